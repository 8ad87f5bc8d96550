"""The one attention entry of every model: the position-masked jnp definition and the kernel dispatcher.

Queries carry their absolute positions, keys carry theirs (-1 = empty slot), so one function serves dense caches,
ring buffers, sparse draft caches and verification blocks: key `s` is visible to a query at position `t` iff
`0 <= pos[s] <= t` (and `pos[s] > t - W` for sliding layers). Softmax is f32 with a finite mask value, so a fully
masked row (padding) yields zeros, never NaN. The mask rule and the mask value are `pallas_kernels.reference`'s (the
definition every kernel must match); `attention(..., implementation=)` picks the implementation: "xla" is
`default_attention` (exactly `attend` for caches under 4096 slots, its blocked online-softmax form, which reads only
occupied blocks, for larger ones); "pallas", "pallas_interpret" and "pallas_debug" run kernel 0 of `pallas_kernels`;
"native" runs the native CPU kernel (`pallas_kernels/native`) for the shapes where it measured faster than XLA
(`native_wins`) and the XLA path for the others; None picks "pallas" on a GPU backend and
`pallas_kernels.active_cpu_implementation()` ("native" where it builds, else "xla") elsewhere. Models call
`attention` (or a bound `make_attention_fn`) and never pick a kernel.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from kvjax.cache.draft import Int8KV, QuantizedKV
from pallas_kernels import native
from pallas_kernels.online_softmax import MASK_VALUE, M_INIT
from pallas_kernels.reference import position_visible


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """bool[B, K|1, T, S] mask. q_pos: i32[B, T]; k_pos: i32[B, S] or i32[B, K, S]."""
    return position_visible(q_pos, k_pos, window)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Grouped-query attention with position masks.

    Args:
        q: [B, T, N, D] queries.
        k, v: [B, K, S, D] keys/values (N a multiple of K).
        q_pos: i32[B, T] absolute query positions.
        k_pos: i32[B, S] or i32[B, K, S] absolute key positions, -1 for empty slots.
        window: sliding window W (keys with pos <= t - W are hidden), or None.
        scale: softmax scale, default D ** -0.5.

    Returns:
        [B, T, N, D] in q's dtype.
    """
    B, T, N, D = q.shape
    K = k.shape[1]
    G = N // K
    scale = D**-0.5 if scale is None else scale
    qg = q.reshape(B, T, K, G, D)
    s = jnp.einsum("BTKGD,BKSD->BKGTS", qg, k, preferred_element_type=jnp.float32) * scale
    mask = visible(q_pos, k_pos, window)[:, :, None]  # [B, K|1, 1, T, S]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    # Output in the operands' batch order (BKG...): asking XLA:CPU for BTKGD directly made it 3-10x slower.
    o = jnp.einsum("BKGTS,BKSD->BKGTD", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.maximum(l, 1e-30)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, N, D).astype(q.dtype)


