"""The one functional trace and what runs around it: `trace_program` (make_fx at the PreDispatch
key with FunctionalTensorMode), stack-trace anchors, module-call interception for repeated
blocks, the joint's differentiated trace, and the backend switches held off while tracing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._functorch._aot_autograd.functional_utils import (
    has_data_mutation as _has_data_mutation,
    has_metadata_mutation as _has_metadata_mutation,
)
from torch._higher_order_ops.effects import _EffectType
from torch._ops import HigherOrderOperator, OpOverload
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, is_fake
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    _AttrProxy,
    _ModuleStackTracer,
    get_proxy_mode,
    get_proxy_slot,
    make_fx,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree

from predispatch._torch_internals.codegen import torch_function_disabled
from predispatch._torch_internals.functional import functional_value, MODULE_CALLS, outside_trace
from predispatch._torch_internals.mechanism import Hook, drift, patched, require
from predispatch._torch_versions import HAS


#: What torch raises when Python needs a value that only exists at run time.
DATA_DEPENDENT_ERRORS = (DataDependentOutputException, GuardOnDataDependentSymNode)


def new_fake_mode(*, real_constants: bool = False) -> FakeTensorMode:
    """A fake mode with a ShapeEnv: shapes are tracked symbolically, no real compute runs.

    real_constants: ops may take real tensors (a module-level global forward reads), which the
    trace holds as constants, as torch.export's fake mode does (Note [Tensors from outside the
    module] in trace/outside_tensors.py); elsewhere a real tensor meeting the mode is a bug.
    """
    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=real_constants)


@contextlib.contextmanager
def fake_inputs_only(fake_mode: FakeTensorMode) -> Iterator[None]:
    """While active, `fake_mode` refuses real tensors again (`new_fake_mode(real_constants=True)`
    takes them for the program's own graph; a captured Function's subgraphs do not)."""
    old = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = False
    try:
        yield
    finally:
        fake_mode.allow_non_fake_inputs = old


def reparametrize(module: torch.nn.Module, tensors: dict[str, torch.Tensor], *, tie: bool = False):
    """Temporarily swap a module's parameters/buffers/tensor attributes by fully qualified name."""
    return _reparametrize_module(module, tensors, tie_weights=tie, strict=False, stack_weights=True)


@contextlib.contextmanager
def exporting_flags() -> Iterator[None]:
    """Make `torch.compiler.is_exporting()` and `is_compiling()` answer True while tracing.

    Libraries such as transformers read these flags to take their export-friendly code paths.
    The one reader that asks in order to refuse is answered False (Note [Non-recursive disable]).
    """
    compiler = torch.compiler
    old = (compiler._is_compiling_flag, compiler._is_exporting_flag)
    compiler._is_compiling_flag, compiler._is_exporting_flag = True, True
    try:
        with _this_thread_only("is_compiling", old[0]), _this_thread_only("is_exporting", old[1]), nonrecursive_disable_runs_plainly():
            yield
    finally:
        compiler._is_compiling_flag, compiler._is_exporting_flag = old


# Note [Export flags in one thread]
# torch keeps `is_exporting()` and `is_compiling()` as two module globals, so while one thread
# exported, every other thread's code took its export-only branches (issue 36: 1321 of 2369
# checks in a thread that was not exporting answered True).  The globals stay set for torch's
# own readers of the raw flag in the exporting thread (Dynamo, tracing a `torch.cond` branch);
# the two functions answer True in the exporting thread and, in every other, what they answered
# before the export.  Code that bound the function before export (`from torch.compiler import
# is_exporting`) reads the global: True in every thread, as before.
THREAD_FLAGS = "torch.compiler.is_exporting/is_compiling answered per thread"


class _ThisThreadOnly:
    """One of torch.compiler's flag functions, per thread (Note [Export flags in one thread]).
    Not a plain function, so `patched` leaves the thread test to it and it counts its calls."""

    def __init__(self, hook: Hook, before: bool):
        self.hook, self.before = hook, before

    def __call__(self) -> bool:
        if threading.get_ident() != self.hook.thread:
            return self.before
        self.hook.calls += 1
        return True


@contextlib.contextmanager
def _this_thread_only(name: str, before: bool) -> Iterator[Hook]:
    hook = Hook(THREAD_FLAGS)
    with patched(torch.compiler, name, lambda _: _ThisThreadOnly(hook, before), mechanism=THREAD_FLAGS,
                 probe=lambda: getattr(torch.compiler, name)(), hook=hook):
        yield hook


