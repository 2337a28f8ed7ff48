"""`ProgramModule`: the `fx.GraphModule` `ep.module()` returns, and what it runs around its graph.

The module's generated code (see `unlift.py`) does everything a call needs, so compilers and
graph tools see it whole: pytree in and out, state read from attributes, the write-back step
(`apply_mutations`), captured Functions (`run_autograd_function`).  Two things stay outside the
graph, in hooks, because they inspect Python values rather than compute:

- `_before_call` (forward pre-hook): the input checks (`check_inputs`: structure, constants,
  dtype and shape, dynamic-shape ranges), then the saved-tensor snapshot (`_snapshot_saved`);
- `_after_call` (forward hook, always called): closes the snapshot.

Under Dynamo both hooks step aside (see Note [Checks under torch.compile]).  A program that writes
back holds its module's lock for the whole call, hooks included (Note [Concurrent calls]).

Where later steps plug in: a check of the call goes in `_before_call` after `check_inputs`; a
check of every write target before any write goes at the top of `apply_mutations`; a new kind
of mutation output gets a writer in `_WRITE_BACK` (and, if it writes a user input, a place in
`WRITES_TO_USER_INPUT`).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch import size_expressions
from predispatch.errors import DynamicShapeError, InputMismatchError, SerializationError, user_frame
from predispatch.frontend.reachable import in_tree, resolve
from predispatch.frontend.subclasses import has_own_rules
from predispatch.runtime.call_structure import describe_mismatch
from predispatch.runtime.modes import (
    PT2E_MODE_ATTRIBUTES,
    check_conversion,
    check_mode_switch,
    check_pt2e_mode_switch,
    refuse_copy,
)
from predispatch.signature import InputKind, Leaf, OutputKind, ShapeRecord, SubclassLayout
from predispatch.runtime.writes import (
    PLAIN_TENSOR_TYPES,
    WritePlan,
    apply_metadata_mutation,
    check_write_targets,
    check_write_values,
)

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)

#: Where a function (or nested) export's `module()` keeps the live module it reads state from:
#: an attribute, not a submodule (its children are submodules, as the state_dict shows them).
LIVE_ROOT = "_live_root"
#: The attribute of `ep.module()` reading state named like one of its own attributes (`RootState`).
ROOT_STATE = "__root_state"


@dataclass(frozen=True)
class CallContract:
    """What a call must match, and where its mutations land; plain data, so copies keep it.

    in_spec: pytree spec of `(args, kwargs)` at export.
    input_leaves: every leaf of the call, tensors and constants, in `in_spec` order.
    tensor_meta: for each tensor leaf, its dtype and sizes (None for a symbolic size).
    shapes: the symbols, ranges and derived sizes of a dynamic export.
    writes: per mutation output, the state's fully qualified name, or for a user input its index
        among the call's tensor leaves (for the saved-tensor snapshot).
    arg_names: the exported callable's positional parameter names.
    state: `(target, aliases)` of each lifted tensor, for `state_dict` with hooks.
    write_plans: per mutation output, what eager's in-place op would check of its target
        (`writes.plan_writes`), checked for every target before the graph runs.
    training_flags: the `training` flags at export (`.train()`/`.eval()` to another mode is refused).
    storage_groups: state targets that shared memory at export, one group per base: the graph
        writes each group back consistently, so their overlap is no aliasing of the call.
    state_parts: per entry of `state`, the attribute path of the plain tensor it is inside a
        tensor subclass ("" for a whole tensor): Note [Tensor subclasses] in frontend/subclasses.py.
    subclass_state: the layout each tensor subclass of the state must keep, by target.
    """

    in_spec: pytree.TreeSpec
    input_leaves: tuple[Leaf, ...]
    tensor_meta: tuple[tuple[torch.dtype, tuple[int | None, ...], torch.device], ...]
    shapes: ShapeRecord
    writes: tuple[str | int, ...]
    arg_names: tuple[str, ...]
    state: tuple[tuple[str, tuple[str, ...]], ...]
    write_plans: tuple[WritePlan, ...] = ()
    training_flags: tuple[tuple[str, bool], ...] = ()
    storage_groups: tuple[tuple[str, ...], ...] = ()
    state_parts: tuple[str, ...] = ()
    subclass_state: tuple[tuple[str, SubclassLayout], ...] = ()


class ProgramModule(fx.GraphModule):
    """`ep.module()`: an `fx.GraphModule` with the original calling convention.

    State sits under the original fully qualified names (plain container modules mirror the
    hierarchy), so `state_dict()` keys, tied names included, equal the original module's; for
    a function export the reached modules are the user's own, read at each call.  Tensors the
    graph itself creates are held by `GraphConstant`s, which are neither state nor submodules.
    """

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        """nn.Module's call (hooks, forward), under the module's lock if it writes anything back:
        see Note [Concurrent calls]."""
        lock = None if torch.compiler.is_dynamo_compiling() else _CALL_LOCKS.get(self)
        if lock is None:
            return super()._call_impl(*args, **kwargs)
        with lock:
            return super()._call_impl(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> ProgramModule:
        """A copy with the same kinds of state (fx's own deepcopy re-creates each attribute the
        graph reads as a persistent buffer), sharing only the exported module kept for its
        state_dict hooks."""
        for shared in (self.__dict__.get("_state_dict_owner"), self.call_contract):
            memo[id(shared)] = shared  # the exported module (for its hooks); plain immutable data
        copied = ProgramModule(nn.Module(), fx.Graph())
        memo[id(self)] = copied
        skip = ("_graph", "_code", "_in_spec", "_out_spec", "_call_plan")  # the copy plans its own calls
        copied.__dict__.update(copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in skip}, memo))
        if self in _CALL_LOCKS:
            _CALL_LOCKS[copied] = new_call_lock()  # its own state: calls of the two do not wait for each other
        graph = fx.Graph()
        output, old_output = graph.graph_copy(self.graph, {}, return_output_node=True)
        graph.output(output, type_expr=getattr(old_output, "type", None))
        graph._codegen = self.graph._codegen  # names and pytree specs, never changed in place
        copied.graph = graph  # generates the copy's own code
        keep_class_names(self, copied)
        return copied

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        """Pickling is refused (`refuse_copy`): fx would rebuild a plain GraphModule."""
        refuse_copy()

    def __copy__(self) -> NoReturn:
        refuse_copy()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> ProgramModule:
        """`.to()`, `.double()`, `.cuda()` ...: refused if they change a dtype or device
        (`check_conversion`); one that changes nothing is applied as usual."""
        check_conversion(self, fn)
        return super()._apply(fn, recurse)

    def recompile(self) -> Any:
        """fx's recompile, after which the next call plans itself again from the graph (a tool
        that edited the graph in place calls this; setting `.graph` does too)."""
        self.__dict__.pop("_call_plan", None)  # Note [What a call caches]
        return super().recompile()

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuse PT2E's mode switch, which would change nothing here (`check_pt2e_mode_switch`)."""
        if name in PT2E_MODE_ATTRIBUTES and ti.USER_PRESERVED_ATTRIBUTES in self.__dict__.get("meta", {}):
            check_pt2e_mode_switch(self.call_contract.training_flags, name, value)
        if isinstance(getattr(type(self), name, None), property):  # `graph`: fx's setter, also where
            object.__setattr__(self, name, value)  # state is named `graph` (Note [State named like a GraphModule attribute])
            return
        super().__setattr__(name, value)

    def train(self, mode: bool = True) -> ProgramModule:
        """Refuse a mode the program was not exported in (`.eval()` calls this too); see
        Note [One mode per program] in modes.py."""
        contract = self.meta.get(ti.USER_PRESERVED_ATTRIBUTES, {}).get("call_contract")
        if contract is not None:
            check_mode_switch(contract.training_flags, mode)
        return super().train(mode)

    @property
    def call_contract(self) -> CallContract:
        return self.meta[ti.USER_PRESERVED_ATTRIBUTES]["call_contract"]

    @property
    def positional_names(self) -> tuple[str, ...]:
        """The exported callable's positional parameter names (read by a re-export)."""
        return self.call_contract.arg_names

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """As the exported module's `state_dict()`, its state_dict hooks applied, with our tensors."""
        owner = self.__dict__.get("_state_dict_owner")
        if owner is None:
            return super().state_dict(*args, **kwargs)
        with ti.reparametrize(owner, self._bindings()):
            return owner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As the exported module's `load_state_dict()`, its hooks applied, loading into our tensors."""
        owner = self.__dict__.get("_state_dict_owner")
        if owner is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        with ti.reparametrize(owner, self._bindings()):
            return owner.load_state_dict(state_dict, strict=strict)

    def _bindings(self) -> dict[str, torch.Tensor]:
        """Every fully qualified name of the program's state in the exported module's registered
        tree, bound to this module's tensor (state kept outside the tree, `helpers.0.weight`, is
        not in the exported module's state_dict either)."""
        owner = self.__dict__.get("_state_dict_owner")
        return {
            fqn: getattr(*owner_of(self, target))
            for target, aliases in self.call_contract.state
            for fqn in (target, *aliases)
            if owner is None or in_tree(owner, fqn)
        }


