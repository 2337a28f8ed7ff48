"""FunctionalTensorMode and the mode stacks: the probes and patches that observe in-place ops
and apply the functional rewrites at its `__torch_dispatch__`, reading and writing functional
tensors' values, and the tensor facts `ep.module()`'s write checks and shared state read.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._functorch._aot_autograd.functional_utils import has_data_mutation as _has_data_mutation
from torch._ops import _len_torch_dispatch_stack_pre_dispatch, OpOverload
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.export._remove_effect_tokens_pass import _replace_with_effects_node
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass_type

from predispatch._torch_internals.audit import CIA
from predispatch._torch_internals.decomposition import ask as ask_decompose, pristine_dispatch
from predispatch._torch_internals.mechanism import Hook, patched, raise_held_interrupt


TENSOR_HOOKS = "tensor hook capture (Tensor.register_hook)"
_PROBE_TENSOR = torch.empty(0)


def probe_register_hook() -> None:
    """Register a hook the way user code does (the patch answers it; nothing is registered)."""
    _PROBE_TENSOR.register_hook(None)


REGION_CAPTURE = "grad-mode region capture (make_fx recording torch._C._set_grad_enabled at PreDispatch)"
MODULE_HOOKS = "module hook capture (nn.Module's hook tables)"
DISPATCH_OBSERVER = "the dispatch observer (in-place ops seen at FunctionalTensorMode.__torch_dispatch__)"
FUNCTIONAL_REWRITES = "the functional rewrites (trace/decompose.py REWRITES, at FunctionalTensorMode.__torch_dispatch__)"
MODULE_CALLS = "module-call interception for repeated blocks (make_fx's _ModuleStackTracer.call_module)"

#: FunctionalTensorMode's own methods, before predispatch patches any (see `outside_trace`).
_PRISTINE_FUNCTIONAL_MODE = {
    name: FunctionalTensorMode.__dict__[name]
    for name in ("__torch_dispatch__", "_can_decompose")
    if name in FunctionalTensorMode.__dict__
}


@contextlib.contextmanager
def outside_trace(*, keep_decomposition_policy: bool = True) -> Iterator[None]:
    """Set the running trace aside: its dispatch, pre-dispatch and torch-function modes and
    predispatch's patches of FunctionalTensorMode; put everything back on exit.

    Code run inside sees a clean stack, so neither the outer graph nor the outer observers
    record what it runs.  A Function's subgraphs (`trace_functional`) keep the export's
    decomposition policy (`decomposition_hook`); an export nested in an export, and anything
    else that must run as if no trace were active, passes `keep_decomposition_policy=False`.
    """
    names = ["__torch_dispatch__"] if keep_decomposition_policy else list(_PRISTINE_FUNCTIONAL_MODE)
    outside = {**_PRISTINE_FUNCTIONAL_MODE, "__torch_dispatch__": pristine_dispatch(keep_decomposition_policy)}
    patched = {name: FunctionalTensorMode.__dict__[name] for name in names}
    function_modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        for name in names:
            setattr(FunctionalTensorMode, name, outside[name])
        with _disable_current_modes():
            yield
    finally:
        for name, method in patched.items():
            setattr(FunctionalTensorMode, name, method)
        for mode in reversed(function_modes):
            torch._C._push_on_torch_function_stack(mode)


def mode_stack_depths() -> tuple[int, int, int]:
    """Depths of the dispatch, pre-dispatch and function mode stacks (to check we left them as found)."""
    return (
        torch._C._len_torch_dispatch_stack(),
        _len_torch_dispatch_stack_pre_dispatch(),
        torch._C._len_torch_function_stack(),
    )


def pop_modes_to(depths: tuple[int, int, int]) -> None:
    """Pop dispatch/pre-dispatch/function modes left above `depths` by a failed trace."""
    from torch._ops import _pop_mode_from_pre_dispatch

    while torch._C._len_torch_dispatch_stack() > depths[0]:
        torch._C._pop_torch_dispatch_stack()
    while _len_torch_dispatch_stack_pre_dispatch() > depths[1]:
        _pop_mode_from_pre_dispatch()
    while torch._C._len_torch_function_stack() > depths[2]:
        torch._C._pop_torch_function_stack()


@contextlib.contextmanager
def functional_dispatch_observer(
    before: Callable[[FunctionalTensorMode, Any, tuple, dict], None], after: Callable[[Any, Any], None]
) -> Iterator[Hook]:
    """Call `before(mode, func, args, kwargs)` / `after(func, out)` around every op FunctionalTensorMode handles.

    The functional mode is where in-place ops are seen as in-place (below it they are already
    rewritten); predispatch watches them there to keep autograd history right.
    """

    def observed(original):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            raise_held_interrupt()  # a safe point: Ctrl-C passes from here (interrupts_at_safe_points)
            before(self, func, args, kwargs or {})
            out = original(self, func, types, args, kwargs)
            after(func, out)
            return out

        return __torch_dispatch__

    with patched(FunctionalTensorMode, "__torch_dispatch__", observed, mechanism=DISPATCH_OBSERVER) as hook:
        yield hook


@contextlib.contextmanager
def functional_rewrites(table: dict[OpOverload, tuple[Callable[..., Any], tuple[OpOverload, ...]]]) -> Iterator[Hook]:
    """Run `rewrite(*args, **kwargs)` in FunctionalTensorMode in place of `func`, for
    `table[func] = (rewrite, skips)`.

    For the ops torch's own path gets wrong or slow (see `REWRITES` in trace/decompose.py): a
    composite is rewritten only when the decomposition policy decomposes it and every composite
    in `skips` (those torch's path would pass through; `_can_decompose`, see
    `decomposition_hook`); the rewrite runs inside the mode again, so its own ops are
    functionalized as usual.
    """

    def rewriting(original):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            entry = table.get(func)
            if entry is None or not _rewrites(self, func, entry[1], args, kwargs or {}):
                return original(self, func, types, args, kwargs)
            with self:
                return entry[0](*args, **(kwargs or {}))

        return __torch_dispatch__

    with patched(FunctionalTensorMode, "__torch_dispatch__", rewriting, mechanism=FUNCTIONAL_REWRITES) as hook:
        yield hook


SUBCLASS_DISPATCH = "tensor subclass dispatch at PreDispatch (FunctionalTensorMode.__torch_dispatch__)"

# Note [detach inside a subclass's dispatch]
# Eager runs a subclass's `__torch_dispatch__` below autograd: autograd has already recorded the
# op forward called on the subclass (`nt.values()` is a view with a gradient), and a `detach`
# inside the dispatch only makes a new alias of a part (NestedTensor's `values` returns
# `self._values.detach()`).  The trace runs the dispatch above autograd, where that detach would
# cut the gradient eager gives.  So inside a subclass's dispatch of any op but `detach` itself, a
# detach is traced as `alias`; forward's own `x.detach()` on a subclass stays a detach.
_DETACH = torch.ops.aten.detach.default
_ALIAS = torch.ops.aten.alias.default
REENTRANT_DISPATCH = "a tensor subclass's redispatch from its own dispatch (torch.overrides.enable_reentrant_dispatch)"

#: The tensor types FunctionalTensorMode handles itself (torch's `_has_unrecognized_tensor_types`).
_FUNCTIONAL_TYPES = (torch.Tensor, torch._subclasses.FakeTensor, FunctionalTensor)


_DISPATCH = threading.local()


@contextlib.contextmanager
def in_subclass_dispatch() -> Iterator[None]:
    """Mark code a tensor subclass runs on its own tensors (its `__torch_dispatch__`, and
    predispatch taking one apart), as opposed to forward's code (`inside_subclass_dispatch`)."""
    _DISPATCH.depth = getattr(_DISPATCH, "depth", 0) + 1
    try:
        yield
    finally:
        _DISPATCH.depth -= 1


