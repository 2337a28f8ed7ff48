"""Lift the tensors a higher-order op's body holds into operands of its call.

torch's HOPs (`TORCH_HOPS`) take their body as a subgraph and its inputs as operands; Dynamo and
torch.export refuse a body that reads a tensor of its own ("expects no freevars").  A grad-mode
or autocast region's body can hold such tensors (ones the trace created), so both `ep.module()`
(runtime/unlift.py) and `to_torch()` (transforms/to_torch.py) move them into placeholders of
the body, threaded through each HOP call, with `lift_from_subgraph`.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import fx

__all__ = ["TORCH_HOPS", "attribute", "hop_body", "lift_from_subgraph"]

#: Higher-order ops torch.export knows as its own (its verifier, serializer,
#: `run_decompositions` and `module()` handle them), with the position of the subgraph among
#: their arguments; the subgraph's operands follow it.  Any other HOP is refused.
TORCH_HOPS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4, "invoke_subgraph": 0}


def attribute(module: torch.nn.Module, target: str) -> Any:
    """`module`'s attribute at the dotted path `target` (a get_attr node's)."""
    for part in target.split("."):
        module = getattr(module, part)
    return module


def hop_body(node: fx.Node) -> fx.Node | None:
    """The subgraph (get_attr) argument of a call to one of `TORCH_HOPS`, else None."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    index = TORCH_HOPS.get(node.target.name())
    return cast(fx.Node, node.args[index]) if index is not None else None  # the HOP's schema: a get_attr


def lift_from_subgraph(gm: fx.GraphModule, path: str) -> list[tuple[str, torch.Tensor, dict]]:
    """Make the tensors `gm` (a copied subgraph) and its own subgraphs read into trailing
    placeholders, threading nested ones through their HOP calls; returns
    `(path, tensor, meta)` for each new placeholder, in order."""
    lifted: list[tuple[str, torch.Tensor, dict]] = []
    by_target: dict[str, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and isinstance(attribute(gm, node.target), torch.Tensor):
            if node.target not in by_target:
                by_target[node.target] = _trailing_placeholder(gm, node.name, node.meta)
                lifted.append((f"{path}.{node.target}", attribute(gm, node.target), node.meta))
            node.replace_all_uses_with(by_target[node.target])
            gm.graph.erase_node(node)
        elif (body := hop_body(node)) is not None:
            inner = lift_from_subgraph(attribute(gm, body.target), f"{path}.{body.target}")
            node.args = (*node.args, *(_trailing_placeholder(gm, p.rsplit(".", 1)[1], m) for p, _, m in inner))
            lifted += inner
    for target in by_target:
        delattr(gm, target)
    gm.recompile()
    return lifted


def _trailing_placeholder(gm: fx.GraphModule, name: str, meta: dict) -> fx.Node:
    placeholders = gm.graph.find_nodes(op="placeholder")
    point = gm.graph.inserting_after(placeholders[-1]) if placeholders else gm.graph.inserting_before(next(iter(gm.graph.nodes)))
    with point:
        node = gm.graph.placeholder(name)
    node.meta = dict(meta)
    return node
