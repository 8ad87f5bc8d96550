"""Jit-compiled prefill and decode steps for every model family (static shapes, donated caches).

Each step takes the family (`kvjax.families.Family`) and the attention implementation as static keyword arguments
and is jitted once per (family, config, batch, chunk/draft length, capacity bucket); lengths and positions are
arrays, so a decode run of any length and prompts of any length compile nothing after warm-up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.decode import sampling
from kvjax.errors import CapacityError, InputError

DEFAULT_CHUNK = 256
SHORT_CHUNK = 64  # prompts up to this long run as one chunk of this width (one compiled shape for all of them)
# A long prompt runs in chunks of BULK_CHUNK tokens while that many remain, then in DEFAULT_CHUNK pieces (two compiled
# shapes). Why: XLA:CPU's products pack their weights once per call, so 4x longer chunks pack a quarter as often --
# measured interleaved in one process (Xeon, 8,000-token prompt, all-1024 against all-256 chunks): SmolLM2 406 -> 429
# tokens/s, the bundled model 7,686 -> 7,889 -- while the 256-token tail keeps a medium prompt's padding short. The
# cache is the all-DEFAULT_CHUNK one up to f32 rounding: bit for bit for both bundled models (their caches compared
# after 2,600 tokens), ~1e-6 apart for the tests' 64-wide models, whose products XLA groups differently by chunk width;
# VeriCache and its reference decoder prefill the same way, so their bit-identity does not depend on it.
BULK_CHUNK = 1024


def chunk_plan(T: int, chunk: int = DEFAULT_CHUNK, bulk: int | None = BULK_CHUNK) -> list[tuple[int, int]]:
    """(start, width) of each prefill chunk of a T-token prompt: `bulk`-token chunks while that many tokens remain
    (when `bulk` is longer than `chunk`), then `chunk`-token chunks, the last one padded."""
    plan, start = [], 0
    while start < T:
        width = bulk if bulk is not None and bulk > chunk and T - start >= bulk else chunk
        plan.append((start, width))
        start += width
    return plan


def _forward(family, impl, params, config, cache, tokens, n_valid):
    return family.forward(params, config, cache, tokens, n_valid, implementation=impl)


@functools.partial(jax.jit, static_argnames=("family", "impl", "all_logits"), donate_argnames="cache")
def prefill_chunk(params, config, cache, tokens: jax.Array, n_valid: jax.Array, *, family, impl: str,
                  all_logits: bool = False):
    """One prefill chunk. tokens: i32[B, C]; n_valid: i32[B]. Returns (logits of each row's last real token f32[B, V],
    all-row logits f32[B, C, V] when `all_logits` else None, cache).

    Without `all_logits` only the last real row goes through the vocabulary projection (measured at 8K on the
    bundled model: `scripts/bench_prefill.py`)."""
    last = jnp.clip(n_valid - 1, 0, tokens.shape[1] - 1)
    logits, cache = family.forward(params, config, cache, tokens, n_valid, implementation=impl,
                                   logit_rows=None if all_logits else last[:, None])
    if not all_logits:
        return logits[:, 0], None, cache
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], logits, cache


@functools.partial(jax.jit, static_argnames=("family", "impl"), donate_argnames="cache")
def forward_step(params, config, cache, tokens: jax.Array, n_valid: jax.Array, *, family, impl: str):
    """All-row logits for `T` new tokens through the family's plain forward. Returns (logits f32[B, T, V], cache)."""
    return _forward(family, impl, params, config, cache, tokens, n_valid)


@functools.partial(jax.jit, static_argnames=("family", "impl", "rows", "block"), donate_argnames="cache")
def prefill_chunk_masses(params, config, cache, tokens: jax.Array, n_valid: jax.Array, first: jax.Array, *, family,
                         impl: str, rows: int, block: int):
    """`prefill_chunk` (its last-row logits and cache, bit for bit) plus the family's `forward_with_masses` masses of
    the scoring rows at positions first[b] .. first[b] + rows - 1 that lie in this chunk."""
    last = jnp.clip(n_valid - 1, 0, tokens.shape[1] - 1)
    logits, cache, masses = family.forward_with_masses(params, config, cache, tokens, n_valid, first, rows=rows,
                                                       block=block, implementation=impl, logit_rows=last[:, None])
    return logits[:, 0], cache, masses


