"""Train the small bundled code model, resumably, in context-length phases; then evaluate and export it.

    python scripts/train_tiny.py --out checkpoints/kvjax-code-tiny-v2-work \
        --phases 512:3M,2048:300k,4096:200k --save-every 20
    python scripts/train_tiny.py --out checkpoints/kvjax-code-tiny-v2-work --resume ...   # same flags: continue
    python scripts/train_tiny.py --out DIR --resume --export-to checkpoints/kvjax-code-tiny --train-steps 0

Recipe: AdamW (Optax) with warm-up and cosine decay over the whole run, phases of window length (short windows
first, the last phase >= 4K tokens so the model learns to use long context), windows of the train split visited
without repeats per epoch (`kvjax.training.windows`), f32 training, bf16 weights shipped with YaRN over the last
phase's context. The step (`kvjax.training.step`) is one jitted program over `--tokens-per-step` tokens,
accumulated over micro-batches of `--micro-tokens`, dense causal attention, params and optimizer state donated,
the loss read back only every `--log-every` steps.

Every `--save-every` steps (and on SIGINT/SIGTERM, and at the end) the whole training state — params, optimizer
state, data position, step, phase, RNG — replaces `<out>/train_state` (Orbax) and `<out>/train_log.json` is
rewritten: one entry per segment (a process's run: start/stop time, steps, tokens, tokens/s, effective GFLOP/s,
machine load) plus the loss curve. `--resume` continues from the saved state with the data the uninterrupted run
would have seen. When the last phase is done (or with `--export-to`), the model is exported, evaluated on held-out
files at `--eval-contexts` through the decode engine, and the model card is rendered.

`--family deepseek_v4` trains the hybrid checkpoint's architecture through its own `forward_train`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvjax.data import corpus  # noqa: E402
from kvjax.tokenizer import Tokenizer  # noqa: E402
from kvjax.training import state as train_state  # noqa: E402
from kvjax.training.flops import train_flops_per_token  # noqa: E402
from kvjax.training.model_config import tiny_llama_config, with_long_context_rope  # noqa: E402
from kvjax.training.phases import parse_phases, phase_at, step_for_tokens, total_steps  # noqa: E402
from kvjax.training.step import make_optimizer, make_train_step  # noqa: E402
from kvjax.training.windows import WindowSampler  # noqa: E402

LOG_NAME = "train_log.json"


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_model(args, vocab: int, eos: int, context: int):
    """(config, params init function, loss function) of the chosen family."""
    if args.family == "llama":
        from kvjax.models import llama
        from kvjax.training.forward import next_token_loss

        cfg = tiny_llama_config(context=context, vocab=vocab, eos=eos, hidden=args.hidden,
                                intermediate=args.intermediate, layers=args.layers, heads=args.heads,
                                kv_heads=args.kv_heads, head_dim=args.head_dim, rope_theta=args.rope_theta)
        return cfg, llama.init_params, functools.partial(next_token_loss, attention_block=args.attention_block,
                                                              dense_up_to=args.dense_up_to)
    from kvjax.models import deepseek_v4

    cfg = deepseek_v4.config_for_training(vocab=vocab, eos=eos, **json.loads(args.hybrid_config or "{}"))

    def loss(params, config, windows):
        logits = deepseek_v4.forward_train(params, config, windows[:, :-1]).astype(jnp.float32)
        picked = jnp.take_along_axis(logits, windows[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)

    return cfg, deepseek_v4.init_params, loss


def read_log(out: str) -> dict:
    path = os.path.join(out, LOG_NAME)
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def write_log(out: str, log: dict) -> None:
    tmp = os.path.join(out, LOG_NAME + ".tmp")
    with open(tmp, "w") as f:
        json.dump(log, f, indent=1)
    os.replace(tmp, os.path.join(out, LOG_NAME))


class StopFlag:
    """Set by SIGINT / SIGTERM so the loop saves the state and stops at the next step boundary."""

    def __init__(self):
        self.set = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        print(f"signal {signum}: saving the training state at the next step boundary", flush=True)
        self.set = True


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="run folder: training state, train_log.json, exported model")
    ap.add_argument("--tokenizer", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--family", default="llama", choices=["llama", "deepseek_v4"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--phases", default="512:3M,2048:300k,4096:200k", help="CONTEXT:TOKENS,... in order")
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--micro-tokens", type=int, default=2048, help="tokens per accumulated micro-batch")
    ap.add_argument("--attention-block", type=int, default=256,
                    help="query block of the blocked causal attention of windows over --dense-up-to (0: dense)")
    ap.add_argument("--dense-up-to", type=int, default=1024, help="windows up to this long attend densely")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=5)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--resume", action="store_true", help="continue from <out>/train_state")
    ap.add_argument("--train-steps", type=int, default=None, help="stop this segment after this many steps")
    ap.add_argument("--max-seconds", type=float, default=None, help="stop this segment after this much training")
    ap.add_argument("--export-to", default=None, help="export/evaluate into this folder even if phases remain")
    ap.add_argument("--no-export", action="store_true", help="never export or evaluate")
    ap.add_argument("--yarn-factor", type=float, default=8.0)
    ap.add_argument("--eval-contexts", default="2048,8192,16384,32768",
                    help="CONTEXT[:WINDOWS],... (windows default to --eval-windows)")
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--eval-splits", default="heldout,val")
    ap.add_argument("--eval-same-tokens", default="2048,8192,16384",
                    help="CONTEXT,...: also score the same tokens (ends of windows of the longest) at each context")
    ap.add_argument("--eval-same-windows", type=int, default=4)
    ap.add_argument("--hybrid-config", default=None, help="JSON of DeepSeek-V4 config fields (deepseek_v4 only)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    tok = Tokenizer.from_dir(args.tokenizer)
    phases = parse_phases(args.phases, args.tokens_per_step)
    n_steps = total_steps(phases)
    cfg, init_params, loss_fn = build_model(args, tok.vocab_size, tok.eos_token_id, phases[-1].context)
    opt = make_optimizer(args.lr, args.warmup, n_steps)
    params = init_params(cfg, jax.random.PRNGKey(args.seed))
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    state = dict(params=params, opt_state=opt.init(params), rng=jax.random.PRNGKey(args.seed + 1), step=0,
                 phase=0, cursor=0, seed=args.seed, tokens=0)
    log = read_log(args.out) if args.resume else {}
    if args.resume:
        state = train_state.restore_state(args.out, state)
        print(f"resumed at step {state['step']} (phase {state['phase']}, window {state['cursor']}, "
              f"{state['tokens']:,} tokens)", flush=True)
        step = step_for_tokens(phases, state["tokens"])
        if step != state["step"]:
            # Resumed with another --tokens-per-step: continue by tokens, and move the optimizer's schedule and
            # bias-correction counters to the same step so the LR curve follows the new step count.
            p_idx, _ = phase_at(phases, step)
            if p_idx != state["phase"]:
                raise SystemExit(f"--tokens-per-step {args.tokens_per_step} would move the run from phase "
                                 f"{state['phase']} to {p_idx}; resume with the tokens per step it was run with")
            state["step"] = step
            counted = optax.tree_utils.tree_set(state["opt_state"], count=jnp.asarray(step, jnp.int32))
            state["opt_state"] = jax.tree.map(jnp.array, counted)  # one buffer per leaf: the step donates them
            print(f"tokens per step changed: continuing at step {step} of {n_steps}", flush=True)
    elif train_state.has_state(args.out):
        raise SystemExit(f"{args.out} already holds a training state; pass --resume to continue it or pick a new --out")
    log.setdefault("runs", dict(argv=sys.argv[1:], phases=args.phases, tokens_per_step=args.tokens_per_step,
                                micro_tokens=args.micro_tokens, lr=args.lr, seed=args.seed))
    log.setdefault("segments", [])
    log.setdefault("loss", [])
    log.update(family=args.family, params=n_params, weights_bytes_bf16=2 * n_params,
               kv_bytes_per_token_f32=(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
                                       if args.family == "llama" else None),
               total_steps=n_steps, jax=jax.__version__, python=sys.version.split()[0])

    train = corpus.token_stream(tok, "train")
    print(f"params {n_params:,}; train tokens {train.size:,}; {n_steps} steps: "
          + ", ".join(f"{p.context}x{p.batch} for {p.steps} steps" for p in phases), flush=True)
    step_fn = make_train_step(cfg, opt, loss_fn)
    samplers: dict[int, WindowSampler] = {}
    stop = StopFlag()

    seg = dict(start_utc=utc_now(), start_step=state["step"], start_tokens=state["tokens"], train_s=0.0,
               compile_s=0.0, load_avg_start=os.getloadavg(), argv=sys.argv[1:], resumed=args.resume)
    log["segments"].append(seg)
    pending: list[tuple[int, int, object]] = []  # (step, context, loss on device) not yet logged
    t_last = time.perf_counter()
    seg_steps = 0

    def flush(final: bool = False):
        nonlocal t_last
        if pending:  # wait for the last step here, so the time it took is on the clock before any rate is printed
            jax.block_until_ready(pending[-1][2])
            now = time.perf_counter()
            seg["train_s"] += now - t_last
            t_last = now
        for s, c, loss in pending:
            log["loss"].append(dict(step=s, context=c, loss=round(float(loss), 4)))
        if pending:
            s, c, loss = pending[-1]
            rate = (state["tokens"] - seg["start_tokens"]) / max(seg["train_s"], 1e-9)
            print(f"step {s:5d}/{n_steps} ctx {c:5d} loss {float(loss):.4f}  {state['tokens']:>11,} tok  "
                  f"{rate:7.0f} tok/s  load {os.getloadavg()[0]:.1f}", flush=True)
        pending.clear()
        seg.update(stop_utc=utc_now(), stop_step=state["step"], tokens=state["tokens"] - seg["start_tokens"],
                   load_avg_stop=os.getloadavg(), final=final)
        timed = seg["train_s"] - seg["compile_s"]
        seg["tokens_per_s"] = round(seg.get("timed_tokens", 0) / timed, 1) if timed > 0 else None
        seg["effective_gflops"] = round(seg.get("timed_flops", 0) / timed / 1e9, 2) if timed > 0 else None

    def save():
        flush()
        train_state.save_state(args.out, state)
        log["train_state_bytes"] = train_state.state_bytes(args.out)
        log["tokens_trained"] = state["tokens"]
        log["steps_done"] = state["step"]
        write_log(args.out, log)

    compiled = set()
    while state["step"] < n_steps and not stop.set:
        if args.train_steps is not None and seg_steps >= args.train_steps:
            break
        if args.max_seconds is not None and seg["train_s"] >= args.max_seconds:
            break
        p_idx, _ = phase_at(phases, state["step"])
        if p_idx != state["phase"]:
            state["phase"], state["cursor"] = p_idx, 0
        ph = phases[p_idx]
        if p_idx not in samplers:
            samplers[p_idx] = WindowSampler(train, ph.context, args.seed, p_idx)
        micro = max(1, min(ph.batch, args.micro_tokens // ph.context))
        while ph.batch % micro:
            micro -= 1
        windows = samplers[p_idx].batch(state["cursor"], ph.batch).reshape(ph.batch // micro, micro, -1)
        first = (ph.context, micro) not in compiled
        state["params"], state["opt_state"], loss = step_fn(state["params"], state["opt_state"],
                                                            jnp.asarray(windows))
        state["step"] += 1
        state["cursor"] += ph.batch
        state["tokens"] += ph.tokens_per_step
        seg_steps += 1
        flops = train_flops_per_token(cfg, ph.context) * ph.tokens_per_step if args.family == "llama" else 0.0
        pending.append((state["step"], ph.context, loss))
        if first:  # time the compile separately: it is not throughput
            jax.block_until_ready(loss)
            compiled.add((ph.context, micro))
        now = time.perf_counter()
        dt = now - t_last
        t_last = now
        seg["train_s"] += dt
        if first:
            seg["compile_s"] += dt
        else:
            seg["timed_tokens"] = seg.get("timed_tokens", 0) + ph.tokens_per_step
            seg["timed_flops"] = seg.get("timed_flops", 0.0) + flops
        if state["step"] % args.log_every == 0:
            flush()
        if state["step"] % args.save_every == 0:
            save()
            t_last = time.perf_counter()  # saving is not training time
    done = state["step"] >= n_steps
    flush(final=done)
    save()
    print(f"segment: {seg['tokens']:,} tokens, {seg['tokens_per_s']} tok/s, {seg['effective_gflops']} GFLOP/s "
          f"effective; state {log['train_state_bytes'] / 2**20:.1f} MiB; {'finished' if done else 'stopped'}",
          flush=True)
    if args.no_export or stop.set or not (done or args.export_to):
        return
    export_and_evaluate(args, cfg, state, log, tok)


def export_and_evaluate(args, cfg, state, log, tok):
    from kvjax import api
    from kvjax.training.evaluate import perplexity, perplexity_by_context
    from kvjax.training.export import export_checkpoint

    dest = args.export_to or args.out
    ship_cfg = with_long_context_rope(cfg, args.yarn_factor) if args.family == "llama" else cfg
    export_checkpoint(dest, args.family, ship_cfg, state["params"], args.tokenizer)
    manifest = os.path.join(args.out, "corpus_manifest.json")  # written by build_corpus.py into the run folder
    if os.path.exists(manifest) and os.path.abspath(dest) != os.path.abspath(args.out):
        shutil.copy(manifest, os.path.join(dest, "corpus_manifest.json"))
    model = api.load(dest)
    ppl = {}
    splits = [s for s in args.eval_splits.split(",") if s]
    for split in splits:
        ppl[split] = {}
        for item in [x for x in args.eval_contexts.split(",") if x]:
            c, _, n = item.partition(":")  # CONTEXT or CONTEXT:WINDOWS
            c, n = int(c), int(n or args.eval_windows)
            t0 = time.perf_counter()
            ppl[split][str(c)] = round(perplexity(model, tok, c, n, split=split), 3)
            log.setdefault("eval_windows_by_context", {})[str(c)] = n
            print(f"{split} ppl @ {c}: {ppl[split][str(c)]}  ({time.perf_counter() - t0:.0f}s)", flush=True)
    same_contexts = sorted(int(c) for c in args.eval_same_tokens.split(",") if c)
    if same_contexts:
        same = {}
        for split in splits:
            t0 = time.perf_counter()
            got = perplexity_by_context(model, tok, same_contexts, args.eval_same_windows, split=split)
            same[split] = {str(c): round(v, 3) for c, v in got.items()}
            print(f"{split} ppl of the same tokens by context: {same[split]}  ({time.perf_counter() - t0:.0f}s)",
                  flush=True)
        log.update(ppl_same_tokens=same, ppl_same_tokens_windows=args.eval_same_windows)
    final_loss = log["loss"][-1]["loss"] if log["loss"] else None
    segs = [s for s in log["segments"] if s.get("tokens_per_s")]
    log.update(val_ppl=ppl.get("heldout", next(iter(ppl.values()), {})), ppl_by_split=ppl,
               eval_windows=args.eval_windows, eval_scored_tokens=512, final_loss=final_loss,
               yarn_factor=args.yarn_factor, trained_context=cfg.max_position_embeddings,
               train_seconds=round(sum(s["train_s"] for s in log["segments"]), 1),
               tokens_per_s=round(sum(s["timed_tokens"] for s in segs)
                                  / sum(s["train_s"] - s["compile_s"] for s in segs), 1) if segs else None,
               effective_gflops=round(sum(s["timed_flops"] for s in segs) / 1e9
                                      / sum(s["train_s"] - s["compile_s"] for s in segs), 2) if segs else None)
    if ppl:
        first = log["val_ppl"]
        log["ppl_ratio_longest_vs_2k"] = round(first[max(first, key=int)] / first[min(first, key=int)], 3)
    write_log(args.out, log)
    if os.path.abspath(dest) != os.path.abspath(args.out):
        write_log(dest, {k: v for k, v in log.items()})
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import model_card

    model_card.main([dest])


if __name__ == "__main__":
    main()
