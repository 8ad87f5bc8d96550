"""Plots from benchmark JSON (matplotlib, Agg backend): the JSON's content picks the plot.

- **memory** — records carry a `timeline` of (seconds, measured device bytes, reserved bytes, tokens emitted)
  (`scripts/bench_scheduler.py`): device memory over time against the budget, and tokens emitted over time.
- **throughput** — several result files, or one file that spans context lengths (`scripts/bench_kernels.py`'s
  `cached_tokens`): throughput (tokens/s, or GB/s for kernels) against context length, one line per contender.
- **prefix** — prefix-cache records (`scripts/bench_prefix_cache.py`: kind lookup / restore): lookup latency
  against cached prefix length, and restore time per tier against recomputing the prefix.
- **accuracy** — records carry an exact-answer `accuracy` (`scripts/bench_exact_tasks.py`): accuracy per
  contender (lossy cache alone, full cache, VeriCache) and context length, tokens/s written on each bar.
- **accepted** — records carry `accepted_histogram` (`scripts/bench_vericache.py`, `kvjax generate --mode vericache
  --json`): the share of VeriCache rounds that accepted n drafted tokens, and the mean per contender.
- **roofline** — records carry `step`, `ms` and `floor_ms` (`scripts/bench_roofline.py`): each step's measured time
  against its memory-bandwidth floor, per context length.
- **bars** — anything else with labelled numeric records (`docs/results/parity_random.json`, ...): the first numeric field
  every record has, one bar per record.

Throughput also reads per-contender dicts (`scripts/bench_prefill.py`'s `tokens_per_s: {name: value}`,
`scripts/bench_fused_loops.py`'s `ms_per_token`) and `contenders` lists (`scripts/bench_remote_prefix.py`).
"""

from __future__ import annotations

import json
import os

KINDS = ("throughput", "accepted", "memory", "prefix", "accuracy", "roofline", "bars")
LABELS = ("name", "step", "model", "family", "mode", "kernel")


def load(paths) -> list[tuple[str, dict]]:
    """(file name, parsed JSON) per path; a JSON list of records becomes {"records": list}."""
    docs = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except ValueError as e:
                raise ValueError(f"{p} is not JSON: {e}") from None
        docs.append((os.path.basename(p), {"records": d} if isinstance(d, list) else d))
    return docs


def _records(doc: dict) -> list[dict]:
    for key in ("records", "contenders"):
        recs = doc.get(key)
        if isinstance(recs, list):
            return [r for r in recs if isinstance(r, dict)]
    return [doc]  # a single result (e.g. `kvjax generate --json`)


def detect(docs) -> str:
    """The plot kind the content calls for (see the module docstring).

    Raises:
        ValueError: when nothing plottable is found.
    """
    recs = [r for _, d in docs for r in _records(d)]
    if any(r.get("timeline") for r in recs):
        return "memory"
    if any(r.get("kind") in ("lookup", "restore") and "prefix_tokens" in r for r in recs):
        return "prefix"
    if any(isinstance(r.get("accuracy"), (int, float)) and r.get("name") for r in recs):
        return "accuracy"
    if any("step" in r and "floor_ms" in r and "ms" in r for r in recs):
        return "roofline"
    series, _ = throughput_series(docs)
    if any(len(v) > 1 for v in series.values()):
        return "throughput"
    if any(r.get("accepted_histogram") for r in recs):
        return "accepted"
    if series:
        return "throughput"
    if bar_values(docs)[0]:
        return "bars"
    raise ValueError("no plottable data: expected records with timeline, accepted_histogram, tokens_per_s with a "
                     "context length, kernel cached_tokens/gbps, or labelled numbers")


