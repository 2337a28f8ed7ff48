"""The IR contract of docs/ir.md, checked: what `export` guarantees is what `load` requires.

One verifier for both directions, so the two cannot drift: `load` runs it on every file
before it returns a program (a crafted file must not run what export could never emit), and
the test suite runs it on every program it exports (tests/conftest.py, tests/helpers.py).

    problems = program_problems(ep)          # [] for a good program; data, for tests and tools
    verify_program(ep, error=SerializationError, stored=True)   # load: raise on the first ones
    graph_problems(gm)                        # one graph module and its subgraphs
    verifying(predispatch._export._export_with_policy)   # export, checked (the tests' hook)

What it checks, each from a table so that a new op family, HOP or output kind is one entry:
- ops: `op_allowlist.decide` for every OpOverload (the allow list, then the schema);
  `HOP_CONVENTIONS` for higher-order ops (argument kinds, subgraphs that are subgraphs of
  this module, operand counts that match the subgraph's placeholders, subgraphs that return
  what the call's result says, Note [What a subgraph gives back]); `PYTHON_CALLABLES`
  for the few plain functions a graph may call;
- structure: placeholders first, one output last, `get_attr` naming what the module holds,
  no `call_module` / `call_method`;
- calls: no shared body calls a shared body, and (stored) what calls add when `module()`
  inlines shared bodies and lifts regions' tensors stays within `MAX_CALL_EXPANSION` times the
  file (Note [Calls of one subgraph]), checked in one walk before anything is checked per call;
- the signature: placeholders are the signature's inputs, state placeholders carry their
  stored tensor's dtype and shape, and every output is a node whose value is what its
  `OutputKind` says (`OUTPUT_RULES`): a tensor where a tensor is promised, a mutation with
  its target's dtype and shape; `training_flags` start with the root module's;
- tensor subclasses (`subclass_problems`): each layout's class can be taken apart and built,
  each subclass's parts are its inputs (or outputs) in its layout's order, and all stored;
- with `stored=True` (a program read from or written to a file): no op of a `files_only`
  family (sparse, nested, quantized; export emits them for the user's own code), every tensor
  is a dense strided tensor with data, inside its storage, never on the `meta` device, and
  node metadata holds no meta, sparse or quantized tensor (the file format holds none); no
  op's device argument is `meta` or a device this machine lacks; `grad_mode_on_exit` only
  with the region export writes for it (Note [A file that changes its caller's grad mode]).
"""

from __future__ import annotations

import functools
import math
import operator
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from predispatch.errors import SerializationError
from predispatch.runtime import names as naming
from predispatch.runtime.writes import resized_by_kernel, resized_targets
from predispatch.serialize.classes import displayed_name, is_tensor_subclass
from predispatch.serialize.subclasses import SEPARATOR, StoredParts, part_of
from predispatch.serialize.values import STORED_DEVICE_TYPES, parse_device
from predispatch.serialize.kernel_inputs import BodyCalls, FunctionPair, callers_of, trusted_input_problems
from predispatch.serialize.op_allowlist import decide
from predispatch.signature import MUTATION_KINDS, ExportSignature, InputKind, InputSpec, OutputKind, OutputSpec, Program, SubclassLayout, state_names

__all__ = [
    "HOP_CONVENTIONS", "MAX_CALL_EXPANSION", "MAX_CALL_WORK", "OUTPUT_RULES", "PYTHON_CALLABLES", "HopConvention", "Problem", "custom_namespaces",
    "graph_problems", "program_problems", "stored_tensor_problems", "subclass_problems", "verify_program", "verifying",
]


@dataclass(frozen=True)
class Problem:
    """One broken promise: where (graph module and node, signature entry, tensor) and why."""

    where: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}: {self.why}"


# --------------------------------------------------------------------------- argument kinds


def _is_subgraph(value: Any, gm: fx.GraphModule) -> bool:
    """A `get_attr` node of this graph naming a GraphModule this module holds."""
    return isinstance(value, fx.Node) and value.op == "get_attr" and isinstance(_held(gm, value.target), fx.GraphModule)


def _is_ints(value: Any, gm: fx.GraphModule) -> bool:
    return isinstance(value, (list, tuple)) and all(type(v) is int and v >= 0 for v in value)


def _is_value_node(value: Any, gm: fx.GraphModule) -> bool:
    """A node holding a value: any but a `get_attr` of a subgraph (one of a tensor the module
    holds is a value: a module-level tensor forward read, which a HOP may take as an operand)."""
    return isinstance(value, fx.Node) and (value.op != "get_attr" or isinstance(_held(gm, value.target), torch.Tensor))


def _is_nodes(value: Any, gm: fx.GraphModule) -> bool:
    return isinstance(value, (list, tuple)) and all(_is_value_node(v, gm) for v in value)


def _is_block_mask(value: Any, gm: fx.GraphModule) -> bool:
    """flex_attention's block mask: sizes, its tensors (or None), and the mask_mod subgraph last."""
    return (
        isinstance(value, tuple)
        and len(value) > 0
        and _is_subgraph(value[-1], gm)
        and all(v is None or type(v) is int or _is_value_node(v, gm) for v in value[:-1])
    )


def _is_options(value: Any, gm: fx.GraphModule) -> bool:
    """Kernel options: names to plain scalars."""
    return isinstance(value, dict) and all(
        type(k) is str and (v is None or type(v) in (bool, int, float, str)) for k, v in value.items()
    )


#: What an argument of a given kind may be.  A kind ending in `?` may also be None.
ARGUMENT_KINDS: dict[str, Callable[[Any, fx.GraphModule], bool]] = {
    "subgraph": _is_subgraph,
    "node": _is_value_node,
    "bool": lambda v, gm: type(v) is bool,
    "str": lambda v, gm: type(v) is str,
    "int": lambda v, gm: type(v) is int,
    "dtype": lambda v, gm: isinstance(v, torch.dtype),
    "ints": _is_ints,
    "op": lambda v, gm: isinstance(v, torch._ops.OpOverload),
    "predicate": lambda v, gm: type(v) is bool or (isinstance(v, fx.Node) and v.op != "get_attr"),
    "none": lambda v, gm: v is None,
    "float": lambda v, gm: type(v) is float,
    "nodes": _is_nodes,
    "block_mask": _is_block_mask,
    "options": _is_options,
}


def _kind_ok(kind: str, value: Any, gm: fx.GraphModule) -> bool:
    if kind.endswith("?"):
        return value is None or ARGUMENT_KINDS[kind[:-1]](value, gm)
    return ARGUMENT_KINDS[kind](value, gm)


# --------------------------------------------------------------------------- higher-order ops


@dataclass(frozen=True)
class HopConvention:
    """How a higher-order op is called: `hop(*leading, *operands, **kwargs)`.

    leading: the kinds of the fixed arguments (`ARGUMENT_KINDS`), subgraphs among them.
    operands: the kinds an operand may be.
    kwargs: the keyword arguments it takes, all required, by kind.
    bodies: indices in `leading` of the subgraphs the operands are passed to (their
        placeholders must match the operands' count).
    packed: the operands come as this many tuple or list arguments after `leading`, not spread
        (`cond`: one; `while_loop`: carried and additional inputs; `scan`: initial carries,
        scanned inputs, additional inputs); every body takes all of them, in order.
    inner_op: index in `leading` of an op the HOP calls (`with_effects`), itself checked.
    structure: further checks of how its subgraphs fit together (`autograd_function_apply`:
        what forward returns, what backward takes and returns), given each subgraph's
        placeholder count by id (counted once: Note [Calls of one subgraph]), yielding why not.
    reason: why programs hold this HOP.
    """

    leading: tuple[str, ...]
    operands: tuple[str, ...]
    reason: str
    kwargs: Mapping[str, str] = field(default_factory=dict)
    bodies: tuple[int, ...] = ()
    packed: int = 0
    inner_op: int | None = None
    structure: Callable[[fx.Node, fx.GraphModule, Mapping[int, int]], Iterator[str]] | None = None


def _returned(gm: Any) -> Any:
    """What a subgraph's output node returns (its one argument), or None."""
    outputs = gm.graph.find_nodes(op="output") if isinstance(gm, fx.GraphModule) else []
    return outputs[0].args[0] if len(outputs) == 1 and outputs[0].args else None


