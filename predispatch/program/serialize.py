"""`save` / `load`: a program as a zip of JSON and safetensors.  No pickle; loading runs no code.

Layout of format version 1 (docs/format.md states the guarantees and the version policy):

    manifest.json          {"format": "predispatch.program", "version": 1,
                            "writer": {"predispatch": "0.1.0", "torch": "2.13.0"},
                            "members": {"program.json": "<sha256>", ...}}
    program.json           the graph modules (subgraphs nested), the signature and pytree
                           specs, the decomposition log, and one record per stored tensor
    state.safetensors      parameters and buffers, by fully qualified name
    constants.safetensors  lifted constant tensors, by fully qualified name
    graph.safetensors      tensors graph modules hold themselves (`_tensor_constant0`), by path

Members are stored uncompressed with a fixed timestamp, so a program always saves to the same
bytes.  `load` reads the manifest, refuses a version it does not know, and checks every
member's SHA-256 before parsing it.

In program.json a value is JSON where JSON is unambiguous (null, true, 3, 0.5, "s", [..]) and a
one-key object tagged by type otherwise: {"node": "add"}, {"tuple": [..]}, {"dict": [[k, v]]},
{"float": "inf"}, {"dtype": "float32"}, {"device": "cpu"}, {"layout": "strided"},
{"memory_format": "channels_last"}, and, in node meta, {"tensor": {shape, stride, ...}}.

Note [What load trusts]
-----------------------
A file may come from a stranger, so nothing in it chooses code to run:
- no pickle anywhere: JSON parses to plain data, tensors come from safetensors;
- a node's target is a name looked up in torch's op registry, only in the namespaces
  `OP_NAMESPACES` (plus those the caller passes), or in the `HIGHER_ORDER_OPS` and
  `PYTHON_CALLABLES` tables; never an import, never `eval`;
- a class named by a pytree spec (dataclass, namedtuple, ModelOutput) is looked up in modules
  the process has already imported, through their `__dict__` (no `__getattr__` hook runs), and
  must be a registered pytree node type (dataclasses are registered, as `export` does).
Running the loaded program calls those ops and those pytree types' (un)flatten functions: code
the user's own process registered, never code from the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import operator
import os
import re
import sys
import tempfile
import zipfile
from collections import defaultdict, namedtuple
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import safetensors.torch
import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch import ops  # noqa: F401 - registers predispatch::keep_history, which graphs call
from predispatch.errors import SerializationError
from predispatch.program.exported_program import ExportedProgram
from predispatch.program.signature import ExportSignature, InputKind, InputSpec, Leaf, OutputKind, OutputSpec
from predispatch.trace.decompose import DecompositionLog, op_name

FORMAT = "predispatch.program"
#: The version `save` writes.
VERSION = 1
#: The versions `load` reads (see docs/format.md for the policy).
READABLE_VERSIONS = (1,)

#: Op namespaces whose OpOverloads any file may call.
OP_NAMESPACES = ("aten", "prims", "predispatch")

#: Higher-order ops a graph may call, by `hop.name()`.  Supporting a new HOP is one entry:
#: its subgraphs are ordinary `get_attr` arguments and its other arguments plain values.
HIGHER_ORDER_OPS: dict[str, Callable[[], torch._ops.HigherOrderOperator]] = {
    "wrap_with_set_grad_enabled": lambda: ti.wrap_with_set_grad_enabled,
    "wrap_with_autocast": lambda: ti.wrap_with_autocast,
}

#: Plain Python callables a graph may call, by `module.name`.
PYTHON_CALLABLES: dict[str, Callable[..., Any]] = {"_operator.getitem": operator.getitem}

_MANIFEST = "manifest.json"
_PROGRAM = "program.json"
#: Tensor members, by the group of tensors each holds.
_TENSOR_MEMBERS = {"state": "state.safetensors", "constants": "constants.safetensors", "graph": "graph.safetensors"}
_MEMBERS = (_MANIFEST, _PROGRAM, *_TENSOR_MEMBERS.values())
_NODE_OPS = ("placeholder", "get_attr", "call_function", "output")
#: Node meta kept besides "val": informational, kept when it is plain data, else left out.
_INFORMATIONAL_META = ("stack_trace", "nn_module_stack", "torch_fn")
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# --------------------------------------------------------------------------- public API


def save(ep: ExportedProgram, f: str | os.PathLike | BinaryIO) -> None:
    """Write `ep` to `f` (a path or a binary file object) in the newest format version.

    Everything is encoded before the first byte is written: a program the format cannot hold
    raises `SerializationError` and leaves no file behind; a path is replaced atomically.
    What is not saved: `live_root`, `hooks` and `state_dict_owner` (live Python objects), so a
    loaded program's `module()` always holds copies of the state.
    """
    members = _encode_program(ep)
    manifest = {"format": FORMAT, "version": VERSION, "writer": _writer(), "members": {n: _digest(d) for n, d in members.items()}}
    _write_zip(f, {_MANIFEST: _json_bytes(manifest), **members})


def load(f: str | os.PathLike | BinaryIO, *, op_namespaces: tuple[str, ...] = ()) -> ExportedProgram:
    """Read a program written by `save`; see Note [What load trusts].

    `op_namespaces`: further op namespaces the graph may call (a library of custom ops you
    trust and have imported).  Any problem with the file raises `SerializationError`, never a
    partial program; only opening a path can raise `OSError`.
    """
    namespaces = (*OP_NAMESPACES, *op_namespaces)
    with open(f, "rb") if isinstance(f, (str, os.PathLike)) else contextlib.nullcontext(f) as file:
        with _reading("the file"):
            members = _read_archive(file)
    return _decode_program(members, namespaces)


# --------------------------------------------------------------------------- the archive


def _writer() -> dict[str, str]:
    import predispatch

    return {"predispatch": predispatch.__version__, "torch": torch.__version__}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _write_zip(f: str | os.PathLike | BinaryIO, members: Mapping[str, bytes]) -> None:
    """Deterministic bytes: stored members, fixed timestamps and attributes, fixed order."""
    if not isinstance(f, (str, os.PathLike)):
        _zip_into(f, members)
        return
    directory = os.path.dirname(os.path.abspath(f))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".predispatch-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            _zip_into(out, members)
        os.replace(tmp, f)
    except BaseException:
        os.unlink(tmp)
        raise


def _zip_into(out: BinaryIO, members: Mapping[str, bytes]) -> None:
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)


def _read_archive(f: BinaryIO) -> dict[str, bytes]:
    """The members, after the version check and every checksum."""
    try:
        archive = zipfile.ZipFile(f)
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as exc:
        raise SerializationError(
            "the file is not a predispatch program: not a zip archive, or truncated.",
            fix="pass a file written by predispatch.save; if it was, it was cut short or damaged.",
        ) from exc
    with archive:
        names = archive.namelist()
        if _MANIFEST not in names:
            raise SerializationError("the file is not a predispatch program: it has no manifest.json.")
        manifest = _check_manifest(archive.read(_MANIFEST))
        return _checked_members(archive, names, manifest)


def _check_manifest(data: bytes) -> dict:
    manifest = _parse_json(data, _MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SerializationError(f"the file is not a predispatch program: its manifest does not name format {FORMAT!r}.")
    version = manifest.get("version")
    if type(version) is not int:
        raise SerializationError(f"manifest.json is corrupted: 'version' is {version!r}, not an integer.")
    if version not in READABLE_VERSIONS:
        import predispatch

        newer = version > max(READABLE_VERSIONS)
        raise SerializationError(
            f"the file has format version {version}; predispatch {predispatch.__version__} reads "
            f"version{'s' if len(READABLE_VERSIONS) > 1 else ''} {', '.join(map(str, READABLE_VERSIONS))}.",
            fix="upgrade predispatch to a release that reads it." if newer
            else "load and save it with a release that reads both versions; see docs/format.md.",
        )
    return manifest


def _checked_members(archive: zipfile.ZipFile, names: list[str], manifest: dict) -> dict[str, bytes]:
    digests = manifest.get("members")
    expected = set(_MEMBERS) - {_MANIFEST}
    if sorted(names) != sorted(_MEMBERS) or not isinstance(digests, dict) or set(digests) != expected:
        raise SerializationError(f"the file is corrupted: its members are {sorted(names)}, expected {sorted(_MEMBERS)}.")
    members = {}
    for name in sorted(expected):
        if archive.getinfo(name).compress_type != zipfile.ZIP_STORED:
            raise SerializationError(f"the file is corrupted: member {name} is compressed; format version 1 stores members as they are.")
        data = archive.read(name)  # zipfile checks the CRC-32 too
        if _digest(data) != digests[name]:
            raise SerializationError(f"the file is corrupted: member {name} does not match its checksum.")
        members[name] = data
    return members


def _parse_json(data: bytes, member: str) -> Any:
    def no_constants(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    try:
        return json.loads(data.decode("utf-8"), parse_constant=no_constants)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SerializationError(f"{member} is corrupted: it is not valid JSON ({exc}).") from exc


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """Turn any failure while decoding `what` into a SerializationError that names it.

    Decoding validates what it reads, but a crafted or damaged file can still trip torch or
    safetensors in ways no check foresees; whatever the failure, the caller gets one error
    type and no program.  (pyo3's PanicException, raised by a Rust panic, is a BaseException.)
    """
    try:
        yield
    except SerializationError:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        raise SerializationError(
            f"{what} is corrupted or not written by predispatch.save: {type(exc).__name__}: {exc}",
            fix="save the program again; a file from elsewhere may be damaged or crafted.",
        ) from exc


# --------------------------------------------------------------------------- values


def _torch_names(kind: type) -> dict[str, Any]:
    """torch's public values of one kind by name (`float32`, `strided`, `channels_last`)."""
    return {name: value for name, value in vars(torch).items() if isinstance(value, kind) and not name.startswith("_")}


def _parse_device(name: str) -> torch.device:
    if not isinstance(name, str) or not re.fullmatch(r"[a-z_]+(:\d{1,4})?", name):
        raise SerializationError(f"{name!r} is not a device name.")
    return torch.device(name)


def _named_value(kind: type) -> tuple[type, Callable[[Any], str], Callable[[str], Any]]:
    names = _torch_names(kind)
    return kind, lambda value: str(value).removeprefix("torch."), lambda name: names[name]


#: torch's enum-like values: tag -> (type, name of a value, value of a name).
_TORCH_VALUES: dict[str, tuple[type, Callable[[Any], str], Callable[[str], Any]]] = {
    "dtype": _named_value(torch.dtype),
    "layout": _named_value(torch.layout),
    "memory_format": _named_value(torch.memory_format),
    "device": (torch.device, str, _parse_device),
}

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _encode(value: Any, where: str, *, classes: bool = False, tensors: bool = False) -> Any:
    """`value` as JSON data (see the module docstring); `classes` and `tensors` allow type
    references (pytree contexts) and tensor metadata (node meta)."""
    if value is None or isinstance(value, (bool, str)) or type(value) is int:
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple, dict)):
        return _encode_container(value, where, classes=classes, tensors=tensors)
    for tag, (kind, name_of, _) in _TORCH_VALUES.items():
        if isinstance(value, kind) and _round_trips(tag, value):
            return {tag: name_of(value)}
    if tensors and isinstance(value, torch.Tensor):
        return {"tensor": _tensor_meta(value, where)}
    if classes and isinstance(value, type):
        return {"class": _class_name(value, where)}
    hint = " Dynamic shapes are not part of format version 1." if isinstance(value, _SYMBOLIC) else ""
    raise SerializationError(f"{where}: a {type(value).__name__} ({_short(value)}) has no encoding in format version 1.{hint}")


