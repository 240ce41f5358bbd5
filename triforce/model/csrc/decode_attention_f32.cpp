// Attention at a few to a few dozen queries in float32 over 16- or 32-bit caches on avx2, and on
// avx512f where the CPU has it (decode_attention_f32.py), after prelude.h, attention_f32_blocks.h and
// attention_f32_avx512.h.

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// ======== scores = rows . keys^T ========

// 8 vectors of partial sums -> one vector of their 8 totals, in order
AVX2 inline __m256 totals8(const __m256* a) {
  __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half: totals of 4 vectors
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// one row's dot products with 8 consecutive keys: 8 independent FMA chains, the row's chunk loaded
// once for all 8
template <int D, typename T>
AVX2 inline __m256 dots8(const float* q, const T* k) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int c = 0; c < D / 8; ++c) {
    __m256 qc = _mm256_loadu_ps(q + 8 * c);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, load8(k + j * D + 8 * c), acc[j]);
  }
  return totals8(acc);
}

// two rows' dot products with 4 consecutive keys, lanes (row 0: keys 0-3, row 1: keys 0-3):
// each key chunk loaded (and widened) once for both rows, 0.75 loads per FMA where one row takes 1.1
template <int D, typename T>
AVX2 inline __m256 dots2x4(const float* q0, const float* q1, const T* k) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int c = 0; c < D / 8; ++c) {
    __m256 a = _mm256_loadu_ps(q0 + 8 * c), b = _mm256_loadu_ps(q1 + 8 * c);
    for (int j = 0; j < 4; ++j) {
      __m256 x = load8(k + j * D + 8 * c);
      acc[j] = _mm256_fmadd_ps(a, x, acc[j]);
      acc[4 + j] = _mm256_fmadd_ps(b, x, acc[4 + j]);
    }
  }
  return totals8(acc);
}

// out[r, 0:n] = rows[r] . k[0:n] for every row, n a multiple of 8: rows in pairs, 8 keys a step
template <int D, typename T>
AVX2 void score_rows(const float* rows, int64_t R, const T* k, int64_t n, float* out, int64_t S, Ahead& ahead) {
  int64_t r = 0;
  for (; r + 2 <= R; r += 2)
    for (int64_t j = 0; j < n; j += 8) {
      ahead.step();
      const float *q0 = rows + r * D, *q1 = q0 + D;
      __m256 lo = dots2x4<D>(q0, q1, k + j * D), hi = dots2x4<D>(q0, q1, k + (j + 4) * D);
      _mm256_storeu_ps(out + r * S + j, _mm256_permute2f128_ps(lo, hi, 0x20));
      _mm256_storeu_ps(out + (r + 1) * S + j, _mm256_permute2f128_ps(lo, hi, 0x31));
    }
  if (r < R)
    for (int64_t j = 0; j < n; j += 8) {
      ahead.step();
      _mm256_storeu_ps(out + r * S + j, dots8<D>(rows + r * D, k + j * D));
    }
}

// out[r, 0:S] = rows[r] . keys[0:S] for one head's S keys, out's rows `ld` apart; Wide: each block's
// multiples of 8 keys through the avx512f code (attention_f32_avx512.h), the same bits
template <int D, typename T, bool Wide>
AVX2 void scores_head(const float* rows, int64_t R, const T* keys, int64_t S, float* out, int64_t ld) {
  constexpr int KB = BLOCK / D;
  constexpr int64_t bytes = int64_t(KB) * D * sizeof(T);
  if constexpr (Wide)
    if (R < WIDE_SCORE_ROWS) return scores_head<D, T, false>(rows, R, keys, S, out, ld);
  alignas(32) float tail[8 * D];
  const float* packed = Wide ? pack_pairs<D>(rows, R) : nullptr;
  Ahead ahead(keys, keys + S * D, bytes, (Wide ? wide_score_tiles(R) : (R + 1) / 2) * KB / 8);
  for (int64_t s0 = 0; s0 < S; s0 += KB) {
    int64_t n = std::min<int64_t>(KB, S - s0), full = n - n % 8;
    ahead.aim(keys + s0 * D, bytes);
    if constexpr (Wide) score_rows_wide<D>(packed, R, keys + s0 * D, full, out + s0, ld, ahead);
    else score_rows<D>(rows, R, keys + s0 * D, full, out + s0, ld, ahead);
    if (full < n) {  // the last n % 8 keys: widened into a block of 8 padded with zero keys
      for (int64_t i = 0; i < 8 * D; i += 8)
        _mm256_store_ps(tail + i, i < (n - full) * D ? load8(keys + (s0 + full) * D + i) : _mm256_setzero_ps());
      for (int64_t r = 0; r < R; ++r) {
        alignas(32) float t[8];
        _mm256_store_ps(t, dots8<D>(rows + r * D, tail));
        for (int64_t j = 0; j < n - full; ++j) out[r * ld + s0 + full + j] = t[j];
      }
    }
  }
}

