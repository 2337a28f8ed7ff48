"""Bad input gets an error of ours that says what, where (the user's file:line) and what to do."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from expecttest import TestCase
from torch import nn

from helpers import stable_message as message

import predispatch
from predispatch import errors


class Branchy(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class ReturnsModule(nn.Module):
    def forward(self, x):
        return x, self


class MutatesMetadata(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(2, 3))

    def forward(self, x):
        self.b.t_()
        return x + 1


class Scheduler:
    """A diffusers-style scheduler: plain Python that builds its schedule with numpy."""

    def set_timesteps(self, end, *, item=False):
        end = end.item() if item else end
        self.sigmas = torch.from_numpy(np.linspace(0.0, np.asarray(end), 5).astype(np.float32))


class Denoiser(nn.Module):
    def __init__(self, *, item=False):
        super().__init__()
        self.scheduler, self.item = Scheduler(), item

    def forward(self, x, end):
        self.scheduler.set_timesteps(end, item=self.item)
        return x * self.scheduler.sigmas


class Errors(TestCase):
    def test_not_a_module(self):
        with pytest.raises(errors.UnsupportedInputError) as info:
            predispatch.export(42, (torch.randn(2),))
        self.assertExpectedInline(message(info.value), """\
export() takes an nn.Module or a function, got int.
  at test_errors.py:N (predispatch.export(42, (torch.randn(2),)))
  fix: pass the model itself, e.g. predispatch.export(model, (x,)).
  see docs/errors.md#unsupportedinputerror""")

    def test_args_not_a_tuple(self):
        with pytest.raises(errors.UnsupportedInputError) as info:
            predispatch.export(nn.ReLU(), torch.randn(2))
        self.assertExpectedInline(message(info.value), """\
export() takes positional arguments as a tuple, got Tensor.
  at test_errors.py:N (predispatch.export(nn.ReLU(), torch.randn(2)))
  fix: wrap them in a tuple: export(model, (x,)).
  see docs/errors.md#unsupportedinputerror""")

    def test_input_of_unknown_type(self):
        with pytest.raises(errors.UnsupportedInputError) as info:
            predispatch.export(nn.ReLU(), (object(),))
        self.assertExpectedInline(message(info.value), """\
input 'input' has type object, which is neither a tensor nor a constant.
  at test_errors.py:N (predispatch.export(nn.ReLU(), (object(),)))
  fix: pass tensors, None, bools, numbers or strings, in tuples/lists/dicts/dataclasses; register other containers with torch.utils._pytree.register_pytree_node.
  see docs/errors.md#unsupportedinputerror""")

    def test_output_not_tensors(self):
        with pytest.raises(errors.UnsupportedOutputError) as info:
            predispatch.export(ReturnsModule(), (torch.randn(2),))
        self.assertExpectedInline(message(info.value), """\
output[1] has type ReturnsModule, which is neither a tensor nor a constant.
  at test_errors.py:N (return x, self)
  fix: return tensors (or tuples/lists/dicts/dataclasses of tensors); register custom containers with torch.utils._pytree.register_pytree_node.
  see docs/errors.md#unsupportedoutputerror""")

    def test_data_dependent_branch(self):
        with pytest.raises(errors.DataDependentError) as info:
            predispatch.export(Branchy(), (torch.randn(2),))
        self.assertExpectedInline(message(info.value), """\
Python code branches on, or converts, a value inside a tensor, which export cannot know (it traces shapes, not values).
  at test_errors.py:N (if x.sum() > 0:)
  fix: compute both arms and pick with torch.where(cond, a, b), or use torch.cond(pred, true_fn, false_fn, (x,)) with arms that return new tensors (x * 1, not x itself); both need arms of one shape: where the arms differ in shape (x[:2] vs x) neither fits (torch.where cannot pick between them, and torch.cond's output size then depends on data, which a saved program cannot hold), so make both arms the same shape (pad or mask the shorter one) or move the branch out of forward (decide before calling the program, and export each arm).
  see docs/errors.md#datadependenterror""")

    def test_numpy_of_a_traced_tensor(self):
        # was "tracing failed: RuntimeError: .numpy() is not supported for tensor subclasses"
        for item in (False, True):  # np.asarray(t), and numpy given t.item() (a symbol it compares)
            with pytest.raises(errors.DataDependentError) as info:
                predispatch.export(Denoiser(item=item), (torch.randn(5), torch.tensor(3.0)))
            self.assertExpectedInline(message(info.value), """\
numpy computing on a traced tensor (.numpy(), np.asarray(t), or numpy given t.item() or t.tolist()) needs its values, which export does not have: it traces tensors that have shapes but no values, and numpy's result would not be part of the graph.
  at test_errors.py:N (self.sigmas = torch.from_numpy(np.linspace(0.0, np.asarray(end), 5).astype(np.float32)))
  fix: compute it with torch ops on the tensor (torch.linspace, torch.arange, ... instead of numpy) so it stays in the graph; or, where the value is a setting rather than data, do the numpy work before export, outside forward (call scheduler.set_timesteps(n) once, then export: forward reads the result as a constant).
  see docs/errors.md#datadependenterror""")

    def test_numpy_refusal_fixes_work(self):
        x = torch.randn(5)

        # the numpy work before export, outside forward: the schedule is a constant of the program
        class Prepared(nn.Module):
            def __init__(self):
                super().__init__()
                self.scheduler = Scheduler()

            def forward(self, x):
                return x * self.scheduler.sigmas

        model = Prepared()
        model.scheduler.set_timesteps(torch.tensor(3.0))
        ep = predispatch.export(model, (x,))
        torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)

        # torch ops instead of numpy: the schedule is part of the graph, computed from the tensor
        class TorchSchedule(nn.Module):
            def forward(self, x, end):
                return x * torch.linspace(0.0, 1.0, 5) * end

        ep = predispatch.export(TorchSchedule(), (x, torch.tensor(3.0)))
        for end in (3.0, 7.0):
            torch.testing.assert_close(ep.module()(x, torch.tensor(end)), TorchSchedule()(x, torch.tensor(end)), rtol=0, atol=0)

    def test_metadata_mutation_of_buffer(self):
        with pytest.raises(errors.TraceError) as info:
            predispatch.export(MutatesMetadata(), (torch.randn(2, 3),))
        self.assertExpectedInline(message(info.value), """\
forward changes the shape, strides or storage of input 'b' in place (x.t_(), x.resize_(), x.set_(...)); a functional graph cannot hand that change back to a parameter or buffer, nor a storage swap to any input.
  at test_errors.py:N (self.b.t_())
  fix: write it out of place (x = x.t()) and return the new tensor.
  see docs/errors.md#traceerror""")

    def test_attribute_error_inside_a_property_is_named(self):
        # Python answers an AttributeError raised in a property by calling nn.Module.__getattr__,
        # whose "'Gathered' object has no attribute 'weight'" dropped the property's own error
        class Gathered(nn.Module):
            def __init__(self):
                super().__init__()
                self.shard = nn.Parameter(torch.ones(3))

            @property
            def weight(self):
                return self.shard.full_tensor()  # a DTensor method; the trace's tensors lack it

            def forward(self, x):
                return x * self.weight

        model = Gathered()
        with pytest.raises(errors.TraceError) as info:
            predispatch.export(model, (torch.ones(3),))
        self.assertExpectedInline(message(info.value), """\
property Gathered.weight raised AttributeError: 'FunctionalTensor' object has no attribute 'full_tensor'; nn.Module.__getattr__ would have reported it as a missing attribute 'weight'.
  at test_errors.py:N (return self.shard.full_tensor()  # a DTensor method; the trace's tensors lack it)
  fix: the named line inside the property failed under tracing; torch's error is kept as err.torch_error. A property that gathers a DTensor parameter (SimpleFSDP, parametrizations of DTensors) is not supported yet: see docs/distributed.md.
  see docs/errors.md#traceerror""")
        assert isinstance(info.value.torch_error, AttributeError)
        assert nn.Module.__getattr__ is torch.fx._symbolic_trace._orig_module_getattr  # both put back
        with pytest.raises(AttributeError, match="'Gathered' object has no attribute 'weight'"):
            model.weight  # eager's own behaviour, unchanged outside export

    def test_call_with_other_constant(self):
        class Scale(nn.Module):
            def forward(self, x, k):
                return x * k

        program = predispatch.export(Scale(), (torch.randn(2), 3)).module()
        with pytest.raises(errors.InputMismatchError) as info:
            program(torch.randn(2), 4)
        self.assertExpectedInline(message(info.value), """\
input 'k' was 3 at export and is 4 now; constants are baked into the program.
  at test_errors.py:N (program(torch.randn(2), 4))
  fix: call with the exported value, or export again with this one.
  see docs/errors.md#inputmismatcherror""")

    def test_call_with_other_shape(self):
        program = predispatch.export(nn.Linear(3, 2), (torch.randn(4, 3),)).module()
        with pytest.raises(errors.InputMismatchError) as info:
            program(torch.randn(5, 3))
        self.assertExpectedInline(message(info.value), """\
input 'input' was exported as torch.float32 (4, 3) and is torch.float32 (5, 3) now.
  at test_errors.py:N (program(torch.randn(5, 3)))
  fix: call with the exported shape and dtype, export again, or mark the dimension dynamic.
  see docs/errors.md#inputmismatcherror""")


