"""Structural attacks on `predispatch.load`: crafted, correctly checksummed files, one class each.

Each attack is a file and what the refusal must say (the node or member, and why).  The
cases run in a subprocess (`python tests/load_attacks.py`), because a file that got past the
verifier could crash the process when its program runs: a segfault then fails the test that
started the subprocess instead of killing the test run.  The subprocess prints one JSON line
per case, `{"case", "class", "outcome", "message"}`, flushed before the next case starts.

Classes (the issue's list): io, unsafe_constructor, mutable, global_state, uninitialised,
output_type_lie, hop_operand_lie, duplicate_key, compression_bomb, registration; and since:
names, function_structure, kernels (issue 21); classes (issue 40: classes the user did not
allow); sizes (issue 40: size expressions beyond the grammar's bounds); call_sites (issue 40:
subgraphs called from many places, nested shared bodies); subclasses (issue 32: tensor subclass
layouts, parts and flatten contexts that lie); call_failures (issue 40: files that loaded and
then failed at every call with a raw error); caller_state (issue 40: records that change the
caller's state).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import hashlib
import io
import json
import os
import random
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

import predispatch  # noqa: E402
from predispatch.errors import SerializationError  # noqa: E402

#: Random variants per op-family attack class (on top of the hand-written cases).
VARIANTS = 12


@dataclass(frozen=True)
class Attack:
    """A crafted file and the text its refusal must contain."""

    klass: str
    name: str
    data: bytes
    expect: tuple[str, ...]
    run_after: bool = True  # if it loads anyway, run the program (a crash must show)
    args: tuple = ()  # what to run it on (default: one 4x3 tensor)
    types: tuple = ()  # the classes the loading user allows: load(..., types=types)
    never_opened: str | None = None  # a file neither the load nor the run may open


@dataclass
class Unregistered:
    """A dataclass no one registered as a pytree node: a file naming it must not register it
    unless the user allows it and the whole file is good."""

    a: torch.Tensor


class NotPlain(collections.namedtuple("NotPlain", "a")):
    """A namedtuple class whose constructor runs code of its own: a file naming it must not
    make load build it."""

    def __new__(cls, *values):
        with open(MARKER, "w"):
            pass
        return super().__new__(cls, *values)


class PlainMode(enum.Enum):
    """A plain enum: a file may name its members, not members it does not have."""

    ONE = 1


class CodedMode(enum.Enum):
    """An enum with code of its own: a file may name its members only when the user allows it."""

    ONE = 1

    def __eq__(self, other):
        with open(MARKER, "w"):
            pass
        return self is other

    __hash__ = enum.Enum.__hash__


# --------------------------------------------------------------------------- crafting


def members_of(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def zip_of(members: dict[str, bytes], methods: dict[str, int] | None = None) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as zf:
        for name, member in members.items():
            zf.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), member, compress_type=(methods or {}).get(name, zipfile.ZIP_STORED))
    return out.getvalue()


def checksummed(members: dict[str, bytes], manifest: dict | None = None) -> dict[str, bytes]:
    manifest = manifest or json.loads(members["manifest.json"])
    manifest["members"] = {n: hashlib.sha256(d).hexdigest() for n, d in members.items() if n != "manifest.json"}
    manifest["sizes"] = {n: len(d) for n, d in members.items() if n != "manifest.json"}
    return {**members, "manifest.json": json.dumps(manifest).encode()}


def edited(data: bytes, edit: Callable[[dict], None], *, raw: Callable[[bytes], bytes] | None = None) -> bytes:
    """`data` with program.json edited (and/or its bytes rewritten), every checksum recomputed."""
    members = members_of(data)
    program = json.loads(members["program.json"])
    edit(program)
    text = json.dumps(program).encode()
    members["program.json"] = raw(text) if raw else text
    return zip_of(checksummed(members))


def module_of(program: dict, path: str = "") -> dict:
    module = program["graph_module"]
    for part in filter(None, path.split(".")):
        module = next(s["module"] for s in module["submodules"] if s["name"] == part)
    return module


def node(program: dict, name: str, path: str = "") -> dict:
    return next(n for n in module_of(program, path)["nodes"] if n["name"] == name)


def call(program: dict, name: str, target: str, args: list, path: str = "", kwargs: dict | None = None) -> None:
    """Make node `name` call `target` with `args` (its meta kept: a value it claims to have)."""
    record = node(program, name, path)
    record.update(target=target, args=args)
    record.pop("kwargs", None)
    if kwargs:
        record["kwargs"] = kwargs


def _op(op_name: str) -> torch._ops.OpOverload:
    namespace, packet, overload = op_name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def _dispatcher_name(op_name: str) -> str:
    namespace, packet, overload = op_name.split(".")
    return f"{namespace}::{packet}" + (f".{overload}" if overload != "default" else "")


def _binding(op_name: str, value: dict) -> tuple[list, dict]:
    """Arguments that bind `op_name`'s schema: `value` for every required argument."""
    arguments = _op(op_name)._schema.arguments
    required = [a for a in arguments if not a.has_default_value()]
    return [value for a in required if not a.kwarg_only], {a.name: value for a in required if a.kwarg_only}


def _overloads(packet: str) -> list[str]:
    namespace, name = packet.split(".")
    try:
        return [f"{packet}.{o}" for o in getattr(getattr(torch.ops, namespace), name).overloads()]
    except (AttributeError, RuntimeError):
        return []


# --------------------------------------------------------------------------- base programs


def base_programs() -> dict[str, bytes]:
    from test_serialize import export_case, saved

    bases = {name: saved(export_case(name)[0]) for name in ("autograd_functions", "buffer_mutation", "graph_tensors", "kwargs")}
    regions = saved(export_case("region_detached_double")[0])
    return {**bases, "regions": regions, "kernels": kernel_program(), "shape_kernels": shape_kernel_program(),
            "sizes": chain_program(1), "subclasses": subclass_program(), **control_flow_programs()}


# --------------------------------------------------------------------------- attack classes


def _op_attacks(klass: str, family_ops: list[str], why: str, data: bytes, rng: random.Random) -> Iterator[Attack]:
    """Random ops of one refused family, called from a random place: the root graph or a subgraph."""
    places = [("add_2", ""), ("add", "grad_region_0"), ("matmul", "setup_context_linear_fwd_0")]
    for op in rng.sample(family_ops, min(VARIANTS, len(family_ops))):
        name, path = rng.choice(places)
        args, kwargs = _binding(op, {"node": "x" if not path else node_arg(path)})
        yield Attack(klass, f"{op} in {path or '<root>'}", edited(data, lambda p, op=op, name=name, path=path, a=args, k=kwargs: call(p, name, op, a, path, k)),
                     (f"graph module {path or '<root>'}, node {name}", f"calls {op},", why))


def node_arg(path: str) -> str:
    return {"grad_region_0": "round_1", "setup_context_linear_fwd_0": "x"}[path]


def _family_ops(*families: str) -> list[str]:
    from predispatch.serialize.op_families import PACKETS

    return sorted(o for f in families for p in PACKETS[f] for o in _overloads(p))


def io_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data = bases["autograd_functions"]
    yield Attack("io", "from_file then fill_ (the issue's file)", edited(data, lambda p: call(
        p, "add_2", "aten.from_file.default", ["/etc/passwd", True, 4096])), ("node add_2", "aten.from_file.default", "(io: reads or writes files"))
    yield Attack("io", "save", edited(data, lambda p: call(p, "add_2", "aten.save.default", [{"node": "x"}, "/tmp/pwned"])), ("node add_2", "(io:",))
    yield Attack("io", "_print in a region", edited(data, lambda p: call(p, "add", "aten._print.default", ["hi"], "grad_region_0")),
                 ("graph module grad_region_0, node add", "(io:"))
    yield from _op_attacks("io", _family_ops("io"), "(io:", data, rng)


def unsafe_constructor_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data = bases["autograd_functions"]

    def sparse(p):
        # indices far outside the size: `_to_dense` would write out of bounds
        nodes = module_of(p)["nodes"]
        at = next(i for i, n in enumerate(nodes) if n["name"] == "add_2")
        nodes[at:at] = [
            {"op": "call_function", "name": "big", "target": "aten.mul.Scalar", "args": [{"node": "x"}, 1e9]},
            {"op": "call_function", "name": "idx", "target": "aten._to_copy.default", "args": [{"node": "big"}], "kwargs": {"dtype": {"dtype": "int64"}}},
            {"op": "call_function", "name": "sp", "target": "aten._sparse_coo_tensor_with_dims_and_tensors.default",
             "args": [2, 0, [4, 3], {"node": "idx"}, {"node": "x"}]},
        ]
        call(p, "add_2", "aten._to_dense.default", [{"node": "sp"}])

    yield Attack("unsafe_constructor", "sparse COO from unchecked indices, then _to_dense", edited(data, sparse),
                 ("node sp", "_sparse_coo_tensor_with_dims_and_tensors", "(unsafe_layout:"))
    yield Attack("unsafe_constructor", "_reshape_alias past the storage", edited(data, lambda p: call(
        p, "add_2", "aten._reshape_alias.default", [{"node": "x"}, [1 << 20], [1]])), ("node add_2", "_reshape_alias", "(unsafe_layout:"))
    yield Attack("unsafe_constructor", "_nested_view_from_buffer", edited(data, lambda p: call(
        p, "add_2", "aten._nested_view_from_buffer.default", [{"node": "x"}, {"node": "x"}, {"node": "x"}, {"node": "x"}])),
        ("node add_2", "(unsafe_layout:"))
    yield from _op_attacks("unsafe_constructor", _family_ops("unsafe_layout"), "(unsafe_layout:", data, rng)


def mutable_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data = bases["autograd_functions"]
    for op, args in (("aten.add_.Tensor", [{"node": "p_weight"}, {"node": "p_weight"}]), ("aten.copy_.default", [{"node": "p_weight"}, {"node": "x"}]),
                     ("aten.zero_.default", [{"node": "p_weight"}]), ("aten.add.out", [{"node": "x"}, {"node": "x"}])):
        kwargs = {"out": {"node": "p_weight"}} if op.endswith(".out") else None
        yield Attack("mutable", f"{op} on the parameter", edited(data, lambda p, op=op, args=args, kwargs=kwargs: call(p, "add_2", op, args, kwargs=kwargs)),
                     ("node add_2", f"calls {op}", "mutate"))
    registered = torch._C._dispatch_get_all_op_names()
    mutable_overloads = [o for o in _family_ops("aten_functional") if _op(o)._schema.is_mutable and _dispatcher_name(o) in registered]
    yield from _op_attacks("mutable", mutable_overloads, "(mutable_schema:", data, rng)
    yield from _op_attacks("mutable", _family_ops("mutable_only"), "(mutable_only:", data, rng)


