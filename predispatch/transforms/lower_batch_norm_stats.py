"""Lower train-mode batch norm's functional form to core ATen ops, for ExecuTorch.

torch's joint export (`_export_forward_backward`) leaves train-mode batch norm as
`_native_batch_norm_legit_functional`, which is not core ATen: `to_edge` refuses it, whoever
exported the model.  The same values from core ATen ops that ExecuTorch has kernels for:

Before:
    bn = aten._native_batch_norm_legit_functional.default(x, w, b, running_mean, running_var, True, 0.1, 1e-05)
    out, save_mean, save_invstd = bn[0], bn[1], bn[2]
    new_mean, new_var = bn[3], bn[4]
After:
    bn = aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-05)
    out, save_mean, save_invstd = bn[0], bn[1], bn[2]
    new_mean = running_mean * 0.9 + save_mean * 0.1
    new_var = running_var * 0.9 + aten.var.correction(x, [0, 2, 3], correction=1) * 0.1

which is eager's update (the unbiased batch variance; float rounding may differ in the last
bit).  The backward part of a joint graph already reads `save_mean` and `save_invstd`, which
are unchanged.

Pre: a graph after torch's core ATen decomposition (its nodes carry `meta["val"]`).
Post: no `_native_batch_norm_legit_functional`; `meta["val"]` of new nodes propagated with the
    graph's fake mode.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten


def lower_batch_norm_stats(gm: fx.GraphModule) -> int:
    """Rewrite every train-mode functional batch norm of `gm`'s top-level graph; how many."""
    nodes = gm.graph.find_nodes(op="call_function", target=aten._native_batch_norm_legit_functional.default)
    for node in nodes:
        _lower(gm.graph, node)
    if nodes:
        gm.graph.lint()
        gm.recompile()
    return len(nodes)


def _lower(graph: fx.Graph, node: fx.Node) -> None:
    """Replace one functional batch norm by `no_stats` batch norm and the statistics' update."""
    x, weight, bias, running_mean, running_var, training, momentum, eps = node.args
    rank = node.args[0].meta["val"].dim()
    with graph.inserting_before(node):
        no_stats = _call(graph, aten._native_batch_norm_legit.no_stats, x, weight, bias, training, momentum, eps)
        stats = [_call(graph, operator.getitem, no_stats, i) for i in range(3)]
        var = _call(graph, aten.var.correction, x, [0, *range(2, rank)], correction=1)
        new_mean = _update(graph, running_mean, stats[1], momentum)
        new_var = _update(graph, running_var, var, momentum)
    for user in list(node.users):
        index = user.args[1]
        user.replace_all_uses_with([*stats, new_mean, new_var][index])
        graph.erase_node(user)
    graph.erase_node(node)


def _update(graph: fx.Graph, running: Any, batch: fx.Node, momentum: Any) -> fx.Node:
    """`running * (1 - momentum) + batch * momentum`, as eager's kernel updates a statistic."""
    kept = _call(graph, aten.mul.Tensor, running, 1 - momentum)
    new = _call(graph, aten.mul.Tensor, batch, momentum)
    return _call(graph, aten.add.Tensor, kept, new)


def _call(graph: fx.Graph, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
    """A new node with its `meta["val"]`, computed on the inputs' fake values."""
    node = graph.call_function(target, args, kwargs)
    fake_args, fake_kwargs = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    node.meta["val"] = _fake_value(target, fake_args, fake_kwargs)
    return node


def _fake_value(target: Any, args: Any, kwargs: dict) -> Any:
    """`target` run on fake values, in their fake mode (getitem of a tuple needs none)."""
    if target is operator.getitem:
        return args[0][args[1]]
    mode = next(a.fake_mode for a in torch.utils._pytree.tree_leaves(args) if hasattr(a, "fake_mode"))
    with mode:
        return target(*args, **kwargs)