def _round_trips(tag: str, value: Any) -> bool:
    """Whether a torch value's name reads back as the value (a dtype torch does not export does not)."""
    _, name_of, value_of = _TORCH_VALUES[tag]
    try:
        return value_of(name_of(value)) == value
    except (KeyError, SerializationError):
        return False


def _encode_container(value: Any, where: str, **allow: bool) -> Any:
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", **allow) for i, v in enumerate(value)]
    if type(value) is tuple:
        return {"tuple": [_encode(v, f"{where}[{i}]", **allow) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, where, **allow), _encode(v, f"{where}[{k!r}]", **allow)] for k, v in value.items()]}
    raise SerializationError(f"{where}: a {type(value).__name__} has no encoding in format version 1 (only plain tuples).")


def _tensor_meta(t: torch.Tensor, where: str) -> dict:
    """A tensor's metadata (node meta "val" is a fake tensor: there is no data to keep)."""
    sizes = (*t.shape, *t.stride(), t.storage_offset())
    if not all(type(s) is int for s in sizes):
        raise SerializationError(f"{where}: a tensor of symbolic shape {tuple(t.shape)}; dynamic shapes are not part of format version 1.")
    if t.layout != torch.strided:
        raise SerializationError(f"{where}: a {t.layout} tensor; format version 1 holds strided tensors only.")
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "dtype": _TORCH_VALUES["dtype"][1](t.dtype),
        "device": str(t.device),
        "requires_grad": t.requires_grad,
    }


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class _Refs:
    """What decoded values may refer to, by where they sit in the file.

    nodes: graph nodes defined so far, by name (in node arguments).
    class_check: which classes a {"class": ...} may name (in pytree contexts); None: none.
    fake_mode: the mode {"tensor": ...} metadata becomes fake tensors in (in node meta).
    """

    nodes: Mapping[str, fx.Node] | None = None
    class_check: Callable[[type], bool] | None = None
    fake_mode: Any = None


