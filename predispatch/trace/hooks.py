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
returns new input gradients) that do not read `grad_output` are captured on the input side:
the module's tensor inputs, after its forward pre-hooks, pass through an identity Function
whose backward runs the hooks on `grad_input`.  torch's own hook machinery is set aside for the
trace (the hooks are restored after), so it does not also run.  Unlike eager, hooks see zeros,
not None, for floating tensors that get no gradient.  Refused, naming the module, the hook and
where it was defined: full backward hooks that read `grad_output` (it is known only on the
output side of backward, `grad_input` only on the input side, and a traced program has no
channel between the two), the deprecated `register_backward_hook`, global backward hooks, and
hooks with Python side effects.
"""

from __future__ import annotations

import contextlib
import dis
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules import module as module_globals

from predispatch.errors import UnsupportedHookError, user_frame


@contextlib.contextmanager
def backward_hooks(root: nn.Module, keeper: Any) -> Iterator[None]:
    """While active: backward pre-hooks and `Tensor.register_hook` are captured where they can
    be, and calling a module with any other backward hook raises (see the module docstring).
    `keeper` tells which tensors ops have read."""
    names = {id(m): path or type(root).__name__ for path, m in root.named_modules(remove_duplicate=False)}
    _check_global_hooks()
    with _captured_module_hooks(root), _refusing_module_hooks(root, names):
        original = torch.Tensor.register_hook
        torch.Tensor.register_hook = lambda tensor, hook: _capture_tensor_hook(tensor, hook, keeper)
        try:
            yield
        finally:
            torch.Tensor.register_hook = original


@contextlib.contextmanager
def _captured_module_hooks(root: nn.Module) -> Iterator[None]:
    """Set aside the capturable backward hooks of each module and apply them through captured
    Functions instead (restored on exit): pre-hooks on the module's outputs, full hooks on its
    inputs.  A module keeps torch's machinery (and is refused) unless all its hooks qualify."""
    stashed: list[tuple[nn.Module, str, Any]] = []
    handles = []
    for module in root.modules():
        pre, full = list(module._backward_pre_hooks.values()), list(module._backward_hooks.values())
        if not (pre or full) or not all(_capturable(h) for h in pre) or not all(_capturable(h, full=True) for h in full):
            continue
        if full and not getattr(module, "_is_full_backward_hook", True):
            continue  # the deprecated register_backward_hook: semantics of its own, refused
        for attr in ("_backward_pre_hooks", "_backward_hooks"):
            stashed.append((module, attr, getattr(module, attr)))
            setattr(module, attr, type(getattr(module, attr))())
        if pre:
            handles.append(module.register_forward_hook(_output_gradient_hooks(pre)))
        if full:
            handles.append(module.register_forward_pre_hook(_input_gradient_hooks(full)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, attr, hooks in stashed:
            setattr(module, attr, hooks)


def _why_refused(module: nn.Module) -> str:
    """Why `_captured_module_hooks` left a module's backward hooks in place (for the error)."""
    for hook in [*module._backward_pre_hooks.values(), *module._backward_hooks.values()]:
        effect = side_effect(hook)
        if effect:
            return f"it has a Python side effect ({effect})."
    if module._backward_hooks and not getattr(module, "_is_full_backward_hook", True):
        return "it was registered with the deprecated register_backward_hook."
    return "a full backward hook that reads grad_output cannot be captured (only grad_input is known where it runs)."


def _capturable(hook: Any, full: bool = False) -> bool:
    """Pure, and (for a full backward hook) not reading `grad_output`, which is only known on the
    module's output side of backward while `grad_input` is known on its input side."""
    if side_effect(hook):
        return False
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    if not full:
        return True
    if code is None or code.co_argcount < 3:
        return False
    grad_output = code.co_varnames[code.co_argcount - 1]
    return not any(i.opname.startswith("LOAD") and i.argval == grad_output for i in dis.get_instructions(code))


def _input_gradient_hooks(hooks: list[Any]) -> Any:
    """A forward pre-hook that routes the module's tensor inputs through full backward `hooks`.

    In backward the hooks get `grad_input` (None for non-floating tensor inputs, as in eager) and
    may return replacements; `grad_output` is passed as None (the hooks do not read it).
    """

    def pre_hook(module: nn.Module, args: tuple) -> tuple:
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        floating = [i for i in tensors if args[i].is_floating_point() or args[i].is_complex()]

        class FullBackwardHooks(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
                return tuple(t.clone() for t in inputs)

            @staticmethod
            def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
                by_index = dict(zip(floating, grads))
                grad_input = tuple(by_index.get(i) for i in tensors)
                for hook in hooks:
                    new = hook(module, grad_input, None)
                    grad_input = grad_input if new is None else tuple(new)
                return tuple(g for i, g in zip(tensors, grad_input) if i in by_index)

        if not floating:
            return args
        hooked = iter(FullBackwardHooks.apply(*(args[i] for i in floating)))
        return tuple(next(hooked) if i in floating else a for i, a in enumerate(args))

    return pre_hook


def _output_gradient_hooks(hooks: list[Any]) -> Any:
    """A forward hook that routes the module's floating outputs through `hooks` in backward."""

    # Each hook kind keeps its own Function class (here, for inputs, for tensors): the class's
    # name and forward signature name the captured subgraphs and their placeholders.
    def forward_hook(module: nn.Module, args: Any, output: Any) -> Any:
        leaves, spec = pytree.tree_flatten(output)
        index = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]

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
        hooks = [*module._backward_pre_hooks.values(), *module._backward_hooks.values()]
        if hooks:
            name = names.get(id(module), type(module).__name__)
            raise UnsupportedHookError(
                f"module {name!r} ({type(module).__name__}) has a backward hook, {_describe(hooks)}, "
                f"which a traced program would silently drop: {_why_refused(module)}",
                where=user_frame(),
                fix="remove it before export (handle.remove()), make it a pure function of the gradients "
                "(a full backward hook may only use grad_input), or move its effect into an autograd.Function.",
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
