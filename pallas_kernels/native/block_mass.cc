// Block masses on the CPU: the softmax mass query rows put on each block of a cache's keys, as an XLA FFI custom call
// (`kvjax.models.attention_scores.block_mass`; the refreshing drafter chooses its blocks by it).
//
// Inputs  q f32[B, R, N, D], k f32[B, K, S, D], q_pos s32[B, R], k_pos s32[B, S] or s32[B, K, S]
// Output  mass f32[B, K, ceil(S / block)]
// Attrs   block (s64 >= 1), scale (f32)
//
// Per (b, KV head h) and each of its R * G query rows (query head h * G + g, G = N / K): scores s_j = scale * q.k_j
// over the keys visible to the row (0 <= k_pos[j] <= q_pos), p_j = exp(s_j - max) / sum, and the block's mass is
// the sum of p_j over its keys, the G heads and the R rows. A row that sees no key contributes 0.
//
// One pass over the keys: they are read in chunks of whole blocks (about 256 keys); each active row's scores for a
// chunk stay in L1, and the row keeps, per chunk, its own maximum m_c there and, per block, sum_j exp(s_j - m_c).
// The rows' true maxima and sums are known only at the end, where a block's partial sum is rescaled by
// exp(m_c - max) (one exponential per row and chunk) and divided by the row's sum: no second read of the keys, no
// S-long buffer of scores, and chunks independent of each other, so threads split a head's keys (3 KV heads on 2
// threads balance). Chunks no row can see (empty slots past the cache's end) are never read.
//
// Determinism: every number is one fixed sequence of roundings whatever the thread split or the build. Under 8 rows
// per head a score is 8 lane partials over d (lane d % 8: q[l] * k[l], then fma over d = l + 8, l + 16, ...) summed
// in simd.h's Reduce8 tree, then * scale, and a block's sum is 8 lane partials (key offset % 8 within the block) then
// Reduce8; from 8 rows (`ChunkLanes`: rows as vector lanes) a score is one chain over d and a block's sum one chain
// over its keys. The final rescale and the sum over rows run in a fixed order. The scalar build (no AVX2/FMA; also
// the dot products under 8 rows at D % 8 != 0) performs the same operations one lane at a time, so both builds give
// the same bits.
//
// Measured (scripts/bench_refresh_step.py, the 2-core EPYC shared with other jobs, medians of interleaved rounds,
// three runs): the bundled model's 4 layers at 32,768 slots, 2 verify rows: 1.25-1.75x a same-run reduction over the
// same keys (the memory floor; XLA's einsum/softmax path 3.4-6.1x); 16 rows, compute-bound, 4.3x (XLA 29x).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "pool.h"
#include "shapes.h"
#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace kvjax_native;  // Pool, QKShape, ExpScalar, Exp8, Reduce8(x8), Max8 (pool.h, shapes.h, simd.h)

// Keys per chunk (rounded to whole blocks): an active row's chunk of scores (1 KiB) and the chunk's keys (32 KiB at
// D = 32) stay in L1/L2 between the scoring and the exponentials.
constexpr int64_t kChunkKeys = 256;
// Keys per work unit (rounded to whole chunks): enough to amortise a unit's set-up, small enough that the threads
// share a head's keys evenly.
constexpr int64_t kUnitKeys = 4096;

struct MassProblem {
  const float *q, *k;
  const int32_t *q_pos, *k_pos;
  float* mass;
  int64_t B, R, N, K, S, D, G, rows;  // rows = R * G per (b, head), row r = t * G + g
  bool pos_per_head;
  float scale;
  int64_t block, nb;          // keys per block, blocks
  int64_t cblocks, ck, nc;    // blocks per chunk, keys per chunk, chunks
  float *bsum, *cmax;         // per (tile, row): bsum[nb] block partial sums, cmax[nc] chunk maxima (-inf: none)
};

// One row's score against one key: 8 lane partials over d, Reduce8, then the scale (the scalar form of Dot8).
inline float DotScalar(const float* q, const float* k, int64_t D, float scale) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t d = 0; d < std::min<int64_t>(D, 8); ++d) lanes[d] = q[d] * k[d];
  for (int64_t d = 8; d < D; ++d) lanes[d % 8] = std::fma(q[d], k[d], lanes[d % 8]);
  return Reduce8(lanes) * scale;
}

