"""README "Results" tables rendered from the JSON files in docs/results/, one render function per table.

Each README block sits between `<!-- results:TABLE -->` and `<!-- /results:TABLE -->` and holds only what this
module writes: the table (one column, or row group, per result of the registry in `regenerate_results.py`, real
model first), the machine the files record, and the commands that regenerate each result. Prose that interprets a
table stays outside its markers. A result not yet measured renders as "not yet measured".

A render function takes `[(Result, doc or None)]` (the registry entries of one table with their parsed JSON) and
returns Markdown; it reads only the JSON, never a hand-typed figure.
"""

from __future__ import annotations

import json
import os
import re

DEFAULT_MACHINE = "AMD EPYC, 2 cores, 32 MiB L3"
PENDING = "not yet measured"
DASH = "–"

DRAFTERS = {"streaming": "StreamingLLM", "snapkv": "SnapKV", "kvzip": "KVzip-style", "kivi4": "KIVI 4-bit",
            "kivi2": "KIVI 2-bit", "dropquant": "drop + quantize", "refresh": "refresh (re-selected blocks)",
            "refresh_kivi4": "refresh inside a 4-bit bulk", "refresh_kivi2": "refresh inside a 2-bit bulk"}


# ---- formatting -------------------------------------------------------------------------------------------------

def num(x, digits: int = 3) -> str:
    """`x` to `digits` significant figures (thousands separated), or a dash when absent."""
    if x is None:
        return DASH
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}"
    if x == 0:
        return "0"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    if abs(x) < 1e-3:
        return f"{x:.1e}"
    s = f"{x:.{digits}g}"
    return f"{float(s):,.0f}" if "e" in s else s


def ratio(x) -> str:
    return DASH if x is None else f"{x:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def column_rows(labels: list[str], cols: list[tuple]) -> list[list[str]]:
    """Rows of a one-column-per-result table: `cols` is [(doc or None, {row label: cell})]; a result not yet
    measured says so in its first row and leaves the rest blank, a row a result lacks is a dash."""
    return [[label] + [(PENDING if i == 0 else "") if doc is None else by.get(label, DASH) for doc, by in cols]
            for i, label in enumerate(labels)]


def drafter(spec: str) -> str:
    """`refresh_kivi4:ratio=8.0` -> 'refresh inside a 4-bit bulk (ratio=8.0)'."""
    base, _, opts = spec.partition(":")
    return DRAFTERS.get(base, base) + (f" ({opts.replace(':', ', ')})" if opts else "")


def records(doc) -> list[dict]:
    """The record list of a result file: the document itself when it is a list, else its `records`."""
    if doc is None:
        return []
    return doc if isinstance(doc, list) else doc.get("records", [])


# ---- one function per table ---------------------------------------------------------------------------------------

def _vericache_row(name: str) -> tuple[int, str]:
    """(sort group, row label) of a bench_vericache record name."""
    m = re.fullmatch(r"(\w[\w-]*)\[(.*)\](\+offload)?", name)
    if name == "full":
        return 0, "full-cache decoding (speed 1.00; tokens/s)"
    if not m:
        return 9, name
    kind, inner, offload = m.groups()
    first = inner.split(",")[0]
    rest = inner.split(",")[1:]
    if kind == "vc-adaptive":
        return 1, f"VeriCache, {drafter(inner)}, adaptive x"
    if kind == "vc":
        return (3 if offload else 2), f"VeriCache, {drafter(inner)}" + (", offloaded" if offload else "")
    if kind == "magicdec":
        return 4, f"MagicDec-style ({drafter(first)}, {', '.join(rest).replace('=', ' = ')})"
    if kind == "quantspec":
        return 4, f"QuantSpec-style ({drafter(first)}, {', '.join(rest).replace('=', ' = ')})"
    return 9, name


