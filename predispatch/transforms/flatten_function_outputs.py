"""Give each captured Function of a `to_torch()` graph a forward that `torch.export.load` reads.

torch's `autograd_function_apply` takes a forward subgraph returning two lists, which
`torch.export.load` cannot read back; predispatch's `FUNCTION_APPLY` takes the same forward
returning one flat tuple (Note [Custom backwards that torch.export.load reads] in ops.py):

Before:
    autograd_function_apply = higher_order.autograd_function_apply(ste_fwd_0, ste_bwd_0, mul,
        non_differentiable_idx=[], saved_for_backward_idx=[0])
    ste_fwd_0:  return ((round_1,), (x,))
After:
    autograd_function_apply = higher_order.predispatch_autograd_function_apply(ste_fwd_0, ste_bwd_0, mul,
        non_differentiable_idx=[], saved_for_backward_idx=[0], num_outputs=1)
    ste_fwd_0:  return (round_1, x)

Pre: `gm` is a copy the caller owns (its forward subgraphs are rewritten in place).
Post: no `autograd_function_apply` in `gm` or its subgraphs; the same values computed, with
    the same custom backwards.
"""

from __future__ import annotations

from typing import cast

from torch import fx

from predispatch import _torch_internals as ti
from predispatch.ops import FUNCTION_APPLY

__all__ = ["flatten_function_outputs"]


def flatten_function_outputs(gm: fx.GraphModule) -> int:
    """Rewrite every `autograd_function_apply` call in `gm` and its subgraphs; how many."""
    count = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        calls = module.graph.find_nodes(op="call_function", target=ti.autograd_function_apply)
        flat: dict[str, int] = {}  # forwards already flattened (two calls may share one): their outputs
        for node in calls:
            _flatten(module, node, flat)
        if calls:
            module.recompile()
        count += len(calls)
    return count


def _flatten(module: fx.GraphModule, node: fx.Node, flat: dict[str, int]) -> None:
    """Flatten the forward of one call (once per forward) and retarget the call."""
    target = node.args[0].target
    if target not in flat:
        fwd = cast(fx.GraphModule, module.get_submodule(target))  # a HOP's subgraph
        output = fwd.graph.output_node()
        outputs, saved = cast(tuple, output.args[0])  # ((*outputs), (*saved)): torch's HOP convention
        output.args = ((*outputs, *saved),)
        fwd.recompile()
        flat[target] = len(outputs)
    node.target = FUNCTION_APPLY
    node.kwargs = {**node.kwargs, "num_outputs": flat[target]}
