"""Backward hooks that cannot be captured, refused by name when their module is called.

torch installs backward hooks on autograd nodes, which a trace on fake tensors never builds, so
a hook left in place would be dropped from the program without a word: the deprecated
`register_backward_hook`, hooks with Python side effects, hooks on modules outside the
exported one, and global backward hooks are refused instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn.modules import module as module_globals

from predispatch.errors import UnsupportedHookError, user_frame
from predispatch.custom_backward.hooks.inspection import describe, side_effect


def refusal(module: nn.Module) -> tuple[Any, str] | None:
    """The backward hook that keeps a module's hooks from being captured, and why; or None."""
    for hook in [*module._backward_pre_hooks.values(), *module._backward_hooks.values()]:
        effect = side_effect(hook)
        if effect:
            return hook, f"it has a Python side effect ({effect})."
    if module._backward_hooks and not getattr(module, "_is_full_backward_hook", True):
        return next(iter(module._backward_hooks.values())), "it was registered with the deprecated register_backward_hook."
    return None


def _why_refused(module: nn.Module) -> tuple[Any, str]:
    """Which hook `captured_module_hooks` left in place on a module, and why (for the error)."""
    hooks = [*module._backward_pre_hooks.values(), *module._backward_hooks.values()]
    return refusal(module) or (
        hooks[0],
        "the module is not a submodule of the exported one, so its hooks were not set up for capture.",
    )


@contextlib.contextmanager
def refusing_module_hooks(root: nn.Module, names: dict[int, str]) -> Iterator[None]:
    """Raise when a module with a (not captured) backward hook is called."""

    def pre_hook(module: nn.Module, args: Any) -> None:
        if module._backward_pre_hooks or module._backward_hooks:
            name = names.get(id(module), type(module).__name__)
            hook, why = _why_refused(module)
            raise UnsupportedHookError(
                f"module {name!r} ({type(module).__name__}) has a backward hook, {describe([hook])}, "
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


def check_global_hooks() -> None:
    hooks = [*module_globals._global_backward_pre_hooks.values(), *module_globals._global_backward_hooks.values()]
    if hooks:
        raise UnsupportedHookError(
            f"a global module backward hook is registered ({describe(hooks)}); a traced program would "
            "silently drop it.",
            where=user_frame(),
            fix="remove it before export (handle.remove()).",
        )