_PLAIN = _Refs()


def _decode(data: Any, where: str, refs: _Refs = _PLAIN) -> Any:
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [_decode(v, f"{where}[{i}]", refs) for i, v in enumerate(data)]
    if isinstance(data, dict) and len(data) == 1:
        ((tag, payload),) = data.items()
        decoder = _DECODERS.get(tag)
        if decoder is not None:
            return decoder(payload, where, refs)
    raise SerializationError(f"{where}: {_short(data)} is not a value format version 1 knows.")


def _expect(data: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, kind) or (kind is int and isinstance(data, bool)):
        raise SerializationError(f"{where}: expected {getattr(kind, '__name__', kind)}, found {_short(data)}.")
    return data


def _decode_node_ref(name: Any, where: str, refs: _Refs) -> fx.Node:
    if refs.nodes is None or not isinstance(name, str) or name not in refs.nodes:
        raise SerializationError(f"{where}: refers to node {_short(name)}, which is not defined before it.")
    return refs.nodes[name]


def _decode_float(name: Any, where: str, refs: _Refs) -> float:
    if name not in ("inf", "-inf", "nan"):
        raise SerializationError(f"{where}: {_short(name)} is not a non-finite float.")
    return float(name)


def _decode_dict(pairs: Any, where: str, refs: _Refs) -> dict:
    result = {}
    for pair in _expect(pairs, list, where):
        if not isinstance(pair, list) or len(pair) != 2:
            raise SerializationError(f"{where}: a dict entry is {_short(pair)}, not a [key, value] pair.")
        key = _decode(pair[0], where, refs)
        if not isinstance(key, (str, int, float, bool, type(None), tuple)):
            raise SerializationError(f"{where}: {_short(key)} cannot be a dict key.")
        result[key] = _decode(pair[1], f"{where}[{key!r}]", refs)
    return result


def _decode_class(name: Any, where: str, refs: _Refs) -> type:
    cls = _find_class(_expect(name, str, where), where)
    if refs.class_check is None or not isinstance(cls, type) or not refs.class_check(cls):
        raise SerializationError(f"{where}: {name} is not a class a pytree spec may name here.")
    return cls


