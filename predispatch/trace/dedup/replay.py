"""`block_call`: the trace-time HOP that replays a shared body as torch's `invoke_subgraph`.

It exists only while export traces; graphs never hold it.  Dispatched through the outer trace's
levels like predispatch's Function capture (trace/autograd_function/hop.py):

    functionalization  unwrap the FunctionalTensor operands, redispatch, wrap the outputs
    proxy (capture)    install the body once on the traced module, emit
                           invoke_subgraph(body, identifier, *operands)
                       and track its outputs
    autograd           an autograd.Function, so outputs require grad as the recorded call's did
    fake               fresh fake tensors with the recorded outputs' metadata (the body's input
                       metadata is part of the key, so its outputs' metadata is the same)

so neither the user's forward nor the body's ops run again: a replay costs one node.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from predispatch import _torch_internals as ti


@dataclass(frozen=True, eq=False)
class SharedBody:
    """One body shared by every call of a key.

    body: the GraphModule `(*operands) -> (*outputs, *new values of mutated operands)`.
    name: its attribute name on the traced module (`repeated_body_0`), also the HOP's identifier.
    outputs: for each output, (shape, stride, dtype, device, requires_grad) of the recorded call.
    """

    body: fx.GraphModule
    name: str
    outputs: tuple[tuple, ...]


class _BlockCall(ti.HigherOrderOperator):
    """`block_call(shared, *operands) -> outputs`: one replayed call (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("predispatch_block_call")

    def __call__(self, shared: SharedBody, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().__call__(shared, *operands)


block_call = _BlockCall()


@block_call.py_functionalize_impl
def _functionalize(ctx, shared: SharedBody, *operands):
    unwrapped = ctx.unwrap_tensors(operands)
    with ctx.redispatch_to_next():
        outputs = block_call(shared, *unwrapped)
    return ctx.wrap_tensors(outputs)


@block_call.py_impl(ti.ProxyTorchDispatchMode)
def _emit(mode, shared: SharedBody, *operands):
    with ti.disable_proxy_modes_tracing():
        outputs = block_call(shared, *operands)
    tracer = mode.tracer
    if not hasattr(tracer.root, shared.name):
        tracer.root.register_module(shared.name, shared.body)
    args = (shared.body, shared.name, *(tracer.unwrap_proxy(t) for t in operands))
    proxy = tracer.create_proxy("call_function", ti.invoke_subgraph, args, {})
    tracked = ti.track_tensor_tree(outputs, proxy, constant=None, tracer=tracer)
    _name_outputs(proxy.node, shared)
    return tracked


def _name_outputs(node: fx.Node, shared: SharedBody) -> None:
    """Name each `getitem` of the HOP after the body's output (`add_3`, not `getitem`)."""
    names = [getattr(n, "name", "out") for n in shared.body.graph.output_node().args[0]]
    for user in list(node.users):
        if user.target is operator.getitem:
            user._rename(names[user.args[1]])


@block_call.py_impl(ti.FakeTensorMode)
def _fake(mode, shared: SharedBody, *operands):
    with mode:
        return tuple(
            torch.empty_strided(shape, stride, dtype=dtype, device=device)
            for shape, stride, dtype, device, _requires_grad in shared.outputs
        )


#: torch's own `Function.apply`: the trace's Function capture must not capture `_Replayed`.
_TORCH_APPLY = torch.autograd.Function.__dict__["apply"].__func__


@block_call.py_autograd_impl
def _autograd(shared: SharedBody, *operands):
    return _TORCH_APPLY(_Replayed, shared, *operands)


class _Replayed(torch.autograd.Function):
    """Gives the outputs the autograd metadata the recorded call's outputs had.

    Never differentiated: the export trace is forward-only; the program's gradients come from
    the body's ops at run time.
    """

    @staticmethod
    def forward(ctx, shared: SharedBody, *operands):
        with torch._C._AutoDispatchBelowAutograd():
            outputs = block_call(shared, *operands)
        ctx.mark_non_differentiable(*(out for out, meta in zip(outputs, shared.outputs) if not meta[4]))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        raise AssertionError("predispatch's trace-time block call is never differentiated")


def replay_call(shared: SharedBody, recorded: Any, operands: Sequence[torch.Tensor]) -> Any:
    """One call of a shared block: the HOP on the operands the body reads, the in-place changes
    it made written back to their tensors, the result rebuilt in the recorded call's structure."""
    outputs = block_call(shared, *(operands[i] for i in recorded.used), *recorded.symbols)
    n_user = len(recorded.outputs) - len(recorded.mutated)
    for value, i in zip(outputs[n_user:], recorded.mutated):
        operands[i].copy_(value)
    tensors = iter(outputs[:n_user])
    leaves = [_leaf(leaf, tensors, operands) for leaf in recorded.out_leaves]
    return pytree.tree_unflatten(leaves, recorded.out_spec)


@dataclass(frozen=True)
class PassThrough:
    """An output that is one of the block's operands itself (T5 hands `position_bias` on):
    the replay returns that very tensor, as eager does."""

    operand: int


class _BodyOutput:
    """Where the next output of the body goes in the rebuilt result."""

    def __repr__(self) -> str:
        return "BODY_OUTPUT"


BODY_OUTPUT = _BodyOutput()


def _leaf(leaf: Any, tensors: Any, operands: Sequence[torch.Tensor]) -> Any:
    if leaf is BODY_OUTPUT:
        return next(tensors)
    if isinstance(leaf, PassThrough):
        return operands[leaf.operand]
    return leaf  # a constant (plain values are their own snapshot)
