"""flex_attention's captured tensors: which ones the program can differentiate.

Note [flex_attention's captured tensors]
----------------------------------------
A `score_mod` or `mask_mod` that reads a tensor it captures (`self.bias[h]`, a buffer, a tensor
computed in forward) exports as torch.export exports it: the tensor is an operand of the
`flex_attention` HOP (`score_mod_other_buffers` / `mask_mod_other_buffers`, lifted as state
when it is a parameter or buffer), and the index is `aten.index` in the score_mod's subgraph
(`ti.flex_attention_index_inline`).

Eager indexes through torch's `ModIndex` Function, whose backward is `flex_lib::zeros_and_scatter`,
a custom op whose vmap rule sums over the batch: the HOP's dense backward vmaps the score_mod's
joint graph over batch, head and positions and needs a captured tensor's gradient unbatched.
`aten.index`'s own derivative (an accumulating `index_put`) is batched there, and the program's
backward fails ("can not return a BatchedTensor when out_dim is None"; torch.export's decomposed
program fails the same way, its undecomposed one returns twice eager's gradient, torch 2.13).
So a captured tensor the score_mod indexes must not be differentiable: one that a parameter or a
floating user input reaches, not through `detach`, is refused by name; buffers, constants and
detached values export, and so does any mask_mod (its output is a bool, never differentiated).
"""

from __future__ import annotations

import torch
from torch import fx

from predispatch.errors import UnsupportedConstructError, user_frame
from predispatch.frontend.inputs import PreparedInputs
from predispatch.signature import InputKind
from predispatch._meta import stack_line

__all__ = ["refuse_differentiated_captures"]

#: Ops whose output carries no gradient of their input.
_DETACHING = (torch.ops.aten.detach.default,)


def refuse_differentiated_captures(prepared: PreparedInputs, gm: fx.GraphModule) -> None:
    """Refuse a flex_attention whose score_mod indexes a captured tensor that carries a gradient."""
    flex = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.flex_attention)
    if not flex:
        return
    differentiable = _differentiable(prepared, gm)
    for node in flex:
        score_mod, captured = getattr(gm, node.args[3].target), node.args[7]
        inputs = score_mod.graph.find_nodes(op="placeholder")[5:]  # after score, b, h, q_idx, kv_idx
        for tensor, inner in zip(captured, inputs):
            if tensor in differentiable and any(use.target is torch.ops.aten.index.Tensor for use in inner.users):
                raise UnsupportedConstructError(
                    f"forward calls torch.nn.attention.flex_attention with a score_mod that indexes a tensor it "
                    f"captures ({_label(prepared, gm, tensor)}) and that carries a gradient; eager differentiates that "
                    "index through torch's own ModIndex Function, whose backward an exported (ATen) graph does not "
                    "hold, and flex_attention's backward fails on aten.index's gradient.",
                    where=stack_line(node) or f"{user_frame()} (the export call)",
                    fix="if the tensor is not trained, make it a buffer or read it detached (bias.detach()[h]): "
                    "that exports; for a trained per-head bias, put it into a float attn_mask of "
                    "F.scaled_dot_product_attention (attn_mask = bias[:, None, None] * (q_idx - kv_idx)), "
                    "which on CPU computes what flex_attention computes, and exports with its gradient.",
                )


def _differentiable(prepared: PreparedInputs, gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes a parameter that requires grad, or a floating user input, reaches (not through detach)."""
    placeholders = gm.graph.find_nodes(op="placeholder")[1:]  # after the effect token
    state = len(prepared.state)
    roots = {p for p, lifted in zip(placeholders, prepared.state) if lifted.tensor.requires_grad}
    roots |= {p for p in placeholders[state:] if _floating(p)}
    reached = set(roots)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target not in _DETACHING and any(i in reached for i in node.all_input_nodes):
            reached.add(node)
    return reached


def _floating(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def _label(prepared: PreparedInputs, gm: fx.GraphModule, node: fx.Node) -> str:
    """The captured tensor as the user knows it: a state name, or 'computed in forward'."""
    placeholders = gm.graph.find_nodes(op="placeholder")[1:]
    for p, lifted in zip(placeholders, prepared.state):
        if p is node:
            kind = "parameter" if lifted.spec.kind is InputKind.PARAMETER else "tensor"
            return f"{kind} {lifted.spec.target}"
    return "a tensor computed from differentiable values in forward"
