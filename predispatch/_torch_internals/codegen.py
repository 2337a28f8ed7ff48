"""FX code generation, size symbols and op registries, for building programs and reading them
from files: lazily generated GraphModule code, the names FX reserves, the symbols a stored
shape declares, the dispatcher's op names and torch's joint export for ExecuTorch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule




def fx_reserved_names() -> frozenset[str]:
    """Names FX's code generator will not give a node (Python keywords, builtins such as
    `input`, and its own globals such as `torch`, `inf`): it renames such a node `input_1`."""
    from torch.fx.graph import _illegal_names

    return frozenset(_illegal_names)


def declare_size_symbol(fake_mode: FakeTensorMode, name: str, low: int, high: int | None, hint: int) -> Any:
    """A size symbol named `name` in `fake_mode`'s ShapeEnv, with its range and example value.

    For a loaded program: its graph's fake tensors get the symbols the exporting trace had
    (same names, same ranges), so printing, `to_torch()`'s range_constraints and the call
    check see what the original saw.  torch's own symbols are integer and positive.
    """
    import sympy
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges

    env = fake_mode.shape_env
    symbol = sympy.Symbol(name, integer=True, positive=True)
    env.backed_var_to_val[symbol] = sympy.Integer(hint)
    env.var_to_range[symbol] = ValueRanges(low, int_oo if high is None else high)
    return symbol


def size_symint(fake_mode: FakeTensorMode, expr: Any, hint: int | None) -> torch.SymInt:
    """A SymInt for `expr` (over symbols from `declare_size_symbol` and
    `declare_unbacked_symbol`; hint None where it has unbacked ones) in `fake_mode`."""
    return fake_mode.shape_env.create_symintnode(expr, hint=hint)


def size_functions() -> dict[str, Any]:
    """torch's sympy functions of its size arithmetic, by the name sympy prints them with
    (`Max`, `Min`, `Mod`, `FloorDiv`): what a loaded size is rebuilt from, so that it is made
    of the classes torch's own ShapeEnv makes (torch's Max and Min, not sympy's)."""
    from torch.utils._sympy.functions import FloorDiv, Max, Min, Mod

    return {"Max": Max, "Min": Min, "Mod": Mod, "FloorDiv": FloorDiv}


def symbolic_bool(fake_mode: FakeTensorMode, expr: Any) -> torch.SymBool:
    """A SymBool for the relation `expr` in `fake_mode` (node meta of `u0 < 3`)."""
    return fake_mode.shape_env.create_symboolnode(expr)


def declare_unbacked_symbol(fake_mode: FakeTensorMode, name: str, index: int, low: int | None, high: int | None) -> Any:
    """The unbacked symbol `u<index>` (a value known only when the program runs: a while_loop's
    int carry) in `fake_mode`'s ShapeEnv, with its range, as `create_unbacked_symint` makes it
    (integer, no value), under its saved name; the env's counter moves past it, so a symbol
    a later trace in this mode creates gets a fresh name."""
    import sympy
    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import ValueRanges

    env = fake_mode.shape_env
    symbol = sympy.Symbol(name, integer=True)
    env.var_to_range[symbol] = ValueRanges(-int_oo if low is None else low, int_oo if high is None else high)
    env.unbacked_symint_counter = max(env.unbacked_symint_counter, index + 1)
    return symbol


def unbacked_symbols(value: torch.SymInt | torch.SymBool) -> dict[str, tuple[int | None, int | None]]:
    """The unbacked symbols (torch's `u0`, values known only at run time) `value` is made of,
    each with its range in `value`'s ShapeEnv (None where unbounded)."""
    import sympy
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    node = value.node
    ranges = {}
    for symbol in sorted(free_unbacked_symbols(node.expr), key=str):
        vr = node.shape_env.var_to_range[symbol]
        ranges[str(symbol)] = tuple(int(b) if isinstance(b, sympy.Integer) else None for b in (vr.lower, vr.upper))
    return ranges


def symbol_ranges(fake_mode_or_env: Any, symbols: Any) -> dict:
    """torch.export's `range_constraints` for `symbols`: each one's ValueRanges in the ShapeEnv."""
    env = getattr(fake_mode_or_env, "shape_env", fake_mode_or_env)
    return {s: env.var_to_range[s] for s in symbols}
def dispatcher_op_names() -> frozenset[str]:
    """`ns::name.overload` (`ns::name` for the default overload) of every op the dispatcher holds.

    TorchScript's interpreter builtins (`aten::len.t`, `aten::save`) are JIT operators only and
    are not listed, though `torch.ops.aten.<name>` resolves them too.
    """
    return frozenset(torch._C._dispatch_get_all_op_names())


def jit_op_schemas() -> list[torch._C.FunctionSchema]:
    """The schema of every op `torch.ops` can resolve: dispatcher ops and TorchScript builtins."""
    return list(torch._C._jit_get_all_schemas())


def import_dynamo() -> None:
    """Import `torch._dynamo` now, before export patches torch's seeding functions.

    Importing it replaces `torch.manual_seed` by a Dynamo-disabled copy.  Export patches that
    function while forward runs (trace/rng.py) and the trace imports Dynamo lazily; imported
    inside that window, Dynamo would wrap the patch and the restore would drop its wrapper.
    `import predispatch` stays free of Dynamo: only an export pays for it.
    """
    import torch._dynamo  # noqa: F401


def generate_code(gm: torch.fx.GraphModule) -> None:
    """Generate `gm`'s Python code from its graph now, as a plain GraphModule: one the trace
    made lazily (`trace_program`) becomes a GraphModule like any other, so the program holds
    no lazy module (whose code would be made at its first call or print)."""
    if isinstance(gm, LazyGraphModule):

        class GraphModuleImpl(torch.fx.GraphModule):  # what GraphModule.__new__ makes per instance
            pass

        # the name subgraphs are known by (a captured Function's `straight_through`)
        GraphModuleImpl.__name__, GraphModuleImpl.__qualname__ = type(gm).__name__, type(gm).__qualname__
        gm.__class__ = GraphModuleImpl
    gm.recompile()


def torch_function_disabled() -> Any:
    """A context in which Python code reads tensors (`.shape`, `.stride()`, storages) without
    the running trace's torch-function modes seeing each read: each costs a trip through the
    mode stack, and torch's metadata mode would record the read as the `torch_fn` of the next
    node created.  Dispatch modes (functionalization, the proxy tracer) are untouched."""
    return torch._C.DisableTorchFunction()


def import_op_registrations() -> None:
    """Import the torch modules that register ops in the namespaces the allow list decides.

    `prims.inductor_*`, `prims.fma`, `prims._low_memory_max_pool_*` ... are registered when
    `torch._inductor` is imported: without this the registry, and so the allow list generated
    from it, would depend on whether the process had compiled anything before.
    """
    import torch._inductor.inductor_prims  # noqa: F401


# --- torch's joint export for ExecuTorch's training runtime (program/exported_program.py) -----


def export_forward_backward(ep: Any, loss_index: int = 0) -> Any:
    """torch's `_export_forward_backward`: the program's joint forward-backward graph with the
    loss marked (LOSS_OUTPUT) and the gradients as GRADIENT_TO_PARAMETER outputs, the form
    ExecuTorch's training runtime reads (torch.export.experimental, torch 2.13)."""
    from torch.export.experimental import _export_forward_backward

    return _export_forward_backward(ep, joint_loss_index=loss_index)
