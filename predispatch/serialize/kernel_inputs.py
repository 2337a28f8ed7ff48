"""Kernels that trust their inputs: which a file may call, and only how.

Note [Kernels that trust their inputs]
--------------------------------------
Some dense CPU kernels take an index, an offset or a saved statistic and do not check it,
because autograd only ever feeds them what the matching forward op produced:
`max_pool2d_with_indices_backward` writes `grad_input[indices[i]]` (an index of 2**40
segfaults), `native_layer_norm_backward` reads `mean[i]` for every row (a one-element `mean`
returns whatever memory follows), `_sobol_engine_draw` walks its state past the end (heap
corruption).  Eager code never hands them anything else; a file can.

They were found by reading every allowed packet's schema for tensor arguments that carry
indices, offsets, lengths, workspaces or saved statistics (`python -m
predispatch.serialize.kernel_inputs` prints that scan), then keeping those whose kernels do
not check them (or that only an internal caller uses).  Each is one of:

- `REFUSED_IN_FILES`: no program a file holds needs it (samplers' internals, fused RNN cells'
  workspaces, CUDA-only statistics, `_unsafe_*` indexing); export still emits it for the
  user's own code, in memory.
- `FORWARD_PROOFS`: a joint program's backward calls it, so a file may, but only where the
  verifier proves that each trusted argument is the matching forward op's output (or
  argument) in the same graph, called on the very same input and parameters.  A kernel fed
  by its own forward gets exactly what eager autograd gives it.  In a joint program with
  shared bodies (Note [Shared bodies in the joint] in trace/dedup/backward.py) the kernel is
  in a backward body and its forward in the matching forward body: the proof then follows
  the values through every call of the backward body (`BodyCalls`): each trusted argument is
  an output of one forward-body call that is that forward op's result, and the arguments that
  must be the same are the very same values at that call.  Likewise in the backward subgraph
  of an `autograd_function_apply` (a per-rank DTensor program's, Note [Per-rank DTensor
  programs]): its saved placeholders are, by the HOP's convention, exactly what the paired
  forward subgraph returns as saved values, so the proof follows each trusted argument to the
  forward subgraph's node it is (`FunctionPair`).

`verify.py` asks `trusted_input_problems(node)` for every call of these packets in a stored
program.  docs/format.md's threat model lists both tables.

Backward kernels that read a gradient or saved value as another argument's shape are checked
at run time instead
(passes/kernel_shapes.py, Note [Kernels that trust their arguments' shapes]); `probe_arguments`
finds them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from predispatch.passes.kernel_shapes import packet_of
from predispatch.trace.dedup.backward import VIEWS

__all__ = [
    "FORWARD_PROOFS",
    "REFUSED_IN_FILES",
    "TRUSTING_PACKETS",
    "BodyCalls",
    "ForwardProof",
    "FunctionPair",
    "body_calls",
    "callers_of",
    "probe_arguments",
    "scan",
    "trusted_input_problems",
]


_SAMPLER = "a quasi-random sampler's internals: it indexes its state tensor by the dimension and count it is given"
_FUSED_CELL = "a fused RNN cell's backward: reads a workspace its forward wrote, of a size it does not check"
_CUDA_STATS = "a CUDA or cuDNN kernel's backward, fed saved statistics or a reserve it does not check (CPU programs never hold it)"
_EMBEDDING_BAG = "an embedding bag's backward: indexes by offsets and maximum indices its forward produced, unchecked"
_UNSAFE_INDEX = "indexing that skips the bounds check by design (`_unsafe_*`, `_index_put_impl`'s unsafe flag)"

#: Packets a file may not call, with why.  Export may still emit them for the user's own code.
REFUSED_IN_FILES: Mapping[str, str] = {
    "aten._sobol_engine_draw": _SAMPLER,
    "aten._thnn_fused_lstm_cell_backward": _FUSED_CELL,
    "aten._thnn_fused_lstm_cell_backward_impl": _FUSED_CELL,
    "aten._thnn_fused_gru_cell_backward": _FUSED_CELL,
    "aten._embedding_bag_backward": _EMBEDDING_BAG,
    "aten._embedding_bag_dense_backward": _EMBEDDING_BAG,
    "aten._embedding_bag_per_sample_weights_backward": _EMBEDDING_BAG,
    "aten._unsafe_index": _UNSAFE_INDEX,
    "aten._unsafe_index_put": _UNSAFE_INDEX,
    "aten._unsafe_masked_index": _UNSAFE_INDEX,
    "aten._unsafe_masked_index_put_accumulate": _UNSAFE_INDEX,
    "aten._index_put_impl": _UNSAFE_INDEX,
    "aten._segment_reduce_backward": "a segment reduction's backward: indexes by lengths and offsets its forward checked, unchecked",
    "aten._pack_padded_sequence_backward": "indexes by the batch sizes its forward produced, unchecked",
    "aten._pad_packed_sequence": "indexes by batch sizes a packed sequence carries, checked only against their sum",
    "aten.cummaxmin_backward": "scatters through the indices cummax/cummin produced, unchecked",
    "aten.value_selecting_reduction_backward": "scatters through the indices max/min/median produced, unchecked",
    "aten._fused_rms_norm_backward": "reads the saved rstd of its forward for every row, unchecked",
    "aten.batch_norm_backward": "reads saved statistics and a reserve its forward produced, unchecked",
    "aten._batch_norm_impl_index_backward": "reads saved statistics and a reserve its forward produced, unchecked",
    "aten.batch_norm_backward_elemt": _CUDA_STATS,
    "aten.batch_norm_backward_reduce": _CUDA_STATS,
    "aten.cudnn_batch_norm_backward": _CUDA_STATS,
    "aten.miopen_batch_norm_backward": _CUDA_STATS,
    "aten._cudnn_rnn_backward": _CUDA_STATS,
    "aten.miopen_rnn_backward": _CUDA_STATS,
    "aten._efficient_attention_backward": _CUDA_STATS,
    "aten._flash_attention_backward": _CUDA_STATS,
    "aten._scaled_dot_product_efficient_attention_backward": _CUDA_STATS,
    "aten._scaled_dot_product_flash_attention_backward": _CUDA_STATS,
    "aten._scaled_dot_product_cudnn_attention_backward": _CUDA_STATS,
    "aten._cudnn_attention_backward": _CUDA_STATS,
    "aten._scaled_dot_product_fused_attention_overrideable_backward": _CUDA_STATS,
}


@dataclass(frozen=True)
class ForwardProof:
    """How a backward kernel's trusted arguments must come from its forward in the graph.

    forwards: the forward packets whose result it may be fed.
    outputs: backward argument -> index of the forward's output it must be (`getitem`).
    same: (backward argument, forward argument) pairs that must be the very same node or equal
        constant: the forward ran on what the backward reads.
    extra: a further check of (backward arguments, forward arguments, in the root graph),
        yielding why not.
    reason: what the kernel trusts.
    """

    forwards: tuple[str, ...]
    outputs: Mapping[str, int]
    same: tuple[tuple[str, str], ...]
    reason: str
    extra: Callable[[dict, dict, bool], Iterator[str]] | None = field(default=None)


def _embedding_rows(backward: dict, forward: dict, root: bool) -> Iterator[str]:
    """`num_weights` is the row count of the weight the forward indexed, a placeholder of the
    root graph: its size is checked (a state's against its stored tensor at load, a user
    input's at every call), so the forward's own bounds check holds for the backward's scatter."""
    weight = forward.get("weight")
    value = weight.meta.get("val") if isinstance(weight, fx.Node) else None
    rows = value.shape[0] if isinstance(value, torch.Tensor) and value.dim() >= 1 else None
    if not (root and weight.op == "placeholder" and type(rows) is int and backward.get("num_weights") == rows):
        yield "its num_weights must be the row count of a root-graph input or state the matching embedding indexed"


_POOL = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
_STATS = "reads a saved mean and reciprocal std for every row or group, unchecked against the input"

#: Backward kernels a file may call only when fed by their forward, by packet.
FORWARD_PROOFS: Mapping[str, ForwardProof] = {
    "aten.max_pool2d_with_indices_backward": ForwardProof(
        ("aten.max_pool2d_with_indices",), {"indices": 1}, (("self", "self"), *((a, a) for a in _POOL)),
        "writes grad_input[indices[i]] unchecked"),
    "aten.max_pool3d_with_indices_backward": ForwardProof(
        ("aten.max_pool3d_with_indices",), {"indices": 1}, (("self", "self"), *((a, a) for a in _POOL)),
        "writes grad_input[indices[i]] unchecked"),
    "aten.adaptive_max_pool2d_backward": ForwardProof(
        ("aten.adaptive_max_pool2d",), {"indices": 1}, (("self", "self"),), "writes grad_input[indices[i]] unchecked"),
    "aten.adaptive_max_pool3d_backward": ForwardProof(
        ("aten.adaptive_max_pool3d",), {"indices": 1}, (("self", "self"),), "writes grad_input[indices[i]] unchecked"),
    "aten.fractional_max_pool2d_backward": ForwardProof(
        ("aten.fractional_max_pool2d",), {"indices": 1}, (("self", "self"), ("kernel_size", "kernel_size"), ("output_size", "output_size")),
        "writes grad_input[indices[i]] unchecked"),
    "aten.fractional_max_pool3d_backward": ForwardProof(
        ("aten.fractional_max_pool3d",), {"indices": 1}, (("self", "self"), ("kernel_size", "kernel_size"), ("output_size", "output_size")),
        "writes grad_input[indices[i]] unchecked"),
    "aten.embedding_dense_backward": ForwardProof(
        ("aten.embedding",), {}, (("indices", "indices"), ("padding_idx", "padding_idx")),
        "scatters into num_weights rows by indices, unchecked", extra=_embedding_rows),
    "aten.embedding_backward": ForwardProof(  # composite: calls embedding_dense_backward inside the kernel
        ("aten.embedding",), {}, (("indices", "indices"), ("padding_idx", "padding_idx")),
        "scatters into num_weights rows by indices, unchecked", extra=_embedding_rows),
    "aten.native_layer_norm_backward": ForwardProof(
        ("aten.native_layer_norm",), {"mean": 1, "rstd": 2},
        (("input", "input"), ("normalized_shape", "normalized_shape"), ("weight", "weight"), ("bias", "bias")), _STATS),
    "aten.native_group_norm_backward": ForwardProof(
        ("aten.native_group_norm",), {"mean": 1, "rstd": 2},
        (("input", "input"), ("weight", "weight"), ("N", "N"), ("C", "C"), ("HxW", "HxW"), ("group", "group")), _STATS),
    "aten.native_batch_norm_backward": ForwardProof(
        ("aten.native_batch_norm", "aten._native_batch_norm_legit", "aten._native_batch_norm_legit_functional",
         "aten._native_batch_norm_legit_no_training"),
        {"save_mean": 1, "save_invstd": 2},
        (("input", "input"), ("weight", "weight"), ("running_mean", "running_mean"), ("running_var", "running_var")),
        "reads saved statistics for every channel, unchecked"),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": ForwardProof(
        ("aten._scaled_dot_product_flash_attention_for_cpu",), {"out": 0, "logsumexp": 1},
        (("query", "query"), ("key", "key"), ("value", "value"), ("is_causal", "is_causal"), ("attn_mask", "attn_mask"),
         ("scale", "scale"), ("dropout_p", "dropout_p")),
        "reads the saved logsumexp for every query row, unchecked"),
    "aten._ctc_loss_backward": ForwardProof(
        ("aten._ctc_loss",), {"neg_log_likelihood": 0, "log_alpha": 1},
        (("log_probs", "log_probs"), ("targets", "targets"), ("input_lengths", "input_lengths"),
         ("target_lengths", "target_lengths"), ("blank", "blank"), ("zero_infinity", "zero_infinity")),
        "reads the saved log_alpha and loss for every sample, unchecked"),
}

