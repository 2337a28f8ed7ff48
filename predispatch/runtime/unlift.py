"""`module_of`: an `ExportedProgram` as the `fx.GraphModule` `ep.module()` returns.

The program's graph takes `(*state, *user_tensors)` and returns `(*mutations, *user_outputs)`.
The module's graph, on a copy, takes the call as the user makes it, as torch.export's unlifted
module does:

    def forward(self, x, mask):                                   # the exported parameters
        x, mask, = fx_pytree.tree_flatten_spec(([x, mask], {}), self._in_spec)
        lin_weight = self.lin.weight                              # state: get_attr by FQN
        ...                                                       # the program's body
        apply_mutations(('buffer_mutation',), (bn_running_mean,), (add_1,))  # the write-back
        return pytree.tree_unflatten([linear, 'label'], self._out_spec)     # constants back in

- every leaf of the call is a placeholder, in pytree order (constants too, checked by the
  pre-hook; the graph does not read them);
- each lifted tensor is a `get_attr` of its first fully qualified name; tied names are more
  attributes holding the same tensor;
- mutations are written back by one `apply_mutations` call (runner.py), then a forward that
  leaves grad mode changed for its caller sets it;
- a captured Function calls `run_autograd_function` (Note [Captured Functions under Dynamo]);
- a tensor the graph creates (`_tensor_constant0`) is read through a `GraphConstant`, so it is
  neither state (state_dict keys stay the original module's) nor lifted by a re-export.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import warnings
from typing import Any, cast

import torch
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch.frontend.reachable import in_tree
from predispatch.passes import inline_subgraphs
from predispatch.passes.lift_constants import ConstantLifter, attribute, hop_body
from predispatch.runtime import runner
from predispatch.runtime.names import argument_names, program_attributes
from predispatch.runtime.runner import _STATE_KINDS, CallContract, GraphConstant, ProgramModule
from predispatch.runtime.modes import set_exported_modes
from predispatch.runtime.owner import OwnedCodeGen
from predispatch.runtime.kernel_checks import guard_kernel_shapes
from predispatch.signature import InputKind, Program
from predispatch.runtime.writes import WritePlan, plan_writes

def module_of(ep: Program) -> ProgramModule:
    """Build `ep.module()`; see the module docstring."""
    shared = {id(v): v for v in _opaque_objects(ep.graph_module).values()}  # the user's generator, not a copy
    source = copy.deepcopy(ep.graph_module, shared)  # the module's graph is its own: tools rewrite it
    inline_subgraphs(source)  # shared bodies inlined: torch's eager invoke_subgraph differentiates only under a fake mode
    runner.keep_class_names(ep.graph_module, source)
    graph = source.graph
    sig = ep.signature
    placeholders = graph.find_nodes(op="placeholder")
    n_state = len(sig.inputs_of(*_STATE_KINDS))
    layouts = _SubclassLayouts(source)
    user, by_name = _placeholders_per_leaf(graph, sig, placeholders[n_state:], layouts)
    state = _unlift_state(graph, sig, placeholders[:n_state], ep.live_root, layouts)
    plans = plan_writes(ep.graph_module, sig)
    _write_back_and_return(graph, sig, state, by_name, plans, layouts)
    bodies, lifter = _region_bodies(source), ConstantLifter()
    for gm in list(source.modules()):
        if isinstance(gm, fx.GraphModule):
            if id(gm) not in bodies:  # a region body's constants are lifted with its caller's
                _lift_region_constants(gm, lifter)
            _call_functions_through_runner(gm)
            guard_kernel_shapes(gm)
    pure_eval = bool(sig.training_flags) and not any(flag for _, flag in sig.training_flags) and not plans
    graph._codegen = OwnedCodeGen(ti.PyTreeInfo(argument_names(sig.in_spec, sig.arg_names), sig.in_spec, sig.out_spec), pure_eval)
    module = ProgramModule(nn.Module(), fx.Graph())
    _install_state(module, ep)
    _install_subgraphs(module, source)
    module.meta[ti.USER_PRESERVED_ATTRIBUTES] = {"call_contract": _contract(ep, plans)}
    if ep.live_root is None:
        set_exported_modes(module, sig.training_flags)
    if ep.state_dict_owner is not None:
        module.__dict__["_state_dict_owner"] = ep.state_dict_owner
    module.graph = graph  # generates the code, of every subgraph too (each once: Note [Load cost] in serialize/graph.py)
    runner.attach_call_hooks(module)
    return module


def _opaque_objects(gm: fx.GraphModule) -> dict[str, Any]:
    """The Python objects (not tensors, modules or graph constants) the graph reads by a
    top-level `get_attr`: a module's own `torch.Generator`.  `ep.module()` shares them with the
    exported graph, so the program draws from the user's generator, as eager does."""
    found = {}
    for node in gm.graph.find_nodes(op="get_attr"):
        value = vars(gm).get(node.target)
        if value is not None and not isinstance(value, (torch.Tensor, nn.Module, GraphConstant)):
            found[node.target] = value
    return found


