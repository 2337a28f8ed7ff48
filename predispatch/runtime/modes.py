"""Train/eval for `ep.module()`: the graph was traced in one mode, and a mode switch cannot change it;
likewise its dtypes and devices (`check_conversion`), and copies that would drop the contract
(`refuse_copy`).

Note [One mode per program]
---------------------------
`export` traces forward once, with the module's `training` flags as they are: dropout draws its
mask (or not), batch norm uses batch statistics and updates its running ones (or reads them).
The graph is that one mode.  `ep.module().eval()` on a program traced in train mode would flip
`.training` and change nothing else: dropout stays on.  So a switch to another mode is refused
(`ModeSwitchError`, which says how to export the other mode), a "switch" to the mode the program
already has is allowed (`.eval()` on an eval program), and `.training` reads the exported flags.
To switch modes, export both: `predispatch.export_train_eval(model, args)` traces the model
once in each mode and returns a `TrainEvalProgram`, whose `module()` runs the train program
or the eval program by its `.training` flag, over one set of state (pytorch#103681).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
from torch import fx, nn

from predispatch.errors import ModeSwitchError, ModuleConversionError, ModuleCopyError, user_frame


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
        fix=f"export a program for {wanted} mode ({call}; ep_{wanted} = predispatch.export(model, args)), "
        "or export both modes at once: predispatch.export_train_eval(model, args).module() switches "
        "with .train()/.eval().",
    )


def check_conversion(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Raise `ModuleConversionError` if `fn` (what `nn.Module._apply` applies: `.to()`,
    `.double()`, `.cuda()` ...) changes the dtype or device of any of `module`'s tensors.

    `fn` is tried on an empty tensor of each dtype and device the state has, before anything is
    converted: the graph is traced for those (casts, created tensors, input checks), and the
    module shares the exported model's tensors, which a conversion would change too.  State on
    the meta device may be materialized (`to_empty(device=...)`): a meta model is traced as if its
    weights were on the inputs' device (`ti.fake_of_meta`)."""
    kinds = {(t.dtype, t.device) for t in (*module.parameters(), *module.buffers())}
    for dtype, device in sorted(kinds, key=str):
        converted = fn(torch.empty(0, dtype=dtype, device=device))
        if device.type == "meta" and converted.dtype == dtype:
            continue  # a meta model's state materialized (`to_empty`): the graph was traced for real weights
        if converted.dtype != dtype or converted.device != device:
            raise ModuleConversionError(
                f"converting the program module's {dtype} state on {device} to {converted.dtype} on "
                f"{converted.device} is refused: its graph and input checks are traced for the exported "
                "dtypes and devices, and it shares the exported model's tensors; nothing was converted.",
                where=user_frame(),
                fix=f"convert the model and export again: predispatch.export(model.to({converted.dtype}), args) "
                "(for a device, with the model and the inputs on it).",
            )


def refuse_copy() -> NoReturn:
    """Raise `ModuleCopyError`: a pickled (or shallow-copied) program module would be a plain
    GraphModule, without its input checks, write-back checks and mode guard."""
    raise ModuleCopyError(
        "ep.module() cannot be pickled or shallow-copied: fx rebuilds a pickled GraphModule from its "
        "code alone, without the input checks, the write-back checks and the train/eval guard.",
        where=user_frame(),
        fix="copy.deepcopy(m) for a copy in this process; predispatch.save(ep, path) and "
        "predispatch.load(path).module() to store it; m.state_dict() for its weights.",
    )