def _decode_tensor_meta(meta: Any, where: str, refs: _Refs) -> torch.Tensor:
    """A fake tensor with the saved metadata (node meta), made in the load's fake mode."""
    if refs.fake_mode is None:
        raise SerializationError(f"{where}: tensor metadata is only valid in node meta.")
    meta = _expect(meta, dict, where)
    shape, stride = _ints(meta.get("shape"), where), _ints(meta.get("stride"), where)
    offset = _expect(meta.get("storage_offset"), int, where)
    dtype = _decode_named("dtype", meta.get("dtype"), where)
    device = _parse_device(meta.get("device"))
    if len(shape) != len(stride) or offset < 0:
        raise SerializationError(f"{where}: inconsistent tensor metadata {_short(meta)}.")
    with refs.fake_mode:
        if offset == 0:
            fake = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        else:
            extent = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else offset
            fake = torch.empty(extent, dtype=dtype, device=device).as_strided(shape, stride, offset)
    return fake.requires_grad_(True) if _expect(meta.get("requires_grad"), bool, where) else fake


def _ints(data: Any, where: str) -> list[int]:
    values = _expect(data, list, where)
    if not all(type(v) is int and v >= 0 for v in values):
        raise SerializationError(f"{where}: {_short(data)} is not a list of sizes.")
    return values


def _decode_named(tag: str, name: Any, where: str) -> Any:
    try:
        return _TORCH_VALUES[tag][2](_expect(name, str, where))
    except KeyError:
        raise SerializationError(f"{where}: {_short(name)} is not a torch {tag} this torch has.") from None


_DECODERS: dict[str, Callable[[Any, str, _Refs], Any]] = {
    "node": _decode_node_ref,
    "tuple": lambda items, where, refs: tuple(_decode(_expect(items, list, where), where, refs)),
    "dict": _decode_dict,
    "float": _decode_float,
    "class": _decode_class,
    "tensor": _decode_tensor_meta,
    **{tag: (lambda name, where, refs, tag=tag: _decode_named(tag, name, where)) for tag in _TORCH_VALUES},
}


# --------------------------------------------------------------------------- classes and pytree specs


def _class_name(cls: Any, where: str) -> str:
    """`module:qualname`, the only way a file names a class (namedtuple's node type included)."""
    if cls is namedtuple:
        return "collections:namedtuple"
    name = f"{cls.__module__}:{cls.__qualname__}"
    if "<locals>" in name:
        raise SerializationError(
            f"{where}: {cls.__qualname__} is defined inside a function, so a loading process could not find it.",
            fix="define the class at module level.",
        )
    return name


def _find_class(name: str, where: str) -> Any:
    """The object `module:qualname` names, from an already imported module; never imports.

    Walks `__dict__`s only, so no module or class `__getattr__` hook runs.
    """
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None or not qualname:
        raise SerializationError(
            f"{where}: the program names {qualname or name!r} from module {module_name!r}, which is not imported; "
            "load never imports modules a file names.",
            fix=f"import {module_name} before predispatch.load(...).",
        )
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, "__dict__", {}).get(part)
        if obj is None:
            raise SerializationError(f"{where}: module {module_name!r} has no {qualname!r}.", fix="load with the version of the code that saved it.")
    return obj


#: Classes a pytree context may name, by the node type it belongs to.
_CONTEXT_CLASSES: dict[Any, Callable[[type], bool]] = {
    namedtuple: pytree.is_namedtuple_class,
    defaultdict: lambda cls: cls in (list, dict, set, tuple, int, float, str),
}


def _encode_spec(spec: pytree.TreeSpec, where: str) -> Any:
    if spec.is_leaf():
        return None
    return {
        "type": _class_name(spec.type, where),
        "context": _encode(spec.context, f"{where} context", classes=True),
        "children": [_encode_spec(child, f"{where}[{i}]") for i, child in enumerate(spec.children())],
    }


def _decode_spec(data: Any, where: str) -> pytree.TreeSpec:
    if data is None:
        return pytree.treespec_leaf()
    data = _expect(data, dict, where)
    node_type = _pytree_node_type(_expect(data.get("type"), str, where), where)
    context = _decode(data.get("context"), f"{where} context", _Refs(class_check=_CONTEXT_CLASSES.get(node_type)))
    children = [_decode_spec(c, f"{where}[{i}]") for i, c in enumerate(_expect(data.get("children"), list, where))]
    return pytree.TreeSpec(node_type, context, children)


def _pytree_node_type(name: str, where: str) -> Any:
    """A registered pytree node type; a dataclass is registered as `export` registers it."""
    node_type = _find_class(name, where)
    if node_type in pytree.SUPPORTED_NODES:
        return node_type
    if isinstance(node_type, type) and dataclasses.is_dataclass(node_type):
        pytree.register_dataclass(node_type)
        return node_type
    raise SerializationError(
        f"{where}: {name} is not a pytree node type in this process.",
        fix="register it (torch.utils._pytree.register_pytree_node) before predispatch.load(...).",
    )


# --------------------------------------------------------------------------- tensors

#: dtypes safetensors stores natively; any other is stored as its bytes (uint8).
_SAFETENSORS_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
        "bool", "complex64", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
    )
    if hasattr(torch, name)
)


def _pack(tensors: Mapping[str, torch.Tensor], where: str) -> tuple[bytes, dict[str, dict]]:
    """safetensors bytes of `tensors`, and a record each (layout, Parameter-ness, device)."""
    arrays, records, storages = {}, {}, set()
    for name, tensor in tensors.items():
        record = _tensor_record(tensor, f"{where}[{name!r}]")
        data = tensor.detach().contiguous()  # logical order; the record keeps the stride
        if data.numel() and data.untyped_storage().data_ptr() in storages:
            data = data.clone()  # safetensors refuses tensors that share memory
        storages.add(data.untyped_storage().data_ptr())
        arrays[name] = data if not record["as_bytes"] else data.reshape(-1).view(torch.uint8)
        records[name] = record
    return safetensors.torch.save(arrays), records


