"""Custom autograd.Functions keep their backward (one HOP, two subgraphs), traced once."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from expecttest import TestCase
from helpers import assert_same_tree, check_gradients, graph, stable_message as message
from torch import nn

import predispatch
from predispatch import _torch_internals as ti
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


class Views(torch.autograd.Function):
    """Outputs that alias the input (itself, a view, a transpose): eager returns views, the program copies."""

    @staticmethod
    def forward(ctx, x):
        return x, x.view(-1), x.t()

    @staticmethod
    def backward(ctx, grad_x, grad_flat, grad_t):
        return grad_x * 2 + grad_flat.view(2, 3) * 3 + grad_t.t() * 4


class WeightedSum(torch.autograd.Function):
    """Tensors inside a list argument: inputs of forward, but not differentiated by autograd."""

    @staticmethod
    def forward(ctx, x, weights):
        ctx.save_for_backward(*weights)
        return sum(w * x for w in weights)

    @staticmethod
    def backward(ctx, grad):
        return grad * sum(ctx.saved_tensors) * 2, None


class ArgMax(torch.autograd.Function):
    """An integer output next to a floating one."""

    @staticmethod
    def forward(ctx, x):
        index = x.argmax(0, keepdim=True)
        ctx.save_for_backward(index)
        ctx.n = x.numel()
        return x.gather(0, index) * 2, index

    @staticmethod
    def backward(ctx, grad, grad_index):
        (index,) = ctx.saved_tensors
        return torch.zeros(ctx.n).scatter(0, index, grad * 3)


class Float32Matmul(torch.autograd.Function):
    """`custom_fwd(cast_inputs=...)`: under autocast, forward runs in float32 with autocast off."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad @ b.t(), a.t() @ grad


class ScaleByMax(torch.autograd.Function):
    """`.item()` used as a number (not to branch): captured as at top level."""

    @staticmethod
    def forward(ctx, x):
        return x / x.abs().max().item()

    @staticmethod
    def backward(ctx, grad):
        return grad * grad.abs().max().item()


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
        if not ti.HAS.apply_keywords:  # torch < 2.13's own apply refuses keywords (eager TypeError)
            return SetupContextLinear.apply(x, self.weight, self.bias), SetupContextLinear.apply(x, self.weight)
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


class ViewsModule(nn.Module):
    def forward(self, x):
        a, b, c = Views.apply(x * 1)
        return a + 1, b * 2, c.sum(0)


class WeightedSumModule(nn.Module):
    def forward(self, x):
        return WeightedSum.apply(x, [x.sin(), x.cos()])


class ArgMaxModule(nn.Module):
    def forward(self, x):
        return ArgMax.apply(x)


class AutocastCustomFwd(nn.Module):
    def forward(self, x, y):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return Float32Matmul.apply(x @ y, y)


class ScaleByMaxModule(nn.Module):
    def forward(self, x):
        return ScaleByMax.apply(x + 1)


class InplaceInNoGrad(nn.Module):
    """An in-place Function under no_grad: h keeps its history, as any no_grad mutation does."""

    def forward(self, x):
        h = x * 2
        with torch.no_grad():
            AddOneInplace.apply(h)
        return h * x


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
    "outputs_alias_input": (ViewsModule, lambda: (torch.randn(2, 3),)),
    "tensors_in_a_list": (WeightedSumModule, lambda: (torch.randn(3),)),
    "integer_output": (ArgMaxModule, lambda: (torch.randn(5),)),
    "autocast_custom_fwd": (AutocastCustomFwd, lambda: (torch.randn(3, 3), torch.randn(3, 3))),
    "item_as_number": (ScaleByMaxModule, lambda: (torch.randn(4),)),
    "mark_dirty_in_no_grad": (InplaceInNoGrad, lambda: (torch.randn(3),)),
}


