"""The public API, the same for every model family: `load`, `logits`, `generate`, `generate_vericache`, `stream`.

`generate` and `generate_vericache` take one prompt (a 1-D sequence of token ids) or a batch (a list of them, ragged
lengths allowed — or a 2-D array). One prompt runs directly; a batch runs through the continuous-batching schedulers
(`kvjax.serve`) under a device-memory budget derived from the device. Sampling (`temperature`, `top_k`, `top_p`,
`min_p`, `seed`) and stopping (`stop` strings and token ids, EOS unless `ignore_eos`) mean the same in every mode
(`kvjax.decode.sampling.Sampling`, `kvjax.generation.StopRule`); VeriCache stays exact for all of them.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import warnings
from typing import Iterator

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from kvjax.arrays import np_dtype
from kvjax.cache.capacity import pick_capacity
from kvjax.checkpoint import read_safetensors
from kvjax.decode import steps
from kvjax.decode import vericache as vc
from kvjax.decode.sampling import Sampling
from kvjax.errors import InputError
from kvjax.families import family_for
from kvjax.generation import Delta, DeltaBuilder, Generation, StopRule, finish
from kvjax.model import Model

DEFAULT_MAX_NEW_TOKENS = 128  # the API's and the CLI's default token budget
STREAM_CHUNK = 32  # full-cache decode steps per jitted call: one compiled shape for every length, text every chunk


def load(path: str | os.PathLike, *, dtype: str = "f32", attention: str | None = None) -> Model:
    """Load a Hugging Face-format model directory (config.json + safetensors [+ tokenizer.json]).

    Args:
        path: model directory.
        dtype: parameter and cache dtype, "f32" (CPU default: measured ~10x faster than bf16 there) or "bf16".
        attention: attention implementation: None (Pallas kernels on a GPU; on a CPU the native kernel where it
            builds, else XLA: `pallas_kernels.active_cpu_implementation()`), "xla", "pallas", "pallas_interpret",
            "pallas_debug", "native".

    Raises:
        FileNotFoundError: no config.json.
        UnsupportedConfigError / WeightsError: naming the field or tensor (and file) at fault.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"no config.json in {path}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            hf = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{cfg_path} is not a JSON config: {e}") from None
    np_dtype(dtype)  # an unknown dtype name fails here, naming the choices
    family = family_for(hf.get("model_type"))
    config = family.config_from_hf(hf)
    params = family.params_from_tensors(config, read_safetensors(path), dtype=dtype)
    tok = None
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from kvjax.tokenizer import Tokenizer  # noqa: PLC0415 - only models with a tokenizer need it

        tok = Tokenizer.from_dir(path)
    return Model(config=config, params=params, family=family, tokenizer=tok, path=path, dtype=dtype,
                 attention=pallas_kernels.resolve(attention))


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


def _logprob(row, token: int) -> float:
    row = np.asarray(row, np.float64)
    m = row.max()
    return float(row[token] - m - np.log(np.exp(row - m).sum()))


def prefill(model: Model, ids: np.ndarray, capacity: int, *, prefix_cache=None, on_chunk=None):
    """Prefill one prompt into a fresh cache of `capacity`: (last-row logits f32[V], cache, plan or None).

    With a `kvjax.PrefixCache`, the prompt goes through it: what it holds is restored (the Plan says what and from
    where), the rest is prefilled and inserted for later requests."""
    if prefix_cache is None:
        cache = model.family.init_cache(model.config, 1, capacity, model.cache_dtype)
        last, cache = steps.prefill(model, cache, ids, on_chunk=on_chunk)
        return last, cache, None
    from kvjax.prefix.prefill import prefill_with_prefix_cache  # noqa: PLC0415 - the prefix cache sits above

    last, cache, plan = prefill_with_prefix_cache(model, ids, prefix_cache, capacity=capacity)
    if on_chunk is not None:
        on_chunk(ids.size)
    return last, cache, plan


