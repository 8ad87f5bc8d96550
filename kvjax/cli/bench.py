"""`kvjax bench NAME -- ARGS`: run scripts/bench_NAME.py from the repository root."""

from __future__ import annotations

import ast
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
            doc = ast.get_docstring(ast.parse(src)) or ""  # the module docstring, however long
            out[f[len("bench_"):-3]] = doc.strip().splitlines()[0] if doc.strip() else ""
    return out


OUTPUT_FLAGS = ("--json", "--plot")  # the scripts' output paths: resolved from where the user is, not the repository


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
    out_dir = os.path.abspath(args.out or os.getcwd())
    if not os.path.isdir(out_dir):
        raise CliError(f"--out {args.out}: folder does not exist")
    script = os.path.join(SCRIPTS, f"bench_{args.name}.py")
    script_args = _outputs_here(list(args.script_args), out_dir, f"bench_{args.name}.json", script)
    cmd = [sys.executable, script, *script_args]
    log("running: " + " ".join(cmd[1:]))
    t0 = time.perf_counter()
    # the script's own table goes to stderr when stdout carries our JSON; it runs from the repository root, where its
    # default model paths (checkpoints/...) resolve
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
    result = dict(suite=args.name, args=script_args, returncode=r.returncode,
                  seconds=round(time.perf_counter() - t0, 3))
    if r.returncode:
        raise CliError(f"benchmark {args.name} exited with status {r.returncode}")
    out_json = _flag_value(script_args, "--json")
    if out_json and os.path.exists(out_json):
        result["result_json"] = out_json
        log(f"wrote {out_json}")
        png = _flag_value(script_args, "--plot") or os.path.splitext(out_json)[0] + ".png"
        if os.path.exists(png):
            result["plot"] = png
            log(f"wrote {png}")
    return result


def _outputs_here(argv: list[str], out_dir: str, default_json: str, script: str) -> list[str]:
    """The script's arguments with its output paths absolute: a relative --json/--plot resolves from `out_dir` (the
    user's working directory or `--out`), and a script that takes --json gets `out_dir/bench_NAME.json` when none
    was given."""
    for i, a in enumerate(argv):
        for flag in OUTPUT_FLAGS:
            if a == flag and i + 1 < len(argv):
                argv[i + 1] = os.path.join(out_dir, argv[i + 1])
            elif a.startswith(flag + "="):
                argv[i] = flag + "=" + os.path.join(out_dir, a.split("=", 1)[1])
    if _flag_value(argv, "--json") is None and not {"-h", "--help"} & set(argv):
        with open(script, encoding="utf-8") as f:
            takes_json = '"--json"' in f.read()
        if takes_json:
            argv += ["--json", os.path.join(out_dir, default_json)]
    return argv


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
                       description="Runs scripts/bench_NAME.py from the repository root (relative model paths in the "
                                   "script's arguments resolve from there); its JSON and plot go to the working "
                                   "directory (or --out) and their paths are printed.")
    b.add_argument("name", nargs="?")
    b.add_argument("--list", action="store_true", help="list the suites")
    b.add_argument("--out", metavar="DIR", help="folder for the script's JSON and plot (default: the working "
                                                "directory; a relative --json/--plot after -- resolves here too)")
    add_json(b)
    b.set_defaults(fn=cmd_bench)
