"""Benchmark: full-cache decoding vs lossy draft-cache decoding vs VeriCache (resident and offloaded), one run.

For each held-out long prompt the full cache is prefilled ONCE and copied for every contender; timings cover decoding
only (compression is reported apart). Contenders:
  - full:        `steps.decode` (plain one-token lax loop, the fastest full-cache decoder);
  - reference:   kvjax's verify-shape full-cache decoder (the exactness reference; timed too);
  - lossy[c]:    greedy decoding from draft cache c alone (one `draft_step` call of M-1 tokens);
  - vc[c]:       VeriCache with draft cache c, x = --draft-len, resident full cache;
  - vc[c]+off:   the same with the prompt's full KV in pinned host memory;
  - magicdec:    StreamingLLM drafter, resident, short draft (x = 4) — MagicDec-style;
  - quantspec:   4-bit KIVI drafter, resident, x = 8 — QuantSpec-style;
  - vc-adaptive: draft length per round by the cost model over (2, 4, 8, 16, 32) (`--adaptive` names the drafters;
    default: the first of `--compressors`).
Writes JSON (one record per contender: name, tokens_per_s, speedup_vs_full, identical_fraction,
mean_accepted_per_round, draft_bytes_ratio, ...), prints a table, the ideal speedup predicted from measured
per-phase costs and acceptance, and draws a PNG.

Usage: python scripts/bench_vericache.py --context 32768 --new-tokens 256 --prompts 50 --json out.json
       (--random uses a randomly initialised model of the checkpoint's shape when no trained checkpoint exists)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvjax.arrays import tree_nbytes  # noqa: E402
from kvjax.decode import draft as draft_mod  # noqa: E402
from kvjax.decode import steps  # noqa: E402
from kvjax.decode.reference import reference_step  # noqa: E402
from kvjax.decode import vericache as vc  # noqa: E402
from kvjax.decode.draft_length import DEFAULT_SET  # noqa: E402
from bench_common import (STATIC_DRAFTERS, heldout_prompts, load_bench_model, parse_drafter_spec, run_meta,  # noqa: E402
                          tokens_and_stats)

COMPRESSORS = {**STATIC_DRAFTERS, "refresh": dict(ratio=4.0), "refresh_kivi2": {}, "refresh_kivi4": {}}


def parse_compressor(spec: str, overrides: dict | None = None) -> tuple[str, dict]:
    """`bench_common.parse_drafter_spec` over this benchmark's defaults (COMPRESSORS)."""
    return parse_drafter_spec(spec, COMPRESSORS, overrides, "bench_vericache")


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def lossy_decode(model, dc, first, M):
    """Greedy decoding from the draft cache `dc` alone (ring >= M slots); returns (tokens, decode seconds)."""
    t = time.perf_counter()
    toks, _, _ = draft_mod.draft_step(model.params, model.config, dc, first, jnp.zeros((1,), jnp.int32), x=M - 1,
                                      family=model.family, impl=model.attention)
    toks = np.asarray(toks[0])
    return np.concatenate([np.asarray(first), toks]), time.perf_counter() - t


def plain_full(model, full, first, M):
    t = time.perf_counter()
    rest, _ = steps.decode(model.loop_params(), model.config, full, first, jnp.zeros((1,), jnp.int32), num_steps=M - 1,
                           family=model.family, impl=model.attention)
    rest = np.asarray(rest[0])
    return np.concatenate([np.asarray(first), rest]), time.perf_counter() - t


