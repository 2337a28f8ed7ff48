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

The carriers are shaped like the module's output, and whether eager calls the hooks at all
depends on the output's layout; neither is known before the forward runs.  So the module is
traced once, as every other module (Note [One trace of a hooked module]), and the Function is
applied once its output is known, its nodes placed before the forward's.

As in eager, a hook changes nothing when no floating input requires grad at run time
(FullBackwardHooks then has no backward; eager calls the hook with Nones and requires None
back), when the module runs with grad mode off, or when its output has no floating tensor at
the top level of a tensor or tuple (eager never calls the hooks then).  One difference: the
copies GradOutputCarrier returns require grad whenever an input of the module does, even one
eager leaves without history (a module returning `x.detach()`), and its gradient then reaches
the hooks.  A size of the output that depends on tensor values (`x[x > 0]`) comes from no
argument, so a carrier inside the Function cannot be shaped by it: refused (`shape_sources`).

Note [One trace of a hooked module]
-----------------------------------
The forward pre-hook gives the forward a copy of each floating argument (`x.clone()`, the
value FullBackwardHooks returns) and notes where the graph stood; the forward and the forward
hooks run once, traced as usual; then the forward hook, knowing the output, applies
FullBackwardHooks to the arguments as they were before the forward, moves the nodes it made to
just before the copies, and turns each copy's node into the Function's output for it:

    before:  clone = aten.clone(x); linear = aten.linear(clone, ...)      # the forward, traced once
    after:   autograd_function_apply = autograd_function_apply(fwd, bwd, x, ...)
             clone = autograd_function_apply[0]; linear = aten.linear(clone, ...)

The forward's nodes read the copy's node, which keeps its name and value; only its source
changes.  Operands are the values from before the forward (their nodes noted by the pre-hook),
so the moved nodes read nothing the forward made.  When eager would call no hook (the output
holds no floating tensor), each copy stays a plain `clone`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch.errors import UnsupportedHookError, user_frame
from predispatch.custom_backward.hooks.capture import Capture, applying, chain
from predispatch.custom_backward.hooks.inspection import may_read_argument
from predispatch.custom_backward.hooks.layout import Layout
from predispatch.custom_backward.hooks.state import State


@dataclass(frozen=True)
class _OpenCall:
    """A module call whose forward reads copies of its floating arguments, until its forward
    hooks ran (Note [One trace of a hooked module]).

    inputs: the positional arguments' layout.
    arguments: `(args, kwargs)` as the caller passed them (with the originals, not the copies).
    state: the module tensors the hooks may read, and their mutation counts, as they were then.
    copies: the node of each copy the forward reads, made by the pre-hook.
    before: the node of every tensor of `arguments` and `state`, by id, before the forward ran.
    """

    inputs: Layout
    arguments: tuple[tuple, dict]
    state: State
    counts: tuple[int | None, ...]
    copies: tuple[fx.Node, ...]
    before: dict[int, fx.Node | None]


def full_backward_hooks(hooks: list[Any], capture: Capture) -> tuple[Callable, Callable]:
    """A forward pre-hook (with kwargs) that gives the module's forward copies of its floating
    arguments, and the forward hook that, once the output is known, routes the arguments through
    the full backward `hooks` in the copies' place and, when a hook reads grad_output, hands
    grad_output to them (Note [Carrying grad_output], Note [One trace of a hooked module])."""
    carried = any(may_read_argument(h, 2) for h in hooks)
    open_calls: list[_OpenCall | None] = []  # one per call in progress

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        inputs = Layout.of(args)
        if not inputs.hooked or not torch.is_grad_enabled() or ti.current_tracer() is None:
            # (no tracer: a run that records nothing, AOTAutograd's metadata pass in the one-pass
            # test's reference; the hooks' Functions are identities on values)
            open_calls.append(None)
            return None
        opened, copies = _open(module, hooks, inputs, args, kwargs)
        open_calls.append(opened)
        return inputs.place(args, copies), kwargs

    def after(module: nn.Module, args: tuple, output: Any) -> Any:
        opened = open_calls.pop()
        if opened is None:
            return None
        outputs = Layout.of(output)
        if not outputs.hooked:  # eager calls no hook: the copies stay plain copies
            return None
        carriers = _hook_inputs(module, hooks, opened, outputs if carried else None, capture)
        if not carried:
            return None
        return outputs.place(output, GradOutputCarrier.apply(*outputs.pick(output), *carriers))

    return before, after


