"""Choosing x per round: the cost model estimates per-depth acceptance and phase times and picks the x with the most
predicted tokens per second; adaptive runs stay exact."""

from __future__ import annotations

import numpy as np

import kvjax
from kvjax.decode.draft_length import CostModel, GrowShrink


def _feed(model, rounds, x, accept_prob, draft_token_s, verify_s, rng):
    for _ in range(rounds):
        n = 0
        while n < x and rng.random() < accept_prob:
            n += 1
        model.next(x, n, x * draft_token_s, verify_s)


def test_cost_model_prefers_long_drafts_when_they_are_accepted_and_short_ones_when_not():
    rng = np.random.default_rng(0)
    xs = (2, 4, 8, 16, 32)
    high, low = CostModel(xs), CostModel(xs)
    # verification timed at two lengths, costing the same (a line flat in the rows: long blocks cost no more)
    _feed(high, 20, 8, 0.97, 1e-3, 8e-3, rng)
    _feed(high, 20, 16, 0.97, 1e-3, 8e-3, rng)
    _feed(low, 40, 8, 0.3, 1e-3, 8e-3, rng)
    assert high.next(8, 8, 8e-3, 8e-3) >= 16
    assert low.next(8, 0, 8e-3, 8e-3) <= 4
    a = low.acceptance()
    assert abs(a[0] - 0.3) < 0.1 and a.shape == (32,)


def test_cost_model_ignores_the_compiling_round_and_expected_emitted_is_monotone():
    m = CostModel((2, 4, 8))
    assert m.next(4, 4, 100.0, 100.0) == 4  # first round of x = 4: compile time, not a measurement
    assert m.draft_s == {}
    m.next(4, 4, 4e-3, 5e-3)
    e = [m.expected_emitted(x) for x in (2, 4, 8)]
    assert e == sorted(e) and 1 < e[0] <= 3


def test_grow_shrink_rule():
    g = GrowShrink((2, 4, 8))
    assert g.next(4, 4, 0, 0) == 8 and g.next(4, 1, 0, 0) == 2 and g.next(8, 8, 0, 0) == 8


def test_adaptive_cost_policy_is_exact(hf_model_dir):
    m = kvjax.load(hf_model_dir("llama")[1])
    p = np.random.default_rng(5).integers(0, 97, 64).astype(np.int32)
    ref = kvjax.reference_decode(m, p, 30, draft_len=4, max_draft=8)
    g = kvjax.generate_vericache(m, p, 30, compressor="kivi4", draft_len=4, adaptive=(2, 4, 8),
                                 adaptive_policy="cost", compressor_kw={"residual": 16}, ignore_eos=True)
    np.testing.assert_array_equal(g.tokens, ref.tokens)
    assert set(g.stats["draft_lengths"]) <= {2, 4, 8}


def test_cost_model_leaves_short_drafts_when_every_one_is_accepted_after_an_unlucky_start():
    """Two early rounds of x = 8 rejected at depth 4 must not pin the policy to x = 4 once every draft is accepted:
    depths with few trials follow the pooled acceptance (a per-depth estimate alone never re-tries them)."""
    m = CostModel((2, 4, 8, 16))
    x = m.next(8, 8, 8e-3, 10e-3)  # compiling round
    for _ in range(2):
        x = m.next(8, 4, 8e-3, 10e-3)
    picked = []
    for _ in range(20):
        x = m.next(x, x, x * 1e-3, 10e-3)  # from here on every draft is accepted
        picked.append(x)
    assert picked[-1] >= 8, picked


def test_a_re_selection_is_charged_per_drafted_token_not_to_the_length_that_paid_it():
    """A refreshing draft re-selects every so many drafted tokens: x = 8 pays it every fourth round, x = 16 every
    other one. Charged to the round's fixed part, one costly re-selection in the few x = 16 rounds made x = 16 look
    slow for the rest of a run; charged per drafted token it costs every length alike (x (d + r) + v(x))."""
    m = CostModel((8, 16))
    m.next(8, 8, 8e-3, 0.1)  # compiling rounds
    m.next(16, 16, 16e-3, 0.15)
    m.next(8, 8, 8 * 20e-3, 0.10)
    m.next(16, 16, 16 * 20e-3, 0.15, refresh_s=0.064, refreshed_tokens=32)
    assert m.verify_s == {8: 0.10, 16: 0.15}  # the re-selection did not enter x = 16's verify time
    assert abs(m.refresh_token_s - 0.002) < 1e-12  # 64 ms over 32 drafted tokens
    d, r = m.draft_s[16], m.refresh_token_s
    assert abs(m.predicted_tokens_per_s(16) - m.expected_emitted(16) / (d + 16 * r + 0.15)) < 1e-9
    m.next(16, 16, 16 * 20e-3, 0.15, refresh_s=0.5, refreshed_tokens=0)  # no re-selection counted: no change
    assert abs(m.refresh_token_s - 0.002) < 1e-12