def _sum_masses(chunks: list):
    """Per-layer sums of the masses of the chunks that hold scoring rows (None if any chunk has none)."""
    if any(m is None for m in chunks):
        return None
    return tuple(None if parts[0] is None else sum(parts[1:], parts[0]) for parts in zip(*chunks))


def prefill(model, cache, prompt: np.ndarray, *, chunk: int = DEFAULT_CHUNK, on_chunk=None, all_logits: bool = False,
            bulk_chunk: int | None = BULK_CHUNK, scoring: tuple[int, int] | None = None):
    """Prefill one prompt (batch 1) in fixed-size chunks so no `T x T` score matrix is ever built.

    Args:
        model: a `kvjax.Model`.
        prompt: i32[T] token ids.
        chunk: static chunk length (the last chunk is padded); prompts of at most SHORT_CHUNK tokens use one chunk of
            SHORT_CHUNK.
        bulk_chunk: a longer static chunk taken first while that many tokens remain (`chunk_plan`); None: `chunk`
            only. The cache and logits are the same either way.
        on_chunk: optional callback(tokens_done) for progress bars.
        all_logits: also return every prompt row's logits f32[T, V].
        scoring: (rows, block) or None — also return the block masses the prompt's last `rows` tokens put on the
            cache, per layer f32[1, K, ceil(S / block)] (None for sliding layers), from the chunks' own attention
            (the refreshing drafter's first selection: `Compressor.prompt_scoring`, `Refresh.prepare`); the masses
            are None where the family or the attention implementation cannot hand them out. The cache and logits
            are the same either way.

    Returns:
        (logits f32[V] at the last prompt token, cache) — or (logits f32[T, V], cache) with `all_logits` — then the
        masses with `scoring`.
    """
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim != 1 or prompt.size == 0:
        raise InputError(f"prompt must be a non-empty 1-D array of token ids, got shape {prompt.shape}")
    T = prompt.size
    used = int(cache.length[0])
    if T > cache.capacity - used:
        raise CapacityError(f"prompt of {T} tokens does not fit the cache ({cache.capacity} slots, {used} used)")
    if T <= SHORT_CHUNK and used == 0:
        chunk = min(chunk, SHORT_CHUNK)
    scored = scoring is not None and model.family.forward_with_masses is not None and not all_logits
    w = min(scoring[0], T) if scoring is not None else 0
    last, rows, held = None, [], []  # held: the masses of the chunks that hold scoring rows
    for start, width in chunk_plan(T, chunk, bulk_chunk):
        part = prompt[start:start + width]
        buf = np.zeros((1, width), np.int32)
        buf[0, :part.size] = part
        if scored:  # every chunk runs this one program (no second compile per width); rows outside add nothing
            last, cache, m = prefill_chunk_masses(model.params, model.config, cache, jnp.asarray(buf),
                                                  jnp.asarray([part.size], jnp.int32),
                                                  jnp.asarray([used + T - w], jnp.int32), family=model.family,
                                                  impl=model.attention, rows=w, block=scoring[1])
            if start + part.size > T - w:  # this chunk holds some of the scoring rows (the last one always does)
                held.append(m)
            lg = None
        else:
            last, lg, cache = prefill_chunk(model.params, model.config, cache, jnp.asarray(buf),
                                            jnp.asarray([part.size], jnp.int32), family=model.family,
                                            impl=model.attention, all_logits=all_logits)
        if all_logits:
            rows.append(np.asarray(lg[0, :part.size]))
        if on_chunk is not None:
            jax.block_until_ready(last)  # a progress bar counts the chunk once it ran, not once it was dispatched
            on_chunk(start + part.size)
    if all_logits:
        return (np.concatenate(rows, axis=0), cache) + ((None,) if scoring is not None else ())
    if scoring is not None:
        return last[0], cache, _sum_masses(held) if scored else None
    return last[0], cache


