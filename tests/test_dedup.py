"""Repeated blocks: traced twice, compared, replayed as `invoke_subgraph` (trace/dedup/).

Each test pairs what the report and graph say was shared with outputs and gradients against
eager (`check_gradients`, bitwise), so a wrong share shows as a wrong number.
"""

from __future__ import annotations

import copy
import enum
from types import SimpleNamespace

import pytest
import torch
from expecttest import TestCase
from helpers import assert_same_tree, check_gradients, export_and_check, graph, round_trip, stable_message
from torch import nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch.errors import DedupVerificationError

INVOKE = torch.ops.higher_order.invoke_subgraph


@pytest.fixture(autouse=True)
def small_bodies_are_shared(request, monkeypatch):
    """These tests' blocks are small (a norm, two linears: 6 ops) so that their golden graphs
    stay readable; they test what sharing does, so they share bodies of 4 ops and more.  The
    real threshold (`MIN_BODY_OPS`, chosen for speed) has its own tests, named `*real_threshold*`."""
    if "real_threshold" not in request.node.name:
        from predispatch.trace.dedup import share

        monkeypatch.setattr(share, "MIN_BODY_OPS", 4)


class Block(nn.Module):
    """A small residual block: norm, two linears, an activation."""

    def __init__(self, width: int = 8, config=None, layer_idx: int = 0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.config = config
        self.layer_idx = layer_idx  # never read by forward: must not split the layers
        self.scale = 1.0

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x)))) * self.scale