def global_state_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data = bases["autograd_functions"]
    yield Attack("global_state", "manual_seed", edited(data, lambda p: call(p, "add_2", "aten.manual_seed.default", [0])), ("node add_2", "(global_state:"))
    yield Attack("global_state", "set_grad_enabled in a region", edited(data, lambda p: call(p, "add", "aten.set_grad_enabled.default", [False], "grad_region_0")),
                 ("graph module grad_region_0, node add", "(global_state:"))
    yield Attack("global_state", "a raw grad-mode toggle", edited(data, lambda p: call(p, "add_2", "torch._C._set_grad_enabled", [False])),
                 ("(add_2)", "torch._C._set_grad_enabled", "which a program may not call"))
    yield from _op_attacks("global_state", _family_ops("global_state"), "(global_state:", data, rng)


def uninitialised_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data, held = bases["autograd_functions"], bases["graph_tensors"]

    def record(p, group, name, **fields):
        p["tensors"][group][name].update(fields)

    yield Attack("uninitialised", "parameter record on the meta device", edited(data, lambda p: record(p, "state", "weight", device="meta")),
                 ("state.safetensors['weight']", "device meta"))
    yield Attack("uninitialised", "graph tensor on the meta device", edited(held, lambda p: record(p, "graph", "_tensor_constant1", device="meta")),
                 ("graph.safetensors['_tensor_constant1']", "device meta"))
    yield Attack("uninitialised", "node value on the meta device", edited(data, lambda p: node(p, "add_2")["meta"]["val"]["tensor"].update(device="meta")),
                 ("(add_2) meta['val']", "device meta"))
    yield Attack("uninitialised", "record with strides outside the data", edited(data, lambda p: record(p, "state", "weight", stride=[30, 1])),
                 ("state.safetensors['weight']", "does not match its record"))
    yield Attack("uninitialised", "record larger than its data", edited(data, lambda p: record(p, "state", "weight", shape=[3, 300], stride=[300, 1])),
                 ("state.safetensors['weight']", "does not match its record"))
    yield Attack("uninitialised", "node value with a negative size", edited(data, lambda p: node(p, "add_2")["meta"]["val"]["tensor"].update(shape=[-4, 3])),
                 ("(add_2) meta['val']", "is not a list of sizes"))


def output_type_lie_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data, mutation = bases["autograd_functions"], bases["buffer_mutation"]

    def output(p, value, path=""):
        node(p, "output", path)["args"] = [{"tuple": [value]}]

    yield Attack("output_type_lie", "a string where the signature says tensor", edited(data, lambda p: output(p, "pwned")),
                 ("graph output 0 (USER_OUTPUT 'output')", "is str 'pwned', not a node"))
    yield Attack("output_type_lie", "an int output", edited(data, lambda p: output(p, 7)), ("graph output 0", "not a node"))
    yield Attack("output_type_lie", "an output node whose value is a string", edited(data, lambda p: node(p, "add_2")["meta"].update(val="pwned")),
                 ("graph output 0", "its value is str 'pwned'"))
    yield Attack("output_type_lie", "an output that is another node than the signature's", edited(data, lambda p: output(p, {"node": "mul"})),
                 ("graph output 0", "returns node mul, the signature names add_2"))
    yield Attack("output_type_lie", "a buffer mutation of another dtype", edited(mutation, lambda p: node(p, "add")["meta"]["val"]["tensor"].update(dtype="float64")),
                 ("graph output 0 (BUFFER_MUTATION 'count')", "torch.float64"))
    yield Attack("output_type_lie", "a buffer mutation of another shape", edited(mutation, lambda p: node(p, "add_1")["meta"]["val"]["tensor"].update(shape=[4])),
                 ("graph output 1 (BUFFER_MUTATION 'total')", "shape [4]"))
    yield Attack("output_type_lie", "a mutation of a buffer the program does not have", edited(mutation, lambda p: p["signature"]["outputs"][0].update(target="nothing")),
                 ("graph output 0", "mutates 'nothing'"))
    yield Attack("output_type_lie", "a parameter placeholder of another dtype", edited(data, lambda p: node(p, "p_weight")["meta"]["val"]["tensor"].update(dtype="float16")),
                 ("signature input p_weight", "torch.float16"))


def hop_operand_lie_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data, held = bases["autograd_functions"], bases["graph_tensors"]

    def args(p, name, new):
        node(p, name)["args"] = new

    region = "wrap_with_set_grad_enabled"
    yield Attack("hop_operand_lie", "a tensor as the subgraph", edited(data, lambda p: args(p, region, [False, {"node": "x"}, {"node": "round_1"}])),
                 (f"node {region}", "argument 1 must be a subgraph, not node x (placeholder)"))
    def held_tensor(p):
        module_of(p)["nodes"].insert(1, {"op": "get_attr", "name": "held", "target": "_tensor_constant1"})
        args(p, region, [False, {"node": "held"}, {"node": "x"}])

    yield Attack("hop_operand_lie", "a held tensor as the subgraph", edited(held, held_tensor),
                 (f"node {region}", "argument 1 must be a subgraph"))
    yield Attack("hop_operand_lie", "a string as grad mode", edited(data, lambda p: node(p, region)["args"].__setitem__(0, "no")),
                 (f"node {region}", "argument 0 must be a bool"))
    yield Attack("hop_operand_lie", "one operand too many", edited(data, lambda p: node(p, region)["args"].append({"node": "x"})),
                 (f"node {region}", "passes 2 operands to subgraph 'grad_region_0', which takes 1"))
    yield Attack("hop_operand_lie", "no operands", edited(data, lambda p: args(p, region, [False, {"node": "grad_region_0"}])),
                 (f"node {region}", "passes 0 operands"))
    yield Attack("hop_operand_lie", "no arguments", edited(data, lambda p: args(p, region, [])), (f"node {region}", "takes 2 leading arguments"))
    yield Attack("hop_operand_lie", "a constant operand", edited(data, lambda p: node(p, region)["args"].__setitem__(2, 3.5)),
                 (f"node {region}", "operand 0 is float 3.5"))
    yield Attack("hop_operand_lie", "autograd_function_apply without its indices", edited(data, lambda p: node(p, "autograd_function_apply").pop("kwargs")),
                 ("node autograd_function_apply", "takes keyword arguments ['non_differentiable_idx', 'saved_for_backward_idx']"))
    yield Attack("hop_operand_lie", "a backward that is a tensor", edited(data, lambda p: node(p, "autograd_function_apply")["args"].__setitem__(1, {"node": "p_weight"})),
                 ("node autograd_function_apply", "argument 1 must be a subgraph"))


def function_structure_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """An `autograd_function_apply` whose graphs do not fit together (issue 21): each used to
    load and fail at backward with a raw error."""
    data = bases["autograd_functions"]
    fwd, bwd, apply = "setup_context_linear_fwd_0", "setup_context_linear_bwd_0", "autograd_function_apply_1"

    def placeholders(p, path):
        return [n for n in module_of(p, path)["nodes"] if n["op"] == "placeholder"]

    def drop_placeholder(p):
        nodes = module_of(p, bwd)["nodes"]
        nodes.remove(placeholders(p, bwd)[-1])
        _replace_refs(nodes, "saved_weight", "saved_x")

    yield Attack("function_structure", "a backward that takes one value too few", edited(data, drop_placeholder),
                 (f"node {apply}", "its backward 'setup_context_linear_bwd_0' takes 2 values; forward gives 1 gradients and 2 saved values"))
    yield Attack("function_structure", "a backward that returns one gradient too few",
                 edited(data, lambda p: node(p, "output", bwd).update(args=[{"tuple": [{"node": "matmul"}]}])),
                 (f"node {apply}", "must return one gradient or None per operand (2)"))
    yield Attack("function_structure", "a backward that returns a string",
                 edited(data, lambda p: node(p, "output", bwd).update(args=[{"tuple": ["g", {"node": "matmul"}]}])),
                 (f"node {apply}", "must return one gradient or None per operand"))
    yield Attack("function_structure", "saved indices past the saved values",
                 edited(data, lambda p: node(p, apply)["kwargs"].update(saved_for_backward_idx=[0, 7])),
                 (f"node {apply}", "keyword 'saved_for_backward_idx' is [0, 7]: distinct indices below 2 expected"))
    yield Attack("function_structure", "a non-differentiable index past the outputs",
                 edited(data, lambda p: node(p, apply)["kwargs"].update(non_differentiable_idx=[3])),
                 (f"node {apply}", "'non_differentiable_idx'", "below 1"))
    yield Attack("function_structure", "a forward that returns its outputs only",
                 edited(data, lambda p: node(p, "output", fwd).update(args=[{"tuple": [{"node": "matmul"}]}])),
                 (f"node {apply}", "must return ((*outputs), (*saved))"))
    yield Attack("function_structure", "a getitem past a multi-output value",
                 edited(data, lambda p: node(p, "round_1").update(args=[{"node": "autograd_function_apply"}, 5])),
                 ("node round_1", "calls getitem with arguments"))


def _inject_duplicate(text: bytes, needle: bytes, duplicate: bytes) -> bytes:
    assert needle in text, needle
    return text.replace(needle, needle + duplicate, 1)


def duplicate_key_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data = bases["autograd_functions"]
    # the second "target" would win in plain json.loads: the node would call from_file
    yield Attack("duplicate_key", "a node target given twice", edited(data, lambda p: None, raw=lambda t: _inject_duplicate(
        t, b'"target": "aten.add.Tensor"', b', "target": "aten.from_file.default"')), ("program.json", "the key 'target' appears twice"))
    yield Attack("duplicate_key", "a signature kind given twice", edited(data, lambda p: None, raw=lambda t: _inject_duplicate(
        t, b'"kind": "user_output"', b', "kind": "buffer_mutation"')), ("program.json", "the key 'kind' appears twice"))
    members = members_of(data)
    manifest = members["manifest.json"].replace(b'"version":2', b'"version":2,"version":3')
    yield Attack("duplicate_key", "a manifest version given twice", zip_of({**members, "manifest.json": manifest}), ("manifest.json", "the key 'version' appears twice"))
    yield Attack("duplicate_key", "an integer out of range", edited(data, lambda p: None, raw=lambda t: t.replace(b'"args": [2,', b'"args": [99999999999999999999999,', 1)
                                                                   if b'"args": [2,' in t else t.replace(b'"shape": [3, 3]', b'"shape": [3, 99999999999999999999999]', 1)),
                 ("program.json", "out of range"))
    yield Attack("duplicate_key", "a float out of range", edited(data, lambda p: None, raw=lambda t: t.replace(b'"shape": [3, 3]', b'"shape": [3, 1e999]', 1)),
                 ("program.json", "out of range"))


