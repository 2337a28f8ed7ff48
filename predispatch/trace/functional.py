"""The functional pre-dispatch trace: one run of the user's forward (see `ti.trace_program`)."""

from __future__ import annotations

import ast
import contextlib
import gc
import inspect
import linecache
import textwrap
import traceback
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx

from predispatch import _meta
from predispatch import _torch_internals as ti
from predispatch.errors import (
    DataDependentError,
    PredispatchError,
    RngStateError,
    TraceError,
    UnsupportedOutputError,
    from_torch,
    is_numpy_file,
    is_user_file,
    user_frame,
)
from predispatch.frontend import PreparedInputs
from predispatch.frontend.dynamic import check_constraints
from predispatch.frontend.inputs import CONSTANT_TYPES, hf_cache_fix, is_hf_cache, register_dataclasses
from predispatch.frontend.reachable import in_tree, resolve
from predispatch.frontend.subclasses import is_subclass, layout_of
from predispatch.signature import InputKind, Leaf
from predispatch.custom_backward.autograd_function import capture_autograd_functions
from predispatch.trace.collectives import COLLECTIVE_REWRITES
from predispatch.trace.data_dependent import data_dependent_fix
from predispatch.trace.constructs import (
    construct_refusal,
    naming_property_errors,
    refuse_script_modules,
    refusing_encoder_fast_path,
    torch_check_error,
)
from predispatch.trace.decompose import (
    FAST_INPLACE_META,
    REWRITES,
    DecompositionLog,
    DecompositionPolicy,
    check_trace_decompositions,
    trace_decompositions,
)
from predispatch.trace.dedup import Dedup, share_repeated_blocks
from predispatch.trace.grad_history import GradHistoryKeeper
from predispatch.custom_backward.hooks import backward_hooks
from predispatch.trace.inference_mode import inference_mode_as_grad_mode
from predispatch.trace.transforms import transforms_below_autograd
from predispatch.trace.flex_attention import refuse_differentiated_captures
from predispatch.trace.outside_tensors import refuse_outside_tensor_uses
from predispatch.trace.scatter_gradients import rewrite_as_strided_scatters
from predispatch.trace.subclass_reads import eager_part_reads, guard_plain_gradients
from predispatch.trace.rng import refuse_generators_made_in_forward, refusing_rng_changes


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
    metadata_mutated: the positions among `mutated_inputs` (user inputs only) whose shape,
        strides or storage offset forward changed in place (`x.t_()`).
    """

    graph_module: fx.GraphModule
    mutated_inputs: tuple[int, ...]
    output_leaves: tuple[Leaf, ...]
    out_spec: pytree.TreeSpec
    decompositions: DecompositionLog
    grad_mode_on_exit: bool | None
    metadata_mutated: tuple[int, ...] = ()


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
        self.sharing: Any = None  # the repeated-block sharing of the running trace (trace/dedup/)
        self.outputs: tuple[tuple[Leaf, ...], pytree.TreeSpec] | None = None
        self.grad_mode_on_exit: bool | None = None
        self.input_metadata_write: str | None = None
        self.visible_generators: frozenset[int] = frozenset()
        # what `_check_engaged` asks afterwards: the dispatch observer's hook and the keeper
        self.observer: ti.Hook | None = None
        self.keeper: GradHistoryKeeper | None = None

    def __call__(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        prepared = self._prepared
        inputs, user_tensors = tensors[: len(prepared.state)], tensors[len(prepared.state) :]
        # buffers and constants that do not require grad: their updates need no history kept
        without_history = [
            tensor
            for lifted, tensor in zip(prepared.state, inputs)
            if lifted.spec.kind is not InputKind.PARAMETER and not lifted.tensor.requires_grad
        ]
        args, kwargs = prepared.call_args(user_tensors)
        keeper = GradHistoryKeeper(without_history, [*inputs, *user_tensors])
        with contextlib.ExitStack() as stack:
            # Note [RNG state in forward]
            self.visible_generators = stack.enter_context(refusing_rng_changes(prepared.module))
            stack.enter_context(keeper)  # Note [Mutations inside grad regions]
            self.observer, self.keeper = stack.enter_context(keeper.observer()), keeper
            state = _bind_storage_views(prepared, inputs)  # Note [State that shares storage]
            bound, subclasses = _bindings(prepared, state)
            inside, beyond = _split_by_reach(prepared.module, bound)
            stack.enter_context(ti.reparametrize(prepared.module, inside))
            stack.enter_context(_bound_beyond(prepared.module, beyond))
            stack.enter_context(backward_hooks(prepared.module, keeper))
            stack.enter_context(capture_autograd_functions())
            assigned = stack.enter_context(_buffer_assignments())
            self.sharing = stack.enter_context(share_repeated_blocks(prepared.module, self._dedup))
            stack.enter_context(eager_part_reads([*subclasses, *_input_subclasses(prepared, args, kwargs)]))
            out = prepared.module(*args, **kwargs)
            _record_reassigned_buffers(prepared, state, assigned)
            _write_storage_views(prepared, inputs)
        self.grad_mode_on_exit = torch.is_grad_enabled() if keeper.open_regions > 0 else None
        self.input_metadata_write = keeper.input_metadata_write
        self.outputs = _output_leaves(out, prepared.module)
        flat = pytree.tree_leaves(out)
        return tuple(
            part
            for x, leaf in zip(flat, self.outputs[0])
            if leaf.is_tensor
            for part in (leaf.layout.flatten(x) if leaf.layout is not None else (x,))
        )


def _bindings(prepared: PreparedInputs, state: tuple[torch.Tensor, ...]) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """Every name of the lifted state bound to its traced tensor; a subclass's parts are built
    into the subclass again, bound at the subclass's names (Note [Tensor subclasses]).  Also
    each subclass built, with its layout and the module's own subclass tensor."""
    bound: dict[str, torch.Tensor] = {}
    subclasses: list[tuple] = []
    parts: list[torch.Tensor] = []
    for lifted, tensor in zip(prepared.state, state):
        if lifted.part is not None:
            parts.append(tensor)
            if len(parts) < len(lifted.part.layout.paths()):
                continue
            with ti.lazy_symbolic_sizes():  # a jagged nested tensor's strides are products of its nested int
                tensor, parts = lifted.part.layout.unflatten(parts), []
            subclasses.append((tensor, _stored_without_grad(tensor, lifted.part.layout, lifted.part.whole)))
        bound.update((fqn, tensor) for fqn in (*lifted.spec.names, *lifted.bind_also))
    return bound, subclasses


