"""`ep.module()` is an `fx.GraphModule` that compilers and graph tools take whole.

Every case checks the calling convention in the generated code, then what a consumer sees:
`torch.compile(..., fullgraph=True)` compiles it as one frame with no graph break (custom
backwards included, checked by a straight-through estimator whose autograd-through-forward
gradient is 0), with outputs, gradients and buffers equal to eager's; torchao's PT2E
`prepare_pt2e` -> calibrate -> `convert_pt2e` runs it close to eager.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch._dynamo.testing
from expecttest import TestCase
from helpers import StraightThrough, assert_same_tree, stable_message
from torch import fx, nn

import predispatch
from predispatch.errors import DynamicShapeError, InputMismatchError, ModeSwitchError, ModuleConversionError, ModuleCopyError


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class ConvBn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


class NoGradRegion(nn.Module):
    """A no_grad region that reads a tensor the forward creates (a region body constant)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            scale = x.abs().mean(0) * torch.tensor([1.0, 2.0, 3.0, 4.0])
        return self.lin(x) * scale


class AutocastRegion(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return y.float() + x


class Quantized(nn.Module):
    """A straight-through estimator, as in quantization-aware training."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(StraightThrough.apply(x * 4) / 4)


class BackwardHooks(nn.Module):
    """A module backward hook and a tensor hook, both captured as autograd_function_apply."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = nn.Linear(4, 4), nn.Linear(4, 2)
        self.out.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0].clamp(-0.01, 0.01),))

    def forward(self, x):
        h = self.hidden(x)
        h.register_hook(lambda g: g * 10)
        return self.out(h)


def _transformer_block():
    return nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)


#: name -> (module factory, example args); each module in train mode unless the name says eval.
CASES = {
    "mlp": (Mlp, lambda: (torch.randn(3, 8),)),
    "conv_bn_train": (ConvBn, lambda: (torch.randn(2, 3, 8, 8),)),
    "conv_bn_eval": (lambda: ConvBn().eval(), lambda: (torch.randn(2, 3, 8, 8),)),
    "transformer_block": (_transformer_block, lambda: (torch.randn(2, 5, 16),)),
    "no_grad_region": (NoGradRegion, lambda: (torch.randn(3, 4),)),
    "autocast_region": (AutocastRegion, lambda: (torch.randn(3, 4),)),
    "straight_through": (Quantized, lambda: (torch.randn(3, 4),)),
    "backward_hooks": (BackwardHooks, lambda: (torch.randn(3, 4),)),
}


def _run(module, args):
    """Outputs, input and parameter gradients, and the state after one training step's forward."""
    inputs = [a.clone().requires_grad_() for a in args]
    out = module(*inputs)
    out.sum().backward()
    grads = [p.grad for p in module.parameters()] if isinstance(module, nn.Module) else []
    state = getattr(module, "_orig_mod", module).state_dict() if isinstance(module, nn.Module) else {}
    return out, [x.grad for x in inputs], grads, state


