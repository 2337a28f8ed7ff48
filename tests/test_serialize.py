"""save/load: loaded programs run and differentiate exactly like the saved ones; bad files are refused."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import hashlib
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import typing
import zipfile

import pytest
import torch
import torch.utils._pytree as pytree
from expecttest import TestCase
from helpers import assert_same_tree, subprocess_env
from test_consumers import WhileModel
from test_export import Batch, ConvBN, Counter, DictOut, Masked, ScaleInPlace, Tied, WithConstant
from test_regions import CASES as REGION_CASES
from test_regions import LeftOpen
from torch import fx, nn

import predispatch
from predispatch.errors import SerializationError
from predispatch.serialize import archive as serialize


class GraphTensors(nn.Module):
    """Tensors created in forward become attributes of the graph (and of a region's subgraph)."""

    def forward(self, x):
        with torch.no_grad():
            y = x + torch.tensor([1.0, 2.0])
        return x * torch.tensor([3.0, 4.0]) + y


class OddState(nn.Module):
    """State safetensors alone would not round-trip: strides, shared storage, dtypes, flags."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3).t())  # non-contiguous
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        base = torch.arange(8.0)
        self.register_buffer("low", base[:4])  # two buffers sharing one storage
        self.register_buffer("high", base[4:])
        self.register_buffer("bf16", torch.randn(4).to(torch.bfloat16))
        self.register_buffer("wide", torch.randn(4, dtype=torch.complex128))  # stored as bytes
        self.register_buffer("steps", torch.tensor(3))
        self.register_buffer("empty", torch.zeros(0, 4))
        self.register_buffer("scratch", torch.ones(4), persistent=False)

    def forward(self, x):
        self.steps.add_(1)
        y = x @ self.weight + self.frozen * self.low + self.high + self.bf16.float() + self.wide.real.float()
        return y * self.scratch + self.empty.sum()


class KwargsAndConstants(nn.Module):
    def forward(self, x, *, scale: float = 1.0, mode: str = "a", inf: float = float("inf"), dtype=torch.float64):
        return {"out": (x * scale).clamp(max=inf).to(dtype), "mode": mode, "nothing": None}


class CustomFunctions(nn.Module):
    """autograd.Functions (the autograd_function_apply HOP), one inside a grad region's reach."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        from test_autograd_function import ScaledMul, SetupContextLinear, StraightThrough

        y = StraightThrough.apply(x * 2)
        with torch.no_grad():
            z = y + 1
        return SetupContextLinear.apply(y + z, self.weight) + ScaledMul.apply(x, y, 0.5)


class CountedLoop(nn.Module):
    """torch's while_loop with a tensor counter, both carries returned."""

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        return while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2 + i), (torch.tensor(0), x))


class DataTripCount(nn.Module):
    """A while_loop that runs `n` times, `n` an input tensor: the trip count comes from data."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x, n):
        from torch._higher_order_ops.while_loop import while_loop

        start = torch.zeros((), dtype=torch.long)
        _, y = while_loop(lambda i, y: i < n, lambda i, y: (i + 1, torch.tanh(y @ self.weight) + y), (start, x))
        return y * 2


WHILE_LOOPS = {
    "counted": lambda: (CountedLoop(), (torch.randn(4, 8),), {}),
    "parameter": lambda: (WhileModel(), (torch.randn(4, 8),), {}),  # a layer in the body
    "data_trip_count": lambda: (DataTripCount(), (torch.randn(4, 8), torch.tensor(4)), {}),
}


def _args_of(module_cls, make_args):
    return lambda: (module_cls(), make_args(), {})


CASES = {
    **{f"region_{name}": _args_of(cls, make) for name, (cls, make) in REGION_CASES.items()},
    "conv_bn_train": lambda: (ConvBN().train(), (torch.randn(2, 3, 6, 6),), {}),
    "buffer_mutation": lambda: (Counter(), (torch.randn(2, 3),), {}),
    # an integer x: the check makes float inputs leaves requiring grad, which eager (and the
    # program) refuse to change in place
    "input_mutation": lambda: (ScaleInPlace(), (torch.arange(3), torch.randn(3)), {}),
    "dict_output": lambda: (DictOut(), (torch.randn(2, 3),), {}),
    "kwargs": lambda: (Masked(), (torch.randn(2, 4),), {"mask": torch.rand(2, 4) > 0.5, "scale": 0.5}),
    "tied": lambda: (Tied(), (torch.tensor([[1, 2, 3]]),), {}),
    "dataclass_input": lambda: (WithConstant(), (Batch(torch.randn(4), torch.randn(4)),), {}),
    "graph_tensors": lambda: (GraphTensors(), (torch.randn(2),), {}),
    "odd_state": lambda: (OddState(), (torch.randn(2, 3),), {}),
    "autograd_functions": lambda: (CustomFunctions(), (torch.randn(4, 3),), {}),
    "constants": lambda: (KwargsAndConstants(), (torch.randn(3),), {"scale": 2.0, "mode": "b", "dtype": torch.float16}),
    **{f"while_loop_{name}": make for name, make in WHILE_LOOPS.items()},
}


def export_case(name):
    torch.manual_seed(0)
    module, args, kwargs = CASES[name]()
    return predispatch.export(module, args, kwargs), args, kwargs


def saved(ep) -> bytes:
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    return buffer.getvalue()


def assert_same_behaviour(ep, loaded, args, kwargs):
    """Bitwise: outputs, their requires_grad, gradients of inputs and parameters, state after."""
    expected_module, actual_module = ep.module(), loaded.module()

    def fresh():
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.is_floating_point()), (args, kwargs)
        )

    def run(module, args, kwargs):
        try:
            return module(*args, **kwargs)
        finally:
            torch.set_grad_enabled(True)  # a program may leave grad mode off, as its forward did

    (e_args, e_kwargs), (a_args, a_kwargs) = fresh(), fresh()
    expected, actual = run(expected_module, e_args, e_kwargs), run(actual_module, a_args, a_kwargs)
    assert_same_tree(actual, expected)
    e_out = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    a_out = [t for t in pytree.tree_leaves(actual) if isinstance(t, torch.Tensor)]
    assert [t.requires_grad for t in a_out] == [t.requires_grad for t in e_out]
    for outs in (e_out, a_out):
        live = [t for t in outs if t.requires_grad]
        if live:
            torch.autograd.backward([t.float().sum() for t in live])
    for e, a in zip(pytree.tree_leaves((e_args, e_kwargs)), pytree.tree_leaves((a_args, a_kwargs))):
        if isinstance(e, torch.Tensor):
            assert_same_tree(a.grad, e.grad)
    e_params, a_params = dict(expected_module.named_parameters()), dict(actual_module.named_parameters())
    assert e_params.keys() == a_params.keys()
    for name, param in e_params.items():
        assert_same_tree(a_params[name].grad, param.grad)
    assert_same_tree(actual_module.state_dict(), expected_module.state_dict())


@pytest.mark.parametrize("name", sorted(CASES))
def test_round_trip(name, tmp_path):
    """Same text, same bytes when saved again, same numbers and gradients, every HOP included."""
    ep, args, kwargs = export_case(name)
    path = tmp_path / "program.pd"
    predispatch.save(ep, path)
    loaded = predispatch.load(path)
    assert str(loaded) == str(ep)
    assert saved(loaded) == path.read_bytes()
    assert loaded.decompositions.decisions == ep.decompositions.decisions
    assert list(loaded.state_dict) == list(ep.state_dict) and list(loaded.constants) == list(ep.constants)
    for name_, tensor in (*ep.state_dict.items(), *ep.constants.items()):
        other = {**loaded.state_dict, **loaded.constants}[name_]
        assert (type(other), other.dtype, other.shape, other.stride(), other.requires_grad) == (
            type(tensor), tensor.dtype, tensor.shape, tensor.stride(), tensor.requires_grad
        ), name_
        assert torch.equal(other, tensor), name_
    assert_same_behaviour(ep, loaded, args, kwargs)


class ScaledCounter(Counter):
    def __init__(self):
        super().__init__()
        self.scale = torch.ones(3, requires_grad=True)  # a constant leaf the user made require grad

    def forward(self, x):
        return super().forward(x) * self.scale


def test_state_written_in_grad_mode_is_saved_as_its_value(tmp_path):
    """A buffer a grad-mode run of module() wrote has autograd history (as running the model
    gives it); the file holds its value: it loads as a plain tensor, not a leaf requiring grad,
    while the parameters keep theirs and a leaf constant that requires grad keeps that."""
    model = ScaledCounter()
    ep = predispatch.export(model, (torch.randn(2, 3),))
    eager = copy.deepcopy(model)
    x = torch.randn(2, 3, requires_grad=True)
    ep.module()(x).sum().backward()
    eager(x.detach().requires_grad_()).sum().backward()
    assert ep.state_dict["total"].grad_fn is not None and eager.total.grad_fn is not None  # as eager leaves it
    path = tmp_path / "program.pd"
    predispatch.save(ep, path)
    loaded = predispatch.load(path)
    total = loaded.state_dict["total"]
    assert (type(total), total.requires_grad, total.is_leaf) == (torch.Tensor, False, True)
    assert torch.equal(total, eager.total.detach())
    assert loaded.state_dict["count"].requires_grad is False
    assert loaded.constants["scale"].requires_grad is True
    y = torch.randn(2, 3)
    assert_same_tree(loaded.module()(y), eager(y).detach())
    assert loaded.state_dict["total"].requires_grad is False  # a no-grad input: no history


def test_save_is_deterministic_and_atomic(tmp_path):
    ep, _, _ = export_case("region_nested")
    assert saved(ep) == saved(ep)
    path = tmp_path / "program.pd"
    with pytest.raises(SerializationError):
        predispatch.save(_unsaveable(ep), path)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


def test_file_layout():
    ep, _, _ = export_case("region_detached_double")
    with zipfile.ZipFile(io.BytesIO(saved(ep))) as zf:
        infos = zf.infolist()
        manifest = json.loads(zf.read("manifest.json"))
        program = json.loads(zf.read("program.json"))
    assert [i.filename for i in infos] == [
        "manifest.json", "program.json", "state.safetensors", "constants.safetensors", "graph.safetensors"
    ]
    assert {i.compress_type for i in infos} == {zipfile.ZIP_STORED}
    assert (manifest["format"], manifest["version"]) == ("predispatch.program", 2)
    nodes = [{k: v for k, v in n.items() if k != "meta"} for n in program["graph_module"]["nodes"]]
    assert nodes == [
        {"op": "placeholder", "name": "x", "target": "x"},
        {"op": "get_attr", "name": "grad_region_0", "target": "grad_region_0"},
        {
            "op": "call_function",
            "name": "wrap_with_set_grad_enabled",
            "target": "higher_order.wrap_with_set_grad_enabled",
            "args": [False, {"node": "grad_region_0"}, {"node": "x"}],
        },
        {"op": "call_function", "name": "mul", "target": "_operator.getitem", "args": [{"node": "wrap_with_set_grad_enabled"}, 0]},
        {"op": "call_function", "name": "add", "target": "aten.add.Tensor", "args": [{"node": "x"}, {"node": "mul"}]},
        {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [{"node": "add"}]}]},
    ]
    assert program["graph_module"]["nodes"][0]["meta"]["val"] == {
        "tensor": {"shape": [3], "stride": [1], "storage_offset": 0, "dtype": "float32", "device": "cpu", "requires_grad": False}
    }
    assert [s["name"] for s in program["graph_module"]["submodules"]] == ["grad_region_0"]


def test_format_covers_every_field():
    """A new field in a saved record must be added to the format (and docs/format.md) on purpose."""
    from predispatch.program.exported_program import ExportedProgram
    from predispatch.signature import ExportSignature, InputSpec, Leaf, OutputSpec, ShapeRecord

    from predispatch.trace.decompose import DecompositionLog

    records = (ExportedProgram, ExportSignature, InputSpec, OutputSpec, Leaf, DecompositionLog)
    fields = {cls.__name__: [f.name for f in cls.__dataclass_fields__.values()] for cls in records}
    assert fields == {
        "ExportedProgram": ["graph_module", "signature", "state_dict", "constants", "decompositions", "live_root", "hooks", "state_dict_owner"],
        "ExportSignature": ["inputs", "outputs", "in_spec", "out_spec", "input_leaves", "output_leaves", "grad_mode_on_exit", "arg_names", "shapes", "training_flags", "outside_tree", "state_order", "placements", "subclass_state"],
        "InputSpec": ["kind", "name", "target", "aliases", "persistent", "inner"],
        "OutputSpec": ["kind", "name", "target", "inner"],
        "Leaf": ["path", "is_tensor", "value", "layout"],
        "DecompositionLog": ["decisions"],
    }, "update predispatch/serialize/archive.py and docs/format.md (and VERSION if old files change meaning)"
    assert ShapeRecord.__dataclass_fields__  # saved field by field, whatever its fields


# --------------------------------------------------------------------------- refused files


def rewrite(data: bytes, edit) -> bytes:
    """The archive with `edit(members)` applied and every checksum recomputed: a crafted file."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = {name: zf.read(name) for name in zf.namelist()}
    program = json.loads(members["program.json"])
    manifest = json.loads(members["manifest.json"])
    edit(program, manifest)
    members["program.json"] = json.dumps(program).encode()
    manifest["members"] = {n: hashlib.sha256(d).hexdigest() for n, d in members.items() if n != "manifest.json"}
    manifest["sizes"] = {n: len(d) for n, d in members.items() if n != "manifest.json"}
    members["manifest.json"] = json.dumps(manifest).encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, member in members.items():
            zf.writestr(name, member)
    return out.getvalue()


