"""`kvjax cache STORE`: inspect, verify or evict a prefix-cache store.

Acts only on a location that holds kvjax's store marker, and deletes only that store's own keys
(`kvjax.prefix.inspect`); anything else is refused with one error line.
"""

from __future__ import annotations

import json

from kvjax.cli.common import CliError, add_json


def _emit_json(report: dict, args) -> None:
    """The report as `--json` asks for it, also when the command then fails (damage found)."""
    if args.json_stdout:
        print(json.dumps(report, indent=1), flush=True)
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def cmd_cache(args) -> dict:
    from kvjax.prefix import inspect as store_inspect

    report = store_inspect.inspect(args.store, namespace=args.namespace,
                                   verify=args.verify or args.evict_corrupt or args.evict_stale)
    evicted = {}
    if args.evict:
        evicted["evicted_namespaces"] = store_inspect.evict_namespace(args.store, args.evict)
    if args.evict_stale:
        evicted["evicted_stale"] = store_inspect.evict_entries(args.store, report["stale"])
    if args.evict_corrupt:
        evicted["evicted_corrupt"] = store_inspect.evict_entries(args.store, report["corrupt"])
    if evicted:  # the report describes the store as it is now, after the eviction
        report = dict(store_inspect.inspect(args.store, namespace=args.namespace, verify=args.evict_corrupt),
                      **evicted)
    if not args.json_stdout:
        print(store_inspect.format_report(report))
    if report.get("corrupt") and not args.evict_corrupt:
        _emit_json(report, args)
        raise CliError(f"{len(report['corrupt'])} corrupt entries (first: {report['corrupt'][0]['key']}: "
                       f"{report['corrupt'][0]['why']}); --evict-corrupt deletes them")
    return report


def register(sub) -> None:
    """Add the `cache` subcommand to the parser's subparsers."""
    c = sub.add_parser("cache", help="inspect, verify or evict a prefix-cache store")
    c.add_argument("store", help="TensorStore kvstore URL or directory (file:// by default) holding a kvjax store")
    c.add_argument("--namespace", help="only namespaces whose hex starts with this")
    c.add_argument("--verify", action="store_true", help="read every entry and check header, tokens and checksum")
    c.add_argument("--evict", metavar="HEX", help="delete the store's keys of the namespaces starting with HEX")
    c.add_argument("--evict-corrupt", action="store_true", help="verify, then delete entries that fail")
    c.add_argument("--evict-stale", action="store_true",
                   help="verify, then delete only the entries another store format version wrote")
    add_json(c)
    c.set_defaults(fn=cmd_cache)
