"""`capture_autograd_functions`: intercept `Function.apply` while the user's forward is traced."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointFunction

from predispatch import _torch_internals as ti
from predispatch.trace.autograd_function.hop import TracedCall, function_call
from predispatch.trace.autograd_function.record import CapturedCall
from predispatch.trace.autograd_function.subgraphs import CallSite, capture_call, has_setup_context

#: Functions whose `apply` runs as before (forward inlined), and why that is right for them.
INLINED: dict[type, str] = {
    CheckpointFunction: "reentrant checkpointing recomputes forward in backward: its gradient is "
    "the forward's own derivative, which the inlined forward already gives",
    TracedCall: "predispatch's own trace-time Function, never differentiated",
}


@dataclass
class _Calls:
    """The captured calls of one export, by call order; shared by AOTAutograd's two passes.

    position: how many calls the running pass has made so far.
    depth: > 0 while a Function's own forward or backward is being traced: Functions they call
        are inlined (eager runs them under no_grad, so their backward is never used).
    """

    captured: list[CapturedCall] = field(default_factory=list)
    position: int = 0
    depth: int = 0


_EXPORTS: weakref.WeakKeyDictionary[object, _Calls] = weakref.WeakKeyDictionary()

#: torch's own `Function.apply`, what every call not captured runs (also under a nested export).
_TORCH_APPLY = torch.autograd.Function.__dict__["apply"].__func__


@contextlib.contextmanager
def capture_autograd_functions(owner: object) -> Iterator[None]:
    """While active, each `Function.apply` becomes one `autograd_function_apply` node.

    `owner` identifies the export (the traced root module): captures made in AOTAutograd's
    first pass are replayed, not retraced, in its second; see Note [Capturing autograd.Function].
    """
    calls = _EXPORTS.setdefault(owner, _Calls())
    calls.position = 0
    original = torch.autograd.Function.__dict__["apply"]

    def apply(cls, *args, **kwargs):
        if calls.depth > 0 or cls in INLINED or torch._C._are_functorch_transforms_active():
            return _TORCH_APPLY(cls, *args, **kwargs)
        return _apply(calls, cls, _bind(cls, args, kwargs))

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _bind(cls: type, args: tuple, kwargs: dict) -> tuple:
    """Keyword arguments and defaults bound to positions, as `Function.apply` binds them."""
    with_ctx = not has_setup_context(cls)
    if with_ctx and not kwargs:
        return args
    bound = inspect.signature(cls.forward).bind(*((None,) if with_ctx else ()), *args, **kwargs)
    bound.apply_defaults()
    return bound.args[1:] if with_ctx else bound.args


def _apply(calls: _Calls, cls: type, args: tuple) -> Any:
    """Capture (first pass) or replay (second pass) one call, then run it through the HOP."""
    site = CallSite(cls, args)
    call = _captured(calls, site)
    operands = site.operands()
    outputs = list(function_call(call, *operands))
    for output, operand in call.dirty:  # ctx.mark_dirty: the input now holds the output
        operands[operand].copy_(outputs[output])
        outputs[output] = operands[operand]
    return call.user_output(outputs)


def _captured(calls: _Calls, site: CallSite) -> CapturedCall:
    """The capture for this call: the first pass's when it matches, else a new trace."""
    index = calls.position
    calls.position += 1
    if index < len(calls.captured) and calls.captured[index].key == site.key():
        return calls.captured[index]
    fake_mode = ti.detect_fake_mode(site.operands())
    calls.depth += 1
    try:
        call = capture_call(site, fake_mode)
    finally:
        calls.depth -= 1
    calls.captured[index:index + 1] = [call]
    return call