#if KVJAX_AVX2
// One row's scores against 8 consecutive keys (kb: D floats each, D % 8 == 0): per key, 8 lane partials over d
// (a product, then FMAs), and the 8 keys' partials reduced together in Reduce8's order (`Reduce8x8`).
inline __m256 Dot8(const float* q, const float* kb, int64_t D, __m256 scale) {
  __m256 a[8];
  {
    const __m256 q0 = _mm256_loadu_ps(q);
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j) a[j] = _mm256_mul_ps(q0, _mm256_loadu_ps(kb + j * D));
  }
  for (int64_t c = 8; c < D; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; ++j)
      a[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kb + j * D + c), a[j]);
  }
  return _mm256_mul_ps(Reduce8x8(a), scale);
}
#endif

// Sum of exp(s[j] - m) over n scores: 8 lane partials (j % 8) then Reduce8. s is readable up to n rounded up to 8,
// the padding -inf (exp gives exactly 0, so the vector form's padded lanes add nothing).
inline float ExpSum(const float* s, int64_t n, float m, bool vector_ok) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#if KVJAX_AVX2
  if (vector_ok) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) acc = _mm256_add_ps(acc, Exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm)));
    _mm256_storeu_ps(lanes, acc);
    return Reduce8(lanes);
  }
#else
  (void)vector_ok;
#endif
  for (int64_t j = 0; j < n; ++j) lanes[j % 8] += ExpScalar(s[j] - m);
  return Reduce8(lanes);
}

// ------------------------------------------------------------------------------------------------ rows as lanes
// From kLaneRows rows per head up (the first selection: 16 prompt rows x the group), the rows are the 8 lanes of a
// vector and the keys are broadcast: a group of 8 rows is scored against 8 keys with 8 FMAs per d and no horizontal
// reduction, then masked, maximised, exponentiated and summed per block lane-wise. Each row's numbers are then: a
// score one chain over d (q[0] * k[0], then fma over d = 1..D-1, then * scale), a block's sum one chain over its keys
// in order. Which path a call takes depends only on its shapes (rows >= kLaneRows), so results stay deterministic.
// Measured (one A/B run, loaded machine): 16 rows x 2 heads, D = 32, 4 x 32,768 slots 34.1 vs 43.8 ms by the path
// above; SmolLM2's 16 x 3, D = 64, 30 x 8,192 slots 205 vs 247 ms; under 8 rows it would waste lanes.
constexpr int64_t kLaneRows = 8;

// Rows [8v, 8v + 8) of the tile (qT: their queries as qT[d * 8 + lane], rows past `rows` zero with hi -1, never
// visible) against the chunk's n keys kc (positions pos): chunk maxima into cmax[c], block sums into bsum. s: 8 * n
// floats of scratch.
void ChunkLanes(const MassProblem& P, int64_t tile, int64_t v, const float* qT, const int32_t* hiT, const float* kc,
                const int32_t* pos, int64_t n, int64_t c, int64_t blk0, int64_t blk1, float* s) {
  const int64_t D = P.D;
  const int64_t nl = std::min<int64_t>(8, P.rows - 8 * v);  // real rows among the lanes
  alignas(32) float mx[8], acc[8];
#if KVJAX_AVX2
  const __m256 vscale = _mm256_set1_ps(P.scale), ninf = _mm256_set1_ps(-INFINITY);
  const __m256i vhi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hiT)), vneg = _mm256_set1_epi32(-1);
  __m256 vmx = ninf;
  int64_t j = 0;
  auto finish = [&](__m256 a, int64_t jj) {  // scale, mask, store, fold into the lane maxima
    const __m256i p = _mm256_set1_epi32(pos[jj]);
    const __m256i ok = _mm256_andnot_si256(_mm256_cmpgt_epi32(p, vhi), _mm256_cmpgt_epi32(p, vneg));
    const __m256 sv = _mm256_blendv_ps(ninf, _mm256_mul_ps(a, vscale), _mm256_castsi256_ps(ok));
    _mm256_storeu_ps(s + 8 * jj, sv);
    vmx = _mm256_max_ps(vmx, sv);
  };
  for (; j + 8 <= n; j += 8) {
    const float* kj = kc + j * D;
    __m256 a[8];
    {
      const __m256 q0 = _mm256_loadu_ps(qT);
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) a[i] = _mm256_mul_ps(q0, _mm256_broadcast_ss(kj + i * D));
    }
    for (int64_t d = 1; d < D; ++d) {
      const __m256 qd = _mm256_loadu_ps(qT + 8 * d);
      _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i)
        a[i] = _mm256_fmadd_ps(qd, _mm256_broadcast_ss(kj + i * D + d), a[i]);
    }
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) finish(a[i], j + i);
  }
  for (; j < n; ++j) {
    const float* kj = kc + j * D;
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qT), _mm256_broadcast_ss(kj));
    for (int64_t d = 1; d < D; ++d) a = _mm256_fmadd_ps(_mm256_loadu_ps(qT + 8 * d), _mm256_broadcast_ss(kj + d), a);
    finish(a, j);
  }
  _mm256_store_ps(mx, vmx);
  for (int64_t bi = blk0; bi < blk1; ++bi) {
    const int64_t i0 = (bi - blk0) * P.block, i1 = std::min(n, i0 + P.block);
    __m256 va = _mm256_setzero_ps();
    for (int64_t i = i0; i < i1; ++i)  // a row that sees nothing here: -inf - -inf = NaN, and Exp8(NaN) = 0
      va = _mm256_add_ps(va, Exp8(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * i), vmx)));
    _mm256_store_ps(acc, va);
    for (int64_t l = 0; l < nl; ++l) P.bsum[(tile * P.rows + 8 * v + l) * P.nb + bi] = acc[l];
  }