def attend_blocked(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    window: int | None = None,
    scale: float | None = None,
    block: int = 1024,
) -> jax.Array:
    """`attend` as an online softmax over key blocks, reading only blocks up to the last occupied slot.

    Same signature and masking as `attend`; S must be a multiple of `block`. The trip count is dynamic (the last slot
    holding a key, over the batch), so a decode at length L in a capacity-C cache reads ~L slots, not C, and a
    prefill chunk reads a triangle. A block a row cannot see leaves its (o, m, l) bit-identical (p = 0 exactly,
    rescale factor exp(0) = 1), so a row's result does not depend on how many extra blocks the loop visits: the
    one-row reference and the (x+1)-row verify agree bit for bit.
    """
    B, T, N, D = q.shape
    K, S = k.shape[1], k.shape[2]
    G = N // K
    scale = D**-0.5 if scale is None else scale
    if k_pos.ndim == 2:
        k_pos = k_pos[:, None, :]
    occupied = jnp.any(k_pos >= 0, axis=(0, 1))  # [S]
    last = jnp.max(jnp.where(occupied, jnp.arange(S), -1))
    n_blocks = (last + block) // block
    qg = jnp.transpose(q.reshape(B, T, K, G, D), (0, 2, 3, 1, 4))  # [B, K, G, T, D]

    def body(i, carry):
        o, m, l = carry
        kb = jax.lax.dynamic_slice_in_dim(k, i * block, block, axis=2)
        vb = jax.lax.dynamic_slice_in_dim(v, i * block, block, axis=2)
        pb = jax.lax.dynamic_slice_in_dim(k_pos, i * block, block, axis=2)
        s = jnp.einsum("BKGTD,BKSD->BKGTS", qg, kb, preferred_element_type=jnp.float32) * scale
        mask = visible(q_pos, pb, window)[:, :, None]  # [B, K, 1, T, block]
        s = jnp.where(mask, s, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        a = jnp.exp(m - m_new)
        l = l * a + jnp.sum(p, axis=-1, keepdims=True)
        o = o * a + jnp.einsum("BKGTS,BKSD->BKGTD", p.astype(vb.dtype), vb, preferred_element_type=jnp.float32)
        return o, m_new, l

    o0 = jnp.zeros((B, K, G, T, D), jnp.float32)
    m0 = jnp.full((B, K, G, T, 1), M_INIT, jnp.float32)
    l0 = jnp.zeros((B, K, G, T, 1), jnp.float32)
    o, _, l = jax.lax.fori_loop(0, n_blocks, body, (o0, m0, l0))
    o = o / jnp.maximum(l, 1e-30)
    return jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(B, T, N, D).astype(q.dtype)


BLOCKED_MIN_SLOTS = 4096
BLOCK = 1024
# Up to this many query rows per sequence the one-shot `attend` beats the blocked loop on XLA:CPU even though it
# reads the empty slots too; above it the blocked loop wins (the one-shot's [rows, S] scores no longer stay in
# cache). Measured per layer on the bundled model's shape (8 heads, 4 KV heads, D = 32), one-shot vs blocked-1024 ms:
# 9,216 slots: 1.30 vs 2.12 (3 rows), 1.47 vs 2.57 (5), 1.62-2.03 vs 2.58-2.91 (9), 3.48 vs 3.96 (17);
# 36,864 slots: 2.49 vs 4.89 (1), 4.98 vs 8.51 (5), 7.9-11.3 vs 9.5-11.9 (9), 28.0 vs 15.3 (17), 72.0 vs 32.7 (33).
# The whole verify step of x = 8 (9 rows) ran 1.4x (8K) and 1.57x (32K) faster in one shot
# (`scripts/bench_short_verify.py`). Short verifies (adaptive x = 2, 4, 8) and one-token steps therefore attend in
# one shot; prefill chunks and long verifies stay blocked. The choice depends only on static shapes, so a verify and
# its reference decoder (same rows) still run the same program.
ONE_SHOT_MAX_ROWS = 9
# From this many query rows (prefill chunks) the blocked loop takes key blocks of PREFILL_BLOCK: a block's scores
# and probabilities (rows x heads x block f32, 4 MB at 256 rows) are re-read by the softmax passes and the value dot,
# and half the tile keeps more of them in cache. Measured per layer, 256 rows, block 512 vs 1024: 25.8 vs 30.4 ms at
# 9,216 slots, 122 vs 148 ms at 36,864; with 17-65 rows 1024 stayed faster (9.0 vs 11.5 ms, 65 rows at 9,216 slots),
# so verifies keep BLOCK. Whole prefill with the last-row-only logits: `scripts/bench_prefill.py`.
PREFILL_ROWS = 128
PREFILL_BLOCK = 512


def default_attention(q, k, v, q_pos, k_pos, *, window=None, scale=None):
    """The XLA path the model uses: blocked (length-proportional) for large caches and many query rows, one-shot
    `attend` otherwise (see ONE_SHOT_MAX_ROWS, PREFILL_BLOCK)."""
    S, T = k.shape[2], q.shape[1]
    block = PREFILL_BLOCK if T >= PREFILL_ROWS else BLOCK
    if T > ONE_SHOT_MAX_ROWS and S >= BLOCKED_MIN_SLOTS and S % block == 0:
        return attend_blocked(q, k, v, q_pos, k_pos, window=window, scale=scale, block=block)
    return attend(q, k, v, q_pos, k_pos, window=window, scale=scale)


# The native kernel against XLA per layer, f32, one interleaved run per model on the shared 2-core EPYC, native / XLA
# ms (`scripts/bench_attention_peers.py`; docs/results/attention_peers_tiny.json, attention_peers_smollm2.json):
#   tiny (8 heads / 4 KV, D = 32), rows 1/5/9/17/33/256: 9,216 slots 1.05/1.85, 2.81/7.92, 3.93/5.40, 6.02/16.0,
#     10.3/31.3, 116/219; 36,864 slots 4.86/18.6, 12.4/43.9, 11.5/43.5, 29.3/68.2, 32.9/69.0, 173/453
#     (native/XLA 0.26-0.73; native/PyTorch fused SDPA in the same run 0.16-0.88);
#   SmolLM2-135M (9 heads / 3 KV, D = 64), rows 1/5/9/17/33/256: 2,048 slots 0.69/1.79, 0.63/1.62, 1.49/2.82,
#     1.71/6.54, 2.53/8.97, 18.3/66.2; 8,192 slots 1.46/4.35, 4.17/5.29, 3.11/9.67, 7.00/15.2, 10.1/20.3, 60.2/96.8
#     (native/XLA 0.26-0.79 at 2K-8K; native/PyTorch 0.44-1.26: PyTorch is faster at 1 and 256 rows of 2K and
#     33 rows of 4K); tiny shape at 256-4,096 slots (draft rings and buffers, an exploratory run): 0.24-0.89.
# The kernel scores up to 16 query rows against each group of keys it loads (register-blocked across rows, each
# row's arithmetic unchanged), so it no longer re-reads a key block per row and wins at every row count and cache
# size measured, from 256-slot draft rings to 256-row prefill chunks over 36,864 slots. Hence: native for every f32
# or bf16 attention (NATIVE_MIN_SLOTS = 0, no row limit); the kernel reads bf16 keys and values directly (widened
# exactly as it loads them, no f32 copy), e.g. a bf16 draft cache's prompt parts. The two limits stay as knobs (tests
# lift or set them) in case a shape is found where XLA wins.
NATIVE_MAX_ROWS: int | None = None
NATIVE_MIN_SLOTS = 0


def native_wins(q: jax.Array, k: jax.Array) -> bool:
    """Whether the native kernel runs this attention (static shapes only, so a verify block and its reference decoder
    take the same one): f32 or bf16 keys (the kernel reads both without a copy), at most NATIVE_MAX_ROWS query rows
    (None: any) and at least NATIVE_MIN_SLOTS slots (measured, above)."""
    rows_ok = NATIVE_MAX_ROWS is None or q.shape[1] <= NATIVE_MAX_ROWS
    return k.dtype in (jnp.float32, jnp.bfloat16) and rows_ok and k.shape[2] >= NATIVE_MIN_SLOTS


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
              window: int | None = None, scale: float | None = None, implementation: str | None = None) -> jax.Array:
    """Position-masked GQA attention with a choice of implementation.

    Args:
        q: [B, T, N, D] queries; k, v: [B, K, S, D]; q_pos: i32[B, T]; k_pos: i32[B, S] or i32[B, K, S] (-1 empty).
        window: sliding window W or None; scale: default D ** -0.5.
        implementation: None (auto), "xla", "pallas", "pallas_interpret", "pallas_debug", "native".

    Returns:
        [B, T, N, D] in q's dtype.
    """
    impl = pallas_kernels.resolve(implementation)
    if impl == "xla" or (impl == "native" and not native_wins(q, k)):
        return default_attention(q, k, v, q_pos, k_pos, window=window, scale=scale)
    return pallas_kernels.attend(q, k, v, q_pos, k_pos, window=window, scale=scale, implementation=impl)


