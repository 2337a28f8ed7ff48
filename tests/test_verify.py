"""The IR contract verifier (predispatch/serialize/verify.py) and its op allow list."""

from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch
from expecttest import TestCase
from torch import fx, nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch.errors import NonFunctionalGraphError
from predispatch.serialize import op_allowlist
from predispatch.serialize.graph import HIGHER_ORDER_OPS
from predispatch.serialize.op_allowlist import decide
from predispatch.serialize.verify import HOP_CONVENTIONS, graph_problems, program_problems, verifying

aten = torch.ops.aten


# --------------------------------------------------------------------------- the allow list


def test_op_table_decides_every_op():
    """The checked-in table is what the rules generate from this torch: an op torch adds (or
    drops) fails here until someone regenerates the table and reviews the diff."""
    current = op_allowlist.classify(op_allowlist.registry_packets())
    from predispatch.serialize.op_families import PACKETS

    stored = {family: set(packets) for family, packets in PACKETS.items()}
    new = sorted(p for packets in current.values() for p in packets if not any(p in s for s in stored.values()))
    gone = sorted(p for packets in stored.values() for p in packets if not any(p in c for c in current.values()))
    moved = sorted(p for family, packets in current.items() for p in packets if p in set().union(*stored.values()) and p not in stored.get(family, ()))
    assert (new, gone, moved) == ([], [], []), (
        f"torch's ops changed: new {new}, gone {gone}, moved between families {moved}. "
        "Run `python -m predispatch.serialize.op_allowlist --write` and review the diff of the op_families_<release>.json table."
    )
    assert op_allowlist.render(current) == open(op_allowlist.TABLE_PATH).read()


def test_allow_list_families():
    """Sizes of the families (packets; a packet's mutable overloads are refused by schema), per
    torch release: each release's table is generated on it and reviewed as a diff."""
    common = {"io": 6, "global_state": 16, "unsafe_layout": 184, "test_only": 12, "trusts_inputs": 46, "predispatch": 1}
    by_release = {
        (2, 11): {"torchscript_builtin": 137, "mutable_only": 249, "aten_functional": 1078, "prims": 134},
        (2, 12): {"torchscript_builtin": 132, "mutable_only": 252, "aten_functional": 1090, "prims": 136},
        (2, 13): {"torchscript_builtin": 133, "mutable_only": 251, "aten_functional": 1086, "prims": 136},
        (2, 14): {"torchscript_builtin": 133, "mutable_only": 252, "aten_functional": 1086, "prims": 136},
        (2, 15): {"torchscript_builtin": 134, "mutable_only": 255, "aten_functional": 1088, "prims": 136},
    }
    assert op_allowlist.allow_list_summary() == {**common, **by_release[ti.TORCH]}
    assert [f.name for f in op_allowlist.FAMILIES if f.allowed] == ["aten_functional", "prims", "predispatch"]
    assert all(f.reason for f in op_allowlist.FAMILIES)


def test_allowed_overloads_agree_with_torchs_schemas_and_tags():
    """Checked against torch's own metadata: no allowed overload mutates (schema or tag), and
    each is a dispatcher op (not a TorchScript builtin)."""
    from predispatch.serialize.op_families import PACKETS

    allowed, refused = 0, 0
    # the tags this torch has (`inplace` and `out` came in 2.13)
    mutating_tags = {getattr(torch.Tag, t) for t in ("inplace", "inplace_view", "out", "out_variant") if hasattr(torch.Tag, t)}
    for family in ("aten_functional", "prims", "predispatch"):
        for packet in PACKETS[family]:
            namespace, name = packet.split(".")
            ops = getattr(getattr(torch.ops, namespace), name)
            for overload in ops.overloads():
                op = getattr(ops, overload)
                decision = decide(op)
                if decision.allowed:
                    allowed += 1
                    assert not op._schema.is_mutable and not mutating_tags & set(op.tags), op
                    assert not any(str(a.type) == "Storage" for a in op._schema.arguments), op
                else:
                    refused += 1
    assert allowed > 1500 and refused > 1000, (allowed, refused)  # 1559 and 1307 overloads in torch 2.13


