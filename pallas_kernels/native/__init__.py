"""Native CPU kernels as XLA FFI custom calls, built on first use into one library and loaded through jax.ffi: kernel 0
(`attention.cc`; with some rows' block masses from the same pass, `attend_stats_mass`), the refreshing drafter's
block masses (`block_mass.cc`, wrapped by `native.block_mass`), products
with bf16 weights, int8 codes or exact block codes (`matmul.cc`, `native.matmul`), a draft's lossy products of 4-bit
or int8 codes with int16-quantised rows (`int_dot.cc`, `native.matmul.matmul_int_dot` / `matmul_int_dot8`), gathers
of a cache's rows as int8 codes (`gather_int8.cc`) or f32 / bf16 (`gather_rows.cc`, both on `gather.h`) and greedy
tokens' argmax (`argmax.cc`, `pallas_kernels.argmax`).

Build choice: the library is compiled on first use, not by a setuptools step, into a per-user cache directory keyed by
the sources' hash, the jax/jaxlib versions, the compiler, its flags and the CPU's feature flags. Why: the project is
installed editable (a setuptools build step would not re-run when the source changes, and would need jaxlib's headers
at build-isolation time); a key that includes the CPU keeps a `-march=native` library built on one machine from ever
running on another that shares the home directory. The compiler is `$CXX`, else `c++`/`g++`; the flags
`-O3 -march=native` where the compiler accepts them, plain `-O3` (the portable scalar path) where it does not.

Where no library can be built (no compiler, no headers, a failed build), `available()` is False, `status()` says why,
and the dispatcher (`pallas_kernels.backend.resolve`) keeps the XLA path: never a silent wrong answer, and
`kvjax --version` / `pallas_kernels.active_cpu_implementation()` name the implementation in use.

Environment: `KVJAX_NATIVE=0` disables the native kernel; `KVJAX_NATIVE_CACHE` moves the build directory;
`KVJAX_NATIVE_THREADS` sets the kernel's thread count (default: the CPU count, at most 16).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).parent
KERNEL_SOURCES = (HERE / "attention.cc", HERE / "block_mass.cc", HERE / "matmul.cc", HERE / "int_dot.cc",
                  HERE / "gather_int8.cc", HERE / "gather_rows.cc", HERE / "argmax.cc")
SOURCES = (*KERNEL_SOURCES, HERE / "fma_probe.cc")  # one library: the kernels and the multiply-add probe
# shared by the sources; part of the build key too
HEADERS = (HERE / "gather.h", HERE / "pool.h", HERE / "shapes.h", HERE / "simd.h", HERE / "workers.h")
TARGET = "kvjax_attend"
INT8_TARGET = "kvjax_attend_int8"  # attention.cc over int8 codes with per-slot scales (`attend_stats_int8`)
INT8_RING_TARGET = "kvjax_attend_int8_ring"  # ... an int8 part and an f32/bf16 ring as one call (`attend_stats_int8_ring`)
MASS_TARGET = "kvjax_attend_mass"  # attention.cc plus some rows' block masses (`attend_stats_mass`)
GATHER_INT8_TARGET = "kvjax_gather_int8"  # gather_int8.cc: a cache's rows gathered as int8 codes (`gather_int8`)
GATHER_ROWS_TARGET = "kvjax_gather_rows"  # gather_rows.cc: a cache's rows gathered as f32 or bf16 (`gather_rows`)
BLOCK_MASS_TARGET = "kvjax_block_mass"  # block_mass.cc, wrapped by `pallas_kernels.native.block_mass`
MATMUL_TARGET = "kvjax_matmul_bf16"  # matmul.cc, wrapped by `pallas_kernels.native.matmul`
MATMUL_F32_TARGET = "kvjax_matmul_f32"  # matmul.cc's f32-weight product (`native.matmul.matmul_f32`)
MATMUL_I8_TARGET = "kvjax_matmul_int8"  # matmul.cc's int8-code product (`native.matmul.matmul_int8`)
MATMUL_F32_PACKED_TARGET = "kvjax_matmul_f32_packed"  # matmul.cc's product with panel-packed f32 weights
MATMUL_I8_PACKED_TARGET = "kvjax_matmul_int8_packed"  # ... and with panel-packed int8 codes
MATMUL_AFFINE_PACKED_TARGET = "kvjax_matmul_affine_packed"  # ... and with packed block-affine codes (exact f32 weights)
MATMUL_INT_DOT_TARGET = "kvjax_matmul_int_dot"  # int_dot.cc: 4-bit codes x int16-quantised rows (a draft's, lossy)
MATMUL_INT_DOT8_TARGET = "kvjax_matmul_int_dot8"  # ... and int8 codes x int16-quantised rows
ARGMAX_TARGET = "kvjax_argmax"  # argmax.cc: each row's first maximum (`pallas_kernels.argmax.argmax`)
_lock = threading.Lock()
_state: dict = {}
_handles: list = []  # the loaded library (ctypes), for its plain C entry points


def _cache_dir() -> Path:
    env = os.environ.get("KVJAX_NATIVE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvjax" / "native"


def _cpu_fingerprint() -> str:
    """The CPU's feature flags (Linux) or the machine name: part of the build key because of -march=native."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _compile(cxx: str, flags: list[str], out: Path) -> str | None:
    """Compile to `out` atomically; returns None on success, else the compiler's message."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [cxx, *flags, "-std=c++17", "-shared", "-fPIC", "-pthread", f"-I{jax.ffi.include_dir()}",
           *map(str, SOURCES), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        os.unlink(tmp)
        return f"{' '.join(cmd)}: {e}"
    if proc.returncode != 0:
        os.unlink(tmp)
        return f"{' '.join(cmd)}: {proc.stderr.strip()[-2000:]}"
    os.replace(tmp, out)  # atomic: concurrent first uses never load a half-written library
    return None


# -ffp-contract=off: only the kernel's explicit FMA intrinsics fuse, so the arithmetic order is the source's.
FLAG_SETS = (["-O3", "-march=native", "-ffp-contract=off"], ["-O3", "-ffp-contract=off"])


def _build() -> dict:
    if os.environ.get("KVJAX_NATIVE", "1") == "0":
        return dict(ok=False, reason="disabled by KVJAX_NATIVE=0")
    cxx = _compiler()
    if cxx is None:
        return dict(ok=False, reason="no C++ compiler found ($CXX, c++, g++, clang++)")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return dict(ok=False, reason=f"{cxx} --version failed: {e}")
    errors = []
    texts = _source_texts()
    for flags in FLAG_SETS:
        key = hashlib.sha256("\0".join([*texts, jax.__version__, jax.lib.__version__, cxx, version, " ".join(flags),
                                        _cpu_fingerprint()]).encode()).hexdigest()[:20]
        lib = _cache_dir() / f"kvjax_attention_{key}.so"
        if not lib.exists():
            err = _compile(cxx, flags, lib)
            if err is not None:
                errors.append(err)
                continue
        try:
            handle = ctypes.cdll.LoadLibrary(str(lib))
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handle.KvjaxAttend), platform="cpu")
            jax.ffi.register_ffi_target(INT8_TARGET, jax.ffi.pycapsule(handle.KvjaxAttendInt8), platform="cpu")
            jax.ffi.register_ffi_target(INT8_RING_TARGET, jax.ffi.pycapsule(handle.KvjaxAttendInt8Ring),
                                        platform="cpu")
            jax.ffi.register_ffi_target(MASS_TARGET, jax.ffi.pycapsule(handle.KvjaxAttendMass), platform="cpu")
            jax.ffi.register_ffi_target(GATHER_INT8_TARGET, jax.ffi.pycapsule(handle.KvjaxGatherInt8),
                                        platform="cpu")
            jax.ffi.register_ffi_target(GATHER_ROWS_TARGET, jax.ffi.pycapsule(handle.KvjaxGatherRows),
                                        platform="cpu")
            jax.ffi.register_ffi_target(BLOCK_MASS_TARGET, jax.ffi.pycapsule(handle.KvjaxBlockMass), platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(handle.KvjaxMatmulBf16), platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_F32_TARGET, jax.ffi.pycapsule(handle.KvjaxMatmulF32), platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_I8_TARGET, jax.ffi.pycapsule(handle.KvjaxMatmulI8), platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_F32_PACKED_TARGET, jax.ffi.pycapsule(handle.KvjaxMatmulF32Packed),
                                        platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_I8_PACKED_TARGET, jax.ffi.pycapsule(handle.KvjaxMatmulI8Packed),
                                        platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_AFFINE_PACKED_TARGET,
                                        jax.ffi.pycapsule(handle.KvjaxMatmulAffinePacked), platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_INT_DOT_TARGET, jax.ffi.pycapsule(handle.KvjaxMatmulIntDot),
                                        platform="cpu")
            jax.ffi.register_ffi_target(MATMUL_INT_DOT8_TARGET, jax.ffi.pycapsule(handle.KvjaxMatmulIntDot8),
                                        platform="cpu")
            jax.ffi.register_ffi_target(ARGMAX_TARGET, jax.ffi.pycapsule(handle.KvjaxArgmax), platform="cpu")
        except Exception as e:  # noqa: BLE001 -- any load/registration failure means: use XLA, and say why
            errors.append(f"loading {lib}: {e}")
            continue
        _handles.append(handle)
        return dict(ok=True, library=str(lib), flags=" ".join(flags), vector_width=handle.kvjax_native_vector_width(),
                    int_dot_vnni=bool(handle.kvjax_native_int_dot_vnni()),
                    int8_score_tile_dims=int(handle.kvjax_native_int8_score_tile_dims()))
    return dict(ok=False, reason="build failed: " + " | ".join(errors))


def status() -> dict:
    """Build/load status: `ok`, and either `library`, `flags`, `vector_width` (8 = AVX2+FMA path), `int_dot_vnni`
    (whether `int_dot.cc`'s integer dot products run as AVX-512 VNNI instructions), `int8_score_tile_dims`
    (`attend_stats_int8`'s `qscores` run as VNNI tiles for head sizes that are multiples of it; 0: none,
    `int8_scores_fast`) or `reason`."""
    with _lock:
        if not _state:
            _state.update(_build())
        return dict(_state)


def set_spin_us(us: int) -> None:
    """How long (microseconds) the kernels' pool workers spin for the next job before they sleep (default 300, or
    $KVJAX_NATIVE_SPIN_US): for benchmarks that compare settings in one process. Raises where the library is not
    loaded."""
    if not available():
        raise RuntimeError(f"the native library is not available: {status()['reason']}")
    if int(us) < 0:
        raise ValueError(f"spin window must be >= 0 microseconds, got {us}")
    _handles[-1].kvjax_native_set_spin_us(ctypes.c_longlong(int(us)))


def set_pool(choice: str) -> None:
    """Which threads the kernels run on from now on: "xla" (XLA's intra-op pool where the runtime lends it to the
    call, the default) or "own" (the library's pool, as `KVJAX_NATIVE_POOL=own`): for benchmarks that compare the two in
    one process. Raises where the library is not loaded."""
    if not available():
        raise RuntimeError(f"the native library is not available: {status()['reason']}")
    if choice not in ("xla", "own"):
        raise ValueError(f"pool must be 'xla' or 'own', got {choice!r}")
    _handles[-1].kvjax_native_set_pool(ctypes.c_int(0 if choice == "xla" else 1))


def multiply_add_rate(threads: int = 1, seconds: float = 0.2) -> float:
    """The machine's f32 multiply-add rate (multiply-adds per second) on `threads` threads at once, each running
    independent chains of the widest vector FMA the library was built with (`fma_probe.cc`) for about `seconds`: the
    arithmetic floor of a step that must do N multiply-adds is N / this, measured in the same run as the step
    (`scripts/bench_short_verify.py`). Raises where the library is not loaded."""
    if not available():
        raise RuntimeError(f"the native library is not available: {status()['reason']}")
    if int(threads) < 1 or not seconds > 0:
        raise ValueError(f"threads must be >= 1 and seconds > 0, got {threads} and {seconds}")
    import concurrent.futures  # noqa: PLC0415 - benchmarks only

    fn = _handles[-1].kvjax_fma_rate
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_longlong, ctypes.POINTER(ctypes.c_float)]
    sink = ctypes.c_float()
    iters = 1 << 16
    while True:  # one thread: rounds enough for `seconds` (ctypes releases the GIL: threads below run at once)
        t0 = time.perf_counter()
        fn(iters, ctypes.byref(sink))
        if time.perf_counter() - t0 >= seconds / 4 or iters >= 1 << 34:
            break
        iters *= 4
    iters = max(int(iters * seconds / max(time.perf_counter() - t0, 1e-9)), 1)
    with concurrent.futures.ThreadPoolExecutor(int(threads)) as ex:
        rates = list(ex.map(lambda _: fn(iters, ctypes.byref(ctypes.c_float())), range(int(threads))))
    return float(sum(rates))


def source_digest() -> str:
    """A digest of the library's sources (what defines every native kernel's arithmetic, whatever compiler, flags or
    CPU built it: the vector and scalar builds give the same bits): part of a cache entry's identity where the native
    kernels computed its keys and values (`kvjax.prefix.runtime_identity`)."""
    return hashlib.sha256("\0".join(p.read_text() for p in KERNEL_SOURCES + HEADERS).encode()).hexdigest()[:16]


def _source_texts() -> list[str]:
    return [p.read_text() for p in SOURCES + HEADERS]


def available() -> bool:
    """Whether the native kernel is built and registered (builds it on the first call)."""
    return status()["ok"]


def attend_stats(q, k, v, q_pos, k_pos, *, window=None, scale=None, block: int | None = None):
    """Kernel 0's un-normalised statistics by the native kernel.

    Args:
        q: [B, T, N, D]; k, v: [B, K, S, D] (v None: keys are the values; both bf16: read as bf16, else as f32);
            q_pos: i32[B, T];
        k_pos: i32[B, S] or i32[B, K, S] (-1 empty); window: W or None; scale: default D ** -0.5;
        block: keys per block (static; default `default_block(D)`).

    Returns:
        `(o f32[B, T, N, D], m f32[B, T, N], l f32[B, T, N])`, as `pallas_kernels.attend(..., return_stats=True)`.
    """
    call, attrs = _stats_call(TARGET, q, k, window, scale, block)
    scale = q.shape[-1] ** -0.5 if scale is None else scale  # the reference's, for the backward pass
    f32 = jnp.float32
    k, v = _keys_values(k, v)
    q_pos, k_pos = q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)

    # The custom call has no derivative: gradients (training, e.g. DeepSeek-V4's train step) take the f32
    # reference's, recomputed in the backward pass -- the same function up to f32 rounding.
    @jax.custom_vjp
    def stats(q, k, v):
        return call(q, k, v, q_pos, k_pos, **attrs)

    def fwd(q, k, v):
        return stats(q, k, v), (q, k, v)

    def bwd(res, g):
        from pallas_kernels import reference as ref

        _, vjp = jax.vjp(lambda q, k, v: ref.attend_reference(q, k, v, q_pos, k_pos, window=window, scale=scale,
                                                              return_stats=True), *res)
        return vjp(g)

    stats.defvjp(fwd, bwd)
    return stats(q.astype(f32), k, v)


def attend_stats_int8(q, k, v, k_scale, v_scale, q_pos, k_pos, *, window=None, scale=None,
                      block: int | None = None, qscores: bool = False):
    """`attend_stats` over int8 codes with one f32 scale per (batch, kv head, slot): keys `k * k_scale[..., None]`,
    values `v * v_scale[..., None]` (`kvjax.cache.draft.Int8KV`). Only the codes and scales are read: each code is
    widened and multiplied by its slot's scale in registers (the one f32 product of that dequantisation), so the
    statistics are bit for bit `attend_stats` over the dequantised f32 arrays.

    With `qscores`, the codes are read as integers instead (`pallas_kernels.reference.int8_qscores_reference` defines
    the arithmetic): each query row is quantised to int8 codes per head, a score is the exact integer dot product of
    the two codes times the row's and the key's scales, and each value's scale multiplies its probability rather than
    the value -- a draft's attention, lossy anyway, at a fraction of the instructions per key.

    Args:
        q: [B, T, N, D]; k, v: int8[B, K, S, D]; k_scale, v_scale: f32[B, K, S]; q_pos, k_pos, window, scale, block:
            as `attend_stats`.
    """
    call, attrs = _stats_call(INT8_TARGET, q, k, window, scale, block)
    _check_int8_part(k, v, k_scale, v_scale)
    f32 = jnp.float32
    return call(q.astype(f32), k, v, k_scale.astype(f32), v_scale.astype(f32), q_pos.astype(jnp.int32),
                k_pos.astype(jnp.int32), qscores=np.int64(bool(qscores)), **attrs)


def attend_stats_int8_ring(q, k, v, k_scale, v_scale, q_pos, k_pos, ring_k, ring_v, ring_pos, *, window=None,
                           scale=None, block: int | None = None, qscores: bool = False):
    """`attend_stats` over the union of two parts, in one call: int8 codes with per-slot scales (as
    `attend_stats_int8`) and a ring of f32 or bf16 keys and values (as `attend_stats`) -- a draft's kept tokens and its
    recent ones. Each part's segments and the merge of all their statistics happen inside the call, so it equals
    `combine` of the two parts' statistics up to f32 rounding (not bit for bit: the merge order is its own).

    Args:
        q: [B, T, N, D]; k, v, k_scale, v_scale, k_pos: the int8 part (`attend_stats_int8`); ring_k, ring_v:
            f32 or bf16 [B, K, R, D] (one dtype); ring_pos: i32[B, R] or [B, K, R]; q_pos, window, scale, block:
            as `attend_stats`; qscores: the int8 part's scores as `attend_stats_int8`'s (the ring's stay f32).
    """
    call, attrs = _stats_call(INT8_RING_TARGET, q, k, window, scale, block)
    _check_int8_part(k, v, k_scale, v_scale)
    (B, K), D = k.shape[:2], k.shape[-1]
    if ring_k.ndim != 4 or ring_k.shape[:2] != (B, K) or ring_k.shape[3] != D or ring_v.shape != ring_k.shape:
        raise ValueError(f"ring_k and ring_v must be [B, K, R, D] with B, K, D = {(B, K, D)}, got {ring_k.shape} and "
                         f"{ring_v.shape}")
    ring_k, ring_v = _keys_values(ring_k, ring_v)
    f32 = jnp.float32
    return call(q.astype(f32), k, v, k_scale.astype(f32), v_scale.astype(f32), q_pos.astype(jnp.int32),
                k_pos.astype(jnp.int32), ring_k, ring_v, ring_pos.astype(jnp.int32), qscores=np.int64(bool(qscores)),
                **attrs)


def _check_int8_part(k, v, k_scale, v_scale):
    """Raise ValueError unless k, v are int8 codes of one shape and k_scale, v_scale are [B, K, S]."""
    B, K, S = k.shape[:3]
    if k.dtype != jnp.int8 or v.dtype != jnp.int8 or v.shape != k.shape:
        raise ValueError(f"k and v must be int8 codes of one shape, got {k.dtype}{k.shape} and {v.dtype}{v.shape}")
    if k_scale.shape != (B, K, S) or v_scale.shape != (B, K, S):
        raise ValueError(f"k_scale and v_scale must be [B, K, S] = {(B, K, S)}, got {k_scale.shape}, {v_scale.shape}")


def attend_stats_mass(q, k, v, q_pos, k_pos, *, rows: tuple[int, ...], mass_block: int, row_base=None, window=None,
                      scale=None, block: int | None = None):
    """`attend_stats` and, from the same pass over the keys, the block masses of query rows `rows`: the softmax mass
    each group of `mass_block` slots gets from those rows, summed over each KV head's query group and the rows --
    `kvjax.models.attention_scores.block_mass_reference(q[:, rows], k, q_pos[:, rows], k_pos, mass_block)` up to f32
    rounding. The statistics are bit for bit `attend_stats`' (the masses only read the probabilities).

    Args:
        rows: distinct query rows in [0, T) (static); mass_block: a multiple of 8 dividing the kernel's block (static);
            row_base: i32[B] or None (zeros): batch row b's mass rows are row_base[b] + rows, and those outside
            [0, T) add nothing -- where the rows that score fall in a call is known only at run time (a prefill
            chunk's share of its prompt's last tokens); the rest as `attend_stats` (no gradient: an inference path).

    Returns:
        `(o, m, l, mass f32[B, K, ceil(S / mass_block)])`.
    """
    B, T = q.shape[:2]
    K, S = k.shape[1], k.shape[2]
    mass = jax.ShapeDtypeStruct((B, K, -(-S // mass_block)), jnp.float32)
    call, attrs = _stats_call(MASS_TARGET, q, k, window, scale, block, extra=(mass,))
    rows = tuple(int(r) for r in rows)
    if len(set(rows)) != len(rows) or not all(0 <= r < T for r in rows):
        raise ValueError(f"rows must be distinct query rows in [0, {T}), got {rows}")
    if not mass_block_fits(mass_block, int(attrs["block"])):
        raise ValueError(f"mass_block must be a multiple of 8 dividing the kernel's block {int(attrs['block'])}, "
                         f"got {mass_block}")
    k, v = _keys_values(k, v)
    base = jnp.zeros((B,), jnp.int32) if row_base is None else jnp.asarray(row_base, jnp.int32).reshape(B)
    return call(q.astype(jnp.float32), k, v, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32), base,
                mass_block=np.int64(mass_block), mass_rows=np.asarray(rows, np.int64), **attrs)


def mass_block_fits(mass_block: int, block: int) -> bool:
    """Whether `attend_stats_mass` can sum masses over groups of `mass_block` slots in the kernel's `block`-slot key
    blocks (`default_block(D)` unless given): a multiple of 8 that divides it."""
    return mass_block >= 8 and mass_block % 8 == 0 and block % mass_block == 0


def _keys_values(k, v):
    """k and v (None: the keys) as the kernel reads them: bf16 as they are when both are bf16 (widened exactly inside
    the kernel: no f32 copy of the cache), else f32."""
    v = k if v is None else v
    kv_dtype = jnp.bfloat16 if k.dtype == jnp.bfloat16 and v.dtype == jnp.bfloat16 else jnp.float32
    return k.astype(kv_dtype), v.astype(kv_dtype)


def _stats_call(target, q, k, window, scale, block, extra=()):
    """(the custom call of one of kernel 0's entry points, its attrs) for queries q [B, T, N, D] over keys
    [B, K, S, D]: the (o, m, l) statistics' shapes then `extra`'s, window / scale / block with their defaults; raises
    where the library is not built or N is not a multiple of K."""
    if not available():
        raise RuntimeError(f"the native attention kernel is not available: {status()['reason']}")
    B, T, N, D = q.shape
    K = k.shape[1]
    if N % K:
        raise ValueError(f"query heads N={N} must be a multiple of kv heads K={K}")
    if scale is not None and not scale > 0:  # the kernel scales each block's maximum (a monotone map only then)
        raise ValueError(f"scale must be positive, got {scale}")
    f32 = jnp.float32
    out = (jax.ShapeDtypeStruct((B, T, N, D), f32), jax.ShapeDtypeStruct((B, T, N), f32),
           jax.ShapeDtypeStruct((B, T, N), f32), *extra)
    attrs = dict(window=np.int64(0 if window is None else window),
                 scale=np.float32(D**-0.5 if scale is None else scale),
                 block=np.int64(default_block(D) if block is None else block))
    return jax.ffi.ffi_call(target, out, vmap_method="sequential"), attrs


def runs_here() -> bool:
    """Whether the native kernels serve this process's calls: the CPU backend, with the library built and loaded --
    the one predicate every native dispatch checks (the attention's goes through `pallas_kernels.backend.resolve`)."""
    return jax.default_backend() == "cpu" and available()


def int8_scores_fast(head_dim: int) -> bool:
    """Whether int8 keys' integer scores (`attend_stats_int8`'s `qscores`) run here as AVX-512 VNNI tiles: the native
    kernels serve this process, the library was built with VNNI, and the head size is one the tiles take (a multiple
    of 32, as `attention.cc` reports it; elsewhere a plain integer loop gives the same results, slower)."""
    dims = status().get("int8_score_tile_dims", 0) if runs_here() else 0
    return dims > 0 and head_dim % dims == 0


def _gather_shape(x, pos) -> tuple[int, int, int, int]:
    """(B, K, C, D) of a gather of rows `pos` ([B, C] or [B, K, C]) from x f32[B, K, S, D]; raises naming the wrong
    argument (or why the native kernels are missing)."""
    if not available():
        raise RuntimeError(f"the native kernels are not available: {status()['reason']}")
    if x.ndim != 4 or x.dtype != jnp.float32:
        raise ValueError(f"x must be f32[B, K, S, D], got {x.dtype}{x.shape}")
    B, K, _, D = x.shape
    if pos.ndim not in (2, 3) or pos.shape[0] != B or (pos.ndim == 3 and pos.shape[1] != K):
        raise ValueError(f"pos must be [B, C] or [B, K, C] with B={B}, K={K}, got {pos.shape}")
    return B, K, pos.shape[-1], D


def gather_int8(x, pos):
    """Rows `pos` (slots of x, i32[B, C] or [B, K, C]; -1: an empty row) of x f32[B, K, S, D] as int8 codes
    i8[B, K, C, D] and scales f32[B, K, C] (`gather_int8.cc`): the codes and scales `kvjax.cache.draft.Int8KV.quantize`
    makes of `gather_tokens(x, pos)`, in one pass."""
    B, K, C, D = _gather_shape(x, pos)
    out = (jax.ShapeDtypeStruct((B, K, C, D), jnp.int8), jax.ShapeDtypeStruct((B, K, C), jnp.float32))
    return jax.ffi.ffi_call(GATHER_INT8_TARGET, out, vmap_method="sequential")(x, pos.astype(jnp.int32))


def gather_rows(x, pos, dtype):
    """Rows `pos` (slots of x, i32[B, C] or [B, K, C]; -1: an empty row, zeros) of x f32[B, K, S, D] as `dtype` (f32
    or bf16) [B, K, C, D] (`gather_rows.cc`): `kvjax.compress.base.gather_tokens(x, pos).astype(dtype)`, the same
    bits, in one pass."""
    B, K, C, D = _gather_shape(x, pos)
    dtype = jnp.dtype(dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"rows are gathered as float32 or bfloat16, not {dtype}")
    out = jax.ShapeDtypeStruct((B, K, C, D), dtype)
    return jax.ffi.ffi_call(GATHER_ROWS_TARGET, out, vmap_method="sequential")(x, pos.astype(jnp.int32))


def default_block(D: int) -> int:
    """Keys per block: one block's keys (BLOCK x D f32) fill about half of a 64 KiB L1/L2 working set; 256 at D <= 32.
    Depends only on D, so every call of one model takes the same blocks (a row's arithmetic order is fixed)."""
    return int(max(64, min(256, (8192 // max(D, 1)) // 8 * 8)))
