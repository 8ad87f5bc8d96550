"""A warm VeriCache run compiles nothing: a round's tokens are taken on the host, so a new accepted count does not
compile a slice of the device array (~30 ms each, charged to the round's verify and to the adaptive policy's estimate
of it)."""

from __future__ import annotations

import jax
import numpy as np

import kvjax


def test_a_warm_run_compiles_nothing_whatever_counts_its_rounds_accept(toy_model):
    m = toy_model()

    def run(seed):
        p = np.random.default_rng(seed).integers(0, 97, 64).astype(np.int32)
        g = kvjax.generate_vericache(m, p, 40, compressor="streaming", draft_len=8, ignore_eos=True)
        np.testing.assert_array_equal(g.tokens, kvjax.reference_decode(m, p, 40, draft_len=8).tokens)
        return {i for i, c in enumerate(g.stats["accepted_histogram"]) if c}

    warm = run(1)
    compiles = []
    listener = lambda event, secs, **kw: compiles.append(event) if "backend_compile" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        p = np.random.default_rng(2).integers(0, 97, 64).astype(np.int32)
        g = kvjax.generate_vericache(m, p, 40, compressor="streaming", draft_len=8, ignore_eos=True)
    finally:
        from jax._src import monitoring  # noqa: PLC0415 - the listener's only way out

        monitoring.unregister_event_duration_listener(listener)
    counts = {i for i, c in enumerate(g.stats["accepted_histogram"]) if c}
    assert counts - warm, (counts, warm)  # the second run accepts counts the first never did ...
    assert compiles == []  # ... and compiles nothing for them
