"""DeepSeek-V4 checkpoint tensors <-> kvjax params, and a fresh random init.

Checkpoints come in three spellings: transformers' module names (`model.layers.0.self_attn.q_a_proj.weight`,
packed `mlp.experts.gate_up_proj`), the upstream DeepSeek names that transformers 5.24 `save_pretrained` writes back
(`model.layers.0.attn.wq_a.weight`, per-expert `ffn.experts.3.w1.weight`, `head.weight`), and the raw upstream
names without the `model.` prefix (`embed.weight`, `hc_head_fn`). Every name is first normalised with the rename
rules transformers applies on load (`conversion_mapping.py`, "deepseek_v4"), so one table serves all three; export
writes the `save_pretrained` spelling, which `DeepseekV4ForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.arrays import np_dtype
from kvjax.models.layer_types import CSA, SLIDING
from kvjax.models.deepseek_v4.config import HASH_MOE, DeepseekV4Config, hash_table
from kvjax.errors import WeightsError

# Renames transformers applies when loading a DeepSeek-V4 checkpoint, in its order (after dropping "model.").
_RENAMES = [
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."),
    (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"), (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."), (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]
_IGNORED = re.compile(r"(^|\.)mtp\.")  # multi-token-prediction layers: not part of the causal LM
# Leaves transformers keeps in float32 whatever the model dtype (`_keep_in_fp32_modules_strict`: hyper-connections,
# sinks, position biases, router bias, every RMSNorm weight); kvjax does the same so bf16 runs round alike.
F32_LEAVES = frozenset({"fn", "base", "scale", "sinks", "ape", "bias", "q_norm", "kv_norm", "norm", "attn_norm",
                        "ffn_norm", "final_norm"})


def canonical(name: str) -> str:
    """A checkpoint tensor name in any of the three spellings -> transformers' module name without `model.`."""
    n = name[len("model."):] if name.startswith("model.") else name
    for src, dst in _RENAMES:
        n = re.sub(src, dst, n)
    return n


