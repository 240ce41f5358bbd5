// Decode attention's two products in avx512f code (decode_attention_f32.py), after
// attention_f32_blocks.h: for a CPU with AVX-512 but no native bfloat16 (Xeons from Skylake-SP to
// Ice Lake), where the model computes in float32. A register holds 16 lanes where avx2's holds 8,
// and each lane makes the avx2 code's operations in its order, so the two codes give the same bits
// (a machine's tokens do not depend on which ran, nor on TRIFORCE_AVX512).
//
// - scores: two rows share a register, row 2p's 8 partial sums in the low half and row 2p+1's in the
//   high half (the rows packed so: 8 dims of one, the same 8 of the other, in turn). Each key chunk is
//   widened once into both halves and multiply-added into up to 3 pairs' sums: a widening serves 6
//   rows where the avx2 code's serves 2, and one instruction makes two rows' multiply-adds. Each
//   (row, key)'s 8 partial sums are reduced by the avx2 code's tree of horizontal adds, per half.
// - mix: a register holds 16 dims of a row's sums; 6 rows x 64 dims in 24 registers, each value chunk
//   widened once for the 6; each (row, dim)'s sum adds its keys in the avx2 code's order.

namespace {

bool use_wide = false;  // set from Python (decode_attention_f32.WIDE): avx512f here, TRIFORCE_AVX512 not 0
void use_avx512(bool on) { use_wide = on; }

// 8 values widened, in both halves of a register
template <typename T> AVX512F inline __m512 load8x2(const T* p);
template <> AVX512F inline __m512 load8x2<float>(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}
template <> AVX512F inline __m512 load8x2<f16>(const f16* p) {
  return _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
template <> AVX512F inline __m512 load8x2<b16>(const b16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// 16 consecutive values widened
template <typename T> AVX512F inline __m512 load16(const T* p);
template <> AVX512F inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <> AVX512F inline __m512 load16<f16>(const f16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
template <> AVX512F inline __m512 load16<b16>(const b16* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// ======== scores ========

constexpr int SCORE_PAIRS = 3;  // pairs of rows a tile: 3 x 8 sums, the rows' chunks and a key beside them

// Below a full tile of rows the scores are bound by reading the keys, and the avx2 code's narrower
// reduction left it ahead (SmolLM2's 30 layers at 4,096 float16 keys, one thread on the avx512 Xeon:
// 1-4 rows 0.90-0.98x, 6 rows 1.10x, 21 rows 1.49x); the values product gains from 2 rows
constexpr int64_t WIDE_SCORE_ROWS = 2 * SCORE_PAIRS - 1, WIDE_MIX_ROWS = 2;

// the rows (R x D) as pairs, each pair's chunks of 8 dims interleaved (row 2p's, then row 2p+1's);
// an odd last row is paired with a copy of itself, whose sums are not stored. Each thread's buffer is
// kept between calls.
template <int D>
const float* pack_pairs(const float* rows, int64_t R) {
  thread_local std::vector<float> packed;
  int64_t pairs = (R + 1) / 2;
  if (packed.size() < size_t(pairs * 2 * D)) packed.resize(pairs * 2 * D);
  float* out = packed.data();
  for (int64_t p = 0; p < pairs; ++p) {
    const float *a = rows + 2 * p * D, *b = rows + std::min(2 * p + 1, R - 1) * D;
    for (int c = 0; c < D / 8; ++c, out += 16) {
      std::memcpy(out, a + 8 * c, 8 * sizeof(float));
      std::memcpy(out + 8, b + 8 * c, 8 * sizeof(float));
    }
  }
  return packed.data();
}

// _mm256_hadd_ps's sums in each 128-bit quarter: (a0 + a1, a2 + a3, b0 + b1, b2 + b3)
AVX512F inline __m512 hadd4(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// a pair's partial sums with 8 keys (a[j]: key j's, row 0's 8 in the low half, row 1's in the high)
// -> the 8 totals of row 0 (low half) and of row 1 (high half), each by totals8's tree
AVX512F inline __m512 pair_totals8(const __m512* a) {
  // quarters: row 0's lanes 0-3 and 4-7 summed per key, then row 1's (keys 0-3 in u0, 4-7 in u1)
  __m512 u0 = hadd4(hadd4(a[0], a[1]), hadd4(a[2], a[3]));
  __m512 u1 = hadd4(hadd4(a[4], a[5]), hadd4(a[6], a[7]));
  __m512 low = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0));
  __m512 high = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1));
  __m512 t = _mm512_add_ps(low, high);  // (row 0 keys 0-3, row 1 keys 0-3, row 0 keys 4-7, row 1 keys 4-7)
  return _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(3, 1, 2, 0));
}

// P packed pairs . 8 consecutive keys -> out (rows ld apart); of the last pair, only `rows` rows
// (the tile's rows left) are stored
template <int D, int P, typename T>
AVX512F inline void pairs_dots8(const float* packed, const T* k, int64_t rows, float* out, int64_t ld) {
  __m512 acc[P][8];
  for (int p = 0; p < P; ++p)
    for (int j = 0; j < 8; ++j) acc[p][j] = _mm512_setzero_ps();
  for (int c = 0; c < D / 8; ++c) {
    __m512 q[P];
    for (int p = 0; p < P; ++p) q[p] = _mm512_loadu_ps(packed + (p * (D / 8) + c) * 16);
    for (int j = 0; j < 8; ++j) {
      __m512 x = load8x2(k + j * D + 8 * c);
      for (int p = 0; p < P; ++p) acc[p][j] = _mm512_fmadd_ps(q[p], x, acc[p][j]);
    }
  }
  for (int p = 0; p < P; ++p) {
    __m512 t = pair_totals8(acc[p]);
    _mm256_storeu_ps(out + 2 * p * ld, _mm512_castps512_ps256(t));
    if (2 * p + 1 < rows)
      _mm256_storeu_ps(out + (2 * p + 1) * ld, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(t), 1)));
  }
}

