"""The native block masses (`pallas_kernels/native/block_mass.cc`): equal to the jnp definition within f32 rounding
(ragged blocks, empty slots, keys after the query masked, rows that see nothing, GQA groups of 1-3, D = 32 / 64,
1-16 rows, two sequences of different lengths), the same bits on every call and in the portable build, chosen by
`block_mass` on CPU, and the refreshing drafter's VeriCache still equal to `reference_decode` bit for bit with it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import scalar_native_library

from kvjax.models import attention_scores
from kvjax.models.attention_scores import block_mass_reference
from pallas_kernels import native
from pallas_kernels.native.block_mass import block_mass as native_block_mass

TOL = dict(rtol=1e-5, atol=1e-6)

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library does not build here")


def _case(R, G, D, *, K=2, S=700, lengths=(650, 301), per_head=False, seed=0):
    """q [B, R, K * G, D] at the last R positions of each sequence (so the earlier rows cannot see the later keys),
    keys over S slots with `lengths[b]` occupied, the rest empty (-1)."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    q = jnp.asarray(rng.normal(size=(B, R, K * G, D)) * 2.0, jnp.float32)  # * 2: peaked, uneven masses
    k = jnp.asarray(rng.normal(size=(B, K, S, D)), jnp.float32)
    L = np.asarray(lengths)
    q_pos = jnp.asarray(L[:, None] - R + np.arange(R)[None], jnp.int32)
    k_pos = np.where(np.arange(S)[None] < L[:, None], np.arange(S)[None], -1).astype(np.int32)
    if per_head:  # per-head positions with holes (a sparse cache)
        k_pos = np.repeat(k_pos[:, None], K, axis=1)
        k_pos[rng.random(k_pos.shape) < 0.3] = -1
    return q, k, q_pos, jnp.asarray(k_pos)


def _native(q, k, q_pos, k_pos, block):
    return np.asarray(jax.jit(native_block_mass, static_argnums=4)(q, k, q_pos, k_pos, block))


def _reference(q, k, q_pos, k_pos, block):
    return np.asarray(jax.jit(block_mass_reference, static_argnums=4)(q, k, q_pos, k_pos, block))


