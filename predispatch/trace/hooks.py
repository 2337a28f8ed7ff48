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
Note [Carrying grad_output].  Hooks that read the module's parameters and buffers get them
as saved values, see Note [Hooks reading module state].  torch's own hook machinery is set
aside for the trace (the hooks are restored after), so it does not also run.

Both kinds see what torch's `BackwardHook` sees (`_Layout`): only the top level of the
positional arguments (one grad_input entry per argument; kwargs and tensors nested in lists are
not hooked) and of the output (one grad_output entry for a tensor, one per element of a tuple,
None for an element that is not a floating tensor; a nested tuple is such an element).  For an
output that is neither a tensor nor a tuple (a list, a dict, a dataclass), or that holds no
floating tensor at its top level, eager calls none of the module's backward hooks, and neither
does the program (export gives eager's warning for the former).  Unlike eager, hooks see zeros,
not None, for floating outputs that get no gradient, and None, not zeros, for a tensor argument
that is not floating (see `_Layout.hooked`).  Refused, naming the module, the hook and
where it was defined: the deprecated `register_backward_hook`, global backward hooks, hooks
with Python side effects, hooks that cannot be traced (they return a wrong number of gradients,
which eager refuses in backward, or call something that is not a torch operation), and hooks
reading a tensor that is neither a gradient nor the module's own; and, for a full backward
hook, a module whose forward cannot run on stand-ins, or, when the hook reads grad_output,
whose output shape depends on tensor values (see the Note).

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

A carrier is made before the forward runs, yet shaped like its output, and whether eager
calls the hooks at all depends on the output's layout: `_probe_outputs` learns both by running
the module's forward and forward hooks once more, at export, on stand-in fake tensors outside
the trace.  So at export the forward Python of a module with a full backward hook runs once
more for each call of the module, just before its traced run (side effects of that Python
included), and the real output must be laid out as the probe's was (`_check_probed`).  Hooks
that do not read grad_output are given None for it and need no carrier.

As in eager, a hook changes nothing when no floating input requires grad at run time
(FullBackwardHooks then has no backward; eager calls the hook with Nones and requires None
back), when the module runs with grad mode off, or when its output has no floating tensor at
the top level of a tensor or tuple (eager never calls the hooks then).  One difference: the
copies GradOutputCarrier returns require grad whenever an input of the module does, even one
eager leaves without history (a module returning `x.detach()`), and its gradient then reaches
the hooks.  A size of the output that depends on tensor values (`x[x > 0]`) is known only
after the forward, too late for a carrier: refused (`_shape_sources`).

Note [Hooks reading module state]
---------------------------------
A hook may read the module it is given (`go[0] @ module.weight`).  Traced as written, its
backward would read the outer trace's tensor for the weight, which a captured backward may
not (it reads only its operands and what its forward saved).  So when a hook may read module
state (`_may_read_state`: it uses its module argument, is a bound method, or reaches an
`nn.Module` through a closure or a global; read from the bytecode), its Function takes every
tensor the module holds as extra operands (`_State`: parameters, buffers and tensor attributes,
recursively, a tied tensor once), saves them, and runs the hooks with the module rebound to the
saved values (`ti.reparametrize`, every name of a tied tensor); their gradients are None:

    autograd_function_apply(backward_pre_hooks_fwd_0, backward_pre_hooks_bwd_0, linear, p_weight,
        p_bias, non_differentiable_idx = [], saved_for_backward_idx = [0, 1])

Hooks that cannot read it cost nothing (for a hooked Linear, 2 operands and 4 placeholders
more otherwise).  A hook then sees the module's tensors as they were when its Function ran,
before the module's forward for full backward hooks, after it for pre-hooks; eager reads them
when backward runs.  The two differ only for a tensor the forward pass changes later
(BatchNorm's running statistics in training, a second call of the module): refused at the end
of the forward (`_check_state_unchanged`).  A tensor that is neither a gradient nor the
module's own (a global tensor, another module's weight) is refused by name (`_hook_refusal`).
"""

from __future__ import annotations

import contextlib
import dis
import inspect
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules import module as module_globals

from predispatch import _torch_internals as ti
from predispatch.errors import AutogradFunctionError, PredispatchError, UnsupportedHookError, user_frame

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
    handed: the module tensors hook Functions took, checked unchanged when the forward pass ends.
    """

    names: dict[int, str]
    probing: bool = False
    handed: list[_Handed] = field(default_factory=list)

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
        handles.extend(_install(module, pre, full, capture))
    try:
        yield
        _check_state_unchanged(capture)
    finally:
        for handle in handles:
            handle.remove()
        for module, attr, hooks in stashed:
            setattr(module, attr, hooks)


def _install(module: nn.Module, pre: list[Any], full: list[Any], capture: _Capture) -> list[Any]:
    """The forward (pre-)hooks that stand for a module's backward hooks, in eager's order: the
    full hooks' Function on the arguments; after the forward hooks, GradOutputCarrier, then the
    pre-hooks' Function, whose backward so runs first (Note [Carrying grad_output])."""
    handles = [module.register_forward_hook(_warn_unhooked_output(capture))]
    if full:
        before, after = _full_backward_hooks(full, capture)
        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after))
    if pre:
        handles.append(module.register_forward_hook(_output_gradient_hooks(pre, capture)))
    return handles


