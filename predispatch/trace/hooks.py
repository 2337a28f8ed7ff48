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
torch's own hook machinery is set aside for the trace (the hooks are restored after), so it
does not also run.  Unlike eager, the hooks see zeros, not None, for outputs that get no
gradient.  Refused, naming the module, the hook and where it was defined: full backward hooks
(they need the gradients of the module's inputs and outputs at once), global backward hooks,
and pre-hooks with Python side effects.
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
def refuse_backward_hooks(root: nn.Module, keeper: Any) -> Iterator[None]:
    """While active: backward pre-hooks and `Tensor.register_hook` are captured where they can
    be, and calling a module with any other backward hook raises (see the module docstring).
    `keeper` tells which tensors ops have read."""
    names = {id(m): path or type(root).__name__ for path, m in root.named_modules(remove_duplicate=False)}
    _check_global_hooks()
    with _captured_pre_hooks(root), _refusing_module_hooks(root, names):
        original = torch.Tensor.register_hook
        torch.Tensor.register_hook = lambda tensor, hook: _capture_tensor_hook(tensor, hook, keeper)
        try:
            yield
        finally:
            torch.Tensor.register_hook = original


@contextlib.contextmanager
def _captured_pre_hooks(root: nn.Module) -> Iterator[None]:
    """Set aside the pure backward pre-hooks of modules without full backward hooks and apply
    them to the modules' outputs through a captured Function instead (restored on exit)."""
    stashed: dict[nn.Module, Any] = {}
    handles = []
    for module in root.modules():
        hooks = list(module._backward_pre_hooks.values())
        if hooks and not module._backward_hooks and not any(side_effect(h) for h in hooks):
            stashed[module] = module._backward_pre_hooks
            module._backward_pre_hooks = type(stashed[module])()
            handles.append(module.register_forward_hook(_output_gradient_hooks(hooks)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module, hooks in stashed.items():
            module._backward_pre_hooks = hooks


def _output_gradient_hooks(hooks: list[Any]) -> Any:
    """A forward hook that routes the module's floating outputs through `hooks` in backward."""

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
                "which a traced program would silently drop.",
                where=user_frame(),
                fix="remove it before export (handle.remove()), or move its effect into the forward as an "
                "autograd.Function whose backward does the same.",
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
