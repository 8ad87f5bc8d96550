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
DEFAULT_DRAFT_LEN = 32  # == draft_length.DEFAULT_FIXED: a fixed x where adaptation is not available (batches)
ADAPTIVE_START = 8  # == draft_length.DEFAULT_START: the first round's x of an adaptive run without --draft-len
VERICACHE_ONLY = ("compressor", "draft_len", "adaptive", "ratio", "max_kept", "draft_dtype", "draft_weights",
                  "offload", "compare_full", "rejection")


# ------------------------------------------------------------------------------------------------ checks
def check_args(args) -> None:
    """Every refusal that needs no model: ranges, contradictions, flags meaningless in the mode."""
    given = [f for f in ("prompt", "prompt_file", "long_prompt", "prompts_file") if getattr(args, f) is not None]
    if len(given) != 1:
        names = ", ".join("--" + f.replace("_", "-") for f in given) or "none"
        raise CliError(f"give exactly one of --prompt, --prompt-file, --long-prompt, --prompts-file (got {names})")
    if args.prompt is not None and not args.prompt:
        raise CliError("--prompt is empty: give the text to continue")
    if args.new_tokens < 1:
        raise CliError(f"--new-tokens must be >= 1, got {args.new_tokens}")
    if args.long_prompt is not None and args.long_prompt < 1:
        raise CliError(f"--long-prompt must be >= 1 tokens, got {args.long_prompt}")
    if args.prompt_index is not None and args.long_prompt is None:
        raise CliError("--prompt-index picks the held-out text of --long-prompt; it means nothing with "
                       f"--{given[0].replace('_', '-')}")
    if args.prompt_index is not None and args.prompt_index < 0:
        raise CliError(f"--prompt-index must be >= 0, got {args.prompt_index}")
    if args.chat and args.long_prompt is not None:
        raise CliError("--chat wraps text in the chat template; --long-prompt is raw held-out code (use --prompt-file "
                       "with --chat to template a file)")
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
        if args.ratio is not None and not args.ratio >= 1:
            raise CliError(f"--ratio must be >= 1 (prompt tokens per kept token), got {args.ratio}")
        if args.max_kept is not None and args.max_kept < 32:
            raise CliError(f"--max-kept must be >= 32 (kept tokens per head), got {args.max_kept}")
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
        if args.compare_full and args.rejection:
            raise CliError("--compare-full checks token-for-token exactness, which --rejection does not promise "
                           "(rejection sampling preserves the distribution, not the sample): drop one of them")
    if args.prefix_store and args.prompts_file:
        raise CliError("--prefix-store takes one prompt, not a --prompts-file batch")
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


def _compressor_kw(args) -> dict:
    """The drafter's fields the command line set (--ratio, --max-kept, --draft-dtype, --draft-weights); the rest keep
    its defaults."""
    given = dict(ratio=args.ratio, max_kept=args.max_kept, draft_dtype=args.draft_dtype,
                 draft_weights=args.draft_weights)
    return {k: v for k, v in given.items() if v is not None}


def _sampling_kw(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed)


def _stop_rule(args, model):
    from kvjax.generation import StopRule

    stop = list(args.stop or []) + list(args.stop_id or [])
    return StopRule(model.config.eos_token_ids, stop or None, ignore_eos=args.ignore_eos, tokenizer=model.tokenizer)


# ------------------------------------------------------------------------------------------------ one prompt
def _run_full(model, ids, args, text: TextStream):
    """Full-cache decoding, streamed chunk by chunk; the decode is timed compiled (`kvjax.api` leaves chunks that
    compiled out of tokens_per_s; the warm-up compiles the chunk on a copy first so that there is one to time)."""
    from kvjax import api
    from kvjax.decode.sampling import Sampling
    from kvjax.generation import DeltaBuilder, finish

    rule, n = _stop_rule(args, model), args.new_tokens
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    deltas = DeltaBuilder(rule, n)
    toks, lps, plans, timing = [], [], [], {}
    with progress_bar(ids.size, "prefill") as pbar:
        chunks = api._full_chunks(model, ids, n, sampling, args.seed, args.logprobs, rule,
                                  on_prefill=lambda d: pbar.update(d - pbar.n), warmup=args.warmup,
                                  prefix_cache=args.prefix_cache, plans=plans, timing=timing)
        first, first_lp = next(chunks)
    _log_plan(plans[0] if plans else None)  # logged before any text streams
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
    if bar is not None:
        bar.close()
    stats = dict(api._timing_stats(timing), **api.prefix_stats(plans[0] if plans else None))
    g = finish(toks, rule, n, prompt_tokens=int(ids.size), logprobs=lps if args.logprobs else None, stats=stats)
    return g, g.stats


