"""The example-input language of the command line: shapes and dtypes, parsed at the edge.

    --inputs "f32[2,5,16], i64[2,5]"          two positional tensors
    --inputs "f32[2,5,16], mask=b8[5,5]"      a positional tensor and a keyword tensor
    --inputs "f32[8], 3, None, True, 'sum'"   constants: ints, floats, None, True/False, strings
    --inputs "(f32[2], f32[3]), {ids: i64[4]}" a tuple and a dict argument ([...] is a list;
                                              (...) is a tuple even with one element)
    --kwargs "mask=b8[5,5], scale=0.5"        keyword inputs only
    --inputs "f32[batch=4,16], i64[batch=4]"  a dynamic dimension, `batch`, example size 4,
                                              the same symbol in both inputs

A tensor is `DTYPE[d0,d1,...]` (`f32[]` is a 0-dim tensor).  DTYPE is a short name as FX
prints it (`f32`, `bf16`, `i64`, `b8`) or a torch name (`float32`, `long`, `bool`).  The
values do not matter to export, which traces shapes and dtypes only: floating tensors are
filled with a seeded normal sample, integer tensors with zeros, bool tensors with True.

A named dimension (`batch=4`) is dynamic: the program works for other sizes of it.  Its range
is torch.export's default unless given (`--dim batch=1..64`, parsed by `parse_dim_range`).

`parse_inputs(text)` returns data (`ParsedInputs` with `TensorSpec` leaves); `make_example(tree)`
turns it into tensors.  Errors raise `SpecError`, which points at the column and, for a dtype,
lists the allowed ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

#: Short dtype names (as FX prints shapes: `f32[2, 3]`) -> dtype, in the order errors list them.
SHORT_DTYPES: dict[str, torch.dtype] = {
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f32": torch.float32,
    "f64": torch.float64,
    "c64": torch.complex64,
    "c128": torch.complex128,
    "i8": torch.int8,
    "i16": torch.int16,
    "i32": torch.int32,
    "i64": torch.int64,
    "u8": torch.uint8,
    "b8": torch.bool,
}
_ALIASES = {"bool": torch.bool, "float": torch.float32, "double": torch.float64, "half": torch.float16,
            "int": torch.int32, "long": torch.int64, "short": torch.int16}
_CONSTANTS = {"None": None, "none": None, "True": True, "true": True, "False": False, "false": False}


class SpecError(ValueError):
    """An input spec that does not parse; `str()` shows the text with a caret under the column."""

    def __init__(self, what: str, text: str, column: int, hint: str = ""):
        self.what, self.text, self.column, self.hint = what, text, column, hint
        lines = [what, f"    {text}", "    " + " " * column + "^"]
        if hint:
            lines.append(f"  {hint}")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to make: its dtype and example shape, and which dimensions are dynamic.

    dims: per dimension, the name of its dynamic dimension (`batch` in `f32[batch=4,8]`) or
        None for a static one; empty when every dimension is static.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]
    dims: tuple[str | None, ...] = ()

    def __str__(self) -> str:
        short = {v: k for k, v in SHORT_DTYPES.items()}.get(self.dtype, str(self.dtype).replace("torch.", ""))
        names = self.dims or (None,) * len(self.shape)
        return f"{short}[{','.join(f'{n}={d}' if n else str(d) for n, d in zip(names, self.shape))}]"


@dataclass(frozen=True)
class ParsedInputs:
    """Positional and keyword inputs with `TensorSpec` leaves, in the order written."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def allowed_dtypes() -> str:
    longs = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32",
             torch.float64: "float64", torch.int64: "int64", torch.bool: "bool"}
    return ", ".join(f"{k} ({longs[v]})" if v in longs else k for k, v in SHORT_DTYPES.items())


def parse_dtype(name: str) -> torch.dtype | None:
    """A short name, a torch alias, or any `torch.<name>` that is a dtype; None if none is."""
    if name in SHORT_DTYPES:
        return SHORT_DTYPES[name]
    if name in _ALIASES:
        return _ALIASES[name]
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else None


def parse_inputs(text: str, *, keywords_only: bool = False) -> ParsedInputs:
    """Parse a whole `--inputs` (or, with `keywords_only`, `--kwargs`) value."""
    parser = _Parser(text)
    args, kwargs = parser.items(end=None, keywords_only=keywords_only)
    return ParsedInputs(tuple(args), kwargs)


