// The threads a native kernel's call runs on: XLA's own intra-op pool where the runtime lends it to the custom call
// (the FFI `ThreadPool` context), else this library's `Pool` (pool.h).
//
// Why XLA's pool first: between our calls a decode step runs XLA's products on XLA's intra-op threads. Our own pool's
// worker is a third thread on a 2-core machine: after the products (0.5-1 ms per layer) it has gone to sleep and
// wakes late for the next attention call, or, spinning, takes a core from XLA's threads. XLA's threads have just run
// the products and are awake; using them adds no thread. `KVJAX_NATIVE_POOL=own` (or `set_pool(1)`) keeps the
// library's pool, for comparing the two in one process.

#ifndef KVJAX_NATIVE_WORKERS_H_
#define KVJAX_NATIVE_WORKERS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <utility>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace kvjax_native {

// 0: XLA's intra-op pool where lent, 1: always the library's pool.
inline std::atomic<int>& PoolChoice() {
  static std::atomic<int> choice{[] {
    const char* env = std::getenv("KVJAX_NATIVE_POOL");
    return env != nullptr && std::strcmp(env, "own") == 0 ? 1 : 0;
  }()};
  return choice;
}

class Workers {
 public:
  explicit Workers(xla::ffi::ThreadPool& xla_pool) : xla_(&xla_pool) {
    xla_threads_ = PoolChoice().load(std::memory_order_relaxed) == 0 ? xla_pool.num_threads() : 0;
  }
  // Threads a call's units are spread over (the caller included).
  int64_t threads() const { return xla_threads_ >= 2 ? xla_threads_ : Pool::get().threads(); }
  void Run(int64_t units, const std::function<void(int64_t)>& fn) {
    if (xla_threads_ >= 2) {
      // XLA's pool runs this call's thunk on one of its threads (or the caller's): the others help
      Pool::RunShared(units, xla_threads_ - 1, fn, [this](std::function<void()> task) { xla_->Schedule(std::move(task)); });
    } else {
      Pool::get().Run(units, fn);
    }
  }

 private:
  xla::ffi::ThreadPool* xla_;
  int64_t xla_threads_ = 0;
};

// Units of work for a product over `panels` 64-column panels, each unit a run of consecutive panels (unit u takes
// [u * panels / units, (u + 1) * panels / units)): at least two per thread where there are enough panels, so a late
// thread costs less, and at most ~8 panels each. A thread then streams contiguous weights (`matmul.cc`'s packed
// products, `int_dot.cc`).
inline int64_t PanelUnits(const Workers& pool, int64_t panels) {
  return std::min<int64_t>(panels, std::max<int64_t>(2 * pool.threads(), panels / 8));
}

}  // namespace kvjax_native

#endif  // KVJAX_NATIVE_WORKERS_H_
