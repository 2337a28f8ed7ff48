"""Reseeding, restoring or forking a generator inside forward is refused (Note [RNG state in forward]).

A graph records random ops but not a change of the generator: a program exported from such a
forward would draw other numbers than eager and leave the generator elsewhere.  Each variant is
refused with `RngStateError` naming the user's line, and leaves the module, the generators and
torch's functions exactly as they were.  Random draws themselves (default generator, or one the
module keeps) still export and match eager bitwise.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # noqa: F401  (importing it rewraps torch.manual_seed; export imports it, so snapshots come after)
import torch.nn.functional as F
from helpers import stable_message as message
from torch import nn

import predispatch
from predispatch import _torch_internals as ti
from predispatch.errors import RngStateError

#: Cases whose forward passes a `torch.Generator` to a random op, which FX records from torch 2.13 on.
_GENERATOR_CASES = {"module_generator", "global_generator", "generator_made_in_forward"}
needs_generator_in_graph = pytest.mark.skipif(
    not ti.HAS.generator_in_graph,
    reason="torch 2.11 and 2.12's FX cannot record a Generator argument; test_generator_argument_refused_before_torch_2_13 pins the refusal",
)

#: A module-level generator, reached by forward through its globals.
GLOBAL_GENERATOR = torch.Generator().manual_seed(7)


class Seeded(nn.Module):
    """Runs `body(self, x)`; keeps a generator of its own and a buffer."""

    def __init__(self, body):
        super().__init__()
        self.body = body
        self.generator = torch.Generator().manual_seed(3)
        self.register_buffer("scale", torch.full((4,), 2.0))

    def forward(self, x):
        return self.body(self, x) * self.scale


def _manual_seed(m, x):
    torch.manual_seed(0)
    return F.dropout(x, 0.5)


def _random_manual_seed(m, x):
    torch.random.manual_seed(0)
    return F.dropout(x, 0.5)


def _seed(m, x):
    torch.seed()
    return F.dropout(x, 0.5)


def _set_rng_state(m, x):
    state = torch.get_rng_state()
    y = F.dropout(x, 0.5)
    torch.set_rng_state(state)
    return y


def _fork_rng(m, x):
    with torch.random.fork_rng():
        return F.dropout(x, 0.5)


def _cuda_manual_seed(m, x):
    torch.cuda.manual_seed(0)
    return F.dropout(x, 0.5)


def _cuda_manual_seed_all(m, x):
    torch.cuda.manual_seed_all(0)
    return F.dropout(x, 0.5)


def _freeze_rng_state(m, x):
    """torch.testing's `wrapper_set_seed`: save, seed, draw, restore."""
    return torch.testing._utils.wrapper_set_seed(F.dropout, x, 0.5)


def _caught(m, x):
    """Forward catches the refusal and goes on: the export fails all the same."""
    try:
        torch.manual_seed(0)
    except RngStateError:
        pass
    return F.dropout(x, 0.5)


def _module_generator(m, x):
    m.generator.manual_seed(0)
    return x + torch.rand(4, generator=m.generator)


def _global_generator_state(m, x):
    GLOBAL_GENERATOR.set_state(torch.Generator().manual_seed(1).get_state())
    return x + torch.rand(4, generator=GLOBAL_GENERATOR)


def _default_generator(m, x):
    torch.default_generator.manual_seed(0)
    return F.dropout(x, 0.5)


def _generator_made_in_forward(m, x):
    g = torch.Generator()
    g.manual_seed(0)
    return x + torch.rand(4, generator=g)


