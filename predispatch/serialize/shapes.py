"""Dynamic shapes in a file: symbolic sizes in node meta, and the symbols they are made of.

A symbolic size is saved as its expression's text and its value at export:

    "shape": [{"sym": "s31", "hint": 3}, 4]       "val": {"symint": {"sym": "2*s31", "hint": 6}}

The symbols, their ranges and the guards live in the signature's `ShapeRecord`, which load
reads first: each symbol is declared in the load's ShapeEnv under its saved name and range
(`SymbolTable`), and each size is rebuilt as a SymInt over those symbols.  So the loaded
program prints the same shapes, checks calls against the same ranges, and `to_torch()` gives
torch the same `range_constraints`.

Expression text is never given to `eval` or `sympify` (both run Python): `parse_expression`
reads it by the size grammar (Note [The size grammar] in size_expressions.py: integers, the
declared symbols, `+ - * // % **`, `Max`/`Min`/`Mod`/`FloorDiv` calls and, for a SymBool, one
comparison of two such expressions, with bounds on length, depth, arguments and exponents),
and `build` makes sympy of the parse at a cost linear in the text.  A symbol is named as torch
names them (`s31`, `u0`), so no name reads as sympy's (`N`, `oo`) or the grammar's (`Max`).
The record's input shapes, which the call check evaluates, are checked the same way.

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

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from predispatch import _torch_internals as ti
from predispatch import size_expressions as sizes
from predispatch.errors import SerializationError
from predispatch.signature import ShapeRecord


def encode_size(size: int | torch.SymInt, where: str) -> Any:
    """An int as itself; a SymInt as its expression and its value at export."""
    if type(size) is int:
        return size
    if isinstance(size, torch.SymInt) and size.node.hint is None:
        raise SerializationError(
            f"{where}: the size {size.node.expr} depends on data (an unbacked size, from .item(), "
            "nonzero() or a data-dependent op); the file format holds symbolic sizes of inputs only. "
            "Keep using the program in memory, or make the size static."
        )
    if isinstance(size, torch.SymInt):
        return {"sym": _grammar_text(size, where), "hint": int(size.node.hint)}
    raise SerializationError(f"{where}: a size {size!r} is neither an int nor a SymInt.")


def _grammar_text(value: torch.SymInt | torch.SymBool, where: str) -> str:
    """The text of `value`'s expression, which load reads back: save refuses one outside the
    size grammar (a function of torch's the grammar does not have, a bound it breaks) by name,
    rather than write a file load would refuse."""
    text = str(value.node.expr)
    known = {str(s) for s in value.node.expr.free_symbols}
    try:
        parse_expression(text, known, where, relation=isinstance(value, torch.SymBool))
    except SerializationError as exc:
        raise SerializationError(
            f"{exc.what} Format version 1 holds sizes in the size grammar load reads (docs/format.md).",
            fix="make the size static (dynamic_shapes), or keep using the program in memory.",
        ) from exc
    return text


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
                f"{where}: a SymBool ({value}) has no encoding in the file format, which holds symbolic bools only "
                "as comparisons of unbacked symbols (a while_loop's condition on an int carry)."
            )
        return encode_size(value, where)
    return {"sym": _grammar_text(value, where), "hint": None}


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
            if not sizes.SIZE_SYMBOL.match(name) or name in self.symbols or (high is not None and high < low) or low < 0:
                raise SerializationError(
                    f"{where}: symbol {name!r} with range [{low}, {high}] is not a size symbol "
                    "(a new name s<index>, as torch names them, with 0 <= low <= high)."
                )
            self.symbols[name] = None  # declared at the first size that names it (its hint is there)
        self._low_high = {name: (low, high) for name, low, high in shapes.ranges}
        self._texts: set[str] = set()  # the distinct size texts read so far, and their characters
        self._chars = 0
        _check_input_shapes(shapes, lambda text: self._read(text, self._low_high, where), where)
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
            match = sizes.UNBACKED_SYMBOL.match(entry[0]) if ok else None
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
        expression = self._read(data["sym"], known, where, relation=relation)
        if not any(name in self.unbacked for name in expression.names):
            raise SerializationError(f"{where}: {data!r} has no value at export but no unbacked symbol.")
        expr = build(expression, self._declare(data, self.unbacked))
        return ti.symbolic_bool(self.fake_mode, expr) if relation else ti.size_symint(self.fake_mode, expr, None)

    def size(self, data: Any, where: str) -> int | torch.SymInt:
        """A size saved by `encode_size`, as an int or a SymInt in the load's fake mode."""
        if type(data) is int and data >= 0:
            return data
        if isinstance(data, dict) and set(data) == {"sym", "hint"} and data["hint"] is None:
            raise SerializationError(
                f"{where}: {data!r} is a size without a value at export (an unbacked symbol); "
                "the file format holds symbolic sizes of inputs only."
            )
        if not isinstance(data, dict) or set(data) != {"sym", "hint"} or type(data["hint"]) is not int:
            raise SerializationError(f"{where}: {data!r} is not a size.")
        expr = build(self._read(data["sym"], self._low_high, where), self._declare(data))
        return ti.size_symint(self.fake_mode, expr, data["hint"])

    def _read(self, text: Any, known: Any, where: str, relation: bool = False) -> sizes.SizeExpression:
        """`text` parsed over the `known` symbols, its characters counted against the file's
        budget of distinct size text (MAX_FILE_CHARS) before anything is built of it: building a
        new text is what costs (Note [The size grammar]); a repeated one costs little."""
        expression = parse_expression(text, known, where, relation=relation)
        if text not in self._texts:
            self._texts.add(text)
            self._chars += len(text)
            if self._chars > sizes.MAX_FILE_CHARS:
                raise SerializationError(
                    f"{where}: the program's distinct size expressions have more than {sizes.MAX_FILE_CHARS} "
                    "characters in all (size_expressions.MAX_FILE_CHARS); programs export makes have a few hundred."
                )
        return expression

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


def _check_input_shapes(shapes: ShapeRecord, read: Callable[[str], sizes.SizeExpression], where: str) -> None:
    """The input shapes the call check evaluates at every call (runner._check_symbols, on
    the grammar's tree) can be evaluated: each a declared symbol, or an expression in the
    grammar over symbols some input dimension binds.  Otherwise every call would fail."""
    bound = {dim for dims in shapes.input_shapes for dim in dims if isinstance(dim, str) and dim.isidentifier()}
    for dims in shapes.input_shapes:
        for dim in (d for d in dims if isinstance(d, str)):
            unbound = sorted(read(dim).names - bound)
            if unbound:
                raise SerializationError(
                    f"{where}: the input size {dim!r} uses {unbound}, which no input dimension gives a value; "
                    "a call could not be checked against it."
                )


def parse_expression(text: Any, known: Any, where: str, relation: bool = False) -> sizes.SizeExpression:
    """`text` read by the size grammar (Note [The size grammar]) over the `known` symbol names
    only; with `relation`, one comparison of two expressions (`u0 < 3`: a SymBool)."""
    expression = sizes.parse(text, where, relation)
    if not all(name in known for name in expression.names):
        raise SerializationError(f"{where}: {sizes.shown(text)!r} is not a size expression over the program's symbols.")
    return expression


def build(expression: sizes.SizeExpression, symbol: Callable[[str], Any]) -> Any:
    """`expression` as sympy over the symbols `symbol` gives for their names, one constructor
    per tree node (Note [The size grammar]): Add and Mul evaluated, once per chain, so the
    expression is in sympy's canonical form; the others as the file spells them."""
    return _sympy(expression.tree, symbol, ti.size_functions())


def _sympy(tree: Any, symbol: Callable[[str], Any], functions: dict[str, Any]) -> Any:
    import sympy

    if isinstance(tree, int):
        return sympy.Integer(tree)
    if isinstance(tree, str):
        return symbol(tree)
    op, *operands = tree
    if op in ("+", "*"):
        return (sympy.Add if op == "+" else sympy.Mul)(*(_sympy(t, symbol, functions) for t in operands[0]))
    if op in ("Max", "Min"):
        return _lattice(op, [_sympy(t, symbol, functions) for t in operands[0]], functions[op])
    if op == "neg":
        return -_sympy(operands[0], symbol, functions)
    first = _sympy(operands[0], symbol, functions)
    if op == "**":
        return sympy.Pow(first, sympy.Integer(operands[1]))
    if op in ("//", "%") and isinstance(first, sympy.Integer):
        return sympy.Integer(int(first) // operands[1] if op == "//" else int(first) % operands[1])
    if op in ("//", "%"):
        return functions["FloorDiv" if op == "//" else "Mod"](first, sympy.Integer(operands[1]), evaluate=False)
    relation = getattr(sympy, _RELATIONS[op])
    return relation(first, _sympy(operands[1], symbol, functions), evaluate=False)


def _lattice(op: str, args: list[Any], function: Any) -> Any:
    """`Max`/`Min` of `args` unevaluated, its integer arguments folded into one as torch's
    own construction folds them (linear): sympy's evaluation compares arguments pairwise."""
    import sympy

    numbers = [int(a) for a in args if isinstance(a, sympy.Integer)]
    rest = [a for a in args if not isinstance(a, sympy.Integer)]
    if numbers:
        rest.append(sympy.Integer(max(numbers) if op == "Max" else min(numbers)))
    return function(*rest, evaluate=False)


#: sympy's class of each relation the grammar reads.
_RELATIONS = {"<": "Lt", "<=": "Le", ">": "Gt", ">=": "Ge", "Eq": "Eq", "Ne": "Ne"}
