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


def test_a_bf16_checkpoints_projections_pack_as_bf16_panels_and_verify_and_decode_with_the_f32_bits():
    """Weights that are exactly bf16 values (a bf16 checkpoint loaded as f32) are packed at half the bytes; verify
    blocks and decode loops give bit for bit what the f32 panels and the plain layout give."""
    model = toy_model()
    as_bf16 = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32) if a.dtype == jnp.float32 else a  # noqa: E731
    for tree in (model.params, *model.params["layers"]):  # in place: the model's own dicts
        for k, v in tree.items():
            if isinstance(v, jax.Array):
                tree[k] = as_bf16(v)
    packed = model.loop_params()
    layer = packed["layers"][0]
    assert all(layer[k].panels.dtype == jnp.bfloat16 for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    is_packed = lambda a: isinstance(a, PackedF32)  # noqa: E731
    f32 = jax.tree.map(lambda a: PackedF32(a.panels.astype(jnp.float32)) if is_packed(a) else a, packed,
                       is_leaf=is_packed)
    half = sum(a.nbytes for a in jax.tree.leaves(packed, is_leaf=is_packed) if is_packed(a))
    assert 2 * half == sum(a.nbytes for a in jax.tree.leaves(f32, is_leaf=is_packed) if is_packed(a))
    for T in (1, 5, 9):
        want = _verify_logits(model, model.params, T)
        np.testing.assert_array_equal(_verify_logits(model, packed, T), want)
        np.testing.assert_array_equal(_verify_logits(model, f32, T), want)
    cache = model.family.init_cache(model.config, 1, 64, model.cache_dtype)
    _, cache = steps.prefill(model, cache, np.arange(1, 20, dtype=np.int32))
    first, seed = jnp.asarray([3], jnp.int32), jnp.zeros((1,), jnp.int32)
    runs = [np.asarray(steps.decode(p, model.config, jax.tree.map(jnp.copy, cache), first, seed, num_steps=12,
                                    family=model.family, impl=model.attention)[0]) for p in (packed, f32)]
    np.testing.assert_array_equal(runs[0], runs[1])
