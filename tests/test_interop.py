"""ep.to_torch(): a genuine torch.export.ExportedProgram that computes what the program does."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.utils._pytree as pytree
from expecttest import TestCase
from helpers import assert_same_tree
from test_export import Batch, ConvBN, Counter, DictOut, Masked, ScaleInPlace, Tied, WithConstant
from test_regions import CASES as REGION_CASES
from test_regions import LeftOpen
from test_serialize import GraphTensors, KwargsAndConstants
from torch import nn

import predispatch
from predispatch.errors import NotRepresentableError

CASES = {
    **{f"region_{name}": (lambda cls=cls, make=make: (cls(), make(), {})) for name, (cls, make) in REGION_CASES.items()},
    "conv_bn_train": lambda: (ConvBN().train(), (torch.randn(2, 3, 6, 6),), {}),
    "buffer_mutation": lambda: (Counter(), (torch.randn(2, 3),), {}),
    # an integer x: a float one would be a leaf requiring grad in `run_both`, which eager (and
    # predispatch's module()) refuse to change in place
    "input_mutation": lambda: (ScaleInPlace(), (torch.arange(3), torch.randn(3)), {}),
    "dict_output": lambda: (DictOut(), (torch.randn(2, 3),), {}),
    "kwargs": lambda: (Masked(), (torch.randn(2, 4),), {"mask": torch.rand(2, 4) > 0.5, "scale": 0.5}),
    "tied": lambda: (Tied(), (torch.tensor([[1, 2, 3]]),), {}),
    "dataclass_input": lambda: (WithConstant(), (Batch(torch.randn(4), torch.randn(4)),), {}),
    "graph_tensors": lambda: (GraphTensors(), (torch.randn(2),), {}),
}

#: Programs torch itself cannot save or load, whoever exported them (torch 2.13).
TORCH_SAVE_LIMITATIONS = {
    "dict_output": "torch.export.load cannot read a str output (SerializeError: Unable to deserialize output node)",
    "dataclass_input": "torch.export.save needs the dataclass registered with a serialized_type_name",
}
_LEAF_MUTATED = (
    "torch's module() copies a mutation back into a leaf that requires grad (an input, a parameter), "
    "which autograd forbids outside no_grad; predispatch's module() writes such leaves under no_grad"
)
#: Programs whose gradients torch's module() cannot compute (forward is still compared).  Train-mode
#: batch norm is not among them: to_torch() gives it torch's form, which updates the running
#: statistics inside the kernel (transforms/recompose_for_torch.py), see
#: test_train_batch_norm_is_torch_training_ir.
TORCH_BACKWARD_LIMITATIONS = {
    "region_input_mutated_under_no_grad": _LEAF_MUTATED,
    "region_ema": _LEAF_MUTATED,
}
#: Programs whose forward leaves grad mode changed for the caller: refused (see below).
REFUSED = {"region_left_open", "region_across_modules"}


def export_case(name):
    torch.manual_seed(0)
    module, args, kwargs = CASES[name]()
    return predispatch.export(module, args, kwargs), args, kwargs


def fresh(args, kwargs, grad=True):
    return pytree.tree_map_only(
        torch.Tensor, lambda t: t.detach().clone().requires_grad_(grad and t.is_floating_point()), (args, kwargs)
    )


def run_both(expected_module, actual_module, args, kwargs, *, exact=True, grad=True):
    """Outputs, mutated inputs and state after agree; with `grad`, gradients of inputs too."""
    (e_args, e_kwargs), (a_args, a_kwargs) = fresh(args, kwargs, grad), fresh(args, kwargs, grad)
    with torch.set_grad_enabled(grad):
        expected = expected_module(*e_args, **e_kwargs)
        actual = actual_module(*a_args, **a_kwargs)
    assert_same_tree(actual, expected, exact)
    assert_same_tree((a_args, a_kwargs), (e_args, e_kwargs), exact)
    assert_same_tree(dict(actual_module.state_dict()), dict(expected_module.state_dict()), exact)
    if grad:
        for outs in (expected, actual):
            live = [t for t in pytree.tree_leaves(outs) if isinstance(t, torch.Tensor) and t.requires_grad]
            if live:
                torch.autograd.backward([t.float().sum() for t in live])
        for e, a in zip(pytree.tree_leaves((e_args, e_kwargs)), pytree.tree_leaves((a_args, a_kwargs))):
            if isinstance(e, torch.Tensor):
                assert_same_tree(a.grad, e.grad, exact)


#: torch's run_decompositions deep-copies module_call_graph's pytree specs, which makes torch
#: 2.13 warn about LeafSpec; torch.export's own programs warn the same, so it is not ours.
_TORCH_LEAFSPEC_WARNING = "ignore:.*isinstance\\(treespec, LeafSpec\\):FutureWarning"


@pytest.mark.filterwarnings(_TORCH_LEAFSPEC_WARNING)
@pytest.mark.parametrize("name", sorted(set(CASES) - REFUSED))
def test_torch_program_matches(name):
    """Each comparison starts from a fresh export: `ep.module()` shares the program's state,
    which a run changes as it would change the model's (a buffer written with a value that
    requires grad keeps its history, as in eager)."""
    ep, args, kwargs = export_case(name)
    tep = ep.to_torch()
    assert type(tep) is torch.export.ExportedProgram
    tep.validate()  # torch's verifier (TrainingIRVerifier)
    grad = name not in TORCH_BACKWARD_LIMITATIONS
    run_both(ep.module(), tep.module(), args, kwargs, grad=grad)
    # torch's core ATen IR is for inference: run_decompositions drops grad-mode regions (its
    # own programs' too), so only the forward is compared.
    ep = export_case(name)[0]
    run_both(ep.module(), ep.to_torch().run_decompositions().module(), args, kwargs, exact=False, grad=False)
    if name not in TORCH_SAVE_LIMITATIONS:
        ep = export_case(name)[0]
        buffer = io.BytesIO()
        torch.export.save(ep.to_torch(), buffer)
        buffer.seek(0)
        run_both(ep.module(), torch.export.load(buffer).module(), args, kwargs, grad=grad)
    if not grad:
        ep = export_case(name)[0]
        with pytest.raises(RuntimeError):  # the limitation is torch's; when it goes, move the case back
            run_both(ep.module(), ep.to_torch().module(), args, kwargs)


def test_train_batch_norm_is_torch_training_ir():
    """to_torch() gives train-mode batch norm and dropout torch.export's own forms, so torch's
    module() backpropagates (a write-back of running_var after the graph saved it would not) and
    PT2E's patterns match them."""

    class ConvBNDropout(ConvBN):
        def forward(self, x):
            return torch.nn.functional.dropout(super().forward(x), 0.3)

    torch.manual_seed(0)
    model, x = ConvBNDropout().train(), torch.randn(2, 3, 6, 6)
    tep = predispatch.export(model, (x,)).to_torch()
    ops = [n.target for n in tep.graph.nodes if n.op == "call_function"]
    theirs = [n.target for n in torch.export.export(model, (x,)).graph.nodes if n.op == "call_function"]
    assert ops == theirs
    assert dict(tep.graph_signature.buffers_to_mutate) == {}
    runs = []
    for module in (copy.deepcopy(model), tep.module()):
        torch.manual_seed(1)  # the same dropout mask
        out = module(x)
        out.sum().backward()
        runs.append((out, dict(module.state_dict()), {k: p.grad for k, p in module.named_parameters()}))
    assert_same_tree(runs[1], runs[0], True)


