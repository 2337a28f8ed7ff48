"""Where every `Function.apply` call is seen: inside torch's own C++ apply, however it was reached.

Note [Seeing every apply]
-------------------------
`MyFn.apply` is torch's C++ apply (`THPFunction_apply`) on torch >= 2.14, and the Python
`Function.apply` ends in it on earlier releases; an `apply` bound before export (`op =
MyFn.apply` at module level, in `__init__`, in a table, in `functools.partial`) calls it
directly, so nothing in Python sees the call itself.  Two steps of that C++ apply are Python,
on every release (2.11 to 2.15):

1. it makes the Function's ctx by calling `MyFn._backward_cls()`, a `BackwardCFunction`
   subclass, before the forward runs (grad mode is still the caller's);
2. it then looks `forward` up on the class (`PyObject_GetAttrString(cls, "forward")`), calls
   it (with the ctx first, or without it followed by `setup_context(ctx, inputs, output)`,
   looked up on the class too), and wraps what forward returned as the Function's outputs.

The capture hooks both: `BackwardCFunction.__init__` asks `route(MyFn)` whether this call is
captured; if so, the next lookup of `MyFn.forward` on the exporting thread (through
`FunctionMeta.__getattribute__`, the metaclass of every Function) returns a forward that runs
`run(ctx, args, kwargs)` instead of the user's forward, and a new-style Function's following
`setup_context` lookup returns one that does nothing (what the user's would record, `run` has
recorded).  Every call is seen, whatever reached torch's apply; nothing on the user's classes
changes.  (Under an active functorch transform torch's apply hands the call to functorch's
`custom_function_call` instead, making no ctx at that level; the capture leaves such calls to
torch anyway: Note [Which Functions are captured] in custom_backward/autograd_function/capture.py.)

Proved, not assumed (Note [Drift is loud]): the ctx hook's probe must reach it; the forward
hook's probe applies a Function of each style through torch's apply and must reach the redirected
forward of both and the no-op `setup_context` of the new-style one; and a ctx made for a captured call whose forward was never looked up through the hook (torch ran the
forward itself) is refused by name, at the next ctx or when the export ends: `AutogradFunctionError`
where the Function's own metaclass bypasses FunctionMeta's `__getattribute__`, `TorchDriftError`
where torch's apply changed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction, FunctionMeta
from torch.autograd.function import _SingleLevelFunction as SingleLevelFunction

from predispatch._torch_internals.mechanism import Hook, drift, patched
from predispatch.errors import AutogradFunctionError, user_frame

__all__ = [
    "APPLY_CAPTURE",
    "FORWARD_REDIRECT",
    "Run",
    "SingleLevelFunction",
    "redirected_applies",
    "torch_apply",
    "unrecorded_grad_mode",
]

APPLY_CAPTURE = "the autograd.Function capture (torch's apply making a Function's ctx)"
FORWARD_REDIRECT = "the autograd.Function capture (torch's apply looking up a Function's forward)"

#: `run(ctx, args, kwargs)`: what a captured call computes instead of the user's forward (and
#: setup_context), given torch's ctx and the arguments torch's apply passes to forward.
Run = Callable[[Any, tuple, dict], Any]


def torch_apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's own C++ apply for `cls`, not through `Function.apply` (the probes' way in)."""
    return super(SingleLevelFunction, cls).apply(*args, **kwargs)


@contextlib.contextmanager
def unrecorded_grad_mode(enabled: bool) -> Iterator[None]:
    """Grad mode `enabled` for the block, a change no torch-function mode sees, so no trace records it.

    torch's apply runs forward with grad mode off (a C++ guard it undoes itself); a captured
    call computes in the caller's mode, as the call would outside a Function.
    """
    with torch._C.DisableTorchFunction():
        before = torch.is_grad_enabled()
        torch._C._set_grad_enabled(enabled)
    try:
        yield
    finally:
        with torch._C.DisableTorchFunction():
            torch._C._set_grad_enabled(before)


