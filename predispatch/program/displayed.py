"""`DisplayedProgram`: a saved program read to print or draw it, never to run it.

`predispatch show` and `predispatch draw` read files from anywhere, whose inputs and outputs
may be made of classes from any library (a Hugging Face `CausalLMOutputWithPast`).  Building a
class runs its code, so `load` builds only the classes the user allows
(Note [Classes a file may name] in serialize/classes.py); a program that is only displayed
needs none of them: `load_for_display` (predispatch/_files.py) keeps each as the file's name
for it, a `DisplayedClass`.  So that such a program cannot be run by accident, it is this
class, with the fields printing and drawing read and no `module()`, `joint()` or `to_torch()`;
`predispatch.save` refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from predispatch.program.printing import format_graph, format_program
from predispatch.signature import ExportSignature


@dataclass(frozen=True, eq=False)
class DisplayedProgram:
    """A program read for display only: the fields of `ExportedProgram` that describe it (its
    docstring says what each holds), its pytree specs' classes `DisplayedClass`es."""

    graph_module: fx.GraphModule
    signature: ExportSignature
    state_dict: Mapping[str, torch.Tensor]
    constants: Mapping[str, torch.Tensor]
    decompositions: Any  # trace.DecompositionLog
    live_root: None = None
    hooks: None = None
    state_dict_owner: None = None

    @property
    def audit(self) -> Any:
        return self.decompositions

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    def graph_code(self) -> str:
        return format_graph(self.graph_module)

    def __str__(self) -> str:
        return format_program(self)
