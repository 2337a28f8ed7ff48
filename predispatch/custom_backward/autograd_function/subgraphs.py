"""Trace one `Function.apply` call into a forward and a backward subgraph, each functional.

Both traces run outside the outer trace (`ti.outside_trace`), on fresh fake tensors of the
arguments' shapes, with the same decomposition policy as the outer graph.  Forward graph:

    def forward(self, x: "f32[3]"):
        round_1: "f32[3]" = torch.ops.aten.round.default(x)
        return ((round_1,), (x,))                       # (outputs, saved)

Backward graph, traced from fakes of the outputs' gradients and of the saved values:

    def forward(self, grad_out: "f32[3]", saved_x: "f32[3]"):
        abs_1: "f32[3]" = torch.ops.aten.abs.default(saved_x)
        ...
        return (mul,)                                   # one gradient per operand, or None
"""

from __future__ import annotations

import contextlib
import inspect
import linecache
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef

from predispatch import _torch_internals as ti
from predispatch.errors import AutogradFunctionError, DataDependentError, PredispatchError, user_frame
from predispatch.frontend.inputs import CONSTANT_TYPES
from predispatch.passes.name_placeholders import name_placeholders
from predispatch.passes.wrap_regions import TOGGLES, wrap_regions
from predispatch.custom_backward.autograd_function.record import (
    BackwardCtx,
    CapturedCall,
    ForwardCtx,
    OutputLeaf,
    SavedAttribute,
    SavedSlot,
    is_differentiable,
)

aten = torch.ops.aten

_FIX = (
    "write the Function's forward and backward with torch operations on their arguments only "
    "(see docs/autograd_function.md); an opaque kernel can be wrapped in torch.library.custom_op "
    "with a fake implementation."
)


@dataclass(frozen=True)
class CallSite:
    """One `Function.apply` call as the trace meets it.

    function: the Function class.
    args: the positional arguments (keywords already bound, as `Function.apply` binds them).
    """

    function: type
    args: tuple[Any, ...]

    def operands(self) -> list[torch.Tensor]:
        """The tensor leaves of the arguments, in pytree order: the HOP's operands."""
        return [x for x in pytree.tree_leaves(self.args) if isinstance(x, torch.Tensor)]

    def with_operands(self, tensors: tuple[torch.Tensor, ...]) -> tuple[Any, ...]:
        """The arguments with their tensor leaves replaced, in order, by `tensors`."""
        leaves, spec = pytree.tree_flatten(self.args)
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


@dataclass(frozen=True)
class _ForwardRecord:
    """What forward returned and left on its ctx, as indices and constants.

    outputs, returns_tuple, non_differentiable, dirty: as in `CapturedCall`.
    saved_layout: per tensor given to `ctx.save_for_backward`, its index among the saved values
        (None where forward saved None).
    attributes: the user's ctx attributes, tensors replaced by saved-value slots.
    materialize_grads: the `ctx.set_materialize_grads` setting.
    saved_names: backward placeholder names for the saved values (`saved_x`, `ctx_sign`).
    """

    outputs: tuple[OutputLeaf, ...]
    returns_tuple: bool
    non_differentiable: tuple[int, ...]
    dirty: tuple[tuple[int, int], ...]
    saved_layout: tuple[int | None, ...]
    attributes: tuple[SavedAttribute, ...]
    materialize_grads: bool
    saved_names: tuple[str, ...]


def capture_call(site: CallSite, fake_mode: ti.FakeTensorMode) -> CapturedCall:
    """Trace `site`'s forward once and its backward from what forward saved; see the module docstring."""
    needs_input_grad = tuple(is_differentiable(a) for a in site.args)
    # a real tensor the Function reads from outside its arguments (a global, another module's
    # weight) is refused as before, not held as a constant of its subgraphs: `_READS_OUTSIDE`
    with ti.outside_trace(), ti.fake_inputs_only(fake_mode):
        with fake_mode:
            operands = tuple(_fresh_fake(t) for t in site.operands())
        forward, record = _trace_forward(site, operands, needs_input_grad, fake_mode)
        backward = _trace_backward(site, forward, record, needs_input_grad, fake_mode)
    return CapturedCall(
        site.function,
        forward,
        backward,
        record.outputs,
        record.returns_tuple,
        record.non_differentiable,
        tuple(i for i in record.saved_layout if i is not None),
        record.dirty,
    )


