"""`ep.to_onnx()`: the program as ONNX, with the user's `Dim` names on its dynamic axes.

torch's ONNX exporter names a dynamic axis after its size symbol (`s77`), whoever made the
`ExportedProgram`: torch's keeps no `Dim` names, so `torch.onnx.export(ep.to_torch())` of ours
and of torch.export's both say `s77` unless the user passes `dynamic_shapes` again.  Our program
keeps the names (`ShapeRecord.names`, recorded at export), so this route exports
`to_torch(for_inference=True)` with torch's exporter and renames the axes with torch.onnx's own
`ONNXProgram.rename_axes` (expressions too: `2*s77` becomes `2*batch`).  The symbols cannot be
renamed in the graph itself: torch reads a symbol's kind from its prefix.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from predispatch.errors import TorchDriftError
from predispatch.signature import Program
from predispatch.transforms.to_torch import to_torch

__all__ = ["to_onnx"]


def to_onnx(program: Program, f: str | os.PathLike | None = None, *,
            input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
            opset_version: int | None = None, optimize: bool = True, external_data: bool = True) -> Any:
    """`torch.onnx.export(program.to_torch(for_inference=True), dynamo=True, ...)` with the
    program's `Dim` names on the dynamic axes; saved to `f` when given.  Returns torch's
    `ONNXProgram`."""
    names = dict(program.signature.shapes.names)
    onnx_program = torch.onnx.export(
        to_torch(program, for_inference=True), (), dynamo=True, verbose=False, input_names=input_names,
        output_names=output_names, opset_version=opset_version, optimize=optimize,
    )
    if names:
        onnx_program.rename_axes(names)
        _check_renamed(onnx_program, names)
    if f is not None:
        onnx_program.save(f, external_data=external_data)
    return onnx_program


def _check_renamed(onnx_program: Any, names: dict[str, str]) -> None:
    """Every named symbol reached the ONNX inputs under its name: torch.onnx's naming of axes
    after symbols is what the rename relies on, so a torch that names them otherwise is caught."""
    axes = {str(d) for value in onnx_program.model.graph.inputs for d in (value.shape or ())}
    missing = sorted(set(names.values()) - axes)
    if missing:
        raise TorchDriftError(
            f"to_onnx: the dynamic axes {missing} did not get their Dim names in the ONNX inputs "
            f"(their inputs' axes are {sorted(axes)}); this torch names ONNX axes differently.",
            fix="pass the names to torch.onnx.export yourself: "
            "`torch.onnx.export(ep.to_torch(for_inference=True), dynamic_shapes=...)`.",
        )
