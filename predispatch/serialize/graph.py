"""Graph modules as data: nodes with qualified op names, subgraphs nested, meta kept as data.

    {"class_name": "GraphModule",
     "nodes": [{"op": "placeholder", "name": "x", "target": "x", "meta": {"val": {"tensor": ...}}},
               {"op": "get_attr", "name": "grad_region_0", "target": "grad_region_0"},
               {"op": "call_function", "name": "wrap_with_set_grad_enabled",
                "target": "higher_order.wrap_with_set_grad_enabled",
                "args": [false, {"node": "grad_region_0"}, {"node": "x"}]},
               {"op": "call_function", "name": "mul", "target": "_operator.getitem", ...},
               {"op": "output", "name": "output", "target": "output", "args": [{"tuple": [..]}]}],
     "tensors": [{"name": "_tensor_constant0", "persistent": true}],   (data in graph.safetensors)
     "submodules": [{"name": "grad_region_0", "module": {...}}]}

A target is resolved only against the tables below and torch's op registry: see Note [What
load trusts] in serialize.py.  A higher-order op's subgraphs are `get_attr` arguments like any
other, so supporting a new HOP is one entry in `HIGHER_ORDER_OPS`.
"""

from __future__ import annotations

import contextlib
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch import ops  # noqa: F401 - registers predispatch::keep_history, which graphs call
from predispatch.errors import SerializationError
from predispatch.runtime import names as naming
from predispatch.serialize.values import Refs, decode, encode, expect, short
from predispatch.serialize.verify import MAX_SUBGRAPH_DEPTH
from predispatch.trace.decompose import op_name


#: Op namespaces whose OpOverloads any file may call.
OP_NAMESPACES = ("aten", "prims", "predispatch")


#: Higher-order ops a graph may call, by `hop.name()`.  Supporting a new HOP is one entry:
#: its subgraphs are ordinary `get_attr` arguments and its other arguments plain values.
HIGHER_ORDER_OPS: dict[str, Callable[[], torch._ops.HigherOrderOperator]] = {
    "wrap_with_set_grad_enabled": lambda: ti.wrap_with_set_grad_enabled,
    "wrap_with_autocast": lambda: ti.wrap_with_autocast,
    "autograd_function_apply": lambda: ti.autograd_function_apply,  # custom autograd.Functions
    "invoke_subgraph": lambda: ti.invoke_subgraph,  # shared bodies of repeated blocks
    # torch's control flow in the user's code
    "cond": lambda: torch.ops.higher_order.cond,
    "scan": lambda: torch.ops.higher_order.scan,
    "map_impl": lambda: torch.ops.higher_order.map_impl,
    "while_loop": lambda: torch.ops.higher_order.while_loop,  # see Note [Data-dependent storage offsets]
    # torch.nn.attention.flex_attention: score_mod and mask_mod subgraphs, the block mask's tensors
    "flex_attention": lambda: torch.ops.higher_order.flex_attention,
}


#: Plain Python callables a graph may call, by `module.name`.
PYTHON_CALLABLES: dict[str, Callable[..., Any]] = {
    "_operator.getitem": operator.getitem,
    # size arithmetic in dynamic-shape graphs (`y.size(0) * 2`): pure functions of ints
    **{f"_operator.{name}": getattr(operator, name) for name in ("add", "sub", "mul", "floordiv", "mod", "neg")},
    # comparisons of symbolic ints: a while_loop's condition on an int carry (`i < 3`)
    **{f"_operator.{name}": getattr(operator, name) for name in ("lt", "le", "gt", "ge", "eq", "ne")},
}

_NODE_OPS = ("placeholder", "get_attr", "call_function", "output")
#: Node meta kept besides "val": informational, kept when it is plain data, else left out.
_INFORMATIONAL_META = ("stack_trace", "nn_module_stack", "torch_fn")
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def _target_name(node: fx.Node, where: str) -> str:
    """The name a node's target is saved under; see Note [What load trusts]."""
    target = node.target
    if node.op != "call_function":
        return target
    if isinstance(target, torch._ops.OpOverload):
        return op_name(target)
    if isinstance(target, torch._ops.HigherOrderOperator) and target.name() in HIGHER_ORDER_OPS:
        if HIGHER_ORDER_OPS[target.name()]() is target:
            return f"higher_order.{target.name()}"
    for name, fn in PYTHON_CALLABLES.items():
        if target is fn:
            return name
    raise SerializationError(
        f"{where}: calls {short(target)}, which the file format cannot name: it holds OpOverloads, "
        f"the higher-order ops {sorted(HIGHER_ORDER_OPS)} and {sorted(PYTHON_CALLABLES)}.",
        fix="keep the program in memory, or save ep.to_torch() with torch.export.save if torch's format holds "
        "the op (a predispatch HOP missing here is our bug: report it).",
    )


