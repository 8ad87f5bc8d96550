"""Transparent huge pages for the large arrays the steps stream through (full caches, weights).

Why: a decode step or a verify reads its cache and weights once, front to back. With 4 KiB pages every 4 KiB of that
stream is a TLB miss, the hardware prefetchers stop at each page boundary, and on a virtual machine each miss walks two
page tables. Measured on the 2-core AMD EPYC VM (Zen 4, 32 MiB L3): one core summing 134 MiB ran at 21 GB/s on 4 KiB
pages and 34 GB/s on 2 MiB ones; the bundled model at 32K (8 held-out prompts, 128 tokens, x = 8, one run each way):
full-cache decoding 207 -> 228 tokens/s, VeriCache 355 -> 415 tokens/s (its round's verify 12.3 -> 10.6 ms, its
draft phase 3.4 -> 2.8 ms), the same tokens.

How: Linux backs a region with huge pages when its THP mode is "always", or when it is "madvise" (the usual default)
and the region was advised MADV_HUGEPAGE. glibc's malloc (2.35 and later) advises every region it maps when the
tunable `glibc.malloc.hugetlb=1` is set -- and XLA's CPU buffers come from malloc. Tunables are read only when a
process starts, so the `kvjax` command and the benchmark scripts re-execute themselves once with it set (`reexec`);
a program that imports kvjax keeps its memory as it is (kvjax never re-executes a process it did not start): run it
with `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` to get the same. `KVJAX_HUGEPAGES=0` turns the re-execution off.
`status()` says what this process has.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb"
OFF_ENV = "KVJAX_HUGEPAGES"  # "0": never re-execute for huge pages
_MARK_ENV = "KVJAX_HUGEPAGES_REEXEC"  # set in the re-executed process: never a second time
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = _THP_ENABLED) -> str | None:
    """The kernel's transparent-huge-page mode ("always", "madvise" or "never"), None where it cannot be read."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def glibc_version() -> tuple[int, int] | None:
    """(major, minor) of the C library's glibc, None for another C library or platform."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, OSError, ValueError):
        return None


def tunable_set(environ=None) -> bool:
    """Whether `GLIBC_TUNABLES` asks malloc for huge pages (`glibc.malloc.hugetlb` = 1 or 2)."""
    env = os.environ if environ is None else environ
    for item in env.get("GLIBC_TUNABLES", "").split(":"):
        key, _, value = item.partition("=")
        if key == TUNABLE and value in ("1", "2"):
            return True
    return False


def status(environ=None) -> dict:
    """What this process's large arrays get: `active` (huge pages: THP "always", or "madvise" with the tunable under
    glibc >= 2.35), the THP mode, whether the tunable is set, and why not where they are not active."""
    mode, glibc, tun = thp_mode(), glibc_version(), tunable_set(environ)
    if mode == "always":
        active, why = True, ""
    elif mode != "madvise":
        active, why = False, f"transparent huge pages are {mode or 'not available'} here"
    elif glibc is None or glibc < (2, 35):
        active, why = False, "malloc cannot advise huge pages (needs glibc >= 2.35)"
    elif not tun:
        active, why = False, f"GLIBC_TUNABLES={TUNABLE}=1 was not set when this process started"
    else:
        active, why = True, ""
    return dict(active=active, thp_mode=mode, tunable=tun, reason=why)


def reexec_env(environ=None) -> dict | None:
    """The environment to re-execute this process with for huge pages, or None where that would change nothing
    (already active, THP not "madvise", glibc too old, turned off with KVJAX_HUGEPAGES=0, or already re-executed)."""
    env = dict(os.environ if environ is None else environ)
    if env.get(OFF_ENV) == "0" or env.get(_MARK_ENV):
        return None
    st = status(env)
    if st["active"] or st["thp_mode"] != "madvise" or not st["reason"].startswith("GLIBC_TUNABLES"):
        return None
    prior = env.get("GLIBC_TUNABLES", "")
    env["GLIBC_TUNABLES"] = f"{prior}:{TUNABLE}=1" if prior else f"{TUNABLE}=1"
    env[_MARK_ENV] = "1"
    return env


def reexec() -> None:
    """Re-execute this process (the same interpreter and command line, `sys.orig_argv`) with huge pages where
    `reexec_env` says it would get them; otherwise return. Only for a process kvjax started itself: the `kvjax`
    command and the benchmark scripts, before they allocate anything large."""
    env = reexec_env()
    if env is None:
        return
    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], env)
    except OSError:  # could not re-execute: carry on with 4 KiB pages
        return
