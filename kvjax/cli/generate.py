"""`kvjax generate`: decode from a prompt with the full cache or with VeriCache, streamed, optionally checked against
full-cache decoding."""

from __future__ import annotations

import json
import os
import sys
import time

from kvjax.cli.common import DEFAULT_MODEL, CliError, add_json, log, progress_bar

STREAM_CHUNK = 32  # full-mode decode steps per jitted call when streaming (one compile, text every chunk)


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


def _decode(model, cache, tok, num_steps: int):
    """`num_steps` greedy full-cache steps after `tok` (one jitted `lax.fori_loop`): (tokens i32[1, num_steps], cache)."""
    import jax.numpy as jnp

    from kvjax.decode import steps

    return steps.decode(model.params, model.config, cache, tok, jnp.zeros((1,), jnp.int32), num_steps=num_steps,
                        family=model.family, impl=model.attention)


def _decode_full(model, ids, n: int, stream: _Stream, warmup: bool = True):
    """Greedy full-cache decoding with progress: chunked prefill, then `STREAM_CHUNK`-step `greedy_decode` calls."""
    import jax.numpy as jnp
    import numpy as np

    from kvjax.cache.capacity import pick_capacity
    from kvjax.decode import steps

    cache = model.family.init_cache(model.config, 1, pick_capacity(ids.size + n + STREAM_CHUNK), model.cache_dtype)
    with progress_bar(ids.size, "prefill") as bar:
        logits, cache = steps.prefill(model, cache, ids, on_chunk=lambda d: bar.update(d - bar.n))
    tok = jnp.argmax(logits).astype(jnp.int32)[None]
    if warmup and n > 1:  # compile on a copy, so tokens_per_s is the compiled speed
        import jax

        jax.block_until_ready(_decode(model, jax.tree.map(jnp.copy, cache), tok, STREAM_CHUNK)[0])
    out = [int(tok[0])]
    stream.add(out)
    t0 = time.perf_counter()
    with progress_bar(n, "decode") as bar:
        bar.update(1)
        while len(out) < n:
            rest, cache = _decode(model, cache, tok, STREAM_CHUNK)
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

    from kvjax.decode import sampling, steps, vericache

    n = args.new_tokens
    vericache.check_draft_len(model, args.draft_len)
    full = model.family.init_cache(model.config, 1, vericache.capacity_for(ids.size, n, args.draft_len), model.cache_dtype)
    with progress_bar(ids.size, "prefill") as bar:
        logits, full = steps.prefill(model, full, ids, on_chunk=lambda d: bar.update(d - bar.n))
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
        log(f"warm-up (compile) {warm_s:.1f}s")
    stream.add([int(first[0])])
    with progress_bar(n, "decode") as bar:
        def progress(done, new=None):  # `new`: the round's tokens, when run_vericache passes them
            if new is not None:
                stream.add(new)
            bar.update(done - bar.n)

        out, stats = vericache.run_vericache(model, full, first, ids, n, progress=progress, **kw)
    if stream.enabled and len(stream.ids) == 1:  # this run_vericache reports counts only: print the text now
        stream.add(out[1:])
    return out, {**stats, "warmup_s": round(warm_s, 3)}


def cmd_generate(args) -> dict:
    import numpy as np

    model = _load_model(args)
    ids = _prompt_ids(args, model)
    if args.new_tokens < 1:
        raise CliError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    log(f"model {os.path.basename(os.path.normpath(args.model))}: {model.config.num_layers} layers, "
         f"prompt {ids.size} tokens, generating {args.new_tokens} ({args.mode})")
    stream = _Stream(model.tokenizer, enabled=not args.json_stdout)
    t0 = time.perf_counter()
    if args.mode == "full":
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

    from kvjax.cache.capacity import pick_capacity
    from kvjax.decode import steps

    cache = model.family.init_cache(model.config, 1, pick_capacity(ids.size + n + 2), model.cache_dtype)
    logits, cache = steps.prefill(model, cache, ids)
    first = jnp.argmax(logits).astype(jnp.int32)[None]
    warm = jax.tree.map(jnp.copy, cache)
    jax.block_until_ready(_decode(model, warm, first, n)[0])
    t0 = time.perf_counter()
    jax.block_until_ready(_decode(model, cache, first, n)[0])
    return n / (time.perf_counter() - t0)


def _compare_full(args, model, ids, out) -> dict:
    """Check VeriCache tokens against the full-cache reference decode and time full-cache decoding."""
    import numpy as np

    from kvjax.decode import vericache

    if args.mode != "vericache":
        return {}
    log("checking against full-cache reference decoding ...")
    ref = vericache.reference_decode(model, ids, len(out), draft_len=args.draft_len)
    identical = bool(np.array_equal(ref, np.asarray(out)))
    full_tps = _full_cache_tokens_per_s(model, ids, len(out))
    return dict(identical_to_full_cache=identical, full_cache_tokens_per_s=round(full_tps, 2))


def summary(result: dict) -> str:
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


def register(sub) -> None:
    """Add the `generate` subcommand to the parser's subparsers."""
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