# Note [Non-recursive disable]
# `torch._dynamo.disable(fn, recursive=False)` wraps `fn` in `nonrecursive_disable_wrapper`
# (torch/_dynamo/external_utils.py), which raises "Non-recursive torch.compiler.disable is not
# supported with torch.export" whenever `torch.compiler.is_exporting()` is True, and otherwise
# calls `fn`.  The refusal is about Dynamo (torch.export's strict mode cannot skip one frame and
# trace its callees); predispatch does not run Dynamo on forward, so the plain call is what the
# wrapper means here, as under aot_export_module (which sets no flag).  So `is_exporting()`
# answers False to that wrapper's frame only; every other reader still sees True.
NONRECURSIVE_DISABLE = "non-recursive torch._dynamo.disable (torch.compiler.is_exporting)"


def _nonrecursive_wrapper() -> Callable[[], None]:
    """A wrapper as `disable(recursive=False)` makes: its code identifies every other, and calling
    it probes that the wrapper reads `torch.compiler.is_exporting` where the hook is."""
    from torch._dynamo import external_utils

    make = require(external_utils, "get_nonrecursive_disable_wrapper", NONRECURSIVE_DISABLE)
    return make(lambda: None)


@contextlib.contextmanager
def nonrecursive_disable_runs_plainly() -> Iterator[Hook]:
    """`torch.compiler.is_exporting()` is False for `nonrecursive_disable_wrapper` (Note [Non-recursive disable])."""
    from predispatch._torch_internals.mechanism import caller_frame

    probe = _nonrecursive_wrapper()
    wrapper = probe.__code__

    def make(original: Callable[[], bool]) -> Callable[[], bool]:
        def is_exporting() -> bool:
            frame = caller_frame(1)
            return False if frame is not None and frame.f_code is wrapper else original()

        return is_exporting

    with patched(torch.compiler, "is_exporting", make, mechanism=NONRECURSIVE_DISABLE, probe=probe) as hook:
        yield hook


#: The hook that keeps a tensor subclass's constructor out of the graph (`subclass_constructors_unrecorded`).
SUBCLASS_CONSTRUCTORS = "tensor subclass constructors (torch._export.wrappers._maybe_find_pre_dispatch_tf_mode_for_export)"


@contextlib.contextmanager
def subclass_constructors_unrecorded() -> Iterator[Hook]:
    """A subclass constructor torch marks exportable (`mark_subclass_constructor_exportable_experimental`:
    TwoTensor, DTensor) records itself as a `flat_apply` node holding the subclass when it runs under a
    pre-dispatch export; predispatch's program computes on the plain tensors inside subclasses
    (Note [Tensor subclasses] in frontend/subclasses.py), so the construction is plain Python here,
    as under AOTAutograd: the wrapper finds no export mode to record into."""
    import torch._export.wrappers as wrappers

    with patched(
        wrappers,
        "_maybe_find_pre_dispatch_tf_mode_for_export",
        lambda original: lambda: None,
        mechanism=SUBCLASS_CONSTRUCTORS,
        probe=lambda: wrappers._maybe_find_pre_dispatch_tf_mode_for_export(),
    ) as hook:
        yield hook


def dynamic_dims(t: torch.Tensor) -> dict[int, tuple[int | None, int | None]]:
    """The dimensions of `t` torch.compile makes dynamic on its first compile, each with the
    range marked for it (None: unbounded): `torch._dynamo.mark_dynamic(t, dim, min=, max=)`,
    and the marks a tensor subclass sets on its own parts (a jagged nested tensor marks its
    values' jagged dimension, and its cached min/max sequence lengths)."""
    dims: dict[int, tuple[int | None, int | None]] = {}
    for name in ("_dynamo_propagated_dynamic_indices", "_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices"):
        dims.update((int(d), (None, None)) for d in getattr(t, name, ()))
    for marked in getattr(t, "_dynamo_dynamic_range", ()):
        dims[int(marked.dim)] = (marked.min, marked.max)
    return dims


