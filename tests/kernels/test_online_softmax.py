"""The online softmax pieces on their own: block updates equal one softmax, `combine` merges split-K partials."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import online_softmax as osm

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")


def _softmax_out(s, vis, v):
    s = np.where(vis, s, -np.inf)
    m = s.max(axis=1, keepdims=True)
    p = np.where(vis, np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
    l = p.sum(axis=1, keepdims=True)
    return np.where(l > 0, p @ v / np.maximum(l, 1e-30), 0.0)


def _run_blocks(s, vis, v, bounds):
    """Online softmax over column blocks [a, b) -> (o, m, l)."""
    state = osm.init_state(s.shape[0], v.shape[1])
    for a, b in bounds:
        state = osm.update(state, jnp.asarray(s[:, a:b]), jnp.asarray(vis[:, a:b]),
                           lambda p, a=a, b=b: osm.dot(p, jnp.asarray(v[a:b])))
    return state


def _case(seed=0, R=5, S=40, Dv=8):
    rng = np.random.default_rng(seed)
    s = rng.normal(size=(R, S)).astype(np.float32) * 4
    v = rng.normal(size=(S, Dv)).astype(np.float32)
    vis = rng.random((R, S)) < 0.6
    vis[1] = False  # a row that sees nothing
    vis[2, 10:] = False  # a row whose later blocks are fully masked
    return s, vis, v


def test_blocked_update_equals_softmax():
    s, vis, v = _case()
    o, m, l = _run_blocks(s, vis, v, [(0, 16), (16, 32), (32, 40)])
    got = np.asarray(osm.finalize(o, m, l))
    np.testing.assert_allclose(got, _softmax_out(s, vis, v), atol=1e-5, rtol=1e-5)
    assert not got[1].any() and np.isfinite(got).all()


@pytest.mark.parametrize("cuts", [[(0, 40)], [(0, 8), (8, 40)], [(0, 13), (13, 14), (14, 30), (30, 40)]])
def test_combine_equals_one_pass(cuts):
    s, vis, v = _case(seed=1)
    one = _run_blocks(s, vis, v, [(0, 16), (16, 32), (32, 40)])
    parts = [_run_blocks(s, vis, v, [c]) for c in cuts]  # each split is its own online pass
    o, m, l = osm.combine(*(jnp.stack([p[i] for p in parts], axis=0) for i in range(3)), axis=0)
    np.testing.assert_allclose(np.asarray(osm.finalize(o, m, l)), np.asarray(osm.finalize(*one)), atol=1e-6,
                               rtol=1e-6)
    np.testing.assert_allclose(np.asarray(l), np.asarray(one[2]) * np.exp(np.asarray(one[1]) - np.asarray(m)),
                               rtol=1e-5)


def test_combine_with_empty_partials_and_other_axis():
    """A split that saw no key (m at its initial value, l = 0) must not change anything, on any axis."""
    s, vis, v = _case(seed=2)
    full = _run_blocks(s, vis, v, [(0, 40)])
    empty = osm.init_state(s.shape[0], v.shape[1])
    o = jnp.stack([empty[0], full[0], empty[0]], axis=1)  # [R, splits, D]
    m = jnp.stack([empty[1], full[1], empty[1]], axis=1)
    l = jnp.stack([empty[2], full[2], empty[2]], axis=1)
    got = osm.finalize(*osm.combine(o, m, l, axis=1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(osm.finalize(*full)), atol=1e-7)
    # all splits empty: zeros, not NaN
    allempty = osm.combine(*(jnp.stack([e, e]) for e in empty), axis=0)
    assert not np.asarray(osm.finalize(*allempty)).any()


def test_finalize_sinks_is_softmax_with_a_dropped_column():
    s, vis, v = _case(seed=3)
    sinks = np.linspace(-2.0, 3.0, s.shape[0]).astype(np.float32)
    o, m, l = _run_blocks(s, vis, v, [(0, 40)])
    got = np.asarray(osm.finalize(o, m, l, jnp.asarray(sinks)))
    s2 = np.concatenate([s, sinks[:, None]], axis=1)
    vis2 = np.concatenate([vis, np.ones((s.shape[0], 1), bool)], axis=1)
    v2 = np.concatenate([v, np.zeros((1, v.shape[1]), np.float32)], axis=0)
    np.testing.assert_allclose(got, _softmax_out(s2, vis2, v2), atol=1e-5, rtol=1e-5)


def test_no_nan_from_extreme_scores():
    """Running max starts at finfo.min and masks are finite: huge negative scores never give -inf - -inf."""
    s = np.full((2, 16), -3e38, np.float32)
    vis = np.ones((2, 16), bool)
    vis[1] = False
    o, m, l = _run_blocks(s, vis, np.ones((16, 4), np.float32), [(0, 8), (8, 16)])
    got = np.asarray(osm.finalize(o, m, l))
    assert np.isfinite(got).all() and not got[1].any()
