"""Trace: `PreparedInputs` -> `TracedGraph`, the functional pre-dispatch capture.

One trace, at the PreDispatch key: a single make_fx pass (`ti.trace_program`) with
FunctionalTensorMode on the PreDispatch mode stack, so the user's forward runs once, mutations
become outputs (read off the functional inputs after the run) and CompositeImplicitAutograd ops
reach us before their kernels run (`decompose.py` decides which stay whole).
"""

from predispatch.trace.decompose import DecompositionLog, DecompositionPolicy
from predispatch.trace.functional import TracedGraph, is_tracing, trace

__all__ = ["DecompositionLog", "DecompositionPolicy", "TracedGraph", "is_tracing", "trace"]
