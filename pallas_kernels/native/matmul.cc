// Products for a few rows on the CPU, as XLA FFI custom calls: y = x @ w with bf16 weights (a draft's), int8 weight
// codes with one f32 scale per output column (a cheaper draft's: y = (x @ codes) * scale) or f32 weights (a verify
// block's).
//
// Inputs  x f32[M, K] (any leading shape, flattened to M rows), w bf16[K, N], int8[K, N] or f32[K, N] (row-major);
//         for int8, scale f32[N]
// Output  y f32[M, N]
//
// Why bf16: a draft token reads every weight once; stored in bf16 they are half the bytes of f32, but XLA:CPU
// multiplies a bf16 matrix by converting it to an f32 copy first (reading 2 bytes, writing and re-reading 4 per
// weight). Here each weight is read once as bf16 and widened in registers (bf16 -> f32 is exact: a 16-bit shift).
// int8 codes: a quarter of f32's bytes, widened the same way (int8 -> f32 is exact); the column's scale multiplies
// the finished sum once. SmolLM2's draft token (8K, refresh): 26.6 -> 20.1 ms with int8 instead of bf16 weights.
// f32 weights: a decode step's row and a verify block's 2-64 rows (`pallas_kernels.linear.F32_NATIVE_ROWS`), the
// latter by register tiles (below): SmolLM2's verify at 8K, one process against XLA's dot: 9 rows 0.90-0.93x, 17 rows
// 0.91-0.93x its time. Weights packed in 64-column panels (`MatmulPackedImpl`, below) are read faster still.
// Block-affine codes (`MatmulAffinePacked`): f32 weights that are exactly integer codes q with an f32 scale d and
// offset m per block of 32 k (a GGUF model's Q4_1 / Q8_0 / ... weights once loaded), read as the codes and made in
// registers as fma(q, d, m) -- the f32 weight itself, so the f32 product's bits at 1.25 bytes per weight (int8 codes)
// or 0.75 (4-bit codes two per byte).
//
// Tiling: threads take column panels of a group of up to 64 rows (the rows' partial sums, rows x panel f32, stay in
// L1: 4,096 columns for one row, 160 for 33); within a panel the weights stream in memory order, four weight rows at a
// time, each partial sum loaded once per four of its FMAs. Each y[m, n] is one FMA chain over k in order (its first
// term a plain product) -- or, for short weight rows, one chain per chunk of k fixed by the shape (`KChunks`), the
// chunks' sums added in order -- so a row's result does not depend on the other rows in the call, the panel width or
// the thread that ran it; the scalar build (no AVX2/FMA) does the same roundings with std::fma.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using kvjax_native::Widen;

