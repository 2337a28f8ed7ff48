"""The IR contract verifier (predispatch/serialize/verify.py) and its op allow list."""

from __future__ import annotations

import copy
import dataclasses
import io
import os

import pytest
import torch
from expecttest import TestCase
from helpers import subprocess_env
from torch import fx, nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch.errors import NonFunctionalGraphError, SerializationError
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
    common = {"io": 6, "global_state": 16, "unsafe_layout": 184, "test_only": 12, "trusts_inputs": 46, "predispatch": 2}
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
    with pytest.raises(predispatch.errors.SerializationError, match=r"node _to_sparse meta\['val'\]: a torch.sparse_coo tensor; the file format holds strided"):
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
def test_every_backward_kernel_argument_that_is_read_unchecked_is_decided():
    """The argument probe (Note [Kernels that trust their arguments' shapes]), in a subprocess
    (each argument in a child of its own: a kernel reading out of bounds may crash): every
    tensor and int-list argument of every allowed backward kernel autograd calls on the OpInfo
    samples that is taken shrunk or grown without raising or broadcasting is checked at each
    call (`SHAPE_RULES`: the argument or one its shape comes from), proved from its forward
    (`FORWARD_PROOFS`), refused in files, or explained (`SHAPE_SAFE`)."""
    import json
    import os
    import subprocess
    import sys

    from predispatch.passes import kernel_shapes
    from predispatch.serialize import kernel_inputs

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "predispatch.serialize.kernel_inputs", "--probe"],
        capture_output=True, text=True, timeout=900, cwd=root, env=subprocess_env(root),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    verdicts = json.loads(result.stdout)
    assert len(verdicts) > 50 and sum(map(len, verdicts.values())) > 150  # the probe reached the kernels' arguments
    unchecked = {(packet, argument) for packet, found in verdicts.items() for argument, v in found.items() if v.startswith("UNCHECKED")}
    assert sorted(unchecked - _decided_arguments(kernel_shapes, kernel_inputs)) == []
    assert {("aten.native_layer_norm_backward", "grad_out"), ("aten._log_softmax_backward_data", "output"),
            ("aten._pdist_backward", "self")} <= unchecked


def _decided_arguments(kernel_shapes, kernel_inputs) -> set[tuple[str, str]]:
    """(packet, argument)s the tables decide: refused packets' every argument (their calls
    are refused), a shape rule's argument and those its shape comes from, a forward proof's
    trusted and same arguments, and those explained safe."""
    decided = set(kernel_shapes.SHAPE_SAFE)
    for packet, rules in kernel_shapes.SHAPE_RULES.items():
        decided |= {(packet, name) for rule in rules for name in (rule.argument, *rule.reads)}
    for packet, proof in kernel_inputs.FORWARD_PROOFS.items():
        decided |= {(packet, name) for name in (*proof.outputs, *(b for b, _ in proof.same))}
    refused = {(packet, a.name) for packet in kernel_inputs.REFUSED_IN_FILES if hasattr(torch.ops.aten, packet.split(".")[1])
               for o in getattr(torch.ops.aten, packet.split(".")[1]).overloads()
               for a in getattr(getattr(torch.ops.aten, packet.split(".")[1]), o)._schema.arguments}
    return decided | refused