def _full_chunks(model: Model, ids: np.ndarray, max_new_tokens: int, sampling: Sampling, seed: int,
                 logprobs: bool, rule: StopRule, on_prefill=None, warmup: bool = False,
                 prefix_cache=None, plans: list | None = None) -> Iterator[tuple[list, list]]:
    """Full-cache decoding of one prompt, yielding (new tokens, their logprobs or []) per jitted chunk until the stop
    rule ends the run or `max_new_tokens` are out (the last chunk may run past both; callers cut).

    `warmup`: compile the decode chunk on a copy of the cache before the first token is yielded, so that a caller
    timing from there times compiled code. `prefix_cache`: prefill through it (its Plan is appended to `plans`)."""
    last, cache, plan = prefill(model, ids, pick_capacity(ids.size + max_new_tokens + STREAM_CHUNK),
                                prefix_cache=prefix_cache, on_chunk=on_prefill)
    if plans is not None:
        plans.append(plan)
    seed_a = jnp.asarray([seed], jnp.int32)
    tok = vc.first_token(last, ids.size, seed_a, sampling)

    def chunk(c):
        return steps.decode(model.params, model.config, c, tok, seed_a, num_steps=STREAM_CHUNK, temperature=sampling,
                            return_logprobs=logprobs, family=model.family, impl=model.attention)

    if warmup and max_new_tokens > 1:
        import jax  # noqa: PLC0415 - only the timed CLI path warms up

        jax.block_until_ready(chunk(jax.tree.map(jnp.copy, cache)))
    done = [int(tok[0])]
    yield done[:], ([_logprob(last, done[0])] if logprobs else [])
    while len(done) < max_new_tokens and rule.end(done) is None:
        res = chunk(cache)
        rest, cache = res[0], res[1]
        new = [int(t) for t in np.asarray(rest[0])]
        done += new
        yield new, ([float(x) for x in np.asarray(res[2][0])] if logprobs else [])
        tok = rest[:, -1]


