"""Shared bodies in the joint program: one forward body and one backward body per shared body.

Note [Shared bodies in the joint]
---------------------------------
A program whose repeated blocks are shared calls each block's body through `invoke_subgraph`
(share.py).  Differentiating it as a flat graph traces every layer's forward and backward again,
so the joint of a 32-layer decoder cost 8-14 times the 2-layer one.  Instead each call of a
shared body is, in the joint trace, one node in the forward and one in the backward:

    invoke_subgraph(repeated_body_0_forward, 'repeated_body_0_forward', *operands)
        -> (*outputs, *saved)
    invoke_subgraph(repeated_body_0_backward, 'repeated_body_0_backward', *saved, *tangents)
        -> (*gradients of the operands that require grad)

The pair is made once per body (and per which operands require grad, and the outputs'
tangents' metadata): the body's own joint is traced as the whole program's is
(`ti.trace_differentiated`: `torch.autograd.grad` of the body with eager's formulas, below
autograd, functionalized), then split where the program's joint is split (`forward_nodes`):
the forward part returns the body's outputs and the values its backward reads (the nodes the
backward uses: autograd's saved tensors, dropout masks included), the backward part takes
those and the tangents.  Nothing is recomputed, random ops run once in the forward, and each
gradient is computed by the same ops on the same values as in the flat joint, so gradients
are bitwise the flat joint's (tests/test_joint.py).

torch's own autograd key for `invoke_subgraph` (`InvokeSubgraphAutogradOp`) also makes one
backward graph per forward graph and caches it, but its backward is the body's whole joint
(`create_joint`, run under grad mode): it recomputes the forward inside the backward (drawing
a dropout's mask a second time) and records formulas in their double-differentiable form
(`silu_backward` as `sigmoid` arithmetic), whose last bits differ from eager's.  So the joint
calls this module's `SharedBodies.call` where the program calls `invoke_subgraph`, and emits
torch's HOP on the split bodies with trace-time HOPs (trace_hop.py), as replays do.

A call whose tangent metadata differs from the outputs' (a gradient arriving transposed) gets
a backward traced for that metadata; its forward part must read no value the first split did
not save, which holds because a formula's saved values do not depend on its gradient's layout,
and is checked (`JointError` otherwise).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from predispatch import _torch_internals as ti
from predispatch.errors import JointError
from predispatch.custom_backward.trace_hop import Emitted, Installed, TraceTimeHop

__all__ = ["VIEWS", "SharedBodies", "drop_autograd_only", "forward_nodes", "static_calls"]

#: Ops that only matter to autograd: in a graph that computes its own gradients they are
#: the identity (`detach` appears where autograd saved a value for the backward, and where
#: the joint detaches the forward outputs it returns).
_AUTOGRAD_ONLY = (torch.ops.aten.detach.default,)


def drop_autograd_only(graph: fx.Graph) -> None:
    """Remove the autograd-only identities (`_AUTOGRAD_ONLY`) and dead code."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _AUTOGRAD_ONLY:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.eliminate_dead_code()