def load_error(data: bytes, **options) -> str:
    with pytest.raises(SerializationError) as info:
        predispatch.load(io.BytesIO(data), **options)
    return str(info.value)


def node(program, name):
    return next(n for n in program["graph_module"]["nodes"] if n["name"] == name)


class RefusedFiles(TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.ep, _, _ = export_case("region_detached_double")
        cls.data = saved(cls.ep)

    def test_newer_version(self):
        def newer(program, manifest):
            manifest["version"] = 3

        self.assertExpectedInline(load_error(rewrite(self.data, newer)), """\
the file has format version 3; predispatch 0.1.0 reads versions 1, 2.
  fix: upgrade predispatch to a release that reads it.
  see docs/errors.md#serializationerror""")

    def test_not_a_zip(self):
        self.assertExpectedInline(load_error(b"not a program"), """\
the file is not a predispatch program: not a zip archive, or truncated.
  fix: pass a file written by predispatch.save; if it was, it was cut short or damaged.
  see docs/errors.md#serializationerror""")

    def test_truncated(self):
        self.assertIn("not a zip archive, or truncated", load_error(self.data[: len(self.data) // 2]))

    def test_flipped_weight_byte(self):
        ep, _, _ = export_case("conv_bn_train")
        data = bytearray(saved(ep))
        info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo("state.safetensors")
        start = info.header_offset + 30 + len(info.filename) + len(info.extra)  # the member's bytes
        data[start + info.file_size - 3] ^= 0x01  # in the last weight
        self.assertIn("Bad CRC-32 for file 'state.safetensors'", load_error(bytes(data)))

    def test_op_torch_does_not_have(self):
        def renamed(program, manifest):
            node(program, "add")["target"] = "aten.add_but_not_really.Tensor"

        text = load_error(rewrite(self.data, renamed)).replace(f"({torch.__version__})", "(<torch>)")
        self.assertExpectedInline(text, """\
graph module <root>, nodes[4] (add): calls aten.add_but_not_really.Tensor, which this torch (<torch>) does not have.
  fix: load with the torch release that saved the program (see manifest.json); for a custom op, import the library that defines it first.
  see docs/errors.md#serializationerror""")

    def test_target_outside_the_allow_list(self):
        for target in ("builtins.eval", "os.system", "higher_order.triton_kernel_wrapper_mutation", "torch.ops.aten.add.Tensor", "aten.__class__.default"):
            def hostile(program, manifest, target=target):
                node(program, "add")["target"] = target

            self.assertIn("which a program may not call", load_error(rewrite(self.data, hostile)), target)

    def test_schema_mismatch(self):
        def extra_kwarg(program, manifest):
            node(program, "add")["kwargs"] = {"beta": 2}

        self.assertIn("unknown argument 'beta'", load_error(rewrite(self.data, extra_kwarg)))

    def test_code_injection_through_names(self):
        """FX compiles graphs into Python: nothing a file names may become code."""
        edits = {
            "kwarg name": lambda p: node(p, "mul").update(kwargs={"x); import os; (": 1}),
            "node name": lambda p: node(p, "add").update(name="add(); import os #"),
            "placeholder target": lambda p: node(p, "x").update(target="x=__import__('os')"),
            "attribute target": lambda p: node(p, "grad_region_0").update(target="grad_region_0;os"),
            "stack trace": lambda p: node(p, "add").setdefault("meta", {}).update(
                stack_trace='File "a.py", line 1, in f\n    x\rimport os'
            ),
            "class name": lambda p: p["graph_module"].update(class_name="G(os.system('x'))"),
        }
        for what, edit in edits.items():
            message = load_error(rewrite(self.data, lambda program, manifest: edit(program)))
            self.assertTrue(message.startswith("graph module"), (what, message))

    def test_class_from_a_module_not_imported(self):
        ep, _, _ = export_case("dataclass_input")
        data = saved(ep)
        module = sys.modules.pop("test_export")
        try:
            message = load_error(data)
        finally:
            sys.modules["test_export"] = module
        self.assertExpectedInline(message, """\
signature in_spec[0][0]: the file names the class test_export:Batch; load builds a class only when you allow it, since building it runs the class's code (its __new__, __init__ and __post_init__, or its pytree unflatten function) on values from the file. It allows the classes you pass in types= and those your code or a library you imported registered as pytree nodes.
  fix: if you trust test_export.Batch, allow it: predispatch.load(path, types=[test_export.Batch]) after `import test_export` (load never imports a module a file names; importing it runs its code).
  see docs/errors.md#serializationerror""")

    def test_class_that_is_not_a_pytree_node(self):
        def hostile(program, manifest):
            program["signature"]["out_spec"] = {"type": "os:system", "context": None, "children": []}

        self.assertIn("signature out_spec: the file names the class os:system;", load_error(rewrite(self.data, hostile)))

    def test_namedtuple_context_must_be_a_namedtuple(self):
        def hostile(program, manifest):
            program["signature"]["out_spec"] = {
                "type": "collections:namedtuple", "context": {"class": "subprocess:Popen"}, "children": [None]
            }

        self.assertIn("signature out_spec context: the file names the class subprocess:Popen;", load_error(rewrite(self.data, hostile)))

    def test_inconsistent_signature(self):
        def dropped_input(program, manifest):
            program["signature"]["inputs"] = []

        self.assertIn("placeholders ['x'] differ from the signature's inputs", load_error(rewrite(self.data, dropped_input)))


def test_keyword_names_in_a_file_never_run_code(tmp_path):
    """Issue 21's file: two keyword names that close and reopen the string literal FX writes
    for `ep.module()`'s keyword dict.  Before the names were checked, `load` accepted it and
    `module()` ran the file's code while compiling; now `load` refuses it by name."""
    import load_attacks

    marker = tmp_path / "ran"
    names = [f'a=__import__("os").system("touch {marker}"), b="""', "):\n    pass\n#"]
    message = load_error(load_attacks.inject_kwargs(saved(export_case("kwargs")[0]), names))
    assert "signature in_spec: keyword argument: 'a=__import__" in message and "is not a Python identifier" in message
    assert not marker.exists()


def test_state_names_never_replace_the_modules_own_attributes():
    """A state named like an attribute `ep.module()` has of its own would replace it when
    installed (a constant tensor named `forward` or `_compiled_call_impl`): refused at load."""
    import load_attacks

    data = saved(export_case("buffer_mutation")[0])
    for name in ("forward", "_compiled_call_impl", "training"):
        message = load_error(load_attacks.renamed_state(data, "count", name, constant=True))
        assert f"state {name!r}: {name!r} is an attribute ep.module() has of its own" in message, message
    assert "'forward' is an attribute a module has of its own" in load_error(load_attacks.renamed_state(data, "count", "inner.forward"))
    loaded = predispatch.load(io.BytesIO(load_attacks.renamed_state(data, "count", "layers.0.count")))  # a Sequential's index is fine
    assert "layers.0.count" in loaded.module().state_dict()
    # fx.GraphModule's own names (not nn.Module's) load: the state goes into the module's dicts and
    # replaces nothing (Note [State named like a GraphModule attribute])
    for name in ("graph", "meta", "call_contract", "code"):
        for constant in (False, True):
            module = predispatch.load(io.BytesIO(load_attacks.renamed_state(data, "count", name, constant=constant))).module()
            assert isinstance(module.graph, fx.Graph) and isinstance(module.meta, dict) and isinstance(module.code, str), name
            assert (name in module.state_dict()) is not constant, name
            module(torch.randn(2, 3))


class BitOps(nn.Module):
    """What Hugging Face attention masks trace to: `aten.__and__.Tensor`, `__or__`, `__xor__`,
    `__lshift__`, `__rshift__` (issue 26)."""

    def forward(self, a, b, mask):
        return (a & b) | (a ^ b), a << 2, b >> 1, mask & (a > 1), (mask | (b > 2)) ^ mask


def test_dunder_ops_of_the_allow_list_load():
    """`_resolve_target` refused every `__` op name before the allow list; the allow list's
    own dunder packets now resolve (other dunders still never reach `getattr`)."""
    args = (torch.tensor([1, 2, 3, 12]), torch.tensor([3, 3, 1, 5]), torch.tensor([True, False, True, False]))
    ep = predispatch.export(BitOps(), args)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"aten.__and__.Tensor", "aten.__or__.Tensor", "aten.__xor__.Tensor", "aten.__lshift__.Scalar", "aten.__rshift__.Scalar"} <= targets
    loaded = predispatch.load(io.BytesIO(saved(ep)))
    assert_same_tree(loaded.module()(*args), BitOps()(*args))
    assert str(loaded) == str(ep)


def test_custom_op_namespace_is_opt_in():
    @torch.library.custom_op("pdtest::double", mutates_args=())
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    double.register_fake(lambda x: torch.empty_like(x))

    class UsesCustomOp(nn.Module):
        def forward(self, x):
            return torch.ops.pdtest.double(x) + 1

    x = torch.randn(3)
    ep = predispatch.export(UsesCustomOp(), (x,))
    data = saved(ep)
    assert "namespaces ['aten', 'prims', 'predispatch']" in load_error(data)
    loaded = predispatch.load(io.BytesIO(data), op_namespaces=("pdtest",))
    assert_same_tree(loaded.module()(x), ep.module()(x))


class Reshaping(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y.view(y.size(0) * 2, -1)  # size arithmetic in the graph: operator.mul on a SymInt


def test_dynamic_shapes_round_trip():
    """Symbols, ranges and guards survive; the loaded program runs at other sizes and refuses
    out-of-range ones as the original does."""
    from torch.export import Dim

    from predispatch.errors import DynamicShapeError

    model = Reshaping()
    ep = predispatch.export(model, (torch.randn(3, 4),), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    loaded = predispatch.load(io.BytesIO(saved(ep)))
    assert str(loaded) == str(ep)
    assert loaded.signature.shapes == ep.signature.shapes
    (symbol, low, high), = loaded.signature.shapes.ranges
    assert (low, high) == (2, 64)
    assert re.search(rf'x: "f32\[{symbol}, 4\]".*"Sym\(2\*{symbol}\)"', str(loaded), re.S)
    for batch in (2, 7, 64):
        x = torch.randn(batch, 4)
        assert_same_tree(loaded.module()(x), model(x))
    for program in (ep, loaded):
        with pytest.raises(DynamicShapeError, match=rf"x.shape\[0\] is 65, outside the range \[2, 64\] of Dim 'batch' \({symbol} in print"):
            program.module()(torch.randn(65, 4))
    assert saved(loaded) == saved(ep)


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "s0.__class__", "lambda: 1", "s0 ** 1000000", "unknown + 1", "(" * 2000],
)
def test_dynamic_shape_expressions_run_no_code(expression):
    """Size expressions are read by a grammar, never eval/sympify (Note [What load trusts])."""
    from torch.export import Dim

    ep = predispatch.export(nn.Linear(4, 4), (torch.randn(3, 4),), dynamic_shapes=({0: Dim("batch")},))

    def edit(program, manifest):
        node(program, "input_1")["meta"]["val"]["tensor"]["shape"][0]["sym"] = expression

    assert "is not a size expression" in load_error(rewrite(saved(ep), edit))


class Concatenated(nn.Module):
    def forward(self, x, y):
        return torch.cat([x, y], 0)


@pytest.mark.parametrize("size, why", [
    ("Mod(SYM, 0)", "divides by something other than a positive integer"),
    ("SYM // 0", "divides by something other than a positive integer"),
    ("SYM % SYM", "divides by something other than a positive integer"),
    ("Max()", "calls Max with 0 arguments"),
    ("2*SYM + s99", "is not a size expression over the program's symbols"),
])
def test_input_size_expressions_a_call_cannot_evaluate_are_refused(size, why):
    """Issue 21: the grammar accepted input sizes the call check (sympy, at every call) cannot
    evaluate; the file loaded and every call raised a raw TypeError or ZeroDivisionError."""
    from torch.export import Dim

    batch = Dim("batch", min=2, max=64)
    ep = predispatch.export(Concatenated(), (torch.randn(3, 4), torch.randn(6, 4)), dynamic_shapes=({0: batch}, {0: 2 * batch}))
    (symbol, _, _), = ep.signature.shapes.ranges

    def edit(program, manifest):
        program["signature"]["shapes"]["input_shapes"]["tuple"][1]["tuple"][0] = size.replace("SYM", symbol)

    assert why in load_error(rewrite(saved(ep), edit))


def test_input_size_over_a_symbol_no_input_binds_is_refused():
    """A derived size over a declared symbol that no input dimension gives a value."""
    from torch.export import Dim

    batch = Dim("batch", min=2, max=64)
    ep = predispatch.export(Concatenated(), (torch.randn(3, 4), torch.randn(6, 4)), dynamic_shapes=({0: batch}, {0: 2 * batch}))
    (symbol, _, _), = ep.signature.shapes.ranges

    def edit(program, manifest):
        shapes = program["signature"]["shapes"]
        shapes["ranges"]["tuple"].append({"tuple": ["s5", 2, 8]})
        shapes["input_shapes"]["tuple"][1]["tuple"][0] = f"{symbol} + s5"

    assert "uses ['s5'], which no input dimension gives a value" in load_error(rewrite(saved(ep), edit))


class Squared(nn.Module):
    """A dynamic size squared in the graph: the (s, s) scores of attention over a dynamic
    sequence, flattened (GPT-2's and Llama's `s**2`)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scores = self.lin(x) @ x.T
        return scores.flatten().softmax(0), scores.reshape(-1, 1).expand(-1, 2) * x.sum()


def test_squared_dynamic_size_round_trip():
    """Issue 38 item 6: a program with a size `s**2` saved, then load (and `predispatch show`)
    refused it: "'s70**2' is not a size expression".  Powers by an integer literal are in the
    size grammar: the loaded program prints the same, saves the same bytes and runs at other
    sizes as eager does, itself and through `to_torch()`."""
    from torch.export import Dim

    model = Squared()
    ep = predispatch.export(model, (torch.randn(5, 4),), dynamic_shapes=({0: Dim("seq", min=2, max=64)},))
    (symbol, _, _), = ep.signature.shapes.ranges
    assert f'"f32[{symbol}**2]"' in str(ep)
    loaded = predispatch.load(io.BytesIO(saved(ep)))
    assert str(loaded) == str(ep) and saved(loaded) == saved(ep)
    converted = loaded.to_torch()
    for seq in (2, 9, 64):
        x = torch.randn(seq, 4)
        assert_same_tree(loaded.module()(x), model(x))
        assert_same_tree(converted.module()(x), model(x))


@pytest.mark.parametrize("size", ["Max(3, SYM)", "Min(3, SYM)", "Mod(SYM, 3)", "(((SYM - 1)//2)) + 1", "2*SYM**2 + 1",
                                  "Max(SYM, ((SYM//2)) + 3)"])
def test_sizes_in_the_grammar_load_as_written(size):
    """Max, Min, Mod and FloorDiv are built without sympy's evaluation (Note [The size
    grammar]): a size as sympy prints it loads as the same expression, prints and saves as written."""
    from torch.export import Dim

    ep = predispatch.export(nn.Linear(4, 4), (torch.randn(3, 4),), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    (symbol, _, _), = ep.signature.shapes.ranges
    text = size.replace("SYM", symbol)

    def edit(program, manifest):
        node(program, "linear")["meta"]["val"]["tensor"]["shape"][0] = {"sym": text, "hint": 5}

    loaded = predispatch.load(io.BytesIO(rewrite(saved(ep), edit)))
    assert f'"f32[{text}, 4]"' in str(loaded)
    resaved = json.loads(zipfile.ZipFile(io.BytesIO(saved(loaded))).read("program.json"))
    assert node(resaved, "linear")["meta"]["val"]["tensor"]["shape"][0] == {"sym": text, "hint": 5}


def test_save_refuses_a_size_outside_the_grammar_by_name():
    """A size load could not read (interpolate's `TruncToInt(1.5*ToFloat(s))`) is refused by
    save, naming the node and the function, rather than written to a file load refuses."""
    from torch.export import Dim

    class Upsample(nn.Module):
        def forward(self, x):
            return nn.functional.interpolate(x, scale_factor=1.5, mode="nearest")

    ep = predispatch.export(Upsample(), (torch.randn(1, 2, 10),), dynamic_shapes=({2: Dim("t", min=4, max=64)},))
    with pytest.raises(SerializationError, match=r"node upsample_nearest1d meta\['val'\]: 'TruncToInt\(.*' is not a size "
                       r"expression: it calls TruncToInt, which the size grammar does not have"):
        saved(ep)


@pytest.mark.parametrize("name", ["N", "eval", "oo", "Symbol", "Max", "batch", "s01"])
def test_symbol_names_torch_does_not_make_are_refused(name):
    """Issue 40: a symbol named as sympy or Python name things (`N`, `oo`, `eval`) loaded, then
    every call failed with a raw error (the call check handed `2*N` to sympify).  A file's size
    symbols are named as torch names them, `s<index>`, and the call check no longer uses sympy."""
    from torch.export import Dim

    batch = Dim("batch", min=2, max=64)
    ep = predispatch.export(Concatenated(), (torch.randn(3, 4), torch.randn(6, 4)), dynamic_shapes=({0: batch}, {0: 2 * batch}))
    (symbol, _, _), = ep.signature.shapes.ranges

    def edit(program, manifest):
        renamed = json.loads(re.sub(rf"\b{symbol}\b", name, json.dumps(program)))
        program.clear()
        program.update(renamed)

    assert f"symbol {name!r} with range [2, 64] is not a size symbol" in load_error(rewrite(saved(ep), edit))


def test_call_check_evaluates_input_sizes_by_the_grammar():
    """The call check evaluates an input size on the grammar's parse with Python ints; it
    handed the text to sympy, so an input size `FloorDiv(...)` (which sympy cannot evaluate)
    was refused at load.  A call that does not fit says what the size must be."""
    from torch.export import Dim

    from predispatch.errors import DynamicShapeError

    batch = Dim("batch", min=2, max=64)
    ep = predispatch.export(Concatenated(), (torch.randn(3, 4), torch.randn(6, 4)), dynamic_shapes=({0: batch}, {0: 2 * batch}))
    (symbol, _, _), = ep.signature.shapes.ranges

    def edit(program, manifest):
        program["signature"]["shapes"]["input_shapes"]["tuple"][1]["tuple"][0] = f"FloorDiv(4*{symbol} + 1, 2)"

    loaded = predispatch.load(io.BytesIO(rewrite(saved(ep), edit)))
    x, y = torch.randn(5, 4), torch.randn(10, 4)
    assert_same_tree(loaded.module()(x, y), Concatenated()(x, y))
    with pytest.raises(DynamicShapeError, match=rf"shape\[0\] is 9 but must equal FloorDiv\(4\*{symbol} \+ 1, 2\) = 10"):
        loaded.module()(x, torch.randn(9, 4))


def test_dim_names_round_trip():
    """Issue 22 item 6: the user's Dim names are part of the program and survive save/load."""
    from torch.export import Dim

    batch = Dim("batch", min=2, max=64)
    ep = predispatch.export(Concatenated(), (torch.randn(3, 4), torch.randn(6, 4)), dynamic_shapes=({0: batch}, {0: 2 * batch}))
    (symbol, _, _), = ep.signature.shapes.ranges
    assert ep.signature.shapes.names == ((symbol, "batch"),)  # the derived 2*batch has no name of its own
    loaded = predispatch.load(io.BytesIO(saved(ep)))
    assert loaded.signature.shapes == ep.signature.shapes and f"{symbol} (batch): [2, 64]" in str(loaded)


@pytest.mark.parametrize("name, symbol", [
    ("x; import os", None),  # not an identifier: a name reaches ONNX files and printing
    ("batch", "s5"),  # names a symbol the program does not have
    (7, None),
])
def test_malformed_dim_names_are_refused(name, symbol):
    from torch.export import Dim

    ep = predispatch.export(Concatenated(), (torch.randn(3, 4), torch.randn(6, 4)), dynamic_shapes=({0: Dim("batch")}, None))
    (known, _, _), = ep.signature.shapes.ranges

    def edit(program, manifest):
        program["signature"]["shapes"]["names"]["tuple"][0]["tuple"] = [symbol or known, name]

    assert "malformed shape record" in load_error(rewrite(saved(ep), edit))


def _recompiles(monkeypatch) -> list:
    """Every `GraphModule.recompile` call from now on (FX recompiles descendants recursively)."""
    calls, original = [], torch.fx.GraphModule.recompile

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    return calls


def test_nesting_deeper_than_the_bound_is_refused_quickly():
    """Issue 21: 100 nested regions (a 134 KB program.json) took 15 s to load, 49 s for
    `module()`, then a raw RecursionError at the call.  A file nests at most
    MAX_SUBGRAPH_DEPTH deep; a deeper one is refused before its graphs are built."""
    import load_attacks

    from predispatch.serialize.verify import MAX_SUBGRAPH_DEPTH

    data = load_attacks.nested_regions(saved(export_case("region_detached_double")[0]), 100)
    start = time.monotonic()
    message = load_error(data)
    assert time.monotonic() - start < 5
    assert f"subgraphs nest more than {MAX_SUBGRAPH_DEPTH} deep" in message


def test_load_and_module_cost_grows_linearly_with_nesting(monkeypatch):
    """Load compiles each graph once (it compiled each level's whole subtree again: depth^2
    compiles, 561 at depth 32); `module()` walks each region body once (it walked every body
    below each level, recompiling as it went: cubic).  Programs at the bound load and run."""
    import load_attacks

    from predispatch.serialize.verify import MAX_SUBGRAPH_DEPTH

    base = saved(export_case("region_detached_double")[0])
    counts = {}
    for depth in (MAX_SUBGRAPH_DEPTH // 2, MAX_SUBGRAPH_DEPTH):
        data = load_attacks.nested_regions(base, depth)
        calls = _recompiles(monkeypatch)
        loaded = predispatch.load(io.BytesIO(data))
        assert len(calls) <= 2 * (depth + 1) + 1  # per graph module: its empty graph at construction, then its own
        calls.clear()
        module = loaded.module()
        counts[depth] = len(calls)
        x = torch.randn(3)
        assert torch.equal(module(x), x + x * 2)
        monkeypatch.undo()
    assert counts[MAX_SUBGRAPH_DEPTH] < 4.5 * counts[MAX_SUBGRAPH_DEPTH // 2], counts  # quadratic at most (was cubic)


def test_missing_path_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        predispatch.load(tmp_path / "nothing.pd")


def test_unsaveable_program_says_what():
    ep, _, _ = export_case("region_detached_double")
    with pytest.raises(SerializationError, match=r"calls <built-in function truediv>, which the file format cannot name"):
        saved(_unsaveable(ep))


def _unsaveable(ep):
    """A copy of `ep` whose graph calls a Python function the format has no name for."""
    import dataclasses
    import operator

    gm = copy.deepcopy(ep.graph_module)
    add = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor)
    add.target = operator.truediv  # not in PYTHON_CALLABLES (size arithmetic is)
    gm.recompile()
    return dataclasses.replace(ep, graph_module=gm)


# --------------------------------------------------------------------------- fuzzing


class LoadHung(BaseException):
    """Not an Exception, so that load cannot mistake it for a damaged file."""


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail instead of hanging (POSIX timers; the test runs in the main thread)."""

    def expired(signum, frame):
        raise LoadHung(f"load took more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def corrupt(data: bytes, rng: random.Random) -> bytes:
    """Flip a few bytes, or truncate, or both."""
    damaged = bytearray(data)
    kind = rng.choice(["flip", "flips", "truncate", "flip_and_truncate"])
    if kind in ("flip", "flips", "flip_and_truncate"):
        for _ in range(1 if kind == "flip" else rng.randint(2, 8)):
            damaged[rng.randrange(len(damaged))] ^= rng.randint(1, 255)
    if kind in ("truncate", "flip_and_truncate"):
        del damaged[rng.randrange(len(damaged)) :]
    return bytes(damaged)


FUZZ_CASES = 300


def test_fuzzed_files_load_identically_or_raise():
    """Random byte flips and truncations: each loads the very same program or raises
    SerializationError; no other exception, no hang."""
    ep, _, _ = export_case("region_pre_hook_region")
    original = saved(ep)
    rng = random.Random(0)
    outcomes = {"refused": 0, "identical": 0}
    start = time.monotonic()
    for case in range(FUZZ_CASES):
        data = corrupt(original, rng)
        with deadline(10):
            try:
                loaded = predispatch.load(io.BytesIO(data))
            except SerializationError:
                outcomes["refused"] += 1
                continue
        assert saved(loaded) == original, f"case {case} loaded a different program"
        outcomes["identical"] += 1
    assert outcomes["refused"] > FUZZ_CASES // 2, outcomes
    assert time.monotonic() - start < 120


def mutate_json(value, rng: random.Random):
    """One random structural change somewhere in a JSON tree."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(sorted(value))
        if rng.random() < 0.15:
            del value[key]
        else:
            value[key] = mutate_json(value[key], rng)
        return value
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        value[i] = mutate_json(value[i], rng)
        return value
    return rng.choice([
        None, True, 0, -1, 2**70, 1.5, float("inf"), "", "x", "aten.add.Tensor", "higher_order.cond",
        [], [1, "a"], {}, {"node": "x"}, {"tuple": 3}, {"dtype": "int128"}, {"class": "os:system"},
        {"tensor": {"shape": [2], "stride": [-1]}}, [[[[[]]]]],
    ])


def test_crafted_files_load_or_raise():
    """Random structural edits of program.json, re-checksummed (a stranger's file): load returns
    a program or raises SerializationError, never another exception."""
    ep, _, _ = export_case("region_intermediate_mutated_under_no_grad")
    original = saved(ep)
    rng = random.Random(1)
    for case in range(200):
        data = rewrite(original, lambda program, manifest: mutate_json(program, rng))
        with deadline(10):
            try:
                predispatch.load(io.BytesIO(data))
            except SerializationError:
                pass


class SwitchesLast(LeftOpen):
    """LeftOpen's switch with nothing computed after it."""

    def forward(self, x):
        y = self.lin(x)
        torch.set_grad_enabled(False)
        return y


def test_a_program_leaving_grad_mode_with_nothing_after_the_switch_is_not_saved():
    """A file leaves its caller's grad mode changed only with the region export writes for it
    (Note [A file that changes its caller's grad mode]): a forward whose switch is followed by
    no computation has none, so save refuses it by name (before, it saved, and a file that
    claimed the same of any program loaded)."""
    ep = predispatch.export(SwitchesLast(), (torch.randn(2, 3),))
    assert torch.is_grad_enabled() and ep.signature.grad_mode_on_exit is False
    with pytest.raises(SerializationError) as info:
        saved(ep)
    message = str(info.value)
    assert message.startswith("format version 2 cannot hold this program: signature grad_mode_on_exit: the program would "
                              "leave grad mode disabled for its caller"), message
    assert "a forward that switches grad mode and computes nothing after: undo the switch" in message


@pytest.mark.parametrize("name", sorted(WHILE_LOOPS))
def test_while_loop_programs_leave_the_callers_grad_mode(name):
    """torch 2.11's while_loop compiles its body with Dynamo, which restores grad mode after
    with a toggle nothing records: the trace took it for forward's own, and every while_loop
    program left grad mode enabled for its caller (to_torch() refused them, and a file would
    need the region export never wrote).  Only recorded toggles are the program's now."""
    ep, args, kwargs = export_case(f"while_loop_{name}")
    assert ep.signature.grad_mode_on_exit is None
    with torch.no_grad():
        predispatch.load(io.BytesIO(saved(ep))).module()(*args, **kwargs)
        assert not torch.is_grad_enabled()


def test_tables_name_every_hop_we_emit():
    names = set(serialize.HIGHER_ORDER_OPS)
    assert {"wrap_with_set_grad_enabled", "wrap_with_autocast", "autograd_function_apply"} <= names
    for name, hop in serialize.HIGHER_ORDER_OPS.items():
        assert hop().name() == name



# --------------------------------------------------------------------------- structural attacks


def _run_attacks_subprocess(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """tests/load_attacks.py in a fresh interpreter: a crash fails the test, not the test run."""
    env = subprocess_env(ROOT)
    return subprocess.run([sys.executable, os.path.join(TESTS, "load_attacks.py"), *argv], capture_output=True, text=True, timeout=timeout, env=env)


TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
ATTACK_CLASSES = (
    "io", "unsafe_constructor", "mutable", "global_state", "uninitialised", "output_type_lie",
    "hop_operand_lie", "duplicate_key", "compression_bomb", "registration", "names",
    "function_structure", "kernels", "classes", "sizes", "call_sites", "subclasses", "call_failures",
    "caller_state",
)


def test_structural_attacks_are_refused():
    """Every attack class of issue 13, hand-written cases and random variants (~100 files),
    in one subprocess: each is refused with SerializationError naming the node or member and
    why, and no load changes what is registered globally (pytree nodes, op namespaces)."""
    result = _run_attacks_subprocess()
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    started = [r for r in rows if r["outcome"] == "started"]
    done = [r for r in rows if r["outcome"] != "started"]
    assert result.returncode == 0 and len(started) == len(done), (
        f"the attack subprocess died (rc {result.returncode}) during {started[-1] if started else None}:\n{result.stderr[-3000:]}"
    )
    counts = {klass: sum(r["class"] == klass for r in done) for klass in ATTACK_CLASSES}
    assert all(counts.values()) and set(counts) == {r["class"] for r in done}, counts
    wrong = [r for r in done if r["outcome"] != "refused" or r["missing"] or r["registered"] or r["to_torch"] not in (None, "refused")]
    assert wrong == [], wrong
    through_torch = [r for r in done if r["to_torch"] == "refused"]  # the kernels checked at the call, through to_torch() too
    assert len(through_torch) >= 10, through_torch


def test_a_refused_compression_bomb_costs_no_memory(tmp_path):
    """The issue's file: manifest.json deflated with 256 MiB of whitespace.  It is refused
    before a byte is inflated; the loading process's peak RSS grows < 10 MB (measured in a
    fresh process, after a warm-up load)."""
    import load_attacks

    ep, _, _ = export_case("autograd_functions")
    good, bomb = tmp_path / "good.pdp", tmp_path / "bomb.pdp"
    good.write_bytes(saved(ep))
    compressed = load_attacks.write_bomb(str(bomb), good.read_bytes())
    assert compressed < 2 << 20  # 256 MiB inflated
    result = _run_attacks_subprocess("--measure", str(bomb), str(good))
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.splitlines()[-1])
    assert measured["outcome"] == "refused" and "member manifest.json is compressed" in measured["message"], measured
    assert measured["rss_peak_growth_bytes"] < 10 << 20 and measured["tracemalloc_peak_bytes"] < 10 << 20, measured


class RefusedAttacks(TestCase):
    """The messages of the attacks of issue 13, pinned (the subprocess test checks them all)."""

    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.data = saved(export_case("autograd_functions")[0])

    def refusal(self, edit) -> str:
        return load_error(rewrite(self.data, lambda program, manifest: edit(program)))

    def test_file_access(self):
        def from_file(program):
            node(program, "add_2").update(target="aten.from_file.default", args=["/etc/passwd", True, 4096])

        self.assertExpectedInline(self.refusal(from_file), """\
the program breaks the IR contract (docs/ir.md): graph module <root>, node add_2: calls aten.from_file.default, which a program may not call (io: reads or writes files, streams or the console; a program computes values only).
  see docs/errors.md#serializationerror""")

    def test_parameter_mutation(self):
        def zero(program):
            node(program, "add_2").update(target="aten.zero_.default", args=[{"node": "p_weight"}])

        self.assertIn("node add_2: calls aten.zero_.default, which a program may not call (mutable_only:", self.refusal(zero))

    def test_string_output(self):
        def lie(program):
            node(program, "output")["args"] = [{"tuple": ["pwned"]}]

        self.assertExpectedInline(self.refusal(lie), """\
the program breaks the IR contract (docs/ir.md): graph output 0 (USER_OUTPUT 'output'): is str 'pwned', not a node: the signature says it is computed.
  see docs/errors.md#serializationerror""")

    def test_tensor_as_subgraph(self):
        def lie(program):
            node(program, "wrap_with_set_grad_enabled")["args"][1] = {"node": "x"}

        self.assertExpectedInline(self.refusal(lie), """\
the program breaks the IR contract (docs/ir.md): graph module <root>, node wrap_with_set_grad_enabled: wrap_with_set_grad_enabled argument 1 must be a subgraph, not node x (placeholder).
  see docs/errors.md#serializationerror""")

    def test_meta_record(self):
        def meta(program):
            program["tensors"]["state"]["weight"]["device"] = "meta"

        self.assertExpectedInline(self.refusal(meta), """\
state.safetensors['weight']: a tensor on device meta; the file format holds tensors with data (cpu, cuda, ...).
  see docs/errors.md#serializationerror""")

    def test_duplicate_key(self):
        with zipfile.ZipFile(io.BytesIO(self.data)) as zf:
            members = {name: zf.read(name) for name in zf.namelist()}
        members["program.json"] = members["program.json"].replace(
            b'"target":"aten.add.Tensor"', b'"target":"aten.add.Tensor","target":"aten.from_file.default"', 1
        )
        import load_attacks

        self.assertExpectedInline(load_error(load_attacks.zip_of(load_attacks.checksummed(members))), """\
program.json is corrupted: it is not valid JSON (the key 'target' appears twice in one object).
  see docs/errors.md#serializationerror""")


@dataclasses.dataclass
class FreshOutput:
    """Returned by `ReturnsFresh`; the test unregisters it to play a process that never saw it."""

    value: torch.Tensor


pytree.register_dataclass(FreshOutput)


class ReturnsFresh(nn.Module):
    def forward(self, x):
        return FreshOutput(x * 2)


def test_dataclass_is_registered_only_once_the_file_is_verified():
    x = torch.randn(3)
    data = saved(predispatch.export(ReturnsFresh(), (x,)))
    pytree._deregister_pytree_node(FreshOutput)
    try:
        def io_op(program, manifest):
            node(program, "mul").update(target="aten.from_file.default", args=["/etc/passwd", True, 4096])

        assert "(io:" in load_error(rewrite(data, io_op), types=[FreshOutput])
        assert FreshOutput not in pytree.SUPPORTED_NODES  # a refused file registered nothing
        loaded = predispatch.load(io.BytesIO(data), types=[FreshOutput])
        assert FreshOutput in pytree.SUPPORTED_NODES  # a verified one registers it, as export does
        assert_same_tree(loaded.module()(x), FreshOutput(x * 2))
    finally:
        if FreshOutput not in pytree.SUPPORTED_NODES:
            pytree.register_dataclass(FreshOutput)


def test_a_registered_dataclass_loads_without_types():
    """A class the user's code registered as a pytree node (here: export did) is the user's choice."""
    x = torch.randn(3)
    loaded = predispatch.load(io.BytesIO(saved(predispatch.export(ReturnsFresh(), (x,)))))
    assert_same_tree(loaded.module()(x), FreshOutput(x * 2))


def test_a_file_naming_torchs_file_reading_dataclass_is_refused(tmp_path):
    """Issue 40: torch's `ProcessFailure` dataclass reads the JSON file at the path it is given
    (`__post_init__`).  A file naming it is refused at load and registers nothing; the user who
    allows it (types=) gets what the class builds (here: that file's contents)."""
    import load_attacks
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"message": "the user's file", "timestamp": 1}))
    data = load_attacks.edited(saved(export_case("autograd_functions")[0]), load_attacks.read_file_output(str(secret)))
    before = frozenset(pytree.SUPPORTED_NODES)
    message = load_error(data)
    assert frozenset(pytree.SUPPORTED_NODES) == before and ProcessFailure not in pytree.SUPPORTED_NODES
    assert message.startswith(f"signature out_spec: the file names the class {load_attacks.PROCESS_FAILURE};"), message
    assert "fix: if you trust torch.distributed.elastic.multiprocessing.errors.ProcessFailure, allow it: predispatch.load(path, types=[torch." in message
    try:
        out = predispatch.load(io.BytesIO(data), types=[ProcessFailure]).module()(torch.randn(4, 3))
        assert isinstance(out, ProcessFailure) and out.message == "the user's file"
    finally:
        if ProcessFailure in pytree.SUPPORTED_NODES:
            pytree._deregister_pytree_node(ProcessFailure)


