"""DeepSeek-V4 config: a frozen, static description built from a transformers `DeepseekV4Config` dict.

Mirrors transformers 5.24 `configuration_deepseek_v4.py` (the definition): per-layer attention types
(`sliding_attention`, `compressed_sparse_attention` = CSA with rate `m`, `heavily_compressed_attention` = HCA with rate
`m'`), per-layer MLP types (`hash_moe`, `moe`), two rotary parameter sets ("main" for sliding layers, "compress" for
CSA/HCA layers and their compressors/indexer). Fields kvjax cannot run raise `UnsupportedConfigError` naming them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax

from kvjax.errors import UnsupportedConfigError
from kvjax.models.config_fields import KVFields
from kvjax.models.layer_types import CSA, HCA, SLIDING
from kvjax.models.rope import RopeConfig

FAMILY = "deepseek_v4"
HASH_MOE = "hash_moe"
MOE = "moe"
_LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
# The config docstring also lists "softmax", but transformers 5.24 cannot run it (`ACT2FN` has no "softmax"), so
# there is no definition to match: it is rejected.
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class DeepseekV4Config(KVFields):
    """Static DeepSeek-V4 description; hashable, so it can be passed straight into jitted functions."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    rope_head_dim: int  # trailing channels of each head that get (interleaved) RoPE
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int  # m
    hca_rate: int  # m'
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Training only: hash-MoE layers route by `hash_table(config)` (a fixed function of this seed) when the params
    # carry no `tid2eid`, so training params stay all-float. Loaded checkpoints always carry their own table.
    hash_seed: int | None = None
    family: str = FAMILY

    @property
    def num_kv_heads(self) -> int:
        """Shared K=V single-head MQA."""
        return 1

    def rate(self, kind: str) -> int:
        """Compression rate of a layer type (0 for sliding layers)."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[kind]


# Fields that, present with any other value, would change the computation in ways this file does not implement.
_MUST_EQUAL = {
    "num_key_value_heads": (1, None),
    "attention_bias": (False, None),
    "mlp_bias": (False, None),
    "attention_dropout": (0, 0.0, None),
    "n_shared_experts": (1, None),  # transformers builds exactly one shared MLP whatever this says
    "quantization_config": (None,),
    "hidden_act": ("silu", "swish", None),
}


def _rope(params: Mapping[str, Any] | None, theta: float, prf: float, label: str) -> RopeConfig:
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn"):
        raise UnsupportedConfigError(f"rope_parameters.{label}.rope_type={rope_type!r}; supported: default, yarn")
    theta = float(params.get("rope_theta", theta))
    prf = float(params.get("partial_rotary_factor", prf))
    if rope_type == "default":
        return RopeConfig(rope_type="default", theta=theta, partial_rotary_factor=prf)
    if params.get("factor") is None or params.get("original_max_position_embeddings") is None:
        raise UnsupportedConfigError(
            f"rope_parameters.{label}: yarn needs factor and original_max_position_embeddings")
    return RopeConfig(
        rope_type="yarn",
        theta=theta,
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
        mscale=None if params.get("mscale") is None else float(params["mscale"]),
        mscale_all_dim=None if params.get("mscale_all_dim") is None else float(params["mscale_all_dim"]),
        # Quirk of transformers 5.24: `_compute_yarn_parameters` reads `truncate` from the *top-level*
        # `config.rope_parameters` (the {"main", "compress"} dict), never from the per-type dict, so it is always True.
        truncate=True,
        partial_rotary_factor=prf,
    )


def config_from_hf(hf: Mapping[str, Any]) -> DeepseekV4Config:
    """Build a DeepseekV4Config from a parsed transformers config.json (dict), folding legacy fields as transformers
    does.

    Raises:
        UnsupportedConfigError: naming the field kvjax cannot run.
    """
    if hf.get("model_type") != FAMILY:
        raise UnsupportedConfigError(f"model_type={hf.get('model_type')!r}; expected {FAMILY!r}")
    for field, ok in _MUST_EQUAL.items():
        if field in hf and hf[field] not in ok:
            raise UnsupportedConfigError(f"{field}={hf[field]!r} is not supported (supported: {ok})")
    n = int(hf.get("num_hidden_layers", 43))
    head_dim = int(hf.get("head_dim", 512))

    rates = dict(hf.get("compress_rates") or {CSA: 4, HCA: 128})
    if hf.get("compress_rate_csa") is not None:
        rates[CSA] = hf["compress_rate_csa"]
    if hf.get("compress_rate_hca") is not None:
        rates[HCA] = hf["compress_rate_hca"]
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        types = [_LEGACY_RATIO_TO_TYPE[r] for r in hf["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = tuple(types[:n])
    if len(types) != n:
        raise UnsupportedConfigError(f"layer_types has {len(types)} entries, num_hidden_layers={n}")
    for t in types:
        if t not in (SLIDING, CSA, HCA):
            raise UnsupportedConfigError(f"layer_types entry {t!r}; supported: {(SLIDING, CSA, HCA)}")
    mlp_types = hf.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = hf.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    mlp_types = tuple(mlp_types[:n])
    for t in mlp_types:
        if t not in (HASH_MOE, MOE):
            raise UnsupportedConfigError(f"mlp_layer_types entry {t!r}; supported: {(HASH_MOE, MOE)}")
    if len(mlp_types) != n:
        raise UnsupportedConfigError(f"mlp_layer_types has {len(mlp_types)} entries, num_hidden_layers={n}")

    prf = hf.get("partial_rotary_factor")
    if prf is None:
        prf = hf["qk_rope_head_dim"] / head_dim if hf.get("qk_rope_head_dim") is not None else 64 / 512
    prf = float(prf)
    rope_head_dim = int(head_dim * prf)
    if rope_head_dim % 2 or rope_head_dim > head_dim:
        raise UnsupportedConfigError(f"partial_rotary_factor={prf} gives rope dim {rope_head_dim}")
    rp = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # legacy name of the yarn dict
    theta = float(hf.get("rope_theta", 10000.0))
    ctheta = float(hf.get("compress_rope_theta", 160000.0))
    if isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
        main, comp = rp["main"], dict(rp["compress"])
    else:  # flat form, folded as DeepseekV4Config.__post_init__ does
        main = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": prf}
        comp = {k: v for k, v in rp.items() if k not in ("main", "compress")}
        comp.update(rope_theta=ctheta, partial_rotary_factor=prf)
        comp.setdefault("rope_type", "default")
        if comp["rope_type"] == "yarn":
            comp.setdefault("attention_factor", 1.0)
        comp.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings", 1048576))
    for label, p in (("main", main), ("compress", comp)):
        if float(p.get("partial_rotary_factor", prf)) != prf:
            raise UnsupportedConfigError(f"rope_parameters.{label}.partial_rotary_factor differs from the config's")
    scoring = hf.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise UnsupportedConfigError(f"scoring_func={scoring!r}; supported: {SCORING_FUNCS}")
    heads = int(hf.get("num_attention_heads", 64))
    o_groups = int(hf.get("o_groups", 8))
    if heads % o_groups:
        raise UnsupportedConfigError(f"num_attention_heads={heads} is not a multiple of o_groups={o_groups}")
    index_head_dim = int(hf.get("index_head_dim", 128))
    if CSA in types and index_head_dim < rope_head_dim:
        raise UnsupportedConfigError(f"index_head_dim={index_head_dim} < rope dim {rope_head_dim}")
    eos = hf.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return DeepseekV4Config(
        vocab_size=int(hf.get("vocab_size", 129280)),
        hidden_size=int(hf.get("hidden_size", 4096)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 2048)),
        num_layers=n,
        num_heads=heads,
        head_dim=head_dim,
        q_lora_rank=int(hf.get("q_lora_rank", 1024)),
        rope_head_dim=rope_head_dim,
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 6)),
        n_routed_experts=int(hf.get("n_routed_experts", 256)),
        scoring_func=scoring,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        main_rope=_rope(main, theta, prf, "main"),
        compress_rope=_rope(comp, ctheta, prf, "compress"),
        layer_types=types,
        mlp_layer_types=mlp_types,
        csa_rate=int(rates[CSA]),
        hca_rate=int(rates[HCA]),
        hc_mult=int(hf.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(hf.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(hf.get("hc_eps", 1e-6)),
        swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
        sliding_window=int(hf.get("sliding_window", 128)),
        o_groups=o_groups,
        o_lora_rank=int(hf.get("o_lora_rank", 1024)),
        index_n_heads=int(hf.get("index_n_heads", 64)),
        index_head_dim=index_head_dim,
        index_topk=int(hf.get("index_topk", 512)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 1048576)),
        hidden_act="silu",
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def hash_table(config: DeepseekV4Config):
    """i32[V, k] token -> experts table for hash-MoE layers: `num_experts_per_tok` distinct experts per token, a
    fixed function of `config.hash_seed` (NumPy, built once at trace time)."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(config.hash_seed or 0)
    r = rng.random((config.vocab_size, config.n_routed_experts))
    return np.argsort(r, axis=1)[:, :config.num_experts_per_tok].astype(np.int32)


