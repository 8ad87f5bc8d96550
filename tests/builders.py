"""Shared builders of the test suite (not a test module): tiny random Hugging Face models made with transformers,
tiny random kvjax models with no files, and the compile counter. `conftest.py` wraps them as fixtures; modules that
need them at import time (parametrize lists, hypothesis state machines) import this module."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
import threading

import numpy as np

import jax
import jax.numpy as jnp

from kvjax.families.llama import LLAMA
from kvjax.model import Model
from kvjax.models.layer_types import FULL, SLIDING
from kvjax.models.llama.config import ModelConfig
from kvjax.models.rope import RopeConfig
from kvjax.remote import Link

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))  # the repository root
CHECKPOINTS = os.path.join(REPO, "checkpoints")
BUNDLED = os.path.join(CHECKPOINTS, "kvjax-code-tiny")  # the bundled trained checkpoint


def cli_error(capsys) -> str:
    """The one line a refused `kvjax` command wrote to stderr (asserting it wrote exactly one, `kvjax: error: ...`)."""
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("kvjax: error: "), err
    return err[0]

HF_FAMILIES = {
    "llama": dict(model_type="llama", num_key_value_heads=2,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                    original_max_position_embeddings=64)),
    "llama_tied_linear": dict(model_type="llama", num_key_value_heads=4, tie_word_embeddings=True,
                              rope_scaling=dict(rope_type="linear", factor=2.0)),
    "llama_yarn": dict(model_type="llama", num_key_value_heads=1,
                       rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=16,
                  max_window_layers=1),
    "qwen3": dict(model_type="qwen3", num_key_value_heads=2, head_dim=16),
    "mistral": dict(model_type="mistral", num_key_value_heads=2, sliding_window=16),
}


def make_hf_model(tmpdir: str, name: str, seed: int = 0):
    """Create, save and return (transformers model, directory) for a tiny random config of family `name`."""
    import torch
    import transformers

    spec = dict(HF_FAMILIES[name])
    model_type = spec.pop("model_type")
    cfg_cls = transformers.AutoConfig.for_model(model_type).__class__
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, eos_token_id=None,
                bos_token_id=None, pad_token_id=None)
    base.update(spec)
    cfg = cfg_cls(**base)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    # larger-than-default init so attention patterns are not flat
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 1:
                p.normal_(0, 0.08 if p.ndim > 1 else 0.3)
                if p.ndim == 1:
                    p.add_(1.0)
    d = os.path.join(tmpdir, name)
    model.save_pretrained(d)
    return model, d


def toy_config(layer_types=(FULL, SLIDING, FULL), *, window: int | None = 16, vocab: int = 97, hidden: int = 64,
               heads: int = 4, kv_heads: int = 2, head_dim: int = 16, theta: float = 10000.0,
               max_pos: int = 1 << 17) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_layers=len(layer_types), num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       rms_norm_eps=1e-5, rope=RopeConfig(theta=theta), layer_types=tuple(layer_types),
                       sliding_window=window if SLIDING in layer_types else None, max_position_embeddings=max_pos)


def toy_model(config: ModelConfig | None = None, seed: int = 0, scale: float = 0.08) -> Model:
    """Random params in kvjax's layout (matrices [in, out]); larger-than-default init so attention is not flat."""
    c = config or toy_config()
    H, I, N, K, D, V = c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 10 * c.num_layers + 4))

    def w(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * scale

    def norm(n):
        return 1.0 + 0.3 * jax.random.normal(next(keys), (n,), jnp.float32)

    layers = tuple(dict(attn_norm=norm(H), wq=w(H, N * D), wk=w(H, K * D), wv=w(H, K * D), wo=w(N * D, H),
                        mlp_norm=norm(H), w_gate=w(H, I), w_up=w(H, I), w_down=w(I, H)) for _ in range(c.num_layers))
    params = dict(embed=w(V, H) * 10, final_norm=norm(H), lm_head=w(H, V), layers=layers)
    return Model(config=c, params=params, family=LLAMA)


@functools.lru_cache(maxsize=None)
def _jitted(fn, static: tuple):
    return jax.jit(functools.partial(fn, **dict(static)))


def jitted_reference(fn, *args, **kw):
    """fn(*args, **kw) as one compiled program, reused by every call with the same keyword settings and shapes.

    The kernels' jnp references run op by op otherwise, and on CPU each op's first call at a shape compiles a
    program of its own (~0.2-0.6 s each on a 2-core machine): most of a kernel test's time. Keyword arguments
    that are arrays stay traced; the others (window, ratio, ...) are static.
    """
    static = tuple(sorted((k, v) for k, v in kw.items() if not hasattr(v, "shape")))
    return _jitted(fn, static)(*args, **{k: v for k, v in kw.items() if hasattr(v, "shape")})


def native_attention_case(T, G, *, K=2, D=32, S=700, lengths=(650, 300), per_head=False, seed=0,
                          kv_dtype=jnp.float32, q_scale=1.0):
    """Kernel 0's inputs (q, k, v, q_pos, k_pos): f32 queries (standard normal times `q_scale`: > 1 peaks the
    softmax), keys/values in `kv_dtype` over several native blocks (S = 700: blocks of 256, the last one partial),
    ragged lengths, the T query rows at each sequence's last T positions; `per_head`: per-head positions with holes (a
    sparse draft cache), head 0 of sequence 0 keeping only 40 keys."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    q = jnp.asarray(rng.normal(size=(B, T, K * G, D)) * q_scale, jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, K, S, D)), kv_dtype)
    v = jnp.asarray(rng.normal(size=(B, K, S, D)), kv_dtype)
    L = np.asarray(lengths)
    q_pos = jnp.asarray(L[:, None] - T + np.arange(T)[None], jnp.int32)
    k_pos = np.where(np.arange(S)[None] < L[:, None], np.arange(S)[None], -1).astype(np.int32)
    if per_head:
        k_pos = np.repeat(k_pos[:, None], K, axis=1)
        k_pos[rng.random(k_pos.shape) < 0.3] = -1
        k_pos[0, 0, 40:] = -1
    return q, k, v, q_pos, jnp.asarray(k_pos)


def int8_ring_case(T, G, *, D=64, K=3, S=700, R=64, fill=20, per_head=True, ring_dtype=jnp.float32, seed=0,
                   q_scale=1.0):
    """A draft's two parts for `native.attend_stats_int8_ring`: (q, an `Int8KV` kept part over slots 0..S-31
    (positions with holes), its ring (k, v, pos) of R slots whose first `fill` hold the positions right after the kept
    ones, q_pos: the T query rows the last of them)."""
    from kvjax.cache.draft import Int8KV  # noqa: PLC0415 - only the native tests build draft parts

    q, k, v, _, k_pos = native_attention_case(T, G, K=K, D=D, S=S, lengths=(S - 30,), per_head=per_head, seed=seed,
                                              q_scale=q_scale)
    part = Int8KV.quantize(k, v, k_pos)
    rng = np.random.default_rng(seed + 1)
    rk = jnp.asarray(rng.normal(size=(1, K, R, D)), ring_dtype)
    rv = jnp.asarray(rng.normal(size=(1, K, R, D)), ring_dtype)
    start = S - 30
    r_pos = jnp.asarray(np.where(np.arange(R) < fill, start + np.arange(R), -1)[None], jnp.int32)
    q_pos = jnp.asarray((start + max(fill, T) - T + np.arange(T))[None], jnp.int32)
    return q, part, (rk, rv, r_pos), q_pos


_scalar_handles: list = []  # the scalar build, compiled once per test process (~15 s each time)


def scalar_native_library(directory):
    """The native library built without -march=native (the scalar path every machine can run), loaded with ctypes,
    for tests that compare it with the vector build bit for bit; skips where the active build is the scalar one.
    Compiled into `directory` by the first test of the process that asks, then shared (the sources do not change
    within a run)."""
    import ctypes
    from pathlib import Path

    import pytest

    from pallas_kernels import native

    if native.status().get("vector_width") != 8:
        pytest.skip("this machine's build is the scalar one already")
    if not _scalar_handles:
        lib = Path(directory) / "scalar.so"
        err = native._compile(native._compiler(), list(native.FLAG_SETS[-1]), lib)
        assert err is None, err
        handle = ctypes.cdll.LoadLibrary(str(lib))
        assert handle.kvjax_native_vector_width() == 1
        _scalar_handles.append(handle)
    return _scalar_handles[0]


def vector_and_scalar(directory, symbol: str, target: str):
    """A function `call(out, *args)` that runs the product `symbol` of the active (vector) build, registered as
    `target`, and of the scalar build (`scalar_native_library`) on the same arguments, and returns both results as
    NumPy arrays, for tests that compare the two bit for bit."""
    import jax

    handle = scalar_native_library(directory)
    scalar_target = f"{target}_scalar_test"
    jax.ffi.register_ffi_target(scalar_target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")

    def call(out, *args):
        return tuple(np.asarray(jax.ffi.ffi_call(t, out)(*args)) for t in (target, scalar_target))

    return call


def gguf_weights(K, N, qtype, seed=0):
    """An f32 [K, N] matrix as a GGUF file holds it after loading: [N, K] rows quantised in blocks of 32 along K by the
    gguf package (`qtype`, a `gguf.GGMLQuantizationType`), dequantised to f32 (what `kvjax.formats` does), transposed
    to kvjax's [in, out]."""
    import gguf

    a = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32) * 0.05
    back = gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype)
    return np.ascontiguousarray(np.asarray(back, np.float32).reshape(N, K).T)


