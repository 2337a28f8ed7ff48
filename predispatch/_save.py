"""`predispatch.save`: refuse what is not a predispatch program before the format sees it.

The format (program/serialize.py) reads a program's fields as it encodes them; handed a
`torch.export.ExportedProgram` or a `TrainEvalProgram` it would fail on the first field it
misses, with a bare `AttributeError`.  This is the public entry point, which says instead what
was passed and what saves it.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from predispatch.errors import NotAProgramError, user_frame


def save(ep: Any, f: str | os.PathLike[str] | BinaryIO) -> None:
    """Write `ep`, a program `predispatch.export` returned, to `f` (a path or a binary file object).

    Everything is verified and encoded before the first byte is written: a program the format
    cannot hold raises `SerializationError` and leaves no file behind; a path is replaced
    atomically.  Anything but a predispatch `ExportedProgram` raises `NotAProgramError`.
    """
    from predispatch.program import ExportedProgram
    from predispatch.program.serialize import save as write

    if not isinstance(ep, ExportedProgram):
        raise NotAProgramError(
            f"predispatch.save takes a predispatch ExportedProgram; got {_kind(ep)}.",
            where=user_frame(),
            fix=_fix(ep),
        )
    write(ep, f)


def _kind(obj: Any) -> str:
    """`a torch.export.exported_program.ExportedProgram`: what was passed, by its full class name."""
    cls = type(obj)
    name = cls.__name__ if "<locals>" in cls.__qualname__ else cls.__qualname__  # GraphModule's per-instance class
    return f"a {cls.__module__}.{name}"


def _fix(obj: Any) -> str:
    """What saves `obj`, for the kinds of objects people pass by mistake."""
    import torch

    from predispatch.program.modes import TrainEvalProgram

    if isinstance(obj, torch.export.ExportedProgram):
        return ("use torch.export.save(ep, path) for torch.export's programs; predispatch.save takes "
                "what predispatch.export(model, args) returns.")
    if isinstance(obj, TrainEvalProgram):
        return ("save its two programs one by one: predispatch.save(p.train_program, 'train.pd') and "
                "predispatch.save(p.eval_program, 'eval.pd'); TrainEvalProgram(load('train.pd'), "
                "load('eval.pd'), p.training) puts them together again.")
    if isinstance(obj, torch.nn.Module):
        return "save the ExportedProgram (what predispatch.export returned), not a module such as ep.module()."
    return "pass what predispatch.export(model, args) returns."
