"""Render a checkpoint's model card (README.md) from its train_log.json, config.json and corpus_manifest.json.

    python scripts/model_card.py checkpoints/kvjax-code-tiny

`scripts/train_tiny.py` calls this at the end of a run, so every figure in the card comes from a measured run.
"""

from __future__ import annotations

import itertools
import json
import os
import sys


def _table(header: str, rows) -> str:
    return header + "\n" + "\n".join(rows)


def _trained_phases(log: dict, run: dict) -> str:
    """What the run actually trained, phase by phase in step order, from its per-step loss log (segments may
    re-plan phases, and a later phase may return to a window length an earlier one used)."""
    per_step = run.get("tokens_per_step") or 0
    steps = sorted(log.get("loss", []), key=lambda e: e["step"])
    phases = [(c, len(list(run_of))) for c, run_of in itertools.groupby(e["context"] for e in steps)]
    if not phases or not per_step:
        return ", then ".join(f"{p.split(':')[1]} tokens at {p.split(':')[0]}-token windows"
                              for p in run.get("phases", "").split(",") if ":" in p)
    return ", then ".join(f"{n} steps ({n * per_step:,} tokens) at {c}-token windows" for c, n in phases)


def _context_table(first_column: str, by_split: dict) -> str:
    """A markdown table of {split: {context: perplexity}}: a row per context, a column per split."""
    contexts = sorted({int(c) for v in by_split.values() for c in v})
    rows = [f"| {c} | " + " | ".join(str(by_split[s].get(str(c), "–")) for s in by_split) + " |" for c in contexts]
    return _table(f"| {first_column} | " + " | ".join(by_split) + " |" + chr(10) + "|---|" + "---|" * len(by_split),
                  rows)


def _same_tokens_section(log: dict) -> str:
    """The table of perplexity of the same tokens at each context (whether longer context helps), if measured."""
    same = log.get("ppl_same_tokens")
    if not same:
        return ""
    longest = max(int(c) for v in same.values() for c in v)
    return f"""
### The same tokens at each context
The rows above score different tokens (a longer window ends further into the split). Here the last
{log.get('eval_scored_tokens', 512)} tokens of {log.get('ppl_same_tokens_windows')} windows of {longest} tokens are scored with only the last `context kept`
tokens before them (`kvjax.training.evaluate.perplexity_by_context`): lower down the table means the model uses the
longer context.

{_context_table("context kept", same)}
"""


