"""The real downstream consumers take predispatch programs (`pytest -m consumers`).

Needs the `consumers` extra (onnx, onnxscript, onnxruntime, torchao, executorch; see
pyproject.toml).  For each model and each consumer, the program goes in by the route the
consumer documents, from two sources side by side:

    predispatch    ep = predispatch.export(m, args); ep.to_torch() (training: torch.compile,
                   torch.export.save/load) or ep.to_torch(for_inference=True) (ONNX, PT2E,
                   ExecuTorch)
    torch.export   torch.export.export(m, args), the consumer's own documented route

and every cell compares numbers with eager.  Known failures are strict xfails, each with its
cause; docs/comparison.md#downstream-consumers is this file's table.
"""

from __future__ import annotations

import copy
import io
import re
import warnings

import pytest
import torch
from torch import nn

import predispatch
from helpers import round_trip, stable_message

pytestmark = pytest.mark.consumers

SOURCES = ("predispatch", "torch.export")


# ---- the models


class STE(torch.autograd.Function):
    """A straight-through estimator: round() forward, identity backward (autograd would give 0)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class NoGradRegion(MLP):
    def forward(self, x):
        h = self.fc1(x)
        with torch.no_grad():
            scale = h.abs().mean() + 1
        return self.fc2(h / scale)


class AutocastRegion(MLP):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = torch.relu(self.fc1(x))
        return self.fc2(h.float())


class QuantizedActivation(MLP):
    def forward(self, x):
        return self.fc2(STE.apply(self.fc1(x) * 4) / 4)


class BackwardHook(MLP):
    def __init__(self):
        super().__init__()
        self.fc2.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 10,))


def _transformer():
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    return layer, (torch.randn(2, 5, 16),)


MODELS = {
    "mlp": lambda: (MLP(), (torch.randn(4, 8),)),
    "conv_bn_eval": lambda: (ConvBN().eval(), (torch.randn(2, 3, 8, 8),)),
    "transformer_block": _transformer,
    "no_grad_region": lambda: (NoGradRegion(), (torch.randn(4, 8),)),
    "autocast_bf16": lambda: (AutocastRegion(), (torch.randn(4, 8),)),
    "custom_function_ste": lambda: (QuantizedActivation(), (torch.randn(4, 8),)),
    "backward_hook": lambda: (BackwardHook(), (torch.randn(4, 8),)),
}

_CUSTOM_BACKWARD = ("custom_function_ste", "backward_hook")
_ORT_BF16 = "onnxruntime's CPU provider has no bfloat16 Gemm (NOT_IMPLEMENTED), whoever exports"
_TORCH_EXPORT_DROPS = "torch.export inlines the custom backward: gradients are autograd's through forward"

#: (consumer, source, model) -> why it fails; applied as strict xfails.
XFAILS = {
    **{("onnx", source, "autocast_bf16"): _ORT_BF16 for source in SOURCES},
    **{("compile", "torch.export", model): _TORCH_EXPORT_DROPS for model in _CUSTOM_BACKWARD},
    **{("save_load", "torch.export", model): _TORCH_EXPORT_DROPS for model in _CUSTOM_BACKWARD},
    ("pt2e-x86", "torch.export", "backward_hook"): "the X86 quantizer meets the view_as nodes torch.export leaves "
    "for a module backward hook: 'view_as_1 is not an aten linear operator'",
}


#: Outputs computed in bfloat16: its tolerance (torch.testing's for bfloat16).
BF16 = {"autocast_bf16"}


def tolerance(model_name: str) -> dict:
    return {"rtol": 1.6e-2, "atol": 1e-2} if model_name in BF16 else {"rtol": 1e-3, "atol": 1e-4}


def cells(consumer: str) -> list:
    return [
        pytest.param(source, model, id=f"{source}-{model}",
                     marks=[pytest.mark.xfail(reason=XFAILS[consumer, source, model], strict=True)]
                     if (consumer, source, model) in XFAILS else [])
        for source in SOURCES for model in MODELS
    ]


def make(model_name: str):
    torch.manual_seed(0)
    model, args = MODELS[model_name]()
    return model, args


def for_training(source: str, model: nn.Module, args: tuple) -> torch.export.ExportedProgram:
    """A torch ExportedProgram that keeps training semantics."""
    if source == "torch.export":
        return torch.export.export(copy.deepcopy(model), args)
    return predispatch.export(model, args).to_torch()


def for_compile(source: str, model: nn.Module, args: tuple) -> nn.Module:
    """What a user hands torch.compile: each tool's own module.  predispatch's `ep.module()` is
    an fx.GraphModule whose captured Functions run as autograd.Functions under Dynamo (Note
    [Captured Functions under Dynamo]); torch's `to_torch().module()` would call the
    autograd_function_apply HOP directly, which Dynamo 2.13 cannot trace."""
    if source == "torch.export":
        return torch.export.export(copy.deepcopy(model), args).module()
    return predispatch.export(model, args).module()


def for_inference(source: str, model: nn.Module, args: tuple) -> torch.export.ExportedProgram:
    """A torch ExportedProgram for consumers that only run forward."""
    if source == "torch.export":
        return torch.export.export(copy.deepcopy(model), args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the dropped-backward warning, tested in test_interop
        return predispatch.export(model, args).to_torch(for_inference=True)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.to(expected.dtype), expected.detach(), rtol=rtol, atol=atol)


# ---- the consumers


@pytest.mark.parametrize("source, model_name", cells("onnx"))
def test_onnx_onnxruntime(source, model_name):
    import onnxruntime

    model, args = make(model_name)
    expected = model(*args)
    program = torch.onnx.export(for_inference(source, model, args), args, dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)}
    (actual,) = session.run(None, feeds)
    assert_close(torch.from_numpy(actual), expected, **tolerance(model_name))


def _x86():
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())


def _xnnpack():
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    return XNNPACKQuantizer().set_global(get_symmetric_quantization_config())


QUANTIZERS = {"x86": _x86, "xnnpack": _xnnpack}


@pytest.mark.parametrize("source, model_name", cells("pt2e-x86"))
def test_pt2e_x86(source, model_name):
    check_pt2e(source, model_name, "x86")


@pytest.mark.parametrize("source, model_name", cells("pt2e-xnnpack"))
def test_pt2e_xnnpack(source, model_name):
    check_pt2e(source, model_name, "xnnpack")


def check_pt2e(source: str, model_name: str, quantizer: str) -> None:
    """prepare -> calibrate -> convert -> run; the quantized output near eager's."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    model, args = make(model_name)
    expected = model(*args)
    prepared = prepare_pt2e(for_inference(source, model, args).module(), QUANTIZERS[quantizer]())
    prepared(*args)  # calibrate
    converted = convert_pt2e(prepared)
    quantize_ops = [n for n in converted.graph.nodes if "quantize_per_tensor" in str(n.target)]
    assert quantize_ops, "the quantizer annotated nothing"
    actual = converted(*args)
    error = (actual.float() - expected.float()).abs().max()
    assert error <= 0.1 * expected.abs().max() + 0.05, f"quantized output off by {error}"