def _shape_rule_calls() -> dict[str, tuple]:
    """An honest call of each `SHAPE_RULES` kernel, recorded while eager autograd
    differentiates a small use of its forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from predispatch.passes.kernel_shapes import SHAPE_RULES, packet_of

    calls: dict[str, tuple] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if packet_of(func) in SHAPE_RULES and packet_of(func) not in calls:
                calls[packet_of(func)] = (func, torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), args))
            return func(*args, **(kwargs or {}))

    F = torch.nn.functional
    x = torch.randn(2, 3, 8, requires_grad=True)
    image, volume = torch.randn(1, 2, 5, 5, requires_grad=True), torch.randn(1, 2, 3, 3, 3, requires_grad=True)
    points, q = torch.randn(4, 3, requires_grad=True), torch.randn(1, 2, 4, 8, requires_grad=True)
    log_probs = torch.randn(6, 2, 4).log_softmax(2).requires_grad_()
    uses = [
        lambda: F.layer_norm(x, [8]), lambda: F.batch_norm(image, None, None, training=True),
        lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)[0],
        lambda: F.grid_sample(image, torch.rand(1, 3, 3, 2) * 2 - 1, align_corners=False),
        lambda: F.grid_sample(volume, torch.rand(1, 2, 2, 2, 3) * 2 - 1, align_corners=False),
        lambda: F.ctc_loss(log_probs, torch.tensor([[1, 2, 3], [3, 2, 1]]), [6, 6], [3, 3], reduction="none"),
        lambda: torch.log_softmax(x, -1), lambda: torch.cdist(points, points * 2), lambda: torch.pdist(points),
        lambda: F.adaptive_avg_pool2d(image, 2), lambda: F.adaptive_avg_pool3d(volume, 2), lambda: x.unfold(2, 3, 2),
    ]
    for use in uses:
        out = use()
        with Record():
            out.backward(torch.randn_like(out))
    return calls


def test_kernels_given_an_argument_of_another_shape_are_refused_before_they_run():
    """`shape_problem`, on each `SHAPE_RULES` kernel's honest call and with each checked
    argument one element: the honest call passes, the other is refused naming the shapes.
    Before: the kernels ran and read past the argument (tests/load_attacks.py's kernel
    attacks show it through `ep.module()`)."""
    from predispatch.passes.kernel_shapes import SHAPE_RULES, shape_problem

    calls = _shape_rule_calls()
    assert set(calls) == set(SHAPE_RULES)
    for packet, (op, args) in calls.items():
        assert shape_problem(op, args, {}) is None, packet
        names = [a.name for a in op._schema.arguments]
        for rule in SHAPE_RULES[packet]:
            position = names.index(rule.argument)
            problem = shape_problem(op, (*args[:position], torch.ones(1, dtype=args[position].dtype), *args[position + 1:]), {})
            assert problem is not None and problem.startswith(f"{op} is given {rule.argument} of shape (1,) where it must have shape"), problem


def torch_checks_refuse_every_rule() -> None:
    """Run in a subprocess by the test below (a check that failed to fire would let the
    kernel read out of bounds): each `SHAPE_RULES` kernel's honest call as a graph with
    `pin_kernel_shapes`' views gives the kernel's result; with a checked argument of one
    element, or one more in each dimension, the graph raises before the kernel."""
    from predispatch.passes.kernel_shapes import SHAPE_RULES, pin_kernel_shapes

    for packet, (op, args) in _shape_rule_calls().items():
        names = [a.name for a in op._schema.arguments]
        graph = fx.Graph()
        values = [graph.placeholder(f"a{i}") if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        for node, value in zip(values, args):
            if isinstance(node, fx.Node):
                node.meta["val"] = value
        graph.output(graph.call_function(op, tuple(values)))
        assert pin_kernel_shapes(graph) == 1
        gm = fx.GraphModule(torch.nn.Module(), graph)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for e, a in zip(torch.utils._pytree.tree_leaves(op(*args)), torch.utils._pytree.tree_leaves(gm(*tensors))):
            assert e is None and a is None or torch.equal(e, a), packet
        for rule in SHAPE_RULES[packet]:
            checked = args[names.index(rule.argument)]
            for bad in (torch.ones(1, dtype=checked.dtype), torch.ones([n + 1 for n in checked.shape], dtype=checked.dtype)):
                fed = [bad if a is checked else a for a in tensors]
                with pytest.raises(RuntimeError, match="is invalid for input of size"):
                    gm(*fed)
    print("every rule refused")


def test_to_torch_graphs_check_every_rule_before_the_kernel():
    """`to_torch()`'s checks (`pin_kernel_shapes`: the kernel's arguments through `aten.view`s
    of the shapes they must have) on every `SHAPE_RULES` kernel, in a subprocess."""
    _in_subprocess("torch_checks_refuse_every_rule", "every rule refused")


def test_every_shape_rule_names_arguments_of_its_kernel():
    """A rule naming an argument the schema lacks would check nothing (torch 2.15 renamed
    `_cdist_backward`'s `grad` to `grad_output`): every name a rule reads is in its kernel's
    schema, on every overload."""
    from predispatch.passes.kernel_shapes import SHAPE_RULES

    for packet, rules in SHAPE_RULES.items():
        packet_ops = getattr(torch.ops.aten, packet.split(".")[1])
        for overload in packet_ops.overloads():
            names = {a.name for a in getattr(packet_ops, overload)._schema.arguments}
            assert {n for rule in rules for n in (rule.argument, *rule.reads)} <= names, (packet, overload)


def crafted_program_through_torch() -> None:
    """Run in a subprocess by the test below: a file whose cdist backward is fed a (4, 3)
    gradient where its forward gave (4, 4), loaded and converted with `to_torch()`: the
    conversion refuses it by name (the program's own meta shows it; where the meta lies, the
    view before the kernel raises at the call: `torch_checks_refuse_every_rule`)."""
    import load_attacks

    def edit(p):
        record = next(n for n in load_attacks.module_of(p)["nodes"] if n.get("target") == "aten._cdist_backward.default")
        record["args"][0] = {"node": "p_points"}  # the gradient: `grad` (`grad_output` from torch 2.15)

    loaded = predispatch.load(io.BytesIO(load_attacks.edited(load_attacks.shape_kernel_program(), edit)))
    with pytest.raises(SerializationError, match=r"refused to convert a kernel call: aten._cdist_backward.default \(_cdist_backward\) "
                       r"is given grad(_output)? of shape \(4, 3\), which it would read as \[4, 4\]"):
        loaded.to_torch()

    print("refused through torch")


def test_a_crafted_program_converted_to_torch_still_refuses_its_kernel():
    """The check survives `to_torch()`: converting the crafted program is refused by name
    (before: it converted, and torch's `module()` ran `_cdist_backward` on a smaller gradient,
    reading past it).  In a subprocess."""
    _in_subprocess("crafted_program_through_torch", "refused through torch")


def _in_subprocess(function: str, done: str) -> None:
    """Run this module's `function` in a fresh interpreter (a kernel that reads out of bounds
    crashes it, not the test run); it prints `done` when all its assertions held."""
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", f"import sys; sys.path.insert(0, {here!r}); "
                             f"import test_verify; test_verify.{function}()"],
                            capture_output=True, text=True, timeout=300, env=subprocess_env(os.path.dirname(here)))
    assert result.returncode == 0 and done in result.stdout, result.stderr[-3000:]


def test_an_honest_joint_with_checked_kernels_converts_and_gives_eagers_gradients():
    """The joint of ShapeKernels and of Kernels (layer and batch norm, log-softmax, cdist,
    pdist, adaptive pooling, unfold, 3-d grid sampling) through `to_torch()`: torch's verifier
    accepts the checks, `module()` gives the program's outputs bitwise and eager's gradients,
    and `torch.export.save`/`load` keep the checks."""
    import load_attacks

    from predispatch.passes.kernel_shapes import trusts_shapes

    torch.manual_seed(0)
    model = load_attacks.ShapeKernels()
    args = load_attacks.SHAPE_KERNEL_ARGS
    jp = predispatch.export(model, args).joint(loss="")
    converted = jp.to_torch()
    checks = [n for n in converted.graph.nodes if n.target is torch.ops.aten.view.default and any(trusts_shapes(u.target) for u in n.users)]
    assert len(checks) >= 8
    expected, actual = jp.module()(*args), converted.module()(*args)
    for e, a in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(actual)):
        assert torch.equal(e, a)
    loss = model(*args)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for name, g in zip(dict(model.named_parameters()), grads):
        torch.testing.assert_close(actual[1][name], g)
    buffer = io.BytesIO()
    torch.export.save(converted, buffer)
    buffer.seek(0)
    again = torch.export.load(buffer)
    assert sum(n.target is torch.ops.aten.view.default and any(trusts_shapes(u.target) for u in n.users) for n in again.graph.nodes) == len(checks)
    kernels = predispatch.export(load_attacks.Kernels().train(), load_attacks.KERNEL_ARGS).joint(loss="")
    with torch.no_grad():
        expected, actual = kernels.module()(*load_attacks.KERNEL_ARGS), kernels.to_torch().module()(*load_attacks.KERNEL_ARGS)
    for e, a in zip(torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(actual)):
        assert torch.equal(e, a)


class _DynamicKernels(nn.Module):
    """Layer norm, pdist and log-softmax backwards whose checked shapes follow a dynamic batch."""

    def __init__(self):
        super().__init__()
        self.norm, self.points = nn.LayerNorm(8), nn.Parameter(torch.randn(3, 8))

    def forward(self, x):
        return self.norm(x).sum() + torch.pdist(self.points * x.sum()).sum() + torch.log_softmax(x * self.points.sum(), -1).sum()


def test_to_torch_checks_follow_symbolic_sizes():
    """With a dynamic batch, the views before the checked kernels are sized by `sym_size.int`
    nodes: the converted program gives the joint's outputs bitwise at two batch sizes, and
    keeps working through `run_decompositions` and `torch.export.save`/`load`."""
    torch.manual_seed(0)
    batch = torch.export.Dim("batch", min=2, max=64)
    jp = predispatch.export(_DynamicKernels(), (torch.randn(4, 8),), dynamic_shapes={"x": {0: batch}}).joint(loss="")
    converted = jp.to_torch()
    views = [n for n in converted.graph.nodes if n.target is torch.ops.aten.view.default and any(isinstance(a, fx.Node) for a in n.args[1])]
    assert views  # sized by the batch's symbol
    for n in (4, 7):
        x = torch.randn(n, 8)
        for e, a in zip(torch.utils._pytree.tree_leaves(jp.module()(x)), torch.utils._pytree.tree_leaves(converted.module()(x))):
            assert torch.equal(e, a)
    x = torch.randn(5, 8)
    expected = jp.module()(x)[0]
    assert torch.equal(converted.run_decompositions({}).module()(x)[0], expected)
    buffer = io.BytesIO()
    torch.export.save(converted, buffer)
    buffer.seek(0)
    assert torch.equal(torch.export.load(buffer).module()(x)[0], expected)


class _LayerNormPair(torch.autograd.Function):
    """Layer norm written as a Function whose backward is torch's kernel, fed the saved mean and
    rstd of its forward: the shape of a per-rank DTensor program's pair (its backward subgraph
    calls the kernel on values its forward subgraph saved)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        out, mean, rstd = torch.ops.aten.native_layer_norm(x, [x.shape[-1]], weight, bias, 1e-5)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        return torch.ops.aten.native_layer_norm_backward(grad, x, [x.shape[-1]], mean, rstd, weight, bias, [True, True, True])


