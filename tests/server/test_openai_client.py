"""A real server on 127.0.0.1 talked to with the `openai` client: completions and chat, streamed and not, greedy and
sampled, give the tokens offline `kvjax.generate` / `generate_vericache` give for the same request; VeriCache through
the server equals full-cache decoding; bad input is a 400 naming the field; a full queue is a 429 at once."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

PROMPT = "def add(a, b):\n    return"


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def _streamed(stream):
    ids, text, reasons, usage = [], "", [], None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            ids += c.model_extra.get("token_ids", [])
            text += (c.text if hasattr(c, "text") else (c.delta.content or ""))
            reasons.append(c.finish_reason)
    return ids, text, reasons, usage


@pytest.mark.parametrize("mode", ["vericache", pytest.param("full", marks=pytest.mark.slow)])
def test_outputs_equal_offline(tiny, servers, offline, mode):
    url = servers[mode][0]
    c = _client(url)
    tok = tiny.tokenizer
    ids = tok.encode(PROMPT)
    want = offline(mode, ids, 12)
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].text == tok.decode(want, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    # the same request streamed: the pieces add up to the same tokens, the finish reason comes last, then usage
    s_ids, s_text, reasons, usage = _streamed(c.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert (s_ids, s_text) == (want, r.choices[0].text)
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert usage.completion_tokens == 12
    # chat: the chat template is applied (the prompt is what the tokenizer's template makes of the messages)
    msgs = [{"role": "user", "content": "write a function"}]
    chat_ids = tok.apply_chat_template(msgs, add_generation_prompt=True)
    want_chat = offline(mode, chat_ids, 10)
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    assert r.choices[0].model_extra["token_ids"] == want_chat
    assert r.usage.prompt_tokens == len(chat_ids)
    s_ids, s_text, reasons, _ = _streamed(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10,
                                                                    temperature=0, stream=True))
    assert s_ids == want_chat and s_text == r.choices[0].message.content


@pytest.mark.slow  # a sampling configuration is its own scheduler group: it compiles every step again
@pytest.mark.parametrize("mode", ["vericache", "full"])
def test_sampled_outputs_equal_offline(tiny, servers, offline, mode):
    """Position-keyed noise: the server's tokens are the offline ones for the same seed and filters."""
    ids = tiny.tokenizer.encode(PROMPT)
    r = _client(servers[mode][0]).completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0.9,
                                                     top_p=0.95, seed=11, extra_body=dict(top_k=40))
    want = offline(mode, ids, 10, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    assert r.choices[0].model_extra["token_ids"] == want


@pytest.mark.slow  # starts the full-cache server too
def test_vericache_through_the_server_equals_full_cache(servers, tiny):
    got = {}
    for mode in ("vericache", "full"):
        url = servers[mode][0]
        r = _client(url).completions.create(model="tiny", prompt="import numpy as np\n", max_tokens=16,
                                            temperature=0, extra_body=dict(ignore_eos=True))
        got[mode] = r.choices[0].model_extra["token_ids"]
    assert got["vericache"] == got["full"] and len(got["full"]) == 16


def test_stop_strings_logprobs_and_models(servers, tiny, offline):
    url = servers["vericache"][0]
    c = _client(url)
    ids = tiny.tokenizer.encode(PROMPT)
    full = offline("vericache", ids, 24)
    text = tiny.tokenizer.decode(full, skip_special_tokens=True)
    stop = text.strip()[:3]  # a stop string that occurs in the output
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and stop not in ch.text and text.startswith(ch.text)
    assert ch.model_extra["token_ids"] == full[:len(ch.model_extra["token_ids"])]
    # logprobs: each chosen token's log-probability, as offline `generate(logprobs=True)` reports it
    r = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    g = kvjax_generate_logprobs(tiny, ids, 6)
    np.testing.assert_allclose(r.choices[0].logprobs.token_logprobs, g, atol=2e-3)
    m = c.models.list()
    assert [x.id for x in m.data] == ["tiny"]


def kvjax_generate_logprobs(tiny, ids, n):
    import kvjax

    return np.asarray(kvjax.generate(tiny, ids, n, logprobs=True).logprobs)


@pytest.mark.parametrize("body,status,param", [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps(dict(prompt="x", max_tokens="ten")).encode(), 400, "max_tokens"),
    (json.dumps(dict(prompt="x", max_tokens=0)).encode(), 400, "max_tokens"),
    (json.dumps(dict(prompt="x", max_tokens=10**6)).encode(), 400, "max_tokens"),
    (json.dumps(dict(prompt="x", temperature=7)).encode(), 400, "temperature"),
    (json.dumps(dict(prompt="x", top_p=0)).encode(), 400, "top_p"),
    (json.dumps(dict(prompt="x", n=3)).encode(), 400, "n"),
    (json.dumps(dict(prompt="x", stop=5)).encode(), 400, "stop"),
    (json.dumps(dict(prompt=[1, 2, 99999])).encode(), 400, "prompt"),
    (json.dumps(dict(prompt=list(range(1, 200)))).encode(), 400, "prompt"),  # longer than the context
    (json.dumps(dict(prompt=None)).encode(), 400, "prompt"),
    (json.dumps(dict(prompt="x", model="gpt-9")).encode(), 404, "model"),
    (json.dumps(dict(prompt="x", stream="yes")).encode(), 400, "stream"),
])
def test_bad_input_is_an_openai_error_naming_the_field(servers, body, status, param):
    r = httpx.post(f"{servers['vericache'][0]}/v1/completions", content=body, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if param:
        assert param in err["message"]


def test_chat_messages_checked(servers):
    url = servers["vericache"][0]
    r = httpx.post(f"{url}/v1/chat/completions", json=dict(messages=[{"role": "user", "content": 3}]), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        _client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                             max_tokens=-1)


def test_full_queue_is_429_at_once(servers):
    url, engine, _ = servers["vericache"]
    old = engine.max_queue
    engine.max_queue = 0  # nothing may wait: the next request is refused before any work
    try:
        r = httpx.post(f"{url}/v1/completions", json=dict(prompt="x", max_tokens=4), timeout=30)
    finally:
        engine.max_queue = old
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert httpx.get(f"{url}/health", timeout=30).json()["status"] == "ok"


def test_metrics_prometheus_text(servers):
    url = servers["vericache"][0]
    httpx.post(f"{url}/v1/completions", json=dict(prompt="x = 1", max_tokens=8, temperature=0), timeout=60)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for name in ("kvjax_requests_total", "kvjax_queue_depth", "kvjax_generation_tokens_per_second",
                 "kvjax_time_to_first_token_seconds_bucket", "kvjax_time_per_output_token_seconds_count",
                 "kvjax_accepted_tokens_per_verification_count", "kvjax_prefix_hit_tokens_total",
                 "kvjax_prefix_miss_tokens_total"):
        assert name in text, name
    count = [l for l in text.splitlines() if l.startswith("kvjax_accepted_tokens_per_verification_count")]
    assert int(float(count[0].split()[-1])) > 0


def test_a_failing_request_fails_alone(servers, monkeypatch):
    """An exception inside one request's work is that request's 500; the server keeps serving."""
    url, engine, _ = servers["vericache"]
    real = engine._prefill if engine.prefix_cache is not None else None

    def boom(job):
        if job.req.max_tokens == 11:
            raise RuntimeError("injected fault")
        return real(job)

    monkeypatch.setattr(engine, "_prefill", boom)
    body = dict(prompt=PROMPT, temperature=0, max_tokens=11)
    bad = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert bad.status_code == 500 and "injected fault" in bad.json()["error"]["message"]
    ok = httpx.post(f"{url}/v1/completions", json=dict(body, max_tokens=12), timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 12
