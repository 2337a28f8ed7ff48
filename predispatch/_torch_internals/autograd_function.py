"""Where a `Function.apply` call, and a Function's forward about to run, can be seen.

Two mechanisms, both proved to engage when placed (Note [Drift is loud] in mechanism.py):

- the apply interception: every `Function.apply` call on the exporting thread is handed to the
  capture.  Variant A (torch <= 2.13): `Function.apply` is Python and ends in `super().apply`,
  so a classmethod on `_SingleLevelFunction` sees every call, an `apply` bound before export
  included.  Variant B (torch >= 2.14): `Function.apply` is the C++ apply itself; we replace
  `Function.apply`, which every `MyFn.apply(...)` looks up at call time.
- the forward detector: torch's C++ apply makes the Function's ctx (an instance of its
  `_backward_cls`, a `BackwardCFunction`) before it runs forward.  A ctx made on the exporting
  thread that the capture did not ask for is a forward the capture missed (on variant B, an
  `apply` bound before export): the capture refuses it by name, never traces it silently.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.function import _SingleLevelFunction as SingleLevelFunction

from predispatch._torch_internals.mechanism import Hook, patched
from predispatch._torch_versions import HAS

__all__ = [
    "APPLY_CAPTURE",
    "FORWARD_DETECTOR",
    "SingleLevelFunction",
    "detected_forwards",
    "intercepted_applies",
    "torch_apply",
]

APPLY_CAPTURE = "the autograd.Function capture (Function.apply interception)"
FORWARD_DETECTOR = "the autograd.Function forward detector (torch's apply making a Function's ctx)"


def torch_apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
    """torch's own C++ apply for `cls` (what `Function.apply` ends in on every release)."""
    return super(SingleLevelFunction, cls).apply(*args, **kwargs)


class _Probe(torch.autograd.Function):
    """Applied with no tensor by the probes: nothing is traced, nothing is differentiated."""

    @staticmethod
    def forward(ctx: Any, x: Any) -> Any:
        return x

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return grad


def _hook_point() -> tuple[type, str]:
    """Where `apply` is replaced on this torch (variant A or B, see the module docstring)."""
    return (SingleLevelFunction, "apply") if HAS.python_function_apply else (torch.autograd.Function, "apply")


@contextlib.contextmanager
def intercepted_applies(apply: Callable[[type, tuple, dict], Any]) -> Iterator[Hook]:
    """While active, `MyFn.apply(*args, **kwargs)` on this thread returns `apply(MyFn, args, kwargs)`;
    other threads keep torch's apply."""
    owner, name = _hook_point()
    hook = Hook(APPLY_CAPTURE)

    def replacement(cls: type, *args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != hook.thread:
            return torch_apply(cls, *args, **kwargs)
        hook.calls += 1
        if hook.probing:
            return None
        return apply(cls, args, kwargs)

    probe = lambda: _Probe.apply(0)  # noqa: E731
    with patched(owner, name, lambda _: classmethod(replacement), mechanism=APPLY_CAPTURE, probe=probe, hook=hook):
        yield hook


@contextlib.contextmanager
def detected_forwards(on_forward: Callable[[type], None]) -> Iterator[Hook]:
    """While active, `on_forward(MyFn)` runs on this thread whenever torch's apply is about to run
    `MyFn.forward` (it is making the ctx); raising there stops the apply."""

    def make(original: Any) -> Callable[..., None]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            on_forward(type(self)._forward_cls)

        return __init__

    probe = lambda: torch_apply(_Probe, 0)  # noqa: E731
    with patched(BackwardCFunction, "__init__", make, mechanism=FORWARD_DETECTOR, probe=probe) as hook:
        yield hook
