// A small thread pool shared by the native kernels of this library (one pool per process: `Pool::get()` is an
// inline function, so every translation unit of the library gets the same instance).

#ifndef KVJAX_NATIVE_POOL_H_
#define KVJAX_NATIVE_POOL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvjax_native {

// ------------------------------------------------------------------------------------------------ a small pool
// XLA:CPU runs this custom call on one of its threads; the pool adds workers for the duration of a call. A call that
// finds the pool busy (another attention running concurrently) runs on its own thread. The caller takes units itself
// and waits only for units a worker has claimed, never for a worker to wake up.
//
// A decode step makes ~100 calls of 50-300 us each (every layer's products and attention), a few microseconds apart.
// A worker that went to sleep on a condition variable after each call took longer to wake (a futex wake on a VM:
// tens of microseconds to a scheduler slice) than the call lasted, so the caller did every unit alone: measured on a
// 2-core Xeon, SmolLM2's bf16 products ran at 9 GB/s with the pool and 10.4 GB/s with one thread, against 20 GB/s
// for an XLA reduction over the same bytes. So a worker spins for a short window after each job before it sleeps, as
// XLA's own pool does, and the caller spins on the count of finished units. The spinning worker yields its core every
// few iterations: a pure pause loop took a core from XLA's threads between our calls and slowed SmolLM2's 8K
// full-cache decode 5%; with the yield, in one process, decode went 63.8 -> 61.0 ms and a bf16 draft token 25.6 ->
// 22.3 ms against no spinning. A worker spins only while jobs come within the window of each other (a step's loop);
// after a longer gap it sleeps at once, so a process that calls the kernels now and then (tests, a server between
// requests) burns nothing after each call. Measured with the rule: two test files take the CPU time they take with
// no spinning, and in one process a bf16 draft token is 24.3 ms against 26.6 with no spinning (full-cache decode
// 63.8 vs 64.5 ms). The window: KVJAX_NATIVE_SPIN_US, default 300 us; 0 = sleep at once;
// `pallas_kernels.native.set_spin_us`.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool(ThreadCount(), SpinMicros());  // never destroyed: workers may outlive statics
    return *pool;
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }
  // The spin window from now on (microseconds; 0 = workers sleep right after each job).
  void set_spin_us(int64_t us) { spin_ns_.store(std::max<int64_t>(us, 0) * 1000, std::memory_order_relaxed); }

  void Run(int64_t units, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || units <= 1) {
      for (int64_t u = 0; u < units; ++u) fn(u);
      return;
    }
    // One job per call, shared with the workers that pick it up: a worker that finds the job after the call returned
    // finds every unit taken and never touches `fn` (which lives only for the call).
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->units = units;
    {
      std::lock_guard<std::mutex> g(mu_);
      job_ = job;
      generation_.fetch_add(1, std::memory_order_release);
    }
    if (sleepers_.load(std::memory_order_acquire) > 0) cv_.notify_all();
    Drain(*job);
    Wait(*job);
    std::lock_guard<std::mutex> g(mu_);
    if (job_ == job) job_.reset();
  }

  // `units` calls of `fn` shared by the caller and up to `helpers` tasks handed to `schedule` (a callable taking a
  // std::function<void()>: another runtime's pool, e.g. XLA's intra-op threads). As in `Run`, the caller takes units
  // itself and waits only for units a helper has claimed; a helper that starts after the call returned finds every
  // unit taken and never touches `fn`.
  template <typename Schedule>
  static void RunShared(int64_t units, int64_t helpers, const std::function<void(int64_t)>& fn, Schedule&& schedule) {
    if (helpers <= 0 || units <= 1) {
      for (int64_t u = 0; u < units; ++u) fn(u);
      return;
    }
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->units = units;
    for (int64_t i = 0; i < std::min(helpers, units - 1); ++i) schedule(std::function<void()>([job] { Drain(*job); }));
    Drain(*job);
    Wait(*job);
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* fn = nullptr;
    int64_t units = 0;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };

  static void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
  }

  static int ThreadCount() {
    if (const char* env = std::getenv("KVJAX_NATIVE_THREADS")) {
      int n = std::atoi(env);
      if (n >= 1) return n;
    }
    unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(std::min(hw, 16u));
  }

  static int64_t SpinMicros() {
    if (const char* env = std::getenv("KVJAX_NATIVE_SPIN_US")) {
      const long long n = std::atoll(env);
      if (n >= 0) return n;
    }
    return 300;
  }

  Pool(int n, int64_t spin_us) : spin_ns_(spin_us * 1000) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { Loop(); });
    for (auto& w : workers_) w.detach();
  }

  // Every unit is claimed; wait for the ones a worker is still running (spinning: they are short).
  static void Wait(const Job& job) {
    for (int64_t spins = 0; job.done.load(std::memory_order_acquire) != job.units; ++spins) {
      if (spins < (1 << 16)) {
        CpuRelax();
      } else {
        std::this_thread::yield();
      }
    }
  }

  static void Drain(Job& job) {
    for (int64_t u; (u = job.next.fetch_add(1)) < job.units;) {
      (*job.fn)(u);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void Loop() {
    uint64_t seen = 0;
    bool hot = true;  // the last job came within the window of the one before: calls are in a tight loop
    for (;;) {
      // Spin for the window first (in a step's loop a new job comes within microseconds), then sleep. Only while
      // calls come that fast: after a long gap (compiling, Python, another program's turn) the worker sleeps at
      // once, so a process that calls the kernels now and then burns no spin after each call.
      const auto window = std::chrono::nanoseconds(spin_ns_.load(std::memory_order_relaxed));
      const auto idle_from = std::chrono::steady_clock::now();
      const auto until = idle_from + (hot ? window : std::chrono::nanoseconds(0));
      for (int64_t spins = 0; hot && generation_.load(std::memory_order_acquire) == seen; ++spins) {
        if ((spins & 15) == 15) {
          if (std::chrono::steady_clock::now() >= until) break;
          std::this_thread::yield();  // XLA's own threads (between our calls) take the core if they need it
        }
        CpuRelax();
      }
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> g(mu_);
        if (generation_.load(std::memory_order_acquire) == seen) {
          sleepers_.fetch_add(1, std::memory_order_acq_rel);
          cv_.wait(g, [&] { return generation_.load(std::memory_order_acquire) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_acq_rel);
        }
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
      }
      hot = std::chrono::steady_clock::now() - idle_from < window;
      if (job) Drain(*job);
    }
  }

  std::atomic<int64_t> spin_ns_;
  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> sleepers_{0};
};

}  // namespace kvjax_native

#endif  // KVJAX_NATIVE_POOL_H_
