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
import torch._decomp.decompositions  # noqa: F401  (registers Python CIA kernels via py_impl)
from torch._dispatch.python import enable_python_dispatcher
from torch._ops import OpOverload
from torch._subclasses.schema_check_mode import SchemaCheckMode
from torch.fx.node import _side_effectful_functions
from torch.fx.proxy import _STACK_TRACE_ANCHORS
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch._functorch.aot_autograd import aot_export_module
from torch._functorch._aot_autograd.functional_utils import (
    has_data_mutation as _has_data_mutation,
    has_metadata_mutation as _has_metadata_mutation,
)
from torch._higher_order_ops.effects import _EffectType
from torch._dynamo.utils import _disable_saved_tensors_hooks_during_tracing
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensor, FakeTensorMode
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode, _can_decompose_fast
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv
from torch._higher_order_ops.effects import with_effects
from torch.export._remove_effect_tokens_pass import _replace_with_effects_node
from torch._export.verifier import TrainingIRVerifier
from torch._export.non_strict_utils import make_fake_inputs, produce_guards_and_solve_constraints
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.nn.utils.stateless import _reparametrize_module

# custom autograd.Function capture (trace/autograd_function.py)
from torch._functorch.autograd_function import autograd_function_apply
from torch._guards import detect_fake_mode
from torch._ops import HigherOrderOperator
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    make_fx,
    track_tensor_tree,
)
from torch.utils._python_dispatch import _disable_current_modes

__all__ = [
    "fake_of_meta",
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
    "mutation_count",
    "wrap_functional",
    "wrap_with_autocast",
    "wrap_with_set_grad_enabled",
    "with_effects",
    "unwrap_effects",
    "mode_stack_depths",
    "new_fake_mode",
    "pop_modes_to",
    "reparametrize",
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


@contextlib.contextmanager
def decomposition_hook(should_decompose: Callable[[Any, Callable[[], bool]], bool]) -> Iterator[None]:
    """Route FunctionalTensorMode's "decompose this composite?" question to `should_decompose`.

    FunctionalTensorMode sits on the PreDispatch stack and sees every op before its
    CompositeImplicitAutograd kernel would run.  It asks `_can_decompose` whether to inline
    the composite; we answer from predispatch's policy, handing it torch's own answer as a
    thunk so the policy can defer to it (for example for ops with aliasing schemas).
    """
    original = FunctionalTensorMode._can_decompose

    def _can_decompose(self, func, args, kwargs):
        return should_decompose(func, lambda: original(self, func, args, kwargs))

    FunctionalTensorMode._can_decompose = _can_decompose
    try:
        yield
    finally:
        FunctionalTensorMode._can_decompose = original


#: FunctionalTensorMode's own methods, before predispatch patches any (see `outside_trace`).
_PRISTINE_FUNCTIONAL_MODE = {
    name: FunctionalTensorMode.__dict__[name] for name in ("__torch_dispatch__", "_can_decompose")
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
    patched = {name: FunctionalTensorMode.__dict__[name] for name in names}
    function_modes = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())]
    try:
        for name in names:
            setattr(FunctionalTensorMode, name, _PRISTINE_FUNCTIONAL_MODE[name])
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
) -> Iterator[None]:
    """Call `before(mode, func, args, kwargs)` / `after(func, out)` around every op FunctionalTensorMode handles.

    The functional mode is where in-place ops are seen as in-place (below it they are already
    rewritten); predispatch watches them there to keep autograd history right.
    """
    original = FunctionalTensorMode.__torch_dispatch__

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before(self, func, args, kwargs or {})
        out = original(self, func, types, args, kwargs)
        after(func, out)
        return out

    FunctionalTensorMode.__torch_dispatch__ = __torch_dispatch__
    try:
        yield
    finally:
        FunctionalTensorMode.__torch_dispatch__ = original