@pytest.mark.parametrize("op, family", [
    (aten.from_file.default, "io"),
    (aten.save.default, "io"),
    (aten._print.default, "io"),
    (aten._debug_has_internal_overlap.default, "io"),
    (aten.manual_seed.default, "global_state"),
    (aten.set_grad_enabled.default, "global_state"),
    (aten._sparse_coo_tensor_with_dims_and_tensors.default, "unsafe_layout"),
    (aten._reshape_alias.default, "unsafe_layout"),
    (aten._nested_view_from_buffer.default, "unsafe_layout"),
    (aten.add_.Tensor, "mutable_only"),
    (aten.copy_.default, "mutable_only"),
    (aten.add.out, "mutable_schema"),
    (aten.index_put_.default, "mutable_only"),
    (aten.add.str, "torchscript_builtin"),
    (aten.len.t, "torchscript_builtin"),
])
def test_refused_ops(op, family):
    decision = decide(op)
    assert (decision.allowed, decision.family) == (False, family)


@pytest.mark.parametrize("op", [
    aten.add.Tensor, aten.linear.default, aten.scaled_dot_product_attention.default, aten._to_copy.default,
    aten.lift_fresh_copy.default, aten.native_dropout.default, aten._native_batch_norm_legit_functional.default,
    aten.as_strided.default, aten.empty.memory_format, aten.fake_quantize_per_tensor_affine.default,
    torch.ops.prims.mul.default, torch.ops.predispatch.keep_history.default,
])
def test_allowed_ops(op):
    assert decide(op).allowed, decide(op)


