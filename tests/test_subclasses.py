"""Tensor subclasses: taken apart into their plain tensors, traced through their own rules
(Note [Tensor subclasses] in predispatch/frontend/subclasses.py).

Each program is compared with eager part by part, bitwise; the graphs hold plain tensors only.
"""

from __future__ import annotations

import copy
import io
import sys

import pytest
import torch
from expecttest import assert_expected_inline

import predispatch
from predispatch.errors import InputMismatchError, SerializationError, UnsupportedConstructError, UnsupportedInputError
from predispatch.passes import mutable_ops

from helpers import assert_verified, graph, state_bits
from subclass_cases import Configured, Fancy, Opaque, QuantConfig, Rounding, Scaled, ScaledLinear, TwoTensor, quantize


def parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A tensor's plain tensors, depth first (itself when plain)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [p for name in names for p in parts(getattr(t, name))]


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same class, and each part bitwise equal."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    for a, e in zip(parts(actual), parts(expected), strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def plain_graph(ep: predispatch.ExportedProgram) -> None:
    """Every value in the graph is a plain tensor (or not a tensor), no op mutates."""
    assert mutable_ops(ep.graph_module) == []
    for node in ep.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            assert not predispatch.frontend.subclasses.is_subclass(value), node


class Everywhere(torch.nn.Module):
    """A TwoTensor parameter, a TwoTensor buffer forward updates, a TwoTensor input and output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(TwoTensor(torch.randn(3, 3), torch.randn(3, 3)))
        self.register_buffer("steps", TwoTensor(torch.zeros(3), torch.ones(3)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.steps.add_(1)
        return (x @ self.w).sin() + self.steps * y


def test_two_tensor_parameter_buffer_input_and_output():
    m = Everywhere()
    x, y = torch.randn(2, 3), TwoTensor(torch.randn(2, 3), torch.randn(2, 3))
    before = state_bits(m)
    ep = predispatch.export(m, (x, y))
    plain_graph(ep)
    assert_verified(ep)
    assert all(torch.equal(a, b) for k in before for a, b in zip(parts(before[k]), parts(m.state_dict()[k])))
    assert_expected_inline(
        graph(ep),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, p_w__a: "f32[3, 3]", p_w__b: "f32[3, 3]", b_steps__a: "f32[3]", b_steps__b: "f32[3]", x: "f32[2, 3]", y__a: "f32[2, 3]", y__b: "f32[2, 3]"):
        add: "f32[3]" = torch.ops.aten.add.Tensor(b_steps__a, 1);  b_steps__a = None
        add_1: "f32[3]" = torch.ops.aten.add.Tensor(b_steps__b, 1);  b_steps__b = None
        subclass_gradient_barrier: "f32[2, 3]" = torch.ops.predispatch.subclass_gradient_barrier.default(x);  x = None
        matmul: "f32[2, 3]" = torch.ops.aten.matmul.default(subclass_gradient_barrier, p_w__a);  p_w__a = None
        matmul_1: "f32[2, 3]" = torch.ops.aten.matmul.default(subclass_gradient_barrier, p_w__b);  subclass_gradient_barrier = p_w__b = None
        sin: "f32[2, 3]" = torch.ops.aten.sin.default(matmul);  matmul = None
        sin_1: "f32[2, 3]" = torch.ops.aten.sin.default(matmul_1);  matmul_1 = None
        mul: "f32[2, 3]" = torch.ops.aten.mul.Tensor(add, y__a);  y__a = None
        mul_1: "f32[2, 3]" = torch.ops.aten.mul.Tensor(add_1, y__b);  y__b = None
        add_2: "f32[2, 3]" = torch.ops.aten.add.Tensor(sin, mul);  sin = mul = None
        add_3: "f32[2, 3]" = torch.ops.aten.add.Tensor(sin_1, mul_1);  sin_1 = mul_1 = None
        return (add, add_1, add_2, add_3)""",
    )
    assert_expected_inline(
        str(ep.signature),
        """\
Inputs:
    p_w__a: PARAMETER target='w' inner='a'
    p_w__b: PARAMETER target='w' inner='b'
    b_steps__a: BUFFER target='steps' inner='a'
    b_steps__b: BUFFER target='steps' inner='b'
    x: USER_INPUT target='x'
    y__a: USER_INPUT target='y' inner='a'
    y__b: USER_INPUT target='y' inner='b'
Outputs:
    add: BUFFER_MUTATION target='steps' inner='a'
    add_1: BUFFER_MUTATION target='steps' inner='b'
    add_2: USER_OUTPUT target='output' inner='a'
    add_3: USER_OUTPUT target='output' inner='b'
Tensor subclasses (the graph computes on their parts):
    w: torch.testing._internal.two_tensor.TwoTensor(a, b)
    steps: torch.testing._internal.two_tensor.TwoTensor(a, b)
    y: torch.testing._internal.two_tensor.TwoTensor(a, b)
    output: torch.testing._internal.two_tensor.TwoTensor(a, b)""",
    )
    eager, program = copy.deepcopy(m), ep.module()
    assert program.w is m.w and program.steps is m.steps  # the model's own subclass tensors
    for _ in range(2):  # the buffer update lands in the model's own TwoTensor, as eager's does
        expected, actual = eager(x, y), program(x, y)
        assert_same(actual, expected)
        assert_same(m.steps, eager.steps)
        expected.sum().backward()
        actual.sum().backward()
        assert_same(m.w.grad, eager.w.grad)


