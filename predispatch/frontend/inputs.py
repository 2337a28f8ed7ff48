"""Turn `(module_or_fn, args, kwargs)` into `PreparedInputs`: named, lifted, fake."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import UnsupportedInputError, user_frame
from predispatch.frontend import registrations
from predispatch.frontend.distributed import refuse_distributed_state, refuse_wrapped
from predispatch.frontend.per_rank import has_dtensor_state, per_rank_module
from predispatch.frontend.dynamic import DynamicInputs, fake_dynamic_inputs
from predispatch.frontend.reachable import Beyond, beyond_tree, modules_reached, resolve
from predispatch.frontend.shared_storage import StorageView, with_storage_views
from predispatch.frontend.subclasses import SubclassPart, is_subclass, layout_of, part_name, refuse_opaque_subclass
from predispatch.signature import PLACEHOLDER_PREFIX, InputKind, InputSpec, Leaf, StatePlacement

#: Leaf types that are baked into the program as constants instead of becoming graph inputs.
CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.memory_format)


@dataclass(frozen=True)
class LiftedTensor:
    """A parameter, buffer or tensor attribute lifted to a graph input.

    spec: its input spec (kind, placeholder name, fully qualified name, tied aliases).
    tensor: the real tensor in the user's module; never written to by export.
    """

    spec: InputSpec
    tensor: torch.Tensor
    #: more names to bind it to during the trace, not program names: a plain container holding
    #: the same tensor (RNNs' `_flat_weights` list, `self.refs = [self.lin.weight]`)
    bind_also: tuple[str, ...] = ()
    #: where it lies in another lifted tensor's memory, when it shares that memory (Note [State
    #: that shares storage] in frontend/shared_storage.py): the trace binds it as a view of that base
    view_of: StorageView | None = None
    #: the subclass tensor it is a part of (Note [Tensor subclasses] in frontend/subclasses.py):
    #: `tensor` is then one plain tensor inside the module's subclass tensor `part.whole`
    part: SubclassPart | None = None

    @property
    def owned(self) -> torch.Tensor:
        """The module's own tensor at the spec's target: the subclass for a part, else `tensor`."""
        return self.part.whole if self.part is not None else self.tensor


@dataclass(frozen=True)
class PreparedInputs:
    """Everything the trace stage needs, with nothing left to look up in the user's objects.

    module: the module to call (a function is wrapped in a module that calls it).
    state: lifted tensors in graph order: parameters, then buffers, then constant tensors.
    user_inputs: one USER_INPUT spec per tensor leaf of `(args, kwargs)`.
    arg_names: the names of the positional arguments, as the callable's signature gives them.
    input_leaves: every leaf of `(args, kwargs)` in pytree order, constants with their values.
    in_spec: the pytree spec of `(args, kwargs)`.
    fake_mode: the FakeTensorMode (with a ShapeEnv) every fake tensor below belongs to.
    fake_state: fake twins of `state`, in order.
    fake_user_inputs: fake twins of the tensor leaves, in order; one tensor passed at several
        places gets a twin of its own at each (see `_one_twin_per_place`).
    repeated: (position, first position) of every tensor leaf that is the same tensor as an
        earlier one (`model(ids, labels=ids)`), positions among the tensor leaves.
    dynamic: torch's dynamic-shape bookkeeping when `dynamic_shapes` was given, else None.
    placements: for a module with DTensor state, each DTensor's mesh and placements; `module`
        is then the stand-in holding the rank's shards (Note [Per-rank DTensor programs]).
    subclass_inputs: for each tensor subclass input, its position among `input_leaves` and the
        parts the user's tensor holds without grad though the trace gives them grad
        (Note [Reading a subclass's tensors in forward] in trace/subclass_reads.py).
    """

    module: nn.Module
    state: tuple[LiftedTensor, ...]
    user_inputs: tuple[InputSpec, ...]
    arg_names: tuple[str, ...]
    input_leaves: tuple[Leaf, ...]
    in_spec: pytree.TreeSpec
    fake_mode: ti.FakeTensorMode
    fake_state: tuple[torch.Tensor, ...]
    fake_user_inputs: tuple[torch.Tensor, ...]
    dynamic: DynamicInputs | None = None
    repeated: tuple[tuple[int, int], ...] = ()
    placements: tuple[StatePlacement, ...] = ()
    subclass_inputs: tuple[tuple[int, frozenset[str]], ...] = ()

    def call_args(self, user_tensors: tuple[torch.Tensor, ...]) -> tuple[tuple, dict]:
        """Rebuild `(args, kwargs)` from tensors for the tensor leaves and the recorded constants
        (a subclass leaf from its parts: Note [Tensor subclasses])."""
        tensors = iter(user_tensors)
        with ti.lazy_symbolic_sizes():  # a jagged nested tensor's strides are products of its nested int
            leaves = [
                leaf.layout.unflatten(tensors) if leaf.layout is not None else next(tensors) if leaf.is_tensor else leaf.value
                for leaf in self.input_leaves
            ]
        return pytree.tree_unflatten(leaves, self.in_spec)


class FunctionRoot(nn.Module):
    """Makes a plain function look like a module so one pipeline serves both.

    The modules the function reaches (see `reachable.py`) and the modules passed to it as
    arguments become submodules under their names, so their state is lifted with paths like
    `encoder.layer.weight`; the modules themselves are shared, not copied.
    """

    def __init__(self, fn: Callable[..., Any], modules: dict[str, nn.Module]):
        super().__init__()
        # `forward` is the function itself, so its signature (argument names, defaults) is the
        # module's: torch's dynamic-shape helpers bind `dynamic_shapes` against it.
        object.__setattr__(self, "forward", fn)
        for name, module in modules.items():
            self.add_module(name, module)


def prepare(module_or_fn: Any, args: Any, kwargs: Any, dynamic_shapes: Any = None) -> PreparedInputs:
    """Validate, name, lift and fakify; see the module docstring."""
    args, kwargs = _check_args(args, kwargs)
    register_dataclasses((args, kwargs))
    module, signature_of = as_module(module_or_fn, args, kwargs)
    _refuse_lazy_state(module)
    refuse_wrapped(module)  # DDP, FSDP2: Note [Distributed state]
    placements: tuple[StatePlacement, ...] = ()
    if has_dtensor_state(module):  # Note [Per-rank DTensor programs]
        module, placements = per_rank_module(module, args, kwargs, dynamic_shapes)
    leaves, in_spec = _named_leaves(signature_of, args, kwargs)
    state = with_storage_views(subclass_parts(lift_state(module, beyond_tree(module))))
    _check_state(state)
    flat = pytree.tree_leaves((args, kwargs))
    tensors = _parts_of_inputs(flat, leaves)
    _refuse_dynamic_subclass_inputs(leaves, dynamic_shapes)
    refuse_distributed_state(module, state, tensors)  # Note [Distributed state]
    dynamic = fake_dynamic_inputs(module, args, kwargs, dynamic_shapes) if dynamic_shapes is not None else None
    fake_mode = dynamic.fake_mode if dynamic else ti.new_fake_mode(real_constants=True)  # Note [Tensors from outside the module]
    device = _inputs_device(flat)
    alone = _alone_in_storage([s.tensor for s in state] if dynamic else [*(s.tensor for s in state), *tensors])
    fake_state = tuple(_fake_state(fake_mode, s, device, alone) for s in state)
    user_specs = _user_input_specs(leaves, taken={s.spec.name for s in state})
    if dynamic:
        fake_flat = pytree.tree_leaves((dynamic.fake_args, dynamic.fake_kwargs))
        fake_user = tuple(x for x in fake_flat if isinstance(x, torch.Tensor))
    else:
        marked = _dynamic_parts(flat, leaves)  # Note [Jagged nested tensors]
        fake_user = tuple(
            ti.fake_with_dynamic_dims(fake_mode, x, marked[i], user_specs[i].name) if i in marked else _fakify(fake_mode, x, alone=alone)
            for i, x in enumerate(tensors)
        )
    repeated = _repeated(tensors)
    _refuse_shared_parts(leaves, repeated)
    fake_user = _one_twin_per_place(fake_mode, fake_user, repeated)
    fake_user, subclass_inputs = _parts_with_grad(flat, leaves, fake_user)
    arg_names = tuple(_parameter_names(signature_of, args))
    return PreparedInputs(
        module, state, user_specs, arg_names, leaves, in_spec, fake_mode, fake_state, fake_user, dynamic, repeated,
        placements, subclass_inputs,
    )


def _fake_state(fake_mode: ti.FakeTensorMode, lifted: LiftedTensor, device: torch.device, alone: frozenset[int]) -> torch.Tensor:
    """The fake twin of a lifted tensor.  A part of a subclass parameter that requires grad is
    traced as requiring grad where its dtype can (the subclass's floating tensors), as
    AOTAutograd traces a subclass's inner tensors: the gradient reaches the subclass through them."""
    if lifted.part is None:
        return _fakify(fake_mode, lifted.tensor, lifted.spec.kind is InputKind.PARAMETER, device, alone)
    fake = _fakify(fake_mode, lifted.tensor, False, device, alone)
    if lifted.part.whole.requires_grad and (fake.is_floating_point() or fake.is_complex()):
        fake.requires_grad_(True)
    return fake


def _repeated(tensors: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
    """(position, first position) of each tensor that already occurred earlier in `tensors`."""
    first: dict[int, int] = {}
    pairs = []
    for i, t in enumerate(tensors):
        earlier = first.setdefault(id(t), i)
        if earlier != i:
            pairs.append((i, earlier))
    return tuple(pairs)


def _one_twin_per_place(
    fake_mode: ti.FakeTensorMode, fakes: tuple[torch.Tensor, ...], repeated: tuple[tuple[int, int], ...]
) -> tuple[torch.Tensor, ...]:
    """A fresh twin for each repeated place: the program takes one input per place.

    The tracer binds a fake tensor to one graph input; the same fake at two places would make
    every use read the last place's input (`embedding(weight, labels)` for `model(ids,
    labels=ids)`), wrong when the program is called with different tensors there.  The fresh
    twin has the same shape (symbols included), strides, dtype and device, and no storage in
    common: the two places are independent inputs (a mutation of one is refused at trace time).
    """
    twins: list[torch.Tensor] = list(fakes)
    for position, _ in repeated:
        twins[position] = _fake_from_metadata(fake_mode, twins[position]).requires_grad_(twins[position].requires_grad)
    return tuple(twins)


def _fake_from_metadata(fake_mode: ti.FakeTensorMode, tensor: torch.Tensor) -> torch.Tensor:
    """A fake tensor with `tensor`'s shape (symbols included), strides, dtype and device, and
    storage of its own: made from metadata alone, never from data."""
    with fake_mode:
        return torch.empty_strided(tuple(tensor.shape), tensor.stride(), dtype=tensor.dtype, device=tensor.device)


def as_module(obj: Any, args: tuple = (), kwargs: dict | None = None) -> tuple[nn.Module, Callable[..., Any]]:
    """The module to trace and the callable whose signature names the inputs."""
    if isinstance(obj, nn.Module):
        if _module_leaves(args, kwargs, obj.forward):
            raise UnsupportedInputError(
                "a module was passed as an argument to a module's forward; its state would not be lifted.",
                where=user_frame(),
                fix="make it a submodule (an attribute) of the exported module, or export a function "
                "that takes both: predispatch.export(lambda x: model(x, other), (x,)).",
            )
        return obj, obj.forward
    if callable(obj) and not isinstance(obj, type):
        return FunctionRoot(obj, {**modules_reached(obj), **_module_leaves(args, kwargs, obj)}), obj
    raise UnsupportedInputError(
        f"export() takes an nn.Module or a function, got {type(obj).__name__}.",
        where=user_frame(),
        fix="pass the model itself, e.g. predispatch.export(model, (x,)).",
    )


def _module_leaves(args: tuple, kwargs: dict | None, fn: Callable[..., Any]) -> dict[str, nn.Module]:
    """Modules passed as arguments, named by their argument path (`model`, `models_0`)."""
    names = _parameter_names(fn, args)
    found: dict[str, nn.Module] = {}
    for path, value in pytree.tree_flatten_with_path((args, kwargs or {}))[0]:
        if isinstance(value, nn.Module):
            found[unique_identifier(_label(names, path), set(found))] = value
    return found


def _label(names: list[str], path: tuple) -> str:
    """`x`, `mask`, `batch['ids']`: a leaf's path named after the function's parameters."""
    top = names[path[1].idx] if path[0].idx == 0 else path[1].key
    return top + pytree.keystr(path[2:])


def _check_args(args: Any, kwargs: Any) -> tuple[tuple, dict]:
    if not isinstance(args, tuple):
        hint = "(x,)" if isinstance(args, torch.Tensor) else "tuple(args)"
        raise UnsupportedInputError(
            f"export() takes positional arguments as a tuple, got {type(args).__name__}.",
            where=user_frame(),
            fix=f"wrap them in a tuple: export(model, {hint}).",
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise UnsupportedInputError(
            f"export() takes keyword arguments as a dict, got {type(kwargs).__name__}.",
            where=user_frame(),
            fix="pass kwargs={'name': value}.",
        )
    for key in kwargs or {}:
        if not isinstance(key, str):
            raise UnsupportedInputError(
                f"export() takes keyword arguments by name, got the key {key!r} ({type(key).__name__}).",
                where=user_frame(),
                fix="use parameter names as the keys: kwargs={'mask': mask}; pass other values positionally.",
            )
    return args, dict(kwargs or {})


def modules_of(obj: Any, args: Any, kwargs: Any) -> list[nn.Module]:
    """The user's modules an export of `obj` may touch (to protect their training flags)."""
    if isinstance(obj, nn.Module):
        return [obj]
    if not callable(obj) or not isinstance(args, tuple):
        return []
    return [*modules_reached(obj).values(), *_module_leaves(args, kwargs if isinstance(kwargs, dict) else {}, obj).values()]


def register_dataclasses(tree: Any) -> None:
    """Register dataclass types found in `tree` as pytree nodes, as torch.export asks users to.

    The registration is global and permanent (pytree has no way to undo it); it is what lets
    `ep.module()` accept and return the same dataclasses later.
    """
    def visit(node: Any) -> None:
        if is_hf_cache(node) and register_hf_cache(node):
            return
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            cls = type(node)
            if cls not in pytree.SUPPORTED_NODES:
                pytree.register_dataclass(cls)
                registrations.note(cls)  # undone if the export fails
            for field in dataclasses.fields(node):
                visit(getattr(node, field.name))
        elif type(node) in pytree.SUPPORTED_NODES:
            for child in pytree.tree_flatten(node, is_leaf=lambda x: x is not node)[0]:
                visit(child)

    visit(tree)


def is_hf_cache(value: Any) -> bool:
    """A Hugging Face key/value cache (`DynamicCache`, `StaticCache`, `EncoderDecoderCache`, ...):
    what a transformers model returns as `past_key_values` when `use_cache=True`, its default."""
    cls = type(value)
    return cls.__module__.startswith("transformers.") and cls.__name__.endswith("Cache")


def register_hf_cache(cache: Any) -> bool:
    """Register a `DynamicCache`'s class as a pytree node (`register_hf_caches`); whether it is one.

    The other cache classes have no registration in transformers: they stay unsupported.
    """
    if type(cache).__name__ != "DynamicCache" or type(cache).__module__ != "transformers.cache_utils":
        return False
    register_hf_caches()
    return True


def register_hf_caches() -> None:
    """Register transformers' `DynamicCache` as a pytree node, with transformers' own flattening.

    transformers 5 ships the registration torch.export needs for its default cache
    (`register_dynamic_cache_export_support`) but leaves it to the user.  Like the dataclass
    registration above it is global and permanent; it is what lets `ep.module()` return the
    cache, and a process that loads such a program needs it too (`load(path, types=[DynamicCache])`
    makes it: serialize/classes.py).
    """
    from transformers.cache_utils import DynamicCache

    if DynamicCache not in pytree.SUPPORTED_NODES:
        from transformers.integrations.executorch import register_dynamic_cache_export_support

        register_dynamic_cache_export_support()
        registrations.note(DynamicCache)


def hf_cache_fix(value: Any) -> str:
    """The fix for a Hugging Face cache that cannot be exported."""
    return (
        f"{type(value).__name__} is the model's key/value cache, returned because use_cache=True (the default): "
        "pass use_cache=False to the call (export(model, args, {'use_cache': False})) or set "
        "model.config.use_cache = False; predispatch exports transformers' DynamicCache, not other caches."
    )


def _named_leaves(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple[Leaf, ...], pytree.TreeSpec]:
    """Every leaf of `(args, kwargs)` with its path named after the function's parameters."""
    names = _parameter_names(fn, args)
    with_path, in_spec = pytree.tree_flatten_with_path((args, kwargs))
    leaves = []
    for path, value in with_path:
        label = _label(names, path)
        if isinstance(value, torch.Tensor):
            _check_tensor_input(label, value)
            refuse_opaque_subclass(value, f"input {label!r}")
            leaves.append(Leaf(label, True, layout=layout_of(value, label) if is_subclass(value) else None))
        elif isinstance(value, (*CONSTANT_TYPES, nn.Module)):  # modules: lifted by FunctionRoot
            leaves.append(Leaf(label, False, value))
        else:
            raise UnsupportedInputError(
                f"input {label!r} has type {type(value).__name__}, which is neither a tensor nor a constant.",
                where=user_frame(),
                fix=hf_cache_fix(value) if is_hf_cache(value) else "pass tensors, None, bools, numbers or "
                "strings, in tuples/lists/dicts/dataclasses; register other containers with "
                "torch.utils._pytree.register_pytree_node.",
            )
    return tuple(leaves), in_spec


def _check_tensor_input(label: str, tensor: torch.Tensor) -> None:
    """Refuse tensors the fake-tensor trace has no kernels for (quantized tensors, nested
    tensors of the strided layout)."""
    if ti.is_strided_nested(tensor):
        raise UnsupportedInputError(
            f"input {label!r} is a nested tensor of the strided layout (torch.nested's default); fake tensors, "
            "which export traces on, have no kernels for that layout.",
            where=user_frame(),
            fix="build it with layout=torch.jagged (torch.nested.nested_tensor(tensors, layout=torch.jagged), or "
            "torch.nested.nested_tensor_from_jagged(values, offsets)): a jagged nested tensor is exported as its "
            "values and offsets, its jagged length dynamic (docs/subclasses.md).",
        )
    if tensor.is_quantized:
        raise UnsupportedInputError(
            f"input {label!r} is a quantized tensor ({tensor.dtype}); export traces on fake tensors, "
            "which have no quantized kernels.",
            where=user_frame(),
            fix="pass the float tensor (x.dequantize()) and quantize inside forward, or export the float "
            "model and quantize the program (torchao's PT2E flow).",
        )


def _refuse_lazy_state(module: nn.Module) -> None:
    """Refuse uninitialized parameters and buffers (`nn.LazyLinear` before its first call): they
    have no shape yet, so there is nothing to trace; torch's own error reads as a bug inside
    export ("Attempted to use an uninitialized parameter in numel")."""
    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if torch.nn.parameter.is_lazy(tensor):
            raise UnsupportedInputError(
                f"{name!r} is an uninitialized parameter or buffer of a lazy module (nn.LazyLinear, "
                "nn.LazyConv2d, ...): its shape is only known after the module's first call, so there is "
                "nothing to trace yet.",
                where=user_frame(),
                fix="call the model once on an example batch before exporting (model(*args)), which "
                "initializes its lazy modules; then predispatch.export(model, args).",
            )


def _check_state(state: tuple[LiftedTensor, ...]) -> None:
    """Refuse inference tensors as parameters or buffers: a module built or loaded under
    `torch.inference_mode()` has them, and they cannot take part in autograd outside it."""
    for lifted in state:
        if lifted.tensor.is_inference():
            raise UnsupportedInputError(
                f"{lifted.spec.kind.name.lower().replace('_', ' ')} {lifted.spec.target!r} is an inference tensor: "
                "the module was built or loaded under torch.inference_mode(), and such tensors cannot be "
                "traced for training.",
                where=user_frame(),
                fix="build or load the module outside inference_mode, or replace its state by normal "
                "tensors first: model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, "
                "assign=True) outside inference_mode.",
            )


def _parameter_names(fn: Callable[..., Any], args: tuple) -> list[str]:
    """Names for positional arguments: the parameter names, `*args` entries as `args_0`, ..."""
    recorded = getattr(getattr(fn, "__self__", None), "positional_names", None)
    if recorded is not None and len(recorded) == len(args):  # a program's module(): original names
        return list(recorded)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(len(args)):
        if i < len(params) and params[i].kind in (params[i].POSITIONAL_ONLY, params[i].POSITIONAL_OR_KEYWORD):
            names.append(params[i].name)
        else:
            star = next((p.name for p in params if p.kind is p.VAR_POSITIONAL), "args")
            first_star = next((j for j, p in enumerate(params) if p.kind is p.VAR_POSITIONAL), 0)
            names.append(f"{star}_{i - first_star}")
    return names


def _user_input_specs(leaves: tuple[Leaf, ...], taken: set[str]) -> tuple[InputSpec, ...]:
    """One USER_INPUT spec per graph input: a tensor leaf's, or each part of a subclass leaf's."""
    specs = []
    for leaf in leaves:
        if leaf.layout is not None:
            name = unique_identifier(leaf.path, set(taken))
            for path in leaf.layout.paths():
                specs.append(InputSpec(InputKind.USER_INPUT, unique_identifier(part_name(name, path), taken), leaf.path, inner=path))
        elif leaf.is_tensor:
            name = unique_identifier(leaf.path, taken)
            specs.append(InputSpec(InputKind.USER_INPUT, name, leaf.path))
    return tuple(specs)


def _parts_of_inputs(flat: list[Any], leaves: tuple[Leaf, ...]) -> list[torch.Tensor]:
    """The graph's user tensors: each tensor leaf, a subclass leaf as its parts (Note [Tensor subclasses])."""
    tensors: list[torch.Tensor] = []
    for value, leaf in zip(flat, leaves):
        if leaf.layout is not None:
            tensors.extend(leaf.layout.flatten(value))
        elif isinstance(value, torch.Tensor):
            tensors.append(value)
    return tensors


def _parts_with_grad(
    flat: list[Any], leaves: tuple[Leaf, ...], fakes: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[tuple[int, frozenset[str]], ...]]:
    """The fakes of a subclass input that requires grad get it on its floating parts, as the
    state's do (`_fake_state`); and which of those parts the user's tensor holds without grad."""
    fakes_list, position, found = list(fakes), 0, []
    for index, (value, leaf) in enumerate(zip(flat, leaves)):
        if leaf.layout is None:
            position += int(leaf.is_tensor)
            continue
        width = len(leaf.layout.paths())
        if value.requires_grad:
            stored = dict(zip(leaf.layout.paths(), leaf.layout.flatten(value)))
            names = set()
            for offset, path in enumerate(leaf.layout.paths()):
                fake = fakes_list[position + offset]
                if (fake.is_floating_point() or fake.is_complex()) and not fake.requires_grad:
                    fakes_list[position + offset] = fake.detach().requires_grad_(True)
                    names.add(path)
            found.append((index, frozenset(n for n in names if not stored[n].requires_grad)))
        position += width
    return tuple(fakes_list), tuple(found)


def _dynamic_parts(flat: list[Any], leaves: tuple[Leaf, ...]) -> dict[int, dict[int, tuple[int | None, int | None]]]:
    """For each part of a subclass input whose class computes its size from its parts (a jagged
    nested tensor), the dimensions torch.compile would make dynamic (`ti.dynamic_dims`), by the
    part's position among the graph's user tensors (Note [Jagged nested tensors])."""
    marked, position = {}, 0
    for value, leaf in zip(flat, leaves):
        if leaf.layout is None:
            position += int(leaf.is_tensor)
            continue
        for part in leaf.layout.flatten(value):
            dims = ti.dynamic_dims(part) if leaf.layout.sized_by_parts else {}
            if dims:
                marked[position] = dims
            position += 1
    return marked


def _refuse_shared_parts(leaves: tuple[Leaf, ...], repeated: tuple[tuple[int, int], ...]) -> None:
    """Refuse one tensor at two places of the call when one is a part of a subclass sized by its
    parts: two jagged tensors sharing their offsets share a jagged dimension, which the program's
    independent inputs (`_one_twin_per_place`) would not (Note [Jagged nested tensors])."""
    places = [
        (f"{leaf.path}.{path}" if leaf.layout is not None else leaf.path, leaf.layout is not None and leaf.layout.sized_by_parts)
        for leaf in leaves
        if leaf.is_tensor
        for path in (leaf.layout.paths() if leaf.layout is not None else ("",))
    ]
    for position, first in repeated:
        if places[position][1] or places[first][1]:
            raise UnsupportedInputError(
                f"input {places[position][0]!r} is the same tensor as input {places[first][0]!r}: the jagged tensors "
                "share their jagged dimension through it, while the program takes every input as a tensor of its "
                "own, whose jagged dimensions would differ.",
                where=user_frame(),
                fix="pass the jagged tensor once and build the other in forward from its values and the first one's "
                "offsets: torch.nested.nested_tensor_from_jagged(values, x.offsets()).",
            )


def _refuse_dynamic_subclass_inputs(leaves: tuple[Leaf, ...], dynamic_shapes: Any) -> None:
    subclass = next((leaf for leaf in leaves if leaf.layout is not None), None)
    if subclass is not None and dynamic_shapes is not None:
        raise UnsupportedInputError(
            f"input {subclass.path!r} is a tensor subclass ({subclass.layout.cls.__qualname__}) and dynamic_shapes "
            "is given; dynamic_shapes cannot name a subclass's parts, and a program with a subclass input takes "
            "no dynamic_shapes. A jagged nested tensor's jagged length is dynamic without it.",
            where=user_frame(),
            fix="export without dynamic_shapes: a jagged nested tensor's parts are dynamic where torch.compile's "
            "marks say (its values' jagged dimension; torch._dynamo.mark_dynamic(nt.offsets(), 0) for the batch); "
            "or pass the plain tensors the subclass holds as inputs, with dynamic_shapes for them.",
        )


def subclass_parts(state: tuple[LiftedTensor, ...]) -> tuple[LiftedTensor, ...]:
    """Each lifted tensor subclass replaced by its plain tensors (Note [Tensor subclasses]), in
    place, each named after the subclass and the attribute; other state as it is."""
    taken = {lifted.spec.name for lifted in state}
    out: list[LiftedTensor] = []
    for lifted in state:
        tensor, spec = lifted.tensor, lifted.spec
        refuse_opaque_subclass(tensor, f"{spec.kind.name.lower().replace('_', ' ')} {spec.target!r}")
        if not is_subclass(tensor):
            out.append(lifted)
            continue
        layout = layout_of(tensor, spec.target)
        for index, (path, part) in enumerate(zip(layout.paths(), layout.flatten(tensor))):
            name = unique_identifier(part_name(spec.name, path), taken)
            part_spec = dataclasses.replace(spec, name=name, inner=path)
            out.append(dataclasses.replace(lifted, spec=part_spec, tensor=part, part=SubclassPart(layout, tensor, index)))
    return tuple(out)


_FX_RESERVED = ti.fx_reserved_names()


def unique_identifier(label: str, taken: set[str]) -> str:
    """A Python identifier made from `label`, not in `taken` (which it is then added to).

    Nor one FX reserves (`input`, `list`, `torch`): FX would rename the node (`input_1`), and
    the name recorded here must stay the graph's (save/load checks they agree).
    """
    base = re.sub(r"\W+", "_", label).strip("_") or "arg"
    if base[0].isdigit():
        base = "_" + base
    name, i = base, 1
    while name in taken or name in _FX_RESERVED:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def lift_state(module: nn.Module, beyond: Beyond | None = None) -> tuple[LiftedTensor, ...]:
    """Parameters, buffers and tensor attributes of `module`, deduplicated, by fully qualified name.

    Order: parameters, then buffers, then constant tensors, each in module registration order
    (AOTAutograd places parameters before buffers; we keep that order in the graph).
    A tensor reachable under several names (tied weights) is lifted once, under its first name,
    with the other names recorded as aliases.  With `beyond`, the state of modules outside the
    registered tree and tensors in plain containers come after the tree's, named by their
    paths (see Note [Modules outside the registered tree]).
    """
    taken: set[str] = set()
    lifted: list[LiftedTensor] = []
    outside = beyond.modules if beyond is not None else {}
    groups = (
        (InputKind.PARAMETER, _named_beyond(module, outside, lambda m: m.named_parameters(remove_duplicate=False))),
        (InputKind.BUFFER, _named_beyond(module, outside, lambda m: m.named_buffers(remove_duplicate=False))),
        (InputKind.CONSTANT_TENSOR, _named_beyond(module, outside, _tensor_attributes)),
        (InputKind.CONSTANT_TENSOR, (beyond.tensors.items() if beyond is not None else ())),
    )
    seen: dict[int, int] = {}
    aliases: dict[int, list[str]] = {}
    bind_also: dict[int, list[str]] = {}
    for kind, named in groups:
        for fqn, tensor in named:
            if id(tensor) in seen:
                in_container = beyond is not None and beyond.tensors.get(fqn) is tensor
                (bind_also if in_container else aliases).setdefault(seen[id(tensor)], []).append(fqn)
                continue
            seen[id(tensor)] = len(lifted)
            name = unique_identifier(PLACEHOLDER_PREFIX[kind] + fqn, taken)
            persistent = _is_persistent(module, fqn) if kind is InputKind.BUFFER else None
            lifted.append(LiftedTensor(InputSpec(kind, name, fqn, (), persistent), tensor))
    for index, names in aliases.items():
        spec = lifted[index].spec
        lifted[index] = LiftedTensor(dataclasses.replace(spec, aliases=tuple(names)), lifted[index].tensor)
    for index, names in bind_also.items():
        lifted[index] = dataclasses.replace(lifted[index], bind_also=tuple(names))
    return tuple(lifted)


def _named_beyond(module: nn.Module, outside: dict[str, nn.Module], named: Callable[[nn.Module], Any]):
    """`named(module)`, then `named(m)` of each module outside the tree, prefixed by its path."""
    yield from named(module)
    for path, other in outside.items():
        for fqn, tensor in named(other):
            yield f"{path}.{fqn}", tensor


def _tensor_attributes(module: nn.Module):
    """Plain tensor attributes (not parameters or buffers) of every submodule, as (fqn, tensor)."""
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield (f"{prefix}.{attr}" if prefix else attr), value


def _is_persistent(module: nn.Module, fqn: str) -> bool:
    owner, _, attr = fqn.rpartition(".")
    return attr not in resolve(module, owner)._non_persistent_buffers_set


def _inputs_device(leaves: list[Any]) -> torch.device:
    """Where the real computation happens: the first non-meta tensor input's device; meta when
    every tensor input is meta (the user traces shapes only, all on meta, as torch.export does:
    state moved to CPU would meet the meta inputs in one op); CPU when there is none."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    if tensors and all(x.is_meta for x in tensors):
        return torch.device("meta")
    return next((x.device for x in tensors if not x.is_meta), torch.device("cpu"))


def _alone_in_storage(tensors: list[torch.Tensor]) -> frozenset[int]:
    """The ids of the tensors among `tensors` whose storage no other of them uses (a tensor
    passed twice shares its own; every kind of tensor counts, so a subclass over a plain
    tensor's storage keeps that one off the short way): `ti.fake_of_plain` may fakify those
    without the general path, which keeps storage sharing."""
    owners: dict[int | None, list[int]] = {}
    for t in tensors:
        owners.setdefault(ti.storage_key(t), []).append(id(t))
    return frozenset(ids[0] for key, ids in owners.items() if key is not None and len(ids) == 1)


def _fakify(
    fake_mode: ti.FakeTensorMode,
    tensor: torch.Tensor,
    parameter: bool = False,
    device: torch.device | None = None,
    alone: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """A fake twin with static shapes (dynamic dimensions are opted into, later).

    A tensor of another trace (an export nested in an export sees the outer trace's tensors)
    has no data to convert: its twin is made from its metadata alone.  A meta tensor (a model
    built under `torch.device("meta")`) gets its twin on `device`, where its real data will be.
    A plain tensor alone in its storage (`alone`, by id) takes `ti.fake_of_plain`'s short way.
    """
    fake: torch.Tensor | None
    if tensor.is_meta and device is not None and type(tensor) in (torch.Tensor, nn.Parameter):
        fake = ti.fake_of_meta(fake_mode, tensor, device)
    elif type(tensor) in (torch.Tensor, nn.Parameter):
        fake = ti.fake_of_plain(fake_mode, tensor) if id(tensor) in alone else None
        if fake is None:
            fake = fake_mode.from_tensor(tensor, static_shapes=True)
    else:
        fake = _fake_from_metadata(fake_mode, tensor)
    if parameter and not isinstance(fake, nn.Parameter):  # from_tensor keeps a Parameter's class already
        fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
    return fake
