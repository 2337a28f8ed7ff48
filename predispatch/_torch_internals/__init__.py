"""The one place that imports torch's private APIs.

predispatch reuses torch's own machinery (make_fx's proxy tracer, FunctionalTensorMode on the
PreDispatch mode stack, fake tensors, AOTAutograd's mutation analysis; AOTAutograd's export
entry point is kept as the tests' reference) instead of reimplementing it.  Those live
behind underscores and move between releases, so every private name we use is imported here
and nowhere else: a torch upgrade touches this file only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
import torch._decomp.decompositions  # noqa: F401  (registers Python CIA kernels via py_impl)
from torch._dispatch.python import enable_python_dispatcher
from torch._ops import OpOverload
from torch._subclasses.schema_check_mode import SchemaCheckMode
from torch.fx.node import _side_effectful_functions
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch._functorch._aot_autograd.functional_utils import (
    has_data_mutation as _has_data_mutation,
    has_metadata_mutation as _has_metadata_mutation,
)
from torch._higher_order_ops.effects import _EffectType
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch._higher_order_ops.effects import with_effects
from torch.export._remove_effect_tokens_pass import _replace_with_effects_node
from torch._export.verifier import TrainingIRVerifier
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.nn.utils.stateless import _reparametrize_module

# custom autograd.Function capture (trace/autograd_function.py)
from torch._functorch.autograd_function import autograd_function_apply
from predispatch._torch_internals.autograd_function import (  # noqa: E402  (see its docstring)
    APPLY_CAPTURE,
    FORWARD_DETECTOR,
    SingleLevelFunction,
    detected_forwards,
    intercepted_applies,
    torch_apply,
)
from torch._guards import detect_fake_mode
from torch._ops import HigherOrderOperator
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    make_fx,
    track_tensor_tree,
)
from torch.utils._python_dispatch import _disable_current_modes

from predispatch._lazy import lazy_getattr
from predispatch._torch_internals.decomposition import ask as ask_decompose
from predispatch._torch_internals.decomposition import decomposition_hook, pristine_dispatch, torch_can_decompose_fast
from predispatch._torch_internals.mechanism import Hook, caller_frame, drift, patched, require
from predispatch._torch_versions import HAS, TESTED, TORCH, tested, warn_if_untested

__all__ = [
    "HAS",
    "ask_decompose",
    "Hook",
    "caller_frame",
    "is_generator_argument_error",
    "NOOP_SAVE_INPUTS",
    "TESTED",
    "TORCH",
    "drift",
    "require",
    "tested",
    "warn_if_untested",
    "fake_of_meta",
    "GLOBAL_SWITCHES",
    "GlobalSwitch",
    "AUTOCAST_DEVICE_TYPES",
    "UNREADABLE",
    "global_module_hook_tables",
    "torch_keeps_whole_in_export",
    "TrainingIRVerifier",
    "CIA",
    "OpOverload",
    "PreDispatchMode",
    "TorchDispatchMode",
    "aten_overloads",
    "cia_registrations",
    "enable_python_dispatcher",
    "has_cpp_cia_kernel",
    "load_op_db",
    "pytree",
    "python_cia_kernel",
    "run_cpp_cia_kernel",
    "side_effectful_ops",
    "storage_key",
    "ConstraintViolationError",
    "DATA_DEPENDENT_ERRORS",
    "make_fake_inputs",
    "produce_guards_and_solve_constraints",
    "HigherOrderOperator",
    "ProxyTorchDispatchMode",
    "autograd_function_apply",
    "detect_fake_mode",
    "discarding_unbacked_symbols",
    "free_symbols",
    "is_traced_tensor",
    "disable_proxy_modes_tracing",
    "outside_trace",
    "trace_functional",
    "trace_program",
    "trace_differentiated",
    "forward_frames_only",
    "ProgramTrace",
    "track_tensor_tree",
    "FakeTensor",
    "FakeTensorMode",
    "FunctionalTensor",
    "FunctionalTensorMode",
    "ShapeEnv",
    "aot_export_module",
    "decomposition_hook",
    "exporting_flags",
    "functional_dispatch_observer",
    "functional_value",
    "set_functional_value",
    "mutation_count",
    "wrap_functional",
    "wrap_with_autocast",
    "wrap_with_set_grad_enabled",
    "with_effects",
    "unwrap_effects",
    "mode_stack_depths",
    "new_fake_mode",
    "pop_modes_to",
    "pre_dispatch_modes",
    "SingleLevelFunction",
    "APPLY_CAPTURE",
    "FORWARD_DETECTOR",
    "detected_forwards",
    "intercepted_applies",
    "torch_apply",
    "TENSOR_HOOKS",
    "probe_register_hook",
    "DISPATCH_OBSERVER",
    "REGION_CAPTURE",
    "MODULE_HOOKS",
    "check_module_hook_tables",
    "FUNCTIONAL_REWRITES",
    "MODULE_CALLS",
    "inside_op_call",
    "generator_identity",
    "import_dynamo",
    "import_op_registrations",
    "reparametrize",
    "has_internal_overlap",
    "functional_rewrites",
    "patched",
    "generate_code",
    "meta_kernels",
    "dispatcher_op_names",
    "jit_op_schemas",
]

#: What torch raises when Python needs a value that only exists at run time.
DATA_DEPENDENT_ERRORS = (DataDependentOutputException, GuardOnDataDependentSymNode)


def new_fake_mode() -> FakeTensorMode:
    """A fake mode with a ShapeEnv: shapes are tracked symbolically, no real compute runs."""
    return FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=False)


def reparametrize(module: torch.nn.Module, tensors: dict[str, torch.Tensor], *, tie: bool = False):
    """Temporarily swap a module's parameters/buffers/tensor attributes by fully qualified name."""
    return _reparametrize_module(module, tensors, tie_weights=tie, strict=False, stack_weights=True)


