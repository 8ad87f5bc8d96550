"""RunMetrics.summary: rounds that compiled stay out of the throughput and of the per-round phase means."""

import pytest

from kvjax.decode.metrics import RunMetrics


def _round(verify_s, compiled=False, accepted=7, refresh_s=0.0):
    return dict(x=8, accepted=accepted, kept=accepted + 1, draft_s=0.004, transfer_s=0.0, verify_s=verify_s,
                refresh_s=refresh_s, compiled=compiled, draft_read_bytes=0, verify_read_bytes=0, h2d_bytes=0)


def test_phase_means_leave_compiling_rounds_out():
    met = RunMetrics(name="vc")
    met.add_round(**_round(0.100, compiled=True, refresh_s=0.050))  # a first round: compiles verify and refresh
    for _ in range(4):
        met.add_round(**_round(0.010, refresh_s=0.002))
    met.emitted = 40
    s = met.summary()
    assert s["compile_rounds"] == 1 and s["timed_rounds"] == 4
    assert s["mean_verify_s"] == pytest.approx(0.010)
    assert s["mean_draft_step_s"] == pytest.approx(0.004)
    assert s["mean_refresh_s"] == pytest.approx(0.002)
    assert s["tokens_per_s"] == pytest.approx(32 / (4 * 0.016))
    assert s["verify_s"] == pytest.approx(0.140)  # totals still count every round


def test_phase_means_over_every_round_when_all_compiled():
    met = RunMetrics(name="vc")
    met.add_round(**_round(0.100, compiled=True))
    met.add_round(**_round(0.050, compiled=True))
    s = met.summary()
    assert s["tokens_per_s"] is None
    assert s["mean_verify_s"] == pytest.approx(0.075)
