"""Module hooks: forward hooks traced, pure backward hooks captured and the others refused by
name, state_dict hooks honoured, and hook changes after export detected."""

from __future__ import annotations


import copy
import dataclasses
import warnings
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F
from expecttest import TestCase
from helpers import assert_same_tree, check_gradients, export_and_check, graph, stable_message as message
from torch import nn

import predispatch
from predispatch import errors


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.out = nn.Linear(3, 2)

    def forward(self, x, scale=1.0):
        return self.out(torch.relu(self.lin(x))) * scale


def double_input(module, args):
    return (args[0] * 2,)


def add_one(module, args, output):
    return output + 1


def kwargs_pre_hook(module, args, kwargs):
    return args, {**kwargs, "scale": kwargs.get("scale", 1.0) * 3}


def kwargs_hook(module, args, kwargs, output):
    return output - kwargs["scale"]


class ForwardHooks(TestCase):
    maxDiff = None

    def test_pre_hook_and_hook(self):
        net = Net()
        net.lin.register_forward_pre_hook(double_input)
        net.lin.register_forward_hook(add_one)
        ep = export_and_check(net, (torch.randn(4, 3),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", p_out_weight: "f32[2, 3]", p_out_bias: "f32[2]", x: "f32[4, 3]"):
        mul: "f32[4, 3]" = torch.ops.aten.mul.Tensor(x, 2);  x = None
        linear: "f32[4, 3]" = torch.ops.aten.linear.default(mul, p_lin_weight, p_lin_bias);  mul = p_lin_weight = p_lin_bias = None
        add: "f32[4, 3]" = torch.ops.aten.add.Tensor(linear, 1);  linear = None
        relu: "f32[4, 3]" = torch.ops.aten.relu.default(add);  add = None
        linear_1: "f32[4, 2]" = torch.ops.aten.linear.default(relu, p_out_weight, p_out_bias);  relu = p_out_weight = p_out_bias = None
        mul_1: "f32[4, 2]" = torch.ops.aten.mul.Tensor(linear_1, 1.0);  linear_1 = None
        return (mul_1,)""")

    def test_with_kwargs_prepend_and_always_call(self):
        net = Net()
        order = []
        net.register_forward_pre_hook(kwargs_pre_hook, with_kwargs=True)
        net.register_forward_hook(kwargs_hook, with_kwargs=True, always_call=True)
        net.lin.register_forward_hook(lambda m, a, o: order.append("second") or o * 2)
        net.lin.register_forward_hook(lambda m, a, o: order.append("first") or o + 5, prepend=True)
        export_and_check(net, (torch.randn(4, 3),), {"scale": 0.5})
        self.assertEqual(order[:2], ["first", "second"])

    def test_global_hooks(self):
        pre = nn.modules.module.register_module_forward_pre_hook(lambda m, a: None)
        post = nn.modules.module.register_module_forward_hook(
            lambda m, a, o: o * 0.5 if isinstance(m, nn.Linear) else o
        )
        try:
            export_and_check(Net(), (torch.randn(4, 3),))
        finally:
            pre.remove()
            post.remove()

    def test_region_in_hook(self):
        net = Net()

        def count(module, args):
            with torch.no_grad():
                module.calls = getattr(module, "calls", 0) + 1
            return (args[0].detach() + args[0],)

        net.out.register_forward_pre_hook(count)
        export_and_check(net, (torch.randn(4, 3),))


def print_grads(module, grad_input, grad_output):
    print(grad_output)


class BackwardHooks(TestCase):
    maxDiff = None

    def test_full_backward_hook_on_grad_input_is_captured(self):
        net = Net()
        net.out.register_full_backward_hook(lambda module, grad_input, grad_output: (grad_input[0].clamp(-0.01, 0.01),))
        ep = check_gradients(net, (torch.randn(4, 3),))
        self.assertIn("full_backward_hooks_bwd_0", ep.graph_module.code)
        self.assertEqual(len(net.out._backward_hooks), 1)  # restored after export

    def test_full_backward_hook_is_refused(self):
        net = Net()
        net.out.register_full_backward_hook(print_grads)
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(4, 3),))
        self.assertExpectedInline(message(info.value), """\
module 'out' (Linear) has a backward hook, print_grads defined at test_hooks.py:N, which a traced program would silently drop: it has a Python side effect (calls print).
  at test_hooks.py:N (return self.out(torch.relu(self.lin(x))) * scale)
  fix: remove it before export (handle.remove()), make it a pure function of the gradients, or move its effect into an autograd.Function.
  see docs/errors.md#unsupportedhookerror""")

    def test_backward_pre_hook_is_captured(self):
        net = Net()
        net.lin.register_full_backward_pre_hook(lambda m, g: (g[0] * 2,))
        net.lin.register_forward_hook(add_one)  # the pre-hook sees gradients of the hooked output
        ep = check_gradients(net, (torch.randn(4, 3),))
        self.assertIn("backward_pre_hooks_bwd_0", ep.graph_module.code)
        self.assertEqual(len(net.lin._backward_pre_hooks), 1)  # restored after export
        self.assertEqual(len(net.lin._forward_hooks), 1)

    def test_backward_pre_hook_with_side_effect_is_refused(self):
        net = Net()
        net.lin.register_full_backward_pre_hook(lambda m, g: print(g))
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(4, 3),))
        self.assertIn("module 'lin' (Linear) has a backward hook", message(info.value))

    def test_global_backward_hook_is_refused(self):
        handle = nn.modules.module.register_module_full_backward_hook(print_grads)
        try:
            with pytest.raises(errors.UnsupportedHookError) as info:
                predispatch.export(Net(), (torch.randn(4, 3),))
        finally:
            handle.remove()
        self.assertIn("a global module backward hook is registered (print_grads defined at", message(info.value))

    def test_tensor_register_hook_is_captured(self):
        class Hooked(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)

            def forward(self, x):
                h = self.lin(x)
                h.register_hook(lambda g: g.clamp(-0.1, 0.1) * 10)  # a clipping hook
                return (h * h).sum()

        ep = check_gradients(Hooked(), (torch.randn(4, 3),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[3, 3]", p_lin_bias: "f32[3]", x: "f32[4, 3]"):
        linear: "f32[4, 3]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
        tensor_hook_fwd_0 = self.tensor_hook_fwd_0
        tensor_hook_bwd_0 = self.tensor_hook_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(tensor_hook_fwd_0, tensor_hook_bwd_0, linear, non_differentiable_idx = [], saved_for_backward_idx = []);  tensor_hook_fwd_0 = tensor_hook_bwd_0 = linear = None
        clone: "f32[4, 3]" = autograd_function_apply[0];  autograd_function_apply = None
        mul: "f32[4, 3]" = torch.ops.aten.mul.Tensor(clone, clone);  clone = None
        sum_1: "f32[]" = torch.ops.aten.sum.default(mul);  mul = None
        return (sum_1,)

    class tensor_hook_fwd_0(torch.nn.Module):
        def forward(self, x: "f32[4, 3]"):
            clone: "f32[4, 3]" = torch.ops.aten.clone.default(x);  x = None
            return ((clone,), ())

    class tensor_hook_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[4, 3]"):
            clamp: "f32[4, 3]" = torch.ops.aten.clamp.default(grad_out, -0.1, 0.1);  grad_out = None
            mul: "f32[4, 3]" = torch.ops.aten.mul.Tensor(clamp, 10);  clamp = None
            return (mul,)""")

    def test_tensor_hooks_that_cannot_be_captured_are_refused(self):
        seen = []

        class UsedBefore(nn.Module):
            def forward(self, x):
                h = x * 2
                y = h.sum()
                h.register_hook(lambda g: g * 10)
                return y + (h * 3).sum()

        class OnInput(nn.Module):
            def forward(self, x):
                x.register_hook(lambda g: g * 10)
                return x * 2

        class Stores(nn.Module):
            def forward(self, x):
                h = x * 2
                h.register_hook(lambda g: seen.append(g))
                return h * 3

        class Prints(nn.Module):
            def forward(self, x):
                h = x * 2
                h.register_hook(lambda g: print(g))
                return h * 3

        expected = {
            UsedBefore: "an op already read the tensor",
            OnInput: "the tensor is a graph input or parameter",
            Stores: "the hook has a Python side effect (calls append)",
            Prints: "the hook has a Python side effect (calls print)",
        }
        for module_cls, why in expected.items():
            with self.subTest(module_cls.__name__), pytest.raises(errors.UnsupportedHookError) as info:
                predispatch.export(module_cls(), (torch.randn(3),))
            self.assertIn(why, message(info.value))
            self.assertIn("test_hooks.py:N (h.register_hook" if module_cls is not OnInput else "(x.register_hook", message(info.value))

    def test_refusal_leaves_hooks_in_place(self):
        net = Net()
        handle = net.out.register_full_backward_hook(print_grads)
        with pytest.raises(errors.UnsupportedHookError):
            predispatch.export(net, (torch.randn(4, 3),))
        self.assertEqual(list(net.out._backward_hooks.values()), [print_grads])
        self.assertEqual(torch.Tensor.register_hook.__qualname__, "Tensor.register_hook")
        handle.remove()


class Deconv(nn.Module):
    """Linear, ReLU, Linear: the ReLU is where deconvnet-style hooks go."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.act = nn.ReLU()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.act(self.lin(x)))


class Pair(nn.Module):
    def forward(self, x):
        return x * 2, x.sin()


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.pair = Pair()

    def forward(self, x):
        a, b = self.pair(self.lin(x))
        return a * b + a


class Scaled(nn.Module):
    def forward(self, x, scale):
        return x * scale


class CallsScaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scaled = Scaled()

    def forward(self, x):
        return self.scaled(self.lin(x), 2.0)


def deconvnet(module, grad_input, grad_output):
    return (F.relu(grad_output[0]),)


class GradOutputHooks(TestCase):
    """Full backward hooks that read grad_output: captured (Note [Carrying grad_output]),
    gradients through `ep.module()` equal eager's bitwise."""

    maxDiff = None

    def test_deconvnet_hook_on_relu(self):
        net = Deconv()
        net.act.register_full_backward_hook(deconvnet)
        ep = check_gradients(net, (torch.randn(5, 3),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_lin_weight: "f32[4, 3]", p_lin_bias: "f32[4]", p_out_weight: "f32[2, 4]", p_out_bias: "f32[2]", x: "f32[5, 3]"):
        linear: "f32[5, 4]" = torch.ops.aten.linear.default(x, p_lin_weight, p_lin_bias);  x = p_lin_weight = p_lin_bias = None
        full_backward_hooks_fwd_0 = self.full_backward_hooks_fwd_0
        full_backward_hooks_bwd_0 = self.full_backward_hooks_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(full_backward_hooks_fwd_0, full_backward_hooks_bwd_0, linear, non_differentiable_idx = [], saved_for_backward_idx = []);  full_backward_hooks_fwd_0 = full_backward_hooks_bwd_0 = linear = None
        clone: "f32[5, 4]" = autograd_function_apply[0]
        zeros: "f32[5, 4]" = autograd_function_apply[1];  autograd_function_apply = None
        relu: "f32[5, 4]" = torch.ops.aten.relu.default(clone);  clone = None
        grad_output_carrier_fwd_0 = self.grad_output_carrier_fwd_0
        grad_output_carrier_bwd_0 = self.grad_output_carrier_bwd_0
        autograd_function_apply_1 = torch.ops.higher_order.autograd_function_apply(grad_output_carrier_fwd_0, grad_output_carrier_bwd_0, relu, zeros, non_differentiable_idx = [], saved_for_backward_idx = []);  grad_output_carrier_fwd_0 = grad_output_carrier_bwd_0 = relu = zeros = None
        clone_2: "f32[5, 4]" = autograd_function_apply_1[0];  autograd_function_apply_1 = None
        linear_1: "f32[5, 2]" = torch.ops.aten.linear.default(clone_2, p_out_weight, p_out_bias);  clone_2 = p_out_weight = p_out_bias = None
        return (linear_1,)

    class full_backward_hooks_fwd_0(torch.nn.Module):
        def forward(self, args_0: "f32[5, 4]"):
            clone: "f32[5, 4]" = torch.ops.aten.clone.default(args_0);  args_0 = None
            zeros: "f32[5, 4]" = torch.ops.aten.zeros.default([5, 4], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
            return ((clone, zeros), ())

    class full_backward_hooks_bwd_0(torch.nn.Module):
        def forward(self, grad_out_0: "f32[5, 4]", grad_out_1: "f32[5, 4]"):
            relu: "f32[5, 4]" = torch.ops.aten.relu.default(grad_out_1);  grad_out_1 = None
            return (relu,)

    class grad_output_carrier_fwd_0(torch.nn.Module):
        def forward(self, args_0: "f32[5, 4]", args_1: "f32[5, 4]"):
            clone: "f32[5, 4]" = torch.ops.aten.clone.default(args_0);  args_0 = None
            return ((clone,), ())

    class grad_output_carrier_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[5, 4]"):
            return (grad_out, grad_out)""")

        self.assertEqual(list(net.act._backward_hooks.values()), [deconvnet])  # restored after export
        self.assertEqual((len(net.act._forward_pre_hooks), len(net.act._forward_hooks)), (0, 0))

    def test_hook_replacing_grad_input_by_grad_output(self):
        net = Deconv()
        net.act.register_full_backward_hook(lambda module, grad_input, grad_output: (grad_output[0] * 2,))
        check_gradients(net, (torch.randn(5, 3),))

    def test_hook_mixing_grad_input_and_grad_output_on_linear(self):
        net = Deconv()
        net.out.register_full_backward_hook(lambda m, grad_input, grad_output: (grad_input[0] * grad_output[0].sum(),))
        net.lin.register_full_backward_hook(lambda m, gi, go: (gi[0] + go[0].mean(-1, keepdim=True),))
        check_gradients(net, (torch.randn(5, 3),))

    def test_module_with_two_outputs(self):
        net = TwoOutputs()
        net.pair.register_full_backward_hook(lambda m, gi, go: (gi[0] + go[0] * go[1],))
        ep = check_gradients(net, (torch.randn(4, 3),))
        self.assertIn("return (grad_out_0, grad_out_1, grad_out_0, grad_out_1)", graph(ep))  # one carrier each

    def test_forward_hook_changing_the_output_shape(self):
        net = Deconv()
        net.lin.register_forward_hook(lambda m, args, output: torch.cat([output, output]))
        net.lin.register_full_backward_hook(lambda m, gi, go: (gi[0] + go[0][:5, :3] - go[0][5:, 1:],))
        ep = check_gradients(net, (torch.randn(5, 3),))
        self.assertIn('zeros: "f32[10, 4]"', graph(ep))  # the carrier is shaped like the hooked output

    def test_backward_pre_hook_changes_grad_output_before_full_hooks_see_it(self):
        for pre_first in (True, False):
            net = Deconv()
            pre = lambda m, grad_output: (grad_output[0] + 1,)  # noqa: E731
            full = lambda m, gi, go: (gi[0] * 0.5 + go[0].sum(-1, keepdim=True)[:, :1],)  # noqa: E731
            if pre_first:
                net.lin.register_full_backward_pre_hook(pre)
            net.lin.register_full_backward_hook(full)
            if not pre_first:
                net.lin.register_full_backward_pre_hook(pre)
            with self.subTest(pre_first=pre_first):
                check_gradients(net, (torch.randn(5, 3),))

    def test_input_that_does_not_require_grad(self):
        class Detached(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(3, 3)
                self.out = nn.Linear(3, 2)

            def forward(self, x):
                return self.out(x.detach()) + self.lin(x)[:, :2]

        net = Detached()
        # eager calls the hook with grad_input (None,) and requires None back
        net.out.register_full_backward_hook(lambda m, gi, go: None if gi[0] is None else (gi[0] * go[0].sum(),))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            check_gradients(net, (torch.randn(4, 3),))

    def test_program_input_that_does_not_require_grad(self):
        net = Deconv()
        net.lin.register_full_backward_hook(lambda m, gi, go: None if gi[0] is None else (gi[0] * go[0].sum(),))
        x = torch.randn(5, 3)  # no grad: eager calls the hook with grad_input (None,), the program skips it
        ep = predispatch.export(net, (x,))
        eager, program = copy.deepcopy(net), ep.module()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Full backward hook is firing")
            eager(x).sum().backward()
        program(x).sum().backward()
        for e, p in zip(eager.parameters(), program.parameters()):
            assert_same_tree(p.grad, e.grad)

    def test_grad_input_has_one_entry_per_argument(self):
        hooks = {
            "grad_input only": lambda m, grad_input, grad_output: (grad_input[0] * 3, None),
            "grad_output too": lambda m, grad_input, grad_output: (grad_input[0] * grad_output[0], grad_input[1]),
        }
        for name, hook in hooks.items():
            net = CallsScaled()  # calls self.scaled(h, 2.0): grad_input is (grad of h, None)
            net.scaled.register_full_backward_hook(hook)
            with self.subTest(name):
                check_gradients(net, (torch.randn(4, 3),))

    def test_batchnorm_in_train_mode_updates_running_stats_once(self):
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
        net[1].register_full_backward_hook(lambda m, gi, go: (gi[0] + go[0] * 0.1,))
        export_and_check(net, (torch.randn(6, 3),))  # export leaves the stats alone; one run matches eager
        self.assertEqual(int(net[1].num_batches_tracked), 1)  # that run, on net's own buffers
        ep = check_gradients(net, (torch.randn(6, 3),))
        self.assertEqual(int(net[1].num_batches_tracked), 2)
        program = ep.module()
        program(torch.randn(6, 3))
        self.assertEqual(int(program.state_dict()["1.num_batches_tracked"]), 3)

    def test_dynamic_shapes(self):
        net = Deconv()
        net.lin.register_forward_hook(lambda m, args, output: torch.cat([output, output]))
        net.lin.register_full_backward_hook(lambda m, gi, go: (gi[0] + go[0].sum(),))
        batch = torch.export.Dim("batch", min=2, max=64)
        ep = predispatch.export(net, (torch.randn(5, 3),), dynamic_shapes={"x": {0: batch}})
        self.assertIn('zeros: "f32[2*s', graph(ep))
        for rows in (3, 9):
            x = torch.randn(rows, 3)
            eager_x, program_x = x.clone().requires_grad_(), x.clone().requires_grad_()
            net(eager_x).sum().backward()
            ep.module()(program_x).sum().backward()
            assert_same_tree(program_x.grad, eager_x.grad)

    def test_output_shape_from_values_is_refused(self):
        class Positive(nn.Module):
            def forward(self, x):
                return x[x > 0] * 2

        net = nn.Sequential(Positive())
        net[0].register_full_backward_hook(lambda m, gi, go: (gi[0] * go[0].mean(),))
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(4, 3),))
        self.assertIn(
            "module '0' (Positive) has a full backward hook that reads grad_output, and the shape of its output "
            "depends on tensor values (u0)",
            message(info.value),
        )

    def test_deprecated_backward_hook_is_refused(self):
        net = Net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net.out.register_backward_hook(lambda m, grad_input, grad_output: (grad_output[0] @ m.weight,))
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(4, 3),))
        self.assertIn("module 'out' (Linear) has a backward hook", message(info.value))
        self.assertIn("it was registered with the deprecated register_backward_hook.", message(info.value))

    def test_forward_is_traced_once(self):
        """Issue 23 (11): the module's forward runs once at export, traced, as every other
        module's (it ran once more on stand-ins before, to learn its output); a forward reading a
        value of the trace from outside its arguments, which the stand-ins could not give, exports."""
        outside = {}
        calls = []

        class ReadsOutside(nn.Module):
            def forward(self, x):
                calls.append(type(x).__name__)
                return x * outside["scale"]  # a tensor of the trace that is no argument and no state

        class Sets(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(3))
                self.inner = ReadsOutside()

            def forward(self, x):
                outside["scale"] = self.w * 2
                return self.inner(x)

        net = Sets()
        net.inner.register_full_backward_hook(lambda m, gi, go: (gi[0] * go[0].mean(),))
        ep = predispatch.export(net, (torch.randn(4, 3),))
        self.assertEqual(calls, ["FunctionalTensor"])
        check_gradients(net, (torch.randn(4, 3),))
        self.assertEqual(len(net.inner._backward_hooks), 1)  # restored after export
        self.assertIn("full_backward_hooks_bwd_0", ep.graph_module.code)

    def test_hook_with_side_effect_is_refused(self):
        seen = []

        def keep_grad_output(module, grad_input, grad_output):
            seen.append(grad_output[0])
            return (grad_input[0] * grad_output[0].sum(),)

        net = Net()
        net.out.register_full_backward_hook(keep_grad_output)
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(4, 3),))
        self.assertExpectedInline(message(info.value), """\
module 'out' (Linear) has a backward hook, GradOutputHooks.test_hook_with_side_effect_is_refused.<locals>.keep_grad_output defined at test_hooks.py:N, which a traced program would silently drop: it has a Python side effect (calls append).
  at test_hooks.py:N (return self.out(torch.relu(self.lin(x))) * scale)
  fix: remove it before export (handle.remove()), make it a pure function of the gradients, or move its effect into an autograd.Function.
  see docs/errors.md#unsupportedhookerror""")


def hook_ops(ep: predispatch.ExportedProgram) -> list[str]:
    """The operands of each captured Function in the program's top-level graph."""
    nodes = ep.graph_module.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply)
    return [", ".join(str(a) for a in n.args[2:]) for n in nodes]


class Tied(nn.Module):
    """Two Linears sharing one weight."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class SelfClipping(nn.Module):
    """Registers its own method as a backward pre-hook; the method reads the module through `self`."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_full_backward_pre_hook(self.clip)

    def clip(self, module, grad_output):
        return (grad_output[0].clamp(-1, 1) * self.lin.bias,)

    def forward(self, x):
        return self.lin(x)


OTHER = nn.Linear(3, 3)
GLOBAL_SCALE = torch.tensor([1.0, 2.0, 3.0])


class ModuleState(TestCase):
    """Hooks that read their module's parameters and buffers: Note [Hooks reading module state].
    Gradients through `ep.module()` equal eager's bitwise."""

    maxDiff = None

    def test_pre_hook_reading_the_bias(self):
        lin = nn.Linear(3, 2)
        lin.register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] * m.bias,))
        ep = check_gradients(lin, (torch.randn(4, 3),))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, p_weight: "f32[2, 3]", p_bias: "f32[2]", input_1: "f32[4, 3]"):
        linear: "f32[4, 2]" = torch.ops.aten.linear.default(input_1, p_weight, p_bias);  input_1 = None
        backward_pre_hooks_fwd_0 = self.backward_pre_hooks_fwd_0
        backward_pre_hooks_bwd_0 = self.backward_pre_hooks_bwd_0
        autograd_function_apply = torch.ops.higher_order.autograd_function_apply(backward_pre_hooks_fwd_0, backward_pre_hooks_bwd_0, linear, p_weight, p_bias, non_differentiable_idx = [], saved_for_backward_idx = [0, 1]);  backward_pre_hooks_fwd_0 = backward_pre_hooks_bwd_0 = linear = p_weight = p_bias = None
        clone: "f32[4, 2]" = autograd_function_apply[0];  autograd_function_apply = None
        return (clone,)

    class backward_pre_hooks_fwd_0(torch.nn.Module):
        def forward(self, args_0: "f32[4, 2]", module_weight: "f32[2, 3]", module_bias: "f32[2]"):
            clone: "f32[4, 2]" = torch.ops.aten.clone.default(args_0);  args_0 = None
            return ((clone,), (module_weight, module_bias))

    class backward_pre_hooks_bwd_0(torch.nn.Module):
        def forward(self, grad_out: "f32[4, 2]", saved_module_weight: "f32[2, 3]", saved_module_bias: "f32[2]"):
            mul: "f32[4, 2]" = torch.ops.aten.mul.Tensor(grad_out, saved_module_bias);  grad_out = saved_module_bias = None
            return (mul, None, None)""")

    def test_full_hook_reading_the_weight(self):
        net = Deconv()
        net.out.register_full_backward_hook(lambda m, grad_input, grad_output: (grad_output[0] @ m.weight,))
        ep = check_gradients(net, (torch.randn(5, 3),))
        self.assertEqual(hook_ops(ep), ["relu, p_out_weight, p_out_bias", "linear_1, zeros"])

    def test_hook_that_does_not_read_the_module_takes_no_state(self):
        net = Deconv()
        net.out.register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] * 2,))
        net.out.register_full_backward_hook(lambda m, grad_input, grad_output: (grad_input[0] * 3,))
        ep = check_gradients(net, (torch.randn(5, 3),))
        self.assertEqual(hook_ops(ep), ["relu", "linear_1"])

    def test_submodule_state_and_buffers(self):
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU()).eval()
        net.register_full_backward_hook(
            lambda m, grad_input, grad_output: (grad_input[0] + grad_output[0] @ m[0].weight / m[1].running_var.sum(),)
        )
        ep = check_gradients(nn.Sequential(net), (torch.randn(6, 3),))
        self.assertEqual(len(hook_ops(ep)[0].split(", ")), 1 + 2 + 2 + 3)  # x, 0.weight, 0.bias, 1.weight, ...

    def test_tied_weight_is_passed_once(self):
        net = Tied()
        net.register_full_backward_hook(
            lambda m, grad_input, grad_output: (grad_input[0] * m.a.weight.sum() + grad_output[0] @ m.b.weight,)
        )
        ep = check_gradients(nn.Sequential(net), (torch.randn(4, 3),))
        self.assertEqual(hook_ops(ep)[0], "input_1, p_0_a_weight, p_0_a_bias, p_0_b_bias")

    def test_closure_over_the_module_and_bound_method(self):
        net = Deconv()
        out = net.out
        net.out.register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] - out.bias,))
        check_gradients(net, (torch.randn(5, 3),))
        check_gradients(nn.Sequential(SelfClipping()), (torch.randn(5, 3),))

    def test_state_changed_later_in_the_forward_is_refused(self):
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
        net[1].register_full_backward_hook(lambda m, grad_input, grad_output: (grad_input[0] / m.running_var,))
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(6, 3),))
        self.assertExpectedInline(message(info.value), """\
