"""Bug class 1: the weights fingerprint follows the weights' content, even under in-place leaf replacement (an RL
step, a hot reload), and remembers no params object."""

import dataclasses
import gc
import weakref

import jax.numpy as jnp
import numpy as np

from kvjax.prefix.identity import weights_fingerprint
from kvjax.prefix.prefill import model_namespace
from kvjax.remote import prefix_entry as pe


def test_in_place_weight_update_never_serves_the_old_weights_kv(model, make_cache, run, cold, prompt):
    pc = make_cache(model)
    p = prompt(100)
    run(model, pc, p)
    layer = model.params["layers"][0]  # the same params dict keeps living: only one leaf is replaced
    layer["wk"] = layer["wk"] * 1.5
    got, plan = run(model, pc, p)
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)
    assert plan.boundary == 0 and any("semantic.weights" in r for r in plan.reasons()), plan.reasons()
    # the same values in a new object are the same weights: the cache hits again
    layer["wk"] = jnp.array(layer["wk"])
    got, plan = run(model, pc, p)
    assert plan.boundary == 96
    np.testing.assert_allclose(got, cold(model, p), atol=2e-5, rtol=0)


def test_numpy_leaf_mutated_in_place_changes_the_fingerprint(model):
    params = {"w": np.ones((4, 4), np.float32)}
    before = weights_fingerprint(params)
    params["w"][0, 0] = 2.0  # a mutable leaf: no identity-based memo may hide this
    assert weights_fingerprint(params) != before


def test_fingerprinting_keeps_no_params_alive(model, make_cache):
    pc = make_cache(model)
    refs = []
    for step in range(3):
        params = {**model.params, "lm_head": model.params["lm_head"] + float(step + 1)}
        m = dataclasses.replace(model, params=params)
        model_namespace(m, pc)
        pe.prefix_namespace(m)
        refs.append(weakref.ref(params["lm_head"]))
        del m, params
    gc.collect()
    assert [r() is None for r in refs] == [True] * 3, "a fingerprint memo keeps old weights alive"


def test_remote_namespace_follows_in_place_update(model):
    before = pe.prefix_namespace(model)
    model.params["layers"][1]["wv"] = model.params["layers"][1]["wv"] + 1e-3
    after = pe.prefix_namespace(model)
    assert after.hex != before.hex and after.diff(before) == ["semantic.weights"]
