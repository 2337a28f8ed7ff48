"""Forward's writes outside the module: nothing of the trace stays reachable after export.

A forward may keep what it computes outside the module: a `functools.lru_cache`d helper, a
module-level dict, a mutable default argument, a class attribute set through `type(self)`.
During a trace every such value is a tracer tensor; left there, it breaks the model's next eager
call and every fresh instance (Note [Forward's writes outside the module] in _isolation.py).
Export puts each place back as it found it; each test exports, then runs the same instance and a
fresh one eagerly, and compares the program's output with eager's.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import predispatch
from helpers import stable_message
from predispatch import _torch_internals as ti


@functools.lru_cache(maxsize=None)
def _positions(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) / n


@functools.lru_cache(maxsize=8)
def _bounded_positions(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32) * 2


class LruCached(nn.Module):
    def forward(self, x):
        return x + _positions(x.shape[-1]) + _bounded_positions(x.shape[-1])


_BIAS: dict[int, torch.Tensor] = {}
_NESTED: dict[str, dict[int, torch.Tensor]] = {"by_size": {}}


class GlobalDict(nn.Module):
    def forward(self, x):
        n = x.shape[-1]
        if n not in _BIAS:
            _BIAS[n] = torch.ones(n) * 2
        _NESTED["by_size"].setdefault(n, torch.full((n,), 3.0))
        return x + _BIAS[n] * _NESTED["by_size"][n]


def _scaled(x, memo=[]):  # noqa: B006 - the mutable default is the point
    if not memo:
        memo.append(torch.full((x.shape[-1],), 0.5))
    return x * memo[0]


class DefaultArgument(nn.Module):
    def forward(self, x, cache={}):  # noqa: B006 - the mutable default is the point
        if "shift" not in cache:
            cache["shift"] = torch.arange(x.shape[-1], dtype=x.dtype)
        return _scaled(x) + cache["shift"]


class ClassAttribute(nn.Module):
    def forward(self, x):
        if "table" not in vars(type(self)):
            type(self).table = torch.linspace(0, 1, x.shape[-1])
        return x * type(self).table


PATTERNS = {
    "lru_cache": LruCached,
    "module_dict": GlobalDict,
    "default_argument": DefaultArgument,
    "class_attribute": ClassAttribute,
}


def _outside_state() -> dict:
    return {
        "positions": _positions.cache_info().currsize,
        "bounded": _bounded_positions.cache_info().currsize,
        "bias": dict(_BIAS),
        "nested": {k: dict(v) for k, v in _NESTED.items()},
        "memo": list(_scaled.__defaults__[0]),
        "cache": dict(DefaultArgument.forward.__defaults__[0]),
        "table": "table" in vars(ClassAttribute),
    }


def _no_tracer_tensors(state: dict) -> None:
    def leaves(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from leaves(v)
        elif isinstance(value, list):
            for v in value:
                yield from leaves(v)
        else:
            yield value

    assert not any(ti.is_traced_tensor(v) for v in leaves(state))


@pytest.fixture(autouse=True)
def _empty_outside_places():
    def clear():
        _positions.cache_clear()
        _bounded_positions.cache_clear()
        _BIAS.clear()
        _NESTED["by_size"].clear()
        _scaled.__defaults__[0].clear()
        DefaultArgument.forward.__defaults__[0].clear()
        vars(ClassAttribute).get("table") is not None and delattr(ClassAttribute, "table")

    clear()
    yield
    clear()


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_nothing_of_the_trace_stays_outside_the_module(pattern):
    """The outside place is as before (empty), holds no tracer tensor, and the same instance and
    a fresh one run eagerly; the program's result is eager's.  Before: the place held a fake or
    functional tensor and the eager call raised ("Attempting to use FunctionalTensor on its
    own", "Please convert all Tensors to FakeTensors")."""
    model, x = PATTERNS[pattern](), torch.randn(2, 4)
    before = _outside_state()
    ep = predispatch.export(model, (x,))
    after = _outside_state()
    _no_tracer_tensors(after)
    assert after == before
    eager = model(x)
    assert torch.equal(PATTERNS[pattern]()(x), eager)
    assert torch.equal(ep.module()(x), eager)


_TABLE = None


def _function_with_global(x):
    global _TABLE
    _TABLE = torch.ones(x.shape[-1]) if _TABLE is None else _TABLE
    return x + _TABLE


def test_a_global_an_exported_function_assigns_is_put_back():
    """`global _TABLE; _TABLE = ...` in an exported function: the global is None again."""
    x = torch.randn(2, 4)
    ep = predispatch.export(_function_with_global, (x,))
    assert _TABLE is None
    assert torch.equal(ep.module()(x), x + 1)


class _Failing(GlobalDict):
    def forward(self, x):
        y = super().forward(x)
        type(self).table = y
        raise RuntimeError("boom")


def test_put_back_when_export_fails():
    before = _outside_state()
    with pytest.raises(predispatch.errors.TraceError):
        predispatch.export(_Failing(), (torch.randn(2, 4),))
    assert _outside_state() == before and "table" not in vars(_Failing)


class _Slots:
    __slots__ = ("value",)


_HOLDER = _Slots()


class SlotsHolder(nn.Module):
    def forward(self, x):
        _HOLDER.value = x * 2
        return x + 1


def test_a_place_export_cannot_put_back_is_refused_by_name():
    """An object with `__slots__` held by a global: export cannot snapshot it, so a tracer tensor
    left there is refused with the place named (our error), not left for the next eager call."""
    with pytest.raises(predispatch.errors.OutsideWriteError) as info:
        predispatch.export(SlotsHolder(), (torch.randn(2, 4),))
    text = stable_message(info.value)
    assert text.startswith(
        "forward left a tensor of the trace in test_outside_writes._HOLDER.value, outside the module, "
        "where export cannot put back what was there"
    ), text
    assert "  at test_outside_writes.py:N (predispatch.export(SlotsHolder(), (torch.randn(2, 4),)))" in text, text
    assert "see docs/errors.md#outsidewriteerror" in text
    del _HOLDER.value


_STATS: dict = {"calls": 0, "last": {}}


class CountsAndCaches(nn.Module):
    def forward(self, x):
        _STATS["calls"] += 1  # a plain value: stays, as after the one eager call the trace stands for
        _STATS["last"][x.shape[-1]] = x * 2  # a tensor of the trace: put back
        return x + 1


def test_plain_values_forward_keeps_outside_stay_tensors_of_the_trace_go():
    """Only what holds a tracer tensor is put back: a call counter in the same dict keeps
    forward's one increment (test_autograd_function counts calls this way)."""
    _STATS.update(calls=0, last={})
    predispatch.export(CountsAndCaches(), (torch.randn(2, 4),))
    assert _STATS == {"calls": 1, "last": {}}
