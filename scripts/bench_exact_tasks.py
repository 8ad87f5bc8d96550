"""Benchmark: long-context tasks with exact answers — decoding from a lossy cache alone vs full-cache decoding vs
VeriCache, one run.

The tasks (`kvjax.data.exact_tasks`): a value or a function signature buried at a stated depth in real source code
the model never trained on, asked for at the end of the prompt; an answer counts only when the continuation starts
with it character for character. For each task the full cache is prefilled once and copied for every contender;
timings cover decoding only. Contenders:
  - reference:  kvjax's full-cache decoder through the verify shape (the exactness reference, x + 1 rows a step);
  - full:       plain one-token full-cache decoding (`steps.decode`, the fastest full-cache decoder; its agreement
                with the reference is reported);
  - lossy[c]:   greedy decoding from draft cache c alone (`draft.decode_from_draft`), the first token from the
                prefill as a lossy-cache method computes it;
  - vc[c]:      VeriCache with draft cache c (resident, x = --draft-len).
Every drafter runs at a 4x budget (token droppers keep a quarter of the prompt; KIVI stores 4 or 2 bits). The script
stops with an error unless every VeriCache output equals the reference's token for token.

Writes JSON (`records`: one per contender and context, with accuracy, tokens_per_s, identical_fraction; `tasks`:
each task's answer and every contender's continuation), prints a table, and plots accuracy per contender
(`kvjax plot FILE` draws the same plot).

Usage: python scripts/bench_exact_tasks.py --model DIR --context 4096,8192 --tasks 10 --json out.json
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvjax import api  # noqa: E402
from kvjax.data import exact_tasks  # noqa: E402
from kvjax.decode import draft as draft_mod  # noqa: E402
from kvjax.decode import steps  # noqa: E402
from kvjax.decode import vericache as vc  # noqa: E402
from kvjax.decode.reference import reference_step  # noqa: E402
from bench_common import (STATIC_DRAFTERS, add_model_args, model_label, parse_model_args, run_meta,  # noqa: E402
                          tokens_and_stats)

# a 4x budget for every drafter (dropquant, which halves and quantizes, is left out: its budget is not 4x)
DRAFTERS = {**{k: v for k, v in STATIC_DRAFTERS.items() if k != "dropquant"}, "refresh": dict(ratio=4.0),
            "refresh_kivi4": {}}


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def timed(fn):
    t = time.perf_counter()
    out = np.asarray(fn())
    return out, time.perf_counter() - t


def reference(model, full, first, M, x):
    seed, tok, out = jnp.zeros((1,), jnp.int32), first, [int(first[0])]
    vparams = model.verify_params()  # what VeriCache verifies with (and its reference reads)
    for _ in range(M - 1):
        tok, _, full, _ = reference_step(vparams, model.config, full, tok, seed, x=x,
                                         family=model.family, impl=model.attention)
        out.append(int(tok[0]))
    return np.asarray(out, np.int32)


def plain_full(model, full, first, M):
    rest, _ = steps.decode(model.loop_params(), model.config, full, first, jnp.zeros((1,), jnp.int32), num_steps=M - 1,
                           family=model.family, impl=model.attention)
    return jnp.concatenate([first, rest[0]])


def run_context(model, tasks, names, comps, M, x, log):
    """Every contender on every task of one context length: {contender: [(tokens, seconds)]}."""
    tok = model.tokenizer
    runs = {n: [] for n in ["reference", "full"] + [f"lossy[{c}]" for c in names] + [f"vc[{c}]" for c in names]}
    for ti, task in enumerate(tasks):
        prompt = task.prompt_ids
        t0 = time.perf_counter()
        full, first = vc.prefill_for(model, prompt, M, max_draft=x)
        jax.block_until_ready(full)
        t_prefill = time.perf_counter() - t0
        reps = 2 if ti == 0 else 1  # the first task also compiles: run each contender twice, keep the second
        for _ in range(reps):
            ref, t = timed(lambda: reference(model, copy(full), first, M, x))
        runs["reference"].append((ref, t))
        for _ in range(reps):
            out = timed(lambda: plain_full(model, copy(full), first, M))
        runs["full"].append(out)
        for c in names:
            dc = comps[c](model.params, model.config, full, prompt, recent_slots=max(M, x) + 1)
            for _ in range(reps):
                out = timed(lambda: draft_mod.decode_from_draft(model, copy(dc), first, M))
            runs[f"lossy[{c}]"].append(out)
            for _ in range(reps):
                toks, st = tokens_and_stats(vc.run_vericache(model, copy(full), first, prompt, M, compressor=comps[c],
                                                             draft_len=x, draft_cache=copy(dc)))
            if not np.array_equal(toks, ref):
                raise SystemExit(f"bench_exact_tasks: error: VeriCache[{c}] differs from full-cache decoding on task "
                                 f"{ti} ({task.kind}, depth {task.depth}): {toks.tolist()} vs {ref.tolist()}")
            runs[f"vc[{c}]"].append((toks, st["decode_s"]))
            del dc
        del full
        marks = " ".join(f"{n}={'ok' if task.is_correct(tok.decode(r[-1][0])) else 'x'}" for n, r in runs.items())
        log(f"[bench] task {ti + 1}/{len(tasks)} {task.kind} depth {task.depth} ({prompt.size} tokens, prefill "
            f"{t_prefill:.1f}s): {marks}")
    return runs


def summarise(ctx, tasks, runs, tok, M):
    ref = runs["reference"]
    records, per_task = [], [dict(context=ctx, kind=t.kind, depth=t.depth, prompt_tokens=int(t.prompt_ids.size),
                                  needle_token=t.needle_token, answer=t.answer, continuations={}) for t in tasks]
    for name, rs in runs.items():
        correct = []
        for i, (toks, _) in enumerate(rs):
            text = tok.decode(toks)
            correct.append(tasks[i].is_correct(text))
            per_task[i]["continuations"][name] = dict(text=text, correct=correct[-1])
        records.append(dict(name=name, context=ctx, prompt_tokens=int(np.mean([t.prompt_ids.size for t in tasks])),
                            tasks=len(tasks), correct=int(sum(correct)), accuracy=float(np.mean(correct)),
                            tokens_per_s=len(rs) * M / sum(s for _, s in rs),
                            identical_fraction=float(np.mean([np.array_equal(a, r) for (a, _), (r, _) in
                                                              zip(rs, ref)])),
                            answers_equal_to_reference=float(np.mean(
                                [a == b for a, b in zip(correct, [t.is_correct(tok.decode(r)) for t, (r, _) in
                                                                  zip(tasks, ref)])]))))
    return records, per_task


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap, context="4096", compressors=",".join(DRAFTERS), new_tokens=24,
                   new_tokens_help="tokens decoded per task (the answer must fit)",
                   json_default="bench_exact_tasks.json")
    ap.add_argument("--tasks", type=int, default=10, help="tasks per context (kinds alternate, depths cycle)")
    ap.add_argument("--kinds", default="value", help="task kinds, comma-separated (signature: SmolLM2-135M copies "
                                                      "a 4-parameter list from 4K back in 1 of 4 tries, full cache)")
    ap.add_argument("--depths", default=",".join(str(d) for d in exact_tasks.DEFAULT_DEPTHS))
    ap.add_argument("--draft-len", type=int, default=8)
    ap.add_argument("--plot", default=None, help="PNG path (default: JSON path with .png)")
    args = ap.parse_args(argv)
    contexts, names = parse_model_args(ap, args, DRAFTERS, 256)
    depths = tuple(float(d) for d in args.depths.split(",") if d)
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or any(k not in exact_tasks.KINDS for k in kinds):
        ap.error(f"--kinds: expected some of {', '.join(exact_tasks.KINDS)}, got {args.kinds!r}")
    M, x = args.new_tokens, args.draft_len

    model = api.load(args.model)
    if model.tokenizer is None:
        ap.error(f"--model {args.model}: the tasks need the model's tokenizer")
    comps = {c: model.family.make_compressor(c, **DRAFTERS[c]) for c in names}
    records, per_task = [], []
    for ctx in contexts:
        tasks = exact_tasks.make_tasks(model.tokenizer, ctx - M - x - 2, args.tasks, args.seed, kinds=kinds,
                                       depths=depths)
        print(f"[bench] {len(tasks)} tasks of <= {ctx - M - x - 2} prompt tokens; {M} new tokens; x = {x}; "
              f"haystack {exact_tasks.HAYSTACK_DISTRIBUTION} {exact_tasks.haystack_version()}", flush=True)
        runs = run_context(model, tasks, names, comps, M, x, lambda s: print(s, flush=True))
        r, p = summarise(ctx, tasks, runs, model.tokenizer, M)
        records += r
        per_task += p

    print(f"{'context':>7s} {'contender':24s} {'accuracy':>9s} {'tok/s':>8s} {'ident':>6s}")
    for r in records:
        print(f"{r['context']:7d} {r['name']:24s} {r['correct']:3d}/{r['tasks']:<3d} {r['accuracy']:.2f} "
              f"{r['tokens_per_s']:8.1f} {r['identical_fraction']:6.2f}")
    vcs = [r for r in records if r["name"].startswith("vc[")]
    print(f"[bench] VeriCache answers equal full-cache decoding's on every task: "
          f"{all(r['identical_fraction'] == 1.0 for r in vcs)} ({len(vcs)} drafter x context runs)")
    out = dict(config=dict(model=model_label(args.model), contexts=contexts, tasks=args.tasks, new_tokens=M,
                           draft_len=x, kinds=kinds, depths=depths, seed=args.seed, budget="4x",
                           haystack=f"{exact_tasks.HAYSTACK_DISTRIBUTION}=={exact_tasks.haystack_version()}",
                           **run_meta()),
               records=records, tasks=per_task)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    png = args.plot or os.path.splitext(args.json)[0] + ".png"
    from kvjax import plots

    plots.plot_accuracy(plots.load([args.json]), png)
    print(f"[bench] wrote {args.json} and {png}")


if __name__ == "__main__":
    main()
