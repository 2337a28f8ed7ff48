"""Speed and memory of `predispatch.export` against `torch.export`, as ratios, in one run.

    python benchmarks/run.py [--reps 5] [--out benchmarks/results.md]

Four measurements, on the models of benchmarks/models.py (train mode, loss in the graph):

1. Export wall time of `predispatch.export`, of `torch.export.export(..., strict=False)` and of
   `torch.export.export(...).run_decompositions({})` (torch's way to a functional graph), each
   the median of `--reps` warm repetitions (one untimed warm-up first, tools interleaved), as
   ratios, with the time per graph node (each tool's own node count).
2. Depth scaling: a Llama-style decoder (hidden 64) at 2, 8, 32 and 80 layers, predispatch
   (repeated layers shared, trace/dedup/) against its inline trace (`dedup=False`) and
   torch.export; the ratios of issue 15 (32/2 <= 2.5x, 80/2 <= 4x, a replayed layer <= 10% of a
   traced one, torch.export >= 4x predispatch's time at 32 layers).
3. Peak memory of exporting the 7-billion-parameter Llama and a 70B-shaped one (80 layers)
   built on the meta device, each tool in a fresh process (benchmarks/peak_memory.py: the
   process's own peak resident memory).
4. Forward time of `ep.module()` against the eager model (median of many calls), on the same
   models and on a wider Llama where compute rather than Python overhead fills a call.
5. The vision zoo (benchmarks/vision.py: 43 timm models, eval and train) against torch.export:
   the per-model table goes to benchmarks/vision_results.md, the summary to `--out`.

The joint-program section (benchmarks/joint.py writes it), the section on `ep.module()`'s
run-time cost (benchmarks/module_cost.py writes it) and the export-scaling section
(benchmarks/export_scaling.py writes it) are kept as they are in `--out`.

Targets (issue 7): predispatch at most 0.5x export+run_decompositions and at most 1.0x plain
torch.export (median over the models); time per layer flat with depth; 7B export under 4 GiB.
Prints markdown and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

import predispatch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from models import BENCHES, WIDE, llama  # noqa: E402  (a sibling file, not a package)

#: How each tool exports `(model, args, kwargs)`; every one returns an object with `.graph`.
TOOLS: dict[str, Callable[[Any, tuple, dict], Any]] = {
    "predispatch": lambda m, a, k: predispatch.export(m, a, k),
    "torch.export": lambda m, a, k: torch.export.export(m, a, k, strict=False),
    "torch.export+decomp": lambda m, a, k: torch.export.export(m, a, k, strict=False).run_decompositions({}),
    "predispatch inline": lambda m, a, k: predispatch.export(m, a, k, dedup=False),
}
DEPTHS = (2, 8, 32, 80)
#: Which tools each depth times: the targets compare predispatch across depths, against its
#: inline trace at 2 and 8 layers (the cost of a traced layer), against torch.export at 32.
DEPTH_TOOLS = {
    2: ["predispatch", "predispatch inline", "torch.export"],
    8: ["predispatch", "predispatch inline", "torch.export"],
    32: ["predispatch", "predispatch inline", "torch.export"],
    80: ["predispatch"],
}


@dataclass(frozen=True)
class ExportTimes:
    """Median warm export seconds and graph sizes of one model, per tool.

    seconds / nodes: tool -> value; a tool that failed is absent, its error in `errors`.
    """

    name: str
    seconds: dict[str, float]
    nodes: dict[str, int]
    errors: dict[str, str]

    def ratio(self, tool: str, baseline: str) -> float | None:
        if tool in self.seconds and baseline in self.seconds:
            return self.seconds[tool] / self.seconds[baseline]
        return None


#: The clock every timing here reads: wall time by default; `--clock cpu` (vision.py,
#: joint_depth.py) reads the process's CPU time, which other processes' load on a shared machine
#: inflates far less (fake tensors compute nothing, so the trace's CPU time is its Python time).
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = CLOCKS["wall"]


def time_exports(name: str, model: Any, args: tuple, kwargs: dict, reps: int, tools: list[str]) -> ExportTimes:
    """Warm up each tool once, then time `reps` rounds, the tools interleaved in each round."""
    nodes, errors = {}, {}
    for tool in tools:
        try:
            nodes[tool] = len(TOOLS[tool](model, args, kwargs).graph.nodes)
        except Exception as exc:  # noqa: BLE001 - a failing tool is reported, not fatal
            errors[tool] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"
    samples: dict[str, list[float]] = {tool: [] for tool in nodes}
    for _ in range(reps):
        for tool in samples:
            gc.collect()
            start = CLOCK()
            TOOLS[tool](model, args, kwargs)
            samples[tool].append(CLOCK() - start)
    return ExportTimes(name, {t: statistics.median(s) for t, s in samples.items()}, nodes, errors)


def time_depths(reps: int) -> list[ExportTimes]:
    """`time_exports` for the Llama decoder at every depth, with the depths interleaved too: each
    round times every (depth, tool) once, so load from other processes falls on all depths
    alike and the ratios between depths stay meaningful on a shared machine."""
    ids = torch.randint(0, 128, (2, 16))
    models = {}
    for depth in DEPTHS:
        torch.manual_seed(0)
        models[depth] = llama(depth).train()
    nodes: dict[int, dict[str, int]] = {d: {} for d in DEPTHS}
    samples: dict[int, dict[str, list[float]]] = {d: {t: [] for t in DEPTH_TOOLS[d]} for d in DEPTHS}
    for depth, tools in DEPTH_TOOLS.items():  # the untimed warm-up
        for tool in tools:
            nodes[depth][tool] = len(TOOLS[tool](models[depth], (ids,), {"labels": ids}).graph.nodes)
    for _ in range(reps):
        for depth, tools in DEPTH_TOOLS.items():
            for tool in tools:
                gc.collect()
                start = time.perf_counter()
                TOOLS[tool](models[depth], (ids,), {"labels": ids})
                samples[depth][tool].append(time.perf_counter() - start)
    return [
        ExportTimes(f"llama-{d}", {t: statistics.median(s) for t, s in samples[d].items()}, nodes[d], {})
        for d in DEPTHS
    ]


def forward_ratio(model: Any, args: tuple, kwargs: dict, calls: int = 30) -> tuple[float, float] | None:
    """Median seconds of one forward call: (eager, ep.module()), the two calls alternated so
    that load from other processes falls on both alike."""
    try:
        program = predispatch.export(model, args, kwargs).module()
    except Exception:  # noqa: BLE001
        return None
    samples: dict[nn.Module, list[float]] = {model: [], program: []}
    for i in range(calls + 3):
        for fn in samples:
            start = time.perf_counter()
            fn(*args, **kwargs)
            if i >= 3:  # the first calls warm up
                samples[fn].append(time.perf_counter() - start)
    return statistics.median(samples[model]), statistics.median(samples[program])


def peak_memory(tool: str, size: str = "7b") -> dict:
    done = subprocess.run(
        [sys.executable, str(HERE / "peak_memory.py"), tool, size], capture_output=True, text=True, env=os.environ.copy()
    )
    if done.returncode != 0:
        return {"tool": tool, "size": size, "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- rendering ----------------------------------------------------------------------------------


def _fmt(value: float | None, spec: str) -> str:
    return "fail" if value is None else format(value, spec)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def export_table(rows: list[ExportTimes]) -> list[str]:
    pd, te, rd = "predispatch", "torch.export", "torch.export+decomp"
    lines = [
        "| model | predispatch s | torch.export s | export+decomp s | pd / torch.export | pd / export+decomp "
        "| pd µs/node (nodes) | torch.export µs/node (nodes) | export+decomp µs/node (nodes) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_node = [
            f"{1e6 * r.seconds[t] / r.nodes[t]:.0f} ({r.nodes[t]})" if t in r.seconds else "fail" for t in (pd, te, rd)
        ]
        lines.append(
            f"| {r.name} | {_fmt(r.seconds.get(pd), '.3f')} | {_fmt(r.seconds.get(te), '.3f')} "
            f"| {_fmt(r.seconds.get(rd), '.3f')} | {_fmt(r.ratio(pd, te), '.2f')}x | {_fmt(r.ratio(pd, rd), '.2f')}x "
            f"| {' | '.join(per_node)} |"
        )
    to_te, to_rd = _median([r.ratio(pd, te) for r in rows]), _median([r.ratio(pd, rd) for r in rows])
    lines.append(f"| **median** | | | | **{_fmt(to_te, '.2f')}x** | **{_fmt(to_rd, '.2f')}x** | | | |")
    slowest = max(((r.ratio(pd, te), r.name) for r in rows if r.ratio(pd, te) is not None), default=None)
    lines.append("")
    lines.append(f"Targets: pd / torch.export <= 1.0x: **{_verdict(to_te, 1.0)}**; "
                 f"pd / export+decomp <= 0.5x: **{_verdict(to_rd, 0.5)}**; no model slower than torch.export "
                 f"(issue 15; slowest: {slowest and slowest[1]} at {_fmt(slowest and slowest[0], '.2f')}x): "
                 f"**{_verdict(slowest and slowest[0], 1.0)}**.")
    for r in rows:
        for tool, error in r.errors.items():
            lines.append(f"- {r.name}, {tool} failed: `{error}`")
    return lines


def _verdict(value: float | None, target: float) -> str:
    return "n/a" if value is None else ("met" if value <= target else "not met")


def depth_table(rows: list[ExportTimes]) -> list[str]:
    tools = ("predispatch", "predispatch inline", "torch.export")
    lines = [
        "| layers | predispatch s | ms/layer | nodes | predispatch inline s | ms/layer | torch.export s | ms/layer "
        "| pd / torch.export | torch.export / pd |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for depth, r in zip(DEPTHS, rows):
        cells = []
        for tool in tools:
            s = r.seconds.get(tool)
            cells += ["-", "-"] if s is None else [f"{s:.3f}", f"{1e3 * s / depth:.1f}"]
            if tool == "predispatch":
                cells.append(str(r.nodes.get(tool, "-")))
        ratios = [r.ratio("predispatch", "torch.export"), r.ratio("torch.export", "predispatch")]
        lines.append(f"| {depth} | {' | '.join(cells)} | {' | '.join('-' if x is None else f'{x:.2f}x' for x in ratios)} |")
    lines.append("")
    lines += _depth_targets({d: r for d, r in zip(DEPTHS, rows)})
    return lines


def _depth_targets(by_depth: dict[int, ExportTimes]) -> list[str]:
    """Issue 15's targets: depth ratios, the marginal replayed layer against a traced one, and
    the speed-up over torch.export at 32 layers."""
    pd = {d: r.seconds.get("predispatch") for d, r in by_depth.items()}
    inline = {d: r.seconds.get("predispatch inline") for d, r in by_depth.items()}
    r32 = pd[32] / pd[2] if pd[32] and pd[2] else None
    r80 = pd[80] / pd[2] if pd[80] and pd[2] else None
    replayed = (pd[80] - pd[32]) / 48 if pd[80] and pd[32] else None
    traced = (inline[8] - inline[2]) / 6 if inline[8] and inline[2] else None
    share = replayed / traced if replayed is not None and traced else None
    speedup = by_depth[32].ratio("torch.export", "predispatch")
    return [
        f"- 32 layers / 2 layers: **{_fmt(r32, '.2f')}x** (target <= 2.5x: **{_verdict(r32, 2.5)}**); "
        f"80 layers / 2 layers: **{_fmt(r80, '.2f')}x** (target <= 4x: **{_verdict(r80, 4.0)}**).",
        f"- Marginal cost of a replayed layer, (t(80) - t(32)) / 48: {_fmt(None if replayed is None else 1e3 * replayed, '.1f')} ms; "
        f"of a traced layer (dedup=False), (t(8) - t(2)) / 6: {_fmt(None if traced is None else 1e3 * traced, '.1f')} ms; "
        f"ratio **{_fmt(None if share is None else 100 * share, '.1f')}%** (target <= 10%: **{_verdict(share, 0.10)}**).",
        f"- 32 layers: torch.export takes **{_fmt(speedup, '.2f')}x** predispatch's time "
        f"(target >= 4x: **{'n/a' if speedup is None else ('met' if speedup >= 4 else 'not met')}**).",
    ]


def memory_table(results: list[dict]) -> list[str]:
    lines = ["| model | process | peak RSS MiB (VmHWM) | export s | nodes |", "|---|---|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['tool']} | fail: `{r['error'][:120]}` | | |")
        else:
            lines.append(f"| {r['size']} | {r['tool']} | {r['peak_rss_mib']:.0f} | {r['seconds']:.2f} | {r['nodes'] or ''} |")
    big = next((r for r in results if r["tool"] == "predispatch" and r["size"] == "70b" and "error" not in r), None)
    if big:
        lines += ["", f"70B-shaped Llama ({big['parameters'] / 1e9:.1f} billion parameters, 80 layers, meta device): "
                  f"predispatch exports in {big['seconds']:.2f} s at {big['peak_rss_mib']:.0f} MiB peak. Target: under "
                  f"1024 MiB: **{_verdict(big['peak_rss_mib'], 1024)}**."]
    pd = next((r for r in results if r["tool"] == "predispatch" and r["size"] == "7b" and "error" not in r), None)
    if pd:
        lines += ["", f"{pd['parameters'] / 1e9:.2f} billion parameters on the meta device. Target: predispatch under "
                  f"4096 MiB: **{_verdict(pd['peak_rss_mib'], 4096)}**. Peaks are read from /proc/self/status, not "
                  "`ru_maxrss`, which a child inherits from its parent (Note [Peak memory of a child process] in "
                  "benchmarks/peak_memory.py)."]
    return lines


def forward_table(rows: list[tuple[str, tuple[float, float] | None]]) -> list[str]:
    lines = ["| model | eager ms | ep.module() ms | ep.module() / eager |", "|---|---:|---:|---:|"]
    ratios = []
    for name, times in rows:
        if times is None:
            lines.append(f"| {name} | fail | fail | |")
            continue
        eager, program = times
        ratios.append(program / eager)
        lines.append(f"| {name} | {1e3 * eager:.2f} | {1e3 * program:.2f} | {program / eager:.2f}x |")
    lines.append(f"| **median** | | | **{_fmt(_median(ratios), '.2f')}x** |")
    return lines


JOINT_SECTION = "## Joint forward-backward program (`ep.joint()`) vs `_export_forward_backward`"
MODULE_COST_SECTION = "## ep.module() at run time (issue 25)"  # benchmarks/module_cost.py
EXPORT_SCALING_SECTION = "## Export scaling: parameters and ops doubled (issue 40)"  # benchmarks/export_scaling.py


def _kept_section(path: Path, heading: str) -> list[str]:
    """The lines of `heading`'s section in the existing `path` (up to the next `## `), if any."""
    if not path.exists() or heading not in path.read_text():
        return []
    lines = path.read_text().split(heading, 1)[1].splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("## ")), len(lines))
    section = [heading, *lines[:end]]
    while section[-1] == "":
        section.pop()
    return section


