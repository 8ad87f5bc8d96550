"""A draft's weights: the same model's weights stored in bf16, read by drafting only.

A draft token reads every weight once, so with f32 weights it costs most of a full decode step however small its
cache (SmolLM2-135M at 8K: weights are 538 MB of a draft token's ~630 MB). Drafts only need to be good, not exact:
verification still runs the f32 weights over the full cache, so the output stays bit-identical to full-cache decoding
whatever the draft reads (`draft_weights="bfloat16"` changes acceptance, never tokens). QuantSpec (arXiv 2502.10424)
quantizes the draft's cache for the same reason.

The bf16 copy is made once per model and kept (half the f32 weights' bytes), fused the way the one-token loops read
them (`family.loop_params`) and with the output head as its own [H, V] matrix; its products go through
`pallas_kernels.linear` (the native kernel on CPU reads bf16 directly; XLA:CPU would convert to f32 first). int8 codes
("int8") are a quarter of f32's bytes; a GGUF model's own 4-bit codes are drafted exactly ("float32": the loops' layout)
or by integer dot products with int16-rounded rows ("int_dot", `pallas_kernels.int_dot`: the same codes, fewer
instructions per weight); a float model's "int_dot" draft multiplies the int8 draft's codes that way (`IntDot8`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels.affine import PackedAffine
from pallas_kernels.int_dot import int_dot8_codes, int_dot_codes, requantize_4bit
from pallas_kernels.linear import PANEL, pack_int8, packed_weights_supported, quantize_int8
from kvjax.arrays import tree_identity
from kvjax.compress.base import DRAFT_WEIGHTS
from kvjax.errors import InputError
from kvjax.models.llama.layers import FUSED_PROJECTIONS

_cache: dict = {}  # ids of the params' leaves -> (the leaves, draft params): the leaves are held so no id is reused


def check_draft_weights(name: str, family_name: str | None = None) -> str:
    """`name` if it is a draft weights dtype this family drafts with here, else InputError naming why."""
    if name not in DRAFT_WEIGHTS:
        raise InputError(f"draft_weights must be one of {DRAFT_WEIGHTS}, got {name!r}")
    if name == "float32":
        return name
    if family_name is not None and family_name != "llama":
        raise InputError(f"draft_weights={name!r} is supported for the llama family (llama, qwen2), not {family_name}")
    ok, why = pallas_kernels.bf16_weights_supported()
    if not ok:
        raise InputError(f"draft_weights={name!r} needs a product that reads bf16 weights here: {why}")
    return name


def _int8(w):
    """int8 codes of `w`, packed in 64-column panels where the native CPU product reads them (the same bits as the
    plain codes; SmolLM2's 121 one-row int8 products of a draft token as a chain, one process: 12.0 vs 19.6 ms)."""
    return _packed(quantize_int8(w))


def _packed(q):
    """int8 codes `q` (an `Int8Weight`) in 64-column panels where the native CPU product reads them, else as is."""
    if packed_weights_supported() and q.codes.shape[1] % PANEL == 0:
        return pack_int8(q)
    return q


def _int_dot8(w):
    """The "int8" draft's codes of a float matrix `w` in the integer-dot layout (`IntDot8`), or in the int8 draft's own
    layout where the kernel's blocks of 32 k and panels of 64 columns do not fit it."""
    q = quantize_int8(w)
    return int_dot8_codes(q.codes, q.scale) or _packed(q)


def _reads_block_codes(model) -> bool:
    """Whether `model`'s loops read some projection as GGUF block codes (`PackedAffine`): its integer-dot draft then
    reads those codes (`_four_bit_params`)."""
    return any(isinstance(layer[k], PackedAffine) for layer in model.loop_params()["layers"]
               for k in FUSED_PROJECTIONS if k in layer)


def _four_bit_params(model, params):
    """`params` (the loops') with every 4-bit code matrix in the integer-dot layout; a tied output head as 4-bit codes
    with its best candidates re-scored exactly (`lm_head_coarse`, `lm_head_rows`), an untied one kept as the loops'
    codes; norms and the embedding shared with the loops. InputError unless every projection is 4-bit block codes."""
    layers = []
    for layer in params["layers"]:
        codes = {k: int_dot_codes(layer[k]) for k in FUSED_PROJECTIONS if k in layer}
        if not codes or any(c is None for c in codes.values()):
            raise InputError("draft_weights='int_dot' needs 4-bit block codes in every projection of a GGUF model "
                             "(Q4_0 / Q4_1), or a float model")
        layers.append({**layer, **codes})
    out = dict(params, layers=tuple(layers))
    rows = params.get("embed") if "lm_head" not in model.params else None
    if rows is not None and rows.dtype == jnp.float32 and rows.shape[0] % PANEL == 0 and rows.shape[1] % 32 == 0:
        # tied embeddings: the head read as 4-bit codes, its best blocks re-scored from the embedding's exact rows
        # (`layers.coarse_head_logits`; SmolLM2: a draft token 8.60 against 9.31 ms with the exact 8-bit head,
        # interleaved in one process, and the same tokens accepted per round of 8 on six prompts)
        out.pop("lm_head", None)
        out.update(lm_head_coarse=requantize_4bit(np.asarray(rows).T), lm_head_rows=rows)
    return out


def draft_params(model, weights: str = "float32"):
    """The params drafting reads: for "float32" the model's own weights in the loops' layout (`Model.loop_params()`:
    fused, and on CPU packed -- a GGUF model's as its exact block codes, `pallas_kernels.affine`; shared with
    verification, so no extra copy); for "bfloat16" a fused bf16 copy, for "int8" fused
    int8 codes with a scale per output column (`pallas_kernels.linear.Int8Weight`; on CPU packed in 64-column panels,
    `PackedInt8`); for "int_dot" a GGUF model's 4-bit codes, or a float model's int8 codes, in the integer-dot layout,
    multiplied with int16-quantised rows (`pallas_kernels.int_dot`: lossy, a draft's only); each made on first use and
    then kept while the model's params hold the same arrays (a weight replaced anywhere in the tree makes it again);
    InputError (`check_draft_weights`) for any other name or where this family, model or platform cannot draft with
    it."""
    if weights == "float32":
        return model.loop_params()
    check_draft_weights(weights, model.family.name)
    ids, leaves = tree_identity(model.params)
    key = (weights, *ids)
    hit = _cache.get(key)
    if hit is not None:
        return hit[1]
    if weights == "int_dot" and _reads_block_codes(model):
        out = _four_bit_params(model, model.loop_params())
        _remember(key, leaves, out)
        return out
    params = model.family.loop_params(model.params)
    store = {"int8": _int8, "int_dot": _int_dot8}.get(weights, lambda w: jnp.asarray(w, jnp.bfloat16))
    layers = tuple({k: (store(v) if k in FUSED_PROJECTIONS else v) for k, v in layer.items()}
                   for layer in params["layers"])
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    out = dict(params, layers=layers, lm_head=store(head))
    _remember(key, leaves, out)
    return out


def _remember(key, leaves, out) -> None:
    if len(_cache) >= 4:  # a process rarely holds more than a model or two; never grow without bound
        _cache.pop(next(iter(_cache)))
    _cache[key] = (leaves, out)
