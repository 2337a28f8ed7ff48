"""Code users write that export used to get wrong or refuse uselessly (issue 23).

Each pattern: a golden graph, outputs and gradients against eager, the module untouched by
export (`export_and_check`), and torch.export's behaviour where it is the reference; or the
pinned refusal naming the construct.
"""

from __future__ import annotations

import copy
import gc
import io
from unittest import mock

import pytest
import torch
from torch._higher_order_ops import while_loop
from expecttest import TestCase
from helpers import check_gradients, export_and_check, graph, on_golden_torch, round_trip, stable_message
from predispatch.passes import mutable_ops
from torch import nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch.errors import SharedStorageError, UnsupportedConstructError


def _run(module: nn.Module, *args: torch.Tensor) -> tuple:
    """Two calls (the second sees the first's writes) and the state after them."""
    return module(*args), module(*args), {k: v.clone() for k, v in module.state_dict().items()}


def _assert_same_runs(actual: tuple, expected: tuple) -> None:
    for a, e in zip(actual[:2], expected[:2]):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert actual[2].keys() == expected[2].keys()
    for key in expected[2]:
        torch.testing.assert_close(actual[2][key], expected[2][key], rtol=0, atol=0, msg=key)


# --- state that shares storage (Note [State that shares storage]) ---------------------------


class RowOfWeight(nn.Module):
    """A buffer that is a view of a parameter, written under no_grad before the parameter is read."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(12.0).view(4, 3) / 10)
        self.register_buffer("row", self.w.detach()[1])

    def forward(self, x):
        with torch.no_grad():
            self.row.add_(1.0)
        return x @ self.w.t()


class HeadOfBuffer(nn.Module):
    """A tensor attribute that is a slice of a buffer, written; the buffer is read."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(6))
        self.head = self.buf[2:4]

    def forward(self, x):
        self.head.add_(x)
        return self.buf * 2


class ColumnOfBuffer(nn.Module):
    """A strided view (a column) of a buffer, written through a further view of it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(12.0).view(3, 4))
        self.register_buffer("col", self.table[:, 1])

    def forward(self, x):
        self.col[1:].mul_(x)
        return self.table.sum(0)


class SharedStorage(TestCase):
    maxDiff = None

    def test_buffer_view_of_parameter(self):
        x = torch.randn(2, 3)
        ep = export_and_check(RowOfWeight(), (x,), eager=RowOfWeight())
        check_gradients(RowOfWeight(), (x,), eager=RowOfWeight())
        # ep.module() shares the exported model's tensors, which the checks above ran: a fresh export
        _assert_same_runs(_run(predispatch.export(RowOfWeight(), (x,)).module(), x), _run(RowOfWeight(), x))
        # torch.export gets it right too (its graph keeps the in-place add_)
        _assert_same_runs(_run(torch.export.export(RowOfWeight(), (x,)).module(), x), _run(RowOfWeight(), x))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, p_w: "f32[4, 3]", b_row: "f32[3]", x: "f32[2, 3]"):
            detach: "f32[4, 3]" = torch.ops.aten.detach.default(p_w)
            view: "f32[12]" = torch.ops.aten.view.default(detach, [-1]);  detach = None
            slice_1: "f32[3]" = torch.ops.aten.slice.Tensor(view, 0, 3, 6);  view = None
            grad_region_0 = self.grad_region_0
            wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, slice_1, p_w);  grad_region_0 = slice_1 = None
            view_2: "f32[4, 3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
            keep_history: "f32[4, 3]" = torch.ops.predispatch.keep_history.default(view_2, p_w);  view_2 = p_w = None
            t_1: "f32[3, 4]" = torch.ops.aten.t.default(keep_history)
            matmul: "f32[2, 4]" = torch.ops.aten.matmul.default(x, t_1);  x = t_1 = None
            detach_4: "f32[4, 3]" = torch.ops.aten.detach.default(keep_history)
            view_5: "f32[12]" = torch.ops.aten.view.default(detach_4, [-1]);  detach_4 = None
            slice_4: "f32[3]" = torch.ops.aten.slice.Tensor(view_5, 0, 3, 6);  view_5 = None
            return (keep_history, slice_4, matmul)

        class grad_region_0(torch.nn.Module):
            def forward(self, slice_1: "f32[3]", p_w: "f32[4, 3]"):
                add: "f32[3]" = torch.ops.aten.add.Tensor(slice_1, 1.0);  slice_1 = None
                detach_1: "f32[4, 3]" = torch.ops.aten.detach.default(p_w);  p_w = None
                view_1: "f32[12]" = torch.ops.aten.view.default(detach_1, [-1]);  detach_1 = None
                slice_scatter: "f32[12]" = torch.ops.aten.slice_scatter.default(view_1, add, 0, 3, 6);  view_1 = add = None
                view_2: "f32[4, 3]" = torch.ops.aten.view.default(slice_scatter, [4, 3]);  slice_scatter = None
                return (view_2,)

Graph signature:
    Inputs:
        p_w: PARAMETER target='w'
        b_row: BUFFER target='row'
        x: USER_INPUT target='x'
    Outputs:
        keep_history: PARAMETER_MUTATION target='w'
        slice_4: BUFFER_MUTATION target='row'
        matmul: USER_OUTPUT target='output'""")

    def test_attribute_view_of_buffer(self):
        x = torch.randn(2)
        ep = export_and_check(HeadOfBuffer(), (x,), eager=HeadOfBuffer())
        # ep.module() shares the exported model's tensors, which the checks above ran: a fresh export
        _assert_same_runs(_run(predispatch.export(HeadOfBuffer(), (x,)).module(), x), _run(HeadOfBuffer(), x))
        _assert_same_runs(_run(torch.export.export(HeadOfBuffer(), (x,)).module(), x), _run(HeadOfBuffer(), x))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, b_buf: "f32[6]", c_head: "f32[2]", x: "f32[2]"):
        detach: "f32[6]" = torch.ops.aten.detach.default(b_buf)
        slice_1: "f32[2]" = torch.ops.aten.slice.Tensor(detach, 0, 2, 4);  detach = None
        add: "f32[2]" = torch.ops.aten.add.Tensor(slice_1, x);  slice_1 = x = None
        detach_1: "f32[6]" = torch.ops.aten.detach.default(b_buf);  b_buf = None
        slice_scatter: "f32[6]" = torch.ops.aten.slice_scatter.default(detach_1, add, 0, 2, 4);  detach_1 = add = None
        mul: "f32[6]" = torch.ops.aten.mul.Tensor(slice_scatter, 2)
        detach_4: "f32[6]" = torch.ops.aten.detach.default(slice_scatter)
        slice_4: "f32[2]" = torch.ops.aten.slice.Tensor(detach_4, 0, 2, 4);  detach_4 = None
        return (slice_scatter, slice_4, mul)""")
        kinds = [(s.kind.name, s.target) for s in ep.signature.mutations]
        self.assertEqual(kinds, [("BUFFER_MUTATION", "buf"), ("BUFFER_MUTATION", "head")])

    def test_strided_view_written_through_a_view(self):
        x = torch.randn(2)
        ep = export_and_check(ColumnOfBuffer(), (x,), eager=ColumnOfBuffer())
        # ep.module() shares the exported model's tensors, which the checks above ran: a fresh export
        _assert_same_runs(_run(predispatch.export(ColumnOfBuffer(), (x,)).module(), x), _run(ColumnOfBuffer(), x))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, b_table: "f32[3, 4]", b_col: "f32[3]", x: "f32[2]"):
        detach: "f32[3, 4]" = torch.ops.aten.detach.default(b_table)
        view: "f32[12]" = torch.ops.aten.view.default(detach, [-1]);  detach = None
        slice_1: "f32[3]" = torch.ops.aten.slice.Tensor(view, 0, 1, 10, 4);  view = None
        slice_2: "f32[2]" = torch.ops.aten.slice.Tensor(slice_1, 0, 1, 9223372036854775807);  slice_1 = None
        mul: "f32[2]" = torch.ops.aten.mul.Tensor(slice_2, x);  slice_2 = x = None
        detach_1: "f32[3, 4]" = torch.ops.aten.detach.default(b_table);  b_table = None
        view_1: "f32[12]" = torch.ops.aten.view.default(detach_1, [-1]);  detach_1 = None
        slice_3: "f32[3]" = torch.ops.aten.slice.Tensor(view_1, 0, 1, 10, 4)
        slice_scatter: "f32[3]" = torch.ops.aten.slice_scatter.default(slice_3, mul, 0, 1, 9223372036854775807);  slice_3 = mul = None
        slice_scatter_1: "f32[12]" = torch.ops.aten.slice_scatter.default(view_1, slice_scatter, 0, 1, 10, 4);  view_1 = slice_scatter = None
        view_2: "f32[3, 4]" = torch.ops.aten.view.default(slice_scatter_1, [3, 4]);  slice_scatter_1 = None
        sum_1: "f32[4]" = torch.ops.aten.sum.dim_IntList(view_2, [0])
        detach_4: "f32[3, 4]" = torch.ops.aten.detach.default(view_2)
        view_5: "f32[12]" = torch.ops.aten.view.default(detach_4, [-1]);  detach_4 = None
        slice_7: "f32[3]" = torch.ops.aten.slice.Tensor(view_5, 0, 1, 10, 4);  view_5 = None
        return (view_2, slice_7, sum_1)""")

    def test_block_view_refused(self):
        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.register_buffer("table", torch.zeros(3, 4))
                self.register_buffer("block", self.table[:, 1:3])

            def forward(self, x):
                return self.block + x

        with pytest.raises(SharedStorageError) as info:
            predispatch.export(Block(), (torch.randn(3, 2),))
        self.assertExpectedInline(stable_message(info.value), """\
'block' is a view of 'table' that is neither contiguous nor one strided dimension (shape (3, 2), strides (4, 1)); export lifts shared state as such views only.
  at test_patterns.py:N (predispatch.export(Block(), (torch.randn(3, 2),))) (the export call)
  fix: keep 'block' out of the module's state and take the view inside forward (e.g. table[:, 1:3]), or give it its own memory (.clone()).
  see docs/errors.md#sharedstorageerror""")

    def test_overlapping_parameters_refused(self):
        class TwoWindows(nn.Module):
            def __init__(self):
                super().__init__()
                t = torch.arange(6.0)
                self.a = nn.Parameter(t[:4])
                self.b = nn.Parameter(t[2:])

            def forward(self, x):
                return x * self.a.sum() + self.b.sum()

        with pytest.raises(SharedStorageError) as info:
            predispatch.export(TwoWindows(), (torch.randn(2),))
        self.assertExpectedInline(stable_message(info.value), """\
the module's tensors 'a', 'b' share memory, and none of them holds the others' memory whole; export lifts overlapping state as views of one tensor.
  at test_patterns.py:N (predispatch.export(TwoWindows(), (torch.randn(2),))) (the export call)
  fix: register the tensor they are all views of as a buffer too (or make them views of one of them), or give each its own memory with .clone().
  see docs/errors.md#sharedstorageerror""")

    def test_parameter_view_of_parameter_refused(self):
        class Halves(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(4))
                self.first = nn.Parameter(self.w.detach()[:2])

            def forward(self, x):
                return x * self.w.sum() + self.first.sum()

        with pytest.raises(SharedStorageError, match="parameter 'first' shares memory with 'w'"):
            predispatch.export(Halves(), (torch.randn(2),))

    def test_disjoint_views_stay_independent(self):
        class Flat(nn.Module):
            def __init__(self):
                super().__init__()
                flat = torch.zeros(6)
                self.register_buffer("a", flat[:3])
                self.register_buffer("b", flat[3:])

            def forward(self, x):
                self.a.add_(x)
                return self.b + 1

        ep = export_and_check(Flat(), (torch.randn(3),), eager=Flat())
        self.assertEqual([s.target for s in ep.signature.mutations], ["a"])


