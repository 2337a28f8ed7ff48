"""`TrainEvalProgram`: one module exported in both modes (`predispatch.export_train_eval`).

Each program is one mode (Note [One mode per program] in runtime/modes.py); this pairs them, and
its `module()` switches between them with `.train()` / `.eval()` (runtime/modes.py's
`TrainEvalModule`).
"""

from __future__ import annotations

import dataclasses

from predispatch.program.exported_program import ExportedProgram
from predispatch.runtime.modes import TrainEvalModule

__all__ = ["TrainEvalProgram"]


@dataclasses.dataclass(frozen=True, eq=False)
class TrainEvalProgram:
    """One module exported in both modes (`predispatch.export_train_eval`).

    train_program: the program traced with `model.train()` (every module training).
    eval_program: the program traced with `model.eval()`.
    training: the module's mode at export: the mode `module()` starts in.
    Save each program with `predispatch.save`; `TrainEvalProgram(load(a), load(b), training)`
    puts them together again.
    """

    train_program: ExportedProgram
    eval_program: ExportedProgram
    training: bool = True

    def module(self) -> TrainEvalModule:
        """An `nn.Module` that runs `train_program` or `eval_program` by its `.training` flag: the
        train program's module holds the state, the eval program's reads it live from that one."""
        train = self.train_program.module()
        evaluate = dataclasses.replace(self.eval_program, live_root=train).module()
        return TrainEvalModule(train, evaluate, self.training)

    def __str__(self) -> str:
        return f"Train mode:\n{self.train_program}\n\nEval mode:\n{self.eval_program}"
