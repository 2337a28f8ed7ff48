"""Keep autograd history across in-place updates made while grad mode is off.

Note [Mutations inside grad regions]
------------------------------------
Eager autograd does not see an in-place op run under `no_grad`: the tensor's data changes, its
history (`grad_fn`, or leaf-ness) stays.  So after

    h = x * 3
    with torch.no_grad():
        h.mul_(2)
    return h * x

`h` still requires grad and d(out)/dx = 3*x + 6*x.  Functionalization rewrites the update as
`h1 = mul(h, 2)` computed under no_grad, and later uses read `h1`, which has *no* history:
the exported program would give 6*x.  The same happens to a parameter updated under no_grad
(an EMA) and to a user input mutated under no_grad, when they are used afterwards.

The fix is made during the trace, where in-place ops are still visible (in FunctionalTensorMode):
every tensor written by an in-place op while grad mode is off is remembered with its value
before the first such write; when grad mode is switched back on, each is rebound to

    keep_history(new_value, old_value)       # predispatch::keep_history

which has the new value exactly and passes gradients to the old value's history as identity.
It is emitted *outside* the region (grad on), so its autograd edge exists at run time.

Which tensors: every floating tensor written while grad is off, except tensors created in that
same no-grad stretch and buffers/constants that do not require grad.  `requires_grad` cannot
decide more: the trace does not compute it for intermediates, and a user input or parameter may
require grad at run time though its example did not.
`keep_history` is value-exact, so a spurious one changes no number and no gradient: at run
time autograd decides whether the old value has any history.

A stretch that is still open when forward returns (a plain `torch.set_grad_enabled(False)`
never undone) gets no rebinding: nothing after it runs with grad on.

Note [Writes through a detached alias]
--------------------------------------
`p.detach().mul_(0.5)`, `p.data.mul_(0.5)`, `nn.Embedding(max_norm=...)` (which renormalises
`weight.detach()` in place) and a buffer lifted as a view of a parameter (Note [State that
shares storage]) change a tensor's data behind autograd's back, with grad mode on or off: eager
keeps the tensor's history (a parameter stays a leaf), and its later uses differentiate as if
the change were not there.  Functionalization gives the tensor a new value computed from its
detached alias, with no history.  So each `detach` (and each view of one) remembers the tensor
it was taken from; a write through it is treated as a write of that tensor made with grad off:
the tensor is rebound to `keep_history(new_value, old_value)` right after a write made with grad
on (at the next grad-on switch after one made with grad off), which also tells `ep.module()` that the write ran with grad
off (runtime/writes.py), as eager's did.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch.overrides import TorchFunctionMode

from predispatch import _meta
from predispatch import _torch_internals as ti
from predispatch import ops  # noqa: F401 - registers predispatch::keep_history
from predispatch.errors import user_frame
from predispatch.trace.outside_tensors import refuse_write_into_real
from predispatch.trace.scatter_gradients import note_direct_call


def _writes_metadata(func: torch._ops.OpOverload) -> bool:
    """An in-place op that changes its first argument's shape, strides or storage (`t_`, `resize_`, `set_`)."""
    return torch.Tag.inplace_view in func.tags or func.overloadpacket in (torch.ops.aten.resize_, torch.ops.aten.set_)


def _called_from_exit() -> bool:
    """Whether this grad toggle is a context manager's `__exit__` (closing a region).

    `enable_grad().__enter__` and `no_grad().__exit__` both record `_set_grad_enabled(True)`;
    only the Python caller tells a region's end from a nested region's start.  A program's
    own region HOP (`wrap_with_set_grad_enabled`, run when an exported program is exported
    again) restores the mode in its `wrapper` once the body has run, i.e. once `res` is bound.
    """
    frame = sys._getframe(2)
    for _ in range(5):
        if frame is None:
            break
        code = frame.f_code
        if code.co_filename.endswith("grad_mode.py") and code.co_name == "__exit__":
            return True
        if code.co_filename.endswith(_HOP_FILE) and code.co_name == "wrapper":
            return "res" in frame.f_locals
        frame = frame.f_back
    return False


_HOP_FILE = os.path.join("_higher_order_ops", "wrap.py")

_DATA = vars(torch._C.TensorBase)["data"]


def _is_data_get(func: Any) -> bool:
    """Whether a torch function is `tensor.data`'s getter (Note [Writes through a detached alias])."""
    return getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", None) == "__get__"


