// Products with a model's stored blocks in float32 on avx2, and on avx512f where the CPU has it
// (stored_avx2.py), after prelude.h.

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

// every function below, lambdas included (they take no target attribute of their own), is avx2 code,
// but for those marked AVX512F
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace {

constexpr int BLOCK_COLUMNS = 32;
// ~25 us of one thread's work: a one-row product streams its records from memory, which two threads
// read faster than one (SmolLM2's 121 products, one row, 2 threads on the avx512 Xeon: 10.3 -> 8.4 ms
// in avx2 code, 9.7 -> 7.8 in avx512f code, against 2^19 weights a share)
constexpr int64_t GRAIN_WEIGHTS = int64_t(1) << 17;
inline float scale_value(uint16_t h) { return c10::Half(h, c10::Half::from_bits()); }
inline float scale_value(float f) { return f; }

AVX2 inline __m256 load_scales8(const uint16_t* p) {  // 8 f16 values, widened exactly
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
AVX2 inline __m256 load_scales8(const float* p) { return _mm256_loadu_ps(p); }

// nibble j of every lane as float, times 2^4j (j = 7: times 2^24)
template <int J>
AVX2 inline __m256 nibble(__m256i v) {
  if constexpr (J == 7) {
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), _mm256_set1_epi32(15 << 24)));
  } else {
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15 << (4 * J))));
  }
}

// byte b of every lane, signed, as float times 2^24
template <int B>
AVX2 inline __m256 byte24(__m256i v) {
  const __m256i top = _mm256_set1_epi32(int32_t(0xff000000u));
  if constexpr (B == 0) return _mm256_cvtepi32_ps(_mm256_slli_epi32(v, 24));
  else if constexpr (B == 3) return _mm256_cvtepi32_ps(_mm256_and_si256(v, top));
  else return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_slli_epi32(v, 24 - 8 * B), top));
}

// the column of a block that nibble j of vector c holds: low halves 8c + 2j, high halves 8c + 2(j-4) + 1
constexpr int q4_column(int c, int j) { return 8 * c + (j < 4 ? 2 * j : 2 * (j - 4) + 1); }
// Q8: byte b of vector c holds column 4c + (0, 2, 1, 3)[b]
constexpr int q8_column(int c, int b) { return 4 * c + (b == 0 ? 0 : b == 1 ? 2 : b == 2 ? 1 : 3); }

template <typename Scale> constexpr int q4_record() { return 256 + 2 * 16 * int(sizeof(Scale)); }
template <typename Scale> constexpr int q8_record() { return 512 + 16 * int(sizeof(Scale)); }

// Sum chains per (row, half), the same for every number of rows, so that a row's sums run in one
// order however many rows share the call: a verification pass computes each row as a one-token pass
// does, bit for bit. One chain: more left the 4-row tile short of registers (SmolLM2-sized Q8_0 at 4
// rows, 2 chains 4.9 ms against 2.2 with one; one row 1.1 against 0.9 with 4 chains, not batch-invariant)
constexpr int CHAINS = 1;
constexpr int TILE = 4;  // rows of x per pass over a group's records
template <int NR> constexpr int chains() { return CHAINS; }

template <int NR, int CH>
struct Sums {
  __m256 t[NR][2][CH];
  AVX2 void zero() {
    for (int r = 0; r < NR; ++r)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < CH; ++c) t[r][h][c] = _mm256_setzero_ps();
  }
  AVX2 __m256 total(int r, int h) const {
    __m256 s = t[r][h][0];
    for (int c = 1; c < CH; ++c) s = _mm256_add_ps(s, t[r][h][c]);
    return s;
  }
};

