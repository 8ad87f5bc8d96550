"""Host offload of the prompt's full KV with JAX memory kinds (`pinned_host` <-> `device`).

The prompt's full keys/values live in host memory between verifications and are brought back with `jax.device_put`
(asynchronous) for each verify pass. `fetch` issues every layer's transfer in layer order before anything waits on
them, so later layers' copies are in flight while earlier ones land; the verify jit starts when its inputs are ready.
(Overlapping a layer's transfer with the previous layer's *compute* would need one jit call per layer, which changes
the verify computation's compiled form and with it the bit-identity to the reference decoder; on this CPU the copy
and the compute share the same memory bandwidth anyway.) Decoded tokens' KV never leaves the device.
"""

from __future__ import annotations

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


def fetch(host_tree, device=None):
    """Start host->device copies of every array, in tree (layer) order; returns device arrays without waiting."""
    _, dev = shardings(device)
    return jax.tree.map(lambda a: jax.device_put(a, dev), host_tree)
