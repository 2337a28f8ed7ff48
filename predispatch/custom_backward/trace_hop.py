"""`TraceTimeHop`: a higher-order op that exists only while export traces.

predispatch puts a computation it has already recorded into the outer graph through such an op:
a captured autograd.Function (`custom_backward/autograd_function/hop.py`) and a replayed shared block
(`trace/dedup/replay.py`).  Graphs never hold it.  `hop(record, *operands)` is dispatched
through the outer trace's levels:

    functionalization  unwrap the FunctionalTensor operands, redispatch, wrap the outputs
    proxy (capture)    `emit` installs the record's subgraphs and says which of torch's HOPs
                       to call; that node is emitted, its outputs tracked and named
    autograd           `TraceTimeFunction`, so outputs require grad as the record says
    fake               `fake` makes the outputs' fake tensors

so the user's Python never runs again: a call costs one node.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from predispatch import _torch_internals as ti


@dataclass(frozen=True, eq=False)
class Installed:
    """A module `emit` installed on `tracer.root` under `name`, as a node's argument: the node
    reads it by a `get_attr` of that name.

    FX makes that `get_attr` itself for a module argument, named by the module's first path in
    a walk of every module under the root (`Tracer.create_arg`, `root.named_modules()`), and
    every captured Function and replayed block installs its graphs on the root: a walk per
    call was quadratic in the calls.  A module just installed is reached first by the name it
    was installed under (nothing installed before holds it), so the node is the one FX makes;
    a module the root does not hold under that name is left to FX's walk.
    """

    name: str
    module: torch.nn.Module


@dataclass(frozen=True)
class Emitted:
    """What one call becomes in the graph: `target(*leading, *operands, **kwargs)`, whose
    `getitem` outputs are named `names` (the recorded graph's own names, not `getitem`).
    Modules among `leading` are given as `Installed`."""

    target: Callable[..., Any]
    leading: tuple[Any, ...]
    names: Sequence[str]
    kwargs: dict[str, Any] = field(default_factory=dict)


class TraceTimeHop(ti.HigherOrderOperator):
    """`hop(record, *operands) -> outputs`; see the module docstring.

    emit(tracer, record) -> Emitted: installs what the node needs on `tracer.root`.
    fake(mode, record, *operands) -> outputs: fake tensors of the outputs' metadata.
    non_differentiable(record) -> positions of the outputs that never require grad.
    """

    def __init__(
        self,
        name: str,
        *,
        emit: Callable[[Any, Any], Emitted],
        fake: Callable[..., tuple[torch.Tensor, ...]],
        non_differentiable: Callable[[Any], Sequence[int]],
    ) -> None:
        super().__init__(name)
        self.emit, self.non_differentiable = emit, non_differentiable
        self.py_functionalize_impl(self._functionalize)
        self.py_impl(ti.ProxyTorchDispatchMode)(self._proxy)
        self.py_impl(ti.FakeTensorMode)(fake)
        self.py_autograd_impl(self._autograd)

    def __call__(self, record: Any, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().__call__(record, *operands)

    def _functionalize(self, ctx: Any, record: Any, *operands: torch.Tensor) -> Any:
        unwrapped = ctx.unwrap_tensors(operands)
        with ctx.redispatch_to_next():
            outputs = self(record, *unwrapped)
        return ctx.wrap_tensors(outputs)

    def _proxy(self, mode: Any, record: Any, *operands: torch.Tensor) -> Any:
        with ti.disable_proxy_modes_tracing():
            outputs = self(record, *operands)
        tracer = mode.tracer
        emitted = self.emit(tracer, record)
        args = (*(_argument(tracer, a) for a in emitted.leading), *(tracer.unwrap_proxy(t) for t in operands))
        proxy = tracer.create_proxy("call_function", emitted.target, args, emitted.kwargs)
        tracked = ti.track_tensor_tree(outputs, proxy, constant=None, tracer=tracer)
        _name_outputs(proxy.node, emitted.names)
        return tracked

    def _autograd(self, record: Any, *operands: torch.Tensor) -> Any:
        return TraceTimeFunction.apply(self, record, *operands)


def _argument(tracer: Any, value: Any) -> Any:
    """A leading argument as the node takes it: an installed module as its `get_attr` node."""
    if not isinstance(value, Installed):
        return value
    if getattr(tracer.root, value.name, None) is value.module:
        return tracer.create_proxy("get_attr", value.name, (), {})  # what `create_arg` makes for it
    return value.module


def _name_outputs(node: fx.Node, names: Sequence[str]) -> None:
    for user in list(node.users):
        if user.target is operator.getitem:
            user._rename(names[user.args[1]])


class TraceTimeFunction(torch.autograd.Function):
    """Gives a trace-time call's outputs the autograd metadata its record says.

    Never differentiated: the export trace is forward-only; the program's gradients come from
    the recorded graphs at run time.  Function capture runs it as torch does (`RUN_INSTEAD`).
    """

    @staticmethod
    def forward(ctx: Any, hop: TraceTimeHop, record: Any, *operands: torch.Tensor) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            outputs = hop(record, *operands)
        ctx.mark_non_differentiable(*(outputs[i] for i in hop.non_differentiable(record)))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise AssertionError("predispatch's trace-time calls are never differentiated")
