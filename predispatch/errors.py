"""One exception class per user-facing failure.

Every message says what is wrong, where (the user's file:line, or the input's pytree path),
and what to do instead, and ends with a link to its entry in docs/errors.md.  Each class's
docstring is that entry in short: cause, example, fix.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from types import TracebackType

_DOCS = "docs/errors.md"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class PredispatchError(Exception):
    """Base class of every error predispatch raises on purpose."""

    anchor = "predispatchError"
    #: the torch exception this error was raised from, when it was (see `from_torch`)
    torch_error: BaseException | None = None

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None):
        self.what, self.where, self.fix = what, where, fix
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [self.what]
        if self.where:
            lines.append(f"  at {self.where}")
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        lines.append(f"  see {_DOCS}#{self.anchor}")
        return "\n".join(lines)


class UnsupportedInputError(PredispatchError):
    """What was passed to `export` is not something it can trace.

    Cause: `module_or_fn` is not an `nn.Module` or a callable, `args` is not a tuple, an input
    leaf is of a type that is neither a tensor nor a constant (None, bool, int, float, str), a
    kwargs key is not a string, an input is quantized, or the module's state holds inference
    tensors (built under `torch.inference_mode()`), or a lazy module's uninitialized parameters,
    or forward reads a tensor requiring grad from outside the module (a module-level Parameter).
    Example: `export(model, x)` instead of `export(model, (x,))`.
    Fix: pass positional arguments as a tuple and keyword arguments as a dict.
    """

    anchor = "unsupportedinputerror"


class UnsupportedOutputError(PredispatchError):
    """The traced code returned something that is not a tensor or a pytree of tensors.

    Cause: an output leaf is an object predispatch cannot put in a graph (a module, a custom
    class that is not a registered pytree node).
    Example: `return self.layer` or `return MyResult(x)` with `MyResult` a plain class.
    Fix: return tensors, or tuples/lists/dicts/dataclasses of tensors; register custom
    containers with `torch.utils._pytree.register_pytree_node`.
    """

    anchor = "unsupportedoutputerror"


class DataDependentError(PredispatchError):
    """Python control flow depends on the value inside a tensor.

    Cause: export traces with fake tensors that have shapes but no values, so
    `if x.sum() > 0:` or `int(x.max())` has no answer at trace time.
    Example: `if (x > 0).all(): ...`.
    Fix: the one that fits the statement (trace/data_dependent.py): a branch computes both arms
    and picks with `torch.where`, or uses `torch.cond(pred, true_fn, false_fn, operands)`, both
    only for arms of one shape (else: one shape, or the branch out of forward); a `while` loop
    uses `while_loop`; a loop count read from a tensor a `while_loop` over a counter or a
    Python int.  A check inside torch's own code (`FakeQuantize`, a distribution's
    `validate_args`) gets the fix that fits it instead, and so does numpy given a traced tensor
    (`t.numpy()`, `np.asarray(t)`, `np.linspace(0, t.item(), n)`): torch ops instead of numpy,
    or the numpy work done before export.
    """

    anchor = "datadependenterror"


class TraceError(PredispatchError):
    """torch could not trace the user's code; torch's error is kept as `err.torch_error`.

    Cause: an operation that functional pre-dispatch tracing does not support (for example a
    metadata mutation such as `self.b.t_()` of a buffer, a storage swap `x.set_(y)`, a
    mutation of a tensor passed at two places, or a buffer replaced in forward by a tensor of
    another shape), or a raw torch failure.
    Fix: the message names the line and gives the fix that fits the cause (`y = x.t()` instead
    of `x.t_()` for a metadata change); a raw torch failure says where torch's error is.
    """

    anchor = "traceerror"


class SharedStorageError(PredispatchError):
    """The module's state tensors share memory in a way export cannot lift as views of one tensor.

    Cause: overlapping parameters, buffers or tensor attributes are lifted as views of the one
    that holds them all (Note [State that shares storage] in frontend/shared_storage.py); that
    fails when none holds the others whole, when that one does not start its storage contiguously,
    when a view has another dtype, or when a parameter is the view (its gradient is its own).
    Example: `self.a = nn.Parameter(t[:3]); self.b = nn.Parameter(t[1:])` on one tensor `t`.
    Fix: give the tensor its own memory (`.clone()`), or share the tensor object itself.
    """

    anchor = "sharedstorageerror"


class UnsupportedConstructError(PredispatchError):
    """forward uses a construct export cannot capture as eager runs it; refused by name.

    Cause: what a torch.func transform inside forward does that export cannot keep (a grad-mode
    change in the transformed function, a failure there), a TorchScript submodule (`torch.jit.script`), `nn.TransformerEncoder`'s
    nested-tensor fast path (eval mode with a `src_key_padding_mask`), whose output eager
    computes differently under `torch.no_grad()` than the traced program does,
    `torch.autograd.grad` inside forward, `pack_padded_sequence` (sizes from data), a tensor
    made by `torch.from_numpy` in forward (made without its values by the fake mode), or a
    flex_attention score_mod indexing a captured tensor that carries a gradient.
    Example: `with torch.no_grad():` inside a function given to `torch.func.vmap` in forward.
    Fix: the message says what to do for each construct (apply the transform to `ep.module()`,
    export the module before scripting it, build the encoder with `enable_nested_tensor=False`).
    """

    anchor = "unsupportedconstructerror"


class InputMismatchError(PredispatchError):
    """A program was called with inputs that differ from the ones it was exported for.

    Cause: a different pytree structure, a constant (int, bool, None, ...) of another value, or
    a tensor of another shape, dtype or device than at export.
    Fix: call with inputs of the exported structure, or export again with the new ones.
    """

    anchor = "inputmismatcherror"


class ProgramCallError(PredispatchError, TypeError):
    """An `ExportedProgram` was called directly, as if it were a module.

    Cause: the program is a description (graph, signature, state); what runs it is its module.
    Example: `ep = predispatch.export(model, (x,)); ep(x)`.
    Fix: `ep.module()(x)`: build the module once and call it as often as you like.
    A TypeError too, as calling any other non-callable object is.
    """

    anchor = "programcallerror"


class NotAProgramError(PredispatchError, TypeError):
    """An API that takes a predispatch `ExportedProgram` was given something else.

    Cause: a `torch.export.ExportedProgram`, a `TrainEvalProgram` (two programs), the module
    `ep.module()` returns, or any other object passed to `predispatch.save`.
    Example: `predispatch.save(torch.export.export(model, (x,)), "m.pd")`.
    Fix: save what `predispatch.export` returns; `torch.export.save` for torch's programs; each
    of a `TrainEvalProgram`'s `train_program` and `eval_program` on its own.
    A TypeError too, as Python's own wrong-argument errors are.
    """

    anchor = "notaprogramerror"


class NonFunctionalGraphError(PredispatchError):
    """A mutable op survived into the graph: a bug in predispatch, please report it.

    Cause: an internal contract between stages failed; the exported graph must be functional.
    Fix: report the model; as a workaround, `decompose=[op]` the named op.
    """

    anchor = "nonfunctionalgrapherror"


def user_frame(tb: TracebackType | None = None) -> str | None:
    """The innermost `file:line` of the user's code: not torch, not predispatch, not stdlib.

    With `tb`, searches the traceback of an exception (where tracing failed); without it,
    the current call stack (where export was called).
    """
    frames = traceback.extract_tb(tb) if tb is not None else traceback.extract_stack()[:-1]
    for frame in reversed(frames):
        if is_user_file(frame.filename):
            return f"{frame.filename}:{frame.lineno} ({frame.line.strip() if frame.line else ''})"
    return None


def is_user_file(filename: str) -> bool:
    """Whether `filename` is the user's: not torch, not predispatch, not numpy (a failure inside
    numpy's own code is the line that called numpy), not the standard library."""
    import torch

    if filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    if path.startswith((_PACKAGE_DIR, os.path.dirname(os.path.abspath(torch.__file__)))) or is_numpy_file(path):
        return False
    return not (path.startswith(sysconfig.get_paths()["stdlib"]) and "site-packages" not in path)


