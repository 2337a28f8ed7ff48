"""`python -m predispatch ...`: the same command line as the `predispatch` script.

Python put the current folder first on `sys.path` for `-m`; the script has no such entry, so
it goes first (predispatch/_paths.py): no module of the current folder is imported in its place.
`import predispatch` itself ran before this file, with that folder on the path (Python's rule
for `-m`): in a folder you do not trust, run the `predispatch` script, or `python -P -m predispatch`.
"""

import sys

from predispatch._paths import drop_current_folder

drop_current_folder()

from predispatch.cli import main  # noqa: E402 - after the search path is fixed

if __name__ == "__main__":
    sys.exit(main())