def _function_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """An `autograd_function_apply`'s pair of graphs fit: forward returns `((*outputs),
    (*saved))`; backward takes one gradient per output, then the saved values, and returns one
    gradient (or None) per operand; the index lists point into outputs and saved values.
    Without this a crafted pair loads and fails at backward with a raw error."""
    fwd, bwd = (_held(gm, a.target) if _is_subgraph(a, gm) else None for a in node.args[:2])
    if fwd is None or bwd is None:
        return  # reported by the argument kinds
    returned = _returned(fwd)
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2 and all(isinstance(r, (tuple, list)) for r in returned)):
        yield f"its forward {node.args[0].target!r} must return ((*outputs), (*saved)), not {_describe(returned)}"
        return
    outputs, saved = map(len, returned)
    takes = _arity(bwd, arities)
    if takes != outputs + saved:
        yield f"its backward {node.args[1].target!r} takes {takes} values; forward gives {outputs} gradients and {saved} saved values"
    grads, operands = _returned(bwd), len(node.args) - 2
    if not isinstance(grads, (tuple, list)) or len(grads) != operands or not all(g is None or isinstance(g, fx.Node) for g in grads):
        yield f"its backward {node.args[1].target!r} must return one gradient or None per operand ({operands}), not {_describe(grads)}"
    for key, count in (("non_differentiable_idx", outputs), ("saved_for_backward_idx", saved)):
        indices = node.kwargs.get(key)
        if isinstance(indices, (list, tuple)) and (len(set(indices)) != len(indices) or any(type(i) is not int or not 0 <= i < count for i in indices)):
            yield f"keyword {key!r} is {list(indices)}: distinct indices below {count} expected"


def _flex_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """flex_attention's subgraphs take what the HOP passes them: score_mod the score and four
    indices, then the score_mod's captured tensors (argument 7); mask_mod (the block mask's last
    entry) four indices, then the mask_mod's (argument 8).  Without this a crafted file loads and
    fails at its first call with a raw error."""
    if len(node.args) != 9 or not all(isinstance(a, (tuple, list)) for a in node.args[7:]):
        return  # reported by the argument kinds
    block_mask = node.args[4]
    mask_mod = block_mask[-1] if isinstance(block_mask, tuple) and block_mask else None
    bodies = (("score_mod", node.args[3], 5, node.args[7]), ("mask_mod", mask_mod, 4, node.args[8]))
    for name, body, fixed, captured in bodies:
        held = _held(gm, body.target) if _is_subgraph(body, gm) else None
        if held is None:
            continue  # reported by the argument kinds
        takes = _arity(held, arities)
        if takes != fixed + len(captured):
            yield (f"its {name} {body.target!r} takes {takes} values; flex_attention passes {fixed} and "
                   f"{len(captured)} captured tensor(s)")


# Note [What a subgraph gives back]
# ---------------------------------
# A higher-order op hands its caller what its subgraphs return, and torch checks little of it
# at the call: a region or `invoke_subgraph` returns its body's tuple as it is, a `cond` the
# tuple of the branch that ran, `map` and `scan` stack what their bodies return.  The graph
# around the call reads that result as the HOP node's value says (`getitem` by index, ops on
# its tensors), so a body returning fewer values than the value has, or a tensor of another
# dtype, rank or size, loads and then fails at every call with a raw error (an IndexError, a
# kernel's shape error), or runs and hands the caller something the program never promised.
# Loops and branches add their own conventions, which torch checks only when they run: a
# `cond` predicate is a bool or a one-element tensor, a `while_loop` condition returns a bool
# or a bool tensor of shape [], its body a tuple of exactly the carries, each like the carry it
# replaces.  So each HOP's subgraphs are checked against the HOP's result (node meta `val`, as
# the rest of the verifier reads it): same count, and for tensors the same dtype, device, rank
# and static sizes (a stacked result has the body's sizes after its first); a value without
# metadata is taken as stated.  The checks read each body's output node and the call's own
# result, so they cost what the call holds (Note [Calls of one subgraph]).


def _body(node: fx.Node, gm: fx.GraphModule, index: int) -> fx.GraphModule | None:
    """The subgraph argument `index` of `node`, or None (the argument kinds report it)."""
    arg = node.args[index] if index < len(node.args) else None
    return _held(gm, arg.target) if _is_subgraph(arg, gm) else None


def _value_of(value: Any) -> Any:
    """What a returned entry or operand holds: a node's metadata value, or the literal itself."""
    return _val(value) if isinstance(value, fx.Node) else value


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).removeprefix('torch.')}{list(value.shape)} tensor on {value.device}"
    return _describe(value)


def _misfit(entry: Any, expected: Any, stacked: bool = False) -> str | None:
    """Why `entry`, a value a subgraph returns (a node or a literal), cannot be `expected` (a HOP
    result's or a carry's value), or None.  `stacked`: `expected` stacks such values along a new
    first dimension (`map`, `scan`)."""
    if expected is None or isinstance(entry, fx.Node) and "val" not in entry.meta:
        return None  # no metadata to compare with: taken as stated
    actual = _value_of(entry)
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{_described(actual)} where the result holds {_described(expected)}"
        sizes = list(expected.shape)[1:] if stacked else list(expected.shape)
        static = all(type(a) is int and type(b) is int for a, b in zip(actual.shape, sizes))
        if (actual.dtype, actual.device, actual.dim()) != (expected.dtype, expected.device, len(sizes)) or static and list(actual.shape) != sizes:
            where = f"{'each slice of ' if stacked else ''}{_described(expected)}"
            return f"{_described(actual)} where the result holds {where}"
        return None
    if isinstance(actual, torch.Tensor) or isinstance(expected, (int, torch.SymInt)) != isinstance(actual, (int, torch.SymInt)):
        return f"{_described(actual)} where the result holds {_describe(expected)}"
    return None


def _returned_entries(body: fx.GraphModule, name: str, count: int | None, *, tuple_only: bool = False) -> tuple[list, str | None]:
    """What `body` returns, as a list, and why it is not a tuple (or list) of `count` values."""
    returned = _returned(body)
    kinds = (tuple,) if tuple_only else (tuple, list)
    if not isinstance(returned, kinds):
        return [], f"its {name} returns {_describe(returned)}, not a {'tuple' if tuple_only else 'tuple or list'} of values"
    if count is not None and len(returned) != count:
        return list(returned), f"its {name} returns {len(returned)} value(s), where the call's result has {count}"
    return list(returned), None


def _result(node: fx.Node) -> tuple | None:
    """The HOP call's own result (its node's `val`), a tuple, or None when it has none."""
    value = _val(node)
    return tuple(value) if isinstance(value, (tuple, list)) else None


def _getitem_bound(node: fx.Node) -> int:
    """One past the largest index a `getitem` of `node`'s result reads (0 when none does)."""
    return max((u.args[1] + 1 for u in node.users if u.target is operator.getitem and len(u.args) == 2 and type(u.args[1]) is int), default=0)


def _fits_result(node: fx.Node, body: fx.GraphModule | None, name: str, stacked: bool = False) -> Iterator[str]:
    """`body` returns the call's result: a tuple of as many values as the result (at least as
    many as its `getitem`s read), each fitting its entry (Note [What a subgraph gives back])."""
    if body is None:
        return
    result = _result(node)
    entries, why = _returned_entries(body, name, len(result) if result is not None else None)
    if why:
        yield why
        return
    if result is None and len(entries) < _getitem_bound(node):
        yield f"its {name} returns {len(entries)} value(s), and the call's result is read at index {_getitem_bound(node) - 1}"
    for i, (entry, expected) in enumerate(zip(entries, result or ())):
        if (why := _misfit(entry, expected, stacked)) is not None:
            yield f"its {name} returns, at {i}, {why}"


def _region_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """A grad-mode region's or a shared body's subgraph returns the call's result."""
    index = 0 if node.target.name() == "invoke_subgraph" else 1
    yield from _fits_result(node, _body(node, gm, index), "body")


def _cond_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """`cond`: the predicate is a bool or a one-element tensor (torch's own rule, checked only
    when it runs), and each branch returns the call's result."""
    predicate = _value_of(node.args[0]) if node.args else None
    if isinstance(predicate, torch.Tensor):
        sizes = list(predicate.shape)
        if all(type(s) is int for s in sizes) and math.prod(sizes) != 1:
            yield f"its predicate is {_described(predicate)}: a bool or a one-element tensor expected"
    elif predicate is not None and not isinstance(predicate, (bool, torch.SymBool)):
        yield f"its predicate is {_describe(predicate)}: a bool or a one-element tensor expected"
    for index, name in ((1, "true branch"), (2, "false branch")):
        yield from _fits_result(node, _body(node, gm, index), name)


def _while_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """`while_loop`: the condition returns a bool or a bool tensor of shape []; the body a tuple
    of exactly the carries, each like the carry it replaces (what the loop feeds back to both);
    the call's result is the carries."""
    if len(node.args) != 4 or not isinstance(node.args[2], (tuple, list)):
        return  # reported by the argument kinds
    carries = list(node.args[2])
    condition, body = _body(node, gm, 0), _body(node, gm, 1)
    if condition is not None:
        returned = _returned(condition)
        value = _val(returned) if isinstance(returned, fx.Node) else returned
        scalar = isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.dim() == 0
        unknown = isinstance(returned, fx.Node) and "val" not in returned.meta  # taken as stated
        if not (unknown or scalar or isinstance(value, (bool, torch.SymBool))):
            shown = _described(value) if isinstance(returned, fx.Node) else _describe(returned)
            yield f"its condition returns {shown}: a bool or a bool tensor of shape [] expected"
    result = _result(node)
    if result is not None and len(result) != len(carries):
        yield f"its result has {len(result)} value(s) for {len(carries)} carries"
    if body is None:
        return
    entries, why = _returned_entries(body, "body", len(carries), tuple_only=True)
    if why:
        yield why
        return
    for i, (entry, carry) in enumerate(zip(entries, carries)):
        if (why := _misfit(entry, _value_of(carry))) is not None:
            yield f"its body returns, for carry {i}, {why.replace('the result holds', 'the carry is')}"


