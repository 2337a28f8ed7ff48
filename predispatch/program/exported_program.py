"""`ExportedProgram`: the graph, what its inputs and outputs mean, and the lifted state."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch.errors import HooksChangedError, ProgramCallError, user_frame
from predispatch.frontend.hooks import HookRecord, hook_changes, record_hooks
from predispatch.frontend.reachable import tree_exit
from predispatch.passes import check_functional, name_placeholders, remove_copies, shared_bodies, wrap_regions
from predispatch.program.printing import format_graph, format_program
from predispatch.signature import ExportSignature, InputKind, InputSpec, OutputKind, OutputSpec, SubclassLayout, state_names

if TYPE_CHECKING:  # the program stage consumes the earlier stages' values, never their code
    from predispatch.frontend import PreparedInputs
    from predispatch.trace import DecompositionLog, TracedGraph

_MUTATION_KIND = {
    InputKind.PARAMETER: OutputKind.PARAMETER_MUTATION,
    InputKind.BUFFER: OutputKind.BUFFER_MUTATION,
    InputKind.CONSTANT_TENSOR: OutputKind.BUFFER_MUTATION,
    InputKind.USER_INPUT: OutputKind.USER_INPUT_MUTATION,
}


@dataclass(frozen=True, eq=False)
class ExportedProgram:
    """A functional pre-dispatch ATen program.

    graph_module: the graph; takes `(*state, *user_tensors)` in `signature.inputs` order and
        returns `(*mutations, *user_outputs)` in `signature.outputs` order.
    signature: what each graph input and output stands for.
    state_dict: parameters and buffers by fully qualified name: the exported module's own
        tensors (export copies no weights, nor does `module()`, which holds these tensors).
    constants: tensor attributes lifted as CONSTANT_TENSOR inputs, by fully qualified name.
    decompositions: for each composite op the trace met, whether it was kept whole and why;
        read it as `ep.audit`, the documented name (the same object: this field stores it).
    live_root: for a function (or a nested export), the module whose live state `module()`
        reads and writes at each call, as the exported code itself would; None for a module
        export, whose `module()` holds the tensors of `state_dict` and `constants`.
    hooks: the module and global hooks in force at export (see `verify_hooks`).
    state_dict_owner: the exported module, kept only when it has state_dict hooks, so that
        `module().state_dict()` / `load_state_dict()` apply them exactly as the module does.
    """

    graph_module: fx.GraphModule
    signature: ExportSignature
    state_dict: Mapping[str, torch.Tensor]
    constants: Mapping[str, torch.Tensor]
    decompositions: DecompositionLog
    live_root: nn.Module | None = field(default=None, repr=False, compare=False)
    hooks: HookRecord | None = field(default=None, repr=False, compare=False)
    state_dict_owner: nn.Module | None = field(default=None, repr=False, compare=False)

    @property
    def audit(self) -> DecompositionLog:
        """Which composite ops the program kept whole and which it decomposed, and why: the
        `decompositions` record itself, under the name the docs use."""
        return self.decompositions

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refuse a direct call with the way to run the program (`ep.module()(...)`), as
        torch.export's program does, instead of Python's bare "object is not callable"."""
        raise ProgramCallError(
            "an ExportedProgram is not callable: it describes the program; its module runs it.",
            where=user_frame(),
            fix="call ep.module()(...) instead (build the module once, then call it as often as you like).",
        )

    def module(self) -> fx.GraphModule:
        """An `fx.GraphModule` that runs the program like the original: same call, same results.

        It takes the original (pytree) args and kwargs, returns outputs in the original
        structure, and applies buffer and input mutations back as eager does, all in its
        generated code (see predispatch/runtime/unlift.py), so `torch.compile(..., fullgraph=True)`
        and graph tools such as PT2E quantizers take it whole.  A forward pre-hook checks each
        call against the exported one.  For a module export, its parameters and buffers are
        the exported model's own tensors, as in torch.export's module: it adds no memory,
        training it trains the model, and running it updates the buffers it shares as running
        the model would (Note [module() shares the program's state] in runtime/unlift.py); its
        `state_dict()` has the original module's keys.  For a function export it uses the
        reached modules themselves, as calling the function would.
        """
        from predispatch.runtime.unlift import module_of

        return module_of(self)

    def inline_subgraphs(self) -> ExportedProgram:
        """This program with every shared body (`invoke_subgraph`) inlined: one flat graph, for
        consumers that do not recurse into higher-order ops (PT2E quantization).  Same state."""
        from dataclasses import replace

        from predispatch.passes import inlined_copy

        return replace(self, graph_module=inlined_copy(self.graph_module))

    def verify_hooks(self, module: nn.Module) -> None:
        """Raise `HooksChangedError` if `module`'s hooks (or the global module hooks) differ
        from those in force at export: the program behaves as the module did then."""
        changes = hook_changes(self.hooks, record_hooks(module)) if self.hooks is not None else []
        if changes:
            raise HooksChangedError(
                "the module's hooks changed since export:\n    " + "\n    ".join(changes),
                fix="export again to trace the current hooks, or restore the old ones.",
            )

    def joint(self, loss: str | None = None) -> ExportedProgram:
        """The functional joint forward-backward program: `(*state, *user inputs) ->
        (*mutations, *outputs, *gradients)`; its `module()` returns `(outputs, grads)`.

        `loss`: the path of the loss among the outputs (`"[0]"`, `"loss"`) when forward
        returns more than one leaf.  See Note [The joint program] in transforms/joint.py.
        """
        from dataclasses import replace

        from predispatch.transforms.joint import joint_program

        graph_module, signature = joint_program(self, loss)
        return replace(self, graph_module=graph_module, signature=signature)

    def to_torch(self, *, for_inference: bool = False) -> torch.export.ExportedProgram:
        """This program as a `torch.export.ExportedProgram`; see predispatch/transforms/to_torch.py.

        for_inference: for consumers that only run forward (ONNX, PT2E, ExecuTorch): custom
        autograd.Function and backward-hook backwards are DROPPED (their forwards inlined, with
        a warning), grad-mode and autocast regions inlined with autocast's casts explicit.
        """
        from predispatch.transforms.to_torch import to_torch

        return to_torch(self, for_inference=for_inference)

    def to_torch_forward_backward(self, loss_index: int = 0) -> torch.export.ExportedProgram:
        """torch's joint forward-backward program, for ExecuTorch's training runtime
        (`to_edge(ep.to_torch_forward_backward()).to_executorch()`); loss_index: the position of
        the loss among the outputs.  See predispatch/transforms/to_torch.py."""
        from predispatch.transforms.to_torch import to_torch_forward_backward

        return to_torch_forward_backward(self, loss_index)

    def to_onnx(self, f: str | os.PathLike | None = None, **options: Any) -> Any:
        """This program as ONNX (torch's `ONNXProgram`; saved to `f` when given), its dynamic
        axes named after the user's `Dim`s; options: `input_names`, `output_names`,
        `opset_version`, `optimize`, `external_data`.  See predispatch/transforms/to_onnx.py."""
        from predispatch.transforms.to_onnx import to_onnx

        return to_onnx(self, f, **options)

    def graph_code(self) -> str:
        """The graph as Python code, subgraphs nested, as `print(ep)` shows it (without the signature)."""
        return format_graph(self.graph_module)

    def __str__(self) -> str:
        return format_program(self)


