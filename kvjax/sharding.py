"""Multi-device meshes: tensor parallel over heads ("tp"), data parallel over requests ("dp").

The model, the caches and the VeriCache steps are not rewritten for a mesh: parameters and caches are placed with
`NamedSharding`s and the existing jitted steps run on them, XLA's sharding propagation partitioning every matmul and
inserting the collectives (Megatron-style: q/k/v and MLP up/gate split by output columns, o and MLP down split by
input rows, so each layer needs one all-reduce after attention and one after the MLP; Shoeybi et al. 2019).

- Attention: query heads `N`, kv heads `K` and their biases on "tp" (a device holds whole heads and the kv heads its
  query heads read, since `N/tp` query heads per device are `(N/K)`-groups of `K/tp` kv heads); `wo` rows on "tp".
- MLP: intermediate columns of `w_gate`/`w_up` and rows of `w_down` on "tp".
- Embeddings / LM head: vocab-sharded on "tp" when `V % tp == 0` (else replicated); norms replicated.
- Caches: every kvjax cache form is `[B, K, ...]` (batch first, kv heads second), so batch goes on "dp" and kv heads
  on "tp"; lengths and positions `[B]` / `[B, S]` on "dp". A single request (B = 1) is replicated over "dp".

Limits: the rules here are the Llama family's (`kvjax.models.llama`; DeepSeek-V4's split is
`kvjax.models.deepseek_v4.sharding`, placed through `shard_model` by its family value, and `shard_cache` /
`init_sharded_cache` know only the `[B, K, ...]` Llama cache layout); sums over heads happen on several devices, so sharded logits agree
with single-device logits to float rounding, not necessarily bit for bit (tests/test_sharding.py measures it). The Pallas
GPU kernels are custom calls that XLA cannot partition; on a multi-GPU mesh run them under `shard_map` or use the
"xla" attention implementation. Multi-host start-up: docs/multi_host.md.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

TP, DP = "tp", "dp"

# parameter name -> which axis is split over "tp" (None: replicated)
_COLUMN = ("wq", "wk", "wv", "w_gate", "w_up")  # [in, out]: heads / intermediate are the output columns
_ROW = ("wo", "w_down")  # [in, out]: heads / intermediate are the input rows
_VECTOR = ("bq", "bk", "bv")  # [N*D] / [K*D] biases follow their projections' columns


def place(x, sharding: NamedSharding) -> jax.Array:
    """Put `x` (the same value in every process) on `sharding`.

    One process: `jax.device_put` (device to device, no host round trip). Several processes (multi-host): each
    process fills only its own devices' shards from its copy (`jax.make_array_from_callback`), which is valid
    whether or not the mesh spans other hosts' devices.
    """
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def to_numpy(x) -> np.ndarray:
    """A (possibly multi-host) array as a NumPy array in every process (`process_allgather` when not addressable)."""
    if getattr(x, "is_fully_addressable", True) or getattr(x, "is_fully_replicated", False):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A `dp x tp` mesh with axes ("dp", "tp") over the first `dp * tp` devices.

    "tp" is the minor axis, so a tensor-parallel group is made of neighbouring devices (on GPUs and TPUs the
    fastest links): its two all-reduces per layer are the most frequent collectives.

    Args:
        tp: tensor-parallel degree (must divide the model's query heads, kv heads and intermediate size).
        dp: data-parallel degree (must divide the batch, or the batch is 1).
        devices: devices to use (default `jax.devices()`, all processes' devices in a multi-host run).

    Raises:
        ValueError: when there are fewer than `dp * tp` devices or a degree is below 1.
    """
    if tp < 1 or dp < 1:
        raise ValueError(f"mesh degrees must be >= 1, got tp={tp}, dp={dp}")
    devs = list(jax.devices() if devices is None else devices)
    if tp * dp > len(devs):
        raise ValueError(f"a tp={tp} x dp={dp} mesh needs {tp * dp} devices, only {len(devs)} available "
                         f"(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)")
    return Mesh(np.asarray(devs[: tp * dp], dtype=object).reshape(dp, tp), (DP, TP))


def mesh_fingerprint(mesh: Mesh | None) -> str:
    """Short identity of a mesh for cache namespaces (`identity.make_namespace(mesh=...)`): "dp=2,tp=4"."""
    if mesh is None:
        return "single-device"
    return ",".join(f"{a}={n}" for a, n in mesh.shape.items())


