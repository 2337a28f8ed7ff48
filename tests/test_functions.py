"""Plain functions that call modules, nested exports, and re-export of a program's module()."""

from __future__ import annotations

import copy
import dataclasses
import tempfile

import torch
import torch.nn.functional as F
from expecttest import TestCase
from helpers import assert_same_tree, clone_tree
from test_export import ConvBN, Masked
from test_regions import EMA, Nested
from torch import nn

import predispatch
from predispatch import InputKind
from predispatch import _torch_internals as ti

torch.manual_seed(0)
encoder = nn.Linear(4, 4)  # a module held in a global
norm = nn.BatchNorm1d(4)


def make_closure():
    scale = nn.Linear(4, 4, bias=False)  # a module held in a closure

    def fn(x, head):  # `head`: a module passed as an argument
        return head(F.relu(norm(encoder(x)))) + scale(x)

    return fn, scale


class FunctionsCallingModules(TestCase):
    maxDiff = None

    def test_globals_closures_and_arguments_are_lifted(self):
        fn, scale = make_closure()
        head, x = nn.Linear(4, 4), torch.randn(5, 4)
        ep = predispatch.export(fn, (x, head))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, p_scale_weight: "f32[4, 4]", p_norm_weight: "f32[4]", p_norm_bias: "f32[4]", p_encoder_weight: "f32[4, 4]", p_encoder_bias: "f32[4]", p_head_weight: "f32[4, 4]", p_head_bias: "f32[4]", b_norm_running_mean: "f32[4]", b_norm_running_var: "f32[4]", b_norm_num_batches_tracked: "i64[]", x: "f32[5, 4]"):
            linear: "f32[5, 4]" = torch.ops.aten.linear.default(x, p_encoder_weight, p_encoder_bias);  p_encoder_weight = p_encoder_bias = None
            add: "i64[]" = torch.ops.aten.add.Tensor(b_norm_num_batches_tracked, 1);  b_norm_num_batches_tracked = None
            _native_batch_norm_legit_functional = torch.ops.aten._native_batch_norm_legit_functional.default(linear, p_norm_weight, p_norm_bias, b_norm_running_mean, b_norm_running_var, True, 0.1, 1e-05);  linear = p_norm_weight = p_norm_bias = b_norm_running_mean = b_norm_running_var = None
            getitem: "f32[5, 4]" = _native_batch_norm_legit_functional[0]
            getitem_3: "f32[4]" = _native_batch_norm_legit_functional[3]
            getitem_4: "f32[4]" = _native_batch_norm_legit_functional[4];  _native_batch_norm_legit_functional = None
            relu: "f32[5, 4]" = torch.ops.aten.relu.default(getitem);  getitem = None
            linear_1: "f32[5, 4]" = torch.ops.aten.linear.default(relu, p_head_weight, p_head_bias);  relu = p_head_weight = p_head_bias = None
            linear_2: "f32[5, 4]" = torch.ops.aten.linear.default(x, p_scale_weight);  x = p_scale_weight = None
            add_1: "f32[5, 4]" = torch.ops.aten.add.Tensor(linear_1, linear_2);  linear_1 = linear_2 = None
            return (getitem_3, getitem_4, add, add_1)