def render_vericache(items) -> str:
    """Speed vs full-cache decoding and tokens accepted per round, per contender, one column per result; the
    lossy caches alone (no verification) are left out: their output differs, so their speed is not comparable."""
    header = ["contender (speed vs full · accepted per round)"]
    cols, labels = [], {}
    for res, doc in items:
        c = (doc or {}).get("config", {})
        header.append(f"{res.label}" + (f" ({c['prompts']} prompt{'s' * (c['prompts'] != 1)} x {c['new_tokens']} "
                                         f"tokens, x = {c['draft_len']})" if c else ""))
        by = {}
        for r in records(doc):
            if r["name"] == "reference" or r["name"].startswith("lossy["):
                continue
            g, label = _vericache_row(r["name"])
            labels.setdefault(label, (g, len(labels)))
            if r["name"] == "full":
                by[label] = f"1.00 ({num(r['tokens_per_s'])} tok/s)"
            else:
                acc = r.get("mean_accepted_per_round")
                by[label] = f"{r['speedup_vs_full']:.2f}" + (f" · {acc:.1f}" if acc is not None else "")
        cols.append((doc, by))
    rows = column_rows(sorted(labels, key=lambda k: labels[k]), cols)
    same = ["identical to full-cache decoding (every VeriCache row)"]
    for doc, _ in cols:
        fr = [r["identical_fraction"] for r in records(doc) if r["name"] != "reference"
              and not r["name"].startswith("lossy[")]
        same.append("" if doc is None else ("yes" if fr and min(fr) == 1.0 else f"no (min {min(fr):.3f})"))
    rows.append(same)
    return table(header, rows)


def render_vericache_exactness(items) -> str:
    """Per drafter: how often the lossy cache alone and VeriCache reproduce full-cache decoding's tokens."""
    parts = []
    for res, doc in items:
        if doc is None:
            parts.append(f"{res.label}: {PENDING}")
            continue
        c = doc["config"]
        by = {r["name"]: r for r in records(doc)}
        names = [n[3:-1] for n in by if n.startswith("vc[")]
        rows = [[drafter(n), f"{by.get(f'lossy[{n}]', {}).get('identical_fraction', 0):.2f}",
                 f"{by[f'vc[{n}]']['identical_fraction']:.2f}", num(by[f"vc[{n}]"].get("mean_accepted_per_round"))]
                for n in names]
        parts.append(table([f"drafter ({res.label}: {c['prompts']} prompts x {c['new_tokens']} tokens, x = "
                            f"{c['draft_len']})", "lossy cache alone: identical outputs", "VeriCache: identical",
                            "accepted per round"], rows))
    return "\n\n".join(parts)


def render_exact_tasks(items) -> str:
    """Exact answers: per drafter, the lossy cache alone vs VeriCache (which must answer as full-cache decoding)."""
    parts = []
    for res, doc in items:
        if doc is None:
            parts.append(f"{res.label}: {PENDING}")
            continue
        by = {r["name"]: r for r in records(doc)}
        full, ref = by["full"], by.get("reference", {})
        n = full["tasks"]
        rows = [[f"full cache (plain decode / verify-shape reference), {res.label}", f"{full['correct']} / {n}",
                 f"{num(full['tokens_per_s'])} / {num(ref.get('tokens_per_s'))}", DASH, DASH, DASH]]
        for name in [k[6:-1] for k in by if k.startswith("lossy[")]:
            lo, vc = by[f"lossy[{name}]"], by.get(f"vc[{name}]", {})
            rows.append([drafter(name), f"{lo['correct']} / {n} (tokens identical on "
                                        f"{round(lo['identical_fraction'] * n)} of {n})",
                         num(lo["tokens_per_s"]), f"{vc.get('correct', DASH)} / {n}",
                         f"{round(vc.get('identical_fraction', 0) * n)} / {n}", num(vc.get("tokens_per_s"))])
        c = doc.get("config", {})
        parts.append(table([f"contender ({c.get('budget', '')} budget, x = {c.get('draft_len')})",
                            "lossy cache alone: correct", "tokens/s", "VeriCache: correct", "identical to full",
                            "tokens/s"], rows))
    return "\n\n".join(parts)


