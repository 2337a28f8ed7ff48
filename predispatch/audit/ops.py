"""Which ops the audit covers, their CIA kernels, and what their schemas declare."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from predispatch._torch_internals import (
    OpOverload,
    aten_overloads,
    cia_registrations,
    has_cpp_cia_kernel,
    python_cia_kernel,
    run_cpp_cia_kernel,
)
from predispatch.audit.table import Reason


class Kernel(enum.Enum):
    """Which CompositeImplicitAutograd kernel ran.

    An op may have both: a C++ kernel (what eager runs, and what a graph that keeps the op
    whole runs) and a Python ``py_impl`` kernel (what ``op.decompose`` and the Python
    dispatcher prefer while tracing).  Either one lying is enough to decompose.  CPP means
    "registered with the dispatcher": for a custom op defined through ``torch.library`` it
    is the Python function given to ``Library.impl``.
    """

    CPP = "C++"
    PYTHON = "Python"


def cia_ops() -> list[OpOverload]:
    """Every aten overload with a CIA kernel in C++ or Python, sorted by name.

    Unlike ``torch._export.utils._collect_all_valid_cia_ops`` this keeps the mutable and
    aliasing ones too: the table must answer for every CIA op the export can meet.
    """
    for name in cia_registrations():  # load the C++ ones into torch.ops.aten
        namespace, _, rest = name.partition("::")
        packet, _, overload = rest.partition(".")
        if namespace == "aten":
            getattr(getattr(torch.ops.aten, packet), overload or "default")
    found = [op for op in aten_overloads() if kernels_of(op)]
    return sorted(found, key=str)


def kernels_of(op: OpOverload) -> tuple[Kernel, ...]:
    python = (Kernel.PYTHON,) if python_cia_kernel(op) is not None else ()
    cpp = (Kernel.CPP,) if has_cpp_cia_kernel(op) else ()
    return python + cpp


def kernel_callable(op: OpOverload, kernel: Kernel) -> Callable[..., Any]:
    if kernel is Kernel.PYTHON:
        return python_cia_kernel(op)  # type: ignore[return-value]
    return lambda *args, **kwargs: run_cpp_cia_kernel(op, *args, **kwargs)


@dataclass(frozen=True)
class SchemaFinding:
    """A reason read off the schema alone, before any sample runs."""

    code: Reason
    detail: str


def schema_findings(op: OpOverload) -> list[SchemaFinding]:
    """What rules ``op`` out of a functional graph by declaration: mutation, aliasing, no tensor."""
    schema = op._schema
    found = [SchemaFinding(Reason.SCHEMA_MUTABLE, _mutable_detail(op, a.name))
             for a in schema.arguments if _writes(a)]
    found += [SchemaFinding(Reason.SCHEMA_ALIAS, _alias_detail(op, i))
              for i, r in enumerate(schema.returns) if r.alias_info is not None and not found]
    if not any(returns_tensor(r.type) for r in schema.returns):
        kinds = ", ".join(str(r.type) for r in schema.returns) or "nothing"
        found.append(SchemaFinding(Reason.NO_TENSOR_RESULT, f"returns {kinds}, no tensor"))
    return found


def returns_tensor(type_: Any) -> bool:
    return "Tensor" in str(type_)


def _writes(argument: Any) -> bool:
    return argument.alias_info is not None and argument.alias_info.is_write


def declared_aliases(op: OpOverload, return_index: int) -> set[str]:
    """Names of the arguments the schema says output ``return_index`` may alias.

    Only explicit annotations count: ``Tensor(a)`` on both sides with a shared set (or a
    wildcard).  torch's ``_SchemaInfo.may_contain_alias`` is no use here, since it lets any
    ``Tensor[]`` input alias any ``Tensor[]`` output.  Python cannot see the set on a list
    element (``Tensor(a)[]`` shows as an empty annotation), so an empty one matches every
    annotated argument.
    """
    schema = op._schema
    ret = schema.returns[return_index].alias_info
    if ret is None:
        return set()
    return {a.name for a in schema.arguments if a.alias_info is not None
            and _sets_meet(_sets(ret), _sets(a.alias_info))}


def outputs_may_alias(op: OpOverload, i: int, j: int) -> bool:
    """Does the schema allow returns ``i`` and ``j`` to share storage?"""
    a, b = op._schema.returns[i].alias_info, op._schema.returns[j].alias_info
    return a is not None and b is not None and _sets_meet(_sets(a), _sets(b))


def _sets(info: Any) -> set[str]:
    return set(info.before_set) | set(info.after_set)


def _sets_meet(a: set[str], b: set[str]) -> bool:
    return not a or not b or "*" in a or "*" in b or bool(a & b)


def argument_is_mutable(op: OpOverload, name: str) -> bool:
    return any(a.name == name and _writes(a) for a in op._schema.arguments)


def _mutable_detail(op: OpOverload, argument: str) -> str:
    base = op._schema.name.split("::")[1]
    dunder = re.fullmatch(r"__i(\w+)__", base)
    if any(a.name == argument and a.kwarg_only for a in op._schema.arguments):
        kind = "an out= variant"
    elif dunder:
        kind = f"the in-place variant of aten.__{dunder.group(1)}__"
    elif base.endswith("_"):
        kind = f"the in-place variant of aten.{base[:-1]}"
    else:
        kind = "a declared in-place write"
    return f"schema mutates '{argument}' ({kind}); a functional graph holds no mutations"


def _alias_detail(op: OpOverload, return_index: int) -> str:
    names = sorted(declared_aliases(op, return_index)) or ["an input"]
    quoted = ", ".join(f"'{n}'" for n in names)
    return f"schema declares output {return_index} a view of {quoted}; views are decomposed"


def bind_arguments(op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Map schema argument names to the values passed, positional or keyword."""
    names = [a.name for a in op._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound
