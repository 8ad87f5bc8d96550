"""`Model.loop_params`: the one-token loops' layout made once, remade when a weight changes, decoding exactly as the
plain layout does."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax.decode import steps
from pallas_kernels.linear import PackedF32, packed_weights_supported, unpack_f32
from tests.builders import toy_model


def _decode(model, params, prompt):
    cache = model.family.init_cache(model.config, 1, 64, model.cache_dtype)
    logits, cache = steps.prefill(model, cache, prompt)
    first = jnp.argmax(logits).astype(jnp.int32)[None]
    out, _ = steps.decode(params, model.config, cache, first, jnp.zeros((1,), jnp.int32), num_steps=6,
                          family=model.family, impl=model.attention)
    return np.asarray(out)


def test_loop_params_are_kept_remade_on_a_changed_weight_and_decode_like_the_plain_layout():
    model = toy_model()
    fused = model.loop_params()
    assert "wqkv" in fused["layers"][0] and "wq" in model.params["layers"][0]  # the model's own layout is untouched
    assert isinstance(fused["layers"][0]["w_gate_up"], PackedF32) == packed_weights_supported()
    assert model.loop_params() is fused  # kept
    prompt = np.arange(1, 12, dtype=np.int32)
    np.testing.assert_array_equal(_decode(model, fused, prompt), _decode(model, model.params, prompt))
    # a weight replaced deep in the tree (as tests and fine-tuning loops do): the kept layout must not be reused
    model.params["layers"][0]["wk"] = model.params["layers"][0]["wk"] * 1.5
    again = model.loop_params()
    assert again is not fused
    wqkv = again["layers"][0]["wqkv"]  # packed in 64-column panels where the native products read them
    wqkv = unpack_f32(wqkv) if isinstance(wqkv, PackedF32) else wqkv
    np.testing.assert_array_equal(np.asarray(wqkv[:, model.config.num_heads * model.config.head_dim:][:, :8]),
                                  np.asarray(model.params["layers"][0]["wk"][:, :8]))
    np.testing.assert_array_equal(_decode(model, again, prompt), _decode(model, model.params, prompt))