def forward_nodes(graph: fx.Graph, forward_outputs: int) -> set[fx.Node]:
    """The forward part: the nodes the forward outputs (the first `forward_outputs` outputs)
    depend on, the other results of the multi-result ops among them (a batch norm's saved
    statistics, a dropout's mask), which the forward computes for the backward, and the
    checks on forward values (`_assert_tensor_metadata`, kept for their side effect)."""
    seen: set[fx.Node] = set()
    stack = [n for n in graph.output_node().args[0][:forward_outputs] if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
            stack.extend(user for user in node.users if user.target is operator.getitem)
    checks = [n for n in graph.nodes if n.op == "call_function" and not n.users and n.all_input_nodes]
    return seen | {n for n in checks if all(i in seen for i in n.all_input_nodes)}


Meta = tuple  # (shape, stride, dtype, device) of a tensor


def _meta(t: torch.Tensor) -> Meta:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


@dataclass(frozen=True, eq=False)
class _Graph:
    """A split body as the trace-time HOP emits it: installed as `name`, its outputs' metadata
    (fresh fake tensors stand for them) and the names its outputs' `getitem`s take."""

    module: fx.GraphModule
    name: str
    outputs: tuple[Meta, ...]
    non_differentiable: tuple[int, ...]

    @property
    def output_names(self) -> list[str]:
        return [getattr(n, "name", "out") for n in self.module.graph.output_node().args[0]]


@dataclass(frozen=True, eq=False)
class _Split:
    """One body's joint split in two, for one pattern of operands requiring grad (and, for the
    backward, one metadata of the tangents).

    forward: `(*operands) -> (*outputs, *saved)`.
    backward: `(*operands it reads, *saved, *tangents) -> (*gradients)`.
    n_outputs: how many of forward's outputs are the body's.
    differentiable: the body outputs that get a tangent (those that require grad).
    tangents: the tangents' metadata the backward was traced for (None: no tangent).
    grads: the operand positions the backward returns a gradient for, in its output order.
    passed: (operand position, position among the backward's inputs) of the gradients that are
        one of its inputs (a residual's gradient is the tangent itself): handed on outside the
        body, whose outputs then never alias its inputs.
    read: the operand positions the backward reads.
    saved_names: the forward nodes saved, by name (a later split's backward must read no other).
    uses: for each operand the split bodies take, the position of the call's operand it is
        (see `_per_use`).
    """

    forward: _Graph
    backward: _Graph
    n_outputs: int
    differentiable: tuple[int, ...]
    tangents: tuple[Meta | None, ...]
    grads: tuple[int, ...]
    read: tuple[int, ...]
    saved_names: tuple[str, ...]
    uses: tuple[int, ...]
    passed: tuple[tuple[int, int], ...]


def _emit(tracer: Any, graph: _Graph) -> Emitted:
    if not hasattr(tracer.root, graph.name):
        tracer.root.register_module(graph.name, graph.module)
    return Emitted(ti.invoke_subgraph, (Installed(graph.name, graph.module), graph.name), graph.output_names)


def _fake(mode: Any, graph: _Graph, *operands: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(ti.fake_empty(mode, shape, stride, dtype, device) for shape, stride, dtype, device in graph.outputs)


#: One call of a split body (or of a body none of whose operands requires grad).
_split_call = TraceTimeHop(
    "predispatch_split_body_call", emit=_emit, fake=_fake, non_differentiable=lambda graph: graph.non_differentiable
)


class _SharedCall(torch.autograd.Function):
    """A call of a shared body in the joint trace: the forward body, and in the backward the
    backward body on the operands and forward values it reads and the tangents."""

    @staticmethod
    def forward(ctx: Any, bodies: SharedBodies, split: _Split, key: Any, *operands: torch.Tensor) -> Any:
        with torch._C._AutoDispatchBelowAutograd():
            results = _split_call(split.forward, *operands)
        outputs = results[: split.n_outputs]
        ctx.bodies, ctx.split, ctx.key, ctx.count = bodies, split, key, len(operands)
        ctx.kept = (*(operands[i] for i in split.read), *results[split.n_outputs:])
        ctx.set_materialize_grads(False)
        differentiable = set(split.differentiable)
        ctx.mark_non_differentiable(*(t for i, t in enumerate(outputs) if i not in differentiable))
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        tangents = [grads[i] for i in ctx.split.differentiable]
        out: list[Any] = [None] * ctx.count
        if any(t is not None for t in tangents):
            split = ctx.bodies.backward_for(ctx.key, ctx.split, tangents)
            inputs = (*ctx.kept, *(t for t in tangents if t is not None))
            results = _split_call(split.backward, *inputs)
            for position, grad in zip(split.grads, results):
                out[position] = grad
            for position, index in split.passed:
                out[position] = inputs[index]
        return (None, None, None, *out)


@dataclass(frozen=True)
class _Key:
    """What a split depends on: the body, and each operand's metadata and requires_grad."""

    identifier: str
    operands: tuple[tuple, ...]


class SharedBodies:
    """The joint trace's calls of shared bodies (see Note [Shared bodies in the joint]).

    The program's `invoke_subgraph` nodes call `self.call` instead (`retarget`); a body's
    split is made once per key and reused by every call.
    """

    def __init__(self, fake_mode: Any) -> None:
        self.fake_mode = fake_mode
        self.bodies: dict[str, fx.GraphModule] = {}
        self.splits: dict[_Key, _Split] = {}
        self.backwards: dict[tuple[_Key, tuple], _Split] = {}
        self.plain: dict[str, _Graph] = {}
        self.taken: set[str] = set()

    def retarget(self, gm: fx.GraphModule) -> None:
        """Make every `invoke_subgraph` call of `gm` and its subgraphs call `self.call`."""
        for module in gm.modules():
            if isinstance(module, fx.GraphModule):
                calls = module.graph.find_nodes(op="call_function", target=ti.invoke_subgraph)
                for node in calls:
                    node.target = self.call
                if calls:
                    module.recompile()

    def call(self, body: fx.GraphModule, identifier: str, *operands: Any) -> tuple[torch.Tensor, ...]:
        """One call of a shared body, in place of `invoke_subgraph(body, identifier, *operands)`."""
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in operands)):
            return _split_call(self._plain(body, identifier), *operands)
        key = _Key(identifier, tuple((*_meta(t), t.requires_grad) for t in operands))
        split = self.splits.get(key)
        if split is None:
            self.bodies[identifier] = body
            split = self.splits[key] = self._split(key, None, None)
        return _SharedCall.apply(self, split, key, *(operands[i] for i in split.uses))

    def check_engaged(self, gm: fx.GraphModule) -> None:
        """Prove the joint's body calls are this object's: a call that reached torch's own
        autograd key for `invoke_subgraph` would name a body it traced (`fw_...`, `bw_...`),
        with other formulas and a forward recomputed in the backward."""
        ours = self.taken | set(self.plain)
        for module in gm.modules():
            if isinstance(module, fx.GraphModule):
                for node in module.graph.find_nodes(op="call_function", target=ti.invoke_subgraph):
                    if node.args[1] not in ours:
                        raise JointError(
                            f"the joint calls a shared body {node.args[1]!r} that predispatch did not split: torch's own "
                            "invoke_subgraph differentiation ran instead.",
                            fix="a predispatch bug with this torch release: report it; export with dedup=False meanwhile.",
                        )

    def backward_for(self, key: _Key, split: _Split, tangents: Sequence[torch.Tensor | None]) -> _Split:
        """The split whose backward takes these tangents: `split` itself when they are what it
        was traced for, else one traced for them (once per metadata)."""
        metas = tuple(None if t is None else _meta(t) for t in tangents)
        if metas == split.tangents:
            return split
        found = self.backwards.get((key, metas))
        if found is None:
            found = self.backwards[(key, metas)] = self._split(key, metas, split)
        return found

    def _plain(self, body: fx.GraphModule, identifier: str) -> _Graph:
        """The body itself, called where no operand requires grad (nothing to differentiate)."""
        graph = self.plain.get(identifier)
        if graph is None:
            outputs = tuple(_meta(n.meta["val"]) for n in body.graph.output_node().args[0])
            graph = self.plain[identifier] = _Graph(body, identifier, outputs, tuple(range(len(outputs))))
        return graph

    def _split(self, key: _Key, tangents: tuple | None, first: _Split | None) -> _Split:
        """Trace the body's joint and split it.  `first`: the split whose forward already ran,
        when only a backward for other `tangents` is wanted."""
        joint, n_outputs, differentiable, tangents, grads, uses = self._trace(self.bodies[key.identifier], key, tangents)
        forward = forward_nodes(joint.graph, n_outputs)
        backward = {n for n in joint.graph.nodes if n.op not in ("placeholder", "output") and n not in forward}
        _recompute_views(forward, backward)
        reads = [n for n in joint.graph.nodes if n in forward and n not in backward and any(u in backward for u in n.users)]
        operands = joint.graph.find_nodes(op="placeholder")[: len(uses)]
        read = tuple(i for i, p in enumerate(operands) if any(u in backward for u in p.users))
        saved = [n for n in reads if n.op != "placeholder"]
        if first is not None:
            saved = self._same_saved(joint.graph, first, read, saved, key.identifier)
            read, fw_graph = first.read, first.forward
        else:
            fw_graph = self._graph(joint, [*operands], [*joint.graph.output_node().args[0][:n_outputs], *saved],
                                   _checks(forward), f"{key.identifier}_forward", differentiable)
        tangent_nodes = joint.graph.find_nodes(op="placeholder")[len(uses):]
        present = [p for p, meta in zip(tangent_nodes, tangents) if meta is not None]
        inputs = [*(operands[i] for i in read), *saved, *present]
        grad_nodes = joint.graph.output_node().args[0][n_outputs:]
        passed = tuple((p, inputs.index(g)) for p, g in zip(grads, grad_nodes) if g in inputs)
        computed = [(p, g) for p, g in zip(grads, grad_nodes) if g not in inputs]
        bw_graph = self._graph(joint, inputs, [g for _, g in computed], _checks(backward), f"{key.identifier}_backward", ())
        return _Split(
            fw_graph, bw_graph, n_outputs, differentiable, tangents, tuple(p for p, _ in computed), read,
            tuple(n.name for n in saved), uses, passed,
        )

    def _trace(self, body: fx.GraphModule, key: _Key, tangents: tuple | None) -> tuple:
        """The body's joint `(*operands, *tangents) -> (*outputs, *gradients)`, traced as the
        program's is; tangents (None: the outputs' own metadata) for the outputs requiring grad."""
        outputs = [n.meta["val"] for n in body.graph.output_node().args[0]]
        body, uses = _per_use(body, [meta[4] for meta in key.operands])
        metas_in = [key.operands[i] for i in uses]
        found: dict[str, Any] = {}

        def joint(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
            operands, given = inputs[: len(uses)], inputs[len(uses):]
            results = body(*operands)
            differentiable = tuple(i for i, r in enumerate(results) if r.requires_grad and (tangents is None or tangents[i] is not None))
            wanted = [t for t, (*_, requires_grad) in zip(operands, metas_in) if requires_grad]
            grads: Sequence[Any] = [None] * len(wanted)
            if differentiable:
                grads = torch.autograd.grad(
                    [results[i] for i in differentiable], wanted, [given[i] for i in differentiable], allow_unused=True
                )
            positions = [i for i, (*_, requires_grad) in enumerate(metas_in) if requires_grad]
            found.update(differentiable=differentiable, grads=tuple(p for p, g in zip(positions, grads) if g is not None))
            return (*(r.detach() for r in results), *(g for g in grads if g is not None))

        metas = tangents if tangents is not None else tuple(_meta(v) for v in outputs)
        with ti.outside_trace(), self.fake_mode:
            examples = [_empty(meta[:4]).requires_grad_(meta[4]) for meta in metas_in]
            examples += [_empty(meta if meta is not None else _meta(v)) for meta, v in zip(metas, outputs)]
        with ti.outside_trace():
            joint_gm = ti.trace_differentiated(joint, tuple(examples), self.fake_mode)
        drop_autograd_only(joint_gm.graph)
        names = [p.name for p in body.graph.find_nodes(op="placeholder")] + [f"tangent_{i}" for i in range(len(outputs))]
        for node, name in zip(joint_gm.graph.find_nodes(op="placeholder"), names):
            node._rename(name)  # the body's names (make_fx's are arg0_1, ...), for the split bodies' signatures
            node.target = node.name
        differentiable = found["differentiable"]
        used = tuple(metas[i] if i in differentiable else None for i in range(len(outputs)))
        return joint_gm, len(outputs), differentiable, used, found["grads"], uses

    def _same_saved(self, graph: fx.Graph, first: _Split, read: tuple[int, ...], saved: list[fx.Node], identifier: str) -> list[fx.Node]:
        """A later split's backward reads what the first split's forward saved: the nodes of
        that name here (the forward parts of two traces of one body are the same), or raise."""
        by_name = {n.name: n for n in graph.nodes}
        extra = [n.name for n in saved if n.name not in first.saved_names] + [f"operand {i}" for i in read if i not in first.read]
        if extra:
            raise JointError(
                f"the backward of shared body {identifier} for gradients of another layout reads {', '.join(extra)}, "
                "which its forward did not keep.",
                fix="export with dedup=False to differentiate every layer inline, and report the model.",
            )
        return [by_name[name] for name in first.saved_names]

    def _graph(
        self, joint: fx.GraphModule, inputs: list[fx.Node], outputs: list[Any], checks: list[fx.Node], base: str,
        differentiable: tuple[int, ...],
    ) -> _Graph:
        """The nodes of `joint` that compute `outputs` (and `checks`) from `inputs`, as a GraphModule."""
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for node in inputs:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
        wanted = _needed([*outputs, *checks], set(inputs))
        for node in joint.graph.nodes:
            if node in wanted and node not in env:
                assert node.op != "placeholder", f"{base} reads {node.name}, which it does not take"
                env[node] = graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[o] if isinstance(o, fx.Node) else o for o in outputs))
        module = fx.GraphModule(joint, graph)
        name = self._fresh(base)
        metas = tuple(_meta(o.meta["val"]) for o in outputs)
        non_differentiable = tuple(i for i in range(len(outputs)) if i not in set(differentiable))
        return _Graph(module, name, metas, non_differentiable)

    def _fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.taken:
            i += 1
            name = f"{base}_{i}"
        self.taken.add(name)
        return name


