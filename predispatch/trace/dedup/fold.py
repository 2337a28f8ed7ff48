"""Fold the fully traced calls of a shared block into `invoke_subgraph` calls on its body.

The first two calls of a key are traced inline (they are what the comparison compares); once
the trace is done and the key is shared, their runs of nodes are replaced by calls of the body,
so every call of a shared body is one node and the program reads the same at every layer:

    layer_norm = aten.layer_norm(x, ...); ...; add = aten.add(x, mul)        (layer 0, inline)
becomes
    invoke_subgraph = invoke_subgraph(repeated_body_0, 'repeated_body_0', p_layers_0_..., x)
    add = invoke_subgraph[0]

The body was copied from the first call's run, and the second call's run compared equal to it
node by node, so the fold changes no computation.  A run whose nodes are read after it other
than through its outputs (a value kept in Python state and used later) is left inline.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any

from torch import fx

from predispatch import _torch_internals as ti
from predispatch.trace.dedup.body import Region


@dataclass(frozen=True)
class CallSite:
    """A call traced in full: its run of nodes, the outer values it passes to the body (operands
    read, then symbolic sizes), and the module stack it was traced under (as `node_module_stack`
    gives it)."""

    region: Region
    operands: tuple[Any, ...]
    module_stack: dict[str, tuple[str, str]]


def node_module_stack(tracer_stack: dict) -> dict[str, tuple[str, str]]:
    """The tracer's module stack (`{key: (path, class)}`) as make_fx writes it into a node's
    `nn_module_stack`: the class as its qualified name.  torch.export.save refuses a node whose
    stack holds a class object, and a folded call is built outside make_fx's `create_node`."""
    return {
        key: (path, f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else cls)
        for key, (path, cls) in tracer_stack.items()
    }


def fold_traced_calls(
    gm: fx.GraphModule,
    body: fx.GraphModule,
    name: str,
    sites: list[CallSite],
    replaced: dict[fx.Node, fx.Node],
    alive: set[fx.Node],
) -> None:
    """Replace each site's run of nodes in `gm` by an `invoke_subgraph` call on `body` (installed
    on `gm` as `name` if no replay installed it).  `replaced` maps the outputs of runs folded so
    far to the `getitem`s that stand for them now (a later call's operand may be one).  `alive`:
    the nodes of `gm` (kept by the caller for all its keys, not gathered again for each: that
    was quadratic in the number of shared blocks); the nodes erased here are taken out of it."""
    erased: list[fx.Node] = []
    for site in sites:
        # make_fx may already have dropped dead nodes of the run (with dynamic shapes)
        region = dataclasses.replace(site.region, nodes=tuple(n for n in site.region.nodes if n in alive))
        if region.nodes and _closed(region):
            if not hasattr(gm, name):
                gm.add_submodule(name, body)
            _fold(gm, name, dataclasses.replace(site, region=region), replaced)
            erased.extend(region.nodes)
    alive.difference_update(erased)


def _closed(region: Region) -> bool:
    """Whether only the region's outputs are read after it."""
    inside, outputs = set(region.nodes), set(region.outputs)
    return all(user in inside for node in region.nodes if node not in outputs for user in node.users)


def _fold(gm: fx.GraphModule, name: str, site: CallSite, replaced: dict[fx.Node, fx.Node]) -> None:
    graph, region = gm.graph, site.region
    inside = set(region.nodes)
    first = region.nodes[0]
    operands = tuple(replaced.get(x, x) if isinstance(x, fx.Node) else x for x in site.operands)
    with graph.inserting_before(first):
        getter = graph.get_attr(name)
        call = graph.call_function(ti.invoke_subgraph, (getter, name, *operands))
        items = [graph.call_function(operator.getitem, (call, k)) for k in range(len(region.outputs))]
    call.meta.update(
        val=tuple(out.meta.get("val") for out in region.outputs),
        nn_module_stack=site.module_stack,
        stack_trace=first.meta.get("stack_trace"),
    )
    names = []
    for item, out in zip(items, region.outputs):
        item.meta.update(out.meta)
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
        replaced[out] = item
        names.append(out.name)
    for node in reversed(region.nodes):
        graph.erase_node(node)
    for item, old in zip(items, names):
        item._rename(old)
