"""Contract: the graph and its subgraphs hold no op with a mutable schema and no raw toggle.

Raw toggles (`_set_grad_enabled`, autocast enter/exit) are state changes, not values; after
`wrap_regions` they must all have become region HOPs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

from predispatch.errors import NonFunctionalGraphError


def mutable_ops(gm: fx.GraphModule) -> list[str]:
    """`node: op` for every call of an op whose schema mutates an argument, subgraphs included."""
    return [f"{node.name}: {node.target}" for node in _all_nodes(gm) if _is_mutable(node.target)]


def raw_toggles(gm: fx.GraphModule) -> list[str]:
    """`node: target` for every raw grad-mode or autocast toggle left, subgraphs included."""
    from predispatch.passes.wrap_regions import TOGGLES

    return [f"{node.name}: {node.target.__name__}" for node in _all_nodes(gm) if node.target in TOGGLES]


def check_functional(gm: fx.GraphModule) -> None:
    """Raise if any mutable op or raw toggle is left: a broken contract between stages, not a user error."""
    found = mutable_ops(gm) + raw_toggles(gm)
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