def is_numpy_file(filename: str) -> bool:
    """Whether `filename` is numpy's own (numpy imported: a trace reaching numpy has imported it)."""
    import sys

    numpy = sys.modules.get("numpy")
    where = getattr(numpy, "__file__", None)
    return where is not None and os.path.abspath(filename).startswith(os.path.dirname(os.path.abspath(where)) + os.sep)


class UnsupportedHookError(PredispatchError):
    """A hook would be dropped from the exported program, so export refuses it.

    Cause: a module called during the trace has a full backward hook or backward pre-hook, or
    the traced code calls `Tensor.register_hook`, and the hook cannot be captured as a traced
    tensor function (see docs/errors.md for what is captured).
    Example: `model.lin.register_full_backward_hook(print_grads)`.
    Fix: remove the hook before export (`handle.remove()`), or express it in the forward as an
    `autograd.Function` whose backward does the same thing.
    """

    anchor = "unsupportedhookerror"


class HooksChangedError(PredispatchError):
    """A module's hooks differ from those traced into its program.

    Cause: hooks were added to or removed from the module (or its submodules) after export;
    the program still behaves as the module did with the old hooks.
    Fix: export again, or restore the hooks; `ep.verify_hooks(module)` is the check.
    """

    anchor = "hookschangederror"


