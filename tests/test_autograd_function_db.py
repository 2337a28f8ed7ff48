"""Sweep torch's autograd.Function database (`autograd_function_db`) through predispatch.export.

Every entry's first sample (CPU float32) is wrapped in a module whose forward calls the entry's
op, as tests/test_op_db.py does for op_db.  Each entry either

    exports: the graph is functional and holds the Function as one `autograd_function_apply`
        (its backward kept, not inlined); the Function's forward ran once at export; the
        program's outputs and the gradients of its inputs, for random output gradients, equal
        eager's bitwise;
    or is refused (`REFUSED`): its forward leaves torch (`.numpy()`), and export raises
        `AutogradFunctionError` naming the Function, its `def forward` line and the custom-op fix.

These Functions are defined under `torch.testing`: the sweep is also the test that where a
Function's class is defined does not decide whether it is captured (Note [Which Functions are
captured] in predispatch/custom_backward/autograd_function/capture.py).  The whole sweep runs by default
(about ten seconds):

    pytest tests/test_autograd_function_db.py
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.testing._internal import autograd_function_db as db_module
from torch.testing._internal.autograd_function_db import autograd_function_db
from torch.testing._internal.opinfo.core import OpInfo, SampleInput

import predispatch
from predispatch import _torch_internals as ti
from predispatch.errors import AutogradFunctionError
from predispatch.passes.check_functional import mutable_ops
from sweep_support import assert_same, clone_tree

DTYPE = torch.float32

#: Seed of the random output gradients, the same for eager and the program.
GRAD_SEED = 0

#: Entries refused by design, each with the Function whose forward leaves torch (numpy).
REFUSED: dict[str, str] = {
    "NumpyCubeAutogradFunction": "NumpyCube",
    "NumpyExpMarkDirtyAutogradFunction": "NumpyExp_",
    "NumpyMulAutogradFunction": "NumpyMul",
    "NumpyCubeNotComposableAutogradFunction": "NumpyCubeNotComposable",
    "NumpySortAutogradFunction": "NumpySort",
    "NumpyTakeAutogradFunction": "NumpyTake",
}

#: Known failures (strict xfails), each with its reason.  None today.
XFAILS: dict[str, str] = {}

INFOS: dict[str, OpInfo] = {info.name: info for info in autograd_function_db}

#: Every autograd.Function class the database defines, by name.
FUNCTIONS: dict[str, type] = {
    name: value
    for name, value in vars(db_module).items()
    if isinstance(value, type) and issubclass(value, torch.autograd.Function) and value.__module__ == db_module.__name__
}


class OpModule(nn.Module):
    """Calls `op(sample.input, *sample.args, **sample.kwargs)` with the tensors passed in; every
    other leaf of the sample is held here as a constant."""

    def __init__(self, op: Any, sample: SampleInput):
        super().__init__()
        leaves, self._spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self._is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
        self._constants = [None if t else leaf for t, leaf in zip(self._is_tensor, leaves)]
        self._op = _looked_up_at_call_time(op)

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self._is_tensor, self._constants)]
        input, args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        return self._op(input, *args, **kwargs)


def _looked_up_at_call_time(op: Any) -> Any:
    """`MyFn.apply` bound when the database was built, called as `MyFn.apply(...)` in forward.

    On torch >= 2.14 a bound `apply` is torch's C++ apply itself, which export cannot intercept
    (it refuses it by name: `test_autograd_function.py::test_apply_bound_before_export`); looked
    up in forward, as user code writes it, the call is captured on every release.
    """
    owner = getattr(op, "__self__", None)
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function) and op.__name__ == "apply":
        return lambda *args, **kwargs: owner.apply(*args, **kwargs)
    return op


def first_sample(info: OpInfo) -> tuple[OpModule, tuple[torch.Tensor, ...]]:
    """The entry's module and tensor inputs, from its first sample, seeded."""
    torch.manual_seed(0)
    samples = iter(info.sample_inputs("cpu", DTYPE, requires_grad=False))
    try:
        sample = next(samples)
    finally:
        getattr(samples, "close", lambda: None)()  # not left to the collector mid-trace
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return OpModule(info.op, sample), tuple(x for x in leaves if isinstance(x, torch.Tensor))


@contextlib.contextmanager
def counting_forwards() -> Iterator[dict[str, int]]:
    """Count each database Function's forward calls while active, outside of backwards.

    A backward may apply Functions itself (`MulGenVmap`'s does): those forwards are part of
    tracing the backward, not runs of the user's forward.
    """
    counts = {name: 0 for name in FUNCTIONS}
    in_backward = [0]
    originals = {name: (cls.__dict__["forward"], cls.__dict__["backward"]) for name, cls in FUNCTIONS.items()}

    def counted_forward(name: str, forward: Any) -> Any:
        @functools.wraps(forward)
        def wrapper(*args, **kwargs):
            counts[name] += in_backward[0] == 0
            return forward(*args, **kwargs)

        return staticmethod(wrapper)

    def marked_backward(backward: Any) -> Any:
        @functools.wraps(backward)
        def wrapper(*args, **kwargs):
            in_backward[0] += 1
            try:
                return backward(*args, **kwargs)
            finally:
                in_backward[0] -= 1

        return staticmethod(wrapper)

    for name, cls in FUNCTIONS.items():
        forward, backward = originals[name]
        cls.forward, cls.backward = counted_forward(name, forward.__func__), marked_backward(backward.__func__)
    try:
        yield counts
    finally:
        for name, cls in FUNCTIONS.items():
            cls.forward, cls.backward = originals[name]


