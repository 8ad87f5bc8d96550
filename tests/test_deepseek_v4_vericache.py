"""VeriCache on DeepSeek-V4: drafts from a lossy copy (compressed entries and indexer keys dropped / quantized), the
full hybrid state verifies; the output equals full-cache greedy decoding."""

from __future__ import annotations

import numpy as np
import pytest
from test_deepseek_v4_models import make_v4

import kvjax
from kvjax.models.deepseek_v4.draft import DraftSpec, generate_vericache

PROMPT, NEW = 30, 20  # 30 tokens: 7 CSA entries and 3 HCA entries per layer before decoding starts


@pytest.fixture(scope="module")
def model():
    return kvjax.load(make_v4("hybrid")[1])


def greedy_reference(model, ids, n):
    """Full-forward greedy chain (one padded 64-token chunk per step: no extra compile)."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(kvjax.logits(model, np.asarray(seq, np.int32))[-1])))
    return np.asarray(seq[len(ids):], np.int32)


def test_lossy_draft_output_equals_full_cache_decoding(model):
    ids = np.random.RandomState(11).randint(0, model.config.vocab_size, size=PROMPT)
    ref = greedy_reference(model, ids, NEW)
    # drop all but the newest entry of every compressed form and quantize what is left to 2 bits
    spec = DraftSpec(keep_sink=0, keep_recent=1, drop=True, bits=2)
    out, stats = generate_vericache(model, ids, NEW, x=4, spec=spec)
    np.testing.assert_array_equal(out, ref)
    assert stats["draft_bytes"] < stats["full_bytes"] / 4
    assert stats["acceptance"] < 1.0  # the draft really was lossy: some drafts were rejected and replaced
    # an exact draft copy is accepted throughout
    out2, stats2 = generate_vericache(model, ids, NEW, x=4, spec=DraftSpec(drop=False, bits=0))
    np.testing.assert_array_equal(out2, ref)
    assert stats2["acceptance"] == 1.0
