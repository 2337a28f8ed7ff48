"""Program: `PreparedInputs` + `TracedGraph` -> `ExportedProgram`, the program as a value.

`ExportedProgram`'s methods are the public API of what comes after export, and delegate: to
runtime/ (`module()`), transforms/ (`joint()`, `to_torch()`); `predispatch.save`/`load`
(_files.py) go to serialize/.  The signature's records are in predispatch/signature.py.
"""

from predispatch.program.exported_program import ExportedProgram, build_program
from predispatch.signature import (
    ExportSignature,
    InputKind,
    InputSpec,
    Leaf,
    OutputKind,
    OutputSpec,
)

__all__ = [
    "ExportSignature",
    "ExportedProgram",
    "InputKind",
    "InputSpec",
    "Leaf",
    "OutputKind",
    "OutputSpec",
    "build_program",
]