#: variant -> (forward body, the start of the refusal's first line, the line it names).
REFUSED = {
    "manual_seed": (_manual_seed, "forward calls torch.manual_seed(), which reseeds the default generator", "torch.manual_seed(0)"),
    "random.manual_seed": (_random_manual_seed, "forward calls torch.random.manual_seed(), which reseeds", "torch.random.manual_seed(0)"),
    "seed": (_seed, "forward calls torch.seed(), which reseeds the default generator from a non-deterministic seed", "torch.seed()"),
    "set_rng_state": (_set_rng_state, "forward calls torch.set_rng_state(), which restores the default generator's state", "torch.set_rng_state(state)"),
    "fork_rng": (_fork_rng, "forward calls torch.random.fork_rng(), which restores the generators' states when its block ends", "with torch.random.fork_rng():"),
    "cuda.manual_seed": (_cuda_manual_seed, "forward calls torch.cuda.manual_seed(), which reseeds the current device's generator", "torch.cuda.manual_seed(0)"),
    "cuda.manual_seed_all": (_cuda_manual_seed_all, "forward calls torch.cuda.manual_seed_all(), which reseeds every device's generator", "torch.cuda.manual_seed_all(0)"),
    "freeze_rng_state": (_freeze_rng_state, "forward calls torch.manual_seed(), which reseeds", "return torch.testing._utils.wrapper_set_seed(F.dropout, x, 0.5)"),
    "caught": (_caught, "forward calls torch.manual_seed(), which reseeds", "torch.manual_seed(0)"),
    "module_generator": (_module_generator, "forward changed the state of a torch.Generator the module reaches", "predispatch.export(module, (x,))"),
    "global_generator": (_global_generator_state, "forward changed the state of a torch.Generator the module reaches", "predispatch.export(module, (x,))"),
    "generator_made_in_forward": (_generator_made_in_forward, "forward draws from a torch.Generator that export could not see before forward ran", "return self.body(self, x) * self.scale"),
    "default_generator": (_default_generator, "forward changed the state of torch's default CPU generator", "predispatch.export(module, (x,))"),
}

#: torch functions the refusal patches while forward is traced: put back after every export.
PATCHED = [
    (module, name)
    for module in (torch, torch.random, torch.cuda)
    for name in ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "fork_rng")
    if hasattr(module, name)
]


def _snapshot(module: Seeded) -> dict:
    """What a failed export must leave as it was: generators, torch's functions, the module."""
    return {
        "default": torch.get_rng_state(),
        "initial_seed": torch.initial_seed(),
        "module_generator": module.generator.get_state(),
        "global_generator": GLOBAL_GENERATOR.get_state(),
        "functions": [getattr(m, name) for m, name in PATCHED],
        "dict": dict(vars(module)),
        "state_dict": {k: v.clone() for k, v in module.state_dict().items()},
    }


def _assert_unchanged(before: dict, after: dict) -> None:
    for key in ("default", "module_generator", "global_generator"):
        assert torch.equal(after[key], before[key]), f"{key} generator changed"
    assert after["initial_seed"] == before["initial_seed"]
    assert all(a is b for a, b in zip(after["functions"], before["functions"]))
    assert after["dict"].keys() == before["dict"].keys()
    assert all(after["dict"][k] is v for k, v in before["dict"].items())
    assert after["state_dict"].keys() == before["state_dict"].keys()
    assert all(torch.equal(after["state_dict"][k], v) for k, v in before["state_dict"].items())


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=needs_generator_in_graph) if v in _GENERATOR_CASES else v for v in REFUSED]
)
def test_refused_and_nothing_changed(variant):
    body, first_line, line = REFUSED[variant]
    module = Seeded(body)
    x = torch.ones(4)
    torch.manual_seed(123)
    before = _snapshot(module)
    with pytest.raises(RngStateError) as info:
        predispatch.export(module, (x,))
    text = message(info.value)
    assert text.startswith(first_line), text
    assert f"  at test_rng.py:N ({line})" in text, text
    assert "fix: seed outside forward" in text or "fix: make the generator outside forward" in text
    _assert_unchanged(before, _snapshot(module))


def test_message():
    with pytest.raises(RngStateError) as info:
        predispatch.export(Seeded(_manual_seed), (torch.ones(4),))
    assert message(info.value) == """\
forward calls torch.manual_seed(), which reseeds the default generator; a graph records random ops but cannot record a change of the generator, so the program's outputs and the generator's state after a call would differ from eager's.
  at test_rng.py:N (torch.manual_seed(0))
  fix: seed outside forward (torch.manual_seed before calling the model, and before calling ep.module()); for a stream of its own, create and seed a torch.Generator outside forward and pass it to the random ops (torch.rand(..., generator=g)).
  see docs/errors.md#rngstateerror"""


def _draws(m, x):
    """Random draws without reseeding, from the default generator and from the module's own."""
    torch.get_rng_state()  # reading the state changes nothing
    return F.dropout(x, 0.5) + torch.rand(4, generator=m.generator)


