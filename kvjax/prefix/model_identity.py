"""The parts of a cache namespace read off a live model and process, besides the weights fingerprint.

- Tokenizer and chat-template revisions: content hashes of what the model's tokenizer read (tokenizer.json bytes and
  tokenizer_config.json; the chat template source), so a re-trained tokenizer or an edited template under the same
  path is another namespace and the same files anywhere are the same one.
- Adapters: a list of (content fingerprint of the adapter's weights, scale), in the order they are applied. An
  adapter is given as its weights, never as a name: a name says nothing about the bytes.
- The runtime: kernel ABI, the attention implementation the default dispatch picks, the mesh the params are
  partitioned over, device kind and platform, jax and jaxlib versions. Two hosts that differ in any of these do not
  compute bit-identical keys and values, so a store they share must never hand one's entries to the other.
"""

from __future__ import annotations

import json
import weakref
from typing import Any, Sequence

import jax
import numpy as np

from kvjax.errors import InputError
from kvjax.prefix.identity import canonical, digest, weights_fingerprint
from kvjax.prefix.runtime_identity import mesh_descriptor, runtime_fields  # noqa: F401 - re-exported

# tokenizer object -> (the bytes object, template object and config JSON it was hashed from, the revisions). Hashing
# a large tokenizer.json costs milliseconds; an attribute replaced by a new object (or a config edited in place) is
# seen by the identity/equality checks, and the weak key keeps no tokenizer alive.
_TOKENIZER_REVS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def tokenizer_revisions(tokenizer) -> tuple[str, str]:
    """(tokenizer_rev, template_rev) of a `kvjax.tokenizer.Tokenizer`; ("", "") when the model has no tokenizer.

    tokenizer_rev hashes tokenizer.json's bytes and tokenizer_config.json without its chat template (special tokens,
    flags); template_rev hashes the chat template's source ("" when there is none).

    Raises:
        InputError: for a tokenizer object whose files kvjax cannot read.
    """
    if tokenizer is None:
        return "", ""
    raw = getattr(tokenizer, "_raw_json", None)  # the exact tokenizer.json bytes `Tokenizer.from_dir` read
    if raw is None:
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            raise InputError(f"cannot fingerprint a tokenizer of type {type(tokenizer).__name__}: expected a "
                             "kvjax.tokenizer.Tokenizer")
        raw = backend.to_str().encode()
    template = getattr(tokenizer, "chat_template", None)
    config = {k: v for k, v in (getattr(tokenizer, "config", None) or {}).items() if k != "chat_template"}
    config_json = json.dumps(canonical(config), sort_keys=True)
    try:
        hit = _TOKENIZER_REVS.get(tokenizer)
    except TypeError:  # not weak-referenceable: hash every time
        hit = None
    if hit is not None and hit[0] is raw and hit[1] is template and hit[2] == config_json:
        return hit[3]
    revs = (digest(b"kvjax.tokenizer1", bytes(raw), config_json.encode()).hex(),
            "" if template is None else digest(b"kvjax.template1", template.encode()).hex())
    try:
        _TOKENIZER_REVS[tokenizer] = (raw, template, config_json, revs)
    except TypeError:
        pass
    return revs


def adapter_fields(adapters: Sequence[tuple[Any, float]]) -> list[tuple[str, float]]:
    """(content fingerprint, scale) of each adapter, in order.

    Args:
        adapters: (adapter weights as a pytree of arrays, scale) per adapter, in the order they are applied.

    Raises:
        InputError: an adapter given as anything but arrays (e.g. a name), or a scale that is not a number.
    """
    out = []
    for i, item in enumerate(adapters):
        try:
            tree, scale = item
        except (TypeError, ValueError):
            raise InputError(f"adapters[{i}] must be (adapter weights, scale), got {item!r}") from None
        leaves = jax.tree.leaves(tree)
        if not leaves or not all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves):
            raise InputError(f"adapters[{i}]: an adapter is given as its weights (a pytree of arrays), got "
                             f"{type(tree).__name__} {tree!r:.40}: a name is not an identity")
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise InputError(f"adapters[{i}]: scale must be a number, got {scale!r}")
        out.append((weights_fingerprint(tree), float(scale)))
    return out
