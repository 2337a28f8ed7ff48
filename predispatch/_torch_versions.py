"""Which torch is running, which releases predispatch is tested on, and what differs between them.

The one place that asks for torch's version; it imports no torch (`import predispatch` warns
from here before torch is loaded), reading the installed release's metadata instead.  Every other module asks this one a question by
name (`HAS.can_decompose_method`, ...), never `torch.__version__`, so the table below is the
whole story of what changes from release to release.

Note [Variants by torch version]
--------------------------------
| mechanism                         | 2.11 | 2.12 | 2.13 | 2.14 | 2.15 | why                                        |
|-----------------------------------|------|------|------|------|------|--------------------------------------------|
| decomposition question            | C    | M    | M    | M    | M    | M: `FunctionalTensorMode._can_decompose`,  |
|                                   |      |      |      |      |      | a method we replace for the trace.  C:     |
|                                   |      |      |      |      |      | a closure inside `__torch_dispatch__`; an  |
|                                   |      |      |      |      |      | adapter around `__torch_dispatch__` asks   |
|                                   |      |      |      |      |      | the method first and decomposes itself     |
|                                   |      |      |      |      |      | where the policy says so (torch's own      |
|                                   |      |      |      |      |      | lines), refusing loudly where it cannot.   |
| torch's fast decomposition answer | own  | T    | T    | T    | T    | T: `_can_decompose_fast`.  own: the same   |
|                                   |      |      |      |      |      | rules, written out here (2.11 has them     |
|                                   |      |      |      |      |      | only inside the closure above).            |
| stack-trace anchors               | none | none | T    | T    | T    | `torch.fx.proxy._STACK_TRACE_ANCHORS`      |
|                                   |      |      |      |      |      | (frames FX keeps besides `forward`) came   |
|                                   |      |      |      |      |      | in 2.13; before it FX keeps none.          |

| a `torch.Generator` argument     | no   | no   | T    | T    | T    | FX's `create_arg` takes a Generator from   |
| in a graph (`rand(generator=g)`)  |      |      |      |      |      | 2.13 on; before, such a program is refused |
|                                   |      |      |      |      |      | with `RngStateError`, naming the release.  |
| non-reentrant checkpoint applies | yes  | no   | no   | no   | no   | 2.11's placeholder Function is run by      |
| `_NoopSaveInputs`                 |      |      |      |      |      | torch, not captured (RUN_INSTEAD).         |
| keyword arguments to a            | no   | no   | T    | T    | T    | torch's own C++ apply refuses keywords     |
| setup_context Function's `apply`  |      |      |      |      |      | before 2.13: eager and export raise the    |
|                                   |      |      |      |      |      | same TypeError.                            |
| `_is_grad_layout_enforcement_     | no   | T    | T    | T    | T    | a switch 2.11 lacks: not in its            |
| enabled` switch                   |      |      |      |      |      | GLOBAL_SWITCHES (nothing to restore).      |

The same on every release, so not a row: the autograd.Function capture sees each call inside
torch's C++ apply (the ctx it makes, the forward it looks up), which `Function.apply` is on 2.14
and later and ends in before, however `apply` was reached (Note [Seeing every apply] in
`_torch_internals/autograd_function.py`).

A mechanism whose hook point is gone on a future torch raises `TorchDriftError` naming it and
the running version (`_torch_internals/mechanism.py`); it never runs without the hook.
"""

from __future__ import annotations

import re
import sys
import warnings
from importlib import metadata

__all__ = ["DEVELOPMENT", "TESTED", "TORCH", "TORCH_VERSION", "HAS", "tested", "tested_range", "warn_if_untested"]

#: The torch releases CI runs the default suite on (.ci/run); pyproject.toml admits this range.
TESTED = ((2, 11), (2, 12), (2, 13), (2, 14), (2, 15))

#: The development release (the README's quick path, the local CPU wheel): docs/audit.md, the
#: notebooks' stored outputs, docs/comparison.md and the golden graphs are made on it.
DEVELOPMENT = (2, 13)


def _parse(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def _installed() -> str:
    """The running torch's version: the imported module's, else the installed distribution's."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):
        return str(torch.__version__)
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "0.0"


#: The running torch's version string, and its (major, minor).
TORCH_VERSION = _installed()
TORCH = _parse(TORCH_VERSION)


class _Has:
    """The answers to "which variant does this torch need?", one attribute per row of the table."""

    #: `FunctionalTensorMode._can_decompose` is a method (variant M); else a closure (variant C).
    can_decompose_method = TORCH >= (2, 12)
    #: `torch._subclasses.functional_tensor._can_decompose_fast` exists.
    can_decompose_fast = TORCH >= (2, 12)
    #: `torch.fx.proxy._STACK_TRACE_ANCHORS` exists.
    stack_trace_anchors = TORCH >= (2, 13)
    #: FX records a `torch.Generator` argument (`torch.rand(4, generator=g)`) in a graph.
    generator_in_graph = TORCH >= (2, 13)
    #: non-reentrant `torch.utils.checkpoint` applies `_NoopSaveInputs` (2.11 only).
    checkpoint_applies_function = TORCH < (2, 12)
    #: eager `MyFn.apply(x, bias=b)` works for a setup_context Function (before: TypeError).
    apply_keywords = TORCH >= (2, 13)


HAS = _Has()


def tested() -> bool:
    """Whether the running torch is one CI tests predispatch on."""
    return TORCH in TESTED


def tested_range() -> tuple[str, str]:
    """The tested releases in words and as a pip requirement: ("2.11 to 2.15", "torch>=2.11,<2.16")."""
    low, high = TESTED[0], TESTED[-1]
    return f"{low[0]}.{low[1]} to {high[0]}.{high[1]}", f"torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"


def warn_if_untested() -> None:
    """Warn once per process when torch is outside the tested range (called by `import predispatch`)."""
    if not tested():
        words, requirement = tested_range()
        warnings.warn(
            f"predispatch is tested with torch {words}; this is torch "
            f"{TORCH_VERSION}. Every hook predispatch places in torch checks that it engaged and "
            f"raises TorchDriftError if not, but untested releases may refuse programs the tested ones "
            f"export. Install a tested torch (pip install '{requirement}').",
            UserWarning,
            stacklevel=3,
        )
