"""`ep.module()`'s graph runs only as `ep.module()`: a new GraphModule built over it is refused at its first call.

Note [A GraphModule built over ep.module()'s graph]
---------------------------------------------------
`fx.GraphModule(m, m.graph)` makes a plain GraphModule of `ep.module()`'s graph; torchao's
`prepare_pt2e(ep.module(), quantizer)` and `prepare_qat_pt2e(...)` (the first route a PT2E user
tries) do exactly that (torchao/quantization/pt2e/prepare.py).  The new module has none of the
program module's call contract: no input checks, no write-back checks, no train/eval guard
(`move_exported_model_to_eval` on it silently keeps dropout on, since the graph holds the
functional dropout PT2E's patterns do not match), and PT2E's conv+BN rewrite leaves the
write-back of the batch-norm statistics reading tensors the backward needs (torch's raw
"modified by an inplace operation" at the first training step).

The graph's code generator travels with the graph (GraphModule shares it), so `OwnedCodeGen`
puts one line in the generated `forward`, `check_owner(self)`, which passes for a
`ProgramModule` and raises `ModuleCopyError`, naming the routes that work, for anything else.
It is not a graph node: FX passes (`eliminate_dead_code`, `torch.fx.Interpreter`, subgraph
rewriting) see the graph exactly as before, and an Interpreter, which runs the nodes and not the
generated code, still runs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import ModuleCopyError, user_frame

#: The name the generated code calls the check by (a global of that code only).
_CHECK = "_predispatch_check_owner"


def check_owner(module: nn.Module) -> None:
    """Raise `ModuleCopyError` unless `module` (the generated forward's `self`) is a program module."""
    from predispatch.runtime.runner import ProgramModule  # runner imports this module's users

    if isinstance(module, ProgramModule):
        return
    raise ModuleCopyError(
        f"this {type(module).__name__} was built over ep.module()'s graph (as torchao's prepare_pt2e/"
        "prepare_qat_pt2e(ep.module(), quantizer) do): it would run without ep.module()'s input checks, "
        "write-back and train/eval guard, and PT2E's patterns do not match its functional graph "
        "(dropout would stay on after move_exported_model_to_eval; conv+BN training fails), so it is refused.",
        where=user_frame(),
        fix="give PT2E torch's IR: prepare_qat_pt2e(ep.to_torch().module(), quantizer) for QAT, "
        "prepare_pt2e(ep.to_torch(for_inference=True).module(), quantizer) for PTQ "
        "(docs/comparison.md#training-routes).",
    )


class OwnedCodeGen(ti.PyTreeCodeGen):
    """ep.module()'s pytree code generator, whose forward first calls `check_owner(self)`."""

    def gen_fn_def(self, *args: Any, **kwargs: Any) -> str:
        """The def line and pytree bindings, then the owner check (fx counts the line in its line map)."""
        definition: str = super().gen_fn_def(*args, **kwargs)
        return f"{definition}\n    {_CHECK}(self)"

    def _gen_python_code(self, *args: Any, **kwargs: Any) -> Any:
        """fx's generated code, with the check among its globals."""
        code = super()._gen_python_code(*args, **kwargs)
        code.globals[_CHECK] = check_owner
        return code