def _resolve_target(name: Any, where: str, namespaces: tuple[str, ...]) -> Any:
    name = expect(name, str, where)
    if name in PYTHON_CALLABLES:
        return PYTHON_CALLABLES[name]
    parts = name.split(".")
    if len(parts) == 2 and parts[0] == "higher_order" and parts[1] in HIGHER_ORDER_OPS:
        return HIGHER_ORDER_OPS[parts[1]]()
    if len(parts) == 3 and parts[0] in namespaces and all(_IDENTIFIER.match(p) for p in parts) and _lookup_allowed(*parts):
        op = _lookup_op(*parts)
        if op is None:
            raise SerializationError(
                f"{where}: calls {name}, which this torch ({torch.__version__}) does not have.",
                fix="load with the torch release that saved the program (see manifest.json); "
                "for a custom op, import the library that defines it first.",
            )
        return op
    raise SerializationError(
        f"{where}: calls {short(name)}, which a program may not call. Allowed: OpOverloads in "
        f"namespaces {list(namespaces)}, higher-order ops {sorted(HIGHER_ORDER_OPS)}, and {sorted(PYTHON_CALLABLES)}.",
        fix="for custom ops of a library you trust, import it and pass load(..., op_namespaces=('mylib',)).",
    )


def _lookup_allowed(namespace: str, name: str, overload: str) -> bool:
    """Whether a name may be looked up on `torch.ops` at all.  A `__` name is looked up only
    when it is an op packet the allow list decides (`aten.__and__`, what `a & b` on tensors
    traces to): `getattr` of any other dunder on torch's namespaces reaches Python's own
    attributes (`aten.__class__`), not the op registry."""
    from predispatch.serialize.op_allowlist import is_known_packet

    if overload.startswith("__"):
        return False
    return not (namespace.startswith("__") or name.startswith("__")) or is_known_packet(f"{namespace}.{name}")


def _lookup_op(namespace: str, name: str, overload: str) -> torch._ops.OpOverload | None:
    """The registered overload, or None; reads torch's op registry only."""
    try:
        op = getattr(getattr(getattr(torch.ops, namespace), name), overload)
    except (AttributeError, RuntimeError):
        return None
    if isinstance(op, torch._ops.OpOverload) and op_name(op) == f"{namespace}.{name}.{overload}":
        return op
    return None


def _check_schema(op: torch._ops.OpOverload, args: tuple, kwargs: dict, where: str) -> None:
    """The saved call binds to this torch's schema of `op` (schemas change between releases)."""
    arguments = op._schema.arguments
    positional = [a.name for a in arguments if not a.kwarg_only]
    given = positional[: len(args)]
    problems = []
    if len(args) > len(positional):
        problems.append(f"{len(args)} positional arguments for {len(positional)}")
    problems += [f"unknown argument {k!r}" for k in kwargs if k not in {a.name for a in arguments}]
    problems += [f"{k!r} given twice" for k in kwargs if k in given]
    problems += [f"missing {a.name!r}" for a in arguments if a.name not in given and a.name not in kwargs and not a.has_default_value()]
    if problems:
        raise SerializationError(
            f"{where}: the saved call does not match this torch's schema {op._schema}: {'; '.join(problems)}.",
            fix="load with the torch release that saved the program (see manifest.json).",
        )


def _class_name(gm: fx.GraphModule) -> str:
    """The class name a module is saved under: its own, or `GraphModule` where that is no
    identifier (make_fx names a branch traced from a lambda, a `torch.cond` branch, `<lambda>`)."""
    name = type(gm).__name__
    return name if name.isidentifier() else "GraphModule"


def encode_module(gm: fx.GraphModule, path: str, tensors: dict[str, torch.Tensor]) -> dict:
    """A graph module and its subgraphs; the tensors it holds go to `tensors` by path."""
    where = f"graph module {path or '<root>'}"
    submodules = []
    for name, child in gm.named_children():
        if not isinstance(child, fx.GraphModule):
            raise SerializationError(f"{where}: submodule {name!r} is a {type(child).__name__}, not a GraphModule.")
        submodules.append({"name": name, "module": encode_module(child, f"{path}.{name}".lstrip("."), tensors)})
    held = []
    for name, tensor in (*gm._parameters.items(), *gm._buffers.items()):
        if tensor is None:
            continue
        held.append({"name": name, "persistent": name not in gm._non_persistent_buffers_set})
        tensors[f"{path}.{name}".lstrip(".")] = tensor
    for node in gm.graph.find_nodes(op="get_attr"):
        if not _holds(gm, node.target):
            raise SerializationError(f"{where}: get_attr {node.target!r} names neither a subgraph nor a tensor the module holds.")
    nodes = [_encode_node(node, f"{where}, node {node.name}") for node in gm.graph.nodes]
    return {"class_name": _class_name(gm), "nodes": nodes, "tensors": held, "submodules": submodules}


