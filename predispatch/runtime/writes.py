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
- a view eager may not change in place with grad mode on: one of several views one op
  returned (`unbind`, `split`), a view made under `no_grad` or in inference mode;
- a target sharing memory with another input of the call: the program takes its inputs as
  independent values, so eager's change seen through the other alias would be lost silently.
  The same tensor at two positions counts too (`m(t, t)`, or `m(m.c)` passing the module's own
  buffer, which for a module export is also the model's: Note [module() shares the program's
  state] in unlift.py).

One rule needs the values the graph computed: eager refuses to write a value that requires grad
into such a view even when the view itself does not.  `check_write_values` checks every pair
after the graph ran and before the first write, so that call too writes nothing (the graph
has run, so a random draw in it has happened).

Under torch.func's transforms the checks read through functorch's wrappers (Note [Calls under
torch.func]).

The helpers take plain lists so any runner (today's `ProgramModule`, or a generated
`GraphModule`) can call them.

Note [Calls under torch.func]
-----------------------------
`torch.func.vmap(ep.module())(x)` calls the module with `x` wrapped in a BatchedTensor (grad's
GradTrackingTensor likewise), and the write-back's `copy_` runs through the wrapper as eager's
in-place op does: into the plain tensor under it for a batched input, into the buffer itself for
state vmap did not map.  So eager's vmap cases run here too: a buffer update whose value is the
same for the whole batch (`self.steps.add_(1)`), an in-place op on a batched input.  The checks
read the tensors eager's op would reach: memory (storage, overlap, data pointers) of the plain
tensor under every wrapper (`ti.memory_of`; a wrapper has none to read), and autograd's view,
leaf and inference state of the tensor under vmap's wrappers (`ti.below_vmap`: the batching rule
runs the op on it, and the wrapper reports none of its own).  Two writes eager refuses, we refuse
by name before any write:

