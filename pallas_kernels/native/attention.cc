// Kernel 0 on the CPU: position-masked grouped-query attention over a cache, as an XLA FFI custom call.
//
// Inputs  q f32[B, T, N, D], k f32|bf16[B, K, S, D], v (k's dtype)[B, K, S, D], q_pos s32[B, T],
//         k_pos s32[B, S] or s32[B, K, S]; kvjax_attend_int8: k, v s8 codes and k_scale, v_scale f32[B, K, S]
//         after them
// Outputs o f32[B, T, N, D] (un-normalised), m f32[B, T, N] (running max), l f32[B, T, N] (sum of exp(s - m))
// Attrs   window (s64, <= 0: none), scale (f32), block (s64)
// kvjax_attend_int8_ring: kvjax_attend_int8's inputs, then a second part's ring_k, ring_v (f32 or bf16) [B, K, R, D]
//         and ring_pos s32[B, R] or s32[B, K, R]; the outputs are the statistics of both parts as one (`SolveParts`)
// kvjax_attend_mass: also mass f32[B, K, ceil(S / mass_block)], the block masses of the query rows
//         mass_base[b] + mass_rows (an input mass_base s32[B] after k_pos; attrs mass_block, mass_rows: s64[]; a row
//         outside [0, T) adds nothing) from the probabilities the softmax computes (`GroupSums`, `MassOut`)
//
// Key s is visible to a query at position t iff 0 <= k_pos[s] <= t (and k_pos[s] > t - W). The statistics are the
// online-softmax state of `pallas_kernels.online_softmax` (normalised by `finalize` in Python, which also adds
// sinks); a row that sees nothing keeps m = finfo(f32).min, l = 0, o = 0.
//
// Tiling: one (batch, kv head) is a tile; its T * G query rows run against one key block of BLOCK keys at a time, in
// chunks of up to 96 rows. Scores are GEMM-style: a panel of 64 keys (32 at D > 32) is transposed into L1 as kT[d][key]
// (16x16 AVX-512 or 8x8 AVX2 transposes; a ragged block's last keys padded with zeros, their scores masked), and
// register tiles of R rows x V vectors of 8 keys (6 x 2 ... 1 x 4, <= 12 accumulators) accumulate broadcast(q[row][d])
// * kT[d][keys] -- no horizontal reduction -- with the mask and the per-row lane maxima fused into the tile's end (no
// mask at all for a row that sees every key of a fully occupied block). Then per row: exp(s - m) and its sum over the
// block; then p.V in register tiles of up to 6 rows x 2 (or 4) vectors of columns over 32 KiB sub-blocks of values,
// each value load shared by the tile's rows. The next block's keys and values are prefetched into L2 during the current
// block. The chunk's scores (96 x BLOCK floats) and the block stay in L2. Blocks past the last occupied slot are never
// read, and a block none of whose keys a row can see is skipped for that row after reading only its positions (the
// per-block min/max position).
//
// Exactness: every (row, key) score is ONE chain over d in order -- q[0] * k[0], then fma(q[d], k[d], .) for
// d = 1..D-1 -- whatever tile, panel or chunk the row lands in, and enters its exponential as 2^fma(s, scale * log2 e,
// -(m * log2 e)) (`BlockRows`, simd.h's Exp2_16 / Exp2_8 / Exp2Scalar); exponentials and their sum are per row
// (16 lane partials in slot order over the zero-padded block, then a fixed tree); p.V is one FMA chain per (row,
// column) in slot order; blocks in slot order. Nothing a row computes depends on any other row, so its result is
// bit-identical whether the call holds 1 row or 66 (the verify/reference contract, docs/exactness.md). Threads split
// the work by tiles (and, when tiles do not divide among threads, by row ranges), never a row's keys, for the same
// reason. The scalar build (no AVX2/FMA) performs the same roundings in the same order (std::fma, the same exp
// polynomial), so it agrees with the vector build.
//
// bf16 keys and values (a draft cache stored at half the bytes) are read directly, never copied to f32 first: a
// bf16 -> f32 conversion is exact (the 16 bits shifted into the high half), done as keys are transposed into the L1
// panel and as values are loaded into registers for p.V; from there the arithmetic is the f32 path's. So attending
// to bf16 K/V gives bit for bit what attending to the same values stored as f32 gives. Measured (draft attention per
// layer at 32K: 1 row x 8 heads, 4 KV heads, D = 32, interleaved, median of 300): 8,192 slots (a 4x draft) bf16
// 0.69 ms vs f32 1.27 ms; 4,096 slots (8x) 0.39 vs 0.47 ms.
//
// int8 codes with one f32 scale per (batch, kv head, slot) for keys and for values (`kvjax_attend_int8`, a draft's
// kept tokens as `kvjax.cache.draft.Int8KV`) are read the same way: each code widened exactly and multiplied by its
// slot's scale as the keys enter the panel and the values the p.V registers -- the one f32 product of the reference's
// dequantisation, so the result is bit for bit the f32 path's over the dequantised values. Measured (SmolLM2's draft
// token at 8K, 2,016 kept slots per head, interleaved in one process): 8.87 ms against 9.60 ms for the same slots in
// bf16; dequantising each block into an f32 scratch first (one more pass over L2) ran 1.06x bf16's time instead.
//
// int8 codes read as integers (attr qscores = 1; a draft's kept tokens, `kvjax.models.attention.INT8_QSCORES`): each
// query row is quantised to int8 codes per head (`QuantizeRow`), a key's score is the exact integer dot product of
// the two codes times the row's factor and the key's scale, and each value's scale multiplies its probability instead
// of the value's elements. With AVX-512 VNNI, 16 keys' codes are transposed as dwords once (`TransposeCodes16`) and
// each row takes one VPDPBUSD per 4 dims of 16 keys (`IntScoreTile`); elsewhere a plain integer loop. An integer dot
// product is exact in any order, so every build gives the same bits. Not the f32 kernel's result over the dequantised
// values (the query's codes round it): a draft's attention only, whose verification reads the exact cache. Measured
// (AMD EPYC Zen 4, SmolLM2's draft token at 8K: 2,048 kept slots per KV head plus the ring, interleaved in one
// process): the call 0.75x the f32 scores' time (30 calls in one jit, 40 alternations); a draft token 0.897x (6.52
// against 5.85 ms, the same drafts); over 8 prompts (128 tokens, x = 8) 6.96 accepted per round against 6.94, every
// output identical, VeriCache 1.34x full-cache decoding against 1.30x.
//
// Measured (2-core EPYC Zen 3, AVX2, a shared and loaded machine; per layer, this kernel / the previous one of 8-lane
// partials + hadd tree, interleaved in one process, best of 10-40 runs): >= 17 rows per KV head 0.61-0.88x (33 x 2
// rows, D = 32, 36,864 slots: 15.5 vs 21.7 ms; SmolLM2's 33 x 3 rows, D = 64: 32.3 vs 47.9 ms); 1-2 rows per KV head
// about 1.05x at 36,864 slots (memory-bound) but up to 1.2-1.5x at 8,192 slots, where the per-panel key
// transposition is not amortised over rows.

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "pool.h"
#include "shapes.h"
#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMInit = -FLT_MAX;  // online_softmax.M_INIT
using namespace kvjax_native;  // Pool, QKShape, exponentials, lane reductions (pool.h, shapes.h, simd.h)


// ------------------------------------------------------------------------------------------------ the problem
// k and v point at float, uint16_t (bf16) or int8_t elements, per `bf16` / `k_scale` (int8 codes: k_scale and
// v_scale hold one f32 scale per (batch, kv head, slot), laid out as k_pos per head).
struct Problem {
  const float* q;
  const void *k, *v;
  bool bf16;
  const float *k_scale = nullptr, *v_scale = nullptr;
  const int32_t *q_pos, *k_pos;
  float *o, *m, *l;
  int64_t B, T, N, K, S, D, G;
  bool pos_per_head;
  int64_t window;
  float scale;
  int64_t block;
  // int8 codes only: keys scored by integer dot products with each row's query as int8 codes (`IntScoreBlock`), and
  // each value's scale multiplied into its probability instead of into the value (`BlockRows`' step 3)
  bool qscores = false;
  // kvjax_attend_mass: the block masses of the query rows mass_base[b] + mass_rows[0..n_mass) (distinct; those
  // outside [0, T) skipped: a prefill chunk's share of the prompt's last rows, `kvjax.decode.steps.prefill`) over groups of
  // mass_block keys (`groups` per KV head), from each block's probabilities as the online softmax computes them:
  // gsum[(b, i, n), group] sums a group's exp(s - m_blk), gmax[(b, i, n), block] is that m_blk (M_INIT: the row saw
  // nothing there); `MassOut` rescales them by the row's final m and l into mass[b, K, groups].
  const int64_t* mass_rows = nullptr;
  const int32_t* mass_base = nullptr;
  int64_t n_mass = 0, mass_block = 0, groups = 0, nblocks = 0;
  float *mass = nullptr, *gsum = nullptr, *gmax = nullptr;
};

// Row-state of one work unit: un-normalised output, running max and sum, visible position range, query pointer.
struct Rows {
  std::vector<float> o, m, l;
  std::vector<int32_t> lo, hi;
  std::vector<const float*> q;
  std::vector<int64_t> mass;  // per row: its (b, mass row, head) index into gsum / gmax, or -1
  // qscores: per row its query as int8 codes (q8, D each), the f32 factor of its integer scores (qrs: the codes'
  // scale; the softmax scale enters with the exponential) and 128 x the sum of its codes (qcorr: what scoring keys
  // made unsigned adds)
  std::vector<int8_t> q8;
  std::vector<float> qrs;
  std::vector<int32_t> qcorr;
};

// Prefetches two ranges, [k, k + k_left) and [v, v + v_left), into L2 a few lines at a time, alternating between them:
// the next block's keys and values stream in from memory while this block is computed (measured: without it 1-2 rows
// per tile ran 1.3x slower, the key transposition waiting on memory; at many rows the kernel is compute-bound and would
// stall on each new block). Spread over the tiles' inner loops (and the key transposition's) rather than issued as
// one burst per panel: a burst filled the line-fill buffers and stalled the core with nothing to compute (SmolLM2's
// shape at 8K keys, interleaved A/B: 1-9 rows 0.89-0.90x the burst's time, 33 rows 1.01x). Keys and values together
// through the whole block, not the keys while scoring and the values during p.V: two streams in flight keep more of
// the memory system busy (a plain read of a block's keys and values interleaved ran 0.93x the time of keys then values)
// -- SmolLM2's decode attention at 8K, 30 layers, interleaved A/B in one process: 0.92-0.93x the time; a 9-row verify
// block 0.98x; 513 rows unchanged.
struct Prefetch {
  const char *k = nullptr, *v = nullptr;
  int64_t k_left = 0, v_left = 0;
  bool values_next = false;
  // Up to n more lines: called from inside a tile's loop (once per step over d or over keys), so the streams'
  // requests are spread over the computation instead of issued in bursts.
  void Lines(int64_t n) {
#if KVJAX_AVX2
    for (; n > 0 && (k_left > 0 || v_left > 0); --n) {
      if (v_left > 0 && (values_next || k_left <= 0)) {
        _mm_prefetch(v, _MM_HINT_T1);
        v += 64;
        v_left -= 64;
      } else {
        _mm_prefetch(k, _MM_HINT_T1);
        k += 64;
        k_left -= 64;
      }
      values_next = !values_next;
    }
#else
    (void)n;
#endif
  }
  // A step of a tile's loop worth `inc` / 2^16 lines (`Scratch::pf_rate` times the step's work): the whole lines
  // accumulated so far, the fraction kept for the next step.
  void Credit(int64_t inc) {
    credit += inc;
    Lines(credit >> 16);
    credit &= 0xFFFF;
  }
  int64_t credit = 0;
};