def _holds(module: nn.Module, target: str) -> bool:
    *path, last = target.split(".")
    for part in path:
        module = module._modules.get(part)
        if module is None:
            return False
    return last in module._modules or last in module._parameters or last in module._buffers


def _encode_node(node: fx.Node, where: str) -> dict:
    if node.op not in _NODE_OPS:
        raise SerializationError(f"{where}: a {node.op} node; programs hold only {list(_NODE_OPS)}.")
    record = {"op": node.op, "name": node.name, "target": _target_name(node, where)}
    if node.args:
        record["args"] = [encode(a, f"{where} args[{i}]") for i, a in enumerate(node.args)]
    if node.kwargs:
        record["kwargs"] = {k: encode(v, f"{where} kwargs[{k!r}]") for k, v in node.kwargs.items()}
    meta = _encode_meta(node.meta, where)
    if meta:
        record["meta"] = meta
    return record


def _encode_meta(meta: Mapping[str, Any], where: str) -> dict:
    encoded = {}
    if "val" in meta:
        encoded["val"] = encode(meta["val"], f"{where} meta['val']", tensors=True)
    for key in _INFORMATIONAL_META:
        if key in meta:
            with contextlib.suppress(SerializationError):  # kept only when it is plain text and data
                _check_text(meta[key], key)
                encoded[key] = encode(meta[key], key)
    return encoded


@dataclass(frozen=True)
class GraphLoading:
    """What decoding a program needs besides the JSON: ops allowed, the fake mode for node
    meta, and the tensors graph modules hold (by path)."""

    namespaces: tuple[str, ...]
    fake_mode: Any
    graph_tensors: Mapping[str, torch.Tensor]
    symbols: Any = None  # the program's SymbolTable: symbolic sizes in node meta (shapes.py)


def decode_program_module(data: Any, loading: GraphLoading) -> fx.GraphModule:
    """The root graph module and every subgraph, compiled once (Note [Load cost]); `data`, the
    graph's JSON, is dropped first when the caller holds no other reference (Note [Load memory]
    in archive.py)."""
    gm = decode_module(data, "", loading)
    del data
    gm.recompile()  # compiles every descendant too, each once
    return gm


def decode_module(data: Any, path: str, loading: GraphLoading) -> fx.GraphModule:
    """Subgraphs first, then the tensors held, then the graph; attributes in the saved order.

    Note [Load cost]
    ----------------
    FX's `recompile` recompiles every descendant graph module, so assigning `gm.graph` at each
    level (which recompiles) costs depth x size: a 100-deep file took 15 s.  Decoding attaches
    each graph without compiling it, and `decode_program_module` compiles the whole tree once;
    depth is bounded by `MAX_SUBGRAPH_DEPTH`.  Nothing runs the stale code in between: the
    verifier reads graphs, not code.
    """
    where = f"graph module {path or '<root>'}"
    if path and path.count(".") + 1 > MAX_SUBGRAPH_DEPTH:
        raise SerializationError(
            f"graph module {short(path)}: subgraphs nest more than {MAX_SUBGRAPH_DEPTH} deep; the file format reads at most that "
            "(programs export makes nest a few levels: regions, custom Functions, repeated blocks).",
            fix="save the program again; a file nesting this deep is damaged or crafted.",
        )
    data = expect(data, dict, where)
    class_name = expect(data.get("class_name"), str, where)
    check_identifier(class_name, where)
    gm = fx.GraphModule(nn.Module(), fx.Graph(), class_name=class_name)
    for entry in expect(data.get("submodules"), list, where):
        name = expect(expect(entry, dict, where).get("name"), str, where)
        check_attribute(name, where)
        gm.add_module(name, decode_module(entry.get("module"), f"{path}.{name}".lstrip("."), loading))
    for entry in expect(data.get("tensors"), list, where):
        _hold_tensor(gm, expect(entry, dict, where), path, loading, where)
    graph = _decode_graph(data.get("nodes"), gm, where, loading)
    gm._graph, graph.owning_module = graph, gm  # compiled by decode_program_module: Note [Load cost]
    return gm


def _hold_tensor(gm: fx.GraphModule, entry: dict, path: str, loading: GraphLoading, where: str) -> None:
    name = expect(entry.get("name"), str, where)
    check_attribute(name, where)
    tensor = loading.graph_tensors.get(f"{path}.{name}".lstrip("."))
    if tensor is None:
        raise SerializationError(f"{where}: tensor {name!r} is not in graph.safetensors.")
    if isinstance(tensor, nn.Parameter):
        gm.register_parameter(name, tensor)
    else:
        gm.register_buffer(name, tensor, persistent=expect(entry.get("persistent"), bool, where))


