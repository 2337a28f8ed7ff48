"""Nothing changes but the result: export leaves the user's module and torch's globals as found.

Tracing swaps parameters for fakes, flips torch's exporting flags, pushes dispatch modes and may
toggle grad mode or autocast as the user's code runs.  The user's forward itself may also write
to what it can reach: `self.cache = x * 2`, `self.register_buffer(...)`, a hook registered
inside forward, a plain dict of cached attention biases, `torch.set_num_threads(1)`.  During a
trace every value it writes is a tracer tensor, useless (and poisonous) once the trace is over.
`isolated` snapshots all of it and puts it back on the way out, whether export succeeded or raised.
Forward may also write outside the module, where the user's code keeps things: see Note
[Forward's writes outside the module] below and `OutsideState`.

This module holds the whole promise; frontend/reachable.py only answers which objects an export
reaches (`beyond_tree`), which the snapshot reads.
"""

# Note [What export puts back, and in what order]
# -----------------------------------------------
# `isolated` snapshots, before anything runs: torch's global state (`GlobalState`), the user's
# objects (`ObjectState`: every module's and helper object's `__dict__` and the plain containers
# reachable from them, Note [Modules outside the registered tree] in frontend/reachable.py), and
# the places outside the module (`OutsideState`: the user's code's module globals, class
# attributes, default arguments, lru_caches).  On the way out it puts them back in that order:
#   1. torch's global state: the process-wide switches first (putting back the default device
#      rebuilds the function mode stack), then the mode stacks popped to their depths, grad mode,
#      the default dtype, every device type's autocast state and its cache, torch.compiler's
#      flags, the global module hook tables;
#   2. the user's objects: each plain container in place, then each object's attributes;
#   3. outside the module: only what holds a tracer tensor, key by key (containers, module
#      globals, class attributes, default arguments); an lru_cache that missed is cleared.
# Every step runs whatever an earlier one raised (Note [Putting back, whatever happens]); then
# what could not be put back is refused (`RestoreError`), and last a tracer tensor still
# reachable from outside the module is refused (`OutsideWriteError`, `_refuse_leaks`).

from __future__ import annotations

import contextlib
import sys
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import OutsideWriteError, RestoreError, user_frame
from predispatch.frontend.reachable import LIBRARIES, beyond_tree, global_names

#: Every device type's autocast state, not only CPU's and CUDA's (forward may enter any).
_AUTOCAST_DEVICES = ti.AUTOCAST_DEVICE_TYPES


@dataclass(frozen=True)
class GlobalState:
    """The process-wide torch state a trace could disturb.

    switches: the value of each `ti.GLOBAL_SWITCHES` entry (deterministic algorithms, thread
        count, matmul precision, backend flags, ...), in that table's order.

    Not here: the generators' states, which other threads may be drawing from; the trace
    checks and puts back what forward changed (trace/rng.py, Note [Another thread's draws
    during an export]).
    """

    grad_enabled: bool
    default_dtype: torch.dtype
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    mode_depths: tuple[int, int, int]
    compiler_flags: tuple[bool, bool]
    switches: tuple[Any, ...] = ()
    global_hooks: tuple[dict, ...] = ()

    @classmethod
    def capture(cls) -> GlobalState:
        return cls(
            torch.is_grad_enabled(),
            torch.get_default_dtype(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES),
            torch.is_autocast_cache_enabled(),
            ti.mode_stack_depths(),
            (torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag),
            tuple(switch.get() for switch in ti.GLOBAL_SWITCHES),
            tuple(dict(table) for table in ti.global_module_hook_tables()),
        )

    def restore(self) -> None:
        # switches first: the default device's mode sits at the bottom of the function mode
        # stack, and putting it back rebuilds that stack (see `ti._set_default_device_context`)
        for switch, value in zip(ti.GLOBAL_SWITCHES, self.switches):
            if value is not ti.UNREADABLE and not _same(switch.get(), value):
                switch.set(value)
        ti.pop_modes_to(self.mode_depths)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_default_dtype(self.default_dtype)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = self.compiler_flags
        for table, saved in zip(ti.global_module_hook_tables(), self.global_hooks):
            _put_back(table, saved)


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)