#: Every packet this module decides: the allow list's `trusts_inputs` family.
TRUSTING_PACKETS = frozenset({*REFUSED_IN_FILES, *FORWARD_PROOFS})


@dataclass(frozen=True)
class BodyCalls:
    """Every call of a subgraph that only `invoke_subgraph` calls: `parent` holds it, `calls`
    are those nodes of `parent`'s graph (what feeds the subgraph's placeholders)."""

    parent: fx.GraphModule
    calls: tuple[fx.Node, ...]


def body_calls(parent: fx.GraphModule, name: str) -> BodyCalls | None:
    """The calls of `parent`'s subgraph `name` if every use of it is an `invoke_subgraph` call."""
    getters = parent.graph.find_nodes(op="get_attr", target=name)
    calls = [u for g in getters for u in g.users]
    if not calls or not all(_is_invoke(c) and c.args[0] in getters and not set(getters) & set(c.args[1:]) for c in calls):
        return None
    return BodyCalls(parent, tuple(calls))


@dataclass(frozen=True)
class FunctionPair:
    """A backward subgraph that only `autograd_function_apply` calls, always with `forward`:
    its placeholders are one gradient per forward output, then forward's saved values in order
    (torch's HOP runs `bwd(*grads, *saved)`)."""

    forward: fx.GraphModule
    backward: fx.GraphModule