def _stored_without_grad(traced: torch.Tensor, layout: Any, stored: torch.Tensor) -> frozenset[str]:
    """The parts of a subclass the module stores without grad though the trace gives them grad."""
    return frozenset(
        name for name, inner in layout.inner
        if inner is None and not getattr(stored, name).requires_grad and getattr(traced, name).requires_grad
    )


def _input_subclasses(prepared: PreparedInputs, args: tuple, kwargs: dict) -> list[tuple]:
    """Each subclass input as the trace builds it, with the parts forward reads detached."""
    if not prepared.subclass_inputs:
        return []
    traced = pytree.tree_leaves((args, kwargs))
    return [(traced[index], names) for index, names in prepared.subclass_inputs]


def _bind_storage_views(prepared: PreparedInputs, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors to bind to the state's names: each input, except that a tensor lying in
    another's memory is a view of that base's input (its own input is left unread)."""
    return tuple(
        lifted.view_of.of(inputs[lifted.view_of.base]) if lifted.view_of else tensor
        for lifted, tensor in zip(prepared.state, inputs)
    )


def _write_storage_views(prepared: PreparedInputs, inputs: tuple[torch.Tensor, ...]) -> None:
    """Give each storage view's own input its new value when forward changed its base: a view
    of the base's new value, so the program writes it back with the base."""
    for lifted, tensor in zip(prepared.state, inputs):
        view = lifted.view_of
        if view is not None and ti.mutated_in_trace(inputs[view.base]):
            ti.set_functional_value(tensor, view.of(inputs[view.base]))


def _split_by_reach(root: torch.nn.Module, bound: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Names whose path runs through submodules only (torch's reparametrize binds them), and
    the others: state of modules outside the tree, tensors in plain containers."""
    inside: dict[str, torch.Tensor] = {}
    beyond: dict[str, torch.Tensor] = {}
    for fqn, tensor in bound.items():
        (inside if in_tree(root, fqn) else beyond)[fqn] = tensor
    return inside, beyond


@contextlib.contextmanager
def _bound_beyond(root: torch.nn.Module, bound: dict[str, torch.Tensor]):
    """Bind state reached outside the registered tree (Note [Modules outside the registered
    tree]): a module's tensors through torch's reparametrize, a container's entry by assignment;
    everything is put back on exit."""
    per_module: dict[int, tuple[torch.nn.Module, dict[str, torch.Tensor]]] = {}
    entries = []
    in_tuples: dict[str, dict[int, torch.Tensor]] = {}
    for fqn, tensor in bound.items():
        owner_path, _, attr = fqn.rpartition(".")
        owner = resolve(root, owner_path)
        if isinstance(owner, torch.nn.Module):
            per_module.setdefault(id(owner), (owner, {}))[1][attr] = tensor
        elif isinstance(owner, tuple):  # immutable: rebuilt with the tensors swapped, on its holder
            in_tuples.setdefault(owner_path, {})[int(attr)] = tensor
        else:
            entries.append((owner, attr, tensor))
    for path, swapped in in_tuples.items():
        old = resolve(root, path)
        items = [swapped.get(i, item) for i, item in enumerate(old)]
        holder_path, _, key = path.rpartition(".")
        entries.append((resolve(root, holder_path), key, type(old)(*items) if hasattr(old, "_fields") else type(old)(items)))
    with contextlib.ExitStack() as stack:
        for module, tensors in per_module.values():
            stack.enter_context(ti.reparametrize(module, tensors))
        for owner, attr, tensor in entries:
            stack.enter_context(_entry_bound(owner, attr, tensor))
        yield


@contextlib.contextmanager
def _entry_bound(owner: Any, attr: str, tensor: torch.Tensor):
    """`owner[attr]` (a list index, a dict key) or `owner.attr` bound to `tensor` for a while."""
    if isinstance(owner, list):
        key: Any = int(attr)
    elif isinstance(owner, dict):
        key = attr if attr in owner else int(attr)
    else:
        key = None
    old = getattr(owner, attr) if key is None else owner[key]
    _put(owner, attr if key is None else key, tensor, key is None)
    try:
        yield
    finally:
        _put(owner, attr if key is None else key, old, key is None)


def _put(owner: Any, key: Any, value: Any, attribute: bool) -> None:
    if attribute:
        object.__setattr__(owner, key, value)
    else:
        owner[key] = value


@contextlib.contextmanager
def _buffer_assignments():
    """Where forward assigns a registered buffer (`self.rel_indices = t` goes through
    `register_buffer`, so torch's global buffer registration hook sees it): `{(id(module),
    name): (module, name, the user's line)}`, the last assignment of each."""
    assigned: dict[tuple[int, str], tuple[torch.nn.Module, str, str | None]] = {}

    def hook(module: torch.nn.Module, name: str, buffer: Any) -> None:
        assigned[(id(module), name)] = (module, name, user_frame())

    handle = torch.nn.modules.module.register_module_buffer_registration_hook(hook)
    try:
        yield assigned
    finally:
        handle.remove()


def _record_reassigned_buffers(prepared: PreparedInputs, state: tuple[torch.Tensor, ...], assigned: dict) -> None:
    """A buffer forward replaced by another tensor (`self.rel_indices = new`) is a mutation of
    that buffer, as in eager (where the module keeps the new tensor): write the new value into
    the buffer's graph input, so the program records it as a buffer mutation.  A replacement of
    another shape, dtype or device, or by None, cannot be written into the buffer: refused.
    """
    if not assigned:
        return
    places = _buffer_places(prepared)
    for module, name, where in assigned.values():
        index = places.get((id(module), name))
        if index is None:  # a buffer forward registered itself: put back by `_isolation`
            continue
        bound, new = state[index], module._buffers.get(name)
        if new is bound:
            continue
        old = prepared.fake_state[index]
        if not isinstance(new, torch.Tensor) or (new.shape, new.dtype, new.device) != (bound.shape, bound.dtype, bound.device):
            now = "None" if new is None else f"{new.dtype} {tuple(new.shape)}"
            raise TraceError(
                f"forward replaces buffer {prepared.state[index].spec.target!r} ({old.dtype} {tuple(old.shape)}) "
                f"by a tensor of another shape, dtype or device ({now}); the program's buffer keeps its "
                "exported shape, so it cannot take the new value.",
                where=where or f"{user_frame()} (the export call)",
                fix="register the buffer with the shape forward gives it (compute it in __init__), or keep "
                "the new tensor in a local variable (or a plain attribute) instead of the buffer.",
            )
        bound.copy_(new.detach() if new.requires_grad else new)


def _buffer_places(prepared: PreparedInputs) -> dict[tuple[int, str], int]:
    """`{(id(owner module), attribute): state index}` of every lifted buffer name (aliases too)."""
    places = {}
    for index, lifted in enumerate(prepared.state):
        if lifted.spec.kind is InputKind.BUFFER:
            for fqn in lifted.spec.names:
                owner, _, attr = fqn.rpartition(".")
                places[(id(resolve(prepared.module, owner)), attr)] = index
    return places


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
    refuse_script_modules(prepared.module)
    program = _Program(prepared, dedup)
    log = DecompositionLog()
    with contextlib.ExitStack() as stack:
        stack.enter_context(ti.interrupts_at_safe_points())  # Ctrl-C raised where torch lets it pass (a no-op under export's)
        stack.enter_context(_no_garbage_collection())
        stack.enter_context(torch.enable_grad())  # the ambient mode regions are relative to
        stack.enter_context(inference_mode_as_grad_mode())  # Note [inference_mode in forward]
        stack.enter_context(refusing_encoder_fast_path())
        stack.enter_context(naming_property_errors())
        stack.enter_context(transforms_below_autograd())  # Note [torch.func in forward]
        stack.enter_context(ti.exporting_flags())
        stack.enter_context(ti.subclass_constructors_unrecorded())  # Note [Tensor subclasses]
        stack.enter_context(ti.subclass_dispatch(guard_plain_gradients))  # Note [Gradients of plain tensors through a subclass]
        stack.enter_context(ti.jagged_constructors_traceable())  # Note [Jagged nested tensors]
        stack.enter_context(ti.flex_attention_index_inline())
        stack.enter_context(_no_backend_heuristics())
        stack.enter_context(
            ti.decomposition_hook(lambda op, default, args, kwargs: policy.should_decompose(op, default, log, args, kwargs))
        )
        rewrites = {**REWRITES, **COLLECTIVE_REWRITES}  # Note [In-place collectives]
        stack.enter_context(ti.functional_rewrites({op: (r.fn, r.skips) for op, r in rewrites.items()}))
        stack.enter_context(ti.meta_kernels(FAST_INPLACE_META))
        stack.enter_context(prepared.fake_mode)
        stack.enter_context(_counted())
        with _user_errors():
            captured = ti.trace_program(
                program, (*prepared.fake_state, *prepared.fake_user_inputs), prepared.module, trace_decompositions()
            )
    _check_engaged(program, captured.graph_module)
    ti.drop_nested_int_guards(prepared.fake_mode.shape_env)  # Note [Jagged nested tensors]
    check_trace_decompositions(captured.graph_module)
    _check_metadata_mutations(prepared, captured, program.input_metadata_write)
    _check_repeated_inputs(prepared, captured.mutated)
    refuse_generators_made_in_forward(captured.graph_module, program.visible_generators)
    refuse_differentiated_captures(prepared, captured.graph_module)  # Note [flex_attention's captured tensors]
    refuse_outside_tensor_uses(captured.graph_module)  # Note [Tensors from outside the module]
    rewrite_as_strided_scatters(captured.graph_module, prepared.fake_mode)  # Note [as_strided_scatter's gradient]
    gm = captured.graph_module
    _remove_effect_tokens(gm)
    program.sharing.fold(gm)  # the fully traced calls of shared blocks call the body too
    gm.graph.eliminate_dead_code()  # what the trace computed and nothing used, as AOTAutograd drops it
    gm.meta["dedup"] = program.sharing.reports  # which blocks were shared, replayed, or why not
    if prepared.dynamic is not None:
        check_constraints(prepared.dynamic, gm)
    output_leaves, out_spec = program.outputs
    return TracedGraph(
        gm, captured.mutated, output_leaves, out_spec, log, program.grad_mode_on_exit, captured.metadata_mutated
    )


def _check_engaged(program: _Program, gm: fx.GraphModule) -> None:
    """The hooks that must have run did run (Note [Drift is loud] in _torch_internals/mechanism.py):
    ops reached the graph through FunctionalTensorMode, so its observer saw them; every grad-mode
    toggle forward made was recorded in the graph, so its region can be rebuilt."""
    assert program.observer is not None and program.keeper is not None  # set by the traced call
    ops = any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and _meta.BELOW_AUTOGRAD not in n.meta
        for n in gm.graph.nodes
    )
    if ops:
        program.observer.expect_calls("the graph holds ops traced through FunctionalTensorMode")
    keeper = program.keeper
    if keeper.toggles_unrecorded:
        raise ti.drift(
            ti.REGION_CAPTURE,
            f"{keeper.toggles_unrecorded} grad-mode change(s) in forward were not recorded in the graph",
        )


def _check_metadata_mutations(prepared: PreparedInputs, captured: ti.ProgramTrace, where: str | None) -> None:
    """Refuse an in-place change of shape, strides or storage the program cannot hand back.

    A user input's new shape and strides are handed back (`USER_INPUT_METADATA_MUTATION`:
    `ep.module()` applies them with `as_strided_`, as AOTAutograd's runtime wrappers do); a
    storage swap (`x.set_(y)`) and a metadata change of lifted state (a buffer's `t_()`) are not.
    """
    n_state = len(prepared.state)
    refused = [i for i in captured.metadata_mutated if i < n_state or i in captured.storage_mutated]
    if refused:
        raise TraceError(
            f"forward changes the shape, strides or storage of {_input_label(prepared, refused[0])} "
            "in place (x.t_(), x.resize_(), x.set_(...)); a functional graph cannot hand that change back "
            "to a parameter or buffer, nor a storage swap to any input.",
            where=where or f"{user_frame()} (the export call)",
            fix="write it out of place (x = x.t()) and return the new tensor.",
        )


@contextlib.contextmanager
def _no_backend_heuristics():
    """Trace with the mkldnn and nnpack backends off, as torch.export does.

    Fake convolution kernels ask which backend eager would pick to learn the output's memory
    format, and CPU's choice of mkldnn tests `batch >= 16`: traced with it on, a dynamic batch
    gets a guard `batch < 16` from that heuristic alone (`Dim(max=64)` refused, "suggested fix:
    max=15").  The graph does not depend on these backends; at run time eager's choice is made
    as usual.  torch.export traces under `_ignore_backend_decomps` for the same reason; unlike
    it, cudnn stays on: `F.layer_norm` and `F.batch_norm` pass `cudnn.enabled` as an argument,
    so turning it off would write `cudnn_enable=False` into every such node.
    """
    with ti.backends_off():
        yield


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

    return bool(node.target is operator.getitem and node.args[0].target is ti.with_effects and node.args[1] == 0)


#: What a graph can return: tensors, and scalars computed from data (`x.sum().item()`, `idx.shape[0]`).
_GRAPH_OUTPUT_TYPES = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool)


_SCALAR_TYPE = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}


def _is_static(value: Any) -> bool:
    """A symbolic scalar that turned out to be a known number is a constant, not a graph output."""
    return isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)) and value.node.expr.is_number