// The work of one exponential, in multiply-adds (a score or p.V step is one per lane): what `BlockRows` weighs the
// phases by when it spreads the next block's prefetches over them (Exp2_16 with its load, FMA, store and sum: ~15-17
// vector operations per 16 lanes).
constexpr int64_t kExpWork = 17;
// ... and of moving one key element into the transposed panel (`TransposePanel`, once per block whatever the rows):
// a 16 x 16 step is 16 loads, 64 shuffles and 16 stores for 256 elements. Its share of the lines used to be a fixed 2
// per step, ~6% of a block's lines at D = 32, while the transposition is about a third of a decode row's work; the
// rest ran ahead during the tiles. Measured (per layer of kernel 0, interleaved in one process, the same bits): the
// bundled model's decode attention at 32K (1 row, 4 KV heads, 4 layers) 0.906-0.920x the time by medians with a weight
// of 3 (5: 0.919x, 10: 0.913x); SmolLM2's at 32K 0.920x, at 8K 0.99-1.00x; the 9-row verify 0.96-0.98x (SmolLM2,
// 8K) and 0.98-1.00x (bundled, 32K).
constexpr int64_t kTransposeWork = 3;

// The per-block scratch of one work unit. kT: the block's keys transposed, kT[d * npad + j] (keys past n are 0);
// kp: the block's positions padded with -1 (never visible: lo >= 0); s: scores then probabilities, one row of
// `block` floats per row of the chunk; rmax / vis: per row, 8 lane maxima of its masked scores and whether any key
// of the block is visible to it.
struct Scratch {
  std::vector<float> kT, s, rmax;
  std::vector<int32_t> kq;  // qscores: 16 keys' codes as dwords, transposed (`TransposeCodes16`)
  std::vector<int32_t> kp, vis;
  std::vector<uint8_t> full;  // per row of the chunk: every key of the block is visible to it
  Prefetch* pf = nullptr;     // the streams the tiles now running prefetch from (the next block's keys and values)
  int64_t pf_rate = 0;        // lines per multiply-add of the block's work (`BlockRows`, `kExpWork`), times 2^16
};

// One key block: n keys (up to its last occupied slot; npad = n rounded up to 8, nfull the block's own slots rounded
// up), whether every slot is occupied with n == npad, and the min and max occupied position.
template <typename T>
struct Block {
  const T *k, *v;
  const float *ks = nullptr, *vs = nullptr;  // int8 codes: the block's key and value scales, one per key
  int64_t n, npad, nfull = 0;
  bool dense;
  int32_t pmin, pmax;
  int64_t index = 0, start = 0;  // the block's number and first slot
};

// A group's 8 lane partials: lane i sums p[g0 + i + 8c] over c in order (keys past g1 are not read).
#if KVJAX_AVX2
inline __m256 GroupLanes(const float* p, int64_t g0, int64_t g1) {
  __m256 acc = _mm256_loadu_ps(p + g0);
  for (int64_t j = g0 + 8; j < g1; j += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(p + j));
  return acc;
}
#endif

// A mass row's share of one block's masses (kvjax_attend_mass): per group of mass_block slots, the sum of its
// probabilities p = exp(s - m) (the block's, as p.V reads them: 8 lane partials, then Reduce8's tree, eight groups
// at a time), and the m they are relative to. Reads p only, so the row's (o, m, l) are the plain kernel's bit for bit.
// Measured (the bundled model's 9-row verify attention at 32K, 2 mass rows, 20 calls in one jit, interleaved): 1.022x
// and 1.025x the plain kernel's time; one serial chain per group instead 1.040x.
template <typename T>
inline void GroupSums(const Problem& P, int64_t mi, const Block<T>& blk, const float* p, float m) {
  const int64_t mb = P.mass_block, ng = (blk.npad + mb - 1) / mb;
  float* gs = P.gsum + mi * P.groups + blk.start / mb;
  // the groups past the block's last occupied slot see no key: mass 0 (MassOut reads every group of the block)
  std::fill(gs + ng, gs + std::max(ng, (blk.nfull + mb - 1) / mb), 0.0f);
  int64_t g = 0;
#if KVJAX_AVX2
  for (; g + 8 <= ng; g += 8) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) r[i] = GroupLanes(p, (g + i) * mb, std::min(blk.npad, (g + i + 1) * mb));
    _mm256_storeu_ps(gs + g, Reduce8x8(r));
  }
  for (; g < ng; ++g) {
    alignas(32) float t[8];
    _mm256_store_ps(t, GroupLanes(p, g * mb, std::min(blk.npad, (g + 1) * mb)));
    gs[g] = Reduce8(t);
  }
#else
  for (; g < ng; ++g) {
    float lanes[8];
    const int64_t g0 = g * mb, g1 = std::min(blk.npad, g0 + mb);
    for (int i = 0; i < 8; ++i) {
      lanes[i] = p[g0 + i];
      for (int64_t j = g0 + 8 + i; j < g1; j += 8) lanes[i] += p[j];
    }
    gs[g] = Reduce8(lanes);
  }
#endif
  P.gmax[mi * P.nblocks + blk.index] = m;
}

// Rows handled together against one key block (their scores stay in L2 with the block); any multiple of the row
// tile sizes works, the result does not depend on it.
constexpr int64_t kChunk = 96;

// A tile's rows are split among threads (when its tiles do not divide among them) only from this many rows: a unit
// costs about a + b * rows (a: reading and transposing the tile's keys, b: one row's arithmetic); for 3 tiles on 2
// threads a split wins once rows > 2a/b, ~20-30 rows by the SmolLM2-shape timings (9 rows split ran 1.6x slower).
constexpr int64_t kSplitMinRows = 24;

// Keys per panel: a panel of the block is transposed into kT (PK x D floats, <= 8 KiB at D <= 32) and scored against
// every row tile of the chunk while it sits in L1.
// With AVX-512, for more than one row tile, a panel of 64 keys up to D = 64 (16 KiB): four 16-key registers per
// score tile (measured, SmolLM2's shape at 8K: 33 rows 0.98x, 256 rows 0.96x the time of 32-key panels; for a single
// row tile, where the panel is scored once, 32-key panels were 2-6% faster). The panel never changes a score's chain.
inline int64_t PanelKeys(int64_t D, int64_t rows) {
#if KVJAX_AVX2 && defined(__AVX512F__)
  if (rows > 6) return D <= 64 ? 64 : 32;
#else
  (void)rows;
#endif
  return D <= 32 ? 64 : 32;
}

#if KVJAX_AVX2
// 4 consecutive elements as f32 lanes (Load8 and Load16: simd.h).
inline __m128 Load4(const float* p) { return _mm_loadu_ps(p); }
inline __m128 Load4(const uint16_t* p) {
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}
#endif

// Key or value j's element as f32: widened, and for int8 codes times the key's scale (one f32 product, the value
// `codes.astype(f32) * scale[..., None]` holds).
template <typename T>
inline float Value(const T* p, const float* sc, int64_t j) {
  if constexpr (std::is_same_v<T, int8_t>) return sc == nullptr ? Widen(*p) : Widen(*p) * sc[j];  // qscores: none
  (void)sc;
  (void)j;
  return Widen(*p);
}

#if KVJAX_AVX512
// The 16 x 16 transpose of r (r[i]: row i's 16 lanes): column c (lane c of every row) stored at out + c * ld. Data
// movement only; inlined into both transposes' loops, as it was written there before.
__attribute__((always_inline)) inline void Transpose16x16(const __m512* r, float* out, int64_t ld) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i+1 interleaved at columns 4L, 4L+1 / 4L+2, 4L+3
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // u[4g + c], lane L: rows 4g..4g+3 at column 4L + c
    u[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {  // column 4L + c: lane g of it is lane L of u[4g + c]
    const __m512 a = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88), b = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);
    const __m512 a2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 b2 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    _mm512_storeu_ps(out + c * ld, _mm512_shuffle_f32x4(a, a2, 0x88));         // column c
    _mm512_storeu_ps(out + (4 + c) * ld, _mm512_shuffle_f32x4(b, b2, 0x88));   // column 4 + c
    _mm512_storeu_ps(out + (8 + c) * ld, _mm512_shuffle_f32x4(a, a2, 0xDD));   // column 8 + c
    _mm512_storeu_ps(out + (12 + c) * ld, _mm512_shuffle_f32x4(b, b2, 0xDD));  // column 12 + c
  }
}
#endif

// Whether `TransposePanel` moves keys in 16 x 16 steps (AVX-512, D a multiple of 16): the only steps that issue the
// next block's lines, so the only case whose transposition counts in `BlockRows`' prefetch rate.
constexpr bool TransposeSteps16(int64_t D) { return KVJAX_AVX512 && D % 16 == 0; }

// Transposes keys [0, n) (kb: n x D, f32, bf16 or int8 codes with scales ks) into kT[d * ld + j] as f32,
// zero-padding columns [n, ld); each 16 x 16 step issues its share of `pf`'s lines (`Prefetch::Credit`, weighted by
// `kTransposeWork`), as the tiles do.
template <typename T>
inline void TransposePanel(const T* kb, const float* ks, int64_t n, int64_t D, int64_t ld, float* kT,
                           Prefetch& pf_io, int64_t pf_rate) {
  Prefetch pf = pf_io;  // in registers for the loop
  int64_t j = 0;
#if KVJAX_AVX512
  // 16 keys x 16 dims per step where the CPU has AVX-512: half the instructions per value of the 8 x 8 steps below,
  // whose shuffles were a few-row call's largest cost after its FMAs (a 9-row verify scores each block's keys against
  // 27 rows per KV head only, so the transposition is not amortised as at 256 rows). Data movement only: the same kT.
  if (TransposeSteps16(D)) {
    for (; j + 16 <= n; j += 16) {
      const T* k0 = kb + j * D;
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        pf.Credit(pf_rate * 256 * kTransposeWork);
        __m512 r[16];
        for (int i = 0; i < 16; ++i) {
          r[i] = Load16(k0 + i * D + d0);  // key j + i's values of d0..d0+15
          if constexpr (std::is_same_v<T, int8_t>) r[i] = _mm512_mul_ps(r[i], _mm512_set1_ps(ks[j + i]));
        }
        Transpose16x16(r, kT + d0 * ld + j, ld);
      }
    }
  }
