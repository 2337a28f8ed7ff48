"""Trace: `PreparedInputs` -> `TracedGraph`, the functional pre-dispatch capture.

One trace, at the PreDispatch key: torch's `aot_export_module(pre_dispatch=True)` puts
FunctionalTensorMode on the PreDispatch mode stack, so mutations become outputs and
CompositeImplicitAutograd ops reach us before their kernels run (`decompose.py` decides which
stay whole).
"""

from predispatch.trace.decompose import DecompositionLog, DecompositionPolicy
from predispatch.trace.functional import TracedGraph, is_tracing, trace

__all__ = ["DecompositionLog", "DecompositionPolicy", "TracedGraph", "is_tracing", "trace"]
