"""Readable, deterministic text for a program: graph code plus signature.

No ids, addresses or file paths: the `# File: ...` provenance comments FX adds are dropped,
so goldens do not depend on where the code lives.  Subgraphs (regions, captured Functions)
print nested and indented under the module that holds them, as FX's `print_readable` does.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from torch import fx

if TYPE_CHECKING:
    from predispatch.program.exported_program import ExportedProgram


def format_graph(gm: fx.GraphModule) -> str:
    """The graph as Python code, without provenance comments or the blank lines around them."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    lines = []
    for line in code.splitlines():
        if line.strip().startswith("# File:") or line.strip().startswith("# No stacktrace"):
            continue
        if not line.strip() and (not lines or not lines[-1].strip()):
            continue
        lines.append(line.rstrip())
    return "\n".join(lines).strip()


def format_program(ep: ExportedProgram) -> str:
    return "\n".join(
        [
            "ExportedProgram:",
            textwrap.indent(format_graph(ep.graph_module), "    "),
            "",
            "Graph signature:",
            textwrap.indent(str(ep.signature), "    "),
        ]
    )
