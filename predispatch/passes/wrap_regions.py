"""Rewrite grad-mode and autocast regions into higher-order ops holding subgraphs.

Before (raw toggles, as the pre-dispatch trace records them):

    _set_grad_enabled = torch._C._set_grad_enabled(False)
    mul = torch.ops.aten.mul.Tensor(x, 2)
    _set_grad_enabled_1 = torch._C._set_grad_enabled(True)
    add = torch.ops.aten.add.Tensor(x, mul)

After (torch's own HOPs, so downstream torch tooling recognizes them):

    grad_region_0 = self.grad_region_0
    wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x)
    mul = wrap_with_set_grad_enabled[0]
    add = torch.ops.aten.add.Tensor(x, mul)

Semantics (why not torch's `replace_set_grad_with_hop_pass`): a region's state is absolute,
so a program behaves the same whatever grad mode it is called in.  Torch's pass drops a region
whose state equals the grad mode *at pass time*, which is wrong for `enable_grad` in a program
called under `no_grad`, and for `enable_grad` nested inside `no_grad`.  Here a region is only
inlined when it repeats the state of the region that encloses it.

Nesting is recovered from the toggles.  `enable_grad().__enter__` and `no_grad().__exit__` both
record `_set_grad_enabled(True)`, so the trace marks each toggle node "enter" or "exit" (see
`trace/grad_history.py`): an exit closes the innermost open grad region, anything else opens
one (a plain `torch.set_grad_enabled(False)` never undone is a region open to the end of
forward).  Unmarked toggles (graphs not traced by predispatch) close a region when they return
to the state in force before it.
Autocast enter/exit nodes are paired by the graph itself.  A region closed while a region it
encloses is still open (ill-nested context managers) closes the inner one too and reopens it
after, which keeps the meaning.

Precondition: a functional graph (mutations are outputs), so a region's effects are exactly
its outputs.  Postcondition: no `_set_grad_enabled`, `_enter_autocast` or `_exit_autocast`
call is left in any graph.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from predispatch import _meta
from predispatch import _torch_internals as ti

_SET_GRAD = torch._C._set_grad_enabled
_ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
_EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast
TOGGLES = (_SET_GRAD, _ENTER_AUTOCAST, _EXIT_AUTOCAST)


class RegionKind(enum.Enum):
    GRAD = "grad"
    AUTOCAST = "autocast"


_HOP = {RegionKind.GRAD: ti.wrap_with_set_grad_enabled, RegionKind.AUTOCAST: ti.wrap_with_autocast}


@dataclass
class Region:
    """A span of the graph run under one grad mode or autocast state.

    kind: grad mode or autocast.
    state: the HOP's leading arguments: `(enabled,)` or `(device, dtype, enabled, cache)`.
    start: the node that opens it (a toggle or autocast enter); None for a reopened region.
    nodes: the nodes it holds directly, in order.
    children: regions nested in it, in order.
    """

    kind: RegionKind
    state: tuple
    start: fx.Node | None
    nodes: list[fx.Node] = field(default_factory=list)
    children: list[Region] = field(default_factory=list)
    members: list[fx.Node] = field(default_factory=list)  # own nodes and children's, in order
    name: str = ""  # the subgraph's attribute name: grad_region_0, autocast_region_1, ...


def _name_regions(region: Region, counter: dict[RegionKind, int]) -> None:
    """Number regions outermost first, in program order, per kind."""
    for child in region.children:
        child.name = f"{child.kind.value}_region_{counter[child.kind]}"
        counter[child.kind] += 1
        _name_regions(child, counter)


def wrap_regions(gm: fx.GraphModule) -> None:
    """Rewrite every region of `gm` into a HOP call (in place); see the module docstring."""
    root = _parse_regions(gm)
    _name_regions(root, {kind: 0 for kind in RegionKind})
    for region in root.children:
        _materialize(gm, region, enclosing_grad=None)
    for node in reversed(list(gm.graph.nodes)):  # exits before their enters
        if node.op == "call_function" and node.target in TOGGLES:
            gm.graph.erase_node(node)
    gm.graph.lint()


def _parse_regions(gm: fx.GraphModule) -> Region:
    """Build the region tree from the toggles (see the module docstring for the rules)."""
    root = Region(RegionKind.GRAD, (True,), None)
    stack = [root]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_function" and node.target is _SET_GRAD:
            _on_grad_toggle(stack, node)
        elif node.op == "call_function" and node.target is _ENTER_AUTOCAST:
            _open(stack, Region(RegionKind.AUTOCAST, tuple(node.args), node))
        elif node.op == "call_function" and node.target is _EXIT_AUTOCAST:
            _close(stack, next(r for r in reversed(stack) if r.start is node.args[0]))
        else:
            for region in stack:
                region.members.append(node)
            stack[-1].nodes.append(node)
    return root


def _grad_state(stack: list[Region], below: int | None = None) -> bool:
    """The grad mode in force at the top of `stack` (or under index `below`)."""
    regions = stack if below is None else stack[:below]
    return next(r.state[0] for r in reversed(regions) if r.kind is RegionKind.GRAD)


def _on_grad_toggle(stack: list[Region], node: fx.Node) -> None:
    enabled = node.args[0]
    innermost = max(i for i, r in enumerate(stack) if r.kind is RegionKind.GRAD)
    marked = node.meta.get(_meta.GRAD_TOGGLE)
    if innermost > 0 and (marked == "exit" if marked else enabled == _grad_state(stack, below=innermost)):
        _close(stack, stack[innermost])
    else:
        _open(stack, Region(RegionKind.GRAD, (enabled,), node))


def _open(stack: list[Region], region: Region) -> None:
    stack[-1].children.append(region)
    stack.append(region)


def _close(stack: list[Region], region: Region) -> None:
    """Close `region`; regions still open inside it are closed here and reopened after."""
    index = stack.index(region)
    reopened = [Region(r.kind, r.state, None) for r in stack[index + 1 :]]
    del stack[index:]
    for inner in reopened:
        _open(stack, inner)


def _materialize(gm: fx.GraphModule, region: Region, enclosing_grad: bool | None):
    """Turn `region` (children first) into a subgraph and a HOP call in `gm`.

    Returns `(old_nodes, new_nodes)` when the region was extracted, so the enclosing region
    can put the HOP call where the region's nodes were; None when it stayed inline.
    """
    grad = region.state[0] if region.kind is RegionKind.GRAD else enclosing_grad
    if region.children:
        region.members = _members_after_children(gm, region, grad)
    if not region.members:
        return None
    if region.kind is RegionKind.GRAD and region.state[0] == enclosing_grad:
        return None  # repeats the enclosing state: its nodes simply stay inline
    span = list(region.members)
    return span, _extract(gm, region, span)


def _members_after_children(gm: fx.GraphModule, region: Region, grad: bool | None) -> list[fx.Node]:
    """Materialize `region`'s children; its members with each child's run of nodes replaced by
    what the child became: its HOP call's nodes, or its own members when it stayed inline.

    A region's members are every node traced while it was open, so each child's are one run of
    them, and a grandchild's nodes are in the child's run: the run is replaced whole (the nodes
    a grandchild's extraction erased go with it).  One pass over the members for all children:
    a search and a rebuild per child was quadratic in the number of regions inside one.
    """
    owner: dict[fx.Node, int] = {}
    became: list[list[fx.Node]] = []
    for i, child in enumerate(region.children):
        owner.update(dict.fromkeys(child.members, i))  # before the child's own rewrite
        replaced = _materialize(gm, child, grad)
        became.append(replaced[1] if replaced else child.members)
    members: list[fx.Node] = []
    placed: set[int] = set()
    for node in region.members:
        run = owner.get(node)
        if run is None:
            members.append(node)
        elif run not in placed:
            placed.add(run)
            members.extend(became[run])
    return members


def _extract(gm: fx.GraphModule, region: Region, span: list[fx.Node]) -> list[fx.Node]:
    """Move `span` into a new GraphModule and call it through the region's HOP; returns the new nodes."""
    inside = set(span)
    inputs = _unique(a for n in span for a in n.all_input_nodes if a not in inside)
    outputs = [n for n in span if any(u not in inside for u in n.users)]
    returned = set(outputs)
    sub_graph, attributes = _copy_into_subgraph(gm, span, inputs, outputs)
    name = region.name
    gm.add_submodule(name, fx.GraphModule(attributes, sub_graph, class_name=name))
    graph = gm.graph
    with graph.inserting_before(span[0]):
        body = graph.get_attr(name)
        call = graph.call_function(_HOP[region.kind], (*region.state, body, *inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    for i, out in enumerate(outputs):  # each output node becomes its own getitem: name and meta stay
        out.op, out.target, out.args, out.kwargs = "call_function", operator.getitem, (call, i), {}
    for node in reversed(span):
        if node not in returned:
            graph.erase_node(node)
    for attr in {n.target for n in span if n.op == "get_attr"}:
        if not graph.find_nodes(op="get_attr", target=attr):
            delattr(gm, attr)
    return [body, call, *outputs]


def _copy_into_subgraph(gm: fx.GraphModule, span, inputs, outputs) -> tuple[fx.Graph, dict]:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    attributes = {}
    for node in span:
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.op == "get_attr":
            attributes[node.target] = getattr(gm, node.target)
    graph.output(tuple(env[o] for o in outputs))
    return graph, attributes


def _unique(nodes) -> list[fx.Node]:
    return list(dict.fromkeys(nodes))