@pytest.mark.parametrize("source, model_name", cells("compile"))
def test_torch_compile_forward_and_training_step(source, model_name):
    import torch._dynamo

    model, args = make(model_name)
    eager = copy.deepcopy(model)
    torch._dynamo.reset()
    program = for_compile(source, model, args)
    compiled = torch.compile(program, backend="inductor", fullgraph=True)
    x_eager, x_compiled = args[0].clone().requires_grad_(), args[0].clone().requires_grad_()
    expected, actual = eager(x_eager), compiled(x_compiled)
    assert_close(actual, expected, **tolerance(model_name))
    expected.float().pow(2).sum().backward()
    actual.float().pow(2).sum().backward()
    assert_close(x_compiled.grad, x_eager.grad, **tolerance(model_name))
    compiled_params = dict(program.named_parameters())
    for name, param in eager.named_parameters():
        assert_close(compiled_params[name].grad, param.grad, **tolerance(model_name))


@pytest.mark.parametrize("source, model_name", cells("save_load"))
def test_torch_export_save_load(source, model_name):
    model, args = make(model_name)
    buffer = io.BytesIO()
    torch.export.save(for_training(source, model, args), buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer).module()
    x_eager, x_loaded = args[0].clone().requires_grad_(), args[0].clone().requires_grad_()
    expected, actual = model(x_eager), loaded(x_loaded)
    assert_close(actual, expected, **tolerance(model_name))
    expected.float().sum().backward()
    actual.float().sum().backward()
    assert_close(x_loaded.grad, x_eager.grad, **tolerance(model_name))


@pytest.mark.parametrize("source, model_name", cells("executorch"))
def test_executorch(source, model_name):
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    model, args = make(model_name)
    expected = model(*args)
    program = to_edge(for_inference(source, model, args)).to_executorch()
    method = Runtime.get().load_program(program.buffer).load_method("forward")
    (actual,) = method.execute(list(args))
    assert_close(actual, expected, **tolerance(model_name))