def _output_leaves(out: Any, module: torch.nn.Module) -> tuple[tuple[Leaf, ...], pytree.TreeSpec]:
    """Check and describe the user's return value: graph outputs (tensors, symbolic scalars) and constants.

    Outputs take what inputs take: dataclasses are registered as pytree nodes here as they are
    for inputs (`register_dataclasses`), so `ep.module()` returns eager's types.
    """
    try:
        register_dataclasses(out)
    except Exception as exc:  # noqa: BLE001 - a dataclass pytree cannot describe (init=False fields)
        raise UnsupportedOutputError(
            f"the output is a {type(out).__name__} that cannot be flattened: {exc}",
            where=_return_lines(module),
            fix="return tensors (or tuples/lists/dicts/dataclasses of tensors); register custom "
            "containers with torch.utils._pytree.register_pytree_node.",
        ) from None
    with_path, spec = pytree.tree_flatten_with_path(out)
    leaves = []
    for path, value in with_path:
        label = "output" + pytree.keystr(path)
        if is_subclass(value):  # Note [Tensor subclasses]: returned as its parts
            leaves.append(Leaf(label, True, layout=layout_of(value, label)))
        elif isinstance(value, _GRAPH_OUTPUT_TYPES) and not _is_static(value):
            leaves.append(Leaf(label, True))
        elif _is_static(value):
            leaves.append(Leaf(label, False, _SCALAR_TYPE[type(value)](value)))
        elif isinstance(value, CONSTANT_TYPES):
            leaves.append(Leaf(label, False, value))
        else:
            raise UnsupportedOutputError(
                f"{label} has type {type(value).__name__}, which is neither a tensor nor a constant.",
                where=_return_lines(module),
                fix=hf_cache_fix(value) if is_hf_cache(value) else "return tensors (or tuples/lists/"
                "dicts/dataclasses of tensors); register custom containers with "
                "torch.utils._pytree.register_pytree_node.",
            )
    return tuple(leaves), spec


