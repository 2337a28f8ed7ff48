"""`share_repeated_blocks`: while the trace runs, repeated blocks are traced twice, then replayed.

Note [Sharing repeated blocks]
------------------------------
Every submodule call the trace meets passes through `_Sharing.call` (make_fx's module-stack
tracer hands it over, `ti.intercept_module_calls`).  A call is a candidate when its module is not
a leaf and either at least two other modules in the tree have the same class and state shapes
(`MIN_INSTANCES`), or the module was called before (one layer applied many times).  A candidate's key has two parts:

- static, computed before the call (`_describe`): class and forward code, the classes of its
  submodules, each parameter's, buffer's and tensor attribute's metadata (shape, stride, dtype,
  device, requires_grad; not values), which operands are the same tensor, the module hooks and
  global hooks (by identity), grad mode, inference mode and autocast state, the training flags,
  and the input structure with each tensor input's metadata and each other input's value;
- dynamic: the Python attributes the forward read in its first traced call, with their values
  (reads.py).  A later call matches when re-reading those paths on its module gives the same values.

The first two calls of a key are traced in full, inline, as without sharing, each recorded as
a run of nodes (body.py).  If the two runs are the same node for node (ops, arguments, results'
metadata, constants), every later call of the key is one `invoke_subgraph` node on the first
run's nodes copied into a subgraph (replay.py), and after the trace the two runs traced in full
are folded into calls of that body too (fold.py), so every call is one node; if they differ,
the key is never shared and its calls are traced inline.  Not shared either, with the reason
kept in the report: a forward that writes Python attributes, changes a tensor that requires
grad in place, returns two views of one tensor or a view of its input or state, has forward
hooks with visible Python side effects, reads a traced value that is neither its input nor its
state, or has backward hooks inside.  The decomposition policy is one per export: every body
of an export is traced under the same one.

`dedup="verify"` records every call instead and raises `DedupVerificationError` if one differs
from its key's first call; every call is then folded, so the program is the one `dedup=True` gives.

Note [What the key cannot see]
------------------------------
A forward that reads something the instrumentation does not observe (a module-level global, a
value reached through `obj.__dict__[...]`, a mutation of a list held by the module) can change
between calls without changing the key.  If it changes between the first and second call of a
key, the comparison sees different graphs and the key is not shared; if it changes only later,
the replay repeats the first call's graph.  tests/test_dedup.py::test_global_read_after_second_call
shows that case, and `dedup="verify"` (or `dedup=False`) catches or avoids it.
"""

from __future__ import annotations

import contextlib
import functools
import enum
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch.errors import DedupVerificationError, user_frame
from predispatch.frontend.reachable import is_filled
from predispatch.trace.dedup.body import NotClosed, extract, find_region, first_difference, named
from predispatch.trace.dedup.fold import CallSite, fold_traced_calls, node_module_stack
from predispatch.trace.dedup.reads import _PLAIN, matches, recording_reads, snapshot
from predispatch.custom_backward.hooks.inspection import side_effect
from predispatch.trace.dedup.replay import BODY_OUTPUT, PassThrough, SharedBody, replay_call

#: Bodies with fewer ops than this are inlined, and so are the later calls of modules like
#: them (`_Sharing.declined`): a replay costs about what tracing five ops costs (one HOP node
#: through the trace's modes, a fake output per result), and keying and recording the first
#: two calls cost more, so a small block (timm's BatchNormAct2d: 6 ops, replayed in 2.4 ms,
#: traced in 3 ms) made the export slower; a 21-op MobileNet block replays in 5 ms of its 17.
MIN_BODY_OPS = 12

#: Modules of a kind with fewer instances than this are not candidates: the first two calls of a
#: key are traced in full anyway, so a pair (a 2-layer model) would pay for recording and
#: comparing and replay nothing.
MIN_INSTANCES = 3