@pytest.mark.parametrize("source", SOURCES)
def test_onnx_dynamic_batch(source):
    """A dynamic batch dimension reaches ONNX as a symbolic one: onnxruntime runs other sizes."""
    import onnxruntime
    from torch.export import Dim

    model, args = make("mlp")
    shapes = ({0: Dim("batch", min=2, max=64)},)
    if source == "torch.export":
        program = torch.export.export(model, args, dynamic_shapes=shapes)
    else:
        program = predispatch.export(model, args, dynamic_shapes=shapes).to_torch(for_inference=True)
    onnx_program = torch.onnx.export(program, args, dynamic_shapes=shapes, dynamo=True, verbose=False)
    assert str(onnx_program.model.graph.inputs[0].shape[0]) == "batch"  # the user's Dim name, given again
    session = onnxruntime.InferenceSession(onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch in (2, 9, 64):
        x = torch.randn(batch, 8)
        (actual,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        assert_close(torch.from_numpy(actual), model(x), **tolerance("mlp"))


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, y):
        return torch.cat([self.lin(x).sum(1), y], 0)


def test_onnx_dim_names_without_giving_them_again(tmp_path):
    """Issue 22 item 6: `ep.to_onnx()` names ONNX's dynamic axes after the user's Dims (an
    expression too); torch.onnx.export of an ExportedProgram, torch.export's or ours through
    `to_torch()`, names them after torch's symbols. onnxruntime runs other sizes as eager."""
    import onnx
    import onnxruntime
    from torch.export import Dim

    model, args = Pooled(), (torch.randn(3, 5, 8), torch.randn(3, 8))
    batch = Dim("batch", min=2, max=64)
    shapes = {"x": {0: batch, 1: Dim("seq")}, "y": {0: batch}}
    ep = predispatch.export(model, args, dynamic_shapes=shapes)
    path = tmp_path / "pooled.onnx"
    onnx_program = ep.to_onnx(path)

    def axes(proto):
        return [[d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*proto.graph.input, *proto.graph.output]]

    assert axes(onnx.load(path)) == axes(onnx_program.model_proto) == [["batch", "seq", 8], ["batch", 8], ["2*batch", 8]]
    torch_route = torch.onnx.export(torch.export.export(model, args, dynamic_shapes=shapes), args, dynamo=True, verbose=False)
    ours_by_hand = torch.onnx.export(ep.to_torch(for_inference=True), args, dynamo=True, verbose=False)
    for other in (torch_route, ours_by_hand):
        assert all(re.fullmatch(r"s\d+", str(a)) for a in axes(other.model_proto)[0][:2])
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for b, q in ((2, 1), (9, 4), (64, 7)):
        x, y = torch.randn(b, q, 8), torch.randn(b, 8)
        (actual,) = session.run(None, {session.get_inputs()[0].name: x.numpy(), session.get_inputs()[1].name: y.numpy()})
        assert_close(torch.from_numpy(actual), model(x, y), **tolerance("mlp"))


def test_onnx_dim_names_that_do_not_reach_the_axes_stop_to_onnx(monkeypatch):
    """If torch.onnx stops naming axes after symbols, the rename misses: to_onnx raises rather
    than return axes without the user's names."""
    from torch.export import Dim
    from torch.onnx._internal.exporter._onnx_program import ONNXProgram

    from predispatch.errors import TorchDriftError

    batch = Dim("batch", min=2, max=64)
    ep = predispatch.export(Pooled(), (torch.randn(3, 5, 8), torch.randn(3, 8)), dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
    monkeypatch.setattr(ONNXProgram, "rename_axes", lambda self, mapping: None)
    with pytest.raises(TorchDriftError, match=r"the dynamic axes \['batch'\] did not get their Dim names"):
        ep.to_onnx()


# ---- training routes (docs/comparison.md#training-routes)


class ConvBNReLU(ConvBN):
    """conv -> BN -> ReLU in train mode: QAT fuses conv+BN and updates BN's statistics."""


class DropoutMLP(MLP):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


QAT_MODELS = {
    "conv_bn_relu": lambda: (ConvBNReLU(), torch.randn(4, 3, 8, 8)),
    "mlp_dropout": lambda: (DropoutMLP(), torch.randn(8, 8)),
}


def qat_module(source: str, model: nn.Module, x: torch.Tensor) -> torch.fx.GraphModule:
    """The module each route hands `prepare_qat_pt2e`: torch.export's `module()`, and
    predispatch's documented QAT route, `ep.to_torch().module()` (torch's training IR)."""
    if source == "torch.export":
        return torch.export.export(copy.deepcopy(model), (x,)).module()
    return predispatch.export(copy.deepcopy(model), (x,)).to_torch().module()


def run_qat(source: str, model: nn.Module, x: torch.Tensor) -> dict:
    """prepare_qat_pt2e -> 3 SGD steps -> move_exported_model_to_eval -> convert_pt2e; what each step left."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config
    from torchao.quantization.pt2e import move_exported_model_to_eval
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_qat_pt2e

    torch.manual_seed(0)
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=True))
    prepared = prepare_qat_pt2e(qat_module(source, model, x), quantizer)
    prepared_ops = _ops(prepared)  # convert_pt2e rewrites `prepared` in place
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.05)
    for _ in range(3):
        optimizer.zero_grad()
        prepared(x).pow(2).mean().backward()
        optimizer.step()
    trained = {k: v.clone() for k, v in prepared.state_dict().items()}
    move_exported_model_to_eval(prepared)
    evaluated = prepared(x)
    converted = convert_pt2e(prepared)
    return {
        "prepared_ops": prepared_ops, "state": trained, "eval": evaluated,
        "converted_ops": _ops(converted), "converted": (converted(x), converted(x)),
    }


def _ops(gm: torch.fx.GraphModule) -> set[str]:
    """The aten and quantization ops a graph calls (not the module's own helpers)."""
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}


@pytest.mark.parametrize("model_name", QAT_MODELS)
def test_qat_pt2e_matches_torch_export(model_name):
    """QAT on predispatch's route gives torch.export's route's model: conv+BN fused for QAT, BN
    statistics (num_batches_tracked too) updated, the eval switch applied, BN folded and dropout
    off after convert, the same numbers throughout."""
    model, x = QAT_MODELS[model_name]()
    expected, actual = run_qat("torch.export", model, x), run_qat("predispatch", model, x)
    assert actual["prepared_ops"] == expected["prepared_ops"]
    assert actual["state"].keys() == expected["state"].keys()
    for key, value in expected["state"].items():
        torch.testing.assert_close(actual["state"][key], value, rtol=0, atol=0, msg=key)
    torch.testing.assert_close(actual["eval"], expected["eval"], rtol=0, atol=0)
    assert "aten.batch_norm.default" not in actual["converted_ops"]  # folded into the conv
    torch.testing.assert_close(actual["converted"][0], actual["converted"][1], rtol=0, atol=0)  # dropout off
    torch.testing.assert_close(actual["converted"][0], expected["converted"][0], rtol=0, atol=0)
    if model_name == "conv_bn_relu":
        assert actual["state"]["bn.num_batches_tracked"].item() == 3
        assert "aten.sqrt.default" in actual["prepared_ops"]  # the QAT conv+BN fusion's weight scaling


def test_write_back_survives_fx_dead_code_elimination():
    """ep.module()'s write-back call has no users; FX keeps it because it is declared side-effectful."""
    model, x = ConvBNReLU(), torch.randn(2, 3, 8, 8)
    module = predispatch.export(copy.deepcopy(model), (x,)).module()
    module.graph.eliminate_dead_code()
    module.recompile()
    module(x)
    model(x)
    for name, value in model.bn.state_dict().items():
        torch.testing.assert_close(getattr(module.bn, name), value, msg=name)


def test_fx_interpreter_runs_program_module():
    """torch.fx.Interpreter runs ep.module()'s nodes, not its generated forward: the owner check
    (runtime/owner.py) is generated code, not a node, so the Interpreter runs as before, write-back included."""
    torch.manual_seed(0)
    model, x = ConvBNReLU(), torch.randn(2, 3, 8, 8)
    module = predispatch.export(copy.deepcopy(model), (x,)).module()
    assert not any("check_owner" in str(node.target) for node in module.graph.nodes)
    torch.testing.assert_close(torch.fx.Interpreter(module).run(x), model(x))
    torch.testing.assert_close(module.bn.running_mean, model.bn.running_mean)


def test_pt2e_mode_switch_on_program_module_is_refused():
    """allow_exported_model_train_eval on ep.module() would switch nothing (its graph holds
    the functional forms PT2E's patterns do not match): refused, naming the route that works."""
    from torchao.quantization.pt2e import allow_exported_model_train_eval, move_exported_model_to_eval

    module = predispatch.export(ConvBNReLU(), (torch.randn(2, 3, 8, 8),)).module()
    with pytest.raises(predispatch.errors.ModeSwitchError, match=r"ep.to_torch\(\).module\(\)"):
        allow_exported_model_train_eval(module)
    with pytest.raises(predispatch.errors.ModeSwitchError, match="move_exported_model_to_eval"):
        move_exported_model_to_eval(module)
    evaluated = predispatch.export(ConvBNReLU().eval(), (torch.randn(2, 3, 8, 8),)).module()
    move_exported_model_to_eval(evaluated)  # already eval: nothing to switch, allowed



# The first route a PT2E user tries hands `ep.module()` itself to torchao's prepare, which builds a
# plain GraphModule over its graph (Note [A GraphModule built over ep.module()'s graph]).

_QAT_ON_MODULE = {
    "train": """\
this GraphModule was built over ep.module()'s graph (as torchao's prepare_qat_pt2e(ep.module(), quantizer) does): \
it would run without ep.module()'s input checks, write-back and train/eval guard, and PT2E's patterns do not match \
its functional graph (dropout would stay on after move_exported_model_to_eval; conv+BN training fails), so it is refused.
  at test_consumers.py:N (prepared(x).pow(2).mean().backward())
  fix: give PT2E torch's training IR: prepare_qat_pt2e(ep.to_torch().module(), quantizer) (docs/comparison.md#training-routes).
  see docs/errors.md#modulecopyerror""",
    "eval": """\
this GraphModule was built over ep.module()'s graph (as torchao's prepare_qat_pt2e(ep.module(), quantizer) does): \
it would run without ep.module()'s input checks, write-back and train/eval guard, and its graph is ep.module()'s eval \
graph, whose batch norm PT2E's QAT conv+BN fusion does not match, so it is refused.
  at test_consumers.py:N (prepared(x).pow(2).mean().backward())
  fix: give PT2E torch's training IR: prepare_qat_pt2e(ep.to_torch().module(), quantizer) (docs/comparison.md#training-routes).
  see docs/errors.md#modulecopyerror""",
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("model_name", QAT_MODELS)
def test_qat_pt2e_on_program_module_is_refused(model_name, mode):
    """prepare_qat_pt2e(ep.module(), quantizer) is refused at the prepared model's first call,
    naming the route that works.  Before: with dropout, move_exported_model_to_eval left dropout
    on, silently; conv+BN's first training step failed with torch's raw in-place error; an eval
    program got no conv+BN fusion."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    model, x = QAT_MODELS[model_name]()
    module = predispatch.export(model.train(mode == "train"), (x,)).module()
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_qat=True))
    prepared = prepare_qat_pt2e(module, quantizer)
    with pytest.raises(predispatch.errors.ModuleCopyError) as info:
        prepared(x).pow(2).mean().backward()
    assert stable_message(info.value) == _QAT_ON_MODULE[mode]
    torch.testing.assert_close(module(x).shape, model(x).shape)  # ep.module() itself still runs


_PTQ_ON_TRAIN_MODULE = """\
this GraphModule was built over ep.module()'s graph (as torchao's prepare_pt2e(ep.module(), quantizer) does): \
it would run without ep.module()'s input checks, write-back and train/eval guard, and PT2E's patterns do not match \
its functional graph (dropout would stay on after move_exported_model_to_eval; conv+BN training fails), so it is refused.
  at test_consumers.py:N (prepared(x))
  fix: for QAT, prepare_qat_pt2e(ep.to_torch().module(), quantizer); for PTQ, export the model in eval mode \
(predispatch.export(model.eval(), args)) and give PT2E prepare_pt2e(ep.to_torch(for_inference=True).module(), quantizer) \
(docs/comparison.md#training-routes).
  see docs/errors.md#modulecopyerror"""


@pytest.mark.parametrize("model_name", QAT_MODELS)
def test_ptq_pt2e_on_program_module(model_name):
    """prepare_pt2e(ep.module(), quantizer): on an eval program (which writes nothing back) it
    gives the documented route's model (ep.to_torch(for_inference=True)), bitwise; on a train
    program, whose dropout/batch norm PT2E cannot switch, it is refused at the first calibration
    call (before: dropout stayed on in the converted model, silently)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    def converted(module: torch.fx.GraphModule) -> torch.Tensor:
        prepared = prepare_pt2e(module, XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
        prepared(x)
        return convert_pt2e(prepared)(x)

    model, x = QAT_MODELS[model_name]()
    ep = predispatch.export(copy.deepcopy(model).eval(), (x,))
    torch.testing.assert_close(converted(ep.module()), converted(for_inference("predispatch", model.eval(), (x,)).module()),
                               rtol=0, atol=0)
    prepared = prepare_pt2e(predispatch.export(model.train(), (x,)).module(),
                            XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
    with pytest.raises(predispatch.errors.ModuleCopyError) as info:
        prepared(x)
    assert stable_message(info.value) == _PTQ_ON_TRAIN_MODULE


def test_pt2e_mode_switch_on_train_eval_module():
    """PT2E's mode switch (move_exported_model_to_eval/_train, allow_exported_model_train_eval
    then .eval()/.train()) on `export_train_eval(...).module()` switches between the exported
    programs of each mode: eager's outputs in each mode, bitwise."""
    from torchao.quantization.pt2e import (
        allow_exported_model_train_eval,
        move_exported_model_to_eval,
        move_exported_model_to_train,
    )

    torch.manual_seed(0)
    model, x = DropoutMLP(), torch.randn(8, 8)
    both = predispatch.export_train_eval(copy.deepcopy(model), (x,)).module()

    def check(mode: bool) -> None:
        assert both.training is mode
        eager = copy.deepcopy(model).train(mode)
        torch.manual_seed(1)
        expected = eager(x)
        torch.manual_seed(1)
        torch.testing.assert_close(both(x), expected, rtol=0, atol=0)

    move_exported_model_to_eval(both)
    check(False)
    move_exported_model_to_train(both)
    check(True)
    allow_exported_model_train_eval(both)
    both.eval()
    check(False)
    both.train()
    check(True)

class WithLoss(nn.Module):
    """On-device training exports the loss with the model, as its first output (ExecuTorch's recipe)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


ON_DEVICE_MODELS = {
    "mlp": lambda: (MLP(), torch.randn(4, 8), torch.randn(4, 4)),
    "custom_function_ste": lambda: (QuantizedActivation(), torch.randn(4, 8), torch.randn(4, 4)),
    "conv_bn_train": lambda: (ConvBN(), torch.randn(2, 3, 8, 8), torch.randn(2, 4, 6, 6)),
}

_ET_BUFFER_INDEX = ("ExecuTorch 1.5.1's training metadata (_get_training_metadata in exir/emit/_emit_program.py) "
                    "counts BUFFER_MUTATION outputs, which the method does not return: with batch norm's "
                    "statistics the gradients are read from the wrong outputs, whoever exports")
ON_DEVICE_XFAILS = {
    ("torch.export", "custom_function_ste"): _TORCH_EXPORT_DROPS,
    ("torch.export", "conv_bn_train"): "to_edge refuses _native_batch_norm_legit_functional (not core ATen), "
    "which torch's _export_forward_backward leaves",
    ("predispatch", "conv_bn_train"): _ET_BUFFER_INDEX,
}


def joint_for_executorch(source: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """The joint program each route hands `to_edge`: torch's documented
    `_export_forward_backward(torch.export.export(...))`, and `ep.to_torch_forward_backward()`."""
    if source == "torch.export":
        from torch.export.experimental import _export_forward_backward

        return _export_forward_backward(torch.export.export(WithLoss(copy.deepcopy(model)), (x, y)))
    return predispatch.export(WithLoss(copy.deepcopy(model)), (x, y)).to_torch_forward_backward()


def eager_step(model: nn.Module, x, y, lr: float) -> tuple:
    """Eager's loss, gradients by name, and loss after one SGD step."""
    trained = WithLoss(copy.deepcopy(model))
    loss = trained(x, y)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in trained.named_parameters()}
    torch.optim.SGD(trained.parameters(), lr=lr).step()
    with torch.no_grad():
        return loss.detach(), grads, trained(x, y)


@pytest.mark.parametrize("source, model_name", [
    pytest.param(s, m, id=f"{s}-{m}", marks=[pytest.mark.xfail(reason=ON_DEVICE_XFAILS[s, m], strict=True)]
                 if (s, m) in ON_DEVICE_XFAILS else [])
    for s in SOURCES for m in ON_DEVICE_MODELS
])
def test_executorch_training_runtime(source, model_name):
    """ExecuTorch's training runtime: forward_backward gives eager's loss and gradients, and its
    SGD step gives eager's next loss."""
    from executorch.exir import to_edge
    from executorch.extension.training import _load_for_executorch_for_training_from_buffer, get_sgd_optimizer

    torch.manual_seed(0)
    model, x, y = ON_DEVICE_MODELS[model_name]()
    loss, grads, next_loss = eager_step(model, x, y, lr=0.1)
    program = to_edge(joint_for_executorch(source, model, x, y)).to_executorch()
    trainer = _load_for_executorch_for_training_from_buffer(program.buffer)
    (actual_loss,) = trainer.forward_backward("forward", (x, y))
    assert_close(actual_loss, loss)
    actual_grads = trainer.named_gradients()
    assert actual_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert_close(actual_grads[name], grad)
    get_sgd_optimizer(trainer.named_parameters(), 0.1, 0, 0, 0, False).step(actual_grads)
    (actual_next,) = trainer.forward_backward("forward", (x, y))
    assert_close(actual_next, next_loss)


def test_executorch_joint_conv_bn_runs_with_eager_gradients():
    """Train-mode conv+BN's joint program passes to_edge and runs in ExecuTorch (the plain runtime:
    the training runtime misreads its outputs, see ON_DEVICE_XFAILS) with eager's loss and
    gradients."""
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    torch.manual_seed(0)
    model, x, y = ON_DEVICE_MODELS["conv_bn_train"]()
    loss, grads, _ = eager_step(model, x, y, lr=0.1)
    joint = joint_for_executorch("predispatch", model, x, y)
    program = to_edge(joint).to_executorch()
    method = Runtime.get().load_program(program.buffer).load_method("forward")
    outputs = method.execute([x, y])
    kinds = [s for s in joint.graph_signature.output_specs if s.kind != torch.export.graph_signature.OutputKind.BUFFER_MUTATION]
    by_kind = dict(zip([(s.kind.name, s.target) for s in kinds], outputs))
    assert_close(by_kind["LOSS_OUTPUT", None], loss)
    for name, grad in grads.items():
        assert_close(by_kind["GRADIENT_TO_PARAMETER", name], grad)


# ---- programs torch's own tools read back (docs/comparison.md#training-routes)


class ScaledBlock(nn.Module):
    """A residual block with a no-grad region (a per-call scale): repeated, it becomes a shared
    body (`invoke_subgraph`) holding a grad-mode region."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        with torch.no_grad():
            scale = self.up(x).abs().mean() + 1
        return x + self.down(torch.relu(self.up(self.norm(x)))) / scale


class SharedLayers(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(ScaledBlock() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def save_load(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def check_trains_like(module: nn.Module, eager: nn.Module, *args: torch.Tensor, exact: bool = True) -> None:
    """`module` gives `eager`'s outputs and its gradients for the inputs and parameters (bitwise
    when `exact`), and leaves the buffers as eager's forward does (on a copy of `eager`)."""
    eager = copy.deepcopy(eager)
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-4, "atol": 1e-5}
    ins_m, ins_e = [a.clone().requires_grad_() for a in args], [a.clone().requires_grad_() for a in args]
    out_m, out_e = module(*ins_m), eager(*ins_e)
    out_m, out_e = (out_m, out_e) if isinstance(out_e, tuple) else ((out_m,), (out_e,))
    for actual, expected in zip(out_m, out_e):
        torch.testing.assert_close(actual, expected, **tol)
    sum(o.float().sum() for o in out_m).backward()
    sum(o.float().sum() for o in out_e).backward()
    for actual, expected in zip(ins_m, ins_e):
        torch.testing.assert_close(actual.grad, expected.grad, **tol)
    params = dict(module.named_parameters())
    for name, param in eager.named_parameters():
        torch.testing.assert_close(params[name].grad, param.grad, **tol, msg=name)
    buffers = dict(module.named_buffers())
    for name, buffer in eager.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, **tol, msg=name)


