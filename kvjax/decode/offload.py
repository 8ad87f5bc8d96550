"""Host offload of the prompt's full KV with JAX memory kinds (`pinned_host` <-> `device`).

The prompt's full keys/values live in host memory between verifications and are brought back with `jax.device_put`
(asynchronous) for each verify pass. `fetch` issues every layer's transfer in layer order before anything waits on
them, so later layers' copies are in flight while earlier ones land; the verify jit starts when its inputs are ready.
(Overlapping a layer's transfer with the previous layer's *compute* would need one jit call per layer, which changes
the verify computation's compiled form and with it the bit-identity to the reference decoder; on this CPU the copy
and the compute share the same memory bandwidth anyway.) Decoded tokens' KV never leaves the device.

On the CPU there is no link to cross: host and device memory are the same RAM, and a verify is lent the host copy
instead (`lends`): it reads the buffers where they lie, assembles the full cache in them and hands them back
(`take_back`), so the prompt's full cache is never copied between rounds.
"""

from __future__ import annotations

import functools

import jax
from jax.sharding import SingleDeviceSharding

from kvjax.arrays import same_shapes


def shardings(device=None):
    """(host, device) shardings of one device: memory kinds "pinned_host" and "device"."""
    dev = device or jax.devices()[0]
    return (SingleDeviceSharding(dev, memory_kind="pinned_host"), SingleDeviceSharding(dev, memory_kind="device"))


def to_host(tree, device=None, copy: bool = False):
    """Copy every array of `tree` to pinned host memory (None leaves stay None). `copy`: new buffers even for arrays
    already there (which `jax.device_put` would hand back as they are)."""
    host, _ = shardings(device)
    if copy and all(a.sharding == host for a in jax.tree.leaves(tree)):
        # a jitted copy: 16 ms for 64 MiB against jax.device_put(may_alias=False)'s 29 ms (same run, this CPU)
        return _copy(tree)
    return jax.tree.map(lambda a: jax.device_put(a, host, may_alias=False if copy else None), tree)


@jax.jit
def _copy(tree):
    return tree  # (arguments not donated: XLA writes the outputs to new buffers)


def fetch(host_tree, device=None, into=None):
    """Start host->device copies of every array, in tree (layer) order; returns device arrays without waiting.

    `into`: device arrays of the same tree, shapes and dtypes that the caller is done with (a previous fetch's
    buffers; `scripts/bench_roofline.py` times an accelerator's per-verify copy this way), donated. On the CPU the copy then writes into them
    instead of into fresh allocations: a fresh buffer's pages are faulted in and zeroed by the kernel on first
    touch, which made a 64 MiB fetch cost 8.0 ms against 3.5 ms into reused buffers (same run, tiny model's
    16K full cache). Elsewhere (and when `into` does not match) `into` is dropped and `jax.device_put` copies as
    before: a GPU's allocator reuses device memory without faults, and its copy engine should keep the transfer.
    """
    _, dev = shardings(device)
    if into is not None and _platform(dev) == "cpu" and same_shapes(into, host_tree):
        return _copy_into(into, host_tree, dev)
    del into
    return jax.tree.map(lambda a: jax.device_put(a, dev), host_tree)


# Whether `lends` may say yes; tests switch it off to run the fetching path (a GPU's or TPU's) on the CPU.
LEND_ON_CPU = True


def lends(host_tree) -> bool:
    """Whether a verify reads `host_tree` where it is instead of a fetched copy: on the CPU, where "pinned_host" and
    "device" memory are the same RAM, a jit moves its pinned-host arguments into device space without a copy
    (`kvjax.arrays.device_space`), so a fetch would only copy the full cache from one place in RAM to another (measured, the
    bundled model's 64 MiB at 16K: 3.5-8 ms a verify, the in-place read none). The verify donates what it is lent
    and hands the same buffers back, in host space, in its committed cache (`take_back`). Elsewhere the full cache
    crosses a host link and is fetched."""
    leaves = jax.tree.leaves(host_tree)
    return LEND_ON_CPU and bool(leaves) and all(a.sharding.memory_kind == "pinned_host" and d.platform == "cpu"
                                                for a in leaves for d in a.devices())


def device_of(tree):
    """The device of the first array in `tree`."""
    return next(iter(jax.tree.leaves(tree)[0].devices()))


def host_space(tree):
    """(Traced) every leaf in host memory space: a verify's committed cache handed back to a lent host copy (its
    donated host buffers come back aliased; the small device leaves are copied)."""
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), tree)


def in_host_space(tree) -> bool:
    """(Traced) whether the arguments in `tree` are in host memory space: a lent host copy (`lends`)."""
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(jax.typeof(a).memory_space == jax.memory.Space.Host for a in leaves)


def take_back(family, committed):
    """The host part of a verify's committed cache (donated), after the verify was lent the host copy (`lends`): the
    same buffers, holding the prompt's rows as before plus the tail rows the assembly wrote after them (masked by the
    length; the next assembly writes them again)."""
    return _host_part(committed, family=family)


@functools.partial(jax.jit, static_argnames="family", donate_argnums=0)
def _host_part(committed, *, family):
    # jitted: the split's empty tails are never made (eagerly: ~8 small allocations, 0.7 ms a verify)
    return family.offload_split(committed, 1)[0]


def _platform(sharding) -> str:
    return next(iter(sharding.device_set)).platform


@functools.partial(jax.jit, static_argnums=2, donate_argnums=0)
def _copy_into(dst, src, sharding):
    # a whole-buffer update of a donated buffer: XLA writes the fetched bytes into dst's memory
    return jax.tree.map(lambda d, s: jax.lax.dynamic_update_slice(d, jax.device_put(s, sharding), (0,) * d.ndim),
                        dst, src)
