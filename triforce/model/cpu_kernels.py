"""What the CPU kernels share (decode_attention.py, stored_bf16.py: bfloat16 on avx512_bf16;
stored_avx2.py: float32 on avx2): the CPU check, the build through torch's extension builder, and
the C++ helpers every kernel source starts with.

Each kernel module compiles its C++ at first use with `load_inline` (a C++ compiler and ninja, as
--compile needs anyway; cached on disk across processes) into torch ops that torch.compile calls as
opaque kernels. A module whose build or self-check fails keeps torch's own ops.
"""
from __future__ import annotations

import hashlib
from typing import Callable

from .kv_dtype import cpu_flags

AVX512_BF16 = frozenset({"avx512f", "avx512bw", "avx512_bf16"})  # the bfloat16 kernels' code
AVX2 = frozenset({"avx2", "fma", "f16c"})  # the float32 kernels' code

PRELUDE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

// How long handing work to OpenMP's other threads takes. The command line sets OMP_WAIT_POLICY=PASSIVE
// (triforce/cli/__init__.py: spinning threads fight a busy machine's other jobs for its cores), and
// then every parallel call wakes a sleeping thread: ~45 us a call on this project's 2-core EPYC, ~150
// calls a SmolLM2 decode step, so two threads decoded slower than one (4K: 13.8 ms a step against 9.7;
// spinning threads 6.8). Under that policy a call goes parallel only where its work pays for a wake
// many times over; spinning threads keep the small shares.
inline bool threads_sleep() {
  static const bool passive = [] {
    const char* policy = std::getenv("OMP_WAIT_POLICY");
    return policy && (std::strcmp(policy, "PASSIVE") == 0 || std::strcmp(policy, "passive") == 0);
  }();
  return passive;
}

// the least work (multiply-adds, or weights of a product) worth splitting over threads
inline int64_t parallel_work(int64_t spinning, int64_t sleeping) { return threads_sleep() ? sleeping : spinning; }

// Tasks over torch's threads (where the module is built with OpenMP), each taken by whichever thread
// is free: a head's span of keys, a group of output rows. No task's result depends on the thread or
// on the others, so any number of threads gives the same bits. Taken in order, so callers put the
// small tasks (a last partial span) last; dealt out in fixed shares, SmolLM2's 4,097 keys (3 heads x
// 3 spans, the last a key long) gave one thread 4 full spans and the other 2. Calls of less work
// than SERIAL_WORK multiply-adds (SLEEPING_SERIAL_WORK where threads sleep) stay on the calling thread.
constexpr int64_t SERIAL_WORK = int64_t(1) << 20, SLEEPING_SERIAL_WORK = int64_t(1) << 23;

template <typename F>
void over_tasks(int64_t tasks, int64_t work, const F& task) {
  int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  if (work < parallel_work(SERIAL_WORK, SLEEPING_SERIAL_WORK) || threads <= 1) {
    for (int64_t t = 0; t < tasks; ++t) task(t);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      for (int64_t t = next.fetch_add(1); t < tasks; t = next.fetch_add(1)) task(t);
  });
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
"""


def cpu_has(isa: frozenset[str] = AVX512_BF16) -> bool:
    return isa <= cpu_flags()


_BUILT: dict[str, bool] = {}


def built(name: str, source: str, register_shapes: Callable[[], None], check: Callable[[], bool],
          isa: frozenset[str] = AVX512_BF16, openmp: bool = False, cflags: tuple[str, ...] = ()) -> bool:
    """Whether the extension `name` (PRELUDE + source) builds here, its ops' shapes registered for
    torch.compile, and passes `check` on a small case; only where the CPU has `isa`, the
    instructions its code uses. `openmp`: built with OpenMP, so that at::parallel_for splits work
    over torch's threads (the libgomp torch loaded serves it: same soname). Built and checked once
    per process: any failure (no compiler, no headers, an ISA the build rejects, a wrong result)
    means False. `cflags`: the compiler's further flags."""
    if name not in _BUILT:
        _BUILT[name] = cpu_has(isa) and _build_and_check(name, source, register_shapes, check, openmp, cflags)
    return _BUILT[name]


def _build_and_check(name: str, source: str, register_shapes: Callable[[], None], check: Callable[[], bool],
                     openmp: bool, cflags: tuple[str, ...] = ()) -> bool:
    try:
        from torch.utils.cpp_extension import load_inline

        flags = (["-O3", "-fopenmp"] if openmp else ["-O3"]) + list(cflags)
        # the source's hash in the build's name: checkouts with different sources (two branches, two
        # versions) keep a build each instead of rebuilding one another's (~16 s each time)
        digest = hashlib.sha256((PRELUDE + source + " ".join(flags)).encode()).hexdigest()[:10]
        load_inline(f"{name}_{digest}", cpp_sources=[PRELUDE + source], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"] if openmp else None, is_python_module=False)
        register_shapes()
        return bool(check())
    except Exception:  # noqa: BLE001 - not here, whatever the reason: the callers keep torch's ops
        return False