def _roofline_group(step: str) -> int:
    """Rows in reading order: kvjax's steps, then each peer, then the speed ratios."""
    order = ("prefill", "full-cache decode", "draft step", "verify", "offload", "transformers", "llama.cpp",
             "kvjax vs")
    return next((i for i, p in enumerate(order) if step.startswith(p)), len(order))


def _roofline_label(step: str) -> str:
    m = re.fullmatch(r"draft step \[(.*)\]", step)
    if m:
        return f"draft step, {drafter(m.group(1))}"
    return {"prefill": "kvjax prefill", "full-cache decode": "kvjax full-cache decode"}.get(
        step, step.replace("kvjax vs", "kvjax speed vs"))


def _roofline_cell(r: dict) -> str:
    if "skipped" in r:
        return "skipped"
    if "native_ms" in r:  # attention per layer, the kernel beside XLA and PyTorch's fused attention
        return (f"native {num(r['native_ms'])} / XLA {num(r.get('xla_ms'))} / PyTorch SDPA "
                f"{num(r.get('torch_sdpa_ms'))} ms")
    if "decode_speedup" in r:
        return f"decode {ratio(r['decode_speedup'])}; prefill {ratio(r.get('prefill_speedup'))}"
    if r.get("per") == "prompt":
        return f"{num(r['tokens_per_s'])} tok/s"
    if r.get("per") == "verify" and "decode_steps" in r:
        return f"{num(r['ms'])} ms = {r['decode_steps']:.1f} decode steps"
    return f"{num(r['ms'])} ms ({r['ratio']:.2f}x floor)"


def render_roofline(items) -> str:
    """Each step (ms per token, x its memory floor measured in the same run) and the peers, one column per result."""
    header, cols, labels = ["step"], [], {}
    for res, doc in items:
        header.append(res.label)
        by = {}
        for r in records(doc):
            label = _roofline_label(r["step"])
            labels.setdefault(label, (_roofline_group(r["step"]), len(labels)))
            by[label] = _roofline_cell(r)
        cols.append((doc, by))
    return table(header, column_rows(sorted(labels, key=labels.get), cols))


def _drafter_fields(kw: dict | None) -> str:
    """A drafter's recorded fields as the table says them: ', 8x smaller, <= 2,048 kept, int8 cache and weights'."""
    kw = kw or {}
    out = [f"{kw['ratio']:g}x smaller"] if "ratio" in kw else []
    if "max_kept" in kw:
        out.append(f"<= {num(kw['max_kept'])} kept")
    cache, weights = kw.get("draft_dtype", "float32"), kw.get("draft_weights", "float32")
    if cache != "float32" and cache == weights:
        out.append(f"{cache} cache and weights")
    else:
        out += [f"{cache} cache"] * (cache != "float32") + [f"{weights} weights"] * (weights != "float32")
    return "".join(", " + x for x in out)


def render_scheduler(items) -> str:
    """Many requests under one memory budget: staggered and lock-step VeriCache vs full-cache batching."""
    rows_spec = [
        ("requests x prompt tokens", lambda c, by, d: f"{c['requests']} x {num(c['prompt_tokens'])}"),
        ("drafter, x", lambda c, by, d: f"{drafter(c['compressor'])}{_drafter_fields(c.get('compressor_kw'))}"
                                        + f", x = {c['draft_len']}"),
        ("budget (full caches)", lambda c, by, d: f"{c['budget_bytes'] / c['full_cache_bytes']:.2f}"),
        ("slots: full / VeriCache", lambda c, by, d: f"{by['full']['stats']['slots']} / "
                                                     f"{by['vericache-staggered']['stats']['slots']}"),
        ("full-cache batching, tokens/s", lambda c, by, d: num(by["full"]["tokens_per_s"])),
        ("one request at a time (plain, no budget limit on a CPU), tokens/s",
         lambda c, by, d: num((d.get("one_at_a_time") or {}).get("tokens_per_s"))),
        ("VeriCache staggered vs full", lambda c, by, d: ratio(d["ratios"]["staggered_vs_full"])),
        ("VeriCache lock-step vs full", lambda c, by, d: ratio(d["ratios"]["lockstep_vs_full"])),
        ("staggered vs lock-step", lambda c, by, d: ratio(d["ratios"]["staggered_vs_lockstep"])),
        ("VeriCache lock-step vs one at a time", lambda c, by, d: ratio(d["ratios"].get("lockstep_vs_one_at_a_time"))),
        ("accepted per round", lambda c, by, d: num(by["vericache-staggered"]["stats"].get("mean_accepted_per_round"))),
        ("identical to full-cache decoding", lambda c, by, d: "yes" if all(
            r["identical_fraction"] == 1.0 for r in by.values()) else "no"),
        ("VeriCache within the budget", lambda c, by, d: "yes" if all(
            r["within_budget"] for n, r in by.items() if n != "full") else "no"),
    ]
    header = [""] + [res.label for res, _ in items]
    cols = [(doc, {} if doc is None else {label: cell(doc["config"], {r["name"]: r for r in records(doc)}, doc)
                                          for label, cell in rows_spec}) for _, doc in items]
    return table(header, column_rows([label for label, _ in rows_spec], cols))


