// A draft's products with 4-bit block codes, or int8 codes, by integer dot products, as XLA FFI custom calls: the row
// is quantised to int16 per block of 32 k, and codes times row codes accumulate exactly in int32 (VPDPWSSD where the
// CPU has AVX-512 VNNI). The int8 codes' product (`MatmulIntDot8`) is described where it is defined, below.
//
// Inputs  x f32[M, K] (any leading shape, flattened to M rows), q uint8[P, K / 2, 64] (below), d f16[P, K / 32, 64],
//         m (d's shape)
// Output  y f32[M, 64P]
//
// Semantics (`pallas_kernels.int_dot.int_dot_reference`): for each row r and block b of 32 k, amax = max |x[r, k]|,
// xs = amax / 32767, xq[k] = rint(x[r, k] * (32767 / amax)) (0 where amax = 0), xsum = the block's sum of x in k
// order; then y[r, n] = sum over b in order of fma(m[b, n], xsum, fma(d[b, n] * xs, (sum_k q[k, n] * xq[k]), .)), the
// integer sum exact; a block holding NaN or inf makes its row NaN. Lossy (the row's quantisation, ~1e-5 relative): for
// drafts only, never for what verification reads.
//
// Layout of q (`pallas_kernels.int_dot.int_dot_codes` makes it from a `PackedAffine`'s 4-bit panels): panel p, k pair
// g (k = 2g, 2g + 1): 64 bytes; byte 32s + 2i + j holds, in its low nibble, the code of column 16s + i at k = 2g + j
// and, in its high nibble, that of column 32 + 16s + i. One 512-bit load, its nibbles masked (and shifted), and each
// 256-bit half widened to 16-bit words gives four registers of 16 columns x 2 k -- VPDPWSSD's operand order (two
// products of words summed into each 32-bit lane), each row's x pair broadcast as 32 bits.
//
// Why: a draft token reads every weight, and the exact 4-bit product (`matmul.cc`, `Affine4`) makes each weight in f32
// (widen, convert, fma(q, d, m)) before its FMA: 5 vector ops per 16 weights, about as long as streaming their bytes,
// and the two do not overlap. Here 128 weights cost one load, 3 masks and shifts, 6 widenings and 4 dot instructions
// per row. (int8 rows -- llama.cpp's Q4 x Q8 dot, VPDPBUSD, half these ops -- cut SmolLM2's acceptance at 8K from 7.53
// to 7.00 tokens per round of 8, more than their speed gave back; int16 rows keep the draft's guesses.)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "pool.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define KVJAX_INT_DOT_VNNI 1
#else
#define KVJAX_INT_DOT_VNNI 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;       // k per (d, m) and per row scale
constexpr int64_t kPanel = 64;       // columns per panel
constexpr int kMaxRows = 4;          // rows sharing each load of codes
constexpr float kTop = 32767.0f;     // the largest int16 code of a row

// Rows quantised: xq as k pairs (2 int16 in one int32), per block its scale and its sum.
struct QuantRows {
  std::vector<int32_t> pairs;     // [M, K / 2]
  std::vector<float> scale, sum;  // [M, K / 32]
};

QuantRows Quantise(const float* x, int64_t M, int64_t K) {
  const int64_t B = K / kBlock;
  QuantRows Q;
  Q.pairs.resize(M * K / 2);
  Q.scale.resize(M * B);
  Q.sum.resize(M * B);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < B; ++b) {
      const float* xb = x + r * K + b * kBlock;
      float amax = 0.0f, s = 0.0f;
      bool finite = true;
      for (int64_t i = 0; i < kBlock; ++i) {
        finite = finite && std::isfinite(xb[i]);
        amax = std::max(amax, std::fabs(xb[i]));
        s += xb[i];
      }
      // a block holding NaN or inf: codes 0 and a NaN scale, so the row's results are NaN (never a cast of NaN)
      const float inv = finite && amax > 0.0f ? kTop / amax : 0.0f;
      int16_t q[kBlock];
      for (int64_t i = 0; i < kBlock; ++i) q[i] = finite ? static_cast<int16_t>(std::nearbyint(xb[i] * inv)) : 0;
      std::memcpy(Q.pairs.data() + r * K / 2 + b * kBlock / 2, q, sizeof(q));
      Q.scale[r * B + b] = finite ? amax / kTop : NAN;
      Q.sum[r * B + b] = s;
    }
  return Q;
}

// 64 f16 values as f32 (exact).
inline void HalvesToFloats(const uint16_t* h, float* out) {
#if KVJAX_INT_DOT_VNNI
  for (int c = 0; c < 4; ++c)
    _mm512_storeu_ps(out + 16 * c, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + 16 * c))));