class ModuleIsAGraphModule(TestCase):
    def test_calling_convention_is_generated_code(self):
        """Pytree in (kwargs, a constant), state by FQN, the write-back, constants back in the output."""

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)
                self.register_buffer("steps", torch.zeros((), dtype=torch.long))

            def forward(self, x, *, scale, tag="a"):
                self.steps += 1
                return {"y": self.lin(x) * scale, "tag": tag}

        net, x, scale = Net(), torch.randn(2, 4), torch.tensor(2.0)
        program = predispatch.export(net, (x,), {"scale": scale, "tag": "a"}).module()
        self.assertIsInstance(program, fx.GraphModule)
        self.assertExpectedInline(
            program.code.strip(),
            """\
def forward(self, x, scale, tag):
    x, scale, tag, = fx_pytree.tree_flatten_spec(([x], {'scale':scale, 'tag':tag}), self._in_spec)
    _predispatch_check_owner(self, False)
    lin_weight = self.lin.weight
    lin_bias = self.lin.bias
    steps = self.steps
    read_before_write = predispatch_runtime_runner_read_before_write(steps)
    add = torch.ops.aten.add.Tensor(read_before_write, 1);  read_before_write = None
    linear = torch.ops.aten.linear.default(x, lin_weight, lin_bias);  x = lin_weight = lin_bias = None
    mul = torch.ops.aten.mul.Tensor(linear, scale);  linear = scale = None
    apply_mutations = predispatch_runtime_runner_apply_mutations(('copy',), (steps,), (add,));  steps = add = apply_mutations = None
    return pytree.tree_unflatten([mul, 'a'], self._out_spec)""",
        )
        eager = copy.deepcopy(net)
        assert_same_tree(program(x, scale=scale, tag="a"), eager(x, scale=scale, tag="a"))
        assert_same_tree(program.state_dict(), eager.state_dict())
        self.assertEqual(list(program.state_dict()), list(net.state_dict()))
        with pytest.raises(InputMismatchError, match="'tag' was 'a' at export and is 'b' now"):
            program(x, scale=scale, tag="b")
        with pytest.raises(InputMismatchError, match="exported as torch.float32"):
            program(x.double(), scale=scale, tag="a")
        self.assertEqual(program.steps.item(), 1)  # the refused calls wrote nothing

    def test_state_named_like_graph_module_attributes(self):
        """A submodule named `code` (seen in library models), `graph`, `meta`: fx.GraphModule's own
        attributes, not nn.Module's, so eager allows them (Note [State named like a GraphModule
        attribute]); `ep.module()` used to raise "'str' object has no attribute 'register_parameter'"."""

        class Named(nn.Module):
            def __init__(self):
                super().__init__()
                self.code = nn.Linear(3, 3)
                self.graph = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
                self.meta = nn.Parameter(torch.randn(3))
                self.register_buffer("recompile", torch.ones(3), persistent=False)
                self.print_readable = torch.full((3,), 2.0)  # a plain tensor attribute: a constant

            def forward(self, x):
                return self.graph(self.code(x)) * self.meta + self.recompile * self.print_readable

        model, x = Named(), torch.randn(4, 3)
        eager = copy.deepcopy(model)
        ep = predispatch.export(model, (x,))
        program = ep.module()
        self.assertExpectedInline(
            program.code.strip(),
            """\
def forward(self, x):
    x, = fx_pytree.tree_flatten_spec(([x], {}), self._in_spec)
    _predispatch_check_owner(self, False)
    meta = self.__root_state.meta
    code_weight = self.__root_state.code.weight
    code_bias = self.__root_state.code.bias
    graph_0_weight = getattr(self.__root_state.graph, "0").weight
    graph_0_bias = getattr(self.__root_state.graph, "0").bias
    graph_1_weight = getattr(self.__root_state.graph, "1").weight
    graph_1_bias = getattr(self.__root_state.graph, "1").bias
    recompile = self.__root_state.recompile
    graph_1_running_mean = getattr(self.__root_state.graph, "1").running_mean
    read_before_write = predispatch_runtime_runner_read_before_write(graph_1_running_mean)
    graph_1_running_var = getattr(self.__root_state.graph, "1").running_var
    read_before_write_1 = predispatch_runtime_runner_read_before_write(graph_1_running_var)
    graph_1_num_batches_tracked = getattr(self.__root_state.graph, "1").num_batches_tracked
    read_before_write_2 = predispatch_runtime_runner_read_before_write(graph_1_num_batches_tracked)
    print_readable = self.__root_state.print_readable
    linear = torch.ops.aten.linear.default(x, code_weight, code_bias);  x = code_weight = code_bias = None
    linear_1 = torch.ops.aten.linear.default(linear, graph_0_weight, graph_0_bias);  linear = graph_0_weight = graph_0_bias = None
    add = torch.ops.aten.add.Tensor(read_before_write_2, 1);  read_before_write_2 = None
    _native_batch_norm_legit_functional = torch.ops.aten._native_batch_norm_legit_functional.default(linear_1, graph_1_weight, graph_1_bias, read_before_write, read_before_write_1, True, 0.1, 1e-05);  linear_1 = graph_1_weight = graph_1_bias = read_before_write = read_before_write_1 = None
    getitem = _native_batch_norm_legit_functional[0]
    getitem_3 = _native_batch_norm_legit_functional[3]
    getitem_4 = _native_batch_norm_legit_functional[4];  _native_batch_norm_legit_functional = None
    mul = torch.ops.aten.mul.Tensor(getitem, meta);  getitem = meta = None
    mul_1 = torch.ops.aten.mul.Tensor(recompile, print_readable);  recompile = print_readable = None
    add_1 = torch.ops.aten.add.Tensor(mul, mul_1);  mul = mul_1 = None
    apply_mutations = predispatch_runtime_runner_apply_mutations(('copy', 'copy', 'copy'), (graph_1_running_mean, graph_1_running_var, graph_1_num_batches_tracked), (getitem_3, getitem_4, add));  graph_1_running_mean = graph_1_running_var = graph_1_num_batches_tracked = getitem_3 = getitem_4 = add = apply_mutations = None
    return pytree.tree_unflatten([add_1], self._out_spec)""",
        )
        actual, expected = program(x), eager(x)
        assert_same_tree(actual, expected)
        self.assertEqual(list(program.state_dict()), list(eager.state_dict()))
        assert_same_tree(program.state_dict(), eager.state_dict())  # the running stats written back
        actual.sum().backward(), expected.sum().backward()
        for (name, p), e in zip(program.named_parameters(), eager.parameters()):
            assert_same_tree(p.grad, e.grad)
        self.assertIsInstance(program.graph, fx.Graph)  # the module's own attributes stay its own
        self.assertIsInstance(program.meta, dict)
        self.assertIs(program._modules["code"].weight, model.code.weight)  # the model's own tensors
        copied = copy.deepcopy(program)
        assert_same_tree(copied(x), copy.deepcopy(eager)(x))
        buffer = io.BytesIO()
        predispatch.save(ep, buffer)
        loaded = predispatch.load(io.BytesIO(buffer.getvalue())).module()
        self.assertEqual(list(loaded.state_dict()), list(eager.state_dict()))
        assert_same_tree(loaded(x), program(x))

    def test_function_export_of_a_module_named_code(self):
        code = nn.Linear(3, 3)  # a function export's reached module, named by its variable

        def run(x):
            return code(x) * 2

        x = torch.randn(2, 3)
        program = predispatch.export(run, (x,)).module()  # was KeyError: "attribute 'code' already exists"
        assert_same_tree(program(x), run(x))
        self.assertEqual(list(program.state_dict()), ["code.weight", "code.bias"])
        self.assertIsInstance(program.code, str)

    def test_graph_constants_are_not_state(self):
        """A tensor the forward creates is read by the graph but is neither state nor a buffer."""
        module = NoGradRegion()
        program = predispatch.export(module, (torch.randn(3, 4),)).module()
        self.assertEqual(list(program.state_dict()), list(module.state_dict()))
        self.assertEqual([name for name, _ in program.named_buffers()], [])

    def test_deepcopy_keeps_kinds_of_state_and_runs(self):
        module = ConvBn()
        module.register_buffer("scratch", torch.ones(1), persistent=False)
        x = torch.randn(2, 3, 8, 8)
        program = predispatch.export(module, (x,)).module()
        copied = copy.deepcopy(program)
        self.assertEqual(list(copied.state_dict()), list(module.state_dict()))
        self.assertIsNot(copied.conv.weight, program.conv.weight)
        assert_same_tree(copied(x), program(x))
        assert_same_tree(copied.state_dict(), program.state_dict())


class Dropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.lin(x))


class SharesState(TestCase):
    """Note [module() shares the program's state] in predispatch/runtime/unlift.py."""

    def test_module_holds_the_models_own_tensors(self):
        module = ConvBn()
        program = predispatch.export(module, (torch.randn(2, 3, 8, 8),)).module()
        own = module.state_dict(keep_vars=True)
        held = program.state_dict(keep_vars=True)
        self.assertEqual(list(held), list(own))
        for name, tensor in own.items():
            self.assertIs(held[name], tensor, name)
        self.assertEqual([n for n, _ in program.named_parameters()], [n for n, _ in module.named_parameters()])

    def test_running_the_program_trains_the_model_as_eager_would(self):
        """One train step through the program and one through a copy of the model: the model's
        own parameters get eager's gradients and its buffers eager's updates, bitwise."""
        torch.manual_seed(0)
        module, x = ConvBn(), torch.randn(2, 3, 8, 8)
        eager = copy.deepcopy(module)
        program = predispatch.export(module, (x,)).module()
        assert_same_tree(program(x), eager(x))
        program(x).sum().backward()
        eager(x).sum().backward()
        assert_same_tree(module.state_dict(), eager.state_dict())
        for (name, p), (_, e) in zip(module.named_parameters(), eager.named_parameters()):
            assert_same_tree(p.grad, e.grad)

    def test_state_is_read_at_each_call(self):
        """The call's checks cache the contract, not the state (Note [What a call caches]): a
        buffer replaced after a first call is the one checked and written."""

        from test_calls import Counts

        program = predispatch.export(Counts(), (torch.zeros(3),)).module()
        program(torch.zeros(3))
        program.c = torch.zeros(1).expand(3)  # eager's add_ would refuse this buffer
        with pytest.raises(predispatch.errors.MutationTargetError, match="more than one of its elements"):
            program(torch.zeros(3))
        program.c = fresh = torch.full((3,), 5.0)
        assert torch.equal(program(torch.zeros(3)), torch.full((3,), 6.0)) and torch.equal(fresh, torch.full((3,), 6.0))

    def test_saved_buffer_written_back_small_and_large(self):
        """Batch norm's running stats: the graph reads them, autograd saves them, the write-back
        then changes them.  Backward must see the values read, whether a buffer is cloned as it is
        read (small) or when autograd saves it (large: more than 64 KiB); outputs, gradients and
        buffers equal eager's bitwise (Note [Saved inputs that are written back])."""
        for n in (4, 20_000):
            torch.manual_seed(0)
            module, x = nn.BatchNorm1d(n), torch.randn(2, n)
            eager, program = copy.deepcopy(module), predispatch.export(module, (x,)).module()
            xe, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            (eager(xe) * x).sum().backward()
            (program(xp) * x).sum().backward()
            assert_same_tree(xp.grad, xe.grad)
            assert_same_tree(module.weight.grad, eager.weight.grad)
            assert_same_tree(module.state_dict(), eager.state_dict())


