"""Jagged nested tensors (`torch.nested`, `layout=torch.jagged`) under the trace: the two places
torch's constructors misread make_fx's trace, the lazy symbolic sizes a nested int needs, and
sizes compared without guards (Note [Jagged nested tensors] in frontend/subclasses.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx._symbolic_trace as fx_symbolic_trace
import torch.nested._internal.nested_tensor as njt
from torch._subclasses.fake_tensor import UnsupportedOperatorException, unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import maybe_enable_thunkify
from torch.nested._internal.nested_tensor import NestedTensor

from predispatch._torch_internals.functional import outside_trace
from predispatch._torch_internals.mechanism import caller_frame, patched

__all__ = [
    "NO_FAKE_KERNEL",
    "JAGGED_CONSTRUCTORS",
    "NESTED_VIEW_DUMMY",
    "NestedTensor",
    "is_strided_nested",
    "jagged_constructors_traceable",
    "lazy_symbolic_sizes",
    "same_sizes",
    "drop_nested_int_guards",
]

#: What the fake mode raises for an op with no fake kernel (the strided nested layout's ops).
NO_FAKE_KERNEL = UnsupportedOperatorException

#: torch.nested.nested_tensor_from_jagged's refusal of fx.symbolic_trace (`is_fx_tracing`).
JAGGED_CONSTRUCTORS = "jagged nested tensors built in forward (torch.nested.nested_tensor_from_jagged's is_fx_tracing check)"
#: The NestedTensor every jagged view op passes to reach NestedTensor's dispatch (`_nt_view_dummy`).
NESTED_VIEW_DUMMY = "the jagged view ops' dispatch dummy (torch.nested._internal.nested_tensor._nt_view_dummy)"


@contextlib.contextmanager
def jagged_constructors_traceable() -> Iterator[None]:
    """While active, forward may build jagged nested tensors from its tensors.

    - `nested_tensor_from_jagged` refuses to run when `fx.symbolic_trace` is tracing, whose
      tensors are Proxies; it asks `is_fx_tracing()`, which make_fx's trace sets too, though its
      tensors are real tensor objects (torch.compile clears the flag for the same reason,
      `_set_compilation_env`).  Its own check reads False; every other caller reads torch's flag.
    - Each jagged view op (`_nested_view_from_jagged`) passes a NestedTensor dummy, made once
      per process on first use and cached in torch's module; made during the trace it would be
      a fake tensor of this export's fake mode, kept by torch after it.  The trace's dummy is
      made outside the trace, once, and kept here, not in torch's module.
    """
    constructor = torch.nested.nested_tensor_from_jagged.__code__

    def not_tracing_for_constructors(original: Any) -> Any:
        def is_fx_tracing() -> bool:
            frame = caller_frame()
            return False if frame is not None and frame.f_code is constructor else original()

        return is_fx_tracing

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(fx_symbolic_trace, "is_fx_tracing", not_tracing_for_constructors, mechanism=JAGGED_CONSTRUCTORS))
        stack.enter_context(patched(njt, "_nt_view_dummy", lambda original: _view_dummy, mechanism=NESTED_VIEW_DUMMY))
        yield


_DUMMY: list[torch.Tensor] = []


def _view_dummy() -> torch.Tensor:
    """The dispatch dummy, a meta NestedTensor made outside any trace (as torch's own is)."""
    if not _DUMMY:
        with outside_trace(keep_decomposition_policy=False), unset_fake_temporarily():
            values, offsets = torch.zeros(3, 3, device="meta"), torch.zeros(3, device="meta", dtype=torch.int64)
            _DUMMY.append(NestedTensor(values=values, offsets=offsets).detach())
    return _DUMMY[0]


def lazy_symbolic_sizes() -> contextlib.AbstractContextManager[None]:
    """Symbolic size arithmetic traced only where the graph uses it (make_fx's thunks).

    A jagged nested tensor built inside the trace computes its strides from its nested int
    (`j * stride`), a symbol of the fake mode that no graph input carries: traced eagerly,
    that product fails ("s24 is not tracked with proxy"); NestedTensor's own torch function
    handler builds its results under the same switch.
    """
    return maybe_enable_thunkify()


def is_strided_nested(t: torch.Tensor) -> bool:
    """Whether `t` is a nested tensor of the strided layout (torch's C++ NestedTensorImpl, the
    default of `torch.nested.nested_tensor`): fake tensors have no kernels for it."""
    return t.is_nested and not isinstance(t, NestedTensor)


def same_sizes(a: tuple, b: tuple) -> bool:
    """Whether two sizes (or strides) are the same, dimension by dimension, without a guard:
    ints equal, symbols the same expression, nested ints the same nested int."""
    return len(a) == len(b) and all(_same_dim(x, y) for x, y in zip(a, b))


def _same_dim(x: Any, y: Any) -> bool:
    if type(x) is int or type(y) is int:
        return type(x) is type(y) and x == y
    nx, ny = x.node, y.node
    ex, ey = getattr(nx, "expr", None), getattr(ny, "expr", None)  # a trace's symbols (nested ints too)
    if ex is not None or ey is not None:
        return ex is not None and ey is not None and bool(ex == ey)
    return (nx.nested_int(), nx.nested_int_coeff()) == (ny.nested_int(), ny.nested_int_coeff())  # eager's nested ints


def drop_nested_int_guards(shape_env: Any) -> int:
    """Drop the guards on a nested int's symbol (`Ne(s24, 8)`: a jagged tensor's code asking
    whether a dimension is the jagged one) from the trace's ShapeEnv; how many there were.

    A nested int stands for a jagged dimension and equals no int and no other size, so such a
    guard holds at every call; but no input size binds its symbol (a jagged tensor built in
    forward has an ephemeral one), and torch's guard solver fails on a symbol without source
    (an IndexError in `produce_guards`)."""
    from torch.utils._sympy.singleton_int import SingletonInt

    if not shape_env.guards:
        return 0
    hints = shape_env.backed_var_to_val if hasattr(shape_env, "backed_var_to_val") else shape_env.var_to_val
    nested = {symbol for symbol, hint in hints.items() if isinstance(hint, SingletonInt)}
    kept = [guard for guard in shape_env.guards if not guard.expr.free_symbols & nested]
    dropped = len(shape_env.guards) - len(kept)
    shape_env.guards[:] = kept
    return dropped
