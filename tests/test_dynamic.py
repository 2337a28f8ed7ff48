"""Dynamic dimensions (torch.export.Dim), shape ranges checked at call time, data-dependent values."""

from __future__ import annotations


import pytest
import torch
from expecttest import TestCase
from helpers import on_golden_torch, assert_same_tree, stable_message as message
from torch import nn
from torch.export import Dim

import predispatch
from predispatch import errors


class Mixer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        h = self.lin(x)
        return h.reshape(-1), torch.cat([h, y], 0), h.sum(0, keepdim=True).expand(x.shape[0], 8)


class Specializes(nn.Module):
    def forward(self, x):
        return x.view(4, -1)


class DynamicShapes(TestCase):
    maxDiff = None

    def export_mixer(self):
        torch.manual_seed(0)
        batch = Dim("batch", min=2, max=64)
        shapes = {"x": {0: batch}, "y": {0: Dim("extra", max=32)}}
        return predispatch.export(Mixer(), (torch.randn(4, 8), torch.randn(3, 8)), dynamic_shapes=shapes)

    def test_dim_names_are_kept(self):
        """Each named Dim's symbol keeps the name (printed, and given to ONNX by `to_onnx`)."""
        shapes = self.export_mixer().signature.shapes
        origin = dict(shapes.origins)
        assert {origin[sym]: name for sym, name in shapes.names} == {"x.size()[0]": "batch", "y.size()[0]": "extra"}

    def test_one_dim_in_two_inputs_is_one_named_symbol(self):
        batch = Dim("batch", min=2, max=64)
        ep = predispatch.export(Mixer(), (torch.randn(4, 8), torch.randn(4, 8)), dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
        (symbol, _, _), = ep.signature.shapes.ranges
        assert ep.signature.shapes.names == ((symbol, "batch"),)

    def test_dim_names_that_cannot_be_bound_stop_the_export(self):
        """A torch whose reading of the spec no longer names our inputs: export stops, loudly,
        rather than return a program that silently lost the names."""
        from unittest import mock

        from predispatch import _torch_internals as ti
        from predispatch.errors import TorchDriftError

        with mock.patch.object(ti, "named_dims", lambda *a: [(0, 0, "batch")]), self.assertRaises(TorchDriftError) as info:
            self.export_mixer()
        self.assertIn("the user's Dim names", str(info.exception))
        self.assertIn("names Dim 'batch' on a tensor that is not an input", str(info.exception))

    def test_graph_is_symbolic_and_ranges_are_printed(self):
        text = str(self.export_mixer())
        assert "x: \"f32[s77, 8]\", y: \"f32[s17, 8]\"" in text and "s77 (batch): [2, 64]  (x.size()[0])" in text, text
        if not on_golden_torch():  # torch 2.15 places sym_size after linear
            return
        self.assertExpectedInline(text, """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, p_lin_weight: "f32[8, 8]", p_lin_bias: "f32[8]", x: "f32[s77, 8]", y: "f32[s17, 8]"):
            sym_size_int: "Sym(s77)" = torch.ops.aten.sym_size.int(x, 0)
            linear: "f32[s77, 8]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
            view: "f32[8*s77]" = torch.ops.aten.view.default(linear, [-1])
            cat: "f32[s17 + s77, 8]" = torch.ops.aten.cat.default([linear, y]);  y = None
            sum_1: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(linear, [0], True);  linear = None
            expand: "f32[s77, 8]" = torch.ops.aten.expand.default(sum_1, [sym_size_int, 8]);  sum_1 = sym_size_int = None
            return (view, cat, expand)

Graph signature:
    Inputs:
        p_lin_weight: PARAMETER target='lin.weight'
        p_lin_bias: PARAMETER target='lin.bias'
        x: USER_INPUT target='x'
        y: USER_INPUT target='y'
    Outputs:
        view: USER_OUTPUT target='output[0]'
        cat: USER_OUTPUT target='output[1]'
        expand: USER_OUTPUT target='output[2]'
    Range constraints:
        s17 (extra): [0, 32]  (y.size()[0])
        s77 (batch): [2, 64]  (x.size()[0])""")

    def test_runs_at_other_sizes_like_eager(self):
        ep = self.export_mixer()
        program, eager = ep.module(), Mixer()
        eager.load_state_dict(program.state_dict())
        for batch, extra in [(2, 2), (7, 5), (64, 32)]:
            x, y = torch.randn(batch, 8), torch.randn(extra, 8)
            assert_same_tree(program(x, y), eager(x, y))

    def test_sizes_outside_the_range_are_refused(self):
        program = self.export_mixer().module()
        for batch, extra, why in [(1, 3, "batch"), (65, 3, "batch"), (4, 33, "extra")]:
            with self.subTest(batch=batch, extra=extra), pytest.raises(errors.DynamicShapeError) as info:
                program(torch.randn(batch, 8), torch.randn(extra, 8))
            self.assertIn(f"outside the range [{2 if why == 'batch' else 0}, ", str(info.value))
            self.assertIn(f"of Dim {why!r}", str(info.value))
        with pytest.raises(errors.InputMismatchError):
            program(torch.randn(4, 9), torch.randn(3, 8))  # a static dimension

    def test_size_outside_the_range_names_the_users_dim(self):
        """The call-time range error names the user's Dim (`batch`), not only torch's symbol, and
        its fix (a range that holds the size) works."""
        program = self.export_mixer().module()
        (symbol,) = [sym for sym, name in self.export_mixer().signature.shapes.names if name == "batch"]
        with pytest.raises(errors.DynamicShapeError) as info:
            program(torch.randn(65, 8), torch.randn(3, 8))
        self.assertEqual(message(info.value).replace(symbol, "sN"), """\
this call's shapes do not fit the program: x.shape[0] is 65, outside the range [2, 64] of Dim 'batch' (sN in print(ep)).
  at test_dynamic.py:N (program(torch.randn(65, 8), torch.randn(3, 8)))
  fix: call with x.shape[0] in [2, 64], or export again with a range for Dim 'batch' (sN in print(ep)) that holds 65.
  see docs/errors.md#dynamicshapeerror""")
        torch.manual_seed(0)
        eager = Mixer()
        shapes = {"x": {0: Dim("batch", min=2, max=65)}, "y": {0: Dim("extra", max=32)}}
        wider = predispatch.export(eager, (torch.randn(4, 8), torch.randn(3, 8)), dynamic_shapes=shapes).module()
        x, y = torch.randn(65, 8), torch.randn(3, 8)
        assert_same_tree(wider(x, y), eager(x, y))

    def test_constant_keyword_needs_a_none_entry(self):
        """A constant keyword argument left out of a dynamic_shapes dict: the fix names it and
        its None entry, and with that entry the export succeeds and equals eager."""

        class Scaled(nn.Module):
            def forward(self, x, scale=2.0):
                return x * scale

        x, seq = torch.randn(4, 3), Dim("seq", min=2, max=16)
        with pytest.raises(errors.DynamicShapeError) as info:
            predispatch.export(Scaled(), (x,), {"scale": 3.0}, dynamic_shapes={"x": {0: seq}})
        assert message(info.value).splitlines()[1:] == [
            "  at test_dynamic.py:N (predispatch.export(Scaled(), (x,), {\"scale\": 3.0}, dynamic_shapes={\"x\": {0: seq}}))",
            "  fix: add 'scale': None to dynamic_shapes: torch wants an entry for every argument passed; scale=3.0 is a "
            "constant (baked into the program), whose entry is None; a tensor argument with no dynamic dimension takes None too.",
            "  see docs/errors.md#dynamicshapeerror",
        ]
        program = predispatch.export(Scaled(), (x,), {"scale": 3.0}, dynamic_shapes={"x": {0: seq}, "scale": None}).module()
        longer = torch.randn(9, 3)
        assert_same_tree(program(longer, scale=3.0), Scaled()(longer, scale=3.0))

    def test_specialized_dimension_is_refused_with_torchs_fix(self):
        with pytest.raises(errors.DynamicShapeError) as info:
            predispatch.export(Specializes(), (torch.randn(4, 8),), dynamic_shapes={"x": {0: Dim("rows")}})
        text = message(info.value)
        self.assertIn("You marked rows as dynamic but your code specialized it to be a constant (4)", text)
        self.assertIn("Suggested fixes:\n  rows = 4", text)

    def test_malformed_spec(self):
        with pytest.raises(errors.DynamicShapeError) as info:
            predispatch.export(Specializes(), (torch.randn(4, 8),), dynamic_shapes={"y": {0: Dim("rows")}})
        self.assertIn("dynamic_shapes does not match the inputs", str(info.value))

    def test_function_with_dynamic_shapes(self):
        def fn(a, b):
            return a @ b

        ep = predispatch.export(fn, (torch.randn(3, 4), torch.randn(4, 5)), dynamic_shapes=({0: Dim("m")}, {1: Dim("n")}))
        a, b = torch.randn(6, 4), torch.randn(4, 2)
        assert_same_tree(ep.module()(a, b), fn(a, b))

    def test_checks_on_data_dependent_values_are_recorded(self):
        class Counted(nn.Module):
            def forward(self, x):
                n = (x > 0).sum().item()
                torch._check(n <= x.shape[0])  # a check torch defers to run time
                return torch.zeros(n) + x[:1]

        ep = predispatch.export(Counted(), (torch.randn(5),))
        self.assertIn("runtime: ", "".join(ep.signature.shapes.guards))
        self.assertIn("Shape guards:", str(ep))
        x = torch.tensor([1.0, -1.0, 2.0, 3.0, -4.0])
        assert_same_tree(ep.module()(x), Counted()(x))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)).relu()


