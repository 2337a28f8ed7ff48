"""predispatch's own operators, in the `predispatch` op namespace.

These are the only non-aten ops our passes add to a graph; each is functional, has a fake
(meta) kernel, and an autograd formula, so programs that contain them trace, run and
differentiate like any other.  See Note [Mutations inside grad regions].
"""

from __future__ import annotations

import torch


@torch.library.custom_op("predispatch::keep_history", mutates_args=())
def keep_history(value: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """`value`'s data with `history`'s autograd history: the functional form of an in-place
    update made while grad mode was off (gradients flow to `history` as through identity)."""
    return value.clone()


@keep_history.register_fake
def _keep_history_fake(value: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)


def _keep_history_backward(ctx, grad: torch.Tensor):
    return None, grad


keep_history.register_autograd(_keep_history_backward)
