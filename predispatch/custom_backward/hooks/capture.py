"""What the module-hook capture shares across one export (`Capture`), and how it calls the
Functions that stand for a module's hooks (`applying`, `chain`).

Full backward hooks (full.py) and backward pre-hooks (module.py) are captured alike: each
kind's hooks run in order inside the backward of an identity Function, and a failure to capture
that Function is the user's hook failing, so it is reported as one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import AutogradFunctionError, UnsupportedHookError, user_frame
from predispatch.custom_backward.hooks.inspection import describe
from predispatch.custom_backward.hooks.state import Handed, State


@dataclass
class Capture:
    """What the module-hook captures of one export share.

    names: each module's path in the exported module, for errors.
    handed: the module tensors hook Functions took, checked unchanged when the forward pass ends.
    """

    names: dict[int, str]
    handed: list[Handed] = field(default_factory=list)

    def describe(self, module: nn.Module) -> str:
        """`module 'encoder.lin' (Linear)`, for errors."""
        return f"module {self.names.get(id(module), type(module).__name__)!r} ({type(module).__name__})"



#: How a hook's read of a tensor from outside shows in a failed capture: a tensor of the outer
#: trace is caught after tracing (`_check_reads_only_arguments` in
#: custom_backward/autograd_function/subgraphs.py), a real tensor (a global constant) by FakeTensorMode.
_READS_OUTSIDE = ("reads a tensor that is not one of its arguments", "Please convert all Tensors to FakeTensors")


@contextlib.contextmanager
def applying(
    module: nn.Module, hooks: list[Any], kind: str, state: State, capture: Capture, counts: tuple[int | None, ...] | None = None
) -> Iterator[None]:
    """Around the call of a hook Function: a failure to capture it becomes an error about the
    user's hooks (the Function and its file are ours, the code that failed is theirs), and the
    module tensors it takes are recorded for `check_state_unchanged`, with their mutation
    `counts` when it took them (now, unless given: a full backward hook's Function takes them as
    they were before the forward, Note [One trace of a hooked module] in full.py)."""
    named = f"{capture.describe(module)} has a {kind} ({describe(hooks)})"
    counts = tuple(map(ti.mutation_count, state.tensors)) if counts is None else counts
    try:
        yield
    except AutogradFunctionError as exc:
        raise _hook_refusal(named, exc) from exc
    if state.tensors:
        capture.handed.append(Handed(named, module, state, counts))


def _hook_refusal(named: str, exc: AutogradFunctionError) -> UnsupportedHookError:
    """The error for hooks whose Function the capture refused: reading a tensor from outside the
    module gets a fix of its own; any other failure is quoted, at the user's line where known."""
    if any(marker in exc.what for marker in _READS_OUTSIDE):
        return UnsupportedHookError(
            f"{named} that reads a tensor which is neither one of its gradients nor a parameter, buffer or "
            "tensor attribute of that module (a global tensor, another module's weight); the program's "
            "backward would hold its value at export.",
            where=user_frame(),
            fix="reach the tensor through the module the hook is given (module.weight): register it on that "
            "module (as a parameter or buffer), or register the hook on a module that holds every tensor it "
            "reads.",
        )
    cause = exc.__cause__
    return UnsupportedHookError(
        f"{named} that cannot be captured: "
        + (f"{type(cause).__name__}: {first_line(cause)}" if cause else exc.what.split("): ", 1)[-1]),
        where=(user_frame(cause.__traceback__) if cause else None) or user_frame(),
        fix="compute the hook with torch operations on its gradients and on its module's tensors, returning "
        "one gradient (or None) per entry it is given; or remove it before export (handle.remove()).",
    )


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def chain(hooks: list[Any], call: Callable[[Any, tuple], Any], grads: tuple, *, pre: bool) -> tuple:
    """Call the hooks in order as eager does, each seeing the gradients the previous returned
    (None keeps them), with eager's check and message for a wrong count."""
    kind, name = ("pre hook", "grad_output") if pre else ("hook", "grad_input")
    for hook in hooks:
        new = call(hook, grads)
        if new is None:
            continue
        if len(new) != len(grads):
            raise RuntimeError(
                f"Backward {kind} returned an invalid number of {name}, got {len(new)}, but expected {len(grads)}"
            )
        grads = tuple(new)
    return grads