# --- writes through a detached alias (Note [Writes through a detached alias]) --------------


class DetachedScale(nn.Module):
    def __init__(self, through_data: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.arange(9.0).view(3, 3) / 10)
        self.through_data = through_data

    def forward(self, x):
        alias = self.w.data if self.through_data else self.w.detach()
        alias.mul_(0.5)
        return x @ self.w


class RenormedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, max_norm=1.0)

    def forward(self, ids):
        return self.emb(ids) * 2


class DetachedWrites(TestCase):
    maxDiff = None

    def test_write_through_detach(self):
        x = torch.randn(2, 3)
        ep = export_and_check(DetachedScale(), (x,))
        check_gradients(DetachedScale(), (x,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_w: "f32[3, 3]", x: "f32[2, 3]"):
        detach: "f32[3, 3]" = torch.ops.aten.detach.default(p_w)
        mul: "f32[3, 3]" = torch.ops.aten.mul.Tensor(detach, 0.5);  detach = None
        keep_history: "f32[3, 3]" = torch.ops.predispatch.keep_history.default(mul, p_w);  mul = p_w = None
        matmul: "f32[2, 3]" = torch.ops.aten.matmul.default(x, keep_history);  x = None
        return (keep_history, matmul)""")

    def test_write_through_data(self):
        x = torch.randn(2, 3)
        ep = export_and_check(DetachedScale(through_data=True), (x,))
        check_gradients(DetachedScale(through_data=True), (x,))
        self.assertEqual(graph(ep), graph(predispatch.export(DetachedScale(), (x,))))

    def test_embedding_max_norm(self):
        ids = torch.tensor([1, 2, 1, 7])
        ep = export_and_check(RenormedEmbedding(), (ids,))
        check_gradients(RenormedEmbedding(), (ids,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_emb_weight: "f32[10, 4]", ids: "i64[4]"):
        detach: "f32[10, 4]" = torch.ops.aten.detach.default(p_emb_weight)
        embedding_renorm: "f32[10, 4]" = torch.ops.aten.embedding_renorm.default(detach, ids, 1.0, 2.0);  detach = None
        keep_history: "f32[10, 4]" = torch.ops.predispatch.keep_history.default(embedding_renorm, p_emb_weight);  embedding_renorm = p_emb_weight = None
        embedding: "f32[4, 4]" = torch.ops.aten.embedding.default(keep_history, ids);  ids = None
        mul: "f32[4, 4]" = torch.ops.aten.mul.Tensor(embedding, 2);  embedding = None
        return (keep_history, mul)""")

    def test_data_read_has_no_gradient(self):
        class ReadData(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(3))

            def forward(self, x):
                return x * self.w.data + self.w

        check_gradients(ReadData(), (torch.randn(3),))

    def test_detach_of_a_detached_alias(self):
        """The second detach's source is already a detached alias, a tensor: the keeper asked for
        its truth value (a RuntimeError the trace reported as a failure of this line)."""

        class TwiceDetached(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(3))

            def forward(self, x):
                y = self.w * x
                return y.detach().detach() + y

        export_and_check(TwiceDetached(), (torch.randn(3),))
        check_gradients(TwiceDetached(), (torch.randn(3),))


# --- torch.inference_mode() inside forward (Note [inference_mode in forward]) --------------


class InferenceBranch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        with torch.inference_mode():
            frozen = self.lin(x)
        return frozen * 2 + self.lin(x)


class InferenceDecorated(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    @torch.inference_mode()
    def _frozen(self, x):
        with torch.inference_mode(False):  # grad back on inside: eager differentiates this part
            inner = x.sin()
        return self.lin(x), inner

    def forward(self, x):
        frozen, inner = self._frozen(x)
        return frozen + inner + self.lin(x)


class InferenceModeRegions(TestCase):
    maxDiff = None

    def test_inference_mode_is_a_no_grad_region(self):
        x = torch.randn(2, 3)
        ep = check_gradients(InferenceBranch(), (x,))
        export_and_check(InferenceBranch(), (x,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", x: "f32[2, 3]"):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x, p_lin_weight, p_lin_bias);  grad_region_0 = None
        linear: "f32[2, 3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(linear, 2);  linear = None
        linear_1: "f32[2, 3]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(mul, linear_1);  mul = linear_1 = None
        return (add,)

    class grad_region_0(torch.nn.Module):
        def forward(self, x: "f32[2, 3]", p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]"):
            linear: "f32[2, 3]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
            return (linear,)""")

    def test_decorator_and_nested_false(self):
        x = torch.randn(2, 3)
        ep = check_gradients(InferenceDecorated(), (x,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", x: "f32[2, 3]"):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled_1 = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x, p_lin_weight, p_lin_bias);  grad_region_0 = None
        sin: "f32[2, 3]" = wrap_with_set_grad_enabled_1[0]
        linear: "f32[2, 3]" = wrap_with_set_grad_enabled_1[1];  wrap_with_set_grad_enabled_1 = None
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(linear, sin);  linear = sin = None
        linear_1: "f32[2, 3]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
        add_1: "f32[2, 3]" = torch.ops.aten.add.Tensor(add, linear_1);  add = linear_1 = None
        return (add_1,)

    class grad_region_0(torch.nn.Module):
        def forward(self, x: "f32[2, 3]", p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]"):
            grad_region_1 = self.grad_region_1
            wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(True, grad_region_1, x);  grad_region_1 = None
            sin: "f32[2, 3]" = wrap_with_set_grad_enabled[0];  wrap_with_set_grad_enabled = None
            linear: "f32[2, 3]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
            return (sin, linear)

        class grad_region_1(torch.nn.Module):
            def forward(self, x: "f32[2, 3]"):
                sin: "f32[2, 3]" = torch.ops.aten.sin.default(x);  x = None
                return (sin,)""")


# --- refused by name (trace/constructs.py) ----------------------------------------------------


class Refusals(TestCase):
    maxDiff = None

    def test_torchscript_submodule(self):
        class Scripted(nn.Module):
            def __init__(self):
                super().__init__()
                self.net = torch.jit.script(nn.Linear(3, 3))

            def forward(self, x):
                return self.net(x)

        with pytest.raises(UnsupportedConstructError) as info:
            predispatch.export(Scripted(), (torch.randn(2, 3),))
        self.assertExpectedInline(stable_message(info.value), """\
submodule 'net' is a TorchScript module (torch.jit.script / torch.jit.trace); export traces Python code, and a scripted module runs in TorchScript's interpreter.
  at test_patterns.py:N (predispatch.export(Scripted(), (torch.randn(2, 3),))) (the export call)
  fix: export the original nn.Module (before torch.jit.script), e.g. keep a reference to it and assign that as the submodule for export.
  see docs/errors.md#unsupportedconstructerror""")


def _encoder(nested: bool) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()


class EncoderFastPath(TestCase):
    maxDiff = None
    x = torch.randn(2, 5, 8)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])

    def test_nested_fast_path_refused(self):
        """Eager under no_grad zeroes padded positions (nested tensors); the program cannot."""
        encoder = _encoder(nested=True)
        with torch.no_grad():
            fast = encoder(self.x, src_key_padding_mask=self.mask)
        slow = encoder(self.x, src_key_padding_mask=self.mask)
        assert torch.equal(fast[1, 3:], torch.zeros(2, 8)) and not torch.allclose(fast, slow)
        with pytest.raises(UnsupportedConstructError) as info:
            predispatch.export(encoder, (self.x,), {"src_key_padding_mask": self.mask})
        self.assertExpectedInline(stable_message(info.value), """\
nn.TransformerEncoder in eval mode with a src_key_padding_mask: eager under torch.no_grad() takes its nested-tensor fast path and returns 0 at padded positions, the exported program computes the layers there (eager's path with grad on); their outputs differ.
  at test_patterns.py:N (predispatch.export(encoder, (self.x,), {"src_key_padding_mask": self.mask}))
  fix: build the encoder with enable_nested_tensor=False (or set encoder.use_nested_tensor = False before export): eager then returns the layers' values at padded positions too, and so does the program; mask the padded positions of the output yourself if you need zeros there.
  see docs/errors.md#unsupportedconstructerror""")

    def test_without_nested_tensor_matches_eager(self):
        """The fix the refusal gives: eager's fast and slow paths then agree, and the program is eager's."""
        kwargs = {"src_key_padding_mask": self.mask}
        export_and_check(_encoder(nested=False), (self.x,), kwargs)
        program = predispatch.export(_encoder(nested=False), (self.x,), kwargs).module()
        with torch.no_grad():
            fast = _encoder(nested=False)(self.x, **kwargs)
            torch.testing.assert_close(program(self.x, **kwargs), fast)
        # torch.export's program takes the same (slow) path as ours
        exported = torch.export.export(_encoder(nested=False), (self.x,), kwargs).module()
        torch.testing.assert_close(exported(self.x, **kwargs), program(self.x, **kwargs), rtol=0, atol=0)

    def test_training_mode_is_not_refused(self):
        check_gradients(_encoder(nested=True).train(), (self.x,), {"src_key_padding_mask": self.mask})