def _scan_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """`scan`: the combine subgraph returns the next carries (each like its initial carry), then
    one slice of each stacked output; the call's result is the carries, then the stacked outputs."""
    if len(node.args) != 4 or not isinstance(node.args[1], (tuple, list)):
        return  # reported by the argument kinds
    body, carries, result = _body(node, gm, 0), len(node.args[1]), _result(node)
    if body is None:
        return
    entries, why = _returned_entries(body, "combine", len(result) if result is not None else None)
    if why:
        yield why
        return
    if len(entries) < carries or len(entries) < _getitem_bound(node):
        yield f"its combine returns {len(entries)} value(s), fewer than its {carries} carries or than the call's result is read at"
        return
    expected = [*((_value_of(c), False) for c in node.args[1]), *((v, True) for v in (result or ())[carries:])]
    for i, (entry, (value, stacked)) in enumerate(zip(entries, expected)):
        if (why := _misfit(entry, value, stacked)) is not None:
            yield f"its combine returns, at {i}, {why}"


def _map_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """`map`: the body returns one slice of each stacked output of the call's result."""
    yield from _fits_result(node, _body(node, gm, 0), "body", stacked=True)


def _function_pair_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """An `autograd_function_apply`'s pair fits together (`_function_structure`), and its
    forward's outputs are the call's result (Note [What a subgraph gives back])."""
    problems = list(_function_structure(node, gm, arities))
    yield from problems
    forward = _body(node, gm, 0)
    returned = _returned(forward) if forward is not None else None
    if problems or not isinstance(returned, (tuple, list)) or not returned or not isinstance(returned[0], (tuple, list)):
        return  # reported by `_function_structure` or the argument kinds
    outputs, result = list(returned[0]), _result(node)
    if result is not None and len(outputs) != len(result) or len(outputs) < _getitem_bound(node):
        yield f"its forward returns {len(outputs)} output(s), where the call's result has {len(result) if result is not None else _getitem_bound(node)}"
        return
    for i, (entry, expected) in enumerate(zip(outputs, result or ())):
        if (why := _misfit(entry, expected)) is not None:
            yield f"its forward returns, at {i}, {why}"


def _autocast_structure(node: fx.Node, gm: fx.GraphModule, arities: Mapping[int, int]) -> Iterator[str]:
    """An autocast region runs under `torch.autocast(device_type, dtype, enabled, cache)` on this
    machine: a device type torch does not know, or has no autocast for (`meta`), raises at every
    call; one this machine lacks (`cuda` on a CPU build: torch disables itself with a warning;
    `xpu`: casts nothing) or a dtype its autocast does not take runs the region without casts,
    and the casts after it fail.  So the arguments must make an autocast torch enables here.
    Its body returns the call's result."""
    device_type, dtype, enabled, cache = (list(node.args[:4]) + [None] * 4)[:4]
    kinds = type(enabled) is bool and (cache is None or type(cache) is bool) and (dtype is None or isinstance(dtype, torch.dtype))
    if type(device_type) is str and not re.fullmatch(r"[a-z_]{1,32}(:\d{1,4})?", device_type):
        yield f"its device type {_describe(device_type)} is not the name of a device type"
    elif kinds and type(device_type) is str:  # otherwise the argument kinds report it
        yield from _autocast_problems(device_type, dtype, enabled, cache)
    yield from _fits_result(node, _body(node, gm, 4), "body")


