"""A `Picture` as Graphviz DOT text, and as SVG through Graphviz's `dot` program.

`to_dot` needs nothing installed; `to_svg` runs `dot -Tsvg` and says how to get it when it is
missing.  Clusters become `subgraph cluster_<id>` blocks nested like the regions they draw.
"""

from __future__ import annotations

import html
import shutil
from collections import defaultdict
import subprocess

from predispatch.render.palette import CLUSTER_STYLE, NODE_STYLE, SAVED_COLOR, WRITE_BACK_COLOR
from predispatch.render.picture import Cluster, ClusterKind, EdgeKind, NodeKind, Picture, PictureNode

_FONT = "Helvetica"


class GraphvizNotFoundError(RuntimeError):
    """SVG output needs Graphviz's `dot` program and it is not on PATH."""

    def __init__(self) -> None:
        super().__init__(
            "drawing SVG needs Graphviz's `dot` program, which is not on PATH\n"
            "  fix: install Graphviz: `apt-get install graphviz` (Debian, Ubuntu), `brew install graphviz`\n"
            "       (macOS) or `conda install graphviz`; `pip install graphviz` is not enough, it installs\n"
            "       Python bindings only, not the `dot` program\n"
            "  or draw without Graphviz: `-o picture.html` (a self-contained page) or `-o picture.dot`"
        )


def to_svg(dot_text: str) -> str:
    """Lay out DOT text with Graphviz's `dot`; raises GraphvizNotFoundError when it is missing."""
    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizNotFoundError()
    done = subprocess.run([dot, "-Tsvg"], input=dot_text, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"Graphviz `dot -Tsvg` failed (exit {done.returncode}): {done.stderr.strip()}")
    return done.stdout


def to_dot(pic: Picture) -> str:
    """Deterministic DOT text: same picture, same bytes."""
    lines = [
        f"digraph {_quote(pic.title or 'program')} {{",
        f'  graph [rankdir=TB, fontname="{_FONT}", fontsize=11, nodesep=0.25, ranksep=0.35, newrank=true];',
        f'  node [shape=box, style="rounded,filled", fontname="{_FONT}", fontsize=10, margin="0.12,0.04"];',
        f'  edge [fontname="{_FONT}", fontsize=8, color="#666666", arrowsize=0.6];',
    ]
    if pic.title:
        lines.append(f'  label={_html_label(f"<b>{html.escape(pic.title)}</b>")}; labelloc=t;')
    lines += _legend(pic)
    lines += _members(pic, None, "  ")
    outputs = [n.id for n in pic.nodes if n.kind in (NodeKind.USER_OUTPUT, NodeKind.MUTATION)]
    if outputs:  # one bottom row: where the program ends is easy to find
        lines.append(f"  {{rank=max; {'; '.join(outputs)};}}")
    for edge in pic.edges:
        attrs = [f"label={_quote(edge.label)}"] if edge.label else []
        if edge.kind is EdgeKind.WRITE_BACK:
            attrs += [
                "style=dashed",
                f'color="{WRITE_BACK_COLOR}"',
                f'fontcolor="{WRITE_BACK_COLOR}"',
                'label="writes back"',
                "constraint=false",
            ]
        if edge.kind is EdgeKind.SAVED:
            attrs += ["style=dashed", f'color="{SAVED_COLOR}"', f'fontcolor="{SAVED_COLOR}"', 'xlabel="saved"']
        suffix = f" [{', '.join(attrs)}]" if attrs else ""
        lines.append(f"  {edge.source} -> {edge.target}{suffix};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _members(pic: Picture, cluster: str | None, indent: str) -> list[str]:
    """The nodes directly in `cluster`, then its child clusters, recursively."""
    nodes, children = defaultdict(list), defaultdict(list)
    for n in pic.nodes:
        nodes[n.cluster].append(n)
    for c in pic.clusters:
        children[c.parent].append(c)
    return _nested(nodes, children, cluster, indent)


def _nested(nodes: dict, children: dict, cluster: str | None, indent: str) -> list[str]:
    lines = [indent + _node(n) for n in nodes[cluster]]
    for child in children[cluster]:
        lines += _cluster(child, indent, _nested(nodes, children, child.id, indent + "  "))
    return lines


def _cluster(c: Cluster, indent: str, members: list[str]) -> list[str]:
    fill, border, _ = CLUSTER_STYLE[c.kind]
    detail = f' <font color="#666666">{html.escape(c.detail)}</font>' if c.detail else ""
    style = "rounded,filled,dashed" if c.kind is ClusterKind.SUBGRAPH else "rounded,filled"
    lines = [
        f"{indent}subgraph cluster_{c.id} {{",
        f"{indent}  label={_html_label(f'<b>{html.escape(c.label)}</b>{detail}')};",
        f'{indent}  style="{style}"; fillcolor="{fill}"; color="{border}"; penwidth=1.5; labeljust=l;',
    ]
    lines += members
    lines.append(f"{indent}}}")
    return lines


def _node(n: PictureNode) -> str:
    fill, border, legend = NODE_STYLE[n.kind]
    second = n.op
    if n.kind in _INPUTS:
        second = legend if n.op in ("", n.name) else f"{legend} · {n.op}"
    rows = [f'<font point-size="11"><b>{html.escape(n.name)}</b></font>']
    if second:
        rows.append(f'<font point-size="9" color="#444444">{html.escape(second)}</font>')
    if n.detail:
        rows.append(f'<font point-size="9" color="#444444">{html.escape(n.detail)}</font>')
    attrs = [f"label={_html_label('<br/>'.join(rows))}", f'fillcolor="{fill}"', f'color="{border}"']
    if n.kind in (NodeKind.COMPOSITE, NodeKind.MUTATION, NodeKind.CUSTOM_OP):
        attrs.append("penwidth=2")
    if n.kind in (NodeKind.SUBGRAPH_INPUT, NodeKind.SUBGRAPH_OUTPUT):
        attrs.append('style="rounded,filled,dashed"')
    tooltip = n.note or legend
    attrs.append(f"tooltip={_quote(tooltip)}")
    return f"{n.id} [{', '.join(attrs)}];"


_INPUTS = frozenset({NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT_TENSOR, NodeKind.USER_INPUT})


def _legend(pic: Picture) -> list[str]:
    """One plaintext node with a table of the node and cluster kinds this picture uses."""
    used_nodes = [k for k in NODE_STYLE if any(n.kind is k for n in pic.nodes)]
    used_clusters = [k for k in CLUSTER_STYLE if any(c.kind is k for c in pic.clusters)]
    styles = [NODE_STYLE[k] for k in used_nodes] + [CLUSTER_STYLE[k] for k in used_clusters]
    rows = {
        text: f'<tr><td bgcolor="{fill}" color="{border}" border="1" width="14"></td>'
        f'<td align="left">{html.escape(text)}</td></tr>'
        for fill, border, text in styles
    }
    table = f'<table border="0" cellborder="0" cellspacing="2" cellpadding="2">{"".join(rows.values())}</table>'
    return [f'  legend [shape=plaintext, style="", fontsize=9, label={_html_label(table)}];']


def _html_label(markup: str) -> str:
    return f"<{markup}>"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
