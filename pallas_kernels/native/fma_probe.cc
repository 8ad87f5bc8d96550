// The multiply-add rate of the calling thread, for benchmarks' arithmetic floors (`pallas_kernels.native.
// multiply_add_rate`): what a step that must do N multiply-adds cannot beat, measured in the same run as the step,
// as a reduction over the step's bytes is its memory floor (`scripts/bench_roofline.py`'s `Floor`).
//
// Twelve independent chains of the widest vector FMA the build has (AVX-512: 16 lanes, AVX2: 8, else one lane):
// more chains than an FMA's latency times the FMA units of current x86 cores, so the units, not a chain's latency,
// set the rate. Not a kernel: it computes nothing any result depends on, and it is not part of the library's
// arithmetic digest (`source_digest`).

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace {

constexpr int kChains = 12;

template <typename V, typename Fma>
double Run(int64_t iterations, V a, V b, Fma fma, int lanes, float* sink) {
  V acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = a;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = fma(acc[i], b);
    __asm__ volatile("" : "+x"(b));  // b opaque once per round: nothing is hoisted or folded across rounds
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  float sum = 0.0f;
  for (int i = 0; i < kChains; ++i) {
    float first;
    std::memcpy(&first, &acc[i], sizeof(float));  // lane 0 of each chain
    sum += first;
  }
  *sink = sum;
  return static_cast<double>(iterations) * kChains * lanes / (s > 0 ? s : 1e-9);
}

}  // namespace

// Multiply-adds per second of `iterations` rounds of kChains vector FMAs on the calling thread; `sink` receives a
// value derived from the chains (so that they are computed).
extern "C" double kvjax_fma_rate(int64_t iterations, float* sink) {
#if KVJAX_AVX512
  return Run(iterations, _mm512_set1_ps(1.0f), _mm512_set1_ps(0.999999f),
             [](__m512 x, __m512 y) { return _mm512_fmadd_ps(x, y, y); }, 16, sink);
#elif KVJAX_AVX2
  return Run(iterations, _mm256_set1_ps(1.0f), _mm256_set1_ps(0.999999f),
             [](__m256 x, __m256 y) { return _mm256_fmadd_ps(x, y, y); }, 8, sink);
#else
  return Run(iterations, 1.0f, 0.999999f, [](float x, float y) { return std::fma(x, y, y); }, 1, sink);
#endif
}