def callers_of(parent: fx.GraphModule, name: str) -> BodyCalls | FunctionPair | None:
    """How `parent`'s subgraph `name` is called, when a proof can follow values through it."""
    return body_calls(parent, name) or function_pair(parent, name)


def function_pair(parent: fx.GraphModule, name: str) -> FunctionPair | None:
    """The pair `name` is the backward of, if every use of it is the backward of an
    `autograd_function_apply` whose forward is one and the same subgraph."""
    getters = parent.graph.find_nodes(op="get_attr", target=name)
    calls = [u for g in getters for u in g.users]
    if not calls or not all(c.op == "call_function" and c.target is torch.ops.higher_order.autograd_function_apply
                            and c.args[1] in getters and not set(getters) & {c.args[0], *c.args[2:]} for c in calls):
        return None
    forwards = {c.args[0].target for c in calls if isinstance(c.args[0], fx.Node) and c.args[0].op == "get_attr"}
    target = next(iter(forwards)) if len(forwards) == 1 else None
    forward = getattr(parent, target, None) if isinstance(target, str) else None
    backward = getattr(parent, name, None)
    if isinstance(forward, fx.GraphModule) and isinstance(backward, fx.GraphModule):
        return FunctionPair(forward, backward)
    return None


def trusted_input_problems(node: fx.Node, *, root: bool, callers: BodyCalls | FunctionPair | None = None) -> Iterator[str]:
    """Why `node`, a call of a `TRUSTING_PACKETS` packet, may not be in a stored program
    (`root`: it is in the program's root graph, not a subgraph; `callers`: how its graph is
    called, when that is a body only `invoke_subgraph` calls or the backward of one
    `autograd_function_apply` pair)."""
    packet = packet_of(node.target)
    assert packet is not None, node.target  # the caller only asks for TRUSTING_PACKETS' calls
    if packet in REFUSED_IN_FILES:
        yield f"calls {node.target}, which a file may not call (trusts_inputs: {REFUSED_IN_FILES[packet]})"
        return
    proof = FORWARD_PROOFS[packet]
    backward = _bound(node)
    forward_node = _forward_of(backward, proof)
    if forward_node is None and isinstance(callers, FunctionPair) and proof.outputs and proof.extra is None:
        if _proved_in_pair(backward, proof, callers):
            return
        yield (f"calls {node.target}, which {proof.reason}: its {', '.join(proof.outputs)} are not the saved results "
               f"of one {' or '.join(proof.forwards)} call of its forward subgraph on the same arguments")
        return
    if forward_node is None and isinstance(callers, BodyCalls) and proof.outputs and proof.extra is None:
        unproved = [c.name for c in callers.calls if not _proved_at(c, node, backward, proof, callers.parent)]
        if not unproved:
            return
        yield (f"calls {node.target}, which {proof.reason}: at call {unproved[0]} of its body, its {', '.join(proof.outputs)} "
               f"are not the results of one {' or '.join(proof.forwards)} call of a forward body on the same arguments")
        return
    if forward_node is None:
        trusted = ", ".join(proof.outputs) or ", ".join(b for b, _ in proof.same)
        yield (f"calls {node.target}, which {proof.reason}: in a file its {trusted} must come from a "
               f"{' or '.join(proof.forwards)} call in the same graph")
        return
    forward = _bound(forward_node)
    differing = [b for b, f in proof.same if not _same(backward.get(b), forward.get(f))]
    if differing:
        yield f"calls {node.target} on other {', '.join(differing)} than its forward {forward_node.name} ran on"
    if proof.extra is not None:
        for why in proof.extra(backward, forward, root):
            yield f"calls {node.target}: {why}"


