"""Module hooks: forward hooks traced, backward hooks refused by name, state_dict hooks honoured,
and hook changes after export detected."""

from __future__ import annotations


import pytest
import torch
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

    def test_full_backward_hook_reading_grad_output_is_refused(self):
        net = Net()
        net.out.register_full_backward_hook(lambda module, grad_input, grad_output: (grad_input[0] * grad_output[0].sum(),))
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(4, 3),))
        self.assertIn("a full backward hook that reads grad_output cannot be captured", message(info.value))

    def test_full_backward_hook_is_refused(self):
        net = Net()
        net.out.register_full_backward_hook(print_grads)
        with pytest.raises(errors.UnsupportedHookError) as info:
            predispatch.export(net, (torch.randn(4, 3),))
        self.assertExpectedInline(message(info.value), """\
module 'out' (Linear) has a backward hook, print_grads defined at test_hooks.py:N, which a traced program would silently drop: it has a Python side effect (calls print).
  at test_hooks.py:N (return self.out(torch.relu(self.lin(x))) * scale)
  fix: remove it before export (handle.remove()), make it a pure function of the gradients (a full backward hook may only use grad_input), or move its effect into an autograd.Function.
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