def inside_subclass_dispatch() -> bool:
    """Whether this thread runs inside `in_subclass_dispatch`."""
    return getattr(_DISPATCH, "depth", 0) > 0


@contextlib.contextmanager
def subclass_dispatch(
    prepare: Callable[[Any, tuple, dict], tuple[tuple, dict]] = lambda func, args, kwargs: (args, kwargs),
) -> Iterator[Hook]:
    """Run a tensor subclass's own `__torch_dispatch__` for an op that reaches the pre-dispatch
    FunctionalTensorMode with a subclass argument, with the mode active again, so the ops the
    subclass runs on its plain tensors are functionalized and traced like any other.

    Below autograd, where AOTAutograd takes subclasses apart, the mode answers NotImplemented and
    the dispatcher calls the subclass next; at the PreDispatch key torch's handler returns that
    NotImplemented as the op's result ("Unable to cast NotImplemented to Tensor").  So the mode
    makes that next call itself (Note [Tensor subclasses] in frontend/subclasses.py).  `prepare(func,
    args, kwargs)`, run in the mode, gives the arguments of each such op forward runs (not of those
    a subclass runs inside its own).

    A subclass's dispatch may hand an op back to the dispatcher, inside
    `torch.overrides.enable_reentrant_dispatch()` (NestedTensor runs a composite it has no rule for
    by its CompositeImplicitAutograd kernel): that restores the Python TLS the C++ dispatcher
    saved on entering Python, which it never entered here, the mode calling the subclass from
    Python ("Accessing torch dispatch state outside of '__torch_dispatch__'").  Inside such a call
    there is nothing to restore, so it is a no-op; the ops the kernel runs come back to the mode.
    """

    def dispatching(original):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            subclasses = [t for t in types if t not in _FUNCTIONAL_TYPES and is_traceable_wrapper_subclass_type(t)]
            if not self.pre_dispatch or not subclasses:
                if func is _DETACH and inside_subclass_dispatch() and getattr(_DISPATCH, "top", None) is not _DETACH:
                    func = _ALIAS  # Note [detach inside a subclass's dispatch]
                return original(self, func, types, args, kwargs)
            with self:
                outermost = not inside_subclass_dispatch()  # an op forward runs, not one a subclass runs inside its own
                if outermost:
                    args, kwargs = prepare(func, args, kwargs or {})
                    _DISPATCH.top = func
                try:
                    with in_subclass_dispatch():
                        for subclass in subclasses:
                            out = subclass.__torch_dispatch__(func, types, args, kwargs or {})
                            if out is not NotImplemented:
                                return out
                finally:
                    if outermost:
                        _DISPATCH.top = None
            return NotImplemented

        return __torch_dispatch__

    def reentrant(original):
        def enable_reentrant_dispatch():
            return contextlib.nullcontext() if inside_subclass_dispatch() else original()

        return enable_reentrant_dispatch

    with contextlib.ExitStack() as stack:
        hook = stack.enter_context(patched(FunctionalTensorMode, "__torch_dispatch__", dispatching, mechanism=SUBCLASS_DISPATCH))
        stack.enter_context(patched(torch.overrides, "enable_reentrant_dispatch", reentrant, mechanism=REENTRANT_DISPATCH))
        yield hook


