"""A picture of a program as data: nodes, edges and nested clusters, ready for any renderer.

`picture(ep)` walks the graph and its subgraphs and returns a `Picture`; `to_dot` and
`to_html` (next to this file) turn it into text.  Nothing here knows about colours or layout.

What the picture shows, for a program like

    def forward(self, x):
        grad_region_0 = self.grad_region_0
        wrap_with_set_grad_enabled = torch.ops.higher_order.wrap_with_set_grad_enabled(False, grad_region_0, x)
        mul = wrap_with_set_grad_enabled[0]
        add = torch.ops.aten.add.Tensor(x, mul)
        return (add,)

is: an input node `x` (coloured by its `InputKind`), a cluster "grad disabled" holding `mul`
(the subgraph drawn in place of the HOP call), `add`, and an output node.  Edges run from the
value's producer straight to its consumer, into and out of clusters:

    x -> mul (in cluster grad_region_0) -> add -> output
    x -> add

Rules, generic over higher-order ops:

- A call whose arguments include `get_attr` nodes naming GraphModules is a HOP call.  It is
  drawn as a cluster; each of its subgraphs is drawn inside it (as its own nested cluster when
  there are several, e.g. a captured Function's forward and backward).
- A subgraph whose placeholders match the call's operands one to one (the operands being the
  node arguments after the last subgraph) is drawn *inline*: its placeholders are the outer
  values and the call's `getitem`s are its outputs.  Otherwise its placeholders and outputs
  are drawn as small nodes inside its cluster, and the call itself is a node.
- Every subgraph is drawn once, at its first call; every later call of it is one CALL node
  (a HOP call some of whose subgraphs were drawn before shows those as CALL nodes in its
  cluster).  A shared body (`invoke_subgraph`, a repeated block) is labelled with how many
  calls share it.
- `getitem` of an ordinary multi-output op (`unbind`) is not a node: its edges carry `[i]`.
- Graph outputs are nodes; a mutation output gets a WRITE_BACK edge to the input it updates.
"""

from __future__ import annotations

import enum
import operator
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import fx
from torch.fx.graph import dtype_abbrs

from predispatch.signature import InputKind, OutputKind
from predispatch.trace.decompose import is_composite, op_name

if TYPE_CHECKING:
    from predispatch.signature import Program


