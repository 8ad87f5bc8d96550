"""Ctrl-C ends the `kvjax` command at once with status 130, whatever it is doing.

Letting KeyboardInterrupt unwind is not safe here: it surfaces only when the main thread next runs Python (a JAX
compile can keep it in C++ for a minute), and the interpreter's teardown then runs while XLA's compile threads are
still live — measured: 7 of 17 interrupts during prefill or warm-up died with a segmentation fault (status 139).
So the command turns SIGINT into a byte on a pipe (`signal.set_wakeup_fd`, written by CPython's C-level handler
even while the main thread is inside XLA), and a watcher thread that reads it prints one line and leaves with
`os._exit(130)`: no unwinding, no teardown. Streamed text is flushed as it is written, so nothing is lost.
"""

from __future__ import annotations

import os
import signal
import threading

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for a Ctrl-C


def exit_on_interrupt() -> None:
    """Install the SIGINT -> exit(130) path (main thread only; call once, before any work)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGINT, lambda signum, frame: None)  # a Python handler: the C handler then writes the fd
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch():
        while True:
            data = os.read(r, 64)
            if data and signal.SIGINT in data:
                try:
                    os.write(2, b"\nkvjax: interrupted\n")
                finally:
                    os._exit(EXIT_INTERRUPTED)

    threading.Thread(target=watch, name="kvjax-interrupt", daemon=True).start()