def attend_stats(q, k, v, q_pos, k_pos, *, window=None, scale=None):
    """`attend` without the final division: un-normalised `(o f32[B, T, N, D], m f32[B, T, N], l f32[B, T, N])`.

    The XLA form of `pallas_kernels.attend(..., return_stats=True)` (same statistics, `combine`-able across parts),
    with the einsum output order XLA:CPU runs fast (see `attend`). Keys and values narrower than the queries (a bf16
    draft part under f32 queries) are upcast to the queries' dtype — an f32 copy on this path, unlike the native
    kernel — so the probabilities are never rounded to bf16.
    """
    B, T, N, D = q.shape
    K = k.shape[1]
    G = N // K
    scale = D**-0.5 if scale is None else scale
    qg = q.reshape(B, T, K, G, D)
    s = jnp.einsum("BTKGD,BKSD->BKGTS", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    mask = visible(q_pos, k_pos, window)[:, :, None]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("BKGTS,BKSD->BKGTD", p.astype(q.dtype), v.astype(q.dtype), preferred_element_type=jnp.float32)
    to_q = lambda a: jnp.transpose(a, (0, 3, 1, 2, 4)).reshape(B, T, N, a.shape[-1])  # noqa: E731
    return to_q(o), to_q(m)[..., 0], to_q(l)[..., 0]


def attention_parts(q: jax.Array, parts, q_pos: jax.Array, *, window: int | None = None, scale: float | None = None,
                    implementation: str | None = None) -> jax.Array:
    """Attention over a cache held in several parts (e.g. a draft cache's compressed prompt + its recent ring, or a
    quantized bulk + full-precision recent tokens) as if they were one, without concatenating them.

    Each part yields an un-normalised `(o, m, l)` (`attend_stats` on XLA, kernel 0 with `return_stats=True`
    otherwise); `pallas_kernels.combine` merges them and `finalize` normalises: the same arithmetic as split-K.

    Args:
        q: [B, T, N, D]; parts: sequence of (k [B, K, S_i, D], v [B, K, S_i, D], pos i32[B, S_i] or [B, K, S_i])
            or `QuantizedKV` (attended through `quantized_part_stats`: kernel 6 reads its codes on a GPU);
        q_pos: i32[B, T]; window, scale, implementation: as `attention`.

    Returns:
        [B, T, N, D] in q's dtype.
    """
    impl = pallas_kernels.resolve(implementation)
    fused = _int8_ring_stats(q, parts, q_pos, window=window, scale=scale) if impl == "native" else None
    if fused is not None:
        return pallas_kernels.finalize(*fused).astype(q.dtype)
    stats = []
    for part in parts:
        if isinstance(part, Int8KV):
            stats.append(int8_part_stats(q, part, q_pos, window=window, scale=scale, implementation=impl))
        elif isinstance(part, QuantizedKV):
            stats.append(quantized_part_stats(q, part, q_pos, window=window, scale=scale, implementation=impl))
        else:
            k, v, pos = part
            stats.append(part_stats(q, k, v, q_pos, pos, window=window, scale=scale, implementation=impl))
    if len(stats) == 1:
        o, m, l = stats[0]
    else:
        o, m, l = pallas_kernels.combine(*(jnp.stack(s, axis=0) for s in zip(*stats)), axis=0)
    return pallas_kernels.finalize(o, m, l).astype(q.dtype)


# Whether `attention_parts` attends an int8 kept part and its f32/bf16 ring in one native call (benchmarks switch it
# off to measure the two calls and their combine in the same process).
FUSE_INT8_RING = True
# Whether that call reads the kept codes as integers (`native.attend_stats_int8`'s qscores: each query row as int8
# codes, exact integer scores, the values' scales in the probabilities) instead of as f32 values. A draft's attention
# only -- verification never reads int8 codes -- so drafts may change, tokens never. Measured (SmolLM2 at 8K, AMD EPYC
# Zen 4, interleaved in one process): a draft token 0.90x the time; over 8 prompts 6.96 accepted per round of 8
# against 6.94, every output identical.
INT8_QSCORES = True


def _int8_ring_stats(q, parts, q_pos, *, window, scale):
    """`(o, m, l)` of a draft's [int8 kept part, f32/bf16 ring] in one native call, or None for any other parts.

    Two calls and XLA's combine of their statistics cost SmolLM2's draft token (30 layers) a fork and join of the
    threads per call and the combine's small operations per layer; one call merges the parts' statistics where it
    computes them (`native.attend_stats_int8_ring`: equal to the combine up to f32 rounding -- a draft's attention,
    lossy anyway). Measured, SmolLM2's draft token at 8K, interleaved in one process: 0.95-0.99x the time, the same
    drafts. The kept codes are scored as integers where `INT8_QSCORES` says so (the default).
    """
    if not FUSE_INT8_RING or len(parts) != 2 or not isinstance(parts[0], Int8KV) or not isinstance(parts[1], tuple):
        return None
    k, v, pos = parts[1]
    v = k if v is None else v
    if k.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != k.dtype:
        return None
    kept = parts[0]
    return native.attend_stats_int8_ring(q, kept.k, kept.v, kept.k_scale, kept.v_scale, q_pos, kept.pos, k, v, pos,
                                         window=window, scale=scale, qscores=INT8_QSCORES)


def quantized_part_stats(q, part: QuantizedKV, q_pos, *, window=None, scale=None, implementation=None):
    """Un-normalised `(o, m, l)` of the queries over a quantized draft part.

    On Pallas, kernel 6 dequantises inside the kernel, so only the codes and scales are read. On XLA the part is
    dequantised to f32 and attended by `attend_stats`: XLA:CPU has no dot over 4-bit codes, and inside the draft
    loop the part is loop-invariant, so XLA hoists the dequantisation out of it — measured on the bundled model's
    shape at 8K, per layer and draft token: 0.34 ms this way vs 0.48 ms with a bf16 copy and 0.75 ms with the scales
    folded into the queries and a dot over the converted codes (f32 attention over the same tokens: 0.25 ms).
    The compiled kernel needs `D * bits / 8 >= 16` (its dot tiles); narrower parts take the XLA form there too.
    """
    impl = pallas_kernels.resolve(implementation)
    D = q.shape[-1]
    if impl in ("xla", "native") or (impl == "pallas" and D * part.bits // 8 < 16):
        k, v, pos = part.dense()
        return part_stats(q, k, v, q_pos, pos, window=window, scale=scale, implementation=impl)
    return pallas_kernels.quantized_attention(q, part.k_codes, part.k_scale, part.k_zero, part.v_codes, part.v_scale,
                                              part.v_zero, part.pos, q_pos, bits=part.bits, group=part.group,
                                              window=window, scale=scale, implementation=impl, return_stats=True)


def int8_part_stats(q, part: Int8KV, q_pos, *, window=None, scale=None, implementation=None):
    """Un-normalised `(o, m, l)` of the queries over an int8 draft part.

    Natively (CPU), the kernel reads the codes and scales, multiplying each widened code by its slot's scale in
    registers: the result is bit for bit the f32 kernel's over `part.dense()`. Elsewhere the part is dequantised
    (`part.dense()`, which XLA hoists out of a draft loop: an f32 copy) and attended through the dispatcher.
    """
    impl = pallas_kernels.resolve(implementation)
    if impl == "native":
        return native.attend_stats_int8(q, part.k, part.v, part.k_scale, part.v_scale, q_pos, part.pos,
                                        window=window, scale=scale)
    k, v, pos = part.dense()
    return part_stats(q, k, v, q_pos, pos, window=window, scale=scale, implementation=impl)


def make_attention_fn(implementation: str | None = None) -> Callable[..., jax.Array]:
    """A callable with `attend`'s signature bound to one implementation (for `llama.forward(attention_fn=...)`).

    The name is resolved now, so a typo fails here rather than inside a traced step.
    """
    impl = pallas_kernels.resolve(implementation)
    if impl == "xla":
        return default_attention
    return functools.partial(attention, implementation=impl)


def canonical_attention(q, k, v, q_pos, k_pos, *, window=None, scale=None, implementation: str | None = None):
    """`attention` with every sliding-window key first moved to slot `position % S`.

    The verify shape's attention (see `kvjax.models.llama.verify`): a sliding layer attends over concat(ring, new
    block), where a key sits in the block in one computation and in the ring in another; scattering the `W + T` keys
    to slot `position % (W + T)` (W + T consecutive positions never collide) puts every key at the same slot in both,
    so rows agree bit for bit. Full-attention keys already sit at slot == position.
    """
    if window is None:
        return attention(q, k, v, q_pos, k_pos, window=None, scale=scale, implementation=implementation)
    B, K, S, D = k.shape
    slot = jnp.where(k_pos >= 0, jnp.mod(k_pos, S), S)  # [B, S]; empty -> dropped
    b = jnp.arange(B)[:, None]
    kc = jnp.zeros_like(k).at[b, :, slot].set(jnp.swapaxes(k, 1, 2), mode="drop")
    vc = jnp.zeros_like(v).at[b, :, slot].set(jnp.swapaxes(v, 1, 2), mode="drop")
    pc = jnp.full((B, S), -1, jnp.int32).at[b, slot].set(k_pos, mode="drop")
    return attention(q, kc, vc, q_pos, pc, window=window, scale=scale, implementation=implementation)


# ---------------------------------------------------------------- parts with sinks and per-query sparse parts
# DeepSeek-V4's attention: one softmax over a sliding window, compressed entries (HCA) and each query's own top-k
# entries (CSA), with a learned per-head sink logit in the denominator. Each part yields un-normalised statistics
# through the dispatcher (kernel 0 / kernel 5 with `return_stats=True` on Pallas, `attend_stats` / `sparse_stats` on
# XLA); `combine` merges them and `finalize` adds the sinks, so the parts are never concatenated.


def sparse_stats(q, k, v, indices, *, scale=None):
    """XLA statistics of each query over its own picked entries: gather, then `attend_stats`' masked softmax.

    Args:
        q: [B, T, N, D]; k, v: [B, K, E, D] entries (v None: keys are the values); indices: i32[B, T, P] entry per
            pick (shared by the heads), -1 = no pick.

    Returns:
        un-normalised `(o f32[B, T, N, D], m f32[B, T, N], l f32[B, T, N])`.
    """
    B, T, N, D = q.shape
    K = k.shape[1]
    G = N // K
    scale = D**-0.5 if scale is None else scale
    safe = jnp.maximum(indices, 0)  # -1 picks read entry 0 and are masked
    gather = jax.vmap(lambda kb, ib: kb[:, ib])  # [K, E, D], [T, P] -> [K, T, P, D]
    kg = gather(k, safe)
    vg = kg if v is None else gather(v, safe)
    qg = q.reshape(B, T, K, G, D)
    s = jnp.einsum("BTKGD,BKTPD->BKGTP", qg, kg.astype(q.dtype), preferred_element_type=jnp.float32) * scale
    mask = (indices >= 0)[:, None, None]  # [B, 1, 1, T, P]
    s = jnp.where(mask, s, MASK_VALUE)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("BKGTP,BKTPD->BKGTD", p.astype(vg.dtype), vg, preferred_element_type=jnp.float32)
    to_q = lambda a: jnp.transpose(a, (0, 3, 1, 2, 4)).reshape(B, T, N, a.shape[-1])  # noqa: E731
    return to_q(o), to_q(m)[..., 0], to_q(l)[..., 0]


def part_stats(q, k, v, q_pos, k_pos, *, window=None, scale=None, implementation=None):
    """Un-normalised `(o, m, l)` of one position-masked part through the dispatcher (v None: keys are the values)."""
    impl = pallas_kernels.resolve(implementation)
    if impl == "xla" or (impl == "native" and not native_wins(q, k)):
        return attend_stats(q, k, k if v is None else v, q_pos, k_pos, window=window, scale=scale)
    return pallas_kernels.attend(q, k, v, q_pos, k_pos, window=window, scale=scale, implementation=impl,
                                 return_stats=True)


def sparse_part_stats(q, k, v, indices, *, scale=None, implementation=None):
    """Un-normalised `(o, m, l)` of a per-query sparse part (kernel 5 on Pallas, `sparse_stats` on XLA)."""
    impl = pallas_kernels.resolve(implementation)
    if impl in ("xla", "native"):  # per-query gathers: no native form
        return sparse_stats(q, k, v, indices, scale=scale)
    return pallas_kernels.sparse_attention(q, k, v, indices, scale=scale, implementation=impl, return_stats=True)


def attention_merged(q: jax.Array, q_pos: jax.Array, *, parts=(), sparse_parts=(), sinks: jax.Array | None = None,
                     scale: float | None = None, implementation: str | None = None) -> jax.Array:
    """One softmax over several cache parts, position-masked and per-query sparse, with optional per-head sinks.

    Args:
        q: [B, T, N, D] queries at positions q_pos i32[B, T].
        parts: (k [B, K, S_i, D], v or None (keys are the values), pos i32[B, S_i] or [B, K, S_i], window or None)
            each: key visible iff 0 <= pos <= q_pos (and pos > q_pos - window).
        sparse_parts: (k [B, K, E, D], v or None, indices i32[B, T, P]) each: query t sees entries indices[b, t]
            (-1 = none).
        sinks: f32[N] sink logits (join the denominator, carry no value) or None.
        scale: default D ** -0.5; implementation: as `attention`.

    Returns:
        [B, T, N, D] in q's dtype; a row with nothing visible and no sink is zeros.
    """
    stats = [part_stats(q, k, v, q_pos, pos, window=w, scale=scale, implementation=implementation)
             for k, v, pos, w in parts]
    stats += [sparse_part_stats(q, k, v, idx, scale=scale, implementation=implementation)
              for k, v, idx in sparse_parts]
    if len(stats) == 1:
        o, m, l = stats[0]
    else:
        o, m, l = pallas_kernels.combine(*(jnp.stack(s, axis=0) for s in zip(*stats)), axis=0)
    return pallas_kernels.finalize(o, m, l, sinks).astype(q.dtype)
