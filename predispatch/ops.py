"""predispatch's own operators: `predispatch::keep_history`, in the `predispatch` op namespace,
and the higher-order op `predispatch_autograd_function_apply`.

These are the only non-aten ops our passes add to a graph; each is functional, has a fake
(meta) kernel, and an autograd formula, so programs that contain them trace, run and
differentiate like any other.  See Note [Mutations inside grad regions].  `import
predispatch.ops` registers them, which `torch.export.load` of a `to_torch()` file needs.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import fx

from predispatch import _torch_internals as ti

__all__ = ["FUNCTION_APPLY", "FunctionApply", "keep_history", "subclass_gradient_barrier"]


@torch.library.custom_op("predispatch::keep_history", mutates_args=())
def keep_history(value: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """`value`'s data with `history`'s autograd history: the functional form of an in-place
    update made while grad mode was off (gradients flow to `history` as through identity)."""
    return value.clone()


@keep_history.register_fake
def _keep_history_fake(value: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


def _keep_history_backward(ctx, grad: torch.Tensor):
    return None, grad


keep_history.register_autograd(_keep_history_backward)


@torch.library.custom_op("predispatch::subclass_gradient_barrier", mutates_args=())
def subclass_gradient_barrier(value: torch.Tensor) -> torch.Tensor:
    """`value`'s data, where a plain tensor enters a tensor subclass's `__torch_dispatch__`: a
    gradient reaching it raises, since eager computes that gradient above the subclass, where it
    can be a subclass (Note [Gradients of plain tensors through a subclass] in
    trace/subclass_reads.py).  Without a gradient (inference, a frozen tensor) it is a copy."""
    return value.clone()


@subclass_gradient_barrier.register_fake
def _subclass_gradient_barrier_fake(value: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


def _subclass_gradient_barrier_backward(ctx: Any, grad: torch.Tensor) -> Any:
    from predispatch.errors import UnsupportedConstructError

    raise UnsupportedConstructError(
        "a gradient reached a plain tensor that forward combined with a tensor subclass inside the subclass's "
        "__torch_dispatch__. Eager computes that tensor's gradient with the subclass's own backward (for "
        "torch's TwoTensor it is a TwoTensor); the program computes on the subclass's parts, where it would "
        "be the sum over the parts: not eager's gradient, so none is given.",
        fix="detach that tensor (or freeze what it is computed from: requires_grad_(False)) where its gradient "
        "is not needed, or make it a tensor of the subclass too; a frozen subclass weight with plain "
        "activations, or a library computing on the subclass's parts in __torch_function__ (torchao), is fine.",
    )


subclass_gradient_barrier.register_autograd(_subclass_gradient_barrier_backward)


class FunctionApply(ti.HigherOrderOperator):
    """torch's `autograd_function_apply` whose forward subgraph returns one flat tuple,
    `(*outputs, *saved)`, with `num_outputs` saying where the outputs end.

    Note [Custom backwards that torch.export.load reads]
    ----------------------------------------------------
    torch's HOP takes a forward subgraph returning two lists, `((*outputs), (*saved))`.
    `torch.export.save` writes that, but `torch.export.load` reads a subgraph's outputs one
    value each (`GraphModuleDeserializer.deserialize_graph_output`, torch 2.11 to 2.15) and
    fails.  `to_torch()` therefore gives each captured Function this HOP instead
    (passes/flatten_function_outputs.py): the flat forward serialises like any subgraph, and
    `torch.export.load` resolves `torch.ops.higher_order.predispatch_autograd_function_apply`
    once `predispatch.ops` is imported.  Calling it calls torch's own HOP on the forward with
    its outputs regrouped, so eager runs, `module()`, `run_decompositions()` and torch's joint
    export (`_export_forward_backward`) see exactly torch's `autograd_function_apply`.
    """

    def __init__(self) -> None:
        super().__init__("predispatch_autograd_function_apply")
        self._regrouped: weakref.WeakKeyDictionary[fx.GraphModule, fx.GraphModule] = weakref.WeakKeyDictionary()

    def __call__(self, fwd: fx.GraphModule, bwd: fx.GraphModule, *args: Any, num_outputs: int, **kwargs: Any) -> Any:
        regrouped = self._regrouped.get(fwd)
        if regrouped is None:
            regrouped = self._regrouped[fwd] = regroup_outputs(fwd, num_outputs)
        return ti.autograd_function_apply(regrouped, bwd, *args, **kwargs)


def regroup_outputs(fwd: fx.GraphModule, num_outputs: int) -> fx.GraphModule:
    """A copy of the flat forward `fwd` returning `((*outputs), (*saved))`, as torch's HOP takes it."""
    graph = fx.Graph()
    output = graph.graph_copy(fwd.graph, {})
    values = tuple(output) if isinstance(output, (tuple, list)) else (output,)
    graph.output((values[:num_outputs], values[num_outputs:]))
    return fx.GraphModule(fwd, graph)


FUNCTION_APPLY = FunctionApply()