class ReadsNewMean(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(x) + self.bn.running_mean


class NewStatistics(TestCase):
    def test_batch_norm_whose_new_statistics_are_read_saves_copies(self):
        """Batch norm whose new running mean forward reads stays functional, with its statistics
        copied before it (`clone_saved_statistics`): torch's module() then writes the buffers back
        without touching what backward saved, and trains like the model."""
        torch.manual_seed(0)
        model, x = ReadsNewMean(), torch.randn(4, 3)
        tep = predispatch.export(copy.deepcopy(model), (x,)).to_torch()
        self.assertExpectedInline(tep.graph_module.code.strip(), """\
def forward(self, p_bn_weight, p_bn_bias, b_bn_running_mean, b_bn_running_var, b_bn_num_batches_tracked, x):
    add_ = torch.ops.aten.add_.Tensor(b_bn_num_batches_tracked, 1);  b_bn_num_batches_tracked = add_ = None
    clone = torch.ops.aten.clone.default(b_bn_running_mean);  b_bn_running_mean = None
    clone_1 = torch.ops.aten.clone.default(b_bn_running_var);  b_bn_running_var = None
    _native_batch_norm_legit_functional = torch.ops.aten._native_batch_norm_legit_functional.default(x, p_bn_weight, p_bn_bias, clone, clone_1, True, 0.1, 1e-05);  x = p_bn_weight = p_bn_bias = clone = clone_1 = None
    getitem = _native_batch_norm_legit_functional[0]
    getitem_3 = _native_batch_norm_legit_functional[3]
    getitem_4 = _native_batch_norm_legit_functional[4];  _native_batch_norm_legit_functional = None
    add_1 = torch.ops.aten.add.Tensor(getitem, getitem_3);  getitem = None
    return (getitem_3, getitem_4, add_1)""")
        runs = []
        for module in (model, tep.module()):
            x_grad = x.clone().requires_grad_()
            out = module(x_grad)
            out.sum().backward()
            runs.append((out, x_grad.grad, dict(module.state_dict()), {k: p.grad for k, p in module.named_parameters()}))
        assert_same_tree(runs[1], runs[0], True)


class AttentionThenView(nn.Module):
    """The end of an attention block whose next step reads the heads as rows: the `reshape` is
    a view at the trace (the CPU kernel's output makes the transposed tensor contiguous), and
    torch's decomposed attention lays its output out otherwise."""

    def forward(self, x):
        b, s, d = x.shape
        q = (x * 2).view(b, s, 4, d // 4).transpose(1, 2)
        att = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        rows = att.transpose(1, 2).reshape(b, s, d).reshape(-1, d)
        return rows + x.view(-1, d)


class ViewsOfComputedTensors(TestCase):
    @pytest.mark.filterwarnings(_TORCH_LEAFSPEC_WARNING)
    def test_torch_consumers_decompose_past_a_view_the_trace_decided(self):
        """Note [Views of computed tensors]: `to_torch()` writes a view of a computed tensor as
        `reshape` (a view of an input stays a view), so torch's `run_decompositions()` traces it
        with its own attention layout; before, it raised "Cannot view a tensor with shape
        [2, 8, 64] and strides ...".  Equal, bitwise, to torch.export's route with the same
        decompositions."""
        torch.manual_seed(0)
        x = torch.randn(2, 8, 64)
        ep = predispatch.export(AttentionThenView(), (x,))
        tep = ep.to_torch()
        self.assertExpectedInline(tep.graph_module.code.strip(), """\
def forward(self, x):
    mul = torch.ops.aten.mul.Tensor(x, 2)
    reshape = torch.ops.aten.reshape.default(mul, [2, 8, 4, 16]);  mul = None
    transpose = torch.ops.aten.transpose.int(reshape, 1, 2);  reshape = None
    scaled_dot_product_attention = torch.ops.aten.scaled_dot_product_attention.default(transpose, transpose, transpose, None, 0.0, True);  transpose = None
    transpose_1 = torch.ops.aten.transpose.int(scaled_dot_product_attention, 1, 2);  scaled_dot_product_attention = None
    reshape_1 = torch.ops.aten.reshape.default(transpose_1, [2, 8, 64]);  transpose_1 = None
    reshape_2 = torch.ops.aten.reshape.default(reshape_1, [-1, 64]);  reshape_1 = None
    view_3 = torch.ops.aten.view.default(x, [-1, 64]);  x = None
    add = torch.ops.aten.add.Tensor(reshape_2, view_3);  reshape_2 = view_3 = None
    return (add,)""")
        ours = tep.run_decompositions()
        theirs = torch.export.export(AttentionThenView(), (x,)).run_decompositions()
        for args in ((x,), (torch.randn(2, 8, 64),)):
            torch.testing.assert_close(ours.module()(*args), theirs.module()(*args), rtol=0, atol=0)
            torch.testing.assert_close(ours.module()(*args), AttentionThenView()(*args))


def test_state_is_copied():
    """torch's module() writes mutations into the program's state: never into ep or the model."""
    model = Counter()
    ep = predispatch.export(model, (torch.randn(2, 3),))
    tep = ep.to_torch()
    tep.module()(torch.randn(2, 3))
    assert model.count.item() == 0 and ep.state_dict["count"].item() == 0
    assert tep.state_dict["count"].item() == 1


def test_keep_history_survives_torch_save():
    """predispatch::keep_history is a custom op: torch holds it by name."""
    ep, args, kwargs = export_case("region_intermediate_mutated_under_no_grad")
    buffer = io.BytesIO()
    torch.export.save(ep.to_torch(), buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    targets = {str(n.target) for n in loaded.graph.nodes if n.op == "call_function"}
    assert "predispatch.keep_history.default" in targets
    assert "wrap_with_set_grad_enabled" in targets


def input_specs(tep):
    return [(s.kind.name, getattr(s.arg, "name", None), s.target, getattr(s.arg, "value", None)) for s in tep.graph_signature.input_specs]


def test_tied_weights_get_a_placeholder_per_name():
    ep, _, _ = export_case("tied")
    tep = ep.to_torch()
    assert input_specs(tep) == [
        ("PARAMETER", "p_emb_weight", "emb.weight", None),
        ("PARAMETER", "p_head_weight", "head.weight", None),
        ("USER_INPUT", "ids", None, None),
    ]
    assert tep.state_dict["emb.weight"] is tep.state_dict["head.weight"]
    module = tep.module()
    assert module.emb.weight is module.head.weight


def test_constant_leaves_are_placeholders_and_literals():
    torch.manual_seed(0)
    ep = predispatch.export(KwargsAndConstants(), (torch.randn(3),), {"scale": 2.0, "mode": "b"})
    tep = ep.to_torch()
    assert input_specs(tep) == [
        ("USER_INPUT", "x", None, None),
        ("USER_INPUT", "scale", None, 2.0),
        ("USER_INPUT", "mode", None, "b"),
    ]
    outputs = [(s.kind.name, getattr(s.arg, "value", "tensor")) for s in tep.graph_signature.output_specs]
    assert outputs == [("USER_OUTPUT", "tensor"), ("USER_OUTPUT", "b"), ("USER_OUTPUT", None)]


def test_graph_tensors_are_lifted():
    """Tensors created in forward, in the graph and inside a region, become constant inputs."""
    ep, _, _ = export_case("graph_tensors")
    tep = ep.to_torch()
    assert input_specs(tep) == [
        ("CONSTANT_TENSOR", "c_grad_region_0__tensor_constant0", "grad_region_0__tensor_constant0", None),
        ("CONSTANT_TENSOR", "c__tensor_constant1", "_tensor_constant1", None),
        ("USER_INPUT", "x", None, None),
    ]
    assert list(tep.constants) == ["grad_region_0__tensor_constant0", "_tensor_constant1"]
    assert dict(tep.graph_module.named_buffers()) == {}


class Refusals(TestCase):
    maxDiff = None

    def test_grad_mode_left_changed(self):
        ep = predispatch.export(LeftOpen(), (torch.randn(2, 3),))
        with self.assertRaises(NotRepresentableError) as info:
            ep.to_torch()
        self.assertExpectedInline(str(info.exception), """\
torch.export.ExportedProgram cannot hold this program:
    forward leaves grad mode disabled for its caller
  fix: keep using the predispatch program (ep.module(), predispatch.save, which holds all of it), use ep.to_torch(for_inference=True) for a consumer that only runs forward, or change the model so the named construct goes away; docs/format.md#torch-interop lists what converts.
  see docs/errors.md#notrepresentableerror""")

    def test_grad_mode_left_changed_is_no_matter_for_inference(self):
        model, x = LeftOpen(), torch.randn(2, 3)
        tep = predispatch.export(model, (x,)).to_torch(for_inference=True)
        with torch.enable_grad():
            expected = model(x)
        with torch.enable_grad():
            assert_same_tree(tep.module()(x), expected)

    def test_constant_of_a_type_torch_cannot_hold(self):
        class Cast(nn.Module):
            def forward(self, x, dtype):
                return x.to(dtype)

        ep = predispatch.export(Cast(), (torch.randn(2), torch.float64))
        with self.assertRaises(NotRepresentableError) as info:
            ep.to_torch()
        self.assertIn("dtype is a constant dtype; torch holds int, float, bool, str or None", str(info.exception))

    def test_control_flow_branch_holding_a_tensor(self):
        """A tensor made inside a torch.cond branch is a get_attr of the branch, which to_torch
        cannot lift into cond's operands: refused, naming what to do."""

        class MadeInBranch(nn.Module):
            def forward(self, x):
                return torch.cond(x.sum() > 0, lambda x: x * torch.tensor([1.0, 2.0]), lambda x: x - 1, (x,))

        ep = predispatch.export(MadeInBranch(), (torch.randn(3, 2),))
        with self.assertRaises(NotRepresentableError) as info:
            ep.to_torch()
        self.assertIn("node cond in the graph calls cond: its subgraphs hold tensors (made inside them), which "
                      "to_torch cannot lift into them; make the tensor outside the branch or body and pass it in "
                      "as an operand", str(info.exception))



class DynamicShapes(TestCase):
    def test_symbols_become_range_constraints(self):
        """Each symbol's range reaches torch's range_constraints, for a fresh and a loaded
        program; torch's module() then refuses an out-of-range call as ours does."""
        from test_serialize import Reshaping, saved
        from torch.export import Dim

        model = Reshaping()
        ep = predispatch.export(model, (torch.randn(3, 4),), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
        loaded = predispatch.load(io.BytesIO(saved(ep)))
        for program in (ep, loaded):
            tep = program.to_torch()
            self.assertEqual({str(s): (int(r.lower), int(r.upper)) for s, r in tep.range_constraints.items()},
                             {name: (low, high) for name, low, high in ep.signature.shapes.ranges})
            x = torch.randn(7, 4)
            self.assertTrue(torch.equal(tep.module()(x), model(x)))
            with self.assertRaisesRegex(RuntimeError, r"to be <= 64, but got 65"):
                tep.module()(torch.randn(65, 4))
            buffer = io.BytesIO()
            torch.export.save(tep, buffer)
            buffer.seek(0)
            self.assertTrue(torch.equal(torch.export.load(buffer).module()(x), model(x)))


class CustomBackwards(TestCase):
    """Note [Custom backwards in torch's ExportedProgram]."""

    def setUp(self):
        from test_autograd_function import StraightThrough

        class Rounding(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)

            def forward(self, x):
                return StraightThrough.apply(self.lin(x) * 2)

        torch.manual_seed(0)
        self.model, self.x = Rounding(), torch.randn(2, 3) / 4
        self.ep = predispatch.export(self.model, (self.x,))

    def grads(self, module):
        x = self.x.clone().requires_grad_()
        module(x).sum().backward()
        return x.grad, [p.grad for p in module.parameters()]

    def test_to_torch_trains_with_the_custom_backward(self):
        tep = self.ep.to_torch()
        calls = [n.target for n in tep.graph.nodes if n.op == "call_function"]
        self.assertIn(torch.ops.higher_order.predispatch_autograd_function_apply, calls)
        self.assertNotIn(torch.ops.higher_order.autograd_function_apply, calls)
        expected, got = self.grads(self.model), self.grads(tep.module())
        assert_same_tree(got, expected)
        self.assertTrue(expected[0].abs().sum() > 0)  # autograd through round() would give zeros

    def test_torch_export_save_load_keeps_the_custom_backward(self):
        """The flat forward (Note [Custom backwards that torch.export.load reads]) is what torch
        reads back: the loaded module trains with the custom backward, bitwise."""
        buffer = io.BytesIO()
        torch.export.save(self.ep.to_torch(), buffer)
        buffer.seek(0)
        loaded = torch.export.load(buffer)
        self.assertExpectedInline(loaded.graph_module.straight_through_fwd_0.code.strip(), """\
def forward(self, x):
    round_1 = torch.ops.aten.round.default(x)
    return (round_1, x)""")
        assert_same_tree(self.grads(loaded.module()), self.grads(self.model))

    def test_for_inference_inlines_forward_and_says_backward_is_dropped(self):
        with self.assertWarnsRegex(UserWarning, r"dropped 1 custom backward\(s\) \(straight_through_fwd_0\)"):
            tep = self.ep.to_torch(for_inference=True)
        self.assertExpectedInline(tep.graph_module.code.strip(), """\
def forward(self, p_lin_weight, p_lin_bias, x):
    linear = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
    mul = torch.ops.aten.mul.Tensor(linear, 2);  linear = None
    round_1 = torch.ops.aten.round.default(mul);  mul = None
    return (round_1,)""")
        self.assertTrue(torch.equal(tep.module()(self.x), self.model(self.x)))
        buffer = io.BytesIO()
        torch.export.save(tep, buffer)
        buffer.seek(0)
        self.assertTrue(torch.equal(torch.export.load(buffer).module()(self.x), self.model(self.x)))

    def test_for_inference_makes_autocast_casts_explicit(self):
        class Mixed(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)

            def forward(self, x):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = self.lin(x)
                with torch.no_grad():
                    return y.float() * 2

        model, x = Mixed(), torch.randn(2, 3)
        tep = predispatch.export(model, (x,)).to_torch(for_inference=True)
        hops = [n for n in tep.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
        self.assertEqual(hops, [])
        casts = [n.kwargs.get("dtype") for n in tep.graph.nodes if n.target is torch.ops.aten._to_copy.default]
        self.assertEqual(casts, [torch.bfloat16] * 3 + [torch.float32])
        self.assertTrue(torch.equal(tep.module()(x), model(x)))


def test_for_inference_drops_keep_history():
    """predispatch::keep_history only routes gradients: the inference lowering computes its value."""
    cls, make = REGION_CASES["intermediate_mutated_under_no_grad"]
    torch.manual_seed(0)
    model, args = cls(), make()
    ep = predispatch.export(model, args)
    assert "keep_history" in str(ep)
    tep = ep.to_torch(for_inference=True)
    targets = {str(n.target) for m in tep.graph_module.modules() for n in m.graph.nodes if hasattr(m, "graph")}
    assert not any("keep_history" in t or "higher_order" in t for t in targets)
    assert_same_tree(tep.module()(*args), ep.module()(*args))
