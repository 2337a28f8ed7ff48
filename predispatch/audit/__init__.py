"""The composite-op audit: which CompositeImplicitAutograd ops the export may keep whole.

    from predispatch.audit import Verdict, load_table
    load_table().verdict(torch.ops.aten.reshape.default)   # Verdict.MUST_DECOMPOSE
    load_table().get("aten.linear.default").evidence       # which samples ran clean

Ops are named by overload as ``str(OpOverload)`` prints them, ``"aten.to.dtype"``; the
dispatcher's ``"aten::to.dtype"`` is accepted too.  ``run_audit()`` regenerates the table from
evidence; ``python -m predispatch.audit --write`` ships it (see docs/audit.md).
"""

from predispatch.audit.auditor import run_audit
from predispatch.audit.table import (
    AuditEntry,
    AuditTable,
    Reason,
    Verdict,
    load_table,
    op_key,
)


__all__ = ["AuditEntry", "AuditTable", "Reason", "Verdict", "load_table", "op_key", "run_audit"]
