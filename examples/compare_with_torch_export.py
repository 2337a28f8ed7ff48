"""Export the same modules with torch.export and with predispatch, print the graphs, and measure.

    python examples/compare_with_torch_export.py             # every case: graphs, then a summary
    python examples/compare_with_torch_export.py --summary   # the summary table only
    python examples/compare_with_torch_export.py --case custom_backward
    python examples/compare_with_torch_export.py --strict    # add torch.export(strict=True) (Dynamo)

For each case, three exporters:

    torch.export            torch.export.export(m, args, strict=False)
    torch.export+decomp     the same, then .run_decompositions({})  (the functional form)
    predispatch             predispatch.export(m, args)

and, for each program, what it contains (in-place ops, grad-mode regions, autograd.Function
backward) and whether running it (`ep.module()`) gives eager's outputs, gradients and buffer
updates.  docs/comparison.md discusses the results.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import fx, nn

import predispatch
from predispatch.program.printing import format_graph


# ---- the modules


class DetachedDouble(nn.Module):
    """A no_grad region: d(out)/dx is 1, not 3."""

    def forward(self, x):
        with torch.no_grad():
            y = 2 * x
        return x + y


class GradInsideNoGrad(nn.Module):
    """enable_grad inside the caller's no_grad (gradient checkpointing, meta-learning inner loops)."""

    def forward(self, x):
        with torch.enable_grad():
            return x * x