class GradHistoryKeeper(TorchFunctionMode):
    """Active around the user's forward during the trace; see Note [Mutations inside grad regions]."""

    def __init__(self, without_history: list[torch.Tensor], inputs: list[torch.Tensor] = ()):
        super().__init__()
        self._inputs = _IdentitySet(inputs)
        self._born_without_grad = _IdentitySet(without_history)
        self._used = _IdentitySet()  # tensors some op has read (see `was_used`)
        #: where forward first changed an input's shape, strides or storage in place (`x.t_()`),
        #: for the error a functional graph's refusal of it gives
        self.input_metadata_write: str | None = None
        #: grad-mode changes the trace did not record as graph nodes: the region capture did not
        #: engage (`trace/functional.py` `_check_engaged` raises)
        self.toggles_unrecorded = 0
        self.open_regions = 0  # grad regions entered and not exited: > 0 when forward returns
        # means forward leaves grad mode set for its caller (a plain set_grad_enabled call)
        self._pending = _Writes()  # written with grad off, rebound at the next grad-on switch
        #: a detached alias (or a view of one) -> the tensor it aliases, which keeps its history
        self._detached_from = _IdentityMap()
        self._behind_autograd = _Writes()  # written through an alias, grad on
        self._first_args: list[Any] = []  # the first argument of each op being dispatched, innermost last

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _is_data_get(func) and isinstance(args[0], ti.FunctionalTensor):
            # a FunctionalTensor's `.data` is the tensor itself, history included: the trace
            # would differentiate through it, and see a write through it as a write of the
            # tensor.  `.detach()` is what it is in eager (Note [Writes through a detached alias]).
            return args[0].detach()
        if func is not torch._C._set_grad_enabled:
            return func(*args, **kwargs)
        was_enabled = torch.is_grad_enabled()
        result = func(*args, **kwargs)
        closing = _called_from_exit()
        if isinstance(result, fx.Node):  # recorded in the graph: tell wrap_regions how to nest
            result.meta[_meta.GRAD_TOGGLE] = "exit" if closing else "enter"
            # only a recorded toggle is the program's: one made while no tracer records (torch
            # 2.11's while_loop compiles its body with Dynamo, which restores grad mode after)
            # is torch's own, and counted it would leave grad mode set for the caller
            self.open_regions += -1 if closing else 1
        elif ti.current_tracer() is not None:
            self.toggles_unrecorded += 1
        if args[0] and not was_enabled:
            self._rebind_pending()
        return result

    def observer(self):
        """The hooks to install on FunctionalTensorMode while this keeper is active."""
        return ti.functional_dispatch_observer(self._before_op, self._after_op)

    def is_input(self, t: Any) -> bool:
        """Whether `t` is one of the graph's inputs (lifted state or user tensor)."""
        return t in self._inputs

    def was_used(self, t: Any) -> bool:
        """Whether an op has read `t` (a FunctionalTensor) since the trace began."""
        return t in self._used

    def _before_op(self, mode, func, args, kwargs) -> None:
        self._first_args.append(args[0] if args else None)  # for `_after_op`, which sees no args
        for value in _tensor_leaves(func, args, kwargs):
            if isinstance(value, ti.FunctionalTensor):
                self._used.add(value)
        if not isinstance(func, torch._ops.OpOverload) or not func._schema.is_mutable:
            return
        refuse_write_into_real(func, args, kwargs)  # Note [Tensors from outside the module]
        if self.input_metadata_write is None and args and self.is_input(args[0]) and _writes_metadata(func):
            self.input_metadata_write = user_frame()
        for value, schema_arg in zip((*args, *kwargs.values()), func._schema.arguments):
            info = schema_arg.alias_info
            if info is None or not info.is_write:
                continue
            aliased = self._detached_from.get(value)
            if aliased is not None:  # Note [Writes through a detached alias]
                self._remember(self._pending if not torch.is_grad_enabled() else self._behind_autograd, aliased, mode)
            elif not torch.is_grad_enabled() and self._keeps_history(value):
                self._remember(self._pending, value, mode)

    def _remember(self, pending: _Writes, tensor: Any, mode: Any) -> None:
        """Keep `tensor`'s value before its first write of this stretch, to rebind it to later."""
        if tensor not in self._pending and tensor not in self._behind_autograd:
            pending.add(tensor, ti.functional_value(tensor), mode)

    def _after_op(self, func, out) -> None:
        note_direct_call(func, out)  # Note [as_strided_scatter's gradient]
        self._note_detached_aliases(func, out, self._first_args.pop() if self._first_args else None)
        if self._behind_autograd:  # Note [Writes through a detached alias]
            pending = self._behind_autograd.take()
            with pending[0][2]:  # in the functional mode again, as its rewrites run
                self._rebind(pending)
        if torch.is_grad_enabled():
            return
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, ti.FunctionalTensor) and t not in self._pending:
                self._born_without_grad.add(t)

    def _keeps_history(self, t: Any) -> bool:
        if not isinstance(t, ti.FunctionalTensor) or not (t.is_floating_point() or t.is_complex()):
            return False
        return t not in self._born_without_grad

    def _note_detached_aliases(self, func, out, source) -> None:
        """Remember what a `detach` output, or a view of a remembered alias, aliases: a tensor
        whose history a write through the alias must not lose."""
        if not isinstance(func, torch._ops.OpOverload) or not isinstance(out, ti.FunctionalTensor):
            return
        if func is torch.ops.aten.detach.default and self._keeps_history(source):
            earlier = self._detached_from.get(source)  # a tensor: `or` would ask for its truth value
            self._detached_from.set(out, earlier if earlier is not None else source)
        elif func.is_view and self._detached_from.get(source) is not None:
            self._detached_from.set(out, self._detached_from.get(source))

    def _rebind_pending(self) -> None:
        self._rebind(self._pending.take())

    @staticmethod
    def _rebind(pending: list) -> None:
        for tensor, before, mode in pending:
            old = ti.wrap_functional(before, mode)
            tensor.copy_(torch.ops.predispatch.keep_history(tensor, old))


