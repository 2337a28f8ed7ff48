"""What predispatch asks of AOTAutograd for DTensor models: the per-rank joint, partitioned.

`aot_export_joint_with_descriptors` (torch/_functorch/aot_autograd.py, the entry point
torchtitan's graph trainer and autoparallel build on) traces a module's forward and backward
together below autograd, with every DTensor input unwrapped by `__tensor_flatten__` into its
local tensor and its mesh, so the joint is what one rank runs: local shapes, DTensor's own
collectives in forward and in backward.  Its placeholders and outputs carry descriptors
(`meta["desc"]`) saying what each one is; torch's `default_partition` splits the joint into the
forward and backward graphs AOTAutograd itself runs.  This module hands back those two graphs
with each position named in plain terms (`Slot`), so that nothing outside it reads a descriptor.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

__all__ = ["PerRankGraphs", "Slot", "per_rank_graphs"]


@dataclass(frozen=True)
class Slot:
    """What one placeholder of the forward graph (or one output of the user's forward) is.

    kind: "state" (the rank's tensor of the parameter or buffer `name`: a DTensor's
        `_local_tensor`, or a plain tensor), "mesh" (a DTensor state tensor's mesh), "arg" (the
        `index`-th flat user input), "output" (the `index`-th flat user output), "subclass
        output" (a piece of the `index`-th output, a tensor subclass such as a DTensor), or
        what torch called it when it is none of those (the caller refuses it by that name).
    name: the state's fully qualified name ("" otherwise).
    index: the flat position of a user input or output (-1 otherwise).
    """

    kind: str
    name: str = ""
    index: int = -1


@dataclass(frozen=True)
class PerRankGraphs:
    """One rank's forward and backward, as AOTAutograd partitions the joint.

    forward: `(*inputs) -> (*outputs, *saved)`; `inputs` says what each placeholder is.
    backward: `(*placeholders) -> (*joint_input_grads)`: each placeholder is a saved value
        (`backward_inputs[i] = ("saved", j)`, the j-th of forward's saved outputs) or an output
        gradient (`("grad", k)`, the gradient of the k-th output); it returns one gradient per
        joint input (meshes included, as None), None where none flows.
    inputs: the forward graph's placeholders.
    grad_positions: for each forward input, the position of its gradient among backward's
        outputs (matched by descriptor), None where the joint returns none for it.
    outputs: the forward graph's first outputs (the user's flat outputs, in order).
    differentiable: for each output, whether the joint gives it a gradient input (a tangent).
    out_spec: the pytree spec of the user's return value.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    inputs: tuple[Slot, ...]
    outputs: tuple[Slot, ...]
    differentiable: tuple[bool, ...]
    backward_inputs: tuple[tuple[str, int], ...]
    grad_positions: tuple[int | None, ...]
    out_spec: Any


def per_rank_graphs(module: nn.Module, args: tuple[Any, ...], check: Callable[[list[Slot], list[Slot]], None]) -> PerRankGraphs:
    """Trace `module(*args)`'s joint with DTensors unwrapped, and partition it.  `check(inputs,
    outputs)` sees what every joint input and forward output is before anything else happens
    (the caller refuses what it does not cover: the partitioner assumes plain outputs)."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, module, args)
        graph_module, out_spec = joint.graph_module, joint.out_spec
        placeholders = graph_module.graph.find_nodes(op="placeholder")
        primals = [p for p in placeholders if not _is_tangent(p)]
        forward_count = _forward_count(_output_descs(graph_module))
        aliased = _aliased_outputs(joint)
        outputs = [_output_slot(d, aliased) for d in _output_descs(graph_module)[:forward_count]]
        check([_slot(p.meta["desc"]) for p in primals], outputs)
        _drop_mesh_gradients(graph_module, primals, forward_count)
        forward, backward = _partition(graph_module, forward_count)
    return _named(forward, backward, primals, graph_module, forward_count, out_spec)


def _forward_count(descs: list[Any]) -> int:
    """How many of the joint's outputs are forward's: those before the first gradient (the joint
    returns forward's outputs, then one gradient per input, some of them None)."""
    count = 0
    while count < len(descs) and not _is_grad(descs[count]):
        count += 1
    return count


def _output_descs(graph_module: fx.GraphModule) -> list[Any]:
    return list(graph_module.graph.output_node().meta["desc"])


def _is_grad(desc: Any) -> bool:
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, SubclassGetAttrAOTOutput

    while isinstance(desc, SubclassGetAttrAOTOutput):
        desc = desc.base
    return isinstance(desc, GradAOTOutput)


def _is_tangent(node: fx.Node) -> bool:
    from torch._functorch._aot_autograd.descriptors import SubclassGetAttrAOTInput, TangentAOTInput

    desc = node.meta.get("desc")
    while isinstance(desc, SubclassGetAttrAOTInput):
        desc = desc.base
    return isinstance(desc, TangentAOTInput)


def _drop_mesh_gradients(graph_module: fx.GraphModule, primals: list[fx.Node], forward_count: int) -> None:
    """A DTensor's mesh is a placeholder too, whose "gradient" the joint returns as the mesh
    itself: None in its place, so no graph carries a mesh (the forward reads none: checked)."""
    output = graph_module.graph.output_node()
    values = list(output.args[0])
    for i, node in enumerate(values):
        if i >= forward_count and isinstance(node, fx.Node) and node in primals and _slot(node.meta["desc"]).kind == "mesh":
            values[i] = None
    output.args = (values,)
    graph_module.recompile()


def _partition(graph_module: fx.GraphModule, forward_count: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    from torch._functorch.partitioners import default_partition

    return default_partition(graph_module, None, num_fwd_outputs=forward_count)


def _slot(desc: Any) -> Slot:
    """The plain meaning of a forward input's descriptor."""
    from torch._functorch._aot_autograd import descriptors as d

    if isinstance(desc, d.PlainAOTInput):
        return Slot("arg", index=desc.idx)
    if isinstance(desc, (d.ParamAOTInput, d.BufferAOTInput)):
        return Slot("state", desc.target)
    if isinstance(desc, d.SubclassGetAttrAOTInput) and isinstance(desc.base, (d.ParamAOTInput, d.BufferAOTInput)):
        if desc.attr == "_local_tensor":
            return Slot("state", desc.base.target)
        if desc.attr == "device_mesh":
            return Slot("mesh", desc.base.target)
    return Slot(str(desc))


def _key(desc: Any) -> tuple[Any, str | None]:
    """An input descriptor as (the input, its attribute: `_local_tensor` of a DTensor, or None)."""
    from torch._functorch._aot_autograd.descriptors import SubclassGetAttrAOTInput

    return (desc.base, desc.attr) if isinstance(desc, SubclassGetAttrAOTInput) else (desc, None)


def _grad_positions(descs: list[Any]) -> dict[tuple[Any, str | None], int]:
    """Each gradient output's input key (as `_key` makes it) -> its position among `descs`: the
    joint returns gradients only for some inputs (not for buffers), so position alone says nothing."""
    from torch._functorch._aot_autograd.descriptors import GradAOTOutput, SubclassGetAttrAOTOutput

    positions = {}
    for i, desc in enumerate(descs):
        attr = desc.attr if isinstance(desc, SubclassGetAttrAOTOutput) else None
        base = desc.base if isinstance(desc, SubclassGetAttrAOTOutput) else desc
        if isinstance(base, GradAOTOutput):
            positions[(base.grad_of, attr)] = i
    return positions


def _aliased_outputs(joint: Any) -> set[int]:
    """The user outputs that alias an input or another output: AOTAutograd regenerates those
    outside its graphs (its runtime wrappers), which a program of the graphs alone would not."""
    from torch._functorch._aot_autograd.schemas import OutputType

    infos = joint._aot_state.fw_metadata.output_info
    return {i for i, info in enumerate(infos) if info.output_type is not OutputType.non_alias}


def _output_slot(desc: Any, aliased: set[int]) -> Slot:
    from torch._functorch._aot_autograd import descriptors as d

    if isinstance(desc, d.PlainAOTOutput) and desc.idx in aliased:
        return Slot(f"output {desc.idx}, a view of an input or of another output")
    if isinstance(desc, d.PlainAOTOutput):
        return Slot("output", index=desc.idx)
    if isinstance(desc, d.SubclassGetAttrAOTOutput) and isinstance(desc.base, d.PlainAOTOutput):
        return Slot("subclass output", index=desc.base.idx)  # a piece of a tensor subclass (a DTensor) the user returns
    return Slot(str(desc))


def _named(
    forward: fx.GraphModule,
    backward: fx.GraphModule,
    primals: list[fx.Node],
    joint: fx.GraphModule,
    forward_count: int,
    out_spec: Any,
) -> PerRankGraphs:
    """Name every position of the partitioned graphs: forward's placeholders by the joint's
    descriptors (unused mesh placeholders erased), backward's by name, saved value or tangent."""
    descs = {p.name: p.meta["desc"] for p in joint.graph.find_nodes(op="placeholder")}
    for node in forward.graph.find_nodes(op="placeholder"):
        if _slot(descs[node.name]).kind == "mesh" and not node.users:
            forward.graph.erase_node(node)
    forward.recompile()
    kept = [n.name for n in forward.graph.find_nodes(op="placeholder")]
    inputs = tuple(_slot(descs[name]) for name in kept)
    grads = _grad_positions(_output_descs(joint)[forward_count:])
    out_descs = _output_descs(joint)[:forward_count]
    tangents = {p.name: out_descs.index(p.meta["desc"].output) for p in joint.graph.find_nodes(op="placeholder") if _is_tangent(p)}
    returned: Any = forward.graph.output_node().args[0]
    saved = [n.name for n in returned[forward_count:]]
    backward_inputs = tuple(
        ("saved", saved.index(n.name)) if n.name in saved else ("grad", tangents[n.name])
        for n in backward.graph.find_nodes(op="placeholder")
    )
    return PerRankGraphs(
        forward=forward,
        backward=backward,
        inputs=inputs,
        outputs=tuple(_output_slot(desc, set()) for desc in out_descs),
        differentiable=tuple(i in tangents.values() for i in range(forward_count)),
        backward_inputs=backward_inputs,
        grad_positions=tuple(grads.get(_key(descs[name])) for name in kept),
        out_spec=out_spec,
    )