def decode_loop(forward, cache, first: jax.Array, start: jax.Array, num_steps: int, seed: jax.Array,
                temperature, return_logprobs: bool = False):
    """`num_steps` one-token steps in one `lax.fori_loop` (call inside a jitted function).

    Args:
        forward: `(cache, tokens i32[B, 1], n_valid i32[B]) -> (logits f32[B, 1, V], cache)` for any family.
        first: i32[B] the token to feed first (already emitted, not yet in the cache).
        start: i32[B] absolute position of `first` (the produced tokens take start + 1, start + 2, ...).
        seed: i32[B] sampling seeds; temperature: static float or `sampling.Sampling` (see `select_tokens`).
        return_logprobs: also return each produced token's log-probability under the raw logits.

    Returns:
        (i32[B, num_steps] the tokens produced after `first`, cache) — plus f32[B, num_steps] logprobs when asked.
    """
    B = first.shape[0]
    ones = jnp.ones((B,), jnp.int32)

    def body(i, carry):
        tok, cache, out, lps = carry
        logits, cache = forward(cache, tok[:, None], ones)
        nxt = sampling.select_tokens(logits, (start + 1 + i)[:, None], seed, temperature)[:, 0]
        if return_logprobs:
            lp = jax.nn.log_softmax(logits[:, 0].astype(jnp.float32), axis=-1)
            lps = lps.at[:, i].set(jnp.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0])
        return nxt, cache, out.at[:, i].set(nxt), lps

    out = jnp.zeros((B, num_steps), jnp.int32)
    lps = jnp.zeros((B, num_steps if return_logprobs else 0), jnp.float32)
    _, cache, out, lps = jax.lax.fori_loop(0, num_steps, body, (first.astype(jnp.int32), cache, out, lps))
    return (out, cache, lps) if return_logprobs else (out, cache)


@functools.partial(jax.jit, static_argnames=("num_steps", "temperature", "return_logprobs", "family", "impl"),
                   donate_argnames="cache")
def decode(params, config, cache, first: jax.Array, seed: jax.Array, *, num_steps: int, temperature=0.0,
           return_logprobs: bool = False, family, impl: str):
    """Plain full-cache decoding: `num_steps` one-token steps inside one `lax.fori_loop`.

    Args:
        first: i32[B] the token to feed first (already emitted, not yet in the cache; its position is cache.length).
        seed: i32[B] sampling seeds (unused when greedy).
        temperature: a float or a `sampling.Sampling` (static).
        return_logprobs: also return the produced tokens' log-probabilities f32[B, num_steps].

    Returns:
        (i32[B, num_steps] the tokens produced after `first`, cache) — plus the logprobs when asked.
    """
    if family.loop_params is not None:
        params = family.loop_params(params)
    if family.decode_split is None:
        fwd = functools.partial(_forward, family, impl, params, config)
        return decode_loop(fwd, cache, first, cache.length, num_steps, seed, temperature, return_logprobs)
    # the cache before the loop is only read inside it: keep it out of the carry (see kvjax.cache.chunked)
    invariant, carry = family.decode_split(cache, num_steps)

    def fwd(carry, tokens, n_valid):
        logits, after = _forward(family, impl, params, config, family.decode_join(invariant, carry), tokens, n_valid)
        return logits, family.decode_carry(after)

    out = decode_loop(fwd, carry, first, cache.length, num_steps, seed, temperature, return_logprobs)
    return (out[0], family.decode_merge(invariant, out[1])) + tuple(out[2:])


@jax.jit
def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Log-probability f32[T] of `tokens` i32[T] under the raw logits rows f32[T, V] (f32 log-softmax).

    Row by row (`lax.map`): XLA tiles a [T, V] reduction differently for different T, which moves the last bit, and
    the same row must give the same number whether it came from a verify of x + 1 rows or the reference decoder."""

    def one(row_tok):
        row, tok = row_tok
        return jax.nn.log_softmax(row.astype(jnp.float32))[tok]

    return jax.lax.map(one, (logits, tokens.astype(jnp.int32)))


def truncate_at_eos(tokens: np.ndarray, eos_token_ids) -> np.ndarray:
    """Generated tokens up to and including the first end-of-sequence token (all of them when there is none)."""
    if eos_token_ids:
        hit = np.nonzero(np.isin(tokens, eos_token_ids))[0]
        if hit.size:
            return tokens[: hit[0] + 1]
    return tokens
