"""Serving a request whose prefix is in a remote store: fetch-full-then-decode, and draft-first VeriCache.

Draft-first (VeriCache, arXiv 2605.17613, remote prefix caching): fetch the small draft cache and the stored
last-position logits; emit the first token from those logits (exact: they are the prefill's own logits, checksummed);
start drafting at once while a background thread streams the full cache from the store layer by layer, in layer
order, in chunks paced by the link. While the full cache is incomplete the drafter runs ahead (up to `max_ahead`
tokens, whole draft rounds of `x`); nothing it drafts is emitted. The first verification waits for the WHOLE full
cache: verifying layer by layer as layers land would change the compiled verify computation and with it the bit
identity to the reference decoder (same reason as `kvjax.decode.offload`). Verification then walks the run-ahead drafts
in blocks of x (accepting a block, then its bonus token if it equals the next draft), and falls back to ordinary
VeriCache rounds at the first mismatch. Every emitted token after the first is a full-cache verify output, so the
greedy output equals `vericache.reference_decode` token for token.

Fetch-full-then-decode: fetch the logits and every layer of the full cache, then decode (plain one-token greedy —
the fastest full-cache decoder —, the verify-shape reference decoder, or VeriCache over the fetched cache). Its first
token is emitted once the full cache is in place (that is what the contender is); `head_s` in its stats says when
the stored logits alone had arrived, for a reader who wants to credit it with streaming the logits first.

Misses and corruption: a missing or mismatching full manifest is a miss (the caller prefills); a bad draft entry
falls back to fetch-full; a corrupt full-cache chunk met by the background fetch is never used: the full cache is
recomputed by prefill, and the drafted tokens are still verified against it.
"""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.errors import CorruptEntry
from kvjax.decode import draft as draft_mod
from kvjax.decode import steps
from kvjax.decode import verify as verify_mod
from kvjax.decode.draft_weights import draft_params
from kvjax.decode.reference import reference_step
from kvjax.decode import vericache as vc
from kvjax.remote import prefix_entry as pe
from kvjax.remote.store_client import RemoteStore


# ---------------------------------------------------------------------------------------------------- storing
def store_prefix(model, store: RemoteStore, prompt_ids, *, drafts=(("streaming", {}),), recent_slots: int = 256,
                 max_new_tokens: int = 256, max_draft: int = 8, namespace=None) -> dict:
    """Prefill a prefix and write its full cache, last logits and one draft cache per (compressor, settings).

    The prefill runs at the capacity `vericache.prefill_for` would use for (max_new_tokens, max_draft): XLA's
    attention over a different capacity bucket may differ in the last bits, so requests of that size (and every
    request of the same capacity bucket) get output equal to `vericache.reference_decode` bit for bit; any request
    gets output equal to `reference_from_store` (full-cache reference decoding from the stored cache), which is the
    exactness reference of remote serving. The capacity is recorded in the manifest.

    Args:
        prompt_ids: i32[P] the prefix.
        drafts: (compressor name or draft maker, settings dict) pairs; each draft's identity includes them.
        recent_slots: draft ring slots for decoded tokens (part of the draft identity; bounds the run-ahead).

    Returns:
        {"prefix": key, "drafts": [draft names], "full_bytes": ..., "draft_bytes": {name: bytes}}.
    """
    ns = namespace or pe.prefix_namespace(model)
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    capacity = vc.capacity_for(prompt.size, max_new_tokens, max_draft)
    full = model.family.init_cache(model.config, 1, capacity, model.cache_dtype)
    logits, full = steps.prefill(model, full, prompt)
    # leaves are stored cut to the prompt's extent (what a cache of capacity P holds), padded back when served
    at_prompt = jax.eval_shape(lambda: model.family.init_cache(model.config, 1, prompt.size, model.cache_dtype))
    body = pe.store_full(store, ns, prompt, logits, full, trim_to=at_prompt)
    out = {"prefix": pe.prefix_key(ns, prompt), "drafts": [], "draft_bytes": {},
           "full_bytes": sum(r["nbytes"] for k, r in body["bundles"].items() if k != "head")}
    for comp, kw in drafts:
        c = model.family.make_compressor(comp, model=model, **kw)
        dcache = c(model.params, model.config, full, prompt, recent_slots=recent_slots)
        ident = pe.draft_identity(c, recent_slots)
        d = pe.store_draft(store, ns, prompt, dcache, ident)
        name = pe.draft_name(ident)
        out["drafts"].append(name)
        out["draft_bytes"][name] = d["bundle"]["nbytes"]
    return out