class NodeKind(enum.Enum):
    """What a picture node stands for; renderers colour by it."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT_TENSOR = "constant_tensor"
    USER_INPUT = "user_input"
    OP = "op"  # an aten op with its own kernel
    COMPOSITE = "composite"  # a CompositeImplicitAutograd op kept whole (aten.linear, ...)
    CUSTOM_OP = "custom_op"  # a non-aten op: predispatch::keep_history, user custom ops
    CALL = "call"  # a HOP call drawn as a node (its subgraphs do not map onto its operands)
    SUBGRAPH_INPUT = "subgraph_input"  # a placeholder of a subgraph that is not drawn inline
    SUBGRAPH_OUTPUT = "subgraph_output"
    USER_OUTPUT = "user_output"
    MUTATION = "mutation"  # an output that writes back into a parameter, buffer or input


class ClusterKind(enum.Enum):
    GRAD_DISABLED = "grad_disabled"  # wrap_with_set_grad_enabled(False, ...)
    GRAD_ENABLED = "grad_enabled"  # wrap_with_set_grad_enabled(True, ...)
    AUTOCAST = "autocast"  # wrap_with_autocast(...)
    FUNCTION = "function"  # autograd_function_apply: a captured autograd.Function
    CALL = "call"  # any other HOP
    SUBGRAPH = "subgraph"  # one of several subgraphs of a HOP call (forward, backward)


class EdgeKind(enum.Enum):
    DATA = "data"  # the value flows from source to target
    WRITE_BACK = "write_back"  # a mutation output is copied back into this input after the call
    SAVED = "saved"  # a captured Function's forward saves this value for its backward


_INPUT_KINDS = {
    InputKind.PARAMETER: NodeKind.PARAMETER,
    InputKind.BUFFER: NodeKind.BUFFER,
    InputKind.CONSTANT_TENSOR: NodeKind.CONSTANT_TENSOR,
    InputKind.USER_INPUT: NodeKind.USER_INPUT,
}


@dataclass(frozen=True)
class PictureNode:
    """One box.

    id: unique in the picture, safe as a DOT id and an HTML id (`n0`, `n1`, ...).
    name: the node's name in its graph (`linear`, `p_lin_weight`); for an output, its target
        (the mutated `bn.running_mean`, or the pytree path `output[0]` of a user output).
    kind: what it stands for.
    op: the operator (`aten.linear.default`); for an input the target it stands for
        (`lin.weight`); for an output its role (`buffer mutation`); empty when there is none.
    detail: dtype and shape (`f32[2, 3]`), when known.
    cluster: id of the innermost cluster holding the node; None at top level.
    note: a longer explanation for tooltips (why a composite stayed whole, ...).
    """

    id: str
    name: str
    kind: NodeKind
    op: str = ""
    detail: str = ""
    cluster: str | None = None
    note: str = ""


@dataclass(frozen=True)
class PictureEdge:
    """source and target are node ids; label is `[i]` for an element of a multi-output op."""

    source: str
    target: str
    label: str = ""
    kind: EdgeKind = EdgeKind.DATA


@dataclass(frozen=True)
class Cluster:
    """A box around the nodes of a HOP call (a region, a captured Function) or one subgraph.

    id: unique (`c0`, ...).  label: the state it runs under (`grad disabled`).
    detail: the subgraph attribute(s) it comes from (`grad_region_0`).
    parent: the enclosing cluster's id; None at top level.
    """

    id: str
    label: str
    kind: ClusterKind
    detail: str = ""
    parent: str | None = None


@dataclass(frozen=True)
class Picture:
    """Nodes in program order (a cluster's nodes are contiguous), edges, clusters outermost first."""

    title: str
    nodes: tuple[PictureNode, ...]
    edges: tuple[PictureEdge, ...]
    clusters: tuple[Cluster, ...]

    def node(self, name: str) -> PictureNode:
        """The first node called `name` (test and notebook convenience)."""
        return next(n for n in self.nodes if n.name == name)

    def cluster_of(self, name: str) -> Cluster | None:
        cid = self.node(name).cluster
        return next((c for c in self.clusters if c.id == cid), None)


def picture(ep: Program, title: str = "") -> Picture:
    """Describe `ep`'s graph, subgraphs nested in clusters; see the module docstring."""
    builder = _Builder(ep)
    builder.walk_top(ep.graph_module)
    return Picture(title, tuple(builder.nodes), tuple(builder.edges), tuple(builder.clusters))


@dataclass(frozen=True)
class _Ref:
    """Where an edge for a value starts: a node id, and a label for an element of it."""

    id: str
    label: str = ""


@dataclass(frozen=True)
class _HopOutputs:
    """The value of a HOP call drawn inline: its subgraph's outputs, for its getitems."""

    refs: tuple[Any, ...]


@dataclass
class _Builder:
    ep: Program
    nodes: list[PictureNode] = field(default_factory=list)
    edges: list[PictureEdge] = field(default_factory=list)
    clusters: list[Cluster] = field(default_factory=list)
    drawn_bodies: set[int] = field(default_factory=set)  # ids of subgraphs already drawn
    invoke_calls: Counter[int] | None = None  # id of a shared body -> its `invoke_subgraph` calls

    # ---- top level: inputs and outputs from the signature
    def walk_top(self, gm: fx.GraphModule) -> None:
        specs = {s.name: s for s in self.ep.signature.inputs}
        env: dict[fx.Node, Any] = {}
        written: dict[str, str] = {}  # what a mutation output names -> the input node's id
        for node in gm.graph.find_nodes(op="placeholder"):
            spec = specs.get(node.name)
            kind = _INPUT_KINDS[spec.kind] if spec else NodeKind.USER_INPUT
            nid = self._add(node.name, kind, spec.target if spec else "", _detail(node), None)
            env[node] = _Ref(nid)
            if spec:
                written[spec.name if spec.kind is InputKind.USER_INPUT else spec.target] = nid
        results = self._walk_body(gm, env, cluster=None)
        self._outputs(results, written)

    def _outputs(self, results: list[Any], inputs_by_target: dict[str, str]) -> None:
        for spec, ref in zip(self.ep.signature.outputs, results):
            mutation = spec.kind is not OutputKind.USER_OUTPUT
            kind = NodeKind.MUTATION if mutation else NodeKind.USER_OUTPUT
            role = spec.kind.value.replace("_", " ")
            out = self._add(spec.target, kind, role, "", None, note=f"{spec.kind.name} target={spec.target!r}")
            self._edge(ref, out)
            if mutation and spec.target in inputs_by_target:
                self.edges.append(PictureEdge(out, inputs_by_target[spec.target], "", EdgeKind.WRITE_BACK))

    # ---- one graph body
    def _walk_body(self, gm: fx.GraphModule, env: dict[fx.Node, Any], cluster: str | None) -> list[Any]:
        """Add the non-placeholder nodes of `gm` (placeholders already in `env`); returns its outputs."""
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return [env.get(a) if isinstance(a, fx.Node) else None for a in _flat(node.args[0])]
            if node.op == "get_attr" and isinstance(_attr(gm, node), fx.GraphModule):
                continue  # drawn by the HOP call that uses it
            if node.op == "call_function" and node.target is operator.getitem:
                env[node] = _element(env.get(node.args[0]), node.args[1])
            elif _subgraph_args(gm, node):
                env[node] = self._hop(gm, node, env, cluster)
            else:
                env[node] = _Ref(self._op(gm, node, env, cluster))
        return []

    def _op(self, gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any], cluster: str | None) -> str:
        kind, op, note = _classify(node, self.ep, gm)
        nid = self._add(node.name, kind, op, _detail(node), cluster, note)
        for arg in node.all_input_nodes:
            self._edge(env.get(arg), nid)
        return nid

    def _hop(self, gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any], parent: str | None) -> Any:
        """Draw a HOP call as a cluster holding its subgraphs; see the module docstring.  Each
        subgraph is drawn once, at its first call (Note [Each region body once] in
        passes/lift_constants.py): a body called twice at every level of a nest would otherwise
        be drawn 2^depth times."""
        subgraphs = [a for _, a in _subgraph_args(gm, node)]
        last = max(i for i, _ in _subgraph_args(gm, node))
        operands = [env.get(a) for a in node.args[last + 1 :] if isinstance(a, fx.Node)]
        bodies = [_attr(gm, a) for a in subgraphs]
        if all(id(body) in self.drawn_bodies for body in bodies):
            names = ", ".join(a.target for a in subgraphs)
            return self._call_node(node, operands, parent, f"calls {names}, drawn at its first call")
        label, kind, roles = _hop_label(node, [a.target for a in subgraphs])
        if node.target is _INVOKE_SUBGRAPH:
            label = f"{label} (shared by {self._calls_of(bodies[0])} calls)"
        hop_cluster = self._cluster(label, kind, ", ".join(a.target for a in subgraphs), parent)
        inline_outputs, walked = None, []
        for attr_node, role, sub in zip(subgraphs, roles, bodies):
            here = hop_cluster if len(subgraphs) == 1 else self._cluster(role, ClusterKind.SUBGRAPH, attr_node.target, hop_cluster)
            if id(sub) in self.drawn_bodies:
                self._add(attr_node.target, NodeKind.CALL, "", "", here, "drawn at its first call")
                continue
            self.drawn_bodies.add(id(sub))
            placeholders = list(sub.graph.find_nodes(op="placeholder"))
            mapped = len(placeholders) == len(operands)
            sub_env = dict(zip(placeholders, operands)) if mapped else {
                p: _Ref(self._add(p.name, NodeKind.SUBGRAPH_INPUT, "", _detail(p), here)) for p in placeholders
            }
            outs = self._walk_body(sub, sub_env, here)
            walked.append((sub, sub_env))
            if mapped and inline_outputs is None:
                inline_outputs = _HopOutputs(tuple(outs))
            elif not mapped:
                ret = self._add("returns", NodeKind.SUBGRAPH_OUTPUT, "", "", here)
                for ref in outs:
                    self._edge(ref, ret)
        if kind is ClusterKind.FUNCTION and len(walked) == 2:
            self._link_saved(*walked)
        if inline_outputs is not None:
            return inline_outputs
        return self._call_node(node, operands, hop_cluster)

    def _calls_of(self, body: fx.GraphModule) -> int:
        """How many `invoke_subgraph` calls, in the graph and its subgraphs, run `body` (all
        counted in one walk, at the first question)."""
        if self.invoke_calls is None:
            self.invoke_calls = _invoke_calls(self.ep.graph_module)
        return self.invoke_calls[id(body)]

    def _call_node(self, node: fx.Node, operands: list[Any], cluster: str | None, note: str = "") -> _Ref:
        call = self._add(node.name, NodeKind.CALL, _target_name(node.target), "", cluster, note)
        for ref in operands:
            self._edge(ref, call)
        return _Ref(call)

    def _link_saved(self, forward: tuple[fx.GraphModule, dict], backward: tuple[fx.GraphModule, dict]) -> None:
        """SAVED edges from what a Function's forward saves to the backward's inputs that receive it.

        `autograd_function_apply`'s forward returns `((*outputs), (*saved))` and its backward
        takes `(*output_grads, *saved)` (see predispatch/custom_backward/autograd_function).
        """
        (fwd, fwd_env), (bwd, bwd_env) = forward, backward
        result = fwd.graph.output_node().args[0]
        if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], (tuple, list))):
            return
        saved = list(result[1])
        placeholders = list(bwd.graph.find_nodes(op="placeholder"))
        receivers = placeholders[len(placeholders) - len(saved) :]
        for value, receiver in zip(saved, receivers):
            source, target = fwd_env.get(value), bwd_env.get(receiver)
            if isinstance(source, _Ref) and isinstance(target, _Ref):
                self.edges.append(PictureEdge(source.id, target.id, source.label, EdgeKind.SAVED))

    # ---- bookkeeping
    def _add(self, name: str, kind: NodeKind, op: str, detail: str, cluster: str | None, note: str = "") -> str:
        nid = f"n{len(self.nodes)}"
        self.nodes.append(PictureNode(nid, name, kind, op, detail, cluster, note))
        return nid

    def _cluster(self, label: str, kind: ClusterKind, detail: str, parent: str | None) -> str:
        cid = f"c{len(self.clusters)}"
        self.clusters.append(Cluster(cid, label, kind, detail, parent))
        return cid

    def _edge(self, ref: Any, target: str) -> None:
        if isinstance(ref, _Ref):
            self.edges.append(PictureEdge(ref.id, target, ref.label))
        elif isinstance(ref, _HopOutputs):  # a HOP's whole result used directly: one edge per output
            for element in ref.refs:
                self._edge(element, target)