@pytest.mark.skipif(ti.HAS.generator_in_graph, reason="torch 2.13 and later record a Generator argument")
def test_generator_argument_refused_before_torch_2_13():
    """torch 2.11 and 2.12's FX cannot hold a Generator in a graph: our error, naming the line and the
    release, not FX's `NotImplementedError: argument of type Generator`; nothing changed."""
    module = Seeded(_draws)
    x = torch.ones(4)
    before = _snapshot(module)
    with pytest.raises(RngStateError) as info:
        predispatch.export(module, (x,))
    text = message(info.value)
    assert text.startswith(f"a random op draws from an explicit torch.Generator (generator=...), which torch {torch.__version__}'s FX"), text
    assert "fix: draw from the default generator (seed it outside forward), or use torch 2.13 or later." in text
    _assert_unchanged(before, _snapshot(module))


@needs_generator_in_graph
def test_random_draws_still_match_eager_bitwise():
    """Not over-broad: drawing (and reading the state) exports; outputs and generators after the
    call equal eager's when both start from the same states."""
    eager = Seeded(_draws)
    program = predispatch.export(eager, (torch.ones(4),)).module()  # draws from eager.generator itself

    def run(module):
        torch.manual_seed(5)
        eager.generator.manual_seed(9)
        out = module(torch.ones(4))
        return out, torch.get_rng_state(), eager.generator.get_state()

    expected, actual = run(eager), run(program)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


class _Draws(nn.Module):
    """Dropout and `torch.rand` from the default generator: a trace that reads no real generator."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return F.dropout(self.lin(x), 0.5) + torch.rand(4)


def test_another_threads_draws_and_seeds_are_neither_rewound_nor_refused():
    """While the main thread exports (many times), another thread keeps drawing from the default
    generator and now and then reseeds it with `torch.manual_seed`: every export succeeds, the
    other thread's draws never repeat (export rewound nothing under it), its `torch.manual_seed`
    is torch's own, and a refused export still puts back what its forward changed.  Before:
    exports were refused ("forward changed the state of torch's default CPU generator"), the
    generator was rewound at the end of each export, and the other thread's `torch.manual_seed`
    raised our RngStateError (issue 21.5)."""
    import threading

    stop, started = threading.Event(), threading.Event()
    draws: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def bystander():
        try:
            seed = 1000
            while not stop.is_set():
                for _ in range(50):
                    draws.append(torch.rand(8, dtype=torch.float64))
                    started.set()
                seed += 1
                torch.manual_seed(seed)  # a fresh stream: no value of it repeats another's
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    thread = threading.Thread(target=bystander)
    thread.start()
    started.wait(timeout=60)
    try:
        for _ in range(12):
            predispatch.export(_Draws(), (torch.ones(2, 4),))
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors
    values = torch.cat(draws)
    assert values.numel() > 8 * 100
    assert values.unique().numel() == values.numel(), "the other thread drew repeated values"

    # what the exporting thread changes is still put back (no other thread now)
    module = Seeded(_default_generator)
    torch.manual_seed(123)
    before = _snapshot(module)
    with pytest.raises(RngStateError):
        predispatch.export(module, (torch.ones(4),))
    _assert_unchanged(before, _snapshot(module))


def test_only_drawn_from_tells_draws_from_reseeds_and_rewinds():
    """The check behind the test above (Note [Another thread's draws during an export]): a state
    advanced by draws (within one state array, and across many twists) is told apart from a
    reseed (another seed, or the same seed again) and from a rewind to an earlier state."""
    g = torch.Generator().manual_seed(11)
    torch.rand(5, generator=g)
    saved = g.get_state()
    torch.rand(3, generator=g)  # same state array, later position
    assert ti.only_drawn_from(g, saved)
    torch.rand(100_000, generator=g, dtype=torch.float64)  # ~320 twists later
    assert ti.only_drawn_from(g, saved)
    later = g.get_state()
    g.set_state(saved)  # rewound
    assert not ti.only_drawn_from(g, later)
    g.manual_seed(11)  # the same seed again: back to the stream's start
    assert not ti.only_drawn_from(g, saved)
    g.manual_seed(12)
    torch.rand(5, generator=g)
    assert not ti.only_drawn_from(g, saved)