class SerializationError(PredispatchError):
    """A program could not be saved, or a file could not be loaded as a program.

    Cause (load): the file is not a predispatch program, is truncated or corrupted (every
    member is checksummed), has a format version this release does not read, names an op that
    is not allowed or does not exist in this torch, or names a class you did not allow (`types=`:
    a dataclass, a tensor subclass, a class its flatten context holds), or breaks the IR contract export keeps (serialize/verify.py: an op outside the
    allow list, a HOP operand or output that lies, a kernel fed what its forward never makes,
    a name that is not an identifier or would replace a module attribute, subgraphs nested
    deeper than 32, a meta tensor record), or is a compressed or oversized archive.  Load never returns a partial program and never runs code the file chooses.
    Cause (call): `ep.module()` refuses to run a backward kernel that reads its gradient
    unchecked, given a gradient of another shape than its forward's output (an edited file).
    Cause (save): the program holds something format version 2 cannot describe (a sparse
    tensor, a symbolic shape, a class defined inside a function, a tensor subclass whose flatten
    context holds more than plain data, enum members, dataclasses and namedtuples).
    Fix: the message names the file member and the node or input; see docs/format.md.
    """

    anchor = "serializationerror"


class DeviceUnavailableError(SerializationError):
    """A file's program runs on a device this machine's torch cannot provide.

    Cause: the program was exported on an accelerator (its state and the devices its graph
    creates tensors on are `cuda:0`, say) and is loaded where torch has no such device (a CPU
    build, no GPU, fewer GPUs).  The file is sound; a program is traced for its device, so load
    does not move it.
    Fix: load it on a machine with that device, or export the model on the device you will run
    it on (`predispatch.export(model.cpu(), cpu_args)`) and save that program.
    """

    anchor = "deviceunavailableerror"


class NotRepresentableError(PredispatchError):
    """`ep.to_torch()` met something a `torch.export.ExportedProgram` cannot hold.

    Cause: a higher-order op torch.export does not know (predispatch's own), a program that
    leaves grad mode changed for its caller, or a constant input/output of a type torch's
    signature cannot hold (dtype, device, memory format).
    Example: `ep.to_torch()` on a program exported from a forward that calls
    `torch.set_grad_enabled(False)` and never restores it.
    Fix: keep using the predispatch program (`ep.module()`, `predispatch.save`), use
    `ep.to_torch(for_inference=True)` for a consumer that only runs forward, or change the
    model so the named construct goes away.
    """

    anchor = "notrepresentableerror"


