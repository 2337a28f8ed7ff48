"""In-place c10d collectives in forward: exported as torch's functional collectives, or refused by name.

Note [In-place collectives]
---------------------------
`dist.all_reduce(y)` reaches the dispatcher as `c10d::allreduce_(Tensor[] tensors, ...)`,
whose schema does not declare that it writes `tensors`: functionalization passes it through as
an opaque call, the graph keeps it, and the functional check (which reads schemas) saw nothing.
Run, the program then reduced a tensor nobody read again (or raced with the read, the op being
asynchronous): wrong outputs, silently.

So the trace runs each such op as what torch's own compiler turns it into
(`traceable_collective_remaps` in torch/distributed/_functional_collectives.py, which Dynamo
applies at the Python level): the functional collective of `_c10d_functional`, its
`wait_tensor`, and the write of the result into the tensor the op wrote (a `copy_`, which
functionalization turns into the program's own write-back).  The collective reads the tensor
detached and the written value is `keep_history(value, old)`: eager's c10d kernel is invisible
to autograd (the gradient passes through the written tensor as if the collective were not
there, torch's autograd-not-implemented fallback), and `keep_history` is how a write out of
autograd's sight keeps that history (Note [Mutations inside grad regions]).

The op's `async_op` flag is accepted either way: eager's value is defined only after the
user's `work.wait()`, and the program's write is complete before any later read.  The work
the op returns is an already completed one.  The ops torch has no functional twin for
(`alltoall_`, `send`, `recv_`, `gather_`, `scatter_`, `reduce_`, `barrier`, the coalesced
forms), and a reduction the twin cannot express (`PREMUL_SUM`, a sparse all-reduce), are
refused with `DistributedError` naming the op and the user's line.  `passes.check_functional`
knows every c10d op that writes (`HIDDEN_WRITES` there), so one that got past this would still
fail the functional check rather than run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from predispatch import _torch_internals as ti
from predispatch import ops  # noqa: F401 - registers predispatch::keep_history
from predispatch.errors import DistributedError, user_frame
from predispatch.passes.check_functional import HIDDEN_WRITES
from predispatch.trace.decompose import Rewrite

__all__ = ["COLLECTIVE_REWRITES"]


#: c10d's reduction kinds and the names `_c10d_functional` takes; PREMUL_SUM carries a factor
#: the functional op has no argument for.
_REDUCE_OP_NAMES = {"SUM": "sum", "AVG": "avg", "PRODUCT": "product", "MIN": "min", "MAX": "max", "BAND": "band", "BOR": "bor", "BXOR": "bxor"}


def _reduce_op(reduce_op: Any, op: str) -> str:
    """The `_c10d_functional` name of the reduction a c10d op received."""
    kind = ti.reduce_op_kind(reduce_op)
    if kind not in _REDUCE_OP_NAMES:
        raise _refusal(op, f"its reduction {kind} has no functional collective")
    return _REDUCE_OP_NAMES[kind]


def _write(target: torch.Tensor, value: torch.Tensor) -> None:
    """`target` takes `value` as eager's kernel writes it, out of autograd's sight: gradients
    reach `target`'s history as if it had not been written (`keep_history`, as a write under
    no_grad is kept: Note [Mutations inside grad regions])."""
    if target.is_floating_point() or target.is_complex():
        value = torch.ops.predispatch.keep_history(value, target)
    target.copy_(value)


_f = torch.ops._c10d_functional if torch.distributed.is_available() else None


def _allreduce_(tensors, process_group, reduce_op, sparse_indices=None, async_op=True, timeout=-1):
    """`c10d::allreduce_`'s arguments (`dist.all_reduce`); so are the others' below."""
    if sparse_indices is not None:
        raise _refusal("c10d.allreduce_", "a sparse all-reduce has no functional collective")
    name, _ = ti.group_of(process_group)
    op = _reduce_op(reduce_op, "c10d.allreduce_")
    for t in tensors:
        _write(t, _f.wait_tensor(_f.all_reduce(t.detach(), op, name)))
    return tensors, ti.completed_work()


def _allgather_base_(output, input, process_group, async_op=True, timeout=-1):
    name, size = ti.group_of(process_group)
    _write(output, _f.wait_tensor(_f.all_gather_into_tensor(input.detach(), size, name)))
    return output, ti.completed_work()


def _reduce_scatter_base_(output, input, process_group, reduce_op, async_op=True, timeout=-1):
    name, size = ti.group_of(process_group)
    op = _reduce_op(reduce_op, "c10d._reduce_scatter_base_")
    _write(output, _f.wait_tensor(_f.reduce_scatter_tensor(input.detach(), op, size, name)))
    return output, ti.completed_work()


def _allgather_(output_tensors, input_tensors, process_group, async_op=True, timeout=-1):
    name, size = ti.group_of(process_group)
    for outputs, input in zip(output_tensors, input_tensors):
        if any(o.shape != input.shape or o.dtype != input.dtype for o in outputs):
            raise _refusal("c10d.allgather_", "its outputs differ in shape or dtype from the input")
        gathered = _f.wait_tensor(_f.all_gather_into_tensor(input.detach().contiguous(), size, name))
        for out, part in zip(outputs, gathered.chunk(size)):
            _write(out, part)
    return output_tensors, ti.completed_work()


def _broadcast_(tensors, process_group, root_rank, root_tensor, async_op=True, timeout=-1):
    name, _ = ti.group_of(process_group)
    if root_tensor != 0:
        raise _refusal("c10d.broadcast_", "a broadcast from a tensor other than the first has no functional collective")
    for t in tensors:
        _write(t, _f.wait_tensor(_f.broadcast(t.detach(), root_rank, name)))
    return tensors, ti.completed_work()


def _refusal(op: str, why: str) -> DistributedError:
    return DistributedError(
        f"forward calls the in-place collective {op} ({why}); its schema hides the write, so a graph "
        "cannot hold it as it is.",
        where=user_frame(),
        fix="write it with torch.distributed._functional_collectives (all_reduce, "
        "all_gather_tensor_autograd, reduce_scatter_tensor_autograd, all_to_all_single_autograd), "
        "which export with their backward, or call it outside forward.",
    )


def _refused(op: str) -> Callable[..., Any]:
    """What the trace runs for an in-place collective without a functional twin: the refusal."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _refusal(op, "torch has no functional collective for it")

    return refuse