def bomb_members(data: bytes, member: str, size: int) -> dict:
    """The members, `member` padded with `size` bytes of whitespace (JSON) or zeros."""
    members = members_of(data)
    members[member] += (b" " if member.endswith(".json") else b"\0") * size
    return members


def compression_bomb_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    data = bases["autograd_functions"]
    for member in ("manifest.json", "program.json", "state.safetensors"):
        members = bomb_members(data, member, 16 << 20)
        yield Attack("compression_bomb", f"{member} deflated, 16 MiB", zip_of(checksummed(members) if member != "manifest.json" else members,
                                                                              {member: zipfile.ZIP_DEFLATED}),
                     (f"member {member} is compressed",))
    members = members_of(data)
    yield Attack("compression_bomb", "a manifest over the limit, stored", zip_of({**members, "manifest.json": members["manifest.json"] + b" " * (1 << 20)}),
                 ("member manifest.json says it holds", "the limit is 65536"))
    yield Attack("compression_bomb", "a member named twice", _with_duplicate(members, "program.json"), ("its members are",))
    lying = bytearray(zip_of(members))
    yield Attack("compression_bomb", "a central directory that lies about a size", bytes(_lie_about_size(lying, "state.safetensors", 1 << 40)),
                 ("member state.safetensors says it holds",))
    manifest = json.loads(members["manifest.json"])
    manifest["sizes"]["program.json"] -= 1
    yield Attack("compression_bomb", "a member larger than the manifest says", zip_of({**members, "manifest.json": json.dumps(manifest).encode()}),
                 ("members' sizes differ from the manifest's",))
    extra = {**members, "extra.bin": b"x"}
    yield Attack("compression_bomb", "an extra member", zip_of(extra), ("its members are",))


def _lie_about_size(data: bytearray, name: str, size: int) -> bytearray:
    """Set `name`'s uncompressed size in the central directory (capped below zip64's marker)."""
    import struct

    position = 0
    while True:
        position = data.find(b"PK\x01\x02", position)
        if position < 0:
            raise ValueError(name)
        name_length = struct.unpack_from("<H", data, position + 28)[0]
        if data[position + 46:position + 46 + name_length] == name.encode():
            struct.pack_into("<I", data, position + 24, min(size, 0xFFFFFFFE))
            return data
        position += 4


def _with_duplicate(members: dict[str, bytes], name: str) -> bytes:
    import warnings

    out = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(out, "w") as zf:
        warnings.simplefilter("ignore")  # zipfile warns of the duplicated name it writes
        for member, data in [*members.items(), (name, members[name])]:
            zf.writestr(zipfile.ZipInfo(member, (1980, 1, 1, 0, 0, 0)), data)
    return out.getvalue()


def registration_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """A dataclass the user allows (types=) in a file refused for another reason: not registered."""
    data = bases["autograd_functions"]
    spec = {"type": f"{__name__}:Unregistered", "context": [["a"], []], "children": [None]}

    def lie(p):
        p["signature"]["out_spec"] = spec
        call(p, "add_2", "aten.from_file.default", ["/etc/passwd", True, 4096])

    yield Attack("registration", "an unregistered dataclass in a file refused later", edited(data, lie), ("node add_2", "(io:"),
                 types=(Unregistered,))

    def bad_spec_only(p):
        p["signature"]["out_spec"] = {**spec, "children": [None, None]}

    yield Attack("registration", "an unregistered dataclass in an inconsistent signature", edited(data, bad_spec_only),
                 ("the output spec, output leaves and user outputs disagree",), types=(Unregistered,))


#: A file of the user's that a crafted program would read into its output (never opened: `run_attack`).
SECRET = os.path.join(os.environ.get("PD_ATTACK_DIR", "/tmp"), "predispatch_attack_secret.json")
#: torch's dataclass whose `__post_init__` reads the JSON file at the path it is given.
PROCESS_FAILURE = "torch.distributed.elastic.multiprocessing.errors:ProcessFailure"


def output_of(class_name: str, fields: dict) -> Callable[[dict], None]:
    """The program's one tensor output (`add_2`) made the first field of a `class_name`
    dataclass whose other fields are constants: `fields` (name -> value, None for the tensor)."""
    def edit(p):
        sig = p["signature"]
        sig["out_spec"] = {"type": class_name, "context": [list(fields), []], "children": [None] * len(fields)}
        sig["output_leaves"] = [{"path": f"output.{name}", "is_tensor": value is None, "value": value} for name, value in fields.items()]
    return edit


def read_file_output(path: str) -> Callable[[dict], None]:
    """The issue's file: the output a torch `ProcessFailure` whose `error_file` is `path`, so that
    building it (`ep.module()`'s result) reads that file into `.message` and `.error_file_data`."""
    return output_of(PROCESS_FAILURE, {"local_rank": None, "pid": 1, "exitcode": 1, "error_file": path})


def namedtuple_output(class_name: str) -> Callable[[dict], None]:
    """The program's one tensor output the field `a` of the namedtuple class `class_name`."""
    def edit(p):
        p["signature"]["out_spec"] = {"type": "collections:namedtuple", "context": {"class": class_name}, "children": [None]}
        p["signature"]["output_leaves"] = [{"path": "output.a", "is_tensor": True, "value": None}]
    return edit


def class_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """Files naming classes the user did not allow (issue 40): each refused naming the class and
    the types= that allows it, nothing built, read or registered."""
    import torch.distributed.elastic.multiprocessing.errors  # noqa: F401 - a process that has it imported

    with open(SECRET, "w") as f:
        json.dump({"message": "the contents of a file of the user's", "timestamp": 1}, f)
    data, fix = bases["autograd_functions"], "fix: if you trust"
    yield Attack("classes", "torch's ProcessFailure, whose __post_init__ reads the file it names (the issue's file)",
                 edited(data, read_file_output(SECRET)),
                 ("signature out_spec", f"the class {PROCESS_FAILURE};", "runs the class's code",
                  f"types=[{PROCESS_FAILURE.replace(':', '.')}]"), never_opened=SECRET)
    yield Attack("classes", "a dataclass the user did not allow", edited(data, output_of(f"{__name__}:Unregistered", {"a": None})),
                 ("signature out_spec", f"{__name__}:Unregistered", fix))
    yield Attack("classes", "a namedtuple class whose __new__ runs code", edited(data, namedtuple_output(f"{__name__}:NotPlain")),
                 ("signature out_spec context", f"{__name__}:NotPlain", "this one's is not", fix))
    yield Attack("classes", "a class that is no namedtuple as a namedtuple's", edited(data, namedtuple_output("subprocess:Popen")),
                 ("signature out_spec context", "subprocess:Popen", fix))
    yield Attack("classes", "a function as a node type", edited(data, output_of("os:system", {"a": None})), ("signature out_spec", "os:system", fix))
    yield Attack("classes", "a class of a module not imported", edited(data, output_of("never_imported_module:Out", {"a": None})),
                 ("never_imported_module:Out", "after `import never_imported_module`", "importing it runs its code"))
    yield Attack("classes", "a name that is no class name", edited(data, output_of("os:system; rm", {"a": None})),
                 ("signature out_spec", "is not a class name (module:qualname)"))

    def factory(p):
        p["signature"]["out_spec"] = {"type": "collections:defaultdict", "context": [{"class": "os:system"}, ["a"]], "children": [None]}

    yield Attack("classes", "a defaultdict whose factory is no builtin", edited(data, factory),
                 ("signature out_spec context", "is not a defaultdict factory a file may name"))


# --------------------------------------------------------------------------- names (issue 21)

#: The marker file an injected name would write: the tests check it never appears.
MARKER = os.path.join(os.environ.get("PD_ATTACK_DIR", "/tmp"), "predispatch_attack_ran_code")
#: Two keyword names that close and reopen a string literal in the code FX generates for
#: `ep.module()`: the first makes the rest of `def forward(...)` a default value that runs
#: when the code is compiled, the second ends the signature and comments out the rest.
INJECTED_KWARGS = (f'a=__import__("os").system("touch {MARKER}"), b="""', "):\n    pass\n#")


def inject_kwargs(data: bytes, names: list) -> bytes:
    """A program with keyword arguments whose names are `names`."""
    return edited(data, lambda p: p["signature"]["in_spec"]["children"][1].update(context=list(names)))


def renamed_state(data: bytes, old: str, new: str, *, outside: tuple[str, ...] = (), constant: bool = False) -> bytes:
    """`data` with state `old` renamed to `new` everywhere it is named (the signature, its
    tensor record, state.safetensors), optionally made a constant tensor or put outside the tree."""
    import safetensors.torch

    members = members_of(data)
    program = json.loads(members["program.json"])
    sig = program["signature"]
    for spec in (*sig["inputs"], *sig["outputs"]):
        if spec["target"] == old:
            spec["target"] = new
            if constant and spec in sig["inputs"]:
                spec.update(kind="constant_tensor", persistent=None)
    group = "constants" if constant else "state"
    record = program["tensors"]["state"].pop(old)
    program["tensors"][group][new] = record
    sig["outside_tree"], sig["state_order"] = list(outside), []
    state = safetensors.torch.load(members["state.safetensors"])
    tensors = {"state": state, "constants": safetensors.torch.load(members["constants.safetensors"])}
    tensors[group][new] = state.pop(old)
    members.update({"program.json": json.dumps(program).encode(),
                    "state.safetensors": safetensors.torch.save(tensors["state"]),
                    "constants.safetensors": safetensors.torch.save(tensors["constants"])})
    return zip_of(checksummed(members))


