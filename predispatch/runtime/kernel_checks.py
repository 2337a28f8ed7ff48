"""`ep.module()`'s check of the backward kernels that read an argument as another's shape
(Note [Kernels that trust their arguments' shapes] in passes/kernel_shapes.py, which holds the
rules and `to_torch()`'s form of the same check)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from predispatch.errors import SerializationError, user_frame
from predispatch.passes.kernel_shapes import shape_problem, trusts_shapes

__all__ = ["check_kernel_shapes", "guard_kernel_shapes"]


def guard_kernel_shapes(gm: fx.GraphModule) -> None:
    """Before each call of a kernel that trusts its arguments' shapes, a `check_kernel_shapes`
    call on the same arguments (`ep.module()`)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and trusts_shapes(node.target):
            with gm.graph.inserting_before(node):
                gm.graph.call_function(check_kernel_shapes, (str(node.target), *node.args), dict(node.kwargs))


@fx.node.has_side_effect  # kept by FX's dead-code elimination: it guards the kernel after it
def check_kernel_shapes(kernel: str, *args: Any, **kwargs: Any) -> None:
    """Refuse, before it runs, a call of a kernel that reads an argument as another's shape
    without checking (Note [Kernels that trust their arguments' shapes]); `kernel` is the
    call's target, `args`/`kwargs` its arguments.  Only a crafted file's program can fail it:
    export's own backwards are fed eager's values."""
    namespace, name, overload = kernel.split(".")
    problem = shape_problem(getattr(getattr(getattr(torch.ops, namespace), name), overload), args, kwargs)
    if problem is not None:
        raise SerializationError(
            f"refused to run a kernel: {problem}, so it would read memory outside that argument. Only an edited "
            "file holds such a program; eager autograd never runs one.",
            where=user_frame(),
            fix="load programs only from files predispatch.save wrote; this one was edited (see docs/format.md#threat-model).",
        )
