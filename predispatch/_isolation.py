"""Nothing changes but the result: export leaves the user's module and torch's globals as found.

Tracing swaps parameters for fakes, flips torch's exporting flags, pushes dispatch modes and may
toggle grad mode or autocast as the user's code runs.  The user's forward itself may also write
to what it can reach: `self.cache = x * 2`, `self.register_buffer(...)`, a hook registered
inside forward, a plain dict of cached attention biases, `torch.set_num_threads(1)`.  During a
trace every value it writes is a tracer tensor, useless (and poisonous) once the trace is over.
`isolated` snapshots all of it and puts it back on the way out, whether export succeeded or raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from predispatch import _torch_internals as ti
from predispatch.frontend.reachable import beyond_tree

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
                # the registries and hook tables: dicts and sets inside `__dict__`
                containers.extend((v, _copy(v)) for v in namespace.values() if isinstance(v, (dict, set)))
            containers.extend((c, _copy(c)) for c in beyond.containers if id(c) not in seen and not seen.add(id(c)))
        return cls(tuple(namespaces), tuple(containers))

    def restore(self) -> None:
        for container, saved in self.containers:
            _put_back(container, saved)
        for owner, saved in self.namespaces:
            _put_back(vars(owner), saved)


def _copy(container: Any) -> Any:
    return list(container) if isinstance(container, list) else type(container).copy(container)


def _put_back(container: Any, saved: Any) -> None:
    """Make `container` hold what `saved` holds, in place (others may hold a reference to it)."""
    if isinstance(container, list):
        if len(container) != len(saved) or any(a is not b for a, b in zip(container, saved)):
            container[:] = saved
    elif isinstance(container, dict):
        if container.keys() != saved.keys() or any(container[k] is not v for k, v in saved.items()):
            container.clear()
            container.update(saved)
    elif container != saved:
        container.clear()
        container.update(saved)


@contextlib.contextmanager
def isolated(modules: list[nn.Module]) -> Iterator[None]:
    """Restore global state and everything forward may write on `modules` on exit."""
    state = GlobalState.capture()
    objects = ObjectState.capture(modules)
    try:
        yield
    finally:
        state.restore()
        objects.restore()