#: Ops the backward recomputes from their input rather than have the forward save their result:
#: views (`t` of a weight, `view` of an activation), which compute nothing, so recomputing
#: changes no bit and a layer saves about half as many values (each saved value is an output
#: of every forward call, a fake tensor and a node per call in the trace).
VIEWS = frozenset({
    torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims,
    torch.ops.aten.alias.default, torch.ops.aten.expand.default, torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int, torch.ops.aten.slice.Tensor, torch.ops.aten.select.int,
})


def _recompute_views(forward: set[fx.Node], backward: set[fx.Node]) -> None:
    """Move the views of forward values that the backward reads into the backward too
    (`VIEWS`), transitively: the backward then reads their bases."""
    stack = [n for n in forward if n.op == "call_function" and n.target in VIEWS and any(u in backward for u in n.users)]
    while stack:
        node = stack.pop()
        if node in backward or any(not isinstance(a, (fx.Node, int, bool, list, tuple, type(None))) for a in node.args):
            continue
        backward.add(node)
        stack.extend(i for i in node.all_input_nodes if i.op == "call_function" and i.target in VIEWS and i in forward)


def _per_use(body: fx.GraphModule, requires_grad: list[bool]) -> tuple[fx.GraphModule, tuple[int, ...]]:
    """`body` taking an operand that requires grad once per use (each argument position of each
    node reading it), in the order eager's backward adds up its gradient: the last reader's
    first, a reader's arguments in order.  So a gradient summed from several uses inside the
    body and more outside (an encoder's output read by every decoder layer's cross-attention)
    is summed in eager's order, term by term, not from a subtotal per call.  Returns the body
    and, per placeholder, the operand it stands for."""
    placeholders = body.graph.find_nodes(op="placeholder")
    readers = {p: _occurrences(p) for p, wants in zip(placeholders, requires_grad) if wants}
    if all(len(r) < 2 for r in readers.values()):
        return body, tuple(range(len(placeholders)))
    graph, env, per_use, uses = fx.Graph(), {}, {}, []
    for i, p in enumerate(placeholders):
        occurrences = readers.get(p, [])
        if len(occurrences) < 2:
            env[p] = graph.placeholder(p.name)
            env[p].meta = dict(p.meta)
            uses.append(i)
            continue
        for k, occurrence in enumerate(occurrences):
            per_use[occurrence] = graph.placeholder(f"{p.name}_{k}")
            per_use[occurrence].meta = dict(p.meta)
            uses.append(i)
    for node in body.graph.nodes:
        if node.op != "placeholder":
            env[node] = graph.node_copy(node, _numbered(node, per_use, env))
    return fx.GraphModule(body, graph), tuple(uses)


