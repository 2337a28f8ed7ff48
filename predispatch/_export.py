"""`export()`: one call per stage; the table of contents of the pipeline.

    prepare  (frontend/)  module or function + args -> PreparedInputs (named, lifted, fake)
    trace    (trace/)     PreparedInputs -> TracedGraph (functional, pre-dispatch, one trace)
    build    (program/)   PreparedInputs + TracedGraph -> ExportedProgram (passes, signature)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from predispatch._isolation import isolated
from predispatch.frontend import prepare
from predispatch.program import ExportedProgram, build_program
from predispatch.trace import DecompositionPolicy, trace


def export(
    module_or_fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    preserve: Iterable[Any] = (),
    decompose: Iterable[Any] = (),
) -> ExportedProgram:
    """Capture `module_or_fn(*args, **kwargs)` as a functional pre-dispatch ATen program.

    Args:
        module_or_fn: an `nn.Module`, or a function.
        args: positional example inputs, a tuple; leaves are tensors or constants.
        kwargs: keyword example inputs.
        preserve: composite ops (OpOverloads or names like "aten.linear") to keep whole.
        decompose: composite ops to always decompose.

    Tracing runs on fake tensors: no real compute, no copy of the weights.  The module and
    torch's global state are left exactly as they were, whether export succeeds or raises.
    """
    policy = DecompositionPolicy.from_user(preserve, decompose)
    with isolated(module_or_fn):
        prepared = prepare(module_or_fn, args, kwargs)
        traced = trace(prepared, policy)
    return build_program(prepared, traced)
