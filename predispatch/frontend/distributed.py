"""Distributed state export refuses by name, before anything is traced (Note [Distributed state]).

Note [Distributed state]
------------------------
A DTensor parameter (tensor parallelism through `parallelize_module`, `distribute_tensor`)
is a global tensor whose rank holds a shard; DTensor communicates inside its own dispatch.
Faked as a plain tensor of its metadata it became a parameter of the *global* shape with no
collective in the graph: a program no rank runs, correct only by accident (when DTensor's
own dispatch happened to run at call time).  FSDP2 (`fully_shard`) shards parameters as
DTensors too, and gathers them in forward pre-hooks and reduce-scatters their gradients in
backward callbacks on streams of its own: none of that is forward's code.  DDP all-reduces
gradients in its reducer's autograd hooks, likewise outside forward; its program is the
wrapped module's, wrapped in DDP again (`DistributedDataParallel(ep.module())`).

A module with DTensor state is exported per rank instead (Note [Per-rank DTensor programs] in
frontend/per_rank.py): the stand-in module holds the rank's shards, so no DTensor reaches the
trace.  What is left is refused with `DistributedError`: DDP and FSDP2 (checked first, since
FSDP2's parameters are DTensors too), naming the module and what works instead (each rank's
shard as a plain parameter, gathered in forward with torch's functional collectives:
docs/distributed.md), and a DTensor input of a model without DTensor state.  The checks read
`sys.modules` first: a process that never imported torch.distributed's tensor or FSDP
packages has no such state.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from predispatch.errors import DistributedError, user_frame

__all__ = ["is_dtensor", "refuse_distributed_state", "refuse_wrapped"]

_WHAT_WORKS = (
    "keep each rank's shard as a plain tensor (t.to_local() of a DTensor, as an nn.Parameter) and write "
    "the communication in forward with torch.distributed._functional_collectives (all_gather_tensor_autograd "
    "to gather a sharded weight, all_reduce / reduce_scatter_tensor_autograd for partial results): those "
    "export with their backward; see docs/distributed.md."
)


def refuse_wrapped(module: nn.Module) -> None:
    """Raise `DistributedError` for a DDP-wrapped or FSDP2-sharded module (FSDP2's parameters
    are DTensors too: this runs before DTensor state is made per-rank)."""
    _refuse_ddp(module)
    _refuse_fsdp2(module)


def refuse_distributed_state(module: nn.Module, state: Any, user_tensors: list[torch.Tensor]) -> None:
    """Raise `DistributedError` for DTensor state or inputs left after the per-rank stand-in
    (frontend/per_rank.py) replaced a module's DTensor state: DTensor inputs."""
    for lifted in state:
        if is_dtensor(lifted.tensor):
            kind = lifted.spec.kind.name.lower().replace("_", " ")
            raise _dtensor_error(f"{kind} {lifted.spec.target!r}", lifted.tensor)
    for i, tensor in enumerate(user_tensors):
        if is_dtensor(tensor):
            raise _dtensor_error(f"tensor input {i}", tensor)


def is_dtensor(value: Any) -> bool:
    """Whether `value` is a DTensor (none exist before torch.distributed.tensor is imported,
    which this does not do)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _dtensor_error(what: str, tensor: Any) -> DistributedError:
    placements = ", ".join(str(p) for p in tensor.placements)
    return DistributedError(
        f"{what} is a DTensor (placements ({placements}) on {tensor.device_mesh}, global shape "
        f"{tuple(tensor.shape)}, this rank's shard {tuple(tensor.to_local().shape)}); export would make it a "
        "plain tensor of the global shape with DTensor's communication lost: a program no rank runs.",
        where=f"{user_frame()} (the export call)",
        fix=_WHAT_WORKS,
    )


def _refuse_ddp(module: nn.Module) -> None:
    """DistributedDataParallel all-reduces gradients in its reducer's autograd hooks, which a
    program of forward does not hold (torch's trace stops at its compiler-disabled forward)."""
    for path, sub in module.named_modules():
        if isinstance(sub, nn.parallel.DistributedDataParallel):
            name = f"submodule {path!r}" if path else "the module"
            inner = f"{path}.module" if path else "ddp.module"
            raise DistributedError(
                f"{name} is DistributedDataParallel: it all-reduces gradients in autograd hooks of its "
                "reducer, outside forward's code, so a graph of forward cannot hold them.",
                where=f"{user_frame()} (the export call)",
                fix=f"export the wrapped module ({inner}) and wrap the program in DDP: "
                "DistributedDataParallel(ep.module()) all-reduces the program's gradients as DDP does the model's; "
                "see docs/distributed.md.",
            )


def _refuse_fsdp2(module: nn.Module) -> None:
    if "torch.distributed.fsdp" not in sys.modules:
        return
    fsdp_module = getattr(sys.modules["torch.distributed.fsdp"], "FSDPModule", None)
    if fsdp_module is None:
        return
    for path, sub in module.named_modules():
        if isinstance(sub, fsdp_module):
            name = f"submodule {path!r}" if path else "the module"
            raise DistributedError(
                f"{name} is sharded by FSDP2 (fully_shard): its parameters are gathered by forward pre-hooks "
                "and their gradients reduce-scattered by backward callbacks, outside forward's code, so a "
                "graph of forward cannot hold them.",
                where=f"{user_frame()} (the export call)",
                fix="export the model before fully_shard, or shard it SimpleFSDP's way: Shard(0) DTensor parameters "
                "gathered for compute in forward (a parametrization calling redistribute) export per rank; or "
                + _WHAT_WORKS,
            )