def fake_with_dynamic_dims(
    fake_mode: FakeTensorMode, t: torch.Tensor, dims: dict[int, tuple[int | None, int | None]], name: str
) -> torch.Tensor:
    """The fake of plain tensor `t` whose dimensions `dims` are size symbols of `fake_mode`'s
    ShapeEnv, each within its range (None: unbounded), the others static; `name` is the graph
    input the symbols are named after (`x___values.size()[0]`)."""
    from torch._dynamo.source import LocalSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext, StrictMinMaxConstraint
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges

    def constraint(dim: int) -> Any:
        low, high = dims.get(dim, (None, None))
        if low is None and high is None:
            return None
        return StrictMinMaxConstraint(vr=ValueRanges(low or 0, int_oo if high is None else high), warn_only=False)

    context: Any = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in dims else DimDynamic.STATIC for d in range(t.dim())],
        constraint_sizes=[constraint(d) for d in range(t.dim())],
    )
    return fake_mode.from_tensor(t, symbolic_context=context, source=LocalSource(name))


# --- custom autograd.Function capture (custom_backward/autograd_function.py) ---------------------------

def trace_functional(
    fn: Callable[..., Any], args: tuple[Any, ...], fake_mode: FakeTensorMode
) -> tuple[torch.fx.GraphModule, tuple[int, ...]]:
    """Trace `fn(*args)` (fake tensor args) to a functional pre-dispatch graph, as AOTAutograd does.

    Returns the graph and the positions of the tensor args `fn` mutated (data or metadata): a
    functional graph cannot show those mutations, so the caller decides what they mean.  Call
    it `outside_trace()`; `decomposition_hook` still applies, since it patches the class.
    """
    mutated: list[int] = []

    def functional(*inputs: Any) -> Any:
        with _functional_mode():
            wrapped = _to_functional(inputs)
            out = torch.utils._pytree.tree_map_only(FunctionalTensor, functional_value, fn(*wrapped))
            mutated.extend(i for i, changed in enumerate(_mutations(wrapped, inputs)) if any(changed))
        return out

    with fake_mode:
        gm = make_fx(functional, pre_dispatch=True)(*args)
    return gm, tuple(mutated)


@dataclasses.dataclass(frozen=True)
class ProgramTrace:
    """What `trace_program` captured.

    graph_module: inputs `(token, *args)`, outputs `(*new values of mutated, *fn's outputs)`;
        `token` orders effectful ops (`with_effects`); trace/functional.py's
        `_remove_effect_tokens` takes it out again.
    mutated: positions in `args` whose new values the first outputs carry, in order: every
        input `fn` changed in place, its data or its shape, strides or storage offset.
    metadata_mutated: the positions among `mutated` whose shape, strides or storage offset
        changed (`x.t_()`): their output is the input's new view (or new value).
    storage_mutated: positions whose storage `fn` swapped (`x.set_(y)`).
    """

    graph_module: torch.fx.GraphModule
    mutated: tuple[int, ...]
    metadata_mutated: tuple[int, ...]
    storage_mutated: tuple[int, ...] = ()


def trace_program(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    scope: torch.nn.Module,
    decompositions: dict[OpOverload, Callable[..., Any]] | None = None,
) -> ProgramTrace:
    """Capture `fn(*args)` once: a functional graph at the PreDispatch key (call under the fake mode).

    What `aot_export_module(pre_dispatch=True)` records in its capture pass, without its
    metadata pass (a second run of the user's forward, with functionalization below
    PreDispatch, only to learn which inputs are mutated): FunctionalTensorMode on the
    PreDispatch stack over make_fx's proxy tracer, and the mutations read off the
    FunctionalTensor inputs after the run, as AOTAutograd's own metadata analysis reads them.
    `scope` names modules in each node's `nn_module_stack`.  `decompositions`: make_fx's table,
    for ops the proxy tracer meets below functionalization (a function returning NotImplemented
    leaves the call to the op).
    """
    mutated: list[int] = []
    metadata: list[int] = []
    storage: list[int] = []

    def functional(token: torch.Tensor, *inputs: Any) -> tuple[Any, ...]:
        with _functional_mode() as mode:
            with torch_function_disabled():  # metadata reads only (see `torch_function_disabled`)
                f_token, *wrapped = _to_functional((token, *inputs))
            mode._tokens = {effect: f_token for effect in _EffectType}
            with frames_fixed_above(sys._getframe()):
                out = fn(*wrapped)
            with torch_function_disabled():
                changes = list(_mutations(wrapped, inputs))
            for i, (data_changed, meta_changed) in enumerate(changes):
                if data_changed or meta_changed:
                    mutated.append(i)
                if meta_changed:
                    metadata.append(i)
                if meta_changed and _has_metadata_mutation(wrapped[i], inputs[i], check_only_storage_mutation=True):
                    storage.append(i)
            new_values = [functional_value(wrapped[i]) for i in mutated]
            out = torch.utils._pytree.tree_map_only(FunctionalTensor, functional_value, out)
        return (*new_values, *out)

    functional._orig_mod = scope  # make_fx's module-stack tracer names modules from here
    with contextlib.ExitStack() as stack:
        stack.enter_context(enable_python_dispatcher())
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing  # see _LAZY

        stack.enter_context(_disable_saved_tensors_hooks_during_tracing())
        stack.enter_context(forward_frames_only())
        # no Python code for the traced graph yet: build edits it, then generates it once
        # (`generate_code`); a GraphModule's code is a tenth of a 600-node export
        stack.enter_context(_use_lazy_graph_module(True))
        token = torch.empty(0)
        gm = make_fx(functional, decompositions, record_module_stack=True, pre_dispatch=True)(token, *args)
    return ProgramTrace(gm, tuple(mutated), tuple(metadata), tuple(storage))