@pytest.mark.parametrize("outer_no_grad", [False, True], ids=["grad", "outer_no_grad"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case, outer_no_grad):
    torch.manual_seed(0)
    module_cls, make_args = CASES[case]
    ep = check_gradients(module_cls(), make_args(), outer_no_grad=outer_no_grad)
    assert raw_toggles(ep.graph_module) == []
    hops = [n for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
            if n.target is torch.ops.higher_order.autograd_function_apply]
    assert hops


# --- the straight-through estimator: the point of keeping backward ------------------------------


class InlinedSte(nn.Module):
    """What an export that inlines forward and drops backward computes."""

    def forward(self, x):
        return (x * 2).round() + 1


def _input_grad(module, x):
    x = x.detach().clone().requires_grad_()
    module(x).sum().backward()
    return x.grad


def test_straight_through_gradients_are_eager_not_autograd_through_forward():
    x = torch.tensor([0.3, 0.6, -0.2, 1.4])
    exported = _input_grad(predispatch.export(Ste(), (x,)).module(), x)
    torch.testing.assert_close(exported, _input_grad(Ste(), x), rtol=0, atol=0)
    torch.testing.assert_close(exported, torch.tensor([2.0, 0.0, 2.0, 0.0]), rtol=0, atol=0)
    assert torch.equal(_input_grad(InlinedSte(), x), torch.zeros(4))  # round's true derivative


def test_trained_program_follows_eager():
    """A few SGD steps through the program move the weights exactly as eager's do."""
    torch.manual_seed(0)
    eager = CustomLinear()
    program = predispatch.export(eager, (torch.randn(2, 3),)).module()
    for model in (eager, program):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1)
        for _ in range(3):
            optimizer.zero_grad()
            a, b = model(torch.randn(2, 3))
            (a.square().sum() + b.sum()).backward()
            optimizer.step()
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(program.state_dict()[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["straight_through", "mark_dirty", "in_no_grad", "autocast_custom_fwd"])
def test_save_and_load_keep_backward(case, tmp_path):
    torch.manual_seed(0)
    module_cls, make_args = CASES[case]
    module, args = module_cls(), make_args()
    path = tmp_path / "program.pd"
    predispatch.save(predispatch.export(module, args), path)
    loaded = predispatch.load(path).module()
    grads = []
    for model in (loaded, module):
        inputs = [a.clone().requires_grad_() for a in args]
        out = model(*inputs)
        sum(t.sum() for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad).backward()
        grads.append([a.grad for a in inputs])
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_torch_compile_of_the_program_keeps_backward():
    """torch.compile(fullgraph=True) traces the captured Function, custom backward included, into
    one graph: one frame, no graph break, and the straight-through gradient where |2x| <= 1
    (autograd through round() would give 0 everywhere)."""
    import torch._dynamo.testing

    x = torch.tensor([0.3, 0.6, -0.2, 1.4])
    program = predispatch.export(Ste(), (x,)).module()
    assert torch._dynamo.explain(program)(x).graph_break_count == 0
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(program, backend=counter, fullgraph=True)
    grad = _input_grad(compiled, x)
    assert counter.frame_count == 1
    torch.testing.assert_close(grad, torch.tensor([2.0, 0.0, 2.0, 0.0]), rtol=0, atol=0)
    torch.testing.assert_close(grad, _input_grad(Ste(), x), rtol=0, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_reexport_of_the_program_is_stable(case):
    """Exporting `ep.module()` meets torch's `autograd_function_apply`: captured again, not inlined."""
    torch.manual_seed(0)
    module_cls, make_args = CASES[case]
    args = make_args()
    ep = predispatch.export(module_cls(), args)
    again = check_gradients(ep.module(), args)
    assert str(again) == str(ep)


class Library(nn.Module):
    """Exports its inner block while the outer export traces it (a nested export)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.inner = Ste()

    def forward(self, x):
        h = self.pre(x)
        return predispatch.export(self.inner, (h,)).module()(h)


class FunctionInCond(nn.Module):
    """torch.cond traces its branches with Dynamo, which hands the Function over as autograd_function_apply."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.2, -0.7, 0.4]))

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: StraightThroughPure.apply(t * self.weight) * 2, lambda t: t * 3, (x,))


class StraightThroughPure(torch.autograd.Function):
    """StraightThrough without the call counter (Dynamo refuses to trace the global dict update)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1) * 3


def test_nested_export_keeps_backward():
    ep = check_gradients(Library(), (torch.randn(2, 3),))
    assert ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply)


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["true_branch", "false_branch"])
def test_function_in_cond_branch_keeps_backward(sign):
    x = torch.tensor([1.5, 2.0, 0.5]) * sign
    ep = check_gradients(FunctionInCond(), (x,))
    (branch,) = [m for name, m in ep.graph_module.named_children() if name.startswith("true_graph")]
    assert branch.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply)
    assert mutable_ops(ep.graph_module) == []


@pytest.mark.parametrize("size", [5, 9])
def test_dynamic_batch(size):
    """Subgraphs are traced on the symbolic shapes; a shape on ctx (`ctx.n`) stays symbolic."""
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = predispatch.export(StatsModule(), (torch.randn(4, 2),), dynamic_shapes={"x": {0: batch}})
    x = torch.randn(size, 2)
    assert_same_tree(_grads(ep.module(), x), _grads(StatsModule(), x))


def _grads(module, x):
    x = x.detach().clone().requires_grad_()
    out, _label = module(x)
    out.sum().backward()
    return out, x.grad

# --- traced once ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("module_cls", "calls"), [(Ste, 1), (Twice, 2), (InNoGrad, 2)], ids=["once", "twice", "regions"])
def test_forward_and_backward_run_once_per_call(module_cls, calls):
    """Each Function's forward and backward run once per call, as the module's forward runs once per export."""
    CALLS.update(forward=0, backward=0)
    predispatch.export(module_cls(), (torch.randn(3),))
    assert CALLS == {"forward": calls, "backward": calls}


class Counting(nn.Module):
    """Counts its forward calls: an export runs the user's forward exactly once.

    The count lives on the class: export puts back what forward writes on the module itself."""

    passes = 0

    def forward(self, x):
        type(self).passes += 1
        return StraightThrough.apply(x)


def test_module_forward_runs_once_per_export():
    module, Counting.passes = Counting(), 0
    ep = predispatch.export(module, (torch.randn(3),))
    assert Counting.passes == 1
    (node,) = ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply)
    assert node.args[0].target.startswith("straight_through_fwd")
    assert mutable_ops(ep.graph_module) == []


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_reentrant_checkpoint_runs_plainly(use_reentrant):
    """torch.utils.checkpoint's Function is not captured: its gradient is the forward's own
    (eager's gradients either way; the non-reentrant variant applies no Function)."""

    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(lambda t: self.lin(t).relu(), x, use_reentrant=use_reentrant)

    ep = check_gradients(Checkpointed(), (torch.randn(2, 3),))
    assert not ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply)


def test_export_leaves_function_apply_as_found():
    """Nothing export hooks stays behind: `Function.apply`, the ctx class, the Functions' metaclass."""
    apply = torch.autograd.Function.__dict__["apply"]
    below = {k: v for k, v in vars(torch.autograd.function._SingleLevelFunction).items()}
    meta = dict(vars(torch.autograd.function.FunctionMeta))
    ctx = dict(vars(torch.autograd.function.BackwardCFunction))
    numpy = torch.Tensor.numpy
    predispatch.export(Ste(), (torch.randn(3),))
    with pytest.raises(AutogradFunctionError):
        predispatch.export(Apply(NumpyBackward), (torch.randn(3),))
    assert torch.autograd.Function.__dict__["apply"] is apply
    assert dict(vars(torch.autograd.function._SingleLevelFunction)) == below
    assert dict(vars(torch.autograd.function.FunctionMeta)) == meta
    assert dict(vars(torch.autograd.function.BackwardCFunction)) == ctx
    assert torch.Tensor.numpy is numpy


# --- captured by where the call runs, not by where the class is defined -----------------------


#: `apply` bound before any export, as libraries write it (`round_ste = RoundSte.apply`).
straight_through = StraightThrough.apply


class BoundApply(nn.Module):
    def forward(self, x):
        return straight_through(x * 2) + 1


class TorchNamedStraightThrough(torch.autograd.Function):
    """A user's Function whose class claims a `torch.*` module (vendored code, a torch extension)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1)


TorchNamedStraightThrough.__module__ = "torch.nn.vendored_ops"


class TorchNamed(nn.Module):
    def forward(self, x):
        return TorchNamedStraightThrough.apply(x * 2) + 1


def _function_applies(ep):
    return ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply)


@pytest.mark.parametrize("module_cls", [BoundApply, TorchNamed], ids=["apply_bound_before_export", "class_under_torch"])
def test_captured_wherever_defined(module_cls):
    """Before: both were inlined (graph `round`, gradient zero); now the backward is kept.

    An `apply` bound before export is torch's C++ apply itself on torch >= 2.14 (before this
    change refused there by name): the call is seen inside torch's apply (Note [Seeing every
    apply]), so it is captured on every release."""
    x = torch.tensor([0.3, 0.6, -0.2, 1.4])
    ep = check_gradients(module_cls(), (x,))
    assert len(_function_applies(ep)) == 1
    torch.testing.assert_close(_input_grad(ep.module(), x), torch.tensor([2.0, 0.0, 2.0, 0.0]), rtol=0, atol=0)


# --- however `apply` was reached ------------------------------------------------------------------


class ScaleGrad(torch.autograd.Function):
    """A leading non-tensor argument (what `functools.partial` binds); backward scales the gradient."""

    @staticmethod
    def forward(ctx, scale, x):
        ctx.scale = scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, grad * ctx.scale


#: Applies bound when this module was imported, as research code and libraries bind them.
ste_apply, linear_apply, masked_relu_apply = StraightThrough.apply, SetupContextLinear.apply, MaskedRelu.apply
add_one_apply, scale_grad_apply = AddOneInplace.apply, ScaleGrad.apply


def _bound() -> dict[str, object]:
    """The five applies `Reached` calls, each looked up now (in forward, in `__init__`)."""
    return {
        "ste": StraightThrough.apply,
        "linear": SetupContextLinear.apply,
        "masked_relu": MaskedRelu.apply,
        "add_one": AddOneInplace.apply,
        "scale_grad": ScaleGrad.apply,
    }


def _through_helper(op, *args):
    """A library helper handed the op as a callable."""
    return op(*args)


class Reached(nn.Module):
    """Five Functions (old and new style, a default argument, a non-differentiable output, an
    in-place one, a non-tensor argument), each `apply` reached as `idiom` says."""

    def __init__(self, idiom: str):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5]]))
        self.idiom = idiom
        if idiom == "bound_in_init":
            self.ste, self.linear, self.masked_relu, self.add_one, self.scale_grad = _bound().values()
        elif idiom == "kept_in_a_dict":
            self.table = _bound()
        elif idiom == "kept_in_a_list":
            self.table = list(_bound().values())
        elif idiom == "wrapped_in_partial":
            self.partials = {
                "ste": functools.partial(StraightThrough.apply),
                "linear": functools.partial(SetupContextLinear.apply),
                "masked_relu": functools.partial(MaskedRelu.apply),
                "add_one": functools.partial(AddOneInplace.apply),
                "scale_grad": functools.partial(ScaleGrad.apply, 3.0),  # the scale bound in the partial
            }

    def op(self, name: str):
        if self.idiom == "called_in_forward":
            return _bound()[name]
        if self.idiom == "bound_at_module_level":
            return globals()[f"{name}_apply"]
        if self.idiom == "bound_in_init":
            return getattr(self, name)
        if self.idiom == "kept_in_a_dict":
            return self.table[name]
        if self.idiom == "kept_in_a_list":
            return self.table[list(_bound()).index(name)]
        if self.idiom == "wrapped_in_partial":
            return self.partials[name]
        assert self.idiom == "passed_to_a_helper", self.idiom
        return functools.partial(_through_helper, _bound()[name])

    def forward(self, x):
        scale = () if self.idiom == "wrapped_in_partial" else (3.0,)
        h = self.op("ste")(x * 2)
        h = self.op("linear")(h, self.weight)  # bias: its default
        h, mask = self.op("masked_relu")(h)
        h = h * 1.0
        self.op("add_one")(h)  # in place
        return self.op("scale_grad")(*scale, h), mask


IDIOMS = ["called_in_forward", "bound_at_module_level", "bound_in_init", "kept_in_a_dict", "kept_in_a_list",
          "wrapped_in_partial", "passed_to_a_helper"]


@pytest.mark.parametrize("idiom", IDIOMS)
def test_every_idiom_of_reaching_apply_is_captured(idiom):
    """Before: on torch 2.14 and 2.15 every idiom but a call in forward (or through a helper that
    looks `apply` up) was refused ("bound before export"); now each gives the program a call in
    forward gives, printed the same, with eager's gradients."""
    x = torch.tensor([[0.3, 0.6, -0.2], [1.4, -0.7, 0.9]])
    ep = check_gradients(Reached(idiom), (x,))
    assert len(_function_applies(ep)) == 5
    assert str(ep) == str(predispatch.export(Reached("called_in_forward"), (x,)))