#else
  // the same operations one lane at a time
  for (int l = 0; l < 8; ++l) mx[l] = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* kj = kc + j * D;
    for (int l = 0; l < 8; ++l) {
      float a = qT[l] * kj[0];
      for (int64_t d = 1; d < D; ++d) a = std::fma(qT[8 * d + l], kj[d], a);
      const bool ok = pos[j] >= 0 && pos[j] <= hiT[l];
      const float sv = ok ? a * P.scale : -INFINITY;
      s[8 * j + l] = sv;
      mx[l] = mx[l] > sv ? mx[l] : sv;  // _mm256_max_ps(mx, sv)
    }
  }
  for (int64_t bi = blk0; bi < blk1; ++bi) {
    const int64_t i0 = (bi - blk0) * P.block, i1 = std::min(n, i0 + P.block);
    for (int l = 0; l < 8; ++l) acc[l] = 0.0f;
    for (int64_t i = i0; i < i1; ++i)
      for (int l = 0; l < 8; ++l) acc[l] += ExpScalar(s[8 * i + l] - mx[l]);
    for (int64_t l = 0; l < nl; ++l) P.bsum[(tile * P.rows + 8 * v + l) * P.nb + bi] = acc[l];
  }
#endif
  for (int64_t l = 0; l < nl; ++l) P.cmax[(tile * P.rows + 8 * v + l) * P.nc + c] = mx[l];
}

// Chunks [c0, c1) of tile (b, h): every row's chunk maxima and block partial sums.
void RunChunks(const MassProblem& P, int64_t b, int64_t h, int64_t c0, int64_t c1) {
  const int64_t D = P.D, G = P.G, rows = P.rows, tile = b * P.K + h;
  const float* kt = P.k + tile * P.S * D;
  const int32_t* kp = P.k_pos + (P.pos_per_head ? tile * P.S : b * P.S);
  const int64_t ckpad = (P.ck + 7) / 8 * 8;
  std::vector<const float*> q(rows);
  std::vector<int32_t> hi(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / G, g = r % G;
    q[r] = P.q + ((b * P.R + t) * P.N + h * G + g) * D;
    hi[r] = P.q_pos[b * P.R + t];
  }
  const bool lanes = rows >= kLaneRows;
  const int64_t nv = (rows + 7) / 8;
  std::vector<float> qT(lanes ? nv * D * 8 : 0, 0.0f);  // rows as lanes: qT[(v * D + d) * 8 + lane]
  std::vector<int32_t> hiT(lanes ? nv * 8 : 0, -1);
  for (int64_t r = 0; lanes && r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d) qT[((r / 8) * D + d) * 8 + r % 8] = q[r][d];
    hiT[r] = hi[r];
  }
  std::vector<float> s(lanes ? 8 * ckpad : rows * ckpad);  // scores of the chunk, one row of ckpad floats per row
  std::vector<int32_t> pos(ckpad);
  std::vector<int64_t> act(rows);
  const bool vec_dot = KVJAX_AVX2 && D % 8 == 0, vec_sum = KVJAX_AVX2 && P.block % 8 == 0;
#if KVJAX_AVX2
  const __m256 vscale = _mm256_set1_ps(P.scale);