@contextlib.contextmanager
def exporting_flags() -> Iterator[None]:
    """Make `torch.compiler.is_exporting()` and `is_compiling()` answer True while tracing.

    Libraries such as transformers read these flags to take their export-friendly code paths.
    """
    compiler = torch.compiler
    old = (compiler._is_compiling_flag, compiler._is_exporting_flag)
    compiler._is_compiling_flag, compiler._is_exporting_flag = True, True
    try:
        yield
    finally:
        compiler._is_compiling_flag, compiler._is_exporting_flag = old


TENSOR_HOOKS = "tensor hook capture (Tensor.register_hook)"
_PROBE_TENSOR = torch.empty(0)


def probe_register_hook() -> None:
    """Register a hook the way user code does (the patch answers it; nothing is registered)."""
    _PROBE_TENSOR.register_hook(None)


REGION_CAPTURE = "grad-mode region capture (make_fx recording torch._C._set_grad_enabled at PreDispatch)"
MODULE_HOOKS = "module hook capture (nn.Module's hook tables)"
DISPATCH_OBSERVER = "the dispatch observer (in-place ops seen at FunctionalTensorMode.__torch_dispatch__)"
FUNCTIONAL_REWRITES = "the functional rewrites (trace/decompose.py REWRITES, at FunctionalTensorMode.__torch_dispatch__)"
MODULE_CALLS = "module-call interception for repeated blocks (make_fx's _ModuleStackTracer.call_module)"

#: FunctionalTensorMode's own methods, before predispatch patches any (see `outside_trace`).
_PRISTINE_FUNCTIONAL_MODE = {
    name: FunctionalTensorMode.__dict__[name]
    for name in ("__torch_dispatch__", "_can_decompose")
    if name in FunctionalTensorMode.__dict__
}


@contextlib.contextmanager
def outside_trace(*, keep_decomposition_policy: bool = True) -> Iterator[None]:
    """Set the running trace aside: its dispatch, pre-dispatch and torch-function modes and
    predispatch's patches of FunctionalTensorMode; put everything back on exit.

    Code run inside sees a clean stack, so neither the outer graph nor the outer observers
    record what it runs.  A Function's subgraphs (`trace_functional`) keep the export's
    decomposition policy (`decomposition_hook`); an export nested in an export, and anything
    else that must run as if no trace were active, passes `keep_decomposition_policy=False`.
    """
    names = ["__torch_dispatch__"] if keep_decomposition_policy else list(_PRISTINE_FUNCTIONAL_MODE)
    outside = {**_PRISTINE_FUNCTIONAL_MODE, "__torch_dispatch__": pristine_dispatch(keep_decomposition_policy)}
    patched = {name: FunctionalTensorMode.__dict__[name] for name in names}
    function_modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        for name in names:
            setattr(FunctionalTensorMode, name, outside[name])
        with _disable_current_modes():
            yield
    finally:
        for name, method in patched.items():
            setattr(FunctionalTensorMode, name, method)
        for mode in reversed(function_modes):
            torch._C._push_on_torch_function_stack(mode)


def mode_stack_depths() -> tuple[int, int, int]:
    """Depths of the dispatch, pre-dispatch and function mode stacks (to check we left them as found)."""
    return (
        torch._C._len_torch_dispatch_stack(),
        _len_torch_dispatch_stack_pre_dispatch(),
        torch._C._len_torch_function_stack(),
    )


def pop_modes_to(depths: tuple[int, int, int]) -> None:
    """Pop dispatch/pre-dispatch/function modes left above `depths` by a failed trace."""
    from torch._ops import _pop_mode_from_pre_dispatch

    while torch._C._len_torch_dispatch_stack() > depths[0]:
        torch._C._pop_torch_dispatch_stack()
    while _len_torch_dispatch_stack_pre_dispatch() > depths[1]:
        _pop_mode_from_pre_dispatch()
    while torch._C._len_torch_function_stack() > depths[2]:
        torch._C._pop_torch_function_stack()


@contextlib.contextmanager
def functional_dispatch_observer(
    before: Callable[[FunctionalTensorMode, Any, tuple, dict], None], after: Callable[[Any, Any], None]
) -> Iterator[Hook]:
    """Call `before(mode, func, args, kwargs)` / `after(func, out)` around every op FunctionalTensorMode handles.

    The functional mode is where in-place ops are seen as in-place (below it they are already
    rewritten); predispatch watches them there to keep autograd history right.
    """

    def observed(original):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before(self, func, args, kwargs or {})
            out = original(self, func, types, args, kwargs)
            after(func, out)
            return out

        return __torch_dispatch__

    with patched(FunctionalTensorMode, "__torch_dispatch__", observed, mechanism=DISPATCH_OBSERVER) as hook:
        yield hook