#endif
#if KVJAX_AVX2
  if (D % 8 == 0) {
    for (; j + 8 <= n; j += 8) {
      const T* k0 = kb + j * D;
      for (int64_t d0 = 0; d0 < D; d0 += 8) {
        // r[i] = [key i, d0..d0+3 | key i+4, d0..d0+3], r[4+i] the same for d0+4..d0+7: a 4x4 transpose within
        // each 128-bit half then gives the 8 keys of one d per register.
        __m256 r[8];
        if constexpr (!std::is_same_v<T, float>) {
          // bf16 or int8: one load-and-widen per key (its 8 values of d0..d0+7; codes times the key's scale), then
          // the halves paired across keys i, i+4
          __m256 w[8];
          for (int i = 0; i < 8; ++i) {
            w[i] = Load8(k0 + i * D + d0);
            if constexpr (std::is_same_v<T, int8_t>) w[i] = _mm256_mul_ps(w[i], _mm256_set1_ps(ks[j + i]));
          }
          for (int i = 0; i < 4; ++i) {
            r[i] = _mm256_permute2f128_ps(w[i], w[i + 4], 0x20);
            r[4 + i] = _mm256_permute2f128_ps(w[i], w[i + 4], 0x31);
          }
        } else {
          for (int i = 0; i < 4; ++i) {
            r[i] = _mm256_insertf128_ps(_mm256_castps128_ps256(Load4(k0 + i * D + d0)),
                                        Load4(k0 + (i + 4) * D + d0), 1);
            r[4 + i] = _mm256_insertf128_ps(_mm256_castps128_ps256(Load4(k0 + i * D + d0 + 4)),
                                            Load4(k0 + (i + 4) * D + d0 + 4), 1);
          }
        }
        for (int h = 0; h < 2; ++h) {
          __m256* x = r + 4 * h;
          const __m256 t0 = _mm256_unpacklo_ps(x[0], x[1]), t1 = _mm256_unpackhi_ps(x[0], x[1]);
          const __m256 t2 = _mm256_unpacklo_ps(x[2], x[3]), t3 = _mm256_unpackhi_ps(x[2], x[3]);
          float* out = kT + (d0 + 4 * h) * ld + j;
          _mm256_storeu_ps(out, _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)));
          _mm256_storeu_ps(out + ld, _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)));
          _mm256_storeu_ps(out + 2 * ld, _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)));
          _mm256_storeu_ps(out + 3 * ld, _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)));
        }
      }
    }
  }
#endif
  pf_io = pf;  // (the 8 x 8 steps issue none: measured on AVX-512 only)
  for (int64_t d = 0; d < D; ++d)
    for (int64_t jj = j; jj < ld; ++jj) kT[d * ld + jj] = jj < n ? Value(kb + jj * D + d, ks, jj) : 0.0f;
}

#if KVJAX_AVX2
// ------------------------------------------------------------------------------------------------ AVX2 tiles
// Tile loops are unrolled completely: an accumulator array indexed by a loop variable the compiler did not unroll
// lives in memory, and the accumulators were stored to the stack on every step of the d loop.
#define KVJAX_UNROLL _Pragma("GCC unroll 16")
// Scores of R rows against V vectors of 8 keys (kt: kT at the first key), masked, stored, and folded into the rows'
// lane maxima. Each (row, key) is ONE chain over d in order: q[0] * k[0], then fma(q[d], k[d], .) for d = 1..D-1,
// unscaled (`BlockRows` scales it inside the exponential) -- no horizontal reduction, and the same arithmetic
// whatever R, V or the tile a row lands in.
template <int R, int V>
inline void ScoreTile(const float* const* q, const float* kt, int64_t ld, int64_t D, const int32_t* kp,
                      const int32_t* lo, const int32_t* hi, const uint8_t* full, float* const* s, float* rmax,
                      int32_t* vis, Prefetch& pf_io, int64_t pf_rate) {
  Prefetch pf = pf_io;  // in registers for the d loop (a reference's fields went through memory every step)
  const int64_t inc = pf_rate * R * 8 * V;  // a step over d: R x 8V multiply-adds
  __m256 acc[R][V];
  {
    __m256 kv[V];
    KVJAX_UNROLL
    for (int v = 0; v < V; ++v) kv[v] = _mm256_loadu_ps(kt + 8 * v);
    KVJAX_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(q[r]);
      KVJAX_UNROLL
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_mul_ps(b, kv[v]);
    }
  }
  for (int64_t d = 1; d < D; ++d) {
    pf.Credit(inc);
    const float* kd = kt + d * ld;
    __m256 kv[V];
    KVJAX_UNROLL
    for (int v = 0; v < V; ++v) kv[v] = _mm256_loadu_ps(kd + 8 * v);
    KVJAX_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m256 b = _mm256_broadcast_ss(q[r] + d);
      KVJAX_UNROLL
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(b, kv[v], acc[r][v]);
    }
  }
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  KVJAX_UNROLL
  for (int r = 0; r < R; ++r) {
    __m256 mx = _mm256_loadu_ps(rmax + 8 * r);
    if (full[r]) {  // every key of the block visible to this row: masking would change nothing
      KVJAX_UNROLL
      for (int v = 0; v < V; ++v) {
        _mm256_storeu_ps(s[r] + 8 * v, acc[r][v]);
        mx = _mm256_max_ps(mx, acc[r][v]);
      }
      _mm256_storeu_ps(rmax + 8 * r, mx);
      vis[r] = 1;
      continue;
    }
    const __m256i vlo = _mm256_set1_epi32(lo[r] - 1), vhi = _mm256_set1_epi32(hi[r] + 1);
    int bits = 0;
    KVJAX_UNROLL
    for (int v = 0; v < V; ++v) {
      const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + 8 * v));
      const __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(p, vlo), _mm256_cmpgt_epi32(vhi, p));
      const __m256 sv = _mm256_blendv_ps(ninf, acc[r][v], _mm256_castsi256_ps(ok));
      bits |= _mm256_movemask_ps(_mm256_castsi256_ps(ok));
      _mm256_storeu_ps(s[r] + 8 * v, sv);
      mx = _mm256_max_ps(mx, sv);
    }
    _mm256_storeu_ps(rmax + 8 * r, mx);
    vis[r] |= bits;
  }
  pf_io = pf;
}

#if KVJAX_AVX512
// ScoreTile on 16 keys per register (V vectors of 16 keys): each lane the same chain over d as the 8-key tile, the
// mask a lane mask, the tile's maxima folded into the row's 8 lane maxima (a max is exact in any order).
template <int R, int V>
inline void ScoreTile16(const float* const* q, const float* kt, int64_t ld, int64_t D, const int32_t* kp,
                        const int32_t* lo, const int32_t* hi, const uint8_t* full, float* const* s, float* rmax,
                        int32_t* vis, Prefetch& pf_io, int64_t pf_rate) {
  Prefetch pf = pf_io;  // in registers for the d loop (a reference's fields went through memory every step)
  const int64_t inc = pf_rate * R * 16 * V;  // a step over d: R x 16V multiply-adds
  __m512 acc[R][V];
  {
    __m512 kv[V];
    KVJAX_UNROLL
    for (int v = 0; v < V; ++v) kv[v] = _mm512_loadu_ps(kt + 16 * v);
    KVJAX_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(q[r][0]);
      KVJAX_UNROLL
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_mul_ps(b, kv[v]);
    }
  }
  for (int64_t d = 1; d < D; ++d) {
    pf.Credit(inc);
    const float* kd = kt + d * ld;
    __m512 kv[V];
    KVJAX_UNROLL
    for (int v = 0; v < V; ++v) kv[v] = _mm512_loadu_ps(kd + 16 * v);
    KVJAX_UNROLL
    for (int r = 0; r < R; ++r) {
      const __m512 b = _mm512_set1_ps(q[r][d]);
      KVJAX_UNROLL
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(b, kv[v], acc[r][v]);
    }
  }
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  KVJAX_UNROLL
  for (int r = 0; r < R; ++r) {
    __m512 mx = ninf;
    if (full[r]) {  // every key of the block visible to this row: masking would change nothing
      KVJAX_UNROLL
      for (int v = 0; v < V; ++v) {
        _mm512_storeu_ps(s[r] + 16 * v, acc[r][v]);
        mx = _mm512_max_ps(mx, acc[r][v]);
      }
      vis[r] = 1;
    } else {
      const __m512i vlo = _mm512_set1_epi32(lo[r] - 1), vhi = _mm512_set1_epi32(hi[r] + 1);
      int bits = 0;
      KVJAX_UNROLL
      for (int v = 0; v < V; ++v) {
        const __m512i p = _mm512_loadu_si512(kp + 16 * v);
        const __mmask16 ok = _mm512_cmpgt_epi32_mask(p, vlo) & _mm512_cmpgt_epi32_mask(vhi, p);
        const __m512 sv = _mm512_mask_mov_ps(ninf, ok, acc[r][v]);
        bits |= ok;
        _mm512_storeu_ps(s[r] + 16 * v, sv);
        mx = _mm512_max_ps(mx, sv);
      }
      vis[r] |= bits;
    }
    const __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(mx), _mm512_extractf32x8_ps(mx, 1));
    _mm256_storeu_ps(rmax + 8 * r, _mm256_max_ps(_mm256_loadu_ps(rmax + 8 * r), m8));
  }
  pf_io = pf;
}
#endif

// p = 2^fma(s, c, -mt) over npad scores in place (`Exp2_16`; masked scores, -inf, give exactly 0); returns their sum:
// 16 lane partials, lane i summing slots j = i (mod 16) in slot order, then lanes i and i + 8 added and Reduce8's tree.
// Sixteen partials, not eight: one add per 16 exponentials in the loop's chain instead of two dependent ones
// (measured, the bundled model's 9-row verify attention at 32K, interleaved: 0.98-0.99x the time).
inline float ExpSum(float* s, int64_t npad, float c, float mt, Prefetch& pf_io, int64_t pf_rate) {
  Prefetch pf = pf_io;  // in registers for the loop
  const __m256 vc = _mm256_set1_ps(c), vmt = _mm256_set1_ps(-mt);
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // lanes 0-7 and 8-15
  int64_t j = 0;
#if KVJAX_AVX512
  const __m512 vc16 = _mm512_set1_ps(c), vmt16 = _mm512_set1_ps(-mt);
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= npad; j += 16) {
    pf.Credit(pf_rate * 16 * kExpWork);
    const __m512 p = Exp2_16(_mm512_fmadd_ps(_mm512_loadu_ps(s + j), vc16, vmt16));
    _mm512_storeu_ps(s + j, p);
    acc = _mm512_add_ps(acc, p);
  }
  lo = _mm512_castps512_ps256(acc);
  hi = _mm512_extractf32x8_ps(acc, 1);
#endif
  for (; j < npad; j += 8) {  // 8 slots at j: lanes 0-7 where j = 0 (mod 16), else 8-15
    pf.Credit(pf_rate * 8 * kExpWork);
    const __m256 p = Exp2_8(_mm256_fmadd_ps(_mm256_loadu_ps(s + j), vc, vmt));  // masked (-inf) scores: exactly 0
    _mm256_storeu_ps(s + j, p);
    if (j % 16 == 0)
      lo = _mm256_add_ps(lo, p);
    else
      hi = _mm256_add_ps(hi, p);
  }
  pf_io = pf;
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(lo, hi));
  return Reduce8(t);
}

