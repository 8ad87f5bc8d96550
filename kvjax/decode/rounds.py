"""Jit-compiled VeriCache steps: draft x tokens, verify x+1 positions, accept; and the bit-identical reference step.

Bit-identity (DESIGN.md exactness contract). The verify pass runs `llama.forward` with T = x+1 rows over the full
cache; the reference decoder runs the SAME jitted forward with T = x+1 rows, feeding [token, pad...] and reading row
0. Row j of the verify block then equals the reference's row 0 at position L+j bit for bit because (a) XLA's CPU
GEMMs compute each output row with the same reduction order whatever the other rows hold, (b) every key sits in the
same slot in both computations and masked slots contribute exact zeros, and (c) the shapes are identical.
(b) fails for `llama.forward`'s sliding layers, which attend over concat(ring, new block): a key sits in the block
in one computation and in the ring in the other. `canonical_attend` therefore scatters the W + T sliding-layer keys
to slot `position % (W + T)` before attending (W + T consecutive positions never collide), so both computations
see every key at the same slot. Tests assert token AND logit identity.

Rollback is never a reshape: DenseKV layers roll back by a length update; WindowKV rings (which the verify block
overwrote) are merged with the pre-verify ring slot by slot (slots now holding a rejected position take the old
value back), which requires x + 1 <= W. The accepted tokens' exact keys/values (from the verify pass) are written
into the draft cache's recent ring after the drafted ones are rolled back.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.models.layer_types import FULL
from kvjax.models.llama.config import ModelConfig
from kvjax.decode import sampling
from kvjax.models.llama.draft import draft_forward
from kvjax.models import llama
from kvjax.models.attention import attend, default_attention


def canonical_attend(q, k, v, q_pos, k_pos, *, window=None, scale=None):
    """`attend` with sliding-layer keys first moved to slot position % S (see module docstring)."""
    if window is None:
        # blocked for large capacities (reads only occupied blocks); rows stay bit-identical across block counts
        return default_attention(q, k, v, q_pos, k_pos, window=None, scale=scale)
    B, K, S, D = k.shape
    slot = jnp.where(k_pos >= 0, jnp.mod(k_pos, S), S)  # [B, S]; empty -> dropped
    b = jnp.arange(B)[:, None]
    kc = jnp.zeros_like(k).at[b, :, slot].set(jnp.swapaxes(k, 1, 2), mode="drop")
    vc = jnp.zeros_like(v).at[b, :, slot].set(jnp.swapaxes(v, 1, 2), mode="drop")
    pc = jnp.full((B, S), -1, jnp.int32).at[b, slot].set(k_pos, mode="drop")
    return attend(q, kc, vc, q_pos, pc, window=window, scale=scale)


def full_forward(params, config: ModelConfig, cache: ModelCache, tokens, n_valid):
    """The verify-shape forward shared by VeriCache and its reference: logits f32[B, T, V], new cache."""
    return llama.forward(params, config, cache, tokens, n_valid, attention_fn=canonical_attend)


def check_draft_len(config: ModelConfig, x: int) -> None:
    """Raise if x + 1 verify rows cannot be rolled back in a sliding ring."""
    if x < 1:
        raise ValueError(f"draft length must be >= 1, got {x}")
    if config.sliding_window is not None and any(t != FULL for t in config.layer_types):
        if x + 1 > config.sliding_window:
            raise ValueError(f"draft length {x}: x + 1 verify rows must fit the sliding window "
                             f"{config.sliding_window} to be rolled back exactly")


# ---------------------------------------------------------------- drafting

@functools.partial(jax.jit, static_argnames=("x", "temperature", "rejection"), donate_argnames="dcache")
def draft_step(params, config: ModelConfig, dcache, last: jax.Array, seed: jax.Array, *, x: int,
               temperature: float = 0.0, rejection: bool = False):
    """Draft `x` tokens from the draft cache in one call (a `lax.fori_loop` of one-token draft forwards).

    Args:
        dcache: DraftCache with length L (= position of `last`); donated. Its ring gets the drafted KV.
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

    def body(i, carry):
        tok, dc, drafts, qlog = carry
        logits, dc = draft_forward(params, config, dc, tok[:, None], ones)
        pos = dc.length[:, None]  # position of the token being produced
        if rejection:
            nxt = sampling.sample_draft(logits, pos, seed, temperature)[:, 0]
            qlog = qlog.at[:, i].set(logits[:, 0])
        else:
            nxt = sampling.select_tokens(logits, pos, seed, temperature)[:, 0]
        return nxt, dc, drafts.at[:, i].set(nxt), qlog

    _, dcache, drafts, qlog = jax.lax.fori_loop(0, x, body, (last.astype(jnp.int32), dcache, drafts, qlog))
    return drafts, qlog, dcache