def _table(config: DeepseekV4Config) -> list[tuple[tuple, str, tuple[int, ...], str]]:
    """(params path, save_pretrained name, checkpoint shape, how to convert) for every tensor but the experts."""
    c = config
    H, V, hc, R, N, D = c.hidden_size, c.vocab_size, c.hc_mult, c.q_lora_rank, c.num_heads, c.head_dim
    I, G, O = c.moe_intermediate_size, c.o_groups, c.o_lora_rank
    rows = [(("embed",), "model.embed_tokens.weight", (V, H), "id"),
            (("final_norm",), "model.norm.weight", (H,), "id"),
            (("hc_head", "fn"), "model.hc_head.hc_fn", (hc, hc * H), "T"),
            (("hc_head", "base"), "model.hc_head.hc_base", (hc,), "id"),
            (("hc_head", "scale"), "model.hc_head.hc_scale", (1,), "id")]
    if not c.tie_word_embeddings:
        rows.append((("lm_head",), "head.weight", (V, H), "T"))
    nhc = (2 + hc) * hc
    for i, (kind, mlp) in enumerate(zip(c.layer_types, c.mlp_layer_types)):
        L, p = ("layers", i), f"model.layers.{i}."
        rows += [(L + ("attn_norm",), p + "attn_norm.weight", (H,), "id"),
                 (L + ("ffn_norm",), p + "ffn_norm.weight", (H,), "id")]
        for hk, hn in (("hc_attn", "hc_attn"), ("hc_ffn", "hc_ffn")):
            rows += [(L + (hk, "fn"), p + hn + "_fn", (nhc, hc * H), "T"),
                     (L + (hk, "base"), p + hn + "_base", (nhc,), "id"),
                     (L + (hk, "scale"), p + hn + "_scale", (3,), "id")]
        a, pa = L + ("attn",), p + "attn."
        rows += [(a + ("wq_a",), pa + "wq_a.weight", (R, H), "T"),
                 (a + ("q_norm",), pa + "q_norm.weight", (R,), "id"),
                 (a + ("wq_b",), pa + "wq_b.weight", (N * D, R), "T"),
                 (a + ("wkv",), pa + "wkv.weight", (D, H), "T"),
                 (a + ("kv_norm",), pa + "norm.weight", (D,), "id"),
                 (a + ("wo_a",), pa + "wo_a.weight", (G * O, N * D // G), "grouped"),
                 (a + ("wo_b",), pa + "wo_b.weight", (H, G * O), "T"),
                 (a + ("sinks",), pa + "attn_sink", (N,), "id")]
        if kind != SLIDING:
            m = c.rate(kind)

            def comp(path, pre, d, dp):
                return [(path + ("wkv",), pre + "wkv.weight", (dp, H), "T"),
                        (path + ("wgate",), pre + "wgate.weight", (dp, H), "T"),
                        (path + ("ape",), pre + "ape", (m, dp), "id"),
                        (path + ("norm",), pre + "norm.weight", (d,), "id")]

            rows += comp(a + ("compressor",), pa + "compressor.", D, 2 * D if kind == CSA else D)
            if kind == CSA:
                nh, ci = c.index_n_heads, c.index_head_dim
                ix = a + ("indexer",)
                rows += comp(ix + ("compressor",), pa + "indexer.compressor.", ci, 2 * ci)
                rows += [(ix + ("wq_b",), pa + "indexer.wq_b.weight", (nh * ci, R), "T"),
                         (ix + ("weights_proj",), pa + "indexer.weights_proj.weight", (nh, H), "T")]
        f, pf = L + ("ffn",), p + "ffn."
        rows += [(f + ("gate",), pf + "gate.weight", (c.n_routed_experts, H), "T")]
        if mlp == HASH_MOE:
            rows.append((f + ("tid2eid",), pf + "gate.tid2eid", (V, c.num_experts_per_tok), "int"))
        else:
            rows.append((f + ("bias",), pf + "gate.bias", (c.n_routed_experts,), "id"))
        rows += [(f + ("shared", "w1"), pf + "shared_experts.w1.weight", (I, H), "T"),
                 (f + ("shared", "w3"), pf + "shared_experts.w3.weight", (I, H), "T"),
                 (f + ("shared", "w2"), pf + "shared_experts.w2.weight", (H, I), "T")]
    return rows


def _set(tree: dict, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _to_param(x: np.ndarray, how: str, config: DeepseekV4Config) -> np.ndarray:
    if how == "T":
        return x.T
    if how == "grouped":  # [G*O, in] -> [G, in, O]
        G = config.o_groups
        return x.reshape(G, -1, x.shape[1]).transpose(0, 2, 1)
    return x


def _from_param(x: np.ndarray, how: str) -> np.ndarray:
    if how == "T":
        return x.T
    if how == "grouped":  # [G, in, O] -> [G*O, in]
        return x.transpose(0, 2, 1).reshape(-1, x.shape[1])
    return x


def _layers_to_tuple(tree: dict) -> dict:
    tree["layers"] = tuple(tree["layers"][i] for i in range(len(tree["layers"])))
    return tree


def params_from_tensors(config: DeepseekV4Config, tensors: dict[str, np.ndarray], dtype="f32") -> dict[str, Any]:
    """Checkpoint tensors (any of the three spellings) -> params pytree of jnp arrays.

    Raises:
        WeightsError: naming a missing, unexpected or mis-shaped tensor.
    """
    dt = np_dtype(dtype)
    canon = {}
    for name, x in tensors.items():
        if _IGNORED.search(name):
            continue
        canon[canonical(name)] = (name, x)
    tree: dict[str, Any] = {"layers": {}}
    used = set()

    def take(key_saved: str, shape: tuple) -> np.ndarray:
        key = canonical(key_saved)
        if key not in canon:
            raise WeightsError(f"missing tensor {key_saved!r} (transformers name {key!r})")
        name, x = canon[key]
        if tuple(x.shape) != tuple(shape):
            raise WeightsError(f"tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)}")
        used.add(key)
        return np.asarray(x)

    for path, saved, shape, how in _table(config):
        x = take(saved, shape)
        if how == "int":
            _set(tree, path, jnp.asarray(x.astype(np.int32)))
        else:
            leaf_dt = np.float32 if path[-1] in F32_LEAVES else dt
            _set(tree, path, jnp.asarray(_to_param(x.astype(np.float32), how, config).astype(leaf_dt)))
    E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    for i in range(config.num_layers):
        pre = f"layers.{i}.mlp.experts."
        if pre + "gate_up_proj" in canon:
            gu = take(pre + "gate_up_proj", (E, 2 * I, H)).astype(np.float32)
            dn = take(pre + "down_proj", (E, H, I)).astype(np.float32)
            w1, w3, w2 = gu[:, :I], gu[:, I:], dn
        else:
            w1 = np.stack([take(f"{pre}{e}.w1.weight", (I, H)) for e in range(E)]).astype(np.float32)
            w3 = np.stack([take(f"{pre}{e}.w3.weight", (I, H)) for e in range(E)]).astype(np.float32)
            w2 = np.stack([take(f"{pre}{e}.w2.weight", (H, I)) for e in range(E)]).astype(np.float32)
        ffn = tree["layers"][i]["ffn"]
        ffn["w1"] = jnp.asarray(w1.transpose(0, 2, 1).astype(dt))
        ffn["w3"] = jnp.asarray(w3.transpose(0, 2, 1).astype(dt))
        ffn["w2"] = jnp.asarray(w2.transpose(0, 2, 1).astype(dt))
    extra = sorted(canon[k][0] for k in set(canon) - used)
    if extra:
        raise WeightsError(f"unexpected tensors for this config: {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    return _layers_to_tuple(tree)


def params_to_tensors(config: DeepseekV4Config, params: dict[str, Any], dtype="f32") -> dict[str, np.ndarray]:
    """Params -> numpy tensors under the names transformers' `save_pretrained` writes (inverse of the loader;
    `DeepseekV4ForCausalLM.from_pretrained` loads them). Matrices in `dtype`; `F32_LEAVES` stay float32 (as
    transformers keeps them); `tid2eid` is int64 (from `hash_table(config)` when the params carry none)."""
    dt = np_dtype(dtype)
    out = {}
    for path, saved, _, how in _table(config):
        if how == "int":
            try:
                x = np.asarray(_get(params, path))
            except KeyError:
                x = hash_table(config)
            out[saved] = x.astype(np.int64)
            continue
        x = _from_param(np.asarray(_get(params, path)).astype(np.float32), how)
        out[saved] = np.ascontiguousarray(x.astype(np.float32 if path[-1] in F32_LEAVES else dt))
    for i in range(config.num_layers):
        ffn = params["layers"][i]["ffn"]
        for w in ("w1", "w2", "w3"):
            arr = np.asarray(ffn[w]).astype(np.float32)
            for e in range(arr.shape[0]):
                out[f"model.layers.{i}.ffn.experts.{e}.{w}.weight"] = np.ascontiguousarray(arr[e].T.astype(dt))
    return out


def init_params(config: DeepseekV4Config, key: jax.Array, dtype=jnp.float32, std: float = 0.02) -> dict[str, Any]:
    """Random params for training from scratch: normal(std) matrices, unit norm weights, zero sinks / position
    biases / hyper-connection bases, unit hyper-connection scales (transformers' `_init_weights`), and a hash table
    giving each token `num_experts_per_tok` distinct experts (`hash_table`; held in the params only when
    `config.hash_seed` is None). `F32_LEAVES` stay float32 whatever `dtype` is.

    Drawn with NumPy from a seed taken off `key`: a few hundred eager `jax.random` calls took ~15 s on the shared CPU.
    """
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    rng = np.random.default_rng([int(v) for v in np.asarray(data).reshape(-1)])
    tree: dict[str, Any] = {"layers": {}}

    def normal(shape, dt):
        return jnp.asarray((std * rng.standard_normal(shape, dtype=np.float32)).astype(np_dtype(dt)))

    for path, _, shape, how in _table(config):
        leaf = path[-1]
        pshape = tuple(_to_param(np.zeros(shape, np.float32), how, config).shape)
        if how == "int":
            if config.hash_seed is None:  # else the forward derives the table from the seed: params stay all-float
                _set(tree, path, jnp.asarray(hash_table(config)))
        elif leaf in ("sinks", "ape", "base", "bias"):
            _set(tree, path, jnp.zeros(pshape, jnp.float32))
        elif leaf in ("scale", "final_norm", "attn_norm", "ffn_norm", "q_norm", "kv_norm", "norm"):
            _set(tree, path, jnp.ones(pshape, jnp.float32))
        else:
            _set(tree, path, normal(pshape, jnp.float32 if leaf == "fn" else dtype))
    E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
    for i in range(config.num_layers):
        ffn = tree["layers"][i]["ffn"]
        ffn["w1"], ffn["w3"], ffn["w2"] = normal((E, H, I), dtype), normal((E, H, I), dtype), normal((E, I, H), dtype)
    return _layers_to_tuple(tree)


def partition_params(params: dict[str, Any]):
    """(float params, int params) with None where the other holds a leaf: `tid2eid` is a frozen int table, so
    `jax.grad` must differentiate the float part only. `merge_params` undoes it."""
    is_int = lambda x: jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer)  # noqa: E731
    floats = jax.tree_util.tree_map(lambda x: None if is_int(x) else x, params)
    ints = jax.tree_util.tree_map(lambda x: x if is_int(x) else None, params)
    return floats, ints


def merge_params(floats, ints):
    """Inverse of `partition_params`."""
    return jax.tree_util.tree_map(lambda a, b: b if a is None else a, floats, ints, is_leaf=lambda x: x is None)
