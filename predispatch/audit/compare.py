"""Which liars would torch itself keep whole?  Measured against torch's own decision.

torch's pre-dispatch export decides whether to inline a composite in
`FunctionalTensorMode._can_decompose` from the schema and a hand list.  For every op our audit
condemns on evidence (not schema alone), this asks torch's decision function what it would do,
so the claim "torch still preserves these" is measured, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from predispatch import _torch_internals as ti
from predispatch.audit.auditor import EVIDENCE_ORDER
from predispatch.audit.table import AuditTable, Verdict

#: Reasons that come from a sample's behaviour rather than the schema's declarations.
EVIDENCE = frozenset(EVIDENCE_ORDER)

KNOWN_LIARS = frozenset({"aten.to", "aten.reshape", "aten.native_batch_norm", "aten.rrelu_with_noise"})


@dataclass(frozen=True)
class TorchComparison:
    """liars: ops condemned on evidence; beyond_known: those not among the four known liars;
    kept_by_torch: of those, the ones torch 2.13's pre-dispatch export keeps whole by default."""

    liars: tuple[str, ...]
    beyond_known: tuple[str, ...]
    kept_by_torch: tuple[str, ...]

    def __str__(self) -> str:
        lines = [
            f"{len(self.liars)} ops condemned on evidence; {len(self.beyond_known)} beyond the four known liars;",
            f"torch {torch.__version__}'s pre-dispatch export keeps {len(self.kept_by_torch)} of those whole by default:",
        ]
        return "\n".join(lines + [f"  {op}" for op in self.kept_by_torch])


def compare_with_torch(table: AuditTable) -> TorchComparison:
    liars = sorted(e.op for e in table.entries.values() if e.verdict is Verdict.MUST_DECOMPOSE and e.code in EVIDENCE)
    beyond = [op for op in liars if op.rsplit(".", 1)[0] not in KNOWN_LIARS]
    kept = [op for op in beyond if ti.torch_keeps_whole_in_export(_overload(op))]
    return TorchComparison(tuple(liars), tuple(beyond), tuple(kept))


def _overload(name: str) -> torch._ops.OpOverload:
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)