namespace {

constexpr int64_t kGroupRows = 64;  // rows whose partial sums share a panel
constexpr int64_t kTileMinRows = 2;  // calls of this many rows or more take the register tiles (`TilePanel`)
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead (in weight bytes of the panel's rows) to prefetch

// Columns per unit for a group of `rows` rows: their partial sums within ~24 KiB of L1 (and four weight rows of the
// panel beside them), whole runs of 32 columns.
inline int64_t PanelColumns(int64_t rows) {
  return std::clamp<int64_t>(6144 / std::max<int64_t>(rows, 1) / 32 * 32, 32, 4096);
}

// Chunks of k, from the shape alone (never the thread count, so the bits do not depend on the machine): bf16 weight
// rows (what one-row bf16 drafts read) shorter than kContiguousBytes are read in k chunks of at least kChunkRows rows,
// each a contiguous block of whole rows, rather than in column panels of a few hundred bytes per row 4 KiB apart (a
// panel's short runs per row streamed at ~10 GB/s where whole rows stream at ~15: SmolLM2's [576, 3072] and
// [1536, 576] products, one row). int8 codes take one chain over all of k: where the native kernel runs they are
// packed (`PackedInt8`, contiguous panels), and the chunks' second pass (adding their sums) cost more than it saved
// there (a draft token's 121 packed products as a chain: 7.39 vs 7.92 ms); plain codes keep the packed ones' chains.
constexpr int64_t kContiguousBytes = 8192;
constexpr int64_t kChunkRows = 128;
constexpr int64_t kMaxChunks = 2;
inline int64_t KChunks(int64_t K, int64_t row_bytes, int64_t elem_bytes) {
  if (row_bytes >= kContiguousBytes || elem_bytes != 2) return 1;
  return std::clamp<int64_t>(K / kChunkRows, 1, kMaxChunks);
}

// y[m, c] (= or +=) x[m][k + i] * w[k + i][c] for i < KK in order, for the M rows (x rows at stride K, y rows at
// stride ldy, both at the panel's first column) over the panel's `width` columns; the first product when `first`, then
// one FMA each -- the same chain at every width. Columns outer, rows inner: each weight vector is loaded once per step
// and kept in a register for every row (with rows outer, the KK weight rows -- N floats apart, a multiple of 4 KiB for
// SmolLM2 -- fell into the same L1 sets and were evicted between rows: 9 rows ran at 0.3 FMA per cycle).
#if KVJAX_AVX2
// Steps over whole registers of L::kWidth columns from column c; returns the first column left.
template <typename L, int KK, typename T>
inline int64_t StepsVec(const float* x, int64_t K, const T* const* rows, float* y, int64_t ldy, int64_t M,
                        int64_t width, bool first, int64_t c) {
  using V = typename L::V;
  for (; c + L::kWidth <= width; c += L::kWidth) {
    V wv[KK];
    for (int i = 0; i < KK; ++i) wv[i] = L::Load(rows[i] + c);
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float* ym = y + m * ldy + c;
      V acc = first ? L::Mul(L::Set1(xm[0]), wv[0]) : L::Fma(L::Set1(xm[0]), wv[0], L::LoadF(ym));
      for (int i = 1; i < KK; ++i) acc = L::Fma(L::Set1(xm[i]), wv[i], acc);
      L::Store(ym, acc);
    }
  }
  return c;
}
#endif

template <int KK, typename T>
inline void Steps(const float* x, int64_t K, const T* const* rows, float* y, int64_t ldy, int64_t M, int64_t width,
                  bool first) {
  int64_t c = 0;
#if KVJAX_AVX512
  c = StepsVec<kvjax_native::Lanes16, KK>(x, K, rows, y, ldy, M, width, first, c);
#endif
#if KVJAX_AVX2
  c = StepsVec<kvjax_native::Lanes8, KK>(x, K, rows, y, ldy, M, width, first, c);
#endif
  for (; c < width; ++c)
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K;
      float* ym = y + m * ldy + c;
      float acc = first ? xm[0] * Widen(rows[0][c]) : std::fma(xm[0], Widen(rows[0][c]), *ym);
      for (int i = 1; i < KK; ++i) acc = std::fma(xm[i], Widen(rows[i][c]), acc);
      *ym = acc;
    }
}

// y[m0:m1, n0:n1] for one panel: k outer (the weights stream in memory order, a run of the panel's columns per weight
// row), four weight rows per step while the rows' partial sums stay in L1. Each y[m, n] is one FMA chain over k in
// order, its first term a plain product.
// The partial sums live in a scratch of row stride `width + 16` floats, copied to y at the end, rather than in y itself
// (row stride N floats: for SmolLM2 12 KiB, a multiple of 4 KiB like the weight rows' stride, so stores and loads
// alias modulo 4 KiB). Measured, SmolLM2's 120 products, two runs each: bf16 9 rows 28.4/29.4 vs 30.1/29.5 ms in y,
// 33 rows 79/82 vs 89/97 ms; f32 9 rows 38.7/39.5 vs 48.1/42.3 ms; one row the same.
// `scale` (int8 codes' per-column scales, or null) multiplies each finished sum once, as it is copied out.
// x's rows are `ldx` floats apart (a chunk of k: x and w start at the chunk's first k, K is the chunk's length).
template <typename T>
void Panel(const float* x, int64_t ldx, const T* w, const float* scale, float* yout, int64_t M, int64_t K, int64_t N,
           int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(yout + m * N + n0, yout + m * N + n1, 0.0f);
    return;
  }
  thread_local std::vector<float> scratch;
  const int64_t ld = width + 16;
  if (static_cast<int64_t>(scratch.size()) < M * ld) scratch.resize(M * ld);
  float* y = scratch.data() - n0;  // y + m * ld + n0: row m's partial sums
  const int64_t ldy = ld;
  // rows ahead: a short run per row (a narrow panel) needs more rows in flight to cover the memory latency
  const int64_t ahead = std::clamp<int64_t>(kPrefetchBytes / (static_cast<int64_t>(sizeof(T)) * width), 4, 64);
  auto prefetch = [&](int64_t k) {
    if (k < K)
      for (int64_t c = 0; c < width * static_cast<int64_t>(sizeof(T)); c += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(w + k * N + n0) + c);
  };
  {
    const T* rows[1] = {w + n0};
    Steps<1>(x, ldx, rows, y + n0, ldy, M, width, true);
  }
  int64_t k = 1;
  for (; k + 4 <= K; k += 4) {
    for (int64_t i = 0; i < 4; ++i) prefetch(k + ahead + i);
    const T* rows[4] = {w + k * N + n0, w + (k + 1) * N + n0, w + (k + 2) * N + n0, w + (k + 3) * N + n0};
    Steps<4>(x + k, ldx, rows, y + n0, ldy, M, width, false);
  }
  for (; k < K; ++k) {
    const T* rows[1] = {w + k * N + n0};
    Steps<1>(x + k, ldx, rows, y + n0, ldy, M, width, false);
  }
  if (scale == nullptr) {
    for (int64_t m = 0; m < M; ++m) std::memcpy(yout + m * N + n0, y + m * ldy + n0, width * sizeof(float));
    return;
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = n0; c < n1; ++c) yout[m * N + c] = y[m * ldy + c] * scale[c];
}

