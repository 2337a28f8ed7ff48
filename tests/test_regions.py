"""Grad-mode and autocast regions become HOPs; mutations inside them keep eager's gradients."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase
from helpers import check_gradients, graph
from torch import nn

import predispatch
from predispatch.passes import raw_toggles


class DetachedDouble(nn.Module):
    """x + no_grad(2 * x): d/dx is 1, not 3."""

    def forward(self, x):
        with torch.no_grad():
            y = 2 * x
        return x + y


class InputMutatedUnderNoGrad(nn.Module):
    def forward(self, x, y):
        with torch.no_grad():
            y.add_(1)
        return x * y


class IntermediateMutatedUnderNoGrad(nn.Module):
    def forward(self, x):
        h = x * 3
        with torch.no_grad():
            h.mul_(2)
            h[0].zero_()  # through a view, too
        return h * x


class EMA(nn.Module):
    """A parameter and a running-average buffer updated under no_grad, then used."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))
        self.register_buffer("avg", torch.zeros(3))

    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(0.9).add_(x.mean(0), alpha=0.1)
            self.avg.lerp_(x.mean(0), 0.5)
        return (x * self.weight).sum(-1) + self.avg.sum()


class LeftOpen(nn.Module):
    """`torch.set_grad_enabled(False)` as a plain call, never undone."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        torch.set_grad_enabled(False)
        return y, y * 2


class Nested(nn.Module):
    """no_grad inside enable_grad inside no_grad."""

    def forward(self, x):
        with torch.no_grad():
            a = x * 2
            with torch.enable_grad():
                b = x * 3
                with torch.no_grad():
                    c = b * 4
                d = b + c
            e = d * a
        return a, b, c, d, e, x + e


class NestedFirst(nn.Module):
    """Three levels of regions, each beginning with the one inside it."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            with torch.no_grad():
                with torch.enable_grad():
                    y = x * 2
                z = y + 1
            w = z * 3
        return w, x * w


