"""The one-pass trace records the graph `aot_export_module(pre_dispatch=True)` records.

predispatch traces once (`ti.trace_program`: FunctionalTensorMode on the PreDispatch stack over
make_fx, mutations read off the FunctionalTensor inputs afterwards).  It used to drive
AOTAutograd's export entry point, which runs the user's forward twice (a metadata pass, then
the capture pass).  That entry point stays here as the reference: `aot_trace_program` keeps
`trace_program`'s contract on top of `aot_export_module`, and every case below is exported both
ways; the printed programs (graph, subgraphs, signature) must be the same text.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import StraightThrough
from test_export import ConvBN, Counter, DictOut, Masked, ScaleInPlace, Tied, ViewInPlace
from test_regions import CASES as REGION_CASES
from torch import fx, nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch._torch_internals import tracing as ti_tracing


def aot_trace_program(fn, args, scope, decompositions=None) -> ti.ProgramTrace:
    """`ti.trace_program`'s contract (inputs `(token, *args)`, outputs `(*new values of the
    mutated args, *outputs)`, make_fx's `decompositions`), produced by AOTAutograd's two passes."""

    class Program(nn.Module):
        def forward(self, *tensors):
            return fn(*tensors)

    gm, sig = ti.aot_export_module(Program(), args, trace_joint=False, pre_dispatch=True, decompositions=decompositions)
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    n_tokens = len(sig.input_tokens)
    output = graph.output_node()
    output.args = (tuple(output.args[0][len(sig.output_tokens):]),)
    if n_tokens == 0:  # the contract's token input, unused
        with graph.inserting_before(placeholders[0]):
            graph.placeholder("token")
    position = {node.name: i - n_tokens for i, node in enumerate(placeholders)}
    mutated = sorted(position[name] for name in sig.user_inputs_to_mutate.values())
    gm.recompile()
    return ti.ProgramTrace(gm, tuple(mutated), ())


def both_ways(module: nn.Module, args: tuple, monkeypatch, kwargs: dict | None = None) -> tuple[str, str]:
    """The printed program exported in one pass, and through `aot_export_module`."""
    torch.manual_seed(0)
    one_pass = predispatch.export(module, args, kwargs)
    with monkeypatch.context() as patch:
        patch.setattr(ti, "trace_program", aot_trace_program)
        torch.manual_seed(0)
        reference = predispatch.export(module, args, kwargs)
    return str(one_pass), str(reference)


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return StraightThrough.apply(self.lin(x)).relu()


class WithHook(nn.Module):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU()
        self.act.register_full_backward_hook(lambda m, gi, go: (go[0] * 2,))
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return self.act(self.lin(x))


class Effects(nn.Module):
    """`linalg.inv` is traced with an effect token (`_linalg_check_errors`)."""

    def forward(self, a):
        return torch.linalg.inv(a) @ a


CASES = {
    **{f"regions/{name}": (cls, make) for name, (cls, make) in REGION_CASES.items()},
    "conv_bn_train": (ConvBN, lambda: (torch.randn(2, 3, 6, 6),)),
    "counter": (Counter, lambda: (torch.randn(2, 3),)),
    "scale_in_place": (ScaleInPlace, lambda: (torch.randn(3), torch.randn(3))),
    "view_in_place": (ViewInPlace, lambda: (torch.randn(2, 3),)),
    "dict_out": (DictOut, lambda: (torch.randn(3),)),
    "masked": (Masked, lambda: (torch.randn(2, 4),)),
    "tied": (Tied, lambda: (torch.randint(0, 10, (2, 3)),)),
    "autograd_function": (WithFunction, lambda: (torch.randn(2, 3),)),
    "grad_output_hook": (WithHook, lambda: (torch.randn(2, 3),)),
    "effect_token": (Effects, lambda: (torch.randn(3, 3) + 3 * torch.eye(3),)),
}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_program_as_aot_export_module(case, mode, monkeypatch):
    module_cls, make_args = CASES[case]
    module = module_cls().train(mode == "train")
    one_pass, reference = both_ways(module, make_args(), monkeypatch)
    assert one_pass == reference


def test_reference_runs_forward_twice_and_one_pass_once(monkeypatch):
    """What the change buys: the user's forward runs once per export, not twice."""
    calls = []

    class Counting(nn.Module):
        def forward(self, x):
            calls.append(1)
            return x * 2

    both_ways(Counting(), (torch.randn(3),), monkeypatch)
    assert len(calls) == 1 + 2


def test_reference_keeps_the_contract(monkeypatch):
    """The reference itself is checked: a mutated input is reported and the token is first."""
    module = ScaleInPlace()
    with monkeypatch.context() as patch:
        patch.setattr(ti, "trace_program", aot_trace_program)
        ep = predispatch.export(module, (torch.randn(3), torch.randn(3)))
    kinds = [spec.kind.name for spec in ep.signature.outputs]
    assert "USER_INPUT_MUTATION" in kinds
    assert all(isinstance(n, fx.Node) for n in ep.graph.nodes)


def test_forward_frame_stack_traces_are_torchs_text(monkeypatch):
    """`forward_frames_only` walks the stack for the frames FX keeps instead of symbolizing it
    all; each node's `stack_trace` must be the text torch's own capture gives."""
    import contextlib

    module = WithHook().train()
    args = (torch.randn(2, 3),)
    fast = predispatch.export(module, args)
    with monkeypatch.context() as patch:
        patch.setattr(ti_tracing, "forward_frames_only", contextlib.nullcontext)
        torch_own = predispatch.export(module, args)
    traces = [n.meta.get("stack_trace") for n in fast.graph.nodes]
    assert traces == [n.meta.get("stack_trace") for n in torch_own.graph.nodes]
    assert sum(t is not None for t in traces) >= 3
    package = os.path.dirname(predispatch.__file__)  # not "predispatch": a checkout or venv path may hold the word
    assert all("in forward" in t and package not in t for t in traces if t)