// o = alpha * o (when first) then o += p[j] * v[j] for j in [0, m) in slot order, for R rows and CC registers of
// L::kWidth columns (o, vb offset to the first column). One FMA chain per (row, column) over j: neither the tile
// shape nor the register width changes a row's arithmetic.
template <typename L, int R, int CC, typename T>
inline void PVTile(float* const* o, bool first, const float* alpha, const float* const* p, const T* vb,
                   const float* vs, int64_t m, int64_t D, Prefetch& pf_io, int64_t pf_rate) {
  Prefetch pf = pf_io;  // in registers for the j loop
  using V = typename L::V;
  constexpr int W = L::kWidth;
  const int64_t inc = pf_rate * R * CC * W;  // a key: R x CC W multiply-adds
  V acc[R][CC];
  KVJAX_UNROLL
  for (int r = 0; r < R; ++r) {
    const V va = L::Set1(alpha[r]);
    KVJAX_UNROLL
    for (int c = 0; c < CC; ++c) {
      acc[r][c] = L::LoadF(o[r] + W * c);
      if (first) acc[r][c] = L::Mul(va, acc[r][c]);
    }
  }
  for (int64_t j = 0; j < m; ++j) {
    pf.Credit(inc);
    V vv[CC];
    KVJAX_UNROLL
    for (int c = 0; c < CC; ++c) {
      vv[c] = L::Load(vb + j * D + W * c);
      if constexpr (std::is_same_v<T, int8_t>)
        if (vs != nullptr) vv[c] = L::Mul(vv[c], L::Set1(vs[j]));  // codes x the value's scale (qscores: in p)
      L::Pin(vv[c]);  // one load (and widening) per value register, shared by the R rows (not folded into each FMA)
    }
    KVJAX_UNROLL
    for (int r = 0; r < R; ++r) {
      const V pj = L::Set1(p[r][j]);
      KVJAX_UNROLL
      for (int c = 0; c < CC; ++c) acc[r][c] = L::Fma(pj, vv[c], acc[r][c]);
    }
  }
  KVJAX_UNROLL
  for (int r = 0; r < R; ++r)
    KVJAX_UNROLL
    for (int c = 0; c < CC; ++c) L::Store(o[r] + W * c, acc[r][c]);
  pf_io = pf;
}

// Scores of rows act[a0 .. a0 + R) against the key vectors [v0, v1) of the block (v1 - v0 a multiple of V); the
// panel in W.kT starts at key vector p0 and has row stride ld.
// (Not inlined: in one function with the rest of the block's work the compiler spilled the accumulators.)
template <int R, int V>
__attribute__((noinline)) void ScoreRows(const Problem& P, const Rows& R_, const int64_t* act, int64_t a0, int64_t v0,
                                         int64_t v1, Scratch& W, int64_t p0, int64_t ld) {
  const float* q[R];
  int32_t lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = act[a0 + r];
    q[r] = R_.q[row];
    lo[r] = R_.lo[row];
    hi[r] = R_.hi[row];
  }
  for (int64_t v = v0; v < v1; v += V) {
    float* s[R];
    for (int r = 0; r < R; ++r) s[r] = W.s.data() + (a0 + r) * P.block + 8 * v;
    ScoreTile<R, V>(q, W.kT.data() + 8 * (v - p0), ld, P.D, W.kp.data() + 8 * v, lo, hi,
                    W.full.data() + a0, s, W.rmax.data() + 8 * a0, W.vis.data() + a0, *W.pf, W.pf_rate);
  }
}

// Row tile -> key vectors per tile: R * V <= 12 accumulators, plus V key registers and a broadcast (4 divides a
// panel's vectors).
template <int R>
constexpr int kScoreV = R >= 4 ? 2 : 4;

#if KVJAX_AVX512
// ScoreRows on 16-key registers: key vectors [v0, v1) of 8 keys, v1 - v0 a multiple of 2 * V.
template <int R, int V>
__attribute__((noinline)) void ScoreRows16(const Problem& P, const Rows& R_, const int64_t* act, int64_t a0,
                                           int64_t v0, int64_t v1, Scratch& W, int64_t p0, int64_t ld) {
  const float* q[R];
  int32_t lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    const int64_t row = act[a0 + r];
    q[r] = R_.q[row];
    lo[r] = R_.lo[row];
    hi[r] = R_.hi[row];
  }
  for (int64_t v = v0; v < v1; v += 2 * V) {
    float* s[R];
    for (int r = 0; r < R; ++r) s[r] = W.s.data() + (a0 + r) * P.block + 8 * v;
    ScoreTile16<R, V>(q, W.kT.data() + 8 * (v - p0), ld, P.D, W.kp.data() + 8 * v, lo, hi,
                      W.full.data() + a0, s, W.rmax.data() + 8 * a0, W.vis.data() + a0, *W.pf, W.pf_rate);
  }
}

#endif

template <int R>
inline void ScorePanel(const Problem& P, const Rows& R_, const int64_t* act, int64_t a0, int64_t v0, int64_t v1,
                       Scratch& W, int64_t ld) {
  const int64_t p0 = v0;  // the panel's first key vector (kT's column 0)
#if KVJAX_AVX512
  {
    // tiles of 4 16-key registers (R * 4 <= 24 accumulators of 32), then 2, then 1; the rest (a ragged last block's
    // last 8 keys) as an 8-key vector below
    const int64_t va = v0 + (v1 - v0) / 8 * 8, vb = va + (v1 - va) / 4 * 4, vc = vb + (v1 - vb) / 2 * 2;
    // (an empty range skips its call: each call first gathers its rows' pointers and positions)
    if (va > v0) ScoreRows16<R, 4>(P, R_, act, a0, v0, va, W, p0, ld);
    if (vb > va) ScoreRows16<R, 2>(P, R_, act, a0, va, vb, W, p0, ld);
    if (vc > vb) ScoreRows16<R, 1>(P, R_, act, a0, vb, vc, W, p0, ld);
    v0 = vc;
    if (v0 == v1) return;
  }
#endif
  constexpr int V = kScoreV<R>;
  const int64_t vfull = v0 + (v1 - v0) / V * V;
  if (vfull > v0) ScoreRows<R, V>(P, R_, act, a0, v0, vfull, W, p0, ld);
  if (v1 > vfull) ScoreRows<R, 1>(P, R_, act, a0, vfull, v1, W, p0, ld);  // a ragged last block
}

// p.V of rows live[i0 .. i0 + R) (indices into the chunk) over keys [j0, j0 + m) of the block.
template <int R, typename T>
__attribute__((noinline)) void PVRows(const Problem& P, Rows& R_, const int64_t* act, const int64_t* live, int64_t i0, Scratch& W,
                   const float* alpha, const T* vb, const float* vs, int64_t j0, int64_t m, bool first) {
  const int64_t D = P.D, C = D / 8;
  float* o[R];
  const float* p[R];
  float al[R];
  for (int r = 0; r < R; ++r) {
    const int64_t a = live[i0 + r];
    o[r] = R_.o.data() + act[a] * D;
    p[r] = W.s.data() + a * P.block + j0;
    al[r] = alpha[a];
  }
  constexpr int CC = R >= 4 ? 2 : 4;  // R * CC <= 12 accumulators
  const float* vsj = vs == nullptr ? nullptr : vs + j0;  // int8 codes: the sub-block's value scales
  int64_t c = 0;
  auto shifted = [&](int64_t c0, float** out) {
    for (int r = 0; r < R; ++r) out[r] = o[r] + 8 * c0;
  };
  float* oc[R];
#if KVJAX_AVX512
  constexpr int CW = 4;  // 16-column registers per tile: R * CW <= 24 accumulators of 32
  for (; c + 2 * CW <= C; c += 2 * CW) {
    shifted(c, oc);
    PVTile<Lanes16, R, CW>(oc, first, al, p, vb + j0 * D + 8 * c, vsj, m, D, *W.pf, W.pf_rate);
  }
  // 32 columns per tile where 64 do not fit (D = 32: the tiny model's heads): each p[r][j] broadcast once for both
  // registers (one register per tile loaded a value and broadcast a probability per FMA: the tiny model's 9-row verify
  // at 32K spent over a quarter of its attention here)
  for (; c + 4 <= C; c += 4) {
    shifted(c, oc);
    PVTile<Lanes16, R, 2>(oc, first, al, p, vb + j0 * D + 8 * c, vsj, m, D, *W.pf, W.pf_rate);
  }
  for (; c + 2 <= C; c += 2) {
    shifted(c, oc);
    PVTile<Lanes16, R, 1>(oc, first, al, p, vb + j0 * D + 8 * c, vsj, m, D, *W.pf, W.pf_rate);
  }
#endif
  for (; c + CC <= C; c += CC) {
    shifted(c, oc);
    PVTile<Lanes8, R, CC>(oc, first, al, p, vb + j0 * D + 8 * c, vsj, m, D, *W.pf, W.pf_rate);
  }
  for (; c < C; ++c) {
    shifted(c, oc);
    PVTile<Lanes8, R, 1>(oc, first, al, p, vb + j0 * D + 8 * c, vsj, m, D, *W.pf, W.pf_rate);
  }
  for (int r = 0; r < R; ++r)  // columns past the last whole vector (D % 8): the same chain, one lane at a time
    for (int64_t d = 8 * C; d < D; ++d) {
      float acc = first ? al[r] * o[r][d] : o[r][d];
      for (int64_t j = 0; j < m; ++j) acc = std::fma(p[r][j], Value(vb + (j0 + j) * D + d, vsj, j), acc);
      o[r][d] = acc;
    }
}

template <template <int> class F, typename... A>
inline void ByRows(int64_t r, A&&... a) {
  switch (r) {
    case 6: return F<6>::run(a...);
    case 5: return F<5>::run(a...);
    case 4: return F<4>::run(a...);
    case 3: return F<3>::run(a...);
    case 2: return F<2>::run(a...);
    default: return F<1>::run(a...);
  }
}
template <int R>
struct ScorePanelF {
  template <typename... A>
  static void run(A&&... a) { ScorePanel<R>(a...); }
};
template <int R>
struct PVRowsF {
  template <typename... A>
  static void run(A&&... a) { PVRows<R>(a...); }
};
constexpr int64_t kRowTile = 6;
#endif

// ------------------------------------------------------------------------------------------------ scoring a block
// Key j's score sv for row `row` (the chunk's a-th active row), as the vector tiles leave it: masked to -inf where
// the row cannot see the key, stored, folded into the row's lane j % 8 maximum and its visibility.
inline void StoreScore(const Problem& P, const Rows& R, Scratch& W, int64_t a, int64_t row, int64_t j, float sv) {
  const bool ok = W.kp[j] >= R.lo[row] && W.kp[j] <= R.hi[row];
  if (!ok) sv = -INFINITY;
  W.vis[a] |= ok;
  W.s[a * P.block + j] = sv;
  float& mx = W.rmax[8 * a + j % 8];
  mx = mx > sv ? mx : sv;  // _mm256_max_ps(mx, sv)
}

// ------------------------------------------------------------------------------------------------ integer scores
// A row's query as int8 codes for integer scores (qscores): amax = max |q|, codes round(q * (127 / amax)) (nearest,
// ties to even), the row's factor amax / 127. A key's score (before the softmax scale, as the float path's) is then
// ((float)(codes . key codes) * factor) * key scale: the integer dot product is exact, so its order (and the
// instructions that compute it) never matter.
inline void QuantizeRow(const float* q, int64_t D, int8_t* q8, float* rs, int32_t* corr) {
  float amax = 0.0f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(q[d]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t d = 0; d < D; ++d) {
    const float c = std::nearbyint(q[d] * inv);
    const int32_t v = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, c)));
    q8[d] = static_cast<int8_t>(v);
    sum += v;
  }
  *rs = amax / 127.0f;
  *corr = 128 * sum;
}

// A row's score for one key from their integer dot product (unmasked; `IntScoreBlock` masks it).
inline float IntScore(const int8_t* q8, const int8_t* kr, int64_t D, float rs, float ks) {
  int32_t acc = 0;
  for (int64_t d = 0; d < D; ++d) acc += static_cast<int32_t>(q8[d]) * static_cast<int32_t>(kr[d]);
  return (static_cast<float>(acc) * rs) * ks;
}

