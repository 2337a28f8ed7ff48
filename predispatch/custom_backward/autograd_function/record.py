"""What one captured `Function.apply` call leaves behind, and the `ctx` objects its user code sees.

The forward runs once, on a `ForwardCtx`; what it put on the context is turned into data
(`CapturedCall` and the graph's saved values).  The backward is then traced on a `BackwardCtx`
rebuilt from that data, whose tensors are the backward graph's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.autograd.function import FunctionCtx

#: Attributes `FunctionCtx`'s methods set; every other attribute on a ctx belongs to the user.
CTX_OWN = frozenset(
    {"to_save", "dirty_tensors", "non_differentiable", "materialize_grads", "saved_for_forward", "needs_input_grad"}
)


@dataclass(frozen=True)
class OutputLeaf:
    """One element of the value forward returned.

    index: its position among the tensor outputs (the HOP's outputs); None for a constant.
    value: the constant (an int, a string, None, ...) when `index` is None.
    """

    index: int | None
    value: Any = None


@dataclass(frozen=True)
class SavedAttribute:
    """A user attribute set on ctx in forward (`ctx.scale = 2.0`, `ctx.x = x`).

    name: the attribute name.
    spec: the pytree spec of its value.
    leaves: its leaves; a tensor leaf is stored as `SavedSlot(i)`, the i-th saved value.
    """

    name: str
    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]


@dataclass(frozen=True)
class SavedSlot:
    """Stands for the `index`-th saved value (an output of the forward graph, input of the backward)."""

    index: int


@dataclass(frozen=True, eq=False)
class CapturedCall:
    """One `Function.apply` call, its forward and backward traced once each.

    function: the user's Function class (or one made from a pair of graphs, `capture._pair_function`).
    forward: `(*operands) -> ((*outputs), (*saved))`, the user's forward as a functional graph;
        operands are the tensor leaves of the arguments, in pytree order.
    backward: `(*output_grads, *saved) -> (*operand_grads)`, the user's backward as a functional
        graph; an operand that gets no gradient has None in its place.
    outputs: forward's return value, leaf by leaf (a single tensor is one leaf).
    returns_tuple: whether forward returned a tuple (else a single value).
    non_differentiable: indices of the outputs passed to `ctx.mark_non_differentiable`.
    saved_for_backward: indices of the saved values that came from `ctx.save_for_backward`
        (the others are tensors stored as ctx attributes).
    dirty: `(output index, operand index)` for each input forward modified in place and
        passed to `ctx.mark_dirty`.
    """

    function: type
    forward: fx.GraphModule
    backward: fx.GraphModule
    outputs: tuple[OutputLeaf, ...]
    returns_tuple: bool
    non_differentiable: tuple[int, ...]
    saved_for_backward: tuple[int, ...]
    dirty: tuple[tuple[int, int], ...]

    def node_kwargs(self) -> dict[str, list[int]]:
        """The keyword arguments torch's `autograd_function_apply` takes besides the graphs."""
        return {"non_differentiable_idx": list(self.non_differentiable), "saved_for_backward_idx": list(self.saved_for_backward)}

    def user_output(self, tensors: list[torch.Tensor]) -> Any:
        """Forward's return value rebuilt from the HOP's tensor outputs and the recorded constants."""
        values = tuple(tensors[leaf.index] if leaf.index is not None else leaf.value for leaf in self.outputs)
        return values if self.returns_tuple else values[0]


class ForwardCtx(FunctionCtx):
    """The ctx a Function's forward (or setup_context) sees during export.

    It records what forward asks for (`FunctionCtx`'s own methods store it as attributes);
    `needs_input_grad` says True for every floating tensor argument, because the program may
    be trained with any of them requiring grad (see Note [Capturing autograd.Function]).
    """

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = True

    def user_attributes(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k not in CTX_OWN}


class BackwardCtx(FunctionCtx):
    """The ctx a Function's backward sees during export: forward's ctx, rebuilt from data.

    `saved_tensors` and tensor attributes are the backward graph's inputs; constant
    attributes are forward's own values.
    """

    def __init__(self, needs_input_grad: tuple[bool, ...], materialize_grads: bool, saved_tensors: tuple, attributes: dict):
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = materialize_grads
        self.saved_tensors = saved_tensors
        self.saved_variables = saved_tensors  # the deprecated name some Functions still use
        for name, value in attributes.items():
            setattr(self, name, value)


def is_differentiable(value: Any) -> bool:
    """Whether autograd could give `value` a gradient: a floating or complex tensor."""
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
