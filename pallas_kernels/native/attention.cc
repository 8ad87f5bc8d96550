// Kernel 0 on the CPU: position-masked grouped-query attention over a cache, as an XLA FFI custom call.
//
// Inputs  q f32[B, T, N, D], k f32[B, K, S, D], v f32[B, K, S, D], q_pos s32[B, T], k_pos s32[B, S] or s32[B, K, S]
// Outputs o f32[B, T, N, D] (un-normalised), m f32[B, T, N] (running max), l f32[B, T, N] (sum of exp(s - m))
// Attrs   window (s64, <= 0: none), scale (f32)
//
// Key s is visible to a query at position t iff 0 <= k_pos[s] <= t (and k_pos[s] > t - W). The statistics are the
// online-softmax state of `pallas_kernels.online_softmax` (normalised by `finalize` in Python, which also adds
// sinks); a row that sees nothing keeps m = finfo(f32).min, l = 0, o = 0.
//
// Tiling: one (batch, kv head) is a tile; its T * G query rows run against one key block of BLOCK keys at a time, in
// chunks of up to 16 rows: each group of 8 keys is loaded into L1 once and scored against every row of the chunk,
// and each 8 KiB of values is accumulated into every row before the next (register-blocked across rows, never
// across keys). The chunk's scores (16 x BLOCK floats) and the block stay in L2. Blocks past the last occupied slot
// are never read, and a block none of whose keys a row can see is skipped for that row after reading only its
// positions (the per-block min/max position).
//
// Exactness: every row runs the same code path with a fixed arithmetic order -- scores as 8-lane FMA partials over D
// reduced by a fixed tree, blocks in slot order, p.V in slot order -- and nothing a row computes depends on any other
// row. So a row's result is bit-identical whether the call holds 1 row or 33 (the verify/reference contract,
// docs/exactness.md). Threads split the work by tiles (and, when tiles do not divide among threads, by row ranges),
// never a row's keys, for the same reason.

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVJAX_AVX2 1
#else
#define KVJAX_AVX2 0
#endif

namespace ffi = xla::ffi;

namespace {

constexpr float kMInit = -FLT_MAX;  // online_softmax.M_INIT

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

// ------------------------------------------------------------------------------------------------ vector pieces
// The scalar reduction of 8 partials in the order of the AVX2 hadd tree below, so a key scored on its own (a block's
// tail) is reduced exactly like a key scored in a group of 8.
inline float Reduce8(const float* a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

#if KVJAX_AVX2
// exp for f32 lanes: Cody-Waite range reduction and a degree-5 polynomial (the classic Cephes expf coefficients),
// |rel err| < 2 ulp on [-87, 88]; inputs below -87.33 give exactly 0 (masked and underflowing scores).
inline __m256 Exp8(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-87.3365478515625f);
  const __m256 in_range = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);  // below: exactly 0 (and -inf, NaN-free)
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), in_range);
}

inline float Exp1(float x) { return _mm256_cvtss_f32(Exp8(_mm256_set1_ps(x))); }

// Sum of 8 lanes in the fixed order of Reduce8.
inline float Hsum8(__m256 a) {
  alignas(32) float t[8];
  _mm256_store_ps(t, a);
  return Reduce8(t);
}
#else
inline float Exp1(float x) { return std::exp(x); }
#endif

// ------------------------------------------------------------------------------------------------ the problem
struct Problem {
  const float *q, *k, *v;
  const int32_t *q_pos, *k_pos;
  float *o, *m, *l;
  int64_t B, T, N, K, S, D, G;
  bool pos_per_head;
  int64_t window;
  float scale;
  int64_t block;
};

