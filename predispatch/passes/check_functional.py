"""Contract: the graph and all its subgraphs hold no op with a mutable schema."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

from predispatch.errors import NonFunctionalGraphError


def mutable_ops(gm: fx.GraphModule) -> list[str]:
    """`node: op` for every call of an op whose schema mutates an argument, subgraphs included."""
    return [f"{node.name}: {node.target}" for node in _all_nodes(gm) if _is_mutable(node.target)]


def check_functional(gm: fx.GraphModule) -> None:
    """Raise if any mutable op is left: a broken contract between stages, not a user error."""
    found = mutable_ops(gm)
    if found:
        raise NonFunctionalGraphError(
            f"the exported graph still mutates: {', '.join(found)}",
            fix="report this model to predispatch; meanwhile decompose=[op] may avoid it.",
        )


def _is_mutable(target: object) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _all_nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """Nodes of `gm` and of every GraphModule it holds (region and Function subgraphs)."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from module.graph.nodes
