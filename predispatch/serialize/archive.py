"""`save` / `load`: a program as a zip of JSON and safetensors.  No pickle; loading runs no code.

Layout of format version 2 (docs/format.md states the guarantees and the version policy):

    manifest.json          {"format": "predispatch.program", "version": 2,
                            "writer": {"predispatch": "0.1.0", "torch": "2.13.0"},
                            "members": {"program.json": "<sha256>", ...},
                            "sizes": {"program.json": <bytes>, ...}}     (optional)
    program.json           {"graph_module": ..., "signature": ..., "decompositions": ...,
                            "tensors": {"state": {name: record}, "constants": ..., "graph": ...,
                                        "subclasses": {target: record}}}    (only with subclasses)
    state.safetensors      parameters and buffers, by fully qualified name; a tensor subclass's
                           parts by `target:path` (Note [Tensor subclasses in files] in subclasses.py)
    constants.safetensors  lifted constant tensors, by fully qualified name
    graph.safetensors      tensors graph modules hold themselves (`_tensor_constant0`), by path

Version 2 added tensor subclasses (`inner`, `layout`, `subclass_state`, `tensors.subclasses`,
the context values of values.py's `_encode_object`); a version 1 file reads as before, and one
claiming version 1 that holds any of them is refused (`_check_version_fields`).

Members are stored uncompressed with a fixed timestamp, so a program always saves to the same
bytes.  `load` checks the archive's layout and sizes before reading a byte (Note [Bounded
reading]), reads the manifest, refuses a version it does not read, checks every member's
SHA-256 before parsing it, and verifies the decoded program against the IR contract
(`verify.py`) before it registers anything or returns.  Graphs are encoded by
`graph.py`, values, pytree specs and tensors by `values.py`.

Note [What load trusts]
-----------------------
A file may come from a stranger, so nothing in it chooses code to run:
- no pickle anywhere: JSON parses to plain data, tensors come from safetensors;
- a node's target is a name looked up in torch's op registry, only in the namespaces
  `OP_NAMESPACES` (plus those the caller passes), or in the `HIGHER_ORDER_OPS` and
  `PYTHON_CALLABLES` tables; never an import, never `eval`;
- a class named by a pytree spec (dataclass, namedtuple, ModelOutput) is built only when the
  user chose it: passed in `types=`, registered as a pytree node by the user's code or a library
  they imported, or a plain namedtuple (Note [Classes a file may name] in classes.py); it is
  looked up in modules the process has already imported, never imported;
- FX compiles the graph it is given into Python, so every name that reaches that code (node
  names, placeholder and attribute targets, keyword names) must be an identifier, and text
  FX may print as a comment (stack traces) holds no carriage return.
Running the loaded program calls those ops and those pytree types' (un)flatten functions: code
the user's own process registered, never code from the file.  Which of torch's ops a program
may call at all is the verifier's allow list (`op_allowlist.py`): no I/O, no global state, no
mutation, no op that trusts sizes or indices it does not check; see docs/format.md's threat model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import secrets
import zipfile
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO, TypeVar

import torch
from torch import nn

from predispatch import _torch_internals as ti
from predispatch._version import __version__
from predispatch.errors import SerializationError
from predispatch.serialize.classes import FileClasses, decode_spec
from predispatch.serialize.graph import (
    HIGHER_ORDER_OPS,
    OP_NAMESPACES,
    PYTHON_CALLABLES,
    GraphLoading,
    decode_program_module,
    encode_module,
)
from predispatch.serialize.shapes import SymbolTable, unbacked_declarations
from predispatch.serialize.subclasses import (
    apart,
    build_program,
    decode_layout,
    decode_wholes,
    encode_layout,
    missing_wholes,
    together,
)
from predispatch.serialize.values import (
    decode,
    encode,
    encode_spec,
    expect,
    pack,
    short,
    unpack,
)
from predispatch.serialize.verify import custom_namespaces, verify_program
from predispatch.signature import (
    ExportSignature,
    InputKind,
    InputSpec,
    Leaf,
    OutputKind,
    OutputSpec,
    Program,
    ShapeRecord,
    StatePlacement,
)
from predispatch.trace.decompose import DecompositionLog

__all__ = ["FORMAT", "HIGHER_ORDER_OPS", "OP_NAMESPACES", "PYTHON_CALLABLES", "READABLE_VERSIONS", "VERSION", "load", "save"]

FORMAT = "predispatch.program"
#: What `load` builds (predispatch.load passes `ExportedProgram`).
P = TypeVar("P", bound=Program)

#: The version `save` writes.
VERSION = 2
#: The versions `load` reads (see docs/format.md for the policy).
READABLE_VERSIONS = (1, 2)
#: What version 2 added, where (a file claiming version 1 that holds one is refused).
VERSION_2_FIELDS = {"signature": ("subclass_state",), "inputs": ("inner",), "outputs": ("inner",),
                    "input_leaves": ("layout",), "output_leaves": ("layout",), "tensors": ("subclasses",)}

_MANIFEST = "manifest.json"
_PROGRAM = "program.json"
#: Tensor members, by the group of tensors each holds.
_TENSOR_MEMBERS = {"state": "state.safetensors", "constants": "constants.safetensors", "graph": "graph.safetensors"}
_MEMBERS = (_MANIFEST, _PROGRAM, *_TENSOR_MEMBERS.values())
_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


# --------------------------------------------------------------------------- public API


def save(ep: Program, f: str | os.PathLike | BinaryIO) -> None:
    """Write `ep` to `f` (a path or a binary file object) in the newest format version.

    Everything is verified (the contract `load` checks) and encoded before the first byte is
    written: a program the format cannot hold raises `SerializationError` and leaves no file
    behind; a path is replaced atomically.
    What is not saved: `live_root`, `hooks` and `state_dict_owner` (live Python objects), so a
    loaded program's `module()` always holds copies of the state.
    """
    members = _encode_program(ep)  # first: its refusals (dynamic shapes, unnamed targets) are the more precise
    verify_program(ep, op_namespaces=custom_namespaces(ep.graph_module), stored=True, context=f"format version {VERSION} cannot hold this program: ")
    manifest = {
        "format": FORMAT, "version": VERSION, "writer": _writer(), "members": {n: _digest(d) for n, d in members.items()},
        "sizes": {n: len(d) for n, d in members.items()},  # checked before a member is read
    }
    _write_zip(f, {_MANIFEST: _json_bytes(manifest), **members})


def load(f: str | os.PathLike | BinaryIO, make: Callable[..., P], *, op_namespaces: tuple[str, ...] = (),
         classes: FileClasses | None = None) -> P:
    """Read a program written by `save` (see Note [What load trusts]) as `make(graph_module,
    signature, state_dict, constants, decompositions)`: `predispatch.load` (predispatch/_files.py)
    passes `ExportedProgram`, which the format does not import (predispatch/signature.py's `Program`).

    `op_namespaces`: further op namespaces the graph may call (a library of custom ops you
    trust and have imported).  `classes`: which classes the file's pytree specs may make
    (default: pytree's containers, registered node types and plain namedtuples); the allowed
    ones it registers once the file is verified.  Any problem with the file raises
    `SerializationError`, never a partial program; only opening a path can raise `OSError`.
    """
    namespaces = (*OP_NAMESPACES, *op_namespaces)
    classes = classes if classes is not None else FileClasses()
    with open(f, "rb") if isinstance(f, (str, os.PathLike)) else contextlib.nullcontext(f) as file:
        with _reading("the file"):
            members, version = _read_archive(file)
    return _decode_program(members, version, namespaces, make, classes)


# --------------------------------------------------------------------------- the archive


def _writer() -> dict[str, str]:
    return {"predispatch": __version__, "torch": torch.__version__}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def _write_zip(f: str | os.PathLike | BinaryIO, members: Mapping[str, bytes]) -> None:
    """Deterministic bytes: stored members, fixed timestamps and attributes, fixed order."""
    if not isinstance(f, (str, os.PathLike)):
        _zip_into(f, members)
        return
    path = os.path.abspath(f)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "xb") as out:  # the umask's permissions, unlike mkstemp's 0600
            _zip_into(out, members)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _zip_into(out: BinaryIO, members: Mapping[str, bytes]) -> None:
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)


def _read_archive(f: BinaryIO) -> tuple[dict[str, bytes], int]:
    """The members and the format version, after the layout and size checks, the version check
    and every checksum.

    See Note [Bounded reading]: nothing is inflated, and no member is read before its name,
    storage method and size have been checked against the format and the file's length.
    """
    try:
        archive = zipfile.ZipFile(f)
        length = f.seek(0, os.SEEK_END)
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as exc:
        raise SerializationError(
            "the file is not a predispatch program: not a zip archive, or truncated.",
            fix="pass a file written by predispatch.save; if it was, it was cut short or damaged.",
        ) from exc
    with archive:
        infos = archive.infolist()
        if _MANIFEST not in [i.filename for i in infos]:
            raise SerializationError("the file is not a predispatch program: it has no manifest.json.")
        _check_layout(infos, length)
        manifest = _check_manifest(archive.read(_MANIFEST))
        return _checked_members(archive, manifest), manifest["version"]


#: The most bytes a member may hold, besides the file's own length (tensor members: only that).
MEMBER_LIMITS = {_MANIFEST: 64 * 1024, _PROGRAM: 256 * 1024 * 1024}


def _check_layout(infos: list[zipfile.ZipInfo], length: int) -> None:
    """Note [Bounded reading]
    ------------------------
    A zip's central directory states each member's method and sizes; `zipfile` would inflate
    whatever it is told to.  Before any member is read: the names are exactly the format's
    members (each once), each is stored (the file format compresses nothing, so there is
    nothing to inflate), its stated size equals its stored size and fits in the file and in
    `MEMBER_LIMITS` (the manifest is small).  Reading then costs at most the file's length.
    """
    names = [i.filename for i in infos]
    if sorted(names) != sorted(_MEMBERS):
        raise SerializationError(f"the file is corrupted: its members are {short(sorted(names))}, expected {sorted(_MEMBERS)}.")
    for info in infos:
        member = f"member {info.filename}"
        if info.compress_type != zipfile.ZIP_STORED:
            raise SerializationError(
                f"the file is corrupted: {member} is compressed (method {info.compress_type}); "
                "the file format stores members as they are, so load inflates nothing."
            )
        limit = min(length, MEMBER_LIMITS.get(info.filename, length))
        if info.file_size != info.compress_size or info.file_size > limit or info.header_offset + info.compress_size > length:
            raise SerializationError(
                f"the file is corrupted: {member} says it holds {info.file_size} bytes "
                f"({info.compress_size} stored) in a file of {length}; the limit is {limit}."
            )


def _check_manifest(data: bytes) -> dict:
    manifest = _parse_json(data, _MANIFEST)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise SerializationError(f"the file is not a predispatch program: its manifest does not name format {FORMAT!r}.")
    version = manifest.get("version")
    if type(version) is not int:
        raise SerializationError(f"manifest.json is corrupted: 'version' is {version!r}, not an integer.")
    if version not in READABLE_VERSIONS:
        newer = version > max(READABLE_VERSIONS)
        raise SerializationError(
            f"the file has format version {version}; predispatch {__version__} reads "
            f"version{'s' if len(READABLE_VERSIONS) > 1 else ''} {', '.join(map(str, READABLE_VERSIONS))}.",
            fix="upgrade predispatch to a release that reads it." if newer
            else "load and save it with a release that reads both versions; see docs/format.md.",
        )
    return manifest


def _checked_members(archive: zipfile.ZipFile, manifest: dict) -> dict[str, bytes]:
    digests = manifest.get("members")
    expected = set(_MEMBERS) - {_MANIFEST}
    if not isinstance(digests, dict) or set(digests) != expected:
        raise SerializationError(f"manifest.json is corrupted: it lists members {short(digests)}, expected {sorted(expected)}.")
    sizes = manifest.get("sizes")  # optional in version 1: files of the first writers lack it
    if sizes is None and manifest["version"] >= 2:
        raise SerializationError("manifest.json is corrupted: format version 2 lists every member's size ('sizes'); it has none.")
    if sizes is not None and sizes != {name: archive.getinfo(name).file_size for name in expected}:
        raise SerializationError(f"the file is corrupted: its members' sizes differ from the manifest's {short(sizes)}.")
    members = {}
    for name in sorted(expected):
        data = archive.read(name)  # stored and size-checked (_check_layout); zipfile checks the CRC-32 too
        if _digest(data) != digests[name]:
            raise SerializationError(f"the file is corrupted: member {name} does not match its checksum.")
        members[name] = data
    return members


#: JSON integers a file may hold: what an int64 (or a uint64 size) can be.
_INT_RANGE = (-(2**63), 2**64 - 1)


def _parse_json(data: bytes, member: str) -> Any:
    """Strict JSON: no duplicated keys, no NaN or Infinity, integers in the int64/uint64 range."""

    def no_constants(token: str) -> Any:
        raise ValueError(f"{token} is not JSON")

    def unique_keys(pairs: list[tuple[str, Any]]) -> dict:
        result = dict(pairs)
        if len(result) != len(pairs):
            seen: set[str] = set()
            duplicated = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise ValueError(f"the key {duplicated!r} appears twice in one object")
        return result

    def bounded_int(text: str) -> int:
        value = int(text)
        if not _INT_RANGE[0] <= value <= _INT_RANGE[1]:
            raise ValueError(f"the integer {text[:30]} is out of range")
        return value

    def finite_float(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"the number {text[:30]} is out of range")
        return value

    try:
        return json.loads(
            data.decode("utf-8"), parse_constant=no_constants, object_pairs_hook=unique_keys,
            parse_int=bounded_int, parse_float=finite_float,
        )
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SerializationError(f"{member} is corrupted: it is not valid JSON ({exc}).") from exc


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """Turn any failure while decoding `what` into a SerializationError that names it.

    Decoding validates what it reads, but a crafted or damaged file can still trip torch or
    safetensors in ways no check foresees; whatever the failure, the caller gets one error
    type and no program.  A Rust panic inside safetensors arrives as pyo3's PanicException,
    a BaseException; other BaseExceptions (KeyboardInterrupt, ...) pass through.
    """
    try:
        yield
    except SerializationError:
        raise
    except BaseException as exc:  # noqa: BLE001 - see the docstring
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        raise SerializationError(
            f"{what} is corrupted or not written by predispatch.save: {type(exc).__name__}: {exc}",
            fix="save the program again; a file from elsewhere may be damaged or crafted.",
        ) from exc


# --------------------------------------------------------------------------- signature


def _encode_signature(sig: ExportSignature) -> dict:
    where = "signature"
    encoded = {
        "inputs": [
            {"kind": s.kind.value, "name": s.name, "target": s.target, "aliases": list(s.aliases), "persistent": s.persistent,
             **_inner(s.inner)}
            for s in sig.inputs
        ],
        "outputs": [{"kind": s.kind.value, "name": s.name, "target": s.target, **_inner(s.inner)} for s in sig.outputs],
        "in_spec": encode_spec(sig.in_spec, f"{where} in_spec"),
        "out_spec": encode_spec(sig.out_spec, f"{where} out_spec"),
        "input_leaves": [_encode_leaf(leaf, f"{where} input {leaf.path}") for leaf in sig.input_leaves],
        "output_leaves": [_encode_leaf(leaf, f"{where} output {leaf.path}") for leaf in sig.output_leaves],
        "grad_mode_on_exit": sig.grad_mode_on_exit,
        "arg_names": list(sig.arg_names),
        "shapes": _encode_shapes(sig.shapes),
        "training_flags": [[path, flag] for path, flag in sig.training_flags],
        "outside_tree": list(sig.outside_tree),
        "state_order": list(sig.state_order),
        "placements": [_encode_placement(p) for p in sig.placements],
    }
    if sig.subclass_state:  # version 2; plain programs' files keep their bytes
        encoded["subclass_state"] = [
            {"target": target, "layout": encode_layout(layout, f"{where} subclass_state[{target!r}]")}
            for target, layout in sig.subclass_state
        ]
    return encoded


def _inner(inner: str) -> dict:
    """A spec's `inner` (version 2), written only for a part of a tensor subclass."""
    return {"inner": inner} if inner else {}


def _encode_placement(placement: StatePlacement) -> dict:
    """Every field as plain JSON (strings, ints and lists of them)."""
    return {f.name: _plain(getattr(placement, f.name)) for f in dataclasses.fields(placement)}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _decode_placement(data: Any, where: str) -> StatePlacement:
    """A `StatePlacement` whose every field has the type the record documents."""
    data = expect(data, dict, where)
    fields = {f.name: f for f in dataclasses.fields(StatePlacement)}
    if set(data) != set(fields):
        raise SerializationError(f"{where}: expected the fields {sorted(fields)}, found {sorted(data)}.")
    values = {}
    for name, value in data.items():
        if name in ("target", "device_type"):
            values[name] = expect(value, str, f"{where}.{name}")
        else:
            item = str if name in ("placements", "mesh_dim_names") else int
            values[name] = tuple(expect(v, item, f"{where}.{name}") for v in expect(value, list, f"{where}.{name}"))
    return StatePlacement(**values)


def _encode_leaf(leaf: Leaf, where: str) -> dict:
    if isinstance(leaf.value, nn.Module):
        raise SerializationError(
            f"{where}: the argument is a module ({type(leaf.value).__name__}); a file cannot hold a live module.",
            fix="export a module that owns it as a submodule, so its state is saved by name.",
        )
    encoded = {"path": leaf.path, "is_tensor": leaf.is_tensor, "value": encode(leaf.value, where)}
    if leaf.layout is not None:  # version 2
        encoded["layout"] = encode_layout(leaf.layout, f"{where} layout")
    return encoded


def _encode_shapes(shapes: ShapeRecord) -> dict:
    """Every field as plain data (for a static program: the input sizes)."""
    return {f.name: encode(getattr(shapes, f.name), f"signature shapes.{f.name}") for f in dataclasses.fields(shapes)}


def _decode_shapes(data: Any, where: str) -> ShapeRecord:
    data = expect(data, dict, where)
    known = {f.name for f in dataclasses.fields(ShapeRecord)}
    if not set(data) <= known:
        raise SerializationError(f"{where}: unknown fields {sorted(set(data) - known)}.")
    shapes = ShapeRecord(**{name: _deep_tuple(decode(value, f"{where}.{name}")) for name, value in data.items()})
    _check_shape_types(shapes, where)
    return shapes


def _check_shape_types(shapes: ShapeRecord, where: str) -> None:
    """Each field holds what ShapeRecord documents (the expressions are checked by SymbolTable)."""
    ok = all(isinstance(dims, tuple) and all(type(d) in (int, str) for d in dims) for dims in shapes.input_shapes)
    ok = ok and all(isinstance(r, tuple) and len(r) == 3 and type(r[0]) is str and type(r[1]) is int
                    and (r[2] is None or type(r[2]) is int) for r in shapes.ranges)
    ok = ok and all(type(g) is str for g in shapes.guards)
    ok = ok and all(isinstance(o, tuple) and len(o) == 2 and all(type(x) is str for x in o) for o in shapes.origins)
    symbols = {r[0] for r in shapes.ranges} if ok else set()
    ok = ok and all(isinstance(n, tuple) and len(n) == 2 and n[0] in symbols and _is_dim_name(n[1])
                    for n in shapes.names)
    if not ok:
        raise SerializationError(f"{where}: malformed shape record.")


def _is_dim_name(name: object) -> bool:
    """A `Dim` name as torch.export takes it: an identifier (it reaches ONNX files and printing)."""
    return type(name) is str and name.isidentifier() and len(name) <= 200


def _deep_tuple(value: Any) -> Any:
    return tuple(map(_deep_tuple, value)) if isinstance(value, (list, tuple)) else value


def _check_version_fields(signature: Any, tensors: Any, version: int) -> None:
    """A file claiming version 1 holds none of the fields version 2 added (`VERSION_2_FIELDS`)."""
    if version >= 2 or not isinstance(signature, dict):
        return
    places: dict[str, list] = {"signature": [signature], "tensors": [tensors]}
    for key in VERSION_2_FIELDS.keys() - places.keys():
        records = signature.get(key)
        places[key] = records if isinstance(records, list) else []
    for key, fields in VERSION_2_FIELDS.items():
        for record in places[key]:
            found = [f for f in fields if isinstance(record, dict) and f in record]
            if found:
                raise SerializationError(
                    f"{key}: holds {found[0]!r}, which format version 2 introduced, in a file whose manifest says version 1.",
                    fix="save the program again; a file edited by hand or by another tool may be damaged or crafted.",
                )


def _decode_signature(data: Any, classes: FileClasses) -> ExportSignature:
    where = "signature"
    data = expect(data, dict, where)
    grad_mode = data.get("grad_mode_on_exit")
    if grad_mode is not None:
        expect(grad_mode, bool, f"{where} grad_mode_on_exit")
    return ExportSignature(
        tuple(_decode_input(expect(s, dict, where), where) for s in expect(data.get("inputs"), list, where)),
        tuple(_decode_output(expect(s, dict, where), where) for s in expect(data.get("outputs"), list, where)),
        decode_spec(data.get("in_spec"), f"{where} in_spec", classes),
        decode_spec(data.get("out_spec"), f"{where} out_spec", classes),
        tuple(_decode_leaf(leaf, f"{where} input_leaves", classes) for leaf in expect(data.get("input_leaves"), list, where)),
        tuple(_decode_leaf(leaf, f"{where} output_leaves", classes) for leaf in expect(data.get("output_leaves"), list, where)),
        grad_mode,
        tuple(expect(n, str, where) for n in expect(data.get("arg_names"), list, where)),
        _decode_shapes(data.get("shapes"), f"{where} shapes"),
        _decode_training_flags(data.get("training_flags", []), f"{where} training_flags"),
        tuple(expect(p, str, where) for p in expect(data.get("outside_tree", []), list, where)),  # absent before the field
        tuple(expect(n, str, where) for n in expect(data.get("state_order", []), list, where)),  # absent before the field
        tuple(_decode_placement(p, f"{where} placements") for p in expect(data.get("placements", []), list, where)),
        _decode_subclass_state(data.get("subclass_state", []), f"{where} subclass_state", classes),  # version 2
    )


def _decode_subclass_state(data: Any, where: str, classes: FileClasses) -> tuple:
    """`[{"target", "layout"}, ...]`: each subclass state tensor's layout."""
    entries = []
    for entry in expect(data, list, where):
        entry = expect(entry, dict, where)
        if set(entry) != {"target", "layout"}:
            raise SerializationError(f"{where}: an entry has the fields ['layout', 'target'], not {sorted(entry)}.")
        target = expect(entry["target"], str, where)
        entries.append((target, decode_layout(entry["layout"], f"{where}[{target!r}]", classes)))
    return tuple(entries)




def _decode_training_flags(data: Any, where: str) -> tuple[tuple[str, bool], ...]:
    """`[[path, flag], ...]`; absent in files saved before the field existed (read as unknown: ())."""
    pairs = [expect(pair, list, where) for pair in expect(data, list, where)]
    if any(len(pair) != 2 for pair in pairs):
        raise SerializationError(f"{where}: each entry must be [module path, training flag].")
    return tuple((expect(path, str, where), expect(flag, bool, where)) for path, flag in pairs)


def _enum(kind: type, value: Any, where: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(k.value) for k in kind)
        raise SerializationError(f"{where}: {short(value)} is not a {kind.__name__} (one of {allowed}).") from None


def _decode_input(data: dict, where: str) -> InputSpec:
    persistent = data.get("persistent")
    if persistent is not None:
        expect(persistent, bool, where)
    return InputSpec(
        _enum(InputKind, data.get("kind"), where),
        expect(data.get("name"), str, where),
        expect(data.get("target"), str, where),
        tuple(expect(a, str, where) for a in expect(data.get("aliases"), list, where)),
        persistent,
        expect(data.get("inner", ""), str, where),  # version 2
    )


def _decode_output(data: dict, where: str) -> OutputSpec:
    return OutputSpec(
        _enum(OutputKind, data.get("kind"), where), expect(data.get("name"), str, where), expect(data.get("target"), str, where),
        expect(data.get("inner", ""), str, where),  # version 2
    )


def _decode_leaf(data: Any, where: str, classes: FileClasses) -> Leaf:
    data = expect(data, dict, where)
    is_tensor = expect(data.get("is_tensor"), bool, where)
    value = decode(data.get("value"), where)
    if is_tensor and value is not None:
        raise SerializationError(f"{where}: a tensor leaf with a value.")
    path = expect(data.get("path"), str, where)
    layout = None if data.get("layout") is None else decode_layout(data["layout"], f"{where} {path} layout", classes)  # version 2
    if layout is not None and not is_tensor:
        raise SerializationError(f"{where} {path}: a constant leaf with a tensor subclass layout.")
    return Leaf(path, is_tensor, value, layout)


# --------------------------------------------------------------------------- the program


def _encode_program(ep: Program) -> dict[str, bytes]:
    """program.json and the tensor members, all in memory."""
    graph_tensors: dict[str, torch.Tensor] = {}
    program: dict[str, Any] = {
        "graph_module": encode_module(ep.graph_module, "", graph_tensors),
        "signature": _encode_signature(ep.signature),
        "decompositions": {name: {"kept_whole": kept, "why": why} for name, (kept, why) in ep.decompositions.decisions.items()},
    }
    layouts = dict(ep.signature.subclass_state)
    (state, wholes), (constants, constant_wholes) = (apart(group, layouts, name) for name, group in (
        ("state_dict", ep.state_dict), ("constants", ep.constants)))
    groups = {"state": state, "constants": constants, "graph": graph_tensors}
    packed = {group: pack(tensors, group) for group, tensors in groups.items()}
    program["tensors"] = {group: records for group, (_, records) in packed.items()}
    if wholes or constant_wholes:  # version 2: only files with tensor subclasses have it
        program["tensors"]["subclasses"] = {**wholes, **constant_wholes}
    unbacked = unbacked_declarations(ep.graph_module)
    if unbacked:  # only files with unbacked values (a while_loop's int carry) have it: others keep their bytes
        program["unbacked_symbols"] = unbacked
    return {_PROGRAM: _json_bytes(program), **{_TENSOR_MEMBERS[g]: data for g, (data, _) in packed.items()}}


def _decode_program(
    members: dict[str, bytes], version: int, namespaces: tuple[str, ...], make: Callable[..., P], classes: FileClasses
) -> P:
    """The program of `members`, which it empties as it reads them.

    Note [Load memory]
    ------------------
    Loading costs time and memory linear in the file's size (docs/format.md states the bounds
    per byte; tests/test_load_cost.py measures them).  The peak comes last, when FX compiles
    the graph's code (Python's compiler holds ~6 KB a node) with the graph and its fake tensors
    alive; so each input is dropped once read: a member's bytes once parsed or unpacked, each
    stored tensor once restored (values.py's `unpack`), and the program's JSON tree of the
    graph (~6 bytes a byte of file) before the compile.  On a 0.9 MB file the peak Python
    memory went from 25 to 19 bytes a byte of file; files with weights no longer hold their
    bytes beside the tensors made of them.
    """
    with _reading(_PROGRAM):
        program = expect(_parse_json(members.pop(_PROGRAM), _PROGRAM), dict, _PROGRAM)
        records = expect(program.get("tensors"), dict, "tensors")
        _check_version_fields(program.get("signature"), records, version)
        wholes = decode_wholes(records.get("subclasses", {}), "tensors.subclasses")
    tensors = {}
    for group, member in _TENSOR_MEMBERS.items():
        with _reading(member):
            tensors[group] = unpack(members.pop(member), records.get(group), member)
            if group != "graph":  # a tensor subclass's parts, gathered (Note [Tensor subclasses in files])
                tensors[group] = together(tensors[group], wholes, member)
    with _reading(_PROGRAM):
        missing_wholes(wholes, "tensors.subclasses")
        signature = _decode_signature(program.get("signature"), classes)  # first: it declares the size symbols
        classes.check()  # every class the file names that the user did not allow, in one message
        fake_mode = ti.new_fake_mode()
        symbols = SymbolTable(fake_mode, signature.shapes, "signature shapes", program.get("unbacked_symbols", []))
        loading = GraphLoading(namespaces, fake_mode, tensors["graph"], symbols)
        gm = decode_program_module(program.pop("graph_module", None), loading)  # the JSON tree dies before FX compiles
        ep = make(
            gm, signature, tensors["state"], tensors["constants"],
            _decode_decompositions(program.get("decompositions")),
        )
        verify_program(ep, op_namespaces=namespaces, stored=True, context="the program breaks the IR contract (docs/ir.md): ")
        if not classes.display:  # tensor subclasses built once the whole file is verified (subclasses.py)
            ep = build_program(ep, make)
    classes.register()  # the first global change, once the whole file is verified
    return ep


def _decode_decompositions(data: Any) -> DecompositionLog:
    where = "decompositions"
    log = DecompositionLog()
    for name, entry in expect(data, dict, where).items():
        entry = expect(entry, dict, f"{where}[{name!r}]")
        log.decisions[name] = (expect(entry.get("kept_whole"), bool, where), expect(entry.get("why"), str, where))
    return log
