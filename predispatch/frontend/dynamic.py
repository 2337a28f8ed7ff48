"""Dynamic dimensions, in torch.export's own vocabulary.

`export(..., dynamic_shapes=...)` takes exactly what `torch.export.export` takes (a pytree of
`torch.export.Dim`s matching the inputs, by argument name or position), so users learn one
way.  The work is torch's: `make_fake_inputs` makes fakes whose marked dimensions are symbols
with the requested ranges, and after the trace `produce_guards_and_solve_constraints` refuses
a dimension the code specialized, with torch's suggested fix.  What predispatch adds is the
record kept in the program: each input's shape in symbols, each symbol's range, and the
guards the trace discovered, so calls are checked and the program prints them.

Note [Size 0 and 1 in a dynamic range]
A symbol made for `Dim("batch", min=1, max=64)` starts in torch's ShapeEnv at [2, 64]: torch
traces assuming a dynamic size is neither 0 nor 1 (`specialize_zero_one`), so that broadcasting
and contiguity checks do not force a guard on every op.  torch.export still records and checks
the range the user declared ([1, 64]): the program is traced for the general size and runs at 1.
The program's `ShapeRecord` does the same: a symbol made for a `Dim` has the `Dim`'s range (the
solver in `check_constraints` has already refused any narrowing the code made, apart from 0/1).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch._torch_internals import pytree
from predispatch.errors import DynamicShapeError, from_torch, user_frame
from predispatch.signature import ShapeRecord


@dataclass(frozen=True)
class DynamicInputs:
    """What `make_fake_inputs` returns that the post-trace check needs again."""

    fake_mode: ti.FakeTensorMode
    fake_args: tuple
    fake_kwargs: dict
    equalities: Any
    original_signature: Any
    dynamic_shapes: Any
    names: tuple[tuple[Any, str], ...] = ()  # (size symbol, the user's Dim name)


def fake_dynamic_inputs(module: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> DynamicInputs:
    """Fakes of the user inputs with symbolic dimensions where `dynamic_shapes` asks."""
    try:
        made = ti.make_fake_inputs(module, args, kwargs, dynamic_shapes)
    except Exception as exc:  # torch's UserError for a malformed spec
        raise from_torch(
            DynamicShapeError(
                f"dynamic_shapes does not match the inputs: {exc}",
                where=user_frame(),
                fix=_missing_entries_fix(module, args, kwargs, dynamic_shapes)
                or "give one entry per argument (by name in a dict, or by position), each a dict "
                "{dim: torch.export.Dim(...)} or a tuple with None for static dimensions.",
            ),
            exc,
        ) from None
    fake_mode, fake_args, fake_kwargs, equalities, signature, shapes = made
    names = _dim_names(module, args, kwargs, dynamic_shapes, (fake_args, fake_kwargs))
    return DynamicInputs(fake_mode, tuple(fake_args), dict(fake_kwargs), equalities, signature, shapes, names)


def _missing_entries_fix(module: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> str | None:
    """The fix for a `dynamic_shapes` dict that leaves out arguments passed to the call: torch
    wants an entry for each, `None` for a constant (`scale=3.0`) or a tensor with no dynamic
    dimension, and its message says only which keys it expected.  None when the call's arguments
    cannot be bound to names (`*args`, `**kwargs`: torch's own message and our generic fix stand)."""
    if not isinstance(dynamic_shapes, dict):
        return None
    try:
        signature = inspect.signature(module.forward if isinstance(module, nn.Module) else module)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    if any(signature.parameters[name].kind in variadic for name in bound.arguments):
        return None
    missing = [name for name in bound.arguments if name not in dynamic_shapes]
    if not missing:
        return None
    constants = [name for name in missing
                 if not any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(bound.arguments[name]))]
    why = "".join(f"; {name}={bound.arguments[name]!r} is a constant (baked into the program), whose entry is None"
                  for name in constants)
    return (f"add {', '.join(f'{name!r}: None' for name in missing)} to dynamic_shapes: torch wants an entry for every "
            f"argument passed{why}; a tensor argument with no dynamic dimension takes None too.")


DIM_NAMES = "the user's Dim names (torch.export.dynamic_shapes._process_dynamic_shapes)"


def _dim_names(module: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any,
               fakes: Any) -> tuple[tuple[Any, str], ...]:
    """The symbol each named `Dim` became, with its name: the program keeps the user's names
    (`batch`, not `s77`) for what reads them later, ONNX's dynamic axes first (`to_onnx`)."""
    fake_of = {id(real): fake for real, fake in zip(pytree.tree_leaves((args, kwargs)), pytree.tree_leaves(fakes))}
    names: dict[Any, str] = {}
    for tensor_id, dim, name in ti.named_dims(module, args, kwargs, dynamic_shapes):
        if tensor_id not in fake_of:  # torch's reading binds the spec to the inputs we fakified
            raise ti.drift(DIM_NAMES, f"its reading of dynamic_shapes names Dim {name!r} on a tensor that is not an input")
        size = fake_of[tensor_id].shape[dim]
        if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
            names.setdefault(size.node.expr, name)
    return tuple(names.items())


