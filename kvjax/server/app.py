"""The OpenAI-compatible HTTP layer (Starlette): routes, authentication, response and stream formats.

No scheduling here: a request is checked (`schemas`), handed to the `Engine` as a `Job`, and its deltas are written
out as they arrive — one JSON body, or server-sent events (`data: {...}` per chunk, `data: [DONE]` after a
complete response only; a request cut off by an error or a shutdown ends with an error event and no [DONE]).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvjax.server.engine import Engine, Job
from kvjax.server.metrics import ServerMetrics
from kvjax.server.schemas import CHAT, COMPLETIONS, ApiError, parse_generation, parse_json

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


def create_app(engine: Engine, metrics: ServerMetrics, *, served_name: str, api_keys: dict | None = None,
               on_shutdown=None) -> Starlette:
    """The ASGI app serving `engine`'s model under `served_name`.

    Args:
        api_keys: bearer token -> tenant; None or empty = no authentication, one tenant.
        on_shutdown: called when the server stops (after uvicorn's graceful wait).
    """
    created = int(time.time())

    def tenant_of(request: Request) -> str:
        if not api_keys:
            return ""
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        if key not in api_keys:
            raise ApiError(401, "missing or unknown API key (Authorization: Bearer KEY)", code="invalid_api_key")
        return api_keys[key]

    async def generation(request: Request, kind: str) -> Response:
        endpoint = f"/v1/{'chat/' if kind == CHAT else ''}completions"
        try:
            tenant = tenant_of(request)
            req = parse_generation(parse_json(await request.body()), kind, model=engine.model,
                                   served_name=served_name, context=engine.context,
                                   max_tokens_limit=engine.max_tokens_limit)
            loop = asyncio.get_running_loop()
            q: asyncio.Queue = asyncio.Queue()
            job = Job(req, lambda k, v: loop.call_soon_threadsafe(q.put_nowait, (k, v)), tenant=tenant)
            engine.submit(job)
        except ApiError as e:
            metrics.request(endpoint, e.status)
            return JSONResponse(e.body(), status_code=e.status)
        rid = f"{'chatcmpl' if kind == CHAT else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            metrics.request(endpoint, 200)
            return StreamingResponse(_sse(engine, job, q, req, rid, kind, created), media_type="text/event-stream")
        return await _whole(request, engine, job, q, req, rid, kind, created, metrics, endpoint)

    async def completions(request: Request) -> Response:
        return await generation(request, COMPLETIONS)

    async def chat(request: Request) -> Response:
        return await generation(request, CHAT)

    async def models(request: Request) -> Response:
        try:
            tenant_of(request)
        except ApiError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse({"object": "list", "data": [
            {"id": served_name, "object": "model", "created": created, "owned_by": "kvjax",
             "max_model_len": engine.context}]})

    async def health(request: Request) -> Response:
        ok = engine.thread.is_alive() and engine.accepting
        return JSONResponse({"status": "ok" if ok else "unavailable", "mode": engine.mode,
                             "running": engine.running, "queued": max(engine.unfinished - engine.running, 0)},
                            status_code=200 if ok else 503)

    async def prometheus(request: Request) -> Response:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", prometheus, methods=["GET"])]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        if on_shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

    return Starlette(routes=routes, lifespan=lifespan)


def _usage(final: dict) -> dict:
    p, c = final["prompt_tokens"], final["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _choice(kind: str, text: str | None, ids, finish, *, stream: bool, first: bool = False) -> dict:
    """One choice object; `token_ids` (the generated ids) is an extension next to OpenAI's fields."""
    if kind == COMPLETIONS:
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish, "token_ids": list(ids)}
    if stream:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": list(ids)}
    return {"index": 0, "message": {"role": "assistant", "content": text or ""}, "logprobs": None,
            "finish_reason": finish, "token_ids": list(ids)}


async def _sse(engine, job, q, req, rid, kind, created):
    """Server-sent events of one streamed request; the job is cancelled if the client goes away."""
    obj = "text_completion" if kind == COMPLETIONS else "chat.completion.chunk"

    def event(choices, **extra):
        return "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": req.model,
                                      "choices": choices, **extra}) + "\n\n"

    try:
        if kind == CHAT:
            yield event([_choice(kind, "", (), None, stream=True, first=True)])
        while True:
            k, v = await q.get()
            if k == "delta":
                if v.token_ids or v.text:
                    yield event([_choice(kind, v.text, v.token_ids, None, stream=True)])
            elif k == "done":
                yield event([_choice(kind, None, (), v["finish_reason"], stream=True)])
                if req.include_usage:
                    yield event([], usage=_usage(v))
                yield "data: [DONE]\n\n"
                return
            else:  # an error: the response is not complete, so no [DONE]
                yield "data: " + json.dumps(v.body()) + "\n\n"
                return
    finally:
        if not job.finished:
            engine.cancel(job)


async def _whole(request, engine, job, q, req, rid, kind, created, metrics, endpoint) -> Response:
    """A non-streamed response: wait for the end, cancelling the job if the client goes away meanwhile."""
    text = []
    try:
        while True:
            try:
                k, v = await asyncio.wait_for(q.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    engine.cancel(job)
                    metrics.request(endpoint, 499)
                    return Response(status_code=499)
                continue
            if k == "delta":
                text.append(v.text)
            elif k == "error":
                metrics.request(endpoint, v.status)
                return JSONResponse(v.body(), status_code=v.status)
            else:
                break
    finally:
        if not job.finished:
            engine.cancel(job)
    choice = _choice(kind, "".join(text), v["token_ids"], v["finish_reason"], stream=False)
    if "logprobs" in v:
        toks = [engine.model.tokenizer.decode([t]) if engine.model.tokenizer else str(t) for t in v["token_ids"]]
        if kind == COMPLETIONS:
            offs, o = [], 0
            for t in toks:
                offs.append(o)
                o += len(t)
            choice["logprobs"] = {"tokens": toks, "token_logprobs": v["logprobs"], "top_logprobs": None,
                                  "text_offset": offs}
        else:
            choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                                               "top_logprobs": []} for t, lp in zip(toks, v["logprobs"])]}
    metrics.request(endpoint, 200)
    return JSONResponse({"id": rid, "object": "text_completion" if kind == COMPLETIONS else "chat.completion",
                         "created": created, "model": req.model, "choices": [choice], "usage": _usage(v)})