#if KVJAX_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define KVJAX_ATT_VNNI 1
// The head sizes the tiles take: multiples of 32 dims (64-dim chunks, then at most one half chunk).
constexpr int64_t kIntTileDims = 32;
// 16 keys' codes (k0: 16 x D, D % 32 == 0), each byte + 128 (unsigned, as vpdpbusd reads them), as dwords
// transposed: kq[g * 16 + i] holds key i's dims 4g .. 4g + 3 (kq holds 256 dwords per 64 dims, a last 32 as 64 whose
// upper half is zero).
inline void TransposeCodes16(const int8_t* k0, int64_t D, int32_t* kq) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(-128));
  for (int64_t c = 0; c * 64 < D; ++c) {
    __m512 r[16];
    if (D - 64 * c >= 64) {
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_loadu_si512(k0 + i * D + 64 * c), flip));
    } else {  // 32 dims: the upper 8 dwords of each row, and so rows 8-15 of the transpose, are zero (not read)
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_castsi512_ps(_mm512_zextsi256_si512(
            _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(k0 + i * D + 64 * c)),
                             _mm512_castsi512_si256(flip))));
    }
    Transpose16x16(r, reinterpret_cast<float*>(kq + c * 256), 16);
  }
}

// Integer scores of R rows against 16 keys (kq: TransposeCodes16's), then as ScoreTile16 ends: masked, stored,
// folded into the rows' 8 lane maxima.
template <int R>
__attribute__((noinline)) void IntScoreTile(const Rows& R_, const int64_t* act, int64_t a0, const int32_t* kq,
                                            int64_t D, const float* ks, const int32_t* kp, const uint8_t* full,
                                            float* const* s, float* rmax, int32_t* vis) {
  const int8_t* q8[R];
  __m512i acc[R];
  KVJAX_UNROLL
  for (int r = 0; r < R; ++r) {
    q8[r] = R_.q8.data() + act[a0 + r] * D;
    acc[r] = _mm512_setzero_si512();
  }
  // dword group g (dims 4g .. 4g + 3) of the 16 keys, for every row
  auto group = [&](int64_t g) __attribute__((always_inline)) {
    const __m512i kv = _mm512_loadu_si512(kq + g * 16);
    KVJAX_UNROLL
    for (int r = 0; r < R; ++r) {
      int32_t qd;
      std::memcpy(&qd, q8[r] + 4 * g, 4);
      acc[r] = _mm512_dpbusd_epi32(acc[r], kv, _mm512_set1_epi32(qd));
    }
  };
  for (int64_t c = 0; c < D / 64; ++c) {
    KVJAX_UNROLL
    for (int g = 0; g < 16; ++g) group(16 * c + g);
  }
  if (D % 64) {  // a last 32 dims: 8 groups
    KVJAX_UNROLL
    for (int g = 0; g < 8; ++g) group(D / 64 * 16 + g);
  }
  const __m512 ksv = _mm512_loadu_ps(ks);
  const __m512i p = _mm512_loadu_si512(kp);
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  KVJAX_UNROLL
  for (int r = 0; r < R; ++r) {
    const int64_t row = act[a0 + r];
    const __m512i idot = _mm512_sub_epi32(acc[r], _mm512_set1_epi32(R_.qcorr[row]));
    __m512 sv = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(idot), _mm512_set1_ps(R_.qrs[row])), ksv);
    if (full[r]) {
      vis[r] = 1;
    } else {
      const __mmask16 ok = _mm512_cmpgt_epi32_mask(p, _mm512_set1_epi32(R_.lo[row] - 1)) &
                           _mm512_cmpgt_epi32_mask(_mm512_set1_epi32(R_.hi[row] + 1), p);
      sv = _mm512_mask_blend_ps(ok, ninf, sv);
      vis[r] |= ok != 0;
    }
    _mm512_storeu_ps(s[r], sv);
    const __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(sv), _mm512_extractf32x8_ps(sv, 1));  // a max: any order
    _mm256_storeu_ps(rmax + 8 * r, _mm256_max_ps(_mm256_loadu_ps(rmax + 8 * r), m8));
  }
}
template <int R>
struct IntScoreF {
  template <typename... A>
  static void run(A&&... a) { IntScoreTile<R>(a...); }
};
#else
#define KVJAX_ATT_VNNI 0
constexpr int64_t kIntTileDims = 0;  // no tiles: the plain integer loop for every head size
#endif

// Step 1 of BlockRows for int8 keys under qscores: every active row's integer scores against the block, masked, with
// the rows' lane maxima and visibility as the float path leaves them. Each 16-key group issues the next block's lines
// in proportion to its multiply-adds (`Prefetch::Credit`, as the float tiles), not the group's whole share of them:
// those put every line in flight during the scores, leaving memory idle through the exponentials and p.V. Measured
// (SmolLM2's draft attention at 8K: 2,048 int8 slots per KV head plus a 256-slot f32 ring, 30 layers in one jit,
// interleaved, the same bits): 0.935x, 0.93-0.95x and 0.976x the time by medians; the bundled model's shape at 32K
// (4 layers, which stay in cache) 0.96x and 0.98x.
inline void IntScoreBlock(const Problem& P, const Rows& R, const int64_t* act, int64_t na, Scratch& W,
                          const Block<int8_t>& blk, Prefetch& next) {
  const int64_t D = P.D, n = blk.n, npad = blk.npad;
  int64_t j = 0;
#if KVJAX_ATT_VNNI
  if (D % kIntTileDims == 0) {
    W.kq.resize(256 * ((D + 63) / 64));
    const int64_t inc = W.pf_rate * 16 * na * D;  // a group's scores: 16 keys x na rows x D multiply-adds
    for (; j + 16 <= n; j += 16) {
      next.Credit(inc);
      TransposeCodes16(blk.k + j * D, D, W.kq.data());
      for (int64_t a0 = 0; a0 < na; a0 += kRowTile) {
        const int64_t rt = std::min(kRowTile, na - a0);
        float* s[kRowTile];
        for (int64_t r = 0; r < rt; ++r) s[r] = W.s.data() + (a0 + r) * P.block + j;
        ByRows<IntScoreF>(rt, R, act, a0, W.kq.data(), D, blk.ks + j, W.kp.data() + j, W.full.data() + a0, s,
                          W.rmax.data() + 8 * a0, W.vis.data() + a0);
      }
    }
  }
#else
  (void)next;
#endif
  for (int64_t a = 0; a < na; ++a) {
    const int64_t row = act[a];
    const int8_t* q8 = R.q8.data() + row * D;
    for (int64_t jj = j; jj < npad; ++jj)  // keys past n score 0 (the float path's zero padding), then masked
      StoreScore(P, R, W, a, row, jj, jj < n ? IntScore(q8, blk.k + jj * D, D, R.qrs[row], blk.ks[jj]) : 0.0f);
  }
}

// Step 1 of BlockRows: every active row's scores against the block, masked, with its 8 lane maxima and whether it
// sees a key -- a panel of keys, transposed into L1, against every row tile of the chunk.
template <typename T>
inline void ScoreBlock(const Problem& P, const Rows& R, const int64_t* act, int64_t na, Scratch& W,
                       const Block<T>& blk, Prefetch& next) {
  const int64_t D = P.D, n = blk.n, npad = blk.npad;
#if KVJAX_AVX2
  const int64_t PK = PanelKeys(D, na);
  for (int64_t j0 = 0; j0 < npad; j0 += PK) {
    const int64_t ld = std::min(PK, npad - j0);
    TransposePanel(blk.k + j0 * D, blk.ks == nullptr ? nullptr : blk.ks + j0, std::min(ld, n - j0), D, ld,
                   W.kT.data(), next, W.pf_rate);
    for (int64_t a0 = 0; a0 < na; a0 += kRowTile)
      ByRows<ScorePanelF>(std::min(kRowTile, na - a0), P, R, act, a0, j0 / 8, (j0 + ld) / 8, W, ld);
  }
#else
  (void)next;
  for (int64_t a = 0; a < na; ++a) {
    const int64_t row = act[a];
    const float* q = R.q[row];
    for (int64_t j = 0; j < npad; ++j) {  // keys past n score 0 (the vector path's zero padding), then masked
      float acc = 0.0f;
      if (j < n) {
        const T* kr = blk.k + j * D;
        acc = q[0] * Value(kr, blk.ks, j);
        for (int64_t d = 1; d < D; ++d) acc = std::fma(q[d], Value(kr + d, blk.ks, j), acc);
      }
      StoreScore(P, R, W, a, row, j, acc);
    }
  }
#endif
}