// Scores of one query row against keys [0, n) of a block: s[j] = scale * <q, k_j>, each as 8-lane partials over D
// (lane i sums d = i, i + 8, ...) reduced by the fixed tree. D % 8 == 0 on the vector path.
inline void Scores(const float* q, const float* kb, int64_t n, int64_t D, float scale, float* s) {
#if KVJAX_AVX2
  if (D % 8 == 0 && D <= 256) {
    const int64_t C = D / 8;
    __m256 qv[32];
    for (int64_t c = 0; c < C; ++c) qv[c] = _mm256_loadu_ps(q + 8 * c);
    const __m256 sc = _mm256_set1_ps(scale);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 a[8];
      for (int i = 0; i < 8; ++i) {
        const float* kr = kb + (j + i) * D;
        __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
        for (int64_t c = 1; c < C; ++c) acc = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + 8 * c), acc);
        a[i] = acc;
      }
      // hadd tree: lane sums in the order of Reduce8 ((0+1)+(2+3)) + ((4+5)+(6+7))
      __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
      __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
      __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
      // h0123 = [k0lo k1lo k2lo k3lo | k0hi k1hi k2hi k3hi] (lo: lanes 0-3, hi: lanes 4-7)
      __m256 los = _mm256_permute2f128_ps(h0123, h4567, 0x20), his = _mm256_permute2f128_ps(h0123, h4567, 0x31);
      _mm256_storeu_ps(s + j, _mm256_mul_ps(_mm256_add_ps(los, his), sc));
    }
    for (; j < n; ++j) {
      const float* kr = kb + j * D;
      __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kr));
      for (int64_t c = 1; c < C; ++c) acc = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kr + 8 * c), acc);
      s[j] = Hsum8(acc) * scale;
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float* kr = kb + j * D;
    float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t d = 0; d < D; ++d) lane[d % 8] += q[d] * kr[d];
    s[j] = Reduce8(lane) * scale;
  }
}

// Masks the scores (invisible -> -inf) and returns their max; *any = whether a key is visible.
inline float MaskMax(float* s, const int32_t* kp, int64_t n, int32_t lo, int32_t hi, bool* any) {
  float mx = -INFINITY;
  bool seen = false;
  int64_t j = 0;
#if KVJAX_AVX2
  const __m256i vlo = _mm256_set1_epi32(lo - 1), vhi = _mm256_set1_epi32(hi + 1);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  __m256 vmx = ninf;
  int vis_bits = 0;
  for (; j + 8 <= n; j += 8) {
    __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp + j));
    __m256i ok = _mm256_and_si256(_mm256_cmpgt_epi32(p, vlo), _mm256_cmpgt_epi32(vhi, p));
    __m256 sv = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + j), _mm256_castsi256_ps(ok));
    vis_bits |= _mm256_movemask_ps(_mm256_castsi256_ps(ok));
    _mm256_storeu_ps(s + j, sv);
    vmx = _mm256_max_ps(vmx, sv);
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, vmx);
  for (int i = 0; i < 8; ++i) mx = std::max(mx, t[i]);
  seen = vis_bits != 0;
#endif
  for (; j < n; ++j) {
    if (kp[j] >= lo && kp[j] <= hi) {
      seen = true;
      mx = std::max(mx, s[j]);
    } else {
      s[j] = -INFINITY;
    }
  }
  *any = seen;
  return mx;
}

// p = exp(s - m) in place (masked scores, -inf, give 0) and their sum in a fixed order.
inline float ExpSum(float* s, int64_t n, float m) {
  int64_t j = 0;
  float sum = 0.0f;
#if KVJAX_AVX2
  const __m256 vm = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    __m256 sv = _mm256_loadu_ps(s + j);
    __m256 p = Exp8(_mm256_sub_ps(sv, vm));
    p = _mm256_andnot_ps(_mm256_cmp_ps(sv, ninf, _CMP_EQ_OQ), p);  // masked keys: exactly 0
    _mm256_storeu_ps(s + j, p);
    acc = _mm256_add_ps(acc, p);
  }
  sum = Hsum8(acc);
#endif
  for (; j < n; ++j) {
    float p = s[j] == -INFINITY ? 0.0f : Exp1(s[j] - m);
    s[j] = p;
    sum += p;
  }
  return sum;
}