# ---------------------------------------------------------------------------------------------------- helpers
def _first(logits) -> jax.Array:
    return jnp.argmax(jnp.asarray(logits)).astype(jnp.int32)[None]


def _find_full(model, store, ns, prompt, reasons):
    """The full manifest of this namespace + prefix, or None with the reason appended."""
    try:
        body = store.get_manifest(ns.hex, pe.prefix_key(ns, prompt), pe.FULL)
        if body is None:
            reasons.append("miss: no full entry for this namespace + prefix")
            return None
        pe.check_full_manifest(body, model.config, prompt)
        return body
    except CorruptEntry as e:
        reasons.append(f"corrupt full manifest: {e}")
        return None


def _template(model, capacity: int):
    """The abstract full cache the stored layers are placed into (the family's, at the serving capacity)."""
    return jax.eval_shape(lambda: model.family.init_cache(model.config, 1, capacity, model.cache_dtype))


def _fetch_full_layers(model, store, ns, prompt, body, capacity):
    template = _template(model, capacity)
    layers = [form for _, form in pe.iter_layers(store, ns, prompt, body, template)]
    return pe.assemble_full(template, layers, body)


def _decode_full(model, full, first, M, decoder: str, x: int, prompt):
    """Decode M tokens (first included) from a full cache holding the prompt."""
    out = [int(first[0])]
    if M == 1:
        return np.asarray(out, np.int32), {}
    if decoder == "plain":
        rest, _ = steps.decode(model.loop_params(), model.config, full, first, jnp.zeros((1,), jnp.int32), num_steps=M - 1,
                               family=model.family, impl=model.attention)
        return np.asarray(out + [int(t) for t in np.asarray(rest[0])], np.int32), {}
    if decoder == "reference":
        tok, seed = first, jnp.zeros((1,), jnp.int32)
        vparams = model.verify_params()
        for _ in range(M - 1):
            tok, _, full, _ = reference_step(vparams, model.config, full, tok, seed, x=x, family=model.family,
                                             impl=model.attention)
            out.append(int(tok[0]))
        return np.asarray(out, np.int32), {}
    if decoder.startswith("vericache"):
        comp = decoder.split(":", 1)[1] if ":" in decoder else "streaming"
        toks, st = vc.run_vericache(model, full, first, prompt, M, compressor=comp, draft_len=x)
        return toks, {"vericache": st}
    raise ValueError(f"unknown decoder {decoder!r}: expected plain, reference or vericache[:compressor]")


def reference_from_store(model, store: RemoteStore, prompt_ids, max_new_tokens: int, *, draft_len: int = 8,
                         namespace=None):
    """The exactness reference of remote serving: verify-shape full-cache decoding from the STORED full cache.

    Returns tokens i32[M], or None on a miss.
    """
    toks, st = serve_full_fetch(model, store, prompt_ids, max_new_tokens, draft_len=draft_len, decoder="reference",
                                namespace=namespace, fallback=False)
    return toks


def recompute(model, prompt, M, *, draft_len: int = 8, decoder: str = "reference"):
    """The miss path: prefill locally, then decode. Returns (tokens, stats)."""
    t0 = time.perf_counter()
    full, first = vc.prefill_for(model, prompt, M, max_draft=draft_len)
    first.block_until_ready()
    ttft = time.perf_counter() - t0
    toks, extra = _decode_full(model, full, first, M, decoder, draft_len, prompt)
    total = time.perf_counter() - t0
    return toks, dict(source="recompute", ttft_s=ttft, total_s=total, tokens_per_s=M / total, **extra)