@dataclass(frozen=True)
class ObjectState:
    """What forward can write on the user's objects: each module's and helper object's
    `__dict__` (attributes, parameter/buffer/submodule registries, hook tables) and every
    plain list/dict/set reachable from them, as shallow copies, restored in place."""

    namespaces: tuple[tuple[Any, dict[str, Any]], ...]
    containers: tuple[tuple[Any, Any], ...]

    @classmethod
    def capture(cls, roots: list[nn.Module]) -> ObjectState:
        namespaces, containers = [], []
        seen: set[int] = set()
        for root in roots:
            beyond = beyond_tree(root)
            owners = [*root.modules(), *(m for top in beyond.modules.values() for m in top.modules()), *beyond.objects]
            for owner in owners:
                if id(owner) in seen:
                    continue
                seen.add(id(owner))
                namespace = vars(owner)
                namespaces.append((owner, dict(namespace)))
                # the registries and hook tables: dicts and sets inside `__dict__` (most are empty:
                # no copy of those, see `_put_back`)
                containers.extend((v, _copy(v) if v else None) for v in namespace.values() if isinstance(v, (dict, set)))
            containers.extend((c, _copy(c)) for c in beyond.containers if id(c) not in seen and not seen.add(id(c)))
        return cls(tuple(namespaces), tuple(containers))

    def restore(self) -> list[tuple[str, BaseException]]:
        """Put everything back; each container and namespace on its own, so one that raises (a
        user `__eq__`, `__hash__`) stops nothing else.  Returns what could not be put back."""
        failures = [_attempt(f"a container of {type(container).__name__}", _put_back, container, saved)
                    for container, saved in self.containers]
        failures += [_attempt(f"the attributes of {type(owner).__name__}", _put_back, vars(owner), saved)
                     for owner, saved in self.namespaces]
        return [f for f in failures if f is not None]


def _attempt(what: str, step: Callable[..., None], *args: Any) -> tuple[str, BaseException] | None:
    """Run one restore step; what it was and what it raised, if it raised."""
    try:
        step(*args)
    except Exception as exc:  # noqa: BLE001 - a user's __eq__/__hash__ may raise anything
        return what, exc
    return None


def _copy(container: Any) -> Any:
    return list(container) if isinstance(container, list) else type(container).copy(container)


def _put_back(container: Any, saved: Any) -> None:
    """Make `container` hold what `saved` holds, in place (others may hold a reference to it);
    `saved` None: it was empty.  Compared by identity, never with the elements' `__eq__` (the
    user's, which may raise or lie)."""
    if saved is None:
        if container:
            container.clear()
    elif isinstance(container, list):
        if len(container) != len(saved) or any(a is not b for a, b in zip(container, saved)):
            container[:] = saved
    elif isinstance(container, dict):
        if len(container) != len(saved) or any(
                ka is not kb or va is not vb for (ka, va), (kb, vb) in zip(container.items(), saved.items())):
            container.clear()
            container.update(saved)
    elif len(container) != len(saved) or {id(x) for x in container} != {id(x) for x in saved}:
        container.clear()
        container.update(saved)


# --- Outside the module: the places in the user's code ----------------------------------------
#
# Note [Forward's writes outside the module]
# Forward may keep what it computes outside its module tree: in a module-level dict
# (`_BIAS[n] = ...`), a global (`global TABLE; TABLE = ...`), a mutable default argument
# (`def forward(self, x, cache={})`), a class attribute (`type(self).table = ...`), or a
# `functools.lru_cache`d helper's cache.  During a trace each such value is a tracer tensor,
# which breaks the model's next eager call and every fresh instance.  `outside_places` finds
# these places from the code forward runs: the user's classes of the modules (their methods),
# the user's functions their code names (transitively), and those functions' globals; what
# holds a tracer tensor there is put back as it was after export (`OutsideState` below;
# plain values forward kept, a call counter, stay), and a tracer tensor still reachable from
# them afterwards is refused, naming the place (`_refuse_leaks`).

#: How many of the user's functions the walk follows from the modules' methods.
_MAX_FUNCTIONS = 2_000


@dataclass(frozen=True)
class Outside:
    """Where forward can write outside its module tree (Note [Forward's writes outside the module]).

    namespaces: `(name, globals)` of each module file the user's code runs in, by module name.
    classes: the user's classes of the modules and their bases (class attributes).
    functions: the user's functions and methods forward may call (their default arguments).
    caches: `(name, wrapper)` of the `functools.lru_cache` wrappers among them.
    """

    namespaces: tuple[tuple[str, dict[str, Any]], ...]
    classes: tuple[type, ...]
    functions: tuple[types.FunctionType, ...]
    caches: tuple[tuple[str, Any], ...]


