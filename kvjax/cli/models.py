"""`kvjax models`: the model names kvjax can fetch (`kvjax generate --model NAME`, `kvjax.load(NAME)`), their
sizes, and whether each is already in the per-user cache (`$KVJAX_CACHE_DIR/models`, default ~/.cache/kvjax/models)."""

from __future__ import annotations

from kvjax.cli.common import add_json


def cmd_models(args) -> dict:
    from kvjax.formats import named

    rows = []
    for name, m in sorted(named.NAMED_MODELS.items()):
        cached = named.is_cached(name)
        rows.append(dict(name=name, cached=cached, path=named.cached_path(name) if cached else None,
                         size_mb=round(m.size / 1e6), source=f"pip: {m.package}=={m.version} ({m.member})",
                         description=m.description))
    if not args.json_stdout:
        for r in rows:
            state = f"cached at {r['path']}" if r["cached"] else "not cached (fetched on first use)"
            print(f"{r['name']:<24} {r['size_mb']:>5} MB  {state}\n{'':<24} {r['description']}; {r['source']}")
        print(f"cache: {named.cache_dir()} (set {named.CACHE_ENV} to move it)")
    return dict(models=rows, cache_dir=named.cache_dir())


def register(sub) -> None:
    """Add the `models` subcommand to the parser's subparsers."""
    c = sub.add_parser("models", help="list the model names kvjax can fetch and which are cached")
    add_json(c)
    c.set_defaults(fn=cmd_models)
