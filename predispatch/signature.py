"""The program's signature: what each graph input and output stands for.

The graph takes `(*lifted_state, *user_tensors)` and returns `(*mutations, *user_outputs)`.
`ExportSignature.inputs` and `.outputs` describe those positions one to one; the pytree specs
and leaf lists say how the user's `(args, kwargs)` and return value map onto them.

Every stage reads these records (the frontend lifts state into `InputSpec`s, the trace reads
them, `program/` builds the signature, the stages after export run, store and transform it), so
they live here, below all of them.  `Program` names the parts of a program those later stages
read, so that runtime/, serialize/ and transforms/ never import `program/` (whose
`ExportedProgram` methods call them): the layout's one-way rule, tests/test_layout.py.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from dataclasses import dataclass
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch import fx, nn


class InputKind(enum.Enum):
    """What a graph placeholder stands for."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    CONSTANT_TENSOR = "constant_tensor"
    USER_INPUT = "user_input"


class OutputKind(enum.Enum):
    """What a graph output stands for."""

    USER_OUTPUT = "user_output"
    BUFFER_MUTATION = "buffer_mutation"
    USER_INPUT_MUTATION = "user_input_mutation"
    PARAMETER_MUTATION = "parameter_mutation"
    GRADIENT_TO_PARAMETER = "gradient_to_parameter"
    GRADIENT_TO_USER_INPUT = "gradient_to_user_input"
    #: a user input whose shape, strides or storage offset forward changed in place (`x.t_()`):
    #: the output is the input's new view, applied back with `as_strided_`
    USER_INPUT_METADATA_MUTATION = "user_input_metadata_mutation"


#: The outputs that carry a new value of an input (`ProgramModule` writes them back).
MUTATION_KINDS = frozenset(
    {
        OutputKind.BUFFER_MUTATION,
        OutputKind.USER_INPUT_MUTATION,
        OutputKind.USER_INPUT_METADATA_MUTATION,
        OutputKind.PARAMETER_MUTATION,
    }
)

#: Prefix of a placeholder's name, by kind (`p_lin_weight`, `b_bn_running_mean`, `c_scale`).
PLACEHOLDER_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_", InputKind.CONSTANT_TENSOR: "c_"}


@dataclass(frozen=True)
class InputSpec:
    """One graph placeholder.

    kind: what it stands for.
    name: the placeholder's name in the graph (`p_lin_weight`, `x`).
    target: for lifted state, the fully qualified name in the original module (`lin.weight`);
        for a user input, its pytree path in the call (`x`, `batch['ids']`).
    aliases: other fully qualified names bound to the same tensor (tied weights).
    persistent: for buffers, whether the buffer is in the module's state_dict.
    inner: for one plain tensor inside a tensor subclass (Note [Tensor subclasses] in
        frontend/subclasses.py), its attribute path in the subclass (`qdata`, `a.scale` for a
        subclass inside a subclass); "" for a tensor that is the whole input.
    """

    kind: InputKind
    name: str
    target: str
    aliases: tuple[str, ...] = ()
    persistent: bool | None = None
    inner: str = ""

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the tensor is bound to: the target, then its aliases."""
        return (self.target, *self.aliases)


def state_names(inputs: tuple[InputSpec, ...]) -> tuple[str, ...]:
    """Every fully qualified name of the lifted state among `inputs` (targets and aliases)."""
    return tuple(fqn for spec in inputs if spec.kind is not InputKind.USER_INPUT for fqn in spec.names)


@dataclass(frozen=True)
class OutputSpec:
    """One graph output.

    kind: what it stands for.
    name: the graph node it returns.
    target: for a mutation, the fully qualified name of the mutated parameter/buffer, or the
        placeholder name of the mutated user input; for a user output, its pytree path.
    inner: for one plain tensor inside a tensor subclass, its attribute path (as
        `InputSpec.inner`): a mutation of that tensor of the state, or that piece of an output.
    """

    kind: OutputKind
    name: str
    target: str
    inner: str = ""


@dataclass(frozen=True)
class Leaf:
    """One leaf of the user's inputs or outputs, in pytree order.

    path: the leaf's pytree path (`x`, `kwargs['mask']`, `['logits']`).
    is_tensor: the leaf is a graph input/output: a tensor, or (outputs only) a scalar computed
        from data such as `x.sum().item()`; the other leaves are constants baked in.
    value: the constant's value (None for tensor leaves).
    layout: for a tensor subclass leaf, how it is made of plain tensors: the graph takes (or
        returns) one tensor per `layout.paths()`, in order; None for a plain tensor.
    """

    path: str
    is_tensor: bool
    value: Any = None
    layout: SubclassLayout | None = None

    @property
    def width(self) -> int:
        """How many graph inputs (or outputs) the leaf is: its subclass's plain tensors, or one."""
        return len(self.layout.paths()) if self.layout is not None else int(self.is_tensor)