def vision_section(reps: int) -> list[str]:
    """Run the zoo (benchmarks/vision.py), write its table, and return the summary section."""
    import vision  # a sibling file; imports timm as tests/timm_support.py does

    lines, _, _ = vision.run_zoo(reps)
    (HERE / "vision_results.md").write_text("\n".join(lines) + "\n")
    return [
        "## Vision zoo: timm models in eval and train (issue 15)",
        "",
        f"`python benchmarks/vision.py --reps {reps}` (43 timm models, random weights, a `(2, 3, 64, 64)` input, 224 "
        "where the architecture fixes it; predispatch and `torch.export.export(strict=False)` alternated; every "
        "program checked against eager). Per model: [vision_results.md](vision_results.md).",
        "",
        lines[-1],
    ]


def header(reps: int) -> list[str]:
    return [
        "# predispatch benchmarks",
        "",
        f"`python benchmarks/run.py --reps {reps}`: torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs ({platform.machine()}), torch threads "
        f"{torch.get_num_threads()}. Times are medians of {reps} warm repetitions (one untimed warm-up, tools "
        "interleaved); models in train mode with their loss in the graph (benchmarks/models.py).",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (default 5)")
    parser.add_argument("--out", type=Path, default=HERE / "results.md", help="where to write the markdown")
    parser.add_argument("--models", nargs="*", help="only these models (default: all)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["export", "depth", "memory", "forward", "vision"])
    parser.add_argument("--vision-reps", type=int, default=2, help="timed repetitions per zoo export (default 2)")
    opts = parser.parse_args()
    transformers.logging.set_verbosity_error()

    benches = [b for b in BENCHES if not opts.models or b.name in opts.models]
    out = header(opts.reps)
    if "export" not in opts.skip:
        rows = []
        for bench in benches:
            rows.append(time_exports(bench.name, *bench.make(), opts.reps, ["predispatch", "torch.export", "torch.export+decomp"]))
            print(f"  export {bench.name}: {rows[-1].seconds}", file=sys.stderr, flush=True)
        out += ["", "## Export time", "", *export_table(rows)]
    if "depth" not in opts.skip:
        rows = time_depths(opts.reps)
        print(f"  depth: {[r.seconds for r in rows]}", file=sys.stderr, flush=True)
        out += ["", "## Depth scaling (Llama-style decoder, hidden 64)", "", *depth_table(rows)]
    if "memory" not in opts.skip:
        results = [peak_memory(tool, size) for size in ("7b", "70b") for tool in ("baseline", "predispatch", "torch.export")]
        print(f"  memory: {results}", file=sys.stderr, flush=True)
        out += ["", "## Peak memory: 7B and 70B-shaped Llamas on the meta device (fresh process each)", "",
                *memory_table(results)]
    if "forward" not in opts.skip:
        rows = [(bench.name, forward_ratio(*bench.make())) for bench in [*benches, WIDE]]
        out += ["", "## Forward time: ep.module() against eager (train mode, grad enabled)", "", *forward_table(rows)]
    for heading in (JOINT_SECTION, MODULE_COST_SECTION, EXPORT_SCALING_SECTION):
        kept = _kept_section(opts.out, heading)
        if kept:
            out += ["", *kept]
    if "vision" not in opts.skip:
        out += ["", *vision_section(opts.vision_reps)]
    text = "\n".join(out) + "\n"
    print(text)
    opts.out.write_text(text)


if __name__ == "__main__":
    main()
