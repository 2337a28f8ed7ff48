"""Forward reading a tensor subclass's own tensors, with eager's gradients.

Note [Reading a subclass's tensors in forward]
----------------------------------------------
The trace computes on a subclass's plain tensors (Note [Tensor subclasses] in
frontend/subclasses.py), and where the subclass parameter or input requires grad, those parts
are traced requiring grad: the ops the subclass's `__torch_dispatch__` runs on them carry the
gradient back to the subclass, as eager's autograd does above the subclass.

Forward itself may also read the tensors (`w.qdata`, `p.get_elem_a()`, a library's
`__torch_function__` computing `F.linear` on `w.qdata * w.scale`).  In eager those reads are
the stored tensors, with the stored tensors' `requires_grad` (a subclass parameter's inner
tensors usually have none): no gradient flows through them.  So while forward runs, such a read
of a part that is stored without grad but traced with it gives the part `detach()`ed, traced as
eager's value is; reads by the subclass's own dispatch (`ti.inside_subclass_dispatch`) get the
part itself.  A subclass forward builds from traced tensors keeps its tensors as given, as in
eager.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from predispatch import _torch_internals as ti
from predispatch import ops  # noqa: F401 - registers predispatch::subclass_gradient_barrier

__all__ = ["PLAIN_GRADIENTS", "eager_part_reads", "guard_plain_gradients", "SUBCLASS_READS"]

SUBCLASS_READS = "reads of a tensor subclass's tensors in forward (the subclass's __getattribute__)"


@contextlib.contextmanager
def eager_part_reads(subclasses: list[tuple[torch.Tensor, frozenset[str]]]) -> Iterator[None]:
    """While active, forward's reads of the named parts of each traced subclass (those eager
    stores without grad while the trace gives them grad) give them detached (see the Note)."""
    detached = {id(traced): names for traced, names in subclasses if names}
    classes = {type(traced) for traced, names in subclasses if names}
    with contextlib.ExitStack() as stack:
        for cls in classes:
            stack.enter_context(ti.patched(cls, "__getattribute__", lambda original: _reading(original, detached), mechanism=SUBCLASS_READS))
        yield


def _reading(original: Any, detached: dict[int, frozenset[str]]) -> Any:
    def __getattribute__(self: Any, name: str) -> Any:
        value = original(self, name)
        names = detached.get(id(self))
        if names is not None and name in names and not ti.inside_subclass_dispatch():
            return value.detach()
        return value

    return __getattribute__


# Note [Gradients of plain tensors through a subclass]
# Eager's autograd runs above a subclass: the backward of `mm(x, w)` with a `TwoTensor` `w` is
# computed on TwoTensors, so a plain `x` that requires grad gets a TwoTensor gradient.  The
# program computes below the subclass, on its parts: `x` feeds each part's `mm`, and autograd
# would sum what comes back into one plain gradient.  Those differ, and whether `x` requires
# grad is known only at run time (the trace does not compute `requires_grad` of intermediates).
# So each floating plain tensor entering a subclass's `__torch_dispatch__` from forward passes
# `predispatch::subclass_gradient_barrier` (predispatch/ops.py): a copy, whose backward raises
# our error if a gradient ever reaches it.  Inference, frozen tensors, and a library computing
# on the subclass's parts in its `__torch_function__` (torchao's `F.linear`: eager's gradient
# there is plain too) never reach it.
#
# A class whose own backward gives a plain tensor a plain gradient, equal to the sum over its
# parts the program computes, needs no barrier: `PLAIN_GRADIENTS` names those classes, each with
# the evidence.


#: Tensor subclasses through whose dispatch eager gives a plain tensor a plain gradient: the
#: program's gradient (through the parts) is eager's, so no barrier is placed.
PLAIN_GRADIENTS: dict[type, str] = {
    ti.NestedTensor: "a jagged nested tensor's ops reduce over the jagged dimension in backward (linear_backward "
    "gives a Linear's weight a dense gradient; a broadcast plain operand's gradient is summed over the tokens): "
    "tests/test_nested.py compares the gradients with eager's",
}


def guard_plain_gradients(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of a subclass op forward runs, each floating plain tensor behind the
    gradient barrier (Note [Gradients of plain tensors through a subclass])."""
    classes = {type(v) for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor) and ti.is_traceable_wrapper_subclass(v)}
    if classes and all(cls in PLAIN_GRADIENTS for cls in classes):
        return args, kwargs

    def guarded(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and not ti.is_traceable_wrapper_subclass(value) and value.is_floating_point():
            return torch.ops.predispatch.subclass_gradient_barrier(value)
        return value

    return tuple(pytree.tree_map(guarded, list(args))), pytree.tree_map(guarded, kwargs)
