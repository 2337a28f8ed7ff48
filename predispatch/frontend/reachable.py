"""Which modules does a plain function reach?  Those in its globals, closure, or arguments.

`export(fn, args)` lifts the parameters and buffers of every module `fn` can reach as graph
inputs (never baking them in as constants).  They are found without running `fn`, by looking
at the names its code uses: a global or closure variable bound to an `nn.Module`, the module
of a bound method, and modules passed as arguments.  Each is named by the path a reader knows:
the variable's name, or the argument's name.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn


def modules_reached(fn: Callable[..., Any]) -> dict[str, nn.Module]:
    """`{name: module}` for modules `fn` refers to by a global, closure or `self` name."""
    found: dict[str, nn.Module] = {}
    seen: set[int] = set()
    for name, value in _named_references(fn):
        if isinstance(value, nn.Module) and id(value) not in seen:
            seen.add(id(value))
            found[name] = value
    return found


def _named_references(fn: Callable[..., Any]) -> Iterator[tuple[str, Any]]:
    if inspect.ismethod(fn):
        yield "self", fn.__self__
        fn = fn.__func__
    code = getattr(fn, "__code__", None)
    if code is None:
        return
    closure = getattr(fn, "__closure__", None) or ()
    for name, cell in zip(code.co_freevars, closure):
        try:
            yield name, cell.cell_contents
        except ValueError:  # an empty cell: the variable is not bound yet
            continue
    global_names = getattr(fn, "__globals__", {})
    for name in _global_names(code):
        if name in global_names:
            yield name, global_names[name]


def _global_names(code: types.CodeType) -> Iterator[str]:
    """Names the code (and code nested in it: lambdas, inner functions) may load as globals."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)