// ------------------------------------------------------------------------------------------------ register tiles
// For several rows: a tile of R rows x C registers of columns accumulates in registers over all of k (each weight
// vector loaded once per k for the R rows, each x[r, k] broadcast once for the C registers), so the loop is FMAs, not
// loads and stores of partial sums. The chain per output is the same as `Panel`'s: a plain product at k = 0, then
// one FMA per k in order, times the column's scale at the end -- the same bits, whichever path and tile ran.
//
// Where a tile's weights come from. `Stored<T>`: the weights as stored (f32, or int8 codes / bf16 widened exactly),
// rows N elements apart in a [K, N] matrix, 64 in a packed panel. `Affine`: int8 codes q of a packed panel
// with an f32 scale d and offset m per block of kAffineBlock k and column (`Affine4`: 4-bit codes), each weight made in
// registers as fma(q, d, m) -- exactly the f32 weight the codes stand for (`pallas_kernels.affine`: d * q is exact in
// f32, so the fused rounding is the plain sum's), so a tile multiplies the same values as with the f32 matrix.
constexpr int64_t kAffineBlock = 32;

template <typename T>
struct Stored {
  const T* w;
  int64_t ldw;
  static constexpr int64_t kElemBytes = sizeof(T);
  static constexpr bool kMade = false;  // the weights as stored (no unpacking per load)
  const void* Row(int64_t k) const { return w + k * ldw; }
  int64_t Offset(int64_t c) const { return c * kElemBytes; }  // bytes from a row's start to column c
  float At(int64_t k, int64_t c) const { return Widen(w[k * ldw + c]); }
#if KVJAX_AVX2
  template <typename L>
  typename L::V Load(int64_t k, int64_t c) const { return L::Load(w + k * ldw + c); }
#endif
};

struct Affine {
  const int8_t* q;       // [K, 64]
  const float *d, *m;    // [K / kAffineBlock, 64]
  static constexpr int64_t kElemBytes = 1;
  static constexpr bool kMade = true;  // each weight made from its code per load
  const void* Row(int64_t k) const { return q + k * 64; }
  int64_t Offset(int64_t c) const { return c; }
  float At(int64_t k, int64_t c) const {
    const int64_t b = k / kAffineBlock * 64 + c;
    return std::fma(static_cast<float>(q[k * 64 + c]), d[b], m[b]);
  }
#if KVJAX_AVX2
  template <typename L>
  typename L::V Load(int64_t k, int64_t c) const {
    const int64_t b = k / kAffineBlock * 64 + c;
    return L::Fma(L::Load(q + k * 64 + c), L::LoadF(d + b), L::LoadF(m + b));
  }
#endif
};

