// A product with bf16 weights on the CPU, as an XLA FFI custom call: y = x @ w for a few rows x.
//
// Inputs  x f32[M, K] (any leading shape, flattened to M rows), w bf16[K, N] (row-major)
// Output  y f32[M, N]
//
// Why: a draft token reads every weight once; stored in bf16 they are half the bytes of f32, but XLA:CPU multiplies a
// bf16 matrix by converting it to an f32 copy first (reading 2 bytes, writing and re-reading 4 per weight). Here each
// weight is read once as bf16 and widened in registers (bf16 -> f32 is exact: a 16-bit shift).
//
// Tiling: threads take column panels (64-512 columns) of a group of up to 8 rows; within a panel the weights stream
// row by row in memory order while the rows' partial sums stay in L1. Each y[m, n] is one FMA chain over k in order
// (its first term a plain product), so a row's result does not depend on the other rows in the call, the panel width or
// the thread that ran it; the scalar build (no AVX2/FMA) does the same roundings with std::fma.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "pool.h"
#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using kvjax_native::Widen;
#if KVJAX_AVX2
using kvjax_native::Load8;
#endif
#if KVJAX_AVX512
using kvjax_native::Load16;
#endif

namespace {

constexpr int64_t kMaxPanel = 512;  // columns per thread unit at most: M rows' partial sums stay in L1 (M <= 8)
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead (in weight bytes of the panel's rows) to prefetch

// Where the CPU has AVX-512, 16 columns per instruction first: the same per-column FMA chain (vectorised across
// columns, never across k), so results equal the AVX2 and scalar builds bit for bit with half the instructions per
// weight. The widening loads (exact bf16 -> f32) are simd.h's, shared with the attention kernel.

// y[m0:m1, n0:n1] for a column range of at most kMaxPanel columns: k outer, so the weights stream in memory order
// (each of the K rows a contiguous run of the panel's columns; a run per page instead of a page per weight row for a
// narrow column tile) while the rows' partial sums stay in L1. Each y[m, n] is one FMA chain over k in order, its
// first term a plain product.
void Panel(const float* x, const uint16_t* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  if (K == 0) {
    for (int64_t m = 0; m < M; ++m) std::fill(y + m * N + n0, y + m * N + n1, 0.0f);
    return;
  }
#if KVJAX_AVX512
  const int64_t nw = width / 16 * 16;
#else
  const int64_t nw = 0;
#endif
#if KVJAX_AVX2
  const int64_t nv = width / 8 * 8;
#else
  const int64_t nv = 0;
#endif
  // rows ahead: a short run per row (a narrow panel) needs more rows in flight to cover the memory latency
  const int64_t ahead = std::clamp<int64_t>(kPrefetchBytes / (2 * width), 2, 64);
  for (int64_t k = 0; k < K; ++k) {
    const uint16_t* row = w + k * N + n0;
    if (k + ahead < K)
      for (int64_t c = 0; c < width; c += 32) __builtin_prefetch(row + ahead * N + c);
    for (int64_t m = 0; m < M; ++m) {
      float* ym = y + m * N + n0;
      const float xk = x[m * K + k];
#if KVJAX_AVX512
      const __m512 xw = _mm512_set1_ps(xk);
      if (k == 0) {
        for (int64_t c = 0; c < nw; c += 16) _mm512_storeu_ps(ym + c, _mm512_mul_ps(xw, Load16(row + c)));
      } else {
        for (int64_t c = 0; c < nw; c += 16)
          _mm512_storeu_ps(ym + c, _mm512_fmadd_ps(xw, Load16(row + c), _mm512_loadu_ps(ym + c)));
      }
#endif
#if KVJAX_AVX2
      const __m256 xb = _mm256_set1_ps(xk);
      if (k == 0) {
        for (int64_t c = nw; c < nv; c += 8) _mm256_storeu_ps(ym + c, _mm256_mul_ps(xb, Load8(row + c)));
      } else {
        for (int64_t c = nw; c < nv; c += 8)
          _mm256_storeu_ps(ym + c, _mm256_fmadd_ps(xb, Load8(row + c), _mm256_loadu_ps(ym + c)));
      }
#endif
      if (k == 0) {
        for (int64_t c = nv; c < width; ++c) ym[c] = xk * Widen(row[c]);
      } else {
        for (int64_t c = nv; c < width; ++c) ym[c] = std::fma(xk, Widen(row[c]), ym[c]);
      }
    }
  }
}

ffi::Error MatmulImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("w must be rank 2 [K, N]");
  if (xd.size() < 1) return ffi::Error::InvalidArgument("x must have rank >= 1");
  const int64_t K = wd[0], N = wd[1];
  if (xd[xd.size() - 1] != K) return ffi::Error::InvalidArgument("x's last dimension must equal w's first");
  const int64_t M = K > 0 ? static_cast<int64_t>(x.element_count()) / K : 0;
  if (y->element_count() != static_cast<size_t>(M * N)) return ffi::Error::InvalidArgument("y must be [M, N]");
  const float* xp = x.typed_data();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.untyped_data());
  float* yp = y->typed_data();
  if (M == 0 || N == 0) return ffi::Error::Success();
  // Units of whole 32-column runs (a 64-byte line of bf16 weights per row), balanced: at least two per thread where
  // N allows (a loaded machine's late thread then costs less), at most kMaxPanel columns each.
  kvjax_native::Workers pool(xla_pool);
  const int64_t runs = (N + 31) / 32;
  const int64_t units = std::min(runs, std::max<int64_t>(2 * pool.threads(), (N + kMaxPanel - 1) / kMaxPanel));
  // Rows in groups of 8 so a group's partial sums stay in L1 whatever M is.
  const int64_t groups = (M + 7) / 8;
  pool.Run(units * groups, [&](int64_t u) {
    const int64_t p = u % units, g = u / units, m0 = g * 8, mn = std::min<int64_t>(8, M - m0);
    const int64_t n0 = std::min(N, p * runs / units * 32), n1 = std::min(N, (p + 1) * runs / units * 32);
    if (n0 < n1) Panel(xp + m0 * K, wp, yp + m0 * N, mn, K, N, n0, n1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxMatmulBf16, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
