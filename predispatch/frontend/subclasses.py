"""Tensor subclasses in the state and the inputs: taken apart into the plain tensors they hold.

Note [Tensor subclasses]
------------------------
A quantized model's weights are tensor subclasses (torchao's `Int8Tensor` holds `qdata`,
`scale` and `zero_point`); research code wraps tensors in its own `__torch_dispatch__`
classes.  Eager runs such a tensor's ops through the class's own `__torch_function__` /
`__torch_dispatch__`, which compute on the plain tensors inside it.  A graph that records
`aten.linear` on the subclass weight would hand the subclass back to that code at every call,
below the point where eager hands it to the class's kernel (torchao raises "attempting to run
unimplemented operator aten.t"); and no graph consumer can run it.

So the program is a graph over the **plain tensors**, as AOTAutograd's subclass desugaring
makes it (`torch/_functorch/_aot_autograd/subclass_utils.py`):
- every traceable wrapper subclass (one with `__tensor_flatten__` / `__tensor_unflatten__`)
  among the state and the inputs is taken apart here into its plain tensors, each a graph input
  of its own, named after the subclass's and the attribute's (`p_lin_weight__qdata`), its spec
  saying which attribute it is (`InputSpec.inner`);
- the trace builds the subclass again from those inputs' traced tensors (`__tensor_unflatten__`
  with the context `__tensor_flatten__` gave) and binds it where the user's was, so forward
  runs the class's own Python rules, which run ops on plain traced tensors: those are the graph;
- a subclass forward returns is taken apart the same way (each plain tensor an output); a write
  to a subclass's tensor is a write to that plain input, written back as any other;
- `ep.module()` holds the user's subclass tensors themselves and takes them apart at each call
  (`SubclassLayout.flatten`, checked against the layout traced: class, attributes, context,
  size), and builds returned subclasses again (`SubclassLayout.unflatten`).

Refused by name here: a tensor subclass that cannot be taken apart (no `__tensor_flatten__`),
or whose parts are not tensors; a subclass input with dynamic shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import UnsupportedInputError, user_frame
from predispatch.frontend.distributed import is_dtensor
from predispatch.signature import SubclassLayout

__all__ = ["SubclassPart", "has_own_rules", "is_subclass", "layout_of", "part_name", "refuse_opaque_subclass"]

#: Tensor types that are plain for the trace: a parameter is a tensor with a flag.
_PLAIN = (torch.Tensor, nn.Parameter)


@dataclasses.dataclass(frozen=True, eq=False)
class SubclassPart:
    """Where a lifted plain tensor comes from, when it is a part of a subclass tensor.

    layout: the whole subclass tensor's layout.
    whole: the user's subclass tensor (the module's own: `ep.state_dict` and `module()` hold it).
    index: the part's position in `layout.paths()`.
    """

    layout: SubclassLayout
    whole: torch.Tensor
    index: int


def is_subclass(t: Any) -> bool:
    """Whether `t` is a tensor of a traceable wrapper subclass the program takes apart (not a
    DTensor: its own route, Note [Per-rank DTensor programs])."""
    return isinstance(t, torch.Tensor) and type(t) not in _PLAIN and ti.is_traceable_wrapper_subclass(t) and not is_dtensor(t)


def refuse_opaque_subclass(t: Any, where: str) -> None:
    """Refuse a tensor subclass the trace cannot take apart (`where`: the state's name or the
    input's path): traced as a plain tensor, its own rules would silently not run."""
    if not isinstance(t, torch.Tensor) or type(t) in _PLAIN or is_subclass(t) or is_dtensor(t) or ti.is_traced_tensor(t):
        return  # a running trace's tensor: an export nested in another sees the outer trace's
    if not _overrides_torch(type(t)):  # a plain Python subclass with no rules of its own
        return
    raise UnsupportedInputError(
        f"{where} is a {type(t).__module__}.{type(t).__qualname__}, a tensor subclass with its own "
        "__torch_function__/__torch_dispatch__ rules but no __tensor_flatten__/__tensor_unflatten__: "
        "export cannot take it apart into the plain tensors it computes on, and tracing it as a plain "
        "tensor would drop its rules.",
        where=user_frame(),
        fix="make it a traceable wrapper subclass (define __tensor_flatten__ and __tensor_unflatten__, "
        "as torch.testing._internal.two_tensor.TwoTensor does), or pass the plain tensor it wraps.",
    )


def has_own_rules(t: Any) -> bool:
    """Whether `t` is a tensor whose class brings torch function or dispatch rules of its own
    (not a parameter, not a running trace's tensor): a plain program would not run them."""
    return (
        isinstance(t, torch.Tensor) and type(t) not in _PLAIN and not ti.is_traced_tensor(t) and _overrides_torch(type(t))
    )


def _overrides_torch(cls: type[Any]) -> bool:
    """Whether `cls` brings its own torch function or dispatch rules."""
    return cls.__torch_function__ is not torch.Tensor.__torch_function__ or getattr(cls, "__torch_dispatch__", None) not in (
        None, torch.Tensor.__torch_dispatch__)


def layout_of(t: torch.Tensor, where: str) -> SubclassLayout:
    """`t`'s layout (`SubclassLayout`), its parts checked: each a plain tensor or a subclass
    that is itself taken apart; sizes static."""
    names, context = t.__tensor_flatten__()  # type: ignore[attr-defined]  # a traceable wrapper subclass
    inner: list[tuple[str, SubclassLayout | None]] = []
    for name in names:
        value = getattr(t, name)
        if is_subclass(value):
            inner.append((name, layout_of(value, f"{where}.{name}")))
        elif isinstance(value, torch.Tensor) and (type(value) in _PLAIN or ti.is_traced_tensor(value)):
            inner.append((name, None))
        else:
            raise UnsupportedInputError(
                f"{where} is a {type(t).__qualname__} whose part {name!r} is a {type(value).__qualname__}, "
                "not a tensor: the program takes a subclass apart into tensors only.",
                where=user_frame(),
                fix="keep only tensors among the attributes __tensor_flatten__ names; put other values in its context.",
            )
    size, stride = tuple(t.shape), tuple(t.stride())
    if not all(type(s) is int for s in (*size, *stride)):
        raise UnsupportedInputError(
            f"{where} is a {type(t).__qualname__} with symbolic sizes; tensor subclasses are exported with static shapes.",
            where=user_frame(),
            fix="export without dynamic_shapes for this input.",
        )
    return SubclassLayout(type(t), context, tuple(inner), size, stride)


def part_name(name: str, path: str) -> str:
    """The placeholder name of one part: the subclass's name and the attribute path
    (`p_lin_weight` and `qdata` -> `p_lin_weight__qdata`)."""
    return f"{name}__{path.replace('.', '__')}"
