"""torchao-quantized models: their weights are tensor subclasses, taken apart and traced through
(Note [Tensor subclasses] in predispatch/frontend/subclasses.py).

Every config torchao 0.18 runs on CPU, on an MLP and a Llama-style decoder: the program's graph
holds plain tensors only, `ep.module()` holds the model's own quantized weights and equals eager
bitwise on the example and on other inputs; QAT (`QATConfig(..., step="prepare")`, train mode)
trains: `ep.module()`'s and `ep.joint()`'s gradients equal eager's.  Needs the `consumers` extra.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import predispatch
from predispatch.frontend.subclasses import is_subclass
from predispatch.passes import mutable_ops

from helpers import assert_verified, subprocess_env
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

    joint = predispatch.export(Loss(m), example).joint()
    _check_plain(joint)
    loss, grads = joint.module()(*example)
    torch.testing.assert_close(loss, expected.float().sum(), rtol=0, atol=0)
    for name, e in eager.named_parameters():
        torch.testing.assert_close(grads[f"inner.{name}"], e.grad, rtol=0, atol=0, msg=name)


# --------------------------------------------------------------------------- saved, loaded elsewhere


#: The classes each config's program needs in `load(path, types=...)`: the tensor subclass, and
#: the classes its flatten context holds (torchao's `MappingType` and `KernelPreference` are
#: plain enums: a file may name their members).
TYPES = {
    "int8_weight_only": ["torchao.quantization:Int8Tensor"],
    "int8_dynamic_activation": [
        "torchao.quantization:Int8Tensor",
        "torchao.quantization.quantize_.workflows.int8.int8_tensor:QuantizeTensorToInt8Kwargs",
        "torchao.quantization.granularity:PerRow",
    ],
    "intx_weight_only": ["torchao.quantization:IntxUnpackedToInt8Tensor"],
    "8da4w": ["torchao.quantization:IntxUnpackedToInt8Tensor"],
    "float8_weight_only": ["torchao.quantization:Float8Tensor"],
    "qat": [],
}
HERE = os.path.dirname(os.path.abspath(__file__))


class Loss(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return self.inner(*args).float().sum()


def _saved_case(folder: str, model: str, config: str) -> dict:
    """Export, save and run one case here: the job for the fresh process, and eager's results
    (the QAT case: its forward program, then its joint, whose results are the loss and gradients)."""
    m, example, other = _case(model)
    if config == "qat":
        m.train()
        quantize_(m, QATConfig(Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4), step="prepare"))
        programs = {"forward": predispatch.export(m, example), "joint": predispatch.export(Loss(m), example).joint()}
        eager = copy.deepcopy(m)
        leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in example]  # the joint's input gradients too
        loss = eager(*leaves).float().sum()
        loss.backward()
        grads = [*(p.grad for _, p in eager.named_parameters()), *(a.grad for a in leaves if a.requires_grad)]
        expected = {"forward": [eager(*example)], "joint": [loss, *grads]}
        calls = {"forward": [example], "joint": [example]}
    else:
        m.eval()
        quantize_(m, CONFIGS[config]())
        programs = {"forward": predispatch.export(m, example)}
        with torch.no_grad():
            expected = {"forward": [m(*example), m(*other)]}
        calls = {"forward": [example, other]}
    jobs = []
    for kind, ep in programs.items():
        stem = os.path.join(folder, f"{model}-{config}-{kind}")
        predispatch.save(ep, f"{stem}.pd")
        safetensors.torch.save_file({f"{i}.{j}": a for i, args in enumerate(calls[kind]) for j, a in enumerate(args)}, f"{stem}.inputs")
        jobs.append({"program": f"{stem}.pd", "inputs": f"{stem}.inputs", "outputs": f"{stem}.outputs", "types": TYPES[config],
                     "expected": [t.detach() for t in expected[kind]]})
    return {"jobs": jobs}


@pytest.fixture(scope="module")
def loaded_elsewhere(tmp_path_factory):
    """Every case saved here and loaded and run in one fresh interpreter that imports torchao
    and passes each case's `types=` (tests/load_in_fresh_process.py)."""
    folder = str(tmp_path_factory.mktemp("torchao"))
    cases = {(model, config): _saved_case(folder, model, config) for model in ("mlp", "llama") for config in TYPES}
    jobs = [{k: v for k, v in job.items() if k != "expected"} for case in cases.values() for job in case["jobs"]]
    with open(os.path.join(folder, "jobs.json"), "w") as f:
        json.dump(jobs, f)
    result = subprocess.run([sys.executable, os.path.join(HERE, "load_in_fresh_process.py"), os.path.join(folder, "jobs.json")],
                            capture_output=True, text=True, timeout=900, env=subprocess_env(os.path.dirname(HERE)))
    assert result.returncode == 0, result.stderr[-3000:]
    return cases


