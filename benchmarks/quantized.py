"""Export time of torchao-quantized Llama-style decoders: predispatch against torch.export.

    python benchmarks/quantized.py [--reps 5] [--layers 8] [--configs int8wo int8dq ...] [--out FILE]

The model is tests/subclass_cases.py's `TinyLlama` (hidden 256, 8 heads, `--layers` decoder
layers, vocabulary 512), quantized with torchao's `quantize_` under each config (its weights are
tensor subclasses: Note [Tensor subclasses] in predispatch/frontend/subclasses.py).  Per config:
CPU time of warm exports (median of `--reps`, the two tools alternated), their ratio, and whether
each program's output equals eager's on another batch (max abs difference).  torch.export here
is `torch.export.export(strict=False)`, the program torchao documents for its export route.
Needs torchao (the `consumers` extra).  Prints a Markdown table; `--out` appends it to a file.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

import predispatch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from subclass_cases import TinyLlama  # noqa: E402


def configs() -> dict[str, object]:
    """torchao's configs that run on CPU, by a short name."""
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8DynamicActivationIntxWeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )

    return {
        "int8wo": Int8WeightOnlyConfig(),
        "int8dq": Int8DynamicActivationInt8WeightConfig(),
        "intxwo": IntxWeightOnlyConfig(),
        "8da4w": Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4),
        "fp8wo": Float8WeightOnlyConfig(),
    }


def cpu_ms(fn, reps: int) -> list[float]:
    samples = []
    for _ in range(reps):
        gc.collect()
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1e3)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--configs", nargs="*", default=None)
    parser.add_argument("--out", type=Path, default=None)
    opts = parser.parse_args()
    from torchao.quantization import quantize_

    table = configs()
    rows = [
        f"torch {torch.__version__}, TinyLlama {opts.layers} layers (hidden 256), CPU time, median of {opts.reps} warm exports",
        "",
        "| config | predispatch ms | torch.export ms | pd / torch.export | pd max diff | torch.export max diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    ids = torch.randint(0, 512, (2, 16))
    other = torch.randint(0, 512, (2, 16))
    for name in opts.configs or table:
        model = TinyLlama(vocab=512, dim=256, heads=8, layers=opts.layers).eval()
        quantize_(model, table[name])
        pd = lambda: predispatch.export(model, (ids,))  # noqa: E731
        te = lambda: torch.export.export(model, (ids,), strict=False)  # noqa: E731
        pd(), te()  # warm-up
        times: dict[str, list[float]] = {"pd": [], "te": []}
        for _ in range(opts.reps):  # alternated, so drift hits both
            times["pd"] += cpu_ms(pd, 1)
            times["te"] += cpu_ms(te, 1)
        with torch.no_grad():
            expected = model(other)
            diff_pd = (pd().module()(other) - expected).abs().max().item()
            diff_te = (te().module()(other) - expected).abs().max().item()
        p, t = statistics.median(times["pd"]), statistics.median(times["te"])
        rows.append(f"| {name} | {p:.0f} | {t:.0f} | {p / t:.2f}x | {diff_pd:.1e} | {diff_te:.1e} |")
        print(rows[-1], flush=True)
    text = "\n".join(rows)
    print(text)
    if opts.out is not None:
        with opts.out.open("a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
