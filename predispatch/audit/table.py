"""The audit table: one verdict per CompositeImplicitAutograd (CIA) aten overload.

Ops are named by overload in the form ``str(OpOverload)`` prints: ``"aten.to.dtype"``,
``"aten.reshape.default"``.  Names given in the dispatcher's form (``"aten::to.dtype"``,
``"aten::reshape"``) are accepted at the edges and normalised by ``op_key``.

One table ships per tested torch release, ``audit_table_<major>.<minor>.json`` next to this
file (composites and their kernels change between releases); ``load_table()`` reads the running
torch's.  On a torch with no table every aten composite decomposes ("not in the audit table of
this torch version"), the safe answer.  ``docs/audit.md`` is rendered from the table of
``DOCS_TORCH``, the development torch.
"""

from __future__ import annotations

import enum
import functools
import json
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from predispatch._torch_internals import TORCH, OpOverload
from predispatch._torch_versions import DEVELOPMENT

#: The torch release docs/audit.md shows: the development one.
DOCS_TORCH = DEVELOPMENT


def table_path(version: tuple[int, int] = TORCH) -> Path:
    """Where the table of torch `version` (major, minor) ships."""
    return Path(__file__).with_name(f"audit_table_{version[0]}.{version[1]}.json")


#: The running torch's table.
TABLE_PATH = table_path()
FORMAT_VERSION = 1


class Verdict(enum.Enum):
    """What the export may do with a CIA op it meets."""

    PRESERVE = "preserve"  # keep the op whole: samples ran clean on every CIA kernel
    MUST_DECOMPOSE = "must_decompose"  # keeping it whole would be wrong; evidence says why
    UNVERIFIED = "unverified"  # no sample ran cleanly; decomposed by policy (see POLICY)


class Reason(enum.Enum):
    """Why an op got its verdict, as a code; the entry's ``reason`` says it in words."""

    # Evidence: a sample showed the implementation doing what its schema does not declare.
    MUTATES_INPUT = "mutates_input"
    ALIASES_INPUT = "aliases_input"
    CONDITIONAL_ALIAS = "conditional_alias"  # declared alias, but some inputs get a copy
    ALIASES_OUTPUT = "aliases_output"
    DRAWS_RANDOM_UNTAGGED = "draws_random_untagged"
    DATA_DEPENDENT = "data_dependent"
    SIDE_EFFECT = "side_effect"
    # Schema: the declaration alone rules the op out of a functional graph.
    SCHEMA_MUTABLE = "schema_mutable"
    SCHEMA_ALIAS = "schema_alias"
    NO_TENSOR_RESULT = "no_tensor_result"
    # Neither: noted, never blocking.
    DRAWS_RANDOM = "draws_random"  # random, and the schema's tags say so
    CLEAN = "clean"
    NO_EVIDENCE = "no_evidence"


@dataclass(frozen=True)
class AuditEntry:
    """The verdict on one op overload and the evidence behind it."""

    op: str  # overload name as str(OpOverload) prints it: "aten.to.dtype"
    verdict: Verdict
    reason: str  # one line for people: what is wrong (or that nothing was)
    evidence: str  # one line: which sample and kernel showed it, e.g. "op_db:reshape#3 (C++)"
    code: Reason | None = None  # the reason as a code; None only for entries made by hand
    also: tuple[Reason, ...] = ()  # further findings beyond ``code``, e.g. DRAWS_RANDOM


