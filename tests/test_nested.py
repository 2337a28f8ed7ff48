"""Jagged nested tensors (`layout=torch.jagged`): inputs, outputs and built in forward, the
jagged length a symbol of the program (Note [Jagged nested tensors] in
predispatch/frontend/subclasses.py); what torch cannot trace, refused by name.

Each program runs at its example and at three other lengths and batch sizes, bitwise equal to
eager; its graph holds plain tensors only.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch.export import Dim

import predispatch
from predispatch.errors import DynamicShapeError, InputMismatchError, UnsupportedConstructError, UnsupportedInputError
from predispatch.frontend.subclasses import is_subclass

from helpers import assert_verified, graph, on_golden_torch, state_bits

#: (lengths of the sequences) at export, and three other batches: other total lengths and batch sizes
EXAMPLE, OTHERS = [3, 4, 3], ([2, 5], [1, 6, 2, 4], [7, 3, 5, 2, 6])
#: the same for jagged tensors that cache their shortest length, a symbol: 1 is a size the trace
#: excludes (torch's 0/1 specialization), so a batch holding a sequence of one token is another program
LISTED = ([2, 5], [3, 6, 2, 4], [7, 3, 5, 2, 6])



def golden(text: str, expected: str) -> None:
    """A printed graph or signature against its golden, on the release goldens are written on
    (node order and names differ on others: tests/helpers.py GOLDEN_TORCH); the numeric checks
    run on every release."""
    if on_golden_torch():
        assert_expected_inline(text, expected, skip=1)

def jagged(lengths: list[int], dim: int = 8, seed: int = 0, **kwargs) -> torch.Tensor:
    """A jagged tensor of `len(lengths)` sequences of `dim` features, from its values and offsets."""
    torch.manual_seed(seed)
    values = torch.randn(sum(lengths), dim)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return torch.nested.nested_tensor_from_jagged(values, offsets, **kwargs)


def listed(lengths: list[int], dim: int = 8, seed: int = 0, **kwargs) -> torch.Tensor:
    """A jagged tensor made from a list of sequences (it caches its min and max sequence length)."""
    torch.manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, dim) for n in lengths], layout=torch.jagged, **kwargs)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Both jagged tensors, of the same size (nested int included: the same offsets tensor, where
    both come from one) and offsets, and bitwise equal values."""
    assert type(actual) is type(expected) is torch.nested._internal.nested_tensor.NestedTensor
    if actual.offsets() is expected.offsets():
        assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert torch.equal(actual.offsets(), expected.offsets()) and actual._ragged_idx == expected._ragged_idx
    torch.testing.assert_close(actual.values(), expected.values(), rtol=0, atol=0)


def plain_graph(ep: predispatch.ExportedProgram) -> None:
    for node in ep.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            assert not is_subclass(value) and not value.is_nested, node