def test_custom_namespaces_only_by_name_and_only_functional():
    @torch.library.custom_op("pdverify::scale", mutates_args=())
    def scale(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @torch.library.custom_op("pdverify::scale_", mutates_args=("x",))
    def scale_(x: torch.Tensor) -> None:
        x.mul_(2)

    assert decide(torch.ops.pdverify.scale.default).family == "namespace"
    assert decide(torch.ops.pdverify.scale.default, ("pdverify",)).allowed
    assert decide(torch.ops.pdverify.scale_.default, ("pdverify",)).family == "mutable_schema"


# --------------------------------------------------------------------------- graphs


def _graph(build) -> fx.GraphModule:
    """A graph module with a subgraph `body` (x -> x * 2), built by `build(graph, x, body)`."""
    body = fx.Graph()
    bx = body.placeholder("x")
    body.output((body.call_function(aten.mul.Tensor, (bx, 2)),))
    root = nn.Module()
    root.body = fx.GraphModule(nn.Module(), body)
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(build(graph, x, graph.get_attr("body")))
    return fx.GraphModule(root, graph)


def _invoke(identifier, operands):
    hop = torch.ops.higher_order.invoke_subgraph

    def build(graph, x, body):
        result = graph.call_function(hop, (body, identifier, *[x if o == "x" else o for o in operands]))
        return (graph.call_function(__import__("operator").getitem, (result, 0)),)

    return _graph(build)


def test_invoke_subgraph_convention():
    """invoke_subgraph(subgraph, identifier, *operands): the repeated-block HOP."""
    assert graph_problems(_invoke("block_0", ["x"])) == []
    assert [p.why for p in graph_problems(_invoke(3, ["x"]))] == ["invoke_subgraph argument 1 must be a str, not int 3"]
    assert [p.why for p in graph_problems(_invoke("block_0", ["x", "x"]))] == [
        "invoke_subgraph passes 2 operands to subgraph 'body', which takes 1"
    ]
    assert [p.why for p in graph_problems(_invoke("block_0", [1.5]))] == [
        "invoke_subgraph operand 0 is float 1.5; operands are node or int or none"
    ]


def test_every_hop_the_format_names_has_a_convention():
    assert set(HIGHER_ORDER_OPS) <= set(HOP_CONVENTIONS)
    assert {"wrap_with_set_grad_enabled", "wrap_with_autocast", "autograd_function_apply", "with_effects", "invoke_subgraph"} <= set(HOP_CONVENTIONS)


def test_graph_structure_problems():
    def call_module(graph, x, body):
        return (graph.call_module("body", (x,)),)

    def raw_toggle(graph, x, body):
        graph.call_function(torch._C._set_grad_enabled, (False,))
        return (x,)

    assert [p.why for p in graph_problems(_graph(call_module))] == ["a call_module node; programs hold only placeholder, get_attr, call_function, output"]
    assert [p.why for p in graph_problems(_graph(raw_toggle))] == [
        "calls _set_grad_enabled, which is neither an allowed op, a known HOP nor an allowed Python function"
    ]


class ExportedPrograms(TestCase):
    """The verifier on what export makes: good programs pass, and a broken one is caught."""

    def setUp(self):
        class Model(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)
                self.register_buffer("steps", torch.zeros(()))

            def forward(self, x):
                self.steps.add_(1)
                with torch.no_grad():
                    y = self.lin(x)
                return y * x

        self.ep = predispatch.export(Model(), (torch.randn(2, 3),))

    def test_a_good_program_has_no_problems(self):
        self.assertEqual(program_problems(self.ep), [])
        self.assertEqual(program_problems(self.ep, stored=True), [])

    def test_a_mutable_op_is_caught(self):
        gm = copy.deepcopy(self.ep.graph_module)
        mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
        mul.target = aten.mul_.Tensor
        ep = dataclasses.replace(self.ep, graph_module=gm)
        self.assertExpectedInline("\n".join(map(str, program_problems(ep))), """\
graph module <root>, node mul: calls aten.mul_.Tensor, which a program may not call (mutable_only: every overload mutates an argument (in place or out=); programs are functional)""")

    def test_a_mutation_output_of_another_dtype_is_caught(self):
        state = {**self.ep.state_dict, "steps": self.ep.state_dict["steps"].double()}
        ep = dataclasses.replace(self.ep, state_dict=state)
        self.assertExpectedInline("\n".join(map(str, program_problems(ep))), """\
signature input b_steps (BUFFER 'steps'): its value is torch.float32[0 dims], its target torch.float64[0 dims]
graph output 0 (BUFFER_MUTATION 'steps'): its value is torch.float32[0 dims], its target torch.float64[0 dims]""")

    def test_verifying_export_raises_our_error(self):
        def broken_export(*args, **kwargs):
            gm = copy.deepcopy(self.ep.graph_module)
            gm.graph.output_node().args = ((gm.graph.output_node().args[0][0], "not a tensor"),)
            return dataclasses.replace(self.ep, graph_module=gm)

        with self.assertRaises(NonFunctionalGraphError) as info:
            verifying(broken_export)()
        self.assertIn("graph output 1 (USER_OUTPUT 'output'): is str 'not a tensor', not a node", str(info.exception))

    def test_meta_state_is_refused_only_for_files(self):
        state = {k: v.to("meta") for k, v in self.ep.state_dict.items()}
        ep = dataclasses.replace(self.ep, state_dict=state)
        self.assertEqual(program_problems(ep), [])  # export of a model built on the meta device
        self.assertIn("on device meta, which has no data to hold", str(program_problems(ep, stored=True)[0]))


def test_sparse_ops_are_the_users_own_in_export_but_never_in_a_file():
    """Export keeps the user's own sparse code (the `files_only` family); a file may not hold it."""
    assert decide(aten._to_sparse.default, stored=False).allowed
    assert decide(aten._to_sparse.default).family == "unsafe_layout"
    assert not decide(aten.from_file.default, stored=False).allowed  # other refusals hold everywhere

    class Sparse(nn.Module):
        def forward(self, x):
            return x.to_sparse().to_dense() * 2

    ep = predispatch.export(Sparse(), (torch.randn(2, 3),))
    assert program_problems(ep) == []
    with pytest.raises(predispatch.errors.SerializationError, match=r"node _to_sparse meta\['val'\]: a torch.sparse_coo tensor; format version 1 holds strided"):
        predispatch.save(ep, io.BytesIO())
    # the verifier says the same of the op, for a save that got past the encoder
    assert "node _to_sparse: calls aten._to_sparse.default, which a program may not call (unsafe_layout:" in str(program_problems(ep, stored=True)[0])


def test_every_kernel_that_may_trust_its_inputs_is_decided():
    """The schema scan of kernels taking indices, offsets or saved statistics: each candidate
    is refused in files, proved fed by its forward, or listed as checking its arguments; every
    table entry is a packet of this torch (Note [Kernels that trust their inputs])."""
    from predispatch.serialize import kernel_inputs
    from predispatch.serialize.op_families import PACKETS

    scanned = {packet for packet, _ in kernel_inputs.scan()}
    decided = kernel_inputs.TRUSTING_PACKETS | set(kernel_inputs.CHECKED_BY_TORCH)
    assert sorted(scanned - decided) == [] and sorted(set(kernel_inputs.CHECKED_BY_TORCH) - scanned) == []
    assert kernel_inputs.TRUSTING_PACKETS == set(PACKETS["trusts_inputs"])
    assert (len(kernel_inputs.REFUSED_IN_FILES), len(kernel_inputs.FORWARD_PROOFS)) == (33, 13)


def test_a_joint_program_fed_by_its_forwards_saves_loads_and_runs():
    """The proved kernels (max-pool, embedding, layer/group/batch norm backwards) in a joint
    program: it loads, and its gradients equal the saved program's."""
    import io

    import load_attacks

    import predispatch

    data = load_attacks.kernel_program()
    loaded = predispatch.load(io.BytesIO(data))
    targets = {str(n.target) for n in loaded.graph.nodes}
    assert {"aten.max_pool2d_with_indices_backward.default", "aten.embedding_dense_backward.default",
            "aten.native_layer_norm_backward.default", "aten.native_batch_norm_backward.default"} <= targets
    torch.manual_seed(0)
    original = predispatch.export(load_attacks.Kernels().train(), load_attacks.KERNEL_ARGS).joint(loss="")
    with torch.no_grad():
        expected, actual = original.module()(*load_attacks.KERNEL_ARGS), loaded.module()(*load_attacks.KERNEL_ARGS)
    for e, a in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(actual)):
        assert torch.equal(e, a)


