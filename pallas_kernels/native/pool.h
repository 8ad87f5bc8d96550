// A small thread pool shared by the native kernels of this library (one pool per process: `Pool::get()` is an
// inline function, so every translation unit of the library gets the same instance).

#ifndef KVJAX_NATIVE_POOL_H_
#define KVJAX_NATIVE_POOL_H_

#include <algorithm>
#include <atomic>
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
// and waits only for units a worker has claimed, never for a worker to wake up: on a loaded machine a sleeping
// worker can take a scheduler time slice (milliseconds) to run, longer than a whole decode-step attention.
class Pool {
 public:
  static Pool& get() {
    static Pool* pool = new Pool(ThreadCount());  // never destroyed: workers may outlive static destruction order
    return *pool;
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  void Run(int64_t units, const std::function<void(int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || workers_.empty() || units <= 1) {
      for (int64_t u = 0; u < units; ++u) fn(u);
      return;
    }
    // One job per call, shared with the workers that pick it up: a worker that wakes after the call returned finds
    // every unit taken and never touches `fn` (which lives only for the call).
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->units = units;
    {
      std::lock_guard<std::mutex> g(mu_);
      job_ = job;
      ++generation_;
    }
    cv_.notify_all();
    Drain(*job);
    std::unique_lock<std::mutex> g(job->mu);
    job->cv.wait(g, [&] { return job->done == job->units; });
    std::lock_guard<std::mutex> g2(mu_);
    if (job_ == job) job_.reset();
  }

 private:
  struct Job {
    const std::function<void(int64_t)>* fn = nullptr;
    int64_t units = 0;
    std::atomic<int64_t> next{0};
    int64_t done = 0;  // under mu
    std::mutex mu;
    std::condition_variable cv;
  };

  static int ThreadCount() {
    if (const char* env = std::getenv("KVJAX_NATIVE_THREADS")) {
      int n = std::atoi(env);
      if (n >= 1) return n;
    }
    unsigned hw = std::thread::hardware_concurrency();
    return hw == 0 ? 1 : static_cast<int>(std::min(hw, 16u));
  }

  explicit Pool(int n) {
    for (int i = 1; i < n; ++i) workers_.emplace_back([this] { Loop(); });
    for (auto& w : workers_) w.detach();
  }

  static void Drain(Job& job) {
    for (int64_t u; (u = job.next.fetch_add(1)) < job.units;) {
      (*job.fn)(u);
      std::lock_guard<std::mutex> g(job.mu);
      if (++job.done == job.units) job.cv.notify_all();
    }
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return generation_ != seen; });
        seen = generation_;
        job = job_;
      }
      if (job) Drain(*job);
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::shared_ptr<Job> job_;
  uint64_t generation_ = 0;
};

}  // namespace kvjax_native

#endif  // KVJAX_NATIVE_POOL_H_