def name_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """Every name a file supplies that reaches generated code or an attribute."""
    kwargs, state, data = bases["kwargs"], bases["buffer_mutation"], bases["autograd_functions"]
    yield Attack("names", "keyword names that close a string literal (the issue's file)", inject_kwargs(kwargs, list(INJECTED_KWARGS)),
                 ("signature in_spec", "is not a Python identifier"))
    for name, why in (("lambda", "is a Python keyword"), ("self", "a name the generated code uses itself"),
                      ("torch", "a name the generated code uses itself"), ("x y", "is not a Python identifier"), (3, "is not a Python identifier")):
        yield Attack("names", f"keyword name {name!r}", inject_kwargs(kwargs, [name, "scale"]), ("signature in_spec", why))
    yield Attack("names", "a keyword name twice", inject_kwargs(kwargs, ["mask", "mask"]), ("signature in_spec", "a parameter twice"))
    yield Attack("names", "an input spec that is not (args, kwargs)", edited(kwargs, lambda p: p["signature"]["in_spec"].update(type="builtins:list")),
                 ("signature in_spec", "is not (positional arguments, keyword arguments)"))
    # fx.GraphModule's own names that nn.Module lacks (`graph`, `meta`, `call_contract`) are installed
    # without replacing anything (Note [State named like a GraphModule attribute]): test_serialize loads them
    for attribute in ("forward", "training", "_compiled_call_impl", "_parameters", "__class__"):
        yield Attack("names", f"a buffer named {attribute}", renamed_state(state, "count", attribute),
                     ("signature inputs", f"state {attribute!r}", "is an attribute ep.module() has of its own" if not attribute.startswith("__") else "starts with '__'"))
        yield Attack("names", f"a constant named {attribute}", renamed_state(state, "count", attribute, constant=True), ("signature inputs", f"state {attribute!r}"))
    yield Attack("names", "a container outside the tree named _compiled_call_impl",
                 renamed_state(state, "count", "_compiled_call_impl.count", outside=("_compiled_call_impl",)),
                 ("signature inputs", "'_compiled_call_impl' is an attribute ep.module() has"))
    yield Attack("names", "a nested state named forward", renamed_state(state, "count", "inner.forward"),
                 ("signature inputs", "'forward' is an attribute a module has of its own"))
    payload = f'w"),__import__("os").system("touch {MARKER}"),getattr(self,"w'
    yield Attack("names", "a state name that closes getattr's quotes", renamed_state(state, "count", payload),
                 ("signature inputs", "is not a Python identifier"))
    yield Attack("names", "a state under another state", renamed_state(state, "count", "total.count"), ("signature inputs", "lies under another state"))
    yield Attack("names", "a state named like a subgraph", renamed_state(state, "count", "_constant_total"), ("signature inputs", "takes a name ep.module() gives"))
    for name in ("forward", "training", "graph", "class"):
        yield Attack("names", f"a subgraph named {name}", edited(data, lambda p, name=name: _rename_subgraph(p, "grad_region_0", name)),
                     ("graph module <root>", f"{name!r}"))
    yield Attack("names", "a held tensor named training", renamed_held(bases["graph_tensors"], "_tensor_constant1", "training"),
                 ("graph module <root>", "'training' is not a valid attribute name"))
    for name in ("class", "G(os)", "__init__"):
        yield Attack("names", f"a class named {name!r}", edited(data, lambda p, name=name: module_of(p, "grad_region_0").update(class_name=name)),
                     ("graph module grad_region_0", "is not a valid name"))
    yield Attack("names", "a node keyword that is a keyword", edited(data, lambda p: node(p, "mul").update(kwargs={"lambda": 1})),
                 ("(mul)", "'lambda' is a Python keyword"))
    yield Attack("names", "a node named with a keyword", edited(data, lambda p: _rename_node(p, "mul", "return")),
                 ("'return' is not a valid, unique node name",))


def _rename_subgraph(program: dict, old: str, new: str) -> None:
    for entry in program["graph_module"]["submodules"]:
        if entry["name"] == old:
            entry["name"] = new
    node(program, old).update(name=new, target=new)
    _replace_refs(program["graph_module"]["nodes"], old, new)


def renamed_held(data: bytes, old: str, new: str) -> bytes:
    """`data` with the root graph's tensor `old` renamed (its node, record and data)."""
    import safetensors.torch

    members = members_of(data)
    program = json.loads(members["program.json"])
    module = program["graph_module"]
    next(t for t in module["tensors"] if t["name"] == old)["name"] = new
    node(program, old).update(name=new, target=new)
    _replace_refs(module["nodes"], old, new)
    graph = program["tensors"]["graph"]
    graph[new] = graph.pop(old)
    tensors = safetensors.torch.load(members["graph.safetensors"])
    tensors[new] = tensors.pop(old)
    members.update({"program.json": json.dumps(program).encode(), "graph.safetensors": safetensors.torch.save(tensors)})
    return zip_of(checksummed(members))


def _rename_node(program: dict, old: str, new: str) -> None:
    node(program, old)["name"] = new
    _replace_refs(program["graph_module"]["nodes"], old, new)


def _replace_refs(value, old: str, new: str):
    """Every `{"node": old}` reference in a JSON tree, renamed."""
    if isinstance(value, dict):
        if value.get("node") == old and len(value) == 1:
            value["node"] = new
        for item in value.values():
            _replace_refs(item, old, new)
    elif isinstance(value, list):
        for item in value:
            _replace_refs(item, old, new)


# --------------------------------------------------------------------------- cost (issue 21)


def nested_regions(data: bytes, depth: int) -> bytes:
    """`data` (the `region_detached_double` program) with its grad region nested `depth`
    times: each region's body calls the next region, the innermost doubles."""
    import copy as _copy

    members = members_of(data)
    program = json.loads(members["program.json"])
    root = program["graph_module"]
    inner = root["submodules"][0]["module"]
    wrapper = {**_copy.deepcopy(root), "class_name": "grad_region_0"}
    wrapper["nodes"] = [n for n in wrapper["nodes"] if n["name"] != "add"]
    wrapper["nodes"][-1]["args"] = [{"tuple": [{"node": "mul"}]}]
    for level in range(depth - 1):
        inner = {**_copy.deepcopy(wrapper), "submodules": [{"name": "grad_region_0", "module": inner}]}
    root["submodules"][0]["module"] = inner
    members["program.json"] = json.dumps(program).encode()
    return zip_of(checksummed(members))


# --------------------------------------------------------------------------- size expressions (issue 40)


class Chain(torch.nn.Module):
    """`length` relus of one (batch, 4) input: as many nodes whose value holds a size."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length

    def forward(self, x):
        for _ in range(self.length):
            x = x.relu()
        return x


def chain_program(length: int) -> bytes:
    """A saved `Chain(length)` with a dynamic batch (symbol range [2, 64])."""
    from torch.export import Dim

    ep = predispatch.export(Chain(length), (torch.randn(3, 4),), dynamic_shapes=({0: Dim("batch", min=2, max=64)},))
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    return buffer.getvalue()


#: The size symbols `with_sizes` declares: `s100`, `s101`, ...
SIZE_SYMBOLS = 200


def size_symbol(index: int) -> str:
    return f"s{100 + index % SIZE_SYMBOLS}"


def with_sizes(data: bytes, sizes: list[str], hint: int = 3) -> bytes:
    """`data` (a `chain_program`) declaring SIZE_SYMBOLS more size symbols (range [2, 64]),
    and the first size of the i-th relu's value replaced by `sizes[i]`."""
    def edit(p):
        ranges = p["signature"]["shapes"]["ranges"]["tuple"]
        ranges.extend({"tuple": [size_symbol(i), 2, 64]} for i in range(SIZE_SYMBOLS))
        relus = [n for n in module_of(p)["nodes"] if n["op"] == "call_function"]
        assert len(relus) >= len(sizes)
        for record, size in zip(relus, sizes):
            record["meta"]["val"]["tensor"]["shape"][0] = {"sym": size, "hint": hint}
    return edited(data, edit)


def _in_grammar(text: str) -> bool:
    from predispatch import size_expressions

    try:
        size_expressions.parse(text, "")
    except SerializationError:
        return False
    return True


def _at_bound(grow: Callable[[str, int], str], start: str) -> tuple[str, int]:
    """The largest expression `grow(expression, step)` makes from `start` that the grammar
    reads (so at one of its bounds), and the steps it took."""
    expression, step = start, 0
    while _in_grammar(grown := grow(expression, step)):
        expression, step = grown, step + 1
    return expression, step


def _size_growths(j: int) -> dict[str, tuple[Callable[[str, int], str], str]]:
    """The worst cases of the size grammar, each as a growth from a start, over symbols
    rotated by `j` (so that no two expressions of a file are the same text)."""
    s = lambda i: size_symbol(i + j)  # noqa: E731
    return {
        "one Max of many symbols": (lambda e, i: e[:-1] + f", {s(i + 1)})", f"Max({s(0)})"),
        "nested Max and Min": (lambda e, i: f"{'Max' if i % 2 else 'Min'}({s(i + 1)}, {e})", s(0)),
        "a long sum": (lambda e, i: f"{e} + {s(i + 1)}", s(0)),
        "a long product": (lambda e, i: f"{e}*{s(i + 1)}", s(0)),
        "nested distributions": (lambda e, i: f"2*({s(i + 1)} + {e})", s(0)),
        "nested powers": (lambda e, i: f"({e} + {s(i + 1)})**2", s(0)),
        "nested floor divisions": (lambda e, i: f"(({e} + {s(i + 1)})//{i + 2})", s(0)),
        "nested Mods": (lambda e, i: f"Mod({e} + {s(i + 1)}, {i + 2})", s(0)),
        "a sum of floor divisions": (lambda e, i: f"{e} + ({s(i + 1)}//{i + 2})", f"({s(0)}//2)"),
        "a sum of Mods": (lambda e, i: f"{e} + Mod({s(i + 1)}, {i + 2})", f"Mod({s(0)}, 2)"),
        "a sum of Max": (lambda e, i: f"{e} + Max({s(i + 1)}, {s(i + 2)})", f"Max({s(0)}, {s(1)})"),
    }


SIZE_CASES = tuple(_size_growths(0))


def worst_size(case: str, j: int = 0) -> str:
    """The j-th expression of `case` at the grammar's bounds."""
    return _at_bound(*_size_growths(j)[case])[0]


def beyond_size(case: str, j: int = 0) -> str:
    """The expression of `case` one step beyond the grammar's bounds."""
    grow, start = _size_growths(j)[case]
    return grow(*_at_bound(grow, start))


def size_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """Sizes one step beyond each bound of the size grammar, the issue's Max of 150 symbols
    (it loaded for minutes), a function the grammar does not have, and symbols named as
    sympy or Python names things (they loaded, then every call failed with a raw error)."""
    data = bases["sizes"]
    for case in SIZE_CASES:
        yield Attack("sizes", f"{case}, beyond the bound", with_sizes(data, [beyond_size(case)]),
                     ("nodes[1] (relu) meta['val']", "is not a size expression: it", "(size_expressions.MAX_"))
    yield Attack("sizes", "the issue's Max of 150 symbols", with_sizes(data, ["Max(" + ", ".join(map(size_symbol, range(150))) + ")"]),
                 ("nodes[1] (relu) meta['val']", "calls Max with 150 arguments", "(size_expressions.MAX_ARGUMENTS)"))
    yield Attack("sizes", "a function the grammar does not have", with_sizes(data, [f"TruncToInt({size_symbol(0)})"]),
                 ("nodes[1] (relu) meta['val']", "it calls TruncToInt, which the size grammar does not have"))
    symbol = json.loads(members_of(data)["program.json"])["signature"]["shapes"]["ranges"]["tuple"][0]["tuple"][0]
    for name in ("N", "oo", "eval", "Symbol"):
        yield Attack("sizes", f"a symbol named {name}", edited(data, lambda p: None, raw=lambda text, name=name: text.replace(
            f'"{symbol}"'.encode(), f'"{name}"'.encode())), (f"signature shapes: symbol {name!r} with range [2, 64] is not a size symbol",))


