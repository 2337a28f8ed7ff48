"""What `ep.module()` checks and does around a call's write-backs (standalone, runner-agnostic).

Note [All or nothing calls]
---------------------------
A program that mutates its inputs or state writes the new values back after the graph has run
(`copy_`, or `as_strided_` for a metadata mutation).  Eager would have raised, at the in-place
op, for some targets; the program must raise too, and before it has changed anything: not a
buffer written and then a raw RuntimeError from the input's `copy_`.  So every target is checked
*before the graph runs* (which also keeps the RNG untouched by a failing call), with eager's own
rules:

- internal memory overlap (`x.expand(...)`): eager refuses to write a tensor whose elements
  share memory ("more than one element of the written-to tensor refers to a single memory
  location");
- an inference tensor outside inference mode ("Inplace update to inference tensor outside
  InferenceMode is not allowed");
- a leaf that requires grad (or a view of one) written while grad mode is on ("a leaf Variable
  that requires grad is being used in an in-place operation").  Whether grad mode is on at the
  write is read off the graph (`plan_writes`): a value made in a `no_grad` region
  (`keep_history` or the region's result) was written with grad off, one made in an
  `enable_grad` region with grad on, and any other with the caller's mode.  This is
  conservative: a write through `x.data` or `x.detach()` at the top level is refused here for a
  leaf that requires grad, although eager allows it.  (The trace gets such a write wrong too:
  later uses differentiate through the update as if it were recorded; a write under
  `torch.no_grad()` is kept right by Note [Mutations inside grad regions].);
- a target sharing memory with another input of the call: the program takes its inputs as
  independent values, so eager's change seen through the other alias would be lost silently.

The helpers take plain lists so any runner (today's `ProgramModule`, or a generated
`GraphModule`) can call them.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from predispatch import _torch_internals as ti
from predispatch.errors import MutationTargetError, user_frame
from predispatch.program.signature import ExportSignature, InputKind, OutputKind

#: How a mutation's target is named in messages, by the kind of the mutation.
_TARGET_NOUN = {
    OutputKind.PARAMETER_MUTATION: "parameter",
    OutputKind.BUFFER_MUTATION: "buffer",
    OutputKind.USER_INPUT_MUTATION: "input",
    OutputKind.USER_INPUT_METADATA_MUTATION: "input",
}


@dataclass(frozen=True)
class WritePlan:
    """What one mutation output of a program writes back, resolved once per `ep.module()`.

    label: how the user knows the target, for messages (`buffer 'bn.running_mean'`, `input 'x'`;
        a user input is named by its pytree path, not its placeholder).
    grad_mode: the grad mode the last write ran under in forward: True or False when a grad
        region fixed it, None for the caller's mode (see Note [All or nothing calls]).
    metadata: the target's shape, strides or storage offset change (`x.t_()`): applied with
        `as_strided_` (see `apply_metadata_mutation`).
    writes_data: the target's data change (False for a pure metadata change, whose new value
        is a view of the input itself).
    """

    label: str
    grad_mode: bool | None
    metadata: bool = False
    writes_data: bool = True


def plan_writes(graph_module: fx.GraphModule, signature: ExportSignature) -> tuple[WritePlan, ...]:
    """One `WritePlan` per mutation output of the program, in output order."""
    paths = {s.name: s.target for s in signature.inputs_of(InputKind.USER_INPUT)}
    placeholders = {n.name: n for n in graph_module.graph.find_nodes(op="placeholder")}
    outputs = graph_module.graph.output_node().args[0]
    plans = []
    for spec, node in zip(signature.mutations, outputs):
        label = f"{_TARGET_NOUN[spec.kind]} {paths.get(spec.target, spec.target)!r}"
        metadata = spec.kind is OutputKind.USER_INPUT_METADATA_MUTATION
        writes_data = not (metadata and _is_view_of(node, placeholders.get(spec.target)))
        plans.append(WritePlan(label, _grad_mode_of(node), metadata, writes_data))
    return tuple(plans)


def _is_view_of(node: object, placeholder: fx.Node | None) -> bool:
    """Whether `node` is `placeholder` seen through view ops only (`t(x)`, `squeeze(x, 0)`)."""
    while isinstance(node, fx.Node) and node is not placeholder:
        if not (isinstance(node.target, torch._ops.OpOverload) and node.target.is_view):
            return False
        node = node.args[0]
    return node is placeholder


def _grad_mode_of(node: object) -> bool | None:
    if not isinstance(node, fx.Node):
        return None
    if node.target is torch.ops.predispatch.keep_history.default:
        return False  # the rebinding after a no_grad stretch: the write ran with grad off
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        region = node.args[0]
        if region.target is ti.wrap_with_set_grad_enabled:
            return bool(region.args[0])
    return None


def check_write_targets(
    plans: Sequence[WritePlan], targets: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor] = ()
) -> None:
    """Raise `MutationTargetError` if eager would refuse to change any of `targets` in place.

    plans: one per mutation output (`plan_writes`).
    targets: the tensors the call will write back to, in the same order.
    inputs: every tensor the graph takes in this call (state and user tensors): a target whose
        data is written may share memory with none of them but itself.
    Called before the graph runs, so a failing call changes nothing (Note [All or nothing calls]).
    """
    if not plans or any(ti.is_traced_tensor(t) for t in targets):
        return  # nothing written, or a re-export traces this call: checks would be recorded as ops
    spans = _spans_by_storage(inputs) if any(plan.writes_data for plan in plans) else {}
    for plan, target in zip(plans, targets):
        grad_on = torch.is_grad_enabled() if plan.grad_mode is None else plan.grad_mode
        problem = _eager_refusal(target, grad_on, plan.writes_data)
        if problem is None and plan.writes_data:
            problem = _shared_memory(target, spans)
        if problem is not None:
            what, fix = problem
            raise MutationTargetError(
                f"the program changes {plan.label} in place, and {what}; nothing was run or written.",
                where=user_frame(),
                fix=fix,
            )


def apply_metadata_mutation(target: torch.Tensor, value: torch.Tensor, writes_data: bool) -> None:
    """Give `target` the shape, strides and storage offset of `value`, then (if forward also wrote
    its data) `value`'s data: what AOTAutograd's runtime wrappers do for an input whose metadata
    forward changed (`_apply_input_mutations`: `as_strided_`, then `copy_`).  A pure metadata
    change's `value` is a view of `target` itself, so its data is already there.  A value made
    anew may need more memory than the target's storage has (`x.resize_(larger)`): the storage
    grows first, as eager's `resize_` grows it."""
    if writes_data and ti.is_traced_tensor(target):
        target.resize_(value.shape)  # a re-export: no storage to measure; functionalization tracks this
    elif writes_data:
        elements = value.storage_offset() + _extent(value)
        if target.untyped_storage().nbytes() < elements * value.element_size():
            target.as_strided_((0,), (1,), 0)
            target.resize_(elements)  # grows the storage, keeping its bytes, as eager's resize_ does
    target.as_strided_(value.size(), value.stride(), value.storage_offset())
    if writes_data:
        with torch.no_grad() if target.is_leaf and target.requires_grad else contextlib.nullcontext():
            target.copy_(value)