class Dedup(enum.Enum):
    """How export treats repeated blocks (`export(..., dedup=...)`)."""

    OFF = False  # trace every call inline
    ON = True  # trace the first two calls of a key, compare, replay the rest
    VERIFY = "verify"  # trace every call and check it against its key's first call

    @classmethod
    def from_user(cls, value: Any) -> Dedup:
        for member in cls:
            if value is member or (type(value) is type(member.value) and value == member.value):
                return member
        raise ValueError(f"dedup must be one of True, False or 'verify', not {value!r}.")


@dataclass
class BlockReport:
    """What happened to one key: its module class, the module paths of its calls, which calls
    were replayed, and why it was not shared (None when it was)."""

    module_class: str
    calls: list[str] = field(default_factory=list)
    replayed: list[str] = field(default_factory=list)
    not_shared: str | None = None


class _NoShare(Exception):
    """This call cannot be shared; the message says why."""


class _TooSmall(_NoShare):
    """The body is below `MIN_BODY_OPS`: modules like this one are not keyed again."""


@dataclass
class _Recorded:
    """A call traced in full: its body and what replays need to rebuild the call's result."""

    body: fx.GraphModule
    used: tuple[int, ...]
    outputs: tuple[tuple, ...]
    out_leaves: tuple[Any, ...]  # BODY_OUTPUT where a body output goes, a PassThrough for an operand returned, else the constant
    out_spec: pytree.TreeSpec
    mutated: tuple[int, ...]
    symbols: tuple[Any, ...] = ()  # symbolic sizes the body takes after the operands
    site: CallSite | None = None  # where in the outer graph the call was traced (fold.py)


@dataclass
class _Entry:
    """One key: the static part, the recorded reads, the first call and, once compared, the body."""

    reads: dict
    first: _Recorded
    report: BlockReport
    shared: SharedBody | None = None
    compared: bool = False
    traced: list[_Recorded] = field(default_factory=list)  # calls traced in full that compared equal


def _unobserved(fn):
    """Run `fn` (keying, recording and comparing calls: reads of tensor metadata, no ops) with
    torch-function modes off (`ti.torch_function_disabled`): a ResNet's export made ~4000 such
    reads, each a trip through the trace's mode stack, and each left torch's `torch_fn` metadata
    naming the read on the next node (a difference from `dedup=False`)."""

    @functools.wraps(fn)
    def unobserved(*args, **kwargs):
        with ti.torch_function_disabled():
            return fn(*args, **kwargs)

    return unobserved