// ======== out = probs . values ========

// out[r] += probs[r, 0:n] . v[0:n] for RT rows, CH chunks of 8 dims at a time: RT x CH sums in
// registers (at most 12, so that the value chunks and a broadcast weight fit beside them), each
// value chunk loaded once for the tile, each weight broadcast once per pass over the dims
template <int D, int RT, int CH, typename T>
AVX2 void mix_tile(const float* p, int64_t S, const T* v, int64_t n, float* out, Ahead& ahead) {
  for (int g = 0; g < D / 8; g += CH) {
    __m256 acc[RT][CH];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CH; ++c) acc[r][c] = _mm256_loadu_ps(out + r * D + 8 * (g + c));
    for (int64_t s = 0; s < n; ++s) {
      ahead.step();
      __m256 x[CH];
      for (int c = 0; c < CH; ++c) x[c] = load8(v + s * D + 8 * (g + c));
      for (int r = 0; r < RT; ++r) {
        __m256 w = _mm256_broadcast_ss(p + r * S + s);
        for (int c = 0; c < CH; ++c) acc[r][c] = _mm256_fmadd_ps(w, x[c], acc[r][c]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CH; ++c) _mm256_storeu_ps(out + r * D + 8 * (g + c), acc[r][c]);
  }
}

constexpr int MROWS = 6;  // rows per full tile: 6 x 2 sums, 2 value chunks, 1 weight

// the sums per tile's pass over the dims: 8 chunks of 8 dims for one row, 4 for 2-3 rows, 2 beyond
constexpr int mix_chunks(int64_t rows) { return rows == 1 ? 8 : rows <= 3 ? 4 : 2; }

// passes over a block's keys for R rows (each an Ahead step per key)
template <int D>
int64_t mix_passes(int64_t R) {
  int64_t rest = R % MROWS;
  return R / MROWS * (D / 8 / mix_chunks(MROWS)) + (rest ? D / 8 / mix_chunks(rest) : 0);
}

// every row's sums += its weights . n values, tile by tile
template <int D, typename T>
AVX2 void mix_rows(const float* probs, int64_t R, int64_t S, const T* v, int64_t n, float* out, Ahead& ahead) {
  int64_t r = 0;
  for (; r + MROWS <= R; r += MROWS) mix_tile<D, MROWS, mix_chunks(MROWS)>(probs + r * S, S, v, n, out + r * D, ahead);
  const float* p = probs + r * S;
  float* o = out + r * D;
  switch (R - r) {  // fewer rows, more dims per pass: at least 8 independent chains
    case 5: mix_tile<D, 5, mix_chunks(5)>(p, S, v, n, o, ahead); break;
    case 4: mix_tile<D, 4, mix_chunks(4)>(p, S, v, n, o, ahead); break;
    case 3: mix_tile<D, 3, mix_chunks(3)>(p, S, v, n, o, ahead); break;
    case 2: mix_tile<D, 2, mix_chunks(2)>(p, S, v, n, o, ahead); break;
    case 1: mix_tile<D, 1, mix_chunks(1)>(p, S, v, n, o, ahead); break;
  }
}

// out[r] = probs[r, 0:S] . values[0:S] for one head's S values, probs' rows `ld` apart; Wide: through
// the avx512f code, the same bits
template <int D, typename T, bool Wide>
AVX2 void mix_head(const float* probs, int64_t R, int64_t S, int64_t ld, const T* values, float* out) {
  if constexpr (Wide)
    if (R < WIDE_MIX_ROWS) return mix_head<D, T, false>(probs, R, S, ld, values, out);
  constexpr int KB = BLOCK / D;
  constexpr int64_t bytes = int64_t(KB) * D * sizeof(T);
  std::fill(out, out + R * D, 0.0f);
  Ahead ahead(values, values + S * D, bytes, KB * (Wide ? wide_mix_passes<D>(R) : mix_passes<D>(R)));
  for (int64_t s0 = 0; s0 < S; s0 += KB) {
    int64_t n = std::min<int64_t>(KB, S - s0);
    ahead.aim(values + s0 * D, bytes);
    if constexpr (Wide) mix_rows_wide<D>(probs + s0, R, ld, values + s0 * D, n, out, ahead);
    else mix_rows<D>(probs + s0, R, ld, values + s0 * D, n, out, ahead);
  }
}

// ======== heads and spans of keys over torch's threads ========

// A head's keys go in spans of SPAN, the tasks split over torch's threads (prelude.h's over_tasks). The
// spans depend on the number of keys alone (not on the threads or rows), so every split sums in one
// order: a head's values product adds its spans' partial sums in span order. Tasks run span by span
// (every head's first span, then every head's second, ...), so a last partial span comes last.
// SPAN and spans() are prelude.h's, as the attention's frame over spans is.

// ======== attention whole: scores, softmax and mix in one call ========

// e^x for x <= 0 (a score minus its row's maximum): prelude.h's Cephes expf in 8 lanes (its error stays
// well inside the attention's float64 bound, tested)
AVX2 inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x));
  __m256 p = _mm256_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_POLY[i]));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// One row's scores over a span, in place: the first `seen` become their softmax weights against the
