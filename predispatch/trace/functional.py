"""The functional pre-dispatch trace: one run of the user's forward (see `ti.trace_program`)."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from predispatch import _torch_internals as ti
from predispatch.errors import (
    DataDependentError,
    PredispatchError,
    TraceError,
    UnsupportedOutputError,
    user_frame,
)
from predispatch.frontend import PreparedInputs
from predispatch.frontend.dynamic import check_constraints
from predispatch.frontend.inputs import CONSTANT_TYPES
from predispatch.program.signature import InputKind, Leaf
from predispatch.trace.autograd_function import capture_autograd_functions
from predispatch.trace.decompose import DecompositionLog, DecompositionPolicy
from predispatch.trace.dedup import Dedup, share_repeated_blocks
from predispatch.trace.grad_history import GradHistoryKeeper
from predispatch.trace.hooks import backward_hooks


@dataclass(frozen=True)
class TracedGraph:
    """The raw functional graph, before placeholder naming and checks.

    graph_module: inputs `(*state, *user_tensors)`, outputs `(*mutated_inputs_new_values,
        *user_output_tensors)`; placeholder names are still torch's (`arg0_1`).
    mutated_inputs: graph-input positions whose new values the first outputs carry, in order.
    output_leaves: every leaf of the user's return value (tensors and constants).
    out_spec: the pytree spec of the user's return value.
    decompositions: what the trace decided for each composite op it met.
    grad_mode_on_exit: the grad mode forward sets for its caller by a plain
        `torch.set_grad_enabled(b)` never undone; None when forward leaves the caller's mode.
    """

    graph_module: fx.GraphModule
    mutated_inputs: tuple[int, ...]
    output_leaves: tuple[Leaf, ...]
    out_spec: pytree.TreeSpec
    decompositions: DecompositionLog
    grad_mode_on_exit: bool | None


class _Program:
    """What the trace runs: `(*state, *user tensors)` in, the flat graph outputs out.

    Each state tensor is bound to every fully qualified name it has in the user's module (tied
    weights are one input with several names), the module is called, and what the call leaves
    for the stages after the trace is kept: the output's structure, the grad mode forward leaves
    set, where forward first changed an input's metadata.  A call, not a `forward`: node stack
    traces keep only `forward` frames, and this frame is not the user's.
    """

    def __init__(self, prepared: PreparedInputs, dedup: Dedup = Dedup.OFF):
        self._prepared = prepared
        self._dedup = dedup
        self.sharing = None
        self.outputs: tuple[tuple[Leaf, ...], pytree.TreeSpec] | None = None
        self.grad_mode_on_exit: bool | None = None
        self.input_metadata_write: str | None = None

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        prepared = self._prepared
        state, user_tensors = tensors[: len(prepared.state)], tensors[len(prepared.state) :]
        bound = {
            fqn: tensor
            for lifted, tensor in zip(prepared.state, state)
            for fqn in (lifted.spec.target, *lifted.spec.aliases)
        }
        # buffers and constants that do not require grad: their updates need no history kept
        without_history = [
            tensor
            for lifted, tensor in zip(prepared.state, state)
            if lifted.spec.kind is not InputKind.PARAMETER and not lifted.tensor.requires_grad
        ]
        args, kwargs = prepared.call_args(user_tensors)
        keeper = GradHistoryKeeper(without_history, [*state, *user_tensors])
        with contextlib.ExitStack() as stack:
            stack.enter_context(ti.reparametrize(prepared.module, bound))
            stack.enter_context(keeper)  # Note [Mutations inside grad regions]
            stack.enter_context(keeper.observer())
            stack.enter_context(backward_hooks(prepared.module, keeper))
            stack.enter_context(capture_autograd_functions())
            self.sharing = stack.enter_context(share_repeated_blocks(prepared.module, self._dedup))
            out = prepared.module(*args, **kwargs)
        self.grad_mode_on_exit = torch.is_grad_enabled() if keeper.open_regions > 0 else None
        self.input_metadata_write = keeper.input_metadata_write
        self.outputs = _output_leaves(out)
        return tuple(x for x in pytree.tree_leaves(out) if isinstance(x, _GRAPH_OUTPUT_TYPES) and not _is_static(x))


_active_traces = 0


def is_tracing() -> bool:
    """Whether a predispatch trace is running (an export called now is nested in another)."""
    return _active_traces > 0


@contextlib.contextmanager
def _counted():
    global _active_traces
    _active_traces += 1
    try:
        yield
    finally:
        _active_traces -= 1


def trace(prepared: PreparedInputs, policy: DecompositionPolicy, dedup: Dedup = Dedup.OFF) -> TracedGraph:
    """Capture `prepared.module` once as a functional graph (see the package docstring);
    `dedup`: how repeated blocks are shared (Note [Sharing repeated blocks])."""
    program = _Program(prepared, dedup)
    log = DecompositionLog()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_no_garbage_collection())
        stack.enter_context(torch.enable_grad())  # the ambient mode regions are relative to
        stack.enter_context(ti.exporting_flags())
        stack.enter_context(ti.decomposition_hook(lambda op, default: policy.should_decompose(op, default, log)))
        stack.enter_context(prepared.fake_mode)
        stack.enter_context(_counted())
        with _user_errors():
            captured = ti.trace_program(program, (*prepared.fake_state, *prepared.fake_user_inputs), prepared.module)
    if captured.metadata_mutated:
        raise TraceError(
            f"forward changes the shape, strides or storage of {_input_label(prepared, captured.metadata_mutated[0])} "
            "in place (x.t_(), x.resize_(), x.set_(...)); a functional graph cannot hand that change back.",
            where=program.input_metadata_write or f"{user_frame()} (the export call)",
            fix="write it out of place (x = x.t()) and return the new tensor.",
        )
    _check_repeated_inputs(prepared, captured.data_mutated)
    gm = captured.graph_module
    _remove_effect_tokens(gm)
    program.sharing.fold(gm)  # the fully traced calls of shared blocks call the body too
    gm.graph.eliminate_dead_code()  # what the trace computed and nothing used, as AOTAutograd drops it
    gm.meta["dedup"] = program.sharing.reports  # which blocks were shared, replayed, or why not
    if prepared.dynamic is not None:
        check_constraints(prepared.dynamic, gm)
    output_leaves, out_spec = program.outputs
    return TracedGraph(gm, captured.data_mutated, output_leaves, out_spec, log, program.grad_mode_on_exit)


@contextlib.contextmanager
def _no_garbage_collection():
    """Hold the cyclic garbage collector off during the trace.

    A collection can run at any allocation, and the finalizers it runs are Python code: a
    half-consumed generator decorated with `torch.no_grad()` (op_db's sample generators are)
    closes by exiting no_grad, and a trace running at that moment records the toggle into the
    graph as if the user's forward had made it.  Collection resumes after the trace.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _check_repeated_inputs(prepared: PreparedInputs, mutated: tuple[int, ...]) -> None:
    """Refuse a mutation of a tensor passed at several places: eager's other places see the
    change through the shared tensor; the program's inputs are independent."""
    n_state = len(prepared.state)
    for position, first in prepared.repeated:
        if {position + n_state, first + n_state} & set(mutated):
            raise TraceError(
                f"the same tensor is passed as {_input_label(prepared, first + n_state)} and "
                f"{_input_label(prepared, position + n_state)}, and forward changes it in place; "
                "the program takes them as independent inputs, so the change could not reach both.",
                where=f"{user_frame()} (the export call)",
                fix="pass a copy at one place (x.clone()), or do not change the input in place.",
            )


def _input_label(prepared: PreparedInputs, position: int) -> str:
    """How the user knows the graph input at `position`: its state name or input name."""
    n_state = len(prepared.state)
    spec = prepared.state[position].spec if position < n_state else prepared.user_inputs[position - n_state]
    return f"input {spec.target!r}"


def _remove_effect_tokens(gm: fx.GraphModule) -> None:
    """Drop the effect token (the graph's first input): the graph's order of effects is its node order.

    Ops registered as effectful (`aten::_linalg_check_errors`, under `linalg.inv` and
    friends) are traced as `with_effects(token, op, *args)` calls threading a token.  An
    exported program runs its nodes in order, so the token carries nothing:
    `with_effects(token, op, *args)` becomes `op(*args)` and the token input goes.
    """
    for node in list(gm.graph.find_nodes(op="call_function", target=ti.with_effects)):
        ti.unwrap_effects(gm, node)
    for node in reversed(list(gm.graph.nodes)):  # the token getitems and with_effects calls, now unused
        if node.op != "output" and not node.users and (node.target is ti.with_effects or _is_token_item(node)):
            gm.graph.erase_node(node)
    token = next(iter(gm.graph.find_nodes(op="placeholder")))
    assert not token.users, f"effect token {token} is still used"
    gm.graph.erase_node(token)


def _is_token_item(node: fx.Node) -> bool:
    import operator

    return node.target is operator.getitem and node.args[0].target is ti.with_effects and node.args[1] == 0


#: What a graph can return: tensors, and scalars computed from data (`x.sum().item()`, `idx.shape[0]`).
_GRAPH_OUTPUT_TYPES = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)


