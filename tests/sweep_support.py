"""What the op_db and module_db sweeps share: cloning inputs, comparing results, xfail marks.

Both sweeps run eager and the exported program on separate clones of the same inputs and
compare results leaf by leaf, bitwise unless a table in `sweep_expected_failures` says why not.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from sweep_expected_failures import Known, Tolerance


def clone_tree(tree: Any) -> Any:
    """A copy of `tree` whose tensors share nothing with the original (strides kept)."""
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.requires_grad), tree)


def assert_same(
    actual: Any, expected: Any, *, what: str, tolerance: Tolerance | None = None, values: bool = True
) -> None:
    """Same structure, and for each leaf: tensors close (bitwise by default), constants equal.

    what: names the compared value in messages (`output`, `inputs after the call`, `buffers`).
    values: False for random ops, whose tensors are compared by shape and dtype only.
    """
    actual_leaves, actual_spec = pytree.tree_flatten_with_path(actual)
    expected_leaves, expected_spec = pytree.tree_flatten_with_path(expected)
    assert actual_spec == expected_spec, f"{what}: structure differs:\n{actual_spec}\nvs eager\n{expected_spec}"
    for (path, a), (_, e) in zip(actual_leaves, expected_leaves):
        where = what + pytree.keystr(path)
        if isinstance(e, torch.Tensor):
            _assert_tensor_same(where, a, e, tolerance, values)
        else:
            assert type(a) is type(e) and _constant_equal(a, e), f"{where}: {a!r} != eager {e!r}"


def _assert_tensor_same(where: str, a: Any, e: torch.Tensor, tolerance: Tolerance | None, values: bool) -> None:
    assert isinstance(a, torch.Tensor), f"{where}: a {type(a).__name__}, eager has a tensor"
    if not values:
        meta = (a.shape, a.dtype), (e.shape, e.dtype)
        assert meta[0] == meta[1], f"{where}: {a.dtype}{list(a.shape)} vs eager {e.dtype}{list(e.shape)}"
        return
    rtol, atol = (tolerance.rtol, tolerance.atol) if tolerance else (0.0, 0.0)
    torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{where}: {m}")


def _constant_equal(a: Any, e: Any) -> bool:
    """Equality that counts NaN equal to NaN (a float output computed from a NaN)."""
    if isinstance(e, float) and e != e:
        return a != a
    return a == e


def param(key: str, known: Known | None, *marks: Any) -> Any:
    """A pytest param for one sweep case; a known failure becomes a strict xfail with its reason.

    Strict: a case that starts passing fails the run (XPASS), so its entry gets removed.
    """
    if known is not None:
        marks = (*marks, pytest.mark.xfail(strict=True, reason=str(known)))
    return pytest.param(key, marks=marks, id=key)


def skipped(key: str, reason: str) -> Any:
    """A case the sweep cannot run at all, kept visible in the report with its reason."""
    return pytest.param(key, marks=pytest.mark.skip(reason=reason), id=key)
