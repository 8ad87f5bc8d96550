// The index of each row's largest value on the CPU, as an XLA FFI custom call (`pallas_kernels.argmax.argmax`): a
// greedy step's tokens from its logits.
//
// Input   x f32[..., V] (the leading dimensions flattened to M rows)
// Output  i s32[...]: per row the first index of its maximum -- or, where the row holds a NaN, of its first NaN, as
//         jnp.argmax (which counts NaN as the largest value) -- so the two give the same tokens.
//
// Why native: XLA:CPU runs jnp.argmax as a variadic reduce of values and indices at ~3 ns per element -- 0.16 ms of a
// SmolLM2 draft token or decode step (49,152 logits) and 0.84 ms of its 9-row verify (`scripts/bench_step_ops.py`:
// `iota_reduce_fusion`) -- where two vector passes over the row (its maximum, then the first lane equal to it; the
// row stays in L2 between them) take a few microseconds.

#include <cmath>
#include <cstdint>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The first index of x[0..V)'s maximum, or of its first NaN (V >= 1).
int32_t RowArgmax(const float* x, int64_t V) {
  int64_t j = 0;
  float m = x[0];
#if KVJAX_AVX512
  if (V >= 16) {
    __m512 vm = _mm512_loadu_ps(x);
    __mmask16 nan = _mm512_cmp_ps_mask(vm, vm, _CMP_UNORD_Q);
    for (j = 16; j + 16 <= V && !nan; j += 16) {
      const __m512 v = _mm512_loadu_ps(x + j);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      vm = _mm512_max_ps(vm, v);
    }
    if (nan) {  // a NaN in the last vector loaded: the first NaN of the row lies there or before
      for (int64_t i = 0; i < V; ++i)
        if (std::isnan(x[i])) return static_cast<int32_t>(i);
    }
    m = _mm512_reduce_max_ps(vm);
  }
#endif
  for (; j < V; ++j) {  // the rest (or, without AVX-512, the whole row)
    if (std::isnan(x[j])) {
      for (int64_t i = 0; i < V; ++i)
        if (std::isnan(x[i])) return static_cast<int32_t>(i);
    }
    m = x[j] > m ? x[j] : m;
  }
  if (std::isnan(m)) return 0;  // x[0] is NaN (the scans above start past it)
  int64_t i = 0;
#if KVJAX_AVX512
  const __m512 target = _mm512_set1_ps(m);
  for (; i + 16 <= V; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), target, _CMP_EQ_OQ);
    if (eq) return static_cast<int32_t>(i + __builtin_ctz(eq));
  }
#endif
  for (; i < V; ++i)
    if (x[i] == m) return static_cast<int32_t>(i);
  return 0;  // unreachable: m is one of the row's values
}

ffi::Error ArgmaxImpl(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> out) {
  auto dims = x.dimensions();
  if (dims.size() < 1 || dims[dims.size() - 1] < 1) return ffi::Error::InvalidArgument("x must be [..., V], V >= 1");
  const int64_t V = dims[dims.size() - 1];
  const int64_t M = static_cast<int64_t>(x.element_count()) / V;
  if (out->element_count() != static_cast<size_t>(M)) return ffi::Error::InvalidArgument("out must be x's rows");
  const float* xp = x.typed_data();
  int32_t* op = out->typed_data();
  for (int64_t r = 0; r < M; ++r) op[r] = RowArgmax(xp + r * V, V);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxArgmax, ArgmaxImpl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());
