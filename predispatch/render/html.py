"""A `Picture` as one self-contained HTML page: no network, no Graphviz, no external files.

The page lists the program in order, like its printed form, with structure made visible:
inputs as coloured chips (by kind), each op as a row (name, operator, dtype and shape, and
links to the values it reads), regions and captured Functions as nested boxes labelled with the
state they set, and outputs with the input each mutation writes back into.  Hovering a row
highlights what it reads and what reads it (a few lines of inline script; the page reads fine
without it).  When the script has run, `<body data-rendered="ok">`.
"""

from __future__ import annotations

import html
from collections import defaultdict
from dataclasses import dataclass

from predispatch.render.palette import CLUSTER_STYLE, NODE_STYLE, WRITE_BACK_COLOR
from predispatch.render.picture import Cluster, ClusterKind, EdgeKind, NodeKind, Picture, PictureNode

_INPUTS = (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT_TENSOR, NodeKind.USER_INPUT)
_OUTPUTS = (NodeKind.USER_OUTPUT, NodeKind.MUTATION)


def to_html(pic: Picture) -> str:
    """The whole page as a string; deterministic for a given picture."""
    title = pic.title or "program"
    links = _Links.of(pic)
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>predispatch: {html.escape(title)}</title>",
        f"<style>{_css()}</style></head>",
        '<body data-rendered="no">',
        f"<header><h1>{html.escape(title)}</h1>",
        f'<p class="summary">{html.escape(_summary(pic))}</p>',
        _legend(pic),
        "</header><main>",
        _section("Inputs", "inputs", [_chip(n) for n in pic.nodes if n.kind in _INPUTS and n.cluster is None]),
        _section("Program", "body", _body(pic, links)),
        _section("Outputs", "outputs", [_row(links, n) for n in pic.nodes if n.kind in _OUTPUTS]),
        f"</main><script>{_SCRIPT}</script>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _summary(pic: Picture) -> str:
    def count(*kinds: NodeKind) -> int:
        return sum(n.kind in kinds for n in pic.nodes)

    inputs = ", ".join(_plural(count(k), NODE_STYLE[k][2]) for k in _INPUTS if count(k))
    ops = count(NodeKind.OP, NodeKind.COMPOSITE, NodeKind.CUSTOM_OP, NodeKind.CALL)
    regions = sum(c.kind in (ClusterKind.GRAD_DISABLED, ClusterKind.GRAD_ENABLED, ClusterKind.AUTOCAST) for c in pic.clusters)
    functions = sum(c.kind is ClusterKind.FUNCTION for c in pic.clusters)
    boxes = ", ".join([_plural(regions, "region")] + ([_plural(functions, "captured Function")] if functions else []))
    return (
        f"inputs: {inputs or 'none'} · {_plural(ops, 'op')}, {count(NodeKind.COMPOSITE)} kept whole as composites · "
        f"{boxes} · outputs: {count(NodeKind.USER_OUTPUT)} user, {_plural(count(NodeKind.MUTATION), 'mutation')}"
    )


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _section(heading: str, cls: str, items: list[str]) -> str:
    if not items:
        return ""
    return f'<section class="{cls}"><h2>{heading}</h2>\n' + "\n".join(items) + "\n</section>"


def _body(pic: Picture, links: _Links) -> list[str]:
    """Rows in program order; a cluster's box opens before its first node and closes after its last."""
    by_id = {c.id: c for c in pic.clusters}
    out: list[str] = []
    open_stack: list[str] = []
    for n in pic.nodes:
        if n.kind in _INPUTS + _OUTPUTS and n.cluster is None:
            continue
        path = _ancestry(by_id, n.cluster)
        while open_stack and open_stack[-1] not in path:
            out.append("</div></div>")
            open_stack.pop()
        for cid in path[len(open_stack) :]:
            out.append(_open_cluster(by_id[cid]))
            open_stack.append(cid)
        out.append(_row(links, n))
    out.extend("</div></div>" for _ in open_stack)
    return out


def _ancestry(by_id: dict[str, Cluster], cid: str | None) -> list[str]:
    path = []
    while cid is not None:
        path.append(cid)
        cid = by_id[cid].parent
    return path[::-1]


def _open_cluster(c: Cluster) -> str:
    detail = f' <span class="detail">{html.escape(c.detail)}</span>' if c.detail else ""
    return (
        f'<div class="cluster g-{c.kind.value}" id="{c.id}">'
        f'<div class="cluster-head"><b>{html.escape(c.label)}</b>{detail}</div><div class="cluster-body">'
    )


@dataclass(frozen=True)
class _Links:
    """Per node: what it reads `(id, shown text)`, and the inputs it writes back into."""

    reads: dict[str, list[tuple[str, str]]]
    writes: dict[str, list[tuple[str, str]]]

    @classmethod
    def of(cls, pic: Picture) -> _Links:
        names = {m.id: m.name for m in pic.nodes}
        prefix = {EdgeKind.DATA: "", EdgeKind.SAVED: "saved: "}
        reads: dict[str, list[tuple[str, str]]] = defaultdict(list)
        writes: dict[str, list[tuple[str, str]]] = defaultdict(list)
        for e in pic.edges:
            if e.kind is EdgeKind.WRITE_BACK:
                writes[e.source].append((e.target, names[e.target]))
            else:
                reads[e.target].append((e.source, prefix[e.kind] + names[e.source] + e.label))
        return cls(reads, writes)


