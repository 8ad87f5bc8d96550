"""Rotary tables: on the CPU a forward computes cos and sin once (not fused into every head's rotation in every
layer), with the values of cos and sin."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from builders import BUNDLED

import kvjax
from kvjax.decode import steps
from kvjax.models.layers import trig_tables


def _trig_fused_into_larger_outputs(hlo: str) -> list:
    """(root, trig shapes) of each compiled computation that computes cos or sin into a larger output: a fusion that
    recomputes them for every element it writes."""
    found = []
    for comp in re.split(r"\n(?=\S)", hlo):  # a computation starts at column 0
        trig = re.findall(r"= (f32\[[^\]]*\])\S* (?:cosine|sine)\(", comp)
        root = re.search(r"ROOT %\S+ = (\S+)", comp)
        if trig and root and any(root.group(1).split("{")[0] != t for t in trig):
            found.append((root.group(1), trig))
    return found


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the conditional that keeps the tables apart is the CPU's")
def test_a_forward_computes_its_rotary_tables_once():
    m = kvjax.load(BUNDLED)
    cache = m.family.init_cache(m.config, 1, 256, m.cache_dtype)
    hlo = steps.forward_step.lower(m.params, m.config, cache, jnp.zeros((1, 9), jnp.int32), jnp.asarray([9], jnp.int32),
                                   family=m.family, impl=m.attention).compile().as_text()
    assert m.config.num_layers > 1
    # one cos per branch of the conditional (both branches are the same computation), not one per layer and projection
    assert len(re.findall(r" cosine\(", hlo)) <= 2
    assert not _trig_fused_into_larger_outputs(hlo)


def test_trig_tables_are_cos_and_sin():
    angles = jnp.asarray(np.random.default_rng(0).uniform(0, 8192, (1, 9, 64)), jnp.float32)
    c, s = jax.jit(lambda a: trig_tables(a, 0.5))(angles)
    exact = np.asarray(angles, np.float64)
    np.testing.assert_allclose(np.asarray(c), 0.5 * np.cos(exact), rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(s), 0.5 * np.sin(exact), rtol=0, atol=2e-6)
    empty = jnp.zeros((1, 0, 64), jnp.float32)  # no rows: no element to branch on
    assert [t.shape for t in jax.jit(lambda a: trig_tables(a, 1.0))(empty)] == [(1, 0, 64), (1, 0, 64)]
