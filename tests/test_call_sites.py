"""Subgraphs called from many sites or along many paths (issue 40): every walk does each body
once, so load, `ep.module()`, `to_torch()`, `show` and `draw` cost what the file holds; what a
file's calls may add is bounded (Note [Calls of one subgraph] in predispatch/serialize/verify.py)."""

from __future__ import annotations

import io
import subprocess
import sys
from collections import Counter

import load_attacks
import pytest
import torch
from helpers import subprocess_env
from test_serialize import ROOT, TESTS, export_case, load_error, saved
from torch import fx, nn

import predispatch
from predispatch.render import ClusterKind, NodeKind, picture, to_dot, to_html
from predispatch.errors import SerializationError
from predispatch.serialize.verify import MAX_CALL_EXPANSION, MAX_SUBGRAPH_DEPTH


@pytest.fixture(scope="module")
def region_program() -> bytes:
    """x + no_grad(2 * x): the region every crafted nest grows from."""
    return saved(export_case("region_detached_double")[0])


def _file_nodes(ep) -> int:
    return sum(len(m.graph.nodes) for m in ep.graph_module.modules() if isinstance(m, fx.GraphModule))


class _Work:
    """What a step does, counted: graph nodes created (copies, rewrites) and graph modules compiled."""

    def __init__(self, monkeypatch):
        self.counts: Counter[str] = Counter()
        create, recompile = fx.Graph.create_node, fx.GraphModule.recompile

        def counted_create(graph, *args, **kwargs):
            self.counts["created"] += 1
            return create(graph, *args, **kwargs)

        def counted_recompile(gm):
            self.counts["compiled"] += 1
            return recompile(gm)

        monkeypatch.setattr(fx.Graph, "create_node", counted_create)
        monkeypatch.setattr(fx.GraphModule, "recompile", counted_recompile)

    def of(self, step) -> tuple[Counter[str], object]:
        self.counts.clear()
        result = step()
        return Counter(self.counts), result


def _steps(data: bytes, work: _Work) -> dict[str, int]:
    """The work of load, module(), to_torch(), show and draw on one file, one number each."""
    counted: dict[str, int] = {}
    loaded, ep = work.of(lambda: predispatch.load(io.BytesIO(data)))
    counted["load"] = loaded.total()
    module_work, module = work.of(ep.module)
    counted["module"] = module_work.total()
    counted["to_torch"] = work.of(ep.to_torch)[0].total()
    counted["show"] = len(str(ep).splitlines())
    pic = picture(ep)
    counted["draw"] = len(pic.nodes) + len(pic.clusters) + len(to_dot(pic).splitlines()) + to_html(pic).count("<tr")
    assert torch.isfinite(module(torch.zeros(3))).all()  # the call runs every path: 2^(depth-1) regions
    return counted


def test_a_body_calling_its_child_twice_at_every_level_costs_linear_work(region_program, monkeypatch):
    """The issue's file: each region's body calls the next twice, so its call paths number
    2^(depth-1) in a file linear in depth.  `module()`, `to_torch()` and `draw` walked every
    path (a 26 KB file kept module() busy past 30 s); each body is now done once, and doubling
    the depth at most quadruples any step's work (FX's copies recompile the levels below each
    one: quadratic in depth, bounded by MAX_SUBGRAPH_DEPTH).  Load and show did each body once
    already."""
    work = _Work(monkeypatch)
    shallow, deep = (_steps(load_attacks.region_dag(region_program, depth), work) for depth in (5, 10))
    assert all(deep[step] <= 4.5 * shallow[step] for step in deep), (shallow, deep)  # was 2^5 times for module, to_torch, draw
    loaded = predispatch.load(io.BytesIO(load_attacks.region_dag(region_program, 5)))
    x = torch.ones(3, requires_grad=True)
    out = loaded.module()(x)
    out.sum().backward()
    assert torch.equal(out, x.detach() * (1 + 2 ** 16)) and torch.equal(x.grad, torch.ones(3))  # the regions are no_grad
    assert torch.equal(loaded.to_torch().module()(x), out)