// `Affine` with 4-bit codes, two per byte: byte j of a k's 32 holds column j in its low nibble and column j + 32 in its
// high one -- 0.75 bytes per weight instead of 1.25, the same weights. Unsigned nibbles 0..15 (Q4_1's codes) or, with
// `Signed`, two's complement nibbles -8..7 (Q4_0's).
template <bool Signed>
struct Affine4 {
  const uint8_t* q;      // [K, 32]
  const float *d, *m;    // [K / kAffineBlock, 64]
  static constexpr int64_t kElemBytes = 1;  // per byte of codes: two weights (the prefetch reads ahead in bytes)
  static constexpr bool kMade = true;
  const void* Row(int64_t k) const { return q + k * 32; }
  int64_t Offset(int64_t c) const { return c % 32; }
  float At(int64_t k, int64_t c) const {
    const int nibble = c < 32 ? q[k * 32 + c % 32] & 15 : q[k * 32 + c % 32] >> 4;
    const int code = Signed ? (nibble ^ 8) - 8 : nibble;
    const int64_t b = k / kAffineBlock * 64 + c;
    return std::fma(static_cast<float>(code), d[b], m[b]);
  }
#if KVJAX_AVX2
  template <typename L>
  typename L::V Load(int64_t k, int64_t c) const {
    const int64_t b = k / kAffineBlock * 64 + c;
    return L::Fma(Codes<L>(q + k * 32 + c % 32, c >= 32), L::LoadF(d + b), L::LoadF(m + b));
  }
  // L::kWidth codes from the low (or high) nibbles of as many bytes at p, as f32: unsigned, by a mask or a logical
  // shift of the zero-extended bytes; signed, by arithmetic shifts of the sign-extended ones
  template <typename L>
  static typename L::V Codes(const uint8_t* p, bool high) {
#if KVJAX_AVX512
    if constexpr (L::kWidth == 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      __m512i x;
      if constexpr (Signed) {
        x = _mm512_cvtepi8_epi32(bytes);
        x = high ? _mm512_srai_epi32(x, 4) : _mm512_srai_epi32(_mm512_slli_epi32(x, 28), 28);
      } else {
        x = _mm512_cvtepu8_epi32(bytes);
        x = high ? _mm512_srli_epi32(x, 4) : _mm512_and_si512(x, _mm512_set1_epi32(15));
      }
      return _mm512_cvtepi32_ps(x);
    }
#endif
    if constexpr (L::kWidth == 8) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
      __m256i x;
      if constexpr (Signed) {
        x = _mm256_cvtepi8_epi32(bytes);
        x = high ? _mm256_srai_epi32(x, 4) : _mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28);
      } else {
        x = _mm256_cvtepu8_epi32(bytes);
        x = high ? _mm256_srli_epi32(x, 4) : _mm256_and_si256(x, _mm256_set1_epi32(15));
      }
      return _mm256_cvtepi32_ps(x);
    }
  }
#endif
};

#if KVJAX_AVX2
// Columns [C0, C0 + C * L::kWidth) of `src` for R rows; y's rows are `ldy` floats apart. (C0 is a template argument,
// so every column offset is a constant, as when the tiles read a bare pointer.)
template <typename L, int R, int C, int C0, typename Src>
inline void Tile(const float* x, int64_t ldx, int64_t K, const Src& src, const float* scale, float* y, int64_t ldy,
                 int64_t ahead) {
  using V = typename L::V;
  V acc[R][C];
  {
    V wv[C];
    for (int j = 0; j < C; ++j) wv[j] = src.template Load<L>(0, C0 + j * L::kWidth);
    for (int r = 0; r < R; ++r) {
      const V b = L::Set1(x[r * ldx]);
      for (int j = 0; j < C; ++j) acc[r][j] = L::Mul(b, wv[j]);
    }
  }
  constexpr int64_t kLineElems = 64 / Src::kElemBytes;
  // One step over k; the prefetching steps and the last `ahead` ones as two loops, not a branch in one: with the branch
  // GCC stored the 24 accumulators of a 6-row tile to the stack on every step (the f32 9-row product chain 1.10x slower)
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    V wv[C];
    for (int j = 0; j < C; ++j) wv[j] = src.template Load<L>(k, C0 + j * L::kWidth);
    for (int r = 0; r < R; ++r) {
      const V b = L::Set1(x[r * ldx + k]);
      for (int j = 0; j < C; ++j) acc[r][j] = L::Fma(b, wv[j], acc[r][j]);
    }
  };
  const int64_t k_pf = std::max<int64_t>(1, K - ahead);
  int64_t k = 1;
  for (; k < k_pf; ++k) {
    for (int64_t e = 0; e < C * L::kWidth; e += kLineElems)
      __builtin_prefetch(static_cast<const char*>(src.Row(k + ahead)) + src.Offset(C0 + e));
    step(k);
  }
  for (; k < K; ++k) step(k);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j)
      L::Store(y + r * ldy + j * L::kWidth, scale ? L::Mul(acc[r][j], L::LoadF(scale + j * L::kWidth)) : acc[r][j]);
}

