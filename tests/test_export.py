"""Golden graphs of small modules, each paired with a numeric check against eager."""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase
from helpers import check_gradients, export_and_check, graph
from torch import nn

import predispatch
from predispatch import InputKind, OutputKind
from predispatch import _torch_internals as ti


def exact(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def setUpModule():
    torch.manual_seed(0)


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class ConvBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        self.count.add_(1)
        self.total += x.sum(0)
        return x * self.count


class ScaleInPlace(nn.Module):
    def forward(self, x, y):
        x.mul_(2)
        return x + y


class ViewInPlace(nn.Module):
    def forward(self, x):
        row = x[0]
        row.add_(1)
        flat = x.view(-1)
        flat[2:4].zero_()
        return x.sum()


class ReshapeTo(nn.Module):
    def forward(self, x):
        y = x.reshape(2, -1)
        return y.to(torch.float64), x.to(torch.float32)


class DropoutEval(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


class DictOut(nn.Module):
    def forward(self, x):
        return {"double": x * 2, "stats": (x.mean(), x.amax()), "label": "ok", "none": None}


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, mask=None, scale=1.0):
        y = self.lin(x) * scale
        return y if mask is None else y.masked_fill(mask, 0.0)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.emb(ids))


@dataclasses.dataclass
class Batch:
    tokens: torch.Tensor
    weights: torch.Tensor
    scale: float = 2.0


class WithConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.offset = torch.arange(4.0)  # a plain tensor attribute: a CONSTANT_TENSOR input

    def forward(self, batch: Batch):
        return batch.tokens * batch.weights * batch.scale + self.offset


class GoldenGraphs(TestCase):
    maxDiff = None

    def test_linear(self):
        ep = export_and_check(Linear(), (torch.randn(2, 4),))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, p_lin_weight: "f32[3, 4]", p_lin_bias: "f32[3]", x: "f32[2, 4]"):
            linear: "f32[2, 3]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
            return (linear,)