def _memory_joint():
    """A joint program with shared bodies whose backward body calls native_layer_norm_backward
    (its forward, native_layer_norm, is in the forward body): tests/test_joint.py's MemoryStack."""
    from test_joint import MemoryStack

    torch.manual_seed(0)
    model, x = MemoryStack(), torch.randn(2, 3, 8)
    return predispatch.export(model, (x,)).joint(), x


def test_a_joint_program_with_shared_bodies_proves_its_kernels_through_the_calls():
    """Each call of the backward body is fed the mean and rstd of one forward-body call's layer
    norm, run on the very input and parameters the backward reads: the file loads and runs
    exactly like the program saved."""
    jp, x = _memory_joint()
    assert jp.graph_module.repeated_body_0_backward_1.graph.find_nodes(
        op="call_function", target=torch.ops.aten.native_layer_norm_backward.default)
    buffer = io.BytesIO()
    predispatch.save(jp, buffer)
    loaded = predispatch.load(io.BytesIO(buffer.getvalue()))
    torch.manual_seed(1)
    with torch.no_grad():
        expected = jp.module()(x)
    torch.manual_seed(1)
    with torch.no_grad():
        actual = loaded.module()(x)
    for e, a in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(actual)):
        assert torch.equal(e, a)


def test_a_backward_body_fed_another_calls_statistics_is_refused():
    """The last layer's backward call handed the first layer's saved statistics (of another
    input): the proof through the calls fails, naming the call."""
    jp, _ = _memory_joint()
    graph = jp.graph_module.graph
    invoke = torch.ops.higher_order.invoke_subgraph
    forwards = [n for n in graph.find_nodes(op="call_function", target=invoke) if n.args[1].endswith("_forward")]
    last_backward = next(n for n in graph.find_nodes(op="call_function", target=invoke) if "_backward" in n.args[1])
    body = getattr(jp.graph_module, last_backward.args[0].target)
    norm = body.graph.find_nodes(op="call_function", target=torch.ops.aten.native_layer_norm_backward.default)[0]
    mean = norm.args[3]
    position = body.graph.find_nodes(op="placeholder").index(mean)
    fed = last_backward.args[2 + position]
    first = next(u for u in forwards[0].users if u.args[1] == fed.args[1])  # the same output of layer 0's call
    last_backward.args = (*last_backward.args[: 2 + position], first, *last_backward.args[3 + position:])
    problems = [str(p) for p in program_problems(jp, stored=True)]
    assert any("native_layer_norm_backward" in p and f"at call {last_backward.name} of its body" in p for p in problems), problems


