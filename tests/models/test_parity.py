"""Parity with Hugging Face transformers (PyTorch CPU) for every supported Llama family."""

import json
import os

import numpy as np
import pytest
import torch
import transformers

import kvjax
from builders import HF_FAMILIES
from kvjax.models.llama.cache import init_cache
from kvjax.decode import steps
import jax.numpy as jnp

PROMPT_LEN = 70  # several sliding windows (W = 16) and not a multiple of anything
# set to a path (the README's figures: docs/results/parity_random.json) to record each family's measured max |Δ logit|
PARITY_JSON = os.environ.get("KVJAX_PARITY_JSON")


@pytest.fixture(scope="module")
def measured():
    """Collects {family: max |Δ logit|}; written to $KVJAX_PARITY_JSON after the module when it is set."""
    out = {}
    yield out
    if PARITY_JSON and out:
        recs = [dict(name=n, max_abs_logit_diff=v, prompt_tokens=PROMPT_LEN, config=HF_FAMILIES[n])
                for n, v in sorted(out.items())]
        with open(PARITY_JSON, "w", encoding="utf-8") as f:
            json.dump(dict(meta=dict(reference=f"transformers {transformers.__version__} (PyTorch CPU, f32, eager)",
                                     command="KVJAX_PARITY_JSON=docs/results/parity_random.json python -m pytest "
                                             "tests/models/test_parity.py -k prefill_logits"),
                           records=recs), f, indent=1)


@pytest.mark.parametrize("name", sorted(HF_FAMILIES))
def test_prefill_logits_match_transformers(hf_model_dir, name, measured):
    hf, path = hf_model_dir(name)
    model = kvjax.load(path)
    ids = np.random.RandomState(1).randint(0, model.config.vocab_size, size=PROMPT_LEN)
    ref = hf(torch.tensor(ids[None])).logits[0].detach().numpy()
    got = kvjax.logits(model, ids)
    assert got.shape == ref.shape
    measured[name] = float(np.abs(got - ref).max())
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_generate_matches_transformers(hf_model_dir, name):
    hf, path = hf_model_dir(name)
    model = kvjax.load(path)
    ids = np.random.RandomState(2).randint(0, model.config.vocab_size, size=23)
    ref = hf.generate(torch.tensor(ids[None]), max_new_tokens=32, do_sample=False, min_new_tokens=32)[0, 23:].numpy()
    got = kvjax.generate(model, ids, max_new_tokens=32)
    np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_chunked_prefill_matches_unchunked(hf_model_dir, name):
    _, path = hf_model_dir(name)
    model = kvjax.load(path)
    ids = np.random.RandomState(3).randint(0, model.config.vocab_size, size=PROMPT_LEN)
    full = kvjax.logits(model, ids)  # one 256-token chunk
    last = {}
    for chunk in (7, 16, 33):
        cache = init_cache(model.config, 1, 256)
        lg, _ = steps.prefill(model, cache, ids, chunk=chunk)
        last[chunk] = np.asarray(lg)
        np.testing.assert_allclose(last[chunk], full[-1], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_cached_decode_matches_full_forward(hf_model_dir, name):
    _, path = hf_model_dir(name)
    model = kvjax.load(path)
    ids = np.random.RandomState(4).randint(0, model.config.vocab_size, size=50)
    full = kvjax.logits(model, ids)
    cache = init_cache(model.config, 1, 256)
    _, cache = steps.prefill(model, cache, ids[:10])
    for t in range(10, 50):  # one token at a time, across several window boundaries
        lg, cache = steps.forward_step(model.params, model.config, cache, jnp.asarray([[ids[t]]]),
                                       jnp.asarray([1], jnp.int32), family=model.family, impl=model.attention)
        np.testing.assert_allclose(np.asarray(lg[0, 0]), full[t], atol=1e-5, rtol=0)