def throughput_series(docs) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """name -> sorted [(context tokens, throughput)] and the y label."""
    series: dict[str, list] = {}
    unit = "tokens/s"
    for _, d in docs:
        cfg = d.get("config", {}) if isinstance(d.get("config"), dict) else {}
        ctx = cfg.get("prompt_tokens") or cfg.get("context")
        for r in _records(d):
            if "cached_tokens" in r and "gbps" in r:  # bench_kernels
                name = f"{r.get('kernel', '?')} ({r.get('implementation', '?')})"
                series.setdefault(name, []).append((int(r["cached_tokens"]), float(r["gbps"])))
                unit = "GB/s read"
                continue
            c = r.get("prompt_tokens", r.get("context", ctx))
            if c is None or "floor_ms" in r:  # roofline records have their own plot
                continue
            per = r.get("tokens_per_s") if isinstance(r.get("tokens_per_s"), dict) else None
            if per is None and isinstance(r.get("ms_per_token"), dict):
                per = {k: 1e3 / v for k, v in r["ms_per_token"].items() if isinstance(v, (int, float)) and v > 0}
            if per is not None:  # one record, several contenders
                for name, v in per.items():
                    if isinstance(v, (int, float)):
                        series.setdefault(name, []).append((int(c), float(v)))
                continue
            if r.get("tokens_per_s") is not None:
                name = r.get("name") or r.get("mode") or "run"
                series.setdefault(name, []).append((int(c), float(r["tokens_per_s"])))
            if r.get("full_cache_tokens_per_s") is not None:  # `kvjax generate --compare-full`
                series.setdefault("full cache", []).append((int(c), float(r["full_cache_tokens_per_s"])))
    return {k: sorted(v) for k, v in series.items()}, unit


def _figure(*args, **kw):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.subplots(*args, **kw)


