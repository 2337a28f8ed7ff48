"""Contract: the graph and its subgraphs hold no op with a mutable schema and no raw toggle.

Raw toggles (`_set_grad_enabled`, autocast enter/exit) are state changes, not values; after
`wrap_regions` they must all have become region HOPs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import fx

from predispatch.errors import NonFunctionalGraphError


#: c10d's in-place collectives: their schemas declare no write (`allreduce_(Tensor[] tensors,
#: ...)`), yet each writes what is named here, or talks to other ranks as a side effect a
#: graph cannot order.  A graph holding one is not functional (Note [In-place collectives]
#: in trace/collectives.py), whatever the schema says.
HIDDEN_WRITES: dict[str, str] = {
    "c10d::allreduce_": "tensors",
    "c10d::allreduce_coalesced_": "tensors",
    "c10d::allgather_": "output_tensors",
    "c10d::_allgather_base_": "output_tensor",
    "c10d::allgather_coalesced_": "output_lists",
    "c10d::allgather_into_tensor_coalesced_": "outputs",
    "c10d::reduce_scatter_": "output_tensors",
    "c10d::_reduce_scatter_base_": "output_tensor",
    "c10d::reduce_scatter_tensor_coalesced_": "outputs",
    "c10d::reduce_": "tensors (on the root)",
    "c10d::broadcast_": "tensors",
    "c10d::gather_": "output_tensors (on the root)",
    "c10d::scatter_": "output_tensors",
    "c10d::alltoall_": "output_tensors",
    "c10d::alltoall_base_": "output",
    "c10d::recv_": "tensors",
    "c10d::recv_any_source_": "tensors",
    "c10d::send": "nothing: sends to another rank",
    "c10d::barrier": "nothing: waits for every rank",
    "c10d::monitored_barrier_": "nothing: waits for every rank",
}


def mutable_ops(gm: fx.GraphModule) -> list[str]:
    """`node: op` for every call of an op whose schema mutates an argument, or that writes
    without its schema saying so (`HIDDEN_WRITES`), subgraphs included."""
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
    return isinstance(target, torch._ops.OpOverload) and (target._schema.is_mutable or target._schema.name in HIDDEN_WRITES)


def _all_nodes(gm: fx.GraphModule) -> Iterator[fx.Node]:
    """Nodes of `gm` and of every GraphModule it holds (region and Function subgraphs)."""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from module.graph.nodes
