"""A module with DTensor state becomes the module one rank runs (Note [Per-rank DTensor programs]).

Note [Per-rank DTensor programs]
--------------------------------
A DTensor parameter is a global tensor whose rank holds a shard; DTensor's dispatch, below
autograd, runs each op on the local shards and communicates, and its own autograd Functions
(`from_local`, `redistribute`) decide the backward's communication: a row-wise layer's
`Partial -> Replicate` all-reduce has an identity backward in DTensor, where differentiating
the all-reduce itself would multiply by the world size.  So a graph of the local ops alone,
differentiated op by op, would be wrong; the rank's backward has to be DTensor's.

torch's joint exporter (`aot_export_joint_with_descriptors`, _torch_internals/dtensor.py)
traces forward and backward together below autograd, every DTensor unwrapped to its local
tensor (`__tensor_flatten__`): the joint is what this rank runs, with DTensor's collectives in
both halves.  torch's partitioner splits it into a forward graph `(*local inputs) -> (*outputs,
*saved)` and a backward graph `(*saved, *output grads) -> (*input grads)`.  `per_rank_module`
puts the pair behind one `autograd.Function` (`PerRankStep`) and returns a stand-in module:
the user's state at the same names, each DTensor replaced by its local tensor (the same memory,
`to_local()`), whose forward applies `PerRankStep` to the state and the inputs.  Exporting the
stand-in is an ordinary export: the Function is captured as `autograd_function_apply` with the
two graphs as its forward and backward subgraphs (Note [Capturing autograd.Function]), so
`ep.module()` trains with DTensor's backward, `ep.joint()` inlines it, and save/load keeps both.
The forward's ops sit inside that one region (not flat in the program's graph): they are the
joint's own, below autograd, and only as a pair with the backward are they DTensor's program.

Each state tensor's mesh and placements go into the signature (`StatePlacement`).  The
program's state is the rank's shards; a gradient of the program is the gradient of the shard,
`param.grad.to_local()` of the parallel model.  Floating user inputs are traced as requiring
grad, so a program trained with an input that requires grad gives it DTensor's gradient (the
backward then also holds that gradient's collective).

Positions are matched by what torch's descriptors say they are, never by order: the joint
returns gradients for some inputs only (none for buffers), and a gradient matched by position
would land on the wrong tensor.

Covered: DTensor parameters and buffers (`parallelize_module`, `distribute_tensor`, SimpleFSDP's
parametrized form), plain tensors beside them, plain positional tensor inputs and outputs.
Refused by name (`DistributedError`): a DTensor input or output, keyword or non-tensor inputs,
dynamic shapes, `preserve=`/`decompose=`, a write to an input or a buffer, an output aliasing
an input or another output, a mesh read as a value, random ops, and anything else the joint
names otherwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import DistributedError, user_frame
from predispatch.frontend.distributed import is_dtensor
from predispatch.signature import StatePlacement

__all__ = ["PerRankStep", "has_dtensor_state", "per_rank_module", "refuse_per_rank_options"]

_DOCS = "see docs/distributed.md (per-rank DTensor programs)."


def has_dtensor_state(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is a DTensor (none exist before
    torch.distributed.tensor is imported)."""
    return any(is_dtensor(t) for t in _state(module).values())


def per_rank_module(module: nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any) -> tuple[nn.Module, tuple[StatePlacement, ...]]:
    """The stand-in module this rank's program is exported from, and each DTensor state
    tensor's placement; see Note [Per-rank DTensor programs]."""
    _refuse_inputs(args, kwargs, dynamic_shapes)
    graphs = ti.per_rank_graphs(module, _traced_args(args), _refuse_slots)
    _refuse_graphs(graphs)
    state = _state(module)
    locals_ = _local_state(module, state)
    placements = tuple(_placement(name, t) for name, t in state.items() if is_dtensor(t))
    return PerRankModule(module, locals_, graphs), placements