Graph signature:
    Inputs:
        p_lin_weight: PARAMETER target='lin.weight'
        p_lin_bias: PARAMETER target='lin.bias'
        x: USER_INPUT target='x'
    Outputs:
        linear: USER_OUTPUT target='output'""")

    def test_mlp(self):
        ep = export_and_check(MLP(), (torch.randn(3, 4),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_fc1_weight: "f32[8, 4]", p_fc1_bias: "f32[8]", p_fc2_weight: "f32[2, 8]", p_fc2_bias: "f32[2]", x: "f32[3, 4]"):
        linear: "f32[3, 8]" = torch.ops.aten.linear.default(x, p_fc1_weight, p_fc1_bias);  x = p_fc1_weight = p_fc1_bias = None
        gelu: "f32[3, 8]" = torch.ops.aten.gelu.default(linear);  linear = None
        linear_1: "f32[3, 2]" = torch.ops.aten.linear.default(gelu, p_fc2_weight, p_fc2_bias);  gelu = p_fc2_weight = p_fc2_bias = None
        return (linear_1,)""")

    def test_conv_bn_train(self):
        ep = export_and_check(ConvBN().train(), (torch.randn(2, 3, 6, 6),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_conv_weight: "f32[4, 3, 3, 3]", p_conv_bias: "f32[4]", p_bn_weight: "f32[4]", p_bn_bias: "f32[4]", b_bn_running_mean: "f32[4]", b_bn_running_var: "f32[4]", b_bn_num_batches_tracked: "i64[]", x: "f32[2, 3, 6, 6]"):
        conv2d: "f32[2, 4, 4, 4]" = torch.ops.aten.conv2d.default(x, p_conv_weight, p_conv_bias);  x = p_conv_weight = p_conv_bias = None
        add: "i64[]" = torch.ops.aten.add.Tensor(b_bn_num_batches_tracked, 1);  b_bn_num_batches_tracked = None
        _native_batch_norm_legit_functional = torch.ops.aten._native_batch_norm_legit_functional.default(conv2d, p_bn_weight, p_bn_bias, b_bn_running_mean, b_bn_running_var, True, 0.1, 1e-05);  conv2d = p_bn_weight = p_bn_bias = b_bn_running_mean = b_bn_running_var = None
        getitem: "f32[2, 4, 4, 4]" = _native_batch_norm_legit_functional[0]
        getitem_3: "f32[4]" = _native_batch_norm_legit_functional[3]
        getitem_4: "f32[4]" = _native_batch_norm_legit_functional[4];  _native_batch_norm_legit_functional = None
        relu: "f32[2, 4, 4, 4]" = torch.ops.aten.relu.default(getitem);  getitem = None
        return (getitem_3, getitem_4, add, relu)""")
        kinds = [s.kind for s in ep.signature.mutations]
        self.assertEqual(kinds, [OutputKind.BUFFER_MUTATION] * 3)

    def test_conv_bn_eval(self):
        ep = export_and_check(ConvBN().eval(), (torch.randn(2, 3, 6, 6),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_conv_weight: "f32[4, 3, 3, 3]", p_conv_bias: "f32[4]", p_bn_weight: "f32[4]", p_bn_bias: "f32[4]", b_bn_running_mean: "f32[4]", b_bn_running_var: "f32[4]", b_bn_num_batches_tracked: "i64[]", x: "f32[2, 3, 6, 6]"):
        conv2d: "f32[2, 4, 4, 4]" = torch.ops.aten.conv2d.default(x, p_conv_weight, p_conv_bias);  x = p_conv_weight = p_conv_bias = None
        _native_batch_norm_legit_no_training = torch.ops.aten._native_batch_norm_legit_no_training.default(conv2d, p_bn_weight, p_bn_bias, b_bn_running_mean, b_bn_running_var, 0.1, 1e-05);  conv2d = p_bn_weight = p_bn_bias = b_bn_running_mean = b_bn_running_var = None
        getitem: "f32[2, 4, 4, 4]" = _native_batch_norm_legit_no_training[0];  _native_batch_norm_legit_no_training = None
        relu: "f32[2, 4, 4, 4]" = torch.ops.aten.relu.default(getitem);  getitem = None
        return (relu,)""")
        self.assertEqual(ep.signature.mutations, ())

    def test_buffer_mutation(self):
        ep = export_and_check(Counter(), (torch.randn(2, 3),))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, b_count: "f32[]", b_total: "f32[3]", x: "f32[2, 3]"):
            add: "f32[]" = torch.ops.aten.add.Tensor(b_count, 1);  b_count = None
            sum_1: "f32[3]" = torch.ops.aten.sum.dim_IntList(x, [0])
            add_1: "f32[3]" = torch.ops.aten.add.Tensor(b_total, sum_1);  b_total = sum_1 = None
            mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(x, add);  x = None
            return (add, add_1, mul)

