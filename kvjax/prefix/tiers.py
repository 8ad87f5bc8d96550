"""Where prefix-cache entries live: a device pool, host memory (memory kind "pinned_host"), a TensorStore store.

- `DevicePool`: one fixed array `[N, *entry_shape]` per form on the device (N from `admission_caps`); entries are
  slots. Writes and gathers are jitted with slot arrays of a static length, so they compile once per capacity bucket.
- Host: one `jax.Array` per entry with memory kind "pinned_host", made by an asynchronous `jax.device_put`; the
  manager publishes it only once `is_ready()` (never compute on it: it is copied back to the device to be used).
- `StoreTier`: a TensorStore key-value store (`file://` by default). Every value is `u64 header length | JSON header |
  payload`; the header carries the namespace, form fingerprint, block key, shape, dtype, byte count and a BLAKE2b
  checksum of the payload, and `read` verifies all of them, so a corrupted or truncated entry is detected and turned
  into a recompute. The file driver writes a temporary file and renames it, so a crash leaves no half entry; the
  checksum catches anything else.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import CorruptEntry
from kvjax.prefix.identity import payload_checksum
from kvjax.prefix.layouts.llama import FormSpec

DEVICE, HOST, STORE = "device", "host", "store"
TIERS = (DEVICE, HOST, STORE)
MAGIC = "kvjax-prefix-entry"
STORE_FORMAT_VERSION = 1



def admission_caps(specs: tuple[FormSpec, ...], budgets: dict[str, int], shares: dict[str, float] | None = None,
                   ) -> dict[str, dict[str, int]]:
    """Entries each form may hold in each tier — the one function that sizes pools and admits at runtime.

    Args:
        specs: the forms.
        budgets: tier -> bytes (missing tier = 0 bytes).
        shares: form -> fraction of every tier's budget (default: equal bytes per form).

    Returns:
        form -> tier -> number of entries.
    """
    if shares is None:
        shares = {s.name: 1.0 / len(specs) for s in specs} if specs else {}
    total = sum(shares.values()) or 1.0
    return {s.name: {t: int(budgets.get(t, 0) * shares[s.name] / total) // s.nbytes for t in TIERS} for s in specs}


@functools.partial(jax.jit, donate_argnames="pool")
def _pool_put(pool, src, src_idx, dst):
    """pool[dst[j]] = src[src_idx[j]] for every j; dst == N drops the row."""
    return pool.at[dst].set(src[src_idx].astype(pool.dtype), mode="drop")


@jax.jit
def _pool_gather(pool, slots, staged, from_staged):
    """[M, *entry] rows: staged[j] where from_staged[j], else pool[slots[j]] (slot -1 -> zeros)."""
    rows = pool[jnp.clip(slots, 0, pool.shape[0] - 1)]
    rows = jnp.where((slots >= 0).reshape((-1,) + (1,) * (rows.ndim - 1)), rows, 0)
    return jnp.where(from_staged.reshape((-1,) + (1,) * (rows.ndim - 1)), staged.astype(rows.dtype), rows)


@jax.jit
def take_one(src, i):
    """src[i] for a traced index (compiles once per shape, unlike Python-int indexing)."""
    return jax.lax.dynamic_index_in_dim(src, i, keepdims=False)


class DevicePool:
    """Fixed-size device array of `n` entries of one form, with a free list."""

    def __init__(self, spec: FormSpec, n: int):
        self.spec = spec
        self.n = int(n)
        self.array = jnp.zeros((max(self.n, 1),) + spec.entry_shape, spec.dtype)
        self.free = list(range(self.n - 1, -1, -1))

    def reserve(self, k: int) -> list[int] | None:
        """All-or-nothing: `k` slots or None."""
        if k > len(self.free):
            return None
        out = [self.free.pop() for _ in range(k)]
        return out

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def put(self, src: jax.Array, src_idx: list[int], dst: list[int]) -> None:
        """Copy rows `src[src_idx]` of a `[M, *entry]` array into slots `dst` (padded to M: one compile per M)."""
        M = src.shape[0]
        si = np.zeros((M,), np.int32)
        di = np.full((M,), self.array.shape[0], np.int32)
        si[: len(src_idx)] = src_idx
        di[: len(dst)] = dst
        self.array = _pool_put(self.array, src, jnp.asarray(si), jnp.asarray(di))

    def gather(self, slots: np.ndarray, staged: np.ndarray | jax.Array, from_staged: np.ndarray) -> jax.Array:
        return _pool_gather(self.array, jnp.asarray(slots, jnp.int32), staged, jnp.asarray(from_staged))


def host_sharding():
    dev = jax.devices()[0]
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


def device_sharding():
    return jax.sharding.SingleDeviceSharding(jax.devices()[0])


def to_host(x: jax.Array) -> jax.Array:
    """Start an asynchronous device -> pinned_host copy (check `is_ready()` before publishing it)."""
    return jax.device_put(x, host_sharding())


def check_bytes(x, spec: FormSpec, memory_kind: str | None = None) -> str | None:
    """Byte-level verification (DESIGN level d): dtype, shape, contiguity/alignment, memory kind. None if fine."""
    if np.dtype(x.dtype) != np.dtype(spec.dtype):
        return f"dtype {np.dtype(x.dtype).name} != {spec.dtype}"
    if tuple(x.shape) != tuple(spec.entry_shape):
        return f"shape {tuple(x.shape)} != {spec.entry_shape}"
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            return "numpy entry is not C-contiguous"
        if x.ctypes.data % x.dtype.itemsize:
            return f"numpy entry misaligned for {x.dtype}"
    elif memory_kind is not None and x.sharding.memory_kind != memory_kind:
        return f"memory kind {x.sharding.memory_kind} != {memory_kind}"
    return None


class StoreTier:
    """A TensorStore kvstore holding entries and block records under `<namespace hex>/`."""

    def __init__(self, url: str, timeout_s: float = 10.0):
        import tensorstore as ts

        if "://" not in url:
            url = "file://" + os.path.abspath(url)
        if url.startswith("file://"):
            spec = {"driver": "file", "path": url[len("file://"):].rstrip("/") + "/"}
        else:
            spec = url if url.endswith("/") else url + "/"
        self.url = url
        self.timeout_s = timeout_s
        self.kv = ts.KvStore.open(spec).result()

    # -- keys ----------------------------------------------------------------------------------------------------
    @staticmethod
    def entry_key(ns_hex: str, form: str, block_key: bytes) -> str:
        return f"{ns_hex}/{form}/{block_key.hex()}"

    @staticmethod
    def block_record_key(ns_hex: str, block_key: bytes) -> str:
        return f"{ns_hex}/blocks/{block_key.hex()}"

    # -- entries -------------------------------------------------------------------------------------------------
    def write_entry(self, ns_hex: str, spec: FormSpec, block_key: bytes, data: np.ndarray):
        """Start writing one entry; returns a future (the entry is published by the caller once it completes)."""
        payload = np.ascontiguousarray(data).tobytes()
        header = dict(magic=MAGIC, format_version=STORE_FORMAT_VERSION, namespace=ns_hex, form=spec.name,
                      fingerprint=spec.fingerprint, block_key=block_key.hex(), shape=list(spec.entry_shape),
                      dtype=spec.dtype, nbytes=len(payload), checksum=payload_checksum(payload), complete=True)
        h = json.dumps(header, sort_keys=True).encode()
        return self.kv.write(self.entry_key(ns_hex, spec.name, block_key), len(h).to_bytes(8, "little") + h + payload)

    def read_entry_async(self, ns_hex: str, spec: FormSpec, block_key: bytes):
        return self.kv.read(self.entry_key(ns_hex, spec.name, block_key))

    def decode_entry(self, raw, ns_hex: str, spec: FormSpec, block_key: bytes) -> np.ndarray:
        """Verify a read result (integrity, identity, format fingerprint, bytes) and return the entry.

        Raises:
            CorruptEntry: naming the failed check.
        """
        if raw.state != "value":
            raise CorruptEntry(f"entry {spec.name}/{block_key.hex()[:12]} missing from the store")
        buf = bytes(raw.value)
        if len(buf) < 8:
            raise CorruptEntry("truncated: no header length")
        hl = int.from_bytes(buf[:8], "little")
        try:
            header = json.loads(buf[8:8 + hl])
        except (ValueError, UnicodeDecodeError) as e:
            raise CorruptEntry(f"unreadable header: {e}") from None
        payload = buf[8 + hl:]
        checks = [("magic", MAGIC), ("format_version", STORE_FORMAT_VERSION), ("namespace", ns_hex),
                  ("form", spec.name), ("fingerprint", spec.fingerprint), ("block_key", block_key.hex()),
                  ("shape", list(spec.entry_shape)), ("dtype", spec.dtype), ("complete", True)]
        for k, want in checks:
            if header.get(k) != want:
                raise CorruptEntry(f"header {k}={header.get(k)!r}, expected {want!r}")
        if header.get("nbytes") != len(payload) or len(payload) != spec.nbytes:
            raise CorruptEntry(f"truncated payload: {len(payload)} bytes, header says {header.get('nbytes')}, "
                               f"form needs {spec.nbytes}")
        if payload_checksum(payload) != header.get("checksum"):
            raise CorruptEntry("checksum mismatch")
        return np.frombuffer(payload, dtype=spec.dtype).reshape(spec.entry_shape)

    def delete_entry(self, ns_hex: str, form: str, block_key: bytes):
        return self.kv.delete_range(_exact_range(self.entry_key(ns_hex, form, block_key)))

    # -- block records and namespaces (what a restarted cache rebuilds its tree from) --------------------------------
    def write_block_record(self, ns_hex: str, block_key: bytes, parent_key: bytes, index: int, tokens: np.ndarray):
        rec = dict(index=int(index), parent=parent_key.hex(), tokens=[int(t) for t in tokens])
        return self.kv.write(self.block_record_key(ns_hex, block_key), json.dumps(rec).encode())

    def write_namespace(self, ns) -> None:
        self.kv.write(f"{ns.hex}/namespace.json", ns.to_json().encode()).result()

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self.kv.list().result()]

    def read_json(self, key: str):
        r = self.kv.read(key).result()
        if r.state != "value":
            return None
        try:
            return json.loads(bytes(r.value))
        except ValueError:
            return None


def _exact_range(key: str):
    import tensorstore as ts

    return ts.KvStore.KeyRange(key, key + "\x00")