def outside_places(roots: list[nn.Module], fn: Any = None) -> Outside:
    """The places forward may write outside `roots` (and `fn`, an exported function)."""
    walk = _CodeWalk()
    for root in roots:
        for module in root.modules():
            walk.cls(type(module))
    if fn is not None and not isinstance(fn, nn.Module):
        walk.callable(getattr(fn, "__func__", fn))
    return Outside(tuple(walk.namespaces.values()), tuple(walk.classes), tuple(walk.functions), tuple(walk.caches))


class _CodeWalk:
    """One walk over the user's classes and functions, each visited once."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.namespaces: dict[int, tuple[str, dict[str, Any]]] = {}
        self.classes: list[type] = []
        self.functions: list[types.FunctionType] = []
        self.caches: list[tuple[str, Any]] = []

    def cls(self, cls: type) -> None:
        for base in cls.__mro__:
            if id(base) in self.seen or not _is_users(base):
                continue
            self.seen.add(id(base))
            self.classes.append(base)
            for value in list(vars(base).values()):
                self.callable(value)

    def callable(self, value: Any) -> None:
        if type(value) in _NOT_CODE or isinstance(value, types.ModuleType):  # most names code reads
            return
        value = getattr(value, "__func__", value)  # staticmethod, classmethod, bound method
        if isinstance(value, property):
            for accessor in (value.fget, value.fset):
                self.callable(accessor)
            return
        if id(value) in self.seen or len(self.functions) > _MAX_FUNCTIONS:
            return
        if _is_lru_cache(value) and _is_users(value):
            self.seen.add(id(value))
            self.caches.append((_qualified(value), value))
            self.callable(value.__wrapped__)
        elif isinstance(value, types.FunctionType) and _is_users(value):
            self.seen.add(id(value))
            self.functions.append(value)
            self.namespace(value)
            for name in global_names(value.__code__):
                named = value.__globals__.get(name)
                if isinstance(named, type):
                    self.cls(named)
                else:
                    self.callable(named)

    def namespace(self, function: types.FunctionType) -> None:
        namespace = function.__globals__
        if id(namespace) not in self.namespaces:
            self.namespaces[id(namespace)] = (namespace.get("__name__", "?"), namespace)


#: Values that hold nothing: walks pass them without a visit (here and in the leak walk,
#: `_find_tracers`).
ATOMS = frozenset({str, int, float, bool, bytes, complex, type(None)})

#: Values a name in code may hold that are neither functions, caches nor properties.
_NOT_CODE = ATOMS | {tuple, list, dict, set, frozenset}


def _is_lru_cache(value: Any) -> bool:
    return callable(getattr(value, "cache_clear", None)) and callable(getattr(value, "cache_info", None)) and hasattr(value, "__wrapped__")


def _is_users(value: Any) -> bool:
    """Code of the user's own, not of a library (torch, predispatch, the standard library)."""
    module_name = getattr(value, "__module__", None) or ""
    top = module_name.split(".")[0]
    return bool(module_name) and top not in sys.stdlib_module_names and not module_name.startswith(LIBRARIES)


def _qualified(value: Any) -> str:
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', repr(value))}"


#: How deep `OutsideState.leaks` looks into what an outside place holds, and how much it visits.
_LEAK_DEPTH, _LEAK_VISITS = 6, 100_000


