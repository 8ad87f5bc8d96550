"""Shared pytest set-up: the `gpu` marker skips unless JAX sees a GPU; tiny HF models are built once per session."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/hf_models.py and friends


def pytest_collection_modifyitems(config, items):
    import jax

    has_gpu = any(d.platform == "gpu" for d in jax.devices())
    skip = pytest.mark.skip(reason="needs a GPU visible to JAX")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """factory(name) -> (transformers model, saved directory), cached per session."""
    from hf_models import make_hf_model

    made = {}
    root = tmp_path_factory.mktemp("hf_models")

    def get(name):
        if name not in made:
            made[name] = make_hf_model(str(root), name)
        return made[name]

    return get


def compile_count(jitted) -> int:
    """How many executables a jitted function holds (STYLE.md habit 6)."""
    return jitted._cache_size()
