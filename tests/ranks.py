"""Run a case of tests/distributed_cases.py on several ranks: one process per rank, gloo on 127.0.0.1.

Each rank is a fresh `python tests/distributed_cases.py CASE OUT` with torch's env:// variables
(MASTER_ADDR, MASTER_PORT of a port free a moment ago, RANK, WORLD_SIZE), CPU only.  A rank
writes what its case returned (a JSON object) to OUT; a case that raises writes the error's
class and text instead.  A hang (a collective one rank never reaches) or a crash is bounded by
`timeout` and reported with every rank's output, never left running.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
CASES = os.path.join(TESTS_DIR, "distributed_cases.py")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listened on a moment ago (rank 0's store binds it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(case: str, world_size: int = 2, timeout: float = 180) -> list[dict[str, Any]]:
    """Each rank's result of `case` (rank order); raises with every rank's output when a rank
    fails to report, exits non-zero, or runs past `timeout` seconds."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"rank{r}.json") for r in range(world_size)]
        procs = [_start(case, rank, world_size, port, outs[rank]) for rank in range(world_size)]
        logs = _wait_all(procs, timeout)
        failed = [r for r, p in enumerate(procs) if p.returncode != 0 or not os.path.exists(outs[r])]
        if failed:
            detail = "\n".join(f"--- rank {r} (exit {procs[r].returncode}):\n{logs[r][-4000:]}" for r in range(world_size))
            raise AssertionError(f"case {case!r} failed on rank(s) {failed}:\n{detail}")
        results = []
        for path in outs:
            with open(path) as f:
                results.append(json.load(f))
        return results


def _start(case: str, rank: int, world_size: int, port: int, out: str) -> subprocess.Popen:
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([ROOT, TESTS_DIR, os.environ.get("PYTHONPATH", "")]),
    )
    return subprocess.Popen(
        [sys.executable, CASES, case, out], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _wait_all(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every rank's output; all ranks are killed once one runs past the shared deadline."""
    logs = []
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            out = f"{out}\n[killed after {timeout}s: a rank hung]"
        logs.append(out)
    return logs