def make_example(tree: Any, seed: int = 0) -> Any:
    """Replace every TensorSpec leaf by a tensor of its dtype and shape (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)

    def make(spec: TensorSpec) -> torch.Tensor:
        if spec.dtype.is_floating_point or spec.dtype.is_complex:
            return torch.randn(spec.shape, generator=generator, dtype=spec.dtype)
        if spec.dtype is torch.bool:
            return torch.ones(spec.shape, dtype=torch.bool)
        return torch.zeros(spec.shape, dtype=spec.dtype)

    return pytree.tree_map_only(TensorSpec, make, tree)


def dim_names(tree: Any) -> list[str]:
    """The dynamic dimension names used in `tree`, in order of first use."""
    specs = [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, TensorSpec)]
    return list(dict.fromkeys(n for spec in specs for n in spec.dims if n))


def parse_dim_range(text: str) -> tuple[str, int | None, int | None]:
    """`batch=2..64`, `batch=..64`, `batch=2..` -> (name, min, max)."""
    match = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=\s*(\d*)\s*\.\.\s*(\d*)\s*", text)
    if match is None:
        raise SpecError("a dimension range is NAME=MIN..MAX", text, 0, "example: --dim batch=1..64 (either bound may be left out)")
    name, low, high = match.groups()
    return name, int(low) if low else None, int(high) if high else None


def dynamic_shapes(tree: Any, dims: dict[str, Any]) -> Any:
    """`tree` with each TensorSpec replaced by torch.export's `{index: Dim}` (None when static)."""

    def shape_of(spec: TensorSpec) -> dict[int, Any] | None:
        marked = {i: dims[n] for i, n in enumerate(spec.dims) if n}
        return marked or None

    return pytree.tree_map_only(TensorSpec, shape_of, tree)


def describe(parsed: ParsedInputs) -> str:
    """The inputs as one line, in the spec language (for messages)."""
    parts = [_show(a) for a in parsed.args] + [f"{k}={_show(v)}" for k, v in parsed.kwargs.items()]
    return ", ".join(parts)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(map(_show, value)) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(map(_show, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_show(v)}" for k, v in value.items()) + "}"
    return str(value) if isinstance(value, TensorSpec) else repr(value)


_TOKEN = re.compile(
    r"\s*(?:(?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<string>'[^']*'|\"[^\"]*\")"
    r"|(?P<punct>[\[\](){},=:]))"
)
_CLOSE = {"(": ")", "[": "]", "{": "}"}


