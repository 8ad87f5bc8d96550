"""Ctrl-C ends a real `kvjax generate` process with status 130 — never a segmentation fault — whether it lands in
prefill, the warm-up compile or the decode (`kvjax.cli.interrupt`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from builders import REPO

ARGV = [sys.executable, "-m", "kvjax.cli.main", "generate", "--mode", "vericache", "--long-prompt", "1500",
        "--new-tokens", "64", "--ignore-eos", "--json"]
DELAYS_S = (0.0, 1.0, 3.0)  # after the command has loaded the model: prefill, warm-up compile, warm-up / decode


def _start():
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(ARGV, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_for_line(proc, needle: bytes, timeout_s: float) -> list[bytes]:
    lines, end = [], time.monotonic() + timeout_s
    while time.monotonic() < end:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} on stderr: {b''.join(lines)!r}")


def test_ctrl_c_exits_130_at_every_phase():
    procs = [_start() for _ in DELAYS_S]  # side by side: the whole test costs one start-up
    try:
        heads = [_wait_for_line(p, b"up to 64 new", 60) for p in procs]
        t0 = time.monotonic()
        for p, delay in sorted(zip(procs, DELAYS_S), key=lambda pd: pd[1]):
            time.sleep(max(0.0, t0 + delay - time.monotonic()))
            p.send_signal(signal.SIGINT)
        for p, head, delay in zip(procs, heads, DELAYS_S):
            out, err = p.communicate(timeout=60)
            err = b"".join(head) + err
            assert p.returncode == 130, (delay, p.returncode, err[-2000:])
            assert b"Segmentation fault" not in err and b"Traceback" not in err, err[-2000:]
            assert err.rstrip().endswith(b"kvjax: interrupted")
            assert out == b""  # no half-written JSON
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