@pytest.mark.slow
def test_every_backward_kernel_that_reads_an_unchecked_gradient_is_decided():
    """The gradient probe (Note [Kernels that trust their gradient's shape]), in a subprocess
    (a kernel reading out of bounds may crash): every allowed backward kernel autograd calls on
    the OpInfo samples that takes a shrunk or grown gradient without raising or broadcasting is
    checked at each call (`GRAD_SHAPES`), explained (`GRAD_SHAPE_SAFE`) or refused in files."""
    import json
    import os
    import subprocess
    import sys

    from predispatch.runtime import kernel_checks
    from predispatch.serialize import kernel_inputs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "predispatch.serialize.kernel_inputs", "--probe"],
        capture_output=True, text=True, timeout=900, cwd=root, env={**os.environ, "PYTHONPATH": root},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = json.loads(result.stdout)
    assert len(verdicts) > 50  # the probe reached the backward kernels
    unchecked = {packet for packet, found in verdicts.items() if "UNCHECKED" in found.values()}
    decided = set(kernel_checks.GRAD_SHAPES) | set(kernel_checks.GRAD_SHAPE_SAFE) | set(kernel_inputs.REFUSED_IN_FILES)
    assert sorted(unchecked - decided) == []
    assert {"aten.native_layer_norm_backward", "aten.native_batch_norm_backward", "aten.grid_sampler_2d_backward"} <= unchecked


def test_kernels_given_a_gradient_of_another_shape_are_refused_before_they_run():
    """`grad_shape_problem`, on each `GRAD_SHAPES` kernel's honest call and with a one-element
    gradient: the honest call passes, the other is refused naming the shapes.  Before: the
    kernels ran and read past the gradient (tests/load_attacks.py's kernel attacks show it
    through `ep.module()`)."""
    from predispatch.runtime.kernel_checks import GRAD_SHAPES, grad_shape_problem

    aten = torch.ops.aten
    x, w, b = torch.randn(2, 3, 8), torch.ones(8), torch.zeros(8)
    out, mean, rstd = aten.native_layer_norm(x, [8], w, b, 1e-5)
    image, grid = torch.randn(1, 2, 5, 5), torch.rand(1, 3, 3, 2) * 2 - 1
    q = torch.randn(1, 2, 4, 8)
    attention, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[:2]
    log_probs = torch.randn(6, 2, 4).log_softmax(2)
    targets = torch.tensor([[1, 2, 3], [3, 2, 1]])
    loss, alpha = aten._ctc_loss(log_probs, targets, [6, 6], [3, 3], 0, False)
    bn, bn_mean, bn_invstd = aten.native_batch_norm(x, None, None, None, None, True, 0.1, 1e-5)
    calls = {
        "aten.native_layer_norm_backward": (aten.native_layer_norm_backward.default, (out, x, [8], mean, rstd, w, b, [True] * 3)),
        "aten.native_batch_norm_backward": (aten.native_batch_norm_backward.default,
                                            (bn, x, None, None, None, bn_mean, bn_invstd, True, 1e-5, [True] * 3)),
        "aten._scaled_dot_product_flash_attention_for_cpu_backward": (
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default, (attention, q, q, q, attention, logsumexp, 0.0, False)),
        "aten.grid_sampler_2d_backward": (aten.grid_sampler_2d_backward.default,
                                          (torch.ones(1, 2, 3, 3), image, grid, 0, 0, False, [True, True])),
        "aten._ctc_loss_backward": (aten._ctc_loss_backward.default,
                                    (torch.ones(2), log_probs, targets, [6, 6], [3, 3], loss, alpha, 0, False)),
    }
    assert set(calls) == set(GRAD_SHAPES)
    for packet, (op, args) in calls.items():
        assert grad_shape_problem(op, args, {}) is None, packet
        op(*args)  # the honest call runs
        problem = grad_shape_problem(op, (torch.ones(1), *args[1:]), {})
        assert problem is not None and problem.startswith(f"{op} is given {GRAD_SHAPES[packet].grad} of shape (1,)"), problem
