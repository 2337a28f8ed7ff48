"""Command line: ``python -m predispatch.audit [--write | --check | --torch] [--show N] [--quiet]``.

Without flags it audits the installed torch and prints a summary; ``--write`` regenerates
the running torch's ``predispatch/audit/audit_table_<major>.<minor>.json`` (and
``docs/audit.md`` on the development torch, ``DOCS_TORCH``); ``--check`` exits 1 when the
shipped table differs from a fresh run; ``--torch`` lists, from the shipped table, the liars
torch's own pre-dispatch export would still keep whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from predispatch.audit.auditor import run_audit
from predispatch.audit.render import render_markdown, render_summary
from predispatch._torch_internals import TORCH
from predispatch.audit.table import DOCS_TORCH, TABLE_PATH, AuditEntry, AuditTable, Verdict, dumps_table, loads_table

DOCS_PATH = Path(__file__).resolve().parents[2] / "docs" / "audit.md"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.torch:
        from predispatch.audit.compare import compare_with_torch
        from predispatch.audit.table import load_table

        print(compare_with_torch(load_table()))
        return 0
    progress = None if args.quiet else (lambda msg: print(msg, file=sys.stderr))
    fresh = run_audit(progress=progress)
    if args.check:
        return _check(fresh)
    if args.write:
        TABLE_PATH.write_text(dumps_table(fresh))
        print(f"wrote {TABLE_PATH}")
        if TORCH == DOCS_TORCH:
            DOCS_PATH.parent.mkdir(exist_ok=True)
            DOCS_PATH.write_text(render_markdown(fresh))
            print(f"wrote {DOCS_PATH}")
    print(render_summary(fresh, show=args.show))
    return 0


def _check(fresh: AuditTable) -> int:
    shipped = loads_table(TABLE_PATH.read_text()) if TABLE_PATH.exists() else None
    problems = confirmed_differences(shipped, fresh)
    for line in problems:
        print(line)
    if problems:
        print("the shipped audit table is stale: run `python -m predispatch.audit --write`")
        return 1
    print(f"the shipped audit table matches a fresh run ({len(fresh.entries)} ops)")
    return 0


def confirmed_differences(shipped: AuditTable | None, fresh: AuditTable) -> list[str]:
    """``table_differences``, with every differing op audited again on its own first.

    The full audit runs thousands of jobs in a few forked children, so a job's error text can
    depend on what ran before it in the same child (an earlier schema-built call that corrupted
    memory, a child killed on a timeout under load): CI once saw one op's evidence change that
    way and nothing else.  An op whose entry differs is audited again in a fresh child of its
    own; only differences that repeat there count.
    """
    again = [key for key in _differing_ops(shipped, fresh) if key in fresh.entries] if shipped else []
    if again:
        fresh = dataclasses.replace(fresh, entries={**fresh.entries, **run_audit(ops=again).entries})
    return table_differences(shipped, fresh)


def table_differences(shipped: AuditTable | None, fresh: AuditTable, limit: int = 20) -> list[str]:
    """Human-readable differences between two tables; empty when they agree."""
    if shipped is None:
        return [f"no shipped table at {TABLE_PATH}"]
    found = []
    if shipped.torch_version != fresh.torch_version:
        found.append(
            f"torch version: shipped {shipped.torch_version}, installed {fresh.torch_version}"
        )
    if shipped.policy != fresh.policy:
        found.append("policy text differs")
    for key in _differing_ops(shipped, fresh):
        found.append(f"{key}: shipped {_describe(shipped.entries.get(key))}, fresh {_describe(fresh.entries.get(key))}")
    return found[:limit] + ([f"... and {len(found) - limit} more"] if len(found) > limit else [])


def _differing_ops(shipped: AuditTable, fresh: AuditTable) -> list[str]:
    """The ops whose entries differ, beyond how one sample failed (`_same_failure`)."""
    return [key for key in sorted(set(shipped.entries) | set(fresh.entries))
            if shipped.entries.get(key) != fresh.entries.get(key)
            and not _same_failure(shipped.entries.get(key), fresh.entries.get(key))]


def _same_failure(old: AuditEntry | None, new: AuditEntry | None) -> bool:
    """Two UNVERIFIED entries that differ only in how the same sample failed on the same kernel.

    A schema-built sample can feed a C++ kernel arguments it reads out of bounds: what happens
    then depends on memory layout (`_thnn_differentiable_gru_cell_backward` on its `schema:f32`
    sample segfaults in most runs and raises a size mismatch in others, on torch 2.11 and 2.14).
    The verdict, its reason and the failing sample are the table's facts; the failure's text is not.
    """
    if old is None or new is None or old.verdict is not Verdict.UNVERIFIED:
        return False
    sample, raised, _ = old.evidence.partition(" raised ")  # "schema:f32 (C++ kernel)", " raised "
    return (bool(raised) and new.evidence.startswith(sample + raised)
            and dataclasses.replace(old, evidence="") == dataclasses.replace(new, evidence=""))


def _describe(entry: object) -> str:
    if entry is None:
        return "absent"
    return (f"{entry.verdict.value} ({entry.code.value if entry.code else '-'}: {entry.reason}; "
            f"evidence: {entry.evidence}; also: {[c.value for c in entry.also]})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m predispatch.audit", description=__doc__)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="regenerate the JSON table and docs")
    mode.add_argument("--check", action="store_true", help="exit 1 if the shipped table is stale")
    mode.add_argument("--torch", action="store_true", help="liars torch's own export would keep whole")
    p.add_argument("--show", type=int, default=0, help="list at most N evidence findings (0: all)")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    return p


if __name__ == "__main__":
    sys.exit(main())