@dataclass(frozen=True)
class AuditTable:
    """Verdicts for every CIA aten overload of one torch version."""

    torch_version: str  # torch.__version__ the table was generated with, without its build (+cpu)
    policy: str  # how verdicts follow from evidence, UNVERIFIED ops included
    entries: Mapping[str, AuditEntry]  # op_key(op) -> entry, read-only

    def get(self, op: object) -> AuditEntry | None:
        return self.entries.get(op_key(op))

    def verdict(self, op: object) -> Verdict:
        """The verdict for ``op`` (an OpOverload or a name).

        An op missing from the table (a CIA op newer than the table) is UNVERIFIED, and
        UNVERIFIED ops are decomposed: the safe answer for an op nobody has looked at.
        """
        entry = self.get(op)
        return Verdict.UNVERIFIED if entry is None else entry.verdict

    def summary(self) -> dict[Verdict, int]:
        """How many ops got each verdict, every verdict listed."""
        counts = {v: 0 for v in Verdict}
        for entry in self.entries.values():
            counts[entry.verdict] += 1
        return counts

    def to_json(self) -> str:
        return dumps_table(self)


def make_table(torch_version: str, policy: str, entries: list[AuditEntry]) -> AuditTable:
    """Build a table whose entries are sorted by op name and cannot be changed."""
    ordered = {e.op: e for e in sorted(entries, key=lambda e: e.op)}
    return AuditTable(torch_version, policy, types.MappingProxyType(ordered))


def op_key(op: object) -> str:
    """Normalise an OpOverload or a name to the table's form, ``"aten.to.dtype"``."""
    if isinstance(op, OpOverload):
        return str(op)
    if not isinstance(op, str):
        raise TypeError(
            f"expected an OpOverload or a name like 'aten.to.dtype' or 'aten::to.dtype', "
            f"got {type(op).__name__}"
        )
    if "::" in op:
        namespace, rest = op.split("::", 1)
        name, _, overload = rest.partition(".")
        return f"{namespace}.{name}.{overload or 'default'}"
    parts = op.split(".")
    return f"{op}.default" if len(parts) == 2 else op


def dumps_table(table: AuditTable) -> str:
    """Deterministic JSON: a header with counts, then entries sorted by op."""
    header = {
        "format": FORMAT_VERSION,
        "torch_version": table.torch_version,
        "policy": table.policy,
        "counts": {v.value: n for v, n in table.summary().items()},
    }
    rows = [_entry_to_dict(table.entries[k]) for k in sorted(table.entries)]
    return json.dumps({**header, "entries": rows}, indent=1) + "\n"


def loads_table(text: str) -> AuditTable:
    data = json.loads(text)
    if data.get("format") != FORMAT_VERSION:
        raise ValueError(f"audit table format {data.get('format')!r}, expected {FORMAT_VERSION}")
    entries = [_entry_from_dict(row) for row in data["entries"]]
    return make_table(data["torch_version"], data["policy"], entries)


@functools.lru_cache(maxsize=1)
def load_table() -> AuditTable:
    """The table shipped for the running torch, read once; an empty one where none ships."""
    if not TABLE_PATH.exists():
        return make_table(public_version(), "no audit table ships for this torch: every aten composite decomposes", [])
    return loads_table(TABLE_PATH.read_text())


def public_version() -> str:
    """torch's version without its build suffix: `2.13.0+cpu` and `2.13.0+cu130` audit alike."""
    import torch

    return torch.__version__.split("+")[0]


def _entry_to_dict(entry: AuditEntry) -> dict[str, object]:
    return {
        "op": entry.op,
        "verdict": entry.verdict.value,
        "code": entry.code.value if entry.code else None,
        "also": [r.value for r in entry.also],
        "reason": entry.reason,
        "evidence": entry.evidence,
    }


def _entry_from_dict(row: Mapping[str, object]) -> AuditEntry:
    code = row.get("code")
    return AuditEntry(
        op=str(row["op"]),
        verdict=_parse(Verdict, row["verdict"]),
        reason=str(row["reason"]),
        evidence=str(row["evidence"]),
        code=_parse(Reason, code) if code else None,
        also=tuple(_parse(Reason, r) for r in row.get("also", ())),  # type: ignore[union-attr]
    )


E = TypeVar("E", bound=enum.Enum)


def _parse(kind: type[E], value: object) -> E:
    """An enum member from its JSON value; a bad one names the allowed values."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{value!r} is not a {kind.__name__}; expected one of {allowed}") from None