@contextlib.contextmanager
def functional_rewrites(table: dict[OpOverload, tuple[Callable[..., Any], tuple[OpOverload, ...]]]) -> Iterator[Hook]:
    """Run `rewrite(*args, **kwargs)` in FunctionalTensorMode in place of `func`, for
    `table[func] = (rewrite, skips)`.

    For the ops torch's own path gets wrong or slow (see `REWRITES` in trace/decompose.py): a
    composite is rewritten only when the decomposition policy decomposes it and every composite
    in `skips` (those torch's path would pass through; `_can_decompose`, see
    `decomposition_hook`); the rewrite runs inside the mode again, so its own ops are
    functionalized as usual.
    """

    def rewriting(original):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            entry = table.get(func)
            if entry is None or not _rewrites(self, func, entry[1], args, kwargs or {}):
                return original(self, func, types, args, kwargs)
            with self:
                return entry[0](*args, **(kwargs or {}))

        return __torch_dispatch__

    with patched(FunctionalTensorMode, "__torch_dispatch__", rewriting, mechanism=FUNCTIONAL_REWRITES) as hook:
        yield hook


@contextlib.contextmanager
def meta_kernels(table: dict[OpOverload, Callable[[Callable[..., Any]], Callable[..., Any]]]) -> Iterator[None]:
    """While active, `op`'s Python Meta kernel is `table[op](original)` (see `FAST_INPLACE_META`
    in trace/decompose.py); the originals are back on exit, and the ops' dispatch caches cleared
    both ways, as `py_impl` clears them."""
    meta = torch._C.DispatchKey.Meta
    originals = {op: op.py_kernels[meta] for op in table if meta in op.py_kernels}
    try:
        for op, original in originals.items():
            op.py_kernels[meta] = table[op](original)
            op._dispatch_cache.clear()
        yield
    finally:
        for op, original in originals.items():
            op.py_kernels[meta] = original
            op._dispatch_cache.clear()


def has_no_internal_overlap(t: torch.Tensor) -> bool:
    """Whether no two elements of `t` share memory (torch's MemOverlap::No, from strides)."""
    return torch._debug_has_internal_overlap(t) == 0


def _rewrites(mode: FunctionalTensorMode, func: OpOverload, skips: tuple[OpOverload, ...], args: tuple, kwargs: dict) -> bool:
    """Whether the policy lets `func`'s rewrite run: a composite and everything it skips decompose."""
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), CIA)
    return not composite or all(ask_decompose(mode, op, args, kwargs) for op in (func, *skips))


def functional_value(t: FunctionalTensor) -> torch.Tensor:
    """The tensor a FunctionalTensor currently stands for (its latest functional value)."""
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def set_functional_value(t: FunctionalTensor, value: FunctionalTensor) -> None:
    """Make `t` stand for `value` from now on, as functionalization does for an in-place op's
    result: no op is traced (a `t.copy_(value)` would trace `aten.copy`, which build removes again)."""
    torch._functionalize_replace(t.elem, functional_value(value))
    torch._functionalize_commit_update(t.elem)
    torch._functionalize_sync(t.elem)


def mutation_count(t: torch.Tensor) -> int | None:
    """How many times a tensor of the running functional trace was changed in place so far
    (None for any other tensor): two counts differ when it changed in between."""
    return torch._functionalize_mutation_counter(t.elem) if isinstance(t, FunctionalTensor) else None


def wrap_functional(value: torch.Tensor, mode: FunctionalTensorMode) -> FunctionalTensor:
    """A FunctionalTensor for `value` (a tensor the tracer already knows) in functional mode `mode`."""
    return FunctionalTensor(torch._to_functional_tensor(value), mode)


def unwrap_effects(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    """Replace `with_effects(token, op, *args)` by `op(*args)` (torch's own rewrite)."""
    _replace_with_effects_node(node, None, {}, [], [], gm)


# --- custom autograd.Function capture (trace/autograd_function.py) ---------------------------

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


def trace_program(fn: Callable[..., Any], args: tuple[Any, ...], scope: torch.nn.Module) -> ProgramTrace:
    """Capture `fn(*args)` once: a functional graph at the PreDispatch key (call under the fake mode).

    What `aot_export_module(pre_dispatch=True)` records in its capture pass, without its
    metadata pass (a second run of the user's forward, with functionalization below
    PreDispatch, only to learn which inputs are mutated): FunctionalTensorMode on the
    PreDispatch stack over make_fx's proxy tracer, and the mutations read off the
    FunctionalTensor inputs after the run, as AOTAutograd's own metadata analysis reads them.
    `scope` names modules in each node's `nn_module_stack`.
    """
    mutated: list[int] = []
    metadata: list[int] = []
    storage: list[int] = []

    def functional(token: torch.Tensor, *inputs: Any) -> tuple[Any, ...]:
        with _functional_mode() as mode:
            with torch_function_disabled():  # metadata reads only (see `torch_function_disabled`)
                f_token, *wrapped = _to_functional((token, *inputs))
            mode._tokens = {effect: f_token for effect in _EffectType}
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
        gm = make_fx(functional, record_module_stack=True, pre_dispatch=True)(token, *args)
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
        frames = []
        frame = sys._getframe(1)
        while frame is not None:
            code = frame.f_code
            if (
                code.co_name == "forward"
                or code.co_filename.endswith("torch/__init__.py")
                or (code.co_filename, code.co_name) in _stack_trace_anchors()
            ):
                frames.append((code.co_filename, frame.f_lineno, code.co_name))
            frame = frame.f_back
        return _ForwardFrames(frames)

    def summary(self) -> traceback.StackSummary:
        return traceback.StackSummary.from_list([traceback.FrameSummary(*f) for f in reversed(self.frames)])


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


def is_traced_tensor(value: Any) -> bool:
    """Whether `value` is a tensor of a running trace (fake or functional), not a real constant."""
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(value, torch.Tensor) and (is_fake(value) or isinstance(value, FunctionalTensor))


# --- The composite audit (predispatch/audit/) -----------------------------------------------

CIA = torch._C.DispatchKey.CompositeImplicitAutograd


def cia_registrations() -> list[str]:
    """Names ("aten::to.dtype") of every op with a C++ CompositeImplicitAutograd kernel."""
    return list(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))


