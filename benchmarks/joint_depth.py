"""The joint program of deep models: depth scaling, and a 70B-shaped Llama against torch's joint.

    python benchmarks/joint_depth.py [--reps 3] [--sizes 70b] [--out benchmarks/results.md]

1. Depth scaling (the Llama-style decoder of benchmarks/models.py, hidden 64, train mode with
   its loss): `ep.joint()` of 2, 8 and 32 layers, and export + joint, against the same model
   exported with `dedup=False`, whose joint differentiates every layer (what the joint did
   for every program before shared bodies were kept in the backward).
2. Llama-3 70B's shape on the meta device (80 layers, no weights), the module returning its
   loss: predispatch's export + joint against torch's
   `aot_export_joint_with_descriptors` (the joint torch's autoparallel starts from), in the
   same process, both on the same meta inputs (every tensor on meta: nothing is computed).

Times are medians of `--reps` warm repetitions (one untimed warm-up), the tools interleaved,
so each ratio compares runs made under the same load; min and max of the per-repetition
ratios are shown too.  With `--out FILE`, also appends (or replaces) its "Joint of deep models" section.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch
import transformers
from torch import nn

import predispatch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from models import _lm, llama  # noqa: E402  (a sibling file, not a package)
from peak_memory import SIZES  # noqa: E402
from run import CLOCKS  # noqa: E402

SECTION = "## Joint of deep models (`ep.joint()` keeps shared bodies)"
DEPTHS = (2, 8, 32)


class LossOnly(nn.Module):
    """A causal LM returning only its loss: the one output both tools differentiate.  The
    causal mask is passed built (4-D, which Hugging Face uses as given): its own mask code
    reads tensor values, which torch's joint tracer refuses (data-dependent) where it is not
    told it traces."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, labels, mask):
        return self.model(ids, attention_mask=mask, labels=labels).loss


#: wall time, or the process's CPU time with `--clock cpu` (see benchmarks/run.py's CLOCKS)
CLOCK = CLOCKS["wall"]


def _timed(fn) -> float:
    start = CLOCK()
    fn()
    return CLOCK() - start


def _interleaved(tools: dict, reps: int) -> dict[str, list[float]]:
    """Each tool's times over `reps` rounds (one untimed warm-up round), tools alternating."""
    for fn in tools.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in tools}
    for _ in range(reps):
        for name, fn in tools.items():
            times[name].append(_timed(fn))
    return times


def depth_scaling(reps: int) -> list[dict]:
    """Export, joint and the flat joint of each depth, every depth's tools in one interleaved
    round (a change of load between depths falls on all of them)."""
    tools, calls = {}, {}
    for layers in DEPTHS:
        torch.manual_seed(0)
        model = llama(layers).train()
        (ids,), kwargs = _lm()
        shared = predispatch.export(model, (ids,), kwargs)
        flat = predispatch.export(model, (ids,), kwargs, dedup=False)
        tools[(layers, "export")] = lambda model=model, ids=ids, kwargs=kwargs: predispatch.export(model, (ids,), kwargs)
        tools[(layers, "joint")] = lambda shared=shared: shared.joint(loss="loss")
        tools[(layers, "flat joint")] = lambda flat=flat: flat.joint(loss="loss")
        joint = shared.joint(loss="loss")
        calls[layers] = len(joint.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph))
    times = _interleaved(tools, reps)
    rows = []
    for layers in DEPTHS:
        rows.append({"layers": layers, "calls": calls[layers], **{kind: statistics.median(times[(layers, kind)]) for kind in ("export", "joint", "flat joint")},
                     "rounds": [times[(layers, "joint")], times[(layers, "export")]]})
        print(rows[-1], flush=True)
    return rows


