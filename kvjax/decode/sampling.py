"""Token selection: greedy, position-keyed exact sampling, and speculative rejection sampling.

Exact sampling (Gumbel-max): the token at absolute position p is argmax(logits / temperature + g_p) with
g_p = Gumbel noise from `fold_in(key(seed), p)`. The noise depends only on (seed, position), never on how many
tokens a step produced, so the draft and the full cache see the SAME noise at each position and VeriCache's
accept-if-equal rule emits exactly the tokens full-cache sampled decoding emits (the greedy contract, lifted).

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023) is the distribution-preserving alternative: draft
token d ~ q is accepted with probability min(1, p(d) / q(d)); at the first rejection the token is drawn from
norm(max(p - q, 0)); when all x are accepted a bonus token is drawn from p. Its randomness is keyed by (seed,
position, stream) too, so runs are reproducible.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# independent noise streams per position
STREAM_TOKEN, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3


def position_keys(seed: jax.Array, positions: jax.Array, stream: int = STREAM_TOKEN) -> jax.Array:
    """Typed PRNG keys [B, T] from seed i32[B] and absolute positions i32[B, T]."""
    base = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), stream))(seed)  # [B]
    return jax.vmap(lambda k, ps: jax.vmap(lambda p: jax.random.fold_in(k, p))(ps))(base, positions)


def gumbel(seed, positions, vocab: int, stream: int = STREAM_TOKEN) -> jax.Array:
    """f32[B, T, V] Gumbel noise keyed by (seed, position, stream)."""
    keys = position_keys(seed, positions, stream)
    return jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32)))(keys)


def select_tokens(logits: jax.Array, positions: jax.Array, seed: jax.Array, temperature: float) -> jax.Array:
    """Tokens i32[B, T] for logits f32[B, T, V] producing the tokens at absolute `positions` i32[B, T].

    temperature 0 (static) is greedy argmax; otherwise position-keyed Gumbel-max sampling.
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    g = gumbel(seed, positions, logits.shape[-1])
    return jnp.argmax(logits / temperature + g, axis=-1).astype(jnp.int32)


def sample_draft(logits: jax.Array, positions: jax.Array, seed: jax.Array, temperature: float) -> jax.Array:
    """Draft tokens i32[B, T] ~ softmax(logits / temperature) for rejection sampling (draft noise stream)."""
    g = gumbel(seed, positions, logits.shape[-1], STREAM_DRAFT)
    return jnp.argmax(logits / temperature + g, axis=-1).astype(jnp.int32)


def rejection_accept(p_logits: jax.Array, q_logits: jax.Array, drafts: jax.Array, positions: jax.Array,
                     seed: jax.Array, temperature: float):
    """Speculative rejection sampling over one verified block.

    Args:
        p_logits: f32[B, x+1, V] full-cache logits (row j predicts the token at positions[:, j]).
        q_logits: f32[B, x, V] draft logits the drafts were sampled from.
        drafts: i32[B, x] drafted tokens.
        positions: i32[B, x+1] absolute positions of the predicted tokens.

    Returns:
        (n i32[B] drafts accepted, next i32[B] the token after them: residual sample or bonus).
    """
    B, X1, V = p_logits.shape
    x = X1 - 1
    p = jax.nn.softmax(p_logits / temperature, axis=-1)
    q = jax.nn.softmax(q_logits / temperature, axis=-1)
    pd = jnp.take_along_axis(p[:, :x], drafts[..., None], axis=-1)[..., 0]
    qd = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    keys = position_keys(seed, positions[:, :x], STREAM_ACCEPT)
    u = jax.vmap(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32)))(keys)
    ok = u * qd < pd  # u < p/q without dividing by a tiny q
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
    # residual distribution at the first rejection; the bonus row x uses p itself (q := 0 there)
    q_pad = jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], axis=1)
    resid = jnp.maximum(p - q_pad, 0.0)
    resid = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, resid, p)  # p == q exactly: any sample of p
    r = jnp.take_along_axis(resid, n[:, None, None], axis=1)[:, 0]  # [B, V]
    rpos = jnp.take_along_axis(positions, n[:, None], axis=1)
    g = gumbel(seed, rpos, V, STREAM_RESIDUAL)[:, 0]
    nxt = jnp.argmax(jnp.log(jnp.maximum(r, 1e-38)) + jnp.where(r > 0, g, -jnp.inf), axis=-1).astype(jnp.int32)
    return n, nxt
