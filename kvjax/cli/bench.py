"""`kvjax bench NAME -- ARGS`: run scripts/bench_NAME.py from the repository root."""

from __future__ import annotations

import os
import sys
import time

from kvjax.cli.common import ROOT, SCRIPTS, CliError, add_json, log


def bench_suites() -> dict[str, str]:
    """Benchmark name -> first docstring line, for every scripts/bench_NAME.py."""
    if not os.path.isdir(SCRIPTS):
        raise CliError(f"no benchmark scripts at {SCRIPTS} (they ship with the source tree, not the wheel)")
    out = {}
    for f in sorted(os.listdir(SCRIPTS)):
        if f.startswith("bench_") and f.endswith(".py"):
            with open(os.path.join(SCRIPTS, f), encoding="utf-8") as fh:
                src = fh.read()
            if '__name__ == "__main__"' not in src:  # a helper module of the benchmarks, not one itself
                continue
            head = src[:2000]
            doc = head.split('"""')[1].strip().splitlines()[0] if head.count('"""') >= 2 else ""
            out[f[len("bench_"):-3]] = doc
    return out


def cmd_bench(args) -> dict:
    import subprocess

    suites = bench_suites()
    if args.list or not args.name:
        if not args.json_stdout:
            for k, v in suites.items():
                print(f"{k:16s} {v}")
        return dict(suites=suites)
    if args.name not in suites:
        raise CliError(f"unknown benchmark {args.name!r}; available: {', '.join(suites)}")
    cmd = [sys.executable, os.path.join(SCRIPTS, f"bench_{args.name}.py"), *args.script_args]
    log("running: " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    # the script's own table goes to stderr when stdout carries our JSON
    try:
        err_fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stderr is not a file (captured): relay the output after
        err_fd = None
    if not args.json_stdout:
        r = subprocess.run(cmd, cwd=ROOT)
    elif err_fd is not None:
        r = subprocess.run(cmd, cwd=ROOT, stdout=err_fd)
    else:
        r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        sys.stderr.write(r.stdout)
    result = dict(suite=args.name, args=args.script_args, returncode=r.returncode,
                  seconds=round(time.perf_counter() - t0, 3))
    out_json = _flag_value(args.script_args, "--json")
    if out_json:
        result["result_json"] = os.path.join(ROOT, out_json) if not os.path.isabs(out_json) else out_json
    if r.returncode:
        raise CliError(f"benchmark {args.name} exited with status {r.returncode}")
    return result


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def register(sub) -> None:
    """Add the `bench` subcommand to the parser's subparsers."""
    b = sub.add_parser("bench", help="run a benchmark suite (scripts/bench_NAME.py); script args after --",
                       description="Runs scripts/bench_NAME.py from the repository root (relative paths in the "
                                   "script's arguments resolve from there).")
    b.add_argument("name", nargs="?")
    b.add_argument("--list", action="store_true", help="list the suites")
    add_json(b)
    b.set_defaults(fn=cmd_bench)
