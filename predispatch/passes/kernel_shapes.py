"""Backward kernels that trust their arguments' shapes, checked before each call.

Note [Kernels that trust their arguments' shapes]
-------------------------------------------------
A backward kernel also takes the gradient of its forward's output and values its forward saved,
and some read them as if they had the shape of another argument without checking
(`SHAPE_RULES`): `native_layer_norm_backward` given a one-element `grad_out` reads past it for
every element of its input.  Unlike a saved statistic (serialize/kernel_inputs.py's
`FORWARD_PROOFS`), a gradient comes from whatever the backward computed before, so no
graph-local proof exists; `ep.module()` checks each such argument's shape before each call
(`shape_problem`, the `check_kernel_shapes` node `guard_kernel_shapes` puts before it) and
raises `SerializationError` instead of running it.  `to_torch()` keeps the check in torch's
own terms (`pin_kernel_shapes`): the kernel reads each such argument through an `aten.view` of
the shape it must have, which raises unless the element count matches, sized by literals or
`sym_size.int` nodes, as torch.export writes sizes.

They were found by running every allowed backward kernel autograd calls on torch's OpInfo
samples with each tensor argument shrunk to one element and grown to twice its sizes, and each
int list shrunk to ones and grown, one argument at a time, each in a forked child process
(serialize/kernel_inputs.py's `probe_arguments`, `python -m predispatch.serialize.kernel_inputs
--probe`): an argument a kernel takes without raising or broadcasting is checked here, proved
from its forward, refused in files, or listed in `SHAPE_SAFE` with why its reads stay inside
the tensors the kernel is given.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from predispatch.errors import SerializationError

__all__ = [
    "SHAPE_RULES", "SHAPE_SAFE", "ShapeRule", "Shapes", "packet_of", "pin_kernel_shapes", "shape_problem", "trusts_shapes",
]


@dataclass(frozen=True)
class ShapeRule:
    """An argument a kernel reads as having a shape it does not check.

    argument: the argument's name.
    expected: the shape it must have, from a `Shapes` view of the call's arguments (the same
        function builds the run-time check and, on graph values, `to_torch()`'s).
    reads: the other arguments `expected` reads (an argument the rule pins is decided too).
    reason: what the kernel reads.
    """

    argument: str
    expected: Callable[[Shapes], list]
    reads: tuple[str, ...]
    reason: str


class Shapes:
    """A call's arguments as a rule reads them: real values at run time (`ep.module()`)."""

    def __init__(self, bound: dict):
        self.bound = bound

    def size(self, name: str, start: int = 0, stop: int | None = None) -> list:
        """Sizes `start:stop` of tensor argument `name`."""
        return list(self.bound[name].shape)[start:stop]

    def __getitem__(self, name: str) -> Any:
        return self.bound[name]


def _like(*pieces: tuple[str, int, int | None]) -> Callable[[Shapes], list]:
    """The concatenation of pieces `(argument, start, stop)` of other arguments' shapes."""
    return lambda shapes: [n for name, start, stop in pieces for n in shapes.size(name, start, stop)]


