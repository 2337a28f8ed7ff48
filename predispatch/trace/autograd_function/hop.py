"""`function_call`: the trace-time HOP that puts a `CapturedCall` into the outer graph.

It exists only while export traces; graphs never hold it.  Dispatched like any HOP through the
outer trace's levels, it leaves torch's own `autograd_function_apply` in the graph:

    functionalization  unwrap the FunctionalTensor operands, redispatch, wrap the outputs
    proxy (capture)    install the two subgraphs on the traced module, emit
                           autograd_function_apply(fwd, bwd, *operands, non_differentiable_idx=...,
                                                   saved_for_backward_idx=...)
                       and track its outputs
    autograd           an autograd.Function, so outputs require grad as the Function's would
    fake               run the forward graph on the fake operands (shapes and dtypes only)

so the user's Python never runs here: its forward already ran once, in the nested trace that
made the graphs (`subgraphs.py`), and the outer trace sees only those graphs.
"""

from __future__ import annotations

import operator
import re

import torch

from predispatch import _torch_internals as ti
from predispatch.trace.autograd_function.record import CapturedCall


class _FunctionCall(ti.HigherOrderOperator):
    """`function_call(call, *operands) -> outputs`: one captured Function call (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("predispatch_function_call")

    def __call__(self, call: CapturedCall, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().__call__(call, *operands)


function_call = _FunctionCall()


@function_call.py_functionalize_impl
def _functionalize(ctx, call: CapturedCall, *operands):
    unwrapped = ctx.unwrap_tensors(operands)
    with ctx.redispatch_to_next():
        outputs = function_call(call, *unwrapped)
    return ctx.wrap_tensors(outputs)


@function_call.py_impl(ti.ProxyTorchDispatchMode)
def _emit(mode, call: CapturedCall, *operands):
    with ti.disable_proxy_modes_tracing():
        outputs = function_call(call, *operands)
    tracer = mode.tracer
    base = _snake(call.function.__name__)
    for suffix, graph in (("fwd", call.forward), ("bwd", call.backward)):
        name = tracer.get_fresh_qualname(f"{base}_{suffix}_")
        graph.__class__.__name__ = name  # each GraphModule has a class of its own: name it as it prints
        tracer.root.register_module(name, graph)
    args = (call.forward, call.backward, *(tracer.unwrap_proxy(t) for t in operands))
    proxy = tracer.create_proxy("call_function", ti.autograd_function_apply, args, call.node_kwargs())
    tracked = ti.track_tensor_tree(outputs, proxy, constant=None, tracer=tracer)
    _name_outputs(proxy.node, call)
    return tracked


def _name_outputs(node: torch.fx.Node, call: CapturedCall) -> None:
    """Name each `getitem` of the HOP after the forward graph's output (`round_1`, not `getitem`)."""
    names = [n.name for n in call.forward.graph.output_node().args[0][0]]
    for user in list(node.users):
        if user.target is operator.getitem:
            user._rename(names[user.args[1]])


@function_call.py_impl(ti.FakeTensorMode)
def _fake(mode, call: CapturedCall, *operands):
    with mode, ti.discarding_unbacked_symbols(mode):
        outputs, _saved = call.forward(*operands)
    return tuple(outputs)


@function_call.py_autograd_impl
def _autograd(call: CapturedCall, *operands):
    return TracedCall.apply(call, *operands)


class TracedCall(torch.autograd.Function):
    """Gives the HOP's outputs the autograd metadata the user's Function would give them.

    Never differentiated: the export trace is forward-only; the program's gradients come from
    the backward subgraph at run time.
    """

    @staticmethod
    def forward(ctx, call: CapturedCall, *operands):
        with torch._C._AutoDispatchBelowAutograd():
            outputs = function_call(call, *operands)
        ctx.mark_non_differentiable(*(outputs[i] for i in call.non_differentiable))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        raise AssertionError("predispatch's trace-time Function call is never differentiated")


def _snake(name: str) -> str:
    """`StraightThrough` -> `straight_through`: readable subgraph names."""
    return re.sub(r"(?<!^)(?=[A-Z][a-z])", "_", name).lower().strip("_") or "function"
