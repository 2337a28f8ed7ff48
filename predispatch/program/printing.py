"""Readable, deterministic text for a program: graph code plus signature.

No ids, addresses or file paths: the `# File: ...` provenance comments FX adds are dropped,
so goldens do not depend on where the code lives.  Subgraphs (regions, captured Functions)
print nested and indented under the module that holds them, as FX's `print_readable` does.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from torch import fx

from predispatch.transforms.joint import mark_backward

if TYPE_CHECKING:
    from predispatch.signature import Program


def format_graph(gm: fx.GraphModule) -> str:
    """The graph as Python code: no provenance comments, a blank line only before a nested class.

    FX groups statements by source line with blank lines and `# File:` comments; both depend
    on where the code was traced from (a re-exported program's code lives in predispatch), so
    both are dropped to keep the text a function of the graph alone.
    """
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    lines = []
    for line in code.splitlines():
        text = line.strip()
        if not text or text.startswith("# File:") or text.startswith("# No stacktrace"):
            continue
        if text.startswith("class ") and lines:
            lines.append("")
        lines.append(line.rstrip())
    return "\n".join(lines)


def format_program(ep: Program) -> str:
    return "\n".join(
        [
            "ExportedProgram:",
            textwrap.indent(mark_backward(format_graph(ep.graph_module), ep), "    "),
            "",
            "Graph signature:",
            textwrap.indent(str(ep.signature), "    "),
        ]
    )