def _fresh_fake(t: torch.Tensor) -> torch.Tensor:
    """A new fake tensor of `t`'s metadata, known to no tracer (call inside the fake mode)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


# --- forward -------------------------------------------------------------------------------


def _trace_forward(site: CallSite, operands, needs_input_grad, fake_mode) -> tuple[fx.GraphModule, _ForwardRecord]:
    """The forward graph `(*operands) -> ((*outputs), (*saved))`, and what forward recorded."""
    records: list[_ForwardRecord] = []  # filled while forward's tensors are alive

    def forward(*tensors):
        ctx = ForwardCtx(needs_input_grad)
        out = _run_user_forward(site.function, ctx, site.with_operands(tensors))
        record, outputs, saved = _describe_forward(site, ctx, out, tensors)
        records.append(record)
        return outputs, saved

    with _located(site.function, "forward"), _torch_only(site.function, "forward"), torch.no_grad():
        gm, mutated = ti.trace_functional(forward, operands, fake_mode)  # eager runs forward with grad off
    (record,) = records
    _check_forward_mutations(site, record, mutated)
    _check_reads_only_arguments(site, gm, "forward")
    _tidy(gm, _operand_names(site))
    _clone_aliased_outputs(gm, fake_mode)
    return gm, record


def _run_user_forward(function: type, ctx: ForwardCtx, args: tuple) -> Any:
    """Call forward as `Function.apply` would: with ctx first, or then `setup_context`."""
    if has_setup_context(function):
        out = function.forward(*args)
        function.setup_context(ctx, args, out)
        return out
    return function.forward(ctx, *args)


def has_setup_context(function: type) -> bool:
    """Whether `function` uses the `setup_context` style (forward takes no ctx), as torch decides it."""
    return function.setup_context is not ti.SingleLevelFunction.setup_context


def _describe_forward(site: CallSite, ctx: ForwardCtx, out: Any, inputs: tuple):
    """`(record, outputs, saved)`: what forward did, and the forward graph's two output tuples."""
    returns_tuple = isinstance(out, tuple)
    tensors, leaves = [], []
    for i, value in enumerate(out if returns_tuple else (out,)):
        if isinstance(value, torch.Tensor):
            leaves.append(OutputLeaf(len(tensors)))
            tensors.append(value)
        elif isinstance(value, CONSTANT_TYPES):
            leaves.append(OutputLeaf(None, value))
        else:
            what = f"output {i} has type {type(value).__name__}, neither a tensor nor a constant."
            raise _refusal(site.function, "forward", what, fix="return tensors and constants (int, float, bool, str, None) only.")
    saved, layout = _saved_tensors(ctx)
    attributes = _saved_attributes(ctx, saved)
    record = _ForwardRecord(
        tuple(leaves),
        returns_tuple,
        tuple(_non_differentiable(site, t, tensors) for t in getattr(ctx, "non_differentiable", ())),
        tuple(_dirty(site, t, tensors, inputs) for t in getattr(ctx, "dirty_tensors", ())),
        layout,
        attributes,
        ctx.materialize_grads,
        _saved_names(site, saved, inputs, attributes),
    )
    return record, tuple(tensors), tuple(saved)


def _saved_tensors(ctx: ForwardCtx) -> tuple[list[torch.Tensor], tuple[int | None, ...]]:
    """Tensors from `ctx.save_for_backward`, and where each lands (None stays None)."""
    saved, layout = [], []
    for t in getattr(ctx, "to_save", None) or ():
        layout.append(None if t is None else len(saved))
        if t is not None:
            saved.append(t)
    return saved, tuple(layout)


def _saved_attributes(ctx: ForwardCtx, saved: list[torch.Tensor]) -> tuple[SavedAttribute, ...]:
    """User attributes of ctx; tensor leaves join `saved` and are replaced by their slots."""
    attributes = []
    for name, value in ctx.user_attributes().items():
        leaves, spec = pytree.tree_flatten(value)
        kept = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                kept.append(SavedSlot(len(saved)))
                saved.append(leaf)
            else:
                kept.append(leaf)
        attributes.append(SavedAttribute(name, spec, tuple(kept)))
    return tuple(attributes)


def _saved_names(site: CallSite, saved: list, inputs: tuple, attributes: tuple[SavedAttribute, ...]) -> tuple[str, ...]:
    """Backward placeholder names: `saved_x` for a saved input, `saved_<i>` else, `ctx_<attr>` for attributes."""
    if hasattr(site.function, "placeholder_names"):
        return tuple(site.function.placeholder_names[1])
    arg_names = _operand_names(site)
    names = [f"saved_{next((arg_names[j] for j, x in enumerate(inputs) if x is t), i)}" for i, t in enumerate(saved)]
    for attribute in attributes:
        slots = [x for x in attribute.leaves if isinstance(x, SavedSlot)]
        for j, slot in enumerate(slots):
            names[slot.index] = f"ctx_{attribute.name}" if len(slots) == 1 else f"ctx_{attribute.name}_{j}"
    return tuple(names)


