"""predispatch: export PyTorch programs to a functional, pre-dispatch ATen graph.

    import predispatch
    ep = predispatch.export(model, (x,), {"mask": mask})
    print(ep)
    out = ep.module()(x, mask=mask)

The public names are imported on first use (PEP 562): `import predispatch` costs little more
than Python's start, and torch is imported by the first call that needs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from predispatch import errors
from predispatch._lazy import lazy_getattr
from predispatch._torch_versions import warn_if_untested
from predispatch._version import __version__

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` imports them
    from predispatch._export import export, export_train_eval
    from predispatch._files import load, save
    from predispatch.program import (
        ExportedProgram,
        ExportSignature,
        InputKind,
        InputSpec,
        OutputKind,
        OutputSpec,
    )
    from predispatch.program.train_eval import TrainEvalProgram


warn_if_untested()

__all__ = [
    "ExportSignature",
    "ExportedProgram",
    "InputKind",
    "InputSpec",
    "OutputKind",
    "OutputSpec",
    "TrainEvalProgram",
    "errors",
    "export",
    "export_train_eval",
    "load",
    "save",
]

#: Where each public name lives; imported when first asked for.
_LAZY = {
    "export": "predispatch._export",
    "export_train_eval": "predispatch._export",
    "save": "predispatch._files",
    "load": "predispatch._files",
    "TrainEvalProgram": "predispatch.program.train_eval",
    **{name: "predispatch.program" for name in
       ("ExportedProgram", "ExportSignature", "InputKind", "InputSpec", "OutputKind", "OutputSpec")},
}


__getattr__ = lazy_getattr(globals(), _LAZY)  # a public name is imported when first asked for


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
