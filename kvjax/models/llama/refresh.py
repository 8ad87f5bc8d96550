"""Where the refreshing drafter's scores come from, for the Llama family: the verify rows' own attention.

The verify-shape forward (`verify.verify_forward`) hands out, per full-attention layer, the queries of two of its
rows (the first and the last) and, where the native kernel runs the layer's attention, the block masses those rows put
on the cache the verify just read (`attention_scores.attention_with_block_mass`: taken from the probabilities the
kernel computes anyway, no second pass over the keys). Every program that runs the verify shape — VeriCache's
verifications, refreshing or not, and the reference decoder — outputs both, so the program, and with it every bit of
every logit, is the same with and without a refreshing draft (measured: scoring with XLA inside the verify's program
moved its logits in the last bits; XLA fused the queries' computation differently once they had a second use; the
native kernel's masses leave its statistics unchanged). `refresh_masses` takes the verify's masses, or scores the
committed full cache with the queries where there are none (XLA, Pallas, another block size), in the refresh step's
own jitted call, and the drafter re-gathers its blocks. `prompt_block_masses` scores the prompt from its last tokens'
queries, for the first selection: where the native kernel runs, every one of those rows' masses comes from its own
attention pass too, instead of a second pass over the keys (`block_mass`): a compression, alternated in one process
(AMD EPYC Zen 4), 16.3 against 19.4 ms on the bundled model at 16K, 114 against 148 ms on SmolLM2 at 8K.

The verify's masses cover the keys the verify saw: the committed cache plus the verify block's own rows (the last row
sees the drafts, rejected ones included), so a row's mass is normalised over a few more keys than the committed
cache holds; the selection ranks blocks below the draft's recent ring only, where this rescales each row's masses
and nothing else.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax.arrays import device_space
from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.models.attention import attention, canonical_attention, make_attention_fn
from kvjax.models.attention_scores import attention_with_block_mass, block_mass
from kvjax.models.llama.config import ModelConfig
from kvjax.models.llama.layers import decoder_stack, lm_head
from kvjax.models.llama.model import _attend_layer

QUERY_ROWS = (0, -1)  # the verify rows whose queries score: the last emitted token and the last draft (Vegas)
MASS_BLOCK = 16  # the block of the verify's own masses: the refreshing drafter's default (`Refresh.block`)


def _attend_full_with_masses(form: DenseKV, q, k, v, positions, n_valid, *, rows: tuple[int, ...], block: int,
                             row_base=None, implementation: str | None):
    """`_attend_layer`'s full-attention case (write the new rows, attend over the whole cache), with the block masses
    of query rows `rows` (moved by `row_base`) where the attention computes them free (`attention_with_block_mass`;
    None elsewhere). Returns (out, new form, mass)."""
    form = form.write(k, v, n_valid)
    out, mass = attention_with_block_mass(q, form.k, form.v, positions, form.key_positions(), rows=rows, block=block,
                                          row_base=row_base, implementation=implementation)
    return out, form, mass


def verify_with_queries(params, config: ModelConfig, cache: ModelCache, tokens, n_valid, *,
                        implementation: str | None = None):
    """The verify-shape forward: (logits f32[B, T, V], new cache, (queries: per layer f32[B, 2, N, D] of rows
    QUERY_ROWS or None for sliding layers, their positions i32[B, 2], masses: per layer those rows' block masses
    f32[B, K, ceil(S / MASS_BLOCK)] over the verified cache where the native kernel computed them, else None))."""
    B, T = tokens.shape
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    attn = functools.partial(canonical_attention, implementation=implementation)
    r = jnp.asarray([j % T for j in QUERY_ROWS], jnp.int32)

    def attend(i, form, q, k, v):
        if type(form) is DenseKV:
            out, form, mass = _attend_full_with_masses(form, q, k, v, positions, n_valid, rows=QUERY_ROWS,
                                                       block=MASS_BLOCK, implementation=implementation)
            return out, form, (q[:, r], mass)
        out, new = _attend_layer(form, q, k, v, positions, n_valid, attn)
        return out, new, ((q[:, r], None) if isinstance(new, DenseKV) else (None, None))

    h, layers, auxes = decoder_stack(params, config, tokens, positions, cache.layers, attend)
    queries, masses = tuple(a[0] for a in auxes), tuple(a[1] for a in auxes)
    return (lm_head(params, config, h), ModelCache(layers=layers, length=cache.length + n_valid),
            (queries, positions[:, r], masses))


def forward_with_masses(params, config: ModelConfig, cache: ModelCache, tokens, n_valid, first, *, rows: int,
                        block: int, implementation: str | None = None, logit_rows=None):
    """A prefill chunk's `forward` that also hands out, per full-attention layer, the block masses f32[B, K,
    ceil(S / block)] its share of the prompt's scoring rows puts on the cache -- the rows at positions first[b] ..
    first[b] + rows - 1 that lie in this chunk (none: zeros) -- from the attention's own pass, where the native kernel
    runs it. Sliding layers: None; all of them None where some full-attention layer's attention cannot (the caller
    then scores with `prompt_block_masses`).

    The first selection of the refreshing drafter scores the prompt by its last tokens' attention
    (`Refresh.prepare`); the prefill already computes exactly that attention, so taking the masses from it spares a
    forward of those tokens over the whole cache (SmolLM2 at 8K: ~125 ms of ~130 per compression). Summed over the
    chunks that hold them, they are `prompt_block_masses`' masses of the same rows up to f32 rounding (bit for bit
    when one chunk holds them all and the products are row-independent, as the native ones are). The logits and the
    cache are `forward`'s bit for bit: the masses only read the probabilities, and each layer runs the attention
    `forward` runs (`attention_with_block_mass` falls back to it)."""
    B, T = tokens.shape
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    base = first - cache.length  # the first scoring row's index in this chunk (negative: an earlier chunk holds it)
    scoring = tuple(range(min(rows, T)))

    def attend(i, form, q, k, v):
        if type(form) is DenseKV:
            return _attend_full_with_masses(form, q, k, v, positions, n_valid, rows=scoring, block=block,
                                            row_base=base, implementation=implementation)
        out, new = _attend_layer(form, q, k, v, positions, n_valid, make_attention_fn(implementation), implementation)
        return out, new, None

    h, layers, masses = decoder_stack(params, config, tokens, positions, cache.layers, attend)
    logits = lm_head(params, config, h if logit_rows is None else jnp.take_along_axis(h, logit_rows[..., None], 1))
    if any(m is None and type(f) is DenseKV for m, f in zip(masses, cache.layers)):
        masses = None  # some full-attention layer's attention could not hand them out (decided by static shapes)
    return logits, ModelCache(layers=layers, length=cache.length + n_valid), masses


def refresh_masses(full: ModelCache, aux, *, block: int) -> tuple:
    """Per layer block mass f32[B, K, S // block] (None for sliding layers) the verify rows put on the full cache: the
    verify's own where it computed them at this block size, else their queries' on the committed cache."""
    queries, q_pos, masses = aux
    return tuple(None if q is None or not isinstance(f, DenseKV) else
                 mass if mass is not None and block == MASS_BLOCK else
                 block_mass(q, f.k, q_pos, f.key_positions(), block)
                 for q, mass, f in zip(queries, masses, full.layers))


@functools.partial(jax.jit, static_argnames="block")
def prompt_block_masses(params, config: ModelConfig, cache: ModelCache, tokens: jax.Array, start: jax.Array, *,
                        block: int):
    """Per layer block mass f32[B, K, ceil(S / block)] (None for sliding layers) that prompt tokens i32[B, T] at
    positions start + t put on the prefilled cache (which already holds them; it is read, never written): from the
    attention's own pass where the native kernel runs it and can sum `block`-slot groups, else scored from the
    queries (`block_mass`)."""
    cache = device_space(cache)  # a prefilled cache lent from host memory is read in place
    T = tokens.shape[1]
    positions = start[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]

    def attend(i, form, q, k, v):
        if isinstance(form, WindowKV):
            return attention(q, form.k, form.v, positions, form.slot_positions(), window=form.window), form, None
        kpos = form.key_positions()
        # every row's masses from the attention's own pass where the native kernel runs it (no second pass over the
        # keys, most of an admission's compression), else scored from the queries
        out, mass = attention_with_block_mass(q, form.k, form.v, positions, kpos, rows=tuple(range(T)), block=block)
        return out, form, block_mass(q, form.k, positions, kpos, block) if mass is None else mass

    _, _, masses = decoder_stack(params, config, tokens, positions, cache.layers, attend)
    return masses