def test_a_nest_at_the_depth_bound_with_two_calls_per_level_is_refused_in_seconds(region_program, tmp_path):
    """2^(MAX_SUBGRAPH_DEPTH - 1) call paths in a 70 KB file: one call of it would run 2^31
    region bodies, so load refuses it, counting each body once (the count is memoized), and so
    do `predispatch show` and `draw`, in seconds, in fresh processes."""
    path = tmp_path / "dag.pd"
    path.write_bytes(load_attacks.region_dag(region_program, MAX_SUBGRAPH_DEPTH))
    with pytest.raises(SerializationError, match=r"one call runs \d+ nodes \(each subgraph as often as its callers call it\)"):
        predispatch.load(path)
    for command in (["show", str(path)], ["draw", str(path), "-o", str(tmp_path / "dag.html")]):
        done = subprocess.run([sys.executable, "-m", "predispatch", *command], capture_output=True, text=True, timeout=300,
                              env=subprocess_env(ROOT), cwd=TESTS)
        assert done.returncode != 0 and "one call runs" in done.stderr, done.stderr[-2000:]


def test_calls_below_the_work_bound_load_and_run(region_program):
    """A nest of 12 levels calling their child twice: 2^11 bodies a call, within MAX_CALL_WORK."""
    data = load_attacks.region_dag(region_program, 12)
    loaded = predispatch.load(io.BytesIO(data))
    assert torch.equal(loaded.module()(torch.zeros(3)), torch.zeros(3))  # each body doubles: zeros stay finite


def test_a_shared_body_calling_a_shared_body_is_refused(region_program):
    """Export never nests shared bodies; such a file loaded, and every backward raised torch's
    "fake_mode should be enabled for HOPs" (the inlined body still called invoke_subgraph)."""
    data = load_attacks.region_dag(region_program, 3, hops=("invoke_subgraph",))
    message = load_error(data)
    assert "graph module grad_region_0, node call0: a shared body (invoke_subgraph, called by <root>'s node call0) " in message
    assert "calls a shared body itself; a file holds no nested shared bodies" in message


def test_a_shared_body_may_hold_a_region_that_calls_shared_bodies(region_program):
    """The region is one module: its shared bodies are inlined into it once, and it trains."""
    data = load_attacks.region_dag(region_program, 3, hops=("invoke_subgraph", "wrap_with_autocast", "invoke_subgraph"))
    x = torch.ones(3, requires_grad=True)
    out = predispatch.load(io.BytesIO(data)).module()(x)
    out.sum().backward()
    assert torch.equal(out.detach(), x.detach() * (1 + 2 ** 4)) and torch.equal(x.grad, torch.full((3,), 1.0 + 2 ** 4))


def test_calls_that_expand_the_file_past_the_bound_are_refused(region_program):
    """A 200-op shared body called 200 times: inlined, 40,400 nodes from a file of 606."""
    data = load_attacks.region_dag(region_program, 1, root_calls=200, hops=("invoke_subgraph",), ops=200)
    message = load_error(data)
    assert "graph module grad_region_0: its calls add 40400 nodes" in message
    assert f"more than {MAX_CALL_EXPANSION} times the 606 nodes and tensors the file holds" in message
    assert "export with dedup=False to save repeated blocks inline" in message


def test_many_calls_of_a_shared_body_within_the_bound_cost_what_they_add(region_program, monkeypatch):
    """256 calls of a 10-node shared body: module() creates the file's nodes (its copy) and the
    2,560 the calls add (the body inlined at each), and no more."""
    data = load_attacks.region_dag(region_program, 1, root_calls=256, hops=("invoke_subgraph",), ops=8)
    ep = predispatch.load(io.BytesIO(data))
    added = 256 * (8 + 2)
    work = _Work(monkeypatch)
    created, module = work.of(ep.module)
    assert created["created"] <= _file_nodes(ep) + added
    assert work.of(ep.to_torch)[0]["created"] <= 2 * (_file_nodes(ep) + added)
    x = torch.zeros(3, requires_grad=True)
    out = module(x)
    out.sum().backward()  # the inlined bodies differentiate
    assert torch.equal(out, torch.zeros(3)) and x.grad is not None


