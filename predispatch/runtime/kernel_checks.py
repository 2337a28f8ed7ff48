"""Backward kernels that trust their gradient's shape, checked before each call in `ep.module()`.

Note [Kernels that trust their gradient's shape]
------------------------------------------------
A backward kernel also takes the gradient of its forward's output, and some read it as if it
had that output's shape without checking (`GRAD_SHAPES`): `native_layer_norm_backward` given a
one-element `grad_out` reads past it for every element of its input.  Unlike a saved statistic,
a gradient comes from whatever the backward computed before, so no graph-local proof exists;
`ep.module()` checks its shape before each call of such a kernel (`grad_shape_problem`, the
`check_kernel_gradient` node `guard_kernel_gradients` puts before it) and raises `SerializationError` instead of running it.
They were found by running every allowed backward kernel autograd calls on torch's OpInfo
samples with a gradient shrunk to ones and grown to twice its sizes (serialize/kernel_inputs.py's `probe_gradients`,
`python -m predispatch.serialize.kernel_inputs --probe`): a kernel that neither raises nor broadcasts is
listed here, or in `GRAD_SHAPE_SAFE` with why its reads stay inside the tensors it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from predispatch.errors import SerializationError, user_frame

__all__ = [
    "GRAD_SHAPES", "GRAD_SHAPE_SAFE", "GradShape", "check_kernel_gradient", "grad_shape_problem", "guard_kernel_gradients",
    "packet_of", "trusts_gradient_shape",
]


@dataclass(frozen=True)
class GradShape:
    """A backward kernel that reads its gradient argument as its forward output's shape.

    grad: the gradient argument's name.
    expected: the shape it must have, from the call's other arguments (by schema name).
    reason: what the kernel reads.
    """

    grad: str
    expected: Callable[[dict], tuple[int, ...]]
    reason: str


def _like(argument: str) -> Callable[[dict], tuple[int, ...]]:
    return lambda bound: tuple(bound[argument].shape)


def _grid_sample_output(bound: dict) -> tuple[int, ...]:
    """(N, C, *grid's spatial sizes): the shape grid_sampler_2d gave its output."""
    return (*bound["input"].shape[:2], *bound["grid"].shape[1:-1])


#: Kernels given a gradient whose shape they do not check (Note [Kernels that trust their
#: gradient's shape]), by packet.
GRAD_SHAPES: Mapping[str, GradShape] = {
    "aten.native_layer_norm_backward": GradShape("grad_out", _like("input"), "reads grad_out for every element of input"),
    "aten.native_batch_norm_backward": GradShape("grad_out", _like("input"), "reads grad_out for every element of input"),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": GradShape(
        "grad_out", _like("out"), "reads grad_out for every element of out"),
    "aten.grid_sampler_2d_backward": GradShape(
        "grad_output", _grid_sample_output, "reads grad_output for every sampled point of every channel"),
    "aten._ctc_loss_backward": GradShape("grad", _like("neg_log_likelihood"), "reads grad for every sample of the batch"),
}

#: Kernels the probe finds accepting a gradient of another shape, whose reads still stay inside
#: the tensors they are given, with why.
GRAD_SHAPE_SAFE: Mapping[str, str] = {
    "aten._log_softmax_backward_data": "walks grad_output's own shape (its result has that shape); output is read inside it",
    "aten.embedding_dense_backward": "views grad_output as (indices, -1): a size that does not divide raises, the row width follows grad",
    "aten._cdist_backward": "reads grad inside the (x1 rows, x2 rows) block its inputs define; a larger grad is read in part",
}


def trusts_gradient_shape(target: Any) -> bool:
    """Whether `target` is a call of a `GRAD_SHAPES` kernel (checked before each call)."""
    return packet_of(target) in GRAD_SHAPES


def grad_shape_problem(target: Any, args: tuple, kwargs: dict) -> str | None:
    """Why a call of `target` (a `GRAD_SHAPES` kernel) must not run on these arguments, or None."""
    check = GRAD_SHAPES.get(packet_of(target) or "")
    if check is None:
        return None
    bound = _bound_values(target, args, kwargs)
    grad, expected = bound[check.grad], check.expected(bound)
    if tuple(grad.shape) == expected:
        return None
    return (f"{target} is given {check.grad} of shape {tuple(grad.shape)} where its forward's output has shape "
            f"{expected}: the kernel {check.reason} without checking")


def _bound_values(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    values = dict(zip((a.name for a in target._schema.arguments), args))
    values.update(kwargs)
    return values


def packet_of(target: Any) -> str | None:
    """`aten.native_layer_norm_backward` for any of its overloads; None for a non-op target."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    namespace, name = target._schema.name.split("::")
    return f"{namespace}.{name}"




def guard_kernel_gradients(gm: fx.GraphModule) -> None:
    """Before each call of a kernel that trusts its gradient's shape, a `check_kernel_gradient`
    call on the same arguments."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and trusts_gradient_shape(node.target):
            with gm.graph.inserting_before(node):
                gm.graph.call_function(check_kernel_gradient, (str(node.target), *node.args), dict(node.kwargs))


@fx.node.has_side_effect  # kept by FX's dead-code elimination: it guards the kernel after it
def check_kernel_gradient(kernel: str, *args: Any, **kwargs: Any) -> None:
    """Refuse, before it runs, a call of a kernel that reads its gradient as its forward
    output's shape without checking (Note [Kernels that trust their gradient's shape] in
    serialize/kernel_inputs.py); `kernel` is the call's target, `args`/`kwargs` its arguments.
    Only a crafted file's program can fail it: export's own backwards are fed eager's gradients."""
    namespace, name, overload = kernel.split(".")
    problem = grad_shape_problem(getattr(getattr(getattr(torch.ops, namespace), name), overload), args, kwargs)
    if problem is not None:
        raise SerializationError(
            f"refused to run a kernel: {problem}, so it would read memory outside the gradient. Only an edited "
            "file holds such a program; eager autograd never runs one.",
            where=user_frame(),
            fix="load programs only from files predispatch.save wrote; this one was edited (see docs/format.md#threat-model).",
        )
