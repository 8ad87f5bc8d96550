"""The native kernel reads int8 keys and values with per-slot scales (`kvjax.cache.draft.Int8KV`, a draft's kept
tokens) without a dequantised copy: bit for bit what it gives for the dequantised values stored as f32.

The kernel multiplies each widened code by its slot's scale as it transposes keys and as it loads values for p.V --
one f32 product, the one `Int8KV.dense()` makes -- so native(int8) must equal native(f32 of `dense()`) exactly:
ragged lengths, empty slots, windows, GQA groups, D = 24 / 32 / 64. And the codes are gathered and quantised by
`pallas_kernels.native.gather_int8` exactly as `Int8KV.quantize` of `gather_tokens` makes them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import native_attention_case, scalar_native_library

from kvjax.cache.draft import Int8KV
from kvjax.compress.base import gather_tokens, int8_part
from kvjax.models import attention as attn
from pallas_kernels import native
from pallas_kernels import reference as ref

pytestmark = pytest.mark.skipif(not native.available(), reason="the native kernel does not build here")


def _case(T, G, *, D=32, per_head=False, seed=0, K=2, S=700, lengths=(650, 300)):
    """Kernel 0's inputs with the keys and values as an `Int8KV` (scales spread over two orders of magnitude)."""
    q, k, v, q_pos, k_pos = native_attention_case(T, G, K=K, D=D, S=S, lengths=lengths, per_head=per_head, seed=seed)
    rng = np.random.default_rng(seed + 100)
    spread = jnp.asarray(10.0 ** rng.uniform(-1, 1, size=k.shape[:3] + (1,)), jnp.float32)
    part = Int8KV.quantize(k * spread, v / spread, k_pos)
    return q, part, q_pos


def _int8(q, part, q_pos, window=None):
    return jax.jit(lambda q, p, qp: native.attend_stats_int8(q, p.k, p.v, p.k_scale, p.v_scale, qp, p.pos,
                                                             window=window))(q, part, q_pos)


def _f32(q, part, q_pos, window=None):
    k, v, pos = part.dense()
    return jax.jit(lambda *a: native.attend_stats(*a, window=window))(q, k, v, q_pos, pos)


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert np.array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("T,G,D,window,per_head", [
    (1, 3, 64, None, True),  # a SmolLM2 draft token over its kept slots (per-head positions)
    (1, 2, 32, None, False),  # the tiny model's draft token
    (9, 2, 32, 100, True),  # several rows, a window inside the cache
    (5, 8, 64, None, False),  # GQA group of 8
    (3, 1, 24, None, False),  # D not a multiple of 8 or 16: the scalar tails
])
def test_int8_kv_equals_f32_kv_of_the_dequantised_values(T, G, D, window, per_head):
    q, part, q_pos = _case(T, G, D=D, per_head=per_head, seed=D + T)
    _assert_same(_int8(q, part, q_pos, window), _f32(q, part, q_pos, window))


def test_against_the_reference_and_a_quantisation_error_of_the_codes():
    """Within f32 rounding of the jnp reference over `dense()`; and the codes are what they claim: each dequantised
    value within half a step (scale / 2) of the value quantised, the largest magnitude of a row exact to a step."""
    q, k, v, q_pos, k_pos = native_attention_case(9, 3, D=64, per_head=True, seed=3)
    part = Int8KV.quantize(k, v, k_pos)
    kd, vd, _ = part.dense()
    o, m, l = _int8(q, part, q_pos)
    want = ref.attend_reference(q, kd, vd, q_pos, k_pos, return_stats=True)
    for a, b in zip((o, m, l), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5, rtol=3e-5)
    err = np.abs(np.asarray(kd) - np.asarray(k))
    assert np.all(err <= np.asarray(part.k_scale)[..., None] * 0.5 + 1e-7)
    assert part.k.dtype == part.v.dtype == jnp.int8 and np.abs(np.asarray(part.k, np.int32)).max() == 127


def test_a_zero_row_and_empty_slots():
    """A row of zeros quantises to scale 0, codes 0 (no division by zero); rows nobody can see stay invisible."""
    q, part, q_pos = _case(4, 2, seed=9)
    k = part.k.at[0, 1, 5].set(0)
    part = Int8KV(k=k, v=part.v, k_scale=part.k_scale.at[0, 1, 5].set(0.0), v_scale=part.v_scale, pos=part.pos)
    _assert_same(_int8(q, part, q_pos), _f32(q, part, q_pos))
    z = Int8KV.quantize(jnp.zeros((1, 1, 8, 16)), jnp.zeros((1, 1, 8, 16)), jnp.arange(8)[None])
    assert not np.any(np.asarray(z.k)) and not np.any(np.asarray(z.k_scale)) and np.all(np.isfinite(z.dense()[0]))


def test_the_compiled_call_reads_the_codes_without_an_f32_copy():
    q, part, q_pos = _case(1, 2)
    hlo = jax.jit(lambda q, p, qp: native.attend_stats_int8(q, p.k, p.v, p.k_scale, p.v_scale, qp, p.pos)).lower(
        q, part, q_pos).as_text()
    call = next(line for line in hlo.splitlines() if "custom_call" in line)
    assert call.count("tensor<2x2x700x32xi8>") >= 2 and "stablehlo.convert" not in hlo


