"""`export()`: one call per stage; the table of contents of the pipeline.

    prepare  (frontend/)  module or function + args -> PreparedInputs (named, lifted, fake)
    trace    (trace/)     PreparedInputs -> TracedGraph (functional, pre-dispatch, one trace);
                          custom_backward/ captures Functions and backward hooks with their backwards
    build    (program/)   PreparedInputs + TracedGraph -> ExportedProgram (passes/, signature)

After export, `ExportedProgram`'s methods (program/exported_program.py) delegate, one job a package:
    run        (runtime/)     ep.module() -> fx.GraphModule: unlift.module_of builds it; each call
                              goes through runner.py (input checks, the graph, writes.py's write-backs),
                              modes.py (train/eval, dtype and copy contracts), names.py (safe names)
    store      (serialize/)   predispatch.save / load (_files.py) -> archive.py: the zip, its JSON
                              (graph.py, values.py, shapes.py); every loaded file is checked by
                              verify.py against op_allowlist.py and kernel_inputs.py before use
    transform  (transforms/)  ep.joint() -> joint.py; ep.to_torch() -> to_torch.py and its lowering
                              passes (recompose_for_torch, lower_for_inference, lower_batch_norm_stats)
The records every stage shares (InputSpec, ExportSignature, ...) are in signature.py; imports go
one way: program -> serialize -> runtime -> transforms (tests/test_layout.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from predispatch import _torch_internals as ti
from predispatch._isolation import isolated
from predispatch.frontend import modules_of, prepare, refuse_per_rank_options, registrations, walks_shared
from predispatch.errors import UnsupportedInputError, user_frame
from predispatch.program import ExportedProgram, build_program
from predispatch.program.train_eval import TrainEvalProgram
from predispatch.trace import DecompositionPolicy, is_tracing, trace
from predispatch.trace.dedup import Dedup


def export(
    module_or_fn: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    *,
    preserve: Iterable[Any] = (),
    decompose: Iterable[Any] = (),
    dynamic_shapes: Any = None,
    dedup: bool | str = True,
) -> ExportedProgram:
    """Capture `module_or_fn(*args, **kwargs)` as a functional pre-dispatch ATen program.

    Args:
        module_or_fn: an `nn.Module`, or a function.
        args: positional example inputs, a tuple; leaves are tensors or constants.
        kwargs: keyword example inputs.
        preserve: composite ops (OpOverloads or names like "aten.linear") to keep whole.
        decompose: composite ops to always decompose.
        dynamic_shapes: which input dimensions are symbolic, exactly as `torch.export.export`
            takes them (`{"x": {0: torch.export.Dim("batch", min=1, max=64)}}`).
        dedup: True: repeated blocks (decoder layers) are traced twice, compared, and their
            later calls replay one shared body as `invoke_subgraph` nodes; False: every call
            traced inline; "verify": every call traced and checked against its shared body.

    Tracing runs on fake tensors: no real compute, no copy of the weights.  The module and
    torch's global state are left exactly as they were, whether export succeeds or raises.
    """
    policy = DecompositionPolicy.from_user(preserve, decompose)
    return _export_with_policy(module_or_fn, args, kwargs, policy, dynamic_shapes, Dedup.from_user(dedup))


def _export_with_policy(
    module_or_fn: Any,
    args: tuple,
    kwargs: dict | None,
    policy: DecompositionPolicy,
    dynamic_shapes: Any = None,
    dedup: Dedup = Dedup.ON,
) -> ExportedProgram:
    """`export` once the user's options are checked (tests call it to bypass those checks).

    One export at a time in a process (Note [Export touches only its own thread]): the hooks a
    trace places in torch are served to its own thread only, but two traces placing and removing
    them at once would remove each other's; a second thread's export waits.  The lock is
    re-entrant: an export nested in the running one (same thread) goes on.
    """
    with _ONE_EXPORT_AT_A_TIME:
        return _export_locked(module_or_fn, args, kwargs, policy, dynamic_shapes, dedup)


# Note [Export touches only its own thread]
# -----------------------------------------
# While one thread exports, others keep running torch: every function export swaps in torch
# (`ti.patched`, the forward and ctx hooks of custom Functions (Note [Seeing every apply]), trace/rng.py's generator changers) serves the
# exporting thread only and gives every other thread torch's own; the generators other threads
# draw from are never rewound (Note [Another thread's draws during an export]); and exports
# themselves are serialised by this lock.  One effect is process-wide: the cyclic garbage
# collector is paused for the length of the trace (`_no_garbage_collection` in
# trace/functional.py: a finalizer it would run is Python code, executed inside the trace) and
# resumed after, if it was on; `gc.collect()` still collects, and reference counting frees as
# usual.
_ONE_EXPORT_AT_A_TIME = threading.RLock()


def _export_locked(
    module_or_fn: Any,
    args: tuple,
    kwargs: dict | None,
    policy: DecompositionPolicy,
    dynamic_shapes: Any,
    dedup: Dedup,
) -> ExportedProgram:
    """`_export_with_policy` under the lock."""
    if is_tracing():  # called by the code another export is tracing
        with registrations.journal(), ti.outside_trace(keep_decomposition_policy=False), isolated(
                modules_of(module_or_fn, args, kwargs), module_or_fn):
            return _export_nested(module_or_fn, args, kwargs, policy)
    # Ctrl-C is raised between ops (a safe point) or at the end: where torch's C++ calls Python,
    # it would abort the process (ti.interrupts_at_safe_points)
    with ti.interrupts_at_safe_points(), registrations.journal():  # registrations undone if anything below fails
        with walks_shared() as walked, isolated(modules_of(module_or_fn, args, kwargs), module_or_fn):
            prepared = prepare(module_or_fn, args, kwargs, dynamic_shapes)
            walked.clear()  # forward may change what is reachable: a walk from here on is fresh
            refuse_per_rank_options(prepared.placements, (*policy.preserve, *policy.decompose))
            traced = trace(prepared, policy, dedup)
        return build_program(prepared, traced)


def _export_nested(module_or_fn: Any, args: tuple, kwargs: dict | None, policy: DecompositionPolicy) -> ExportedProgram:
    """Export code reached by an outer export's trace.

    The inputs are the outer trace's tensors: only their metadata is used.  The program
    reads its state from the live module at each call (`live=True`), so when the outer trace
    runs `ep.module()`, the inner graph is traced into the outer one over the outer trace's
    lifted parameters: the inner program is inlined, as if the code had been called directly.
    """
    prepared = prepare(module_or_fn, args, kwargs)
    return build_program(prepared, trace(prepared, policy), live=True)


def export_train_eval(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, **options: Any) -> TrainEvalProgram:
    """`export` the module twice, with `module.train()` and with `module.eval()`; the result's
    `module()` switches between the two programs with `.train()`/`.eval()` as the module does.

    The module's training flags are put back as they were.  Options are `export`'s.  See Note
    [One mode per program] in predispatch/runtime/modes.py.
    """
    import torch

    if not isinstance(module, torch.nn.Module):
        raise UnsupportedInputError(
            f"export_train_eval() takes an nn.Module, got {type(module).__name__}.",
            where=user_frame(),
            fix="export a function with predispatch.export; it has no train/eval mode.",
        )
    flags = [(m, m.training) for m in module.modules()]
    try:
        train_program = export(module.train(), args, kwargs, **options)
        eval_program = export(module.eval(), args, kwargs, **options)
    finally:
        for m, flag in flags:
            m.training = flag
    return TrainEvalProgram(train_program, eval_program, flags[0][1])