module '1' (BatchNorm1d) has a full backward hook (ModuleState.test_state_changed_later_in_the_forward_is_refused.<locals>.<lambda> defined at test_hooks.py:N) that may read the module's tensors, and the forward pass changes 'running_mean' after the hook's Function took it (as BatchNorm does to its running statistics in training): the program's hook would see the value from before the change, eager's sees the value when backward runs.
  at test_hooks.py:N (predispatch.export(net, (torch.randn(6, 3),)))
  fix: export with the module in eval mode (BatchNorm's running statistics then stay as they are), or remove the hook before export (handle.remove()).
  see docs/errors.md#unsupportedhookerror""")
        check_gradients(net.eval(), (torch.randn(6, 3),))
        net = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
        net[1].register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0] / m.running_var,))
        check_gradients(net, (torch.randn(6, 3),))  # a pre-hook takes the statistics after their update

    def test_tensor_from_outside_the_module_is_refused(self):
        hooks = {
            "another module's weight": lambda m, grad_input, grad_output: (grad_output[0] @ OTHER.weight,),
            "a global tensor": lambda m, grad_input, grad_output: (grad_input[0] * GLOBAL_SCALE,),
        }
        for name, hook in hooks.items():
            net = Deconv()
            net.out.register_full_backward_hook(hook)
            with self.subTest(name), pytest.raises(errors.UnsupportedHookError) as info:
                predispatch.export(net, (torch.randn(5, 3),))
            self.assertIn("module 'out' (Linear) has a full backward hook (ModuleState.", message(info.value))
            self.assertIn("that reads a tensor which is neither one of its gradients nor", message(info.value))
        self.assertExpectedInline(message(info.value), """\
module 'out' (Linear) has a full backward hook (ModuleState.test_tensor_from_outside_the_module_is_refused.<locals>.<lambda> defined at test_hooks.py:N) that reads a tensor which is neither one of its gradients nor a parameter, buffer or tensor attribute of that module (a global tensor, another module's weight); the program's backward would hold its value at export.
  at test_hooks.py:N (return self.out(self.act(self.lin(x))))
  fix: reach the tensor through the module the hook is given (module.weight): register it on that module (as a parameter or buffer), or register the hook on a module that holds every tensor it reads.
  see docs/errors.md#unsupportedhookerror""")

    def test_hook_that_cannot_be_traced_is_refused(self):
        net = Deconv()
        net.out.register_full_backward_pre_hook(lambda m, grad_output: (grad_output[0], grad_output[0]))
        with pytest.raises(errors.UnsupportedHookError) as info:  # eager raises in backward
            predispatch.export(net, (torch.randn(5, 3),))
        self.assertExpectedInline(message(info.value), """\
module 'out' (Linear) has a backward pre-hook (ModuleState.test_hook_that_cannot_be_traced_is_refused.<locals>.<lambda> defined at test_hooks.py:N) that cannot be captured: RuntimeError: Backward pre hook returned an invalid number of grad_output, got 2, but expected 1
  at test_hooks.py:N (return self.out(self.act(self.lin(x))))
  fix: compute the hook with torch operations on its gradients and on its module's tensors, returning one gradient (or None) per entry it is given; or remove it before export (handle.remove()).
  see docs/errors.md#unsupportedhookerror""")
        net = Deconv()
        net.out.register_full_backward_hook(lambda m, grad_input, grad_output: (torch.from_numpy(grad_input[0].numpy()),))
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(5, 3),))
        self.assertIn("that cannot be captured: backward leaves torch: it calls `.numpy()` on a tensor", message(info.value))
        self.assertIn("at test_hooks.py:N (net.out.register_full_backward_hook(lambda", message(info.value))