class NestedTemporaries(nn.Module):
    """Three levels of regions; the innermost computes a value only it reads (its extraction
    erases that node, which the outermost region must not take along)."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            with torch.no_grad():
                u = x + 1
                with torch.enable_grad():
                    y = u * 2 + 3
                z = y + 1
            w = z * 3
        return w, x * w


class NestedInline(nn.Module):
    """A region repeating its enclosing state (inline) between an extracted region and one
    inside it that keeps a temporary."""

    def forward(self, x):
        with torch.no_grad():
            a = x * 2
            with torch.no_grad():
                with torch.enable_grad():
                    b = (x * 3).sin()
                c = b + a
        return c, x * c


class AutocastBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
            z = self.norm(y)
        return y, z, z.float() + x


class PreHookRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3))

        def hook(module, args):
            with torch.no_grad():
                module.seen.add_(args[0].sum(0))
            return (args[0] * 2,)

        self.register_forward_pre_hook(hook)

    def forward(self, x):
        return self.lin(x) + self.seen


class Opener(nn.Module):
    def forward(self, x):
        torch.set_grad_enabled(False)
        return x * 2


class Closer(nn.Module):
    def forward(self, x):
        y = x + 1
        torch.set_grad_enabled(True)
        return y * x


class AcrossModules(nn.Module):
    """A region that begins in one submodule and ends in another."""

    def __init__(self):
        super().__init__()
        self.open, self.close = Opener(), Closer()

    def forward(self, x):
        return self.close(self.open(x)) + x


class NoOutputs(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            x.sum()  # computed and dropped
        return x * 2


class DropoutTrain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        with torch.no_grad():
            scale = self.lin(x).abs().mean()
        return self.bn(x) * scale


CASES = {
    "detached_double": (DetachedDouble, lambda: (torch.randn(3),)),
    "input_mutated_under_no_grad": (InputMutatedUnderNoGrad, lambda: (torch.randn(3), torch.randn(3))),
    "intermediate_mutated_under_no_grad": (IntermediateMutatedUnderNoGrad, lambda: (torch.randn(2, 3),)),
    "ema": (EMA, lambda: (torch.randn(4, 3),)),
    "left_open": (LeftOpen, lambda: (torch.randn(2, 3),)),
    "nested": (Nested, lambda: (torch.randn(3),)),
    "nested_first": (NestedFirst, lambda: (torch.randn(3),)),
    "nested_temporaries": (NestedTemporaries, lambda: (torch.randn(3),)),
    "nested_inline": (NestedInline, lambda: (torch.randn(3),)),
    "autocast": (AutocastBlock, lambda: (torch.randn(4, 8),)),
    "pre_hook_region": (PreHookRegion, lambda: (torch.randn(2, 3),)),
    "across_modules": (AcrossModules, lambda: (torch.randn(3),)),
    "no_outputs": (NoOutputs, lambda: (torch.randn(3),)),
    "batchnorm_with_region": (DropoutTrain, lambda: (torch.randn(5, 4),)),
}


@pytest.mark.parametrize("outer_no_grad", [False, True], ids=["grad", "outer_no_grad"])
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_eager(case, mode, outer_no_grad):
    torch.manual_seed(0)
    module_cls, make_args = CASES[case]
    module = module_cls().train(mode == "train")
    ep = check_gradients(module, make_args(), outer_no_grad=outer_no_grad)
    assert raw_toggles(ep.graph_module) == []


def test_program_leaves_grad_mode_as_forward_does():
    model = LeftOpen()
    ep = predispatch.export(model, (torch.randn(2, 3),))
    assert torch.is_grad_enabled()  # export itself changed nothing
    try:
        ep.module()(torch.randn(2, 3))
        assert not torch.is_grad_enabled()  # as model(x) would
    finally:
        torch.set_grad_enabled(True)
    assert ep.signature.grad_mode_on_exit is False


def export(module, *args):
    torch.manual_seed(0)
    return predispatch.export(module, args)


class Goldens(TestCase):
    maxDiff = None

    def test_detached_double(self):
        self.assertExpectedInline(graph(export(DetachedDouble(), torch.randn(3))), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x);  grad_region_0 = None
        mul: "f32[3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
        add: "f32[3]" = torch.ops.aten.add.Tensor(x, mul);  x = mul = None
        return (add,)

    class grad_region_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
            return (mul,)""")

    def test_intermediate_mutated_under_no_grad(self):
        self.assertExpectedInline(graph(export(IntermediateMutatedUnderNoGrad(), torch.randn(2, 3))), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[2, 3]"):
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(x, 3)
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, mul);  grad_region_0 = None
        select_scatter: "f32[2, 3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
        keep_history: "f32[2, 3]" = torch.ops.predispatch.keep_history.default(select_scatter, mul);  select_scatter = mul = None
        mul_2: "f32[2, 3]" = torch.ops.aten.mul.Tensor(keep_history, x);  keep_history = x = None
        return (mul_2,)

    class grad_region_0(torch.nn.Module):
        def forward(self, mul: "f32[2, 3]"):
            mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(mul, 2);  mul = None
            select_1: "f32[3]" = torch.ops.aten.select.int(mul_1, 0, 0)
            zero: "f32[3]" = torch.ops.aten.zero.default(select_1);  select_1 = None
            select_scatter: "f32[2, 3]" = torch.ops.aten.select_scatter.default(mul_1, zero, 0, 0);  mul_1 = zero = None
            return (select_scatter,)""")

    def test_input_mutated_under_no_grad(self):
        ep = export(InputMutatedUnderNoGrad(), torch.randn(3), torch.randn(3))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, x: "f32[3]", y: "f32[3]"):
            grad_region_0 = self.grad_region_0
            wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, y);  grad_region_0 = None
            add: "f32[3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
            keep_history: "f32[3]" = torch.ops.predispatch.keep_history.default(add, y);  add = y = None
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, keep_history);  x = None
            return (keep_history, mul)

        class grad_region_0(torch.nn.Module):
            def forward(self, y: "f32[3]"):
                add: "f32[3]" = torch.ops.aten.add.Tensor(y, 1);  y = None
                return (add,)

Graph signature:
    Inputs:
        x: USER_INPUT target='x'
        y: USER_INPUT target='y'
    Outputs:
        keep_history: USER_INPUT_MUTATION target='y'
        mul: USER_OUTPUT target='output'""")

    def test_ema(self):
        self.assertExpectedInline(str(export(EMA(), torch.randn(4, 3))), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, p_weight: "f32[3]", b_avg: "f32[3]", x: "f32[4, 3]"):
            grad_region_0 = self.grad_region_0
            wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, p_weight, x, b_avg);  grad_region_0 = b_avg = None
            add: "f32[3]" = wrap_with_set_grad_enabled[0]
            lerp: "f32[3]" = wrap_with_set_grad_enabled[1];  wrap_with_set_grad_enabled = None
            keep_history: "f32[3]" = torch.ops.predispatch.keep_history.default(add, p_weight);  add = p_weight = None
            mul_1: "f32[4, 3]" = torch.ops.aten.mul.Tensor(x, keep_history);  x = None
            sum_1: "f32[4]" = torch.ops.aten.sum.dim_IntList(mul_1, [-1]);  mul_1 = None
            sum_2: "f32[]" = torch.ops.aten.sum.default(lerp)
            add_1: "f32[4]" = torch.ops.aten.add.Tensor(sum_1, sum_2);  sum_1 = sum_2 = None
            return (keep_history, lerp, add_1)

        class grad_region_0(torch.nn.Module):
            def forward(self, p_weight: "f32[3]", x: "f32[4, 3]", b_avg: "f32[3]"):
                mul: "f32[3]" = torch.ops.aten.mul.Tensor(p_weight, 0.9);  p_weight = None
                mean: "f32[3]" = torch.ops.aten.mean.dim(x, [0])
                add: "f32[3]" = torch.ops.aten.add.Tensor(mul, mean, alpha = 0.1);  mul = mean = None
                mean_1: "f32[3]" = torch.ops.aten.mean.dim(x, [0]);  x = None
                lerp: "f32[3]" = torch.ops.aten.lerp.Scalar(b_avg, mean_1, 0.5);  b_avg = mean_1 = None
                return (add, lerp)