class InPlace(nn.Module):
    """In-place ops on a buffer and an intermediate."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count.add_(1)
        return self.lin(x).relu_() + self.count


class MutatedUnderNoGrad(nn.Module):
    """An intermediate updated in place under no_grad keeps its autograd history in eager."""

    def forward(self, x):
        h = x * 3
        with torch.no_grad():
            h.mul_(2)
        return h * x


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 10 * x  # a custom gradient, not the derivative of forward (2x)


class CustomBackward(nn.Module):
    def forward(self, x):
        return Square.apply(x) + 1


class Attention(nn.Module):
    """Composites: linear, layer_norm, scaled_dot_product_attention."""

    def __init__(self):
        super().__init__()
        self.norm, self.qkv = nn.LayerNorm(8), nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        return F.scaled_dot_product_attention(q, k, v)


@dataclass(frozen=True)
class Case:
    make: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    outer_no_grad: bool = False  # run programs inside the caller's torch.no_grad()


CASES = {
    "no_grad_region": Case(DetachedDouble, lambda: (torch.randn(3),)),
    "enable_grad_under_caller_no_grad": Case(GradInsideNoGrad, lambda: (torch.randn(3),), outer_no_grad=True),
    "in_place_ops": Case(InPlace, lambda: (torch.randn(2, 4),)),
    "mutation_under_no_grad": Case(MutatedUnderNoGrad, lambda: (torch.randn(3),)),
    "custom_backward": Case(CustomBackward, lambda: (torch.randn(3),)),
    "composites": Case(Attention, lambda: (torch.randn(2, 5, 8),)),
}


# ---- the exporters


def torch_export(m: nn.Module, args: tuple):
    return torch.export.export(m, args, strict=False)


def torch_export_strict(m: nn.Module, args: tuple):
    return torch.export.export(m, args, strict=True)


def torch_export_decomposed(m: nn.Module, args: tuple):
    return torch.export.export(m, args, strict=False).run_decompositions({})


EXPORTERS: dict[str, Callable[[nn.Module, tuple], object]] = {
    "torch.export": torch_export,
    "torch.export+decomp": torch_export_decomposed,
    "predispatch": predispatch.export,
}


# ---- what a program contains


def all_nodes(gm: fx.GraphModule):
    for module in gm.modules():
        if isinstance(module, fx.GraphModule):
            yield from module.graph.nodes


def contents(gm: fx.GraphModule) -> dict[str, object]:
    targets = [n.target for n in all_nodes(gm) if n.op == "call_function"]
    in_place = sorted({t.name() for t in targets if isinstance(t, torch._ops.OpOverload) and t._schema.is_mutable})
    names = [getattr(t, "__name__", str(t)) for t in targets]
    return {
        "in-place ops": ", ".join(in_place) or "none",
        "grad regions": names.count("wrap_with_set_grad_enabled"),
        "Function backward kept": "yes" if "autograd_function_apply" in names else "no",
        "composites kept": ", ".join(sorted({t.name().split("::")[1] for t in targets if isinstance(t, torch._ops.OpOverload)
                                            and torch._C._dispatch_has_kernel_for_dispatch_key(t.name(), "CompositeImplicitAutograd")})) or "none",
    }


# ---- does running it match eager?


def run(module: nn.Module, args: tuple, outer_no_grad: bool):
    """Outputs, their requires_grad, input and parameter gradients, and buffers after one call."""
    args = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone().requires_grad_(t.is_floating_point()), args)
    with torch.no_grad() if outer_no_grad else torch.enable_grad():
        out = module(*args)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    live = [t for t in outs if t.requires_grad]
    if live and not outer_no_grad:
        torch.autograd.backward([t.float().sum() for t in live])
    grads = [a.grad for a in args] + [p.grad for _, p in sorted(module.named_parameters())]
    buffers = [b for _, b in sorted(module.named_buffers())]
    return outs, [t.requires_grad for t in outs], grads, buffers


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-4)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def matches_eager(program: nn.Module, eager: nn.Module, case: Case, args: tuple) -> str:
    e_out, e_req, e_grads, e_bufs = run(eager, args, case.outer_no_grad)
    p_out, p_req, p_grads, p_bufs = run(program, args, case.outer_no_grad)
    wrong = [name for name, ok in [("outputs", same(p_out, e_out)), ("requires_grad", p_req == e_req),
                                   ("gradients", same(p_grads, e_grads)), ("buffers", same(p_bufs, e_bufs))] if not ok]
    return "yes" if not wrong else "NO: " + ", ".join(wrong)


# ---- how often each exporter runs the user's forward, and how long it takes


_CALLS = {"forward": 0}  # outside the module: torch.export restores a module's own attributes


class CountCalls(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        _CALLS["forward"] += 1
        return self.inner(*args)


def forward_calls(exporter, case: Case) -> int:
    _CALLS["forward"] = 0
    exporter(CountCalls(case.make()), case.inputs())
    return _CALLS["forward"]


def seconds(exporter, case: Case, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        module, args = case.make(), case.inputs()
        start = time.perf_counter()
        exporter(module, args)
        best = min(best, time.perf_counter() - start)
    return best


def compare(name: str, case: Case, show_graphs: bool) -> list[dict[str, object]]:
    torch.manual_seed(0)
    eager, args = case.make(), case.inputs()
    rows = []
    for label, exporter in EXPORTERS.items():
        ep = exporter(copy.deepcopy(eager), args)
        if show_graphs:
            print(f"--- {label}")
            print(format_graph(ep.graph_module))
            print()
        row = {"case": name, "exporter": label, **contents(ep.graph_module)}
        row["runs like eager"] = matches_eager(ep.module(), copy.deepcopy(eager), case, args)
        row["forward calls"] = forward_calls(exporter, case)
        row["seconds"] = f"{seconds(exporter, case):.2f}"
        rows.append(row)
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + " --- |" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", action="store_true", help="print only the summary table")
    parser.add_argument("--case", choices=sorted(CASES), action="append", help="run only these cases")
    parser.add_argument("--strict", action="store_true", help="also export with torch.export(strict=True) (Dynamo)")
    ns = parser.parse_args()
    if ns.strict:
        EXPORTERS["torch.export strict"] = torch_export_strict
    print(f"torch {torch.__version__}, predispatch {predispatch.__version__}\n")
    rows = []
    for name in ns.case or CASES:
        if not ns.summary:
            print(f"===== {name}: {CASES[name].make.__doc__ or CASES[name].make.__name__}\n")
        rows += compare(name, CASES[name], show_graphs=not ns.summary)
    print(markdown(rows))


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")  # torch.export's deprecation notices are not the point here
    main()