def _stack_trace_anchors() -> Any:
    """Frames FX keeps in a node's stack trace besides `forward` ones (none before torch 2.13)."""
    return torch.fx.proxy._STACK_TRACE_ANCHORS if HAS.stack_trace_anchors else ()


class _ForwardFrames:
    """FX's per-node stack trace at a fraction of the cost: only the frames FX keeps.

    make_fx's module-stack tracer records, for every node, the stack's `forward` frames (and
    `torch/__init__.py` and registered anchors; `_filter_traceback_frames` drops the rest).
    torch extracts and symbolizes the *whole* stack first (pytest, the model, torch's
    dispatch: a hundred frames) for each node, 15-20% of an export.  This stand-in for
    `CapturedTraceback` walks the stack and keeps those frames only, so FX's filter returns
    the same frames and the node's `stack_trace` is the same text.
    """

    __slots__ = ("frames",)

    def __init__(self, frames: list[tuple[str, int, str]]):
        self.frames = frames

    @staticmethod
    def extract(**_: Any) -> _ForwardFrames:
        return _ForwardFrames(_kept_frames(sys._getframe(1), getattr(_ABOVE, "frame", None)))

    def summary(self) -> traceback.StackSummary:
        return traceback.StackSummary.from_list([traceback.FrameSummary(*f) for f in reversed(self.frames)])


#: The frame a trace calls the traced function from, in this thread, and the frames FX keeps
#: from it up (see `frames_fixed_above`).
_ABOVE = threading.local()


def _kept_frames(frame: Any, stop: Any = None) -> list[tuple[str, int, str]]:
    """The frames FX keeps from `frame` up the stack; at `stop`, the ones `frames_fixed_above`
    found there (the same: those frames are suspended, their lines fixed)."""
    frames = []
    anchors = _stack_trace_anchors()
    while frame is not None:
        if frame is stop:
            frames.extend(_ABOVE.kept)
            break
        code = frame.f_code
        if code.co_name == "forward" or code.co_filename.endswith("torch/__init__.py") or (code.co_filename, code.co_name) in anchors:
            frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return frames


@contextlib.contextmanager
def frames_fixed_above(frame: Any) -> Iterator[None]:
    """Every node traced below `frame` (the traced function's caller) shares the frames above it:
    walk them once, not for each node (the export's own frames, the user's script, a test
    runner: half of a node's stack).  A stack without `frame` (another thread) is walked whole."""
    saved = getattr(_ABOVE, "frame", None), getattr(_ABOVE, "kept", ())
    _ABOVE.kept = _kept_frames(frame, saved[0])
    _ABOVE.frame = frame
    try:
        yield
    finally:
        _ABOVE.frame, _ABOVE.kept = saved


@contextlib.contextmanager
def forward_frames_only() -> Iterator[None]:
    """While active, FX tracers capture stack traces with `_ForwardFrames` (same text, less work).

    It patches FX's module global, so a tracer running meanwhile in another thread gets it too;
    only a tracer not filtering to `forward` frames would then see a shorter stack trace.
    """
    with patched(torch.fx.proxy, "CapturedTraceback", lambda _: _ForwardFrames, mechanism="node stack traces (torch.fx.proxy.CapturedTraceback)"):
        yield


@contextlib.contextmanager
def _functional_mode() -> Iterator[FunctionalTensorMode]:
    """FunctionalTensorMode at PreDispatch, entered as AOTAutograd enters it (Python
    functionalization only: the C++ Functionalize key is excluded)."""
    mode = FunctionalTensorMode(pre_dispatch=True, export=True, _allow_token_discovery=True)
    exclude = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
    with exclude, mode:
        yield mode