def _tensor_record(t: torch.Tensor, where: str) -> dict:
    if type(t) not in (torch.Tensor, nn.Parameter) or t.layout != torch.strided or t.is_quantized or t.is_meta:
        raise SerializationError(
            f"{where}: a {type(t).__name__} ({t.layout}{', meta' if t.is_meta else ''}) cannot be saved; "
            "format version 1 holds dense tensors with data.",
            fix="convert it to a plain dense tensor before export.",
        )
    return {
        "dtype": _TORCH_VALUES["dtype"][1](t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()) if _is_dense(t.shape, t.stride()) else _contiguous_stride(t.shape),
        "device": str(t.device),
        "requires_grad": t.requires_grad,
        "parameter": isinstance(t, nn.Parameter),
        "as_bytes": t.dtype not in _SAFETENSORS_DTYPES,
    }


def _contiguous_stride(shape: Any) -> list[int]:
    stride, step = [], 1
    for size in reversed(list(shape)):
        stride.append(step)
        step *= max(size, 1)
    return stride[::-1]


def _is_dense(shape: Any, stride: Any) -> bool:
    """Whether the elements fill their memory exactly once (any dimension order)."""
    step = 1
    for s, n in sorted((s, n) for n, s in zip(shape, stride) if n != 1):
        if s != step:
            return False
        step *= n
    return True


def _unpack(data: bytes, records: Any, where: str) -> dict[str, torch.Tensor]:
    """The tensors of one member, each in fresh memory with its saved layout and kind."""
    raw = safetensors.torch.load(data)
    records = _expect(records, dict, where)
    if set(raw) != set(records):
        raise SerializationError(f"{where}: the stored tensors {sorted(raw)} do not match the records {sorted(records)}.")
    return {name: _restore(raw[name], _expect(rec, dict, where), f"{where}[{name!r}]") for name, rec in records.items()}


def _restore(raw: torch.Tensor, record: dict, where: str) -> torch.Tensor:
    dtype = _decode_named("dtype", record.get("dtype"), where)
    shape, stride = _ints(record.get("shape"), where), _ints(record.get("stride"), where)
    values = raw.view(dtype) if _expect(record.get("as_bytes"), bool, where) else raw
    if values.dtype != dtype or values.numel() != math.prod(shape) or len(stride) != len(shape) or not _is_dense(shape, stride):
        raise SerializationError(f"{where}: the stored data ({values.dtype}, {values.numel()} elements) does not match its record {_short(record)}.")
    tensor = torch.empty_strided(shape, stride, dtype=dtype).copy_(values.reshape(shape))
    device = _parse_device(record.get("device"))
    if device.type != "cpu":
        tensor = tensor.to(device)
    requires_grad = _expect(record.get("requires_grad"), bool, where)
    if _expect(record.get("parameter"), bool, where):
        return nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


# --------------------------------------------------------------------------- graphs


def _target_name(node: fx.Node, where: str) -> str:
    """The name a node's target is saved under; see Note [What load trusts]."""
    target = node.target
    if node.op != "call_function":
        return target
    if isinstance(target, torch._ops.OpOverload):
        return op_name(target)
    if isinstance(target, torch._ops.HigherOrderOperator) and target.name() in HIGHER_ORDER_OPS:
        if HIGHER_ORDER_OPS[target.name()]() is target:
            return f"higher_order.{target.name()}"
    for name, fn in PYTHON_CALLABLES.items():
        if target is fn:
            return name
    raise SerializationError(
        f"{where}: calls {_short(target)}, which format version 1 cannot name: it holds OpOverloads, "
        f"the higher-order ops {sorted(HIGHER_ORDER_OPS)} and {sorted(PYTHON_CALLABLES)}.",
        fix="if this is a new predispatch HOP, add it to HIGHER_ORDER_OPS in predispatch/program/serialize.py.",
    )


def _resolve_target(name: Any, where: str, namespaces: tuple[str, ...]) -> Any:
    name = _expect(name, str, where)
    if name in PYTHON_CALLABLES:
        return PYTHON_CALLABLES[name]
    parts = name.split(".")
    if len(parts) == 2 and parts[0] == "higher_order" and parts[1] in HIGHER_ORDER_OPS:
        return HIGHER_ORDER_OPS[parts[1]]()
    if len(parts) == 3 and parts[0] in namespaces and all(_IDENTIFIER.match(p) and not p.startswith("__") for p in parts):
        op = _lookup_op(*parts)
        if op is None:
            raise SerializationError(
                f"{where}: calls {name}, which this torch ({torch.__version__}) does not have.",
                fix="load with the torch release that saved the program (see manifest.json); "
                "for a custom op, import the library that defines it first.",
            )
        return op
    raise SerializationError(
        f"{where}: calls {_short(name)}, which a program may not call. Allowed: OpOverloads in "
        f"namespaces {list(namespaces)}, higher-order ops {sorted(HIGHER_ORDER_OPS)}, and {sorted(PYTHON_CALLABLES)}.",
        fix="for custom ops of a library you trust, import it and pass load(..., op_namespaces=('mylib',)).",
    )


def _lookup_op(namespace: str, name: str, overload: str) -> torch._ops.OpOverload | None:
    """The registered overload, or None; reads torch's op registry only."""
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None
    if isinstance(op, torch._ops.OpOverload) and op_name(op) == f"{namespace}.{name}.{overload}":
        return op
    return None


