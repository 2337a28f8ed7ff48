"""Exit codes, and the command-line failures that are not the library's (`PredispatchError`).

The table below is the one `predispatch --help` and docs/cli.md show.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0  # success
    REFUSED = 1  # predispatch refused: export failed, or a saved program could not be loaded
    USAGE = 2  # bad arguments, a bad input spec, a MODULE:ATTR or FILE that does not exist
    MODEL = 3  # the model could not be created: importing MODULE or constructing ATTR raised
    MISSING = 4  # something needed is not installed: Graphviz `dot`, save/load, the audit table
    INTERNAL = 5  # an unexpected exception: a bug in predispatch, please report it


EXIT_CODES_HELP = """\
exit codes:
  0  success
  1  predispatch refused: export failed, or a saved program could not be loaded
     (the message says what is wrong, where, and how to fix it)
  2  usage: bad arguments, a bad input spec, a MODULE:ATTR or FILE that does not exist
  3  the model could not be created: importing MODULE or constructing ATTR raised
  4  something needed is not installed: Graphviz `dot` for .svg, save/load support,
     the audit table
  5  internal error: an unexpected exception, a bug in predispatch (please report it)

Errors print as a message without a traceback; add --traceback to see it.
Details: docs/cli.md."""


class CommandError(Exception):
    """A failure of the command line itself; `code` is its exit code."""

    code = ExitCode.USAGE

    def __init__(self, what: str, *, fix: str | None = None, where: str | None = None):
        self.what, self.fix, self.where = what, fix, where
        lines = [what]
        if where:
            lines.append(f"  at {where}")
        if fix:
            lines.append(f"  fix: {fix}")
        super().__init__("\n".join(lines))


class UsageError(CommandError):
    """The command line asks for something that does not exist or does not parse."""

    code = ExitCode.USAGE


class ModelError(CommandError):
    """The user's code raised while importing MODULE or creating the model from ATTR."""

    code = ExitCode.MODEL


class MissingError(CommandError):
    """A tool or feature the command needs is not installed or not built yet."""

    code = ExitCode.MISSING
