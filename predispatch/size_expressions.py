"""Symbolic sizes as text: the grammar files hold them in, read without running code and at a
cost linear in the text (Note [The size grammar]).

A size in node meta or in the signature's input shapes is sympy's printing of torch's size
expression (`2*s31`, `s70**2`, `Max(s0, s1)`, `((s0 - 1)//2)`, `Mod(s0, 4)`; a SymBool of
unbacked symbols `u0 < 3`).  `parse` reads one into a small tree of tuples; load builds sympy
from the tree (serialize/shapes.py), and the call check evaluates the input shapes on it with
Python ints (runtime/runner.py), so neither hands file text to sympy.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from predispatch.errors import SerializationError

# Note [The size grammar]
# What export writes, as sympy prints torch's shape expressions, and nothing else:
#
#     expression := integer | symbol | expression ("+" | "-" | "*") expression | "-" expression
#                 | expression "**" exponent | expression ("//" | "%") divisor
#                 | ("Max" | "Min") "(" expression {"," expression} ")"
#                 | ("Mod" | "FloorDiv") "(" expression "," divisor ")" | "(" expression ")"
#     relation   := expression ("<" | "<=" | ">" | ">=") expression            (a SymBool only)
#                 | ("Eq" | "Ne") "(" expression "," expression ")"
#
# with an integer a literal in [0, 2**63), a divisor one in [1, 2**63), an exponent one in
# [1, MAX_EXPONENT], a symbol one the file declares (`s<index>` for an input's size, `u<index>`
# for an unbacked value).  Read with `ast` (no eval, no sympify), and bounded:
#
# - MAX_CHARS characters of text.  What export writes stays below 100 in the programs we know
#   (a CNN with dynamic height and width: `8*(2*(((s0 - 1)//32)) + 2)*(2*(((s53 - 1)//32)) + 2)`).
# - MAX_FILE_CHARS characters of distinct expression text in one file (16 KiB; that CNN has 31
#   distinct texts, 897 characters; a transformer with dynamic batch and sequence 11, 76): what
#   a file may make load build, whatever its size (a repeated text costs little: its parse is
#   cached, as are sympy's constructions and torch's evaluations of it).
# - MAX_DEPTH levels of nesting (parentheses, calls, unary minus, powers); a chain of `+ - *`
#   is one level whatever its length.  sympy prints a handful.
# - MAX_ARGUMENTS arguments of one Max/Min call.  torch's sym_max/sym_min are binary and sympy
#   flattens nested calls: a few.
# - MAX_EXPONENT: an exponent, and the product of the exponents of powers nested in one
#   another (`(s0**8)**8`), at most 64: `s**2` from a flatten of an (s, s) tensor, `s**4` of
#   four such dims; bounding the product keeps the integer a size evaluates to (a hint raised
#   to it) at most 64 times its bits.
#
# Cost: `parse` visits each syntax node once (`ast.parse` is linear, and the tree is walked
# without recursion along chains), so it does O(1) work per byte.  Load builds sympy from the
# tree with one constructor per tree node: `Add` and `Mul` once per chain with all its terms
# (sympy's flattening is then O(n log n), where building them pairwise would be quadratic),
# `Max`, `Min`, `FloorDiv` and `Mod` of torch's own classes (what its ShapeEnv makes) without
# automatic evaluation (sympy.Max compares its arguments pairwise: one Max of 150 symbols took
# 32 s to load).  What export writes is already in sympy's evaluated form, so building it
# unevaluated gives the very expression torch had; a file that is not is still a correct
# expression, printed as the file spells it.  What torch then does with a size (its fake
# tensors' checks evaluate it through sympy's assumptions) costs per syntax node too:
# tests/test_load_cost.py bounds the whole, load to `predispatch draw`, per byte of
# expression text (docs/format.md states the bound).


MAX_CHARS = 1000
MAX_FILE_CHARS = 16 << 10
MAX_DEPTH = 32
MAX_ARGUMENTS = 64
MAX_EXPONENT = 64
_MAX_LITERAL = (1 << 63) - 1

#: The names torch gives symbols: `s<index>` (a backed size: an input's dimension) and
#: `u<index>` (unbacked: a value known only when the program runs).  A file's symbols must be
#: such names: an arbitrary identifier (`N`, `oo`, `Max`) would read as sympy or as the grammar.
SIZE_SYMBOL = re.compile(r"s(0|[1-9][0-9]{0,8})\Z")
UNBACKED_SYMBOL = re.compile(r"u(0|[1-9][0-9]{0,8})\Z")

_FUNCTIONS = ("Max", "Min", "Mod", "FloorDiv")
_RELATIONS = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">="}
_SHOWN = 120  # characters of an expression an error message repeats


@dataclass(frozen=True)
class SizeExpression:
    """One size expression (or relation), parsed.

    text: as the file holds it.
    tree: an int, a symbol's name (str), or a tuple `(op, *operands)`: `("+", terms)` and
        `("*", factors)` with tuples of operands, `("neg", x)`, `("**", base, exponent)`,
        `("//", x, divisor)`, `("%", x, divisor)` (divisor and exponent ints),
        `("Max", arguments)` / `("Min", arguments)`, and at the top of a relation only
        `(op, left, right)` with op one of `< <= > >= Eq Ne`.
    names: the symbols it mentions.
    """

    text: str
    tree: Any
    names: frozenset[str]


class _Refused(Exception):
    """Why a text is not in the grammar (`parse` adds where, and caches the refusal)."""


def parse(text: Any, where: str, relation: bool = False) -> SizeExpression:
    """`text` as a SizeExpression (with `relation`, one comparison: a SymBool's), or
    SerializationError naming `where` and what of the grammar or its bounds it breaks."""
    if not isinstance(text, str):
        raise SerializationError(f"{where}: {text!r} is not a size expression.")
    parsed = _parse(text, relation)
    if isinstance(parsed, str):
        raise SerializationError(f"{where}: {shown(text)!r} {parsed}")
    return parsed


def shown(text: str) -> str:
    """`text` as an error message repeats it: its first characters, when it is long."""
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."


@functools.lru_cache(maxsize=4096)
def _parse(text: str, relation: bool) -> SizeExpression | str:
    """The parse of `text`, or why it is refused (cached: a program repeats its sizes)."""
    if len(text) > MAX_CHARS:
        return f"is not a size expression: it has {len(text)} characters, more than {MAX_CHARS} (size_expressions.MAX_CHARS)."
    try:
        root = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "is not a size expression."
    names: set[str] = set()
    try:
        tree = _relation(root, names) if relation else _expression(root, names, 0, 1)
    except _Refused as why:
        return str(why)
    return SizeExpression(text, tree, frozenset(names))


def _relation(node: ast.AST, names: set[str]) -> Any:
    """A comparison of two expressions, as sympy prints its relations: `a < b`, `<=`, `>`,
    `>=`, `Eq(a, b)`, `Ne(a, b)`."""
    called = _called(node)
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _RELATIONS:
        op, operands = _RELATIONS[type(node.ops[0])], (node.left, node.comparators[0])
    elif isinstance(node, ast.Call) and called in ("Eq", "Ne") and len(node.args) == 2:
        op, operands = called, (node.args[0], node.args[1])
    else:
        raise _Refused("is not a comparison of size expressions.")
    return (op, *(_expression(o, names, 1, 1) for o in operands))


def _called(node: ast.AST) -> str | None:
    """The function a plain call calls (`Max(a, b)`): no keywords, no `*args`."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords
            and not any(isinstance(a, ast.Starred) for a in node.args)):
        return node.func.id
    return None


