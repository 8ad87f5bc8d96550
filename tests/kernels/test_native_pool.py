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