@functools.lru_cache(maxsize=64)
def _autocast_problems(device_type: str, dtype: torch.dtype | None, enabled: bool, cache: bool | None) -> tuple[str, ...]:
    """Why `torch.autocast(device_type, dtype, enabled, cache)` does not run here as a region
    asks (`_autocast_structure`); once per distinct arguments, however many regions a file has."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.autocast(device_type, dtype, enabled, cache)  # builds the object only: enters nothing
        except (RuntimeError, ValueError, AssertionError, TypeError) as exc:
            return (f"torch.autocast({device_type!r}) fails here: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",)
    if enabled and caught:
        return (f"torch.autocast({device_type!r}, {dtype}) would disable itself here: {str(caught[0].message).splitlines()[0]}",)
    try:
        parse_device(device_type)  # a device type this machine's torch provides
    except (SerializationError, RuntimeError) as exc:
        return (f"an autocast region for {device_type!r}: {getattr(exc, 'what', str(exc))}",)
    return ()


#: The higher-order ops a program may call, by `hop.name()`, and their calling conventions.
HOP_CONVENTIONS: dict[str, HopConvention] = {
    "wrap_with_set_grad_enabled": HopConvention(
        ("bool", "subgraph"), ("node",), "a grad-mode region: runs its subgraph with grad mode set, for that scope only", bodies=(1,),
        structure=_region_structure),
    "wrap_with_autocast": HopConvention(
        ("str", "dtype?", "bool", "bool?", "subgraph"), ("node",),
        "an autocast region: runs its subgraph under torch.autocast, for that scope only", bodies=(4,), structure=_autocast_structure),
    "autograd_function_apply": HopConvention(
        ("subgraph", "subgraph"), ("node",), "a custom autograd.Function: forward and backward subgraphs",
        kwargs={"non_differentiable_idx": "ints", "saved_for_backward_idx": "ints"}, bodies=(0,),
        structure=_function_pair_structure),
    "invoke_subgraph": HopConvention(
        ("subgraph", "str"), ("node", "int", "none"), "a repeated block: one subgraph called at each repetition", bodies=(0,),
        structure=_region_structure),
    "with_effects": HopConvention(
        ("node", "op"), ("node", "int", "none", "bool", "str"), "an effectful op ordered by a token; the op itself is checked",
        inner_op=1),
    "cond": HopConvention(
        ("predicate", "subgraph", "subgraph"), ("node",), "torch.cond in the user's code: both branches kept, one runs",
        bodies=(1, 2), packed=1, structure=_cond_structure),
    "while_loop": HopConvention(
        ("subgraph", "subgraph"), ("node", "int"),
        "torch's while_loop in the user's code: condition and body subgraphs (a Python int may be carried)",
        bodies=(0, 1), packed=2, structure=_while_structure),
    "scan": HopConvention(
        ("subgraph",), ("node",), "torch's scan in the user's code: the combine subgraph, run along the scanned inputs",
        bodies=(0,), packed=3, structure=_scan_structure),
    "map_impl": HopConvention(
        ("subgraph",), ("node",), "torch's map in the user's code: the body subgraph, run on each slice",
        bodies=(0,), packed=2, structure=_map_structure),
    "flex_attention": HopConvention(
        ("node", "node", "node", "subgraph", "block_mask", "float", "options", "nodes", "nodes"), (),
        "torch.nn.attention.flex_attention: score_mod and mask_mod as subgraphs, the block mask's tensors and "
        "the tensors score_mod and mask_mod capture as nodes", structure=_flex_structure),
}


def _hop_problems(
    node: fx.Node, gm: fx.GraphModule, convention: HopConvention, namespaces: tuple[str, ...], stored: bool, arities: Mapping[int, int],
) -> Iterator[str]:
    args, name = node.args, node.target.name()
    if len(args) < len(convention.leading):
        yield f"{name} takes {len(convention.leading)} leading arguments ({', '.join(convention.leading)}), given {len(args)}"
        return
    for i, (kind, value) in enumerate(zip(convention.leading, args)):
        if not _kind_ok(kind, value, gm):
            yield f"{name} argument {i} must be a {_kind_text(kind)}, not {_describe(value)}"
    operands = args[len(convention.leading):]
    if convention.packed:
        if len(operands) != convention.packed or not all(isinstance(group, (tuple, list)) for group in operands):
            yield (f"{name} takes its operands as {convention.packed} tuple(s) after {len(convention.leading)} "
                   f"arguments, given {_describe(operands)}")
            return
        operands = [value for group in operands for value in group]
    for i, value in enumerate(operands):
        if not any(_kind_ok(kind, value, gm) for kind in convention.operands):
            yield f"{name} operand {i} is {_describe(value)}; operands are {' or '.join(convention.operands)}"
    if set(node.kwargs) != set(convention.kwargs):
        yield f"{name} takes keyword arguments {sorted(convention.kwargs)}, given {sorted(node.kwargs)}"
    for key, kind in convention.kwargs.items():
        if key in node.kwargs and not _kind_ok(kind, node.kwargs[key], gm):
            yield f"{name} keyword {key!r} must be {_kind_text(kind)}, not {_describe(node.kwargs[key])}"
    for index in convention.bodies:
        if _is_subgraph(args[index], gm):
            arity = _arity(_held(gm, args[index].target), arities)
            if arity != len(operands):
                yield f"{name} passes {len(operands)} operands to subgraph {args[index].target!r}, which takes {arity}"
    if convention.structure is not None:
        yield from convention.structure(node, gm, arities)
    if convention.inner_op is not None and isinstance(args[convention.inner_op], torch._ops.OpOverload):
        decision = decide(args[convention.inner_op], namespaces, stored=stored)
        if not decision.allowed:
            yield f"{name} calls {args[convention.inner_op]}, which a program may not call ({decision.family}: {decision.reason})"


def _kind_text(kind: str) -> str:
    return f"{kind[:-1]} or None" if kind.endswith("?") else kind


def _describe(value: Any) -> str:
    if isinstance(value, fx.Node):
        return f"node {value.name} ({value.op})"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


# --------------------------------------------------------------------------- Python callables


def _getitem_args(node: fx.Node) -> bool:
    """`source[i]`, with `i` inside the source's value when that is a tuple or list (a
    multi-output op's, a HOP's): an index past it would fail at every call."""
    if len(node.args) != 2 or node.kwargs or not isinstance(node.args[0], fx.Node) or type(node.args[1]) is not int:
        return False
    value = _val(node.args[0])
    return not isinstance(value, (tuple, list)) or -len(value) <= node.args[1] < len(value)


def _scalar_args(node: fx.Node) -> bool:
    return not node.kwargs and all(isinstance(a, (fx.Node, int, float, bool)) for a in node.args)


_SYMBOLIC_REASON = "arithmetic on symbolic sizes (dynamic shapes), as torch.export emits it"

#: Plain Python functions a graph may call, with the argument check each must pass and why.
PYTHON_CALLABLES: dict[Callable[..., Any], tuple[Callable[[fx.Node], bool], str]] = {
    operator.getitem: (_getitem_args, "unpacks a multi-output op's or a HOP's result by index"),
    **{fn: (_scalar_args, _SYMBOLIC_REASON) for fn in (
        operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv, operator.mod, operator.pow,
        operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
        operator.and_, operator.or_, operator.not_, torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min,
        torch.sym_not, torch.sym_ite, math.ceil, math.floor, math.trunc,
    )},
}


# --------------------------------------------------------------------------- graphs


_NODE_OPS = ("placeholder", "get_attr", "call_function", "output")
_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def _held(gm: nn.Module, target: str) -> Any:
    """What a `get_attr` target names in `gm` (a submodule, parameter or buffer), or None."""
    *path, last = target.split(".")
    for part in path:
        gm = gm._modules.get(part)
        if gm is None:
            return None
    for table in (gm._modules, gm._parameters, gm._buffers):
        if last in table:
            return table[last]
    return None


#: Python objects (not tensors or modules) a program's graph may read with `get_attr`, in memory
#: only: a file holds none of them.
_OPAQUE_ATTRIBUTES = {
    torch.Generator: "a generator of the user's module that random ops draw from (torch.rand(..., generator=g)), "
    "shared with the module as eager shares it",
}


def _opaque(gm: nn.Module, target: str, stored: bool) -> bool:
    """Whether a `get_attr` reads an object of `_OPAQUE_ATTRIBUTES` (never in a stored program)."""
    return not stored and "." not in target and type(gm.__dict__.get(target)) in _OPAQUE_ATTRIBUTES


#: How deeply subgraphs may nest in a file (a region in a Function's forward in a region ...).
#: Programs export makes nest a few levels; FX copies and compiles graph modules recursively,
#: each level costing Python stack and a copy of what lies below, so a stored program nests
#: at most this deep (Note [Load cost] in serialize/graph.py; docs/format.md states it).
MAX_SUBGRAPH_DEPTH = 32

#: How much a file's calls may expand it (Note [Calls of one subgraph]): what `ep.module()` and
#: `to_torch()` add at calls, at most this many times the nodes and tensors the file holds.
#: Programs export makes expand 2-10 times (a decoder layer's body, a few dozen ops, inlined at
#: each of dozens of layers, whose parameters and calls the file holds too).
MAX_CALL_EXPANSION = 64
#: The nodes one call of a stored program may run beyond `MAX_CALL_EXPANSION` times the file:
#: a 32-layer Llama-style decoder's joint runs 8,812 (its file holds 1,682); a file whose bodies call their child twice at
#: every level of a 32-deep nest would run 2^32 (Note [Calls of one subgraph]).
MAX_CALL_WORK = 1 << 20


# Note [Calls of one subgraph]
# ----------------------------
# A file holds each subgraph once, but its graphs may call one subgraph from many sites, and a
# body may call its child twice at every level of a nest: a file linear in its depth whose call
# paths number 2^depth.  Every walk that follows calls does each body once (Note [Each region
# body once] in passes/lift_constants.py), and the verifier counts each subgraph's
# placeholders once, so those cost what the file costs.  Two things are done at each call, and
# they are what a stored program bounds:
# - inlining: `ep.module()` and `to_torch()` copy a shared body's nodes into its caller at each
#   `invoke_subgraph` call (torch's eager `invoke_subgraph` cannot differentiate);
# - lifting: each call of a region passes the tensors its body (and the bodies it calls) holds
#   as operands, a node each.
# Their sum over all calls, the expansion, is at most MAX_CALL_EXPANSION times the nodes and
# tensors of the file.  And a call itself runs each body as often as its callers call it, so a
# nest of bodies calling their child twice runs 2^depth nodes per call from a file linear in
# depth: the nodes one call runs (`_work_of_a_call`, counted once per subgraph) are at most
# MAX_CALL_EXPANSION times the file, or MAX_CALL_WORK, whichever is more.  And no shared body calls a shared body itself (`invoke_subgraph` in its
# own graph): export never writes one (it traces a repeated block's inner blocks inline, and
# torch's own `invoke_subgraph` flattens nested regions too); copied, such a body still called
# torch's eager `invoke_subgraph`, and every backward raised "fake_mode should be enabled for
# HOPs"; inlined all the way, nested bodies would multiply.  A shared body may hold a region
# that calls shared bodies: that region is one module, inlined once.


@dataclass(frozen=True)
class _Calls:
    """What one walk over a program's graph modules finds about their calls (by module id)."""

    paths: Mapping[int, str]  # each graph module's path
    arities: Mapping[int, int]  # each graph module's placeholders
    problems: tuple[Problem, ...]  # nested shared bodies, and too much expansion (stored programs)


def _calls(gm: fx.GraphModule, stored: bool) -> _Calls:
    """The calls of every subgraph of `gm`, counted in one walk (Note [Calls of one subgraph])."""
    modules = [(path or "<root>", m) for path, m in gm.named_modules() if isinstance(m, fx.GraphModule)]
    paths = {id(m): path for path, m in modules}
    arities = {id(m): len(m.graph.find_nodes(op="placeholder")) for _, m in modules}
    held = {id(m): len(m._parameters) + len(m._buffers) for _, m in modules}
    below = _tensors_below(gm, held)
    calling = {id(m): calls[0] for _, m in modules if (calls := m.graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH))}
    expansion: Counter[int] = Counter()  # a subgraph -> what its calls add
    nested: dict[int, str] = {}  # a shared body calling shared bodies -> its first caller
    for path, module in modules:
        for node in module.graph.nodes:
            for arg in node.all_input_nodes if node.op == "call_function" else ():
                sub = _held(module, arg.target) if arg.op == "get_attr" else None
                if not isinstance(sub, fx.GraphModule):
                    continue
                invoked = node.target is _INVOKE_SUBGRAPH and arg is node.args[0]
                expansion[id(sub)] += below.get(id(sub), 0) + (len(sub.graph.nodes) if invoked else 0)
                if invoked and id(sub) in calling:
                    nested.setdefault(id(sub), f"{path}'s node {node.name}")
    problems = [
        Problem(f"graph module {paths[body]}, node {calling[body].name}",
                f"a shared body (invoke_subgraph, called by {caller}) calls a shared body itself; a file holds no nested shared "
                "bodies: export never writes them (Note [Calls of one subgraph] in predispatch/serialize/verify.py)")
        for body, caller in nested.items()
    ]
    total = sum(len(m.graph.nodes) for _, m in modules) + sum(held.values())
    work = _work_of_a_call(gm)
    if stored and work > max(MAX_CALL_EXPANSION * total, MAX_CALL_WORK):
        problems.append(Problem(
            "graph module <root>",
            f"one call runs {work} nodes (each subgraph as often as its callers call it): more than {MAX_CALL_EXPANSION} "
            f"times the {total} nodes and tensors the file holds, and more than {MAX_CALL_WORK} (Note [Calls of one "
            "subgraph] in predispatch/serialize/verify.py); export never writes a nest of bodies calling their child twice",
        ))
    if stored and sum(expansion.values()) > MAX_CALL_EXPANSION * total:
        body, most = expansion.most_common(1)[0]
        problems.append(Problem(
            f"graph module {paths.get(body, '?')}",
            f"its calls add {most} nodes (copies of a shared body, a region's tensors passed), and all calls {sum(expansion.values())}: "
            f"more than {MAX_CALL_EXPANSION} times the {total} nodes and tensors the file holds (Note [Calls of one subgraph] in "
            "predispatch/serialize/verify.py); export with dedup=False to save repeated blocks inline",
        ))
    return _Calls(paths, arities, tuple(problems))


