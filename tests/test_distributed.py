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
    def test_ddp_fsdp2_and_dtensor_inputs_and_outputs_are_refused_by_name_and_left_unchanged(self):
        # FSDP2 failed on a FunctionalTensor's _local_tensor; per-rank DTensor programs take and
        # return plain tensors: a DTensor input or output is refused, not exported wrong
        for result in ranks("distributed_state_refused"):
            for name in ("ddp", "fsdp2", "dtensor_output", "dtensor_input", "preserve", "dropout", "view_output"):
                assert result[name]["raised"] == "DistributedError", (name, result[name])
                assert result[name]["unchanged"] and result[name]["eager_runs"], name
                assert "docs/distributed.md" in result[name]["message"]
            assert result["fsdp2"]["first_line"].startswith("the module is sharded by FSDP2 (fully_shard)")
            assert result["ddp"]["first_line"] == (
                "the module is DistributedDataParallel: it all-reduces gradients in autograd hooks of its reducer, "
                "outside forward's code, so a graph of forward cannot hold them."
            )
            assert result["dtensor_output"]["first_line"] == (
                "an output of forward is a DTensor; per-rank DTensor programs take and return plain tensors "
                "(the rank's values)."
            )
            assert result["view_output"]["first_line"].startswith(
                "the rank's forward returns output 1, a view of an input or of another output"
            )
            assert result["dropout"]["first_line"].startswith("the rank's forward draws random numbers (aten.")
            assert result["preserve"]["first_line"].startswith("preserve= / decompose= (aten.linear) with DTensor state")
            assert result["dtensor_input"]["first_line"] == (
                "tensor input 0 is a DTensor; per-rank DTensor programs take and return plain tensors (the rank's values)."
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
                "to_local, redistribute, full_tensor) from plain state; per-rank DTensor programs are built for "
                "models whose parameters or buffers are DTensors."
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


class TestPerRankDTensor(TestCase):
    """Models with DTensor state export per rank (Note [Per-rank DTensor programs]): the state is
    the rank's shards, forward and DTensor's backward (torch's partitioned joint) are one
    autograd_function_apply, and every rank's program equals the eager parallel model.  These
    were refused by name before (tensor parallelism first as an error about torch's
    _FromTorchTensor; DTensor parameters without hooks first exported with the global shapes)."""

    def check_equal_on_every_rank(self, results: list[dict]) -> None:
        for result in results:
            assert result["mutable"] == [] and result["module_unchanged"]
            assert result["outputs_equal"] and result["grads_equal"], result
            assert result["joint_equal"] and result["input_grad_equal"], result
            assert result["joint_loaded_equal"]  # the joint is one flat graph: it always saves

    def test_tensor_parallel_mlp(self):
        results = ranks("tensor_parallel_mlp_per_rank")
        if on_golden_torch():
            self.assertExpectedInline(results[0]["graph"], """\
class GraphModule(torch.nn.Module):
    def forward(self, p_inner_0_weight: "f32[8, 8]", p_inner_0_bias: "f32[8]", p_inner_2_weight: "f32[8, 8]", p_inner_2_bias: "f32[8]", x: "f32[4, 8]"):
        per_rank_step_fwd_0 = self.per_rank_step_fwd_0
        per_rank_step_bwd_0 = self.per_rank_step_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(per_rank_step_fwd_0, per_rank_step_bwd_0, p_inner_0_weight, p_inner_0_bias, p_inner_2_weight, p_inner_2_bias, x, non_differentiable_idx = [], saved_for_backward_idx = [0, 1, 2, 3, 4]);  per_rank_step_fwd_0 = per_rank_step_bwd_0 = p_inner_0_weight = p_inner_0_bias = p_inner_2_weight = p_inner_2_bias = x = None
        view_3: "f32[4, 8]" = autograd_function_apply[0]
        sum_1: "f32[]" = autograd_function_apply[1];  autograd_function_apply = None
        return (view_3, sum_1)

    class per_rank_step_fwd_0(torch.nn.Module):
        def forward(self, args_1: "f32[8, 8]", args_2: "f32[8]", args_3: "f32[8, 8]", args_4: "f32[8]", args_5: "f32[4, 8]"):
            view: "f32[4, 8]" = torch.ops.aten.view.default(args_5, [4, 8]);  args_5 = None
            t: "f32[8, 8]" = torch.ops.aten.t.default(args_1);  args_1 = None
            addmm: "f32[4, 8]" = torch.ops.aten.addmm.default(args_2, view, t);  args_2 = None
            view_1: "f32[4, 8]" = torch.ops.aten.view.default(addmm, [4, 8]);  addmm = None
            relu: "f32[4, 8]" = torch.ops.aten.relu.default(view_1);  view_1 = None
            detach: "f32[4, 8]" = torch.ops.aten.detach.default(relu)
            view_2: "f32[4, 8]" = torch.ops.aten.view.default(relu, [4, 8]);  relu = None
            t_1: "f32[8, 8]" = torch.ops.aten.t.default(args_3);  args_3 = None
            div: "f32[8]" = torch.ops.aten.div.Tensor(args_4, 2);  args_4 = None
            addmm_1: "f32[4, 8]" = torch.ops.aten.addmm.default(div, view_2, t_1);  div = None
            all_reduce: "f32[4, 8]" = torch.ops._c10d_functional.all_reduce.default(addmm_1, 'sum', '0');  addmm_1 = None
            wait_tensor: "f32[4, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
            view_3: "f32[4, 8]" = torch.ops.aten.view.default(wait_tensor, [4, 8]);  wait_tensor = None
            sum_1: "f32[]" = torch.ops.aten.sum.default(view_3)
            return ((view_3, sum_1), (view, t, detach, view_2, t_1))

    class per_rank_step_bwd_0(torch.nn.Module):
        def forward(self, grad_out_0: "f32[4, 8]", grad_out_1: "f32[]", saved_0: "f32[4, 8]", saved_1: "f32[8, 8]", saved_2: "f32[4, 8]", saved_3: "f32[4, 8]", saved_4: "f32[8, 8]"):
            expand: "f32[4, 8]" = torch.ops.aten.expand.default(grad_out_1, [4, 8]);  grad_out_1 = None
            add: "f32[4, 8]" = torch.ops.aten.add.Tensor(grad_out_0, expand);  grad_out_0 = expand = None
            view: "f32[4, 8]" = torch.ops.aten.view.default(add, [4, 8]);  add = None
            t: "f32[8, 8]" = torch.ops.aten.t.default(saved_4);  saved_4 = None
            mm: "f32[4, 8]" = torch.ops.aten.mm.default(view, t);  t = None
            t_1: "f32[8, 4]" = torch.ops.aten.t.default(view)
            mm_1: "f32[8, 8]" = torch.ops.aten.mm.default(t_1, saved_3);  t_1 = saved_3 = None
            t_2: "f32[8, 8]" = torch.ops.aten.t.default(mm_1);  mm_1 = None
            sum_1: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(view, [0], True);  view = None
            view_1: "f32[8]" = torch.ops.aten.view.default(sum_1, [8]);  sum_1 = None
            t_3: "f32[8, 8]" = torch.ops.aten.t.default(t_2);  t_2 = None
            detach: "f32[4, 8]" = torch.ops.aten.detach.default(saved_2);  saved_2 = None
            threshold_backward: "f32[4, 8]" = torch.ops.aten.threshold_backward.default(mm, detach, 0);  mm = detach = None
            view_2: "f32[4, 8]" = torch.ops.aten.view.default(threshold_backward, [4, 8]);  threshold_backward = None
            t_4: "f32[8, 8]" = torch.ops.aten.t.default(saved_1);  saved_1 = None
            mm_2: "f32[4, 8]" = torch.ops.aten.mm.default(view_2, t_4);  t_4 = None
            t_5: "f32[8, 4]" = torch.ops.aten.t.default(view_2)
            mm_3: "f32[8, 8]" = torch.ops.aten.mm.default(t_5, saved_0);  t_5 = saved_0 = None
            t_6: "f32[8, 8]" = torch.ops.aten.t.default(mm_3);  mm_3 = None
            sum_2: "f32[1, 8]" = torch.ops.aten.sum.dim_IntList(view_2, [0], True);  view_2 = None
            view_3: "f32[8]" = torch.ops.aten.view.default(sum_2, [8]);  sum_2 = None
            t_7: "f32[8, 8]" = torch.ops.aten.t.default(t_6);  t_6 = None
            all_reduce: "f32[4, 8]" = torch.ops._c10d_functional.all_reduce.default(mm_2, 'sum', '0');  mm_2 = None
            wait_tensor: "f32[4, 8]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce);  all_reduce = None
            return (t_7, view_3, t_3, view_1, wait_tensor)""")
            self.assertExpectedInline(results[0]["signature"], """\
Inputs:
    p_inner_0_weight: PARAMETER target='inner.0.weight'
    p_inner_0_bias: PARAMETER target='inner.0.bias'
    p_inner_2_weight: PARAMETER target='inner.2.weight'
    p_inner_2_bias: PARAMETER target='inner.2.bias'
    x: USER_INPUT target='x'
Outputs:
    view_3: USER_OUTPUT target='output[0]'
    sum_1: USER_OUTPUT target='output[1]'
Placements (the state is this rank's shard):
    inner.0.weight: (Shard(dim=0)) on cpu mesh (2,) ranks [0, 1], global [16, 8], local [8, 8]
    inner.0.bias: (Shard(dim=0)) on cpu mesh (2,) ranks [0, 1], global [16], local [8]
    inner.2.weight: (Shard(dim=1)) on cpu mesh (2,) ranks [0, 1], global [8, 16], local [8, 8]
    inner.2.bias: (Replicate()) on cpu mesh (2,) ranks [0, 1], global [8], local [8]""")
        self.check_equal_on_every_rank(results)
        for result in results:
            assert result["state_shapes"] == {"inner.0.weight": [8, 8], "inner.0.bias": [8], "inner.2.weight": [8, 8], "inner.2.bias": [8]}
            # forward: the row-wise layer's Partial -> Replicate all-reduce; backward: the input
            # gradient's (the column-wise layer's Replicate input), none for the row-wise output
            assert result["forward_collectives"] == {"all_reduce.default": 1, "wait_tensor.default": 1}
            assert result["backward_collectives"] == {"all_reduce.default": 1, "wait_tensor.default": 1}
            assert result["joint_collectives"] == {"all_reduce.default": 2, "wait_tensor.default": 2}
            assert result["save"]["raised"] is None and result["loaded_equal"] and result["loaded_placements"]

    def test_tensor_parallel_transformer_block(self):
        # attention (q, k, v column-wise, o row-wise) and the MLP under parallelize_module; the
        # layer norms are plain parameters beside the DTensors
        results = ranks("tensor_parallel_block_per_rank")
        self.check_equal_on_every_rank(results)
        for result in results:
            shapes = result["state_shapes"]
            assert shapes["inner.q.weight"] == [8, 16] and shapes["inner.o.weight"] == [16, 8] and shapes["inner.norm1.weight"] == [16]
            assert result["forward_collectives"] == {"all_reduce.default": 2, "wait_tensor.default": 2}
            assert result["backward_collectives"] == {"all_reduce.default": 4, "wait_tensor.default": 4}
            # the backward subgraph's layer-norm and attention backwards read statistics the
            # forward subgraph saved: the file format proves them through the pair (FunctionPair)
            assert result["save"]["raised"] is None and result["loaded_equal"] and result["loaded_placements"]

    def test_dtensor_parameters_and_buffers_without_parallelize_hooks(self):
        # distribute_tensor parameters, DTensor.from_local of the input and full_tensor() of the
        # output in forward: DTensor's dispatch decides the communication; a Shard(0) DTensor
        # buffer gathered in forward and a plain non-persistent buffer beside them (buffers get
        # no gradient in torch's joint: a gradient matched by position went to the wrong input)
        results = ranks("dtensor_parameters_per_rank")
        self.check_equal_on_every_rank(results)
        for result in results:
            assert result["state_shapes"] == {"inner.mlp.0.weight": [8, 8], "inner.mlp.0.bias": [8], "inner.mlp.2.weight": [8, 8],
                                              "inner.mlp.2.bias": [8], "inner.scale": [4], "inner.offset": [8]}
            assert result["forward_collectives"] == {"all_gather_into_tensor.default": 1, "all_reduce.default": 1, "wait_tensor.default": 2}
            assert result["backward_collectives"] == {"all_reduce.default": 1, "wait_tensor.default": 1}
            assert result["save"]["raised"] is None and result["loaded_equal"] and result["loaded_placements"]

    def test_simple_fsdp_with_dtensor_parameters(self):
        # SimpleFSDP's form: Shard(0) DTensor parameters gathered for compute by a
        # parametrization; the backward reduce-scatters (averages) each gradient; inputs differ
        # between ranks
        results = ranks("simple_fsdp_per_rank")
        self.check_equal_on_every_rank(results)
        for result in results:
            assert result["state_shapes"]["inner.2.parametrizations.weight.original"] == [4, 16]
            assert result["forward_collectives"] == {"all_gather_into_tensor.default": 4, "wait_tensor.default": 4}
            assert result["backward_collectives"] == {"reduce_scatter_tensor.default": 4, "wait_tensor.default": 4}
            assert result["save"]["raised"] is None and result["loaded_equal"] and result["loaded_placements"]


class TestSideBySide(TestCase):
    def test_tensor_parallel_mlp_torch_joint_exporter_and_predispatch(self):
        # the tensor-parallel MLP (ColwiseParallel, RowwiseParallel), the input requiring grad:
        # torch's joint exporter unwraps each DTensor parameter to its local shard
        # (__tensor_flatten__: `_local_tensor` plus the mesh); predispatch's program holds the
        # same shards and, in its joint, the same collectives (it was refused by name before)
        for result in ranks("tensor_parallel_side_by_side"):
            assert result["torch_joint_collectives"] == {"all_reduce.default": 2, "wait_tensor.default": 2}
            local = {desc: shape for desc, shape in result["torch_joint_inputs"] if "_local_tensor" in desc}
            assert sorted(local.values()) == [[8], [8], [8, 8], [8, 8]]  # the rank's shards
            assert result["torch_equal"]
            assert result["predispatch_joint_collectives"] == result["torch_joint_collectives"]
            assert result["predispatch_state_shapes"] == sorted(local.values())
            assert result["predispatch_equal"] and result["predispatch_joint_equal"]
