"""The refreshing drafter ("refresh"): after verifications, re-select the draft's prompt part from the attention the
verify rows themselves put on the full cache, so the draft follows what the decode attends to.

Published forms of the idea: PillarAttn in SparseSpec (arXiv 2512.01278: the verify pass's softmax weights averaged
over the GQA group and the verify rows, top-k tokens per (layer, KV head) become the next draft's sparse set), Vegas
(arXiv 2602.07223: the first and last verify rows' scores, top 5% plus the newest tokens), TriForce's chunks
(arXiv 2404.11912: fixed-size chunks scored as one).

Here, per full-attention layer and KV head, the full cache is cut into blocks of `block` tokens; a block's score is
the softmax mass the queries of the verify rows put on it (the first and the last: Vegas), summed over the GQA group
and the rows. The draft keeps the top blocks within the same static budget as every other drafter (a
`ratio`-th of the prompt), always with the first `sink_blocks` blocks and the `recent_blocks` blocks just before the
tokens the draft's recent ring holds exactly. Budget, block size, rows and refresh period are static; selection is a
`top_k`; nothing recompiles. The verify forward hands out its rows' queries and, where the native kernel ran its
attention, the block masses they put on the cache it read (every verify-shape program does, so verification stays
bit-identical to the reference decoder); a separate jitted step takes those masses (or scores the full cache with the
queries where there are none) and gathers the new selection from the full cache the verify just read — in offloaded
mode from the fetched copy, with no extra transfer. Before the first verification the selection is made the same way
from the last `obs_window` prompt tokens' queries.

Composed with quantization (`bulk_bits`, "refresh_kivi4" / "refresh_kivi2"), every prompt token is also kept in a
KIVI-style bulk quantized once at compression; the selected blocks are hidden in it (`QuantizedBulk.hidden`), so
each token is attended once, exactly or coarsely. Measured on the bundled checkpoint (README "VeriCache"): a 4-bit
bulk raises acceptance above both KIVI-4 and refresh alone; a 2-bit bulk lowers it below refresh alone.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax.arrays import device_space
from kvjax.cache.dense import DenseKV, ModelCache
from kvjax.cache.draft import DraftCache, QuantizedBulk, QuantizedKV
from kvjax.compress.base import Compressor, gather_blocks, gather_tokens, round_up, sparse_part
from kvjax.models.attention_scores import block_mass  # noqa: F401 - part of this drafter's interface


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class RefreshSpec:
    """The static shape of a refreshing draft: its block size and budget, where it scores, how often it refreshes."""

    block: int
    budget_blocks: int
    sink_blocks: int
    recent_blocks: int
    period: int
    min_drafts: int = 0
    dtype: str = "float32"  # how the selected tokens are stored (the drafter's `draft_dtype`)

    @property
    def budget(self) -> int:
        return self.block * self.budget_blocks

    def due(self, rounds_since: int, drafts_since: int) -> bool:
        """Re-select now? After `period` verifications and at least `min_drafts` drafted tokens since the last
        selection: short adaptive rounds (x = 2, 4) would otherwise pay a re-selection every few tokens."""
        return rounds_since >= self.period and drafts_since >= self.min_drafts

    def after_verify(self, since: tuple[int, int], drafted: int) -> tuple[bool, tuple[int, int]]:
        """One verification of `drafted` drafts happened: (re-select now?, the (verifications, drafted tokens)
        counters to carry into the next round) — the one schedule rule of `run_vericache` and the scheduler."""
        since = (since[0] + 1, since[1] + drafted)
        return (True, (0, 0)) if self.due(*since) else (False, since)


def select_blocks(mass: jax.Array, end: jax.Array, spec: RefreshSpec) -> jax.Array:
    """Token positions i32[B, K, budget] of the top blocks among blocks wholly or partly below `end[b]` (ascending;
    -1 where a block reaches past `end` or fewer blocks exist), sinks and the blocks just before `end` forced in."""
    B, K, nb = mass.shape
    P = spec.block
    b = jnp.arange(nb)[None, None, :]
    n_end = ((end + P - 1) // P)[:, None, None]  # blocks touching [0, end)
    forced = (b < spec.sink_blocks) | ((b >= n_end - spec.recent_blocks) & (b < n_end))
    score = jnp.where(b < n_end, jnp.where(forced, jnp.inf, mass), -jnp.inf)
    kb = min(spec.budget_blocks, nb)
    vals, idx = jax.lax.top_k(score, kb)
    idx = jnp.sort(jnp.where(vals > -jnp.inf, idx, nb + 1), axis=-1)  # ascending: neighbours stay together
    pos = idx[..., None] * P + jnp.arange(P)[None, None, None, :]  # [B, K, kb, P]
    pos = jnp.where((idx[..., None] <= nb) & (pos < end[:, None, None, None]), pos, -1).reshape(B, K, kb * P)
    if kb * P < spec.budget:
        pos = jnp.pad(pos, ((0, 0), (0, 0), (0, spec.budget - kb * P)), constant_values=-1)
    return pos.astype(jnp.int32)


def bulk_positions(length: jax.Array, slots: int) -> jax.Array:
    """i32[B, slots]: slot s holds prompt position s (< length[b]), -1 beyond: the quantized bulk's positions."""
    s = jnp.arange(slots, dtype=jnp.int32)[None, :]
    return jnp.where(s < length[:, None], s, -1).astype(jnp.int32)


