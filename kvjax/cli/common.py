"""What every subcommand shares: the one-line error type, stderr logging, progress bars, repository paths."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(ROOT, "checkpoints", "kvjax-code-tiny")
SCRIPTS = os.path.join(ROOT, "scripts")


class CliError(Exception):
    """A user-facing error: printed as one line."""


def log(msg: str) -> None:
    """A line on stderr (stdout carries only generated text or JSON)."""
    print(msg, file=sys.stderr, flush=True)


def progress_bar(total: int, desc: str):
    """A tqdm progress bar on stderr (disabled when stderr is not a terminal)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, disable=None, leave=False)


def add_json(sp) -> None:
    """The `--json [PATH]` flag every subcommand takes."""
    sp.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="print the result as JSON on stdout, or write it to PATH")