class TokenMLP(torch.nn.Module):
    """An MLP applied to every token, with a per-head view of the features on the way."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x)).unflatten(-1, (2, 8))
        return x + self.down(torch.relu(h).flatten(-2))


def test_mlp_over_jagged_input_at_other_lengths_and_batch_sizes():
    m, x = TokenMLP(), jagged(EXAMPLE)
    torch._dynamo.mark_dynamic(x.offsets(), 0)  # the batch too; the jagged length is dynamic anyway
    before = state_bits(m)
    ep = predispatch.export(m, (x,))
    plain_graph(ep)
    assert_verified(ep)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    golden(
        graph(ep),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, p_up_weight: "f32[16, 8]", p_up_bias: "f32[16]", p_down_weight: "f32[8, 16]", p_down_bias: "f32[8]", p_norm_weight: "f32[8]", p_norm_bias: "f32[8]", x___values: "f32[s1, 8]", x___offsets: "i64[s72]"):
        sym_size_int: "Sym(s1)" = torch.ops.aten.sym_size.int(x___values, 0)
        native_layer_norm = torch.ops.aten.native_layer_norm.default(x___values, [8], p_norm_weight, p_norm_bias, 1e-05);  p_norm_weight = p_norm_bias = None
        getitem: "f32[s1, 8]" = native_layer_norm[0];  native_layer_norm = None
        linear: "f32[s1, 16]" = torch.ops.aten.linear.default(getitem, p_up_weight, p_up_bias);  getitem = p_up_weight = p_up_bias = None
        view: "f32[s1, 2, 8]" = torch.ops.aten.view.default(linear, [sym_size_int, 2, 8]);  linear = None
        relu: "f32[s1, 2, 8]" = torch.ops.aten.relu.default(view);  view = None
        view_1: "f32[s1, 16]" = torch.ops.aten.view.default(relu, [sym_size_int, 16]);  relu = sym_size_int = None
        linear_1: "f32[s1, 8]" = torch.ops.aten.linear.default(view_1, p_down_weight, p_down_bias);  view_1 = p_down_weight = p_down_bias = None
        add_5: "f32[s1, 8]" = torch.ops.aten.add.Tensor(x___values, linear_1);  x___values = linear_1 = None
        return (add_5, x___offsets)""",
    )
    golden(
        str(ep.signature),
        """\
Inputs:
    p_up_weight: PARAMETER target='up.weight'
    p_up_bias: PARAMETER target='up.bias'
    p_down_weight: PARAMETER target='down.weight'
    p_down_bias: PARAMETER target='down.bias'
    p_norm_weight: PARAMETER target='norm.weight'
    p_norm_bias: PARAMETER target='norm.bias'
    x___values: USER_INPUT target='x' inner='_values'
    x___offsets: USER_INPUT target='x' inner='_offsets'
Outputs:
    add_5: USER_OUTPUT target='output' inner='_values'
    x___offsets: USER_OUTPUT target='output' inner='_offsets'
Tensor subclasses (the graph computes on their parts):
    x: torch.nested._internal.nested_tensor.NestedTensor(_values, _offsets)
    output: torch.nested._internal.nested_tensor.NestedTensor(_values, _offsets)
Range constraints:
    s1: [2, inf]  (x___values.size()[0])
    s72: [2, inf]  (x___offsets.size()[0])""",
    )
    program = ep.module()
    for lengths in (EXAMPLE, *OTHERS):
        y = jagged(lengths, seed=len(lengths))
        out = program(y)
        assert_same(out, m(y))
        assert out.offsets() is y.offsets()  # the call's own jagged dimension: out + y works, as in eager
        assert_same(out + y, m(y) + y)


class Built(torch.nn.Module):
    """Forward builds the jagged tensor from its values and offsets, and returns one."""

    def __init__(self):
        super().__init__()
        self.mlp = TokenMLP()

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.nested.nested_tensor_from_jagged(values, offsets))


def test_mlp_over_jagged_tensor_built_in_forward():
    m, x = Built(), jagged(EXAMPLE)
    ep = predispatch.export(m, (x.values(), x.offsets()), dynamic_shapes=({0: Dim("tokens")}, {0: Dim("batch_1")}))
    plain_graph(ep)
    golden(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_mlp_up_weight: "f32[16, 8]", p_mlp_up_bias: "f32[16]", p_mlp_down_weight: "f32[8, 16]", p_mlp_down_bias: "f32[8]", p_mlp_norm_weight: "f32[8]", p_mlp_norm_bias: "f32[8]", values: "f32[s59, 8]", offsets: "i64[s33]"):
        sym_size_int: "Sym(s59)" = torch.ops.aten.sym_size.int(values, 0)
        native_layer_norm = torch.ops.aten.native_layer_norm.default(values, [8], p_mlp_norm_weight, p_mlp_norm_bias, 1e-05);  p_mlp_norm_weight = p_mlp_norm_bias = None
        getitem: "f32[s59, 8]" = native_layer_norm[0];  native_layer_norm = None
        linear: "f32[s59, 16]" = torch.ops.aten.linear.default(getitem, p_mlp_up_weight, p_mlp_up_bias);  getitem = p_mlp_up_weight = p_mlp_up_bias = None
        view: "f32[s59, 2, 8]" = torch.ops.aten.view.default(linear, [sym_size_int, 2, 8]);  linear = None
        relu: "f32[s59, 2, 8]" = torch.ops.aten.relu.default(view);  view = None
        view_1: "f32[s59, 16]" = torch.ops.aten.view.default(relu, [sym_size_int, 16]);  relu = sym_size_int = None
        linear_1: "f32[s59, 8]" = torch.ops.aten.linear.default(view_1, p_mlp_down_weight, p_mlp_down_bias);  view_1 = p_mlp_down_weight = p_mlp_down_bias = None
        add_5: "f32[s59, 8]" = torch.ops.aten.add.Tensor(values, linear_1);  values = linear_1 = None
        return (add_5, offsets)""")
    program = ep.module()
    for lengths in (EXAMPLE, *OTHERS):
        y = jagged(lengths, seed=len(lengths))
        values, offsets = y.values().clone(), y.offsets()
        out = program(values, offsets)
        assert_same(out, m(values, offsets))
        assert out.offsets() is offsets


def test_gradients_in_module_and_joint():
    """Parameters and the jagged input get eager's gradients: the program's, computed on the
    parts, are eager's (no barrier: `PLAIN_GRADIENTS`), and `values()` keeps its gradient."""

    class Loss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = TokenMLP()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp(x).values().square().mean()

    m = Loss()
    x = listed(EXAMPLE, requires_grad=True)
    torch._dynamo.mark_dynamic(x.offsets(), 0)
    ep = predispatch.export(m, (x,))
    assert "subclass_gradient_barrier" not in graph(ep)
    eager, program = copy.deepcopy(m), ep.module()
    for lengths in (EXAMPLE, *LISTED):
        x1, x2 = listed(lengths, seed=1, requires_grad=True), listed(lengths, seed=1, requires_grad=True)
        eager.zero_grad(), m.zero_grad()
        eager(x1).backward()
        program(x2).backward()
        for (name, a), b in zip(m.named_parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
        assert_same(x2.grad, x1.grad)
    joint = ep.joint()
    plain_graph(joint)
    loss, grads = joint.module()(x)
    eager.zero_grad()
    expected = eager(x)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)
    for name, p in eager.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0, msg=name)
    grad_of_x = [s for s in joint.signature.outputs if s.kind.name == "GRADIENT_TO_USER_INPUT"]
    assert [(s.target, s.inner) for s in grad_of_x] == [("x", "_values")]


