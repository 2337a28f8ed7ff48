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

A `view` of a computed tensor becomes `reshape` (Note [Views of computed tensors]).

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
    chains = _BufferChains(graph, input_specs, output_specs)
    replaced: list[fx.Node] = []
    for node in list(graph.nodes):
        if node.target is aten._native_batch_norm_legit_functional.default:
            replaced += _batch_norm_train(graph, node, chains)
        elif node.target is aten.add.Tensor:
            replaced += _counter_in_place(graph, node, chains)
        elif node.target is aten._native_batch_norm_legit_no_training.default:
            args = (*node.args[:5], False, *node.args[5:7], _CUDNN_ENABLED)
            replaced += _replace_outputs(graph, node, aten.batch_norm.default, args, keep=())
        elif node.target is aten.native_dropout.default and isinstance(node.args[2], bool):
            replaced += _replace_outputs(graph, node, aten.dropout.default, tuple(node.args[:3]), keep=())
        elif node.target is aten.view.default and _computed(node.args[0]):
            _as_reshape(graph, node)
    return _erase(graph, output_specs, replaced, chains)


# Note [Views of computed tensors]
# ---------------------------------
# predispatch's trace decides each `reshape` when it runs (the composite audit: whether it
# aliases depends on its input's strides), so `x.transpose(1, 2).reshape(b, s, d)` after the
# CPU attention kernel is recorded as `aten.view`: that kernel's output makes the transposed
# tensor contiguous.  torch's consumers trace the program again with their own kernels and
# decompositions (`run_decompositions()`, ExecuTorch's `to_edge`): the decomposed
# `scaled_dot_product_attention` lays its output out otherwise, and the `view` fails ("Cannot
# view a tensor with shape [2, 8, 64] and strides (64, 128, 1)"; a torchao int8 Llama-style
# model, whose quantized linear reshapes its input).  torch.export's own training IR keeps
# `aten.reshape`, which decides again on the strides it is given.  In `to_torch()`'s graph a
# `view` of a computed tensor (not an input, whose layout is the caller's) is written as
# `aten.reshape`: the same values, as nothing writes in place into such a view (the only
# in-place writes here are the buffer updates above, on placeholders).


def _computed(value: object) -> bool:
    """Whether `value` is a tensor the graph computes, whose strides are its kernel's choice."""
    return isinstance(value, fx.Node) and value.op == "call_function"


def _as_reshape(graph: fx.Graph, view: fx.Node) -> None:
    """`view` written as `aten.reshape`, named so (Note [Views of computed tensors])."""
    with graph.inserting_before(view):
        reshape = graph.create_node("call_function", aten.reshape.default, view.args, view.kwargs, name="reshape")
    reshape.meta = dict(view.meta)
    view.replace_all_uses_with(reshape)
    graph.erase_node(view)


class _BufferChains:
    """Which values may become in-place updates of a buffer.

    An update `new = f(old)` of a buffer's value can run in place on the buffer's placeholder
    when nothing reads `old` afterwards and `new` is read only by the next update of the same
    buffer or, last, by the BUFFER_MUTATION output that writes the buffer.  Each update made in
    place replaces `new` by the placeholder, so the next update finds the placeholder again
    (batch norm called twice in one forward updates its statistics twice).
    """

    def __init__(self, graph: fx.Graph, input_specs: list[tsig.InputSpec], output_specs: list[tsig.OutputSpec]):
        self.output = graph.output_node()
        self.buffer_of = {s.arg.name: s.target for s in input_specs if s.kind is tsig.InputKind.BUFFER}
        self.writes = [s.target if s.kind is tsig.OutputKind.BUFFER_MUTATION else None for s in output_specs]
        self.in_place: set[fx.Node] = set()  # the updates made in place, and the nodes they replace (erased at the end)

    def updatable(self, old: object, reader: fx.Node) -> bool:
        """Whether `reader` may update the buffer placeholder `old` in place: nothing but earlier
        in-place updates and `reader` reads it."""
        return isinstance(old, fx.Node) and old.name in self.buffer_of and set(old.users) <= self.in_place | {reader}

    def written_once(self, new: fx.Node | None, old: fx.Node, next_update: tuple) -> bool:
        """Whether `new` is read only by one next update (`next_update`: (target, argument
        index)) or by one output position writing `old`'s buffer."""
        if new is None or len(new.users) != 1:
            return False
        (user,) = new.users
        if user is self.output:
            positions = [i for i, value in enumerate(self.output.args[0]) if value is new]
            return len(positions) == 1 and self.writes[positions[0]] == self.buffer_of[old.name]
        target, index = next_update
        return user.target is target and len(user.args) > index and user.args[index] is new and user.args.count(new) == 1

    def update_in_place(self, new_node: fx.Node, replaced: fx.Node, new_values: list[fx.Node], old_values: list[fx.Node]) -> None:
        """`new_node` (standing for `replaced`) updates the placeholders in place: readers of the
        new values read them."""
        self.in_place |= {new_node, replaced}
        for new, old in zip(new_values, old_values):
            new.replace_all_uses_with(old)


def _outputs_by_index(node: fx.Node) -> dict[int, fx.Node] | None:
    """`{index: getitem node}` of a multi-output op, or None if anything but `getitem` reads it."""
    found: dict[int, fx.Node] = {}
    for user in node.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int):
            return None
        found[user.args[1]] = user
    return found


