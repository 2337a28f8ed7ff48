"""Sweep torch's autograd.Function database (`autograd_function_db`) through predispatch.export.

Every entry's first sample (CPU float32) is wrapped in a module whose forward calls the entry's
op, as tests/test_op_db.py does for op_db, once for each way user code reaches a Function's
`apply` (`IDIOMS`: called in forward, bound at module level, bound in `__init__`, kept in a
table, wrapped in `functools.partial`, passed to a helper).  Each entry either

    exports: the graph is functional and holds the Function as one `autograd_function_apply`
        (its backward kept, not inlined); the Function's forward ran once at export; the
        program's outputs and the gradients of its inputs, for random output gradients, equal
        eager's bitwise, through `ep.module()` and through the saved and loaded program, and
        the joint program's (`ep.joint()`) gradients equal eager's;
    or is refused (`REFUSED`): its forward leaves torch (`.numpy()`), and export raises
        `AutogradFunctionError` naming the Function, its `def forward` line and the custom-op fix.

These Functions are defined under `torch.testing`: the sweep is also the test that where a
Function's class is defined does not decide whether it is captured (Note [Which Functions are
captured] in predispatch/custom_backward/autograd_function/capture.py), and, as the database
binds every `apply` when it is built, that how `apply` was reached does not either (Note [Seeing
every apply] in predispatch/_torch_internals/autograd_function.py).  The whole sweep runs by
default (about a minute):

    pytest tests/test_autograd_function_db.py
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
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
from helpers import round_trip
from sweep_support import assert_same, clone_tree
from test_joint import Loss, check_joint

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


def _helper(op: Any, *args: Any, **kwargs: Any) -> Any:
    """A library helper handed the op as a callable."""
    return op(*args, **kwargs)


#: How a program reaches an entry's `apply`, from the Function class and the database's op (the
#: class's `apply`, bound when the database was built): the callable the module's forward calls.
IDIOMS: dict[str, Callable[[type, Any], Callable[..., Any]]] = {
    "called_in_forward": lambda cls, op: lambda *args, **kwargs: cls.apply(*args, **kwargs),
    "bound_at_module_level": lambda cls, op: op,
    "bound_in_init": lambda cls, op: cls.apply,
    "kept_in_a_table": lambda cls, op: (lambda table: lambda *args, **kwargs: table["op"](*args, **kwargs))({"op": cls.apply}),
    "wrapped_in_partial": lambda cls, op: functools.partial(cls.apply),
    "passed_to_a_helper": lambda cls, op: lambda *args, **kwargs: _helper(cls.apply, *args, **kwargs),
}


class OpModule(nn.Module):
    """Calls `op(sample.input, *sample.args, **sample.kwargs)` with the tensors passed in; every
    other leaf of the sample is held here as a constant.  `op` is reached as `idiom` says."""

    def __init__(self, op: Any, sample: SampleInput, idiom: str = "bound_at_module_level"):
        super().__init__()
        self._rebuild = _rebuilder(sample)
        owner = getattr(op, "__self__", None)
        bound_apply = isinstance(owner, type) and issubclass(owner, torch.autograd.Function) and op.__name__ == "apply"
        assert bound_apply or idiom == "bound_at_module_level", f"{op} is not a Function's apply"
        self._op = IDIOMS[idiom](owner, op) if bound_apply else op

    def forward(self, *tensors: torch.Tensor) -> Any:
        input, args, kwargs = self._rebuild(tensors)
        return self._op(input, *args, **kwargs)


def _rebuilder(sample: SampleInput) -> Callable[[tuple], Any]:
    """`(input, args, kwargs)` of `sample` with its tensors replaced, in order, by those given
    (a function, which a module's deep copy shares)."""
    leaves, spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
    is_tensor = [isinstance(leaf, torch.Tensor) for leaf in leaves]
    constants = [None if t else leaf for t, leaf in zip(is_tensor, leaves)]

    def rebuild(tensors: tuple) -> Any:
        it = iter(tensors)
        return pytree.tree_unflatten([next(it) if t else c for t, c in zip(is_tensor, constants)], spec)

    return rebuild


def first_sample(info: OpInfo, idiom: str = "bound_at_module_level") -> tuple[OpModule, tuple[torch.Tensor, ...]]:
    """The entry's module (reaching its op as `idiom` says) and tensor inputs, from its first sample, seeded."""
    torch.manual_seed(0)
    samples = iter(info.sample_inputs("cpu", DTYPE, requires_grad=False))
    try:
        sample = next(samples)
    finally:
        getattr(samples, "close", lambda: None)()  # not left to the collector mid-trace
    leaves = pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
    return OpModule(info.op, sample, idiom), tuple(x for x in leaves if isinstance(x, torch.Tensor))


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


def check_exported(key: str, idiom: str) -> None:
    info = INFOS[key]
    module, inputs = first_sample(info, idiom)
    with counting_forwards() as counts:
        ep = predispatch.export(module, clone_tree(inputs))
    assert counts[entry_function(info)] == 1, counts
    assert mutable_ops(ep.graph_module) == []
    applies = ep.graph_module.graph.find_nodes(op="call_function", target=ti.autograd_function_apply)
    assert len(applies) == 1, f"{key}: the Function was not captured as one autograd_function_apply"

    expected, expected_grads = run_with_grads(module, inputs)
    for program, what in ((ep.module(), "ep.module()"), (round_trip(ep).module(), "saved and loaded")):
        actual, actual_grads = run_with_grads(program, inputs)
        assert_same(actual, expected, what=f"{what}: output")
        assert_same(actual_grads, expected_grads, what=f"{what}: input gradients")
    check_joint(Loss(module), clone_tree(inputs))


def _params() -> list[Any]:
    params = []
    for key in INFOS:
        if key in REFUSED:
            continue
        marks = [pytest.mark.xfail(strict=True, reason=XFAILS[key])] if key in XFAILS else []
        params.extend(pytest.param(key, idiom, marks=marks, id=f"{key}-{idiom}") for idiom in IDIOMS)
    return params


@pytest.mark.parametrize(("key", "idiom"), _params())
def test_exported(key: str, idiom: str) -> None:
    check_exported(key, idiom)


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
    assert len(_params()) + len(REFUSED) * len(IDIOMS) == len(autograd_function_db) * len(IDIOMS)
