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
from predispatch.errors import UnsupportedConstructError, user_frame

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
