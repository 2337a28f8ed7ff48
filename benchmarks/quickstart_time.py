"""Export time of the bundled example (examples/quickstart.py), against torch.export, in one run.

    python benchmarks/quickstart_time.py [--reps 9]

Warm medians in one process: one untimed call of each tool first, then the tools interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quickstart import Block  # noqa: E402

import predispatch  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=9)
    reps = parser.parse_args().reps
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 5, 16)
    kwargs = {"mask": torch.ones(5, 5, dtype=torch.bool).tril()}
    tools = {
        "predispatch.export": lambda: predispatch.export(model, (x,), kwargs),
        "torch.export (non-strict)": lambda: torch.export.export(model, (x,), kwargs, strict=False),
        "torch.export + run_decompositions({})": lambda: torch.export.export(model, (x,), kwargs, strict=False).run_decompositions({}),
    }
    times = {name: [] for name in tools}
    for fn in tools.values():
        fn()
    for _ in range(reps):
        for name, fn in tools.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    ours = statistics.median(times["predispatch.export"])
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:40s} {median * 1e3:7.1f} ms   predispatch / this: {ours / median:.2f}x")


if __name__ == "__main__":
    main()
