"""Values, pytree specs and tensors as data: the leaves of predispatch's file format.

A value is JSON where JSON is unambiguous (null, true, 3, 0.5, "s", [..]) and a one-key
object tagged by type otherwise:

    {"node": "add"}  {"tuple": [..]}  {"dict": [[k, v], ..]}  {"float": "inf"}
    {"dtype": "float32"}  {"device": "cpu"}  {"layout": "strided"}  {"memory_format": "channels_last"}
    {"class": "collections:namedtuple"}              only in pytree contexts
    {"tensor": {"shape", "stride", ...}}             only in node meta (fake tensors: no data)
    {"enum": {"class", "name"}}                      only in a tensor subclass's flatten context
    {"dataclass": {"class", "fields": [[name, value], ..]}}     (format version 2): the objects
    {"namedtuple": {"class", "values": [..]}}                   load builds once the file is verified

Tensors with data go to safetensors, with a JSON record each for what safetensors does not keep
(stride, Parameter-ness, requires_grad, device).  Which classes a file may name, and how:
Note [Classes a file may name] in classes.py.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections import namedtuple
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import safetensors.torch
import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from predispatch.errors import DeviceUnavailableError, SerializationError, user_frame
from predispatch.serialize.shapes import encode_size, encode_storage_offset, encode_symbolic

#: Device types a stored tensor or tensor metadata may name: `meta` has no data, and a
#: file has no business naming others.
STORED_DEVICE_TYPES = frozenset({"cpu", "cuda", "xpu", "mps", "hpu", "privateuseone"})


def _torch_names(kind: type) -> dict[str, Any]:
    """torch's public values of one kind by name (`float32`, `strided`, `channels_last`)."""
    return {name: value for name, value in vars(torch).items() if isinstance(value, kind) and not name.startswith("_")}


def parse_device(name: str) -> torch.device:
    if not isinstance(name, str) or not re.fullmatch(r"[a-z_]+(:\d{1,4})?", name):
        raise SerializationError(f"{name!r} is not a device name.")
    device = torch.device(name)
    _check_available(device)
    return device


def _check_available(device: torch.device) -> None:
    """Refuse a device this torch cannot provide, at load: a file from a GPU machine read on a
    CPU one would otherwise fail inside safetensors (reported as a corrupted file) or, for a
    device only the graph names, at the first call, inside a kernel."""
    if device.type in ("cpu", "meta"):
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.xpu, torch.mps
    count = backend.device_count() if backend is not None and backend.is_available() else 0
    if count > (device.index or 0):
        return
    raise DeviceUnavailableError(
        f"the file's program runs on {device}, which this machine's torch ({torch.__version__}) "
        f"cannot provide ({count} {device.type} device(s) available): it was exported there, and a "
        "program is traced for its device, so load does not move it.",
        where=user_frame(),
        fix=f"load it on a machine with a {device.type} device, or export the model on the device you "
        "will run it on (predispatch.export(model.cpu(), cpu_args)) and save that program.",
    )


def _named_value(kind: type) -> tuple[type, Callable[[Any], str], Callable[[str], Any]]:
    names = _torch_names(kind)
    return kind, lambda value: str(value).removeprefix("torch."), lambda name: names[name]


#: torch's enum-like values: tag -> (type, name of a value, value of a name).
TORCH_VALUES: dict[str, tuple[type, Callable[[Any], str], Callable[[str], Any]]] = {
    "dtype": _named_value(torch.dtype),
    "layout": _named_value(torch.layout),
    "memory_format": _named_value(torch.memory_format),
    "device": (torch.device, str, parse_device),
}

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def encode(value: Any, where: str, *, classes: bool = False, tensors: bool = False, objects: bool = False) -> Any:
    """`value` as JSON data (see the module docstring); `classes` and `tensors` allow type
    references (pytree contexts) and tensor metadata (node meta), `objects` enum members,
    dataclass and namedtuple instances (a tensor subclass's flatten context: `_encode_object`)."""
    if objects and (found := _encode_object(value, where)) is not None:
        return found
    if value is None or isinstance(value, (bool, str)) or type(value) is int:
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if isinstance(value, (list, tuple, dict)):
        return _encode_container(value, where, classes=classes, tensors=tensors, objects=objects)
    for tag, (kind, name_of, _) in TORCH_VALUES.items():
        if isinstance(value, kind) and _round_trips(tag, value):
            return {tag: name_of(value)}
    if tensors and isinstance(value, torch.Tensor):
        return {"tensor": _tensor_meta(value, where)}
    if tensors and isinstance(value, torch.SymInt):  # node meta of a size computed in the graph
        return {"symint": encode_symbolic(value, where)}
    if tensors and isinstance(value, torch.SymBool):  # a while_loop's `i < 3` on an int carry
        return {"symbool": encode_symbolic(value, where)}
    if classes and isinstance(value, type):
        return {"class": class_name(value, where)}
    hint = " Symbolic floats and bools are not part of the file format." if isinstance(value, _SYMBOLIC) else ""
    raise SerializationError(f"{where}: a {type(value).__name__} ({short(value)}) has no encoding in format version 2.{hint}")