def _tensor_leaves(func: Any, args: tuple, kwargs: dict) -> Iterable[Any]:
    """The leaves of an op's arguments that may be tensors.  An op overload's arguments are
    values or lists of values (`Tensor[]`, `Tensor?[]`): two loops, not a pytree walk, which was
    a fifth of this hook's cost per op; anything else (a higher-order op) is walked whole."""
    if not isinstance(func, torch._ops.OpOverload):
        return pytree.tree_leaves((args, kwargs))
    leaves: list[Any] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            leaves.extend(value)
        else:
            leaves.append(value)
    return leaves


class _Writes:
    """The tensors written in one stretch, in order, each with its value before the stretch's
    first write and the functional mode of that write; asked by identity whether it holds a
    tensor.  A stretch may write every parameter (an EMA under no_grad) and both questions come
    once per write and once per op output: an index, not a scan of the list, keeps that linear."""

    def __init__(self) -> None:
        self.items: list[tuple[Any, torch.Tensor, Any]] = []  # (tensor, value before, mode)
        self._ids: set[int] = set()  # the items hold their tensors, so an id stays theirs

    def __bool__(self) -> bool:
        return bool(self.items)

    def __contains__(self, tensor: Any) -> bool:
        return id(tensor) in self._ids

    def add(self, tensor: Any, before: torch.Tensor, mode: Any) -> None:
        self.items.append((tensor, before, mode))
        self._ids.add(id(tensor))

    def take(self) -> list[tuple[Any, torch.Tensor, Any]]:
        """The items, in order; the stretch starts empty again."""
        items, self.items, self._ids = self.items, [], set()
        return items


class _IdentityMap:
    """A map from objects by identity to values, holding the keys weakly."""

    def __init__(self):
        self._items: dict[int, tuple[weakref.ref, Any]] = {}

    def set(self, key: Any, value: Any) -> None:
        self._items[id(key)] = (weakref.ref(key), value)

    def get(self, key: Any) -> Any:
        ref, value = self._items.get(id(key), (None, None))
        return value if ref is not None and ref() is key else None


class _IdentitySet:
    """A set of objects by identity, holding them weakly (tensors compare elementwise with ==)."""

    def __init__(self, items: Iterable[Any] = ()):
        self._refs: dict[int, weakref.ref] = {}
        for item in items:
            self.add(item)

    def add(self, item: Any) -> None:
        self._refs[id(item)] = weakref.ref(item)

    def __contains__(self, item: Any) -> bool:
        ref = self._refs.get(id(item))
        return ref is not None and ref() is item
