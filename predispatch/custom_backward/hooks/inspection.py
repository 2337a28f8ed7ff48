"""What a hook's code shows without running it: side effects, which arguments it reads,
whether it may reach module state; and how a hook is named in errors.

Capture decides from these whether a hook can be traced at all (`side_effect`) and what its
Function must carry (`may_read_argument`, `may_read_state`), before any hook runs: a traced
backward runs the hook's Python once, at export, so what it would do beyond returning
gradients has to be seen in its code: its source, never its bytecode (Note [Reading a hook's
code from its source]).
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import types
from collections.abc import Iterator
from typing import Any

from torch import nn

from predispatch.frontend.reachable import is_filled

# Note [Reading a hook's code from its source]
# ---------------------------------------------
# What a hook does beyond returning gradients is read from its source's syntax tree (`ast`), not
# from its bytecode: bytecode changes with every Python release (3.12 compiles `buf[:] = g` to
# STORE_SLICE where 3.11 had STORE_SUBSCR; 3.12 folds LOAD_METHOD into LOAD_ATTR), while the
# syntax tree of the statements this looks for is the same on every supported Python.  The
# hook's definition is found in its file's source (`linecache`: files, notebooks' cells) by the
# line its code starts at and its name; of several lambdas on one line, by the columns its code
# covers (`co_positions`, 3.11+), else all of them are read.  A hook whose source cannot be
# found (a builtin such as `print`, code made by `exec`) counts as having a side effect: export
# cannot see what it does.

_EFFECT_NAMES = {"print", "append", "extend", "insert", "add", "update", "setattr", "write", "log", "info"}
_NO_SOURCE = "its source cannot be read, so what it does cannot be checked"


def side_effect(fn: Any) -> str | None:
    """A Python side effect the function's source visibly has (a store or an effectful call),
    or None; see Note [Reading a hook's code from its source].

    A static look that catches prints, stores into containers, attributes, globals and closures
    and in-place calls on tensors the hook does not own; effects hidden inside other functions
    it calls are not seen.
    """
    function, _ = _function_of(fn)
    nodes = _definitions(function) if function is not None else []
    if not nodes:
        return _NO_SOURCE
    return next((effect for node in nodes for effect in _effects(node)), None)


def may_read_argument(hook: Any, index: int) -> bool:
    """Whether a hook may read its argument `index` (0: the module; 2: a full hook's grad_output).

    Read from the source (Note [Reading a hook's code from its source]); a hook whose source
    cannot be read, or that takes `*args`, is assumed to read it (reading grad_output costs
    carriers, see Note [Carrying grad_output] in full.py).
    """
    function, bound = _function_of(hook)
    nodes = _definitions(function) if function is not None else []
    index += 1 if bound else 0
    return not nodes or any(_reads_parameter(node, index) for node in nodes)


def _reads_parameter(node: _Definition, index: int) -> bool:
    positional = [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
    if index >= len(positional):
        return True
    name = positional[index]
    return any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(node))


_Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


def _function_of(hook: Any) -> tuple[types.FunctionType | None, bool]:
    """The Python function a hook runs, and whether it is bound (its first parameter is taken):
    a function, a bound method, a `functools.partial` of one, or a callable object's `__call__`."""
    if isinstance(hook, functools.partial):
        return _function_of(hook.func)[0], False
    if inspect.ismethod(hook):
        return _function_of(hook.__func__)[0], True
    if isinstance(hook, types.FunctionType):
        return hook, False
    call = getattr(type(hook), "__call__", None)
    if isinstance(call, types.FunctionType):
        return call, True
    return None, False


def _definitions(function: types.FunctionType) -> list[_Definition]:
    """The syntax tree of `function`'s definition: one node, several when lambdas on one line
    cannot be told apart (all are read), none when its source cannot be found."""
    code = function.__code__
    tree = _parsed(code.co_filename, "".join(linecache.getlines(code.co_filename, function.__globals__)))
    if tree is None:
        return []
    name = code.co_name
    candidates = [
        node
        for node in ast.walk(tree)
        if isinstance(node, _Definition)
        and (name == "<lambda>" if isinstance(node, ast.Lambda) else node.name == name)
        and code.co_firstlineno in (node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ())))
    ]
    if len(candidates) > 1:
        candidates = [node for node in candidates if _covers(node, code)] or candidates
    return candidates


def _covers(node: _Definition, code: types.CodeType) -> bool:
    """Whether the instructions of `code` lie in `node`'s source span (Python 3.11+; empty
    spans, such as the RESUME at column 0 every function starts with, say nothing)."""
    positions = getattr(code, "co_positions", None)
    if positions is None:
        return True
    start, end = (node.lineno, node.col_offset), (node.end_lineno or node.lineno, node.end_col_offset or 0)
    spans = [
        ((line, col), (end_line, end_col))
        for line, end_line, col, end_col in positions()
        if None not in (line, end_line, col, end_col) and (end_line, end_col) > (line, col)
    ]
    return bool(spans) and all(start <= first and last <= end for first, last in spans)


@functools.lru_cache(maxsize=32)
def _parsed(filename: str, source: str) -> ast.Module | None:
    if not source:
        return None
    try:
        return ast.parse(source, filename)
    except (SyntaxError, ValueError):
        return None


def _effects(node: _Definition) -> Iterator[str]:
    """Each side effect `node` visibly has: a store into something not its own, a call by an
    effectful name, an in-place call on a tensor it did not make."""
    declared = {name for n in ast.walk(node) if isinstance(n, (ast.Global, ast.Nonlocal)) for name in n.names}
    owned = _parameters(node) | {
        n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store) and n.id not in declared
    }
    for sub in ast.walk(node):
        for target in _targets(sub):
            if isinstance(target, (ast.Subscript, ast.Attribute)) or (isinstance(target, ast.Name) and target.id in declared):
                yield f"writes {ast.unparse(target)}"
        if isinstance(sub, ast.Call):
            func = sub.func
            called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            if called in _EFFECT_NAMES:
                yield f"calls {called}"
            elif isinstance(func, ast.Attribute) and _in_place(func.attr) and not _owned(func.value, owned):
                yield f"calls {ast.unparse(func)}"


def _parameters(node: _Definition) -> set[str]:
    args = node.args
    every = (*args.posonlyargs, *args.args, *args.kwonlyargs, *(a for a in (args.vararg, args.kwarg) if a is not None))
    return {a.arg for a in every}


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    """The expressions a statement stores into or deletes (tuples unpacked)."""
    if isinstance(node, ast.Assign):
        pending = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        pending = [node.target]
    elif isinstance(node, ast.Delete):
        pending = list(node.targets)
    elif isinstance(node, (ast.With, ast.AsyncWith)):
        pending = [item.optional_vars for item in node.items if item.optional_vars is not None]
    else:
        return
    while pending:
        target = pending.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            pending.extend(target.elts)
        elif isinstance(target, ast.Starred):
            pending.append(target.value)
        else:
            yield target


def _in_place(method: str) -> bool:
    """torch's naming of in-place methods: `copy_`, `add_`, `zero_` (not `__call__`, `_private`)."""
    return method.endswith("_") and not method.startswith("_")


def _owned(receiver: ast.expr, owned: set[str]) -> bool:
    """Whether `receiver` is a local name of the hook, or an element of one (`g[0]`)."""
    while isinstance(receiver, ast.Subscript):
        receiver = receiver.value
    return isinstance(receiver, ast.Name) and receiver.id in owned


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
