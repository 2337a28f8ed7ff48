"""How close `predispatch.export` is to the bare trace it is built on, and where torch.export is.

    python benchmarks/trace_floor.py [--reps 5] [--models resnet18 resnet50 vgg11 ...]

Three timings per timm model (eval and train, CPU time, medians of `--reps` warm runs, tools
alternated): the *floor*, a functional pre-dispatch trace with nothing else (the state and input
fakified with `from_tensor`, `FunctionalTensorMode` over `make_fx(pre_dispatch=True)`, no stack
traces, no isolation, no checks, no program built); `predispatch.export`; and
`torch.export.export(strict=False)`.  floor / torch.export bounds what any functional exporter
on torch's machinery can reach; pd - floor is what predispatch's promises and program cost.
A diagnostic for speed work: it uses torch's private tracing APIs directly, as the package
does only through `predispatch._torch_internals`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import predispatch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from timm_support import import_timm  # noqa: E402
from vision import build  # noqa: E402


def floor(model: torch.nn.Module, args: tuple) -> torch.fx.GraphModule:
    """The bare functional pre-dispatch trace of `model(*args)` (see the module docstring)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    fake_mode = FakeTensorMode()
    flat = [fake_mode.from_tensor(t, static_shapes=True) for t in (*(t for _, t in named), *args)]

    def run(*inputs):
        exclude = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
        with exclude, FunctionalTensorMode(pre_dispatch=True, export=True):
            wrapped = [FunctionalTensor.to_functional(t) for t in inputs]
            state = {name: t for (name, _), t in zip(named, wrapped)}
            out = torch.func.functional_call(model, state, tuple(wrapped[len(named):]))
            return torch.utils._pytree.tree_map_only(FunctionalTensor, lambda t: t.elem, out)

    with fake_mode, enable_python_dispatcher():
        return make_fx(run, record_module_stack=True, pre_dispatch=True)(*flat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--models", nargs="*", default=["vgg11", "resnet18", "resnet50"])
    opts = parser.parse_args()
    timm = import_timm()
    print("| model | mode | floor ms | predispatch ms | torch.export ms | floor / torch.export | pd / torch.export |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in opts.models:
        for mode in ("eval", "train"):
            model, args = build(timm, name, False, 64, mode)
            tools = {
                "floor": lambda: floor(model, args),
                "pd": lambda: predispatch.export(model, args),
                "te": lambda: torch.export.export(model, args, strict=False),
            }
            samples: dict[str, list[float]] = {tool: [] for tool in tools}
            for fn in tools.values():
                fn()  # warm-up
            for _ in range(opts.reps):
                for tool, fn in tools.items():
                    gc.collect()
                    start = time.process_time()
                    fn()
                    samples[tool].append(time.process_time() - start)
            ms = {tool: statistics.median(s) * 1e3 for tool, s in samples.items()}
            print(f"| {name} | {mode} | {ms['floor']:.1f} | {ms['pd']:.1f} | {ms['te']:.1f} "
                  f"| {ms['floor'] / ms['te']:.2f}x | {ms['pd'] / ms['te']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