def _work_of_a_call(gm: fx.GraphModule) -> int:
    """How many nodes one call of `gm` runs: its own, and each subgraph's as often as it is
    called (a `cond`'s two arms both, a loop's body once: an upper bound where data decides).
    Each subgraph is counted once and remembered, so this costs what the file holds, while the
    count itself may be exponential in the nesting (a body calling its child twice a level)."""
    memo: dict[int, int] = {}

    def work(module: fx.GraphModule) -> int:
        if id(module) not in memo:
            memo[id(module)] = 0  # a subgraph holds its callees, never itself: no cycle to guard
            total = len(module.graph.nodes)
            for node in module.graph.nodes:
                for arg in node.all_input_nodes if node.op == "call_function" else ():
                    sub = _held(module, arg.target) if arg.op == "get_attr" else None
                    if isinstance(sub, fx.GraphModule):
                        total += work(sub)
            memo[id(module)] = total
        return memo[id(module)]

    return work(gm)


def _tensors_below(gm: nn.Module, held: Mapping[int, int]) -> dict[int, int]:
    """For each graph module, the tensors it and the modules under it hold: what lifting may
    pass at each call of it (an upper bound: Note [Calls of one subgraph])."""
    below: dict[int, int] = {}

    def count(module: nn.Module) -> int:
        if id(module) not in below:
            below[id(module)] = held.get(id(module), 0) + sum(count(child) for child in module.children())
        return below[id(module)]

    count(gm)
    return below


def _arity(gm: Any, arities: Mapping[int, int]) -> int:
    """A subgraph's placeholders, counted once per verification (a call site counting them
    again would cost the subgraph's size at each of its calls)."""
    return arities[id(gm)] if id(gm) in arities else len(gm.graph.find_nodes(op="placeholder"))


def graph_problems(
    gm: fx.GraphModule, *, op_namespaces: tuple[str, ...] = (), stored: bool = False, path: str = "",
    callers: BodyCalls | FunctionPair | None = None, calls: _Calls | None = None,
) -> list[Problem]:
    """Problems of one graph module and of every module it holds (its subgraphs; `callers`: this
    one's calls when only `invoke_subgraph` calls it, or its forward when it is the backward of
    one `autograd_function_apply` pair, for Note [Kernels that trust their inputs]; `calls`:
    what the outermost call found about all calls, Note [Calls of one subgraph])."""
    where = f"graph module {path or '<root>'}"
    if stored and path and path.count(".") + 1 > MAX_SUBGRAPH_DEPTH:
        return [Problem(where, f"subgraphs nest more than {MAX_SUBGRAPH_DEPTH} deep, the most a file holds")]
    if calls is None:
        calls = _calls(gm, stored)
        if calls.problems:
            return list(calls.problems)  # before any check per call: Note [Calls of one subgraph]
    problems = [
        Problem(f"{where}, node {node.name}", why)
        for node in gm.graph.nodes for why in _node_problems(node, gm, op_namespaces, stored, not path, callers, calls.arities)
    ]
    kinds = [node.op for node in gm.graph.nodes]
    placeholders = kinds.count("placeholder")
    if kinds[:placeholders] != ["placeholder"] * placeholders or kinds.count("output") != 1 or kinds[-1:] != ["output"]:
        problems.append(Problem(where, "the graph must be placeholders, then computations, then one output"))
    for name, child in gm.named_children():
        child_path = f"{path}.{name}".lstrip(".")
        if not isinstance(child, fx.GraphModule):
            problems.append(Problem(where, f"holds {name!r}, a {type(child).__name__}; a program holds only graph modules"))
        else:
            problems += graph_problems(
                child, op_namespaces=op_namespaces, stored=stored, path=child_path, callers=callers_of(gm, name), calls=calls,
            )
    if stored:
        for name, tensor in (*gm._parameters.items(), *gm._buffers.items()):
            problems += [Problem(f"{where}, tensor {name}", why) for why in stored_tensor_problems(tensor)]
    return problems


def _node_problems(
    node: fx.Node, gm: fx.GraphModule, namespaces: tuple[str, ...], stored: bool, root: bool = True,
    callers: BodyCalls | FunctionPair | None = None, arities: Mapping[int, int] | None = None,
) -> Iterator[str]:
    if node.op not in _NODE_OPS:
        yield f"a {node.op} node; programs hold only {', '.join(_NODE_OPS)}"
    elif node.op == "get_attr" and _held(gm, node.target) is None and not _opaque(gm, node.target, stored):
        yield f"get_attr {node.target!r} names nothing the module holds"
    elif node.op == "call_function":
        yield from _call_problems(node, gm, namespaces, stored, root, callers, arities)
    if stored and "val" in node.meta:
        yield from _meta_problems(node.meta["val"])
    if stored and node.op == "call_function":
        yield from _device_argument_problems(node)
    if stored and node.op in ("placeholder", "get_attr") and (node.args or node.kwargs):
        # FX compiles a placeholder's argument into the generated code as its default value
        # (`x = [[]], = fx_pytree.tree_flatten_spec(...)` in `ep.module()`): every call failed
        yield f"a {node.op} with arguments {_describe((*node.args, *node.kwargs.values()))}; export writes none"


def _call_problems(
    node: fx.Node, gm: fx.GraphModule, namespaces: tuple[str, ...], stored: bool, root: bool,
    callers: BodyCalls | FunctionPair | None = None, arities: Mapping[int, int] | None = None,
) -> Iterator[str]:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        decision = decide(target, namespaces, stored=stored)
        if stored and decision.family == "trusts_inputs":  # Note [Kernels that trust their inputs]
            decision = decide(target, namespaces, stored=False)  # its schema still decides
            if decision.allowed:
                yield from trusted_input_problems(node, root=root, callers=callers)
        if not decision.allowed:
            yield f"calls {target}, which a program may not call ({decision.family}: {decision.reason})"
    elif isinstance(target, torch._ops.HigherOrderOperator):
        convention = HOP_CONVENTIONS.get(target.name())
        if convention is None:
            yield f"calls the higher-order op {target.name()}, which programs do not hold (known: {', '.join(sorted(HOP_CONVENTIONS))})"
        else:
            yield from _hop_problems(node, gm, convention, namespaces, stored, arities or {})
    elif _hashable(target) and target in PYTHON_CALLABLES:
        check, _ = PYTHON_CALLABLES[target]
        if not check(node):
            yield f"calls {getattr(target, '__name__', target)} with arguments {_describe(node.args)}"
    else:
        yield f"calls {getattr(target, '__qualname__', target)!s}, which is neither an allowed op, a known HOP nor an allowed Python function"


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _meta_problems(value: Any) -> Iterator[str]:
    """A stored program's node metadata: the file format's tensors only."""
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _meta_problems(item)
    elif isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            yield f"its value is a {value.layout} tensor; the file format holds strided tensors only"
        if value.device.type == "meta":
            yield "its value is on the meta device (no data); the file format holds tensors with data"


def _device_argument_problems(node: fx.Node) -> Iterator[str]:
    """A stored program's device arguments name a device with data that this machine has.  A
    device is read as a tagged value (`{"device": "cuda:0"}`, checked where it is read) or, as
    torch takes it too, a plain string (`device="cuda"`), checked here; neither may be `meta`:
    the op would make a tensor without data, which the program returns or fails on (format
    version 1 holds none, as it holds no meta tensor)."""
    op, args, kwargs = node.target, node.args, node.kwargs
    if isinstance(op, torch._ops.HigherOrderOperator) and op.name() == "with_effects" and len(args) > 1:
        op, args = args[1], args[2:]  # the op it calls, on the arguments after the token and the op
    if not isinstance(op, torch._ops.OpOverload):
        return
    for position, name, kwarg_only in _device_arguments(op):
        value = args[position] if not kwarg_only and position < len(args) else kwargs.get(name)
        if isinstance(value, str):
            try:
                value = parse_device(value)
            except (SerializationError, RuntimeError) as exc:  # torch.device("foo") raises RuntimeError
                yield f"its argument {name} is {_describe(value)}: {getattr(exc, 'what', exc)}"
                continue
        if isinstance(value, torch.device) and value.type == "meta":
            yield (f"its argument {name} is the meta device: the op would make a tensor without data, "
                   "which the file format holds none of")


@functools.lru_cache(maxsize=None)
def _device_arguments(op: torch._ops.OpOverload) -> tuple[tuple[int, str, bool], ...]:
    """Each `Device` or `Device?` argument of `op`'s schema: position, name, keyword-only."""
    return tuple((i, a.name, a.kwarg_only) for i, a in enumerate(op._schema.arguments) if str(a.type) in ("Device", "Optional[Device]"))