# A small hybrid model that trains on a CPU: every layer type, hash and top-k MoE, plain rope.
TRAINING_DEFAULTS = dict(
    hidden_size=128, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
    q_lora_rank=64, partial_rotary_factor=0.25, num_experts_per_tok=2, n_routed_experts=4,
    layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=[HASH_MOE, MOE, MOE, MOE],
    compress_rates={CSA: 4, HCA: 32}, sliding_window=64, o_groups=2, o_lora_rank=64, index_n_heads=4,
    index_head_dim=32, index_topk=16, hc_mult=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
)


def config_for_training(vocab: int, eos: int | None = None, hash_seed: int = 0, **fields) -> DeepseekV4Config:
    """A config for training from scratch: `TRAINING_DEFAULTS` updated by `fields` (transformers config names, e.g.
    `hidden_size`, `layer_types`, `compress_rates`, or this dataclass's own names, e.g. `csa_rate`).

    Raises:
        UnsupportedConfigError: as `config_from_hf`; ValueError for a field neither spelling knows.
    """
    own = {f.name for f in dataclasses.fields(DeepseekV4Config)}
    hf = dict(TRAINING_DEFAULTS, model_type=FAMILY, vocab_size=vocab, eos_token_id=eos, bos_token_id=None)
    mine = {}
    for k, v in fields.items():
        if k in own and k not in hf and k not in ("vocab_size", "hidden_size"):
            mine[k] = tuple(v) if isinstance(v, list) else v
        else:
            hf[k] = v
    n = hf["num_hidden_layers"]
    for k in ("layer_types", "mlp_layer_types"):
        if len(hf[k]) != n and k not in fields:  # stretch the default pattern to the requested depth
            hf[k] = [hf[k][min(i, len(hf[k]) - 1) if i < 2 else 1 + (i - 1) % (len(hf[k]) - 1)] for i in range(n)]
    return dataclasses.replace(config_from_hf(hf), hash_seed=hash_seed, **mine)


