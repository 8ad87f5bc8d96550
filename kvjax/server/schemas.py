"""Request bodies of the OpenAI API, checked field by field into one `GenRequest`; errors as OpenAI error objects.

Every rejection names its field (`param`) in an OpenAI-style error object
`{"error": {"message", "type", "param", "code"}}` — clients and SDKs read `message` and `param` from there.
Fields the server does not act on (`user`, `frequency_penalty` = 0, ...) are accepted when they are of the right
type and leave the output unchanged; a value that would change the output and is not supported is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from kvjax.decode.sampling import Sampling
from kvjax.generation import StopRule

COMPLETIONS, CHAT = "completions", "chat"


class ApiError(Exception):
    """An error answered as an OpenAI error object with HTTP `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class GenRequest:
    """One checked generation request (what the engine runs)."""

    kind: str  # COMPLETIONS or CHAT
    model: str
    prompt: np.ndarray  # i32[P] token ids after chat templating
    max_tokens: int
    sampling: Sampling
    seed: int
    rule: StopRule
    logprobs: bool
    stream: bool
    include_usage: bool
    echo: bool = False


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _bad(param: str, msg: str) -> ApiError:
    return ApiError(400, f"{param}: {msg}", param=param, code="invalid_value")


def _int(body, name, default, lo=None, hi=None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {json.dumps(v)}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _num(body, name, default, lo, hi, lo_open=False):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"must be a number, got {json.dumps(v)}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise _bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _bool(body, name, default=False):
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"must be a boolean, got {json.dumps(v)}")
    return v


def _prompt_ids(body, kind: str, tokenizer, vocab: int) -> np.ndarray:
    if kind == CHAT:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("messages", "must be a non-empty list of {role, content} objects")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}]", "must be an object with a string role")
            c = m.get("content")
            if isinstance(c, list):  # content parts: only text parts
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in c):
                    raise _bad(f"messages[{i}].content", "only text content parts are supported")
                msgs[i] = dict(m, content="".join(p["text"] for p in c))
            elif not isinstance(c, str):
                raise _bad(f"messages[{i}].content", f"must be a string, got {json.dumps(c)}")
        if tokenizer is None or tokenizer.chat_template is None:
            raise _bad("messages", "this model has no chat template: use /v1/completions")
        return np.asarray(tokenizer.apply_chat_template(msgs, add_generation_prompt=True), np.int32)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        if tokenizer is None:
            raise _bad("prompt", "this model has no tokenizer: give token ids")
        ids = tokenizer.encode(p)
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        ids = p
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
        if bad is not None:
            raise _bad("prompt", f"token id {ids[bad]} at index {bad} is outside the vocabulary [0, {vocab})")
    elif isinstance(p, list) and len(p) > 1:
        raise _bad("prompt", "a batch of prompts is not supported: send one prompt per request")
    else:
        raise _bad("prompt", f"must be a string or a list of token ids, got {json.dumps(p)[:80]}")
    if len(ids) == 0:
        raise _bad("prompt", "is empty")
    return np.asarray(ids, np.int32)


def parse_generation(body: dict, kind: str, *, model, served_name: str, context: int, max_tokens_limit: int,
                     ) -> GenRequest:
    """Check an OpenAI completions / chat-completions body against the served model's limits.

    Args:
        body: the decoded JSON object.
        kind: COMPLETIONS or CHAT.
        model: the served `kvjax.Model` (tokenizer, vocabulary, end-of-sequence ids).
        served_name: the model name clients give (`model` must equal it when present).
        context: most tokens a request may hold (prompt + max_tokens).
        max_tokens_limit: largest max_tokens accepted.

    Raises:
        ApiError: 400 naming the field, 404 for an unknown model.
    """
    name = body.get("model", served_name)
    if not isinstance(name, str):
        raise _bad("model", f"must be a string, got {json.dumps(name)}")
    if name != served_name:
        raise ApiError(404, f"model {name!r} is not served here (this server serves {served_name!r})",
                       param="model", code="model_not_found")
    n = _int(body, "n", 1, 1, 128)
    if n != 1:
        raise _bad("n", "only n = 1 is supported: send one request per completion")
    best_of = _int(body, "best_of", 1, 1, 128)
    if best_of != 1:
        raise _bad("best_of", "only best_of = 1 is supported")
    for pen in ("frequency_penalty", "presence_penalty"):
        if _num(body, pen, 0.0, -2.0, 2.0) != 0.0:
            raise _bad(pen, "penalties are not supported (they would change the output); use 0")
    stream = _bool(body, "stream")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise _bad("stream_options", "must be an object")
    include_usage = _bool(so or {}, "include_usage")
    if so is not None and not stream:
        raise _bad("stream_options", "is only allowed with stream = true")
    ids = _prompt_ids(body, kind, model.tokenizer, model.config.vocab_size)
    default_max = 16 if kind == COMPLETIONS else max_tokens_limit  # OpenAI's completions default is 16
    mt_name = "max_completion_tokens" if kind == CHAT and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, mt_name, default_max, 1, max_tokens_limit)
    if ids.size >= context:
        raise _bad("messages" if kind == CHAT else "prompt",
                   f"the prompt has {ids.size} tokens, this server's context is {context}")
    if mt_name not in body or body.get(mt_name) is None:
        max_tokens = min(max_tokens, context - int(ids.size))
    if ids.size + max_tokens > context:
        raise _bad(mt_name, f"prompt ({ids.size} tokens) + {mt_name} ({max_tokens}) exceeds the context {context}")
    temperature = _num(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _num(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", 0, -1, model.config.vocab_size)
    min_p = _num(body, "min_p", 0.0, 0.0, 1.0)
    if min_p >= 1.0:
        raise _bad("min_p", f"must be in [0, 1), got {min_p}")
    seed = _int(body, "seed", 0, -2**31, 2**31 - 1)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise _bad("stop", "must be a non-empty string or a list of at most 16 of them")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and (not isinstance(stop_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
        raise _bad("stop_token_ids", "must be a list of token ids")
    if stop and model.tokenizer is None:
        raise _bad("stop", "stop strings need a model with a tokenizer")
    ignore_eos = _bool(body, "ignore_eos")
    if kind == CHAT:
        logprobs = _bool(body, "logprobs")
        if body.get("top_logprobs") not in (None, 0):
            raise _bad("top_logprobs", "only the chosen token's log-probability is returned: use 0 or omit it")
    else:
        lp = body.get("logprobs")
        if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= 0):
            raise _bad("logprobs", f"only logprobs = 0 (the chosen token's) is supported, got {json.dumps(lp)}")
        logprobs = lp is not None
    if logprobs and stream:
        raise _bad("logprobs", "logprobs are returned with stream = false only")
    echo = _bool(body, "echo") if kind == COMPLETIONS else False
    if echo:
        raise _bad("echo", "echo is not supported")
    rule = StopRule(model.config.eos_token_ids, (stop or []) + list(stop_ids or []), ignore_eos=ignore_eos,
                    tokenizer=model.tokenizer)
    # OpenAI's default temperature is 1; temperature 0 is greedy; top_k <= 0 means no top-k filter
    # (greedy ignores the filters: one sampling key, so greedy requests share one batch)
    sampling = Sampling(temperature=temperature, top_k=max(top_k, 0), top_p=top_p, min_p=min_p) if temperature \
        else Sampling()
    return GenRequest(kind=kind, model=served_name, prompt=ids, max_tokens=max_tokens, sampling=sampling, seed=seed,
                      rule=rule, logprobs=logprobs, stream=stream, include_usage=include_usage)
