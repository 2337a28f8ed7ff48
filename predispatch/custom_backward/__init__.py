"""Custom backwards: what the trace captures with its own backward, so gradients are eager's.

A custom `autograd.Function` (`autograd_function/`) and a pure backward hook (`hooks/`: tensor
and module hooks) become torch's `autograd_function_apply` HOP: a forward subgraph and the
backward subgraph the user wrote, not the derivative of the forward.  `trace_hop.py` is the
higher-order op that stands for such a call while the trace runs.  The trace (trace/) turns
these captures on around the user's forward; nothing here runs after export.
"""
