"""`refusing_rng_changes`: forward may draw random numbers, but not reseed or restore a generator.

Note [RNG state in forward]
---------------------------
A graph records random ops (`aten.bernoulli`, `aten.rand`), which draw from the generator each
time the program runs; it has no op that reseeds or restores a generator.  A `torch.manual_seed(0)`
inside forward would run once, at export (and export puts the generator back afterwards): the
program, called later, draws from whatever state the caller's generator is in, so its outputs
and the generator's state after the call differ from eager's, which reseeds at every call (or,
under `fork_rng`, restores the state its block started from).  There is no faithful capture, so
export refuses, by three mechanisms:

- the functions that change a generator (`_CHANGERS`) raise `RngStateError` while the user's
  forward is traced, naming the user's line, before they change anything;
- a graph drawing from a generator made inside forward (`g = torch.Generator()`) would hold
  the one object made at export and continue its stream across calls, where eager starts a new
  one at each call: `refuse_generators_made_in_forward` refuses generators in the graph that
  were not visible before forward ran;
- a `torch.Generator` method called directly (`g.manual_seed(0)`, `g.set_state(s)`) cannot be
  intercepted (a C type), so the states of the generators export can see (torch's default CPU
  generator, generators kept on the module tree or in the globals and closures of its forwards)
  are compared when forward returns; a change is refused, naming the export call.

Either way a generator forward changed is put back as it was before export.  torch's own tracing
machinery (`_TRACERS`: Dynamo tracing a `torch.cond` branch saves and restores the RNG state
around its work) calls the same functions and is let through.

Other threads keep their generators (Note [Another thread's draws during an export]): the
changers refuse on the exporting thread only, a state moved only by draws is neither refused nor
put back, and after another thread called a changer meanwhile the default generator cannot be
told apart (its state is then neither checked nor put back).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import fx, nn

from predispatch import _meta
from predispatch import _torch_internals as ti
from predispatch.errors import RngStateError, user_frame
from predispatch.frontend.reachable import is_filled

#: Functions that change a generator, by module, and what each does.
_CHANGERS: dict[str, dict[str, str]] = {
    "torch": {
        "manual_seed": "reseeds the default generator",
        "seed": "reseeds the default generator from a non-deterministic seed",
        "set_rng_state": "restores the default generator's state",
    },
    "torch.random": {
        "manual_seed": "reseeds the default generator",
        "seed": "reseeds the default generator from a non-deterministic seed",
        "set_rng_state": "restores the default generator's state",
        "fork_rng": "restores the generators' states when its block ends",
    },
    **{
        module: {
            "manual_seed": "reseeds the current device's generator",
            "manual_seed_all": "reseeds every device's generator",
            "seed": "reseeds the current device's generator from a non-deterministic seed",
            "seed_all": "reseeds every device's generator from a non-deterministic seed",
            "set_rng_state": "restores a device generator's state",
            "set_rng_state_all": "restores every device generator's state",
        }
        for module in ("torch.cuda", "torch.cuda.random", "torch.xpu", "torch.xpu.random", "torch.mps")
    },
}

#: torch's tracing machinery, which saves and restores the RNG state around its own work (Dynamo
#: compiling a `torch.cond` branch, AOTAutograd): a call made from these files is let through.
_TRACERS = tuple(
    os.path.join(os.path.dirname(torch.__file__), part)
    for part in ("_dynamo", "_functorch", "_higher_order_ops", "fx", "_export", "export", "_guards.py")
)

_FIX = (
    "seed outside forward (torch.manual_seed before calling the model, and before calling "
    "ep.module()); for a stream of its own, create and seed a torch.Generator outside forward and "
    "pass it to the random ops (torch.rand(..., generator=g))."
)


@contextlib.contextmanager
def refusing_rng_changes(module: nn.Module) -> Iterator[frozenset[int]]:
    """While active, forward's changes of a generator are refused; see Note [RNG state in forward].

    Yields the identities (`ti.generator_identity`) of the generators export could see before
    forward ran, for `refuse_generators_made_in_forward`.
    """
    ti.import_dynamo()  # it rewraps torch.manual_seed on import: before the patch, not inside it
    generators = _visible_generators(module)
    record = _Changes(threading.get_ident())
    patched = _patch_changers(record)  # first: another thread's reseed from now on is recorded
    if _other_thread_inside(original for _, _, original in patched):
        record.by_other_threads = True  # a reseed begun before the patch may land after the snapshot
    before = [(g, g.get_state()) for g in generators]
    changed: list[tuple[torch.Generator, torch.Tensor]] | None = None
    try:
        yield frozenset(ti.generator_identity(g) for g in generators)
        if record.refusals:  # forward caught the refusal and went on: the export still fails
            raise record.refusals[0]
        changed = _changed_by_forward(before, record)
        if changed:
            raise RngStateError(
                f"forward changed the state of {_describe(changed[0][0])} without a call export can "
                "intercept (Generator.manual_seed, .set_state or .seed called on it directly); a graph "
                "cannot record that, so the program's random numbers would differ from eager's.",
                where=f"{user_frame()} (the export call)",
                fix=_FIX,
            )
    finally:
        _unpatch(patched)
        for g, state in changed if changed is not None else _changed_by_forward(before, record):
            g.set_state(state)


class _Changes:
    """What the changers saw during one export: the exporting thread's refusals, and whether
    another thread changed the default generator (then forward's changes of it cannot be told)."""

    def __init__(self, thread: int):
        self.thread = thread
        self.refusals: list[RngStateError] = []
        self.by_other_threads = False


def _changed_by_forward(
    before: list[tuple[torch.Generator, torch.Tensor]], record: _Changes
) -> list[tuple[torch.Generator, torch.Tensor]]:
    """The generators (with their saved states) whose state moved other than by draws (Note
    [Another thread's draws during an export]); the default one is left out once another thread
    reseeded it."""
    with ti.outside_trace():  # real tensors: read with the trace's modes set aside
        return [
            (g, state)
            for g, state in before
            if not (record.by_other_threads and g is torch.default_generator) and not ti.only_drawn_from(g, state)
        ]


def refuse_generators_made_in_forward(gm: fx.GraphModule, visible: frozenset[int]) -> None:
    """Refuse a graph drawing from a generator export could not see before forward ran.

    The graph holds the generator object itself (a `get_attr` constant): one made inside forward
    (`g = torch.Generator(); g.manual_seed(0)`) is made once, at export, so the program continues
    its stream from call to call where eager starts a fresh one at every call.
    """
    for graph_module in gm.modules():
        if not isinstance(graph_module, fx.GraphModule):
            continue
        for node in graph_module.graph.find_nodes(op="get_attr"):
            value = getattr(graph_module, node.target, None)
            if isinstance(value, torch.Generator) and ti.generator_identity(value) not in visible:
                raise RngStateError(
                    "forward draws from a torch.Generator that export could not see before forward "
                    "ran (made inside forward, or kept where export does not look): the program would "
                    "hold the one generator made at export and continue its stream from call to call, "
                    "while eager makes and seeds a new one at every call.",
                    where=_meta.stack_line(node) or f"{user_frame()} (the export call)",
                    fix="make the generator outside forward and keep it on the module "
                    "(self.generator = torch.Generator().manual_seed(0) in __init__), or draw from "
                    "torch's default generator seeded outside forward.",
                )


def _patch_changers(record: _Changes) -> list[tuple[Any, str, Any]]:
    """Replace each changer with one that refuses (into `record`); returns what to put back."""
    patched = []
    for module_name, functions in _CHANGERS.items():
        module = sys.modules.get(module_name) or _import(module_name)
        for name, effect in functions.items():
            original = getattr(module, name, None) if module is not None else None
            if callable(original):
                setattr(module, name, _refusing(f"{module_name}.{name}", effect, original, record))
                patched.append((module, name, original))
    return patched


def _other_thread_inside(functions: Iterable[Callable[..., Any]]) -> bool:
    """Whether another thread is running one of `functions` now (any frame of its stack).

    A call that began before the changers were patched goes to torch's original, unrecorded,
    and can reseed after export read the states: a false "forward changed the generator".
    CPython checks for a thread switch on entering a function, so a thread that looked the
    original up and was switched out is already inside its frame, and shows here.
    """
    codes = set()
    for function in functions:
        layer: Any = function
        while layer is not None:  # through functools.wraps layers (Dynamo rewraps manual_seed)
            if (code := getattr(layer, "__code__", None)) is not None:
                codes.add(code)
            layer = getattr(layer, "__wrapped__", None)
    me = threading.get_ident()
    for ident, top in sys._current_frames().items():
        frame: Any = top
        while ident != me and frame is not None:
            if frame.f_code in codes:
                return True
            frame = frame.f_back
    return False


def _import(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None


def _unpatch(patched: list[tuple[Any, str, Any]]) -> None:
    for module, name, original in reversed(patched):
        setattr(module, name, original)


def _refusing(qualified: str, effect: str, original: Callable[..., Any], record: _Changes) -> Callable[..., Any]:
    """`original`, refusing when called from the user's code on the exporting thread.

    Let through: another thread's call (noted in `record`), torch's tracing machinery
    (`_TRACERS`), and every call after the first refusal (a `finally:` restoring the state as
    the refusal unwinds, as `freeze_rng_state` does, must not replace the first error; the
    generators are put back when the trace ends anyway).
    """

    def changer(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() != record.thread:
            record.by_other_threads = True
            return original(*args, **kwargs)
        caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
        if caller.startswith(_TRACERS) or record.refusals:
            return original(*args, **kwargs)
        record.refusals.append(
            RngStateError(
                f"forward calls {qualified}(), which {effect}; a graph records random ops but cannot "
                "record a change of the generator, so the program's outputs and the generator's state "
                "after a call would differ from eager's.",
                where=user_frame(),
                fix=_FIX,
            )
        )
        raise record.refusals[0]

    changer.__wrapped__ = original  # type: ignore[attr-defined]
    return changer


def _visible_generators(module: nn.Module) -> list[torch.Generator]:
    """torch's default CPU generator, and the generators forward can reach by name.

    Those kept on the module tree (`self.generator`, also in a list or dict attribute) and in
    the globals and closures of each module's forward (a module-level `g = torch.Generator()`).
    """
    found = {ti.generator_identity(torch.default_generator): torch.default_generator}
    seen_globals: set[int] = set()
    for submodule in module.modules():
        values = list(vars(submodule).values())
        forward = getattr(type(submodule).forward, "__func__", type(submodule).forward)
        for fn in (forward, *(v for v in values if callable(v) and hasattr(v, "__globals__"))):
            namespace = getattr(fn, "__globals__", {})
            if id(namespace) not in seen_globals:
                seen_globals.add(id(namespace))
                values.extend(namespace.values())
            values.extend(cell.cell_contents for cell in (getattr(fn, "__closure__", None) or ()) if is_filled(cell))
        for value in values:
            for item in (value, *(_shallow_items(value))):
                if issubclass(type(item), torch.Generator):  # isinstance runs torch's Python check
                    found.setdefault(ti.generator_identity(item), item)
    return list(found.values())


def _shallow_items(value: Any) -> tuple[Any, ...]:
    """The items of a list, tuple or dict attribute (one level: where modules keep generators)."""
    if isinstance(value, (list, tuple)):
        return tuple(value)
    if isinstance(value, dict):
        return tuple(value.values())
    return ()


def _describe(generator: torch.Generator) -> str:
    if generator is torch.default_generator:
        return "torch's default CPU generator (torch.default_generator)"
    return "a torch.Generator the module reaches"
