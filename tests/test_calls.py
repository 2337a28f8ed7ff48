"""`ep.module()` behaves as eager, all or nothing: write-back checks, input metadata mutations, train/eval."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from expecttest import TestCase
from helpers import check_gradients, export_and_check, graph, stable_message
from torch import nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch import errors
from predispatch._isolation import GlobalState
from predispatch.passes import mutable_ops
from predispatch.program import OutputKind


class BufferAndInput(nn.Module):
    """Mutates a buffer and an input: a failing call must write neither."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(3))

    def forward(self, x):
        self.steps.add_(1)
        x.add_(torch.rand(3))  # draws: a refused call must leave the RNG as it was
        return x * 2


class EmaParameter(nn.Module):
    """A parameter updated under no_grad (an EMA): eager allows it on a leaf that requires grad."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(0.5)
        return x * self.w


class Counts(nn.Module):
    """Counts its calls in a buffer and adds the count: `m(m.c)` passes the buffer it writes."""

    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.zeros(3))

    def forward(self, x):
        self.c.add_(1)
        return x + self.c


class MutatesTwo(nn.Module):
    def forward(self, x, y):
        x.mul_(2)
        return x + y


def _outcome(fn):
    """(exception type, first line) of `fn()`, or None when it returns."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares what eager and the program raise
        return type(exc), str(exc).splitlines()[0]
    return None