def _open(module: nn.Module, hooks: list[Any], inputs: Layout, args: tuple, kwargs: dict) -> tuple[_OpenCall, tuple]:
    """The copies the forward reads, and what the forward hook needs of the call's start."""
    state = State.of(module, hooks)
    tensors = [t for t in (*pytree.tree_leaves((args, kwargs)), *state.tensors) if isinstance(t, torch.Tensor)]
    before = {id(t): _node(t, required=False) for t in tensors}
    copies = tuple(t.clone() for t in inputs.pick(args))
    nodes = tuple(_node(c) for c in copies)
    counts = tuple(map(ti.mutation_count, state.tensors))
    return _OpenCall(inputs, (args, kwargs), state, counts, nodes, before), copies


def _hook_inputs(module: nn.Module, hooks: list[Any], opened: _OpenCall, outputs: Layout | None, capture: Capture) -> tuple:
    """Apply `FullBackwardHooks` to the arguments as they were before the forward, in the place
    of the copies the forward read (Note [One trace of a hooked module]); returns the carriers."""
    args, kwargs = opened.arguments
    originals = opened.inputs.pick(args)
    sources = shape_sources(module, originals, (args, kwargs), outputs, capture) if outputs is not None else ()
    function = _input_side(module, hooks, opened.inputs, outputs, len(sources), opened.state)
    graph = opened.copies[0].graph
    last = _last_node(graph)
    with applying(module, hooks, "full backward hook", opened.state, capture, opened.counts):
        results = function.apply(*originals, *sources, *opened.state.tensors)
    made = _nodes_after(graph, last)
    for t in (*originals, *sources, *opened.state.tensors):  # operands as they were before the forward
        now, then = _node(t, required=False), opened.before.get(id(t))
        if now is not None and then is not None and now is not then:
            for node in made:
                node.replace_input_with(now, then)
    for node in made:
        opened.copies[0].prepend(node)
    for copy, result in zip(opened.copies, results):
        source = _node(result)
        source.append(copy)  # the copy's node takes the output's place, and its source
        copy.target, copy.args, copy.kwargs = source.target, source.args, source.kwargs
        graph.erase_node(source)
    return tuple(results[len(originals):])


def _node(t: torch.Tensor, required: bool = True) -> Any:
    """The graph node of `t`'s current value (None for a tensor the trace does not know, a real
    constant, unless `required`: the copies and the Function's outputs are always traced)."""
    tracer = ti.current_tracer()
    node = None if tracer is None else ti.traced_node(t, tracer)
    if node is None and required:
        raise ti.drift(ti.APPLY_CAPTURE, "a full backward hook's tensor is not in the graph of the trace")
    return node


def _last_node(graph: fx.Graph) -> fx.Node:
    """The graph's last node so far (the trace appends; no output node yet)."""
    return next(iter(reversed(graph.nodes)))


def _nodes_after(graph: fx.Graph, last: fx.Node) -> list[fx.Node]:
    """The nodes appended after `last`, in order."""
    made, node = [], last.next
    while node is not graph._root:
        made.append(node)
        node = node.next
    return made


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


def shape_sources(module: nn.Module, inputs: tuple, arguments: Any, outputs: Layout, capture: Capture) -> tuple:
    """Other argument tensors whose sizes the carriers' symbolic sizes are made from (usually none).

    A carrier is made inside `FullBackwardHooks`' forward, a subgraph that sees only its
    operands, so each symbolic size of an output must come from an operand's: an index
    tensor's length (dynamic shapes) joins the operands.  A size that comes from no argument
    depends on tensor values (`nonzero`, boolean masks) and is known only after the forward.
    """
    missing = set(ti.free_symbols([shape for shape, _, _ in outputs.like])) - set(ti.free_symbols(list(inputs)))
    sources = []
    for t in pytree.tree_leaves(arguments):
        if missing and isinstance(t, torch.Tensor) and missing & set(ti.free_symbols(t)):
            sources.append(t)
            missing -= set(ti.free_symbols(t))
    if missing:
        raise UnsupportedHookError(
            f"{capture.describe(module)} has a full backward hook that reads grad_output, and "
            f"the shape of its output depends on tensor values ({', '.join(sorted(map(str, missing)))}); the "
            "tensor that brings grad_output to the hook is made before the forward runs, so its shape must "
            "follow from the shapes of the module's arguments.",
            where=user_frame(),
            fix="make the hook use only grad_input, or register it on a submodule whose output shape "
            "follows from its input shapes.",
        )
    return tuple(sources)


class GradOutputCarrier(torch.autograd.Function):
    """`(*outputs, *carriers) -> copies of outputs`; backward hands each output's gradient to its
    carrier too.  See Note [Carrying grad_output]."""

    @staticmethod
    def forward(ctx: Any, *outputs_and_carriers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in outputs_and_carriers[: len(outputs_and_carriers) // 2])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*grads, *grads)
