"""Programs on CUDA: autocast and no_grad regions, AMP training, moving and saving across devices.

Skipped without a GPU (CI has none); run on a machine with one:
`python -m pytest -q tests/test_cuda.py`.  Each compares with eager on the same device.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import predispatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Regions(nn.Module):
    """A float16 autocast region and a no_grad region, inside a trainable model."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)
        self.register_buffer("seen", torch.zeros(16))

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.float16):
            h = torch.relu(self.a(x))
        with torch.no_grad():
            self.seen.add_(h.float().mean(0))
            scale = h.float().abs().mean() + 1
        return self.b(h.float() / scale)


def _grads(module):
    return {name: p.grad.clone() for name, p in module.named_parameters()}


def test_autocast_and_no_grad_regions_match_eager_on_cuda():
    torch.manual_seed(0)
    eager = Regions().cuda()
    program_model = copy.deepcopy(eager)
    x = torch.randn(8, 16, device="cuda")
    ep = predispatch.export(program_model, (x,))
    names = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("wrap_with_autocast" in t for t in names) and any("wrap_with_set_grad_enabled" in t for t in names), names
    module = ep.module()
    out_e, out_p = eager(x), module(x)
    torch.testing.assert_close(out_p, out_e, rtol=0, atol=0)
    out_e.square().sum().backward()
    out_p.square().sum().backward()
    for name, grad in _grads(eager).items():
        torch.testing.assert_close(dict(module.named_parameters())[name].grad, grad, rtol=0, atol=0)
    torch.testing.assert_close(module.get_buffer("seen"), eager.seen, rtol=0, atol=0)


def test_five_amp_steps_with_grad_scaler_match_eager():
    torch.manual_seed(0)
    eager = Regions().cuda()
    trained = copy.deepcopy(eager)
    xs = [torch.randn(8, 16, device="cuda") for _ in range(5)]
    program = predispatch.export(trained, (xs[0],)).module()

    def train(model, params):
        opt = torch.optim.SGD(params, lr=0.1)
        scaler = torch.amp.GradScaler("cuda")
        for x in xs:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().square().mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return loss.detach(), scaler.get_scale()

    expected = train(eager, eager.parameters())
    actual = train(program, program.parameters())
    assert actual[1] == expected[1]
    torch.testing.assert_close(actual[0], expected[0], rtol=0, atol=0)
    for (name, p), q in zip(eager.named_parameters(), program.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


def test_program_exported_on_cpu_runs_on_cuda_after_to():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    x = torch.randn(4, 8)
    ep = predispatch.export(copy.deepcopy(model), (x,))
    module = ep.module().to("cuda")
    eager = model.to("cuda")
    torch.testing.assert_close(module(x.cuda()), eager(x.cuda()), rtol=0, atol=0)


def test_saved_on_cuda_loads_and_runs_on_cpu():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).cuda()
    x = torch.randn(4, 8, device="cuda")
    ep = predispatch.export(model, (x,))
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    buffer.seek(0)
    loaded = predispatch.load(buffer)
    module = loaded.module().to("cpu")
    torch.testing.assert_close(module(x.cpu()), model.cpu()(x.cpu()), rtol=1e-6, atol=1e-6)