def _index_in(site: CallSite, t: Any, candidates: list, problem: str, fix: str) -> int:
    """Position of `t` (by identity) among `candidates`; refuse with `problem` when absent."""
    for i, c in enumerate(candidates):
        if c is t:
            return i
    raise _refusal(site.function, "forward", problem, fix=fix)


def _non_differentiable(site: CallSite, t: torch.Tensor, outputs: list) -> int:
    return _index_in(site, t, outputs, "ctx.mark_non_differentiable was given a tensor forward does not return.",
                     "mark only tensors that forward returns.")


def _dirty(site: CallSite, t: torch.Tensor, outputs: list, inputs: tuple) -> tuple[int, int]:
    """`(output index, operand index)` of a tensor passed to `ctx.mark_dirty`."""
    fix = "mark only inputs that forward changes in place, and return them from forward (as eager requires)."
    operand = _index_in(site, t, list(inputs), "ctx.mark_dirty was given a tensor that is not an input of forward.", fix)
    output = _index_in(site, t, outputs, "ctx.mark_dirty was given an input that forward does not return.", fix)
    return output, operand


def _check_forward_mutations(site: CallSite, record: _ForwardRecord, mutated: tuple[int, ...]) -> None:
    """An input changed in place must have been passed to `ctx.mark_dirty` (eager's own rule)."""
    dirty = {operand for _, operand in record.dirty}
    for position in mutated:
        if position not in dirty:
            raise _refusal(
                site.function,
                "forward",
                f"forward changes its input {_operand_names(site)[position]!r} in place without ctx.mark_dirty, "
                "so autograd (eager and exported) would compute wrong gradients.",
                fix="call ctx.mark_dirty(x) and return x, or compute out of place (x = x * 2).",
            )


def _check_reads_only_arguments(site: CallSite, gm: fx.GraphModule, phase: str) -> None:
    """Refuse a subgraph that baked in a tensor of the outer trace (a closure, not an argument).

    Such a tensor reaches the nested trace as a constant: the program would hold a fake
    tensor where the model's weight or an earlier result should flow, and no gradient.
    """
    for node in gm.graph.find_nodes(op="get_attr"):
        if ti.is_traced_tensor(getattr(gm, node.target, None)):
            raise _refusal(
                site.function, phase,
                f"{phase} reads a tensor that is not one of its arguments (a closure over a module "
                "weight or an earlier result), which would be frozen into the program.",
                fix=f"pass the tensor to {site.function.__name__}.apply(...) as an argument and "
                "return a gradient for it from backward.",
            )


# --- backward ------------------------------------------------------------------------------


def _trace_backward(
    site: CallSite, forward: fx.GraphModule, record: _ForwardRecord, needs_input_grad, fake_mode
) -> fx.GraphModule:
    """The backward graph `(*output_grads, *saved) -> (*operand_grads)`."""
    outputs, saved = forward.graph.output_node().args[0]
    with fake_mode:
        fakes = tuple(_fresh_fake(n.meta["val"]) for n in (*outputs, *saved))
    n = len(outputs)

    def backward(*inputs):
        ctx = _backward_ctx(record, inputs[n:], needs_input_grad)
        grads = [inputs[leaf.index] if leaf.index is not None else None for leaf in record.outputs]
        return _operand_grads(site, _run_user_backward(site.function, ctx, grads))

    with _located(site.function, "backward"), _torch_only(site.function, "backward"), torch.no_grad():
        gm, mutated = ti.trace_functional(backward, fakes, fake_mode)
    if any(i >= n for i in mutated):
        raise _refusal(
            site.function, "backward", "backward changes a saved tensor in place, which a functional graph cannot do.",
            fix="compute out of place in backward (y = x * 2 instead of x.mul_(2)).",
        )
    _check_reads_only_arguments(site, gm, "backward")
    _tidy(gm, [*_grad_names(n), *record.saved_names])
    return gm


