"""VeriCache (arXiv 2605.17613): lossy draft cache drafts, full cache verifies — exact decoding, one request.

Round: the drafter (same model, lossy `DraftCache`) decodes `x` tokens in one jit call; the full cache checks all of
them in one x+1-row forward; tokens are accepted up to the first mismatch, the mismatch is replaced by the full
cache's token (or, if all x matched, the bonus token is kept). The accepted tokens' exact KV (from the verify pass)
go into both caches; nothing drafted survives. Greedy output equals `reference_decode` token for token (the same
verify-shape forward, see `draft_steps`); position-keyed sampling makes sampled output exact in the same sense.

Offloaded mode keeps the prompt's full KV in pinned host memory and brings it back for each verify; tokens decoded
since stay on the device. Adaptive mode picks x per round from a small static set (each x compiles once): it grows
after a fully accepted round and shrinks after an early mismatch.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decode import offload as offl
from kvjax.cache.capacity import CAPACITY_BUCKETS, pick_capacity
from kvjax.cache.dense import DenseKV, WindowKV
from kvjax.models.llama.cache import init_cache
from kvjax.compress import Compressor, make_compressor
from kvjax.decode import rounds as draft_steps, sampling, steps
from kvjax.decode.metrics import RunMetrics


def capacity_for(prompt_len: int, max_new_tokens: int, max_draft: int) -> int:
    """Full-cache capacity bucket: prompt + new tokens + one verify block of slack.

    The reference decoder must use the same capacity (the cache length is part of the computation's shape).
    """
    return pick_capacity(prompt_len + max_new_tokens + max_draft + 2)


def _dtype(model):
    return jnp.bfloat16 if getattr(model, "dtype", "f32") in ("bf16", "bfloat16") else jnp.float32


def _first_token(logits, prompt_len: int, seed, temperature: float):
    return sampling.select_tokens(logits[None, None, :], jnp.asarray([[prompt_len]], jnp.int32), seed, temperature)[0]


def _next_x(xs: tuple, x: int, n: int) -> int:
    """Adaptive draft length: grow after a fully accepted round, shrink when under half was accepted."""
    i = xs.index(x)
    if n == x and i + 1 < len(xs):
        return xs[i + 1]
    if n < x // 2 and i > 0:
        return xs[i - 1]
    return x


def generate_vericache(model, prompt_ids, max_new_tokens: int, *, compressor: str | Compressor = "streaming",
                       draft_len: int = 8, offload: bool = False, temperature: float = 0.0, seed: int = 0,
                       rejection: bool = False, adaptive: tuple | None = None, recent_slots: int = 256,
                       compressor_kw: dict | None = None, progress=None):
    """Exact decoding of one prompt with a lossy draft cache and full-cache verification.

    Args:
        model: a `kvjax.Model` (Llama family).
        prompt_ids: i32[P] prompt token ids.
        max_new_tokens: tokens to emit (no EOS stop: the benchmark compares fixed lengths).
        compressor: a `Compressor` or a name for `make_compressor` ("streaming", "snapkv", "kvzip", "kivi2",
            "kivi4", "dropquant"); `compressor_kw` are its fields.
        draft_len: x, tokens drafted per round (static).
        offload: keep the prompt's full KV in pinned host memory between verifications.
        temperature: 0 = greedy; > 0 = position-keyed exact sampling (or rejection sampling when `rejection`).
        adaptive: static ascending set of x values to adapt over (starting at draft_len, which must be in it).
        recent_slots: draft ring slots for decoded tokens.
        progress: optional callback(tokens_emitted).

    Returns:
        (tokens i32[max_new_tokens], stats dict — see `kvjax.decode.metrics.RunMetrics.summary`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if rejection and temperature <= 0:
        raise ValueError("rejection sampling needs temperature > 0")
    config = model.config
    comp = make_compressor(compressor, **(compressor_kw or {})) if isinstance(compressor, str) else compressor
    xs = tuple(sorted(adaptive)) if adaptive else (draft_len,)
    if draft_len not in xs:
        raise ValueError(f"draft_len {draft_len} is not in the adaptive set {xs}")
    for x in xs:
        draft_steps.check_draft_len(config, x)
    full, first = prefill_for(model, prompt_ids, max_new_tokens, max_draft=xs[-1], temperature=temperature,
                              seed=seed)
    return run_vericache(model, full, first, prompt_ids, max_new_tokens, compressor=comp, draft_len=draft_len,
                         offload=offload, temperature=temperature, seed=seed, rejection=rejection, adaptive=adaptive,
                         recent_slots=recent_slots, progress=progress)


def prefill_for(model, prompt_ids, max_new_tokens: int, *, max_draft: int, temperature: float = 0.0, seed: int = 0):
    """Prefilled full cache (capacity as `generate_vericache` uses) and the first token: (cache, first i32[1])."""
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    full = init_cache(model.config, 1, capacity_for(prompt.size, max_new_tokens, max_draft), _dtype(model))
    logits, full = steps.prefill(model.params, model.config, full, prompt)
    return full, _first_token(logits, prompt.size, jnp.asarray([seed], jnp.int32), temperature)


def run_vericache(model, full, first, prompt_ids, max_new_tokens: int, *, compressor, draft_len: int = 8,
                  offload: bool = False, temperature: float = 0.0, seed: int = 0, rejection: bool = False,
                  adaptive: tuple | None = None, recent_slots: int = 256, progress=None, draft_cache=None):
    """VeriCache rounds from an already prefilled full cache (`prefill_for`); `full` is consumed (donated).

    Same arguments and result as `generate_vericache`; the prefill is not part of the timed decode.
    `draft_cache`: an already compressed DraftCache of this prompt (consumed; its ring must hold x + 1 rows) —
    benchmarks compress once and reuse it; `compressor` then only names the run.
    """
    params, config = model.params, model.config
    comp = make_compressor(compressor) if isinstance(compressor, str) else compressor
    xs = tuple(sorted(adaptive)) if adaptive else (draft_len,)
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    P = prompt.size
    xmax = xs[-1]
    seed_a = jnp.asarray([seed], jnp.int32)
    met = RunMetrics(name=f"vericache[{comp.name}]", params=params)
    t0 = time.perf_counter()
    if draft_cache is None:
        dcache = comp(params, config, full, prompt, recent_slots=max(recent_slots, xmax + 1))
    else:
        dcache = draft_cache
    jax.block_until_ready(dcache)
    met.compress_s = time.perf_counter() - t0
    met.full_prompt_bytes = offl.nbytes([(l.k, l.v) for l in full.layers])
    met.draft_prompt_bytes = dcache.prompt_nbytes()
    met.draft_bytes = dcache.nbytes()
    full_row_bytes = sum(2 * l.k.shape[1] * l.k.shape[3] * l.k.dtype.itemsize for l in full.layers)

    if offload:
        host_kv = tuple(None if isinstance(l, WindowKV) else (l.k, l.v) for l in full.layers)
        host_kv = offl.to_host(host_kv)
        tail_cap = pick_capacity(max_new_tokens + xmax + 2, CAPACITY_BUCKETS)
        tail = tuple(l if isinstance(l, WindowKV) else
                     DenseKV(k=jnp.zeros(l.k.shape[:2] + (tail_cap,) + l.k.shape[3:], l.k.dtype),
                             v=jnp.zeros(l.v.shape[:2] + (tail_cap,) + l.v.shape[3:], l.v.dtype),
                             length=jnp.zeros((1,), jnp.int32)) for l in full.layers)
        length = full.length
        prompt_len = jnp.asarray([P], jnp.int32)
        jax.block_until_ready((host_kv, tail))
        met.h2d_bytes_per_verify = offl.nbytes(host_kv)
        del full
        met.device_resident_bytes = offl.nbytes(tail) + met.draft_bytes
        met.device_peak_bytes = met.device_resident_bytes + met.h2d_bytes_per_verify
    else:
        met.device_resident_bytes = offl.nbytes(full) + met.draft_bytes
        met.device_peak_bytes = met.device_resident_bytes

    out = [int(first[0])]
    last = first
    x = draft_len
    t_start = time.perf_counter()
    while len(out) < max_new_tokens:
        ta = time.perf_counter()
        drafts, qlog, dcache = draft_steps.draft_step(params, config, dcache, last, seed_a, x=x,
                                                      temperature=temperature, rejection=rejection)
        drafts.block_until_ready()
        tb = time.perf_counter()
        if offload:
            fetched = offl.fetch(host_kv)
            jax.block_until_ready(fetched)
            tc = time.perf_counter()
            emitted, n, tail, dcache, _ = draft_steps.verify_offloaded(
                params, config, fetched, tail, length, prompt_len, dcache, last, drafts, qlog, seed_a,
                temperature=temperature, rejection=rejection)
            length = length + n + 1
        else:
            tc = tb
            emitted, n, full, dcache = draft_steps.verify_step(params, config, full, dcache, last, drafts, qlog,
                                                               seed_a, temperature=temperature, rejection=rejection)
        n_host = int(n[0])
        new = np.asarray(emitted[0, :n_host + 1])
        td = time.perf_counter()
        ctx = P + len(out) - 1  # tokens in the full cache before this round
        met.add_round(x=x, accepted=n_host, draft_s=tb - ta, transfer_s=tc - tb, verify_s=td - tc,
                      draft_read_bytes=x * (met.param_bytes + met.draft_bytes),
                      verify_read_bytes=met.param_bytes + ctx * full_row_bytes,
                      h2d_bytes=met.h2d_bytes_per_verify if offload else 0)
        out.extend(int(t) for t in new)
        last = emitted[:, n_host]
        if progress is not None:
            progress(min(len(out), max_new_tokens))
        if len(xs) > 1:
            x = _next_x(xs, x, n_host)
    met.decode_s = time.perf_counter() - t_start
    toks = np.asarray(out[:max_new_tokens], np.int32)
    met.emitted = int(toks.size)
    return toks, met.summary()


def reference_decode(model, prompt_ids, max_new_tokens: int, *, draft_len: int = 8, temperature: float = 0.0,
                     seed: int = 0, max_draft: int | None = None, return_margins: bool = False):
    """kvjax's full-cache reference decoder: one token per step through the verify shape (T = x + 1, row 0).

    Args:
        draft_len: x of the VeriCache run to compare with (the verify block shape).
        max_draft: largest x of an adaptive run (sets the cache capacity like `generate_vericache`).
        return_margins: also return f32[max_new_tokens] top-1 minus top-2 logit at each step.

    Returns:
        tokens i32[max_new_tokens] (and margins).
    """
    params, config = model.params, model.config
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    P = prompt.size
    seed_a = jnp.asarray([seed], jnp.int32)
    full = init_cache(config, 1, capacity_for(P, max_new_tokens, max_draft or draft_len), _dtype(model))
    logits, full = steps.prefill(params, config, full, prompt)
    tok = _first_token(logits, P, seed_a, temperature)
    out = [int(tok[0])]
    margins = [_margin(logits)]
    for _ in range(max_new_tokens - 1):
        tok, m, full = draft_steps.reference_step(params, config, full, tok, seed_a, x=draft_len,
                                                  temperature=temperature)
        out.append(int(tok[0]))
        margins.append(float(m[0]))
    toks = np.asarray(out, np.int32)
    return (toks, np.asarray(margins, np.float32)) if return_margins else toks


def _margin(logits) -> float:
    top = jax.lax.top_k(logits.reshape(-1), 2)[0]
    return float(top[0] - top[1])


def plain_decode(model, prompt_ids, max_new_tokens: int, *, capacity: int | None = None):
    """Plain one-token greedy decoding (`steps.greedy_decode`, a lax loop): the fastest full-cache decoder.

    Returns tokens i32[max_new_tokens].
    """
    params, config = model.params, model.config
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    full = init_cache(config, 1, capacity or pick_capacity(prompt.size + max_new_tokens + 2), _dtype(model))
    logits, full = steps.prefill(params, config, full, prompt)
    first = jnp.argmax(logits).astype(jnp.int32)[None]
    toks = [int(first[0])]
    if max_new_tokens > 1:
        rest, _ = steps.greedy_decode(params, config, full, first, num_steps=max_new_tokens - 1)
        toks += [int(t) for t in np.asarray(rest[0])]
    return np.asarray(toks, np.int32)