def _keyed_rows(items, key: str, unit: str) -> str:
    """Records of {'context', key: {contender: value}, '*_vs_*': ratio}: one row per result and context."""
    contenders, ratios = [], []
    for _, doc in items:
        for r in records(doc):
            contenders += [k for k in r.get(key, {}) if k not in contenders]
            ratios += [k for k, v in r.items() if "_vs_" in k and isinstance(v, float) and k not in ratios]
    header = ["model", "context"] + [f"{c} ({unit})" for c in contenders] + [k.replace("_", " ") for k in ratios]
    rows = []
    for res, doc in items:
        if doc is None:
            rows.append([res.label, PENDING] + [DASH] * (len(contenders) + len(ratios)))
        for r in records(doc):
            rows.append([res.label, num(r["context"])] + [num(r.get(key, {}).get(c)) for c in contenders]
                        + [ratio(r.get(k)) for k in ratios])
    return table(header, rows)


def render_prefill(items) -> str:
    """Prefill tokens/s per contender and context (best of the repetitions, interleaved)."""
    return _keyed_rows(items, "tokens_per_s", "tokens/s")


def render_fused_loops(items) -> str:
    """Decode and draft ms per token with fused and unfused projections."""
    return _keyed_rows(items, "ms_per_token", "ms/token")


def render_prefix_cache(items) -> str:
    """Prefix cache: lookup + plan time by prefix length, restore vs recompute by tier, hit rate vs the oracle."""
    header, cols, labels = ["measure"], [], {}
    for res, doc in items:
        header.append(res.label)
        by = {}
        for r in records(doc):
            if r["kind"] == "lookup":
                label, cell = f"lookup + plan, {num(r['prefix_tokens'])} tokens", f"{num(r['lookup_ms'])} ms"
            elif r["kind"] == "restore":
                label = f"restore {num(r['prefix_tokens'])} tokens from {r['tier']} vs recompute"
                cell = f"{r['speedup_vs_recompute']:.0f}x ({num(r['restore_ms'])} vs {num(r['recompute_ms'])} ms)"
            elif r["kind"] == "hit_rate":
                label = f"hit rate, {r['requests']} shared-prefix requests (oracle)"
                cell = f"{r['hit_rate']:.3f} ({r['oracle_hit_rate']:.3f})"
            else:
                continue
            labels.setdefault(label, len(labels))
            by[label] = cell
        cols.append((doc, by))
    return table(header, column_rows(sorted(labels, key=labels.get), cols))