def _check_schema(op: torch._ops.OpOverload, args: tuple, kwargs: dict, where: str) -> None:
    """The saved call binds to this torch's schema of `op` (schemas change between releases)."""
    arguments = op._schema.arguments
    positional = [a.name for a in arguments if not a.kwarg_only]
    given = positional[: len(args)]
    problems = []
    if len(args) > len(positional):
        problems.append(f"{len(args)} positional arguments for {len(positional)}")
    problems += [f"unknown argument {k!r}" for k in kwargs if k not in {a.name for a in arguments}]
    problems += [f"{k!r} given twice" for k in kwargs if k in given]
    problems += [f"missing {a.name!r}" for a in arguments if a.name not in given and a.name not in kwargs and not a.has_default_value()]
    if problems:
        raise SerializationError(
            f"{where}: the saved call does not match this torch's schema {op._schema}: {'; '.join(problems)}.",
            fix="load with the torch release that saved the program (see manifest.json).",
        )


def _encode_module(gm: fx.GraphModule, path: str, tensors: dict[str, torch.Tensor]) -> dict:
    """A graph module and its subgraphs; the tensors it holds go to `tensors` by path."""
    where = f"graph module {path or '<root>'}"
    submodules = []
    for name, child in gm.named_children():
        if not isinstance(child, fx.GraphModule):
            raise SerializationError(f"{where}: submodule {name!r} is a {type(child).__name__}, not a GraphModule.")
        submodules.append({"name": name, "module": _encode_module(child, f"{path}.{name}".lstrip("."), tensors)})
    held = []
    for name, tensor in (*gm._parameters.items(), *gm._buffers.items()):
        if tensor is None:
            continue
        held.append({"name": name, "persistent": name not in gm._non_persistent_buffers_set})
        tensors[f"{path}.{name}".lstrip(".")] = tensor
    for node in gm.graph.find_nodes(op="get_attr"):
        if not _holds(gm, node.target):
            raise SerializationError(f"{where}: get_attr {node.target!r} names neither a subgraph nor a tensor the module holds.")
    nodes = [_encode_node(node, f"{where}, node {node.name}") for node in gm.graph.nodes]
    return {"class_name": type(gm).__name__, "nodes": nodes, "tensors": held, "submodules": submodules}


def _holds(module: nn.Module, target: str) -> bool:
    *path, last = target.split(".")
    for part in path:
        module = module._modules.get(part)
        if module is None:
            return False
    return last in module._modules or last in module._parameters or last in module._buffers


def _encode_node(node: fx.Node, where: str) -> dict:
    if node.op not in _NODE_OPS:
        raise SerializationError(f"{where}: a {node.op} node; programs hold only {list(_NODE_OPS)}.")
    record = {"op": node.op, "name": node.name, "target": _target_name(node, where)}
    if node.args:
        record["args"] = [_encode(a, f"{where} args[{i}]") for i, a in enumerate(node.args)]
    if node.kwargs:
        record["kwargs"] = {k: _encode(v, f"{where} kwargs[{k!r}]") for k, v in node.kwargs.items()}
    meta = _encode_meta(node.meta, where)
    if meta:
        record["meta"] = meta
    return record


def _encode_meta(meta: Mapping[str, Any], where: str) -> dict:
    encoded = {}
    if "val" in meta:
        encoded["val"] = _encode(meta["val"], f"{where} meta['val']", tensors=True)
    for key in _INFORMATIONAL_META:
        if key in meta:
            with contextlib.suppress(SerializationError):
                encoded[key] = _encode(meta[key], key)
    return encoded


@dataclass(frozen=True)
class _Loading:
    """What decoding a program needs besides the JSON: ops allowed, the fake mode for node
    meta, and the tensors graph modules hold (by path)."""

    namespaces: tuple[str, ...]
    fake_mode: Any
    graph_tensors: Mapping[str, torch.Tensor]


def _decode_module(data: Any, path: str, loading: _Loading) -> fx.GraphModule:
    """Subgraphs first, then the tensors held, then the graph; attributes in the saved order."""
    where = f"graph module {path or '<root>'}"
    data = _expect(data, dict, where)
    class_name = _expect(data.get("class_name"), str, where)
    _check_identifier(class_name, where)
    gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name=class_name)
    for entry in _expect(data.get("submodules"), list, where):
        name = _expect(_expect(entry, dict, where).get("name"), str, where)
        _check_identifier(name, where)
        gm.add_module(name, _decode_module(entry.get("module"), f"{path}.{name}".lstrip("."), loading))
    for entry in _expect(data.get("tensors"), list, where):
        _hold_tensor(gm, _expect(entry, dict, where), path, loading, where)
    gm.graph = _decode_graph(data.get("nodes"), gm, where, loading)
    return gm


def _hold_tensor(gm: fx.GraphModule, entry: dict, path: str, loading: _Loading, where: str) -> None:
    name = _expect(entry.get("name"), str, where)
    _check_identifier(name, where)
    tensor = loading.graph_tensors.get(f"{path}.{name}".lstrip("."))
    if tensor is None:
        raise SerializationError(f"{where}: tensor {name!r} is not in graph.safetensors.")
    if isinstance(tensor, nn.Parameter):
        gm.register_parameter(name, tensor)
    else:
        gm.register_buffer(name, tensor, persistent=_expect(entry.get("persistent"), bool, where))


def _check_identifier(name: str, where: str) -> None:
    if not _IDENTIFIER.match(name) or name.startswith("__"):
        raise SerializationError(f"{where}: {_short(name)} is not a valid attribute name.")