class WriteTargets(TestCase):
    """Note [All or nothing calls] in predispatch/runtime/writes.py."""

    def _refused(self, module, make_args):
        """Eager raises; the program raises MutationTargetError before writing or drawing anything."""
        program = predispatch.export(module, make_args()).module()
        eager_args = make_args()
        assert _outcome(lambda: copy.deepcopy(module)(*eager_args)) is not None  # eager refuses too
        args = make_args()
        before_args = [a.detach().clone() for a in args]
        before_state = {k: v.clone() for k, v in program.state_dict().items()}
        globals_before, rng_before = GlobalState.capture(), torch.get_rng_state()
        with pytest.raises(errors.MutationTargetError) as info:
            program(*args)
        for a, b in zip(args, before_args):
            assert torch.equal(a, b)
        for k, v in program.state_dict().items():
            assert torch.equal(v, before_state[k]), k
        globals_after = GlobalState.capture()
        assert torch.equal(rng_before, torch.get_rng_state())
        assert globals_before.grad_enabled == globals_after.grad_enabled
        return stable_message(info.value)

    def test_expanded_input_writes_nothing(self):
        message = self._refused(BufferAndInput(), lambda: (torch.zeros(3).expand(2, 3),))
        self.assertExpectedInline(message, """\
the program changes input 'x' in place, and more than one of its elements refers to the same memory (an expanded tensor), so eager would raise too ('more than one element of the written-to tensor refers to a single memory location'); nothing was run or written.
  at test_calls.py:N (program(*args))
  fix: pass a tensor with its own memory: x.clone() (or x.contiguous()) instead of x.expand(...).
  see docs/errors.md#mutationtargeterror""")

    def test_leaf_that_requires_grad(self):
        message = self._refused(BufferAndInput(), lambda: (torch.zeros(2, 3, requires_grad=True),))
        self.assertExpectedInline(message, """\
the program changes input 'x' in place, and it is a leaf tensor that requires grad (or a view of one) written with grad mode on, so eager would raise ('a leaf Variable that requires grad is being used in an in-place operation'); nothing was run or written.
  at test_calls.py:N (program(*args))
  fix: pass a tensor that is not a leaf requiring grad (x.clone()), or call under torch.no_grad(); a write through x.data or x.detach() in forward cannot be told apart here: make it under torch.no_grad() instead.
  see docs/errors.md#mutationtargeterror""")

    def test_view_of_a_leaf_that_requires_grad(self):
        self._refused(BufferAndInput(), lambda: (torch.zeros(4, 3, requires_grad=True)[:2],))

    def test_leaf_under_no_grad_is_written_as_eager_writes_it(self):
        module = BufferAndInput()
        program = predispatch.export(module, (torch.zeros(2, 3),)).module()
        eager_x, program_x = torch.zeros(2, 3, requires_grad=True), torch.zeros(2, 3, requires_grad=True)
        with torch.no_grad():
            torch.manual_seed(0)
            expected = module(eager_x)
            torch.manual_seed(0)
            actual = program(program_x)
        assert torch.equal(actual, expected) and torch.equal(program_x, eager_x)
        assert torch.equal(program.steps, module.steps)

    def test_inference_tensor(self):
        def make():
            with torch.inference_mode():
                return (torch.zeros(2, 3),)

        message = self._refused(BufferAndInput(), make)
        self.assertExpectedInline(message, """\
the program changes input 'x' in place, and it is an inference tensor, which eager may change in place only inside torch.inference_mode() ('Inplace update to inference tensor outside InferenceMode'); nothing was run or written.
  at test_calls.py:N (program(*args))
  fix: call inside torch.inference_mode(), or pass x.clone() made outside it.
  see docs/errors.md#mutationtargeterror""")

    def test_inference_tensor_inside_inference_mode(self):
        module = BufferAndInput()
        program = predispatch.export(module, (torch.zeros(2, 3),)).module()
        with torch.inference_mode():
            eager_x, program_x = torch.zeros(2, 3), torch.zeros(2, 3)
            torch.manual_seed(0)
            expected = module(eager_x)
            torch.manual_seed(0)
            actual = program(program_x)
        assert torch.equal(actual, expected) and torch.equal(program_x, eager_x)

    def test_input_sharing_memory_with_another_input(self):
        """Eager's `x.mul_(2)` shows through `y`, a view of `x`; the program's inputs are independent."""
        base = torch.ones(3)
        eager_out = MutatesTwo()(base, base[:])
        assert torch.equal(eager_out, torch.full((3,), 4.0))  # eager: y sees x's change
        program = predispatch.export(MutatesTwo(), (torch.ones(3), torch.ones(3))).module()
        shared = torch.ones(3)
        with pytest.raises(errors.MutationTargetError) as info:
            program(shared, shared[:])
        assert torch.equal(shared, torch.ones(3))
        self.assertExpectedInline(stable_message(info.value), """\
the program changes input 'x' in place, and it shares memory with another input of the call; eager's change would show through that alias, the program's inputs are independent values; nothing was run or written.
  at test_calls.py:N (program(shared, shared[:]))
  fix: pass tensors that do not share memory (x.clone() at one place).
  see docs/errors.md#mutationtargeterror""")

    def test_same_tensor_passed_twice(self):
        """`m(t, t)`: eager's `x.mul_(2)` shows through `y`, the same tensor; the overlap check
        counts positions, not objects, so the program refuses instead of returning 3s."""
        eager_t = torch.ones(3)
        assert torch.equal(MutatesTwo()(eager_t, eager_t), torch.full((3,), 4.0))
        program = predispatch.export(MutatesTwo(), (torch.ones(3), torch.ones(3))).module()
        t = torch.ones(3)
        with pytest.raises(errors.MutationTargetError) as info:
            program(t, t)
        assert torch.equal(t, torch.ones(3))
        self.assertExpectedInline(stable_message(info.value), """\
the program changes input 'x' in place, and the same tensor is also another input of the call (passed twice, or the module's own state passed in); eager's change would show through the other use, the program's inputs are independent values; nothing was run or written.
  at test_calls.py:N (program(t, t))
  fix: pass a copy at one place (x.clone(); for the module's state, m.c.clone()).
  see docs/errors.md#mutationtargeterror""")
        assert torch.equal(program(t, t.clone()), MutatesTwo()(torch.ones(3), torch.ones(3)))

    def test_the_mutated_buffer_passed_in(self):
        """`m(m.c)` (the program module's buffer, which is also the model's own: Note [module()
        shares the program's state]): eager's `self.c.add_(1)` shows through `x`; refused,
        nothing written.  A copy of the buffer runs as eager does."""

        eager = Counts()
        assert torch.equal(eager(eager.c), torch.full((3,), 2.0))  # x sees the update (the program would give 1s)
        model = Counts()
        program = predispatch.export(model, (torch.zeros(3),)).module()
        for passed in (program.c, model.c):
            with pytest.raises(errors.MutationTargetError, match="the same tensor is also another input"):
                program(passed)
            assert torch.equal(model.c, torch.zeros(3))
        assert torch.equal(program(model.c.clone()), Counts()(torch.zeros(3)))
        assert torch.equal(model.c, torch.ones(3))

    def test_several_views_of_one_op(self):
        """Inputs that are outputs of one multi-output view op (`unbind`) of a tensor that requires
        grad: eager refuses the first in-place change; the program refuses before writing any."""

        def make():
            base = torch.randn(2, 3, requires_grad=True).clone()
            return (torch.zeros(3), *base.unbind(0))

        class WritesThree(nn.Module):
            def forward(self, x, a, b):
                x.add_(1)
                a.mul_(2)
                b.mul_(2)
                return x + a + b

        message = self._refused(WritesThree(), make)
        self.assertExpectedInline(message, """\
the program changes input 'a' in place, and it is one of several views one op returned (unbind, split, chunk), which eager may not change in place with grad mode on ('This view is the output of a function that returns multiple views'); nothing was run or written.
  at test_calls.py:N (program(*args))
  fix: pass x.clone() (a tensor of its own) instead of the view, or call under torch.no_grad().
  see docs/errors.md#mutationtargeterror""")

    def test_view_getting_a_value_that_requires_grad(self):
        """The view itself needs no grad, the value written into it does (`b.add_(self.w)`): only
        the graph's values tell, so the write-back checks them all before the first write."""

        class AddsWeight(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))

            def forward(self, x, b):
                x.add_(1)
                b.add_(self.w)
                return x + b

        def make():
            return (torch.zeros(3), *torch.zeros(2, 3).unbind(0)[:1])

        assert _outcome(lambda: AddsWeight()(*make())) is not None  # eager refuses
        program = predispatch.export(AddsWeight(), make()).module()
        x, b = make()
        with pytest.raises(errors.MutationTargetError, match="with a value that requires grad, and it is one of several views"):
            program(x, b)
        assert torch.equal(x, torch.zeros(3)) and torch.equal(b, torch.zeros(3))
        with torch.no_grad():
            assert torch.equal(program(x, b), AddsWeight()(*make()))

    def test_ema_of_a_parameter_under_no_grad_still_runs(self):
        """A parameter is a leaf that requires grad; written under no_grad, eager allows it."""
        ep = export_and_check(EmaParameter(), (torch.randn(3),))
        assert [s.kind for s in ep.signature.mutations] == [OutputKind.PARAMETER_MUTATION]
        check_gradients(EmaParameter(), (torch.randn(3),))

    def test_write_through_data_runs_as_eager(self):
        """Eager allows `self.w.data.mul_(...)`, and later uses differentiate as if it were not
        there: the write is kept behind autograd (Note [Writes through a detached alias]), so the
        call runs (it was refused before) with eager's values and gradients."""

        class DataEma(EmaParameter):
            def forward(self, x):
                self.w.data.mul_(0.5)
                return x * self.w

        export_and_check(DataEma(), (torch.randn(3),))
        check_gradients(DataEma(), (torch.randn(3),))


