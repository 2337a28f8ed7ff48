"""A recorded call's nodes as a subgraph of its own, and the node-by-node comparison of two.

A call traced in full leaves a contiguous run of nodes in the outer graph (make_fx appends).
`extract` copies that run into a GraphModule whose placeholders are the block's operands (its
parameters, buffers and tensor inputs, in a fixed order) and whose outputs are the block's
tensor outputs followed by the new values of the operands it changed in place.  A run that
reads any other outer node (a tensor reached through Python state, a symbolic size computed
outside) is not a closed computation of its operands: it cannot be shared, and `extract` says why.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from predispatch import _torch_internals as ti


@dataclass(frozen=True)
class Region:
    """The outer-graph nodes of one recorded call.

    nodes: the run, in graph order.
    used: operand positions the run reads, in order: the body's placeholders.
    outputs: the nodes the body returns (user outputs, then new values of mutated operands).
    """

    nodes: tuple[fx.Node, ...]
    used: tuple[int, ...]
    outputs: tuple[fx.Node, ...]
    symbols: tuple[fx.Node, ...] = ()


#: Node values that are symbolic sizes: the body takes them as extra operands (see `find_region`).
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class NotClosed(Exception):
    """The run of nodes is not a function of the block's operands alone (the reason is the message)."""


def find_region(
    first: fx.Node | None,
    last: fx.Node,
    operand_nodes: Sequence[fx.Node | None],
    outputs: Sequence[fx.Node],
    size_symbols: frozenset = frozenset(),
) -> Region:
    """The run after `first` up to `last`, with the operands it reads; `NotClosed` if it reads
    an outer node that is no operand, or returns a node that is not its own.

    An outer node holding a symbolic size (`sym_size_int` of the first input, made before the
    block) is no operand but is allowed when its expression only uses `size_symbols`, the
    symbols of the operands' shapes: every call with the same operand shapes (the key) has the
    same value, so the body takes it as an extra operand and each call passes that same value."""
    nodes: list[fx.Node] = []
    node = first.next if first is not None else None
    while node is not None and node.op != "root":
        nodes.append(node)
        if node is last:
            break
        node = node.next
    inside = set(nodes)
    position = {}
    for i, operand in enumerate(operand_nodes):
        if operand is not None:
            position.setdefault(operand, i)
    used, symbols = set(), {}
    for node in nodes:
        if node.op in ("placeholder", "output"):
            raise NotClosed(f"the block's trace holds a {node.op} node")
        for arg in node.all_input_nodes:
            if arg in inside:
                continue
            if arg in position:
                used.add(position[arg])
            elif _is_size_of_operands(arg, size_symbols):
                symbols.setdefault(arg, None)
            else:
                raise NotClosed(f"{node.name} reads {arg.name}, a value from outside the block that is not its input or state")
    for out in outputs:
        if out not in inside:
            raise NotClosed(f"the block returns {out.name} unchanged (an input, its state, or an outer value)")
    return Region(tuple(nodes), tuple(sorted(used)), tuple(outputs), tuple(symbols))


def _is_size_of_operands(node: fx.Node, size_symbols: frozenset) -> bool:
    value = node.meta.get("val")
    return isinstance(value, _SYMBOLIC) and bool(size_symbols) and ti.free_symbols(value) <= size_symbols