def _forward_of(backward: dict, proof: ForwardProof) -> fx.Node | None:
    """The one forward call every trusted argument comes from, or None."""
    sources = set()
    for argument, index in proof.outputs.items():
        value = _through_aliases(backward.get(argument))
        if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target is _getitem()
                and value.args[1] == index and isinstance(value.args[0], fx.Node)):
            return None
        sources.add(value.args[0])
    if not proof.outputs:  # fed by the forward's argument: find a forward call sharing it
        first, forward_argument = proof.same[0]
        value = backward.get(first)
        sources = {u for u in value.users if packet_of(u.target) in proof.forwards
                   and _bound(u).get(forward_argument) is value} if isinstance(value, fx.Node) else set()
    forward = next(iter(sources)) if len(sources) == 1 else None
    ok = forward is not None and forward.op == "call_function" and packet_of(forward.target) in proof.forwards
    return forward if ok else None


def _proved_at(call: fx.Node, node: fx.Node, backward: dict, proof: ForwardProof, parent: fx.GraphModule) -> bool:
    """Whether, at `call` of the backward body holding `node`, each trusted argument is an
    output of one forward-body call that is the forward op's result, and each pair that must be
    the same is the same value there (a value of the parent graph, or the forward body's)."""
    sources = set()
    for argument, index in proof.outputs.items():
        found = _forward_output(_fed(call, _through_aliases(backward.get(argument))), parent)
        if found is None:
            return False
        forward_call, value = found
        if not (value.op == "call_function" and value.target is _getitem() and value.args[1] == index):
            return False
        sources.add((forward_call, value.args[0]))
    if len(sources) != 1:
        return False
    forward_call, forward_node = next(iter(sources))
    if not (isinstance(forward_node, fx.Node) and forward_node.op == "call_function" and packet_of(forward_node.target) in proof.forwards):
        return False
    forward = _bound(forward_node)
    return all(
        _value_at(call, backward.get(b), parent) == _value_at(forward_call, forward.get(f), parent, own=forward_call)
        for b, f in proof.same
    )