Graph signature:
    Inputs:
        p_scale_weight: PARAMETER target='scale.weight'
        p_norm_weight: PARAMETER target='norm.weight'
        p_norm_bias: PARAMETER target='norm.bias'
        p_encoder_weight: PARAMETER target='encoder.weight'
        p_encoder_bias: PARAMETER target='encoder.bias'
        p_head_weight: PARAMETER target='head.weight'
        p_head_bias: PARAMETER target='head.bias'
        b_norm_running_mean: BUFFER target='norm.running_mean'
        b_norm_running_var: BUFFER target='norm.running_var'
        b_norm_num_batches_tracked: BUFFER target='norm.num_batches_tracked'
        x: USER_INPUT target='x'
    Outputs:
        getitem_3: BUFFER_MUTATION target='norm.running_mean'
        getitem_4: BUFFER_MUTATION target='norm.running_var'
        add: BUFFER_MUTATION target='norm.num_batches_tracked'
        add_1: USER_OUTPUT target='output'
    Module inputs (their state is lifted above):
        head: Linear""")
        self.assertEqual(ep.graph.find_nodes(op="get_attr"), [])  # nothing baked in as a constant

    def test_program_runs_like_the_function_and_updates_its_modules(self):
        fn, scale = make_closure()
        head, x = nn.Linear(4, 4), torch.randn(5, 4)
        before = copy.deepcopy(norm.state_dict())
        ep = predispatch.export(fn, (x, head))
        assert_same_tree(norm.state_dict(), before)  # export itself changes nothing
        actual = ep.module()(x, head)
        after_program = copy.deepcopy(norm.state_dict())
        norm.load_state_dict(before)
        expected = fn(x, head)
        assert_same_tree(actual, expected)
        assert_same_tree(after_program, norm.state_dict())  # the running stats moved the same way
        self.assertEqual(after_program["num_batches_tracked"].item(), before["num_batches_tracked"].item() + 1)

    def test_gradients_reach_the_modules_parameters(self):
        fn, scale = make_closure()
        head, x = nn.Linear(4, 4), torch.randn(5, 4)
        norm.eval()
        try:
            program = predispatch.export(fn, (x, head)).module()
            program(x, head).sum().backward()
            grads = [p.grad.clone() for p in (*encoder.parameters(), *scale.parameters())]
            for p in (*encoder.parameters(), *scale.parameters(), *head.parameters()):
                p.grad = None
            fn(x, head).sum().backward()
            for got, p in zip(grads, (*encoder.parameters(), *scale.parameters())):
                torch.testing.assert_close(got, p.grad, rtol=0, atol=0)
        finally:
            norm.train()

    def test_bound_method(self):
        model = Masked()
        x = torch.randn(2, 4)
        ep = predispatch.export(model.forward, (x,))
        self.assertEqual([s.target for s in ep.signature.inputs_of(InputKind.PARAMETER)], ["self.lin.weight", "self.lin.bias"])
        assert_same_tree(ep.module()(x), model(x))


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, h):
        self.calls += 1
        with torch.no_grad():
            gate = torch.sigmoid(h.mean())
        return self.lin(h) * gate


class LibraryThatExports(nn.Module):
    """Calls predispatch.export on a submodule inside its own forward, as a library might."""

    def __init__(self, nested: bool):
        super().__init__()
        self.nested = nested
        self.pre = nn.Linear(4, 4)
        self.inner = Inner()

    def forward(self, x):
        h = self.pre(x)
        if self.nested:
            return predispatch.export(self.inner, (h,)).module()(h)
        return self.inner(h)


class NestedExport(TestCase):
    def test_inner_program_is_inlined_like_flat_code(self):
        x = torch.randn(3, 4)
        flat, nested = LibraryThatExports(nested=False), LibraryThatExports(nested=True)
        nested.load_state_dict(flat.state_dict())
        ep_flat = predispatch.export(flat, (x,))
        ep_nested = predispatch.export(nested, (x,))
        self.assertEqual(str(ep_nested), str(ep_flat))
        # Run eagerly, the library's own export would train copies; the program means the flat code.
        program, x1, x2 = ep_nested.module(), x.clone().requires_grad_(), x.clone().requires_grad_()
        assert_same_tree(program(x1), flat(x2))
        program(x1).sum().backward(), flat(x2).sum().backward()
        assert_same_tree(x1.grad, x2.grad)
        for p, q in zip(program.parameters(), flat.parameters()):
            assert_same_tree(p.grad, q.grad)

    def test_nested_export_leaves_modules_untouched(self):
        model = LibraryThatExports(nested=True)
        before = copy.deepcopy(model.state_dict())
        predispatch.export(model, (torch.randn(3, 4),))
        assert_same_tree(model.state_dict(), before)
        self.assertIsInstance(model.inner.lin.weight, nn.Parameter)


class ReExport(TestCase):
    def test_reexport_of_program_module_is_stable(self):
        cases = [
            (ConvBN().train(), (torch.randn(2, 3, 6, 6),), {}),
            (Nested(), (torch.randn(3),), {}),
            (EMA(), (torch.randn(4, 3),), {}),
            (Masked(), (torch.randn(2, 4),), {"mask": torch.rand(2, 4) > 0.5, "scale": 0.5}),
        ]
        for model, args, kwargs in cases:
            with self.subTest(type(model).__name__):
                first = predispatch.export(model, args, kwargs)
                second = predispatch.export(first.module(), args, kwargs)
                self.assertEqual(str(second), str(first))
                third = predispatch.export(second.module(), args, kwargs)
                self.assertEqual(str(third), str(first))
                program = copy.deepcopy(first.module())
                assert_same_tree(second.module()(*clone_tree(args), **kwargs), program(*clone_tree(args), **kwargs))


# --- modules outside the registered tree (issue 12, item 3) -----------------------------------


class _Helpers:
    """A plain object holding a module: not a submodule of the model."""

    def __init__(self):
        self.proj = nn.Linear(3, 3)


class OutsideTheTree(nn.Module):
    """Modules forward calls that `named_parameters()` does not list."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.helpers = [nn.Linear(3, 3), nn.BatchNorm1d(3)]  # a plain list
        self.table = {"gate": nn.Linear(3, 3)}  # a plain dict
        self.pair = (nn.Linear(3, 3),)  # a tuple
        self.ctx = _Helpers()  # a helper object

    def forward(self, x):
        x = self.helpers[1](self.helpers[0](self.lin(x)))
        return self.ctx.proj(self.pair[0](x)) * torch.sigmoid(self.table["gate"](x))


