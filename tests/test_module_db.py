"""Sweep torch's ModuleInfo database (`module_db`) through predispatch.export, CPU float32.

For every ModuleInfo, in train and in eval mode, the first few module inputs are exported and
each case checks that

    (a) export leaves the user's module exactly as it was: `state_dict()` bit-identical;
    (b) the exported graph is functional: `mutable_ops(ep.graph_module) == []`;
    (c) `ep.module()` returns what eager returns (bitwise unless `MODULE_DB_TOLERANCES` says
        why not), leaves the inputs as eager does, and ends with the same buffers and
        state_dict as eager after one call (BatchNorm's running stats, for example).

Eager runs a deep copy of the module made before export; eager, export and the program each
get their own clones of the inputs.  Known failures are strict xfails listed with reasons in
`sweep_expected_failures.py`.  A fast subset runs by default; the whole sweep is behind the
slow marker:

    pytest tests/test_module_db.py                              # fast subset
    pytest -m slow -p no:cacheprovider tests/test_module_db.py  # full sweep

The `*_save_load` tests save every case's program with `predispatch.save`, load it back, and
compare the loaded program's call with the original program's, bitwise.
"""

from __future__ import annotations

import copy
import io
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import make_tensor
from torch.testing._internal.common_modules import FunctionInput, ModuleInfo, ModuleInput, module_db

import predispatch
from predispatch.passes.check_functional import mutable_ops
from sweep_expected_failures import MODULE_DB_RANDOM, MODULE_DB_TOLERANCES, MODULE_DB_XFAILS, lookup
from sweep_support import assert_same, clone_tree, param, skipped

DTYPE = torch.float32
MODES = ("train", "eval")

#: How many of each ModuleInfo's inputs to try: the first ones cover the common configurations.
INPUTS_PER_MODULE = 3

#: Seed for both the eager and the program call, so random modules (dropout in training) draw
#: the same numbers and can be compared bitwise.
RUN_SEED = 0


def _dropout_inputs(module_info, device, dtype, requires_grad, training, **kwargs) -> list[ModuleInput]:
    make = partial(make_tensor, device=device, dtype=dtype, requires_grad=requires_grad)
    return [
        ModuleInput(FunctionInput(), FunctionInput(make((4, 8)))),
        ModuleInput(FunctionInput(p=0.3), FunctionInput(make((2, 3, 5))), desc="p"),
    ]


#: Modules the sweep should cover that module_db does not have.
SUPPLEMENT = (ModuleInfo(nn.Dropout, module_inputs_func=_dropout_inputs),)

MODULE_INFOS = {info.name: info for info in (*module_db, *SUPPLEMENT)}

#: The default subset: the layers most models are built from.
FAST_MODULES = (
    "nn.Linear", "nn.Conv2d", "nn.BatchNorm2d", "nn.LayerNorm", "nn.GRU", "nn.LSTM",
    "nn.MultiheadAttention", "nn.TransformerEncoderLayer", "nn.Embedding", "nn.Dropout",
)


def module_inputs(info: ModuleInfo, training: bool) -> list[ModuleInput]:
    """The ModuleInfo's inputs, seeded so that every call yields the same tensors."""
    torch.manual_seed(0)
    inputs = info.module_inputs_func(info, device="cpu", dtype=DTYPE, requires_grad=False, training=training)
    return list(inputs)[:INPUTS_PER_MODULE]


def _keys(names) -> list[str]:
    return [
        f"{name}:{mode}:{i}"
        for name in names
        for mode in MODES
        for i in range(len(module_inputs(MODULE_INFOS[name], mode == "train")))
    ]


def _params(names) -> list[Any]:
    """Each case as a pytest param: skipped if the ModuleInfo has no float32, xfail if known."""
    params = []
    for key in _keys(names):
        if DTYPE not in MODULE_INFOS[key.split(":")[0]].supported_dtypes("cpu"):
            params.append(skipped(key, "the ModuleInfo declares no float32 support on CPU"))
        else:
            params.append(param(key, lookup(MODULE_DB_XFAILS, key)))
    return params


def build_module(info: ModuleInfo, module_input: ModuleInput, training: bool) -> nn.Module:
    """Construct, cast and set the mode, as torch's test_modules does.

    A lazy module is materialized by one eager call first: its parameters have no shape until
    then, and exporting it would capture the initialization instead of the module.
    """
    ctor = module_input.constructor_input
    module = info.module_cls(*ctor.args, **ctor.kwargs).to(DTYPE)
    module.train(training)
    if isinstance(module, nn.modules.lazy.LazyModuleMixin):
        args, kwargs = clone_tree((module_input.forward_input.args, module_input.forward_input.kwargs))
        with torch.no_grad():
            module(*args, **kwargs)
    return module


