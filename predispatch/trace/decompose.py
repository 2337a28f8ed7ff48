"""Which CompositeImplicitAutograd (CIA) ops stay whole in the graph, and which decompose.

The trace asks `DecompositionPolicy.should_decompose(op)` for every op FunctionalTensorMode
meets; this is the single place where that decision is made.  The rule, in order:

1. the user's `decompose=` list wins, then the user's `preserve=` list (checked against the
   audit when the policy is made: preserving an op the audit condemns is refused);
2. an op whose schema aliases or mutates decomposes: a functional graph cannot hold it whole;
3. a CIA op outside aten decomposes: custom composites make no schema promises;
4. an aten CIA op follows the composite audit (`predispatch/audit/`): it stays whole only
   when its verdict is PRESERVE, i.e. samples ran clean on every kernel it has.  An op torch
   itself forces to decompose (tag `maybe_aliasing_or_mutating`) decomposes whatever the
   audit says, and an op missing from the table (a newer torch) decomposes until audited.

Autocast: an op kept whole inside an autocast region is cast at run time by the same
autocast kernel as in eager (the region HOP re-enters autocast), so it gets eager's dtype.
A decomposed op's pieces are cast one by one instead; for ops autocast lists that is where
dtypes could differ from eager, which is why the audit keeps every op it can.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from predispatch import _torch_internals as ti


def op_name(op: torch._ops.OpOverload) -> str:
    """The canonical name of an overload: `aten.to.dtype`, `aten.linear.default`."""
    return f"{op.namespace}.{op._schema.name.split('::')[1]}.{op._overloadname}"


def is_composite(op: object) -> bool:
    """True for an OpOverload with a CompositeImplicitAutograd kernel."""
    if not isinstance(op, torch._ops.OpOverload):
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # a TorchScript-only overload (aten::add.t) the dispatcher does not know
        return False


def mutates_or_aliases(op: torch._ops.OpOverload) -> bool:
    """Rule 2: the schema itself rules the op out of a functional graph (in-place, out=, views)."""
    schema = op._schema
    return schema.is_mutable or any(a.alias_info for a in schema.arguments)


@dataclass
class DecompositionLog:
    """What the trace decided for each composite it met: name -> (kept whole?, why).

    This is `ep.audit`: printing it lists the composites the program kept and those it
    decomposed, each with the reason.
    """

    decisions: dict[str, tuple[bool, str]] = field(default_factory=dict)

    def record(self, op: torch._ops.OpOverload, decomposed: bool, why: str) -> None:
        """The first decision for `op`; an op decided per call (`CALL_DEPENDENT_ALIASING`) that
        was both kept and decomposed is listed as kept, with both reasons."""
        name = op_name(op)
        earlier = self.decisions.get(name)
        if earlier is not None and earlier[0] == decomposed and not earlier[1].startswith("per call:"):
            kept_why, decomposed_why = (self.decisions[name][1], why) if decomposed else (why, self.decisions[name][1])
            self.decisions[name] = (True, f"per call: kept where {kept_why}; decomposed where {decomposed_why}")
            return
        self.decisions.setdefault(name, (not decomposed, why))

    @property
    def kept(self) -> list[str]:
        return sorted(name for name, (kept, _) in self.decisions.items() if kept)

    @property
    def decomposed(self) -> list[str]:
        return sorted(name for name, (kept, _) in self.decisions.items() if not kept)

    def __str__(self) -> str:
        if not self.decisions:
            return "No composite (CompositeImplicitAutograd) op was met."
        width = max(map(len, self.decisions))
        lines = []
        for title, names in (("Kept whole:", self.kept), ("Decomposed:", self.decomposed)):
            if names:
                lines.append(title)
                lines.extend(f"    {n:<{width}}  {self.decisions[n][1]}" for n in names)
        return "\n".join(lines)


@dataclass(frozen=True)
class DecompositionPolicy:
    """The user's overrides plus the default rule (see the module docstring).

    preserve: op names (`aten.foo.default` or packet `aten.foo`) to keep whole.
    decompose: op names to always decompose.
    """

    preserve: frozenset[str] = frozenset()
    decompose: frozenset[str] = frozenset()

    @classmethod
    def from_user(cls, preserve: Iterable[object] = (), decompose: Iterable[object] = ()) -> DecompositionPolicy:
        """Check the user's lists (see `_check_preservable`) and normalize them to names."""
        preserve, decompose = list(preserve), list(decompose)
        for op in preserve:
            for overload in _composites_named(op):
                _check_preservable(overload)
        for op in decompose:
            _composites_named(op)
        return cls(frozenset(map(_normalize, preserve)), frozenset(map(_normalize, decompose)))

    def should_decompose(
        self, op: object, torch_default: Callable[[], bool], log: DecompositionLog, args: tuple = (), kwargs: dict | None = None
    ) -> bool:
        if not is_composite(op):
            return torch_default()
        decomposed, why = self._decide(op, torch_default, args, kwargs or {})
        log.record(op, decomposed, why)
        return decomposed

    def _decide(
        self, op: torch._ops.OpOverload, torch_default: Callable[[], bool], args: tuple, kwargs: dict
    ) -> tuple[bool, str]:
        names = {op_name(op), op_name(op).rsplit(".", 1)[0]}
        if names & self.decompose:
            return True, "decompose= asked for it"
        if names & self.preserve:
            return False, "preserve= asked for it"
        if mutates_or_aliases(op):
            return True, "its schema mutates or aliases"
        if op.namespace != "aten":
            return True, "non-aten composites decompose by default"
        if op in CALL_DEPENDENT_ALIASING:
            aliases, which = CALL_DEPENDENT_ALIASING[op]
            if aliases(*args, **kwargs):
                return True, f"the call aliases its input ({which})"
            return False, "the call does not alias its input"
        return verdict_of(op, torch_default)


