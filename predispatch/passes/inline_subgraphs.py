"""Inline every `invoke_subgraph` call: the flat graph of a program with shared bodies.

Before (a repeated block shared, see Note [Sharing repeated blocks] in trace/dedup/share.py):

    repeated_body_0 = self.repeated_body_0
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph(repeated_body_0, 'repeated_body_0', p_layers_2_w, add_1)
    mul_4 = invoke_subgraph[0]

After (the body's nodes copied in place of each call, as the inline trace would have them):

    mul_4 = torch.ops.aten.mul.Tensor(add_1, p_layers_2_w)

For consumers that need one flat graph (PT2E quantization does not recurse into HOP bodies;
`ep.module()` runs the flat graph, since torch's eager `invoke_subgraph` differentiates its body
only under a fake mode).  Subgraphs the bodies hold (regions, captured Functions) are installed
on the outer module under a fresh name each, which every inlined call reads (Note [Each region
body once] in passes/lift_constants.py).  Precondition: none; postcondition: no
`invoke_subgraph` node in `gm`'s graph, and no body left on `gm`.
"""

from __future__ import annotations

import copy
import operator

from torch import fx

from predispatch import _torch_internals as ti


def shared_bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The distinct bodies the `invoke_subgraph` calls of `gm` and of its subgraphs (a call inside
    a grad region) run, in first-call order."""
    bodies: dict[int, fx.GraphModule] = {}
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            for node in module.graph.find_nodes(op="call_function", target=ti.invoke_subgraph):
                body = getattr(module, node.args[0].target)
                bodies.setdefault(id(body), body)
    return list(bodies.values())


def inline_subgraphs(gm: fx.GraphModule) -> None:
    """Replace each `invoke_subgraph` call of `gm` and of its subgraphs by its body's nodes
    (in place; recompiles what changed)."""
    for module in list(gm.modules()):
        if isinstance(module, fx.GraphModule):
            _inline_calls(module)


def _inline_calls(gm: fx.GraphModule) -> None:
    calls = list(gm.graph.find_nodes(op="call_function", target=ti.invoke_subgraph))
    if not calls:
        return
    names = {node.args[0].target for node in calls}
    installed: dict[int, str] = {}  # what a body holds -> its name on `gm`: one name for all calls
    for node in calls:
        _inline(gm, node, installed)
    for name in names:
        for getter in gm.graph.find_nodes(op="get_attr", target=name):
            gm.graph.erase_node(getter)
        delattr(gm, name)
    gm.graph.lint()
    gm.recompile()


def _inline(gm: fx.GraphModule, node: fx.Node, installed: dict[int, str]) -> None:
    """Copy the body's nodes in place of `node`; what the body holds (its regions, tensors) is
    installed on `gm` once, under one fresh name that every inlined call reads."""
    body: fx.GraphModule = getattr(gm, node.args[0].target)
    env = dict(zip(body.graph.find_nodes(op="placeholder"), node.args[2:]))
    with gm.graph.inserting_before(node):
        for attr in body.graph.find_nodes(op="get_attr"):
            value = getattr(body, attr.target)
            if id(value) not in installed:
                installed[id(value)] = _fresh(gm, attr.target)
                setattr(gm, installed[id(value)], value)
            env[attr] = gm.graph.get_attr(installed[id(value)])
        outputs = gm.graph.graph_copy(body.graph, env)
    for user in list(node.users):
        assert user.target is operator.getitem, user
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def _fresh(gm: fx.GraphModule, base: str) -> str:
    i = 0
    while hasattr(gm, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def inlined_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` itself if it calls no shared body, else a copy with every body inlined."""
    if not shared_bodies(gm):
        return gm
    flat = copy.deepcopy(gm)
    inline_subgraphs(flat)
    return flat
