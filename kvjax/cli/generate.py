"""`kvjax generate`: decode from a prompt (or a JSONL batch of them) with the full cache or with VeriCache; text
streams to stdout as it is produced, progress goes to stderr, `--compare-full` checks VeriCache against full-cache
decoding. Every flag is checked before any work starts; a flag that means nothing in the chosen mode is refused."""

from __future__ import annotations

import json
import math
import os
import time

from kvjax.cli.common import DEFAULT_MODEL, CliError, add_json, log, progress_bar
from kvjax.cli.output import TextStream, check_output_path, jsonable
from kvjax.cli.prompts import batch_prompts, single_prompt

DEFAULT_MAX_NEW_TOKENS = 128  # == kvjax.api.DEFAULT_MAX_NEW_TOKENS (kept literal: --help must not import JAX)
MAX_DRAFT_LEN = 256  # == kvjax.decode.vericache.MAX_DRAFT_LEN
ADAPTIVE_SET = (2, 4, 8, 16, 32)  # == kvjax.decode.draft_length.DEFAULT_SET (this module imports no JAX)
COMPRESSORS = ("streaming", "snapkv", "kvzip", "kivi2", "kivi4", "dropquant", "refresh", "refresh_kivi2",
               "refresh_kivi4")
# drafts per verification when --draft-len is not given: the length the default draft maker was measured best at
DEFAULT_DRAFT_LEN = 32  # a fixed draft length where adaptation is not available (--prompts-file batches)
ADAPTIVE_START = 8  # the first round's draft length of an adaptive run without --draft-len
VERICACHE_ONLY = ("compressor", "draft_len", "adaptive", "offload", "compare_full", "rejection")


