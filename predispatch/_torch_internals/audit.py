"""What the composite audit (predispatch/audit/) asks of torch's dispatcher: the
CompositeImplicitAutograd registrations, their C++ and Python kernels, op_db, and which ops
torch.export keeps whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode
from torch._subclasses.schema_check_mode import SchemaCheckMode
from torch.fx.node import _side_effectful_functions
from torch.utils._python_dispatch import TorchDispatchMode

from predispatch._torch_internals.decomposition import torch_can_decompose_fast


# --- The composite audit (predispatch/audit/) -----------------------------------------------

CIA = torch._C.DispatchKey.CompositeImplicitAutograd


def cia_registrations() -> list[str]:
    """Names ("aten::to.dtype") of every op with a C++ CompositeImplicitAutograd kernel."""
    return list(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd"))


def aten_overloads() -> list[OpOverload]:
    """Every aten overload loaded in ``torch.ops.aten`` that the C++ dispatcher knows.

    ``torch.ops.aten`` also lists TorchScript-only overloads (``aten::add.t``); the
    dispatcher has never heard of those and answers questions about them with errors.
    """
    found = []
    for name in list(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        for overload in (getattr(packet, n) for n in packet.overloads()):  # `op_overloads()` is 2.13+
            if torch._C._dispatch_has_kernel(overload.name()):
                found.append(overload)
    return found


def has_cpp_cia_kernel(op: OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), CIA)


def python_cia_kernel(op: OpOverload) -> Callable[..., Any] | None:
    """The ``py_impl(CompositeImplicitAutograd)`` kernel, if torch registered one in Python."""
    kernel = op.py_kernels.get(CIA)
    return kernel if callable(kernel) and not isinstance(kernel, torch._C.DispatchKey) else None


def run_cpp_cia_kernel(op: OpOverload, *args: Any, **kwargs: Any) -> Any:
    """Run the C++ CIA kernel itself, skipping any Python kernel ``op.decompose`` would prefer."""
    return op._op_dk(CIA, *args, **kwargs)


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the StorageImpl behind ``t``: equal for every view of one storage.

    ``data_ptr`` would not do: every empty storage has data pointer 0.  Tensors without
    a storage (sparse, nested) have no key.
    """
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def side_effectful_ops() -> frozenset[OpOverload]:
    """The ops torch.fx refuses to dead-code-eliminate because they have side effects."""
    return frozenset(f for f in _side_effectful_functions if isinstance(f, OpOverload))


def load_op_db() -> list[Any]:
    """torch's OpInfo database; imported lazily because it takes a few seconds."""
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


class PreDispatchMode(SchemaCheckMode):
    """Base for a dispatch mode that sits on the PreDispatch key, above autograd.

    A mode there sees CompositeImplicitAutograd ops before their kernels decompose them.
    torch only admits three mode classes onto that key (``_set_mode_pre_dispatch``), one of
    them ``SchemaCheckMode``; subclassing it is the admission ticket, nothing of its checking
    is used.  The key is consulted only while the Python dispatcher is on: run under
    ``enable_python_dispatcher()``.
    """

    def __init__(self) -> None:
        TorchDispatchMode.__init__(self, torch._C.DispatchKey.PreDispatch)


def torch_keeps_whole_in_export(op: OpOverload) -> bool:
    """Whether torch's own pre-dispatch export would keep `op` whole (its `_can_decompose` says no)."""
    return torch_can_decompose_fast(op, True, True) is False


def fake_of_meta(fake_mode: FakeTensorMode, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor with `t`'s metadata on `device`: a meta model's weight, traced as if real.

    A model built under `torch.device("meta")` has no data, only shapes; tracing it on the meta
    device would record `device=meta` into factory ops and pick meta kernels' strides.  Its
    fakes are made on the device the real weights will live on (the inputs' device) instead.
    """
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, t, device)
