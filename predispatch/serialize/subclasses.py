"""Tensor subclasses in files (format version 2): layouts as data, subclass state as its parts.

Note [Tensor subclasses in files]
---------------------------------
A program with tensor subclass state (torchao's quantized weights: Note [Tensor subclasses] in
frontend/subclasses.py) computes on the subclasses' plain parts; `ep.state_dict` holds the
subclasses themselves.  A file holds no pickle, so it keeps what the program needs to build
them again, as data:
- each part is a plain tensor in the state (or constants) member, under `target:path`
  (`up.weight:qdata`; a fully qualified name has no `:`), with the usual per-tensor record;
  `program.json`'s `tensors.subclasses` gives each subclass tensor's own `parameter` and
  `requires_grad` (its parts' are the parts' own);
- each layout (`SubclassLayout`: `ExportSignature.subclass_state`, `Leaf.layout`) is
  `{"class": "module:qualname", "context", "inner": [[name, null | layout], ...], "size",
  "stride"}`, its flatten context a value (values.py) that may also hold enum members,
  dataclass and namedtuple instances (torchao's `QuantizeTensorToInt8Kwargs(PerRow(), ...)`);
- `InputSpec.inner` and `OutputSpec.inner` are written where not empty.
Plain programs' files hold none of these fields, only the new version number.

Load reads each layout's class and the classes of its context's objects only when the user
allows them (Note [Classes a file may name] in classes.py): a layout names `Unbuilt` objects
and the state names `StoredParts` until the whole file is verified, the parts checked against
their placeholders like any state tensor (serialize/verify.py: `subclass_problems`).  Only then
does `built` call each context class and `__tensor_unflatten__`, making the `ExportedProgram`
whose `state_dict[target]` is the subclass, a `Parameter` where the file says so.  A program
read for display only (`load_for_display`) builds nothing: its state keeps the `StoredParts`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from predispatch.errors import SerializationError
from predispatch.serialize.classes import FileClasses, built
from predispatch.serialize.values import Refs, class_name, decode, encode, expect, ints, short
from predispatch.signature import Leaf, Program, SubclassLayout

__all__ = [
    "MAX_LAYOUT_DEPTH", "SEPARATOR", "StoredParts", "apart", "build_program", "decode_layout", "decode_wholes",
    "encode_layout", "missing_wholes", "part_of", "together",
]

#: Between a subclass tensor's target and a part's path in a tensor member (`up.weight:qdata`).
SEPARATOR = ":"
#: How deeply subclasses may nest in a file (a subclass whose part is a subclass ...).
MAX_LAYOUT_DEPTH = 8
_LAYOUT_FIELDS = ("class", "context", "inner", "size", "stride")


@dataclasses.dataclass(frozen=True, eq=False)
class StoredParts:
    """A subclass state tensor as a file holds it, before load builds it.

    parts: each plain tensor by its attribute path (`qdata`, `a.scale`).
    parameter, requires_grad: the subclass tensor's own (`tensors.subclasses` in program.json).
    """

    parts: dict[str, torch.Tensor]
    parameter: bool
    requires_grad: bool


def part_of(tensor: Any, inner: str) -> Any:
    """The plain tensor at attribute path `inner` of a subclass tensor or `StoredParts`
    (`tensor` itself for ""); None where there is none."""
    if isinstance(tensor, StoredParts):
        return tensor.parts.get(inner)
    for name in inner.split(".") if inner else ():
        tensor = getattr(tensor, name, None)
    return tensor


# --------------------------------------------------------------------------- layouts


def encode_layout(layout: SubclassLayout, where: str) -> dict:
    """A layout as data (see the Note); its context may hold enum members and dataclasses."""
    return {
        "class": class_name(layout.cls, where),
        "context": encode(layout.context, f"{where} context", objects=True),
        "inner": [[name, None if sub is None else encode_layout(sub, f"{where}.{name}")] for name, sub in layout.inner],
        "size": list(layout.size),
        "stride": list(layout.stride),
    }


def decode_layout(data: Any, where: str, classes: FileClasses, depth: int = 1) -> SubclassLayout:
    """A layout whose class and context objects `classes` allows (refused ones stand in until
    `classes.check()` names them all); its context's objects `Unbuilt`."""
    data = expect(data, dict, where)
    if set(data) != set(_LAYOUT_FIELDS):
        raise SerializationError(f"{where}: a tensor subclass layout has the fields {list(_LAYOUT_FIELDS)}, not {sorted(data)}.")
    if depth > MAX_LAYOUT_DEPTH:
        raise SerializationError(f"{where}: tensor subclasses nest more than {MAX_LAYOUT_DEPTH} deep, the most a file holds.")
    cls = classes.tensor_subclass(expect(data["class"], str, f"{where} class"), where)
    context = decode(data["context"], f"{where} context", Refs(objects=classes.context_value))
    inner = []
    for item in expect(data["inner"], list, f"{where} inner"):
        if not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str):
            raise SerializationError(f"{where} inner: an entry is {short(item)}, not [attribute name, null or layout].")
        name, sub = item
        inner.append((name, None if sub is None else decode_layout(sub, f"{where}.{name}", classes, depth + 1)))
    size, stride = ints(data["size"], f"{where} size"), ints(data["stride"], f"{where} stride")
    return SubclassLayout(cls, context, tuple(inner), tuple(size), tuple(stride))