def test_a_region_body_holding_a_tensor_called_from_two_sites(monkeypatch):
    """A file calling a region whose body holds a tensor it made, twice: `module()` lifted the
    tensor into an operand at the first call only, so every call raised "forward() missing 1
    required positional argument"."""
    data = load_attacks.called_again(saved(export_case("graph_tensors")[0]), "wrap_with_set_grad_enabled", "add")
    ep = predispatch.load(io.BytesIO(data))
    x = torch.tensor([1.0, 1.0], requires_grad=True)
    expected = x.detach() * torch.tensor([3.0, 4.0]) + x.detach() + 2 * torch.tensor([1.0, 2.0])
    out = ep.module()(x)
    out.sum().backward()
    assert torch.equal(out, expected) and torch.equal(x.grad, torch.tensor([3.0, 4.0]))  # the region is no_grad
    assert torch.equal(ep.to_torch().module()(x), expected)
    assert torch.equal(ep.to_torch(for_inference=True).module()(x), expected)


class _Scaled(nn.Module):
    """A block whose no_grad region makes a tensor: repeated, it is one shared body, and its
    region one module called at every repetition once `module()` inlines the body."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        with torch.no_grad():
            scale = self.up(x).abs().mean() + torch.tensor([1.0, 2.0]).sum()
        return x + self.down(torch.relu(self.up(self.norm(x)))) / scale


def test_a_shared_block_whose_region_makes_a_tensor_runs():
    """What a real export writes: every call of `module()` raised (in memory and loaded)."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*(_Scaled() for _ in range(4))), torch.randn(2, 3, 8)
    ep = predispatch.export(model, (x,))
    assert len(ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)) == 4
    for program in (ep, predispatch.load(io.BytesIO(saved(ep)))):
        assert torch.equal(program.module()(x), model(x))
        assert torch.equal(program.to_torch().module()(x), model(x))


def test_a_region_called_twice_is_drawn_once(region_program):
    """The later call is one CALL node saying where the body is drawn."""
    data = load_attacks.called_again(region_program, "wrap_with_set_grad_enabled", "mul")
    pic = picture(predispatch.load(io.BytesIO(data)))
    assert [c.kind for c in pic.clusters] == [ClusterKind.GRAD_DISABLED]
    (call,) = [n for n in pic.nodes if n.kind is NodeKind.CALL]
    assert (call.name, call.note) == ("wrap_with_set_grad_enabled_again", "calls grad_region_0, drawn at its first call")


def test_a_lifted_tensor_and_a_graph_tensor_of_one_flat_name_stay_apart():
    """to_torch() names a region's lifted tensor by its path flattened (`grad_region_0._tensor_constant0`
    -> `grad_region_0__tensor_constant0`), which a tensor of the root graph may be called: the
    second took the first's place (a raw AttributeError in torch's module())."""
    data = load_attacks.renamed_held(saved(export_case("graph_tensors")[0]), "_tensor_constant1", "grad_region_0__tensor_constant0")
    ep = predispatch.load(io.BytesIO(data))
    x = torch.tensor([1.0, 1.0])
    expected = x * torch.tensor([3.0, 4.0]) + x + torch.tensor([1.0, 2.0])
    assert torch.equal(ep.module()(x), expected) and torch.equal(ep.to_torch().module()(x), expected)


def test_the_verifier_counts_a_subgraphs_placeholders_once(region_program, monkeypatch):
    """It counted them at each call (a body's size at each of its calls: a crafted body of many
    placeholders called from many sites with none made load quadratic)."""
    data = load_attacks.region_dag(region_program, 2, root_calls=256)
    counted, find_nodes = Counter(), fx.Graph.find_nodes

    def counting(graph, *, op, target=None, sort=True):
        counted[op] += 1
        return find_nodes(graph, op=op, target=target, sort=sort)

    monkeypatch.setattr(fx.Graph, "find_nodes", counting)
    predispatch.load(io.BytesIO(data))
    assert counted["placeholder"] < 32, counted  # was one per call site, and more