// o = alpha * o + sum_j p[j] * v[j] (j in slot order), o f32[D].
inline void AccumulatePV(float* o, float alpha, const float* p, const float* vb, int64_t n, int64_t D) {
#if KVJAX_AVX2
  if (D % 8 == 0) {
    const __m256 va = _mm256_set1_ps(alpha);
    for (int64_t c0 = 0; c0 < D; c0 += 64) {  // up to 8 accumulators of 8 lanes in registers
      const int64_t C = std::min<int64_t>(8, (D - c0) / 8);
      __m256 acc[8];
      for (int64_t c = 0; c < C; ++c) acc[c] = _mm256_mul_ps(va, _mm256_loadu_ps(o + c0 + 8 * c));
      for (int64_t j = 0; j < n; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        const float* vr = vb + j * D + c0;
        for (int64_t c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * c), acc[c]);
      }
      for (int64_t c = 0; c < C; ++c) _mm256_storeu_ps(o + c0 + 8 * c, acc[c]);
    }
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* vr = vb + j * D;
    for (int64_t d = 0; d < D; ++d) o[d] = std::fma(pj, vr[d], o[d]);
  }
}

#if KVJAX_AVX2
// ------------------------------------------------------------------------------------------------ row-blocked path
// D = 8 * C with C known at compile time: accumulators stay in registers (a runtime C made the compiler keep them on
// the stack, and every FMA waited on a store-to-load round trip). The arithmetic of each row is exactly `Scores` and
// `AccumulatePV`'s -- the same lane assignment, FMA order, hadd tree and slot order -- only the loop nest differs:
// a group of keys is loaded into L1 once and every row of the chunk is scored against it (and its values
// accumulated into every row) before the next group, instead of each row streaming the whole block from L2.

// Scores of one row against 8 keys (kb: 8 rows of D floats) -> s[0..8), as `Scores`' vector loop.
template <int C>
inline void Score8(const float* q, const float* kb, __m256 sc, float* s) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) {
    const float* kr = kb + i * 8 * C;
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kr));
    for (int c = 1; c < C; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(kr + 8 * c), acc);
    a[i] = acc;
  }
  __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  __m256 los = _mm256_permute2f128_ps(h0123, h4567, 0x20), his = _mm256_permute2f128_ps(h0123, h4567, 0x31);
  _mm256_storeu_ps(s, _mm256_mul_ps(_mm256_add_ps(los, his), sc));
}

// One key's score (a block's tail), as `Scores`' tail loop.
template <int C>
inline float Score1(const float* q, const float* kr, float scale) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kr));
  for (int c = 1; c < C; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(kr + 8 * c), acc);
  return Hsum8(acc) * scale;
}

// o = alpha * o (when first) then o += p[j] * v[j] for j in [0, n) in slot order, for one row, as `AccumulatePV`.
template <int C>
inline void PV1(float* o, bool first, float alpha, const float* p, const float* vb, int64_t n) {
  __m256 acc[C];
  const __m256 va = _mm256_set1_ps(alpha);
  for (int c = 0; c < C; ++c) {
    acc[c] = _mm256_loadu_ps(o + 8 * c);
    if (first) acc[c] = _mm256_mul_ps(va, acc[c]);
  }
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj = _mm256_set1_ps(p[j]);
    for (int c = 0; c < C; ++c) acc[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vb + j * 8 * C + 8 * c), acc[c]);
  }
  for (int c = 0; c < C; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
}

