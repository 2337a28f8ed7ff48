"""Runtime: `ep.module()`, the program run as the original module would run.

`unlift.module_of(ep)` builds the `fx.GraphModule` (state installed, write-backs in its code);
each call goes through `runner.py` (input checks against the exported call, the graph, captured
Functions) and `writes.py` (the mutations written back, all or nothing); `modes.py` holds the
train/eval, dtype and copy contracts; `names.py` checks every name that reaches generated code;
`kernel_checks.py` guards the backward kernels that trust their arguments' shapes.
"""

from predispatch.runtime.unlift import module_of

__all__ = ["module_of"]
