"""What `ep.module()` costs at run time, side by side with torch.export's module, in one run.

    python benchmarks/module_cost.py [--reps 15] [--calls 200] [--mib 256] [--threads 1] [--out benchmarks/results.md]

Two measurements (issue 25, items 1 and 2):

1. Memory `module()` adds: a model of `--mib` MiB of float32 weights (eight square linear
   layers) is exported by both tools, and each tool's `module()` is built three times.  Reported
   per `module()` call: the growth of the process's resident memory (/proc/self/statm), and the
   bytes of tensor storage the module holds that the model does not (exact, noise-free).
2. Per-call time: a small MLP with BatchNorm in train mode (batch 8), forward alone and
   forward+backward, `--calls` calls per timing, `--reps` timings per tool, tools interleaved
   (A B A B ...), after a warm-up; reported as the median per-call time and the median of the
   per-pair ratios predispatch / torch.export.

`--threads` sets torch's intra-op threads (1 by default: on a shared machine a second thread
mostly adds waiting, which both tools pay alike and which hides the per-call difference).
Prints a markdown section; with `--out FILE`, also writes it there (replacing its earlier version, or
appended; benchmarks/run.py keeps it when it rewrites the file).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import predispatch

#: How each tool turns `(model, args)` into the module a user runs.
TOOLS: dict[str, Callable[[nn.Module, tuple], nn.Module]] = {
    "predispatch": lambda m, a: predispatch.export(m, a).module(),
    "torch.export": lambda m, a: torch.export.export(m, a, strict=False).module(),
}


def _rss_bytes() -> int:
    """The process's resident memory now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _storages(tensors) -> dict[int, int]:
    """Storage address -> bytes, each storage once."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def _big_model(mib: int) -> nn.Module:
    """Eight square linear layers holding `mib` MiB of float32 weights in all."""
    width = int((mib * 2**20 / 4 / 8) ** 0.5)
    return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(8)))


def memory_added(mib: int) -> dict[str, tuple[float, float]]:
    """Per tool: (MiB of resident memory, MiB of new tensor storage) one `module()` adds."""
    model = _big_model(mib)
    args = (torch.randn(2, model[0].in_features),)
    own = _storages(model.state_dict(keep_vars=True).values())
    results = {}
    for name, make in TOOLS.items():
        exported = predispatch.export(model, args) if name == "predispatch" else torch.export.export(model, args, strict=False)
        gc.collect()
        before, modules = _rss_bytes(), []
        for _ in range(3):
            modules.append(exported.module())
        gc.collect()
        grown = (_rss_bytes() - before) / 3
        held = [t for m in modules for t in (*m.parameters(), *m.buffers())]
        new = sum(n for ptr, n in _storages(held).items() if ptr not in own) / 3
        results[name] = (grown / 2**20, new / 2**20)
        del modules, exported
        gc.collect()
    return results


class MlpBn(nn.Module):
    """The small MLP with BatchNorm of issue 25 (train mode)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


def _per_call(module: nn.Module, x: torch.Tensor, calls: int, backward: bool) -> float:
    """Seconds per call over `calls` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        out = module(x)
        if backward:
            out.sum().backward()
    return (time.perf_counter() - start) / calls


def call_times(reps: int, calls: int) -> dict[str, tuple[float, float, float]]:
    """Per phase: (predispatch µs, torch.export µs, median ratio of interleaved pairs)."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    modules = {name: make(MlpBn().train(), (x,)) for name, make in TOOLS.items()}
    results = {}
    for phase, backward in (("forward", False), ("forward+backward", True)):
        times: dict[str, list[float]] = {name: [] for name in modules}
        for name, module in modules.items():
            _per_call(module, x, calls // 4, backward)  # warm-up
        for _ in range(reps):
            for name, module in modules.items():
                times[name].append(_per_call(module, x, calls, backward))
        pd, te = times["predispatch"], times["torch.export"]
        ratio = statistics.median(a / b for a, b in zip(pd, te))
        results[phase] = (statistics.median(pd) * 1e6, statistics.median(te) * 1e6, ratio)
    return results


#: This benchmark's heading in benchmarks/results.md (benchmarks/run.py keeps the section).
SECTION = "## ep.module() at run time (issue 25)"


def write_section(path: Path, text: str) -> None:
    """Put `text` (this benchmark's section) into `path`: in place of its earlier version, up to
    the next `## ` heading, or at the end; the rest of the file stays as it is."""
    old = path.read_text() if path.exists() else ""
    if SECTION not in old:
        path.write_text(old.rstrip("\n") + "\n\n" + text)
        return
    head, tail = old.split(SECTION, 1)
    rest = tail[tail.index("\n## ") + 1 :] if "\n## " in tail else ""
    path.write_text(head + text + ("\n" + rest if rest else ""))


def report(mib: int, reps: int, calls: int) -> str:
    """The markdown section."""
    memory = memory_added(mib)
    timing = call_times(reps, calls)
    lines = [
        SECTION,
        "",
        f"`python benchmarks/module_cost.py --reps {reps} --calls {calls} --mib {mib} --threads {torch.get_num_threads()}`: torch {torch.__version__}, "
        f"Python {platform.python_version()}, torch threads {torch.get_num_threads()}.",
        "",
        f"Memory one `module()` call adds, for a model of {mib} MiB of float32 weights (mean of three calls):",
        "",
        "| tool | resident memory added MiB | new tensor storage MiB | % of the model |",
        "|---|---:|---:|---:|",
    ]
    for name, (grown, new) in memory.items():
        lines.append(f"| {name} | {grown:.1f} | {new:.1f} | {100 * max(grown, new) / mib:.1f}% |")
    lines += [
        "",
        f"Per call, a small MLP with BatchNorm in train mode (batch 8; median of {reps} timings of {calls} calls, tools interleaved):",
        "",
        "| phase | ep.module() µs | torch.export module µs | ep.module() / torch.export (median of pairs) |",
        "|---|---:|---:|---:|",
    ]
    for phase, (pd, te, ratio) in timing.items():
        lines.append(f"| {phase} | {pd:.1f} | {te:.1f} | {ratio:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="also replace this section of a results file (results.md keeps curated history: off by default)")
    options = parser.parse_args(argv)
    torch.set_num_threads(options.threads)
    text = report(options.mib, options.reps, options.calls)
    sys.stdout.write(text)
    if options.out:
        write_section(options.out, text)


if __name__ == "__main__":
    main()
