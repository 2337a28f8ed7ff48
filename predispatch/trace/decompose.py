"""Which CompositeImplicitAutograd (CIA) ops stay whole in the graph, and which decompose.

The trace asks `DecompositionPolicy.should_decompose(op)` for every op FunctionalTensorMode
meets; this is the single place where that decision is made.  Today's rule, in order:

1. the user's `decompose=` list wins, then the user's `preserve=` list;
2. an op whose schema aliases or mutates decomposes (torch's own answer: a functional graph
   cannot hold it whole);
3. a CIA op outside aten decomposes: custom composites make no schema promises;
4. an aten CIA op stays whole, unless torch itself forces it to decompose.

The composite audit (issue 3) plugs into rule 4 through `verdict_of`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch


def op_name(op: torch._ops.OpOverload) -> str:
    """The canonical name of an overload: `aten.to.dtype`, `aten.linear.default`."""
    return f"{op.namespace}.{op._schema.name.split('::')[1]}.{op._overloadname}"


def is_composite(op: object) -> bool:
    """True for an OpOverload with a CompositeImplicitAutograd kernel."""
    return isinstance(op, torch._ops.OpOverload) and torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd"
    )


@dataclass
class DecompositionLog:
    """What the trace decided for each composite it met: name -> (kept whole?, why)."""

    decisions: dict[str, tuple[bool, str]] = field(default_factory=dict)

    def record(self, op: torch._ops.OpOverload, decomposed: bool, why: str) -> None:
        self.decisions.setdefault(op_name(op), (not decomposed, why))


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
        return cls(frozenset(map(_normalize, preserve)), frozenset(map(_normalize, decompose)))

    def should_decompose(self, op: object, torch_default: Callable[[], bool], log: DecompositionLog) -> bool:
        if not is_composite(op):
            return torch_default()
        decomposed, why = self._decide(op, torch_default)
        log.record(op, decomposed, why)
        return decomposed

    def _decide(self, op: torch._ops.OpOverload, torch_default: Callable[[], bool]) -> tuple[bool, str]:
        names = {op_name(op), op_name(op).rsplit(".", 1)[0]}
        if names & self.decompose:
            return True, "decompose= asked for it"
        if names & self.preserve:
            return False, "preserve= asked for it"
        schema = op._schema
        if schema.is_mutable or any(a.alias_info for a in schema.arguments):
            return True, "its schema mutates or aliases"
        if op.namespace != "aten":
            return True, "non-aten composites decompose by default"
        return verdict_of(op, torch_default)


def verdict_of(op: torch._ops.OpOverload, torch_default: Callable[[], bool]) -> tuple[bool, str]:
    """Default for an aten composite with a functional schema: torch's own answer."""
    if torch_default():
        return True, "torch forces it to decompose"
    return False, "functional schema"


def _normalize(op: object) -> str:
    if isinstance(op, torch._ops.OpOverload):
        return op_name(op)
    if isinstance(op, torch._ops.OpOverloadPacket):
        return f"{op._qualified_op_name.replace('::', '.')}"
    if isinstance(op, str):
        return op.replace("::", ".")
    raise TypeError(f"expected an op or an op name, got {op!r}")
