"""A module's arguments and output as eager's `BackwardHook` lays them out for its hooks.

Both module-hook kinds hand their hooks one grad_input entry per positional argument and one
grad_output entry per element of the output, top level only; `Layout` records that layout so
a hook Function can pick the tensors it passes through, put them back, and spread its gradients
into the tuples the hooks expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def is_floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


@dataclass(frozen=True)
class Layout:
    """A module's positional arguments or its output as torch's `BackwardHook` sees them: the top
    level only (`_top_level`), one entry of grad_input or grad_output per element.

    count: the number of entries: one per argument; for an output, 1 for a tensor, the length of
        a tuple, 0 for anything else (eager then calls none of the module's backward hooks).
    hooked: positions of the floating tensors, which pass through the hook Function; the other
        entries are None.  (Eager's grad_input holds zeros for a tensor argument of another
        dtype; passing one through the Function would hand the module a copy, and an in-place
        update of it, a position counter's, would no longer reach the caller.)
    like: `(shape, dtype, device)` of the tensor at each of `hooked`, for a carrier.
    """

    count: int
    hooked: tuple[int, ...]
    like: tuple[tuple[torch.Size, torch.dtype, torch.device], ...]

    @staticmethod
    def of(value: Any) -> Layout:
        elements = _top_level(value)
        hooked = tuple(i for i, t in enumerate(elements) if is_floating(t))
        return Layout(len(elements), hooked, tuple(_like(elements[i]) for i in hooked))

    def same_entries(self, other: Layout) -> bool:
        return (self.count, self.hooked) == (other.count, other.hooked)

    def pick(self, value: Any) -> tuple:
        """The elements of `value` at `hooked`."""
        elements = _top_level(value)
        return tuple(elements[i] for i in self.hooked)

    def place(self, value: Any, tensors: tuple) -> Any:
        """`value` with `tensors` at `hooked`, rebuilt as `BackwardHook` rebuilds it."""
        elements = list(_top_level(value))
        for i, t in zip(self.hooked, tensors):
            elements[i] = t
        if isinstance(value, torch.Tensor):
            return elements[0]
        return tuple(elements) if type(value) is tuple else type(value)(*elements)

    def spread(self, grads: tuple) -> tuple:
        """One entry per element, `grads` at `hooked` and None elsewhere, as `BackwardHook` packs them."""
        by_position = dict(zip(self.hooked, grads))
        return tuple(by_position.get(i) for i in range(self.count))


def _top_level(value: Any) -> tuple:
    """The elements torch's `BackwardHook` hooks: a tensor, or a tuple's elements; nothing else."""
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(value) if isinstance(value, tuple) else ()


def _like(t: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return t.shape, t.dtype, t.device