def python_calls(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """`fn(*args)` and the Python function calls it made: a work count, not a time."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event == "call"

    sys.setprofile(count)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    return result, calls


def measure_work(paths: list[str], warm_up: str) -> list[dict]:
    """Python function calls made to load each file, build and call its module, convert it
    with `to_torch()` and run `predispatch show` and `predispatch draw` on it (a work count,
    not a time), after one such pass over `warm_up`, so that imports and caches do not count."""
    import contextlib
    import tempfile

    from predispatch.cli.main import main as cli

    def use(path: str, out: str) -> str:
        try:
            loaded = predispatch.load(path)
        except SerializationError as exc:
            return f"refused: {exc}"
        loaded.module()(torch.randn(5, 4))
        loaded.to_torch()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            assert cli(["show", path]) == 0 and cli(["draw", path, "-o", out]) == 0
        return "loaded"

    def counted(path: str, out: str) -> tuple[str, int]:
        return python_calls(use, path, out)

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "picture.html")
        use(warm_up, out)
        rows = []
        for path in paths:
            outcome, calls = counted(path, out)
            rows.append({"path": path, "outcome": outcome, "calls": calls, "bytes": os.path.getsize(path)})
        return rows
#: How each higher-order op the region attacks use calls a subgraph `body` on one value `x`.
REGION_CALLS: dict[str, Callable[[dict, dict], list]] = {
    "wrap_with_set_grad_enabled": lambda body, x: [False, body, x],
    "wrap_with_autocast": lambda body, x: ["cpu", None, False, None, body, x],
    "invoke_subgraph": lambda body, x: [body, "grad_region_0", x],
}


def _calls_in_chain(call: dict, getitem: dict, hop: str, body: str, calls: int) -> list[dict]:
    """`calls` calls of subgraph `body` by `hop` in a chain on `x` (each on the previous one's
    result), copied from `call` and its `getitem`; the last result is named `result`."""
    nodes, value = [], "x"
    for i in range(calls):
        name = "result" if i == calls - 1 else f"r{i}"
        args = REGION_CALLS[hop]({"node": body}, {"node": value})
        nodes.append({**call, "name": f"call{i}", "target": f"higher_order.{hop}", "args": args})
        nodes.append({**getitem, "name": name, "args": [{"node": f"call{i}"}, 0]})
        value = name
    return nodes


def region_dag(
    data: bytes, depth: int, calls: int = 2, *, root_calls: int = 1, hops: tuple[str, ...] = ("wrap_with_set_grad_enabled",),
    ops: int = 1,
) -> bytes:
    """`data` (the `region_detached_double` program) with `depth` levels of subgraphs, each
    level's body calling the next level's `calls` times in a chain, the innermost doubling
    `ops` times: a file linear in `depth` whose call paths number `calls ** (depth - 1)`
    (issue 40).  The root calls the outermost body `root_calls` times (many call sites of one
    body).  `hops`: the higher-order op each level calls its body with, outermost first, the
    last one repeated."""
    members = members_of(data)
    program = json.loads(members["program.json"])
    root = program["graph_module"]
    placeholder, getter, call, getitem, add, output = root["nodes"]
    body = root["submodules"][0]["module"]
    first, double, returned = body["nodes"]
    doubles = [{**double, "name": f"mul{i}", "args": [{"node": f"mul{i - 1}" if i else "x"}, 2]} for i in range(ops)]
    body["nodes"] = [first, *doubles, {**returned, "args": [{"tuple": [{"node": f"mul{ops - 1}"}]}]}]
    levels = [*hops, *[hops[-1]] * depth][:depth]
    for hop in reversed(levels[1:]):
        nodes = [placeholder, getter, *_calls_in_chain(call, getitem, hop, "grad_region_0", calls)]
        nodes.append({**output, "args": [{"tuple": [{"node": "result"}]}]})
        body = {"class_name": "grad_region_0", "nodes": nodes, "tensors": [], "submodules": [{"name": "grad_region_0", "module": body}]}
    root["submodules"][0]["module"] = body
    chain = _calls_in_chain(call, getitem, levels[0], "grad_region_0", root_calls)
    root["nodes"] = [placeholder, getter, *chain, {**add, "args": [{"node": "x"}, {"node": "result"}]}, output]
    members["program.json"] = json.dumps(program).encode()
    return zip_of(checksummed(members))


def called_again(data: bytes, call: str, result: str, times: int = 1) -> bytes:
    """`data` with the root's HOP call `call` made `times` more times, each on the previous
    result (its getitem `result`), the last of which the rest of the graph then reads: one
    body, `1 + times` call sites."""

    def edit(program):
        nodes = program["graph_module"]["nodes"]
        first = next(i for i, n in enumerate(nodes) if n["name"] == result)
        last = result if times == 1 else f"{result}_again{times - 1}"
        _replace_refs(nodes[first + 1:], result, f"{result}_again" if times == 1 else last)
        added, value = [], result
        for i in range(times):
            suffix = "_again" if times == 1 else f"_again{i}"
            added.append({**nodes[first - 1], "name": f"{call}{suffix}", "args": [*nodes[first - 1]["args"][:-1], {"node": value}]})
            added.append({**nodes[first], "name": f"{result}{suffix}", "args": [{"node": f"{call}{suffix}"}, 0]})
            value = f"{result}{suffix}"
        nodes[first + 1:first + 1] = added

    return edited(data, edit)


def region_holding(data: bytes, tensors: int, sites: int) -> bytes:
    """`data` (the `graph_tensors` program) with its region's body holding `tensors` more
    tensors (read, unused), called from `1 + sites` sites: lifting passes each tensor at each call."""
    import safetensors.torch

    members = members_of(data)
    program = json.loads(members["program.json"])
    body = program["graph_module"]["submodules"][0]["module"]
    held = safetensors.torch.load(members["graph.safetensors"])
    record = program["tensors"]["graph"]["grad_region_0._tensor_constant0"]
    getter = next(n for n in body["nodes"] if n["op"] == "get_attr")
    for i in range(tensors):
        body["tensors"].append({"name": f"t{i}", "persistent": True})
        body["nodes"].insert(1, {**getter, "name": f"t{i}", "target": f"t{i}"})
        held[f"grad_region_0.t{i}"] = torch.ones(2)
        program["tensors"]["graph"][f"grad_region_0.t{i}"] = record
    members.update({"program.json": json.dumps(program).encode(), "graph.safetensors": safetensors.torch.save(held)})
    return called_again(zip_of(checksummed(members)), "wrap_with_set_grad_enabled", "add", sites)


def call_site_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """Calls that multiply what `module()` and `to_torch()` build (Note [Calls of one subgraph]
    in predispatch/serialize/verify.py)."""
    regions = bases["regions"]
    yield Attack("call_sites", "a shared body calling a shared body", region_dag(regions, 3, hops=("invoke_subgraph",)),
                 ("graph module grad_region_0, node call0", "calls a shared body itself"))
    yield Attack("call_sites", "a 200-op shared body called 200 times",
                 region_dag(regions, 1, root_calls=200, hops=("invoke_subgraph",), ops=200),
                 ("graph module grad_region_0: its calls add 40400 nodes", "times the 606 nodes and tensors the file holds"))
    yield Attack("call_sites", "a region holding 400 tensors called from 301 sites", region_holding(bases["graph_tensors"], 400, 300),
                 ("graph module grad_region_0: its calls add 120701 nodes", "times the 1418 nodes and tensors the file holds"))


# --------------------------------------------------------------------------- calls (issue 40)


class Branches(torch.nn.Module):
    """torch.cond on the sign of the input's sum."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))


class Scanned(torch.nn.Module):
    """torch's scan: a running sum (the carry) and each step's double."""

    def forward(self, x):
        from torch._higher_order_ops.scan import scan

        return scan(lambda carry, row: (carry + row, row * 2), torch.zeros(x.shape[1]), x)


class Mapped(torch.nn.Module):
    """torch's map: each row's relu."""

    def forward(self, x):
        from functorch.experimental.control_flow import map as control_flow_map

        return control_flow_map(lambda row: row.relu(), x)


def control_flow_programs() -> dict[str, bytes]:
    """Saved programs with each control-flow op, an autocast region and a region left open."""
    from test_serialize import export_case, saved

    x = torch.randn(4, 3)
    programs = {name: saved(predispatch.export(cls(), (x,))) for name, cls in (("cond", Branches), ("scan", Scanned), ("map", Mapped))}
    for name, case in (("while_loop", "while_loop_counted"), ("autocast", "region_autocast"), ("left_open", "region_left_open")):
        programs[name] = saved(export_case(case)[0])
    torch.set_grad_enabled(True)  # `left_open`'s export leaves it as it was; this is for the reader
    return programs


def returns(program: dict, path: str, value) -> None:
    """Make subgraph `path`'s output node return `value` (a JSON value: `{"tuple": [...]}`)."""
    node(program, "output", path)["args"] = [value]


def returned_node(program: dict, path: str, name: str, target: str, args: list, val: dict) -> None:
    """Make subgraph `path` compute node `name` = `target(*args)` with metadata `val` (a tensor's
    record, as honest as the file is) before its output, and return it alone."""
    nodes = module_of(program, path)["nodes"]
    nodes.insert(len(nodes) - 1, {"op": "call_function", "name": name, "target": target, "args": args, "meta": {"val": {"tensor": val}}})
    returns(program, path, {"tuple": [{"node": name}]})


def _tensor_val(shape: list, dtype: str = "float32") -> dict:
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return {"shape": shape, "stride": stride, "storage_offset": 0, "dtype": dtype, "device": "cpu", "requires_grad": False}


def call_failure_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """Files that loaded and then failed at every call with torch's raw error, or ran and
    returned what the program never promised (issue 40; Note [What a subgraph gives back] in
    predispatch/serialize/verify.py): each refused at load, naming the node and why."""
    cond, loop, scan, mapped = bases["cond"], bases["while_loop"], bases["scan"], bases["map"]
    x8 = (torch.randn(4, 8),)
    yield Attack("call_failures", "a cond predicate that is a 4x3 tensor (ambiguous truth value at the call)",
                 edited(cond, lambda p: node(p, "cond")["args"].__setitem__(0, {"node": "x"})),
                 ("graph module <root>, node cond", "its predicate is a float32[4, 3] tensor on cpu: a bool or a one-element tensor expected"))
    yield Attack("call_failures", "a cond branch returning two values for a one-value result",
                 edited(cond, lambda p: returns(p, "false_graph_0", {"tuple": [{"node": "cos"}, {"node": "cos"}]})),
                 ("node cond", "its false branch returns 2 value(s), where the call's result has 1"))
    yield Attack("call_failures", "a cond branch returning a tensor of another shape",
                 edited(cond, lambda p: returned_node(p, "true_graph_0", "rows", "aten.sum.dim_IntList", [{"node": "arg0_1"}, [0]], _tensor_val([3]))),
                 ("node cond", "its true branch returns, at 0, a float32[3] tensor on cpu where the result holds a float32[4, 3] tensor on cpu"))
    yield Attack("call_failures", "a cond branch returning a bare tensor, not a tuple",
                 edited(cond, lambda p: returns(p, "false_graph_0", {"node": "cos"})),
                 ("node cond", "its false branch returns node cos (call_function), not a tuple or list of values"))
    yield Attack("call_failures", "a while_loop body returning one of its two carries (AssertionError at the call)",
                 edited(loop, lambda p: returns(p, "while_loop_body_graph_0", {"tuple": [{"node": "add"}]})),
                 ("node while_loop", "its body returns 1 value(s), where the call's result has 2"), args=x8)
    yield Attack("call_failures", "a while_loop body returning its carries swapped",
                 edited(loop, lambda p: returns(p, "while_loop_body_graph_0", {"tuple": [{"node": "add_1"}, {"node": "add"}]})),
                 ("node while_loop", "its body returns, for carry 0, a float32[4, 8] tensor on cpu where the carry is a int64[] tensor on cpu"),
                 args=x8)
    yield Attack("call_failures", "a while_loop condition returning a 4x8 tensor",
                 edited(loop, lambda p: returns(p, "while_loop_cond_graph_0", {"node": "arg1_1"})),
                 ("node while_loop", "its condition returns a float32[4, 8] tensor on cpu: a bool or a bool tensor of shape [] expected"), args=x8)
    yield Attack("call_failures", "a while_loop condition returning the int64 counter",
                 edited(loop, lambda p: returns(p, "while_loop_cond_graph_0", {"node": "arg0_1"})),
                 ("node while_loop", "its condition returns a int64[] tensor on cpu"), args=x8)
    yield Attack("call_failures", "a while_loop condition returning None",
                 edited(loop, lambda p: returns(p, "while_loop_cond_graph_0", None)),
                 ("node while_loop", "its condition returns NoneType None: a bool or a bool tensor of shape [] expected"), args=x8)
    yield Attack("call_failures", "a placeholder with a default value (FX compiles it into the call's unpacking: ValueError)",
                 edited(bases["regions"], lambda p: node(p, "x").update(args=[[[[]]]])),
                 ("graph module <root>, node x", "a placeholder with arguments", "export writes none"), args=(torch.randn(3),))
    yield Attack("call_failures", "a scan combine returning only its carry (IndexError at the call)",
                 edited(scan, lambda p: returns(p, "scan_combine_graph_0", [{"node": "add"}])),
                 ("node scan", "its combine returns 1 value(s), where the call's result has 2"))
    yield Attack("call_failures", "a map body returning nothing (IndexError at the call)",
                 edited(mapped, lambda p: returns(p, "body_graph_0", {"tuple": []})),
                 ("node map_impl", "its body returns 0 value(s), where the call's result has 1"))
    yield Attack("call_failures", "a grad-mode region body returning nothing (IndexError at the call)",
                 edited(bases["regions"], lambda p: returns(p, "grad_region_0", {"tuple": []})),
                 ("node wrap_with_set_grad_enabled", "its body returns 0 value(s), where the call's result has 1"), args=(torch.randn(3),))
    yield from _autocast_attacks(bases["autocast"])
    data = bases["autograd_functions"]
    yield Attack("call_failures", "a custom Function whose result claims an output its forward does not return (IndexError at the call)",
                 edited(data, _second_output), ("node autograd_function_apply_1", "its forward returns 1 output(s), where the call's result has 2"))
    yield Attack("call_failures", "a custom Function whose forward returns an output of another shape",
                 edited(data, _summed_output), ("node autograd_function_apply_1",
                                                "its forward returns, at 0, a float32[3] tensor on cpu where the result holds a float32[4, 3] tensor on cpu"))
    for device in ({"device": "meta"}, "meta"):
        yield Attack("call_failures", f"an op making a tensor on the meta device ({json.dumps(device)})",
                     edited(data, lambda p, device=device: call(p, "add_2", "aten._to_copy.default", [{"node": "x"}], kwargs={"device": device})),
                     ("graph module <root>, node add_2", "its argument device is the meta device"))
    if not torch.cuda.is_available():
        yield Attack("call_failures", "an op making a tensor on a device named by a plain string this machine lacks",
                     edited(data, lambda p: call(p, "add_2", "aten._to_copy.default", [{"node": "x"}], kwargs={"device": "cuda"})),
                     ("node add_2", "its argument device is str 'cuda'", "cannot provide"))
    yield Attack("call_failures", "training flags without the root module's (.train() raised KeyError: '')",
                 edited(data, lambda p: p["signature"].update(training_flags=[["inner", False]])),
                 ("signature training_flags", "starts with str 'inner', not the root module's flag (path '')"))
    yield Attack("call_failures", "training flags naming the root twice",
                 edited(data, lambda p: p["signature"].update(training_flags=[["", True], ["", False]])),
                 ("signature training_flags", "gives the flag of str '' twice"))


def _second_output(program: dict) -> None:
    """`autograd_function_apply_1`'s result claims a second output, which a new node reads."""
    call_node = node(program, "autograd_function_apply_1")
    call_node["meta"]["val"]["tuple"].append(call_node["meta"]["val"]["tuple"][0])
    nodes = module_of(program)["nodes"]
    first = next(n for n in nodes if n.get("args") == [{"node": "autograd_function_apply_1"}, 0])
    nodes.insert(nodes.index(first) + 1, {**first, "name": "second", "args": [{"node": "autograd_function_apply_1"}, 1]})


def _summed_output(program: dict) -> None:
    """`autograd_function_apply_1`'s forward returns its (4, 3) output summed to (3,)."""
    path = "setup_context_linear_fwd_0"
    nodes = module_of(program, path)["nodes"]
    nodes.insert(len(nodes) - 1, {"op": "call_function", "name": "rows", "target": "aten.sum.dim_IntList",
                                  "args": [{"node": "matmul"}, [0]], "meta": {"val": {"tensor": _tensor_val([3])}}})
    node(program, "output", path)["args"][0]["tuple"][0] = {"tuple": [{"node": "rows"}]}


def _autocast_attacks(data: bytes) -> Iterator[Attack]:
    """Autocast regions this machine cannot run as the file says: torch raises at every call, or
    disables autocast and the casts after the region fail (`_assert_tensor_metadata`)."""
    def device_type(value):
        return lambda p: node(p, "wrap_with_autocast")["args"].__setitem__(0, value)

    x8 = (torch.randn(4, 8),)
    where = "graph module <root>, node wrap_with_autocast"
    yield Attack("call_failures", "an autocast region for a device type that does not exist",
                 edited(data, device_type("foo")), (where, "torch.autocast('foo') fails here"), args=x8)
    yield Attack("call_failures", "an autocast region for the meta device",
                 edited(data, device_type("meta")), (where, "unsupported autocast device_type 'meta'"), args=x8)
    yield Attack("call_failures", "an autocast region whose dtype CPU autocast does not take",
                 edited(data, lambda p: node(p, "wrap_with_autocast")["args"].__setitem__(1, {"dtype": "int64"})),
                 (where, "torch.autocast('cpu', torch.int64) would disable itself here"), args=x8)
    if not torch.cuda.is_available():
        yield Attack("call_failures", "an autocast region for cuda on a machine without it (torch disables it)",
                     edited(data, device_type("cuda")), (where, "torch.autocast('cuda', torch.bfloat16) would disable itself here"), args=x8)
    if not torch.xpu.is_available():
        yield Attack("call_failures", "an autocast region for xpu on a machine without it (casts nothing)",
                     edited(data, device_type("xpu")), (where, "an autocast region for 'xpu'", "cannot provide"), args=x8)


def caller_state_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """Records that change what happens outside the call (issue 40; Note [A file that changes its
    caller's grad mode] in predispatch/serialize/verify.py)."""
    data, left_open = bases["autograd_functions"], bases["left_open"]
    for mode, state in ((False, "disabled"), (True, "enabled")):
        yield Attack("caller_state", f"a plain program that leaves grad mode {state} for its caller (the issue's file)",
                     edited(data, lambda p, mode=mode: p["signature"].update(grad_mode_on_exit=mode)),
                     ("signature grad_mode_on_exit", f"the program would leave grad mode {state} for its caller",
                      f"does not run in a wrap_with_set_grad_enabled({mode}, ...) region"))
    yield Attack("caller_state", "a program ending in an enable_grad region that leaves grad mode disabled",
                 edited(left_open, lambda p: node(p, "wrap_with_set_grad_enabled")["args"].__setitem__(0, True)),
                 ("signature grad_mode_on_exit", "leave grad mode disabled", "wrap_with_set_grad_enabled(False, ...)"), args=(torch.randn(2, 3),))


# --------------------------------------------------------------------------- kernels (issue 21)


class Kernels(torch.nn.Module):
    """A joint program of this holds the backward kernels that trust their forward's outputs."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.bn = torch.nn.BatchNorm2d(1)
        self.gn = torch.nn.GroupNorm(1, 1)

    def forward(self, tokens, image):
        pooled = torch.nn.functional.max_pool2d(self.gn(self.bn(image)), 2)
        return (self.norm(self.emb(tokens)).sum() + pooled.sum()).float()


KERNEL_ARGS = (torch.tensor([[1, 2, 9]]), torch.ones(2, 1, 4, 4))


def kernel_program() -> bytes:
    torch.manual_seed(0)
    buffer = io.BytesIO()
    predispatch.save(predispatch.export(Kernels().train(), KERNEL_ARGS).joint(loss=""), buffer)
    return buffer.getvalue()


class ShapeKernels(torch.nn.Module):
    """A joint program of this holds the other backward kernels that read an argument as
    another's shape (passes/kernel_shapes.py's SHAPE_RULES), and a one-element parameter
    (`p_tiny`) an attack feeds them instead."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 3, 8))
        self.points = torch.nn.Parameter(torch.randn(4, 3))
        self.image = torch.nn.Parameter(torch.randn(1, 2, 5, 5))
        self.volume = torch.nn.Parameter(torch.randn(1, 2, 3, 3, 3))
        self.tiny = torch.nn.Parameter(torch.ones(1))

    def forward(self, grid):
        terms = (torch.log_softmax(self.w, -1), torch.cdist(self.points, self.points * 2), torch.pdist(self.points),
                 torch.nn.functional.adaptive_avg_pool2d(self.image, 2), self.w.unfold(2, 3, 2),
                 torch.nn.functional.grid_sample(self.volume, grid, align_corners=False), self.tiny)
        return sum(t.sum() for t in terms)