def _warn_unhooked_output(capture: _Capture) -> Callable:
    """A forward hook giving eager's warning for an output its backward hooks never see."""

    def forward_hook(module: nn.Module, args: tuple, output: Any) -> None:
        if not capture.probing and not isinstance(output, (torch.Tensor, tuple)):
            warnings.warn(
                "For backward hooks to be called, module output should be a Tensor or a tuple of Tensors"
                f" but received {type(output)}",
                stacklevel=2,
            )

    return forward_hook


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


def _may_read_argument(hook: Any, index: int) -> bool:
    """Whether a hook may read its argument `index` (0: the module; 2: a full hook's grad_output).

    Read from the bytecode; a hook whose code cannot be read, or that takes `*args`, is assumed
    to read it (reading grad_output costs carriers, see Note [Carrying grad_output]).
    """
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    index += 1 if inspect.ismethod(hook) else 0
    if code is None or code.co_argcount <= index:
        return True
    name = code.co_varnames[index]
    for instr in dis.get_instructions(code):
        loaded = instr.argval if isinstance(instr.argval, tuple) else (instr.argval,)
        if instr.opname.startswith("LOAD") and name in loaded:
            return True
    return False


def _may_read_state(hook: Any) -> bool:
    """Whether a hook may read the state of the module it is on: it uses its module argument,
    is a bound method (`self` may be the module), or reaches an `nn.Module` through a closure or
    a global.  A cheap look at the code; see Note [Hooks reading module state]."""
    if inspect.ismethod(hook) or _may_read_argument(hook, 0):
        return True
    cells = [cell.cell_contents for cell in hook.__closure__ or () if _is_filled(cell)]
    names = [name for code in _code_objects(hook.__code__) for name in code.co_names]
    return any(isinstance(value, nn.Module) for value in (*cells, *map(hook.__globals__.get, names)))


