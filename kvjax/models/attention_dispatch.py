"""Attention through the kernel dispatcher: the model and VeriCache steps call `attention` (or a bound
`make_attention_fn(...)`) instead of a fixed implementation.

"xla" is `kvjax.models.attention.default_attention`: exactly `attend` (the jnp definition) for caches under
4096 slots, and its blocked online-softmax form (reads only occupied blocks) for larger ones; "pallas",
"pallas_interpret" and "pallas_debug" run kernel 0 of `pallas_kernels` (position-masked attention, same masking rule);
None picks "pallas" on a GPU backend and "xla" elsewhere.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp

import pallas_kernels
from kvjax.models.attention import default_attention


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
              window: int | None = None, scale: float | None = None, implementation: str | None = None) -> jax.Array:
    """Position-masked GQA attention with a choice of implementation.

    Args:
        q: [B, T, N, D] queries; k, v: [B, K, S, D]; q_pos: i32[B, T]; k_pos: i32[B, S] or i32[B, K, S] (-1 empty).
        window: sliding window W or None; scale: default D ** -0.5.
        implementation: None (auto), "xla", "pallas", "pallas_interpret", "pallas_debug".

    Returns:
        [B, T, N, D] in q's dtype.
    """
    impl = pallas_kernels.resolve(implementation)
    if impl == "xla":
        return default_attention(q, k, v, q_pos, k_pos, window=window, scale=scale)
    return pallas_kernels.attend(q, k, v, q_pos, k_pos, window=window, scale=scale, implementation=impl)


def attention_parts(q: jax.Array, parts, q_pos: jax.Array, *, window: int | None = None, scale: float | None = None,
                    implementation: str | None = None) -> jax.Array:
    """Attention over a cache held in several parts (e.g. a draft cache's compressed prompt + its recent ring, or a
    quantized bulk + full-precision recent tokens) as if they were one, without concatenating them.

    Each part yields an un-normalised `(o, m, l)` (kernel 0 with `return_stats=True`); `pallas_kernels.combine`
    merges them and `finalize` normalises: the same arithmetic as split-K.

    Args:
        q: [B, T, N, D]; parts: sequence of (k [B, K, S_i, D], v [B, K, S_i, D], pos i32[B, S_i] or [B, K, S_i]);
        q_pos: i32[B, T]; window, scale, implementation: as `attention`.

    Returns:
        [B, T, N, D] in q's dtype.
    """
    impl = pallas_kernels.resolve(implementation)
    stats = [pallas_kernels.attend(q, k, v, q_pos, pos, window=window, scale=scale, implementation=impl,
                                   return_stats=True) for k, v, pos in parts]
    o, m, l = pallas_kernels.combine(*(jnp.stack(s, axis=0) for s in zip(*stats)), axis=0)
    return pallas_kernels.finalize(o, m, l).astype(q.dtype)


def make_attention_fn(implementation: str | None = None) -> Callable[..., jax.Array]:
    """A callable with `attend`'s signature bound to one implementation (for `llama.forward(attention_fn=...)`).

    The name is resolved now, so a typo fails here rather than inside a traced step.
    """
    impl = pallas_kernels.resolve(implementation)
    if impl == "xla":
        return default_attention
    return functools.partial(attention, implementation=impl)