class AutogradFunctionError(PredispatchError):
    """A custom `torch.autograd.Function` could not be captured with its backward.

    Cause: export keeps each `Function.apply` as forward and backward subgraphs, so both must
    trace: the backward calls something that is not a torch operation (`.numpy()`, a C
    extension), changes an input in place without `ctx.mark_dirty`, mutates a saved tensor,
    returns the wrong number of gradients, or forward reads a tensor that is not one of its
    arguments (a closure over the module's weights) or returns a non-constant Python object.
    The message names the Function, forward or backward, and the line.
    Example: `def backward(ctx, g): return torch.from_numpy(g.numpy() * 2)`.
    Fix: write forward and backward with torch operations on their arguments only; pass every
    tensor forward reads to `apply`; wrap an opaque kernel in `torch.library.custom_op` with a
    fake implementation and `register_autograd`.  Data-dependent Python in either raises
    `DataDependentError`, naming the Function the same way.
    """

    anchor = "autogradfunctionerror"


class DynamicShapeError(PredispatchError):
    """A dimension marked dynamic cannot be, or a program was called outside its shape range.

    Cause (export): the code forces a dimension marked dynamic (`torch.export.Dim`) to a fixed
    value or a narrower range, e.g. `x.view(4, -1)` or a comparison with a constant; torch's
    message lists the specializations it found and suggested fixes.
    Cause (call): an input size is outside the range recorded for its symbol, or two dimensions
    that share a symbol differ.
    Fix: follow the suggested `dynamic_shapes` fix, mark the dimension static, or call the
    program with sizes in range.
    """

    anchor = "dynamicshapeerror"


class DecompositionError(PredispatchError):
    """`preserve=` or `decompose=` asked for something export cannot do.

    Cause: preserving a composite op that the composite audit found to lie about its schema
    (the message quotes the audit's evidence), or naming an op that does not exist or is not
    a CompositeImplicitAutograd composite (only composites can be kept whole or decomposed).
    Example: `export(model, args, preserve=["aten.reshape"])`.
    Fix: drop it from `preserve=`; `python -m predispatch.audit` shows every verdict.
    """

    anchor = "decompositionerror"


class JointError(PredispatchError):
    """`ep.joint()` cannot build the joint forward-backward program.

    Cause: the loss is not known (forward returns several leaves and `loss=` was not given, or
    names no tensor output), the loss is not a floating tensor of one element, or the program
    is already a joint program.
    Example: `ep.joint()` on a model returning `(logits, loss)`.
    Fix: name the loss leaf, `ep.joint(loss="[1]")` (the paths print(ep) shows as USER_OUTPUT
    targets), and make it a scalar such as `out.sum()`.
    """

    anchor = "jointerror"
class RngStateError(PredispatchError):
    """Forward reseeds, restores or forks a random number generator, which a graph cannot record.

    Cause: a graph records random ops (`dropout`, `torch.rand`), which draw from the generator
    when the program runs; `torch.manual_seed`, `torch.seed`, `torch.set_rng_state`,
    `torch.random.fork_rng`, `torch.cuda.manual_seed*` or `Generator.manual_seed` / `set_state`
    inside forward would run once, at export, so the program's outputs and the generator's
    state after a call would differ from eager's.  The message names the call's line.
    Example: `def forward(self, x): torch.manual_seed(0); return F.dropout(x, 0.5)`.
    Fix: seed outside forward (before calling the model and its program), or create and seed a
    `torch.Generator` outside forward and pass it to the random ops (`generator=g`).
    """

    anchor = "rngstateerror"


def from_torch(error: PredispatchError, exc: BaseException) -> PredispatchError:
    """`error`, keeping the torch exception it was raised from without printing it.

    Raise it as `raise from_torch(OurError(...), exc) from None` inside the `except` block:
    Python then prints our message alone (torch's chained traceback of internals, ~90 lines for
    a data-dependent branch, is what users saw first before), while torch's exception stays
    reachable as `error.torch_error` (and as `error.__context__`, which `from None` hides).
    Not as `__cause__`: Python prints a `__cause__` whatever `__suppress_context__` says.
    """
    error.torch_error = exc
    return error