@contextlib.contextmanager
def meta_kernels(table: dict[OpOverload, Callable[[Callable[..., Any]], Callable[..., Any]]]) -> Iterator[None]:
    """While active, `op`'s Python Meta kernel is `table[op](original)` (see `FAST_INPLACE_META`
    in trace/decompose.py); the originals are back on exit, and the ops' dispatch caches cleared
    both ways, as `py_impl` clears them."""
    meta = torch._C.DispatchKey.Meta
    originals = {op: op.py_kernels[meta] for op in table if meta in op.py_kernels}
    try:
        for op, original in originals.items():
            op.py_kernels[meta] = table[op](original)
            op._dispatch_cache.clear()
        yield
    finally:
        for op, original in originals.items():
            op.py_kernels[meta] = original
            op._dispatch_cache.clear()


def has_no_internal_overlap(t: torch.Tensor) -> bool:
    """Whether no two elements of `t` share memory (torch's MemOverlap::No, from strides)."""
    return torch._debug_has_internal_overlap(t) == 0


def _rewrites(mode: FunctionalTensorMode, func: OpOverload, skips: tuple[OpOverload, ...], args: tuple, kwargs: dict) -> bool:
    """Whether the policy lets `func`'s rewrite run: a composite and everything it skips decompose."""
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), CIA)
    return not composite or all(ask_decompose(mode, op, args, kwargs) for op in (func, *skips))


def functional_value(t: FunctionalTensor) -> torch.Tensor:
    """The tensor a FunctionalTensor currently stands for (its latest functional value)."""
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def set_functional_value(t: FunctionalTensor, value: FunctionalTensor) -> None:
    """Make `t` stand for `value` from now on, as functionalization does for an in-place op's
    result: no op is traced (a `t.copy_(value)` would trace `aten.copy`, which build removes again)."""
    torch._functionalize_replace(t.elem, functional_value(value))
    torch._functionalize_commit_update(t.elem)
    torch._functionalize_sync(t.elem)


def mutation_count(t: torch.Tensor) -> int | None:
    """How many times a tensor of the running functional trace was changed in place so far
    (None for any other tensor): two counts differ when it changed in between."""
    return torch._functionalize_mutation_counter(t.elem) if isinstance(t, FunctionalTensor) else None


