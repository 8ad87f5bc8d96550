"""Jit-compiled prefill and decode steps (static shapes, donated caches).

Each step is jitted once per (config, batch, chunk/draft length, capacity bucket); lengths and positions are arrays,
so a decode run of any length and prompts of any length compile nothing after warm-up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.dense import ModelCache
from kvjax.models.llama.config import ModelConfig
from kvjax.models import llama

DEFAULT_CHUNK = 256


@functools.partial(jax.jit, donate_argnames="cache")
def prefill_chunk(params, config: ModelConfig, cache: ModelCache, tokens: jax.Array, n_valid: jax.Array):
    """One prefill chunk. tokens: i32[B, C]; n_valid: i32[B]. Returns (logits of each row's last real token f32[B, V], cache)."""
    logits, cache = llama.forward(params, config, cache, tokens, n_valid)
    last = jnp.clip(n_valid - 1, 0, tokens.shape[1] - 1)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0], cache


@functools.partial(jax.jit, donate_argnames="cache")
def forward_step(params, config: ModelConfig, cache: ModelCache, tokens: jax.Array, n_valid: jax.Array):
    """All-row logits for `T` new tokens (the multi-token verify shape). Returns (logits f32[B, T, V], cache)."""
    return llama.forward(params, config, cache, tokens, n_valid)


def prefill(params, config: ModelConfig, cache: ModelCache, prompt: np.ndarray, *, chunk: int = DEFAULT_CHUNK,
            on_chunk=None):
    """Prefill one prompt (batch 1) in fixed-size chunks so no `T x T` score matrix is ever built.

    Args:
        prompt: i32[T] token ids.
        chunk: static chunk length (the last chunk is padded).
        on_chunk: optional callback(tokens_done) for progress bars.

    Returns:
        (logits f32[V] at the last prompt token, cache).
    """
    prompt = np.asarray(prompt, np.int32)
    if prompt.ndim != 1 or prompt.size == 0:
        raise ValueError(f"prompt must be a non-empty 1-D array of token ids, got shape {prompt.shape}")
    T = prompt.size
    if T > cache.capacity - int(cache.length[0]):
        raise ValueError(f"prompt of {T} tokens does not fit the cache ({cache.capacity} slots, "
                         f"{int(cache.length[0])} used)")
    logits = None
    for start in range(0, T, chunk):
        part = prompt[start:start + chunk]
        buf = np.zeros((1, chunk), np.int32)
        buf[0, :part.size] = part
        logits, cache = prefill_chunk(params, config, cache, jnp.asarray(buf), jnp.asarray([part.size], jnp.int32))
        if on_chunk is not None:
            on_chunk(start + part.size)
    return logits[0], cache


def greedy_loop(forward, cache, first: jax.Array, num_steps: int):
    """`num_steps` one-token greedy steps in one `lax.fori_loop` (call inside a jitted function).

    Args:
        forward: `(cache, tokens i32[B, 1], n_valid i32[B]) -> (logits f32[B, 1, V], cache)` for any model family.
        first: i32[B] the token to feed first (already emitted, not yet in the cache).

    Returns:
        (i32[B, num_steps] the tokens produced after `first`, cache).
    """
    B = first.shape[0]
    ones = jnp.ones((B,), jnp.int32)

    def body(i, carry):
        tok, cache, out = carry
        logits, cache = forward(cache, tok[:, None], ones)
        nxt = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
        return nxt, cache, out.at[:, i].set(nxt)

    out = jnp.zeros((B, num_steps), jnp.int32)
    _, cache, out = jax.lax.fori_loop(0, num_steps, body, (first.astype(jnp.int32), cache, out))
    return out, cache


@functools.partial(jax.jit, static_argnames="num_steps", donate_argnames="cache")
def greedy_decode(params, config: ModelConfig, cache: ModelCache, first: jax.Array, *, num_steps: int):
    """Plain full-cache greedy decoding: `num_steps` one-token steps inside one `lax.fori_loop`.

    Args:
        first: i32[B] the token to feed first (already emitted, not yet in the cache).

    Returns:
        (i32[B, num_steps] the tokens produced after `first`, cache).
    """
    return greedy_loop(lambda c, t, n: llama.forward(params, config, c, t, n), cache, first, num_steps)


def truncate_at_eos(tokens: np.ndarray, eos_token_ids) -> np.ndarray:
    """Generated tokens up to and including the first end-of-sequence token (all of them when there is none)."""
    if eos_token_ids:
        hit = np.nonzero(np.isin(tokens, eos_token_ids))[0]
        if hit.size:
            return tokens[: hit[0] + 1]
    return tokens
