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
                "_c10d_functional.all_gather_into_tensor.default": 1,
                "_c10d_functional.all_reduce.default": 1,
                "_c10d_functional.reduce_scatter_tensor.default": 1,
                "_c10d_functional.wait_tensor.default": 3,
            }
            assert result["joint_collectives"] == {
                "_c10d_functional.all_gather_into_tensor.default": 2,
                "_c10d_functional.all_reduce.default": 1,
                "_c10d_functional.reduce_scatter_tensor.default": 2,
                "_c10d_functional.wait_tensor.default": 5,
            }
            assert result["mutable"] == []
            assert result["outputs_equal"] and result["grads_equal"]
            assert result["joint_equal"] and result["loaded_equal"]