@dataclass(frozen=True)
class OutsideState:
    """What forward can write outside the module (Note [Forward's writes outside the module]):
    the module files' globals, the user's classes' attributes and functions' default arguments,
    as shallow copies, with the plain containers they hold; and each `lru_cache`'s counters.

    Only what holds a tracer tensor is put back, in place and key by key (other threads run code
    that reads those globals): a counter or a log of plain values forward kept stays, as after
    the one eager call export's trace stands for.  A cache that missed during export holds what
    forward computed, tracer tensors: it is cleared (its entries are recomputed on the next
    calls; a cache's contents cannot be read or put back).
    """

    places: Outside
    namespaces: tuple[dict[str, Any], ...]
    classes: tuple[dict[str, Any], ...]
    defaults: tuple[tuple[Any, Any], ...]
    containers: tuple[tuple[Any, Any], ...]
    cache_misses: tuple[int, ...]

    @classmethod
    def capture(cls, places: Outside) -> OutsideState:
        defaults = tuple((f.__defaults__, dict(f.__kwdefaults__ or {})) for f in places.functions)
        held = [
            *(v for _, ns in places.namespaces for v in ns.values()),
            *(v for c in places.classes for v in vars(c).values()),
            *(v for f in places.functions for v in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())),
        ]
        return cls(
            places,
            tuple(dict(ns) for _, ns in places.namespaces),
            tuple(dict(vars(c)) for c in places.classes),
            defaults,
            tuple((c, _copy(c)) for c in _containers_in(held)),
            tuple(cache.cache_info().misses for _, cache in places.caches),
        )

    def restore(self) -> None:
        for container, saved in self.containers:
            if isinstance(container, dict):
                _put_back_keys(container, saved, _holds_tracer)
            elif any(_holds_tracer(v) for v in container):
                _put_back(container, saved)
        for (_, namespace), saved in zip(self.places.namespaces, self.namespaces):
            _put_back_keys(namespace, saved, _holds_tracer)
        for owner, saved in zip(self.places.classes, self.classes):
            _put_back_attributes(owner, saved, _holds_tracer)
        for function, (positional, keywords) in zip(self.places.functions, self.defaults):
            if function.__defaults__ is not positional and _holds_tracer(function.__defaults__):
                function.__defaults__ = positional
            if _holds_tracer(function.__kwdefaults__):
                function.__kwdefaults__ = keywords or None
        for (_, cache), misses in zip(self.places.caches, self.cache_misses):
            if cache.cache_info().misses != misses:
                cache.cache_clear()

    def leaks(self) -> list[str]:
        """Where a tracer tensor is still reachable from an outside place after `restore`: what
        it could not put back (an object's slots, a container of another type, deeper state).

        A first walk only answers whether there is one, building no path (a model file's globals
        hold configuration tables of thousands of entries: formatting a path for each was most of
        the walk); only when it finds one does the walk run again, naming every place.  Both walks
        visit the same values in the same order, so they agree."""
        roots = [
            *(((name, ".", key), v) for name, ns in self.places.namespaces for key, v in list(ns.items())),
            *(((f"{c.__module__}.{c.__qualname__}", ".", key), v) for c in self.places.classes for key, v in list(vars(c).items())),
            *(((f"{f.__module__}.{f.__qualname__}", "'s default argument", None), v) for f in self.places.functions
              for v in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())),
        ]
        seen: set[int] = set()
        if not any(_find_tracers(value, None, 0, seen, None) for _, value in roots):
            return []
        found: list[str] = []
        seen.clear()
        for (owner, joint, key), value in roots:
            _find_tracers(value, f"{owner}{joint}{'' if key is None else key}", 0, seen, found)
        return found


def _containers_in(values: list[Any]) -> list[Any]:
    """The plain lists, dicts and sets among `values` and inside them (a few levels)."""
    found, seen, stack = [], set(), [(v, 0) for v in values]
    while stack:
        value, depth = stack.pop()
        if not isinstance(value, (list, dict, set)) or id(value) in seen or depth > 3:
            continue
        seen.add(id(value))
        found.append(value)
        stack.extend((child, depth + 1) for child in (value.values() if isinstance(value, dict) else value))
    return found


def _find_tracers(value: Any, path: str | None, depth: int, seen: set[int], found: list[str] | None) -> bool:
    """Whether `value` holds a tracer tensor; append `path` (extended into containers and objects)
    of every one to `found`.  With `found=None` (and `path=None`) stop at the first one and format
    no path."""
    if type(value) in ATOMS:
        return False
    if isinstance(value, torch.Tensor):  # a leaf of the walk: a tracer, or a real tensor
        if not ti.is_traced_tensor(value):
            return False
        if found is not None:
            found.append(path or "")
        return True
    if depth > _LEAK_DEPTH or id(value) in seen or len(seen) > _LEAK_VISITS or isinstance(value, type):
        return False
    seen.add(id(value))
    if isinstance(value, dict):
        children, step = list(value.items()), "[{!r}]"
    elif isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
        children, step = list(enumerate(list(value))), "[{}]"
    elif _is_plain_object(value):
        children, step = _attributes(value), ".{}"
    else:
        return False
    held = False
    for key, child in children:
        if type(child) in ATOMS:  # the check `_find_tracers` makes first, without the call
            continue
        if _find_tracers(child, None if found is None else (path or "") + step.format(key), depth + 1, seen, found):
            if found is None:
                return True
            held = True
    return held


def _is_plain_object(value: Any) -> bool:
    """A helper object of the user's own class (walked through its attributes)."""
    module = getattr(type(value), "__module__", "") or ""
    return not module.startswith(("torch", "builtins", "predispatch", "types")) and (
        hasattr(value, "__dict__") or hasattr(type(value), "__slots__")
    )


