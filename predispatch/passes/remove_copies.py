"""Replace `aten.copy(dst, src)` by the value it stands for.

Functionalization turns `dst.copy_(src)` into `copy = aten.copy(dst, src)`; the result is
`src` converted to `dst`'s dtype and broadcast to `dst`'s shape.  `aten.copy` has no autograd
formula, so a program holding it cannot be differentiated when run eagerly.

Before:  copy = torch.ops.aten.copy.default(add, keep_history)
After:   (uses of `copy` read `keep_history` directly)

When dtype or shape differ, the value is built from differentiable ops:
`_to_copy(src, dtype=...)`, then `expand(..., dst.shape)` and `clone`.
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten


def remove_copies(gm: fx.GraphModule) -> None:
    """Rewrite every `aten.copy.default` in `gm` and its subgraphs (in place)."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.find_nodes(op="call_function", target=aten.copy.default):
                _replace(module.graph, node)
            module.graph.lint()


def _replace(graph: fx.Graph, node: fx.Node) -> None:
    dst, src = node.args[0], node.args[1]
    dst_val, src_val = dst.meta.get("val"), src.meta.get("val")
    if dst_val is None or src_val is None:
        return
    value = src
    with graph.inserting_before(node):
        if src_val.dtype != dst_val.dtype or src_val.device != dst_val.device:
            value = graph.call_function(aten._to_copy.default, (value,), {"dtype": dst_val.dtype, "device": dst_val.device})
            value.meta["val"] = src_val.to(dtype=dst_val.dtype, device=dst_val.device)
        if tuple(src_val.shape) != tuple(dst_val.shape):
            value = graph.call_function(aten.expand.default, (value, list(dst_val.shape)))
            value = graph.call_function(aten.clone.default, (value,))
            value.meta["val"] = node.meta.get("val")
    node.replace_all_uses_with(value)
    graph.erase_node(node)
