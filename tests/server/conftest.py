"""A real server on 127.0.0.1 (uvicorn in a thread, a free port) over the tiny checkpoint, and offline references."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import kvjax
from kvjax.server.launch import free_port

TINY = os.path.join(os.path.dirname(__file__), "..", "..", "checkpoints", "kvjax-code-tiny")
CONTEXT, MAX_TOKENS = 128, 32


@pytest.fixture(scope="session")
def tiny():
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    return kvjax.load(TINY)


@pytest.fixture(scope="session")
def start_server(tiny):
    """start(mode, **build kw) -> (base url, engine, metrics); every server started is stopped at session end."""
    from kvjax.server import launch

    running = []

    def start(mode="vericache", **kw):
        kw.setdefault("context", CONTEXT)
        kw.setdefault("max_tokens_limit", MAX_TOKENS)
        kw.setdefault("budget_bytes", 64 << 20)
        kw.setdefault("max_slots", 8)
        if kw.pop("prefix", True):
            from kvjax.families import forms_for
            from kvjax.prefix.manager import PrefixCache

            kw["prefix_cache"] = PrefixCache(forms_for(tiny.config, np.float32, 16), device_bytes=8 << 20,
                                             host_bytes=8 << 20, store_url=kw.pop("store_url", None))
        app, engine, metrics = launch.build(tiny, served_name="tiny", mode=mode, **kw)
        port = free_port()
        srv = launch.uvicorn_server(app, port=port, grace_s=5)
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        t0 = time.monotonic()
        while not srv.started:
            assert th.is_alive() and time.monotonic() - t0 < 60, "server did not start"
            time.sleep(0.02)
        running.append((srv, th))
        return f"http://127.0.0.1:{port}", engine, metrics

    yield start
    for srv, th in running:
        srv.should_exit = True
        th.join(timeout=30)


@pytest.fixture(scope="session")
def offline(tiny):
    """offline(mode, prompt ids, max_tokens, **kw) -> the token ids kvjax.generate / generate_vericache return."""
    memo = {}

    def run(mode, ids, max_tokens, **kw):
        key = (mode, tuple(int(t) for t in ids), max_tokens, tuple(sorted(kw.items())))
        if key not in memo:
            fn = kvjax.generate if mode == "full" else kvjax.generate_vericache
            r = fn(tiny, np.asarray(ids, np.int32), max_tokens, **kw)
            memo[key] = np.asarray(r[0] if isinstance(r, tuple) else r).tolist()  # (tokens, stats) or a Generation
        return memo[key]

    return run


@pytest.fixture(scope="session")
def servers(start_server):
    """One server per mode (prefix cache on), started on first use and shared by the test modules:
    servers[mode] -> (url, engine, metrics)."""

    class Servers(dict):
        def __missing__(self, mode):
            self[mode] = start_server(mode)
            return self[mode]

    return Servers()