SHAPE_KERNEL_ARGS = (torch.rand(1, 2, 2, 2, 3) * 2 - 1,)


def shape_kernel_program() -> bytes:
    torch.manual_seed(0)
    buffer = io.BytesIO()
    predispatch.save(predispatch.export(ShapeKernels(), SHAPE_KERNEL_ARGS).joint(loss=""), buffer)
    return buffer.getvalue()


def _fed_tiny(target: str, argument: str) -> Callable[[dict], None]:
    """Feed `p_tiny` (one element) to `argument` of the first call of `target`."""
    def edit(p):
        record = next(n for n in module_of(p)["nodes"] if n.get("target") == target)
        names = [a.name for a in _op(target)._schema.arguments]
        record["args"][names.index(argument)] = {"node": "p_tiny"}
    return edit


def shape_kernel_attacks(data: bytes) -> Iterator[Attack]:
    """Each SHAPE_RULES argument of the kernels ShapeKernels' joint holds, fed one element:
    refused by `ep.module()` before the kernel runs (and by `to_torch()`'s module: `run_attack`)."""
    for target, argument in (("aten._log_softmax_backward_data.default", "output"), ("aten._cdist_backward.default", _op("aten._cdist_backward.default")._schema.arguments[0].name),
                             ("aten._cdist_backward.default", "cdist"), ("aten._pdist_backward.default", _op("aten._pdist_backward.default")._schema.arguments[0].name),
                             ("aten._pdist_backward.default", "pdist"), ("aten._adaptive_avg_pool2d_backward.default", "grad_output"),
                             ("aten.unfold_backward.default", "grad_in"), ("aten.grid_sampler_3d_backward.default", "grad_output")):
        yield Attack("kernels", f"{target} reading a one-element {argument} (checked at the call)",
                     edited(data, _fed_tiny(target, argument)),
                     (f"{target} is given {argument} of shape (1,) where it must have shape",), args=SHAPE_KERNEL_ARGS)