def _encode_object(value: Any, where: str) -> dict | None:
    """An enum member (by its class and name: first, as a `str` or `int` enum is also a str or
    an int, which would read back as one), a dataclass instance (its class and the fields its
    `__init__` takes) or a namedtuple instance (its class and values); None for any other value.
    Which of these classes load may build: Note [Classes a file may name] in classes.py."""
    if isinstance(value, enum.Enum):
        return {"enum": {"class": class_name(type(value), where), "name": value.name}}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [[f.name, encode(getattr(value, f.name), f"{where}.{f.name}", objects=True)] for f in dataclasses.fields(value) if f.init]
        return {"dataclass": {"class": class_name(type(value), where), "fields": fields}}
    if isinstance(value, tuple) and type(value) is not tuple and pytree.is_namedtuple_instance(value):
        values = [encode(v, f"{where}.{name}", objects=True) for name, v in zip(getattr(type(value), "_fields"), value)]
        return {"namedtuple": {"class": class_name(type(value), where), "values": values}}
    return None


def _round_trips(tag: str, value: Any) -> bool:
    """Whether a torch value's name reads back as the value (a dtype torch does not export does not)."""
    _, name_of, value_of = TORCH_VALUES[tag]
    try:
        return value_of(name_of(value)) == value
    except (KeyError, SerializationError):
        return False


def _encode_container(value: Any, where: str, **allow: bool) -> Any:
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]", **allow) for i, v in enumerate(value)]
    if type(value) is tuple:
        return {"tuple": [encode(v, f"{where}[{i}]", **allow) for i, v in enumerate(value)]}
    if isinstance(value, dict):
        return {"dict": [[encode(k, where, **allow), encode(v, f"{where}[{k!r}]", **allow)] for k, v in value.items()]}
    raise SerializationError(f"{where}: a {type(value).__name__} has no encoding in the file format (only plain tuples).")


def _tensor_meta(t: torch.Tensor, where: str) -> dict:
    """A tensor's metadata (node meta "val" is a fake tensor: there is no data to keep)."""
    if t.layout != torch.strided:
        raise SerializationError(f"{where}: a {t.layout} tensor; the file format holds strided tensors only.")
    return {
        "shape": [encode_size(s, where) for s in t.shape],  # symbolic sizes: shapes.py
        "stride": [encode_size(s, where) for s in t.stride()],
        "storage_offset": encode_storage_offset(t.storage_offset(), where),
        "dtype": TORCH_VALUES["dtype"][1](t.dtype),
        "device": str(t.device),
        "requires_grad": t.requires_grad,
    }


def short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Refs:
    """What decoded values may refer to, by where they sit in the file.

    nodes: graph nodes defined so far, by name (in node arguments).
    classes: how a {"class": name} becomes a class (in pytree contexts: classes.py); None: it may not.
    fake_mode: the mode {"tensor": ...} metadata becomes fake tensors in (in node meta).
    objects: how an {"enum"}, {"dataclass"} or {"namedtuple"} value becomes one, unbuilt until
        the file is verified (in a tensor subclass's flatten context: `FileClasses.context_value`
        in classes.py; called with the tag, the payload, where, and how to decode its values);
        None: it may not.
    """

    nodes: Mapping[str, fx.Node] | None = None
    classes: Callable[[str, str], type] | None = None
    fake_mode: Any = None
    symbols: Any = None  # the program's SymbolTable (shapes.py): symbolic sizes in node meta
    objects: Callable[[str, Any, str, Callable[[Any, str], Any]], Any] | None = None


