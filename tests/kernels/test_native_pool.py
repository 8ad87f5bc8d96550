"""The native kernels' thread pool: the spin window changes only when a worker sleeps, never a result."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="the native library did not build here")


def test_results_do_not_depend_on_the_spin_window_and_a_negative_one_is_refused():
    from pallas_kernels.native.matmul import matmul_bf16

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 576)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((576, 1000)), jnp.bfloat16)
    f = jax.jit(matmul_bf16)
    try:
        outs = []
        for spin in (0, 300, 5000):  # sleeping workers, the default window, a long one
            native.set_spin_us(spin)
            outs.append(np.asarray(f(x, w)))
    finally:
        native.set_spin_us(300)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    with pytest.raises(ValueError, match="spin window"):
        native.set_spin_us(-1)


def test_xla_intra_op_threads_and_the_library_pool_give_the_same_bits():
    """The kernels run on XLA's intra-op threads where the runtime lends them (workers.h), else on the library's pool:
    which threads run a unit never changes its arithmetic (attention with segments, the bf16 product, block masses)."""
    from pallas_kernels.native.block_mass import block_mass
    from pallas_kernels.native.matmul import matmul_bf16

    rng = np.random.default_rng(1)
    B, T, N, K, S, D = 1, 5, 6, 2, 5000, 32  # > 2,048 slots: several key segments merged after the units
    q = jnp.asarray(rng.standard_normal((B, T, N, D)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, K, S, D)), jnp.float32)
    k_pos = jnp.asarray(np.where(np.arange(S) < 4700, np.arange(S), -1)[None], jnp.int32)
    q_pos = jnp.asarray((4695 + np.arange(T))[None], jnp.int32)
    x = jnp.asarray(rng.standard_normal((3, 576)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((576, 1000)), jnp.bfloat16)
    att = jax.jit(lambda *a: native.attend_stats(*a))
    mm = jax.jit(matmul_bf16)
    mass = jax.jit(lambda q, k, qp, kp: block_mass(q, k, qp, kp, block=64))
    try:
        got = {}
        for choice in ("xla", "own"):
            native.set_pool(choice)
            got[choice] = jax.tree.map(np.asarray, (att(q, k, v, q_pos, k_pos), mm(x, w),
                                                    mass(q, k, q_pos, k_pos)))
    finally:
        native.set_pool("xla")
    for a, b in zip(jax.tree.leaves(got["xla"]), jax.tree.leaves(got["own"])):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="pool must be"):
        native.set_pool("gpu")
