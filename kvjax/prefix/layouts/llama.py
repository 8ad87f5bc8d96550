"""Per-form specs of the prefix cache, byte accounting, format/ABI fingerprints, and the Llama family's forms.

A model's per-request state is split into *forms* (DESIGN.md idea 2). Each form is one of two kinds:

- **path** forms are append-only: block `i` holds the state produced by tokens `[i*P, (i+1)*P)` and is shared by every
  prefix that passes through it (Llama dense KV; V4 compressed KV and indexer keys). A path form can serve any
  boundary that is a multiple of its `align` (1 for dense KV; the compression rate for compressed entries).
- **snapshot** forms are the state *at* a boundary: it rolls, so it cannot be assembled from blocks (the SWA ring,
  V4's uncompressed tail). A snapshot form serves exactly the boundaries where a snapshot was stored.

A family plugs in through a `BlockLayout`: `specs`, `blocks(cache)` (all path blocks of a cache, static shape),
`snapshot(cache)` (all snapshot forms at the cache's current length) and `restore(cache, staged, boundary)`.
Everything shape-dependent is jitted once per capacity bucket (`max_blocks = capacity // P`).

Block size. The Llama default is `P = 64`: every capacity bucket (256 .. 128K) is a multiple of it, the radix walk of a
128K prompt touches 2048 blocks (cheap metadata), and a partial hit loses at most 63 tokens; smaller `P` gives finer
hits but more metadata, larger `P` coarser hits. For families with compression rates `P` must be a multiple of
their lcm so every block boundary is a compression boundary (`check_block_size`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.arrays import np_dtype

from kvjax.cache.dense import DenseKV, ModelCache
from kvjax.models.llama.cache import init_cache
from kvjax.prefix.hashing import digest
from kvjax.prefix.runtime_identity import KERNEL_ABI
from kvjax.models.layer_types import SLIDING
from kvjax.models.llama.config import ModelConfig

PATH = "path"
SNAPSHOT = "snapshot"
FORMAT_VERSION = 1
DEFAULT_BLOCK_SIZE = 64


@dataclasses.dataclass(frozen=True)
class FormSpec:
    """One cache form as stored by the prefix cache.

    Attributes:
        name: "dense", "swa" (Llama); "compressed", "tail", "swa", "indexer" (hybrid families).
        kind: PATH (one entry per block, shared along a path) or SNAPSHOT (one entry per boundary).
        layers: model layer indices whose state the entry stacks.
        entry_shape: shape of one entry (one block of a path form, one boundary of a snapshot form).
        dtype: numpy dtype name of the entry.
        layout: axis string of `entry_shape` in the repo alphabet, e.g. "L2KPD".
        align: path forms serve boundaries that are multiples of this.
    """

    name: str
    kind: str
    layers: tuple[int, ...]
    entry_shape: tuple[int, ...]
    dtype: str
    layout: str
    align: int = 1
    version: int = FORMAT_VERSION

    @property
    def nbytes(self) -> int:
        """Bytes of one entry."""
        return int(np.prod(self.entry_shape)) * np.dtype(self.dtype).itemsize

    @property
    def fingerprint(self) -> str:
        """Format/ABI fingerprint: every field that decides how the bytes are read (never byte count alone)."""
        body = (f"{self.name}|{self.kind}|{self.layers}|{self.entry_shape}|{self.dtype}|{self.layout}|{self.align}|"
                f"v{self.version}|{KERNEL_ABI}")
        return digest(b"kvjax.format1", body.encode()).hex()[:32]


class BlockLayout(Protocol):
    """What a model family provides so the prefix cache can save and restore its state."""

    block_size: int
    specs: tuple[FormSpec, ...]

    def blocks(self, cache) -> dict[str, jax.Array]:
        """Path form name -> [max_blocks, *entry_shape]: every block of the cache's capacity."""

    def snapshot(self, cache) -> dict[str, jax.Array]:
        """Snapshot form name -> [*entry_shape]: the form's state at the cache's current length."""

    def restore(self, cache, staged: dict[str, jax.Array], boundary: int):
        """A fresh cache with every form restored to `boundary` tokens (path forms staged [max_blocks, ...])."""

    def new_cache(self, capacity: int):
        """An empty batch-1 cache of the family (`init_cache`)."""


