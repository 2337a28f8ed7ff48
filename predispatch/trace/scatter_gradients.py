"""`as_strided_scatter` rewritten so that the program's gradient through it is right.

Note [as_strided_scatter's gradient]
------------------------------------
Functionalization turns a write through an `as_strided` view (`x.as_strided(...).mul_(2)`,
and the buffers torch.func's jacrev and vmap-over-vjp fill) into
`as_strided_scatter(self, src, size, stride, offset)`.  torch's derivative of that op for `self`
is the complement of the right one (torch 2.11 to 2.15): it gives `self` the gradient inside the
scattered region, where `src` overwrote it, and zero outside, where the output is `self`:

    x = torch.zeros(3, 3, requires_grad=True)
    torch.as_strided_scatter(x, torch.zeros(3), [3], [1], 0).sum().backward()
    x.grad  ->  [[1, 1, 1], [0, 0, 0], [0, 0, 0]]        slice_scatter's: [[0, 0, 0], [1, 1, 1], [1, 1, 1]]

(its review said as much: "Autograd formula looks wrong", pytorch/pytorch#77128).  Eager never
calls the op (it writes in place and differentiates through CopySlices), so a program holding
it had wrong gradients: the write through an as_strided view above, and jacrev through a layer
(the outer gradient came out exactly twice eager's, where `self` was overwritten whole).

Each call is rewritten to the same values with a derivative that is right, from ops whose own
derivatives are: `src` scattered into zeros (`as_strided_scatter`'s `src` derivative is right,
and its `self` is now a constant), selected by the region's mask, `self` outside it:

    where(as_strided_scatter(zeros_like(self, bool), ones_like(src, bool), ...),
          as_strided_scatter(zeros_like(self), src, ...),
          self)

A call the user's code makes itself (`torch.as_strided_scatter(x, src, ...)`) is eager's own op,
differentiated by torch's derivative in eager too: it is kept as called (`note_direct_call`
marks it as the functional mode meets it; a call it cannot mark stops the export).

The values are bitwise the op's: `where` picks each element from one side, and the scatter into
zeros writes the region as the op does (overlapping strides included: the same op writes both).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from predispatch import _meta
from predispatch import _torch_internals as ti

__all__ = ["note_direct_call", "rewrite_as_strided_scatters"]

aten = torch.ops.aten
MECHANISM = "as_strided_scatter's gradient (direct calls kept, seen by the functional mode's op observer)"
#: Node meta the rewritten nodes inherit from the call they replace.
_INHERITED_META = ("stack_trace", "nn_module_stack", "torch_fn", _meta.BELOW_AUTOGRAD)


def note_direct_call(func: object, out: object) -> None:
    """Mark the node of an `as_strided_scatter` the traced code called itself (the functional
    mode met it as an op): it keeps torch's derivative, as in eager."""
    if func is not aten.as_strided_scatter.default:
        return
    tracer = ti.current_tracer()
    node = ti.traced_node(out, tracer) if tracer is not None and isinstance(out, torch.Tensor) else None
    if node is None:
        raise ti.drift(MECHANISM, "the graph node of an as_strided_scatter call could not be found")
    node.meta[_meta.DIRECT_CALL] = True


def rewrite_as_strided_scatters(gm: fx.GraphModule, fake_mode: torch._subclasses.FakeTensorMode) -> int:
    """Rewrite every `as_strided_scatter` in `gm` and its subgraphs; returns how many."""
    count = 0
    for graph_module in gm.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        for node in graph_module.graph.find_nodes(op="call_function", target=aten.as_strided_scatter.default):
            if node.meta.get(_meta.DIRECT_CALL):
                continue
            _rewrite(graph_module.graph, node, fake_mode)
            count += 1
        if count:
            graph_module.graph.lint()
    return count


def _rewrite(graph: fx.Graph, node: fx.Node, fake_mode: torch._subclasses.FakeTensorMode) -> None:
    self, src, *geometry = node.args
    region = (*geometry, *node.kwargs.values())  # size, stride, storage_offset
    with graph.inserting_before(node):
        calls: list[tuple[str, Any, tuple, dict[str, Any]]] = [
            ("mask_base", aten.zeros_like.default, (self,), {"dtype": torch.bool}),
            ("mask_src", aten.ones_like.default, (src,), {"dtype": torch.bool}),
            ("mask", aten.as_strided_scatter.default, ("mask_base", "mask_src", *region), {}),
            ("zeros", aten.zeros_like.default, (self,), {}),
            ("scattered", aten.as_strided_scatter.default, ("zeros", src, *region), {}),
            ("out", aten.where.self, ("mask", "scattered", self), {}),
        ]
        made: dict[str, fx.Node] = {}
        for name, op, args, kwargs in calls:
            args = tuple(made[a] if isinstance(a, str) else a for a in args)
            made[name] = graph.create_node("call_function", op, args, kwargs, name=f"{node.name}_{name}")
            made[name].meta.update({k: node.meta[k] for k in _INHERITED_META if k in node.meta})
            with fake_mode:
                made[name].meta["val"] = op(*_vals(args), **kwargs)
    node.replace_all_uses_with(made["out"])
    graph.erase_node(node)


def _vals(args: tuple) -> tuple:
    return tuple(a.meta["val"] if isinstance(a, fx.Node) else a for a in args)