#: StraightThroughPure's apply bound at module level, for a `torch.cond` arm.
pure_apply = StraightThroughPure.apply


class BoundInCond(nn.Module):
    """A bound apply inside a `torch.cond` arm (Dynamo traces the arm), bound at module level or in `__init__`."""

    def __init__(self, idiom: str):
        super().__init__()
        self.weight = nn.Parameter(torch.tensor([0.2, -0.7, 0.4]))
        self.idiom = idiom
        self.op = StraightThroughPure.apply

    def forward(self, x):
        if self.idiom == "bound_at_module_level":
            return torch.cond(x.sum() > 0, lambda t: pure_apply(t * self.weight) * 2, lambda t: t * 3, (x,))
        return torch.cond(x.sum() > 0, lambda t: self.op(t * self.weight) * 2, lambda t: t * 3, (x,))


#: torch 2.11's Dynamo cannot trace a Function's `apply` kept as a module attribute (`self.op =
#: MyFn.apply`) inside a `torch.cond` arm (eager runs it); later releases can.  README's table says so.
_DYNAMO_211 = pytest.mark.xfail(
    ti.TORCH < (2, 12), strict=True, raises=predispatch.errors.TraceError,
    reason="torch 2.11's Dynamo: GetAttrVariable(AutogradFunctionVariable(), setup_context) has no type",
)


@pytest.mark.parametrize("idiom", ["bound_at_module_level", pytest.param("bound_in_init", marks=_DYNAMO_211)])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["true_branch", "false_branch"])
def test_bound_apply_in_cond_branch_keeps_backward(sign, idiom):
    x = torch.tensor([1.5, 2.0, 0.5]) * sign
    ep = check_gradients(BoundInCond(idiom), (x,))
    (branch,) = [m for name, m in ep.graph_module.named_children() if name.startswith("true_graph")]
    assert branch.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply)
    assert str(ep) == str(predispatch.export(FunctionInCond(), (x,)))


def test_bound_apply_in_repeated_block_is_captured_in_the_shared_body(monkeypatch):
    """A repeated block applying an `apply` bound at module level: traced twice, compared, its body
    shared by the later layers (test_dedup.py, whose small-body threshold it takes), the Function
    captured inside it."""
    from test_dedup import Block, Stack, _replayed

    from predispatch.trace.dedup import share

    monkeypatch.setattr(share, "MIN_BODY_OPS", 4)

    class BoundInBlock(Block):
        def forward(self, x):
            return super().forward(ste_apply(self.norm(x)))

    torch.manual_seed(0)
    ep = check_gradients(Stack(4, BoundInBlock), (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.3"]
    bodies = [m for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule) and m is not ep.graph_module]
    assert any(m.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply) for m in bodies)


def test_torch_apply_reached_directly_is_captured():
    """torch's C++ apply called with no Python around it (`_C._FunctionBase.apply`), on every
    release: before, the forward detector refused it; now it is captured like any call."""
    cpp_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, StraightThrough)

    class Direct(nn.Module):
        def forward(self, x):
            return cpp_apply(x * 2) + 1

    x = torch.tensor([0.3, 0.6, -0.2, 1.4])
    ep = check_gradients(Direct(), (x,))
    assert str(ep) == str(predispatch.export(BoundApply(), (x,)))


def test_other_threads_keep_torch_apply_during_export():
    """A Function applied on another thread while export traces runs as torch runs it, its
    forward once per call, never redirected (Note [Export touches only its own thread])."""
    import threading

    seen: list = []
    started, release = threading.Event(), threading.Event()

    class Waits(nn.Module):
        def forward(self, x):
            started.set()
            release.wait(10)
            return ste_apply(x * 2)

    def other():
        started.wait(10)
        try:
            x = torch.tensor([0.3, 1.6], requires_grad=True)
            y = ste_apply(x)
            y.sum().backward()
            seen.append((y.detach(), x.grad))
        finally:
            release.set()

    thread = threading.Thread(target=other)
    thread.start()
    ep = predispatch.export(Waits(), (torch.tensor([0.3, 0.6]),))
    thread.join(10)
    (y, grad), = seen
    assert torch.equal(y, torch.tensor([0.0, 2.0])) and torch.equal(grad, torch.tensor([1.0, 0.0]))
    assert len(_function_applies(ep)) == 1


@torch.library.custom_op("predispatch_function_test::round_ste", mutates_args=())
def round_ste(x: torch.Tensor) -> torch.Tensor:
    return x.round()


@round_ste.register_fake
def _round_ste_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


round_ste.register_autograd(lambda ctx, grad: grad * 3)


class CustomOpModule(nn.Module):
    def forward(self, x):
        return round_ste(x * 2) + 1


def test_custom_op_autograd_kernel_is_left_to_torch():
    """The op's autograd kernel applies a Function from inside the dispatcher: the op is the node."""
    x = torch.tensor([0.3, 0.6, -0.2, 1.4])
    ep = check_gradients(CustomOpModule(), (x,))
    assert not _function_applies(ep)
    assert [n.target for n in ep.graph.find_nodes(op="call_function", target=torch.ops.predispatch_function_test.round_ste.default)]
    torch.testing.assert_close(_input_grad(ep.module(), x), torch.full((4,), 6.0), rtol=0, atol=0)


class DirichletSample(nn.Module):
    """torch.distributions' reparametrized Dirichlet sample applies a Function (`_Dirichlet`)."""

    def forward(self, concentration):
        return torch.distributions.Dirichlet(concentration.exp(), validate_args=False).rsample()


def test_torch_library_function_keeps_its_backward():
    """Before: inlined, the program's backward raised "derivative for aten::_sample_dirichlet is not implemented"."""
    concentration = torch.randn(4)
    ep = predispatch.export(DirichletSample(), (concentration,))
    assert len(_function_applies(ep)) == 1

    def run(module):
        c = concentration.clone().requires_grad_()
        torch.manual_seed(3)
        out = module(c)
        out.backward(torch.arange(4.0))
        return out.detach(), c.grad

    assert_same_tree(run(ep.module()), run(DirichletSample()))