def compile_count(jitted) -> int:
    """How many executables a jitted function holds (STYLE.md habit 6)."""
    return jitted._cache_size()


# ---------------------------------------------------------------- tiny random DeepSeek-V4 models (transformers)

# Every layer type (sliding / CSA / HCA), hash-routed and top-k MoE, yarn "compress" rope; m = 4, m' = 8, W = 8.
# index_topk = 3 is below the number of complete CSA entries for prompts over 16 tokens, so the indexer really selects.
# 16 indexer heads make exact ReLU score ties (all heads zero) improbable, so transformers' unspecified top-k tie
# order does not enter the parity test (the tie rule is tested separately).
V4_SPECS = {
    "hybrid": dict(
        vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=4,
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3,
        partial_rotary_factor=0.25, hc_mult=2,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        max_position_embeddings=256, eos_token_id=None, bos_token_id=None),
    # Other switches: tied embeddings, sigmoid router scores, plain compress rope, one output group, hc_mult 3,
    # HCA first (the V4 default order), CSA with m = 2 and a window of 12. One indexer head: scores are
    # w * relu(q . k), so every entry with q . k <= 0 (or with a negative head weight) ties at 0 and top-k ties
    # decide the selection everywhere.
    "variant": dict(
        vocab_size=89, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=2,
        head_dim=24, q_lora_rank=32, num_experts_per_tok=3, n_routed_experts=5, scoring_func="sigmoid",
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        sliding_window=12, o_groups=1, o_lora_rank=20, index_n_heads=1, index_head_dim=8, index_topk=4,
        partial_rotary_factor=1 / 3, hc_mult=3, hc_sinkhorn_iters=7, tie_word_embeddings=True,
        max_position_embeddings=256, eos_token_id=None, bos_token_id=None),
}