Graph signature:
    Inputs:
        b_count: BUFFER target='count'
        b_total: BUFFER target='total'
        x: USER_INPUT target='x'
    Outputs:
        add: BUFFER_MUTATION target='count'
        add_1: BUFFER_MUTATION target='total'
        mul: USER_OUTPUT target='output'""")

    def test_user_input_mutation(self):
        ep = export_and_check(ScaleInPlace(), (torch.randn(3), torch.randn(3)))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]", y: "f32[3]"):
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
        add: "f32[3]" = torch.ops.aten.add.Tensor(mul, y);  y = None
        return (mul, add)""")
        (mutation,) = ep.signature.mutations
        self.assertEqual((mutation.kind, mutation.target), (OutputKind.USER_INPUT_MUTATION, "x"))

    def test_inplace_on_views(self):
        ep = export_and_check(ViewInPlace(), (torch.randn(3, 4),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3, 4]"):
        select: "f32[4]" = torch.ops.aten.select.int(x, 0, 0)
        add: "f32[4]" = torch.ops.aten.add.Tensor(select, 1);  select = None
        select_scatter: "f32[3, 4]" = torch.ops.aten.select_scatter.default(x, add, 0, 0);  x = add = None
        view_1: "f32[12]" = torch.ops.aten.view.default(select_scatter, [-1])
        slice_2: "f32[2]" = torch.ops.aten.slice.Tensor(view_1, 0, 2, 4);  view_1 = None
        zero: "f32[2]" = torch.ops.aten.zero.default(slice_2);  slice_2 = None
        view_2: "f32[12]" = torch.ops.aten.view.default(select_scatter, [-1]);  select_scatter = None
        slice_scatter: "f32[12]" = torch.ops.aten.slice_scatter.default(view_2, zero, 0, 2, 4);  view_2 = zero = None
        view_3: "f32[3, 4]" = torch.ops.aten.view.default(slice_scatter, [3, 4]);  slice_scatter = None
        sum_1: "f32[]" = torch.ops.aten.sum.default(view_3)
        return (view_3, sum_1)""")

    def test_reshape_and_to(self):
        ep = export_and_check(ReshapeTo(), (torch.randn(4, 3),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[4, 3]"):
        view: "f32[2, 6]" = torch.ops.aten.view.default(x, [2, -1])
        _assert_tensor_metadata = torch.ops.aten._assert_tensor_metadata.default(view, None, None, torch.float32, device = device(type='cpu'), layout = torch.strided);  _assert_tensor_metadata = None
        _to_copy: "f64[2, 6]" = torch.ops.aten._to_copy.default(view, dtype = torch.float64);  view = None
        _assert_tensor_metadata_1 = torch.ops.aten._assert_tensor_metadata.default(x, None, None, torch.float32, device = device(type='cpu'), layout = torch.strided);  _assert_tensor_metadata_1 = None
        return (_to_copy, x)""")

    def test_dropout_eval(self):
        ep = export_and_check(DropoutEval().eval(), (torch.randn(2, 4),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[4, 4]", p_lin_bias: "f32[4]", x: "f32[2, 4]"):
        linear: "f32[2, 4]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
        return (linear,)""")

    def test_dict_outputs(self):
        ep = export_and_check(DictOut(), (torch.randn(2, 3),))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, x: "f32[2, 3]"):
            mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(x, 2)
            mean: "f32[]" = torch.ops.aten.mean.default(x)
            amax: "f32[]" = torch.ops.aten.amax.default(x);  x = None
            return (mul, mean, amax)

Graph signature:
    Inputs:
        x: USER_INPUT target='x'
    Outputs:
        mul: USER_OUTPUT target="output['double']"
        mean: USER_OUTPUT target="output['stats'][0]"
        amax: USER_OUTPUT target="output['stats'][1]\"""")

    def test_kwargs_inputs(self):
        x, mask = torch.randn(2, 4), torch.rand(2, 4) > 0.5
        ep = export_and_check(Masked(), (x,), {"mask": mask, "scale": 0.5})
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, p_lin_weight: "f32[4, 4]", p_lin_bias: "f32[4]", x: "f32[2, 4]", mask: "b8[2, 4]"):
            linear: "f32[2, 4]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
            mul: "f32[2, 4]" = torch.ops.aten.mul.Tensor(linear, 0.5);  linear = None
            masked_fill: "f32[2, 4]" = torch.ops.aten.masked_fill.Scalar(mul, mask, 0.0);  mul = mask = None
            return (masked_fill,)

Graph signature:
    Inputs:
        p_lin_weight: PARAMETER target='lin.weight'
        p_lin_bias: PARAMETER target='lin.bias'
        x: USER_INPUT target='x'
        mask: USER_INPUT target='mask'
    Outputs:
        masked_fill: USER_OUTPUT target='output'
    Constant inputs:
        scale = 0.5""")

    def test_tied_weights(self):
        model = Tied()
        ep = export_and_check(model, (torch.tensor([[1, 2, 3]]),))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, p_emb_weight: "f32[10, 4]", ids: "i64[1, 3]"):
            embedding: "f32[1, 3, 4]" = torch.ops.aten.embedding.default(p_emb_weight, ids);  ids = None
            linear: "f32[1, 3, 10]" = torch.ops.aten.linear.default(embedding, p_emb_weight);  embedding = p_emb_weight = None
            return (linear,)

Graph signature:
    Inputs:
        p_emb_weight: PARAMETER target='emb.weight' (tied: head.weight)
        ids: USER_INPUT target='ids'
    Outputs:
        linear: USER_OUTPUT target='output'""")
        program = ep.module()
        self.assertEqual(list(program.state_dict()), list(model.state_dict()))
        self.assertIs(program.emb.weight, program.head.weight)

    def test_dataclass_input_and_constant_attribute(self):
        batch = Batch(torch.randn(4), torch.randn(4))
        ep = export_and_check(WithConstant(), (batch,))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, c_offset: "f32[4]", batch_tokens: "f32[4]", batch_weights: "f32[4]"):
            mul: "f32[4]" = torch.ops.aten.mul.Tensor(batch_tokens, batch_weights);  batch_tokens = batch_weights = None
            mul_1: "f32[4]" = torch.ops.aten.mul.Tensor(mul, 2.0);  mul = None
            add: "f32[4]" = torch.ops.aten.add.Tensor(mul_1, c_offset);  mul_1 = c_offset = None
            return (add,)