@pytest.mark.parametrize("source", SOURCES)
def test_shared_layers_save_load(source):
    """A program with shared bodies (`invoke_subgraph`, each holding a grad-mode region) goes
    through torch.export.save/load and trains like eager, bitwise, as torch.export's route does:
    `to_torch()` inlines the bodies, which torch's eager `invoke_subgraph` cannot differentiate."""
    torch.manual_seed(0)
    model, x = SharedLayers(), torch.randn(2, 3, 8)
    if source == "predispatch":
        ep = predispatch.export(model, (x,))
        assert len(ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)) == 4
        program = ep.to_torch()
    else:
        program = for_training(source, model, (x,))
    check_trains_like(save_load(program).module(), model, x)


class BNInAutocast(nn.Module):
    """Train-mode batch norm inside an autocast region: its statistics stay functional there."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.bn(self.fc(x)).float()


class BNReadsStatistics(nn.Module):
    """Train-mode batch norm whose updated running mean the forward reads afterwards."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.fc(x)) + self.bn.running_mean


BN_TRAIN_MODELS = {"conv_bn_train": lambda: (ConvBN(), torch.randn(2, 3, 8, 8)),
                   "bn_in_autocast": lambda: (BNInAutocast(), torch.randn(4, 8)),
                   "bn_reads_statistics": lambda: (BNReadsStatistics(), torch.randn(4, 8))}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("model_name", BN_TRAIN_MODELS)