class TraceErrorFix(TestCase):
    def test_fix_fits_the_cause(self):
        """Issue 23 (12): a raw failure's fix no longer speaks of in-place metadata changes."""

        class ToNumpy(nn.Module):
            def forward(self, x):
                return torch.from_numpy(x.numpy() * 2)

        with pytest.raises(predispatch.errors.PredispatchError) as info:
            predispatch.export(ToNumpy(), (torch.randn(2),))
        assert "metadata" not in str(info.value) and "x.t_()" not in str(info.value)

    def test_metadata_fix_where_it_fits(self):
        """A raw failure about an in-place change of shape keeps that fix."""

        class GrowsView(nn.Module):
            def forward(self, x):
                return x[:2].resize_(5).sum()

        with pytest.raises(predispatch.errors.TraceError) as info:
            predispatch.export(GrowsView(), (torch.randn(4),))
        assert info.value.fix.startswith("an in-place change of an input's shape, strides or storage")


# --- our errors for constructs torch fails on (trace/constructs.py; issue 23, 10) ------------


class PackedGRU(nn.Module):
    def __init__(self, pack: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.pack = pack

    def forward(self, x, lengths):
        if not self.pack:  # the fix the refusal gives: the padded batch, masked
            out, _ = self.rnn(x)
            return out * (torch.arange(x.shape[1]) < lengths[:, None])[..., None]
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


class GradientPenalty(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        energy = self.lin(x).pow(2).sum()
        (force,) = torch.autograd.grad(energy, x, create_graph=True)
        return force


class QuantizedInput(nn.Module):
    def __init__(self, fake_quantize: type = torch.ao.quantization.FakeQuantize):
        super().__init__()
        self.fq = fake_quantize()

    def forward(self, x):
        return self.fq(x) * 2


class NormalLogProb(nn.Module):
    def __init__(self, validate: bool = True):
        super().__init__()
        self.validate = validate

    def forward(self, mu, x):
        return torch.distributions.Normal(mu, mu.exp(), validate_args=self.validate).log_prob(x)


class ConstructErrors(TestCase):
    maxDiff = None

    def test_pack_padded_sequence(self):
        x, lengths = torch.randn(2, 5, 3), torch.tensor([5, 3])
        for lengths_arg in (lengths, [5, 3]):  # sizes from a tensor or from a list: both fail in torch
            module = PackedGRU()
            with pytest.raises(UnsupportedConstructError) as info:
                predispatch.export(module, (x, lengths_arg) if isinstance(lengths_arg, torch.Tensor) else (x, lengths))
            assert "pack_padded_sequence" in str(info.value)
        self.assertExpectedInline(stable_message(info.value), """\
forward packs a padded batch (torch.nn.utils.rnn.pack_padded_sequence / PackedSequence): the packed batch sizes come from the lengths' values, which export cannot know (it traces shapes, not values).
  at test_patterns.py:N (out, _ = self.rnn(packed))
  fix: run the RNN on the padded batch without packing and mask the steps past each length (torch.arange(T) < lengths[:, None]); a unidirectional RNN's outputs at the valid steps are the packed run's, and its final state is the output at lengths - 1 (gather it).
  see docs/errors.md#unsupportedconstructerror""")
        # the fix works: the masked padded run exports and equals eager's packed run
        export_and_check(PackedGRU(pack=False), (x, lengths), exact=False)
        program = predispatch.export(PackedGRU(pack=False), (x, lengths)).module()
        torch.testing.assert_close(program(x, lengths), PackedGRU()(x, lengths))

    def test_autograd_grad_in_forward(self):
        x = torch.randn(2, 3)
        with pytest.raises(UnsupportedConstructError) as info:
            predispatch.export(GradientPenalty(), (x,))
        self.assertExpectedInline(stable_message(info.value), """\
forward calls torch.autograd.grad (or Tensor.backward); export traces forward above autograd, where forward's tensors have no autograd graph to differentiate.
  at test_patterns.py:N ((force,) = torch.autograd.grad(energy, x, create_graph=True))
  fix: export the function without the gradient and differentiate the program's output outside it (torch.autograd.grad(ep.module()(x).sum(), x) in your training step), or write the derivative out in forward.
  see docs/errors.md#unsupportedconstructerror""")

    def test_fake_quantize_check(self):
        with pytest.raises(predispatch.errors.DataDependentError) as info:
            predispatch.export(QuantizedInput(), (torch.randn(2, 3),))
        self.assertExpectedInline(stable_message(info.value), """\
forward uses torch.ao.quantization.FakeQuantize, whose forward branches on the values of its observer_enabled and fake_quant_enabled buffers; export traces shapes, not values, so the check has no answer (it is inside torch's ao/quantization/fake_quantize.py (forward), where torch.cond cannot be applied).
  at test_patterns.py:N (return self.fq(x) * 2)
  fix: use FusedMovingAvgObsFakeQuantize (the fake quantizer of torch.ao.quantization.get_default_qat_qconfig), which reads those flags inside one op; or export the float model and quantize the program with PT2E (torch.ao.quantization.quantize_pt2e.prepare_qat_pt2e).
  see docs/errors.md#datadependenterror""")

    def test_distribution_validate_args(self):
        mu, x = torch.randn(3), torch.randn(3)
        if hasattr(torch.distributions.distribution, "_all_true_or_runtime_assert"):
            # torch 2.15: the check is a runtime assert when traced, and the program is eager's
            check_gradients(NormalLogProb(), (mu, x))
            return
        with pytest.raises(predispatch.errors.DataDependentError) as info:
            predispatch.export(NormalLogProb(), (mu, x))
        self.assertExpectedInline(stable_message(info.value), """\
forward uses a torch.distributions distribution with validate_args=True, which checks its parameters' (and log_prob's sample's) values; export traces shapes, not values, so the check has no answer (it is inside torch's distributions/distribution.py (__init__), where torch.cond cannot be applied).
  at test_patterns.py:N (return torch.distributions.Normal(mu, mu.exp(), validate_args=self.validate).log_prob(x))
  fix: build the distribution with validate_args=False (or call torch.distributions.Distribution.set_default_validate_args(False) before export), and check the values outside forward if you need to.
  see docs/errors.md#datadependenterror""")
        check_gradients(NormalLogProb(validate=False), (mu, x))  # the fix works

    def test_relaxed_distribution_leads_with_the_default_flag(self):
        """RelaxedBernoulli(..., validate_args=False) builds its inner distribution without the
        flag: the fix leads with the one that works (the default flag), and it works."""

        class RelaxedLogProb(nn.Module):
            def forward(self, logits, value):
                return torch.distributions.RelaxedBernoulli(
                    torch.tensor(0.5), logits=logits, validate_args=False).log_prob(value)

        logits, value = torch.randn(3), torch.rand(3) * 0.8 + 0.1
        if hasattr(torch.distributions.distribution, "_all_true_or_runtime_assert"):
            check_gradients(RelaxedLogProb(), (logits, value))  # torch 2.15: a runtime assert, no refusal
            return
        # torch's default (validate when not run with -O), which something the suite imports may have changed
        with mock.patch.object(torch.distributions.Distribution, "_validate_args", True), \
                pytest.raises(predispatch.errors.DataDependentError) as info:
            predispatch.export(RelaxedLogProb(), (logits, value))
        text = stable_message(info.value)
        assert "\n  at test_patterns.py:N (return torch.distributions.RelaxedBernoulli()\n" in text, text
        assert info.value.fix.startswith(
            "call torch.distributions.Distribution.set_default_validate_args(False) before export"), text
        assert "build the distribution with validate_args=False" not in text, text
        default = torch.distributions.Distribution._validate_args
        torch.distributions.Distribution.set_default_validate_args(False)
        try:
            program = predispatch.export(RelaxedLogProb(), (logits, value)).module()
        finally:
            torch.distributions.Distribution.set_default_validate_args(default)
        torch.testing.assert_close(program(logits, value), RelaxedLogProb()(logits, value))

    def test_other_torch_check_names_the_place(self):
        """A data-dependent check inside torch that has no entry: where it is, not torch.cond."""

        class GaussianLoss(nn.Module):
            def forward(self, mean, target, var):
                return nn.functional.gaussian_nll_loss(mean, target, var)  # checks var >= 0

        with pytest.raises(predispatch.errors.DataDependentError) as info:
            predispatch.export(GaussianLoss(), (torch.randn(3), torch.randn(3), torch.rand(3)))
        self.assertExpectedInline(stable_message(info.value), """\
a check inside torch's own code (nn/functional.py (gaussian_nll_loss)) reads a value inside a tensor, which export cannot know (it traces shapes, not values); torch.cond cannot be applied inside torch's code.
  at test_patterns.py:N (return nn.functional.gaussian_nll_loss(mean, target, var)  # checks var >= 0)
  fix: call that torch function with arguments that skip the check (see the named file), or outside forward on the program's inputs or outputs.
  see docs/errors.md#datadependenterror""")

    def test_users_own_branch_keeps_torch_cond(self):
        class Branch(nn.Module):
            def forward(self, x):
                return x * 2 if x.sum() > 0 else x

        with pytest.raises(predispatch.errors.DataDependentError) as info:
            predispatch.export(Branch(), (torch.randn(3),))
        assert "torch.cond" in info.value.fix


class DoublesUntil(nn.Module):
    """A data-dependent `while` loop, or (fixed) the same loop as a while_loop."""

    def __init__(self, fixed: bool = False):
        super().__init__()
        self.fixed = fixed

    def forward(self, x):
        if self.fixed:
            return while_loop(lambda x: x.sum() < 10, lambda x: (x * 2,), (x,))[0]
        while x.sum() < 10:
            x = x * 2
        return x


class DoublesNTimes(nn.Module):
    """A loop count read from a tensor, or (fixed) a while_loop over a counter."""

    def __init__(self, fixed: bool = False):
        super().__init__()
        self.fixed = fixed

    def forward(self, x, n):
        if self.fixed:
            return while_loop(lambda i, x: i < n, lambda i, x: (i + 1, x * 2), (n.new_zeros(()), x))[1]
        for _ in range(n.item()):
            x = x * 2
        return x


class DataDependentFixes(TestCase):
    """The data-dependent refusal's fix fits the statement: a loop, a loop count, a branch."""

    maxDiff = None

    def refusal(self, module, args) -> str:
        with pytest.raises(predispatch.errors.DataDependentError) as info:
            predispatch.export(module, args)
        return stable_message(info.value)

    def test_while_loop_gets_while_loop(self):
        x = torch.full((3,), 0.5)
        self.assertExpectedInline(self.refusal(DoublesUntil(), (x,)).split("\n", 1)[1], """\
  at test_patterns.py:N (while x.sum() < 10:)
  fix: write the loop with torch._higher_order_ops.while_loop: while_loop(lambda x: x.sum() < 10, body_fn, (x,)), where body_fn(x) returns the loop body's new (x,) (tensors of unchanged shapes) and while_loop returns them after the last step; torch.where and torch.cond do not loop.
  see docs/errors.md#datadependenterror""")
        program = predispatch.export(DoublesUntil(fixed=True), (x,)).module()  # the fix works
        for value in (x, torch.full((3,), 0.1), torch.full((3,), 7.0)):
            torch.testing.assert_close(program(value), DoublesUntil()(value))

    def test_loop_count_from_a_tensor_gets_a_counter(self):
        x = torch.randn(3)
        self.assertExpectedInline(self.refusal(DoublesNTimes(), (x, torch.tensor(3))).split("\n", 1)[1], """\
  at test_patterns.py:N (for _ in range(n.item()):)
  fix: the loop count n.item() is a tensor's value: loop with torch._higher_order_ops.while_loop over a counter, while_loop(lambda i, x: i < n, lambda i, x: (i + 1, <the body's new x>), (n.new_zeros(()), x))[1:], or pass the count as a Python int (export then fixes it in the program); torch.where and torch.cond do not loop.
  see docs/errors.md#datadependenterror""")
        program = predispatch.export(DoublesNTimes(fixed=True), (x, torch.tensor(3))).module()  # the fix works
        for n in (0, 3, 5):
            torch.testing.assert_close(program(x, torch.tensor(n)), DoublesNTimes()(x, torch.tensor(n)))

    def test_branch_names_the_shape_condition_and_where_works(self):
        class Branch(nn.Module):
            def forward(self, x):
                if x.sum() > 0:
                    return x * 2
                return x - 1

        class Picked(nn.Module):
            def forward(self, x):
                return torch.where(x.sum() > 0, x * 2, x - 1)

        fix = self.refusal(Branch(), (torch.randn(3),)).split("  fix: ", 1)[1]
        assert fix.startswith("compute both arms and pick with torch.where(cond, a, b)"), fix
        program = predispatch.export(Picked(), (torch.randn(3),)).module()
        for x in (torch.ones(3), -torch.ones(3)):
            torch.testing.assert_close(program(x), Branch()(x))

    def test_arms_of_different_shapes_are_told_neither_where_nor_cond(self):
        """Arms of different shapes: the fix says torch.where / torch.cond do not fit and what does
        (same shapes, or the branch out of forward); the latter works."""

        class Crop(nn.Module):
            def forward(self, x):
                if x.sum() > 0:
                    return x[:2]
                return x

        fix = self.refusal(Crop(), (torch.randn(3),)).split("  fix: ", 1)[1]
        assert "where the arms differ in shape (x[:2] vs x) neither fits" in fix, fix
        assert "make both arms the same shape (pad or mask the shorter one) or move the branch out of forward" in fix, fix
        # the branch out of forward: each arm exported, the choice made before the call
        arms = [predispatch.export(arm, (torch.randn(3),)).module() for arm in (CropArm(True), CropArm(False))]
        for x in (torch.ones(3), -torch.ones(3)):
            torch.testing.assert_close(arms[0 if x.sum() > 0 else 1](x), Crop()(x))


class CropArm(nn.Module):
    def __init__(self, crop: bool):
        super().__init__()
        self.crop = crop

    def forward(self, x):
        return x[:2] * 1 if self.crop else x * 1


class FlexAttention(nn.Module):
    """flex_attention with a score_mod, with a causal block mask built in forward, or with a
    score_mod reading a parameter by index."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.bias = nn.Parameter(torch.linspace(-1, 1, 2))

    def forward(self, q, k, v):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if self.kind == "block mask":
            mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, q.shape[2], k.shape[2], device="cpu")
            return flex_attention(q, k, v, block_mask=mask)
        if self.kind == "score_mod":
            return flex_attention(q, k, v, score_mod=lambda score, b, h, qi, ki: score + (qi - ki) * 0.1)
        return flex_attention(q, k, v, score_mod=lambda score, b, h, qi, ki: score + self.bias[h] * (qi - ki))


class CapturedTensors(nn.Module):
    """score_mod and mask_mod reading tensors they capture by index: a per-head buffer, a
    tensor computed in forward from a detached parameter, and per-position document ids (a
    document mask built in forward)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("alibi", torch.tensor([0.5, 0.25]))
        self.scale = nn.Parameter(torch.tensor([1.0, -2.0]))
        self.register_buffer("document", torch.arange(128) // 48)

    def forward(self, q, k, v):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        document, offset = self.document, self.scale.detach() * 0.01
        mask = create_block_mask(lambda b, h, qi, ki: document[qi] == document[ki], None, None, 128, 128, device="cpu")
        return flex_attention(q, k, v, score_mod=lambda score, b, h, qi, ki: score - self.alibi[h] * (qi - ki).abs() + offset[h], block_mask=mask)


HEAD_BIAS = torch.tensor([0.5, -0.5])


class GlobalHeadBias(nn.Module):
    def forward(self, q, k, v):
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, score_mod=lambda score, b, h, qi, ki: score + HEAD_BIAS[h])


class DenseAttention(nn.Module):
    """The fix the refusal gives: the same per-head bias, dense, through SDPA."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-1, 1, 2))

    def forward(self, q, k, v):
        qi, ki = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias[:, None, None] * (qi - ki))


def _flex_call(ep) -> str:
    """The flex_attention node and its subgraphs as printed (the block mask's construction,
    a hundred ops of torch's create_block_mask, left out)."""
    lines = graph(ep).splitlines()
    keep = [line for line in lines if "flex_attention" in line and "=" in line and "#" not in line]
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("class sdpa_score"))
    return "\n".join([*keep, *lines[start:]])


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
class FlexAttentionInForward(TestCase):
    """On CPU flex_attention has a backward only for tensors its score_mod captures and indexes
    (q, k, v requiring grad are refused by torch): outputs, and the refusal where that gradient
    is asked for (Note [flex_attention's captured tensors])."""

    maxDiff = None
    qkv = tuple(torch.randn(1, 2, 128, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))

    def test_score_mod_and_block_mask(self):
        for kind in ("score_mod", "block mask"):
            ep = export_and_check(FlexAttention(kind), self.qkv)
            flex = ep.graph_module.graph.find_nodes(op="call_function", target=torch.ops.higher_order.flex_attention)
            self.assertEqual(len(flex), 1)  # the HOP kept, its score_mod and mask_mod as subgraphs
            torch.testing.assert_close(ep.module()(*self.qkv), FlexAttention(kind)(*self.qkv), rtol=0, atol=0)
            torch.testing.assert_close(round_trip(ep).module()(*self.qkv), FlexAttention(kind)(*self.qkv), rtol=0, atol=0)

    def test_captured_tensors(self):
        ep = export_and_check(CapturedTensors(), self.qkv)
        if on_golden_torch():  # the block mask's tuple differs between releases
            self.assertExpectedInline(_flex_call(ep), """\
        flex_attention = torch.ops.higher_order.flex_attention(q, k, v, sdpa_score0, (128, 128, _to_copy_3, _to_copy_4, _to_copy_6, _to_copy_7, _to_copy_8, _to_copy_9, _to_copy_10, _to_copy_11, None, None, None, None, 128, 128, sdpa_mask0), 0.35355339059327373, {'BACKEND': 'AUTO', 'PRESCALE_QK': False, 'ROWS_GUARANTEED_SAFE': False, 'BLOCKS_ARE_CONTIGUOUS': False, 'WRITE_DQ': True, 'OUTPUT_LOGSUMEXP': False, 'OUTPUT_MAX': False}, (b_alibi, mul), (b_document,));  q = k = v = sdpa_score0 = _to_copy_3 = _to_copy_4 = _to_copy_6 = _to_copy_7 = _to_copy_8 = _to_copy_9 = _to_copy_10 = _to_copy_11 = sdpa_mask0 = b_alibi = mul = b_document = None
        getitem: "f32[1, 2, 128, 8]" = flex_attention[0];  flex_attention = None
    class sdpa_score0(torch.nn.Module):
        def forward(self, arg0_1: "f32[]", arg1_1: "i32[]", arg2_1: "i32[]", arg3_1: "i32[]", arg4_1: "i32[]", arg5_1: "f32[2]", arg6_1: "f32[2]"):
            index: "f32[]" = torch.ops.aten.index.Tensor(arg5_1, [arg2_1]);  arg5_1 = None
            sub: "i32[]" = torch.ops.aten.sub.Tensor(arg3_1, arg4_1);  arg3_1 = arg4_1 = None
            abs_1: "i32[]" = torch.ops.aten.abs.default(sub);  sub = None
            mul: "f32[]" = torch.ops.aten.mul.Tensor(index, abs_1);  index = abs_1 = None
            sub_1: "f32[]" = torch.ops.aten.sub.Tensor(arg0_1, mul);  arg0_1 = mul = None
            index_1: "f32[]" = torch.ops.aten.index.Tensor(arg6_1, [arg2_1]);  arg6_1 = arg2_1 = None
            add: "f32[]" = torch.ops.aten.add.Tensor(sub_1, index_1);  sub_1 = index_1 = None
            return add

    class sdpa_mask0(torch.nn.Module):
        def forward(self, arg0_1: "i32[]", arg1_1: "i32[]", arg2_1: "i32[]", arg3_1: "i32[]", arg4_1: "i64[128]"):
            index: "i64[]" = torch.ops.aten.index.Tensor(arg4_1, [arg2_1]);  arg2_1 = None
            index_1: "i64[]" = torch.ops.aten.index.Tensor(arg4_1, [arg3_1]);  arg4_1 = arg3_1 = None
            eq: "b8[]" = torch.ops.aten.eq.Tensor(index, index_1);  index = index_1 = None
            return eq""")
        signature = {spec.name: spec.kind.name for spec in ep.signature.inputs}
        assert signature["b_alibi"] == "BUFFER" and signature["b_document"] == "BUFFER"
        loaded = round_trip(ep)
        torch.testing.assert_close(loaded.module()(*self.qkv), CapturedTensors()(*self.qkv), rtol=0, atol=0)
        self.assertEqual(graph(loaded), graph(ep))

    def test_module_level_tensor_captured(self):
        """A global tensor the score_mod indexes: a constant of the program, the HOP's operand."""
        ep = export_and_check(GlobalHeadBias(), self.qkv)
        (node,) = ep.graph_module.graph.find_nodes(op="call_function", target=torch.ops.higher_order.flex_attention)
        self.assertEqual([(a.op, a.target) for a in node.args[7]], [("get_attr", "_tensor_constant0")])
        torch.testing.assert_close(round_trip(ep).module()(*self.qkv), GlobalHeadBias()(*self.qkv), rtol=0, atol=0)

    def test_verifier_checks_what_the_subgraphs_take(self):
        """A file whose flex_attention passes its subgraphs other counts than they take is refused
        at load, not at its first call with a raw error."""
        from predispatch.serialize.verify import graph_problems

        ep = predispatch.export(CapturedTensors(), self.qkv)
        (node,) = ep.graph_module.graph.find_nodes(op="call_function", target=torch.ops.higher_order.flex_attention)
        assert graph_problems(ep.graph_module) == []
        node.args = (*node.args[:7], node.args[7][:1], ())
        self.assertEqual([p.why for p in graph_problems(ep.graph_module)], [
            "its score_mod 'sdpa_score0' takes 7 values; flex_attention passes 5 and 1 captured tensor(s)",
            "its mask_mod 'sdpa_mask0' takes 5 values; flex_attention passes 4 and 0 captured tensor(s)",
        ])

    def test_score_mod_indexing_a_parameter_refused(self):
        model = FlexAttention("indexed")
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(UnsupportedConstructError) as info:
            predispatch.export(model, self.qkv)
        assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
        self.assertExpectedInline(stable_message(info.value), """\
forward calls torch.nn.attention.flex_attention with a score_mod that indexes a tensor it captures (parameter bias) and that carries a gradient; eager differentiates that index through torch's own ModIndex Function, whose backward an exported (ATen) graph does not hold, and flex_attention's backward fails on aten.index's gradient.
  at test_patterns.py:N (return flex_attention(q, k, v, score_mod=lambda score, b, h, qi, ki: score + self.bias[h] * (qi - ki)))
  fix: if the tensor is not trained, make it a buffer or read it detached (bias.detach()[h]): that exports; for a trained per-head bias, put it into a float attn_mask of F.scaled_dot_product_attention (attn_mask = bias[:, None, None] * (q_idx - kv_idx)), which on CPU computes what flex_attention computes, and exports with its gradient.
  see docs/errors.md#unsupportedconstructerror""")

    def test_the_fix_exports_eagers_values(self):
        with torch.no_grad():
            expected = FlexAttention("indexed")(*self.qkv)
        check_gradients(DenseAttention(), self.qkv)
        program = predispatch.export(DenseAttention(), self.qkv).module()
        torch.testing.assert_close(program(*self.qkv), expected)


# --- writes through as_strided views (Note [as_strided_scatter's gradient]) --------------------


class WritesThroughAsStrided(nn.Module):
    def forward(self, a):
        x = a * 1
        x.as_strided([3], [1], 0).mul_(2)  # the first row, written through an as_strided view
        return x


class CallsAsStridedScatter(nn.Module):
    def forward(self, a, src):
        return torch.as_strided_scatter(a * 2, src, [3], [1], 0)


class AsStridedWrites(TestCase):
    maxDiff = None
    a = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))

    def test_write_through_an_as_strided_view(self):
        """Functionalized as as_strided_scatter, whose derivative torch gets wrong ([[3, 3, 3],
        [0, 0, 0], [0, 0, 0]] where eager's is [[2, 2, 2], [1, 1, 1], [1, 1, 1]]): rewritten."""
        ep = check_gradients(WritesThroughAsStrided(), (self.a,))
        export_and_check(WritesThroughAsStrided(), (self.a,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, a: "f32[3, 3]"):
        mul: "f32[3, 3]" = torch.ops.aten.mul.Tensor(a, 1);  a = None
        as_strided: "f32[3]" = torch.ops.aten.as_strided.default(mul, [3], [1], 0)
        mul_1: "f32[3]" = torch.ops.aten.mul.Tensor(as_strided, 2);  as_strided = None
        as_strided_scatter_mask_base: "b8[3, 3]" = torch.ops.aten.zeros_like.default(mul, dtype = torch.bool)
        as_strided_scatter_mask_src: "b8[3]" = torch.ops.aten.ones_like.default(mul_1, dtype = torch.bool)
        as_strided_scatter_mask: "b8[3, 3]" = torch.ops.aten.as_strided_scatter.default(as_strided_scatter_mask_base, as_strided_scatter_mask_src, [3], [1], 0);  as_strided_scatter_mask_base = as_strided_scatter_mask_src = None
        as_strided_scatter_zeros: "f32[3, 3]" = torch.ops.aten.zeros_like.default(mul)
        as_strided_scatter_scattered: "f32[3, 3]" = torch.ops.aten.as_strided_scatter.default(as_strided_scatter_zeros, mul_1, [3], [1], 0);  as_strided_scatter_zeros = mul_1 = None
        as_strided_scatter_out: "f32[3, 3]" = torch.ops.aten.where.self(as_strided_scatter_mask, as_strided_scatter_scattered, mul);  as_strided_scatter_mask = as_strided_scatter_scattered = mul = None
        return (as_strided_scatter_out,)""")
        a = self.a.clone().requires_grad_()
        ep.module()(a).sum().backward()
        self.assertEqual(a.grad.tolist(), [[2.0] * 3, [1.0] * 3, [1.0] * 3])

    def test_direct_call_keeps_torchs_derivative(self):
        """The user's own as_strided_scatter call is eager's op: the program differentiates it as
        eager does (with torch's derivative), not rewritten."""
        ep = check_gradients(CallsAsStridedScatter(), (self.a, torch.randn(3)))
        assert "where" not in ep.graph_module.code


# --- tensors from outside the module (Note [Tensors from outside the module]) ----------------

SCALE = torch.tensor(2.0)
TABLE = torch.linspace(0, 1, 12).reshape(3, 4)
GLOBAL_WEIGHT = nn.Parameter(torch.ones(4))
CALLS = torch.zeros(())


class ReadsGlobals(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * SCALE + TABLE[1]


class GlobalParameter(nn.Module):
    def forward(self, x):
        return x * GLOBAL_WEIGHT


class FromNumpy(nn.Module):
    """A schedule computed with numpy in forward, made a tensor by `make`."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def forward(self, x):
        import numpy as np

        return x * self.make(np.linspace(0.0, 3.0, 4).astype(np.float32))


class CountsCalls(nn.Module):
    def forward(self, x):
        CALLS.add_(1)
        return x + CALLS


class GlobalTensors(TestCase):
    maxDiff = None
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))

    def test_module_level_tensor_is_a_constant(self):
        scale, table = SCALE.clone(), TABLE.clone()
        ep = export_and_check(ReadsGlobals(), (self.x,))
        check_gradients(ReadsGlobals(), (self.x,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[4, 4]", p_lin_bias: "f32[4]", x: "f32[2, 4]"):
        linear: "f32[2, 4]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
        _tensor_constant0: "f32[]" = self._tensor_constant0
        mul: "f32[2, 4]" = torch.ops.aten.mul.Tensor(linear, _tensor_constant0);  linear = _tensor_constant0 = None
        _tensor_constant1: "f32[3, 4]" = self._tensor_constant1
        select: "f32[4]" = torch.ops.aten.select.int(_tensor_constant1, 0, 1);  _tensor_constant1 = None
        add: "f32[2, 4]" = torch.ops.aten.add.Tensor(mul, select);  mul = select = None
        return (add,)""")
        assert torch.equal(SCALE, scale) and torch.equal(TABLE, table)  # the globals untouched
        torch.testing.assert_close(round_trip(ep).module()(self.x), ep.module()(self.x), rtol=0, atol=0)
        # torch.export lifts the same tensors as constants
        reference = torch.export.export(ReadsGlobals(), (self.x,))
        assert [s.kind.name for s in reference.graph_signature.input_specs].count("CONSTANT_TENSOR") == 2

    def test_module_level_parameter_refused(self):
        with pytest.raises(predispatch.errors.UnsupportedInputError) as info:
            predispatch.export(GlobalParameter(), (self.x,))
        self.assertExpectedInline(stable_message(info.value), """\
forward reads the module-level parameter test_patterns.GLOBAL_WEIGHT, a tensor that requires grad but is not the module's parameter: the program would hold it as a constant, without the gradient eager computes for it.
  at test_patterns.py:N (return x * GLOBAL_WEIGHT)
  fix: make it the module's parameter (self.w = nn.Parameter(...), or a submodule holding it), or read it detached (W.detach()) if it is not trained.
  see docs/errors.md#unsupportedinputerror""")

    def test_tensor_made_without_its_values_refused(self):
        """`torch.from_numpy` in forward is made by the fake mode without its values: the program
        held a fake tensor and `ep.module()` returned a FakeTensor, silently.  Refused by name;
        the fix (`torch.as_tensor`) exports a program equal to eager."""
        with pytest.raises(predispatch.errors.UnsupportedConstructError) as info:
            predispatch.export(FromNumpy(torch.from_numpy), (self.x,))
        self.assertExpectedInline(stable_message(info.value), """\
forward makes a tensor with a constructor that bypasses torch's ops (torch.from_numpy, torch.frombuffer): the trace's fake mode made it without its values, so the program would hold a tensor with no data (Note [Tensors from outside the module]).
  at test_patterns.py:N (return x * self.make(np.linspace(0.0, 3.0, 4).astype(np.float32)))
  fix: build it with torch.as_tensor(array) or torch.tensor(array), whose values the program records; or make it before export and register it as a buffer of the module.
  see docs/errors.md#unsupportedconstructerror""")
        ep = export_and_check(FromNumpy(torch.as_tensor), (self.x,))
        out = ep.module()(self.x)
        assert type(out) is torch.Tensor
        torch.testing.assert_close(out, FromNumpy(torch.as_tensor)(self.x), rtol=0, atol=0)

    def test_write_into_module_level_tensor_refused(self):
        with pytest.raises(predispatch.errors.OutsideWriteError) as info:
            predispatch.export(CountsCalls(), (self.x,))
        assert torch.equal(CALLS, torch.zeros(()))  # export wrote nothing into it
        self.assertExpectedInline(stable_message(info.value), """\
forward writes in place (aten.add_.Tensor) into the module-level tensor test_patterns.CALLS, a tensor that is not the module's state nor an input: eager changes it at every call, a program cannot.
  at test_patterns.py:N (CALLS.add_(1))
  fix: register it as a buffer of the module (self.register_buffer(...)): the program then writes it back as eager does; or compute a new tensor instead of writing in place.
  see docs/errors.md#outsidewriteerror""")


# --- scatters into complex tensors (Note [Scatters into complex tensors]; issue 23, 8) --------


class FourierLayer(nn.Module):
    """A spectral convolution (Fourier neural operator): the first modes weighted, the rest zero."""

    def __init__(self, channels: int = 3, modes: int = 3, select: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(channels, modes, dtype=torch.cfloat) / channels)
        self.modes, self.select = modes, select

    def forward(self, x):
        x_ft = torch.fft.rfft(x)
        out = torch.zeros(x.shape[0], x.shape[1], x.shape[-1] // 2 + 1, dtype=torch.cfloat)
        if self.select:  # one mode, written through an index
            out[..., 1] = x_ft[..., 1] * self.w[:, 0]
        else:
            out[..., : self.modes] = x_ft[..., : self.modes] * self.w
        return torch.fft.irfft(out, n=x.shape[-1])


class ComplexScatters(TestCase):
    maxDiff = None
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))

    def test_slice_assignment(self):
        ep = check_gradients(FourierLayer(), (self.x,))
        export_and_check(FourierLayer(), (self.x,))
        torch.testing.assert_close(ep.module()(self.x), torch.export.export(FourierLayer(), (self.x,)).module()(self.x), rtol=0, atol=0)
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_w: "c64[3, 3]", x: "f32[2, 3, 8]"):
        fft_rfft: "c64[2, 3, 5]" = torch.ops.aten.fft_rfft.default(x);  x = None
        zeros: "c64[2, 3, 5]" = torch.ops.aten.zeros.default([2, 3, 5], dtype = torch.complex64, device = device(type='cpu'), pin_memory = False)
        slice_1: "c64[2, 3, 3]" = torch.ops.aten.slice.Tensor(fft_rfft, 2, 0, 3);  fft_rfft = None
        mul: "c64[2, 3, 3]" = torch.ops.aten.mul.Tensor(slice_1, p_w);  slice_1 = p_w = None
        slice_2: "c64[2, 3, 3]" = torch.ops.aten.slice.Tensor(zeros, 2, 0, 3);  slice_2 = None
        view_as_real: "f32[2, 3, 5, 2]" = torch.ops.aten.view_as_real.default(zeros);  zeros = None
        view_as_real_1: "f32[2, 3, 3, 2]" = torch.ops.aten.view_as_real.default(mul);  mul = None
        slice_scatter: "f32[2, 3, 5, 2]" = torch.ops.aten.slice_scatter.default(view_as_real, view_as_real_1, 2, 0, 3);  view_as_real = view_as_real_1 = None
        view_as_complex: "c64[2, 3, 5]" = torch.ops.aten.view_as_complex.default(slice_scatter);  slice_scatter = None
        fft_irfft: "f32[2, 3, 8]" = torch.ops.aten.fft_irfft.default(view_as_complex, 8);  view_as_complex = None
        return (fft_irfft,)""")

    def test_saved_and_joint(self):
        buffer = io.BytesIO()
        predispatch.save(predispatch.export(FourierLayer(), (self.x,)), buffer)
        buffer.seek(0)
        torch.testing.assert_close(predispatch.load(buffer).module()(self.x), FourierLayer()(self.x), rtol=0, atol=0)
        from test_joint import check_joint

        class SpectralLoss(nn.Module):
            def __init__(self):
                super().__init__()
                self.layer = FourierLayer()

            def forward(self, x):
                return self.layer(x).square().mean()

        check_joint(SpectralLoss(), (self.x,))

    def test_index_assignment(self):
        ep = check_gradients(FourierLayer(select=True), (self.x,))
        export_and_check(FourierLayer(select=True), (self.x,))
        assert "select_scatter" in ep.graph_module.code and "view_as_real" in ep.graph_module.code

    def test_table_not_taken_is_drift(self):
        """Without the table a write under no_grad traces whole, which the program could not
        differentiate once grad is on: the trace checks that the rewrite engaged."""

        class NoGradWrite(nn.Module):
            def forward(self, x):
                out = torch.zeros(2, 3, 5, dtype=torch.cfloat)
                with torch.no_grad():
                    out[..., :2] = torch.fft.rfft(x)[..., :2]
                return torch.fft.irfft(out, n=8)

        export_and_check(NoGradWrite(), (self.x,))
        with mock.patch("predispatch.trace.functional.trace_decompositions", dict):
            with pytest.raises(predispatch.errors.TorchDriftError, match="slice_scatter"):
                predispatch.export(NoGradWrite(), (self.x,))

    def test_real_tensors_keep_the_plain_scatter(self):
        class Real(nn.Module):
            def forward(self, x):
                out = torch.zeros(2, 3, 8)
                out[..., :3] = x[..., :3] * 2
                return out

        ep = check_gradients(Real(), (self.x,))
        assert "view_as_real" not in ep.graph_module.code and "slice_scatter" in ep.graph_module.code


# --- a buffer a kernel resizes (issue 23, 6) --------------------------------------------------


def _qat_linear() -> nn.Module:
    torch.manual_seed(0)
    return torch.ao.nn.qat.Linear(4, 8, qconfig=torch.ao.quantization.get_default_qat_qconfig("fbgemm"))


class QatLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _qat_linear()

    def forward(self, x):
        return self.lin(x).square().mean()


class ResizedBuffers(TestCase):
    """`torch.ao.nn.qat.Linear`'s per-channel observer: the fused kernel grows min_val / max_val
    from [0] and scale / zero_point from [1] to one per output channel on the first call."""

    maxDiff = None
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))

    def test_module_runs_as_eager(self):
        ep = export_and_check(_qat_linear(), (self.x,))
        _assert_same_runs(_run(predispatch.export(_qat_linear(), (self.x,)).module(), self.x), _run(_qat_linear(), self.x))
        check_gradients(_qat_linear(), (self.x,))
        plans = [s.target for s in ep.signature.mutations]
        self.assertEqual(
            plans,
            [
                "weight_fake_quant.scale",
                "weight_fake_quant.zero_point",
                "weight_fake_quant.activation_post_process.min_val",
                "weight_fake_quant.activation_post_process.max_val",
            ],
        )

    def test_saved_after_growing(self):
        model = _qat_linear()
        ep = predispatch.export(model, (self.x,))
        eager = _qat_linear()
        program = ep.module()
        torch.testing.assert_close(program(self.x), eager(self.x), rtol=0, atol=0)  # the state grows
        assert model.weight_fake_quant.scale.shape == (8,)
        buffer = io.BytesIO()
        predispatch.save(ep, buffer)
        buffer.seek(0)
        loaded = predispatch.load(buffer).module()
        _assert_same_runs(_run(loaded, self.x), _run(eager, self.x))

    def test_saved_before_growing(self):
        ep = predispatch.export(_qat_linear(), (self.x,))
        buffer = io.BytesIO()
        predispatch.save(ep, buffer)
        buffer.seek(0)
        _assert_same_runs(_run(predispatch.load(buffer).module(), self.x), _run(_qat_linear(), self.x))

    def test_joint(self):
        from test_joint import check_joint

        check_joint(QatLoss(), (self.x,))


# --- torch.func transforms in forward (Note [torch.func in forward]; issue 23, 4) -------------


class PerRow(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return torch.func.vmap(lambda row: self.lin(row).sin())(x) * 2


class InputGradient(nn.Module):
    """A force from an energy: the gradient of a scalar function of the input, differentiated again."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 1)

    def forward(self, x):
        return torch.func.grad(lambda r: self.lin(r).tanh().sum())(x) + x


