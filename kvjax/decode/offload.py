"""Host offload of the prompt's full KV with JAX memory kinds (`pinned_host` <-> `device`).

The prompt's full keys/values live in host memory between verifications and are brought back with `jax.device_put`
(asynchronous) for each verify pass. `fetch` issues every layer's transfer in layer order before anything waits on
them, so later layers' copies are in flight while earlier ones land; the verify jit starts when its inputs are ready.
(Overlapping a layer's transfer with the previous layer's *compute* would need one jit call per layer, which changes
the verify computation's compiled form and with it the bit-identity to the reference decoder; on this CPU the copy
and the compute share the same memory bandwidth anyway.) Decoded tokens' KV never leaves the device.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import SingleDeviceSharding


def shardings(device=None):
    """(host, device) shardings of one device: memory kinds "pinned_host" and "device"."""
    dev = device or jax.devices()[0]
    return (SingleDeviceSharding(dev, memory_kind="pinned_host"), SingleDeviceSharding(dev, memory_kind="device"))


def to_host(tree, device=None):
    """Copy every array of `tree` to pinned host memory (None leaves stay None)."""
    host, _ = shardings(device)
    return jax.tree.map(lambda a: jax.device_put(a, host), tree)


def fetch(host_tree, device=None, into=None):
    """Start host->device copies of every array, in tree (layer) order; returns device arrays without waiting.

    `into`: device arrays of the same tree, shapes and dtypes that the caller is done with (a previous fetch's
    buffers, e.g. the assembled cache a verify hands back), donated. On the CPU the copy then writes into them
    instead of into fresh allocations: a fresh buffer's pages are faulted in and zeroed by the kernel on first
    touch, which made a 64 MiB fetch cost 8.0 ms against 3.5 ms into reused buffers (same run, tiny model's
    16K full cache). Elsewhere (and when `into` does not match) `into` is dropped and `jax.device_put` copies as
    before: a GPU's allocator reuses device memory without faults, and its copy engine should keep the transfer.
    """
    _, dev = shardings(device)
    if into is not None and _platform(dev) == "cpu" and _same_arrays(into, host_tree):
        return _copy_into(into, host_tree, dev)
    del into
    return jax.tree.map(lambda a: jax.device_put(a, dev), host_tree)


def reusable(family, assembled):
    """The arrays of an assembled full cache (a verify's committed cache) that a later `fetch(into=...)` of the same
    request shape can overwrite: the family's host part of it (`offload_split`), aliasing its buffers. None off the
    CPU, where `fetch` would not use them: holding them until the next fetch would keep a second full cache in device
    memory."""
    leaves = jax.tree.leaves(assembled)
    if not leaves or any(d.platform != "cpu" for d in leaves[0].devices()):
        return None  # (before splitting: off the CPU the split's small device parts would be made for nothing)
    part = family.offload_split(assembled, 1)[0]
    return part if jax.tree.leaves(part) else None


def _platform(sharding) -> str:
    return next(iter(sharding.device_set)).platform


def _same_arrays(a, b) -> bool:
    if jax.tree.structure(a) != jax.tree.structure(b):
        return False
    return all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@functools.partial(jax.jit, static_argnums=2, donate_argnums=0)
def _copy_into(dst, src, sharding):
    # a whole-buffer update of a donated buffer: XLA writes the fetched bytes into dst's memory
    return jax.tree.map(lambda d, s: jax.lax.dynamic_update_slice(d, jax.device_put(s, sharding), (0,) * d.ndim),
                        dst, src)