def build_program(prepared: PreparedInputs, traced: TracedGraph, *, live: bool = False) -> ExportedProgram:
    """Name the placeholders, check the contract, and describe inputs and outputs.

    `live`: the program's `module()` reads state from `prepared.module` at each call (always
    so for functions, whose modules are the user's own).
    """
    from predispatch.frontend import FunctionRoot
    from predispatch.frontend.dynamic import shape_record

    gm = traced.graph_module
    inputs = (*(s.spec for s in prepared.state), *prepared.user_inputs)
    name_placeholders(gm, [spec.name for spec in inputs])
    remove_copies(gm)
    wrap_regions(gm)
    for body in shared_bodies(gm):  # a shared body's regions, once for all its calls
        wrap_regions(body)
    for module in gm.modules():  # the passes edit in place; generate the code once
        if isinstance(module, fx.GraphModule):
            ti.generate_code(module)
    gm.__class__.__name__ = "GraphModule"
    check_functional(gm)
    output_nodes = gm.graph.output_node().args[0]
    outputs = [
        _mutation_spec(inputs[i], node, i in traced.metadata_mutated)
        for i, node in zip(traced.mutated_inputs, output_nodes)
    ]
    user_paths = [
        (leaf.path, inner)
        for leaf in traced.output_leaves
        if leaf.is_tensor
        for inner in (leaf.layout.paths() if leaf.layout is not None else ("",))
    ]
    user_nodes = output_nodes[len(traced.mutated_inputs):]
    outputs += [OutputSpec(OutputKind.USER_OUTPUT, _node_name(n), p, inner) for n, (p, inner) in zip(user_nodes, user_paths)]
    signature = ExportSignature(
        tuple(inputs),
        tuple(outputs),
        prepared.in_spec,
        traced.out_spec,
        prepared.input_leaves,
        traced.output_leaves,
        traced.grad_mode_on_exit,
        prepared.arg_names,
        shape_record(prepared.fake_mode, gm.graph.find_nodes(op="placeholder")[len(prepared.state):],
                     prepared.dynamic.names if prepared.dynamic else ()),
        () if isinstance(prepared.module, FunctionRoot) else training_flags(prepared.module),
        () if isinstance(prepared.module, FunctionRoot) else outside_tree(prepared.module, inputs),
        () if isinstance(prepared.module, FunctionRoot) else state_order(prepared.module, inputs),
        prepared.placements,
        _subclass_state(prepared),
    )
    gm.meta["storage_groups"] = _storage_groups(prepared)
    state = {s.spec.target: s.owned for s in prepared.state if s.spec.kind is not InputKind.CONSTANT_TENSOR}
    constants = {s.spec.target: s.owned for s in prepared.state if s.spec.kind is InputKind.CONSTANT_TENSOR}
    live_root = prepared.module if live or isinstance(prepared.module, FunctionRoot) else None
    hooks = record_hooks(prepared.module)
    owner = prepared.module if hooks.has_state_dict_hooks and live_root is None else None
    return ExportedProgram(gm, signature, state, constants, traced.decompositions, live_root, hooks, owner)