template <typename L, int RMax, int C, int C0, typename Src>
inline void Tiles(const float* x, int64_t ldx, int64_t K, const Src& src, const float* scale, float* y, int64_t ldy,
                  int64_t M, int64_t ahead) {
  for (int64_t m0 = 0; m0 < M; m0 += RMax) {
    const float* xm = x + m0 * ldx;
    float* ym = y + m0 * ldy;
    switch (std::min<int64_t>(RMax, M - m0)) {
      case 1: Tile<L, 1, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
      case 2: Tile<L, 2, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
      case 3: if constexpr (RMax >= 3) Tile<L, 3, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
      case 4: if constexpr (RMax >= 4) Tile<L, 4, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
      case 5: if constexpr (RMax >= 5) Tile<L, 5, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
      case 6: if constexpr (RMax >= 6) Tile<L, 6, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
      case 7: if constexpr (RMax >= 7) Tile<L, 7, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
      case 8: if constexpr (RMax >= 8) Tile<L, 8, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
      default: if constexpr (RMax >= 9) Tile<L, 9, C, C0>(xm, ldx, K, src, scale, ym, ldy, ahead); break;
    }
  }
}
#endif

// Columns [n0, n1) of a group of at most kGroupRows rows by register tiles, the columns no whole tile covers by `Panel`
// (x's rows `ldx` apart, as in `Panel`).
template <typename T>
void TilePanel(const float* x, int64_t ldx, const T* w, const float* scale, float* y, int64_t M, int64_t K, int64_t N,
               int64_t n0, int64_t n1) {
  int64_t c = n0;
  if (K > 0) {
#if KVJAX_AVX512
    using L = kvjax_native::Lanes16;
    constexpr int kRows = 6, kRegs = 4;  // 24 accumulators + 4 weight registers + a broadcast of 32
#elif KVJAX_AVX2
    using L = kvjax_native::Lanes8;
    constexpr int kRows = 2, kRegs = 4;  // 8 + 4 + 1 of 16
#endif
#if KVJAX_AVX2
    constexpr int64_t kBlock = kRegs * L::kWidth;
    const int64_t ahead = std::clamp<int64_t>(4096 / (kBlock * static_cast<int64_t>(sizeof(T))), 4, 32);
    for (; c + kBlock <= n1; c += kBlock)
      Tiles<L, kRows, kRegs, 0>(x, ldx, K, Stored<T>{w + c, N}, scale ? scale + c : nullptr, y + c, N, M, ahead);
#endif
  }
  if (c < n1) Panel(x, ldx, w, scale, y, M, K, N, c, n1);
}

// y[:, n0:n1] from the chunks' partial sums parts[c] (each [M, N]): added in chunk order, then times the column's
// scale.
void AddChunks(const float* parts, int64_t chunks, const float* scale, float* y, int64_t M, int64_t N, int64_t n0,
               int64_t n1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) {
      float acc = parts[m * N + n];
      for (int64_t c = 1; c < chunks; ++c) acc += parts[c * M * N + m * N + n];
      y[m * N + n] = scale ? acc * scale[n] : acc;
    }
}

