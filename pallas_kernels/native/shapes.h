// The query/cache shapes kernel 0 (attention.cc) and the block masses (block_mass.cc) share, read and checked once.
#pragma once

#include <cstddef>
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace kvjax_native {

struct QKShape {
  int64_t B, T, N, D, K, S, G;  // T: query rows per sequence; G = N / K
  bool pos_per_head;            // k_pos is [B, K, S] (else [B, S])
};

// q [B, T, N, D], k [B, K, S, D] with N a multiple of K, k_pos [B, S] or [B, K, S], q_pos with B * T elements
// (`q_pos_message` names its shape in the error: attention's rows are T, the block masses' R).
inline xla::ffi::Error ReadQKShape(xla::ffi::Span<const int64_t> qd, xla::ffi::Span<const int64_t> kd,
                                   xla::ffi::Span<const int64_t> pd, size_t q_pos_count, const char* q_pos_message,
                                   QKShape* s) {
  using xla::ffi::Error;
  if (qd.size() != 4 || kd.size() != 4) return Error::InvalidArgument("q and k must be rank 4");
  *s = QKShape{qd[0], qd[1], qd[2], qd[3], kd[1], kd[2], 0, false};
  if (kd[0] != s->B || kd[3] != s->D || s->K == 0 || s->N % s->K != 0)
    return Error::InvalidArgument("k must be [B, K, S, D] with N a multiple of K");
  if (pd.size() == 3 && pd[0] == s->B && pd[1] == s->K && pd[2] == s->S) {
    s->pos_per_head = true;
  } else if (!(pd.size() == 2 && pd[0] == s->B && pd[1] == s->S)) {
    return Error::InvalidArgument("k_pos must be [B, S] or [B, K, S]");
  }
  if (q_pos_count != static_cast<size_t>(s->B * s->T)) return Error::InvalidArgument(q_pos_message);
  s->G = s->N / s->K;
  return Error::Success();
}

}  // namespace kvjax_native
