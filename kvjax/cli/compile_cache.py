"""JAX's persistent compilation cache for the `kvjax` command: a VeriCache run compiles a draft and a verify program
per draft length it may pick (minutes on a CPU for a 30-layer model), and every later run with the same shapes loads
them from disk instead. Programs are keyed by their full HLO, compile options and JAX/XLA versions, so a cached
program is the program a fresh compile would produce: outputs stay bit for bit the same.

The cache lives in `$KVJAX_CACHE_DIR/xla` (default ~/.cache/kvjax/xla), capped at `MAX_BYTES` (least recently used
programs go first); `KVJAX_COMPILE_CACHE=0` turns it off, and a cache the user already configured for JAX
(`JAX_COMPILATION_CACHE_DIR`) is left as it is. Only the command enables it: a library import never changes the
caller's JAX configuration.
"""

from __future__ import annotations

import os

ENV = "KVJAX_COMPILE_CACHE"
MAX_BYTES = 4 << 30
MIN_COMPILE_S = 1.0  # programs that compile faster than this are not worth a disk entry


def cache_path() -> str:
    from kvjax.data.corpus import cache_dir  # noqa: PLC0415 - one definition of the per-user cache

    return os.path.join(cache_dir(), "xla")


def enable() -> str | None:
    """Point JAX's persistent compilation cache at `cache_path()`; returns the directory in use (the user's own when
    one is configured already), or None when turned off."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    import jax  # noqa: PLC0415

    configured = jax.config.jax_compilation_cache_dir or os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if configured:
        return configured
    path = cache_path()
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_S)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