class _Parser:
    """Recursive descent over a token list; every token keeps its column for errors."""

    def __init__(self, text: str):
        self.text = text
        self.tokens: list[tuple[str, str, int]] = []  # (kind, text, column)
        pos = 0
        while pos < len(text):
            if text[pos:].strip() == "":
                break
            match = _TOKEN.match(text, pos)
            if match is None or match.end() == pos:
                column = len(text) - len(text[pos:].lstrip())
                raise SpecError(f"unexpected character {text[column]!r}", text, column, _GRAMMAR_HINT)
            kind = match.lastgroup or ""
            self.tokens.append((kind, match.group(kind), match.start(kind)))
            pos = match.end()
        self.i = 0

    # ---- token helpers
    def peek(self, offset: int = 0) -> tuple[str, str, int]:
        j = self.i + offset
        return self.tokens[j] if j < len(self.tokens) else ("end", "", len(self.text))

    def take(self, text: str | None = None) -> tuple[str, str, int]:
        token = self.peek()
        if text is not None and token[1] != text:
            got = f"{token[1]!r}" if token[0] != "end" else "the end of the spec"
            raise SpecError(f"expected {text!r}, found {got}", self.text, token[2], _GRAMMAR_HINT)
        self.i += 1
        return token

    # ---- grammar
    def items(self, end: str | None, keywords_only: bool = False) -> tuple[list[Any], dict[str, Any]]:
        """`item ("," item)* [","]` up to `end` (a closing bracket, or None for the whole text)."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        while not self.at(end):
            kind, text, column = self.peek()
            if kind == "name" and self.peek(1)[1] == "=":
                if end is not None:
                    raise SpecError("keyword inputs (name=...) are allowed only at the top level", self.text, column)
                if text in kwargs:
                    raise SpecError(f"keyword {text!r} is given twice", self.text, column)
                self.i += 2
                kwargs[text] = self.value()
            elif keywords_only:
                raise SpecError("--kwargs takes keyword inputs only, written name=VALUE", self.text, column,
                                'example: --kwargs "mask=b8[5,5], scale=0.5"')
            elif kwargs:
                raise SpecError("a positional input follows a keyword input", self.text, column,
                                "write positional inputs first, as in a Python call")
            else:
                args.append(self.value())
            if self.peek()[1] == ",":
                self.take(",")
            elif not self.at(end):
                _, text, column = self.peek()
                raise SpecError(f"expected ',' between inputs, found {text!r}", self.text, column, _GRAMMAR_HINT)
        if end is not None:
            self.take(end)
        return args, kwargs

    def at(self, end: str | None) -> bool:
        """Whether the next token closes the current list (`end`), or the text is over."""
        kind, text, _ = self.peek()
        return kind == "end" or (kind == "punct" and text == end)

    def value(self) -> Any:
        kind, text, column = self.peek()
        if kind == "end":
            raise SpecError("expected an input, found the end of the spec", self.text, column, _GRAMMAR_HINT)
        if text in ("(", "["):
            self.take()
            args, _ = self.items(end=_CLOSE[text])
            return tuple(args) if text == "(" else args
        if text == "{":
            return self.mapping()
        if kind == "number":
            self.take()
            return float(text) if any(c in text for c in ".eE") else int(text)
        if kind == "string":
            self.take()
            return text[1:-1]
        if kind == "name" and self.peek(1)[1] == "[":
            return self.tensor()
        if kind == "name" and text in _CONSTANTS:
            self.take()
            return _CONSTANTS[text]
        if kind == "name" and parse_dtype(text) is not None:
            raise SpecError(f"dtype {text!r} needs a shape in brackets", self.text, column + len(text),
                            f"example: {text}[2,3], or {text}[] for a 0-dim tensor")
        raise SpecError(f"unknown input {text!r}", self.text, column, _GRAMMAR_HINT)

    def tensor(self) -> TensorSpec:
        _, name, column = self.take()
        dtype = parse_dtype(name)
        if dtype is None:
            raise SpecError(f"unknown dtype {name!r}", self.text, column, f"allowed dtypes: {allowed_dtypes()}")
        self.take("[")
        shape: list[int] = []
        dims: list[str | None] = []
        while self.peek()[1] != "]":
            dim: str | None = None
            if self.peek()[0] == "name" and self.peek(1)[1] == "=":
                dim = self.take()[1]
                self.take("=")
            kind, text, col = self.take()
            if kind != "number" or not text.isdigit():
                found = repr(text) if kind != "end" else "the end of the spec"
                raise SpecError(f"a dimension must be a non-negative integer, found {found}",
                                self.text, col, "example: f32[2,5,16], or f32[batch=2,5,16] for a dynamic dimension")
            shape.append(int(text))
            dims.append(dim)
            if self.peek()[1] == ",":
                self.take(",")
        self.take("]")
        return TensorSpec(dtype, tuple(shape), tuple(dims) if any(dims) else ())

    def mapping(self) -> dict[str, Any]:
        self.take("{")
        out: dict[str, Any] = {}
        while self.peek()[1] != "}":
            kind, key, column = self.take()
            if kind not in ("name", "string"):
                raise SpecError(f"a dict key must be a name or a 'string', found {key!r}", self.text, column,
                                "example: {ids: i64[2,5], mask: b8[2,5]}")
            self.take(":")
            out[key.strip("'\"")] = self.value()
            if self.peek()[1] == ",":
                self.take(",")
            elif self.peek()[1] != "}":
                _, text, col = self.peek()
                raise SpecError(f"expected ',' or '}}' in a dict, found {text or 'the end'!r}", self.text, col)
        self.take("}")
        return out


_GRAMMAR_HINT = (
    "an input is a tensor DTYPE[dims] (f32[2,3]), a number, True/False/None, a 'string', "
    "(tuple), [list] or {key: dict}; keyword inputs are name=VALUE"
)