def check_identifier(name: str, where: str) -> None:
    """A name FX pastes into code: an identifier, not a keyword, not Python's own `__x`
    (Note [Names that reach code] in names.py)."""
    why = naming.identifier_problem(name) if _IDENTIFIER.match(name) else f"{short(name)} is not an identifier"
    if why is None and name.startswith("__"):
        why = f"{name!r} starts with '__'"
    if why:
        raise SerializationError(f"{where}: {short(name)} is not a valid name ({why}).")


def check_attribute(name: str, where: str) -> None:
    """A subgraph or graph tensor name: also never an attribute a graph module has of its own
    (`forward`, `training`, `graph`), which installing it would replace."""
    check_identifier(name, where)
    why = naming.attribute_problem(name, root=True)
    if why:
        raise SerializationError(f"{where}: {short(name)} is not a valid attribute name ({why}).")


def _decode_graph(records: Any, gm: fx.GraphModule, where: str, loading: GraphLoading) -> fx.Graph:
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for i, record in enumerate(expect(records, list, where)):
        node = _decode_node(graph, expect(record, dict, where), f"{where}, nodes[{i}]", nodes, loading)
        if node.op == "get_attr" and not _holds(gm, node.target):
            raise SerializationError(f"{where}: get_attr {node.target!r} names nothing the module holds.")
        nodes[node.name] = node
    kinds = [node.op for node in graph.nodes]
    placeholders = kinds.count("placeholder")
    if kinds[:placeholders] != ["placeholder"] * placeholders or kinds.count("output") != 1 or kinds[-1] != "output":
        raise SerializationError(f"{where}: the graph must be placeholders, then computations, then one output.")
    return graph


def _decode_node(graph: fx.Graph, record: dict, where: str, nodes: dict, loading: GraphLoading) -> fx.Node:
    op, name = record.get("op"), expect(record.get("name"), str, where)
    if op not in _NODE_OPS:
        raise SerializationError(f"{where}: node op {short(op)} is not one of {list(_NODE_OPS)}.")
    where = f"{where} ({name})"
    target = _decode_target(op, record.get("target"), where, loading)
    refs = Refs(nodes=nodes)
    args = tuple(decode(a, f"{where} args[{i}]", refs) for i, a in enumerate(expect(record.get("args", []), list, where)))
    kwargs = {k: decode(v, f"{where} kwargs[{k!r}]", refs) for k, v in expect(record.get("kwargs", {}), dict, where).items()}
    for key in kwargs:  # FX writes `key = value` into the code it compiles
        check_identifier(key, where)
    if isinstance(target, torch._ops.OpOverload):
        _check_schema(target, args, kwargs, where)
    node = graph.create_node(op, target, args, kwargs, name=name)
    if node.name != name or name in nodes:
        raise SerializationError(f"{where}: {name!r} is not a valid, unique node name.")
    node.meta.update(_decode_meta(expect(record.get("meta", {}), dict, where), where, loading))
    return node


def _decode_target(op: str, target: Any, where: str, loading: GraphLoading) -> Any:
    if op == "call_function":
        return _resolve_target(target, where, loading.namespaces)
    target = expect(target, str, where)
    if op == "output" and target != "output":
        raise SerializationError(f"{where}: an output node's target is 'output', not {short(target)}.")
    for part in target.split(".") if op == "get_attr" else [target] if op == "placeholder" else []:
        check_identifier(part, where)
    return target


def _decode_meta(meta: dict, where: str, loading: GraphLoading) -> dict:
    unknown = set(meta) - {"val", *_INFORMATIONAL_META}
    if unknown:
        raise SerializationError(f"{where}: unknown node meta {sorted(unknown)}.")
    decoded = {}
    if "val" in meta:
        decoded["val"] = decode(meta["val"], f"{where} meta['val']", Refs(fake_mode=loading.fake_mode, symbols=loading.symbols))
    for key in _INFORMATIONAL_META:
        if key in meta:
            decoded[key] = decode(meta[key], f"{where} meta[{key!r}]")
            _check_text(decoded[key], f"{where} meta[{key!r}]")
    return decoded


def _check_text(value: Any, where: str) -> None:
    """Informational strings hold no control characters but newlines and tabs.

    FX can print a node's stack trace as a comment in generated code; a carriage return
    there would end the comment, so a file must not be able to put one in.
    """
    if isinstance(value, str):
        if not all(c.isprintable() or c in "\n\t" for c in value):
            raise SerializationError(f"{where}: text with control characters.")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _check_text(item, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, where)
