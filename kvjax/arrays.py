"""Small array facts used everywhere: dtype names and the bytes a pytree holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_ALIASES = {"f32": jnp.float32, "float32": jnp.float32, "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16}
DTYPE_NAMES = ("f32", "float32", "bf16", "bfloat16")


def np_dtype(name_or_dtype) -> np.dtype:
    """'f32' / 'float32' / 'bf16' / 'bfloat16' / a dtype -> a NumPy dtype (ml_dtypes for bf16).

    Raises:
        ValueError: for any other name.
    """
    if isinstance(name_or_dtype, str) and name_or_dtype not in _ALIASES:
        raise ValueError(f"dtype {name_or_dtype!r}; expected one of {DTYPE_NAMES}")
    return np.dtype(_ALIASES.get(name_or_dtype, name_or_dtype)) if isinstance(name_or_dtype, str) \
        else np.dtype(name_or_dtype)


def jnp_dtype(name_or_dtype):
    """The JAX dtype of a dtype name ('f32', 'bf16', ...) or dtype."""
    return jnp.dtype(np_dtype(name_or_dtype))


def tree_nbytes(tree) -> int:
    """Bytes of every array leaf of `tree` (concrete arrays or `jax.ShapeDtypeStruct`s)."""
    return int(sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree)))


def same_shapes(a, b) -> bool:
    """Whether two pytrees of arrays (or `jax.ShapeDtypeStruct`s) have the same structure, shapes and dtypes."""
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def device_space(tree):
    """(Traced) every leaf in device memory space: host arguments moved (on the CPU an alias: XLA:CPU elides the
    transfer, the buffers stay where they are), the others untouched -- a placement on a device value would pin its
    results' memory kind, and arrays carrying it are another jit cache key (measured: every step compiled twice).
    So a jitted function that starts with it reads host memory lent to it (`kvjax.decode.offload.lends`)."""
    host = jax.memory.Space.Host
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device) if jax.typeof(a).memory_space == host
                        else a, tree)


def in_device_memory(tree):
    """(Eager) `tree` with every array that lies in host memory ("pinned_host") copied into its device's memory, the
    others as they are."""
    def move(a):
        sharding = getattr(a, "sharding", None)
        if getattr(sharding, "memory_kind", None) != "pinned_host":
            return a
        return jax.device_put(a, sharding.with_memory_kind("device"))

    return jax.tree.map(move, tree)


def tree_identity(tree) -> tuple[tuple[int, ...], list]:
    """(the ids of `tree`'s leaves, the leaves): a key for "made from these very arrays" -- a leaf replaced anywhere in
    the tree, even inside a dict held in place, changes it. A cache keyed on it must hold the leaves (returned for that)
    so that no id is reused while the entry lives."""
    leaves = jax.tree_util.tree_leaves(tree)
    return tuple(map(id, leaves)), leaves