def big_llama(size: str, reps: int) -> dict:
    """predispatch export + joint vs torch's aot_export_joint_with_descriptors, meta device."""
    transformers.logging.set_verbosity_error()
    with torch.device("meta"):
        model = LossOnly(transformers.LlamaForCausalLM(transformers.LlamaConfig(use_cache=False, **SIZES[size]))).train()
    ids = torch.randint(0, model.model.config.vocab_size, (1, 128))
    args = (ids, ids, torch.ones(128, 128, dtype=torch.bool).tril()[None, None])
    meta_args = tuple(a.to("meta") for a in args)  # torch's joint refuses CPU inputs to a meta model

    def ours():
        predispatch.export(model, meta_args).joint()

    def torchs():
        from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

        with contextlib.ExitStack() as stack:
            aot_export_joint_with_descriptors(stack, model, meta_args)

    times = _interleaved({"predispatch": ours, "torch": torchs}, reps)
    ratios = [p / t for p, t in zip(times["predispatch"], times["torch"])]
    row = {"size": size, **{k: statistics.median(v) for k, v in times.items()}, "ratios": ratios}
    print(row, flush=True)
    return row


def table(rows: list[dict], big: list[dict], reps: int) -> list[str]:
    clock = "" if CLOCK is CLOCKS["wall"] else " --clock cpu"
    lines = [SECTION, "", f"`python benchmarks/joint_depth.py --reps {reps}{clock}` (torch {torch.__version__}, transformers "
             f"{transformers.__version__}, {torch.get_num_threads()} threads); medians of {reps} warm repetitions, tools interleaved.", ""]
    lines += ["| layers | body calls in the joint | export s | joint s | export + joint s | flat joint s (dedup=False) |",
              "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['layers']} | {r['calls']} | {r['export']:.3f} | {r['joint']:.3f} | {r['export'] + r['joint']:.3f} | {r['flat joint']:.3f} |")
    first, last = rows[0], rows[-1]
    joint_ratio = last["joint"] / first["joint"]
    total_ratio = (last["export"] + last["joint"]) / (first["export"] + first["joint"])
    per_round = [j32 / j2 for j32, j2 in zip(last["rounds"][0], first["rounds"][0])]
    lines += ["", f"- {last['layers']} layers / {first['layers']} layers: joint **{joint_ratio:.2f}x**, export + joint "
              f"**{total_ratio:.2f}x** (target <= 2.5x: **{'met' if max(joint_ratio, total_ratio) <= 2.5 else 'NOT met'}**); "
              f"the flat joint: {last['flat joint'] / first['flat joint']:.2f}x.  Joint ratio per round: "
              f"{min(per_round):.2f}x-{max(per_round):.2f}x.", ""]
    for b in big:
        median = statistics.median(b["ratios"])
        lines.append(f"- {b['size']}-shaped Llama (meta device, 80 layers), export + joint: predispatch {b['predispatch']:.2f} s, "
                     f"torch's `aot_export_joint_with_descriptors` {b['torch']:.2f} s: **{median:.2f}x** (per-repetition "
                     f"{min(b['ratios']):.2f}x-{max(b['ratios']):.2f}x; target <= 0.5x: **{'met' if median <= 0.5 else 'NOT met'}**).")
    return lines


def write_section(path: Path, lines: list[str]) -> None:
    text = path.read_text() if path.exists() else ""
    start = text.find(SECTION)
    if start >= 0:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + text[end + 1:] if end >= 0 else text[:start]
    path.write_text(text.rstrip() + "\n\n" + "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", nargs="*", default=["70b"], choices=sorted(SIZES))
    parser.add_argument("--out", type=Path, default=None, help="also replace this section of a results file (results.md keeps curated history: off by default)")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: the process's CPU time, which other processes' load inflates less")
    args = parser.parse_args()
    global CLOCK
    CLOCK = CLOCKS[args.clock]
    rows = depth_scaling(args.reps)
    big = [big_llama(size, args.reps) for size in args.sizes]
    lines = table(rows, big, args.reps)
    print("\n".join(lines))
    if args.out:
        write_section(args.out, lines)


if __name__ == "__main__":
    main()
