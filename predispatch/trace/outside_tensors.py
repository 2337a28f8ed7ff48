"""Tensors forward reads from outside its module: module-level globals, closures.

Note [Tensors from outside the module]
--------------------------------------
`SCALE = torch.tensor(2.0)` at module level, `return x * SCALE` in forward: the tensor is
neither state of the module nor an input, so the trace meets it as a real tensor.  As in
torch.export, it is a constant of the program: the trace's fake mode takes real tensors
(`allow_non_fake_inputs`, `ti.new_fake_mode(real_constants=True)`) and the proxy tracer holds
each as a `get_attr` constant (`_tensor_constant0`), as it holds a tensor made in forward.
Eager reads the global at each call, so the program computes what eager computes as long as
the global keeps its value (torch.export's lifted constants behave alike).

A tensor made in forward by a constructor that bypasses torch's ops (`torch.from_numpy`,
`torch.frombuffer`) is made by the fake mode itself, without its values, and reaches the
graph as a `get_attr` of a fake tensor: `ep.module()` returned a FakeTensor, silently.
`torch.as_tensor(array)` and `torch.tensor(array)` go through `lift_fresh`, which the tracer
records with the values; the refusal names them.

Two uses would make the program differ from eager, and are refused by name instead:
- a constant that requires grad (a module-level `nn.Parameter`): eager differentiates it,
  a constant has no gradient (`UnsupportedInputError`);
- an in-place write into it (`COUNT.add_(1)`): eager changes the global at every call, the
  program would hold a mutable op on a constant (`OutsideWriteError`).  It is refused as the
  functional mode meets it (`refuse_write_into_real`, called by the trace's op observer),
  before it runs: make_fx's constant propagation runs a small op on real arguments for real,
  which would write into the user's global during export.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import fx, nn

from predispatch import _torch_internals as ti
from predispatch.errors import OutsideWriteError, UnsupportedConstructError, UnsupportedInputError, user_frame
from predispatch._meta import stack_line

__all__ = ["refuse_outside_tensor_uses", "refuse_write_into_real"]


def refuse_outside_tensor_uses(gm: fx.GraphModule) -> None:
    """Refuse a real tensor from outside the module that requires grad (its writes are refused
    as they happen, `refuse_write_into_real`), and a constant made without its values."""
    for graph_module in gm.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        for node in graph_module.graph.find_nodes(op="get_attr"):
            value = getattr(graph_module, node.target, None)
            if not isinstance(value, torch.Tensor):
                continue
            if ti.is_traced_tensor(value):
                raise UnsupportedConstructError(
                    "forward makes a tensor with a constructor that bypasses torch's ops (torch.from_numpy, "
                    "torch.frombuffer): the trace's fake mode made it without its values, so the program would "
                    "hold a tensor with no data (Note [Tensors from outside the module]).",
                    where=_reading_line(node) or f"{user_frame()} (the export call)",
                    fix="build it with torch.as_tensor(array) or torch.tensor(array), whose values the program "
                    "records; or make it before export and register it as a buffer of the module.",
                )
            if value.requires_grad:
                line = _reading_line(node)
                raise UnsupportedInputError(
                    f"forward reads {_name(value, line)}, a tensor that requires grad but is not the module's "
                    "parameter: the program would hold it as a constant, without the gradient eager computes for it.",
                    where=line or f"{user_frame()} (the export call)",
                    fix="make it the module's parameter (self.w = nn.Parameter(...), or a submodule holding it), "
                    "or read it detached (W.detach()) if it is not trained.",
                )


def _reading_line(node: fx.Node) -> str | None:
    """The user's line that read the constant: its first reader's.  The `get_attr` node's own
    stack trace is where the tracer made that node; in one full-suite run on torch 2.15 it named
    the enclosing `def` line instead of the reading one (not reproduced alone)."""
    readers = (stack_line(user) for user in node.users)
    return next((line for line in readers if line), None) or stack_line(node)


def refuse_write_into_real(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> None:
    """Refuse an in-place op whose written argument is a real tensor (one from outside the
    module), before it runs: the trace's constant propagation would run it on that tensor."""
    for value, schema_arg in zip((*args, *kwargs.values()), func._schema.arguments):
        info = schema_arg.alias_info
        if info is None or not info.is_write or not isinstance(value, torch.Tensor) or ti.is_traced_tensor(value):
            continue
        raise OutsideWriteError(
            f"forward writes in place ({func}) into {_name(value, user_frame())}, a tensor that is not the "
            "module's state nor an input: eager changes it at every call, a program cannot.",
            where=user_frame(),
            fix="register it as a buffer of the module (self.register_buffer(...)): the program then writes "
            "it back as eager does; or compute a new tensor instead of writing in place.",
        )


def _name(value: torch.Tensor, line: str | None) -> str:
    """The global that holds `value` in the file of the user's `line` (`path:line (code)`), else
    a description."""
    path = os.path.abspath(line.split(" (", 1)[0].rsplit(":", 1)[0]) if line else None
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if path is None or not file or os.path.abspath(file) != path:
            continue
        for name, held in vars(module).items():
            if held is value:
                kind = "parameter" if isinstance(value, nn.Parameter) else "tensor"
                return f"the module-level {kind} {module.__name__}.{name}"
    return "a tensor from outside the module (a module-level global or a closure)"