def _proved_in_pair(backward: dict, proof: ForwardProof, pair: FunctionPair) -> bool:
    """Whether each trusted argument is a saved value that is the forward op's result in the
    forward subgraph (one call for all), and each pair that must be the same is: the backward's
    value a saved value that is the very node the forward op ran on, or an equal constant."""
    saved = _saved_sources(pair)
    if saved is None:
        return False
    sources = set()
    for argument, index in proof.outputs.items():
        value = _through_aliases(saved.get(_through_aliases(backward.get(argument))))
        if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target is _getitem() and value.args[1] == index):
            return False
        sources.add(value.args[0])
    forward_node = next(iter(sources)) if len(sources) == 1 else None
    if not (isinstance(forward_node, fx.Node) and forward_node.op == "call_function" and packet_of(forward_node.target) in proof.forwards):
        return False
    forward = _bound(forward_node)
    for b, f in proof.same:
        value = backward.get(b)
        if isinstance(value, fx.Node):
            value = saved.get(_through_aliases(value))
            if value is None:
                return False
        if not _same(value, forward.get(f)):
            return False
    return True


def _saved_sources(pair: FunctionPair) -> dict[fx.Node, Any] | None:
    """Each saved placeholder of the backward -> the forward subgraph's value it receives."""
    returned = pair.forward.graph.output_node().args[0] if pair.forward.graph.output_node().args else None
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        return None
    outputs, saved = returned
    if not (isinstance(outputs, (tuple, list)) and isinstance(saved, (tuple, list))):
        return None
    placeholders = pair.backward.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(outputs) + len(saved):
        return None
    return dict(zip(placeholders[len(outputs):], saved))