class MutationTargetError(PredispatchError):
    """A program that changes an input or its state in place was called with a target eager could
    not change in place; the call raised before running, so nothing was written.

    Cause: the tensor to be written is expanded (its elements share memory), an inference tensor
    outside `torch.inference_mode()`, a leaf that requires grad (or a view of one) written with
    grad mode on, one of several views of one op (`unbind`) written with grad mode on, or it
    shares memory with another input of the call (the same tensor passed twice, `m(t, t)`, or
    the module's own buffer passed in, `m(m.c)`).
    Example: `ep.module()(torch.zeros(3).expand(2, 3))` for a forward doing `x.add_(1)`.
    Fix: pass a tensor with its own memory (`x.clone()`), or call under `torch.no_grad()` for a
    leaf that requires grad.
    """

    anchor = "mutationtargeterror"


class ModeSwitchError(PredispatchError):
    """`ep.module().train()` / `.eval()` asked for a mode the program was not exported in.

    Cause: the graph is traced once, in the module's mode at export (dropout on or off, batch
    norm's batch or running statistics); switching the program module's mode cannot change it,
    so the switch is refused instead of silently keeping the old behaviour.
    Example: `predispatch.export(model.train(), args).module().eval()`.
    Fix: `predispatch.export_train_eval(model, args)` exports both modes, and its `module()`
    switches between them; or export once per mode: `model.eval(); predispatch.export(model, args)`.
    Also raised for PT2E's mode switch on `ep.module()` (`allow_exported_model_train_eval`,
    `move_exported_model_to_eval`), which rewrites ops the functional graph does not hold; give
    PT2E `ep.to_torch().module()` instead.
    """

    anchor = "modeswitcherror"
class OutsideWriteError(PredispatchError):
    """Forward left a tensor of the trace outside the module, in a place export cannot put back.

    Cause: forward stored what it computed outside its module tree, in a place export does not
    restore after the trace: an object with `__slots__` or a container of another type (a
    `deque`) held by a module-level global, a class attribute or a default argument (plain
    dicts, lists, sets, globals, class attributes, default arguments and `lru_cache`s are put
    back).  The value is a tracer tensor; the model's next eager call, or a fresh instance,
    would read it and fail.  The message names the place (`module.NAME.attr`).  Also: an
    in-place write into a tensor forward reads from outside the module (a module-level global).
    Example: `HOLDER = Slots()` at module level; forward sets `HOLDER.value = x * 2`.
    Fix: keep what forward computes on the module (an attribute, a buffer, a dict there), or
    compute it outside forward.
    """

    anchor = "outsidewriteerror"


class RestoreError(PredispatchError):
    """Export could not put back something forward changed on the module (or outside it).

    Cause: putting a container or namespace back raised: an object forward stored in a set or
    used as a dict key has an `__eq__` or `__hash__` that raises.  Every other step still ran
    (Note [Putting back, whatever happens] in predispatch/_isolation.py); the message names
    what was left and what raised.
    Example: forward adds a key object whose `__eq__` raises to a dict on the module.
    Fix: make such objects comparable and hashable without raising, or keep forward from
    changing them during export.
    """

    anchor = "restoreerror"


class ModuleCopyError(PredispatchError):
    """`pickle` or `copy.copy` of `ep.module()`, which would lose the module's call contract.

    Cause: pickling (and a shallow copy, which goes through pickling's protocol) rebuilds an
    `fx.GraphModule` from its code alone: the copy would run without the input checks, the
    write-back checks and the mode guard (`.eval()` would silently keep dropout on), so it is
    refused.  `copy.deepcopy` keeps all of them and is allowed.
    A new GraphModule built over `ep.module()`'s graph (torchao's `prepare_pt2e`/
    `prepare_qat_pt2e(ep.module(), quantizer)`) lacks it too, and PT2E's patterns do not match
    its functional graph: its first call is refused (runtime/owner.py), unless it is PTQ of an
    eval program that writes nothing back.
    Example: `pickle.dumps(ep.module())`, `torch.save(ep.module(), path)`, `copy.copy(ep.module())`,
    `prepare_qat_pt2e(ep.module(), quantizer)(x)`.
    Fix: `copy.deepcopy(m)` for a copy in this process; `predispatch.save(ep, path)` and
    `predispatch.load(path).module()` to store it; `m.state_dict()` for its weights; for PT2E,
    `prepare_qat_pt2e(ep.to_torch().module(), quantizer)` or, for PTQ,
    `prepare_pt2e(ep.to_torch(for_inference=True).module(), quantizer)`.
    """

    anchor = "modulecopyerror"


