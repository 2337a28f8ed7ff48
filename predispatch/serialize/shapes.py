"""Dynamic shapes in a file: symbolic sizes in node meta, and the symbols they are made of.

A symbolic size is saved as its expression's text and its value at export:

    "shape": [{"sym": "s31", "hint": 3}, 4]       "val": {"symint": {"sym": "2*s31", "hint": 6}}

The symbols, their ranges and the guards live in the signature's `ShapeRecord`, which load
reads first: each symbol is declared in the load's ShapeEnv under its saved name and range
(`SymbolTable`), and each size is rebuilt as a SymInt over those symbols.  So the loaded
program prints the same shapes, checks calls against the same ranges, and `to_torch()` gives
torch the same `range_constraints`.

Expression text is never given to `eval` or `sympify` (both run Python): `parse_expression`
reads it with `ast` and accepts only integers, the declared symbols, `+ - * // %`, and
`Max`/`Min`/`Mod` calls (and, for a SymBool, one comparison of two such expressions).  The
record's input shapes, which the call check evaluates, are checked the same way.

Unbacked symbols (torch's `u0`: a value known only when the program runs) appear in node meta
values only where torch's while_loop carries a Python int (`Sym(u0)`, `Sym(u0 + 1)`,
`Sym(u0 < 3)`, the loop's result `Sym(u1)`), and a program may ask for an offset that depends
on one (Note [Data-dependent storage offsets]).  Such a value is saved with hint None, and the
file declares each symbol once, with its range (`"unbacked_symbols": [["u0", null, null]]` in
program.json, only in files that have one); load declares them in its ShapeEnv before reading
the graph and refuses a value over an undeclared symbol, a declaration torch would not make, a
hint None without an unbacked symbol, and an unbacked symbol in a tensor's size.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import torch
import torch.utils._pytree as pytree

from predispatch import _torch_internals as ti
from predispatch.errors import SerializationError
from predispatch.signature import ShapeRecord

#: torch's name of an unbacked symbol (`create_unbacked_symint`): `u` and its index.
_UNBACKED_NAME = re.compile(r"u(0|[1-9][0-9]{0,8})\Z")


def encode_size(size: int | torch.SymInt, where: str) -> Any:
    """An int as itself; a SymInt as its expression and its value at export."""
    if type(size) is int:
        return size
    if isinstance(size, torch.SymInt) and size.node.hint is None:
        raise SerializationError(
            f"{where}: the size {size.node.expr} depends on data (an unbacked size, from .item(), "
            "nonzero() or a data-dependent op); format version 1 holds symbolic sizes of inputs only. "
            "Keep using the program in memory, or make the size static."
        )
    if isinstance(size, torch.SymInt):
        return {"sym": str(size.node.expr), "hint": int(size.node.hint)}
    raise SerializationError(f"{where}: a size {size!r} is neither an int nor a SymInt.")


# Note [Data-dependent storage offsets]
# torch's `while_loop` under autograd (WhileLoopAutogradOp.forward) runs the stacking variant
# of the loop and returns the last row of each stacked carry, `stacked[-1]`: in the trace the
# row count is a fresh unbacked symbol u0 (the trip count, discarded from the pending symbols:
# no node binds it), so the loop's outputs, and every view of them, have the storage offset
# `(u0 - 1) * numel`.  Nothing in a program reads it: the graph runs real tensors, whose offset
# is whatever the kernel made (without grad the same loop returns the body's output, offset 0),
# `ep.module()` reads only the placeholders' meta, and a graph that asks for the offset
# (`y.storage_offset()`) holds a `sym_storage_offset` node, which reads the running tensor's
# (its own value, the SymInt `32*u0 - 32`, is saved by `encode_symbolic`).  So such an offset
# is saved as 0, the offset torch.export.load gives every tensor meta (its
# `deserialize_tensor_meta` rebuilds them with `empty_strided`).  Sizes and strides stay
# exact: an unbacked one is refused by `encode_size`.


def encode_symbolic(value: torch.SymInt | torch.SymBool, where: str) -> Any:
    """A SymInt or SymBool node meta value (not a size): a backed SymInt as `encode_size` writes
    it; one made of unbacked symbols (a while_loop's int carry `u0`, `u0 + 1`, `u0 < 3`) as its
    expression with hint None, its symbols declared in the file (`unbacked_declarations`)."""
    unbacked = ti.unbacked_symbols(value)
    if not unbacked:
        if isinstance(value, torch.SymBool):
            raise SerializationError(
                f"{where}: a SymBool ({value}) has no encoding in format version 1, which holds symbolic bools only "
                "as comparisons of unbacked symbols (a while_loop's condition on an int carry)."
            )
        return encode_size(value, where)
    text = str(value.node.expr)
    known = {str(s) for s in value.node.expr.free_symbols}
    try:
        parse_expression(text, known, where, relation=isinstance(value, torch.SymBool))
    except SerializationError as exc:
        raise SerializationError(f"{where}: {text!r} is outside the size grammar format version 1 reads.") from exc
    return {"sym": text, "hint": None}


def unbacked_declarations(gm: torch.fx.GraphModule) -> list[list[Any]]:
    """`[name, low, high]` of every unbacked symbol the node meta values of `gm` and its
    subgraphs mention (None: unbounded), by index: what load declares before reading them."""
    found: dict[str, tuple[int | None, int | None]] = {}
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            for leaf in pytree.tree_leaves(node.meta.get("val")):
                if isinstance(leaf, (torch.SymInt, torch.SymBool)):
                    found.update(ti.unbacked_symbols(leaf))
    return [[name, *found[name]] for name in sorted(found, key=lambda n: int(n[1:]))]


def encode_storage_offset(offset: int | torch.SymInt, where: str) -> Any:
    """A tensor meta's storage offset: exact, or 0 where it depends on data (Note [Data-dependent
    storage offsets]): the program cannot depend on it, and the file cannot hold its symbol."""
    if isinstance(offset, torch.SymInt) and offset.node.hint is None:
        return 0
    return encode_size(offset, where)


class SymbolTable:
    """The symbols of a loaded program, declared in the load's fake mode (see the module docstring)."""

    def __init__(self, fake_mode: Any, shapes: ShapeRecord, where: str, unbacked: Any = None):
        self.fake_mode = fake_mode
        self.symbols: dict[str, Any] = {}
        for name, low, high in shapes.ranges:
            if not name.isidentifier() or (high is not None and high < low) or low < 0:
                raise SerializationError(f"{where}: symbol {name!r} with range [{low}, {high}] is not a size symbol.")
            self.symbols[name] = None  # declared at the first size that names it (its hint is there)
        self._low_high = {name: (low, high) for name, low, high in shapes.ranges}
        self._hints: dict[str, int] = {}
        _check_input_shapes(shapes, self._low_high, where)
        self.unbacked = self._declare_unbacked([] if unbacked is None else unbacked, "unbacked_symbols")

    def _declare_unbacked(self, entries: Any, where: str) -> dict[str, Any]:
        """The file's unbacked symbols (`[name, low, high]`, a bound None where unbounded),
        declared in the load's ShapeEnv: each named as torch names them (`u0`), once, no name of
        an input's symbol, with a range; only a node meta value may use them (`value`)."""
        if not isinstance(entries, list):
            raise SerializationError(f"{where}: {entries!r} is not a list of [name, low, high].")
        declared: dict[str, Any] = {}
        for entry in entries:
            ok = isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
            ok = ok and all(b is None or type(b) is int for b in entry[1:])
            match = _UNBACKED_NAME.match(entry[0]) if ok else None
            if not match or entry[0] in declared or entry[0] in self._low_high or (
                    None not in entry[1:] and entry[1] > entry[2]):
                raise SerializationError(f"{where}: {entry!r} is not the declaration of an unbacked symbol "
                                         "(a new name u<index>, a range [low, high], null where unbounded).")
            declared[entry[0]] = ti.declare_unbacked_symbol(self.fake_mode, entry[0], int(match.group(1)), entry[1], entry[2])
        return declared

    def value(self, data: Any, where: str, relation: bool = False) -> int | torch.SymInt | torch.SymBool:
        """A SymInt (or, with `relation`, SymBool) node meta value saved by `encode_symbolic`:
        over input symbols with its hint, as `size`; over declared unbacked symbols, hint None."""
        if not (isinstance(data, dict) and set(data) == {"sym", "hint"} and data["hint"] is None):
            if relation:
                raise SerializationError(f"{where}: {data!r} is not a symbolic bool of unbacked symbols.")
            return self.size(data, where)
        known = {**self._low_high, **self.unbacked}
        tree = parse_expression(data["sym"], known, where, relation=relation)
        if not any(isinstance(n, ast.Name) and n.id in self.unbacked for n in ast.walk(tree)):
            raise SerializationError(f"{where}: {data!r} has no value at export but no unbacked symbol.")
        expr = parse_expression(data["sym"], known, where, self._declare(data, self.unbacked), relation=relation)
        return ti.symbolic_bool(self.fake_mode, expr) if relation else ti.size_symint(self.fake_mode, expr, None)

    def size(self, data: Any, where: str) -> int | torch.SymInt:
        """A size saved by `encode_size`, as an int or a SymInt in the load's fake mode."""
        if type(data) is int and data >= 0:
            return data
        if isinstance(data, dict) and set(data) == {"sym", "hint"} and data["hint"] is None:
            raise SerializationError(
                f"{where}: {data!r} is a size without a value at export (an unbacked symbol); "
                "format version 1 holds symbolic sizes of inputs only."
            )
        if not isinstance(data, dict) or set(data) != {"sym", "hint"} or type(data["hint"]) is not int:
            raise SerializationError(f"{where}: {data!r} is not a size.")
        expr = parse_expression(data["sym"], self._low_high, where, self._declare(data))
        return ti.size_symint(self.fake_mode, expr, data["hint"])

    def _declare(self, data: dict, unbacked: Any = None) -> Any:
        """A function from a symbol's name to the symbol, declaring an input's at first use."""

        def symbol(name: str) -> Any:
            if unbacked and name in unbacked:
                return unbacked[name]
            if self.symbols.get(name) is None:
                low, high = self._low_high[name]
                hint = data["hint"] if data["sym"] == name else max(low, 2)
                self.symbols[name] = ti.declare_size_symbol(self.fake_mode, name, low, high, hint)
            return self.symbols[name]

        return symbol


