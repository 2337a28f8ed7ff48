"""`python -m predispatch ...`: the same command line as the `predispatch` script."""

import sys

from predispatch.cli import main

if __name__ == "__main__":
    sys.exit(main())