class Stack(nn.Module):
    def __init__(self, n: int = 5, make=Block):
        super().__init__()
        self.layers = nn.ModuleList(make(layer_idx=i) for i in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _report(ep):
    return ep.graph_module.meta["dedup"]


def _replayed(ep) -> list[str]:
    return [path for r in _report(ep) for path in r.replayed]


def _calls(ep) -> int:
    return len(ep.graph.find_nodes(op="call_function", target=INVOKE))


def test_stack_shares_one_body():
    torch.manual_seed(0)
    model, x = Stack(4), torch.randn(2, 3, 8)
    ep = check_gradients(model, (x,))
    assert _replayed(ep) == ["layers.2", "layers.3"]
    assert [r.calls for r in _report(ep)] == [["layers.0", "layers.1", "layers.2", "layers.3"]]
    calls = [n for n in ep.graph.nodes if n.target is INVOKE]  # every call: the first two are folded
    assert [list(n.meta["nn_module_stack"])[-1] for n in calls] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert {n.args[0].target for n in calls} == {"repeated_body_0"}
    assert graph(ep).count("class repeated_body_0") == 1


def test_dedup_false_traces_inline_and_inlining_gives_the_same_ops():
    torch.manual_seed(0)
    model, x = Stack(5), torch.randn(2, 3, 8)
    flat = predispatch.export(model, (x,), dedup=False)
    shared = predispatch.export(model, (x,))
    assert _calls(flat) == 0 and _report(flat) == []
    assert _calls(shared) == 5
    inlined = shared.inline_subgraphs()
    assert _calls(inlined) == 0 and _calls(shared) == 5  # a copy: the program keeps its bodies
    ops = lambda ep: [n.target for n in ep.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert ops(inlined) == ops(flat)
    assert_same_tree(inlined.module()(x), model(x))


def test_verify_mode_checks_every_call():
    torch.manual_seed(0)
    model, x = Stack(5), torch.randn(2, 3, 8)
    ep = predispatch.export(model, (x,), dedup="verify")
    (report,) = _report(ep)
    assert report.not_shared is None and len(report.calls) == 5 and report.replayed == []
    targets = lambda ep: [(n.target, len(n.args)) for n in ep.graph.nodes]  # noqa: E731
    assert targets(ep) == targets(predispatch.export(model, (x,)))  # every call folded: the same program
    with pytest.raises(ValueError, match="dedup must be one of True, False or 'verify', not 'yes'"):
        predispatch.export(model, (x,), dedup="yes")


# ---- the key: each distinguishing attribute splits the layers --------------------------------


def _change_last(model: Stack, how: str) -> None:
    last = model.layers[-1]
    if how == "dtype":
        last.double()
    elif how == "requires_grad":
        last.up.weight.requires_grad_(False)
    elif how == "forward_hook":
        last.register_forward_hook(lambda m, args, out: out * 2)
    elif how == "read_attribute":
        last.scale = 0.5
    elif how == "training":
        last.norm.eval()
    elif how == "shape":
        last.norm = nn.LayerNorm(8, elementwise_affine=False)


class _Dtype(Stack):
    def forward(self, x):
        for layer in self.layers:
            x = layer(x.to(layer.up.weight.dtype)).float()
        return x


@pytest.mark.parametrize("how", ["dtype", "requires_grad", "forward_hook", "read_attribute", "training", "shape"])
def test_key_splits_a_different_layer(how):
    torch.manual_seed(0)
    model = (_Dtype if how == "dtype" else Stack)(5)
    _change_last(model, how)
    ep = check_gradients(model, (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.3"]  # layers.4 has a key of its own


def test_unread_attribute_does_not_split():
    torch.manual_seed(0)
    model = Stack(4)
    for i, layer in enumerate(model.layers):
        layer.layer_idx = i
        layer.unused_note = f"layer {i}"
    ep = check_gradients(model, (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.3"]


class GradModes(Stack):
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            with torch.no_grad() if i == 3 else torch.enable_grad():
                x = layer(x)
        return x


class Autocast(Stack):
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=i == 3):
                x = layer(x).float()
        return x


class InputShapes(Stack):
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x if i != 3 else x[:, :2])
            if i == 3:
                x = torch.cat([x, x[:, :1]], dim=1)
        return x


class InputConstant(Stack):
    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer.forward_with(x, 1.0 if i != 3 else 2.0) if hasattr(layer, "forward_with") else layer(x)
        return x


@pytest.mark.parametrize("cls", [GradModes, Autocast, InputShapes])
def test_key_splits_on_ambient_state_and_inputs(cls):
    torch.manual_seed(0)
    ep = check_gradients(cls(5), (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.4"]


class ScaledBlock(Block):
    def forward(self, x, factor=1.0):
        return super().forward(x) * factor


class NonTensorInputs(Stack):
    def __init__(self):
        super().__init__(5, ScaledBlock)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x, factor=2.0 if i == 3 else 1.0)
        return x


def test_key_splits_on_a_non_tensor_input():
    torch.manual_seed(0)
    ep = check_gradients(NonTensorInputs(), (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.4"]


# ---- the Gemma-3 trap: attention type chosen from layer_idx through the config ------------


class Attention(nn.Module):
    """Sliding-window or full causal attention, picked per layer from the config."""

    def __init__(self, config, layer_idx: int, pick_in_forward: bool):
        super().__init__()
        self.config, self.layer_idx, self.pick_in_forward = config, layer_idx, pick_in_forward
        self.is_sliding = config.layer_types[layer_idx] == "sliding"  # Gemma-3's __init__ pattern
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.out = nn.Linear(config.width, config.width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        n = x.shape[1]
        i = torch.arange(n)
        mask = i[:, None] >= i[None, :]
        sliding = self.config.layer_types[self.layer_idx] == "sliding" if self.pick_in_forward else self.is_sliding
        if sliding:
            mask = mask & (i[:, None] - i[None, :] < self.config.sliding_window)
        scores = (q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        return self.out(scores.softmax(-1) @ v)


class Layer(nn.Module):
    def __init__(self, config, layer_idx, pick_in_forward):
        super().__init__()
        self.attn = Attention(config, layer_idx, pick_in_forward)
        self.norm = nn.LayerNorm(config.width)

    def forward(self, x):
        return x + self.attn(self.norm(x))


class Decoder(nn.Module):
    def __init__(self, pick_in_forward: bool = False):
        super().__init__()
        config = SimpleNamespace(width=8, sliding_window=2, layer_types=["sliding"] * 5 + ["full"])
        self.layers = nn.ModuleList(Layer(config, i, pick_in_forward) for i in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("dedup", [True, "verify"])
def test_gemma_trap_full_attention_layer_gets_its_own_body(dedup, monkeypatch):
    torch.manual_seed(0)
    model, x = Decoder(), torch.randn(2, 6, 8)
    monkeypatch.setattr(predispatch, "export", _with_dedup(predispatch.export, dedup))
    ep = check_gradients(model, (x,))
    sliding, full = _report(ep)
    assert sliding.calls == [f"layers.{i}" for i in range(5)] and sliding.not_shared is None
    assert full.calls == ["layers.5"] and full.replayed == []
    assert _replayed(ep) == (["layers.2", "layers.3", "layers.4"] if dedup is True else [])


def test_gemma_trap_reading_layer_idx_in_forward_splits_every_layer():
    torch.manual_seed(0)
    ep = check_gradients(Decoder(pick_in_forward=True), (torch.randn(2, 6, 8),))
    assert _replayed(ep) == []  # each layer reads its own layer_idx: six keys, no sharing, still right
    assert len(_report(ep)) == 6


def _with_dedup(export, dedup):
    return lambda *args, **kwargs: export(*args, dedup=dedup, **kwargs)


# ---- what the key cannot see: the comparison, and the documented gap ------------------------

SCALE = {"value": 1.0}


class GlobalReader(Block):
    def forward(self, x):
        return super().forward(x) * SCALE["value"]


class GlobalStack(Stack):
    def __init__(self, change_at: int):
        super().__init__(5, GlobalReader)
        self.change_at = change_at

    def forward(self, x):
        SCALE["value"] = 1.0
        for i, layer in enumerate(self.layers):
            if i == self.change_at:
                SCALE["value"] = 3.0
            x = layer(x)
        return x


def test_global_change_between_first_two_calls_is_caught_by_the_comparison():
    torch.manual_seed(0)
    ep = check_gradients(GlobalStack(change_at=1), (torch.randn(2, 3, 8),))
    (report,) = _report(ep)
    assert report.replayed == [] and "layers.1 differs from layers.0" in report.not_shared


def test_global_read_after_second_call():
    """Note [What the key cannot see]: a global changed only after the second call is not in the
    key, so the replay repeats the first call's graph; `dedup="verify"` raises, `dedup=False` is right."""
    torch.manual_seed(0)
    model, x = GlobalStack(change_at=3), torch.randn(2, 3, 8)
    expected = model(x)
    wrong = predispatch.export(model, (x,)).module()(x)
    assert not torch.equal(wrong, expected)  # the documented gap
    assert_same_tree(predispatch.export(model, (x,), dedup=False).module()(x), expected)
    with pytest.raises(DedupVerificationError) as info:
        predispatch.export(model, (x,), dedup="verify")
    assert stable_message(info.value) == (
        "the call of layers.3 differs from the shared body of layers.0: node mul_1 (call_function mul.Tensor) "
        "against mul_7 (call_function mul.Tensor): different arguments.\n"
        "  at test_dedup.py:N (x = layer(x))\n"
        "  fix: export with dedup=False, and report the module: its key misses what makes the calls differ.\n"
        "  see docs/errors.md#dedupverificationerror"
    )


# ---- mutations, regions, Functions and hooks inside a shared block -------------------------


class BNBlock(nn.Module):
    def __init__(self, layer_idx=0):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x)))


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_buffer_mutations_inside_shared_blocks_are_written_back(mode):
    torch.manual_seed(0)
    model = Stack(4, BNBlock).train(mode == "train")
    ep = export_and_check(model, (torch.randn(4, 8),))
    check_gradients(model, (torch.randn(4, 8),))
    assert _replayed(ep) == ["layers.2", "layers.3"]
    mutated = [s.target for s in ep.signature.mutations]
    assert mutated == ([f"layers.{i}.bn.{b}" for i in range(4) for b in ("running_mean", "running_var", "num_batches_tracked")]
                       if mode == "train" else [])


class RegionBlock(Block):
    def forward(self, x):
        with torch.no_grad():
            shift = self.up(x).mean()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.down(torch.relu(self.up(self.norm(x)))).float()
        return x + y - shift


class Straight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g * 2


class FunctionBlock(Block):
    def forward(self, x):
        return super().forward(Straight.apply(self.norm(x)))


def _hook(module, args, out):
    return out * 2


def _pre_hook(module, args):
    return (args[0] + 1,)


class HookedStack(Stack):
    def __init__(self):
        super().__init__(4)
        for layer in self.layers:
            layer.up.register_forward_hook(_hook)
            layer.register_forward_pre_hook(_pre_hook)


@pytest.mark.parametrize("make", [lambda: Stack(4, RegionBlock), lambda: Stack(4, FunctionBlock), HookedStack])
def test_regions_functions_and_forward_hooks_inside_shared_blocks(make):
    torch.manual_seed(0)
    ep = check_gradients(make(), (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.3"]


def test_backward_hooks_inside_are_traced_inline():
    torch.manual_seed(0)
    model = Stack(4)
    for layer in model.layers:
        layer.up.register_full_backward_hook(lambda m, gi, go: (gi[0] * 3,))
    ep = check_gradients(model, (torch.randn(2, 3, 8),))
    assert _replayed(ep) == []  # the hook capture's stand-in forward hooks differ per module


class Counting(Block):
    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        return super().forward(x)


def test_a_forward_writing_python_state_is_not_shared():
    torch.manual_seed(0)
    model = Stack(4, Counting)
    ep = predispatch.export(model, (torch.randn(2, 3, 8),))
    assert _replayed(ep) == [] and _report(ep)[0].not_shared == "the forward sets the Python attribute calls"


class ReturnsInput(Block):
    def forward(self, x, bias):
        return super().forward(x) + bias, bias, None  # T5 hands position_bias on like this


class ReturnsInputStack(Stack):
    def __init__(self):
        super().__init__(4, ReturnsInput)

    def forward(self, x):
        bias = x.mean(0)
        for layer in self.layers:
            x, passed, _ = layer(x, bias)
            assert passed is bias  # the very tensor, as in eager
        return x


def test_a_block_returning_its_input_returns_that_tensor():
    torch.manual_seed(0)
    ep = check_gradients(ReturnsInputStack(), (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.3"]


class ReturnsView(Block):
    def forward(self, x):
        y = super().forward(x)
        return y, y[0]


class ReturnsViewStack(Stack):
    def __init__(self):
        super().__init__(4, ReturnsView)

    def forward(self, x):
        for layer in self.layers:
            x, first = layer(x)
            first.mul_(2)  # changes x too, in eager
        return x


def test_a_block_returning_two_views_of_one_tensor_is_not_shared():
    torch.manual_seed(0)
    ep = export_and_check(ReturnsViewStack(), (torch.randn(2, 3, 8),))
    assert _replayed(ep) == [] and "views of one tensor" in _report(ep)[0].not_shared


def test_one_module_called_many_times_is_shared():
    """ALBERT's pattern: one layer applied repeatedly."""
    torch.manual_seed(0)

    class Repeat(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            for _ in range(5):
                x = self.block(x)
            return x

    ep = check_gradients(Repeat(), (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["block", "block"]  # calls 2 and 3 are traced and compared, 4 and 5 replayed


# ---- downstream: save/load, to_torch, pictures -----------------------------------------------


def test_save_load_round_trips_shared_bodies():
    torch.manual_seed(0)
    model, x = Stack(5), torch.randn(2, 3, 8)
    ep = predispatch.export(model, (x,))
    loaded = round_trip(ep)
    assert str(loaded) == str(ep)
    assert _calls(loaded) == 5
    assert_same_tree(loaded.module()(x), model(x))


def test_to_torch_inlines_shared_bodies():
    """torch's eager invoke_subgraph cannot differentiate (it needs a fake mode), so to_torch()
    gives the flat graph: its module() trains like the model."""
    torch.manual_seed(0)
    model, x = Stack(5), torch.randn(2, 3, 8)
    ep = predispatch.export(model, (x,))
    assert _calls(ep) == 5
    theirs = ep.to_torch()
    assert len(theirs.graph.find_nodes(op="call_function", target=INVOKE)) == 0
    x_theirs, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert_same_tree(theirs.module()(x_theirs), model(x_eager))
    theirs.module()(x_theirs).sum().backward()
    model(x_eager).sum().backward()
    assert_same_tree(x_theirs.grad, x_eager.grad)


class Golden(TestCase):
    maxDiff = None

    def test_printed_program_shows_the_body_once_with_its_calls(self):
        torch.manual_seed(0)
        model, x = Stack(3), torch.randn(2, 3, 8)
        ep = export_and_check(model, (x,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_layers_0_norm_weight: "f32[8]", p_layers_0_norm_bias: "f32[8]", p_layers_0_up_weight: "f32[16, 8]", p_layers_0_up_bias: "f32[16]", p_layers_0_down_weight: "f32[8, 16]", p_layers_0_down_bias: "f32[8]", p_layers_1_norm_weight: "f32[8]", p_layers_1_norm_bias: "f32[8]", p_layers_1_up_weight: "f32[16, 8]", p_layers_1_up_bias: "f32[16]", p_layers_1_down_weight: "f32[8, 16]", p_layers_1_down_bias: "f32[8]", p_layers_2_norm_weight: "f32[8]", p_layers_2_norm_bias: "f32[8]", p_layers_2_up_weight: "f32[16, 8]", p_layers_2_up_bias: "f32[16]", p_layers_2_down_weight: "f32[8, 16]", p_layers_2_down_bias: "f32[8]", x: "f32[2, 3, 8]"):
        repeated_body_1 = self.repeated_body_0
        invoke_subgraph_1 = torch.ops.higher_order.invoke_subgraph(repeated_body_1, 'repeated_body_0', p_layers_0_norm_weight, p_layers_0_norm_bias, p_layers_0_up_weight, p_layers_0_up_bias, p_layers_0_down_weight, p_layers_0_down_bias, x);  repeated_body_1 = p_layers_0_norm_weight = p_layers_0_norm_bias = p_layers_0_up_weight = p_layers_0_up_bias = p_layers_0_down_weight = p_layers_0_down_bias = x = None
        add_3: "f32[2, 3, 8]" = invoke_subgraph_1[0];  invoke_subgraph_1 = None
        repeated_body_2 = self.repeated_body_0
        invoke_subgraph_2 = torch.ops.higher_order.invoke_subgraph(repeated_body_2, 'repeated_body_0', p_layers_1_norm_weight, p_layers_1_norm_bias, p_layers_1_up_weight, p_layers_1_up_bias, p_layers_1_down_weight, p_layers_1_down_bias, add_3);  repeated_body_2 = p_layers_1_norm_weight = p_layers_1_norm_bias = p_layers_1_up_weight = p_layers_1_up_bias = p_layers_1_down_weight = p_layers_1_down_bias = add_3 = None
        add_4: "f32[2, 3, 8]" = invoke_subgraph_2[0];  invoke_subgraph_2 = None
        repeated_body_0 = self.repeated_body_0
        invoke_subgraph = torch.ops.higher_order.invoke_subgraph(repeated_body_0, 'repeated_body_0', p_layers_2_norm_weight, p_layers_2_norm_bias, p_layers_2_up_weight, p_layers_2_up_bias, p_layers_2_down_weight, p_layers_2_down_bias, add_4);  repeated_body_0 = p_layers_2_norm_weight = p_layers_2_norm_bias = p_layers_2_up_weight = p_layers_2_up_bias = p_layers_2_down_weight = p_layers_2_down_bias = add_4 = None
        add_2: "f32[2, 3, 8]" = invoke_subgraph[0];  invoke_subgraph = None
        return (add_2,)

    class repeated_body_0(torch.nn.Module):
        def forward(self, norm_weight: "f32[8]", norm_bias: "f32[8]", up_weight: "f32[16, 8]", up_bias: "f32[16]", down_weight: "f32[8, 16]", down_bias: "f32[8]", x_0: "f32[2, 3, 8]"):
            layer_norm: "f32[2, 3, 8]" = torch.ops.aten.layer_norm.default(x_0, [8], norm_weight, norm_bias);  norm_weight = norm_bias = None
            linear: "f32[2, 3, 16]" = torch.ops.aten.linear.default(layer_norm, up_weight, up_bias);  layer_norm = up_weight = up_bias = None
            relu: "f32[2, 3, 16]" = torch.ops.aten.relu.default(linear);  linear = None
            linear_1: "f32[2, 3, 8]" = torch.ops.aten.linear.default(relu, down_weight, down_bias);  relu = down_weight = down_bias = None
            mul: "f32[2, 3, 8]" = torch.ops.aten.mul.Tensor(linear_1, 1.0);  linear_1 = None
            add: "f32[2, 3, 8]" = torch.ops.aten.add.Tensor(x_0, mul);  x_0 = mul = None
            return (add,)""")


def test_picture_draws_a_shared_body_once_with_its_count():
    from predispatch.render.picture import NodeKind, picture

    torch.manual_seed(0)
    ep = predispatch.export(Stack(5), (torch.randn(2, 3, 8),))
    drawn = picture(ep)
    shared = [c for c in drawn.clusters if c.label.startswith("invoke_subgraph")]
    assert [c.label for c in shared] == ["invoke_subgraph (shared by 5 calls)"]
    calls = [n for n in drawn.nodes if n.kind is NodeKind.CALL]
    assert [n.note for n in calls] == ["calls repeated_body_0, drawn at its first call"] * 4
    relus = [n for n in drawn.nodes if n.name.startswith("relu")]
    assert len(relus) == 1  # the body, once


def test_dynamic_batch_shares_with_the_size_as_an_operand():
    torch.manual_seed(0)
    model = Stack(5)
    ep = predispatch.export(model, (torch.randn(2, 3, 8),), dynamic_shapes={"x": {0: torch.export.Dim("b", min=2, max=64)}})
    assert _replayed(ep) == ["layers.2", "layers.3", "layers.4"]
    calls = ep.graph.find_nodes(op="call_function", target=INVOKE)
    # the batch size: an operand of every call (torch <= 2.14), or read inside the body (2.15's
    # invoke_subgraph lifts no free symbols); either way one body serves every batch size
    sizes = [c for c in calls if c.args[-1].target is torch.ops.aten.sym_size.int]
    assert len(calls) == 5 and len(sizes) in ((5,) if ti.TORCH < (2, 15) else (0, 5))
    x = torch.randn(7, 3, 8)
    assert_same_tree(ep.module()(x), model(x))


class _Config:
    """A plain config object: its class is swapped while a call is recorded."""

    def __init__(self):
        self.fail = False


class Failing(Block):
    def forward(self, x):
        y = super().forward(x)
        if self.config.fail:
            raise RuntimeError("boom")
        return y


def test_recording_leaves_classes_and_state_as_found():
    """The read log swaps classes during a recorded call; on success and failure they are back."""
    config = _Config()
    model = Stack(4, lambda layer_idx: Failing(config=config, layer_idx=layer_idx))
    classes = [type(m) for m in model.modules()]
    before = copy.deepcopy(model.state_dict())
    predispatch.export(model, (torch.randn(2, 3, 8),))
    assert [type(m) for m in model.modules()] == classes and type(config) is _Config
    config.fail = True
    with pytest.raises(predispatch.errors.TraceError, match="boom"):
        predispatch.export(model, (torch.randn(2, 3, 8),))
    assert [type(m) for m in model.modules()] == classes and type(config) is _Config
    assert_same_tree(model.state_dict(), before)
    assert all("__class__" not in vars(m) for m in model.modules())


def test_repeated_sequentials_share_with_digit_named_state():
    """timm's GhostNet: the repeated block is an `nn.Sequential`, whose state is named `0.weight`;
    the body's placeholders must still be Python names (`0_weight` gave a SyntaxError)."""
    torch.manual_seed(0)
    make = lambda layer_idx: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU())  # noqa: E731
    ep = check_gradients(Stack(4, make=make), (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.3"]
    placeholders = [n.target for n in ep.graph_module.repeated_body_0.graph.find_nodes(op="placeholder")]
    assert placeholders == ["_0_weight", "_0_bias", "_2_weight", "_2_bias", "x_0"]


class WideBlock(nn.Module):
    """Two of `Block` in one module: a body of 12 ops, at the real threshold."""

    def __init__(self, layer_idx: int = 0):
        super().__init__()
        self.first, self.second = Block(), Block()

    def forward(self, x):
        return self.second(self.first(x))


def test_real_threshold_inlines_small_bodies_and_every_module_like_them(monkeypatch):
    """At `MIN_BODY_OPS` a 6-op block is traced inline, once decided: its later calls are not
    keyed again, all are listed on one report, and the program is the one dedup=False gives."""
    from predispatch.trace.dedup import share

    assert share.MIN_BODY_OPS == 12
    keyed = []
    describe = share._describe
    monkeypatch.setattr(share, "_describe", lambda module, *a: keyed.append(module) or describe(module, *a))
    torch.manual_seed(0)
    model, x = Stack(5), torch.randn(2, 3, 8)
    ep = check_gradients(model, (x,))
    assert keyed == [model.layers[0]]  # the later layers are declined by signature (`_Sharing.declined`)
    assert _calls(ep) == 0
    [report] = _report(ep)
    assert report.calls == [f"layers.{i}" for i in range(5)] and report.replayed == []
    assert report.not_shared == "its body has 6 ops, fewer than 12: a replay would save nothing"
    assert graph(ep) == graph(predispatch.export(model, (x,), dedup=False))


def test_real_threshold_shares_a_body_of_twelve_ops():
    torch.manual_seed(0)
    model, x = Stack(4, make=WideBlock), torch.randn(2, 3, 8)
    ep = check_gradients(model, (x,))
    assert _replayed(ep) == ["layers.2", "layers.3"] and _calls(ep) == 4


class SharedPositionStack(Stack):
    """CoaT's pattern: one submodule registered on every layer (a shared position encoding)."""

    def __init__(self, n: int = 4):
        super().__init__(n)
        self.position = nn.Linear(8, 8)
        for layer in self.layers:
            layer.position = self.position


def test_a_submodule_registered_twice_turns_sharing_off_with_the_reason():
    """make_fx then reaches every submodule through a proxy, which a key cannot be computed
    for: nothing is intercepted, the report says why, and the program is dedup=False's."""
    torch.manual_seed(0)
    model, x = SharedPositionStack(), torch.randn(2, 3, 8)
    ep = export_and_check(model, (x,))
    [report] = _report(ep)
    assert report.module_class == "SharedPositionStack" and report.calls == [] and _calls(ep) == 0
    assert report.not_shared.startswith("the model registers one submodule under two paths (layers.0.position and layers.1.position)")
    assert list(ep.module().state_dict()) == list(model.state_dict())  # ExportSignature.state_order
    assert graph(ep) == graph(predispatch.export(model, (x,), dedup=False))


def test_folded_calls_record_the_module_stack_as_torch_does():
    """Every call of a shared body, folded after the trace or replayed, names its modules'
    classes by qualified name as make_fx does: torch.export.save refuses a class object there,
    and predispatch.save leaves such meta out."""
    torch.manual_seed(0)
    ep = predispatch.export(Stack(4, RegionBlock), (torch.randn(2, 3, 8),))
    calls = ep.graph.find_nodes(op="call_function", target=INVOKE)
    assert len(calls) == 4
    for call in calls:
        stack = call.meta["nn_module_stack"]
        assert list(stack.values())[-1][1] == "test_dedup.RegionBlock", call.name
        assert all(isinstance(path, str) and isinstance(cls, str) for path, cls in stack.values()), call.name


class _Mode(enum.Enum):
    SYMMETRIC = 1
    ASYMMETRIC = 2


class _ModeConfig:
    """A config like torchao's fake-quantize config: an enum member behind a property."""

    def __init__(self, mode: _Mode):
        self.mode = mode

    @property
    def symmetric(self) -> bool:
        return self.mode == _Mode.SYMMETRIC


class _ModeBlock(Block):
    def __init__(self, layer_idx: int = 0):
        super().__init__(config=_ModeConfig(_Mode.ASYMMETRIC if layer_idx == 4 else _Mode.SYMMETRIC), layer_idx=layer_idx)

    def forward(self, x):
        out = super().forward(x)
        return out if self.config.symmetric else out * 2


def test_an_enum_read_in_forward_keys_the_block():
    """Forward reading an enum member through a property (torchao's QAT config does): the enum is
    a constant of the key, not an object to follow (its class cannot be extended)."""
    torch.manual_seed(0)
    model = Stack(5, make=_ModeBlock)
    ep = check_gradients(model, (torch.randn(2, 3, 8),))
    assert _replayed(ep) == ["layers.2", "layers.3"]  # layers.4 reads ASYMMETRIC: a key of its own
