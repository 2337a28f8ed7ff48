"""The joint program of each Hugging Face model in train mode equals eager's gradients bitwise.

The same models as test_models.py (small configs, random weights, dropout on).  Models whose
output carries the loss (`labels` given) are joined at `loss="loss"`, the structured output
kept whole; Wav2Vec2's CTC loss is taken outside the model (test_models.py says why), so it
is joined through a module returning that scalar.  Needs the `models` extra; `pytest -m models`.
"""

from __future__ import annotations

import pytest
import torch
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


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_model_joint_matches_eager(case: ModelCase):
    torch.manual_seed(0)
    model = case.build().train()
    args, kwargs = case.inputs()
    if "labels" in kwargs:
        check_joint(model, args, kwargs, loss="loss")
    else:
        check_joint(TrainingLoss(model, case.loss), args, kwargs)
