"""Nothing changes but the result: export leaves the user's module and torch's globals as found.

Tracing swaps parameters for fakes, flips torch's exporting flags, pushes dispatch modes and may
toggle grad mode or autocast as the user's code runs.  `isolated` snapshots all of it and puts
it back on the way out, whether export succeeded or raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from predispatch import _torch_internals as ti

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class GlobalState:
    """The process-wide torch state a trace could disturb."""

    grad_enabled: bool
    default_dtype: torch.dtype
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    rng_state: torch.Tensor
    mode_depths: tuple[int, int, int]
    compiler_flags: tuple[bool, bool]

    @classmethod
    def capture(cls) -> GlobalState:
        return cls(
            torch.is_grad_enabled(),
            torch.get_default_dtype(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in _AUTOCAST_DEVICES),
            torch.is_autocast_cache_enabled(),
            torch.get_rng_state(),
            ti.mode_stack_depths(),
            (torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag),
        )

    def restore(self) -> None:
        ti.pop_modes_to(self.mode_depths)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_default_dtype(self.default_dtype)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)
        if not torch.equal(torch.get_rng_state(), self.rng_state):
            torch.set_rng_state(self.rng_state)
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = self.compiler_flags


@contextlib.contextmanager
def isolated(modules: list[nn.Module]) -> Iterator[None]:
    """Restore global state and the training flag of every submodule of `modules` on exit."""
    state = GlobalState.capture()
    training = [(m, m.training) for root in modules for m in root.modules()]
    try:
        yield
    finally:
        state.restore()
        for module, flag in training:
            module.training = flag
