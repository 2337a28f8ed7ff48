"""predispatch: export PyTorch programs to a functional, pre-dispatch ATen graph.

    import predispatch
    ep = predispatch.export(model, (x,), {"mask": mask})
    print(ep)
    out = ep.module()(x, mask=mask)
"""

from predispatch import errors
from predispatch._torch_internals.versions import warn_if_untested
from predispatch._export import export, export_train_eval
from predispatch.program import (
    ExportedProgram,
    ExportSignature,
    InputKind,
    InputSpec,
    OutputKind,
    OutputSpec,
)
from predispatch.program.modes import TrainEvalProgram
from predispatch.program.serialize import load, save

__version__ = "0.1.0"

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