def refuse_per_rank_options(placements: tuple[StatePlacement, ...], overrides: tuple[str, ...]) -> None:
    """`preserve=` / `decompose=` cannot reach a per-rank program's ops: they come from torch's
    joint below autograd, composites already decomposed.  Refused rather than ignored."""
    if placements and overrides:
        raise DistributedError(
            f"preserve= / decompose= ({', '.join(sorted(overrides))}) with DTensor state: a per-rank program's ops "
            "are torch's joint's, traced below autograd, where composite ops are already decomposed.",
            where=f"{user_frame()} (the export call)",
            fix="export without preserve= and decompose=; " + _DOCS,
        )


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by every name it has (tied ones under each)."""
    named: dict[str, torch.Tensor] = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


def _local_state(module: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's tensor of each state tensor: a DTensor's local tensor (its memory, detached;
    a Parameter again when it was one), a plain tensor itself.  Tied names share one."""
    made: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        if id(t) not in made:
            if is_dtensor(t):
                local = t.to_local().detach()  # type: ignore[attr-defined]  # a DTensor's
                made[id(t)] = nn.Parameter(local, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else local
            else:
                made[id(t)] = t
        out[name] = made[id(t)]
    return out


def _placement(name: str, tensor: Any) -> StatePlacement:
    mesh = tensor.device_mesh
    return StatePlacement(
        target=name,
        placements=tuple(repr(p) for p in tensor.placements),
        mesh_shape=tuple(mesh.shape),
        mesh_dim_names=tuple(mesh.mesh_dim_names or ()),
        mesh_ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
        device_type=mesh.device_type,
        global_shape=tuple(tensor.shape),
        local_shape=tuple(tensor.to_local().shape),
    )


def _traced_args(args: tuple) -> tuple:
    """The inputs the joint is traced with: floating ones requiring grad (the program may be
    trained with them requiring it), detached copies so the user's are untouched."""

    def prepare(t: torch.Tensor) -> torch.Tensor:
        copy = t.detach().clone()
        return copy.requires_grad_(True) if copy.is_floating_point() or copy.is_complex() else copy

    return tuple(pytree.tree_map(prepare, args))


def _refuse_inputs(args: tuple, kwargs: dict, dynamic_shapes: Any) -> None:
    """Refuse what the per-rank route does not cover, before anything is traced."""
    where = f"{user_frame()} (the export call)"
    if kwargs:
        raise DistributedError(
            "a model with DTensor state was called with keyword arguments; per-rank DTensor programs take "
            "positional tensor inputs only.",
            where=where,
            fix="pass the inputs positionally; " + _DOCS,
        )
    if dynamic_shapes is not None:
        raise DistributedError(
            "dynamic_shapes with DTensor state: per-rank DTensor programs are exported with static shapes.",
            where=where,
            fix="export without dynamic_shapes, once per input shape; " + _DOCS,
        )
    for i, leaf in enumerate(pytree.tree_leaves(args)):
        if not isinstance(leaf, torch.Tensor):
            raise DistributedError(
                f"input leaf {i} is a {type(leaf).__name__}; per-rank DTensor programs take tensor inputs only.",
                where=where,
                fix="bind constants in the model (an attribute or a closure) and pass tensors; " + _DOCS,
            )
        if is_dtensor(leaf):
            raise _dtensor_io_error(f"tensor input {i}", where)


def _dtensor_io_error(what: str, where: str) -> DistributedError:
    return DistributedError(
        f"{what} is a DTensor; per-rank DTensor programs take and return plain tensors (the rank's values).",
        where=where,
        fix="pass the local tensor (t.to_local()) and make the DTensor inside forward (DTensor.from_local), "
        "and return out.to_local() or out.full_tensor(); " + _DOCS,
    )


def _refuse_slots(inputs: list[ti.Slot], outputs: list[ti.Slot]) -> None:
    """Every joint input must be state (a local tensor or its mesh) or a user input, every
    forward output a user output."""
    where = f"{user_frame()} (the export call)"
    for slot in outputs:
        if slot.kind != "output":
            if slot.kind == "subclass output":
                raise _dtensor_io_error("an output of forward", where)
            raise DistributedError(
                f"the rank's forward returns {slot.kind} (a write to an input or buffer, or an output aliasing one); "
                "per-rank DTensor programs return their outputs only.",
                where=where,
                fix="return new values instead of writing inputs or buffers in forward; " + _DOCS,
            )
    for slot in inputs:
        if slot.kind not in ("state", "arg", "mesh"):
            raise DistributedError(
                f"the rank's forward takes an input torch's joint exporter describes as {slot.kind}; "
                "per-rank DTensor programs take the state's local tensors and plain inputs only.",
                where=where,
                fix=_DOCS,
            )


def _refuse_graphs(graphs: ti.PerRankGraphs) -> None:
    """The partitioned forward may read no mesh as a value (a graph holds tensors) and draw no
    random numbers: DTensor's RNG tracker moves the generator's offset per shard around each
    random op, which the joint does not record; a program drawing plainly would differ."""
    where = f"{user_frame()} (the export call)"
    for slot in graphs.inputs:
        if slot.kind == "mesh":
            raise DistributedError(
                f"the rank's forward reads the device mesh of {slot.name!r} as a value; a program's graph holds "
                "tensors, not meshes.",
                where=where,
                fix=_DOCS,
            )
    for node in graphs.forward.graph.nodes:
        if _draws(node):
            raise DistributedError(
                f"the rank's forward draws random numbers ({node.target}) with DTensor state: DTensor offsets the "
                "generator per shard around each random op, which the per-rank program does not capture.",
                where=where,
                fix="export in eval mode (no dropout), or draw the randomness outside the model and pass it in; " + _DOCS,
            )


def _draws(node: Any) -> bool:
    """Whether `node` draws random numbers: an op torch tags as seeded, unless it is attention
    with `dropout_p` 0 (tagged for its dropout, which it then does not draw)."""
    tags = getattr(node.target, "tags", ()) if node.op == "call_function" else ()
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    names = [a.name for a in node.target._schema.arguments]
    if "dropout_p" not in names:
        return True
    position = names.index("dropout_p")
    dropout = node.kwargs.get("dropout_p", node.args[position] if position < len(node.args) else 0.0)
    return dropout != 0


class PerRankStep(torch.autograd.Function):
    """One rank's forward and DTensor's backward for it, as AOTAutograd partitioned the joint.

    `apply(graphs, *inputs)`: `inputs` in `graphs.inputs` order.  Captured by export as
    `autograd_function_apply` (the two graphs its subgraphs); run eagerly it runs them.
    """

    @staticmethod
    def forward(ctx: Any, graphs: ti.PerRankGraphs, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        results = graphs.forward(*inputs)
        count = len(graphs.outputs)
        outputs, saved = tuple(results[:count]), results[count:]
        ctx.save_for_backward(*saved)
        ctx.graphs = graphs
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, graphs.differentiable) if not d))
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        graphs, saved = ctx.graphs, ctx.saved_tensors
        values = [saved[i] if kind == "saved" else grads[i] for kind, i in graphs.backward_inputs]
        input_grads = graphs.backward(*values)
        return (None, *(None if i is None else input_grads[i] for i in graphs.grad_positions))