def _pairs(shapes: Shapes) -> list:
    """pdist's output: one distance per pair of self's rows."""
    rows = shapes.size("self", 0, 1)[0]
    return [rows * (rows - 1) // 2]


def _unfold_windows(shapes: Shapes) -> list:
    """unfold's output: dim replaced by its window count, the window appended."""
    sizes, dim, size, step = list(shapes["input_sizes"]), shapes["dim"], shapes["size"], shapes["step"]
    dim = dim + len(sizes) if dim < 0 else dim
    return [*sizes[:dim], (sizes[dim] - size) // step + 1, *sizes[dim + 1:], size]


_EVERY = "reads {} for every element of {}"
#: `_cdist_backward`'s and `_pdist_backward`'s gradients, their first arguments: `grad` until
#: torch 2.14, `grad_output` from 2.15 (read from the schema).
_CDIST_GRAD = torch.ops.aten._cdist_backward.default._schema.arguments[0].name
_PDIST_GRAD = torch.ops.aten._pdist_backward.default._schema.arguments[0].name
_GRID = "reads grad_output for every sampled point of every channel"
_ADAPTIVE = "walks self's batch and channels and reads grad_output and writes its result for each"
_CDIST = "reads {} for every pair of x1's and x2's rows"

#: Kernels given arguments whose shapes they do not check (Note [Kernels that trust their
#: arguments' shapes]), by packet.
SHAPE_RULES: Mapping[str, tuple[ShapeRule, ...]] = {
    "aten.native_layer_norm_backward": (ShapeRule("grad_out", _like(("input", 0, None)), ("input",), _EVERY.format("grad_out", "input")),),
    "aten.native_batch_norm_backward": (ShapeRule("grad_out", _like(("input", 0, None)), ("input",), _EVERY.format("grad_out", "input")),),
    "aten._scaled_dot_product_flash_attention_for_cpu_backward": (
        ShapeRule("grad_out", _like(("out", 0, None)), ("out",), _EVERY.format("grad_out", "out")),),
    "aten.grid_sampler_2d_backward": (ShapeRule("grad_output", _like(("input", 0, 2), ("grid", 1, -1)), ("input", "grid"), _GRID),),
    "aten.grid_sampler_3d_backward": (ShapeRule("grad_output", _like(("input", 0, 2), ("grid", 1, -1)), ("input", "grid"), _GRID),),
    "aten._ctc_loss_backward": (
        ShapeRule("grad", _like(("neg_log_likelihood", 0, None)), ("neg_log_likelihood",), "reads grad for every sample of the batch"),),
    "aten._log_softmax_backward_data": (
        ShapeRule("output", _like(("grad_output", 0, None)), ("grad_output",), _EVERY.format("output", "grad_output")),),
    "aten._cdist_backward": (
        ShapeRule(_CDIST_GRAD, _like(("x1", 0, -1), ("x2", -2, -1)), ("x1", "x2"), _CDIST.format(_CDIST_GRAD)),
        ShapeRule("cdist", _like(("x1", 0, -1), ("x2", -2, -1)), ("x1", "x2"), _CDIST.format("cdist")),
    ),
    "aten._pdist_backward": (
        ShapeRule(_PDIST_GRAD, _pairs, ("self",), f"reads {_PDIST_GRAD} for every pair of self's rows"),
        ShapeRule("pdist", _pairs, ("self",), "reads pdist for every pair of self's rows"),
    ),
    "aten._adaptive_avg_pool2d_backward": (
        ShapeRule("grad_output", _like(("self", 0, -2), ("grad_output", -2, None)), ("self",), _ADAPTIVE),),
    "aten._adaptive_avg_pool3d_backward": (
        ShapeRule("grad_output", _like(("self", 0, -3), ("grad_output", -3, None)), ("self",), _ADAPTIVE),),
    "aten.unfold_backward": (
        ShapeRule("grad_in", _unfold_windows, ("input_sizes",), "reads grad_in for every window input_sizes, dim, size and step make"),),
}

_ELEMENTWISE = "an elementwise TensorIterator kernel: operands broadcast or raise; {} only scales the result"

#: (packet, argument)s the probe finds accepting another shape, whose reads still stay inside
#: the tensors the kernel is given, with why.
SHAPE_SAFE: Mapping[tuple[str, str], str] = {
    ("aten._log_softmax_backward_data", "grad_output"): "walks grad_output's own shape (its result has it); output is checked to have it",
    ("aten.embedding_dense_backward", "grad_output"): "views grad_output as (indices, -1): a size that does not divide raises, the row width follows grad",
    ("aten.mse_loss_backward", "self"): _ELEMENTWISE.format("the mean's element count"),
    ("aten.smooth_l1_loss_backward", "self"): _ELEMENTWISE.format("the mean's element count"),
    ("aten.soft_margin_loss_backward", "self"): _ELEMENTWISE.format("the mean's element count"),
    ("aten.rrelu_with_noise_backward", "self"): "composite: elementwise ops (leaky_relu_backward, mul) that broadcast or raise",
    ("aten.masked_scatter_backward", "sizes"): "composite: masked_select of grad, zero-padded and viewed as sizes by checked ops",
    ("aten.avg_pool2d_backward", "kernel_size"): ("grad_output's shape is checked against the output size these sizes give, "
                                                  "each window clipped to the input"),
}


def trusts_shapes(target: Any) -> bool:
    """Whether `target` is a call of a `SHAPE_RULES` kernel (checked before each call)."""
    return packet_of(target) in SHAPE_RULES


def shape_problem(target: Any, args: tuple, kwargs: dict) -> str | None:
    """Why a call of `target` (a `SHAPE_RULES` kernel) must not run on these arguments, or None."""
    bound = _bound_values(target, args, kwargs)
    shapes = Shapes(bound)
    for rule in SHAPE_RULES.get(packet_of(target) or "", ()):
        value = _argument(target, rule, bound)
        if value is None:
            continue
        expected = tuple(rule.expected(shapes))
        if tuple(value.shape) != expected:
            return (f"{target} is given {rule.argument} of shape {tuple(value.shape)} where it must have shape "
                    f"{expected}: the kernel {rule.reason} without checking")
    return None


def _argument(target: Any, rule: ShapeRule, bound: dict) -> Any:
    """The value of the argument `rule` checks; a rule naming no argument of this torch's
    schema raises (the table is out of date: a check must never be skipped silently)."""
    if rule.argument not in bound:
        raise RuntimeError(f"SHAPE_RULES checks {rule.argument} of {target}, whose schema has no such argument: {target._schema}")
    return bound[rule.argument]


def _bound_values(target: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """A call's arguments by schema name, defaults filled in."""
    values = {a.name: a.default_value for a in target._schema.arguments if a.has_default_value()}
    values.update(zip((a.name for a in target._schema.arguments), args))
    values.update(kwargs)
    return values


def packet_of(target: Any) -> str | None:
    """`aten.native_layer_norm_backward` for any of its overloads; None for a non-op target."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    namespace, name = target._schema.name.split("::")
    return f"{namespace}.{name}"




def pin_kernel_shapes(graph: fx.Graph) -> int:
    """Before each call of a `SHAPE_RULES` kernel in `graph` (torch's ExportedProgram graph,
    `to_torch()`), its arguments as torch's own `aten.view`s of the shapes they must have: each
    argument a rule's shape comes from viewed as the shape its node meta gives (a file's meta
    may lie), then each checked argument viewed as the rule's shape.  `view` raises unless the
    element count matches, so the kernel only ever gets arguments of the shapes it reads; an
    honest program's arguments already have them (the views change no value).  Static sizes
    are literals, symbolic ones `sym_size.int` nodes and `operator` arithmetic, as torch.export
    writes them: torch's verifier, `run_decompositions` and `torch.export.save` keep them.
    (torch's `_assert_tensor_metadata` cannot: its fake kernel compares a `torch.Size` with the
    list it is given and refuses every size; and an unused check node of int-valued
    `sym_size`s does not serialize.)  Returns how many kernel calls it guarded."""
    guarded = 0
    for node in list(graph.nodes):
        if not (node.op == "call_function" and trusts_shapes(node.target)):
            continue
        shapes, before = _GraphShapes(graph, node), node.prev
        with graph.inserting_before(node):
            for rule in SHAPE_RULES[packet_of(node.target)]:
                if isinstance(_argument(node.target, rule, shapes.bound), fx.Node):
                    shapes.pin(rule.argument, [_node_of(n) for n in rule.expected(shapes)])
        _fill_values(before, node)
        guarded += 1
    return guarded


class _GraphShapes(Shapes):
    """A kernel call's arguments as graph values (`to_torch()`): a size is the int its node meta
    gives, or an FX proxy of its `sym_size.int` node when symbolic, so a rule's arithmetic
    becomes `operator` nodes; each argument read is first pinned to its meta's shape."""

    def __init__(self, graph: fx.Graph, kernel: fx.Node):
        super().__init__(_bound_values(kernel.target, kernel.args, dict(kernel.kwargs)))
        self.graph, self.kernel, self.tracer = graph, kernel, fx.proxy.GraphAppendingTracer(graph)
        self.sizes: dict[str, list] = {}

    def size(self, name: str, start: int = 0, stop: int | None = None) -> list:
        if name not in self.sizes:
            tensor = self.bound[name]
            value = tensor.meta.get("val") if isinstance(tensor, fx.Node) else None
            shape = value.shape if isinstance(value, torch.Tensor) else ()  # none: `pin` refuses it
            sizes = [n if type(n) is int else _call(self.graph, torch.ops.aten.sym_size.int, tensor, d) for d, n in enumerate(shape)]
            self.pin(name, sizes)
            self.sizes[name] = [fx.Proxy(n, self.tracer) if isinstance(n, fx.Node) else n for n in sizes]
        return self.sizes[name][start:stop]

    def __getitem__(self, name: str) -> Any:
        value = self.bound[name]
        if isinstance(value, (list, tuple)):
            return [fx.Proxy(v, self.tracer) if isinstance(v, fx.Node) else v for v in value]
        return fx.Proxy(value, self.tracer) if isinstance(value, fx.Node) else value

    def pin(self, name: str, sizes: list) -> None:
        """The kernel reads argument `name` through `aten.view(name, sizes)`."""
        argument = self.bound[name]
        value = argument.meta.get("val")
        if not isinstance(value, torch.Tensor):
            raise SerializationError(f"{self.kernel.name}'s {name} has no tensor value in its node meta: "
                                     "its shape cannot be checked", fix="convert programs export or load made")
        view = _call(self.graph, torch.ops.aten.view.default, argument, sizes)
        try:
            view.meta["val"] = value.view([n.meta["val"] if isinstance(n, fx.Node) else n for n in sizes])
        except RuntimeError as exc:  # the program's own meta says the kernel would read outside it
            raise SerializationError(
                f"refused to convert a kernel call: {self.kernel.target} ({self.kernel.name}) is given {name} of shape "
                f"{tuple(value.shape)}, which it would read as {[getattr(n, 'name', n) for n in sizes]} ({exc}). Only an "
                "edited file holds such a program; eager autograd never runs one.",
                fix="load programs only from files predispatch.save wrote; this one was edited (see docs/format.md#threat-model).",
            ) from None
        self.kernel.replace_input_with(argument, view)
        self.bound = _bound_values(self.kernel.target, self.kernel.args, dict(self.kernel.kwargs))


def _node_of(value: Any) -> Any:
    return value.node if isinstance(value, fx.Proxy) else value


def _fill_values(before: fx.Node, kernel: fx.Node) -> None:
    """Node meta values for the `operator` nodes a rule's arithmetic made through proxies
    (between `before` and `kernel`, where `pin_kernel_shapes` put its nodes)."""
    node = before
    while node.next is not kernel:
        node = node.next
        if node.op == "call_function" and "val" not in node.meta and node.target in _ARITHMETIC:
            values = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
            node.meta["val"] = None if any(v is None for v in values) else node.target(*values)


_ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.floordiv)


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    """A call node with the value its node meta would hold (torch's verifier and passes read it)."""
    node = graph.call_function(target, args)
    if target is torch.ops.aten.sym_size.int:
        node.meta["val"] = args[0].meta["val"].shape[args[1]]
    return node
