"""`capture_autograd_functions`: intercept `Function.apply` while the user's forward is traced."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointFunction

from predispatch import _torch_internals as ti
from predispatch.errors import AutogradFunctionError, user_frame
from predispatch.trace.autograd_function.hop import TracedCall, function_call
from predispatch.trace.autograd_function.record import CapturedCall
from predispatch.trace.autograd_function.subgraphs import CallSite, capture_call, has_setup_context

#: torch's own `Function.apply`, what every call not captured runs (also under a nested export).
_TORCH_APPLY = torch.autograd.Function.__dict__["apply"].__func__


def _run_checkpointed(cls, function, preserve_rng_state, *args):
    return function(*args)


#: Functions export runs another way instead of capturing, and why that is right for each.
RUN_INSTEAD: dict[type, tuple[Callable[..., Any], str]] = {
    TracedCall: (_TORCH_APPLY, "predispatch's own trace-time Function; it is never differentiated."),
    CheckpointFunction: (
        _run_checkpointed,
        "reentrant activation checkpointing: its backward recomputes the forward and differentiates "
        "it, so its gradient is the forward's own, and that backward (autograd.backward with side "
        "effects on .grad) cannot be traced; the program runs the checkpointed function plainly "
        "(same values and gradients, without the memory saving).",
    ),
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
        if cls.__qualname__.startswith("AutogradFunctionApply."):
            raise _compiled_region_refusal()
        if cls in RUN_INSTEAD:
            return RUN_INSTEAD[cls][0](cls, *args, **kwargs)
        if calls.depth > 0 or _is_torch_own(cls) or torch._C._are_functorch_transforms_active():
            return _TORCH_APPLY(cls, *args, **kwargs)
        return _apply(calls, cls, _bind(cls, args, kwargs))

    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = original


def _compiled_region_refusal() -> AutogradFunctionError:
    """torch.cond & co. trace their branches with Dynamo, which turns a Function into torch's
    `autograd_function_apply`; running that inlines the forward and drops the backward."""
    return AutogradFunctionError(
        "a custom autograd.Function is called inside torch.cond (or another region torch traces "
        "with Dynamo); torch hands it to export inlined, so its backward would be lost.",
        where=user_frame(),
        fix="call the Function outside the torch.cond branches: compute it once before, or compute "
        "both sides and select with torch.where.",
    )


def _is_torch_own(cls: type) -> bool:
    """torch's own Functions implement ops, not models: the autograd kernel of every
    `torch.library.custom_op` (`predispatch::keep_history` too) and of HOPs runs one, from inside
    the dispatcher, and the op or HOP is what the graph records.  Left to torch as before."""
    return cls.__module__ == "torch" or cls.__module__.startswith("torch.")


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
