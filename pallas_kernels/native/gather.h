// The row gathers' shared part (gather_int8.cc, gather_rows.cc): their shapes, read and checked once, and the loop
// that hands every output row its source row -- or none, for an empty one -- split among the threads.
#pragma once

#include <algorithm>
#include <cstdint>

#include "workers.h"
#include "xla/ffi/api/ffi.h"

namespace kvjax_native {

struct GatherShape {
  int64_t B, K, S, D, C;  // x [B, K, S, D]; C rows gathered per (b, k)
  bool per_head;          // pos is [B, K, C] (else [B, C], the same slots for every head)
};

// x [B, K, S, D], pos [B, C] or [B, K, C].
inline xla::ffi::Error ReadGatherShape(xla::ffi::Span<const int64_t> xd, xla::ffi::Span<const int64_t> pd,
                                       GatherShape* s) {
  using xla::ffi::Error;
  if (xd.size() != 4) return Error::InvalidArgument("x must be [B, K, S, D]");
  *s = GatherShape{xd[0], xd[1], xd[2], xd[3], 0, false};
  if (pd.size() == 3 && pd[0] == s->B && pd[1] == s->K) {
    s->per_head = true;
  } else if (!(pd.size() == 2 && pd[0] == s->B)) {
    return Error::InvalidArgument("pos must be [B, C] or [B, K, C]");
  }
  s->C = pd[pd.size() - 1];
  return Error::Success();
}

// Rows whose source is prefetched ahead of the row being written: a gathered row is a few lines at a slot the hardware
// cannot predict, so without it each row waited on memory in turn. Measured (2-core Zen 4; SmolLM2's re-selection
// shape, 2,048 of 8,192 slots per head, 3 heads, 60 cold caches in one jit, interleaved): 4 rows ahead 0.72x the time,
// 8 rows 0.66x, 16 rows 0.67x.
constexpr int64_t kRowsAhead = 8;

// row(r, src) for every output row r = (b * K + k) * C + c: src is x's row at slot pos, or nullptr where the slot is
// -1 or past S (an empty row). Rows in contiguous ranges, a few per thread.
template <typename Fn>
void ForEachRow(Workers& pool, const GatherShape& s, const float* x, const int32_t* pos, Fn&& row) {
  const int64_t rows = s.B * s.K * s.C;
  const int64_t units = std::min<int64_t>(pool.threads() * 4, std::max<int64_t>(rows, 1));
  auto source = [&](int64_t r) -> const float* {
    const int64_t b = r / (s.K * s.C), k = r / s.C % s.K, c = r % s.C;
    const int32_t p = pos[s.per_head ? r : b * s.C + c];
    return p < 0 || p >= s.S ? nullptr : x + ((b * s.K + k) * s.S + p) * s.D;
  };
  const int64_t row_bytes = s.D * static_cast<int64_t>(sizeof(float));
  pool.Run(units, [&](int64_t u) {
    const int64_t r1 = (u + 1) * rows / units;
    for (int64_t r = u * rows / units; r < r1; ++r) {
      if (r + kRowsAhead < r1)
        if (const char* next = reinterpret_cast<const char*>(source(r + kRowsAhead)))
          for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(next + off);
      row(r, source(r));
    }
  });
}

}  // namespace kvjax_native
