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
    """A tqdm progress bar on stderr when it is a terminal; else a `PhaseLines` (one line when the phase starts, one
    when it ends), so that a log of a long warm-up shows where the time went."""
    if not _isatty(sys.stderr):
        return PhaseLines(total, desc)
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False)


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False


class PhaseLines:
    """A progress bar's interface (update, n, close, `with`) that logs a line per phase instead of drawing."""

    def __init__(self, total: int, desc: str):
        import time

        self.total, self.desc, self.n, self.closed, self.t0 = total, desc, 0, False, time.perf_counter()
        log(f"{desc} ...")

    def update(self, k: int = 1) -> None:
        self.n += k

    def close(self) -> None:
        import time

        if not self.closed:
            self.closed = True
            log(f"{self.desc}: done ({self.n}/{self.total}) in {time.perf_counter() - self.t0:.1f}s")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def add_json(sp) -> None:
    """The `--json [PATH]` flag every subcommand takes."""
    sp.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="print the result as JSON on stdout, or write it to PATH")