# ---------------------------------------------------------------- verification

def _rows(form, start: jax.Array, T: int):
    """Keys/values of positions start..start+T-1 from a layer form: ([B, T, K, D], [B, T, K, D])."""
    if isinstance(form, WindowKV):
        slot = jnp.mod(start[:, None] + jnp.arange(T)[None, :], form.window)
    else:
        slot = jnp.minimum(start[:, None] + jnp.arange(T)[None, :], form.capacity - 1)
    k = jnp.take_along_axis(form.k, slot[:, None, :, None], axis=2)
    v = jnp.take_along_axis(form.v, slot[:, None, :, None], axis=2)
    return jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)


def _rollback(old, new, keep_len: jax.Array):
    """Full-cache layer after verify rolled back to keep_len[b] tokens (masked, no reshape)."""
    if isinstance(new, WindowKV):
        take_new = (new.slot_positions() < keep_len[:, None])[:, None, :, None]
        return dataclasses.replace(new, k=jnp.where(take_new, new.k, old.k), v=jnp.where(take_new, new.v, old.v),
                                   seen=keep_len)
    return DenseKV(k=new.k, v=new.v, length=keep_len)


def verify_core(params, config: ModelConfig, full: ModelCache, dcache, last, drafts, qlog, seed, *,
                temperature: float, rejection: bool):
    """Verify + accept (traced inside a jit). Returns (emitted i32[B, x+1], n i32[B], full, dcache, rows).

    emitted[:, :n+1] are the new tokens (n accepted drafts, then the full cache's own token); `rows` are the exact
    per-layer (k, v) [B, x+1, K, D] of positions L..L+x from the verify pass.
    """
    B, x = drafts.shape
    L = full.length
    tokens = jnp.concatenate([last[:, None].astype(jnp.int32), drafts], axis=1)
    logits, new = full_forward(params, config, full, tokens, jnp.full((B,), x + 1, jnp.int32))
    positions = L[:, None] + 1 + jnp.arange(x + 1, dtype=jnp.int32)[None, :]  # positions of predicted tokens
    if rejection:
        n, nxt = sampling.rejection_accept(logits, qlog, drafts, positions, seed, temperature)
        target = None
    else:
        target = sampling.select_tokens(logits, positions, seed, temperature)  # [B, x+1]
        match = (drafts == target[:, :x]).astype(jnp.int32)
        n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
        nxt = jnp.take_along_axis(target, n[:, None], axis=1)[:, 0]
    j = jnp.arange(x + 1)[None, :]
    padded = jnp.concatenate([drafts, jnp.zeros((B, 1), jnp.int32)], axis=1)
    emitted = jnp.where(j < n[:, None], padded, nxt[:, None])
    keep = n + 1  # rows kept in the caches: last + n accepted drafts
    keep_len = L + keep
    layers, rows = [], []
    for old_f, new_f in zip(full.layers, new.layers):
        rows.append(_rows(new_f, L, x + 1))
        layers.append(_rollback(old_f, new_f, keep_len))
    full = ModelCache(layers=tuple(layers), length=keep_len)
    if dcache is not None:
        dl = []
        pos = L[:, None] + jnp.arange(x + 1, dtype=jnp.int32)[None, :]
        for layer, (k, v) in zip(dcache.layers, rows):
            recent = layer.recent.rollback(L).write(k, v, pos, keep)
            dl.append(dataclasses.replace(layer, recent=recent))
        dcache = dataclasses.replace(dcache, layers=tuple(dl), length=keep_len)
    return emitted, n, full, dcache, rows


