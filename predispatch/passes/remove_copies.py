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
            _remove_copies(module.graph)
            module.graph.lint()


def _remove_copies(graph: fx.Graph) -> None:
    """Each copy's users read its value instead; the output node's reads are rewritten once.

    Most copies are new values of state (an update of every parameter), so most are read by the
    output node, and FX rewrites a user by rebuilding all its arguments: one rewrite of the
    output per copy made the pass quadratic in the state written.  The output's reads are
    rewritten in one assignment instead, made when the last copy it reads is replaced, where
    the one-by-one rewrites made their last one, so every node's users stay in the same order.
    """
    copies = list(graph.find_nodes(op="call_function", target=aten.copy.default))
    output = graph.output_node()
    last = max((i for i, node in enumerate(copies) if output in node.users), default=-1)
    returned: dict[fx.Node, fx.Node] = {}  # copy -> its value, for the output node
    for i, node in enumerate(copies):
        value = _value_of(graph, node)
        if value is not None:
            node.replace_all_uses_with(value, delete_user_cb=lambda user: user is not output)
            if output in node.users:
                returned[node] = value
            else:
                graph.erase_node(node)
        if i == last and returned:
            output.args = fx.map_arg(output.args, lambda n: returned.get(n, n))
            for copy in returned:
                graph.erase_node(copy)


def _value_of(graph: fx.Graph, node: fx.Node) -> fx.Node | None:
    """What `copy(dst, src)` stands for: `src`, converted to `dst`'s dtype and device and broadcast
    to its shape by new nodes where they differ; None when the values' metadata is unknown."""
    dst, src = node.args[0], node.args[1]
    assert isinstance(dst, fx.Node) and isinstance(src, fx.Node), node.format_node()  # aten.copy takes tensors
    dst_val, src_val = dst.meta.get("val"), src.meta.get("val")
    if dst_val is None or src_val is None:
        return None
    value = src
    with graph.inserting_before(node):
        if src_val.dtype != dst_val.dtype or src_val.device != dst_val.device:
            value = graph.call_function(aten._to_copy.default, (value,), {"dtype": dst_val.dtype, "device": dst_val.device})
            value.meta["val"] = src_val.to(dtype=dst_val.dtype, device=dst_val.device)
        if tuple(src_val.shape) != tuple(dst_val.shape):
            value = graph.call_function(aten.expand.default, (value, list(dst_val.shape)))
            value = graph.call_function(aten.clone.default, (value,))
            value.meta["val"] = node.meta.get("val")
    return value