def _is_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return False
    return True


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    """`code` and the code of the functions, lambdas and comprehensions defined in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _is_floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


@dataclass(frozen=True)
class _Layout:
    """A module's positional arguments or its output as torch's `BackwardHook` sees them: the top
    level only (`_top_level`), one entry of grad_input or grad_output per element.

    count: the number of entries: one per argument; for an output, 1 for a tensor, the length of
        a tuple, 0 for anything else (eager then calls none of the module's backward hooks).
    hooked: positions of the floating tensors, which pass through the hook Function; the other
        entries are None.  (Eager's grad_input holds zeros for a tensor argument of another
        dtype; passing one through the Function would hand the module a copy, and an in-place
        update of it, a position counter's, would no longer reach the caller.)
    like: `(shape, dtype, device)` of the tensor at each of `hooked`, for a carrier.
    """

    count: int
    hooked: tuple[int, ...]
    like: tuple[tuple[torch.Size, torch.dtype, torch.device], ...]

    @staticmethod
    def of(value: Any) -> _Layout:
        elements = _top_level(value)
        hooked = tuple(i for i, t in enumerate(elements) if _is_floating(t))
        return _Layout(len(elements), hooked, tuple(_like(elements[i]) for i in hooked))

    def same_entries(self, other: _Layout) -> bool:
        return (self.count, self.hooked) == (other.count, other.hooked)

    def pick(self, value: Any) -> tuple:
        """The elements of `value` at `hooked`."""
        elements = _top_level(value)
        return tuple(elements[i] for i in self.hooked)

    def place(self, value: Any, tensors: tuple) -> Any:
        """`value` with `tensors` at `hooked`, rebuilt as `BackwardHook` rebuilds it."""
        elements = list(_top_level(value))
        for i, t in zip(self.hooked, tensors):
            elements[i] = t
        if isinstance(value, torch.Tensor):
            return elements[0]
        return tuple(elements) if type(value) is tuple else type(value)(*elements)

    def spread(self, grads: tuple) -> tuple:
        """One entry per element, `grads` at `hooked` and None elsewhere, as `BackwardHook` packs them."""
        by_position = dict(zip(self.hooked, grads))
        return tuple(by_position.get(i) for i in range(self.count))


def _top_level(value: Any) -> tuple:
    """The elements torch's `BackwardHook` hooks: a tensor, or a tuple's elements; nothing else."""
    if isinstance(value, torch.Tensor):
        return (value,)
    return tuple(value) if isinstance(value, tuple) else ()


def _like(t: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return t.shape, t.dtype, t.device


_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


@dataclass(frozen=True)
class _State:
    """A module's tensors handed to a hook Function, for hooks that read them in backward.

    See Note [Hooks reading module state].
    names: for each of `tensors`, every qualified name it has in the module (a tied tensor is
        handed over once).
    tensors: the Function's last operands, saved for backward.
    """

    names: tuple[tuple[str, ...], ...] = ()
    tensors: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def of(module: nn.Module, hooks: list[Any]) -> _State:
        """All of the module's tensors when a hook may read them (`_may_read_state`), else none."""
        if not any(_may_read_state(hook) for hook in hooks):
            return _State()
        held: dict[int, tuple[torch.Tensor, list[str]]] = {}
        for name, t in _module_tensors(module):
            held.setdefault(id(t), (t, []))[1].append(name)
        return _State(tuple(tuple(names) for _, names in held.values()), tuple(t for t, _ in held.values()))

    def save(self, ctx: Any, operands: tuple) -> None:
        if self.tensors:
            ctx.save_for_backward(*operands[-len(self.tensors):])

    def bound(self, module: nn.Module, ctx: Any) -> contextlib.AbstractContextManager:
        """The module with its tensors swapped for backward's saved values, while the hooks run."""
        if not self.tensors:
            return contextlib.nullcontext()
        saved = ctx.saved_tensors
        return ti.reparametrize(module, {name: t for names, t in zip(self.names, saved) for name in names})

    def no_grads(self) -> tuple[None, ...]:
        return (None,) * len(self.tensors)

    def name_operands(self, function: type, leading: int) -> type:
        """Name the operands of `function` for its subgraphs' placeholders, through the signature
        of its forward (which the capture reads): `args_<i>` for the `leading` ones, then
        `module_<name>` for the module's tensors (`saved_module_weight` in backward)."""
        if self.tensors:
            state = [f"module_{names[0]}".replace(".", "_") for names in self.names]
            names = ["ctx", *(f"args_{i}" for i in range(leading)), *state]
            function.forward.__signature__ = inspect.Signature([inspect.Parameter(n, _POSITIONAL) for n in names])
        return function


@dataclass(frozen=True)
class _Handed:
    """Module tensors a hook Function took, as `_check_state_unchanged` needs them.

    named: "module 'lin' (Linear) has a ... hook (...)", for the error.
    counts: `ti.mutation_count` of each of `state.tensors` when the Function took it.
    """

    named: str
    module: nn.Module
    state: _State
    counts: tuple[int | None, ...]


def _check_state_unchanged(capture: _Capture) -> None:
    """Refuse a module tensor that changed after a hook Function took it, see Note [Hooks
    reading module state]: the program's hook would read the old value, eager's the new one."""
    for handed in capture.handed:
        for names, t, count in zip(handed.state.names, handed.state.tensors, handed.counts):
            if ti.mutation_count(t) == count and _held(handed.module, names[0]) is t:
                continue
            raise UnsupportedHookError(
                f"{handed.named} that may read the module's tensors, and the forward pass changes "
                f"{names[0]!r} after the hook's Function took it (as BatchNorm does to its running "
                "statistics in training): the program's hook would see the value from before the change, eager's "
                "sees the value when backward runs.",
                where=user_frame(),
                fix="export with the module in eval mode (BatchNorm's running statistics then stay as they are), "
                "or remove the hook before export (handle.remove()).",
            )


def _held(module: nn.Module, name: str) -> Any:
    """The module's attribute at a qualified name (`0.weight`)."""
    prefix, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(prefix), attr, None)


@dataclass(frozen=True)
class _OpenCall:
    """A module call whose arguments went through `FullBackwardHooks`, until its forward hooks ran.

    outputs: the output's layout, learnt by the probe; the real output must match it.
    carriers: one per floating output, for `GradOutputCarrier` (none when no hook reads grad_output).
    """

    outputs: _Layout
    carriers: tuple[torch.Tensor, ...]


def _full_backward_hooks(hooks: list[Any], capture: _Capture) -> tuple[Callable, Callable]:
    """A forward pre-hook (with kwargs) that routes the module's floating arguments through the
    full backward `hooks`, and the forward hook that checks the output against the probe and,
    when a hook reads grad_output, hands grad_output to them (Note [Carrying grad_output])."""
    carried = any(_may_read_argument(h, 2) for h in hooks)
    open_calls: list[_OpenCall | None] = []  # one per call in progress

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if capture.probing:
            return None
        hooked, opened = _hook_inputs(module, hooks, args, kwargs, carried, capture)
        open_calls.append(opened)
        return None if hooked is None else (hooked, kwargs)

    def after(module: nn.Module, args: tuple, output: Any) -> Any:
        if capture.probing:
            return None
        opened = open_calls.pop()
        if opened is None:
            return None
        outputs = opened.outputs
        _check_probed(module, output, outputs, carried, capture)
        if not carried:
            return None
        return outputs.place(output, GradOutputCarrier.apply(*outputs.pick(output), *opened.carriers))

    return before, after


def _hook_inputs(
    module: nn.Module, hooks: list[Any], args: tuple, kwargs: dict, carried: bool, capture: _Capture
) -> tuple[tuple | None, _OpenCall | None]:
    """`(new args, open call)`: the floating args through `FullBackwardHooks`, and what the
    forward hook needs after the forward; `(None, None)` when eager would not run the hooks
    either (no floating argument, grad mode off, no floating tensor at the output's top level)."""
    inputs = _Layout.of(args)
    if not inputs.hooked or not torch.is_grad_enabled():
        return None, None
    outputs = _probe_outputs(module, args, kwargs, capture)
    if not outputs.hooked:
        return None, None
    sources = _shape_sources(module, inputs.pick(args), (args, kwargs), outputs, capture) if carried else ()
    state = _State.of(module, hooks)
    function = _input_side(module, hooks, inputs, outputs if carried else None, len(sources), state)
    with _applying(module, hooks, "full backward hook", state, capture):
        results = function.apply(*inputs.pick(args), *sources, *state.tensors)
    n = len(inputs.hooked)
    return inputs.place(args, results[:n]), _OpenCall(outputs, tuple(results[n:]))


def _shape_sources(module: nn.Module, inputs: tuple, arguments: Any, outputs: _Layout, capture: _Capture) -> tuple:
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
    module: nn.Module, hooks: list[Any], inputs: _Layout, outputs: _Layout | None, n_sources: int, state: _State
) -> type:
    """The identity on the module's floating arguments whose backward runs the full backward
    hooks.  With `outputs`, it also returns one carrier per floating output, shaped from its
    operands (the arguments, then `n_sources` tensors that only lend their sizes); Note
    [Carrying grad_output].  The module's `state` comes last (Note [Hooks reading module state])."""
    like = outputs.like if outputs is not None else ()
    n = len(inputs.hooked)

    class FullBackwardHooks(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state.save(ctx, operands)
            carriers = (torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in like)
            return (*(t.clone() for t in operands[:n]), *carriers)

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            grad_output = None if outputs is None else outputs.spread(grads[n:])
            call = lambda hook, grad_input: hook(module, grad_input, grad_output)  # noqa: E731
            with state.bound(module, ctx):
                grad_input = _chain(hooks, call, inputs.spread(grads[:n]), pre=False)
            return (*inputs.pick(grad_input), *(None,) * n_sources, *state.no_grads())

    return state.name_operands(FullBackwardHooks, n + n_sources)


def _chain(hooks: list[Any], call: Callable[[Any, tuple], Any], grads: tuple, *, pre: bool) -> tuple:
    """Call the hooks in order as eager does, each seeing the gradients the previous returned
    (None keeps them), with eager's check and message for a wrong count."""
    kind, name = ("pre hook", "grad_output") if pre else ("hook", "grad_input")
    for hook in hooks:
        new = call(hook, grads)
        if new is None:
            continue
        if len(new) != len(grads):
            raise RuntimeError(
                f"Backward {kind} returned an invalid number of {name}, got {len(new)}, but expected {len(grads)}"
            )
        grads = tuple(new)
    return grads


class GradOutputCarrier(torch.autograd.Function):
    """`(*outputs, *carriers) -> copies of outputs`; backward hands each output's gradient to its
    carrier too.  See Note [Carrying grad_output]."""

    @staticmethod
    def forward(ctx: Any, *outputs_and_carriers: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.clone() for t in outputs_and_carriers[: len(outputs_and_carriers) // 2])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*grads, *grads)


def _check_probed(module: nn.Module, output: Any, probed: _Layout, carried: bool, capture: _Capture) -> None:
    """Refuse an output laid out otherwise than the probe found (shaped otherwise, for carriers)."""
    actual = _Layout.of(output)
    if actual == probed or (not carried and actual.same_entries(probed)):
        return
    raise UnsupportedHookError(
        f"{capture.describe(module)} has a full backward hook, and its output changed between two "
        "runs on the same inputs at export (a probe learns the output's layout before the forward, see "
        "Note [Carrying grad_output] in predispatch/trace/hooks.py).",
        where=user_frame(),
        fix="make the module's forward return the same layout, shapes and dtypes each time it is called "
        "with the same inputs.",
    )


def _probe_outputs(module: nn.Module, args: tuple, kwargs: dict, capture: _Capture) -> _Layout:
    """The layout of the module's output after its forward hooks, from running it once more.

    The full hooks' Function is applied before the forward runs, yet whether eager calls the
    hooks at all, and the carriers' shapes (Note [Carrying grad_output]), depend on the output:
    so the forward and the forward hooks run first on stand-ins (fresh fake tensors for the
    arguments and the module's state) with the trace suspended and every capture hook standing
    aside.  Nothing the probe does is recorded, and what it mutates (BatchNorm's running
    statistics) is a stand-in.
    """
    fake_mode = ti.detect_fake_mode([t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    try:
        with ti.suspended_tracing(), capture.probe(), _plain_autograd(), fake_mode, ti.discarding_unbacked_symbols(fake_mode):
            stand_in = _StandIns()
            p_args, p_kwargs = pytree.tree_map_only(torch.Tensor, stand_in, (args, kwargs))
            with ti.reparametrize(module, {name: stand_in(t) for name, t in _module_tensors(module)}):
                return _Layout.of(_forward_with_hooks(module, p_args, p_kwargs))
    except PredispatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise UnsupportedHookError(
            f"{capture.describe(module)} has a full backward hook; export learns which outputs its "
            "grad_output holds by running the module once more on stand-in tensors, which failed: "
            f"{type(exc).__name__}: {_first_line(exc)}",
            where=user_frame(exc.__traceback__) or user_frame(),
            fix="make the module's forward depend only on its arguments and its own parameters and buffers.",
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


def _output_gradient_hooks(hooks: list[Any], capture: _Capture) -> Callable:
    """A forward hook that routes the module's floating outputs, laid out as eager lays them out
    (`_Layout`), through the backward pre-`hooks`."""

    def forward_hook(module: nn.Module, args: Any, output: Any) -> Any:
        if capture.probing:
            return None
        outputs = _Layout.of(output)
        if not outputs.hooked:  # eager calls no backward hook of the module then
            return None
        state = _State.of(module, hooks)
        with _applying(module, hooks, "backward pre-hook", state, capture):
            hooked = _output_side(module, hooks, outputs, state).apply(*outputs.pick(output), *state.tensors)
        return outputs.place(output, hooked)

    return forward_hook


def _output_side(module: nn.Module, hooks: list[Any], outputs: _Layout, state: _State) -> type:
    """The identity on the module's floating outputs whose backward runs the backward pre-hooks;
    the module's `state` comes last (Note [Hooks reading module state])."""
    n = len(outputs.hooked)

    # Each hook kind keeps its own Function class (here, for inputs, for tensors): the class's
    # name and forward signature name the captured subgraphs and their placeholders.
    class BackwardPreHooks(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
            state.save(ctx, operands)
            return tuple(t.clone() for t in operands[:n])

        @staticmethod
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            with state.bound(module, ctx):
                grad_output = _chain(hooks, lambda hook, go: hook(module, go), outputs.spread(grads), pre=True)
            return (*outputs.pick(grad_output), *state.no_grads())

    return state.name_operands(BackwardPreHooks, n)


#: How a hook's read of a tensor from outside shows in a failed capture: a tensor of the outer
#: trace is caught after tracing (`_check_reads_only_arguments` in
#: trace/autograd_function/subgraphs.py), a real tensor (a global constant) by FakeTensorMode.
_READS_OUTSIDE = ("reads a tensor that is not one of its arguments", "Please convert all Tensors to FakeTensors")


@contextlib.contextmanager
def _applying(module: nn.Module, hooks: list[Any], kind: str, state: _State, capture: _Capture) -> Iterator[None]:
    """Around the call of a hook Function: a failure to capture it becomes an error about the
    user's hooks (the Function and its file are ours, the code that failed is theirs), and the
    module tensors it takes are recorded for `_check_state_unchanged`."""
    named = f"{capture.describe(module)} has a {kind} ({_describe(hooks)})"
    counts = tuple(map(ti.mutation_count, state.tensors))
    try:
        yield
    except AutogradFunctionError as exc:
        raise _hook_refusal(named, exc) from exc
    if state.tensors:
        capture.handed.append(_Handed(named, module, state, counts))


def _hook_refusal(named: str, exc: AutogradFunctionError) -> UnsupportedHookError:
    """The error for hooks whose Function the capture refused: reading a tensor from outside the
    module gets a fix of its own; any other failure is quoted, at the user's line where known."""
    if any(marker in exc.what for marker in _READS_OUTSIDE):
        return UnsupportedHookError(
            f"{named} that reads a tensor which is neither one of its gradients nor a parameter, buffer or "
            "tensor attribute of that module (a global tensor, another module's weight); the program's "
            "backward would hold its value at export.",
            where=user_frame(),
            fix="reach the tensor through the module the hook is given (module.weight): register it on that "
            "module (as a parameter or buffer), or register the hook on a module that holds every tensor it "
            "reads.",
        )
    cause = exc.__cause__
    return UnsupportedHookError(
        f"{named} that cannot be captured: "
        + (f"{type(cause).__name__}: {_first_line(cause)}" if cause else exc.what.split("): ", 1)[-1]),
        where=(user_frame(cause.__traceback__) if cause else None) or user_frame(),
        fix="compute the hook with torch operations on its gradients and on its module's tensors, returning "
        "one gradient (or None) per entry it is given; or remove it before export (handle.remove()).",
    )


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
    """`name defined at file:line` of each hook, for errors."""
    return ", ".join(map(_describe_one, hooks))


def _describe_one(hook: Any) -> str:
    fn = getattr(hook, "__func__", hook)
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        return f"{name} defined at {inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return name