class Halves(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class HalvesData:
    a: torch.Tensor
    b: torch.Tensor


#: Module outputs laid out in the ways torch's BackwardHook tells apart, from `x * 2`, `x.sin()`
#: and the integer tensor `x.argmax(-1)`.
LAYOUTS = {
    "tensor": lambda a, b, i: a,
    "tuple": lambda a, b, i: (a, i, b),
    "namedtuple": lambda a, b, i: Halves(a, b),
    "nested tuple": lambda a, b, i: (a, (b, i)),
    "list": lambda a, b, i: [a, b],
    "dict": lambda a, b, i: {"a": a, "b": b},
    "dataclass": lambda a, b, i: HalvesData(a, b),
    "no floating tensor": lambda a, b, i: (i, 3),
}


class Returns(nn.Module):
    def __init__(self, layout):
        super().__init__()
        self.layout = layout

    def forward(self, x):
        return LAYOUTS[self.layout](x * 2, x.sin(), x.argmax(-1))


class AfterLinear(nn.Module):
    """A Linear, then `inner` (the hooked module) on its result and the other arguments."""

    def __init__(self, inner):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.inner = inner

    def forward(self, x, *rest):
        out = self.inner(self.lin(x), *rest)
        return vars(out) if dataclasses.is_dataclass(out) else out  # a program returns no dataclass


def scale_by_position(module, grad_output):
    """A pre-hook whose result shows the layout it is given: each gradient scaled by its position and the count."""
    return tuple(None if g is None else g * (10 * len(grad_output) + i + 1) for i, g in enumerate(grad_output))


def mix_by_position(module, grad_input, grad_output):
    """A full hook whose result shows the layout of grad_output: its count, its Nones, its gradients by position."""
    nones = sum(2**i for i, g in enumerate(grad_output) if g is None)
    mixed = sum((i + 1) * g.mean() for i, g in enumerate(grad_output) if g is not None)
    return (grad_input[0] * (len(grad_output) + nones) + mixed,)


def scale_grad_input(module, grad_input, grad_output):
    return (grad_input[0] * 7,)


class Combines(nn.Module):
    def forward(self, x, pair, index, *, shift):
        return x * pair[0] + pair[1] * index.unsqueeze(-1) + shift


class CallsCombines(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.combine = Combines()

    def forward(self, x):
        h = self.lin(x)
        return self.combine(h, [h.sin(), h.cos()], x.argmax(-1), shift=h.tanh())


class Counts(nn.Module):
    def forward(self, x, position):
        position.add_(1)
        return x * position, position * 1  # the second output shows the update


class EagerLayout(TestCase):
    """Module backward hooks see the top level of the positional arguments and of the output, as
    torch's BackwardHook lays them out; outputs and gradients equal eager's for each layout."""

    def test_output_layouts(self):
        hooks = {
            "pre-hook": lambda m: m.register_full_backward_pre_hook(scale_by_position),
            "full hook reading grad_output": lambda m: m.register_full_backward_hook(mix_by_position),
            "full hook on grad_input": lambda m: m.register_full_backward_hook(scale_grad_input),
        }
        never_called = {"list", "dict", "dataclass", "no floating tensor"}
        for kind in LAYOUTS:
            for name, register in hooks.items():
                net = AfterLinear(Returns(kind))
                register(net.inner)
                with self.subTest(kind, hook=name), warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # eager's, for the layouts it never hooks
                    ep = check_gradients(net, (torch.randn(4, 3),))
                    self.assertEqual(hook_ops(ep) == [], kind in never_called)

    def test_export_warns_as_eager_does(self):
        net = AfterLinear(Returns("dict"))
        net.inner.register_full_backward_pre_hook(scale_by_position)
        with pytest.warns(UserWarning, match="For backward hooks to be called, module output should be a Tensor or"):
            predispatch.export(net, (torch.randn(4, 3),))

    def test_grad_input_has_top_level_positional_arguments_only(self):
        net = CallsCombines()  # grad_input: (grad of h, None for the list, one for the index)
        net.combine.register_full_backward_hook(
            lambda m, grad_input, grad_output: (grad_input[0] * (len(grad_input) + 10 * (grad_input[1] is None)), None, None)
        )
        ep = check_gradients(net, (torch.randn(4, 3),))
        self.assertEqual(hook_ops(ep), ["linear"])  # not the list's tensors, not the keyword shift

    def test_integer_argument_updated_in_place_reaches_the_caller(self):
        net = AfterLinear(Counts())
        net.inner.register_full_backward_hook(lambda m, grad_input, grad_output: (grad_input[0] * 2, None))
        check_gradients(net, (torch.randn(3), torch.tensor([1, 2, 3])))


class Renamed(nn.Module):
    """Saves its weight under an old key and accepts the old key on load, via state_dict hooks."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self._register_state_dict_hook(Renamed._rename_out)
        self._register_load_state_dict_pre_hook(Renamed._rename_in)

    @staticmethod
    def _rename_out(module, state_dict, prefix, local_metadata):
        state_dict[prefix + "legacy_weight"] = state_dict.pop(prefix + "lin.weight")

    @staticmethod
    def _rename_in(state_dict, prefix, *args):
        if prefix + "legacy_weight" in state_dict:
            state_dict[prefix + "lin.weight"] = state_dict.pop(prefix + "legacy_weight")

    def forward(self, x):
        return self.lin(x)


class StateDictHooks(TestCase):
    def test_program_state_dict_applies_module_hooks(self):
        model = Renamed()
        program = predispatch.export(model, (torch.randn(2, 3),)).module()
        self.assertEqual(sorted(program.state_dict()), sorted(model.state_dict()))
        assert_same_tree(dict(program.state_dict()), dict(model.state_dict()))

    def test_weights_move_between_module_and_program(self):
        model, other = Renamed(), Renamed()
        program = predispatch.export(model, (torch.randn(2, 3),)).module()
        program.load_state_dict(other.state_dict())
        x = torch.randn(2, 3)
        assert_same_tree(program(x), other(x))
        model.load_state_dict(program.state_dict())
        assert_same_tree(model(x), other(x))


class HookChanges(TestCase):
    def test_unchanged_hooks_verify(self):
        net = Net()
        net.lin.register_forward_hook(add_one)
        ep = predispatch.export(net, (torch.randn(4, 3),))
        ep.verify_hooks(net)

    def test_added_and_removed_hooks_are_reported(self):
        net = Net()
        handle = net.lin.register_forward_hook(add_one)
        ep = predispatch.export(net, (torch.randn(4, 3),))
        handle.remove()
        net.out.register_forward_pre_hook(double_input)
        with pytest.raises(errors.HooksChangedError) as info:
            ep.verify_hooks(net)
        self.assertExpectedInline(message(info.value), """\
the module's hooks changed since export:
    added forward_pre_hook on 'out': test_hooks.double_input
    removed forward_hook on 'lin': test_hooks.add_one
  fix: export again to trace the current hooks, or restore the old ones.
  see docs/errors.md#hookschangederror""")


# --- Side effects read from the source, not the bytecode (Note [Reading a hook's code from its source])

_BUFFER = torch.zeros(3)


def _copies_into_buffer(g):
    _BUFFER.copy_(g)
    return g


def _records(log, g):
    log.append(g)
    return g


_EXEC_NAMESPACE: dict = {}
exec("def made_by_exec(g):\n    return g * 2\n", _EXEC_NAMESPACE)  # no source file to read


def _tensor_hook_model(hook):
    class Hooked(nn.Module):
        def forward(self, x):
            h = x * 2
            h.register_hook(hook)
            return h * 3

    return Hooked()


#: hook -> the side effect the refusal names; each was missed by the former bytecode reading on
#: every Python (`_slice_store_hook`'s `buf[:] = g` on 3.12, whose STORE_SLICE it did not know).
_EFFECTFUL = {
    "in_place_copy": (lambda buf: _copies_into_buffer, "calls _BUFFER.copy_"),
    "builtin": (lambda buf: print, "its source cannot be read"),
    "partial": (lambda buf: __import__("functools").partial(_records, []), "calls append"),
    "exec": (lambda buf: _EXEC_NAMESPACE["made_by_exec"], "its source cannot be read"),
}


def _slice_store_hook(buf):
    def hook(g):
        buf[:] = g
        return g

    return hook


@pytest.mark.parametrize("case", ["slice_store_statement", *_EFFECTFUL])
def test_hook_side_effects_are_read_from_the_source(case):
    """Each hook has an effect a traced backward would run once, at export: refused, naming it."""
    buf = torch.zeros(3)
    if case == "slice_store_statement":
        hook, effect = _slice_store_hook(buf), "writes buf[:]"
    else:
        make, effect = _EFFECTFUL[case]
        hook = make(buf)
    with pytest.raises(errors.UnsupportedHookError) as info:
        predispatch.export(_tensor_hook_model(hook), (torch.randn(3),))
    assert f"the hook has a Python side effect ({effect}" in message(info.value), message(info.value)


def test_hook_inspection_reads_no_bytecode(monkeypatch):
    """The checks never read bytecode (whose instructions change with each Python release): with
    `dis` unusable, a pure hook is still captured and an effectful one refused.  Before: the
    check read `dis.get_instructions` and missed 3.12's STORE_SLICE."""
    import dis

    def unusable(*args, **kwargs):
        raise AssertionError("bytecode read")

    monkeypatch.setattr(dis, "get_instructions", unusable)
    monkeypatch.setattr(dis, "Bytecode", unusable)
    x = torch.randn(3)
    ep = predispatch.export(_tensor_hook_model(lambda g: g * 10), (x,))
    x = x.requires_grad_()
    ep.module()(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 60.0))
    with pytest.raises(errors.UnsupportedHookError):
        predispatch.export(_tensor_hook_model(_slice_store_hook(torch.zeros(3))), (torch.randn(3),))
    net = Net()
    net.out.register_full_backward_hook(lambda m, gi, go: (gi[0] * 2,))  # reads no grad_output: no carriers
    check_gradients(net, (torch.randn(4, 3),))


def test_lambdas_on_one_line_are_told_apart():
    """Of two lambdas on one line, the pure one is captured though the other prints (the columns
    its code covers pick it)."""
    pure, printing = (lambda g: g * 10), (lambda g: print(g))  # noqa: E731
    from predispatch.custom_backward.hooks.inspection import side_effect

    assert side_effect(printing) == "calls print"
    assert side_effect(pure) is None