def assert_bit_identical(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """Same keys, dtypes, shapes and bytes: export must not touch the user's module."""
    assert after.keys() == before.keys()
    for name, tensor in after.items():
        old = before[name]
        assert (tensor.dtype, tensor.shape) == (old.dtype, old.shape), name
        assert torch.equal(_bytes(tensor), _bytes(old)), f"{name} changed during export"


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def check_module(key: str) -> None:
    """Export one case, then compare the module's state, the graph and one call with eager."""
    name, mode, index = key.split(":")
    info, training = MODULE_INFOS[name], mode == "train"
    module_input = module_inputs(info, training)[int(index)]
    module = build_module(info, module_input, training)
    fwd = module_input.forward_input
    state_before = {k: v.clone() for k, v in module.state_dict().items()}
    eager = copy.deepcopy(module)

    ep = predispatch.export(module, clone_tree(fwd.args), clone_tree(fwd.kwargs))
    assert_bit_identical(module.state_dict(), state_before)
    assert mutable_ops(ep.graph_module) == []

    eager_in, program_in = clone_tree((fwd.args, fwd.kwargs)), clone_tree((fwd.args, fwd.kwargs))
    program = ep.module()
    torch.manual_seed(RUN_SEED)
    expected = eager(*eager_in[0], **eager_in[1])
    torch.manual_seed(RUN_SEED)
    actual = program(*program_in[0], **program_in[1])

    compare = partial(assert_same, tolerance=lookup(MODULE_DB_TOLERANCES, key), values=lookup(MODULE_DB_RANDOM, key) is None)
    compare(actual, expected, what="output")
    compare(program_in, eager_in, what="inputs after the call")
    compare(_sorted(program.named_buffers()), _sorted(eager.named_buffers()), what="buffers after the call")
    compare(_sorted(program.state_dict().items()), _sorted(eager.state_dict().items()), what="state_dict after the call")


def _sorted(items) -> dict[str, torch.Tensor]:
    """By name: the program registers state in graph order, not the module's."""
    return dict(sorted(items))


@pytest.mark.parametrize("key", _params(FAST_MODULES))
def test_module_fast(key: str) -> None:
    check_module(key)


@pytest.mark.slow
@pytest.mark.parametrize("key", _params(MODULE_INFOS))
def test_module(key: str) -> None:
    check_module(key)


def test_table_keys_name_cases() -> None:
    """A key that names no case never applies: catch typos and ModuleInfos that torch renamed."""
    keys = _keys(MODULE_INFOS)
    prefixes = {":".join(key.split(":")[:n]) for key in keys for n in (1, 2, 3)}
    for table in (MODULE_DB_XFAILS, MODULE_DB_RANDOM, MODULE_DB_TOLERANCES):
        assert set(table) - prefixes == set()


def check_save_load(key: str) -> None:
    """Save and load one case's program; the loaded one computes what the original does.

    Forward argument names that FX reserves (`nn.Linear.forward(input)`) once made load refuse
    the file: the graph said `input_1` where the signature said `input`.
    """
    name, mode, index = key.split(":")
    info, training = MODULE_INFOS[name], mode == "train"
    module_input = module_inputs(info, training)[int(index)]
    fwd = module_input.forward_input
    ep = predispatch.export(build_module(info, module_input, training), clone_tree(fwd.args), clone_tree(fwd.kwargs))
    buffer = io.BytesIO()
    predispatch.save(ep, buffer)
    loaded = predispatch.load(io.BytesIO(buffer.getvalue()))
    assert [n.name for n in loaded.graph.find_nodes(op="placeholder")] == [s.name for s in ep.signature.inputs]
    results = []
    for program in (ep.module(), loaded.module()):
        inputs = clone_tree((fwd.args, fwd.kwargs))
        torch.manual_seed(RUN_SEED)
        results.append((program(*inputs[0], **inputs[1]), inputs, _sorted(program.state_dict().items())))
    assert_same(results[1], results[0], what="loaded program")  # same graph, same seed: bitwise


@pytest.mark.parametrize("key", _params(FAST_MODULES))
def test_module_fast_save_load(key: str) -> None:
    check_save_load(key)


@pytest.mark.slow
@pytest.mark.parametrize("key", _params(MODULE_INFOS))
def test_module_save_load(key: str) -> None:
    check_save_load(key)
