"""Hugging Face transformers models, from small configs with random weights, against eager.

Every model is exported in eval and in train mode.  The program's outputs, and the gradients
of every parameter under a training loss (the model's own, from `labels`, except for
Wav2Vec2), must equal eager's bitwise.  Train mode keeps each config's dropout: eager and the
program run from the same RNG seed, so the check also pins that the program draws its random
numbers (dropout masks) in eager's order.

Models whose parameters live on the `meta` device export without materializing weights; the
7-billion-parameter Llama shape is exported in a subprocess whose peak memory is measured.

Needs the `models` extra; run with `pytest -m models`.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from helpers import assert_same_tree, graph, state_bits
from test_one_pass import both_ways
from torch import nn

import predispatch
from predispatch.passes import mutable_ops

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.models

VOCAB = 128
#: Width and depth shared by the decoder-only language models.
DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    use_cache=False,  # a KV cache object is an inference-time output, not a training one
    attention_dropout=0.1,  # defaults to 0; on, so that train mode runs dropout inside SDPA
)


def _ids(batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length))


def _lm_inputs() -> tuple[tuple, dict]:
    ids = _ids()
    return (ids,), {"labels": ids}


def _bert_inputs() -> tuple[tuple, dict]:
    ids, mask = _ids(), torch.ones(2, 16, dtype=torch.long)
    mask[1, 10:] = 0  # the second sequence is padded
    labels = torch.where(torch.rand(2, 16) < 0.3, ids, -100)
    return (ids,), {"attention_mask": mask, "token_type_ids": torch.zeros_like(ids), "labels": labels}


def _t5_inputs() -> tuple[tuple, dict]:
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, 12:] = 0
    return (_ids(),), {"attention_mask": mask, "labels": _ids(2, 8)}


def _vit_inputs() -> tuple[tuple, dict]:
    return (torch.randn(2, 3, 32, 32),), {"labels": torch.tensor([1, 7])}


def _whisper_inputs() -> tuple[tuple, dict]:
    return (torch.randn(2, 16, 32),), {"labels": _ids(2, 8)}


def _wav2vec2_inputs() -> tuple[tuple, dict]:
    return (torch.randn(2, 800),), {}


def _ctc_loss(out: Any) -> torch.Tensor:
    """Wav2Vec2ForCTC's own loss starts with `if labels.max() >= vocab_size: raise`, a branch on
    a tensor's value (data-dependent, not exportable); the same CTC loss is taken outside."""
    log_probs = out.logits.log_softmax(-1).transpose(0, 1)
    frames, batch = log_probs.shape[:2]
    targets = torch.arange(1, 11).reshape(batch, 5)
    return F.ctc_loss(log_probs, targets, torch.full((batch,), frames), torch.full((batch,), 5))


@dataclass(frozen=True)
class ModelCase:
    """One model to export.

    name: the test id.
    build: makes the model (random weights, seeded by the caller).
    inputs: makes `(args, kwargs)`; kwargs carry `labels` so the output has a `loss`.
    loss: the training loss, from the model's output.
    xfail: mode ("eval"/"train") -> why that mode is expected to fail.
    """

    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[tuple, dict]]
    loss: Callable[[Any], torch.Tensor] = lambda out: out.loss
    xfail: dict[str, str] = field(default_factory=dict)


