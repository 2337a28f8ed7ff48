"""Lifted state that shares memory: views of one base, not independent inputs.

Note [State that shares storage]
--------------------------------
A module's tensors may overlap in memory: a buffer made as a view of a parameter
(`self.register_buffer("row", self.w.detach()[0])`), a tensor attribute that is a slice of a
buffer (`self.head = self.buf[:4]`).  Eager writes through one are seen through the other.
Lifted as independent graph inputs they would not be: functionalization tracks views of one
tensor, not two inputs that happen to share memory (the program's outputs and state drift).

So every state tensor whose memory overlaps another's is lifted with a `StorageView`: during
the trace its names are bound to a view of its *base* (the state tensor whose memory holds the
whole group), made as `base.as_strided(size, stride, offset)` (detached first when the member
does not require grad, as a `.detach()` or `.data` view does not).  Functionalization then
sees one tensor and its views, as AOTAutograd sees inputs it merged into a synthetic base:

    def forward(self, p_w, b_row, x):               # b_row: a view of p_w, not read
        detach = aten.detach(p_w)
        as_strided = aten.as_strided(detach, [3], [1], 0)
        add = aten.add(as_strided, 1.0)             # self.row.add_(1.0)
        ...                                         # p_w's new value: written back once
        return (new_w, as_strided_2, ...)           # and b_row's, the view of new_w

The member keeps its placeholder (the program's state, `state_dict()` and `module()` stay the
module's) but the graph reads the base only.  When forward writes the base (directly or through
a member), each member gets its new value as a view of the base's new value, so a program whose
state copies do not share memory (`ep.module()` clones each tensor) stays consistent too.

What is refused (`SharedStorageError`): overlapping state where no one tensor holds the
others' memory, a base that is not contiguous from the start of its storage (the view's offset
would depend on the base's layout at run time), members of another dtype than their base,
members that are neither contiguous nor one strided dimension (a 2-d block `t[:, 1:3]`: the
views that make it compose badly with functionalization, see `StorageView.of`), and a parameter
that is a member (its gradient is its own in eager, a view's would go to the base).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from predispatch.errors import SharedStorageError, user_frame
from predispatch.signature import InputKind


@dataclass(frozen=True)
class StorageView:
    """Where a lifted state tensor lies in the memory of another (its base).

    base: the base's position in `PreparedInputs.state`.
    size, stride, offset: the member as `base.as_strided(size, stride, offset)`.
    differentiable: the member requires grad (a view made with autograd on); otherwise the
        view is taken of `base.detach()`, as the member itself was.
    """

    base: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    differentiable: bool

    def of(self, base: torch.Tensor) -> torch.Tensor:
        """The member, as a view of the traced base (contiguous, so `view(-1)` is a view).

        Made of composable views (`view`, `slice`), not `as_strided`: functionalization refuses
        a write through a view of an `as_strided` view ("as_strided() is non-compositional"),
        which `self.member[0].add_(1)` would be; nor `unfold`, whose write-back (`unfold_backward`)
        zeroes what its windows do not cover.  `_view` refuses the layouts these cannot make."""
        flat = base if self.differentiable else base.detach()
        flat = flat if flat.dim() == 1 else flat.view(-1)
        if self.stride == _contiguous_strides(self.size):
            part = flat.narrow(0, self.offset, math.prod(self.size))
            return part if len(self.size) == 1 else part.view(self.size)
        (n,), (step,) = self.size, self.stride  # one strided dimension (`_view` checked)
        return flat[self.offset : self.offset + (n - 1) * step + 1 : step]


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _byte_range(t: torch.Tensor) -> tuple[Any, Any]:
    """The bytes of its storage `t` can reach: [first, last + 1)."""
    size = t.element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.storage_offset() * size, (t.storage_offset() + extent) * size


def _groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Positions of tensors whose memory overlaps, transitively; only groups of two or more.

    Tensors on one storage that do not overlap (the parameters of a flattened buffer) are
    independent: no write through one can show through another."""
    by_storage: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() and type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta:
            key = (t.device, t.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append(i)
    groups = []
    for members in by_storage.values():
        members.sort(key=lambda i: _byte_range(tensors[i]))
        current, reach = [members[0]], _byte_range(tensors[members[0]])[1]
        for i in members[1:]:
            first, last = _byte_range(tensors[i])
            if first < reach:
                current.append(i)
                reach = max(reach, last)
            else:
                groups.append(current)
                current, reach = [i], last
        groups.append(current)
    return [g for g in groups if len(g) > 1]


def with_storage_views(state: tuple) -> tuple:
    """`state` (LiftedTensor, in graph order) with a `StorageView` on each tensor that lies in
    another's memory; see Note [State that shares storage]."""
    tensors = [lifted.tensor for lifted in state]
    views = {}
    for group in _groups(tensors):
        base = _base_of(state, group)
        for member in group:
            if member != base:
                views[member] = _view(state, member, base)
    return tuple(dataclasses.replace(lifted, view_of=views.get(i)) for i, lifted in enumerate(state))


def _base_of(state: tuple, group: list[int]) -> int:
    """The first tensor of `group` (parameters before buffers before constants) whose memory
    holds all the others'; it must start its storage and be contiguous."""
    ranges = {i: _byte_range(state[i].tensor) for i in group}
    start, end = min(r[0] for r in ranges.values()), max(r[1] for r in ranges.values())
    holders = [i for i in sorted(group) if ranges[i] == (start, end) and state[i].tensor.is_contiguous()]
    names = ", ".join(repr(state[i].spec.target) for i in sorted(group))
    if not holders:
        raise SharedStorageError(
            f"the module's tensors {names} share memory, and none of them holds the others' memory "
            "whole; export lifts overlapping state as views of one tensor.",
            where=f"{user_frame()} (the export call)",
            fix="register the tensor they are all views of as a buffer too (or make them views of one "
            "of them), or give each its own memory with .clone().",
        )
    base = holders[0]
    if state[base].tensor.storage_offset() != 0:
        raise SharedStorageError(
            f"the module's tensors {names} share memory, and {state[base].spec.target!r}, which holds "
            "the others, does not start at the beginning of its storage; the views' offsets would "
            "depend on how it is laid out when the program runs.",
            where=f"{user_frame()} (the export call)",
            fix="make the shared tensor a tensor of its own (.clone()) and take the others as views of it.",
        )
    return base


def _view(state: tuple, member: int, base: int) -> StorageView:
    """`state[member]` as a view of `state[base]`, or a refusal of what a view cannot be."""
    m, b = state[member].tensor, state[base].tensor
    m_name, b_name = state[member].spec.target, state[base].spec.target
    if m.dtype != b.dtype:
        raise SharedStorageError(
            f"{m_name!r} ({m.dtype}) shares memory with {b_name!r} ({b.dtype}): a view of another "
            "dtype cannot be lifted as a view of it.",
            where=f"{user_frame()} (the export call)",
            fix=f"give {m_name!r} its own memory (.clone()), or reinterpret it inside forward "
            f"({b_name}.view({m.dtype})).",
        )
    if state[member].spec.kind is InputKind.PARAMETER or (m.requires_grad and (m.is_leaf or not b.requires_grad)):
        raise SharedStorageError(
            f"parameter {m_name!r} shares memory with {b_name!r}: in eager it has a gradient of its "
            "own, which a view of another tensor cannot have.",
            where=f"{user_frame()} (the export call)",
            fix=f"share the parameter itself (assign the same nn.Parameter to both names), or give "
            f"{m_name!r} its own memory (nn.Parameter(t.clone())).",
        )
    strided = tuple(m.stride()) != _contiguous_strides(tuple(m.shape))
    if strided and (m.dim() != 1 or m.stride(0) <= 0):
        raise SharedStorageError(
            f"{m_name!r} is a view of {b_name!r} that is neither contiguous nor one strided dimension "
            f"(shape {tuple(m.shape)}, strides {tuple(m.stride())}); export lifts shared state as such views only.",
            where=f"{user_frame()} (the export call)",
            fix=f"keep {m_name!r} out of the module's state and take the view inside forward "
            f"(e.g. {b_name}[:, 1:3]), or give it its own memory (.clone()).",
        )
    return StorageView(base, tuple(m.shape), tuple(m.stride()), m.storage_offset(), m.requires_grad)
