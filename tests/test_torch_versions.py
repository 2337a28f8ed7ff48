"""predispatch on torch 2.11 to 2.15: the right program on each, and a loud error where a hook of
ours cannot engage (Note [Drift is loud] in predispatch/_torch_internals/mechanism.py).

Each mechanism's absence is simulated the way a torch release would remove it (the attribute
gone, the hook point no longer reached, a new table) and the error is pinned; each simulation
also checks that nothing was left changed.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from helpers import stable_message as message
from torch import nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch._torch_internals import autograd_function as ti_function
from predispatch._torch_internals import decomposition as ti_decomposition
from predispatch._torch_internals import switches as ti_switches
from predispatch._torch_versions import TESTED
from predispatch.errors import AutogradFunctionError, TorchDriftError


class TwiceStraightThrough(torch.autograd.Function):
    """The issue's estimator: round() forward, twice the gradient back (autograd through round: 0)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Straight(nn.Module):
    def forward(self, x):
        return TwiceStraightThrough.apply(x) * 1.0


def _drift(mechanism: str, what: str) -> str:
    return (
        f"{mechanism} cannot engage on torch {torch.__version__}: {what}. predispatch stops here rather than "
        "return a program without it.\n"
        "  fix: use a torch release predispatch is tested on (2.11 to 2.15: pip install 'torch>=2.11,<2.16'), "
        "and report this message to predispatch.\n"
        "  see docs/errors.md#torchdrifterror"
    )


def _untouched() -> dict:
    """What every simulation must leave as it found: the classes export patches."""
    return {
        "function": dict(vars(torch.autograd.Function)),
        "single": dict(vars(ti.SingleLevelFunction)),
        "mode": dict(vars(ti.FunctionalTensorMode)),
        "tensor": torch.Tensor.register_hook,
        "backward_cls": dict(vars(torch.autograd.function.BackwardCFunction)),
        "function_meta": dict(vars(torch.autograd.function.FunctionMeta)),
    }


# --- the program is right on every tested release ---------------------------------------------


def test_straight_through_gradient_is_the_custom_backward():
    """The issue's check: the custom backward (2 * grad), not round's zero gradient, on this torch."""
    x = torch.tensor([0.3, 0.6, -0.2, 1.4], requires_grad=True)
    ep = predispatch.export(Straight(), (x,))
    assert len(ep.graph.find_nodes(op="call_function", target=torch.ops.higher_order.autograd_function_apply)) == 1
    assert not ep.graph.find_nodes(op="call_function", target=torch.ops.aten.round.default)
    ep.module()(x).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))


def test_this_torch_is_tested_and_in_the_declared_range():
    assert ti.TORCH in TESTED, f"CI tests {TESTED}; torch {torch.__version__} is not among them"


def test_untested_torch_warns_once_naming_the_range(monkeypatch):
    from predispatch import _torch_versions

    monkeypatch.setattr(_torch_versions, "TORCH", (2, 99))
    monkeypatch.setattr(_torch_versions, "TORCH_VERSION", "2.99.0")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        _torch_versions.warn_if_untested()
        _torch_versions.warn_if_untested()
    assert len(seen) == 1, [str(w.message) for w in seen]
    assert str(seen[0].message).startswith("predispatch is tested with torch 2.11 to 2.15; this is torch 2.99.0.")


# --- each mechanism's absence, simulated ---------------------------------------------------------


def test_apply_capture_not_reached(monkeypatch):
    """torch no longer makes a Function's ctx from `_backward_cls` (a `BackwardCFunction`)."""

    class NotTheCtx:
        pass

    monkeypatch.setattr(ti_function, "BackwardCFunction", NotTheCtx)
    before = _untouched()
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(Straight(), (torch.ones(3),))
    assert message(info.value) == _drift(ti.APPLY_CAPTURE, "the probe call did not reach predispatch's replacement")
    assert _untouched() == before


def test_forward_redirect_not_reached(monkeypatch):
    """torch's apply no longer looks a Function's forward up on the class through its metaclass."""

    class NotTheMetaclass(type):
        pass

    monkeypatch.setattr(ti_function, "FunctionMeta", NotTheMetaclass)
    before = _untouched()
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(Straight(), (torch.ones(3),))
    assert message(info.value) == _drift(
        ti.FORWARD_REDIRECT,
        "torch's apply did not look up a probe Function's forward and setup_context through FunctionMeta.__getattribute__",
    )
    assert _untouched() == before


def test_forward_run_past_the_redirect_is_refused(monkeypatch):
    """A call whose ctx torch made but whose forward it ran without asking the hook (what a torch
    that stopped looking forward up through the metaclass, after the probe, would do) never
    becomes a program without its backward: export stops, naming the Function."""
    real = ti_function._Redirect.getattribute

    def blind_to_forward(self, cls, name):
        return type.__getattribute__(cls, name) if name == "forward" and cls is TwiceStraightThrough else real(self, cls, name)

    monkeypatch.setattr(ti_function._Redirect, "getattribute", blind_to_forward)
    before = _untouched()
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(Straight(), (torch.ones(3),))
    assert message(info.value) == _drift(
        ti.FORWARD_REDIRECT,
        "torch's apply made TwiceStraightThrough's ctx but ran its forward without looking it up through "
        "FunctionMeta.__getattribute__ (its custom backward would be lost)",
    )
    assert _untouched() == before


class Bypassing(type(torch.autograd.Function)):
    """A metaclass whose attribute lookup skips FunctionMeta's."""

    def __getattribute__(cls, name):
        return type.__getattribute__(cls, name)


