"""A warm VeriCache run compiles nothing: a round's tokens are taken on the host, so a new accepted count does not
compile a slice of the device array (~30 ms each, charged to the round's verify and to the adaptive policy's estimate
of it)."""

from __future__ import annotations

import jax
import numpy as np

import kvjax


def test_a_warm_run_compiles_nothing_whatever_counts_its_rounds_accept(toy_model):
    m = toy_model()

    def run(seed, n):
        p = np.random.default_rng(seed).integers(0, 97, 64).astype(np.int32)
        g = kvjax.generate_vericache(m, p, n, compressor="streaming", draft_len=8, ignore_eos=True)
        np.testing.assert_array_equal(g.tokens, kvjax.reference_decode(m, p, n, draft_len=8).tokens)
        return {i for i, c in enumerate(g.stats["accepted_histogram"]) if c}

    warm = run(1, 12)  # a short run: every program compiled, few accepted counts seen
    compiles = []
    listener = lambda event, secs, **kw: compiles.append(event) if "backend_compile" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        counts = set().union(*(run(seed, 40) for seed in (2, 3, 4)))
    finally:
        from jax._src import monitoring  # noqa: PLC0415 - the listener's only way out

        monitoring.unregister_event_duration_listener(listener)
    assert counts - warm, (counts, warm)  # the later runs accept counts the warm one never did ...
    assert compiles == []  # ... and compile nothing for them
