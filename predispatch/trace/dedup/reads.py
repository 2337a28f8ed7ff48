"""Which Python attributes a block's forward reads, and their values (part of a block's key).

While a call is recorded, the block's modules and the plain objects reached from them (a shared
config) get a subclass of their own class, made here, whose `__getattribute__`/`__getattr__`
log every read as `(path, value)`: `(("self_attn", "is_sliding"), True)`,
`(("config", "sliding_window"), 4)`.  A later call shares the recorded body only if reading the
same paths on its own module gives the same values (`matches`).  An attribute the forward never
reads is not part of the key: a Hugging Face layer's `layer_idx`, unread without a cache, does not
split the layers; a forward that picks its attention type from `layer_idx` reads it and does.

Writes (`self.calls += 1`, `self.cache = x`) are logged too: a block that writes Python state is
never shared (a replay would not run the write).  What instrumentation cannot see (a global, a
read through `obj.__dict__`, a mutation of a list held by the module) is left to the comparison of
the first two calls; see Note [What the key cannot see] in share.py.
"""

from __future__ import annotations

import contextlib
import enum
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: The values a read is keyed on by value; containers of these are snapshot as tuples.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format, enum.Enum)

#: nn.Module's own bookkeeping, read by torch's `__call__`, not by the user's forward.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}


class _Missing:
    """The value of a read that raised AttributeError (`getattr(obj, name, default)`, `hasattr`)."""

    def __repr__(self) -> str:
        return "<missing>"


MISSING = _Missing()


class Unkeyable(Exception):
    """A read whose value cannot be compared across calls (the block is then not shared)."""


@dataclass
class ReadLog:
    """The reads and writes of one recorded call.

    paths: id of each instrumented object -> its path from the block module.
    reads: path -> snapshot of the value read (first read wins; later reads of the same path
        are the same value unless the forward wrote it, and a write disables sharing).
    writes: paths written.
    identity: snapshot values that compare by identity (kept alive here).
    unkeyable: why some read cannot be keyed, if one could not.
    """

    paths: dict[int, tuple[str, ...]] = field(default_factory=dict)
    reads: dict[tuple[str, ...], Any] = field(default_factory=dict)
    writes: list[tuple[str, ...]] = field(default_factory=list)
    unkeyable: str | None = None
    operand_ids: frozenset[int] = frozenset()


_active: ReadLog | None = None