class GraphConstant:
    """A tensor the trace created, read by the graph (`getattr(_constant_x, 'tensor')`).

    Wrapped so that it is neither module state nor a tensor attribute: `state_dict()` keys stay
    the original module's, and re-exporting `ep.module()` keeps it a constant of the graph.
    """

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __repr__(self) -> str:
        return f"GraphConstant({tuple(self.tensor.shape)}, {self.tensor.dtype})"


def keep_class_names(original: nn.Module, copied: nn.Module) -> None:
    """Give each copied subgraph its original's class name, which fx's deepcopy resets to
    "GraphModule": a captured Function's graphs are named after it (`straight_through_fwd_0`)."""
    for (_, a), (_, b) in zip(original.named_modules(), copied.named_modules()):
        if isinstance(b, fx.GraphModule) and b is not copied:
            type(b).__name__ = type(a).__name__


def attach_call_hooks(module: ProgramModule) -> None:
    """Register the input checks and the saved-tensor snapshot around each call; give a program
    that writes back its lock (Note [Concurrent calls])."""
    module.register_forward_pre_hook(_before_call, with_kwargs=True)
    module.register_forward_hook(_after_call, always_call=True)
    if module.call_contract.writes:
        _CALL_LOCKS[module] = new_call_lock()


# Note [Concurrent calls]
# A call reads the state it writes when the graph starts and writes the new values back when it
# ends (`apply_mutations`): two threads calling one module at once would both read the old
# count and both write old + 1, losing an update eager's in-place op keeps (3 threads x 400
# calls of `self.count.add_(1)` kept 487 to 621 of 1200).  So a module whose program writes
# anything back (state or inputs) holds a re-entrant lock of its own for the whole call, from
# before the pre-hook's checks to after the write-back and the forward hooks (`_call_impl`; a
# `with`, so a call that raises, even in a hook, releases it): its calls run one at a time, in
# some order, as eager's would have each applied its updates.  A program that writes nothing
# has no lock, and its calls run concurrently.  Re-entrant, so a call made inside a call of the
# same module (by a hook) does not wait for itself; a re-export traces a call like any other;
# `copy.deepcopy` gives the copy a lock of its own (its own state).  Not covered: two modules over the same
# tensors (`ep.module()` twice, or the model itself, for a module export) do not wait for each
# other, as two eager modules sharing a buffer do not; and under Dynamo the lock steps aside
# like the checks (Note [Checks under torch.compile]: Dynamo cannot trace a lock), so calls of
# `torch.compile(ep.module())` are not serialized, as those of `torch.compile(model)` are not.