def render_remote_prefix(items) -> str:
    """Draft-first VeriCache vs fetch-the-full-cache-then-decode over a modelled link."""
    header = ["model", "contender", "context", "link GB/s", "first token (ms)", "tokens/s", "accepted per round",
              "identical"]
    rows = []
    for res, doc in items:
        if doc is None:
            rows.append([res.label, PENDING] + [DASH] * 6)
            continue
        for c in doc["contenders"]:
            rows.append([res.label, c["name"], num(c["context"]), num(c["link_gbps"]), num(c["ttft_s"] * 1e3),
                         num(c["tokens_per_s"]), num(c.get("mean_accepted_per_round")),
                         f"{c['identical_fraction']:.2f}"])
        for r in doc.get("runs", []):
            rows.append([res.label, "draft-first vs full-fetch", num(r["context"]), num(r["link_gbps"]),
                         f"{r['ttft_speedup']:.2f}x sooner", f"{r['throughput_speedup']:.2f}x", DASH,
                         f"{r['identical_fraction']:.2f}"])
    return table(header, rows)


def render_attention_peers(items) -> str:
    """One attention layer: the native kernel, XLA and PyTorch SDPA, ms (best of the repetitions, interleaved)."""
    header = ["model (heads)", "cache slots", "query rows", "native ms", "XLA ms", "PyTorch SDPA ms", "native / XLA"]
    rows = []
    for res, doc in items:
        if doc is None:
            rows.append([res.label, PENDING] + [DASH] * 5)
            continue
        for r in records(doc):
            rows.append([res.label, num(r["slots"]), num(r["rows"]), num(r.get("native_ms")), num(r.get("xla_ms")),
                         num(r.get("torch_sdpa_ms")), ratio(r.get("native_over_xla"))])
    return table(header, rows)


def _step_times(doc) -> dict:
    """The {'<impl> decode step' | '<impl> verify x=<n>': (ms, median of rounds in decode steps or None, multiply-add
    floor ms or None)} mapping anywhere in a bench_short_verify file."""
    pat = re.compile(r"\S+ (decode step|verify x=\d+)")
    if isinstance(doc, dict):
        if doc and all(isinstance(k, str) and pat.fullmatch(k) for k in doc):
            # each timing is ms, or a record {"ms": ..., "runs_ms": [...], "decode_steps": ...,
            # "decode_steps_median": ...} (the median over rounds of each round's verify / decode step)
            return {k: (v["ms"], v.get("decode_steps_median"), (v.get("multiply_add_floor") or {}).get("ms"))
                    if isinstance(v, dict) else (v, None, None) for k, v in doc.items()}
        for v in doc.values():
            found = _step_times(v)
            if found:
                return found
    return {}


def _verify_cell(x: str, ms: float, median: float | None, floor: float | None, dec: float | None) -> str:
    """'x = 8: 11.2 = 1.8' (best verify over best decode step), with ' (median of rounds 2.0)' and '; multiply-add
    floor 5.6 = 1.2, measured 1.7x it' where recorded."""
    cell = f"x = {x}: {num(ms)} = {ms / dec:.1f}" if dec else f"x = {x}: {num(ms)}"
    cell += f" (median of rounds {median:.1f})" if median is not None else ""
    if floor:
        cell += f"; multiply-add floor {num(floor)}" + (f" = {floor / dec:.1f}" if dec else "") + \
            f", measured {ms / floor:.1f}x it"
    return cell


def render_short_verify(items) -> str:
    """The verify step in full-cache decode steps, per attention implementation and draft length."""
    header = ["model", "implementation", "decode step (ms)", "verify: ms = decode steps"]
    rows = []
    for res, doc in items:
        if doc is None:
            rows.append([res.label, PENDING, DASH, DASH])
            continue
        steps = _step_times(doc)
        if not steps:
            raise ValueError(f"{res.path}: no '<impl> decode step' / '<impl> verify x=N' timings found; "
                             f"render_short_verify needs updating for this layout")
        for impl in dict.fromkeys(k.split()[0] for k in steps):
            dec = steps.get(f"{impl} decode step", (None, None))[0]
            ver = [(k.split("=")[1], *v) for k, v in steps.items() if k.startswith(f"{impl} verify")]
            rows.append([res.label, impl, num(dec),
                         " · ".join(_verify_cell(x, ms, med, fl, dec) for x, ms, med, fl in ver)])
    return table(header, rows)