// steps (ahead.step calls) per 8 keys of a block: one per tile of pairs
inline int64_t wide_score_tiles(int64_t R) { return ((R + 1) / 2 + SCORE_PAIRS - 1) / SCORE_PAIRS; }

// out[r, 0:n] = rows[r] . k[0:n] for every row (packed by pack_pairs), n a multiple of 8
template <int D, typename T>
AVX512F void score_rows_wide(const float* packed, int64_t R, const T* k, int64_t n, float* out, int64_t S,
                             Ahead& ahead) {
  if constexpr (!std::is_same_v<T, float>) {
    if (wide_score_tiles(R) >= 2) {  // the block widened once for all the tiles
      alignas(64) float widened[BLOCK];
      for (int64_t i = 0; i < n * D; i += 16) _mm512_store_ps(widened + i, load16(k + i));
      return score_rows_wide<D, float>(packed, R, widened, n, out, S, ahead);
    }
  }
  constexpr int64_t PAIR = 2 * D;  // floats a packed pair
  int64_t pairs = (R + 1) / 2, p = 0;
  for (; p + SCORE_PAIRS <= pairs; p += SCORE_PAIRS)
    for (int64_t j = 0; j < n; j += 8) {
      ahead.step();
      pairs_dots8<D, SCORE_PAIRS>(packed + p * PAIR, k + j * D, R - 2 * p, out + 2 * p * S + j, S);
    }
  for (int64_t j = 0; p < pairs && j < n; j += 8) {
    ahead.step();
    if (pairs - p == 2) pairs_dots8<D, 2>(packed + p * PAIR, k + j * D, R - 2 * p, out + 2 * p * S + j, S);
    else pairs_dots8<D, 1>(packed + p * PAIR, k + j * D, R - 2 * p, out + 2 * p * S + j, S);
  }
}

// ======== mix ========

constexpr int WIDE_MROWS = 6;  // rows per full tile: 6 x 4 sums, 4 value chunks, 1 weight

// chunks of 16 dims per tile's pass: every dim of a 64-dim head; 8 (one pass) for 1-2 rows at 128
template <int D>
constexpr int wide_chunks(int64_t rows) { return std::min(D / 16, rows <= 2 ? 8 : 4); }

template <int D>
int64_t wide_mix_passes(int64_t R) {
  int64_t rest = R % WIDE_MROWS;
  return R / WIDE_MROWS * (D / 16 / wide_chunks<D>(WIDE_MROWS)) + (rest ? D / 16 / wide_chunks<D>(rest) : 0);
}

// out[r] += probs[r, 0:n] . v[0:n] for RT rows, CH chunks of 16 dims a pass
template <int D, int RT, int CH, typename T>
AVX512F void mix_tile_wide(const float* p, int64_t S, const T* v, int64_t n, float* out, Ahead& ahead) {
  for (int g = 0; g < D / 16; g += CH) {
    __m512 acc[RT][CH];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_loadu_ps(out + r * D + 16 * (g + c));
    for (int64_t s = 0; s < n; ++s) {
      ahead.step();
      __m512 x[CH];
      for (int c = 0; c < CH; ++c) x[c] = load16(v + s * D + 16 * (g + c));
      for (int r = 0; r < RT; ++r) {
        __m512 w = _mm512_set1_ps(p[r * S + s]);
        for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_fmadd_ps(w, x[c], acc[r][c]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(out + r * D + 16 * (g + c), acc[r][c]);
  }
}

template <int D, typename T>
AVX512F void mix_rows_wide(const float* probs, int64_t R, int64_t S, const T* v, int64_t n, float* out,
                           Ahead& ahead) {
  int64_t r = 0;
  for (; r + WIDE_MROWS <= R; r += WIDE_MROWS)
    mix_tile_wide<D, WIDE_MROWS, wide_chunks<D>(WIDE_MROWS)>(probs + r * S, S, v, n, out + r * D, ahead);
  const float* p = probs + r * S;
  float* o = out + r * D;
  switch (R - r) {
    case 5: mix_tile_wide<D, 5, wide_chunks<D>(5)>(p, S, v, n, o, ahead); break;
    case 4: mix_tile_wide<D, 4, wide_chunks<D>(4)>(p, S, v, n, o, ahead); break;
    case 3: mix_tile_wide<D, 3, wide_chunks<D>(3)>(p, S, v, n, o, ahead); break;
    case 2: mix_tile_wide<D, 2, wide_chunks<D>(2)>(p, S, v, n, o, ahead); break;
    case 1: mix_tile_wide<D, 1, wide_chunks<D>(1)>(p, S, v, n, o, ahead); break;
  }
}

}  // namespace

namespace {

// ======== the softmax's exponentials ========

// prelude.h's expf in 16 lanes: exp8's operations lane by lane (round to nearest even as
// _mm256_round_ps does), so the same bits
AVX512F inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_FLOOR));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x));
  __m512 p = _mm512_set1_ps(EXP_POLY[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_POLY[i]));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// span_weights' main loop: s[0:n] (n a multiple of 16) -> e^(s * scale - m) in place, and the avx2
// code's two sums of them (sum0 over each 16's first 8, sum1 over its last 8) into sums[0:8], sums[8:16]:
// a register's low half is sum0's chain, its high half sum1's
AVX512F inline void exps16(float* s, int64_t n, float scale, float m, float* sums) {
  __m512 sv = _mm512_set1_ps(scale), mv = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    __m512 e = exp16(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), sv, mv));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  _mm512_storeu_ps(sums, sum);
}

}  // namespace
