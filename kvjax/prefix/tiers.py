"""Where prefix-cache entries live: a device pool, host memory (memory kind "pinned_host"), a TensorStore store.

- `DevicePool`: one fixed array `[N, *entry_shape]` per form on the device (N from `admission_caps`); entries are
  slots. Writes and gathers are jitted with slot arrays of a static length, so they compile once per capacity bucket.
- Host: one `jax.Array` per entry with memory kind "pinned_host", made by an asynchronous `jax.device_put`; the
  manager publishes it only once `is_ready()` (never compute on it: it is copied back to the device to be used).
- `StoreTier`: a TensorStore key-value store (`file://` by default). A store is a store only if it holds kvjax's
  marker (`MARKER_KEY`, written when the store is created in an empty location); a location that is not empty and
  has no marker is refused, so the cache never writes into (and `kvjax cache` never deletes from) a directory it does
  not own. Every entry is one `codec` value; its header carries the namespace, form fingerprint, block key, parent
  key, block index, **the block's token ids**, shape, dtype, byte count and a BLAKE2b checksum of the payload, and
  `decode_entry` verifies all of them against the block being restored, so a corrupted, truncated or foreign entry
  (even one written under a colliding key) is detected and turned into a recompute. The file driver writes a
  temporary file and renames it, so a crash leaves no half entry; the checksum catches anything else.
"""

from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import CorruptEntry, InputError
from kvjax.prefix import codec
from kvjax.prefix.layouts.llama import FormSpec

DEVICE, HOST, STORE = "device", "host", "store"
TIERS = (DEVICE, HOST, STORE)
MAGIC = "kvjax-prefix-entry"
STORE_FORMAT_VERSION = 2  # 2: entries carry their block's parent key, index and token ids; the store has a marker
MARKER_KEY = "kvjax-prefix-store.json"
MARKER_MAGIC = "kvjax-prefix-store"
ENTRY_FIELDS = dict(magic=str, format_version=int, namespace=str, form=str, fingerprint=str, block_key=str,
                    parent_key=str, index=int, tokens=list, shape=list, dtype=str, complete=bool)
STALE_CAUSE = "store format"  # miss cause of an entry another store format wrote: "store format 1"
_HEX64 = "[0-9a-f]{64}"
_KEY_RE = re.compile(rf"(?P<ns>{_HEX64})/(?:(?P<nsrec>namespace\.json)|blocks/(?P<block>{_HEX64})|"
                     rf"(?P<form>[a-z][a-z0-9_]*)/(?P<entry>{_HEX64}))")


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


class StaleEntry(CorruptEntry):
    """An entry written by another store format version: not corrupt, just not readable by this kvjax. Counted as a
    compatibility miss ("store format N") and left in the store (`kvjax cache --evict-stale` removes it)."""

    def __init__(self, msg: str, version):
        super().__init__(msg)
        self.version = version

    @property
    def cause(self) -> str:
        return f"{STALE_CAUSE} {self.version}"


def stale_version(buf):
    """The format version of a stored entry that another store format wrote (its header is readable and kvjax's),
    else None (this version's entries, and values that are not kvjax entries at all)."""
    header = codec.peek_header(buf)
    if header is None or header.get("magic") != MAGIC or "format_version" not in header:
        return None
    v = header["format_version"]
    return None if v == STORE_FORMAT_VERSION else v


def parse_key(key: str) -> tuple[str, str, str | None, str | None] | None:
    """What a key of a store is: ("marker", "", None, None), ("namespace", ns, None, None), ("block", ns, None, key),
    ("entry", ns, form, key) — or None for anything that is not the store's own (never read as data, never deleted).
    """
    if key == MARKER_KEY:
        return "marker", "", None, None
    m = _KEY_RE.fullmatch(key)
    if m is None:
        return None
    if m["nsrec"]:
        return "namespace", m["ns"], None, None
    if m["block"]:
        return "block", m["ns"], None, m["block"]
    return "entry", m["ns"], m["form"], m["entry"]