def _check_input_shapes(shapes: ShapeRecord, known: Any, where: str) -> None:
    """The input shapes the call check evaluates at every call (runner._check_symbols, with
    sympy) can be evaluated: each a declared symbol, or an expression in the grammar, without
    `FloorDiv(...)` (sympy does not know it; torch writes `//`), over symbols some input
    dimension binds by itself.  Otherwise every call would raise a raw sympy error."""
    bound = {dim for dims in shapes.input_shapes for dim in dims if isinstance(dim, str) and dim.isidentifier()}
    for dims in shapes.input_shapes:
        for dim in (d for d in dims if isinstance(d, str)):
            if dim.isidentifier():
                parse_expression(dim, known, where)
                continue
            tree = parse_expression(dim, known, where, calls=("Max", "Min", "Mod"))
            unbound = sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - bound - {"Max", "Min", "Mod"})
            if unbound:
                raise SerializationError(
                    f"{where}: the input size {dim!r} uses {unbound}, which no input dimension gives a value; "
                    "a call could not be checked against it."
                )


def parse_expression(
    text: Any, known: Any, where: str, symbol: Any = None, calls: tuple[str, ...] | None = None, relation: bool = False
) -> Any:
    """`text` as a sympy expression over the `known` symbol names, read without running code.

    With `symbol` None only the check runs (returns the syntax tree).  `calls`: the function
    names allowed (all of the grammar's by default).  With `relation`, `text` is one comparison
    of two expressions (`u0 < 3`, `Eq(u0, 3)`: a SymBool)."""
    if not isinstance(text, str) or len(text) > 1000:
        raise SerializationError(f"{where}: {text!r} is not a size expression.")
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise SerializationError(f"{where}: {text!r} is not a size expression.") from exc
    built = _relation(tree, known, where, text, symbol) if relation else _build(tree, known, where, text, symbol, calls)
    return tree if symbol is None else built


