"""`ProgramModule`: run an `ExportedProgram` with the original calling convention."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from predispatch import _torch_internals as ti
from predispatch.passes import inlined_copy
from predispatch.errors import DynamicShapeError, InputMismatchError, user_frame
from predispatch.program.signature import InputKind, OutputKind, ShapeRecord

if TYPE_CHECKING:
    from predispatch.program.exported_program import ExportedProgram

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


class ProgramModule(nn.Module):
    """Holds copies of the program's state under the original fully qualified names.

    Submodules are plain `nn.Module` containers mirroring the original hierarchy, so
    `state_dict()` keys (tied names included) equal the original module's.
    """

    def __init__(self, ep: ExportedProgram):
        super().__init__()
        object.__setattr__(self, "_program", ep)  # not a submodule: keeps state_dict() clean
        object.__setattr__(self, "_live", ep.live_root)
        if ep.live_root is not None:  # share the user's modules: state is read at each call
            for name, child in ep.live_root.named_children():
                self.add_module(name, child)
        else:
            for spec in ep.signature.inputs_of(*_STATE_KINDS):
                source = ep.constants[spec.target] if spec.kind is InputKind.CONSTANT_TENSOR else ep.state_dict[spec.target]
                tensor = _copy(source, spec.kind)
                for fqn in (spec.target, *spec.aliases):
                    _install(self, fqn, tensor, spec.kind, spec.persistent)
        self._prepare_calls()

    def _prepare_calls(self) -> None:
        """Resolve, once, what every call needs: the module owning each state tensor (read by
        attribute at call time, so reassigned or live tensors are seen) and which graph outputs
        write back where."""
        sig = self._program.signature
        root = self._live if self._live is not None else self
        owners = [_owner(root, spec.target) for spec in sig.inputs_of(*_STATE_KINDS)]
        user_index = {spec.name: i for i, spec in enumerate(sig.inputs_of(InputKind.USER_INPUT))}
        writes = [
            (None, user_index[s.target]) if s.kind is OutputKind.USER_INPUT_MUTATION else _owner(root, s.target)
            for s in sig.mutations
        ]
        object.__setattr__(self, "_state_owners", owners)
        # shared bodies inlined: torch's eager invoke_subgraph differentiates only under a fake mode
        object.__setattr__(self, "_graph", inlined_copy(self._program.graph_module))
        object.__setattr__(self, "_writes", writes)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ep = self._program
        sig = ep.signature
        user = _user_tensors(ep, args, kwargs)
        state = [getattr(owner, attr) for owner, attr in self._state_owners]
        targets = [user[attr] if owner is None else getattr(owner, attr) for owner, attr in self._writes]
        mutations = sig.mutations
        with _snapshot_saved(targets):
            outs = self._graph(*state, *user)
        for target, value in zip(targets, outs):
            _write_back(target, value)
        if sig.grad_mode_on_exit is not None:
            torch.set_grad_enabled(sig.grad_mode_on_exit)
        results = iter(outs[len(mutations):])
        leaves = [next(results) if leaf.is_tensor else leaf.value for leaf in sig.output_leaves]
        return pytree.tree_unflatten(leaves, sig.out_spec)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """As the exported module's `state_dict()`, its state_dict hooks applied, with our tensors."""
        owner = self._program.state_dict_owner
        if owner is None:
            return super().state_dict(*args, **kwargs)
        with ti.reparametrize(owner, self._bindings()):
            return owner.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As the exported module's `load_state_dict()`, its hooks applied, loading into our tensors."""
        owner = self._program.state_dict_owner
        if owner is None:
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        with ti.reparametrize(owner, self._bindings()):
            return owner.load_state_dict(state_dict, strict=strict)

    def _bindings(self) -> dict[str, torch.Tensor]:
        """Every fully qualified name of the program's state, bound to this module's tensor."""
        return {
            fqn: self._lookup(spec.target)
            for spec in self._program.signature.inputs_of(*_STATE_KINDS)
            for fqn in (spec.target, *spec.aliases)
        }

    @property
    def positional_names(self) -> tuple[str, ...]:
        """The exported callable's positional parameter names (read by a re-export)."""
        return self._program.signature.arg_names

    def _lookup(self, fqn: str) -> torch.Tensor:
        return getattr(*_owner(self._live if self._live is not None else self, fqn))


def _copy(tensor: torch.Tensor, kind: InputKind) -> torch.Tensor:
    copy = tensor.detach().clone()
    if kind is InputKind.PARAMETER:
        return nn.Parameter(copy, requires_grad=tensor.requires_grad)
    return copy


def _install(root: nn.Module, fqn: str, tensor: torch.Tensor, kind: InputKind, persistent: bool | None) -> None:
    """Put `tensor` at `fqn`, creating empty container modules along the path."""
    *path, attr = fqn.split(".")
    owner = root
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if kind is InputKind.PARAMETER:
        owner.register_parameter(attr, tensor)
    elif kind is InputKind.BUFFER:
        owner.register_buffer(attr, tensor, persistent=persistent is not False)
    else:
        setattr(owner, attr, tensor)