def verdict_of(op: torch._ops.OpOverload, torch_default: Callable[[], bool]) -> tuple[bool, str]:
    """Rule 4: an aten composite with a functional schema follows the audit table."""
    from predispatch.audit import Verdict, load_table

    if torch_default():
        return True, "torch forces it to decompose (maybe_aliasing_or_mutating)"
    entry = load_table().get(op)
    if entry is None:
        return True, "not in the audit table of this torch version: decomposed until audited"
    if entry.verdict is Verdict.PRESERVE:
        return False, f"audit: {entry.reason}"
    return True, f"audit ({entry.verdict.value}): {entry.reason}"


def _composites_named(op: object) -> list[torch._ops.OpOverload]:
    """The CIA overloads `op` names (an overload, a packet, or their names); refuse anything else."""
    from predispatch.errors import DecompositionError, user_frame

    name = _normalize(op)
    namespace, _, rest = name.partition(".")
    packet_name, _, overload_name = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace, None), packet_name, None) if rest else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise DecompositionError(
            f"there is no op {name!r}.", where=user_frame(), fix="name ops like 'aten.linear' or 'aten.to.dtype'."
        )
    names = [overload_name] if overload_name else packet.overloads()
    overloads = [o for o in map(lambda n: _overload(packet, n), names) if o is not None]
    composites = [o for o in overloads if is_composite(o)]
    if not composites:
        raise DecompositionError(
            f"{name!r} is not a CompositeImplicitAutograd composite, so it is never decomposed.",
            where=user_frame(),
            fix="remove it from preserve=/decompose=; only composites can be kept whole or decomposed.",
        )
    return composites


def _overload(packet: torch._ops.OpOverloadPacket, name: str) -> torch._ops.OpOverload | None:
    """`packet.<name>`, or None for a TorchScript-only overload the dispatcher does not know."""
    try:
        return getattr(packet, name)
    except (AttributeError, RuntimeError):
        return None


def _check_preservable(op: torch._ops.OpOverload) -> None:
    """Refuse to keep whole an op that cannot be: it aliases/mutates, or the audit condemns it."""
    from predispatch.audit import Verdict, load_table
    from predispatch.errors import DecompositionError, user_frame

    reason = None
    if mutates_or_aliases(op):
        reason = "its schema mutates or aliases, which no functional graph can hold"
    elif op.namespace == "aten":
        entry = load_table().get(op)
        if entry is not None and entry.verdict is Verdict.MUST_DECOMPOSE:
            reason = f"the composite audit found: {entry.reason} (evidence: {entry.evidence})"
    if reason:
        raise DecompositionError(
            f"cannot preserve {op_name(op)}: {reason}.",
            where=user_frame(),
            fix=f"remove {op_name(op)!r} from preserve=; keeping it whole would give a wrong program.",
        )


def _normalize(op: object) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return op_name(op)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return f"{op._qualified_op_name.replace('::', '.')}"
    if isinstance(op, str):
        return op.replace("::", ".")
    raise TypeError(f"expected an op or an op name, got {op!r}")


