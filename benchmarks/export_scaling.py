"""How export time grows with the parameters and the ops of a model (issue 40), in one run.

    python benchmarks/export_scaling.py [--reps 3] [--families experts ema ops] [--n N] [--big]
                                        [--tools predispatch torch.export] [--label TEXT]
                                        [--out benchmarks/results.md]

Each family is a model made at two sizes, n and 2n, exported by predispatch and by
`torch.export.export(strict=False)`; the time is the process's CPU time of one export (fake
tensors compute nothing: an export's CPU time is its Python time, which other processes' load on
a shared machine inflates far less than wall time), the median of `--reps` repetitions after one
untimed warm-up per tool, the tools and sizes interleaved.  Printed: each time, and the doubling
ratio t(2n) / t(n).  Target: doubling the parameters or the ops costs predispatch at most 2.2x.

Families (pure torch, tiny tensors, so the time is export's own work per parameter or op):
    experts    n unfused MoE experts, a ModuleList of `Linear(4, 4)`s all used in forward:
               n parameter tensors, n ops
    ema        n parameters updated in place under no_grad (an EMA), then used: n parameter
               tensors, 2n ops, n state writes
    functions  a custom autograd.Function per parameter (slow: each call's capture traces the
               Function with a make_fx of its own, see Note in the section printed)
    ops        a chain of elementwise ops on one parameter: 2 * n ops, parameters fixed
`--n N`: every family measured at N and 2N instead of its own n.
`--big`: predispatch alone on the experts family at 5000 and 10000 experts, once each.
`--families` defaults to experts, ema and ops; functions takes minutes (before issue 40's fixes,
its 800 calls took half a minute an export).

Prints a markdown section; with `--out FILE`, also appends it to the file, under `--label`
(the checkout measured) in this benchmark's section (earlier runs stay: results.md keeps history).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import predispatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from scaling_cases import FunctionCalls, UpdatedUnderNoGrad  # noqa: E402  (shared with tests/test_export_scaling.py)


class Experts(nn.Module):
    """`n` unfused experts, each used once (a MoE layer whose experts are separate modules)."""

    def __init__(self, n: int):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4, bias=False) for _ in range(n))

    def forward(self, x):
        for expert in self.experts:
            x = expert(x)
        return x


class Ops(nn.Module):
    """`2 * n` elementwise ops on one parameter."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        for _ in range(self.n):
            x = x * 1.0001 + self.w
        return x


#: family -> (model maker, n, what doubles).
FAMILIES: dict[str, tuple[Callable[[int], nn.Module], int, str]] = {
    "experts": (Experts, 2500, "parameters and ops"),
    "ema": (UpdatedUnderNoGrad, 2500, "parameters written under no_grad"),
    "functions": (FunctionCalls, 400, "Function calls and parameters"),
    "ops": (Ops, 2500, "ops, parameters fixed"),
}

#: How each tool exports.
TOOLS: dict[str, Callable[[nn.Module, tuple], object]] = {
    "predispatch": lambda m, a: predispatch.export(m, a),
    "torch.export": lambda m, a: torch.export.export(m, a, strict=False),
}

TARGET = 2.2


def cpu_seconds(tool: str, model: nn.Module, args: tuple) -> float:
    """The CPU time of one export, after collecting what earlier ones left."""
    gc.collect()
    start = time.process_time()
    TOOLS[tool](model, args)
    return time.process_time() - start


def measure(family: str, n: int, reps: int, tools: list[str]) -> dict[tuple[str, int], float]:
    """(tool, size) -> median CPU seconds, sizes n and 2n, tools and sizes interleaved."""
    make = FAMILIES[family][0]
    args = (torch.randn(2, 4),)
    models = {size: make(size) for size in (n, 2 * n)}
    for tool in tools:
        TOOLS[tool](make(8), args)  # warm-up: imports and caches are no size's
    samples: dict[tuple[str, int], list[float]] = {(tool, size): [] for tool in tools for size in models}
    for _ in range(reps):
        for size, model in models.items():
            for tool in tools:
                samples[(tool, size)].append(cpu_seconds(tool, model, args))
    return {key: statistics.median(values) for key, values in samples.items()}


def big_experts() -> list[tuple[int, float]]:
    """predispatch alone, experts family at 5000 and 10000, once each."""
    args = (torch.randn(2, 4),)
    return [(n, cpu_seconds("predispatch", Experts(n), args)) for n in (5000, 10000)]


SECTION = "## Export scaling: parameters and ops doubled (issue 40)"


