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
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = os.path.join(ROOT, "checkpoints", "kvjax-code-tiny")
SCRIPTS = os.path.join(ROOT, "scripts")
STREAM_CHUNK = 32  # full-mode decode steps per jitted call when streaming (one compile, text every chunk)


class CliError(Exception):
    """A user-facing error: printed as one line."""


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, disable=None, leave=False)


# ------------------------------------------------------------------------------------------------ generate
def _prompt_ids(args, model):
    import numpy as np

    tok = model.tokenizer
    if args.long_prompt:
        if tok is None:
            raise CliError("--long-prompt needs a model directory with tokenizer.json")
        from kvjax.data import corpus

        return corpus.long_prompts(tok, args.long_prompt, 1, seed=args.seed)[0]
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            text = f.read()
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise CliError("give one of --prompt, --prompt-file or --long-prompt")
    if tok is None:
        raise CliError(f"model directory {model.path} has no tokenizer.json; pass token ids via the Python API")
    if args.chat:
        return np.asarray(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True),
                          np.int32)
    return np.asarray(tok.encode(text), np.int32)


class _Stream:
    """Prints decoded text as tokens arrive (stdout), keeping the decoded prefix so multi-token characters and
    tokenizer merges print correctly."""

    def __init__(self, tokenizer, enabled: bool):
        self.tok, self.enabled, self.ids, self.shown = tokenizer, enabled and tokenizer is not None, [], ""

    def add(self, ids) -> None:
        if not self.enabled:
            return
        self.ids += [int(t) for t in ids]
        text = self.tok.decode(self.ids)
        if text.startswith(self.shown) and not text.endswith("\ufffd"):  # hold back half a UTF-8 character
            sys.stdout.write(text[len(self.shown):])
            sys.stdout.flush()
            self.shown = text

    def end(self) -> None:
        if self.enabled:
            sys.stdout.write("\n")


def _simulate_host_devices(n: int) -> None:
    """Ask XLA for `n` CPU devices; only possible before JAX has started its backends."""
    flag = f"--xla_force_host_platform_device_count={n}"
    started = False
    if "jax" in sys.modules:  # imported is fine; XLA reads the flag when the first backend starts
        try:
            from jax._src import xla_bridge  # private, hence the fallback below

            started = xla_bridge.backends_are_initialized()
        except (ImportError, AttributeError):
            started = True
    if started:
        import jax

        if jax.device_count() < n:
            raise CliError(f"--host-devices {n}: JAX already started with {jax.device_count()} devices "
                           f"(set XLA_FLAGS={flag} in the environment instead)")
        return
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _load_model(args):
    if args.host_devices:
        _simulate_host_devices(args.host_devices)
    import kvjax

    if not os.path.exists(os.path.join(args.model, "config.json")):
        raise CliError(f"no model at {args.model} (expected a Hugging Face directory with config.json)")
    model = kvjax.load(args.model, dtype=args.dtype)
    if args.tp * args.dp > 1:
        from kvjax import sharding

        model = sharding.shard_model(model, sharding.make_mesh(tp=args.tp, dp=args.dp))
    return model


def _cache_dtype(model):
    import jax.numpy as jnp

    return jnp.bfloat16 if model.dtype in ("bf16", "bfloat16") else jnp.float32


def _decode_full(model, ids, n: int, stream: _Stream, warmup: bool = True):
    """Greedy full-cache decoding with progress: chunked prefill, then `STREAM_CHUNK`-step `greedy_decode` calls."""
    import jax.numpy as jnp
    import numpy as np

    from kvjax.models.llama.cache import init_cache
    from kvjax.cache.capacity import pick_capacity
    from kvjax.decode import steps

    cache = init_cache(model.config, 1, pick_capacity(ids.size + n + STREAM_CHUNK), _cache_dtype(model))
    with _bar(ids.size, "prefill") as bar:
        logits, cache = steps.prefill(model.params, model.config, cache, ids, on_chunk=lambda d: bar.update(d - bar.n))
    tok = jnp.argmax(logits).astype(jnp.int32)[None]
    if warmup and n > 1:  # compile on a copy, so tokens_per_s is the compiled speed
        import jax

        jax.block_until_ready(steps.greedy_decode(model.params, model.config, jax.tree.map(jnp.copy, cache), tok,
                                                  num_steps=STREAM_CHUNK)[0])
    out = [int(tok[0])]
    stream.add(out)
    t0 = time.perf_counter()
    with _bar(n, "decode") as bar:
        bar.update(1)
        while len(out) < n:
            rest, cache = steps.greedy_decode(model.params, model.config, cache, tok, num_steps=STREAM_CHUNK)
            new = [int(t) for t in np.asarray(rest[0])][: n - len(out)]
            out += new
            stream.add(new)
            bar.update(len(new))
            tok = rest[:, -1]
    dt = time.perf_counter() - t0
    return np.asarray(out, np.int32), dict(tokens_per_s=round((n - 1) / dt, 2) if n > 1 else None)