def _to_functional(values: Any) -> list[Any]:
    """The tensors among `values` wrapped for the active functional mode; the rest as they are."""
    return [FunctionalTensor.to_functional(t) if isinstance(t, torch.Tensor) else t for t in values]


def _mutations(wrapped: list[Any], originals: Any) -> Iterator[tuple[bool, bool]]:
    """(data mutated, metadata mutated) of each wrapped input, AOTAutograd's tests
    (`torch._functorch._aot_autograd.functional_utils`); a storage swap (`set_`) counts as metadata.
    Both can be true (`x.t_().add_(1)`)."""
    for f_arg, arg in zip(wrapped, originals):
        if not isinstance(f_arg, FunctionalTensor):
            yield False, False
            continue
        torch._sync(f_arg)
        yield _has_data_mutation(f_arg), _has_metadata_mutation(f_arg, arg, check_only_storage_mutation=False)


def named_dims(module: torch.nn.Module, args: tuple, kwargs: dict,
               dynamic_shapes: Any) -> list[tuple[int, int, str]]:
    """`(id of the input tensor, dimension, Dim name)` for each dimension a named `Dim` marks.

    torch's own reading of the spec (`_process_dynamic_shapes`), so names follow the same
    binding rules as the ranges; derived dimensions (`2 * batch`) have no name of their own
    and hints (`Dim.AUTO`) none at all.
    """
    from torch.export import dynamic_shapes as spec

    combined = spec._combine_args(module, args, kwargs)
    constraints = spec._process_dynamic_shapes(combined, dynamic_shapes)
    return [(c.t_id, c.dim, c.name) for c in constraints if type(c) is spec._Constraint]


def discarding_unbacked_symbols(fake_mode: FakeTensorMode):
    """Symbols for data-dependent values (`.item()`) created now are used and dropped inside
    a subgraph: the outer trace must not look for them among its own outputs."""
    if fake_mode.shape_env is None:
        return contextlib.nullcontext()
    return fake_mode.shape_env.ignore_fresh_unbacked_symbols()


#: torch 2.11's non-reentrant checkpoint applies this Function (later releases apply none).
NOOP_SAVE_INPUTS: type | None = getattr(torch.utils.checkpoint, "_NoopSaveInputs", None) if HAS.checkpoint_applies_function else None


def is_generator_argument_error(exc: BaseException) -> bool:
    """Whether `exc` is FX refusing a `torch.Generator` argument (torch 2.11; see HAS.generator_in_graph)."""
    return (
        not HAS.generator_in_graph
        and isinstance(exc, NotImplementedError)
        and "torch._C.Generator" in str(exc)
    )


#: torch's message when `.numpy()` (or numpy's `np.asarray(t)`, through `Tensor.__array__`)
#: meets the trace's fake or functional tensor (torch/csrc/utils/tensor_numpy.cpp).
_NUMPY_OF_SUBCLASS = ".numpy() is not supported for tensor subclasses"


def is_numpy_conversion_error(exc: BaseException) -> bool:
    """Whether `exc` is torch refusing `.numpy()` of a traced tensor: its values do not exist
    at trace time (the tensor is fake), so numpy cannot compute on them."""
    return isinstance(exc, RuntimeError) and _NUMPY_OF_SUBCLASS in str(exc)