# ------------------------------------------------------------------------------------------------ checks
def check_args(args) -> None:
    """Every refusal that needs no model: ranges, contradictions, flags meaningless in the mode."""
    given = [f for f in ("prompt", "prompt_file", "long_prompt", "prompts_file") if getattr(args, f)]
    if len(given) != 1:
        names = ", ".join("--" + f.replace("_", "-") for f in given) or "none"
        raise CliError(f"give exactly one of --prompt, --prompt-file, --long-prompt, --prompts-file (got {names})")
    if args.new_tokens < 1:
        raise CliError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.long_prompt is not None and args.long_prompt < 1:
        raise CliError(f"--long-prompt must be >= 1 tokens, got {args.long_prompt}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise CliError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise CliError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0 <= args.min_p < 1:
        raise CliError(f"--min-p must be in [0, 1), got {args.min_p}")
    for flag in ("tp", "dp"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.host_devices < 0:
        raise CliError(f"--host-devices must be >= 0, got {args.host_devices}")
    if args.mode == "full":
        given = [f for f in VERICACHE_ONLY if getattr(args, f) not in (None, False)]
        if given:
            raise CliError(f"--{given[0].replace('_', '-')} means nothing with --mode full (it is a VeriCache "
                           f"option: add --mode vericache)")
    else:
        if args.draft_len is not None and not 1 <= args.draft_len <= MAX_DRAFT_LEN:
            raise CliError(f"--draft-len must be in [1, {MAX_DRAFT_LEN}], got {args.draft_len}")
        if args.rejection and args.temperature == 0:
            raise CliError("--rejection needs --temperature > 0")
        if args.offload and args.tp * args.dp > 1:
            raise CliError("--offload cannot be combined with --tp/--dp (host offload is single-device)")
        if args.adaptive and args.prompts_file:
            raise CliError("--adaptive takes one prompt, not a --prompts-file batch")
        if args.adaptive and (args.draft_len or ADAPTIVE_START) not in ADAPTIVE_SET:
            raise CliError(f"--adaptive starts at --draft-len, which must be one of {list(ADAPTIVE_SET)}, "
                           f"got {args.draft_len}")
        if args.compare_full and args.prompts_file:
            raise CliError("--compare-full checks one prompt, not a --prompts-file batch")
    if args.prefix_store and args.prompts_file:
        raise CliError("--prefix-store takes one prompt, not a --prompts-file batch")
    if args.prompts_file and args.logprobs and args.mode == "vericache":
        raise CliError("--logprobs with --mode vericache takes one prompt, not a --prompts-file batch")
    check_output_path(args.json)


def _simulate_host_devices(n: int) -> None:
    """Ask XLA for `n` CPU devices; only possible before JAX has started its backends."""
    import sys

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
    from kvjax.formats.named import NAMED_MODELS  # noqa: PLC0415 - no JAX here

    if not os.path.exists(args.model) and args.model not in NAMED_MODELS:
        raise CliError(f"no model at {args.model} (expected a Hugging Face directory with config.json, a .gguf file, "
                       f"or a model name: {', '.join(sorted(NAMED_MODELS))})")
    import kvjax

    model = kvjax.load(args.model, dtype=args.dtype)
    if args.rope_scaling:
        model = _scale_rope(model, args.rope_scaling)
    if args.tp * args.dp > 1:
        import jax

        from kvjax import sharding

        if jax.device_count() < args.tp * args.dp:
            raise CliError(f"--tp {args.tp} --dp {args.dp} needs {args.tp * args.dp} devices, JAX sees "
                           f"{jax.device_count()} (on a CPU, add --host-devices {args.tp * args.dp})")
        model = sharding.shard_model(model, sharding.make_mesh(tp=args.tp, dp=args.dp))
    return model


def _scale_rope(model, spec: str):
    """--rope-scaling KIND:FACTOR: the model's context extended by rope scaling (opt-in, said on stderr)."""
    import dataclasses

    kind, _, factor = spec.partition(":")
    try:
        f = float(factor)
    except ValueError:
        raise CliError(f"--rope-scaling takes KIND:FACTOR (e.g. yarn:2), got {spec!r}") from None
    if model.family.name != "llama":
        raise CliError(f"--rope-scaling applies to Llama-family models, not {model.family.name!r}")
    from kvjax.models.llama.config import with_rope_scaling

    trained = model.config.max_position_embeddings
    model = dataclasses.replace(model, config=with_rope_scaling(model.config, kind, f))
    log(f"rope scaling {kind} x{f:g}: context {trained} -> {model.config.max_position_embeddings} tokens (positions "
        f"past {trained} were never trained; quality there is not measured)")
    return model


def check_context(model, n_prompt: int, n_new: int) -> None:
    """A prompt longer than the model's trained context is refused (opt in with --rope-scaling); new tokens that run
    past it are warned about on stderr."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not limit:
        return
    factor = -(-(n_prompt + n_new) // limit)
    if n_prompt > limit:
        raise CliError(f"prompt of {n_prompt} tokens exceeds the model's trained context of {limit} tokens; to run "
                       f"past it anyway, opt in to rope scaling with --rope-scaling yarn:{factor}")
    if n_prompt + n_new > limit:
        log(f"warning: prompt of {n_prompt} tokens + {n_new} new runs past the model's trained context of {limit} "
            f"tokens (--rope-scaling yarn:{factor} extends it)")


def _sampling_kw(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)


def _stop_rule(args, model):
    from kvjax.generation import StopRule

    stop = list(args.stop or []) + list(args.stop_id or [])
    return StopRule(model.config.eos_token_ids, stop or None, ignore_eos=args.ignore_eos, tokenizer=model.tokenizer)


# ------------------------------------------------------------------------------------------------ one prompt
def _run_full(model, ids, args, text: TextStream):
    """Full-cache decoding, streamed chunk by chunk; the decode is timed after its compile (warm-up on a copy)."""
    from kvjax import api
    from kvjax.decode.sampling import Sampling
    from kvjax.generation import DeltaBuilder, finish

    rule, n = _stop_rule(args, model), args.new_tokens
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    deltas = DeltaBuilder(rule, n)
    toks, lps, t0, plans = [], [], None, []
    with progress_bar(ids.size, "prefill") as pbar:
        chunks = api._full_chunks(model, ids, n, sampling, args.seed, args.logprobs, rule,
                                  on_prefill=lambda d: pbar.update(d - pbar.n), warmup=args.warmup,
                                  prefix_cache=args.prefix_cache, plans=plans)
        first, first_lp = next(chunks)
    prefix = _prefix_report(plans[0] if plans else None)  # logged before any text streams
    t0 = time.perf_counter()
    bar = progress_bar(n, "decode") if not text.live else None
    for new, lp in _chain([(first, first_lp)], chunks):
        toks += new
        lps += lp
        d = deltas.add(new)
        if d is not None:
            text.write(d.text)
        if bar is not None:
            bar.update(min(len(toks), n) - bar.n)
        if deltas.ended:
            break
    dt = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    g = finish(toks, rule, n, prompt_tokens=int(ids.size), logprobs=lps if args.logprobs else None)
    return g, dict(tokens_per_s=round((len(g) - 1) / dt, 2) if len(g) > 1 and dt > 0 else None, **prefix)


def _chain(*its):
    for it in its:
        yield from it


def _run_vericache(model, ids, args, text: TextStream):
    """VeriCache with the prefill's progress, a compile warm-up on a copy, and each round's text as it is verified."""
    import jax
    import jax.numpy as jnp

    from kvjax.decode import vericache
    from kvjax.decode.sampling import Sampling
    from kvjax.generation import DeltaBuilder, finish

    rule, n = _stop_rule(args, model), args.new_tokens
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    # measured (README): adapting x beats every fixed x on the bundled checkpoint, so it is what a run without
    # --draft-len does; --draft-len alone asks for that fixed length
    adaptive = args.adaptive or args.draft_len is None
    x = args.draft_len or ADAPTIVE_START
    xs = ADAPTIVE_SET if adaptive else (x,)
    for xi in xs:
        vericache.check_draft_len(model, xi)
    comp = model.family.make_compressor(args.compressor)
    from kvjax import api

    with progress_bar(ids.size, "prefill") as pbar:
        last, full, plan = api.prefill(model, ids, vericache.capacity_for(ids.size, n, max(xs)),
                                       prefix_cache=args.prefix_cache, on_chunk=lambda d: pbar.update(d - pbar.n))
        first = vericache.first_token(last, ids.size, jnp.asarray([args.seed], jnp.int32), sampling)
    prefix = _prefix_report(plan)
    kw = dict(compressor=comp, draft_len=x, offload=args.offload, temperature=sampling, seed=args.seed,
              rejection=args.rejection, adaptive=xs if adaptive else None)
    warm_s = 0.0
    if args.warmup and n > 1:
        # compile the draft/verify steps on a copy first: the full-cache figure (`--compare-full`) is timed compiled,
        # so VeriCache's must be too
        t0 = time.perf_counter()
        with progress_bar(len(xs), "warm-up (compile)") as wbar:
            for xi in xs:  # every draft length an adaptive run may pick
                vericache.run_vericache(model, jax.tree.map(jnp.copy, full), first, ids, min(n, 2 * xi + 2),
                                        **{**kw, "draft_len": xi, "adaptive": None})
                wbar.update(1)
        warm_s = time.perf_counter() - t0
        log(f"warm-up (compile) {warm_s:.1f}s")
    deltas = DeltaBuilder(rule, n)
    bar = progress_bar(n, "decode") if not text.live else None

    def progress(done, new):
        d = deltas.add(new)
        if d is not None:
            text.write(d.text)
        if bar is not None:
            bar.update(min(done, n) - bar.n)

    out, stats = vericache.run_vericache(model, full, first, ids, n, progress=progress,
                                         should_stop=lambda o: rule.end(o) is not None, **kw)
    if bar is not None:
        bar.close()
    g = finish(out, rule, n, prompt_tokens=int(ids.size), stats=stats)
    return g, {**stats, "warmup_s": round(warm_s, 3), **prefix}


def _open_prefix_cache(args, model):
    """A PrefixCache over `--prefix-store URL` (created when the location is empty, reused when it is a store)."""
    if not args.prefix_store:
        return None
    import kvjax

    store = args.prefix_store
    if "://" not in store:
        store = os.path.abspath(store)
        os.makedirs(store, exist_ok=True)
    return kvjax.PrefixCache(kvjax.forms_for(model.config, model.cache_dtype), store_url=store)


def _prefix_report(plan) -> dict:
    if plan is None:
        return {}
    log(f"prefix cache: {plan}")
    return dict(prefix_hit_tokens=int(plan.boundary), prefix_recomputed_tokens=int(plan.prompt_tokens - plan.boundary),
                prefix_plan=plan.summary())


def _compare_full(args, model, ids, g) -> dict:
    """Check VeriCache tokens against the full-cache reference decode and time full-cache decoding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.cache.capacity import pick_capacity
    from kvjax.decode import steps, vericache
    from kvjax.decode.sampling import Sampling

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    with progress_bar(len(g), "reference decode (check)") as bar:
        x = args.draft_len or ADAPTIVE_START
        ref = vericache.reference_decode(model, ids, len(g), draft_len=x, temperature=sampling,
                                         seed=args.seed, progress=lambda k: bar.update(k - bar.n))
    identical = bool(np.array_equal(ref, g.tokens))
    with progress_bar(2, "full-cache decode (timing)") as bar:
        cache = model.family.init_cache(model.config, 1, pick_capacity(ids.size + len(g) + 2), model.cache_dtype)
        logits, cache = steps.prefill(model, cache, ids)
        first = jnp.argmax(logits).astype(jnp.int32)[None]
        seed = jnp.zeros((1,), jnp.int32)

        def run(c):
            return steps.decode(model.params, model.config, c, first, seed, num_steps=len(g), family=model.family,
                                impl=model.attention)[0]

        jax.block_until_ready(run(jax.tree.map(jnp.copy, cache)))
        bar.update(1)
        t0 = time.perf_counter()
        jax.block_until_ready(run(cache))
        full_tps = len(g) / (time.perf_counter() - t0)
        bar.update(1)
    return dict(identical_to_full_cache=identical, full_cache_tokens_per_s=round(full_tps, 2))


# ------------------------------------------------------------------------------------------------ the command
def cmd_generate(args) -> dict:
    check_args(args)
    model = _load_model(args)
    if args.prompts_file:
        return _run_batch(model, args)
    ids = single_prompt(args, model)
    from kvjax.api import check_token_ids

    ids = check_token_ids(model, ids)
    check_context(model, int(ids.size), args.new_tokens)
    args.prefix_cache = _open_prefix_cache(args, model)  # a location that is not a store fails here, before any work
    log(f"model {os.path.basename(os.path.normpath(args.model))} ({model.family.name}): "
        f"{model.config.num_layers} layers, prompt {ids.size} tokens, up to {args.new_tokens} new ({args.mode})")
    text = TextStream(enabled=not args.json_stdout and model.tokenizer is not None)
    t0 = time.perf_counter()
    runner = _run_full if args.mode == "full" else _run_vericache
    try:
        g, stats = runner(model, ids, args, text)
    finally:
        if args.prefix_cache is not None:
            args.prefix_cache.flush()  # entries written to the store before the process ends
    dt = time.perf_counter() - t0
    text.end()
    if args.compare_full:
        stats = {**stats, **_compare_full(args, model, ids, g)}
    return dict(mode=args.mode, family=model.family.name, seconds=round(dt, 3), mesh=dict(tp=args.tp, dp=args.dp),
                **g.to_json(), **jsonable({k: v for k, v in stats.items() if k != "finish_reason"}))


def _run_batch(model, args) -> dict:
    """--prompts-file: one JSON result per line (stdout, or the --json file), in the file's order."""
    import kvjax

    prompts = batch_prompts(args, model)
    stop = list(args.stop or []) + list(args.stop_id or [])
    kw = dict(**_sampling_kw(args), stop=stop or None, ignore_eos=args.ignore_eos)
    log(f"model {os.path.basename(os.path.normpath(args.model))} ({model.family.name}): {len(prompts)} prompts, "
        f"up to {args.new_tokens} new tokens each ({args.mode})")
    t0 = time.perf_counter()
    if args.mode == "full":
        gens = kvjax.generate(model, prompts, args.new_tokens, logprobs=args.logprobs, **kw)
        rows = [g.to_json() for g in gens]
    else:
        res = kvjax.generate_vericache(model, prompts, args.new_tokens, compressor=args.compressor,
                                       draft_len=args.draft_len or DEFAULT_DRAFT_LEN, **kw)
        rows = [dict(text=model.tokenizer.decode(t.tolist(), skip_special_tokens=True) if model.tokenizer else None,
                     tokens=t.tolist(), finish_reason=s["finish_reason"], new_tokens=int(t.size)) for t, s in res]
    lines = [json.dumps(dict(index=i, **r)) for i, r in enumerate(rows)]
    if args.json not in (None, "-"):
        with open(args.json, "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    else:
        print("\n".join(lines), flush=True)
    return dict(batch=True, mode=args.mode, prompts=len(rows), seconds=round(time.perf_counter() - t0, 3),
                written=args.json if args.json not in (None, "-") else "stdout")


def summary(result: dict) -> str:
    """The one-line summary printed on stderr after a run."""
    keys = ("mode", "family", "prompt_tokens", "new_tokens", "finish_reason", "tokens_per_s",
            "full_cache_tokens_per_s", "mean_accepted_per_round", "mean_x", "identical_to_full_cache", "seconds",
            "prompts")
    parts = [f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}"
             for k in keys if k in result and result[k] is not None]
    if result.get("tokens_per_s") and result.get("full_cache_tokens_per_s"):
        parts.append(f"speedup_vs_full={result['tokens_per_s'] / result['full_cache_tokens_per_s']:.2f}x")
    return "summary: " + " ".join(parts)


def register(sub) -> None:
    """Add the `generate` subcommand to the parser's subparsers."""
    g = sub.add_parser("generate", help="decode from a prompt (full cache or VeriCache)",
                       description=__doc__.replace("`", ""))
    src = g.add_argument_group("prompt (exactly one)")
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", metavar="FILE", help="read the prompt from a UTF-8 text file")
    src.add_argument("--long-prompt", type=int, metavar="N", help="N tokens of held-out code from the corpus")
    src.add_argument("--prompts-file", metavar="FILE.jsonl",
                     help='a batch: one JSON object per line, {"prompt": text} or {"token_ids": [...]}; one JSON '
                          'result per line on stdout (or in --json PATH)')
    src.add_argument("--prompt-index", type=int, default=0, help="which held-out text --long-prompt uses (default 0)")
    src.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="Hugging Face-format model directory, a .gguf file, or a model name (`kvjax models`, e.g. "
                        "smollm2-135m-instruct, fetched once) (default: the bundled checkpoints/kvjax-code-tiny)")
    g.add_argument("--new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"most tokens to generate (default {DEFAULT_MAX_NEW_TOKENS}, as the Python API)")
    g.add_argument("--mode", choices=["full", "vericache"], default="full",
                   help="full-cache decoding or VeriCache (default full)")
    g.add_argument("--rope-scaling", metavar="KIND:FACTOR",
                   help="opt in to a context past the model's trained length by rope scaling, e.g. yarn:2 "
                        "(linear or yarn; Llama family; quality past the trained length is not measured)")
    g.add_argument("--dtype", default="f32", choices=["f32", "bf16"], help="weights and cache dtype (default f32)")
    s = g.add_argument_group("sampling and stopping (every mode)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="keep tokens >= min-p x the most likely (default 0)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    s.add_argument("--stop", action="append", metavar="TEXT", help="stop at this string (repeatable)")
    s.add_argument("--stop-id", action="append", type=int, metavar="ID", help="stop at this token id (repeatable)")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's end-of-sequence token")
    s.add_argument("--logprobs", action="store_true", help="report each token's log-probability")
    v = g.add_argument_group("VeriCache (--mode vericache only)")
    v.add_argument("--compressor", choices=COMPRESSORS, help="draft maker (default: the model family's measured best, "
                                                             "`model.family.default_compressor`; DeepSeek-V4 models "
                                                             "take streaming, kivi4, kivi2, dropquant)")
    v.add_argument("--draft-len", type=int,
                   help=f"a fixed number of drafts per verification, 1..{MAX_DRAFT_LEN} (default: adaptive from "
                        f"{ADAPTIVE_START}; a --prompts-file batch: {DEFAULT_DRAFT_LEN})")
    v.add_argument("--adaptive", action="store_true",
                   help=f"pick each round's draft length from {list(ADAPTIVE_SET)} by the measured acceptance and "
                        "step times, starting at --draft-len (the default when --draft-len is not given)")
    v.add_argument("--offload", action="store_true", help="keep the prompt's full cache in host memory")
    v.add_argument("--rejection", action="store_true", help="speculative rejection sampling (needs --temperature)")
    v.add_argument("--compare-full", action="store_true",
                   help="also run full-cache decoding: identity check and throughput ratio")
    m = g.add_argument_group("devices and timing")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mesh over heads, default 1)")
    m.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    m.add_argument("--host-devices", type=int, default=0,
                   help="CPU only: simulate N devices (sets XLA_FLAGS before JAX starts) to try --tp/--dp")
    m.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the first (compiling) decode calls too")
    g.add_argument("--prefix-store", metavar="URL",
                   help="prefix cache in a TensorStore kvstore (a directory or file:// URL; gs://, s3:// where "
                        "available): created when empty, reused after; reports the hit tokens")
    add_json(g)
    g.set_defaults(fn=cmd_generate)