def _decode_vericache(model, ids, args, stream: _Stream):
    """VeriCache with progress bars: the prefill of `vericache.prefill_for`, then `run_vericache`."""
    import jax.numpy as jnp

    from kvjax.models.llama.cache import init_cache
    from kvjax.decode import rounds as draft_steps, sampling, steps, vericache

    n = args.new_tokens
    draft_steps.check_draft_len(model.config, args.draft_len)
    full = init_cache(model.config, 1, vericache.capacity_for(ids.size, n, args.draft_len), _cache_dtype(model))
    with _bar(ids.size, "prefill") as bar:
        logits, full = steps.prefill(model.params, model.config, full, ids, on_chunk=lambda d: bar.update(d - bar.n))
    first = sampling.select_tokens(logits[None, None, :], jnp.asarray([[ids.size]], jnp.int32),
                                   jnp.asarray([args.seed], jnp.int32), 0.0)[0]
    kw = dict(compressor=args.compressor, draft_len=args.draft_len, offload=args.offload, seed=args.seed)
    warm_s = 0.0
    if args.warmup and n > 1:
        # compile the draft/verify steps on a copy first: the full-cache figure (`--compare-full`) is timed compiled,
        # so VeriCache's must be too
        import jax

        t0 = time.perf_counter()
        vericache.run_vericache(model, jax.tree.map(jnp.copy, full), first, ids, min(n, 2 * args.draft_len + 2), **kw)
        warm_s = time.perf_counter() - t0
        _log(f"warm-up (compile) {warm_s:.1f}s")
    stream.add([int(first[0])])
    with _bar(n, "decode") as bar:
        def progress(done, new=None):  # `new`: the round's tokens, when run_vericache passes them
            if new is not None:
                stream.add(new)
            bar.update(done - bar.n)

        out, stats = vericache.run_vericache(model, full, first, ids, n, progress=progress, **kw)
    if stream.enabled and len(stream.ids) == 1:  # this run_vericache reports counts only: print the text now
        stream.add(out[1:])
    return out, {**stats, "warmup_s": round(warm_s, 3)}


def _decode_family(model, ids, args):
    """Models with their own family API (DeepSeek-V4): plain greedy or that family's VeriCache, no mesh/compare."""
    import kvjax

    if args.compare_full or args.tp * args.dp > 1 or args.offload:
        raise CliError(f"--compare-full, --tp/--dp and --offload support the Llama family only, not "
                       f"{model.config.family}")
    if args.mode == "full":
        return kvjax.generate(model, ids, max_new_tokens=args.new_tokens, stop_at_eos=False), {}
    from kvjax.models.deepseek_v4 import draft as deepseek_v4_vericache

    out, stats = deepseek_v4_vericache.generate_vericache(model, ids, args.new_tokens, x=args.draft_len)
    return out, stats