class _Sharing:
    """The state of one export's sharing (see Note [Sharing repeated blocks])."""

    def __init__(self, root: nn.Module, mode: Dedup):
        self.root, self.mode = root, mode
        self.signatures, self.repeated = _repeated_modules(root)
        self.declined: dict[Any, BlockReport] = {}  # signature -> the report of its too-small body
        self.called: set[int] = set()
        self.entries: dict[Any, list[_Entry]] = {}
        self.bodies = 0  # entries shared so far: the next body's number
        self.recording = 0
        self.reports: list[BlockReport] = []
        self.refused: dict[tuple[type, str], BlockReport] = {}
        self.paths = {id(m): name for name, m in root.named_modules(remove_duplicate=False)}

    def call(self, module: nn.Module, run, args: tuple, kwargs: dict) -> Any:
        if self.recording or not self._candidate(module):
            return run(*args, **kwargs)
        declined = self.declined.get(self.signatures.get(id(module)))
        if declined is not None:
            declined.calls.append(self._path(module))
            return run(*args, **kwargs)
        try:
            static, operands, labels = _describe(module, args, kwargs)
        except _NoShare as exc:
            self._refused(module, str(exc))
            return run(*args, **kwargs)
        entry = self._matching(static, module)
        path = self._path(module)
        if entry is not None and entry.shared is not None and self.mode is Dedup.ON:
            entry.report.calls.append(path)
            entry.report.replayed.append(path)
            return replay_call(entry.shared, entry.first, operands)
        if entry is not None and entry.report.not_shared is not None:
            entry.report.calls.append(path)
            return run(*args, **kwargs)
        out, recorded, reads, refusal = self._record(module, run, args, kwargs, operands, labels)
        reason = None if refusal is None else str(refusal)
        if entry is None:
            report = BlockReport(type(module).__qualname__, [path], not_shared=reason)
            self.reports.append(report)
            if isinstance(refusal, _TooSmall) and id(module) in self.signatures:
                self.declined[self.signatures[id(module)]] = report
                return out
            if recorded is not None or reason is not None:
                self.entries.setdefault(static, []).append(_Entry(reads, recorded, report))
            return out
        entry.report.calls.append(path)
        self._compare(entry, recorded, reads, reason, path)
        return out

    @_unobserved
    def _matching(self, static: Any, module: nn.Module) -> _Entry | None:
        """The entry of `static` whose recorded reads give the same values on `module`, if any."""
        return next((e for e in self.entries.get(static, ()) if matches(e.reads, module)), None)

    def fold(self, gm: fx.GraphModule) -> None:
        """After the trace: the calls of shared keys traced in full become `invoke_subgraph`
        calls too (fold.py), so every call of a shared body is one node."""
        replaced: dict[fx.Node, fx.Node] = {}
        alive = set(gm.graph.nodes)  # once for all keys: each fold takes out the nodes it erases
        for entries in self.entries.values():
            for entry in entries:
                if entry.shared is not None:
                    fold_traced_calls(gm, entry.shared.body, entry.shared.name, [r.site for r in entry.traced], replaced, alive)

    def _refused(self, module: nn.Module, reason: str) -> None:
        """Report a call that could not even be keyed, once per class and reason."""
        key = (type(module), reason)
        if key not in self.refused:
            self.refused[key] = BlockReport(type(module).__qualname__, not_shared=reason)
            self.reports.append(self.refused[key])
        self.refused[key].calls.append(self._path(module))

    def _candidate(self, module: nn.Module) -> bool:
        if module is self.root or not any(True for _ in module.children()):
            return False
        seen = id(module) in self.called
        self.called.add(id(module))
        return seen or id(module) in self.repeated

    def _path(self, module: nn.Module) -> str:
        return self.paths.get(id(module), type(module).__qualname__)

    def _record(self, module, run, args, kwargs, operands, labels):
        """Trace one call in full, recording its reads and its run of nodes."""
        tracer = ti.current_tracer()
        operand_nodes = [ti.traced_node(t, tracer) for t in operands]
        counts = [ti.mutation_count(t) for t in operands]
        start = next(iter(reversed(tracer.graph.nodes)))
        self.recording += 1
        try:
            with recording_reads(module, operands) as log:
                out = run(*args, **kwargs)
        finally:
            self.recording -= 1
        end = next(iter(reversed(tracer.graph.nodes)))
        try:
            recorded = _recorded(module, tracer, log, out, operands, operand_nodes, counts, labels, start, end)
        except (_NoShare, NotClosed) as exc:  # the refusal itself: `call` tells a too-small body by its class
            return out, None, dict(log.reads), exc
        return out, recorded, dict(log.reads), None

    @_unobserved
    def _compare(self, entry: _Entry, recorded: _Recorded | None, reads: dict, reason: str | None, path: str) -> None:
        """The second call (or, verifying, any later one) against the first."""
        first = entry.first
        difference = reason or (
            "the forward read different attributes" if reads != entry.reads else first_difference(first.body, recorded.body)
        )
        if difference is None and (recorded.out_leaves, recorded.out_spec, recorded.mutated) != (
            first.out_leaves, first.out_spec, first.mutated
        ):
            difference = "the calls return different structures or change different tensors"
        if difference is not None:
            if self.mode is Dedup.VERIFY and entry.compared:
                raise DedupVerificationError(
                    f"the call of {path} differs from the shared body of {entry.report.calls[0]}: {difference}.",
                    where=user_frame(),
                    fix="export with dedup=False, and report the module: its key misses what makes the calls differ.",
                )
            entry.report.not_shared = f"{path} differs from {entry.report.calls[0]}: {difference}"
            return
        entry.compared = True
        entry.traced += [first, recorded] if not entry.traced else [recorded]
        if entry.shared is None:
            name = f"repeated_body_{self.bodies}"
            self.bodies += 1
            entry.shared = SharedBody(named(first.body, name), name, first.outputs)


