"""The Llama family (Llama, Qwen2, Qwen3, Mistral) as a `Family` value."""

from __future__ import annotations

import jax

import pallas_kernels
from kvjax import sharding
from kvjax.cache import chunked, draft as draft_forms
from kvjax.compress import COMPRESSORS, make_compressor
from kvjax.families.base import Family
from kvjax.models.attention import make_attention_fn
from kvjax.compress.refresh import refresh_draft
from kvjax.models.llama import cache, draft, model, offload, refresh, verify, weights
from kvjax.models.llama.config import SUPPORTED_FAMILIES, ModelConfig, config_from_hf
from kvjax.models.llama.layers import FUSED_PROJECTIONS, fuse_projections, pack_projections
from kvjax.prefix.layouts.llama import LlamaBlockLayout
from pallas_kernels import native as native_kernels
from pallas_kernels.affine import PackedAffine
from pallas_kernels.int_dot import int_dot_fast
from pallas_kernels.linear import packed_weights_supported


def forward(params, config: ModelConfig, cache_, tokens, n_valid=None, *, implementation: str | None = None,
            logit_rows=None):
    """`kvjax.models.llama.forward` with the attention implementation named."""
    return model.forward(params, config, cache_, tokens, n_valid, attention_fn=make_attention_fn(implementation),
                         implementation=implementation, logit_rows=logit_rows)


DEFAULT_MAX_KEPT = 2048  # kept tokens per head of the default drafter, whatever the prompt's length


def default_drafter_fields(model=None) -> dict:
    """The default drafter's fields (refresh, ratio 4): at most `DEFAULT_MAX_KEPT` kept tokens per head, and a cheap
    draft where the kernels read it directly: kept keys and values in bf16, and weights as int8 codes on the CPU (the
    native int8 product) or bf16 on a GPU/TPU (XLA's bf16 dot; int8 there is not measured); f32 where neither reads
    directly. Measured, identical output everywhere: SmolLM2 at 8K, x = 16, 0.70x -> 1.07x full-cache decoding with
    the bf16 draft, acceptance unchanged (draft token 0.64 -> 0.38 decode steps); int8 weights then cut a draft token
    26.6 -> 20.1 ms against bf16 in one process, with the same tokens accepted at x = 16 on three held-out prompts
    (README "Cheaper drafts"); the tiny model at 32K, x = 8, bf16: 4K kept tokens 1.81x vs 2K 2.05x in one run, 2K
    1.62x vs 1K 1.23x in another.

    A `model` whose loops read its weights as their exact block codes (a GGUF model on the CPU,
    `pallas_kernels.affine`: ~1.25 bytes per weight, about int8's) drafts with those weights themselves: as cheap to
    read, shared with verification (no copy), and the exact model's guesses. SmolLM2 (Q4_1) at 8K, the README main
    command, one after the other: 48.1 tokens/s, 7.53 accepted per round of 8, against int8 codes' 42.7 and 6.53.
    Where those codes are all 4-bit and the CPU has VNNI, by integer dot products with int16-quantised rows
    (`draft_weights="int_dot"`, `pallas_kernels.int_dot`): SmolLM2 at 8K, the same command, interleaved in one
    process: 60.0-61.4 tokens/s against the exact codes' 54.9-56.5, the same 7.53 accepted per round of 8.

    On the CPU with the native kernels, for a `model` whose kept keys and values would fill more than
    `INT8_KEPT_FROM` bytes in bf16, or whose int8 kept keys are scored as integers on VNNI tiles
    (`pallas_kernels.native.int8_scores_fast`), they are int8 codes with a scale per head and slot
    (`kvjax.cache.draft.Int8KV`, read by the attention kernel without a dequantised copy). Measured: SmolLM2 (45 MiB
    in bf16 at 2,048 kept slots) at 8K, a draft token 9.22 against 10.16 ms (roofline, one run) and the README
    workload 52.5-58.1 tokens/s against bf16's 52.1-55.6 (interleaved in one process, four runs each), the same
    acceptance at a fixed x = 8 on three prompts. The tiny model (4 MiB, which stays in cache) at 32K on four prompts,
    x = 8, with the codes widened to f32: 1.53x full-cache decoding against bf16's 1.56x, its draft 1.05x slower; with
    integer scores on VNNI (its head size 32) over 8 prompts, 256 tokens, in one run: **2.25x against bf16's 2.07x**,
    6.08 against 6.02 accepted per round, every output identical (README "Cheaper drafts")."""
    ok, _ = pallas_kernels.bf16_weights_supported()
    if not ok:
        return dict(max_kept=DEFAULT_MAX_KEPT)
    cpu = jax.default_backend() == "cpu"
    weights = "int8" if cpu else "bfloat16"
    if model is not None and reads_block_codes(model):
        weights = "int_dot" if _int_dot_drafts(model) else "float32"
    native = cpu and pallas_kernels.active_cpu_implementation() == "native"
    int8 = model is not None and (_bf16_kept_bytes(model.config) > INT8_KEPT_FROM
                                  or native_kernels.int8_scores_fast(model.config.head_dim))
    kept = "int8" if native and int8 else "bfloat16"
    return dict(max_kept=DEFAULT_MAX_KEPT, draft_dtype=kept, draft_weights=weights)