Graph signature:
    Inputs:
        p_weight: PARAMETER target='weight'
        b_avg: BUFFER target='avg'
        x: USER_INPUT target='x'
    Outputs:
        keep_history: PARAMETER_MUTATION target='weight'
        lerp: BUFFER_MUTATION target='avg'
        add_1: USER_OUTPUT target='output'""")

    def test_left_open(self):
        self.assertExpectedInline(graph(export(LeftOpen(), torch.randn(2, 3))), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", x: "f32[2, 3]"):
        linear: "f32[2, 3]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, linear);  grad_region_0 = None
        mul: "f32[2, 3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
        return (linear, mul)

    class grad_region_0(torch.nn.Module):
        def forward(self, linear: "f32[2, 3]"):
            mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(linear, 2);  linear = None
            return (mul,)""")

    def test_nested(self):
        self.assertExpectedInline(graph(export(Nested(), torch.randn(3))), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled_2 = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x);  grad_region_0 = None
        mul: "f32[3]" = wrap_with_set_grad_enabled_2[0]
        mul_1: "f32[3]" = wrap_with_set_grad_enabled_2[1]
        mul_2: "f32[3]" = wrap_with_set_grad_enabled_2[2]
        add: "f32[3]" = wrap_with_set_grad_enabled_2[3]
        mul_3: "f32[3]" = wrap_with_set_grad_enabled_2[4];  wrap_with_set_grad_enabled_2 = None
        add_1: "f32[3]" = torch.ops.aten.add.Tensor(x, mul_3);  x = None
        return (mul, mul_1, mul_2, add, mul_3, add_1)

    class grad_region_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2)
            grad_region_1 = self.grad_region_1
            wrap_with_set_grad_enabled_1 = torch.ops.higher_order.wrap_with_set_grad_enabled(True, grad_region_1, x);  grad_region_1 = x = None
            mul_1: "f32[3]" = wrap_with_set_grad_enabled_1[0]
            mul_2: "f32[3]" = wrap_with_set_grad_enabled_1[1]
            add: "f32[3]" = wrap_with_set_grad_enabled_1[2];  wrap_with_set_grad_enabled_1 = None
            mul_3: "f32[3]" = torch.ops.aten.mul.Tensor(add, mul)
            return (mul, mul_1, mul_2, add, mul_3)

        class grad_region_1(torch.nn.Module):
            def forward(self, x: "f32[3]"):
                mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(x, 3);  x = None
                grad_region_2 = self.grad_region_2
                wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_2, mul_1);  grad_region_2 = None
                mul_2: "f32[3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
                add: "f32[3]" = torch.ops.aten.add.Tensor(mul_1, mul_2)
                return (mul_1, mul_2, add)

            class grad_region_2(torch.nn.Module):
                def forward(self, mul_1: "f32[3]"):
                    mul_2: "f32[3]" = torch.ops.aten.mul.Tensor(mul_1, 4);  mul_1 = None
                    return (mul_2,)""")

    def test_autocast(self):
        self.assertExpectedInline(graph(export(AutocastBlock(), torch.randn(4, 8))), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[8, 8]", p_lin_bias: "f32[8]", p_norm_weight: "f32[8]", p_norm_bias: "f32[8]", x: "f32[4, 8]"):
        autocast_region_0 = self.autocast_region_0
        wrap_with_autocast = torch.ops.higher_order.wrap_with_autocast('cpu', torch.bfloat16, True, False, autocast_region_0, x, p_lin_weight, p_lin_bias, p_norm_weight, p_norm_bias);  autocast_region_0 = p_lin_weight = p_lin_bias = p_norm_weight = p_norm_bias = None
        linear: "bf16[4, 8]" = wrap_with_autocast[0]
        layer_norm: "bf16[4, 8]" = wrap_with_autocast[1];  wrap_with_autocast = None
        _assert_tensor_metadata = torch.ops.aten._assert_tensor_metadata.default(layer_norm, None, None, torch.bfloat16, device = device(type='cpu'), layout = torch.strided);  _assert_tensor_metadata = None
        _to_copy: "f32[4, 8]" = torch.ops.aten._to_copy.default(layer_norm, dtype = torch.float32)
        add: "f32[4, 8]" = torch.ops.aten.add.Tensor(_to_copy, x);  _to_copy = x = None
        return (linear, layer_norm, add)

    class autocast_region_0(torch.nn.Module):
        def forward(self, x: "f32[4, 8]", p_lin_weight: "f32[8, 8]", p_lin_bias: "f32[8]", p_norm_weight: "f32[8]", p_norm_bias: "f32[8]"):
            linear: "bf16[4, 8]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
            layer_norm: "bf16[4, 8]" = torch.ops.aten.layer_norm.default(linear, [8], p_norm_weight, p_norm_bias);  p_norm_weight = p_norm_bias = None
            return (linear, layer_norm)""")

    def test_pre_hook_region(self):
        self.assertExpectedInline(graph(export(PreHookRegion(), torch.randn(2, 3))), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", b_seen: "f32[3]", x: "f32[2, 3]"):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x, b_seen);  grad_region_0 = b_seen = None
        add: "f32[3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
        linear: "f32[2, 3]" = torch.ops.aten.linear.default(mul, p_lin_weight, p_lin_bias);  mul = p_lin_weight = p_lin_bias = None
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(linear, add);  linear = None
        return (add, add_1)

    class grad_region_0(torch.nn.Module):
        def forward(self, x: "f32[2, 3]", b_seen: "f32[3]"):
            sum_1: "f32[3]" = torch.ops.aten.sum.dim_IntList(x, [0]);  x = None
            add: "f32[3]" = torch.ops.aten.add.Tensor(b_seen, sum_1);  b_seen = sum_1 = None
            return (add,)""")

    def test_across_modules(self):
        self.assertExpectedInline(graph(export(AcrossModules(), torch.randn(3))), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled_1 = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x);  grad_region_0 = x = None
        add_1: "f32[3]" = wrap_with_set_grad_enabled_1[0];  wrap_with_set_grad_enabled_1 = None
        return (add_1,)

    class grad_region_0(torch.nn.Module):
        def forward(self, x: "f32[3]"):
            mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2)
            add: "f32[3]" = torch.ops.aten.add.Tensor(mul, 1)
            grad_region_1 = self.grad_region_1
            wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(True, grad_region_1, add, mul, x);  grad_region_1 = add = mul = x = None
            add_1: "f32[3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
            return (add_1,)

        class grad_region_1(torch.nn.Module):
            def forward(self, add: "f32[3]", mul: "f32[3]", x: "f32[3]"):
                mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(add, mul);  add = mul = None
                add_1: "f32[3]" = torch.ops.aten.add.Tensor(mul_1, x);  mul_1 = x = None
                return (add_1,)""")

    def test_no_outputs(self):
        self.assertExpectedInline(graph(export(NoOutputs(), torch.randn(3))), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
        return (mul,)""")


def test_unmarked_toggles_at_the_top_level_open_regions():
    """A toggle the trace did not mark (a generator's no_grad exit run by the garbage collector
    mid-trace, say) must not break the pass: at the top level it can only open a region."""
    from torch import fx

    from predispatch.passes import wrap_regions

    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(torch._C._set_grad_enabled, (True,))
    y = graph.call_function(torch.ops.aten.mul.Tensor, (x, 2))
    graph.output((y,))
    gm = fx.GraphModule({}, graph)
    wrap_regions(gm)
    gm.recompile()  # passes edit in place; build_program recompiles once
    assert raw_toggles(gm) == []
    assert "wrap_with_set_grad_enabled(True" in gm.code
    torch.testing.assert_close(gm(torch.ones(2))[0], torch.full((2,), 2.0))