class ModuleConversionError(PredispatchError):
    """`ep.module().to(dtype)` (or `.double()`, `.half()`, `.to(device)`, `.cuda()`) would change
    the dtype or device of the program's state.

    Cause: the graph is traced for the exported dtypes and devices (casts, tensors it creates, the
    input checks), so converting the state would leave a module that refuses the new inputs and
    fails on the old ones; and the module shares the exported model's tensors, so the model would
    be converted too.  The conversion is refused before anything is converted; one that changes
    nothing (`.float()` of a float32 program) is allowed.
    Example: `ep.module().to(torch.float64)`.
    Fix: convert the model and export again: `predispatch.export(model.to(torch.float64), args)`
    (for a device, with the model and the inputs on it).
    """

    anchor = "moduleconversionerror"


class DedupVerificationError(PredispatchError):
    """`export(..., dedup="verify")` found a call that differs from the body its key shares.

    Cause: two calls of a repeated block had the same key (class, state metadata, hooks, grad
    and autocast state, inputs, and the values of every attribute the forward read) but traced
    to different graphs: the forward depends on something the key cannot see, such as a
    module-level global changed between layers.
    Example: `def forward(self, x): return x * SCALE` with `SCALE` changed between layer calls.
    Fix: export with `dedup=False` (every call traced inline); better, make the forward read
    the value from the module or its config, where the key sees it.
    """

    anchor = "dedupverificationerror"


class DistributedError(PredispatchError):
    """A distributed construct export cannot yet capture as the rank runs it; refused by name.

    Cause: an in-place c10d collective with no functional twin in torch (`dist.all_to_all`,
    `dist.send`/`recv`, `dist.gather`, `dist.scatter`, `dist.reduce`, `dist.barrier`, the
    coalesced forms) or one the twin cannot express (a `PREMUL_SUM` reduction, a sparse
    all-reduce); DTensor parameters, buffers or inputs (tensor parallelism through
    `parallelize_module`, `distribute_tensor`), whose program would be one of the global
    tensor, not the rank's, and DTensors made or redistributed in forward; a
    DistributedDataParallel module (its gradient all-reduce runs in autograd hooks; wrap
    `ep.module()` in DDP instead); a module sharded by FSDP2 (`fully_shard`), whose gathers
    and reduce-scatters run in hooks and streams outside forward.
    Example: `dist.all_to_all(outs, ins)` in forward; `export(parallelize_module(m, mesh, plan), args)`.
    Fix: write the communication with torch's functional collectives
    (`torch.distributed._functional_collectives`: `all_reduce`, `all_gather_tensor_autograd`,
    `reduce_scatter_tensor_autograd`, `all_to_all_single_autograd`), which export with their
    backward; `dist.all_reduce`, `dist.all_gather_into_tensor`, `dist.all_gather`,
    `dist.reduce_scatter_tensor` and `dist.broadcast` are exported as those.  See
    docs/distributed.md for what works.
    """

    anchor = "distributederror"


class TorchDriftError(PredispatchError):
    """A hook predispatch places in torch did not engage on the running torch.

    Cause: export replaces a few of torch's private functions for the length of a trace (the
    `Function.apply` capture, the decomposition question, the dispatch observers, tensor and
    module hook capture, ...), and proves each one engaged.  On a torch release where the
    function moved, changed its signature, or is no longer what torch calls, the proof fails:
    export stops rather than return a program that silently lacks what the hook provides (a
    custom backward dropped, a mutation missed).  The message names the mechanism and the torch
    version.
    Example: a future torch renames `FunctionalTensorMode._can_decompose`.
    Fix: use a torch release predispatch is tested on (2.11 to 2.15:
    `pip install 'torch>=2.11,<2.16'`), and report the message to predispatch.
    """

    anchor = "torchdrifterror"