def render_parity(items) -> str:
    """Max |Δ logit| against transformers: SmolLM2 per prompt (and its greedy tokens), random models per family."""
    parts = []
    for res, doc in items:
        if doc is None:
            parts.append(f"{res.label}: {PENDING}")
        elif "prompts" in doc:  # tests/formats/test_smollm2_parity.py
            rows = [[name, num(p["prompt_tokens"]), num(p["max_abs_delta_logit"]),
                     f"{p['greedy_identical_prefix']} / {p['greedy_tokens']}"] for name, p in doc["prompts"].items()]
            parts.append(table([f"{res.label} ({doc['dtype']}, tolerance {doc['tolerance']}; transformers "
                                f"{doc['transformers']}): prompt", "tokens", "max abs Δ logit",
                                "greedy tokens identical"], rows))
        else:  # tests/models/test_parity.py
            rows = [[r["name"], num(r["prompt_tokens"]), num(r["max_abs_logit_diff"])] for r in records(doc)]
            ref = doc.get("meta", {}).get("reference", "transformers")
            parts.append(table([f"{res.label} weights of each family (vs {ref})", "prompt tokens",
                                "max abs Δ logit"], rows))
    return "\n\n".join(parts)


# XLA's own matrix products among `bench_step_ops.py`'s operation kinds (YNNPACK / XNNPACK / oneDNN fusions, a dot)
XLA_PRODUCTS = ("xla: ynn_fusion", "xla: xnn_fusion", "xla: dot", "xla: onednn_fusion")


def render_step_ops(items) -> str:
    """Per step (`bench_step_ops.py`): each native kernel's time per chunk, token or verify with the bytes its operands
    hold and their floor, then XLA's matrix products and XLA's other operations as two groups; the step's own
    (untraced) time in its label."""
    header = ["model", "step (untraced ms)", "operation", "calls", "ms", "share", "MB read", "floor ms", "vs floor"]
    rows = []
    for res, doc in items:
        if doc is None:
            rows.append([res.label, PENDING] + [DASH] * 7)
            continue
        for rec in records(doc):
            step = f"{rec['step']} ({num(rec['step_ms'])})"
            ops = rec["ops"]
            total = max(sum(o["ms"] for o in ops), 1e-12)
            kernels = [o for o in ops if o["op"].startswith("kvjax_")]  # this library's native kernels
            products = [o for o in ops if o["op"] in XLA_PRODUCTS]  # XLA's own matrix products (a prefill chunk's)
            rest = [o for o in ops if not o["op"].startswith("kvjax_") and o["op"] not in XLA_PRODUCTS]
            for o in kernels:
                rows.append([res.label, step, f"`{o['op']}`", num(o["count"]), num(o["ms"]),
                             f"{100 * o['ms'] / total:.0f}%", num(o["bytes"] / 1e6) if o["bytes"] else DASH,
                             num(o.get("floor_ms")), ratio(o.get("ratio"))])
            groups = (("XLA's matrix products", products), (f"XLA's other operations ({len(rest)} kinds)", rest))
            for label, group in groups:
                if group:
                    ms = sum(o["ms"] for o in group)
                    rows.append([res.label, step, label, num(sum(o["count"] for o in group)), num(ms),
                                 f"{100 * ms / total:.0f}%", DASH, DASH, DASH])
    return table(header, rows)


RENDER = {"exact_tasks": render_exact_tasks, "parity": render_parity, "roofline": render_roofline,
          "vericache": render_vericache, "vericache_ablation": render_vericache,
          "vericache_cheap_drafts": render_vericache,
          "vericache_exactness": render_vericache_exactness, "scheduler": render_scheduler,
          "prefill": render_prefill, "fused_loops": render_fused_loops, "prefix_cache": render_prefix_cache,
          "remote_prefix": render_remote_prefix, "attention_peers": render_attention_peers,
          "short_verify": render_short_verify, "step_ops": render_step_ops}


# ---- blocks and the README ---------------------------------------------------------------------------------------