class TrainEvalModule(fx.GraphModule):
    """Both programs of a `TrainEvalProgram` (program/train_eval.py) over one set of state, switched by `.train()`/`.eval()`.

    An `fx.GraphModule`, so graph tools take it: its graph calls the program of the current mode,

        def forward(self, x):
            train_program = self.train_program(x)        # self.eval_program(x) after .eval()
            return train_program

    and `.train()`/`.eval()` retarget that call.  The train program's module holds the state
    (the model's own tensors); the eval program's reads them live from it at each call (as a
    function export reads its modules), so training in one mode and evaluating in the other
    see the same parameters and buffers.  The two program modules are attributes, not
    submodules: its submodules and `state_dict()` keys are the exported module's.

    PT2E's mode switch works here (Note [PT2E's mode switch on a TrainEvalModule]).
    """

    def __init__(self, train: fx.GraphModule, evaluate: fx.GraphModule, training: bool):
        """`train`: the train program's module; `evaluate`: the eval program's, reading its
        state live from `train` (`TrainEvalProgram.module` builds both)."""
        super().__init__(nn.Module(), fx.Graph())
        for name, runner in ((_TRAIN, train), (_EVAL, evaluate)):
            object.__setattr__(self, name, runner)  # not submodules: no second set of state names
        for name, child in train.named_children():
            self.add_module(name, child)
        self.graph = _switch_graph(train.graph._codegen.pytree_info.orig_args)  # type: ignore[attr-defined]  # ProgramModule's PyTreeCodeGen
        self.train(training)

    def train(self, mode: bool = True) -> TrainEvalModule:
        """Run the `mode` program from now on (`.eval()` calls this too)."""
        super().train(mode)
        (call,) = self.graph.find_nodes(op="call_module")
        if call.target != _RUNNER[mode]:
            call.target = _RUNNER[mode]
            self.recompile()
        self.__dict__[_PT2E_TRAINING] = mode  # what PT2E reads (Note [PT2E's mode switch on a TrainEvalModule])
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        """PT2E's `move_exported_model_to_train`/`_eval` set `_exported_training`: switch to it."""
        super().__setattr__(name, value)
        if name == _PT2E_TRAINING:
            TrainEvalModule.train(self, bool(value))  # the class's own, not a method PT2E installed

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TrainEvalModule:
        """`.to()`, `.double()` ...: refused if they change a dtype or device (`check_conversion`)."""
        check_conversion(self, fn)
        return super()._apply(fn, recurse)

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        refuse_copy()

    def __copy__(self) -> NoReturn:
        refuse_copy()

    def __deepcopy__(self, memo: dict) -> TrainEvalModule:
        """A deep copy (which would otherwise go through the refused `__reduce_ex__`): both
        programs' modules copied, the eval one reading the copied train one's state."""
        train, evaluate = (copy.deepcopy(self.__dict__[name], memo) for name in (_TRAIN, _EVAL))
        copied = TrainEvalModule(train, evaluate, self.training)
        memo[id(self)] = copied
        return copied

    @property
    def positional_names(self) -> tuple[str, ...]:
        """The exported callable's positional parameter names (read by a re-export)."""
        return self.__dict__[_TRAIN].positional_names


#: The attributes holding the two program modules, by mode, and PT2E's mode attribute.
_TRAIN, _EVAL = "train_program", "eval_program"
_RUNNER = {True: _TRAIN, False: _EVAL}
_PT2E_TRAINING = "_exported_training"

# Note [PT2E's mode switch on a TrainEvalModule]
# ----------------------------------------------
# torchao's `move_exported_model_to_eval(m)` / `_train(m)` read `m._exported_training`, set it,
# and rewrite `aten.batch_norm` / `aten.dropout` patterns in `m.graph`;
# `allow_exported_model_train_eval(m)` installs `m.train`/`m.eval` that call them.  A
# TrainEvalModule's graph holds no such pattern, so the rewrite alone would switch nothing; but
# it holds both modes' programs, so setting `_exported_training` switches to that program, and
# `train()` keeps `_exported_training` equal to the mode.  Every PT2E route then switches,
# with the exported graphs of each mode (tests/test_consumers.py).


def _switch_graph(argument_names: Sequence[str]) -> fx.Graph:
    """`TrainEvalModule`'s graph: the callable's arguments passed to the train program."""
    graph = fx.Graph()
    inputs = [graph.placeholder(name) for name in argument_names]
    graph.output(graph.call_module(_TRAIN, tuple(inputs)))
    return graph


#: Attributes PT2E sets on an exported module to switch its graph's mode by rewriting
#: `aten.batch_norm` / `aten.dropout` patterns (torchao's `allow_exported_model_train_eval`
#: replaces `train`/`eval`; `move_exported_model_to_eval`/`_train` set `_exported_training`).
PT2E_MODE_ATTRIBUTES = frozenset({"train", "eval", "_exported_training"})


def check_pt2e_mode_switch(training_flags: Sequence[tuple[str, bool]], name: str, value: Any) -> None:
    """Refuse PT2E's graph-rewriting mode switch on `ep.module()`: its graph holds the functional
    forms of batch norm and dropout, which PT2E's patterns do not match, so the switch would
    silently change nothing.  Setting `_exported_training` to the exported mode is allowed (a
    no-op, as `move_exported_model_to_eval` on an eval program)."""
    if name == "_exported_training" and all(flag == value for _, flag in training_flags):
        return
    raise ModeSwitchError(
        f"PT2E's mode switch ({'allow_exported_model_train_eval' if name != '_exported_training' else 'move_exported_model_to_' + ('train' if value else 'eval')}) "
        "rewrites aten.batch_norm and aten.dropout, which ep.module()'s functional graph does not hold: "
        "it would silently switch nothing.",
        where=user_frame(),
        fix="give PT2E torch's training IR, ep.to_torch().module(), whose batch norm and dropout are "
        "the composites its patterns match (docs/comparison.md#training-routes); or export both modes: "
        "predispatch.export_train_eval(model, args).module() switches with .train()/.eval().",
    )
