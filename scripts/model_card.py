"""Render a checkpoint's model card (README.md) from its train_log.json, config.json and corpus_manifest.json.

    python scripts/model_card.py checkpoints/kvjax-code-tiny

`scripts/train_tiny.py` calls this at the end of a run, so every figure in the card comes from a measured run.
"""

from __future__ import annotations

import json
import os
import sys


def render(ckpt: str) -> str:
    with open(os.path.join(ckpt, "train_log.json")) as f:
        log = json.load(f)
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    man_path = os.path.join(ckpt, "corpus_manifest.json")
    man = json.load(open(man_path)) if os.path.exists(man_path) else {}
    splits = man.get("splits", {})

    def nfiles(name):
        s = splits.get(name, {})
        files = s.get("files") if isinstance(s, dict) else s
        return len(files) if files is not None else "?"

    kv_tok = log.get("kv_bytes_per_token_f32")
    w = log["weights_bytes_bf16"]
    rows = "\n".join(f"| {k} | {v} |" for k, v in log["val_ppl"].items())
    plain = log.get("val_ppl_without_rope_scaling") or {}
    plain_rows = "\n".join(f"| {k} | {v} |" for k, v in plain.items())
    rope = cfg.get("rope_parameters", {})
    kv_lines = ""
    if kv_tok:
        kv_lines = (f"- KV cache: {kv_tok} bytes per token in f32 ({kv_tok // 2} in bf16); at 16K tokens "
                    f"{kv_tok * 16384 / 2**20:.0f} MiB, at 32K {kv_tok * 32768 / 2**20:.0f} MiB — "
                    f"{kv_tok * 32768 / (2 * w):.1f}× the f32 weights at 32K.\n")
    return f"""# kvjax-code-tiny

A small Llama-family code model trained from scratch on the Python standard library, shipped so that kvjax runs
with nothing to download and so that draft acceptance is measured on real attention patterns. It writes
plausible-looking Python, not correct programs.

## Model
- Architecture: `{cfg['model_type']}` ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, MLP
  {cfg['intermediate_size']}, {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads of
  dim {cfg['head_dim']}, tied embeddings, vocabulary {cfg['vocab_size']}).
- Parameters: {log['params']:,} ({w / 2**20:.1f} MiB in bf16; `model.safetensors` and the Orbax checkpoint in
  `orbax/` hold bf16 weights).
{kv_lines}- Positions: trained at {log['context']} tokens with RoPE θ = {rope.get('rope_theta')}; shipped with YaRN
  (factor {rope.get('factor')}, original context {rope.get('original_max_position_embeddings')}) so 32K-token prompts
  keep rotation angles the model has seen.
- Tokenizer: byte-level BPE (`tokenizers`), {cfg['vocab_size']} entries, ChatML-style chat template.

## Data
Python {man.get('python_version', '?')} standard library (`*.py`, tests excluded), split by file with a hash of the
relative path: {nfiles('train')} train files, {nfiles('val')} validation files, {nfiles('heldout')} held-out files
(used for the long prompts of the demos and benchmarks). File lists and hashes: `corpus_manifest.json`.

## Recipe
AdamW (Optax; β = 0.9/0.95, weight decay 0.1, clip 1.0), peak LR {log['lr']}, warm-up then cosine decay,
{log['steps']} steps of {log['tokens_per_step']} tokens: the first {int(log['short_fraction'] * 100)}% at
{log['short_context']}-token windows, the rest at {log['context']}. f32 training on the 2-core CPU machine (JAX
{log['jax']}, Python {log['python']}); training took {log['train_seconds'] / 60:.1f} min (whole script
{log['total_seconds'] / 60:.1f} min, machine shared with other jobs). Final training loss {log['final_loss']:.3f}.

Reproduce: `python scripts/train_tiny.py {' '.join(log.get('argv', []))}`

## Validation perplexity (shipped bf16 weights, f32 compute, last 512 tokens of each window)
| context | perplexity |
|---|---|
{rows}

Longest / shortest context ratio: {log.get('ppl_ratio_longest_vs_2k')}.
""" + (f"""
Without rope scaling (same weights, plain RoPE):

| context | perplexity |
|---|---|
{plain_rows}
""" if plain_rows else "")


def render_hybrid(ckpt: str) -> str:
    """Model card of a DeepSeek-V4-style hybrid checkpoint trained by `train_tiny.py --family deepseek_v4`."""
    with open(os.path.join(ckpt, "train_log.json")) as f:
        log = json.load(f)
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    rows = "\n".join(f"| {k} | {v} |" for k, v in log["val_ppl"].items())
    rates = cfg.get("compress_rates", {})
    return f"""# kvjax-hybrid-tiny

A tiny DeepSeek-V4-style hybrid-attention model trained from scratch on the same Python standard-library corpus and
tokenizer as `kvjax-code-tiny`, so the prefix-cache and VeriCache code paths for hybrid attention run on a model whose
attention, compressors and lightning indexer were trained rather than random. It is far too small to write useful
code.

## Model
- `deepseek_v4`, {cfg['num_hidden_layers']} layers: {', '.join(cfg['layer_types'])}; MLPs:
  {', '.join(cfg['mlp_layer_types'])}.
- Hidden {cfg['hidden_size']}, {cfg['num_attention_heads']} query heads of dim {cfg['head_dim']} over one shared K=V
  head, partial RoPE (factor {cfg['partial_rotary_factor']}), sliding window {cfg['sliding_window']}, CSA every
  {rates.get('compressed_sparse_attention')} tokens with a lightning indexer ({cfg['index_n_heads']} heads, top
  {cfg['index_topk']}), HCA every {rates.get('heavily_compressed_attention')} tokens, {cfg['n_routed_experts']} routed
  experts (top {cfg['num_experts_per_tok']}) + 1 shared, hyper-connections x{cfg['hc_mult']}.
- Parameters: {log['params']:,} ({log['weights_bytes_bf16'] / 2**20:.1f} MiB in bf16; f32 where transformers keeps
  f32). `model.safetensors` loads in `transformers.DeepseekV4ForCausalLM` and in `kvjax.load`; Orbax copy in `orbax/`.

## Recipe
AdamW (Optax), peak LR {log['lr']}, {log['steps']} steps of {log['tokens_per_step']} tokens, the first
{int(log['short_fraction'] * 100)}% at {log['short_context']}-token windows, the rest at {log['context']}; f32 on the
2-core CPU machine, {log['train_seconds'] / 60:.1f} min of training. Final training loss {log['final_loss']:.3f}.

Reproduce: `python scripts/train_tiny.py {' '.join(log.get('argv', []))}`

## Validation perplexity (bf16 weights, f32 compute)
| context | perplexity |
|---|---|
{rows}
"""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ckpt = argv[0] if argv else "checkpoints/kvjax-code-tiny"
    with open(os.path.join(ckpt, "config.json")) as f:
        family = json.load(f).get("model_type")
    text = render_hybrid(ckpt) if family == "deepseek_v4" else render(ckpt)
    with open(os.path.join(ckpt, "README.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
