"""Everything kvjax does, on real weights (SmolLM2-135M-Instruct, GGUF Q4_1, fetched by name): VeriCache is
token-for-token `reference_decode` (the exactness contract) on a ~1K-token prompt of held-out code; a chat reply
ends at the GGUF's end-of-turn token; and (slow) every Llama drafter greedy and sampled, offload, both schedulers,
the prefix cache and remote prefix serving, all exact."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("gguf")

import kvjax  # noqa: E402
from kvjax.decode import vericache as vc  # noqa: E402

NAME = "smollm2-135m-instruct"
P, M, X = 1024, 32, 8


@pytest.fixture(scope="module")
def model():
    return kvjax.load(NAME)


@pytest.fixture(scope="module")
def prompt(model):
    from kvjax.data import corpus

    return corpus.long_prompts(model.tokenizer, P, 1, seed=1)[0]


def _tokens(res):
    """generate_vericache's tokens, whether it returns (tokens, stats) or a Generation."""
    return np.asarray(res[0] if isinstance(res, tuple) else res.tokens)


def _vericache(model, prompt, compressor, **kw):
    return _tokens(vc.generate_vericache(model, prompt, M, compressor=compressor, draft_len=X, **kw))


@pytest.mark.slow  # compiles the 30-layer model's draft/verify steps (~50 s); CI keeps the SmolLM2 logits/tokenizer parity and chat
def test_vericache_refresh_equals_reference_decode(model, prompt):
    ref = vc.reference_decode(model, prompt, M, draft_len=X)
    np.testing.assert_array_equal(_vericache(model, prompt, "refresh"), ref)


def test_chat_answers_and_stops_at_end_of_turn(model):
    tok = model.tokenizer
    assert model.config.eos_token_ids == (tok.token_to_id("<|im_end|>"),)  # ChatML: the end of a turn is EOS
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True)
    g = kvjax.generate(model, ids, 64)
    assert g.finish_reason == "stop" and int(g.tokens[-1]) == tok.token_to_id("<|im_end|>")
    assert "Paris" in g.text and "<|im_end|>" not in g.text


@pytest.mark.slow
def test_every_drafter_offload_and_sampling_exact(model, prompt):
    ref = vc.reference_decode(model, prompt, M, draft_len=X)
    for name in model.family.compressors:
        np.testing.assert_array_equal(_vericache(model, prompt, name), ref, err_msg=name)
    np.testing.assert_array_equal(_vericache(model, prompt, "refresh", offload=True), ref, err_msg="offload")
    sampled = vc.reference_decode(model, prompt, M, draft_len=X, temperature=0.8, seed=3)
    for name in ("refresh", "kivi4", "streaming"):
        np.testing.assert_array_equal(_vericache(model, prompt, name, temperature=0.8, seed=3), sampled,
                                      err_msg=f"{name} sampled")


@pytest.mark.slow
def test_stream_and_sampling_equal_generate(model):
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Write a haiku about rivers."}],
                                              add_generation_prompt=True)
    for kw in (dict(), dict(temperature=0.7, top_p=0.9, seed=5)):
        g = kvjax.generate(model, ids, 48, **kw)
        assert "".join(d.text for d in kvjax.stream(model, ids, 48, **kw)) == g.text, kw
        assert g.text.strip()


@pytest.mark.slow
def test_schedulers_exact(model):
    from kvjax.scheduling.full_scheduler import FullCacheScheduler
    from kvjax.scheduling.requests import Request
    from kvjax.scheduling.vericache_scheduler import VeriCacheScheduler
    from kvjax.data import corpus

    prompts = corpus.long_prompts(model.tokenizer, 512, 3, seed=2)
    refs = [vc.reference_decode(model, p, 16, draft_len=X) for p in prompts]
    reqs = lambda: [Request(prompt=p, max_new_tokens=16) for p in prompts]  # noqa: E731
    F = VeriCacheScheduler(model, budget_bytes=1, draft_len=X)._full_bytes(reqs()[0])
    # the default drafter too: on a CPU with VNNI it drafts the batch's rows by integer dot products (int_dot)
    for res in (VeriCacheScheduler(model, budget_bytes=4 * F, draft_len=X, compressor="refresh").run(reqs()),
                VeriCacheScheduler(model, budget_bytes=4 * F, draft_len=X).run(reqs()),
                FullCacheScheduler(model, budget_bytes=int(2.2 * F), draft_len=X).run(reqs())):
        for i, ref in enumerate(refs):
            np.testing.assert_array_equal(res.outputs[i], ref, err_msg=f"{res.name} request {i}")


@pytest.mark.slow
def test_prefix_cache_and_remote_prefix_exact(model, prompt, tmp_path):
    from kvjax.remote import RemoteStore
    from kvjax.remote import draft_first as df

    ref = vc.reference_decode(model, prompt, M, draft_len=X)
    pc = kvjax.PrefixCache(kvjax.forms_for(model.config, model.cache_dtype), store_url=str(tmp_path / "prefix"))
    first = kvjax.generate(model, prompt, M, ignore_eos=True, stop=None)
    from kvjax import api

    _, _, plan0, _ = api.prefill(model, np.asarray(prompt), 2048, prefix_cache=pc)
    _, _, plan1, _ = api.prefill(model, np.asarray(prompt), 2048, prefix_cache=pc)
    assert plan0.boundary == 0 and plan1.boundary >= P - 64, (plan0, plan1)
    assert len(first) == M
    store = RemoteStore(str(tmp_path / "remote"), chunk_bytes=1 << 20)
    # the refreshing drafter (the default), whose draft carries a static RefreshSpec through the manifest's JSON
    df.store_prefix(model, store, prompt, drafts=(("refresh", {}),), max_new_tokens=M, max_draft=X)
    toks, st = df.serve_draft_first(model, store, prompt, M, compressor="refresh", compressor_kw={}, draft_len=X)
    assert st["source"] == "draft-first", st.get("reasons")
    np.testing.assert_array_equal(toks, ref)