def test_bad_inputs_are_refused_with_reasons():
    q, part, q_pos = _case(1, 2)
    with pytest.raises(ValueError, match="int8 codes"):
        native.attend_stats_int8(q, part.k.astype(jnp.float32), part.v, part.k_scale, part.v_scale, q_pos, part.pos)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        native.attend_stats_int8(q, part.k, part.v, part.k_scale[..., :5], part.v_scale, q_pos, part.pos)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        native.attend_stats_int8(q[:, :, :3], part.k, part.v, part.k_scale, part.v_scale, q_pos, part.pos)


def test_the_dispatcher_sends_int8_parts_to_native_and_xla_dequantises(monkeypatch):
    """`attention_parts` (the draft's attention over its parts) takes the native kernel for an `Int8KV` natively,
    and the XLA path attends to `dense()`: both agree with the f32 statistics of the dequantised values (f32 scores:
    the integer ones are `test_native_int8_qscores.py`'s)."""
    monkeypatch.setattr(attn, "INT8_QSCORES", False)
    q, part, q_pos = _case(9, 2, per_head=True, seed=7)
    k, v, pos = part.dense()
    ring = (k[:, :, :64], v[:, :, :64], jnp.full(pos.shape[:1] + (64,), -1, jnp.int32))  # an empty recent ring
    for impl in ("native", "xla"):
        got = jax.jit(lambda q, p, qp: attn.attention_parts(q, [p, ring], qp, implementation=impl))(q, part, q_pos)
        want = attn.attention_parts(q, [(k, v, pos), ring], q_pos, implementation=impl)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    _assert_same(jax.jit(lambda q, p, qp: attn.int8_part_stats(q, p, qp, implementation="native"))(q, part, q_pos),
                 _f32(q, part, q_pos))


@pytest.mark.parametrize("per_head", [True, False])
def test_native_gather_equals_quantising_the_gathered_rows(per_head):
    """`int8_part` (natively: one gather-and-quantise pass) makes `Int8KV.quantize(gather_tokens(...))`'s codes and
    scales bit for bit: empty rows (-1) are codes 0 and scale 0, a zero row too."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(2, 3, 300, 64)) * 10.0 ** rng.uniform(-2, 2, size=(2, 3, 300, 1)), jnp.float32)
    x = x.at[1, 2, 17].set(0.0)
    shape = (2, 3, 96) if per_head else (2, 96)
    pos = np.where(rng.random(shape) < 0.8, rng.integers(0, 300, shape), -1)
    pos[(1, 2, 0) if per_head else (1, 0)] = 17
    pos = jnp.asarray(pos, jnp.int32)
    got = jax.jit(lambda x, p: native.gather_int8(x, p))(x, pos)
    want = Int8KV.quantize(gather_tokens(x, pos), gather_tokens(x, pos), pos)
    assert np.array_equal(np.asarray(got[0]), np.asarray(want.k))
    assert np.array_equal(np.asarray(got[1]), np.asarray(want.k_scale))
    form = type("Form", (), dict(k=x, v=x * 2))()
    part = jax.jit(lambda p: int8_part(form, p))(pos)
    assert isinstance(part, Int8KV) and np.array_equal(np.asarray(part.v), np.asarray(want.v))
    with pytest.raises(ValueError, match="pos must be"):
        native.gather_int8(x, pos[:1])


@pytest.mark.slow  # compiles the library a second time (~15 s; shared with the other scalar-build tests of the run)
def test_scalar_build_equals_the_vector_build_for_int8(tmp_path):
    """The portable build (no -march=native) reads int8 codes and gathers them as the vector build does."""
    handle = scalar_native_library(tmp_path)
    jax.ffi.register_ffi_target("kvjax_attend_int8_scalar", jax.ffi.pycapsule(handle.KvjaxAttendInt8),
                                platform="cpu")
    jax.ffi.register_ffi_target("kvjax_gather_int8_scalar", jax.ffi.pycapsule(handle.KvjaxGatherInt8),
                                platform="cpu")
    for T, G, D, window in [(17, 2, 32, None), (1, 3, 64, 300), (3, 2, 24, None)]:
        q, part, q_pos = _case(T, G, D=D, per_head=True, seed=D, S=701, lengths=(698, 350))
        shapes = (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(q.shape[:3], jnp.float32),
                  jax.ShapeDtypeStruct(q.shape[:3], jnp.float32))
        outs = [jax.ffi.ffi_call(target, shapes)(q, part.k, part.v, part.k_scale, part.v_scale, q_pos, part.pos,
                                                 window=np.int64(window or 0), scale=np.float32(D**-0.5),
                                                 block=np.int64(native.default_block(D)), qscores=np.int64(0))
                for target in (native.INT8_TARGET, "kvjax_attend_int8_scalar")]
        _assert_same(*outs)
        x = part.dense()[0]
        gshapes = (jax.ShapeDtypeStruct(part.k.shape, jnp.int8), jax.ShapeDtypeStruct(part.k.shape[:3], jnp.float32))
        _assert_same(*[jax.ffi.ffi_call(t, gshapes)(x, part.pos)
                       for t in (native.GATHER_INT8_TARGET, "kvjax_gather_int8_scalar")])
