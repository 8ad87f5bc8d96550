"""`Model`: what `kvjax.load` returns — static config, params pytree, the family value, tokenizer, dtype, attention."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvjax.arrays import jnp_dtype


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model.

    Attributes:
        config: the family's frozen config (static, hashable).
        params: the params pytree.
        family: the `kvjax.families.Family` value every engine function dispatches through.
        tokenizer: a `kvjax.tokenizer.Tokenizer` when the directory has one.
        path: the directory it came from.
        dtype: parameter and cache dtype name ("f32" or "bf16").
        attention: the resolved attention implementation ("xla", "pallas", "pallas_interpret", "pallas_debug",
            "native").
    """

    config: Any
    params: Any
    family: Any
    tokenizer: Any = None
    path: str | None = None
    dtype: str = "f32"
    attention: str = "xla"

    @property
    def cache_dtype(self):
        """The JAX dtype caches of this model are kept in (the parameter dtype)."""
        return jnp_dtype(self.dtype)

    def __repr__(self) -> str:
        return (f"Model(family={self.family.name!r}, path={self.path!r}, dtype={self.dtype!r}, "
                f"attention={self.attention!r})")
