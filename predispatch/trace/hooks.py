"""Refuse hooks that a functional trace would silently drop.

Forward hooks and pre-hooks simply run during the trace, so they are in the graph.  Backward
hooks are different: torch installs them on autograd nodes, which a trace on fake tensors
never builds, so torch's own export drops them without a word.  Until a hook can be captured
as a traced tensor function, export refuses it, naming the module, the hook and where it was
defined.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_globals

from predispatch.errors import UnsupportedHookError, user_frame


@contextlib.contextmanager
def refuse_backward_hooks(root: nn.Module) -> Iterator[None]:
    """While active: calling a module with backward hooks, or `Tensor.register_hook`, raises."""
    names = {id(m): path or type(root).__name__ for path, m in root.named_modules(remove_duplicate=False)}
    _check_global_hooks()

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
    original = torch.Tensor.register_hook
    torch.Tensor.register_hook = _refused_register_hook
    try:
        yield
    finally:
        torch.Tensor.register_hook = original
        if handle is not None:
            handle.remove()


def _refused_register_hook(tensor: torch.Tensor, hook: Any) -> Any:
    raise UnsupportedHookError(
        f"Tensor.register_hook({_describe([hook])}) is called in the traced code; a traced program "
        "would silently drop the hook.",
        where=user_frame(),
        fix="write the gradient transformation as an autograd.Function (forward: identity, backward: "
        "the hook), which predispatch captures with its backward.",
    )


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
