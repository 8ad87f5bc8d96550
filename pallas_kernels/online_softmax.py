"""Online softmax, written once: the running state `(o, m, l)`, its block update, the split-K `combine`, `finalize`.

State per query row: `o` f32[R, D] un-normalised output, `m` f32[R] running max of the scores, `l` f32[R] running sum
of `exp(s - m)`. The running max starts at `finfo(f32).min` and masked scores are the finite `MASK_VALUE`, so the
correction factor `exp(m_old - m_new)` is always `exp(finite - finite)`: never `-inf - -inf`, never NaN. A row that saw
no visible key keeps `l == 0` and finalises to zeros (padding rows, empty caches).

The same functions run inside Pallas kernel bodies (on [R, ...] tiles) and in plain jnp (on stacked partials), so the
arithmetic is identical across implementations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Same finite value as kvjax.models.attention.MASK_VALUE: well above finfo.min, so `m` can always start below it.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
M_INIT = float(jnp.finfo(jnp.float32).min)


def dot(a: jax.Array, b: jax.Array, contract_b: int = 0) -> jax.Array:
    """f32-accumulated `a @ b` (contract_b=0) or `a @ b.T` (contract_b=1).

    f32 operands ask for HIGHEST precision so the Triton backend does not silently use TF32 (which would break parity
    with the f32 reference at 1e-5); bf16 operands use the native bf16 MMA with f32 accumulation.
    """
    if a.dtype != b.dtype:  # e.g. f32 queries over a bf16 cache: compute in the wider type
        dt = jnp.promote_types(a.dtype, b.dtype)
        a, b = a.astype(dt), b.astype(dt)
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


def init_state(rows: int, dim: int):
    """Fresh `(o f32[R, D], m f32[R], l f32[R])`."""
    return (jnp.zeros((rows, dim), jnp.float32), jnp.full((rows,), M_INIT, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def update(state, s: jax.Array, visible: jax.Array, pv):
    """Fold one block of scores into the running state.

    Args:
        state: `(o, m, l)`; `o` may be a tuple of arrays (e.g. per-plane outputs of the quantized kernel).
        s: f32[R, bk] scaled scores of this block.
        visible: bool[R, bk] mask.
        pv: callable `p f32[R, bk] -> contribution` with `o`'s structure (usually `dot(p.astype(v.dtype), v)`).

    Returns:
        the new `(o, m, l)`.
    """
    o, m, l = state
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)  # finite - finite: m >= M_INIT, m_new >= MASK_VALUE
    p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
    l_new = alpha * l + jnp.sum(p, axis=1)
    o_new = jax.tree.map(lambda a, c: alpha[:, None] * a + c, o, pv(p))
    return o_new, m_new, l_new


def combine(o: jax.Array, m: jax.Array, l: jax.Array, axis: int = 0):
    """Merge split-K partials along `axis` into one `(o, m, l)`.

    Args:
        o: f32[..., splits, ..., D] partial un-normalised outputs (`axis` indexes the splits, counted on `m`'s shape).
        m: f32[..., splits, ...] partial running maxima.
        l: f32[..., splits, ...] partial sums.

    Returns:
        `(o, m, l)` with the split axis removed; exactly the state one pass over all blocks would reach (up to
        float rounding). Empty partials (`l == 0`, `m` at its initial value) contribute nothing.
    """
    axis = axis % m.ndim
    m_all = jnp.max(m, axis=axis, keepdims=True)
    w = jnp.exp(m - m_all)
    l_all = jnp.sum(w * l, axis=axis)
    o_all = jnp.sum(jnp.expand_dims(w, -1) * o, axis=axis)
    return o_all, jnp.squeeze(m_all, axis), l_all


def finalize(o: jax.Array, m: jax.Array, l: jax.Array, sinks: jax.Array | None = None) -> jax.Array:
    """Normalise: `o / l`, with an optional per-row attention sink logit joining the denominator.

    A sink is a learned logit with no value (gpt-oss, DeepSeek-V4): softmax runs over `[scores, sink]` and the sink's
    column is dropped, so it only adds `exp(sink - m)` to `l`.

    Args:
        o: f32[..., D]; m, l: f32[...]; sinks: f32 broadcastable to `m`, or None.

    Returns:
        f32[..., D]; rows with nothing visible (and no sink) are zeros.
    """
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks.astype(jnp.float32), m.shape)
        m_new = jnp.maximum(m, sinks)
        alpha = jnp.exp(m - m_new)
        o = o * alpha[..., None]
        l = l * alpha + jnp.exp(sinks - m_new)
    return o / jnp.maximum(l, 1e-30)[..., None]
