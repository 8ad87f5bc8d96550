"""The `kvjax` console command: one file per subcommand."""

from kvjax.cli.main import main

__all__ = ["main"]