def _parameters_by_path(root) -> dict[str, torch.Tensor]:
    from predispatch.frontend.reachable import resolve

    paths = [
        "lin.weight", "lin.bias", "helpers.0.weight", "helpers.0.bias", "helpers.1.weight", "helpers.1.bias",
        "table.gate.weight", "table.gate.bias", "pair.0.weight", "pair.0.bias", "ctx.proj.weight", "ctx.proj.bias",
    ]  # fmt: skip
    return {p: resolve(root, p) for p in paths}


class ModulesOutsideTheTree(TestCase):
    maxDiff = None

    def test_state_is_lifted_by_path(self):
        model, x = OutsideTheTree().train(), torch.randn(4, 3)
        ep = predispatch.export(model, (x,))
        inputs = [(s.kind.name, s.target) for s in ep.signature.inputs]
        self.assertEqual(
            [t for k, t in inputs if k == "PARAMETER"],
            ["lin.weight", "lin.bias", "helpers.0.weight", "helpers.0.bias", "helpers.1.weight", "helpers.1.bias",
             "table.gate.weight", "table.gate.bias", "pair.0.weight", "pair.0.bias", "ctx.proj.weight", "ctx.proj.bias"],
        )  # fmt: skip
        self.assertEqual(
            [(s.kind.name, s.target) for s in ep.signature.mutations],
            [("BUFFER_MUTATION", "helpers.1.running_mean"), ("BUFFER_MUTATION", "helpers.1.running_var"),
             ("BUFFER_MUTATION", "helpers.1.num_batches_tracked")],
        )  # fmt: skip
        self.assertEqual(ep.graph.find_nodes(op="get_attr"), [])  # nothing baked in as a constant

    def test_outputs_gradients_and_buffer_updates_match_eager(self):
        model, x = OutsideTheTree().train(), torch.randn(4, 3)
        eager = copy.deepcopy(model)
        ep = predispatch.export(model, (x,))
        program = ep.module()
        expected, actual = eager(x), program(x)
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        expected.sum().backward()
        actual.sum().backward()
        want, got = _parameters_by_path(eager), _parameters_by_path(program)
        for path in want:
            assert got[path].grad is not None, path
            torch.testing.assert_close(got[path].grad, want[path].grad, rtol=0, atol=0, msg=path)
        # the batch norm in the plain list updated its running stats in the program, as in eager
        torch.testing.assert_close(program.helpers.get_submodule("1").running_mean, eager.helpers[1].running_mean)
        self.assertEqual(int(program.helpers.get_submodule("1").num_batches_tracked), 1)

    def test_the_users_outside_modules_are_trained_through_the_program(self):
        """`module()` shares the user's tensors (Note [module() shares the program's state]): the
        modules kept in a plain list, dict or tuple get the gradients and the buffer updates an
        eager step gives them, bitwise, and export alone changed nothing."""
        model, x = OutsideTheTree().train(), torch.randn(4, 3)
        eager = copy.deepcopy(model)
        program = predispatch.export(model, (x,)).module()
        torch.testing.assert_close(model.helpers[1].running_mean, torch.zeros(3), rtol=0, atol=0)
        expected, actual = eager(x), program(x)
        expected.sum().backward()
        actual.sum().backward()
        want, got = _parameters_by_path(eager), _parameters_by_path(model)  # the user's own modules
        self.assertIn("helpers.0.weight", got)
        for path in want:
            assert got[path].grad is not None, path
            torch.testing.assert_close(got[path].grad, want[path].grad, rtol=0, atol=0, msg=path)
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model.helpers[1], name), getattr(eager.helpers[1], name), rtol=0, atol=0)
        self.assertIs(program.helpers.get_submodule("0").weight, model.helpers[0].weight)

    def test_tensor_cached_in_a_plain_dict_is_a_constant(self):
        """A real tensor an earlier eager call cached in a dict (timm's attention_bias_cache) is
        read as a lifted constant, not mixed with the trace's fake tensors."""

        class Cached(nn.Module):
            def __init__(self):
                super().__init__()
                self.bias = nn.Parameter(torch.randn(3))
                self.cache = {}

            def forward(self, x):
                if "cpu" not in self.cache:
                    self.cache["cpu"] = self.bias * 2
                return x + self.cache["cpu"]

        model, x = Cached(), torch.randn(2, 3)
        with torch.no_grad():
            model(x)  # fills the cache with a real tensor
        ep = predispatch.export(model, (x,))
        self.assertIn(("CONSTANT_TENSOR", "cache.cpu"), [(s.kind.name, s.target) for s in ep.signature.inputs])
        torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)
        self.assertEqual(list(model.cache), ["cpu"])
        self.assertFalse(ti.is_traced_tensor(model.cache["cpu"]))

    def test_tensors_in_plain_containers_and_functions_reaching_them(self):
        """Tensors in a tuple, a dict and on a helper object are lifted constants; a function
        reaching such a model reads them live (its program shares the user's modules)."""

        class Holder(nn.Module):
            def __init__(self):
                super().__init__()
                self.helpers = [nn.Linear(3, 3)]
                self.pair = (torch.full((3,), 2.0), torch.full((3,), 3.0))
                self.table = {"shift": torch.ones(3)}
                self.ctx = _Helpers()
                self.ctx.scale = torch.full((3,), 0.5)

            def forward(self, x):
                return self.helpers[0](x) * self.pair[1] + self.pair[0] + self.table["shift"] * self.ctx.scale

        model, x = Holder(), torch.randn(2, 3)
        for exported in (model, lambda t: model(t)):
            ep = predispatch.export(exported, (x,))
            prefix = "" if exported is model else "model."
            self.assertEqual(
                [(s.kind.name, s.target) for s in ep.signature.inputs if s.kind.name == "CONSTANT_TENSOR"],
                [("CONSTANT_TENSOR", prefix + p) for p in ("pair.0", "pair.1", "table.shift", "ctx.scale")],
            )
            torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)
            self.assertIsInstance(model.pair, tuple)
            self.assertFalse(any(ti.is_traced_tensor(t) for t in (*model.pair, model.table["shift"], model.ctx.scale)))

    def test_state_dict_keys_and_values_match_eager(self):
        """`ep.module().state_dict()` lists what the exported module's does (not the helpers kept
        outside its tree), before and after a call that updates a helper's buffer, while the
        program still reads and writes the helpers' state at each call; loading the original's
        state_dict works, and a saved program keeps all of it."""
        model, x = OutsideTheTree().train(), torch.randn(4, 3)
        eager = copy.deepcopy(model)
        ep = predispatch.export(model, (x,))
        self.assertEqual(ep.signature.outside_tree, ("helpers", "table", "pair", "ctx"))
        path = self.enterContext(tempfile.TemporaryDirectory()) + "/outside.pd"
        predispatch.save(ep, path)
        for program in (ep.module(), predispatch.load(path).module()):
            self.assertEqual(list(program.state_dict()), list(eager.state_dict()))
            self.assertEqual([n for n, _ in program.named_parameters()], [n for n, _ in eager.named_parameters()])
            state_before = {k: v.clone() for k, v in eager.state_dict().items()}
            expected, actual = copy.deepcopy(eager)(x), program(x)
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)
            self.assertEqual(list(program.state_dict()), list(eager.state_dict()))
            for key, value in program.state_dict().items():
                torch.testing.assert_close(value, state_before[key], rtol=0, atol=0, msg=key)
            # the helper's buffer outside the tree was updated at its path, as eager's is
            ran = copy.deepcopy(eager)
            ran(x)
            helper = program.helpers.get_submodule("1")
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                torch.testing.assert_close(getattr(helper, name), getattr(ran.helpers[1], name), rtol=0, atol=0, msg=name)
            self.assertNotEqual(int(helper.num_batches_tracked), 0)
            # the original's keys load back (strict), and the program runs with them
            other = OutsideTheTree().train()
            other.helpers = copy.deepcopy(eager.helpers)
            other.table, other.pair, other.ctx = eager.table, eager.pair, eager.ctx
            program.load_state_dict(other.state_dict())
            torch.testing.assert_close(program.lin.weight, other.lin.weight, rtol=0, atol=0)
            self.assertNotEqual(program.lin.weight.data_ptr(), other.lin.weight.data_ptr())

    def test_outside_tree_paths_are_verified(self):
        """A recorded path no lifted state lies under breaks the contract (a crafted file)."""
        from predispatch.serialize.verify import program_problems

        ep = predispatch.export(OutsideTheTree(), (torch.randn(4, 3),))
        self.assertEqual(program_problems(ep), [])
        bad = dataclasses.replace(ep, signature=dataclasses.replace(ep.signature, outside_tree=("lin", "nowhere")))
        self.assertEqual(
            [(p.where, p.why) for p in program_problems(bad)],
            [("signature outside_tree", "'nowhere' is not the path of a container holding lifted state")],
        )

    def test_state_dict_of_a_module_with_state_dict_hooks(self):
        """With state_dict hooks, `ep.module().state_dict()` is the exported module's own, which
        does not hold the state kept outside its tree; loading it back works."""
        model = OutsideTheTree()
        model._register_state_dict_hook(lambda module, state, prefix, local_metadata: state)
        program = predispatch.export(model, (torch.randn(4, 3),)).module()
        self.assertEqual(sorted(program.state_dict()), sorted(model.state_dict()))
        program.load_state_dict(model.state_dict())
