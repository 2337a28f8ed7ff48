"""The one place that imports torch's private APIs.

predispatch reuses torch's own machinery (make_fx's proxy tracer, FunctionalTensorMode on the
PreDispatch mode stack, fake tensors, AOTAutograd's mutation analysis; AOTAutograd's export
entry point is kept as the tests' reference) instead of reimplementing it.  Those live
behind underscores and move between releases, so every private name we use is imported here
and nowhere else: a torch upgrade touches this package only.

By concern, one module each; every name is re-exported here, so the rest of predispatch reads
`ti.<name>` without knowing which module holds it:
    mechanism.py          `patched` and `Hook`: how a patch of torch proves it engaged; drift checks
    autograd_function.py  every `Function.apply` call, seen inside torch's C++ apply
    decomposition.py      the decomposition question (which composites stay whole), per release
    tracing.py            the one functional trace, module-call interception, the joint's trace
    functional.py         FunctionalTensorMode and the mode stacks; functional tensors' values
    switches.py           torch's process-wide switches and hook tables (restored after export)
    generators.py         a generator's state layout: moved only by draws, or reseeded?
    audit.py              what the composite audit asks of the dispatcher
    codegen.py            FX code generation, size symbols and op registries (build and load)
    distributed.py        c10d's boxed process groups, reductions and works; FX's module getattr
    dtensor.py            AOTAutograd's per-rank joint of a DTensor model, partitioned
    nested.py             jagged nested tensors: their constructors under the trace, dynamic marks
"""

from __future__ import annotations

import torch.utils.checkpoint
import torch._decomp.decompositions  # noqa: F401  (registers Python CIA kernels via py_impl)
from torch._dispatch.python import enable_python_dispatcher
from torch._ops import OpOverload
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch._higher_order_ops.wrap import wrap_with_autocast, wrap_with_set_grad_enabled
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch._higher_order_ops.effects import with_effects
from torch._export.verifier import SpecViolationError, TrainingIRVerifier
from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch._functorch.autograd_function import autograd_function_apply
from predispatch._torch_internals.autograd_function import (
    APPLY_CAPTURE,
    FORWARD_REDIRECT,
    Run,
    SingleLevelFunction,
    redirected_applies,
    torch_apply,
    unrecorded_grad_mode,
)
from torch._guards import detect_fake_mode
from torch._ops import HigherOrderOperator
from torch.fx.experimental.proxy_tensor import (
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    track_tensor_tree,
)
from predispatch._lazy import lazy_getattr
from predispatch._torch_internals.decomposition import ask as ask_decompose
from predispatch._torch_internals.decomposition import decomposition_hook, pristine_dispatch, torch_can_decompose_fast
from predispatch._torch_internals.mechanism import (
    Hook,
    caller_frame,
    drift,
    interrupts_at_safe_points,
    interrupts_deferred,
    patched,
    raise_held_interrupt,
    require,
)
from predispatch._torch_versions import HAS, TESTED, TORCH, tested, warn_if_untested
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
from torch.fx.graph import _PyTreeCodeGen as PyTreeCodeGen, _PyTreeInfo as PyTreeInfo
from torch.fx.graph_module import _USER_PRESERVED_ATTRIBUTES_KEY as USER_PRESERVED_ATTRIBUTES