@_unobserved
def _recorded(module, tracer, log, out, operands, operand_nodes, counts, labels, start, end) -> _Recorded:
    """Check a recorded call can be replayed and copy its run of nodes into a body."""
    if log.unkeyable:
        raise _NoShare(log.unkeyable)
    if log.writes:
        raise _NoShare(f"the forward sets the Python attribute {'.'.join(log.writes[0])}")
    mutated = tuple(i for i, t in enumerate(operands) if ti.mutation_count(t) != counts[i])
    if any(operands[i].requires_grad for i in mutated):
        raise _NoShare("the forward changes a tensor that requires grad in place")
    leaves, spec = pytree.tree_flatten(out)
    operand_at = {id(t): i for i, t in reversed(list(enumerate(operands)))}
    tensors = [x for x in leaves if isinstance(x, torch.Tensor) and id(x) not in operand_at]
    for x in leaves:
        if not isinstance(x, torch.Tensor) and not isinstance(x, _PLAIN):
            raise _NoShare(f"the forward returns a {type(x).__name__}")
        if isinstance(x, torch.Tensor) and not isinstance(x, ti.FunctionalTensor):
            raise _NoShare("the forward returns a tensor the trace does not know")
    storages = [ti.storage_key(ti.functional_value(t)) for t in tensors]
    operand_storages = {ti.storage_key(ti.functional_value(t)) for t in operands}
    if len(set(storages)) != len(storages) or operand_storages & set(storages):
        raise _NoShare("the forward returns views of one tensor, or of its input or state")
    out_nodes = [ti.traced_node(t, tracer) for t in tensors]
    new_values = [ti.traced_node(operands[i], tracer) for i in mutated]
    size_symbols = frozenset().union(*(ti.free_symbols(t) for t in operands))
    region = find_region(start, end, operand_nodes, (*out_nodes, *new_values), size_symbols)
    body = extract(region, tracer.root, operand_nodes, labels, "repeated_body")
    ops = sum(1 for n in body.graph.nodes if n.op == "call_function")
    if ops < MIN_BODY_OPS:
        raise _TooSmall(f"its body has {ops} ops, fewer than {MIN_BODY_OPS}: a replay would save nothing")
    metadata = tuple(
        (tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)
        for t in (*tensors, *(operands[i] for i in mutated))
    )
    constants = tuple(
        (PassThrough(operand_at[id(x)]) if id(x) in operand_at else BODY_OUTPUT) if isinstance(x, torch.Tensor) else snapshot(x)
        for x in leaves
    )
    symbols = tuple(n.meta["val"] for n in region.symbols)
    operand_args = (*(operand_nodes[i] for i in region.used), *region.symbols)
    site = CallSite(region, operand_args, node_module_stack(tracer.module_stack))
    return _Recorded(body, region.used, metadata, constants, spec, mutated, symbols, site)


