"""The jitted draft step of every family: `x` tokens from the draft cache in one call (a `lax.fori_loop`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.decode import sampling


@functools.partial(jax.jit, static_argnames=("x", "temperature", "rejection", "family", "impl"),
                   donate_argnames="dcache")
def draft_step(params, config, dcache, last: jax.Array, seed: jax.Array, *, x: int, temperature: float = 0.0,
               rejection: bool = False, family, impl: str):
    """Draft `x` tokens from the draft cache in one call (a `lax.fori_loop` of one-token draft forwards).

    Args:
        dcache: the family's draft cache with length L (= position of `last`); donated.
        last: i32[B] last emitted token (not yet in either cache).
        seed: i32[B] sampling seed (unused when greedy).

    Returns:
        (drafts i32[B, x], draft logits f32[B, x, V] (zeros unless rejection sampling), dcache with length L + x).
    """
    B = last.shape[0]
    V = config.vocab_size
    drafts = jnp.zeros((B, x), jnp.int32)
    qlog = jnp.zeros((B, x, V) if rejection else (B, 1, V), jnp.float32)
    ones = jnp.ones((B,), jnp.int32)

    # the compressed prompt parts never change while drafting: out of the loop carry, so XLA reads them in place
    # instead of copying them every iteration (it copies a carried buffer a dot reads; see kvjax.cache.chunked)
    split = family.draft_split is not None
    frozen, dcache = family.draft_split(dcache) if split else (None, dcache)
    if family.loop_params is not None:
        params = family.loop_params(params)

    def body(i, carry):
        tok, dc, drafts, qlog = carry
        logits, dc = family.draft_forward(params, config, family.draft_join(frozen, dc) if split else dc, tok[:, None],
                                          ones, implementation=impl)
        dc = family.draft_split(dc)[1] if split else dc
        pos = dc.length[:, None]  # position of the token being produced
        if rejection:
            nxt = sampling.sample_draft(logits, pos, seed, temperature)[:, 0]
            qlog = qlog.at[:, i].set(logits[:, 0])
        else:
            nxt = sampling.select_tokens(logits, pos, seed, temperature)[:, 0]
        return nxt, dc, drafts.at[:, i].set(nxt), qlog

    _, dcache, drafts, qlog = jax.lax.fori_loop(0, x, body, (last.astype(jnp.int32), dcache, drafts, qlog))
    return drafts, qlog, (family.draft_join(frozen, dcache) if split else dcache)


def decode_from_draft(model, dcache, first: jax.Array, num_tokens: int, *, temperature: float = 0.0,
                      seed: int = 0) -> jax.Array:
    """Decode from the draft cache alone, never consulting the full cache: what a lossy-cache method (StreamingLLM,
    SnapKV, KIVI, ...) emits by itself. The baseline VeriCache's exactness is measured against.

    Args:
        dcache: the family's draft cache of the prompt (consumed); its ring must hold `num_tokens` slots.
        first: i32[1] the token after the prompt (from the prefill, as a lossy-cache method computes it before it
            compresses).
        num_tokens: tokens to return, `first` included.

    Returns:
        i32[num_tokens]: `first`, then num_tokens - 1 tokens drafted in one `draft_step` call.
    """
    first = jnp.asarray(first, jnp.int32).reshape(1)
    if num_tokens < 2:
        return first[:num_tokens]
    rest, _, _ = draft_step(model.params, model.config, dcache, first, jnp.asarray([seed], jnp.int32),
                            x=num_tokens - 1, temperature=temperature, family=model.family, impl=model.attention)
    return jnp.concatenate([first, rest[0]])
