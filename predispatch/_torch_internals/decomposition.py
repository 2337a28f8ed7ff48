"""FunctionalTensorMode's "decompose this composite?" question, answered by predispatch's policy.

Two variants (Note [Variants by torch version] in predispatch/_torch_versions.py):

- M (torch >= 2.12): the question is the method `FunctionalTensorMode._can_decompose`, which
  `__torch_dispatch__` calls; we replace the method for the trace.
- C (torch 2.11): the question is a closure inside `__torch_dispatch__`, out of reach; an adapter
  placed around `__torch_dispatch__` asks the policy first.  Where the policy decomposes and
  torch would not, the adapter decomposes with torch's own lines (`func.decompose` inside the
  mode); where the policy keeps whole what torch would decompose, it cannot, and says so
  (`TorchDriftError`): never a program with another decomposition than the policy's.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.utils import _pytree as pytree

from predispatch._torch_internals.mechanism import drift, patched
from predispatch._torch_versions import HAS

__all__ = ["MECHANISM", "ask", "decomposition_hook", "pristine_dispatch", "torch_can_decompose_fast", "torch_default"]

MECHANISM = "the decomposition hook (FunctionalTensorMode's question whether to inline a composite)"

#: The question the running trace's policy answers, and the `__torch_dispatch__` that asks it
#: (variant C), innermost last; `outside_trace` keeps them for a Function's subgraphs.
_ACTIVE: list[tuple[Callable[..., bool], Any]] = []

#: torch's own `__torch_dispatch__`, before any patch of predispatch's.
PRISTINE_DISPATCH = FunctionalTensorMode.__dict__["__torch_dispatch__"]


def torch_can_decompose_fast(func: Any, export: bool, pre_dispatch: bool) -> bool | None:
    """torch's answer from `(func, export, pre_dispatch)` alone, or None where it depends on the call."""
    if HAS.can_decompose_fast:
        from torch._subclasses.functional_tensor import _can_decompose_fast

        return _can_decompose_fast(func, export, pre_dispatch)
    return _rules_of_2_11(func, export, pre_dispatch)


def _rules_of_2_11(func: Any, export: bool, pre_dispatch: bool) -> bool | None:
    """torch 2.11's closure `_can_decompose`, written out (its later releases name it
    `_can_decompose_fast`): the same rules in the same order."""
    from torch._decomp import _should_decompose_because_unsafe_op

    if export and func is torch.ops.aten.dropout.default:
        return False
    if _should_decompose_because_unsafe_op(func):
        return True
    if any(arg.alias_info for arg in func._schema.arguments) or func._schema.is_mutable:
        return True
    if export:
        return not pre_dispatch
    return None


def torch_default(mode: FunctionalTensorMode, func: Any, args: tuple, kwargs: dict) -> bool:
    """What torch's FunctionalTensorMode would answer for this call."""
    fast = torch_can_decompose_fast(func, mode.export, mode.pre_dispatch)
    if fast is not None:
        return fast
    from torch._subclasses.functional_tensor import autograd_would_have_decomposed

    return autograd_would_have_decomposed(func, pytree.tree_flatten((args, kwargs))[0])


def ask(mode: FunctionalTensorMode, func: Any, args: tuple, kwargs: dict) -> bool:
    """The answer the running trace gives (the policy's where one is active, else torch's)."""
    if HAS.can_decompose_method:
        return mode._can_decompose(func, args, kwargs)
    if _ACTIVE:
        return _ACTIVE[-1][0](func, lambda: torch_default(mode, func, args, kwargs), args, kwargs)
    return torch_default(mode, func, args, kwargs)


def pristine_dispatch(keep_policy: bool) -> Any:
    """The `__torch_dispatch__` code outside the trace runs: torch's own, with the policy's
    adapter around it where the policy is kept (variant C)."""
    if keep_policy and _ACTIVE and _ACTIVE[-1][1] is not None:
        return _ACTIVE[-1][1]
    return PRISTINE_DISPATCH


@contextlib.contextmanager
def decomposition_hook(should_decompose: Callable[[Any, Callable[[], bool], tuple, dict], bool]) -> Iterator[None]:
    """Route FunctionalTensorMode's "decompose this composite?" question to `should_decompose`
    (with the call's args and kwargs: some composites alias their input only for some calls).

    FunctionalTensorMode sits on the PreDispatch stack and sees every op before its
    CompositeImplicitAutograd kernel would run.  It asks whether to inline the composite; we
    answer from predispatch's policy, handing it torch's own answer as a thunk so the policy can
    defer to it (for example for ops with aliasing schemas).
    """
    if HAS.can_decompose_method:
        _check_method_is_asked()

        def method(original):
            def _can_decompose(self, func, args, kwargs):
                return should_decompose(func, lambda: original(self, func, args, kwargs), args, kwargs)

            return _can_decompose

        with patched(FunctionalTensorMode, "_can_decompose", method, mechanism=MECHANISM):
            _ACTIVE.append((should_decompose, None))
            try:
                yield
            finally:
                _ACTIVE.pop()
        return
    with patched(FunctionalTensorMode, "__torch_dispatch__", lambda original: _adapter(original, should_decompose), mechanism=MECHANISM):
        _ACTIVE.append((should_decompose, vars(FunctionalTensorMode)["__torch_dispatch__"]))
        try:
            yield
        finally:
            _ACTIVE.pop()


def _check_method_is_asked() -> None:
    """Variant M engages only if torch's `__torch_dispatch__` still asks `self._can_decompose`."""
    if "_can_decompose" not in _names_used(inspect.unwrap(PRISTINE_DISPATCH).__code__):
        raise drift(MECHANISM, "FunctionalTensorMode.__torch_dispatch__ no longer calls self._can_decompose")


def _names_used(code: Any) -> set[str]:
    """The attribute and global names `code` and the functions nested in it use."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names_used(const)
    return names


def _adapter(original: Callable[..., Any], should_decompose: Callable[..., bool]) -> Callable[..., Any]:
    """Variant C: ask the policy before torch's `__torch_dispatch__` asks its closure."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FunctionalTensor.metadata_fns or not torch._C._dispatch_has_kernel(func.name()):
            return original(self, func, types, args, kwargs)
        theirs = torch_default(self, func, args, kwargs)
        ours = should_decompose(func, lambda: theirs, args, kwargs)
        if ours and not theirs:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        elif theirs and not ours:
            raise drift(MECHANISM, f"this torch decomposes {func} itself and cannot be asked to keep it whole")
        return original(self, func, types, args, kwargs)

    return __torch_dispatch__
