"""Name placeholders after what they stand for.

Before:  def forward(self, arg0_1, arg1_1, arg2_1):
After:   def forward(self, p_lin_weight, p_lin_bias, x):

Names come from the signature specs (fully qualified names, pytree paths), so printing is
deterministic.  A non-placeholder node that already holds a wanted name is renamed first.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import fx


def name_placeholders(gm: fx.GraphModule, names: Sequence[str]) -> None:
    """Rename the graph's placeholders, in order, to `names` (in place)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    assert len(placeholders) == len(names), (len(placeholders), len(names))
    wanted = set(names)
    for node in gm.graph.nodes:
        if node.op != "placeholder" and node.name in wanted:
            node._rename(f"{node.name}_1")
    for node in placeholders:
        node._rename(f"__tmp_{node.name}")
    for node, name in zip(placeholders, names):
        node._rename(name)
        node.target = name