@functools.lru_cache(maxsize=None)
def make_v4(name: str = "hybrid", seed: int = 0):
    """(transformers model in eval mode, saved directory) for the tiny config `name`, random weights of useful size."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    # one torch thread: on a shared 2-core machine, torch's thread pool made each tiny forward ~100x slower
    torch.set_num_threads(1)
    cfg = DeepseekV4Config(**V4_SPECS[name])
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0, 0.08 if p.ndim > 1 else 0.3)
            if p.ndim == 1 and ("norm" in n or "scale" in n):
                p.add_(1.0)
        for n, b in model.named_buffers():
            if n.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape))
            elif n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    # removed when the process exits: each suite run left its saved models (~1 MB a config) in the temp directory
    root = tempfile.mkdtemp(prefix="kvjax_v4_")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    d = os.path.join(root, name)
    model.save_pretrained(d)
    return model, d


def hf_logits(model, ids: np.ndarray, *, lowest_index_ties: bool = False) -> np.ndarray:
    """transformers' uncached full forward: logits f32[T, V] for one sequence.

    lowest_index_ties: run it with `Tensor.topk` (the indexer's selection; the router calls `torch.topk`) replaced by
    a stable sort, so ties go to the lowest index as in kvjax — torch leaves their order unspecified.
    """
    import collections

    import torch

    topk = torch.Tensor.topk
    if lowest_index_ties:
        TopK = collections.namedtuple("TopK", "values indices")

        def stable_topk(self, k, dim=-1, largest=True, sorted=True):
            assert largest
            v, i = torch.sort(self, dim=dim, descending=True, stable=True)
            return TopK(v.narrow(dim, 0, k), i.narrow(dim, 0, k))

        torch.Tensor.topk = stable_topk
    try:
        with torch.no_grad():
            return model(torch.tensor(np.asarray(ids)[None], dtype=torch.long), use_cache=False).logits[0].numpy()
    finally:
        torch.Tensor.topk = topk


def assert_pool_bookkeeping(pc) -> None:
    """Every device pool's slots are used or free exactly once; no tier holds more entries than its capacity."""
    with pc.lock:
        for name, pool in pc.pools.items():
            used = pc.members[name]["device"]
            assert len(used) + len(pool.free) == pool.n
            assert len({e.slot for e in used}) == len(used)
            for tier in ("host", "store"):
                assert len(pc.members[name][tier]) <= pc.caps[name][tier]


class GatedLink(Link):
    """Uncapped, but the background full-cache fetch waits for `gate` before its first byte crosses the link."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()

    def reserve(self, nbytes):
        if threading.current_thread().name == "kvjax-full-fetch":
            self.gate.wait(30)
        return super().reserve(nbytes)


def assert_every_request_exact(res, refs) -> None:
    """A scheduler run served every request, each token for token its reference decode, and counted their tokens."""
    assert sorted(res.outputs) == list(range(len(refs)))
    for i, ref in enumerate(refs):
        np.testing.assert_array_equal(res.outputs[i], ref, err_msg=f"{res.name} request {i}")
    assert res.tokens == sum(len(r) for r in refs)


def check_int_dot_product(w, product, reference, seed=0):
    """Checks an integer-dot draft product (`pallas_kernels.int_dot`) of weights `w` [K, N]: `product(x)` (the native
    kernel) against `reference(x)` (its jnp definition) up to f32 rounding for 1-11 rows through the dispatcher, each
    row's result independent of the others, a zero row exactly 0, non-finite rows NaN (only theirs), and leading
    dimensions flattened."""
    import jax.numpy as jnp

    import pallas_kernels

    K, N = w.shape
    x = np.random.default_rng(seed).standard_normal((11, K)).astype(np.float32)
    x[2] = 0.0  # a row of zeros
    x[3, :32] = 0.0  # and one block of zeros
    x = jnp.asarray(x)
    whole = np.asarray(product(x))
    # the definition quantises and sums each row on its own: computed once for all 11 rows (~1 s a call)
    ref = np.asarray(reference(x))
    for M in (1, 2, 3, 4, 5, 9, 11):
        got = np.asarray(pallas_kernels.linear(x[:M], w))  # the dispatcher takes the native kernel on CPU
        np.testing.assert_allclose(got, ref[:M], rtol=2e-6, atol=2e-6 * np.abs(ref[:M]).max())
        np.testing.assert_array_equal(got, whole[:M])  # a row's result does not depend on the others
    np.testing.assert_array_equal(whole[2], 0)
    bad = x[:3].at[1, 40].set(jnp.nan).at[2, 7].set(jnp.inf)  # non-finite rows give NaN, and only their own rows
    got = np.asarray(product(bad))
    assert np.isnan(got[1]).all() and np.isnan(got[2]).all()
    assert np.isnan(np.asarray(reference(bad))[1:]).all()
    np.testing.assert_array_equal(got[0], whole[0])
    batched = np.asarray(product(x[:6].reshape(2, 3, K)))  # leading dimensions
    np.testing.assert_array_equal(batched.reshape(6, N), whole[:6])