#endif
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t j0 = c * P.ck, n = std::min(P.ck, P.S - j0), npad = (n + 7) / 8 * 8;
    const int64_t blk0 = c * P.cblocks, blk1 = std::min(P.nb, blk0 + P.cblocks);
    int32_t pmin = INT32_MAX, pmax = -1;
    int64_t occupied = 0;
    for (int64_t j = 0; j < npad; ++j) {
      const int32_t p = j < n ? kp[j0 + j] : -1;  // -1: padding, never visible
      pos[j] = p;
      if (p >= 0) {
        pmin = std::min(pmin, p);
        pmax = std::max(pmax, p);
        ++occupied;
      }
    }
    int64_t na = 0;
    for (int64_t r = 0; r < rows; ++r) {
      float* bs = P.bsum + (tile * rows + r) * P.nb;
      if (occupied > 0 && pmin <= hi[r]) {  // some key of the chunk is visible to row r
        act[na++] = r;
      } else {
        P.cmax[(tile * rows + r) * P.nc + c] = -INFINITY;
        std::fill(bs + blk0, bs + blk1, 0.0f);
      }
    }
    if (na == 0) continue;  // nothing visible to any row: the chunk's keys are never read
    if (lanes) {
      for (int64_t v = 0; v < nv; ++v)
        ChunkLanes(P, tile, v, qT.data() + v * D * 8, hiT.data() + 8 * v, kt + j0 * D, pos.data(), n, c, blk0, blk1,
                   s.data());
      continue;
    }
    // 1. scores, key groups outer so a group's keys are read from memory once for all rows
    int64_t j = 0;
#if KVJAX_AVX2
    // The next chunk's keys are prefetched into L2 while this one is scored, a group's worth (8 keys) at a time
    // (measured at the tiny model's shape, 32K slots, 2 rows x 2 heads per KV head: 0.72-0.75x the time without).
    const char* next = reinterpret_cast<const char*>(kt + std::min(P.S, j0 + P.ck) * D);
    const int64_t next_bytes = std::max<int64_t>(0, std::min(P.ck, P.S - j0 - P.ck)) * D * 4;
    if (vec_dot)
      for (; j + 8 <= n; j += 8) {
        for (int64_t b = j * D * 4; b < std::min(next_bytes, (j + 8) * D * 4); b += 64)
          _mm_prefetch(next + b, _MM_HINT_T1);
        for (int64_t a = 0; a < na; ++a)
          _mm256_storeu_ps(s.data() + act[a] * ckpad + j, Dot8(q[act[a]], kt + (j0 + j) * D, D, vscale));
      }
#endif
    for (; j < n; ++j)
      for (int64_t a = 0; a < na; ++a) s[act[a] * ckpad + j] = DotScalar(q[act[a]], kt + (j0 + j) * D, D, P.scale);
    // 2. per row: mask (unless every key is visible), the chunk maximum, the blocks' sums of exp(s - max)
    const bool dense = occupied == n;
    for (int64_t a = 0; a < na; ++a) {
      const int64_t r = act[a];
      float* sr = s.data() + r * ckpad;
      std::fill(sr + n, sr + npad, -INFINITY);
      const bool all_visible = dense && pmax <= hi[r];
      float mx = -INFINITY;  // max is exact: any order gives the same value (up to the sign of a zero, which no
                             // later result depends on)
      int64_t i = 0;
#if KVJAX_AVX2
      const __m256i vhi = _mm256_set1_epi32(hi[r]), vneg = _mm256_set1_epi32(-1);
      const __m256 ninf = _mm256_set1_ps(-INFINITY);
      __m256 vmx = ninf;
      for (; i < npad; i += 8) {
        __m256 sv = _mm256_loadu_ps(sr + i);
        if (!all_visible) {
          const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pos.data() + i));
          const __m256i ok = _mm256_andnot_si256(_mm256_cmpgt_epi32(p, vhi), _mm256_cmpgt_epi32(p, vneg));
          sv = _mm256_blendv_ps(ninf, sv, _mm256_castsi256_ps(ok));
          _mm256_storeu_ps(sr + i, sv);
        }
        vmx = _mm256_max_ps(vmx, sv);
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmx);
      mx = Max8(lanes);
#endif
      for (; i < npad; ++i) {
        if (!all_visible && !(pos[i] >= 0 && pos[i] <= hi[r])) sr[i] = -INFINITY;
        mx = std::max(mx, sr[i]);
      }
      P.cmax[(tile * rows + r) * P.nc + c] = mx;
      float* bs = P.bsum + (tile * rows + r) * P.nb;
      for (int64_t bi = blk0; bi < blk1; ++bi) {
        const int64_t i0 = (bi - blk0) * P.block, i1 = std::min(n, i0 + P.block);
        bs[bi] = ExpSum(sr + i0, i1 - i0, mx, vec_sum);
      }
    }
  }
}