def test_train_mode_batch_norm_module_backpropagates(source, model_name):
    """`to_torch().module()` of train-mode batch norm trains like eager (outputs, gradients,
    running statistics bitwise), as torch.export's `module()` does: torch's write-back of the
    statistics must not touch a tensor batch norm's backward saved."""
    torch.manual_seed(0)
    model, x = BN_TRAIN_MODELS[model_name]()
    program = for_training(source, copy.deepcopy(model), (x,))
    check_trains_like(program.module(), model, x)



class CondModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("shift", torch.ones(8))

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: self.fc(x).sin() + self.shift, lambda x: self.fc(x).cos(), (x,))


class WhileModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        _, y = while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, torch.tanh(self.fc(y))), (torch.tensor(0), x))
        return y


class ScanModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        from torch._higher_order_ops.scan import scan

        def step(carry, row):
            new = torch.tanh(self.fc(row) + carry)
            return new, new * 2

        return scan(step, torch.zeros(8), x)


class MapModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        from functorch.experimental.control_flow import map as control_flow_map

        return control_flow_map(lambda row: torch.relu(self.fc(row)), x)


CONTROL_FLOW = {"cond": CondModel, "while_loop": WhileModel, "scan": ScanModel, "map": MapModel}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("model_name", CONTROL_FLOW)
def test_control_flow_to_torch_save_load(source, model_name):
    """`to_torch()` of a program with torch.cond / while_loop / scan / map keeps the HOP; its
    module() and torch.export.save/load's train like eager, bitwise, as torch.export's route does."""
    torch.manual_seed(0)
    model, x = CONTROL_FLOW[model_name](), torch.randn(4, 8)
    program = for_training(source, model, (x,))
    hop = {"map": "map_impl"}.get(model_name, model_name)
    assert any(getattr(n.target, "__name__", None) == hop for n in program.graph.nodes)
    check_trains_like(program.module(), model, x)
    check_trains_like(save_load(program).module(), model, x)


