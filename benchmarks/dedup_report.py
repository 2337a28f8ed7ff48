"""Which blocks of the Hugging Face models are shared, and why the others are traced inline.

    python benchmarks/dedup_report.py [--depth 5] [--mode train]

Each model of tests/test_models.py, its layer lists grown to `--depth` layers (that file's
`_deepen`), is exported once; the export's sharing report (`ep.graph_module.meta["dedup"]`,
Note [Sharing repeated blocks] in predispatch/trace/dedup/share.py) is printed per model: the
shared bodies with their calls and replays, and each kind of block not shared with the reason.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
import transformers

import predispatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import test_models  # noqa: E402  (the models and `_deepen` of the test suite)


def report_lines(depth: int, mode: str) -> list[str]:
    lines = []
    for case in test_models.CASES:
        torch.manual_seed(0)
        model = test_models._deepen(case.build(), depth).train(mode == "train")
        args, kwargs = case.inputs()
        reports = predispatch.export(model, args, kwargs).graph_module.meta["dedup"]
        shared = [f"{r.module_class} ({len(r.calls)} calls, {len(r.replayed)} replayed)"
                  for r in reports if r.not_shared is None and len(r.calls) > 1]
        once = sorted({r.module_class for r in reports if r.not_shared is None and len(r.calls) == 1})
        lines.append(f"- {case.name}: shared {', '.join(shared) or 'nothing'}")
        if once:
            lines.append(f"  - recorded, no second call like it (so inline): {', '.join(once)}")
        inline = collections.Counter((r.module_class, r.not_shared) for r in reports if r.not_shared)
        lines += [f"  - not shared: {cls} ({n} kind{'s' if n > 1 else ''}): {why}" for (cls, why), n in inline.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depth", type=int, default=test_models.DEEP)
    parser.add_argument("--mode", choices=["train", "eval"], default="train")
    opts = parser.parse_args()
    transformers.logging.set_verbosity_error()
    print("\n".join(report_lines(opts.depth, opts.mode)))


if __name__ == "__main__":
    main()