class _SubclassLayouts:
    """The layouts of the program's tensor subclasses, as attributes of the module's graph
    (`_subclass_layout_0`), read by `get_attr` where the generated code takes a subclass apart or
    builds one (Note [Tensor subclasses] in frontend/subclasses.py)."""

    def __init__(self, source: fx.GraphModule):
        self.source = source
        self.count = 0

    def node(self, graph: fx.Graph, layout: Any) -> fx.Node:
        name = f"_subclass_layout_{self.count}"
        self.count += 1
        self.source.__dict__[name] = layout  # shared with module(): `_opaque_objects`
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a plain attribute, not a submodule, parameter or buffer
            return graph.get_attr(name)


def _take_apart(
    graph: fx.Graph, whole: fx.Node, layout: Any, layouts: _SubclassLayouts, parts: list[fx.Node], after: fx.Node | None = None
) -> list[fx.Node]:
    """After `whole` (a subclass; or after `after`), the call taking it apart, and one item per
    part; each part's old placeholder is replaced by its item.  Returns the items."""
    with graph.inserting_after(after or whole):
        layout_node = layouts.node(graph, layout)
    with graph.inserting_after(layout_node):
        call = graph.call_function(runner.subclass_parts, (whole, layout_node))
    items = []
    anchor = call
    for i, part in enumerate(parts):
        with graph.inserting_after(anchor):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = dict(part.meta)
        part.replace_all_uses_with(item)
        graph.erase_node(part)
        items.append(item)
        anchor = item
    return items


def _placeholders_per_leaf(
    graph: fx.Graph, sig: Any, tensor_placeholders: list[fx.Node], layouts: _SubclassLayouts
) -> tuple[list[fx.Node], dict[str, fx.Node]]:
    """One placeholder per leaf of the call, in pytree order, first in the graph; and the node
    standing for each USER_INPUT spec, by its name (a subclass leaf's parts: items of its
    `subclass_parts` call)."""
    tensors = iter(tensor_placeholders)
    specs = iter(sig.inputs_of(InputKind.USER_INPUT))
    ordered, by_name, apart = [], {}, []
    for leaf in sig.input_leaves:
        if leaf.layout is not None:
            parts = [next(tensors) for _ in leaf.layout.paths()]
            node = graph.placeholder(_identifier(leaf.path))
            node.meta["val"] = None
            apart.append((node, leaf.layout, parts, [next(specs).name for _ in parts]))
            ordered.append(node)
        elif leaf.is_tensor:
            ordered.append(next(tensors))
            by_name[next(specs).name] = ordered[-1]
        else:
            node = graph.placeholder(_identifier(leaf.path))
            node.meta["val"] = leaf.value
            ordered.append(node)
    first = next(iter(graph.nodes))
    for i, node in enumerate(ordered):
        if i == 0:
            if node is not first:
                first.prepend(node)
        else:
            ordered[i - 1].append(node)
    for node, layout, parts, names in apart:
        by_name.update(zip(names, _take_apart(graph, node, layout, layouts, parts, after=_last_placeholder(graph))))
    return ordered, by_name


def _last_placeholder(graph: fx.Graph) -> fx.Node:
    return graph.find_nodes(op="placeholder")[-1]