INT8_KEPT_FROM = 16 << 20  # bf16 kept bytes from which the default drafter keeps int8 codes (measured both sides)


def _bf16_kept_bytes(config) -> int:
    """Bytes of the default drafter's kept keys and values in bf16 at `DEFAULT_MAX_KEPT` slots per head."""
    return config.num_layers * config.num_kv_heads * DEFAULT_MAX_KEPT * config.head_dim * 2 * 2


def _int_dot_drafts(model) -> bool:
    """Whether a draft of `model` is cheaper by integer dot products here: every projection 4-bit codes, and the
    CPU's VNNI instructions there (`pallas_kernels.int_dot`)."""
    layers = model.loop_params()["layers"]
    return int_dot_fast() and all(layer[k].bits == 4 for layer in layers for k in FUSED_PROJECTIONS)


def reads_block_codes(model) -> bool:
    """Whether `model`'s one-token loops read its projections as exact block codes (`Model.loop_params()` holds
    `pallas_kernels.affine.PackedAffine` matrices)."""
    if model.family.pack_params is None or not packed_weights_supported():
        return False
    layers = model.loop_params()["layers"]
    return bool(layers) and all(isinstance(layers[0].get(k), PackedAffine) for k in FUSED_PROJECTIONS)


LLAMA = Family(
    name="llama",
    model_types=SUPPORTED_FAMILIES,
    config_type=ModelConfig,
    config_from_hf=config_from_hf,
    params_from_tensors=weights.params_from_tensors,
    params_to_tensors=weights.params_to_tensors,
    hf_config_dict=weights.hf_config_dict,
    init_params=model.init_params,
    init_cache=cache.init_cache,
    read_bytes=cache.read_bytes,
    forward=forward,
    verify_forward=verify.verify_forward,
    forward_with_masses=refresh.forward_with_masses,
    commit=verify.commit,
    decode_split=chunked.decode_split,
    decode_join=chunked.decode_join,
    decode_carry=chunked.decode_carry,
    decode_merge=chunked.decode_merge,
    check_draft_len=verify.check_draft_len,
    draft_forward=draft.draft_forward,
    draft_commit=draft.draft_commit,
    draft_refresh=refresh_draft,
    draft_split=draft_forms.draft_split,
    draft_join=draft_forms.draft_join,
    compressor=make_compressor,
    compressors=COMPRESSORS,
    # measured on the v2 checkpoint (README "VeriCache"): with x adapted per round, the refreshing drafter ran the
    # main command (16K) fastest, and it accepts the most of the sparse drafters at a fixed x = 32; 4-bit KIVI accepts
    # more (24-28 of 32) but each of its draft steps costs most of a full-cache step on XLA:CPU
    default_compressor="refresh",
    default_compressor_kw=default_drafter_fields,
    offload_split=offload.offload_split,
    offload_join=offload.offload_join,
    offload_update=offload.offload_update,
    prefix_layout=LlamaBlockLayout,
    shard_params=sharding.shard_params,
    loop_params=fuse_projections,
    pack_params=pack_projections,
)