def run_with_grads(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[Any, list[torch.Tensor | None]]:
    """Outputs, and the gradients of the floating inputs for seeded random output gradients."""
    inputs = tuple(t.requires_grad_(t.is_floating_point()) for t in clone_tree(inputs))
    outputs = module(*inputs)
    live = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    torch.manual_seed(GRAD_SEED)
    torch.autograd.backward(live, [torch.randn_like(t) for t in live])
    return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, outputs), [t.grad for t in inputs]


def entry_function(info: OpInfo) -> str:
    """The class name of the Function an entry applies (`Cube.apply` or a lambda around one)."""
    op = info.op
    if isinstance(getattr(op, "__self__", None), type):
        return op.__self__.__name__
    names = [n for n in op.__code__.co_names if n in FUNCTIONS]
    assert len(names) == 1, f"{info.name}: cannot tell which Function {op} applies"
    return names[0]


def check_exported(key: str) -> None:
    info = INFOS[key]
    module, inputs = first_sample(info)
    with counting_forwards() as counts:
        ep = predispatch.export(module, clone_tree(inputs))
    assert counts[entry_function(info)] == 1, counts
    assert mutable_ops(ep.graph_module) == []
    applies = ep.graph_module.graph.find_nodes(op="call_function", target=ti.autograd_function_apply)
    assert len(applies) == 1, f"{key}: the Function was not captured as one autograd_function_apply"

    expected, expected_grads = run_with_grads(module, inputs)
    actual, actual_grads = run_with_grads(ep.module(), inputs)
    assert_same(actual, expected, what="output")
    assert_same(actual_grads, expected_grads, what="input gradients")


def _params() -> list[Any]:
    params = []
    for key in INFOS:
        if key in REFUSED:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=XFAILS[key])] if key in XFAILS else []
        params.append(pytest.param(key, marks=marks, id=key))
    return params


@pytest.mark.parametrize("key", _params())
def test_exported(key: str) -> None:
    check_exported(key)


def _stable(text: str) -> str:
    return text.replace(os.path.dirname(db_module.__file__) + os.sep, "<torch.testing._internal>/")


@pytest.mark.parametrize("key", list(REFUSED))
def test_numpy_refused(key: str) -> None:
    """The Function that leaves torch is named with its `def forward` line, and nothing is left patched."""
    module, inputs = first_sample(INFOS[key])
    with pytest.raises(AutogradFunctionError) as info:
        predispatch.export(module, clone_tree(inputs))
    text = _stable(str(info.value))
    function = FUNCTIONS[REFUSED[key]]
    lines, first = inspect.getsourcelines(function.forward)  # from the `@staticmethod` line
    def_line = first + next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
    assert text.startswith(f"autograd.Function {function.__qualname__} (forward): forward leaves torch: it calls `.numpy()`"), text
    assert f"  at <torch.testing._internal>/autograd_function_db.py:{def_line} (def forward(" in text, text
    assert "torch.library.custom_op" in text and "register_fake" in text, text
    assert info.value.__cause__ is None
    assert "numpy" not in torch.Tensor.__dict__ and "apply" not in ti.SingleLevelFunction.__dict__
    assert isinstance(inputs[0].detach().numpy(), object)  # torch's own .numpy() is back


def test_numpy_refusal_message() -> None:
    module, inputs = first_sample(INFOS["NumpyCubeAutogradFunction"])
    with pytest.raises(AutogradFunctionError) as info:
        predispatch.export(module, clone_tree(inputs))
    assert _stable(str(info.value)) == """\
autograd.Function NumpyCube (forward): forward leaves torch: it calls `.numpy()` on a tensor (at <torch.testing._internal>/autograd_function_db.py:26 (return tensor.cpu().numpy())); export traces it on fake tensors, which hold no data, so what numpy computes cannot be captured.
  at <torch.testing._internal>/autograd_function_db.py:31 (def forward(input):)
  fix: move the part that leaves torch into a torch.library.custom_op (@torch.library.custom_op("mylib::name", mutates_args=())) with a fake kernel (@name.register_fake, computing only the output's shape and dtype) and its gradient (name.register_autograd); call it from the Function, or write the Function with torch operations only.
  see docs/errors.md#autogradfunctionerror"""


def test_tables_name_entries() -> None:
    """Every database entry is either swept or refused; table keys name real entries."""
    assert set(REFUSED) | set(XFAILS) <= set(INFOS)
    assert all(name in FUNCTIONS for name in REFUSED.values())
    assert len(_params()) + len(REFUSED) == len(autograd_function_db)