class _Probe(torch.autograd.Function):
    """Applied with no tensor by the probes: nothing is traced, nothing is differentiated."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad


class _ProbeSetupContext(torch.autograd.Function):
    """A new-style probe: its own `setup_context` does nothing, and is never reached once its
    forward was redirected (the probe counts the calls that reached predispatch's instead)."""

    @staticmethod
    def forward(x: Any) -> Any:
        return x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad


def _probe_run(ctx: Any, args: tuple, kwargs: dict) -> Any:
    return args[0]


@dataclass
class _Pending:
    """A captured call between its ctx being made and its forward being looked up."""

    cls: type
    ctx: Any
    run: Run


class _Redirect:
    """The exporting thread's one call in flight: `pending` until torch looks up forward, then
    `settled` (a new-style class) until it looks up setup_context."""

    def __init__(self, hook: Hook) -> None:
        self.hook = hook
        self.pending: _Pending | None = None
        self.settled: type | None = None

    def unseen(self, pending: _Pending) -> Exception:
        """The error for a captured call whose forward torch ran without looking it up through
        the hook: the Function's own metaclass bypasses FunctionMeta's `__getattribute__`, or
        torch's apply changed (drift).  Its backward would be lost, so export stops."""
        cls, self.pending = pending.cls, None
        owner = next(k for k in type(cls).__mro__ if "__getattribute__" in vars(k))
        if owner is not FunctionMeta:
            return AutogradFunctionError(
                f"{cls.__qualname__}.forward was looked up through its metaclass "
                f"{owner.__qualname__}'s own __getattribute__, which does not call FunctionMeta's: "
                "export could not capture the call, and its custom backward would be lost.",
                where=user_frame(),
                fix=f"let {owner.__qualname__}.__getattribute__ end in super().__getattribute__(name) "
                "(or define __getattr__, which runs only for missing attributes).",
            )
        return drift(
            FORWARD_REDIRECT,
            f"torch's apply made {cls.__qualname__}'s ctx but ran its forward without looking it up "
            "through FunctionMeta.__getattribute__ (its custom backward would be lost)",
        )

    def forward(self, pending: _Pending) -> Callable[..., Any]:
        """The forward torch's apply calls for `pending`: `run`, in the grad mode torch's apply
        gave forward (off; `run` restores the caller's where it needs it)."""

        def redirected(*args: Any, **kwargs: Any) -> Any:
            self.hook.calls += 1
            new_style = not (args and args[0] is pending.ctx)
            out = pending.run(pending.ctx, args if new_style else args[1:], kwargs)
            if new_style:
                self.settled = pending.cls
            return out

        return redirected

    def getattribute(self, cls: Any, name: str) -> Any:
        """`FunctionMeta.__getattribute__`: torch's own, but forward and setup_context are
        redirected for the call in flight (exporting thread only)."""
        value = type.__getattribute__(cls, name)
        if threading.get_ident() != self.hook.thread:
            return value
        if name == "forward" and self.pending is not None and self.pending.cls is cls:
            pending, self.pending = self.pending, None
            return self.forward(pending)
        if name == "setup_context" and self.settled is cls:
            self.settled = None
            self.hook.calls += 1
            return _recorded_already
        return value


def _recorded_already(ctx: Any, inputs: tuple, output: Any) -> None:
    """The user's setup_context after a redirected forward: `run` has recorded what it would."""


class _Method:
    """A function placed on a class as a method, bound as a function is; `patched` places it as
    given (it serves other threads itself), where a plain function would be wrapped."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self.function
        return lambda *args: self.function(instance, *args)


@contextlib.contextmanager
def redirected_applies(route: Callable[[type], Run | None]) -> Iterator[Hook]:
    """While active, every call of torch's apply on this thread asks `route(MyFn)` as it makes
    the ctx: None lets torch run `MyFn.forward` as always; a `Run` is computed instead of the
    user's forward and setup_context (Note [Seeing every apply]).  `route` may raise to refuse
    the call.  Other threads keep torch's apply untouched."""
    hook = Hook(FORWARD_REDIRECT)
    state = _Redirect(hook)

    def make_init(original: Any) -> Callable[..., None]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            if state.pending is not None:
                raise state.unseen(state.pending)
            state.settled = None
            cls = type(self)._forward_cls
            run = _probe_run if hook.probing else route(cls)
            if run is not None:
                state.pending = _Pending(cls, self, run)

        return __init__

    def probe() -> None:
        """Both styles through torch's apply: three calls must reach predispatch (two forwards,
        one setup_context)."""
        before = hook.calls
        for function in (_Probe, _ProbeSetupContext):
            torch_apply(function, 0)
            state.pending = state.settled = None
        if hook.calls != before + 3:
            raise drift(FORWARD_REDIRECT, "torch's apply did not look up a probe Function's forward and "
                        "setup_context through FunctionMeta.__getattribute__")

    ctx_probe = lambda: torch_apply(_Probe, 0)  # noqa: E731
    with (
        patched(BackwardCFunction, "__init__", make_init, mechanism=APPLY_CAPTURE, probe=ctx_probe),
        patched(FunctionMeta, "__getattribute__", lambda _: _Method(state.getattribute), mechanism=FORWARD_REDIRECT, probe=probe, hook=hook),
    ):
        yield hook
        if state.pending is not None:
            raise state.unseen(state.pending)
