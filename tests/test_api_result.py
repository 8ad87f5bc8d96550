"""The API keeps its word (issue [api-keeps-its-word]): one result type for every mode, every option honoured or
refused, timings that leave compilation out, the prefix cache as an argument, end-of-turn ids from
generation_config.json."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import warnings

import numpy as np
import pytest

import kvjax
from kvjax.decode import steps
from kvjax.decode.draft_length import usable_lengths
from kvjax.errors import InputError


@pytest.fixture(scope="module")
def code_model():
    from builders import CHECKPOINTS

    return kvjax.load(os.path.join(CHECKPOINTS, "kvjax-code-tiny"))


def _ids(m, text="def parse(text):\n    "):
    return m.tokenizer.encode(text)


def test_vericache_returns_a_generation_with_text_logprobs_and_counters(code_model):
    m, ids = code_model, _ids(code_model)
    g = kvjax.generate_vericache(m, ids, 12, draft_len=4, logprobs=True, ignore_eos=True)
    assert isinstance(g, kvjax.Generation) and g.finish_reason == "length" and len(g) == 12
    assert g.text == m.tokenizer.decode(g.tokens.tolist(), skip_special_tokens=True)  # the text it built, kept
    assert g.prompt_tokens == len(ids) and g.logprobs.shape == (12,)
    for key in ("tokens_per_s", "decode_s", "compile_rounds", "timed_rounds", "verifications",
                "mean_accepted_per_round"):
        assert key in g.stats
    # the logprobs are the exact (full-cache) distribution's: those of the reference decoder's rows, bit for bit ...
    ref = kvjax.reference_decode(m, ids, 12, draft_len=4, return_logits=True)
    np.testing.assert_array_equal(g.tokens, ref.tokens)
    np.testing.assert_array_equal(g.logprobs, np.asarray(steps.token_logprobs(ref.logits, ref.tokens)))
    # ... and those full-cache decoding reports (a different matmul shape: equal to float rounding)
    full = kvjax.generate(m, ids, 12, logprobs=True, ignore_eos=True)
    np.testing.assert_array_equal(full.tokens, g.tokens)
    np.testing.assert_allclose(g.logprobs, full.logprobs, atol=1e-4)
    assert g.logprobs[0] == full.logprobs[0]  # the first token comes from the same prefill row in both


def test_batches_are_lists_of_generations_and_old_unpacking_warns(code_model):
    m = code_model
    prompts = [_ids(m), _ids(m, "import os\n")]
    gens = kvjax.generate_vericache(m, prompts, 6, draft_len=4, ignore_eos=True)
    assert [type(g) for g in gens] == [kvjax.Generation] * 2
    assert [g.prompt_tokens for g in gens] == [len(p) for p in prompts] and all(g.text is not None for g in gens)
    with pytest.warns(DeprecationWarning, match="unpacking a Generation"):
        tokens, stats = kvjax.generate_vericache(m, prompts[0], 6, draft_len=4, ignore_eos=True)
    np.testing.assert_array_equal(tokens, gens[0].tokens)
    with pytest.warns(DeprecationWarning):
        toks, margins = kvjax.reference_decode(m, prompts[0], 6, draft_len=4, return_margins=True)
    assert margins.shape == (6,)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a full-cache Generation iterates its tokens, no warning
        assert list(kvjax.generate(m, prompts[0], 3)) == kvjax.generate(m, prompts[0], 3).tolist()


def test_one_argument_list_and_the_measured_best_default():
    common = set(inspect.signature(kvjax.generate).parameters)
    vc = inspect.signature(kvjax.generate_vericache).parameters
    assert common <= set(vc), common - set(vc)  # prefix_cache, logprobs, stream, warmup, progress included
    assert vc["draft_len"].default is None and vc["adaptive"].default is None  # None: adapt (what the CLI does)
    assert vc["compressor"].default is None  # the family's measured default_compressor
    ref = inspect.signature(kvjax.reference_decode).parameters
    assert ref["max_new_tokens"].default == kvjax.DEFAULT_MAX_NEW_TOKENS


def test_default_adapts_and_compiles_only_usable_lengths(code_model):
    m, ids = code_model, _ids(code_model)
    g = kvjax.generate_vericache(m, ids, 16, ignore_eos=True)
    assert g.stats["draft_length_set"] == [2, 4, 8]  # a 16-token run never compiles x = 16 or 32
    assert g.stats["name"] == f"vericache[{m.family.default_compressor}]"
    assert usable_lengths((2, 4, 8, 16, 32), 128) == (2, 4, 8, 16, 32) and usable_lengths((4, 8), 3) == (4,)
    # accepted per round counts the tokens the run used: never past its draft length or its budget
    g = kvjax.generate_vericache(m, ids, 8, draft_len=16, ignore_eos=True)
    assert g.stats["mean_accepted_per_round"] <= 7


def test_timings_leave_compilation_out(code_model):
    m, ids = code_model, _ids(code_model, "x = 1\n")
    # a recent_slots value no other test uses gives the draft cache a new shape: the first round must compile
    cold = kvjax.generate_vericache(m, ids, 10, draft_len=4, recent_slots=40, ignore_eos=True)
    assert cold.stats["compile_rounds"] >= 1
    assert cold.stats["timed_rounds"] == cold.stats["verifications"] - cold.stats["compile_rounds"]
    warm = kvjax.generate_vericache(m, ids, 10, draft_len=4, recent_slots=40, ignore_eos=True, warmup=True)
    assert warm.stats["compile_rounds"] == 0 and warm.stats["tokens_per_s"] is not None
    full = kvjax.generate(m, ids, 40, ignore_eos=True, warmup=True)
    assert full.stats["compile_rounds"] == 0 and full.stats["tokens_per_s"] is not None


def test_stream_carries_logprobs_and_checks_its_seed(code_model):
    m, ids = code_model, _ids(code_model)
    whole = kvjax.generate(m, ids, 10, logprobs=True, ignore_eos=True)
    for mode, kw in (("full", {}), ("vericache", dict(draft_len=4))):
        deltas = list(kvjax.stream(m, ids, 10, mode=mode, logprobs=True, ignore_eos=True, **kw))
        lps = [x for d in deltas for x in d.logprobs]
        assert [t for d in deltas for t in d.token_ids] == whole.tolist() and len(lps) == 10
        np.testing.assert_allclose(lps, whole.logprobs, atol=1e-4)
    with pytest.raises(InputError, match="seed must be a 32-bit integer"):
        kvjax.stream(m, ids, 4, mode="vericache", seed=2**40)


def test_prefix_cache_is_an_argument(code_model, tmp_path):
    m = code_model
    ids = _ids(m, "def tokenize(source):\n    out = []\n    for line in source.splitlines():\n" * 8)
    pc = kvjax.PrefixCache(kvjax.forms_for(m.config, m.cache_dtype), store_url=str(tmp_path))
    cold = kvjax.generate(m, ids, 6, ignore_eos=True)
    first = kvjax.generate(m, ids, 6, ignore_eos=True, prefix_cache=pc)
    again = kvjax.generate(m, ids, 6, ignore_eos=True, prefix_cache=pc)
    vc = kvjax.generate_vericache(m, ids, 6, draft_len=4, ignore_eos=True, prefix_cache=pc)
    assert first.stats["prefix_hit_tokens"] == 0 and again.stats["prefix_hit_tokens"] > 0
    assert vc.stats["prefix_hit_tokens"] == again.stats["prefix_hit_tokens"]
    for g in (first, again, vc):
        np.testing.assert_array_equal(g.tokens, cold.tokens)
    with pytest.raises(InputError, match="prefix_cache takes one prompt"):
        kvjax.generate(m, [ids, ids], 2, prefix_cache=pc)


def test_generation_config_end_of_turn_ids_stop_the_run(code_model, tmp_path):
    from builders import CHECKPOINTS

    d = tmp_path / "chat"
    shutil.copytree(os.path.join(CHECKPOINTS, "kvjax-code-tiny"), d, ignore=shutil.ignore_patterns("orbax"))
    ids = _ids(code_model)
    free = kvjax.generate(code_model, ids, 12, ignore_eos=True)
    end_of_turn = int(free.tokens[4])
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, end_of_turn]}))
    m = kvjax.load(d)
    assert set(m.config.eos_token_ids) == {0, end_of_turn}
    stop_at = int(np.nonzero(np.isin(free.tokens, [0, end_of_turn]))[0][0]) + 1
    for g in (kvjax.generate(m, ids, 12), kvjax.generate_vericache(m, ids, 12, draft_len=4)):
        assert g.finish_reason == "stop" and len(g) == stop_at
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": "end"}))
    with pytest.raises(InputError, match="eos_token_id must be an integer"):
        kvjax.load(d)


def test_batch_refuses_what_it_cannot_honour(code_model):
    m, ids = code_model, _ids(code_model)
    for kw in (dict(warmup=True), dict(progress=print), dict(recent_slots=64), dict(offload=True)):
        with pytest.raises(InputError, match="takes one prompt, not a batch"):
            kvjax.generate_vericache(m, [ids, ids], 4, **kw)
    with pytest.raises(InputError, match="progress takes one prompt"):
        kvjax.generate(m, [ids, ids], 4, progress=print)