def test_an_untimed_length_costs_more_verification_the_more_rows_it_verifies():
    """A length not timed yet is estimated linear in the block's rows, never at a timed neighbour's cost: with only
    x = 8 timed, x = 16 and 32 cost more (half the time taken as per-row work); with x = 8 and 16 timed, x = 32
    follows their line and x = 4 sits on it below them."""
    m = CostModel((4, 8, 16, 32))
    m.next(8, 8, 8e-3, 1.0)  # compiling round
    m.next(8, 8, 8e-3, 0.090)
    v = {x: m._verify_time(x) for x in (4, 8, 16, 32)}
    assert v[8] == 0.090 and v[4] < v[8] < v[16] < v[32]
    assert abs(v[32] - 0.090 * (0.5 + 0.5 * 33 / 9)) < 1e-12
    m.next(16, 16, 16e-3, 1.0)
    m.next(16, 16, 16e-3, 0.130)
    assert abs(m._verify_time(32) - (0.130 + 16 * 0.040 / 8)) < 1e-12
    assert abs(m._verify_time(4) - (0.090 - 4 * 0.040 / 8)) < 1e-12


def test_a_length_timed_long_ago_is_timed_again_when_it_predicts_almost_as_much():
    """x = 8's verify timed slow in its first round (a busy moment), x = 4 chosen since: once x = 8's estimate is
    `STALE_ROUNDS` old and x = 8 predicts within `RETIME_WITHIN` of x = 4, it runs to be timed again, and its real
    time makes it the choice; a length predicting far less is never re-timed."""
    from kvjax.decode.draft_length import STALE_ROUNDS

    def run(first_v8, real_v8, rounds):
        m = CostModel((4, 8))
        m.next(8, 8, 1.0, 1.0)  # compiling rounds: not measurements
        m.next(4, 4, 1.0, 1.0)
        m.next(4, 4, 4e-3, 10e-3)
        x = m.next(8, 5, 8e-3, first_v8)  # x = 8 timed once, slowly
        picked = []
        for _ in range(rounds):  # every draft accepted from here; x = 4 verifies in 10 ms, x = 8 in real_v8
            x = m.next(x, x, x * 1e-3, 10e-3 if x == 4 else real_v8)
            picked.append(x)
        return picked

    picked = run(17e-3, 11e-3, STALE_ROUNDS + 4)
    assert picked[:STALE_ROUNDS - 2] == [4] * (STALE_ROUNDS - 2) and picked[-1] == 8, picked  # re-timed, then kept
    assert run(40e-3, 11e-3, 3 * STALE_ROUNDS) == [4] * (3 * STALE_ROUNDS)  # far slower: never re-timed


def test_a_length_never_timed_must_predict_a_margin_more_before_it_runs():
    """x = 16, never timed, is run only when it predicts over `EXPLORE_MARGIN` more tokens per second than the timed
    x = 8: its acceptance at depths never tried and its verify time are extrapolations, and near-ties between noisy
    timings sent the README command to x = 16 rounds that accepted less than predicted."""
    import copy

    from kvjax.decode.draft_length import EXPLORE_MARGIN

    outcomes = set()
    for draft_ms in (0.6, 0.8, 1.0, 1.2, 1.4, 1.6, 2.0):
        m = CostModel((8, 16))
        m.next(8, 8, 1.0, 1.0)  # compiling round
        for _ in range(6):
            m.next(8, 8, 8 * draft_ms * 1e-3, 10e-3)  # every draft accepted
        after = copy.deepcopy(m)  # the estimates the last round's decision sees
        after.observe(8, 8, 8 * draft_ms * 1e-3, 10e-3)
        ratio = after.predicted_tokens_per_s(16) / after.predicted_tokens_per_s(8)
        picked = m.next(8, 8, 8 * draft_ms * 1e-3, 10e-3)
        assert picked == (16 if ratio > 1 + EXPLORE_MARGIN else 8), (draft_ms, ratio, picked)
        outcomes.add((picked, ratio > 1))
    assert (8, True) in outcomes and (16, True) in outcomes  # a near-tie stayed, a clear gain moved


def test_a_rounds_draft_phase_is_a_fixed_part_plus_a_part_per_token():
    """Each length's draft phase is its own measured time; an untimed length's lies on the line through the two
    nearest timed ones (intercept: the round's fixed part). Charged per token instead, a round's fixed part made
    x = 8 look dearer than x = 4 while x = 4 was running: here (a fixed part large against the verification, so that
    the bias decides) x = 8, never timed, predicts over `EXPLORE_MARGIN` more tokens per second than x = 4 and is
    tried; with the draft phase as x times x = 4's time per token it would have predicted less than x = 4."""
    from kvjax.decode.draft_length import EXPLORE_MARGIN

    fixed, per_token, verify = 12e-3, 0.25e-3, 4e-3
    m = CostModel((2, 4, 8))
    for x in (2, 4):
        m.next(x, x, 1.0, 1.0)  # compiling rounds
        for _ in range(5):
            m.next(x, x, fixed + per_token * x, verify)  # every draft accepted; verification costs the same
    assert abs(m._draft_time(8) - (fixed + 8 * per_token)) < 1e-12
    assert abs(m._draft_time(4) - (fixed + 4 * per_token)) < 1e-12
    assert m.predicted_tokens_per_s(8) > (1 + EXPLORE_MARGIN) * m.predicted_tokens_per_s(4)
    per_token_only = m.expected_emitted(8) / (8 * (fixed + 4 * per_token) / 4 + verify)
    assert per_token_only < m.predicted_tokens_per_s(4)
    assert m.next(4, 4, fixed + 4 * per_token, verify) == 8
