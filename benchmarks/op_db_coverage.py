"""How many op_db cases export, with predispatch and with torch.export (non-strict), in one run.

    python benchmarks/op_db_coverage.py          # ~3-4 minutes; prints the counts and the differences

Each case is tests/test_op_db.py's: the first float32 sample of every OpInfo (and of its in-place
variant) wrapped in a module.  "Exported" means the export call returned; tests/test_op_db.py's
slow sweep checks, for predispatch, that the graph is functional and the outputs equal eager's.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import predispatch  # noqa: E402
from test_op_db import CASES, DTYPE, OpModule, first_sample, tensor_leaves  # noqa: E402
from sweep_support import clone_tree  # noqa: E402


def _exports(export, module, inputs) -> bool:
    try:
        export(module, clone_tree(inputs))
    except Exception:  # noqa: BLE001 - counting failures of any kind
        return False
    return True


def main() -> None:
    warnings.simplefilter("ignore")
    ours, theirs, runnable = set(), set(), []
    for key, case in CASES.items():
        if DTYPE not in case.opinfo.supported_dtypes("cpu"):
            continue
        runnable.append(key)
        try:
            sample = first_sample(case)
        except AssertionError:
            continue
        module, inputs = OpModule(case.fn, sample), tensor_leaves(sample)
        if _exports(predispatch.export, module, inputs):
            ours.add(key)
        if _exports(lambda m, a: torch.export.export(m, a, strict=False), module, inputs):
            theirs.add(key)
    print(f"op_db cases: {len(CASES)}, with float32 on CPU: {len(runnable)}")
    print(f"predispatch exports {len(ours)}; torch.export (strict=False) exports {len(theirs)}")
    print("only torch.export:", sorted(theirs - ours))
    print("only predispatch:", sorted(ours - theirs))


if __name__ == "__main__":
    main()