def aten_overloads() -> list[OpOverload]:
    """Every aten overload loaded in ``torch.ops.aten`` that the C++ dispatcher knows.

    ``torch.ops.aten`` also lists TorchScript-only overloads (``aten::add.t``); the
    dispatcher has never heard of those and answers questions about them with errors.
    """
    found = []
    for name in list(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        for overload in (getattr(packet, n) for n in packet.overloads()):  # `op_overloads()` is 2.13+
            if torch._C._dispatch_has_kernel(overload.name()):
                found.append(overload)
    return found


def has_cpp_cia_kernel(op: OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), CIA)


def python_cia_kernel(op: OpOverload) -> Callable[..., Any] | None:
    """The ``py_impl(CompositeImplicitAutograd)`` kernel, if torch registered one in Python."""
    kernel = op.py_kernels.get(CIA)
    return kernel if callable(kernel) and not isinstance(kernel, torch._C.DispatchKey) else None


def run_cpp_cia_kernel(op: OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run the C++ CIA kernel itself, skipping any Python kernel ``op.decompose`` would prefer."""
    return op._op_dk(CIA, *args, **kwargs)


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the StorageImpl behind ``t``: equal for every view of one storage.

    ``data_ptr`` would not do: every empty storage has data pointer 0.  Tensors without
    a storage (sparse, nested) have no key.
    """
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def side_effectful_ops() -> frozenset[OpOverload]:
    """The ops torch.fx refuses to dead-code-eliminate because they have side effects."""
    return frozenset(f for f in _side_effectful_functions if isinstance(f, OpOverload))


def load_op_db() -> list[Any]:
    """torch's OpInfo database; imported lazily because it takes a few seconds."""
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


class PreDispatchMode(SchemaCheckMode):
    """Base for a dispatch mode that sits on the PreDispatch key, above autograd.

    A mode there sees CompositeImplicitAutograd ops before their kernels decompose them.
    torch only admits three mode classes onto that key (``_set_mode_pre_dispatch``), one of
    them ``SchemaCheckMode``; subclassing it is the admission ticket, nothing of its checking
    is used.  The key is consulted only while the Python dispatcher is on: run under
    ``enable_python_dispatcher()``.
    """

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self, torch._C.DispatchKey.PreDispatch)


def torch_keeps_whole_in_export(op: OpOverload) -> bool:
    """Whether torch's own pre-dispatch export would keep `op` whole (its `_can_decompose` says no)."""
    return torch_can_decompose_fast(op, True, True) is False


