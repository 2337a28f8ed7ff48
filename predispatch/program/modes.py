"""Train/eval for `ep.module()`: the graph was traced in one mode, and a mode switch cannot change it.

Note [One mode per program]
---------------------------
`export` traces forward once, with the module's `training` flags as they are: dropout draws its
mask (or not), batch norm uses batch statistics and updates its running ones (or reads them).
The graph is that one mode.  `ep.module().eval()` on a program traced in train mode would flip
`.training` and change nothing else: dropout stays on.  So a switch to another mode is refused
(`ModeSwitchError`, which says how to export the other mode), a "switch" to the mode the program
already has is allowed (`.eval()` on an eval program), and `.training` reads the exported flags.
One program per mode: export twice (`model.train()` / `model.eval()` before each export).

A program that holds both modes (pytorch#103681) would need two graphs behind one module and a
save format for both; that is left for when the program module and the file format settle.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from predispatch.errors import ModeSwitchError, user_frame


def exported_mode(training_flags: Sequence[tuple[str, bool]], path: str) -> bool | None:
    """The `training` flag the module at `path` had at export; None when not recorded (a
    function export, or a file saved before the flags were)."""
    flags = dict(training_flags)
    return flags.get(path, flags.get(""))


def set_exported_modes(root: nn.Module, training_flags: Sequence[tuple[str, bool]]) -> None:
    """Give `root` and its submodules the `training` flags the exported modules had (a program
    module's containers are fresh modules, whose flag would otherwise read True)."""
    if not training_flags:
        return
    for path, module in root.named_modules():
        module.training = exported_mode(training_flags, path)


def check_mode_switch(training_flags: Sequence[tuple[str, bool]], mode: bool) -> None:
    """Raise `ModeSwitchError` unless every exported module already had `training == mode`
    (see Note [One mode per program]); nothing is checked without recorded flags."""
    differing = [path or "the module" for path, flag in training_flags if flag != mode]
    if not differing:
        return
    exported = "train" if dict(training_flags)[""] else "eval"
    if dict(training_flags)[""] != mode:
        what = f"the program was exported with the module in {exported} mode"
    else:
        what = f"the program was exported with {', '.join(differing[:3])} in {'eval' if mode else 'train'} mode"
    wanted, call = ("eval", "model.eval()") if not mode else ("train", "model.train()")
    raise ModeSwitchError(
        f"{what}, and its graph is traced in that mode (dropout, batch norm); "
        f".{'eval' if not mode else 'train'}() cannot change a traced graph, so it is refused.",
        where=user_frame(),
        fix=f"export a program for {wanted} mode: {call}; ep_{wanted} = predispatch.export(model, args); "
        "keep one program per mode.",
    )