def _cases() -> list[ModelCase]:
    T = transformers
    return [
        ModelCase(
            "gpt2",
            lambda: T.GPT2LMHeadModel(
                T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                             use_cache=False, bos_token_id=0, eos_token_id=0)
            ),
            _lm_inputs,
        ),
        ModelCase("llama", lambda: T.LlamaForCausalLM(T.LlamaConfig(**DECODER)), _lm_inputs),
        ModelCase("mistral", lambda: T.MistralForCausalLM(T.MistralConfig(**DECODER, sliding_window=8)), _lm_inputs),
        ModelCase("qwen2", lambda: T.Qwen2ForCausalLM(T.Qwen2Config(**DECODER)), _lm_inputs),
        # Mixture of experts: the router's auxiliary loss is part of `loss`.  Mixtral runs its
        # experts through transformers' default `grouped_mm` (a custom op with its own
        # autograd); Qwen2-MoE through `batched_mm` (plain bmm over gathered expert weights).
        # Their `eager` experts loop over `nonzero()` hits: data-dependent, not exportable.
        ModelCase(
            "mixtral",
            lambda: T.MixtralForCausalLM(
                T.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
            ),
            _lm_inputs,
        ),
        ModelCase(
            "qwen2_moe",
            lambda: T.Qwen2MoeForCausalLM(
                T.Qwen2MoeConfig(**DECODER, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 shared_expert_intermediate_size=64, output_router_logits=True,
                                 experts_implementation="batched_mm")
            ),
            _lm_inputs,
        ),
        ModelCase(
            "bert",
            lambda: T.BertForMaskedLM(
                T.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             vocab_size=VOCAB, max_position_embeddings=64)
            ),
            _bert_inputs,
        ),
        ModelCase(
            "t5",
            lambda: T.T5ForConditionalGeneration(
                T.T5Config(d_model=64, d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4,
                           vocab_size=VOCAB, use_cache=False, decoder_start_token_id=0)
            ),
            _t5_inputs,
        ),
        ModelCase(
            "vit",
            lambda: T.ViTForImageClassification(
                T.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            image_size=32, patch_size=8, num_labels=10)
            ),
            _vit_inputs,
        ),
        ModelCase(
            "whisper",
            lambda: T.WhisperForConditionalGeneration(
                T.WhisperConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                num_mel_bins=16, max_source_positions=16, max_target_positions=32,
                                vocab_size=VOCAB, use_cache=False, decoder_start_token_id=0, pad_token_id=0,
                                bos_token_id=0, eos_token_id=0)
            ),
            _whisper_inputs,
        ),
        # LayerDrop (`layerdrop`) decides per layer with `if torch.rand([]) < p`: a branch on a
        # random value, which no tracer can capture; SpecAugment (`mask_time_prob`) draws its
        # masks with numpy, which a trace would bake in as constants.  Both are off.
        ModelCase(
            "wav2vec2",
            lambda: T.Wav2Vec2ForCTC(
                T.Wav2Vec2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 conv_dim=(32, 32), conv_stride=(5, 2), conv_kernel=(10, 3),
                                 num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, vocab_size=VOCAB,
                                 layerdrop=0.0, mask_time_prob=0.0, ctc_loss_reduction="mean")
            ),
            _wav2vec2_inputs,
            _ctc_loss,
        ),
    ]


CASES = _cases()


@pytest.fixture(autouse=True)
def _quiet_and_deterministic():
    """Deterministic kernels: eager's own backward of `weight[index]` (index_put with
    accumulate) sums in a varying order on CPU, which would make bitwise checks flaky."""
    verbosity = transformers.logging.get_verbosity()
    deterministic = torch.are_deterministic_algorithms_enabled()
    transformers.logging.set_verbosity_error()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(deterministic)
    transformers.logging.set_verbosity(verbosity)


def _params(cases: list[ModelCase]):
    for case in cases:
        for mode in ("eval", "train"):
            marks = [pytest.mark.xfail(reason=case.xfail[mode], strict=True)] if mode in case.xfail else []
            yield pytest.param(case, mode, id=f"{case.name}-{mode}", marks=marks)


@pytest.mark.parametrize("case, mode", list(_params(CASES)))
def test_model(case: ModelCase, mode: str):
    torch.manual_seed(0)
    model = case.build().train(mode == "train")
    args, kwargs = case.inputs()
    eager = copy.deepcopy(model)
    before = state_bits(model)

    ep = predispatch.export(model, args, kwargs)

    assert mutable_ops(ep.graph_module) == []
    assert_same_tree(state_bits(model), before)
    program = ep.module()
    assert program.state_dict().keys() == model.state_dict().keys()
    _assert_matches_eager(case, eager, program, args, kwargs)


@pytest.mark.parametrize("case, mode", list(_params(CASES)))
def test_same_program_as_aot_export_module(case: ModelCase, mode: str, monkeypatch):
    """The one-pass trace prints the program AOTAutograd's export entry point gives (test_one_pass.py)."""
    torch.manual_seed(0)
    model = case.build().train(mode == "train")
    args, kwargs = case.inputs()
    one_pass, reference = both_ways(model, args, monkeypatch, kwargs)
    assert one_pass == reference


def _run(module: nn.Module, args: tuple, kwargs: dict, seed: int = 1) -> Any:
    """Call on fresh clones of the inputs, from a fixed RNG seed (dropout draws the same masks)."""
    args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
    torch.manual_seed(seed)
    return module(*args, **kwargs)


# ---- parameters on the meta device --------------------------------------------------------------


def _meta_llama() -> tuple[Callable[[], nn.Module], tuple]:
    config = transformers.LlamaConfig(**{**DECODER, "attention_dropout": 0.0})
    return (lambda: transformers.LlamaForCausalLM(config)), (_ids(),)


def _meta_vit() -> tuple[Callable[[], nn.Module], tuple]:
    config = transformers.ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, image_size=32, patch_size=8, num_labels=10)
    return (lambda: transformers.ViTForImageClassification(config)), (torch.randn(2, 3, 32, 32),)


META_MODELS = {"llama": _meta_llama, "vit": _meta_vit}


