"""`block_call`: the trace-time HOP that replays a shared body as torch's `invoke_subgraph`.

A `TraceTimeHop` (custom_backward/trace_hop.py): graphs never hold it; in the graph each replayed call is

    invoke_subgraph(body, identifier, *operands)

with the body installed once on the traced module, and its fake outputs are fresh tensors of
the recorded call's output metadata.  Neither the user's forward nor the body's ops run again:
a replay costs one node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from predispatch import _torch_internals as ti
from predispatch.custom_backward.trace_hop import Emitted, Installed, TraceTimeHop


@dataclass(frozen=True, eq=False)
class SharedBody:
    """One body shared by every call of a key.

    body: the GraphModule `(*operands) -> (*outputs, *new values of mutated operands)`.
    name: its attribute name on the traced module (`repeated_body_0`), also the HOP's identifier.
    outputs: for each output, (shape, stride, dtype, device, requires_grad) of the recorded call.
    """

    body: fx.GraphModule
    name: str
    outputs: tuple[tuple, ...]


def _emit(tracer: Any, shared: SharedBody) -> Emitted:
    """Install the body once; the node is torch's `invoke_subgraph(body, identifier, *operands)`."""
    if not hasattr(tracer.root, shared.name):
        tracer.root.register_module(shared.name, shared.body)
    names = [getattr(n, "name", "out") for n in shared.body.graph.output_node().args[0]]
    return Emitted(ti.invoke_subgraph, (Installed(shared.name, shared.body), shared.name), names)


def _fake(mode: Any, shared: SharedBody, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Fresh fake tensors with the recorded outputs' metadata (the body's input metadata is
    part of the key, so its outputs' metadata is the same)."""
    return tuple(ti.fake_empty(mode, shape, stride, dtype, device) for shape, stride, dtype, device, _requires_grad in shared.outputs)


block_call = TraceTimeHop(
    "predispatch_block_call",
    emit=_emit,
    fake=_fake,
    non_differentiable=lambda shared: [i for i, meta in enumerate(shared.outputs) if not meta[4]],
)


def replay_call(shared: SharedBody, recorded: Any, operands: Sequence[torch.Tensor]) -> Any:
    """One call of a shared block: the HOP on the operands the body reads, the in-place changes
    it made written back to their tensors, the result rebuilt in the recorded call's structure."""
    outputs = block_call(shared, *(operands[i] for i in recorded.used), *recorded.symbols)
    n_user = len(recorded.outputs) - len(recorded.mutated)
    for value, i in zip(outputs[n_user:], recorded.mutated):
        _write_back(operands[i], value)
    tensors = iter(outputs[:n_user])
    leaves = [_leaf(leaf, tensors, operands) for leaf in recorded.out_leaves]
    return pytree.tree_unflatten(leaves, recorded.out_spec)


def _write_back(operand: torch.Tensor, value: torch.Tensor) -> None:
    """The operand's new value, as the inline trace leaves it: the body's output itself (same
    metadata, so no `copy_`, whose node build would remove again) when that is what it is."""
    same = (operand.shape, operand.stride(), operand.dtype, operand.device) == (value.shape, value.stride(), value.dtype, value.device)
    if same and isinstance(operand, ti.FunctionalTensor) and isinstance(value, ti.FunctionalTensor):
        ti.set_functional_value(operand, value)
    else:
        operand.copy_(value)


@dataclass(frozen=True)
class PassThrough:
    """An output that is one of the block's operands itself (T5 hands `position_bias` on):
    the replay returns that very tensor, as eager does."""

    operand: int


class _BodyOutput:
    """Where the next output of the body goes in the rebuilt result."""

    def __repr__(self) -> str:
        return "BODY_OUTPUT"


BODY_OUTPUT = _BodyOutput()


def _leaf(leaf: Any, tensors: Any, operands: Sequence[torch.Tensor]) -> Any:
    if leaf is BODY_OUTPUT:
        return next(tensors)
    if isinstance(leaf, PassThrough):
        return operands[leaf.operand]
    return leaf  # a constant (plain values are their own snapshot)
