"""What a stored prefix is: its identity, and the bundles that hold its full cache, last logits and draft caches.

Identity. The namespace is the prefix cache's (`kvjax.prefix.identity.make_namespace`: weights content fingerprint
that follows in-place leaf updates, tokenizer/template content hashes, adapters as (content fingerprint, scale),
every config field that changes keys/values, kv dtype, the runtime — kernel ABI, attention implementation, mesh,
device kind, jax/jaxlib — and the tenant salt) with this package's full-cache format as its representation; the
prefix key is BLAKE2b(namespace, prompt token ids), and the stored token ids are re-compared on every hit (a digest
is an address, not a proof). A draft cache is a second, lossy representation of the same prefix: its key adds the
compressor's name and EVERY field of its settings (ratio, sinks, window, bits, ...), the recent-ring size and the
draft format version, so a StreamingLLM 4x draft is never served for a SnapKV or 8x one.

Layout under `<namespace>/<prefix>/`:
  - `full/`: bundles `head` (logits f32[V] at the last prompt position, tokens i32[P]) and `layer-000`, ... one per
    layer in layer order (full-attention layers: the prompt's k, v [K, P, D]; sliding layers: the ring k, v [K, W, D]),
    then the manifest;
  - `draft-<key>/`: one bundle with every compressed part of every layer, then the manifest.

The first token. Both serving paths need the logits at the last prompt position; they are stored with the prefix
(`head`), checksummed like everything else, so the first token is exact without the full cache or a recompute.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.draft import DraftCache, DraftLayer, QuantizedKV, RecentKV, SparseKV
from kvjax.cache.dense import DenseKV, ModelCache, WindowKV
from kvjax.prefix import model_identity
from kvjax.prefix.identity import Namespace, canonical, digest, make_namespace, weights_fingerprint
from kvjax.errors import CorruptEntry
from kvjax.remote.store_client import RemoteStore

FULL_FORMAT = "kvjax-remote-full-v1"  # per-layer prompt rows [K, P, D] / sliding rings [K, W, D], batch 1
DRAFT_FORMAT = "kvjax-remote-draft-v1"
FULL = "full"
PREFIX_DOMAIN = b"kvjax.rprefix1"
DRAFT_DOMAIN = b"kvjax.rdraft1"
PART_TYPES = {"SparseKV": SparseKV, "QuantizedKV": QuantizedKV}


def kv_dtype(model):
    return jnp.bfloat16 if getattr(model, "dtype", "f32") in ("bf16", "bfloat16") else jnp.float32


def prefix_namespace(model, *, tenant_salt: str = "", adapters: Sequence[tuple[Any, float]] = ()) -> Namespace:
    """Namespace of `model`'s remote prefix entries, every field derived from the model (as
    `kvjax.prefix.prefill.model_namespace`): weights and adapters by content, tokenizer files by content hashes."""
    tokenizer_rev, template_rev = model_identity.tokenizer_revisions(getattr(model, "tokenizer", None))
    return make_namespace(model.config, weights=weights_fingerprint(model.params),
                          kv_dtype=np.dtype(kv_dtype(model)).name, formats={FULL: FULL_FORMAT}, block_size=0,
                          tokenizer_rev=tokenizer_rev, template_rev=template_rev,
                          adapters=model_identity.adapter_fields(adapters),
                          runtime=model_identity.runtime_fields(model.params, model.attention),
                          tenant_salt=tenant_salt)


def prefix_key(ns: Namespace, tokens) -> str:
    return digest(PREFIX_DOMAIN, ns.digest, np.asarray(tokens, "<i4").tobytes()).hex()


def draft_identity(compressor, recent_slots: int) -> dict:
    """The draft cache's representation identity: compressor name + all its settings + ring size + format."""
    settings = {f.name: getattr(compressor, f.name) for f in dataclasses.fields(compressor)}
    return {"format": DRAFT_FORMAT, "compressor": compressor.name, "settings": canonical(settings),
            "recent_slots": int(recent_slots)}


def draft_name(identity: dict) -> str:
    body = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return "draft-" + digest(DRAFT_DOMAIN, body).hex()[:32]


