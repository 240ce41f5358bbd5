// The float32 attention kernels' shared parts (decode_attention_f32.py), after prelude.h: the cache's
// element types and their widening loads, the read-ahead, the blocks of keys and values.

#include <algorithm>

namespace {

// the cache's element types: two 16-bit kinds told apart by type, float32 as it is
struct f16 { uint16_t x; };
struct b16 { uint16_t x; };

template <typename T> AVX2 inline __m256 load8(const T* p);
template <> AVX2 inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <> AVX2 inline __m256 load8<f16>(const f16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <> AVX2 inline __m256 load8<b16>(const b16* p) {  // bfloat16 is float32's upper half
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// Software prefetch of a head's cache, spread over the steps of the loops that work on the block
// before (asking for a whole block at once, as it starts, stalls on the memory system's queue).
constexpr int64_t MARGIN = 4096;  // bytes asked for beyond the next block

struct Ahead {
  const char* next;   // the first line not yet asked for
  const char* end;    // the head's last byte + 1
  const char* limit;  // how far the current block's steps go
  int64_t per_step;   // lines asked for per step

  // block_bytes read per block of `steps` steps; the first two blocks and MARGIN asked for at once
  Ahead(const void* from, const void* to, int64_t block_bytes, int64_t steps)
      : next(static_cast<const char*>(from)), end(static_cast<const char*>(to)),
        per_step(std::max<int64_t>(1, (block_bytes / 64 + steps - 1) / std::max<int64_t>(1, steps))) {
    aim(from, block_bytes);
    for (; next < limit; next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }

  // the block at `block` is read now: ask for the one after it and MARGIN beyond
  void aim(const void* block, int64_t block_bytes) {
    limit = std::min(end, static_cast<const char*>(block) + 2 * block_bytes + MARGIN);
  }

  inline void step() {
    for (int64_t i = 0; i < per_step && next < limit; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
};

// Keys and values are taken a block at a time (BLOCK values: 32 keys at head_dim 64, 16 at 128, 4-8 KB)
// and every row runs over the block while it sits in L1, so memory sees each value once per call.
// They are widened in registers as they are loaded, again for each row (pair) that reads them: a
// float32 copy of the block, widened once into an L1 buffer and read by every row, took longer at
// every row count, its stores and loads costing more than F16C's conversion or bfloat16's shift
// (SmolLM2 at 16K keys, float16: scores 7.0 ms against 5.9 at 1 row, 29.3 against 20.4 at 12,
// 89.7 against 69.1 at 42; the values product alike).
constexpr int BLOCK = 2048;

}  // namespace
