"""Custom autograd.Functions keep their backward (one HOP, two subgraphs), traced once."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase
from helpers import check_gradients, graph
from torch import nn

import predispatch
from predispatch.errors import AutogradFunctionError, DataDependentError
from predispatch.passes import mutable_ops, raw_toggles

CALLS = {"forward": 0, "backward": 0}


# --- Functions ---------------------------------------------------------------------------------


class StraightThrough(torch.autograd.Function):
    """round() forward; the gradient passes straight through where |x| <= 1 (autograd would give 0)."""

    @staticmethod
    def forward(ctx, x):
        CALLS["forward"] += 1
        ctx.save_for_backward(x)
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        CALLS["backward"] += 1
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1)


class ScaledMul(torch.autograd.Function):
    """save_for_backward of two inputs plus a float attribute on ctx; a non-tensor argument."""

    @staticmethod
    def forward(ctx, x, y, scale):
        ctx.save_for_backward(x, y)
        ctx.scale = scale
        return x * y * scale

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y * ctx.scale, grad * x * ctx.scale, None


class SetupContextLinear(torch.autograd.Function):
    """The `setup_context` style, with a keyword default; backward scales the weight gradient by 0.5."""

    @staticmethod
    def forward(x, weight, bias=None):
        out = x @ weight.t()
        return out if bias is None else out + bias

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_bias = grad.sum(0) if ctx.has_bias else None
        return grad @ weight, 0.5 * grad.t() @ x, grad_bias


class MaskedRelu(torch.autograd.Function):
    """Two outputs, the mask marked non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        mask = (x > 0).to(x.dtype)
        ctx.save_for_backward(mask)
        ctx.mark_non_differentiable(mask)
        return x * mask, mask

    @staticmethod
    def backward(ctx, grad, grad_mask):
        (mask,) = ctx.saved_tensors
        return grad * mask


class OnlyNeeded(torch.autograd.Function):
    """Backward computes only the gradients `ctx.needs_input_grad` asks for."""

    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        grad_x = grad * y * 3 if ctx.needs_input_grad[0] else None
        grad_y = grad * x if ctx.needs_input_grad[1] else None
        return grad_x, grad_y


class SplitUnmaterialized(torch.autograd.Function):
    """`set_materialize_grads(False)`: backward sees None for outputs that got no gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        grad = torch.zeros_like(grad_a if grad_a is not None else grad_b)
        if grad_a is not None:
            grad = grad + 2 * grad_a
        if grad_b is not None:
            grad = grad + 3 * grad_b
        return grad


class ClampGrad(torch.autograd.Function):
    """Identity forward; backward clips the gradient and returns None for the bound tensor and the flag."""

    @staticmethod
    def forward(ctx, x, bound, enabled):
        ctx.save_for_backward(bound)
        ctx.enabled = enabled
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (bound,) = ctx.saved_tensors
        return (torch.minimum(torch.maximum(grad, -bound), bound) if ctx.enabled else grad), None, None


class Stats(torch.autograd.Function):
    """Several outputs mixed with a constant; non-tensor arguments (a tuple, a string)."""

    @staticmethod
    def forward(ctx, x, dims, how):
        ctx.dims, ctx.how, ctx.n = dims, how, x.shape[dims[0]]
        mean = x.mean(dims, keepdim=True)
        return mean, x - mean, "centered"

    @staticmethod
    def backward(ctx, grad_mean, grad_centered, _):
        grad = grad_centered - grad_centered.mean(ctx.dims, keepdim=True)
        return grad + grad_mean / ctx.n * 2, None, None  # custom: twice the true mean gradient


class Outer(torch.autograd.Function):
    """Calls another Function in its forward; only Outer's backward counts (eager: inner runs under no_grad)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return StraightThrough.apply(x) * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.cos(x)


class AddOneInplace(torch.autograd.Function):
    """An in-place Function: mutates its input and says so with `ctx.mark_dirty`."""

    @staticmethod
    def forward(ctx, x):
        x.add_(1)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 5


class OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.exp() + 1


class TensorOnCtx(torch.autograd.Function):
    """A tensor stored as a ctx attribute (not through save_for_backward)."""

    @staticmethod
    def forward(ctx, x):
        ctx.sign = x.sign()
        return x.abs()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.sign * 0.5


# --- modules -----------------------------------------------------------------------------------


