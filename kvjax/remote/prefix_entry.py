"""What a stored prefix is: its identity, and the bundles that hold its full cache, last logits and draft caches.

Identity. The namespace is the prefix cache's (`kvjax.prefix.identity.make_namespace`: weights content fingerprint
that follows in-place leaf updates, tokenizer/template content hashes, adapters as (content fingerprint, scale),
every config field that changes keys/values, kv dtype, the runtime — kernel ABI, attention implementation, mesh,
device kind, jax/jaxlib — and the tenant salt) with this package's full-cache format as its representation; the
prefix key is BLAKE2b(namespace, prompt token ids), and the stored token ids are re-compared on every hit (a digest
is an address, not a proof). A draft cache is a second, lossy representation of the same prefix: its key adds the
compressor's name and EVERY field of its settings (ratio, sinks, window, bits, ...), the recent-ring size and the
draft format version, so a StreamingLLM 4x draft is never served for a SnapKV or 8x one.

Layout under `<namespace>/<prefix>/` (any model family: `kvjax.remote.cache_codec` names leaves by tree path):
  - `full/`: bundles `head` (logits f32[V] at the last prompt position, tokens i32[P]) and `layer-000`, ... one per
    layer in layer order (every leaf of the family's layer state, trimmed to the prompt's extent: Llama's prompt
    rows k, v and sliding rings; DeepSeek-V4's rings, tails, compressed entries, indexer keys), then the manifest,
    which holds each leaf's encoding and, inline, the cache's non-layer leaves (its token count);
  - `draft-<key>/`: one bundle with every leaf of the draft cache, then the manifest, which holds its structure.

The first token. Both serving paths need the logits at the last prompt position; they are stored with the prefix
(`head`), checksummed like everything else, so the first token is exact without the full cache or a recompute.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from kvjax.prefix import model_identity
from kvjax.prefix.identity import Namespace, canonical, digest, make_namespace, weights_fingerprint
from kvjax.errors import CorruptEntry
from kvjax.remote import cache_codec as codec
from kvjax.remote.store_client import RemoteStore

FULL_FORMAT = "kvjax-remote-full-v2"  # per-layer bundles of the family's leaves by tree path (cache_codec), batch 1
DRAFT_FORMAT = "kvjax-remote-draft-v2"
FULL = "full"
PREFIX_DOMAIN = b"kvjax.rprefix1"
DRAFT_DOMAIN = b"kvjax.rdraft1"


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
    # every setting that shapes the draft's keys and values; not the weights drafting reads (`draft_weights`)
    settings = {f.name: getattr(compressor, f.name) for f in dataclasses.fields(compressor)
                if f.name != "draft_weights"}
    return {"format": DRAFT_FORMAT, "compressor": compressor.name, "settings": canonical(settings),
            "recent_slots": int(recent_slots)}


def draft_name(identity: dict) -> str:
    body = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return "draft-" + digest(DRAFT_DOMAIN, body).hex()[:32]


# ---------------------------------------------------------------------------------------------------- write
def store_full(store: RemoteStore, ns: Namespace, tokens, logits, full, *, trim_to=None) -> dict:
    """Write the prefix's full cache (batch 1, length P) and its last logits; publish the manifest last.

    Args:
        tokens: i32[P] the prefix; logits: f32[V] at position P-1; full: the prefilled cache (any family).
        trim_to: abstract cache to cut leaves to where the rest is untouched (`cache_codec.full_bundles`).

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
    head, layers = codec.head_specs(full), []
    for i, (specs, arrays) in enumerate(codec.layer_bundles(full, trim_to)):
        layers.append(specs)
        recs[f"layer-{i:03d}"] = store.put_bundle(ns.hex, pk, f"{FULL}-layer-{i:03d}", arrays)
    body = {"format": FULL_FORMAT, "prompt_len": P, "head": head, "layers": layers, "bundles": recs,
            "namespace": json.loads(ns.to_json())}
    store.put_manifest(ns.hex, pk, FULL, body)
    return body


def store_draft(store: RemoteStore, ns: Namespace, tokens, dcache, identity: dict) -> dict:
    """Write one draft cache (as built right after prefill) under its identity: its leaves and its structure."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    desc, arrays = codec.encode_draft(dcache)
    name = draft_name(identity)
    pk = prefix_key(ns, tokens)
    rec = store.put_bundle(ns.hex, pk, name, arrays)
    body = {"identity": identity, "prompt_len": int(tokens.size), "draft": desc, "bundle": rec}
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


def iter_layers(store: RemoteStore, ns: Namespace, tokens, body: dict, template):
    """Stream the full cache's layers in layer order: yields (i, layer state) with each layer placed in the shapes of
    `template` (the abstract `init_cache` of the serving capacity), exactly as prefill leaves it. Raises CorruptEntry
    at the first bad chunk or leaf."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    if len(template.layers) != len(body["layers"]):
        raise CorruptEntry(f"full entry has {len(body['layers'])} layers, the model {len(template.layers)}")
    recs = [body["bundles"][f"layer-{i:03d}"] for i in range(len(body["layers"]))]
    for i, (_, a) in enumerate(store.iter_bundles(ns.hex, prefix_key(ns, tokens), recs)):
        yield i, codec.decode_layer(template.layers[i], body["layers"][i], a)


def assemble_full(template, layers, body: dict):
    """The full cache from the streamed layers and the manifest's non-layer leaves (its token count)."""
    return codec.assemble_full(template, layers, body["head"])


def read_draft(store: RemoteStore, ns: Namespace, tokens, body: dict):
    """Fetch a draft cache's bundle and rebuild the family's draft cache."""
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    return draft_from_arrays(tokens, body, store.get_bundle(ns.hex, prefix_key(ns, tokens), body["bundle"]))


def draft_from_arrays(tokens, body: dict, a: dict):
    """Rebuild a draft cache from its manifest and fetched bundle arrays."""
    del tokens
    return codec.decode_draft(body["draft"], a)
