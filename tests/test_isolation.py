"""Nothing changes but the result: the module and torch's globals after export, on success and failure."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from helpers import state_bits
from torch import nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch._isolation import GlobalState


class Model(nn.Module):
    """Touches global state the way real forwards do, then optionally fails."""

    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps.add_(1)
        y = self.bn(self.lin(x))
        torch.set_grad_enabled(False)  # left open, as a plain call
        self.bn.eval()  # flips a training flag
        torch.set_default_dtype(torch.float64)
        torch.autocast("cpu", dtype=torch.bfloat16).__enter__()  # never exited
        if self.fail:
            raise RuntimeError("boom")
        return y


class PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _snapshot(model: nn.Module):
    def hooks(m):
        return (dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks), dict(m._state_dict_hooks))

    return {
        "global": GlobalState.capture(),
        "inference": torch.is_inference_mode_enabled(),
        "state": state_bits(model),
        "params": {n: id(p) for n, p in model.named_parameters()},
        "training": [(n, m.training) for n, m in model.named_modules()],
        "hooks": [hooks(m) for m in model.modules()],
    }


def _assert_unchanged(before, model):
    after = _snapshot(model)
    g0, g1 = before["global"], after["global"]
    for field in ("grad_enabled", "default_dtype", "autocast", "autocast_cache", "mode_depths", "compiler_flags"):
        assert getattr(g0, field) == getattr(g1, field), field
    assert torch.equal(g0.rng_state, g1.rng_state)
    assert before["inference"] == after["inference"]
    assert before["params"] == after["params"]
    assert before["training"] == after["training"]
    assert before["hooks"] == after["hooks"]
    assert before["state"].keys() == after["state"].keys()
    for key, value in before["state"].items():
        assert torch.equal(value, after["state"][key]), key


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_module_and_globals_restored(fail, mode):
    model = Model(fail).train(mode == "train")
    model.lin.register_forward_hook(lambda m, i, o: o)
    x = torch.randn(4, 3)
    before = _snapshot(model)
    with pytest.raises(predispatch.errors.TraceError) if fail else contextlib.nullcontext():
        predispatch.export(model, (x,))
    _assert_unchanged(before, model)


def test_restored_under_outer_modes():
    """Exporting from inside no_grad and a dispatch mode leaves both in place."""
    model, x = Model(fail=True), torch.randn(4, 3)
    with torch.no_grad(), PassThrough():
        depths = ti.mode_stack_depths()
        with pytest.raises(predispatch.errors.TraceError):
            predispatch.export(model, (x,))
        assert ti.mode_stack_depths() == depths
        assert not torch.is_grad_enabled()


def test_bad_input_changes_nothing():
    model, x = Model(fail=False), torch.randn(4, 3)
    before = _snapshot(model)
    with pytest.raises(predispatch.errors.UnsupportedInputError):
        predispatch.export(model, x)
    _assert_unchanged(before, model)


def test_no_garbage_collection_during_the_trace():
    """The cyclic collector runs finalizers (Python code: a half-read generator under no_grad
    closes by toggling grad mode) at any allocation; inside a trace they would run under the
    tracer's modes, so collection waits until the trace is done, and is on again after."""
    from predispatch.trace.functional import is_tracing

    during = []

    def watch(phase, info):
        if phase == "start":
            during.append(is_tracing())

    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)  # collect at nearly every allocation
    gc.callbacks.append(watch)
    try:
        predispatch.export(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), (torch.randn(2, 3),))
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*threshold)
    assert during and not any(during), "a collection ran while tracing"
    assert gc.isenabled()