# --- refused, with the Function and the line named ------------------------------------------------


HERE = __file__


class NumpyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return torch.from_numpy(grad.numpy() * 2)


class BranchyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if grad.sum() > 0:
            return grad
        return -grad


class MutatesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        return x + 1

    @staticmethod
    def backward(ctx, grad):
        return grad


class MutatesSaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x.mul_(2)
        return grad * x


class TooFewGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x * y

    @staticmethod
    def backward(ctx, grad):
        return grad


class DirtyNotReturned(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x + 1

    @staticmethod
    def backward(ctx, grad):
        return grad


class Closure(nn.Module):
    """forward reads the module's weight without taking it as an argument."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        module = self

        class ScaleByWeight(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * module.weight

            @staticmethod
            def backward(ctx, grad):
                return grad

        self.function = ScaleByWeight

    def forward(self, x):
        return self.function.apply(x)


def refused(module, error=AutogradFunctionError) -> str:
    with pytest.raises(error) as info:
        predispatch.export(module, (torch.randn(3),))
    return message(info.value)


class Refusals(TestCase):
    maxDiff = None

    def test_backward_not_traceable(self):
        self.assertExpectedInline(refused(Apply(NumpyBackward)), """\
autograd.Function NumpyBackward (backward): backward leaves torch: it calls `.numpy()` on a tensor (at test_autograd_function.py:N (return torch.from_numpy(grad.numpy() * 2))); export traces it on fake tensors, which hold no data, so what numpy computes cannot be captured.
  at test_autograd_function.py:N (def backward(ctx, grad):)
  fix: move the part that leaves torch into a torch.library.custom_op (@torch.library.custom_op("mylib::name", mutates_args=())) with a fake kernel (@name.register_fake, computing only the output's shape and dtype) and its gradient (name.register_autograd); call it from the Function, or write the Function with torch operations only.
  see docs/errors.md#autogradfunctionerror""")

    def test_data_dependent_backward(self):
        self.assertExpectedInline(refused(Apply(BranchyBackward), DataDependentError), """\
autograd.Function BranchyBackward (backward): backward branches on, or converts, a value inside a tensor, which export cannot know (it traces shapes, not values).
  at test_autograd_function.py:N (if grad.sum() > 0:)
  fix: make the backward static, compute both sides and pick with torch.where, or move the data-dependent part into a torch.library.custom_op.
  see docs/errors.md#datadependenterror""")

    def test_input_mutated_without_mark_dirty(self):
        self.assertExpectedInline(refused(Apply(MutatesInput)), """\
autograd.Function MutatesInput (forward): forward changes its input 'x' in place without ctx.mark_dirty, so autograd (eager and exported) would compute wrong gradients.
  at test_autograd_function.py:N (def forward(ctx, x):)
  fix: call ctx.mark_dirty(x) and return x, or compute out of place (x = x * 2).
  see docs/errors.md#autogradfunctionerror""")

    def test_saved_tensor_mutated_in_backward(self):
        self.assertExpectedInline(refused(Apply(MutatesSaved)), """\
autograd.Function MutatesSaved (backward): backward changes a saved tensor in place, which a functional graph cannot do.
  at test_autograd_function.py:N (def backward(ctx, grad):)
  fix: compute out of place in backward (y = x * 2 instead of x.mul_(2)).
  see docs/errors.md#autogradfunctionerror""")

    def test_wrong_number_of_gradients(self):
        self.assertExpectedInline(refused(Apply(TooFewGradients, pre=lambda x: (x, x * 2))), """\
autograd.Function TooFewGradients (backward): backward returned 1 gradient(s) for the 2 arguments of forward.
  at test_autograd_function.py:N (def backward(ctx, grad):)
  fix: return one gradient per forward argument (None for arguments without one).
  see docs/errors.md#autogradfunctionerror""")

    def test_mark_dirty_on_a_tensor_not_returned(self):
        self.assertExpectedInline(refused(Apply(DirtyNotReturned)), """\
autograd.Function DirtyNotReturned (forward): ctx.mark_dirty was given an input that forward does not return.
  at test_autograd_function.py:N (def forward(ctx, x):)
  fix: mark only inputs that forward changes in place, and return them from forward (as eager requires).
  see docs/errors.md#autogradfunctionerror""")

    def test_closure_over_a_weight(self):
        self.assertExpectedInline(refused(Closure()), """\
autograd.Function Closure.__init__.<locals>.ScaleByWeight (forward): forward reads a tensor that is not one of its arguments (a closure over a module weight or an earlier result), which would be frozen into the program.
  at test_autograd_function.py:N (def forward(ctx, x):)
  fix: pass the tensor to ScaleByWeight.apply(...) as an argument and return a gradient for it from backward.
  see docs/errors.md#autogradfunctionerror""")


# --- goldens ---------------------------------------------------------------------------------------


def exported(case: str) -> str:
    torch.manual_seed(0)
    module_cls, make_args = CASES[case]
    return graph(predispatch.export(module_cls(), make_args()))


class Goldens(TestCase):
    maxDiff = None

    def test_straight_through(self):
        self.assertExpectedInline(exported("straight_through"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[4]"):
        mul: "f32[4]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
        straight_through_fwd_0 = self.straight_through_fwd_0
        straight_through_bwd_0 = self.straight_through_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(straight_through_fwd_0, straight_through_bwd_0, mul, non_differentiable_idx = [], saved_for_backward_idx = [0]);  straight_through_fwd_0 = straight_through_bwd_0 = mul = None
        round_1: "f32[4]" = autograd_function_apply[0];  autograd_function_apply = None
        add: "f32[4]" = torch.ops.aten.add.Tensor(round_1, 1);  round_1 = None
        return (add,)

    class straight_through_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[4]"):
            round_1: "f32[4]" = torch.ops.aten.round.default(x)
            return ((round_1,), (x,))

    class straight_through_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[4]", saved_x: "f32[4]"):
            abs_1: "f32[4]" = torch.ops.aten.abs.default(saved_x);  saved_x = None
            le: "b8[4]" = torch.ops.aten.le.Scalar(abs_1, 1);  abs_1 = None
            mul: "f32[4]" = torch.ops.aten.mul.Tensor(grad_out, le);  grad_out = le = None
            return (mul,)""")

    def test_save_for_backward_and_attributes(self):
        self.assertExpectedInline(exported("save_for_backward_and_attributes"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]", y: "f32[3]"):
        scaled_mul_fwd_0 = self.scaled_mul_fwd_0
        scaled_mul_bwd_0 = self.scaled_mul_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(scaled_mul_fwd_0, scaled_mul_bwd_0, x, y, non_differentiable_idx = [], saved_for_backward_idx = [0, 1]);  scaled_mul_fwd_0 = scaled_mul_bwd_0 = x = y = None
        mul_1: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
        return (mul_1,)

    class scaled_mul_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3]", y: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, y)
            mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(mul, 0.5);  mul = None
            return ((mul_1,), (x, y))

    class scaled_mul_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[3]", saved_x: "f32[3]", saved_y: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, saved_y);  saved_y = None
            mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(mul, 0.5);  mul = None
            mul_2: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, saved_x);  grad_out = saved_x = None
            mul_3: "f32[3]" = torch.ops.aten.mul.Tensor(mul_2, 0.5);  mul_2 = None
            return (mul_1, mul_3)""")

    def test_setup_context(self):
        self.assertExpectedInline(exported("setup_context"), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_weight: "f32[4, 3]", p_bias: "f32[4]", x: "f32[2, 3]"):
        setup_context_linear_fwd_0 = self.setup_context_linear_fwd_0
        setup_context_linear_bwd_0 = self.setup_context_linear_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(setup_context_linear_fwd_0, setup_context_linear_bwd_0, x, p_weight, p_bias, non_differentiable_idx = [], saved_for_backward_idx = [0, 1]);  setup_context_linear_fwd_0 = setup_context_linear_bwd_0 = p_bias = None
        add: "f32[2, 4]" = autograd_function_apply[0];  autograd_function_apply = None
        setup_context_linear_fwd_1 = self.setup_context_linear_fwd_1
        setup_context_linear_bwd_1 = self.setup_context_linear_bwd_1
        autograd_function_apply_1 = torch.ops.higher_order.autograd_function_apply(setup_context_linear_fwd_1, setup_context_linear_bwd_1, x, p_weight, non_differentiable_idx = [], saved_for_backward_idx = [0, 1]);  setup_context_linear_fwd_1 = setup_context_linear_bwd_1 = x = p_weight = None
        matmul: "f32[2, 4]" = autograd_function_apply_1[0];  autograd_function_apply_1 = None
        return (add, matmul)

    class setup_context_linear_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[2, 3]", weight: "f32[4, 3]", bias: "f32[4]"):
            t: "f32[3, 4]" = torch.ops.aten.t.default(weight)
            matmul: "f32[2, 4]" = torch.ops.aten.matmul.default(x, t);  t = None
            add: "f32[2, 4]" = torch.ops.aten.add.Tensor(matmul, bias);  matmul = bias = None
            return ((add,), (x, weight))

    class setup_context_linear_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[2, 4]", saved_x: "f32[2, 3]", saved_weight: "f32[4, 3]"):
            sum_1: "f32[4]" = torch.ops.aten.sum.dim_IntList(grad_out, [0])
            matmul: "f32[2, 3]" = torch.ops.aten.matmul.default(grad_out, saved_weight);  saved_weight = None
            t: "f32[4, 2]" = torch.ops.aten.t.default(grad_out);  grad_out = None
            mul: "f32[4, 2]" = torch.ops.aten.mul.Tensor(t, 0.5);  t = None
            matmul_1: "f32[4, 3]" = torch.ops.aten.matmul.default(mul, saved_x);  mul = saved_x = None
            return (matmul, matmul_1, sum_1)

    class setup_context_linear_fwd_1(torch.nn.Module):
        def forward(self, x: "f32[2, 3]", weight: "f32[4, 3]"):
            t: "f32[3, 4]" = torch.ops.aten.t.default(weight)
            matmul: "f32[2, 4]" = torch.ops.aten.matmul.default(x, t);  t = None
            return ((matmul,), (x, weight))

    class setup_context_linear_bwd_1(torch.nn.Module):
        def forward(self, grad_out: "f32[2, 4]", saved_x: "f32[2, 3]", saved_weight: "f32[4, 3]"):
            matmul: "f32[2, 3]" = torch.ops.aten.matmul.default(grad_out, saved_weight);  saved_weight = None
            t: "f32[4, 2]" = torch.ops.aten.t.default(grad_out);  grad_out = None
            mul: "f32[4, 2]" = torch.ops.aten.mul.Tensor(t, 0.5);  t = None
            matmul_1: "f32[4, 3]" = torch.ops.aten.matmul.default(mul, saved_x);  mul = saved_x = None
            return (matmul, matmul_1)""")

    def test_mark_non_differentiable(self):
        self.assertExpectedInline(exported("mark_non_differentiable"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[5]"):
        masked_relu_fwd_0 = self.masked_relu_fwd_0
        masked_relu_bwd_0 = self.masked_relu_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(masked_relu_fwd_0, masked_relu_bwd_0, x, non_differentiable_idx = [1], saved_for_backward_idx = [0]);  masked_relu_fwd_0 = masked_relu_bwd_0 = x = None
        mul: "f32[5]" = autograd_function_apply[0]
        _to_copy: "f32[5]" = autograd_function_apply[1];  autograd_function_apply = None
        mul_1: "f32[5]" = torch.ops.aten.mul.Tensor(mul, 2);  mul = None
        return (mul_1, _to_copy)

    class masked_relu_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[5]"):
            gt: "b8[5]" = torch.ops.aten.gt.Scalar(x, 0)
            _assert_tensor_metadata = torch.ops.aten._assert_tensor_metadata.default(gt, None, None, torch.bool, device = device(type='cpu'), layout = torch.strided);  _assert_tensor_metadata = None
            _to_copy: "f32[5]" = torch.ops.aten._to_copy.default(gt, dtype = torch.float32);  gt = None
            mul: "f32[5]" = torch.ops.aten.mul.Tensor(x, _to_copy);  x = None
            return ((mul, _to_copy), (_to_copy,))

    class masked_relu_bwd_0(torch.nn.Module):
        def forward(self, grad_out_0: "f32[5]", grad_out_1: "f32[5]", saved_0: "f32[5]"):
            mul: "f32[5]" = torch.ops.aten.mul.Tensor(grad_out_0, saved_0);  grad_out_0 = saved_0 = None
            return (mul,)""")

    def test_needs_input_grad(self):
        self.assertExpectedInline(exported("needs_input_grad"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]", y: "f32[3]"):
        detach: "f32[3]" = torch.ops.aten.detach.default(y);  y = None
        only_needed_fwd_0 = self.only_needed_fwd_0
        only_needed_bwd_0 = self.only_needed_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(only_needed_fwd_0, only_needed_bwd_0, x, detach, non_differentiable_idx = [], saved_for_backward_idx = [0, 1]);  only_needed_fwd_0 = only_needed_bwd_0 = x = detach = None
        mul: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
        return (mul,)

    class only_needed_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3]", y: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, y)
            return ((mul,), (x, y))

    class only_needed_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[3]", saved_x: "f32[3]", saved_y: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, saved_y);  saved_y = None
            mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(mul, 3);  mul = None
            mul_2: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, saved_x);  grad_out = saved_x = None
            return (mul_1, mul_2)""")

    def test_set_materialize_grads(self):
        self.assertExpectedInline(exported("set_materialize_grads"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        split_unmaterialized_fwd_0 = self.split_unmaterialized_fwd_0
        split_unmaterialized_bwd_0 = self.split_unmaterialized_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(split_unmaterialized_fwd_0, split_unmaterialized_bwd_0, x, non_differentiable_idx = [], saved_for_backward_idx = []);  split_unmaterialized_fwd_0 = split_unmaterialized_bwd_0 = x = None
        mul: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
        sin: "f32[3]" = torch.ops.aten.sin.default(mul);  mul = None
        return (sin,)

    class split_unmaterialized_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2)
            mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(x, 3);  x = None
            return ((mul, mul_1), ())

    class split_unmaterialized_bwd_0(torch.nn.Module):
        def forward(self, grad_out_0: "f32[3]", grad_out_1: "f32[3]"):
            zeros_like: "f32[3]" = torch.ops.aten.zeros_like.default(grad_out_0, pin_memory = False)
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out_0, 2);  grad_out_0 = None
            add: "f32[3]" = torch.ops.aten.add.Tensor(zeros_like, mul);  zeros_like = mul = None
            mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out_1, 3);  grad_out_1 = None
            add_1: "f32[3]" = torch.ops.aten.add.Tensor(add, mul_1);  add = mul_1 = None
            return (add_1,)""")

    def test_none_gradients(self):
        self.assertExpectedInline(exported("none_gradients"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[4]"):
        mul: "f32[4]" = torch.ops.aten.mul.Tensor(x, 10);  x = None
        full: "f32[]" = torch.ops.aten.full.default([], 0.5, device = device(type='cpu'), pin_memory = False)
        clamp_grad_fwd_0 = self.clamp_grad_fwd_0
        clamp_grad_bwd_0 = self.clamp_grad_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(clamp_grad_fwd_0, clamp_grad_bwd_0, mul, full, non_differentiable_idx = [], saved_for_backward_idx = [0]);  clamp_grad_fwd_0 = clamp_grad_bwd_0 = mul = full = None
        clone: "f32[4]" = autograd_function_apply[0];  autograd_function_apply = None
        pow_1: "f32[4]" = torch.ops.aten.pow.Tensor_Scalar(clone, 2);  clone = None
        return (pow_1,)

    class clamp_grad_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[4]", bound: "f32[]"):
            clone: "f32[4]" = torch.ops.aten.clone.default(x);  x = None
            return ((clone,), (bound,))

    class clamp_grad_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[4]", saved_bound: "f32[]"):
            neg: "f32[]" = torch.ops.aten.neg.default(saved_bound)
            maximum: "f32[4]" = torch.ops.aten.maximum.default(grad_out, neg);  grad_out = neg = None
            minimum: "f32[4]" = torch.ops.aten.minimum.default(maximum, saved_bound);  maximum = saved_bound = None
            return (minimum, None)""")

    def test_several_outputs_and_constants(self):
        self.assertExpectedInline(exported("several_outputs_and_constants"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3, 2]"):
        stats_fwd_0 = self.stats_fwd_0
        stats_bwd_0 = self.stats_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(stats_fwd_0, stats_bwd_0, x, non_differentiable_idx = [], saved_for_backward_idx = []);  stats_fwd_0 = stats_bwd_0 = x = None
        mean: "f32[1, 2]" = autograd_function_apply[0]
        sub: "f32[3, 2]" = autograd_function_apply[1];  autograd_function_apply = None
        sum_1: "f32[]" = torch.ops.aten.sum.default(mean);  mean = None
        mul: "f32[3, 2]" = torch.ops.aten.mul.Tensor(sum_1, sub);  sum_1 = sub = None
        return (mul,)

    class stats_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3, 2]"):
            mean: "f32[1, 2]" = torch.ops.aten.mean.dim(x, [0], True)
            sub: "f32[3, 2]" = torch.ops.aten.sub.Tensor(x, mean);  x = None
            return ((mean, sub), ())

    class stats_bwd_0(torch.nn.Module):
        def forward(self, grad_out_0: "f32[1, 2]", grad_out_1: "f32[3, 2]"):
            mean: "f32[1, 2]" = torch.ops.aten.mean.dim(grad_out_1, [0], True)
            sub: "f32[3, 2]" = torch.ops.aten.sub.Tensor(grad_out_1, mean);  grad_out_1 = mean = None
            div: "f32[1, 2]" = torch.ops.aten.div.Tensor(grad_out_0, 3);  grad_out_0 = None
            mul: "f32[1, 2]" = torch.ops.aten.mul.Tensor(div, 2);  div = None
            add: "f32[3, 2]" = torch.ops.aten.add.Tensor(sub, mul);  sub = mul = None
            return (add,)""")

    def test_used_twice(self):
        self.assertExpectedInline(exported("used_twice"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        straight_through_fwd_0 = self.straight_through_fwd_0
        straight_through_bwd_0 = self.straight_through_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(straight_through_fwd_0, straight_through_bwd_0, x, non_differentiable_idx = [], saved_for_backward_idx = [0]);  straight_through_fwd_0 = straight_through_bwd_0 = None
        round_1: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 3);  x = None
        straight_through_fwd_1 = self.straight_through_fwd_1
        straight_through_bwd_1 = self.straight_through_bwd_1
        autograd_function_apply_1 = torch.ops.higher_order.autograd_function_apply(straight_through_fwd_1, straight_through_bwd_1, mul, non_differentiable_idx = [], saved_for_backward_idx = [0]);  straight_through_fwd_1 = straight_through_bwd_1 = mul = None
        round_2: "f32[3]" = autograd_function_apply_1[0];  autograd_function_apply_1 = None
        add: "f32[3]" = torch.ops.aten.add.Tensor(round_1, round_2);  round_1 = round_2 = None
        return (add,)

    class straight_through_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            round_1: "f32[3]" = torch.ops.aten.round.default(x)
            return ((round_1,), (x,))

    class straight_through_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[3]", saved_x: "f32[3]"):
            abs_1: "f32[3]" = torch.ops.aten.abs.default(saved_x);  saved_x = None
            le: "b8[3]" = torch.ops.aten.le.Scalar(abs_1, 1);  abs_1 = None
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, le);  grad_out = le = None
            return (mul,)

    class straight_through_fwd_1(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            round_1: "f32[3]" = torch.ops.aten.round.default(x)
            return ((round_1,), (x,))

    class straight_through_bwd_1(torch.nn.Module):
        def forward(self, grad_out: "f32[3]", saved_x: "f32[3]"):
            abs_1: "f32[3]" = torch.ops.aten.abs.default(saved_x);  saved_x = None
            le: "b8[3]" = torch.ops.aten.le.Scalar(abs_1, 1);  abs_1 = None
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, le);  grad_out = le = None
            return (mul,)""")

    def test_in_no_grad(self):
        self.assertExpectedInline(exported("in_no_grad"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x);  grad_region_0 = None
        round_1: "f32[3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, round_1);  round_1 = None
        straight_through_fwd_1 = self.straight_through_fwd_1
        straight_through_bwd_1 = self.straight_through_bwd_1
        autograd_function_apply_1 = torch.ops.higher_order.autograd_function_apply(straight_through_fwd_1, straight_through_bwd_1, x, non_differentiable_idx = [], saved_for_backward_idx = [0]);  straight_through_fwd_1 = straight_through_bwd_1 = x = None
        round_2: "f32[3]" = autograd_function_apply_1[0];  autograd_function_apply_1 = None
        add: "f32[3]" = torch.ops.aten.add.Tensor(mul, round_2);  mul = round_2 = None
        return (add,)

    class straight_through_fwd_1(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            round_1: "f32[3]" = torch.ops.aten.round.default(x)
            return ((round_1,), (x,))

    class straight_through_bwd_1(torch.nn.Module):
        def forward(self, grad_out: "f32[3]", saved_x: "f32[3]"):
            abs_1: "f32[3]" = torch.ops.aten.abs.default(saved_x);  saved_x = None
            le: "b8[3]" = torch.ops.aten.le.Scalar(abs_1, 1);  abs_1 = None
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, le);  grad_out = le = None
            return (mul,)

    class grad_region_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            straight_through_fwd_0 = self.straight_through_fwd_0
            straight_through_bwd_0 = self.straight_through_bwd_0
            autograd_function_apply = torch.ops.higher_order.autograd_function_apply(straight_through_fwd_0, straight_through_bwd_0, x, non_differentiable_idx = [], saved_for_backward_idx = [0]);  straight_through_fwd_0 = straight_through_bwd_0 = x = None
            round_1: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
            return (round_1,)

        class straight_through_fwd_0(torch.nn.Module):
            def forward(self, x: "f32[3]"):
                round_1: "f32[3]" = torch.ops.aten.round.default(x)
                return ((round_1,), (x,))

        class straight_through_bwd_0(torch.nn.Module):
            def forward(self, grad_out: "f32[3]", saved_x: "f32[3]"):
                abs_1: "f32[3]" = torch.ops.aten.abs.default(saved_x);  saved_x = None
                le: "b8[3]" = torch.ops.aten.le.Scalar(abs_1, 1);  abs_1 = None
                mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, le);  grad_out = le = None
                return (mul,)""")

    def test_in_enable_grad(self):
        self.assertExpectedInline(exported("in_enable_grad"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled_1 = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x);  grad_region_0 = x = None
        round_1: "f32[3]" = wrap_with_set_grad_enabled_1[0]
        mul_1: "f32[3]" = wrap_with_set_grad_enabled_1[1];  wrap_with_set_grad_enabled_1 = None
        return (round_1, mul_1)

    class grad_region_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            grad_region_1 = self.grad_region_1
            wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(True, grad_region_1, x);  grad_region_1 = x = None
            round_1: "f32[3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
            mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(round_1, 3)
            return (round_1, mul_1)

        class grad_region_1(torch.nn.Module):
            def forward(self, x: "f32[3]"):
                mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
                straight_through_fwd_0 = self.straight_through_fwd_0
                straight_through_bwd_0 = self.straight_through_bwd_0
                autograd_function_apply = torch.ops.higher_order.autograd_function_apply(straight_through_fwd_0, straight_through_bwd_0, mul, non_differentiable_idx = [], saved_for_backward_idx = [0]);  straight_through_fwd_0 = straight_through_bwd_0 = mul = None
                round_1: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
                return (round_1,)

            class straight_through_fwd_0(torch.nn.Module):
                def forward(self, x: "f32[3]"):
                    round_1: "f32[3]" = torch.ops.aten.round.default(x)
                    return ((round_1,), (x,))

            class straight_through_bwd_0(torch.nn.Module):
                def forward(self, grad_out: "f32[3]", saved_x: "f32[3]"):
                    abs_1: "f32[3]" = torch.ops.aten.abs.default(saved_x);  saved_x = None
                    le: "b8[3]" = torch.ops.aten.le.Scalar(abs_1, 1);  abs_1 = None
                    mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, le);  grad_out = le = None
                    return (mul,)""")

    def test_nested(self):
        self.assertExpectedInline(exported("nested"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        outer_fwd_0 = self.outer_fwd_0
        outer_bwd_0 = self.outer_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(outer_fwd_0, outer_bwd_0, x, non_differentiable_idx = [], saved_for_backward_idx = [0]);  outer_fwd_0 = outer_bwd_0 = x = None
        mul: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
        return (mul,)

    class outer_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            round_1: "f32[3]" = torch.ops.aten.round.default(x)
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(round_1, 2);  round_1 = None
            return ((mul,), (x,))

    class outer_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[3]", saved_x: "f32[3]"):
            cos: "f32[3]" = torch.ops.aten.cos.default(saved_x);  saved_x = None
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, cos);  grad_out = cos = None
            return (mul,)""")

    def test_mark_dirty(self):
        self.assertExpectedInline(exported("mark_dirty"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2)
        add_one_inplace_fwd_0 = self.add_one_inplace_fwd_0
        add_one_inplace_bwd_0 = self.add_one_inplace_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(add_one_inplace_fwd_0, add_one_inplace_bwd_0, mul, non_differentiable_idx = [], saved_for_backward_idx = []);  add_one_inplace_fwd_0 = add_one_inplace_bwd_0 = mul = None
        add: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
        mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(add, x);  x = None
        return (mul_1, add)

    class add_one_inplace_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            add: "f32[3]" = torch.ops.aten.add.Tensor(x, 1);  x = None
            return ((add,), ())

    class add_one_inplace_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, 5);  grad_out = None
            return (mul,)""")

    def test_once_differentiable(self):
        self.assertExpectedInline(exported("once_differentiable"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        once_differentiable_fwd_0 = self.once_differentiable_fwd_0
        once_differentiable_bwd_0 = self.once_differentiable_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(once_differentiable_fwd_0, once_differentiable_bwd_0, x, non_differentiable_idx = [], saved_for_backward_idx = [0]);  once_differentiable_fwd_0 = once_differentiable_bwd_0 = x = None
        exp: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
        return (exp,)

    class once_differentiable_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            exp: "f32[3]" = torch.ops.aten.exp.default(x)
            return ((exp,), (x,))

    class once_differentiable_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[3]", saved_x: "f32[3]"):
            exp: "f32[3]" = torch.ops.aten.exp.default(saved_x);  saved_x = None
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, exp);  grad_out = exp = None
            add: "f32[3]" = torch.ops.aten.add.Tensor(mul, 1);  mul = None
            return (add,)""")

    def test_tensor_on_ctx(self):
        self.assertExpectedInline(exported("tensor_on_ctx"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[4]"):
        sub: "f32[4]" = torch.ops.aten.sub.Tensor(x, 0.5);  x = None
        tensor_on_ctx_fwd_0 = self.tensor_on_ctx_fwd_0
        tensor_on_ctx_bwd_0 = self.tensor_on_ctx_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(tensor_on_ctx_fwd_0, tensor_on_ctx_bwd_0, sub, non_differentiable_idx = [], saved_for_backward_idx = []);  tensor_on_ctx_fwd_0 = tensor_on_ctx_bwd_0 = sub = None
        abs_1: "f32[4]" = autograd_function_apply[0];  autograd_function_apply = None
        return (abs_1,)

    class tensor_on_ctx_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[4]"):
            sign: "f32[4]" = torch.ops.aten.sign.default(x)
            abs_1: "f32[4]" = torch.ops.aten.abs.default(x);  x = None
            return ((abs_1,), (sign,))

    class tensor_on_ctx_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[4]", ctx_sign: "f32[4]"):
            mul: "f32[4]" = torch.ops.aten.mul.Tensor(grad_out, ctx_sign);  grad_out = ctx_sign = None
            mul_1: "f32[4]" = torch.ops.aten.mul.Tensor(mul, 0.5);  mul = None
            return (mul_1,)""")

    def test_outputs_alias_input(self):
        self.assertExpectedInline(exported("outputs_alias_input"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[2, 3]"):
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(x, 1);  x = None
        views_fwd_0 = self.views_fwd_0
        views_bwd_0 = self.views_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(views_fwd_0, views_bwd_0, mul, non_differentiable_idx = [], saved_for_backward_idx = []);  views_fwd_0 = views_bwd_0 = mul = None
        clone: "f32[2, 3]" = autograd_function_apply[0]
        clone_1: "f32[6]" = autograd_function_apply[1]
        clone_2: "f32[3, 2]" = autograd_function_apply[2];  autograd_function_apply = None
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(clone, 1);  clone = None
        mul_1: "f32[6]" = torch.ops.aten.mul.Tensor(clone_1, 2);  clone_1 = None
        sum_1: "f32[2]" = torch.ops.aten.sum.dim_IntList(clone_2, [0]);  clone_2 = None
        return (add, mul_1, sum_1)

    class views_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[2, 3]"):
            view: "f32[6]" = torch.ops.aten.view.default(x, [-1])
            t: "f32[3, 2]" = torch.ops.aten.t.default(x)
            clone: "f32[2, 3]" = torch.ops.aten.clone.default(x);  x = None
            clone_1: "f32[6]" = torch.ops.aten.clone.default(view);  view = None
            clone_2: "f32[3, 2]" = torch.ops.aten.clone.default(t);  t = None
            return ((clone, clone_1, clone_2), ())

    class views_bwd_0(torch.nn.Module):
        def forward(self, grad_out_0: "f32[2, 3]", grad_out_1: "f32[6]", grad_out_2: "f32[3, 2]"):
            mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(grad_out_0, 2);  grad_out_0 = None
            view: "f32[2, 3]" = torch.ops.aten.view.default(grad_out_1, [2, 3]);  grad_out_1 = None
            mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(view, 3);  view = None
            add: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul, mul_1);  mul = mul_1 = None
            t: "f32[2, 3]" = torch.ops.aten.t.default(grad_out_2);  grad_out_2 = None
            mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(t, 4);  t = None
            add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(add, mul_2);  add = mul_2 = None
            return (add_1,)""")

    def test_tensors_in_a_list(self):
        self.assertExpectedInline(exported("tensors_in_a_list"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        sin: "f32[3]" = torch.ops.aten.sin.default(x)
        cos: "f32[3]" = torch.ops.aten.cos.default(x)
        weighted_sum_fwd_0 = self.weighted_sum_fwd_0
        weighted_sum_bwd_0 = self.weighted_sum_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(weighted_sum_fwd_0, weighted_sum_bwd_0, x, sin, cos, non_differentiable_idx = [], saved_for_backward_idx = [0, 1]);  weighted_sum_fwd_0 = weighted_sum_bwd_0 = x = sin = cos = None
        add_1: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
        return (add_1,)

    class weighted_sum_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[3]", weights_0: "f32[3]", weights_1: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(weights_0, x)
            add: "f32[3]" = torch.ops.aten.add.Tensor(mul, 0);  mul = None
            mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(weights_1, x);  x = None
            add_1: "f32[3]" = torch.ops.aten.add.Tensor(add, mul_1);  add = mul_1 = None
            return ((add_1,), (weights_0, weights_1))

    class weighted_sum_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[3]", saved_weights_0: "f32[3]", saved_weights_1: "f32[3]"):
            add: "f32[3]" = torch.ops.aten.add.Tensor(saved_weights_0, 0);  saved_weights_0 = None
            add_1: "f32[3]" = torch.ops.aten.add.Tensor(add, saved_weights_1);  add = saved_weights_1 = None
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, add_1);  grad_out = add_1 = None
            mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(mul, 2);  mul = None
            return (mul_1, None, None)""")

    def test_autocast_custom_fwd(self):
        self.assertExpectedInline(exported("autocast_custom_fwd"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3, 3]", y: "f32[3, 3]"):
        autocast_region_0 = self.autocast_region_0
        wrap_with_autocast = torch.ops.higher_order.wrap_with_autocast('cpu', torch.bfloat16, True, False, autocast_region_0, x, y);  autocast_region_0 = x = y = None
        matmul_1: "f32[3, 3]" = wrap_with_autocast[0];  wrap_with_autocast = None
        return (matmul_1,)

    class autocast_region_0(torch.nn.Module):
        def forward(self, x: "f32[3, 3]", y: "f32[3, 3]"):
            matmul: "bf16[3, 3]" = torch.ops.aten.matmul.default(x, y);  x = None
            float32_matmul_fwd_0 = self.float32_matmul_fwd_0
            float32_matmul_bwd_0 = self.float32_matmul_bwd_0
            autograd_function_apply = torch.ops.higher_order.autograd_function_apply(float32_matmul_fwd_0, float32_matmul_bwd_0, matmul, y, non_differentiable_idx = [], saved_for_backward_idx = [0, 1]);  float32_matmul_fwd_0 = float32_matmul_bwd_0 = matmul = y = None
            matmul_1: "f32[3, 3]" = autograd_function_apply[0];  autograd_function_apply = None
            return (matmul_1,)

        class float32_matmul_fwd_0(torch.nn.Module):
            def forward(self, a: "bf16[3, 3]", b: "f32[3, 3]"):
                autocast_region_0 = self.autocast_region_0
                wrap_with_autocast = torch.ops.higher_order.wrap_with_autocast('cpu', torch.bfloat16, False, False, autocast_region_0, a, b);  autocast_region_0 = a = None
                _to_copy: "f32[3, 3]" = wrap_with_autocast[0]
                matmul: "f32[3, 3]" = wrap_with_autocast[1];  wrap_with_autocast = None
                return ((matmul,), (_to_copy, b))

            class autocast_region_0(torch.nn.Module):
                def forward(self, a: "bf16[3, 3]", b: "f32[3, 3]"):
                    _assert_tensor_metadata = torch.ops.aten._assert_tensor_metadata.default(a, None, None, torch.bfloat16, device = device(type='cpu'), layout = torch.strided);  _assert_tensor_metadata = None
                    _to_copy: "f32[3, 3]" = torch.ops.aten._to_copy.default(a, dtype = torch.float32);  a = None
                    _assert_tensor_metadata_1 = torch.ops.aten._assert_tensor_metadata.default(b, None, None, torch.float32, device = device(type='cpu'), layout = torch.strided);  _assert_tensor_metadata_1 = None
                    matmul: "f32[3, 3]" = torch.ops.aten.matmul.default(_to_copy, b);  b = None
                    return (_to_copy, matmul)

        class float32_matmul_bwd_0(torch.nn.Module):
            def forward(self, grad_out: "f32[3, 3]", saved_0: "f32[3, 3]", saved_b: "f32[3, 3]"):
                autocast_region_0 = self.autocast_region_0
                wrap_with_autocast = torch.ops.higher_order.wrap_with_autocast('cpu', torch.bfloat16, False, False, autocast_region_0, saved_b, grad_out, saved_0);  autocast_region_0 = saved_b = grad_out = saved_0 = None
                matmul: "f32[3, 3]" = wrap_with_autocast[0]
                matmul_1: "f32[3, 3]" = wrap_with_autocast[1];  wrap_with_autocast = None
                return (matmul, matmul_1)

            class autocast_region_0(torch.nn.Module):
                def forward(self, saved_b: "f32[3, 3]", grad_out: "f32[3, 3]", saved_0: "f32[3, 3]"):
                    t: "f32[3, 3]" = torch.ops.aten.t.default(saved_b);  saved_b = None
                    matmul: "f32[3, 3]" = torch.ops.aten.matmul.default(grad_out, t);  t = None
                    t_1: "f32[3, 3]" = torch.ops.aten.t.default(saved_0);  saved_0 = None
                    matmul_1: "f32[3, 3]" = torch.ops.aten.matmul.default(t_1, grad_out);  t_1 = grad_out = None
                    return (matmul, matmul_1)""")

    def test_mark_dirty_in_no_grad(self):
        self.assertExpectedInline(exported("mark_dirty_in_no_grad"), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2)
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, mul);  grad_region_0 = None
        add: "f32[3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
        keep_history: "f32[3]" = torch.ops.predispatch.keep_history.default(add, mul);  add = mul = None
        mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(keep_history, x);  keep_history = x = None
        return (mul_1,)

    class grad_region_0(torch.nn.Module):
        def forward(self, mul: "f32[3]"):
            add_one_inplace_fwd_0 = self.add_one_inplace_fwd_0
            add_one_inplace_bwd_0 = self.add_one_inplace_bwd_0
            autograd_function_apply = torch.ops.higher_order.autograd_function_apply(add_one_inplace_fwd_0, add_one_inplace_bwd_0, mul, non_differentiable_idx = [], saved_for_backward_idx = []);  add_one_inplace_fwd_0 = add_one_inplace_bwd_0 = mul = None
            add: "f32[3]" = autograd_function_apply[0];  autograd_function_apply = None
            return (add,)

        class add_one_inplace_fwd_0(torch.nn.Module):
            def forward(self, x: "f32[3]"):
                add: "f32[3]" = torch.ops.aten.add.Tensor(x, 1);  x = None
                return ((add,), ())

        class add_one_inplace_bwd_0(torch.nn.Module):
            def forward(self, grad_out: "f32[3]"):
                mul: "f32[3]" = torch.ops.aten.mul.Tensor(grad_out, 5);  grad_out = None
                return (mul,)""")
