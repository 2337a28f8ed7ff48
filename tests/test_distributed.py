"""Distributed programs on 2 ranks (gloo, CPU, 127.0.0.1): collectives in the graph, or refused by name.

Each test runs one case of tests/distributed_cases.py in one process per rank (tests/ranks.py,
with a timeout) and asserts on what every rank reports: the graph, the collectives in it, and
outputs and gradients of `ep.module()` and `ep.joint()` bitwise equal to the eager model's on
that rank.  Run with `-m distributed`.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from expecttest import TestCase
from helpers import on_golden_torch
from ranks import run_ranks

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo"),
]


def ranks(case: str) -> list[dict]:
    """Every rank's result of `case`; a case that raised fails the test with its traceback."""
    results = run_ranks(case)
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('traceback', result)}"
    return results


class TestFunctionalCollectives(TestCase):
    def test_hand_written_functional_collectives_export_train_and_load(self):
        # torch's functional collectives written in forward are ops like any other: in the
        # graph with their waits, differentiated in the joint (all_gather's backward is a
        # reduce_scatter and the reverse), saved and loaded
        results = ranks("functional_collectives")
        if on_golden_torch():
            self.assertExpectedInline(results[0]["graph"], """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[8, 8]", p_lin_bias: "f32[8]", x: "f32[4, 8]"):
        linear: "f32[4, 8]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  p_lin_weight = p_lin_bias = None
        all_gather_into_tensor: "f32[8, 8]" = torch.ops._c10d_functional.all_gather_into_tensor.default(linear, 2, '0');  linear = None
        wait_tensor: "f32[8, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None
        relu: "f32[8, 8]" = torch.ops.aten.relu.default(wait_tensor);  wait_tensor = None
        reduce_scatter_tensor: "f32[4, 8]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(relu, 'sum', 2, '0');  relu = None
        wait_tensor_1: "f32[4, 8]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor);  reduce_scatter_tensor = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(x);  x = None
        abs_1: "f32[4, 8]" = torch.ops.aten.abs.default(detach);  detach = None
        mean: "f32[]" = torch.ops.aten.mean.default(abs_1);  abs_1 = None
        all_reduce: "f32[]" = torch.ops._c10d_functional.all_reduce.default(mean, 'avg', '0');  mean = None
        wait_tensor_2: "f32[]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
        mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(wait_tensor_1, wait_tensor_2);  wait_tensor_1 = wait_tensor_2 = None
        sum_1: "f32[]" = torch.ops.aten.sum.default(mul)
        return (mul, sum_1)""")
        for result in results:
            assert result["collectives"] == {
                "all_gather_into_tensor.default": 1,
                "all_reduce.default": 1,
                "reduce_scatter_tensor.default": 1,
                "wait_tensor.default": 3,
            }
            assert result["joint_collectives"] == {
                "all_gather_into_tensor.default": 2,
                "all_reduce.default": 1,
                "reduce_scatter_tensor.default": 2,
                "wait_tensor.default": 5,
            }
            assert result["mutable"] == []
            assert result["outputs_equal"] and result["grads_equal"]
            assert result["joint_equal"] and result["loaded_equal"]


