"""`torch.inference_mode()` inside forward, traced as the grad-mode region it is.

Note [inference_mode in forward]
--------------------------------
`torch.inference_mode()` turns grad mode off (and `inference_mode(False)` turns it on) through
a C++ guard, `torch._C._InferenceMode`, that calls no Python: the trace saw nothing, so the
program differentiated through code eager runs without autograd (gradients where eager has
none).  During the trace its `__enter__`/`__exit__` are those of `torch.set_grad_enabled(not
mode)`, whose toggles the trace records and `wrap_regions` nests as a
`wrap_with_set_grad_enabled` region, exactly as for `torch.no_grad()`:

    with torch.inference_mode():             wrap_with_set_grad_enabled(False, grad_region_0, x, ...)
        y = self.lin(x)                  ->      linear(x, p_lin_weight, p_lin_bias)

Values and gradients are eager's.  What the program does not reproduce is the *inference
tensor* flag on what the region creates: where eager raises later ("Inference tensors cannot
be saved for backward", an in-place update of one outside the mode), the program computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from predispatch import _torch_internals as ti

_MECHANISM = "inference_mode regions (torch.inference_mode.__enter__/__exit__)"


def _enter(original: Any) -> Any:
    def __enter__(self: torch.inference_mode) -> None:
        # made, it sets the mode (its `__enter__` would set it again: a second region's start)
        self._as_grad_mode = torch.set_grad_enabled(not self.mode)  # type: ignore[attr-defined]

    return __enter__


def _exit(original: Any) -> Any:
    def __exit__(self: torch.inference_mode, *exc: Any) -> None:
        entered = vars(self).pop("_as_grad_mode", None)  # None: `__enter__` was only probed
        if entered is not None:
            entered.__exit__(*exc)  # grad_mode.py's __exit__: the trace sees a region's end

    return __exit__


def _probe() -> None:
    """Run before the trace starts (its toggles are not recorded)."""
    with torch.inference_mode():
        pass


@contextlib.contextmanager
def inference_mode_as_grad_mode() -> Iterator[None]:
    """While active, `torch.inference_mode(mode)` acts as `torch.set_grad_enabled(not mode)`
    (Note [inference_mode in forward])."""
    with ti.patched(torch.inference_mode, "__exit__", _exit, mechanism=_MECHANISM):
        with ti.patched(torch.inference_mode, "__enter__", _enter, mechanism=_MECHANISM, probe=_probe):
            yield
