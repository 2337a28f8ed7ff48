"""Bad input gets an error of ours that says what, where (the user's file:line) and what to do."""

from __future__ import annotations


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
  at test_errors.py:N (predispatch.export(ReturnsModule(), (torch.randn(2),)))
  fix: return tensors (or tuples/lists/dicts/dataclasses of tensors); register custom containers with torch.utils._pytree.register_pytree_node.
  see docs/errors.md#unsupportedoutputerror""")

    def test_data_dependent_branch(self):
        with pytest.raises(errors.DataDependentError) as info:
            predispatch.export(Branchy(), (torch.randn(2),))
        self.assertExpectedInline(message(info.value), """\
Python code branches on, or converts, a value inside a tensor, which export cannot know (it traces shapes, not values).
  at test_errors.py:N (if x.sum() > 0:)
  fix: make the branch static, use torch.where to compute both sides, or torch.cond.
  see docs/errors.md#datadependenterror""")

    def test_metadata_mutation_of_buffer(self):
        with pytest.raises(errors.TraceError) as info:
            predispatch.export(MutatesMetadata(), (torch.randn(2, 3),))
        self.assertExpectedInline(message(info.value), """\
forward changes the shape, strides or storage of input 'b' in place (x.t_(), x.resize_(), x.set_(...)); a functional graph cannot hand that change back to a parameter or buffer, nor a storage swap to any input.
  at test_errors.py:N (self.b.t_())
  fix: write it out of place (x = x.t()) and return the new tensor.
  see docs/errors.md#traceerror""")

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