_COMPARISONS = {ast.Lt: "Lt", ast.LtE: "Le", ast.Gt: "Gt", ast.GtE: "Ge"}


def _relation(node: ast.AST, known: Any, where: str, text: str, symbol: Any) -> Any:
    """A comparison of two grammar expressions as sympy (None when only checking): `a < b`,
    `<=`, `>`, `>=`, or `Eq(a, b)` / `Ne(a, b)`, as sympy prints its relations."""
    import sympy

    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARISONS:
        name, operands = _COMPARISONS[type(node.ops[0])], (node.left, node.comparators[0])
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Eq", "Ne")
          and len(node.args) == 2 and not node.keywords):
        name, operands = node.func.id, (node.args[0], node.args[1])
    else:
        raise SerializationError(f"{where}: {text!r} is not a comparison of size expressions.")
    left, right = (_build(o, known, where, text, symbol) for o in operands)
    return None if symbol is None else getattr(sympy, name)(left, right)


_DIVISIONS = (ast.FloorDiv, ast.Mod)


def _divisor_ok(node: ast.AST) -> bool:
    """`//`, `%`, `FloorDiv` and `Mod` divide by a positive integer literal, as torch's shape
    arithmetic does (a kernel's stride, a chunk count): a zero or symbolic divisor would make a
    size undefined at some call."""
    return isinstance(node, ast.Constant) and type(node.value) is int and node.value > 0