def wrap_functional(value: torch.Tensor, mode: FunctionalTensorMode) -> FunctionalTensor:
    """A FunctionalTensor for `value` (a tensor the tracer already knows) in functional mode `mode`."""
    return FunctionalTensor(torch._to_functional_tensor(value), mode)


def unwrap_effects(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Replace `with_effects(token, op, *args)` by `op(*args)` (torch's own rewrite)."""
    _replace_with_effects_node(node, None, {}, [], [], gm)
# --- ep.module()'s write-back checks (runtime/writes.py) ---------------------------------------

def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of `t` share memory for sure (an expanded tensor): eager's in-place
    ops refuse such a target (`assert_no_internal_overlap`); "too hard to tell" counts as no, as
    in eager."""
    return torch._debug_has_internal_overlap(t) == 1


# --- ep.module()'s write-back checks (runtime/writes.py) ----------------------------------------

_FUNCTORCH = torch._C._functorch


def functorch_active() -> bool:
    """Whether a torch.func transform (vmap, grad, jvp, functionalize) is running: only then can a
    call's tensors be functorch's wrappers (Note [Calls under torch.func] in runtime/writes.py)."""
    return _FUNCTORCH.peek_interpreter_stack() is not None


def memory_of(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory `t`'s in-place ops write: `t`, or inside functorch's wrappers
    (vmap's BatchedTensor, grad's GradTrackingTensor, functionalize's), which have no storage to
    read ("Cannot access storage of BatchedTensorImpl"), the plain tensor under all of them."""
    while _FUNCTORCH.is_functorch_wrapped_tensor(t):
        t = _FUNCTORCH.get_unwrapped(t)
    return t


def below_vmap(t: torch.Tensor) -> torch.Tensor:
    """`t` without vmap's wrappers: the tensor vmap's batching rule runs an in-place op on, whose
    autograd and inference state eager's op checks (a BatchedTensor reports none of its own:
    not requires_grad, not a view)."""
    while _FUNCTORCH.is_batchedtensor(t):
        t = _FUNCTORCH.get_unwrapped(t)
    return t


def vmap_levels(t: torch.Tensor) -> frozenset[int]:
    """The vmap levels `t` is batched at (empty outside vmap, or for a tensor vmap did not map)."""
    levels = set()
    while _FUNCTORCH.is_functorch_wrapped_tensor(t):
        if _FUNCTORCH.is_batchedtensor(t):
            levels.add(_FUNCTORCH.maybe_get_level(t))
        t = _FUNCTORCH.get_unwrapped(t)
    return frozenset(levels)


def grad_levels_missing(t: torch.Tensor) -> list[int]:
    """The running grad/jvp transforms (by level) for which `t` is a captured tensor, not one of
    the transform's own: functorch refuses an in-place op on such a tensor ("would mutate a
    captured Tensor", `checkForInvalidMutationOnCaptures`), at the op, whatever it writes."""
    stack = _FUNCTORCH.get_interpreter_stack() or []
    wanted = [i.level() for i in stack if i.key() in (_FUNCTORCH.TransformType.Grad, _FUNCTORCH.TransformType.Jvp)]
    if not wanted:
        return []
    own = set()
    while _FUNCTORCH.is_functorch_wrapped_tensor(t):
        if _FUNCTORCH.is_gradtrackingtensor(t):
            own.add(_FUNCTORCH.maybe_get_level(t))
        t = _FUNCTORCH.get_unwrapped(t)
    return [level for level in wanted if level not in own]


def view_creation_meta(t: torch.Tensor) -> str:
    """How autograd recorded the view `t` was made (`"DEFAULT"`, `"MULTI_OUTPUT_NODE"`,
    `"NO_GRAD_MODE"`, ...): eager refuses an in-place change with grad mode on to any but a
    DEFAULT one (`handle_view_on_rebase`); "DEFAULT" for a tensor that is not a view."""
    if not t._is_view():
        return "DEFAULT"
    return torch._C._autograd._get_creation_meta(t).name


# --- state that shares storage (frontend/shared_storage.py, trace/functional.py) ---------------

def mutated_in_trace(t: torch.Tensor) -> bool:
    """Whether a graph input of the running functional trace had its data changed so far
    (directly or through a view), by AOTAutograd's own test; False for any other tensor."""
    if not isinstance(t, FunctionalTensor):
        return False
    torch._sync(t)
    return bool(_has_data_mutation(t))
