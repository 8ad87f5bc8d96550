"""Cache identity: a `Namespace` says which computation produced a cache entry; block keys chain inside it.

A namespace has two typed parts (after LMCache's split, see REFERENCES.md "Prefix caching"):

- **semantic** — what the model computes: the weights as a content fingerprint (never a name), tokenizer and
  chat-template revisions (content hashes), the adapters as (content fingerprint, scale) in order, and every config
  field that changes keys or values (`ModelConfig.kv_fields()`: rope, windows, layer types, family, compression
  rates for hybrid families);
- **representation** — how the bytes are produced and stored: kv dtype, layout/format version (per-form
  fingerprints from `layouts/`), block size, and the runtime (`runtime_identity.runtime_fields`): kernel ABI,
  attention implementation, mesh, device kind and platform, jax/jaxlib versions — two computations that are not
  bit-identical never share entries.

plus a per-tenant salt that the server supplies. Sampling parameters are deliberately absent: they do not change
keys/values. The digest is BLAKE2b over a canonical JSON encoding in which every field is a typed, named entry, so
one field's value can never be read as another's (an adapter name cannot collide with a tenant salt); the
`person` parameter separates the namespace, block-key and payload hash domains.

Block keys chain `H(namespace, parent key, block token ids)`. A digest is an address, not a proof: a hit always
re-compares token ids (radix.py) and every stored entry carries its block's token ids, compared on restore (tiers.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import weakref
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from kvjax.prefix.hashing import canonical, digest
from kvjax.prefix.runtime_identity import runtime_fields

NAMESPACE_DOMAIN = b"kvjax.ns.v1"
BLOCK_DOMAIN = b"kvjax.block.v1"
PAYLOAD_DOMAIN = b"kvjax.payload1"
ROOT_KEY = bytes(32)


# id(leaf) -> (weak reference to the leaf, digest of its bytes). Only `jax.Array` leaves are memoised: they are
# immutable, so while the weak reference still points at the same object its bytes are the ones hashed. The weak
# reference keeps nothing alive, and its callback forgets the id before the object's memory (and id) can be reused.
_LEAF_DIGESTS: dict[int, tuple[weakref.ref, bytes]] = {}


def _forget(key: int, ref: weakref.ref) -> None:
    if _LEAF_DIGESTS.get(key, (None,))[0] is ref:
        del _LEAF_DIGESTS[key]


def _hash_leaf(leaf) -> bytes:
    a = np.asarray(leaf)
    h = hashlib.blake2b(digest_size=32, person=b"kvjax.leaf1")
    h.update(f"{a.dtype.str}{a.shape}".encode())
    h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8))  # a byte view: no copy, any dtype (bf16 too)
    return h.digest()


def leaf_digest(leaf) -> bytes:
    """BLAKE2b of one array's dtype, shape and bytes; memoised for immutable `jax.Array`s (see `_LEAF_DIGESTS`).

    Anything else (a NumPy array can be written in place) is hashed on every call.
    """
    if not isinstance(leaf, jax.Array):
        return _hash_leaf(leaf)
    key = id(leaf)
    hit = _LEAF_DIGESTS.get(key)
    if hit is not None and hit[0]() is leaf:
        return hit[1]
    d = _hash_leaf(leaf)
    ref = weakref.ref(leaf, lambda r, key=key: _forget(key, r))
    _LEAF_DIGESTS[key] = (ref, d)
    return d


def weights_fingerprint(params) -> str:
    """Content fingerprint of a params pytree: BLAKE2b over every leaf's path and `leaf_digest`.

    It follows the content, never the object: replacing a leaf inside the same dict (an RL step, a hot reload)
    changes it; the same values in new objects (a renamed or re-loaded checkpoint) keep it. Each leaf's bytes are
    hashed once per array object (on a GPU that is one device-to-host copy per new leaf), then looked up by identity.
    """
    h = hashlib.blake2b(digest_size=32, person=b"kvjax.weights2")
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        p = jax.tree_util.keystr(path).encode()
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
        h.update(leaf_digest(leaf))
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Identity of a cache: semantic + representation fields and a tenant salt. Compare and hash by `digest`.

    Attributes:
        semantic: what the model computes (weights fingerprint, tokenizer/template revisions, adapter, kv fields).
        representation: how the bytes are stored (kv dtype, format fingerprints, kernel ABI, mesh, block size).
        tenant_salt: per-tenant isolation set by the server ("" = shared).
    """

    semantic: Mapping[str, Any]
    representation: Mapping[str, Any]
    tenant_salt: str = ""

    @functools.cached_property
    def digest(self) -> bytes:
        body = json.dumps({"semantic": canonical(self.semantic), "representation": canonical(self.representation),
                           "tenant_salt": self.tenant_salt}, sort_keys=True, separators=(",", ":"))
        return digest(NAMESPACE_DOMAIN, body.encode())

    @functools.cached_property
    def hex(self) -> str:
        return self.digest.hex()

    def flat_fields(self) -> dict[str, str]:
        """`part.field` -> canonical JSON of its value (used to name the fields that make two namespaces differ)."""
        out = {f"semantic.{k}": json.dumps(canonical(v), sort_keys=True) for k, v in self.semantic.items()}
        out.update({f"representation.{k}": json.dumps(canonical(v), sort_keys=True)
                    for k, v in self.representation.items()})
        out["tenant_salt"] = json.dumps(self.tenant_salt)
        return out

    def diff(self, other: "Namespace") -> list[str]:
        """Names of the fields whose values differ (sorted), e.g. ['semantic.weights']."""
        a, b = self.flat_fields(), other.flat_fields()
        return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))

    def to_json(self) -> str:
        return json.dumps({"semantic": canonical(self.semantic), "representation": canonical(self.representation),
                           "tenant_salt": self.tenant_salt}, sort_keys=True)