// Tile (b, h): each row's maximum and sum from its chunks, then mass[block] = sum over rows, in order, of the
// block's partial sum * exp(chunk max - row max) / row sum.
void Finish(const MassProblem& P, int64_t tile) {
  const int64_t rows = P.rows, nb = P.nb, nc = P.nc;
  float* out = P.mass + tile * nb;
  std::fill(out, out + nb, 0.0f);
  std::vector<float> w(nc);
  for (int64_t r = 0; r < rows; ++r) {
    const float* cm = P.cmax + (tile * rows + r) * nc;
    const float* bs = P.bsum + (tile * rows + r) * nb;
    float mx = -INFINITY;
    for (int64_t c = 0; c < nc; ++c) mx = std::max(mx, cm[c]);
    if (mx == -INFINITY) continue;  // the row sees no key: it contributes nothing
    for (int64_t c = 0; c < nc; ++c) w[c] = ExpScalar(cm[c] - mx);  // -inf (a chunk it cannot see): 0
    // The row's sum: per chunk the sum of its blocks, rescaled, then 8 lane partials over chunks (c % 8) and
    // Reduce8 -- short chains, so its rounding stays near the reference's tree-shaped sum over the keys.
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t c = 0; c < nc; ++c) {
      float cs = 0.0f;
      for (int64_t i = c * P.cblocks; i < std::min(nb, (c + 1) * P.cblocks); ++i) cs += bs[i];
      lanes[c % 8] += cs * w[c];
    }
    const float inv = 1.0f / Reduce8(lanes);  // >= 1: the chunk holding the maximum adds exp(0)
    for (int64_t c = 0; c < nc; ++c) {
      const float wc = w[c] * inv;
      for (int64_t i = c * P.cblocks; i < std::min(nb, (c + 1) * P.cblocks); ++i) out[i] += bs[i] * wc;
    }
  }
}

ffi::Error BlockMassImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::S32> q_pos,
                         ffi::Buffer<ffi::S32> k_pos, ffi::ResultBuffer<ffi::F32> mass, int64_t block, float scale) {
  QKShape sh;
  if (ffi::Error e = ReadQKShape(q.dimensions(), k.dimensions(), k_pos.dimensions(), q_pos.element_count(),
                                 "q_pos must be [B, R]", &sh);
      e.failure())
    return e;
  MassProblem P;
  P.B = sh.B;
  P.R = sh.T;
  P.N = sh.N;
  P.D = sh.D;
  P.K = sh.K;
  P.S = sh.S;
  P.G = sh.G;
  P.pos_per_head = sh.pos_per_head;
  if (block < 1) return ffi::Error::InvalidArgument("block must be >= 1");
  P.rows = P.R * P.G;
  P.block = block;
  P.nb = (P.S + block - 1) / block;
  if (mass->element_count() != static_cast<size_t>(P.B * P.K * P.nb))
    return ffi::Error::InvalidArgument("mass must be [B, K, ceil(S / block)]");
  P.cblocks = std::max<int64_t>(1, kChunkKeys / block);
  P.ck = P.cblocks * block;
  P.nc = (P.S + P.ck - 1) / P.ck;
  P.q = q.typed_data();
  P.k = k.typed_data();
  P.q_pos = q_pos.typed_data();
  P.k_pos = k_pos.typed_data();
  P.mass = mass->typed_data();
  P.scale = scale;
  const int64_t tiles = P.B * P.K;
  std::fill(P.mass, P.mass + tiles * P.nb, 0.0f);
  if (P.S == 0 || P.rows == 0) return ffi::Error::Success();
  // The partial sums live for one call; a thread's buffer is kept across calls so that repeated calls do not fault
  // fresh pages in.
  thread_local std::vector<float> work;
  const size_t need = static_cast<size_t>(tiles * P.rows * (P.nb + P.nc));
  if (work.size() < need) work.resize(need);
  P.bsum = work.data();
  P.cmax = work.data() + tiles * P.rows * P.nb;
  Workers pool(xla_pool);
  const int64_t unit_chunks = std::max<int64_t>(1, kUnitKeys / P.ck), per_tile = (P.nc + unit_chunks - 1) / unit_chunks;
  pool.Run(tiles * per_tile, [&](int64_t u) {
    const int64_t tile = u / per_tile, c0 = (u % per_tile) * unit_chunks;
    RunChunks(P, tile / P.K, tile % P.K, c0, std::min(P.nc, c0 + unit_chunks));
  });
  pool.Run(tiles, [&](int64_t tile) { Finish(P, tile); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxBlockMass, BlockMassImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Attr<float>("scale"));
