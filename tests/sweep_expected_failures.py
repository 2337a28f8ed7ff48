"""Known failures and per-case allowances of the op_db and module_db sweeps, each with a reason.

Every entry says why.  An xfail is strict: once the case passes, the run fails (XPASS) until
the entry is removed.  Keys:

    op_db:      `name`, `name.variant_test_name`, plus `:inplace` for the in-place variant
                (`add`, `div.trunc_rounding`, `add:inplace`).
    module_db:  `name:mode:index`, `name:mode` or `name` (`nn.LSTM:train:1`, `nn.LSTM`); the
                most specific key that is present wins.

Print the tables' counts by category with `python tests/sweep_expected_failures.py`.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass


class Why(enum.Enum):
    """The closed set of reasons a sweep case may be allowed to fail."""

    DATA_DEPENDENT = "data-dependent output shape or value"
    NEEDS_DEVICE = "sample needs a non-CPU device"
    PREDISPATCH_BUG = "predispatch bug"
    TORCH_LIMITATION = "torch export limitation"
    SAMPLE = "the OpInfo/ModuleInfo sample cannot be used as is"


@dataclass(frozen=True)
class Known:
    """A known failure: its category and what exactly goes wrong."""

    why: Why
    detail: str

    def __str__(self) -> str:
        return f"{self.why.value}: {self.detail}"


@dataclass(frozen=True)
class Tolerance:
    """A per-case loosening of the bitwise comparison, and why it is needed."""

    rtol: float
    atol: float
    reason: str


def _bug(detail: str) -> Known:
    return Known(Why.PREDISPATCH_BUG, detail)


def _torch(detail: str) -> Known:
    return Known(Why.TORCH_LIMITATION, detail)


def _data(detail: str) -> Known:
    return Known(Why.DATA_DEPENDENT, detail)


def _device(detail: str) -> Known:
    return Known(Why.NEEDS_DEVICE, detail)


def _sample(detail: str) -> Known:
    return Known(Why.SAMPLE, detail)


# ---------------------------------------------------------------------------------------------
# op_db
# ---------------------------------------------------------------------------------------------

_UNINITIALIZED = "returns uninitialized memory (empty*): its values are arbitrary"

#: Ops whose values are not comparable with eager's: compared by shape and dtype only.
#: (Random ops are compared bitwise: see RUN_SEED in test_op_db.py.)
OP_DB_RANDOM: dict[str, str] = {
    "empty": _UNINITIALIZED,
    "empty_like": _UNINITIALIZED,
    "empty_permuted": _UNINITIALIZED,
    "empty_strided": _UNINITIALIZED,
    "new_empty": _UNINITIALIZED,
    "new_empty_strided": _UNINITIALIZED,
}

#: Ops compared with a tolerance instead of bitwise.  None needed today: every op that runs
#: matches eager bit for bit.
OP_DB_TOLERANCES: dict[str, Tolerance] = {}

_JITERATOR = _device("jiterator ops compile CUDA kernels at run time; CPU has none")
_LSTSQ = _data("aten.linalg_lstsq has no fake kernel for its data-dependent output sizes")

OP_DB_XFAILS: dict[str, Known] = {
    # Python values read from tensor contents.
    "allclose": _data("returns a Python bool computed from tensor values (aten.allclose)"),
    "equal": _data("returns a Python bool computed from tensor values (aten.equal)"),
    "corrcoef": _data("the reference branches on aten.equal of tensor values"),
    "cov": _data("the reference branches on aten.equal of tensor values"),
    "nn.functional.gaussian_nll_loss": _data("branches on a tensor value (Eq(u0, 1)) to validate var"),
    "linalg.lstsq": _LSTSQ,
    "linalg.lstsq.grad_oriented": _LSTSQ,
    "nn.functional.ctc_loss": _data("aten._ctc_loss has no fake kernel for its data-dependent output sizes"),
    # predispatch bugs: remove the entry with the fix (the case then XPASSes).
    # torch limitations.
    "broadcast_shapes": _torch(
        "a torch.Size output comes back as a plain tuple: pytree unflattens torch.Size to tuple "
        "(torch.export's module() does the same)"
    ),
    # Samples that cannot run here.
    "jiterator_unary": _JITERATOR,
    "jiterator_binary": _JITERATOR,
    "jiterator_binary_return_by_ref": _JITERATOR,
    "jiterator_2inputs_2outputs": _JITERATOR,
    "jiterator_4inputs_with_extra_args": _JITERATOR,
    "float_power:inplace": _sample("float_power_ needs a float64 base; eager raises on float32 too"),
}


# ---------------------------------------------------------------------------------------------
# module_db
# ---------------------------------------------------------------------------------------------

#: Modules compared by shape and dtype only.  None needed today: random modules (dropout in
#: training, FractionalMaxPool) draw the same numbers as eager under the same seed.
MODULE_DB_RANDOM: dict[str, str] = {}

#: Modules compared with a tolerance instead of bitwise.  None needed today.
MODULE_DB_TOLERANCES: dict[str, Tolerance] = {}

_CUMULATIVE_BN = _data(
    "BatchNorm(momentum=None) in training computes 1.0 / float(num_batches_tracked), a value "
    "read from a buffer; torch.export fails the same way"
)

MODULE_DB_XFAILS: dict[str, Known] = {
    "nn.BatchNorm1d:train:2": _CUMULATIVE_BN,
    "nn.BatchNorm2d:train:1": _CUMULATIVE_BN,
    "nn.BatchNorm3d:train:1": _CUMULATIVE_BN,
    "nn.CTCLoss": _data("aten._ctc_loss has no fake kernel for its data-dependent output sizes"),
    "nn.GaussianNLLLoss": _data("branches on a tensor value (Eq(u0, 1)) to validate var"),
}


def lookup(table: dict, key: str):
    """The entry for a `name:mode:index` key, or its `name:mode` or `name` prefix."""
    parts = key.split(":")
    for n in range(len(parts), 0, -1):
        entry = table.get(":".join(parts[:n]))
        if entry is not None:
            return entry
    return None


def counts() -> dict[str, collections.Counter]:
    """Expected-failure entries by category, per sweep (a module_db entry may cover several cases)."""
    return {
        "op_db": collections.Counter(k.why.value for k in OP_DB_XFAILS.values()),
        "module_db": collections.Counter(k.why.value for k in MODULE_DB_XFAILS.values()),
    }


if __name__ == "__main__":
    for sweep, counter in counts().items():
        print(f"{sweep}: {sum(counter.values())} expected failures")
        for why, n in counter.most_common():
            print(f"    {n:4d}  {why}")
