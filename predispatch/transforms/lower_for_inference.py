"""Lower a program for consumers that only run forward: drop what exists for backward.

Two steps, both value-exact for forward: `inline_function_forwards` and `drop_history`.

`inline_function_forwards`: each captured `autograd.Function`'s forward inlined, its backward dropped.

Before:
    ste_fwd_0 = self.ste_fwd_0
    ste_bwd_0 = self.ste_bwd_0
    autograd_function_apply = torch.ops.higher_order.autograd_function_apply(
        ste_fwd_0, ste_bwd_0, mul, non_differentiable_idx = [], saved_for_backward_idx = [])
    round_1 = autograd_function_apply[0]
After:
    round_1 = torch.ops.aten.round.default(mul)

What runs forward is unchanged: the forward subgraph's ops replace the call, its first output
tuple replaces the `getitem`s, and the values it saved for backward are no longer computed.
What is lost is the custom backward: differentiating the result differentiates the forward's
ops (a straight-through estimator's gradient becomes 0).  That is why only
`to_torch(for_inference=True)` runs this pass; see Note [Capturing autograd.Function] in
predispatch/custom_backward/autograd_function/__init__.py for what the HOP holds.

`drop_history`: `predispatch.keep_history(value, history)` (Note [Mutations inside grad
regions]) and `predispatch.subclass_gradient_barrier(value)` become `aten.clone(value)`, their
value; they only route gradients, and inference consumers (ONNX, ExecuTorch) do not know them.

Pre: `gm` is a copy the caller owns (the passes edit it and its subgraphs in place).
Post: no `autograd_function_apply`, `keep_history` or `subclass_gradient_barrier` node in `gm` or any subgraph.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from predispatch import _torch_internals as ti
from predispatch import ops  # noqa: F401 - registers predispatch's ops


def inline_function_forwards(gm: fx.GraphModule) -> list[str]:
    """Inline every `autograd_function_apply` in `gm` and its subgraphs; the names of their forward subgraphs, in order."""
    inlined = []
    for module in list(gm.modules()):
        if isinstance(module, fx.GraphModule):
            for node in module.graph.find_nodes(op="call_function", target=ti.autograd_function_apply):
                inlined.append(node.args[0].target)  # the forward subgraph: `ste_fwd_0`
                _inline(module, node)
            module.graph.lint()
            module.recompile()
    return inlined


def _inline(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace `node` (a call in `gm`) with its forward subgraph's nodes."""
    fwd_node, bwd_node, *operands = node.args
    forward = getattr(gm, fwd_node.target)
    env = dict(zip(forward.graph.find_nodes(op="placeholder"), operands))
    with gm.graph.inserting_before(node):
        for inner in forward.graph.nodes:
            if inner.op == "get_attr":  # a subgraph or tensor the forward holds: move it into gm
                env[inner] = gm.graph.get_attr(_adopt(gm, forward, inner.target))
            elif inner.op not in ("placeholder", "output"):
                env[inner] = gm.graph.node_copy(inner, env.__getitem__)
    outputs = fx.map_arg(forward.graph.output_node().args[0][0], env.__getitem__)
    for user in list(node.users):
        assert user.target is operator.getitem, user.format_node()  # the HOP's only consumers
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)
    for holder in (fwd_node, bwd_node):
        if not holder.users:
            gm.graph.erase_node(holder)
            if not gm.graph.find_nodes(op="get_attr", target=holder.target):
                delattr(gm, holder.target)


def _adopt(gm: fx.GraphModule, owner: fx.GraphModule, target: str) -> str:
    """Register `owner`'s attribute `target` on `gm` under a fresh name; that name."""
    value = getattr(owner, target)
    name, i = target, 0
    while hasattr(gm, name):
        i += 1
        name = f"{target}_{i}"
    if isinstance(value, fx.GraphModule):
        gm.add_module(name, value)
    else:
        setattr(gm, name, value)
    return name


#: predispatch's ops that only route (or stop) gradients: for inference, the clone of their first argument.
_GRADIENT_ONLY = (torch.ops.predispatch.keep_history.default, torch.ops.predispatch.subclass_gradient_barrier.default)


def drop_history(gm: fx.GraphModule) -> int:
    """Replace every `keep_history(value, history)` and `subclass_gradient_barrier(value)` (Note
    [Gradients of plain tensors through a subclass]) by `clone(value)`; how many there were."""
    count = 0
    for module in list(gm.modules()):
        if isinstance(module, fx.GraphModule):
            for op in _GRADIENT_ONLY:
                for node in module.graph.find_nodes(op="call_function", target=op):
                    node.target, node.args, node.kwargs = torch.ops.aten.clone.default, node.args[:1], {}
                    count += 1
            module.recompile()
    return count
