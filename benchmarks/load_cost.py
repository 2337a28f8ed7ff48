"""What `predispatch.load` costs per byte of file, at n and 2n graph nodes (issue 36 item 3).

    python benchmarks/load_cost.py [--n 30000] [--dir DIR]

Saves a chain of `n` and of `2n` relus of a (3, 4) tensor (each node ~460 bytes of program.json,
its meta['val'] a fake tensor) into DIR (default: a temporary folder; files already there of the
right name are reused, since exporting 60,000 ops takes minutes), then loads each in a fresh
process, after a warm-up load of a 10-node file so that imports and caches do not count.
Printed per file: its bytes and nodes; the load's wall and CPU seconds, and CPU seconds per MB;
the growth of the process's peak resident memory (VmHWM, Note [Peak memory of a child process]
in peak_memory.py) and that growth per byte of file; then the doubling ratios, which are 2.0 for
a cost linear in the file's size.  docs/format.md states the bounds; tests/test_load_cost.py
checks them as work (calls, allocations), not time.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_file(n: int, path: str) -> None:
    """A saved chain of `n` relus (exported once; reused when the file exists)."""
    if os.path.exists(path):
        return
    import torch

    import predispatch

    class Chain(torch.nn.Module):
        def forward(self, x):
            for _ in range(n):
                x = x.relu()
            return x

    predispatch.save(predispatch.export(Chain(), (torch.randn(3, 4),)), path)


def _peak() -> int:
    """This address space's peak resident bytes (Note [Peak memory of a child process])."""
    status = open("/proc/self/status").read()
    return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) * 1024


def measure(path: str, warm_up: str) -> dict:
    """One load of `path` in this process, after loading `warm_up`."""
    import predispatch

    predispatch.load(warm_up)
    peak, wall, cpu = _peak(), time.perf_counter(), time.process_time()
    ep = predispatch.load(path)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    size = os.path.getsize(path)
    grown = _peak() - peak
    return {"bytes": size, "nodes": len(ep.graph_module.graph.nodes), "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "cpu_s_per_MB": round(cpu / size * 1e6, 3), "peak_growth_MiB": round(grown / 2**20, 1),
            "memory_per_byte": round(grown / size, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30000)
    parser.add_argument("--dir", default=None)
    args = parser.parse_args()
    folder = args.dir or tempfile.mkdtemp()
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    paths = {n: os.path.join(folder, f"chain{n}.pd") for n in (10, args.n, 2 * args.n)}
    for n, path in paths.items():
        _chain_file(n, path)
    rows = []
    for n in (args.n, 2 * args.n):
        out = subprocess.run([sys.executable, __file__, "--measure", paths[n], paths[10]], env=env,
                             capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    small, large = rows
    print(json.dumps({"bytes_ratio": round(large["bytes"] / small["bytes"], 2),
                      "cpu_ratio": round(large["cpu_s"] / small["cpu_s"], 2),
                      "memory_ratio": round(large["peak_growth_MiB"] / small["peak_growth_MiB"], 2)}))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        print(json.dumps(measure(sys.argv[2], sys.argv[3])))
    else:
        main()
