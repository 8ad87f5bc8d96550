"""The native CPU kernel (`pallas_kernels/native`): matches the f32 reference on multi-block caches for every row
count the engine uses, each row's result is bit-identical whatever other rows the call holds, the dispatcher picks
it on CPU, and a machine where it cannot build falls back to XLA and says so.

The shared kernel cases (ragged lengths, window edge, fully masked rows, sinks, shared K=V, rings, compressed
entries) run against it in `test_attention.py::TestNative`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import jitted_reference, native_attention_case as _case, scalar_native_library

import pallas_kernels as pk
from pallas_kernels import native
from pallas_kernels import online_softmax as osm
from pallas_kernels import reference as ref

TOL = dict(atol=2e-5, rtol=2e-5)


def _reference(*args, **kw):
    """The f32 reference as one compiled program (op by op, each op compiled a program of its own)."""
    return jitted_reference(ref.attend_reference, *args, **kw)


def _native(q, k, v, q_pos, k_pos, window=None):
    return jitted_reference(pk.attend, q, k, v, q_pos, k_pos, window=window, implementation="native")


@pytest.mark.parametrize("T", [1, 5, 9, 33, 256])
@pytest.mark.parametrize("G", [1, 8])
def test_matches_reference_for_every_row_count(T, G):
    q, k, v, q_pos, k_pos = _case(T, G, lengths=(650, 300) if T < 256 else (690, 400))
    got = _native(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(q, k, v, q_pos, k_pos)), **TOL)


@pytest.mark.parametrize("window", [None, 100, 300])
def test_windows_and_per_head_positions(window):
    q, k, v, q_pos, k_pos = _case(9, 2, per_head=True, seed=3)
    got = _native(q, k, v, q_pos, k_pos, window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(q, k, v, q_pos, k_pos,
                                                                                window=window)), **TOL)


def test_empty_slots_and_fully_masked_rows_are_zero():
    q, k, v, _, k_pos = _case(3, 2)
    q_pos = jnp.asarray([[-1, 0, 700], [5, 6, 7]], jnp.int32)  # a padding query; slot 0 visible; beyond the cache
    k_pos = k_pos.at[1].set(-1)  # sequence 1: an empty cache
    got = np.asarray(_native(q, k, v, q_pos, k_pos))
    np.testing.assert_allclose(got, np.asarray(_reference(q, k, v, q_pos, k_pos)), **TOL)
    assert not got[0, 0].any() and not got[1].any() and np.isfinite(got).all()
    o, m, l = jax.jit(lambda *a: native.attend_stats(*a))(q, k, v, q_pos, k_pos)
    assert not np.asarray(l[1]).any() and (np.asarray(m[1]) == osm.M_INIT).all()


def test_stats_combine_across_parts_with_sinks():
    """Two parts' statistics, one `combine`, `finalize` with sinks == attention over the concatenated cache."""
    q, k, v, q_pos, k_pos = _case(5, 4, seed=5)
    sinks = jnp.linspace(-1.0, 1.0, q.shape[2], dtype=jnp.float32)
    a = pk.attend(q, k[:, :, :400], v[:, :, :400], q_pos, k_pos[:, :400], implementation="native", return_stats=True)
    b = pk.attend(q, k[:, :, 400:], v[:, :, 400:], q_pos, k_pos[:, 400:], implementation="native", return_stats=True)
    got = osm.finalize(*osm.combine(*(jnp.stack(x) for x in zip(a, b))), sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(q, k, v, q_pos, k_pos, sinks=sinks)),
                               **TOL)


@pytest.mark.parametrize("G,window,per_head", [(1, None, False), (8, 200, True)])
def test_a_row_is_bit_identical_alone_or_with_other_rows(G, window, per_head):
    """The exactness contract's property: row t of a 33-row call equals the same row computed alone and in a 5-row
    call, bit for bit (the reduction order of a row does not depend on the other rows)."""
    q, k, v, q_pos, k_pos = _case(33, G, per_head=per_head, seed=9)
    full = np.asarray(_native(q, k, v, q_pos, k_pos, window))
    for t in (0, 4, 17, 32):
        alone = np.asarray(_native(q[:, t:t + 1], k, v, q_pos[:, t:t + 1], k_pos, window))
        assert np.array_equal(alone[:, 0], full[:, t]), t
    five = np.asarray(_native(q[:, 28:], k, v, q_pos[:, 28:], k_pos, window))
    assert np.array_equal(five, full[:, 28:])


def test_dispatcher_picks_native_on_cpu():
    assert native.available(), native.status()
    assert pk.active_cpu_implementation() == "native"
    assert pk.resolve(None) == ("pallas" if jax.default_backend() == "gpu" else "native")
    q, k, v, q_pos, k_pos = _case(1, 2)
    jaxpr = str(jax.make_jaxpr(lambda q: pk.attend(q, k, v, q_pos, k_pos, implementation="native"))(q))
    assert native.TARGET in jaxpr