def _decode_graph(records: Any, gm: fx.GraphModule, where: str, loading: _Loading) -> fx.Graph:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for i, record in enumerate(_expect(records, list, where)):
        node = _decode_node(graph, _expect(record, dict, where), f"{where}, nodes[{i}]", nodes, loading)
        if node.op == "get_attr" and not _holds(gm, node.target):
            raise SerializationError(f"{where}: get_attr {node.target!r} names nothing the module holds.")
        nodes[node.name] = node
    ops = [node.op for node in graph.nodes]
    placeholders = ops.count("placeholder")
    if ops[:placeholders] != ["placeholder"] * placeholders or ops.count("output") != 1 or ops[-1] != "output":
        raise SerializationError(f"{where}: the graph must be placeholders, then computations, then one output.")
    return graph


def _decode_node(graph: fx.Graph, record: dict, where: str, nodes: dict, loading: _Loading) -> fx.Node:
    op, name = record.get("op"), _expect(record.get("name"), str, where)
    if op not in _NODE_OPS:
        raise SerializationError(f"{where}: node op {_short(op)} is not one of {list(_NODE_OPS)}.")
    where = f"{where} ({name})"
    target = _decode_target(op, record.get("target"), where, loading)
    refs = _Refs(nodes=nodes)
    args = tuple(_decode(a, f"{where} args[{i}]", refs) for i, a in enumerate(_expect(record.get("args", []), list, where)))
    kwargs = {k: _decode(v, f"{where} kwargs[{k!r}]", refs) for k, v in _expect(record.get("kwargs", {}), dict, where).items()}
    for key in kwargs:  # FX writes `key = value` into the code it compiles
        _check_identifier(key, where)
    if isinstance(target, torch._ops.OpOverload):
        _check_schema(target, args, kwargs, where)
    node = graph.create_node(op, target, args, kwargs, name=name)
    if node.name != name or name in nodes:
        raise SerializationError(f"{where}: {name!r} is not a valid, unique node name.")
    node.meta.update(_decode_meta(_expect(record.get("meta", {}), dict, where), where, loading))
    return node


def _decode_target(op: str, target: Any, where: str, loading: _Loading) -> Any:
    if op == "call_function":
        return _resolve_target(target, where, loading.namespaces)
    target = _expect(target, str, where)
    if op == "output" and target != "output":
        raise SerializationError(f"{where}: an output node's target is 'output', not {_short(target)}.")
    for part in target.split(".") if op == "get_attr" else [target] if op == "placeholder" else []:
        _check_identifier(part, where)
    return target


def _decode_meta(meta: dict, where: str, loading: _Loading) -> dict:
    unknown = set(meta) - {"val", *_INFORMATIONAL_META}
    if unknown:
        raise SerializationError(f"{where}: unknown node meta {sorted(unknown)}.")
    decoded = {}
    if "val" in meta:
        decoded["val"] = _decode(meta["val"], f"{where} meta['val']", _Refs(fake_mode=loading.fake_mode))
    for key in _INFORMATIONAL_META:
        if key in meta:
            decoded[key] = _decode(meta[key], f"{where} meta[{key!r}]")
            _check_text(decoded[key], f"{where} meta[{key!r}]")
    return decoded


def _check_text(value: Any, where: str) -> None:
    """Informational strings hold no control characters but newlines and tabs.

    FX can print a node's stack trace as a comment in generated code; a carriage return
    there would end the comment, so a file must not be able to put one in.
    """
    if isinstance(value, str):
        if not all(c.isprintable() or c in "\n\t" for c in value):
            raise SerializationError(f"{where}: text with control characters.")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_text(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, where)


# --------------------------------------------------------------------------- signature


def _encode_signature(sig: ExportSignature) -> dict:
    where = "signature"
    return {
        "inputs": [
            {"kind": s.kind.value, "name": s.name, "target": s.target, "aliases": list(s.aliases), "persistent": s.persistent}
            for s in sig.inputs
        ],
        "outputs": [{"kind": s.kind.value, "name": s.name, "target": s.target} for s in sig.outputs],
        "in_spec": _encode_spec(sig.in_spec, f"{where} in_spec"),
        "out_spec": _encode_spec(sig.out_spec, f"{where} out_spec"),
        "input_leaves": [_encode_leaf(leaf, f"{where} input {leaf.path}") for leaf in sig.input_leaves],
        "output_leaves": [_encode_leaf(leaf, f"{where} output {leaf.path}") for leaf in sig.output_leaves],
        "grad_mode_on_exit": sig.grad_mode_on_exit,
        "arg_names": list(sig.arg_names),
    }


def _encode_leaf(leaf: Leaf, where: str) -> dict:
    return {"path": leaf.path, "is_tensor": leaf.is_tensor, "value": _encode(leaf.value, where)}


def _decode_signature(data: Any) -> ExportSignature:
    where = "signature"
    data = _expect(data, dict, where)
    grad_mode = data.get("grad_mode_on_exit")
    if grad_mode is not None:
        _expect(grad_mode, bool, f"{where} grad_mode_on_exit")
    return ExportSignature(
        tuple(_decode_input(_expect(s, dict, where), where) for s in _expect(data.get("inputs"), list, where)),
        tuple(_decode_output(_expect(s, dict, where), where) for s in _expect(data.get("outputs"), list, where)),
        _decode_spec(data.get("in_spec"), f"{where} in_spec"),
        _decode_spec(data.get("out_spec"), f"{where} out_spec"),
        tuple(_decode_leaf(leaf, f"{where} input_leaves") for leaf in _expect(data.get("input_leaves"), list, where)),
        tuple(_decode_leaf(leaf, f"{where} output_leaves") for leaf in _expect(data.get("output_leaves"), list, where)),
        grad_mode,
        tuple(_expect(n, str, where) for n in _expect(data.get("arg_names"), list, where)),
    )


