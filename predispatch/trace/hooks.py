"""Backward hooks: capture the ones that are tensor functions, refuse the rest by name.

Forward hooks and pre-hooks simply run during the trace, so they are in the graph.  Backward
hooks are different: torch installs them on autograd nodes, which a trace on fake tensors
never builds, so torch's own export drops them without a word.

`Tensor.register_hook(hook)` on an intermediate is captured: the tensor is rebound to an
identity `autograd.Function` whose backward is the hook, which the Function capture
(trace/autograd_function/) turns into an `autograd_function_apply` node with the hook traced
as its backward subgraph.  Gradients through the program then pass through the hook exactly
where eager's do.  Refused, because the program could not do what eager does:
- a hook on a tensor some op already read (eager's hook also transforms the gradient flowing
  back through that earlier use; a rebinding only reaches later uses);
- a hook on a graph input or parameter (eager applies it to the leaf's accumulated gradient);
- a hook with Python side effects (print, storing into a list or attribute): a traced backward
  would run them once, at export, and never again.
A module's backward pre-hooks (`register_full_backward_pre_hook`: `hook(module, grad_output)`
returns new output gradients) are captured the same way: the module's outputs, after its
forward hooks, pass through one identity Function whose backward runs the hooks in order.
Full backward hooks (`register_full_backward_hook`: `hook(module, grad_input, grad_output)`
returns new input gradients) are captured on the input side: the module's floating tensor
inputs, after its forward pre-hooks, pass through an identity Function whose backward runs the
hooks; hooks that read `grad_output` receive it through carrier tensors, see
Note [Carrying grad_output].  torch's own hook machinery is set aside for the trace (the hooks
are restored after), so it does not also run.  Unlike eager, hooks see zeros, not None, for
floating tensors that get no gradient.  Refused, naming the module, the hook and where it was
defined: the deprecated `register_backward_hook`, global backward hooks, and hooks with
Python side effects; and, for a hook that reads grad_output, a module whose output shape
depends on tensor values or whose forward cannot run on stand-ins (see the Note).

Note [Carrying grad_output]
---------------------------
A full backward hook needs two gradients that backward computes at two different places:
grad_output where the module's outputs are differentiated, grad_input where its inputs are,
later.  Eager links them in Python (`torch.utils.hooks.BackwardHook` keeps grad_output on an
object until the input side runs); a traced program has only autograd edges, so it gets one:

    x_1, carrier = FullBackwardHooks(x)     # carrier: zeros shaped like the module's output
    y = <the module's forward and forward hooks>(x_1)
    y_1 = GradOutputCarrier(y, carrier)     # forward: a copy of y; backward: (grad_y, grad_y)

Backward runs GradOutputCarrier first, handing grad_y both to the module's forward and to the
carrier.  FullBackwardHooks runs once the gradients of all its outputs are in: those of x_1 are
grad_input, that of the carrier is grad_output.  It calls the hooks with both, laid out as
eager lays them out (one entry per positional argument, per element of a returned tuple; None
where no floating tensor is), and returns their grad_input.  Backward pre-hooks change
grad_output before full hooks see it, so their Function comes after GradOutputCarrier.

A carrier is made before the forward runs, yet shaped like its output: `_probe_outputs` learns
the shape by running the module's forward and forward hooks once more, at export, on stand-in
fake tensors outside the trace.  So at export the forward Python of a module with such a hook
runs once more for each call of the module, just before its traced run (side effects of that
Python included); hooks that do not read grad_output are given None for it and need no carrier
and no probe.

As in eager, a hook changes nothing when no floating input requires grad at run time
(FullBackwardHooks then has no backward; eager calls the hook with Nones and requires None
back), when the module runs with grad mode off, or, for hooks reading grad_output, when it
returns neither a tensor nor a tuple (eager never calls the hooks then; hooks using only
grad_input are still called, as before carriers existed).  One difference: the copies
GradOutputCarrier returns require grad whenever an input of the module does, even one eager
leaves without history (a module returning `x.detach()`), and its gradient then reaches the
hooks.  A size of the output that depends on tensor values (`x[x > 0]`) is known only after
the forward, too late for a carrier: refused (`_shape_sources`).
"""

from __future__ import annotations

import contextlib
import dis
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules import module as module_globals