class Transposes(nn.Module):
    def forward(self, x):
        x.t_()
        return x * 2


class MetadataAndData(nn.Module):
    def forward(self, x, y):
        x.unsqueeze_(0).add_(1)
        y.resize_(1, 4)  # same size: torch 2.15's functionalization refuses growing an input (test below)
        y.fill_(3)
        return x.sum() + y.sum()


class ReadsAfterTranspose(nn.Module):
    def forward(self, x):
        x.transpose_(0, 1)
        return x @ torch.ones(2, 1)


def _check_metadata_like_eager(module, make_args):
    """Output and every input's shape, strides, storage offset and values equal eager's."""
    ep = predispatch.export(module, make_args())
    assert mutable_ops(ep.graph_module) == []
    eager_args, program_args = make_args(), make_args()
    expected = copy.deepcopy(module)(*eager_args)
    actual = ep.module()(*program_args)
    assert torch.equal(actual, expected)
    for a, e in zip(program_args, eager_args):
        assert (a.shape, a.stride(), a.storage_offset()) == (e.shape, e.stride(), e.storage_offset())
        assert torch.equal(a, e)
    return ep


class InputMetadataMutations(TestCase):
    def test_transpose_in_place(self):
        ep = _check_metadata_like_eager(Transposes(), lambda: (torch.arange(6.0).view(2, 3),))
        self.assertExpectedInline(str(ep), """\
ExportedProgram:
    class GraphModule(torch.nn.Module):
        def forward(self, x: "f32[2, 3]"):
            t: "f32[3, 2]" = torch.ops.aten.t.default(x);  x = None
            mul: "f32[3, 2]" = torch.ops.aten.mul.Tensor(t, 2)
            return (t, mul)

Graph signature:
    Inputs:
        x: USER_INPUT target='x'
    Outputs:
        t: USER_INPUT_METADATA_MUTATION target='x'
        mul: USER_OUTPUT target='output'""")

    def test_metadata_and_data(self):
        ep = _check_metadata_like_eager(MetadataAndData(), lambda: (torch.arange(6.0).view(2, 3), torch.ones(2, 2)))
        kinds = [s.kind for s in ep.signature.mutations]
        assert kinds == [OutputKind.USER_INPUT_METADATA_MUTATION] * 2

    def test_growing_an_input_in_place(self):
        """`y.resize_(4, 4)` of a 2x2 input: exported on torch <= 2.14; torch 2.15's
        functionalization refuses it, and export says so in our words, changing nothing."""

        class Grows(nn.Module):
            def forward(self, y):
                y.resize_(4, 4)
                return y.fill_(3).sum()

        if ti.TORCH < (2, 15):
            _check_metadata_like_eager(Grows(), lambda: (torch.ones(2, 2),))
            return
        y = torch.ones(2, 2)
        with pytest.raises(errors.TraceError, match="Attempted to resize a view tensor to a larger size"):
            predispatch.export(Grows(), (y,))
        assert torch.equal(y, torch.ones(2, 2))

    def test_gradients_through_the_new_view(self):
        module = ReadsAfterTranspose()
        ep = predispatch.export(module, (torch.randn(2, 3),))
        base_e, base_p = torch.randn(2, 3, requires_grad=True), None
        base_p = base_e.detach().clone().requires_grad_()
        x_e, x_p = base_e * 1, base_p * 1  # not leaves: eager may change their metadata in place
        module(x_e).sum().backward()
        ep.module()(x_p).sum().backward()
        assert torch.equal(base_p.grad, base_e.grad)
        assert (x_p.shape, x_p.stride()) == (x_e.shape, x_e.stride())

    def test_re_export_of_the_program(self):
        """The program module's `as_strided_`/`resize_` write-backs trace as metadata mutations."""
        ep = predispatch.export(MetadataAndData(), (torch.randn(2, 3), torch.ones(2, 2)))
        again = predispatch.export(ep.module(), (torch.randn(2, 3), torch.ones(2, 2)))
        assert mutable_ops(again.graph_module) == []
        eager_args = (torch.arange(6.0).view(2, 3), torch.ones(2, 2))
        program_args = (torch.arange(6.0).view(2, 3), torch.ones(2, 2))
        assert torch.equal(again.module()(*program_args), MetadataAndData()(*eager_args))
        for a, e in zip(program_args, eager_args):
            assert (a.shape, a.stride()) == (e.shape, e.stride()) and torch.equal(a, e)

    def test_round_trips_through_save(self):
        ep = predispatch.export(Transposes(), (torch.randn(2, 3),))
        buffer = io.BytesIO()
        predispatch.save(ep, buffer)
        buffer.seek(0)
        loaded = predispatch.load(buffer)
        assert loaded.signature == ep.signature
        x_e, x_p = torch.randn(2, 3), None
        x_p = x_e.clone()
        assert torch.equal(loaded.module()(x_p), Transposes()(x_e))
        assert (x_p.shape, x_p.stride()) == (x_e.shape, x_e.stride())

    def test_to_torch_refuses(self):
        ep = predispatch.export(Transposes(), (torch.randn(2, 3),))
        with pytest.raises(errors.NotRepresentableError) as info:
            ep.to_torch()
        self.assertExpectedInline(stable_message(info.value), """\
torch.export.ExportedProgram cannot hold this program:
    output t changes the shape or strides of input 'x' in place: torch's signature has no output kind for a metadata mutation
  fix: keep using the predispatch program (ep.module(), predispatch.save, which holds all of it), use ep.to_torch(for_inference=True) for a consumer that only runs forward, or change the model so the named construct goes away; docs/format.md#torch-interop lists what converts.
  see docs/errors.md#notrepresentableerror""")

    def test_storage_swap_is_refused(self):
        class Swaps(nn.Module):
            def forward(self, x, y):
                x.set_(y)
                return x + 1

        with pytest.raises(errors.TraceError) as info:
            predispatch.export(Swaps(), (torch.randn(3), torch.randn(3)))
        self.assertExpectedInline(stable_message(info.value), """\
forward changes the shape, strides or storage of input 'x' in place (x.t_(), x.resize_(), x.set_(...)); a functional graph cannot hand that change back to a parameter or buffer, nor a storage swap to any input.
  at test_calls.py:N (x.set_(y))
  fix: write it out of place (x = x.t()) and return the new tensor.
  see docs/errors.md#traceerror""")

    def test_polygamma_in_place(self):
        class Polygamma(nn.Module):
            def forward(self, x):
                return x.polygamma_(1)

        ep = export_and_check(Polygamma(), (torch.rand(3) + 0.5,))
        self.assertExpectedInline(graph(ep), """\
class GraphModule(torch.nn.Module):
    def forward(self, x: "f32[3]"):
        polygamma: "f32[3]" = torch.ops.aten.polygamma.default(1, x);  x = None
        return (polygamma, polygamma)""")