def _owner(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    owner, _, attr = fqn.rpartition(".")
    return root.get_submodule(owner), attr


def _user_tensors(ep: ExportedProgram, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor leaves of the call, after checking it matches the exported call."""
    sig = ep.signature
    flat, spec = pytree.tree_flatten((args, kwargs))
    if spec != sig.in_spec:
        raise InputMismatchError(
            f"the program was exported for inputs structured as\n    {sig.in_spec}\nbut was called with\n    {spec}",
            where=user_frame(),
            fix="call it with the same structure of args and kwargs as at export, or export again.",
        )
    tensors = []
    placeholders = ep.graph.find_nodes(op="placeholder")[len(sig.inputs_of(*_STATE_KINDS)) :]
    examples = iter(n.meta.get("val") for n in placeholders)
    for leaf, value in zip(sig.input_leaves, flat):
        if leaf.is_tensor:
            _check_tensor(leaf.path, value, next(examples))
            tensors.append(value)
        elif type(value) is not type(leaf.value) or (value is not leaf.value and value != leaf.value):
            raise InputMismatchError(
                f"input {leaf.path!r} was {leaf.value!r} at export and is {value!r} now; "
                "constants are baked into the program.",
                where=user_frame(),
                fix="call with the exported value, or export again with this one.",
            )
    if sig.shapes.is_dynamic:
        paths = [leaf.path for leaf in sig.input_leaves if leaf.is_tensor]
        _check_symbols(sig.shapes, paths, tensors)
    return tensors


def _check_symbols(shapes: ShapeRecord, paths: list[str], tensors: list[torch.Tensor]) -> None:
    """Bind each symbol to the size it has in this call; check equal symbols, ranges, expressions."""
    import sympy

    bound: dict[str, int] = {}
    derived = []
    for path, tensor, dims in zip(paths, tensors, shapes.input_shapes):
        for i, (dim, size) in enumerate(zip(dims, tensor.shape)):
            if isinstance(dim, str) and dim.isidentifier():
                if bound.setdefault(dim, size) != size:
                    _shape_error(f"{path}.shape[{i}] is {size} but {dim} is {bound[dim]} from an earlier input")
            elif isinstance(dim, str):
                derived.append((path, i, dim, size))
    for name, lo, hi in shapes.ranges:
        if name in bound and not (lo <= bound[name] and (hi is None or bound[name] <= hi)):
            _shape_error(f"{name} = {bound[name]} is outside its range [{lo}, {'inf' if hi is None else hi}]")
    for path, i, expr, size in derived:
        if int(sympy.sympify(expr).subs(bound)) != size:
            _shape_error(f"{path}.shape[{i}] is {size} but must equal {expr} = {sympy.sympify(expr).subs(bound)}")


def _shape_error(what: str) -> None:
    raise DynamicShapeError(
        f"this call's shapes do not fit the program: {what}.",
        where=user_frame(),
        fix="call with sizes inside the ranges print(ep) shows, or export again with wider dynamic_shapes.",
    )


def _check_tensor(path: str, value: Any, example: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise InputMismatchError(
            f"input {path!r} was a tensor at export and has type {type(value).__name__} now.", where=user_frame()
        )
    if example is None:
        return
    wrong_rank = value.dim() != len(example.shape)
    static_dims = [(a, e) for a, e in zip(value.shape, example.shape) if isinstance(e, int)]
    if value.dtype != example.dtype or wrong_rank or any(a != e for a, e in static_dims):
        raise InputMismatchError(
            f"input {path!r} was exported as {example.dtype} {tuple(example.shape)} and is "
            f"{value.dtype} {tuple(value.shape)} now.",
            where=user_frame(),
            fix="call with the exported shape and dtype, export again, or mark the dimension dynamic.",
        )


def _snapshot_saved(targets: list[torch.Tensor]):
    """Autograd saves what the graph read; clone it when it is about to be written back.

    Eager updates such inputs inside the kernel (batch norm's running stats) or after saving
    nothing of them; the program reads them, may save them for backward, and then writes the
    new values back in place, which would bump the saved tensors' versions.  Saving a copy of
    exactly those tensors keeps backward's view of the values the graph read.
    """
    if not targets or any(type(t) not in (torch.Tensor, nn.Parameter) for t in targets):
        return contextlib.nullcontext()  # nothing written back, or being traced (a re-export)
    storages = {t.untyped_storage().data_ptr() for t in targets}

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if storages and t.untyped_storage().data_ptr() in storages else t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _write_back(target: torch.Tensor, value: torch.Tensor) -> None:
    """Apply a mutation as eager would: in place, autograd-visible unless the target is a leaf."""
    if target.is_leaf and target.requires_grad:
        with torch.no_grad():
            target.copy_(value)
    else:
        target.copy_(value)