class Copies(TestCase):
    """`ep.module()` keeps its contract across copies, or refuses to be copied (issue 21.10)."""

    def test_pickle_and_shallow_copy_are_refused(self):
        program = predispatch.export(Dropout(), (torch.randn(2, 4),)).module()
        with pytest.raises(ModuleCopyError) as info:
            pickle.dumps(program)
        self.assertExpectedInline(stable_message(info.value), """\
ep.module() cannot be pickled or shallow-copied: fx rebuilds a pickled GraphModule from its code alone, without the input checks, the write-back checks and the train/eval guard.
  at test_program_module.py:N (pickle.dumps(program))
  fix: copy.deepcopy(m) for a copy in this process; predispatch.save(ep, path) and predispatch.load(path).module() to store it; m.state_dict() for its weights.
  see docs/errors.md#modulecopyerror""")
        with pytest.raises(ModuleCopyError):
            copy.copy(program)
        with pytest.raises(ModuleCopyError):
            torch.save(program, io.BytesIO())
        with pytest.raises(ModuleCopyError):
            pickle.dumps(predispatch.export_train_eval(Dropout(), (torch.randn(2, 4),)).module())

    def test_deepcopy_of_both_modes_switches_over_its_own_state(self):
        torch.manual_seed(0)
        module, x = Dropout(), torch.randn(2, 4)
        both = predispatch.export_train_eval(module, (x,)).module()
        copied = copy.deepcopy(both).eval()
        assert_same_tree(copied(x), copy.deepcopy(module).eval()(x))
        self.assertIsNot(copied.lin.weight, module.lin.weight)
        with torch.no_grad():
            copied.lin.weight.zero_()
        assert_same_tree(copied(x), copied.lin.bias.expand(2, 4))  # the eval program reads the copy's state
        self.assertFalse(torch.equal(module.lin.weight, torch.zeros(4, 4)))

    def test_deepcopy_keeps_the_checks_and_the_mode_guard(self):
        torch.manual_seed(0)
        module, x = Dropout(), torch.randn(2, 4)
        copied = copy.deepcopy(predispatch.export(module, (x,)).module())
        with pytest.raises(ModeSwitchError):
            copied.eval()
        with pytest.raises(InputMismatchError):
            copied(torch.randn(3, 5))
        eager = copy.deepcopy(module)
        torch.manual_seed(1)
        expected = eager(x)
        torch.manual_seed(1)
        assert_same_tree(copied(x), expected)  # dropout still on, as exported
        self.assertIsNot(copied.lin.weight, module.lin.weight)


