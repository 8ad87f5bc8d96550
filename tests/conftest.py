"""Shared pytest set-up: the `gpu` marker skips unless JAX sees a GPU; the builders of `builders.py` as fixtures
(tiny HF models are built once per session)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/builders.py


def pytest_configure(config):
    """A compilation cache on disk for this run (removed at its end), shared by the xdist workers and the
    subprocesses the tests start (the environment variables carry it).

    Modules build the same tiny models and compile the same programs; after `_release_compiled_programs` drops them
    from memory, a later module -- on either worker -- loads an executable from disk instead of compiling it again (a
    cache hit still fills the jitted function's own cache, so the tests that count compiled programs count the same).
    One directory for the whole run: JAX's cache key includes the directory's path (it names XLA's own cache files
    inside it), so per-worker directories never shared an entry. The process that made the directory (the xdist
    controller, or the only process) removes it; a worker finds it in the environment. Two workers writing one key at
    once can at worst leave a torn file, which JAX fails to decompress, warns about and compiles again.
    """
    import shutil
    import tempfile

    if os.environ.get("KVJAX_TEST_COMPILE_CACHE") == "0":
        return
    path = os.environ.get("KVJAX_TEST_COMPILE_CACHE_DIR")
    if path is None:
        path = tempfile.mkdtemp(prefix="kvjax-test-xla-cache-")
        os.environ["KVJAX_TEST_COMPILE_CACHE_DIR"] = path  # inherited by the workers xdist starts after this hook
        config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
    settings = {"JAX_COMPILATION_CACHE_DIR": path, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    os.environ.update(settings)
    import jax

    jax.config.update("jax_compilation_cache_dir", path)  # jax may already have read the environment
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module.

    XLA:CPU maps memory for each executable it loads; a single process that runs the whole suite keeps thousands of
    them (every module builds its own tiny models and shapes) and reached the kernel's limit on memory mappings
    (vm.max_map_count, 65,530 by default): the next compile died with a segmentation fault. A program a later module
    needs again comes back from the run's disk cache (`pytest_configure`), not from a new compile.
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()


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
    from builders import make_hf_model

    made = {}
    root = tmp_path_factory.mktemp("hf_models")

    def get(name):
        if name not in made:
            made[name] = make_hf_model(str(root), name)
        return made[name]

    return get


@pytest.fixture
def compile_count():
    """compile_count(jitted) -> executables it holds."""
    from builders import compile_count as count

    return count


@pytest.fixture
def toy_model():
    """toy_model(config=None, seed=0, scale=0.08) -> a tiny random Llama-family kvjax Model (no files)."""
    from builders import toy_model as make

    return make


@pytest.fixture
def toy_config():
    """toy_config(layer_types, *, window, ...) -> a tiny ModelConfig."""
    from builders import toy_config as make

    return make