def make_namespace(config, *, weights: str, kv_dtype: str, formats: Mapping[str, str], block_size: int,
                   tokenizer_rev: str = "", template_rev: str = "", adapters: Sequence[tuple[str, float]] = (),
                   runtime: Mapping[str, Any] | None = None, tenant_salt: str = "") -> Namespace:
    """Build the namespace of a model + cache layout (`prefill.model_namespace` derives every argument from a model).

    Args:
        config: a config with `kv_fields()` (every field that changes keys/values).
        weights: content fingerprint of the weights (`weights_fingerprint(params)`), not a name.
        kv_dtype: cache dtype name ("float32", "bfloat16").
        formats: form name -> format/ABI fingerprint (`layout.FormSpec.fingerprint`).
        block_size: tokens per block `P`.
        tokenizer_rev, template_rev: content hashes of the tokenizer and of the chat template
            (`model_identity.tokenizer_revisions`; "" = the model has none).
        adapters: (content fingerprint, scale) per adapter, in the order they are applied
            (`model_identity.adapter_fields`).
        runtime: what the running computation is besides the weights — kernel ABI, attention implementation, mesh,
            device kind, platform, jax/jaxlib versions (`runtime_identity.runtime_fields`); default: this process,
            unsharded.
        tenant_salt: per-tenant salt from the server.
    """
    if runtime is None:
        runtime = runtime_fields(None)
    semantic = {"weights": weights, "tokenizer_rev": tokenizer_rev, "template_rev": template_rev,
                "adapters": [[str(fp), float(scale)] for fp, scale in adapters], "kv_fields": config.kv_fields()}
    representation = {"kv_dtype": kv_dtype, "formats": dict(formats), "block_size": int(block_size), **runtime}
    return Namespace(semantic=semantic, representation=representation, tenant_salt=tenant_salt)


def block_key(namespace_digest: bytes, parent: bytes, tokens: np.ndarray) -> bytes:
    """Key of one block: H(namespace, parent key, block token ids as little-endian i32)."""
    return digest(BLOCK_DOMAIN, namespace_digest, parent, np.asarray(tokens, "<i4").tobytes())


def block_keys(namespace_digest: bytes, tokens: np.ndarray, block_size: int, parent: bytes = ROOT_KEY,
               ) -> list[bytes]:
    """Chained keys of the full blocks of `tokens` (a trailing partial block has no key)."""
    keys = []
    for s in range(0, (len(tokens) // block_size) * block_size, block_size):
        parent = block_key(namespace_digest, parent, tokens[s:s + block_size])
        keys.append(parent)
    return keys


def payload_checksum(data: bytes) -> str:
    """Checksum of a stored payload (BLAKE2b, its own domain)."""
    return digest(PAYLOAD_DOMAIN, data).hex()
