"""Pictures of programs: describe as data, then render at the edge.

    from predispatch.render import picture, to_dot, to_html, to_svg
    pic = picture(ep, title="Block")      # Picture: nodes, edges, nested clusters
    open("block.html", "w").write(to_html(pic))   # self-contained page, nothing to install
    open("block.svg", "w").write(to_svg(to_dot(pic)))   # needs Graphviz's `dot`
"""

from predispatch.render.dot import GraphvizNotFoundError, to_dot, to_svg
from predispatch.render.html import to_html
from predispatch.render.picture import (
    Cluster,
    ClusterKind,
    EdgeKind,
    NodeKind,
    Picture,
    PictureEdge,
    PictureNode,
    picture,
)

__all__ = [
    "Cluster",
    "ClusterKind",
    "EdgeKind",
    "GraphvizNotFoundError",
    "NodeKind",
    "Picture",
    "PictureEdge",
    "PictureNode",
    "picture",
    "to_dot",
    "to_html",
    "to_svg",
]
