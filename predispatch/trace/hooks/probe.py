"""The probe: a module's output layout learnt before its forward runs, for full backward hooks.

A carrier is made before the forward runs, yet shaped like its output, and whether eager
calls the hooks at all depends on the output's layout (Note [Carrying grad_output] in
full.py): `probe_outputs` learns both by running the module's forward and forward hooks once
more, at export, on stand-in fake tensors outside the trace.  So at export the forward Python
of a module with a full backward hook runs once more for each call of the module, just before
its traced run (side effects of that Python included), and the real output must be laid out as
the probe's was (`check_probed`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.nn.modules import module as module_globals

from predispatch import _torch_internals as ti
from predispatch.errors import PredispatchError, UnsupportedHookError, from_torch, user_frame
from predispatch.trace.autograd_function.capture import torch_applies
from predispatch.trace.hooks.capture import Capture, first_line
from predispatch.trace.hooks.layout import Layout, is_floating
from predispatch.trace.hooks.state import module_tensors


def probe_outputs(module: nn.Module, args: tuple, kwargs: dict, capture: Capture) -> Layout:
    """The layout of the module's output after its forward hooks, from running it once more.

    The full hooks' Function is applied before the forward runs, yet whether eager calls the
    hooks at all, and the carriers' shapes (Note [Carrying grad_output]), depend on the output:
    so the forward and the forward hooks run first on stand-ins (fresh fake tensors for the
    arguments and the module's state) with the trace suspended and every capture hook standing
    aside.  Nothing the probe does is recorded, and what it mutates (BatchNorm's running
    statistics) is a stand-in.
    """
    fake_mode = ti.detect_fake_mode([t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    try:
        with (
            ti.outside_trace(keep_decomposition_policy=False),
            capture.probe(),
            _plain_autograd(),
            fake_mode,
            ti.discarding_unbacked_symbols(fake_mode),
        ):
            stand_in = _StandIns()
            p_args, p_kwargs = pytree.tree_map_only(torch.Tensor, stand_in, (args, kwargs))
            with ti.reparametrize(module, {name: stand_in(t) for name, t in module_tensors(module)}):
                return Layout.of(_forward_with_hooks(module, p_args, p_kwargs))
    except PredispatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with what to do
        raise from_torch(
            UnsupportedHookError(
                f"{capture.describe(module)} has a full backward hook; export learns which outputs its "
                "grad_output holds by running the module once more on stand-in tensors, which failed: "
                f"{type(exc).__name__}: {first_line(exc)}",
                where=user_frame(exc.__traceback__) or user_frame(),
                fix="make the module's forward depend only on its arguments and its own parameters and buffers.",
            ),
            exc,
        ) from None


class _StandIns:
    """Fresh fake tensors standing in for a trace's tensors (one per tensor, so ties stay tied).

    Call inside the fake mode, outside the trace.
    """

    def __init__(self) -> None:
        # id -> (original, stand-in); holding the original keeps its id from being reused
        self._made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self._made:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            self._made[id(t)] = (t, fake.requires_grad_(t.requires_grad and is_floating(t)))
        return self._made[id(t)][1]


def _forward_with_hooks(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """`module.forward` and then its forward hooks (global ones first), as `Module.__call__` runs them."""
    output = module.forward(*args, **kwargs)
    for hook_id, hook in (*module_globals._global_forward_hooks.items(), *module._forward_hooks.items()):
        with_kwargs = hook_id in module._forward_hooks_with_kwargs or hook_id in module_globals._global_forward_hooks_with_kwargs
        result = hook(module, args, kwargs, output) if with_kwargs else hook(module, args, output)
        output = output if result is None else result
    return output


@contextlib.contextmanager
def _plain_autograd() -> Iterator[None]:
    """For the probe: torch's own `Function.apply`, and `Tensor.register_hook` doing nothing.

    The trace replaces both (`capture_autograd_functions`, `captured_tensor_hooks`): a Function the
    probe calls must not be captured (its subgraphs would be traced for a run nothing records),
    and a tensor hook changes no shape, while torch's would refuse a stand-in without grad.
    """
    with ti.patched(torch.Tensor, "register_hook", lambda _: lambda tensor, hook: _ProbeHandle(), mechanism=ti.TENSOR_HOOKS), torch_applies():
        yield


class _ProbeHandle:
    """What `register_hook` returns during a probe: nothing was registered, nothing to remove."""

    def remove(self) -> None:
        pass


def check_probed(module: nn.Module, output: Any, probed: Layout, carried: bool, capture: Capture) -> None:
    """Refuse an output laid out otherwise than the probe found (shaped otherwise, for carriers)."""
    actual = Layout.of(output)
    if actual == probed or (not carried and actual.same_entries(probed)):
        return
    raise UnsupportedHookError(
        f"{capture.describe(module)} has a full backward hook, and its output changed between two "
        "runs on the same inputs at export (a probe learns the output's layout before the forward, see "
        "Note [Carrying grad_output] in predispatch/trace/hooks/full.py).",
        where=user_frame(),
        fix="make the module's forward return the same layout, shapes and dtypes each time it is called "
        "with the same inputs.",
    )


def shape_sources(module: nn.Module, inputs: tuple, arguments: Any, outputs: Layout, capture: Capture) -> tuple:
    """Other argument tensors whose sizes the carriers' symbolic sizes are made from (usually none).

    A carrier is made inside `FullBackwardHooks`' forward, a subgraph that sees only its
    operands, so each symbolic size of an output must come from an operand's: an index
    tensor's length (dynamic shapes) joins the operands.  A size that comes from no argument
    depends on tensor values (`nonzero`, boolean masks) and is known only after the forward.
    """
    missing = set(ti.free_symbols([shape for shape, _, _ in outputs.like])) - set(ti.free_symbols(list(inputs)))
    sources = []
    for t in pytree.tree_leaves(arguments):
        if missing and isinstance(t, torch.Tensor) and missing & set(ti.free_symbols(t)):
            sources.append(t)
            missing -= set(ti.free_symbols(t))
    if missing:
        raise UnsupportedHookError(
            f"{capture.describe(module)} has a full backward hook that reads grad_output, and "
            f"the shape of its output depends on tensor values ({', '.join(sorted(map(str, missing)))}); the "
            "tensor that brings grad_output to the hook is made before the forward runs, so its shape must "
            "follow from the shapes of the module's arguments.",
            where=user_frame(),
            fix="make the hook use only grad_input, or register it on a submodule whose output shape "
            "follows from its input shapes.",
        )
    return tuple(sources)
