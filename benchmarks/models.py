"""The benchmark's models: Hugging Face transformers from small configs, random weights.

The same shapes as tests/test_models.py (which also checks them against eager), in train mode
with each model's training loss in the graph (`labels` passed), as a training export sees them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers as T
from torch import nn

VOCAB = 128
DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    use_cache=False,
)


@dataclass(frozen=True)
class Bench:
    """A model and its example inputs, built fresh (seeded) on each call of `make`."""

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[tuple, dict]]

    def make(self) -> tuple[nn.Module, tuple, dict]:
        torch.manual_seed(0)
        model = self.build().train()
        args, kwargs = self.inputs()
        return model, args, kwargs


def _ids(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length))


def _lm() -> tuple[tuple, dict]:
    ids = _ids()
    return (ids,), {"labels": ids}


def _bert() -> tuple[tuple, dict]:
    ids, mask = _ids(), torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0
    return (ids,), {"attention_mask": mask, "token_type_ids": torch.zeros_like(ids), "labels": ids}


def llama(layers: int, hidden: int = 64) -> nn.Module:
    """A Llama-style decoder of `layers` layers (the depth-scaling model)."""
    config = T.LlamaConfig(**{**DECODER, "num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": 2 * hidden})
    return T.LlamaForCausalLM(config)


BENCHES = [
    Bench(
        "gpt2",
        lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                               use_cache=False, bos_token_id=0, eos_token_id=0)),
        _lm,
    ),
    Bench("llama", lambda: llama(2), _lm),
    Bench("mistral", lambda: T.MistralForCausalLM(T.MistralConfig(**DECODER, sliding_window=8)), _lm),
    Bench("qwen2", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER)), _lm),
    Bench(
        "mixtral",
        lambda: T.MixtralForCausalLM(T.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2)),
        _lm,
    ),
    Bench(
        "qwen2_moe",
        lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                                       experts_implementation="batched_mm")),
        _lm,
    ),
    Bench(
        "bert",
        lambda: T.BertForMaskedLM(T.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                               num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64)),
        _bert,
    ),
    Bench(
        "t5",
        lambda: T.T5ForConditionalGeneration(T.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2,
                                                        num_decoder_layers=2, num_heads=4, vocab_size=VOCAB,
                                                        use_cache=False, decoder_start_token_id=0)),
        lambda: ((_ids(),), {"labels": _ids(2, 8)}),
    ),
    Bench(
        "vit",
        lambda: T.ViTForImageClassification(T.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                        num_attention_heads=4, image_size=32, patch_size=8,
                                                        num_labels=10)),
        lambda: ((torch.randn(2, 3, 32, 32),), {"labels": torch.tensor([1, 7])}),
    ),
    Bench(
        "whisper",
        lambda: T.WhisperForConditionalGeneration(T.WhisperConfig(
            d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=16,
            max_target_positions=32, vocab_size=VOCAB, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
            bos_token_id=0, eos_token_id=0)),
        lambda: ((torch.randn(2, 16, 32),), {"labels": _ids(2, 8)}),
    ),
    Bench(
        "wav2vec2",
        lambda: T.Wav2Vec2ForCTC(T.Wav2Vec2Config(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, conv_dim=(32, 32),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
            vocab_size=VOCAB, layerdrop=0.0, mask_time_prob=0.0)),
        lambda: ((torch.randn(2, 800),), {}),
    ),
]


#: For forward time only: a width where compute, not Python overhead, dominates a call.
WIDE = Bench(
    "llama-wide (hidden 512, 4 layers, 2x128 tokens)",
    lambda: llama(4, hidden=512),
    lambda: ((torch.randint(0, VOCAB, (2, 128)),), {"labels": torch.randint(0, VOCAB, (2, 128))}),
)