from predispatch import _torch_internals as ti
from predispatch.errors import PredispatchError, UnsupportedHookError, user_frame

#: torch's own `Function.apply`, which the trace replaces; a shape probe runs with it (`_plain_autograd`).
_TORCH_APPLY = torch.autograd.Function.__dict__["apply"]


@contextlib.contextmanager
def backward_hooks(root: nn.Module, keeper: Any) -> Iterator[None]:
    """While active: backward pre-hooks and `Tensor.register_hook` are captured where they can
    be, and calling a module with any other backward hook raises (see the module docstring).
    `keeper` tells which tensors ops have read."""
    names = {id(m): path or type(root).__name__ for path, m in root.named_modules(remove_duplicate=False)}
    _check_global_hooks()
    with _captured_module_hooks(root, names), _refusing_module_hooks(root, names):
        original = torch.Tensor.register_hook
        torch.Tensor.register_hook = lambda tensor, hook: _capture_tensor_hook(tensor, hook, keeper)
        try:
            yield
        finally:
            torch.Tensor.register_hook = original


@dataclass
class _Capture:
    """What the module-hook captures of one export share.

    names: each module's path in the exported module, for errors.
    probing: True while `_probe_outputs` runs a module again; every capture hook then stands
        aside, so the probe captures nothing and leaves nothing behind.
    """

    names: dict[int, str]
    probing: bool = False

    def describe(self, module: nn.Module) -> str:
        """`module 'encoder.lin' (Linear)`, for errors."""
        return f"module {self.names.get(id(module), type(module).__name__)!r} ({type(module).__name__})"

    @contextlib.contextmanager
    def probe(self) -> Iterator[None]:
        self.probing = True
        try:
            yield
        finally:
            self.probing = False