class Dropper(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.drop(self.lin(x)))


class TrainEval(TestCase):
    """Note [One mode per program] in predispatch/runtime/modes.py."""

    def _in_mode(self, training: bool):
        torch.manual_seed(0)
        model = Dropper().train(training)
        return model, predispatch.export(model, (torch.randn(8, 4),))

    def test_each_mode_matches_eager(self):
        for training in (True, False):
            model, ep = self._in_mode(training)
            program = ep.module()
            assert program.training is training
            x = torch.randn(8, 4)
            torch.manual_seed(1)
            expected = copy.deepcopy(model)(x)
            torch.manual_seed(1)
            actual = program(x)
            assert torch.equal(actual, expected)
            program.train(training)  # the exported mode: allowed, changes nothing
            assert program.training is training

    def test_eval_of_a_train_program_is_refused(self):
        _, ep = self._in_mode(True)
        program = ep.module()
        with pytest.raises(errors.ModeSwitchError) as info:
            program.eval()
        assert program.training is True and all(m.training for m in program.modules())
        self.assertExpectedInline(stable_message(info.value), """\
the program was exported with the module in train mode, and its graph is traced in that mode (dropout, batch norm); .eval() cannot change a traced graph, so it is refused.
  at test_calls.py:N (program.eval())
  fix: export a program for eval mode (model.eval(); ep_eval = predispatch.export(model, args)), or export both modes at once: predispatch.export_train_eval(model, args).module() switches with .train()/.eval().
  see docs/errors.md#modeswitcherror""")

    def test_train_of_an_eval_program_is_refused(self):
        _, ep = self._in_mode(False)
        with pytest.raises(errors.ModeSwitchError) as info:
            ep.module().train()
        assert "exported with the module in eval mode" in str(info.value)

    def test_mixed_modes(self):
        model = Dropper().train()
        model.bn.eval()
        program = predispatch.export(model, (torch.randn(8, 4),)).module()
        assert program.training and not program.bn.training
        with pytest.raises(errors.ModeSwitchError) as info:
            program.train()
        self.assertExpectedInline(str(info.value).splitlines()[0], """\
the program was exported with bn in eval mode, and its graph is traced in that mode (dropout, batch norm); .train() cannot change a traced graph, so it is refused.""")

    def test_mode_survives_save(self):
        _, ep = self._in_mode(False)
        buffer = io.BytesIO()
        predispatch.save(ep, buffer)
        buffer.seek(0)
        program = predispatch.load(buffer).module()
        assert program.training is False
        with pytest.raises(errors.ModeSwitchError):
            program.train()


