"""The resumable training state: params, optimizer state, data position, step, phase and RNG in one Orbax
checkpoint, replaced atomically on every save.

`save_state(folder, state)` writes `<folder>/train_state` (Orbax; a JSON copy of the scalars sits next to the
arrays as `progress.json`) through a temporary folder and a rename, so a run killed mid-save leaves the previous
state intact. `restore_state(folder, like)` reads it back into the structure of `like` (the freshly initialised
state of the same config), which is how the optimizer's named tuples come back as they were.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
import numpy as np

STATE_DIR = "train_state"
_SCALARS = ("step", "phase", "cursor", "seed", "tokens")


def _abs(path: str) -> str:
    return os.path.abspath(os.fspath(path))


def state_dir(folder: str) -> str:
    return os.path.join(folder, STATE_DIR)


def has_state(folder: str) -> bool:
    return os.path.isdir(os.path.join(state_dir(folder), "arrays"))


def save_state(folder: str, state: dict[str, Any]) -> None:
    """Write `state` (params, opt_state, rng, and the `_SCALARS` ints) as the folder's only training state."""
    import orbax.checkpoint as ocp

    missing = [k for k in ("params", "opt_state", "rng", *_SCALARS) if k not in state]
    if missing:
        raise ValueError(f"training state lacks {missing}")
    final, tmp, old = state_dir(folder), state_dir(folder) + ".tmp", state_dir(folder) + ".old"
    for d in (tmp, old):
        if os.path.exists(d):
            shutil.rmtree(d)
    os.makedirs(tmp)
    tree = {k: v for k, v in state.items() if k in ("params", "opt_state", "rng")}
    tree.update({k: np.asarray(int(state[k]), np.int64) for k in _SCALARS})
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(_abs(os.path.join(tmp, "arrays")), tree)
    ckpt.wait_until_finished()
    marker = os.path.join(tmp, "arrays", "commit_success.txt")  # names this machine's path; restore needs none
    if os.path.exists(marker):
        os.remove(marker)
    with open(os.path.join(tmp, "progress.json"), "w") as f:
        json.dump({k: int(state[k]) for k in _SCALARS}, f, indent=1)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    if os.path.exists(old):
        shutil.rmtree(old)


def restore_state(folder: str, like: dict[str, Any]) -> dict[str, Any]:
    """The training state saved in `folder`, in the structure and dtypes of `like` (same keys as `save_state`)."""
    import orbax.checkpoint as ocp

    path = os.path.join(state_dir(folder), "arrays")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no training state to resume in {folder} (expected {STATE_DIR}/arrays)")
    target = {k: like[k] for k in ("params", "opt_state", "rng")}
    target.update({k: np.asarray(0, np.int64) for k in _SCALARS})
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
    tree = ocp.StandardCheckpointer().restore(_abs(path), abstract)
    out = {k: tree[k] for k in ("params", "opt_state", "rng")}
    out.update({k: int(tree[k]) for k in _SCALARS})
    return out


def state_bytes(folder: str) -> int:
    """Bytes on disk of the folder's training state."""
    total = 0
    for dirpath, _, files in os.walk(state_dir(folder)):
        total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    return total