def _rope_dict(r: RopeConfig) -> dict[str, Any]:
    d: dict[str, Any] = {"rope_type": r.rope_type, "rope_theta": r.theta,
                         "partial_rotary_factor": r.partial_rotary_factor}
    if r.rope_type == "yarn":
        d.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                 beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        for k in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(r, k) is not None:
                d[k] = getattr(r, k)
    return d


def hf_config_dict(config: DeepseekV4Config) -> dict[str, Any]:
    """A transformers config.json dict for `config` (inverse of `config_from_hf`)."""
    c = config
    eos = list(c.eos_token_ids)
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": FAMILY,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "moe_intermediate_size": c.moe_intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": 1,
        "head_dim": c.head_dim,
        "q_lora_rank": c.q_lora_rank,
        "partial_rotary_factor": c.rope_head_dim / c.head_dim,
        "num_experts_per_tok": c.num_experts_per_tok,
        "n_routed_experts": c.n_routed_experts,
        "n_shared_experts": 1,
        "scoring_func": c.scoring_func,
        "routed_scaling_factor": c.routed_scaling_factor,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.main_rope.theta,
        "compress_rope_theta": c.compress_rope.theta,
        "rope_parameters": {"main": _rope_dict(c.main_rope), "compress": _rope_dict(c.compress_rope)},
        "layer_types": list(c.layer_types),
        "mlp_layer_types": list(c.mlp_layer_types),
        "compress_rates": {CSA: c.csa_rate, HCA: c.hca_rate},
        "hc_mult": c.hc_mult,
        "hc_sinkhorn_iters": c.hc_sinkhorn_iters,
        "hc_eps": c.hc_eps,
        "swiglu_limit": c.swiglu_limit,
        "sliding_window": c.sliding_window,
        "o_groups": c.o_groups,
        "o_lora_rank": c.o_lora_rank,
        "index_n_heads": c.index_n_heads,
        "index_head_dim": c.index_head_dim,
        "index_topk": c.index_topk,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "bos_token_id": c.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": None,
        "dtype": "float32",
    }