def test_a_user_subclass_with_torch_function_rules():
    m = ScaledLinear()
    x = torch.randn(5, 8)
    ep = predispatch.export(m, (x,))
    plain_graph(ep)
    assert_expected_inline(
        graph(ep),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, p_a_weight__qdata: "i8[16, 8]", p_a_weight__scale: "f32[16, 1]", p_a_bias: "f32[16]", p_b_weight__qdata: "i8[4, 16]", p_b_weight__scale: "f32[4, 1]", p_b_bias: "f32[4]", x: "f32[5, 8]"):
        _assert_tensor_metadata = torch.ops.aten._assert_tensor_metadata.default(p_a_weight__qdata, None, None, torch.int8, device = device(type='cpu'), layout = torch.strided);  _assert_tensor_metadata = None
        _to_copy: "f32[16, 8]" = torch.ops.aten._to_copy.default(p_a_weight__qdata, dtype = torch.float32);  p_a_weight__qdata = None
        mul: "f32[16, 8]" = torch.ops.aten.mul.Tensor(_to_copy, p_a_weight__scale);  _to_copy = p_a_weight__scale = None
        linear: "f32[5, 16]" = torch.ops.aten.linear.default(x, mul, p_a_bias);  x = mul = p_a_bias = None
        relu: "f32[5, 16]" = torch.ops.aten.relu.default(linear);  linear = None
        _assert_tensor_metadata_1 = torch.ops.aten._assert_tensor_metadata.default(p_b_weight__qdata, None, None, torch.int8, device = device(type='cpu'), layout = torch.strided);  _assert_tensor_metadata_1 = None
        _to_copy_1: "f32[4, 16]" = torch.ops.aten._to_copy.default(p_b_weight__qdata, dtype = torch.float32);  p_b_weight__qdata = None
        mul_1: "f32[4, 16]" = torch.ops.aten.mul.Tensor(_to_copy_1, p_b_weight__scale);  _to_copy_1 = p_b_weight__scale = None
        linear_1: "f32[5, 4]" = torch.ops.aten.linear.default(relu, mul_1, p_b_bias);  relu = mul_1 = p_b_bias = None
        return (linear_1,)""",
    )
    program = ep.module()
    assert program.a.weight is m.a.weight
    for inputs in (x, torch.randn(5, 8) * 3):
        torch.testing.assert_close(program(inputs), m(inputs), rtol=0, atol=0)


class Methods(torch.nn.Module):
    """Forward reads a subclass parameter's method and attribute (torch's export tests do)."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(TwoTensor(torch.arange(3.0), torch.arange(3.0) * 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.p.get_elem_a() * self.p.b