// One group of 16 output rows against NR rows of x (xs: x scaled per column, see the docstring;
// sx: block sums of x); acc[r][h] = outputs 8h..8h+7 of row r
template <int NR, typename Scale>
AVX2 void q4_group(const uint8_t* rec, int64_t blocks, const float* const* xs, const float* const* sx, __m256 (*acc)[2]) {
  constexpr int RECORD = q4_record<Scale>(), CH = chains<NR>();
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  Sums<NR, CH> s;
  for (int64_t b = 0; b < blocks; ++b, rec += RECORD) {
    for (int line = 0; line < RECORD; line += 64) read_ahead(rec + line);
    s.zero();
    const float* xb[NR];
    for (int r = 0; r < NR; ++r) xb[r] = xs[r] + BLOCK_COLUMNS * b;
    auto step = [&](auto jc, int c, __m256i v0, __m256i v1) {
      constexpr int J = decltype(jc)::value;
      __m256 w0 = nibble<J>(v0), w1 = nibble<J>(v1);
      int col = q4_column(c, J);
      for (int r = 0; r < NR; ++r) {
        __m256 x = _mm256_broadcast_ss(xb[r] + col);
        s.t[r][0][J % CH] = _mm256_fmadd_ps(w0, x, s.t[r][0][J % CH]);
        s.t[r][1][J % CH] = _mm256_fmadd_ps(w1, x, s.t[r][1][J % CH]);
      }
    };
    for (int c = 0; c < 4; ++c) {
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c + 32));
      step(std::integral_constant<int, 0>{}, c, v0, v1);
      step(std::integral_constant<int, 1>{}, c, v0, v1);
      step(std::integral_constant<int, 2>{}, c, v0, v1);
      step(std::integral_constant<int, 3>{}, c, v0, v1);
      step(std::integral_constant<int, 4>{}, c, v0, v1);
      step(std::integral_constant<int, 5>{}, c, v0, v1);
      step(std::integral_constant<int, 6>{}, c, v0, v1);
      step(std::integral_constant<int, 7>{}, c, v0, v1);
    }
    const Scale* d = reinterpret_cast<const Scale*>(rec + 256);
    const Scale* m = d + 16;
    for (int h = 0; h < 2; ++h) {
      __m256 dh = load_scales8(d + 8 * h), mh = load_scales8(m + 8 * h);
      for (int r = 0; r < NR; ++r)
        acc[r][h] = _mm256_fmadd_ps(mh, _mm256_set1_ps(sx[r][b]), _mm256_fmadd_ps(s.total(r, h), dh, acc[r][h]));
    }
  }
}

template <int NR, typename Scale>
AVX2 void q8_group(const uint8_t* rec, int64_t blocks, const float* const* x, const float* const*, __m256 (*acc)[2]) {
  constexpr int RECORD = q8_record<Scale>(), CH = chains<NR>();
  const __m256 unscale = _mm256_set1_ps(1.0f / 16777216.0f);  // 2^-24: the codes arrive times 2^24
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  Sums<NR, CH> s;
  for (int64_t b = 0; b < blocks; ++b, rec += RECORD) {
    for (int line = 0; line < RECORD; line += 64) read_ahead(rec + line);
    s.zero();
    const float* xb[NR];
    for (int r = 0; r < NR; ++r) xb[r] = x[r] + BLOCK_COLUMNS * b;
    auto step = [&](auto bc, int c, __m256i v0, __m256i v1) {
      constexpr int B = decltype(bc)::value;
      __m256 w0 = byte24<B>(v0), w1 = byte24<B>(v1);
      int col = q8_column(c, B);
      for (int r = 0; r < NR; ++r) {
        __m256 xv = _mm256_broadcast_ss(xb[r] + col);
        s.t[r][0][(c + B) % CH] = _mm256_fmadd_ps(w0, xv, s.t[r][0][(c + B) % CH]);
        s.t[r][1][(c + B) % CH] = _mm256_fmadd_ps(w1, xv, s.t[r][1][(c + B) % CH]);
      }
    };
    for (int c = 0; c < 8; ++c) {
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 64 * c + 32));
      step(std::integral_constant<int, 0>{}, c, v0, v1);
      step(std::integral_constant<int, 1>{}, c, v0, v1);
      step(std::integral_constant<int, 2>{}, c, v0, v1);
      step(std::integral_constant<int, 3>{}, c, v0, v1);
    }
    const Scale* d = reinterpret_cast<const Scale*>(rec + 512);
    for (int h = 0; h < 2; ++h) {
      __m256 dh = _mm256_mul_ps(load_scales8(d + 8 * h), unscale);  // exact: a power of two
      for (int r = 0; r < NR; ++r) acc[r][h] = _mm256_fmadd_ps(s.total(r, h), dh, acc[r][h]);
    }
  }
}

