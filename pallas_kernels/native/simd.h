// Vector helpers shared by the native kernels of this library: the f32 exponentials (AVX2 and AVX-512 forms and a
// scalar form with the same roundings), the exact bf16 -> f32 widening loads and the fixed-order reductions of 8 lane
// partials.

#ifndef KVJAX_NATIVE_SIMD_H_
#define KVJAX_NATIVE_SIMD_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVJAX_AVX2 1
#else
#define KVJAX_AVX2 0
#endif

namespace kvjax_native {

// ------------------------------------------------------------------------------------------------ exponentials
// 2^t for f32 (t <= 127): n = round(t), f = t - n in [-1/2, 1/2] (exact), 2^f by a degree-6 polynomial (Cephes'
// exp2f coefficients, |rel err| <= 1.7e-7), times 2^n (built in the exponent bits; VSCALEFPS on 16 lanes, the same
// product). t below kExp2Lo (-126) and NaN give exactly 0: masked scores (-inf) and underflow. `Exp2Scalar` is the
// same sequence of roundings one lane at a time (std::fma for each fused step, nearbyint for the round-to-nearest-
// even), so the scalar build's exponentials equal the vector builds' bit for bit.
//
// exp(x) is 2^(x * log2 e) with the product rounded once: relative error <= 2 ulp + |x| * 6e-8, so the ABSOLUTE error
// of exp(x) for x <= 0 stays below 7e-8 (measured over every f32 in [-20, 0] and a 1/64 sample of [-87, -20]) -- all a
// softmax's sums can see. The attention kernel passes t itself (the score times scale * log2 e minus the row's max
// times log2 e, one FMA), which saves the score's scaling, the subtraction and the range reduction's second step
// against the Cody-Waite form this replaced (11 multiply-class operations per 16 lanes -> 8; the bundled model's
// 9-row verify attention over 8K keys, interleaved, median of 300: 0.96-0.97x its time).
constexpr float kExpHi = 88.3762626647949f, kExp2Lo = -126.0f, kLog2e = 1.44269504088896341f;
constexpr float kC0 = 1.535336188319500e-4f, kC1 = 1.339887440266574e-3f, kC2 = 9.618437357674640e-3f,
                kC3 = 5.550332471162809e-2f, kC4 = 2.402264791363012e-1f, kC5 = 6.931472028550421e-1f;

inline float Exp2Scalar(float t) {
  if (!(t >= kExp2Lo)) return 0.0f;  // NaN and -inf too, as the vector forms
  const float n = std::nearbyint(t);
  const float f = t - n;
  float y = kC0;
  y = std::fma(y, f, kC1);
  y = std::fma(y, f, kC2);
  y = std::fma(y, f, kC3);
  y = std::fma(y, f, kC4);
  y = std::fma(y, f, kC5);
  y = std::fma(y, f, 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float e;
  std::memcpy(&e, &bits, sizeof e);
  return y * e;
}

// exp(x) for x <= kExpHi (inf above it).
inline float ExpScalar(float x) { return x > kExpHi ? INFINITY : Exp2Scalar(x * kLog2e); }


// ------------------------------------------------------------------------------------------------ widening loads
// bf16 -> f32, exactly: a bf16 is the high 16 bits of the f32 of the same value. Elements are float (f32 data,
// unchanged), uint16_t (bf16 bits) or int8_t (an int8 weight code, exact in f32); the vector forms load 8 (AVX2) or 16
// (AVX-512) consecutive elements.
inline float Widen(float x) { return x; }
inline float Widen(int8_t x) { return static_cast<float>(x); }
inline float Widen(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

#if KVJAX_AVX2
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 Load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

#if KVJAX_AVX2 && defined(__AVX512F__)
#define KVJAX_AVX512 1
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 Load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 Load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
#define KVJAX_AVX512 0
#endif

#if KVJAX_AVX2
// A register of f32 lanes: 8 (AVX2) or, where the CPU has AVX-512, 16. The kernels write one loop over `L` for both
// widths (attention's p.V, the few-row products); each lane performs the same chain at either width, so both give the
// scalar build's bits.
struct Lanes8 {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V Set1(float x) { return _mm256_set1_ps(x); }
  static V LoadF(const float* p) { return _mm256_loadu_ps(p); }
  template <typename T>
  static V Load(const T* p) { return Load8(p); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void Store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static void Pin(V& x) { __asm__("" : "+x"(x)); }
};
#if KVJAX_AVX512
struct Lanes16 {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V Set1(float x) { return _mm512_set1_ps(x); }
  static V LoadF(const float* p) { return _mm512_loadu_ps(p); }
  template <typename T>
  static V Load(const T* p) { return Load16(p); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void Store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static void Pin(V& x) { __asm__("" : "+v"(x)); }
};
#endif
#endif

#if KVJAX_AVX2
// ------------------------------------------------------------------------------------------------ vector exponentials
// 2^f for f in [-1/2, 1/2] on L's lanes: Exp2Scalar's polynomial, one FMA per coefficient in the same order.
template <typename L>
inline typename L::V Exp2Poly(typename L::V f) {
  typename L::V y = L::Set1(kC0);
  y = L::Fma(y, f, L::Set1(kC1));
  y = L::Fma(y, f, L::Set1(kC2));
  y = L::Fma(y, f, L::Set1(kC3));
  y = L::Fma(y, f, L::Set1(kC4));
  y = L::Fma(y, f, L::Set1(kC5));
  return L::Fma(y, f, L::Set1(1.0f));
}

// Exp2Scalar on 8 lanes. The kernel's arguments are t <= 0 (up to rounding), so there is no upper clamp on the hot
// path; t > 127 (never passed) is outside both forms' range (ExpScalar clamps exp's argument for its callers).
inline __m256 Exp2_8(__m256 t) {
  const __m256 in_range = _mm256_cmp_ps(t, _mm256_set1_ps(kExp2Lo), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 y = Exp2Poly<Lanes8>(_mm256_sub_ps(t, n));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), in_range);
}
// exp(x) = Exp2_8(x * log2 e) (ExpScalar's arithmetic on 8 lanes; arguments <= 0).
inline __m256 Exp8(__m256 x) { return Exp2_8(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e))); }

#if KVJAX_AVX512
// Exp2_8's sequence of roundings on 16 lanes, the same bits as Exp2_8 and Exp2Scalar for t < 127.5 (the softmax's
// t = fma(s, scale * log2 e, -m * log2 e) <= ~0): y * 2^n by one VSCALEFPS instead of building 2^n in the exponent
// bits and multiplying (cvt, add, shift, mul) -- both the exact product rounded once, denormal results included. Above
// 127.5 (n = 128) Exp2_8 gives inf where this gives the finite y * 2^128. Checked against Exp2Scalar on every float
// in [-130, 130), with and without flush-to-zero: equal bits below 127.5. Measured (the bundled model's 9-row verify
// attention at 32K, interleaved in one process, the same bits): 0.986-0.994x the time.
inline __m512 Exp2_16(__m512 t) {
  const __mmask16 in_range = _mm512_cmp_ps_mask(t, _mm512_set1_ps(kExp2Lo), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 y = Exp2Poly<Lanes16>(_mm512_sub_ps(t, n));
  return _mm512_maskz_scalef_ps(in_range, y, n);
}
#endif
#endif

// Sum of 8 lane partials in a fixed tree order (both builds).
inline float Reduce8(const float* a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

#if KVJAX_AVX2
// Reduce8 of each of 8 vectors at once, lane i = Reduce8(r[i]), operand for operand: hadd(x, y) = [x0+x1, x2+x3,
// y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]; after two levels the halves hold (l0+l1)+(l2+l3) and (l4+l5)+(l6+l7) of
// each vector, and one add across the 128-bit halves joins them.
inline __m256 Reduce8x8(const __m256* r) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(r[0], r[1]), _mm256_hadd_ps(r[2], r[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(r[4], r[5]), _mm256_hadd_ps(r[6], r[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

// Max of 8 lane maxima in a fixed order (both builds; std::max's comparison, so NaN and -0 fall the same way).
inline float Max8(const float* a) {
  float mx = -INFINITY;
  for (int i = 0; i < 8; ++i) mx = std::max(mx, a[i]);
  return mx;
}

}  // namespace kvjax_native

#endif  // KVJAX_NATIVE_SIMD_H_