def _attributes(value: Any) -> list[tuple[str, Any]]:
    found = list(getattr(value, "__dict__", {}).items())
    for slot in _slots(type(value)):
        if hasattr(value, slot):
            found.append((slot, getattr(value, slot)))
    return found


def _slots(klass: type) -> tuple[str, ...]:
    """The slot names `klass` and its bases declare (a class's `__slots__` are fixed when it is
    created: read once, not for each object the walk meets; held weakly by class)."""
    slots = _SLOTS.get(klass)
    if slots is None:
        slots = _SLOTS[klass] = tuple(
            slot for base in klass.__mro__ for slot in (lambda s: (s,) if isinstance(s, str) else s)(vars(base).get("__slots__", ()))
        )
    return slots


_SLOTS: weakref.WeakKeyDictionary[type, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _put_back_keys(namespace: dict[Any, Any], saved: dict[Any, Any], holds: Callable[[Any], bool]) -> None:
    """Put back, key by key, each value of `namespace` that changed and `holds` says must go;
    never emptying it (other code reads it meanwhile)."""
    for key in [k for k in namespace if k not in saved and holds(namespace[k])]:
        del namespace[key]
    for key, value in saved.items():
        current = namespace.get(key, _MISSING)
        if current is not value and (current is _MISSING or holds(current)):
            namespace[key] = value


def _put_back_attributes(owner: type, saved: dict[str, Any], holds: Callable[[Any], bool]) -> None:
    """`_put_back_keys` for a class's attributes (its namespace is read-only: set/delattr)."""
    current = vars(owner)
    for key in [k for k in current if k not in saved and holds(current[k])]:
        delattr(owner, key)
    for key, value in saved.items():
        now = current.get(key, _MISSING)
        if now is not value and (now is _MISSING or holds(now)):
            setattr(owner, key, value)


def _holds_tracer(value: Any) -> bool:
    """Whether a tracer tensor is reachable from `value` (`_find_tracers`'s bounded walk)."""
    return _find_tracers(value, None, 0, set(), None)


_MISSING = object()


@contextlib.contextmanager
def isolated(modules: list[nn.Module], fn: Any = None) -> Iterator[None]:
    """Restore global state and everything forward may write on `modules` (and outside them,
    in the code of `modules` and of `fn`) on exit; refuse a tracer tensor left outside."""
    state = GlobalState.capture()
    objects = ObjectState.capture(modules)
    outside = OutsideState.capture(outside_places(modules, fn))
    try:
        yield
    finally:
        with ti.interrupts_deferred():  # Note [Putting back, whatever happens]
            failures = [f for f in (_attempt("torch's global state", state.restore),) if f]
            failures += objects.restore()
            failures += [f for f in (_attempt("state outside the module", outside.restore),) if f]
        if failures:
            _refuse_unrestored(failures)
    _refuse_leaks(outside)


# Note [Putting back, whatever happens]
# Every step that puts back what forward changed runs, whatever an earlier one raised (a user
# `__eq__` or `__hash__` on an object forward put in a set or used as a dict key), and a
# Ctrl-C arriving while they run is held until they are done (`ti.interrupts_deferred`):
# half-way, the module would keep a tracer tensor and the next export would refuse it.  What
# could not be put back is then refused by name (`RestoreError`), after all the others ran.


def _refuse_unrestored(failures: list[tuple[str, BaseException]]) -> None:
    what, exc = failures[0]
    raise RestoreError(
        f"export could not put back {what}, which forward changed: putting it back raised "
        f"{type(exc).__name__}: {exc}" + (f" ({len(failures) - 1} more.)" if len(failures) > 1 else "")
        + " Everything else was put back.",
        where=f"{user_frame()} (the export call)",
        fix="make the objects forward stores comparable and hashable without raising (a custom __eq__ "
        "or __hash__ that raises), or keep forward from changing them during export.",
    ) from exc


def _refuse_leaks(outside: OutsideState) -> None:
    leaks = outside.leaks()
    if leaks:
        raise OutsideWriteError(
            f"forward left a tensor of the trace in {leaks[0]}, outside the module, where export cannot "
            "put back what was there; the model's next eager call (or a fresh instance) would read it "
            "and fail." + (f" ({len(leaks) - 1} more places.)" if len(leaks) > 1 else ""),
            where=f"{user_frame()} (the export call)",
            fix="keep what forward computes on the module (self.cache = ..., a buffer), in a plain "
            "dict, list or attribute there, or compute it outside forward.",
        )
