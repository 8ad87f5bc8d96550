"""Attention scores as a side computation: where queries put their softmax mass over a cache, block by block.

Used to choose what a draft cache keeps (`kvjax.compress.refresh`); never part of a forward's own arithmetic, so the
implementation may differ from the reference by f32 rounding without touching VeriCache's exactness (it only has to be
deterministic: the same inputs give the same bits, so a run's selections are reproducible).

On CPU, where the native library builds (`pallas_kernels.native.available()`, off with `KVJAX_NATIVE=0`), f32 inputs
take the native kernel (`pallas_kernels/native/block_mass.cc`: one pass over the keys); elsewhere, and for other
dtypes, the jnp reference (`block_mass_reference`: the definition; XLA's einsum on a GPU). Measured on the 2-core
EPYC at the bundled model's shape, 32,768 slots (`scripts/bench_refresh_step.py`, three interleaved runs on a shared
machine): a refresh's masses (2 verify rows, 4 layers) 0.27-0.37x XLA's time (1.25-1.75x the memory floor of reading
the keys once); the whole re-selection step 1.56-2.01 full-cache decode steps with them against 2.20-2.56 with
XLA's, the rest of it now mostly the gather of the selected blocks and the top-k.

`attention_with_block_mass` takes the masses from a verify's own attention instead (the native kernel's
`kvjax_attend_mass`), so a re-selection after a verify reads no key a second time: the bundled model's re-selection at
32K 1.7-2.2 ms against 6.4-7.0 with `block_mass`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels
from kvjax.models.attention import MASK_VALUE, attention, native_wins, visible
from pallas_kernels import native
from pallas_kernels.native.block_mass import block_mass as native_block_mass


# The implementation `block_mass` takes when called without one: None (the default) picks per backend and dtype
# (`uses_native`); "xla" or "native" forces one (benchmarks compare them in one run; set before tracing).
IMPLEMENTATION: str | None = None


def block_mass(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array, block: int, *,
               implementation: str | None = None) -> jax.Array:
    """Softmax mass f32[B, K, ceil(S / block)] that queries q [B, R, N, D] at q_pos i32[B, R] put on each block of
    keys k [B, K, S, D] (positions k_pos i32[B, S]), summed over each KV head's query group and the R rows (the
    definition: `block_mass_reference`).

    implementation: None (the module's IMPLEMENTATION, by default: the native kernel on CPU for f32 inputs where it
    builds, else the reference), "native" (raises where it cannot build) or "xla" (the jnp reference)."""
    impl = implementation or IMPLEMENTATION
    if impl not in (None, "xla", "native"):
        raise ValueError(f"implementation must be None, 'xla' or 'native', got {impl!r}")
    if impl == "native" or (impl is None and uses_native(q, k)):
        return native_block_mass(q, k, q_pos, k_pos, block)
    return block_mass_reference(q, k, q_pos, k_pos, block)


def uses_native(q: jax.Array, k: jax.Array) -> bool:
    """Whether `block_mass` picks the native kernel for these (static) shapes and dtypes on the current backend."""
    return q.dtype == jnp.float32 and k.dtype == jnp.float32 and native.runs_here()


def block_mass_reference(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array, block: int) -> jax.Array:
    """Softmax mass f32[B, K, S // block] that queries q [B, R, N, D] at q_pos i32[B, R] put on each block of keys
    k [B, K, S, D] (positions k_pos i32[B, S]), summed over each KV head's query group and the R rows."""
    B, R, N, D = q.shape
    K, S = k.shape[1], k.shape[2]
    qg = q.reshape(B, R, K, N // K, D)
    s = jnp.einsum("BRKGD,BKSD->BKGRS", qg, k.astype(q.dtype), preferred_element_type=jnp.float32) * D**-0.5
    mask = visible(q_pos, k_pos, None)[:, :, None]
    s = jnp.where(mask, s, MASK_VALUE)
    p = jnp.where(mask, jnp.exp(s - jnp.max(s, axis=-1, keepdims=True)), 0.0)
    p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
    mass = jnp.sum(p, axis=(2, 3))  # [B, K, S]
    pad = (-S) % block
    mass = jnp.pad(mass, ((0, 0), (0, 0), (0, pad)))
    return mass.reshape(B, K, -1, block).sum(-1)


def attention_with_block_mass(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
                              rows: tuple[int, ...], block: int, row_base: jax.Array | None = None,
                              implementation: str | None = None):
    """`attention(q, k, v, q_pos, k_pos)` and, where the native kernel runs it, the block masses of query rows `rows`
    (`block_mass(q[:, rows], k, q_pos[:, rows], k_pos, block)` up to f32 rounding) from the same pass over the keys;
    elsewhere the mass is None and the caller scores later from the queries. `row_base` (i32[B], default zeros) moves
    batch row b's scoring rows to row_base[b] + rows; those that fall outside the call's rows add nothing.

    A verify reads its whole full cache anyway; taking the refreshing drafter's scores from its probabilities spares
    the re-selection a second pass over the keys (`block_mass`, most of a re-selection's time). The attention output is
    the plain kernel's bit for bit (the masses only read the probabilities), and which path runs depends only on static
    shapes and the implementation, so a verify and its reference decoder still run one program.
    """
    rows = tuple(sorted({r % q.shape[1] for r in rows}))
    impl = pallas_kernels.resolve(implementation)
    if impl == "native" and native_wins(q, k) and native.mass_block_fits(block, native.default_block(q.shape[-1])):
        o, m, l, mass = native.attend_stats_mass(q, k, v, q_pos, k_pos, rows=rows, mass_block=block,
                                                 row_base=row_base)
        return pallas_kernels.finalize(o, m, l).astype(q.dtype), mass
    return attention(q, k, v, q_pos, k_pos, implementation=implementation), None