def _backward_ctx(record: _ForwardRecord, saved: tuple, needs_input_grad) -> BackwardCtx:
    """Forward's ctx rebuilt for backward, its tensors being the backward graph's inputs `saved`."""
    saved_tensors = tuple(None if i is None else saved[i] for i in record.saved_layout)
    attributes = {}
    for attribute in record.attributes:
        leaves = [saved[x.index] if isinstance(x, SavedSlot) else x for x in attribute.leaves]
        attributes[attribute.name] = pytree.tree_unflatten(leaves, attribute.spec)
    return BackwardCtx(needs_input_grad, record.materialize_grads, saved_tensors, attributes)


def _run_user_backward(function: type, ctx: BackwardCtx, grads: list) -> Any:
    """Call the user's `backward` (or `vjp`) as the autograd engine would."""
    base = torch.autograd.Function
    user_fn = function.vjp if function.vjp is not base.vjp else function.backward
    if getattr(function, "boxed_grads_call", False):
        return user_fn(ctx, list(grads))
    return user_fn(ctx, *grads)


def _operand_grads(site: CallSite, result: Any) -> tuple[torch.Tensor | None, ...]:
    """One gradient per operand from backward's result (one per argument), checked as eager checks it.

    A tensor nested in a container argument is an operand autograd does not differentiate
    (only top-level tensor arguments are inputs of the Function): it gets None.
    """
    grads = result if isinstance(result, tuple) else (result,)
    if len(grads) < len(site.args) or any(g is not None for g in grads[len(site.args):]):
        raise _refusal(
            site.function,
            "backward",
            f"backward returned {len(grads)} gradient(s) for the {len(site.args)} arguments of forward.",
            fix="return one gradient per forward argument (None for arguments without one).",
        )
    out: list[torch.Tensor | None] = []
    for i, (arg, grad) in enumerate(zip(site.args, grads)):
        _check_gradient(site, i, arg, grad)
        nested = sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(arg))
        out.extend([grad] if isinstance(arg, torch.Tensor) else [None] * nested)
    return tuple(out)


def _check_gradient(site: CallSite, i: int, arg: Any, grad: Any) -> None:
    """Eager's checks on one returned gradient: None or a tensor, and None for a non-tensor argument."""
    if grad is None:
        return
    if not isinstance(arg, torch.Tensor):
        raise _refusal(site.function, "backward", f"backward returned a gradient for argument {i}, which is not a tensor.",
                       fix="return None for arguments that are not tensors.")
    if not isinstance(grad, torch.Tensor):
        raise _refusal(site.function, "backward", f"backward returned a {type(grad).__name__} for argument {i}.",
                       fix="return a tensor or None for each argument.")


# --- graph tidying -------------------------------------------------------------------------


def _tidy(gm: fx.GraphModule, names: list[str]) -> None:
    """Drop grad-mode toggles, wrap autocast regions, name placeholders; see Note [Grad mode inside Function subgraphs]."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch._C._set_grad_enabled:
            gm.graph.erase_node(node)
    name_placeholders(gm, _unique_names(names))
    if any(n.op == "call_function" and n.target in TOGGLES for n in gm.graph.nodes):
        wrap_regions(gm)
    gm.graph.lint()
    gm.recompile()


def _clone_aliased_outputs(gm: fx.GraphModule, fake_mode) -> None:
    """Clone forward outputs that alias an input or an earlier output.

    A HOP's outputs must be new tensors: the outer trace tracks each output as its own value.
    Eager autograd returns such outputs as views; the values are the same.
    """
    outputs, saved = gm.graph.output_node().args[0]
    seen = {StorageWeakRef(n.meta["val"].untyped_storage()) for n in gm.graph.find_nodes(op="placeholder")}
    new_outputs = []
    for node in outputs:
        storage = StorageWeakRef(node.meta["val"].untyped_storage())
        if storage in seen:
            with gm.graph.inserting_before(gm.graph.output_node()):
                clone = gm.graph.create_node("call_function", aten.clone.default, (node,), name="clone")
            with fake_mode:
                clone.meta["val"] = node.meta["val"].clone()
            node = clone
        seen.add(StorageWeakRef(node.meta["val"].untyped_storage()))
        new_outputs.append(node)
    gm.graph.output_node().args = ((tuple(new_outputs), saved),)
    gm.recompile()


def _operand_names(site: CallSite) -> list[str]:
    """Placeholder names for the operands: forward's parameter names (`x`, `weight`, `args_1`).

    A Function made from an exported pair of graphs (`capture._pair_function`) keeps the
    pair's names, so exporting a program's module again prints the same program.
    """
    if hasattr(site.function, "placeholder_names"):
        return list(site.function.placeholder_names[0])
    params = list(inspect.signature(site.function.forward).parameters.values())
    if not has_setup_context(site.function):
        params = params[1:]  # ctx
    names = []
    for i, arg in enumerate(site.args):
        base = params[i].name if i < len(params) and params[i].kind is not inspect.Parameter.VAR_POSITIONAL else f"args_{i}"
        count = sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(arg))
        names.extend([base] if isinstance(arg, torch.Tensor) else [f"{base}_{j}" for j in range(count)])
    return names


def _grad_names(n: int) -> list[str]:
    return ["grad_out"] if n == 1 else [f"grad_out_{i}" for i in range(n)]


def _unique_names(names: list[str]) -> list[str]:
    """Valid, distinct identifiers (`x`, `x_1`, ...)."""
    out, used = [], set()
    for name in names:
        name = re.sub(r"\W", "_", name)
        candidate, k = name, 1
        while candidate in used:
            candidate, k = f"{name}_{k}", k + 1
        used.add(candidate)
        out.append(candidate)
    return out


# --- errors --------------------------------------------------------------------------------


def _refusal(function: type, phase: str, what: str, fix: str = _FIX) -> AutogradFunctionError:
    """An error about `function`'s `phase` found after tracing it: it points at the method itself."""
    where = _defined_at(function, phase) or user_frame()
    return AutogradFunctionError(f"autograd.Function {function.__qualname__} ({phase}): {what}", where=where, fix=fix)


