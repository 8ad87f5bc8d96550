"""The one-token loops read the Llama projections fused (`fuse_projections`): the same model, fewer matmuls."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.decode import steps
from kvjax.models.llama.layers import fuse_projections


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])  # q/k/v biases; q/k norms
def test_fused_projections_compute_the_same_model(hf_model_dir, name):
    m = kvjax.load(hf_model_dir(name)[1])
    fused = fuse_projections(m.params)
    layer = fused["layers"][0]
    assert "wqkv" in layer and "w_gate_up" in layer and not {"wq", "wk", "wv", "w_gate", "w_up"} & set(layer)
    ids = jnp.asarray(((np.arange(24) * 5) % m.config.vocab_size)[None], jnp.int32)
    outs = []
    for params in (m.params, fused):
        cache = m.family.init_cache(m.config, 1, 64, m.cache_dtype)
        logits, cache = m.family.forward(params, m.config, cache, ids, implementation=m.attention)
        outs.append((np.asarray(logits), [np.asarray(a) for a in jax.tree.leaves(cache)]))
    np.testing.assert_allclose(outs[1][0], outs[0][0], atol=2e-5, rtol=1e-5)
    for a, b in zip(outs[0][1], outs[1][1]):
        np.testing.assert_allclose(b, a, atol=2e-6)


def test_decode_loop_with_fused_projections_emits_the_unfused_tokens(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    assert m.family.loop_params is fuse_projections
    _, cache = steps.prefill(m, m.family.init_cache(m.config, 1, 128, m.cache_dtype),
                             (np.arange(40) * 3) % m.config.vocab_size)
    first, seed = jnp.asarray([5], jnp.int32), jnp.zeros((1,), jnp.int32)
    toks = [np.asarray(steps.decode(m.params, m.config, jax.tree.map(jnp.copy, cache), first, seed, num_steps=24,
                                    family=fam, impl=m.attention)[0])
            for fam in (m.family, dataclasses.replace(m.family, loop_params=None))]
    np.testing.assert_array_equal(toks[0], toks[1])