#: The in-place collectives torch has a functional twin for: what runs instead, and what it becomes.
_FUNCTIONAL: dict[str, tuple[Callable[..., Any], str]] = {
    "c10d::allreduce_": (_allreduce_, "dist.all_reduce: _c10d_functional.all_reduce + wait_tensor + the write"),
    "c10d::_allgather_base_": (
        _allgather_base_,
        "dist.all_gather_into_tensor: _c10d_functional.all_gather_into_tensor + wait_tensor + the write",
    ),
    "c10d::_reduce_scatter_base_": (
        _reduce_scatter_base_,
        "dist.reduce_scatter_tensor: _c10d_functional.reduce_scatter_tensor + wait_tensor + the write",
    ),
    "c10d::allgather_": (_allgather_, "dist.all_gather: one all_gather_into_tensor, its chunks written to the outputs"),
    "c10d::broadcast_": (_broadcast_, "dist.broadcast: _c10d_functional.broadcast + wait_tensor + the write"),
}


def _collective_rewrites() -> dict[torch._ops.OpOverload, Rewrite]:
    """Every c10d op that writes (`HIDDEN_WRITES`): its functional form, or its refusal."""
    if not torch.distributed.is_available():
        return {}
    table = {}
    for qualified in HIDDEN_WRITES:
        fn, reason = _FUNCTIONAL.get(qualified, (_refused(qualified.replace("::", ".")), "no functional twin: refused"))
        op = getattr(torch.ops.c10d, qualified.split("::")[1]).default
        table[op] = Rewrite(fn, reason)  # no skips: c10d ops are not composites
    return table


#: What the trace runs for each in-place c10d op; see Note [In-place collectives].
COLLECTIVE_REWRITES = _collective_rewrites()