def _fed(call: fx.Node, value: Any) -> Any:
    """What `call` passes for `value`, a placeholder of the body it calls (else None)."""
    if not (isinstance(value, fx.Node) and value.op == "placeholder"):
        return None
    position = value.graph.find_nodes(op="placeholder").index(value)
    return call.args[2 + position] if 2 + position < len(call.args) else None


def _forward_output(value: Any, parent: fx.GraphModule) -> tuple[fx.Node, fx.Node] | None:
    """(the call, its body's output node) when `value` is `getitem(invoke_subgraph call, k)`."""
    value = _through_aliases(value)
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target is _getitem()):
        return None
    call, k = value.args
    if not (isinstance(call, fx.Node) and _is_invoke(call) and type(k) is int):
        return None
    getter = call.args[0]
    body = getattr(parent, getter.target, None) if isinstance(getter, fx.Node) and isinstance(getter.target, str) else None
    returned = body.graph.output_node().args[0] if isinstance(body, fx.GraphModule) else ()
    output = returned[k] if isinstance(returned, (tuple, list)) and 0 <= k < len(returned) else None
    return (call, output) if isinstance(output, fx.Node) else None


def _value_at(call: fx.Node, value: Any, parent: fx.GraphModule, own: fx.Node | None = None) -> Any:
    """A value of a body called by `call`, named so that values equal across bodies compare
    equal: a placeholder is what the call passes (the parent's node, or the forward body's node
    a forward call's output is); a view (`VIEWS`: a backward body recomputes its forward's) is
    the view of what it views; another node of the body is (`own` call, node)."""
    if not isinstance(value, fx.Node):
        return ("constant", tuple(value)) if isinstance(value, (list, tuple)) else ("constant", type(value), value)
    if value.op == "call_function" and value.target in VIEWS and not value.kwargs:  # a backward body recomputes views
        return ("view", value.target, tuple(_value_at(call, a, parent, own) for a in value.args))
    if value.op != "placeholder":
        return ("body", own, value)
    fed = _through_aliases(_fed(call, value))
    found = _forward_output(fed, parent)
    return ("body", found[0], found[1]) if found is not None else ("parent", fed)


def _is_invoke(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph


#: Ops whose result is its argument's very values, shape and strides: a proof sees through them.
_SAME_VALUES = (torch.ops.aten.alias.default, torch.ops.aten.detach.default)


def _through_aliases(value: Any) -> Any:
    """`value` seen through `aten.alias` and `aten.detach` (same values, same shape), which
    torch 2.14+'s joint puts between a forward's saved statistics and the backward that reads
    them, and AOTAutograd's partitioner between a saved attention output and its backward."""
    while isinstance(value, fx.Node) and value.op == "call_function" and value.target in _SAME_VALUES:
        value = value.args[0]
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, fx.Node) or isinstance(b, fx.Node):
        return a is b
    return type(a) is type(b) and a == b or (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and list(a) == list(b))