class DynamicBatch(TestCase):
    """A dynamic batch from 1 to 64, as torch.export takes it (Note [Size 0 and 1 in a dynamic range])."""

    def test_conv_net_runs_every_batch_from_one_to_sixty_four(self):
        model = ConvNet().eval()
        batch = Dim("batch", min=1, max=64)
        ep = predispatch.export(model, (torch.randn(4, 3, 8, 8),), dynamic_shapes=({0: batch},))
        self.assertEqual([r[1:] for r in ep.signature.shapes.ranges], [(1, 64)])
        program = ep.module()
        for size in (1, 2, 15, 16, 64):
            x = torch.randn(size, 3, 8, 8)
            assert_same_tree(program(x), model(x))
        with pytest.raises(errors.DynamicShapeError):
            program(torch.randn(65, 3, 8, 8))

    def test_declared_minimum_of_one_is_kept(self):
        ep = predispatch.export(Mixer(), (torch.randn(4, 8), torch.randn(3, 8)),
                                dynamic_shapes={"x": {0: Dim("batch", min=1, max=64)}, "y": None})
        self.assertIn("[1, 64]", str(ep))
        program, eager = ep.module(), Mixer()
        eager.load_state_dict(program.state_dict())
        x, y = torch.randn(1, 8), torch.randn(3, 8)
        assert_same_tree(program(x, y), eager(x, y))

    def test_frozen_backend_flags_are_no_obstacle(self):
        """torch's test utilities freeze the backend flags (`disable_global_flags`): export
        still turns mkldnn off for its trace (in a subprocess: the freeze cannot be undone)."""
        import subprocess
        import sys

        code = (
            "import torch, predispatch\n"
            "torch.backends.disable_global_flags()\n"
            "m = torch.nn.Conv2d(3, 4, 3)\n"
            "ep = predispatch.export(m, (torch.randn(4, 3, 8, 8),), "
            "dynamic_shapes=({0: torch.export.Dim('batch', min=1, max=64)},))\n"
            "print(ep.signature.shapes.ranges[0][1:], torch.backends.mkldnn.enabled)"
        )
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        self.assertEqual(done.stdout.strip(), f"(1, 64) {torch.backends.mkldnn.enabled}", done.stderr)

    def test_backends_are_back_after_export(self):
        before = torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled
        predispatch.export(ConvNet(), (torch.randn(2, 3, 8, 8),), dynamic_shapes=({0: Dim("batch", max=64)},))
        after = torch.backends.mkldnn.enabled, torch.backends.cudnn.enabled
        self.assertEqual(before, after)