@pytest.mark.parametrize("R,G,D,block,S", [
    (2, 2, 32, 16, 700),  # the tiny model's refresh: first and last verify rows, GQA 2; 700 = 43.75 blocks
    (16, 2, 32, 16, 700),  # the first selection: obs_window = 16 prompt rows
    (2, 3, 64, 16, 1100),  # SmolLM2's shape: 9 query / 3 KV heads, D = 64
    (1, 1, 32, 7, 500),  # G = 1, a block not a multiple of 8 (nor of the chunk)
    (16, 3, 64, 300, 1000),  # blocks larger than a chunk of keys
    (2, 1, 24, 16, 333),  # D not a multiple of 8: the scalar dot product
    (3, 3, 32, 16, 500),  # 9 rows per head: rows as vector lanes, the second group of 8 with one real row
])
def test_matches_the_reference(R, G, D, block, S):
    q, k, q_pos, k_pos = _case(R, G, D, S=S, lengths=(S - 50, S // 3), seed=R + G + D)
    got = _native(q, k, q_pos, k_pos, block)
    want = _reference(q, k, q_pos, k_pos, block)
    assert got.shape == want.shape == (2, 2, -(-S // block))
    np.testing.assert_allclose(got, want, **TOL)
    # every row is a distribution over the keys it sees: the masses of a head sum to its R * G rows
    np.testing.assert_allclose(got.sum(-1), R * G, rtol=1e-5)
    assert (got[1, :, -(-(S // 3) // block):] == 0).all()  # sequence 1's empty slots carry nothing


@pytest.mark.parametrize("R", [2, 16])
def test_per_head_positions_with_holes(R):
    q, k, q_pos, k_pos = _case(R, 2, 32, per_head=True, seed=5)
    np.testing.assert_allclose(_native(q, k, q_pos, k_pos, 16), _reference(q, k, q_pos, k_pos, 16), **TOL)


def test_rows_that_see_nothing_add_zero_not_nan():
    """Sequence 1's first row sits before every key (q_pos -1); sequence 0's head sees keys 0..9 only. A sequence
    with no occupied slot gives all zeros."""
    q, k, q_pos, k_pos = _case(2, 2, 32, S=300, lengths=(10, 200), seed=7)
    q_pos = q_pos.at[1, 0].set(-1)
    got = _native(q, k, q_pos, k_pos, 16)
    np.testing.assert_allclose(got, _reference(q, k, q_pos, k_pos, 16), **TOL)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[1].sum(-1), 2, rtol=1e-5)  # one of the two rows (x G = 2 heads) sees nothing
    assert (got[0, :, 1:] == 0).all()  # keys 10.. are empty slots
    empty = _native(q, k, q_pos, jnp.full_like(k_pos, -1), 16)
    assert (empty == 0).all()


def test_the_same_bits_on_every_call():
    q, k, q_pos, k_pos = _case(16, 2, 32, S=2000, lengths=(1999, 1200), seed=9)
    a = _native(q, k, q_pos, k_pos, 16)
    b = np.asarray(native_block_mass(q, k, q_pos, k_pos, 16))  # eager, a separate program
    assert np.array_equal(a, b)


@pytest.mark.slow  # a second process (~10 s)
def test_the_same_bits_on_one_thread(tmp_path):
    """Threads split a head's keys by chunks, each chunk's arithmetic fixed: one thread gives the same bits."""
    import os
    import subprocess
    import sys

    q, k, q_pos, k_pos = _case(2, 3, 64, S=9000, lengths=(8999, 5000), seed=11)  # several work units per head
    np.savez(tmp_path / "case.npz", q=q, k=k, q_pos=q_pos, k_pos=k_pos)
    code = ("import sys, numpy as np, jax.numpy as jnp\n"
            "from pallas_kernels.native.block_mass import block_mass\n"
            "a = np.load(sys.argv[1])\n"
            "args = [jnp.asarray(a[n]) for n in ('q', 'k', 'q_pos', 'k_pos')]\n"
            "np.save(sys.argv[2], np.asarray(block_mass(*args, 16)))\n")
    env = dict(os.environ, KVJAX_NATIVE_THREADS="1", JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "case.npz"), str(tmp_path / "one.npy")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert np.array_equal(np.load(tmp_path / "one.npy"), _native(q, k, q_pos, k_pos, 16))


def test_block_mass_takes_the_native_kernel_on_cpu_for_f32(monkeypatch):
    q, k, q_pos, k_pos = _case(2, 2, 32, S=64, lengths=(60, 30))
    trace = lambda q, k: str(jax.make_jaxpr(  # noqa: E731
        lambda q, k: attention_scores.block_mass(q, k, q_pos, k_pos, 16))(q, k))
    assert (native.BLOCK_MASS_TARGET in trace(q, k)) == (jax.default_backend() == "cpu")
    assert native.BLOCK_MASS_TARGET not in trace(q, k.astype(jnp.bfloat16))  # other dtypes: the reference
    named = lambda impl: str(jax.make_jaxpr(  # noqa: E731
        lambda q: attention_scores.block_mass(q, k, q_pos, k_pos, 16, implementation=impl))(q))
    assert native.BLOCK_MASS_TARGET in named("native") and native.BLOCK_MASS_TARGET not in named("xla")
    with pytest.raises(ValueError, match="implementation"):
        named("pallas")
    monkeypatch.setattr(native, "available", lambda: False)  # what KVJAX_NATIVE=0 or a failed build gives
    assert native.BLOCK_MASS_TARGET not in trace(q, k)


def test_bad_shapes_raise_naming_the_problem():
    q, k, q_pos, k_pos = _case(2, 2, 32, S=64, lengths=(60, 30))
    with pytest.raises(ValueError, match="q_pos"):
        native_block_mass(q, k, q_pos[:, :1], k_pos, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        native_block_mass(q[:, :, :3], k, q_pos, k_pos, 16)
    with pytest.raises(ValueError, match="block"):
        native_block_mass(q, k, q_pos, k_pos, 0)


@pytest.mark.slow  # compiles the library a second time
def test_scalar_build_equals_the_vector_build(tmp_path):
    """The portable build (no -march=native: scalar lanes, std::fma, the same exp polynomial) gives the AVX2 build's
    bits, ragged blocks, D = 24 (scalar in both builds) and rows as lanes (9 and 48 rows per head) included."""
    handle = scalar_native_library(tmp_path)
    jax.ffi.register_ffi_target("kvjax_block_mass_scalar_test", jax.ffi.pycapsule(handle.KvjaxBlockMass),
                                platform="cpu")
    for R, G, D, block in [(2, 2, 32, 16), (16, 3, 64, 7), (3, 1, 24, 16), (3, 3, 24, 16)]:
        q, k, q_pos, k_pos = _case(R, G, D, S=701, lengths=(698, 350), per_head=True, seed=D)
        shape = jax.ShapeDtypeStruct((2, 2, -(-701 // block)), jnp.float32)
        outs = [np.asarray(jax.ffi.ffi_call(t, shape)(q, k, q_pos, k_pos, block=np.int64(block),
                                                      scale=np.float32(D**-0.5)))
                for t in (native.BLOCK_MASS_TARGET, "kvjax_block_mass_scalar_test")]
        assert np.array_equal(*outs), (R, G, D, block)


@pytest.mark.parametrize("block,scored", [
    # ~35 s here; tests/compress/test_refresh.py's exactness tests take the native masses on CPU too
    pytest.param(8, {2}, marks=pytest.mark.slow),  # the re-selections score the 2 verify rows' queries themselves
    (16, set()),  # the default block: the verify's own masses (`kvjax_attend_mass`), nothing scored apart
])
def test_refreshing_vericache_equals_the_reference_with_native_masses(hf_model_dir, monkeypatch, block, scored):
    """The masses only choose the draft's blocks: with the native kernels scoring them (the separate `block_mass`
    calls counted: none for the first selection, whose 8 prompt rows' masses come from their attention pass, and the
    re-selections' 2 verify rows unless the verify handed its masses out), the refreshing drafter's tokens and logits
    still equal `reference_decode`'s bit for bit."""
    import kvjax

    calls = []
    real = attention_scores.native_block_mass
    monkeypatch.setattr(attention_scores, "native_block_mass", lambda *a: calls.append(a[0].shape) or real(*a))
    jax.clear_caches()  # traces made before the counter was in place must not be reused
    try:
        m = kvjax.load(hf_model_dir("llama")[1])
        prompt = np.random.default_rng(1).integers(0, 97, 120).astype(np.int32)
        ref = kvjax.reference_decode(m, prompt, 16, draft_len=4, return_logits=True)
        kw = dict(ratio=4.0, block=block, recent_blocks=2, obs_window=8, min_drafts=0)
        g = kvjax.generate_vericache(m, prompt, 16, compressor="refresh", compressor_kw=kw, draft_len=4,
                                     ignore_eos=True, return_logits=True)
        np.testing.assert_array_equal(g.tokens, ref.tokens)
        np.testing.assert_array_equal(g.logits, ref.logits)
        assert g.stats["verifications"] >= 3
        assert {s[1] for s in calls} == scored
    finally:
        jax.clear_caches()
