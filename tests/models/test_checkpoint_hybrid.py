"""The bundled hybrid checkpoint (DeepSeek-V4-style): loads in kvjax and transformers alike, and is trained."""

import os

import numpy as np
import pytest

import kvjax
from builders import CHECKPOINTS

CKPT = os.path.join(CHECKPOINTS, "kvjax-hybrid-tiny")


@pytest.fixture(scope="module")
def model():
    return kvjax.load(CKPT)


def test_transformers_loads_it_and_agrees(model):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()
    text = "import os\n\n\ndef walk(top):\n    for name in os.listdir(top):\n        path = os.path.join(top, name)\n"
    ids = model.tokenizer.encode(text)
    assert len(ids) > 2 * 4  # spans several CSA compression windows
    ref = hf(torch.tensor([ids])).logits[0].detach().numpy()
    np.testing.assert_allclose(kvjax.logits(model, ids), ref, atol=1e-4)


@pytest.mark.slow  # ~35 s; the hybrid checkpoint's transformers agreement stays in CI (test_transformers_loads_it_and_agrees)
def test_trained_loss_beats_uniform_and_generate_runs(model):
    from kvjax.data import corpus

    prompt = corpus.long_prompts(model.tokenizer, 600, 1)[0]
    lg = kvjax.logits(model, prompt)
    lp = lg - lg.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    nll = -lp[np.arange(599), prompt[1:]].mean()
    assert nll < 6.5, nll  # uniform over 4096 tokens is 8.3 nats
    out = kvjax.generate(model, prompt[:200], max_new_tokens=8, ignore_eos=True)
    assert out.shape == (8,)
    # greedy decode through the cache equals argmax of the full forward on the extended sequence
    full = kvjax.logits(model, np.concatenate([prompt[:200], out[:-1]]))
    np.testing.assert_array_equal(np.argmax(full[199:], axis=-1), out)
