"""Keys predispatch writes into `fx.Node.meta`, shared by the stage that writes and the one
that reads; and `stack_line`, the user's line a node's recorded stack trace names (for errors)."""

from __future__ import annotations

import re

from torch import fx

#: On `_set_grad_enabled` nodes: "enter" (opens a region) or "exit" (closes one).
#: Written by the trace (trace/grad_history.py), read by passes/wrap_regions.py.
GRAD_TOGGLE = "predispatch_grad_toggle"

#: On nodes a torch.func transform computed, traced below autograd: the transform's name.
#: Written by trace/transforms.py, read by the trace's engagement check (trace/functional.py).
BELOW_AUTOGRAD = "predispatch_below_autograd"

#: On `as_strided_scatter` nodes the user's code called itself (not made by functionalization):
#: kept as called, with torch's own derivative, as eager differentiates it.
#: Written by the trace's op observer (trace/grad_history.py), read by trace/scatter_gradients.py.
DIRECT_CALL = "predispatch_direct_call"


def stack_line(node: fx.Node) -> str | None:
    """`file:line (code)` of the innermost frame in a node's recorded stack trace that is a file
    (not code torch generated: dynamo's graph of flex_attention is `<eval_with_key>.N`)."""
    frames = re.findall(r'File "([^"<]+)", line (\d+), in \S+\n\s*(.*)', node.meta.get("stack_trace") or "")
    if not frames:
        return None
    path, line, code = frames[-1]
    return f"{path}:{line} ({code.strip()})"
