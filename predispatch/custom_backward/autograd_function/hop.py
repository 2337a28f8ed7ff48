"""`function_call`: the trace-time HOP that puts a `CapturedCall` into the outer graph.

A `TraceTimeHop` (custom_backward/trace_hop.py): graphs never hold it; in the graph each call is torch's

    autograd_function_apply(fwd, bwd, *operands, non_differentiable_idx=..., saved_for_backward_idx=...)

with the two subgraphs installed on the traced module, and its fake outputs come from running
the forward graph on the fake operands.  The user's Python never runs here: its forward already
ran once, in the nested trace that made the graphs (`subgraphs.py`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from predispatch import _torch_internals as ti
from predispatch.custom_backward.autograd_function.record import CapturedCall
from predispatch.custom_backward.trace_hop import Emitted, Installed, TraceTimeHop


def _emit(tracer: Any, call: CapturedCall) -> Emitted:
    """Install the forward and backward graphs; the node is torch's `autograd_function_apply`."""
    base = _snake(call.function.__name__)
    installed = []
    for suffix, graph in (("fwd", call.forward), ("bwd", call.backward)):
        name = tracer.get_fresh_qualname(f"{base}_{suffix}_")
        graph.__class__.__name__ = name  # each GraphModule has a class of its own: name it as it prints
        tracer.root.register_module(name, graph)
        installed.append(Installed(name, graph))
    names = [n.name for n in call.forward.graph.output_node().args[0][0]]
    return Emitted(ti.autograd_function_apply, tuple(installed), names, call.node_kwargs())


def _fake(mode: Any, call: CapturedCall, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Run the forward graph on the fake operands (shapes and dtypes only)."""
    with mode, ti.discarding_unbacked_symbols(mode):
        outputs, _saved = call.forward(*operands)
    return tuple(outputs)


function_call = TraceTimeHop(
    "predispatch_function_call", emit=_emit, fake=_fake, non_differentiable=lambda call: call.non_differentiable
)


def _snake(name: str) -> str:
    """`StraightThrough` -> `straight_through`: readable subgraph names."""
    return re.sub(r"(?<!^)(?=[A-Z][a-z])", "_", name).lower().strip("_") or "function"
