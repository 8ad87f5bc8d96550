"""The blocked XLA attention equals the one-shot definition, and extra (invisible) blocks leave rows bit-identical."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.models.attention import attend, attend_blocked


def _case(S=4096, L=2500, T=5, K=2, G=4, D=16, seed=0, per_head=False):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (2, T, K * G, D))
    k = jax.random.normal(ks[1], (2, K, S, D))
    v = jax.random.normal(ks[2], (2, K, S, D))
    lengths = jnp.asarray([L, L // 3])
    q_pos = (lengths[:, None] - T + jnp.arange(T)[None]).astype(jnp.int32)
    k_pos = jnp.where(jnp.arange(S)[None] < lengths[:, None], jnp.arange(S)[None], -1).astype(jnp.int32)
    if per_head:  # sparse-style per-head positions with holes
        drop = jax.random.bernoulli(ks[0], 0.3, (2, K, S))
        k_pos = jnp.where(drop, -1, jnp.broadcast_to(k_pos[:, None], (2, K, S)))
    return q, k, v, q_pos, k_pos


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("per_head", [False, True])
def test_blocked_matches_definition(window, per_head):
    q, k, v, qp, kp = _case(per_head=per_head)
    a = attend(q, k, v, qp, kp, window=window)
    b = attend_blocked(q, k, v, qp, kp, window=window, block=512)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6)


def test_row_result_independent_of_blocks_beyond_it():
    """Row 0 of a block whose other rows reach further equals the same row computed alone: bit for bit."""
    q, k, v, qp, kp = _case(T=8, L=3000)
    f = jax.jit(lambda q, qp, kp: attend_blocked(q, k, v, qp, kp, block=512))
    full = f(q, qp, kp)
    # same first row, but the cache (and the other rows) end 600 slots earlier: two fewer blocks visited
    short_kp = jnp.where(kp <= qp[:, :1], kp, -1)
    q2 = q.at[:, 1:].set(0.0)
    qp2 = qp.at[:, 1:].set(qp[:, :1])
    alone = f(q2, qp2, short_kp)
    assert np.array_equal(np.asarray(full[:, 0]), np.asarray(alone[:, 0]))


def test_default_attention_is_one_shot_for_few_rows_and_blocked_for_many():
    """Few query rows (one-token steps, short verifies) attend in one shot, more rows in the blocked loop; both
    equal the definition."""
    from kvjax.models.attention import ONE_SHOT_MAX_ROWS, default_attention

    for T, loops in ((ONE_SHOT_MAX_ROWS, False), (ONE_SHOT_MAX_ROWS + 1, True)):
        q, k, v, qp, kp = _case(T=T)
        jaxpr = str(jax.make_jaxpr(lambda q: default_attention(q, k, v, qp, kp))(q))
        assert ("while" in jaxpr) == loops, T
        np.testing.assert_allclose(np.asarray(default_attention(q, k, v, qp, kp)),
                                   np.asarray(attend(q, k, v, qp, kp)), atol=2e-6)


def test_prefill_sized_queries_take_the_smaller_key_blocks(monkeypatch):
    """Chunk-sized queries (>= PREFILL_ROWS) run the loop over PREFILL_BLOCK-slot blocks, fewer rows over BLOCK."""
    from kvjax.models import attention as attn

    seen = []
    real = attn.attend_blocked
    monkeypatch.setattr(attn, "attend_blocked", lambda *a, block, **kw: seen.append(block) or real(*a, block=block,
                                                                                                   **kw))
    for T in (attn.ONE_SHOT_MAX_ROWS + 1, attn.PREFILL_ROWS):
        q, k, v, qp, kp = _case(T=T, L=3000)
        np.testing.assert_allclose(np.asarray(attn.default_attention(q, k, v, qp, kp)),
                                   np.asarray(attend(q, k, v, qp, kp)), atol=2e-6)
    assert seen == [attn.BLOCK, attn.PREFILL_BLOCK] and attn.PREFILL_BLOCK < attn.BLOCK