def _expression(node: ast.AST, names: set[str], depth: int, power: int) -> Any:
    """One expression's tree; `depth` its nesting so far, `power` the product of the exponents
    of the powers it is inside."""
    if depth > MAX_DEPTH:
        raise _Refused(f"is not a size expression: it nests deeper than {MAX_DEPTH} levels (size_expressions.MAX_DEPTH).")
    if isinstance(node, ast.Constant) and type(node.value) is int and 0 <= node.value <= _MAX_LITERAL:
        return node.value
    if isinstance(node, ast.Name):
        names.add(node.id)
        return node.id
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return ("neg", _expression(node.operand, names, depth + 1, power))
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        return _chain(node, names, depth, power)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.FloorDiv, ast.Mod)):
        op = "//" if isinstance(node.op, ast.FloorDiv) else "%"
        return (op, _expression(node.left, names, depth + 1, power), _divisor(node.right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        exponent = _literal(node.right, 1, MAX_EXPONENT)
        if exponent is None or power * exponent > MAX_EXPONENT:
            raise _Refused(f"is not a size expression: it raises to a power other than an integer literal in [1, {MAX_EXPONENT}]; "
                           "nested powers multiply (size_expressions.MAX_EXPONENT).")
        return ("**", _expression(node.left, names, depth + 1, power * exponent), exponent)
    return _call(node, names, depth, power)


def _call(node: ast.AST, names: set[str], depth: int, power: int) -> Any:
    """`Max`/`Min` of 1 to MAX_ARGUMENTS expressions, `Mod`/`FloorDiv` of an expression and a divisor."""
    function = _called(node)
    if function is not None and function not in _FUNCTIONS:
        raise _Refused(f"is not a size expression: it calls {function}, which the size grammar does not have "
                       f"(it has {', '.join(_FUNCTIONS)}).")
    if function is None:
        raise _Refused("is not a size expression over the program's symbols.")
    args = node.args  # type: ignore[attr-defined]
    if function in ("Max", "Min"):
        if not 1 <= len(args) <= MAX_ARGUMENTS:
            raise _Refused(f"is not a size expression: it calls {function} with {len(args)} arguments; a size expression's Max and Min "
                           f"take 1 to {MAX_ARGUMENTS} (size_expressions.MAX_ARGUMENTS).")
        return (function, tuple(_expression(a, names, depth + 1, power) for a in args))
    if len(args) != 2:
        raise _Refused("divides by something other than a positive integer; a size expression may not.")
    return ("//" if function == "FloorDiv" else "%", _expression(args[0], names, depth + 1, power), _divisor(args[1]))


def _chain(node: ast.BinOp, names: set[str], depth: int, power: int) -> Any:
    """A run of `+ -` (or of `*`) as one n-ary node, read along its left spine without
    recursion, so a long sum costs one level of depth and O(1) per term."""
    additive = isinstance(node.op, (ast.Add, ast.Sub))
    ops = (ast.Add, ast.Sub) if additive else (ast.Mult,)
    operands: list[Any] = []
    current: ast.AST = node
    while isinstance(current, ast.BinOp) and isinstance(current.op, ops):
        right = _expression(current.right, names, depth + 1, power)
        operands.append(("neg", right) if isinstance(current.op, ast.Sub) else right)
        current = current.left
    operands.append(_expression(current, names, depth + 1, power))
    return ("+" if additive else "*", tuple(reversed(operands)))


def _divisor(node: ast.AST) -> int:
    """`//`, `%`, `FloorDiv` and `Mod` divide by a positive integer literal, as torch's shape
    arithmetic does (a kernel's stride, a chunk count): a zero or symbolic divisor would make
    a size undefined at some call."""
    divisor = _literal(node, 1, _MAX_LITERAL)
    if divisor is None:
        raise _Refused("divides by something other than a positive integer; a size expression may not.")
    return divisor


def _literal(node: ast.AST, low: int, high: int) -> int | None:
    """An integer literal in [low, high], or None."""
    if isinstance(node, ast.Constant) and type(node.value) is int and low <= node.value <= high:
        return node.value
    return None


def evaluate(expression: SizeExpression, values: Mapping[str, int]) -> int:
    """The expression's value with each symbol given its value in `values` (Python ints:
    `//` floors, `%` of a positive divisor is non-negative, as torch's FloorDiv and Mod)."""
    return _value(expression.tree, values)


#: A relation's operator, as a function of its two sides' values.
_COMPARE: dict[str, Callable[[int, int], bool]] = {
    "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
    "Eq": lambda a, b: a == b, "Ne": lambda a, b: a != b,
}


def holds(relation: SizeExpression, values: Mapping[str, int]) -> bool:
    """Whether a relation (`parse(..., relation=True)`) is true with each symbol given its value."""
    op, left, right = relation.tree
    return _COMPARE[op](_value(left, values), _value(right, values))


def _value(tree: Any, values: Mapping[str, int]) -> int:
    if isinstance(tree, int):
        return tree
    if isinstance(tree, str):
        return values[tree]
    op, *operands = tree
    if op in ("+", "*", "Max", "Min"):
        items = [_value(t, values) for t in operands[0]]
        return _REDUCE[op](items)
    if op == "neg":
        return -_value(operands[0], values)
    first = _value(operands[0], values)
    return _BINARY[op](first, operands[1])


def _product(items: list[int]) -> int:
    result = 1
    for item in items:
        result *= item
    return result


_REDUCE: dict[str, Callable[[list[int]], int]] = {"+": sum, "*": _product, "Max": max, "Min": min}
_BINARY: dict[str, Callable[[int, int], int]] = {
    "**": lambda a, b: a**b, "//": lambda a, b: a // b, "%": lambda a, b: a % b,
}
