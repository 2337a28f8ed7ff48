"""`predispatch.save` and `predispatch.load`: the public entry points of the file format.

The format (serialize/archive.py) reads a program's fields as it encodes them; handed a
`torch.export.ExportedProgram` or a `TrainEvalProgram` it would fail on the first field it
misses, with a bare `AttributeError`.  `save` says instead what was passed and what saves it.
`load` hands the format the class it builds, `ExportedProgram` (serialize/ never imports
program/, whose methods call it), and `load_for_display` (the command line's `show` and
`draw`) `DisplayedProgram`, which has no `module()`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, BinaryIO

from predispatch.errors import NotAProgramError, user_frame

if TYPE_CHECKING:
    from predispatch.program import ExportedProgram
    from predispatch.program.displayed import DisplayedProgram


def save(ep: Any, f: str | os.PathLike[str] | BinaryIO) -> None:
    """Write `ep`, a program `predispatch.export` returned, to `f` (a path or a binary file object).

    Everything is verified and encoded before the first byte is written: a program the format
    cannot hold raises `SerializationError` and leaves no file behind; a path is replaced
    atomically.  Anything but a predispatch `ExportedProgram` raises `NotAProgramError`.
    """
    from predispatch.program import ExportedProgram
    from predispatch.serialize.archive import save as write

    if not isinstance(ep, ExportedProgram):
        raise NotAProgramError(
            f"predispatch.save takes a predispatch ExportedProgram; got {_kind(ep)}.",
            where=user_frame(),
            fix=_fix(ep),
        )
    write(ep, f)


def load(f: str | os.PathLike[str] | BinaryIO, *, types: Iterable[type] = (),
         op_namespaces: tuple[str, ...] = ()) -> ExportedProgram:
    """Read a program written by `save`; see Note [What load trusts] in serialize/archive.py.

    `types`: the classes the program's inputs and outputs may be built of, beyond pytree's
    containers, the pytree node types your code or your libraries registered (transformers'
    `ModelOutput`s) and plain namedtuples: your dataclasses (`types=[mymodule.Output]`),
    namedtuple classes, transformers' `DynamicCache`.  A file naming any other class is refused:
    building a class runs its code, so you choose the classes, not the file (Note [Classes a
    file may name] in serialize/classes.py).
    `op_namespaces`: further op namespaces the graph may call (a library of custom ops you
    trust and have imported).  Any problem with the file raises `SerializationError`, never a
    partial program; only opening a path can raise `OSError`.
    """
    from predispatch.program import ExportedProgram
    from predispatch.serialize.archive import load as read
    from predispatch.serialize.classes import FileClasses

    return read(f, ExportedProgram, op_namespaces=op_namespaces, classes=FileClasses(types))


def load_for_display(f: str | os.PathLike[str] | BinaryIO, *, op_namespaces: tuple[str, ...] = ()) -> DisplayedProgram:
    """Read a program to print or draw it (`predispatch show`, `draw`), building no class it names.

    The file is checked as `load` checks it, but the classes its inputs and outputs are made of
    are kept as the file's names (`DisplayedClass`): none is looked up, imported, built or
    registered, so no `types=` is needed.  The result prints and draws as the program does and
    has no `module()`: `predispatch.load` reads a program to run.
    """
    from predispatch.program.displayed import DisplayedProgram
    from predispatch.serialize.archive import load as read
    from predispatch.serialize.classes import FileClasses

    return read(f, DisplayedProgram, op_namespaces=op_namespaces, classes=FileClasses(display=True))


def _kind(obj: Any) -> str:
    """`a torch.export.exported_program.ExportedProgram`: what was passed, by its full class name."""
    cls = type(obj)
    name = cls.__name__ if "<locals>" in cls.__qualname__ else cls.__qualname__  # GraphModule's per-instance class
    return f"a {cls.__module__}.{name}"


def _fix(obj: Any) -> str:
    """What saves `obj`, for the kinds of objects people pass by mistake."""
    import torch

    from predispatch.program.displayed import DisplayedProgram
    from predispatch.program.train_eval import TrainEvalProgram

    if isinstance(obj, DisplayedProgram):
        return "a program read for display only (load_for_display) is the file itself: copy the file, or load it with predispatch.load(path, types=[...]) and save that."
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