// row's own maximum (returned, with their sum), the rest zero. The weights are not yet divided by
// the sum: the spans of a head each weigh by their own maximum, and the heads' merge brings them to
// one. The scale rides in exp's argument (s * scale - max, one rounding); scale > 0, so the scaled
// maximum is the maximum's scaled value. Wide: the exponentials 16 at a time in avx512f code (exps16),
// the same bits.
template <bool Wide>
AVX2 inline void span_weights(float* s, int64_t seen, int64_t n, float scale, float& top, float& total) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t j = 0;
  for (; j + 8 <= seen; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float m = *std::max_element(lanes, lanes + 8);
  for (; j < seen; ++j) m = std::max(m, s[j]);
  m *= scale;
  __m256 sv = _mm256_set1_ps(scale), mv = _mm256_set1_ps(m);
  __m256 sum0 = _mm256_setzero_ps(), sum1 = _mm256_setzero_ps();  // two chains: exp's adds overlap
  j = 0;
  if constexpr (Wide) {
    alignas(64) float sums[16];
    j = seen - seen % 16;
    exps16(s, j, scale, m, sums);
    sum0 = _mm256_load_ps(sums);
    sum1 = _mm256_load_ps(sums + 8);
  }
  for (; j + 16 <= seen; j += 16) {
    __m256 e0 = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j), sv, mv));
    __m256 e1 = exp8(_mm256_fmsub_ps(_mm256_loadu_ps(s + j + 8), sv, mv));
    _mm256_storeu_ps(s + j, e0);
    _mm256_storeu_ps(s + j + 8, e1);
    sum0 = _mm256_add_ps(sum0, e0);
    sum1 = _mm256_add_ps(sum1, e1);
  }
  for (; j < seen; j += 8) {  // the last seen % 16: 8 at a time, the final part padded with -inf
    alignas(32) float t[8];
    int64_t k = std::min<int64_t>(8, seen - j);
    for (int64_t i = 0; i < 8; ++i) t[i] = i < k ? s[j + i] : -INFINITY;
    __m256 e = exp8(_mm256_fmsub_ps(_mm256_load_ps(t), sv, mv));
    e = _mm256_and_ps(e, _mm256_cmp_ps(_mm256_load_ps(t), _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
    _mm256_store_ps(t, e);
    for (int64_t i = 0; i < k; ++i) s[j + i] = t[i];
    sum1 = _mm256_add_ps(sum1, e);
  }
  _mm256_store_ps(lanes, _mm256_add_ps(sum0, sum1));
  total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  std::fill(s + seen, s + n, 0.0f);
  top = m;
}

template <int D, typename T, bool Wide>
struct AttendOp {
  // A (head, span) task of prelude.h's attend_spans: the rows' scores in a scratch block, their weights,
  // then their weighted sum of the span's values.
  static void run(const at::Tensor& keys, const at::Tensor& values, const float* rows, int64_t R,
                  const int64_t* limits, int64_t tokens, float scale, float* out) {
    const T* k = reinterpret_cast<const T*>(keys.const_data_ptr());
    const T* v = reinterpret_cast<const T*>(values.const_data_ptr());
    attend_spans(keys.size(0), keys.size(1), R, D, limits, tokens, out,
                 [&](int64_t h, int64_t s0, int64_t reach, const int64_t* seen, float* part, float* top, float* total) {
      // each thread's scratch, kept between calls: a fresh one per task (up to 344 KB at 42 rows) cost
      // its page faults every time, as much as the softmax itself
      thread_local std::vector<float> scratch;
      if (scratch.size() < size_t(R * reach)) scratch.resize(R * reach);
      float* weights = scratch.data();
      scores_head<D, T, Wide>(rows + h * R * D, R, k + h * keys.stride(0) + s0 * D, reach, weights, reach);
      for (int64_t r = 0; r < R; ++r) span_weights<Wide>(weights + r * reach, seen[r], reach, scale, top[r], total[r]);
      mix_head<D, T, Wide>(weights, R, reach, reach, v + h * values.stride(0) + s0 * D, part);
    });
  }
};

// ======== the ops ========

void check_cache(const at::Tensor& cache, int64_t heads, int64_t D) {
  TORCH_CHECK(cache.dim() == 3 && cache.size(0) == heads && cache.size(2) == D,
              "cache must be (heads, tokens, head_dim) like the rows");
  TORCH_CHECK(cache.stride(2) == 1 && cache.stride(1) == D, "each head's tokens must be contiguous");
  auto t = cache.scalar_type();
  TORCH_CHECK(t == at::kHalf || t == at::kBFloat16 || t == at::kFloat, "cache must be float16, bfloat16 or float32");
}

// the kernel for this head_dim and cache dtype, in the code use_avx512 chose, run for each head
template <template <int, typename, bool> class Op, int D, typename T, typename... Args>
void in_code(const at::Tensor& cache, Args... args) {
  if (use_wide) Op<D, T, true>::run(cache, args...);
  else Op<D, T, false>::run(cache, args...);
}

template <template <int, typename, bool> class Op, typename... Args>
void per_head(const at::Tensor& cache, int64_t D, Args... args) {
  auto t = cache.scalar_type();
  if (D == 64) {
    if (t == at::kHalf) in_code<Op, 64, f16>(cache, args...);
    else if (t == at::kBFloat16) in_code<Op, 64, b16>(cache, args...);
    else in_code<Op, 64, float>(cache, args...);
  } else {
    if (t == at::kHalf) in_code<Op, 128, f16>(cache, args...);
    else if (t == at::kBFloat16) in_code<Op, 128, b16>(cache, args...);
    else in_code<Op, 128, float>(cache, args...);
  }
}

template <int D, typename T, bool Wide>
struct ScoresOp {
  static void run(const at::Tensor& keys, const float* rows, int64_t R, float* out) {
    int64_t H = keys.size(0), S = keys.size(1), C = spans(S);
    const T* k = reinterpret_cast<const T*>(keys.const_data_ptr());
    over_tasks(H * C, H * S * R * D, [&](int64_t task) {
      int64_t h = task % H, s0 = task / H * SPAN;
      scores_head<D, T, Wide>(rows + h * R * D, R, k + h * keys.stride(0) + s0 * D, std::min(SPAN, S - s0),
                        out + h * R * S + s0, S);
    });
  }
};

template <int D, typename T, bool Wide>
struct MixOp {
  static void run(const at::Tensor& values, const float* probs, int64_t R, float* out) {
    int64_t H = values.size(0), S = values.size(1), C = spans(S);
    const T* v = reinterpret_cast<const T*>(values.const_data_ptr());
    if (C == 1) {  // one span a head: straight into the output
      over_tasks(H, H * S * R * D, [&](int64_t h) {
        mix_head<D, T, Wide>(probs + h * R * S, R, S, S, v + h * values.stride(0), out + h * R * D);
      });
      return;
    }
    std::vector<float> parts(H * C * R * D);
    over_tasks(H * C, H * S * R * D, [&](int64_t task) {
      int64_t h = task % H, c = task / H, t = h * C + c, s0 = c * SPAN;
      mix_head<D, T, Wide>(probs + h * R * S + s0, R, std::min(SPAN, S - s0), S, v + h * values.stride(0) + s0 * D,
                     parts.data() + t * R * D);
    });
    for (int64_t h = 0; h < H; ++h) {
      float* o = out + h * R * D;
      std::copy(parts.data() + h * C * R * D, parts.data() + (h * C + 1) * R * D, o);
      for (int64_t c = 1; c < C; ++c) {
        const float* part = parts.data() + (h * C + c) * R * D;
        for (int64_t i = 0; i < R * D; ++i) o[i] += part[i];
      }
    }
  }
};

at::Tensor scores(const at::Tensor& rows_in, const at::Tensor& keys) {
  auto rows = rows_in.contiguous();
  TORCH_CHECK(rows.dim() == 3 && rows.scalar_type() == at::kFloat, "rows must be float32 (heads, rows, head_dim)");
  int64_t H = rows.size(0), R = rows.size(1), D = rows.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  check_cache(keys, H, D);
  auto out = at::empty({H, R, keys.size(1)}, rows.options());
  if (R > 0 && keys.size(1) > 0) per_head<ScoresOp>(keys, D, rows.const_data_ptr<float>(), R, out.data_ptr<float>());
  return out;
}

at::Tensor mix(const at::Tensor& probs_in, const at::Tensor& values) {
  auto probs = probs_in.contiguous();
  TORCH_CHECK(probs.dim() == 3 && probs.scalar_type() == at::kFloat, "probs must be float32 (heads, rows, tokens)");
  int64_t H = probs.size(0), R = probs.size(1), D = values.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  check_cache(values, H, D);
  TORCH_CHECK(values.size(1) == probs.size(2), "probs must have one weight per cached token");
  auto out = at::empty({H, R, D}, probs.options());
  if (values.size(1) == 0) out.zero_();  // no tokens: nothing to mix
  else if (R > 0) per_head<MixOp>(values, D, probs.const_data_ptr<float>(), R, out.data_ptr<float>());
  return out;
}

at::Tensor attend(const at::Tensor& rows_in, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& limits_in, double scale) {
  auto rows = rows_in.contiguous();
  auto limits = limits_in.to(at::kLong).contiguous();
  TORCH_CHECK(rows.dim() == 3 && rows.scalar_type() == at::kFloat, "rows must be float32 (heads, rows, head_dim)");
  int64_t H = rows.size(0), R = rows.size(1), D = rows.size(2), T = limits.numel();
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  check_cache(keys, H, D);
  check_cache(values, H, D);
  TORCH_CHECK(keys.size(1) == values.size(1) && keys.scalar_type() == values.scalar_type(),
              "keys and values must match");
  TORCH_CHECK(limits.dim() == 1 && T > 0 && R % T == 0, "limits must hold one count per token of the rows");
  auto out = at::empty({H, R, D}, rows.options());
  if (keys.size(1) == 0) out.zero_();
  else if (R > 0) per_head<AttendOp>(keys, D, values, rows.const_data_ptr<float>(), R,
                                     limits.const_data_ptr<int64_t>(), T, float(scale), out.data_ptr<float>());
  return out;
}

// ======== a decode layer's cache write and attention in one call ========

// what torch's copy_ does to a float32 value going into the cache: round to nearest even
template <typename T> inline T narrowed(float x);
template <> inline float narrowed<float>(float x) { return x; }
template <> inline f16 narrowed<f16>(float x) { return f16{c10::Half(x).x}; }
template <> inline b16 narrowed<b16>(float x) { return b16{c10::BFloat16(x).x}; }

// rows (T, H, D), any token and head strides, into cache (L, H, S, D) at [layer, :, start:start + T]
template <typename T>
void store(const at::Tensor& rows, const at::Tensor& cache, int64_t layer, int64_t start) {
  int64_t tokens = rows.size(0), H = rows.size(1), D = rows.size(2);
  const float* x = rows.const_data_ptr<float>();
  T* c = reinterpret_cast<T*>(cache.data_ptr()) + layer * cache.stride(0) + start * D;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* from = x + t * rows.stride(0) + h * rows.stride(1);
      T* to = c + h * cache.stride(1) + t * D;
      for (int64_t d = 0; d < D; ++d) to[d] = narrowed<T>(from[d]);
    }
}