# ---------------------------------------------------------------------------------------------------- full fetch
def serve_full_fetch(model, store: RemoteStore, prompt_ids, max_new_tokens: int, *, draft_len: int = 8,
                     decoder: str = "plain", namespace=None, fallback: bool = True):
    """Fetch-full-then-decode. Returns (tokens i32[M], stats) — stats["source"] is "full-fetch" or "recompute".

    Args:
        decoder: "plain" (one-token greedy), "reference" (verify-shape, bit-exact) or "vericache[:compressor]".
        fallback: on a miss or a corrupt entry, recompute (else return (None, stats)).
    """
    t0 = time.perf_counter()
    M, x = max_new_tokens, draft_len
    ns = namespace or pe.prefix_namespace(model)
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    reasons: list[str] = []
    body = _find_full(model, store, ns, prompt, reasons)
    if body is not None:
        try:
            logits = pe.read_head(store, ns, prompt, body)
            head_s = time.perf_counter() - t0
            full = _fetch_full_layers(model, store, ns, prompt, body, vc.capacity_for(prompt.size, M, x))
            jax.block_until_ready(full)
            fetched_s = time.perf_counter() - t0
            first = _first(logits)
            first.block_until_ready()
            ttft = time.perf_counter() - t0
            toks, extra = _decode_full(model, full, first, M, decoder, x, prompt)
            total = time.perf_counter() - t0
            return toks, dict(source="full-fetch", ttft_s=ttft, head_s=head_s, full_arrival_s=fetched_s,
                              total_s=total, tokens_per_s=M / total, decode_s=total - ttft, reasons=reasons,
                              **extra)
        except CorruptEntry as e:
            reasons.append(f"corrupt full entry: {e}")
    if not fallback:
        return None, dict(source="miss", reasons=reasons)
    toks, st = recompute(model, prompt, M, draft_len=x)
    st["reasons"] = reasons
    return toks, st


# ---------------------------------------------------------------------------------------------------- draft first
class _FullStream:
    """Background fetch of the full cache, layer by layer in layer order; `wait()` returns it or raises."""

    def __init__(self, model, store, ns, prompt, body, capacity):
        self.layers = [None] * len(body["layers"])
        self.arrival_s: list[float] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._args = (model, store, ns, prompt, body, capacity)
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="kvjax-full-fetch", daemon=True)
        self.thread.start()

    def _run(self):
        model, store, ns, prompt, body, capacity = self._args
        try:
            for i, form in pe.iter_layers(store, ns, prompt, body, _template(model, capacity)):
                self.layers[i] = jax.block_until_ready(form)
                self.arrival_s.append(time.perf_counter() - self.t0)
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            self.error = e
        finally:
            self.done.set()

    def wait(self):
        """The full cache (the family's), once every layer has arrived."""
        self.done.wait()
        self.thread.join()
        if self.error is not None:
            raise self.error
        model, _, _, _, body, capacity = self._args
        return pe.assemble_full(_template(model, capacity), self.layers, body)