def extract(region: Region, root: torch.nn.Module, operand_nodes: Sequence[fx.Node], names: Sequence[str], class_name: str) -> fx.GraphModule:
    """Copy `region` into a GraphModule `(*used operands) -> (*outputs)`, dead nodes left out.

    get_attr targets (constants, subgraphs of regions and Functions inside the block) are
    copied onto the new module under the same names.  The module is lazy (torch's
    `_LazyGraphModule`: no Python code generated until it runs or is printed): most recorded
    calls are only compared with another (`first_difference` reads the graph), and the one body
    that is shared gets its code when build generates every graph's (`ti.generate_code`);
    generating code for every recorded call cost ~10% of a ResNet's export (benchmarks/vision.py).
    """
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i in region.used:
        placeholder = graph.placeholder(names[i])
        placeholder.meta.update(operand_nodes[i].meta)
        env[operand_nodes[i]] = placeholder
    for symbol in region.symbols:
        placeholder = graph.placeholder(symbol.name)
        placeholder.meta.update(symbol.meta)
        env[symbol] = placeholder
    attributes: dict[str, Any] = {}
    live = _live(region)
    for node in region.nodes:
        if node in live:
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op == "get_attr":
                attributes[node.target] = _get(root, node.target)
    graph.output(tuple(env[n] for n in region.outputs))
    return ti.LazyGraphModule(attributes, graph, class_name=class_name)


def _live(region: Region) -> set[fx.Node]:
    """The run's nodes its outputs depend on, and those with side effects (what FX's dead code
    elimination keeps; copying only these spares the copy and the elimination: a third of a
    recorded call's cost)."""
    inside = set(region.nodes)
    live: set[fx.Node] = set()
    stack = [n for n in region.nodes if n.is_impure()] + list(region.outputs)
    while stack:
        node = stack.pop()
        if node in live or node not in inside:
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    return live


def named(body: fx.GraphModule, class_name: str) -> fx.GraphModule:
    """`body` (from `extract`) as the shared body named `class_name`, on the same graph and
    attributes, which the program keeps, prints, saves and runs.  Still lazy: replays never run
    it, and build generates the code of every graph once (`ti.generate_code`)."""
    return ti.LazyGraphModule(body, body.graph, class_name=class_name)


def _get(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def first_difference(a: fx.GraphModule, b: fx.GraphModule) -> str | None:
    """Where two bodies differ (op, arguments, value metadata, constants), or None if they are
    the same computation node for node."""
    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        return f"{len(nodes_a)} nodes against {len(nodes_b)}"
    index = {n: i for i, n in enumerate(nodes_a)}
    index_b = {n: i for i, n in enumerate(nodes_b)}
    for x, y in zip(nodes_a, nodes_b):
        where = f"node {x.name} ({x.op} {_target_text(x)}) against {y.name} ({y.op} {_target_text(y)})"
        if x.op != y.op:
            return where
        if x.op == "get_attr":
            difference = _attribute_difference(_get(a, x.target), _get(b, y.target))
            if difference:
                return f"{where}: {difference}"
        elif x.target != y.target:
            return where
        if _shape(x.args, index) != _shape(y.args, index_b) or _shape(x.kwargs, index) != _shape(y.kwargs, index_b):
            return f"{where}: different arguments"
        if _value_text(x.meta.get("val")) != _value_text(y.meta.get("val")):
            return f"{where}: different results ({_value_text(x.meta.get('val'))} against {_value_text(y.meta.get('val'))})"
    return None


def _target_text(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _shape(value: Any, index: dict[fx.Node, int]) -> Any:
    """Arguments with nodes replaced by their positions, for comparison across graphs."""
    if isinstance(value, fx.Node):
        return ("node", index[value])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_shape(v, index) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _shape(v, index)) for k, v in value.items()))
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(value))
    return ("value", type(value).__name__, repr(value))


def _value_text(value: Any) -> Any:
    """What a node's `val` says that matters: tensor metadata, symbolic expressions, structure."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(map(str, value.shape)), tuple(map(str, value.stride())), value.dtype, value.device.type, value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_value_text(v) for v in value)
    return repr(value) if value is not None else None


def _attribute_difference(x: Any, y: Any) -> str | None:
    if isinstance(x, fx.GraphModule) and isinstance(y, fx.GraphModule):
        inner = first_difference(x, y)
        return f"subgraphs differ: {inner}" if inner else None
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        same = x.shape == y.shape and x.dtype == y.dtype and (x is y or torch.equal(x, y))
        return None if same else "different constant tensors"
    return None if type(x) is type(y) else "different attributes"