@pytest.mark.parametrize("model_name", CONTROL_FLOW)
def test_control_flow_predispatch_save_load(model_name):
    """predispatch.save/load holds torch.cond, while_loop, scan and map: the loaded program
    prints the same and its module() trains like eager, bitwise, as does its `to_torch()`
    through torch.export.save/load."""
    torch.manual_seed(0)
    model, x = CONTROL_FLOW[model_name](), torch.randn(4, 8)
    ep = predispatch.export(model, (x,))
    loaded = round_trip(ep)
    assert str(loaded) == str(ep)
    check_trains_like(loaded.module(), model, x)
    check_trains_like(save_load(loaded.to_torch()).module(), model, x)


class IntCarryLoop(nn.Module):
    def forward(self, x):
        from torch._higher_order_ops.while_loop import while_loop

        i, y = while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, y * 2 + i), (0, x))
        return y, i


def test_while_loop_int_carry_saves_with_predispatch_only():
    """A while_loop carrying a Python int (unbacked symbols in node meta): predispatch.save/load
    gives eager's outputs bitwise, the int included; torch.export.save cannot write it, from
    torch.export's route or from `to_torch()` (if torch learns to, docs/comparison.md's row changes)."""
    model, x = IntCarryLoop(), torch.randn(4, 8)
    loaded = round_trip(predispatch.export(model, (x,)))
    out, count = loaded.module()(x)
    torch.testing.assert_close(out, model(x)[0], rtol=0, atol=0)
    assert count == 3
    from torch._export.serde.serialize import SerializeError

    for program in (torch.export.export(model, (x,)), predispatch.export(model, (x,)).to_torch()):
        with pytest.raises(SerializeError, match=r"Unsupported list/tuple argument type"):
            save_load(program)