def check_divisible(config, tp: int) -> None:
    """Raise ValueError naming the config field that `tp` does not divide."""
    for field in ("num_heads", "num_kv_heads", "intermediate_size"):
        n = getattr(config, field)
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {field}={n}")


def param_specs(params, config, tp: int, *, vocab: bool | None = None):
    """PartitionSpec pytree for a Llama-family params pytree (same structure as `params`).

    Args:
        params: the params pytree (`kvjax.models.llama` layout, matrices [in, out]).
        config: its ModelConfig.
        tp: tensor-parallel degree.
        vocab: shard embeddings / LM head over the vocabulary (default: when `tp` divides `vocab_size`).
    """
    check_divisible(config, tp)
    if vocab is None:
        vocab = config.vocab_size % tp == 0
    elif vocab and config.vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide vocab_size={config.vocab_size}")

    def layer_spec(name, leaf):
        if name in _COLUMN:
            return P(None, TP)
        if name in _ROW:
            return P(TP, None)
        if name in _VECTOR:
            return P(TP)
        return P(*([None] * np.ndim(leaf)))  # norms: replicated

    out = {}
    for name, leaf in params.items():
        if name == "layers":
            out[name] = tuple({k: layer_spec(k, v) for k, v in layer.items()} for layer in leaf)
        elif name == "embed":
            out[name] = P(TP, None) if vocab else P(None, None)
        elif name == "lm_head":
            out[name] = P(None, TP) if vocab else P(None, None)
        else:
            out[name] = P(*([None] * np.ndim(leaf)))
    return out


def shard_params(params, config, mesh: Mesh, *, vocab: bool | None = None):
    """Place a Llama-family params pytree on `mesh`: heads and MLP intermediate on "tp", replicated over "dp".

    Returns:
        the params pytree of `jax.Array`s with `NamedSharding`s (same structure and values).
    """
    specs = param_specs(params, config, mesh.shape[TP], vocab=vocab)
    return jax.tree.map(lambda x, s: place(x, NamedSharding(mesh, s)), params, specs)


def shard_model(model, mesh: Mesh, *, vocab: bool | None = None):
    """A `kvjax.Model` whose params live on `mesh` (`shard_params`); everything that takes a model runs sharded."""
    shard = model.family.require("shard_params", "tensor/data-parallel meshes (--tp/--dp)")
    return dataclasses.replace(model, params=shard(model.params, model.config, mesh, vocab=vocab))


def cache_spec(shape: tuple[int, ...], mesh: Mesh) -> P:
    """PartitionSpec of one cache leaf `[B, K, ...]` (or `[B]`, `[B, S]`): B on "dp", K on "tp" where they divide.

    Raises:
        ValueError: batch > 1 not divisible by dp (a request would be split across data-parallel replicas).
    """
    tp, dp = mesh.shape[TP], mesh.shape[DP]
    if not shape:
        return P()
    B = shape[0]
    if B % dp and B != 1:
        raise ValueError(f"batch {B} is not divisible by dp={dp}")
    spec = [DP if B % dp == 0 and dp > 1 else None] + [None] * (len(shape) - 1)
    if len(shape) >= 3 and tp > 1:
        if shape[1] % tp:
            raise ValueError(f"kv heads {shape[1]} (axis 1 of a cache leaf {shape}) not divisible by tp={tp}")
        spec[1] = TP
    return P(*spec)


def shard_cache(cache, mesh: Mesh):
    """Place any kvjax cache pytree (ModelCache, draft caches) on `mesh`: batch on "dp", kv heads on "tp".

    Every array leaf is `[B, ...]`; leaves of rank >= 3 are `[B, K, ...]` (DenseKV/WindowKV k, v `[B, K, S, D]`,
    per-head positions `[B, K, S]`).
    """
    return jax.tree.map(lambda x: place(x, NamedSharding(mesh, cache_spec(x.shape, mesh))), cache)


def init_sharded_cache(config, batch: int, capacity: int, mesh: Mesh, dtype=None):
    """`forms.init_cache` placed on `mesh` (see `shard_cache`)."""
    import jax.numpy as jnp

    from kvjax.models.llama.cache import init_cache

    return shard_cache(init_cache(config, batch, capacity, dtype or jnp.float32), mesh)