# ---------------------------------------------------------------------------------------------------- write
def store_full(store: RemoteStore, ns: Namespace, tokens, logits, full: ModelCache) -> dict:
    """Write the prefix's full cache (batch 1, length P) and its last logits; publish the manifest last.

    Args:
        tokens: i32[P] the prefix; logits: f32[V] at position P-1; full: the prefilled cache.

    Returns:
        the manifest.
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    P = tokens.size
    if int(full.length[0]) != P:
        raise ValueError(f"full cache holds {int(full.length[0])} tokens, the prefix has {P}")
    pk = prefix_key(ns, tokens)
    recs = {"head": store.put_bundle(ns.hex, pk, f"{FULL}-head",
                                     {"logits": np.asarray(logits, np.float32).reshape(-1), "tokens": tokens})}
    layers = []
    for i, form in enumerate(full.layers):
        if isinstance(form, WindowKV):
            arrays = {"k": np.asarray(form.k[0]), "v": np.asarray(form.v[0])}
            layers.append({"kind": "swa", "window": form.window})
        else:
            arrays = {"k": np.asarray(form.k[0, :, :P]), "v": np.asarray(form.v[0, :, :P])}
            layers.append({"kind": "dense"})
        recs[f"layer-{i:03d}"] = store.put_bundle(ns.hex, pk, f"{FULL}-layer-{i:03d}", arrays)
    body = {"format": FULL_FORMAT, "prompt_len": P, "prefill_capacity": int(full.layers[0].k.shape[2]),
            "layers": layers, "bundles": recs,
            "namespace": json.loads(ns.to_json())}
    store.put_manifest(ns.hex, pk, FULL, body)
    return body


def store_draft(store: RemoteStore, ns: Namespace, tokens, dcache: DraftCache, identity: dict) -> dict:
    """Write one draft cache (as built right after prefill: empty recent rings) under its identity."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    arrays, layers = {}, []
    for i, layer in enumerate(dcache.layers):
        parts = []
        for j, part in enumerate(layer.parts):
            fields = [f for f in dataclasses.fields(part) if not f.metadata.get("static")]
            static = {f.name: getattr(part, f.name) for f in dataclasses.fields(part) if f.metadata.get("static")}
            for f in fields:
                arrays[f"L{i}.p{j}.{f.name}"] = np.asarray(getattr(part, f.name))
            parts.append({"type": type(part).__name__, "static": static, "fields": [f.name for f in fields]})
        r = layer.recent
        layers.append({"window": layer.window, "parts": parts, "recent": [int(s) for s in r.k.shape[1:]],
                       "dtype": np.dtype(r.k.dtype).name})
    name = draft_name(identity)
    pk = prefix_key(ns, tokens)
    rec = store.put_bundle(ns.hex, pk, name, arrays)
    body = {"identity": identity, "prompt_len": int(tokens.size), "layers": layers, "bundle": rec}
    store.put_manifest(ns.hex, pk, name, body)
    return body


# ---------------------------------------------------------------------------------------------------- read
def check_full_manifest(body: dict, config, tokens) -> None:
    """Raise CorruptEntry unless a full manifest matches this model's layer kinds and the prefix length."""
    if body.get("format") != FULL_FORMAT:
        raise CorruptEntry(f"full manifest format {body.get('format')!r}, expected {FULL_FORMAT!r}")
    if body.get("prompt_len") != len(tokens) or len(body.get("layers", ())) != config.num_layers:
        raise CorruptEntry("full manifest: prompt length or layer count differs from the request")


def read_head(store: RemoteStore, ns: Namespace, tokens, body: dict) -> np.ndarray:
    """Fetch and check the head bundle; returns the last-position logits f32[V]."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    head = store.get_bundle(ns.hex, prefix_key(ns, tokens), body["bundles"]["head"])
    if not np.array_equal(head["tokens"], tokens):
        raise CorruptEntry("stored prefix tokens differ from the request's (digest collision or bad entry)")
    return head["logits"]


def iter_layers(store: RemoteStore, ns: Namespace, tokens, body: dict, capacity: int, dtype):
    """Stream the full cache's layers in layer order: yields (i, form) with each layer placed in a full-cache form
    of `capacity` slots, exactly as prefill leaves it. Raises CorruptEntry at the first bad chunk."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    P = len(tokens)
    recs = [body["bundles"][f"layer-{i:03d}"] for i in range(len(body["layers"]))]
    for i, (_, a) in enumerate(store.iter_bundles(ns.hex, prefix_key(ns, tokens), recs)):
        spec = body["layers"][i]
        k, v = a["k"], a["v"]
        if np.dtype(k.dtype) != np.dtype(dtype) or k.shape != v.shape or k.ndim != 3:
            raise CorruptEntry(f"layer {i}: k {k.dtype}{k.shape}, v {v.dtype}{v.shape}, expected {np.dtype(dtype)}")
        seen = jnp.full((1,), P, jnp.int32)
        if spec["kind"] == "swa":
            yield i, WindowKV(k=jnp.asarray(k[None]), v=jnp.asarray(v[None]), seen=seen, window=int(spec["window"]))
            continue
        if k.shape[1] != P:
            raise CorruptEntry(f"layer {i}: {k.shape[1]} rows, prefix has {P}")
        yield i, DenseKV(k=_to_capacity(k, capacity=capacity), v=_to_capacity(v, capacity=capacity), length=seen)


@functools.partial(jax.jit, static_argnames="capacity")
def _to_capacity(rows, *, capacity: int):
    """[K, P, D] prompt rows -> [1, K, capacity, D] with zeros after them (what prefill leaves in the slots)."""
    return jnp.pad(rows, ((0, 0), (0, capacity - rows.shape[1]), (0, 0)))[None]


def read_draft(store: RemoteStore, ns: Namespace, tokens, body: dict) -> DraftCache:
    """Fetch a draft cache's bundle and rebuild the `DraftCache` (empty recent rings)."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    return draft_from_arrays(tokens, body, store.get_bundle(ns.hex, prefix_key(ns, tokens), body["bundle"]))


def draft_from_arrays(tokens, body: dict, a: dict) -> DraftCache:
    """Rebuild a `DraftCache` from its manifest and fetched bundle arrays."""
    layers = []
    for i, spec in enumerate(body["layers"]):
        parts = []
        for j, p in enumerate(spec["parts"]):
            cls = PART_TYPES.get(p["type"])
            if cls is None:
                raise CorruptEntry(f"draft layer {i}: unknown part type {p['type']!r}")
            arrays = {f: jnp.asarray(a[f"L{i}.p{j}.{f}"]) for f in p["fields"]}
            parts.append(cls(**arrays, **p["static"]))
        K, R, D = spec["recent"]
        ring = RecentKV.empty(1, K, R, D, jnp.dtype(spec["dtype"]))
        layers.append(DraftLayer(parts=tuple(parts), recent=ring, window=spec["window"]))
    return DraftCache(layers=tuple(layers), length=jnp.full((1,), len(tokens), jnp.int32))
