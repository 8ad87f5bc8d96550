"""The public API the way users of transformers / vLLM meet it: sampling with filters, stop rules and finish reasons,
logprobs, ragged batches, streaming, and input that is checked (each case of issue [user-api] "Why")."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest

import kvjax
from kvjax.errors import InputError


@pytest.fixture(scope="module")
def model(hf_model_dir):
    return kvjax.load(hf_model_dir("llama")[1])


@pytest.fixture(scope="module")
def code_model():
    import os

    from builders import CHECKPOINTS

    return kvjax.load(os.path.join(CHECKPOINTS, "kvjax-code-tiny"))


def _ids(n=20, seed=0):
    return np.random.default_rng(seed).integers(0, 97, n).astype(np.int32)


def test_sampling_filters_and_seeds(model):
    ids = _ids()
    greedy = kvjax.generate(model, ids, 24)
    a = kvjax.generate(model, ids, 24, temperature=1.0, seed=1)
    b = kvjax.generate(model, ids, 24, temperature=1.0, seed=1)
    c = kvjax.generate(model, ids, 24, temperature=1.0, seed=2)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c) and not np.array_equal(a, greedy)
    # top_k=1 and a tiny top_p leave only the argmax: greedy whatever the temperature (min_p: tests/decode)
    for kw in (dict(top_k=1), dict(top_p=1e-6)):
        np.testing.assert_array_equal(kvjax.generate(model, ids, 24, temperature=2.0, seed=3, **kw), greedy)


@pytest.mark.parametrize("kw", [pytest.param(dict(temperature=0.9, top_p=0.8), marks=pytest.mark.slow),  # CI time:
                                # top-p exactness also in tests/decode/test_sampling.py
                                dict(temperature=1.2, top_k=5, min_p=0.05)])
def test_vericache_exact_under_every_sampling_filter(model, kw):
    ids = _ids(60, seed=1)
    ref = kvjax.reference_decode(model, ids, 20, draft_len=4, seed=5, **kw)
    g = kvjax.generate_vericache(model, ids, 20, draft_len=4, seed=5, ignore_eos=True, **kw)
    np.testing.assert_array_equal(g.tokens, ref.tokens)
    assert g.finish_reason == "length"


def test_stop_ids_strings_eos_and_finish_reason(code_model):
    m = code_model
    ids = m.tokenizer.encode("def parse(text):\n")
    free = kvjax.generate(m, ids, 40, ignore_eos=True)
    assert free.finish_reason == "length" and len(free) == 40
    at = int(free.tokens[5])
    g = kvjax.generate(m, ids, 40, stop=[at], ignore_eos=True)
    first = int(np.nonzero(free.tokens == at)[0][0])
    assert g.finish_reason == "stop" and len(g) == first + 1 and g.tokens[-1] == at
    # EOS: make the 4th greedy token the model's end-of-sequence id; generation ends there in every mode
    eos = int(free.tokens[3])
    m_eos = dataclasses.replace(m, config=dataclasses.replace(m.config, eos_token_ids=(eos,)))
    n_eos = int(np.nonzero(free.tokens == eos)[0][0]) + 1
    assert len(kvjax.generate(m_eos, ids, 40)) == n_eos
    assert len(kvjax.generate(m_eos, ids, 40, ignore_eos=True)) == 40
    g = kvjax.generate_vericache(m_eos, ids, 40, draft_len=4)
    assert len(g) == n_eos and g.finish_reason == "stop"
    # a stop string: text cut where it begins, tokens end at the token that completed it
    text = free.text
    stop = text[10:13]
    g = kvjax.generate(m, ids, 40, stop=stop, ignore_eos=True)
    assert g.finish_reason == "stop" and g.text == text[: text.index(stop)]
    assert stop in m.tokenizer.decode(g.tokens.tolist()) and stop not in m.tokenizer.decode(g.tokens[:-1].tolist())


def test_logprobs_are_the_model_distribution(model):
    ids = _ids()
    g = kvjax.generate(model, ids, 10, logprobs=True)
    full = kvjax.logits(model, np.concatenate([ids, g.tokens]))
    lp = full - full.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    want = lp[len(ids) - 1 + np.arange(10), g.tokens]
    np.testing.assert_allclose(g.logprobs, want, atol=1e-4)


@pytest.mark.slow  # CI time; ragged batches are exact in tests/scheduling and tests/test_api_result.py
def test_ragged_batches_through_the_schedulers(model):
    prompts = [_ids(20, 1), _ids(7, 2), _ids(45, 3)]
    gens = kvjax.generate(model, prompts, 12)
    assert [g.finish_reason for g in gens] == ["length"] * 3
    for p, g in zip(prompts, gens):
        np.testing.assert_array_equal(g, kvjax.generate(model, p, 12))
    outs = kvjax.generate_vericache(model, prompts, 12, draft_len=4, ignore_eos=True)
    for p, g in zip(prompts, outs):
        np.testing.assert_array_equal(g.tokens, kvjax.reference_decode(model, p, 12, draft_len=4).tokens)
        assert g.finish_reason == "length" and g.prompt_tokens == len(p)
    # a 2-D list is a batch, never flattened into one prompt
    assert len(kvjax.generate(model, [[1, 2, 3], [4, 5, 6]], 4)) == 2


@pytest.mark.parametrize("mode,kw", [("full", {}), ("vericache", dict(draft_len=4))])
def test_streaming_deltas_add_up_to_the_generation(code_model, mode, kw):
    ids = code_model.tokenizer.encode("class Parser:\n    def __init__(self")
    deltas = list(kvjax.stream(code_model, ids, 40, mode=mode, ignore_eos=True, **kw))
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    toks = [t for d in deltas for t in d.token_ids]
    assert len(deltas) >= 2 and len(toks) == 40
    whole = kvjax.generate(code_model, ids, 40, ignore_eos=True)
    assert "".join(d.text for d in deltas) == whole.text
    np.testing.assert_array_equal(toks, whole.tokens)


@pytest.mark.parametrize("bad,needle", [
    ([1, 2, 5000], "token id 5000 at index 2 is outside the vocabulary"),
    ([-1, 3], "token id -1 at index 0"),
    ([3, 2**31 - 1], "token id 2147483647 at index 1"),
    ([1.5, 2.0], "must be integers, got 1.5 at index 0"),
    ([], "is empty"),
    ("def f():", "not text"),
    ([[1, 2], 3], "mixes token ids and sequences"),
])
def test_bad_token_ids_are_refused_by_name(model, bad, needle):
    with pytest.raises(InputError, match=needle):
        kvjax.generate(model, bad, 4)


@pytest.mark.parametrize("kw,needle", [
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(temperature=math.nan), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), "top_p must be in"), (dict(top_p=1.5), "top_p must be in"),
    (dict(top_k=-2), "top_k must be an integer"), (dict(min_p=1.0), "min_p must be in"),
    (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
    (dict(stop=[""]), "stop strings must be non-empty"),
])
def test_bad_numbers_are_refused(model, kw, needle):
    n = kw.pop("max_new_tokens", 4)
    with pytest.raises(InputError, match=needle):
        kvjax.generate(model, [1, 2, 3], n, **kw)


def test_draft_len_range_and_long_prompt_warning(model):
    with pytest.raises(InputError, match="draft_len"):
        kvjax.generate_vericache(model, [1, 2, 3], 4, draft_len=100000)
    m = dataclasses.replace(model, config=dataclasses.replace(model.config, max_position_embeddings=16))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        kvjax.generate(m, _ids(20), 2)
        kvjax.generate(m, _ids(20), 2)
    msgs = [str(x.message) for x in w if "max_position_embeddings" in str(x.message)]
    assert len(msgs) == 1  # warned once


def test_one_default_token_budget():
    import inspect

    from kvjax.cli import generate as cli_generate

    assert inspect.signature(kvjax.generate).parameters["max_new_tokens"].default == kvjax.DEFAULT_MAX_NEW_TOKENS
    assert cli_generate.DEFAULT_MAX_NEW_TOKENS == kvjax.DEFAULT_MAX_NEW_TOKENS