template <typename T>
ffi::Error MatmulImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, const float* scale,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("w must be rank 2 [K, N]");
  if (xd.size() < 1) return ffi::Error::InvalidArgument("x must have rank >= 1");
  const int64_t K = wd[0], N = wd[1];
  if (xd[xd.size() - 1] != K) return ffi::Error::InvalidArgument("x's last dimension must equal w's first");
  const int64_t M = K > 0 ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (y->element_count() != static_cast<size_t>(M * N)) return ffi::Error::InvalidArgument("y must be [M, N]");
  const float* xp = x.typed_data();
  const T* wp = reinterpret_cast<const T*>(w.untyped_data());
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  // Units of whole 32-column runs, balanced: at least two per thread where N allows (a loaded machine's late thread
  // then costs less), at most PanelColumns(rows of a group) columns each; with k in chunks (`KChunks`), every chunk
  // has its own units, writing its partial sums apart, and the chunks' sums are added in order at the end.
  kvjax_native::Workers pool(xla_pool);
  const int64_t chunks = KChunks(K, N * static_cast<int64_t>(sizeof(T)), sizeof(T));
  // Register tiles take whole 64-column blocks and keep no partial sums in L1, so their units need no width cap.
  const bool tiles = M >= kTileMinRows;
  const int64_t align = tiles ? 64 : 32;
  const int64_t runs = (N + align - 1) / align;
  const int64_t panel = PanelColumns(std::min(M, kGroupRows));
  const int64_t want = (2 * pool.threads() + chunks - 1) / chunks;
  const int64_t units = std::min(runs, std::max<int64_t>(want, tiles ? runs / 8 : (N + panel - 1) / panel));
  const int64_t groups = (M + kGroupRows - 1) / kGroupRows;
  thread_local std::vector<float> parts;  // the calling thread's: workers use `out`, never `parts` itself
  if (chunks > 1 && static_cast<int64_t>(parts.size()) < chunks * M * N) parts.resize(chunks * M * N);
  float* out = chunks > 1 ? parts.data() : yp;
  pool.Run(chunks * units * groups, [&](int64_t u) {
    const int64_t p = u % units, g = u / units % groups, c = u / (units * groups);
    const int64_t m0 = g * kGroupRows, mn = std::min(kGroupRows, M - m0);
    const int64_t k0 = c * K / chunks, k1 = (c + 1) * K / chunks;
    const int64_t n0 = std::min(N, p * runs / units * align), n1 = std::min(N, (p + 1) * runs / units * align);
    if (n0 >= n1) return;
    if (tiles)
      TilePanel(xp + m0 * K + k0, K, wp + k0 * N, chunks > 1 ? nullptr : scale, out + c * M * N + m0 * N, mn, k1 - k0,
                N, n0, n1);
    else
      Panel(xp + m0 * K + k0, K, wp + k0 * N, chunks > 1 ? nullptr : scale, out + c * M * N + m0 * N, mn, k1 - k0, N,
            n0, n1);
  });
  if (chunks > 1)
    pool.Run(units, [&](int64_t p) {
      AddChunks(out, chunks, scale, yp, M, N, std::min(N, p * runs / units * align),
                std::min(N, (p + 1) * runs / units * align));
    });
  return ffi::Error::Success();
}

ffi::Error MatmulBf16(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::BF16) return ffi::Error::InvalidArgument("w must be bf16");
  return MatmulImpl<uint16_t>(xla_pool, x, w, nullptr, y);
}

ffi::Error MatmulI8(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                    ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::S8) return ffi::Error::InvalidArgument("w must be int8");
  auto wd = w.dimensions(), sd = scale.dimensions();
  if (wd.size() != 2 || sd.size() != 1 || sd[0] != wd[1])
    return ffi::Error::InvalidArgument("scale must be f32[N] for w [K, N]");
  return MatmulImpl<int8_t>(xla_pool, x, w, scale.typed_data(), y);
}

ffi::Error MatmulF32(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::F32) return ffi::Error::InvalidArgument("w must be f32");
  return MatmulImpl<float>(xla_pool, x, w, nullptr, y);
}

