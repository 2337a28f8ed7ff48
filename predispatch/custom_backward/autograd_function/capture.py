"""`capture_autograd_functions`: capture every `Function.apply` call while the user's forward is traced."""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointFunction

from predispatch import _torch_internals as ti
from predispatch.errors import AutogradFunctionError, DistributedError, user_frame
from predispatch.custom_backward.autograd_function.hop import function_call
from predispatch.custom_backward.trace_hop import TraceTimeFunction
from predispatch.custom_backward.autograd_function.record import CapturedCall
from predispatch.custom_backward.autograd_function.subgraphs import CallSite, capture_call, has_setup_context


def _run_checkpointed(cls, function, preserve_rng_state, *args):
    return function(*args)


#: Functions export runs another way instead of capturing, and why that is right for each:
#: None runs torch's own forward (inlined into the running trace), a function `(cls, *args)`
#: computes in the forward's place.
RUN_INSTEAD: dict[type, tuple[Callable[..., Any] | None, str]] = {
    TraceTimeFunction: (
        None,
        "predispatch's own trace-time call (a captured Function, a replayed block); never differentiated.",
    ),
    CheckpointFunction: (
        _run_checkpointed,
        "reentrant activation checkpointing: its backward recomputes the forward and differentiates "
        "it, so its gradient is the forward's own, and that backward (autograd.backward with side "
        "effects on .grad) cannot be traced; the program runs the checkpointed function plainly "
        "(same values and gradients, without the memory saving).",
    ),
}
if ti.NOOP_SAVE_INPUTS is not None:
    RUN_INSTEAD[ti.NOOP_SAVE_INPUTS] = (
        None,
        "non-reentrant activation checkpointing's placeholder (torch 2.11): it only anchors saved-tensor "
        "hooks, and its backward is never meant to run; the program runs the checkpointed function plainly "
        "(same values and gradients, without the memory saving), as later releases' export does.",
    )


#: DTensor's own Functions (`from_local`'s `_FromTorchTensor`, `to_local`'s, `Redistribute`) live here.
_DTENSOR_PACKAGE = "torch.distributed.tensor."


def _dtensor_in_forward(cls: type) -> DistributedError:
    """Forward makes, unwraps or redistributes a DTensor: refused by name (Note [Distributed
    state] in frontend/distributed.py), not reported as a Function whose forward cannot be traced."""
    return DistributedError(
        f"forward makes, unwraps or redistributes a DTensor (torch's {cls.__name__}: DTensor.from_local, "
        "to_local, redistribute, full_tensor) from plain state; per-rank DTensor programs are built for models "
        "whose parameters or buffers are DTensors.",
        where=user_frame(),
        fix="make the sharded parameters DTensors (parallelize_module, distribute_tensor), or keep the rank's "
        "tensors plain and write the communication with "
        "torch.distributed._functional_collectives (all_gather_tensor_autograd, all_reduce, "
        "reduce_scatter_tensor_autograd), which export with their backward; see docs/distributed.md.",
    )


@dataclass
class _Calls:
    """What the capture keeps during one export.

    program_modes: the PreDispatch modes (proxy tracer, functional mode) while the traced
        program's own Python runs; see Note [Which Functions are captured].
    depth: > 0 while a Function's own forward or backward is being traced: Functions they call
        are inlined (eager runs them under no_grad, so their backward is never used).
    torch_runs: > 0 while `torch_applies` is active: every apply runs as torch's own.
    pairs: `autograd_function_apply` graph pairs met in the trace, as Functions (`_pair_function`).
    """

    program_modes: tuple[Any, Any]
    depth: int = 0
    torch_runs: int = 0
    pairs: dict[tuple[int, int], tuple[type, Any, Any]] = field(default_factory=dict)


#: The running exports' captures, innermost last (an export nested in an export).
_ACTIVE: list[_Calls] = []


@contextlib.contextmanager
def capture_autograd_functions() -> Iterator[None]:
    """While active, each `Function.apply` call becomes one `autograd_function_apply` node.

    Each call is seen inside torch's own apply, however `apply` was reached (called in forward,
    bound before export, kept in a table, wrapped in `functools.partial`): Note [Seeing every
    apply] in _torch_internals/autograd_function.py.  Its forward is traced once and its backward
    from fakes; see Note [Capturing autograd.Function].
    """
    calls = _Calls(ti.pre_dispatch_modes())
    hop_type = type(ti.autograd_function_apply)
    original_hop_call = hop_type.__dict__["__call__"]

    def route(cls: type) -> ti.Run | None:
        """Asked by torch's apply as it makes `cls`'s ctx: how this call runs."""
        if calls.torch_runs > 0:
            return None
        if cls in RUN_INSTEAD:
            return _instead(cls, RUN_INSTEAD[cls][0])
        if cls.__module__.startswith(_DTENSOR_PACKAGE):
            raise _dtensor_in_forward(cls)
        if _left_to_torch(calls, cls):
            return None
        grad_enabled = torch.is_grad_enabled()  # the caller's mode: torch's apply turns it off for forward

        def run(ctx: Any, args: tuple, kwargs: dict) -> Any:
            return _apply(calls, cls, _bind(cls, args, kwargs), _TorchCall(ctx, grad_enabled))

        return run

    def hop_call(hop, fwd, bwd, *args, **kwargs):
        if calls.depth > 0 or not any(isinstance(a, ti.FunctionalTensor) for a in args):
            return original_hop_call(hop, fwd, bwd, *args, **kwargs)
        return _apply(calls, _pair_function(calls, fwd, bwd, kwargs), args)

    _ACTIVE.append(calls)
    hop_type.__call__ = hop_call
    try:
        with ti.redirected_applies(route):
            yield
    finally:
        hop_type.__call__ = original_hop_call
        _ACTIVE.pop()


