"""The module tensors a hook Function takes for hooks that read their module, and the check
that the forward pass leaves them as the Function took them.

Note [Hooks reading module state]
---------------------------------
A hook may read the module it is given (`go[0] @ module.weight`).  Traced as written, its
backward would read the outer trace's tensor for the weight, which a captured backward may
not (it reads only its operands and what its forward saved).  So when a hook may read module
state (`may_read_state` in inspection.py: it uses its module argument, is a bound method, or
reaches an `nn.Module` through a closure or a global; read from its source and names), its Function
takes every tensor the module holds as extra operands (`State`: parameters, buffers and tensor
attributes, recursively, a tied tensor once), saves them, and runs the hooks with the module
rebound to the saved values (`ti.reparametrize`, every name of a tied tensor); their gradients
are None:

    autograd_function_apply(backward_pre_hooks_fwd_0, backward_pre_hooks_bwd_0, linear, p_weight,
        p_bias, non_differentiable_idx = [], saved_for_backward_idx = [0, 1])

Hooks that cannot read it cost nothing (for a hooked Linear, 2 operands and 4 placeholders
more otherwise).  A hook then sees the module's tensors as they were when its Function ran,
before the module's forward for full backward hooks, after it for pre-hooks; eager reads them
when backward runs.  The two differ only for a tensor the forward pass changes later
(BatchNorm's running statistics in training, a second call of the module): refused at the end
of the forward (`check_state_unchanged`).  A tensor that is neither a gradient nor the
module's own (a global tensor, another module's weight) is refused by name (`_hook_refusal` in
capture.py).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import UnsupportedHookError, user_frame
from predispatch.custom_backward.hooks.inspection import may_read_state

_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


@dataclass(frozen=True)
class State:
    """A module's tensors handed to a hook Function, for hooks that read them in backward.

    See Note [Hooks reading module state].
    names: for each of `tensors`, every qualified name it has in the module (a tied tensor is
        handed over once).
    tensors: the Function's last operands, saved for backward.
    """

    names: tuple[tuple[str, ...], ...] = ()
    tensors: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def of(module: nn.Module, hooks: list[Any]) -> State:
        """All of the module's tensors when a hook may read them (`may_read_state`), else none."""
        if not any(may_read_state(hook) for hook in hooks):
            return State()
        held: dict[int, tuple[torch.Tensor, list[str]]] = {}
        for name, t in module_tensors(module):
            held.setdefault(id(t), (t, []))[1].append(name)
        return State(tuple(tuple(names) for _, names in held.values()), tuple(t for t, _ in held.values()))

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
class Handed:
    """Module tensors a hook Function took, as `check_state_unchanged` needs them.

    named: "module 'lin' (Linear) has a ... hook (...)", for the error.
    counts: `ti.mutation_count` of each of `state.tensors` when the Function took it.
    """

    named: str
    module: nn.Module
    state: State
    counts: tuple[int | None, ...]


def check_state_unchanged(handed_over: list[Handed]) -> None:
    """Refuse a module tensor that changed after a hook Function took it, see Note [Hooks
    reading module state]: the program's hook would read the old value, eager's the new one."""
    for handed in handed_over:
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


def module_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the module holds (parameters, buffers, tensor attributes), by qualified name."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        held = [*m._parameters.items(), *m._buffers.items(), *vars(m).items()]
        for name, t in held:
            if isinstance(t, torch.Tensor):
                yield (f"{prefix}.{name}" if prefix else name), t