# Note [Rewrites of torch's own path]
# -------------------------------------
# A few ops come out of torch's functional pre-dispatch path wrong, or not at all; `REWRITES`
# runs predispatch's version of each instead (`ti.functional_rewrites`; a composite only when
# the policy decomposes it, so `decompose=`/`preserve=` and `ep.audit` still apply):
#
# - aliasing that depends on the call: eval-mode `dropout` returns its input itself in eager,
#   so a later in-place op on the result changes the input; torch's Python decomposition
#   clones; the rewrite returns the input itself too (no node: `y is x`, as in eager, and an
#   `alias` node per dropout cost 4% of Whisper's export).  `unsafe_chunk`/`unsafe_split` return
#   views of the input whose schema hides it, so functionalization does not see a later in-place
#   op reach the input; the rewrites use the view op functionalization tracks (`split`).  Either
#   way the mutation is written back to the input as eager makes it.
# - composites whose C++ kernel reads tensor data, which fake tensors do not have ("data is not
#   allocated yet"): `_reshape_from_tensor` (the shape comes from a tensor's values) and
#   `_saturate_weight_to_fp16` (clamps the weight to the float16 range, in place).
# - in-place ops functionalization cannot pair with a functional twin (`polygamma_`: the
#   functional `polygamma` takes its arguments in another order).
#
# One rewrite is for speed, not correctness, and gives the very graph torch's path gives:
#
# - `batch_norm` reaches its functional op through three composites (`batch_norm` ->
#   `_batch_norm_impl_index` -> `native_batch_norm`'s Python decomposition ->
#   `_native_batch_norm_legit*`), each a trip through the trace's modes: about 1 ms of a CNN's
#   export per BatchNorm, a tenth of ResNet's.  The rewrite calls the op the chain ends in,
#   for the calls where the chain is known (a CPU or meta input with elements, the statistics
#   given both or neither, per-channel shapes right); any other call takes torch's path.
#   `_batch_norm_impl_index` is still put to the policy (`Rewrite.skips`), so `ep.audit`
#   lists what the long path lists.  tests/test_decompose.py compares the two paths' graphs.


def _dropout(op: torch._ops.OpOverload) -> Callable[..., torch.Tensor]:
    """`op` (a dropout) as eager runs it: the input itself when nothing is dropped."""

    def dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
        if train and p != 0:
            return op.decompose(input, p, train)
        return input

    return dropout


def _unsafe_chunk(self: torch.Tensor, chunks: int, dim: int = 0) -> list[torch.Tensor]:
    size = self.size(dim)
    return torch.ops.aten.split.Tensor(self, (size + chunks - 1) // chunks, dim)


def _reshape_from_tensor(self: torch.Tensor, shape: torch.Tensor) -> torch.Tensor:
    sizes = shape.tolist()  # data-dependent: unbacked sizes under fake tensors
    return self.reshape(sizes)


_FP16_MAX = 65504.0


def _saturate_weight_to_fp16(weight: torch.Tensor) -> torch.Tensor:
    """The C++ kernel clamps the first `size(0) * size(1)` elements of `weight.contiguous()` to
    the float16 range in place (so `weight` itself when contiguous) and returns `weight`."""
    target = weight if weight.is_contiguous() else weight.contiguous()
    target.view(-1)[: weight.size(0) * weight.size(1)].clamp_(-_FP16_MAX, _FP16_MAX)
    return torch.ops.aten.alias.default(weight)


def _polygamma_(self: torch.Tensor, n: int) -> torch.Tensor:
    return self.copy_(torch.ops.aten.polygamma.default(n, self))


_aten = torch.ops.aten


def _batch_norm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    training: bool,
    momentum: float,
    eps: float,
    cudnn_enabled: bool,
) -> torch.Tensor:
    """`batch_norm` straight to the op torch's chain of composites ends in (Note [Rewrites of
    torch's own path]); a call outside the known cases takes the chain itself."""
    if not _native_batch_norm_call(input, weight, bias, running_mean, running_var):
        return _aten.batch_norm.default.decompose(
            input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled
        )
    if running_mean is None:
        return _aten._native_batch_norm_legit.no_stats(input, weight, bias, training, momentum, eps)[0]
    if training:
        return _aten._native_batch_norm_legit.default(input, weight, bias, running_mean, running_var, True, momentum, eps)[0]
    return _aten._native_batch_norm_legit_no_training.default(input, weight, bias, running_mean, running_var, momentum, eps)[0]


def _native_batch_norm_call(input: torch.Tensor, *per_channel: torch.Tensor | None) -> bool:
    """Whether `_batch_norm_impl_index` would call `native_batch_norm` (a CPU or meta input:
    CUDA may take cuDNN) and its Python decomposition would not raise: elements in the input,
    running statistics given both or neither, each per-channel tensor of the channels' size."""
    running_mean, running_var = per_channel[2:]
    return (
        input.device.type in ("cpu", "meta")
        and input.dim() >= 2
        and input.numel() > 0
        and (running_mean is None) == (running_var is None)
        and all(t is None or (t.dim() == 1 and t.numel() == input.shape[1]) for t in per_channel)
    )