// ------------------------------------------------------------------------------------------------ one key block
// One key block for the rows act[0..na) of a chunk (all of which can see part of it); W.kT / W.kp hold the block.
// Every row gets the same arithmetic whatever na: scores as above, lane maxima, exp and the lane-ordered sum over
// the padded block, p.V in slot order. The scalar build performs the same roundings in the same order.
template <typename T>
void BlockRows(const Problem& P, Rows& R, const int64_t* act, int64_t na, Scratch& W, const Block<T>& blk,
               Prefetch& next) {
  const int64_t D = P.D, BK = P.block, n = blk.n, npad = blk.npad;
  const T* vb = blk.v;
  float alpha[kChunk];
  bool any[kChunk];
  std::fill(W.rmax.begin(), W.rmax.begin() + 8 * na, -INFINITY);
  std::fill(W.vis.begin(), W.vis.begin() + na, 0);
  // The next block's lines, spread evenly over this block's work: scores, exponentials and p.V each issue them in
  // proportion to their arithmetic (`Prefetch::Credit`). Per core, memory delivers only so many lines at once, so a
  // phase that issued none (the exponentials did) left it idle, and the tiles' rounded-up shares issued ~70% of a
  // block's lines during its scores. Measured (interleaved in one process, the same bits): the bundled model's 9-row
  // verify attention at 32K 0.973x the time, SmolLM2's decode attention at 32K 0.965x.
  W.pf = &next;
  const int64_t lines = (next.k_left + next.v_left + 63) / 64;
  // the key transposition's share: only where its 16 x 16 steps issue lines and only where the block's keys are
  // transposed as floats. The 8 x 8 steps issue none: crediting them too, in an AVX2 build of this library here
  // (-mno-avx512f, interleaved, the same bits), ran the bundled model's decode attention at 32K 0.95-0.97x the time but
  // SmolLM2's 1.15x.
  bool credited = TransposeSteps16(D);
  if constexpr (std::is_same_v<T, int8_t>) credited = credited && !P.qscores;
  const int64_t work = na * (npad * (D + kExpWork) + n * D) + (credited ? npad * D * kTransposeWork : 0);
  W.pf_rate = ((lines << 16) + work - 1) / std::max<int64_t>(work, 1);
  for (int64_t a = 0; a < na; ++a) {
    const int64_t r = act[a];
    W.full[a] = blk.dense && R.lo[r] <= blk.pmin && blk.pmax <= R.hi[r];
  }
  // 1. scores, masked, with lane maxima (int8 codes under qscores: integer dot products)
  if constexpr (std::is_same_v<T, int8_t>) {
    if (P.qscores)
      IntScoreBlock(P, R, act, na, W, blk, next);
    else
      ScoreBlock(P, R, act, na, W, blk, next);
  } else {
    ScoreBlock(P, R, act, na, W, blk, next);
  }
  // 2. per row: the online-softmax update (exponentials and their sum over the padded block). The scores are unscaled
  // dot products: p = exp(scale * s - m) = 2^t with t = fma(s, scale * log2 e, -(m * log2 e)), one rounding where
  // scaling, subtracting and the exponential's own multiply by log2 e took three
  const float c = P.scale * kLog2e;
  for (int64_t a = 0; a < na; ++a) {
    const int64_t r = act[a];
    any[a] = W.vis[a] != 0;
    if (!any[a]) continue;
    // the block's maximum score: scaling by a positive factor and rounding are monotone, so the scaled maximum of
    // the unscaled scores is the maximum of the scaled ones
    const float m_new = std::max(R.m[r], Max8(W.rmax.data() + 8 * a) * P.scale);
    alpha[a] = ExpScalar(R.m[r] - m_new);  // finite - finite: m >= M_INIT, m_new a real score
    float* s = W.s.data() + a * BK;
    const float mt = m_new * kLog2e;
#if KVJAX_AVX2
    const float psum = ExpSum(s, npad, c, mt, next, W.pf_rate);
#else
    float lanes[16] = {};  // ExpSum's 16 lane partials
    for (int64_t j = 0; j < npad; ++j) {
      s[j] = Exp2Scalar(std::fma(s[j], c, -mt));  // masked (-inf) scores: exactly 0
      lanes[j % 16] += s[j];
    }
    for (int i = 0; i < 8; ++i) lanes[i] += lanes[i + 8];
    const float psum = Reduce8(lanes);
#endif
    if (R.mass[r] >= 0) GroupSums(P, R.mass[r], blk, s, m_new);
    R.l[r] = alpha[a] * R.l[r] + psum;
    R.m[r] = m_new;
  }
  // 3. p.V: a sub-block of values (32 KiB of f32, 128 keys at D = 64) accumulated into every live row, in slot order
  // per row. Each row tile reloads and stores its accumulators once per sub-block: 8 KiB sub-blocks (32 keys at D = 64)
  // spent ~9% of a tile's work there. Measured (Xeon, 48 KiB L1d; 30 layers of SmolLM2's shape at 8K, interleaved in
  // one process, the same bits): 33 query rows per KV head 0.947x, 171 rows 0.950x, 9 rows 0.97-0.98x, one row 1.00x
  // the time of 8 KiB; the bundled model's 129 rows at 32K 0.964-0.978x. Whole blocks (128 KiB) gained no more. End
  // to end (SmolLM2 8K, the previous library in the same process): the x = 8 verify 0.965x, a decode step 1.006x.
  int64_t live[kChunk], nl = 0;
  for (int64_t a = 0; a < na; ++a)
    if (any[a]) live[nl++] = a;
  // qscores: each probability times its value's scale, once per (row, key), instead of every value element times
  // its scale as it is loaded (the sum l above is of the probabilities themselves)
  const float* vscale = blk.vs;
  if constexpr (std::is_same_v<T, int8_t>) {
    if (P.qscores) {
      for (int64_t i = 0; i < nl; ++i) {
        float* p = W.s.data() + live[i] * BK;
        for (int64_t j = 0; j < n; ++j) p[j] *= blk.vs[j];
      }
      vscale = nullptr;
    }
  }
  const int64_t SUB = std::max<int64_t>(8, 8192 / std::max<int64_t>(D, 1));
  for (int64_t j0 = 0; j0 < n; j0 += SUB) {
    const int64_t m = std::min(SUB, n - j0);
    const bool first = j0 == 0;
#if KVJAX_AVX2
    for (int64_t i0 = 0; i0 < nl; i0 += kRowTile)
      ByRows<PVRowsF>(std::min(kRowTile, nl - i0), P, R, act, live, i0, W, alpha, vb, vscale, j0, m, first);
#else
    for (int64_t i = 0; i < nl; ++i) {
      const int64_t a = live[i];
      float* o = R.o.data() + act[a] * D;
      const float* p = W.s.data() + a * BK + j0;
      for (int64_t d = 0; d < D; ++d) {
        float acc = first ? alpha[a] * o[d] : o[d];
        for (int64_t j = 0; j < m; ++j) acc = std::fma(p[j], Value(vb + (j0 + j) * D + d, vscale, j0 + j), acc);
        o[d] = acc;
      }
    }
#endif
  }
  next.Lines(lines);  // what the rounding left (the next block needs all of it)
}

// One work unit: rows [r0, r1) of tile (b, h), rows numbered r = t * G + g (query head h * G + g), against key
// blocks [i0, i1); its statistics go to (o, m, l), laid out as the call's outputs.
template <typename T>
void RunUnit(const Problem& P, int64_t b, int64_t h, int64_t r0, int64_t r1, int64_t i0, int64_t i1, float* out_o,
             float* out_m, float* out_l) {
  const int64_t S = P.S, D = P.D, G = P.G, BK = P.block;
  const T* kt = static_cast<const T*>(P.k) + (b * P.K + h) * S * D;
  const T* vt = static_cast<const T*>(P.v) + (b * P.K + h) * S * D;
  const int32_t* kp = P.k_pos + (P.pos_per_head ? (b * P.K + h) * S : b * S);
  const int64_t nblocks = (S + BK - 1) / BK;
  // per block: min and max occupied position (max < 0: the block is empty); blocks past the last occupied one are
  // never read.
  std::vector<int32_t> bmin(nblocks), bmax(nblocks);
  std::vector<uint8_t> dense(nblocks);
  // per block: its slots up to the last occupied one -- the keys past it are masked, so reading, scoring and
  // exponentiating them added only exact zeros (a draft's recent ring fills a few slots of its blocks at a time;
  // measured, SmolLM2's draft token at 8K in VeriCache rounds, interleaved: 0.970x the time, the same tokens)
  std::vector<int64_t> filled(nblocks);
  int64_t used = 0;
  for (int64_t i = i0; i < i1; ++i) {
    int32_t mn = INT32_MAX, mx = -1;
    const int64_t j1 = std::min(S, (i + 1) * BK);
    int64_t occupied = 0, last = i * BK - 1;
    int64_t j = i * BK;
#if KVJAX_AVX512
    // 16 positions at a time: a draft's call scans every kept slot's position once per unit (SmolLM2's draft token at
    // 8K in VeriCache rounds, interleaved: 0.967x and 0.982x the time of the one-slot loop below)
    __m512i vmn = _mm512_set1_epi32(INT32_MAX), vmx = _mm512_set1_epi32(-1);
    for (; j + 16 <= j1; j += 16) {
      const __m512i p = _mm512_loadu_si512(kp + j);
      const __mmask16 ok = _mm512_cmpge_epi32_mask(p, _mm512_setzero_si512());
      vmn = _mm512_mask_min_epi32(vmn, ok, vmn, p);
      vmx = _mm512_mask_max_epi32(vmx, ok, vmx, p);
      if (ok) {
        occupied += __builtin_popcount(ok);
        last = j + 31 - __builtin_clz(static_cast<unsigned>(ok));
      }
    }
    mn = _mm512_reduce_min_epi32(vmn);
    mx = _mm512_reduce_max_epi32(vmx);
#endif
    for (; j < j1; ++j) {
      const int32_t p = kp[j];
      if (p >= 0) {
        mn = std::min(mn, p);
        mx = std::max(mx, p);
        ++occupied;
        last = j;
      }
    }
    bmin[i] = mn;
    bmax[i] = mx;
    filled[i] = last + 1 - i * BK;
    dense[i] = occupied == filled[i] && occupied % 8 == 0;
    if (mx >= 0) used = i + 1;
  }
  const int64_t NR = r1 - r0;
  Rows R;
  R.o.assign(NR * D, 0.0f);
  R.m.assign(NR, kMInit);
  R.l.assign(NR, 0.0f);
  R.lo.resize(NR);
  R.hi.resize(NR);
  R.q.resize(NR);
  R.mass.assign(NR, -1);
  for (int64_t r = 0; r < NR; ++r) {
    const int64_t t = (r0 + r) / G, g = (r0 + r) % G;
    for (int64_t i = 0; i < P.n_mass; ++i)
      if (P.mass_base[b] + P.mass_rows[i] == t) R.mass[r] = (b * P.n_mass + i) * P.N + h * G + g;
    const int32_t qp = P.q_pos[b * P.T + t];
    R.hi[r] = qp;
    int64_t low = P.window > 0 ? static_cast<int64_t>(qp) - P.window + 1 : 0;
    R.lo[r] = static_cast<int32_t>(std::max<int64_t>(0, low));
    R.q[r] = P.q + ((b * P.T + t) * P.N + h * G + g) * D;
  }
  if (std::is_same_v<T, int8_t> && P.qscores) {  // each row's query as int8 codes, once per unit
    R.q8.resize(NR * D);
    R.qrs.resize(NR);
    R.qcorr.resize(NR);
    for (int64_t r = 0; r < NR; ++r) QuantizeRow(R.q[r], D, R.q8.data() + r * D, &R.qrs[r], &R.qcorr[r]);
  }
  // The thread's scratch, kept between calls (every element a call reads it writes first): a draft's call of a few
  // rows per head allocated and zero-filled a whole chunk's scores (96 x 256 floats at D = 32) per unit.
  thread_local Scratch W;
  W.kT.resize(D * 64);  // the largest panel (PanelKeys)
  W.kp.resize(BK);
  W.s.resize(std::min(kChunk, NR) * BK);
  W.rmax.resize(8 * kChunk);
  W.vis.resize(kChunk);
  W.full.resize(kChunk);
  std::vector<int64_t> act(NR);
  for (int64_t i = i0; i < used; ++i) {
    if (bmax[i] < 0) continue;
    Block<T> blk;
    const int64_t j0 = i * BK;
    blk.k = kt + j0 * D;
    blk.v = vt + j0 * D;
    blk.n = filled[i];
    blk.npad = (blk.n + 7) / 8 * 8;
    blk.nfull = (std::min(BK, S - j0) + 7) / 8 * 8;
    blk.dense = dense[i];
    blk.pmin = bmin[i];
    blk.pmax = bmax[i];
    blk.index = i;
    blk.start = j0;
    int64_t na = 0;
    for (int64_t r = 0; r < NR; ++r)  // rows that can see something in this block
      if (!(R.hi[r] < R.lo[r] || bmin[i] > R.hi[r] || bmax[i] < R.lo[r])) act[na++] = r;
    if (na == 0) continue;
    for (int64_t j = 0; j < blk.npad; ++j) W.kp[j] = j < blk.n ? kp[j0 + j] : -1;  // -1: never visible (lo >= 0)
    Prefetch next;  // the next block's keys and values, both through this block's scores and p.V
    if (i + 1 < used) {
      const int64_t bytes = std::min(BK, S - j0 - BK) * D * static_cast<int64_t>(sizeof(T));
      next.k = reinterpret_cast<const char*>(blk.k + BK * D);
      next.v = reinterpret_cast<const char*>(blk.v + BK * D);
      next.k_left = next.v_left = bytes;
    }
    if (P.k_scale != nullptr) {  // int8 codes: each key's and value's scale, widened with it (`Value`)
      blk.ks = P.k_scale + (b * P.K + h) * S + j0;
      blk.vs = P.v_scale + (b * P.K + h) * S + j0;
    }
    for (int64_t a0 = 0; a0 < na; a0 += kChunk)
      BlockRows(P, R, act.data() + a0, std::min(kChunk, na - a0), W, blk, next);
  }
  for (int64_t r = 0; r < NR; ++r) {
    const int64_t t = (r0 + r) / G, g = (r0 + r) % G;
    const int64_t qi = (b * P.T + t) * P.N + h * G + g;
    std::memcpy(out_o + qi * D, R.o.data() + r * D, D * sizeof(float));
    out_m[qi] = R.m[r];
    out_l[qi] = R.l[r];
  }
}

