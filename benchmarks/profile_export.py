"""Where `predispatch.export` spends its time, by stage, on a few benchmark models.

    python benchmarks/profile_export.py [llama t5 ...] [--reps 3] [--cprofile 25]

Two views of warm exports (one untimed warm-up first):

- Stages, wall clock: the pipeline's stage functions, and the parts of the one trace (the
  user's forward, FX's per-node stack traces), are wrapped with timers (small overhead).
- cProfile: own time (tottime) summed by code area (predispatch's own files, AOTAutograd,
  functionalization, fake tensors, FX, ...), and predispatch's most expensive functions.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import contextlib
import functools
import pstats
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers

import predispatch
import predispatch._export as pipeline
import predispatch._torch_internals as ti
import predispatch.program.exported_program as program_stage
from predispatch.trace import functional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import BENCHES  # noqa: E402

#: (label, owner, attribute): callables timed in place; nested labels are indented.
STAGES = [
    ("export (total)", predispatch, "export"),
    ("  prepare: frontend", pipeline, "prepare"),
    ("  trace", pipeline, "trace"),
    ("    trace_program (the one functional make_fx pass)", ti, "trace_program"),
    ("      user forward under the tracer", functional._Program, "__call__"),
    ("      node stack traces (forward frames)", ti._ForwardFrames, "extract"),
    ("  build_program", pipeline, "build_program"),
    ("    name_placeholders", program_stage, "name_placeholders"),
    ("    remove_copies", program_stage, "remove_copies"),
    ("    wrap_regions", program_stage, "wrap_regions"),
    ("    check_functional", program_stage, "check_functional"),
    ("  fx recompile (all callers)", torch.fx.GraphModule, "recompile"),
]

#: Code areas for cProfile's own time, first match wins (path fragments).
AREAS = [
    ("predispatch (own code)", "/predispatch/"),
    ("transformers (the model's Python)", "/transformers/"),
    ("torch: functionalization", "functional_tensor.py"),
    ("torch: fake tensors", "/_subclasses/"),
    ("torch: make_fx / proxy tensors", "proxy_tensor.py"),
    ("torch: symbolic shapes", "symbolic_shapes.py"),
    ("torch: AOTAutograd", "/_functorch/"),
    ("torch: FX graph", "/torch/fx/"),
    ("torch: pytree", "_pytree.py"),
    ("torch: dispatch / ops", "/torch/_ops.py"),
    ("torch: nn.Module", "/torch/nn/"),
    ("torch: other Python", "/torch/"),
    ("C and builtins (kernels, dispatcher, isinstance, ...)", "~"),
    ("other packages (sympy, ...)", "site-packages"),
    ("Python stdlib (contextlib, weakref, functools, ...)", "/lib/python3"),
]


@contextlib.contextmanager
def stage_timers() -> Iterator[dict[str, list[float]]]:
    """Wrap each STAGES callable with a timer for the duration; yields label -> seconds per call."""
    times: dict[str, list[float]] = collections.defaultdict(list)
    saved = []
    for label, owner, name in STAGES:
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, functools.wraps(original)(_timed(original, times[label])))
    try:
        yield times
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _timed(fn, samples: list[float]):
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            samples.append(time.perf_counter() - start)

    return timed


def profile_stages(name: str, reps: int) -> list[str]:
    model, args, kwargs = next(b for b in BENCHES if b.name == name).make()
    predispatch.export(model, args, kwargs)  # warm-up
    with stage_timers() as times:
        for _ in range(reps):
            predispatch.export(model, args, kwargs)
    total = sum(times["export (total)"]) / reps
    lines = [f"### {name}: stages (mean of {reps} warm exports, wall clock)", "",
             "| stage | ms | % of export | calls per export |", "|---|---:|---:|---:|"]
    for label, _, _ in STAGES:
        samples = times[label]
        if not samples:
            continue
        per_export = sum(samples) / reps
        lines.append(f"| `{label.strip()}`{' (nested)' if label.startswith('    ') else ''} | {1e3 * per_export:.0f} "
                     f"| {100 * per_export / total:.0f}% | {len(samples) / reps:g} |")
    return lines


def profile_areas(name: str, top: int) -> list[str]:
    model, args, kwargs = next(b for b in BENCHES if b.name == name).make()
    predispatch.export(model, args, kwargs)  # warm-up
    profiler = cProfile.Profile()
    profiler.runcall(predispatch.export, model, args, kwargs)
    stats = pstats.Stats(profiler).stats  # (file, line, func) -> (cc, nc, tottime, cumtime, callers)
    total = sum(v[2] for v in stats.values())
    by_area: dict[str, float] = collections.defaultdict(float)
    own: list[tuple[float, float, int, str]] = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.items():
        area = next((label for label, fragment in AREAS if fragment in file), "other")
        by_area[area] += tottime
        if "/predispatch/" in file:
            own.append((tottime, cumtime, ncalls, f"{file.split('/predispatch/')[-1]}:{line} {func}"))
    lines = [f"### {name}: own time by code area (cProfile, {total:.2f} s under the profiler)", "",
             "| area | s | % |", "|---|---:|---:|"]
    for area, seconds in sorted(by_area.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {area} | {seconds:.3f} | {100 * seconds / total:.1f}% |")
    lines += ["", f"predispatch's own functions, by own time (top {top}):", "",
              "| function | own s | cumulative s | calls |", "|---|---:|---:|---:|"]
    for tottime, cumtime, ncalls, where in sorted(own, reverse=True)[:top]:
        lines.append(f"| `{where}` | {tottime:.4f} | {cumtime:.3f} | {ncalls} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="*", default=["llama", "t5"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cprofile", type=int, default=20, help="how many of predispatch's functions to list")
    opts = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    out = []
    for name in opts.models:
        out += [*profile_stages(name, opts.reps), "", *profile_areas(name, opts.cprofile), ""]
    print("\n".join(out))


if __name__ == "__main__":
    main()
