"""The auditor: find samples for every CIA op, run its kernels on them, and judge.

    table = run_audit()                      # every CIA aten overload, ~15 s on 2 cores
    table = run_audit(["aten.reshape.default", torch.ops.aten.linear.default])
    table.verdict("aten.reshape.default")    # Verdict.MUST_DECOMPOSE

How a verdict follows from the evidence is the ``POLICY`` below; it is stored in the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch

from predispatch._torch_internals import OpOverload
from predispatch.audit.checking import RunResult, check
from predispatch.audit.hand import HAND_PROGRAMS
from predispatch.audit.isolation import run_isolated
from predispatch.audit.ops import Kernel, cia_ops, kernels_of, schema_findings
from predispatch.audit.samples import Sample, SampleBank, op_db_programs, record, schema_samples
from predispatch.audit.table import AuditEntry, AuditTable, Reason, Verdict, make_table, op_key, public_version

POLICY = (
    "An op is PRESERVED only on evidence: every CompositeImplicitAutograd kernel it has "
    "(C++, Python py_impl, or both) ran at least one sample, and no run showed a violation. "
    "It MUST_DECOMPOSE when any run mutates an input the schema declares read-only, returns "
    "an output that aliases an input or another output without a declared alias, fails to "
    "realise a declared alias (views for some inputs, copies for others), draws random "
    "numbers without the nondeterministic_seeded tag, reads tensor data for shapes or control "
    "flow, or has a side effect; or when its schema alone rules it out (mutable arguments, "
    "a view return, no tensor result). UNVERIFIED ops (no sample ran cleanly) are decomposed, "
    "like MUST_DECOMPOSE: keeping an op whole is the claim that needs evidence, and "
    "decomposing a truthful op costs only graph size. Random draws by ops whose tags declare "
    "them (nondeterministic_seeded) are noted, not blocking: the preserved op draws exactly "
    "as eager does."
)

# Evidence codes, most serious first: the first one found is the entry's reason.
EVIDENCE_ORDER: tuple[Reason, ...] = (
    Reason.MUTATES_INPUT,
    Reason.ALIASES_INPUT,
    Reason.CONDITIONAL_ALIAS,
    Reason.ALIASES_OUTPUT,
    Reason.DRAWS_RANDOM_UNTAGGED,
    Reason.DATA_DEPENDENT,
    Reason.SIDE_EFFECT,
)


def run_audit(
    ops: Iterable[object] | None = None,
    *,
    progress: Callable[[str], None] | None = None,
) -> AuditTable:
    """Audit ``ops`` (OpOverloads or names; default: every CIA aten overload)."""
    every = cia_ops()
    targets = every if ops is None else _select(every, ops)
    bank = collect_samples(every, [str(op) for op in targets], progress)
    jobs = [job for op in targets for job in plan_runs(op, bank.for_op(str(op)))]
    if progress:
        progress(f"checking: {len(jobs)} runs of {len(targets)} ops")
    results = run_isolated(jobs, _run_job, _crashed)
    by_op: dict[str, list[RunResult]] = {str(op): [] for op in targets}
    for (op, _, _), result in zip(jobs, results):
        by_op[str(op)].append(result)
    entries = [judge(op, by_op[str(op)]) for op in targets]
    return make_table(public_version(), POLICY, entries)


def collect_samples(
    every: Sequence[OpOverload],
    wanted: Iterable[str],
    progress: Callable[[str], None] | None = None,
) -> SampleBank:
    """Record the CIA calls op_db and the hand-written programs make, for ``wanted`` ops."""
    bank = SampleBank(frozenset(wanted))
    programs = [*op_db_programs(), *HAND_PROGRAMS]
    record(programs, frozenset(every), bank, progress)
    return bank


def audit_op(op: OpOverload, samples: Sequence[Sample], *,
             schema_built: bool = True) -> AuditEntry:
    """Judge any CIA op (a custom one too) on the given samples, in this process.

    No op_db, no crash isolation: for tests and for ops outside the shipped table.
    ``schema_built`` adds the calls built from the schema to the given samples.
    """
    return judge(op, [check(*job) for job in plan_runs(op, samples, schema_built=schema_built)])


Job = tuple[OpOverload, Kernel, Sample]


def plan_runs(op: OpOverload, recorded: Sequence[Sample], *,
              schema_built: bool = True) -> list[Job]:
    """Every kernel on every sample; none for ops whose schema mutates (no run could save them)."""
    if any(f.code is Reason.SCHEMA_MUTABLE for f in schema_findings(op)):
        return []
    direct = [s for s in recorded if not s.via]
    built = schema_samples(op) if schema_built else []
    samples = [*direct, *built, *(s for s in recorded if s.via)]
    return [(op, kernel, s) for kernel in kernels_of(op) for s in samples]


def _run_job(job: Job) -> RunResult:
    return check(*job)


def _crashed(job: Job, why: str) -> RunResult:
    op, kernel, sample = job
    return RunResult(sample.label, kernel, why, (), False)


def judge(op: OpOverload, runs: Sequence[RunResult]) -> AuditEntry:
    """Judge one op from its schema and from every kernel run on every sample."""
    declared = schema_findings(op)
    if any(f.code is Reason.SCHEMA_MUTABLE for f in declared):
        return _entry(op, Verdict.MUST_DECOMPOSE, declared[0].code, declared[0].detail,
                      f"schema: {op._schema}", also=[f.code for f in declared[1:]])
    evidence = _first_violations(runs)
    random = _drew_declared_randomness(op, runs)
    if evidence:
        return _from_evidence(op, evidence, runs, [f.code for f in declared] + random)
    if declared:
        return _entry(op, Verdict.MUST_DECOMPOSE, declared[0].code, declared[0].detail,
                      f"schema: {op._schema}", also=[f.code for f in declared[1:]] + random)
    return _judge_clean(op, runs, random)


def _first_violations(runs: Sequence[RunResult]) -> dict[Reason, tuple[RunResult, str, int]]:
    """For each evidence code: the first run showing it, its detail, and how many runs did."""
    found: dict[Reason, tuple[RunResult, str, int]] = {}
    for run in runs:
        for code in {v.code for v in run.violations}:
            detail = next(v.detail for v in run.violations if v.code is code)
            first, first_detail, count = found.get(code, (run, detail, 0))
            found[code] = (first, first_detail, count + 1)
    return found


def _from_evidence(
    op: OpOverload,
    evidence: dict[Reason, tuple[RunResult, str, int]],
    runs: Sequence[RunResult],
    more: list[Reason],
) -> AuditEntry:
    codes = [c for c in EVIDENCE_ORDER if c in evidence]
    run, detail, count = evidence[codes[0]]
    completed = sum(r.error is None for r in runs)
    where = f"{run.sample} ({run.kernel.value} kernel)"
    if codes[0] is Reason.CONDITIONAL_ALIAS:
        detail, where = _conditional_alias(detail, where, count, completed, runs)
    elif count != completed:
        detail += f" (in {count} of {completed} runs)"
    return _entry(op, Verdict.MUST_DECOMPOSE, codes[0], detail, where, also=codes[1:] + more)


def _conditional_alias(detail: str, where: str, count: int, completed: int,
                       runs: Sequence[RunResult]) -> tuple[str, str]:
    """Say both halves when some runs aliased and others copied: that is the lie."""
    aliased = next((r for r in runs if r.realised_alias and r.error is None), None)
    if aliased is None:
        return f"{detail}, in all {completed} runs", where
    reason = (f"aliases its input for some inputs and copies for others: {detail}, "
              f"in {count} of {completed} runs")
    return reason, f"fresh: {where}; alias: {aliased.sample} ({aliased.kernel.value} kernel)"


def _judge_clean(op: OpOverload, runs: Sequence[RunResult],
                 random: list[Reason]) -> AuditEntry:
    """No violation anywhere: PRESERVE if every kernel completed a run, else UNVERIFIED."""
    missing = [k for k in kernels_of(op) if not any(r.clean and r.kernel is k for r in runs)]
    if not missing:
        reason = f"no violation in {sum(r.clean for r in runs)} runs"
        if random:
            reason += "; draws random numbers, as its nondeterministic_seeded tag declares"
        return _entry(op, Verdict.PRESERVE, Reason.CLEAN, reason, _clean_summary(runs),
                      also=random)
    kernels = " and ".join(k.value for k in missing)
    failed = next((r for r in runs if r.error and r.kernel in missing), None)
    evidence = (f"{failed.sample} ({failed.kernel.value} kernel) raised {failed.error}"
                if failed else "no op_db, hand-written or schema sample reaches this op")
    return _entry(op, Verdict.UNVERIFIED, Reason.NO_EVIDENCE,
                  f"no sample ran on its {kernels} kernel; decomposed by policy", evidence)


def _drew_declared_randomness(op: OpOverload,
                              runs: Sequence[RunResult]) -> list[Reason]:
    tagged = torch.Tag.nondeterministic_seeded in op.tags
    return [Reason.DRAWS_RANDOM] if tagged and any(r.random for r in runs) else []


def _clean_summary(runs: Sequence[RunResult]) -> str:
    clean = [r for r in runs if r.clean]
    if not clean:
        return ""
    labels = list(dict.fromkeys(f"{r.sample} ({r.kernel.value})" for r in clean))
    more = f" and {len(labels) - 3} more" if len(labels) > 3 else ""
    return "ran clean: " + ", ".join(labels[:3]) + more


def _entry(op: OpOverload, verdict: Verdict, code: Reason, reason: str,
           evidence: str, also: Sequence[Reason] = ()) -> AuditEntry:
    unique = tuple(dict.fromkeys(c for c in also if c is not code))
    return AuditEntry(str(op), verdict, reason, evidence, code, unique)


def _select(every: Sequence[OpOverload], ops: Iterable[object]) -> list[OpOverload]:
    by_key = {str(op): op for op in every}
    keys = [op_key(op) for op in ops]
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise ValueError(
            f"not CompositeImplicitAutograd aten ops in torch {torch.__version__}: {unknown}"
        )
    return [by_key[k] for k in sorted(set(keys))]