def _defined_at(function: type, phase: str) -> str | None:
    """`file:line (def backward(ctx, grad):)`: where the user's forward or backward is defined."""
    method = inspect.unwrap(function.forward if phase == "forward" else function.backward)
    try:
        lines, first = inspect.getsourcelines(method)
        offset = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
        return f"{inspect.getsourcefile(method)}:{first + offset} ({lines[offset].strip()})"
    except (OSError, TypeError, StopIteration):
        return None


#: Fix for a Function whose forward or backward leaves torch: the opaque part as a custom op.
_CUSTOM_OP_FIX = (
    "move the part that leaves torch into a torch.library.custom_op (@torch.library.custom_op("
    "\"mylib::name\", mutates_args=())) with a fake kernel (@name.register_fake, computing only the "
    "output's shape and dtype) and its gradient (name.register_autograd); call it from the Function, "
    "or write the Function with torch operations only."
)


@contextlib.contextmanager
def _torch_only(function: type, phase: str) -> Iterator[None]:
    """Refuse `Tensor.numpy()` (and `np.asarray(t)`, which calls it) while `phase` is traced.

    The trace runs the user's code on fake tensors, which hold no data: what numpy would compute
    from them cannot be seen, and torch's own error (".numpy() is not supported for tensor
    subclasses") names neither the Function nor the way out.
    """

    def numpy(tensor, *args, **kwargs):
        caller = ti.caller_frame(1)
        line = (linecache.getline(caller.f_code.co_filename, caller.f_lineno) or "").strip()
        raise AutogradFunctionError(
            f"autograd.Function {function.__qualname__} ({phase}): {phase} leaves torch: it calls "
            f"`.numpy()` on a tensor (at {caller.f_code.co_filename}:{caller.f_lineno} ({line})); "
            "export traces it on fake tensors, which hold no data, so what numpy computes cannot be "
            "captured.",
            where=_defined_at(function, phase) or user_frame(),
            fix=_CUSTOM_OP_FIX,
        )

    with ti.patched(torch.Tensor, "numpy", lambda _: numpy, mechanism="Tensor.numpy() refusal in a Function's subgraphs"):
        yield


@contextlib.contextmanager
def _located(function: type, phase: str) -> Iterator[None]:
    """Turn a failure while tracing `phase` into an error naming the Function and the user's line."""
    try:
        yield
    except PredispatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure is re-raised with context
        name, where = function.__qualname__, user_frame(exc.__traceback__) or _defined_at(function, phase)
        chain = [exc, exc.__cause__, exc.__context__]
        if any(isinstance(e, ti.DATA_DEPENDENT_ERRORS) for e in chain):
            raise DataDependentError(
                f"autograd.Function {name} ({phase}): {phase} branches on, or converts, a value inside "
                "a tensor, which export cannot know (it traces shapes, not values).",
                where=where,
                fix=f"make the {phase} static, compute both sides and pick with torch.where, or "
                "move the data-dependent part into a torch.library.custom_op.",
            ) from exc
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AutogradFunctionError(
            f"autograd.Function {name} ({phase}): {phase} cannot be traced: {type(exc).__name__}: {first}",
            where=where,
            fix=_FIX,
        ) from exc