def _numbered(node: fx.Node, per_use: dict, env: dict) -> Any:
    """node_copy's argument map for `node`: the placeholder of each split use, else the copy."""
    position = itertools.count()

    def argument(n: fx.Node) -> fx.Node:
        use = per_use.get((node, next(position)))
        return use if use is not None else env[n]

    return argument


def _occurrences(placeholder: fx.Node) -> list[tuple[fx.Node, int]]:
    """Each (reader, position among its node arguments) of `placeholder`, last reader first."""
    found = []
    for user in reversed(list(placeholder.graph.nodes)):
        if user in placeholder.users:
            arguments: list[fx.Node] = []
            fx.node.map_arg(user.args, arguments.append)  # node_copy maps args, then kwargs, in this order
            fx.node.map_arg(user.kwargs, arguments.append)
            found += [(user, k) for k, n in enumerate(arguments) if n is placeholder]
    return found


def _checks(part: set[fx.Node]) -> list[fx.Node]:
    """The calls of a part whose result nothing reads (`_assert_tensor_metadata`): kept for their effect."""
    return [n for n in part if n.op == "call_function" and not n.users]


def _needed(outputs: list[Any], inputs: set[fx.Node]) -> set[fx.Node]:
    """The nodes `outputs` depend on, stopping at `inputs`, with the checks among them."""
    seen: set[fx.Node] = set()
    stack = [o for o in outputs if isinstance(o, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            if node not in inputs:
                stack.extend(node.all_input_nodes)
    return seen


def _empty(meta: Meta) -> torch.Tensor:
    shape, stride, dtype, device = meta
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


def static_calls(gm: fx.GraphModule) -> bool:
    """Whether every `invoke_subgraph` call in `gm` and its subgraphs passes tensors of static
    sizes and gets such tensors back: what `SharedBodies` keys its splits on.  (A program with
    symbolic sizes has its joint traced flat.)"""
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.find_nodes(op="call_function", target=ti.invoke_subgraph):
                values = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[2:]]
                values += list(node.meta.get("val") or [None])
                if not all(isinstance(v, torch.Tensor) and _is_static(v) for v in values):
                    return False
    return True


def _is_static(t: torch.Tensor) -> bool:
    return all(type(s) is int for s in (*t.shape, *t.stride()))