class TestInPlaceCollectives(TestCase):
    def test_in_place_collectives_become_functional_collectives_and_writes(self):
        # dist.all_reduce / all_gather_into_tensor / reduce_scatter_tensor / all_gather /
        # broadcast in forward: torch's functional collective, its wait, and the write (a
        # keep_history: eager's kernel is out of autograd's sight); no c10d op left, outputs and
        # gradients equal eager's on every call, in the joint and after save/load
        results = ranks("inplace_collectives")
        if on_golden_torch():
            self.assertExpectedInline(results[0]["graph"], """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[8, 8]", p_lin_bias: "f32[8]", x: "f32[4, 8]"):
        linear: "f32[4, 8]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  p_lin_weight = p_lin_bias = None
        detach: "f32[4, 8]" = torch.ops.aten.detach.default(linear)
        all_reduce: "f32[4, 8]" = torch.ops._c10d_functional.all_reduce.default(detach, 'sum', '0');  detach = None
        wait_tensor: "f32[4, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
        keep_history: "f32[4, 8]" = torch.ops.predispatch.keep_history.default(wait_tensor, linear);  wait_tensor = linear = None
        empty: "f32[8, 8]" = torch.ops.aten.empty.memory_format([8, 8], device = device(type='cpu'), pin_memory = False)
        detach_2: "f32[4, 8]" = torch.ops.aten.detach.default(keep_history)
        mul: "f32[4, 8]" = torch.ops.aten.mul.Tensor(detach_2, 1);  detach_2 = None
        detach_3: "f32[4, 8]" = torch.ops.aten.detach.default(mul);  mul = None
        all_gather_into_tensor: "f32[8, 8]" = torch.ops._c10d_functional.all_gather_into_tensor.default(detach_3, 2, '0');  detach_3 = None
        wait_tensor_1: "f32[8, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None
        keep_history_1: "f32[8, 8]" = torch.ops.predispatch.keep_history.default(wait_tensor_1, empty);  wait_tensor_1 = empty = None
        empty_1: "f32[2, 8]" = torch.ops.aten.empty.memory_format([2, 8], device = device(type='cpu'), pin_memory = False)
        slice_2: "f32[4, 8]" = torch.ops.aten.slice.Tensor(keep_history_1, 0, 0, 4);  keep_history_1 = None
        relu: "f32[4, 8]" = torch.ops.aten.relu.default(slice_2);  slice_2 = None
        detach_4: "f32[4, 8]" = torch.ops.aten.detach.default(relu);  relu = None
        reduce_scatter_tensor: "f32[2, 8]" = torch.ops._c10d_functional.reduce_scatter_tensor.default(detach_4, 'max', 2, '0');  detach_4 = None
        wait_tensor_2: "f32[2, 8]" = torch.ops._c10d_functional.wait_tensor.default(reduce_scatter_tensor);  reduce_scatter_tensor = None
        keep_history_2: "f32[2, 8]" = torch.ops.predispatch.keep_history.default(wait_tensor_2, empty_1);  wait_tensor_2 = empty_1 = None
        empty_2: "f32[2, 8]" = torch.ops.aten.empty.memory_format([2, 8], device = device(type='cpu'), pin_memory = False)
        empty_3: "f32[2, 8]" = torch.ops.aten.empty.memory_format([2, 8], device = device(type='cpu'), pin_memory = False)
        detach_6: "f32[2, 8]" = torch.ops.aten.detach.default(keep_history_2);  keep_history_2 = None
        all_gather_into_tensor_1: "f32[4, 8]" = torch.ops._c10d_functional.all_gather_into_tensor.default(detach_6, 2, '0');  detach_6 = None
        wait_tensor_3: "f32[4, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
        split = torch.ops.aten.split.Tensor(wait_tensor_3, 2);  wait_tensor_3 = None
        getitem: "f32[2, 8]" = split[0]
        getitem_1: "f32[2, 8]" = split[1];  split = None
        keep_history_3: "f32[2, 8]" = torch.ops.predispatch.keep_history.default(getitem, empty_2);  getitem = empty_2 = None
        keep_history_4: "f32[2, 8]" = torch.ops.predispatch.keep_history.default(getitem_1, empty_3);  getitem_1 = empty_3 = None
        detach_7: "f32[4, 8]" = torch.ops.aten.detach.default(x);  x = None
        mean: "f32[8]" = torch.ops.aten.mean.dim(detach_7, [0]);  detach_7 = None
        detach_8: "f32[8]" = torch.ops.aten.detach.default(mean)
        broadcast: "f32[8]" = torch.ops._c10d_functional.broadcast.default(detach_8, 1, '0');  detach_8 = None
        wait_tensor_4: "f32[8]" = torch.ops._c10d_functional.wait_tensor.default(broadcast);  broadcast = None
        keep_history_5: "f32[8]" = torch.ops.predispatch.keep_history.default(wait_tensor_4, mean);  wait_tensor_4 = mean = None
        cat: "f32[4, 8]" = torch.ops.aten.cat.default([keep_history_3, keep_history_4]);  keep_history_3 = keep_history_4 = None
        slice_4: "f32[4, 8]" = torch.ops.aten.slice.Tensor(keep_history, 0, 0, 4);  keep_history = None
        mul_1: "f32[4, 8]" = torch.ops.aten.mul.Tensor(cat, slice_4);  cat = slice_4 = None
        add: "f32[4, 8]" = torch.ops.aten.add.Tensor(mul_1, keep_history_5);  mul_1 = keep_history_5 = None
        sum_1: "f32[]" = torch.ops.aten.sum.default(add)
        return (add, sum_1)""")
        for result in results:
            assert result["collectives"] == {
                "all_gather_into_tensor.default": 2,
                "all_reduce.default": 1,
                "broadcast.default": 1,
                "reduce_scatter_tensor.default": 1,
                "wait_tensor.default": 5,
            }
            # the backward of a write out of autograd's sight is the identity: no collective added
            assert result["joint_collectives"] == result["collectives"]
            assert result["mutable"] == [] and result["module_unchanged"]
            assert result["calls_equal"] == [True] * 5
            assert result["joint_equal"] and result["loaded_equal"]

    def test_in_place_collectives_without_a_functional_twin_are_refused_by_name(self):
        for result in ranks("inplace_collectives_refused"):
            assert result["all_to_all"]["raised"] == "DistributedError"
            assert result["all_to_all"]["first_line"] == (
                "forward calls the in-place collective c10d.alltoall_ (torch has no functional collective for it); "
                "its schema hides the write, so a graph cannot hold it as it is."
            )
            assert "distributed_cases.py" in result["all_to_all"]["message"]  # the user's line
            assert result["premul_sum"]["raised"] == "DistributedError"
            assert "its reduction PREMUL_SUM has no functional collective" in result["premul_sum"]["first_line"]


