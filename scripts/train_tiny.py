"""Train the small bundled code model (or any architecture kvjax supports) on the Python standard library.

Reproduces checkpoints/kvjax-code-tiny (Llama family) and the hybrid checkpoint (``--family deepseek_v4``):

    python scripts/train_tiny.py --out checkpoints/kvjax-code-tiny

Recipe: AdamW (Optax) with warm-up + cosine decay, a context curriculum (short windows first, then ``--context``
tokens), random windows of the train split, f32 training, bf16 weights shipped. After training it evaluates
validation perplexity at several context lengths with the shipped rope config and writes config.json,
model.safetensors, an Orbax checkpoint, train_log.json and the model card figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvjax.models.llama.config import ModelConfig  # noqa: E402
from kvjax.models.rope import RopeConfig
from kvjax.models.layer_types import FULL
from kvjax.tokenizer import Tokenizer  # noqa: E402
from kvjax.data import corpus  # noqa: E402


def llama_family(args, vocab: int, eos: int) -> tuple[ModelConfig, object]:
    from kvjax.models import llama

    cfg = ModelConfig(
        family="llama", vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
        rms_norm_eps=1e-5, rope=RopeConfig(rope_type="default", theta=args.rope_theta),
        layer_types=(FULL,) * args.layers, tie_word_embeddings=True, max_position_embeddings=args.context,
        eos_token_ids=(eos,),
    )
    return cfg, llama


def with_long_context_rope(cfg: ModelConfig, factor: float) -> ModelConfig:
    """The shipped config: YaRN over the trained context, so 32K-token prompts keep seen rotation angles."""
    if factor <= 1:
        return cfg
    rope = dataclasses.replace(cfg.rope, rope_type="yarn", factor=factor,
                               original_max_position_embeddings=cfg.max_position_embeddings)
    return dataclasses.replace(cfg, rope=rope, max_position_embeddings=int(cfg.max_position_embeddings * factor))


def make_step(family, cfg, opt):
    def loss_fn(params, batch):
        logits = family.forward_train(params, cfg, batch[:, :-1])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(nll)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def eval_ppl(family, cfg, params, stream: np.ndarray, ctx: int, windows: int, chunk: int = 512) -> float:
    """Perplexity of the last `chunk` tokens of `windows` windows of `ctx` tokens (full context before them)."""
    from kvjax.models.llama.cache import init_cache
    from kvjax.cache.capacity import pick_capacity
    from kvjax.decode import steps

    rng = np.random.RandomState(1234)
    nll, count = 0.0, 0
    for _ in range(windows):
        start = rng.randint(0, len(stream) - ctx - 1)
        seq = stream[start:start + ctx + 1]
        if family.__name__.endswith("llama"):
            cache = init_cache(cfg, 1, pick_capacity(ctx))
            _, cache = steps.prefill(params, cfg, cache, seq[: ctx - chunk])
            logits, _ = steps.forward_step(params, cfg, cache, jnp.asarray(seq[None, ctx - chunk:ctx]),
                                           jnp.asarray([chunk], jnp.int32))
            logits = np.asarray(logits[0])
        else:
            logits = np.asarray(family.forward_train(params, cfg, jnp.asarray(seq[None, :ctx])))[0, -chunk:]
        tgt = seq[ctx - chunk + 1: ctx + 1]
        lp = logits - logits.max(-1, keepdims=True)
        lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
        nll += -lp[np.arange(chunk), tgt].sum()
        count += chunk
    return float(math.exp(nll / count))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--tokenizer", default="checkpoints/kvjax-code-tiny")
    ap.add_argument("--family", default="llama", choices=["llama", "deepseek_v4"])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--short-context", type=int, default=512)
    ap.add_argument("--short-fraction", type=float, default=0.6, help="fraction of steps at --short-context")
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--yarn-factor", type=float, default=16.0)
    ap.add_argument("--eval-contexts", default="2048,8192,16384,32768")
    ap.add_argument("--eval-windows", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hybrid-config", default=None, help="JSON of DeepSeek-V4 config fields (deepseek_v4 only)")
    args = ap.parse_args(argv)

    t_start = time.time()
    tok = Tokenizer.from_dir(args.tokenizer)
    train = corpus.token_stream(tok, "train")
    val = corpus.token_stream(tok, "val")
    print(f"train tokens {len(train):,}  val tokens {len(val):,}", flush=True)

    if args.family == "llama":
        cfg, family = llama_family(args, tok.vocab_size, tok.eos_token_id)
    else:
        from kvjax.models import deepseek_v4 as family

        cfg = family.config_for_training(vocab=tok.vocab_size, eos=tok.eos_token_id,
                                         **json.loads(args.hybrid_config or "{}"))
    params = family.init_params(cfg, jax.random.PRNGKey(args.seed))
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
    print(f"params {n_params:,}", flush=True)

    warmup = min(args.warmup, max(1, args.steps // 4))
    sched = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, end_value=args.lr * 0.05)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1))
    opt_state = opt.init(params)
    step = make_step(family, cfg, opt)
    rng = np.random.RandomState(args.seed)
    log = []
    n_short = int(args.steps * args.short_fraction)
    t_train = time.time()
    for i in range(args.steps):
        ctx = args.short_context if i < n_short else args.context
        bs = max(1, args.tokens_per_step // ctx)
        starts = rng.randint(0, len(train) - ctx - 1, size=bs)
        batch = np.stack([train[s:s + ctx + 1] for s in starts]).astype(np.int32)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(batch))
        if i % 10 == 0 or i == args.steps - 1:
            loss = float(loss)
            el = time.time() - t_train
            log.append(dict(step=i, context=ctx, loss=loss, elapsed_s=el))
            print(f"step {i:5d} ctx {ctx:5d} loss {loss:.4f}  {el:7.1f}s", flush=True)
    train_s = time.time() - t_train

    # Ship bf16 weights; evaluate exactly what is shipped (bf16-rounded, computed in f32).
    shipped = jax.tree.map(lambda a: a.astype(jnp.bfloat16).astype(jnp.float32), params)
    ship_cfg = with_long_context_rope(cfg, args.yarn_factor) if args.family == "llama" else cfg
    # Save first: evaluation at 32K tokens takes minutes on a CPU.
    os.makedirs(args.out, exist_ok=True)
    from safetensors.numpy import save_file

    if args.family == "llama":
        from kvjax.models.llama.weights import hf_config_dict, params_to_tensors
        from kvjax.checkpoint import save_orbax

        hf = hf_config_dict(ship_cfg, torch_dtype="bfloat16")
        tensors = params_to_tensors(ship_cfg, shipped, dtype="bf16")
    else:
        from kvjax.checkpoint import save_orbax

        hf = family.hf_config_dict(cfg)
        tensors = family.params_to_tensors(cfg, shipped, dtype="bf16")
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    save_file(tensors, os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    orbax_dir = os.path.join(args.out, "orbax")
    if os.path.exists(orbax_dir):
        shutil.rmtree(orbax_dir)
    save_orbax(orbax_dir, jax.tree.map(lambda a: a.astype(jnp.bfloat16), params))
    marker = os.path.join(orbax_dir, "commit_success.txt")  # names this machine's path; restore does not need it
    if os.path.exists(marker):
        os.remove(marker)
    if os.path.abspath(args.tokenizer) != os.path.abspath(args.out):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(args.tokenizer, name), os.path.join(args.out, name))
    ppl = {}
    for c in [int(x) for x in args.eval_contexts.split(",") if x]:
        if len(val) < c + 2:
            stream = np.concatenate([val] * (c // len(val) + 2))
        else:
            stream = val
        ppl[c] = eval_ppl(family, ship_cfg, shipped, stream, c, args.eval_windows)
        print(f"val ppl @ {c}: {ppl[c]:.3f}", flush=True)

    # The same weights without rope scaling, for the model card: what YaRN buys at long context.
    ppl_plain = {}
    if args.family == "llama" and ship_cfg is not cfg and ppl:
        for c in sorted({min(ppl), max(ppl)}):
            stream = val if len(val) >= c + 2 else np.concatenate([val] * (c // len(val) + 2))
            ppl_plain[c] = eval_ppl(family, cfg, shipped, stream, c, max(1, args.eval_windows // 2))
            print(f"val ppl @ {c} without rope scaling: {ppl_plain[c]:.3f}", flush=True)

    kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 if args.family == "llama" else None
    result = dict(
        family=args.family, params=n_params, weights_bytes_bf16=2 * n_params, kv_bytes_per_token_f32=kv_bytes_per_token,
        steps=args.steps, tokens_per_step=args.tokens_per_step, context=args.context,
        short_context=args.short_context, short_fraction=args.short_fraction, lr=args.lr,
        train_seconds=round(train_s, 1), total_seconds=round(time.time() - t_start, 1),
        final_loss=log[-1]["loss"], val_ppl={str(k): round(v, 3) for k, v in ppl.items()},
        val_ppl_without_rope_scaling={str(k): round(v, 3) for k, v in ppl_plain.items()},
        ppl_ratio_longest_vs_2k=round(ppl[max(ppl)] / ppl[min(ppl)], 3) if ppl else None,
        yarn_factor=args.yarn_factor, jax=jax.__version__, python=sys.version.split()[0], argv=sys.argv[1:], log=log,
    )
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "log"}, indent=2))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import model_card

    model_card.main([args.out])


if __name__ == "__main__":
    main()