def _built_layout(layout: SubclassLayout, memo: dict[int, SubclassLayout]) -> SubclassLayout:
    """`layout` with its context's objects built (one layout object per file layout)."""
    if id(layout) not in memo:
        inner = tuple((name, None if sub is None else _built_layout(sub, memo)) for name, sub in layout.inner)
        memo[id(layout)] = SubclassLayout(layout.cls, built(layout.context), inner, layout.size, layout.stride)
    return memo[id(layout)]


# --------------------------------------------------------------------------- state


def apart(tensors: Mapping[str, torch.Tensor], layouts: Mapping[str, SubclassLayout], where: str) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """For `save`: `tensors` with each subclass tensor replaced by its parts (`target:path`),
    and each subclass tensor's record (`parameter`, `requires_grad`) by target."""
    out: dict[str, torch.Tensor] = {}
    wholes: dict[str, dict] = {}
    for name, tensor in tensors.items():
        layout = layouts.get(name)
        if layout is None:
            out[name] = tensor
            continue
        why = layout.mismatch(tensor)
        if why is not None:
            raise SerializationError(
                f"{where}[{name!r}] was a {layout} at export and is {why} now: the program was traced for that layout.",
                fix="save the program with the state it was exported with, or export again.",
            )
        out.update((f"{name}{SEPARATOR}{path}", part) for path, part in zip(layout.paths(), layout.flatten(tensor)))
        wholes[name] = {"parameter": isinstance(tensor, nn.Parameter), "requires_grad": tensor.requires_grad}
    return out, wholes


def together(tensors: Mapping[str, torch.Tensor], wholes: Mapping[str, StoredParts], where: str) -> dict[str, Any]:
    """For `load`: a tensor member's tensors, each `target:path` part gathered into its
    target's `StoredParts` (from `wholes`, which `decode_wholes` made), in the member's order."""
    out: dict[str, Any] = {}
    for name, tensor in tensors.items():
        target, separator, path = name.partition(SEPARATOR)
        whole = wholes.get(target) if separator else None
        if separator and whole is None:
            raise SerializationError(f"{where}[{name!r}]: a part of {target!r}, which tensors.subclasses does not list.")
        if out.setdefault(target, whole if separator else tensor) is not (whole if separator else tensor):
            raise SerializationError(f"{where}: holds both a tensor and parts of a subclass tensor under {target!r}.")
        if whole is not None:
            whole.parts[path] = tensor
    return out


def decode_wholes(data: Any, where: str) -> dict[str, StoredParts]:
    """`tensors.subclasses`: each subclass tensor's `parameter` and `requires_grad` by target."""
    wholes = {}
    for target, record in expect(data, dict, where).items():
        record = expect(record, dict, f"{where}[{target!r}]")
        if set(record) != {"parameter", "requires_grad"}:
            raise SerializationError(f"{where}[{target!r}]: expected the fields ['parameter', 'requires_grad'], found {sorted(record)}.")
        wholes[target] = StoredParts(
            {}, expect(record["parameter"], bool, f"{where}[{target!r}]"), expect(record["requires_grad"], bool, f"{where}[{target!r}]"))
    return wholes


def missing_wholes(wholes: Mapping[str, StoredParts], where: str) -> None:
    """Every subclass tensor `tensors.subclasses` lists has parts in some tensor member."""
    empty = sorted(target for target, whole in wholes.items() if not whole.parts)
    if empty:
        raise SerializationError(f"{where}: lists the subclass tensors {empty}, whose parts no tensor member holds.")


def _built_tensor(stored: StoredParts, layout: SubclassLayout) -> torch.Tensor:
    """The subclass tensor: its class's `__tensor_unflatten__` on the parts, as a `Parameter`
    and requiring grad as the file says."""
    tensor = layout.unflatten(stored.parts[path] for path in layout.paths())
    if stored.parameter:
        return nn.Parameter(tensor, requires_grad=stored.requires_grad)
    return tensor.requires_grad_(True) if stored.requires_grad else tensor


# --------------------------------------------------------------------------- the program


def build_program(ep: Program, make: Callable[..., Any]) -> Any:
    """The verified program `ep` with its layouts' contexts built and its `StoredParts` made
    the subclass tensors they are, as `make(graph_module, signature, state_dict, constants,
    decompositions)`; `ep` itself when it has no tensor subclass."""
    sig = ep.signature
    if not sig.subclass_state and not any(leaf.layout for leaf in (*sig.input_leaves, *sig.output_leaves)):
        return ep
    memo: dict[int, SubclassLayout] = {}
    layouts = {target: _built_layout(layout, memo) for target, layout in sig.subclass_state}
    signature = dataclasses.replace(
        sig,
        subclass_state=tuple(layouts.items()),
        input_leaves=tuple(_built_leaf(leaf, memo) for leaf in sig.input_leaves),
        output_leaves=tuple(_built_leaf(leaf, memo) for leaf in sig.output_leaves),
    )
    state, constants = ({name: _built_tensor(t, layouts[name]) if isinstance(t, StoredParts) else t for name, t in group.items()}
                        for group in (ep.state_dict, ep.constants))
    return make(ep.graph_module, signature, state, constants, ep.decompositions)


def _built_leaf(leaf: Leaf, memo: dict[int, SubclassLayout]) -> Leaf:
    return leaf if leaf.layout is None else dataclasses.replace(leaf, layout=_built_layout(leaf.layout, memo))