def _commit() -> str:
    """The checkout predispatch was imported from (its short commit), if it is a git checkout."""
    where = os.path.dirname(os.path.dirname(predispatch.__file__))
    try:
        return subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def report(
    results: dict[str, dict[tuple[str, int], float]], sizes: dict[str, int], big: list[tuple[int, float]], reps: int, label: str, command: str
) -> list[str]:
    """This run's block of the section: a table and the target."""
    lines = [
        f"### {label}",
        "",
        f"`{command}`: predispatch at {_commit()}, torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}; CPU seconds, median of {reps}.",
        "",
        "| family (what doubles) | n | predispatch t(n) s | t(2n) s | **ratio** | torch.export t(n) s | t(2n) s | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    worst = []
    for family, times in results.items():
        n, what = sizes[family], FAMILIES[family][2]
        cells = []
        for tool in TOOLS:
            if (tool, n) in times:
                ratio = times[(tool, 2 * n)] / times[(tool, n)]
                cells += [f"{times[(tool, n)]:.2f}", f"{times[(tool, 2 * n)]:.2f}", f"**{ratio:.2f}x**" if tool == "predispatch" else f"{ratio:.2f}x"]
                if tool == "predispatch" and family != "functions":
                    worst.append((ratio, family))
            else:
                cells += ["-", "-", "-"]
        lines.append(f"| {family}: {what} | {n} | {' | '.join(cells)} |")
    if big:
        lines += ["", "predispatch, experts family, once each: " + ", ".join(f"{n} experts {t:.1f} s" for n, t in big)
                  + (f" (ratio {big[1][1] / big[0][1]:.2f}x)" if len(big) == 2 else "") + "."]
    if worst:
        ratio, family = max(worst)
        lines += ["", f"Target: doubling parameters or ops costs predispatch at most {TARGET}x (worst: {family}, "
                  f"{ratio:.2f}x): **{'met' if ratio <= TARGET else 'NOT met'}**."]
    if "functions" in results:
        lines += ["", "Note: in the functions family each captured call traces the Function with a make_fx of its own, "
                  "and torch's tracer patches `nn.Module.__getattr__`/`__call__` for each trace (`torch.fx._symbolic_trace."
                  "_Patcher.patch_method`); assigning a class's dunder makes CPython update every subclass, one of which "
                  "is made per `fx.GraphModule` (FX gives each its own class), so each call costs more as the captured "
                  "graphs accumulate: torch's cost, left out of the target."]
    return lines


def write(path: Path, block: list[str]) -> None:
    """Append `block` at the end of this benchmark's section of `path` (made if missing); the
    rest of the file, earlier runs included, stays as it is."""
    text = path.read_text() if path.exists() else ""
    if SECTION not in text:
        path.write_text(text.rstrip("\n") + "\n\n" + SECTION + "\n\n" + "\n".join(block) + "\n")
        return
    head, tail = text.split(SECTION, 1)
    end = tail.find("\n## ")
    section, rest = (tail, "") if end < 0 else (tail[: end + 1], tail[end + 1 :])
    path.write_text(head + SECTION + section.rstrip("\n") + "\n\n" + "\n".join(block) + "\n" + ("\n" + rest if rest else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--families", nargs="*", default=["experts", "ema", "ops"], choices=sorted(FAMILIES))
    parser.add_argument("--tools", nargs="*", default=list(TOOLS), choices=list(TOOLS))
    parser.add_argument("--n", type=int, default=None, help="measure every family at N and 2N (default: each family's own n)")
    parser.add_argument("--big", action="store_true", help="also predispatch alone at 5000 and 10000 experts, once each")
    parser.add_argument("--label", default=None, help="this run's heading in --out (default: the commit measured)")
    parser.add_argument("--out", type=Path, default=None, help="also append this run to this benchmark's section of a results file")
    opts = parser.parse_args()
    torch.manual_seed(0)
    results = {}
    sizes = {family: opts.n or FAMILIES[family][1] for family in opts.families}
    for family in opts.families:
        results[family] = measure(family, sizes[family], opts.reps, opts.tools)
        print(f"  {family}: {results[family]}", flush=True)
    big = big_experts() if opts.big else []
    command = "python benchmarks/export_scaling.py " + " ".join(
        [f"--reps {opts.reps}", f"--families {' '.join(opts.families)}", *([f"--n {opts.n}"] if opts.n else []),
         *([f"--tools {' '.join(opts.tools)}"] if opts.tools != list(TOOLS) else []), *(["--big"] if opts.big else [])]
    )
    block = report(results, sizes, big, opts.reps, opts.label or f"predispatch {_commit()}", command)
    print("\n".join(block))
    if opts.out:
        write(opts.out, block)


if __name__ == "__main__":
    main()