def _links(items: list[tuple[str, str]]) -> str:
    return ", ".join(f'<a href="#{nid}">{html.escape(text)}</a>' for nid, text in items)


def _row(links: _Links, n: PictureNode) -> str:
    sources, writes = links.reads.get(n.id, []), links.writes.get(n.id, [])
    reads = f"← {_links(sources)}" if sources else ""
    if writes:
        reads += f' <span class="writes">writes back into {_links(writes)}</span>'
    reads = f'<span class="args">{reads}</span>'
    op = n.op
    return (
        f'<div class="node k-{n.kind.value}" id="{n.id}" data-in="{" ".join(s for s, _ in sources)}"'
        f' title="{html.escape(n.note or NODE_STYLE[n.kind][2])}">'
        f'<span class="name">{html.escape(n.name)}</span><span class="op">{html.escape(op)}</span>'
        f'<span class="shape">{html.escape(n.detail)}</span>{reads}</div>'
    )


def _chip(n: PictureNode) -> str:
    target = f'<span class="op">{html.escape(n.op)}</span>' if n.op and n.op != n.name else ""
    return (
        f'<div class="node chip k-{n.kind.value}" id="{n.id}" data-in="" title="{html.escape(NODE_STYLE[n.kind][2])}">'
        f'<span class="name">{html.escape(n.name)}</span>{target}'
        f'<span class="shape">{html.escape(n.detail)}</span></div>'
    )


def _legend(pic: Picture) -> str:
    """One entry per node and cluster style the picture uses."""
    items = {
        style[2]: f'<li><span class="swatch k-{k.value}"></span>{html.escape(style[2])}</li>'
        for k, style in NODE_STYLE.items()
        if any(n.kind is k for n in pic.nodes)
    }
    items.update({
        style[2]: f'<li><span class="swatch g-{k.value}"></span>{html.escape(style[2])}</li>'
        for k, style in CLUSTER_STYLE.items()
        if any(c.kind is k for c in pic.clusters)
    })
    return f'<ul class="legend">{"".join(items.values())}</ul>'


def _css() -> str:
    kinds = "".join(
        f".k-{k.value}{{background:{fill};border-color:{border}}}" for k, (fill, border, _) in NODE_STYLE.items()
    )
    clusters = "".join(
        f".g-{k.value}{{background:{fill};border-color:{border}}}" for k, (fill, border, _) in CLUSTER_STYLE.items()
    )
    return _BASE_CSS + kinds + clusters + f".writes{{color:{WRITE_BACK_COLOR}}}"


_BASE_CSS = """
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:0;color:#222;background:#fafafa}
header{padding:12px 20px;background:#fff;border-bottom:1px solid #ddd}
h1{font-size:18px;margin:0 0 4px}h2{font-size:13px;text-transform:uppercase;letter-spacing:.06em;color:#666;margin:14px 0 6px}
.summary{margin:0 0 6px;color:#555}
main{padding:0 20px 30px}
.legend{list-style:none;padding:0;margin:0;display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;color:#444}
.legend li{display:flex;align-items:center;gap:5px}
.swatch{display:inline-block;width:14px;height:12px;border:1.5px solid;border-radius:3px}
.inputs{display:flex;flex-wrap:wrap;gap:6px}.inputs h2{width:100%}
.node{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px;border:1.5px solid;
 border-left-width:6px;border-radius:5px;padding:3px 8px;margin:3px 0;display:grid;
 grid-template-columns:14em 23em 9em 1fr;column-gap:12px;align-items:baseline}
.node>span{overflow-wrap:anywhere}
.chip{display:inline-flex;margin:0;gap:8px}
.name{font-weight:700}
.op{color:#444}
.shape{color:#0b5394}
.args{color:#555}.args a,.writes a{color:inherit}
.writes{font-weight:600}
.k-composite .op,.k-custom_op .op{font-weight:700}
.cluster{border:2px solid;border-radius:8px;margin:8px 0;padding:0 8px 6px}
.g-subgraph{border-style:dashed}
.cluster-head{font-size:13px;padding:4px 2px}.cluster-head .detail{color:#666;font-family:ui-monospace,Menlo,monospace;font-size:12px}
.node.focus{outline:2px solid #222}.node.src{outline:2px solid #2f6db5}.node.dst{outline:2px solid #c0392b}
"""

_SCRIPT = """
(function () {
  var nodes = Array.prototype.slice.call(document.querySelectorAll('.node'));
  var users = {};
  function ids(n) { return (n.getAttribute('data-in') || '').split(' ').filter(Boolean); }
  nodes.forEach(function (n) {
    ids(n).forEach(function (s) { (users[s] = users[s] || []).push(n.id); });
  });
  function toggle(id, cls, on) { var e = document.getElementById(id); if (e) { e.classList.toggle(cls, on); } }
  function mark(n, on) {
    n.classList.toggle('focus', on);
    ids(n).forEach(function (s) { toggle(s, 'src', on); });
    (users[n.id] || []).forEach(function (s) { toggle(s, 'dst', on); });
  }
  nodes.forEach(function (n) {
    n.addEventListener('mouseenter', function () { mark(n, true); });
    n.addEventListener('mouseleave', function () { mark(n, false); });
  });
  document.body.setAttribute('data-rendered', 'ok');
})();
"""
