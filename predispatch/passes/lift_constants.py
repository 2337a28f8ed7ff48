"""Lift the tensors a higher-order op's body holds into operands of its call.

torch's HOPs (`TORCH_HOPS`) take their body as a subgraph and its inputs as operands; Dynamo and
torch.export refuse a body that reads a tensor of its own ("expects no freevars").  A grad-mode
or autocast region's body can hold such tensors (ones the trace created), so both `ep.module()`
(runtime/unlift.py) and `to_torch()` (transforms/to_torch.py) move them into placeholders of
the body, threaded through each HOP call, with a `ConstantLifter`.

Note [Each region body once]
----------------------------
A body can be called from several sites: a shared block's region, once the block is inlined at
each of its calls, is one module under a name per call; a file may call a body twice from its
parent's graph, at every level of a nest, so that its call paths number 2^depth in a file linear
in depth.  Every walk that follows calls into bodies (lifting here, `ep.module()`'s rewrites,
`to_torch()`, the picture) remembers the bodies it has done, by identity, and does each once;
each later call reuses what the first one found (here: the same operands).  Lifting a body at
its first call only, as a walk per call did, left every later call without the operands its body
now takes ("missing 1 required positional argument"), and walked the nest 2^depth times.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import fx

__all__ = ["TORCH_HOPS", "ConstantLifter", "Lifted", "attribute", "hop_body"]

#: Higher-order ops torch.export knows as its own (its verifier, serializer,
#: `run_decompositions` and `module()` handle them), with the position of the subgraph among
#: their arguments; the subgraph's operands follow it.  Any other HOP is refused.
TORCH_HOPS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4, "invoke_subgraph": 0}

#: One lifted tensor: its path from the body first lifted (`grad_region_0._tensor_constant0`),
#: the tensor, and its get_attr node's meta.
Lifted = tuple[str, torch.Tensor, dict]


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


class ConstantLifter:
    """Lifts the tensors of (copied) subgraphs into trailing placeholders, each body once
    (Note [Each region body once]).  One lifter per rewrite of a program: it remembers the
    bodies it has lifted by identity, and `lifted_bodies` counts them (tests bound the work)."""

    def __init__(self) -> None:
        self._done: dict[int, list[Lifted]] = {}
        self.lifted_bodies = 0

    def lift(self, gm: fx.GraphModule, path: str) -> list[Lifted]:
        """Make the tensors `gm` and its own subgraphs read into trailing placeholders of `gm`,
        threading nested ones through their HOP calls (every call of a body passes the same
        operands); returns what each new placeholder stands for, in order.  Not recompiled:
        the caller compiles the whole tree once (Note [Load cost] in serialize/graph.py)."""
        if id(gm) in self._done:
            return self._done[id(gm)]
        self.lifted_bodies += 1
        lifted: list[Lifted] = []
        by_path: dict[str, fx.Node] = {}  # a tensor read twice, or by two calls, is one placeholder
        last = [*gm.graph.find_nodes(op="placeholder")[-1:]]

        def placeholder(path: str, tensor: torch.Tensor, meta: dict) -> fx.Node:
            if path not in by_path:
                by_path[path] = _placeholder_after(gm.graph, last, path.rsplit(".", 1)[-1], meta)
                lifted.append((path, tensor, meta))
            return by_path[path]

        held = []
        for node in list(gm.graph.nodes):
            if node.op == "get_attr" and isinstance(value := attribute(gm, node.target), torch.Tensor):
                node.replace_all_uses_with(placeholder(f"{path}.{node.target}", value, node.meta))
                gm.graph.erase_node(node)
                held.append(node.target)
            elif (body := hop_body(node)) is not None:
                inner = self.lift(attribute(gm, body.target), f"{path}.{body.target}")
                node.args = (*node.args, *(placeholder(*entry) for entry in inner))
        for target in dict.fromkeys(held):
            if "." not in target:  # a tensor of a subgraph stays where it is: that subgraph's own
                delattr(gm, target)
        self._done[id(gm)] = lifted
        return lifted


def _placeholder_after(graph: fx.Graph, last: list[fx.Node], name: str, meta: dict) -> fx.Node:
    """A new placeholder after `last[0]` (the graph's last one; first in the graph when there is
    none), which it becomes."""
    point = graph.inserting_after(last[0]) if last else graph.inserting_before(next(iter(graph.nodes)))
    with point:
        node = graph.placeholder(name)
    node.meta = dict(meta)
    last[:] = [node]
    return node
