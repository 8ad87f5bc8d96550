"""VeriCache (arXiv 2605.17613) on DeepSeek-V4: a lossy draft copy of the hybrid cache drafts, the full state verifies.

The draft copy keeps the small forms exact (SWA rings, compressor and indexer tails) and makes the two growing forms
lossy: compressed KV entries and the indexer's compressed keys are dropped (all but `keep_sink` oldest and
`keep_recent` newest entries per layer) and/or quantized (symmetric per-entry absmax, `bits` bits). Dropped entries are
invisible to the draft's attention and indexer (`CompressedKV.keep`); entries the drafter completes while drafting are
exact and kept.

A round: rebuild the draft from the full cache (`make_draft`), draft `x` tokens with one-token steps inside one jit
call, then run the `x + 1` block [last token, drafts] through the *full* cache: accept drafts up to the first mismatch
with the full cache's argmax, emit the full cache's token there (or the bonus token when all match). The hybrid forms
cannot be rolled back by a length update (the ring overwrote old slots, tails absorbed rejected tokens), so the state
is committed by a second masked pass over the same block with `n_valid = accepted + 1` from the pre-verify state: pure
functions make that free of copies, and rows beyond `n_valid` never touch the state.

Limits: the draft stores dequantized values in the cache dtype and hides dropped entries with a mask, so its *compact*
size is computed (`draft_bytes`), not allocated; the draft is rebuilt each round (a pass over the compressed entries).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.capacity import pick_capacity
from kvjax.cache.hybrid import CompressedKV, HybridCache
from kvjax.models.deepseek_v4.cache import init_cache
from kvjax.models import deepseek_v4
from kvjax.decode.steps import greedy_loop
from kvjax.models.deepseek_v4.api_old import prefill


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """How the draft copy degrades compressed entries and indexer keys. bits=0: no quantization."""

    keep_sink: int = 1
    keep_recent: int = 4
    drop: bool = True
    bits: int = 4


def _degrade(form: CompressedKV, spec: DraftSpec) -> CompressedKV:
    C = form.entries.shape[1]
    c = jnp.arange(C)[None, :]
    keep = jnp.ones(form.entries.shape[:2], bool)
    if spec.drop:
        keep = (c < spec.keep_sink) | (c >= form.count[:, None] - spec.keep_recent)
    entries = form.entries
    if spec.bits:
        e = entries.astype(jnp.float32)
        qmax = 2 ** (spec.bits - 1) - 1
        scale = jnp.max(jnp.abs(e), axis=-1, keepdims=True) / qmax
        scale = jnp.where(scale > 0, scale, 1.0)
        entries = (jnp.clip(jnp.round(e / scale), -qmax, qmax) * scale).astype(entries.dtype)
    return dataclasses.replace(form, entries=entries, keep=keep)


@jax.jit
def make_draft(full: HybridCache, spec: DraftSpec) -> HybridCache:
    """The lossy draft copy of `full` (rings and tails exact; compressed entries and indexer keys degraded)."""
    layers = []
    for st in full.layers:
        if st.compressed is not None:
            st = dataclasses.replace(st, compressed=_degrade(st.compressed, spec))
        if st.indexer is not None:
            st = dataclasses.replace(st, indexer=dataclasses.replace(st.indexer, keys=_degrade(st.indexer.keys, spec)))
        layers.append(st)
    return dataclasses.replace(full, layers=tuple(layers))


def draft_bytes(full: HybridCache, spec: DraftSpec, itemsize: int = 2) -> tuple[int, int]:
    """(full, compact draft) bytes of the compressed entries + indexer keys held, batch row 0.

    Draft: kept entries only, `bits` per element plus one `itemsize` scale per entry when quantized.
    """
    full_b = draft_b = 0
    for st in full.layers:
        for form in (st.compressed, None if st.indexer is None else st.indexer.keys):
            if form is None:
                continue
            n, d = int(form.count[0]), form.entries.shape[-1]
            kept = min(n, spec.keep_sink + spec.keep_recent) if spec.drop else n
            full_b += n * d * itemsize
            draft_b += kept * (d * spec.bits // 8 + itemsize) if spec.bits else kept * d * itemsize
    return full_b, draft_b


@functools.partial(jax.jit, static_argnames="x")
def draft_tokens(params, config, draft: HybridCache, first: jax.Array, *, x: int) -> jax.Array:
    """x greedy tokens from the draft copy (one-token steps in a fori_loop), feeding `first` i32[B] first."""
    out, _ = greedy_loop(lambda c, t, n: deepseek_v4.forward(params, config, c, t, n), draft, first, x)
    return out


@functools.partial(jax.jit, donate_argnames="full")
def verify(params, config, full: HybridCache, block: jax.Array):
    """Verify the block [last emitted token, x drafts] i32[B, x+1] against the full cache.

    Returns (accepted drafts i32[B], the full cache's predictions i32[B, x+1], full cache advanced by accepted + 1).
    """
    B, T = block.shape
    logits, _ = deepseek_v4.forward(params, config, full, block, jnp.full((B,), T, jnp.int32))
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    match = pred[:, :-1] == block[:, 1:]
    accepted = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
    _, full = deepseek_v4.forward(params, config, full, block, accepted + 1)
    return accepted, pred, full


def generate_vericache(model, prompt_ids, max_new_tokens: int, *, x: int = 4, spec: DraftSpec = DraftSpec()):
    """Greedy decoding of one prompt with a lossy draft copy and full-cache verification (DeepSeek-V4).

    Returns:
        (tokens i32[max_new_tokens], stats {"rounds", "accepted_per_round", "acceptance", "full_bytes",
        "draft_bytes"}).
    """
    ids = np.asarray(prompt_ids, np.int32).reshape(-1)
    cfg, params = model.config, model.params
    full = init_cache(cfg, 1, pick_capacity(ids.size + max_new_tokens + x + 1))
    lg, full = prefill(params, cfg, full, ids)
    out = [int(np.argmax(lg[-1]))]
    accepted_total = rounds = 0
    fb = db = 0
    while len(out) < max_new_tokens:
        draft = make_draft(full, spec)
        fb, db = draft_bytes(full, spec)
        last = jnp.asarray([out[-1]], jnp.int32)
        drafts = draft_tokens(params, cfg, draft, last, x=x)
        block = jnp.concatenate([last[:, None], drafts], axis=1)
        acc, pred, full = verify(params, cfg, full, block)
        a = int(acc[0])
        out += [int(t) for t in np.asarray(drafts[0, :a])] + [int(pred[0, a])]
        accepted_total += a
        rounds += 1
    stats = {"rounds": rounds, "accepted_per_round": accepted_total / max(rounds, 1),
             "acceptance": accepted_total / max(rounds * x, 1), "full_bytes": fb, "draft_bytes": db}
    return np.asarray(out[:max_new_tokens], np.int32), stats
