"""The `rlft` command and what only it uses: the subcommands (commands.py), what `rlft <kind>` runs
from a recipe (recipes.py), preflight checks (doctor.py), the demo (demo.py) and the fields' help
view (field_help.py). Nothing else in rlft imports this package."""

from rlft.cli.commands import main

__all__ = ["main"]