class BothModes(TestCase):
    """`predispatch.export_train_eval`: one export per mode, one module switching between them."""

    def _eager_and_program(self):
        torch.manual_seed(0)
        model = Dropper().eval()
        flags_before = [m.training for m in model.modules()]
        state_before = {k: v.clone() for k, v in model.state_dict().items()}
        programs = predispatch.export_train_eval(model, (torch.randn(8, 4),))
        assert [m.training for m in model.modules()] == flags_before  # put back
        for k, v in model.state_dict().items():
            assert torch.equal(v, state_before[k]), k
        return copy.deepcopy(model), programs.module(), programs

    def _step(self, eager, program, x, seed):
        """Outputs, parameter gradients and buffers after one call equal eager's."""
        for module in (eager, program):
            module.zero_grad()
        torch.manual_seed(seed)
        expected = eager(x)
        torch.manual_seed(seed)
        actual = program(x)
        assert torch.equal(actual, expected)
        expected.sum().backward()
        actual.sum().backward()
        for (name, e), (_, p) in zip(eager.named_parameters(), program.named_parameters()):
            assert torch.equal(p.grad, e.grad), name
        for (name, e), (_, p) in zip(eager.state_dict().items(), program.state_dict().items()):
            assert torch.equal(p, e), name

    def test_switches_like_eager(self):
        eager, program, programs = self._eager_and_program()
        assert program.training is False and list(program.state_dict()) == list(eager.state_dict())
        x = torch.randn(8, 4)
        self._step(eager, program, x, seed=1)  # eval: dropout off, running stats read
        eager.train(), program.train()
        assert program.training is True
        self._step(eager, program, x, seed=2)  # train: dropout on, running stats updated
        self._step(eager, program, x, seed=3)
        eager.eval(), program.eval()
        self._step(eager, program, x, seed=4)  # eval again, with the stats train mode updated
        assert "native_dropout" in str(programs.train_program) and "native_dropout" not in str(programs.eval_program)

    def test_one_set_of_state(self):
        _, program, _ = self._eager_and_program()
        with torch.no_grad():
            program.lin.weight.zero_()
        x = torch.randn(8, 4)
        out = program(x)
        assert torch.equal(out, out[0].expand_as(out))  # the zeroed weight reached the eval program

    def test_only_modules(self):
        with pytest.raises(errors.UnsupportedInputError) as info:
            predispatch.export_train_eval(torch.sin, (torch.randn(2),))
        self.assertExpectedInline(stable_message(info.value), """\
export_train_eval() takes an nn.Module, got builtin_function_or_method.
  at test_calls.py:N (predispatch.export_train_eval(torch.sin, (torch.randn(2),)))
  fix: export a function with predispatch.export; it has no train/eval mode.
  see docs/errors.md#unsupportedinputerror""")

    def test_flags_put_back_when_an_export_fails(self):
        class FailsInEval(Dropper):
            def forward(self, x):
                if not self.training:
                    raise RuntimeError("no eval here")
                return super().forward(x)

        model = FailsInEval().train()
        model.bn.eval()
        flags = [m.training for m in model.modules()]
        state = {k: v.clone() for k, v in model.state_dict().items()}
        x = torch.randn(8, 4)
        globals_before, rng_before = GlobalState.capture(), torch.get_rng_state()
        with pytest.raises(errors.TraceError):
            predispatch.export_train_eval(model, (x,))
        assert [m.training for m in model.modules()] == flags
        for k, v in model.state_dict().items():
            assert torch.equal(v, state[k]), k
        globals_after = GlobalState.capture()
        assert globals_before.grad_enabled == globals_after.grad_enabled
        assert torch.equal(rng_before, torch.get_rng_state())


