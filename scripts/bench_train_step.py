"""Training-step throughput, old vs new, side by side in one run (interleaved rounds, same machine state).

    python scripts/bench_train_step.py --context 512 --tokens-per-step 16384 --micro 8192 --rounds 3

"old" is the step of the previous scripts/train_tiny.py: `jax.jit` of value_and_grad through the decode-time
forward (`llama.forward_train`: cache writes, the attention dispatcher), log-softmax loss, loss fetched to the
host every step, no donation. "new" is `kvjax.training.step.make_train_step`: dense causal attention (or blocked, `--attention-block`), the loss
from logsumexp, gradient accumulation over micro-batches of `--micro` tokens, params/optimizer state donated,
the loss fetched once per round. Each round times `--steps` steps of each contender after a compile+warm-up step;
the report is tokens/s per contender (median over rounds), effective GFLOP/s and the new/old ratio, as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvjax.models import llama  # noqa: E402
from kvjax.training.forward import next_token_loss  # noqa: E402
from kvjax.training.flops import train_flops_per_token  # noqa: E402
from kvjax.training.model_config import tiny_llama_config  # noqa: E402
from kvjax.training.step import make_optimizer, make_train_step  # noqa: E402


def old_step(cfg, opt):
    def loss_fn(params, batch):
        logits = llama.forward_train(params, cfg, batch[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return jnp.mean(-jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0])

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--micro", type=int, default=0, help="tokens per micro-batch of the new step (0: no split)")
    ap.add_argument("--attention-block", type=int, default=0,
                    help="query block of the new step's blocked causal attention (0: dense)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per contender per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only-new", action="store_true", help="skip the old step (e.g. shapes it cannot fit)")
    args = ap.parse_args(argv)

    cfg = tiny_llama_config(context=args.context)
    T = args.context
    batch = max(1, args.tokens_per_step // T)
    micro = batch if args.micro <= 0 else max(1, min(batch, args.micro // T))
    if batch % micro:
        raise SystemExit(f"--micro {args.micro}: {batch} windows per step do not split into micro-batches of {micro}")
    tokens = batch * T
    rng = np.random.default_rng(0)
    data = rng.integers(0, cfg.vocab_size, (batch, T + 1)).astype(np.int32)
    opt = make_optimizer(1e-3, 10, 1000)

    def fresh():
        p = llama.init_params(cfg, jax.random.PRNGKey(0))
        return p, opt.init(p)

    contenders = {}
    new = make_train_step(cfg, opt, functools.partial(next_token_loss, attention_block=args.attention_block,
                                                    dense_up_to=0))
    new_batch = jnp.asarray(data.reshape(batch // micro, micro, T + 1))
    contenders["new"] = [new, *fresh(), new_batch, True]
    if not args.only_new:
        contenders["old"] = [old_step(cfg, opt), *fresh(), jnp.asarray(data), False]
    times = {k: [] for k in contenders}
    for k, c in contenders.items():  # compile + warm up
        step, p, s, b, _ = c
        p, s, loss = step(p, s, b)
        float(loss)
        c[1], c[2] = p, s
    for _ in range(args.rounds):
        for k, c in contenders.items():
            step, p, s, b, once = c
            t0 = time.perf_counter()
            for _ in range(args.steps):
                p, s, loss = step(p, s, b)
                if not once:
                    float(loss)  # the old loop's per-step host round trip
            float(loss)
            times[k].append((time.perf_counter() - t0) / args.steps)
            c[1], c[2] = p, s
    flops = train_flops_per_token(cfg, T)
    out = dict(context=T, tokens_per_step=tokens, micro_windows=micro, attention_block=args.attention_block, steps=args.steps, rounds=args.rounds,
               load_avg=os.getloadavg())
    for k, ts in times.items():
        s = float(np.median(ts))
        out[k] = dict(step_s=round(s, 4), tokens_per_s=round(tokens / s, 1),
                      effective_gflops=round(tokens / s * flops / 1e9, 2), rounds_s=[round(t, 4) for t in ts])
    if "old" in out:
        out["new_over_old"] = round(out["new"]["tokens_per_s"] / out["old"]["tokens_per_s"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