def functional_value(t: FunctionalTensor) -> torch.Tensor:
    """The tensor a FunctionalTensor currently stands for (its latest functional value)."""
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


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

    graph_module: inputs `(token, *args)`, outputs `(*new values of data_mutated, *fn's outputs)`;
        `token` orders effectful ops (`with_effects`); trace/functional.py's
        `_remove_effect_tokens` takes it out again.
    data_mutated / metadata_mutated: positions in `args` whose data / shape, strides or storage
        `fn` changed in place.
    """

    graph_module: torch.fx.GraphModule
    data_mutated: tuple[int, ...]
    metadata_mutated: tuple[int, ...]


def trace_program(fn: Callable[..., Any], args: tuple[Any, ...], scope: torch.nn.Module) -> ProgramTrace:
    """Capture `fn(*args)` once: a functional graph at the PreDispatch key (call under the fake mode).

    What `aot_export_module(pre_dispatch=True)` records in its capture pass, without its
    metadata pass (a second run of the user's forward, with functionalization below
    PreDispatch, only to learn which inputs are mutated): FunctionalTensorMode on the
    PreDispatch stack over make_fx's proxy tracer, and the mutations read off the
    FunctionalTensor inputs after the run, as AOTAutograd's own metadata analysis reads them.
    `scope` names modules in each node's `nn_module_stack`.
    """
    data: list[int] = []
    metadata: list[int] = []

    def functional(token: torch.Tensor, *inputs: Any) -> tuple[Any, ...]:
        with _functional_mode() as mode:
            f_token, *wrapped = _to_functional((token, *inputs))
            mode._tokens = {effect: f_token for effect in _EffectType}
            out = fn(*wrapped)
            for i, (data_changed, meta_changed) in enumerate(_mutations(wrapped, inputs)):
                if meta_changed:
                    metadata.append(i)
                elif data_changed:
                    data.append(i)
            new_values = [functional_value(wrapped[i]) for i in data]
            out = torch.utils._pytree.tree_map_only(FunctionalTensor, functional_value, out)
        return (*new_values, *out)

    functional._orig_mod = scope  # make_fx's module-stack tracer names modules from here
    with contextlib.ExitStack() as stack:
        stack.enter_context(enable_python_dispatcher())
        stack.enter_context(torch.autograd.set_multithreading_enabled(False))
        stack.enter_context(_disable_saved_tensors_hooks_during_tracing())
        stack.enter_context(forward_frames_only())
        token = torch.empty(0)
        gm = make_fx(functional, record_module_stack=True, pre_dispatch=True)(token, *args)
    return ProgramTrace(gm, tuple(data), tuple(metadata))


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
                or (code.co_filename, code.co_name) in _STACK_TRACE_ANCHORS
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
    original = torch.fx.proxy.CapturedTraceback
    torch.fx.proxy.CapturedTraceback = _ForwardFrames
    try:
        yield
    finally:
        torch.fx.proxy.CapturedTraceback = original


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
    (`torch._functorch._aot_autograd.functional_utils`); a storage swap (`set_`) counts as metadata."""
    for f_arg, arg in zip(wrapped, originals):
        if not isinstance(f_arg, FunctionalTensor):
            yield False, False
            continue
        torch._sync(f_arg)
        meta_changed = _has_metadata_mutation(f_arg, arg, check_only_storage_mutation=False)
        yield _has_data_mutation(f_arg) and not meta_changed, meta_changed


def discarding_unbacked_symbols(fake_mode: FakeTensorMode):
    """Symbols for data-dependent values (`.item()`) created now are used and dropped inside
    a subgraph: the outer trace must not look for them among its own outputs."""
    if fake_mode.shape_env is None:
        return contextlib.nullcontext()
    return fake_mode.shape_env.ignore_fresh_unbacked_symbols()


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
        for overload in getattr(torch.ops.aten, name).op_overloads():
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
    return _can_decompose_fast(op, True, True) is False


def fake_of_meta(fake_mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor with `t`'s metadata on `device`: a meta model's weight, traced as if real.

    A model built under `torch.device("meta")` has no data, only shapes; tracing it on the meta
    device would record `device=meta` into factory ops and pick meta kernels' strides.  Its
    fakes are made on the device the real weights will live on (the inputs' device) instead.
    """
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, t, device)


# --- repeated blocks (trace/dedup/) -----------------------------------------------------------

from torch._higher_order_ops.invoke_subgraph import invoke_subgraph  # noqa: E402
from torch.fx.experimental.proxy_tensor import (  # noqa: E402
    _AttrProxy,
    _ModuleStackTracer,
    get_proxy_mode,
    get_proxy_slot,
)


@contextlib.contextmanager
def intercept_module_calls(handler: Callable[[torch.nn.Module, Callable[..., Any], tuple, dict], Any]) -> Iterator[None]:
    """While active, each submodule call make_fx's module-stack tracer meets runs as
    `handler(module, call, args, kwargs)`, where `call(*args, **kwargs)` runs the module as usual.

    The handler runs inside the tracer's own `call_module`, so the module is already on
    `nn_module_stack` and nodes the handler creates are attributed to it.  Modules the tracer
    does not attribute (GraphModules, shared-module proxies) are not handed over.
    """
    original = _ModuleStackTracer.__dict__["call_module"]

    def call_module(self, m, forward, args, kwargs):
        if isinstance(m, (torch.fx.GraphModule, _AttrProxy)):
            return original(self, m, forward, args, kwargs)
        return original(self, m, lambda *a, **k: handler(m, forward, a, k), args, kwargs)

    _ModuleStackTracer.call_module = call_module
    try:
        yield
    finally:
        _ModuleStackTracer.call_module = original


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
