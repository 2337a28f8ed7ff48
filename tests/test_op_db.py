"""Sweep torch's OpInfo database (`op_db`) through predispatch.export, CPU float32.

For every OpInfo, and for its in-place variant where it has one, the first sample is wrapped
in a module whose forward calls the op (tensors are export inputs, everything else is held by
the module as a constant).  Each case checks that

    (a) the exported graph is functional: `mutable_ops(ep.graph_module) == []`;
    (b) `ep.module()` returns what eager returns, bitwise unless `OP_DB_TOLERANCES` says why not
        (`OP_DB_RANDOM` ops: shape and dtype only);
    (c) the inputs after the call equal eager's: an in-place variant's mutation is applied
        back, and nothing else is mutated.

Eager, export and the program each get their own clones of the sample.  Known failures are
strict xfails listed with reasons in `sweep_expected_failures.py`.  A fast subset runs by
default; the whole sweep is behind the slow marker:

    pytest tests/test_op_db.py                              # fast subset
    pytest -m slow -p no:cacheprovider tests/test_op_db.py  # full sweep
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from unittest import mock

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.testing._internal import common_methods_invocations
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import OpInfo, SampleInput

import predispatch
from predispatch.passes.check_functional import mutable_ops
from sweep_expected_failures import OP_DB_RANDOM, OP_DB_TOLERANCES, OP_DB_XFAILS
from sweep_support import assert_same, clone_tree, param, skipped

DTYPE = torch.float32

#: Random OpInfos call their op through `wrapper_set_seed`, which runs it under
#: `torch.manual_seed(42)` in eager and restores the RNG state after.  A graph cannot record
#: reseeding, so export refuses it inside forward (RngStateError, Note [RNG state in forward]):
#: the sweep calls those ops plainly (`_call_plainly`), in eager and at export, and runs eager
#: and the program under the same seed: a graph that draws from the same generator in the same
#: order then matches eager bitwise.
RUN_SEED = 42


def _call_plainly(op: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`wrapper_set_seed` without its reseeding: the sweep seeds outside forward instead."""
    return op(*args, **kwargs)


#: The default subset: common ops across families (pointwise, reductions, views, indexing,
#: linear algebra, nn.functional), and a few in-place variants.
FAST_OPS = (
    "abs", "add", "mul", "div.no_rounding_mode", "exp", "sigmoid", "tanh", "clamp", "where",
    "sum", "mean", "amax", "max.reduction_with_dim", "argmax", "cumsum", "softmax",
    "view", "reshape", "transpose", "permute", "expand", "cat", "stack", "split", "unsqueeze",
    "index_select", "gather", "__getitem__", "masked_fill",
    "mm", "bmm", "matmul", "addmm",
    "nn.functional.linear", "nn.functional.conv2d", "nn.functional.relu", "nn.functional.gelu",
    "nn.functional.layer_norm", "nn.functional.embedding", "nn.functional.dropout",
    "add:inplace", "mul:inplace", "clamp:inplace", "masked_fill:inplace",
)


@dataclass(frozen=True)
class OpCase:
    """One OpInfo, functional or in-place.

    key: the test id and table key (`add`, `div.trunc_rounding`, `add:inplace`).
    opinfo: the OpInfo.
    inplace: whether `fn` is the OpInfo's in-place variant.
    """

    key: str
    opinfo: OpInfo
    inplace: bool

    @property
    def fn(self) -> Callable[..., Any]:
        return self.opinfo.inplace_variant if self.inplace else self.opinfo.op


def _cases() -> dict[str, OpCase]:
    cases = {}
    for opinfo in op_db:
        key = f"{opinfo.name}.{opinfo.variant_test_name}" if opinfo.variant_test_name else opinfo.name
        cases[key] = OpCase(key, opinfo, False)
        if opinfo.inplace_variant is not None:
            cases[f"{key}:inplace"] = OpCase(f"{key}:inplace", opinfo, True)
    return cases


CASES = _cases()


def _params(keys) -> list[Any]:
    """Each key as a pytest param: skipped if the OpInfo has no float32, xfail if known."""
    params = []
    for key in keys:
        if DTYPE not in CASES[key].opinfo.supported_dtypes("cpu"):
            params.append(skipped(key, "the OpInfo declares no float32 support on CPU"))
        else:
            params.append(param(key, OP_DB_XFAILS.get(key)))
    return params


class OpModule(nn.Module):
    """Calls `fn(sample.input, *sample.args, **sample.kwargs)` with the tensors passed in.

    forward takes the sample's tensor leaves, in pytree order; every other leaf (ints, dims,
    dtypes, ...) is held here and baked into the program as a constant.
    """

    def __init__(self, fn: Callable[..., Any], sample: SampleInput):
        super().__init__()
        leaves, self._spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self._is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        self._constants = [None if t else leaf for t, leaf in zip(self._is_tensor, leaves)]
        self._fn = fn

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self._is_tensor, self._constants)]
        input, args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self._fn(input, *args, **kwargs)


def first_sample(case: OpCase) -> SampleInput:
    """The first sample, seeded; for an in-place variant, the first that does not broadcast its
    input (an in-place op cannot grow its input: eager itself would raise)."""
    torch.manual_seed(0)
    samples = iter(case.opinfo.sample_inputs("cpu", DTYPE, requires_grad=False))
    try:
        return next(s for s in samples if not (case.inplace and s.broadcasts_input))
    except StopIteration:
        raise AssertionError(f"{case.key}: the OpInfo yields no usable float32 sample") from None
    finally:
        # Finish the generator now: left to the garbage collector, its cleanup (a no_grad
        # exit) could run in the middle of the trace and be recorded by it.
        getattr(samples, "close", lambda: None)()


def tensor_leaves(sample: SampleInput) -> tuple[torch.Tensor, ...]:
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return tuple(x for x in leaves if isinstance(x, torch.Tensor))


def check_op(key: str) -> None:
    """Export one case, then compare graph, outputs and mutated inputs with eager."""
    with mock.patch.object(common_methods_invocations, "wrapper_set_seed", _call_plainly):
        _check_op(key)


def _check_op(key: str) -> None:
    case = CASES[key]
    sample = first_sample(case)
    module = OpModule(case.fn, sample)
    inputs = tensor_leaves(sample)

    ep = predispatch.export(module, clone_tree(inputs))
    assert mutable_ops(ep.graph_module) == []

    eager_inputs, program_inputs = clone_tree(inputs), clone_tree(inputs)
    torch.manual_seed(RUN_SEED)
    expected = module(*eager_inputs)
    torch.manual_seed(RUN_SEED)
    actual = ep.module()(*program_inputs)

    compare = partial(assert_same, tolerance=OP_DB_TOLERANCES.get(key), values=key not in OP_DB_RANDOM)
    compare(actual, expected, what="output")
    compare(program_inputs, eager_inputs, what="inputs after the call")


@pytest.mark.parametrize("key", _params(FAST_OPS))
def test_op_fast(key: str) -> None:
    check_op(key)


@pytest.mark.slow
@pytest.mark.parametrize("key", _params(CASES))
def test_op(key: str) -> None:
    check_op(key)


def test_table_keys_name_cases() -> None:
    """A key that names no case never applies: catch typos and OpInfos that torch renamed."""
    for table in (OP_DB_XFAILS, OP_DB_RANDOM, OP_DB_TOLERANCES):
        assert set(table) - set(CASES) == set()
