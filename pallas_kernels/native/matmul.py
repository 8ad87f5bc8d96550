"""The native products for a few rows (`matmul.cc`): y f32[..., N] = x f32[..., K] @ w[K, N] with bf16 weights (each
read once as bf16 and widened in registers; XLA:CPU would first convert `w` to an f32 copy), int8 codes with a scale per
output column (`matmul_int8`, the same loop, a quarter of f32's bytes) or f32 weights (`matmul_f32`: what a decode
step's row and a verify block's 2-64 rows multiply by on CPU, `pallas_kernels.linear.F32_NATIVE_ROWS`; register tiles
of up to 6 rows x 64 columns, 0.90-0.93x XLA:CPU's time inside SmolLM2's 9- and 17-row verify steps); and f32 weights or
int8 codes packed in 64-column panels (`matmul_f32_packed`, `matmul_int8_packed`: the same bits, contiguous streams)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import native


def _require() -> None:
    """RuntimeError (naming why) where the native library is not available."""
    if not native.available():
        raise RuntimeError(f"the native matmul kernel is not available: {native.status()['reason']}")


def _call(target: str, x: jax.Array, n: int):
    """The custom call `target` giving f32[..., n] for x [..., K]."""
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape[:-1] + (n,), jnp.float32), vmap_method="broadcast_all")


def _product_call(name: str, target: str, x: jax.Array, w: jax.Array):
    """The checked custom call of `name` (`target`): RuntimeError where the library is not available, ValueError for
    shapes other than x [..., K], w [K, N]."""
    _require()
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"{name} needs x [..., K] and w [K, N], got {x.shape} and {w.shape}")
    return _call(target, x, w.shape[1])


def _packed_call(name: str, target: str, x: jax.Array, panels: jax.Array):
    """`_product_call` for weights packed in 64-column panels, `panels` [P, K, 64] (N = 64P)."""
    _require()
    if panels.ndim != 3 or panels.shape[2] != 64 or x.shape[-1] != panels.shape[1]:
        raise ValueError(f"{name} needs x [..., K] and panels [P, K, 64], got {x.shape} and {panels.shape}")
    return _call(target, x, panels.shape[0] * 64)


def matmul_bf16(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32[..., K] @ w bf16[K, N] -> f32[..., N]; each output FMA chains over k in order (`matmul.cc`: fixed by the
    shape), so no row depends on another row of `x`. Raises RuntimeError (naming why) where the native library is not
    available."""
    call = _product_call("matmul_bf16", native.MATMUL_TARGET, x, w)
    return call(x.astype(jnp.float32), w.astype(jnp.bfloat16))


def matmul_int8(x: jax.Array, codes: jax.Array, scale: jax.Array) -> jax.Array:
    """(x f32[..., K] @ codes int8[K, N]) * scale f32[N] -> f32[..., N]: each output one FMA chain over k in order
    (codes widened exactly to f32; int8 codes are never read in chunks, `matmul.cc`), times its column's scale once;
    no row depends on another row of `x`. Raises RuntimeError (naming why) where the native library is not available,
    ValueError for mismatched shapes."""
    call = _product_call("matmul_int8", native.MATMUL_I8_TARGET, x, codes)
    if scale.shape != (codes.shape[1],):
        raise ValueError(f"matmul_int8 needs scale [N] = [{codes.shape[1]}], got {scale.shape}")
    return call(x.astype(jnp.float32), codes.astype(jnp.int8), scale.astype(jnp.float32))