def serve_draft_first(model, store: RemoteStore, prompt_ids, max_new_tokens: int, *,
                      compressor="streaming", compressor_kw: dict | None = None,
                      recent_slots: int = 256, draft_len: int = 8, max_ahead: int | None = None, namespace=None,
                      fallback_decoder: str = "reference"):
    """Draft-first VeriCache serving of a stored prefix (greedy). Returns (tokens i32[M], stats).

    Args:
        compressor, compressor_kw, recent_slots: the draft cache wanted (its identity; must match a stored one).
        draft_len: x, drafts per verification (static; the reference decoder's verify shape).
        max_ahead: most tokens drafted before the full cache has arrived (whole rounds of x; bounded by the ring).
            Default one round (x): a queued round is only used if every draft before it was accepted, which is
            rare at realistic acceptance, and on a shared CPU drafting further ahead slows the fetch it waits for.
        fallback_decoder: decoder of the fetch-full fallback taken when the draft entry is missing or corrupt.

    Returns:
        tokens and stats: source ("draft-first" / fallback's), ttft_s, full_arrival_s, total_s, tokens_per_s,
        drafted_ahead, accepted_ahead, verifications, mean_accepted_per_round, layer_arrival_s, reasons.
    """
    t0 = time.perf_counter()
    config = model.config
    vparams = model.verify_params()  # the layout verification reads, not `model.params`
    M, x = max_new_tokens, draft_len
    vc.check_draft_len(model, x)
    ns = namespace or pe.prefix_namespace(model)
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    P = prompt.size
    comp = model.family.make_compressor(compressor, model=model, **(compressor_kw or {}))
    dparams = draft_params(model, comp.draft_weights)  # checks it
    ident = pe.draft_identity(comp, recent_slots)
    reasons: list[str] = []
    body = _find_full(model, store, ns, prompt, reasons)
    dbody, dcache, logits, stream = None, None, None, None
    if body is not None:
        try:
            dbody = store.get_manifest(ns.hex, pe.prefix_key(ns, prompt), pe.draft_name(ident))
            if dbody is None:
                reasons.append(f"draft miss: no {comp.name} draft with these settings")
            elif dbody.get("identity") != ident:
                reasons.append("draft miss: stored identity differs")
                dbody = None
            else:
                logits = pe.read_head(store, ns, prompt, body)
                draft_arrays = store.get_bundle(ns.hex, pe.prefix_key(ns, prompt), dbody["bundle"])
                stream = _FullStream(model, store, ns, prompt, body, vc.capacity_for(P, M, x))  # link free now
                dcache = pe.draft_from_arrays(prompt, dbody, draft_arrays)
        except CorruptEntry as e:
            reasons.append(f"corrupt draft/head entry: {e}")
            dcache = None
    if dcache is None:
        if stream is not None:
            stream.done.wait()
        toks, st = serve_full_fetch(model, store, prompt, M, draft_len=x, decoder=fallback_decoder, namespace=ns)
        st["reasons"] = reasons + st.get("reasons", [])
        return toks, st

    first = _first(logits)
    first.block_until_ready()
    ttft = time.perf_counter() - t0
    seed = jnp.zeros((1,), jnp.int32)
    room = dcache.room()  # tokens the draft can take before its ring wraps (or its capacity ends)
    ahead_cap = max(0, min(x if max_ahead is None else max_ahead, room - x - 1) // x * x)

    # run ahead while the full cache streams in
    queue: list[int] = []
    last = first
    t_ahead = time.perf_counter()
    while len(queue) + x <= ahead_cap and len(queue) < M - 1 and not stream.done.is_set():
        drafts, _, dcache = draft_mod.draft_step(dparams, config, dcache, last, seed, x=x, family=model.family,
                                                 impl=model.attention)
        d = np.asarray(drafts[0])
        queue.extend(int(t) for t in d)
        last = drafts[:, -1]
    ahead_s = time.perf_counter() - t_ahead
    drafted_ahead = len(queue)
    try:
        full = stream.wait()
        full_src = "store"
    except Exception as e:  # noqa: BLE001 - corrupt or unreadable: a recompute is always correct
        reasons.append(f"full entry failed during streaming ({type(e).__name__}: {e}); recomputed by prefill")
        full, _ = vc.prefill_for(model, prompt, M, max_draft=x)
        full_src = "recompute"
    jax.block_until_ready(full)
    full_arrival = time.perf_counter() - t0

    out = [int(first[0])]
    last = first
    rounds: list[int] = []
    accepted_ahead = 0
    while len(out) < M:
        from_queue = len(queue) >= x
        if from_queue:
            drafts = jnp.asarray(np.asarray(queue[:x], np.int32)[None])
        else:
            queue = []
            drafts, _, dcache = draft_mod.draft_step(dparams, config, dcache, last, seed, x=x, family=model.family,
                                                     impl=model.attention)
        emitted, n, full, dcache, _, _ = verify_mod.verify_step(
            vparams, config, full, dcache, last, drafts, jnp.zeros((1, 1, config.vocab_size), jnp.float32), seed,
            family=model.family, impl=model.attention)
        n = int(np.asarray(n)[0])
        emitted_host = np.asarray(emitted)  # sliced on the host: a device slice compiles per length
        new = [int(t) for t in emitted_host[0, :n + 1]]
        out.extend(new)
        rounds.append(n)
        last = jnp.asarray(emitted_host[:, n])
        if from_queue:
            accepted_ahead += n + (1 if n == x and len(queue) > x and queue[x] == new[-1] else 0)
            queue = queue[x + 1:] if n == x and len(queue) > x and queue[x] == new[-1] else []
    total = time.perf_counter() - t0
    toks = np.asarray(out[:M], np.int32)
    return toks, dict(source="draft-first", full_source=full_src, ttft_s=ttft, full_arrival_s=full_arrival,
                      layer_arrival_s=stream.arrival_s, total_s=total, tokens_per_s=M / total,
                      decode_s=total - ttft, ahead_s=ahead_s, drafted_ahead=drafted_ahead,
                      accepted_ahead=accepted_ahead, verifications=len(rounds),
                      mean_accepted_per_round=float(np.mean(rounds)) if rounds else 0.0,
                      draft_bytes=dbody["bundle"]["nbytes"], reasons=reasons)