def cmd_generate(args) -> dict:
    import numpy as np

    model = _load_model(args)
    ids = _prompt_ids(args, model)
    if args.new_tokens < 1:
        raise CliError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    _log(f"model {os.path.basename(os.path.normpath(args.model))}: {model.config.num_layers} layers, "
         f"prompt {ids.size} tokens, generating {args.new_tokens} ({args.mode})")
    stream = _Stream(model.tokenizer, enabled=not args.json_stdout)
    t0 = time.perf_counter()
    if getattr(model, "family_api", None) is not None:  # DeepSeek-V4: its own decoders, text at the end
        out, stats = _decode_family(model, ids, args)
        stream.add(out)
    elif args.mode == "full":
        out, stats = _decode_full(model, ids, args.new_tokens, stream, warmup=args.warmup)
    else:
        out, stats = _decode_vericache(model, ids, args, stream)
    dt = time.perf_counter() - t0
    stream.end()
    if args.compare_full:
        stats = {**stats, **_compare_full(args, model, ids, out)}
    text = model.tokenizer.decode([int(t) for t in out]) if model.tokenizer is not None else None
    return dict(mode=args.mode, prompt_tokens=int(ids.size), new_tokens=int(len(out)), seconds=round(dt, 3),
                mesh=dict(tp=args.tp, dp=args.dp), text=text, tokens=np.asarray(out).tolist(),
                **{k: v for k, v in stats.items() if _jsonable(v)})


def _full_cache_tokens_per_s(model, ids, n: int) -> float:
    """Throughput of kvjax's best full-cache decoder (one `lax.fori_loop` call), compiled before it is timed."""
    import jax
    import jax.numpy as jnp

    from kvjax.models.llama.cache import init_cache
    from kvjax.cache.capacity import pick_capacity
    from kvjax.decode import steps

    cache = init_cache(model.config, 1, pick_capacity(ids.size + n + 2))
    logits, cache = steps.prefill(model.params, model.config, cache, ids)
    first = jnp.argmax(logits).astype(jnp.int32)[None]
    warm = jax.tree.map(jnp.copy, cache)
    jax.block_until_ready(steps.greedy_decode(model.params, model.config, warm, first, num_steps=n)[0])
    t0 = time.perf_counter()
    jax.block_until_ready(steps.greedy_decode(model.params, model.config, cache, first, num_steps=n)[0])
    return n / (time.perf_counter() - t0)


def _compare_full(args, model, ids, out) -> dict:
    """Check VeriCache tokens against the full-cache reference decode and time full-cache decoding."""
    import numpy as np

    from kvjax.decode import vericache

    if args.mode != "vericache":
        return {}
    _log("checking against full-cache reference decoding ...")
    ref = vericache.reference_decode(model, ids, len(out), draft_len=args.draft_len)
    identical = bool(np.array_equal(ref, np.asarray(out)))
    full_tps = _full_cache_tokens_per_s(model, ids, len(out))
    return dict(identical_to_full_cache=identical, full_cache_tokens_per_s=round(full_tps, 2))


def _summary(result: dict) -> str:
    keys = ("mode", "prompt_tokens", "new_tokens", "tokens_per_s", "full_cache_tokens_per_s",
            "mean_accepted_per_round", "identical_to_full_cache", "seconds")
    parts = [f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}"
             for k in keys if k in result]
    if "tokens_per_s" in result and "full_cache_tokens_per_s" in result and result["full_cache_tokens_per_s"]:
        parts.append(f"speedup_vs_full={result['tokens_per_s'] / result['full_cache_tokens_per_s']:.2f}x")
    return "summary: " + " ".join(parts)


def _jsonable(v) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


# ------------------------------------------------------------------------------------------------ bench
def bench_suites() -> dict[str, str]:
    """Benchmark name -> first docstring line, for every scripts/bench_NAME.py."""
    if not os.path.isdir(SCRIPTS):
        raise CliError(f"no benchmark scripts at {SCRIPTS} (they ship with the source tree, not the wheel)")
    out = {}
    for f in sorted(os.listdir(SCRIPTS)):
        if f.startswith("bench_") and f.endswith(".py"):
            with open(os.path.join(SCRIPTS, f), encoding="utf-8") as fh:
                head = fh.read(2000)
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
    _log("running: " + " ".join(cmd[1:]))
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