class Built(torch.nn.Module):
    """Forward builds a subclass from its input and returns a part of a result."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = TwoTensor(x, x * 2)
        return (t.sin() + 1).get_elem_a()


@pytest.mark.parametrize("case", [Methods, Built])
def test_subclass_code_in_forward(case):
    m, x = case(), torch.randn(3)
    ep = predispatch.export(m, (x,))
    plain_graph(ep)
    torch.testing.assert_close(ep.module()(x), m(x), rtol=0, atol=0)
    x2 = torch.randn(3)
    torch.testing.assert_close(ep.module()(x2), m(x2), rtol=0, atol=0)


def test_golden_of_methods():
    ep = predispatch.export(Methods(), (torch.randn(3),))
    assert_expected_inline(
        graph(ep),
        """\
class GraphModule(torch.nn.Module):
    def forward(self, p_p__a: "f32[3]", p_p__b: "f32[3]", x: "f32[3]"):
        detach: "f32[3]" = torch.ops.aten.detach.default(p_p__a);  p_p__a = None
        detach_1: "f32[3]" = torch.ops.aten.detach.default(p_p__b);  p_p__b = None
        mul: "f32[3]" = torch.ops.aten.mul.Tensor(detach, detach_1);  detach = detach_1 = None
        add: "f32[3]" = torch.ops.aten.add.Tensor(x, mul);  x = mul = None
        return (add,)""",
    )


class AddOne(torch.nn.Module):
    def __init__(self, weight: torch.Tensor | None = None):
        super().__init__()
        if weight is not None:
            self.register_buffer("w", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1 if not hasattr(self, "w") else x + self.w


def test_a_subclass_export_cannot_take_apart_is_refused_by_name():
    opaque = torch.ones(3).as_subclass(Opaque)
    with pytest.raises(UnsupportedInputError) as err:
        predispatch.export(AddOne(), (opaque,))
    assert "input 'x' is a subclass_cases.Opaque" in str(err.value)
    assert "__tensor_flatten__" in str(err.value) and "test_subclasses.py" in str(err.value)
    m = AddOne(torch.ones(3).as_subclass(Opaque))
    before = state_bits(m)
    with pytest.raises(UnsupportedInputError, match="buffer 'w' is a subclass_cases.Opaque"):
        predispatch.export(m, (torch.ones(3),))
    assert type(m.w) is Opaque and torch.equal(m.w, before["w"])


def test_a_call_with_another_layout_is_refused():
    m = Everywhere()
    x, y = torch.randn(2, 3), TwoTensor(torch.randn(2, 3), torch.randn(2, 3))
    program = predispatch.export(m, (x, y)).module()
    with pytest.raises(InputMismatchError, match=r"input 'y' was a torch.testing._internal.two_tensor.TwoTensor\(a, b\) at export and is a Tensor"):
        program(x, torch.randn(2, 3))
    program.w = torch.nn.Parameter(torch.randn(3, 3))  # the user swaps the state
    with pytest.raises(InputMismatchError, match="state 'w' was a torch.testing._internal.two_tensor.TwoTensor"):
        program(x, y)


def test_scaled_context_is_checked_at_call():
    """The flatten context (here the dtype) is part of the traced program."""
    lin = torch.nn.Linear(3, 4, bias=False)
    w = quantize(lin.weight.detach())
    lin.weight = torch.nn.Parameter(w, requires_grad=False)
    program = predispatch.export(lin, (torch.randn(2, 3),)).module()
    program.weight = torch.nn.Parameter(Scaled(w.qdata, w.scale.double(), torch.float64), requires_grad=False)
    with pytest.raises(InputMismatchError, match="flatten context"):
        program(torch.randn(2, 3))


class TwoLoss(torch.nn.Module):
    """A TwoTensor parameter trained through TwoTensor's dispatch: the loss is a TwoTensor scalar.
    The embedding before it is frozen (`train_embedding` False), as eager would give its weight a
    TwoTensor gradient (Note [Gradients of plain tensors through a subclass]); its input is ids,
    which have no gradient either."""

    def __init__(self, train_embedding: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(TwoTensor(torch.randn(3, 3), torch.randn(3, 3)))
        self.embed = torch.nn.Embedding(5, 3).requires_grad_(train_embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.embed(ids) @ self.w).sin().sum()


def test_gradients_through_subclass_dispatch_in_module_and_joint():
    m, x = TwoLoss(), torch.tensor([[0, 3], [4, 1]])
    ep = predispatch.export(m, (x,))
    eager = copy.deepcopy(m)
    eager(x).backward()
    ep.module()(x).backward()
    assert_same(m.w.grad, eager.w.grad)
    joint = ep.joint()
    plain_graph(joint)
    assert [(s.target, s.inner) for s in joint.signature.outputs if s.kind.name == "GRADIENT_TO_PARAMETER"] == [("w", "a"), ("w", "b")]
    loss, grads = joint.module()(x)
    assert_same(loss, eager(x))
    assert_same(grads["w"], eager.w.grad)


def test_a_plain_tensor_whose_eager_gradient_is_a_subclass_gets_none_but_an_error():
    """Eager gives `embed.weight` a TwoTensor gradient; the program's would be the sum of the parts':
    the program runs forward, and a gradient reaching that tensor raises (Note [Gradients of plain
    tensors through a subclass])."""
    m, x = TwoLoss(train_embedding=True), torch.tensor([[0, 3], [4, 1]])
    ep = predispatch.export(m, (x,))
    assert "predispatch.subclass_gradient_barrier" in graph(ep)
    eager = copy.deepcopy(m)
    program = ep.module()
    assert_same(program(x), eager(x))
    with pytest.raises(UnsupportedConstructError, match="the sum over the parts: not eager's gradient"):
        program(x).backward()
    with pytest.raises(UnsupportedConstructError, match="the sum over the parts"):
        ep.joint()
    m.embed.requires_grad_(False)  # the fix the error names: nothing asks for that gradient
    program(x).backward()
    eager.embed.requires_grad_(False)
    eager(x).backward()
    assert_same(m.w.grad, eager.w.grad)


def test_forward_reading_a_part_gets_no_gradient_as_in_eager():
    """`p.get_elem_a() * p.b` reads the stored tensors, which hold no grad: eager gives `p` no
    gradient, and neither may the program (Note [Reading a subclass's tensors in forward])."""
    m = Methods()
    x = torch.randn(3, requires_grad=True)
    ep = predispatch.export(m, (x,))
    x1, x2 = x.detach().clone().requires_grad_(), x.detach().clone().requires_grad_()
    eager = copy.deepcopy(m)
    eager(x1).sum().backward()
    ep.module()(x2).sum().backward()
    assert eager.p.grad is None and m.p.grad is None
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)


def test_a_subclass_with_rules_passed_to_a_plain_program_is_refused_at_call():
    """Issue 40 item 7: eager runs the subclass's override, the plain program would not."""
    program = predispatch.export(AddOne(), (torch.ones(3),)).module()
    with pytest.raises(InputMismatchError, match="input 'x' was a plain tensor at export and is a subclass_cases.Opaque"):
        program(torch.ones(3).as_subclass(Opaque))
    torch.testing.assert_close(program(torch.ones(3)), torch.full((3,), 2.0))


# --------------------------------------------------------------------------- saving (format version 2)


def saved(ep: predispatch.ExportedProgram) -> bytes:
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    return buffer.getvalue()


def refusal(data: bytes, **options) -> str:
    with pytest.raises(SerializationError) as info:
        predispatch.load(io.BytesIO(data), **options)
    return str(info.value)


def test_a_two_tensor_program_saves_and_loads_as_eager():
    """A TwoTensor parameter, a TwoTensor buffer forward updates, a TwoTensor input and output:
    stored as their parts, built again only for `types=[TwoTensor]`, bitwise eager's."""
    m = Everywhere()
    x, y = torch.randn(2, 3), TwoTensor(torch.randn(2, 3), torch.randn(2, 3))
    ep = predispatch.export(m, (x, y))
    data = saved(ep)
    loaded = predispatch.load(io.BytesIO(data), types=[TwoTensor])
    assert str(loaded) == str(ep) and saved(loaded) == data
    w, steps = loaded.state_dict["w"], loaded.state_dict["steps"]
    assert type(w) is TwoTensor and isinstance(w, torch.nn.Parameter) and w.requires_grad
    assert type(steps) is TwoTensor and not isinstance(steps, torch.nn.Parameter) and not steps.requires_grad
    assert_same(w, m.w) and assert_same(steps, m.steps)
    eager, program = copy.deepcopy(m), loaded.module()
    for _ in range(2):
        expected, actual = eager(x, y), program(x, y)
        assert_same(actual, expected)
        assert_same(program.steps, eager.steps)
        expected.sum().backward()
        actual.sum().backward()
        assert_same(program.w.grad, eager.w.grad)


def test_a_quantized_program_saves_and_loads_as_eager():
    m, x = ScaledLinear(), torch.randn(5, 8)
    loaded = predispatch.load(io.BytesIO(saved(predispatch.export(m, (x,)))), types=[Scaled])
    weight = loaded.state_dict["a.weight"]
    assert type(weight) is Scaled and isinstance(weight, torch.nn.Parameter) and not weight.requires_grad
    assert weight.qdata.dtype == torch.int8 and weight.qdata is not m.a.weight.qdata  # the file's tensors
    for inputs in (x, torch.randn(5, 8) * 3):
        torch.testing.assert_close(loaded.module()(inputs), m(inputs), rtol=0, atol=0)


def test_a_subclass_file_names_every_class_load_needs_in_one_refusal():
    """The layout's class and its context's dataclass and enum (one with a method of its own)
    in one message whose fix works; the plain enum `Rounding` needs no permission."""
    m, x = ScaledLinear(QuantConfig(4, Rounding.DOWN)), torch.randn(5, 8)
    data = saved(predispatch.export(m, (x,)))
    message = refusal(data)
    assert message.startswith("the file names 3 classes load builds only when you allow them: subclass_cases:Configured "
                              "(signature subclass_state['a.weight']); subclass_cases:QuantConfig "
                              "(signature subclass_state['a.weight'] context['config']); subclass_cases:Fancy "
                              "(signature subclass_state['a.weight'] context['config'].fancy)."), message
    assert "Rounding" not in message
    fix = message.split("predispatch.load(path, types=")[1].split(")")[0]
    assert fix == "[subclass_cases.Configured, subclass_cases.QuantConfig, subclass_cases.Fancy]"
    loaded = predispatch.load(io.BytesIO(data), types=eval(fix, {"subclass_cases": sys.modules["subclass_cases"]}))
    assert loaded.state_dict["b.weight"].config == QuantConfig(4, Rounding.DOWN)
    torch.testing.assert_close(loaded.module()(x), m(x), rtol=0, atol=0)
    assert "subclass_cases:Fancy" in refusal(data, types=[Configured, QuantConfig])


def test_a_refused_subclass_file_builds_and_registers_nothing(monkeypatch):
    """No `__tensor_unflatten__` runs for a file refused by its classes, nor for a file of
    allowed classes refused by the verifier: subclasses are built once the whole file is good."""
    import load_attacks

    data = saved(predispatch.export(ScaledLinear(QuantConfig(4, Rounding.DOWN)), (torch.randn(5, 8),)))
    built = []
    unflatten = Configured.__tensor_unflatten__
    monkeypatch.setattr(Configured, "__tensor_unflatten__", staticmethod(lambda *a: built.append(1) or unflatten(*a)))
    nodes = load_attacks.global_registrations()
    allowed = [Configured, QuantConfig, Fancy]
    assert "subclass_cases:Configured" in refusal(data)
    lying = load_attacks.edited(data, lambda p: p["tensors"]["state"]["a.weight:scale"].update(shape=[8, 2], stride=[2, 1]))
    assert "signature input p_a_weight__scale (PARAMETER 'a.weight'): its shape [16, 1] differs from its target's [8, 2]" in refusal(
        lying, types=allowed)
    assert built == [] and load_attacks.global_registrations() == nodes
    predispatch.load(io.BytesIO(data), types=allowed)
    assert built  # built once verified (the Parameter's detach builds one more each)


def test_a_subclass_file_is_displayed_without_types():
    from predispatch._files import load_for_display

    data = saved(predispatch.export(ScaledLinear(QuantConfig(4, Rounding.DOWN)), (torch.randn(5, 8),)))
    shown = load_for_display(io.BytesIO(data))
    assert "a.weight: subclass_cases.Configured(qdata, scale)" in str(shown.signature)


def test_to_torch_holds_a_subclass_state_as_its_parts(tmp_path):
    """torch's program: each part a plain parameter named after the subclass's attribute and its
    own; torch.export.save/load keep it; its module() is eager's."""
    m, x = ScaledLinear(), torch.randn(5, 8)
    converted = predispatch.export(m, (x,)).to_torch()
    assert list(converted.state_dict) == ["a.weight__qdata", "a.weight__scale", "a.bias", "b.weight__qdata", "b.weight__scale", "b.bias"]
    assert all(type(t) is torch.nn.Parameter and not t.requires_grad for k, t in converted.state_dict.items() if "__" in k)
    torch.export.save(converted, tmp_path / "scaled.pt2")
    for program in (converted, torch.export.load(tmp_path / "scaled.pt2")):
        torch.testing.assert_close(program.module()(x), m(x), rtol=0, atol=0)


def test_to_torch_refuses_a_subclass_input_and_output_by_name():
    from predispatch.errors import NotRepresentableError

    ep = predispatch.export(Everywhere(), (torch.randn(2, 3), TwoTensor(torch.randn(2, 3), torch.randn(2, 3))))
    with pytest.raises(NotRepresentableError) as err:
        ep.to_torch()
    assert "y is a tensor subclass (torch.testing._internal.two_tensor.TwoTensor)" in str(err.value)
    assert "output is a tensor subclass" in str(err.value)


def test_a_joint_program_with_subclass_gradients_saves_and_loads():
    """The joint's gradient of a TwoTensor parameter is its parts' outputs, built again into a
    TwoTensor by the loaded program; the loaded program saves to the same bytes."""
    m, x = TwoLoss(), torch.tensor([[0, 3], [4, 1]])
    data = saved(predispatch.export(m, (x,)).joint())
    loaded = predispatch.load(io.BytesIO(data), types=[TwoTensor])
    assert saved(loaded) == data
    eager = copy.deepcopy(m)
    eager(x).backward()
    loss, grads = loaded.module()(x)
    assert_same(loss, eager(x))
    assert_same(grads["w"], eager.w.grad)


def test_plain_enums_are_those_naming_a_member_runs_no_code_of():
    """A file may name a member of a plain enum without `types=`: made by `enum.EnumType`, no
    Python code of its own (its members' `==`, hash and repr are the enum module's or C's)."""
    import enum

    from predispatch.serialize.classes import is_plain_enum

    class Text(str, enum.Enum):
        A = "a"

    class Number(enum.IntEnum):
        A = 1

    class Missing(enum.Enum):
        A = 1

        @classmethod
        def _missing_(cls, value):
            return cls.A

    class Meta(enum.EnumMeta):
        pass

    class WithMeta(enum.Enum, metaclass=Meta):
        A = 1

    class Named(enum.Enum):
        A = 1

        @property
        def label(self):
            return "a"

    assert [is_plain_enum(c) for c in (Rounding, Text, Number)] == [True, True, True]
    assert [is_plain_enum(c) for c in (Fancy, Missing, WithMeta, Named, int, QuantConfig)] == [False] * 6
