"""`draft.decode_from_draft`: decoding from the lossy draft cache alone (the baseline VeriCache is measured
against): with a draft that drops nothing it decodes what the full cache decodes."""

from __future__ import annotations

import numpy as np

from kvjax import load, reference_decode
from kvjax.decode import draft
from kvjax.decode import vericache as vc


def test_lossless_draft_decodes_like_the_full_cache(hf_model_dir):
    m = load(hf_model_dir("llama")[1])
    prompt = np.random.default_rng(0).integers(0, 97, 48).astype(np.int32)
    full, first = vc.prefill_for(m, prompt, 12, max_draft=4)
    keep_all = m.family.make_compressor("streaming", ratio=1.0)  # a budget of the whole prompt: nothing dropped
    out = draft.decode_from_draft(m, keep_all(m.params, m.config, full, prompt, recent_slots=16), first, 12)
    assert out.shape == (12,) and int(out[0]) == int(first[0])
    ref = reference_decode(m, prompt, 12, draft_len=4)
    np.testing.assert_array_equal(np.asarray(out), ref)

