"""A module's backward hooks, set aside for the trace and applied through captured Functions.

Backward pre-hooks (`register_full_backward_pre_hook`: `hook(module, grad_output)` returns new
output gradients) are captured here: the module's outputs, after its forward hooks, pass
through one identity Function whose backward runs the hooks in order.  Full backward hooks are
captured on the input side (full.py).  torch's own hook machinery is set aside for the trace
(the hooks are restored after), so it does not also run; a module whose hooks cannot all be
captured keeps them, and refusal.py refuses it when it is called.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from predispatch.custom_backward.hooks.capture import Capture, applying, chain
from predispatch.custom_backward.hooks.full import full_backward_hooks
from predispatch.custom_backward.hooks.layout import Layout
from predispatch.custom_backward.hooks.refusal import refusal
from predispatch.custom_backward.hooks.state import State, check_state_unchanged


@contextlib.contextmanager
def captured_module_hooks(root: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Set aside the capturable backward hooks of each module and apply them through captured
    Functions instead (restored on exit): pre-hooks on the module's outputs, full hooks on its
    inputs.  A module keeps torch's machinery (and is refused) unless all its hooks qualify."""
    capture = Capture(names)
    stashed: list[tuple[nn.Module, str, Any]] = []
    handles = []
    for module in root.modules():
        pre, full = list(module._backward_pre_hooks.values()), list(module._backward_hooks.values())
        if not (pre or full) or refusal(module):
            continue
        for attr in ("_backward_pre_hooks", "_backward_hooks"):
            stashed.append((module, attr, getattr(module, attr)))
            setattr(module, attr, type(getattr(module, attr))())
        handles.extend(_install(module, pre, full, capture))
    try:
        yield
        check_state_unchanged(capture.handed)
    finally:
        for handle in handles:
            handle.remove()
        for module, attr, hooks in stashed:
            setattr(module, attr, hooks)


def _install(module: nn.Module, pre: list[Any], full: list[Any], capture: Capture) -> list[Any]:
    """The forward (pre-)hooks that stand for a module's backward hooks, in eager's order: the
    full hooks' Function on the arguments; after the forward hooks, GradOutputCarrier, then the
    pre-hooks' Function, whose backward so runs first (Note [Carrying grad_output] in full.py)."""
    handles = [module.register_forward_hook(_warn_unhooked_output(capture))]
    if full:
        before, after = full_backward_hooks(full, capture)
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    if pre:
        handles.append(module.register_forward_hook(_output_gradient_hooks(pre, capture)))
    return handles


def _warn_unhooked_output(capture: Capture) -> Callable:
    """A forward hook giving eager's warning for an output its backward hooks never see."""

    def forward_hook(module: nn.Module, args: tuple, output: Any) -> None:
        if not isinstance(output, (torch.Tensor, tuple)):
            warnings.warn(
                "For backward hooks to be called, module output should be a Tensor or a tuple of Tensors"
                f" but received {type(output)}",
                stacklevel=2,
            )

    return forward_hook


def _output_gradient_hooks(hooks: list[Any], capture: Capture) -> Callable:
    """A forward hook that routes the module's floating outputs, laid out as eager lays them out
    (`Layout`), through the backward pre-`hooks`."""

    def forward_hook(module: nn.Module, args: Any, output: Any) -> Any:
        outputs = Layout.of(output)
        if not outputs.hooked:  # eager calls no backward hook of the module then
            return None
        state = State.of(module, hooks)
        with applying(module, hooks, "backward pre-hook", state, capture):
            hooked = _output_side(module, hooks, outputs, state).apply(*outputs.pick(output), *state.tensors)
        return outputs.place(output, hooked)

    return forward_hook


def _output_side(module: nn.Module, hooks: list[Any], outputs: Layout, state: State) -> type:
    """The identity on the module's floating outputs whose backward runs the backward pre-hooks;
    the module's `state` comes last (Note [Hooks reading module state] in state.py)."""
    n = len(outputs.hooked)

    # Each hook kind keeps its own Function class (here, in full.py, in tensor.py): the class's
    # name and forward signature name the captured subgraphs and their placeholders.
    class BackwardPreHooks(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state.save(ctx, operands)
            return tuple(t.clone() for t in operands[:n])

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            with state.bound(module, ctx):
                grad_output = chain(hooks, lambda hook, go: hook(module, go), outputs.spread(grads), pre=True)
            return (*outputs.pick(grad_output), *state.no_grads())

    return state.name_operands(BackwardPreHooks, n)