def render(ckpt: str) -> str:
    """Model card of the Llama-family code model trained by `train_tiny.py` (phases, segments, held-out ppl)."""
    with open(os.path.join(ckpt, "train_log.json")) as f:
        log = json.load(f)
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    man_path = os.path.join(ckpt, "corpus_manifest.json")
    man = json.load(open(man_path)) if os.path.exists(man_path) else {}
    splits = man.get("splits", {})

    def split_desc(name):
        s = splits.get(name, {})
        return f"{s.get('n_files', '?')} files ({s.get('bytes', 0) / 1e6:.1f} MB)"

    kv_tok = log.get("kv_bytes_per_token_f32")
    w = log["weights_bytes_bf16"]
    rope = cfg.get("rope_parameters", cfg.get("rope_scaling") or {})
    kv_lines = ""
    if kv_tok:
        kv_lines = (f"- KV cache: {kv_tok} bytes per token in f32 ({kv_tok // 2} in bf16); at 16K tokens "
                    f"{kv_tok * 16384 / 2**20:.0f} MiB, at 32K {kv_tok * 32768 / 2**20:.0f} MiB — "
                    f"{kv_tok * 32768 / (2 * w):.1f}× the f32 weights at 32K.\n")
    run = log.get("runs", {})
    packages = man.get("packages", {})
    pkg_rows = [f"| {name} | {p['version']} | {p['licence']} | {p['files'].get('train', 0)} / "
                f"{p['files'].get('val', 0)} / {p['files'].get('heldout', 0)} |" for name, p in packages.items()]
    seg_rows = [f"| {s['start_utc']} | {s.get('stop_utc', '?')} | {s['start_step']}–{s.get('stop_step', '?')} | "
                f"{s.get('tokens', 0):,} | {s.get('tokens_per_s')} | {s.get('effective_gflops')} | "
                f"{s['load_avg_start'][0]:.1f} / {s.get('load_avg_stop', [float('nan')])[0]:.1f} |"
                for s in log.get("segments", []) if s.get("tokens")]
    by_split = log.get("ppl_by_split") or {"heldout": log.get("val_ppl", {})}
    phase_text = _trained_phases(log, run)
    return f"""# kvjax-code-tiny

A small Llama-family code model trained from scratch on Python source (the standard library and the pure-Python
sources of kvjax's runtime dependencies), shipped so that kvjax runs with nothing to download and so that draft
acceptance is measured on real attention patterns. It writes plausible-looking Python, not correct programs.

## Model
- Architecture: `{cfg['model_type']}` ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, MLP
  {cfg['intermediate_size']}, {cfg['num_attention_heads']} query heads, {cfg['num_key_value_heads']} KV heads of
  dim {cfg['head_dim']}, tied embeddings, vocabulary {cfg['vocab_size']}).
- Parameters: {log['params']:,} ({w / 2**20:.1f} MiB in bf16; `model.safetensors` and the Orbax checkpoint in
  `orbax/` hold bf16 weights).
{kv_lines}- Positions: trained up to {log.get('trained_context')} tokens with RoPE θ = {rope.get('rope_theta')}; shipped
  with YaRN (factor {rope.get('factor')}, original context {rope.get('original_max_position_embeddings')}) so
  32K-token prompts keep rotation angles the model has seen.
- Tokenizer: byte-level BPE (`tokenizers`), {cfg['vocab_size']} entries, ChatML-style chat template (unchanged from
  the first release).

## Data
Python {man.get('python_version', '?')} standard library plus the `*.py` files of the installed runtime dependencies
(tests excluded, files over 200 KB excluded, deduplicated by content), split by file with a hash of the path:
train {split_desc('train')}, validation {split_desc('val')}, held-out {split_desc('heldout')}. Held-out files are
never trained on; the stdlib held-out files are the long prompts of the demos and benchmarks. File lists, hashes,
package versions and licences: `corpus_manifest.json`.

{_table("| package | version | licence | files train / val / held-out |" + chr(10) + "|---|---|---|---|", pkg_rows)}

## Recipe
AdamW (Optax; β = 0.9/0.95, weight decay 0.1, clip 1.0), peak LR {run.get('lr')}, warm-up then cosine decay over
the {log.get('total_steps')} steps the last segment planned, {log.get('steps_done')} of them run, of
{run.get('tokens_per_step')} tokens: {phase_text}. f32 training on the 2-core
CPU machine (JAX {log['jax']}, Python {log['python']}), shared with other jobs and run at nice 19.
Trained {log.get('tokens_trained', 0):,} tokens in {log.get('train_seconds', 0) / 60:.1f} min: {log.get('tokens_per_s')}
tokens/s, {log.get('effective_gflops')} GFLOP/s effective (matmul flops of the model, 3× forward). Final training
loss {log.get('final_loss')}. Training state (params, optimizer state, data position; resumable with `--resume`):
`train_state/` in the run folder, {log.get('train_state_bytes', 0) / 2**20:.1f} MiB.

Reproduce (`python scripts/build_corpus.py --out RUN_FOLDER` first), segment by segment:
{chr(10).join(f"- `python scripts/train_tiny.py {' '.join(s.get('argv', []))}`" for s in log.get('segments', [])
              if s.get('tokens')) or f"- `python scripts/train_tiny.py {' '.join(run.get('argv', []))}`"}

{_table("| segment start (UTC) | stop | steps | tokens | tokens/s | GFLOP/s | load avg start / stop |" + chr(10)
        + "|---|---|---|---|---|---|---|", seg_rows)}

## Perplexity (shipped bf16 weights, f32 compute, last 512 tokens of each window)
Windows per context: {log.get('eval_windows_by_context') or log.get('eval_windows')}.
Windows start at file boundaries of the split (`kvjax.data.corpus.long_prompts`) and run on through the following
files.

{_context_table("context", by_split)}

Longest / shortest context ratio (held-out): {log.get('ppl_ratio_longest_vs_2k')}.
{_same_tokens_section(log)}"""


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