def _hostile_indices(p, name: str, like: str, at: str) -> None:
    """Insert `name`, int64 indices of 2**40 shaped like node `like`, before node `at`."""
    nodes = module_of(p)["nodes"]
    index = next(i for i, n in enumerate(nodes) if n["name"] == at)
    nodes[index:index] = [{"op": "call_function", "name": name, "target": "aten.full_like.default",
                           "args": [{"node": like}, 1 << 40], "kwargs": {"dtype": {"dtype": "int64"}},
                           "meta": node(p, like)["meta"]}]


def kernel_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """Kernels fed what their forward never produces (each crashes, corrupts or reads out of
    bounds when it runs), and every packet a file may not call."""
    data, args = bases["kernels"], KERNEL_ARGS

    def feed(name, argument, value):
        return lambda p: node(p, name)["args"].__setitem__(argument, value)

    def hostile_pool(p):
        _hostile_indices(p, "evil", "getitem_9", "max_pool2d_with_indices_backward")
        node(p, "max_pool2d_with_indices_backward")["args"][7] = {"node": "evil"}

    yield Attack("kernels", "max_pool2d backward with indices of 2**40 (segfault)", edited(data, hostile_pool),
                 ("node max_pool2d_with_indices_backward", "its indices must come from a aten.max_pool2d_with_indices call"), args=args)
    yield Attack("kernels", "max_pool2d backward on another input than its forward", edited(data, feed("max_pool2d_with_indices_backward", 1, {"node": "getitem"})),
                 ("node max_pool2d_with_indices_backward", "on other self than its forward"), args=args)
    yield Attack("kernels", "max_pool2d backward with another kernel size", edited(data, feed("max_pool2d_with_indices_backward", 2, [1, 1])),
                 ("node max_pool2d_with_indices_backward", "on other kernel_size"), args=args)
    yield Attack("kernels", "layer norm backward reading a one-element mean", edited(data, feed("native_layer_norm_backward", 3, {"node": "getitem_3"})),
                 ("node native_layer_norm_backward", "its mean, rstd must come from a aten.native_layer_norm call"), args=args)
    yield Attack("kernels", "layer norm backward reading a four-element grad_out as (1, 3, 4) (checked at the call)",
                 edited(data, feed("native_layer_norm_backward", 0, {"node": "p_norm_weight"})),
                 ("aten.native_layer_norm_backward.default is given grad_out of shape (4,) where it must have shape (1, 3, 4)",
                  "so it would read memory outside that argument"), args=args)
    yield Attack("kernels", "batch norm backward reading a one-element grad_out as (2, 1, 4, 4) (checked at the call)",
                 edited(data, feed("native_batch_norm_backward", 0, {"node": "p_bn_weight"})),
                 ("aten.native_batch_norm_backward.default is given grad_out of shape (1,) where it must have shape (2, 1, 4, 4)",), args=args)
    yield Attack("kernels", "layer norm backward with another normalized shape", edited(data, feed("native_layer_norm_backward", 2, [1])),
                 ("node native_layer_norm_backward", "on other normalized_shape"), args=args)
    yield Attack("kernels", "group norm backward with statistics of layer norm", edited(data, feed("native_group_norm_backward", 2, {"node": "getitem_11"})),
                 ("node native_group_norm_backward", "must come from a aten.native_group_norm call"), args=args)
    yield Attack("kernels", "batch norm backward with another running mean", edited(data, feed("native_batch_norm_backward", 3, {"node": "getitem_3"})),
                 ("node native_batch_norm_backward", "on other running_mean"), args=args)
    yield Attack("kernels", "embedding backward into fewer rows than its weight", edited(data, feed("embedding_dense_backward", 2, 2)),
                 ("node embedding_dense_backward", "num_weights must be the row count"), args=args)

    def hostile_embedding(p):
        _hostile_indices(p, "evil", "tokens", "embedding_dense_backward")
        node(p, "embedding_dense_backward")["args"][1] = {"node": "evil"}

    yield Attack("kernels", "embedding backward with indices of 2**40", edited(data, hostile_embedding),
                 ("node embedding_dense_backward", "must come from a aten.embedding call"), args=args)
    yield from shape_kernel_attacks(bases["shape_kernels"])
    yield Attack("kernels", "sobol draw from a one-row state (heap corruption)", edited(bases["autograd_functions"], lambda p: call(
        p, "add_2", "aten._sobol_engine_draw.default", [{"node": "x"}, 100000, {"node": "x"}, 1000, 0, {"dtype": "float32"}])),
        ("node add_2", "which a file may not call (trusts_inputs:"))
    from predispatch.serialize.kernel_inputs import REFUSED_IN_FILES
    from predispatch.serialize.op_allowlist import decide

    callable_ops = sorted(o for p in REFUSED_IN_FILES for o in _overloads(p) if decide(_op(o), stored=False).allowed)
    yield from _op_attacks("kernels", callable_ops,
                           "(trusts_inputs:", bases["autograd_functions"], rng)


# --------------------------------------------------------------------------- tensor subclasses (issue 32)


