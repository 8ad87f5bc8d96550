"""Kernel 0 with some rows' block masses (`kvjax_attend_mass`, `native.attend_stats_mass`): the statistics are the
plain kernel's bit for bit, the masses the jnp definition's within f32 rounding (ragged lengths, empty slots, per-head
positions, several key segments, rows split among threads, bf16 keys, rows that see nothing), the same bits in the
portable build, and `attention_with_block_mass` fuses them only where the native kernel runs (the refreshing drafter's
VeriCache with them: `test_native_block_mass.test_refreshing_vericache_equals_the_reference_with_native_masses`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import native_attention_case, scalar_native_library

from kvjax.models.attention_scores import attention_with_block_mass, block_mass_reference
from pallas_kernels import native

TOL = dict(rtol=2e-5, atol=1e-6)

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library does not build here")


def _case(T, G, D, **kw):
    """`native_attention_case` with peaked queries (x 2: uneven masses) and D positional."""
    return native_attention_case(T, G, D=D, q_scale=2.0, **kw)


def _both(q, k, v, q_pos, k_pos, rows, mass_block=16):
    fused = jax.jit(lambda *a: native.attend_stats_mass(*a, rows=rows, mass_block=mass_block))(q, k, v, q_pos, k_pos)
    plain = jax.jit(native.attend_stats)(q, k, v, q_pos, k_pos)
    r = list(rows)
    want = jax.jit(block_mass_reference, static_argnums=4)(q[:, r], k, q_pos[:, r], k_pos, mass_block)
    return [np.asarray(x) for x in fused], [np.asarray(x) for x in plain], np.asarray(want)


@pytest.mark.parametrize("T,G,D,K,S,rows,per_head,B", [
    (9, 2, 32, 4, 700, (0, 8), False, 2),  # the bundled model's x = 8 verify: first and last rows, GQA 2
    (9, 3, 64, 3, 1100, (0, 8), False, 2),  # SmolLM2's shape: 9 query / 3 KV heads, D = 64 (128-key blocks)
    (5, 2, 32, 2, 5000, (0, 4), False, 2),  # several 2,048-key segments per row, merged after
    # one sequence, 3 KV heads (tiles do not divide among 2 threads), 51 rows, one segment: rows split among threads
    (17, 3, 32, 3, 1000, (0, 16), False, 1),
    (9, 2, 32, 2, 900, (3,), True, 2),  # one row, per-head positions with holes
    (4, 1, 32, 2, 333, (0, 1, 2, 3), False, 2),  # every row, G = 1, a ragged last block
])
def test_statistics_unchanged_and_masses_match_the_reference(T, G, D, K, S, rows, per_head, B):
    q, k, v, q_pos, k_pos = _case(T, G, D, K=K, S=S, lengths=(S - 40, S // 3)[:B], per_head=per_head, seed=T + D + S)
    (o, m, l, mass), plain, want = _both(q, k, v, q_pos, k_pos, rows)
    for got, ref in zip((o, m, l), plain):
        assert np.array_equal(got, ref)  # the masses only read the probabilities
    assert mass.shape == want.shape == (B, K, -(-S // 16))
    np.testing.assert_allclose(mass, want, **TOL)
    if not per_head:  # every row is a distribution over what it sees: a head's masses sum to its rows x G
        np.testing.assert_allclose(mass.sum(-1), len(rows) * G, rtol=1e-5)


def test_bf16_keys_and_rows_that_see_nothing():
    """bf16 keys and values are scored as their f32 widening; a row placed before every key (q_pos -1) adds 0, and a
    sequence with no occupied slot gives all zeros, never NaN."""
    q, k, v, q_pos, k_pos = _case(3, 2, 32, S=400, lengths=(350, 120), seed=3)
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    q_pos = q_pos.at[1, 0].set(-1)
    (o, m, l, mass), plain, want = _both(q, kb, vb, q_pos, k_pos, (0, 2))
    assert all(np.array_equal(a, b) for a, b in zip((o, m, l), plain))
    np.testing.assert_allclose(mass, want, **TOL)
    np.testing.assert_allclose(mass[1].sum(-1), 2, rtol=1e-5)  # sequence 1: only row 2 (x G = 2 heads) sees keys
    empty = native.attend_stats_mass(q, k, v, q_pos, jnp.full_like(k_pos, -1), rows=(0, 2), mass_block=16)[3]
    assert np.isfinite(np.asarray(empty)).all() and (np.asarray(empty) == 0).all()


def test_bad_rows_and_blocks_raise_naming_the_problem():
    q, k, v, q_pos, k_pos = _case(3, 2, 32, S=64, lengths=(60, 30))
    with pytest.raises(ValueError, match="rows"):
        native.attend_stats_mass(q, k, v, q_pos, k_pos, rows=(0, 0), mass_block=16)
    with pytest.raises(ValueError, match="rows"):
        native.attend_stats_mass(q, k, v, q_pos, k_pos, rows=(3,), mass_block=16)
    with pytest.raises(ValueError, match="mass_block"):
        native.attend_stats_mass(q, k, v, q_pos, k_pos, rows=(0,), mass_block=24)  # does not divide 256


def test_the_dispatcher_fuses_only_where_the_native_kernel_runs():
    q, k, v, q_pos, k_pos = _case(3, 2, 32, S=256, lengths=(200, 100))
    out, mass = attention_with_block_mass(q, k, v, q_pos, k_pos, rows=(0, -1), block=16, implementation="native")
    want = block_mass_reference(q[:, [0, 2]], k, q_pos[:, [0, 2]], k_pos, 16)
    np.testing.assert_allclose(np.asarray(mass), np.asarray(want), **TOL)
    out_x, none = attention_with_block_mass(q, k, v, q_pos, k_pos, rows=(0, -1), block=16, implementation="xla")
    assert none is None
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_x), rtol=1e-5, atol=1e-6)
    assert attention_with_block_mass(q, k, v, q_pos, k_pos, rows=(0,), block=24, implementation="native")[1] is None


def test_a_row_base_moves_the_rows_and_splits_add_up():
    """`row_base` moves each sequence's scoring rows at run time, and rows past either end of the call add nothing: a
    prefill scores its prompt's last rows from whichever chunks hold them (`kvjax.decode.steps.prefill`), so the
    masses of rows split over two calls sum to those of one call holding them all, within f32 rounding."""
    q, k, v, q_pos, k_pos = _case(12, 3, 64, K=2, S=900, lengths=(880, 500), seed=11)
    fn = jax.jit(lambda *a: native.attend_stats_mass(*a[:5], rows=(0, 1, 2, 3), mass_block=16, row_base=a[5]))
    plain = [np.asarray(x) for x in jax.jit(native.attend_stats)(q, k, v, q_pos, k_pos)]
    o, m, l, moved = fn(q, k, v, q_pos, k_pos, jnp.asarray([8, 2], jnp.int32))
    assert all(np.array_equal(np.asarray(a), b) for a, b in zip((o, m, l), plain))
    for b, first in ((0, 8), (1, 2)):  # each sequence's own rows
        want = block_mass_reference(q[b:b + 1, first:first + 4], k[b:b + 1], q_pos[b:b + 1, first:first + 4],
                                    k_pos[b:b + 1], 16)
        np.testing.assert_allclose(np.asarray(moved[b:b + 1]), np.asarray(want), **TOL)
    # rows 8..11 of sequence 0 as two calls: base 10 keeps rows 10, 11 (12, 13 fall past the end); base 6 keeps 8, 9
    whole = np.asarray(moved[0])
    halves = [np.asarray(fn(q, k, v, q_pos, k_pos, jnp.asarray([base, 2], jnp.int32))[3][0]) for base in (10, 6)]
    split_a = block_mass_reference(q[:1, 10:12], k[:1], q_pos[:1, 10:12], k_pos[:1], 16)
    np.testing.assert_allclose(halves[0], np.asarray(split_a)[0], **TOL)
    # base 6: rows 6..9, of which 8, 9 are scoring rows of the whole; take the rows 6, 7 share out by the reference
    rows_67 = np.asarray(block_mass_reference(q[:1, 6:8], k[:1], q_pos[:1, 6:8], k_pos[:1], 16))[0]
    np.testing.assert_allclose(halves[0] + halves[1] - rows_67, whole, rtol=1e-4, atol=1e-5)
    outside = np.asarray(fn(q, k, v, q_pos, k_pos, jnp.asarray([12, -4], jnp.int32))[3])
    assert (outside == 0).all()  # every scoring row outside the call: nothing


@pytest.mark.slow  # compiles the library a second time
def test_scalar_build_equals_the_vector_build(tmp_path):
    handle = scalar_native_library(tmp_path)
    jax.ffi.register_ffi_target("kvjax_attend_mass_scalar_test", jax.ffi.pycapsule(handle.KvjaxAttendMass),
                                platform="cpu")
    q, k, v, q_pos, k_pos = _case(9, 2, 32, S=701, lengths=(698, 350), per_head=True, seed=4)
    B, T, N, D = q.shape
    shapes = (jax.ShapeDtypeStruct((B, T, N, D), jnp.float32), jax.ShapeDtypeStruct((B, T, N), jnp.float32),
              jax.ShapeDtypeStruct((B, T, N), jnp.float32), jax.ShapeDtypeStruct((B, 2, -(-701 // 16)), jnp.float32))
    attrs = dict(window=np.int64(0), scale=np.float32(D**-0.5), block=np.int64(native.default_block(D)),
                 mass_block=np.int64(16), mass_rows=np.asarray([0, 8], np.int64))
    base = jnp.asarray([0, -3], jnp.int32)  # sequence 1's first scoring row falls before the call: skipped
    outs = [[np.asarray(x) for x in jax.ffi.ffi_call(t, shapes)(q, k, v, q_pos, k_pos, base, **attrs)]
            for t in (native.MASS_TARGET, "kvjax_attend_mass_scalar_test")]
    assert all(np.array_equal(a, b) for a, b in zip(*outs))