def _build(node: ast.AST, known: Any, where: str, text: str, symbol: Any, calls: tuple[str, ...] | None = None) -> Any:
    """One `ast` node as sympy (None when only checking); anything not in the grammar is refused."""
    import sympy
    from torch.utils._sympy.functions import FloorDiv, Mod

    def build(child: ast.AST) -> Any:
        return _build(child, known, where, text, symbol, calls)

    divides = (isinstance(node, ast.BinOp) and isinstance(node.op, _DIVISIONS) and not _divisor_ok(node.right)) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Mod", "FloorDiv")
        and (len(node.args) != 2 or not _divisor_ok(node.args[1])))
    divides = divides or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Max", "Min") and not node.args)
    if divides:
        raise SerializationError(
            f"{where}: {text!r} divides by something other than a positive integer (or calls Max/Min with no argument); "
            "a size expression may not."
        )
    if calls is not None and isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id not in calls:
        raise SerializationError(f"{where}: {text!r} calls {node.func.id}, which an input size may not (allowed: {', '.join(calls)}).")

    check_only = symbol is None
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return None if check_only else sympy.Integer(node.value)
    if isinstance(node, ast.Name) and node.id in known:
        return None if check_only else symbol(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        operand = build(node.operand)
        return None if check_only else -operand
    binary = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.FloorDiv: FloorDiv, ast.Mod: Mod}
    if isinstance(node, ast.BinOp) and type(node.op) in binary:
        left, right = build(node.left), build(node.right)
        return None if check_only else binary[type(node.op)](left, right)
    functions = {"Max": sympy.Max, "Min": sympy.Min, "Mod": Mod, "FloorDiv": FloorDiv}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in functions and not node.keywords:
        args = [build(a) for a in node.args]
        return None if check_only else functions[node.func.id](*args)
    raise SerializationError(f"{where}: {text!r} is not a size expression over the program's symbols.")
