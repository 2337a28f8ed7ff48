"""while_loop files across torch releases: one release saves, every release loads.

    python tests/while_loop_across_torch.py save DIR      # with each torch: writes DIR/<torch>-<case>.pd/.pt
    python tests/while_loop_across_torch.py load DIR      # with each torch: loads every file in DIR

Each saved program comes with the saving process's eager outputs and gradients; the loading
process runs the loaded `module()` on the same inputs and compares, bitwise.  Run with the
releases' venvs (PYTHONPATH at the repository root): a manual check, as no venv holds two torch.
"""

from __future__ import annotations

import copy
import glob
import os
import sys

import torch
import torch.utils._pytree as pytree

import predispatch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: Cases that run without grad: torch's while_loop takes no int carry under autograd; .item()
#: of a tensor that requires grad would differentiate nothing.
NO_GRAD = ("int_carry", "item")


def cases() -> dict:
    from test_serialize import WHILE_LOOPS, IntCountedLoop, ItemScale, ReadsLoopOffset

    return {**WHILE_LOOPS, "int_carry": lambda: (IntCountedLoop(), (torch.randn(4, 8),), {}),
            "reads_offset": lambda: (ReadsLoopOffset(), (torch.randn(4, 8),), {}),
            "item": lambda: (ItemScale(), (torch.tensor([1.5, 2.5, 3.0]),), {})}


def run(module: torch.nn.Module, args: tuple, grad: bool) -> tuple:
    """Outputs, input gradients and parameter gradients of one call."""
    args = tuple(a.detach().clone().requires_grad_(grad and a.is_floating_point()) for a in args)
    out = module(*args)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward([o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad])
    grads = {k: p.grad for k, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    return [o.detach() if isinstance(o, torch.Tensor) else o for o in outs], [a.grad for a in args], grads


def save(directory: str) -> None:
    tag = torch.__version__.split("+")[0]
    for name, make in cases().items():
        torch.manual_seed(0)
        model, args, _ = make()
        predispatch.save(predispatch.export(model, args), os.path.join(directory, f"{tag}-{name}.pd"))
        calls = [args] + ([(args[0], torch.tensor(n)) for n in (0, 7)] if name == "data_trip_count" else [])
        expected = [(c, run(copy.deepcopy(model), c, name not in NO_GRAD)) for c in calls]
        torch.save(expected, os.path.join(directory, f"{tag}-{name}.pt"))


def load(directory: str) -> None:
    def same(a, b):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            assert a == b, (a, b)

    for path in sorted(glob.glob(os.path.join(directory, "*.pd"))):
        name = os.path.basename(path)[:-3].split("-", 1)[1]
        module = predispatch.load(path).module()
        for args, expected in torch.load(path[:-3] + ".pt"):
            pytree.tree_map(same, run(module, args, name not in NO_GRAD), expected)
        print(f"torch {torch.__version__} loads {os.path.basename(path)}: eager's results, bitwise")


if __name__ == "__main__":
    {"save": save, "load": load}[sys.argv[1]](sys.argv[2])