def _unlift_state(
    graph: fx.Graph, sig: Any, placeholders: list[fx.Node], live_root: nn.Module | None, layouts: _SubclassLayouts
) -> dict[Any, fx.Node]:
    """Each state placeholder becomes a `get_attr` of its fully qualified name (under the live
    root of a function export); by that name.  Live state kept outside the registered tree
    (`helpers.0.weight` in a plain list) is read by `runner.read_state`, which walks containers.
    The parts of a tensor subclass are items of one `subclass_parts` call on the subclass,
    by `(name, inner)`."""
    anchor = graph.find_nodes(op="placeholder")
    by_target: dict[Any, fx.Node] = {}
    specs = sig.inputs_of(*_STATE_KINDS)
    layouts_of = dict(sig.subclass_state)
    i = 0
    while i < len(specs):
        spec = specs[i]
        width = len(layouts_of[spec.target].paths()) if spec.inner else 1
        where = graph.inserting_after(anchor[-1]) if anchor else graph.inserting_before(next(iter(graph.nodes)))
        with where, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the attribute is installed once the graph is complete
            if live_root is None:
                attr = _read_node(graph, spec.target)
            elif in_tree(live_root, spec.target):
                attr = graph.get_attr(f"{runner.LIVE_ROOT}.{spec.target}")
            else:
                root = graph.get_attr(runner.LIVE_ROOT)
                with graph.inserting_after(root):
                    attr = graph.call_function(runner.read_state, (root, spec.target))
        if spec.inner:
            parts = placeholders[i : i + width]
            items = _take_apart(graph, attr, layouts_of[spec.target], layouts, parts)
            by_target.update(((spec.target, s.inner), item) for s, item in zip(specs[i : i + width], items))
            anchor = [items[-1]]
        else:
            node = placeholders[i]
            attr.meta = dict(node.meta)
            node.replace_all_uses_with(attr)
            graph.erase_node(node)
            anchor = [attr]
            by_target[spec.target] = attr
        i += width
    return by_target


def _read_node(graph: fx.Graph, fqn: str) -> fx.Node:
    """The `get_attr` of the state at `fqn`: through `RootState` where its first name is an
    attribute `ep.module()` has of its own (Note [State named like a GraphModule attribute]),
    named as the usual read is (`code_weight`)."""
    if not _held_by_root_state(fqn):
        return graph.get_attr(fqn)
    return graph.create_node("get_attr", f"{runner.ROOT_STATE}.{fqn}", name=_identifier(fqn))


def _held_by_root_state(fqn: str) -> bool:
    return fqn.split(".", 1)[0] in program_attributes()


def _write_back_and_return(
    graph: fx.Graph, sig: Any, state: dict[Any, fx.Node], by_name: dict[str, fx.Node], plans: tuple, layouts: _SubclassLayouts
) -> None:
    """The write-back call, grad mode for the caller, and every output leaf in pytree order (a
    subclass output built again from its parts)."""
    output = graph.output_node()
    values = list(output.args[0])
    mutations = sig.mutations
    with graph.inserting_before(output):
        if mutations:
            targets = tuple(
                by_name[s.target] if s.kind in runner.WRITES_TO_USER_INPUT else state[(s.target, s.inner) if s.inner else s.target]
                for s in mutations
            )
            _read_written_targets_through_runner(graph, targets)
            writers = tuple(runner.writer_of(plan) for plan in plans)
            graph.call_function(runner.apply_mutations, (writers, targets, tuple(values[: len(mutations)])))
        if sig.grad_mode_on_exit is not None:
            graph.call_function(torch._C._set_grad_enabled, (sig.grad_mode_on_exit,))
        results = iter(values[len(mutations) :])
        leaves = []
        for leaf in sig.output_leaves:
            if leaf.layout is not None:
                parts = tuple(next(results) for _ in leaf.layout.paths())
                leaves.append(graph.call_function(runner.subclass_of, (layouts.node(graph, leaf.layout), *parts)))
            else:
                leaves.append(next(results) if leaf.is_tensor else leaf.value)
    output.args = (leaves,)


def _read_written_targets_through_runner(graph: fx.Graph, targets: tuple[fx.Node, ...]) -> None:
    """The ops read each written-back tensor through `read_before_write` (Note [Saved inputs
    that are written back]); the write-back itself gets the tensor."""
    for target in dict.fromkeys(targets):
        readers = [user for user in target.users]
        if not readers:
            continue
        with graph.inserting_after(target):
            read = graph.call_function(runner.read_before_write, (target,))
        read.meta = dict(target.meta)
        for user in readers:
            user.replace_input_with(target, read)