Graph signature:
    Inputs:
        c_offset: CONSTANT_TENSOR target='offset'
        batch_tokens: USER_INPUT target='batch.tokens'
        batch_weights: USER_INPUT target='batch.weights'
    Outputs:
        add: USER_OUTPUT target='output'
    Constant inputs:
        batch.scale = 2.0""")
        self.assertEqual([s.kind for s in ep.signature.inputs], [InputKind.CONSTANT_TENSOR, InputKind.USER_INPUT, InputKind.USER_INPUT])


class ProgramBehaviour(TestCase):
    def test_gradients_match_eager(self):
        model, x = MLP(), torch.randn(3, 4, requires_grad=True)
        program = predispatch.export(model, (x,)).module()
        x2 = x.detach().clone().requires_grad_()
        model(x).sum().backward()
        program(x2).sum().backward()
        exact(x2.grad, x.grad)
        for (name, p), q in zip(model.named_parameters(), program.parameters()):
            exact(q.grad, p.grad)

    def test_program_writes_into_the_exported_models_buffers_as_eager_would(self):
        """`module()` holds the model's own buffers (Note [module() shares the program's state]):
        export alone changes nothing, a run counts in the model as the model's own run would."""
        model, x = Counter(), torch.ones(2, 3)
        program = predispatch.export(model, (torch.randn(2, 3),)).module()
        self.assertEqual(model.count.item(), 0.0)
        eager = copy.deepcopy(model)
        exact(program(x), eager(x))
        self.assertIs(program.count, model.count)
        exact(model.count, eager.count)
        exact(model.total, eager.total)

    def test_load_state_dict_round_trip(self):
        model = ConvBN().eval()
        program = predispatch.export(model, (torch.randn(1, 3, 6, 6),)).module()
        other = ConvBN().eval()
        program.load_state_dict(other.state_dict())
        x = torch.randn(1, 3, 6, 6)
        exact(program(x), other(x))

    def test_is_exporting_during_trace(self):
        seen = []

        class Probe(nn.Module):
            def forward(self, x):
                seen.append((torch.compiler.is_exporting(), torch.compiler.is_compiling()))
                return x + 1

        predispatch.export(Probe(), (torch.randn(2),))
        self.assertTrue(seen and set(seen) == {(True, True)}, seen)
        self.assertFalse(torch.compiler.is_exporting())

    def test_nonrecursive_disable_runs_as_the_plain_call(self):
        # Note [Non-recursive disable]: torch's wrapper refuses whenever is_exporting() is True;
        # the helper it wraps still sees True, and the program is aot_export_module's.
        seen = []

        @torch._dynamo.disable(recursive=False)
        def helper(x):
            seen.append(torch.compiler.is_exporting())
            return x.sin() * 2

        class Disabled(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)

            def forward(self, x):
                return helper(self.lin(x))

        model, x = Disabled(), torch.randn(2, 3)
        ep = check_gradients(model, (x,))
        self.assertEqual(seen[0], True)  # the trace's call (eager's, after it, sees False)
        self.assertExpectedInline(
            graph(ep),
            """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", x: "f32[2, 3]"):
        linear: "f32[2, 3]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
        sin: "f32[2, 3]" = torch.ops.aten.sin.default(linear);  linear = None
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(sin, 2);  sin = None
        return (mul,)""",
        )
        class Tupled(nn.Module):  # aot_export_module takes tuple outputs only
            def __init__(self):
                super().__init__()
                self.inner = model

            def forward(self, x):
                return (self.inner(x),)

        oracle, _ = ti.aot_export_module(Tupled(), (x,), trace_joint=False, pre_dispatch=True)
        def ops(g):
            return [str(n.target) for n in g.nodes if n.op == "call_function"]

        self.assertEqual(ops(ep.graph), ops(oracle.graph))
        self.assertFalse(torch.compiler.is_exporting())

    def test_trace_runs_on_fake_tensors(self):
        kinds = []

        class Probe(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(2, 2)

            def forward(self, x):
                kinds.append((type(x).__name__, type(self.lin.weight).__name__))
                return self.lin(x)

        predispatch.export(Probe(), (torch.randn(2),))
        # Functional wrappers around fake tensors: never the real input or the real weight.
        self.assertEqual(set(kinds), {("FunctionalTensor", "FunctionalTensor")})

    def test_plain_function(self):
        def fn(x, y):
            return torch.sin(x) + y.relu()

        args = (torch.randn(3), torch.randn(3))
        ep = predispatch.export(fn, args)
        exact(ep.module()(*args), fn(*args))
        self.assertEqual([s.name for s in ep.signature.inputs], ["x", "y"])

    def test_placeholder_names_are_deterministic(self):
        first = str(predispatch.export(ConvBN(), (torch.randn(1, 3, 6, 6),)))
        second = str(predispatch.export(ConvBN(), (torch.randn(1, 3, 6, 6),)))
        self.assertEqual(first, second)


class MetaModel(TestCase):
    def test_meta_model_traces_on_the_inputs_device(self):
        """Weights on the meta device cost no memory, and the program is the real model's."""

        class WithFactory(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                return self.lin(x) + torch.arange(4, device=self.lin.weight.device)

        with torch.device("meta"):
            meta = WithFactory()
        real = WithFactory()
        ep = predispatch.export(meta, (torch.randn(2, 4),))
        self.assertNotIn("meta", ep.graph_module.code)
        self.assertEqual(str(ep), str(predispatch.export(real, (torch.randn(2, 4),))))
        program = ep.module()
        program.load_state_dict(real.state_dict(), assign=True)
        x = torch.randn(2, 4)
        exact(program(x), real(x))


    def test_meta_model_with_meta_inputs_traces_on_meta(self):
        """All on meta (shapes only, as for a 70B model): the state stays on meta with the
        inputs; it used to move to CPU and meet the meta inputs in one op (a device mismatch)."""

        class Attention(nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = nn.Linear(8, 24)

            def forward(self, x, mask):
                q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4).unbind(0)
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum()

        with torch.device("meta"):
            meta = Attention()
        real = Attention()
        meta_args = (torch.empty(1, 6, 8, device="meta"), torch.ones(6, 6, dtype=torch.bool, device="meta").tril())
        real_args = (torch.randn(1, 6, 8), torch.ones(6, 6, dtype=torch.bool).tril())
        ep = predispatch.export(meta, meta_args)
        expected = predispatch.export(real, real_args)
        self.assertEqual(str(ep).replace("meta", "cpu"), str(expected))
        joint = ep.joint().graph_module.code  # SDPA's backward picks its kernel by device: not the CPU joint
        self.assertIn("device(type='meta')", joint)
        self.assertNotIn("cpu", joint)
        self.assertEqual(ep.module()(*meta_args).device.type, "meta")
        for name, p in meta.named_parameters():
            self.assertTrue(p.is_meta and p.grad is None, name)


class RepeatedInput(TestCase):
    """One tensor passed at two places (`model(ids, labels=ids)`): two independent inputs."""

    def test_each_place_is_its_own_input(self):
        class Shift(nn.Module):
            def forward(self, ids, labels=None):
                return ids * 2 - labels

        x = torch.randn(3)
        ep = predispatch.export(Shift(), (x,), {"labels": x})
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, ids: "f32[3]", labels: "f32[3]"):
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(ids, 2);  ids = None
        sub: "f32[3]" = torch.ops.aten.sub.Tensor(mul, labels);  mul = labels = None
        return (sub,)""")
        a, b = torch.randn(3), torch.randn(3)
        torch.testing.assert_close(ep.module()(a, labels=b), a * 2 - b, rtol=0, atol=0)

    def test_mutating_it_is_refused(self):
        class AddInPlace(nn.Module):
            def forward(self, x, y):
                x.add_(1)
                return x + y

        x = torch.randn(3)
        before = x.clone()
        with self.assertRaises(predispatch.errors.TraceError) as info:
            predispatch.export(AddInPlace(), (x, x))
        self.assertIn("the same tensor is passed as input 'x' and input 'y'", str(info.exception))
        self.assertTrue(torch.equal(x, before))


def test_nn_module_stack_names_the_users_modules():
    """Each node records the user's module path and class that called it, as torch.export does."""
    ep = predispatch.export(MLP(), (torch.randn(2, 4),))
    stacks = {n.name: n.meta.get("nn_module_stack") for n in ep.graph.nodes if n.op == "call_function"}
    first_linear = next(name for name in stacks if name.startswith("linear"))
    paths = [(path, cls) for path, cls in stacks[first_linear].values()]
    assert paths[0] == ("", f"{MLP.__module__}.MLP")
    assert paths[-1] == ("fc1", "torch.nn.modules.linear.Linear")


# --- any pytree output (issue 12, item 4) ------------------------------------------------------


@dataclasses.dataclass
class _Prediction:  # never registered by the user: export registers it, as for inputs
    logits: torch.Tensor
    extras: dict
    step: int = 0


class _Pair(NamedTuple):
    first: torch.Tensor
    rest: list


class StructuredOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        y = self.lin(x)
        return _Prediction(y, {"pair": _Pair(y + 1, [y * 2, ("k", None)])}, step=3)


def test_dataclass_namedtuple_and_nested_outputs_keep_eager_types():
    model, x = StructuredOutputs(), torch.randn(2, 3)
    ep = export_and_check(model, (x,))
    out = ep.module()(x)
    assert type(out) is _Prediction and type(out.extras["pair"]) is _Pair
    assert out.step == 3 and out.extras["pair"].rest[1] == ("k", None)
    torch.testing.assert_close(out.extras["pair"].rest[0], model(x).extras["pair"].rest[0], rtol=0, atol=0)


@pytest.mark.models  # needs transformers: the models extra
def test_model_output_of_transformers_keeps_its_type():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")

    class Encoder(nn.Module):
        def forward(self, x):
            return modeling_outputs.BaseModelOutput(last_hidden_state=x * 2, hidden_states=(x, x + 1))

    x = torch.randn(2, 3)
    out = predispatch.export(Encoder(), (x,)).module()(x)
    assert type(out) is modeling_outputs.BaseModelOutput
    torch.testing.assert_close(out.last_hidden_state, x * 2, rtol=0, atol=0)
    torch.testing.assert_close(out.hidden_states[1], x + 1, rtol=0, atol=0)


# --- fakifying state: the short way gives what torch's converter gives --------------------------


def _plain_cases() -> dict[str, torch.Tensor]:
    buffer = torch.arange(6.0).reshape(2, 3)
    buffer._is_buffer, buffer.persistent = True, False  # as nn.Buffer marks one
    return {
        "parameter": nn.Parameter(torch.randn(4, 3)),
        "frozen parameter": nn.Parameter(torch.randn(3), requires_grad=False),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "transposed, whole storage": torch.randn(3, 4).t(),  # a view: the general path
        "expanded (stride 0)": torch.randn(3, 1).expand(3, 4).contiguous(),
        "empty": torch.empty(0, 3),
        "bool": torch.tensor([True, False]),
        "complex": torch.randn(2, dtype=torch.cfloat),
        "int64 scalar": torch.tensor(7),
        "requires_grad buffer": torch.randn(2, requires_grad=True),
        "marked buffer": buffer,
        **({"cuda parameter": nn.Parameter(torch.randn(4, 3, device="cuda"))} if torch.cuda.is_available() else {}),
    }


@pytest.mark.parametrize("name", list(_plain_cases()))
def test_fake_of_plain_matches_from_tensor(name):  # on a CUDA machine, a CUDA parameter too
    """Every property torch's `from_tensor` gives a fake, `ti.fake_of_plain` gives it too, and a
    later `from_tensor` of the same tensor returns its fake (the converter's memo)."""
    from predispatch import _torch_internals as ti

    t = _plain_cases()[name]
    expected = ti.new_fake_mode().from_tensor(t, static_shapes=True)
    mode = ti.new_fake_mode()
    fake = ti.fake_of_plain(mode, t)
    if t._is_view():
        assert fake is None  # views keep their base through the general path
        return
    assert fake is not None
    for attr in ("shape", "dtype", "device", "layout", "requires_grad", "is_leaf"):
        assert getattr(fake, attr) == getattr(expected, attr), attr
    assert fake.stride() == expected.stride() and fake.storage_offset() == expected.storage_offset()
    assert fake.untyped_storage().nbytes() == expected.untyped_storage().nbytes()
    assert type(fake) is type(expected) and isinstance(fake, nn.Parameter) == isinstance(expected, nn.Parameter)
    assert getattr(fake, "_is_buffer", False) == getattr(t, "_is_buffer", False)
    assert torch._C._dispatch_keys(fake) == torch._C._dispatch_keys(expected)
    assert mode.from_tensor(t, static_shapes=True) is fake


def test_fake_of_plain_refuses_what_the_general_path_must_make():
    """Views, storage offsets, a storage larger than the tensor, subclasses and meta tensors take
    `from_tensor` (None here), which keeps what they share."""
    from predispatch import _torch_internals as ti

    base = torch.randn(4, 4)
    refused = {
        "view": base[1],
        "offset, not a view": torch.empty(0).set_(base.untyped_storage(), 4, (3,), (1,)),
        "larger storage": torch.empty(0).set_(base.untyped_storage(), 0, (3,), (1,)),
        "meta": torch.empty(3, device="meta"),
        "conj": torch.randn(2, dtype=torch.cfloat).conj(),
        "non-leaf": torch.randn(2, requires_grad=True) * 2,
    }
    for name, t in refused.items():
        assert ti.fake_of_plain(ti.new_fake_mode(), t) is None, name


def test_state_sharing_storage_keeps_sharing_in_the_trace():
    """Two buffers over one storage (not views of each other) are fakified together by torch's
    converter: a write through one reaches the other in the program as in eager."""

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            storage = torch.zeros(4)
            self.register_buffer("a", torch.empty(0).set_(storage.untyped_storage(), 0, (4,), (1,)))
            self.register_buffer("b", torch.empty(0).set_(storage.untyped_storage(), 0, (4,), (1,)))

        def forward(self, x):
            self.a.add_(x)
            return self.b * 1

    from predispatch.frontend.inputs import _alone_in_storage

    model = Shared()
    alone = _alone_in_storage([model.a, model.b, torch.randn(4)])
    assert id(model.a) not in alone and id(model.b) not in alone and len(alone) == 1  # the input alone
    eager, x = copy.deepcopy(model), torch.ones(4)
    program = predispatch.export(model, (x,)).module()
    torch.testing.assert_close(program(x), eager(x), rtol=0, atol=0)
    torch.testing.assert_close(program(x), eager(x), rtol=0, atol=0)


def test_fake_of_plain_stops_when_torch_makes_another_fake(monkeypatch):
    """The once-per-process comparison with torch's converter: a fake that differs in anything
    it compares stops the export with TorchDriftError, before any trace."""
    from predispatch import _torch_internals as ti
    from predispatch._torch_internals import tracing

    monkeypatch.setattr(tracing, "_PLAIN_FAKES_CHECKED", False)
    real = tracing._plain_fake

    def no_requires_grad(fake_mode, t):
        return real(fake_mode, t.detach())  # a fake that lost the parameter's requires_grad

    monkeypatch.setattr(tracing, "_plain_fake", no_requires_grad)
    with pytest.raises(predispatch.errors.TorchDriftError, match="ti.fake_of_plain.*from_tensor.s"):
        ti.fake_of_plain(ti.new_fake_mode(), nn.Parameter(torch.randn(2)))
    monkeypatch.setattr(tracing, "_plain_fake", real)
    assert ti.fake_of_plain(ti.new_fake_mode(), nn.Parameter(torch.randn(2))) is not None
    assert tracing._PLAIN_FAKES_CHECKED
