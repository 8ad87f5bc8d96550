"""Builders shared by the prefix-cache reliability tests: a toy model, cold runs, caches, pin counts, store files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvjax.api import logits as full_logits
from builders import toy_config, toy_model
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.families import forms_for
from kvjax.prefix.manager import PrefixCache
from kvjax.prefix.prefill import prefill_with_prefix_cache

P, CHUNK, CAP = 16, 32, 256


@pytest.fixture
def model():
    """A fresh toy model (full + sliding + full layers) per test: tests may update its weights in place."""
    return toy_model(toy_config((FULL, SLIDING, FULL), window=20))


@pytest.fixture
def make_cache():
    """factory(model, **PrefixCache kwargs) -> PrefixCache with block size P and 1 MiB device/host by default."""

    def make(model, **kw):
        kw.setdefault("device_bytes", 1 << 20)
        kw.setdefault("host_bytes", 1 << 20)
        return PrefixCache(forms_for(model.config, np.float32, P), **kw)

    return make


@pytest.fixture
def run():
    """run(model, pc, prompt, **kw) -> (last-position logits, executed plan) through the prefix cache."""

    def go(model, pc, prompt, **kw):
        logits, _, plan = prefill_with_prefix_cache(model, np.asarray(prompt, np.int32), pc, capacity=CAP,
                                                    chunk=CHUNK, **kw)
        return np.asarray(logits), plan

    return go


@pytest.fixture
def cold():
    """cold(model, prompt) -> last-position logits of a full forward pass with no cache at all."""

    def go(model, prompt):
        return full_logits(model, np.asarray(prompt, np.int32))[-1]

    return go


@pytest.fixture
def stored(model, make_cache, run, prompt, tmp_path):
    """(url, p, reopen): a 100-token prompt `p` prefilled through a store-only cache and flushed to the file store at
    `url`; `reopen()` -> a new store-only cache over the same store (what a restarted server sees)."""
    url = str(tmp_path / "store")
    p = prompt(100)

    def reopen():
        return make_cache(model, device_bytes=0, host_bytes=0, store_url=url)

    pc = reopen()
    run(model, pc, p)
    pc.flush()
    return url, p, reopen


@pytest.fixture
def pins():
    """pins(pc) -> total pin count over every entry the cache knows (0 when no plan is alive)."""

    return lambda pc: pc.pinned()


@pytest.fixture
def store_files():
    """store_files(root, form=None) -> sorted paths of the entry files under a file:// store directory."""

    def files(root, form=None):
        out = []
        for ns in sorted(os.listdir(root)):
            d = os.path.join(root, ns)
            if not os.path.isdir(d):
                continue
            for f in sorted(os.listdir(d)):
                if f == "blocks" or (form is not None and f != form) or not os.path.isdir(os.path.join(d, f)):
                    continue
                out += [os.path.join(d, f, k) for k in sorted(os.listdir(os.path.join(d, f)))
                        if not k.endswith(".__lock")]
        return out

    return files


def prompt_of(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 97, n).astype(np.int32)


@pytest.fixture
def prompt():
    """prompt(n, seed=0) -> i32[n] random token ids below the toy vocabulary."""
    return prompt_of