@_unobserved
def _describe(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, list[torch.Tensor], list[str]]:
    """The static key of a call, its operands (state, then tensor inputs) and their names."""
    if "forward" in module.__dict__:
        raise _NoShare("the module's forward is set on the instance")
    modules = list(module.named_modules(remove_duplicate=False))
    state = _state(modules)
    flat, in_spec = pytree.tree_flatten_with_path((args, kwargs))
    operands = [t for _, t in state]
    labels = [_identifier(name.replace(".", "_")) for name, _ in state]
    constants = []
    for path, value in flat:
        if isinstance(value, torch.Tensor):
            operands.append(value)
            labels.append(_input_label(path))
        elif isinstance(value, _PLAIN):
            constants.append(snapshot(value))
        else:
            raise _NoShare(f"an input of type {type(value).__name__}")
    if not all(isinstance(t, ti.FunctionalTensor) for t in operands):
        raise _NoShare("an operand the trace does not know (a real tensor)")
    first_position = {}
    aliases = tuple(first_position.setdefault(id(t), i) for i, t in enumerate(operands))
    metadata = tuple(_tensor_key(t) for t in operands)
    static = (
        type(module),
        tuple((name, type(m), type(m).forward.__code__) for name, m in modules),
        tuple(name for name, _ in state),
        metadata,
        aliases,
        _hooks(modules),
        _ambient(),
        tuple(m.training for _, m in modules),
        repr(in_spec),
        tuple(constants),
    )
    return static, operands, labels


def _identifier(label: str) -> str:
    """`label` as a body placeholder may be named: FX writes a placeholder's target into the
    body's Python signature, so the state of an `nn.Sequential` (`0.weight` -> `0_weight`) gets
    FX's own prefix for a name that starts with a digit (`_0_weight`)."""
    return f"_{label}" if label[:1].isdigit() else label


def _input_label(path: tuple) -> str:
    """A body placeholder's name for an input leaf: `x_0` for `args[0]`, `mask` for
    `kwargs["mask"]`, with the rest of the leaf's pytree path appended (`pos_1`)."""
    head, *rest = path[1:]
    name = f"x_{head.idx}" if path[0].idx == 0 else str(head.key)
    tail = "".join(c if c.isalnum() else "_" for c in pytree.keystr(tuple(rest)))
    return "_".join(part for part in (name, *tail.split("_")) if part)


def _state(modules: list[tuple[str, nn.Module]]) -> list[tuple[str, torch.Tensor]]:
    """Parameters, buffers and tensor attributes by name (every name of a shared one)."""
    found = []
    for prefix, m in modules:
        dot = f"{prefix}." if prefix else ""
        for name, value in (*m._parameters.items(), *m._buffers.items()):
            if value is not None:
                found.append((dot + name, value))
        for name, value in m.__dict__.items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                found.append((dot + name, value))
    return found


def _tensor_key(t: torch.Tensor) -> tuple:
    shape, stride = t.shape, t.stride()
    if not all(type(s) is int for s in (*shape, *stride)):  # symbolic sizes: by their expressions
        shape, stride = tuple(map(str, shape)), tuple(map(str, stride))
    return (tuple(shape), tuple(stride), t.dtype, t.device, t.requires_grad, type(t))


def _hooks(modules: list[tuple[str, nn.Module]]) -> tuple:
    """The module and global hooks in force (`_hook_key`); backward hooks are never shared."""
    from torch.nn.modules import module as module_globals

    found = []
    for _, m in modules:
        if m._backward_hooks or m._backward_pre_hooks:
            raise _NoShare("a module inside has backward hooks")
        found.append(tuple(_hook_key(h) for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())))
        found.append((tuple(m._forward_hooks_with_kwargs), tuple(m._forward_pre_hooks_with_kwargs), tuple(m._forward_hooks_always_called)))
    if module_globals._global_backward_hooks or module_globals._global_backward_pre_hooks:
        raise _NoShare("global backward hooks are registered")
    global_hooks = (*module_globals._global_forward_pre_hooks.values(), *module_globals._global_forward_hooks.values())
    found.append(tuple(_hook_key(h) for h in global_hooks))
    return tuple(found)