@dataclass(frozen=True)
class Rewrite:
    """predispatch's version of one op (Note [Rewrites of torch's own path]).

    fn: runs in the op's place, inside FunctionalTensorMode.
    reason: why torch's own path is not taken.
    skips: composites torch's path passes through and `fn` does not; each is still put to the
        decomposition policy, and `fn` runs only if the policy decomposes them all (so
        `ep.audit` and `preserve=` see what they would see on torch's path).
    """

    fn: Callable[..., object]
    reason: str
    skips: tuple[torch._ops.OpOverload, ...] = ()


#: predispatch's version of ops torch's path gets wrong, or slowly; see Note [Rewrites of
#: torch's own path].
REWRITES: dict[torch._ops.OpOverload, Rewrite] = {
    _aten.dropout.default: Rewrite(
        _dropout(_aten.dropout.default),
        "eager returns its input itself when not training or p == 0; torch's decomposition clones",
    ),
    _aten.unsafe_chunk.default: Rewrite(_unsafe_chunk, "eager's chunks are views of the input; split is the tracked view op"),
    _aten.unsafe_split.Tensor: Rewrite(
        lambda self, size, dim=0: _aten.split.Tensor(self, size, dim),
        "eager's pieces are views of the input, which unsafe_split's schema does not declare",
    ),
    _aten.unsafe_split_with_sizes.default: Rewrite(
        lambda self, sizes, dim=0: _aten.split_with_sizes.default(self, sizes, dim),
        "eager's pieces are views of the input, which unsafe_split_with_sizes's schema does not declare",
    ),
    _aten._reshape_from_tensor.default: Rewrite(_reshape_from_tensor, "the C++ kernel reads the shape tensor's data"),
    _aten._saturate_weight_to_fp16.default: Rewrite(
        _saturate_weight_to_fp16, "the C++ kernel reads and writes the weight's data"
    ),
    _aten.polygamma_.default: Rewrite(
        _polygamma_,
        "polygamma_(Tensor(a!) self, int n) vs polygamma(int n, Tensor self): functionalization finds no twin",
    ),
    _aten.batch_norm.default: Rewrite(
        _batch_norm,
        "speed: the same graph without three composites' trips through the trace's modes",
        skips=(_aten._batch_norm_impl_index.default,),
    ),
}