def test_cached_sequence_lengths_are_inputs_and_guards_are_checked():
    """A jagged tensor from a list caches its min and max sequence length as sizes of two
    parts: softmax over the jagged dimension reads them, and they are symbols too."""
    x = listed(EXAMPLE)
    torch._dynamo.mark_dynamic(x.offsets(), 0)
    ep = predispatch.export(lambda x: x.softmax(dim=1) * 2, (x,))
    assert_expected_inline(
        str(ep.signature.shapes),
        """\
Range constraints:
    s1: [2, inf]  (x___values.size()[0])
    s34: [2, inf]  (x___min_seqlen_tensor.size()[0])
    s57: [2, inf]  (x___max_seqlen_tensor.size()[0])
    s72: [2, inf]  (x___offsets.size()[0])
Shape guards:
    Ne(s72 - 1, 1)""",
    )
    program = ep.module()
    for lengths in LISTED:
        y = listed(lengths, seed=2)
        assert_same(program(y), y.softmax(dim=1) * 2)
    with pytest.raises(DynamicShapeError, match=r"traced for Ne\(s72 - 1, 1\), which is false for s72 = 2"):
        program(listed([5]))  # one sequence: the trace assumed a batch of several


def test_a_call_with_another_jagged_layout_is_refused():
    x = jagged(EXAMPLE)
    program = predispatch.export(TokenMLP(), (x,)).module()
    with pytest.raises(InputMismatchError, match=r"input 'x._offsets' was exported as torch.int64 \(4,\) and is torch.int64 \(3,\) now"):
        program(jagged([2, 5]))
    with pytest.raises(InputMismatchError, match=r"torch._dynamo.mark_dynamic\(x._offsets, 0\) before export"):
        program(jagged([2, 5]))
    with pytest.raises(InputMismatchError, match=r"made of \['_values', '_offsets', '_min_seqlen_tensor', '_max_seqlen_tensor'\]"):
        program(listed(EXAMPLE))
    with pytest.raises(InputMismatchError, match=r"flatten context is \{'requires_grad': False, 'ragged_idx': 2\}"):
        program(torch.nested.nested_tensor_from_jagged(torch.randn(3, 10, 8), x.offsets(), jagged_dim=2))
    with pytest.raises(InputMismatchError, match=r"input 'x._values' was exported as torch.float32"):
        program(torch.nested.nested_tensor_from_jagged(x.values().double(), x.offsets()))


# --- attention over jagged sequences ---------------------------------------------------------