#: The lock of each module that writes back (Note [Concurrent calls]); kept here, not as an
#: attribute, whose name a state of the program could take.
_CALL_LOCKS: weakref.WeakKeyDictionary[ProgramModule, Any] = weakref.WeakKeyDictionary()


def new_call_lock() -> Any:
    """A module's call lock (Note [Concurrent calls]); re-entrant, so nested calls pass."""
    return threading.RLock()


# Note [Checks under torch.compile]
# Dynamo compiles a module's hooks with its forward.  The checks read pytree specs, Python
# constants and sympy expressions: tracing them would cost graph breaks, which fullgraph=True
# refuses.  So under Dynamo they step aside, as torch.export's unlifted module does: Dynamo's
# own guards on dtypes, shapes and constants recompile (or, with dynamic shapes, generalise)
# where our checks would refuse.  The saved-tensor snapshot steps aside too: AOTAutograd
# functionalizes the write-back, so the compiled backward never sees a written-back input.


def _before_call(module: ProgramModule, args: tuple, kwargs: dict) -> None:
    if torch.compiler.is_dynamo_compiling():  # Note [Checks under torch.compile]
        return
    plan = module.__dict__.get("_call_plan") or _plan_calls(module)
    tensors = plan.positional(args) if plan.positional is not None and not kwargs else None
    if tensors is None:
        tensors = check_inputs(module.call_contract, args, kwargs)
    inputs = (*plan.read_state(), *tensors)
    targets = [inputs[i] for i in plan.target_at]
    check_write_targets(plan.write_plans, targets, inputs, plan.target_at, plan.shared, module.call_contract.writes)  # before any write
    _open_snapshots().append((module, _keep_saved_values(plan, targets)))


def _keep_saved_values(plan: _CallPlan, targets: list[torch.Tensor]) -> tuple[Any, frozenset[int]]:
    """Enter what keeps backward's copy of each target (Note [Saved inputs that are written
    back]); returns what `_after_call` undoes: the snapshot, and the previous clone-on-read ids."""
    previous = _clone_on_read()
    if not targets or not (plan.enables_grad or torch.is_grad_enabled()):
        _THREAD.clone_on_read = _NOTHING  # autograd saves nothing: no copy at all
        return contextlib.nullcontext(), previous
    wrapped = ti.functorch_active()
    on_read = [t for t, may in zip(targets, plan.may_clone_on_read) if may and _small_plain(ti.memory_of(t) if wrapped else t)]
    watched = [t for t in targets if all(t is not c for c in on_read)]
    snapshot = _snapshot_saved(watched) if watched else contextlib.nullcontext()
    snapshot.__enter__()
    _THREAD.clone_on_read = frozenset(map(id, on_read))
    return snapshot, previous


def _small_plain(t: torch.Tensor) -> bool:
    """A plain contiguous tensor small enough to clone as it is read."""
    return type(t) in PLAIN_TENSOR_TYPES and t.is_contiguous() and t.nbytes <= _CLONE_ON_READ_BYTES


# Note [What a call caches]
# A call's checks read the contract (pytree specs, leaves, write plans), which never change,
# and the module's state, which may (`m.bn = BatchNorm1d(...)`, `load_state_dict(assign=True)`,
# `p.data = ...`).  So `_CallPlan` caches what follows from the contract alone, made at the
# first call: each state path, each write target's position among the graph's inputs, and a
# check of a call made of positional tensors only that gives `check_inputs`' verdict without
# flattening the call.  The state itself, and every tensor's memory, is read again at each call.
# A new graph (`recompile`, which setting `.graph` calls) drops the plan.


@dataclass(frozen=True)
class _CallPlan:
    """What a call's checks need that cannot change between calls (Note [What a call caches]).

    read_state: the module's state tensors now, in `CallContract.state` order.
    target_at: each mutation's target, as its position in `(*state, *user tensors)`.
    write_plans: the contract's `write_plans`.
    positional: for a program called with positional tensors only, a check of such a call that
        returns its tensors (None: anything else, which `check_inputs` checks); None also when
        the program has dynamic shapes or constant inputs.
    enables_grad: the graph turns grad mode on somewhere (a region, a captured Function), so
        autograd may save tensors even in a call made under `torch.no_grad()`.
    may_clone_on_read: per write target, whether only functional ops read it, so that a small
        one may be cloned as it is read (Note [Saved inputs that are written back]).
    shared: state position -> the positions of the state that shared its memory at export
        (`CallContract.storage_groups`): overlaps the graph was traced for.
    """

    read_state: Callable[[], tuple[torch.Tensor, ...]]
    target_at: tuple[int, ...]
    write_plans: tuple[WritePlan, ...]
    positional: Callable[[tuple], list[torch.Tensor] | None] | None
    enables_grad: bool = True
    may_clone_on_read: tuple[bool, ...] = ()
    shared: Mapping[int, frozenset[int]] = field(default_factory=dict)


def _plan_calls(module: ProgramModule) -> _CallPlan:
    """Make and keep the module's `_CallPlan` (a copy of the module makes its own)."""
    contract = module.call_contract
    names = [target for target, _ in contract.state]
    parts = list(contract.state_parts) or [""] * len(names)
    keys = list(zip(names, parts))
    plan = _CallPlan(
        _parts_of_state(_state_reader(module, names), names, parts, dict(contract.subclass_state)),
        tuple(len(names) + w if isinstance(w, int) else keys.index(w if isinstance(w, tuple) else (w, "")) for w in contract.writes),
        contract.write_plans,
        _positional_check(contract),
        _enables_grad(module),
        _read_by_functional_ops(module.graph),
        _shared_positions(names, contract.storage_groups),
    )
    module.__dict__["_call_plan"] = plan
    return plan


