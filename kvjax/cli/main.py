"""The `kvjax` console command.

    kvjax generate [--model DIR] (--prompt TEXT | --prompt-file F | --long-prompt N) [--chat] [--new-tokens M]
                   [--mode full|vericache] [--compressor NAME] [--draft-len X] [--offload] [--compare-full]
                   [--tp N --dp N] [--json [PATH]]
    kvjax bench NAME [--json [PATH]] [-- SCRIPT ARGS]      run scripts/bench_NAME.py (`kvjax bench --list`)
    kvjax cache STORE [--namespace HEX] [--verify] [--evict HEX | --evict-corrupt] [--json [PATH]]
    kvjax plot RESULT.json [MORE.json ...] -o OUT.png [--kind auto|throughput|accepted|memory|prefix] [--json [PATH]]

`--json` alone prints the result as JSON on stdout (and nothing else there); `--json PATH` writes it to PATH.
Progress bars (tqdm) go to stderr on a terminal. Errors print as one line (`kvjax: error: ...`) with a non-zero exit
status, never a traceback (set KVJAX_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvjax.cli import bench, cache, generate, plot
from kvjax.cli.common import CliError, log
from kvjax.cli.generate import summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvjax", description="Exact long-context decoding in JAX.")
    sub = p.add_subparsers(dest="command", required=True)
    for module in (generate, bench, cache, plot):
        module.register(sub)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = []
    if "--" in argv:  # `kvjax bench NAME -- SCRIPT ARGS`: everything after -- goes to the script untouched
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    args.script_args = script_args
    args.json_stdout = args.json == "-"
    try:
        if script_args and args.command != "bench":
            raise CliError(f"arguments after -- are for `kvjax bench` only, got {' '.join(script_args)}")
        result = args.fn(args)
    except KeyboardInterrupt:
        log("kvjax: interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - the promise is one line, not a traceback
        if os.environ.get("KVJAX_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        name = "" if isinstance(e, (CliError, ValueError, OSError)) else f"{type(e).__name__}: "
        log(f"kvjax: error: {name}{msg or type(e).__name__}")
        return 2
    if args.command == "generate":
        log(summary(result))
    if args.json_stdout:
        print(json.dumps(result, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if result.get("identical_to_full_cache") is False:
        log("kvjax: error: VeriCache output differs from full-cache decoding")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