def hidden_slots(bulk_pos: jax.Array, selected: jax.Array, block: int) -> jax.Array:
    """bool[B, K, S]: the bulk's slots (positions `bulk_pos` i32[B, S]) whose block is among the full-precision
    selection `selected` i32[B, K, budget] (whole blocks of `block` positions, -1 = none)."""
    B, K, _ = selected.shape
    nb = -(-bulk_pos.shape[1] // block)
    blk = jnp.where(selected >= 0, jnp.minimum(selected // block, nb), nb)  # beyond the bulk / none -> guard nb
    b, k = jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None]
    mark = jnp.zeros((B, K, nb + 1), bool).at[b, k, blk].set(True)
    of_slot = jnp.broadcast_to(jnp.where(bulk_pos >= 0, bulk_pos // block, nb)[:, None, :], (B, K, bulk_pos.shape[1]))
    return jnp.take_along_axis(mark, of_slot, axis=2)


def selected_parts(form, pos: jax.Array, bulk: QuantizedBulk | None, block: int, dtype: str = "float32") -> tuple:
    """A layer's prompt parts for the selection `pos`: its blocks in `dtype` ("float32": full precision, or
    "bfloat16"), and the quantized bulk (if the draft has one) with those blocks hidden, so no token is attended
    twice."""
    part = sparse_part(form, pos, dtype, gather=lambda x, p: gather_blocks(x, p, block))
    if bulk is None:
        return (part,)
    return part, dataclasses.replace(bulk, hidden=hidden_slots(bulk.q.pos, pos, block))


@functools.partial(jax.jit, static_argnames=("spec", "block", "dtype"))
def _first_selection(form, mass, length, bulk, *, spec: RefreshSpec, block: int, dtype: str) -> tuple:
    """A layer's first selection and its parts as one program: op by op, its ~20 small operations cost ~2.5 ms of
    dispatch a layer (the bundled model at 16K: the compression 22 ms, 13 of them dispatch; SmolLM2's 30 layers
    ~75 of 139 ms), paid at every admission. A prefilled layer lent from host memory is read in place."""
    form, length = device_space((form, length))
    return selected_parts(form, select_blocks(mass, length, spec), bulk, block, dtype)


def _ring_start(ring_pos: jax.Array, length: jax.Array) -> jax.Array:
    """The first position the recent ring holds exactly ([B]); `length` when it holds none."""
    held = jnp.where(ring_pos >= 0, ring_pos, jnp.iinfo(jnp.int32).max)
    return jnp.minimum(jnp.min(held, axis=1), length)


def refresh_draft(draft: DraftCache, full: ModelCache, aux, *, spec: RefreshSpec) -> DraftCache:
    """The draft with every full-attention layer's prompt part re-selected from the block masses the verify rows'
    queries (`aux`, from the verify forward) put on the committed full cache, and gathered from it; rings, sliding
    layers and the length are left as they are."""
    from kvjax.models.llama.refresh import refresh_masses  # noqa: PLC0415 - models sit below compress

    masses = refresh_masses(full, aux, block=spec.block)
    layers = []
    for dl, form, mass in zip(draft.layers, full.layers, masses):
        if mass is None or not isinstance(form, DenseKV):
            layers.append(dl)
            continue
        end = _ring_start(dl.recent.pos, draft.length)
        pos = select_blocks(mass, end, spec)
        bulk = next((p for p in dl.parts if isinstance(p, QuantizedBulk)), None)
        # the spec's dtype, not the parts': a row without its parts (the scheduler's, written into the batch's parts
        # by `put_parts`) must make the batch's part type (an int8 draft's `Int8KV` is not a cast of an f32 part)
        layers.append(dataclasses.replace(dl, parts=selected_parts(form, pos, bulk, spec.block, spec.dtype)))
    return dataclasses.replace(draft, layers=tuple(layers))


@dataclasses.dataclass(frozen=True)
class Refresh(Compressor):
    """The refreshing drafter (see the module docstring).

    Attributes:
        ratio: prompt tokens / kept tokens (the same static budget as the other drafters).
        block: tokens per scored block; sink_blocks / recent_blocks: always kept.
        period: refresh after every `period`-th verification ...
        min_drafts: ... once at least this many tokens were drafted since the last selection (measured: with x
            adapted down to 4 at 32K, re-selecting every round took 35% of the round; a re-selection costs ~27 ms
            there, and with adaptive x 32 beat 16 in one run each at 8K, 0.89x vs 0.86x full, and 32K, 1.09x vs
            1.03x — README "VeriCache"). The best value depends on the workload (x = 8, 64 against 32, one run
            each, identical output): SmolLM2 at 8K over 4 held-out prompts 1.61x vs 1.53x full-cache decoding (128
            tokens) and 1.59x vs 1.56x (256); the bundled model at 32K over 8 prompts 1.44x vs 1.41x (128) and 1.72x
            vs 1.71x (256); but the scheduler's 8 x 16K lock-step 1.30x and 1.35x against 1.43x and 1.47x, so it
            stays 32. Since the verify hands out its rows' masses (`attention_with_block_mass`), a re-selection costs
            the top-k and the gather alone (the bundled model at 32K 1.7-2.2 ms, SmolLM2 at 8K 12 ms, about half
            before); every 16 drafts (1.69x) and every round (1.70x) still lost to 32 (1.75x) at 32K over 8 prompts.
        obs_window: prompt tokens whose queries make the first selection.
        bulk_bits: 0, or 2 / 4: also keep every prompt token in a KIVI-style quantized bulk (keys per channel over
            groups of `bulk_group` tokens, values per token), the selected blocks hidden in it: the draft then reads
            the blocks that matter at full precision and the rest coarsely instead of not at all ("refresh_kivi2",
            "refresh_kivi4"); re-selection changes only which bulk slots are hidden.
    """

    block: int = 16
    sink_blocks: int = 1
    recent_blocks: int = 4
    period: int = 1
    min_drafts: int = 32
    obs_window: int = 16
    bulk_bits: int = 0
    bulk_group: int = 32
    name: str = dataclasses.field(default="refresh", init=False)

    def __post_init__(self):
        super().__post_init__()
        if self.bulk_bits not in (0, 2, 4):
            raise ValueError(f"bulk_bits must be 0 (no quantized bulk), 2 or 4, got {self.bulk_bits}")
        if self.bulk_bits:
            object.__setattr__(self, "name", f"refresh_kivi{self.bulk_bits}")

    @property
    def reads_host_memory(self) -> bool:
        """Whether this drafter compresses a prefilled cache lent from host memory in place (`Compressor`): its first
        selection reads the cache in jitted programs that take host arguments; a quantized bulk is built eagerly."""
        return not self.bulk_bits

    def spec(self, prompt_len: int) -> RefreshSpec:
        budget_blocks = max(self.sink_blocks + self.recent_blocks + 1, -(-self.budget(prompt_len) // self.block))
        return RefreshSpec(block=self.block, budget_blocks=budget_blocks, sink_blocks=self.sink_blocks,
                           recent_blocks=self.recent_blocks, period=self.period,
                           min_drafts=self.min_drafts, dtype=self.draft_dtype)

    @property
    def prompt_scoring(self) -> tuple[int, int]:
        """(obs_window, block): the first selection's scores, which a prefill can hand out from its own attention
        (`Compressor.prompt_scoring`)."""
        return self.obs_window, self.block

    def prepare_scored(self, full, prompt_masses):
        for m, form in zip(prompt_masses, full.layers):
            if m is not None and m.shape[-1] != -(-form.k.shape[2] // self.block):
                raise ValueError(f"prompt_masses are over blocks of another size than this drafter's {self.block} "
                                 f"slots ({m.shape[-1]} blocks for {form.k.shape[2]} slots)")
        return {"masses": prompt_masses, "spec": self.spec(int(full.length[0]))}

    def prepare(self, params, config, full, prompt):
        from kvjax.models.llama.refresh import prompt_block_masses  # noqa: PLC0415 - models sit below compress

        L = int(full.length[0])
        w = min(self.obs_window, L)
        spec = self.spec(L)
        toks = jnp.asarray(prompt[L - w:L], jnp.int32)[None, :]
        return {"masses": prompt_block_masses(params, config, full, toks, jnp.asarray([L - w], jnp.int32),
                                              block=spec.block), "spec": spec}

    def layer_parts(self, i, form, length, prompt_len, data):
        bulk = None
        if self.bulk_bits:
            bpos = bulk_positions(length, round_up(prompt_len, self.bulk_group))
            q = QuantizedKV.quantize(gather_tokens(form.k, bpos), gather_tokens(form.v, bpos), bpos,
                                     bits=self.bulk_bits, group=self.bulk_group)
            bulk = QuantizedBulk(q=q, hidden=jnp.zeros(q.k_codes.shape[:3], bool))
        return _first_selection(form, data["masses"][i], length, bulk, spec=data["spec"], block=self.block,
                                dtype=self.draft_dtype)

    def __call__(self, params, config, full, prompt, *, recent_slots: int, prompt_masses=None) -> DraftCache:
        draft = super().__call__(params, config, full, prompt, recent_slots=recent_slots, prompt_masses=prompt_masses)
        return dataclasses.replace(draft, refresh=self.spec(int(full.length[0])))
