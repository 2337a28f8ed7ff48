"""Passes over the traced graph, one file each, run in order by `_export.export`.

Order: name_placeholders -> remove_copies -> wrap_regions -> check_functional.  Passes edit
graphs in place and do not recompile: `build_program` recompiles once at the end (each
recompile regenerates the Python code of the whole graph).  Each pass states its contract in
its docstring; `check_functional` checks the program's contract at the
end: no op with a mutable schema and no raw grad/autocast toggle anywhere in the graph or its
subgraphs.

`lift_constants` lifts the tensors a region's body holds into operands of its HOP call, for
`ep.module()` (runtime/unlift.py) and `to_torch()` (transforms/to_torch.py) alike.  The passes
only `to_torch()` runs live beside it, in transforms/.

`kernel_shapes` holds the shapes backward kernels read their arguments as, unchecked: the
rules `ep.module()` checks before each call (runtime/kernel_checks.py) and `pin_kernel_shapes`,
the pass that gives `to_torch()`'s graph the same check as `aten.view`s.
"""

from predispatch.passes.check_functional import check_functional, mutable_ops, raw_toggles
from predispatch.passes.inline_subgraphs import inline_subgraphs, inlined_copy, shared_bodies
from predispatch.passes.name_placeholders import name_placeholders
from predispatch.passes.remove_copies import remove_copies
from predispatch.passes.wrap_regions import wrap_regions

__all__ = [
    "check_functional",
    "inline_subgraphs",
    "inlined_copy",
    "mutable_ops",
    "name_placeholders",
    "raw_toggles",
    "remove_copies",
    "shared_bodies",
    "wrap_regions",
]
