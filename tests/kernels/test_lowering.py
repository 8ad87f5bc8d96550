"""What interpret mode does not check: CUDA lowering (without a GPU) and out-of-bounds reads (debug run).

- Every kernel is lowered for CUDA on the CPU: Pallas builds the Triton IR at lowering time, so unsupported ops,
  shapes Triton rejects at trace time, or a backend API move fail here, in CI, without a GPU.
- `implementation="pallas_debug"` runs the kernel in the bounds-checking interpreter
  (`pltpu.InterpretParams(out_of_bounds_reads="raise")`): an out-of-bounds ref read raises instead of being clamped.
- Pallas DeprecationWarnings are errors in these tests (API moves show up in CI).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import quant_format as qf

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")

B, T, N, K, D, S = 2, 2, 8, 2, 64, 128


@functools.lru_cache(maxsize=None)
def _inputs():
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.bfloat16)
    q, k, v = f(B, T, N, D), f(B, K, S, D), f(B, K, S, D)
    lengths = jnp.asarray([100, 7], jnp.int32)
    q_pos = lengths[:, None] - T + jnp.arange(T)[None]
    k_pos = jnp.where(jnp.arange(S)[None] < lengths[:, None], jnp.arange(S)[None], -1)
    idx = jnp.asarray(rng.integers(-1, S, size=(B, T, 32)), jnp.int32)
    parts = qf.quantize(k.astype(jnp.float32), v.astype(jnp.float32), bits=2, group=32)
    quant = tuple(parts[n] for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"))
    sinks = jnp.zeros((N,), jnp.float32)
    return dict(q=q, k=k, v=v, lengths=lengths, q_pos=q_pos, k_pos=k_pos, idx=idx, quant=quant, sinks=sinks)


def kernel_calls(x, implementation):
    """(name, thunk-args, fn) for every kernel, the shapes of a small bf16 decode/verify step."""
    impl = dict(implementation=implementation)
    return {
        "attend": (functools.partial(pk.attend, window=64, **impl), (x["q"], x["k"], x["v"], x["q_pos"], x["k_pos"])),
        "decode": (functools.partial(pk.decode_attention, num_splits=4, **impl),
                   (x["q"][:, :1], x["k"], x["v"], x["lengths"])),
        "decode_shared_kv_sinks": (lambda q, k, l, s: pk.decode_attention(q, k, None, l, sinks=s, **impl),
                                   (x["q"][:, :1], x["k"], x["lengths"], x["sinks"])),
        "verify": (functools.partial(pk.verify_attention, **impl), (x["q"], x["k"], x["v"], x["lengths"])),
        "window": (functools.partial(pk.window_attention, window=48, **impl),
                   (x["q"], x["k"][:, :, :64], x["v"][:, :, :64], x["q_pos"], x["lengths"])),
        "compressed": (functools.partial(pk.compressed_attention, ratio=4, **impl),
                       (x["q"], x["k"], None, x["q_pos"] * 4)),
        "sparse": (functools.partial(pk.sparse_attention, **impl), (x["q"], x["k"][:, :1], None, x["idx"])),
        "quantized": (functools.partial(pk.quantized_attention, bits=2, group=32, **impl),
                      (x["q"], *x["quant"], x["k_pos"], x["q_pos"])),
    }


KERNELS = ("attend", "decode", "decode_shared_kv_sinks", "verify", "window", "compressed", "sparse", "quantized")


def test_every_kernel_is_lowered():
    assert tuple(kernel_calls(_inputs(), "pallas")) == KERNELS


@pytest.mark.parametrize("name", KERNELS)  # named, not built: building the inputs at collection compiles
def test_lowers_for_cuda_with_triton(name):
    fn, args = kernel_calls(_inputs(), "pallas")[name]
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    targets = set(re.findall(r"custom_call @([\w$.]+)", text))
    assert "__gpu$xla.gpu.triton" in targets, targets


def test_debug_run_passes_in_bounds_and_matches_interpret():
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.normal(size=(1, 1, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 40, 16)), jnp.float32)  # padded to 64 slots: the pad is read, in bounds
    lengths = jnp.asarray([37], jnp.int32)
    idx = jnp.asarray([[[0, 39, -1, 5, 17, 3]]], jnp.int32)
    for fn, args in ((functools.partial(pk.decode_attention, num_splits=2, block_k=16), (q, k, k, lengths)),
                     (functools.partial(pk.sparse_attention, block_k=16), (q, k, None, idx))):
        debug = fn(*args, implementation="pallas_debug")
        np.testing.assert_array_equal(np.asarray(debug), np.asarray(fn(*args, implementation="pallas_interpret")))


def test_debug_run_raises_on_out_of_bounds_read():
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 1, 2, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 32, 16)), jnp.float32)
    bad = jnp.asarray([[[1, 2, 40, -1]]], jnp.int32)  # entry 40 of 32
    # plain interpret mode clamps the read and returns a plausible-looking answer ...
    assert np.isfinite(np.asarray(pk.sparse_attention(q, k, None, bad, implementation="pallas_interpret"))).all()
    # ... the debug run raises
    with pytest.raises(Exception, match="Out-of-bounds read"):
        jax.block_until_ready(pk.sparse_attention(q, k, None, bad, implementation="pallas_debug"))


def test_pallas_deprecations_are_errors():
    """The deprecated `pl.dot` alias warns; under this module's filter (and pyproject's) that is an error."""
    from jax.experimental import pallas as pl

    with pytest.raises(DeprecationWarning):
        pl.dot  # noqa: B018
