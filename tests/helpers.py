"""Shared checks: a program must match eager and leave everything as it found it."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
from typing import Any

import torch
import torch.utils._pytree as pytree

import predispatch
from predispatch._torch_versions import DEVELOPMENT
from predispatch.passes import mutable_ops
from predispatch.program.printing import format_graph


def round_trip(ep: predispatch.ExportedProgram) -> predispatch.ExportedProgram:
    """`ep` saved with `predispatch.save` and loaded back, in memory."""
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    buffer.seek(0)
    return predispatch.load(buffer)


def clone_tree(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


def state_bits(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict(keep_vars=True).items()}


def assert_same_tree(actual: Any, expected: Any, exact: bool = True) -> None:
    """Same structure, same constants, tensors equal (bitwise unless `exact` is False)."""
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    assert a_spec == e_spec, (a_spec, e_spec)
    for a, e in zip(a_leaves, e_leaves):
        if isinstance(e, torch.Tensor):
            tol = {"rtol": 0, "atol": 0} if exact else {}
            torch.testing.assert_close(a, e, equal_nan=True, **tol)
        else:
            assert a == e, (a, e)


def export_and_check(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    exact: bool = True,
    eager: torch.nn.Module | None = None,
    **options,
):
    """Export, then check what every test of a module must hold; returns the program.

    - the graph (and its subgraphs) holds no mutable op, and the program keeps the IR contract `load` checks;
    - the module's state_dict is bit-identical after export and its parameters are the same objects;
    - `ep.module()` on clones of the inputs gives eager's outputs, mutated inputs and buffers.

    `eager`: a twin of `module` to run eager on, where `copy.deepcopy` is not one (it does not
    keep a buffer made as a view of a parameter sharing the parameter's memory).
    """
    kwargs = kwargs or {}
    before = state_bits(module)
    params_before = dict(module.named_parameters())
    ep = predispatch.export(module, args, kwargs, **options)
    assert mutable_ops(ep.graph_module) == []
    assert_verified(ep)
    after = module.state_dict(keep_vars=True)
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(v, after[k]) and v.dtype == after[k].dtype, k
    assert all(p is params_before[n] for n, p in module.named_parameters())

    eager_module = copy.deepcopy(module) if eager is None else eager
    program = ep.module()
    e_args, e_kwargs = clone_tree((args, kwargs))
    p_args, p_kwargs = clone_tree((args, kwargs))
    expected = eager_module(*e_args, **e_kwargs)
    actual = program(*p_args, **p_kwargs)
    assert_same_tree(actual, expected, exact)
    assert_same_tree((p_args, p_kwargs), (e_args, e_kwargs), exact)
    assert_same_tree(program.state_dict(), eager_module.state_dict(), exact)
    return ep


def graph(ep: predispatch.ExportedProgram) -> str:
    return format_graph(ep.graph_module)


def check_gradients(
    module: torch.nn.Module,
    args: tuple,
    kwargs: dict | None = None,
    *,
    outer_no_grad: bool = False,
    eager: torch.nn.Module | None = None,
):
    """Outputs, `requires_grad` of outputs, and gradients of inputs and parameters equal eager's.

    Runs eager on a deep copy of the module (or on `eager`, its twin, where a deep copy is not
    one) and the program on `ep.module()`, each on fresh clones of the inputs (floating inputs
    require grad).  With `outer_no_grad`, both run inside `torch.no_grad()` and only outputs
    and their `requires_grad` are compared.
    """
    kwargs = kwargs or {}
    ep = predispatch.export(module, args, kwargs)
    assert mutable_ops(ep.graph_module) == []
    assert_verified(ep)
    eager, program = copy.deepcopy(module) if eager is None else eager, ep.module()

    def fresh():
        return pytree.tree_map_only(
            torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.is_floating_point()), (args, kwargs)
        )

    (e_args, e_kwargs), (p_args, p_kwargs) = fresh(), fresh()
    with torch.no_grad() if outer_no_grad else contextlib.nullcontext():
        expected = eager(*e_args, **e_kwargs)
        eager_leaves_grad = torch.is_grad_enabled()
        torch.set_grad_enabled(not outer_no_grad)  # undo what eager's forward may have left
        actual = program(*p_args, **p_kwargs)
        assert torch.is_grad_enabled() == eager_leaves_grad
    torch.set_grad_enabled(True)
    assert_same_tree(actual, expected)
    e_out = [t for t in pytree.tree_leaves(expected) if isinstance(t, torch.Tensor)]
    p_out = [t for t in pytree.tree_leaves(actual) if isinstance(t, torch.Tensor)]
    assert [t.requires_grad for t in p_out] == [t.requires_grad for t in e_out]
    if not outer_no_grad:
        _backward(e_out), _backward(p_out)
        for e, p in zip(pytree.tree_leaves((e_args, e_kwargs)), pytree.tree_leaves((p_args, p_kwargs))):
            if isinstance(e, torch.Tensor):
                assert_same_tree(p.grad, e.grad)
        for (name, e), p in zip(eager.named_parameters(), program.parameters()):
            assert_same_tree(p.grad, e.grad)
    assert_same_tree(program.state_dict(), eager.state_dict())
    return ep


def _backward(outputs: list[torch.Tensor]) -> None:
    live = [t for t in outputs if t.requires_grad]
    if live:
        torch.autograd.backward([t.float().sum() for t in live])


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def subprocess_env(*paths: str) -> dict[str, str]:
    """This process's environment with `paths` first on PYTHONPATH, keeping what was there (a
    machine whose test packages come from PYTHONPATH), for tests that run a child interpreter."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [*map(str, paths), os.environ.get("PYTHONPATH")]))}


#: The torch release the golden graphs are written on (the README's quick path).  A few graphs
#: print differently on other releases (node order, alias nodes torch's autograd adds): those
#: tests compare their golden on this release only, and their numeric checks on every release.
GOLDEN_TORCH = DEVELOPMENT


def on_golden_torch() -> bool:
    from predispatch import _torch_internals as ti

    return ti.TORCH == GOLDEN_TORCH


def stable_message(exc: BaseException) -> str:
    """An error's text with test files' paths and line numbers made stable (`test_x.py:N`)."""
    text = str(exc).replace(TESTS_DIR + os.sep, "")
    return re.sub(r"(test_\w+\.py):\d+", r"\1:N", text)


def assert_verified(ep: predispatch.ExportedProgram) -> None:
    """The program keeps the IR contract `load` checks (predispatch/serialize/verify.py)."""
    from predispatch.serialize.verify import custom_namespaces, program_problems

    problems = program_problems(ep, op_namespaces=custom_namespaces(ep.graph_module))
    assert not problems, "\n".join(map(str, problems))



class StraightThrough(torch.autograd.Function):
    """round() forward; the gradient passes straight through (autograd through round gives 0):
    the smallest Function whose captured backward shows in the gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad
