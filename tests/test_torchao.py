"""torchao-quantized models: their weights are tensor subclasses, taken apart and traced through
(Note [Tensor subclasses] in predispatch/frontend/subclasses.py).

Every config torchao 0.18 runs on CPU, on an MLP and a Llama-style decoder: the program's graph
holds plain tensors only, `ep.module()` holds the model's own quantized weights and equals eager
bitwise on the example and on other inputs; QAT (`QATConfig(..., step="prepare")`, train mode)
trains: `ep.module()`'s and `ep.joint()`'s gradients equal eager's.  Needs the `consumers` extra.
"""

from __future__ import annotations

import copy

import pytest
import torch

import predispatch
from predispatch.frontend.subclasses import is_subclass
from predispatch.passes import mutable_ops

from helpers import assert_verified
from subclass_cases import TinyLlama

pytestmark = pytest.mark.consumers

torchao = pytest.importorskip("torchao")
from torchao.quantization import (  # noqa: E402
    Float8WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8DynamicActivationIntxWeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
    quantize_,
)
from torchao.quantization.qat import QATConfig  # noqa: E402

CONFIGS = {
    "int8_weight_only": Int8WeightOnlyConfig,
    "int8_dynamic_activation": Int8DynamicActivationInt8WeightConfig,
    "intx_weight_only": IntxWeightOnlyConfig,
    "8da4w": lambda: Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4),
    "float8_weight_only": Float8WeightOnlyConfig,
}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(64, 128)
        self.down = torch.nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _case(model: str) -> tuple[torch.nn.Module, tuple, tuple]:
    """A model, its example input, another input."""
    if model == "mlp":
        return MLP(), (torch.randn(4, 64),), (torch.randn(4, 64) * 2,)
    return TinyLlama(), (torch.randint(0, 64, (2, 8)),), (torch.randint(0, 64, (2, 8)),)


def _check_plain(ep: predispatch.ExportedProgram) -> None:
    assert mutable_ops(ep.graph_module) == []
    assert_verified(ep)
    for node in ep.graph.nodes:
        value = node.meta.get("val")
        assert not (isinstance(value, torch.Tensor) and is_subclass(value)), node


@pytest.mark.parametrize("model", ["mlp", "llama"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_quantized_model_exports_and_runs_as_eager(model, config):
    m, example, other = _case(model)
    m.eval()
    quantize_(m, CONFIGS[config]())
    quantized = {name for name, p in m.named_parameters() if is_subclass(p)}
    assert quantized, "quantize_ made no tensor subclass weights"
    ep = predispatch.export(m, example)
    _check_plain(ep)
    assert {target for target, _ in ep.signature.subclass_state} == quantized
    program = ep.module()
    for name in quantized:  # the model's own quantized tensors, not copies
        assert program.get_parameter(name) is m.get_parameter(name)
    with torch.no_grad():
        for args in (example, other):
            torch.testing.assert_close(program(*args), m(*args), rtol=0, atol=0)


@pytest.mark.parametrize("model", ["mlp", "llama"])
def test_qat_prepared_model_trains_as_eager(model):
    m, example, _ = _case(model)
    m.train()
    quantize_(m, QATConfig(Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4), step="prepare"))
    eager = copy.deepcopy(m)
    ep = predispatch.export(m, example)
    _check_plain(ep)
    expected, actual = eager(*example), ep.module()(*example)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    expected.float().sum().backward()
    actual.float().sum().backward()
    for (name, e), p in zip(eager.named_parameters(), m.parameters()):
        torch.testing.assert_close(p.grad, e.grad, rtol=0, atol=0, msg=name)

    class Loss(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *args):
            return self.inner(*args).float().sum()

    joint = predispatch.export(Loss(m), example).joint()
    _check_plain(joint)
    loss, grads = joint.module()(*example)
    torch.testing.assert_close(loss, expected.float().sum(), rtol=0, atol=0)
    for name, e in eager.named_parameters():
        torch.testing.assert_close(grads[f"inner.{name}"], e.grad, rtol=0, atol=0, msg=name)
