"""Pictures: the description built from a program, its DOT and SVG, and the HTML page in a browser."""

from __future__ import annotations

import html.parser
import operator
import re
import shutil
import subprocess
import types
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase
from torch import fx, nn

import predispatch
from predispatch.signature import InputKind, InputSpec, OutputKind, OutputSpec
from predispatch.render import (
    ClusterKind,
    EdgeKind,
    GraphvizNotFoundError,
    NodeKind,
    picture,
    to_dot,
    to_html,
    to_svg,
)
from predispatch.render.palette import CLUSTER_STYLE, NODE_STYLE


class DetachedDouble(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = 2 * x
        return x + y


class Nested(nn.Module):
    """no_grad inside enable_grad inside no_grad, then autocast."""

    def forward(self, x):
        with torch.no_grad():
            a = x * 2
            with torch.enable_grad():
                b = x * 3
                with torch.no_grad():
                    c = b * 4
        with torch.autocast("cpu", dtype=torch.bfloat16):
            d = torch.mm(x, x)
        return a + b + c + d.float()


class AllKinds(nn.Module):
    """Parameters, a buffer and a user input updated in place, a constant tensor, composites."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.offset = torch.ones(4)  # a plain tensor attribute: a CONSTANT_TENSOR input

    def forward(self, x, mask):
        self.steps += 1
        mask.mul_(2)
        with torch.no_grad():
            scale = x.abs().mean()
        q, k = self.lin(x).unbind(0)
        return F.layer_norm(q + k + self.offset, (4,)) * mask * scale


class EMA(nn.Module):
    """A parameter updated under no_grad, then used: keep_history keeps its autograd history."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            self.weight.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x * self.weight


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 10 * x  # deliberately not 2x: the picture must show this backward


class UsesFunction(nn.Module):
    def forward(self, x):
        return Square.apply(x) + 1


def export(module, *args):
    torch.manual_seed(0)
    return predispatch.export(module, args)


def all_kinds():
    return export(AllKinds(), torch.randn(2, 4), torch.ones(4))


def test_regions_are_nested_clusters():
    pic = picture(export(Nested(), torch.randn(3, 3)))
    by_id = {c.id: c for c in pic.clusters}
    outer = pic.cluster_of("mul")
    assert (outer.label, outer.kind, outer.parent) == ("grad disabled", ClusterKind.GRAD_DISABLED, None)
    middle = pic.cluster_of("mul_1")
    assert (middle.kind, middle.parent) == (ClusterKind.GRAD_ENABLED, outer.id)
    inner = pic.cluster_of("mul_2")
    assert (inner.kind, inner.parent) == (ClusterKind.GRAD_DISABLED, middle.id)
    autocast = pic.cluster_of("mm")
    assert (autocast.label, autocast.kind, autocast.parent) == ("autocast cpu bfloat16", ClusterKind.AUTOCAST, None)
    assert pic.node("add").cluster is None
    assert [by_id[c.id].detail for c in pic.clusters] == ["grad_region_0", "grad_region_1", "grad_region_2", "autocast_region_0"]


def test_values_flow_straight_into_and_out_of_regions():
    pic = picture(export(DetachedDouble(), torch.randn(3)))
    names = {n.id: n.name for n in pic.nodes}
    edges = {(names[e.source], names[e.target]) for e in pic.edges}
    assert edges == {("x", "mul"), ("x", "add"), ("mul", "add"), ("add", "output")}
    assert not any(n.kind is NodeKind.CALL for n in pic.nodes)  # the HOP call is the cluster


def test_inputs_are_coloured_by_kind():
    pic = picture(all_kinds())
    kinds = {n.name: n.kind for n in pic.nodes if n.cluster is None and n.kind not in (NodeKind.MUTATION, NodeKind.USER_OUTPUT)}
    assert kinds["p_lin_weight"] is NodeKind.PARAMETER
    assert kinds["b_steps"] is NodeKind.BUFFER
    assert kinds["c_offset"] is NodeKind.CONSTANT_TENSOR
    assert kinds["x"] is kinds["mask"] is NodeKind.USER_INPUT
    assert pic.node("p_lin_weight").op == "lin.weight"
    dot = to_dot(pic)
    for name in ("p_lin_weight", "b_steps", "c_offset", "x"):
        node = pic.node(name)
        assert re.search(rf'{node.id} \[.*fillcolor="{NODE_STYLE[node.kind][0]}"', dot), name
    assert len({NODE_STYLE[k][0] for k in (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.CONSTANT_TENSOR, NodeKind.USER_INPUT)}) == 4


def test_mutation_outputs_write_back_into_their_inputs():
    pic = picture(all_kinds())
    names = {n.id: n.name for n in pic.nodes}
    mutations = {n.name: n.op for n in pic.nodes if n.kind is NodeKind.MUTATION}
    assert mutations == {"steps": "buffer mutation", "mask": "user input mutation"}
    write_backs = {(names[e.source], names[e.target]) for e in pic.edges if e.kind is EdgeKind.WRITE_BACK}
    assert write_backs == {("steps", "b_steps"), ("mask", "mask")}
    assert "writes back" in to_dot(pic) and "writes back into" in to_html(pic)


def test_composites_kept_whole_stand_out():
    pic = picture(all_kinds())
    kinds = {n.name: n.kind for n in pic.nodes}
    assert kinds["linear"] is kinds["layer_norm"] is NodeKind.COMPOSITE
    assert kinds["add_1"] is NodeKind.OP
    assert "composite kept whole" in pic.node("linear").note


def test_keep_history_and_parameter_write_back():
    pic = picture(export(EMA(), torch.randn(2, 4)))
    names = {n.id: n.name for n in pic.nodes}
    keep = pic.node("keep_history")
    assert (keep.kind, keep.op, keep.cluster) == (NodeKind.CUSTOM_OP, "predispatch.keep_history.default", None)
    assert "Note [Mutations inside grad regions]" in keep.note
    mutation = next(n for n in pic.nodes if n.kind is NodeKind.MUTATION)
    assert (mutation.name, mutation.op) == ("weight", "parameter mutation")
    assert {(names[e.source], names[e.target]) for e in pic.edges if e.kind is EdgeKind.WRITE_BACK} == {("weight", "p_weight")}


def test_elements_of_multi_output_ops_are_edge_labels():
    pic = picture(all_kinds())
    names = {n.id: n.name for n in pic.nodes}
    labels = {(names[e.source], e.label) for e in pic.edges if e.label}
    assert labels == {("unbind", "[0]"), ("unbind", "[1]")}
    assert "getitem" not in names.values()


def test_captured_function_shows_forward_and_backward():
    ep = export(UsesFunction(), torch.randn(3))
    assert any("autograd_function_apply" in str(n.target) for n in ep.graph.nodes)
    pic = picture(ep)
    function = next(c for c in pic.clusters if c.kind is ClusterKind.FUNCTION)
    assert function.label == "autograd.Function square"
    parts = {c.label: c for c in pic.clusters if c.parent == function.id}
    assert set(parts) == {"forward", "backward"} and all(c.kind is ClusterKind.SUBGRAPH for c in parts.values())
    names = {n.id: n.name for n in pic.nodes}
    forward_mul = next(n for n in pic.nodes if n.cluster == parts["forward"].id)
    assert forward_mul.name == "mul"
    # the forward is drawn inline: x flows in, and add reads the Function's output from it
    assert {(names[e.source], names[e.target]) for e in pic.edges if forward_mul.id in (e.source, e.target)} == {("x", "mul"), ("mul", "add")}
    backward = [n for n in pic.nodes if n.cluster == parts["backward"].id]
    assert [n.kind for n in backward if n.kind is NodeKind.SUBGRAPH_INPUT] == [NodeKind.SUBGRAPH_INPUT] * 2
    saved = [(names[e.source], names[e.target]) for e in pic.edges if e.kind is EdgeKind.SAVED]
    assert saved == [("x", "saved_x")]


def _unknown_hop(body, x):
    return body(x, x)


def test_unknown_hop_with_unmatched_subgraph_is_a_call_node():
    """A HOP whose subgraph takes other values than its operands: drawn literally."""
    body = fx.symbolic_trace(lambda a, b: a + b)
    root = nn.Module()
    root.body = body
    g = fx.Graph()
    x = g.placeholder("x")
    call = g.call_function(_unknown_hop, (g.get_attr("body"), x))
    g.output((g.call_function(operator.getitem, (call, 0)),))
    signature = types.SimpleNamespace(
        inputs=(InputSpec(InputKind.USER_INPUT, "x", "x"),), outputs=(OutputSpec(OutputKind.USER_OUTPUT, "getitem", "output"),)
    )
    pic = picture(types.SimpleNamespace(graph_module=fx.GraphModule(root, g), signature=signature))
    cluster = pic.clusters[0]
    assert (cluster.label, cluster.kind, cluster.detail) == ("_unknown_hop", ClusterKind.CALL, "body")
    kinds = [(n.name, n.kind) for n in pic.nodes if n.cluster == cluster.id]
    assert kinds == [
        ("a", NodeKind.SUBGRAPH_INPUT),
        ("b", NodeKind.SUBGRAPH_INPUT),
        ("add", NodeKind.OP),
        ("returns", NodeKind.SUBGRAPH_OUTPUT),
        ("_unknown_hop", NodeKind.CALL),
    ]
    names = {n.id: n.name for n in pic.nodes}
    assert ("_unknown_hop", "output", "[0]") in {(names[e.source], names[e.target], e.label) for e in pic.edges}


class Goldens(TestCase):
    maxDiff = None

    def test_dot(self):
        self.assertExpectedInline(to_dot(picture(export(DetachedDouble(), torch.randn(3)), title="DetachedDouble")), """\
digraph "DetachedDouble" {
  graph [rankdir=TB, fontname="Helvetica", fontsize=11, nodesep=0.25, ranksep=0.35, newrank=true];
  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10, margin="0.12,0.04"];
  edge [fontname="Helvetica", fontsize=8, color="#666666", arrowsize=0.6];
  label=<<b>DetachedDouble</b>>; labelloc=t;
  legend [shape=plaintext, style="", fontsize=9, label=<<table border="0" cellborder="0" cellspacing="2" cellpadding="2"><tr><td bgcolor="#d3e4fa" color="#2f6db5" border="1" width="14"></td><td align="left">user input</td></tr><tr><td bgcolor="#ffffff" color="#8a8a8a" border="1" width="14"></td><td align="left">aten op</td></tr><tr><td bgcolor="#e4e4e4" color="#333333" border="1" width="14"></td><td align="left">user output</td></tr><tr><td bgcolor="#eaf0f8" color="#5b7da8" border="1" width="14"></td><td align="left">grad disabled region</td></tr></table>>];
  n0 [label=<<font point-size="11"><b>x</b></font><br/><font point-size="9" color="#444444">user input</font><br/><font point-size="9" color="#444444">f32[3]</font>>, fillcolor="#d3e4fa", color="#2f6db5", tooltip="user input"];
  n2 [label=<<font point-size="11"><b>add</b></font><br/><font point-size="9" color="#444444">aten.add.Tensor</font><br/><font point-size="9" color="#444444">f32[3]</font>>, fillcolor="#ffffff", color="#8a8a8a", tooltip="aten op"];
  n3 [label=<<font point-size="11"><b>output</b></font><br/><font point-size="9" color="#444444">user output</font>>, fillcolor="#e4e4e4", color="#333333", tooltip="USER_OUTPUT target='output'"];
  subgraph cluster_c0 {
    label=<<b>grad disabled</b> <font color="#666666">grad_region_0</font>>;
    style="rounded,filled"; fillcolor="#eaf0f8"; color="#5b7da8"; penwidth=1.5; labeljust=l;
    n1 [label=<<font point-size="11"><b>mul</b></font><br/><font point-size="9" color="#444444">aten.mul.Tensor</font><br/><font point-size="9" color="#444444">f32[3]</font>>, fillcolor="#ffffff", color="#8a8a8a", tooltip="aten op"];
  }
  {rank=max; n3;}
  n0 -> n1;
  n0 -> n2;
  n1 -> n2;
  n2 -> n3;
}
""")


def test_dot_nests_clusters_and_is_deterministic():
    ep = export(Nested(), torch.randn(3, 3))
    dot = to_dot(picture(ep))
    assert dot == to_dot(picture(ep))
    assert dot.count("subgraph cluster_") == 4
    # cluster_c2 (the innermost no_grad) opens inside cluster_c1 (enable_grad) inside cluster_c0
    opened = [line.strip() for line in dot.splitlines() if line.strip().startswith("subgraph cluster_")]
    indents = {line.split()[1]: len(raw) - len(raw.lstrip()) for raw in dot.splitlines()
               if raw.strip().startswith("subgraph cluster_") for line in [raw.strip()]}
    assert len(opened) == 4 and indents["cluster_c0"] < indents["cluster_c1"] < indents["cluster_c2"]
    assert indents["cluster_c3"] == indents["cluster_c0"]
    for kind in (ClusterKind.GRAD_DISABLED, ClusterKind.GRAD_ENABLED, ClusterKind.AUTOCAST):
        assert f'fillcolor="{CLUSTER_STYLE[kind][0]}"' in dot


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz `dot` is not installed (apt-get install graphviz)")
def test_svg_through_graphviz():
    svg = to_svg(to_dot(picture(all_kinds(), title="AllKinds")))
    root = ET.fromstring(svg)
    ns = {"svg": "http://www.w3.org/2000/svg"}
    clusters = [g.find("svg:title", ns).text for g in root.iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "cluster"]
    assert clusters == ["cluster_c0"]
    texts = {t.text for t in root.iter("{http://www.w3.org/2000/svg}text")}
    assert {"grad disabled", "linear", "p_lin_weight", "c_offset", "steps", "writes back"} <= texts


def test_svg_without_graphviz_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(GraphvizNotFoundError) as info:
        to_svg("digraph {}")
    message = str(info.value)
    assert "apt-get install graphviz" in message and "`pip install graphviz` is not enough" in message
    assert "-o picture.html" in message


class _Structure(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.ids, self.urls, self.problems = [], [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag not in ("meta", "br", "link", "img", "input"):
            self.stack.append(tag)
        if "id" in attrs:
            self.ids.append(attrs["id"])
        self.urls += [v for k, v in attrs.items() if k in ("src", "href") and not v.startswith("#")]

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.problems.append(tag)


def test_html_is_self_contained_and_well_formed():
    page = to_html(picture(all_kinds(), title="AllKinds"))
    parser = _Structure()
    parser.feed(page)
    assert parser.problems == [] and parser.stack == []
    assert len(parser.ids) == len(set(parser.ids))
    assert parser.urls == []  # no external scripts, styles or images
    assert "http://" not in page and "https://" not in page
    for label in ("grad disabled", "p_lin_weight", "linear", "writes back into", "composite kept whole"):
        assert label in page


def _browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(_browser() is None, reason="no headless browser (apt-get install chromium)")
def test_html_renders_in_a_headless_browser(tmp_path):
    page = tmp_path / "nested.html"
    page.write_text(to_html(picture(export(Nested(), torch.randn(3, 3)), title="Nested")))
    done = subprocess.run(
        [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--enable-logging=stderr", "--v=0",
         f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'data-rendered="ok"' in done.stdout  # the inline script ran to its end
    console = [line for line in done.stderr.splitlines() if "CONSOLE" in line]
    assert console == [], console
    for label in ("grad disabled", "grad enabled", "autocast cpu bfloat16", "mul_2", "aten.mm.default"):
        assert label in done.stdout