#else
  for (int64_t n = 0; n < kPanel; ++n) {
    const uint32_t sign = (h[n] & 0x8000u) << 16, e = (h[n] >> 10) & 31, f = h[n] & 1023;
    float v;
    if (e == 0) {
      v = std::ldexp(static_cast<float>(f), -24);  // zero or subnormal
    } else if (e == 31) {
      v = f ? NAN : INFINITY;
    } else {
      v = std::ldexp(static_cast<float>(f | 1024), static_cast<int>(e) - 25);
    }
    out[n] = sign ? -v : v;
  }
#endif
}

// ------------------------------------------------------------------------------------------------ the codes
// A panel's codes as the block sums read them. `Widen(g, w)`: k pair g as four registers of 16 columns x 2 k in
// 16-bit words (columns 0-15, 16-31, 32-47, 48-63: VPDPWSSD's operand order); `At(g, n, j)`: the code of column n at
// k = 2g + j (the portable loop).
struct Nibbles {  // 4-bit codes: byte 32s + 2i + j holds column 16s + i (low nibble) and column 32 + 16s + i (high)
  static constexpr int64_t kPairBytes = 64;
  const uint8_t* q;
#if KVJAX_INT_DOT_VNNI
  void Widen(int64_t g, __m512i* w) const {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i v = _mm512_loadu_si512(q + g * kPairBytes);
    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    w[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(lo));
    w[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(lo, 1));
    w[2] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(hi));
    w[3] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(hi, 1));
  }
#endif
  int32_t At(int64_t g, int n, int j) const {
    const uint8_t byte = q[g * kPairBytes + 32 * ((n % 32) / 16) + 2 * (n % 16) + j];
    return n < 32 ? byte & 15 : byte >> 4;
  }
};

struct Bytes {  // int8 codes: byte 32s + 2i + j holds column 16s + i
  static constexpr int64_t kPairBytes = 2 * kPanel;
  const int8_t* q;
#if KVJAX_INT_DOT_VNNI
  void Widen(int64_t g, __m512i* w) const {
    for (int c = 0; c < 4; ++c)
      w[c] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + g * kPairBytes + 32 * c)));
  }
#endif
  int32_t At(int64_t g, int n, int j) const { return q[g * kPairBytes + 32 * (n / 16) + 2 * (n % 16) + j]; }
};