def _chain(*its):
    for it in its:
        yield from it


def _run_vericache(model, ids, args, text: TextStream):
    """VeriCache (`kvjax.api.vericache_one`) with the prefill's progress, a compile warm-up on a copy, and each
    round's text as it is verified."""
    from kvjax import api
    from kvjax.decode.sampling import Sampling
    from kvjax.generation import DeltaBuilder

    rule, n = _stop_rule(args, model), args.new_tokens
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    # measured (README): adapting x beats every fixed x on the bundled checkpoint, so it is what a run without
    # --draft-len does (the API's default too); --draft-len alone asks for that fixed length
    cfg = api.vericache_config(model, n, compressor=args.compressor, compressor_kw=_compressor_kw(args),
                               draft_len=args.draft_len,
                               adaptive=True if args.adaptive else None, offload=args.offload,
                               rejection=args.rejection)
    args.draft_set = cfg.xs
    deltas = DeltaBuilder(rule, n)
    bars = {}

    def on_prefill(done):
        if "prefill" not in bars:
            bars["prefill"] = progress_bar(ids.size, "prefill")
        bars["prefill"].update(done - bars["prefill"].n)

    def on_warmup(k):
        if "warm" not in bars:
            _close(bars.pop("prefill", None))
            bars["warm"] = progress_bar(len(cfg.xs), f"warm-up (compile x={list(cfg.xs)})")
        bars["warm"].update(k - bars["warm"].n)

    def progress(done, new):
        if "decode" not in bars:
            _close(bars.pop("prefill", None))
            _close(bars.pop("warm", None))
            bars["decode"] = progress_bar(n, "decode") if not text.live else None
        d = deltas.add(new)
        if d is not None:
            text.write(d.text)
        if bars["decode"] is not None:
            bars["decode"].update(min(done, n) - bars["decode"].n)

    kept = {}  # --compare-full: the prefilled state, for timing the run again (a copy of the full cache meanwhile)
    keep = (lambda last, full, masses: kept.update(state=(last, full), masses=masses)) if args.compare_full else None
    try:
        g = api.vericache_one(model, ids, n, rule, sampling, args.seed, cfg, logprobs=args.logprobs,
                              prefix_cache=args.prefix_cache, warmup=args.warmup, progress=progress,
                              on_prefill=on_prefill, on_plan=_log_plan, on_warmup=on_warmup, keep_prefilled=keep)
    finally:
        for b in bars.values():
            _close(b)
    if g.stats.get("warmup_s"):
        log(f"warm-up (compile) {g.stats['warmup_s']:.1f}s")
    # --compare-full checks the run against a reference decoded from the same prefilled state, and times the same
    # run again between its full-cache timings from it
    args.prefilled = kept.get("state")
    args.rerun_vericache = lambda: api.vericache_one(
        model, ids, n, rule, sampling, args.seed, cfg,
        prefilled=None if args.prefilled is None else (*args.prefilled, kept.get("masses")))
    return g, g.stats


def _close(bar) -> None:
    if bar is not None:
        bar.close()


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


def _log_plan(plan) -> None:
    """The prefix cache's Plan on stderr (before any text streams)."""
    if plan is not None:
        log(f"prefix cache: {plan}")


# --compare-full: full-cache and VeriCache timings each, alternated (medians reported). Five, not three: on a shared
# 2-core machine one slow run in three moved the median ratio of SmolLM2's 8K command from ~1.6x to 1.48x (last stop's
# three runs: 1.48x, 1.75x, 1.48x); each more pair costs ~5 s of that ~75 s command.
TIMING_RUNS = 5


