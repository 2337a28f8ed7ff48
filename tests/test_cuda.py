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


def test_moving_a_program_across_devices_is_refused_and_its_fix_works():
    """`ep.module().to("cuda")` of a CPU program is refused (its graph and checks are traced for
    CPU, and it shares the model's tensors), changing nothing; the fix the error gives, exporting
    the model on CUDA, gives eager's outputs bitwise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU())
    x = torch.randn(4, 8)
    module = predispatch.export(model, (x,)).module()
    before = {name: t.clone() for name, t in module.state_dict().items()}
    with pytest.raises(predispatch.errors.ModuleConversionError) as info:
        module.to("cuda")
    assert "export again" in info.value.fix
    for name, t in module.state_dict().items():
        assert t.device.type == "cpu" and torch.equal(t, before[name]), name
    model.cuda()
    eager = copy.deepcopy(model)
    module = predispatch.export(model, (x.cuda(),)).module()
    torch.testing.assert_close(module(x.cuda()), eager(x.cuda()), rtol=0, atol=0)


def test_saved_on_cuda_loads_and_runs_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU()).cuda()
    x = torch.randn(4, 8, device="cuda")
    ep = predispatch.export(model, (x,))
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    buffer.seek(0)
    module = predispatch.load(buffer).module()
    assert {t.device.type for t in module.state_dict().values()} == {"cuda"}
    torch.testing.assert_close(module(x), model(x), rtol=0, atol=0)

# --- the joint program, attention kernels, custom backwards, RNG and files on CUDA ---------------
#
# Bitwise where eager and the program call the same CUDA kernels: cuDNN and cuBLAS are pinned to
# their deterministic algorithms (CUBLAS_WORKSPACE_CONFIG, which conftest.py sets before cuBLAS
# starts; the fixture skips where something set another), so a difference is ours, not the
# kernels' scheduling.


@pytest.fixture
def deterministic():
    import os

    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        pytest.skip("set CUBLAS_WORKSPACE_CONFIG=:4096:8 for bitwise CUDA comparisons")
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    # flags(): torch's test utilities (imported by test_joint) freeze cuDNN's global flags
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        yield
    torch.use_deterministic_algorithms(before)


class Attention(nn.Module):
    """Multi-head self-attention through SDPA (flash or memory-efficient kernels on CUDA in half
    precision), with dropout inside attention in train mode."""

    def __init__(self, dim=64, heads=4, dropout=0.0):
        super().__init__()
        self.qkv, self.out, self.heads, self.dropout = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads, dropout

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        p = self.dropout if self.training else 0.0
        h = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        return self.out(h.transpose(1, 2).reshape(b, t, d))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU())
        self.drop, self.head = nn.Dropout(0.2), nn.Linear(8, 5)

    def forward(self, x):
        return self.head(self.drop(self.body(x).mean((2, 3))))


class StraightThroughNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        from helpers import StraightThrough

        return StraightThrough.apply(self.lin(x) * 4) / 4


def _cuda_cases():
    return {
        "convnet-train": (lambda: ConvNet().train(), lambda: (torch.randn(4, 3, 12, 12),)),
        "attention-bf16": (lambda: Attention().to(torch.bfloat16), lambda: (torch.randn(2, 32, 64, dtype=torch.bfloat16),)),
        "attention-dropout-f16": (lambda: Attention(dropout=0.3).half().train(), lambda: (torch.randn(2, 32, 64, dtype=torch.half),)),
        "attention-f32": (lambda: Attention(), lambda: (torch.randn(2, 32, 64),)),
        "straight-through": (StraightThroughNet, lambda: (torch.randn(4, 8),)),
        "regions": (Regions, lambda: (torch.randn(8, 16),)),
    }


@pytest.mark.parametrize("case", list(_cuda_cases()))
def test_module_matches_eager_on_cuda(case, deterministic):
    """`ep.module()`: outputs, gradients of inputs and parameters, buffers: eager's, bitwise,
    each run from the same RNG state (dropout draws the same masks); export leaves the model's
    state bit-identical and the graph functional."""
    from helpers import assert_same_tree, state_bits
    from predispatch.passes import mutable_ops

    make, inputs = _cuda_cases()[case]
    torch.manual_seed(0)
    model, args = make().cuda(), tuple(t.cuda() for t in inputs())
    eager, before = copy.deepcopy(model), state_bits(model)
    ep = predispatch.export(model, args)
    assert mutable_ops(ep.graph_module) == []
    assert_same_tree(state_bits(model), before)
    program = ep.module()
    outs = []
    for run in (eager, program):
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in args]
        torch.manual_seed(5)
        out = run(*xs)
        out.float().square().sum().backward()
        outs.append((out.detach(), [x.grad for x in xs]))
    assert_same_tree(outs[1], outs[0])
    params = dict(program.named_parameters())
    for name, p in eager.named_parameters():
        assert_same_tree(params[name].grad, p.grad)
    assert_same_tree(dict(sorted(program.state_dict().items())), dict(sorted(eager.state_dict().items())))


@pytest.mark.parametrize("case", list(_cuda_cases()))
def test_joint_matches_eager_on_cuda(case, deterministic):
    """`ep.joint()`: eager's outputs, gradients and buffers, bitwise; its backward ops, not
    autograd at run time, give the gradients (the program runs under no_grad).

    A batch norm runs with cuDNN off on both sides: eager's `F.batch_norm` picks cuDNN's kernel,
    while the joint, below autograd like torch's joint exporters, calls `native_batch_norm`'s
    (seen on an H100: 5e-7 apart on the same input, and the joint bitwise with cuDNN off)."""
    import contextlib

    from test_joint import Loss, check_joint

    make, inputs = _cuda_cases()[case]
    torch.manual_seed(0)
    model = Loss(make()).cuda()
    has_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    with torch.backends.cudnn.flags(enabled=False) if has_norm else contextlib.nullcontext():
        check_joint(model, tuple(t.cuda() for t in inputs()))


def test_sdpa_stays_one_node_and_runs_the_flash_kernel(deterministic):
    """The composite is kept whole, so on CUDA it dispatches to the fused kernel eager uses."""
    torch.manual_seed(0)
    model, x = Attention().cuda().half(), torch.randn(2, 32, 64, device="cuda", dtype=torch.half)
    ep = predispatch.export(model, (x,))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("aten.scaled_dot_product_attention.default") == 1, targets
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        ep.module()(x)
    kernels = " ".join(e.name for e in prof.events())
    assert "flash" in kernels.lower() or "fmha" in kernels.lower() or "attention" in kernels.lower(), kernels[:2000]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_gradients_of_q_k_v_on_cuda(deterministic):
    """On CUDA flex_attention backpropagates into q, k and v (on CPU torch refuses): the program's
    gradients are eager's."""
    from helpers import check_gradients

    class Flex(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("alibi", torch.tensor([0.5, 0.25]))

        def forward(self, q, k, v):
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - self.alibi[h] * (qi - ki).abs())

    qkv = tuple(torch.randn(1, 2, 128, 16, device="cuda") for _ in range(3))
    check_gradients(Flex().cuda(), qkv)


def test_to_torch_saved_with_torch_export_runs_on_cuda(tmp_path, deterministic):
    """torch.export.save/load of `to_torch()` of a CUDA program with a custom backward and a
    train-mode batch norm: outputs and gradients equal eager's after loading."""
    import predispatch.ops  # noqa: F401  (loading reads predispatch_autograd_function_apply)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.st = ConvNet().body, StraightThroughNet()

        def forward(self, x, y):
            return self.conv(x).sum() + self.st(y).sum()

    torch.manual_seed(0)
    model = Net().cuda().train()
    args = (torch.randn(2, 3, 12, 12, device="cuda"), torch.randn(4, 8, device="cuda"))
    eager = copy.deepcopy(model)
    torch.export.save(predispatch.export(model, args).to_torch(), tmp_path / "p.pt2")
    loaded = torch.export.load(tmp_path / "p.pt2").module()
    out_e, out_p = eager(*args), loaded(*args)
    torch.testing.assert_close(out_p, out_e, rtol=0, atol=0)
    out_e.backward()
    out_p.backward()
    params = dict(loaded.named_parameters())
    for name, p in eager.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=0, atol=0, msg=name)
