"""timm's vision transformers that cache attention biases in a plain dict during an eval forward.

LeViT, EfficientViT (MSRA), EfficientFormer, EfficientFormerV2 and TinyViT keep
`self.attention_bias_cache = {}` and fill it (`cache[str(device)] = biases[:, idxs]`) on every
eval-mode forward.  Exporting them used to leave tracer tensors in those dicts: the next eager
call raised "Attempting to use FunctionalTensor on its own" and a second export "Mixing fake
modes NYI".  Here each is exported, then used in eager, then exported again after eager filled
its cache with real tensors (read as lifted constants), each program against eager.

ConViT replaces a registered buffer by one of another shape in forward (`self.rel_indices =
self.get_rel_indices(N)`): export refuses it with an error naming that line.

Needs timm (`pip install --no-deps timm==1.0.31`, see tests/timm_support.py); run with `pytest -m models`.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import state_bits
from timm_support import import_timm

import predispatch
from predispatch import _torch_internals as ti

pytestmark = [
    pytest.mark.models,
    pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed"),
]


@pytest.fixture(scope="module")
def timm():
    """Imported when a test runs, not when the default suite collects this file."""
    return import_timm()

CACHING = ["levit_128s", "efficientvit_m0", "efficientformer_l1", "efficientformerv2_s0", "tiny_vit_5m_224"]


def _caches(model: torch.nn.Module) -> list[dict]:
    return [m.attention_bias_cache for m in model.modules() if hasattr(m, "attention_bias_cache")]


@pytest.mark.parametrize("name", CACHING)
def test_attention_bias_cache_left_as_found(timm, name):
    torch.manual_seed(0)
    model, x = timm.create_model(name, pretrained=False).eval(), torch.randn(1, 3, 224, 224)
    caches = _caches(model)
    assert caches and all(c == {} for c in caches)
    before = state_bits(model)
    ep = predispatch.export(model, (x,))
    assert all(c == {} for c in _caches(model)), "export left entries in the attention bias cache"
    assert {k: v.clone() for k, v in model.state_dict(keep_vars=True).items()}.keys() == before.keys()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with torch.no_grad():
        expected = model(x)  # eager after export: fills the caches with real tensors
        torch.testing.assert_close(ep.module()(x), expected)
    assert all(c and not any(ti.is_traced_tensor(t) for t in c.values()) for c in _caches(model))
    again = predispatch.export(model, (x,))  # reads the cached biases as constants
    with torch.no_grad():
        torch.testing.assert_close(again.module()(x), expected)
    assert all(len(c) == 1 for c in _caches(model))


def test_convit_buffer_of_another_shape_is_refused(timm):
    torch.manual_seed(0)
    model, x = timm.create_model("convit_tiny", pretrained=False).eval(), torch.randn(1, 3, 224, 224)
    before = state_bits(model)
    with pytest.raises(predispatch.errors.TraceError) as info:
        predispatch.export(model, (x,))
    message = str(info.value)
    assert message.startswith(
        "forward replaces buffer 'blocks.0.attn.rel_indices' (torch.float32 (1, 1, 1, 3)) by a tensor of another "
        "shape, dtype or device (torch.float32 (1, 196, 196, 3)); the program's buffer keeps its exported shape, "
        "so it cannot take the new value.\n"
    ), message
    assert "timm/models/convit.py:78 (self.rel_indices = self.get_rel_indices(N))" in message
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