def _bound(node: fx.Node) -> dict[str, Any]:
    """A call's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    values = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    values.update(zip((a.name for a in schema.arguments), node.args))
    values.update(node.kwargs)
    return values


def _getitem() -> Any:
    import operator

    return operator.getitem


# --------------------------------------------------------------------------- the scan


#: Argument names that carry indices, offsets, lengths, workspaces or saved statistics.
_TRUSTED_NAMES = (
    "indices", "index", "offsets", "lengths", "batch_sizes", "workspace", "reserve", "mean", "rstd", "invstd",
    "save_mean", "save_invstd", "save_var", "logsumexp", "quasi", "sobolstate", "maximum_indices", "cu_seqlens_q",
    "cu_seqlens_k", "log_alpha", "neg_log_likelihood",
)


def scan() -> list[tuple[str, list[str]]]:
    """Allowed packets of a backward or internal op with a tensor argument named like one a
    kernel may trust (`indices`, `mean`, `workspace`, ...): the candidates this module's
    tables were decided from.  A new torch's new candidate shows here (tests/test_verify.py
    fails until it is decided: refused, proved, or listed in `CHECKED_BY_TORCH`)."""
    from predispatch.serialize.op_families import PACKETS

    found = []
    for packet in sorted({p for family in ("aten_functional", "trusts_inputs") for p in PACKETS.get(family, ())}):
        name = packet.split(".", 1)[1]
        if not (name.endswith("backward") or "backward_" in name or name.startswith("_")):
            continue
        overloads = getattr(torch.ops.aten, name)
        arguments = {a.name for o in overloads.overloads() for a in getattr(overloads, o)._schema.arguments if "Tensor" in str(a.type)}
        hits = sorted(arguments & set(_TRUSTED_NAMES))
        if hits:
            found.append((packet, hits))
    return found


#: Scanned candidates whose kernels check the argument themselves (a bad value raises), with how.
CHECKED_BY_TORCH: Mapping[str, str] = {
    "aten._embedding_bag": "checks every index against the weight's rows and offsets against the indices",
    "aten._embedding_bag_forward_only": "checks every index against the weight's rows and offsets against the indices",
    "aten.index_select_backward": "composite: index_add, which checks its indices",
    "aten.gather_backward": "composite: scatter_add, which checks its indices",
    "aten._pack_padded_sequence": "checks lengths are sorted, positive and within the input",
    "aten._efficient_attention_forward": "CUDA only; the forward checks its sequence offsets",
    "aten._native_batch_norm_legit": "a forward: computes its statistics itself (save_* are outputs of its out= overloads, refused by schema)",
    "aten._spdiags": "checks offsets against the output shape",
}


# --------------------------------------------------------------------------- arguments' shapes


def probe_arguments() -> dict[str, dict[str, str]]:
    """For each allowed backward packet autograd calls on OpInfo samples, per tensor or
    int-list argument: `raises` (shrunk or grown, the call raises), `broadcasts` (a one-element
    tensor gives the expanded tensor's result, a larger one raises) or `UNCHECKED` (neither, or
    the call crashed: decided in passes/kernel_shapes.py's `SHAPE_RULES` or `SHAPE_SAFE`, in
    `FORWARD_PROOFS` or `REFUSED_IN_FILES`).  Slow (every OpInfo's backward); each argument is
    probed in worker processes that may crash (`_probe_in_workers`)."""
    from predispatch._torch_internals import load_op_db
    from predispatch.serialize.op_families import PACKETS

    allowed = {p for family in ("aten_functional", "trusts_inputs") for p in PACKETS.get(family, ())}
    calls = _backward_calls(load_op_db(), allowed)
    verdicts: dict[str, dict[str, str]] = {packet: {} for packet in calls}
    for (packet, argument), verdict in _probe_in_workers(calls).items():
        verdicts[packet][argument] = verdict
    return dict(sorted(verdicts.items()))


def _probed_positions(op: Any) -> list[int]:
    """The tensor and int-list arguments the probe shrinks and grows, by position."""
    return [i for i, a in enumerate(op._schema.arguments)
            if str(a.type) in ("Tensor", "Optional[Tensor]", "List[int]", "List[SymInt]")]


def _probeable(op: Any, args: tuple) -> int:
    """How many of a call's arguments the probe can shrink (the call of most is kept)."""
    return sum(1 for i in _probed_positions(op) if i < len(args) and (
        isinstance(args[i], torch.Tensor) and args[i].numel() >= 2 or isinstance(args[i], (list, tuple)) and args[i]))


def _backward_calls(op_db: list[Any], allowed: set[str]) -> dict[str, tuple[Any, tuple, dict]]:
    """One real call of each allowed backward packet (of those with the most arguments to
    probe), recorded while autograd differentiates each OpInfo's first samples."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: dict[str, tuple[Any, tuple, dict]] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            packet = packet_of(func)
            if packet in allowed and "backward" in packet and _probed_positions(func):
                if packet not in calls or _probeable(func, args) > _probeable(*calls[packet][:2]):
                    copied = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
                    calls[packet] = (func, *copied)
            return func(*args, **kwargs)

    for info in op_db:
        if not info.supports_autograd:
            continue
        try:
            samples = list(info.sample_inputs("cpu", torch.float64, requires_grad=True))[:2]
        except Exception:  # noqa: BLE001 - an OpInfo without CPU float64 samples
            continue
        for sample in samples:
            try:
                out = info(sample.input, *sample.args, **sample.kwargs)
                leaves = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
                if leaves:
                    with Record():
                        torch.autograd.backward(leaves, [torch.randn_like(t) for t in leaves])
            except Exception:  # noqa: BLE001 - a sample eager itself refuses
                continue
    return calls


def _probe_in_workers(calls: dict[str, tuple[Any, tuple, dict]]) -> dict[tuple[str, str], str]:
    """Probe every (packet, argument) in a forked child process of its own: a kernel that reads
    or writes out of bounds may crash it, or corrupt its heap and crash it later; either way
    only that child dies, and its item is `UNCHECKED (crashed)`.  Intra-op threads are off
    (one thread: forking is safe)."""
    torch.set_num_threads(1)
    verdicts: dict[tuple[str, str], str] = {}
    for packet, (op, args, kwargs) in sorted(calls.items()):
        for position in _probed_positions(op):
            if position < len(args):
                verdicts[(packet, op._schema.arguments[position].name)] = _in_child(op, args, kwargs, position)
    return {k: v for k, v in verdicts.items() if v != "n/a"}


def _in_child(op: Any, args: tuple, kwargs: dict, position: int) -> str:
    """`_probe_argument` in a forked child; `UNCHECKED (crashed)` if it dies."""
    import os

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the verdict, never return into the parent's code
        os.close(read)
        try:
            os.write(write, _probe_argument(op, args, kwargs, position).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        verdict = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    return verdict if status == 0 and verdict else "UNCHECKED (crashed)"


def _probe_argument(op: Any, args: tuple, kwargs: dict, i: int) -> str:
    """`raises`, `broadcasts`, `UNCHECKED` or `n/a` (not probed: the sample's value is too
    small, or the honest-shaped replacement itself raises) for argument `i` of this call."""
    full = args[i]

    def call(value: Any) -> Any:
        return op(*args[:i], value, *args[i + 1:], **kwargs)

    if isinstance(full, (list, tuple)) and all(type(n) is int for n in full) and full:
        outcomes = [_raises(call, [1] * len(full)) if any(n > 1 for n in full) else True, _raises(call, [2 * n + 1 for n in full])]
        return "raises" if all(outcomes) else "UNCHECKED"
    if not isinstance(full, torch.Tensor) or full.numel() < 2:
        return "n/a"
    fill = 1.5 if full.is_floating_point() or full.is_complex() else 0
    small = torch.full([1] * full.dim(), fill, dtype=full.dtype)
    try:
        reference = call(small.expand(full.shape).contiguous())
    except Exception:  # noqa: BLE001 - the sample's other arguments refuse a constant value here
        return "n/a"
    try:
        got = call(small)
    except Exception:  # noqa: BLE001 - the kernel checks the argument's shape
        return "raises"
    if not _same_results(got, reference):
        return "UNCHECKED"
    grown = torch.full([2 * n for n in full.shape] or [2], fill, dtype=full.dtype)
    return "broadcasts" if _raises(call, grown) else "UNCHECKED"


def _raises(call: Callable[[Any], Any], value: Any) -> bool:
    try:
        call(value)
    except Exception:  # noqa: BLE001 - any refusal counts
        return True
    return False


def _same_results(a: Any, b: Any) -> bool:
    left = [t for t in torch.utils._pytree.tree_leaves(a) if isinstance(t, torch.Tensor)]
    right = [t for t in torch.utils._pytree.tree_leaves(b) if isinstance(t, torch.Tensor)]
    return len(left) == len(right) and all(
        x.shape == y.shape and torch.allclose(x, y, equal_nan=True) for x, y in zip(left, right))


if __name__ == "__main__":
    import json
    import sys

    if "--probe" in sys.argv:
        print(json.dumps(probe_arguments(), indent=1))
        sys.exit()
    for packet, arguments in scan():
        decided = "refused" if packet in REFUSED_IN_FILES else "proved" if packet in FORWARD_PROOFS else CHECKED_BY_TORCH.get(packet, "UNDECIDED")
        print(f"{packet:60} {', '.join(arguments):40} {decided}")