def fake_empty(fake_mode: FakeTensorMode, shape: Any, stride: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.empty_strided(shape, stride, ...)` under `fake_mode`, made without dispatching:
    torch's converter wraps a meta tensor of that metadata (as the fake mode's own factory
    kernels end), a sixth of the cost of the dispatch (a replayed or split body call makes one
    per output).  Symbolic sizes take the dispatch, which records them in the shape env."""
    if all(type(x) is int for x in (*shape, *stride)):
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, torch.device(device))
    with fake_mode:
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def fake_of_plain(fake_mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor | None:
    """The fake of `t` as `fake_mode.from_tensor(t, static_shapes=True)` makes it, for a plain
    dense leaf tensor that alone owns its whole storage: made from a meta tensor of its metadata
    (`fake_empty`'s way) and entered in the converter's memo, so a later `from_tensor(t)` returns
    it.  A seventh of `from_tensor`'s cost, which describes every tensor for the general case
    (views, subclasses, symbolic sizes): a tenth of a CNN's export, one per parameter and buffer.

    None when `t` is anything else; the caller takes `from_tensor`.  The caller vouches that no
    other tensor it fakifies shares `t`'s storage (storage sharing is what the general path keeps)."""
    if (
        type(t) not in (torch.Tensor, torch.nn.Parameter)
        or t.layout is not torch.strided
        or t.is_meta
        or t.is_quantized
        or t.is_conj()
        or t.is_neg()
        or t._is_zerotensor()
        or t._is_view()
        or not t.is_leaf
        or t.storage_offset() != 0
        or (t.requires_grad and getattr(t, "grad_dtype", t.dtype) != t.dtype)
        or t.untyped_storage().nbytes() != _extent(t) * t.element_size()
        or not all(type(x) is int for x in (*t.shape, *t.stride()))
    ):
        return None
    if not _PLAIN_FAKES_CHECKED:
        _check_plain_fakes()
    return _plain_fake(fake_mode, t)


def _plain_fake(fake_mode: FakeTensorMode, t: torch.Tensor) -> torch.Tensor:
    converter = fake_mode.fake_tensor_converter
    memo = converter._get_memo(t)
    if memo is not None:
        return memo
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta", requires_grad=t.requires_grad)
    fake = converter.from_meta_and_device(fake_mode, meta, t.device)
    if type(t) is torch.nn.Parameter:  # as the meta converter marks it (a Parameter() would detach)
        fake._is_param = True
    if getattr(t, "_is_buffer", False):
        fake._is_buffer = True
        if hasattr(t, "persistent"):
            fake.persistent = t.persistent
    converter.set_tensor_memo(t, fake)
    return fake


_PLAIN_FAKES_CHECKED = False

#: What a fake made the short way must share with `from_tensor`'s, checked once per process.
_FAKE_PROPERTIES: dict[str, Callable[[torch.Tensor], Any]] = {
    "class": type,
    "Parameter-ness": lambda f: isinstance(f, torch.nn.Parameter),
    "shape": lambda f: tuple(f.shape),
    "stride": lambda f: f.stride(),
    "dtype": lambda f: f.dtype,
    "device": lambda f: f.device,
    "requires_grad": lambda f: f.requires_grad,
    "is_leaf": lambda f: f.is_leaf,
    "storage bytes": lambda f: f.untyped_storage().nbytes(),
    "dispatch keys": lambda f: str(torch._C._dispatch_keys(f)),
}


def _check_plain_fakes() -> None:
    """The short way's fakes are torch's own on this torch: compare a parameter and a buffer
    made both ways once, and stop (`TorchDriftError`) rather than trace on a fake that differs
    (a torch release whose converter sets something new on every fake)."""
    global _PLAIN_FAKES_CHECKED
    for t in (torch.nn.Parameter(torch.zeros(2, 3)), torch.zeros(3, 2).t().contiguous()):
        ours, torchs = _plain_fake(FakeTensorMode(), t), FakeTensorMode().from_tensor(t, static_shapes=True)
        for name, read in _FAKE_PROPERTIES.items():
            if read(ours) != read(torchs):
                raise drift(
                    "fakifying state without torch's converter (ti.fake_of_plain)",
                    f"its fake's {name} is {read(ours)}, from_tensor's {read(torchs)}",
                )
    _PLAIN_FAKES_CHECKED = True


def _extent(t: torch.Tensor) -> int:
    """Elements from the first to one past the last a strided tensor reaches (0 when empty)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))


def is_traced_tensor(value: Any) -> bool:
    """Whether `value` is a tensor of a running trace (fake or functional), not a real constant."""
    return isinstance(value, torch.Tensor) and (is_fake(value) or isinstance(value, FunctionalTensor))
# --- the joint forward-backward program (transforms/joint.py) ------------------------------------


def trace_differentiated(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], fake_mode: FakeTensorMode) -> torch.fx.GraphModule:
    """Trace `fn(*args)`, which calls `torch.autograd.grad`, below autograd and functionalized.

    make_fx under FunctionalTensorMode (at the level below autograd, as AOTAutograd traces its
    joint), the inputs wrapped with their `requires_grad`.  Not `aot_export_module(trace_joint=True)`
    (`_aot_export_function`): its joint trace records backward formulas in their
    double-differentiable form (`silu_backward` becomes `sigmoid` arithmetic, as autograd does
    with grad mode on), so its gradients differ from eager's in the last bits (Llama, Mistral,
    Qwen2 in tests/test_joint_models.py); `torch.autograd.grad` called here runs them as eager does.
    """

    def functional(*inputs: torch.Tensor) -> Any:
        with FunctionalTensorMode(), torch.enable_grad():
            wrapped = [FunctionalTensor.to_functional(t).requires_grad_(t.requires_grad) for t in inputs]
            out = fn(*wrapped)
            return pytree.tree_map_only(FunctionalTensor, functional_value, out)

    # lazy: no Python code until the caller has edited the graph (the joint splits bodies out of
    # it, drops detaches, reorders, appends gradients) and generates it once (`generate_code`)
    with fake_mode, enable_python_dispatcher(), torch.autograd.set_multithreading_enabled(False), _use_lazy_graph_module(True):
        return make_fx(functional)(*args)
def pre_dispatch_modes() -> tuple[Any, Any]:
    """The modes in the PreDispatch key's two slots now: (proxy tracer, functional mode).

    While an op (or a HOP) is handled at PreDispatch, torch pops its slot's mode for the time of
    the handler and what it dispatches below (`torch._ops._temporarily_pop_modes_from_pre_dispatch`):
    code running with the trace's modes all in place is the traced program's own Python, code
    running with one popped runs inside an op's kernel (an autograd kernel, a HOP's impl).
    """
    from torch._ops import mode_stack_state_for_pre_dispatch

    state = mode_stack_state_for_pre_dispatch()
    return state.get(0), state.get(1)


def _op_call_codes() -> frozenset[Any]:
    from torch._ops import OpOverloadPacket, TorchBindOpOverload

    calls = (OpOverload.__call__, TorchBindOpOverload.__call__, OpOverloadPacket.__call__, HigherOrderOperator.dispatch)
    return frozenset(f.__code__ for f in calls)


#: The Python frames every op or HOP call from Python passes through on its way to its kernels.
_OP_CALL_CODES = _op_call_codes()


def inside_op_call() -> bool:
    """Whether the caller runs inside an op's or a HOP's call: a kernel's Python (an autograd
    kernel, a HOP's impl), which the dispatcher reached from that call, not the traced program."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _OP_CALL_CODES:
            return True
        frame = frame.f_back
    return False


def generator_identity(generator: torch.Generator) -> int:
    """The C++ generator a `torch.Generator` stands for: Python wrappers of one generator differ
    (the traced graph holds a new wrapper of the module's generator), this does not."""
    return generator._cdata


@contextlib.contextmanager
def intercept_module_calls(handler: Callable[[torch.nn.Module, Callable[..., Any], tuple, dict], Any]) -> Iterator[Hook]:
    """While active, each submodule call make_fx's module-stack tracer meets runs as
    `handler(module, call, args, kwargs)`, where `call(*args, **kwargs)` runs the module as usual.

    The handler runs inside the tracer's own `call_module`, so the module is already on
    `nn_module_stack` and nodes the handler creates are attributed to it.  Modules the tracer
    does not attribute (GraphModules, shared-module proxies) are not handed over.
    """

    def intercepting(original):
        def call_module(self, m, forward, args, kwargs):
            if isinstance(m, (torch.fx.GraphModule, _AttrProxy)):
                return original(self, m, forward, args, kwargs)
            return original(self, m, lambda *a, **k: handler(m, forward, a, k), args, kwargs)

        return call_module

    with patched(_ModuleStackTracer, "call_module", intercepting, mechanism=MODULE_CALLS) as hook:
        yield hook


def current_tracer() -> torch.fx.Tracer | None:
    """The proxy tracer of the running make_fx trace (pre-dispatch or not), or None."""
    mode = get_proxy_mode()
    return None if mode is None else mode.tracer


def traced_node(value: torch.Tensor, tracer: torch.fx.Tracer) -> torch.fx.Node | None:
    """The graph node holding `value`'s current value in `tracer`'s graph (a FunctionalTensor's
    latest value), or None when the tracer does not know it (a real constant)."""
    inner = functional_value(value) if isinstance(value, FunctionalTensor) else value
    slot = get_proxy_slot(inner, tracer, None)
    return None if slot is None else slot.proxy.node


# --- backend switches while tracing (trace/functional.py) ----------------------------------------


@contextlib.contextmanager
def backends_off() -> Iterator[None]:
    """mkldnn and nnpack off, as torch.export's `_ignore_backend_decomps` turns them off while
    it traces (see `_no_backend_heuristics` in trace/functional.py for why).

    Through torch's C setters: `torch.backends.mkldnn.enabled = False` is refused once
    `torch.backends.disable_global_flags()` ran (torch's test utilities call it), and
    `set_flags` reads every flag of the backend, which raises when forward leaves the TF32
    flags mixed between the legacy and the new API.
    """
    saved = torch._C._get_mkldnn_enabled(), torch._C._get_nnpack_enabled()
    torch._C._set_mkldnn_enabled(False)
    torch._C._set_nnpack_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(saved[0])
        torch._C._set_nnpack_enabled(saved[1])


@contextlib.contextmanager
def traced_below_autograd() -> Iterator[torch.fx.Graph]:
    """Trace what runs inside into the running trace's graph, below autograd: the pre-dispatch
    trace set aside (`outside_trace`), the same tracer's proxy mode and a FunctionalTensorMode on
    the ordinary dispatch stack, as make_fx traces without pre_dispatch (and AOTAutograd traces
    torch.func transforms).  Yields the graph the ops are recorded into."""
    mode = get_proxy_mode()
    if mode is None:
        raise RuntimeError("traced_below_autograd() needs a running trace")
    fake_mode = torch._guards.detect_fake_mode()
    if fake_mode is None:
        raise RuntimeError("traced_below_autograd() needs the trace's fake mode")
    below = ProxyTorchDispatchMode(mode.tracer, mode.tracing_mode, pre_dispatch=False)
    include, exclude = dispatch_keys()
    try:
        with outside_trace(), fake_mode, below, FunctionalTensorMode(pre_dispatch=False, export=True):
            yield mode.tracer.graph
    except BaseException as exc:
        # torch's frames the error went through may hold dispatch-key guards that restore the keys
        # they saved when they are freed, with the error, later: free them now, then put the keys back
        traceback.clear_frames(exc.__traceback__)
        _restore_dispatch_keys(include, exclude)
        raise


def dispatch_keys() -> tuple[torch._C.DispatchKeySet, torch._C.DispatchKeySet]:
    """The thread's locally included and excluded dispatch keys."""
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


def _restore_dispatch_keys(include: torch._C.DispatchKeySet, exclude: torch._C.DispatchKeySet) -> None:
    """Put the thread's included and excluded dispatch keys back as they were: a failure inside
    a torch.func transform's C++ layers can leave them set (every functorch key excluded, which
    breaks every later trace in the thread)."""
    now_include, now_exclude = dispatch_keys()
    for key in torch._C.DispatchKey.__members__.values():
        if now_include.has(key) != include.has(key):
            torch._C._dispatch_tls_set_dispatch_key_included(key, include.has(key))
        if now_exclude.has(key) != exclude.has(key):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, exclude.has(key))


INDEX_INLINE = "flex_attention's captured-tensor index (torch._dynamo._trace_wrapped_higher_order_op.mod_index)"


@contextlib.contextmanager
def flex_attention_index_inline() -> Iterator[None]:
    """A `score_mod` / `mask_mod` of flex_attention that indexes a tensor it captures
    (`bias[h]`) is traced as `aten.index`, as torch.export's decomposed graph has it.

    torch turns that index into `ModIndex.apply` (`TransformGetItemToIndex`, while the HOP
    traces the score_mod), an autograd.Function whose `apply` torch marks
    `allow_in_pre_dispatch_graph`: while exporting, it runs the forward with the PreDispatch key
    excluded, below the trace's functional mode, where `aten.index` meets the captured tensor
    wrapped with no mode ("Attempting to use FunctionalTensor on its own").  `ModIndex.forward`
    is `aten.index` and its backward (`zeros_and_scatter`, an accumulating `index_put`) is
    `aten.index`'s own derivative, so the program calls the forward in place of the Function:
    the index is recorded in the score_mod subgraph, and the flex_attention HOP differentiates
    it as eager does.
    """
    from torch._dynamo import _trace_wrapped_higher_order_op as wrapped  # see _LAZY

    mod_index = require(wrapped, "ModIndex", INDEX_INLINE)
    to_index = require(wrapped, "TransformGetItemToIndex", INDEX_INLINE)

    def probe() -> None:
        with to_index():
            torch.zeros(2)[torch.tensor(0)]

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def index(x: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
            if torch._C._are_functorch_transforms_active():  # the eager kernel's vmap: ModIndex's own rule
                return original(x, indices)
            return mod_index.forward(x, indices)

        return index

    with patched(wrapped, "mod_index", make, mechanism=INDEX_INLINE, probe=probe):
        yield