@dataclass(frozen=True, eq=False)
class SubclassLayout:
    """How a traceable wrapper subclass tensor (torchao's `Int8Tensor`, torch's `TwoTensor`) is
    made of plain tensors, as its `__tensor_flatten__` says (Note [Tensor subclasses] in
    frontend/subclasses.py): the program computes on those tensors; this record takes a subclass
    apart into them at a call and builds it again from them.

    cls: the subclass.
    context: what `__tensor_flatten__` returns beside the attribute names (block sizes, dtypes,
        a config); the program was traced for this context, so a call must bring an equal one.
    inner: each tensor attribute's name, with its own layout when it is a subclass too.
    size, stride: the subclass tensor's outer size and stride.
    """

    cls: type[Any]
    context: Any
    inner: tuple[tuple[str, SubclassLayout | None], ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def __deepcopy__(self, memo: dict) -> SubclassLayout:
        """Itself: an immutable record whose class and context belong to the user's code."""
        return self

    def paths(self) -> tuple[str, ...]:
        """Every plain tensor's attribute path, depth first (`a`, `b`; `x.qdata` when nested)."""
        return tuple(
            path
            for name, layout in self.inner
            for path in ((name,) if layout is None else (f"{name}.{p}" for p in layout.paths()))
        )

    @property
    def class_name(self) -> str:
        return f"{self.cls.__module__}.{self.cls.__qualname__}"

    def mismatch(self, t: Any) -> str | None:
        """Why `t` is not a tensor of this layout (another class, other attributes, another
        context, another size), or None when it is."""
        if type(t) is not self.cls:
            return f"a {type(t).__name__}, not a {self.cls.__name__}"
        names, context = t.__tensor_flatten__()
        if tuple(names) != tuple(name for name, _ in self.inner):
            return f"a {self.cls.__name__} made of {list(names)}, not {[name for name, _ in self.inner]}"
        if not same_context(context, self.context):
            return f"a {self.cls.__name__} whose flatten context is {context!r}, not {self.context!r}"
        if tuple(t.shape) != self.size:
            return f"a {self.cls.__name__} of size {list(t.shape)}, not {list(self.size)}"
        for name, layout in self.inner:
            why = layout.mismatch(getattr(t, name)) if layout is not None else None
            if why is not None:
                return f"its {name} is {why}"
        return None

    def flatten(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The plain tensors of `t`, in `paths()` order (`t` already checked by `mismatch`)."""
        out: list[torch.Tensor] = []
        for name, layout in self.inner:
            value = getattr(t, name)
            out.extend([value] if layout is None else layout.flatten(value))
        return out

    def unflatten(self, tensors: Any) -> torch.Tensor:
        """The subclass tensor made of `tensors` (an iterator or sequence in `paths()` order)."""
        it = iter(tensors)
        inner = {name: next(it) if layout is None else layout.unflatten(it) for name, layout in self.inner}
        return self.cls.__tensor_unflatten__(inner, self.context, self.size, self.stride)

    def __str__(self) -> str:
        parts = ", ".join(name if layout is None else f"{name}={layout}" for name, layout in self.inner)
        return f"{self.class_name}({parts})"


def same_context(a: Any, b: Any) -> bool:
    """Whether two flatten contexts are equal; a context whose `==` raises or is not a bool
    (a tensor inside it) is equal only to itself."""
    if a is b:
        return True
    try:
        equal = a == b
    except Exception:  # noqa: BLE001 - a context of any type; its == may raise
        return False
    return equal if isinstance(equal, bool) else False


@dataclass(frozen=True)
class ShapeRecord:
    """The program's shapes in symbols.

    input_shapes: for each user tensor input, its sizes as ints or symbol expressions ("s0").
    ranges: for each symbol, its inclusive `(min, max)`; max None when unbounded.
    guards: the conditions on symbols the trace discovered, as text; "runtime: ..." ones are
        checks on data-dependent values (`torch._check(n > 0)`) torch defers to run time.
    origins: for each symbol, the input dimension it was made for (`x.size()[0]`).
    names: for each symbol a named `torch.export.Dim` made, that name (`batch`): `to_onnx`
        gives it to ONNX's dynamic axes, and the program prints it.
    """

    input_shapes: tuple[tuple[int | str, ...], ...] = ()
    ranges: tuple[tuple[str, int, int | None], ...] = ()
    guards: tuple[str, ...] = ()
    origins: tuple[tuple[str, str], ...] = ()
    names: tuple[tuple[str, str], ...] = ()

    @property
    def is_dynamic(self) -> bool:
        return bool(self.ranges or self.guards)

    def __str__(self) -> str:
        lines = []
        if self.ranges:
            lines.append("Range constraints:")
            origin, name = dict(self.origins), dict(self.names)
            for sym, lo, hi in self.ranges:
                where = f"  ({origin[sym]})" if sym in origin else ""
                called = f" ({name[sym]})" if sym in name else ""
                lines.append(f"    {sym}{called}: [{lo}, {'inf' if hi is None else hi}]{where}")
        if self.guards:
            lines.append("Shape guards:")
            lines.extend(f"    {g}" for g in self.guards)
        return "\n".join(lines)


@dataclass(frozen=True)
class StatePlacement:
    """How a state tensor of a per-rank DTensor program is laid out over its device mesh
    (Note [Per-rank DTensor programs] in frontend/per_rank.py): the program holds this rank's
    shard, the model held a DTensor.  Plain values only, so files keep it as it is.

    target: the state tensor's fully qualified name (`0.weight`).
    placements: one per mesh dimension, as torch writes them (`Shard(dim=0)`, `Replicate()`).
    mesh_shape: the device mesh's shape.
    mesh_dim_names: the mesh dimensions' names; empty when the mesh has none.
    mesh_ranks: the global ranks of the mesh, flattened in row-major order.
    device_type: the mesh's device type (`cpu`, `cuda`).
    global_shape: the DTensor's shape.
    local_shape: the shape of this rank's shard (the program's state tensor).
    """

    target: str
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...]
    mesh_ranks: tuple[int, ...]
    device_type: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    def __str__(self) -> str:
        names = f" {self.mesh_dim_names}" if self.mesh_dim_names else ""
        return (
            f"{self.target}: ({', '.join(self.placements)}) on {self.device_type} mesh {self.mesh_shape}{names} "
            f"ranks {list(self.mesh_ranks)}, global {list(self.global_shape)}, local {list(self.local_shape)}"
        )


@dataclass(frozen=True)
class ExportSignature:
    """How the graph's flat inputs and outputs map to the user's program.

    inputs: one spec per graph placeholder, in order.
    outputs: one spec per graph output, in order (mutations first, then user outputs; in a
        joint program (transforms/joint.py) then gradients, GRADIENT_TO_PARAMETER target
        the parameter's fully qualified name, GRADIENT_TO_USER_INPUT the input's path).
    in_spec: pytree spec of `(args, kwargs)`.
    out_spec: pytree spec of the return value.
    input_leaves: every leaf of `(args, kwargs)`, tensors and constants, in `in_spec` order.
    output_leaves: every leaf of the return value, in `out_spec` order.
    grad_mode_on_exit: the grad mode forward sets for its caller by a plain
        `torch.set_grad_enabled(b)` never undone (running the program does the same); None
        when forward leaves the caller's mode as it was.
    arg_names: the names of the positional parameters at export (`x`, `mask`), so a program's
        `module()` can be exported again with the same names.
    shapes: user input shapes in symbols, symbol ranges and shape guards (dynamic exports).
    training_flags: the `training` flag the exported module had (path "") and each submodule's
        flag that differs from it, at export: the mode the graph was traced in (dropout, batch
        norm); `module().train()`/`.eval()` may not change it.  Empty for a function export.
    outside_tree: the paths of the plain attributes (a list, dict or tuple, a helper object: not
        a submodule) through which lifted state outside the registered tree is reached
        (`helpers` for `helpers.0.weight`; Note [Modules outside the registered tree]):
        `module()` keeps that state off its registered tree, so its `state_dict()` keys are
        the exported module's.  Empty for a function export (its module reads the user's own).
    state_order: every name of the lifted state inside the registered tree, in the exported
        module's own order (module by module, parameters then buffers, as `state_dict()` lists
        them): `module()` registers its state in this order, so a submodule registered under
        two paths (a shared position encoding) does not move its other paths' state ahead of
        their siblings.  Empty for a function export and for files written before the field.
    placements: for a per-rank DTensor program, each DTensor state tensor's mesh and placements
        (the program's state is the rank's shard); empty otherwise.
    subclass_state: for each lifted tensor that is a tensor subclass, its target and layout:
        the graph takes its plain tensors (the inputs whose spec has `inner`), `module()` holds
        the subclass itself and takes it apart at each call.
    """

    inputs: tuple[InputSpec, ...]
    outputs: tuple[OutputSpec, ...]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    input_leaves: tuple[Leaf, ...]
    output_leaves: tuple[Leaf, ...]
    grad_mode_on_exit: bool | None = None
    arg_names: tuple[str, ...] = ()
    shapes: ShapeRecord = ShapeRecord()
    training_flags: tuple[tuple[str, bool], ...] = ()
    outside_tree: tuple[str, ...] = ()
    state_order: tuple[str, ...] = ()
    placements: tuple[StatePlacement, ...] = ()
    subclass_state: tuple[tuple[str, SubclassLayout], ...] = ()

    def __deepcopy__(self, memo: dict) -> ExportSignature:
        """A deep copy sharing the pytree specs, which are immutable: copying one makes a new
        `LeafSpec` for each leaf, which torch 2.13 deprecates with a FutureWarning per copy."""
        shared = ("in_spec", "out_spec")
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return ExportSignature(**{k: v if k in shared else copy.deepcopy(v, memo) for k, v in values.items()})

    def inputs_of(self, *kinds: InputKind) -> tuple[InputSpec, ...]:
        return tuple(s for s in self.inputs if s.kind in kinds)

    def outputs_of(self, *kinds: OutputKind) -> tuple[OutputSpec, ...]:
        return tuple(s for s in self.outputs if s.kind in kinds)

    @property
    def mutations(self) -> tuple[OutputSpec, ...]:
        return tuple(s for s in self.outputs if s.kind in MUTATION_KINDS)

    def __str__(self) -> str:
        lines = ["Inputs:"]
        for s in self.inputs:
            extra = f" inner={s.inner!r}" if s.inner else ""
            extra += f" (tied: {', '.join(s.aliases)})" if s.aliases else ""
            extra += " (non-persistent)" if s.persistent is False else ""
            lines.append(f"    {s.name}: {s.kind.name} target={s.target!r}{extra}")
        lines.append("Outputs:")
        for s in self.outputs:
            inner = f" inner={s.inner!r}" if s.inner else ""
            lines.append(f"    {s.name}: {s.kind.name} target={s.target!r}{inner}")
        subclasses = [*self.subclass_state, *((leaf.path, leaf.layout) for leaf in (*self.input_leaves, *self.output_leaves) if leaf.layout)]
        if subclasses:
            lines.append("Tensor subclasses (the graph computes on their parts):")
            lines.extend(f"    {target}: {layout}" for target, layout in subclasses)
        constants = [leaf for leaf in self.input_leaves if not leaf.is_tensor and not _is_module(leaf.value)]
        if constants:
            lines.append("Constant inputs:")
            lines.extend(f"    {leaf.path} = {leaf.value!r}" for leaf in constants)
        modules = [leaf for leaf in self.input_leaves if _is_module(leaf.value)]
        if modules:
            lines.append("Module inputs (their state is lifted above):")
            lines.extend(f"    {leaf.path}: {type(leaf.value).__name__}" for leaf in modules)
        if self.placements:
            lines.append("Placements (the state is this rank's shard):")
            lines.extend(f"    {p}" for p in self.placements)
        if self.shapes.is_dynamic:
            lines.append(str(self.shapes))
        if self.grad_mode_on_exit is not None:
            state = "enabled" if self.grad_mode_on_exit else "disabled"
            lines.append(f"Leaves grad mode {state} for the caller, as forward does.")
        return "\n".join(lines)


def _is_module(value: Any) -> bool:
    import torch.nn

    return isinstance(value, torch.nn.Module)


class Program(Protocol):
    """The parts of a program (`predispatch.ExportedProgram`, predispatch/program/) that
    `ep.module()` (runtime/), the file format (serialize/) and the transforms (transforms/) read:
    the fields of `ExportedProgram`, whose docstring says what each holds."""

    @property
    def graph_module(self) -> fx.GraphModule: ...

    @property
    def graph(self) -> fx.Graph: ...

    @property
    def signature(self) -> ExportSignature: ...

    @property
    def state_dict(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def constants(self) -> Mapping[str, torch.Tensor]: ...

    @property
    def decompositions(self) -> Any: ...  # trace.DecompositionLog

    @property
    def live_root(self) -> nn.Module | None: ...

    @property
    def hooks(self) -> Any: ...  # frontend.hooks.HookRecord | None

    @property
    def state_dict_owner(self) -> nn.Module | None: ...