# --------------------------------------------------------------------------- tensors


def stored_tensor_problems(t: Any) -> list[str]:
    """Why `t` is not a tensor the file format holds: dense, strided, with data in bounds."""
    if type(t) not in (torch.Tensor, nn.Parameter):
        return [f"a {type(t).__name__}, not a tensor"]
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        return [f"a {t.layout} tensor; the file format holds strided tensors only"]
    if t.device.type not in STORED_DEVICE_TYPES:
        return [f"on device {t.device}, which has no data to hold" if t.device.type == "meta" else f"on device {t.device}"]
    if t.numel():
        extent = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        if min(t.stride(), default=0) < 0 or (extent + 1) * t.element_size() > t.untyped_storage().nbytes():
            return [f"its shape {list(t.shape)} and stride {list(t.stride())} reach outside its storage"]
    return []


# --------------------------------------------------------------------------- the program


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _same_metadata(value: Any, expected: torch.Tensor, resizable: bool = False) -> str | None:
    """Why a node's value cannot stand for `expected`, or None (dtype, rank, static sizes; any
    sizes for state a kernel resizes, Note [State a kernel resizes] in runtime/writes.py)."""
    if not isinstance(value, torch.Tensor):
        return f"its value is {_describe(value)}, not a tensor"
    if value.dtype != expected.dtype or value.dim() != expected.dim():
        return f"its value is {value.dtype}[{value.dim()} dims], its target {expected.dtype}[{expected.dim()} dims]"
    sizes = [(a, b) for a, b in zip(value.shape, expected.shape) if type(a) is int and type(b) is int and not resizable]
    if any(a != b for a, b in sizes):
        return f"its shape {list(value.shape)} differs from its target's {list(expected.shape)}"
    return None


