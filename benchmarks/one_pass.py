"""What a one-pass functional trace would cost: a measurement prototype, not predispatch code.

    python benchmarks/one_pass.py [gpt2 llama t5 whisper ...] [--reps 7]

`predispatch.export` traces through AOTAutograd's `aot_export_module`, which runs the user's
forward twice (a metadata pass, then a capture pass; see benchmarks/profile_export.py).  This
prototype traces once: `make_fx(pre_dispatch=True)` over a function that wraps its inputs in
FunctionalTensors under `FunctionalTensorMode(pre_dispatch=True, export=True)`, runs the
model, and returns the new values of the inputs it mutated (found with
`torch._functionalize_has_data_mutation`) before its outputs.  It has none of predispatch's
work (decomposition policy, grad regions, autograd.Function capture, signature, checks), so it
bounds from below what a one-pass trace stage could cost.  It checks its graph is functional
and computes eager's outputs bitwise (train mode, same RNG seed), then times it against
`predispatch.export` and `torch.export.export(strict=False)`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.utils._pytree as pytree
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.nn.utils.stateless import _reparametrize_module

import predispatch
from predispatch import _torch_internals as ti
from predispatch.passes import mutable_ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import BENCHES  # noqa: E402


def one_pass(model: torch.nn.Module, args: tuple, kwargs: dict, **make_fx_options) -> torch.fx.GraphModule:
    """A functional pre-dispatch graph of `model(*args, **kwargs)`: inputs `(*state, *user)`."""
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [*state.values(), *(x for x in flat if isinstance(x, torch.Tensor))]
    fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]

    def functional(*inputs):
        mode = FunctionalTensorMode(pre_dispatch=True, export=True)
        with mode:
            wrapped = [FunctionalTensor.to_functional(t) for t in inputs]
        user = iter(wrapped[len(state):])
        call_args, call_kwargs = pytree.tree_unflatten(
            [next(user) if isinstance(x, torch.Tensor) else x for x in flat], spec
        )
        with mode, _reparametrize_module(model, dict(zip(state, wrapped)), tie_weights=True), ti.exporting_flags():
            out = model(*call_args, **call_kwargs)
        mutated = []
        for t in wrapped:
            torch._sync(t)
            if torch._functionalize_has_data_mutation(t.elem):
                mutated.append(torch._from_functional_tensor(t.elem))
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return (*mutated, *(torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t for t in outs))

    with fake_mode, torch.enable_grad():
        return make_fx(functional, pre_dispatch=True, **make_fx_options)(*fakes)


def check(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """The prototype's graph is functional and gives eager's outputs bitwise; returns its size."""
    gm = one_pass(model, args, kwargs)
    assert mutable_ops(gm) == [], mutable_ops(gm)
    state = [*dict(model.named_parameters()).values(), *dict(model.named_buffers()).values()]
    user = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    torch.manual_seed(1)
    got = gm(*state, *user)
    torch.manual_seed(1)
    expected = [t for t in pytree.tree_leaves(model(*args, **kwargs)) if isinstance(t, torch.Tensor)]
    assert len(got) == len(expected) and all(torch.equal(g, e) for g, e in zip(got, expected))
    return len(gm.graph.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["gpt2", "llama", "t5", "whisper"])
    parser.add_argument("--reps", type=int, default=7)
    opts = parser.parse_args()
    transformers.logging.set_verbosity_error()
    print("| model | one-pass nodes | predispatch ms | one-pass ms | one-pass + module stack + stack traces ms "
          "| torch.export ms | one-pass / predispatch | one-pass / torch.export | with metadata / torch.export |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in opts.models:
        model, args, kwargs = next(b for b in BENCHES if b.name == name).make()
        nodes = check(model, args, kwargs)
        tools = {
            "predispatch": lambda: predispatch.export(model, args, kwargs),
            "one-pass": lambda: one_pass(model, args, kwargs),
            "one-pass+meta": lambda: one_pass(model, args, kwargs, record_module_stack=True, record_stack_traces=True),
            "torch.export": lambda: torch.export.export(model, args, kwargs, strict=False),
        }
        samples: dict[str, list[float]] = {tool: [] for tool in tools}
        for i in range(opts.reps + 1):
            for tool, fn in tools.items():
                gc.collect()
                start = time.perf_counter()
                fn()
                if i:  # the first round warms up
                    samples[tool].append(time.perf_counter() - start)
        ms = {tool: 1e3 * statistics.median(s) for tool, s in samples.items()}
        print(f"| {name} | {nodes} | {ms['predispatch']:.0f} | {ms['one-pass']:.0f} | {ms['one-pass+meta']:.0f} "
              f"| {ms['torch.export']:.0f} | {ms['one-pass'] / ms['predispatch']:.2f}x "
              f"| {ms['one-pass'] / ms['torch.export']:.2f}x | {ms['one-pass+meta'] / ms['torch.export']:.2f}x |")


if __name__ == "__main__":
    main()