def plot_throughput(docs, out: str) -> dict:
    series, unit = throughput_series(docs)
    if not series:
        raise ValueError("no throughput data (tokens_per_s with a context length, or kernel cached_tokens/gbps)")
    plt, (fig, ax) = _figure(figsize=(8, 4.8))
    for name, pts in sorted(series.items(), key=lambda kv: -kv[1][-1][1]):
        xs, ys = zip(*pts)
        style = dict(ls="--", color="gray") if name in ("full", "full cache", "reference") else {}
        ax.plot(xs, ys, marker="o", label=f"{name} ({ys[-1]:.3g} at {xs[-1]})", **style)
    ax.set_xscale("log", base=2)
    ctxs = sorted({x for pts in series.values() for x, _ in pts})
    ax.set_xticks(ctxs, [f"{c / 1024:.3g}K" if c >= 1024 else str(c) for c in ctxs])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(unit)
    ax.set_title(f"throughput vs context length ({', '.join(n for n, _ in docs)})", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return dict(series={k: len(v) for k, v in series.items()})


def plot_accepted(docs, out: str) -> dict:
    import numpy as np

    rows = [(r.get("name") or r.get("mode") or fn, np.asarray(r["accepted_histogram"], float), r)
            for fn, d in docs for r in _records(d) if r.get("accepted_histogram")]
    if not rows:
        raise ValueError("no accepted_histogram in these records (VeriCache results carry one)")
    plt, (fig, (a1, a2)) = _figure(1, 2, figsize=(11, 4.5), gridspec_kw=dict(width_ratios=(3, 2)))
    means = []
    for name, h, r in rows:
        share = h / max(h.sum(), 1)
        mean = r.get("mean_accepted_per_round", float((np.arange(h.size) * share).sum()))
        means.append((name, mean, r.get("mean_x")))
        a1.plot(np.arange(h.size), share, marker="o", ms=3, label=f"{name} (mean {mean:.2f})")
    a1.set_xlabel("drafted tokens accepted in a round")
    a1.set_ylabel("share of rounds")
    a1.set_title("accepted tokens per VeriCache round")
    a1.grid(alpha=0.3)
    a1.legend(fontsize=7)
    means.sort(key=lambda m: m[1])
    a2.barh(range(len(means)), [m[1] for m in means], color="tab:blue")
    for i, (_, m, x) in enumerate(means):
        a2.text(m, i, f" {m:.2f}" + (f" / x={x:.0f}" if x else ""), va="center", fontsize=7)
    a2.set_yticks(range(len(means)), [m[0] for m in means], fontsize=7)
    a2.set_xlabel("mean accepted per round (+1 emitted by the verify)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return dict(contenders=len(rows))


def plot_accuracy(docs, out: str) -> dict:
    """Grouped bars: exact-answer accuracy per contender, one group per context length; tokens/s on each bar."""
    recs = [r for _, d in docs for r in _records(d) if isinstance(r.get("accuracy"), (int, float)) and r.get("name")]
    if not recs:
        raise ValueError("no accuracy in these records (scripts/bench_exact_tasks.py writes them)")
    names = list(dict.fromkeys(r["name"] for r in recs))
    ctxs = sorted({r.get("context", 0) for r in recs})
    plt, (fig, ax) = _figure(figsize=(max(8, 0.55 * len(names) * len(ctxs) + 2), 4.8))
    width = 0.8 / len(ctxs)
    for j, c in enumerate(ctxs):
        by = {r["name"]: r for r in recs if r.get("context", 0) == c}
        for i, n in enumerate(names):
            r = by.get(n)
            if r is None:
                continue
            color = "tab:red" if n.startswith("lossy") else "tab:blue" if n.startswith("vc") else "tab:gray"
            ax.bar(i + (j - (len(ctxs) - 1) / 2) * width, r["accuracy"], width, color=color, alpha=1 - 0.35 * j,
                   label=f"{c} tokens" if i == 0 else None, edgecolor="k", linewidth=0.3)
            if r.get("tokens_per_s"):
                ax.text(i + (j - (len(ctxs) - 1) / 2) * width, r["accuracy"], f"{r['tokens_per_s']:.0f}",
                        ha="center", va="bottom", fontsize=6, rotation=90)
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    ax.set_ylim(0, 1.15)
    ax.set_ylabel("exact-answer accuracy (label: tokens/s)")
    ax.set_title("exact answers: lossy cache alone (red), full cache (gray), VeriCache (blue)", fontsize=9)
    if len(ctxs) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return dict(contenders=len(names), contexts=len(ctxs))


def plot_memory(docs, out: str) -> dict:
    import numpy as np

    if not any(r.get("timeline") for _, d in docs for r in _records(d)):
        raise ValueError("no timeline in these records (scripts/bench_scheduler.py writes one)")
    plt, (fig, (a1, a2)) = _figure(2, 1, figsize=(8, 7), sharex=True)
    budgets, n = set(), 0
    for _, d in docs:
        for r in _records(d):
            tl = np.asarray(r.get("timeline") or [], np.float64)
            if tl.ndim != 2 or tl.shape[0] == 0:
                continue
            n += 1
            name = r.get("name", "run")
            tps = r.get("tokens_per_s")
            label = f"{name} ({tps:.0f} tok/s)" if tps else name
            a1.plot(tl[:, 0], tl[:, 1] / 2**20, label=label)
            if tl.shape[1] > 3:
                a2.plot(tl[:, 0], tl[:, 3], label=label)
            if r.get("budget_bytes"):
                budgets.add(r["budget_bytes"])
    for b in budgets:
        a1.axhline(b / 2**20, color="k", ls="--", lw=1, label=f"budget {b / 2**20:.0f} MiB")
    a1.set_ylim(bottom=0)
    a1.set_ylabel("measured device memory (MiB)")
    a1.set_title("device memory over time")
    a2.set_ylabel("tokens emitted")
    a2.set_xlabel("seconds")
    for a in (a1, a2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return dict(runs=n)


def plot_prefix(docs, out: str) -> dict:
    recs = [r for _, d in docs for r in _records(d)]
    look = sorted((r["prefix_tokens"], r["lookup_ms"], r.get("lookup_ms_p90")) for r in recs
                  if r.get("kind") == "lookup" and "lookup_ms" in r)
    rest = [r for r in recs if r.get("kind") == "restore" and "restore_ms" in r]
    if not look and not rest:
        raise ValueError("no prefix-cache lookup/restore records")
    plt, (fig, (a1, a2)) = _figure(1, 2, figsize=(11, 4.5))
    if look:
        xs = [x for x, _, _ in look]
        a1.plot(xs, [m for _, m, _ in look], marker="o", label="median")
        if all(p is not None for _, _, p in look):
            a1.plot(xs, [p for _, _, p in look], marker="s", ls="--", label="p90")
        a1.set_xscale("log", base=2)
        a1.set_xticks(xs, [f"{x // 1024}K" if x >= 1024 else str(x) for x in xs])
        a1.minorticks_off()
        a1.set_ylim(bottom=0)
        a1.legend(fontsize=8)
    a1.set_xlabel("cached prefix (tokens)")
    a1.set_ylabel("lookup + plan (ms)")
    a1.set_title("prefix-cache lookup latency")
    a1.grid(alpha=0.3)
    if rest:
        names = [f"restore\n{r.get('tier', '?')}" for r in rest] + ["recompute"]
        ms = [r["restore_ms"] for r in rest] + [rest[0].get("recompute_ms", float("nan"))]
        a2.bar(range(len(ms)), ms, color=["tab:blue"] * len(rest) + ["tab:gray"])
        for i, r in enumerate(rest):
            if r.get("speedup_vs_recompute"):
                a2.text(i, ms[i], f"{r['speedup_vs_recompute']:.0f}x", ha="center", va="bottom", fontsize=8)
        a2.set_xticks(range(len(ms)), names, fontsize=8)
        a2.set_yscale("log")
        a2.set_title(f"{rest[0].get('prefix_tokens', '?')}-token prefix: restore vs recompute")
    a2.set_ylabel("ms (log)")
    a2.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return dict(lookups=len(look), restores=len(rest))


def plot_roofline(docs, out: str) -> dict:
    import numpy as np

    recs = [r for _, d in docs for r in _records(d) if "floor_ms" in r and "ms" in r and "step" in r]
    if not recs:
        raise ValueError("no roofline records (step, ms, floor_ms: scripts/bench_roofline.py)")
    ctxs = sorted({r.get("context", 0) for r in recs})
    plt, (fig, axes) = _figure(1, len(ctxs), figsize=(6 * len(ctxs), 0.45 * max(len(recs) // len(ctxs), 4) + 1.5),
                               squeeze=False)
    for ax, c in zip(axes[0], ctxs):
        rows = [r for r in recs if r.get("context", 0) == c]
        y = np.arange(len(rows))
        ax.barh(y - 0.2, [r["ms"] for r in rows], height=0.4, label="measured")
        ax.barh(y + 0.2, [r["floor_ms"] for r in rows], height=0.4, color="tab:gray", label="bandwidth floor")
        for i, r in enumerate(rows):
            ax.text(r["ms"], i - 0.2, f" {r['ms'] / max(r['floor_ms'], 1e-12):.1f}x", va="center", fontsize=7)
        ax.set_yticks(y, [f"{r['step']} (/{r.get('per', '?')})" for r in rows], fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel("ms (log)")
        ax.set_title(f"context {c}: measured vs memory-bandwidth floor", fontsize=9)
        ax.grid(alpha=0.3, axis="x")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return dict(steps=len(recs), contexts=len(ctxs))


def bar_values(docs) -> tuple[list[tuple[str, float]], str]:
    """[(label, value)] of the first numeric field every labelled record has, and the field's name."""
    recs = [(fn, r) for fn, d in docs for r in _records(d)]
    labelled = [(next((str(r[k]) for k in LABELS if k in r), None), r) for _, r in recs]
    labelled = [(lab, r) for lab, r in labelled if lab is not None]
    if not labelled:
        return [], ""
    first = labelled[0][1]
    for key, v in first.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and all(
                isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) for _, r in labelled):
            return [(lab, float(r[key])) for lab, r in labelled], key
    return [], ""


def plot_bars(docs, out: str) -> dict:
    vals, key = bar_values(docs)
    if not vals:
        raise ValueError("no labelled numeric records to plot")
    plt, (fig, ax) = _figure(figsize=(8, 0.4 * len(vals) + 1.5))
    ax.barh(range(len(vals)), [v for _, v in vals])
    ax.set_yticks(range(len(vals)), [lab for lab, _ in vals], fontsize=8)
    ax.invert_yaxis()
    if min(v for _, v in vals) > 0 and max(v for _, v in vals) / min(v for _, v in vals) > 100:
        ax.set_xscale("log")
    ax.set_xlabel(key)
    ax.set_title(", ".join(n for n, _ in docs), fontsize=9)
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return dict(bars=len(vals), field=key)


def plot_files(paths, out: str, *, kind: str = "auto") -> tuple[str, dict]:
    """Read benchmark JSON files, pick (or use) a plot kind, write a PNG to `out`. Returns (kind, info)."""
    docs = load(paths)
    kind = detect(docs) if kind == "auto" else kind
    if kind not in KINDS:
        raise ValueError(f"unknown plot kind {kind!r}; one of {KINDS}")
    d = os.path.dirname(os.path.abspath(out))
    os.makedirs(d, exist_ok=True)
    fn = {"throughput": plot_throughput, "accepted": plot_accepted, "memory": plot_memory, "prefix": plot_prefix,
          "accuracy": plot_accuracy, "roofline": plot_roofline, "bars": plot_bars}
    return kind, fn[kind](docs, out)
