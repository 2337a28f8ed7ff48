"""Full backward hooks (`register_full_backward_hook`), captured on the module's input side.

`hook(module, grad_input, grad_output)` returns new input gradients: the module's floating
tensor inputs, after its forward pre-hooks, pass through an identity Function whose backward
runs the hooks; hooks that read `grad_output` receive it through carrier tensors.

Note [Carrying grad_output]
---------------------------
A full backward hook needs two gradients that backward computes at two different places:
grad_output where the module's outputs are differentiated, grad_input where its inputs are,
later.  Eager links them in Python (`torch.utils.hooks.BackwardHook` keeps grad_output on an
object until the input side runs); a traced program has only autograd edges, so it gets one:

    x_1, carrier = FullBackwardHooks(x)     # carrier: zeros shaped like the module's output
    y = <the module's forward and forward hooks>(x_1)
    y_1 = GradOutputCarrier(y, carrier)     # forward: a copy of y; backward: (grad_y, grad_y)

Backward runs GradOutputCarrier first, handing grad_y both to the module's forward and to the
carrier.  FullBackwardHooks runs once the gradients of all its outputs are in: those of x_1 are
grad_input, that of the carrier is grad_output.  It calls the hooks with both, laid out as
eager lays them out (one entry per positional argument, per element of a returned tuple; None
where no floating tensor is), and returns their grad_input.  Backward pre-hooks change
grad_output before full hooks see it, so their Function comes after GradOutputCarrier.

A carrier is made before the forward runs, yet shaped like its output, and whether eager calls
the hooks at all depends on the output's layout: the probe learns both first (probe.py, which
says what that costs).  Hooks that do not read grad_output are given None for it and need no
carrier.

As in eager, a hook changes nothing when no floating input requires grad at run time
(FullBackwardHooks then has no backward; eager calls the hook with Nones and requires None
back), when the module runs with grad mode off, or when its output has no floating tensor at
the top level of a tensor or tuple (eager never calls the hooks then).  One difference: the
copies GradOutputCarrier returns require grad whenever an input of the module does, even one
eager leaves without history (a module returning `x.detach()`), and its gradient then reaches
the hooks.  A size of the output that depends on tensor values (`x[x > 0]`) is known only
after the forward, too late for a carrier: refused (`shape_sources` in probe.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from predispatch.trace.hooks.capture import Capture, applying, chain
from predispatch.trace.hooks.inspection import may_read_argument
from predispatch.trace.hooks.layout import Layout
from predispatch.trace.hooks.probe import check_probed, probe_outputs, shape_sources
from predispatch.trace.hooks.state import State


@dataclass(frozen=True)
class _OpenCall:
    """A module call whose arguments went through `FullBackwardHooks`, until its forward hooks ran.

    outputs: the output's layout, learnt by the probe; the real output must match it.
    carriers: one per floating output, for `GradOutputCarrier` (none when no hook reads grad_output).
    """

    outputs: Layout
    carriers: tuple[torch.Tensor, ...]


def full_backward_hooks(hooks: list[Any], capture: Capture) -> tuple[Callable, Callable]:
    """A forward pre-hook (with kwargs) that routes the module's floating arguments through the
    full backward `hooks`, and the forward hook that checks the output against the probe and,
    when a hook reads grad_output, hands grad_output to them (Note [Carrying grad_output])."""
    carried = any(may_read_argument(h, 2) for h in hooks)
    open_calls: list[_OpenCall | None] = []  # one per call in progress

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if capture.probing:
            return None
        hooked, opened = _hook_inputs(module, hooks, args, kwargs, carried, capture)
        open_calls.append(opened)
        return None if hooked is None else (hooked, kwargs)

    def after(module: nn.Module, args: tuple, output: Any) -> Any:
        if capture.probing:
            return None
        opened = open_calls.pop()
        if opened is None:
            return None
        outputs = opened.outputs
        check_probed(module, output, outputs, carried, capture)
        if not carried:
            return None
        return outputs.place(output, GradOutputCarrier.apply(*outputs.pick(output), *opened.carriers))

    return before, after


def _hook_inputs(
    module: nn.Module, hooks: list[Any], args: tuple, kwargs: dict, carried: bool, capture: Capture
) -> tuple[tuple | None, _OpenCall | None]:
    """`(new args, open call)`: the floating args through `FullBackwardHooks`, and what the
    forward hook needs after the forward; `(None, None)` when eager would not run the hooks
    either (no floating argument, grad mode off, no floating tensor at the output's top level)."""
    inputs = Layout.of(args)
    if not inputs.hooked or not torch.is_grad_enabled():
        return None, None
    outputs = probe_outputs(module, args, kwargs, capture)
    if not outputs.hooked:
        return None, None
    sources = shape_sources(module, inputs.pick(args), (args, kwargs), outputs, capture) if carried else ()
    state = State.of(module, hooks)
    function = _input_side(module, hooks, inputs, outputs if carried else None, len(sources), state)
    with applying(module, hooks, "full backward hook", state, capture):
        results = function.apply(*inputs.pick(args), *sources, *state.tensors)
    n = len(inputs.hooked)
    return inputs.place(args, results[:n]), _OpenCall(outputs, tuple(results[n:]))


def _input_side(
    module: nn.Module, hooks: list[Any], inputs: Layout, outputs: Layout | None, n_sources: int, state: State
) -> type:
    """The identity on the module's floating arguments whose backward runs the full backward
    hooks.  With `outputs`, it also returns one carrier per floating output, shaped from its
    operands (the arguments, then `n_sources` tensors that only lend their sizes); Note
    [Carrying grad_output].  The module's `state` comes last (Note [Hooks reading module state]
    in state.py)."""
    like = outputs.like if outputs is not None else ()
    n = len(inputs.hooked)

    class FullBackwardHooks(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state.save(ctx, operands)
            carriers = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in like)
            return (*(t.clone() for t in operands[:n]), *carriers)

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            grad_output = None if outputs is None else outputs.spread(grads[n:])
            call = lambda hook, grad_input: hook(module, grad_input, grad_output)  # noqa: E731
            with state.bound(module, ctx):
                grad_input = chain(hooks, call, inputs.spread(grads[:n]), pre=False)
            return (*inputs.pick(grad_input), *(None,) * n_sources, *state.no_grads())

    return state.name_operands(FullBackwardHooks, n + n_sources)


class GradOutputCarrier(torch.autograd.Function):
    """`(*outputs, *carriers) -> copies of outputs`; backward hands each output's gradient to its
    carrier too.  See Note [Carrying grad_output]."""

    @staticmethod
    def forward(ctx: Any, *outputs_and_carriers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in outputs_and_carriers[: len(outputs_and_carriers) // 2])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*grads, *grads)