def _parts_of_state(
    read: Callable[[], tuple[torch.Tensor, ...]], names: list[str], parts: list[str], layouts: dict[str, SubclassLayout]
) -> Callable[[], tuple[torch.Tensor, ...]]:
    """`read`, with each tensor subclass of the state checked against its layout and replaced by
    the part each position stands for (Note [Tensor subclasses])."""
    if not layouts:
        return read

    def read_parts() -> tuple[torch.Tensor, ...]:
        found = list(read())
        taken: dict[str, dict[str, torch.Tensor]] = {}
        for i, (name, part) in enumerate(zip(names, parts)):
            if part:
                if name not in taken:
                    layout = layouts[name]
                    check_subclass(f"state {name!r}", found[i], layout)
                    taken[name] = dict(zip(layout.paths(), layout.flatten(found[i])))
                found[i] = taken[name][part]
        return tuple(found)

    return read_parts


def _shared_positions(names: list[str], groups: tuple[tuple[str, ...], ...]) -> dict[int, frozenset[int]]:
    """Each grouped state tensor's position -> its group's positions (`_CallPlan.shared`)."""
    shared = {}
    for group in groups:
        positions = frozenset(names.index(name) for name in group if name in names)
        shared.update({p: positions for p in positions})
    return shared


def _enables_grad(module: ProgramModule) -> bool:
    """Whether any graph of the module may run ops with grad mode on whatever the caller's mode:
    a grad-mode region, a grad-mode switch, or a captured Function (its graphs run under
    autograd's own rules)."""
    switches = (ti.wrap_with_set_grad_enabled, torch._C._set_grad_enabled, ti.autograd_function_apply, run_autograd_function)
    return any(
        node.op == "call_function" and node.target in switches
        for gm in module.modules()
        if isinstance(gm, fx.GraphModule)
        for node in gm.graph.nodes
    )


def _read_by_functional_ops(graph: fx.Graph) -> tuple[bool, ...]:
    """Per write target (in `apply_mutations` order), whether every reader of its
    `read_before_write` is an ATen op none of whose outputs may alias an input."""
    writes = graph.find_nodes(op="call_function", target=apply_mutations)
    if not writes:
        return ()
    readers = {node.args[0]: node for node in graph.find_nodes(op="call_function", target=read_before_write)}
    return tuple(target in readers and all(_functional_op(user) for user in readers[target].users) for target in writes[0].args[1])


