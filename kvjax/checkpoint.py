"""Checkpoint files, one module for all of them: Hugging Face safetensors in, Orbax params out and back.

Family-specific name/shape mapping lives with each family (`kvjax/models/<family>/weights.py`); this module only
reads and writes files.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from kvjax.errors import WeightsError


def _load_file(file: str) -> dict[str, np.ndarray]:
    """One safetensors file, or WeightsError naming it (truncated, corrupt, not safetensors, unreadable)."""
    from safetensors.numpy import load_file

    try:
        return load_file(file)
    except FileNotFoundError:
        raise WeightsError(f"{file}: file not found") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises several types; the user needs the file and the cause
        raise WeightsError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of `model.safetensors` or a sharded `model.safetensors.index.json` in a directory, as NumPy.

    Raises:
        WeightsError: naming the file that is missing, truncated or not safetensors.
    """
    path = os.fspath(path)
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
        out: dict[str, np.ndarray] = {}
        for s in shards:
            out.update(_load_file(os.path.join(path, s)))
        return out
    if os.path.exists(single):
        return _load_file(single)
    raise WeightsError(f"no model.safetensors or model.safetensors.index.json in {path}")


def save_orbax(path: str | os.PathLike, params: Any) -> None:
    """Save a params pytree with Orbax (`StandardCheckpointer`); `path` must not exist yet."""
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(os.path.abspath(os.fspath(path)), params)
    ckpt.wait_until_finished()


def restore_orbax(path: str | os.PathLike, like: Any) -> Any:
    """Restore params saved by `save_orbax` into the structure/dtypes of `like` (concrete or abstract pytree)."""
    import orbax.checkpoint as ocp

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), like)
    return ocp.StandardCheckpointer().restore(os.path.abspath(os.fspath(path)), abstract)