def test_without_a_compiler_xla_runs_and_says_so(tmp_path):
    """A machine that cannot build the library (here: a compiler that always fails, an empty build cache) resolves
    to "xla" and the status names the failed build; asking for "native" explicitly raises."""
    code = (
        "import json, pallas_kernels as pk\n"
        "from pallas_kernels import native\n"
        "try:\n"
        "    pk.resolve('native'); raised = False\n"
        "except RuntimeError as e:\n"
        "    raised = 'not available' in str(e)\n"
        "print(json.dumps(dict(active=pk.active_cpu_implementation(), status=native.status(), raised=raised)))\n")
    env = dict(os.environ, CXX="false", PATH=str(tmp_path), KVJAX_NATIVE_CACHE=str(tmp_path / "cache"),
               JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout.strip().splitlines()[-1])
    assert rep["active"] == "xla" and not rep["status"]["ok"] and rep["raised"]
    assert "compiler" in rep["status"]["reason"] or "build failed" in rep["status"]["reason"]


def test_gradients_are_the_references():
    """The custom call has no derivative of its own: `jax.grad` through it takes the reference's (training)."""
    q, k, v, q_pos, k_pos = _case(3, 2, S=300, lengths=(280, 100))

    def loss(impl):
        return lambda q, k, v: jnp.sum(pk.attend(q, k, v, q_pos, k_pos, window=64, implementation=impl) ** 2)

    got = jax.grad(loss("native"), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("N,K,D,window", [(8, 4, 32, None), (9, 3, 64, None), (9, 3, 64, 150), (4, 2, 24, 90)])
def test_every_row_alone_equals_the_row_in_a_blocked_call(N, K, D, window):
    """The row-blocked kernel scores up to 16 rows against each key group it loads once; for random inputs every row
    of a 21-row call (more rows per KV head than one chunk, ragged lengths, a window that hides whole blocks from
    some rows, per-head holes) equals that row computed alone, bit for bit. D = 64 with 9 query / 3 KV heads is
    SmolLM2-135M's shape (3 KV heads: the two threads split each head's rows); D = 24 takes the generic path."""
    G = N // K
    q, k, v, q_pos, k_pos = _case(21, G, K=K, D=D, per_head=True, seed=11 + D)
    full = np.asarray(_native(q, k, v, q_pos, k_pos, window))
    np.testing.assert_allclose(full, np.asarray(_reference(q, k, v, q_pos, k_pos, window=window)), **TOL)
    for t in range(q.shape[1]):
        alone = np.asarray(_native(q[:, t:t + 1], k, v, q_pos[:, t:t + 1], k_pos, window))
        assert np.array_equal(alone[:, 0], full[:, t]), t


@pytest.mark.parametrize("T", [1, 9, 33])
def test_smollm2_shape_matches_reference(T):
    """D = 64, 9 query heads over 3 KV heads (SmolLM2-135M), blocks of `default_block(64)` keys, one sequence."""
    q, k, v, q_pos, k_pos = _case(T, 3, K=3, D=64, S=1100, lengths=(1030,), seed=T)
    got = _native(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(q, k, v, q_pos, k_pos)), **TOL)


@pytest.mark.slow  # CI time; every f32 attention on CPU is native now, so tests/decode/test_vericache.py runs it
def test_vericache_equals_reference_with_native_for_every_shape(hf_model_dir, monkeypatch):
    """The exactness contract through the model with the native kernel taking every attention (the dispatch limits
    lifted; on their own the test's small caches would stay on XLA): VeriCache's tokens and logits equal
    `reference_decode`'s bit for bit, adaptive draft lengths (3-, 5- and 9-row verifies) included."""
    from kvjax import generate_vericache, load, reference_decode
    from kvjax.models import attention as attn

    monkeypatch.setattr(attn, "NATIVE_MIN_SLOTS", 0)
    monkeypatch.setattr(attn, "NATIVE_MAX_ROWS", None)
    picked = []
    wins = attn.native_wins
    monkeypatch.setattr(attn, "native_wins", lambda q, k: picked.append(wins(q, k)) or picked[-1])
    jax.clear_caches()  # traces made under the shipped limits must not be reused
    try:
        m = load(hf_model_dir("llama")[1], attention="native")
        prompt = np.random.default_rng(4).integers(0, 97, 64).astype(np.int32)
        ref_ = reference_decode(m, prompt, 24, draft_len=4, max_draft=8, return_logits=True)
        g = generate_vericache(m, prompt, 24, compressor="snapkv", draft_len=4, adaptive=(2, 4, 8),
                               compressor_kw={"obs_window": 8}, ignore_eos=True, return_logits=True)
        np.testing.assert_array_equal(g.tokens, ref_.tokens)
        np.testing.assert_array_equal(g.logits, ref_.logits)
        assert picked and all(picked)  # every traced attention went native
    finally:
        jax.clear_caches()