// The new tokens' keys and values into the cache, then their queries' attention over the cache's
// first start + T tokens, token t seeing start + t + 1: what `attend` computes for the grouped rows,
// with the row grouping, the cache views, the limits and the output's layout done here rather than
// as some twenty small torch ops per layer (a decode step's host cost, not its bytes).
at::Tensor cache_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor cache_k,
                        at::Tensor cache_v, int64_t layer, int64_t start, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.scalar_type() == at::kFloat &&
              k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "q, k, v must be float32 (tokens, heads, head_dim)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), H = k.size(1);
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == H && k.size(2) == D && v.size(2) == D &&
              H > 0 && Hq % H == 0, "q, k, v disagree");
  TORCH_CHECK(cache_k.dim() == 4 && cache_k.is_contiguous() && cache_v.is_contiguous() &&
              cache_k.sizes() == cache_v.sizes() && cache_k.scalar_type() == cache_v.scalar_type() &&
              cache_k.size(1) == H && cache_k.size(3) == D, "caches must be (layers, kv_heads, slots, head_dim)");
  TORCH_CHECK(0 <= layer && layer < cache_k.size(0) && 0 <= start && start + T <= cache_k.size(2),
              "layer or slots out of the cache");
  auto dtype = cache_k.scalar_type();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat,
              "cache must be float16, bfloat16 or float32");
  for (const auto& [rows, cache] : {std::pair{k, cache_k}, std::pair{v, cache_v}}) {
    if (dtype == at::kHalf) store<f16>(rows, cache, layer, start);
    else if (dtype == at::kBFloat16) store<b16>(rows, cache, layer, start);
    else store<float>(rows, cache, layer, start);
  }
  int64_t rep = Hq / H, R = rep * T;
  // rows (H, rep * T, D) ordered (kv head, query head in its group, token), as attention.py groups them
  auto rows = at::empty({H, R, D}, q.options());
  float* g = rows.data_ptr<float>();
  const float* qd = q.const_data_ptr<float>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t j = 0; j < rep; ++j)
      for (int64_t t = 0; t < T; ++t)
        std::memcpy(g + ((h * rep + j) * T + t) * D, qd + t * q.stride(0) + (h * rep + j) * q.stride(1), D * sizeof(float));
  std::vector<int64_t> limits(T);
  for (int64_t t = 0; t < T; ++t) limits[t] = start + t + 1;
  auto keys = cache_k.select(0, layer).narrow(1, 0, start + T);
  auto values = cache_v.select(0, layer).narrow(1, 0, start + T);
  auto grouped = at::empty({H, R, D}, q.options());
  if (T > 0) per_head<AttendOp>(keys, D, values, rows.const_data_ptr<float>(), R, limits.data(), T, float(scale),
                                grouped.data_ptr<float>());
  // (H, rep, T, D) -> (T, Hq * D)
  auto out = at::empty({T, Hq * D}, q.options());
  const float* o = grouped.const_data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < Hq; ++i)
      std::memcpy(out.data_ptr<float>() + (t * Hq + i) * D, o + (i * T + t) * D, D * sizeof(float));
  return out;
}

}  // namespace

TORCH_LIBRARY(triforce_decode_f32, m) {
  m.def("use_pool(int address) -> ()", &use_pool);
  m.def("use_avx512(bool on) -> ()", &use_avx512);
  m.def("scores(Tensor rows, Tensor keys) -> Tensor");
  m.def("mix(Tensor probs, Tensor values) -> Tensor");
  m.def("attend(Tensor rows, Tensor keys, Tensor values, Tensor limits, float scale) -> Tensor");
  m.def("cache_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) cache_k, Tensor(b!) cache_v, int layer, int start, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(triforce_decode_f32, CPU, m) {
  m.impl("scores", &scores);
  m.impl("mix", &mix);
  m.impl("attend", &attend);
  m.impl("cache_attend", &cache_attend);
}