_SCALAR_TYPE = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def _is_static(value: Any) -> bool:
    """A symbolic scalar that turned out to be a known number is a constant, not a graph output."""
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and value.node.expr.is_number


def _output_leaves(out: Any) -> tuple[tuple[Leaf, ...], pytree.TreeSpec]:
    """Check and describe the user's return value: graph outputs (tensors, symbolic scalars) and constants."""
    with_path, spec = pytree.tree_flatten_with_path(out)
    leaves = []
    for path, value in with_path:
        label = "output" + pytree.keystr(path)
        if isinstance(value, _GRAPH_OUTPUT_TYPES) and not _is_static(value):
            leaves.append(Leaf(label, True))
        elif _is_static(value):
            leaves.append(Leaf(label, False, _SCALAR_TYPE[type(value)](value)))
        elif isinstance(value, CONSTANT_TYPES):
            leaves.append(Leaf(label, False, value))
        else:
            raise UnsupportedOutputError(
                f"{label} has type {type(value).__name__}, which is neither a tensor nor a constant.",
                where=user_frame(),
                fix="return tensors (or tuples/lists/dicts/dataclasses of tensors); register custom "
                "containers with torch.utils._pytree.register_pytree_node.",
            )
    return tuple(leaves), spec


@contextlib.contextmanager
def _user_errors():
    """Turn torch's tracing failures into predispatch errors that name the user's line."""
    try:
        yield
    except PredispatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - every torch failure is re-raised with context
        where = user_frame(exc.__traceback__) or f"{user_frame()} (the export call; torch found this after tracing)"
        if _is_data_dependent(exc):
            raise DataDependentError(
                "Python code branches on, or converts, a value inside a tensor, which export "
                "cannot know (it traces shapes, not values).",
                where=where,
                fix="make the branch static, use torch.where to compute both sides, or torch.cond.",
            ) from exc
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"tracing failed: {type(exc).__name__}: {first_line}",
            where=where,
            fix="the torch error chained below says what failed at the named line; if it is an "
            "in-place metadata change of an input (x.t_(), x.resize_()), write it out of place.",
        ) from exc


def _is_data_dependent(exc: Exception) -> bool:
    chain = [exc, exc.__cause__, exc.__context__]
    return any(isinstance(e, ti.DATA_DEPENDENT_ERRORS) for e in chain)