- a value batched at a vmap level its target is not (`self.acc.add_(x)` into a buffer vmap did not
  map): one buffer cannot hold a value per batch element; eager raises at the op ("output with
  shape [4] doesn't match the broadcast shape [3, 4]").  Only the computed value tells, so
  `check_write_values` refuses it after the graph ran, before the first write;
- any write to a tensor a running grad/jvp transform captured (the module's own buffer under
  `torch.func.grad`): functorch refuses every in-place op on it ("would mutate a captured
  Tensor"); `check_write_targets` refuses it before the graph runs.

Note [State a kernel resizes]
-----------------------------
A few kernels resize the state they write, by what they find in it: the fused observer of
`torch.ao.nn.qat.Linear`'s default fake quantizer (`_fused_moving_avg_obs_fq_helper`) grows a
per-channel observer's `min_val` / `max_val` from [0] and the quantizer's `scale` /
`zero_point` from [1] to one entry per channel on the first call with the observer on.  The
functional twin the graph holds returns those values; its fake kernel gives them the inputs'
shapes, so the graph's shapes are the exported ones and the values a call computes may be
larger.  The graph records it by holding the kernel (`RESIZING_KERNELS`, read off the graph by
`resized_by_kernel`): such a buffer mutation is written back as a metadata mutation
(`as_strided_` to the value's shape, growing the storage as the kernel's `resize_` does, then
the data), and the file checks accept any size for that buffer (serialize/verify.py), since its
shape after a call is the kernel's choice.  The graph's other nodes run at the new sizes as they
are, as eager's do.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import fx

from predispatch import _torch_internals as ti
from predispatch.errors import MutationTargetError, user_frame
from predispatch.signature import ExportSignature, InputKind, OutputKind

#: Tensor types whose memory the checks read; a subclass or a traced tensor has none to read.
PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)

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


#: Kernels that resize the state they write (Note [State a kernel resizes]): the functional op
#: the graph holds -> (the output positions that carry resized state, why).
RESIZING_KERNELS: dict[torch._ops.OpOverload, tuple[tuple[int, ...], str]] = {
    torch.ops.aten._fused_moving_avg_obs_fq_helper_functional.default: (
        (2, 3, 4, 5),
        "the per-channel observer's running_min / running_max grow from [0], scale / zero_point from [1], "
        "to one entry per channel (the kernel's resize_, with the observer on)",
    ),
}


def resized_by_kernel(node: object) -> bool:
    """Whether `node` is state a kernel may have resized (Note [State a kernel resizes]), seen
    through `aten.alias` (which torch 2.14+'s joint puts before its outputs)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is torch.ops.aten.alias.default:
        node = node.args[0]
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and isinstance(node.args[0], fx.Node)):
        return False
    kernel = node.args[0].target
    entry = RESIZING_KERNELS.get(kernel) if isinstance(kernel, torch._ops.OpOverload) else None
    return entry is not None and node.args[1] in entry[0]


def resized_targets(graph_module: fx.GraphModule, signature: ExportSignature) -> frozenset[str]:
    """The state whose mutation a kernel may resize (Note [State a kernel resizes])."""
    outputs = graph_module.graph.output_node().args[0]
    return frozenset(spec.target for spec, node in zip(signature.mutations, outputs) if resized_by_kernel(node))


def plan_writes(graph_module: fx.GraphModule, signature: ExportSignature) -> tuple[WritePlan, ...]:
    """One `WritePlan` per mutation output of the program, in output order."""
    paths = {s.name: s.target for s in signature.inputs_of(InputKind.USER_INPUT)}
    placeholders = {n.name: n for n in graph_module.graph.find_nodes(op="placeholder")}
    outputs = graph_module.graph.output_node().args[0]
    plans = []
    for spec, node in zip(signature.mutations, outputs):
        label = f"{_TARGET_NOUN[spec.kind]} {paths.get(spec.target, spec.target)!r}"
        metadata = spec.kind is OutputKind.USER_INPUT_METADATA_MUTATION or resized_by_kernel(node)
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
    plans: Sequence[WritePlan],
    targets: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor] = (),
    positions: Sequence[int] | None = None,
    shared: Mapping[int, frozenset[int]] | None = None,
    names: Sequence[object] = (),
) -> None:
    """Raise `MutationTargetError` if eager would refuse to change any of `targets` in place.

    plans: one per mutation output (`plan_writes`).
    targets: the tensors the call will write back to, in the same order.
    inputs: every tensor the graph takes in this call (state and user tensors): a target whose
        data is written may share memory with none of them but itself.
    positions: each target's position in `inputs` (found by identity when not given): the same
        tensor at another position (`m(t, t)`, `m(m.c)`) is another input and is refused (Note
        [All or nothing calls]).
    shared: position -> positions of the state that shared its memory at export: the graph
        writes those back consistently, so their overlap is not refused.
    names: per target, its `CallContract.writes` entry (the state's name, a user input's index), for fixes.
    Called before the graph runs, so a failing call changes nothing (Note [All or nothing calls]).
    """
    if not plans or _traced(targets):
        return  # nothing written, or a re-export traces this call: checks would be recorded as ops
    wrapped = ti.functorch_active()  # Note [Calls under torch.func]
    storages = None
    for i, (plan, target) in enumerate(zip(plans, targets)):
        grad_on = torch.is_grad_enabled() if plan.grad_mode is None else plan.grad_mode
        problem = _captured_by_transform(target, names[i] if i < len(names) else None) if wrapped else None
        if problem is None:
            problem = _eager_refusal(ti.below_vmap(target) if wrapped else target, grad_on, plan.writes_data, wrapped)
        if problem is None and plan.writes_data:
            if storages is None:  # one list comprehension: this runs at every call
                memories = [ti.memory_of(t) for t in inputs] if wrapped else inputs
                storages = [t.untyped_storage().data_ptr() if type(t) in PLAIN_TENSOR_TYPES and t.numel() else None for t in memories]
            position = _position(target, inputs) if positions is None else positions[i]
            if position < 0 or storages.count(storages[position]) > 1:
                problem = _shared_memory(target, inputs, position, (shared or {}).get(position, frozenset()))
        if problem is not None:
            what, fix = problem
            raise MutationTargetError(
                f"the program changes {plan.label} in place, and {what}; nothing was run or written.",
                where=user_frame(),
                fix=fix,
            )


def _traced(targets: Sequence[torch.Tensor]) -> bool:
    """Whether a trace runs this call (a re-export): its tensors are not plain ones."""
    return any(type(t) not in PLAIN_TENSOR_TYPES for t in targets) and any(ti.is_traced_tensor(t) for t in targets)


def _position(target: torch.Tensor, inputs: Sequence[torch.Tensor]) -> int:
    """`target`'s position in `inputs` by identity, -1 when it is none of them."""
    return next((i for i, t in enumerate(inputs) if t is target), -1)


def check_write_values(
    targets: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    plans: Sequence[WritePlan] = (),
    names: Sequence[object] = (),
) -> None:
    """Raise `MutationTargetError` before the first write-back if any would raise: a view eager
    may not change in place with grad mode on (`_eager_view_refusal`) that gets a value that
    requires grad; under vmap, a value batched where its target is not (Note [Calls under
    torch.func]).  `check_write_targets` refused the targets that require grad themselves
    before the graph ran; what a value is is known only once the graph has run.  `plans` and
    `names` (the state's name, or a user input's index) word the error when given."""
    wrapped = ti.functorch_active()
    if not (wrapped or torch.is_grad_enabled()):
        return
    for i, (target, value) in enumerate(zip(targets, values)):
        if wrapped:
            _check_batched_value(target, value, plans[i].label if i < len(plans) else "a tensor", names[i] if i < len(names) else None)
            target, value = ti.below_vmap(target), ti.below_vmap(value)
        if torch.is_grad_enabled() and type(target) in PLAIN_TENSOR_TYPES and value.requires_grad and target._is_view():
            problem = _eager_view_refusal(target)
            if problem is not None:
                raise MutationTargetError(
                    f"the program changes a tensor in place with a value that requires grad, and {problem[0]}; "
                    "the graph ran, nothing was written.",
                    where=user_frame(),
                    fix=problem[1],
                )


def _state_name(name: object) -> str | None:
    """The state's name of a `CallContract.writes` entry (a name, or (name, part) for a part of a
    tensor subclass), None for a user input (its index)."""
    return name if isinstance(name, str) else name[0] if isinstance(name, tuple) else None


def _check_batched_value(target: torch.Tensor, value: torch.Tensor, label: str, name: object) -> None:
    """Refuse a value batched at a vmap level its target is not (Note [Calls under torch.func])."""
    if not ti.vmap_levels(value) - ti.vmap_levels(target):
        return
    name = _state_name(name)
    if name is not None:
        fix = (
            f"give each batch element its own {name!r}: torch.func.vmap(lambda s, x: torch.func.functional_call(m, "
            f"{{{name!r}: s}}, (x,)))(batched, x) with batched = m.{name}.expand(n, *m.{name}.shape).clone() (eager "
            "needs the same); or write a value the whole batch shares (reduce over the batch outside vmap)."
        )
    else:
        fix = "map that input too (in_dims=0 for it: each batch element gets its own), as eager needs."
    raise MutationTargetError(
        f"under torch.func.vmap the program changes {label} in place with a value that differs per batch element "
        "(it depends on a mapped input), and that tensor is one for the whole batch: it cannot hold a value per "
        "element, so eager raises too (at the in-place op: 'output with shape ... doesn't match the broadcast "
        "shape ...'); the graph ran, nothing was written.",
        where=user_frame(),
        fix=fix,
    )


def _captured_by_transform(target: torch.Tensor, name: object) -> tuple[str, str] | None:
    """(what, fix) when a running grad/jvp transform captured `target` (Note [Calls under torch.func])."""
    if not ti.grad_levels_missing(target):
        return None
    name = _state_name(name)
    if name is not None:
        fix = (
            f"make it an input of the transformed function: torch.func.grad(lambda x, s: torch.func.functional_call("
            f"m, {{{name!r}: s}}, (x,)).sum())(x, m.{name}), as eager needs; or call outside the transform."
        )
    else:
        fix = "pass that tensor to the transformed function as an argument, as eager needs; or call outside the transform."
    return (
        "it is a tensor the running torch.func transform (grad, vjp, jacrev, jvp) captured rather than took as "
        "an input, which functorch lets no in-place op change, so eager raises too ('would mutate a captured "
        "Tensor')",
        fix,
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


def _eager_refusal(target: torch.Tensor, grad_on: bool, writes_data: bool, wrapped: bool = False) -> tuple[str, str] | None:
    """(what, fix) when eager's in-place op on `target` would raise, else None (a pure metadata
    change such as `t_()` is allowed on an expanded tensor).  `wrapped`: a torch.func transform
    runs, so the memory is under functorch's wrappers (Note [Calls under torch.func])."""
    if writes_data and ti.has_internal_overlap(ti.memory_of(target) if wrapped else target):
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
    if grad_on and target.requires_grad and target._is_view():
        problem = _eager_view_refusal(target)
        if problem is not None:
            return problem
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


#: Why eager refuses an in-place change with grad mode on to a view made in a special way, by
#: the view's `CreationMeta` (torch's `handle_view_on_rebase`); a view made the ordinary way is fine.
_VIEW_REFUSALS = {
    "MULTI_OUTPUT_NODE": "it is one of several views one op returned (unbind, split, chunk), which eager may "
    "not change in place with grad mode on ('This view is the output of a function that returns multiple views')",
    "NO_GRAD_MODE": "it is a view made under torch.no_grad(), which eager may not change in place with grad mode "
    "on ('A view was created in no_grad mode and is being modified inplace with grad mode enabled')",
    "INFERENCE_MODE": "it is a view made in inference mode, which eager may not change in place with grad mode on",
    "IN_CUSTOM_FUNCTION": "it is a view returned by a custom autograd.Function, which eager may not change in "
    "place with grad mode on",
}


def _eager_view_refusal(target: torch.Tensor) -> tuple[str, str] | None:
    """(what, fix) when `target` is a view eager may not change in place with grad mode on."""
    what = _VIEW_REFUSALS.get(ti.view_creation_meta(target))
    if what is None:
        return None
    return what, "pass x.clone() (a tensor of its own) instead of the view, or call under torch.no_grad()."


def _shared_memory(
    target: torch.Tensor, inputs: Sequence[torch.Tensor], position: int, group: frozenset[int] = frozenset()
) -> tuple[str, str] | None:
    """(what, fix) when `target`'s elements overlap another input's (the same tensor at another
    position included), else None (two halves of one tensor do not overlap).  The rare path:
    only a target whose storage another input shares gets here (inputs without readable
    memory, a tensor subclass or an empty tensor, share none)."""
    span = _byte_span(target)
    if span is None:
        return None
    others = [t for i, t in enumerate(inputs) if i != position and i not in group and (position >= 0 or t is not target)]
    if any(t is target for t in others):
        return (
            "the same tensor is also another input of the call (passed twice, or the module's own "
            "state passed in); eager's change would show through the other use, the program's inputs "
            "are independent values",
            "pass a copy at one place (x.clone(); for the module's state, m.c.clone()).",
        )
    start, end = span
    if any((other := _byte_span(t)) is not None and other[0] < end and start < other[1] for t in others):
        return (
            "it shares memory with another input of the call; eager's change would show through "
            "that alias, the program's inputs are independent values",
            "pass tensors that do not share memory (x.clone() at one place).",
        )
    return None


def _byte_span(t: torch.Tensor) -> tuple[int, int] | None:
    """(first byte, one past the last byte) of `t`'s elements, as addresses.  None when empty or
    without readable memory (a tensor subclass, a traced tensor of a re-export)."""
    t = ti.memory_of(t)  # Note [Calls under torch.func]
    if type(t) not in PLAIN_TENSOR_TYPES or t.numel() == 0:
        return None
    start = t.data_ptr()
    return start, start + (t.nbytes if t.is_contiguous() else _extent(t) * t.element_size())
