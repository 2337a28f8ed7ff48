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
puts one line in the generated `forward`, `check_owner(self, pure_eval)`, which passes for a
`ProgramModule` and raises `ModuleCopyError`, naming the routes that work, for anything else,
except a module that is not for QAT over an eval program that writes nothing back (`pure_eval`):
that graph computes the same in any GraphModule, and PTQ on it gives the documented route's
model bitwise (tests/test_consumers.py).
It is not a graph node: FX passes (`eliminate_dead_code`, `torch.fx.Interpreter`, subgraph
rewriting) see the graph exactly as before, and an Interpreter, which runs the nodes and not the
generated code, still runs.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from predispatch import _torch_internals as ti
from predispatch.errors import ModuleCopyError, user_frame
from predispatch.runtime.runner import ProgramModule

#: The name the generated code calls the check by (a global of that code only).
_CHECK = "_predispatch_check_owner"

#: Where torchao's `prepare` (pt2e/prepare.py, `_save_state`) records whether the module it
#: built is for QAT: `module.meta[_PT2E_STATE].is_qat`.  Read to name the route that works and
#: to refuse QAT on an eval program (its batch norm is not the `aten.batch_norm` PT2E's QAT
#: conv+BN fusion matches: no fusion, other numbers than `ep.to_torch().module()`'s).
_PT2E_STATE = "_observed_graph_module_attrs"


def check_owner(module: nn.Module, pure_eval: bool) -> None:
    """Raise `ModuleCopyError` unless `module` (the generated forward's `self`) is a program
    module, or runs an eval program that writes nothing back (`pure_eval`) for anything but
    QAT: such a graph computes the same in any GraphModule, as PTQ on it gives
    `ep.to_torch(for_inference=True)`'s model (tests/test_consumers.py)."""
    if isinstance(module, ProgramModule):
        return
    qat = bool(getattr(getattr(module, "meta", {}).get(_PT2E_STATE), "is_qat", False))
    if pure_eval and not qat:
        return
    what = ("its graph is ep.module()'s eval graph, whose batch norm PT2E's QAT conv+BN fusion does not match"
            if pure_eval else
            "PT2E's patterns do not match its functional graph (dropout would stay on after "
            "move_exported_model_to_eval; conv+BN training fails)")
    raise ModuleCopyError(
        f"this {type(module).__name__} was built over ep.module()'s graph (as torchao's "
        f"{'prepare_qat_pt2e' if qat else 'prepare_pt2e'}(ep.module(), quantizer) does): it would run without "
        f"ep.module()'s input checks, write-back and train/eval guard, and {what}, so it is refused.",
        where=user_frame(),
        fix=_QAT_FIX if qat else _PTQ_FIX,
    )


_QAT_FIX = ("give PT2E torch's training IR: prepare_qat_pt2e(ep.to_torch().module(), quantizer) "
            "(docs/comparison.md#training-routes).")
_PTQ_FIX = ("for QAT, prepare_qat_pt2e(ep.to_torch().module(), quantizer); for PTQ, export the model in eval mode "
            "(predispatch.export(model.eval(), args)) and give PT2E prepare_pt2e(ep.to_torch(for_inference=True)"
            ".module(), quantizer) (docs/comparison.md#training-routes).")


class OwnedCodeGen(ti.PyTreeCodeGen):
    """ep.module()'s pytree code generator, whose forward first calls `check_owner(self, pure_eval)`."""

    def __init__(self, pytree_info: Any, pure_eval: bool):
        """`pure_eval`: the program was exported in eval mode and writes nothing back."""
        super().__init__(pytree_info)
        self.pure_eval = pure_eval

    def gen_fn_def(self, *args: Any, **kwargs: Any) -> str:
        """The def line and pytree bindings, then the owner check (fx counts the line in its line map)."""
        definition: str = super().gen_fn_def(*args, **kwargs)
        return f"{definition}\n    {_CHECK}(self, {self.pure_eval})"

    def _gen_python_code(self, *args: Any, **kwargs: Any) -> Any:
        """fx's generated code, with the check among its globals."""
        code = super()._gen_python_code(*args, **kwargs)
        code.globals[_CHECK] = check_owner
        return code