def _region_bodies(source: fx.GraphModule) -> set[int]:
    """The ids of every graph module that is a region's body: `_lift_region_constants` of the
    graph calling it lifts its constants (and its own bodies') already (Note [Each region body
    once] in passes/lift_constants.py)."""
    return {
        id(attribute(gm, body.target))
        for gm in source.modules() if isinstance(gm, fx.GraphModule)
        for node in gm.graph.nodes if (body := hop_body(node)) is not None
    }


def _lift_region_constants(gm: fx.GraphModule, lifter: ConstantLifter) -> None:
    """Tensors a grad-mode or autocast region's body creates become operands of its HOP call, read
    by `gm` (as `to_torch` lifts them): Dynamo refuses a region body that reads anything but its
    operands ("wrap_with_set_grad_enabled expects no freevars").  Every call of a body passes
    them (Note [Each region body once] in passes/lift_constants.py)."""
    names: dict[str, str] = {}  # lifted path -> the buffer of `gm` holding it
    for node in list(gm.graph.nodes):
        body = hop_body(node)
        if body is None:
            continue
        operands = []
        for path, tensor, meta in lifter.lift(attribute(gm, body.target), body.target):
            if path not in names:
                names[path] = _fresh_attribute(gm, "_lifted_" + path.replace(".", "_"))
                gm.register_buffer(names[path], tensor)  # a graph constant, wrapped by `_install_constants`
            with gm.graph.inserting_before(node):
                operands.append(gm.graph.get_attr(names[path]))
            operands[-1].meta = dict(meta)
        node.args = (*node.args, *operands)


