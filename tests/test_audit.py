"""The composite-op audit: the shipped table, its staleness, and the checks behind it.

The full audit runs once per session (about 15 s on two cores) and is compared with the
shipped table; everything else reads the shipped table or audits small synthetic ops.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from predispatch.audit import AuditTable, Reason, Verdict, load_table, op_key, run_audit
from predispatch.audit.__main__ import DOCS_PATH, confirmed_differences, table_differences
from predispatch.audit.auditor import audit_op
from predispatch.audit.isolation import run_isolated
from predispatch.audit.render import render_markdown
from predispatch.audit.ops import cia_ops
from predispatch.audit.samples import Sample
from predispatch.audit.table import DOCS_TORCH, dumps_table, loads_table, table_path

aten = torch.ops.aten


@pytest.fixture(scope="module")
def fresh() -> AuditTable:
    return run_audit()


@pytest.fixture(scope="module")
def shipped() -> AuditTable:
    return load_table()


# --- the shipped table is current ---------------------------------------------------------


_GRU = "aten._thnn_differentiable_gru_cell_backward.default"


def _with_evidence(table: AuditTable, key: str, evidence: str) -> AuditTable:
    entries = dict(table.entries)
    entries[key] = dataclasses.replace(entries[key], evidence=evidence)
    return dataclasses.replace(table, entries=entries)


def test_a_difference_that_a_fresh_child_does_not_repeat_is_not_staleness(
        shipped: AuditTable) -> None:
    """A neighbour job in the full audit's shared child can change an op's evidence: the op
    audited again alone decides."""
    fresh = _with_evidence(shipped, _GRU, "no op_db, hand-written or schema sample reaches this op")
    assert table_differences(shipped, fresh)
    assert confirmed_differences(shipped, fresh) == []


def test_how_the_same_sample_failed_is_not_staleness(shipped: AuditTable) -> None:
    """CI (torch 2.14) and 2.11: this op's schema:f32 sample segfaults in most runs and raises a
    size mismatch in others (the kernel reads its arguments out of bounds)."""
    for text in ("crashed the process (SIGSEGV)",
                 "RuntimeError: The size of tensor a (4) must match the size of tensor b (2) at non-singleton dimension 1"):
        assert table_differences(shipped, _with_evidence(shipped, _GRU, f"schema:f32 (C++ kernel) raised {text}")) == []
    other_sample = _with_evidence(shipped, _GRU, "schema:f64 (C++ kernel) raised crashed the process (SIGSEGV)")
    assert table_differences(shipped, other_sample)


def test_a_difference_that_repeats_is_staleness(shipped: AuditTable) -> None:
    stale = _with_evidence(shipped, _GRU, "an older torch's error text")
    (problem,) = confirmed_differences(stale, shipped)
    assert problem.startswith(_GRU) and "an older torch's error text" in problem


def test_shipped_table_matches_a_fresh_audit(fresh: AuditTable, shipped: AuditTable) -> None:
    problems = confirmed_differences(shipped, fresh)
    assert not problems, (
        "the shipped audit table is stale for the installed torch; regenerate it with "
        "`python -m predispatch.audit --write` and read the diff:\n" + "\n".join(problems)
    )


def test_table_covers_every_cia_aten_op_of_installed_torch(shipped: AuditTable) -> None:
    assert set(shipped.entries) == {str(op) for op in cia_ops()}
    assert shipped.torch_version == torch.__version__.split("+")[0]


def test_docs_page_is_rendered_from_the_development_torchs_table() -> None:
    docs_table = loads_table(table_path(DOCS_TORCH).read_text())
    assert Path(DOCS_PATH).read_text() == render_markdown(docs_table)


def test_a_table_ships_for_every_tested_torch() -> None:
    """Each release CI tests has its own table (composites change between releases)."""
    from predispatch._torch_internals import TESTED

    for version in TESTED:
        table = loads_table(table_path(version).read_text())
        assert table.torch_version.startswith(f"{version[0]}.{version[1]}."), (version, table.torch_version)


def test_every_verdict_has_a_reason_and_evidence(shipped: AuditTable) -> None:
    for entry in shipped.entries.values():
        assert entry.code is not None and entry.reason and entry.evidence, entry
        assert "\n" not in entry.reason + entry.evidence, entry
        blocking = entry.code not in (Reason.CLEAN, Reason.NO_EVIDENCE, Reason.DRAWS_RANDOM)
        assert blocking == (entry.verdict is Verdict.MUST_DECOMPOSE), entry


# --- the known liars, found from evidence --------------------------------------------------


def test_to_returns_self_or_a_copy_depending_on_the_input(shipped: AuditTable) -> None:
    for overload in ("aten.to.dtype", "aten.to.device", "aten.to.other", "aten.to.dtype_layout"):
        entry = shipped.get(overload)
        assert entry.verdict is Verdict.MUST_DECOMPOSE, entry
        assert entry.code is Reason.CONDITIONAL_ALIAS, entry
        assert "fresh:" in entry.evidence and "alias:" in entry.evidence, entry


def test_reshape_views_or_copies_depending_on_strides(shipped: AuditTable) -> None:
    entry = shipped.get(aten.reshape.default)
    assert entry.verdict is Verdict.MUST_DECOMPOSE
    assert entry.code is Reason.CONDITIONAL_ALIAS
    assert "fresh:" in entry.evidence and "alias:" in entry.evidence


def test_native_batch_norm_mutates_running_stats(shipped: AuditTable) -> None:
    entry = shipped.get(aten.native_batch_norm.default)
    assert entry.verdict is Verdict.MUST_DECOMPOSE
    assert entry.code is Reason.MUTATES_INPUT
    assert "running_mean" in entry.reason


def test_rrelu_with_noise_declares_its_mutation_in_this_torch(shipped: AuditTable) -> None:
    """Once a CIA op whose schema hid the write to ``noise``; torch 2.13 gave it a real kernel
    and the schema ``Tensor(b!) noise``.  Should it turn composite again, the table must
    decompose it; meanwhile the CIA op that calls it (``rrelu``) is honest."""
    op = aten.rrelu_with_noise.default
    if str(op) in shipped.entries:
        assert shipped.verdict(op) is Verdict.MUST_DECOMPOSE
        return
    noise = next(a for a in op._schema.arguments if a.name == "noise")
    assert noise.alias_info is not None and noise.alias_info.is_write
    rrelu = shipped.get(aten.rrelu.default)
    assert rrelu.verdict is Verdict.PRESERVE and Reason.DRAWS_RANDOM in rrelu.also


@pytest.mark.parametrize("op", [aten.linear.default, aten.layer_norm.default,
                                aten.scaled_dot_product_attention.default])
def test_common_nn_composites_are_preserved(shipped: AuditTable, op: object) -> None:
    entry = shipped.get(op)
    assert entry.verdict is Verdict.PRESERVE, entry
    assert entry.evidence.startswith("ran clean: ")


def test_gelu_is_not_composite_so_never_meets_the_table(shipped: AuditTable) -> None:
    assert shipped.get(aten.gelu.default) is None
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(
        "aten::gelu", "CompositeImplicitAutograd")


# --- the table as data ----------------------------------------------------------------------


def test_names_are_accepted_in_every_spelling(shipped: AuditTable) -> None:
    assert op_key(aten.reshape.default) == "aten.reshape.default"
    assert op_key("aten::reshape") == "aten.reshape.default"
    assert op_key("aten::to.dtype") == "aten.to.dtype"
    assert op_key("aten.reshape") == "aten.reshape.default"
    assert shipped.verdict("aten::reshape") is shipped.verdict(aten.reshape.default)


def test_unknown_ops_are_unverified_and_bad_names_explain_themselves(shipped: AuditTable) -> None:
    assert shipped.verdict("aten.no_such_op.default") is Verdict.UNVERIFIED
    with pytest.raises(TypeError, match="OpOverload or a name"):
        shipped.verdict(aten.reshape)


def test_json_round_trips_and_load_is_cached(shipped: AuditTable) -> None:
    assert loads_table(dumps_table(shipped)) == shipped
    assert load_table() is load_table()


def test_summary_counts_every_op(shipped: AuditTable) -> None:
    counts = shipped.summary()
    assert set(counts) == set(Verdict)
    assert sum(counts.values()) == len(shipped.entries)


def test_run_audit_rejects_ops_that_are_not_composite() -> None:
    with pytest.raises(ValueError, match="aten.gelu.default"):
        run_audit([aten.gelu.default])


# --- the checking mode catches each kind of lie ---------------------------------------------


@pytest.fixture(scope="module")
def liars() -> Iterator[torch.library.Library]:
    """Test-only ops whose CIA kernels each misbehave in one way."""
    lib = torch.library.Library("predispatch_audit_test", "DEF")  # noqa: TOR901
    kernels = {
        "honest(Tensor x) -> Tensor": lambda x: x * 2,
        "mutates(Tensor x) -> Tensor": lambda x: x.add_(1).clone(),
        "returns_input(Tensor x) -> Tensor": lambda x: x,
        "returns_view(Tensor x) -> Tensor": lambda x: x.view(-1),
        "copies_or_views(Tensor(a) x) -> Tensor(a)":
            lambda x: x if x.is_contiguous() else x.contiguous(),
        "outputs_share(Tensor x) -> (Tensor, Tensor)": _outputs_share,
        "random(Tensor x) -> Tensor": lambda x: x + torch.rand_like(x),
        "reads_data(Tensor x) -> Tensor": lambda x: x * 2 if x.sum().item() > 0 else x * 3,
        "prints(Tensor x) -> Tensor": _prints,
        "writes(Tensor(a!) x) -> ()": lambda x: x.zero_() and None,
        "counts(Tensor x) -> int": lambda x: x.numel(),
    }
    for schema, kernel in kernels.items():
        name = lib.define(schema)
        lib.impl(name, kernel, "CompositeImplicitAutograd")
    lib.define("random_tagged(Tensor x) -> Tensor", tags=(torch.Tag.nondeterministic_seeded,))
    lib.impl("random_tagged", lambda x: x + torch.rand_like(x), "CompositeImplicitAutograd")
    yield lib
    lib._destroy()


def _outputs_share(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x + 1
    return y, y.view(-1)


def _prints(x: torch.Tensor) -> torch.Tensor:
    torch.ops.aten._print("predispatch audit test")
    return x * 2


def _audit(name: str, *samples: torch.Tensor) -> object:
    op = getattr(torch.ops.predispatch_audit_test, name).default
    given = [Sample.call(op, (x,), source=f"test#{i}") for i, x in enumerate(samples)]
    return audit_op(op, given or [Sample.call(op, (torch.randn(3, 4),))], schema_built=False)


@pytest.mark.parametrize(("name", "code", "words"), [
    ("mutates", Reason.MUTATES_INPUT, "mutates input 'x'"),
    ("returns_input", Reason.ALIASES_INPUT, "returned it unchanged"),
    ("returns_view", Reason.ALIASES_INPUT, "returned a view of it"),
    ("outputs_share", Reason.ALIASES_OUTPUT, "outputs 0 and 1 share storage"),
    ("random", Reason.DRAWS_RANDOM_UNTAGGED, "not tagged nondeterministic_seeded"),
    ("reads_data", Reason.DATA_DEPENDENT, "aten._local_scalar_dense.default"),
    ("prints", Reason.SIDE_EFFECT, "aten._print.default"),
    ("writes", Reason.SCHEMA_MUTABLE, "schema mutates 'x'"),
    ("counts", Reason.NO_TENSOR_RESULT, "returns int"),
])
def test_checking_mode_catches_a_synthetic_liar(liars: object, name: str, code: Reason,
                                                words: str, capfd: pytest.CaptureFixture) -> None:
    entry = _audit(name)
    assert entry.verdict is Verdict.MUST_DECOMPOSE
    assert entry.code is code
    assert words in entry.reason


def test_conditional_alias_names_both_behaviours(liars: object) -> None:
    entry = _audit("copies_or_views", torch.randn(3, 4), torch.randn(4, 3).t())
    assert entry.code is Reason.CONDITIONAL_ALIAS
    assert entry.evidence == "fresh: test#1 (C++ kernel); alias: test#0 (C++ kernel)"


def test_honest_and_tagged_random_ops_are_preserved(liars: object) -> None:
    assert _audit("honest").verdict is Verdict.PRESERVE
    tagged = _audit("random_tagged")
    assert tagged.verdict is Verdict.PRESERVE and tagged.also == (Reason.DRAWS_RANDOM,)


def test_ops_that_never_run_are_unverified(liars: object) -> None:
    op = torch.ops.predispatch_audit_test.honest.default
    entry = audit_op(op, [Sample.call(op, ("not a tensor",), source="bad")], schema_built=False)
    assert entry.verdict is Verdict.UNVERIFIED and entry.code is Reason.NO_EVIDENCE
    assert entry.evidence.startswith("bad (C++ kernel) raised ")
    assert audit_op(op, [], schema_built=False).evidence == (
        "no op_db, hand-written or schema sample reaches this op")


# --- crash isolation -------------------------------------------------------------------------


def _job(n: int) -> int:
    if n == 3:
        os.kill(os.getpid(), signal.SIGSEGV)
    return n * 10


def test_a_segfaulting_job_loses_only_itself() -> None:
    results = run_isolated(list(range(6)), _job, lambda n, why: why)
    assert results[:3] == [0, 10, 20] and results[4:] == [40, 50]
    assert results[3] == "crashed the process (SIGSEGV)"


_poisoned = False


def _poisoning_job(n: int) -> int:
    """Job 1 'corrupts' its process; job 2 crashes only in a corrupted process."""
    global _poisoned
    if n == 1:
        _poisoned = True
    if n == 2 and _poisoned:
        os.kill(os.getpid(), signal.SIGSEGV)
    return n


def test_an_innocent_victim_of_an_earlier_job_is_retried() -> None:
    assert run_isolated([0, 1, 2, 3], _poisoning_job, lambda n, why: why) == [0, 1, 2, 3]


def test_torch_still_keeps_some_liars_whole():
    """Measured against torch's own decision: dropout and einsum lie, and torch keeps them whole."""
    from predispatch.audit.compare import compare_with_torch

    comparison = compare_with_torch(load_table())
    assert set(comparison.beyond_known) <= set(comparison.liars)
    assert {"aten.dropout.default", "aten.einsum.default", "aten.instance_norm.default"} <= set(comparison.kept_by_torch)
    assert "aten.reshape.default" not in comparison.beyond_known