// Keys per segment: a row's keys are taken in segments of whole blocks, each segment's statistics computed on its own,
// then merged in segment order (`MergeSegments`). The segments depend only on the cache's capacity and the block,
// never on the rows in the call or the threads, so a row's arithmetic is still fixed by the shape; a cache of at most
// kMinSegmentKeys slots is one segment (the plain online softmax over every block in order).
// Why: one decode row attends each KV head's whole cache; SmolLM2's 3 KV heads on 2 threads left one thread two
// heads' keys (a third of the time the other idled) at one core's bandwidth. Segments give every thread an equal
// share of the keys (flash-decoding's split-K, with a fixed split). Half the capacity, within [1024, 8192] keys: a
// draft's kept part (SmolLM2's 2,016 bf16 slots per head) then takes two segments, not one (its 30 layers as a chain:
// 0.83x the time; 0.77x with its recent ring), while a long full cache takes segments of up to 8,192 keys (1,024 ran
// SmolLM2's 8K decode 1.02x and its 9-row verify 1.04x slower than 2,048: more segments to merge per row). 8,192
// against 2,048, interleaved in one process, two runs each: the bundled model's 9-row verify attention at 32K 0.920x
// and 0.954x the time, its decode 0.952x and 0.935x; SmolLM2's decode at 8K 0.991x, its 9 rows 0.979x; at 32K decode
// 1.034x and 0.982x, 9 rows 1.009x. (16,384, two segments per head: SmolLM2 at 32K 1.020x, 3 KV heads' 6 units
// balancing worse on 2 threads.)
constexpr int64_t kMinSegmentKeys = 1024, kMaxSegmentKeys = 8192;

inline int64_t SegmentBlocks(int64_t block, int64_t capacity) {
  const int64_t keys = std::clamp<int64_t>(capacity / 2, kMinSegmentKeys, kMaxSegmentKeys);
  return std::max<int64_t>(1, keys / std::max<int64_t>(block, 1));
}

// out[qi] from the segments' statistics, in segment order: m the largest m_s; l and o each one FMA chain over the
// segments of (l_s, o_s) x exp(m_s - m) (an empty segment has m_s = M_INIT and l_s = o_s = 0: it adds exactly 0, and
// a row that sees nothing keeps M_INIT, 0, 0). Scalar code in both builds (ExpScalar equals the vector exp).
void MergeSegments(const Problem& P, int64_t nseg, const float* po, const float* pm, const float* pl, int64_t rows_lo,
                   int64_t rows_hi) {
  const int64_t D = P.D, Q = P.B * P.T * P.N;
  std::vector<float> scale(nseg);
  for (int64_t qi = rows_lo; qi < rows_hi; ++qi) {
    float m = kMInit;
    for (int64_t s = 0; s < nseg; ++s) m = std::max(m, pm[s * Q + qi]);
    float l = 0.0f;
    for (int64_t s = 0; s < nseg; ++s) {
      scale[s] = ExpScalar(pm[s * Q + qi] - m);  // finite - finite (M_INIT is -FLT_MAX)
      l = s == 0 ? pl[qi] * scale[0] : std::fma(pl[s * Q + qi], scale[s], l);
    }
    float* o = P.o + qi * D;
    for (int64_t d = 0; d < D; ++d) {
      float acc = po[qi * D + d] * scale[0];
      for (int64_t s = 1; s < nseg; ++s) acc = std::fma(po[(s * Q + qi) * D + d], scale[s], acc);
      o[d] = acc;
    }
    P.m[qi] = m;
    P.l[qi] = l;
  }
}

ffi::Error Solve(ffi::ThreadPool& xla_pool, Problem& P);
void SolveParts(ffi::ThreadPool& xla_pool, const Problem* parts, int nparts);
void MassOut(const Problem& P);

// The problem of one call: shapes checked, pointers set (k's element type is checked by the caller).
ffi::Error ReadProblem(ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v, ffi::Buffer<ffi::S32>& q_pos,
                       ffi::Buffer<ffi::S32>& k_pos, ffi::ResultBuffer<ffi::F32>& o, ffi::ResultBuffer<ffi::F32>& m,
                       ffi::ResultBuffer<ffi::F32>& l, int64_t window, float scale, int64_t block, Problem* out) {
  QKShape sh;
  if (ffi::Error e = ReadQKShape(q.dimensions(), k.dimensions(), k_pos.dimensions(), q_pos.element_count(),
                                 "q_pos must be [B, T]", &sh);
      e.failure())
    return e;
  Problem P;
  P.B = sh.B;
  P.T = sh.T;
  P.N = sh.N;
  P.D = sh.D;
  P.K = sh.K;
  P.S = sh.S;
  P.G = sh.G;
  P.pos_per_head = sh.pos_per_head;
  if (v.dimensions().size() != 4 || v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument("v must have k's shape");
  if (v.element_type() != k.element_type()) return ffi::Error::InvalidArgument("k and v must have one dtype");
  if (block < 8 || block % 8) return ffi::Error::InvalidArgument("block must be a positive multiple of 8");
  // the kernel takes each block's maximum of the unscaled scores, then scales it (`BlockRows`): a monotone map only
  // for a positive scale
  if (!(scale > 0.0f)) return ffi::Error::InvalidArgument("scale must be positive");
  P.q = q.typed_data();
  P.k = k.untyped_data();
  P.v = v.untyped_data();
  P.bf16 = k.element_type() == ffi::DataType::BF16;
  P.q_pos = q_pos.typed_data();
  P.k_pos = k_pos.typed_data();
  P.o = o->typed_data();
  P.m = m->typed_data();
  P.l = l->typed_data();
  P.window = window;
  P.scale = scale;
  P.block = block;
  *out = P;
  return ffi::Error::Success();
}

ffi::Error AttendImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                      ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> k_pos, ffi::ResultBuffer<ffi::F32> o,
                      ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l, int64_t window, float scale,
                      int64_t block) {
  const ffi::DataType kt = k.element_type();
  if (kt != ffi::DataType::F32 && kt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("k and v must both be f32 or both bf16");
  Problem P;
  if (ffi::Error e = ReadProblem(q, k, v, q_pos, k_pos, o, m, l, window, scale, block, &P); e.failure()) return e;
  return Solve(xla_pool, P);
}

// The problem of an int8 part (`ReadProblem`, then its codes' type and scales checked and set).
ffi::Error ReadInt8Problem(ffi::Buffer<ffi::F32>& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
                           ffi::Buffer<ffi::F32>& k_scale, ffi::Buffer<ffi::F32>& v_scale, ffi::Buffer<ffi::S32>& q_pos,
                           ffi::Buffer<ffi::S32>& k_pos, ffi::ResultBuffer<ffi::F32>& o, ffi::ResultBuffer<ffi::F32>& m,
                           ffi::ResultBuffer<ffi::F32>& l, int64_t window, float scale, int64_t block, int64_t qscores,
                           Problem* out) {
  if (k.element_type() != ffi::DataType::S8) return ffi::Error::InvalidArgument("k and v must be int8 codes");
  if (ffi::Error e = ReadProblem(q, k, v, q_pos, k_pos, o, m, l, window, scale, block, out); e.failure()) return e;
  const size_t scales = static_cast<size_t>(out->B * out->K * out->S);
  if (k_scale.element_count() != scales || v_scale.element_count() != scales)
    return ffi::Error::InvalidArgument("k_scale and v_scale must be [B, K, S]");
  out->k_scale = k_scale.typed_data();
  out->v_scale = v_scale.typed_data();
  out->qscores = qscores != 0;
  return ffi::Error::Success();
}

// int8 codes with one f32 scale per (batch, kv head, slot) for the keys and for the values (a draft's kept tokens).
ffi::Error AttendInt8Impl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> q_pos,
                          ffi::Buffer<ffi::S32> k_pos, ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m,
                          ffi::ResultBuffer<ffi::F32> l, int64_t window, float scale, int64_t block,
                          int64_t qscores) {
  Problem P;
  if (ffi::Error e =
          ReadInt8Problem(q, k, v, k_scale, v_scale, q_pos, k_pos, o, m, l, window, scale, block, qscores, &P);
      e.failure())
    return e;
  return Solve(xla_pool, P);
}

// A draft's two parts in one call: its kept tokens as int8 codes with per-slot scales and its recent ring (f32 or
// bf16), each part's keys in segments as in `Solve`, every segment's statistics merged in one pass (kept segments,
// then the ring's), so the call returns the statistics of the union. One call where the draft made two plus an XLA
// combine of their statistics (dropping the ring's call and the combine altogether ran a SmolLM2 draft token in 0.90x
// the time): measured, SmolLM2's draft token at 8K, interleaved in one process, 0.95-0.99x the time of the two calls,
// the same drafts. The merge order differs from that of two calls and a combine (the same arithmetic otherwise), so
// its bits are its own -- a draft's lossy attention, not a verify's.
ffi::Error AttendInt8RingImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                              ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> k_pos, ffi::AnyBuffer rk,
                              ffi::AnyBuffer rv, ffi::Buffer<ffi::S32> r_pos, ffi::ResultBuffer<ffi::F32> o,
                              ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l, int64_t window,
                              float scale, int64_t block, int64_t qscores) {
  Problem parts[2];
  if (ffi::Error e = ReadInt8Problem(q, k, v, k_scale, v_scale, q_pos, k_pos, o, m, l, window, scale, block, qscores,
                                     &parts[0]);
      e.failure())
    return e;
  const ffi::DataType rt = rk.element_type();
  if (rt != ffi::DataType::F32 && rt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("the ring's k and v must both be f32 or both bf16");
  if (ffi::Error e = ReadProblem(q, rk, rv, q_pos, r_pos, o, m, l, window, scale, block, &parts[1]); e.failure())
    return e;
  if (parts[1].K != parts[0].K || parts[1].D != parts[0].D)
    return ffi::Error::InvalidArgument("the ring must have the kept part's KV heads and head size");
  SolveParts(xla_pool, parts, 2);
  return ffi::Error::Success();
}

// Kernel 0 plus the block masses of some of its query rows (f32 or bf16 keys): what the refreshing drafter scores a
// verified cache with, taken from the verify's own pass over it instead of a second pass (block_mass.cc).
ffi::Error AttendMassImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                          ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> k_pos, ffi::Buffer<ffi::S32> mass_base,
                          ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l,
                          ffi::ResultBuffer<ffi::F32> mass, int64_t window, float scale, int64_t block,
                          int64_t mass_block, ffi::Span<const int64_t> mass_rows) {
  const ffi::DataType kt = k.element_type();
  if (kt != ffi::DataType::F32 && kt != ffi::DataType::BF16)
    return ffi::Error::InvalidArgument("k and v must both be f32 or both bf16");
  Problem P;
  if (ffi::Error e = ReadProblem(q, k, v, q_pos, k_pos, o, m, l, window, scale, block, &P); e.failure()) return e;
  if (mass_block < 8 || mass_block % 8 || block % mass_block)
    return ffi::Error::InvalidArgument("mass_block must be a multiple of 8 that divides block");
  for (size_t i = 0; i < mass_rows.size(); ++i) {
    if (mass_rows[i] < 0 || mass_rows[i] >= P.T) return ffi::Error::InvalidArgument("mass_rows must be in [0, T)");
    for (size_t j = 0; j < i; ++j)
      if (mass_rows[j] == mass_rows[i]) return ffi::Error::InvalidArgument("mass_rows must be distinct");
  }
  if (mass_base.element_count() != static_cast<size_t>(P.B)) return ffi::Error::InvalidArgument("mass_base must be [B]");
  P.n_mass = static_cast<int64_t>(mass_rows.size());
  P.mass_rows = mass_rows.begin();
  P.mass_base = mass_base.typed_data();
  P.mass_block = mass_block;
  P.groups = (P.S + mass_block - 1) / mass_block;
  P.nblocks = (P.S + block - 1) / block;
  if (mass->element_count() != static_cast<size_t>(P.B * P.K * P.groups))
    return ffi::Error::InvalidArgument("mass must be [B, K, ceil(S / mass_block)]");
  // kept between calls (a fresh 128 KiB buffer is fresh pages every call); only what GroupSums writes is read
  thread_local std::vector<float> gsum;
  gsum.resize(P.B * P.n_mass * P.N * P.groups);
  std::vector<float> gmax(P.B * P.n_mass * P.N * P.nblocks, kMInit);
  P.gsum = gsum.data();
  P.gmax = gmax.data();
  P.mass = mass->typed_data();
  if (ffi::Error e = Solve(xla_pool, P); e.failure()) return e;
  MassOut(P);
  return ffi::Error::Success();
}

