"""Token selection: greedy, position-keyed exact sampling with the usual filters, and speculative rejection sampling.

`Sampling` is the one definition of a sampling configuration (temperature, top-k, top-p, min-p) for every mode:
full-cache decoding, VeriCache's drafting and verification, its reference decoder and the schedulers all select
tokens through `select_tokens`, which applies the same filters to the same logits, then the same noise.

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

import dataclasses
import math

import jax
import jax.numpy as jnp

from kvjax.errors import InputError
from pallas_kernels.argmax import argmax  # jnp.argmax's indices; natively on the CPU (XLA's ran ~3 ns/element)

# independent noise streams per position
STREAM_TOKEN, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RESIDUAL = 0, 1, 2, 3


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Sampling:
    """A sampling configuration (static: hashable, passed to jitted steps as is).

    Attributes:
        temperature: 0 = greedy (argmax; the filters then change nothing); > 0 scales the logits.
        top_k: keep the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1 = all).
        min_p: keep tokens whose probability is at least min_p times the most likely one's (0 = all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        t, k, p, m = self.temperature, self.top_k, self.top_p, self.min_p
        if not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise InputError(f"temperature must be a finite number >= 0, got {t!r}")
        if not (isinstance(k, int) and not isinstance(k, bool) and k >= 0):
            raise InputError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        if not (isinstance(p, (int, float)) and 0 < p <= 1):
            raise InputError(f"top_p must be in (0, 1], got {p!r}")
        if not (isinstance(m, (int, float)) and 0 <= m < 1):
            raise InputError(f"min_p must be in [0, 1), got {m!r}")
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))
        object.__setattr__(self, "min_p", float(m))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filtered(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


def as_sampling(temperature) -> Sampling:
    """A `Sampling` from a temperature (float) or a `Sampling`."""
    return temperature if isinstance(temperature, Sampling) else Sampling(temperature=temperature)


def filtered_logits(logits: jax.Array, sampling) -> jax.Array:
    """Logits f32[..., V] divided by the temperature, with the tokens the filters drop set to -inf.

    The kept set is computed from the temperature-scaled distribution (as vLLM and transformers do); the most likely
    token is always kept, so a row is never empty.
    """
    s = as_sampling(sampling)
    x = logits.astype(jnp.float32) / (s.temperature if s.temperature > 0 else 1.0)
    if not s.filtered:
        return x
    V = x.shape[-1]
    order = jnp.argsort(-x, axis=-1)  # descending; ties by index, the same in every caller
    sx = jnp.take_along_axis(x, order, axis=-1)
    keep = jnp.ones(sx.shape, bool)
    if s.top_k > 0:
        keep &= jnp.arange(V) < s.top_k
    if s.top_p < 1.0 or s.min_p > 0.0:
        probs = jax.nn.softmax(sx, axis=-1)
        if s.top_p < 1.0:
            before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
            keep &= before < s.top_p
        if s.min_p > 0.0:
            keep &= probs >= s.min_p * probs[..., :1]
    keep = keep.at[..., 0].set(True)
    mask = jnp.put_along_axis(jnp.zeros(x.shape, bool), order, keep, axis=-1, inplace=False)
    return jnp.where(mask, x, -jnp.inf)


def position_keys(seed: jax.Array, positions: jax.Array, stream: int = STREAM_TOKEN) -> jax.Array:
    """Typed PRNG keys [B, T] from seed i32[B] and absolute positions i32[B, T]."""
    base = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), stream))(seed)  # [B]
    return jax.vmap(lambda k, ps: jax.vmap(lambda p: jax.random.fold_in(k, p))(ps))(base, positions)


def gumbel(seed, positions, vocab: int, stream: int = STREAM_TOKEN) -> jax.Array:
    """f32[B, T, V] Gumbel noise keyed by (seed, position, stream)."""
    keys = position_keys(seed, positions, stream)
    return jax.vmap(jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32)))(keys)


def select_tokens(logits: jax.Array, positions: jax.Array, seed: jax.Array, temperature) -> jax.Array:
    """Tokens i32[B, T] for logits f32[B, T, V] producing the tokens at absolute `positions` i32[B, T].

    `temperature` (static): a float or a `Sampling`. Greedy is argmax; otherwise position-keyed Gumbel-max sampling
    over the filtered distribution.
    """
    s = as_sampling(temperature)
    if s.greedy:
        return argmax(logits)
    g = gumbel(seed, positions, logits.shape[-1])
    return argmax(filtered_logits(logits, s) + g)


def sample_draft(logits: jax.Array, positions: jax.Array, seed: jax.Array, temperature) -> jax.Array:
    """Draft tokens i32[B, T] ~ the filtered softmax for rejection sampling (draft noise stream)."""
    g = gumbel(seed, positions, logits.shape[-1], STREAM_DRAFT)
    return argmax(filtered_logits(logits, temperature) + g)


def rejection_accept(p_logits: jax.Array, q_logits: jax.Array, drafts: jax.Array, positions: jax.Array,
                     seed: jax.Array, temperature):
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
    p = jax.nn.softmax(filtered_logits(p_logits, temperature), axis=-1)
    q = jax.nn.softmax(filtered_logits(q_logits, temperature), axis=-1)
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
    nxt = argmax(jnp.log(jnp.maximum(r, 1e-38)) + jnp.where(r > 0, g, -jnp.inf))
    return n, nxt