class BypassingStraightThrough(torch.autograd.Function, metaclass=Bypassing):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_metaclass_bypassing_the_redirect_is_refused_by_name():
    """The Function's own metaclass hides its forward from the capture: refused by name, with the fix."""

    class Bypassed(nn.Module):
        def forward(self, x):
            return BypassingStraightThrough.apply(x) * 1.0

    before = _untouched()
    with pytest.raises(AutogradFunctionError) as info:
        predispatch.export(Bypassed(), (torch.ones(3),))
    text = message(info.value)
    assert text.startswith(
        "BypassingStraightThrough.forward was looked up through its metaclass Bypassing's own __getattribute__, "
        "which does not call FunctionMeta's: export could not capture the call, and its custom backward would be lost."
    ), text
    assert "fix: let Bypassing.__getattribute__ end in super().__getattribute__(name)" in text, text
    assert _untouched() == before


@pytest.mark.skipif(not ti.HAS.can_decompose_method, reason="torch 2.11 asks a closure: the adapter variant")
def test_decomposition_question_gone(monkeypatch):
    """A torch release without `FunctionalTensorMode._can_decompose`."""
    monkeypatch.delattr(ti.FunctionalTensorMode, "_can_decompose")
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(nn.Linear(3, 3), (torch.ones(2, 3),))
    assert message(info.value) == _drift(ti_decomposition.MECHANISM, "FunctionalTensorMode._can_decompose does not exist")


@pytest.mark.skipif(not ti.HAS.can_decompose_method, reason="torch 2.11 asks a closure: the adapter variant")
def test_decomposition_question_no_longer_asked(monkeypatch):
    """`__torch_dispatch__` stops calling `self._can_decompose`: replacing it would change nothing."""

    def dispatch_without_question(self, func, types, args=(), kwargs=None):
        raise AssertionError("not reached")

    monkeypatch.setattr(ti_decomposition, "PRISTINE_DISPATCH", dispatch_without_question)
    before = _untouched()
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(nn.Linear(3, 3), (torch.ones(2, 3),))
    assert message(info.value) == _drift(
        ti_decomposition.MECHANISM, "FunctionalTensorMode.__torch_dispatch__ no longer calls self._can_decompose"
    )
    assert _untouched() == before


def test_dispatch_observer_never_called(monkeypatch):
    """The observer placed where torch no longer dispatches: ops reach the graph unseen."""
    import contextlib

    class Unused:
        def __torch_dispatch__(self, *args):
            pass

    @contextlib.contextmanager
    def misplaced(before, after):
        with ti.patched(Unused, "__torch_dispatch__", lambda original: original, mechanism=ti.DISPATCH_OBSERVER) as hook:
            yield hook

    monkeypatch.setattr(ti, "functional_dispatch_observer", misplaced)
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(nn.Linear(3, 3), (torch.ones(2, 3),))
    assert message(info.value) == _drift(
        ti.DISPATCH_OBSERVER,
        "torch never called the replaced function, though the graph holds ops traced through FunctionalTensorMode",
    )


def test_tensor_hook_point_gone(monkeypatch):
    """`Tensor.register_hook` gone from torch.Tensor: tensor hooks could not be captured."""
    monkeypatch.delattr(torch.Tensor, "register_hook")
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(nn.Linear(3, 3), (torch.ones(2, 3),))
    assert message(info.value) == _drift(ti.TENSOR_HOOKS, "Tensor.register_hook does not exist")


def test_tensor_hook_probe_not_reached(monkeypatch):
    """Tensors no longer look `register_hook` up on torch.Tensor."""
    monkeypatch.setattr(ti, "probe_register_hook", lambda: None)
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(nn.Linear(3, 3), (torch.ones(2, 3),))
    assert message(info.value) == _drift(ti.TENSOR_HOOKS, "the probe call did not reach predispatch's replacement")


def test_new_module_hook_table(monkeypatch):
    """A torch release that keeps module hooks in a table predispatch does not know."""
    monkeypatch.setattr(ti_switches, "KNOWN_MODULE_HOOK_TABLES", ti_switches.KNOWN_MODULE_HOOK_TABLES - {"_backward_pre_hooks"})
    with pytest.raises(TorchDriftError) as info:
        predispatch.export(nn.Linear(3, 3), (torch.ones(2, 3),))
    assert message(info.value) == _drift(ti.MODULE_HOOKS, "nn.Module's hook tables changed (new: ['_backward_pre_hooks'], gone: [])")


def test_grad_toggle_not_recorded(monkeypatch):
    """make_fx stops recording `_set_grad_enabled`: a no_grad region would be lost."""
    from predispatch.trace import grad_history

    class NotANode:
        pass

    monkeypatch.setattr(grad_history.fx, "Node", NotANode)

    class Region(nn.Module):
        def forward(self, x):
            with torch.no_grad():
                y = x * 2
            return x + y

    with pytest.raises(TorchDriftError) as info:
        predispatch.export(Region(), (torch.ones(3),))
    assert message(info.value) == _drift(ti.REGION_CAPTURE, "2 grad-mode change(s) in forward were not recorded in the graph")


# --- the swap itself ----------------------------------------------------------------------------


class _Owner:
    def method(self):
        return "torch's"


def test_patched_refuses_a_missing_hook_point_and_serves_only_its_thread():
    with pytest.raises(TorchDriftError, match=r"the test hook cannot engage on torch .*: _Owner\.gone does not exist"):
        with ti.patched(_Owner, "gone", lambda original: original, mechanism="the test hook"):
            pass
    seen = {}
    with ti.patched(_Owner, "method", lambda original: lambda self: "ours", mechanism="the test hook") as hook:
        other = threading.Thread(target=lambda: seen.setdefault("other", _Owner().method()))
        other.start()
        other.join()
        seen["this"] = _Owner().method()
    assert seen == {"other": "torch's", "this": "ours"}
    assert hook.calls == 1
    assert "method" in vars(_Owner) and _Owner().method() == "torch's"