def _fresh_attribute(gm: fx.GraphModule, base: str) -> str:
    """`base`, or `base_1`, ... where `gm` has an attribute of that name already (two paths can
    flatten to one name: `a_b.c` and `a.b_c`)."""
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _call_functions_through_runner(gm: fx.GraphModule) -> None:
    """`autograd_function_apply` nodes call `run_autograd_function`, with the pair's Function
    for Dynamo made now (Note [Captured Functions under Dynamo]).  Not recompiled here: see
    `module_of`, which compiles every graph once."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is ti.autograd_function_apply:
            fwd, bwd = (attribute(gm, arg.target) for arg in node.args[:2])
            non_differentiable = tuple(node.kwargs.get("non_differentiable_idx", ()))
            function = runner.dynamo_function(fwd, bwd, non_differentiable, f"{type(fwd).__name__}_function")
            fwd.dynamo_function = function  # kept by deepcopy, as fx keeps user-preserved attributes:
            fwd.meta.setdefault(ti.USER_PRESERVED_ATTRIBUTES, {})["dynamo_function"] = function
            node.target = runner.run_autograd_function


def _identifier(path: str) -> str:
    """A placeholder name for a constant leaf (the graph uniquifies it)."""
    name = "".join(c if c.isalnum() else "_" for c in path).strip("_") or "constant"
    return f"_{name}" if name[0].isdigit() else name


def _install_state(module: ProgramModule, ep: Program) -> None:
    """State under every fully qualified name: the program's own tensors (for a module export,
    the user's: Note [module() shares the program's state]); for a function (or nested) export
    the reached modules themselves, read at each call."""
    if ep.live_root is not None:  # read through `_live_root`; its children show in state_dict()
        module.__dict__[runner.LIVE_ROOT] = ep.live_root
        for name, child in ep.live_root.named_children():
            if name in program_attributes():  # a global module named `code` (Note [State named like a GraphModule attribute])
                module._modules[name] = child  # shown in state_dict(); the graph reads it through `_live_root`
            else:
                module.add_module(name, child)
        return
    outside = frozenset(ep.signature.outside_tree)
    names = {}
    for spec in ep.signature.inputs_of(*_STATE_KINDS):
        source = ep.constants[spec.target] if spec.kind is InputKind.CONSTANT_TENSOR else ep.state_dict[spec.target]
        tensor = _shared(source, spec.kind)
        names.update((fqn, (tensor, spec)) for fqn in spec.names)
    held = frozenset(fqn.split(".", 1)[0] for fqn in names if _held_by_root_state(fqn))
    if held:
        module.__dict__[runner.ROOT_STATE] = runner.RootState(module, held)
    # the exported module's order first (ExportSignature.state_order), then any other name
    for fqn in dict.fromkeys((*(n for n in ep.signature.state_order if n in names), *names)):
        tensor, spec = names[fqn]
        _install(module, fqn, tensor, spec.kind, spec.persistent, outside)


def _install_subgraphs(module: ProgramModule, source: fx.GraphModule) -> None:
    """The HOP subgraphs become submodules; each tensor a graph creates is wrapped (`_install_constants`)."""
    for gm in source.modules():
        if isinstance(gm, fx.GraphModule):
            _install_constants(gm, top=gm is source)
    for name, child in source._modules.items():  # every name: an inlined body shares its regions
        if hasattr(module, name):
            raise AssertionError(f"subgraph {name!r} collides with state of the same name")
        module.add_module(name, child)
    for name, value in vars(source).items():
        if isinstance(value, GraphConstant):
            setattr(module, name, value)
    module.__dict__.update(_opaque_objects(source))


def _install_constants(gm: fx.GraphModule, *, top: bool) -> None:
    """A tensor the trace created (`_tensor_constant0`, a buffer of the graph) is held by a
    `GraphConstant` and read through it: it is neither state (so `state_dict()` keys stay the
    original module's) nor a tensor attribute a re-export would lift."""
    moved: dict[str, str] = {}  # a tensor's target -> its GraphConstant's name (one for all reads)
    for node in list(gm.graph.find_nodes(op="get_attr")):
        if node.target not in moved:
            if top and not _is_graph_attr(gm, node.target):
                continue  # unlifted state, installed on the module
            value = attribute(gm, node.target)
            if not isinstance(value, torch.Tensor):
                continue
            moved[node.target] = name = _fresh_attribute(gm, f"_constant_{node.target.replace('.', '_').lstrip('_')}")
            with contextlib.suppress(AttributeError):
                delattr(gm, node.target)
            gm.__dict__[name] = GraphConstant(value)
        node.target = moved[node.target]
        with gm.graph.inserting_after(node):
            read = gm.graph.call_function(getattr, (node, "tensor"))
        node.replace_all_uses_with(read, delete_user_cb=lambda user: user is not read)
        read.meta = dict(node.meta)


def _is_graph_attr(source: fx.GraphModule, target: str) -> bool:
    """A top-level get_attr that is the graph's own (a subgraph or a tensor the trace created),
    as opposed to unlifted state, which `_unlift_state` added and `source` does not hold."""
    head = target.split(".")[0]
    return head != runner.LIVE_ROOT and head in source.__dict__ or head in source._modules or head in source._buffers


def _contract(ep: Program, plans: tuple[WritePlan, ...]) -> CallContract:
    sig = ep.signature
    placeholders = ep.graph.find_nodes(op="placeholder")[len(sig.inputs_of(*_STATE_KINDS)) :]
    user_index = {spec.name: i for i, spec in enumerate(sig.inputs_of(InputKind.USER_INPUT))}
    writes = tuple(
        user_index[s.target] if s.kind in runner.WRITES_TO_USER_INPUT else (s.target, s.inner) if s.inner else s.target
        for s in sig.mutations
    )
    return CallContract(
        in_spec=sig.in_spec,
        input_leaves=sig.input_leaves,
        tensor_meta=tuple(runner.tensor_meta(n.meta.get("val")) for n in placeholders),
        shapes=sig.shapes,
        writes=writes,
        arg_names=sig.arg_names,
        state=tuple((s.target, s.aliases) for s in sig.inputs_of(*_STATE_KINDS)),
        write_plans=plans,
        training_flags=sig.training_flags,
        storage_groups=ep.graph_module.meta.get("storage_groups", ()),
        state_parts=tuple(s.inner for s in sig.inputs_of(*_STATE_KINDS)) if sig.subclass_state else (),
        subclass_state=sig.subclass_state,
    )


# Note [module() shares the program's state]
# `ep.module()` holds the program's tensors themselves, as torch.export's module does: for a
# module export `ep.state_dict` holds the exported module's own parameters and buffers, so the
# module adds no memory, training it trains the user's model (outside-tree helpers included:
# their parameters are the user's objects, so gradients reach them), and running it updates the
# buffers it shares, as running the model would.  Two consequences:
# - a call may pass one of those tensors as an input (`m(m.c)`, the user's `model.c`); when the
#   program also writes it, eager's write shows through the alias and the program's does not,
#   so `check_write_targets` refuses any target that is also another input of the call;
# - `copy.deepcopy(ep.module())` copies the tensors (an explicit copy, as for any nn.Module).


def _shared(tensor: torch.Tensor, kind: InputKind) -> torch.Tensor:
    """The program's tensor itself (Note [module() shares the program's state]).  A parameter
    held as a plain tensor (a program built by hand) is wrapped: same storage, no copy."""
    if kind is InputKind.PARAMETER and not isinstance(tensor, nn.Parameter):
        return nn.Parameter(tensor.detach(), requires_grad=tensor.requires_grad)
    return tensor


def _install(
    root: nn.Module, fqn: str, tensor: torch.Tensor, kind: InputKind, persistent: bool | None, outside: frozenset[str],
    *, top: bool = True,
) -> None:
    """Put `tensor` at `fqn`, creating empty container modules along the path.

    A container at an `outside` path (where the exported module's path left its registered
    tree: `helpers`, a plain list there) is a plain attribute, not a submodule, as it was
    there: `state_dict()`, `parameters()` and `.to()` pass it by, as the exported module's do,
    while the graph still reads and writes its tensors by path at each call."""
    *path, attr = fqn.split(".")
    if top and _held_by_root_state(fqn):
        _install_held(root, path, attr, tensor, kind, persistent, outside)
        return
    owner = root
    for i, part in enumerate(path):
        if not hasattr(owner, part):
            container = nn.Module()
            if ".".join(path[: i + 1]) in outside:
                owner.__dict__[part] = container  # no nn.Module.__setattr__: not registered
            else:
                owner.add_module(part, container)
        owner = getattr(owner, part)
    if kind is InputKind.PARAMETER:
        owner.register_parameter(attr, tensor)
    elif kind is InputKind.BUFFER:
        owner.register_buffer(attr, tensor, persistent=persistent is not False)
    else:
        setattr(owner, attr, tensor)


# Note [State named like a GraphModule attribute]
# A model may name a submodule (or parameter, buffer, tensor attribute) `code`, `graph` or
# `meta`: eager refuses only names `nn.Module` has, and these are `fx.GraphModule`'s own (its
# generated source, its graph, its meta dict), which `ep.module()` is.  Installed the usual
# way, `add_module("code", ...)` refuses, and `self.code.weight` in the generated code reads
# the source string.  So state whose first name is one of the module's own attributes
# (`names.program_attributes()`) goes straight into the dicts `nn.Module` keeps it in
# (`_modules`, `_parameters`, `_buffers`: `state_dict()` keys stay the model's, `.to()` and
# `load_state_dict` reach it) and is read through `RootState` (`self.__root_state.code.weight`),
# which looks it up in those dicts; a plain tensor attribute is held by `RootState` itself,
# as replacing `meta` or `_graph` would break the module.  `ep.module().code` stays the
# generated source; the submodule is `ep.module()._modules["code"]`.


def _install_held(
    root: nn.Module, path: list[str], attr: str, tensor: torch.Tensor, kind: InputKind, persistent: bool | None, outside: frozenset[str]
) -> None:
    """`_install` of state whose first name is one of the module's own attributes (Note [State
    named like a GraphModule attribute]): the first name goes into `root`'s dicts, the rest as usual."""
    holder = root.__dict__[runner.ROOT_STATE]
    if not path:
        if kind is InputKind.PARAMETER:
            root._parameters[attr] = cast(nn.Parameter, tensor)  # `_shared` made it one
        elif kind is InputKind.BUFFER:
            root._buffers[attr] = tensor
            if persistent is False:
                root._non_persistent_buffers_set.add(attr)
        else:
            holder.plain[attr] = tensor
        return
    head, *rest = path
    if head not in root._modules and head not in holder.plain:
        if head in outside:
            holder.plain[head] = nn.Module()  # not registered, as `_install` keeps it
        else:
            root._modules[head] = nn.Module()
    child = getattr(holder, head)
    _install(child, ".".join((*rest, attr)), tensor, kind, persistent, frozenset(o.partition(".")[2] for o in outside if o.startswith(head + ".")), top=False)
