"""Where `kvjax generate` writes: streamed text on stdout, JSON on stdout or in a file (its folder checked before
the run), progress on stderr — never over the streamed text."""

from __future__ import annotations

import json
import os
import sys

from kvjax.cli.common import CliError


def check_output_path(path: str | None) -> None:
    """Fail before any work if `--json PATH` cannot be written (missing folder, a directory, no permission)."""
    if path in (None, "-"):
        return
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(folder):
        raise CliError(f"--json {path}: folder {folder} does not exist")
    if os.path.isdir(path):
        raise CliError(f"--json {path}: is a directory")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise CliError(f"--json {path}: not writable")


def jsonable(d: dict) -> dict:
    """The entries of `d` that JSON can hold (stats may carry arrays)."""
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
            out[k] = v
        except (TypeError, ValueError):
            pass
    return out


class TextStream:
    """Prints deltas of generated text to stdout as they arrive (`kvjax.generation.Delta.text`)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.started = False

    @property
    def live(self) -> bool:
        """Whether text is going to the same terminal as the progress bars (then no bar runs while it streams)."""
        return self.enabled and sys.stdout.isatty()

    def write(self, text: str) -> None:
        if self.enabled and text:
            sys.stdout.write(text)
            sys.stdout.flush()
            self.started = True

    def end(self) -> None:
        if self.enabled and self.started:
            sys.stdout.write("\n")
            sys.stdout.flush()
