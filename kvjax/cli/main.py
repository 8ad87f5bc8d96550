"""The `kvjax` console command.

    kvjax generate [--model DIR|FILE.gguf|NAME] (--prompt TEXT | --prompt-file F | --long-prompt N | --prompts-file F.jsonl)
                   [--chat] [--new-tokens M] [--temperature T --top-p P --top-k K --min-p M --seed S]
                   [--stop TEXT ...] [--ignore-eos] [--logprobs] [--mode full|vericache] [--compressor NAME]
                   [--draft-len X] [--offload] [--compare-full] [--tp N --dp N] [--json [PATH]]
    kvjax bench NAME [--json [PATH]] [-- SCRIPT ARGS]      run scripts/bench_NAME.py (`kvjax bench --list`)
    kvjax cache STORE [--namespace HEX] [--verify] [--evict HEX | --evict-corrupt] [--json [PATH]]
    kvjax models [--json [PATH]]                           the model names kvjax fetches, and which are cached
    kvjax plot RESULT.json [MORE.json ...] -o OUT.png [--kind auto|throughput|accepted|memory|prefix|accuracy] [--json [PATH]]

`--json` alone prints the result as JSON on stdout (and nothing else there); `--json PATH` writes it to PATH.
Progress bars (tqdm) go to stderr on a terminal, and never run while generated text streams to the same terminal;
when stderr is not a terminal, each phase prints one line there instead. Ctrl-C exits with status 130.
Compiled programs are kept in JAX's persistent cache (`$KVJAX_CACHE_DIR/xla`; `KVJAX_COMPILE_CACHE=0` turns it off),
so a second run with the same shapes does not compile again. `kvjax --version` prints the version. Errors print as
one line (`kvjax: error: ...`) with a non-zero exit status, never a traceback (set KVJAX_DEBUG=1 to see one).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from kvjax.cli import bench, cache, compile_cache, generate, models, plot, serve
from kvjax.cli.common import CliError, log
from kvjax.cli.generate import summary
from kvjax.cli.interrupt import exit_on_interrupt
from kvjax.cli.output import check_output_path
from kvjax.errors import KvjaxError


class _Version(argparse.Action):
    """`--version`: the version and which CPU attention runs ("native", or "xla" with the reason the native kernel
    is not there). Resolved only when asked: the first call may build the native kernel."""

    def __call__(self, parser, namespace, values, option_string=None):
        from kvjax import __version__
        from pallas_kernels import native

        st = native.status()
        cpu = "native" if st["ok"] else f"xla (native kernel unavailable: {st['reason'][:300]})"
        sys.stdout.write(f"kvjax {__version__}\nCPU attention: {cpu}\n")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvjax", description="Exact long-context decoding in JAX.")
    p.add_argument("--version", action=_Version, nargs=0, help="print the version and the CPU attention in use")
    sub = p.add_subparsers(dest="command", required=True)
    for module in (generate, bench, cache, plot, models, serve):
        module.register(sub)
    return p


def _one_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    plain = isinstance(e, (CliError, KvjaxError, ValueError, OSError))
    return f"kvjax: error: {'' if plain else type(e).__name__ + ': '}{msg or type(e).__name__}"


def _quiet_broken_pipe() -> int:
    """stdout's reader went away (`kvjax ... | head`): stop writing, no traceback."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


def main(argv=None) -> int:
    """The command: `argv` None reads sys.argv and is the real process (then Ctrl-C exits 130 at once, see
    `kvjax.cli.interrupt`); a list runs in-process (tests), where KeyboardInterrupt returns 130."""
    if argv is None and threading.current_thread() is threading.main_thread():
        exit_on_interrupt()
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = []
    if "--" in argv:  # `kvjax bench NAME -- SCRIPT ARGS`: everything after -- goes to the script untouched
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    try:
        args = build_parser().parse_args(argv)
    except BrokenPipeError:  # --help / --version into a closed pipe
        return _quiet_broken_pipe()
    args.script_args = script_args
    args.json_stdout = args.json == "-"
    try:
        if script_args and args.command != "bench":
            raise CliError(f"arguments after -- are for `kvjax bench` only, got {' '.join(script_args)}")
        check_output_path(args.json)
        compile_cache.enable()
        result = args.fn(args)
        if args.command == "generate":
            log(summary(result))
        if args.json_stdout and not result.get("batch"):  # a batch's stdout is its JSONL rows, nothing else
            print(json.dumps(result, indent=1), flush=True)
        elif args.json and not result.get("batch"):
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
    except BrokenPipeError:
        return _quiet_broken_pipe()
    except KeyboardInterrupt:
        log("kvjax: interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - the promise is one line, not a traceback
        if os.environ.get("KVJAX_DEBUG"):
            raise
        log(_one_line(e))
        return 2
    if result.get("identical_to_full_cache") is False:
        log("kvjax: error: VeriCache output differs from full-cache decoding")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
