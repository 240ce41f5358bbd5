// What every kernel module's C++ starts with (cpu_kernels.Kernel.text): includes, the calls into
// the process's pool of threads, tasks over spans of keys, the float32 exp, bf16 conversions, read-ahead.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// The process's one pool of threads (cpu_pool.cpp, a module of its own so that every kernel
// module shares its threads), handed to each module by the module's use_pool op; until then, or where
// the pool does not build, the kernels run on the calling thread.
using Task = void (*)(const void* context, int64_t task);
using PoolRun = void (*)(int64_t tasks, Task task, const void* context);
PoolRun pool_run = nullptr;
void use_pool(int64_t address) { pool_run = reinterpret_cast<PoolRun>(address); }

template <typename F>
void call_task(const void* task, int64_t t) { (*static_cast<const F*>(task))(t); }

// Tasks over the pool's threads (torch's, --threads), each taken by whichever thread is free: a
// head's span of keys, a range of output rows. No task's result depends on the thread or on the
// others, so any number of threads gives the same bits. Taken in order, so callers put the small
// tasks (a last partial span) last; dealt out in fixed shares, SmolLM2's 4,097 keys (3 heads x 3
// spans, the last a key long) gave one thread 4 full spans and the other 2.
template <typename F>
void run_tasks(int64_t tasks, const F& task) {
  if (tasks <= 1 || pool_run == nullptr) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
    return;
  }
  pool_run(tasks, &call_task<F>, &task);
}

// run_tasks for calls of at least SERIAL_WORK multiply-adds; smaller ones stay on the calling thread
constexpr int64_t SERIAL_WORK = int64_t(1) << 20;

template <typename F>
void over_tasks(int64_t tasks, int64_t work, const F& task) {
  if (work < SERIAL_WORK) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
    return;
  }
  run_tasks(tasks, task);
}

// [0, n) as ranges range(first, last) of at least `grain` items each (a few microseconds of work),
// and at most MAX_RANGES: small enough that a thread which starts late (woken from sleep) leaves
// its share to the others
constexpr int64_t MAX_RANGES = 64;

template <typename F>
void over_ranges(int64_t n, int64_t grain, const F& range) {
  int64_t size = std::max<int64_t>({grain, int64_t(1), (n + MAX_RANGES - 1) / MAX_RANGES});
  run_tasks((n + size - 1) / size, [&](int64_t t) { range(t * size, std::min(n, (t + 1) * size)); });
}

// ======== attention over spans of keys (flash decoding), the attention kernels' common frame ========
constexpr int64_t SPAN = 2048;  // keys per task: 16 tasks a head at 32K keys, 128-256 KB of keys each

inline int64_t spans(int64_t S) { return (S + SPAN - 1) / SPAN; }

// softmax(scale * rows . keys^T) . values of R rows over a head's S keys, for H heads, into out
// (H, R, D) float32. Row r is token r % tokens, which sees the first limits[t] keys. A task is a
// (head, span): span(h, s0, reach, seen, part, top, total) turns the span's first `reach` keys into
// each row's weighted sum of values (part, R x D), weighed against the row's own maximum scaled
// score (top) with the weights' sum (total); a row sees seen[r] <= reach of them. The heads then
// merge their spans (exp of each span's maximum against the head's), span by span in order, so that
// any number of threads gives the same bits; a span no row sees (keys past the sequence, a row's
// future) is never read.
template <typename Span>
void attend_spans(int64_t H, int64_t S, int64_t R, int64_t D, const int64_t* limits, int64_t tokens,
                  float* out, const Span& span) {
  int64_t C = spans(S);
  std::vector<float> parts(H * C * R * D), tops(H * C * R), totals(H * C * R);
  over_tasks(H * C, 2 * H * S * R * D, [&](int64_t task) {
    int64_t h = task % H, c = task / H, t = h * C + c, s0 = c * SPAN, n = std::min(SPAN, S - s0), reach = 0;
    std::vector<int64_t> seen(R);
    for (int64_t r = 0; r < R; ++r) {
      seen[r] = std::clamp<int64_t>(limits[r % tokens] - s0, 0, n);
      reach = std::max(reach, seen[r]);
    }
    float* part = parts.data() + t * R * D;
    float *top = tops.data() + t * R, *total = totals.data() + t * R;
    if (reach == 0) {
      std::fill(part, part + R * D, 0.0f);
      std::fill(top, top + R, -INFINITY);
      std::fill(total, total + R, 0.0f);
      return;
    }
    span(h, s0, reach, seen.data(), part, top, total);
  });
  for (int64_t h = 0; h < H; ++h)
    for (int64_t r = 0; r < R; ++r) {
      float m = -INFINITY, l = 0.0f;
      for (int64_t c = 0; c < C; ++c) m = std::max(m, tops[(h * C + c) * R + r]);
      float* o = out + (h * R + r) * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t c = 0; c < C; ++c) {
        int64_t i = (h * C + c) * R + r;
        if (totals[i] == 0.0f) continue;
        float w = std::exp(tops[i] - m);
        l += w * totals[i];
        const float* part = parts.data() + i * D;
        for (int64_t d = 0; d < D; ++d) o[d] += w * part[d];
      }
      float inv = l > 0.0f ? 1.0f / l : 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
}

// e^x for x <= 0 as Cephes' expf computes it, in the kernels' vector widths: x = n ln2 + r with
// n = round(x log2 e) and |r| <= ln2/2 (ln2 in two parts, so r is exact to float32), e^r = 1 + r +
// r^2 p(r) with p of degree 5 (EXP_POLY, highest first), 2^n through the exponent bits. Below
// EXP_FLOOR (the smallest normal float32's log) x is held there: e^x ~ 2^-126, far under any sum.
constexpr float LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f, EXP_FLOOR = -87.3f;
constexpr float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

using bf16 = uint16_t;
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define AVX2 __attribute__((target("avx2,fma,f16c")))
// a CPU with AVX-512 but no native bfloat16 (Xeons from Skylake-SP to Ice Lake): the float32 kernels' wide code
#define AVX512F __attribute__((target("avx512f,avx2,fma,f16c")))

// f32 -> bf16, round to nearest even (what torch's bmm and GEMMs do to their float32 sums); NaN stays NaN
AVX512 inline __m256i to_bf16(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

AVX512 inline __m512 widen(const bf16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Read ahead of the loops by software prefetch: the hardware's prefetcher alone left the attention
// score kernel at 3x the memory floor (SmolLM2 at 16K keys, one thread: 12.3 ms for 30 layers, 4.9
// with this, against 4.15 to read the keys once)
constexpr int AHEAD_BYTES = 4096;

inline void read_ahead(const void* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + AHEAD_BYTES, _MM_HINT_T0);
}

inline bf16 scalar_bf16(float x) {
  return c10::BFloat16(x).x;  // round to nearest even
}

inline float scalar_f32(bf16 x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

const bf16* data(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.const_data_ptr()); }

}  // namespace