_PLAIN = Refs()


def decode(data: Any, where: str, refs: Refs = _PLAIN) -> Any:
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(v, f"{where}[{i}]", refs) for i, v in enumerate(data)]
    if isinstance(data, dict) and len(data) == 1:
        ((tag, payload),) = data.items()
        decoder = _DECODERS.get(tag)
        if decoder is not None:
            return decoder(payload, where, refs)
    raise SerializationError(f"{where}: {short(data)} is not a value the file format knows.")


def expect(data: Any, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(data, kind) or (kind is int and isinstance(data, bool)):
        raise SerializationError(f"{where}: expected {getattr(kind, '__name__', kind)}, found {short(data)}.")
    return data


def _decode_node_ref(name: Any, where: str, refs: Refs) -> fx.Node:
    if refs.nodes is None or not isinstance(name, str) or name not in refs.nodes:
        raise SerializationError(f"{where}: refers to node {short(name)}, which is not defined before it.")
    return refs.nodes[name]


def _decode_float(name: Any, where: str, refs: Refs) -> float:
    if name not in ("inf", "-inf", "nan"):
        raise SerializationError(f"{where}: {short(name)} is not a non-finite float.")
    return float(name)


def _decode_dict(pairs: Any, where: str, refs: Refs) -> dict:
    result = {}
    for pair in expect(pairs, list, where):
        if not isinstance(pair, list) or len(pair) != 2:
            raise SerializationError(f"{where}: a dict entry is {short(pair)}, not a [key, value] pair.")
        key = decode(pair[0], where, refs)
        if not isinstance(key, (str, int, float, bool, type(None), tuple)):
            raise SerializationError(f"{where}: {short(key)} cannot be a dict key.")
        result[key] = decode(pair[1], f"{where}[{key!r}]", refs)
    return result


def _decode_class(name: Any, where: str, refs: Refs) -> type:
    if refs.classes is None:
        raise SerializationError(f"{where}: {short(name)} is not a class a pytree spec may name here.")
    return refs.classes(expect(name, str, where), where)


def _decode_object(tag: str, payload: Any, where: str, refs: Refs) -> Any:
    """An enum member, dataclass or namedtuple instance of a flatten context (`Refs.objects`)."""
    if refs.objects is None:
        raise SerializationError(f"{where}: a value tagged {tag!r} ({short(payload)}) is only valid in a tensor subclass's flatten context.")
    return refs.objects(tag, payload, where, lambda data, at: decode(data, at, refs))


def _decode_tensor_meta(meta: Any, where: str, refs: Refs) -> torch.Tensor:
    """A fake tensor with the saved metadata (node meta), made in the load's fake mode."""
    if refs.fake_mode is None:
        raise SerializationError(f"{where}: tensor metadata is only valid in node meta.")
    meta = expect(meta, dict, where)
    shape, stride = _sizes(meta.get("shape"), where, refs), _sizes(meta.get("stride"), where, refs)
    (offset,) = _sizes([meta.get("storage_offset")], where, refs)
    dtype = decode_named("dtype", meta.get("dtype"), where)
    device = parse_device(meta.get("device"))
    if device.type not in STORED_DEVICE_TYPES:
        raise SerializationError(f"{where}: tensor metadata on device {device}; the file format holds tensors with data (cpu, cuda, ...).")
    if len(shape) != len(stride) or (type(offset) is int and offset < 0):
        raise SerializationError(f"{where}: inconsistent tensor metadata {short(meta)}.")
    with refs.fake_mode:
        if offset == 0:
            fake = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        else:
            extent = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else offset
            fake = torch.empty(extent, dtype=dtype, device=device).as_strided(shape, stride, offset)
    return fake.requires_grad_(True) if expect(meta.get("requires_grad"), bool, where) else fake


def _symbolic(data: Any, where: str, refs: Refs, relation: bool) -> Any:
    """A SymInt or SymBool node meta value, over the program's symbols (shapes.py)."""
    if refs.symbols is None:
        return _sizes([data], where, refs)[0]
    return refs.symbols.value(data, where, relation)


def _sizes(data: Any, where: str, refs: Refs) -> list[Any]:
    """Sizes as ints, or SymInts where the file has symbolic ones and the program declares symbols."""
    values = expect(data, list, where)
    if refs.symbols is None or all(type(v) is int for v in values):
        return ints(values, where)
    return [refs.symbols.size(v, where) for v in values]


def ints(data: Any, where: str) -> list[int]:
    values = expect(data, list, where)
    if not all(type(v) is int and v >= 0 for v in values):
        raise SerializationError(f"{where}: {short(data)} is not a list of sizes.")
    return values


def decode_named(tag: str, name: Any, where: str) -> Any:
    try:
        return TORCH_VALUES[tag][2](expect(name, str, where))
    except KeyError:
        raise SerializationError(f"{where}: {short(name)} is not a torch {tag} this torch has.") from None


_DECODERS: dict[str, Callable[[Any, str, Refs], Any]] = {
    "node": _decode_node_ref,
    "tuple": lambda items, where, refs: tuple(decode(expect(items, list, where), where, refs)),
    "dict": _decode_dict,
    "float": _decode_float,
    "class": _decode_class,
    "tensor": _decode_tensor_meta,
    "symint": lambda data, where, refs: _symbolic(data, where, refs, relation=False),
    "symbool": lambda data, where, refs: _symbolic(data, where, refs, relation=True),
    **{tag: (lambda data, where, refs, tag=tag: _decode_object(tag, data, where, refs)) for tag in ("enum", "dataclass", "namedtuple")},
    **{tag: (lambda name, where, refs, tag=tag: decode_named(tag, name, where)) for tag in TORCH_VALUES},
}


def class_name(cls: Any, where: str) -> str:
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


def encode_spec(spec: pytree.TreeSpec, where: str) -> Any:
    if spec.is_leaf():
        return None
    return {
        "type": class_name(spec.type, where),
        "context": encode(spec.context, f"{where} context", classes=True),
        "children": [encode_spec(child, f"{where}[{i}]") for i, child in enumerate(spec.children())],
    }


#: dtypes safetensors stores natively; any other is stored as its bytes (uint8).
_SAFETENSORS_DTYPES = frozenset(
    getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
        "bool", "complex64", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64",
    )
    if hasattr(torch, name)
)