// Two rows at once (independent chains hide the FMA latency when C is small); each row's arithmetic is PV1's.
template <int C>
inline void PV2(float* o0, float* o1, bool first, float alpha0, float alpha1, const float* p0, const float* p1,
                const float* vb, int64_t n) {
  __m256 a0[C], a1[C];
  const __m256 va0 = _mm256_set1_ps(alpha0), va1 = _mm256_set1_ps(alpha1);
  for (int c = 0; c < C; ++c) {
    a0[c] = _mm256_loadu_ps(o0 + 8 * c);
    a1[c] = _mm256_loadu_ps(o1 + 8 * c);
    if (first) {
      a0[c] = _mm256_mul_ps(va0, a0[c]);
      a1[c] = _mm256_mul_ps(va1, a1[c]);
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    const __m256 pj0 = _mm256_set1_ps(p0[j]), pj1 = _mm256_set1_ps(p1[j]);
    for (int c = 0; c < C; ++c) {
      __m256 vv = _mm256_loadu_ps(vb + j * 8 * C + 8 * c);
      __asm__("" : "+x"(vv));  // keep the values in a register: folded into each row's FMA they were loaded twice
      a0[c] = _mm256_fmadd_ps(pj0, vv, a0[c]);
      a1[c] = _mm256_fmadd_ps(pj1, vv, a1[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    _mm256_storeu_ps(o0 + 8 * c, a0[c]);
    _mm256_storeu_ps(o1 + 8 * c, a1[c]);
  }
}
#endif

// Row-state of one work unit: un-normalised output, running max and sum, visible position range, query pointer.
struct Rows {
  std::vector<float> o, m, l;
  std::vector<int32_t> lo, hi;
  std::vector<const float*> q;
};

// Rows scored together against one key group: their scores (CHUNK x block floats) stay in L2 with the block.
constexpr int64_t kChunk = 16;

// One key block for the rows `act[0..na)` (all of which can see part of it). C > 0: the row-blocked vector path for
// D = 8 * C; C == 0: the generic per-row path (any D, scalar or vector). Both give each row the arithmetic of
// `Scores` / `MaskMax` / `ExpSum` / `AccumulatePV`, so the two paths agree bit for bit on the same D.
template <int C>
void BlockRows(const Problem& P, Rows& R, const int64_t* act, int64_t na, const float* kb, const float* vb,
               const int32_t* kp, int64_t n, float* s) {
  const int64_t D = P.D, BK = P.block;
  bool any[kChunk];
  float alpha[kChunk];
  // 1. scores: a group of 8 keys (in L1) against every row of the chunk
#if KVJAX_AVX2
  if constexpr (C > 0) {
    const __m256 sc = _mm256_set1_ps(P.scale);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
      for (int64_t a = 0; a < na; ++a) Score8<C>(R.q[act[a]], kb + j * D, sc, s + a * BK + j);
    for (; j < n; ++j)
      for (int64_t a = 0; a < na; ++a) s[a * BK + j] = Score1<C>(R.q[act[a]], kb + j * D, P.scale);
  } else
#endif
  {
    for (int64_t a = 0; a < na; ++a) Scores(R.q[act[a]], kb, n, D, P.scale, s + a * BK);
  }
  // 2. per row: mask, block max, exponentials and their sum (the online-softmax update)
  for (int64_t a = 0; a < na; ++a) {
    const int64_t r = act[a];
    float* sr = s + a * BK;
    const float mb = MaskMax(sr, kp, n, R.lo[r], R.hi[r], &any[a]);
    if (!any[a]) continue;
    const float m_new = std::max(R.m[r], mb);
    alpha[a] = Exp1(R.m[r] - m_new);  // finite - finite: m >= M_INIT, m_new a real score
    const float psum = ExpSum(sr, n, m_new);
    R.l[r] = alpha[a] * R.l[r] + psum;
    R.m[r] = m_new;
  }
  // 3. p.V: a sub-block of values (in L1) accumulated into every row, in slot order per row
#if KVJAX_AVX2
  if constexpr (C > 0) {
    constexpr int64_t SUB = std::max(8, 2048 / (8 * C));  // 8 KiB of values
    int64_t live[kChunk], nl = 0;
    for (int64_t a = 0; a < na; ++a)
      if (any[a]) live[nl++] = a;
    for (int64_t j0 = 0; j0 < n; j0 += SUB) {
      const int64_t m = std::min(SUB, n - j0);
      const bool first = j0 == 0;
      int64_t i = 0;
      if (C <= 4)
        for (; i + 2 <= nl; i += 2) {
          const int64_t a0 = live[i], a1 = live[i + 1];
          PV2<C>(R.o.data() + act[a0] * D, R.o.data() + act[a1] * D, first, alpha[a0], alpha[a1],
                 s + a0 * BK + j0, s + a1 * BK + j0, vb + j0 * D, m);
        }
      for (; i < nl; ++i) {
        const int64_t a = live[i];
        PV1<C>(R.o.data() + act[a] * D, first, alpha[a], s + a * BK + j0, vb + j0 * D, m);
      }
    }
    return;
  }
#endif
  for (int64_t a = 0; a < na; ++a)
    if (any[a]) AccumulatePV(R.o.data() + act[a] * D, alpha[a], s + a * BK, vb, n, D);
}

// One work unit: rows [r0, r1) of tile (b, h), rows numbered r = t * G + g (query head h * G + g).
template <int C>
void RunUnitT(const Problem& P, int64_t b, int64_t h, int64_t r0, int64_t r1) {
  const int64_t S = P.S, D = P.D, G = P.G, BK = P.block;
  const float* kt = P.k + (b * P.K + h) * S * D;
  const float* vt = P.v + (b * P.K + h) * S * D;
  const int32_t* kp = P.k_pos + (P.pos_per_head ? (b * P.K + h) * S : b * S);
  const int64_t nblocks = (S + BK - 1) / BK;
  // per block: min and max occupied position (max < 0: the block is empty); blocks past the last occupied one are
  // never read.
  std::vector<int32_t> bmin(nblocks), bmax(nblocks);
  int64_t used = 0;
  for (int64_t i = 0; i < nblocks; ++i) {
    int32_t mn = INT32_MAX, mx = -1;
    const int64_t j1 = std::min(S, (i + 1) * BK);
    for (int64_t j = i * BK; j < j1; ++j) {
      const int32_t p = kp[j];
      if (p >= 0) {
        mn = std::min(mn, p);
        mx = std::max(mx, p);
      }
    }
    bmin[i] = mn;
    bmax[i] = mx;
    if (mx >= 0) used = i + 1;
  }
  const int64_t NR = r1 - r0;
  Rows R;
  R.o.assign(NR * D, 0.0f);
  R.m.assign(NR, kMInit);
  R.l.assign(NR, 0.0f);
  R.lo.resize(NR);
  R.hi.resize(NR);
  R.q.resize(NR);
  for (int64_t r = 0; r < NR; ++r) {
    const int64_t t = (r0 + r) / G, g = (r0 + r) % G;
    const int32_t qp = P.q_pos[b * P.T + t];
    R.hi[r] = qp;
    int64_t low = P.window > 0 ? static_cast<int64_t>(qp) - P.window + 1 : 0;
    R.lo[r] = static_cast<int32_t>(std::max<int64_t>(0, low));
    R.q[r] = P.q + ((b * P.T + t) * P.N + h * G + g) * D;
  }
  std::vector<float> s(kChunk * BK);
  std::vector<int64_t> act(NR);
  for (int64_t i = 0; i < used; ++i) {
    if (bmax[i] < 0) continue;
    const int64_t j0 = i * BK, n = std::min(BK, S - j0);
    int64_t na = 0;
    for (int64_t r = 0; r < NR; ++r)  // rows that can see something in this block
      if (!(R.hi[r] < R.lo[r] || bmin[i] > R.hi[r] || bmax[i] < R.lo[r])) act[na++] = r;
    for (int64_t a0 = 0; a0 < na; a0 += kChunk)
      BlockRows<C>(P, R, act.data() + a0, std::min(kChunk, na - a0), kt + j0 * D, vt + j0 * D, kp + j0, n, s.data());
  }
  for (int64_t r = 0; r < NR; ++r) {
    const int64_t t = (r0 + r) / G, g = (r0 + r) % G;
    const int64_t qi = (b * P.T + t) * P.N + h * G + g;
    std::memcpy(P.o + qi * D, R.o.data() + r * D, D * sizeof(float));
    P.m[qi] = R.m[r];
    P.l[qi] = R.l[r];
  }
}

void RunUnit(const Problem& P, int64_t b, int64_t h, int64_t r0, int64_t r1) {
#if KVJAX_AVX2
  switch (P.D) {
    case 16: return RunUnitT<2>(P, b, h, r0, r1);
    case 32: return RunUnitT<4>(P, b, h, r0, r1);
    case 64: return RunUnitT<8>(P, b, h, r0, r1);
    case 128: return RunUnitT<16>(P, b, h, r0, r1);
    default: break;
  }
#endif
  RunUnitT<0>(P, b, h, r0, r1);
}

ffi::Error AttendImpl(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                      ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> k_pos, ffi::ResultBuffer<ffi::F32> o,
                      ffi::ResultBuffer<ffi::F32> m, ffi::ResultBuffer<ffi::F32> l, int64_t window, float scale,
                      int64_t block) {
  auto qd = q.dimensions(), kd = k.dimensions(), pd = k_pos.dimensions();
  if (qd.size() != 4 || kd.size() != 4) return ffi::Error::InvalidArgument("q and k must be rank 4");
  Problem P;
  P.B = qd[0];
  P.T = qd[1];
  P.N = qd[2];
  P.D = qd[3];
  P.K = kd[1];
  P.S = kd[2];
  if (kd[0] != P.B || kd[3] != P.D || P.K == 0 || P.N % P.K != 0)
    return ffi::Error::InvalidArgument("k must be [B, K, S, D] with N a multiple of K");
  if (v.dimensions().size() != 4 || v.element_count() != k.element_count())
    return ffi::Error::InvalidArgument("v must have k's shape");
  if (pd.size() == 3 && pd[0] == P.B && pd[1] == P.K && pd[2] == P.S) {
    P.pos_per_head = true;
  } else if (pd.size() == 2 && pd[0] == P.B && pd[1] == P.S) {
    P.pos_per_head = false;
  } else {
    return ffi::Error::InvalidArgument("k_pos must be [B, S] or [B, K, S]");
  }
  if (q_pos.element_count() != static_cast<size_t>(P.B * P.T))
    return ffi::Error::InvalidArgument("q_pos must be [B, T]");
  if (block < 8 || block % 8) return ffi::Error::InvalidArgument("block must be a positive multiple of 8");
  P.G = P.N / P.K;
  P.q = q.typed_data();
  P.k = k.typed_data();
  P.v = v.typed_data();
  P.q_pos = q_pos.typed_data();
  P.k_pos = k_pos.typed_data();
  P.o = o->typed_data();
  P.m = m->typed_data();
  P.l = l->typed_data();
  P.window = window;
  P.scale = scale;
  P.block = block;
  if (P.S == 0 || P.T == 0) {
    std::fill(P.o, P.o + P.B * P.T * P.N * P.D, 0.0f);
    std::fill(P.m, P.m + P.B * P.T * P.N, kMInit);
    std::fill(P.l, P.l + P.B * P.T * P.N, 0.0f);
    return ffi::Error::Success();
  }
  Pool& pool = Pool::get();
  const int64_t tiles = P.B * P.K, rows = P.T * P.G, threads = pool.threads();
  // Whole tiles when they divide among the threads (each thread streams its own keys); otherwise row ranges too.
  const int64_t chunks = (tiles % threads == 0) ? 1 : std::min<int64_t>(threads, rows);
  const int64_t per = (rows + chunks - 1) / chunks;
  pool.Run(tiles * chunks, [&](int64_t u) {
    const int64_t tile = u / chunks, c = u % chunks;
    const int64_t r0 = c * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) RunUnit(P, tile / P.K, tile % P.K, r0, r1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(KvjaxAttend, AttendImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block"));

extern "C" int kvjax_native_vector_width() { return KVJAX_AVX2 ? 8 : 1; }
