"""`Model`: what `kvjax.load` returns — static config, params pytree, the family value, tokenizer, dtype, attention."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from kvjax.arrays import jnp_dtype, tree_identity
from pallas_kernels.linear import packed_weights_supported


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
    # per layout name ("loop", which verification reads too): (ids of the params' leaves, the leaves, the layout) of
    # its last call
    _loop: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def loop_params(self):
        """`params` in the layout the family's one-token loops read (`Family.loop_params`; Llama fuses q/k/v and
        gate/up into two matrices), packed for the native products where the family packs (`Family.pack_params`: the
        same bits), made once and kept while `params` holds the same arrays: a replaced weight, even deep inside the
        tree, makes it again. Pass it wherever `params` goes to a decode loop (`steps.decode`): a loop given the plain
        layout rebuilds the fused one on every call (SmolLM2-135M: 280 MB of concatenation, ~5 ms per token of a
        32-token call). Costs the fused matrices' memory while kept. Without a loop layout: `params` (packed)."""
        fuse, pack = self.family.loop_params, self.family.pack_params
        if fuse is None or pack is None:
            return self._layout("loop", fuse or pack)
        return self._layout("loop", lambda p: pack(fuse(p)))

    def verify_params(self):
        """`params` in the layout verify-shape forwards read. Where the family packs for the native products
        (`Family.pack_params`; Llama on a CPU with the native kernel, `pallas_kernels.linear.PackedF32`, or a GGUF
        model's exact block codes, `pallas_kernels.affine.PackedAffine`) that is the
        loops' layout itself (`loop_params`: fused and packed), so the model keeps one extra copy of its projections,
        not two: the native product computes each output column as one FMA chain over k whatever matrix it sits in, so
        fused and plain, packed and unpacked give the same hidden states at the rows it takes (`F32_NATIVE_ROWS`: every
        verify block of x <= 63); a tied head's logits are the packed head's (`pack_projections`). Larger blocks take
        XLA's dot of the fused matrices, as VeriCache's verification and its reference decoder both do. Elsewhere (no
        packing, or a GPU/TPU): `params`."""
        if self.family.pack_params is None or not packed_weights_supported():
            return self.params
        return self.loop_params()

    def _layout(self, name: str, make):
        if make is None:
            return self.params
        key, leaves = tree_identity(self.params)
        if any(isinstance(x, jax.core.Tracer) for x in leaves):  # inside a trace: nothing to keep
            return make(self.params)
        hit = self._loop.get(name)
        if hit is not None and hit[0] == key:
            return hit[2]
        # eagerly, not under jax.jit: a jitted call returns the leaves it passes through (the embedding, the norms) as
        # new buffers, a second copy of them per layout (SmolLM2: 113 MB of embedding); eagerly they stay shared
        made = make(self.params)
        self._loop[name] = (key, leaves, made)
        return made

    @property
    def cache_dtype(self):
        """The JAX dtype caches of this model are kept in (the parameter dtype)."""
        return jnp_dtype(self.dtype)

    def __repr__(self) -> str:
        return (f"Model(family={self.family.name!r}, path={self.path!r}, dtype={self.dtype!r}, "
                f"attention={self.attention!r})")