@pytest.mark.parametrize("model", ["mlp", "llama"])
@pytest.mark.parametrize("config", list(TYPES))
def test_saved_program_loads_in_a_fresh_process_as_eager(loaded_elsewhere, model, config):
    """Quantized weights stored as their parts, built again by torchao's own classes in a process
    that imported torchao and allowed them (`types=`); QAT's forward and joint programs too."""
    for job in loaded_elsewhere[(model, config)]["jobs"]:
        got = safetensors.torch.load_file(job["outputs"])
        assert len(got) == len(job["expected"])
        actual = [got[key] for key in sorted(got, key=lambda k: tuple(map(int, k.split("."))))]
        for a, e in zip(actual, job["expected"], strict=True):
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=job["program"])


@pytest.mark.parametrize("config", [c for c in TYPES if TYPES[c]])
def test_a_quantized_file_names_the_types_it_needs(loaded_elsewhere, config):
    """Without `types=` load refuses, naming every class the file needs; its fix is `TYPES`."""
    (job,) = loaded_elsewhere[("mlp", config)]["jobs"]
    with pytest.raises(predispatch.errors.SerializationError) as err:
        predispatch.load(job["program"])
    fix = str(err.value).split("predispatch.load(path, types=[")[1].split("])")[0]
    assert fix.split(", ") == [name.replace(":", ".") for name in TYPES[config]], str(err.value)


# --------------------------------------------------------------------------- torch's consumers


def _torch_part_name(target: str, index: int) -> str:
    """Where torch's `run_decompositions()` puts part `index` of the subclass parameter `target`
    (`unwrap_tensor_subclass_parameters`: `up.parametrizations.weight.original0`)."""
    owner, _, attribute = target.rpartition(".")
    return f"{owner}.parametrizations.{attribute}.original{index}".lstrip(".")


@pytest.mark.parametrize("model", ["mlp", "llama"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_to_torch_gives_torch_consumers_torch_exports_program(tmp_path, model, config):
    """`to_torch()` holds each quantized weight as its plain parts (`up.weight__qdata`): torch's
    verifier, torch.export.save/load and module() take it, equal to eager.  torch.export's own
    route for the same model (`torch.export.export`, then the inference lowering consumers use,
    `run_decompositions({})`) holds the same tensors under torch's names and computes the same;
    so does `to_torch(for_inference=True)`; and torch's core ATen lowering of each,
    `run_decompositions()`, computes the same bits as the other's."""
    m, example, other = _case(model)
    m.eval()
    quantize_(m, CONFIGS[config]())
    ep = predispatch.export(m, example)
    converted = ep.to_torch()
    assert all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in (*converted.state_dict.values(), *converted.constants.values()))
    torch.export.save(converted, tmp_path / "converted.pt2")
    reloaded = torch.export.load(tmp_path / "converted.pt2")
    torch_route = torch.export.export(m, example).run_decompositions({})
    lowered = ep.to_torch(for_inference=True)
    for target, layout in ep.signature.subclass_state:
        for index, path in enumerate(layout.paths()):
            ours = converted.state_dict[f"{target}__{path}"]
            torch.testing.assert_close(ours, torch_route.state_dict[_torch_part_name(target, index)], rtol=0, atol=0)
    # the core ATen route (run_decompositions' default table): attention decomposed, laid out
    # otherwise than the kernel the trace ran (Note [Views of computed tensors])
    ours_core, theirs_core = ep.to_torch().run_decompositions(), torch.export.export(m, example).run_decompositions()
    with torch.no_grad():
        for args in (example, other):
            expected = m(*args)
            for program in (converted, reloaded, torch_route, lowered):
                torch.testing.assert_close(program.module()(*args), expected, rtol=0, atol=0)
            # (not eager's bits: decomposed attention rounds otherwise, and dynamic activation
            # quantization can move a value across a rounding step)
            torch.testing.assert_close(ours_core.module()(*args), theirs_core.module()(*args), rtol=0, atol=0)


@pytest.mark.parametrize("config", ["int8_weight_only", "intx_weight_only", "8da4w"])
def test_executorch_lowering_of_a_quantized_program(config):
    """ExecuTorch, side by side with torch.export's route on the same quantized model: predispatch's
    `to_torch(for_inference=True)` is plain ATen (torchao's quantization ops decomposed), so
    `to_edge(...).to_executorch()` takes it for every config and runs eager's outputs (ExecuTorch's
    kernels: to 1e-6); torch.export's program lowers to the same bits where it lowers at all
    (int8 weight-only), and keeps torchao's own ops elsewhere, which ExecuTorch 1.5.1 has no
    out variants for."""
    executorch = pytest.importorskip("executorch")
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    del executorch
    m, (x,), _ = _case("mlp")
    m.eval()
    quantize_(m, CONFIGS[config]())
    with torch.no_grad():
        expected = m(x)

    def run(program: torch.export.ExportedProgram) -> torch.Tensor:
        lowered = to_edge(program).to_executorch()
        (out,) = Runtime.get().load_program(lowered.buffer).load_method("forward").execute([x])
        return out

    ours = run(predispatch.export(m, (x,)).to_torch(for_inference=True))
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    if config == "int8_weight_only":
        torch.testing.assert_close(run(torch.export.export(m, (x,))), ours, rtol=0, atol=0)
    else:
        with pytest.raises(RuntimeError, match="Missing out variants: .*torchao::"):
            run(torch.export.export(m, (x,)))