// ------------------------------------------------------------------------------------------------ packed weights
// w [P, K, 64] (f32, bf16 holding exactly f32 weights, or int8 codes with scale f32[64P]): panel p holds columns
// [64p, 64p + 64) of a [K, N = 64P] matrix, its 64 weights of each k contiguous (`pallas_kernels.linear.pack_f32` /
// `pack_int8`). A tile then reads its weights as one contiguous stream instead of K runs of 64 weights N elements apart
// (which the hardware prefetchers follow poorly: a 9-row tile over SmolLM2's f32 [576, 3072] read 5.2-5.9 GB/s strided
// vs 7.2-8.5 packed on one core). The same chains as the plain matrix's product (`MatmulImpl`): a plain product at
// k = 0, then one FMA per k in order, times the column's scale once -- so packed and plain weights give the same bits,
// for any number of rows (one row included). f32 and int8 rows take no k chunks in the plain product either (`KChunks`
// splits plain bf16 rows only), so a packed product is one pass; bf16 panels (exactly f32 weights, `MatmulF32Packed`)
// take the f32 panels' chains.
// `panel(p)`: panel p's weights as a tile source (`Stored` or `Affine`); `scale`: int8 codes' column scales, or null.
template <typename Panel>
void PackedPanels(const float* x, int64_t ldx, const Panel& panel, int64_t K, const float* scale, float* y, int64_t N,
                  int64_t M, int64_t p0, int64_t p1) {
  constexpr int64_t kPanel = 64;
  for (int64_t p = p0; p < p1; ++p) {
    const auto src = panel(p);
    using Src = std::decay_t<decltype(src)>;
    const float* sp = scale ? scale + p * kPanel : nullptr;
    float* yp = y + p * kPanel;
    if (K == 0) {
      for (int64_t m = 0; m < M; ++m) std::fill(yp + m * N, yp + m * N + kPanel, 0.0f);
      continue;
    }
#if KVJAX_AVX2
    const int64_t ahead = std::clamp<int64_t>(4096 / (kPanel * Src::kElemBytes), 16, 64);
#endif
#if KVJAX_AVX512
    // Weights made in registers (codes): a tile unpacks its weights once per k for its rows, so fewer row tiles unpack
    // less -- 9 rows as one tile of 2 registers of columns per half panel (26 vector ops per k and 32 columns: 2
    // unpacks, 18 + 2 FMAs) rather than tiles of 6 and 3 rows over 4 registers (each unpacking all 64 columns).
    // Measured, SmolLM2's 120 4-bit products as a chain, 9 rows, one process: 0.87-0.90x the time, the same bits.
    if (Src::kMade && (M + 8) / 9 < (M + 5) / 6) {
      Tiles<kvjax_native::Lanes16, 9, 2, 0>(x, ldx, K, src, sp, yp, N, M, ahead);
      Tiles<kvjax_native::Lanes16, 9, 2, 32>(x, ldx, K, src, sp ? sp + 32 : nullptr, yp + 32, N, M, ahead);
    } else {
      Tiles<kvjax_native::Lanes16, 6, 4, 0>(x, ldx, K, src, sp, yp, N, M, ahead);
    }
#elif KVJAX_AVX2
    Tiles<kvjax_native::Lanes8, 2, 4, 0>(x, ldx, K, src, sp, yp, N, M, ahead);
    Tiles<kvjax_native::Lanes8, 2, 4, 32>(x, ldx, K, src, sp ? sp + 32 : nullptr, yp + 32, N, M, ahead);
#else
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < kPanel; ++c) {
        float acc = x[m * ldx] * src.At(0, c);
        for (int64_t k = 1; k < K; ++k) acc = std::fma(x[m * ldx + k], src.At(k, c), acc);
        yp[m * N + c] = sp ? acc * sp[c] : acc;
      }
#endif
  }
}

// Checks x against packed weights of K rows and P panels, then runs `PackedPanels` over units of whole panels (at
// least two per thread where P allows), rows in groups of kGroupRows (each group a pass over the weights, its tiles'
// rows sharing each weight load).
template <typename Panel>
ffi::Error PackedProduct(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, int64_t P, int64_t K, const Panel& panel,
                         const float* scale, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  if (xd.size() < 1) return ffi::Error::InvalidArgument("x must have rank >= 1");
  const int64_t N = P * 64;
  if (xd[xd.size() - 1] != K) return ffi::Error::InvalidArgument("x's last dimension must equal w's K");
  const int64_t M = K > 0 ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (y->element_count() != static_cast<size_t>(M * N)) return ffi::Error::InvalidArgument("y must be [M, 64P]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  kvjax_native::Workers pool(xla_pool);
  const int64_t units = kvjax_native::PanelUnits(pool, P);
  const int64_t groups = (M + kGroupRows - 1) / kGroupRows;
  pool.Run(units * groups, [&](int64_t u) {
    const int64_t p = u % units, g = u / units;
    const int64_t m0 = g * kGroupRows, mn = std::min(kGroupRows, M - m0);
    PackedPanels(xp + m0 * K, K, panel, K, scale, yp + m0 * N, N, mn, p * P / units, (p + 1) * P / units);
  });
  return ffi::Error::Success();
}

template <typename T>
ffi::Error MatmulPackedImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, const float* scale,
                            ffi::ResultBuffer<ffi::F32> y) {
  auto wd = w.dimensions();
  if (wd.size() != 3 || wd[2] != 64) return ffi::Error::InvalidArgument("w must be packed [P, K, 64]");
  const T* wp = reinterpret_cast<const T*>(w.untyped_data());
  const int64_t K = wd[1];
  return PackedProduct(xla_pool, x, wd[0], K, [=](int64_t p) { return Stored<T>{wp + p * K * 64, 64}; }, scale, y);
}

