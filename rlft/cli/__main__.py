"""`python -m rlft.cli` runs the `rlft` command."""

import sys

from rlft.cli.commands import main

if __name__ == "__main__":
    sys.exit(main())
