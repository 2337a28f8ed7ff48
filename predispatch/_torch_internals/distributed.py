"""What predispatch asks of torch.distributed's private bindings (c10d's boxed objects) and the
FX global through which make_fx's tracer reads module attributes."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["FX_MODULE_GETATTR", "completed_work", "group_of", "reduce_op_kind"]

#: Where make_fx's `module_getattr_wrapper` finds torch's `nn.Module.__getattr__` at each call
#: (torch/fx/_symbolic_trace.py's module global): a replacement of `nn.Module.__getattr__`
#: alone is shadowed while FX traces.
FX_MODULE_GETATTR = (torch.fx._symbolic_trace, "_orig_module_getattr")


def group_of(process_group: Any) -> tuple[str, int]:
    """The name and size of the group a c10d op received (a boxed ProcessGroup ScriptObject)."""
    group = torch._C._distributed_c10d.ProcessGroup.unbox(process_group)
    return group.group_name, group.size()


def reduce_op_kind(reduce_op: Any) -> str:
    """The RedOpType name (`SUM`, `PREMUL_SUM`, ...) of a c10d op's boxed ReduceOp, whose one
    TorchScript method `op()` returns the type's value."""
    return torch._C._distributed_c10d.ReduceOp.RedOpType(reduce_op.op()).name


def completed_work() -> Any:
    """A completed c10d work, boxed as c10d ops return it (`Work.wait()` returns at once)."""
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(future).boxed()