# --- concurrent calls (Note [Concurrent calls] in predispatch/runtime/runner.py) ----------------


class CountsAndNormalizes(nn.Module):
    """Updates state at each call: a count (one `add_`) and batch norm's running stats."""

    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        self.count.add_(1)
        return self.bn(x)


class WritesNothing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


class CountingLock:
    """A re-entrant lock that counts: acquisitions, the depth now, the deepest nesting seen."""

    made: list[CountingLock] = []

    def __init__(self):
        import threading

        self.lock = threading.RLock()
        self.acquired = self.depth = self.deepest = 0
        CountingLock.made.append(self)

    def __enter__(self):
        self.lock.acquire()
        self.acquired += 1
        self.depth += 1
        self.deepest = max(self.deepest, self.depth)
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        self.lock.release()


@pytest.fixture
def counting_locks(monkeypatch):
    from predispatch.runtime import runner

    CountingLock.made = []
    monkeypatch.setattr(runner, "new_call_lock", CountingLock)  # raises if runner has no such factory
    return CountingLock.made


def _in_threads(call, threads=3, calls=400):
    """`call()` `calls` times in each of `threads` threads, switching threads as often as Python can."""
    import sys
    import threading

    errors_seen = []

    def work():
        try:
            for _ in range(calls):
                call()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors_seen.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # a switch between a call's read and its write-back, if anything lets it
    try:
        workers = [threading.Thread(target=work) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=600)
        assert not any(w.is_alive() for w in workers), "a thread hung"
    finally:
        sys.setswitchinterval(interval)
    assert not errors_seen, errors_seen


def test_threads_keep_every_update_as_eager_does():
    """3 threads x 400 calls: eager keeps all 1200 updates; the program lost most of them before
    (a call read the count, another wrote it back, the first wrote back its stale + 1)."""
    torch.manual_seed(0)
    eager = CountsAndNormalizes()
    model = copy.deepcopy(eager)
    program = predispatch.export(model, (torch.randn(8, 4),)).module()
    x = torch.randn(8, 4)
    _in_threads(lambda: eager(x))
    _in_threads(lambda: program(x))
    assert eager.count.item() == program.count.item() == 1200
    assert eager.bn.num_batches_tracked.item() == program.bn.num_batches_tracked.item() == 1200
    torch.testing.assert_close(program.bn.running_mean, eager.bn.running_mean)
    torch.testing.assert_close(program.bn.running_var, eager.bn.running_var)


def test_only_programs_that_write_are_serialized(counting_locks):
    """A program that writes back takes its lock once per call; one that writes nothing has none,
    and its calls run at once (three threads meet inside their calls, in a hook of the user's)."""
    import threading

    writing = predispatch.export(CountsAndNormalizes(), (torch.randn(8, 4),)).module()
    assert len(counting_locks) == 1
    x = torch.randn(8, 4)
    _in_threads(lambda: writing(x), calls=50)
    assert counting_locks[0].acquired == 150 and counting_locks[0].deepest == 1

    torch.manual_seed(0)
    eager = WritesNothing()
    reading = predispatch.export(copy.deepcopy(eager), (torch.randn(8, 4),)).module()
    assert len(counting_locks) == 1  # no lock made for it
    meet = threading.Barrier(3, timeout=60)  # broken (an error in each thread) if calls were serialized

    def all_inside(module, args):
        meet.wait()

    reading.register_forward_pre_hook(all_inside)
    outputs = []
    _in_threads(lambda: outputs.append(reading(x)), calls=5)
    assert counting_locks[0].acquired == 150
    assert len(outputs) == 15 and all(torch.equal(out, eager(x)) for out in outputs)


