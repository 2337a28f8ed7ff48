"""What each rank runs for tests/test_distributed.py (started by tests/ranks.py, one process a rank).

`python tests/distributed_cases.py CASE OUT`: joins the gloo group torch's env:// variables
name, runs `CASE`, writes its JSON result to OUT.  A case returns plain values (graph text,
op counts, whether outputs and gradients equal eager's bitwise) for the test to assert on; a
case that raises writes `{"error": class name, "message": text}`.
"""

from __future__ import annotations

import copy
import io
import json
import os
import sys
import traceback
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
import torch.distributed._functional_collectives as funcol
from torch import nn

import predispatch
from predispatch.passes import mutable_ops
from predispatch.program.printing import format_graph

CASES: dict[str, Callable[[int], dict[str, Any]]] = {}


def case(fn: Callable[[int], dict[str, Any]]) -> Callable[[int], dict[str, Any]]:
    CASES[fn.__name__] = fn
    return fn


def mlp() -> nn.Module:
    """The same weights on every rank (seeded), as a parallel model starts from one model."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def rank_input(rank: int, *shape: int) -> torch.Tensor:
    """An input that differs between ranks, so a missing collective shows in the outputs."""
    torch.manual_seed(100 + rank)
    return torch.randn(*shape)


def collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many calls of each distributed op the graph holds, subgraphs included, by op name:
    `c10d.allreduce_` as such, torch's functional collectives without their namespace (torch
    2.11 records the autograd variant's `_c10d_functional_autograd`, later releases the op
    below it, `_c10d_functional`)."""
    counts: Counter[str] = Counter()
    for module in gm.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                name = str(node.target)
                if name.startswith("c10d."):
                    counts[name] += 1
                elif name.startswith("_c10d_functional"):
                    counts[name.split(".", 1)[1]] += 1
    return dict(sorted(counts.items()))


def equal(a: Any, b: Any) -> bool:
    """Bitwise equal pytrees of tensors (None equals None)."""
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        (x is None and y is None) or (isinstance(x, torch.Tensor) and torch.equal(x, y)) for x, y in zip(la, lb)
    )


def grads_of(module: nn.Module) -> list[torch.Tensor | None]:
    return [p.grad for p in module.parameters()]


def save_load(ep: Any) -> Any:
    """`ep` saved and loaded back, through memory."""
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    buffer.seek(0)
    return predispatch.load(buffer, op_namespaces=("_c10d_functional", "_c10d_functional_autograd"))


def refusal(fn: Callable[[], Any]) -> dict[str, Any]:
    """What `fn` raised: its class and text (its first line alone is what tests golden)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the case reports whatever was raised
        return {"raised": type(exc).__name__, "first_line": str(exc).splitlines()[0], "message": str(exc)}
    return {"raised": None}


# ---------------------------------------------------------------------------------------------
# hand-written functional collectives: work today, in the joint too, and save/load


class FunctionalCollectives(nn.Module):
    """torch's functional collectives written by hand: a differentiable all-gather of the
    activations, a reduce-scatter back, and a non-differentiable all-reduce of a statistic."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        group = dist.group.WORLD
        full = funcol.all_gather_tensor_autograd(self.lin(x), 0, group)
        part = funcol.reduce_scatter_tensor_autograd(full.relu(), "sum", 0, group)
        scale = funcol.all_reduce(x.detach().abs().mean(), "avg", group)
        out = part * scale
        return out, out.sum()


def run_eager(model: nn.Module, *args: Any) -> tuple[Any, list]:
    """Outputs and parameter gradients of `model` (a copy) in eager, the loss its last output."""
    eager = copy.deepcopy(model)
    eager.zero_grad(set_to_none=True)
    out = eager(*args)
    out[-1].backward()
    return out, grads_of(eager)