def pack(tensors: Mapping[str, torch.Tensor], where: str) -> tuple[bytes, dict[str, dict]]:
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
            "the file format holds dense tensors with data.",
            fix="convert it to a plain dense tensor before export.",
        )
    return {
        "dtype": TORCH_VALUES["dtype"][1](t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()) if _is_dense(t.shape, t.stride()) else _contiguous_stride(t.shape),
        "device": str(t.device),
        "requires_grad": t.requires_grad and t.is_leaf,  # a grad-mode write's history is not state: its value is
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


def unpack(data: bytes, records: Any, where: str) -> dict[str, torch.Tensor]:
    """The tensors of one member, each in fresh memory with its saved layout and kind; each
    stored copy is dropped once restored, and `data` once read when the caller holds no other
    reference (Note [Load memory] in archive.py)."""
    raw = safetensors.torch.load(data)
    del data
    records = expect(records, dict, where)
    if set(raw) != set(records):
        raise SerializationError(f"{where}: the stored tensors {sorted(raw)} do not match the records {sorted(records)}.")
    return {name: _restore(raw.pop(name), expect(rec, dict, where), f"{where}[{name!r}]") for name, rec in records.items()}


def _restore(raw: torch.Tensor, record: dict, where: str) -> torch.Tensor:
    dtype = decode_named("dtype", record.get("dtype"), where)
    shape, stride = ints(record.get("shape"), where), ints(record.get("stride"), where)
    values = raw.view(dtype) if expect(record.get("as_bytes"), bool, where) else raw
    if values.dtype != dtype or values.numel() != math.prod(shape) or len(stride) != len(shape) or not _is_dense(shape, stride):
        raise SerializationError(f"{where}: the stored data ({values.dtype}, {values.numel()} elements) does not match its record {short(record)}.")
    device = parse_device(record.get("device"))
    if device.type not in STORED_DEVICE_TYPES:
        raise SerializationError(f"{where}: a tensor on device {device}; the file format holds tensors with data (cpu, cuda, ...).")
    tensor = torch.empty_strided(shape, stride, dtype=dtype).copy_(values.reshape(shape))
    if device.type != "cpu":
        tensor = tensor.to(device)
    requires_grad = expect(record.get("requires_grad"), bool, where)
    if expect(record.get("parameter"), bool, where):
        return nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)