def check_block_size(block_size: int, rates: tuple[int, ...] = (), capacities: tuple[int, ...] = ()) -> None:
    """Raise ValueError unless `block_size` is a multiple of lcm(rates) and divides every capacity."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    m = math.lcm(*rates) if rates else 1
    if block_size % m:
        raise ValueError(f"block_size={block_size} is not a multiple of lcm(compression rates {rates}) = {m}")
    for c in capacities:
        if c % block_size:
            raise ValueError(f"block_size={block_size} does not divide cache capacity {c}")


def _stack_dense(layers, idx):
    """[B=1, K, S, D] per layer -> [Lf, 2, K, S, D]."""
    return jnp.stack([jnp.stack([layers[i].k[0], layers[i].v[0]]) for i in idx])


@functools.partial(jax.jit, static_argnames=("full", "P"))
def _dense_blocks(cache: ModelCache, *, full: tuple[int, ...], P: int):
    x = _stack_dense(cache.layers, full)  # [Lf, 2, K, S, D]
    L, two, K, S, D = x.shape
    x = x.reshape(L, two, K, S // P, P, D)
    return jnp.transpose(x, (3, 0, 1, 2, 4, 5))  # [maxB, Lf, 2, K, P, D]


@functools.partial(jax.jit, static_argnames=("sliding",))
def _swa_snapshot(cache: ModelCache, *, sliding: tuple[int, ...]):
    return jnp.stack([jnp.stack([cache.layers[i].k[0], cache.layers[i].v[0]]) for i in sliding])  # [Ls, 2, K, W, D]


@functools.partial(jax.jit, static_argnames=("full", "sliding"), donate_argnames="cache")
def _restore(cache: ModelCache, dense, swa, boundary, *, full, sliding):
    """dense: [maxB, Lf, 2, K, P, D] or None; swa: [Ls, 2, K, W, D] or None; boundary: i32 scalar."""
    layers = list(cache.layers)
    b = jnp.reshape(boundary, (1,)).astype(jnp.int32)
    if full:
        maxB, L, two, K, P, D = dense.shape
        x = jnp.transpose(dense, (1, 2, 3, 0, 4, 5)).reshape(L, two, K, maxB * P, D)
        keep = (jnp.arange(maxB * P) < b[0])[None, :, None]  # [1, S, 1] broadcast over K, D
        for j, i in enumerate(full):
            f = layers[i]
            layers[i] = DenseKV(k=jnp.where(keep, x[j, 0], f.k[0])[None].astype(f.k.dtype),
                                v=jnp.where(keep, x[j, 1], f.v[0])[None].astype(f.v.dtype), length=b)
    for j, i in enumerate(sliding):
        f = layers[i]
        use = b[0] > 0
        layers[i] = dataclasses.replace(f, k=jnp.where(use, swa[j, 0], f.k[0])[None].astype(f.k.dtype),
                                        v=jnp.where(use, swa[j, 1], f.v[0])[None].astype(f.v.dtype), seen=b)
    return ModelCache(layers=tuple(layers), length=b)


class LlamaBlockLayout:
    """Forms of a Llama-family cache: "dense" (path; full layers' K/V per block) and "swa" (snapshot; every sliding
    layer's ring at a block boundary). The ring is not recoverable from blocks once it rolled, so it is snapshotted.
    """

    def __init__(self, config: ModelConfig, dtype, block_size: int = DEFAULT_BLOCK_SIZE):
        self.config = config
        self.block_size = int(block_size)
        self.dtype = np_dtype(dtype)
        self.full = tuple(i for i, t in enumerate(config.layer_types) if t != SLIDING)
        self.sliding = tuple(i for i, t in enumerate(config.layer_types) if t == SLIDING)
        K, D, P = config.num_kv_heads, config.head_dim, self.block_size
        specs = []
        if self.full:
            specs.append(FormSpec("dense", PATH, self.full, (len(self.full), 2, K, P, D), self.dtype.name, "L2KPD"))
        if self.sliding:
            W = config.sliding_window
            specs.append(FormSpec("swa", SNAPSHOT, self.sliding, (len(self.sliding), 2, K, W, D), self.dtype.name,
                                  "L2KWD"))
        self.specs = tuple(specs)

    def blocks(self, cache: ModelCache) -> dict[str, jax.Array]:
        if not self.full:
            return {}
        return {"dense": _dense_blocks(cache, full=self.full, P=self.block_size)}

    def snapshot(self, cache: ModelCache) -> dict[str, jax.Array]:
        if not self.sliding:
            return {}
        return {"swa": _swa_snapshot(cache, sliding=self.sliding)}

    def restore(self, cache: ModelCache, staged: dict[str, jax.Array], boundary: int) -> ModelCache:
        return _restore(cache, staged.get("dense"), staged.get("swa"), jnp.asarray(boundary, jnp.int32),
                        full=self.full, sliding=self.sliding)

    def new_cache(self, capacity: int) -> ModelCache:
        check_block_size(self.block_size, capacities=(capacity,))
        return init_cache(self.config, 1, capacity, self.dtype)