class Pair(typing.NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


Plain = collections.namedtuple("Plain", "first second")


class Noisy(Plain):
    """A namedtuple subclass with its own constructor: building it runs its code."""

    built = 0

    def __new__(cls, *values):
        Noisy.built += 1
        return super().__new__(cls, *values)


class WithInit(collections.namedtuple("WithInit", "first second")):
    def __init__(self, *values):
        super().__init__()


class Meta(type):
    def __call__(cls, *args):
        return super().__call__(*args)


class ReturnsTuples(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind

    def forward(self, x):
        return self.kind(x + 1, x * 2)


def test_namedtuples_whose_constructor_runs_nothing_else_load_without_types():
    x = torch.randn(3)
    for kind in (Pair, Plain):
        loaded = predispatch.load(io.BytesIO(saved(predispatch.export(ReturnsTuples(kind), (x,)))))
        out = loaded.module()(x)
        assert type(out) is kind and torch.equal(out.second, x * 2)


def test_a_namedtuple_with_its_own_constructor_needs_types():
    from predispatch.serialize.classes import is_plain_namedtuple

    x = torch.randn(3)
    data = saved(predispatch.export(ReturnsTuples(Noisy), (x,)))
    built = Noisy.built
    message = load_error(data)
    assert Noisy.built == built, "load built the class"
    assert "signature out_spec context: the file names the class test_serialize:Noisy;" in message
    assert "this one's is not" in message and "types=[test_serialize.Noisy]" in message
    out = predispatch.load(io.BytesIO(data), types=[Noisy]).module()(x)
    assert type(out) is Noisy and Noisy.built == built + 1
    assert [is_plain_namedtuple(c) for c in (Pair, Plain, Noisy, WithInit, Meta("M", (tuple,), dict(vars(Plain))))] == [True, True, False, False, False]


def test_types_must_be_classes_load_can_build():
    data = saved(export_case("autograd_functions")[0])
    assert "types=: 'Out' is not a class." in load_error(data, types=["Out"])
    assert "types=: test_serialize:ReturnsFresh is neither a dataclass, a namedtuple class, an enum, a tensor subclass nor a registered pytree node type" in load_error(
        data, types=[ReturnsFresh])


def test_files_of_the_first_version_1_writers_still_load():
    """Their manifest has no `sizes` (optional in version 1): the zip's own sizes still bound reading."""
    import load_attacks

    ep, args, kwargs = export_case("buffer_mutation")
    members = load_attacks.members_of(saved(ep))
    manifest = {k: v for k, v in json.loads(members["manifest.json"]).items() if k != "sizes"}
    members["manifest.json"] = json.dumps({**manifest, "version": 1}).encode()
    loaded = predispatch.load(io.BytesIO(load_attacks.zip_of(members)))
    assert_same_behaviour(ep, loaded, args, kwargs)
    members["manifest.json"] = json.dumps(manifest).encode()  # version 2 writers always write them
    assert "manifest.json is corrupted: format version 2 lists every member's size" in load_error(load_attacks.zip_of(members))


#: The fields format version 2 added (tensor subclasses): a plain program's file has none.
VERSION_2_FIELDS = ('"inner"', '"layout"', '"subclass_state"', '"subclasses"', '"enum"', '"dataclass"', '"namedtuple"')


@pytest.mark.parametrize("case", ["buffer_mutation", "autograd_functions", "kwargs"])
def test_plain_programs_save_as_version_2_files_version_1_readers_knew(case):
    """A plain program's file differs from version 1's only in the version number: a version 1
    file (the same bytes, the manifest saying 1) still loads and behaves the same."""
    import load_attacks

    ep, args, kwargs = export_case(case)
    members = load_attacks.members_of(saved(ep))
    assert json.loads(members["manifest.json"])["version"] == 2
    assert not any(field.encode() in members["program.json"] for field in VERSION_2_FIELDS)
    version_1 = load_attacks.zip_of(load_attacks.checksummed(members, {**json.loads(members["manifest.json"]), "version": 1}))
    assert_same_behaviour(ep, predispatch.load(io.BytesIO(version_1)), args, kwargs)


class _NonZero(torch.nn.Module):
    def forward(self, x):
        return x.nonzero()


def test_unbacked_size_is_refused_on_save(tmp_path):
    """A size that depends on data has no value at export: refused by name, nothing written."""
    ep = predispatch.export(_NonZero(), (torch.tensor([1.0, 0.0, 2.0]),))
    path = tmp_path / "p.pd"
    with pytest.raises(SerializationError, match=r"depends on data \(an unbacked size"):
        predispatch.save(ep, path)
    assert not path.exists()


# --------------------------------------------------------------------------- while_loop


def _trains_like_eager(module, eager, args) -> None:
    """`module` gives `eager`'s outputs, input and parameter gradients, bitwise (float inputs
    require grad; the trip count does not)."""
    def fresh():
        return tuple(a.detach().clone().requires_grad_(a.is_floating_point()) for a in args)

    (m_args, e_args) = fresh(), fresh()
    actual, expected = module(*m_args), eager(*e_args)
    assert_same_tree(actual, expected)
    for outs in (actual, expected):
        torch.autograd.backward([t.float().sum() for t in pytree.tree_leaves(outs) if t.requires_grad])
    assert_same_tree([a.grad for a in m_args], [a.grad for a in e_args])
    assert_same_tree(dict(module.named_parameters()).keys(), dict(eager.named_parameters()).keys())
    for (name, param), (_, mine) in zip(eager.named_parameters(), module.named_parameters()):
        assert param.grad is not None, name
        assert_same_tree(mine.grad, param.grad)


@pytest.mark.parametrize("name", sorted(WHILE_LOOPS))
def test_loaded_while_loop_trains_like_eager(name, tmp_path):
    """A saved and loaded while_loop program gives eager's outputs and gradients bitwise, the
    parameters inside the body included, and for a data-dependent trip count at counts other
    than the one exported (none, one, more)."""
    torch.manual_seed(0)
    model, args, _ = WHILE_LOOPS[name]()
    path = tmp_path / "loop.pd"
    predispatch.save(predispatch.export(model, args), path)
    module = predispatch.load(path).module()
    _trains_like_eager(module, model, args)
    if name == "data_trip_count":
        for n in (0, 1, 7):
            _trains_like_eager(module, model, (args[0], torch.tensor(n)))


_WHILE_LOOP_IN_A_FRESH_PROCESS = """
import sys, torch
import predispatch
module = predispatch.load(sys.argv[1]).module()
results = []
for n in (4, 0, 7):
    x = torch.load(sys.argv[2]).clone().requires_grad_()
    out = module(x, torch.tensor(n))
    out.sum().backward()
    results.append((out.detach(), x.grad, module.weight.grad.clone()))
    module.weight.grad = None
torch.save(results, sys.argv[3])
"""


def test_while_loop_loads_in_a_fresh_process(tmp_path):
    """A process that never exported loads a while_loop program and trains it like eager,
    bitwise, at several trip counts."""
    torch.manual_seed(0)
    model, (x, n), _ = WHILE_LOOPS["data_trip_count"]()
    predispatch.save(predispatch.export(model, (x, n)), tmp_path / "loop.pd")
    torch.save(x, tmp_path / "x.pt")
    env = subprocess_env(ROOT)
    result = subprocess.run(
        [sys.executable, "-c", _WHILE_LOOP_IN_A_FRESH_PROCESS, str(tmp_path / "loop.pd"), str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for (out, x_grad, w_grad), count in zip(torch.load(tmp_path / "out.pt"), (4, 0, 7)):
        eager, x_eager = copy.deepcopy(model), x.clone().requires_grad_()
        expected = eager(x_eager, torch.tensor(count))
        expected.sum().backward()
        assert_same_tree((out, x_grad, w_grad), (expected.detach(), x_eager.grad, eager.weight.grad))


class ReadsLoopOffset(nn.Module):
    """Reads the storage offset of a while_loop's output: (trips - 1) * numel under autograd,
    0 without grad (eager's own answer depends on grad mode)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        _, y = while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * self.weight), (torch.tensor(0), x))
        return y + y.storage_offset()


def test_a_program_that_reads_a_loop_output_offset_gets_eager_answer(tmp_path):
    """The tensor meta offset `save` writes as 0 is one no op reads (Note [Data-dependent
    storage offsets]): a program that asks for it calls `sym_storage_offset`, which reads the
    running tensor's, so the loaded program answers as eager does, with grad (the last row of
    the stacked carries: 2 * 32) and without (0).  (Before the trace left grad mode alone
    around torch 2.11's while_loop, each call of the program on 2.11 enabled grad mode for its
    caller, so eager's answer there depended on the order of calls.)"""
    torch.manual_seed(0)
    model, x = ReadsLoopOffset(), torch.randn(4, 8)
    ep = predispatch.export(model, (x,))
    predispatch.save(ep, tmp_path / "p.pd")
    loaded = predispatch.load(tmp_path / "p.pd")
    assert str(loaded) == str(ep)
    assert '"Sym(32*u0 - 32)" = torch.ops.aten.sym_storage_offset.default(getitem_1)' in str(loaded)
    for grad, offset in ((True, 64.0), (False, 0.0)):
        with torch.set_grad_enabled(grad):
            actual, expected = loaded.module()(x), model(x)
        assert_same_tree(actual, expected)
        assert (actual - x)[0, 0].item() == offset


class WhileLoopFiles(TestCase):
    maxDiff = None

    def setUp(self):
        torch.manual_seed(0)
        model, args, _ = WHILE_LOOPS["parameter"]()
        self.ep = predispatch.export(model, args)
        self.data = saved(self.ep)

    def test_loaded_graph(self):
        """The loaded program's graph: torch's while_loop with its two subgraphs, the
        parameters as additional inputs, and its outputs' storage offsets saved as 0 (Note
        [Data-dependent storage offsets]); the shape record keeps torch's runtime guards."""
        from helpers import graph, on_golden_torch

        loaded = predispatch.load(io.BytesIO(self.data))
        getitem = next(n for n in loaded.graph.nodes if n.name == "getitem_1")
        original = next(n for n in self.ep.graph.nodes if n.name == "getitem_1")
        assert str(original.meta["val"].storage_offset()) == "32*u0 - 32"
        assert getitem.meta["val"].storage_offset() == 0
        assert (getitem.meta["val"].shape, getitem.meta["val"].stride()) == (original.meta["val"].shape, original.meta["val"].stride())
        assert str(loaded.signature.shapes) == str(self.ep.signature.shapes)
        if on_golden_torch():
            self.assertExpectedInline(graph(loaded), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_fc_weight: "f32[8, 8]", p_fc_bias: "f32[8]", x: "f32[4, 8]"):
        _tensor_constant0: "i64[]" = self._tensor_constant0
        lift_fresh_copy: "i64[]" = torch.ops.aten.lift_fresh_copy.default(_tensor_constant0);  _tensor_constant0 = None
        detach: "i64[]" = torch.ops.aten.detach.default(lift_fresh_copy);  lift_fresh_copy = None
        while_loop_cond_graph_0 = self.while_loop_cond_graph_0
        while_loop_body_graph_0 = self.while_loop_body_graph_0
        while_loop = torch.ops.higher_order.while_loop(while_loop_cond_graph_0, while_loop_body_graph_0, (detach, x), (p_fc_bias, p_fc_weight));  while_loop_cond_graph_0 = while_loop_body_graph_0 = detach = x = p_fc_bias = p_fc_weight = None
        getitem_1: "f32[4, 8]" = while_loop[1];  while_loop = None
        return (getitem_1,)

    class while_loop_cond_graph_0(torch.nn.Module):
        def forward(self, arg0_1: "i64[]", arg1_1: "f32[4, 8]", arg2_1: "f32[8]", arg3_1: "f32[8, 8]"):
            lt: "b8[]" = torch.ops.aten.lt.Scalar(arg0_1, 3);  arg0_1 = None
            return lt

    class while_loop_body_graph_0(torch.nn.Module):
        def forward(self, arg0_1: "i64[]", arg1_1: "f32[4, 8]", arg2_1: "f32[8]", arg3_1: "f32[8, 8]"):
            add: "i64[]" = torch.ops.aten.add.Tensor(arg0_1, 1);  arg0_1 = None
            linear: "f32[4, 8]" = torch.ops.aten.linear.default(arg1_1, arg3_1, arg2_1);  arg1_1 = arg3_1 = arg2_1 = None
            tanh: "f32[4, 8]" = torch.ops.aten.tanh.default(linear);  linear = None
            return (add, tanh)""")

    def test_malformed_unbacked_symbols_are_refused(self):
        """A file that gives a loop output an unbacked offset or size, which format version 1
        does not declare, is refused with SerializationError naming the node."""

        def meta_of(field, value):
            def edit(program, manifest):
                node(program, "getitem_1")["meta"]["val"]["tensor"][field] = value

            return rewrite(self.data, edit)

        self.assertExpectedInline(load_error(meta_of("storage_offset", {"sym": "32*u0 - 32", "hint": None})), """\
graph module <root>, nodes[9] (getitem_1) meta['val']: {'sym': '32*u0 - 32', 'hint': None} is a size without a value at export (an unbacked symbol); the file format holds symbolic sizes of inputs only.
  see docs/errors.md#serializationerror""")
        self.assertExpectedInline(load_error(meta_of("storage_offset", {"sym": "32*u0 - 32", "hint": 0})), """\
graph module <root>, nodes[9] (getitem_1) meta['val']: '32*u0 - 32' is not a size expression over the program's symbols.
  see docs/errors.md#serializationerror""")
        self.assertExpectedInline(load_error(meta_of("shape", [{"sym": "u0", "hint": 4}, 8])), """\
graph module <root>, nodes[9] (getitem_1) meta['val']: 'u0' is not a size expression over the program's symbols.
  see docs/errors.md#serializationerror""")


class IntCountedLoop(nn.Module):
    """A while_loop carrying a Python int: torch makes the carry an unbacked symbol in the
    subgraphs (`u0`, `u0 + 1`, `u0 < 3`) and the loop's result another (`u1`).  torch's
    while_loop takes no int carry under autograd, so this one runs without grad."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.randn(8))

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        i, y = while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * self.scale + i), (0, x))
        return y * i, i


class IntCarryFiles(TestCase):
    """Unbacked symbols in a file: declared (`unbacked_symbols`), read by the grammar, verified."""

    maxDiff = None

    def setUp(self):
        torch.manual_seed(0)
        self.model, self.x = IntCountedLoop(), torch.randn(4, 8)
        self.ep = predispatch.export(self.model, (self.x,))
        self.data = saved(self.ep)

    def test_round_trip(self):
        """Prints the same, saves to the same bytes, gives eager's outputs bitwise (the int
        result included), through `module()` and `to_torch().module()`.  (torch.export.save
        cannot write an int carry, from torch.export or from to_torch(): "Unsupported
        list/tuple argument type: [int, Node]".)"""
        from helpers import graph, on_golden_torch

        program = json.loads(zipfile.ZipFile(io.BytesIO(self.data)).read("program.json"))
        assert program["unbacked_symbols"] == [["u0", None, None], ["u1", None, None]]
        loaded = predispatch.load(io.BytesIO(self.data))
        assert str(loaded) == str(self.ep)
        assert saved(loaded) == self.data
        expected = self.model(self.x)
        assert_same_tree(loaded.module()(self.x), expected)
        assert_same_tree(loaded.to_torch().module()(self.x), expected)
        if on_golden_torch():
            self.assertExpectedInline(graph(loaded), """\
class GraphModule(torch.nn.Module):
    def forward(self, b_scale: "f32[8]", x: "f32[4, 8]"):
        while_loop_cond_graph_0 = self.while_loop_cond_graph_0
        while_loop_body_graph_0 = self.while_loop_body_graph_0
        while_loop = torch.ops.higher_order.while_loop(while_loop_cond_graph_0, while_loop_body_graph_0, (0, x), (b_scale,));  while_loop_cond_graph_0 = while_loop_body_graph_0 = x = b_scale = None
        getitem: "Sym(u1)" = while_loop[0]
        getitem_1: "f32[4, 8]" = while_loop[1];  while_loop = None
        mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(getitem_1, getitem);  getitem_1 = None
        return (mul, getitem)

    class while_loop_cond_graph_0(torch.nn.Module):
        def forward(self, arg0_1: "Sym(u0)", arg1_1: "f32[4, 8]", arg2_1: "f32[8]"):
            lt: "Sym(u0 < 3)" = arg0_1 < 3;  arg0_1 = None
            return lt

    class while_loop_body_graph_0(torch.nn.Module):
        def forward(self, arg0_1: "Sym(u0)", arg1_1: "f32[4, 8]", arg2_1: "f32[8]"):
            add: "Sym(u0 + 1)" = arg0_1 + 1
            mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(arg1_1, arg2_1);  arg1_1 = arg2_1 = None
            add_1: "f32[4, 8]" = torch.ops.aten.add.Tensor(mul, arg0_1);  mul = arg0_1 = None
            return (add, add_1)""")

    def refusal(self, edit) -> str:
        return load_error(rewrite(self.data, edit))

    def test_malformed_declarations_are_refused(self):
        """Each declaration is a new `u<index>` with a range; anything else is refused."""
        messages = []
        for entry in (["s0", None, None], ["u01", None, None], ["u0 + 1", None, None], ["u0", 5, 2], ["u0", "0", None],
                      ["u0"], "u0"):
            def declare(program, manifest, entry=entry):
                program["unbacked_symbols"][0] = entry

            messages.append(self.refusal(declare))

        def twice(program, manifest):
            program["unbacked_symbols"][1] = ["u0", None, None]

        messages.append(self.refusal(twice))
        self.assertExpectedInline("\n".join(messages), """\
unbacked_symbols: ['s0', None, None] is not the declaration of an unbacked symbol (a new name u<index>, a range [low, high], null where unbounded).
  see docs/errors.md#serializationerror
unbacked_symbols: ['u01', None, None] is not the declaration of an unbacked symbol (a new name u<index>, a range [low, high], null where unbounded).
  see docs/errors.md#serializationerror
unbacked_symbols: ['u0 + 1', None, None] is not the declaration of an unbacked symbol (a new name u<index>, a range [low, high], null where unbounded).
  see docs/errors.md#serializationerror
unbacked_symbols: ['u0', 5, 2] is not the declaration of an unbacked symbol (a new name u<index>, a range [low, high], null where unbounded).
  see docs/errors.md#serializationerror
unbacked_symbols: ['u0', '0', None] is not the declaration of an unbacked symbol (a new name u<index>, a range [low, high], null where unbounded).
  see docs/errors.md#serializationerror
unbacked_symbols: ['u0'] is not the declaration of an unbacked symbol (a new name u<index>, a range [low, high], null where unbounded).
  see docs/errors.md#serializationerror
unbacked_symbols: 'u0' is not the declaration of an unbacked symbol (a new name u<index>, a range [low, high], null where unbounded).
  see docs/errors.md#serializationerror
unbacked_symbols: ['u0', None, None] is not the declaration of an unbacked symbol (a new name u<index>, a range [low, high], null where unbounded).
  see docs/errors.md#serializationerror""")

    def test_undeclared_or_malformed_symbolic_values_are_refused(self):
        """A value over an undeclared symbol, one with no value and no unbacked symbol, a bool
        that is no comparison, code: refused, naming the node."""

        def value(name, data, path="while_loop_cond_graph_0"):
            def edit(program, manifest):
                node_ = next(n for n in load_attacks_module_of(program, path)["nodes"] if n["name"] == name)
                node_["meta"]["val"] = data
            return edit

        def undeclared(program, manifest):
            program["unbacked_symbols"] = program["unbacked_symbols"][1:]

        messages = [self.refusal(undeclared)]
        for name, data in (("lt", {"symbool": {"sym": "u0 + 1", "hint": None}}),
                           ("lt", {"symbool": {"sym": "__import__('os').system('true') < 3", "hint": None}}),
                           ("lt", {"symbool": {"sym": "u0 < 3", "hint": True}}),
                           ("arg0_1", {"symint": {"sym": "3", "hint": None}}),
                           ("arg0_1", {"symint": {"sym": "u7", "hint": None}})):
            messages.append(self.refusal(value(name, data)))
        self.assertExpectedInline("\n".join(messages), """\
graph module while_loop_cond_graph_0, nodes[0] (arg0_1) meta['val']: 'u0' is not a size expression over the program's symbols.
  see docs/errors.md#serializationerror
graph module while_loop_cond_graph_0, nodes[3] (lt) meta['val']: 'u0 + 1' is not a comparison of size expressions.
  see docs/errors.md#serializationerror
graph module while_loop_cond_graph_0, nodes[3] (lt) meta['val']: "__import__('os').system('true') < 3" is not a size expression over the program's symbols.
  see docs/errors.md#serializationerror
graph module while_loop_cond_graph_0, nodes[3] (lt) meta['val']: {'sym': 'u0 < 3', 'hint': True} is not a symbolic bool of unbacked symbols.
  see docs/errors.md#serializationerror
graph module while_loop_cond_graph_0, nodes[0] (arg0_1) meta['val']: {'sym': '3', 'hint': None} has no value at export but no unbacked symbol.
  see docs/errors.md#serializationerror
graph module while_loop_cond_graph_0, nodes[0] (arg0_1) meta['val']: 'u7' is not a size expression over the program's symbols.
  see docs/errors.md#serializationerror""")


def load_attacks_module_of(program: dict, path: str) -> dict:
    import load_attacks

    return load_attacks.module_of(program, path)


class ItemScale(torch.nn.Module):
    def forward(self, x):
        n = x.long().sum().item()  # an unbacked symbol, used as a value only
        return x * n, n


def test_unbacked_value_round_trips(tmp_path):
    """A value that depends on data (`.item()`, `Sym(u0)`) but no size: saved with its symbol
    declared; the loaded program prints the same and computes eager's results on new data."""
    ep = predispatch.export(ItemScale(), (torch.tensor([1.5, 2.5, 3.0]),))
    predispatch.save(ep, tmp_path / "p.pd")
    loaded = predispatch.load(tmp_path / "p.pd")
    assert str(loaded) == str(ep) and '_local_scalar_dense: "Sym(u0)"' in str(loaded)
    x = torch.tensor([4.0, 5.0, 1.0])
    assert_same_tree(loaded.module()(x), ItemScale()(x))


def test_placements_round_trip_and_lying_ones_are_refused(tmp_path):
    """A per-rank DTensor program's placements (tests/test_distributed.py exports them on 2
    ranks) are kept by save/load field by field; a file whose placement names no state, gives
    another local shape than the stored tensor's, or lacks a field is refused."""
    import dataclasses

    from predispatch.signature import StatePlacement

    ep = predispatch.export(nn.Linear(4, 2), (torch.randn(3, 4),))
    placement = StatePlacement("weight", ("Shard(dim=0)",), (2,), ("tp",), (0, 1), "cpu", (4, 4), (2, 4))
    ep = dataclasses.replace(ep, signature=dataclasses.replace(ep.signature, placements=(placement,)))
    path = tmp_path / "p.pd"
    predispatch.save(ep, path)
    loaded = predispatch.load(path)
    assert loaded.signature.placements == (placement,)
    assert "weight: (Shard(dim=0)) on cpu mesh (2,) ('tp',) ranks [0, 1], global [4, 4], local [2, 4]" in str(loaded.signature)

    def edit(field, value):
        def apply(program, manifest):
            program["signature"]["placements"][0][field] = value
        return apply

    assert "signature placement 'nope': names no lifted state" in load_error(rewrite(path.read_bytes(), edit("target", "nope")))
    assert "local shape [4, 4] differs from the stored tensor's [2, 4]" in load_error(rewrite(path.read_bytes(), edit("local_shape", [4, 4])))
    assert "expected int" in load_error(rewrite(path.read_bytes(), edit("mesh_ranks", ["0"])))

    def drop(program, manifest):
        del program["signature"]["placements"][0]["mesh_ranks"]

    assert "expected the fields" in load_error(rewrite(path.read_bytes(), drop))


def test_state_order_round_trips_and_a_lying_one_is_refused(tmp_path):
    """A submodule registered under two paths: `module().state_dict()` lists the exported
    module's keys in its order, after save/load too; a file whose `state_order` names
    something that is no lifted state is refused."""
    from test_dedup import SharedPositionStack

    model = SharedPositionStack()
    ep = predispatch.export(model, (torch.randn(2, 3, 8),))
    path = tmp_path / "p.pd"
    predispatch.save(ep, path)
    assert list(predispatch.load(path).module().state_dict()) == list(model.state_dict())

    def lie(program, manifest):
        program["signature"]["state_order"].append("not.a.state")

    assert "'not.a.state', which is no lifted state" in load_error(rewrite(path.read_bytes(), lie))


# --- a file from a GPU machine on one without ----------------------------------------------------

#: Saved on an H100 machine (torch 2.11, cuda:0) by the device probe: an nn.Sequential(Linear,
#: GELU) whose state is on CUDA, and a stateless forward that creates `torch.ones(8, device="cuda")`
#: (only its graph names the device).
CUDA_FILES = ("linear_gelu_cuda.pd", "device_const_cuda.pd")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the device the files name")
@pytest.mark.parametrize("name", CUDA_FILES)
def test_a_cuda_program_on_a_machine_without_cuda_is_refused_by_name(name):
    """Not "corrupted" (safetensors' own complaint), and not loaded to fail at the first call
    inside a kernel: our error names the device and what to do."""
    path = os.path.join(TESTS, "files", name)
    with open(path, "rb") as f:
        data = f.read()
    with pytest.raises(predispatch.errors.DeviceUnavailableError) as info:
        predispatch.load(path)
    assert "cuda:0" in info.value.what and "corrupted" not in str(info.value)
    assert "export the model on the device" in info.value.fix
    assert os.path.basename(__file__) in (info.value.where or "")
    with open(path, "rb") as f:
        assert f.read() == data


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", CUDA_FILES)
def test_a_cuda_program_loads_where_cuda_is(name):
    module = predispatch.load(os.path.join(TESTS, "files", name)).module()
    x = torch.randn(4, 8, device="cuda")
    assert module(x).device.type == "cuda"