class SubclassState(torch.nn.Module):
    """A TwoTensor parameter and a TwoTensor buffer (stored as their parts, format version 2),
    a plain input and output."""

    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        torch.manual_seed(0)
        self.w = torch.nn.Parameter(TwoTensor(torch.randn(3, 3), torch.randn(3, 3)))
        self.register_buffer("s", TwoTensor(torch.ones(3), torch.full((3,), 2.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x @ self.w) * self.s
        return y.get_elem_a() + y.b


def subclass_program() -> bytes:
    from test_serialize import saved

    return saved(predispatch.export(SubclassState(), (torch.randn(4, 3),)))


def layout_of(program: dict, target: str = "w") -> dict:
    return next(e["layout"] for e in program["signature"]["subclass_state"] if e["target"] == target)


def retensored(data: bytes, edit: Callable[[dict, dict], None]) -> bytes:
    """`data` with `edit(program, state)` applied to program.json and state.safetensors's tensors."""
    import safetensors.torch

    members = members_of(data)
    program, state = json.loads(members["program.json"]), safetensors.torch.load(members["state.safetensors"])
    edit(program, state)
    members.update({"program.json": json.dumps(program).encode(), "state.safetensors": safetensors.torch.save(state)})
    return zip_of(checksummed(members))


def _without_part(program: dict, state: dict) -> None:
    del program["tensors"]["state"]["w:b"], state["w:b"]


def _renamed_part(program: dict, state: dict) -> None:
    program["tensors"]["state"]["v:a"], state["v:a"] = program["tensors"]["state"].pop("w:a"), state.pop("w:a")


def nested_layout(data: bytes, depth: int) -> bytes:
    """The parameter's layout nested `depth` deep (a subclass whose part is a subclass ...)."""
    def edit(p):
        layout = layout_of(p)
        for _ in range(depth - 1):
            layout["inner"][0][1] = copy.deepcopy(layout_of(p))
            layout = layout["inner"][0][1]
    return edited(data, edit)


def subclass_attacks(bases: dict[str, bytes], rng: random.Random) -> Iterator[Attack]:
    """Files whose tensor subclasses lie: refused by name before any subclass is built."""
    data, two = bases["subclasses"], ("torch.testing._internal.two_tensor.TwoTensor",)
    from torch.testing._internal.two_tensor import TwoTensor

    allowed = (TwoTensor,)
    yield Attack("subclasses", "a subclass the user did not allow", data,
                 ("signature subclass_state['w']", "torch.testing._internal.two_tensor:TwoTensor", "__tensor_unflatten__",
                  "types=[torch.testing._internal.two_tensor.TwoTensor]"))
    yield Attack("subclasses", "a layout whose parts are not its inputs'",
                 edited(data, lambda p: layout_of(p).update(inner=[["b", None], ["a", None]])),
                 ("signature subclass_state['w']", "its parts ['b', 'a'] are not the inner paths"), types=allowed)
    yield Attack("subclasses", "a part missing", retensored(data, _without_part),
                 ("signature subclass_state['w']", "the file stores the parts ['a'], its layout has ['a', 'b']"), types=allowed)
    yield Attack("subclasses", "a part of a subclass tensor the file does not list", retensored(data, _renamed_part),
                 ("state.safetensors['v:a']", "tensors.subclasses does not list"), types=allowed)
    yield Attack("subclasses", "a part whose record lies about its shape",
                 edited(data, lambda p: p["tensors"]["state"]["w:a"].update(shape=[9], stride=[1])),
                 ("signature input p_w__a (PARAMETER 'w')", "its value is torch.float32[2 dims], its target torch.float32[1 dims]"),
                 types=allowed)
    yield Attack("subclasses", "a layout class that is no tensor subclass",
                 edited(data, lambda p: layout_of(p).update({"class": f"{__name__}:Unregistered"})),
                 ("signature subclass_state['w']", "its class Unregistered is not a tensor subclass with __tensor_flatten__"),
                 types=(TwoTensor, Unregistered))
    yield Attack("subclasses", "a context naming torch's ProcessFailure, which reads the file it names",
                 edited(data, lambda p: layout_of(p).update(context={"dataclass": {"class": PROCESS_FAILURE, "fields": [
                     ["local_rank", 0], ["pid", 1], ["exitcode", 1], ["error_file", SECRET]]}})),
                 ("signature subclass_state['w'] context", f"the class {PROCESS_FAILURE};", "types=[" + PROCESS_FAILURE.replace(":", ".")),
                 types=allowed, never_opened=SECRET)
    yield Attack("subclasses", "a context enum with code of its own",
                 edited(data, lambda p: layout_of(p).update(context={"enum": {"class": f"{__name__}:CodedMode", "name": "ONE"}})),
                 ("signature subclass_state['w'] context", f"{__name__}:CodedMode", "plain enums"), types=allowed)
    yield Attack("subclasses", "a context enum member that does not exist",
                 edited(data, lambda p: layout_of(p).update(context={"enum": {"class": f"{__name__}:PlainMode", "name": "TWO"}})),
                 ("signature subclass_state['w'] context", f"{__name__}:PlainMode has no member 'TWO'"), types=allowed)
    yield Attack("subclasses", "a context value outside a flatten context",
                 edited(data, lambda p: p["signature"]["input_leaves"][0].update(is_tensor=False, value={"enum": {
                     "class": f"{__name__}:PlainMode", "name": "ONE"}})),
                 ("signature input_leaves", "is only valid in a tensor subclass's flatten context"), types=allowed)
    yield Attack("subclasses", "a plain input claiming to be a part",
                 edited(data, lambda p: next(s for s in p["signature"]["inputs"] if s["name"] == "x").update(inner="a")),
                 ("signature input x", "its graph inputs are the parts ['a'], its layout's ['']"), types=allowed)
    yield Attack("subclasses", "a layout for a tensor the program does not have",
                 edited(data, lambda p: p["signature"]["subclass_state"].append({"target": "nowhere", "layout": layout_of(p)})),
                 ("signature subclass_state['nowhere']", "names no lifted state of the program"), types=allowed)
    yield Attack("subclasses", "subclasses nested deeper than a file holds", nested_layout(data, 9),
                 ("signature subclass_state['w'].a", "nest more than 8 deep"), types=allowed)
    yield Attack("subclasses", "subclass fields in a file claiming format version 1",
                 zip_of(checksummed(members_of(data), {**json.loads(members_of(data)["manifest.json"]), "version": 1})),
                 ("signature: holds 'subclass_state', which format version 2 introduced",), types=allowed)


ATTACK_CLASSES: dict[str, Callable[[dict[str, bytes], random.Random], Iterator[Attack]]] = {
    "io": io_attacks,
    "unsafe_constructor": unsafe_constructor_attacks,
    "mutable": mutable_attacks,
    "global_state": global_state_attacks,
    "uninitialised": uninitialised_attacks,
    "output_type_lie": output_type_lie_attacks,
    "hop_operand_lie": hop_operand_lie_attacks,
    "duplicate_key": duplicate_key_attacks,
    "compression_bomb": compression_bomb_attacks,
    "registration": registration_attacks,
    "classes": class_attacks,
    "names": name_attacks,
    "function_structure": function_structure_attacks,
    "kernels": kernel_attacks,
    "sizes": size_attacks,
    "call_sites": call_site_attacks,
    "subclasses": subclass_attacks,
    "call_failures": call_failure_attacks,
    "caller_state": caller_state_attacks,
}


def all_attacks(seed: int = 0) -> list[Attack]:
    bases, rng = base_programs(), random.Random(seed)
    return [a for klass in ATTACK_CLASSES.values() for a in klass(bases, rng) if a is not None]


# --------------------------------------------------------------------------- running


def global_registrations() -> tuple:
    """What a load must not change: pytree node types, torch.ops namespaces, custom op names."""
    return (frozenset(pytree.SUPPORTED_NODES), frozenset(vars(torch.ops)), len(torch._C._dispatch_get_all_op_names()))


#: Every path this process opened since `record_opens` (Python's audit hook sees each `open`).
OPENED: list[str] = []


def record_opens() -> None:
    """Record the paths `open` is called with, from now on (an audit hook cannot be removed:
    only the attack subprocess installs it)."""
    def hook(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], str):
            OPENED.append(args[0])

    if not getattr(record_opens, "installed", False):
        sys.addaudithook(hook)
        record_opens.installed = True  # type: ignore[attr-defined]


def run_attack(attack: Attack) -> dict:
    before = global_registrations()
    to_torch = None
    OPENED.clear()
    try:
        loaded = predispatch.load(io.BytesIO(attack.data), types=attack.types)
    except SerializationError as exc:
        outcome, message = "refused", str(exc)
    except BaseException as exc:  # noqa: BLE001 - reported, the test fails on it
        outcome, message = "other", f"{type(exc).__name__}: {exc}"
    else:
        outcome, message = "loaded", ""
        to_torch = None
        if attack.run_after:
            try:  # a kernel that trusts its gradient's shape is checked at the call, before it runs
                with torch.no_grad():
                    loaded.module()(*(attack.args or (torch.randn(4, 3),)))
            except SerializationError as exc:
                outcome, message = "refused", str(exc)
                if attack.klass == "kernels":
                    to_torch = _through_torch(loaded, attack.args)
            except Exception as exc:  # noqa: BLE001 - a file that loads must run or be refused with our error
                outcome, message = "raised at the call", f"{type(exc).__name__}: {exc}"
    changed = global_registrations() != before
    if attack.never_opened is not None and attack.never_opened in OPENED:
        outcome, message = "read a file", f"opened {attack.never_opened}; {message}"
    return {"class": attack.klass, "case": attack.name, "outcome": outcome, "message": message,
            "missing": [e for e in attack.expect if e not in message], "registered": changed, "to_torch": to_torch}


def _through_torch(loaded, args: tuple) -> str:
    """A kernel attack `ep.module()` refused, run through `to_torch()`'s torch module:
    `refused` when the views `to_torch()` puts before the kernel raise (a crash kills the subprocess)."""
    try:
        converted = loaded.to_torch().module()
        with torch.no_grad():
            converted(*args)
    except SerializationError as exc:  # the program's own meta shows the kernel would read outside an argument
        return "refused" if "refused to convert a kernel call" in str(exc) else f"other: {exc}"
    except RuntimeError as exc:  # a view before the kernel
        return "refused" if "is invalid for input of size" in str(exc) else f"other: {exc}"
    return "ran"


BOMB_SIZE = 256 << 20


def write_bomb(path: str, data: bytes, member: str = "manifest.json", size: int = BOMB_SIZE) -> int:
    """A program whose `member` is deflated with `size` bytes of trailing whitespace appended
    (the issue's file), written in chunks so the writer never holds it; returns the file size."""
    members, chunk = members_of(data), b" " * (1 << 20)
    with zipfile.ZipFile(path, "w") as zf:
        for name, body in members.items():
            info = zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0))
            if name != member:
                zf.writestr(info, body)
                continue
            info.compress_type = zipfile.ZIP_DEFLATED
            with zf.open(info, "w", force_zip64=True) as out:
                out.write(body)
                for _ in range(size // len(chunk)):
                    out.write(chunk)
    return os.path.getsize(path)


def measure_load(path: str, warm_up: bytes) -> dict:
    """Peak memory of one load of `path` beyond the process's peak so far (after a warm-up
    load, so that lazy imports and caches do not count): ru_maxrss and tracemalloc's peak."""
    import resource
    import tracemalloc

    predispatch.load(io.BytesIO(warm_up))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    try:
        predispatch.load(path)
        outcome, message = "loaded", ""
    except SerializationError as exc:
        outcome, message = "refused", str(exc)
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"outcome": outcome, "message": message, "file_bytes": os.path.getsize(path),
            "rss_peak_growth_bytes": (after - before) * 1024, "tracemalloc_peak_bytes": traced_peak}


def measure_load_cost(paths: list[str], warm_up: str) -> list[dict]:
    """What `predispatch.load` alone costs for each file, after loading `warm_up` (imports and
    caches do not count): Python function calls (a work count) and the most memory Python
    allocated at once while loading (tracemalloc's peak, an allocation count: not a time, and
    not the process's RSS, which other allocators and freed pages blur)."""
    import tracemalloc

    predispatch.load(warm_up)
    rows = []
    for path in paths:
        _, calls = python_calls(predispatch.load, path)
        tracemalloc.start()
        try:
            loaded = predispatch.load(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        rows.append({"path": path, "bytes": os.path.getsize(path), "calls": calls, "peak": peak,
                     "nodes": len(loaded.graph_module.graph.nodes)})
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--work"]:  # --work WARM_UP_PATH PATH...
        for row in measure_work(sys.argv[3:], sys.argv[2]):
            print(json.dumps(row), flush=True)
        return
    if sys.argv[1:2] == ["--load-cost"]:  # --load-cost WARM_UP_PATH PATH...
        for row in measure_load_cost(sys.argv[3:], sys.argv[2]):
            print(json.dumps(row), flush=True)
        return
    if sys.argv[1:2] == ["--measure"]:  # --measure BOMB_PATH WARM_UP_PATH
        with open(sys.argv[3], "rb") as f:
            print(json.dumps(measure_load(sys.argv[2], f.read())), flush=True)
        return
    record_opens()
    for attack in all_attacks():
        print(json.dumps({"class": attack.klass, "case": attack.name, "outcome": "started"}), flush=True)
        print(json.dumps(run_attack(attack)), flush=True)


if __name__ == "__main__":
    main()