class TrainEvalGraph(TestCase):
    """`export_train_eval(...).module()` is an fx.GraphModule: its graph calls the program of the
    current mode, and graph tools (fx.Interpreter, dead-code elimination) run it."""

    def test_graph_calls_the_program_of_the_mode(self):
        torch.manual_seed(0)
        module, x = ConvBn(), torch.randn(2, 3, 6, 6)
        both = predispatch.export_train_eval(module, (x,)).module()
        self.assertIsInstance(both, torch.fx.GraphModule)
        self.assertExpectedInline(both.code.strip(), """\
def forward(self, x):
    train_program = self.train_program(x);  x = None
    return train_program""")
        eager = copy.deepcopy(module)
        assert_same_tree(torch.fx.Interpreter(both).run(x), eager(x))  # batch statistics, updated
        assert_same_tree(dict(both.named_buffers()), dict(eager.named_buffers()))
        both.eval()
        eager.eval()
        both.graph.eliminate_dead_code()
        both.recompile()
        self.assertIn("self.eval_program(x)", both.code)
        assert_same_tree(torch.fx.Interpreter(both).run(x), eager(x))
        assert_same_tree(both(x), eager(x))
        self.assertEqual(list(both.state_dict()), list(module.state_dict()))


class Conversions(TestCase):
    """`.to(dtype)` / `.to(device)` of `ep.module()` are refused before converting (issue 21.11)."""

    def test_to_float64_is_refused_and_converts_nothing(self):
        module, x = Mlp(), torch.randn(3, 8)
        program = predispatch.export(module, (x,)).module()
        with pytest.raises(ModuleConversionError) as info:
            program.to(torch.float64)
        self.assertExpectedInline(stable_message(info.value), """\
converting the program module's torch.float32 state on cpu to torch.float64 on cpu is refused: its graph and input checks are traced for the exported dtypes and devices, and it shares the exported model's tensors; nothing was converted.
  at test_program_module.py:N (program.to(torch.float64))
  fix: convert the model and export again: predispatch.export(model.to(torch.float64), args) (for a device, with the model and the inputs on it).
  see docs/errors.md#moduleconversionerror""")
        for convert in (lambda m: m.double(), lambda m: m.half(), lambda m: m.to(torch.device("meta"))):
            with pytest.raises(ModuleConversionError):
                convert(program)
        self.assertEqual({p.dtype for p in (*program.parameters(), *module.parameters())}, {torch.float32})
        assert_same_tree(program.float().to("cpu")(x), module(x))  # changing nothing is allowed
        both = predispatch.export_train_eval(Mlp(), (x,)).module()
        with pytest.raises(ModuleConversionError):
            both.double()

    def test_a_meta_models_state_may_be_materialized(self):
        """A model built on the meta device is traced as if its weights were real; its program's
        `to_empty(device=...)` then `load_state_dict` is how weights arrive (the models suite's
        Llama and ViT do it), not a conversion of traced dtypes or devices."""
        torch.manual_seed(0)
        eager = Mlp()
        with torch.device("meta"):
            meta = Mlp()
        x = torch.randn(3, 8)
        program = predispatch.export(meta, (x,)).module()
        program.to_empty(device="cpu")
        program.load_state_dict(eager.state_dict())
        assert_same_tree(program(x), eager(x))
        with pytest.raises(ModuleConversionError):
            program.to(torch.float64)  # real state now: converting it is refused as before


