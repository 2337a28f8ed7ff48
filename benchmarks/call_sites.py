"""What crafted files whose graphs call one subgraph many times cost, per byte of program.json (issue 40).

    python benchmarks/call_sites.py [--out benchmarks/results.md]

Three worst cases of docs/format.md#threat-model's bounds, each at two sizes (the second about
twice the first), built by tests/load_attacks.py's helpers:

- a region DAG: each region's body calls the next one twice, 16 and 32 levels deep (2^15 and
  2^31 call paths; 32 is `MAX_SUBGRAPH_DEPTH`);
- one region body called from 512 and 1024 sites of the root graph;
- one 120-op shared body (`invoke_subgraph`) called from 512 and 1024 sites: `module()` and
  `to_torch()` inline it at each call, about 55 times the file's nodes (`MAX_CALL_EXPANSION` is 64).

Reported per case: the size of program.json, and for load, `ep.module()`, `ep.to_torch()`,
`str(ep)` (what `predispatch show` prints) and `picture` + `to_html` (what `predispatch draw`
writes) the time per KB of program.json and the scaling factor from the smaller file to the
larger (2 for work linear in the file).  Each step is timed once, after a warm-up load.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import load_attacks  # noqa: E402
from test_serialize import export_case, saved  # noqa: E402

import predispatch  # noqa: E402
from predispatch.render import picture, to_html  # noqa: E402

STEPS = ("load", "module()", "to_torch()", "show", "draw")


def _cases(base: bytes) -> dict[str, tuple[bytes, bytes]]:
    dag = lambda depth: load_attacks.region_dag(base, depth)  # noqa: E731
    sites = lambda n: load_attacks.region_dag(base, 2, root_calls=n)  # noqa: E731
    shared = lambda n: load_attacks.region_dag(base, 1, root_calls=n, hops=("invoke_subgraph",), ops=120)  # noqa: E731
    return {
        "region DAG, 16 / 32 levels, 2 calls each": (dag(16), dag(32)),
        "one region body, 512 / 1024 call sites": (sites(512), sites(1024)),
        "120-op shared body, 512 / 1024 calls": (shared(512), shared(1024)),
    }


def _program_bytes(data: bytes) -> int:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return zf.getinfo("program.json").file_size


def _timed(data: bytes) -> dict[str, float]:
    times, start = {}, time.perf_counter()
    ep = predispatch.load(io.BytesIO(data))
    times["load"] = time.perf_counter() - start
    for step, run in (("module()", ep.module), ("to_torch()", ep.to_torch), ("show", lambda: str(ep)),
                      ("draw", lambda: to_html(picture(ep)))):
        start = time.perf_counter()
        run()
        times[step] = time.perf_counter() - start
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown section to this file (appended)")
    ns = parser.parse_args()
    base = saved(export_case("region_detached_double")[0])
    _timed(load_attacks.region_dag(base, 2))  # warm-up: imports, the fake mode
    lines = [
        "## Files calling one subgraph many times (issue 40)", "",
        "ms per KB of program.json (smaller file / larger file), and the scaling factor of each step's time",
        "from the smaller file to the larger (2 is linear).  `python benchmarks/call_sites.py`", "",
        f"| case | program.json | {' | '.join(STEPS)} |", "| --- | --- |" + " --- |" * len(STEPS),
    ]
    for name, (small, large) in _cases(base).items():
        sizes = (_program_bytes(small), _program_bytes(large))
        timings = (_timed(small), _timed(large))
        cells = [
            f"{1e6 * timings[0][s] / sizes[0]:.2f} / {1e6 * timings[1][s] / sizes[1]:.2f} (x{timings[1][s] / timings[0][s]:.1f})"
            for s in STEPS
        ]
        lines.append(f"| {name} | {sizes[0] // 1024} / {sizes[1] // 1024} KB | {' | '.join(cells)} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if ns.out:
        with open(ns.out, "a", encoding="utf-8") as f:
            f.write("\n" + text)


if __name__ == "__main__":
    main()