class Attention(torch.nn.Module):
    """Self-attention over each sequence of a jagged batch."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(-1, (2, 4)).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2)


class PaddedAttention(Attention):
    """The refusal's fix: the same attention on the padded batch, masked by the lengths."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = x.to_padded_tensor(0.0)
        keep = torch.arange(p.shape[1]) < x.offsets().diff()[:, None]
        q, k, v = (proj(p).unflatten(-1, (2, 4)).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
        return out.transpose(1, 2).flatten(-2) * keep[..., None]


def test_attention_over_jagged_sequences_is_refused_by_name_and_its_fix_exports():
    x = listed(EXAMPLE)
    m = Attention()
    m(x)  # eager runs it (torch's math kernel on CPU)
    before = state_bits(m)
    with pytest.raises(UnsupportedConstructError, match="scaled_dot_product_attention over jagged nested tensors") as err:
        predispatch.export(m, (x,))
    assert "test_nested.py" in str(err.value) and "to_padded_tensor" in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    fixed = PaddedAttention()
    torch._dynamo.mark_dynamic(x.offsets(), 0)
    program = predispatch.export(fixed, (x,)).module()
    for lengths in (EXAMPLE, *LISTED):
        y = listed(lengths, seed=3)
        torch.testing.assert_close(program(y), fixed(y), rtol=0, atol=0)
        expected = Attention()(y).to_padded_tensor(0.0)  # the fix computes eager's attention
        torch.testing.assert_close(program(y), expected, rtol=1e-5, atol=1e-6)


# --- refused by name -------------------------------------------------------------------------


def test_jagged_constructs_torch_cannot_trace_are_refused_by_name():
    x = jagged(EXAMPLE)
    with pytest.raises(UnsupportedConstructError, match=r"needs its minimum or maximum sequence length") as err:
        predispatch.export(lambda v, o: torch.nested.nested_tensor_from_jagged(v, o).softmax(dim=1), (x.values(), x.offsets()))
    assert "max_seqlen=" in str(err.value)
    # the fix: the lengths given where the jagged tensor is built
    fixed = lambda v, o: torch.nested.nested_tensor_from_jagged(v, o, min_seqlen=3, max_seqlen=4).softmax(dim=1)  # noqa: E731
    assert_same(predispatch.export(fixed, (x.values(), x.offsets())).module()(x.values(), x.offsets()), fixed(x.values(), x.offsets()))
    padded, starts, lengths = torch.randn(3, 6, 8), torch.tensor([0, 1, 0]), torch.tensor([3, 2, 4])
    narrow = lambda p, s, n: torch.nested.narrow(p, 1, s, n, layout=torch.jagged) * 2  # noqa: E731
    narrow(padded, starts, lengths)
    with pytest.raises(UnsupportedConstructError, match=r"torch.nested.narrow\(..., layout=torch.jagged\)"):
        predispatch.export(narrow, (padded, starts, lengths))
    a, b = torch.randn(3, 8), torch.randn(5, 8)
    strided = lambda a, b: torch.nested.nested_tensor([a, b]).to_padded_tensor(0.0)  # noqa: E731
    strided(a, b)
    with pytest.raises(UnsupportedConstructError, match="a nested tensor of the strided layout") as err:
        predispatch.export(strided, (a, b))
    assert "layout=torch.jagged" in str(err.value)


def test_jagged_inputs_refused_by_name():
    a, b = torch.randn(3, 8), torch.randn(5, 8)
    with pytest.raises(UnsupportedInputError, match="input 'x' is a nested tensor of the strided layout"):
        predispatch.export(lambda x: x.to_padded_tensor(0.0), (torch.nested.nested_tensor([a, b]),))
    x = jagged(EXAMPLE)
    y = torch.nested.nested_tensor_from_jagged(torch.randn(10, 8), x.offsets())  # x's jagged dimension
    with pytest.raises(UnsupportedInputError, match="input 'y._offsets' is the same tensor as input 'x._offsets'") as err:
        predispatch.export(lambda x, y: x * y, (x, y))
    # the fix: one jagged input, the other built in forward with its offsets
    fixed = lambda x, v: x * torch.nested.nested_tensor_from_jagged(v, x.offsets())  # noqa: E731
    assert "nested_tensor_from_jagged(values, x.offsets())" in str(err.value)
    assert_same(predispatch.export(fixed, (x, y.values())).module()(x, y.values()), x * y)
    with pytest.raises(UnsupportedInputError, match="takes no dynamic_shapes"):
        predispatch.export(TokenMLP(), (x,), dynamic_shapes=({0: Dim("batch")},))