def _is_value(value: Any) -> bool:
    return isinstance(value, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _user_output(ep: Program, node: Any, target: str) -> str | None:
    value = _val(node)
    return None if _is_value(value) else f"a user output must be a tensor (or a scalar computed from data); its value is {_describe(value)}"


def _state_mutation(ep: Program, node: Any, target: str) -> str | None:
    stored = {**ep.state_dict, **ep.constants}.get(target)
    if stored is None:
        return f"mutates {target!r}, which is not a parameter, buffer or constant of the program"
    return _same_metadata(_val(node), stored, resizable=resized_by_kernel(node))


def _input_mutation(ep: Program, node: Any, target: str) -> str | None:
    inputs = {s.name for s in ep.signature.inputs_of(InputKind.USER_INPUT)}
    if target not in inputs:
        return f"mutates {target!r}, which is not a user input placeholder"
    placeholder = next(n for n in ep.graph.find_nodes(op="placeholder") if n.name == target)
    return _same_metadata(_val(node), _val(placeholder)) if isinstance(_val(placeholder), torch.Tensor) else None


def _input_metadata_mutation(ep: Program, node: Any, target: str) -> str | None:
    """A user input's new view (`x.t_()`): its dtype, any shape (`resize_` changes it)."""
    inputs = {s.name for s in ep.signature.inputs_of(InputKind.USER_INPUT)}
    if target not in inputs:
        return f"changes the metadata of {target!r}, which is not a user input placeholder"
    value = _val(node)
    placeholder = _val(next(n for n in ep.graph.find_nodes(op="placeholder") if n.name == target))
    if not isinstance(value, torch.Tensor):
        return f"its value is {_describe(value)}, not a tensor"
    if isinstance(placeholder, torch.Tensor) and value.dtype != placeholder.dtype:
        return f"its value is {value.dtype}, its target {placeholder.dtype}"
    return None


def _parameter_gradient(ep: Program, node: Any, target: str) -> str | None:
    """A joint program's gradient of a parameter: the parameter's dtype and shape."""
    parameters = {s.target for s in ep.signature.inputs_of(InputKind.PARAMETER)}
    parameters |= {a for s in ep.signature.inputs_of(InputKind.PARAMETER) for a in s.aliases}
    if target not in parameters:
        return f"is the gradient of {target!r}, which is not a parameter of the program"
    stored = ep.state_dict.get(target)
    return _same_metadata(_val(node), stored) if stored is not None else None


def _input_gradient(ep: Program, node: Any, target: str) -> str | None:
    """A joint program's gradient of a user input: a tensor."""
    value = _val(node)
    return None if isinstance(value, torch.Tensor) else f"its value is {_describe(value)}, not a tensor"


#: What each output kind's node must be, by `OutputKind` name: a check returning why not.
OUTPUT_RULES: dict[str, Callable[[Any, Any, str], str | None]] = {
    "USER_OUTPUT": _user_output,
    "BUFFER_MUTATION": _state_mutation,
    "PARAMETER_MUTATION": _state_mutation,
    "USER_INPUT_MUTATION": _input_mutation,
    "USER_INPUT_METADATA_MUTATION": _input_metadata_mutation,
    "GRADIENT_TO_PARAMETER": _parameter_gradient,
    "GRADIENT_TO_USER_INPUT": _input_gradient,
}


def _signature_problems(ep: Program) -> Iterator[Problem]:
    """The signature, the graph and the state describe one program."""
    sig = ep.signature
    placeholders = list(ep.graph.find_nodes(op="placeholder"))
    if [n.name for n in placeholders] != [s.name for s in sig.inputs]:
        yield Problem("signature inputs", f"placeholders {[n.name for n in placeholders]} differ from the signature's inputs {[s.name for s in sig.inputs]}")
    state = {s.target for s in sig.inputs_of(InputKind.PARAMETER, InputKind.BUFFER)}
    constants = {s.target for s in sig.inputs_of(InputKind.CONSTANT_TENSOR)}
    if set(ep.state_dict) != state or set(ep.constants) != constants:
        yield Problem("signature inputs", "the stored tensors differ from the signature's parameters, buffers and constants")
    stored = {**ep.state_dict, **ep.constants}
    resized = resized_targets(ep.graph_module, sig)
    for node, spec in zip(placeholders, sig.inputs):
        if spec.target in stored and spec.kind != InputKind.USER_INPUT and node.name == spec.name:
            part = part_of(stored[spec.target], spec.inner)
            why = _same_metadata(_val(node), part, resizable=spec.target in resized) if isinstance(part, torch.Tensor) else None
            if why:
                yield Problem(f"signature input {spec.name} ({spec.kind.name} {spec.target!r})", why)
    tensor_leaves = sum(leaf.width for leaf in sig.input_leaves)
    if sig.in_spec.num_leaves != len(sig.input_leaves) or tensor_leaves != len(sig.inputs_of(InputKind.USER_INPUT)):
        yield Problem("signature input_leaves", "the input spec, input leaves and user inputs disagree")
    yield from _outside_tree_problems(sig)
    yield from _state_order_problems(sig)
    yield from _training_flag_problems(sig)
    yield from _placement_problems(sig, stored)
    yield from subclass_problems(ep)
    yield from _output_problems(ep)


def _outside_tree_problems(sig: ExportSignature) -> Iterator[Problem]:
    """Each `outside_tree` path is an owner path some lifted state lies under (`helpers` for
    `helpers.0.weight`): `module()` makes a plain attribute there, nothing else."""
    names = state_names(sig.inputs)
    for path in sig.outside_tree:
        if not isinstance(path, str) or not any(fqn.startswith(f"{path}.") for fqn in names):
            shown = repr(path) if isinstance(path, str) else _describe(path)
            yield Problem("signature outside_tree", f"{shown} is not the path of a container holding lifted state")


def _state_order_problems(sig: ExportSignature) -> Iterator[Problem]:
    """`state_order` names each lifted state name at most once, and nothing else."""
    names = set(state_names(sig.inputs))
    order = sig.state_order
    if len(set(order)) != len(order) or not set(order) <= names:
        stray = sorted(set(order) - names)
        yield Problem("signature state_order", f"names {stray[0]!r}, which is no lifted state" if stray else "names a state twice")


def _training_flag_problems(sig: ExportSignature) -> Iterator[Problem]:
    """`training_flags` (Note [One mode per program] in runtime/modes.py) is empty (a function
    export) or starts with the root module's flag (path ""), which `module()` gives every module
    no entry names and `.train()`/`.eval()` check a switch against, and names no path twice
    (which of two flags would hold?).  Export writes the root's, then each that differs from it."""
    paths = Counter(path for path, _ in sig.training_flags)
    if paths and sig.training_flags[0][0] != "":
        yield Problem("signature training_flags", f"starts with {_describe(sig.training_flags[0][0])}, not the root module's flag (path ''), "
                      "which export writes first")
    twice = next((path for path, count in paths.items() if count > 1), None)
    if twice is not None:
        yield Problem("signature training_flags", f"gives the flag of {_describe(twice)} twice")


def _placement_problems(sig: ExportSignature, stored: Any) -> Iterator[Problem]:
    """Each placement names a lifted state tensor once, and its local shape is that tensor's
    (a per-rank program's state is the rank's shard)."""
    names = set(state_names(sig.inputs))
    seen = set()
    for placement in sig.placements:
        where = f"signature placement {placement.target!r}"
        if placement.target not in names or placement.target in seen:
            yield Problem(where, "names no lifted state" if placement.target not in names else "is given twice")
        elif placement.target in stored and tuple(stored[placement.target].shape) != placement.local_shape:
            yield Problem(where, f"local shape {list(placement.local_shape)} differs from the stored tensor's {list(stored[placement.target].shape)}")
        seen.add(placement.target)


def _output_problems(ep: Program) -> Iterator[Problem]:
    sig, output = ep.signature, ep.graph.output_node()
    values = output.args[0] if output.args else None
    if not isinstance(values, (tuple, list)) or len(values) != len(sig.outputs):
        yield Problem("signature outputs", f"the graph returns {_describe(values)}, the signature {len(sig.outputs)} outputs")
        return
    user_outputs = 0
    for i, (value, spec) in enumerate(zip(values, sig.outputs)):
        where = f"graph output {i} ({spec.kind.name} {spec.target!r})"
        user_outputs += spec.kind not in MUTATION_KINDS  # a leaf of the result (a joint's gradients too)
        rule = OUTPUT_RULES.get(spec.kind.name)
        if not isinstance(value, fx.Node):
            yield Problem(where, f"is {_describe(value)}, not a node: the signature says it is computed")
        elif value.name != spec.name:
            yield Problem(where, f"returns node {value.name}, the signature names {spec.name}")
        elif rule is None:
            yield Problem(where, f"no rule checks output kind {spec.kind.name}; add one to OUTPUT_RULES in predispatch/serialize/verify.py")
        elif spec.inner and spec.kind.name in _PART_OUTPUT_KINDS:  # a part of a subclass: its own tensor
            yield from (Problem(where, why) for why in _part_output_problems(ep, value, spec))
        elif (why := rule(ep, value, spec.target)) is not None:
            yield Problem(where, why)
    if sig.out_spec.num_leaves != len(sig.output_leaves) or sum(leaf.width for leaf in sig.output_leaves) != user_outputs:
        yield Problem("signature output_leaves", "the output spec, output leaves and user outputs disagree")


# --------------------------------------------------------------------------- tensor subclasses


#: Output kinds whose check reads the stored tensor they stand for: for a part of a subclass,
#: the part (`_part_output_problems`).
_PART_OUTPUT_KINDS = frozenset({"BUFFER_MUTATION", "PARAMETER_MUTATION", "GRADIENT_TO_PARAMETER"})


def subclass_problems(ep: Program) -> Iterator[Problem]:
    """The tensor subclasses of the program fit together (Note [Tensor subclasses] in
    frontend/subclasses.py; Note [Tensor subclasses in files] in serialize/subclasses.py): each
    layout is one `module()` can take apart and build, each subclass state target's parts are
    its inputs with `inner`, in `paths()` order, one after another, and stored; each subclass
    leaf's inputs or outputs are its parts, in order.  Without this a crafted file loads and
    fails at its first call (or builds a subclass from the wrong tensors)."""
    sig = ep.signature
    layouts: dict[str, SubclassLayout] = {}
    for target, layout in sig.subclass_state:
        where = f"signature subclass_state[{target!r}]"
        if target in layouts:
            yield Problem(where, "is given twice")
        layouts[target] = layout
        yield from (Problem(where, why) for why in _layout_problems(layout))
        yield from (Problem(where, why) for why in _subclass_state_problems(ep, target, layout))
    for spec in sig.inputs:
        if spec.inner and spec.kind is not InputKind.USER_INPUT and spec.target not in layouts:
            yield Problem(f"signature input {spec.name}", f"is part {spec.inner!r} of {spec.target!r}, which subclass_state does not list")
    for group, tensors in (("state_dict", ep.state_dict), ("constants", ep.constants)):
        for name, tensor in tensors.items():
            if name not in layouts and (isinstance(tensor, StoredParts) or _is_subclass_tensor(tensor)):
                yield Problem(f"{group}[{name!r}]", "is a tensor subclass, which subclass_state does not list")
    user_outputs = [s for s in sig.outputs if s.kind not in MUTATION_KINDS]
    for kind, leaves, specs in (("input", sig.input_leaves, sig.inputs_of(InputKind.USER_INPUT)), ("output", sig.output_leaves, user_outputs)):
        yield from _leaf_part_problems(kind, leaves, specs)


def _layout_problems(layout: SubclassLayout, depth: int = 0) -> Iterator[str]:
    """A layout `module()` can take apart and build: a traceable wrapper subclass (a file's
    class read for display only is its name), attribute names that are distinct identifiers,
    as many strides as sizes; nested layouts alike."""
    if displayed_name(layout.cls) is None and not is_tensor_subclass(layout.cls):
        yield (f"its class {getattr(layout.cls, '__qualname__', layout.cls)!s} is not a tensor subclass with "
               "__tensor_flatten__ and __tensor_unflatten__, so module() could not take it apart or build it")
    names = [name for name, _ in layout.inner]
    if not names or len(set(names)) != len(names) or not all(isinstance(n, str) and n.isidentifier() for n in names):
        yield f"its attribute names {names} are not distinct identifiers"
    if len(layout.size) != len(layout.stride):
        yield f"its size {list(layout.size)} and stride {list(layout.stride)} differ in length"
    for name, sub in layout.inner:
        if sub is not None:
            yield from (f"its part {name!r}: {why}" for why in _layout_problems(sub, depth + 1))


def _subclass_state_problems(ep: Program, target: str, layout: SubclassLayout) -> Iterator[str]:
    """The inputs of one subclass state tensor are its parts in order, one tensor's (one kind,
    the same aliases), and the stored tensor is that subclass or has exactly those parts."""
    specs = [(i, s) for i, s in enumerate(ep.signature.inputs) if s.kind is not InputKind.USER_INPUT and s.target == target]
    paths = list(layout.paths())
    if not specs:
        yield "names no lifted state of the program"
        return
    if [s.inner for _, s in specs] != paths:
        yield f"its parts {paths} are not the inner paths of the inputs whose target it is ({[s.inner for _, s in specs]})"
        return
    if [i for i, _ in specs] != list(range(specs[0][0], specs[0][0] + len(specs))):
        yield "its parts' inputs are not one after another"
    if len({(s.kind, s.aliases, s.persistent) for _, s in specs}) != 1:
        yield "its parts' inputs differ in kind, aliases or persistence"
    group = ep.constants if specs[0][1].kind is InputKind.CONSTANT_TENSOR else ep.state_dict
    stored = group.get(target)
    if isinstance(stored, StoredParts):
        missing, extra = sorted(set(paths) - set(stored.parts)), sorted(set(stored.parts) - set(paths))
        if missing or extra:
            yield f"the file stores the parts {sorted(stored.parts)}, its layout has {paths}"
    elif isinstance(stored, torch.Tensor) and (why := layout.mismatch(stored)) is not None:
        yield f"the stored tensor is {why}"


def _leaf_part_problems(kind: str, leaves: tuple, specs: list) -> Iterator[Problem]:
    """Each tensor leaf's inputs (or outputs) in order: a plain tensor's one without `inner`, a
    subclass's one per part, their `inner` its layout's paths.  Counts that differ are
    reported by the checks of the leaves (`_signature_problems`, `_output_problems`)."""
    if sum(leaf.width for leaf in leaves) != len(specs):
        return
    position = 0
    for leaf in leaves:
        if leaf.layout is not None:
            where = f"signature {kind} {leaf.path}"
            yield from (Problem(where, why) for why in _layout_problems(leaf.layout))
        inner = [s.inner for s in specs[position : position + leaf.width]]
        expected = list(leaf.layout.paths()) if leaf.layout is not None else [""] * leaf.width
        if inner != expected:
            yield Problem(f"signature {kind} {leaf.path}", f"its graph {kind}s are the parts {inner}, its layout's {expected}")
        position += leaf.width


def _part_output_problems(ep: Program, node: Any, spec: OutputSpec) -> Iterator[str]:
    """A mutation or gradient of one part of a subclass state tensor: its part's dtype and shape."""
    layouts = dict(ep.signature.subclass_state)
    owner = spec.target
    if spec.kind is OutputKind.GRADIENT_TO_PARAMETER:  # named by any of the parameter's names
        owner = next((s.target for s in ep.signature.inputs_of(InputKind.PARAMETER) if spec.target in s.names), spec.target)
    if owner not in layouts or spec.inner not in layouts[owner].paths():
        yield f"is part {spec.inner!r} of {spec.target!r}, which is no part of a tensor subclass of the program's state"
        return
    part = part_of({**ep.state_dict, **ep.constants}.get(owner), spec.inner)
    if isinstance(part, torch.Tensor) and (why := _same_metadata(_val(node), part)) is not None:
        yield why


def _whole_specs(inputs: tuple[InputSpec, ...]) -> tuple[InputSpec, ...]:
    """One spec per lifted tensor: a subclass's parts share its names (its first part stands for it)."""
    firsts: dict[Any, InputSpec] = {}
    for i, s in enumerate(inputs):
        firsts.setdefault(s.target if s.inner and s.kind is not InputKind.USER_INPUT else i, s)
    return tuple(firsts.values())


def _is_subclass_tensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, nn.Parameter)