def check_constraints(dynamic: DynamicInputs, gm: fx.GraphModule) -> None:
    """Refuse dimensions marked dynamic that the code specialized (torch's solver, torch's message)."""
    try:
        ti.produce_guards_and_solve_constraints(
            dynamic.fake_mode, gm, dynamic.dynamic_shapes, dynamic.equalities, dynamic.original_signature
        )
    except ti.ConstraintViolationError as exc:
        raise from_torch(
            DynamicShapeError(
                "a dimension marked dynamic cannot be dynamic in this code:\n" + str(exc),
                where=user_frame(),
                fix="apply the suggested dynamic_shapes fix above, or mark the dimension static.",
            ),
            exc,
        ) from None


def shape_record(fake_mode: ti.FakeTensorMode, user_placeholders: list[fx.Node],
                 dim_names: tuple[tuple[Any, str], ...] = ()) -> ShapeRecord:
    """Read symbols, ranges and guards off the traced graph's user inputs and the ShapeEnv;
    `dim_names` (from `DynamicInputs`) name the symbols the trace kept or merged them into."""
    shapes: list[tuple[int | str, ...]] = []
    symbols: dict[str, Any] = {}
    for node in user_placeholders:
        val = node.meta.get("val")
        dims = tuple(_dim(d, symbols) for d in val.shape) if isinstance(val, torch.Tensor) else ()
        shapes.append(dims)
    env = fake_mode.shape_env
    declared = _declared_ranges(env)
    ranges = tuple((name, *_bounds(env, sym, declared)) for name, sym in sorted(symbols.items()))
    guards = tuple(str(g.expr) for g in env.guards) if symbols else ()
    guards += tuple(f"runtime: {a.expr}" for asserts in env.deferred_runtime_asserts.values() for a in asserts)
    origins = tuple((name, _origin(env, sym)) for name, sym in sorted(symbols.items()) if _origin(env, sym))
    return ShapeRecord(tuple(shapes), ranges, guards, origins, _kept_names(env, symbols, dim_names))


def _kept_names(env: Any, symbols: dict[str, Any], dim_names: tuple[tuple[Any, str], ...]) -> tuple[tuple[str, str], ...]:
    """(symbol, Dim name) for the program's symbols: a symbol the trace replaced by another
    (two `Dim`s found equal) names the one kept, first name first."""
    kept: dict[str, str] = {}
    for sym, name in dim_names:
        now = str(env.replace(sym))
        if now in symbols:
            kept.setdefault(now, name)
    return tuple(sorted(kept.items()))


def _origin(env: Any, sym: Any) -> str:
    """The input dimension a symbol was made for, as `x.size()[0]` (torch's source name, shortened)."""
    sources = env.var_to_sources.get(sym) or []
    return sources[0].name.replace("L['", "").replace("']", "", 1) if sources else ""


def _dim(d: int | torch.SymInt, symbols: dict) -> int | str:
    if isinstance(d, int):
        return d
    expr = d.node.expr
    if expr.is_number:
        return int(expr)
    for sym in expr.free_symbols:
        symbols[str(sym)] = sym
    return str(expr)


def _declared_ranges(env: Any) -> dict[Any, Any]:
    """`{symbol: ValueRanges}` the user's `Dim`s declared for the input dimensions they name.

    make_fake_inputs records each input's fake with its dimension constraints (a `Dim`'s
    `StrictMinMaxConstraint`); its range is what the program keeps (Note [Size 0 and 1 in a
    dynamic range]).
    """
    declared: dict[Any, Any] = {}
    for tracked in env.tracked_fakes or ():
        constraints = getattr(tracked.symbolic_context, "constraint_sizes", None) or ()
        sizes = tracked.fake.shape if isinstance(tracked.fake, torch.Tensor) else ()
        for size, constraint in zip(sizes, constraints):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol and hasattr(constraint, "vr"):
                declared[size.node.expr] = constraint.vr
    return declared


def _bounds(env: Any, sym: Any, declared: dict[Any, Any]) -> tuple[int, int | None]:
    """A size symbol's inclusive range; an unbounded maximum is None."""
    vr = declared.get(sym) or env.var_to_range.get(sym)
    if vr is None:
        return 0, None
    return _finite(vr.lower) or 0, _finite(vr.upper)


def _finite(bound: Any) -> int | None:
    """A sympy bound as an int, None for an infinite one (torch's `int_oo` is not `is_finite=False`)."""
    try:
        return int(bound)
    except (OverflowError, TypeError, AttributeError, ValueError):
        return None
