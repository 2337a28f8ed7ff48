"""What a hook's code shows without running it: side effects, which arguments it reads,
whether it may reach module state; and how a hook is named in errors.

Capture decides from these whether a hook can be traced at all (`side_effect`) and what its
Function must carry (`may_read_argument`, `may_read_state`), before any hook runs: a traced
backward runs the hook's Python once, at export, so what it would do beyond returning
gradients has to be seen in its code.
"""

from __future__ import annotations

import dis
import inspect
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from predispatch.frontend.reachable import is_filled

_STORES = {"STORE_GLOBAL", "STORE_ATTR", "STORE_DEREF", "STORE_SUBSCR", "DELETE_SUBSCR", "DELETE_ATTR"}
_EFFECT_NAMES = {"print", "append", "extend", "insert", "add", "update", "setattr", "write", "log", "info"}


def side_effect(fn: Any) -> str | None:
    """A Python side effect the function's code visibly has (a store or an effectful call), or None.

    Read from the bytecode, not run: a static look that catches prints and stores into
    containers, attributes, globals and closures; effects hidden inside other functions it calls
    are not seen.
    """
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    for instr in dis.get_instructions(code) if code is not None else ():
        if instr.opname in _STORES:
            return f"{instr.opname.lower()} {instr.argval}"
        if instr.opname in ("LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_NAME") and instr.argval in _EFFECT_NAMES:
            return f"calls {instr.argval}"
    return None


def may_read_argument(hook: Any, index: int) -> bool:
    """Whether a hook may read its argument `index` (0: the module; 2: a full hook's grad_output).

    Read from the bytecode; a hook whose code cannot be read, or that takes `*args`, is assumed
    to read it (reading grad_output costs carriers, see Note [Carrying grad_output] in full.py).
    """
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    index += 1 if inspect.ismethod(hook) else 0
    if code is None or code.co_argcount <= index:
        return True
    name = code.co_varnames[index]
    for instr in dis.get_instructions(code):
        loaded = instr.argval if isinstance(instr.argval, tuple) else (instr.argval,)
        if instr.opname.startswith("LOAD") and name in loaded:
            return True
    return False


def may_read_state(hook: Any) -> bool:
    """Whether a hook may read the state of the module it is on: it uses its module argument,
    is a bound method (`self` may be the module), or reaches an `nn.Module` through a closure or
    a global.  A cheap look at the code; see Note [Hooks reading module state] in state.py."""
    if inspect.ismethod(hook) or may_read_argument(hook, 0):
        return True
    cells = [cell.cell_contents for cell in hook.__closure__ or () if is_filled(cell)]
    names = [name for code in _code_objects(hook.__code__) for name in code.co_names]
    return any(isinstance(value, nn.Module) for value in (*cells, *map(hook.__globals__.get, names)))


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    """`code` and the code of the functions, lambdas and comprehensions defined in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def describe(hooks: list[Any]) -> str:
    """`name defined at file:line` of each hook, for errors."""
    return ", ".join(map(_describe_one, hooks))


def _describe_one(hook: Any) -> str:
    fn = getattr(hook, "__func__", hook)
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        return f"{name} defined at {inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return name
