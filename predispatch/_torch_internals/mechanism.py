"""How predispatch swaps a torch function for the length of a trace, and proves the swap engaged.

Note [Drift is loud]
--------------------
Every hook predispatch places in torch is a `patched(...)` with the mechanism's name.  Three
things make a change inside torch loud instead of silently wrong:

1. The hook point must exist: an attribute gone raises `TorchDriftError` naming the mechanism
   and the torch version before anything is traced.
2. A `probe` (where the mechanism has one) calls the hook point the way torch does, right after
   the swap; a swap torch does not reach raises the same error.
3. `Hook.calls` counts the calls that reached the replacement: the trace checks afterwards that
   the mechanisms which must have run did run (trace/functional.py, `check_engaged`).

The replacement runs on the exporting thread only: another thread calling the same function
meanwhile gets torch's own (Note [Export touches only its own thread]).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from predispatch._torch_versions import tested_range
from predispatch.errors import TorchDriftError

__all__ = [
    "Hook", "caller_frame", "drift", "interrupts_at_safe_points", "interrupts_deferred", "patched", "raise_held_interrupt", "require",
]


def drift(mechanism: str, what: str) -> TorchDriftError:
    """The error for a mechanism that cannot engage on this torch."""
    words, requirement = tested_range()
    return TorchDriftError(
        f"{mechanism} cannot engage on torch {torch.__version__}: {what}. predispatch stops here rather "
        f"than return a program without it.",
        fix=f"use a torch release predispatch is tested on ({words}: pip install '{requirement}'), "
        "and report this message to predispatch.",
    )


def require(owner: Any, name: str, mechanism: str) -> Any:
    """`owner.name`, or `TorchDriftError` for `mechanism` when this torch has no such attribute."""
    try:
        return getattr(owner, name)
    except AttributeError:
        where = getattr(owner, "__qualname__", getattr(owner, "__name__", type(owner).__name__))
        raise drift(mechanism, f"{where}.{name} does not exist") from None


class Hook:
    """One placed hook: its mechanism's name, the thread it serves, and how often it was reached.

    probing: True while the probe runs; the replacement is then not called (a probe call is not
        part of any program), only counted.
    """

    def __init__(self, mechanism: str):
        self.mechanism = mechanism
        self.thread = threading.get_ident()
        self.calls = 0
        self.probing = False

    def expect_calls(self, what: str) -> None:
        """Raise unless the replacement was reached since it was placed (`what`: when it must have been)."""
        if self.calls == 0:
            raise drift(self.mechanism, f"torch never called the replaced function, though {what}")


@contextlib.contextmanager
def patched(
    owner: Any,
    name: str,
    make: Callable[[Any], Any],
    *,
    mechanism: str,
    probe: Callable[[], Any] | None = None,
    hook: Hook | None = None,
) -> Iterator[Hook]:
    """`owner.name` is `make(original)` while active, and what it was afterwards (removed again
    where `owner` only inherited it): the one way predispatch swaps a torch function, method or
    global for the length of a trace, so every swap is undone on success and on failure.

    A function replacement is served to the exporting thread only and counted (`Hook.calls`);
    `probe()`, run right after the swap, must reach it (Note [Drift is loud]).  A replacement
    that is not a plain function (a classmethod) counts its calls on `hook` itself.
    """
    original = require(owner, name, mechanism)
    hook = hook if hook is not None else Hook(mechanism)
    replacement = make(original)
    if isinstance(replacement, types.FunctionType):
        replacement = _served(hook, replacement, original)
    held = name in vars(owner)
    saved = vars(owner).get(name)
    setattr(owner, name, replacement)
    try:
        if probe is not None:
            _run_probe(hook, probe)
        yield hook
    finally:
        with interrupts_deferred():  # a Ctrl-C here would leave torch patched
            if held:
                setattr(owner, name, saved)
            else:
                delattr(owner, name)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Run the block to its end even if Ctrl-C arrives meanwhile; raise the KeyboardInterrupt
    after it.  For the steps that put back what an export changed (a patch of torch, the user's
    module): cut half-way, they would leave a tracer tensor in the module or torch patched.
    Only in the main thread (where Python runs signal handlers) and only over Python's own
    SIGINT handler: a handler of the user's is theirs to keep."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            raise KeyboardInterrupt


#: The interrupts held by each open `interrupts_at_safe_points`, innermost last.
_HELD: list[list[int]] = []


@contextlib.contextmanager
def interrupts_at_safe_points() -> Iterator[None]:
    """Hold Ctrl-C while the block runs, and raise it at the next safe point
    (`raise_held_interrupt`, called where predispatch's own code runs between ops) or at the end.

    torch's C++ calls Python at points where a KeyboardInterrupt cannot pass (a dispatch rule's
    lookup, `torch/_library/simple_registry.py`'s `find`, run from C++ that cannot propagate
    it): a Ctrl-C landing there terminates the process (SIGABRT, "terminate called after
    throwing an instance of 'pybind11::error_already_set'").  Held, it is raised where
    exceptions pass, as any error of the trace does.  Main thread and Python's own handler only,
    as `interrupts_deferred`."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    _HELD.append(held)
    try:
        yield
    finally:
        _HELD.pop()
        signal.signal(signal.SIGINT, previous)
        if held:
            raise KeyboardInterrupt


def raise_held_interrupt() -> None:
    """Raise the KeyboardInterrupt `interrupts_at_safe_points` holds, if any (a safe point)."""
    if _HELD and _HELD[-1]:
        _HELD[-1].clear()
        raise KeyboardInterrupt


def _served(hook: Hook, replacement: Callable[..., Any], original: Callable[..., Any]) -> Callable[..., Any]:
    """`replacement` for the hook's thread (counted), torch's `original` for every other thread."""

    def serve(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != hook.thread:
            return original(*args, **kwargs)
        hook.calls += 1
        if hook.probing:
            return None
        return replacement(*args, **kwargs)

    serve.__name__ = getattr(replacement, "__name__", "serve")
    serve.__wrapped__ = replacement  # type: ignore[attr-defined]
    return serve


_SERVE_CODE = _served(Hook(""), lambda: None, lambda: None).__code__


def _run_probe(hook: Hook, probe: Callable[[], Any]) -> None:
    """Call the hook point as torch would; it must reach the replacement."""
    before = hook.calls
    hook.probing = True
    try:
        probe()
    finally:
        hook.probing = False
    if hook.calls == before:
        raise drift(hook.mechanism, "the probe call did not reach predispatch's replacement")
    hook.calls = before


def caller_frame(depth: int = 1) -> Any:
    """The frame `depth` levels above the caller, not counting `patched`'s own serving frames:
    a replacement that names the line that called it sees the user's line, not ours."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_code is _SERVE_CODE:
        frame = frame.f_back
    return frame
