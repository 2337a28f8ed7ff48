"""Models made at a size n, for the export-scaling tests (tests/test_export_scaling.py) and
benchmark (benchmarks/export_scaling.py): each has n of something a model can have many of."""

from __future__ import annotations

import torch
from torch import nn


class Params(nn.Module):
    """`n` small parameters."""

    def __init__(self, n: int):
        super().__init__()
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(4)) for _ in range(n))


class UpdatedUnderNoGrad(Params):
    """Every parameter updated in place with grad off (an EMA), then used."""

    def forward(self, x):
        with torch.no_grad():
            for p in self.ps:
                p.mul_(0.9)
        for p in self.ps:
            x = x + p
        return x


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad * w, None


class FunctionCalls(Params):
    """A custom autograd.Function call per parameter."""

    def forward(self, x):
        for p in self.ps:
            x = Scale.apply(x, p)
        return x
