"""The runtime part of a cache namespace: what computes the keys and values besides the weights — the kernel ABI,
the attention implementation, the native CPU kernels (their sources' digest and the products they take), the mesh the
params are partitioned over, device kind and platform, jax and jaxlib versions. Two hosts that differ in any of these
do not compute bit-identical keys and values, so a store they share must never hand one's entries to the other."""

from __future__ import annotations

import functools
import json

import jax

from kvjax.prefix.hashing import digest

KERNEL_ABI = "kvjax-jnp-attend-1"  # the attention definition the bytes are read by (models/attention.py)
SINGLE_DEVICE = "single-device"


def mesh_descriptor(params) -> str:
    """How `params` are partitioned: "single-device", or "mesh:" + the mesh axes and a digest of every leaf's spec.

    A sharded computation reduces in another order than an unsharded one, so the descriptor is part of identity.
    """
    if params is None:
        return SINGLE_DEVICE
    axes, specs = set(), []
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        sh = getattr(leaf, "sharding", None)
        if isinstance(sh, jax.sharding.NamedSharding):
            axes.add(tuple((str(k), int(v)) for k, v in sh.mesh.shape.items()))
            specs.append(f"{jax.tree_util.keystr(path)}:{sh.spec}")
        elif sh is not None and len(sh.device_set) > 1:
            specs.append(f"{jax.tree_util.keystr(path)}:{type(sh).__name__}:{len(sh.device_set)}")
    if not specs:
        return SINGLE_DEVICE
    body = {"axes": sorted(axes), "specs": digest(b"kvjax.mesh1", "\n".join(specs).encode()).hex()[:16]}
    return "mesh:" + json.dumps(body, separators=(",", ":"))


@functools.cache
def _process_fields() -> dict[str, str]:
    import jaxlib

    dev = jax.devices()[0]
    return dict(kernel_abi=KERNEL_ABI, device_kind=str(dev.device_kind), platform=str(dev.platform),
                jax=jax.__version__, jaxlib=jaxlib.__version__, native=native_field())


def native_field() -> str:
    """Which native CPU kernels compute here: "none", or their sources' digest and the rows of f32 products they take
    (`pallas_kernels.linear.F32_NATIVE_ROWS`): a decode or verify step's products and attention run them, so a change
    to either changes the keys and values a host writes."""
    from pallas_kernels import native
    from pallas_kernels.linear import F32_NATIVE_ROWS

    if jax.default_backend() != "cpu" or not native.available():
        return "none"
    return f"{native.source_digest()}:f32-rows-{F32_NATIVE_ROWS[0]}-{F32_NATIVE_ROWS[1]}"


def runtime_fields(params, attention: str | None = None) -> dict[str, str]:
    """The representation fields of the running computation (see the module docstring) for `params`.

    Args:
        params: the params pytree (its shardings give the mesh); None = unsharded.
        attention: the attention implementation the computation names (None = what the default dispatch picks on
            this backend, `pallas_kernels.resolve(None)`).
    """
    import pallas_kernels

    return {**_process_fields(), "attention": pallas_kernels.resolve(attention), "mesh": mesh_descriptor(params)}