def test_lock_released_when_a_call_raises_and_reentrant(counting_locks):
    """A call refused by the pre-hook, one that raises after the graph ran, and one nested in a
    hook of a call of the same module: each leaves the lock free, and another thread can call."""
    import threading

    model = CountsAndNormalizes()
    program = predispatch.export(model, (torch.randn(8, 4),)).module()
    (lock,) = counting_locks
    with pytest.raises(errors.InputMismatchError):
        program(torch.randn(8, 5))  # the pre-hook refuses
    assert lock.depth == 0

    def fails_after(module, args, output):
        raise ValueError("a forward hook of the user's fails")

    handle = program.register_forward_hook(fails_after)
    with pytest.raises(ValueError, match="a forward hook"):
        program(torch.randn(8, 4))
    handle.remove()
    assert lock.depth == 0 and model.count.item() == 1  # the graph ran and wrote back before the hook

    nested = []

    def calls_again(module, args):
        if not nested:
            nested.append(True)
            module(torch.randn(8, 4))

    handle = program.register_forward_pre_hook(calls_again)
    program(torch.randn(8, 4))
    handle.remove()
    assert lock.deepest == 2 and lock.depth == 0 and model.count.item() == 3

    other = threading.Thread(target=lambda: program(torch.randn(8, 4)))
    other.start()
    other.join(timeout=60)
    assert not other.is_alive() and model.count.item() == 4


def test_deepcopy_gets_its_own_lock(counting_locks):
    program = predispatch.export(CountsAndNormalizes(), (torch.randn(8, 4),)).module()
    copied = copy.deepcopy(program)
    assert len(counting_locks) == 2
    copied(torch.randn(8, 4))
    assert [lock.acquired for lock in counting_locks] == [0, 1]
    assert copied.count.item() == 1 and program.count.item() == 0


def test_compiled_calls_step_aside_from_the_lock(counting_locks):
    """Dynamo cannot trace a lock: under torch.compile (fullgraph) it steps aside, as the checks do."""
    torch.manual_seed(0)
    eager = CountsAndNormalizes()
    program = predispatch.export(copy.deepcopy(eager), (torch.randn(8, 4),)).module()
    compiled = torch.compile(program, fullgraph=True, backend="eager")
    x = torch.randn(8, 4)
    for _ in range(2):
        torch.testing.assert_close(compiled(x), eager(x))
    assert program.count.item() == eager.count.item() == 2
    assert counting_locks[0].acquired == 0


# --- calls under torch.func (Note [Calls under torch.func] in predispatch/runtime/writes.py) ----


class Steps(nn.Module):
    """A buffer update vmap runs: the same value for the whole batch."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        self.steps.add_(1)
        return self.lin(x) * self.steps


class AddsInPlace(nn.Module):
    def forward(self, x, y):
        x.add_(y)
        return x * 2


class Accumulates(nn.Module):
    """A buffer update whose value depends on the (mapped) input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.zeros(4))

    def forward(self, x):
        self.acc.add_(x)
        return x * 2


class LargeBuffer(nn.Module):
    """A buffer too large to clone as it is read: the saved-tensor snapshot keeps backward's copy."""

    def __init__(self):
        super().__init__()
        self.register_buffer("big", torch.zeros(20000))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x) * (self.big[:4] + 1) * self.big[4:8].sum()
        self.big.add_(1)
        return y


def _eager_and_program(cls, *example):
    torch.manual_seed(0)
    eager = cls()
    model = copy.deepcopy(eager)
    return eager, model, predispatch.export(model, example).module()