def run_program(ep: Any, *args: Any) -> tuple[Any, list]:
    """Outputs and parameter gradients of `ep.module()`, the loss its last output (the program
    shares the exported model's parameters: their gradients are cleared first)."""
    program = ep.module()
    program.zero_grad(set_to_none=True)
    out = program(*args)
    out[-1].backward()
    return out, grads_of(program)


def run_joint(ep: Any, *args: Any) -> tuple[Any, list]:
    """Outputs and parameter gradients of `ep.joint()`, run under no_grad: its gradients come
    from its graph.  The loss is the last output."""
    joint = ep.joint(loss=f"[{ep.signature.out_spec.num_children - 1}]")
    with torch.no_grad():
        out, grads = joint.module()(*args)
    return out, [grads[name] for name in joint.module().state_dict() if name in grads], joint


@case
def functional_collectives(rank: int) -> dict[str, Any]:
    model, x = FunctionalCollectives(), rank_input(rank, 4, 8)
    return exported_and_trained(model, x)


def exported_and_trained(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Export `model` (its last output the loss) and report the graph, its collectives, and
    whether `ep.module()`, `ep.joint()` and the saved and loaded program equal eager."""
    ep = predispatch.export(model, (x,))
    expected, e_grads = run_eager(model, x)
    actual, p_grads = run_program(ep, x)
    j_out, j_grads, joint = run_joint(ep, x)
    return {
        "graph": format_graph(ep.graph_module),
        "state_shapes": {k: list(v.shape) for k, v in ep.state_dict.items()},
        "collectives": collectives(ep.graph_module),
        "joint_collectives": collectives(joint.graph_module),
        "mutable": mutable_ops(ep.graph_module) + mutable_ops(joint.graph_module),
        "outputs_equal": equal(actual, expected),
        "grads_equal": equal(p_grads, e_grads),
        "joint_equal": equal(j_out, expected) and equal(j_grads, e_grads),
        "loaded_equal": equal(run_program(save_load(ep), x), (expected, e_grads)),
    }


# ---------------------------------------------------------------------------------------------
# in-place c10d collectives: functional collective + wait + the write, or refused by name


class InPlaceCollectives(nn.Module):
    """The in-place collectives torch has functional twins for, on activations and on a
    buffer, as a data-parallel model written without functional collectives would call them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        dist.all_reduce(y)  # summed over ranks, in place; its gradient passes as if it were not there
        full = torch.empty(2 * y.shape[0], 8)
        dist.all_gather_into_tensor(full, y.detach() * (dist.get_rank() + 1))  # gloo's kernels refuse grad
        part = torch.empty(y.shape[0] // 2, 8)
        dist.reduce_scatter_tensor(part, full[: y.shape[0]].relu(), op=dist.ReduceOp.MAX)
        pieces = [torch.empty(part.shape) for _ in range(2)]
        dist.all_gather(pieces, part)
        stat = x.detach().mean(0)
        work = dist.broadcast(stat, src=1, async_op=True)
        work.wait()  # the program's write is complete before any later read; its work is a done one
        out = torch.cat(pieces) * y[: 2 * part.shape[0]] + stat
        return out, out.sum()


@case
def inplace_collectives(rank: int) -> dict[str, Any]:
    model, x = InPlaceCollectives(), rank_input(rank, 4, 8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ep = predispatch.export(model, (x,))
    unchanged = equal(list(model.state_dict().values()), list(before.values()))
    calls = []
    for _ in range(5):  # a collective left asynchronous shows as a wrong value in some calls
        expected, e_grads = run_eager(model, x)
        actual, p_grads = run_program(ep, x)
        calls.append(equal(actual, expected) and equal(p_grads, e_grads))
    j_out, j_grads, joint = run_joint(ep, x)
    expected, e_grads = run_eager(model, x)
    return {
        "graph": format_graph(ep.graph_module),
        "collectives": collectives(ep.graph_module),
        "joint_collectives": collectives(joint.graph_module),
        "mutable": mutable_ops(ep.graph_module) + mutable_ops(joint.graph_module),
        "module_unchanged": unchanged,
        "calls_equal": calls,
        "joint_equal": equal(j_out, expected) and equal(j_grads, e_grads),
        "loaded_equal": equal(run_program(save_load(ep), x), run_eager(model, x)),
    }


class AllToAll(nn.Module):
    def forward(self, x):
        outs = [torch.empty_like(x) for _ in range(2)]
        dist.all_to_all(outs, [x, x + 1])
        return torch.cat(outs)


class PremulSum(nn.Module):
    def forward(self, x):
        y = x * 2
        dist.all_reduce(y, op=dist._make_nccl_premul_sum(2.0))
        return y


@case
def inplace_collectives_refused(rank: int) -> dict[str, Any]:
    x = rank_input(rank, 2, 4)
    return {
        "all_to_all": refusal(lambda: predispatch.export(AllToAll(), (x,))),
        "premul_sum": refusal(lambda: predispatch.export(PremulSum(), (x,))),
    }


# ---------------------------------------------------------------------------------------------
# DTensor state and FSDP2: refused by name, nothing changed; what works instead exports


def mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def tensor_parallel_mlp() -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(mlp(), mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})


class DTensorMLP(nn.Module):
    """DTensor parameters without parallelize_module's hooks: the input is made a replicated
    DTensor in forward, DTensor's dispatch communicates, the output is gathered."""

    def __init__(self) -> None:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        super().__init__()
        self.mlp, self.mesh = mlp(), mesh()
        plan = {"0.weight": [Shard(0)], "0.bias": [Shard(0)], "2.weight": [Shard(1)], "2.bias": [Replicate()]}
        for name, placements in plan.items():
            owner, attr = self.mlp.get_submodule(name.split(".")[0]), name.split(".")[1]
            setattr(owner, attr, nn.Parameter(distribute_tensor(getattr(owner, attr).detach(), self.mesh, placements)))

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate

        return self.mlp(DTensor.from_local(x, self.mesh, [Replicate()])).full_tensor()


def fsdp2_mlp() -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    fully_shard(model[0])
    fully_shard(model)
    return model


def ddp_mlp() -> nn.Module:
    return nn.parallel.DistributedDataParallel(mlp())


def dtensor_output() -> nn.Module:
    """The tensor-parallel MLP whose row-wise layer returns its DTensor (use_local_output=False)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(mlp(), mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)})


def tensor_parallel_dropout() -> nn.Module:
    """The tensor-parallel MLP with dropout between its layers, in training mode."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 8))
    return parallelize_module(model, mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})


class ReturnsAView(nn.Module):
    """The tensor-parallel MLP returning, beside its output, a view of its input."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tensor_parallel_mlp()

    def forward(self, x):
        return self.inner(x), x[:2]


def dtensor_input_model() -> nn.Module:
    """The tensor-parallel MLP, called with a DTensor."""
    return tensor_parallel_mlp()


def replicated(x: torch.Tensor) -> Any:
    from torch.distributed.tensor import Replicate, distribute_tensor

    return distribute_tensor(x, mesh(), [Replicate()])


@case
def distributed_state_refused(rank: int) -> dict[str, Any]:
    out = {}
    for name, make, x, options in [
        ("ddp", ddp_mlp, rank_input(rank, 4, 8), {}),
        ("fsdp2", fsdp2_mlp, rank_input(rank, 4, 8), {}),
        ("dtensor_output", dtensor_output, rank_input(0, 4, 8), {}),
        ("dtensor_input", dtensor_input_model, replicated(rank_input(0, 4, 8)), {}),
        ("preserve", tensor_parallel_mlp, rank_input(0, 4, 8), {"preserve": ["aten.linear"]}),
        ("dropout", tensor_parallel_dropout, rank_input(0, 4, 8), {}),
        ("view_output", ReturnsAView, rank_input(0, 4, 8), {}),
    ]:
        model = make()
        before = {k: (type(v), v.to_local().clone() if hasattr(v, "to_local") else v.clone()) for k, v in model.state_dict().items()}
        out[name] = refusal(lambda: predispatch.export(model, (x,), **options))
        after = model.state_dict()
        out[name]["unchanged"] = before.keys() == after.keys() and all(
            type(after[k]) is t and torch.equal(after[k].to_local() if hasattr(after[k], "to_local") else after[k], v)
            for k, (t, v) in before.items()
        ) and all(p.grad is None for p in model.parameters())
        out[name]["eager_runs"] = pytree.tree_leaves(model(x))[0].shape == (4, 8)  # the model still works after the refusal
    return out


class DTensorInForward(nn.Module):
    """Plain parameters; forward makes a DTensor of its input and gathers it back."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.mesh = nn.Linear(8, 8), mesh()

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Shard

        return DTensor.from_local(self.lin(x), self.mesh, [Shard(0)]).full_tensor()


@case
def dtensor_made_in_forward(rank: int) -> dict[str, Any]:
    return refusal(lambda: predispatch.export(DTensorInForward(), (rank_input(rank, 4, 8),)))


@case
def ddp_around_the_program(rank: int) -> dict[str, Any]:
    """What the DDP refusal says to do: export the wrapped module, wrap the program in DDP."""
    model, x = mlp(), rank_input(rank, 4, 8)
    program = nn.parallel.DistributedDataParallel(predispatch.export(copy.deepcopy(model), (x,)).module())
    eager = nn.parallel.DistributedDataParallel(model)
    expected, actual = eager(x), program(x)
    expected.sum().backward(), actual.sum().backward()
    return {"equal": equal(actual, expected) and equal(grads_of(program), grads_of(eager))}


class ShardedLinear(nn.Module):
    """What works instead of FSDP2: each rank holds a row shard of the weight as a plain
    parameter and gathers the full weight in forward (SimpleFSDP's form with torch's
    functional collectives); the gather's backward reduce-scatters the weight's gradient."""

    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        rows = full.out_features // world
        self.weight = nn.Parameter(full.weight.detach()[rank * rows : (rank + 1) * rows].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x):
        weight = funcol.all_gather_tensor_autograd(self.weight, 0, dist.group.WORLD)
        return nn.functional.linear(x, weight, self.bias)


class ShardedMLP(nn.Module):
    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        full = mlp()
        self.up, self.down = ShardedLinear(full[0], rank, world), ShardedLinear(full[2], rank, world)

    def forward(self, x):
        out = self.down(self.up(x).relu())
        return out, out.sum()


@case
def sharded_parameters_gathered_in_forward(rank: int) -> dict[str, Any]:
    return exported_and_trained(ShardedMLP(rank, dist.get_world_size()), rank_input(rank, 4, 8))


# ---------------------------------------------------------------------------------------------
# per-rank DTensor programs: the rank's shards as state, DTensor's collectives in both halves


class Block(nn.Module):
    """A pre-norm transformer block; attention finds its local heads from the shard's width
    (`view(b, s, -1, head_dim)`), as tensor-parallel blocks do."""

    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head_dim = dim // heads

    def forward(self, x):
        h = self.norm1(x)
        b, s, _ = h.shape
        q, k, v = (proj(h).view(b, s, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


def tensor_parallel_block() -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "up": ColwiseParallel(), "down": RowwiseParallel()}
    return parallelize_module(Block(), mesh(), plan)


def local(t: Any) -> Any:
    """A DTensor's local tensor (a gradient of the rank's shard); a plain tensor or None as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def state_snapshot(model: nn.Module) -> dict[str, tuple[type, torch.Tensor, Any]]:
    return {k: (type(v), local(v).detach().clone(), v.grad) for k, v in model.named_parameters()}


def per_rank_trained(model: nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Export a model with DTensor state (its last output the loss) and report the program, its
    collectives and placements, and whether `ep.module()`, `ep.joint()` and the saved and loaded
    program equal the eager parallel model on this rank (gradients of DTensor parameters as
    `param.grad.to_local()`, the gradient of an input that requires grad too)."""
    before = state_snapshot(model)
    ep = predispatch.export(model, (x,))
    after = state_snapshot(model)
    unchanged = before.keys() == after.keys() and all(
        after[k][0] is t and torch.equal(after[k][1], v) and after[k][2] is None for k, (t, v, _) in before.items()
    )
    expected, e_grads = run_eager(model, x)
    e_grads = [local(g) for g in e_grads]
    actual, p_grads = run_program(ep, x)
    j_out, j_grads, joint = run_joint(ep, x)
    saved = refusal(lambda: save_load(ep))
    loaded = save_load(ep) if saved["raised"] is None else None
    return {
        "graph": format_graph(ep.graph_module),
        "signature": str(ep.signature),
        "state_shapes": {k: list(v.shape) for k, v in ep.state_dict.items()},
        "forward_collectives": top_level_collectives(ep.graph_module.get_submodule("per_rank_step_fwd_0")),
        "backward_collectives": top_level_collectives(ep.graph_module.get_submodule("per_rank_step_bwd_0")),
        "joint_collectives": top_level_collectives(joint.graph_module),  # the joint inlines both
        "mutable": mutable_ops(ep.graph_module) + mutable_ops(joint.graph_module),
        "module_unchanged": unchanged,
        "outputs_equal": equal(actual, expected),
        "grads_equal": equal(p_grads, e_grads),
        "joint_equal": equal(j_out, expected) and equal(j_grads, e_grads),
        "save": saved,
        "loaded_equal": loaded is not None and equal(run_program(loaded, x), (expected, e_grads)),
        "loaded_placements": loaded is not None and loaded.signature.placements == ep.signature.placements,
        "input_grad_equal": equal(input_grad(ep.module(), x), input_grad(copy.deepcopy(model), x)),
        "joint_loaded_equal": joint_loaded_equal(joint, x),
    }


def joint_loaded_equal(joint: Any, x: torch.Tensor) -> bool:
    """Whether the joint program, saved and loaded, returns what it returned before."""
    with torch.no_grad():
        return equal(save_load(joint).module()(x), joint.module()(x))


def top_level_collectives(gm: torch.fx.GraphModule) -> dict[str, int]:
    """`collectives` of the graph itself, its subgraphs not counted (the joint inlines them)."""
    counts = Counter(str(n.target).split(".", 1)[1] for n in gm.graph.nodes if str(n.target).startswith("_c10d_functional"))
    return dict(sorted(counts.items()))


def input_grad(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The gradient of the loss (the last output) with respect to an input that requires grad."""
    x = x.clone().requires_grad_(True)
    model(x)[-1].backward()
    return x.grad


@case
def tensor_parallel_mlp_per_rank(rank: int) -> dict[str, Any]:
    return per_rank_trained(WithLoss(tensor_parallel_mlp()), rank_input(0, 4, 8))  # TP: the same input on every rank


@case
def tensor_parallel_block_per_rank(rank: int) -> dict[str, Any]:
    return per_rank_trained(WithLoss(tensor_parallel_block()), rank_input(0, 2, 6, 16))


class GatherForCompute(nn.Module):
    """SimpleFSDP's parametrization: the sharded DTensor parameter is all-gathered for compute,
    its gradient averaged over ranks and scattered back (grad placement `Partial("avg")`)."""

    def forward(self, x):
        from torch.distributed.tensor import Partial, Replicate

        return x.redistribute(placements=[Replicate()]).to_local(grad_placements=[Partial("avg")])


def simple_fsdp_mlp() -> nn.Module:
    """The MLP with every parameter a `Shard(0)` DTensor behind `GatherForCompute` (SimpleFSDP's form)."""
    import torch.nn.utils.parametrize as parametrize
    from torch.distributed.tensor import Shard, distribute_tensor

    model, device_mesh = mlp(), mesh()
    for layer in (model[0], model[2]):
        for name in ("weight", "bias"):
            setattr(layer, name, nn.Parameter(distribute_tensor(getattr(layer, name).detach(), device_mesh, [Shard(0)])))
            parametrize.register_parametrization(layer, name, GatherForCompute(), unsafe=True)
    return model


@case
def simple_fsdp_per_rank(rank: int) -> dict[str, Any]:
    return per_rank_trained(WithLoss(simple_fsdp_mlp()), rank_input(rank, 4, 8))  # data parallel: inputs differ


class DTensorMLPWithBuffers(DTensorMLP):
    """`DTensorMLP` plus a sharded DTensor buffer gathered in forward and a plain non-persistent
    buffer: the joint returns no gradient for buffers, so gradients are matched to inputs by
    what they are, not by position."""

    def __init__(self) -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        super().__init__()
        self.register_buffer("scale", distribute_tensor(torch.arange(8.0), self.mesh, [Shard(0)]))
        self.register_buffer("offset", torch.ones(8), persistent=False)

    def forward(self, x):
        return super().forward(x) * self.scale.full_tensor() + self.offset


@case
def dtensor_parameters_per_rank(rank: int) -> dict[str, Any]:
    return per_rank_trained(WithLoss(DTensorMLPWithBuffers()), rank_input(0, 4, 8))


# ---------------------------------------------------------------------------------------------
# side by side: torch's joint exporter (the route torchtitan and autoparallel build on)


class WithLoss(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out = self.inner(x)
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        return out, out.sum()


@case
def tensor_parallel_side_by_side(rank: int) -> dict[str, Any]:
    """The tensor-parallel MLP through `aot_export_joint_with_descriptors` and through export,
    the input requiring grad in both (export traces floating inputs so)."""
    import contextlib

    from torch._functorch.aot_autograd import aot_compile_joint_with_descriptors, aot_export_joint_with_descriptors

    model, x = WithLoss(tensor_parallel_mlp()), rank_input(0, 4, 8).requires_grad_(True)  # the same input on both ranks, as TP needs
    expected, e_grads = run_eager(model, x)
    e_grads = [g.to_local() for g in e_grads]
    with contextlib.ExitStack() as stack:
        joint = aot_export_joint_with_descriptors(stack, model, (x,))
        counts = collectives(joint.graph_module)
        params = [(str(n.meta["desc"]), list(n.meta["val"].shape)) for n in joint.graph_module.graph.find_nodes(op="placeholder")]
        compiled = aot_compile_joint_with_descriptors(joint)
    program = copy.deepcopy(model)
    program.zero_grad(set_to_none=True)
    actual = compiled(*program.parameters(), x)
    actual[-1].backward()
    ep = predispatch.export(model, (x,))
    ours, our_grads = run_program(ep, x)
    j_out, j_grads, ep_joint = run_joint(ep, x)
    return {
        "torch_joint_collectives": counts,
        "torch_joint_inputs": params,
        "torch_equal": equal(actual, expected) and equal([p.grad.to_local() for p in program.parameters()], e_grads),
        "predispatch_joint_collectives": collectives(ep_joint.graph_module),
        "predispatch_state_shapes": sorted(list(v.shape) for v in ep.state_dict.values()),
        "predispatch_equal": equal(ours, expected) and equal(our_grads, e_grads),
        "predispatch_joint_equal": equal(j_out, expected) and equal(j_grads, e_grads),
    }


# ---------------------------------------------------------------------------------------------


def main(name: str, out: str) -> None:
    dist.init_process_group("gloo")
    try:
        try:
            result = CASES[name](dist.get_rank())
        except Exception as exc:  # noqa: BLE001 - reported to the test, which asserts on it
            result = {"error": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
        with open(out, "w") as f:
            json.dump(result, f)
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort the interpreter's teardown ("terminate called without an active
    # exception"); the result is written, so leave without it
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)




if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