class Apply(nn.Module):
    """Calls `function.apply(*pre(x), *extra)`."""

    def __init__(self, function, *extra, pre=lambda x: (x * 2,)):
        super().__init__()
        self.function, self.extra, self.pre = function, extra, pre

    def forward(self, x):
        return self.function.apply(*self.pre(x), *self.extra)


class Ste(nn.Module):
    def forward(self, x):
        return StraightThrough.apply(x * 2) + 1


class ScaledMulModule(nn.Module):
    def forward(self, x, y):
        return ScaledMul.apply(x, y, 0.5)


class CustomLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3))
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return SetupContextLinear.apply(x, self.weight, bias=self.bias), SetupContextLinear.apply(x, self.weight)


class MaskedReluModule(nn.Module):
    def forward(self, x):
        y, mask = MaskedRelu.apply(x)
        return y * 2, mask


class OnlyNeededModule(nn.Module):
    def forward(self, x, y):
        return OnlyNeeded.apply(x, y.detach())


class SplitUnmaterializedModule(nn.Module):
    def forward(self, x):
        a, b = SplitUnmaterialized.apply(x)
        return a.sin()  # b gets no gradient


class ClampGradModule(nn.Module):
    def forward(self, x):
        return ClampGrad.apply(x * 10, torch.full((), 0.5), True) ** 2


class StatsModule(nn.Module):
    def forward(self, x):
        mean, centered, label = Stats.apply(x, (0,), "rows")
        return mean.sum() * centered, label


class Twice(nn.Module):
    def forward(self, x):
        return StraightThrough.apply(x) + StraightThrough.apply(x * 3)


class InNoGrad(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = StraightThrough.apply(x)
        return x * y + StraightThrough.apply(x)


class InEnableGrad(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            with torch.enable_grad():
                y = StraightThrough.apply(x * 2)
            z = y * 3
        return y, z


class Nested(nn.Module):
    def forward(self, x):
        return Outer.apply(x)


class Inplace(nn.Module):
    def forward(self, x):
        h = x * 2
        out = AddOneInplace.apply(h)
        return out * x, h


class OnceDifferentiableModule(nn.Module):
    def forward(self, x):
        return OnceDifferentiable.apply(x)


class TensorOnCtxModule(nn.Module):
    def forward(self, x):
        return TensorOnCtx.apply(x - 0.5)


CASES = {
    "straight_through": (Ste, lambda: (torch.tensor([0.3, 0.6, -0.2, 1.4]),)),
    "save_for_backward_and_attributes": (ScaledMulModule, lambda: (torch.randn(3), torch.randn(3))),
    "setup_context": (CustomLinear, lambda: (torch.randn(2, 3),)),
    "mark_non_differentiable": (MaskedReluModule, lambda: (torch.randn(5),)),
    "needs_input_grad": (OnlyNeededModule, lambda: (torch.randn(3), torch.randn(3))),
    "set_materialize_grads": (SplitUnmaterializedModule, lambda: (torch.randn(3),)),
    "none_gradients": (ClampGradModule, lambda: (torch.randn(4),)),
    "several_outputs_and_constants": (StatsModule, lambda: (torch.randn(3, 2),)),
    "used_twice": (Twice, lambda: (torch.tensor([0.1, 0.4, -0.3]),)),
    "in_no_grad": (InNoGrad, lambda: (torch.tensor([0.1, 0.7, -1.3]),)),
    "in_enable_grad": (InEnableGrad, lambda: (torch.tensor([0.1, 0.7, -1.3]),)),
    "nested": (Nested, lambda: (torch.randn(3),)),
    "mark_dirty": (Inplace, lambda: (torch.randn(3),)),
    "once_differentiable": (OnceDifferentiableModule, lambda: (torch.randn(3),)),
    "tensor_on_ctx": (TensorOnCtxModule, lambda: (torch.randn(4),)),
}


@pytest.mark.parametrize("outer_no_grad", [False, True], ids=["grad", "outer_no_grad"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case, outer_no_grad):
    torch.manual_seed(0)
    module_cls, make_args = CASES[case]
    ep = check_gradients(module_cls(), make_args(), outer_no_grad=outer_no_grad)
    assert raw_toggles(ep.graph_module) == []
    assert ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply) or case in (
        "in_no_grad",
        "in_enable_grad",
    )