def matmul_f32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f32[..., K] @ w f32[K, N] -> f32[..., N]; each output one FMA chain over k in order (f32 weights are never
    read in chunks, `matmul.cc`), so a row's result does not depend on the other rows of `x`. Raises RuntimeError
    (naming why) where the native library is not available."""
    call = _product_call("matmul_f32", native.MATMUL_F32_TARGET, x, w)

    # The custom call has no derivative: gradients take XLA's products (the same function up to f32 rounding).
    @jax.custom_vjp
    def product(x, w):
        return call(x, w)

    def fwd(x, w):
        return product(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        gx = g @ w.T
        gw = x.reshape(-1, x.shape[-1]).T @ g.reshape(-1, g.shape[-1])
        return gx, gw

    product.defvjp(fwd, bwd)
    return product(x.astype(jnp.float32), w.astype(jnp.float32))


def matmul_f32_packed(x: jax.Array, panels: jax.Array) -> jax.Array:
    """x f32[..., K] @ w -> f32[..., N] for f32 weights packed in 64-column panels, `panels` f32[N / 64, K, 64]
    (`pallas_kernels.linear.pack_f32`) -- or bf16 panels of weights that are exactly bf16 values, read at half the
    bytes and widened exactly: each output one FMA chain over k in order, the same bits as `matmul_f32` on the
    unpacked `w` for any number of rows. Raises RuntimeError (naming why) where the native library is not available,
    ValueError for mismatched shapes."""
    call = _packed_call("matmul_f32_packed", native.MATMUL_F32_PACKED_TARGET, x, panels)
    stored = jnp.bfloat16 if panels.dtype == jnp.bfloat16 else jnp.float32
    return call(x.astype(jnp.float32), panels.astype(stored))


def matmul_int8_packed(x: jax.Array, panels: jax.Array, scale: jax.Array) -> jax.Array:
    """(x f32[..., K] @ codes) * scale -> f32[..., N] for int8 codes packed in 64-column panels, `panels`
    int8[N / 64, K, 64], `scale` f32[N] (`pallas_kernels.linear.pack_int8`): the same bits as `matmul_int8` on the
    unpacked codes for any number of rows. RuntimeError / ValueError as `matmul_f32_packed`."""
    call = _packed_call("matmul_int8_packed", native.MATMUL_I8_PACKED_TARGET, x, panels)
    if scale.shape != (panels.shape[0] * 64,):
        raise ValueError(f"matmul_int8_packed needs scale [N] = [{panels.shape[0] * 64}], got {scale.shape}")
    return call(x.astype(jnp.float32), panels.astype(jnp.int8), scale.astype(jnp.float32))


def matmul_affine_packed(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array) -> jax.Array:
    """x f32[..., K] @ w -> f32[..., N] for weights stored as packed block-affine codes (`pallas_kernels.affine`):
    `q` int8[N / 64, K, 64] in `pack_f32`'s panel order, or [N / 64, K, 32] 4-bit codes (byte j of a k holds column
    j low, j + 32 high; uint8: unsigned nibbles, int8: two's complement ones); `d` and `m` f32[N / 64, K / 32, 64];
    weight = fma(q, d, m) of its block of 32 k -- exactly the f32 weight, so the same bits as `matmul_f32_packed` on the
    f32 panels, reading 1.25 (or 0.75) bytes per weight instead of 4. RuntimeError / ValueError as
    `matmul_f32_packed`."""
    _require()
    widths = (32,) if q.dtype == jnp.uint8 else (32, 64)
    if q.ndim != 3 or q.shape[2] not in widths or q.dtype not in (jnp.int8, jnp.uint8) or x.shape[-1] != q.shape[1]:
        raise ValueError(f"matmul_affine_packed needs x [..., K] and q int8 [P, K, 64] or 4-bit codes [P, K, 32] "
                         f"(uint8 / int8), got {x.shape} and {q.dtype}{q.shape}")
    want = (q.shape[0], q.shape[1] // 32, 64)
    if q.shape[1] % 32 or d.shape != want or m.shape != want:
        raise ValueError(f"matmul_affine_packed needs K a multiple of 32 and d, m {want}, got K = {q.shape[1]}, "
                         f"{d.shape}, {m.shape}")
    call = _call(native.MATMUL_AFFINE_PACKED_TARGET, x, q.shape[0] * 64)
    return call(x.astype(jnp.float32), q, d.astype(jnp.float32), m.astype(jnp.float32))


def matmul_int_dot(x: jax.Array, q: jax.Array, d: jax.Array, m: jax.Array) -> jax.Array:
    """x f32[..., K] times 4-bit codes by integer dot products -> f32[..., N] (`pallas_kernels.int_dot`: `q`
    uint8[N / 64, K / 2, 64] in its pair layout, `d` and `m` f16[N / 64, K / 32, 64]); each row quantised to int16 per
    block of 32 k inside the call, so the result is `int_dot_reference`'s up to f32 rounding, not the exact product.
    RuntimeError where the library is not available; ValueError for other shapes."""
    _require()
    if q.ndim != 3 or q.shape[2] != 64 or q.dtype != jnp.uint8 or x.shape[-1] != 2 * q.shape[1]:
        raise ValueError(f"matmul_int_dot needs x [..., K] and q uint8 [P, K / 2, 64], got {x.shape} and "
                         f"{q.dtype}{q.shape}")
    want = (q.shape[0], 2 * q.shape[1] // 32, 64)
    if (2 * q.shape[1]) % 32 or d.shape != want or m.shape != want:
        raise ValueError(f"matmul_int_dot needs K a multiple of 32 and d, m {want}, got K = {2 * q.shape[1]}, "
                         f"{d.shape}, {m.shape}")
    call = _call(native.MATMUL_INT_DOT_TARGET, x, q.shape[0] * 64)
    return call(x.astype(jnp.float32), q, d.astype(jnp.float16), m.astype(jnp.float16))


def matmul_int_dot8(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
    """x f32[..., K] times int8 codes by integer dot products -> f32[..., N] (`pallas_kernels.int_dot.IntDot8`: `q`
    int8[N / 64, K / 2, 128] in its pair layout, `scale` f32[N]); each row quantised to int16 per block of 32 k inside
    the call, so the result is `int_dot8_reference`'s up to f32 rounding, not the exact product. RuntimeError where the
    library is not available; ValueError for other shapes."""
    _require()
    if q.ndim != 3 or q.shape[2] != 128 or q.dtype != jnp.int8 or x.shape[-1] != 2 * q.shape[1]:
        raise ValueError(f"matmul_int_dot8 needs x [..., K] and q int8 [P, K / 2, 128], got {x.shape} and "
                         f"{q.dtype}{q.shape}")
    if (2 * q.shape[1]) % 32 or scale.shape != (q.shape[0] * 64,):
        raise ValueError(f"matmul_int_dot8 needs K a multiple of 32 and scale [{q.shape[0] * 64}], got "
                         f"K = {2 * q.shape[1]}, {scale.shape}")
    call = _call(native.MATMUL_INT_DOT8_TARGET, x, q.shape[0] * 64)
    return call(x.astype(jnp.float32), q, scale.astype(jnp.float32))
