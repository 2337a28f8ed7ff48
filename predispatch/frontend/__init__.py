"""Frontend: module or function + example inputs -> `PreparedInputs`.

This stage validates what the user passed, names every input leaf by its pytree path, lifts
the module's state (parameters, buffers, tensor attributes) under fully qualified names, and
makes fake twins of all tensors in one FakeTensorMode with a ShapeEnv, so that tracing runs
no real compute and costs no memory for weights.  A module with DTensor state is first
replaced by the stand-in one rank runs (per_rank.py, Note [Per-rank DTensor programs]).
"""

from predispatch.frontend.inputs import FunctionRoot, LiftedTensor, PreparedInputs, modules_of, prepare
from predispatch.frontend.per_rank import refuse_per_rank_options
from predispatch.frontend.reachable import walks_shared

__all__ = ["FunctionRoot", "LiftedTensor", "PreparedInputs", "modules_of", "prepare", "refuse_per_rank_options", "walks_shared"]
