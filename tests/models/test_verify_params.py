"""`Model.verify_params`: the verify-shape forwards' layout (Llama on a CPU with the native kernel: the loops' fused
f32 projections packed in 64-column panels, one copy for both) made once, remade when a weight changes, and giving the
plain layout's bits exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.decode import steps
from pallas_kernels.linear import PackedF32, packable, packed_weights_supported, unpack_f32
from tests.builders import toy_model

pytestmark = pytest.mark.skipif(not packed_weights_supported(), reason="packed weights are read natively on CPU only")


def _verify_logits(model, params, T):
    cache = model.family.init_cache(model.config, 1, 64, model.cache_dtype)
    _, cache = steps.prefill(model, cache, np.arange(1, 20, dtype=np.int32))
    tokens = jnp.asarray([[(7 * t + 3) % model.config.vocab_size for t in range(T)]], jnp.int32)
    logits, _, _ = jax.jit(lambda p, c: model.family.verify_forward(p, model.config, c, tokens,
                                                                    jnp.asarray([T], jnp.int32),
                                                                    implementation=model.attention))(params, cache)
    return np.asarray(logits)


def test_verify_params_are_the_loops_packed_copy_kept_remade_and_verify_with_the_plain_layouts_bits():
    model = toy_model()  # hidden 64: every fused projection is a 64-column multiple
    packed = model.verify_params()
    assert packed is model.loop_params()  # one copy for verification and the loops
    layer, plain = packed["layers"][0], model.params["layers"][0]
    assert all(isinstance(layer[k], PackedF32) for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    # an untied head is packed where its width allows (the same bits packed or plain)
    assert isinstance(packed["lm_head"], PackedF32) == packable(model.params["lm_head"])
    assert "wq" in plain and not isinstance(plain["wq"], PackedF32)  # the model's own layout kept
    np.testing.assert_array_equal(np.asarray(unpack_f32(layer["w_gate_up"])),
                                  np.concatenate([np.asarray(plain["w_gate"]), np.asarray(plain["w_up"])], axis=1))
    assert model.verify_params() is packed  # kept
    for T in (1, 2, 5, 9, 33):  # a decode-sized block and the register tiles' rows
        np.testing.assert_array_equal(_verify_logits(model, packed, T), _verify_logits(model, model.params, T))
    model.params["layers"][1]["w_down"] = model.params["layers"][1]["w_down"] * 1.5  # replaced deep in the tree
    again = model.verify_params()
    assert again is not packed
    np.testing.assert_array_equal(np.asarray(unpack_f32(again["layers"][1]["w_down"])),
                                  np.asarray(model.params["layers"][1]["w_down"]))
    np.testing.assert_array_equal(_verify_logits(model, again, 5), _verify_logits(model, model.params, 5))