def _same_tensor_meta(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The Meta kernel of a unary in-place op on a floating tensor that no two elements of
    share: the tensor itself, as torch's Python kernel ends (`self.copy_(op(self))`) without
    running the op's Python reference on meta tensors first."""

    def meta(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if self.is_floating_point() and ti.has_no_internal_overlap(self):
            return self
        return original(self, *args, **kwargs)

    return meta


# Note [Meta kernels of in-place activations]
# --------------------------------------------
# Functionalizing an in-place op, torch first runs it on meta tensors to catch shape errors the
# functional twin would not raise.  For `hardtanh_` (ReLU6), `silu_`, `hardswish_`,
# `leaky_relu_`, ... the Meta kernel is a Python decomposition (`register_inplace` in
# torch/_decomp/decompositions.py) that runs the op's Python reference, prim by prim: 1.4 ms of
# a 2 ms op, three times what `relu_` costs, on every in-place activation of a CNN.  For a unary
# elementwise op on a floating tensor that check can find nothing (the result has the tensor's
# shape and dtype), so while export traces these ops' Meta kernel returns the tensor at once;
# any other call (an integer tensor, an overlapping one) keeps torch's kernel.  The graph does
# not change: meta results are never recorded.

#: Unary in-place ops whose Meta kernel is replaced while export traces; see Note [Meta kernels
#: of in-place activations].
FAST_INPLACE_META: dict[torch._ops.OpOverload, Callable[..., Callable[..., torch.Tensor]]] = {
    op: _same_tensor_meta
    for op in (
        _aten.hardtanh_.default,
        _aten.silu_.default,
        _aten.hardswish_.default,
        _aten.hardsigmoid_.default,
        _aten.leaky_relu_.default,
        _aten.gelu_.default,
        _aten.logit_.default,
        _aten.round_.default,
        _aten.round_.decimals,
    )
}


def _einsum_aliases(equation: str, tensors: list[torch.Tensor], path: object = None) -> bool:
    """Whether eager's einsum returns a view of its operand: one operand, and no label summed
    (`'ij->ji'`, `'ii->i'`, `'...'`); any other call computes a new tensor."""
    if len(tensors) != 1:
        return False
    lhs, arrow, rhs = equation.replace(" ", "").partition("->")
    labels = _einsum_labels(lhs)
    if arrow:
        return set(labels) <= set(_einsum_labels(rhs))
    return len(labels) == len(set(labels))


def _einsum_labels(term: str) -> list[str]:
    """The labels of one side of an equation, an ellipsis counting as one label."""
    labels = list(term.replace("...", ""))
    return [*labels, "..."] if "..." in term else labels


#: Composites that alias an input for some calls only: the predicate says whether this call
#: does.  A call that does not alias keeps the op whole (the audit's only complaint about it
#: is aliasing); one that does decomposes.
CALL_DEPENDENT_ALIASING: dict[torch._ops.OpOverload, tuple[Callable[..., bool], str]] = {
    _aten.einsum.default: (_einsum_aliases, "one operand, no summed label: a permutation or diagonal"),
}



# Note [Scatters into complex tensors]
# -------------------------------------
# Functionalization turns a write into a view (`out[..., :k] = v`, a Fourier layer's modes) into
# a scatter of the new values into the base: `slice_scatter` / `select_scatter`.  The trace runs
# above autograd, so those ops meet their autograd kernels, which have no complex formula
# ("slice_scatter does not support automatic differentiation for outputs with complex dtype"),
# although eager's `copy_` into the view has one; the program, run eagerly, would meet the same
# kernels.  So for complex tensors the trace records the scatter on the real view of both
# tensors, which autograd differentiates as it does `copy_` (the gradient of the written part is
# the slice of the output's gradient, the rest is the base's):
#
#     view_as_complex(slice_scatter(view_as_real(base), view_as_real(src), dim, start, end, step))
#
# `view_as_real` appends the (real, imaginary) dimension last, so `dim` is taken as non-negative.
# Every complex call is rewritten, not only those requiring grad at export: the program's inputs
# may require grad when it runs.  Other dtypes take the op itself.


def _complex_slice_scatter(
    self: torch.Tensor, src: torch.Tensor, dim: int = 0, start: object = None, end: object = None, step: int = 1
) -> object:
    """`slice_scatter` on complex tensors through their real views (Note [Scatters into complex tensors])."""
    if not self.is_complex():
        return NotImplemented
    real = _aten.slice_scatter.default(
        _aten.view_as_real.default(self), _aten.view_as_real.default(src), dim % self.dim(), start, end, step
    )
    return _aten.view_as_complex.default(real)


def _complex_select_scatter(self: torch.Tensor, src: torch.Tensor, dim: int, index: int) -> object:
    """`select_scatter` on complex tensors through their real views (Note [Scatters into complex tensors])."""
    if not self.is_complex():
        return NotImplemented
    real = _aten.select_scatter.default(
        _aten.view_as_real.default(self), _aten.view_as_real.default(src), dim % self.dim(), index
    )
    return _aten.view_as_complex.default(real)


#: Ops the trace records otherwise where torch's path fails, each with its reason; they run in
#: make_fx's tracer (below functionalization, which makes them) and return NotImplemented for
#: the calls torch's path handles.
TRACE_DECOMPOSITIONS: dict[torch._ops.OpOverload, tuple[Callable[..., object], str]] = {
    _aten.slice_scatter.default: (
        _complex_slice_scatter,
        "no complex autograd formula; functionalization makes it from a write into a slice of a complex tensor",
    ),
    _aten.select_scatter.default: (
        _complex_select_scatter,
        "no complex autograd formula; functionalization makes it from a write into an index of a complex tensor",
    ),
}


#: The mechanism `TRACE_DECOMPOSITIONS` rely on, for drift errors.
TRACE_DECOMPOSITIONS_MECHANISM = "the trace's decompositions (make_fx's decomposition_table, trace/decompose.py)"


def trace_decompositions() -> dict[torch._ops.OpOverload, Callable[..., object]]:
    """`TRACE_DECOMPOSITIONS` as make_fx takes them."""
    return {op: fn for op, (fn, _) in TRACE_DECOMPOSITIONS.items()}


def check_trace_decompositions(gm: torch.fx.GraphModule) -> None:
    """Raise if a call `TRACE_DECOMPOSITIONS` rewrites reached the graph whole (Note [Drift is
    loud]): a complex scatter there means make_fx did not take the table."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.target in TRACE_DECOMPOSITIONS and isinstance(value, torch.Tensor) and value.is_complex():
            raise ti.drift(TRACE_DECOMPOSITIONS_MECHANISM, f"{node.target} on a complex tensor reached the graph whole")
