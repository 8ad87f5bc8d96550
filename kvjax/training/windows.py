"""Training windows drawn from a token stream without repeats within an epoch, addressable by a cursor.

Phase `p` of a run cuts the stream into windows of `context + 1` tokens (the last token is only a target). Epoch
`e` of that phase shifts the cut by a seeded offset and visits the windows in a seeded permutation, so every
token is seen once per epoch and epochs differ. Window number `g` (counting across epochs) is a pure function of
(seed, phase, g), so the data position of a run is one integer per phase: a resumed run asks for the windows from
its cursor on and gets exactly what the uninterrupted run would have seen.
"""

from __future__ import annotations

import numpy as np


class WindowSampler:
    """Windows i32[context + 1] of `stream` for one phase of a run (see the module docstring)."""

    def __init__(self, stream: np.ndarray, context: int, seed: int, phase: int):
        if context < 1:
            raise ValueError(f"window context must be >= 1, got {context}")
        if stream.size < 2 * (context + 1):
            raise ValueError(f"token stream of {stream.size} tokens is too short for windows of {context + 1}")
        self.stream = np.asarray(stream, np.int32)
        self.context = context
        self.seed = seed
        self.phase = phase
        self.per_epoch = (self.stream.size - context - 1) // context
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    def _epoch_starts(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, self.phase, epoch])
            shift = int(rng.integers(0, self.context))
            starts = shift + self.context * rng.permutation(self.per_epoch)
            self._epoch_cache = (epoch, starts)
        return self._epoch_cache[1]

    def starts(self, cursor: int, count: int) -> np.ndarray:
        """Stream offsets of windows number cursor .. cursor + count - 1."""
        out = np.empty(count, np.int64)
        for i in range(count):
            epoch, index = divmod(cursor + i, self.per_epoch)
            out[i] = self._epoch_starts(epoch)[index]
        return out

    def batch(self, cursor: int, count: int) -> np.ndarray:
        """Windows number cursor .. cursor + count - 1 as i32[count, context + 1]."""
        idx = self.starts(cursor, count)[:, None] + np.arange(self.context + 1)[None, :]
        return self.stream[idx]