# --- issue 12, item 8: our errors where torch's or Python's escaped ---------------------------


class TakesKeywords(nn.Module):
    def forward(self, x, y, scale=1.0, *, mask=None):
        return x + y * scale if mask is None else x


class ReturnsPlainObject(nn.Module):
    class Box:  # not a dataclass, not a registered pytree node
        def __init__(self, t):
            self.t = t

    def forward(self, x):
        y = x + 1
        return self.Box(y)


class ReplacesBufferShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("rel", torch.zeros(1, 3))

    def forward(self, x):
        self.rel = x.sum(0, keepdim=True).repeat(2, 1)
        return x + self.rel.sum()


class StaticCache:
    """Stands for a Hugging Face cache other than DynamicCache (transformers is the models extra)."""

    __module__ = "transformers.cache_utils"


class ReturnsCache(nn.Module):
    def forward(self, x):
        return x + 1, StaticCache()


class MoreErrors(TestCase):
    def test_kwargs_key_not_a_string(self):
        with pytest.raises(errors.UnsupportedInputError) as info:
            predispatch.export(TakesKeywords(), (torch.randn(2),), {1: torch.randn(2)})
        self.assertExpectedInline(message(info.value), """\
export() takes keyword arguments by name, got the key 1 (int).
  at test_errors.py:N (predispatch.export(TakesKeywords(), (torch.randn(2),), {1: torch.randn(2)}))
  fix: use parameter names as the keys: kwargs={'mask': mask}; pass other values positionally.
  see docs/errors.md#unsupportedinputerror""")

    def test_model_built_under_inference_mode(self):
        with torch.inference_mode():
            model = nn.Linear(3, 3)
        with pytest.raises(errors.UnsupportedInputError) as info:
            predispatch.export(model, (torch.randn(2, 3),))
        self.assertExpectedInline(message(info.value), """\
parameter 'weight' is an inference tensor: the module was built or loaded under torch.inference_mode(), and such tensors cannot be traced for training.
  at test_errors.py:N (predispatch.export(model, (torch.randn(2, 3),)))
  fix: build or load the module outside inference_mode, or replace its state by normal tensors first: model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True) outside inference_mode.
  see docs/errors.md#unsupportedinputerror""")
        # the fix works
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
        x = torch.randn(2, 3)
        torch.testing.assert_close(predispatch.export(model, (x,)).module()(x), model(x), rtol=0, atol=0)

    @pytest.mark.filterwarnings("ignore:Lazy modules are a new feature")
    def test_lazy_module_before_its_first_call(self):
        """Before: torch's raw ValueError "Attempted to use an uninitialized parameter in numel"."""
        model = nn.Sequential(nn.LazyLinear(3), nn.ReLU())
        with pytest.raises(errors.UnsupportedInputError) as info:
            predispatch.export(model, (torch.randn(2, 4),))
        self.assertExpectedInline(message(info.value), """\
'0.weight' is an uninitialized parameter or buffer of a lazy module (nn.LazyLinear, nn.LazyConv2d, ...): its shape is only known after the module's first call, so there is nothing to trace yet.
  at test_errors.py:N (predispatch.export(model, (torch.randn(2, 4),)))
  fix: call the model once on an example batch before exporting (model(*args)), which initializes its lazy modules; then predispatch.export(model, args).
  see docs/errors.md#unsupportedinputerror""")
        assert torch.nn.parameter.is_lazy(model[0].weight)  # nothing changed
        # the fix works
        x = torch.randn(2, 4)
        model(x)
        torch.testing.assert_close(predispatch.export(model, (x,)).module()(x), model(x), rtol=0, atol=0)

    @pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
    def test_quantized_input(self):
        q = torch.quantize_per_tensor(torch.randn(2, 3), 0.1, 0, torch.quint8)
        with pytest.raises(errors.UnsupportedInputError) as info:
            predispatch.export(nn.Identity(), (q,))
        self.assertExpectedInline(message(info.value), """\
input 'input' is a quantized tensor (torch.quint8); export traces on fake tensors, which have no quantized kernels.
  at test_errors.py:N (predispatch.export(nn.Identity(), (q,)))
  fix: pass the float tensor (x.dequantize()) and quantize inside forward, or export the float model and quantize the program (torchao's PT2E flow).
  see docs/errors.md#unsupportedinputerror""")

    def test_call_on_another_device(self):
        model = nn.Linear(3, 3)
        program = predispatch.export(model, (torch.randn(2, 3),)).module()
        before = program.state_dict()
        with pytest.raises(errors.InputMismatchError) as info:
            program(torch.randn(2, 3, device="meta"))
        self.assertExpectedInline(message(info.value), """\
input 'input' was on cpu at export and is on meta now; the program's state and the devices in its graph are those of the export.
  at test_errors.py:N (program(torch.randn(2, 3, device="meta")))
  fix: move the input: x.to('cpu'), or export again with inputs on meta.
  see docs/errors.md#inputmismatcherror""")
        assert all(torch.equal(v, program.state_dict()[k]) for k, v in before.items())

    def test_kwargs_bound_as_eager_binds_them(self):
        """Eager accepts an argument by position or by name, and keywords in any order: so does
        the program (the call is arranged as the exported one was)."""
        model, x, y = TakesKeywords(), torch.randn(2), torch.randn(2)
        by_name = predispatch.export(model, (x,), {"y": y, "mask": None}).module()
        by_position = predispatch.export(model, (x, y)).module()
        expected = model(x, y)
        for actual in (
            by_name(x, y=y, mask=None),
            by_name(x, mask=None, y=y),  # reordered
            by_name(x, y, mask=None),  # exported by name, passed by position
            by_name(x=x, y=y, mask=None),  # exported by position, passed by name
            by_position(x, y=y),
            by_position(y=y, x=x),
        ):
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    def test_call_of_another_structure(self):
        program = predispatch.export(TakesKeywords(), (torch.randn(2), torch.randn(2))).module()
        with pytest.raises(errors.InputMismatchError) as info:
            program(torch.randn(2), z=torch.randn(2))
        self.assertExpectedInline(message(info.value), """\
keyword argument 'z' was not passed at export, so the program has no input for it. The program takes the keyword arguments it was exported with: none.
  at test_errors.py:N (program(torch.randn(2), z=torch.randn(2)))
  fix: call it with the same structure of args and kwargs as at export, or export again.
  see docs/errors.md#inputmismatcherror""")

    def test_missing_and_extra_keywords_are_named(self):
        program = predispatch.export(TakesKeywords(), (torch.randn(2),), {"y": torch.randn(2), "mask": None}).module()
        x, y = torch.randn(2), torch.randn(2)
        with pytest.raises(errors.InputMismatchError) as info:
            program(x, y=y)
        self.assertExpectedInline(message(info.value).splitlines()[0], """keyword argument 'mask' was passed at export and is missing now. The program takes the keyword arguments it was exported with: y, mask.""")
        with pytest.raises(errors.InputMismatchError) as info:
            program(x, y=y, mask=None, scale=2.0)
        self.assertExpectedInline(message(info.value).splitlines()[0], """keyword argument 'scale' was not passed at export, so the program has no input for it. The program takes the keyword arguments it was exported with: y, mask.""")
        with pytest.raises(errors.InputMismatchError) as info:
            program(x, y=(y, y), mask=None)
        self.assertExpectedInline(message(info.value).splitlines()[0], """input 'y' was a single value (a tensor or constant) at export and is a tuple of 2 now.""")
        self.assertNotIn("TreeSpec", str(info.value))

    def test_torch_error_kept_but_not_printed(self):
        """A data-dependent branch prints our message, not ~90 lines of chained torch internals;
        torch's exception stays reachable."""
        import traceback

        with pytest.raises(errors.DataDependentError) as info:
            predispatch.export(Branchy(), (torch.randn(2),))
        err = info.value
        printed = "".join(traceback.format_exception(err))
        assert "The above exception was the direct cause" not in printed
        assert "During handling of the above exception" not in printed
        assert "GuardOnDataDependentSymNode" not in printed
        assert printed.rstrip().endswith("see docs/errors.md#datadependenterror")
        from predispatch import _torch_internals as ti

        assert isinstance(err.torch_error, ti.DATA_DEPENDENT_ERRORS)
        assert err.__context__ is err.torch_error and err.__suppress_context__

    def test_unsupported_output_names_the_return_line(self):
        with pytest.raises(errors.UnsupportedOutputError) as info:
            predispatch.export(ReturnsPlainObject(), (torch.randn(2),))
        self.assertExpectedInline(message(info.value), """\
output has type Box, which is neither a tensor nor a constant.
  at test_errors.py:N (return self.Box(y))
  fix: return tensors (or tuples/lists/dicts/dataclasses of tensors); register custom containers with torch.utils._pytree.register_pytree_node.
  see docs/errors.md#unsupportedoutputerror""")

    def test_hugging_face_cache_output_says_use_cache_false(self):
        with pytest.raises(errors.UnsupportedOutputError) as info:
            predispatch.export(ReturnsCache(), (torch.randn(2),))
        self.assertExpectedInline(message(info.value), """\
output[1] has type StaticCache, which is neither a tensor nor a constant.
  at test_errors.py:N (return x + 1, StaticCache())
  fix: StaticCache is the model's key/value cache, returned because use_cache=True (the default): pass use_cache=False to the call (export(model, args, {'use_cache': False})) or set model.config.use_cache = False; predispatch exports transformers' DynamicCache, not other caches.
  see docs/errors.md#unsupportedoutputerror""")

    def test_calling_the_program_points_to_module(self):
        ep = predispatch.export(nn.Linear(2, 2), (torch.randn(1, 2),))
        with pytest.raises(errors.ProgramCallError) as info:
            ep(torch.randn(1, 2))
        self.assertIsInstance(info.value, TypeError)
        self.assertExpectedInline(message(info.value), """\
an ExportedProgram is not callable: it describes the program; its module runs it.
  at test_errors.py:N (ep(torch.randn(1, 2)))
  fix: call ep.module()(...) instead (build the module once, then call it as often as you like).
  see docs/errors.md#programcallerror""")

    def test_saving_what_is_not_a_predispatch_program(self):
        model, x = nn.Linear(2, 2), torch.randn(1, 2)
        cases = {
            "torch.export": torch.export.export(model, (x,)),
            "train_eval": predispatch.export_train_eval(model, (x,)),
            "module": predispatch.export(model, (x,)).module(),
        }
        fixes = {}
        for name, value in cases.items():
            with pytest.raises(errors.NotAProgramError) as info:
                predispatch.save(value, "never-written.pd")
            fixes[name] = message(info.value)
        import os
        self.assertFalse(os.path.exists("never-written.pd"))
        self.assertExpectedInline(fixes["torch.export"], """\
predispatch.save takes a predispatch ExportedProgram; got a torch.export.exported_program.ExportedProgram.
  at test_errors.py:N (predispatch.save(value, "never-written.pd"))
  fix: use torch.export.save(ep, path) for torch.export's programs; predispatch.save takes what predispatch.export(model, args) returns.
  see docs/errors.md#notaprogramerror""")
        self.assertExpectedInline(fixes["train_eval"], """\
predispatch.save takes a predispatch ExportedProgram; got a predispatch.program.train_eval.TrainEvalProgram.
  at test_errors.py:N (predispatch.save(value, "never-written.pd"))
  fix: save its two programs one by one: predispatch.save(p.train_program, 'train.pd') and predispatch.save(p.eval_program, 'eval.pd'); TrainEvalProgram(load('train.pd'), load('eval.pd'), p.training) puts them together again.
  see docs/errors.md#notaprogramerror""")
        self.assertExpectedInline(fixes["module"], """\
predispatch.save takes a predispatch ExportedProgram; got a torch.fx.graph_module.GraphModule.
  at test_errors.py:N (predispatch.save(value, "never-written.pd"))
  fix: save the ExportedProgram (what predispatch.export returned), not a module such as ep.module().
  see docs/errors.md#notaprogramerror""")

    def test_buffer_replaced_by_another_shape(self):
        model = ReplacesBufferShape()
        with pytest.raises(errors.TraceError) as info:
            predispatch.export(model, (torch.randn(2, 3),))
        self.assertExpectedInline(message(info.value), """\
forward replaces buffer 'rel' (torch.float32 (1, 3)) by a tensor of another shape, dtype or device (torch.float32 (2, 3)); the program's buffer keeps its exported shape, so it cannot take the new value.
  at test_errors.py:N (self.rel = x.sum(0, keepdim=True).repeat(2, 1))
  fix: register the buffer with the shape forward gives it (compute it in __init__), or keep the new tensor in a local variable (or a plain attribute) instead of the buffer.
  see docs/errors.md#traceerror""")
        assert model.rel.shape == (1, 3) and not predispatch._torch_internals.is_traced_tensor(model.rel)
