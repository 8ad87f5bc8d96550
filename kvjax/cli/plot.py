"""`kvjax plot RESULT.json ... -o OUT.png`: plots picked from the JSON's content."""

from __future__ import annotations

from kvjax.cli.common import add_json, log


def cmd_plot(args) -> dict:
    from kvjax import plots

    kind, info = plots.plot_files(args.paths, args.output, kind=args.kind)
    log(f"wrote {args.output} ({kind})")
    return dict(output=args.output, kind=kind, **info)


def register(sub) -> None:
    """Add the `plot` subcommand to the parser's subparsers."""
    pl = sub.add_parser("plot", help="plot benchmark JSON (the plot is picked from the content)")
    pl.add_argument("paths", nargs="+", help="benchmark or `kvjax generate --json` result files")
    pl.add_argument("-o", "--output", required=True, help="PNG path")
    pl.add_argument("--kind", default="auto", choices=["auto", "throughput", "accepted", "memory", "prefix",
                                                          "roofline", "bars"])
    add_json(pl)
    pl.set_defaults(fn=cmd_plot)
