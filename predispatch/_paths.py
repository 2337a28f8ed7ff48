"""The module search path of an installed command, for the command line's own imports.

`python -m predispatch` (and `python -c`) put the current folder first on `sys.path`, before
anything predispatch runs; the installed `predispatch` script puts its own folder there
instead.  A folder a model was downloaded into may hold `json.py` or `typing_extensions.py`:
on a path that starts with it, `--import json` or torch's own `import typing_extensions` would
run that file.  So the command line imports with the path an installed script has: the
current folder only where PYTHONPATH names it.  Only `os` and `sys` here: this module is
imported before the search path is fixed (predispatch/__main__.py).
"""

from __future__ import annotations

import os
import sys


def drop_current_folder() -> None:
    """Remove from `sys.path` the current folder Python put there for `-m` or `-c` (an empty
    entry or the folder itself), unless PYTHONPATH names it."""
    here = os.getcwd()
    named = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    sys.path[:] = [p for p in sys.path if here in named or (p != "" and os.path.abspath(p) != here)]