def _real_and_meta(name: str) -> tuple[nn.Module, nn.Module, tuple]:
    """A small model with random weights, the same model built on the meta device, and inputs."""
    torch.manual_seed(0)
    build, args = META_MODELS[name]()
    real = build().eval()
    with torch.device("meta"):
        meta = build().eval()
    return real, meta, args


@pytest.mark.parametrize("name", [pytest.param("llama"), pytest.param("vit")])
def test_meta_model_exports_without_weights(name: str):
    """A meta model exports to a program with the real model's signature, holding no storage."""
    real, meta, args = _real_and_meta(name)

    ep = predispatch.export(meta, args)

    assert all(t.is_meta for t in ep.state_dict.values())
    assert all(t.is_meta for t in ep.module().state_dict().values())
    assert ep.signature == predispatch.export(real, args).signature


@pytest.mark.parametrize("name", list(META_MODELS))
def test_meta_model_graph_equals_real_models(name: str):
    real, meta, args = _real_and_meta(name)
    assert graph(predispatch.export(meta, args)) == graph(predispatch.export(real, args))


@pytest.mark.parametrize("assign", [True, False], ids=["assign", "to_empty-copy"])
@pytest.mark.parametrize("name", list(META_MODELS))
def test_meta_model_runs_with_loaded_weights(name: str, assign: bool):
    """The program takes the real weights through load_state_dict and then computes as the real model."""
    real, meta, args = _real_and_meta(name)
    program = predispatch.export(meta, args).module()

    if assign:
        program.load_state_dict(real.state_dict(), assign=True)
    else:
        program.to_empty(device="cpu")
        program.load_state_dict(real.state_dict())
    _load_non_persistent_buffers(program, real)

    assert_same_tree(program(*args), real(*args))


def _load_non_persistent_buffers(program: nn.Module, real: nn.Module) -> None:
    """Non-persistent buffers (Llama's rotary `inv_freq`) are not in a state_dict: set them by hand.

    On a meta model they are meta too; transformers' `from_pretrained` recomputes them.
    """
    saved = real.state_dict()
    for name, buffer in real.named_buffers():
        if name not in saved:
            owner, _, attr = name.rpartition(".")
            setattr(program.get_submodule(owner), attr, buffer.clone())


_EXPORT_7B = textwrap.dedent(
    """
    import json, resource, sys, torch, transformers, predispatch
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(use_cache=False)).eval()
    ep = predispatch.export(model, (torch.randint(0, 32000, (1, 128)),))
    print(json.dumps({
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": sum(1 for n in ep.graph.nodes if "self_attn_q_proj_weight" in n.name),
        "meta": all(t.is_meta for t in ep.state_dict.values()),
        "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }))
    """
)


def test_meta_llama_7b_exports_in_little_memory():
    """LlamaConfig's defaults (hidden 4096, 32 layers): 6.7 billion parameters, never materialized."""
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT_7B], capture_output=True, text=True, check=True
    )
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["parameters"] > 6.5e9
    assert report["layers"] == 32
    assert report["meta"]
    assert report["max_rss_kib"] < 4 * 1024 * 1024, report


# ---- repeated layers shared (trace/dedup/) ---------------------------------------------------

DEEP = 5


def _deepen(model: nn.Module, depth: int = DEEP) -> nn.Module:
    """`model` with each list of identical layers grown to `depth` layers: copies of the last
    one with fresh random weights (so a replay reading the wrong layer's weights shows), their
    `layer_idx` set, and the config's layer counts (and `layer_types`) grown to match."""
    for lists in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
        layers = list(lists)
        if len(layers) < 2 or len({type(layer) for layer in layers}) != 1:
            continue
        for index in range(len(layers), depth):
            layer = copy.deepcopy(layers[-1])
            with torch.no_grad():
                for p in layer.parameters():
                    p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 and "norm" in type(layer).__name__.lower() else 0.0))
            for sub in layer.modules():
                if isinstance(getattr(sub, "layer_idx", None), int):
                    sub.layer_idx = index
            lists.append(layer)
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}.values():
        for name, value in list(vars(config).items()):
            if "layers" in name and value == 2:
                setattr(config, name, depth)
        if isinstance(getattr(config, "layer_types", None), list):
            config.layer_types = config.layer_types + config.layer_types[-1:] * (depth - len(config.layer_types))
    return model


@pytest.mark.parametrize("case, mode", list(_params(CASES)))
def test_deep_model_shares_layers_and_equals_eager(case: ModelCase, mode: str):
    """Five layers a list: the third to fifth replay the first's body; forward, loss and gradients
    are eager's bitwise.  The report says which blocks are not shared and why."""
    torch.manual_seed(0)
    model = _deepen(case.build()).train(mode == "train")
    args, kwargs = case.inputs()
    eager = copy.deepcopy(model)
    ep = predispatch.export(model, args, kwargs)
    program = ep.module()
    _assert_matches_eager(case, eager, program, args, kwargs)
    replayed = [path for report in ep.graph_module.meta["dedup"] for path in report.replayed]
    assert replayed, [r for r in ep.graph_module.meta["dedup"]]


