"""Give `to_torch()`'s graph torch's training-IR forms of batch norm and dropout.

predispatch's graph is functional, so batch norm in train mode is
`_native_batch_norm_legit_functional`, whose new running statistics are BUFFER_MUTATION
outputs, and dropout is `native_dropout`.  torch.export's training IR keeps the composites
`aten.batch_norm` (updating the running statistics in place, as eager's kernel does) and
`aten.dropout`.  Torch's tools are written against those forms:

- torchao's PT2E rewrites (QAT's conv+BN fusion, `move_exported_model_to_eval`,
  `convert_pt2e`'s BN folding) match `aten.batch_norm` and `aten.dropout` by pattern; on the
  functional forms they match nothing and the model is silently not fused, not switched to
  eval, not folded;
- torch's `module()` writes each BUFFER_MUTATION back with `copy_` after the graph ran; batch
  norm's backward saved `running_var`, so that write fails backward ("modified by an inplace
  operation").  `aten.batch_norm` updates it inside the kernel, as eager does.

Before (train mode; the statistics are mutation outputs):

    _native_batch_norm_legit_functional = aten._native_batch_norm_legit_functional.default(
        conv2d, p_bn_weight, p_bn_bias, b_bn_running_mean, b_bn_running_var, True, 0.1, 1e-05)
    getitem = _native_batch_norm_legit_functional[0]
    getitem_3 = _native_batch_norm_legit_functional[3]      # BUFFER_MUTATION bn.running_mean
    getitem_4 = _native_batch_norm_legit_functional[4]      # BUFFER_MUTATION bn.running_var
    native_dropout = aten.native_dropout.default(relu, 0.3, True)
    getitem_5 = native_dropout[0]
After:

    batch_norm = aten.batch_norm.default(
        conv2d, p_bn_weight, p_bn_bias, b_bn_running_mean, b_bn_running_var, True, 0.1, 1e-05, False)
    dropout = aten.dropout.default(relu, 0.3, True)

(and the two BUFFER_MUTATION outputs are gone: the statistics change in place).  Eval-mode
`_native_batch_norm_legit_no_training` becomes `aten.batch_norm(..., False, ...)`.

Only nodes whose extra outputs nothing else reads are rewritten (a dropout mask used
elsewhere, statistics read after the update, or inside a region's subgraph stay functional);
`num_batches_tracked + 1` written back becomes torch's `add_(num_batches_tracked, 1)`.

Pre: a top-level graph in torch's calling convention (`to_torch`'s builder), with its output
    specs, one per output value.
Post: the same values computed; fewer BUFFER_MUTATION outputs; the graph is not functional.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
import torch.export.graph_signature as tsig
from torch import fx

aten = torch.ops.aten

#: cudnn_enabled of the recomposed `aten.batch_norm`: False, as torch.export traces with cudnn
#: disabled (torch/export/_trace.py), so the graph matches torchao's patterns exported that way.
_CUDNN_ENABLED = False


def recompose_for_torch(
    graph: fx.Graph, input_specs: list[tsig.InputSpec], output_specs: list[tsig.OutputSpec]
) -> list[tsig.OutputSpec]:
    """Rewrite batch norm and dropout in `graph` (in place); the output specs that remain."""
    buffer_of = {s.arg.name: s.target for s in input_specs if s.kind is tsig.InputKind.BUFFER}
    written = {s.arg.name: s.target for s in output_specs if s.kind is tsig.OutputKind.BUFFER_MUTATION}
    replaced: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.target is aten._native_batch_norm_legit_functional.default:
            replaced += _batch_norm_train(graph, node, buffer_of, written)
        elif node.target is aten._native_batch_norm_legit_no_training.default:
            args = (*node.args[:5], False, *node.args[5:7], _CUDNN_ENABLED)
            replaced += _replace_outputs(graph, node, aten.batch_norm.default, args, keep=())
        elif node.target is aten.add.Tensor:
            replaced += _counter_in_place(graph, node, buffer_of, written)
        elif node.target is aten.native_dropout.default and isinstance(node.args[2], bool):
            replaced += _replace_outputs(graph, node, aten.dropout.default, tuple(node.args[:3]), keep=())
    return _erase(graph, output_specs, replaced)


def _outputs_by_index(node: fx.Node) -> dict[int, fx.Node] | None:
    """`{index: getitem node}` of a multi-output op, or None if anything but `getitem` reads it."""
    found = {}
    for user in node.users:
        if user.target is not operator.getitem:
            return None
        found[user.args[1]] = user
    return found


def _batch_norm_train(graph: fx.Graph, node: fx.Node, buffer_of: dict[str, str], written: dict[str, str]) -> list[fx.Node]:
    """Recompose a train-mode batch norm when its new statistics are only written back to the
    buffers it read, and nothing else reads those buffers (an in-place update would change
    what a later read sees)."""
    outputs = _outputs_by_index(node)
    if outputs is None:
        return []
    for index, source in ((3, node.args[3]), (4, node.args[4])):
        stat = outputs.get(index)
        if not (isinstance(source, fx.Node) and source.name in buffer_of and list(source.users) == [node]):
            return []
        if stat is None or list(stat.users) != [graph.output_node()] or written.get(stat.name) != buffer_of[source.name]:
            return []
    args = (*node.args[:5], True, *node.args[6:8], _CUDNN_ENABLED)
    return _replace_outputs(graph, node, aten.batch_norm.default, args, keep=(3, 4))


def _counter_in_place(graph: fx.Graph, node: fx.Node, buffer_of: dict[str, str], written: dict[str, str]) -> list[fx.Node]:
    """`buffer + 1` written back to `buffer` (batch norm's `num_batches_tracked`) as torch's
    `add_(buffer, 1)`; the node to erase.  PT2E's prepare turns the scalar of an out-of-place
    `add` into a `_tensor_constant` attribute, which torch's form does not get."""
    source = node.args[0]
    if not (isinstance(source, fx.Node) and source.name in buffer_of and list(source.users) == [node]):
        return []
    if list(node.users) != [graph.output_node()] or written.get(node.name) != buffer_of[source.name]:
        return []
    with graph.inserting_before(node):
        new = graph.create_node("call_function", aten.add_.Tensor, node.args, dict(node.kwargs), name="add_")
    new.meta = dict(node.meta)
    return [node]


def _replace_outputs(graph: fx.Graph, node: fx.Node, target: torch._ops.OpOverload, args: tuple, keep: tuple[int, ...]) -> list[fx.Node]:
    """Make `target(*args)` stand for `node[0]` when nothing reads `node`'s outputs other than
    0 and `keep`; the nodes to erase (`node` and its `keep` outputs), or [] when refused."""
    outputs = _outputs_by_index(node)
    if outputs is None or set(outputs) - {0, *keep}:
        return []
    with graph.inserting_before(node):
        new = graph.create_node("call_function", target, args, name=target._opname)  # `dropout`, as torch names it
    new.meta = dict(node.meta)
    if 0 in outputs:
        new.meta["val"] = outputs[0].meta.get("val")
        outputs[0].replace_all_uses_with(new)
        graph.erase_node(outputs[0])
    return [*(outputs[i] for i in keep), node]


def _erase(graph: fx.Graph, output_specs: list[tsig.OutputSpec], replaced: list[fx.Node]) -> list[tsig.OutputSpec]:
    """Remove the replaced nodes, and the outputs (with their specs) that wrote statistics back."""
    gone = set(replaced)
    output = graph.output_node()
    kept = [(value, spec) for value, spec in zip(output.args[0], output_specs) if value not in gone]
    output.args = (tuple(value for value, _ in kept),)
    for node in replaced:
        graph.erase_node(node)
    return [_renamed(spec, value) for value, spec in kept]


def _renamed(spec: tsig.OutputSpec, value: object) -> tsig.OutputSpec:
    """`spec` naming the node that now computes its value (a replaced `getitem` had another name)."""
    if isinstance(value, fx.Node) and isinstance(spec.arg, tsig.TensorArgument) and spec.arg.name != value.name:
        return dataclasses.replace(spec, arg=tsig.TensorArgument(value.name))
    return spec