class StoreTier:
    """A TensorStore kvstore holding entries and block records under `<namespace hex>/`.

    Args:
        url: kvstore URL or directory (-> `file://`).
        timeout_s: a read slower than this is a tier timeout.
        create: claim an empty location as a new store (write the marker); False = it must already be one.

    Raises:
        InputError: the location is not a kvjax prefix-cache store (no marker, and not empty or `create=False`), or
            a store of another format version.
    """

    def __init__(self, url: str, timeout_s: float = 10.0, *, create: bool = True):
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
        self.marker_version = STORE_FORMAT_VERSION
        self._claim(create)

    def _claim(self, create: bool) -> None:
        raw = self.kv.read(MARKER_KEY).result()
        if raw.state == "value":
            try:
                doc = json.loads(bytes(raw.value))
            except ValueError:
                doc = None
            if not isinstance(doc, dict) or doc.get("magic") != MARKER_MAGIC:
                raise InputError(f"{self.url} is not a kvjax prefix-cache store: {MARKER_KEY} is not kvjax's marker")
            # A store another format version created opens: its entries are compatibility misses ("store format N",
            # found when read), this version's entries are written beside them, and the marker is left as it is so
            # the other version's processes keep using the store too.
            self.marker_version = doc.get("format_version")
            return
        if not create:
            raise InputError(f"{self.url} is not a kvjax prefix-cache store (no {MARKER_KEY} marker)")
        if self.kv.list().result():
            raise InputError(f"{self.url} is not a kvjax prefix-cache store (no {MARKER_KEY} marker) and is not "
                             "empty: refusing to write into it")
        doc = dict(magic=MARKER_MAGIC, format_version=STORE_FORMAT_VERSION)
        self.kv.write(MARKER_KEY, json.dumps(doc).encode()).result()

    # -- keys ----------------------------------------------------------------------------------------------------
    @staticmethod
    def entry_key(ns_hex: str, form: str, block_key: bytes) -> str:
        return f"{ns_hex}/{form}/{block_key.hex()}"

    @staticmethod
    def block_record_key(ns_hex: str, block_key: bytes) -> str:
        return f"{ns_hex}/blocks/{block_key.hex()}"

    # -- entries -------------------------------------------------------------------------------------------------
    def write_entry(self, ns_hex: str, spec: FormSpec, blk, data: np.ndarray):
        """Start writing the entry of form `spec` for Block `blk`; returns a future (published once it completes)."""
        payload = np.ascontiguousarray(data).tobytes()
        header = dict(magic=MAGIC, format_version=STORE_FORMAT_VERSION, namespace=ns_hex, form=spec.name,
                      fingerprint=spec.fingerprint, block_key=blk.key.hex(), parent_key=blk.parent_key.hex(),
                      index=int(blk.index), tokens=np.asarray(blk.tokens).tolist(), shape=list(spec.entry_shape),
                      dtype=spec.dtype, complete=True)
        return self.kv.write(self.entry_key(ns_hex, spec.name, blk.key), codec.encode(header, payload))

    def read_entry_async(self, ns_hex: str, spec: FormSpec, block_key: bytes):
        return self.kv.read(self.entry_key(ns_hex, spec.name, block_key))

    def decode_entry(self, raw, ns_hex: str, spec: FormSpec, blk) -> np.ndarray:
        """Verify a read result against the Block it restores (integrity, identity, format, tokens, bytes).

        Raises:
            CorruptEntry: naming the failed check.
        """
        what = f"entry {spec.name}/{blk.key.hex()[:12]}"
        if raw.state != "value":
            raise CorruptEntry(f"{what}: missing from the store")
        v = stale_version(raw.value)
        if v is not None:
            raise StaleEntry(f"{what}: written by store format {v!r}, this kvjax reads format {STORE_FORMAT_VERSION}",
                             v)
        header, payload = codec.decode(raw.value, what=what, fields=ENTRY_FIELDS)
        codec.expect(header, dict(magic=MAGIC, format_version=STORE_FORMAT_VERSION, namespace=ns_hex, form=spec.name,
                                  fingerprint=spec.fingerprint, block_key=blk.key.hex(), complete=True,
                                  shape=list(spec.entry_shape), dtype=spec.dtype), what)
        # a key is an address, not a proof: the entry must have been computed from this very block of tokens
        codec.expect(header, dict(index=int(blk.index), parent_key=blk.parent_key.hex(),
                                  tokens=np.asarray(blk.tokens).tolist()), what)
        if len(payload) != spec.nbytes:
            raise CorruptEntry(f"{what}: payload is {len(payload)} bytes, the form needs {spec.nbytes}")
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
        except (ValueError, UnicodeDecodeError):
            return None


def _exact_range(key: str):
    import tensorstore as ts

    return ts.KvStore.KeyRange(key, key + "\x00")
