"""Passes over the traced graph, one file each, run in order by `_export.export`.

Each pass states its contract in its docstring; `check_functional` is the contract checked
at the end: no op with a mutable schema anywhere in the graph or its subgraphs.
"""

from predispatch.passes.check_functional import check_functional, mutable_ops
from predispatch.passes.name_placeholders import name_placeholders

__all__ = ["check_functional", "mutable_ops", "name_placeholders"]
