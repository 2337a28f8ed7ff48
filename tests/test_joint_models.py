"""The joint program of each Hugging Face model in train mode equals eager's gradients bitwise.

The same models as test_models.py (small configs, random weights, dropout on).  Models whose
output carries the loss (`labels` given) are joined at `loss="loss"`, the structured output
kept whole.  Wav2Vec2's CTC loss does not export (`aten._ctc_loss` has no static output
shape for the fake-tensor trace, with tensor or int lengths; test_models.py takes it outside
the program), so Wav2Vec2 is joined through a module returning a per-frame cross-entropy;
its feature encoder sets `requires_grad` on its input, so eager cannot take the input's
gradient and only the parameters' gradients are compared.  Needs the `models` extra; `pytest -m models`.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_joint import check_joint
from test_models import CASES, ModelCase, _quiet_and_deterministic  # noqa: F401 - the fixture
from torch import nn

pytestmark = pytest.mark.models


class TrainingLoss(nn.Module):
    """`model`'s training loss as its one output."""

    def __init__(self, model: nn.Module, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *args, **kwargs):
        return self.loss(self.model(*args, **kwargs))


def _frame_loss(out) -> torch.Tensor:
    logits = out.logits.flatten(0, 1)
    return F.cross_entropy(logits, torch.arange(logits.shape[0]) % logits.shape[1])


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_model_joint_matches_eager(case: ModelCase):
    torch.manual_seed(0)
    model = case.build().train()
    args, kwargs = case.inputs()
    if "labels" in kwargs:
        check_joint(model, args, kwargs, loss="loss")
    else:
        check_joint(TrainingLoss(model, _frame_loss), args, kwargs, input_grads=False)  # it sets requires_grad on its input
