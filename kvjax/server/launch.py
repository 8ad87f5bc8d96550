"""Build the engine and the ASGI app for a model and run them under uvicorn.

Needs the `serve` extra (`pip install kvjax[serve]`: Starlette and uvicorn); `require_serve_extra` says so in one
line when it is missing.
"""

from __future__ import annotations

import signal
import socket

from kvjax.errors import InputError


def require_serve_extra() -> None:
    """InputError naming the extra when Starlette or uvicorn is not installed."""
    try:
        import starlette  # noqa: F401, PLC0415
        import uvicorn  # noqa: F401, PLC0415
    except ImportError as e:
        raise InputError(f"kvjax serve needs the 'serve' extra ({e.name} is missing): "
                         f"pip install 'kvjax[serve]'") from None


def build(model, *, served_name: str, mode: str = "vericache", context: int = 2048, max_tokens_limit: int = 256,
          budget_bytes: int | None = None, max_queue: int = 64, max_slots: int = 16, draft_len: int = 8,
          compressor=None, prefix_cache=None, api_keys: dict | None = None, grace_s: float = 10.0,
          warmup: bool = True):
    """(ASGI app, engine, metrics) serving `model`; the engine thread is started (and warmed up).

    Args: as `kvjax.server.engine.Engine`, plus `served_name` (the model id clients send), `api_keys` (bearer token
    -> tenant) and `grace_s` (how long a shutdown lets in-flight requests finish).
    """
    require_serve_extra()
    from kvjax.scheduling.memory import default_budget  # noqa: PLC0415
    from kvjax.server.app import create_app  # noqa: PLC0415
    from kvjax.server.engine import Engine  # noqa: PLC0415
    from kvjax.server.metrics import ServerMetrics  # noqa: PLC0415

    if context < 2 or max_tokens_limit < 1 or max_tokens_limit >= context:
        raise InputError(f"need 1 <= max_tokens_limit < context, got {max_tokens_limit} and {context}")
    metrics = ServerMetrics()
    engine = Engine(model, mode=mode, context=context, max_tokens_limit=max_tokens_limit,
                    budget_bytes=budget_bytes or default_budget(), max_queue=max_queue, max_slots=max_slots,
                    draft_len=draft_len, compressor=compressor, prefix_cache=prefix_cache, metrics=metrics)
    engine.start()
    if warmup:
        engine.warmup()
    app = create_app(engine, metrics, served_name=served_name, api_keys=api_keys,
                     on_shutdown=lambda: engine.shutdown(grace_s))
    return app, engine, metrics


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS picks it), for servers started by tests and benchmarks."""
    s = socket.socket()
    try:
        s.bind((host, 0))
        return s.getsockname()[1]
    finally:
        s.close()


def uvicorn_server(app, *, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 10.0):
    """A `uvicorn.Server` for `app` (call `.run()`; in the main thread it stops on SIGINT/SIGTERM)."""
    import uvicorn  # noqa: PLC0415

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace_s,
                            lifespan="on")
    return uvicorn.Server(config)


def run_until_signal(server) -> None:
    """Run uvicorn in this (main) thread until SIGINT/SIGTERM; return normally afterwards (exit status 0).

    uvicorn re-raises the signal it caught once it has shut down, with the handler that was installed before it:
    a handler that does nothing makes that a normal return.
    """
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