def _assert_matches_eager(case, eager, program, args, kwargs) -> None:
    """Outputs bitwise eager's, and after the case's loss, every parameter's gradient too."""
    expected = _run(eager, args, kwargs)
    actual = _run(program, args, kwargs)
    assert_same_tree(actual, expected)
    case.loss(expected).backward()
    case.loss(actual).backward()
    named = dict(program.named_parameters())
    for name, param in eager.named_parameters():
        assert_same_tree(named[name].grad, param.grad)


# ---- the KV cache (use_cache=True, the default of generation models)


def _gpt2(use_cache: bool) -> nn.Module:
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64,
                                     use_cache=use_cache, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_with_its_default_cache_returns_the_cache():
    """GPT-2's `DynamicCache` is exported as a pytree (transformers' own flattening): the
    program returns a `DynamicCache` equal to eager's, and a second step can use it."""
    model, ids = _gpt2(use_cache=True), _ids(1, 8)
    program = predispatch.export(model, (ids,)).module()
    out, expected = program(ids), model(ids)
    assert type(out.past_key_values) is type(expected.past_key_values)
    assert_same_tree(out.logits, expected.logits)
    for got, want in zip(out.past_key_values.layers, expected.past_key_values.layers):
        assert_same_tree((got.keys, got.values), (want.keys, want.values))


def test_inference_lowering_of_the_default_cache_names_use_cache_false():
    """GPT-2's default `DynamicCache` builds `torch.tensor([])` per layer in forward; torch's
    inference lowering (`run_decompositions`, under `to_torch(for_inference=True)` and
    `to_onnx()`) makes new constants of them that torch's verifier refuses, on torch.export's own
    program too.  Ours is refused by name, and its fix (`use_cache=False`) lowers, equal to eager."""
    model, ids = _gpt2(use_cache=True), _ids(1, 8)
    ep = predispatch.export(model, (ids,))
    try:
        lowered = ep.to_torch(for_inference=True)
    except predispatch.errors.NotRepresentableError as refused:  # torch 2.11-2.14
        assert "use_cache=False" in str(refused) and "lifted_tensor" in str(refused.torch_error)
    else:  # torch 2.15 lowers it: then it computes eager's logits
        with torch.no_grad():
            torch.testing.assert_close(lowered.module()(ids).logits, model(ids).logits)
    fixed = predispatch.export(model, (ids,), {"use_cache": False}).to_torch(for_inference=True)
    with torch.no_grad():
        torch.testing.assert_close(fixed.module()(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_a_cache_other_than_dynamic_cache_says_use_cache_false():
    model, ids = _gpt2(use_cache=True), _ids(1, 8)
    cache = transformers.EncoderDecoderCache(transformers.DynamicCache(), transformers.DynamicCache())
    with pytest.raises(predispatch.errors.UnsupportedInputError) as info:
        predispatch.export(model, (ids,), {"past_key_values": cache})
    assert "pass use_cache=False" in str(info.value) and "EncoderDecoderCache is the model's key/value cache" in str(info.value)


def test_cli_shows_a_saved_gpt2_program_without_importing_its_classes(tmp_path):
    """A shell user's `predispatch show` displays a saved GPT-2 program (its output classes from
    `transformers.modeling_outputs`, its cache's pytree registration) without importing or building
    any class; `load` in a fresh process refuses those classes by name until `types=` allows them."""
    path = tmp_path / "gpt2.pd"
    predispatch.save(predispatch.export(_gpt2(use_cache=True), (_ids(1, 8),)), path)

    shown = subprocess.run([sys.executable, "-m", "predispatch", "show", str(path)],
                           capture_output=True, text=True, timeout=300, check=False)
    assert shown.returncode == 0, shown.stderr
    assert "USER_OUTPUT target=\"output['past_key_values']['key_cache'][0]\"" in shown.stdout

    script = (
        "import sys, predispatch\n"
        "try:\n"
        f"    predispatch.load({str(path)!r})\n"
        "except predispatch.errors.SerializationError as e:\n"
        "    print('REFUSED', e)\n"
        "print('transformers imported:', 'transformers' in sys.modules)\n"
        "import transformers.modeling_outputs as mo\n"
        f"program = predispatch.load({str(path)!r}, types=[mo.CausalLMOutputWithCrossAttentions])\n"
        "print('LOADED', type(program).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert "REFUSED" in done.stdout and "transformers.modeling_outputs" in done.stdout, done.stdout + done.stderr
    assert "transformers imported: False" in done.stdout, done.stdout
