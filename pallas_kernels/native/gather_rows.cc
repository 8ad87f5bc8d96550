// Gathering a cache's rows on the CPU, as f32 or bf16, as an XLA FFI custom call (`kvjax.compress.base.sparse_part`: a
// draft's kept keys and values stored in f32 or bf16, made at compression and re-selected after verifications by the
// refreshing drafter; int8 codes have their own pass, gather_int8.cc).
//
// Inputs  x f32[B, K, S, D], pos s32[B, C] or s32[B, K, C] (a slot of x per row; -1, or a slot past S: an empty row)
// Output  rows f32 or bf16 [B, K, C, D]: x[b, k, pos] (an empty row: zeros)
//
// bf16 is f32 rounded to nearest, ties to even (a NaN becomes the quiet NaN 0x7fc0 with its sign) -- the conversion
// XLA:CPU's `astype(bfloat16)` performs, so both give the same bits.
//
// Why native: XLA:CPU fuses the jnp form (a gather of whole blocks, the empty rows' select and the conversion) into
// one loop that computes every element's source index on its own, ~1 ns per element: the bundled model's
// re-selection at 32K (4 layers, 2,048 bf16 slots per head) spent 2.4 of its 7.5 ms there. Here a row is one copy (or
// one pass of conversions) at memory speed.

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gather.h"
#include "pool.h"
#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace kvjax_native;  // Workers (workers.h), GatherShape, ForEachRow (gather.h)

// f32 -> bf16, round to nearest even; NaN -> the quiet NaN of its sign. Plain integer operations (the compiler
// vectorises the loop that calls it).
inline uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) & 0x8000u) | 0x7fc0u;
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

template <typename T>
inline void CopyRow(const float* x, int64_t D, T* out) {
  if constexpr (sizeof(T) == 4) {
    std::memcpy(out, x, D * sizeof(float));
  } else {
    for (int64_t d = 0; d < D; ++d) out[d] = ToBf16(x[d]);
  }
}

template <typename T>
void Gather(Workers& pool, const GatherShape& sh, const float* x, const int32_t* pos, T* out) {
  const int64_t D = sh.D;
  ForEachRow(pool, sh, x, pos, [&](int64_t r, const float* src) {
    T* o = out + r * D;
    if (src == nullptr) {  // an empty row
      std::fill(o, o + D, T{0});
    } else {
      CopyRow(src, D, o);
    }
  });
}

ffi::Error GatherRowsImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> pos,
                          ffi::Result<ffi::AnyBuffer> rows) {
  GatherShape sh;
  if (ffi::Error e = ReadGatherShape(x.dimensions(), pos.dimensions(), &sh); e.failure()) return e;
  if (rows->element_count() != static_cast<size_t>(sh.B * sh.K * sh.C * sh.D))
    return ffi::Error::InvalidArgument("rows must be [B, K, C, D]");
  Workers pool(xla_pool);
  if (rows->element_type() == ffi::DataType::F32) {
    Gather(pool, sh, x.typed_data(), pos.typed_data(), static_cast<float*>(rows->untyped_data()));
  } else if (rows->element_type() == ffi::DataType::BF16) {
    Gather(pool, sh, x.typed_data(), pos.typed_data(), static_cast<uint16_t*>(rows->untyped_data()));
  } else {
    return ffi::Error::InvalidArgument("rows must be f32 or bf16");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxGatherRows, GatherRowsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());