def _find(doc, keys: tuple[str, ...]):
    """The first value of any of `keys` in the document, its `meta` or its `config` (where scripts record a run)."""
    if not isinstance(doc, dict):
        return None
    for scope in (doc, doc.get("meta") or {}, doc.get("config") or {}):
        for k in keys:
            if isinstance(scope, dict) and scope.get(k):
                return scope[k]
    return None


def machine_line(docs: list, labels: list | None = None) -> str:
    """The CPU the files record (`lscpu` model name and L3), else the machine every unrecorded run used; where the
    files name more than one CPU and `labels` (one per doc) are given, which results ran on which."""
    seen, by = [], {}
    for i, doc in enumerate(docs):
        model, l3 = _find(doc, ("cpu_model", "cpu")), _find(doc, ("l3_cache",))
        if model:
            seen.append(f"{model}" + (f", {_find(doc, ('cpus',))} cores" if _find(doc, ("cpus",)) else "")
                        + (f", {l3} L3" if l3 else ""))
            if labels is not None:
                by.setdefault(seen[-1], []).append(labels[i])
    recorded = [s for s in dict.fromkeys(seen)]
    if recorded and len(seen) == len([d for d in docs if d is not None]):  # every file recorded its machine
        if len(recorded) > 1 and by:
            return "Machine: " + "; ".join(f"{m} ({', '.join(repr(x) for x in by[m])})" for m in recorded) + "."
        return "Machine: " + "; ".join(recorded) + "."
    if recorded:
        return f"Machine: {'; '.join(recorded)} (recorded); the others {DEFAULT_MACHINE} (not recorded in their files)."
    return f"Machine: {DEFAULT_MACHINE} (CPU only; not recorded in the files)."


def load(res, root: str):
    path = os.path.join(root, res.path)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def render_block(name: str, results, root: str) -> str:
    """The Markdown between one table's markers: table, machine line, and each result's regenerate commands."""
    items = [(r, load(r, root)) for r in results if r.table == name]
    if not items:  # a block placed ahead of its first registry line
        return f"{PENDING} (no result registered for this table yet)"
    lines = [RENDER[name](items), "", machine_line([d for _, d in items], [r.label for r, _ in items])]
    for r, doc in items:
        files = f"`{r.path}`" + (f", `{r.path[:-5]}.png`" if r.png else "")
        if doc is None:
            lines.append(f"- {r.label}: {PENDING} — `python scripts/regenerate_results.py --only {r.name}`")
        else:
            lines.append(f"- {r.label} ({files}): `python scripts/regenerate_results.py --only {r.name}`, i.e. "
                         f"`{r.command()}`")
    return "\n".join(lines)


MARKER = re.compile(r"(<!-- results:(\w+) -->)(.*?)(<!-- /results:\2 -->)", re.S)


def blocks_in(text: str) -> dict[str, str]:
    """{table name: its current contents} for every marked block of `text`."""
    return {m.group(2): m.group(3).strip("\n") for m in MARKER.finditer(text)}


def render_readme(text: str, results, root: str) -> str:
    """`text` with every marked block re-rendered; a registry table without a block, or a block no render function
    draws, is an error naming it."""
    missing = sorted({r.table for r in results} - set(blocks_in(text)))
    if missing:
        raise ValueError(f"README.md has no <!-- results:NAME --> block for table(s) {', '.join(missing)}")
    unknown = sorted(set(blocks_in(text)) - set(RENDER))
    if unknown:
        raise ValueError(f"README.md has <!-- results:NAME --> blocks no render function draws: {', '.join(unknown)}")
    return MARKER.sub(lambda m: f"{m.group(1)}\n{render_block(m.group(2), results, root)}\n{m.group(4)}", text)


def update_readme(path: str, results, root: str) -> list[str]:
    """Re-render the README's marked blocks in place; returns the names of the blocks that changed."""
    with open(path, encoding="utf-8") as f:
        old = f.read()
    new = render_readme(old, results, root)
    before, after = blocks_in(old), blocks_in(new)
    if new != old:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return [k for k in after if before.get(k) != after[k]]