def _element(value: Any, index: Any) -> Any:
    """The value of `value[index]`: a HOP output, or the producer with an `[i]` label."""
    if isinstance(value, _HopOutputs) and isinstance(index, int) and index < len(value.refs):
        return value.refs[index]
    if isinstance(value, _Ref):
        return _Ref(value.id, f"{value.label}[{index}]")
    return value


def _classify(node: fx.Node, ep: Program, gm: fx.GraphModule) -> tuple[NodeKind, str, str]:
    target = node.target
    if node.op == "get_attr":
        return NodeKind.CONSTANT_TENSOR, str(target), "a tensor attribute of the graph module"
    if not isinstance(target, torch._ops.OpOverload):
        return NodeKind.OP, _target_name(target), ""
    name = op_name(target)
    if target.namespace != "aten":
        note = "Note [Mutations inside grad regions]" if name == "predispatch.keep_history.default" else ""
        return NodeKind.CUSTOM_OP, name, note
    if is_composite(target):
        decisions = getattr(getattr(ep, "decompositions", None), "decisions", {})
        why = decisions.get(name, (True, "composite op kept whole"))[1]
        return NodeKind.COMPOSITE, name, f"composite kept whole: {why}"
    return NodeKind.OP, name, ""


def _hop_label(node: fx.Node, attrs: list[str]) -> tuple[str, ClusterKind, list[str]]:
    """The cluster's label (a region's says the state it sets: absolute, whatever the caller's
    state), its kind, and a label for each subgraph."""
    name = _target_name(node.target)
    args = node.args
    if name == "wrap_with_set_grad_enabled":
        enabled = bool(args[0])
        return ("grad enabled" if enabled else "grad disabled",
                ClusterKind.GRAD_ENABLED if enabled else ClusterKind.GRAD_DISABLED, attrs)
    if name == "wrap_with_autocast":
        device, dtype, enabled = args[0], args[1], args[2]
        dtype_name = str(dtype).replace("torch.", "") if dtype is not None else "default dtype"
        label = f"autocast {device} {dtype_name}" if enabled else f"autocast disabled ({device})"
        return label, ClusterKind.AUTOCAST, attrs
    if name == "autograd_function_apply" and len(attrs) == 2:
        function = re.sub(r"_fwd_\d+$", "", attrs[0])
        return f"autograd.Function {function}", ClusterKind.FUNCTION, ["forward", "backward"]
    return name, ClusterKind.CALL, attrs