def _return_lines(module: torch.nn.Module) -> str | None:
    """`file:line (return ...)` of forward's return statement (all of them, joined by "or", when
    forward has several: which one ran is gone with its frame); the export call if no source."""
    fn = inspect.unwrap(getattr(module, "forward"))
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    try:
        lines, first = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return f"{user_frame()} (the export call)"
    body = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else tree
    returns = [n.lineno + first - 1 for n in _own_nodes(body) if isinstance(n, ast.Return)]
    if not returns or code is None:
        return f"{user_frame()} (the export call)"
    return " or ".join(f"{code.co_filename}:{line} ({linecache.getline(code.co_filename, line).strip()})" for line in returns)


def _own_nodes(node: ast.AST):
    """The nodes of a function body, not of functions, lambdas or classes defined inside it."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield from _own_nodes(child)


@contextlib.contextmanager
def _user_errors():
    """Turn torch's tracing failures into predispatch errors that name the user's line.

    Our message is printed alone; torch's exception stays reachable as `err.torch_error`
    (see `errors.from_torch`)."""
    try:
        yield
    except PredispatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - every torch failure is re-raised with context
        where = user_frame(exc.__traceback__) or f"{user_frame()} (the export call; torch found this after tracing)"
        if ti.is_generator_argument_error(exc):
            raise from_torch(
                RngStateError(
                    f"a random op draws from an explicit torch.Generator (generator=...), which torch "
                    f"{torch.__version__}'s FX cannot record in a graph (torch 2.13 and later can).",
                    where=where,
                    fix="draw from the default generator (seed it outside forward), or use torch 2.13 or later.",
                ),
                exc,
            ) from None
        refusal = construct_refusal(exc)
        if refusal is not None:
            raise from_torch(refusal, exc) from None
        if ti.is_numpy_conversion_error(exc) or (_is_data_dependent(exc) and _failed_in_numpy(exc)):
            raise from_torch(_numpy_refusal(where), exc) from None
        if _is_data_dependent(exc):
            raise from_torch(
                torch_check_error(exc, where)
                or DataDependentError(
                    "Python code branches on, or converts, a value inside a tensor, which export "
                    "cannot know (it traces shapes, not values).",
                    where=where,
                    fix=data_dependent_fix(exc),
                ),
                exc,
            ) from None
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise from_torch(
            TraceError(f"tracing failed: {type(exc).__name__}: {first_line}", where=where, fix=_trace_error_fix(exc)),
            exc,
        ) from None


def _failed_in_numpy(exc: BaseException) -> bool:
    """Whether the innermost frame outside torch and predispatch is numpy's: numpy computed on a
    traced value (`np.linspace(0, t.item(), n)`, `np.array(t.tolist())`) and asked for its value."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if is_numpy_file(frame.filename):
            return True
        if is_user_file(frame.filename):
            return False
    return False


