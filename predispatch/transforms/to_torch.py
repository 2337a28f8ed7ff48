"""`to_torch`: a predispatch program as a genuine `torch.export.ExportedProgram`.

Both are pre-dispatch ATen graphs with lifted state, so most programs convert as they are.
The differences are in the calling convention, which `to_torch` rewrites on a copy:

    predispatch                                  torch.export
    one placeholder per tied tensor (aliases)    one placeholder per name, unused ones too
    constant input leaves baked in               a placeholder per constant (ConstantArgument)
    constant output leaves rebuilt by module()   literals in the output tuple
    tensors a graph creates: get_attr            lifted to CONSTANT_TENSOR inputs (into regions
                                                 as extra operands of their HOP call)
    a mutated tensor attribute (CONSTANT_TENSOR) a non-persistent buffer (torch mutates buffers)
    functional batch norm, native_dropout        aten.batch_norm (statistics updated in place),
                                                 aten.dropout: torch's training IR, which PT2E's
                                                 patterns match (transforms/recompose_for_torch.py)
    a tensor subclass in the state (torchao's    its parts, each a plain parameter or buffer of the
    quantized weights), taken apart              owner module (`up.weight__qdata`): Note [Tensor
                                                 subclass state in torch's ExportedProgram]

What converts: every OpOverload (aten, prims, and custom ops such as predispatch::keep_history,
which `torch.export.load` finds once `predispatch.ops` is imported), `operator.getitem`, and the
higher-order ops in `TORCH_HOPS` (torch's own grad-mode and autocast regions) and `KEPT_HOPS`
(custom Functions, torch's control flow: `cond`, `while_loop`, `scan`, `map`); shared bodies
(inlined); parameters,
buffers (persistent or not), constants, tied weights, and mutations of buffers, parameters
and user inputs.  What is refused with `NotRepresentableError`: any other higher-order op
(`REFUSED_HOPS` says why for predispatch's own), a forward that leaves grad mode changed for its
caller, and constant leaves whose type torch's `ConstantArgument` cannot hold.
docs/format.md#torch-interop keeps the same list.

Note [Custom backwards in torch's ExportedProgram]
--------------------------------------------------
A captured `autograd.Function` (or backward hook) is torch's `autograd_function_apply` HOP with
a forward and a backward subgraph.  torch.export.load cannot read that HOP back (its forward
subgraph returns two lists), so `to_torch()` gives each one predispatch's
`predispatch_autograd_function_apply` instead, the same HOP with a flat forward (Note [Custom
backwards that torch.export.load reads] in predispatch/ops.py;
transforms/flatten_function_outputs.py).  torch's verifier accepts it, `module()` trains with
the custom backward, `run_decompositions()` inlines its forward, `_export_forward_backward`
traces the custom backward, and `torch.export.save`/`load` round-trip it once
`predispatch.ops` is imported in the loading process.

Shared bodies of repeated blocks are inlined (`invoke_subgraph` becomes the flat graph that
torch.export gives): torch's eager `invoke_subgraph` differentiates only under a fake mode
("fake_mode should be enabled for HOPs") and Dynamo refuses a direct call of it, so a program
that kept it could neither train through `module()` nor compile (tests/test_consumers.py).

Note [Tensor subclass state in torch's ExportedProgram]
-------------------------------------------------------
A program computes on the plain parts of its tensor subclasses (Note [Tensor subclasses] in
frontend/subclasses.py).  torch.export keeps a subclass parameter whole in its state
(`access_subclass_inner_tensor` reads its parts in the graph), which `torch.export.save`
pickles, and its `run_decompositions()` makes each part a parameter of its own,
`up.parametrizations.weight.original0` (torch's `unwrap_tensor_subclass_parameters`).
`to_torch()` gives torch's consumers that plain program directly, naming each part after its
owner's attribute and its own (`up.weight__qdata`, `up.weight__scale`; a part of a nested
subclass `w__a__scale`): a parameter (requiring grad as the subclass does) or buffer of the
subclass's kind, so torch's verifier, `torch.export.save`/`load` and `module()` see plain
tensors only.  A subclass user input or output is refused: torch's program would take or return
the parts instead of the user's tensor (torch.export keeps it whole, and its
`run_decompositions()` fails on it).

Train-mode batch norm that `recompose_for_torch` cannot give torch's in-place form (inside a
region, or with its new statistics read afterwards) saves copies of the running statistics
(`clone_saved_statistics`): torch's `module()` writes the statistics back into the buffers
after the graph ran, which would otherwise change a tensor its backward saved.

`to_torch(for_inference=True)` is the lowering for consumers that only run forward (ONNX,
PT2E quantization, ExecuTorch): each Function's forward is inlined and its backward dropped
(transforms/lower_for_inference.py), then torch's `run_decompositions({})` inlines grad-mode and
autocast regions, making autocast's dtype casts explicit `_to_copy` nodes, and keeps every
op whole (`aten.linear`, `aten.conv2d`, as quantizers match them).  The result is
torch's inference IR: it runs forward like the program, but its gradients are not the
program's wherever a custom backward was dropped (a `UserWarning` names them).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.export.graph_signature as tsig
from torch import fx
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature

from predispatch import _torch_internals as ti
from predispatch.errors import NotRepresentableError, PredispatchError, from_torch
from predispatch.frontend.inputs import unique_identifier
from predispatch.passes.lift_constants import TORCH_HOPS, ConstantLifter, attribute, hop_body
from predispatch.signature import PLACEHOLDER_PREFIX, InputKind, InputSpec, OutputKind, OutputSpec, Program
from predispatch.passes import inlined_copy
from predispatch.passes.kernel_shapes import pin_kernel_shapes
from predispatch.transforms.flatten_function_outputs import flatten_function_outputs
from predispatch.transforms.recompose_for_torch import clone_saved_statistics, recompose_for_torch


#: Why the other HOPs predispatch emits are refused.
REFUSED_HOPS: dict[str, str] = {}

#: Higher-order ops `to_torch()` keeps (no operands to lift into their subgraphs: one whose
#: subgraphs hold tensors is refused), with what torch does with them.
KEPT_HOPS = {
    "autograd_function_apply": "as predispatch_autograd_function_apply, which module(), training, "
    "torch.export.save and load keep (Note [Custom backwards in torch's ExportedProgram])",
    "cond": "torch.cond: torch's verifier, serializer, module() and autograd know it",
    "while_loop": "torch's while_loop: torch's verifier, serializer, module() and autograd know it",
    "scan": "torch's scan: torch's verifier, serializer, module() and autograd know it",
    "map_impl": "torch's map (functorch.experimental.control_flow.map): torch's verifier, serializer, "
    "module() and autograd know it",
}

#: What to do when a kept HOP's subgraphs hold tensors, by HOP ('' for torch's control flow).
_HELD_TENSORS_FIX = {
    "autograd_function_apply": "to_torch(for_inference=True) inlines its forward",
    "": "make the tensor outside the branch or body and pass it in as an operand",
}

#: The constant leaf types torch's `ConstantArgument` holds.
_CONSTANT_TYPES = (int, float, bool, str, type(None))

_INPUT_KIND = {
    InputKind.PARAMETER: tsig.InputKind.PARAMETER,
    InputKind.BUFFER: tsig.InputKind.BUFFER,
    InputKind.CONSTANT_TENSOR: tsig.InputKind.CONSTANT_TENSOR,
}
_OUTPUT_KIND = {
    OutputKind.BUFFER_MUTATION: tsig.OutputKind.BUFFER_MUTATION,
    OutputKind.PARAMETER_MUTATION: tsig.OutputKind.PARAMETER_MUTATION,
    OutputKind.USER_INPUT_MUTATION: tsig.OutputKind.USER_INPUT_MUTATION,
}


def to_torch(ep: Program, *, for_inference: bool = False) -> torch.export.ExportedProgram:
    """`ep` as a `torch.export.ExportedProgram` (see the module docstring for what converts).

    The result passes torch's verifier and supports `torch.export.save`/`load` (custom
    backwards once `predispatch.ops` is imported: Note [Custom backwards in torch's
    ExportedProgram]), `run_decompositions()` and `module()`, which trains.  Everything in it is a copy: torch's `module()`
    writes buffer mutations into the program's own state tensors, and torch's passes rewrite
    graphs, and neither may reach `ep` or the model it was exported from.

    for_inference: lower for consumers that only run forward (ONNX, PT2E, ExecuTorch): custom
    backwards are DROPPED (forwards inlined), grad-mode and autocast regions inlined with
    explicit casts.  Warns when a custom backward is dropped.
    """
    if for_inference:
        return _to_torch_for_inference(ep)
    converted = _convert(ep)
    clone_saved_statistics(converted.graph_module)
    flatten_function_outputs(converted.graph_module)
    return converted


def _convert(ep: Program) -> torch.export.ExportedProgram:
    """`ep` in torch's calling convention and training IR, shared bodies inlined (see the
    module docstring), before the rewrites only a training consumer needs."""
    import dataclasses

    _refuse_unrepresentable(ep)
    flat = inlined_copy(ep.graph_module)
    if flat is not ep.graph_module:
        ep = dataclasses.replace(ep, graph_module=flat)  # type: ignore[type-var]  # an ExportedProgram, a dataclass
    builder = _TorchGraph(ep)
    output_specs = recompose_for_torch(builder.graph, builder.input_specs, builder.output_specs)
    _guard_kernel_shapes(builder)
    sig = ep.signature
    call = ModuleCallSignature(
        inputs=[], outputs=[], in_spec=sig.in_spec, out_spec=sig.out_spec, forward_arg_names=_forward_arg_names(ep)
    )
    return torch.export.ExportedProgram(
        root=builder.root,
        graph=builder.graph,
        graph_signature=tsig.ExportGraphSignature(builder.input_specs, output_specs),
        state_dict=builder.state_dict,
        range_constraints=_range_constraints(builder.graph),
        module_call_graph=[ModuleCallEntry("", call)],
        constants=builder.constants,
        verifiers=[ti.TrainingIRVerifier],
    )


def _guard_kernel_shapes(builder: _TorchGraph) -> None:
    """torch's `module()` runs the graph itself, without `ep.module()`'s `check_kernel_shapes`:
    the same rules as `aten.view`s of the kernels' arguments, in the root graph and every
    subgraph (Note [Kernels that trust their arguments' shapes] in passes/kernel_shapes.py)."""
    pin_kernel_shapes(builder.graph)
    for value in builder.root.values():
        for gm in value.modules() if isinstance(value, torch.nn.Module) else ():
            if isinstance(gm, fx.GraphModule) and pin_kernel_shapes(gm.graph):
                gm.recompile()


def to_torch_forward_backward(ep: Program, loss_index: int = 0) -> torch.export.ExportedProgram:
    """torch's joint forward-backward program of `ep` (torch's `_export_forward_backward` of
    `to_torch()`), the form ExecuTorch's training runtime runs: the loss marked as LOSS_OUTPUT,
    gradients as GRADIENT_TO_PARAMETER outputs.  Captured Functions keep their custom backward
    (torch's joint traces the HOP's backward); train-mode batch norm is lowered to core ATen
    ops (transforms/lower_batch_norm_stats.py), which `to_edge` requires."""
    from predispatch.transforms.lower_batch_norm_stats import lower_batch_norm_stats

    joint = ti.export_forward_backward(to_torch(ep), loss_index)
    lower_batch_norm_stats(joint.graph_module)
    return joint


def _to_torch_for_inference(ep: Program) -> torch.export.ExportedProgram:
    """See Note [Custom backwards in torch's ExportedProgram]: Function forwards inlined on a
    copy, then torch's own inference lowering, which keeps ops whole."""
    import dataclasses
    import warnings

    from predispatch.transforms.lower_for_inference import drop_history, inline_function_forwards

    gm = copy.deepcopy(ep.graph_module)
    dropped = inline_function_forwards(gm)
    drop_history(gm)
    # a forward that leaves grad mode changed for its caller matters to training callers only
    signature = dataclasses.replace(ep.signature, grad_mode_on_exit=None)
    lowered = _convert(dataclasses.replace(ep, graph_module=gm, signature=signature))  # type: ignore[type-var]  # an ExportedProgram, a dataclass
    if dropped:
        warnings.warn(
            f"to_torch(for_inference=True) dropped {len(dropped)} custom backward(s) ({', '.join(dropped)}): "
            "the result runs forward like the program, but differentiating it does not use them.",
            UserWarning,
            stacklevel=4,  # the caller of ExportedProgram.to_torch
        )
    with warnings.catch_warnings():  # torch's run_decompositions deep-copies the pytree specs
        warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)", FutureWarning)
        try:
            return lowered.run_decompositions({})
        except ti.SpecViolationError as exc:
            if "lifted_tensor" not in str(exc):
                raise
            raise _constants_torch_relifts(exc) from None


def _constants_torch_relifts(exc: Exception) -> PredispatchError:
    """torch's inference lowering traces the program again and propagates a tensor forward
    builds from a literal (`torch.tensor([])`: transformers' `DynamicCache` makes one per layer)
    into new constants its own verifier refuses; torch.export's program of the same model fails
    alike.  Ours names it and the routes that work."""
    return from_torch(NotRepresentableError(
        f"torch's inference lowering (run_decompositions) cannot take this program: it makes new tensor "
        f"constants from ones forward builds from literals, and torch's verifier refuses them ({exc}). "
        "A Hugging Face model's default key/value cache (use_cache=True, a DynamicCache) builds such tensors; "
        "torch.export's own program of the same model fails the same way.",
        fix="export with use_cache=False (model(ids, use_cache=False), or config.use_cache = False) for ONNX or "
        "to_torch(for_inference=True); or build the tensors outside forward; ep.module() and ep.to_torch() run as they are.",
    ), exc)


def _refuse_unrepresentable(ep: Program) -> None:
    problems = _unrepresentable(ep)
    if problems:
        raise NotRepresentableError(
            "torch.export.ExportedProgram cannot hold this program:\n    " + "\n    ".join(problems),
            fix="keep using the predispatch program (ep.module(), predispatch.save, which holds all of it), "
            "use ep.to_torch(for_inference=True) for a consumer that only runs forward, or change the model "
            "so the named construct goes away; docs/format.md#torch-interop lists what converts.",
        )


def _unrepresentable(ep: Program) -> list[str]:
    """Everything in `ep` torch's ExportedProgram cannot express, one line each."""
    sig, problems = ep.signature, []
    if sig.grad_mode_on_exit is not None:
        problems.append(f"forward leaves grad mode {'en' if sig.grad_mode_on_exit else 'dis'}abled for its caller")
    for spec in sig.outputs_of(OutputKind.USER_INPUT_METADATA_MUTATION):
        problems.append(
            f"output {spec.name} changes the shape or strides of input {spec.target!r} in place: torch's "
            "signature has no output kind for a metadata mutation"
        )
    for leaf in (*sig.input_leaves, *sig.output_leaves):
        if not leaf.is_tensor and type(leaf.value) not in _CONSTANT_TYPES:
            problems.append(f"{leaf.path} is a constant {type(leaf.value).__name__}; torch holds int, float, bool, str or None")
        if leaf.layout is not None:
            problems.append(f"{leaf.path} is a tensor subclass ({leaf.layout.class_name}); torch's program would take or "
                            "return its parts instead (Note [Tensor subclass state in torch's ExportedProgram])")
    names = [fqn for state in sig.inputs if state.kind is not InputKind.USER_INPUT for fqn in state.names]
    for state in sig.inputs:
        for fqn in state.names if state.inner else ():
            if torch_name(fqn, state.inner) in names:
                problems.append(f"part {state.inner!r} of {fqn!r} would be named {torch_name(fqn, state.inner)!r}, which is another state's name")
    holding: dict[int, bool] = {}  # subgraph id -> whether it or a subgraph in it reads a tensor attribute
    for path, module in ep.graph_module.named_modules():
        for node in module.graph.nodes if isinstance(module, fx.GraphModule) else ():
            target = node.target
            if not isinstance(target, torch._ops.HigherOrderOperator) or target.name() in TORCH_HOPS:
                continue
            where = f"node {node.name} in {path or 'the graph'} calls {target.name()}"
            if target.name() not in KEPT_HOPS:
                problems.append(f"{where}: {REFUSED_HOPS.get(target.name(), 'torch.export does not know it')}")
            elif _holds_tensors(module, node, holding):
                problems.append(f"{where}: its subgraphs hold tensors (made inside them), which to_torch cannot "
                                f"lift into them; {_HELD_TENSORS_FIX.get(target.name(), _HELD_TENSORS_FIX[''])}")
    return problems


def torch_name(fqn: str, inner: str) -> str:
    """The name of a tensor subclass's part in torch's program: the subclass's name and the
    part's attribute path (`up.weight`, `qdata` -> `up.weight__qdata`); `fqn` for a whole tensor
    (Note [Tensor subclass state in torch's ExportedProgram])."""
    return f"{fqn}__{inner.replace('.', '__')}" if inner else fqn


def _holds_tensors(module: fx.GraphModule, node: fx.Node, holding: dict[int, bool]) -> bool:
    """Whether a subgraph argument of `node`, or a subgraph nested in it, reads a tensor
    attribute; each subgraph looked at once, however many calls name it (`holding`)."""
    subgraphs = [attribute(module, a.target) for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr"]
    return any(_reads_tensors(sub, holding) for sub in subgraphs if isinstance(sub, fx.GraphModule))


def _reads_tensors(gm: fx.GraphModule, holding: dict[int, bool]) -> bool:
    if id(gm) not in holding:
        holding[id(gm)] = any(isinstance(attribute(gm, n.target), torch.Tensor) for n in gm.graph.find_nodes(op="get_attr")) or any(
            _reads_tensors(child, holding) for child in gm.children() if isinstance(child, fx.GraphModule)
        )
    return holding[id(gm)]


def _range_constraints(graph: fx.Graph) -> dict:
    """torch's `range_constraints`: every size symbol in the graph's values, with its range in
    the ShapeEnv of the trace (or of `predispatch.load`, which declares the saved ranges)."""
    constraints = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        sizes = [*val.shape] if isinstance(val, torch.Tensor) else [val] if isinstance(val, torch.SymInt) else []
        for size in sizes:
            if isinstance(size, torch.SymInt):
                constraints.update(ti.symbol_ranges(size.node.shape_env, ti.free_symbols(size)))
    return constraints


def _forward_arg_names(ep: Program) -> list[str] | None:
    """Positional parameter names then keyword names, as torch.export records them."""
    in_spec = ep.signature.in_spec
    names = list(ep.signature.arg_names)
    if len(names) != in_spec.child(0).num_children:
        return None
    return names + list(in_spec.child(1).context)


class _TorchGraph:
    """The graph rewritten to torch's calling convention (see the module docstring).

    root, graph: the module holding the (copied) subgraphs, and the new top-level graph.
    input_specs, output_specs: torch's signature, one spec per placeholder and output.
    state_dict, constants: torch's: persistent parameters and buffers under every name; the
        rest (constants, non-persistent buffers, lifted graph tensors) in constants.
    """

    def __init__(self, ep: Program):
        self.ep = ep
        self.graph = fx.Graph()
        self.input_specs: list[tsig.InputSpec] = []
        self.output_specs: list[tsig.OutputSpec] = []
        self.state_dict: dict[str, torch.Tensor] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.root: dict[str, Any] = {}
        self._env: dict[fx.Node, fx.Node] = {}
        self._operands: dict[str, list[fx.Node]] = {}  # per subgraph: its lifted tensors' placeholders
        self.lifter = ConstantLifter()
        self._taken = {node.name for node in ep.graph.nodes}
        mutated = {(s.target, s.inner) for s in ep.signature.outputs_of(OutputKind.BUFFER_MUTATION)}
        placeholders = ep.graph.find_nodes(op="placeholder")
        for spec, node in zip(ep.signature.inputs, placeholders):
            if spec.kind is not InputKind.USER_INPUT:
                self._add_state(spec, node, (spec.target, spec.inner) in mutated)
        self._lift_graph_tensors()
        self._add_user_inputs([n for s, n in zip(ep.signature.inputs, placeholders) if s.kind is InputKind.USER_INPUT])
        self._copy_body()
        self._add_outputs()

    def _add_state(self, spec: InputSpec, node: fx.Node, mutated: bool) -> None:
        """One placeholder per name of the tensor (tied names share the tensor, as in torch); a
        part of a tensor subclass under its own name (`torch_name`)."""
        tensor = _state_copy(self.ep.constants if spec.kind is InputKind.CONSTANT_TENSOR else self.ep.state_dict, spec)
        for i, fqn in enumerate(torch_name(name, spec.inner) for name in spec.names):
            name = node.name if i == 0 else unique_identifier(PLACEHOLDER_PREFIX[spec.kind] + fqn, self._taken)
            placeholder = self._placeholder(name, _meta_with_grad(node.meta, tensor.requires_grad))
            if i == 0:
                self._env[node] = placeholder
            self._add_state_input(spec, fqn, placeholder.name, tensor, mutated)

    def _add_state_input(self, spec: InputSpec, fqn: str, name: str, tensor: torch.Tensor, mutated: bool) -> None:
        kind, persistent = _INPUT_KIND[spec.kind], spec.persistent
        if spec.kind is InputKind.CONSTANT_TENSOR and mutated:  # torch mutates buffers, not constants
            kind, persistent = tsig.InputKind.BUFFER, False
        if kind is tsig.InputKind.BUFFER and persistent is None:
            persistent = True
        store = self.state_dict if kind is tsig.InputKind.PARAMETER or persistent is True else self.constants
        store[fqn] = tensor
        self.input_specs.append(tsig.InputSpec(kind, tsig.TensorArgument(name), fqn, persistent))

    def _lift_graph_tensors(self) -> None:
        """Tensors a graph reads by get_attr become CONSTANT_TENSOR inputs, as torch lifts them:
        its verifier allows only subgraphs as top-level attributes, and `run_decompositions`
        expects no tensor inside a subgraph.  A region's tensors reach it as extra operands of
        its HOP call (`ConstantLifter`), each body once (Note [Each region body once] in
        passes/lift_constants.py); a subgraph read by several get_attr nodes is copied once."""
        inputs: dict[str, fx.Node] = {}  # a tensor read by several get_attr nodes is one input
        for node in self.ep.graph.find_nodes(op="get_attr"):
            value = attribute(self.ep.graph_module, node.target)
            if isinstance(value, torch.Tensor):
                if node.target not in inputs:
                    inputs[node.target] = self._constant_input(node.target, value, node.meta)
                self._env[node] = inputs[node.target]
                continue
            if node.target in self.root:
                continue
            subgraph = copy.deepcopy(value)  # a copy, so torch's passes cannot change ep's
            self.root[node.target] = subgraph
            lifted = self.lifter.lift(subgraph, node.target)
            # flat targets: torch's module() installs each constant as an attribute at its target
            self._operands[node.target] = [self._constant_input(p.replace(".", "_"), t, m) for p, t, m in lifted]

    def _constant_input(self, target: str, tensor: torch.Tensor, meta: dict) -> fx.Node:
        """A CONSTANT_TENSOR input holding a copy of `tensor` at `target`, or at `target_1`, ...
        where that is taken (two lifted paths can flatten to one: `a_b.c` and `a.b_c`)."""
        base, i = target, 0
        while target in self.constants or target in self.state_dict:
            i += 1
            target = f"{base}_{i}"
        placeholder = self._placeholder(unique_identifier(f"c_{target}", self._taken), meta)
        self.constants[target] = _copy(tensor)
        arg = tsig.TensorArgument(placeholder.name)
        self.input_specs.append(tsig.InputSpec(tsig.InputKind.CONSTANT_TENSOR, arg, target))
        return placeholder

    def _add_user_inputs(self, tensor_placeholders: list[fx.Node]) -> None:
        """Every input leaf in pytree order: tensors as before, constants as placeholders."""
        tensors = iter(tensor_placeholders)
        for leaf in self.ep.signature.input_leaves:
            if leaf.is_tensor:
                node = next(tensors)
                self._env[node] = self._placeholder(node.name, node.meta)
                self.input_specs.append(tsig.InputSpec(tsig.InputKind.USER_INPUT, tsig.TensorArgument(node.name), None))
            else:
                placeholder = self._placeholder(unique_identifier(leaf.path, self._taken), {"val": leaf.value})
                arg = tsig.ConstantArgument(placeholder.name, leaf.value)
                self.input_specs.append(tsig.InputSpec(tsig.InputKind.USER_INPUT, arg, None))

    def _copy_body(self) -> None:
        for node in self.ep.graph.nodes:
            if node.op not in ("placeholder", "output") and node not in self._env:
                self._env[node] = copied = self.graph.node_copy(node, self._env.__getitem__)
                body = hop_body(node)
                if body is not None and self._operands.get(body.target):
                    copied.args = (*copied.args, *self._operands[body.target])

    def _add_outputs(self) -> None:
        """Mutations, then every output leaf in pytree order (constants as literals)."""
        sig = self.ep.signature
        values = list(self.ep.graph.output_node().args[0])
        placeholders = {node.name: self._env[node] for node in self.ep.graph.find_nodes(op="placeholder")}
        outputs = []
        for spec, value in zip(sig.mutations, values):
            outputs.append(self._env[value])
            target = placeholders[spec.target].name if spec.kind is OutputKind.USER_INPUT_MUTATION else torch_name(spec.target, spec.inner)
            arg = tsig.TensorArgument(outputs[-1].name)
            self.output_specs.append(tsig.OutputSpec(_OUTPUT_KIND[spec.kind], arg, target))
        results = iter(values[len(sig.mutations) :])
        specs = iter(sig.outputs[len(sig.mutations) :])
        for leaf in sig.output_leaves:
            kind, target = tsig.OutputKind.USER_OUTPUT, None
            if leaf.is_tensor:
                outputs.append(self._env[next(results)])
                arg = tsig.TensorArgument(outputs[-1].name)
                kind, target = _output_kind(next(specs), sig, placeholders)
            else:
                outputs.append(leaf.value)
                arg = tsig.ConstantArgument("", leaf.value)
            self.output_specs.append(tsig.OutputSpec(kind, arg, target))
        self.graph.output(tuple(outputs))

    def _placeholder(self, name: str, meta: dict) -> fx.Node:
        """A placeholder named `name` if FX allows it (it renames Python builtins: `input_1`)."""
        node = self.graph.placeholder(name)
        self._taken.add(node.name)
        node.meta = dict(meta)
        return node


def _output_kind(spec: OutputSpec, sig: Any, placeholders: dict[str, fx.Node]) -> tuple[tsig.OutputKind, str | None]:
    """torch's kind and target of a user output or a joint program's gradient output (torch
    names a user input's gradient by the input's placeholder)."""
    if spec.kind is OutputKind.GRADIENT_TO_PARAMETER:
        return tsig.OutputKind.GRADIENT_TO_PARAMETER, torch_name(spec.target, spec.inner)
    if spec.kind is OutputKind.GRADIENT_TO_USER_INPUT:
        name = next(s.name for s in sig.inputs_of(InputKind.USER_INPUT) if s.target == spec.target)
        return tsig.OutputKind.GRADIENT_TO_USER_INPUT, placeholders[name].name
    return tsig.OutputKind.USER_OUTPUT, None


def _meta_with_grad(meta: dict, requires_grad: bool) -> dict:
    """`meta` whose example value requires grad as the state tensor does, as torch.export records
    parameters: torch's `_export_forward_backward` differentiates the inputs whose example value
    requires grad (the trace's fake values never do, since functionalization runs below autograd)."""
    val = meta.get("val")
    if not isinstance(val, torch.Tensor) or val.requires_grad == requires_grad:
        return meta
    return {**meta, "val": val.detach().requires_grad_(requires_grad)}


def _state_copy(group: Any, spec: InputSpec) -> torch.Tensor:
    """A copy of the state tensor `spec` stands for: a part of a tensor subclass is a parameter
    (requiring grad as the subclass does) when the subclass is one, a plain tensor otherwise."""
    whole = group[spec.target]
    if not spec.inner:
        return _copy(whole)
    part = whole
    for name in spec.inner.split("."):
        part = getattr(part, name)
    if isinstance(whole, torch.nn.Parameter):
        return torch.nn.Parameter(part.detach().clone(), requires_grad=whole.requires_grad)
    return part.detach().clone()


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with the same kind (Parameter or not) and `requires_grad`."""
    copy_ = tensor.detach().clone()
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(copy_, requires_grad=tensor.requires_grad)
    return copy_.requires_grad_(tensor.requires_grad)
