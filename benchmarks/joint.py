"""The joint forward-backward program, side by side with torch's, in one run.

    python benchmarks/joint.py [--reps 3] [--out benchmarks/results.md]

For each model (the Hugging Face models of benchmarks/models.py in train mode, returning
their own training loss, and small modules with a custom `autograd.Function`, a captured backward hook and tied
weights), both tools build the joint program from scratch:

    predispatch   predispatch.export(m, args, kwargs).joint(loss=...)
    torch         torch.export.experimental._export_forward_backward(
                      torch.export.export(m, args, kwargs, strict=False), joint_loss_index)

and each joint graph is run (under no_grad, from the same RNG seed as eager) to compare its
parameter gradients with eager's `loss.backward()`: "bitwise", "close" (allclose at the
default float32 tolerances, with the largest difference), or "WRONG" (with it).  Times are
medians of `--reps` warm repetitions (one untimed warm-up, tools interleaved), as the ratio
predispatch / torch.  A tool that raises is reported with its error's first line.  Appends
(or replaces) the "Joint forward-backward" section of `--out`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
import transformers
from torch import nn
from torch.export.experimental import _export_forward_backward

import predispatch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from helpers import StraightThrough  # noqa: E402  (the test suite's straight-through estimator)
from models import BENCHES  # noqa: E402  (a sibling file, not a package)

SECTION = "## Joint forward-backward program (`ep.joint()`) vs `_export_forward_backward`"


# --- the small modules: what torch's joint cannot see ------------------------------------------


class QuantizedMLP(nn.Module):
    """A straight-through estimator between two layers (quantization-aware training)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, target):
        return F.cross_entropy(self.fc2(StraightThrough.apply(self.fc1(x) * 4) / 4), target)