def _compiled(module):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    return torch.compile(module, backend=counter, fullgraph=True), counter


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_compile_fullgraph_one_frame_no_breaks(case):
    """One frame, no graph break; outputs, gradients (parameters and inputs) and state equal eager."""
    torch.manual_seed(0)
    make_module, make_args = CASES[case]
    module, args = make_module(), make_args()
    eager = copy.deepcopy(module)
    program = predispatch.export(module, args).module()
    assert torch._dynamo.explain(copy.deepcopy(program))(*args).graph_break_count == 0
    torch._dynamo.reset()
    compiled, counter = _compiled(program)
    got, want = _run(compiled, args), _run(eager, args)
    assert counter.frame_count == 1
    for g, w in zip(got, want):
        _close(g, w)


def _close(got, want):
    """Same structure; tensors equal up to compiled kernels' rounding."""
    assert_same_tree(got, want, exact=False)


def test_straight_through_compiled_uses_the_custom_backward():
    """Autograd through round() gives 0; the compiled program gives the custom backward's gradient."""
    x = torch.tensor([[0.3, 0.6, -0.2, 1.4]])
    module = Quantized()
    program, eager = predispatch.export(module, (x,)).module(), copy.deepcopy(module)
    compiled, counter = _compiled(program)
    grad = _run(compiled, (x,))[1][0]
    assert counter.frame_count == 1
    assert grad.abs().sum() > 0
    torch.testing.assert_close(grad, _run(eager, (x,))[1][0])


def test_compiled_batch_norm_updates_running_stats_like_eager():
    torch.manual_seed(0)
    module, x = ConvBn(), torch.randn(2, 3, 8, 8)
    eager = copy.deepcopy(module)
    compiled, counter = _compiled(predispatch.export(module, (x,)).module())
    for _ in range(3):
        _close(compiled(x), eager(x))
    assert counter.frame_count == 1
    state = compiled._orig_mod.state_dict()
    _close(state, eager.state_dict())
    assert state["bn.num_batches_tracked"].item() == 3


def test_function_export_compiles_reading_the_live_modules():
    """A function export's module reads the function's own modules; compiled, it still does."""
    encoder = nn.Linear(4, 4)

    def fn(x, scale=2.0):
        return StraightThrough.apply(encoder(x) * scale)

    x = torch.randn(3, 4)
    compiled, counter = _compiled(predispatch.export(fn, (x,)).module())
    got = _run(compiled, (x,))[1][0]
    encoder.weight.grad = None
    want = _run(lambda t: fn(t), (x,))
    torch.testing.assert_close(got, want[1][0])
    assert counter.frame_count == 1
    with torch.no_grad():
        encoder.weight.zero_()  # read at each call, as the function reads it
    torch.testing.assert_close(compiled(x), fn(x))