class _LayerNormPairModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return _LayerNormPair.apply(x * 2, self.norm.weight, self.norm.bias)


def _pair_program():
    torch.manual_seed(0)
    model, x = _LayerNormPairModule(), torch.randn(3, 8)
    return predispatch.export(model, (x,)), model, x


def test_a_function_pair_fed_by_its_forward_saves_loads_and_trains():
    """`native_layer_norm_backward` in an `autograd_function_apply`'s backward subgraph, fed
    the mean and rstd its forward subgraph saved (FunctionPair): the file loads, and trains as
    the model does."""
    ep, model, x = _pair_program()
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    loaded = predispatch.load(io.BytesIO(buffer.getvalue())).module()
    model(x).sum().backward()
    loaded(x).sum().backward()
    assert torch.equal(loaded.norm.weight.grad, model.norm.weight.grad)
    assert torch.equal(loaded.norm.bias.grad, model.norm.bias.grad)


def test_a_function_pair_whose_backward_reads_other_values_is_refused():
    """The backward's mean swapped for the saved rstd, or its input for another saved tensor of
    the same shape: no longer what one layer norm of the forward subgraph produced on what the
    backward reads; refused, naming the kernel."""
    for argument, other in ((3, 4), (1, 0)):  # mean <- rstd; input <- the output gradient (x's shape)
        ep, _, _ = _pair_program()
        backward = next(m for name, m in ep.graph_module.named_children() if name.endswith("_bwd_0"))
        norm = backward.graph.find_nodes(op="call_function", target=torch.ops.aten.native_layer_norm_backward.default)[0]
        norm.args = (*norm.args[:argument], norm.args[other], *norm.args[argument + 1:])
        problems = [str(p) for p in program_problems(ep, stored=True)]
        assert any("native_layer_norm_backward" in p and "not the saved results of one aten.native_layer_norm call" in p
                   for p in problems), problems