// The integer sums of rows [r0, r0 + R) against block b (16 k pairs) of a panel's codes: isum[r][n], exact.
template <int R, typename Codes>
void BlockSums(const Codes& codes, const QuantRows& Q, int64_t pairs, int64_t b, int64_t r0, int32_t (*isum)[kPanel]) {
  const int64_t g0 = b * (kBlock / 2), g1 = g0 + kBlock / 2;
#if KVJAX_INT_DOT_VNNI
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t g = g0; g < g1; ++g) {
    const char* ahead = reinterpret_cast<const char*>(codes.q + g * Codes::kPairBytes) + 2048;  // 2 KiB on
    for (int64_t o = 0; o < Codes::kPairBytes; o += 64) _mm_prefetch(ahead + o, _MM_HINT_T0);
    __m512i w[4];
    codes.Widen(g, w);
    for (int r = 0; r < R; ++r) {
      const __m512i xb = _mm512_set1_epi32(Q.pairs[(r0 + r) * pairs + g]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpwssd_epi32(acc[r][c], w[c], xb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_si512(isum[r] + 16 * c, acc[r][c]);
#else
  // the same integer sums, one product at a time (exact in any order)
  for (int r = 0; r < R; ++r) std::fill(isum[r], isum[r] + kPanel, 0);
  for (int64_t g = g0; g < g1; ++g)
    for (int r = 0; r < R; ++r) {
      int16_t xq[2];
      std::memcpy(xq, &Q.pairs[(r0 + r) * pairs + g], sizeof(xq));
      for (int n = 0; n < kPanel; ++n)
        for (int j = 0; j < 2; ++j) isum[r][n] += codes.At(g, n, j) * xq[j];
    }
#endif
}

// Panel p's 64 columns for rows [r0, r0 + R): block by block in order, the integer sums scaled into f32 sums by the
// codes' `Epilogue` (`Block(b)` once per block, `Row` once per row and block, `Add` per column), then y (row stride N)
// = `Out` of each sum.
template <int R, typename Codes, typename Epilogue>
void PanelRows(const Codes& codes, Epilogue e, const QuantRows& Q, int64_t K, int64_t r0, float* y, int64_t N) {
  const int64_t B = K / kBlock;
  float acc_y[R][kPanel];
  for (int r = 0; r < R; ++r) std::fill(acc_y[r], acc_y[r] + kPanel, 0.0f);
  for (int64_t b = 0; b < B; ++b) {
    int32_t isum[R][kPanel];
    BlockSums<R>(codes, Q, K / 2, b, r0, isum);
    e.Block(b);
    for (int r = 0; r < R; ++r) {
      e.Row(Q, (r0 + r) * B + b);
      for (int64_t n = 0; n < kPanel; ++n) acc_y[r][n] = e.Add(n, isum[r][n], acc_y[r][n]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t n = 0; n < kPanel; ++n) y[(r0 + r) * N + n] = e.Out(n, acc_y[r][n]);
}

// 4-bit codes: each block's sum times d * xs, plus m times the row's block sum.
struct AffineEpilogue {
  const uint16_t *d, *m;  // the panel's f16 [K / 32, 64]
  float db[kPanel], mb[kPanel], xs = 0.0f, xsum = 0.0f;
  void Block(int64_t b) {
    HalvesToFloats(d + b * kPanel, db);
    HalvesToFloats(m + b * kPanel, mb);
  }
  void Row(const QuantRows& Q, int64_t i) { xs = Q.scale[i], xsum = Q.sum[i]; }
  float Add(int64_t n, int32_t isum, float acc) const {
    return std::fma(mb[n], xsum, std::fma(db[n] * xs, static_cast<float>(isum), acc));
  }
  float Out(int64_t, float acc) const { return acc; }
};

// int8 codes: each block's sum times xs; the column's scale once at the end.
struct ScaleEpilogue {
  const float* scale;  // the panel's 64
  float xs = 0.0f;
  void Block(int64_t) {}
  void Row(const QuantRows& Q, int64_t i) { xs = Q.scale[i]; }
  float Add(int64_t, int32_t isum, float acc) const { return std::fma(xs, static_cast<float>(isum), acc); }
  float Out(int64_t n, float acc) const { return acc * scale[n]; }
};

// Checks x [..., K] against y [M, 64P], quantises x's rows and calls rows(Q, p, r0, R) -- R a
// std::integral_constant -- for every panel p and group of up to kMaxRows rows [r0, r0 + R).
// Units of consecutive panels (`PanelUnits`, as `matmul.cc`'s packed products take them): a thread streams one
// contiguous run of codes, its prefetches running on into its next panel. One panel per unit, claimed in turn,
// gave each thread every other panel (a 9-36 KiB stream each, the prefetch ahead landing in the other thread's
// panel): measured on a 2-core Zen 4, SmolLM2's 121 one-row products of a draft token as a dependent chain 0.75-0.89x
// the time (medians of 20-40 alternations), and in the model a draft token 0.90x (7.48 -> 6.74 ms), the same bits --
// the panels' arithmetic is unchanged, only which thread runs which.
template <typename Rows>
ffi::Error ForPanelRows(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, int64_t P, int64_t K,
                        ffi::ResultBuffer<ffi::F32>& y, const Rows& rows) {
  auto xd = x.dimensions();
  const int64_t N = P * kPanel;
  if (xd.size() < 1 || xd[xd.size() - 1] != K) return ffi::Error::InvalidArgument("x's last dimension must equal K");
  const int64_t M = K > 0 ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (y->element_count() != static_cast<size_t>(M * N)) return ffi::Error::InvalidArgument("y must be [M, 64P]");
  if (M == 0 || N == 0) return ffi::Error::Success();
  if (K == 0) {
    std::fill(y->typed_data(), y->typed_data() + M * N, 0.0f);
    return ffi::Error::Success();
  }
  const QuantRows Q = Quantise(x.typed_data(), M, K);
  kvjax_native::Workers pool(xla_pool);
  const int64_t units = kvjax_native::PanelUnits(pool, P);
  pool.Run(units, [&](int64_t u) {
    for (int64_t p = u * P / units; p < (u + 1) * P / units; ++p)
      for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
        switch (std::min<int64_t>(kMaxRows, M - r0)) {
          case 1: rows(Q, p, r0, std::integral_constant<int, 1>()); break;
          case 2: rows(Q, p, r0, std::integral_constant<int, 2>()); break;
          case 3: rows(Q, p, r0, std::integral_constant<int, 3>()); break;
          default: rows(Q, p, r0, std::integral_constant<int, 4>()); break;
        }
      }
  });
  return ffi::Error::Success();
}

ffi::Error MatmulIntDot(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q,
                        ffi::Buffer<ffi::F16> d, ffi::Buffer<ffi::F16> m, ffi::ResultBuffer<ffi::F32> y) {
  auto qd = q.dimensions(), dd = d.dimensions(), md = m.dimensions();
  if (qd.size() != 3 || qd[2] != Nibbles::kPairBytes)
    return ffi::Error::InvalidArgument("q must be uint8 [P, K / 2, 64]");
  const int64_t P = qd[0], K = qd[1] * 2, B = K / kBlock, N = P * kPanel;
  if (K % kBlock) return ffi::Error::InvalidArgument("q's K must be a multiple of 32");
  for (auto s : {dd, md})
    if (s.size() != 3 || s[0] != P || s[1] != B || s[2] != kPanel)
      return ffi::Error::InvalidArgument("d and m must be f16[P, K / 32, 64] for q [P, K / 2, 64]");
  const uint8_t* qp = q.typed_data();
  const uint16_t* dp = reinterpret_cast<const uint16_t*>(d.untyped_data());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.untyped_data());
  float* yp = y->typed_data();
  return ForPanelRows(xla_pool, x, P, K, y, [&](const QuantRows& Q, int64_t p, int64_t r0, auto R) {
    const AffineEpilogue e{dp + p * B * kPanel, mp + p * B * kPanel};
    PanelRows<decltype(R)::value>(Nibbles{qp + p * (K / 2) * Nibbles::kPairBytes}, e, Q, K, r0, yp + p * kPanel, N);
  });
}

// ------------------------------------------------------------------------------------------------ int8 codes
// Inputs  x f32[M, K] (flattened as above), q int8[P, K / 2, 128] (below), scale f32[64P]
// Output  y f32[M, 64P]
//
// Semantics (`pallas_kernels.int_dot.int_dot8_reference`): the rows quantised as for the 4-bit codes; then
// y[r, n] = scale[n] * (sum over blocks b in order of fma(xs, (sum_k q[k, n] * xq[k]), .)), the integer sum exact (at
// most 32 * 127 * 32767 in magnitude); a block holding NaN or inf makes its row NaN. Lossy by the row's quantisation,
// for drafts only: int8 codes with a scale per column (`pallas_kernels.linear.Int8Weight`) made from a float model's
// weights.
//
// Layout of q (`pallas_kernels.int_dot.int_dot8_codes`): panel p, k pair g: 128 bytes; byte 32s + 2i + j holds the
// code of column 16s + i at k = 2g + j. Each 32-byte quarter widened to 16-bit words is one register of 16 columns x
// 2 k, VPDPWSSD's operand order, each row's x pair broadcast as 32 bits.
//
// Why: the exact int8 product (`matmul.cc`, `Stored<int8_t>`) widens each code to f32 (sign extension, conversion)
// before its FMA: 24 vector ops per 128 weights and row; here 4 widening loads per 128 weights and 4 dot instructions
// per row. Measured on a 2-core Zen 4, the bundled model's 8-token draft at 32K: 0.89-0.90x the exact int8 product's
// time in one process, the same drafts; over whole VeriCache runs the difference was inside the noise (README).
ffi::Error MatmulIntDot8(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                         ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  auto qd = q.dimensions();
  if (qd.size() != 3 || qd[2] != Bytes::kPairBytes)
    return ffi::Error::InvalidArgument("q must be int8 [P, K / 2, 128]");
  const int64_t P = qd[0], K = qd[1] * 2, N = P * kPanel;
  if (K % kBlock) return ffi::Error::InvalidArgument("q's K must be a multiple of 32");
  if (scale.element_count() != static_cast<size_t>(N)) return ffi::Error::InvalidArgument("scale must be f32[64P]");
  const int8_t* qp = q.typed_data();
  const float* sp = scale.typed_data();
  float* yp = y->typed_data();
  return ForPanelRows(xla_pool, x, P, K, y, [&](const QuantRows& Q, int64_t p, int64_t r0, auto R) {
    PanelRows<decltype(R)::value>(Bytes{qp + p * (K / 2) * Bytes::kPairBytes}, ScaleEpilogue{sp + p * kPanel}, Q, K, r0,
                                  yp + p * kPanel, N);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulIntDot, MatmulIntDot,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>().Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>().Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulIntDot8, MatmulIntDot8,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether the integer dot products run as VNNI instructions here (1) or one product at a time (0, the same results).
extern "C" int kvjax_native_int_dot_vnni() { return KVJAX_INT_DOT_VNNI; }