def test_dynamic_program_compiles_once_for_every_size():
    module, x = Mlp(), torch.randn(3, 8)
    program = predispatch.export(module, (x,), dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2, max=16)}}).module()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(program, backend=counter, fullgraph=True, dynamic=True)
    for n in (3, 5, 9):
        batch = torch.randn(n, 8)
        torch.testing.assert_close(compiled(batch), module(batch))
    assert counter.frame_count == 1  # one symbolic compilation serves every size
    with pytest.raises(DynamicShapeError):
        program(torch.randn(17, 8))  # eagerly, the exported range is still enforced


@pytest.mark.slow  # inductor compiles C++ (~15 s)
def test_inductor_training_step_keeps_the_custom_backward():
    torch.manual_seed(0)
    module, x = Quantized(), torch.randn(3, 4)
    eager = copy.deepcopy(module)
    compiled = torch.compile(predispatch.export(module, (x,)).module(), fullgraph=True)
    for g, w in zip(_run(compiled, (x,)), _run(eager, (x,))):
        _close(g, w)


# --- torchao PT2E ------------------------------------------------------------------------------


def _x86_quantizer():
    x86 = pytest.importorskip("torchao.quantization.pt2e.quantizer.x86_inductor_quantizer", reason="needs torchao (the consumers extra)")
    return x86.X86InductorQuantizer().set_global(x86.get_default_x86_inductor_quantization_config())


def _xnnpack_quantizer():
    xnn = pytest.importorskip("executorch.backends.xnnpack.quantizer.xnnpack_quantizer", reason="needs executorch (the consumers extra)")
    return xnn.XNNPACKQuantizer().set_global(xnn.get_symmetric_quantization_config())


#: The PT2E quantizers tried: torchao's X86 one, and ExecuTorch's XNNPACK one.
QUANTIZERS = {"x86": _x86_quantizer, "xnnpack": _xnnpack_quantizer}


@pytest.mark.consumers  # torchao and executorch: the consumers extra
@pytest.mark.parametrize(
    ("case", "quantizer"),
    [
        *((case, "x86") for case in ("mlp", "conv_bn_eval", "transformer_block")),
        ("mlp", "xnnpack"),
        # XNNPACK's annotators export their patterns at each prepare (~15 s a case)
        *(pytest.param(case, "xnnpack", marks=pytest.mark.slow) for case in ("conv_bn_eval", "transformer_block")),
    ],
)
def test_pt2e_prepare_calibrate_convert_run(case, quantizer):
    """prepare_pt2e takes ep.module() as it takes torch.export's: the quantized program runs close
    to eager, and as torch.export's route quantizes the same model with the same calibration."""
    make_quantizer = QUANTIZERS[quantizer]
    pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e", reason="needs torchao (the consumers extra)")

    torch.manual_seed(0)
    make_module, make_args = CASES[case]
    module, args = make_module().eval(), make_args()
    calibration = [args, *(make_args() for _ in range(3))]
    routes = {
        "predispatch": predispatch.export(module, args).module(),
        "torch.export": torch.export.export(copy.deepcopy(module), args).module(),
    }
    outputs = {}
    for route, program in routes.items():
        prepared = pt2e.prepare_pt2e(program, make_quantizer())
        for batch in calibration:
            prepared(*batch)
        quantized = pt2e.convert_pt2e(prepared)
        assert any("quantize_per_tensor" in str(n.target) for n in quantized.graph.nodes), route
        with torch.no_grad():
            outputs[route] = quantized(*args)
    with torch.no_grad():
        want = module(*args)
    assert (outputs["predispatch"] - want).abs().max() <= 0.05 * want.abs().max()
    torch.testing.assert_close(outputs["predispatch"], outputs["torch.export"])