def _extent(t: torch.Tensor) -> int:
    """Elements from `t`'s first to one past its last, in its storage."""
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if s > 0)


def _eager_refusal(target: torch.Tensor, grad_on: bool, writes_data: bool) -> tuple[str, str] | None:
    """(what, fix) when eager's in-place op on `target` would raise, else None (a pure metadata
    change such as `t_()` is allowed on an expanded tensor)."""
    if writes_data and ti.has_internal_overlap(target):
        return (
            "more than one of its elements refers to the same memory (an expanded tensor), so eager "
            "would raise too ('more than one element of the written-to tensor refers to a single "
            "memory location')",
            "pass a tensor with its own memory: x.clone() (or x.contiguous()) instead of x.expand(...).",
        )
    if target.is_inference() and not torch.is_inference_mode_enabled():
        return (
            "it is an inference tensor, which eager may change in place only inside "
            "torch.inference_mode() ('Inplace update to inference tensor outside InferenceMode')",
            "call inside torch.inference_mode(), or pass x.clone() made outside it.",
        )
    if grad_on and target.requires_grad and _is_leaf_or_view_of_leaf(target):
        return (
            "it is a leaf tensor that requires grad (or a view of one) written with grad mode on, so "
            "eager would raise ('a leaf Variable that requires grad is being used in an in-place operation')",
            "pass a tensor that is not a leaf requiring grad (x.clone()), or call under torch.no_grad(); "
            "a write through x.data or x.detach() in forward cannot be told apart here: make it under "
            "torch.no_grad() instead.",
        )
    return None


def _is_leaf_or_view_of_leaf(t: torch.Tensor) -> bool:
    return t.is_leaf or (t._is_view() and t._base is not None and t._base.is_leaf and t._base.requires_grad)


def _shared_memory(target: torch.Tensor, spans: dict[int, list[tuple[int, int, torch.Tensor]]]) -> tuple[str, str] | None:
    """(what, fix) when `target`'s memory overlaps another input's, else None.  `spans`: the
    inputs' byte ranges grouped by storage (`_spans_by_storage`), so a call costs one pass over
    the inputs, not one per target."""
    span = _byte_span(target)
    if span is None:
        return None
    storage, start, end = span
    for other_start, other_end, other in spans.get(storage, ()):
        if other is not target and other_start < end and start < other_end:
            return (
                "it shares memory with another input of the call; eager's change would show through "
                "that alias, the program's inputs are independent values",
                "pass tensors that do not share memory (x.clone() at one place).",
            )
    return None


def _spans_by_storage(inputs: Sequence[torch.Tensor]) -> dict[int, list[tuple[int, int, torch.Tensor]]]:
    spans: dict[int, list[tuple[int, int, torch.Tensor]]] = {}
    for t in inputs:
        span = _byte_span(t)
        if span is not None:
            spans.setdefault(span[0], []).append((span[1], span[2], t))
    return spans


def _byte_span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage id, first byte, one past the last byte) of `t`'s elements; None when empty or
    storage-less (a tensor subclass or a traced tensor of a re-export)."""
    if t.numel() == 0 or type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        return None
    size = t.element_size()
    return t.untyped_storage().data_ptr(), t.storage_offset() * size, (t.storage_offset() + _extent(t)) * size