_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def _invoke_calls(root: fx.GraphModule) -> Counter[int]:
    """How many `invoke_subgraph` calls, in the graph and its subgraphs, run each body (by id)."""
    return Counter(
        id(_attr(gm, node.args[0]))
        for gm in root.modules()
        if isinstance(gm, fx.GraphModule)
        for node in gm.graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH)
    )


def _subgraph_args(gm: fx.GraphModule, node: fx.Node) -> list[tuple[int, fx.Node]]:
    if node.op != "call_function":
        return []
    return [
        (i, a)
        for i, a in enumerate(node.args)
        if isinstance(a, fx.Node) and a.op == "get_attr" and isinstance(_attr(gm, a), fx.GraphModule)
    ]


def _attr(gm: fx.GraphModule, node: fx.Node) -> Any:
    obj: Any = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part, None)
    return obj


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return op_name(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__name__", str(target))


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in _flat(v)]
    return [value]


def _detail(node: fx.Node) -> str:
    """`f32[2, 3]` for a tensor value, as FX prints it; empty when unknown or not one tensor."""
    val = node.meta.get("val")
    if val is None:
        val = node.meta.get("tensor_meta")
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"Sym({val})"
    dtype, shape = getattr(val, "dtype", None), getattr(val, "shape", None)
    if dtype is None or shape is None:
        return ""
    dims = ", ".join(str(d) for d in shape)
    return f"{dtype_abbrs.get(dtype, str(dtype))}[{dims}]"