_LOAD_IN_A_FRESH_PROCESS = """
import sys, torch
import predispatch.ops  # registers predispatch's operators, as docs/format.md#torch-interop says
module = torch.export.load(sys.argv[1]).module()
x, expected_out, expected_grad = torch.load(sys.argv[2])
x = x.clone().requires_grad_()
out = module(x)
out.sum().backward()
torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
torch.testing.assert_close(x.grad, expected_grad, rtol=0, atol=0)
print("ok")
"""


def test_custom_backward_loads_in_a_fresh_process(tmp_path):
    """torch.export.load of `to_torch()` with a custom Function in a new process that imports
    `predispatch.ops` only: eager's output and the custom backward's gradient, bitwise."""
    import subprocess
    import sys

    model, (x,) = make("custom_function_ste")
    torch.export.save(predispatch.export(model, (x,)).to_torch(), tmp_path / "program.pt2")
    x_eager = x.clone().requires_grad_()
    out = model(x_eager)
    out.sum().backward()
    torch.save((x, out.detach(), x_eager.grad), tmp_path / "expected.pt")
    result = subprocess.run([sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, str(tmp_path / "program.pt2"),
                             str(tmp_path / "expected.pt")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# ---- transformers' ExecuTorch recipe (docs/comparison.md#training-routes)


def _tiny_llama_with_static_cache():
    """A randomly initialised two-layer Llama, wrapped as transformers' ExecuTorch recipe wraps it:
    `TorchExportableModuleForDecoderOnlyLM(...).model` registers its StaticCache's tensors as buffers."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(use_cache=True, cache_implementation="static", max_length=32,
                                               cache_config={"batch_size": 1, "max_cache_len": 32})
    return model, TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=32)


def greedy_decode(step, prompt: list[int], new_tokens: int) -> list[int]:
    """The recipe's decode: the prompt one token at a time, then the argmax token, each at its
    cache position; `step(input_ids, cache_position)` returns the logits."""
    tokens = list(prompt)
    with torch.no_grad():
        for position, token in enumerate(tokens):
            logits = step(torch.tensor([[token]]), torch.tensor([position]))
        while len(tokens) < len(prompt) + new_tokens:
            tokens.append(int(logits[:, -1, :].argmax(-1)))
            logits = step(torch.tensor([[tokens[-1]]]), torch.tensor([len(tokens) - 1]))
    return tokens


def test_transformers_executorch_recipe_static_cache():
    """transformers' StaticCache recipe exports (its cache object holds the very tensors it
    registers as buffers); an 8-token greedy decode through ep.module() and through the .pte
    gives HF generate's tokens, as torch.export's route does; export leaves the user's cache
    (buffers and the cache object's tensors) as it was."""
    pytest.importorskip("transformers")
    from executorch.exir import to_edge
    from executorch.runtime import Runtime

    model, recipe = _tiny_llama_with_static_cache()
    prompt = [5, 17, 42]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0].tolist()
    wrapper = recipe.model
    before = {name: b.clone() for name, b in wrapper.named_buffers()}
    example = {"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([0])}
    theirs = copy.deepcopy(recipe).export(**example)  # torch.export's route, on a copy
    ep = predispatch.export(wrapper, (), example)
    for name, buffer in wrapper.named_buffers():
        assert torch.equal(buffer, before[name]) and not buffer.requires_grad, name
    for i, layer in enumerate(wrapper.static_cache.layers):
        assert layer.keys is getattr(wrapper, f"key_cache_{i}") and layer.values is getattr(wrapper, f"value_cache_{i}")
    module = ep.module()
    assert greedy_decode(lambda ids, pos: module(input_ids=ids, cache_position=pos), prompt, 8) == expected
    theirs_module = theirs.module()
    assert greedy_decode(lambda ids, pos: theirs_module(input_ids=ids, cache_position=pos), prompt, 8) == expected
    method = Runtime.get().load_program(to_edge(ep.to_torch(for_inference=True)).to_executorch().buffer).load_method("forward")
    assert greedy_decode(lambda ids, pos: method.execute([ids, pos])[0], prompt, 8) == expected
