"""Program: `PreparedInputs` + `TracedGraph` -> `ExportedProgram` (signature, state, runner)."""

from predispatch.program.exported_program import ExportedProgram, build_program
from predispatch.program.signature import (
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
