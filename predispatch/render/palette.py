"""Colours shared by the DOT and HTML renderers, one table each for nodes and clusters.

Each entry is `(fill, border, legend text)`.  Inputs are coloured by what they stand for,
composites kept whole stand out in yellow, mutation outputs in red.
"""

from __future__ import annotations

from predispatch.render.picture import ClusterKind, NodeKind

NODE_STYLE: dict[NodeKind, tuple[str, str, str]] = {
    NodeKind.PARAMETER: ("#dcefd9", "#3f7f35", "parameter"),
    NodeKind.BUFFER: ("#fde3bf", "#b8700f", "buffer"),
    NodeKind.CONSTANT_TENSOR: ("#eadcf5", "#7b4fa0", "constant tensor"),
    NodeKind.USER_INPUT: ("#d3e4fa", "#2f6db5", "user input"),
    NodeKind.OP: ("#ffffff", "#8a8a8a", "aten op"),
    NodeKind.COMPOSITE: ("#fff3a8", "#a88a00", "composite kept whole"),
    NodeKind.CUSTOM_OP: ("#fbdde8", "#b0406a", "non-aten op (predispatch::keep_history, ...)"),
    NodeKind.CALL: ("#eeeeee", "#555555", "higher-order op call"),
    NodeKind.SUBGRAPH_INPUT: ("#f6f6f6", "#999999", "subgraph input or output"),
    NodeKind.SUBGRAPH_OUTPUT: ("#f6f6f6", "#999999", "subgraph input or output"),
    NodeKind.USER_OUTPUT: ("#e4e4e4", "#333333", "user output"),
    NodeKind.MUTATION: ("#f8c9c4", "#c0392b", "mutation output (written back)"),
}

CLUSTER_STYLE: dict[ClusterKind, tuple[str, str, str]] = {
    ClusterKind.GRAD_DISABLED: ("#eaf0f8", "#5b7da8", "grad disabled region"),
    ClusterKind.GRAD_ENABLED: ("#eaf6ea", "#4a8a3f", "grad enabled region"),
    ClusterKind.AUTOCAST: ("#fdf1e2", "#c07a16", "autocast region"),
    ClusterKind.FUNCTION: ("#f3eefa", "#7b4fa0", "captured autograd.Function (forward, backward)"),
    ClusterKind.CALL: ("#f1f1f1", "#555555", "higher-order op"),
    ClusterKind.SUBGRAPH: ("#ffffff", "#9a8ab0", "subgraph"),
}

WRITE_BACK_COLOR = "#c0392b"
SAVED_COLOR = "#7b4fa0"
