// Gathering a cache's rows as int8 codes on the CPU, as an XLA FFI custom call (`kvjax.compress.base.int8_part`: a
// draft's kept keys and values, made at compression and re-selected after verifications by the refreshing drafter).
//
// Inputs  x f32[B, K, S, D], pos s32[B, C] or s32[B, K, C] (a slot of x per row; -1, or a slot past S: an empty row)
// Outputs codes s8[B, K, C, D], scale f32[B, K, C]
//
// Row c of head k: amax = max_d |x[pos, d]|, scale = amax * f32(1 / 127), codes = round-half-even(x * (127 / amax))
// clamped to [-127, 127] (amax 0 or an empty row: codes 0, scale 0) -- the operations, in f32, of the jnp definition
// (`kvjax.cache.draft._absmax_int8` over `gather_tokens`), so both give the same codes and scales.
//
// Why native: XLA:CPU ran the jnp form (a row maximum, then a product with it broadcast over the row) at ~2 ns per
// element -- SmolLM2-135M's re-selection of 2,016 slots per head over 30 layers took 74 ms against 23 ms for the
// same gather to bf16 -- while this is one pass at memory speed.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "gather.h"
#include "pool.h"
#include "simd.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace kvjax_native;  // Workers (workers.h), GatherShape, ForEachRow (gather.h)

// One row: D values -> D codes and the scale. (The vector path computes the same values: a maximum is exact in any
// order, and the product, rounding and clamp are per element.)
inline void QuantiseRow(const float* x, int64_t D, int8_t* codes, float* scale) {
  float amax = 0.0f;
  int64_t d0 = 0;
#if KVJAX_AVX512
  const int64_t D16 = D / 16 * 16;
  if (D16 > 0) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t d = 0; d < D16; d += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
    amax = _mm512_reduce_max_ps(m);
  }
  for (int64_t d = D16; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  const __m512 vi = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (; d0 < D16; d0 += 16) {
    const __m512 c = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(x + d0), vi),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + d0),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, c)))));
  }
#else
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
#endif
  for (int64_t d = d0; d < D; ++d) {
    const float c = std::nearbyint(x[d] * inv);  // the default rounding mode: half to even, as jnp.round
    codes[d] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, c)));
  }
  *scale = amax * (1.0f / 127.0f);  // the jnp form's product (XLA turns a division by a constant into one)
}

ffi::Error GatherInt8Impl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> pos,
                          ffi::ResultBuffer<ffi::S8> codes, ffi::ResultBuffer<ffi::F32> scale) {
  GatherShape sh;
  if (ffi::Error e = ReadGatherShape(x.dimensions(), pos.dimensions(), &sh); e.failure()) return e;
  int8_t* out = codes->typed_data();
  float* sc = scale->typed_data();
  const int64_t D = sh.D;
  Workers pool(xla_pool);
  ForEachRow(pool, sh, x.typed_data(), pos.typed_data(), [&](int64_t r, const float* src) {
    int8_t* o = out + r * D;
    if (src == nullptr) {  // an empty row (the jnp form's zeros)
      std::fill(o, o + D, 0);
      sc[r] = 0.0f;
    } else {
      QuantiseRow(src, D, o, sc + r);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxGatherInt8, GatherInt8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