def reference(model, full, first, M, x):
    seed = jnp.zeros((1,), jnp.int32)
    tok, out, margins = first, [int(first[0])], []
    t = time.perf_counter()
    vparams = model.verify_params()  # what VeriCache verifies with (and its reference reads)
    for _ in range(M - 1):
        tok, row, full, _ = reference_step(vparams, model.config, full, tok, seed, x=x,
                                           family=model.family, impl=model.attention)
        out.append(int(tok[0]))
        top = jax.lax.top_k(row[0], 2)[0]
        margins.append(float(top[0] - top[1]))
    return np.asarray(out, np.int32), time.perf_counter() - t, np.asarray(margins)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--checkpoint", dest="checkpoint", default="checkpoints/kvjax-code-tiny",
                    help="a model directory kvjax.load reads")
    ap.add_argument("--random", action="store_true", help="random model of the checkpoint's shape")
    ap.add_argument("--context", type=int, default=32768, help="cache bucket; prompts fill it minus new tokens")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--draft-len", default="32",
                    help="x, or a comma list: the first is every contender's x (and the reference's), each further "
                         "one adds a contender vc[c]@x=N per drafter, interleaved in the same run")
    ap.add_argument("--compressors", default="streaming,snapkv,kvzip,kivi4,kivi2,dropquant",
                    help="comma list of drafters, each 'name' or 'name:field=value:...' (e.g. "
                         "'refresh,refresh:ratio=8:draft_dtype=bfloat16' compares two settings in one run)")
    ap.add_argument("--ratio", type=float, default=None,
                    help="compression ratio of every drafter (default: each one's, 4x for the token droppers)")
    ap.add_argument("--draft-dtype", choices=("float32", "bfloat16", "int8"), default=None,
                    help="how the drafts' kept keys and values are stored (default float32; int8: codes with a scale "
                         "per head and slot)")
    ap.add_argument("--offload", default="kvzip", help="compressors also run offloaded (comma list, or 'none')")
    ap.add_argument("--adaptive", default=None, help="drafters also run with adaptive x (comma list; default: the "
                                                      "first of --compressors)")
    ap.add_argument("--no-baselines", action="store_true",
                    help="skip the MagicDec/QuantSpec configs (and the adaptive one unless --adaptive names it)")
    ap.add_argument("--no-lossy", action="store_true", help="skip the lossy (draft-cache-only) decoders")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_vericache.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: JSON path with .png)")
    args = ap.parse_args(argv)

    model, model_name = load_bench_model(args.checkpoint, args.random)
    try:
        x, *extra_x = [int(v) for v in args.draft_len.split(",") if v]
    except ValueError:
        raise SystemExit(f"bench_vericache: error: --draft-len {args.draft_len!r} is not a comma list of integers") \
            from None
    M = args.new_tokens
    xs_adapt = DEFAULT_SET
    xmax = max(x, *extra_x, *xs_adapt, 8)
    P = args.context - M - xmax - 2  # the whole run fits the --context capacity bucket
    prompts, source = heldout_prompts(model, model_name, P, args.prompts, args.seed)
    names = [c for c in args.compressors.split(",") if c]
    off = [] if args.offload == "none" else [c for c in args.offload.split(",") if c in names]
    if not args.no_baselines:  # the MagicDec- and QuantSpec-style baselines draft with these two
        names += [b for b in ("streaming", "kivi4") if b not in names and b in model.family.compressors]
    overrides = {k: v for k, v in (("ratio", args.ratio), ("draft_dtype", args.draft_dtype)) if v is not None}
    comps, comp_fields = {}, {}
    for c in names:
        name, fields = parse_compressor(c, overrides)
        try:
            comps[c] = model.family.make_compressor(name, **fields)
        except (TypeError, ValueError) as e:
            raise SystemExit(f"bench_vericache: error: compressor {c!r}: {e}") from None
        comp_fields[c] = fields
    print(f"[bench] prompts: {len(prompts)} x {P} tokens ({source}); new tokens {M}; x = {x}; "
          f"capacity {vc.capacity_for(P, M, xmax)}; devices {jax.devices()}")

    contenders = [("full", None), ("reference", None)]
    contenders += [] if args.no_lossy else [(f"lossy[{c}]", c) for c in names]
    contenders += [(f"vc[{c}]", c) for c in names]
    contenders += [(f"vc[{c}]@x={xi}", c) for xi in extra_x for c in names]
    contenders += [(f"vc[{c}]+offload", c) for c in off]
    if not args.no_baselines:
        contenders += [(n, c) for n, c in (("magicdec[streaming,x=4]", "streaming"), ("quantspec[kivi4,x=8]", "kivi4"))
                       if c in comps]
    if not args.no_baselines or args.adaptive:  # an explicit --adaptive runs even without the baselines
        adaptive = [c for c in (args.adaptive or names[0]).split(",") if c]
        missing = [c for c in adaptive if c not in names]
        if missing:  # a drafter runs adaptive only with its compressed cache, which --compressors makes
            raise SystemExit(f"bench_vericache: error: --adaptive {','.join(missing)} not in --compressors")
        contenders += [(f"vc-adaptive[{c}]", c) for c in adaptive]
    acc = {n: dict(time=0.0, tokens=0, identical=0, match=0, first_div=[], stats=[], times=[]) for n, _ in contenders}
    plain_agree, plain_margins = [], []
    compress_s = {}

    for pi, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        full, first = vc.prefill_for(model, prompt, M, max_draft=xmax)
        jax.block_until_ready(full)
        t_prefill = time.perf_counter() - t0
        warm = pi == 0  # the first prompt also compiles: run it twice, time the second
        for _ in range(2 if warm else 1):
            ref, t_ref, margins = reference(model, copy(full), first, M, x)
        acc["reference"]["time"] += t_ref
        acc["reference"]["tokens"] += M
        results = {}
        drafts = {}  # compress once per prompt (ring big enough for the lossy run), copy per contender
        for c in names:
            t0 = time.perf_counter()
            drafts[c] = comps[c](model.params, model.config, full, prompt, recent_slots=max(M, xmax) + 1)
            jax.block_until_ready(drafts[c])
            compress_s.setdefault(c, []).append(time.perf_counter() - t0)
        for name, c in contenders:
            if name == "reference":
                continue
            for rep in range(2 if warm else 1):
                if name == "full":
                    toks, dt = plain_full(model, copy(full), first, M)
                    st = {}
                elif name.startswith("lossy"):
                    toks, dt = lossy_decode(model, copy(drafts[c]), first, M)
                    st = {}
                else:
                    kw = dict(compressor=comps[c], draft_len=x, offload=name.endswith("+offload"))
                    if name.startswith("magicdec"):
                        kw["draft_len"] = 4
                    elif name.startswith("quantspec"):
                        kw["draft_len"] = 8
                    elif "@x=" in name:
                        kw["draft_len"] = int(name.rsplit("@x=", 1)[1])
                    elif name.startswith("vc-adaptive"):
                        kw.update(draft_len=8, adaptive=xs_adapt)
                        if warm and rep == 0:  # compile every length it may pick, so no timed round compiles
                            for xi in xs_adapt:
                                vc.run_vericache(model, copy(full), first, prompt, min(M, 2 * xi + 2),
                                                 draft_cache=copy(drafts[c]), **{**kw, "draft_len": xi,
                                                                                 "adaptive": None})
                    toks, st = tokens_and_stats(vc.run_vericache(model, copy(full), first, prompt, M,
                                                                   draft_cache=copy(drafts[c]), **kw))
                    dt = st["decode_s"]
            results[name] = toks
            a = acc[name]
            a["time"] += dt
            a["times"].append(dt)
            a["tokens"] += M
            same = toks == ref
            a["identical"] += int(same.all())
            a["match"] += float(same.mean())
            a["first_div"].append(int(np.argmin(same)) if not same.all() else M)
            if st:
                a["stats"].append(st)
        agree = results["full"] == ref
        plain_agree.append(float(agree.mean()))
        if not agree.all():
            j = int(np.argmin(agree))
            plain_margins.append(float(margins[j - 1]) if j > 0 else float("nan"))
        del full
        print(f"[bench] prompt {pi + 1}/{len(prompts)} prefill {t_prefill:.2f}s; "
              + " ".join(f"{n}={'ok' if np.array_equal(results[n], ref) else 'DIFF'}" for n in results
                         if n.startswith("vc") or n.startswith("magic") or n.startswith("quant")), flush=True)

    records = []
    full_tps = acc["full"]["tokens"] / acc["full"]["time"]
    n_p = len(prompts)
    for name, c in contenders:
        a = acc[name]
        tps = a["tokens"] / a["time"]
        ident = 1.0 if name == "reference" else a["identical"] / n_p  # the reference defines identity
        rec = dict(name=name, tokens_per_s=tps, speedup_vs_full=tps / full_tps, identical_fraction=ident,
                   token_match_fraction=a["match"] / n_p if name != "reference" else 1.0,
                   mean_first_divergence=float(np.mean(a["first_div"])) if a["first_div"] else float(M),
                   mean_accepted_per_round=None, draft_bytes_ratio=None)
        if a["times"] and name != "reference":  # each prompt's own ratio (same prompt, same token count)
            rec["per_prompt_speedup"] = [f / t for f, t in zip(acc["full"]["times"], a["times"])]
        if a["stats"]:
            S = a["stats"]
            mean = lambda k: float(np.mean([s[k] for s in S]))  # noqa: E731
            rec.update(mean_accepted_per_round=mean("mean_accepted_per_round"),
                       draft_bytes_ratio=mean("draft_bytes_ratio"), verifications=mean("verifications"),
                       mean_draft_round_s=mean("mean_draft_step_s"), mean_verify_s=mean("mean_verify_s"),
                       mean_transfer_s=mean("mean_transfer_s"), mean_x=mean("mean_x"),
                       mean_refresh_s=mean("mean_refresh_s"),
                       compress_s=float(np.mean(compress_s[c])), device_read_bytes_per_token=mean("device_read_bytes_per_token"),
                       h2d_bytes_per_token=mean("h2d_bytes_per_token"), device_peak_bytes=mean("device_peak_bytes"),
                       device_resident_bytes=mean("device_resident_bytes"),
                       accepted_histogram=np.sum([np.pad(s["accepted_histogram"], (0, 64 - len(s["accepted_histogram"])))
                                                  for s in S], axis=0).tolist())
            # ideal: per-phase costs and acceptance alone, no host overhead: tokens emitted / time in the phases, every
            # prompt's rounds pooled (its phase means weighted by its rounds: a plain mean over prompts of each prompt's
            # round favoured the prompts of short rounds, and read adaptive runs at 0.86-0.89 of ideal for no lost time)
            rounds = [s["verifications"] for s in S]
            phases = [s["mean_draft_step_s"] + s["mean_verify_s"] + s["mean_transfer_s"] + s["mean_refresh_s"]
                      for s in S]
            t_all = sum(n * t for n, t in zip(rounds, phases))
            rec["refresh_fraction_of_round"] = sum(n * s["mean_refresh_s"] for n, s in zip(rounds, S)) / t_all
            ideal_tps = sum(n * (s["mean_accepted_per_round"] + 1) for n, s in zip(rounds, S)) / t_all
            rec["ideal_speedup"] = ideal_tps / full_tps
            rec["achieved_fraction_of_ideal"] = rec["speedup_vs_full"] / rec["ideal_speedup"]
            # where a round's time goes, in full-cache decode steps (the levers: a cheaper draft token needs fewer
            # weight bytes per step, a cheaper verify a faster attention over x + 1 rows)
            full_s = 1 / full_tps
            rec.update(draft_token_in_decode_steps=rec["mean_draft_round_s"] / max(rec["mean_x"], 1e-9) / full_s,
                       verify_in_decode_steps=rec["mean_verify_s"] / full_s,
                       refresh_in_decode_steps=rec["mean_refresh_s"] / full_s,
                       draft_cache_bytes=mean("draft_bytes"), full_prompt_cache_bytes=mean("full_prompt_bytes"))
        elif name.startswith("lossy"):
            rec["draft_bytes_ratio"] = None
        records.append(rec)

    out = dict(config=dict(context=args.context, prompt_tokens=P, new_tokens=M, prompts=n_p, draft_len=x,
                           extra_draft_lens=extra_x,
                           prompt_source=source, model=model_name, compressor_fields=comp_fields,
                           full_ms_per_token=1000 / full_tps, weight_bytes=tree_nbytes(model.params),
                           **run_meta()),
               plain_vs_reference=dict(mean_token_agreement=float(np.mean(plain_agree)),
                                       margins_at_first_disagreement=plain_margins),
               records=records)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    hdr = f"{'contender':40s} {'tok/s':>8s} {'speedup':>8s} {'ident':>6s} {'match':>6s} {'acc/rd':>7s} " \
          f"{'bytes':>6s} {'ideal':>6s} {'achv':>5s}  per-round draft/verify/transfer/refresh ms"
    print(hdr)
    for r in records:
        f = lambda v, fmt: (fmt % v) if v is not None else "-"  # noqa: E731
        phases = ""
        if r.get("mean_verify_s") is not None:
            phases = f"{1e3 * r['mean_draft_round_s']:.1f}/{1e3 * r['mean_verify_s']:.1f}/" \
                     f"{1e3 * r['mean_transfer_s']:.1f}/{1e3 * r['mean_refresh_s']:.1f}"
        print(f"{r['name']:40s} {r['tokens_per_s']:8.1f} {r['speedup_vs_full']:8.2f} {r['identical_fraction']:6.2f} "
              f"{r['token_match_fraction']:6.3f} {f(r['mean_accepted_per_round'], '%7.2f'):>7s} "
              f"{f(r['draft_bytes_ratio'], '%6.3f'):>6s} {f(r.get('ideal_speedup'), '%6.2f'):>6s} "
              f"{f(r.get('achieved_fraction_of_ideal'), '%5.2f'):>5s}  {phases}")
    print(f"[bench] plain one-token decoding agrees with the reference on {100 * np.mean(plain_agree):.2f}% of "
          f"tokens; margins at first disagreements: {plain_margins}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4.5))
        names_ = [r["name"] for r in records]
        colors = ["tab:gray" if n in ("full", "reference") else "tab:red" if n.startswith("lossy") else "tab:blue"
                  for n in names_]
        ax.bar(range(len(records)), [r["speedup_vs_full"] for r in records], color=colors)
        for i, r in enumerate(records):
            ax.text(i, r["speedup_vs_full"], f"{r['identical_fraction']:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(records)), names_, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("tokens/s vs full cache (label: identical fraction)")
        ax.set_title(f"VeriCache, {P}-token prompts, {M} new tokens, x={x}")
        fig.tight_layout()
        png = args.plot or os.path.splitext(args.json)[0] + ".png"
        fig.savefig(png, dpi=120)
        print(f"[bench] wrote {args.json} and {png}")
    except ImportError:
        print(f"[bench] wrote {args.json} (matplotlib missing: no plot)")


if __name__ == "__main__":
    main()