class PerSampleGradients(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x):
        params = dict(self.net.named_parameters())

        def loss(p, sample):
            return torch.func.functional_call(self.net, p, (sample[None],)).pow(2).sum()

        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
        return sum(g.flatten(1).sum(1) for g in grads.values())


class Ensemble(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.models = nn.ModuleList([nn.Linear(3, 2) for _ in range(4)])
        self.base = [copy.deepcopy(self.models[0]).to("meta")]  # a list: not a submodule

    def forward(self, x):
        params, buffers = torch.func.stack_module_state(list(self.models))
        return torch.func.vmap(lambda p, b: torch.func.functional_call(self.base[0], (p, b), (x,)))(params, buffers)


class VectorJacobian(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        out, pull_back = torch.func.vjp(lambda r: self.lin(r).tanh(), x)
        return pull_back(torch.ones_like(out))[0] * out


class Transform(nn.Module):
    """forward applies `transform(fn)` to the first row (a fixed function of the input)."""

    def __init__(self, transform, fn=torch.sin):
        super().__init__()
        self.transform, self.fn = transform, fn

    def forward(self, x):
        return self.transform(self.fn)(x[0]) @ x.T


class RandomRows(nn.Module):
    def __init__(self, randomness: str):
        super().__init__()
        self.randomness = randomness

    def forward(self, x):
        rows = lambda row: nn.functional.dropout(row, 0.5, True) + torch.rand(3)  # noqa: E731
        return torch.func.vmap(rows, randomness=self.randomness)(x)


class _ChangesKeysWhenFreed:
    """Stands for torch's objects in the frames an error goes through that change the thread's
    dispatch keys when they are freed (a guard restoring what it saved)."""

    held: list = []

    def __del__(self):
        include, exclude = ti.dispatch_keys()
        guard = torch._C._ForceDispatchKeyGuard(include, exclude | torch._C.DispatchKeySet(torch._C.DispatchKey.Negative))
        guard.__enter__()
        self.held.append(guard)  # entered and never left; freed, it would set the keys it saved


class TorchFuncTransforms(TestCase):
    maxDiff = None
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(0))

    def test_vmap(self):
        ep = check_gradients(PerRow(), (self.x,))
        export_and_check(PerRow(), (self.x,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", x: "f32[2, 3]"):
        t: "f32[3, 3]" = torch.ops.aten.t.default(p_lin_weight);  p_lin_weight = None
        unsqueeze: "f32[2, 1, 3]" = torch.ops.aten.unsqueeze.default(x, 1);  x = None
        view: "f32[2, 3]" = torch.ops.aten.view.default(unsqueeze, [2, 3]);  unsqueeze = None
        mm: "f32[2, 3]" = torch.ops.aten.mm.default(view, t);  view = t = None
        _unsafe_view: "f32[2, 1, 3]" = torch.ops.aten._unsafe_view.default(mm, [2, 1, 3]);  mm = None
        squeeze: "f32[2, 3]" = torch.ops.aten.squeeze.dims(_unsafe_view, [1]);  _unsafe_view = None
        add: "f32[2, 3]" = torch.ops.aten.add.Tensor(squeeze, p_lin_bias);  squeeze = p_lin_bias = None
        sin: "f32[2, 3]" = torch.ops.aten.sin.default(add);  add = None
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(sin, 2);  sin = None
        return (mul,)""")

    def test_grad_differentiated_again(self):
        check_gradients(InputGradient(), (self.x,))

    def test_per_sample_gradients(self):
        check_gradients(PerSampleGradients(), (torch.randn(5, 3),))

    def test_vjp_and_its_function(self):
        check_gradients(VectorJacobian(), (self.x,))

    def test_jvp(self):
        """torch's pre-dispatch jvp recorded a zero tangent and kept FunctionalTensors as constants."""

        class Tangent(nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.lin = nn.Linear(3, 3)

            def forward(self, x):
                return torch.func.jvp(lambda r: self.lin(r).tanh(), (x,), (torch.ones_like(x),))[1]

        check_gradients(Tangent(), (self.x,))

    def test_jacfwd(self):
        check_gradients(Transform(torch.func.jacfwd), (self.x,))

    def test_ensemble(self):
        model = Ensemble()
        ep = predispatch.export(model, (self.x,))
        eager_x, program_x = self.x.clone().requires_grad_(), self.x.clone().requires_grad_()
        expected, actual = Ensemble()(eager_x), ep.module()(program_x)
        # the same bmm on the same strides as eager's vmap calls, but MKL's batched product can
        # round by the buffers' alignment: 1 ulp apart on a 16-core AVX-512 machine, bitwise here
        torch.testing.assert_close(actual, expected)
        expected.sum().backward(), actual.sum().backward()
        torch.testing.assert_close(program_x.grad, eager_x.grad)  # bmm's backward: summed in another order

    def test_randomness(self):
        for randomness in ("different", "same"):
            program = predispatch.export(RandomRows(randomness), (torch.randn(4, 3),)).module()
            x = torch.randn(4, 3)
            torch.manual_seed(3)
            actual = program(x)
            torch.manual_seed(3)
            torch.testing.assert_close(actual, RandomRows(randomness)(x), rtol=0, atol=0)

    def test_grad_mode_change_inside_refused(self):
        class NoGradRows(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)

            def forward(self, x):
                def row(r):
                    with torch.no_grad():
                        frozen = self.lin(r)
                    return frozen + r

                return torch.func.vmap(row)(x)

        with pytest.raises(UnsupportedConstructError) as info:
            predispatch.export(NoGradRows(), (self.x,))
        self.assertExpectedInline(stable_message(info.value), """\
forward changes the grad mode (torch.no_grad(), inference_mode, set_grad_enabled) inside torch.func.vmap; export traces the transform below autograd, where the change leaves no trace, so the program would differentiate what eager does not.
  at test_patterns.py:N (with torch.no_grad():)
  fix: use .detach() on the values that must not be differentiated, or move the change out of the transformed function.
  see docs/errors.md#unsupportedconstructerror""")

    def test_jacrev_and_hessian(self):
        check_gradients(Transform(torch.func.jacrev, torch.tanh), (self.x,))
        check_gradients(Transform(torch.func.hessian, lambda r: r.sin().sum()), (self.x,))

    def test_jacrev_through_a_layer(self):
        """jacrev's basis and vmap-over-vjp's gradient buffers are writes through as_strided
        views, functionalized as as_strided_scatter, whose derivative torch gets wrong (the outer
        gradient came out twice eager's): rewritten (Note [as_strided_scatter's gradient])."""

        class LayerJacobian(nn.Module):
            def __init__(self):
                super().__init__()
                torch.manual_seed(0)
                self.lin = nn.Linear(3, 3)

            def forward(self, x):
                return torch.func.jacrev(lambda r: self.lin(r).tanh())(x[0])

        class BatchJacobian(PerSampleGradients):
            def forward(self, x):
                return torch.func.vmap(torch.func.jacrev(self.net))(x)

        class LayerHessian(LayerJacobian):
            def forward(self, x):
                return torch.func.hessian(lambda r: self.lin(r).tanh().sum())(x[0])

        ep = check_gradients(LayerJacobian(), (self.x,))
        check_gradients(BatchJacobian(), (self.x,))
        check_gradients(LayerHessian(), (self.x,))
        if on_golden_torch():
            self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", x: "f32[2, 3]"):
        select: "f32[3]" = torch.ops.aten.select.int(x, 0, 0);  x = None
        t: "f32[3, 3]" = torch.ops.aten.t.default(p_lin_weight);  p_lin_weight = None
        unsqueeze: "f32[1, 3]" = torch.ops.aten.unsqueeze.default(select, 0);  select = None
        mm: "f32[1, 3]" = torch.ops.aten.mm.default(unsqueeze, t);  unsqueeze = None
        squeeze: "f32[3]" = torch.ops.aten.squeeze.dim(mm, 0);  mm = None
        add: "f32[3]" = torch.ops.aten.add.Tensor(squeeze, p_lin_bias);  squeeze = p_lin_bias = None
        unsqueeze_1: "f32[1, 3]" = torch.ops.aten.unsqueeze.default(add, 0);  add = None
        squeeze_1: "f32[3]" = torch.ops.aten.squeeze.dim(unsqueeze_1, 0);  unsqueeze_1 = None
        tanh: "f32[3]" = torch.ops.aten.tanh.default(squeeze_1);  squeeze_1 = None
        new_zeros: "f32[3, 3]" = torch.ops.aten.new_zeros.default(tanh, [3, 3], pin_memory = False)
        diagonal: "f32[3]" = torch.ops.aten.diagonal.default(new_zeros)
        fill: "f32[3]" = torch.ops.aten.fill.Scalar(diagonal, 1);  diagonal = None
        diagonal_scatter: "f32[3, 3]" = torch.ops.aten.diagonal_scatter.default(new_zeros, fill);  new_zeros = fill = None
        view_1: "f32[3, 3]" = torch.ops.aten.view.default(diagonal_scatter, [3, 3]);  diagonal_scatter = None
        tanh_backward: "f32[3, 3]" = torch.ops.aten.tanh_backward.default(view_1, tanh);  view_1 = tanh = None
        new_zeros_1: "f32[3, 3]" = torch.ops.aten.new_zeros.default(tanh_backward, [3, 3])
        as_strided: "f32[3, 3]" = torch.ops.aten.as_strided.default(new_zeros_1, [3, 3], [3, 1], 0);  as_strided = None
        as_strided_scatter_mask_base: "b8[3, 3]" = torch.ops.aten.zeros_like.default(new_zeros_1, dtype = torch.bool)
        as_strided_scatter_mask_src: "b8[3, 3]" = torch.ops.aten.ones_like.default(tanh_backward, dtype = torch.bool)
        as_strided_scatter_mask: "b8[3, 3]" = torch.ops.aten.as_strided_scatter.default(as_strided_scatter_mask_base, as_strided_scatter_mask_src, [3, 3], [3, 1], 0);  as_strided_scatter_mask_base = as_strided_scatter_mask_src = None
        as_strided_scatter_zeros: "f32[3, 3]" = torch.ops.aten.zeros_like.default(new_zeros_1)
        as_strided_scatter_scattered: "f32[3, 3]" = torch.ops.aten.as_strided_scatter.default(as_strided_scatter_zeros, tanh_backward, [3, 3], [3, 1], 0);  as_strided_scatter_zeros = tanh_backward = None
        as_strided_scatter_out: "f32[3, 3]" = torch.ops.aten.where.self(as_strided_scatter_mask, as_strided_scatter_scattered, new_zeros_1);  as_strided_scatter_mask = as_strided_scatter_scattered = new_zeros_1 = None
        as_strided_4: "f32[3, 1, 3]" = torch.ops.aten.as_strided.default(as_strided_scatter_out, [3, 1, 3], [3, 3, 1], 0);  as_strided_scatter_out = None
        new_empty_strided: "f32[3, 1, 3]" = torch.ops.aten.new_empty_strided.default(as_strided_4, [3, 1, 3], [3, 3, 1]);  new_empty_strided = None
        as_strided_6: "f32[3, 3]" = torch.ops.aten.as_strided.default(as_strided_4, [3, 3], [3, 1], 0)
        clone: "f32[3, 3]" = torch.ops.aten.clone.default(as_strided_6, memory_format = torch.contiguous_format);  as_strided_6 = None
        as_strided_scatter_1_mask_base: "b8[3, 1, 3]" = torch.ops.aten.zeros_like.default(as_strided_4, dtype = torch.bool)
        as_strided_scatter_1_mask_src: "b8[3, 3]" = torch.ops.aten.ones_like.default(clone, dtype = torch.bool)
        as_strided_scatter_1_mask: "b8[3, 1, 3]" = torch.ops.aten.as_strided_scatter.default(as_strided_scatter_1_mask_base, as_strided_scatter_1_mask_src, [3, 3], [3, 1], 0);  as_strided_scatter_1_mask_base = as_strided_scatter_1_mask_src = None
        as_strided_scatter_1_zeros: "f32[3, 1, 3]" = torch.ops.aten.zeros_like.default(as_strided_4)
        as_strided_scatter_1_scattered: "f32[3, 1, 3]" = torch.ops.aten.as_strided_scatter.default(as_strided_scatter_1_zeros, clone, [3, 3], [3, 1], 0);  as_strided_scatter_1_zeros = clone = None
        as_strided_scatter_1_out: "f32[3, 1, 3]" = torch.ops.aten.where.self(as_strided_scatter_1_mask, as_strided_scatter_1_scattered, as_strided_4);  as_strided_scatter_1_mask = as_strided_scatter_1_scattered = as_strided_4 = None
        t_1: "f32[3, 3]" = torch.ops.aten.t.default(t);  t = None
        view_3: "f32[3, 3]" = torch.ops.aten.view.default(as_strided_scatter_1_out, [3, 3]);  as_strided_scatter_1_out = None
        mm_1: "f32[3, 3]" = torch.ops.aten.mm.default(view_3, t_1);  view_3 = t_1 = None
        _unsafe_view: "f32[3, 1, 3]" = torch.ops.aten._unsafe_view.default(mm_1, [3, 1, 3]);  mm_1 = None
        squeeze_3: "f32[3, 3]" = torch.ops.aten.squeeze.dims(_unsafe_view, [1]);  _unsafe_view = None
        split_with_sizes = torch.ops.aten.split_with_sizes.default(squeeze_3, [3]);  squeeze_3 = None
        getitem: "f32[3, 3]" = split_with_sizes[0];  split_with_sizes = None
        view_4: "f32[3, 3]" = torch.ops.aten.view.default(getitem, [3, 3]);  getitem = None
        return (view_4,)""")

    def test_failure_inside_is_named_and_leaves_the_thread_clean(self):
        """A failure inside functorch's layers can leave the thread's dispatch keys changed (a
        hessian traced on real tensors left every functorch key excluded, and every later trace
        failed), now or when torch's frames the error holds are freed: the keys are as they were
        when export returns, and stay so."""

        class LeavesGuard(nn.Module):
            def forward(self, x):
                def row(r):
                    keeper = _ChangesKeysWhenFreed()  # noqa: F841 - held by this frame, so by the error
                    return r @ torch.ones(4)  # a size mismatch

                return torch.func.vmap(row)(x)

        def keys():
            return tuple(map(str, ti.dispatch_keys()))

        before = keys()
        with pytest.raises(UnsupportedConstructError) as info:
            predispatch.export(LeavesGuard(), (self.x,))
        self.assertExpectedInline(stable_message(info.value), """\
forward calls torch.func.vmap, which export traces below autograd, and tracing it failed: RuntimeError: size mismatch, got input (2x3), vec (4)
  at test_patterns.py:N (return torch.func.vmap(row)(x))
  fix: export the function the transform is applied to and apply torch.func to the program (torch.func.vmap(ep.module())(x) works); or write the computation without the transform.
  see docs/errors.md#unsupportedconstructerror""")
        assert keys() == before
        del info
        gc.collect()
        assert keys() == before
        check_gradients(PerRow(), (self.x,))  # the next export in the thread works