from predispatch._torch_internals.generators import only_drawn_from  # noqa: F401
from predispatch._torch_internals.nested import (  # noqa: F401
    JAGGED_CONSTRUCTORS,
    NESTED_VIEW_DUMMY,
    NO_FAKE_KERNEL,
    NestedTensor,
    is_strided_nested,
    jagged_constructors_traceable,
    lazy_symbolic_sizes,
    same_sizes,
    drop_nested_int_guards,
)
from predispatch._torch_internals import nested as _nested
from predispatch._torch_internals.audit import (  # noqa: F401
    aten_overloads,
    CIA,
    cia_registrations,
    fake_of_meta,
    has_cpp_cia_kernel,
    load_op_db,
    PreDispatchMode,
    python_cia_kernel,
    run_cpp_cia_kernel,
    side_effectful_ops,
    storage_key,
    torch_keeps_whole_in_export,
)
from predispatch._torch_internals.codegen import (  # noqa: F401
    declare_size_symbol,
    declare_unbacked_symbol,
    dispatcher_op_names,
    export_forward_backward,
    fx_reserved_names,
    generate_code,
    import_dynamo,
    import_op_registrations,
    jit_op_schemas,
    size_functions,
    size_symint,
    symbol_ranges,
    symbolic_bool,
    torch_function_disabled,
    unbacked_symbols,
)
from predispatch._torch_internals.distributed import (  # noqa: F401
    completed_work,
    FX_MODULE_GETATTR,
    group_of,
    reduce_op_kind,
)
from predispatch._torch_internals.dtensor import PerRankGraphs, Slot, per_rank_graphs  # noqa: F401
from predispatch._torch_internals.functional import (  # noqa: F401
    DISPATCH_OBSERVER,
    functional_dispatch_observer,
    FUNCTIONAL_REWRITES,
    functional_rewrites,
    functional_value,
    functorch_active,
    below_vmap,
    grad_levels_missing,
    memory_of,
    vmap_levels,
    has_internal_overlap,
    has_no_internal_overlap,
    meta_kernels,
    mode_stack_depths,
    MODULE_CALLS,
    MODULE_HOOKS,
    mutated_in_trace,
    mutation_count,
    outside_trace,
    pop_modes_to,
    probe_register_hook,
    REGION_CAPTURE,
    set_functional_value,
    SUBCLASS_DISPATCH,
    subclass_dispatch,
    in_subclass_dispatch,
    inside_subclass_dispatch,
    TENSOR_HOOKS,
    unwrap_effects,
    view_creation_meta,
    wrap_functional,
)
from predispatch._torch_internals.switches import (  # noqa: F401
    _set_default_device_context,
    AUTOCAST_DEVICE_TYPES,
    check_module_hook_tables,
    deregister_pytree_node,
    global_module_hook_tables,
    GLOBAL_SWITCHES,
    GlobalSwitch,
    KNOWN_GLOBAL_HOOK_TABLES,
    KNOWN_MODULE_HOOK_TABLES,
    NOT_RESTORED,
    UNREADABLE,
    undecided_setters,
)
from predispatch._torch_internals.tracing import (  # noqa: F401
    fake_empty,
    fake_of_plain,
    _ForwardFrames,
    backends_off,
    current_tracer,
    DATA_DEPENDENT_ERRORS,
    discarding_unbacked_symbols,
    dynamic_dims,
    fake_with_dynamic_dims,
    dispatch_keys,
    exporting_flags,
    fake_inputs_only,
    flex_attention_index_inline,
    forward_frames_only,
    generator_identity,
    inside_op_call,
    intercept_module_calls,
    is_generator_argument_error,
    is_numpy_conversion_error,
    named_dims,
    is_traced_tensor,
    new_fake_mode,
    NOOP_SAVE_INPUTS,
    pre_dispatch_modes,
    ProgramTrace,
    reparametrize,
    SUBCLASS_CONSTRUCTORS,
    subclass_constructors_unrecorded,
    trace_differentiated,
    trace_functional,
    trace_program,
    traced_below_autograd,
    traced_node,
)

__all__ = [
    "HAS",
    "ask_decompose",
    "Hook",
    "caller_frame",
    "is_generator_argument_error",
    "is_numpy_conversion_error",
    "NOOP_SAVE_INPUTS",
    "TESTED",
    "TORCH",
    "drift",
    "require",
    "tested",
    "warn_if_untested",
    "fake_of_meta",
    "GLOBAL_SWITCHES",
    "NOT_RESTORED",
    "undecided_setters",
    "GlobalSwitch",
    "AUTOCAST_DEVICE_TYPES",
    "UNREADABLE",
    "global_module_hook_tables",
    "torch_keeps_whole_in_export",
    "SpecViolationError",
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
    "named_dims",
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
    "traced_below_autograd",
    "dispatch_keys",
    "trace_differentiated",
    "fake_empty",
    "fake_of_plain",
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
    "fake_inputs_only",
    "flex_attention_index_inline",
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
    "FORWARD_REDIRECT",
    "Run",
    "redirected_applies",
    "torch_apply",
    "unrecorded_grad_mode",
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
    "only_drawn_from",
    "import_dynamo",
    "import_op_registrations",
    "reparametrize",
    "has_internal_overlap",
    "functional_rewrites",
    "patched",
    "interrupts_deferred",
    "interrupts_at_safe_points",
    "raise_held_interrupt",
    "generate_code",
    "meta_kernels",
    "dispatcher_op_names",
    "jit_op_schemas",
]


__all__ += ["dynamic_dims", "fake_with_dynamic_dims", *_nested.__all__]
__all__ += ["PyTreeCodeGen", "PyTreeInfo", "USER_PRESERVED_ATTRIBUTES", "LazyGraphModule", "invoke_subgraph", "is_traceable_wrapper_subclass"]


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

