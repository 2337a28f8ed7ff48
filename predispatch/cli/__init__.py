"""The `predispatch` command line: thin wrappers that parse, call the library, and print.

    predispatch export MODULE:ATTR --inputs SPEC [--kwargs SPEC] [--train|--eval] [--save FILE]
    predispatch show FILE
    predispatch draw MODULE:ATTR|FILE [--inputs SPEC ...] -o out.svg|out.html|out.dot
    predispatch audit [--markdown]

`python -m predispatch ...` is the same.  Commands, the input spec language and exit codes:
docs/cli.md and `predispatch COMMAND --help`.
"""

from predispatch.cli.failures import ExitCode
from predispatch.cli.main import build_parser, main

__all__ = ["ExitCode", "build_parser", "main"]