// The block masses from the mass rows' group sums, once every row's final m and l are known: mass[b, h, group] =
// sum over the mass rows i and the G heads of the KV head h of gsum * exp(m_blk - m) / l (a row that sees nothing,
// l = 0, and a block a row skipped, m_blk = M_INIT with its sums never written, add 0), in that fixed order -- p / l
// summed over the group's keys, as `block_mass_reference` defines it.
void MassOut(const Problem& P) {
  const int64_t G = P.G, per_block = P.block / P.mass_block, rows = P.n_mass * P.N;
  std::fill(P.mass, P.mass + P.B * P.K * P.groups, 0.0f);
  for (int64_t b = 0; b < P.B; ++b)
    for (int64_t i = 0; i < P.n_mass; ++i)
      for (int64_t n = 0; n < P.N; ++n) {
        const int64_t t = P.mass_base[b] + P.mass_rows[i];
        if (t < 0 || t >= P.T) continue;  // not among this call's rows: its groups were never written
        const int64_t qi = (b * P.T + t) * P.N + n, mi = b * rows + i * P.N + n;
        const float m = P.m[qi], l = P.l[qi];
        if (!(l > 0.0f)) continue;
        const float* gs = P.gsum + mi * P.groups;
        float* out = P.mass + (b * P.K + n / G) * P.groups;
        for (int64_t blk = 0; blk < P.nblocks; ++blk) {
          const float mb = P.gmax[mi * P.nblocks + blk];
          if (mb == kMInit) continue;
          const float f = ExpScalar(mb - m) / l;
          for (int64_t j = blk * per_block, j1 = std::min(P.groups, j + per_block); j < j1; ++j)
            out[j] = std::fma(gs[j], f, out[j]);
        }
      }
}

// The statistics of rows that see nothing: o = 0, m = M_INIT, l = 0.
void EmptyStats(const Problem& P) {
  const int64_t Q = P.B * P.T * P.N;
  std::fill(P.o, P.o + Q * P.D, 0.0f);
  std::fill(P.m, P.m + Q, kMInit);
  std::fill(P.l, P.l + Q, 0.0f);
}

// One work unit of `P` (`RunUnit`) by its keys' element type: int8 codes, bf16 or f32.
void RunUnitOf(const Problem& P, int64_t tile, int64_t r0, int64_t r1, int64_t i0, int64_t i1, float* out_o,
               float* out_m, float* out_l) {
  const int64_t b = tile / P.K, h = tile % P.K;
  if (P.k_scale != nullptr)
    RunUnit<int8_t>(P, b, h, r0, r1, i0, i1, out_o, out_m, out_l);
  else if (P.bf16)
    RunUnit<uint16_t>(P, b, h, r0, r1, i0, i1, out_o, out_m, out_l);
  else
    RunUnit<float>(P, b, h, r0, r1, i0, i1, out_o, out_m, out_l);
}

ffi::Error Solve(ffi::ThreadPool& xla_pool, Problem& P) {
  if (P.S == 0 || P.T == 0) {
    EmptyStats(P);
    return ffi::Error::Success();
  }
  Workers pool(xla_pool);
  const int64_t tiles = P.B * P.K, rows = P.T * P.G, threads = pool.threads();
  // Whole tiles when they divide among the threads (each thread streams its own keys), or when a tile has few rows
  // (memory-bound: every unit of a tile reads and transposes all its keys, so splitting its rows would read them
  // once per thread -- measured at SmolLM2's 3 KV heads, 1 row: 1.3x slower split); otherwise row ranges too.
  // (Which thread runs a row never changes its arithmetic.)
  const int64_t nblocks = (P.S + P.block - 1) / P.block, segb = SegmentBlocks(P.block, P.S);
  const int64_t nseg = (nblocks + segb - 1) / segb;
  const int64_t chunks =
      (nseg > 1 || tiles % threads == 0 || rows < kSplitMinRows) ? 1 : std::min<int64_t>(threads, rows);
  const int64_t per = (rows + chunks - 1) / chunks;
  const int64_t Q = P.B * P.T * P.N;
  // one segment: straight into the outputs; several: each segment's statistics apart, merged after
  std::vector<float> po(nseg > 1 ? nseg * Q * P.D : 0), pm(nseg > 1 ? nseg * Q : 0), pl(nseg > 1 ? nseg * Q : 0);
  pool.Run(tiles * chunks * nseg, [&](int64_t u) {
    const int64_t sg = u % nseg, tile = u / nseg / chunks, c = u / nseg % chunks;
    const int64_t r0 = c * per, r1 = std::min(rows, r0 + per);
    if (r0 >= r1) return;
    const int64_t i0 = sg * segb, i1 = std::min(nblocks, i0 + segb);
    float* oo = nseg > 1 ? po.data() + sg * Q * P.D : P.o;
    float* om = nseg > 1 ? pm.data() + sg * Q : P.m;
    float* ol = nseg > 1 ? pl.data() + sg * Q : P.l;
    RunUnitOf(P, tile, r0, r1, i0, i1, oo, om, ol);
  });
  if (nseg > 1) {
    const int64_t parts = std::min<int64_t>(threads, Q);
    pool.Run(parts, [&](int64_t u) {
      MergeSegments(P, nseg, po.data(), pm.data(), pl.data(), u * Q / parts, (u + 1) * Q / parts);
    });
  }
  return ffi::Error::Success();
}

// Several parts' keys as one softmax (`AttendInt8RingImpl`): every part's segments (`SegmentBlocks` of its own
// capacity) are work units of their own, and their statistics merge in part order, then segment order. Parts share
// q, the positions of the rows and the outputs; a part with no slots adds nothing.
void SolveParts(ffi::ThreadPool& xla_pool, const Problem* parts, int nparts) {
  Workers pool(xla_pool);
  const Problem& P0 = parts[0];
  const int64_t tiles = P0.B * P0.K, rows = P0.T * P0.G, Q = P0.B * P0.T * P0.N;
  // per part: its blocks, blocks per segment, its first segment
  std::vector<int64_t> nblocks(nparts), segb(nparts), first(nparts + 1, 0);
  for (int i = 0; i < nparts; ++i) {
    const Problem& P = parts[i];
    nblocks[i] = (P.S + P.block - 1) / P.block;
    segb[i] = SegmentBlocks(P.block, P.S);
    first[i + 1] = first[i] + (nblocks[i] + segb[i] - 1) / segb[i];  // none for a part with no slots
  }
  const int64_t nseg = first[nparts];
  if (nseg == 0 || P0.T == 0) return EmptyStats(P0);
  std::vector<float> po(nseg * Q * P0.D), pm(nseg * Q), pl(nseg * Q);
  pool.Run(tiles * nseg, [&](int64_t u) {
    const int64_t sg = u % nseg, tile = u / nseg;
    int i = 0;
    while (first[i + 1] <= sg) ++i;
    const Problem& P = parts[i];
    const int64_t i0 = (sg - first[i]) * segb[i], i1 = std::min(nblocks[i], i0 + segb[i]);
    RunUnitOf(P, tile, 0, rows, i0, i1, po.data() + sg * Q * P.D, pm.data() + sg * Q, pl.data() + sg * Q);
  });
  const int64_t n = std::min<int64_t>(pool.threads(), Q);
  pool.Run(n, [&](int64_t u) { MergeSegments(P0, nseg, po.data(), pm.data(), pl.data(), u * Q / n, (u + 1) * Q / n); });
}

// ------------------------------------------------------------------------------------------------ bindings
// The entry points' FFI signatures share their runs of arguments, built once here, in each handler's argument order.
// The thread pool, q f32[B, T, N, D], then k and v (f32 or bf16, or int8 codes).
auto BindQKV() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>();
}
// BindQKV for int8 codes: then k_scale and v_scale f32[B, K, S].
auto BindInt8QKV() { return BindQKV().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>(); }
// Then q_pos and k_pos.
template <typename B>
auto Positions(B b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::S32>>().template Arg<ffi::Buffer<ffi::S32>>();
}
// Then the statistics o, m, l.
template <typename B>
auto Stats(B b) {
  using Out = ffi::Buffer<ffi::F32>;
  return std::move(b).template Ret<Out>().template Ret<Out>().template Ret<Out>();
}
// Then kernel 0's attributes.
template <typename B>
auto Attrs(B b) {
  return std::move(b).template Attr<int64_t>("window").template Attr<float>("scale").template Attr<int64_t>("block");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxAttend, AttendImpl, Attrs(Stats(Positions(BindQKV()))));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxAttendInt8, AttendInt8Impl,
                              Attrs(Stats(Positions(BindInt8QKV()))).Attr<int64_t>("qscores"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxAttendInt8Ring, AttendInt8RingImpl,
                              Attrs(Stats(Positions(BindInt8QKV())
                                              .Arg<ffi::AnyBuffer>()  // the ring's k: f32 or bf16
                                              .Arg<ffi::AnyBuffer>()  // the ring's v: its k's dtype
                                              .Arg<ffi::Buffer<ffi::S32>>()))  // the ring's positions
                                  .Attr<int64_t>("qscores"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxAttendMass, AttendMassImpl,
                              Attrs(Stats(Positions(BindQKV()).Arg<ffi::Buffer<ffi::S32>>())  // mass_base s32[B]
                                        .Ret<ffi::Buffer<ffi::F32>>())  // mass f32[B, K, ceil(S / mass_block)]
                                  .Attr<int64_t>("mass_block")
                                  .Attr<ffi::Span<const int64_t>>("mass_rows"));

extern "C" int kvjax_native_vector_width() { return KVJAX_AVX2 ? 8 : 1; }
// The head sizes whose qscores run as VNNI tiles here: multiples of this many dims (0: none, the plain loop for all).
extern "C" int kvjax_native_int8_score_tile_dims() { return static_cast<int>(kIntTileDims); }
// The thread pool's spin window (microseconds), for measuring its effect within one process (benchmarks).
extern "C" void kvjax_native_set_spin_us(long long us) { kvjax_native::Pool::get().set_spin_us(us); }
// Which threads the kernels run on (workers.h): 0 XLA's intra-op pool where lent, 1 the library's own pool.
extern "C" void kvjax_native_set_pool(int choice) { kvjax_native::PoolChoice().store(choice); }