def _batch_norm_train(graph: fx.Graph, node: fx.Node, chains: _BufferChains) -> list[fx.Node]:
    """Recompose a train-mode batch norm whose statistics can be updated in place (`_BufferChains`)."""
    outputs = _outputs_by_index(node)
    if outputs is None or set(outputs) - {0, 3, 4}:
        return []
    olds, news = list(node.args[3:5]), [outputs.get(3), outputs.get(4)]
    for index, old, new in zip((3, 4), olds, news):
        if not (chains.updatable(old, node) and chains.written_once(new, old, (node.target, index))):
            return []
    args = (*node.args[:5], True, *node.args[6:8], _CUDNN_ENABLED)
    replaced, new = _replace(graph, node, aten.batch_norm.default, args, keep=(3, 4))
    chains.update_in_place(new, node, news, olds)
    return replaced


def _counter_in_place(graph: fx.Graph, node: fx.Node, chains: _BufferChains) -> list[fx.Node]:
    """`buffer + 1` written back to `buffer` (batch norm's `num_batches_tracked`) as torch's
    `add_(buffer, 1)`; the node to erase.  PT2E's prepare turns the scalar of an out-of-place
    `add` into a `_tensor_constant` attribute, which torch's form does not get."""
    old = node.args[0]
    if not isinstance(old, fx.Node):
        return []
    if not (chains.updatable(old, node) and chains.written_once(node, old, (aten.add.Tensor, 0))):
        return []
    with graph.inserting_before(node):
        new = graph.create_node("call_function", aten.add_.Tensor, node.args, dict(node.kwargs), name="add_")
    new.meta = dict(node.meta)
    chains.update_in_place(new, node, [node], [old])
    return [node]


def _replace_outputs(graph: fx.Graph, node: fx.Node, target: torch._ops.OpOverload, args: tuple, keep: tuple[int, ...]) -> list[fx.Node]:
    """Make `target(*args)` stand for `node[0]` when nothing reads `node`'s outputs other than
    0 and `keep`; the nodes to erase (its `keep` outputs, then `node`), [] when refused."""
    return _replace(graph, node, target, args, keep)[0]


def _replace(graph: fx.Graph, node: fx.Node, target: torch._ops.OpOverload, args: tuple, keep: tuple[int, ...]) -> tuple[list[fx.Node], fx.Node | None]:
    """`_replace_outputs`, also returning the new node (None when refused)."""
    outputs = _outputs_by_index(node)
    if outputs is None or set(outputs) - {0, *keep}:
        return [], None
    with graph.inserting_before(node):
        new = graph.create_node("call_function", target, args, name=target._opname)  # `dropout`, as torch names it
    new.meta = dict(node.meta)
    if 0 in outputs:
        new.meta["val"] = outputs[0].meta.get("val")
        outputs[0].replace_all_uses_with(new)
        graph.erase_node(outputs[0])
    return [*(outputs[i] for i in keep), node], new


def _erase(graph: fx.Graph, output_specs: list[tsig.OutputSpec], replaced: list[fx.Node], chains: _BufferChains) -> list[tsig.OutputSpec]:
    """Erase the replaced nodes, and the outputs (with their specs) that now write a buffer's
    placeholder back to itself: the update ran in place."""
    output = graph.output_node()
    kept = [
        (value, spec) for value, spec in zip(output.args[0], output_specs)
        if not (isinstance(value, fx.Node) and value.op == "placeholder" and spec.kind is tsig.OutputKind.BUFFER_MUTATION)
    ]
    output.args = (tuple(value for value, _ in kept),)
    for node in replaced:
        graph.erase_node(node)
    return [_renamed(spec, value) for value, spec in kept]


def _renamed(spec: tsig.OutputSpec, value: object) -> tsig.OutputSpec:
    """`spec` naming the node that now computes its value (a replaced `getitem` had another name)."""
    if isinstance(value, fx.Node) and isinstance(spec.arg, tsig.TensorArgument) and spec.arg.name != value.name:
        return dataclasses.replace(spec, arg=tsig.TensorArgument(value.name))
    return spec


def clone_saved_statistics(gm: fx.GraphModule) -> int:
    """Give each train-mode batch norm left functional (in a region's subgraph, or with its new
    statistics read after the update) copies of the running statistics; how many nodes.

    Its backward saves `running_mean` and `running_var` (autograd saves every input of
    `native_batch_norm`, though train mode's gradient reads none of them), and torch's
    `module()` then writes the new statistics into those very buffers with `copy_`: backward
    fails with "modified by an inplace operation".  Eager's kernel updates the statistics
    before they are saved, which is what `recompose_for_torch` reproduces where it can; where it
    cannot, a copy is saved instead, at the cost of two vectors the size of the channels.
    """
    count = 0
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.find_nodes(op="call_function", target=aten._native_batch_norm_legit_functional.default):
            if node.args[5] is True:
                for index in (3, 4):
                    _clone_arg(module.graph, node, index)
                count += 1
        module.recompile()
    return count


def _clone_arg(graph: fx.Graph, node: fx.Node, index: int) -> None:
    value = node.args[index]
    if not isinstance(value, fx.Node):
        return
    with graph.inserting_before(node):
        copied = graph.create_node("call_function", aten.clone.default, (value,), name="clone")
    copied.meta = {key: value.meta[key] for key in ("val", "tensor_meta") if key in value.meta}
    node.update_arg(index, copied)
