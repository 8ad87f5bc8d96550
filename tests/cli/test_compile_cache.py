"""The `kvjax` command keeps compiled programs in JAX's persistent cache under $KVJAX_CACHE_DIR/xla (a second run
of the same shapes loads them), respects a cache the user configured, and can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys

from builders import REPO

PROBE = """
import sys, jax, jax.numpy as jnp
from kvjax.cli import compile_cache
compile_cache.MIN_COMPILE_S = 0.0  # keep even this small program
print(compile_cache.enable())
if sys.argv[1:] == ["compile"]:
    jax.jit(lambda x: jnp.tanh(x @ x.T)).lower(jnp.ones((8, 8))).compile()
"""


def _run(tmp_path, *args, **env):
    env = {k: v for k, v in dict(os.environ, KVJAX_CACHE_DIR=str(tmp_path), **env).items()
           if k != "JAX_COMPILATION_CACHE_DIR" or "JAX_COMPILATION_CACHE_DIR" in env}
    out = subprocess.run([sys.executable, "-c", PROBE, *args], env=dict(env, PYTHONPATH=REPO), cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_programs_land_in_the_per_user_cache(tmp_path):
    path = _run(tmp_path, "compile")
    assert path == os.path.join(str(tmp_path), "xla")
    assert any(name.startswith("jit_") for name in os.listdir(path)), os.listdir(path)


def test_turned_off_or_users_own_cache_left_alone(tmp_path):
    assert _run(tmp_path, KVJAX_COMPILE_CACHE="0") == "None"
    assert not os.path.exists(tmp_path / "xla")
    own = str(tmp_path / "mine")
    assert _run(tmp_path, JAX_COMPILATION_CACHE_DIR=own) == own
    assert not os.path.exists(tmp_path / "xla")


def test_the_command_enables_it(monkeypatch):
    from kvjax import cli

    called = []
    monkeypatch.setattr("kvjax.cli.compile_cache.enable", lambda: called.append(1))
    assert cli.main(["models", "--json", "-"]) == 0
    assert called == [1]