def _instead(cls: type, runner: Callable[..., Any] | None) -> ti.Run | None:
    """A `RUN_INSTEAD` entry as torch's apply runs it: None (torch's own forward), or `runner` in
    the caller's grad mode, its result the Function's outputs."""
    if runner is None:
        return None
    grad_enabled = torch.is_grad_enabled()

    def run(ctx: Any, args: tuple, kwargs: dict) -> Any:
        with ti.unrecorded_grad_mode(grad_enabled):
            return runner(cls, *args, **kwargs)

    return run


@contextlib.contextmanager
def torch_applies() -> Iterator[None]:
    """Every `Function.apply` runs as torch's own for the time of the block, even under a capture.

    For code that runs during the trace but is not traced (the hooks' shape probe).
    """
    calls = _ACTIVE[-1] if _ACTIVE else None
    if calls is None:
        yield
        return
    calls.torch_runs += 1
    try:
        yield
    finally:
        calls.torch_runs -= 1


def _left_to_torch(calls: _Calls, cls: type) -> bool:
    """Whether this call runs as torch runs it (forward inlined into the running trace).

    Decided by where the call runs, never by where its class is defined; see
    Note [Which Functions are captured].  torch's own `autograd_function_apply` met in the
    trace is captured by `_pair_function`.
    """
    modes_popped = any(now is not mode for now, mode in zip(ti.pre_dispatch_modes(), calls.program_modes))
    inside_kernel = modes_popped or ti.inside_op_call()
    return calls.depth > 0 or inside_kernel or torch._C._are_functorch_transforms_active()


# Note [Which Functions are captured]
# -----------------------------------
# A `Function.apply` call is captured when the traced program's own Python makes it, whatever
# module defines the class (torch.testing's Functions, `torch.distributions`' `_Dirichlet`, a
# user's), and however `apply` was reached (called in forward, `cube = Cube.apply` bound before
# export, a table of applies, `functools.partial(Cube.apply)`: each call is seen inside torch's
# apply, Note [Seeing every apply]): eager differentiates it with its backward, so must the
# program.  It is left to torch (its forward inlined, the enclosing op recorded) when
# - it runs inside an op's kernel: the autograd kernel of a `torch.library.custom_op`
#   (`predispatch::keep_history` too) or of a HOP (`cond`, `invoke_subgraph`, ...) calls
#   `apply` from inside the dispatcher, and the op or HOP is what the graph records.  Two
#   signals, not the class's module, tell: the call runs below an op's or HOP's Python call
#   frame (`OpOverload.__call__`, `HigherOrderOperator.dispatch`: `ti.inside_op_call`), or the
#   trace's PreDispatch modes (the proxy tracer, the functional mode) are not all in place, as
#   the dispatcher pops the one it is handling for the time of the kernel
#   (`ti.pre_dispatch_modes`; this also covers kernels reached from C++, with no such frame);
# - it is nested inside a captured Function's forward or backward (`_Calls.depth`): eager runs
#   those under no_grad, so only the outer backward is ever used;
# - a functorch transform (vmap, grad) is active: torch routes Functions through its own HOP.
# `RUN_INSTEAD` lists the Functions run another way, each with its reason.


def _bind(cls: type, args: tuple, kwargs: dict) -> tuple:
    """The arguments torch's apply passes to forward as positions, defaults applied (a setup_context
    Function's `apply` binds them so; the capture's subgraphs take positions only)."""
    with_ctx = not has_setup_context(cls)
    if with_ctx and not kwargs:
        return args
    signature, ctx = inspect.signature(cls.forward), (None,) if with_ctx else ()
    bound = signature.bind(*ctx, *args, **kwargs)
    bound.apply_defaults()
    return bound.args[1:] if with_ctx else bound.args


