"""`kvjax serve --model NAME_OR_PATH`: an OpenAI-compatible HTTP server (`kvjax.server`).

Serves POST /v1/completions and /v1/chat/completions (streamed or not), GET /v1/models, /health and /metrics, until
SIGINT/SIGTERM: then it stops accepting, lets in-flight requests finish for `--grace` seconds, cuts off the rest
(their clients get an error, never a complete-looking response) and exits 0.
"""

from __future__ import annotations

import os

from kvjax.cli.common import DEFAULT_MODEL, CliError, add_json, log


def _api_keys(items) -> dict:
    keys = {}
    for item in items or []:
        key, sep, tenant = item.partition("=")
        if not sep or not key or not tenant:
            raise CliError(f"--api-key takes KEY=TENANT, got {item!r}")
        keys[key] = tenant
    return keys


def _prefix_cache(args, model):
    if args.no_prefix_cache:
        return None
    import numpy as np

    from kvjax.families import forms_for
    from kvjax.prefix.manager import PrefixCache

    try:
        forms = forms_for(model.config, np.dtype(model.cache_dtype), args.block_size)
    except Exception as e:  # noqa: BLE001 - a family without prefix-cache forms serves without one
        log(f"kvjax serve: no prefix cache for this model ({e})")
        return None
    return PrefixCache(forms, device_bytes=args.prefix_device_mb << 20, host_bytes=args.prefix_host_mb << 20,
                       store_url=args.prefix_store)


def cmd_serve(args) -> dict:
    from kvjax.server import launch

    launch.require_serve_extra()
    keys = _api_keys(args.api_key)
    if not os.path.exists(os.path.join(args.model, "config.json")):
        raise CliError(f"no model at {args.model} (expected a Hugging Face directory with config.json)")
    import kvjax

    model = kvjax.load(args.model, dtype=args.dtype)
    name = args.served_name or os.path.basename(os.path.normpath(args.model))
    app, engine, _ = launch.build(
        model, served_name=name, mode=args.mode, context=args.context, max_tokens_limit=args.max_tokens_limit,
        budget_bytes=args.budget_mb << 20 if args.budget_mb else None, max_queue=args.max_queue,
        max_slots=args.max_batch, draft_len=args.draft_len, compressor=args.compressor,
        prefix_cache=_prefix_cache(args, model), api_keys=keys, grace_s=args.grace, warmup=True)
    log(f"kvjax serve: {name} ({args.mode}) on http://{args.host}:{args.port}/v1  "
        f"[context {args.context}, budget {engine.mem.budget >> 20} MiB, {len(keys) or 'no'} API keys]")
    launch.run_until_signal(launch.uvicorn_server(app, host=args.host, port=args.port, grace_s=args.grace))
    log(f"kvjax serve: stopped ({engine._cut_off} requests cut off)")
    return {}


def register(sub) -> None:
    """Add the `serve` subcommand to the parser's subparsers."""
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    s.add_argument("--model", default=DEFAULT_MODEL, help="Hugging Face model directory (default: the tiny checkpoint)")
    s.add_argument("--served-name", help="the model id clients send (default: the directory's name)")
    s.add_argument("--mode", choices=("vericache", "full"), default="vericache")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--api-key", action="append", metavar="KEY=TENANT",
                   help="accept bearer token KEY as tenant TENANT (repeatable); none = no authentication")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 429 (default 64)")
    s.add_argument("--max-batch", type=int, default=16, help="requests decoding at once (default 16)")
    s.add_argument("--context", type=int, default=2048, help="prompt + max_tokens limit per request (default 2048)")
    s.add_argument("--max-tokens-limit", type=int, default=256, help="largest max_tokens accepted (default 256)")
    s.add_argument("--budget-mb", type=int, default=0, help="device MiB for per-request state (default: half free)")
    s.add_argument("--draft-len", type=int, default=8, help="VeriCache drafts per round (default 8)")
    s.add_argument("--compressor", default=None, help="VeriCache draft maker (default: the family's)")
    s.add_argument("--dtype", default="f32", choices=("f32", "bf16"))
    s.add_argument("--grace", type=float, default=10.0, help="seconds in-flight requests get after SIGTERM")
    s.add_argument("--no-prefix-cache", action="store_true", help="serve without the shared prefix cache")
    s.add_argument("--prefix-store", help="prefix-cache store URL or directory (shared by replicas)")
    s.add_argument("--prefix-device-mb", type=int, default=64)
    s.add_argument("--prefix-host-mb", type=int, default=256)
    s.add_argument("--block-size", type=int, default=16, help="prefix-cache block size in tokens")
    add_json(s)
    s.set_defaults(fn=cmd_serve)
