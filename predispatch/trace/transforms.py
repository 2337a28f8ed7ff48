"""torch.func transforms called inside forward, traced below autograd.

Note [torch.func in forward]
----------------------------
functorch's transforms wrap tensors in levels of their own (`BatchedTensor` for vmap,
`GradTrackingTensor` for grad), whose dispatch keys sit below PreDispatch: an op on them meets
the trace's functional mode first, which passes it on, and the batching rule's own ops then
meet a FunctionalTensor with no mode ("Attempting to use FunctionalTensor on its own").  So a
transform called in forward runs, as a whole, traced below autograd, as make_fx without
pre_dispatch (and AOTAutograd) traces transforms: the same tracer, with a proxy mode and a
FunctionalTensorMode on the ordinary dispatch stack (`ti.traced_below_autograd`).  functorch
runs as in eager; what reaches the graph is what its rules compute, in place, as plain ATen
ops: vmap's batched ops, grad's forward and backward ops of the inner function.  The results
are FunctionalTensors the outer trace goes on with, and the program differentiates those ops
for the outer gradient, as eager differentiates through the transform:

    return torch.func.vmap(lambda row: self.lin(row).sin())(x)
    ->  t = aten.t(p_lin_weight); mm = aten.mm(x, t); add = aten.add(mm, p_lin_bias); sin = aten.sin(add)

Below autograd, composites decompose (`linear` is `t` and `mm`) whatever the decomposition
policy says, and a grad-mode change is not recorded as a region.  jacrev's basis and the
gradient buffers vmap-over-vjp fills are writes through `as_strided` views, functionalized as
`as_strided_scatter`, whose derivative torch gets wrong: the trace rewrites it (Note
[as_strided_scatter's gradient] in trace/scatter_gradients.py; jacrev through a layer had twice
eager's outer gradient before).  Refused by name instead of
a program that could differ from eager (`UnsupportedConstructError`):
- a grad-mode change by the user's code inside the transform (`torch.no_grad()`,
  `inference_mode`); the transform's own (grad's `enable_grad`) are its semantics;
- any failure inside the transform (jvp under vmap, as in jacfwd and hessian), with torch's
  error kept.
(torch's own pre-dispatch wrappers for jvp, `torch._functorch.predispatch`, recorded a graph
whose tangent was zeros, holding FunctionalTensors as constants: jvp is traced here too.)

Entry points: the functions torch's transforms call at run time (`vmap_impl`, `grad_impl`,
`grad_and_value_impl`, `_vjp_with_argnums`, `_jvp_with_argnums`), looked up by name when called, so a transform the
user imported before export still reaches them.  The outermost call is traced; transforms
nested inside it run as they are.  A torch without an entry point raises at export start
(`ti.require`); one whose transform stops calling it leaves that transform to the old failure,
which `constructs.torch_func_refusal` names: loud either way.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch._functorch.apis
import torch._functorch.eager_transforms
from torch import fx
from torch.overrides import TorchFunctionMode

from predispatch import _meta
from predispatch import _torch_internals as ti
from predispatch.errors import PredispatchError, UnsupportedConstructError, from_torch, user_frame

MECHANISM = "torch.func transforms in forward (functorch's transform entry points)"


@dataclass(frozen=True)
class EntryPoint:
    """A function torch's transforms call when applied.

    owner, name: where torch looks it up at call time.
    transform: the torch.func name users know it by, for errors.
    """

    owner: Any
    name: str
    transform: str


ENTRY_POINTS = (
    EntryPoint(torch._functorch.apis, "vmap_impl", "vmap"),
    EntryPoint(torch._functorch.eager_transforms, "grad_impl", "grad"),
    EntryPoint(torch._functorch.eager_transforms, "grad_and_value_impl", "grad_and_value"),
    EntryPoint(torch._functorch.eager_transforms, "_vjp_with_argnums", "vjp (or jacrev)"),
    EntryPoint(torch._functorch.eager_transforms, "_jvp_with_argnums", "jvp (or jacfwd)"),
)

_FUNCTORCH_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_functorch") + os.sep
#: Files between a grad-mode change and the code that asked for it (context managers).
_GRAD_MODE_FILES = tuple(
    os.path.abspath(m.__file__ or "")
    for m in (sys.modules["torch.autograd.grad_mode"], sys.modules["torch.utils._contextlib"], contextlib)
)


class _Transforms:
    """The transforms being traced now: only the outermost call is traced below autograd."""

    def __init__(self) -> None:
        self.depth = 0


@contextlib.contextmanager
def transforms_below_autograd() -> Iterator[None]:
    """While active, a torch.func transform called inside the trace is traced below autograd
    (Note [torch.func in forward])."""
    active = _Transforms()
    with contextlib.ExitStack() as stack:
        for entry in ENTRY_POINTS:
            make = lambda original, entry=entry: _traced(entry, original, active)  # noqa: E731
            stack.enter_context(ti.patched(entry.owner, entry.name, make, mechanism=MECHANISM))
        yield


def _traced(entry: EntryPoint, original: Callable[..., Any], active: _Transforms) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if active.depth or ti.current_tracer() is None:
            return original(*args, **kwargs)
        active.depth += 1
        try:
            out = _below_autograd(entry, original, args, kwargs)
        finally:
            active.depth -= 1
        if entry.name == "_vjp_with_argnums":  # vjp's function runs later, out of this call: traced too
            return tuple(_traced(entry, v, active) if callable(v) else v for v in out)
        return out

    return call


def _below_autograd(entry: EntryPoint, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """One outermost transform call, traced below autograd; the checks of Note [torch.func in forward]."""
    where = user_frame()
    try:
        with ti.traced_below_autograd() as graph, _UserGradModeChanges(entry, where):
            last = _last_node(graph)
            out = original(*args, **kwargs)
    except PredispatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - the transform failed below autograd: named, torch's error kept
        raise from_torch(
            UnsupportedConstructError(
                f"forward calls torch.func.{entry.transform}, which export traces below autograd, and tracing "
                f"it failed: {type(exc).__name__}: {_first_line(exc)}",
                where=where,
                fix=_FIX,
            ),
            exc,
        ) from None
    _mark_below_autograd(entry, graph, last)
    return out


_FIX = (
    "export the function the transform is applied to and apply torch.func to the program "
    "(torch.func.vmap(ep.module())(x) works); or write the computation without the transform."
)


def _last_node(graph: fx.Graph) -> fx.Node:
    return next(iter(reversed(graph.nodes)))


def _mark_below_autograd(entry: EntryPoint, graph: fx.Graph, last: fx.Node) -> None:
    """Mark what the transform computed as computed below autograd (`_meta.BELOW_AUTOGRAD`)."""
    node = last.next
    while node is not graph._root:
        node.meta[_meta.BELOW_AUTOGRAD] = entry.transform
        node = node.next


class _UserGradModeChanges(TorchFunctionMode):
    """Refuse a grad-mode change the user's code makes inside the transform (not functorch's own)."""

    def __init__(self, entry: EntryPoint, where: str | None):
        super().__init__()
        self.entry, self.where = entry, where

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._set_grad_enabled and not _asked_by_functorch():
            raise UnsupportedConstructError(
                f"forward changes the grad mode (torch.no_grad(), inference_mode, set_grad_enabled) inside "
                f"torch.func.{self.entry.transform}; export traces the transform below autograd, where the "
                "change leaves no trace, so the program would differentiate what eager does not.",
                where=user_frame() or self.where,
                fix="use .detach() on the values that must not be differentiated, or move the change out of "
                "the transformed function.",
            )
        return func(*args, **(kwargs or {}))


def _asked_by_functorch() -> bool:
    """Whether the grad-mode change in progress comes from functorch's own code."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) in _GRAD_MODE_FILES:
        frame = frame.f_back
    return frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_FUNCTORCH_DIR)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