def _stored_tensors(tensors: Any, sig: ExportSignature) -> Iterator[tuple[str, Any]]:
    """Each stored tensor by name, a subclass tensor's parts by `target:path` (a file's names):
    what a file holds, each checked as plain state is."""
    layouts = dict(sig.subclass_state)
    for name, tensor in tensors.items():
        if isinstance(tensor, StoredParts):
            yield from ((f"{name}{SEPARATOR}{path}", part) for path, part in tensor.parts.items())
        elif name in layouts and _is_subclass_tensor(tensor) and layouts[name].mismatch(tensor) is None:
            yield from ((f"{name}{SEPARATOR}{path}", part) for path, part in zip(layouts[name].paths(), layouts[name].flatten(tensor)))
        else:
            yield name, tensor


# Note [A file that changes its caller's grad mode]
# -------------------------------------------------
# A forward that calls `torch.set_grad_enabled(False)` and never undoes it leaves grad mode
# off for its caller, and so does its program (`grad_mode_on_exit`, applied by `module()` after
# the graph ran, runtime/unlift.py): the caller's next `backward()` fails.  In a file that flag
# is one bit of the signature, so a plain linear program could switch its caller's grad mode at
# every call.  The graph tells a region left open from one closed only by that flag, so no check
# can prove it; what it can check is that the graph is one export writes for it: the switch
# opens a grad-mode region that runs to the end of forward, so the graph's last computation
# runs in that mode, inside a `wrap_with_set_grad_enabled(mode, ...)` at the top level or in
# the trailing region of such a region (a region opened inside another, or inside an autocast
# region).  A stored program claims the flag only with such a graph: a file can leave its
# caller in the mode its own last computation ran in, as the program it holds would, and
# `predispatch show` prints it ("Leaves grad mode disabled for the caller").  A forward that
# switches grad mode with nothing computed after the switch writes no such region: `save`
# refuses it by name (undo the switch, or compute under it).


def _grad_mode_on_exit_problems(ep: Program) -> Iterator[Problem]:
    """A stored program leaves grad mode changed for its caller only as its graph ends (Note [A
    file that changes its caller's grad mode])."""
    mode = ep.signature.grad_mode_on_exit
    if mode is None or mode in _trailing_grad_modes(ep.graph_module):
        return
    state = "enabled" if mode else "disabled"
    yield Problem(
        "signature grad_mode_on_exit",
        f"the program would leave grad mode {state} for its caller, but its graph's last computation does not run in a "
        f"wrap_with_set_grad_enabled({mode}, ...) region, which export writes for a forward that calls "
        f"torch.set_grad_enabled({mode}) and never undoes it (Note [A file that changes its caller's grad mode] in "
        "predispatch/serialize/verify.py); a forward that switches grad mode and computes nothing after: undo the switch",
    )


def _trailing_grad_modes(gm: fx.GraphModule) -> set[bool]:
    """The grad modes of the regions the graph's last computation runs in: the top level's last
    call (past its `getitem`s) when it is a region, the last call of that region's body, ..."""
    modes: set[bool] = set()
    module: Any = gm
    for _ in range(MAX_SUBGRAPH_DEPTH + 1):  # bounded as subgraphs nest
        last = next((n for n in reversed(module.graph.nodes) if n.op == "call_function" and n.target is not operator.getitem), None)
        name = last.target.name() if last is not None and isinstance(last.target, torch._ops.HigherOrderOperator) else None
        body_at = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}.get(name or "")
        if last is None or body_at is None or len(last.args) <= body_at:
            break
        if name == "wrap_with_set_grad_enabled" and type(last.args[0]) is bool:
            modes.add(last.args[0])
        body = last.args[body_at]
        module = _held(module, body.target) if _is_subgraph(body, module) else None
        if module is None:
            break
    return modes


#: Root attribute names `ep.module()` gives its own objects (unlift.py, runner.py): a state
#: or subgraph of the file must not take them.
_BUILDER_PREFIXES = ("_constant_", "_lifted_", "_live_root", "_state_dict_owner")


def _name_problems(ep: Program) -> Iterator[Problem]:
    """Every name `ep.module()` compiles or installs is safe there (Note [Names that reach
    code] in names.py): keyword names, state names, and no two things at one attribute."""
    sig = ep.signature
    for why in naming.call_spec_problems(sig.in_spec, sig.arg_names):
        yield Problem("signature in_spec", why)
    fqns = state_names(_whole_specs(sig.inputs))
    for fqn in fqns:
        for why in naming.state_name_problems(fqn):
            yield Problem("signature inputs", why)
    yield from _collision_problems(ep, fqns)


def _collision_problems(ep: Program, fqns: tuple[str, ...]) -> Iterator[Problem]:
    """No state is named twice or lies under another state (`a` and `a.b`), and no state's
    first part is a subgraph's or graph tensor's name or one the builder uses itself."""
    where = "signature inputs"
    if len(set(fqns)) != len(fqns):
        yield Problem(where, f"a state name appears twice: {sorted(n for n in set(fqns) if fqns.count(n) > 1)[:3]}")
    paths = set(fqns)
    for fqn in fqns:
        parts = fqn.split(".") if isinstance(fqn, str) else []
        owners = [".".join(parts[:i]) for i in range(1, len(parts))]
        if any(owner in paths for owner in owners):
            yield Problem(where, f"state {fqn!r} lies under another state of the program")
    held = {*ep.graph_module._modules, *ep.graph_module._parameters, *ep.graph_module._buffers}
    for head in {fqn.split(".")[0] for fqn in fqns if isinstance(fqn, str)}:
        if head in held or head.startswith(_BUILDER_PREFIXES):
            yield Problem(where, f"state {head!r} takes a name ep.module() gives a subgraph or graph tensor")


def program_problems(ep: Program, *, op_namespaces: tuple[str, ...] = (), stored: bool = False) -> list[Problem]:
    """Every way `ep` breaks the IR contract ([] for a good program).

    `op_namespaces`: further op namespaces whose functional ops are allowed (custom ops the
    caller trusts).  `stored`: also check what a file may hold (see the module docstring).
    """
    problems = graph_problems(ep.graph_module, op_namespaces=op_namespaces, stored=stored)
    problems += list(_signature_problems(ep))
    if stored:
        problems += list(_name_problems(ep))
        problems += list(_grad_mode_on_exit_problems(ep))
        for group, tensors in (("state_dict", ep.state_dict), ("constants", ep.constants)):
            problems += [Problem(f"{group}[{name!r}]", why) for name, t in _stored_tensors(tensors, ep.signature) for why in stored_tensor_problems(t)]
    return problems


def verify_program(
    ep: Program, *, op_namespaces: tuple[str, ...] = (), stored: bool = False,
    error: type[Exception] = SerializationError, context: str = "",
) -> None:
    """Raise `error` naming the first problems of `ep`, if any (see `program_problems`)."""
    problems = program_problems(ep, op_namespaces=op_namespaces, stored=stored)
    if problems:
        shown = "; ".join(map(str, problems[:3]))
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise error(f"{context}{shown}{more}.")


def custom_namespaces(gm: fx.GraphModule) -> tuple[str, ...]:
    """Op namespaces outside the allow list's that `gm` (or a subgraph) calls: the user's own
    custom ops, which export keeps and `load` accepts only when the caller names them."""
    from predispatch.serialize.op_allowlist import NAMESPACES

    found = {
        node.target.namespace
        for module in gm.modules() if isinstance(module, fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.namespace not in NAMESPACES
    }
    return tuple(sorted(found))


def verifying(export: Callable[..., Program], tolerate: Callable[[Problem], bool] = lambda p: False) -> Callable[..., Program]:
    """`export` that checks every program it returns against the contract `load` checks.

    The test suite wraps `predispatch.export` with it (tests/conftest.py), so that export and
    load cannot drift apart.  Only the outermost call is checked (a nested export's program is
    inlined into its caller's); the user's custom ops are allowed, as export allows them.
    It lives in the package so that its frame is never taken for the user's code in an error.
    `tolerate`: problems a known, tracked bug still causes (each with its issue).
    """
    from predispatch.errors import NonFunctionalGraphError

    depth = [0]

    def export_and_verify(*args: Any, **kwargs: Any) -> Program:
        depth[0] += 1
        try:
            ep = export(*args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            problems = [p for p in program_problems(ep, op_namespaces=custom_namespaces(ep.graph_module)) if not tolerate(p)]
            if problems:
                raise NonFunctionalGraphError(
                    "the exported program breaks the IR contract that load checks: " + "; ".join(map(str, problems)),
                    fix="a predispatch bug: report it with the model.",
                )
        return ep

    return export_and_verify