@functools.partial(jax.jit, static_argnames=("temperature", "rejection"), donate_argnames=("full", "dcache"))
def verify_step(params, config: ModelConfig, full: ModelCache, dcache, last, drafts, qlog, seed, *,
                temperature: float = 0.0, rejection: bool = False):
    """Resident verify: one x+1-row forward over the full cache, accept, roll back, refresh the draft ring.

    Args:
        full: ModelCache with length L (donated); dcache: DraftCache after drafting (donated).
        last: i32[B]; drafts: i32[B, x]; qlog: draft logits (rejection sampling only); seed: i32[B].

    Returns:
        (emitted i32[B, x+1], n i32[B], full, dcache).
    """
    emitted, n, full, dcache, _ = verify_core(params, config, full, dcache, last, drafts, qlog, seed,
                                              temperature=temperature, rejection=rejection)
    return emitted, n, full, dcache


@functools.partial(jax.jit, static_argnames=("temperature", "rejection"),
                   donate_argnames=("prompt_kv", "tail", "dcache"))
def verify_offloaded(params, config: ModelConfig, prompt_kv, tail, length, prompt_len, dcache, last, drafts, qlog,
                     seed, *, temperature: float = 0.0, rejection: bool = False):
    """Verify with the prompt's full KV just brought back from host memory.

    The full cache is assembled on the device from `prompt_kv` (per layer (k, v) [B, K, C, D] full-capacity
    buffers, prompt rows filled; donated, so the assembly writes into the transferred buffers) and `tail` (per layer:
    DenseKV of decoded tokens, slot = position - prompt_len; WindowKV for sliding layers, always on device). The
    verify forward then runs on a cache bitwise equal to the resident one; only the tail keeps the accepted rows.

    Returns:
        (emitted, n, tail, dcache, scratch) — scratch is the assembled full KV, returned only so the donated
        transferred buffers can be aliased (assembled in place); callers drop it.
    """
    B, x = drafts.shape
    b = jnp.arange(B)[:, None]
    layers = []
    for kv, t in zip(prompt_kv, tail):
        if kv is None:
            layers.append(t)
            continue
        k, v = kv
        slot = prompt_len[:, None] + jnp.arange(t.capacity)[None, :]  # beyond the capacity -> dropped
        k = k.at[b, :, slot].set(jnp.swapaxes(t.k, 1, 2), mode="drop")
        v = v.at[b, :, slot].set(jnp.swapaxes(t.v, 1, 2), mode="drop")
        layers.append(DenseKV(k=k, v=v, length=length))
    full = ModelCache(layers=tuple(layers), length=length)
    emitted, n, new_full, dcache, rows = verify_core(params, config, full, dcache, last, drafts, qlog, seed,
                                                     temperature=temperature, rejection=rejection)
    new_tail = []
    for t, f, (rk, rv) in zip(tail, new_full.layers, rows):
        if isinstance(t, WindowKV):
            new_tail.append(f)
        else:
            rel = DenseKV(k=t.k, v=t.v, length=length - prompt_len)
            new_tail.append(rel.write(rk, rv, n + 1))
    scratch = tuple(None if isinstance(f, WindowKV) else (f.k, f.v) for f in new_full.layers)
    return emitted, n, tuple(new_tail), dcache, scratch


# ---------------------------------------------------------------- reference

@functools.partial(jax.jit, static_argnames=("x", "temperature"), donate_argnames="full")
def reference_step(params, config: ModelConfig, full: ModelCache, tok: jax.Array, seed: jax.Array, *, x: int,
                   temperature: float = 0.0):
    """One full-cache decode step through the verify shape: feed [tok, pad x] (T = x+1), read row 0.

    Returns:
        (next i32[B], top-1 minus top-2 logit f32[B], full with length + 1).
    """
    B = tok.shape[0]
    tokens = jnp.zeros((B, x + 1), jnp.int32).at[:, 0].set(tok)
    logits, full = full_forward(params, config, full, tokens, jnp.ones((B,), jnp.int32))
    nxt = sampling.select_tokens(logits[:, :1], full.length[:, None], seed, temperature)[:, 0]
    top = jax.lax.top_k(logits[:, 0], 2)[0]
    return nxt, top[:, 0] - top[:, 1], full