// f32 panels, or bf16 panels holding f32 weights that are every one exactly a bf16 value (`pallas_kernels.linear.
// pack_f32`: a checkpoint stored in bf16 and loaded as f32). Widening bf16 to f32 is exact (a 16-bit shift), so a
// bf16 panel gives its tiles the f32 weights themselves and the f32 panels' chains (a packed product takes no k
// chunks, unlike the plain bf16 product, `KChunks`): the same bits at half the bytes read.
ffi::Error MatmulF32Packed(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                           ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() == ffi::DataType::BF16) return MatmulPackedImpl<uint16_t>(xla_pool, x, w, nullptr, y);
  if (w.element_type() != ffi::DataType::F32) return ffi::Error::InvalidArgument("w must be f32 or bf16");
  return MatmulPackedImpl<float>(xla_pool, x, w, nullptr, y);
}

ffi::Error MatmulI8Packed(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                          ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  if (w.element_type() != ffi::DataType::S8) return ffi::Error::InvalidArgument("w must be int8");
  auto wd = w.dimensions(), sd = scale.dimensions();
  if (wd.size() != 3 || sd.size() != 1 || sd[0] != wd[0] * 64)
    return ffi::Error::InvalidArgument("scale must be f32[64P] for w [P, K, 64]");
  return MatmulPackedImpl<int8_t>(xla_pool, x, w, scale.typed_data(), y);
}

// Packed block-affine codes (`pallas_kernels.affine.PackedAffine`): q int8[P, K, 64] as the f32 panels (or [P, K, 32],
// 4-bit codes two per byte, `Affine4`: uint8 unsigned, int8 signed), d and m f32[P, K / kAffineBlock, 64]; weight
// (k, c) of panel p is fma(q, d, m) of its block -- the f32 weight itself, so the chains and bits are
// `MatmulF32Packed`'s on the f32 panels, at 1.25 (or 0.75) bytes per weight read instead of 4.
ffi::Error MatmulAffinePacked(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                              ffi::Buffer<ffi::F32> d, ffi::Buffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> y) {
  const bool unsigned_nibbles = q.element_type() == ffi::DataType::U8;
  if (!unsigned_nibbles && q.element_type() != ffi::DataType::S8)
    return ffi::Error::InvalidArgument("q must be int8 or uint8");
  auto qd = q.dimensions(), dd = d.dimensions(), md = m.dimensions();
  const bool nibbles = qd.size() == 3 && qd[2] == 32;
  if (qd.size() != 3 || (qd[2] != 32 && (unsigned_nibbles || qd[2] != 64)))
    return ffi::Error::InvalidArgument("q must be packed [P, K, 64] int8, or [P, K, 32] 4-bit codes (uint8 / int8)");
  const int64_t P = qd[0], K = qd[1], B = K / kAffineBlock;
  if (K % kAffineBlock) return ffi::Error::InvalidArgument("q's K must be a multiple of 32");
  for (auto s : {dd, md})
    if (s.size() != 3 || s[0] != P || s[1] != B || s[2] != 64)
      return ffi::Error::InvalidArgument("d and m must be f32[P, K / 32, 64] for q [P, K, 64]");
  const float *dp = d.typed_data(), *mp = m.typed_data();
  if (nibbles) {
    const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.untyped_data());
    if (unsigned_nibbles)
      return PackedProduct(xla_pool, x, P, K, [=](int64_t p) {
        return Affine4<false>{qp + p * K * 32, dp + p * B * 64, mp + p * B * 64};
      }, nullptr, y);
    return PackedProduct(xla_pool, x, P, K, [=](int64_t p) {
      return Affine4<true>{qp + p * K * 32, dp + p * B * 64, mp + p * B * 64};
    }, nullptr, y);
  }
  const int8_t* qp = reinterpret_cast<const int8_t*>(q.untyped_data());
  return PackedProduct(xla_pool, x, P, K, [=](int64_t p) {
    return Affine{qp + p * K * 64, dp + p * B * 64, mp + p * B * 64};
  }, nullptr, y);
}

// The handlers' bindings: x f32 and w (its dtype checked by each handler) to y f32, and with a scale f32[N] for int8.
auto ProductBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>()
      .Ret<ffi::Buffer<ffi::F32>>();
}
auto ScaledProductBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulBf16, MatmulBf16, ProductBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulI8, MatmulI8, ScaledProductBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulF32, MatmulF32, ProductBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulF32Packed, MatmulF32Packed, ProductBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulI8Packed, MatmulI8Packed, ScaledProductBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulAffinePacked, MatmulAffinePacked,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
