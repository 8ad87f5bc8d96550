"""DeepSeek-V4 forward pass (sliding / CSA / HCA hybrid attention) over a params pytree and a `HybridCache`.

One function serves prefill chunks, one-token decode and multi-token verification, with the calling convention of
`kvjax.models.llama.forward`: `T` new tokens per row (`n_valid[b]` real, the rest padding), positions
`cache.length + t`, every state update a masked write. The full (uncached) forward is the same function run on an
empty cache with the whole sequence as one chunk, so "cached == full" is a property of the state, not of two codes.

Per attention layer (transformers 5.24 `DeepseekV4Attention` is the definition):
- q: low-rank `wq_a -> q_norm -> wq_b`, unweighted RMSNorm per head, interleaved RoPE on the trailing
  `rope_head_dim` channels; one shared key=value head `kv_norm(wkv h)` with the same RoPE.
- every layer attends to its sliding window (the last `W` positions, itself included); CSA/HCA layers add compressed
  entries: HCA all complete entries `w < (t + 1) // m'`; CSA the lightning indexer's top-`index_topk` complete entries.
  Sliding layers use the "main" rope, CSA/HCA layers (and their compressors and indexer) the "compress" rope.
- softmax with a learned per-head sink logit, over the window, HCA entries and CSA's picks as separate parts merged by
  the attention dispatcher (`kvjax.models.attention.attention_merged`: kernels 0 and 5 on Pallas); the output's
  rope slice is rotated back by the query position; grouped low-rank output projection (`wo_a` per head group, then
  `wo_b`).
Around each block, hyper-connections (hc streams, Sinkhorn-projected mixing); the MLP is routed MoE (hash-routed in
`hash_moe` layers) plus one shared expert.

Top-k ties in the indexer break toward the lower entry index (`lax.top_k`), so one-token decode and multi-token
verify select the same entries; transformers' `torch.topk` leaves tie order unspecified.

Params layout (matrices `[in, out]`): embed [V, H]; lm_head [H, V] (absent if tied); final_norm [H];
hc_head {fn [hc*H, hc], base [hc], scale [1]}; layers: tuple of dicts with attn_norm/ffn_norm [H],
hc_attn/hc_ffn {fn [hc*H, (2+hc)*hc], base, scale [3]}, attn {wq_a [H, R], q_norm [R], wq_b [R, N*D], wkv [H, D],
kv_norm [D], wo_a [G, N*D/G, O], wo_b [G*O, H], sinks [N], compressor {wkv, wgate [H, Dp], ape [m, Dp], norm [D]}
(CSA/HCA; Dp = 2D for CSA), indexer {compressor {...at index_head_dim}, wq_b [R, nh*c], weights_proj [H, nh]} (CSA)},
ffn {gate [H, E], bias [E] (moe) | tid2eid i32[V, k] (hash_moe; absent when `config.hash_seed` derives the table),
w1/w3 [E, H, I], w2 [E, I, H], shared {w1/w3 [H, I], w2 [I, H]}}.

Limits: the MoE runs every expert densely (exact, differentiable; fine for small configs, wasteful at 256 experts);
the indexer materialises its scores `[B, T, index_n_heads, C]`, so long prefills of large configs need small chunks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvjax.cache.hybrid import CompressedKV, HybridCache, IndexerState, LayerState, Tail
from kvjax.models.deepseek_v4.cache import init_cache
from kvjax.models.layer_types import CSA, SLIDING
from kvjax.models.deepseek_v4.config import HASH_MOE, DeepseekV4Config, hash_table
from kvjax.models.attention import attention_merged
from kvjax.models.deepseek_v4.layers import (apply_rope, hyper_head, hyper_merge, hyper_weights, moe, pool_windows,
    rms_norm, rope_tables)

Params = dict[str, Any]


def _compress(p: Params, config: DeepseekV4Config, comp: CompressedKV, tail: Tail, h: jax.Array, n_valid: jax.Array):
    """Feed the new tokens to one compressor; emit an entry for every window they complete.

    Returns (new CompressedKV, new Tail).
    """
    kv_new = h @ p["wkv"]
    gate_new = h @ p["wgate"]
    win_kv, win_gate, slot_ok, index, ok, tail = tail.absorb(kv_new, gate_new, n_valid)
    ape = p["ape"]  # [m, Dp]: slot i of a window gets ape[i] (CSA: first half for the Ca series, second for Cb)
    if tail.overlap_kv is not None:
        d = ape.shape[1] // 2
        ape = jnp.concatenate([ape[:, :d], ape[:, d:]], axis=0)  # [2m, d]: previous window's Ca, then this Cb
    pooled = rms_norm(pool_windows(win_kv, win_gate, slot_ok, ape), p["norm"], config.rms_norm_eps)
    # an entry carries the rope of its window's first position
    cos, sin = rope_tables(config.compress_rope, config.rope_head_dim, index * tail.rate)
    pooled = apply_rope(pooled, cos, sin)
    return comp.write(pooled, index, ok), tail


def _indexer(p: Params, config: DeepseekV4Config, state: IndexerState, h, q_res, positions, n_valid,
             present: jax.Array | None = None):
    """Lightning indexer: score `sum_h w_h relu(q_h . k)` over its compressed keys, keep the top-k complete ones.

    `present` bool[B, C] marks the main compressed entries a draft copy still holds (None: all).
    Returns (new IndexerState, idx i32[B, T, k], ok bool[B, T, k]).
    """
    B, T, _ = h.shape
    nh, c, m = config.index_n_heads, config.index_head_dim, config.csa_rate
    keys, tail = _compress(p["compressor"], config, state.keys, state.tail, h, n_valid)
    cos, sin = rope_tables(config.compress_rope, config.rope_head_dim, positions)
    iq = apply_rope((q_res @ p["wq_b"]).reshape(B, T, nh, c), cos[:, :, None], sin[:, :, None])
    s = jnp.einsum("BTHc,BCc->BTHC", iq, keys.entries, preferred_element_type=jnp.float32)
    s = jax.nn.relu(s) * c**-0.5
    w = (h @ p["weights_proj"]).astype(jnp.float32) * nh**-0.5
    score = jnp.einsum("BTHC,BTH->BTC", s, w)
    C = keys.entries.shape[1]
    valid = jnp.arange(C)[None, None, :] < ((positions + 1) // m)[:, :, None]
    if keys.keep is not None or present is not None:  # a draft copy: choose among the entries it still holds
        held = keys.visible() if present is None else keys.visible() & present
        valid = valid & held[:, None, :]
    score = jnp.where(valid, score, -jnp.inf)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(score), min(config.index_topk, C))
    ok = jnp.take_along_axis(valid, idx, axis=-1)
    return IndexerState(keys=keys, tail=tail), idx, ok


def _attention(p: Params, config: DeepseekV4Config, kind: str, state: LayerState, h, positions, n_valid,
               implementation: str | None):
    """One attention block. h: [B, T, H] normalised input. Returns (out [B, T, H], new LayerState)."""
    B, T, _ = h.shape
    N, D, W, eps = config.num_heads, config.head_dim, config.sliding_window, config.rms_norm_eps
    rope = config.main_rope if kind == SLIDING else config.compress_rope
    cos, sin = rope_tables(rope, config.rope_head_dim, positions)
    q_res = rms_norm(h @ p["wq_a"], p["q_norm"], eps)
    q = rms_norm((q_res @ p["wq_b"]).reshape(B, T, N, D), None, eps)
    q = apply_rope(q, cos[:, :, None], sin[:, :, None])
    kv = apply_rope(rms_norm(h @ p["wkv"], p["kv_norm"], eps), cos, sin)  # [B, T, D]

    # sliding window: the ring as it was (older positions) plus this chunk, every key moved to slot
    # `position % (W + T)` (W + T consecutive positions never collide): a key then sits at the same slot whether it
    # came from the ring or from the block, so a verify block's row j reduces over its keys in the same order as a
    # one-token step at that position — the verify shape is bit-identical to the reference decoder's.
    win = state.window
    t = jnp.arange(T)[None, :]
    kpos = jnp.concatenate([win.slot_positions(), jnp.where(t < n_valid[:, None], positions, -1)], axis=1)
    keys = jnp.concatenate([win.kv.astype(kv.dtype), kv], axis=1)
    S_w = W + T
    slot = jnp.where(kpos >= 0, jnp.mod(kpos, S_w), S_w)
    b = jnp.arange(B)[:, None]
    keys = jnp.zeros_like(keys).at[b, slot].set(keys, mode="drop")
    kpos = jnp.full((B, S_w), -1, jnp.int32).at[b, slot].set(kpos, mode="drop")
    # one shared K = V head: every part is [B, 1, S, D] with v None (kernels read it once)
    parts = [(keys[:, None], None, kpos, W)]
    sparse = []
    new = LayerState(window=win.write(kv, n_valid))
    if kind != SLIDING:
        m = config.rate(kind)
        comp, tail = _compress(p["compressor"], config, state.compressed, state.tail, h, n_valid)
        entries = comp.entries.astype(kv.dtype)[:, None]
        if kind == CSA:
            present = None if comp.keep is None else comp.keep
            indexer, idx, ok = _indexer(p["indexer"], config, state.indexer, h, q_res, positions, n_valid, present)
            sparse.append((entries, None, jnp.where(ok, idx, -1)))
            new = LayerState(window=new.window, compressed=comp, tail=tail, indexer=indexer)
        else:
            # HCA: entry w is keyed by the last source position it pools, (w + 1) * m - 1, so the position mask
            # `pos <= t` is the causal rule w < (t + 1) // m; entries a draft copy dropped get -1
            C = comp.entries.shape[1]
            epos = (jnp.arange(C, dtype=jnp.int32)[None, :] + 1) * m - 1
            parts.append((entries, None, jnp.where(comp.visible(), epos, -1), None))
            new = LayerState(window=new.window, compressed=comp, tail=tail)
    out = attention_merged(q, positions, parts=parts, sparse_parts=sparse, sinks=p["sinks"].astype(jnp.float32),
                           scale=D**-0.5, implementation=implementation)
    # K = V carries rope on its trailing slice: rotate the output back by the query position
    out = apply_rope(out, cos[:, :, None], -sin[:, :, None])
    G = config.o_groups
    grouped = jnp.einsum("BTGi,Gio->BTGo", out.reshape(B, T, G, N * D // G), p["wo_a"])
    return grouped.reshape(B, T, -1) @ p["wo_b"], new


def forward(params: Params, config: DeepseekV4Config, cache: HybridCache, tokens: jax.Array,
            n_valid: jax.Array | None = None, *, implementation: str | None = None, return_hidden: bool = False,
            logit_rows: jax.Array | None = None):
    """Run `T` new tokens per sequence through the model, folding them into `cache`.

    Args:
        params: the params pytree (layout in the module docstring).
        config: static model config.
        cache: state before these tokens; new tokens take positions `cache.length + t`.
        tokens: i32[B, T] token ids (rows beyond `n_valid` are padding and change nothing).
        n_valid: i32[B] real tokens per row (default: all T).
        implementation: attention implementation (see `kvjax.models.attention`); every part of every layer's
            attention goes through its dispatcher.
        return_hidden: also return the final normalised hidden states [B, T, H].
        logit_rows: i32[B, R] the rows to compute logits for (default: all T; a prefill chunk needs its last row).

    Returns:
        (logits f32[B, T, V] — f32[B, R, V] with `logit_rows` —, new cache) — and hidden states when asked.
    """
    B, T = tokens.shape
    if n_valid is None:
        n_valid = jnp.full((B,), T, jnp.int32)
    n_valid = n_valid.astype(jnp.int32)
    positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    eps, hc = config.rms_norm_eps, config.hc_mult
    hck = dict(iters=config.hc_sinkhorn_iters, hc_eps=config.hc_eps, norm_eps=eps)
    x = params["embed"][tokens]
    x = jnp.broadcast_to(x[:, :, None, :], (B, T, hc, x.shape[-1]))
    new_layers = []
    for lp, state, kind, mlp_kind in zip(params["layers"], cache.layers, config.layer_types,
                                         config.mlp_layer_types):
        post, comb, col = hyper_weights(lp["hc_attn"], x, **hck)
        a, state = _attention(lp["attn"], config, kind, state, rms_norm(col, lp["attn_norm"], eps), positions, n_valid,
                              implementation)
        x = hyper_merge(post, comb, a, x)
        post, comb, col = hyper_weights(lp["hc_ffn"], x, **hck)
        ffn = lp["ffn"]
        if mlp_kind == HASH_MOE and "tid2eid" not in ffn:
            ffn = dict(ffn, tid2eid=jnp.asarray(hash_table(config)))
        f = moe(ffn, rms_norm(col, lp["ffn_norm"], eps), tokens, hashed=mlp_kind == HASH_MOE,
                top_k=config.num_experts_per_tok, scoring=config.scoring_func,
                scaling=config.routed_scaling_factor, limit=config.swiglu_limit)
        x = hyper_merge(post, comb, f, x)
        new_layers.append(state)
    h = rms_norm(hyper_head(params["hc_head"], x, hc_eps=config.hc_eps, norm_eps=eps), params["final_norm"], eps)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    if logit_rows is not None:
        h = jnp.take_along_axis(h, logit_rows[..., None], 1)
    logits = (h @ head).astype(jnp.float32)
    new_cache = HybridCache(layers=tuple(new_layers), length=cache.length + n_valid)
    if return_hidden:
        return logits, new_cache, h
    return logits, new_cache


def forward_train(params: Params, config: DeepseekV4Config, tokens: jax.Array) -> jax.Array:
    """Full forward without a cache (differentiable): logits f32[B, T, V] for tokens i32[B, T].

    It is `forward` on an empty cache sized to the sequence; gradients flow through everything except the discrete
    choices (indexer top-k, router top-k, hash routing).
    """
    B, T = tokens.shape
    cache = init_cache(config, B, T, params["embed"].dtype)
    return forward(params, config, cache, tokens)[0]
