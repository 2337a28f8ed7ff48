"""What a file's size expressions cost to load and use (issue 40; Note [The size grammar]).

Symbolic sizes in node meta are read by a bounded grammar and built without sympy's automatic
evaluation, so load, `module()`, a call, `to_torch()`, `predispatch show` and `predispatch
draw` do a bounded work per byte of expression text.  The crafted files come from
tests/load_attacks.py; work is counted (Python function calls, in a fresh interpreter), not timed.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import subprocess_env

import load_attacks
import predispatch
from predispatch import size_expressions
from predispatch.errors import SerializationError

TESTS = os.path.dirname(os.path.abspath(__file__))

#: Python function calls per byte of size expression text that loading and using a file may
#: cost beyond the same file with plain sizes (docs/format.md states it; measured at most ~1,100,
#: nested floor divisions, whose every level torch's ShapeEnv evaluates through sympy's
#: assumptions; the rest of a file costs ~5 per byte).
WORK_PER_BYTE = 2000


def _work(paths: list[str], warm_up: str) -> list[dict]:
    """`load_attacks.measure_work` in a fresh interpreter, with a timeout that only a hang meets."""
    result = subprocess.run([sys.executable, os.path.join(TESTS, "load_attacks.py"), "--work", warm_up, *paths],
                            capture_output=True, text=True, timeout=600, env=subprocess_env(os.path.dirname(TESTS)))
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def _write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_size_expressions_at_the_bounds_cost_bounded_work_per_byte(tmp_path):
    """Each worst case of the grammar at its bounds (one Max of MAX_ARGUMENTS symbols, nesting
    MAX_DEPTH deep, MAX_CHARS of text, exponents multiplying to MAX_EXPONENT, sums of calls),
    one distinct expression per node, in files of 2 and 4 nodes: everything the program is used
    for costs at most WORK_PER_BYTE calls per byte of expression text (sympy's Max built 150
    symbols in minutes: it compares its arguments pairwise), and the issue's files (a Max of 150
    and of 190 symbols, 9 KB) are refused by name for less work than a plain file."""
    paths, plain = [], {}
    for nodes in (2, 4):
        base = load_attacks.chain_program(nodes)
        plain[nodes] = _write(tmp_path / f"plain{nodes}.pd", load_attacks.with_sizes(base, [load_attacks.size_symbol(j) for j in range(nodes)]))
        for index, case in enumerate(load_attacks.SIZE_CASES):
            sizes = [load_attacks.worst_size(case, 7 * j + nodes) for j in range(nodes)]
            paths.append((case, nodes, _write(tmp_path / f"case{index}_{nodes}.pd", load_attacks.with_sizes(base, sizes))))
    issue = [_write(tmp_path / f"issue{k}.pd", load_attacks.with_sizes(load_attacks.chain_program(1), [
        "Max(" + ", ".join(load_attacks.size_symbol(i) for i in range(k)) + ")"])) for k in (150, 190)]
    rows = {r["path"]: r for r in _work([*plain.values(), *(p for _, _, p in paths), *issue], plain[2])}
    for case, nodes, path in paths:
        row, base = rows[path], rows[plain[nodes]]
        assert row["outcome"] == "loaded", (case, row)
        per_byte = (row["calls"] - base["calls"]) / (row["bytes"] - base["bytes"])
        assert per_byte <= WORK_PER_BYTE, (case, nodes, per_byte)
    for path, symbols in zip(issue, (150, 190)):
        row = rows[path]
        assert f"calls Max with {symbols} arguments" in row["outcome"] or "characters, more than" in row["outcome"], row
        assert row["calls"] < rows[plain[2]]["calls"], row


@pytest.mark.parametrize("case", load_attacks.SIZE_CASES)
def test_size_expressions_beyond_the_bounds_are_refused_by_name(case):
    """One step past a bound (an argument, a level, a character, a doubled exponent), a size is
    refused naming the node and the bound, before anything is built of it."""
    data = load_attacks.with_sizes(load_attacks.chain_program(1), [load_attacks.beyond_size(case)])
    with pytest.raises(SerializationError) as info:
        predispatch.load(io.BytesIO(data))
    message = str(info.value)
    assert "graph module <root>, nodes[1] (relu) meta['val']" in message and "size_expressions.MAX_" in message, message


def test_distinct_size_text_of_a_file_is_bounded():
    """A file may make load build MAX_FILE_CHARS characters of distinct size expressions: one
    with more (70 nodes, each a different sum of MAX_CHARS) is refused naming the bound; the
    same text repeated is read once."""
    nodes = size_expressions.MAX_FILE_CHARS // size_expressions.MAX_CHARS + 6
    base = load_attacks.chain_program(nodes)
    distinct = [load_attacks.worst_size("a long sum", j) for j in range(nodes)]
    with pytest.raises(SerializationError, match=r"nodes\[\d+\] \(relu_\d+\) meta\['val'\]: the program's distinct size "
                       rf"expressions have more than {size_expressions.MAX_FILE_CHARS} characters in all \(size_expressions.MAX_FILE_CHARS\)"):
        predispatch.load(io.BytesIO(load_attacks.with_sizes(base, distinct)))
    loaded = predispatch.load(io.BytesIO(load_attacks.with_sizes(base, distinct[:1] * nodes)))
    assert torch.equal(loaded.module()(x := torch.randn(5, 4)), x.relu())


#: What `predispatch.load` may cost per byte of a program file (docs/format.md states both):
#: Python function calls (measured ~2.2 on a chain of relus: one call per ~450-byte node record
#: costs ~1,100 calls, mostly torch's fake tensor dispatch for the node's meta['val']) and the
#: most memory Python holds at once while loading (measured ~18.6 bytes: FX compiling the
#: graph's code, ~6 KB a node, with the graph and its fake tensors alive; 25 before the JSON
#: tree and member bytes were dropped as soon as they were read, Note [Load memory]).
LOAD_CALLS_PER_BYTE = 4
LOAD_PEAK_PER_BYTE = 22


def test_load_costs_work_and_memory_linear_in_the_file_size(tmp_path):
    """Loading a program of n and 2n nodes (in a fresh interpreter, after a warm-up load):
    each further byte of file costs at most LOAD_CALLS_PER_BYTE Python calls and
    LOAD_PEAK_PER_BYTE bytes of peak Python memory, and doubling the file doubles both (within
    20%): the cost is linear, with no per-node re-walk of the graph."""
    paths = [_write(tmp_path / f"chain{n}.pd", load_attacks.chain_program(n)) for n in (2, 100, 200)]
    result = subprocess.run([sys.executable, os.path.join(TESTS, "load_attacks.py"), "--load-cost", *paths],
                            capture_output=True, text=True, timeout=600, env=subprocess_env(os.path.dirname(TESTS)))
    assert result.returncode == 0, result.stderr[-3000:]
    small, large = (json.loads(line) for line in result.stdout.splitlines())
    assert (small["nodes"], large["nodes"]) == (102, 202), (small, large)
    for key, bound in (("calls", LOAD_CALLS_PER_BYTE), ("peak", LOAD_PEAK_PER_BYTE)):
        first = small[key] / small["bytes"]
        further = (large[key] - small[key]) / (large["bytes"] - small["bytes"])
        assert further <= bound, (key, further, bound)
        assert 0.8 <= further / first <= 1.2, (key, first, further)