class DataDependent(TestCase):
    maxDiff = None

    def test_item_becomes_an_unbacked_symbol(self):
        class Scale(nn.Module):
            def forward(self, x):
                n = x.sum().item()
                return x * n, n

        ep = predispatch.export(Scale(), (torch.randn(5),))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, x: "f32[5]"):
            sum_1: "f32[]" = torch.ops.aten.sum.default(x)
            _local_scalar_dense: "Sym(zuf0)" = torch.ops.aten._local_scalar_dense.default(sum_1);  sum_1 = None
            mul: "f32[5]" = torch.ops.aten.mul.Tensor(x, _local_scalar_dense);  x = None
            return (mul, _local_scalar_dense)

Graph signature:
    Inputs:
        x: USER_INPUT target='x'
    Outputs:
        mul: USER_OUTPUT target='output[0]'
        _local_scalar_dense: USER_OUTPUT target='output[1]'""")
        x = torch.tensor([1.0, 0.0, 2.0])
        x = torch.cat([x, x[:2]])
        assert_same_tree(ep.module()(x), Scale()(x))

    def test_nonzero_has_a_data_dependent_size(self):
        class Pick(nn.Module):
            def forward(self, x):
                idx = x.nonzero()
                return x[idx[:, 0]], idx.shape[0]

        ep = predispatch.export(Pick(), (torch.randn(5),))
        for x in (torch.tensor([1.0, 0.0, 2.0, 0.0, 3.0]), torch.zeros(5), torch.ones(5)):
            assert_same_tree(ep.module()(x), Pick()(x))

    def test_branch_on_data_suggests_torch_cond(self):
        class Branch(nn.Module):
            def forward(self, x):
                if x.nonzero().shape[0] > 2:
                    return x * 2
                return x

        with pytest.raises(errors.DataDependentError) as info:
            predispatch.export(Branch(), (torch.randn(5),))
        self.assertExpectedInline(message(info.value), """\
Python code branches on, or converts, a value inside a tensor, which export cannot know (it traces shapes, not values).
  at test_dynamic.py:N (if x.nonzero().shape[0] > 2:)
  fix: compute both arms and pick with torch.where(cond, a, b), or use torch.cond(pred, true_fn, false_fn, (x,)) with arms that return new tensors (x * 1, not x itself); both need arms of one shape: where the arms differ in shape (x[:2] vs x) neither fits (torch.where cannot pick between them, and torch.cond's output size then depends on data, which a saved program cannot hold), so make both arms the same shape (pad or mask the shorter one) or move the branch out of forward (decide before calling the program, and export each arm).
  see docs/errors.md#datadependenterror""")
