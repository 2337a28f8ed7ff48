"""Custom `torch.autograd.Function`s keep their backward, traced once.

Note [Capturing autograd.Function]
----------------------------------
torch's export inlines a Function's forward and drops its backward: a program trained from it
differentiates the forward's ops, which is wrong whenever the custom backward is not the
forward's derivative (a straight-through estimator, gradient clipping, a fused kernel's
hand-written gradient).  predispatch keeps both:

    autograd_function_apply = torch.ops.higher_order.autograd_function_apply(
        straight_through_fwd_0, straight_through_bwd_0, mul,
        non_differentiable_idx = [], saved_for_backward_idx = [0])
    round_1 = autograd_function_apply[0]

`straight_through_fwd_0` maps the operands (the tensor leaves of the arguments) to
`((*outputs), (*saved))`; `straight_through_bwd_0` maps `(*output_grads, *saved)` to one gradient
per operand (None where none flows).  Both are functional pre-dispatch graphs, nested under the
program's graph module, so printing, `check_functional` and `wrap_regions` see them.

Why torch's `autograd_function_apply`: it is the HOP torch itself (Dynamo) uses for exactly this
pair of graphs, and its eager implementation runs them inside a real `autograd.Function`, so
`ep.module()` differentiates with the user's backward and AOTAutograd traces the same backward
into its joint graph (Dynamo, which has no handler for the op called directly, is handed the pair
as a Function: runtime/runner.py, Note [Captured Functions under Dynamo]).  It does not dispatch (its `__call__` runs
the Function directly), so the trace reaches the graph through a trace-time HOP of our own
(`hop.py`) that dispatches through functionalization, proxy, autograd and fake levels and emits
torch's op.

Traced once: the user's forward runs once per export, and while it is traced every
`Function.apply` call is seen inside torch's own apply, however `apply` was reached (`capture.py`,
Note [Seeing every apply] in _torch_internals/autograd_function.py).  Each Function's forward runs once per call, on fresh fake tensors
in a nested functional trace; what it left on ctx (saved tensors, attributes, marks) becomes
data; the backward is traced from fakes of the output gradients and saved values, never running
forward again.  The outer graph gets the pair through a HOP that runs no user code.  Functions
called inside a captured forward or backward are inlined, as eager runs them under no_grad.
Functions applied from inside the dispatcher (the autograd kernels of custom ops and HOPs) are
left to torch: the op is what the graph records.  Where the call runs decides, not where its class
is defined (Note [Which Functions are captured] in capture.py).  torch's `autograd_function_apply`, met when the trace runs an exported
program (re-export, nested export) or a Dynamo-traced `torch.cond` branch, is captured again as
a Function made from its two graphs, so re-exporting a program prints the same program.

Choices that follow eager by value, not by bookkeeping:
- `ctx.needs_input_grad` is True for every floating tensor argument: the program may be trained
  with any of them requiring grad; autograd drops the gradients nobody asked for.
- Gradients reaching backward are always tensors (zeros for unused outputs), as with the default
  `set_materialize_grads(True)`; a backward written for `set_materialize_grads(False)` that
  treats None as zero computes the same values.
- An output that aliases an input is returned as a copy (eager returns a view); values match.
- `ctx.mark_dirty(x)`: the forward graph returns x's new value and the outer graph writes it
  back into x, as functionalization does for any in-place op.

Note [Grad mode inside Function subgraphs]
------------------------------------------
The forward subgraph always runs with grad off (inside `autograd.Function.forward`), the backward
with `create_graph`'s mode; grad-mode toggles in user code (`torch.no_grad()` in forward,
`@once_differentiable` on backward) change no value there, so they are dropped from the
subgraphs.  Autocast toggles do change values: they become `wrap_with_autocast` regions.
"""

from predispatch.custom_backward.autograd_function.capture import RUN_INSTEAD, capture_autograd_functions
from predispatch.custom_backward.autograd_function.record import CapturedCall

__all__ = ["RUN_INSTEAD", "CapturedCall", "capture_autograd_functions"]