class PerRankModule(nn.Module):
    """The stand-in for a module with DTensor state: the same names (submodule paths, state
    names, training flags, argument names), each DTensor replaced by the rank's local tensor,
    and a forward that applies `PerRankStep`."""

    def __init__(self, user: nn.Module, state: dict[str, torch.Tensor], graphs: ti.PerRankGraphs) -> None:
        super().__init__()
        self.training = user.training
        for path, sub in user.named_modules(remove_duplicate=False):
            if path:
                self._owner(path).training = sub.training
        buffers = {name for name, _ in user.named_buffers(remove_duplicate=False)}
        for name, tensor in state.items():
            owner, attr = self._owner(name.rpartition(".")[0]), name.rpartition(".")[2]
            if name in buffers:
                persistent = attr not in user.get_submodule(name.rpartition(".")[0])._non_persistent_buffers_set
                owner.register_buffer(attr, tensor, persistent=persistent)
            else:
                assert isinstance(tensor, nn.Parameter), name  # `_local_state` keeps parameters parameters
                owner.register_parameter(attr, tensor)
        object.__setattr__(self, "graphs", graphs)

    def _owner(self, path: str) -> nn.Module:
        """The submodule at `path`, made (a plain `nn.Module`) where the stand-in has none yet."""
        owner: nn.Module = self
        for part in filter(None, path.split(".")):
            if owner._modules.get(part) is None:
                owner.add_module(part, nn.Module())
            owner = owner.get_submodule(part)
        return owner

    graphs: ti.PerRankGraphs

    def forward(self, *args: torch.Tensor) -> Any:
        flat = pytree.tree_leaves(args)
        state: dict[str, torch.Tensor] = dict(self.named_parameters(remove_duplicate=False))
        state.update(self.named_buffers(remove_duplicate=False))
        inputs = [state[s.name] if s.kind == "state" else flat[s.index] for s in self.graphs.inputs]
        outputs = PerRankStep.apply(self.graphs, *inputs)
        return pytree.tree_unflatten(list(outputs), self.graphs.out_spec)