class ClippedGrad(nn.Module):
    """A tensor hook clipping the gradient flowing into the first layer."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x, target):
        h = torch.tanh(self.fc1(x))
        h.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        return F.cross_entropy(self.fc2(h), target)


class TiedLM(nn.Module):
    """An embedding tied to the output projection (pytorch#147380)."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 16), nn.Linear(16, 64, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return F.cross_entropy(self.head(torch.tanh(self.emb(ids))).flatten(0, 1), ids.flatten())


class Attention(nn.Module):
    """Plain scaled-dot-product attention over three projections: the smallest model where
    torch's joint gradients are wrong (every attention model above is too)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, 2, 4).transpose(1, 2) for lin in (self.q, self.k, self.v))
        return F.scaled_dot_product_attention(q, k, v).square().sum()


class LossOnly(nn.Module):
    """The model's own training loss as the one output.  torch's joint refuses a structured
    output whose other leaves require grad ("Found an output of the forward that requires
    gradients, that was not the scalar loss"), so both tools get the scalar."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs).loss


class FrameLoss(nn.Module):
    """Wav2Vec2 with a per-frame cross-entropy: its CTC loss does not export (tests/test_joint_models.py)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        logits = self.model(x).logits.flatten(0, 1)
        return F.cross_entropy(logits, torch.arange(logits.shape[0]) % logits.shape[1])


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[], tuple[nn.Module, tuple, dict]]
    loss: str | None  # the loss leaf for predispatch (None: forward returns the scalar loss)


def _small(cls: type[nn.Module], args: Callable[[], tuple]) -> Callable[[], tuple[nn.Module, tuple, dict]]:
    def make():
        torch.manual_seed(0)
        return cls().train(), args(), {}

    return make


def _hf(bench) -> Callable[[], tuple[nn.Module, tuple, dict]]:
    def make():
        model, args, kwargs = bench.make()
        return (FrameLoss if bench.name == "wav2vec2" else LossOnly)(model).train(), args, kwargs

    return make


def cases() -> list[Case]:
    found = [Case(b.name, _hf(b), None) for b in BENCHES]
    return found + [
        Case("straight-through (custom Function)", _small(QuantizedMLP, lambda: (torch.randn(8, 16), torch.arange(8) % 4)), None),
        Case("tensor hook (gradient clipping)", _small(ClippedGrad, lambda: (torch.randn(8, 16), torch.arange(8) % 4)), None),
        Case("tied weights", _small(TiedLM, lambda: (torch.randint(0, 64, (2, 8)),)), None),
        Case("scaled_dot_product_attention", _small(Attention, lambda: (torch.randn(2, 5, 8),)), None),
    ]


# --- building and running each tool's joint -------------------------------------------------------


def build_predispatch(model, args, kwargs, loss):
    return predispatch.export(model, args, kwargs).joint(loss=loss)


def build_torch(model, args, kwargs, loss):
    return _export_forward_backward(torch.export.export(model, args, kwargs, strict=False), joint_loss_index=0)


def grads_predispatch(jp, args, kwargs) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        _, grads = jp.module()(*args, **kwargs)
    return {k: v for k, v in grads.items() if v is not None}


def grads_torch(tep, args, kwargs) -> dict[str, torch.Tensor]:
    """Run torch's joint graph on its lifted state and the user inputs; gradients by parameter name."""
    sig = tep.graph_signature
    user = iter(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    flat = []
    for spec in sig.input_specs:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            flat.append(next(user))
        elif spec.target in tep.state_dict:
            flat.append(tep.state_dict[spec.target])
        else:
            flat.append(tep.constants[spec.target])
    with torch.no_grad():
        outs = tep.graph_module(*flat)
    return {
        spec.target: out for spec, out in zip(sig.output_specs, outs) if spec.kind.name == "GRADIENT_TO_PARAMETER"
    }


def eager_grads(model, args, kwargs, loss) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    out = model(*args, **kwargs)
    (out if loss is None else out[loss]).backward()
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def verdict(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    """How the joint's gradients compare with eager's, over the parameters eager gives one."""
    missing = [n for n in expected if n not in actual]
    if missing:
        return f"WRONG: no gradient for {len(missing)} of {len(expected)} parameters ({missing[0]}, ...)"
    worst = max(((actual[n] - e).abs().max().item(), n) for n, e in expected.items())
    if all(torch.equal(actual[n], e) for n, e in expected.items()):
        return "bitwise"
    if all(torch.allclose(actual[n], e) for n, e in expected.items()):
        return f"close (max diff {worst[0]:.1e})"
    return f"WRONG (max diff {worst[0]:.1e} at {worst[1]})"


TOOLS = {"predispatch": (build_predispatch, grads_predispatch), "torch": (build_torch, grads_torch)}


def measure(case: Case, reps: int) -> dict[str, Any]:
    """Correctness of each tool's joint, then interleaved timing of both builds."""
    model, args, kwargs = case.make()
    import copy

    expected = eager_grads(copy.deepcopy(model), args, kwargs, case.loss)
    row: dict[str, Any] = {"name": case.name}
    ok = []
    for tool, (build, run) in TOOLS.items():
        try:
            program = build(model, args, kwargs, case.loss)
            torch.manual_seed(1)
            row[tool] = verdict(run(program, args, kwargs), expected)
            ok.append(tool)
        except Exception as exc:  # a tool that cannot build or run its joint: report it
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            row[tool] = f"fails: {type(exc).__name__}: {first[:110]}"
            traceback.print_exc(limit=2, file=sys.stderr)
    times: dict[str, list[float]] = {tool: [] for tool in ok}
    for _ in range(reps):
        for tool in ok:
            start = time.perf_counter()
            TOOLS[tool][0](model, args, kwargs, case.loss)
            times[tool].append(time.perf_counter() - start)
    row["times"] = {tool: statistics.median(values) for tool, values in times.items()}
    return row


#: What the rows show, from reading the failures (the same every run; the numbers are above).
NOTES = [
    "- torch \"fails: Found a parameter that did not receive a gradient\": its joint requires every parameter name "
    "to receive a gradient, and a tied weight, passed once per name, does not (pytorch#147380); GPT-2, BERT, T5 and "
    "Whisper tie their input and output embeddings, as the \"tied weights\" row does.",
    "- torch WRONG on the custom Function and the tensor hook: `torch.export` inlines the Function's forward "
    "and drops its backward (and the hook), so its joint differentiates `round` (zero) and ignores the clip.",
    "- torch WRONG on the attention models (the Llama family, the MoE models, ViT) while its loss equals "
    "eager's (checked on Llama); the one-layer \"scaled_dot_product_attention\" row, three projections and "
    "`F.scaled_dot_product_attention`, reproduces it. Cause not investigated further.",
    "- predispatch's gradients are bitwise eager's on every row (tests/test_joint.py, tests/test_joint_models.py).",
]


def table(rows: list[dict[str, Any]], reps: int) -> list[str]:
    lines = [
        SECTION,
        "",
        f"`python benchmarks/joint.py --reps {reps}` (torch {torch.__version__}, transformers "
        f"{transformers.__version__}); build time = export + joint, median of {reps} warm repetitions.",
        "Gradients: each joint graph run under no_grad against eager's `loss.backward()`, same RNG seed.",
        "",
        "| model | predispatch gradients | torch gradients | predispatch s | torch s | time ratio |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    for row in rows:
        t = row["times"]
        ratio = t["predispatch"] / t["torch"] if "predispatch" in t and "torch" in t else None
        if ratio is not None:
            ratios.append(ratio)
        cells = [
            row["name"],
            row["predispatch"],
            row["torch"],
            f"{t['predispatch']:.2f}" if "predispatch" in t else "-",
            f"{t['torch']:.2f}" if "torch" in t else "-",
            f"{ratio:.2f}x" if ratio is not None else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *NOTES]
    if ratios:
        lines += ["", f"Median time ratio (predispatch / torch, where both build): **{statistics.median(ratios):.2f}x** "
                  f"({min(ratios):.2f}x - {max(ratios):.2f}x)."]
    return lines


def write_section(path: Path, lines: list[str]) -> None:
    """Replace this benchmark's section of `path` (or append it), leaving the rest as it is."""
    text = path.read_text() if path.exists() else ""
    head = text.split(SECTION)[0].rstrip()
    path.write_text((head + "\n\n" if head else "") + "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results.md")
    parser.add_argument("--only", nargs="*", help="model names to run (default: all)")
    options = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.use_deterministic_algorithms(True)  # eager's embedding backward, as in tests/test_models.py
    rows = []
    for case in cases():
        if options.only and case.name not in options.only:
            continue
        rows.append(measure(case, options.reps))
        print(rows[-1], file=sys.stderr, flush=True)
    lines = table(rows, options.reps)
    print("\n".join(lines))
    write_section(options.out, lines)


if __name__ == "__main__":
    main()