@dataclass(frozen=True)
class _TorchCall:
    """A call torch's apply is running, its forward redirected to the capture.

    ctx: torch's ctx for the call (a `BackwardCFunction`), whose outputs it wraps after forward.
    grad_enabled: the caller's grad mode; torch's apply runs forward with grad off.
    """

    ctx: Any
    grad_enabled: bool


def _apply(calls: _Calls, cls: type, args: tuple, torch_call: _TorchCall | None = None) -> Any:
    """Capture one call, then run it through the HOP into the outer graph.

    Under torch's apply (`torch_call`) the HOP runs in forward's grad mode (off), so its outputs
    come without autograd history and torch's apply gives them the Function's, as eager does;
    torch's ctx is told which inputs forward changed in place and which outputs are not
    differentiable, so torch wraps them as eager does (a changed input is returned as itself).
    The write into a changed input is made in the caller's grad mode, as the call would make it.
    A pair of graphs met in the trace (`_pair_function`) runs in the caller's mode, with no ctx.
    """
    site = CallSite(cls, args)
    call = _capture(calls, site)
    operands = site.operands()
    outputs = list(function_call(call, *operands))
    with ti.unrecorded_grad_mode(torch_call.grad_enabled) if torch_call is not None else contextlib.nullcontext():
        for output, operand in call.dirty:  # ctx.mark_dirty: the input now holds the output
            operands[operand].copy_(outputs[output])
            outputs[output] = operands[operand]
    if torch_call is not None:
        torch_call.ctx.mark_dirty(*(outputs[output] for output, _ in call.dirty))
        torch_call.ctx.mark_non_differentiable(*(outputs[i] for i in call.non_differentiable))
    return call.user_output(outputs)


def _capture(calls: _Calls, site: CallSite) -> CapturedCall:
    """Trace this call's forward and backward; Functions they call are left to torch (`calls.depth`)."""
    fake_mode = ti.detect_fake_mode(site.operands())
    calls.depth += 1
    try:
        return capture_call(site, fake_mode)
    finally:
        calls.depth -= 1


def _pair_function(calls: _Calls, fwd: torch.fx.GraphModule, bwd: torch.fx.GraphModule, attrs: dict) -> type:
    """An autograd.Function running an existing `autograd_function_apply` pair of graphs.

    The trace meets torch's op when it runs an exported program (`export(ep.module())`, a
    nested export) or a region Dynamo traced (`torch.cond` branches).  Its `__call__` would
    inline the forward; instead the pair is captured like any Function, which also makes
    Dynamo's torch-level graphs functional ATen graphs.  One class per pair, made at its first
    call and reused by the pair's later calls.
    """
    key = (id(fwd), id(bwd))
    if key not in calls.pairs:
        if attrs.get("dirty_idx"):
            raise AutogradFunctionError(
                "a Dynamo-traced autograd.Function marks an input dirty (ctx.mark_dirty), which its "
                "graphs cannot show functionally.",
                where=user_frame(),
                fix="call the in-place Function outside torch.cond / torch.compile regions.",
            )
        non_differentiable = tuple(attrs.get("non_differentiable_idx", ()))
        pair = _make_pair(fwd, bwd, non_differentiable, tuple(attrs.get("saved_for_backward_idx", ())))
        calls.pairs[key] = (pair, fwd, bwd)  # the graphs are kept alive with their ids
    return calls.pairs[key][0]


def _make_pair(fwd, bwd, non_differentiable: tuple[int, ...], for_backward: tuple[int, ...]) -> type:
    """The Function: saved values from `save_for_backward` (by `for_backward`) or as a ctx attribute."""

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            output, saved = fwd(*args)
            outputs = output if isinstance(output, tuple) else (output,)
            ctx.save_for_backward(*(saved[i] for i in for_backward))
            ctx.others = [t for i, t in enumerate(saved) if i not in for_backward]
            ctx.mark_non_differentiable(*(outputs[i] for i in non_differentiable))
            return output

        @staticmethod
        def backward(ctx, *grads):
            by_index, others = dict(zip(for_backward, ctx.saved_tensors)), iter(ctx.others)
            count = len(by_index) + len(ctx.others)
            return bwd(*grads, *(by_index[i] if i in by_index else next(others) for i in range(count)))

    fwd_output = fwd.graph.output_node().args[0][0]
    num_outputs = len(fwd_output) if isinstance(fwd_output, (tuple, list)) else 1
    Pair.__name__ = Pair.__qualname__ = _pair_name(type(fwd).__name__)
    Pair.placeholder_names = _placeholder_names(fwd), _placeholder_names(bwd)[num_outputs:]
    return Pair


def _placeholder_names(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.find_nodes(op="placeholder")]


def _pair_name(forward_class: str) -> str:
    """`straight_through_fwd_0` -> `straight_through`; Dynamo's anonymous graphs -> `autograd_function`."""
    name = re.sub(r"_?fwd(_body)?_\d+$", "", forward_class)
    return "autograd_function" if name in ("", "GraphModule") else name
