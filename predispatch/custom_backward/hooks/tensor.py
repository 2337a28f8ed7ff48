"""`Tensor.register_hook` on an intermediate, captured as an identity Function.

The tensor is rebound to an identity `autograd.Function` whose backward is the hook, which the
Function capture (custom_backward/autograd_function/) turns into an `autograd_function_apply` node with
the hook traced as its backward subgraph, so gradients pass through the hook exactly where
eager's do.  A rebinding reaches only the tensor's later uses, and a traced backward runs the
hook's Python once, at export: hence the refusals in `_uncapturable`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from predispatch import _torch_internals as ti
from predispatch.errors import UnsupportedHookError, user_frame
from predispatch.custom_backward.hooks.inspection import describe, side_effect


@contextlib.contextmanager
def captured_tensor_hooks(keeper: Any) -> Iterator[None]:
    """While active, `Tensor.register_hook` captures the hook or refuses it (restored on exit).
    `keeper` tells which tensors ops have read."""
    with ti.patched(torch.Tensor, "register_hook", lambda _: lambda tensor, hook: _capture_tensor_hook(tensor, hook, keeper), mechanism=ti.TENSOR_HOOKS, probe=ti.probe_register_hook):
        yield


def _capture_tensor_hook(tensor: torch.Tensor, hook: Any, keeper: Any) -> _NoHandle:
    """Rebind `tensor` to an identity whose backward applies `hook` (see the module docstring)."""
    why = _uncapturable(tensor, hook, keeper)
    if why:
        raise UnsupportedHookError(
            f"Tensor.register_hook({describe([hook])}) cannot be captured: {why}",
            where=user_frame(),
            fix="register the hook right after the tensor is computed, as a pure function of the gradient; "
            "or write the transformation as an autograd.Function (forward: identity, backward: the hook).",
        )

    class TensorHook(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            out = hook(grad)
            return grad if out is None else out

    tensor.copy_(TensorHook.apply(tensor))
    return _NoHandle()


class _NoHandle:
    """What `register_hook` returns in a trace: a captured hook cannot be removed from the graph."""

    def remove(self) -> None:
        raise UnsupportedHookError(
            "a hook captured into the program cannot be removed later in the same forward.",
            where=user_frame(),
            fix="register the hook only where it applies, e.g. under a Python condition known at export.",
        )


def _uncapturable(tensor: torch.Tensor, hook: Any, keeper: Any) -> str | None:
    if not tensor.is_floating_point() and not tensor.is_complex():
        return "the tensor has no gradient (not floating point)."
    if keeper.is_input(tensor):
        return "the tensor is a graph input or parameter; eager applies the hook to its accumulated gradient."
    if keeper.was_used(tensor):
        return (
            "an op already read the tensor, and eager's hook also transforms the gradient flowing back "
            "through that earlier use."
        )
    effect = side_effect(hook)
    if effect:
        return f"the hook has a Python side effect ({effect}), which a traced backward would run once, at export."
    return None