def _subclass_state(prepared: PreparedInputs) -> tuple[tuple[str, SubclassLayout], ...]:
    """The target and layout of each lifted tensor subclass (Note [Tensor subclasses])."""
    return tuple(
        (s.spec.target, s.part.layout) for s in prepared.state if s.part is not None and s.part.index == 0
    )


def _storage_groups(prepared: PreparedInputs) -> tuple[tuple[str, ...], ...]:
    """The state tensors that share memory, by target, one group per base (Note [State that
    shares storage]): the graph writes each group back consistently, so `module()`, which holds
    these very tensors, may write them though they overlap (`writes.check_write_targets`)."""
    groups: dict[int, list[str]] = {}
    for lifted in prepared.state:
        if lifted.view_of is not None:
            groups.setdefault(lifted.view_of.base, [prepared.state[lifted.view_of.base].spec.target]).append(lifted.spec.target)
    return tuple(tuple(names) for names in groups.values())


def training_flags(module: nn.Module) -> tuple[tuple[str, bool], ...]:
    """The root's `training` flag (path "") and every submodule's that differs from it."""
    flags = [("", module.training)]
    flags += [(path, m.training) for path, m in module.named_modules() if path and m.training != module.training]
    return tuple(flags)


def outside_tree(module: nn.Module, inputs: tuple[InputSpec, ...]) -> tuple[str, ...]:
    """Where lifted state's paths leave the registered tree (`ExportSignature.outside_tree`)."""
    exits = (tree_exit(module, fqn) for fqn in state_names(inputs))
    return tuple(dict.fromkeys(e for e in exits if e is not None))


def state_order(module: nn.Module, inputs: tuple[InputSpec, ...]) -> tuple[str, ...]:
    """The lifted state's names in the module's own order (`ExportSignature.state_order`)."""
    lifted = set(state_names(inputs))
    names = (
        f"{path}.{name}" if path else name
        for path, m in module.named_modules(remove_duplicate=False)
        for name in (*m._parameters, *m._buffers)
    )
    return tuple(dict.fromkeys(n for n in names if n in lifted))


def _mutation_spec(mutated: InputSpec, node: fx.Node, metadata: bool = False) -> OutputSpec:
    """The output carrying `mutated`'s new value: its target is the fully qualified name, or
    for a user input the placeholder's name.  `metadata`: the input's shape or strides changed
    too (only user inputs get here: the trace refuses it for state)."""
    target = mutated.name if mutated.kind is InputKind.USER_INPUT else mutated.target
    kind = OutputKind.USER_INPUT_METADATA_MUTATION if metadata else _MUTATION_KIND[mutated.kind]
    return OutputSpec(kind, node.name, target, "" if mutated.kind is InputKind.USER_INPUT else mutated.inner)


def _node_name(node: object) -> str:
    return node.name if isinstance(node, fx.Node) else repr(node)
