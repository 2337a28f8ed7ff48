"""Backward hooks: capture the ones that are tensor functions, refuse the rest by name.

Forward hooks and pre-hooks simply run during the trace, so they are in the graph.  Backward
hooks are different: torch installs them on autograd nodes, which a trace on fake tensors
never builds, so torch's own export drops them without a word.

`Tensor.register_hook(hook)` on an intermediate is captured (tensor.py): the tensor is rebound
to an identity `autograd.Function` whose backward is the hook, which the Function capture
(custom_backward/autograd_function/) turns into an `autograd_function_apply` node with the hook traced
as its backward subgraph.  Gradients through the program then pass through the hook exactly
where eager's do.  Refused, because the program could not do what eager does:
- a hook on a tensor some op already read (eager's hook also transforms the gradient flowing
  back through that earlier use; a rebinding only reaches later uses);
- a hook on a graph input or parameter (eager applies it to the leaf's accumulated gradient);
- a hook with Python side effects (print, storing into a list or attribute): a traced backward
  would run them once, at export, and never again.
A module's backward pre-hooks (`register_full_backward_pre_hook`: `hook(module, grad_output)`
returns new output gradients) are captured the same way (module.py): the module's outputs,
after its forward hooks, pass through one identity Function whose backward runs the hooks in
order.  Full backward hooks (`register_full_backward_hook`: `hook(module, grad_input,
grad_output)` returns new input gradients) are captured on the input side (full.py): the
module's floating tensor inputs, after its forward pre-hooks, pass through an identity Function
whose backward runs the hooks; hooks that read `grad_output` receive it through carrier
tensors, see Note [Carrying grad_output] in full.py.  Hooks that read the module's parameters
and buffers get them as saved values, see Note [Hooks reading module state] in state.py.
torch's own hook machinery is set aside for the trace (the hooks are restored after), so it
does not also run.

Both kinds see what torch's `BackwardHook` sees (`Layout` in layout.py): only the top level of
the positional arguments (one grad_input entry per argument; kwargs and tensors nested in lists
are not hooked) and of the output (one grad_output entry for a tensor, one per element of a
tuple, None for an element that is not a floating tensor; a nested tuple is such an element).
For an output that is neither a tensor nor a tuple (a list, a dict, a dataclass), or that holds
no floating tensor at its top level, eager calls none of the module's backward hooks, and
neither does the program (export gives eager's warning for the former).  Unlike eager, hooks
see zeros, not None, for floating outputs that get no gradient, and None, not zeros, for a
tensor argument that is not floating (see `Layout.hooked`).  Refused, naming the module, the
hook and where it was defined (refusal.py, capture.py): the deprecated `register_backward_hook`,
global backward hooks, hooks with Python side effects, hooks that cannot be traced (they return
a wrong number of gradients, which eager refuses in backward, or call something that is not a
torch operation), and hooks reading a tensor that is neither a gradient nor the module's own;
and, for a full backward hook that reads grad_output, a module whose output shape depends on
tensor values (full.py).

The modules, each leaning only on those listed before it:
    inspection.py  what a hook's code shows without running it; hook names for errors
    layout.py      arguments and output as eager's BackwardHook lays them out
    state.py       the module tensors a hook Function takes (Note [Hooks reading module state])
    capture.py     what one export's module-hook capture shares; calling the hooks' Functions
    full.py        full backward hooks (Note [Carrying grad_output], Note [One trace of a hooked module])
    refusal.py     module hooks that cannot be captured, refused when the module is called
    module.py      setting a module's backward hooks aside; backward pre-hooks
    tensor.py      `Tensor.register_hook`
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from predispatch import _torch_internals as ti
from predispatch.custom_backward.hooks.inspection import side_effect
from predispatch.custom_backward.hooks.module import captured_module_hooks
from predispatch.custom_backward.hooks.refusal import check_global_hooks, refusing_module_hooks
from predispatch.custom_backward.hooks.tensor import captured_tensor_hooks

__all__ = ["backward_hooks", "side_effect"]


@contextlib.contextmanager
def backward_hooks(root: nn.Module, keeper: Any) -> Iterator[None]:
    """While active: backward pre-hooks and `Tensor.register_hook` are captured where they can
    be, and calling a module with any other backward hook raises (see the module docstring).
    `keeper` tells which tensors ops have read."""
    names = {id(m): path or type(root).__name__ for path, m in root.named_modules(remove_duplicate=False)}
    ti.check_module_hook_tables()
    check_global_hooks()
    with captured_module_hooks(root, names), refusing_module_hooks(root, names), captured_tensor_hooks(keeper):
        yield
