"""Export's work grows linearly with the parameters and ops of the program (issue 40).

No clock: each test counts the work one export does (`_work`) at n and 2n of something a model
has many of, and asserts that doubling it at most doubles the work, with a margin
(`_LINEAR`).  Each model below made a step of export quadratic before (named on the test); a
quadratic step shows as a ratio near 4.  benchmarks/export_scaling.py measures the time.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest
import torch
from scaling_cases import FunctionCalls, Params, UpdatedUnderNoGrad
from torch import fx, nn

import predispatch
import predispatch._export as pipeline
from predispatch.trace.dedup.share import _Sharing

#: Doubling n may at most double the work, plus a margin for what n does not scale.
_LINEAR = 2.2

_OWN_CODE = os.path.dirname(predispatch.__file__) + os.sep
_NAMED_MODULES = nn.Module.named_modules.__code__
_ARGUMENT_REWRITES = ("_replace_input_with", "_update_args_kwargs")


def _work(model: nn.Module, args: tuple, monkeypatch: pytest.MonkeyPatch, within: tuple = (pipeline, "_export_locked")) -> int:
    """The work of one export of `model` done inside `within` (an owner and the name of a
    function on it; by default the trace and the build, not the checks tests add):

    - every call of predispatch's own Python code (a generator's resumption counts as a call,
      so a scan written as `any(... for ...)` counts each item it visits);
    - every module `nn.Module.named_modules` yields (FX looked modules up by walking them);
    - every node an iteration over a graph's nodes yields (`set(graph.nodes)` walks them all);
    - every input node FX re-links when it rebuilds a node's arguments.
    """
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call":
            code = frame.f_code
            if code is _NAMED_MODULES or code.co_filename.startswith(_OWN_CODE):
                count += 1
        elif event == "c_call" and getattr(arg, "__name__", None) in _ARGUMENT_REWRITES:
            count += len(arg.__self__.all_input_nodes)

    node_list = type(fx.Graph().nodes)
    iterate = node_list.__iter__

    owner, name = within
    function = getattr(owner, name)
    counting = False

    def counted(*a, **k):
        nonlocal counting
        previous = sys.getprofile()
        sys.setprofile(profile)
        counting = True
        try:
            return function(*a, **k)
        finally:
            counting = False
            sys.setprofile(previous)

    def counted_nodes(self):
        nonlocal count
        for node in iterate(self):
            count += counting
            yield node

    with monkeypatch.context() as patch:
        patch.setattr(owner, name, counted)
        patch.setattr(node_list, "__iter__", counted_nodes)
        predispatch.export(model, args)
    return count


def _ratio(make: Callable[[int], nn.Module], n: int, monkeypatch: pytest.MonkeyPatch, **within) -> float:
    """The work of exporting `make(2 * n)` over that of `make(n)`."""
    x = torch.randn(2, 4)
    predispatch.export(make(2), (x,))  # warm: first-use costs (imports, caches) are not the model's
    return _work(make(2 * n), (x,), monkeypatch, **within) / _work(make(n), (x,), monkeypatch, **within)


class _RegionsInAutocast(Params):
    """A no_grad region per parameter, all inside one autocast region."""

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            for p in self.ps:
                with torch.no_grad():
                    y = p * 2
                x = x + y
        return x


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a = nn.Linear(4, width, bias=False)
        self.b = nn.Linear(width, 4, bias=False)

    def forward(self, x):
        y = self.a(x)
        for _ in range(6):
            y = torch.tanh(y) + 1
        return self.b(y) + x


class _BlockKinds(nn.Module):
    """`n` kinds of block (widths), three of each: `n` shared bodies."""

    def __init__(self, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for width in range(1, n + 1) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_parameters_updated_under_no_grad(monkeypatch):
    """Was quadratic: the grad-history keeper scanned its list of written tensors at each write
    and each op (trace/grad_history.py); `remove_copies` rewrote the output node once per
    written parameter; `wrap_regions` looked each region output up in a list."""
    assert _ratio(UpdatedUnderNoGrad, 100, monkeypatch) <= _LINEAR


def test_regions_inside_a_region(monkeypatch):
    """Was quadratic: `wrap_regions` searched and rebuilt the enclosing region's nodes once per
    region inside it."""
    assert _ratio(_RegionsInAutocast, 150, monkeypatch) <= _LINEAR


def test_function_calls(monkeypatch):
    """Was quadratic: FX named each captured Function's graphs in its node by walking every
    module installed on the traced module so far (`Tracer.create_arg`)."""
    assert _ratio(FunctionCalls, 60, monkeypatch) <= _LINEAR


def test_shared_block_kinds(monkeypatch):
    """Was quadratic: dedup's fold gathered the graph's nodes once per shared body."""
    assert _ratio(_BlockKinds, 6, monkeypatch, within=(_Sharing, "fold")) <= _LINEAR