def _numpy_refusal(where: str) -> DataDependentError:
    """numpy given a tensor the trace holds (`.numpy()`, `np.asarray(t)`) or its values (`t.item()`,
    `t.tolist()`, which trace as symbols numpy cannot compare): export traces
    fake tensors, which have shapes and no values, and numpy's result could not be a graph op
    anyway (it would be a constant of this one example).  Seen in library code that builds a
    schedule in forward (a diffusers scheduler's `set_timesteps` from a tensor of steps)."""
    return DataDependentError(
        "numpy computing on a traced tensor (.numpy(), np.asarray(t), or numpy given t.item() or t.tolist()) needs its values, "
        "which export does not have: it traces tensors that have shapes but no values, and numpy's result "
        "would not be part of the graph.",
        where=where,
        fix="compute it with torch ops on the tensor (torch.linspace, torch.arange, ... instead of numpy) so it "
        "stays in the graph; or, where the value is a setting rather than data, do the numpy work before "
        "export, outside forward (call scheduler.set_timesteps(n) once, then export: forward reads the result "
        "as a constant).",
    )


#: Words in torch's message of a failed in-place change of shape, strides or storage.
_METADATA_WORDS = ("metadata", "resize", "set_", "as_strided_", "storage", "t_()", "transpose_", "squeeze_")


def _trace_error_fix(exc: Exception) -> str:
    """The fix for a raw torch failure: the advice for in-place metadata changes only where
    torch's message is about one; otherwise where torch's full error is."""
    where = "torch's full error is kept as err.torch_error (traceback.print_exception(err.torch_error))"
    if any(word in str(exc) for word in _METADATA_WORDS):
        return f"an in-place change of an input's shape, strides or storage (x.t_(), x.resize_()): write it out of place; {where}."
    return f"{where}; rewrite the named line with other operations, or report it to predispatch with that error."


def _is_data_dependent(exc: Exception) -> bool:
    chain = [exc, exc.__cause__, exc.__context__]
    return any(isinstance(e, ti.DATA_DEPENDENT_ERRORS) for e in chain)