# ------------------------------------------------------------------------------------------------ cache, plot
def cmd_cache(args) -> dict:
    from kvjax.prefix import inspect as store_inspect

    report = store_inspect.inspect(args.store, namespace=args.namespace, verify=args.verify or args.evict_corrupt)
    if args.evict:
        report["evicted_namespaces"] = store_inspect.evict_namespace(args.store, args.evict)
    if args.evict_corrupt:
        report["evicted_corrupt"] = store_inspect.evict_entries(args.store, report["corrupt"])
    if not args.json_stdout:
        print(store_inspect.format_report(report))
    if report.get("corrupt") and not args.evict_corrupt:
        raise CliError(f"{len(report['corrupt'])} corrupt entries (first: {report['corrupt'][0]['key']}: "
                       f"{report['corrupt'][0]['why']}); --evict-corrupt deletes them")
    return report


def cmd_plot(args) -> dict:
    from kvjax import plots

    kind, info = plots.plot_files(args.paths, args.output, kind=args.kind)
    _log(f"wrote {args.output} ({kind})")
    return dict(output=args.output, kind=kind, **info)


# ------------------------------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvjax", description="Exact long-context decoding in JAX.")
    sub = p.add_subparsers(dest="command", required=True)

    def add_json(sp):
        sp.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="print the result as JSON on stdout, or write it to PATH")

    g = sub.add_parser("generate", help="decode from a prompt (full cache or VeriCache)")
    g.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face-format model directory")
    g.add_argument("--prompt")
    g.add_argument("--prompt-file")
    g.add_argument("--long-prompt", type=int, default=0, help="use N tokens of held-out stdlib code as the prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--new-tokens", type=int, default=128)
    g.add_argument("--mode", choices=["full", "vericache"], default="full")
    g.add_argument("--compressor", default="streaming")
    g.add_argument("--draft-len", type=int, default=16)
    g.add_argument("--offload", action="store_true", help="keep the prompt's full KV in host memory")
    g.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mesh over heads)")
    g.add_argument("--dp", type=int, default=1, help="data-parallel degree")
    g.add_argument("--host-devices", type=int, default=0,
                   help="CPU only: simulate N devices (sets XLA_FLAGS before JAX starts) to try --tp/--dp")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the first (compiling) decode calls too")
    g.add_argument("--compare-full", action="store_true",
                   help="also run full-cache decoding: identity check and throughput ratio")
    add_json(g)
    g.set_defaults(fn=cmd_generate)

    b = sub.add_parser("bench", help="run a benchmark suite (scripts/bench_NAME.py); script args after --",
                       description="Runs scripts/bench_NAME.py from the repository root (relative paths in the "
                                   "script's arguments resolve from there).")
    b.add_argument("name", nargs="?")
    b.add_argument("--list", action="store_true", help="list the suites")
    add_json(b)
    b.set_defaults(fn=cmd_bench)

    c = sub.add_parser("cache", help="inspect, verify or evict a prefix-cache store")
    c.add_argument("store", help="TensorStore kvstore URL or directory (file:// by default)")
    c.add_argument("--namespace", help="only namespaces whose hex starts with this")
    c.add_argument("--verify", action="store_true", help="read every entry and check header and checksum")
    c.add_argument("--evict", metavar="HEX", help="delete every key of the namespaces starting with HEX")
    c.add_argument("--evict-corrupt", action="store_true", help="verify, then delete entries that fail")
    add_json(c)
    c.set_defaults(fn=cmd_cache)

    pl = sub.add_parser("plot", help="plot benchmark JSON (the plot is picked from the content)")
    pl.add_argument("paths", nargs="+", help="benchmark or `kvjax generate --json` result files")
    pl.add_argument("-o", "--output", required=True, help="PNG path")
    pl.add_argument("--kind", default="auto", choices=["auto", "throughput", "accepted", "memory", "prefix"])
    add_json(pl)
    pl.set_defaults(fn=cmd_plot)
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
        _log("kvjax: interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - the promise is one line, not a traceback
        if os.environ.get("KVJAX_DEBUG"):
            raise
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        name = "" if isinstance(e, (CliError, ValueError, OSError)) else f"{type(e).__name__}: "
        _log(f"kvjax: error: {name}{msg or type(e).__name__}")
        return 2
    if args.command == "generate":
        _log(_summary(result))
    if args.json_stdout:
        print(json.dumps(result, indent=1))
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if result.get("identical_to_full_cache") is False:
        _log("kvjax: error: VeriCache output differs from full-cache decoding")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