def _compare_full(args, model, ids, g) -> dict:
    """Check VeriCache tokens against the full-cache reference decode, then time full-cache decoding (compiled first,
    as VeriCache's tokens_per_s counts only rounds that compiled nothing: the ratio compares compiled runs) and
    VeriCache alternately, `TIMING_RUNS` times each (the run above is VeriCache's first), so a drift in the shared
    machine's speed falls on both; the speedup is the ratio of the medians.

    Both start from a copy of the run's own prefilled state where it is what they would prefill (measured, SmolLM2's
    8K prompt: two prefills of ~26 s each fewer): the reference (the same prefill program on the same prompt, so the
    same bits) unless a prefix cache restored part of it -- a restored prefix is checked against a fresh prefill --
    and the timing when its capacity bucket is the run's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kvjax.cache.capacity import pick_capacity
    from kvjax.decode import steps, vericache
    from kvjax.decode.sampling import Sampling

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.min_p)
    state = getattr(args, "prefilled", None)  # (last-row logits, full cache) of the run above
    with progress_bar(len(g), "reference decode (check)") as bar:
        xs = args.draft_set  # the reference takes the run's cache capacity (its largest x) and a verify shape
        ref = vericache.reference_decode(model, ids, len(g), draft_len=xs[0], max_draft=max(xs), temperature=sampling,
                                         seed=args.seed, progress=lambda k: bar.update(k - bar.n),
                                         prefilled=state if args.prefix_cache is None else None)
    identical = bool(np.array_equal(ref, g.tokens))
    with progress_bar(2 * TIMING_RUNS, "full-cache decode and VeriCache (timing, alternated)") as bar:
        capacity = pick_capacity(ids.size + len(g) + 2)
        if state is not None and vericache.shaped_as_cache(model, state[1], capacity):
            logits, cache = state  # every timed run decodes a copy of it
        else:
            cache = model.family.init_cache(model.config, 1, capacity, model.cache_dtype)
            logits, cache = steps.prefill(model, cache, ids)
        first = jnp.argmax(logits).astype(jnp.int32)[None]
        seed = jnp.zeros((1,), jnp.int32)

        def run(c):
            return steps.decode(model.loop_params(), model.config, c, first, seed, num_steps=len(g), family=model.family,
                                impl=model.attention)[0]

        jax.block_until_ready(run(jax.tree.map(jnp.copy, cache)))  # compiles
        bar.update(1)
        full_tps, vc_tps = [], [g.stats.get("tokens_per_s")]
        for i in range(TIMING_RUNS):
            c = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
            t0 = time.perf_counter()
            jax.block_until_ready(run(c))
            full_tps.append(len(g) / (time.perf_counter() - t0))
            if i + 1 < TIMING_RUNS:
                vc_tps.append(args.rerun_vericache().stats.get("tokens_per_s"))
            bar.update(min(2, 2 * TIMING_RUNS - bar.n))
    args.rerun_vericache = args.prefilled = None  # frees the kept copy of the prefilled cache
    full_med = float(np.median(full_tps))
    vc_tps = [t for t in vc_tps if t is not None]  # a run whose every round compiled times nothing
    out = dict(identical_to_full_cache=identical, full_cache_tokens_per_s=round(full_med, 2),
               timing_runs=dict(full_cache_tokens_per_s=[round(t, 2) for t in full_tps],
                                vericache_tokens_per_s=[round(t, 2) for t in vc_tps]))
    if vc_tps:
        vc_med = float(np.median(vc_tps))
        out.update(vericache_tokens_per_s_median=round(vc_med, 2), speedup_vs_full=round(vc_med / full_med, 3))
    return out


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
    else:
        gens = kvjax.generate_vericache(model, prompts, args.new_tokens, compressor=args.compressor,
                                        compressor_kw=_compressor_kw(args),
                                        draft_len=args.draft_len or DEFAULT_DRAFT_LEN, logprobs=args.logprobs, **kw)
    rows = [g.to_json() for g in gens]
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
            "vericache_tokens_per_s_median", "full_cache_tokens_per_s", "mean_accepted_per_round", "mean_x",
            "identical_to_full_cache", "seconds", "prompts")
    parts = [f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}"
             for k in keys if k in result and result[k] is not None]
    if result.get("speedup_vs_full"):  # --compare-full: medians of alternated timings
        parts.append(f"speedup_vs_full={result['speedup_vs_full']:.2f}x")
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
    src.add_argument("--prompt-index", type=int, help="which held-out text --long-prompt uses (default 0; "
                                                      "--long-prompt only)")
    src.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (--prompt, "
                                                         "--prompt-file, --prompts-file text)")
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
    s.add_argument("--logprobs", action="store_true", help="report each token's log-probability (VeriCache: from the "
                                                            "verification's exact rows)")
    v = g.add_argument_group("VeriCache (--mode vericache only)")
    v.add_argument("--compressor", choices=COMPRESSORS, help="draft maker (default: the model family's measured best, "
                                                             "`model.family.default_compressor`, for Llama-family "
                                                             "models refresh with a bf16 draft where the kernels read "
                                                             "bf16; DeepSeek-V4 models take streaming, kivi4, kivi2, "
                                                             "dropquant)")
    v.add_argument("--draft-len", type=int,
                   help=f"a fixed number of drafts per verification, 1..{MAX_DRAFT_LEN} (default: adaptive from "
                        f"{ADAPTIVE_START}; a --prompts-file batch: {DEFAULT_DRAFT_LEN})")
    v.add_argument("--adaptive", action="store_true",
                   help=f"pick each round's draft length from {list(ADAPTIVE_SET)} by the measured acceptance and "
                        "step times, starting at --draft-len (the default when --draft-len is not given)")
    v.add_argument("--ratio", type=float, help="the draft's compression ratio: prompt tokens per kept token "
                                               "(default: the drafter's, 4)")
    v.add_argument("--max-kept", type=int, help="at most this many kept tokens per head, whatever the prompt's length "
                                                "(default: the default drafter's 2048; a named drafter's none)")
    v.add_argument("--draft-dtype", choices=("float32", "bfloat16", "int8"),
                   help="dtype of the draft's kept keys and values (default float32; the default drafter's int8 on "
                        "the CPU with the native kernels, else bfloat16; bfloat16: half the bytes; int8: codes with a "
                        "scale per head and slot, a quarter)")
    v.add_argument("--draft-weights", choices=("float32", "bfloat16", "int8", "int_dot"),
                   help="weights the draft reads (default: float32 with a named --compressor; the default drafter's "
                        "int8 on CPU where the native kernel builds -- int_dot or float32 for a GGUF model, whose "
                        "loops read its exact block codes --, bfloat16 on GPU/TPU; bfloat16: a bf16 copy, half the "
                        "bytes per draft token; int8: codes with a scale per output column, a quarter; int_dot: a GGUF "
                        "model's 4-bit codes (or a float model's int8 codes) times int16-rounded rows by integer dot "
                        "products, the default drafter's for a GGUF model where the CPU has them; verification keeps "
                        "the exact weights, so the output is unchanged)")
    v.add_argument("--offload", action="store_true", help="keep the prompt's full cache in host memory")
    v.add_argument("--rejection", action="store_true", help="speculative rejection sampling (needs --temperature)")
    v.add_argument("--compare-full", action="store_true",
                   help="also run full-cache decoding: identity check, and the throughput ratio of the medians "
                        f"of {TIMING_RUNS} timings each, alternated")
    m = g.add_argument_group("devices and timing")
    m.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (mesh over heads, default 1)")
    m.add_argument("--dp", type=int, default=1, help="data-parallel degree (default 1)")
    m.add_argument("--host-devices", type=int, default=0,
                   help="CPU only: simulate N devices (sets XLA_FLAGS before JAX starts) to try --tp/--dp")
    m.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the compile warm-up: decode calls that compile are then left out of tokens_per_s "
                        "(which is absent when every call compiled)")
    g.add_argument("--prefix-store", metavar="URL",
                   help="prefix cache in a TensorStore kvstore (a directory or file:// URL; gs://, s3:// where "
                        "available): created when empty, reused after; reports the hit tokens")
    add_json(g)
    g.set_defaults(fn=cmd_generate)