def _sampling(temperature, top_k, top_p, min_p) -> Sampling:
    return Sampling(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def generate(model: Model, prompt_ids, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0, stop=None,
             ignore_eos: bool = False, logprobs: bool = False, stream: bool = False, budget_bytes: int | None = None):
    """Full-cache decoding: greedy, or position-keyed sampling with the usual filters.

    Args:
        model: a `kvjax.Model`.
        prompt_ids: one prompt (1-D token ids) or a batch (a list of them, or a 2-D array).
        max_new_tokens: most tokens to generate.
        temperature, top_k, top_p, min_p: sampling (`kvjax.decode.sampling.Sampling`); temperature 0 is greedy.
        seed: sampling seed (a batch uses seed + i for prompt i).
        stop: stop strings and/or token ids; ignore_eos: keep going past end-of-sequence tokens.
        logprobs: return each token's log-probability (a batch then runs prompt by prompt).
        stream: return an iterator of `Delta`s instead (one prompt only).
        budget_bytes: device bytes for a batch's caches (default: `kvjax.serve.memory.default_budget`).

    Returns:
        a `Generation` (array-like token ids with `.text`, `.finish_reason`, `.logprobs`), a list of them for a batch,
        or an iterator of `Delta`s when `stream`.
    """
    max_new_tokens = _check_max_new(max_new_tokens)
    sampling = _sampling(temperature, top_k, top_p, min_p)
    seed = _check_seed(seed)
    rule = StopRule(model.config.eos_token_ids, stop, ignore_eos=ignore_eos, tokenizer=model.tokenizer)
    if _is_batch(prompt_ids):
        if stream:
            raise InputError("stream=True takes one prompt, not a batch")
        batch = [check_token_ids(model, p, f"prompt {i}") for i, p in enumerate(prompt_ids)]
        if logprobs:
            return [_one_full(model, p, max_new_tokens, sampling, seed + i, rule, True) for i, p in enumerate(batch)]
        return _batch_full(model, batch, max_new_tokens, sampling, seed, rule, budget_bytes)
    ids = check_token_ids(model, prompt_ids)
    if stream:
        return _stream(_full_chunks(model, ids, max_new_tokens, sampling, seed, False, rule), rule, max_new_tokens)
    return _one_full(model, ids, max_new_tokens, sampling, seed, rule, logprobs)


def _one_full(model, ids, max_new_tokens, sampling, seed, rule, logprobs) -> Generation:
    toks, lps = [], []
    for new, lp in _full_chunks(model, ids, max_new_tokens, sampling, seed, logprobs, rule):
        toks += new
        lps += lp
    return finish(toks, rule, max_new_tokens, prompt_tokens=int(ids.size), logprobs=lps if logprobs else None)


def _batch_full(model, batch, max_new_tokens, sampling, seed, rule, budget_bytes) -> list[Generation]:
    from kvjax.serve.full_scheduler import FullCacheScheduler  # noqa: PLC0415 - serve sits above the engine
    from kvjax.serve.memory import default_budget  # noqa: PLC0415
    from kvjax.serve.requests import Request  # noqa: PLC0415

    sched = FullCacheScheduler(model, budget_bytes=budget_bytes or default_budget(), temperature=sampling)
    res = sched.run([Request(prompt=p, max_new_tokens=max_new_tokens, seed=seed + i) for i, p in enumerate(batch)])
    return [finish(res.outputs[i], rule, max_new_tokens, prompt_tokens=int(p.size),
                   stats=dict(res.stats, tokens_per_s=res.tokens_per_s)) for i, p in enumerate(batch)]


# ------------------------------------------------------------------------------------------------ VeriCache
def generate_vericache(model: Model, prompt_ids, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                       compressor=None, draft_len: int = 8, offload: bool = False, temperature: float = 0.0,
                       top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 0,
                       rejection: bool = False, adaptive: tuple | None = None, adaptive_policy: str = "cost",
                       recent_slots: int = 256,
                       compressor_kw: dict | None = None, stop=None, ignore_eos: bool = False,
                       return_logits: bool = False, progress=None, budget_bytes: int | None = None):
    """Exact decoding with a lossy draft cache and full-cache verification (VeriCache), for any family.

    Arguments as `generate`, plus `compressor` (one of `model.family.compressors` or a draft maker; None: the
    family's `default_compressor`), `draft_len`
    (x drafts per round, static), `offload` (full cache in host memory between verifications), `rejection`
    (speculative rejection sampling instead of position-keyed exact sampling), `adaptive` (a static set of x, e.g.
    `kvjax.decode.draft_length.DEFAULT_SET`) and `adaptive_policy` ("cost" or "grow_shrink"),
    `recent_slots`, `compressor_kw`, `return_logits` (each token's logits row, bit-identical to
    `reference_decode(..., return_logits=True)`), `progress(done, new_tokens)`.

    Returns:
        (tokens i32[n], stats) — stats carries "finish_reason" and the run's measurements (`RunMetrics.summary`) —
        plus the logits f32[n, V] when `return_logits`; a list of (tokens, stats) for a batch (run by
        `VeriCacheScheduler`: full caches in host memory, drafts batched, verifications staggered).
    """
    max_new_tokens = _check_max_new(max_new_tokens)
    sampling = _sampling(temperature, top_k, top_p, min_p)
    seed = _check_seed(seed)
    rule = StopRule(model.config.eos_token_ids, stop, ignore_eos=ignore_eos, tokenizer=model.tokenizer)
    if _is_batch(prompt_ids):
        batch = [check_token_ids(model, p, f"prompt {i}") for i, p in enumerate(prompt_ids)]
        if rejection or adaptive or return_logits:
            raise InputError("rejection, adaptive and return_logits take one prompt, not a batch")
        return _batch_vericache(model, batch, max_new_tokens, sampling, seed, rule, budget_bytes, compressor,
                                compressor_kw, draft_len)
    ids = check_token_ids(model, prompt_ids)
    res = vc.generate_vericache(model, ids, max_new_tokens, compressor=compressor, draft_len=draft_len,
                                offload=offload, temperature=sampling, seed=seed, rejection=rejection,
                                adaptive=adaptive, adaptive_policy=adaptive_policy, recent_slots=recent_slots,
                                compressor_kw=compressor_kw,
                                progress=progress, return_logits=return_logits,
                                should_stop=lambda out: rule.end(out) is not None)
    g = finish(res[0], rule, max_new_tokens, prompt_tokens=int(ids.size), stats=res[1])
    return (g.tokens, g.stats, res[2][: len(g)]) if return_logits else (g.tokens, g.stats)


def _batch_vericache(model, batch, max_new_tokens, sampling, seed, rule, budget_bytes, compressor, compressor_kw,
                     draft_len):
    from kvjax.serve.memory import default_budget  # noqa: PLC0415 - serve sits above the engine
    from kvjax.serve.requests import Request  # noqa: PLC0415
    from kvjax.serve.vericache_scheduler import VeriCacheScheduler  # noqa: PLC0415

    sched = VeriCacheScheduler(model, budget_bytes=budget_bytes or default_budget(), compressor=compressor,
                               compressor_kw=compressor_kw, draft_len=draft_len, temperature=sampling)
    # longest first: draft-batch slots are sized by the first admitted request
    order = sorted(range(len(batch)), key=lambda i: -batch[i].size)
    res = sched.run([Request(prompt=batch[i], max_new_tokens=max_new_tokens, seed=seed + i) for i in order])
    out = [None] * len(batch)
    for j, i in enumerate(order):
        g = finish(res.outputs[j], rule, max_new_tokens, prompt_tokens=int(batch[i].size),
                   stats=dict(res.stats, tokens_per_s=res.tokens_per_s))
        out[i] = (g.tokens, g.stats)
    return out


def reference_decode(model: Model, prompt_ids, max_new_tokens: int, **kw):
    """kvjax's full-cache reference decoder (the exactness contract's "full-cache decoding"); see
    `kvjax.decode.vericache.reference_decode` for the arguments. Runs `max_new_tokens` tokens, no stop rule."""
    kw["temperature"] = _sampling(kw.pop("temperature", 0.0), kw.pop("top_k", 0), kw.pop("top_p", 1.0),
                                  kw.pop("min_p", 0.0))
    return vc.reference_decode(model, check_token_ids(model, prompt_ids), _check_max_new(max_new_tokens), **kw)


# ------------------------------------------------------------------------------------------------ streaming
def stream(model: Model, prompt_ids, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *, mode: str = "full",
           **kw) -> Iterator[Delta]:
    """Iterate over a generation as it is produced: `Delta(token_ids, text, finish_reason)` pieces.

    Args:
        mode: "full" (`generate`'s arguments in `kw`) or "vericache" (`generate_vericache`'s): VeriCache yields each
            round's accepted tokens as soon as the round is verified.
    """
    if mode == "full":
        return generate(model, prompt_ids, max_new_tokens, stream=True, **kw)
    if mode != "vericache":
        raise InputError(f"mode must be 'full' or 'vericache', got {mode!r}")
    max_new_tokens = _check_max_new(max_new_tokens)
    ids = check_token_ids(model, prompt_ids)
    rule = StopRule(model.config.eos_token_ids, kw.pop("stop", None), ignore_eos=kw.pop("ignore_eos", False),
                    tokenizer=model.tokenizer)
    return _stream(_vericache_rounds(model, ids, max_new_tokens, rule, kw), rule, max_new_tokens)


def _vericache_rounds(model, ids, max_new_tokens, rule, kw) -> Iterator[tuple[list, list]]:
    """VeriCache in a worker thread; yields each round's tokens as the round lands (the first token first). The
    decode releases the GIL, so the consumer runs while the next round computes; closing the iterator stops the run
    after the round in flight."""
    q: queue.Queue = queue.Queue()
    closed = threading.Event()
    sampling = _sampling(kw.pop("temperature", 0.0), kw.pop("top_k", 0), kw.pop("top_p", 1.0), kw.pop("min_p", 0.0))

    def work():
        try:
            vc.generate_vericache(model, ids, max_new_tokens, temperature=sampling,
                                  progress=lambda done, new: q.put(("tokens", [int(t) for t in np.asarray(new)])),
                                  should_stop=lambda out: closed.is_set() or rule.end(out) is not None, **kw)
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
            yield val, []
    finally:
        closed.set()
        t.join()


def _stream(chunks: Iterator[tuple[list, list]], rule: StopRule, max_new_tokens: int) -> Iterator[Delta]:
    """The `Delta`s of a token stream (see `kvjax.generation.DeltaBuilder`); the last carries the finish reason."""
    deltas = DeltaBuilder(rule, max_new_tokens)
    for new, _ in chunks:
        d = deltas.add(new)
        if d is not None:
            yield d
        if deltas.ended:
            return


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "check_token_ids", "generate", "generate_vericache", "load", "logits",
           "reference_decode", "stream"]