@pytest.mark.parametrize("D,G", [(16, 1), (24, 1), (64, 3), (128, 1)])
def test_row_results_do_not_depend_on_the_row_count(D, G):
    """Scores come from register tiles of up to 6 rows (fewer at a chunk's end) against a transposed key panel, and
    p.V from tiles of up to 6 rows: every row's arithmetic is one chain per (row, key) and per (row, column), so a
    row alone, in 2, 3 or 17 rows, or among 66 gives the same bits. S = 701 leaves every D's last block ragged
    (n % 8 != 0, its keys padded to 8 inside the kernel); D = 24 is not a multiple of the vector width."""
    T = 66 // G
    q, k, v, q_pos, k_pos = _case(T, G, K=2, D=D, S=701, lengths=(701, 437), per_head=True, seed=D)
    full = np.asarray(_native(q, k, v, q_pos, k_pos))
    np.testing.assert_allclose(full, np.asarray(_reference(q, k, v, q_pos, k_pos)), **TOL)
    for count in (1, 2, 3, 17):
        for t0 in {0, T - count, min(5, T - count)}:
            part = np.asarray(_native(q[:, t0:t0 + count], k, v, q_pos[:, t0:t0 + count], k_pos))
            assert np.array_equal(part, full[:, t0:t0 + count]), (count, t0)


def test_a_windowed_row_is_masked_inside_full_blocks():
    """Rows whose window starts inside a block and rows that see whole blocks share a call: the kernel skips the
    position mask only for a row that sees every key of a fully occupied block; the others stay masked."""
    q, k, v, q_pos, k_pos = _case(12, 2, K=2, D=32, S=1024, lengths=(1024, 1000), seed=21)
    for window in (None, 300, 513):
        got = np.asarray(_native(q, k, v, q_pos, k_pos, window))
        np.testing.assert_allclose(got, np.asarray(_reference(q, k, v, q_pos, k_pos, window=window)),
                                   **TOL)


@pytest.mark.slow  # compiles the library a second time (~15 s)
def test_scalar_build_equals_the_vector_build(tmp_path):
    """The portable build (no -march=native: the scalar path, std::fma and the same exp polynomial) gives the AVX2
    build's bits: ragged blocks, empty slots, a window, D = 24 / 32 / 64, f32 and bf16 keys and values."""
    handle = scalar_native_library(tmp_path)
    jax.ffi.register_ffi_target("kvjax_attend_scalar_test", jax.ffi.pycapsule(handle.KvjaxAttend), platform="cpu")
    shapes = lambda q: (jax.ShapeDtypeStruct(q.shape, jnp.float32),  # noqa: E731
                        jax.ShapeDtypeStruct(q.shape[:3], jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    for kv_dtype in (jnp.float32, jnp.bfloat16):
        for T, G, D, window in [(17, 2, 32, None), (5, 3, 64, 300), (3, 2, 24, None)]:
            q, k, v, q_pos, k_pos = _case(T, G, K=2, D=D, S=701, lengths=(698, 350), per_head=True, seed=D,
                                          kv_dtype=kv_dtype)
            outs = [jax.ffi.ffi_call(target, shapes(q))(q, k, v, q_pos, k_pos, window=np.int64(window or 0),
                                                        scale=np.float32(D**-0.5),
                                                        block=np.int64(native.default_block(D)))
                    for target in (native.TARGET, "kvjax_attend_scalar_test")]
            for a, b in zip(*outs):
                assert np.array_equal(np.asarray(a), np.asarray(b)), (kv_dtype, T, G, D, window)


def test_a_non_positive_scale_is_refused():
    """The kernel takes each block's maximum before scaling it, which holds for a positive scale only: the Python
    entry points refuse anything else with a one-line error, and the custom call itself as a backstop."""
    q, k, v, q_pos, k_pos = _case(3, 2, lengths=(300, 200))
    for scale in (0.0, -0.5):
        with pytest.raises(ValueError, match="scale must be positive"):
            native.attend_stats(q, k, v, q_pos, k_pos, scale=scale)
    shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32),
              jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
    call = jax.ffi.ffi_call(native.TARGET, shapes)
    with pytest.raises(Exception, match="scale must be positive"):
        jax.block_until_ready(call(q, k, v, q_pos, k_pos, window=np.int64(0), scale=np.float32(-1.0),
                                   block=np.int64(native.default_block(q.shape[-1]))))