def _functional_op(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and not any(r.alias_info for r in node.target._schema.returns)


def _state_reader(module: ProgramModule, names: list[str]) -> Callable[[], tuple[torch.Tensor, ...]]:
    """A function reading the state at `names` now, in that order.

    A module export's state sits on the module itself: owners are reached through `_modules`
    (or, for a container outside the registered tree, as plain attributes) and tensors read
    from `_parameters` / `_buffers` (or as attributes), which is what `getattr` finds there,
    without its `nn.Module.__getattr__` per step; each owner is walked once.  A function
    export's state may sit in the user's lists and dicts, which `owner_of` walks."""
    root = module.__dict__.get(LIVE_ROOT)
    if root is not None:
        return lambda: tuple(getattr(*owner_of(root, name)) for name in names)
    by_owner: dict[str, list[tuple[int, str]]] = {}
    for i, name in enumerate(names):
        owner, _, attr = name.rpartition(".")
        by_owner.setdefault(owner, []).append((i, attr))
    owners = [(tuple(owner.split(".")) if owner else (), attrs) for owner, attrs in by_owner.items()]
    held = frozenset(attr for _, attr in by_owner.get("", ()) if root_owner(module, attr) is not module)  # RootState's

    def read() -> tuple[torch.Tensor, ...]:
        found: list[Any] = [None] * len(names)
        for parts, attrs in owners:
            owner: Any = module
            for part in parts:
                child = owner._modules.get(part)
                owner = getattr(owner, part) if child is None else child
            for i, attr in attrs:
                if held and not parts and attr in held:
                    found[i] = getattr(module.__dict__[ROOT_STATE], attr)
                    continue
                value: Any = owner._parameters.get(attr)
                if value is None:
                    value = owner._buffers.get(attr)
                found[i] = getattr(owner, attr) if value is None else value
        return tuple(found)

    return read


def _positional_check(contract: CallContract) -> Callable[[tuple], list[torch.Tensor] | None] | None:
    """For a program exported with positional tensors only and static shapes: a check of a call
    that is such a call (no kwargs, plain tensors), returning its tensors when each has the
    exported dtype, shape and device, None for `check_inputs` to check it (and word the error)."""
    n = len(contract.input_leaves)
    if contract.shapes.is_dynamic or not all(leaf.is_tensor and leaf.layout is None for leaf in contract.input_leaves):
        return None
    if contract.in_spec != pytree.tree_flatten((tuple(range(n)), {}))[1] or None in contract.tensor_meta:
        return None
    if any(None in shape for _, shape, _ in contract.tensor_meta):
        return None
    expected = [(dtype, torch.Size(shape), device) for dtype, shape, device in contract.tensor_meta]

    def check(args: tuple) -> list[torch.Tensor] | None:
        if len(args) != n:
            return None
        for value, (dtype, shape, device) in zip(args, expected):
            if type(value) not in PLAIN_TENSOR_TYPES or value.dtype != dtype or value.shape != shape or value.device != device:
                return None
        return list(args)

    return check


def _after_call(module: ProgramModule, args: tuple, output: Any) -> None:
    """Close this call's snapshot (also when forward raised: the hook is always called)."""
    if torch.compiler.is_dynamo_compiling():  # Note [Checks under torch.compile]
        return
    snapshots = _open_snapshots()
    if snapshots and snapshots[-1][0] is module:  # none if the pre-hook refused the call
        snapshot, previous = snapshots.pop()[1]
        _THREAD.clone_on_read = previous
        snapshot.__exit__(None, None, None)


_THREAD = threading.local()


def _open_snapshots() -> list[tuple[ProgramModule, Any]]:
    """This thread's open snapshots, innermost last (calls nest; threads do not share them)."""
    if not hasattr(_THREAD, "snapshots"):
        _THREAD.snapshots = []
    return _THREAD.snapshots


class RootState:
    """`ep.module()`'s state whose first name is an attribute of the module's own (`code`,
    `graph`, `meta`: Note [State named like a GraphModule attribute]), read by name from the
    module's `_parameters`, `_buffers` and `_modules` (what `nn.Module.__getattr__` reads) and,
    for a plain tensor attribute, from `plain`.  Holds the dicts, not the module, so a deep
    copy of the module copies it along with the dicts it reads."""

    def __init__(self, module: nn.Module, names: frozenset[str]):
        self.names = names
        self.plain: dict[str, Any] = {}
        self.dicts = (module._parameters, module._buffers, module._modules, self.plain)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("__"):
            for found in self.__dict__.get("dicts", ()):
                if name in found:
                    return found[name]
        raise AttributeError(f"ep.module() holds no state named {name!r}")


def root_owner(root: Any, fqn: str) -> Any:
    """What holds `fqn`'s first name: `root`, or its `RootState` where that name is one of
    the module's own attributes."""
    holder = vars(root).get(ROOT_STATE) if isinstance(root, nn.Module) else None
    return holder if holder is not None and fqn.split(".", 1)[0] in holder.names else root


def owner_of(root: nn.Module, fqn: str) -> tuple[Any, str]:
    """The object holding the state at `fqn` and its attribute name there.  The path may run
    outside the registered tree (Note [Modules outside the registered tree]: `helpers.0.weight`,
    `cache.bias`); a list or dict holding the tensor itself is read through `_Entries`."""
    root = root_owner(root, fqn)
    owner, _, attr = fqn.rpartition(".")
    if not owner:
        return root, attr
    found = resolve(root, owner)
    return (_Entries(found) if isinstance(found, (list, tuple, dict)) else found), attr


def read_state(root: Any, fqn: str) -> torch.Tensor:
    """The tensor at `fqn` under `root`, through plain containers too (called from the generated
    code for live state kept outside the registered tree)."""
    return getattr(*owner_of(root, fqn))


class _Entries:
    """A list's or dict's entries as attributes (`getattr(_Entries(cache), "bias")`), so state
    kept in a plain container is read like state kept on a module."""

    def __init__(self, container: list | tuple | dict):
        self._container = container

    def __getattr__(self, name: str) -> Any:
        return resolve(self._container, name)


# --- the input checks --------------------------------------------------------------------------


def check_inputs(contract: CallContract, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor leaves of the call, after checking it matches the exported call."""
    args, kwargs = _as_exported_call(contract, args, kwargs)
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec != contract.in_spec:
        raise InputMismatchError(
            describe_mismatch(contract.in_spec, spec, contract.arg_names),
            where=user_frame(),
            fix="call it with the same structure of args and kwargs as at export, or export again.",
        )
    tensors, paths = [], []
    examples = iter(contract.tensor_meta)
    for leaf, value in zip(contract.input_leaves, flat):
        if leaf.layout is not None:  # Note [Tensor subclasses]: the program takes its parts
            check_subclass(f"input {leaf.path!r}", value, leaf.layout)
            for path, part in zip(leaf.layout.paths(), leaf.layout.flatten(value)):
                _check_tensor(f"{leaf.path}.{path}", part, next(examples), part=leaf.layout.sized_by_parts)
                tensors.append(part)
                paths.append(f"{leaf.path}.{path}")
        elif leaf.is_tensor:
            _check_tensor(leaf.path, value, next(examples))
            tensors.append(value)
            paths.append(leaf.path)
        elif type(value) is not type(leaf.value) or (value is not leaf.value and value != leaf.value):
            raise InputMismatchError(
                f"input {leaf.path!r} was {leaf.value!r} at export and is {value!r} now; "
                "constants are baked into the program.",
                where=user_frame(),
                fix="call with the exported value, or export again with this one.",
            )
    if contract.shapes.is_dynamic:  # a jagged nested tensor's parts have symbols too
        _check_symbols(contract.shapes, paths, tensors)
    return tensors


def _as_exported_call(contract: CallContract, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Arrange a call as the exported one was, where eager would accept it just the same.

    Keyword arguments in another order are put in the exported order; an argument exported
    positionally and passed by its name goes back to its position; an argument exported by
    name and passed positionally gets its name when that is unambiguous (one such argument).
    Anything else is left as it is, and the structure check that follows refuses it.
    """
    exported_args, exported_kwargs = contract.in_spec.children()
    n_args, names = exported_args.num_children, list(exported_kwargs.context or ())
    args, kwargs = tuple(args), dict(kwargs)
    positional = list(contract.arg_names)
    while len(args) < n_args and len(args) < len(positional) and positional[len(args)] in kwargs:
        args = (*args, kwargs.pop(positional[len(args)]))
    missing = [name for name in names if name not in kwargs]
    if len(args) == n_args + 1 and len(missing) == 1:
        kwargs[missing[0]] = args[-1]
        args = args[:-1]
    if set(kwargs) == set(names):
        kwargs = {name: kwargs[name] for name in names}
    return args, kwargs


def tensor_meta(example: Any) -> tuple[torch.dtype, tuple[int | None, ...], torch.device] | None:
    """A placeholder's dtype, sizes (symbolic ones as None) and device: what `_check_tensor` compares."""
    if not isinstance(example, torch.Tensor):
        return None
    return example.dtype, tuple(s if isinstance(s, int) else None for s in example.shape), example.device


def _check_symbols(shapes: ShapeRecord, paths: list[str], tensors: list[torch.Tensor]) -> None:
    """Bind each symbol to the size it has in this call; check equal symbols, ranges, expressions
    (evaluated on the size grammar's parse with Python ints: no text reaches sympy, whose
    `sympify` would read a symbol named `N` or `oo` as its own)."""
    bound: dict[str, int] = {}
    first: dict[str, str] = {}  # symbol -> the input dimension that bound it, as `x.shape[0]`
    derived = []
    for path, tensor, dims in zip(paths, tensors, shapes.input_shapes):
        for i, (dim, size) in enumerate(zip(dims, tensor.shape)):
            if isinstance(dim, str) and dim.isidentifier():
                first.setdefault(dim, f"{path}.shape[{i}]")
                if bound.setdefault(dim, size) != size:
                    _shape_error(f"{path}.shape[{i}] is {size} but {dim} is {bound[dim]} from an earlier input")
            elif isinstance(dim, str):
                derived.append((path, i, dim, size))
    dim_names = dict(shapes.names)
    for name, lo, hi in shapes.ranges:
        if name in bound and not (lo <= bound[name] and (hi is None or bound[name] <= hi)):
            words, span = _symbol_words(name, dim_names), f"[{lo}, {'inf' if hi is None else hi}]"
            _shape_error(f"{first[name]} is {bound[name]}, outside the range {span} of {words}",
                         fix=f"call with {first[name]} in {span}, or export again with a range for {words} "
                         f"that holds {bound[name]}.")
    for path, i, expr, size in derived:
        value = size_expressions.evaluate(size_expressions.parse(expr, "signature shapes"), bound)
        if value != size:
            _shape_error(f"{path}.shape[{i}] is {size} but must equal {expr} = {value}")
    for guard in shapes.guards:
        held = _holds(guard, bound)
        if held is False:
            values = ", ".join(f"{name} = {bound[name]}" for name in sorted(bound) if name in guard)
            _shape_error(f"the program was traced for {guard}, which is false for {values}")


def _symbol_words(symbol: str, dim_names: dict[str, str]) -> str:
    """A size symbol as the user knows it: the `Dim`'s name they gave (`Dim 'seq'`), with torch's
    symbol for reading print(ep); torch's symbol alone for a dimension no named `Dim` made."""
    if symbol in dim_names:
        return f"Dim {dim_names[symbol]!r} ({symbol} in print(ep))"
    return symbol


def _holds(guard: str, bound: dict[str, int]) -> bool | None:
    """Whether a guard the trace recorded holds for this call's sizes, read with the size
    grammar (never sympy: a loaded file's text); None when it cannot be told here (a run-time
    assert on data, a guard outside the grammar, a symbol no input size binds)."""
    if guard.startswith("runtime: "):
        return None
    try:
        relation = size_expressions.parse(guard, "signature shapes guards", relation=True)
    except SerializationError:
        return None
    if not relation.names <= bound.keys():
        return None
    return size_expressions.holds(relation, bound)


def _shape_error(what: str, fix: str = "call with sizes inside the ranges print(ep) shows, or export again "
                 "with wider dynamic_shapes.") -> None:
    raise DynamicShapeError(f"this call's shapes do not fit the program: {what}.", where=user_frame(), fix=fix)


def _check_tensor(
    path: str, value: Any, example: tuple[torch.dtype, tuple[int | None, ...], torch.device] | None, *, part: bool = False
) -> None:
    """Refuse a tensor unlike the exported one; `part`: it is a part of a subclass whose class
    computes its size from its parts (a jagged nested tensor's offsets), whose dimensions are
    dynamic where torch.compile's marks say (Note [Jagged nested tensors])."""
    if not isinstance(value, torch.Tensor):
        raise InputMismatchError(
            f"input {path!r} was a tensor at export and has type {type(value).__name__} now.", where=user_frame()
        )
    if has_own_rules(value):  # eager would run its rules; the graph computes plain ops
        raise InputMismatchError(
            f"input {path!r} was a plain tensor at export and is a {type(value).__module__}.{type(value).__qualname__} "
            "now, a tensor subclass with rules of its own (__torch_function__/__torch_dispatch__): eager would run "
            "them, the program's graph computes plain ops.",
            where=user_frame(),
            fix="pass the plain tensor, or export with the subclass (a traceable one, with __tensor_flatten__, is "
            "taken apart and its rules traced: docs/subclasses.md).",
        )
    if example is None:
        return
    dtype, shape, device = example
    if value.device != device and not ti.is_traced_tensor(value):
        raise InputMismatchError(
            f"input {path!r} was on {device} at export and is on {value.device} now; the "
            "program's state and the devices in its graph are those of the export.",
            where=user_frame(),
            fix=f"move the input: x.to({str(device)!r}), or export again with inputs on {value.device}.",
        )
    wrong_rank = value.dim() != len(shape)
    if value.dtype != dtype or wrong_rank or any(e is not None and a != e for a, e in zip(value.shape, shape)):
        exported = tuple("?" if s is None else s for s in shape)
        changed = next((i for i, (a, e) in enumerate(zip(value.shape, shape)) if e is not None and a != e), 0)
        mark = f"torch._dynamo.mark_dynamic({path}, {changed}) before export" if part else "mark the dimension dynamic"
        raise InputMismatchError(
            f"input {path!r} was exported as {dtype} {exported} and is {value.dtype} {tuple(value.shape)} now.".replace("'?'", "?"),
            where=user_frame(),
            fix=f"call with the exported shape and dtype, export again, or {mark}.",
        )


def check_subclass(what: str, value: Any, layout: SubclassLayout) -> None:
    """Refuse a tensor subclass (an input, or the module's state) unlike the one traced: the
    program computes on the parts of that class, for that flatten context and size."""
    why = layout.mismatch(value)
    if why is not None:
        raise InputMismatchError(
            f"{what} was a {layout} at export and is {why} now; the program was traced through that "
            "class's own rules for that layout.",
            where=user_frame(),
            fix="pass (or keep in the module) a tensor of the exported class and layout, or export again with this one.",
        )


# --- tensor subclasses in the generated code (Note [Tensor subclasses]) -------------------------


def subclass_parts(t: torch.Tensor, layout: SubclassLayout) -> tuple[torch.Tensor, ...]:
    """The plain tensors of a subclass state tensor or input, for the graph.  Where a gradient
    must reach the subclass (it requires grad, grad mode on), through `_TakeApart`, whose backward
    builds the subclass's gradient from its parts' gradients, as eager's autograd would give it."""
    if torch.is_grad_enabled() and t.requires_grad:
        own = layout.flatten(t)  # a part that cannot have a gradient stays itself (a jagged tensor's offsets
        # carry its nested int: the output built from them must have the input's jagged dimension)
        return tuple(p if _differentiable(p) else q for p, q in zip(_TakeApart.apply(layout, t), own))
    return tuple(layout.flatten(t))


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def subclass_of(layout: SubclassLayout, *parts: torch.Tensor) -> torch.Tensor:
    """A subclass output built from the graph's parts; through `_Assemble` where a gradient must
    flow back into the parts."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
        return _Assemble.apply(layout, *parts)
    return _rebuilt(layout, parts)


def _rebuilt(layout: SubclassLayout, parts: Any) -> torch.Tensor:
    """`layout.unflatten(parts)`; under a trace (a re-export of `ep.module()`), with the symbolic
    size arithmetic of a jagged tensor's nested int traced lazily (Note [Jagged nested tensors])."""
    with ti.lazy_symbolic_sizes():
        return layout.unflatten(parts)


class _TakeApart(torch.autograd.Function):
    """A subclass into its parts (views, so the subclass's own tensors keep no autograd history)."""

    @staticmethod
    def forward(ctx: Any, layout: SubclassLayout, t: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        parts = layout.flatten(t)
        ctx.layout = layout
        ctx.parts = [(p.shape, p.dtype, p.device) for p in parts]
        ctx.own = [None if _differentiable(p) else p for p in parts]
        return tuple(part.view_as(part) for part in parts)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        if all(g is None for g in grads):
            return None, None
        # a floating part no gradient reached has a zero gradient; a part that cannot have one (a
        # jagged tensor's offsets, an integer `qdata`) is the subclass's own, as eager's gradient of
        # a jagged tensor has its offsets
        full = [
            own if own is not None else g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, own, (shape, dtype, device) in zip(grads, ctx.own, ctx.parts)
        ]
        return None, _rebuilt(ctx.layout, full)


class _Assemble(torch.autograd.Function):
    """Parts into a subclass output; its gradient is taken apart into the parts' gradients."""

    @staticmethod
    def forward(ctx: Any, layout: SubclassLayout, *parts: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.layout = layout
        return _rebuilt(layout, parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        layout = ctx.layout
        if layout.mismatch(grad) is None:
            return (None, *layout.flatten(grad))
        raise InputMismatchError(
            f"the gradient of a {layout} output is a {type(grad).__name__} of another layout; the program "
            "can only take apart a gradient of the output's own layout.",
            where=user_frame(),
            fix="compute the loss from the subclass output with the subclass's own ops, as in eager.",
        )


# --- the write-back step (called from the generated code) --------------------------------------


# Note [Saved inputs that are written back]
# The graph reads a buffer (or a mutated input), autograd may save it for backward, and the
# write-back then changes it in place: backward would see a bumped version (an error) or, with
# the version hidden, the new values (a wrong gradient).  So backward must get a copy of the
# value the graph read.  Three ways, one per call and target:
# - under Dynamo, the ops read a clone (`read_before_write`); AOTAutograd then saves the value
#   the graph read, and the compiled write-back leaves it alone;
# - eagerly, a small target (at most `_CLONE_ON_READ_BYTES`) whose readers are all functional
#   ops (no output of theirs aliases it) is cloned as the graph reads it: one small copy is
#   cheaper than watching every tensor autograd saves, and no result can alias the copy;
# - eagerly, any other target is cloned only if autograd saves it (`_snapshot_saved`, saved-tensor
#   hooks over the whole call), so a large buffer (a KV cache) is never copied for nothing.
# When grad mode is off and the graph never turns it on, autograd saves nothing: no copy at all.


#: The largest target cloned as it is read (Note [Saved inputs that are written back]).
_CLONE_ON_READ_BYTES = 1 << 16


def read_before_write(target: torch.Tensor) -> torch.Tensor:
    """What the ops read of a tensor written back later; see Note [Saved inputs that are written back]."""
    if torch.compiler.is_dynamo_compiling():
        return target.clone()
    if id(target) in _clone_on_read():
        return target.clone()
    return target


def _clone_on_read() -> frozenset[int]:
    """The ids of the targets this thread's running call clones as the graph reads them."""
    return getattr(_THREAD, "clone_on_read", _NOTHING)


_NOTHING: frozenset[int] = frozenset()


@fx.node.has_side_effect  # FX's dead-code elimination keeps it, though nothing reads its result
def apply_mutations(writers: tuple[str, ...], targets: tuple[torch.Tensor, ...], values: tuple[torch.Tensor, ...]) -> None:
    """Write every mutation back, after the graph computed all of them.

    One call in the generated code for all of a call's mutations (`writers` are keys of
    `_WRITE_BACK`, strings so the generated code can hold them; `writer_of` picks them).  The
    targets were checked before the graph ran (`_before_call`), so no write here can fail
    half-way; what only the values tell (`check_write_values`) is checked before the first write.
    """
    if not torch.compiler.is_dynamo_compiling():
        calls = _open_snapshots()
        if calls:  # the running call's: its plans and names word an error
            module = calls[-1][0]
            check_write_values(targets, values, module.call_contract.write_plans, module.call_contract.writes)
        else:
            check_write_values(targets, values)
    for writer, target, value in zip(writers, targets, values):
        _WRITE_BACK[writer](target, value)


def writer_of(plan: WritePlan) -> str:
    """How one mutation output is written back: its `_WRITE_BACK` key."""
    if not plan.metadata:
        return "copy"
    return "restride_and_copy" if plan.writes_data else "restride"


def _write_back(target: torch.Tensor, value: torch.Tensor) -> None:
    """Apply a mutation as eager would: in place, autograd-visible unless the target is a leaf."""
    if target.is_leaf and target.requires_grad:
        with torch.no_grad():
            target.copy_(value)
    else:
        target.copy_(value)


#: Mutation kinds whose target is a user input (named by its placeholder), not state (by FQN).
WRITES_TO_USER_INPUT = frozenset({OutputKind.USER_INPUT_MUTATION, OutputKind.USER_INPUT_METADATA_MUTATION})

#: How a mutation output is written back (`writer_of` picks the key): new data with `copy_`;
#: a new shape, stride or offset with `as_strided_` as AOTAutograd's runtime wrappers do, and
#: then the data when forward wrote that too.
_WRITE_BACK = {
    "copy": _write_back,
    "restride": lambda target, value: apply_metadata_mutation(target, value, False),
    "restride_and_copy": lambda target, value: apply_metadata_mutation(target, value, True),
}


def _snapshot_saved(targets: list[torch.Tensor]):
    """Autograd saves what the graph read; clone it when it is about to be written back.

    Eager updates such inputs inside the kernel (batch norm's running stats) or after saving
    nothing of them; the program reads them, may save them for backward, and then writes the
    new values back in place, which would bump the saved tensors' versions.  Saving a copy of
    exactly those tensors keeps backward's view of the values the graph read.
    """
    memories = [ti.memory_of(t) for t in targets]  # under torch.func: Note [Calls under torch.func] in writes.py
    if not targets or any(type(t) not in PLAIN_TENSOR_TYPES for t in memories):
        return contextlib.nullcontext()  # nothing written, or being traced (a re-export)
    storages = {t.untyped_storage().data_ptr() for t in memories}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if type(memory := ti.memory_of(t)) in PLAIN_TENSOR_TYPES and memory.untyped_storage().data_ptr() in storages:
            return t.clone()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


# --- captured autograd.Functions (called from the generated code) ------------------------------

# Note [Captured Functions under Dynamo]
# A captured Function (or backward hook) is torch's `autograd_function_apply` over a pair of
# graphs.  Run eagerly, or traced again by predispatch (a re-export, a nested export), the
# generated code calls that op itself: its eager implementation is a real autograd.Function, and
# predispatch's trace recognises it and captures the pair unchanged.  Dynamo has no handler for
# the op called directly, but traces user autograd.Functions, backward included, into its joint
# graph; so under Dynamo the same pair runs as such a Function (`dynamo_function`, made once
# per pair when the module is built, attached to the forward graph).  Same graphs, same saved
# values, same non-differentiable outputs: the two paths compute the same thing.


def run_autograd_function(fwd: fx.GraphModule, bwd: fx.GraphModule, *operands: Any, **attrs: Any) -> Any:
    """One captured Function call; see Note [Captured Functions under Dynamo]."""
    if torch.compiler.is_dynamo_compiling():
        return fwd.dynamo_function.apply(*operands)
    return ti.autograd_function_apply(fwd, bwd, *operands, **attrs)


def dynamo_function(fwd: fx.GraphModule, bwd: fx.GraphModule, non_differentiable: tuple[int, ...], name: str) -> type:
    """The pair of graphs as an autograd.Function Dynamo traces, backward included.

    Saved tensors go through `save_for_backward` (autograd's bookkeeping, no reference cycle);
    saved non-tensors (None) are kept on ctx.
    """

    class CapturedFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            output, saved = fwd(*args)
            outputs = output if isinstance(output, tuple) else (output,)
            tensor_at = [i for i, v in enumerate(saved) if isinstance(v, torch.Tensor)]
            ctx.save_for_backward(*(saved[i] for i in tensor_at))
            ctx.layout = (len(saved), tuple(tensor_at), tuple(None if isinstance(v, torch.Tensor) else v for v in saved))
            if non_differentiable:
                ctx.mark_non_differentiable(*(outputs[i] for i in non_differentiable))
            return output

        @staticmethod
        def backward(ctx: Any, *grads: Any) -> Any:
            count, tensor_at, others = ctx.layout
            saved = list(others)
            for i, t in zip(tensor_at, ctx.saved_tensors):
                saved[i] = t
            return bwd(*grads, *saved)

    CapturedFunction.__name__ = CapturedFunction.__qualname__ = name
    return CapturedFunction
