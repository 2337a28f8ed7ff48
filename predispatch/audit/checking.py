"""Run one CIA kernel on one sample and compare what it did with what its schema declares.

Note [What the checking mode compares]
A CIA kernel's inner calls go back through the dispatcher, past autograd, to the Python key,
where ``EffectMode`` watches them.  Around the whole call we compare:

* inputs before and after: version counter, values and metadata.  A change on an argument
  the schema does not mark ``(a!)`` is MUTATES_INPUT.  The mode also names the inner op that
  wrote to an input's storage, so the evidence says who did it;
* output storages with input storages (``storage_key``: the StorageImpl, shared by views).
  An output sharing an input's storage where the schema declares no alias is ALIASES_INPUT;
  a declared alias that a sample does not realise is CONDITIONAL_ALIAS (the op views or
  copies depending on the input, like ``reshape``); outputs sharing storage with each other
  undeclared is ALIASES_OUTPUT;
* inner ops: random draws (``Tag.nondeterministic_seeded``), data-dependent ones
  (``_local_scalar_dense``, ``Tag.data_dependent_output``/``dynamic_output_shape``) and
  side-effecting ones (torch.fx's list, or no results and no mutation).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from predispatch._torch_internals import (
    OpOverload,
    TorchDispatchMode,
    pytree,
    side_effectful_ops,
    storage_key,
)
from predispatch.audit.ops import (
    Kernel,
    argument_is_mutable,
    bind_arguments,
    declared_aliases,
    kernel_callable,
    outputs_may_alias,
)
from predispatch.audit.samples import Sample, seed_everything
from predispatch.audit.table import Reason

# Checks raise on bad data and do nothing else; an op kept whole raises exactly as eager
# would, so they are not side effects worth decomposing for.
_CHECKS = frozenset({
    torch.ops.aten._linalg_check_errors.default,
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
})
_SIDE_EFFECTFUL = side_effectful_ops() - _CHECKS
_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default


@dataclass(frozen=True)
class Violation:
    """One thing a run did that the schema does not declare."""

    code: Reason
    detail: str  # e.g. "mutates input 'running_mean' (written by aten.copy_.default)"


@dataclass(frozen=True)
class RunResult:
    """The outcome of one kernel on one sample."""

    sample: str  # the sample's label, e.g. "op_db:reshape#3"
    kernel: Kernel
    error: str | None  # the exception, one line, when the kernel raised
    violations: tuple[Violation, ...]
    random: bool  # drew random numbers (declared or not; see Violation for undeclared)
    realised_alias: bool = False  # some output really aliased an input its schema names

    @property
    def clean(self) -> bool:
        return self.error is None and not self.violations


@dataclass(frozen=True)
class _Input:
    """An input tensor as it was before the call."""

    name: str  # schema argument name, with an index for list elements: "tensors[1]"
    argument: str  # schema argument name
    tensor: torch.Tensor
    version: int
    metadata: tuple[Any, ...]
    values: torch.Tensor | None  # a copy, for tensors whose values can be compared


def check(op: OpOverload, kernel: Kernel, sample: Sample) -> RunResult:
    """Run ``kernel`` of ``op`` on a fresh copy of ``sample`` and report every violation."""
    seed_everything()  # a run must not depend on which runs came before it in this process
    try:
        args, kwargs = sample.materialize()
        inputs = _inputs(op, args, kwargs)
    except Exception as e:  # noqa: BLE001  (an exotic tensor the copies cannot handle)
        return RunResult(sample.label, kernel, f"could not copy the sample: {_one_line(e)}",
                         (), False)
    mode = EffectMode({k: i.name for i in inputs for k in storages_of(i.tensor)})
    try:
        with warnings.catch_warnings(), mode:
            warnings.simplefilter("ignore")
            out = kernel_callable(op, kernel)(*args, **kwargs)
    except Exception as e:  # noqa: BLE001  (any failure just makes the sample not count)
        return RunResult(sample.label, kernel, _one_line(e), (), False)
    try:
        return _judge_run(op, kernel, sample, inputs, mode, out)
    except Exception as e:  # noqa: BLE001  (an output the checks cannot read)
        return RunResult(sample.label, kernel, f"could not inspect the result: {_one_line(e)}",
                         (), bool(mode.random))


def _judge_run(op: OpOverload, kernel: Kernel, sample: Sample, inputs: list[_Input],
               mode: EffectMode, out: Any) -> RunResult:
    violations = [*_mutations(op, inputs, mode), *_aliasing(op, inputs, out),
                  *mode.violations(op)]
    realised = _realises_declared_alias(op, inputs, out)
    blind = unchecked_outputs(op, out)
    error = f"cannot inspect the memory of {blind[0]}" if blind and not violations else None
    return RunResult(sample.label, kernel, error, tuple(violations), bool(mode.random), realised)


class EffectMode(TorchDispatchMode):
    """Watches the inner ops of a CIA kernel (see Note [What the checking mode compares])."""

    def __init__(self, watched: Mapping[int | None, str]) -> None:
        super().__init__()
        self.watched = {k: v for k, v in watched.items() if k is not None}
        self.writes: dict[str, str] = {}  # input name -> first inner op that wrote to it
        self.random: list[str] = []
        self.data_dependent: list[str] = []
        self.side_effects: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        self._note_writes(func, args, kwargs)
        self._note_effects(func, args, kwargs)
        return func(*args, **kwargs)

    def _note_writes(self, func: OpOverload, args: Any, kwargs: dict[str, Any]) -> None:
        bound = bind_arguments(func, args, kwargs)
        for a in func._schema.arguments:
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            for t in _tensors(bound.get(a.name)):
                name = self.watched.get(storage_key(t))
                if name is not None:
                    self.writes.setdefault(name, str(func))

    def _note_effects(self, func: OpOverload, args: Any, kwargs: dict[str, Any]) -> None:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.random.append(str(func))
        if _is_data_dependent(func, args):
            self.data_dependent.append(str(func))
        if func in _SIDE_EFFECTFUL or (
            func not in _CHECKS and _returns_nothing_and_mutates_nothing(func)
        ):
            self.side_effects.append(str(func))

    def violations(self, op: OpOverload) -> Iterator[Violation]:
        if self.random and torch.Tag.nondeterministic_seeded not in op.tags:
            yield Violation(
                Reason.DRAWS_RANDOM_UNTAGGED,
                f"draws random numbers (via {self.random[0]}) but the op is not tagged "
                "nondeterministic_seeded",
            )
        if self.data_dependent:
            yield Violation(
                Reason.DATA_DEPENDENT,
                "reads tensor data to decide shapes or control flow "
                f"(via {self.data_dependent[0]})",
            )
        if self.side_effects:
            yield Violation(Reason.SIDE_EFFECT, f"has a side effect (via {self.side_effects[0]})")


def _is_data_dependent(func: OpOverload, args: Any) -> bool:
    if func is _LOCAL_SCALAR or torch.Tag.data_dependent_output in func.tags:
        return True
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if func is torch.ops.aten.index.Tensor:  # only boolean masks give data-dependent shapes
        return any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1:]))
    return True


def _returns_nothing_and_mutates_nothing(func: OpOverload) -> bool:
    schema = func._schema
    return not schema.returns and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments
    )


def _inputs(op: OpOverload, args: Any, kwargs: dict[str, Any]) -> list[_Input]:
    found = []
    for argument, value in bind_arguments(op, args, kwargs).items():
        tensors = _tensors(value)
        for i, t in enumerate(tensors):
            name = argument if isinstance(value, torch.Tensor) else f"{argument}[{i}]"
            found.append(_Input(name, argument, t, t._version, _metadata(t), _values(t)))
    return found


def _mutations(op: OpOverload, inputs: list[_Input], mode: EffectMode) -> Iterator[Violation]:
    for i in inputs:
        if argument_is_mutable(op, i.argument):
            continue
        how = _how_changed(i)
        if how is None and i.name not in mode.writes:
            continue
        by = mode.writes.get(i.name)
        written = f", written by {by}" if by else ""
        yield Violation(
            Reason.MUTATES_INPUT,
            f"mutates input '{i.name}' ({how or 'wrote to its storage'}{written}) "
            "though the schema declares it read-only",
        )


def _how_changed(i: _Input) -> str | None:
    t = i.tensor
    if _metadata(t) != i.metadata:
        return "changed its size, strides or storage"
    if i.values is not None and not _same_values(i.values, t):
        return "changed its values"
    if t._version != i.version:
        return f"version {i.version} -> {t._version}"
    return None


def _aliasing(op: OpOverload, inputs: list[_Input], out: Any) -> Iterator[Violation]:
    outputs = _outputs(op, out)
    by_storage: dict[int, list[_Input]] = {}
    for i in inputs:
        for key in storages_of(i.tensor):
            by_storage.setdefault(key, []).append(i)
    for index, t in outputs:
        sharing = [i for key in storages_of(t) for i in by_storage.get(key, [])]
        sharing += [i for i in inputs if i.tensor is t and i not in sharing]
        yield from _output_vs_inputs(op, index, t, list(dict.fromkeys(sharing)))
    yield from _outputs_vs_each_other(op, outputs)


def storages_of(t: torch.Tensor) -> list[int]:
    """Storage keys of ``t``, or of its components for sparse layouts (which have no storage).

    A sparse tensor built from index and value tensors keeps them, uncopied, as components.
    """
    parts = _SPARSE_PARTS.get(t.layout)
    if parts is None or type(t) is not torch.Tensor:
        key = storage_key(t)
        return [] if key is None else [key]
    try:
        return [k for part in parts for k in storages_of(getattr(t, part)())]
    except (RuntimeError, NotImplementedError):
        return []


_SPARSE_PARTS = {
    torch.sparse_coo: ("_indices", "_values"),
    torch.sparse_csr: ("crow_indices", "col_indices", "values"),
    torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
    torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
    torch.sparse_bsc: ("ccol_indices", "row_indices", "values"),
}


def unchecked_outputs(op: OpOverload, out: Any) -> list[str]:
    """Outputs whose memory the checks cannot see (nested, batched, ...): no clean verdict."""
    return [f"output {i} ({t.layout}, {type(t).__name__})"
            for i, t in _outputs(op, out) if not storages_of(t)]


def _output_vs_inputs(
    op: OpOverload, index: int, t: torch.Tensor, sharing: list[_Input]
) -> Iterator[Violation]:
    declared = declared_aliases(op, index)
    for i in sharing:
        if i.argument not in declared:
            how = "returned it unchanged" if t is i.tensor else "returned a view of it"
            yield Violation(
                Reason.ALIASES_INPUT,
                f"output {index} aliases input '{i.name}' ({how}) but the schema declares no alias",
            )
    realised = {i.argument for i in sharing}
    for name in sorted(declared - realised):
        if _passed_tensor(op, name):
            yield Violation(
                Reason.CONDITIONAL_ALIAS,
                f"output {index} is a fresh tensor, not the declared alias of '{name}'",
            )


def _realises_declared_alias(op: OpOverload, inputs: list[_Input], out: Any) -> bool:
    storages = {k: i.argument for i in inputs for k in storages_of(i.tensor)}
    return any(storages.get(k) in declared_aliases(op, index)
               for index, t in _outputs(op, out) for k in storages_of(t))


def _passed_tensor(op: OpOverload, name: str) -> bool:
    return any(a.name == name and "Tensor" in str(a.type) for a in op._schema.arguments)


def _outputs_vs_each_other(
    op: OpOverload, outputs: list[tuple[int, torch.Tensor]]
) -> Iterator[Violation]:
    seen: dict[int, int] = {}
    for index, t in outputs:
        keys = storages_of(t)
        if not keys or t.numel() == 0:
            continue
        other = seen.setdefault(keys[0], index)
        if other != index and not outputs_may_alias(op, other, index):
            yield Violation(
                Reason.ALIASES_OUTPUT,
                f"outputs {other} and {index} share storage but the schema declares no alias",
            )
            return


def _outputs(op: OpOverload, out: Any) -> list[tuple[int, torch.Tensor]]:
    """(return index, tensor) for every tensor returned, list elements sharing their index."""
    values = out if len(op._schema.returns) > 1 else (out,)
    return [(i, t) for i, v in enumerate(values) for t in _tensors(v)]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def _metadata(t: torch.Tensor) -> tuple[Any, ...]:
    if t.layout != torch.strided:
        return (t.layout, tuple(t.shape))
    return (tuple(t.shape), t.stride(), t.storage_offset(), storage_key(t), t.dtype)


def _values(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's bytes, copied: bitwise equality needs no dtype support and keeps NaNs equal."""
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        return None
    return t.detach().reshape(-1).contiguous().view(torch.uint8).clone()


def _same_values(before: torch.Tensor, after: torch.Tensor) -> bool:
    now = _values(after)
    return now is not None and torch.equal(before, now)


def _one_line(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0]
    first = re.sub(r"0x[0-9a-fA-F]+", "0x…", first)
    return f"{type(e).__name__}: {first[:100]}"