def test_the_functional_check_knows_c10d_writes():
    # c10d's schemas declare no write (`allreduce_(Tensor[] tensors, ...)`): read from the
    # schema alone, a graph holding one passed as functional
    import torch
    from torch import fx

    from predispatch.passes import mutable_ops

    graph = fx.Graph()
    t = graph.placeholder("t")
    call = graph.call_function(torch.ops.c10d.allreduce_.default, ([t], None, None, None, False))
    graph.output(call)
    assert not torch.ops.c10d.allreduce_.default._schema.is_mutable
    assert mutable_ops(fx.GraphModule({}, graph)) == ["allreduce__default: c10d.allreduce_.default"]


class TestDistributedState(TestCase):
    def test_dtensor_state_and_fsdp2_are_refused_by_name_and_left_unchanged(self):
        # DTensor parameters were faked as plain tensors of the global shape (tensor parallelism
        # was refused with an error about torch's _FromTorchTensor; DTensor parameters without
        # hooks exported with no collective); FSDP2 failed on a FunctionalTensor's _local_tensor
        for result in ranks("distributed_state_refused"):
            for name in ("ddp", "tensor_parallel", "dtensor_parameters", "fsdp2"):
                assert result[name]["raised"] == "DistributedError", (name, result[name])
                assert result[name]["unchanged"] and result[name]["eager_runs"], name
                assert "docs/distributed.md" in result[name]["message"]
            if on_golden_torch():  # DeviceMesh's repr differs between releases
                assert result["tensor_parallel"]["first_line"] == (
                    "parameter '0.weight' is a DTensor (placements (S(0)) on DeviceMesh((2,), 'cpu', stride=(1,)), "
                    "global shape (16, 8), this rank's shard (8, 8)); export would make it a plain tensor of the "
                    "global shape with DTensor's communication lost: a program no rank runs."
                )
            assert result["dtensor_parameters"]["first_line"].startswith("parameter 'mlp.0.weight' is a DTensor")
            assert result["fsdp2"]["first_line"].startswith("the module is sharded by FSDP2 (fully_shard)")
            assert result["ddp"]["first_line"] == (
                "the module is DistributedDataParallel: it all-reduces gradients in autograd hooks of its reducer, "
                "outside forward's code, so a graph of forward cannot hold them."
            )

    def test_ddp_around_the_program_equals_ddp_around_the_model(self):
        # the fix the DDP refusal gives: DistributedDataParallel(ep.module()) all-reduces the
        # program's gradients as DDP does the model's
        for result in ranks("ddp_around_the_program"):
            assert result["equal"]

    def test_dtensor_made_in_forward_is_refused_by_name(self):
        # was an AutogradFunctionError about torch's _FromTorchTensor, with a fix about writing
        # the Function's forward, which the user cannot apply
        for result in ranks("dtensor_made_in_forward"):
            assert result["raised"] == "DistributedError"
            assert result["first_line"] == (
                "forward makes, unwraps or redistributes a DTensor (torch's _FromTorchTensor: DTensor.from_local, "
                "to_local, redistribute, full_tensor); export does not build per-rank DTensor programs yet."
            )
            assert "distributed_cases.py" in result["message"]  # the user's line

    def test_sharded_parameters_gathered_in_forward_export_per_rank(self):
        # what works instead: each rank's shard a plain parameter, gathered in forward with a
        # functional all-gather; the program holds the rank's shards, the joint reduce-scatters
        # their gradients
        results = ranks("sharded_parameters_gathered_in_forward")
        if on_golden_torch():
            self.assertExpectedInline(results[0]["graph"], """\
class GraphModule(torch.nn.Module):
    def forward(self, p_up_weight: "f32[8, 8]", p_up_bias: "f32[16]", p_down_weight: "f32[4, 16]", p_down_bias: "f32[8]", x: "f32[4, 8]"):
        all_gather_into_tensor: "f32[16, 8]" = torch.ops._c10d_functional.all_gather_into_tensor.default(p_up_weight, 2, '0');  p_up_weight = None
        wait_tensor: "f32[16, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor);  all_gather_into_tensor = None
        linear: "f32[4, 16]" = torch.ops.aten.linear.default(x, wait_tensor, p_up_bias);  x = wait_tensor = p_up_bias = None
        relu: "f32[4, 16]" = torch.ops.aten.relu.default(linear);  linear = None
        all_gather_into_tensor_1: "f32[8, 16]" = torch.ops._c10d_functional.all_gather_into_tensor.default(p_down_weight, 2, '0');  p_down_weight = None
        wait_tensor_1: "f32[8, 16]" = torch.ops._c10d_functional.wait_tensor.default(all_gather_into_tensor_1);  all_gather_into_tensor_1 = None
        linear_1: "f32[4, 8]" = torch.ops.aten.linear.default(relu, wait_tensor_1, p_down_bias);  relu = wait_tensor_1 = p_down_bias = None
        sum_1: "f32[]" = torch.ops.aten.sum.default(linear_1)
        return (linear_1, sum_1)""")
        for result in results:
            assert result["state_shapes"] == {"up.weight": [8, 8], "up.bias": [16], "down.weight": [4, 16], "down.bias": [8]}
            assert result["collectives"] == {
                "all_gather_into_tensor.default": 2,
                "wait_tensor.default": 2,
            }
            assert result["joint_collectives"] == {
                "all_gather_into_tensor.default": 2,
                "reduce_scatter_tensor.default": 2,
                "wait_tensor.default": 4,
            }
            assert result["mutable"] == []
            assert result["outputs_equal"] and result["grads_equal"]
            assert result["joint_equal"] and result["loaded_equal"]


class TestSideBySide(TestCase):
    def test_tensor_parallel_mlp_torch_joint_exporter_and_predispatch(self):
        # the tensor-parallel MLP (ColwiseParallel, RowwiseParallel): torch's joint exporter
        # unwraps each DTensor parameter to its local shard (__tensor_flatten__: `_local_tensor`
        # plus the mesh) and writes the row-wise layer's all_reduce; predispatch refuses it by
        # name until it builds per-rank programs (docs/distributed.md)
        for result in ranks("tensor_parallel_side_by_side"):
            assert result["torch_joint_collectives"] == {
                "all_reduce.default": 1,
                "wait_tensor.default": 1,
            }
            local = {desc: shape for desc, shape in result["torch_joint_inputs"] if "_local_tensor" in desc}
            assert sorted(local.values()) == [[8], [8], [8, 8], [8, 8]]  # the rank's shards
            assert result["torch_equal"]
            assert result["predispatch"] == "DistributedError"