class CallsUnderTorchFunc(TestCase):
    """Note [Calls under torch.func] in predispatch/runtime/writes.py: eager's cases run, eager's refusals are named."""

    def test_vmap_updates_a_buffer_as_eager_does(self):
        eager, model, program = _eager_and_program(Steps, torch.randn(4))
        x = torch.randn(3, 4)
        for _ in range(2):
            torch.testing.assert_close(torch.func.vmap(program)(x), torch.func.vmap(eager)(x))
        assert model.steps.item() == eager.steps.item() == 2
        nested = torch.randn(2, 3, 4)
        torch.testing.assert_close(torch.func.vmap(torch.func.vmap(program))(nested), torch.func.vmap(torch.func.vmap(eager))(nested))
        assert model.steps.item() == eager.steps.item() == 3


    def test_vmap_changes_a_mapped_input_in_place_as_eager_does(self):
        program = predispatch.export(AddsInPlace(), (torch.randn(4), torch.randn(4))).module()
        x = torch.randn(3, 4)
        for in_dims, y in (((0, 0), torch.randn(3, 4)), ((0, None), torch.randn(4))):  # the value mapped or not
            eager_x, program_x = x.clone(), x.clone()
            expected = torch.func.vmap(AddsInPlace(), in_dims=in_dims)(eager_x, y)
            actual = torch.func.vmap(program, in_dims=in_dims)(program_x, y)
            torch.testing.assert_close(actual, expected)
            torch.testing.assert_close(program_x, eager_x)
            assert not torch.equal(program_x, x)


    def test_vmap_with_gradients_through_a_written_buffer(self):
        """The snapshot reads the memory under vmap's wrappers (a BatchedTensor has no storage)."""
        eager, model, program = _eager_and_program(LargeBuffer, torch.randn(4))
        x = torch.randn(3, 4)
        expected = torch.autograd.grad(torch.func.vmap(eager)(x).sum(), list(eager.lin.parameters()))
        actual = torch.autograd.grad(torch.func.vmap(program)(x).sum(), list(model.lin.parameters()))
        torch.testing.assert_close(actual, expected)
        assert torch.equal(model.big, eager.big)


    def test_vmap_of_a_batched_value_into_one_buffer_is_refused(self):
        """Eager raises torch's shape error at `self.acc.add_(x)`; the program names it, writes nothing;
        the fix it gives (a buffer per element through functional_call) runs as eager does."""
        eager, model, program = _eager_and_program(Accumulates, torch.randn(4))
        x = torch.randn(3, 4)
        assert _outcome(lambda: torch.func.vmap(eager)(x)) is not None
        with pytest.raises(errors.MutationTargetError) as info:
            torch.func.vmap(program)(x)
        assert torch.equal(model.acc, torch.zeros(4))
        self.assertExpectedInline(stable_message(info.value), """\
under torch.func.vmap the program changes buffer 'acc' in place with a value that differs per batch element (it depends on a mapped input), and that tensor is one for the whole batch: it cannot hold a value per element, so eager raises too (at the in-place op: 'output with shape ... doesn't match the broadcast shape ...'); the graph ran, nothing was written.
  at test_calls.py:N (torch.func.vmap(program)(x))
  fix: give each batch element its own 'acc': torch.func.vmap(lambda s, x: torch.func.functional_call(m, {'acc': s}, (x,)))(batched, x) with batched = m.acc.expand(n, *m.acc.shape).clone() (eager needs the same); or write a value the whole batch shares (reduce over the batch outside vmap).
  see docs/errors.md#mutationtargeterror""")
        results = []
        for m in (eager, program):
            batched = m.acc.expand(3, *m.acc.shape).clone()
            out = torch.func.vmap(lambda s, x: torch.func.functional_call(m, {"acc": s}, (x,)))(batched, x)
            results.append((out, batched))
        torch.testing.assert_close(results[0], results[1])


    def test_vmap_of_a_batched_value_into_an_unmapped_input_is_refused(self):
        program = predispatch.export(AddsInPlace(), (torch.randn(4), torch.randn(4))).module()
        x, y = torch.zeros(4), torch.randn(3, 4)
        assert _outcome(lambda: torch.func.vmap(AddsInPlace(), in_dims=(None, 0))(x.clone(), y)) is not None
        with pytest.raises(errors.MutationTargetError, match="input 'x' in place with a value that differs per batch element") as info:
            torch.func.vmap(program, in_dims=(None, 0))(x, y)
        assert "fix: map that input too (in_dims=0 for it" in str(info.value)
        assert torch.equal(x, torch.zeros(4))


    def test_vmap_refuses_what_eager_refuses_under_it(self):
        """Under vmap eager's in-place op reaches the tensor under the wrapper: an expanded one, a
        leaf that requires grad; the program checks that tensor, before running anything."""
        program = predispatch.export(AddsInPlace(), (torch.randn(4), torch.randn(4))).module()
        y = torch.randn(3, 4)
        for x, why in ((torch.zeros(1, 4).expand(3, 4), "refers to the same memory"), (torch.zeros(3, 4, requires_grad=True), "leaf tensor that requires grad")):
            assert _outcome(lambda: torch.func.vmap(AddsInPlace())(x, y)) is not None
            with pytest.raises(errors.MutationTargetError, match=why):
                torch.func.vmap(program)(x, y)
            assert torch.equal(x, torch.zeros(3, 4))


    def test_grad_transform_refuses_a_write_to_a_captured_buffer(self):
        """functorch refuses any in-place change to a tensor a grad transform captured; the program
        names it before running; the buffer passed as an input of the transform runs as eager does."""
        eager, model, program = _eager_and_program(Steps, torch.randn(4))
        x = torch.randn(4)
        for transform in (torch.func.grad, torch.func.jacrev):
            assert _outcome(lambda: transform(lambda t: eager(t).sum())(x)) is not None
            with pytest.raises(errors.MutationTargetError, match="captured rather than took as an input") as info:
                transform(lambda t: program(t).sum())(x)
            assert model.steps.item() == 0
        assert "fix: make it an input of the transformed function: torch.func.grad(lambda x, s: torch.func.functional_call(m, {'steps': s}, (x,)).sum())(x, m.steps)" in str(info.value)
        grads = [
            torch.func.grad(lambda x, s, m=m: torch.func.functional_call(m, {"steps": s}, (x,)).sum())(x, m.steps) for m in (eager, program)
        ]
        torch.testing.assert_close(grads[1], grads[0])
        assert model.steps.item() == eager.steps.item() == 1