def _enum(kind: type, value: Any, where: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in kind)
        raise SerializationError(f"{where}: {_short(value)} is not a {kind.__name__} (one of {allowed}).") from None


def _decode_input(data: dict, where: str) -> InputSpec:
    persistent = data.get("persistent")
    if persistent is not None:
        _expect(persistent, bool, where)
    return InputSpec(
        _enum(InputKind, data.get("kind"), where),
        _expect(data.get("name"), str, where),
        _expect(data.get("target"), str, where),
        tuple(_expect(a, str, where) for a in _expect(data.get("aliases"), list, where)),
        persistent,
    )


def _decode_output(data: dict, where: str) -> OutputSpec:
    return OutputSpec(_enum(OutputKind, data.get("kind"), where), _expect(data.get("name"), str, where), _expect(data.get("target"), str, where))


def _decode_leaf(data: Any, where: str) -> Leaf:
    data = _expect(data, dict, where)
    is_tensor = _expect(data.get("is_tensor"), bool, where)
    value = _decode(data.get("value"), where)
    if is_tensor and value is not None:
        raise SerializationError(f"{where}: a tensor leaf with a value.")
    return Leaf(_expect(data.get("path"), str, where), is_tensor, value)


# --------------------------------------------------------------------------- the program


def _encode_program(ep: ExportedProgram) -> dict[str, bytes]:
    """program.json and the tensor members, all in memory."""
    graph_tensors: dict[str, torch.Tensor] = {}
    program = {
        "graph_module": _encode_module(ep.graph_module, "", graph_tensors),
        "signature": _encode_signature(ep.signature),
        "decompositions": {name: {"kept_whole": kept, "why": why} for name, (kept, why) in ep.decompositions.decisions.items()},
    }
    groups = {"state": ep.state_dict, "constants": ep.constants, "graph": graph_tensors}
    packed = {group: _pack(tensors, group) for group, tensors in groups.items()}
    program["tensors"] = {group: records for group, (_, records) in packed.items()}
    return {_PROGRAM: _json_bytes(program), **{_TENSOR_MEMBERS[g]: data for g, (data, _) in packed.items()}}


def _decode_program(members: Mapping[str, bytes], namespaces: tuple[str, ...]) -> ExportedProgram:
    with _reading(_PROGRAM):
        program = _expect(_parse_json(members[_PROGRAM], _PROGRAM), dict, _PROGRAM)
        records = _expect(program.get("tensors"), dict, "tensors")
    tensors = {}
    for group, member in _TENSOR_MEMBERS.items():
        with _reading(member):
            tensors[group] = _unpack(members[member], records.get(group), member)
    with _reading(_PROGRAM):
        loading = _Loading(namespaces, ti.new_fake_mode(), tensors["graph"])
        gm = _decode_module(program.get("graph_module"), "", loading)
        ep = ExportedProgram(
            gm, _decode_signature(program.get("signature")), tensors["state"], tensors["constants"],
            _decode_decompositions(program.get("decompositions")),
        )
        _check_consistent(ep)
    return ep


def _decode_decompositions(data: Any) -> DecompositionLog:
    where = "decompositions"
    log = DecompositionLog()
    for name, entry in _expect(data, dict, where).items():
        entry = _expect(entry, dict, f"{where}[{name!r}]")
        log.decisions[name] = (_expect(entry.get("kept_whole"), bool, where), _expect(entry.get("why"), str, where))
    return log


def _check_consistent(ep: ExportedProgram) -> None:
    """The signature, the graph and the state describe one program (a crafted file may not)."""
    sig, problems = ep.signature, []
    placeholders = [n.name for n in ep.graph.find_nodes(op="placeholder")]
    if placeholders != [s.name for s in sig.inputs]:
        problems.append(f"placeholders {placeholders} differ from the signature's inputs")
    outputs = ep.graph.output_node().args[0] if ep.graph.output_node().args else ()
    if not isinstance(outputs, (tuple, list)) or len(outputs) != len(sig.outputs):
        problems.append("the graph's outputs differ from the signature's outputs")
    state = {s.target for s in sig.inputs_of(InputKind.PARAMETER, InputKind.BUFFER)}
    constants = {s.target for s in sig.inputs_of(InputKind.CONSTANT_TENSOR)}
    if set(ep.state_dict) != state or set(ep.constants) != constants:
        problems.append("the stored tensors differ from the signature's parameters, buffers and constants")
    tensor_leaves = sum(leaf.is_tensor for leaf in sig.input_leaves)
    if sig.in_spec.num_leaves != len(sig.input_leaves) or tensor_leaves != len(sig.inputs_of(InputKind.USER_INPUT)):
        problems.append("the input spec, input leaves and user inputs disagree")
    if sig.out_spec.num_leaves != len(sig.output_leaves) or sum(leaf.is_tensor for leaf in sig.output_leaves) != len(sig.outputs_of(OutputKind.USER_OUTPUT)):
        problems.append("the output spec, output leaves and user outputs disagree")
    if problems:
        raise SerializationError(f"program.json is inconsistent: {'; '.join(problems)}.")