using GroupFn = void (*)(const uint8_t*, int64_t, const float* const*, const float* const*, __m256 (*)[2]);

template <template <int, typename> class Pick, typename Scale>
GroupFn group_fn(int rows) {
  switch (rows) {
    case 1: return Pick<1, Scale>::fn;
    case 2: return Pick<2, Scale>::fn;
    case 3: return Pick<3, Scale>::fn;
    default: return Pick<TILE, Scale>::fn;
  }
}
template <int NR, typename Scale> struct Q4 { static constexpr GroupFn fn = q4_group<NR, Scale>; };
template <int NR, typename Scale> struct Q8 { static constexpr GroupFn fn = q8_group<NR, Scale>; };

// ---- avx512f: a CPU with AVX-512 but no native bfloat16 (Xeons from Skylake-SP to Ice Lake), where
// the model computes in float32 too. A group's 16 outputs fill one register, so a code's decode and
// its multiply-add by a row of x are one instruction each where avx2 takes two; and WIDE_GROUPS
// groups go side by side, so that their sum chains overlap (one chain waits out each multiply-add's
// latency: 1536x576 Q4, one row, one thread, 0.078 ms for one group at a time against 0.052 for two
// on the avx512 Xeon, avx2 0.096). Each lane makes the avx2 kernel's lane's operations in its order
// (one chain per output and row, codes in the same order, the same roundings), so both give the same
// bits, and a machine's passes take one of them throughout.
constexpr int WIDE_GROUPS = 2;
bool use_wide = false;  // set from Python (stored_avx2.WIDE): avx512f here, TRIFORCE_AVX512 not 0
void use_avx512(bool on) { use_wide = on; }

template <int J>
AVX512F inline __m512 nibble(__m512i v) {
  if constexpr (J == 7) {
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4), _mm512_set1_epi32(15 << 24)));
  } else {
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15 << (4 * J))));
  }
}

template <int B>
AVX512F inline __m512 byte24(__m512i v) {
  const __m512i top = _mm512_set1_epi32(int32_t(0xff000000u));
  if constexpr (B == 0) return _mm512_cvtepi32_ps(_mm512_slli_epi32(v, 24));
  else if constexpr (B == 3) return _mm512_cvtepi32_ps(_mm512_and_si512(v, top));
  else return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_slli_epi32(v, 24 - 8 * B), top));
}

AVX512F inline __m512 load_scales16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
AVX512F inline __m512 load_scales16(const float* p) { return _mm512_loadu_ps(p); }

// What a record format's codes are: vectors of 64 bytes, codes per 32-bit word, where each sits
struct Q4Codes {
  static constexpr int VECTORS = 4, PER_WORD = 8, SCALES_AT = 256;
  static constexpr bool MINS = true;
  static constexpr int column(int c, int j) { return q4_column(c, j); }
  template <int J> AVX512F static __m512 decode(__m512i v) { return nibble<J>(v); }
};
struct Q8Codes {
  static constexpr int VECTORS = 8, PER_WORD = 4, SCALES_AT = 512;
  static constexpr bool MINS = false;
  static constexpr int column(int c, int b) { return q8_column(c, b); }
  template <int B> AVX512F static __m512 decode(__m512i v) { return byte24<B>(v); }
};

template <typename F, int... I>
AVX512F inline void each_index(F&& f, std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }

// NG groups (records `stride` bytes apart) against NR rows of x; out[r]: row r's outputs of the first
// group, `valid` of them real (a last partial group's padding stays out)
template <typename Codes, typename Scale, int NR, int NG>
AVX512F void wide_groups(const uint8_t* rec, int64_t stride, int64_t blocks, const float* const* xs,
                         const float* const* sx, float* const* out, int64_t valid) {
  constexpr int RECORD = Codes::MINS ? q4_record<Scale>() : q8_record<Scale>();
  const __m512 unscale = _mm512_set1_ps(Codes::MINS ? 1.0f : 1.0f / 16777216.0f);  // Q8: codes times 2^24
  __m512 acc[NG][NR];
  for (int g = 0; g < NG; ++g)
    for (int r = 0; r < NR; ++r) acc[g][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, rec += RECORD) {
    for (int g = 0; g < NG; ++g)
      for (int line = 0; line < RECORD; line += 64) read_ahead(rec + g * stride + line);
    __m512 s[NG][NR];
    for (int g = 0; g < NG; ++g)
      for (int r = 0; r < NR; ++r) s[g][r] = _mm512_setzero_ps();
    const float* xb[NR];
    for (int r = 0; r < NR; ++r) xb[r] = xs[r] + BLOCK_COLUMNS * b;
    for (int c = 0; c < Codes::VECTORS; ++c) {
      __m512i v[NG];
      for (int g = 0; g < NG; ++g) v[g] = _mm512_loadu_si512(rec + g * stride + 64 * c);
      each_index([&](auto jc) AVX512F {
        constexpr int J = decltype(jc)::value;
        const int col = Codes::column(c, J);
        for (int g = 0; g < NG; ++g) {
          __m512 w = Codes::template decode<J>(v[g]);
          for (int r = 0; r < NR; ++r) s[g][r] = _mm512_fmadd_ps(w, _mm512_set1_ps(xb[r][col]), s[g][r]);
        }
      }, std::make_integer_sequence<int, Codes::PER_WORD>{});
    }
    for (int g = 0; g < NG; ++g) {
      const Scale* d = reinterpret_cast<const Scale*>(rec + g * stride + Codes::SCALES_AT);
      __m512 dg = _mm512_mul_ps(load_scales16(d), unscale);  // exact: a power of two
      for (int r = 0; r < NR; ++r) {
        acc[g][r] = _mm512_fmadd_ps(s[g][r], dg, acc[g][r]);
        if constexpr (Codes::MINS) acc[g][r] = _mm512_fmadd_ps(load_scales16(d + 16), _mm512_set1_ps(sx[r][b]), acc[g][r]);
      }
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int r = 0; r < NR; ++r) {
      int64_t n = std::min<int64_t>(16, valid - 16 * g);
      _mm512_mask_storeu_ps(out[r] + 16 * g, __mmask16((1u << n) - 1), acc[g][r]);
    }
}

using WideFn = void (*)(const uint8_t*, int64_t, int64_t, const float* const*, const float* const*, float* const*, int64_t);

template <typename Codes, typename Scale, int NR>
WideFn wide_fn(int groups) {
  return groups >= WIDE_GROUPS ? wide_groups<Codes, Scale, NR, WIDE_GROUPS> : wide_groups<Codes, Scale, NR, 1>;
}

template <typename Codes, typename Scale>
WideFn wide_fn(int rows, int groups) {
  switch (rows) {
    case 1: return wide_fn<Codes, Scale, 1>(groups);
    case 2: return wide_fn<Codes, Scale, 2>(groups);
    case 3: return wide_fn<Codes, Scale, 3>(groups);
    default: return wide_fn<Codes, Scale, TILE>(groups);
  }
}

// groups first..last of the output through the avx512f kernels: WIDE_GROUPS at a time, TILE rows of x
// at a time (rows: x as the kernels read it, sums: Q4's block sums of x)
void wide_range(int64_t first, int64_t last, const uint8_t* rec, int64_t stride, int64_t blocks, int64_t R,
                int64_t K, const float* rows, const float* sums, float* o, int64_t out_features, bool q4, bool f32) {
  for (int64_t g = first; g < last; g += WIDE_GROUPS) {
    int ng = int(std::min<int64_t>(WIDE_GROUPS, last - g));
    for (int64_t r0 = 0; r0 < R; r0 += TILE) {
      int nr = int(std::min<int64_t>(TILE, R - r0));
      const float* xs[TILE];
      const float* sx[TILE];
      float* out[TILE];
      for (int r = 0; r < nr; ++r) {
        xs[r] = rows + (r0 + r) * K;
        sx[r] = sums ? sums + (r0 + r) * blocks : nullptr;
        out[r] = o + (r0 + r) * out_features + 16 * g;
      }
      WideFn fn = q4 ? (f32 ? wide_fn<Q4Codes, float>(nr, ng) : wide_fn<Q4Codes, uint16_t>(nr, ng))
                     : (f32 ? wide_fn<Q8Codes, float>(nr, ng) : wide_fn<Q8Codes, uint16_t>(nr, ng));
      fn(rec + g * stride, stride, blocks, xs, sx, out, out_features - 16 * g);
    }
  }
}

// Q4: x with column k of each block scaled by 2^-4j, j the nibble that holds it (2^-24 for j = 7),
// and the block sums of the unscaled x (the mins' factor)
void q4_inputs(const float* x, int64_t blocks, float* scaled, float* sums) {
  float scale[BLOCK_COLUMNS];
  for (int c = 0; c < 4; ++c)
    for (int j = 0; j < 8; ++j) scale[q4_column(c, j)] = j == 7 ? 1.0f / 16777216.0f : 1.0f / float(1 << (4 * j));
  for (int64_t b = 0; b < blocks; ++b) {
    float sum = 0;
    for (int k = 0; k < BLOCK_COLUMNS; ++k) {
      scaled[BLOCK_COLUMNS * b + k] = x[BLOCK_COLUMNS * b + k] * scale[k];
      sum += x[BLOCK_COLUMNS * b + k];
    }
    sums[b] = sum;
  }
}

AVX2 void store_group(const __m256* acc, float* out, int64_t valid) {
  if (valid >= 16) {
    _mm256_storeu_ps(out, acc[0]);
    _mm256_storeu_ps(out + 8, acc[1]);
    return;
  }
  alignas(32) float all[16];  // a last partial group: its padding rows stay out of the output
  _mm256_store_ps(all, acc[0]);
  _mm256_store_ps(all + 8, acc[1]);
  std::memcpy(out, all, valid * sizeof(float));
}

AVX2 at::Tensor product(const at::Tensor& x_in, const at::Tensor& records, int64_t out_features, bool q4) {
  auto x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 (rows, K)");
  TORCH_CHECK(records.dim() == 3 && records.scalar_type() == at::kByte && records.is_contiguous(),
              "records must be uint8 (groups, blocks, record bytes)");
  int64_t R = x.size(0), K = x.size(1), groups = records.size(0), blocks = records.size(1), bytes = records.size(2);
  TORCH_CHECK(K == BLOCK_COLUMNS * blocks && out_features <= 16 * groups && out_features > 16 * (groups - 1),
              "shapes disagree");
  bool f32 = bytes == (q4 ? q4_record<float>() : q8_record<float>());
  TORCH_CHECK(f32 || bytes == (q4 ? q4_record<uint16_t>() : q8_record<uint16_t>()), "unknown record size");
  const float* xd = x.const_data_ptr<float>();
  std::vector<float> scaled(q4 ? R * K : 0), sums(q4 ? R * blocks : 0);
  for (int64_t r = 0; q4 && r < R; ++r) q4_inputs(xd + r * K, blocks, scaled.data() + r * K, sums.data() + r * blocks);
  const float* rows = q4 ? scaled.data() : xd;
  auto out = at::empty({R, out_features}, x.options());
  float* o = out.data_ptr<float>();
  const uint8_t* rec = records.const_data_ptr<uint8_t>();
  // groups of output rows split over torch's threads (compute-bound past a row or two on avx2); a
  // thread's share is at least GRAIN_WEIGHTS weight-rows of work, so small matrices stay on one
  const int64_t grain = std::max<int64_t>(1, GRAIN_WEIGHTS / (16 * K * std::max<int64_t>(R, 1)));
  over_ranges(groups, grain, [&](int64_t first, int64_t last) {
  if (use_wide) {
    wide_range(first, last, rec, blocks * bytes, blocks, R, K, rows, q4 ? sums.data() : nullptr, o, out_features, q4, f32);
    return;
  }
  for (int64_t g = first; g < last; ++g) {
    const uint8_t* group = rec + g * blocks * bytes;
    for (int64_t r0 = 0; r0 < R; r0 += TILE) {
      int nr = int(std::min<int64_t>(TILE, R - r0));
      const float* xs[TILE];
      const float* sx[TILE];
      for (int r = 0; r < nr; ++r) {
        xs[r] = rows + (r0 + r) * K;
        sx[r] = q4 ? sums.data() + (r0 + r) * blocks : nullptr;
      }
      GroupFn fn = q4 ? (f32 ? group_fn<Q4, float>(nr) : group_fn<Q4, uint16_t>(nr))
                      : (f32 ? group_fn<Q8, float>(nr) : group_fn<Q8, uint16_t>(nr));
      __m256 acc[TILE][2];
      fn(group, blocks, xs, sx, acc);
      for (int r = 0; r < nr; ++r) store_group(acc[r], o + (r0 + r) * out_features + 16 * g, out_features - 16 * g);
    }
  }
  });
  return out;
}

// The dense float32 weights (N, K) of the records, for passes of many rows: w = d * q + m in one
// rounding (d * q is exact in float32: an f16, or Q4_K's f16 times 6 bits, times a small integer)
template <typename Scale>
void dense(const uint8_t* rec, int64_t groups, int64_t blocks, int64_t n, bool q4, float* w) {
  const int64_t K = BLOCK_COLUMNS * blocks, bytes = q4 ? q4_record<Scale>() : q8_record<Scale>();
  over_ranges(groups, std::max<int64_t>(1, GRAIN_WEIGHTS / (16 * K)), [&](int64_t first, int64_t last) {
  for (int64_t g = first; g < last; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* r = rec + (g * blocks + b) * bytes;
      const Scale* d = reinterpret_cast<const Scale*>(r + (q4 ? 256 : 512));
      for (int lane = 0; lane < 16 && 16 * g + lane < n; ++lane) {
        float* row = w + (16 * g + lane) * K + BLOCK_COLUMNS * b;
        float dl = scale_value(d[lane]), ml = q4 ? scale_value(d[16 + lane]) : 0.0f;
        for (int c = 0; c < (q4 ? 4 : 8); ++c) {
          uint32_t word;
          std::memcpy(&word, r + 64 * c + 4 * lane, 4);
          for (int j = 0; j < (q4 ? 8 : 4); ++j) {
            int q = q4 ? int((word >> (4 * j)) & 15) : int(int8_t(word >> (8 * j)));
            row[q4 ? q4_column(c, j) : q8_column(c, j)] = std::fma(dl, float(q), ml);
          }
        }
      }
    }
  });
}

at::Tensor dequantize(const at::Tensor& records, int64_t out_features, bool q4) {
  TORCH_CHECK(records.dim() == 3 && records.scalar_type() == at::kByte && records.is_contiguous(), "records must be uint8");
  int64_t groups = records.size(0), blocks = records.size(1), bytes = records.size(2);
  auto w = at::empty({out_features, BLOCK_COLUMNS * blocks}, records.options().dtype(at::kFloat));
  bool f32 = bytes == (q4 ? q4_record<float>() : q8_record<float>());
  if (f32) dense<float>(records.const_data_ptr<uint8_t>(), groups, blocks, out_features, q4, w.data_ptr<float>());
  else dense<uint16_t>(records.const_data_ptr<uint8_t>(), groups, blocks, out_features, q4, w.data_ptr<float>());
  return w;
}

at::Tensor q4_product(const at::Tensor& x, const at::Tensor& records, int64_t n) { return product(x, records, n, true); }
at::Tensor q8_product(const at::Tensor& x, const at::Tensor& records, int64_t n) { return product(x, records, n, false); }
at::Tensor q4_dense(const at::Tensor& records, int64_t n) { return dequantize(records, n, true); }
at::Tensor q8_dense(const at::Tensor& records, int64_t n) { return dequantize(records, n, false); }

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY(triforce_stored_f32, m) {
  m.def("use_pool(int address) -> ()", &use_pool);
  m.def("use_avx512(bool on) -> ()", &use_avx512);
  m.def("q4_product(Tensor x, Tensor records, int out_features) -> Tensor");
  m.def("q8_product(Tensor x, Tensor records, int out_features) -> Tensor");
  m.def("q4_dense(Tensor records, int out_features) -> Tensor");
  m.def("q8_dense(Tensor records, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(triforce_stored_f32, CPU, m) {
  m.impl("q4_product", &q4_product);
  m.impl("q8_product", &q8_product);
  m.impl("q4_dense", &q4_dense);
  m.impl("q8_dense", &q8_dense);
}