def fake_of_meta(fake_mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor with `t`'s metadata on `device`: a meta model's weight, traced as if real.

    A model built under `torch.device("meta")` has no data, only shapes; tracing it on the meta
    device would record `device=meta` into factory ops and pick meta kernels' strides.  Its
    fakes are made on the device the real weights will live on (the inputs' device) instead.
    """
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, t, device)


# ep.module() as torch.export's unlifted module: pytree calling convention generated into its code
from torch.fx.graph import _PyTreeCodeGen as PyTreeCodeGen, _PyTreeInfo as PyTreeInfo  # noqa: E402
from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY as USER_PRESERVED_ATTRIBUTES  # noqa: E402

__all__ += ["PyTreeCodeGen", "PyTreeInfo", "USER_PRESERVED_ATTRIBUTES"]
# --- the joint forward-backward program (program/joint.py) ------------------------------------


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

    with fake_mode, enable_python_dispatcher(), torch.autograd.set_multithreading_enabled(False):
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
# --- torch's process-wide switches (predispatch/_isolation.py restores them after export) ------


#: What a switch's getter answers when torch cannot say (a setting this build does not have, or
#: the legacy matmul precision after the new fp32_precision API was used): never written back.
UNREADABLE = "<unreadable>"


@dataclasses.dataclass(frozen=True)
class GlobalSwitch:
    """One process-wide torch setting a forward can change: how it is read and written back.

    name: how users set it (the public call or attribute), for messages and tests.
    get: reads it now; `set(get())` must be a no-op.
    set: writes a value `get` returned.
    """

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]


def _fp32_precision(backend: str, op: str) -> GlobalSwitch:
    return GlobalSwitch(
        f"torch.backends.{backend}.{op}.fp32_precision" if backend != "generic" else "torch.backends.fp32_precision",
        lambda: torch._C._get_fp32_precision_getter(backend, op),
        lambda value: torch._C._set_fp32_precision_setter(backend, op, value),
    )


def _flush_denormal() -> bool:
    """torch has no getter for `set_flush_denormal`: a denormal double survives arithmetic
    only when flushing is off (CPUs without FTZ/DAZ never flush: always False there)."""
    with torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
        return torch.tensor([1e-310], dtype=torch.float64).mul(2.0).item() == 0.0


def _default_device_context() -> Any:
    return getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)


def _set_default_device_context(context: Any) -> None:
    """Put back the `torch.set_default_device` context object itself: exit the one forward
    set (its mode sits at the bottom of the function mode stack) and re-enter the saved one."""
    torch.set_default_device(None)
    if context is not None:
        context.__enter__()
        torch._GLOBAL_DEVICE_CONTEXT.device_context = context


def _print_options() -> dict[str, Any]:
    return dict(vars(torch._tensor_str.PRINT_OPTS))


def _set_print_options(options: dict[str, Any]) -> None:
    vars(torch._tensor_str.PRINT_OPTS).update(options)


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _set_anomaly(value: tuple[bool, bool]) -> None:
    torch.set_anomaly_enabled(value[0], value[1])


def _set_opt_einsum(value: tuple[bool, Any]) -> None:
    import torch.backends.opt_einsum as opt_einsum

    opt_einsum.enabled = value[0]
    if value[0] and value[1] is not None:
        opt_einsum.strategy = value[1]


def _opt_einsum() -> tuple[bool, Any]:
    import torch.backends.opt_einsum as opt_einsum

    return (opt_einsum.enabled, opt_einsum.strategy)


def _setting_of(obj: Any, attr: str) -> GlobalSwitch:
    """A switch that is a plain module attribute (`torch.backends.mha._is_fastpath_enabled`)."""
    return GlobalSwitch(f"{obj.__name__}.{attr}", lambda: getattr(obj, attr), lambda v: setattr(obj, attr, v))


def _c_switch(name: str, getter: str, setter: str) -> GlobalSwitch | None:
    """A `torch._C` getter/setter pair; a getter returning a tuple is set with it spread
    (`_get_cublas_allow_fp16_reduced_precision_reduction` gives `(allow, allow_splitk)`)."""
    read, write = getattr(torch._C, getter, None), getattr(torch._C, setter, None)
    if read is None or write is None:  # not in this torch (2.11 has no grad layout switch): nothing to restore
        return None
    return GlobalSwitch(name, lambda: _readable(read), lambda v: write(*v) if isinstance(v, tuple) else write(v))


def _readable(read: Callable[[], Any]) -> Any:
    """torch's legacy TF32 getters refuse to answer once the new fp32_precision API was used."""
    try:
        value = read()
    except RuntimeError:
        return UNREADABLE
    return UNREADABLE if value is None else value


def _config_switch(module_name: str) -> GlobalSwitch:
    """A torch config module's values (`torch._dynamo.config`, `torch._functorch.config`), which
    forward may set: read as a copy, written back key by key (only the keys that differ, so
    deprecated keys are not written and warn nothing)."""

    def config() -> Any:
        import importlib

        return importlib.import_module(module_name)

    def put_back(saved: dict[str, Any]) -> None:
        now = config().get_config_copy()
        config().load_config({key: value for key, value in saved.items() if now.get(key) != value})

    return GlobalSwitch(module_name, lambda: config().get_config_copy(), put_back)


def _float32_matmul_precision() -> str:
    """torch refuses to answer once the legacy and the new fp32_precision APIs were mixed."""
    return _readable(torch.get_float32_matmul_precision)


#: Every process-wide switch a forward can flip, enumerated from torch 2.13's `torch/__init__.py`,
#: `torch/backends/*/__init__.py`, `torch/autograd`, the `torch._C._set_*`/`_get_*` pairs, the JIT's
#: and functorch's flags, and the Dynamo and functorch config modules.
#: In restore order: the fp32_precision entries last (the legacy switches write them too).
#: Not here, and why: `set_num_interop_threads` (can be called once, before any parallel work;
#: eager raises on a second call, so there is nothing to restore), grad mode, default dtype,
#: autocast and the RNG (`_isolation.GlobalState` has them), `torch.backends.xnnpack.enabled`,
#: `cpu.get_cpu_capability`, `mkl`/`openmp`/`mps`/`kleidiai`/`cusparselt` (read-only), the cuFFT
#: plan cache and workspace sizes (CUDA allocations, not switches), the mode stacks (popped to
#: their depths by `_isolation`), and the JIT's executor switches (TorchScript only).
_SWITCHES: tuple[GlobalSwitch | None, ...] = (
    GlobalSwitch(
        "torch.use_deterministic_algorithms",
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        _set_deterministic,
    ),
    _c_switch(
        "torch.utils.deterministic.fill_uninitialized_memory",
        "_get_deterministic_fill_uninitialized_memory",
        "_set_deterministic_fill_uninitialized_memory",
    ),
    GlobalSwitch("torch.set_num_threads", torch.get_num_threads, torch.set_num_threads),
    GlobalSwitch("torch.set_float32_matmul_precision", _float32_matmul_precision, torch.set_float32_matmul_precision),
    GlobalSwitch("torch.set_flush_denormal", _flush_denormal, torch.set_flush_denormal),
    GlobalSwitch("torch.set_warn_always", torch.is_warn_always_enabled, torch.set_warn_always),
    GlobalSwitch("torch.set_default_device", _default_device_context, _set_default_device_context),
    GlobalSwitch("torch.set_printoptions", _print_options, _set_print_options),
    GlobalSwitch(
        "torch.autograd.set_detect_anomaly",
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        _set_anomaly,
    ),
    _c_switch("torch.autograd.set_multithreading_enabled", "_is_multithreading_enabled", "_set_multithreading_enabled"),
    _c_switch("torch.autograd.forward_ad (forward grad)", "_is_fwd_grad_enabled", "_set_fwd_grad_enabled"),
    _c_switch("torch.autograd._force_original_view_tracking", "_is_view_replay_enabled", "_set_view_replay_enabled"),
    _c_switch("torch._C._set_grad_layout_enforcement_enabled", "_is_grad_layout_enforcement_enabled", "_set_grad_layout_enforcement_enabled"),
    _c_switch("torch._C._set_autograd_fallback_mode", "_get_autograd_fallback_mode", "_set_autograd_fallback_mode"),
    _c_switch("torch._C._set_backcompat_broadcast_warn", "_get_backcompat_broadcast_warn", "_set_backcompat_broadcast_warn"),
    _c_switch("torch._C._set_backcompat_keepdim_warn", "_get_backcompat_keepdim_warn", "_set_backcompat_keepdim_warn"),
    GlobalSwitch(
        "torch.sparse.check_sparse_tensor_invariants",
        torch.sparse.check_sparse_tensor_invariants.is_enabled,
        torch._C._set_check_sparse_tensor_invariants,
    ),
    _c_switch("torch.backends.cudnn.enabled", "_get_cudnn_enabled", "_set_cudnn_enabled"),
    _c_switch("torch.backends.cudnn.benchmark", "_get_cudnn_benchmark", "_set_cudnn_benchmark"),
    _c_switch("torch.backends.cudnn.deterministic", "_get_cudnn_deterministic", "_set_cudnn_deterministic"),
    _c_switch("torch.backends.cudnn.allow_tf32", "_get_cudnn_allow_tf32", "_set_cudnn_allow_tf32"),
    _c_switch("torch.backends.cudnn.depthwise_kernel", "_get_cudnn_depthwise_kernel", "_set_cudnn_depthwise_kernel"),
    _c_switch("torch.backends.miopen.immediate", "_get_miopen_immediate", "_set_miopen_immediate"),
    _c_switch("torch.backends.mkldnn.enabled", "_get_mkldnn_enabled", "_set_mkldnn_enabled"),
    _c_switch("torch.backends.mkldnn.deterministic", "_get_mkldnn_deterministic", "_set_mkldnn_deterministic"),
    _c_switch("torch.backends.mkldnn.allow_tf32", "_get_onednn_allow_tf32", "_set_onednn_allow_tf32"),
    _c_switch("torch.backends.nnpack.set_flags", "_get_nnpack_enabled", "_set_nnpack_enabled"),
    _c_switch("torch.backends.quantized.engine", "_get_qengine", "_set_qengine"),
    GlobalSwitch("torch.backends.opt_einsum.enabled/strategy", _opt_einsum, _set_opt_einsum),
    GlobalSwitch(
        "torch.backends.mha.set_fastpath_enabled",
        lambda: torch.backends.mha.get_fastpath_enabled(),
        lambda v: torch.backends.mha.set_fastpath_enabled(v),
    ),
    _c_switch("torch.backends.cuda.matmul.allow_tf32", "_get_cublas_allow_tf32", "_set_cublas_allow_tf32"),
    _c_switch(
        "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
        "_get_cublas_allow_fp16_reduced_precision_reduction",
        "_set_cublas_allow_fp16_reduced_precision_reduction",
    ),
    _c_switch(
        "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
        "_get_cublas_allow_bf16_reduced_precision_reduction",
        "_set_cublas_allow_bf16_reduced_precision_reduction",
    ),
    _c_switch("torch.backends.cuda.matmul.allow_fp16_accumulation", "_get_cublas_allow_fp16_accumulation", "_set_cublas_allow_fp16_accumulation"),
    _c_switch(
        "torch.backends.cpu (fp16 reduced precision reduction)",
        "_get_cpu_allow_fp16_reduced_precision_reduction",
        "_set_cpu_allow_fp16_reduced_precision_reduction",
    ),
    _c_switch("torch.backends.cuda.preferred_linalg_library", "_get_linalg_preferred_backend", "_set_linalg_preferred_backend"),
    _c_switch("torch.backends.cuda.preferred_blas_library", "_get_blas_preferred_backend", "_set_blas_preferred_backend"),
    _c_switch("torch.backends.cuda.preferred_rocm_fa_library", "_get_rocm_fa_preferred_backend", "_set_rocm_fa_preferred_backend"),
    _c_switch("torch.backends.cuda.enable_flash_sdp", "_get_flash_sdp_enabled", "_set_sdp_use_flash"),
    _c_switch("torch.backends.cuda.enable_mem_efficient_sdp", "_get_mem_efficient_sdp_enabled", "_set_sdp_use_mem_efficient"),
    _c_switch("torch.backends.cuda.enable_math_sdp", "_get_math_sdp_enabled", "_set_sdp_use_math"),
    _c_switch("torch.backends.cuda.enable_cudnn_sdp", "_get_cudnn_sdp_enabled", "_set_sdp_use_cudnn"),
    _c_switch("torch.backends.cuda (fa3 sdp)", "_get_fa3_sdp_enabled", "_set_sdp_use_fa3"),
    _c_switch("torch.backends.cuda (overrideable sdp)", "_get_overrideable_sdp_enabled", "_set_sdp_use_overrideable"),
    _c_switch(
        "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp",
        "_get_math_sdp_allow_fp16_bf16_reduction",
        "_set_math_sdp_allow_fp16_bf16_reduction",
    ),
    _c_switch("torch.nn.attention (sdpa priority order)", "_get_sdp_priority_order", "_set_sdp_priority_order"),
    GlobalSwitch(
        "torch.jit enabled (torch.jit._state.disable/enable)",
        lambda: torch.jit._state._enabled.enabled,
        lambda value: setattr(torch.jit._state._enabled, "enabled", value),
    ),
    GlobalSwitch(
        "torch._C._functorch._set_vmap_fallback_enabled",
        lambda: torch._C._functorch._is_vmap_fallback_enabled(),
        lambda value: torch._C._functorch._set_vmap_fallback_enabled(value),
    ),
    _config_switch("torch._functorch.config"),
    _config_switch("torch._dynamo.config"),
    # last: the legacy switches above (matmul precision, allow_tf32) also write these
    *(
        _fp32_precision(backend, op)
        for backend, ops in (("generic", ("all",)), ("cuda", ("all", "matmul", "conv", "rnn")), ("mkldnn", ("all", "matmul", "conv", "rnn")))
        for op in ops
    ),
)
GLOBAL_SWITCHES: tuple[GlobalSwitch, ...] = tuple(switch for switch in _SWITCHES if switch is not None)


#: Every hook table torch 2.11-2.15 gives an nn.Module (`module._backward_hooks`, ...) and keeps
#: process-wide (`nn.modules.module._global_backward_hooks`, ...): the module hook capture, its
#: refusals and the isolation handle exactly these.  A table torch adds is a hook the trace would
#: run, or drop, unseen: `check_module_hook_tables` raises before anything is traced.
KNOWN_MODULE_HOOK_TABLES = frozenset({
    "_backward_hooks", "_backward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called",
    "_forward_hooks_with_kwargs", "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs",
    "_load_state_dict_post_hooks", "_load_state_dict_pre_hooks", "_state_dict_hooks", "_state_dict_pre_hooks",
})
KNOWN_GLOBAL_HOOK_TABLES = frozenset({
    "_global_backward_hooks", "_global_backward_pre_hooks", "_global_buffer_registration_hooks",
    "_global_forward_hooks", "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
    "_global_forward_pre_hooks", "_global_module_registration_hooks", "_global_parameter_registration_hooks",
})


def check_module_hook_tables() -> None:
    """Raise `TorchDriftError` unless torch's module hook tables are exactly the known ones."""
    from torch.nn.modules import module as module_globals

    tables = {name for name, value in vars(torch.nn.Module()).items() if "hook" in name and isinstance(value, dict)}
    global_tables = {name for name, value in vars(module_globals).items() if name.startswith("_global_") and "hook" in name and isinstance(value, dict)}
    unknown = (tables - KNOWN_MODULE_HOOK_TABLES) | (global_tables - KNOWN_GLOBAL_HOOK_TABLES)
    missing = ({"_backward_hooks", "_backward_pre_hooks"} - tables) | ({"_global_backward_hooks", "_global_backward_pre_hooks"} - global_tables)
    if unknown or missing:
        raise drift(MODULE_HOOKS, f"nn.Module's hook tables changed (new: {sorted(unknown)}, gone: {sorted(missing)})")


def _autocast_device_types() -> tuple[str, ...]:
    """The device types whose autocast state torch keeps (each has its own on/off and dtype)."""
    candidates = ("cpu", "cuda", "xpu", "hpu", "mps", "xla", "mtia", "maia", "ipu", torch._C._get_privateuse1_backend_name())
    kept = []
    for device in dict.fromkeys(candidates):
        try:
            torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        except (RuntimeError, ValueError, TypeError):
            continue
        kept.append(device)
    return tuple(kept)


#: Every device type with an autocast state in this torch (`_isolation.GlobalState` restores each).
AUTOCAST_DEVICE_TYPES = _autocast_device_types()


def global_module_hook_tables() -> tuple[dict, ...]:
    """torch's process-wide module hook tables (`nn.modules.module.register_module_forward_hook`
    and friends): a forward registering one would leave it for every later module call."""
    from torch.nn.modules import module

    return (
        module._global_buffer_registration_hooks,
        module._global_module_registration_hooks,
        module._global_parameter_registration_hooks,
        module._global_backward_pre_hooks,
        module._global_backward_hooks,
        module._global_forward_pre_hooks,
        module._global_forward_hooks,
        module._global_forward_hooks_always_called,
        module._global_forward_hooks_with_kwargs,
    )
# --- ep.module()'s write-back checks (program/writes.py) ---------------------------------------

def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of `t` share memory for sure (an expanded tensor): eager's in-place
    ops refuse such a target (`assert_no_internal_overlap`); "too hard to tell" counts as no, as
    in eager."""
    return torch._debug_has_internal_overlap(t) == 1
#: Names whose modules import torch._dynamo (about 1 s of CPU): imported on first use, so
#: `import predispatch` and the CLI's help do not pay for them.  `load` (and `show`) imports
#: torch._dynamo anyway: its node metadata are fake tensors, and torch's `FakeTensorMode.__init__`
#: runs `import torch._dynamo.config`, which imports the whole package; but not these modules.
_LAZY = {
    "aot_export_module": "torch._functorch.aot_autograd",
    "make_fake_inputs": "torch._export.non_strict_utils",
    "produce_guards_and_solve_constraints": "torch._export.non_strict_utils",
}


__getattr__ = lazy_getattr(globals(), _LAZY)  # a `_LAZY` name is imported when first asked for


def fx_reserved_names() -> frozenset[str]:
    """Names FX's code generator will not give a node (Python keywords, builtins such as
    `input`, and its own globals such as `torch`, `inf`): it renames such a node `input_1`."""
    from torch.fx.graph import _illegal_names

    return frozenset(_illegal_names)


def declare_size_symbol(fake_mode: FakeTensorMode, name: str, low: int, high: int | None, hint: int) -> Any:
    """A size symbol named `name` in `fake_mode`'s ShapeEnv, with its range and example value.

    For a loaded program: its graph's fake tensors get the symbols the exporting trace had
    (same names, same ranges), so printing, `to_torch()`'s range_constraints and the call
    check see what the original saw.  torch's own symbols are integer and positive.
    """
    import sympy
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges

    env = fake_mode.shape_env
    symbol = sympy.Symbol(name, integer=True, positive=True)
    env.backed_var_to_val[symbol] = sympy.Integer(hint)
    env.var_to_range[symbol] = ValueRanges(low, int_oo if high is None else high)
    return symbol


def size_symint(fake_mode: FakeTensorMode, expr: Any, hint: int) -> torch.SymInt:
    """A SymInt for `expr` (over symbols from `declare_size_symbol`) in `fake_mode`."""
    return fake_mode.shape_env.create_symintnode(expr, hint=hint)


def symbol_ranges(fake_mode_or_env: Any, symbols: Any) -> dict:
    """torch.export's `range_constraints` for `symbols`: each one's ValueRanges in the ShapeEnv."""
    env = getattr(fake_mode_or_env, "shape_env", fake_mode_or_env)
    return {s: env.var_to_range[s] for s in symbols}
def dispatcher_op_names() -> frozenset[str]:
    """`ns::name.overload` (`ns::name` for the default overload) of every op the dispatcher holds.

    TorchScript's interpreter builtins (`aten::len.t`, `aten::save`) are JIT operators only and
    are not listed, though `torch.ops.aten.<name>` resolves them too.
    """
    return frozenset(torch._C._dispatch_get_all_op_names())


def jit_op_schemas() -> list[torch._C.FunctionSchema]:
    """The schema of every op `torch.ops` can resolve: dispatcher ops and TorchScript builtins."""
    return list(torch._C._jit_get_all_schemas())


def import_dynamo() -> None:
    """Import `torch._dynamo` now, before export patches torch's seeding functions.

    Importing it replaces `torch.manual_seed` by a Dynamo-disabled copy.  Export patches that
    function while forward runs (trace/rng.py) and the trace imports Dynamo lazily; imported
    inside that window, Dynamo would wrap the patch and the restore would drop its wrapper.
    `import predispatch` stays free of Dynamo: only an export pays for it.
    """
    import torch._dynamo  # noqa: F401
# --- repeated blocks (trace/dedup/) -----------------------------------------------------------

from torch._higher_order_ops.invoke_subgraph import invoke_subgraph  # noqa: E402
from torch.fx.experimental.proxy_tensor import (  # noqa: E402
    _AttrProxy,
    _ModuleStackTracer,
    get_proxy_mode,
    get_proxy_slot,
)


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


# ---- a GraphModule that generates its Python code only when it is run or printed -----------------

from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule  # noqa: E402
from torch.fx._lazy_graph_module import _use_lazy_graph_module  # noqa: E402


def generate_code(gm: torch.fx.GraphModule) -> None:
    """Generate `gm`'s Python code from its graph now, as a plain GraphModule: one the trace
    made lazily (`trace_program`) becomes a GraphModule like any other, so the program holds
    no lazy module (whose code would be made at its first call or print)."""
    if isinstance(gm, LazyGraphModule):

        class GraphModuleImpl(torch.fx.GraphModule):  # what GraphModule.__new__ makes per instance
            pass

        # the name subgraphs are known by (a captured Function's `straight_through`)
        GraphModuleImpl.__name__, GraphModuleImpl.__qualname__ = type(gm).__name__, type(gm).__qualname__
        gm.__class__ = GraphModuleImpl
    gm.recompile()


def torch_function_disabled() -> Any:
    """A context in which Python code reads tensors (`.shape`, `.stride()`, storages) without
    the running trace's torch-function modes seeing each read: each costs a trip through the
    mode stack, and torch's metadata mode would record the read as the `torch_fn` of the next
    node created.  Dispatch modes (functionalization, the proxy tracer) are untouched."""
    return torch._C.DisableTorchFunction()


def import_op_registrations() -> None:
    """Import the torch modules that register ops in the namespaces the allow list decides.

    `prims.inductor_*`, `prims.fma`, `prims._low_memory_max_pool_*` ... are registered when
    `torch._inductor` is imported: without this the registry, and so the allow list generated
    from it, would depend on whether the process had compiled anything before.
    """
    import torch._inductor.inductor_prims  # noqa: F401


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


# --- ep.module()'s write-back checks (program/writes.py) ----------------------------------------


def view_creation_meta(t: torch.Tensor) -> str:
    """How autograd recorded the view `t` was made (`"DEFAULT"`, `"MULTI_OUTPUT_NODE"`,
    `"NO_GRAD_MODE"`, ...): eager refuses an in-place change with grad mode on to any but a
    DEFAULT one (`handle_view_on_rebase`); "DEFAULT" for a tensor that is not a view."""
    if not t._is_view():
        return "DEFAULT"
    return torch._C._autograd._get_creation_meta(t).name


# --- state that shares storage (frontend/shared_storage.py, trace/functional.py) ---------------

def mutated_in_trace(t: torch.Tensor) -> bool:
    """Whether a graph input of the running functional trace had its data changed so far
    (directly or through a view), by AOTAutograd's own test; False for any other tensor."""
    if not isinstance(t, FunctionalTensor):
        return False
    torch._sync(t)
    return bool(_has_data_mutation(t))


# --- torch's joint export for ExecuTorch's training runtime (program/exported_program.py) -----


def export_forward_backward(ep: Any, loss_index: int = 0) -> Any:
    """torch's `_export_forward_backward`: the program's joint forward-backward graph with the
    loss marked (LOSS_OUTPUT) and the gradients as GRADIENT_TO_PARAMETER outputs, the form
    ExecuTorch's training runtime reads (torch.export.experimental, torch 2.13)."""
    from torch.export.experimental import _export_forward_backward

    return _export_forward_backward(ep, joint_loss_index=loss_index)