def _hook_key(hook: Any) -> Any:
    """A forward hook as part of a key: its code, defaults and closure values (Hugging Face
    installs one closure per module, alike but distinct).  A hook whose code visibly has a
    Python side effect (appending to a collector) is never shared: a replay would not run it."""
    effect = side_effect(hook)
    if effect is not None:
        raise _NoShare(f"a forward hook inside ({getattr(hook, '__qualname__', hook)}) has a Python side effect ({effect})")
    fn = getattr(hook, "__func__", hook)
    code = getattr(fn, "__code__", None)
    if code is None:
        return snapshot(hook)  # a callable object: by identity
    cells = tuple(snapshot(cell.cell_contents) if is_filled(cell) else None for cell in fn.__closure__ or ())
    bound = snapshot(getattr(hook, "__self__", None))
    return (code, cells, snapshot(fn.__defaults__), snapshot(fn.__kwdefaults__), bound)


def _ambient() -> tuple:
    """Grad, inference and autocast state: the same forward traces differently under each."""
    autocast = tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
    )
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), autocast, torch.get_default_dtype())


@_unobserved
def _repeated_modules(root: nn.Module) -> tuple[dict[int, Any], set[int]]:
    """Each module's signature (class, state shapes, children's signatures), and the non-leaf
    modules with at least `MIN_INSTANCES - 1` others of the same signature in the tree.

    Signatures are built bottom-up (a module's own state, then its children's signatures), so
    the scan is linear in the size of the tree."""
    signatures: dict[int, Any] = {}

    def signature(m: nn.Module) -> Any:
        if id(m) not in signatures:
            own = tuple(
                (name, tuple(t.shape), t.dtype)
                for name, t in (*m._parameters.items(), *m._buffers.items())
                if t is not None
            )
            signatures[id(m)] = (type(m), own, tuple((name, signature(c)) for name, c in m._modules.items() if c is not None))
        return signatures[id(m)]

    signature(root)
    non_leaf = {id(m) for m in root.modules() if m._modules}
    counts = Counter(signatures[i] for i in non_leaf)
    return signatures, {i for i in non_leaf if counts[signatures[i]] >= MIN_INSTANCES}


#: Why nothing is shared in a model that registers one submodule under two paths.
_PROXIED = (
    "the model registers one submodule under two paths ({} and {}), so make_fx hands every submodule call to the trace as a "
    "proxy of its module (its AttrProxy), which a key cannot be computed for; every block is traced inline"
)


def _shared_submodule(root: nn.Module) -> tuple[str, str] | None:
    """The first two paths of a submodule registered under two (CoaT's shared position
    encodings), or None.  make_fx's module-stack tracer then reaches every submodule through a proxy class
    made per attribute access (`_ModuleStackTracer.enable_attr_proxy`), which `_Sharing.call`
    never sees; intercepting the calls anyway cost CoaT 8% of its export for nothing."""
    seen: dict[int, str] = {}
    for name, module in root.named_modules(remove_duplicate=False):
        if id(module) in seen:
            return seen[id(module)], name
        seen[id(module)] = name
    return None


class _Off:
    """What `share_repeated_blocks` yields with sharing off."""

    def __init__(self) -> None:
        self.reports: list[BlockReport] = []

    def fold(self, gm: fx.GraphModule) -> None:
        pass


@contextlib.contextmanager
def share_repeated_blocks(root: nn.Module, mode: Dedup) -> Iterator[_Sharing | _Off]:
    """While active (inside the trace), repeated blocks are shared; yields the sharing state,
    whose `reports` say what was shared and whose `fold(gm)` is called on the traced graph."""
    if mode is Dedup.OFF:
        yield _Off()
        return
    shared = _shared_submodule(root)
    if shared is not None:
        off = _Off()
        off.reports.append(BlockReport(type(root).__qualname__, [], not_shared=_PROXIED.format(*shared)))
        yield off
        return
    sharing = _Sharing(root, mode)
    with ti.intercept_module_calls(sharing.call):
        yield sharing
