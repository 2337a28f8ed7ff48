"""torch's process-wide switches and hook tables, enumerated from torch itself:
`_isolation.GlobalState` restores every switch after export, and `check_module_hook_tables`
raises if torch adds a hook table the capture does not know.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

from predispatch._torch_internals.functional import MODULE_HOOKS
from predispatch._torch_internals.mechanism import drift


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
    setters: the functions of torch's C modules that write it (`torch._C._set_cudnn_enabled`),
        by qualified name: with `NOT_RESTORED`, every such function torch has is decided
        (`undecided_setters`).
    """

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    setters: tuple[str, ...] = ()


def _fp32_precision(backend: str, op: str) -> GlobalSwitch:
    return GlobalSwitch(
        f"torch.backends.{backend}.{op}.fp32_precision" if backend != "generic" else "torch.backends.fp32_precision",
        lambda: torch._C._get_fp32_precision_getter(backend, op),
        lambda value: torch._C._set_fp32_precision_setter(backend, op, value),
        ("torch._C._set_fp32_precision_setter",),
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
    return GlobalSwitch(
        name, lambda: _readable(read), lambda v: write(*v) if isinstance(v, tuple) else write(v), (f"torch._C.{setter}",)
    )


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


def _saved_tensors_hooks_stack() -> tuple[tuple[Any, Any], ...]:
    """The thread's saved-tensors default hooks (`torch.autograd.graph.saved_tensors_hooks`),
    bottom first.  torch reads only the top: the stack is read by popping every pair and
    pushing them back (it is thread-local: no other thread sees it meanwhile)."""
    autograd = torch._C._autograd
    popped = []
    while (top := autograd._top_saved_tensors_default_hooks(True)) is not None:
        popped.append(top)
        autograd._pop_saved_tensors_default_hooks()
    stack = tuple(reversed(popped))
    _push_saved_tensors_hooks(stack)
    return stack


def _set_saved_tensors_hooks_stack(stack: tuple[tuple[Any, Any], ...]) -> None:
    autograd = torch._C._autograd
    while autograd._top_saved_tensors_default_hooks(True) is not None:
        autograd._pop_saved_tensors_default_hooks()
    _push_saved_tensors_hooks(stack)


def _push_saved_tensors_hooks(stack: tuple[tuple[Any, Any], ...]) -> None:
    """Push `stack` (bottom first), also while `disable_saved_tensors_hooks` is in force (torch
    refuses a push then): enabled for the pushes, disabled again with its message."""
    autograd = torch._C._autograd
    message = _saved_tensors_hooks_disabled()
    if message is not None:
        autograd._saved_tensors_hooks_enable()
    try:
        for pack, unpack in stack:
            autograd._push_saved_tensors_default_hooks(pack, unpack)
    finally:
        if message is not None:
            autograd._saved_tensors_hooks_disable(message, False)


def _saved_tensors_hooks_disabled() -> str | None:
    """`disable_saved_tensors_hooks`'s message while it is in force, else None."""
    autograd = torch._C._autograd
    return None if autograd._saved_tensors_hooks_is_enabled() else autograd._saved_tensors_hooks_get_disabled_error_message()


def _set_saved_tensors_hooks_disabled(message: str | None) -> None:
    autograd = torch._C._autograd
    if message is None:
        autograd._saved_tensors_hooks_enable()
    else:
        autograd._saved_tensors_hooks_disable(message, False)  # the stack is put back separately


def _vmap_fallback_warnings() -> bool:
    """Whether functorch's vmap warns when an op has no batching rule.  torch has a setter
    (`torch._C._functorch._set_vmap_fallback_warning_enabled`) but no getter: read by running
    torch's test op without a batching rule under vmap and looking for the warning (with the
    fallback itself enabled for the probe, and put back)."""
    functorch = torch._C._functorch
    fallback = functorch._is_vmap_fallback_enabled()
    functorch._set_vmap_fallback_enabled(True)
    try:
        with warnings.catch_warnings(record=True) as caught, torch._C._DisableTorchDispatch(), torch._C.DisableTorchFunction():
            warnings.simplefilter("always")
            ones = torch.ones(2, 1)
            torch.vmap(torch._C._VariableFunctions._test_functorch_fallback)(ones, ones)
    finally:
        functorch._set_vmap_fallback_enabled(fallback)
    return any("batching rule" in str(w.message) for w in caught)


def _float32_matmul_precision() -> str:
    """torch refuses to answer once the legacy and the new fp32_precision APIs were mixed."""
    return _readable(torch.get_float32_matmul_precision)


#: Every process-wide (or thread-wide) switch a forward can flip, enumerated from torch 2.13's
#: `torch/__init__.py`, `torch/backends/*/__init__.py`, `torch/autograd`, the `torch._C._set_*`/`_get_*`
#: pairs, the JIT's and functorch's flags, and the Dynamo and functorch config modules; every setter
#: of torch's C modules is either here (`setters`) or in `NOT_RESTORED` (`undecided_setters`).
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
        ("torch._C._set_deterministic_algorithms",),
    ),
    _c_switch(
        "torch.utils.deterministic.fill_uninitialized_memory",
        "_get_deterministic_fill_uninitialized_memory",
        "_set_deterministic_fill_uninitialized_memory",
    ),
    GlobalSwitch("torch.set_num_threads", torch.get_num_threads, torch.set_num_threads, ("torch._C.set_num_threads",)),
    GlobalSwitch(
        "torch.set_float32_matmul_precision",
        _float32_matmul_precision,
        torch.set_float32_matmul_precision,
        ("torch._C._set_float32_matmul_precision",),
    ),
    GlobalSwitch("torch.set_flush_denormal", _flush_denormal, torch.set_flush_denormal, ("torch._C.set_flush_denormal",)),
    GlobalSwitch("torch.set_warn_always", torch.is_warn_always_enabled, torch.set_warn_always, ("torch._C._set_warnAlways",)),
    GlobalSwitch("torch.set_default_device", _default_device_context, _set_default_device_context),
    GlobalSwitch("torch.set_printoptions", _print_options, _set_print_options),
    GlobalSwitch(
        "torch.autograd.set_detect_anomaly",
        lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        _set_anomaly,
        ("torch._C.set_anomaly_enabled",),
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
        ("torch._C._set_check_sparse_tensor_invariants",),
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
    _c_switch("torch.backends.cuda (fa4 sdp)", "_get_fa4_sdp_enabled", "_set_sdp_use_fa4"),
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
        ("torch._C._functorch._set_vmap_fallback_enabled",),
    ),
    GlobalSwitch(
        "torch._C._functorch._set_vmap_fallback_warning_enabled",
        _vmap_fallback_warnings,
        lambda value: torch._C._functorch._set_vmap_fallback_warning_enabled(value),
        ("torch._C._functorch._set_vmap_fallback_warning_enabled",),
    ),
    _c_switch(
        "torch._C._debug_only_display_vmap_fallback_warnings",
        "_debug_only_are_vmap_fallback_warnings_enabled",
        "_debug_only_display_vmap_fallback_warnings",
    ),
    # the stack first: pushing it back needs the hooks enabled (`_push_saved_tensors_hooks`)
    GlobalSwitch(
        "torch.autograd.graph.saved_tensors_hooks (the stack)",
        _saved_tensors_hooks_stack,
        _set_saved_tensors_hooks_stack,
        ("torch._C._autograd._push_saved_tensors_default_hooks", "torch._C._autograd._pop_saved_tensors_default_hooks"),
    ),
    GlobalSwitch(
        "torch.autograd.graph.disable_saved_tensors_hooks",
        _saved_tensors_hooks_disabled,
        _set_saved_tensors_hooks_disabled,
        ("torch._C._autograd._saved_tensors_hooks_disable", "torch._C._autograd._saved_tensors_hooks_enable"),
    ),
    _c_switch(
        "torch.distributed.tensor.experimental.implicit_replication",
        "_get_dtensor_allow_implicit_replication",
        "_set_dtensor_allow_implicit_replication",
    ),
    _c_switch(
        "torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch",
        "_warn_on_accumulate_grad_stream_mismatch",
        "_set_warn_on_accumulate_grad_stream_mismatch",
    ),
    _c_switch("torch._C._set_sm_carveout_experimental", "_get_sm_carveout_experimental", "_set_sm_carveout_experimental"),
    _c_switch("torch._C._set_only_lift_cpu_tensors", "_only_lift_cpu_tensors", "_set_only_lift_cpu_tensors"),
    _c_switch("torch.backends.cuda.matmul (cublasLt grouped gemm)", "_get_cublaslt_prefer_grouped_gemm", "_set_cublaslt_prefer_grouped_gemm"),
    _c_switch("torch._C._set_native_aot_enabled", "_get_native_aot_enabled", "_set_native_aot_enabled"),
    _c_switch("torch._C._set_native_aot_unconditional_masked", "_get_native_aot_unconditional_masked", "_set_native_aot_unconditional_masked"),
    _c_switch("torch.cuda.tunable.enable", "_cuda_tunableop_is_enabled", "_cuda_tunableop_enable"),
    _c_switch("torch.cuda.tunable.tuning_enable", "_cuda_tunableop_tuning_is_enabled", "_cuda_tunableop_tuning_enable"),
    _c_switch("torch.cuda.tunable.record_untuned_enable", "_cuda_record_untuned_is_enabled", "_cuda_record_untuned_enable"),
    _c_switch(
        "torch.cuda.tunable (wildcard fallback)", "_cuda_tunableop_wildcard_fallback_is_enabled", "_cuda_tunableop_wildcard_fallback_enable"
    ),
    _c_switch("torch.cuda.memory (caching allocator)", "_cuda_cudaCachingAllocator_is_enabled", "_cuda_cudaCachingAllocator_enable"),
    # Dynamo's first use in a process (torch.cond, while_loop: `TorchPatcher.patch`) turns
    # distributions' argument validation off for good; a user's later `Normal(0, -1)` would
    # no longer raise (a Python setting: no C setter)
    GlobalSwitch(
        "torch.distributions.Distribution.set_default_validate_args",
        lambda: torch.distributions.Distribution._validate_args,
        torch.distributions.Distribution.set_default_validate_args,
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

_PER_TENSOR = "a flag of one tensor, not of the process"
_DISPATCH_STATE = "the dispatcher's own thread-local state, set and reset by torch's context managers around their work"
_TORCHSCRIPT = "TorchScript's tracer and executor (predispatch never runs TorchScript)"
_CUDA_GRAPHS = "CUDA graph capture internals (predispatch never captures CUDA graphs)"
_PROCESS = "process plumbing (DataLoader workers, crash reports, thread names): no effect on any result"

#: torch's C setters that no `GLOBAL_SWITCHES` entry restores, with why (in torch 2.11-2.15).
NOT_RESTORED: dict[str, str] = {
    "torch._C._set_grad_enabled": "grad mode: `_isolation.GlobalState` restores it",
    "torch._C._set_default_dtype": "the default dtype: `_isolation.GlobalState` restores it",
    "torch._C._set_default_tensor_type": "sets the default dtype, which `_isolation.GlobalState` restores",
    **{f"torch._C.{name}": "autocast: `_isolation.GlobalState` restores every device type's" for name in (
        "set_autocast_cache_enabled", "set_autocast_cpu_dtype", "set_autocast_cpu_enabled", "set_autocast_dtype",
        "set_autocast_enabled", "set_autocast_gpu_dtype", "set_autocast_ipu_dtype", "set_autocast_ipu_enabled",
        "set_autocast_xla_dtype", "set_autocast_xla_enabled")},
    "torch._C.set_num_interop_threads": "can be called once, before any parallel work: eager raises on a second call",
    **{f"torch._C.{name}": "the mode stacks: `_isolation` pops them to their depths" for name in (
        "_push_on_torch_dispatch_stack", "_pop_torch_dispatch_stack", "_push_on_torch_function_stack",
        "_pop_torch_function_stack")},
    **{f"torch._C.{name}": _DISPATCH_STATE for name in (
        "_set_dispatch_mode", "_set_torch_function_state", "_set_skip_next_torch_function",
        "_set_meta_in_tls_dispatch_include")},
    "torch._C._functorch._set_dynamic_layer_keys_included": _DISPATCH_STATE,
    "torch._C._functorch.set_inplace_requires_grad_allowed": _DISPATCH_STATE,
    "torch._C._functorch.set_single_level_autograd_function_allowed": _DISPATCH_STATE,
    **{f"torch._C.{name}": _PER_TENSOR for name in (
        "_set_conj", "_set_neg", "_set_tensor_metadata", "_set_throw_on_mutable_data_ptr",
        "_set_warn_deprecated_on_mutable_data_ptr", "_set_storage_access_error_msg",
        "_set_storage_data_ptr_access_error_msg", "_set_fake_constant")},
    "torch._C._autograd._set_creation_meta": _PER_TENSOR,
    **{f"torch._C.{name}": _TORCHSCRIPT for name in ("_set_tracing_state", "_set_value_trace", "_set_graph_executor_optimize")},
    **{f"torch._C.{name}": _CUDA_GRAPHS for name in ("_set_cached_tensors_enabled", "_set_graph_exec_group", "_set_override_stale_capture_stream")},
    **{f"torch._C.{name}": _PROCESS for name in (
        "_set_worker_pids", "_set_worker_signal_handlers", "_set_print_stack_traces_on_fatal_signal", "_set_thread_name",
        "set_vital")},
    "torch._C._cuda_cudaCachingAllocator_enable": "CUDA's caching allocator on or off: memory placement, not results "
    "(restored where torch can read it: 2.12 and later)",
    "torch._C._set_default_mobile_cpu_allocator": "the mobile CPU allocator (no getter; memory placement, not results)",
    "torch._C._set_generator_metaclass": "registered once, when torch is imported",
    "torch._C._set_should_use_format_with_string_table": "the profiler's output format",
    "torch._C._autograd._set_empty_test_observer": "a hook for torch's own tests",
    "torch._C._autograd._push_node_creation_hook": "torch's compiled autograd sets it for its own work and pops it",
    "torch._C._autograd._pop_node_creation_hook": "torch's compiled autograd sets it for its own work and pops it",
}

#: Which functions of torch's C modules count as setters (`undecided_setters`).
_SETTER_NAME = re.compile(r"^_(set|push|pop)_|^_push_on_|_enable$|_disable$|^set_|^_debug_only_display_")
_C_MODULES = ("torch._C", "torch._C._functorch", "torch._C._autograd")


def undecided_setters() -> list[str]:
    """torch's C setters this torch has that neither a switch restores nor `NOT_RESTORED`
    explains: a new one is a setting export might leave changed (tests/test_isolation.py)."""
    decided = {name for switch in GLOBAL_SWITCHES for name in switch.setters} | set(NOT_RESTORED)
    found = []
    for module_name in _C_MODULES:
        module = importlib.import_module(module_name)
        for name in dir(module):
            if _SETTER_NAME.search(name) and callable(getattr(module, name)) and f"{module_name}.{name}" not in decided:
                found.append(f"{module_name}.{name}")
    return sorted(found)


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


# --- the pytree registry (frontend/registrations.py) --------------------------------------------


def deregister_pytree_node(cls: type) -> None:
    """Undo `torch.utils._pytree.register_dataclass` / `register_pytree_node` of `cls` (torch's
    own `_deregister_pytree_node`: the node, its serialized name, constant-ness)."""
    import torch.utils._pytree as pytree

    if cls in pytree.SUPPORTED_NODES:
        try:
            undo = pytree._deregister_pytree_node
        except AttributeError:
            raise drift("undoing a failed export's pytree registrations", "torch.utils._pytree._deregister_pytree_node does not exist") from None
        undo(cls)
