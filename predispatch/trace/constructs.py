"""Constructs inside forward that export refuses by name, with the fix that fits each.

Each was a raw torch error (or a program that differs from eager) before: the user got
"Attempting to use FunctionalTensor on its own" for a `torch.func.vmap`, an AttributeError
from our own code for a TorchScript submodule, and for `nn.TransformerEncoder` in eval with a
padding mask a program whose padded positions differ from eager's `torch.no_grad()` output.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import TraceError, UnsupportedConstructError, user_frame

#: The torch.func files a transform's call passes through (torch/_functorch/...).
_FUNCTORCH_FILES = ("apis.py", "eager_transforms.py", "vmap.py")
_FUNCTIONAL_ON_ITS_OWN = "Attempting to use FunctionalTensor on its own"


def torch_func_refusal(exc: BaseException) -> UnsupportedConstructError | None:
    """Our error for a torch.func transform called inside forward, when `exc` is torch's.

    functorch's transforms wrap their inputs in their own tensor levels, under which the
    export's FunctionalTensorMode is not active: torch raises "Attempting to use
    FunctionalTensor on its own".  Exporting them needs functorch's interpreters to run
    under the functional pre-dispatch trace, which predispatch does not do yet."""
    if _FUNCTIONAL_ON_ITS_OWN not in str(exc):
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    if not any("_functorch" in f.filename and os.path.basename(f.filename) in _FUNCTORCH_FILES for f in frames):
        return None
    return UnsupportedConstructError(
        "forward calls a torch.func transform (vmap, grad, grad_and_value, jacrev, jacfwd, vjp, hessian); "
        "export does not capture torch.func transforms yet.",
        where=user_frame(exc.__traceback__),
        fix="export the function the transform is applied to and apply torch.func to the program "
        "(torch.func.vmap(ep.module())(x) works); or write the batched computation with batched ops "
        "(a leading batch dimension, torch.bmm) instead of vmap.",
    )


def refuse_script_modules(root: nn.Module) -> None:
    """Refuse a TorchScript module in the tree: its forward is TorchScript's interpreter, not
    Python, so the trace cannot see its ops (nor its state as the module's own)."""
    for path, module in root.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            name = f"submodule {path!r}" if path else "the module"
            raise UnsupportedConstructError(
                f"{name} is a TorchScript module (torch.jit.script / torch.jit.trace); export traces "
                "Python code, and a scripted module runs in TorchScript's interpreter.",
                where=f"{user_frame()} (the export call)",
                fix="export the original nn.Module (before torch.jit.script), e.g. keep a reference to it "
                "and assign that as the submodule for export.",
            )


_ENCODER_FAST_PATH = "nn.TransformerEncoder fast-path check (TransformerEncoder.forward)"


@contextlib.contextmanager
def refusing_encoder_fast_path() -> Iterator[None]:
    """Refuse `nn.TransformerEncoder` where eager's `torch.no_grad()` call takes the nested-tensor
    fast path, while the trace (grad on, parameters requiring grad) takes the slow path: in eval
    mode with a `src_key_padding_mask`, eager's fast path returns 0 at padded positions and the
    program returns what the layers compute there."""

    def make(original: Any) -> Any:
        def forward(self: nn.TransformerEncoder, src: Any, mask: Any = None, src_key_padding_mask: Any = None, *a: Any, **kw: Any):
            if not self.training and getattr(self, "use_nested_tensor", False) and src_key_padding_mask is not None:
                raise UnsupportedConstructError(
                    "nn.TransformerEncoder in eval mode with a src_key_padding_mask: eager under torch.no_grad() "
                    "takes its nested-tensor fast path and returns 0 at padded positions, the exported program "
                    "computes the layers there (eager's path with grad on); their outputs differ.",
                    where=user_frame(),
                    fix="build the encoder with enable_nested_tensor=False (or set encoder.use_nested_tensor = False "
                    "before export): eager then returns the layers' values at padded positions too, and so does the "
                    "program; mask the padded positions of the output yourself if you need zeros there.",
                )
            return original(self, src, mask, src_key_padding_mask, *a, **kw)

        return forward

    with ti.patched(nn.TransformerEncoder, "forward", make, mechanism=_ENCODER_FAST_PATH):
        yield


_PROPERTY_ERRORS = "property errors under nn.Module.__getattr__ (make_fx's _orig_module_getattr)"


class _Probe(nn.Module):
    """A module the probe asks for a missing attribute."""


@contextlib.contextmanager
def naming_property_errors() -> Iterator[None]:
    """An AttributeError raised inside a module's property is raised as ours, naming the property.

    Python answers an AttributeError from a property by calling the class's `__getattr__`, and
    `nn.Module.__getattr__` raises its own "'Linear' object has no attribute 'weight'" with the
    property's error dropped (not even chained): a parametrization or a SimpleFSDP-style
    gathered parameter failing under the trace (a DTensor attribute a FunctionalTensor lacks)
    read as a missing parameter.  When torch's `__getattr__` fails for a name that is a property
    of the class, the property is run again to catch its own error, which is raised as a
    TraceError naming the property and the line inside it that failed.

    While the trace runs, `nn.Module.__getattr__` is make_fx's wrapper, which calls torch's
    original through the module global `_orig_module_getattr` of torch/fx/_symbolic_trace.py,
    read at each call: that global is what is replaced (`ti.FX_MODULE_GETATTR`).  Not
    `nn.Module.__getattr__` itself: Dynamo, which traces `torch.cond`'s branches, would trace
    into the replacement and fail to capture the branch.  The probe reaches the global as the
    wrapper does; tests/test_errors.py shows the property named on every tested release.
    """

    def make(original: Any) -> Any:
        def __getattr__(self: nn.Module, name: str) -> Any:
            try:
                return original(self, name)
            except AttributeError:
                getter = _property_getter(type(self), name)
                if getter is None:
                    raise
                try:
                    getter(self)
                except AttributeError as inner:
                    raise _property_error(type(self), name, inner) from None
                raise

        return __getattr__

    fx_owner, fx_name = ti.FX_MODULE_GETATTR
    with ti.patched(fx_owner, fx_name, make, mechanism=_PROPERTY_ERRORS, probe=_probe_fx_getattr):
        yield


def _probe_fx_getattr() -> None:
    """As FX's `module_getattr_wrapper` calls it: the module global, looked up at call time."""
    owner, name = ti.FX_MODULE_GETATTR
    getattr(owner, name)(_Probe(), "_predispatch_probe_missing")


def _property_getter(cls: type, name: str) -> Any:
    """The getter of property `name` of `cls` (searched along its MRO as Python does), or None."""
    for klass in cls.__mro__:
        if name in vars(klass):
            found = vars(klass)[name]
            return found.fget if isinstance(found, property) else None
    return None


def _property_error(cls: type, name: str, inner: AttributeError) -> TraceError:
    error = TraceError(
        f"property {cls.__name__}.{name} raised AttributeError: {inner}; nn.Module.__getattr__ would "
        f"have reported it as a missing attribute {name!r}.",
        where=user_frame(inner.__traceback__),
        fix="the named line inside the property failed under tracing; torch's error is kept as "
        "err.torch_error. A property that gathers a DTensor parameter (SimpleFSDP, parametrizations of "
        "DTensors) is not supported yet: see docs/distributed.md.",
    )
    error.torch_error = inner
    return error
