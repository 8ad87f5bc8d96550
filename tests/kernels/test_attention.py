"""Every kernel against its f32 reference: one base of shared cases, one subclass per implementation.

Shared cases: ragged lengths (not multiples of the block), the exact window edge (`q - W` hidden, `q - W + 1` seen),
fully masked blocks and rows, GQA groups of 1 and 8, f32 and bf16 with per-dtype tolerances, sinks, shared K=V,
split-K. Shapes are tiny: interpret mode compiles each call's whole grid on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import jitted_reference

import pallas_kernels as pk
from pallas_kernels import online_softmax as osm
from pallas_kernels import quant_format as qf
from pallas_kernels import reference as ref

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")

TOL = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2)}
D = 32
K = 2


def rand(rng, shape, dtype="float32"):
    return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)


def dense_pos(lengths, S):
    s = jnp.arange(S)[None, :]
    return jnp.where(s < jnp.asarray(lengths)[:, None], s, -1).astype(jnp.int32)


def close(got, want, dtype="float32"):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, **TOL[dtype])


class KernelCases:
    """Cases shared by every implementation; subclasses set IMPLEMENTATION."""

    IMPLEMENTATION: str

    def call(self, fn, *args, **kw):
        # jitted: a single compile instead of op-by-op dispatch of the wrapper (most of the CPU time), reused by
        # the calls of the same shapes and settings
        return jitted_reference(fn, *args, implementation=self.IMPLEMENTATION, **kw)

    # -- kernel 0: position-masked attention ------------------------------------------------------------------
    @pytest.mark.parametrize("G,dtype", [(1, "float32"), (8, "float32"), (8, "bfloat16")])
    def test_attend_ragged(self, G, dtype):
        rng = np.random.default_rng(G)
        S, lengths = 48, [37, 5]  # S and lengths off the 16-slot blocks; blocks 1-2 of row 1 fully masked
        q, k, v = rand(rng, (2, 2, K * G, D), dtype), rand(rng, (2, K, S, D), dtype), rand(rng, (2, K, S, D), dtype)
        q_pos = ref.dense_query_positions(jnp.asarray(lengths), 2)
        k_pos = dense_pos(lengths, S)
        got = self.call(pk.attend, q, k, v, q_pos, k_pos, block_k=16)
        close(got, jitted_reference(ref.attend_reference, q, k, v, q_pos, k_pos), dtype)

    def test_attend_per_head_positions_and_window_edge(self):
        rng = np.random.default_rng(7)
        S, W = 64, 8
        q, k, v = rand(rng, (1, 1, 4, D)), rand(rng, (1, K, S, D)), rand(rng, (1, K, S, D))
        q_pos = jnp.asarray([[40]], jnp.int32)
        k_pos = jnp.stack([dense_pos([64], S), dense_pos([36], S)], axis=1)  # [B, K, S]: head 1 holds fewer keys
        out = self.call(pk.attend, q, k, v, q_pos, k_pos, window=W, block_k=16)
        close(out, jitted_reference(ref.attend_reference, q, k, v, q_pos, k_pos, window=W))
        # position 32 = q - W is hidden, 33 = q - W + 1 is seen
        hidden = self.call(pk.attend, q, k.at[:, :, 32].set(9.0), v.at[:, :, 32].set(9.0), q_pos, k_pos, window=W,
                           block_k=16)
        seen = self.call(pk.attend, q, k, v.at[:, :, 33].set(9.0), q_pos, k_pos, window=W, block_k=16)
        np.testing.assert_array_equal(np.asarray(hidden), np.asarray(out))
        assert np.abs(np.asarray(seen) - np.asarray(out)).max() > 1e-3

    def test_attend_fully_masked_rows_are_zero(self):
        rng = np.random.default_rng(3)
        q, k, v = rand(rng, (2, 2, 2, D)), rand(rng, (2, K, 32, D)), rand(rng, (2, K, 32, D))
        q_pos = jnp.asarray([[5, -1], [3, 4]], jnp.int32)  # a padding query; row 1 has an empty cache
        k_pos = jnp.stack([dense_pos([10], 32)[0], jnp.full((32,), -1, jnp.int32)])
        got = self.call(pk.attend, q, k, v, q_pos, k_pos, block_k=16)
        close(got, jitted_reference(ref.attend_reference, q, k, v, q_pos, k_pos))
        assert not np.asarray(got[0, 1]).any() and not np.asarray(got[1]).any()

    # -- kernels 1 and 2: dense decode / verify -----------------------------------------------------------------
    @pytest.mark.parametrize("G,splits,sinks,shared,dtype", [(1, 1, False, False, "float32"),
                                                            (8, 3, True, True, "float32"),
                                                            (8, 2, True, False, "bfloat16")])
    def test_decode(self, G, splits, sinks, shared, dtype):
        rng = np.random.default_rng(11)
        S, lengths = 96, jnp.asarray([77, 1], jnp.int32)
        q, k, v = rand(rng, (2, 1, K * G, D), dtype), rand(rng, (2, K, S, D), dtype), rand(rng, (2, K, S, D), dtype)
        v = None if shared else v
        sk = rand(rng, (K * G,)) if sinks else None
        got = self.call(pk.decode_attention, q, k, v, lengths, sinks=sk, block_k=16, num_splits=splits)
        close(got, jitted_reference(ref.decode_reference, q, k, v, lengths, sinks=sk), dtype)

    def test_decode_window_starts_at_window(self):
        rng = np.random.default_rng(12)
        S, W, lengths = 64, 20, jnp.asarray([61, 9], jnp.int32)
        q, k, v = rand(rng, (2, 1, 4, D)), rand(rng, (2, K, S, D)), rand(rng, (2, K, S, D))
        got = self.call(pk.decode_attention, q, k, v, lengths, window=W, block_k=16, num_splits=1)
        close(got, jitted_reference(ref.decode_reference, q, k, v, lengths, window=W))
        # garbage before the window (NaN!) is never read: the loop starts at the window's block
        poisoned = self.call(pk.decode_attention, q, k.at[0, :, :32].set(jnp.nan), v, lengths, window=W, block_k=16,
                             num_splits=1) if self.IMPLEMENTATION != "xla" else got
        np.testing.assert_array_equal(np.asarray(poisoned[0]), np.asarray(got[0]))

    @pytest.mark.parametrize("G", [8])
    def test_verify_causal_block(self, G):
        rng = np.random.default_rng(13)
        S, lengths, T = 64, jnp.asarray([45, 5], jnp.int32), 5  # x = 4 drafts + 1: row 1's block is its whole cache
        q, k, v = rand(rng, (2, T, K * G, D)), rand(rng, (2, K, S, D)), rand(rng, (2, K, S, D))
        got = self.call(pk.verify_attention, q, k, v, lengths, block_k=16)
        close(got, jitted_reference(ref.decode_reference, q, k, v, lengths))

    def test_split_k_matches_one_pass(self):
        rng = np.random.default_rng(14)
        q, k, v = rand(rng, (1, 1, 4, D)), rand(rng, (1, K, 128, D)), rand(rng, (1, K, 128, D))
        lengths = jnp.asarray([100], jnp.int32)
        one = self.call(pk.decode_attention, q, k, v, lengths, block_k=16, num_splits=1)
        four = self.call(pk.decode_attention, q, k, v, lengths, block_k=16, num_splits=4)
        np.testing.assert_allclose(np.asarray(four), np.asarray(one), atol=1e-6, rtol=1e-6)

    # -- kernel 3: ring buffer ------------------------------------------------------------------------------------
    @pytest.mark.parametrize("G,dtype", [(1, "float32"), (8, "bfloat16")])
    def test_window_ring(self, G, dtype):
        rng = np.random.default_rng(21)
        C, W, T = 16, 12, 3  # C >= W + T - 1: the block's keys were rolled in before attending
        seen = jnp.asarray([50, 9], jnp.int32)  # wrapped several times / not yet full
        q, k, v = rand(rng, (2, T, K * G, D), dtype), rand(rng, (2, K, C, D), dtype), rand(rng, (2, K, C, D), dtype)
        q_pos = seen[:, None] - T + jnp.arange(T)[None, :]
        got = self.call(pk.window_attention, q, k, v, q_pos, seen, window=W, block_k=16)
        close(got, jitted_reference(ref.window_reference, q, k, v, q_pos, seen, window=W), dtype)

    # -- kernel 4: compressed entries -----------------------------------------------------------------------------
    @pytest.mark.parametrize("G,shared,dtype", [(1, False, "float32"), (8, True, "bfloat16")])
    def test_compressed_threshold(self, G, shared, dtype):
        rng = np.random.default_rng(31)
        m, E = 4, 40
        # t = 7 sees entries 0, 1; t = 6 sees entry 0 only; t = 2 sees nothing; t = 150 sees all 38 written ones
        q_pos = jnp.asarray([[6, 7, 2], [150, 151, 148]], jnp.int32)
        q, k, v = rand(rng, (2, 3, K * G, D), dtype), rand(rng, (2, K, E, D), dtype), rand(rng, (2, K, E, D), dtype)
        v = None if shared else v
        sk = rand(rng, (K * G,)) if shared else None
        got = self.call(pk.compressed_attention, q, k, v, q_pos, ratio=m, sinks=sk, block_k=16)
        close(got, jitted_reference(ref.compressed_reference, q, k, v, q_pos, ratio=m, sinks=sk), dtype)
        if sk is None:
            assert not np.asarray(got[0, 2]).any()

    # -- kernel 5: sparse top-k -----------------------------------------------------------------------------------
    @pytest.mark.parametrize("G,shared,dtype", [(1, False, "float32"), (8, True, "bfloat16")])
    def test_sparse(self, G, shared, dtype):
        rng = np.random.default_rng(41)
        E, P = 40, 20
        q, k, v = rand(rng, (2, 3, K * G, D), dtype), rand(rng, (2, K, E, D), dtype), rand(rng, (2, K, E, D), dtype)
        v = None if shared else v
        idx = jnp.asarray(rng.integers(-1, E, size=(2, 3, P)), jnp.int32).at[1, 2].set(-1)  # one query: no pick
        sk = rand(rng, (K * G,)) if shared else None
        got = self.call(pk.sparse_attention, q, k, v, idx, sinks=sk, block_k=16)
        close(got, jitted_reference(ref.sparse_reference, q, k, v, idx, sinks=sk), dtype)
        if sk is None:
            assert not np.asarray(got[1, 2]).any()

    # -- kernel 6: quantized draft cache -------------------------------------------------------------------------
    @pytest.mark.parametrize("bits,G", [(2, 1), (4, 8)])
    def test_quantized(self, bits, G):
        rng = np.random.default_rng(51)
        S, group, Dq = 64, 16, 64  # D * bits / 8 >= 16: the plane tiles stay Triton-sized
        q = rand(rng, (2, 2, K * G, Dq))
        parts = jitted_reference(qf.quantize, rand(rng, (2, K, S, Dq)), rand(rng, (2, K, S, Dq)), bits=bits,
                                 group=group)
        k_pos = dense_pos([50, 20], S)
        q_pos = jnp.asarray([[48, 49], [18, 19]], jnp.int32)
        args = (q, *(parts[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")), k_pos, q_pos)
        got = self.call(pk.quantized_attention, *args, bits=bits, group=group, window=24)
        kd, vd = jitted_reference(qf.dequantize, *args[1:7], bits=bits, group=group)
        close(got, jitted_reference(ref.attend_reference, q, kd, vd, q_pos, k_pos, window=24))

    def test_quantized_plus_dense_part_combine(self):
        """Draft cache = quantized bulk + full-precision recent tokens: two partials, one `combine`, then sinks."""
        rng = np.random.default_rng(52)
        S, R, Dq = 32, 8, 64
        q = rand(rng, (1, 1, 4, Dq))
        parts = jitted_reference(qf.quantize, rand(rng, (1, K, S, Dq)), rand(rng, (1, K, S, Dq)), bits=4,
                                 group=16)
        k_rec, v_rec = rand(rng, (1, K, R, Dq)), rand(rng, (1, K, R, Dq))
        q_pos = jnp.asarray([[S + R - 1]], jnp.int32)
        pos_q, pos_rec = dense_pos([S], S), (S + jnp.arange(R))[None].astype(jnp.int32)
        sinks = rand(rng, (4,))
        qa = self.call(pk.quantized_attention, q, *(parts[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes",
                       "v_scale", "v_zero")), pos_q, q_pos, bits=4, group=16, return_stats=True)
        da = self.call(pk.attend, q, k_rec, v_rec, q_pos, pos_rec, return_stats=True)
        o, m, l = osm.combine(jnp.stack([qa[0], da[0]]), jnp.stack([qa[1], da[1]]), jnp.stack([qa[2], da[2]]))
        got = osm.finalize(o, m, l, sinks)
        kd, vd = jitted_reference(qf.dequantize, *(parts[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes",
                                                                      "v_scale", "v_zero")), bits=4, group=16)
        want = jitted_reference(ref.attend_reference, q, jnp.concatenate([kd, k_rec], 2),
                                jnp.concatenate([vd, v_rec], 2), q_pos, jnp.concatenate([pos_q, pos_rec], 1),
                                sinks=sinks)
        close(got, want)


class TestXla(KernelCases):
    """The XLA path *is* the reference, so only the cases with their own assertions (window edge, zero rows) run;
    pure reference comparisons would compare the reference with itself."""

    IMPLEMENTATION = "xla"
    test_attend_ragged = test_decode = test_verify_causal_block = test_split_k_matches_one_pass = None
    test_window_ring = test_quantized = test_quantized_plus_dense_part_combine = None


class TestPallasInterpret(KernelCases):
    IMPLEMENTATION = "pallas_interpret"


class TestNative(KernelCases):
    """The native CPU kernel (C++ through jax.ffi, built on first use; a failed build fails here, naming why).
    Sparse and quantized kernels have no native form: "native" runs their XLA path, still checked against the
    reference."""

    IMPLEMENTATION = "native"


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU visible to JAX")
class TestPallasGpu(KernelCases):
    IMPLEMENTATION = "pallas"


def test_decode_step_compiles_once_and_mixed_dtypes():
    """Lengths are arrays: a decode step at any length reuses one compilation. f32 queries over a bf16 cache work."""
    rng = np.random.default_rng(81)
    q, k = rand(rng, (1, 1, 4, D)), rand(rng, (1, K, 64, D), "bfloat16")
    step = jax.jit(functools.partial(pk.decode_attention, implementation="pallas_interpret", block_k=16,
                                     num_splits=2))
    for n in (3, 40, 64):
        lengths = jnp.asarray([n], jnp.int32)
        close(step(q, k, k, lengths), ref.decode_reference(q, k, k, lengths), "bfloat16")  # p rounded to bf16
    assert step._cache_size() == 1


# -- the references themselves -------------------------------------------------------------------------------------
def test_attend_reference_is_kvjax_attend():
    from kvjax.models.attention import attend

    rng = np.random.default_rng(61)
    q, k, v = rand(rng, (2, 3, 8, D)), rand(rng, (2, K, 40, D)), rand(rng, (2, K, 40, D))
    q_pos = jnp.asarray([[10, 11, 12], [30, 31, -1]], jnp.int32)
    k_pos = dense_pos([13, 32], 40)
    for window in (None, 5):
        close(ref.attend_reference(q, k, v, q_pos, k_pos, window=window), attend(q, k, v, q_pos, k_pos, window=window))


def test_ring_positions_match_swa_window():
    from kvjax.cache.dense import WindowKV

    seen = jnp.asarray([0, 5, 16, 37], jnp.int32)
    ring = WindowKV(k=jnp.zeros((4, 1, 16, 2)), v=jnp.zeros((4, 1, 16, 2)), seen=seen, window=16)
    np.testing.assert_array_equal(np.asarray(ref.ring_positions(seen, 16)), np.asarray(ring.slot_positions()))


def test_quant_format_matches_draft_cache():
    """The kernel's reading of the format equals the VeriCache engineer's QuantizedKV (same spec, two writers)."""
    from kvjax.cache.draft import QuantizedKV

    rng = np.random.default_rng(71)
    k, v = rand(rng, (1, 2, 64, 16)), rand(rng, (1, 2, 64, 16))
    pos = dense_pos([64], 64)
    for bits in (2, 4):
        mine = qf.quantize(k, v, bits=bits, group=32)
        theirs = QuantizedKV.quantize(k, v, pos, bits=bits, group=32)
        for name, arr in mine.items():
            np.testing.assert_array_equal(np.asarray(getattr(theirs, name)), np.asarray(arr), err_msg=name)
        kd, vd = qf.dequantize(**mine, bits=bits, group=32)
        tk, tv, _ = theirs.dense()
        np.testing.assert_allclose(np.asarray(kd), np.asarray(tk), atol=1e-6)
        np.testing.assert_allclose(np.asarray(vd), np.asarray(tv), atol=1e-6)
        assert np.abs(np.asarray(kd) - np.asarray(k)).max() <= 1.1 * float(jnp.max(mine["k_scale"])) / 2 + 1e-6