@contextlib.contextmanager
def _captured_module_hooks(root: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Set aside the capturable backward hooks of each module and apply them through captured
    Functions instead (restored on exit): pre-hooks on the module's outputs, full hooks on its
    inputs.  A module keeps torch's machinery (and is refused) unless all its hooks qualify."""
    capture = _Capture(names)
    stashed: list[tuple[nn.Module, str, Any]] = []
    handles = []
    for module in root.modules():
        pre, full = list(module._backward_pre_hooks.values()), list(module._backward_hooks.values())
        if not (pre or full) or _refusal(module):
            continue
        for attr in ("_backward_pre_hooks", "_backward_hooks"):
            stashed.append((module, attr, getattr(module, attr)))
            setattr(module, attr, type(getattr(module, attr))())
        if full:
            pre_hook, carry = _full_backward_hooks(full, capture)
            handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
            if carry is not None:  # before the pre-hooks' Function: Note [Carrying grad_output]
                handles.append(module.register_forward_hook(carry))
        if pre:
            handles.append(module.register_forward_hook(_output_gradient_hooks(pre, capture)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, attr, hooks in stashed:
            setattr(module, attr, hooks)


def _refusal(module: nn.Module) -> tuple[Any, str] | None:
    """The backward hook that keeps a module's hooks from being captured, and why; or None."""
    for hook in [*module._backward_pre_hooks.values(), *module._backward_hooks.values()]:
        effect = side_effect(hook)
        if effect:
            return hook, f"it has a Python side effect ({effect})."
    if module._backward_hooks and not getattr(module, "_is_full_backward_hook", True):
        return next(iter(module._backward_hooks.values())), "it was registered with the deprecated register_backward_hook."
    return None


def _why_refused(module: nn.Module) -> tuple[Any, str]:
    """Which hook `_captured_module_hooks` left in place on a module, and why (for the error)."""
    hooks = [*module._backward_pre_hooks.values(), *module._backward_hooks.values()]
    return _refusal(module) or (
        hooks[0],
        "the module is not a submodule of the exported one, so its hooks were not set up for capture.",
    )


def _reads_grad_output(hook: Any) -> bool:
    """Whether a full backward hook may read `grad_output` (its third parameter).

    Read from the bytecode; a hook whose code cannot be read, or that takes `*args`, is assumed
    to read it (it then pays for a shape probe, see Note [Carrying grad_output]).
    """
    fn = getattr(hook, "__func__", hook)
    code = getattr(fn, "__code__", None)
    index = 3 if inspect.ismethod(hook) else 2
    if code is None or code.co_argcount <= index:
        return True
    name = code.co_varnames[index]
    for instr in dis.get_instructions(code):
        loaded = instr.argval if isinstance(instr.argval, tuple) else (instr.argval,)
        if instr.opname.startswith("LOAD") and name in loaded:
            return True
    return False


def _is_floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


@dataclass(frozen=True)
class _Outputs:
    """A module's output as full backward hooks see it, learnt by `_probe_outputs`.

    count: the length of grad_output: 1 for a tensor, the length of a tuple (eager looks at the
        top level only), 0 for anything else (eager then never calls the hooks).
    floating: positions of the floating tensors, which get gradients (the others get None).
    like: `(shape, dtype, device)` of the tensor at each of `floating`, for its carrier.
    """

    count: int
    floating: tuple[int, ...]
    like: tuple[tuple[torch.Size, torch.dtype, torch.device], ...]

    @staticmethod
    def of(output: Any) -> _Outputs:
        elements = _top_level(output)
        floating = tuple(i for i, t in enumerate(elements) if _is_floating(t))
        return _Outputs(len(elements), floating, tuple(_like(elements[i]) for i in floating))


def _top_level(output: Any) -> tuple:
    """The elements of a module's output that torch's `BackwardHook` hooks (see `_Outputs.count`)."""
    if isinstance(output, torch.Tensor):
        return (output,)
    return tuple(output) if isinstance(output, tuple) else ()


def _like(t: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return t.shape, t.dtype, t.device


def _full_backward_hooks(hooks: list[Any], capture: _Capture) -> tuple[Callable, Callable | None]:
    """A forward pre-hook (with kwargs) that routes the module's floating inputs through the
    full backward `hooks`, and, when a hook reads grad_output, the forward hook that hands
    grad_output to them (see Note [Carrying grad_output]; None otherwise)."""
    carried = any(_reads_grad_output(h) for h in hooks)
    open_calls: list[tuple[_Outputs, tuple[torch.Tensor, ...]] | None] = []  # one per call in progress

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if capture.probing:
            return None
        hooked, opened = _hook_inputs(module, hooks, args, kwargs, carried, capture)
        if carried:
            open_calls.append(opened)
        return None if hooked is None else (hooked, kwargs)

    def carry(module: nn.Module, args: tuple, output: Any) -> Any:
        if capture.probing:
            return None
        opened = open_calls.pop()
        return None if opened is None else _carry_grad_output(module, output, *opened, capture)

    return pre_hook, carry if carried else None


def _hook_inputs(
    module: nn.Module, hooks: list[Any], args: tuple, kwargs: dict, carried: bool, capture: _Capture
) -> tuple[tuple | None, tuple[_Outputs, tuple[torch.Tensor, ...]] | None]:
    """`(new args, (outputs, carriers))`: the floating args through `FullBackwardHooks`, and
    what `GradOutputCarrier` needs (None without carriers); `(None, None)` when eager would not
    run the hooks either (no floating input, grad mode off, no floating output)."""
    floating = tuple(i for i, a in enumerate(args) if _is_floating(a))
    if not floating or not torch.is_grad_enabled():
        return None, None
    outputs = _probe_outputs(module, args, kwargs, capture) if carried else None
    if outputs is not None and not outputs.floating:
        return None, None
    inputs = tuple(args[i] for i in floating)
    sources = _shape_sources(module, inputs, (args, kwargs), outputs, capture) if outputs else ()
    function = _input_side(module, hooks, len(args), floating, outputs, len(sources))
    results = function.apply(*inputs, *sources)
    new_args = list(args)
    for i, t in zip(floating, results):
        new_args[i] = t
    return tuple(new_args), None if outputs is None else (outputs, results[len(floating):])


def _shape_sources(module: nn.Module, inputs: tuple, arguments: Any, outputs: _Outputs, capture: _Capture) -> tuple:
    """Other argument tensors whose sizes the carriers' symbolic sizes are made from (usually none).

    A carrier is made inside `FullBackwardHooks`' forward, a subgraph that sees only its
    operands, so each symbolic size of an output must come from an operand's: an index
    tensor's length (dynamic shapes) joins the operands.  A size that comes from no argument
    depends on tensor values (`nonzero`, boolean masks) and is known only after the forward.
    """
    missing = set(ti.free_symbols([shape for shape, _, _ in outputs.like])) - set(ti.free_symbols(list(inputs)))
    sources = []
    for t in pytree.tree_leaves(arguments):
        if missing and isinstance(t, torch.Tensor) and missing & set(ti.free_symbols(t)):
            sources.append(t)
            missing -= set(ti.free_symbols(t))
    if missing:
        raise UnsupportedHookError(
            f"{capture.describe(module)} has a full backward hook that reads grad_output, and "
            f"the shape of its output depends on tensor values ({', '.join(sorted(map(str, missing)))}); the "
            "tensor that brings grad_output to the hook is made before the forward runs, so its shape must "
            "follow from the shapes of the module's arguments.",
            where=user_frame(),
            fix="make the hook use only grad_input, or register it on a submodule whose output shape "
            "follows from its input shapes.",
        )
    return tuple(sources)


def _input_side(
    module: nn.Module, hooks: list[Any], n_args: int, floating: tuple[int, ...], outputs: _Outputs | None, n_sources: int
) -> type:
    """The identity on the module's floating inputs whose backward runs the full backward hooks;
    with `outputs`, it also returns one carrier per floating output, shaped from its operands
    (the inputs, then `n_sources` tensors that only lend their sizes); Note [Carrying grad_output]."""
    like = outputs.like if outputs is not None else ()

    class FullBackwardHooks(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            carriers = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in like)
            return (*(t.clone() for t in inputs[: len(floating)]), *carriers)

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            grad_input = _with_none(floating, grads[: len(floating)], n_args)
            grad_output = None if outputs is None else _with_none(outputs.floating, grads[len(floating):], outputs.count)
            grad_input = _run_full_hooks(module, hooks, grad_input, grad_output)
            return (*(grad_input[i] for i in floating), *(None,) * n_sources)

    return FullBackwardHooks


def _with_none(positions: tuple[int, ...], values: tuple, size: int) -> tuple:
    """`values` at `positions` of a tuple of `size`, None elsewhere (as torch's BackwardHook packs)."""
    by_position = dict(zip(positions, values))
    return tuple(by_position.get(i) for i in range(size))


def _run_full_hooks(module: nn.Module, hooks: list[Any], grad_input: tuple, grad_output: tuple | None) -> tuple:
    """Call the hooks in order as eager does, each seeing the grad_input the previous returned."""
    for hook in hooks:
        new = hook(module, grad_input, grad_output)
        if new is None:
            continue
        if len(new) != len(grad_input):  # eager's own check and message
            raise RuntimeError(
                f"Backward hook returned an invalid number of grad_input, got {len(new)}, but expected {len(grad_input)}"
            )
        grad_input = tuple(new)
    return grad_input


class GradOutputCarrier(torch.autograd.Function):
    """`(*outputs, *carriers) -> copies of outputs`; backward hands each output's gradient to its
    carrier too.  See Note [Carrying grad_output]."""

    @staticmethod
    def forward(ctx: Any, *outputs_and_carriers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in outputs_and_carriers[: len(outputs_and_carriers) // 2])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*grads, *grads)


def _carry_grad_output(module: nn.Module, output: Any, outputs: _Outputs, carriers: tuple, capture: _Capture) -> Any:
    """The forward hook's work: the module's floating outputs through `GradOutputCarrier`."""
    elements = _top_level(output)
    if _Outputs.of(output) != outputs:
        raise UnsupportedHookError(
            f"{capture.describe(module)} has a full backward hook that reads grad_output, and "
            "its output changed between two runs on the same inputs at export (a probe learns the output's "
            "shape, see Note [Carrying grad_output] in predispatch/trace/hooks.py).",
            where=user_frame(),
            fix="make the module's forward return the same layout, shapes and dtypes each time it is called "
            "with the same inputs, or make the hook use only grad_input.",
        )
    copies = iter(GradOutputCarrier.apply(*(elements[i] for i in outputs.floating), *carriers))
    hooked = [next(copies) if i in outputs.floating else t for i, t in enumerate(elements)]
    if isinstance(output, torch.Tensor):
        return hooked[0]
    return tuple(hooked) if type(output) is tuple else type(output)(*hooked)


def _probe_outputs(module: nn.Module, args: tuple, kwargs: dict, capture: _Capture) -> _Outputs:
    """The module's output after its forward hooks, as `_Outputs`, from running it once more.

    Carriers are made before the forward runs (Note [Carrying grad_output]), so the output's
    shape is learnt first: the forward and the forward hooks run on stand-ins (fresh fake
    tensors for the arguments and the module's state) with the trace suspended and every
    capture hook standing aside.  Nothing the probe does is recorded, and what it mutates
    (BatchNorm's running statistics) is a stand-in.
    """
    fake_mode = ti.detect_fake_mode([t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    try:
        with ti.suspended_tracing(), capture.probe(), _plain_autograd(), fake_mode, ti.discarding_unbacked_symbols(fake_mode):
            stand_in = _StandIns()
            p_args, p_kwargs = pytree.tree_map_only(torch.Tensor, stand_in, (args, kwargs))
            with ti.reparametrize(module, {name: stand_in(t) for name, t in _module_tensors(module)}):
                return _Outputs.of(_forward_with_hooks(module, p_args, p_kwargs))
    except PredispatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise UnsupportedHookError(
            f"{capture.describe(module)} has a full backward hook that reads grad_output; export "
            "learns the shape of grad_output by running the module once more on stand-in tensors, which failed: "
            f"{type(exc).__name__}: {_first_line(exc)}",
            where=user_frame(exc.__traceback__) or user_frame(),
            fix="make the module's forward depend only on its arguments and its own parameters and buffers, "
            "or make the hook use only grad_input.",
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


class _StandIns:
    """Fresh fake tensors standing in for a trace's tensors (one per tensor, so ties stay tied).

    Call inside the fake mode, outside the trace.
    """

    def __init__(self) -> None:
        # id -> (original, stand-in); holding the original keeps its id from being reused
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self._made:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            self._made[id(t)] = (t, fake.requires_grad_(t.requires_grad and _is_floating(t)))
        return self._made[id(t)][1]


def _module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the module holds (parameters, buffers, tensor attributes), by qualified name."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        held = [*m._parameters.items(), *m._buffers.items(), *vars(m).items()]
        for name, t in held:
            if isinstance(t, torch.Tensor):
                yield (f"{prefix}.{name}" if prefix else name), t


def _forward_with_hooks(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """`module.forward` and then its forward hooks (global ones first), as `Module.__call__` runs them."""
    output = module.forward(*args, **kwargs)
    for hook_id, hook in (*module_globals._global_forward_hooks.items(), *module._forward_hooks.items()):
        with_kwargs = hook_id in module._forward_hooks_with_kwargs or hook_id in module_globals._global_forward_hooks_with_kwargs
        result = hook(module, args, kwargs, output) if with_kwargs else hook(module, args, output)
        output = output if result is None else result
    return output


@contextlib.contextmanager
def _plain_autograd() -> Iterator[None]:
    """For the probe: torch's own `Function.apply`, and `Tensor.register_hook` doing nothing.

    The trace replaces both (`capture_autograd_functions`, `backward_hooks`): a Function the
    probe calls must not be captured (its subgraphs would be traced for a run nothing records),
    and a tensor hook changes no shape, while torch's would refuse a stand-in without grad.
    """
    saved = torch.autograd.Function.__dict__["apply"], torch.Tensor.register_hook
    torch.autograd.Function.apply, torch.Tensor.register_hook = _TORCH_APPLY, lambda tensor, hook: _ProbeHandle()
    try:
        yield
    finally:
        torch.autograd.Function.apply, torch.Tensor.register_hook = saved


class _ProbeHandle:
    """What `register_hook` returns during a probe: nothing was registered, nothing to remove."""

    def remove(self) -> None:
        pass


def _output_gradient_hooks(hooks: list[Any], capture: _Capture) -> Any:
    """A forward hook that routes the module's floating outputs through `hooks` in backward."""

    # Each hook kind keeps its own Function class (here, for inputs, for tensors): the class's
    # name and forward signature name the captured subgraphs and their placeholders.
    def forward_hook(module: nn.Module, args: Any, output: Any) -> Any:
        if capture.probing:
            return None
        leaves, spec = pytree.tree_flatten(output)
        index = [i for i, t in enumerate(leaves) if _is_floating(t)]

        class BackwardPreHooks(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *outputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
                return tuple(t.clone() for t in outputs)

            @staticmethod
            def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
                for hook in hooks:
                    new = hook(module, grads)
                    grads = grads if new is None else tuple(new)
                return grads

        hooked = BackwardPreHooks.apply(*(leaves[i] for i in index)) if index else ()
        for i, t in zip(index, hooked):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, spec)

    return forward_hook


@contextlib.contextmanager
def _refusing_module_hooks(root: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Raise when a module with a (not captured) backward hook is called."""

    def pre_hook(module: nn.Module, args: Any) -> None:
        if module._backward_pre_hooks or module._backward_hooks:
            name = names.get(id(module), type(module).__name__)
            hook, why = _why_refused(module)
            raise UnsupportedHookError(
                f"module {name!r} ({type(module).__name__}) has a backward hook, {_describe([hook])}, "
                f"which a traced program would silently drop: {why}",
                where=user_frame(),
                fix="remove it before export (handle.remove()), make it a pure function of the gradients, "
                "or move its effect into an autograd.Function.",
            )

    # A global pre-hook puts every module call on torch's slow path: install it only when some
    # module the export can see has a backward hook (a module reached otherwise is not checked).
    hooked = any(m._backward_pre_hooks or m._backward_hooks for m in root.modules())
    handle = module_globals.register_module_forward_pre_hook(pre_hook) if hooked else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _capture_tensor_hook(tensor: torch.Tensor, hook: Any, keeper: Any) -> _NoHandle:
    """Rebind `tensor` to an identity whose backward applies `hook` (see the module docstring)."""
    why = _uncapturable(tensor, hook, keeper)
    if why:
        raise UnsupportedHookError(
            f"Tensor.register_hook({_describe([hook])}) cannot be captured: {why}",
            where=user_frame(),
            fix="register the hook right after the tensor is computed, as a pure function of the gradient; "
            "or write the transformation as an autograd.Function (forward: identity, backward: the hook).",
        )

    class TensorHook(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            out = hook(grad)
            return grad if out is None else out

    tensor.copy_(TensorHook.apply(tensor))
    return _NoHandle()


class _NoHandle:
    """What `register_hook` returns in a trace: a captured hook cannot be removed from the graph."""

    def remove(self) -> None:
        raise UnsupportedHookError(
            "a hook captured into the program cannot be removed later in the same forward.",
            where=user_frame(),
            fix="register the hook only where it applies, e.g. under a Python condition known at export.",
        )


def _uncapturable(tensor: torch.Tensor, hook: Any, keeper: Any) -> str | None:
    if not tensor.is_floating_point() and not tensor.is_complex():
        return "the tensor has no gradient (not floating point)."
    if keeper.is_input(tensor):
        return "the tensor is a graph input or parameter; eager applies the hook to its accumulated gradient."
    if keeper.was_used(tensor):
        return (
            "an op already read the tensor, and eager's hook also transforms the gradient flowing back "
            "through that earlier use."
        )
    effect = side_effect(hook)
    if effect:
        return f"the hook has a Python side effect ({effect}), which a traced backward would run once, at export."
    return None


_STORES = {"STORE_GLOBAL", "STORE_ATTR", "STORE_DEREF", "STORE_SUBSCR", "DELETE_SUBSCR", "DELETE_ATTR"}
_EFFECT_NAMES = {"print", "append", "extend", "insert", "add", "update", "setattr", "write", "log", "info"}


def side_effect(fn: Any) -> str | None:
    """A Python side effect the function's code visibly has (a store or an effectful call), or None.

    Read from the bytecode, not run: a static look that catches prints and stores into
    containers, attributes, globals and closures; effects hidden inside other functions it calls
    are not seen.
    """
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    for instr in dis.get_instructions(code) if code is not None else ():
        if instr.opname in _STORES:
            return f"{instr.opname.lower()} {instr.argval}"
        if instr.opname in ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_NAME") and instr.argval in _EFFECT_NAMES:
            return f"calls {instr.argval}"
    return None


def _check_global_hooks() -> None:
    hooks = [*module_globals._global_backward_pre_hooks.values(), *module_globals._global_backward_hooks.values()]
    if hooks:
        raise UnsupportedHookError(
            f"a global module backward hook is registered ({_describe(hooks)}); a traced program would "
            "silently drop it.",
            where=user_frame(),
            fix="remove it before export (handle.remove()).",
        )


def _describe(hooks: list[Any]) -> str:
    fn = getattr(hooks[0], "__func__", hooks[0])
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        return f"{name} defined at {inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return name