def snapshot(value: Any) -> Any:
    """A comparable, frozen copy of a read value: plain values as they are, lists and dicts as
    tuples, anything else (a tensor that is not an operand, a function) by identity."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(snapshot(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((snapshot(k), snapshot(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value), frozenset(snapshot(v) for v in value))
    return _Identity(value)


@dataclass(frozen=True, eq=False)
class _Identity:
    """A value compared by identity (`is`)."""

    value: Any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.value is self.value

    def __hash__(self) -> int:
        return id(self.value)


def _follows(value: Any) -> bool:
    """Whether reads on `value` are logged too: modules and plain Python objects with a `__dict__`."""
    if isinstance(value, nn.Module):
        return True
    if isinstance(value, (type, types.FunctionType, types.MethodType, types.ModuleType, torch.Tensor, enum.Enum)):
        return False  # an enum member is a constant: snapshotted, and its class cannot be extended
    return hasattr(value, "__dict__") and type(value).__module__ != "builtins" and not callable(value)


def _log_read(obj: Any, name: str, value: Any) -> Any:
    log = _active
    if log is None or name.startswith("__") or name in _MODULE_INTERNALS:
        return value
    base = log.paths.get(id(obj))
    if base is None:
        return value
    path = (*base, name)
    if isinstance(value, types.MethodType) and value.__self__ is obj:
        return value  # a method of the class: the class is in the key
    if isinstance(value, torch.Tensor) and id(value) in log.operand_ids:
        return value  # an operand of the block: passed to each call
    if _follows(value):
        if id(value) not in log.paths:
            _instrument(value, path)
        log.reads.setdefault(path, _object_at(path, value))
        return value
    log.reads.setdefault(path, snapshot(value))
    return value


@dataclass(frozen=True)
class _ObjectAt:
    """A module or plain object read: keyed by being one at that path (its own reads are keyed
    separately), so layers holding equal but distinct config objects still share.

    contents: for an object whose reads cannot be observed (a `types.SimpleNamespace`, whose
        class cannot be swapped), a snapshot of all its attributes instead: more than the forward
        reads, so two calls share only when the whole object is the same.
    """

    path: tuple[str, ...]
    contents: Any = None


#: Classes whose instances refused the class swap; their objects are keyed by their contents.
_unswappable: set[type] = set()


def _object_at(path: tuple[str, ...], value: Any) -> _ObjectAt:
    if type(value) in _unswappable:
        return _ObjectAt(path, snapshot(dict(vars(value))))
    return _ObjectAt(path)


_subclasses: dict[type, type] = {}
_swapped: list[tuple[Any, type]] = []


def _recording_class(cls: type) -> type:
    """`cls` with reads and writes logged: same name, module and qualname, so torch's module
    stack records the same class text."""
    if cls not in _subclasses:

        def __getattribute__(self, name):
            value = super(sub, self).__getattribute__(name)
            return _log_read(self, name, value)

        def __getattr__(self, name):
            parent = getattr(super(sub, self), "__getattr__", None)
            try:
                if parent is None:
                    raise AttributeError(name)
                value = parent(name)
            except AttributeError:
                if _active is not None and id(self) in _active.paths and not name.startswith("__"):
                    _active.reads.setdefault((*_active.paths[id(self)], name), MISSING)
                raise
            return _log_read(self, name, value)

        def __setattr__(self, name, value):
            if _active is not None and id(self) in _active.paths:
                _active.writes.append((*_active.paths[id(self)], name))
            super(sub, self).__setattr__(name, value)

        namespace = {"__getattribute__": __getattribute__, "__getattr__": __getattr__, "__setattr__": __setattr__}
        namespace.update(__module__=cls.__module__, __qualname__=cls.__qualname__)
        sub = type(cls.__name__, (cls,), namespace)
        _subclasses[cls] = sub
    return _subclasses[cls]


def _instrument(obj: Any, path: tuple[str, ...]) -> None:
    """Swap `obj`'s class for its recording subclass; an object that refuses makes the log unkeyable."""
    log = _active
    log.paths[id(obj)] = path
    cls = type(obj)
    if cls in _subclasses.values():
        return
    if cls in _unswappable:
        return
    try:
        object.__setattr__(obj, "__class__", _recording_class(cls))
    except (TypeError, AttributeError):  # a class that refuses subclasses or the swap
        if isinstance(obj, nn.Module) or not hasattr(obj, "__dict__"):
            log.unkeyable = log.unkeyable or f"reads on {'.'.join(path) or 'the block'} cannot be observed"
        else:
            _unswappable.add(cls)  # keyed by its whole contents (`_ObjectAt.contents`)
        return
    _swapped.append((obj, cls))


@contextlib.contextmanager
def recording_reads(module: nn.Module, operands: list[torch.Tensor]) -> Iterator[ReadLog]:
    """Log the reads and writes of `module`'s forward (and of objects reached from it) while active."""
    global _active
    outer, mark = _active, len(_swapped)
    log = ReadLog(operand_ids=frozenset(id(t) for t in operands))
    _active = log
    try:
        _instrument(module, ())
        yield log
    finally:
        _active = outer
        while len(_swapped) > mark:
            obj, cls = _swapped.pop()
            object.__setattr__(obj, "__class__", cls)


def read_path(module: nn.Module, path: tuple[str, ...]) -> Any:
    """The value at `path` from `module`, as the recorded read saw it (snapshot form)."""
    obj: Any = module
    for name in path:
        try:
            obj = getattr(obj, name)
        except AttributeError:
            return MISSING
    return _object_at(path, obj) if _follows(obj) else snapshot(obj)


def matches(reads: dict[tuple[str, ...], Any], module: nn.Module) -> bool:
    """Whether every recorded read gives the same value on `module`."""
    try:
        return all(read_path(module, path) == value for path, value in reads.items())
    except Exception:  # noqa: BLE001 - a property that fails to read: not the same block
        return False
