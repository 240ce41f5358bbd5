// Attention at a few to a few dozen queries in bfloat16 (decode_attention.py), after prelude.h and
// amx_frame.h.

#include <ATen/ScalarOps.h>
#include <algorithm>
#include <vector>

namespace {

inline int32_t word(const bf16* p) {  // two bf16 (p[0] in the low half) as one 32-bit lane
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// Software prefetch of a head's cache for the many-row kernels, spread over the steps of the loops
// that work on the block before: a block's lines asked for all at once, as it starts, stalled on the
// memory system's queue and left the products waiting (SmolLM2 at 16K keys, 42 rows: the values
// product 23 ms, 17 spread).
constexpr int64_t MARGIN = 4096;  // bytes asked for beyond the next block

struct Ahead {
  const char* next;  // the first line not yet asked for
  const char* end;   // the head's last byte + 1
  const char* limit;  // how far the current block's steps go
  int64_t per_step;

  // block_bytes read per block of `steps` steps. The first two blocks and MARGIN are asked for at
  // once; from there each block's steps ask for one block (without this head start the lines asked
  // for trailed the reads whenever the steps asked for no more than a block: 13-18 rows took twice
  // as long as 19 in the values product).
  Ahead(const bf16* from, const bf16* to, int64_t block_bytes, int64_t steps)
      : next(reinterpret_cast<const char*>(from)), end(reinterpret_cast<const char*>(to)),
        per_step((block_bytes / 64 + steps - 1) / steps) {
    aim(from, block_bytes);
    for (; next < limit; next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }

  // the block at `block` is read now: ask for the one after it and MARGIN beyond
  void aim(const bf16* block, int64_t block_bytes) {
    limit = std::min(end, reinterpret_cast<const char*>(block) + 2 * block_bytes + MARGIN);
  }

  inline void step() {
    for (int64_t i = 0; i < per_step && next < limit; ++i, next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
};

// ======== scores = rows . keys^T ========

// the scores' tasks take spans of prelude.h's SPAN keys (a multiple of the block, 64 keys)

// ---- keys in lanes ----
// A block of 64 keys is transposed once into kt: word p (dims 2p, 2p+1) of 16 keys per vector, key j
// in lane j. A row's scores against 16 keys are then a chain of D/2 pair dot products with the row's
// word p broadcast: no sums across lanes, each key vector loaded once for a tile of rows, and the
// block reused by every row before the next block is read.
constexpr int SBLOCK = 64;  // keys per transposed block: 4 vectors of 16 scores per row
constexpr int SROWS = 6;    // rows per tile: 6 x 4 accumulators, 4 key vectors, 1 broadcast

// rows x[j] (16 words each) -> x[i] holds word i of every row, row j in lane j
AVX512 inline void transpose16(__m512i* x) {
  __m512i t[16], u[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // u[4k+m], 128-bit lane L: word 4L+m of rows 4k..4k+3
    u[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    u[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    u[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // 4x4 transpose of the 128-bit lanes of u[m], u[4+m], u[8+m], u[12+m]
    __m512i v0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
    __m512i v2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
    x[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    x[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    x[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    x[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// n <= 64 keys -> kt[(b * D/2 + p) * 32 ...]: word p of keys 16b..16b+15 (keys past n read as 0)
template <int D, bool FULL>
AVX512 void transpose_block(const bf16* keys, int64_t n, bf16* kt, Ahead& ahead) {
  for (int b = 0; b < SBLOCK / 16; ++b)
    for (int c = 0; c < D / 32; ++c) {
      ahead.step();
      __m512i x[16];
      for (int j = 0; j < 16; ++j) {
        int64_t s = 16 * b + j;
        x[j] = FULL || s < n ? _mm512_loadu_si512(keys + s * D + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(x);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + (b * D / 2 + 16 * c + i) * 32, x[i]);
    }
}

// 32 scores (two vectors of 16 keys) as bf16, the first n of them. Rounded to nearest even by the
// instruction, which flushes float32 denormals to 0 as the pair dot products already did.
AVX512 inline void store32(bf16* out, __m512 lo, __m512 hi, int64_t n) {
  __m512i v = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  if (n >= 32) _mm512_storeu_si512(out, v);
  else if (n > 0) _mm512_mask_storeu_epi16(out, (__mmask32)((1u << n) - 1), v);
}

AVX512 inline void store32(float* out, __m512 lo, __m512 hi, int64_t n) {
  _mm512_mask_storeu_ps(out, (__mmask16)(n >= 16 ? 0xffff : (1u << std::max<int64_t>(n, 0)) - 1), lo);
  _mm512_mask_storeu_ps(out + 16, (__mmask16)(n >= 32 ? 0xffff : (1u << std::clamp<int64_t>(n - 16, 0, 16)) - 1), hi);
}

// out[r, 0:n] = rows[r] . keys[0:n] for RT rows against one transposed block
template <int D, int RT, typename O>
AVX512 void scores_tile(const bf16* rows, const bf16* kt, int64_t n, O* out, int64_t S, Ahead& ahead) {
  constexpr int NB = SBLOCK / 16;
  __m512 acc[RT][NB];
  for (int r = 0; r < RT; ++r)
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  // the lines these rows' scores of the next block go to, into L2: the rows lie S apart, their lines
  // in the same few sets of L1, and waiting for each line at its store cost 10% at 42 rows
  for (int r = 0; r < RT; ++r)
    for (int b = 0; b < NB; b += 2)
      _mm_prefetch(reinterpret_cast<const char*>(out + r * S + SBLOCK + 16 * b), _MM_HINT_T1);
  for (int p = 0; p < D / 2; ++p) {
    ahead.step();
    __m512bh k[NB];
    for (int b = 0; b < NB; ++b) k[b] = (__m512bh)_mm512_load_si512(kt + (b * D / 2 + p) * 32);
    for (int r = 0; r < RT; ++r) {
      __m512bh q = (__m512bh)_mm512_set1_epi32(word(rows + r * D + 2 * p));
      for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], q, k[b]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int b = 0; b < NB; b += 2) store32(out + r * S + 16 * b, acc[r][b], acc[r][b + 1], n - 16 * b);
}

// TILED: the keys are stored in tiles already (key_tiles.py: the layout transpose_block writes, 16
// keys a tile), so each block is read where it lies. Transposing is 64 shuffles per 16 keys and 32
// words, all on one port: the scores of 3 rows took 4.4 ms with it, 3.0 reading tiles (1 row: 4.0 and
// 2.05; SmolLM2, 30 layers at 4K keys, one thread). A part block reads its tiles whole: the buffers
// hold whole blocks, and the scores past n are not stored.
template <int D, bool TILED, typename O>
AVX512 void scores_many(const bf16* rows, int64_t R, const bf16* keys, int64_t S, O* out, int64_t ld) {
  alignas(64) bf16 buffer[TILED ? 32 : SBLOCK * D];
  constexpr int64_t bytes = SBLOCK * D * 2;
  Ahead ahead(keys, keys + S * D, bytes, (TILED ? 0 : SBLOCK / 16 * D / 32) + (R + SROWS - 1) / SROWS * D / 2);
  for (int64_t s0 = 0; s0 < S; s0 += SBLOCK) {
    int64_t n = std::min<int64_t>(SBLOCK, S - s0);
    ahead.aim(keys + s0 * D, bytes);
    const bf16* kt = buffer;
    if constexpr (TILED) kt = keys + s0 * D;
    else if (n == SBLOCK) transpose_block<D, true>(keys + s0 * D, n, buffer, ahead);
    else transpose_block<D, false>(keys + s0 * D, n, buffer, ahead);
    int64_t r = 0;
    for (; r + SROWS <= R; r += SROWS) scores_tile<D, SROWS>(rows + r * D, kt, n, out + r * ld + s0, ld, ahead);
    const bf16* q = rows + r * D;
    O* o = out + r * ld + s0;
    switch (R - r) {
      case 5: scores_tile<D, 5>(q, kt, n, o, ld, ahead); break;
      case 4: scores_tile<D, 4>(q, kt, n, o, ld, ahead); break;
      case 3: scores_tile<D, 3>(q, kt, n, o, ld, ahead); break;
      case 2: scores_tile<D, 2>(q, kt, n, o, ld, ahead); break;
      case 1: scores_tile<D, 1>(q, kt, n, o, ld, ahead); break;
    }
  }
}

// ======== out = probs . values: key pairs in each 32-bit lane ========
// Keys s, s+1 interleaved (unpacklo/hi_epi16 of their value rows) give 16 lanes of (v[s,d], v[s+1,d]),
// one pair dot product each with the broadcast (p[r,s], p[r,s+1]). unpacklo/hi work within 128-bit
// lanes, so the 32 dims of a 64-byte chunk land in a fixed order: lo holds dims 0-3, 8-11, 16-19,
// 24-27 and hi the other 16; the sums are put back in order once, when stored. An odd last key is
// paired with a zero value and a zero weight.
//
// PAIRED: the values are stored in pairs already (key_tiles.py: a full cache of a bf16 model), keys
// 2p and 2p + 1 as (v[2p, d], v[2p + 1, d]) for d in order, so a pair's 16 lanes are loaded where they
// lie and the sums come out in dim order. Interleaving took 3.5 of the 20 ms a decode step's values
// cost at 16K keys (SmolLM2, one thread, AMX), 9 of 27 at 21 rows. An odd last key's partner slot
// holds whatever the buffer does there (zeros, or a later token's value): its weight is 0, so it adds
// +-0 and the bits are those of a zero value.

// 32 dims of one row from their lo and hi sums, back in order, rounded to bf16
AVX512 inline void store_pairs(bf16* out, __m512 lo, __m512 hi) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16(_mm512_permutex2var_ps(lo, first, hi)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), to_bf16(_mm512_permutex2var_ps(lo, second, hi)));
}

AVX512 inline void store_pairs(float* out, __m512 lo, __m512 hi) {  // the same, kept in float32
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  _mm512_storeu_ps(out, _mm512_permutex2var_ps(lo, first, hi));
  _mm512_storeu_ps(out + 16, _mm512_permutex2var_ps(lo, second, hi));
}

// 16 sums in dim order, as float32 or rounded to bf16
AVX512 inline void store16(float* out, __m512 x) { _mm512_storeu_ps(out, x); }
AVX512 inline void store16(bf16* out, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16(x));
}

// ---- a few rows (one tile): every row's sums in registers through all keys ----
// acc[r] += keys s, s+1 of RT rows (PAIR false: key s alone, the last)
template <int D, int RT, bool PAIR, bool PAIRED>
AVX512 inline void mix_pair(const bf16* probs, int64_t S, const bf16* values, int64_t s, __m512 (*acc)[D / 16]) {
  const bf16* a = values + s * D;  // s is even: pair s / 2 starts there too
  for (int line = 0; line < 2 * D; line += 32) read_ahead(a + line);  // 64-byte lines
  __m512bh v[D / 16];
  if constexpr (PAIRED)
    for (int k = 0; k < D / 16; ++k) v[k] = (__m512bh)_mm512_loadu_si512(a + 32 * k);
  else for (int c = 0; c < D / 32; ++c) {
    __m512i x = _mm512_loadu_si512(a + 32 * c);
    __m512i y = PAIR ? _mm512_loadu_si512(a + D + 32 * c) : _mm512_setzero_si512();
    v[2 * c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
    v[2 * c + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
  }
  for (int r = 0; r < RT; ++r) {
    __m512bh p = (__m512bh)_mm512_set1_epi32(PAIR ? word(probs + r * S + s) : probs[r * S + s]);
    for (int k = 0; k < D / 16; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], p, v[k]);
  }
}

template <int D, int RT, bool PAIRED, typename O>
AVX512 void mix_few(const bf16* probs, int64_t S, const bf16* values, O* out) {
  __m512 acc[RT][D / 16];
  for (int r = 0; r < RT; ++r)
    for (int k = 0; k < D / 16; ++k) acc[r][k] = _mm512_setzero_ps();
  int64_t s = 0;
  for (; s + 2 <= S; s += 2) mix_pair<D, RT, true, PAIRED>(probs, S, values, s, acc);
  if (s < S) mix_pair<D, RT, false, PAIRED>(probs, S, values, s, acc);
  for (int r = 0; r < RT; ++r)
    if constexpr (PAIRED)
      for (int k = 0; k < D / 16; ++k) store16(out + r * D + 16 * k, acc[r][k]);
    else
      for (int c = 0; c < D / 32; ++c) store_pairs(out + r * D + 32 * c, acc[r][2 * c], acc[r][2 * c + 1]);
}

// ---- more rows: a block of keys interleaved once, then every tile of rows runs over it ----
// The rows' sums wait in a float32 buffer between blocks, so each value is read from memory once.
template <int D>
constexpr int MBLOCK = 4096 / D;  // keys per interleaved block: 8 KB (16 KB ran 3-6% slower at 21 rows)
constexpr int MROWS = 6;  // rows per tile: 6 x 4 accumulators (64 dims), 4 value vectors, 1 broadcast

template <int D>
AVX512 void interleave_block(const bf16* values, int64_t n, bf16* pk, Ahead& ahead) {
  for (int64_t t = 0; 2 * t < n; ++t) {
    ahead.step();
    const bf16* a = values + 2 * t * D;
    bool pair = 2 * t + 1 < n;
    for (int c = 0; c < D / 32; ++c) {
      __m512i x = _mm512_loadu_si512(a + 32 * c);
      __m512i y = pair ? _mm512_loadu_si512(a + D + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(pk + (t * D / 16 + 2 * c) * 32, _mm512_unpacklo_epi16(x, y));
      _mm512_store_si512(pk + (t * D / 16 + 2 * c + 1) * 32, _mm512_unpackhi_epi16(x, y));
    }
  }
}

// acc[r] += probs[r, 0:n] . values[0:n] for RT rows and the dc-th 64 dims, the sums in pair order
template <int D, int RT>
AVX512 void mix_tile(const bf16* probs, int64_t S, const bf16* pk, int64_t n, float* acc_rows, int dc, Ahead& ahead) {
  __m512 acc[RT][4];
  for (int r = 0; r < RT; ++r)
    for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_loadu_ps(acc_rows + r * D + 64 * dc + 16 * k);
  // these rows' weights of the next block, into L2: past a few dozen rows they come from memory
  if (dc == 0)
    for (int r = 0; r < RT; ++r)
      for (int s = 0; s < MBLOCK<D>; s += 32)
        _mm_prefetch(reinterpret_cast<const char*>(probs + r * S + MBLOCK<D> + s), _MM_HINT_T1);
  int64_t pairs = n / 2;
  for (int64_t t = 0; t < pairs; ++t) {
    ahead.step();
    __m512bh v[4];
    for (int k = 0; k < 4; ++k) v[k] = (__m512bh)_mm512_loadu_si512(pk + (t * D / 16 + 4 * dc + k) * 32);
    for (int r = 0; r < RT; ++r) {
      __m512bh p = (__m512bh)_mm512_set1_epi32(word(probs + r * S + 2 * t));
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], p, v[k]);
    }
  }
  if (n % 2) {  // the last key alone: its partner's value and weight are 0
    __m512bh v[4];
    for (int k = 0; k < 4; ++k) v[k] = (__m512bh)_mm512_loadu_si512(pk + (pairs * D / 16 + 4 * dc + k) * 32);
    for (int r = 0; r < RT; ++r) {
      __m512bh p = (__m512bh)_mm512_set1_epi32(probs[r * S + n - 1]);
      for (int k = 0; k < 4; ++k) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], p, v[k]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int k = 0; k < 4; ++k) _mm512_storeu_ps(acc_rows + r * D + 64 * dc + 16 * k, acc[r][k]);
}

template <int D, bool PAIRED, typename O>
AVX512 void mix_many(const bf16* probs, int64_t R, int64_t S, const bf16* values, O* out, float* acc) {
  constexpr int KB = MBLOCK<D>;
  alignas(64) bf16 buffer[PAIRED ? 32 : KB * D];
  for (int64_t i = 0; i < R * D; ++i) acc[i] = 0.0f;
  constexpr int64_t bytes = KB * D * 2;
  Ahead ahead(values, values + S * D, bytes, (PAIRED ? 0 : KB / 2) + (R + MROWS - 1) / MROWS * KB / 2 * D / 64);
  for (int64_t s0 = 0; s0 < S; s0 += KB) {
    int64_t n = std::min<int64_t>(KB, S - s0);
    ahead.aim(values + s0 * D, bytes);
    const bf16* pk = buffer;
    if constexpr (PAIRED) pk = values + s0 * D;
    else interleave_block<D>(values + s0 * D, n, buffer, ahead);
    for (int dc = 0; dc < D / 64; ++dc) {
      int64_t r = 0;
      for (; r + MROWS <= R; r += MROWS) mix_tile<D, MROWS>(probs + r * S + s0, S, pk, n, acc + r * D, dc, ahead);
      const bf16* p = probs + r * S + s0;
      float* a = acc + r * D;
      switch (R - r) {
        case 5: mix_tile<D, 5>(p, S, pk, n, a, dc, ahead); break;
        case 4: mix_tile<D, 4>(p, S, pk, n, a, dc, ahead); break;
        case 3: mix_tile<D, 3>(p, S, pk, n, a, dc, ahead); break;
        case 2: mix_tile<D, 2>(p, S, pk, n, a, dc, ahead); break;
        case 1: mix_tile<D, 1>(p, S, pk, n, a, dc, ahead); break;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r)
    if constexpr (PAIRED)
      for (int k = 0; k < D / 16; ++k) store16(out + r * D + 16 * k, _mm512_loadu_ps(acc + r * D + 16 * k));
    else
      for (int c = 0; c < D / 32; ++c)
        store_pairs(out + r * D + 32 * c, _mm512_loadu_ps(acc + r * D + 32 * c),
                    _mm512_loadu_ps(acc + r * D + 32 * c + 16));
}

// ======== both products through AMX tiles (CPUs with amx_bf16: Intel Sapphire Rapids and later) ========
// The avx512 kernels above run each row's pair dot products on their own, so past a few rows the
// products are bound by multiply-adds, not memory: a 7-token verification pass of SmolLM2 (21 rows a
// KV head) spent 0.41 ms a layer in attention at 4K keys, a decode step (3 rows) 0.074. TDPBF16PS sums
// a tile of up to 16 rows against 16 keys (or 16 dims) over 32 more in one instruction. Each sum of a
// tile is its own, in the order of the instruction and of the loops below, whatever rows share the
// tile; so that a verification pass gives each token the bits of its decode step, every row count
// takes the tiles where they serve (`use_tiles`, decided once per process), one row as well.
//
// Tiles: 0-3 and 6-7 hold a row tile's rows (rt <= 16), 4-5 sixteen (a key tile's words, 16 pairs
// of keys). scores: the rows' 32-dim chunks in 0 to D / 32 - 1, key tiles' chunks in 4 and 5, two
// key tiles' sums in 6 and 7. mix: 32 keys' weights in 0, 16 pairs of keys' values of 16 dims in 4
// and 5, the sums of 64 dims in 1, 2, 3 and 6.
#if defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11  // the compilers that know AMX
#define TILES_BUILD 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")

// every tile 64 bytes wide; 4 and 5 sixteen rows, the others rt. The scores give a part row tile
// zero rows to fill 16 (copied: a few rows of D) and drop their sums; the values' product reads its
// weights in place, rt rows of them
void configure_tiles(int rt) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = uint8_t(t == 4 || t == 5 ? 16 : rt);
  _tile_loadconfig(&c);
}

// a thread's buffer of at least n bf16, kept between calls, aligned for interleave_block's 64-byte stores
struct alignas(64) Line { bf16 x[32]; };
inline bf16* line_buffer(std::vector<Line>& lines, int64_t n) {
  if (lines.size() < size_t((n + 31) / 32)) lines.resize((n + 31) / 32);
  return lines.data()->x;
}

inline __mmask16 lanes16(int64_t k) { return k >= 16 ? __mmask16(0xffff) : k <= 0 ? 0 : __mmask16((1u << k) - 1); }

// the first k of 16 float32 sums, as float32 or rounded to bf16
inline void store_lanes(float* out, __m512 x, int64_t k) { _mm512_mask_storeu_ps(out, lanes16(k), x); }
inline void store_lanes(bf16* out, __m512 x, int64_t k) {
  _mm512_mask_storeu_epi16(out, __mmask32(lanes16(k)), _mm512_castsi256_si512(to_bf16(x)));
}

// a key tile's scores (16 keys in tiles at kt) for the rows in tiles 0.. into tile C, from zero
#define KEY_TILE_SUMS(C, B, kt)                     \
  _tile_zero(C);                                    \
  _tile_loadd(B, kt, 64);                           \
  _tile_dpbf16ps(C, 0, B);                          \
  _tile_loadd(B, kt + 512, 64);                     \
  _tile_dpbf16ps(C, 1, B);                          \
  if (D == 128) {                                   \
    _tile_loadd(B, kt + 1024, 64);                  \
    _tile_dpbf16ps(C, 2, B);                        \
    _tile_loadd(B, kt + 1536, 64);                  \
    _tile_dpbf16ps(C, 3, B);                        \
  }

// out[r, 0:n] = rows[r] . keys[0:n] for R rows. Keys in tiles (TILED: the buffer holds whole blocks,
// read whole, the sums past n dropped) or plain, put in tiles a block at a time in L1.
template <int D, bool TILED, typename O>
void tile_scores(const bf16* rows_in, int64_t R, const bf16* keys, int64_t n, O* out, int64_t ld) {
  thread_local std::vector<bf16> rows;  // whole row tiles, the extra rows zero
  const int64_t R16 = (R + 15) / 16 * 16;
  rows.assign(R16 * D, bf16(0));
  std::memcpy(rows.data(), rows_in, R * D * 2);
  alignas(64) bf16 buffer[TILED ? 32 : SBLOCK * D];
  alignas(64) float sums[2][16 * 16];
  constexpr int64_t bytes = SBLOCK * D * 2;
  Ahead ahead(keys, keys + n * D, bytes, (TILED ? 0 : SBLOCK / 16 * D / 32) + R16 / 16 * SBLOCK / 32);
  configure_tiles(16);
  for (int64_t s0 = 0; s0 < n; s0 += SBLOCK) {
    const int64_t m = std::min<int64_t>(SBLOCK, n - s0);
    ahead.aim(keys + s0 * D, bytes);
    const bf16* kt = buffer;
    if constexpr (TILED) kt = keys + s0 * D;
    else if (m == SBLOCK) transpose_block<D, true>(keys + s0 * D, m, buffer, ahead);
    else transpose_block<D, false>(keys + s0 * D, m, buffer, ahead);
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const bf16* q = rows.data() + r0 * D;
      _tile_loadd(0, q, 2 * D);
      _tile_loadd(1, q + 32, 2 * D);
      if (D == 128) {
        _tile_loadd(2, q + 64, 2 * D);
        _tile_loadd(3, q + 96, 2 * D);
      }
      for (int64_t s = 0; s < m; s += 32) {  // two key tiles (a block is 4)
        ahead.step();
        KEY_TILE_SUMS(6, 4, kt + s * D);
        KEY_TILE_SUMS(7, 5, kt + (s + 16) * D);
        _tile_stored(6, sums[0], 64);
        _tile_stored(7, sums[1], 64);
        for (int64_t r = 0; r < std::min<int64_t>(16, R - r0); ++r) {
          O* o = out + (r0 + r) * ld + s0 + s;
          store_lanes(o, _mm512_load_ps(sums[0] + 16 * r), m - s);
          store_lanes(o + 16, _mm512_load_ps(sums[1] + 16 * r), m - s - 16);
        }
      }
    }
  }
  _tile_release();
}
#undef KEY_TILE_SUMS

// The values' product of one row tile (rows r0 on, rt of them: tile 0) for 64 dims (dc), over the
// tiles of 32 weights [t0, t1), into tiles 1, 2, 3 and 6 (their sums so far). pk holds the values from
// tile t0 on, paired (interleave_block's layout: pair p's dims in D / 16 vectors of 16 lanes, 2 D
// apart), zero pairs up to a whole tile; `last` the part tile of weights beside zeros.
template <int D>
void mix_tiles(const bf16* probs, int64_t n, int64_t r0, int64_t t0, int64_t t1, const bf16* last,
               const bf16* pk, int dc) {
  for (int64_t t = t0; t < t1; ++t) {
    if (32 * (t + 1) <= n) _tile_loadd(0, probs + r0 * n + 32 * t, 2 * n);
    else _tile_loadd(0, last, 64);
    const bf16* v = pk + ((t - t0) * D + 4 * dc) * 32;  // the tile's first pair, vector 4 dc
    _tile_loadd(4, v, 4 * D);
    _tile_dpbf16ps(1, 0, 4);
    _tile_loadd(5, v + 32, 4 * D);
    _tile_dpbf16ps(2, 0, 5);
    _tile_loadd(4, v + 64, 4 * D);
    _tile_dpbf16ps(3, 0, 4);
    _tile_loadd(5, v + 96, 4 * D);
    _tile_dpbf16ps(6, 0, 5);
  }
}

// values [0, n) paired into pk (blocks of `block` keys, read ahead), zero pairs up to a whole tile
template <int D>
void pair_values(const bf16* values, int64_t n, int64_t block, bf16* pk, Ahead& ahead) {
  for (int64_t s0 = 0; s0 < n; s0 += block) {
    ahead.aim(values + s0 * D, block * D * 2);
    interleave_block<D>(values + s0 * D, std::min(block, n - s0), pk + s0 * D, ahead);
  }
  std::fill(pk + (n + 1) / 2 * 2 * D, pk + (n + 31) / 32 * 32 * D, bf16(0));
}

// out[r] = probs[r, 0:n] . values[0:n] for R rows, probs' rows n apart. Each tile of 32 weights sums
// against 16 pairs of keys' values, 64 dims at a time, the sums kept in tiles through all the keys;
// every sum runs in key order whatever the rows, so both ways below give the same bits.
constexpr int64_t TKEYS = 128;  // keys a step when the values stream through L1: 16 KB of pairs at 64 dims

template <int D, bool PAIRED, typename O>
void tile_mix(const bf16* probs, int64_t R, int64_t n, const bf16* values, O* out) {
  alignas(64) bf16 last[16 * 32];
  alignas(64) float sums[4][16 * 16];
  const int64_t tiles = (n + 31) / 32;
  auto start = [&](int64_t r0, int rt) {  // a row tile: its part tile of weights, its sums from zero
    configure_tiles(rt);
    if (n % 32) {
      std::fill(last, last + 16 * 32, bf16(0));
      for (int r = 0; r < rt; ++r) std::memcpy(last + 32 * r, probs + (r0 + r) * n + n / 32 * 32, n % 32 * 2);
    }
  };
  auto finish = [&](int64_t r0, int rt, int dc) {  // its sums of 64 dims, back in order, out
    _tile_stored(1, sums[0], 64);
    _tile_stored(2, sums[1], 64);
    _tile_stored(3, sums[2], 64);
    _tile_stored(6, sums[3], 64);
    for (int r = 0; r < rt; ++r) {
      O* o = out + (r0 + r) * D + 64 * dc;
      if constexpr (PAIRED)  // stored pairs: each tile's 16 sums are 16 dims in order
        for (int k = 0; k < 4; ++k) store16(o + 16 * k, _mm512_load_ps(sums[k] + 16 * r));
      else {
        store_pairs(o, _mm512_load_ps(sums[0] + 16 * r), _mm512_load_ps(sums[1] + 16 * r));
        store_pairs(o + 32, _mm512_load_ps(sums[2] + 16 * r), _mm512_load_ps(sums[3] + 16 * r));
      }
    }
  };
  auto zero = [] {
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(6);
  };
  if (D == 64 && R <= 16) {
    // one row tile and one run of 64 dims (a decode step's rows): the values stream through L1 a step
    // at a time. Paired once into L2 first, as below, a decode step of SmolLM2 took 5-10% longer.
    alignas(64) bf16 buffer[PAIRED ? 32 : TKEYS * D];
    Ahead ahead(values, values + n * D, TKEYS * D * 2, TKEYS / 2);
    start(0, int(R));
    zero();
    for (int64_t s0 = 0; s0 < n; s0 += TKEYS) {
      const int64_t m = std::min(TKEYS, n - s0);
      const bf16* pk = buffer;
      if constexpr (PAIRED) {  // read where they lie; the step's lines asked for as pairing would
        pk = values + s0 * D;
        ahead.aim(pk, TKEYS * D * 2);
        for (int64_t i = 0; i < TKEYS / 2; ++i) ahead.step();
      } else {
        pair_values<D>(values + s0 * D, m, TKEYS, buffer, ahead);
      }
      mix_tiles<D>(probs, n, 0, s0 / 32, (s0 + m + 31) / 32, last, pk, 0);
    }
    finish(0, int(R), 0);
  } else {
    // several row tiles or 128 dims: the values paired once into a buffer (L2), then each row tile's
    // 64 dims run over it. Streaming in L1 paired them again for each (a decode step of Qwen2.5-1.5B's
    // heads: 5-10% longer); carrying the sums through memory between steps cost a decode step 10%.
    thread_local std::vector<Line> lines;
    const bf16* pk = values;
    if constexpr (!PAIRED) {
      bf16* paired = line_buffer(lines, tiles * 32 * D);
      Ahead ahead(values, values + n * D, MBLOCK<D> * D * 2, MBLOCK<D> / 2);
      pair_values<D>(values, n, MBLOCK<D>, paired, ahead);
      pk = paired;
    }
    for (int64_t r0 = 0; r0 < R; r0 += 16) {
      const int rt = int(std::min<int64_t>(16, R - r0));
      start(r0, rt);
      for (int dc = 0; dc < D / 64; ++dc) {
        zero();
        mix_tiles<D>(probs, n, r0, 0, tiles, last, pk, dc);
        finish(r0, rt, dc);
      }
    }
  }
  _tile_release();
}

#pragma GCC pop_options
#else
#define TILES_BUILD 0
#endif

bool tiles_on = false;  // the products through AMX tiles: use_tiles, once per process

// The products through AMX tiles from here on (or, with on false, the avx512 kernels): whether they
// now are (this build knows AMX and Linux lends the tiles). Asked before any attention runs, once.
bool use_tiles(bool on) {
#if TILES_BUILD
  tiles_on = on && enable_amx();
#else
  tiles_on = false;
#endif
  return tiles_on;
}

// Every row count takes the transposed blocks, 1-3 rows as well: each score is then one chain of
// pair dot products in dim order, whatever the rows, so a verification pass of T tokens gives each
// token the bits of its own decode step (a SmolLM2 pass of 7 tokens on its stored weights: every
// logit equal). 1-3 rows summed each key in a vector and then across lanes, another order (logits
// up to 0.5 apart, and greedy verification could flip a near-tie); decode steps took no longer
// (SmolLM2, 4K and 16K keys, one and two threads).
template <int D, typename O>
void scores_head(const bf16* rows, int64_t R, const bf16* keys, int64_t S, O* out, int64_t ld, bool tiled) {
#if TILES_BUILD
  if (tiles_on) return tiled ? tile_scores<D, true>(rows, R, keys, S, out, ld) : tile_scores<D, false>(rows, R, keys, S, out, ld);
#endif
  if (tiled) scores_many<D, true>(rows, R, keys, S, out, ld);
  else scores_many<D, false>(rows, R, keys, S, out, ld);
}

template <int D, bool PAIRED, typename O>
void mix_rows(const bf16* probs, int64_t R, int64_t S, const bf16* values, O* out) {
#if TILES_BUILD
  if (tiles_on) return tile_mix<D, PAIRED>(probs, R, S, values, out);
#endif
  // up to one tile, the sums stay in registers: 6 rows x 4 vectors at 64 dims, 3 x 8 at 128
  switch (R) {
    case 1: return mix_few<D, 1, PAIRED>(probs, S, values, out);
    case 2: return mix_few<D, 2, PAIRED>(probs, S, values, out);
    case 3: return mix_few<D, 3, PAIRED>(probs, S, values, out);
  }
  if constexpr (D == 64) switch (R) {
    case 4: return mix_few<D, 4, PAIRED>(probs, S, values, out);
    case 5: return mix_few<D, 5, PAIRED>(probs, S, values, out);
    case 6: return mix_few<D, 6, PAIRED>(probs, S, values, out);
  }
  thread_local std::vector<float> acc;  // the rows' float32 sums between blocks, per thread
  if (acc.size() < size_t(R * D)) acc.resize(R * D);
  mix_many<D, PAIRED>(probs, R, S, values, out, acc.data());
}

// probs (R rows, S apart) . values for one head; `paired`: the values stored in pairs (key_tiles.py)
template <int D, typename O>
void mix_head(const bf16* probs, int64_t R, int64_t S, const bf16* values, O* out, bool paired = false) {
  if (paired) mix_rows<D, true>(probs, R, S, values, out);
  else mix_rows<D, false>(probs, R, S, values, out);
}

void check_cache(const at::Tensor& cache, int64_t heads) {
  TORCH_CHECK(cache.dim() == 3 && cache.size(0) == heads, "cache must be (heads, tokens, head_dim)");
  TORCH_CHECK(cache.scalar_type() == at::kBFloat16, "cache must be bfloat16");
  TORCH_CHECK(cache.stride(2) == 1 && cache.stride(1) == cache.size(2), "each head's tokens must be contiguous");
}

at::Tensor scores(const at::Tensor& rows_in, const at::Tensor& keys) {
  auto rows = rows_in.contiguous();
  int64_t H = rows.size(0), R = rows.size(1), D = rows.size(2), S = keys.size(1);
  check_cache(keys, H);
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16 && keys.size(2) == D, "rows must be bfloat16 (heads, rows, head_dim)");
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  auto out = at::empty({H, R, S}, rows.options());
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  // tasks (span of SPAN keys, head), span by span so that a last partial span comes last; every
  // score is its own dot product, so the split does not touch the bits
  int64_t C = (S + SPAN - 1) / SPAN;
  over_tasks(H * C, H * S * R * D, [&](int64_t task) {
    int64_t h = task % H, s0 = task / H * SPAN, n = std::min(SPAN, S - s0);
    const bf16 *q = data(rows) + h * R * D, *k = data(keys) + h * keys.stride(0) + s0 * D;
    if (D == 64) scores_head<64>(q, R, k, n, o + h * R * S + s0, S, false);
    else scores_head<128>(q, R, k, n, o + h * R * S + s0, S, false);
  });
  return out;
}

at::Tensor mix(const at::Tensor& probs_in, const at::Tensor& values) {
  auto probs = probs_in.contiguous();
  int64_t H = probs.size(0), R = probs.size(1), S = probs.size(2), D = values.size(2);
  check_cache(values, H);
  TORCH_CHECK(probs.scalar_type() == at::kBFloat16 && values.size(1) == S, "probs must be bfloat16 (heads, rows, tokens)");
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  auto out = at::empty({H, R, D}, probs.options());
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  // a task per head (each dim's sum runs over all the keys in one order). Splitting a head's dims
  // over threads as well read each value line from both cores: 4.8 -> 5.2 ms against 4.1 for heads
  // alone (SmolLM2 at 16K keys, 3 rows, 2 threads), where the products wait on memory
  over_tasks(H, H * S * R * D, [&](int64_t h) {
    const bf16 *p = data(probs) + h * R * S, *v = data(values) + h * values.stride(0);
    if (D == 64) mix_head<64>(p, R, S, v, o + h * R * D);
    else mix_head<128>(p, R, S, v, o + h * R * D);
  });
  return out;
}

// ======== keys in tiles (key_tiles.py) ========
// Key s of a head at tile s / 16, lane s % 16: word p (dims 2p, 2p+1) at ((s / 16) * D / 2 + p) * 32
// + (s % 16) * 2, the block layout transpose_block writes. The kernels read whole blocks of 64 keys.
constexpr int64_t TILE = 16;

// keys in tiles, or values in pairs (read in whole tiles of 32 keys): whole blocks from a tile on
void check_tiles(const at::Tensor& keys) {
  int64_t H = keys.size(0), S = keys.size(1), D = keys.size(2);
  int64_t reach = (S + SBLOCK - 1) / SBLOCK * SBLOCK;  // the slots a part block reads
  TORCH_CHECK(H == 0 || ((keys.storage_offset() + (H - 1) * keys.stride(0) + reach * D) * 2 <= int64_t(keys.storage().nbytes())
              && keys.stride(0) % (TILE * D) == 0 && keys.storage_offset() % (TILE * D) == 0),
              "a tiled cache's keys and values must start at a tile and hold whole blocks of 64 slots");
}

// ======== attention whole: scores, softmax and mix in one call ========
// Three calls with torch's softmax between them cost SmolLM2 at 16K keys (30 layers, two threads)
// 4.8 + 1.2 + 4.7 ms at 3 rows and 7.0 + 7.6 + 7.1 at 21: torch's bf16 softmax widened, exponentiated
// and rounded the scores on the side, and the mix ran a task per head (SmolLM2's 3 heads: 2:1 over two
// threads). Here each (head, span) task scores its rows into float32 (kept, not rounded to bf16),
// turns them into bf16 weights and mixes the span's values while they are warm; the heads then merge
// their spans (prelude.h's attend_spans, as decode_attention_f32 does).

// 2^t for t <= 0 (a scaled score minus its row's maximum, in powers of 2), to about 3e-6 of its
// value: the weights it makes are rounded to bf16 (2^-9 apart), so at most ~0.2% of them round to the
// other neighbour than an exact exp would. t = n + f, n the nearest integer, |f| <= 1/2 (the
// subtraction is exact); 2^f = 1 + f (c1 + f (c2 + f (c3 + f c4))), the c fitted to 2^f's relative
// error on [-1/2, 1/2] (3e-6, 2^-18); 2^n by vscalefps. A row's top weight rounds to 1, as before.
// Cephes' expf before it (prelude.h's EXP_POLY: degree 5, the exponent assembled by hand, float32-exact)
// bound the weights on the 512-bit units, not memory: with a weight's rounding and sum, 0.46 ns a
// weight (one thread, this Xeon), 3.5 ms of a 21-row attention of SmolLM2 at 4K keys; now 0.21 ns.
constexpr float EXP2_POLY[4] = {0.6931241750717163f, 0.24024099111557007f, 0.05590643361210823f,
                                0.009582849219441414f};  // c1..c4
constexpr float EXP2_FLOOR = -125.0f;  // t is held here: 2^-125 is normal and far under any sum

AVX512 inline __m512 exp2_16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(EXP2_FLOOR));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(EXP2_POLY[3]), f, _mm512_set1_ps(EXP2_POLY[2]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[1]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_POLY[0]));
  return _mm512_scalef_ps(_mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f)), n);
}

inline __mmask16 first_lanes(int64_t k) { return k >= 16 ? __mmask16(0xffff) : k <= 0 ? __mmask16(0) : __mmask16((1u << k) - 1); }

// One row's float32 scores over a span -> its bf16 weights w[0:n]: the first `seen` are
// exp(scale * s - top) against the row's own scaled maximum `top`, the rest 0; `total` is the sum of
// the weights as rounded, the ones the mix multiplies by. Not yet divided by it: the spans of a head
// each weigh by their own maximum, and the merge brings them to one. scale > 0, so the scaled
// maximum is the maximum's scaled value.
AVX512 inline void span_weights(const float* s, int64_t seen, int64_t n, float scale, bf16* w, float& top,
                                float& total) {
  __m512 top16 = _mm512_set1_ps(-INFINITY), top16b = top16;  // two chains: the max's latency
  int64_t j = 0;
  for (; j + 32 <= seen; j += 32) {
    top16 = _mm512_max_ps(top16, _mm512_loadu_ps(s + j));
    top16b = _mm512_max_ps(top16b, _mm512_loadu_ps(s + j + 16));
  }
  for (; j < seen; j += 16)
    top16 = _mm512_mask_max_ps(top16, first_lanes(seen - j), top16, _mm512_maskz_loadu_ps(first_lanes(seen - j), s + j));
  float m = _mm512_reduce_max_ps(_mm512_max_ps(top16, top16b)) * scale;
  // in powers of 2: t = s scale log2(e) - m log2(e), e^(s scale - m) to the constants' rounding.
  // 32 weights a step, rounded to bf16 by one instruction; their sum by one pair dot product against
  // ones (each lane adds a pair of the weights as rounded)
  const __m512 sv = _mm512_set1_ps(scale * LOG2E), mv = _mm512_set1_ps(m * LOG2E);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < seen; j += 32) {
    __mmask16 lo = first_lanes(seen - j), hi = first_lanes(seen - j - 16);
    __m512 a = exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(lo, s + j), sv, mv));
    __m512 b = exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(hi, s + j + 16), sv, mv));
    __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_maskz_mov_ps(hi, b), _mm512_maskz_mov_ps(lo, a));
    _mm512_mask_storeu_epi16(w + j, __mmask32(lo) | (__mmask32(hi) << 16), (__m512i)pair);
    sum = _mm512_dpbf16_ps(sum, pair, ones);
  }
  std::fill(w + seen, w + n, bf16(0));
  total = _mm512_reduce_add_ps(sum);
  top = m;
}

// rows (H, R, D) bf16 over keys and values (H, S, D) -> out (H, R, D) float32
template <int D>
void attend_heads(const bf16* k, int64_t k_head, const bf16* v, int64_t v_head, int64_t H, int64_t S,
                  const bf16* rows, int64_t R, const int64_t* limits, int64_t tokens, float scale, bool tiled,
                  float* out) {
  attend_spans(H, S, R, D, limits, tokens, out,
               [&](int64_t h, int64_t s0, int64_t reach, const int64_t* seen, float* part, float* top, float* total) {
    thread_local std::vector<float> scores;  // each thread's, kept between calls (page faults)
    thread_local std::vector<bf16> weights;
    if (scores.size() < size_t(R * reach)) scores.resize(R * reach), weights.resize(R * reach);
    scores_head<D>(rows + h * R * D, R, k + h * k_head + s0 * D, reach, scores.data(), reach, tiled);
    for (int64_t r = 0; r < R; ++r)
      span_weights(scores.data() + r * reach, seen[r], reach, scale, weights.data() + r * reach, top[r], total[r]);
    mix_head<D>(weights.data(), R, reach, v + h * v_head + s0 * D, part, tiled);
  });
}

// softmax(scale * rows . keys^T) . values, rounded once to bf16; row r is token r % T, which sees the
// first limits[t] keys
at::Tensor attend_rows(const at::Tensor& rows_in, const at::Tensor& keys, const at::Tensor& values,
                       const int64_t* limits, int64_t T, double scale, bool tiled) {
  auto rows = rows_in.contiguous();
  TORCH_CHECK(rows.dim() == 3 && rows.scalar_type() == at::kBFloat16, "rows must be bfloat16 (heads, rows, head_dim)");
  int64_t H = rows.size(0), R = rows.size(1), D = rows.size(2);
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  check_cache(keys, H);
  check_cache(values, H);
  TORCH_CHECK(keys.size(1) == values.size(1) && keys.size(2) == D && values.size(2) == D, "keys and values must match");
  TORCH_CHECK(T > 0 && R % T == 0, "limits must hold one count per token of the rows");
  if (tiled) check_tiles(keys), check_tiles(values);
  auto out = at::zeros({H, R, D}, rows.options().dtype(at::kFloat));
  if (keys.size(1) > 0 && R > 0) {
    float* o = out.data_ptr<float>();
    const bf16 *k = data(keys), *v = data(values);
    int64_t S = keys.size(1);
    if (D == 64) attend_heads<64>(k, keys.stride(0), v, values.stride(0), H, S, data(rows), R, limits, T, float(scale), tiled, o);
    else attend_heads<128>(k, keys.stride(0), v, values.stride(0), H, S, data(rows), R, limits, T, float(scale), tiled, o);
  }
  return out.to(at::kBFloat16);  // round to nearest even
}

at::Tensor attend(const at::Tensor& rows, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& limits_in, double scale, bool tiled) {
  auto limits = limits_in.to(at::kLong).contiguous();
  TORCH_CHECK(limits.dim() == 1, "limits must hold one count per token of the rows");
  return attend_rows(rows, keys, values, limits.const_data_ptr<int64_t>(), limits.numel(), scale, tiled);
}

// D float32 sums -> bf16 (D a multiple of 16), each rounded once to nearest even, as .to() rounds
AVX512 void round_row(const float* from, bf16* to, int64_t D) {
  for (int64_t d = 0; d < D; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + d), to_bf16(_mm512_loadu_ps(from + d)));
}

// The new tokens' keys and values into the cache (L, H, S, D), then `attend` of their queries over the
// first start + T slots, token t seeing start + t + 1: what attention.py does for the grouped rows,
// with the writes, the row grouping, the limits and the output's layout done here by loops over their
// few bytes (as decode_attention_f32 does): as torch calls, copies, views and conversions, they were
// 7 of the 16 us a call cost (SmolLM2's 3 KV heads at 64 keys, one thread), 30 calls a decode step.
at::Tensor cache_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor cache_k,
                        at::Tensor cache_v, int64_t layer, int64_t start, double scale, bool tiled) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.scalar_type() == at::kBFloat16 &&
              k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "q, k, v must be bfloat16 (tokens, heads, head_dim)");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), H = k.size(1);
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  TORCH_CHECK(H > 0 && Hq % H == 0 && k.size(0) == T && v.size(0) == T && v.size(1) == H && k.size(2) == D &&
              v.size(2) == D, "q, k, v disagree");
  TORCH_CHECK(cache_k.dim() == 4 && cache_k.is_contiguous() && cache_v.is_contiguous() &&
              cache_k.sizes() == cache_v.sizes() && cache_k.scalar_type() == at::kBFloat16 &&
              cache_v.scalar_type() == at::kBFloat16 && cache_k.size(1) == H && cache_k.size(3) == D,
              "caches must be bfloat16 (layers, kv_heads, slots, head_dim)");
  TORCH_CHECK(0 <= layer && layer < cache_k.size(0) && 0 <= start && start + T <= cache_k.size(2),
              "layer or slots out of the cache");
  TORCH_CHECK(!tiled || cache_k.size(2) % SBLOCK == 0, "tiled keys must start at a tile and hold whole blocks of 64 slots");
  int64_t S = start + T, rep = Hq / H, R = rep * T, slots = cache_k.size(2);
  auto* keys = reinterpret_cast<bf16*>(cache_k.data_ptr()) + layer * H * slots * D;
  auto* values = reinterpret_cast<bf16*>(cache_v.data_ptr()) + layer * H * slots * D;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const bf16 *key = data(k) + t * k.stride(0) + h * k.stride(1), *value = data(v) + t * v.stride(0) + h * v.stride(1);
      int64_t s = start + t;
      if (!tiled) {
        std::memcpy(keys + (h * slots + s) * D, key, D * 2);
        std::memcpy(values + (h * slots + s) * D, value, D * 2);
        continue;
      }
      // value s in pair s / 2, half s % 2: (v[2p, d], v[2p + 1, d]) for d in order (key_tiles.py)
      bf16* pair = values + (h * slots + s / 2 * 2) * D + s % 2;
      for (int64_t d = 0; d < D; ++d) pair[2 * d] = value[d];
      // key s at tile s / 16, lane s % 16: word p of the tile's keys side by side (key_tiles.py)
      auto* tile = reinterpret_cast<int32_t*>(keys + (h * slots + s / TILE * TILE) * D) + s % TILE;
      for (int64_t p = 0; p < D / 2; ++p) std::memcpy(tile + p * TILE, key + 2 * p, 4);
    }
  // rows (H, rep * T, D) ordered (kv head, query head in its group, token), as attention.py groups them
  thread_local std::vector<bf16> rows;
  thread_local std::vector<float> grouped;
  rows.resize(H * R * D), grouped.resize(H * R * D);
  for (int64_t i = 0; i < Hq; ++i)
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(rows.data() + (i * T + t) * D, data(q) + t * q.stride(0) + i * q.stride(1), D * 2);
  std::vector<int64_t> limits(T);
  for (int64_t t = 0; t < T; ++t) limits[t] = start + t + 1;
  if (D == 64) attend_heads<64>(keys, slots * D, values, slots * D, H, S, rows.data(), R, limits.data(), T, float(scale), tiled, grouped.data());
  else attend_heads<128>(keys, slots * D, values, slots * D, H, S, rows.data(), R, limits.data(), T, float(scale), tiled, grouped.data());
  // (H, rep, T, D) float32 -> (T, Hq * D) bf16
  auto out = at::empty({T, Hq * D}, q.options());
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  for (int64_t i = 0; i < Hq; ++i)
    for (int64_t t = 0; t < T; ++t) round_row(grouped.data() + (i * T + t) * D, o + (t * Hq + i) * D, D);
  return out;
}

// ======== a prefill piece: many tokens over the cache, flash style ========
// The attention of T >= 32 new tokens (a prompt's piece, a chat turn) over the S = start + T keys
// before and among them, token t seeing start + t + 1. `attend` above is built for a few dozen rows:
// a task per (head, span of 2,048 keys) scores all its rows into one float32 buffer (4,096 tokens x 3
// rows a token x 2,048 keys: 96 MB, far past the caches) and splits a piece's 3 heads over threads
// 2:1. Here a task is a (head, block of PREFILL_TOKENS tokens): its rows walk the keys up to the
// block's last token in steps of PREFILL_SPAN, each step scored, weighed against its own maximum and
// mixed by the same kernels while its scores (96 rows x 256 keys, 96 KB), keys and values sit in L2,
// and merged into the rows' running sums (the online softmax). Torch's CPU flash kernel, the path
// before, computes in float32 (SmolLM2's heads at 4K tokens, one thread: 270 ms a layer, this ~60).
constexpr int64_t PREFILL_ROWS = 96;  // rows a task aims for: its tokens x the query heads a KV head serves
constexpr int64_t PREFILL_SPAN = 256;  // keys a step: a multiple of the block (64)

template <int D>
AVX512 void merge_span(float* acc, float& top, float& total, const float* part, float span_top, float span_total) {
  float m = std::max(top, span_top), a = std::exp(top - m), b = std::exp(span_top - m);
  __m512 av = _mm512_set1_ps(a), bv = _mm512_set1_ps(b);
  for (int d = 0; d < D; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(_mm512_loadu_ps(acc + d), av, _mm512_mul_ps(_mm512_loadu_ps(part + d), bv)));
  total = total * a + span_total * b;
  top = m;
}

// rows (R x D, row r seeing limits[r] keys) of one KV head -> out (R x D) float32, normalized
template <int D>
void prefill_rows(const bf16* keys, const bf16* values, const bf16* rows, int64_t R, const int64_t* limits,
                  float scale, bool tiled, float* out) {
  thread_local std::vector<float> scores, part;
  thread_local std::vector<bf16> weights;
  scores.resize(R * PREFILL_SPAN), weights.resize(R * PREFILL_SPAN), part.resize(R * D);
  std::vector<float> top(R, -INFINITY), total(R, 0.0f), span_top(R), span_total(R);
  std::fill(out, out + R * D, 0.0f);
  int64_t reach = *std::max_element(limits, limits + R);
  for (int64_t s0 = 0; s0 < reach; s0 += PREFILL_SPAN) {
    int64_t n = std::min(PREFILL_SPAN, reach - s0);
    scores_head<D>(rows, R, keys + s0 * D, n, scores.data(), PREFILL_SPAN, tiled);
    for (int64_t r = 0; r < R; ++r) {
      int64_t seen = std::clamp<int64_t>(limits[r] - s0, 0, n);
      span_weights(scores.data() + r * PREFILL_SPAN, seen, n, scale, weights.data() + r * n, span_top[r],
                   span_total[r]);
    }
    mix_head<D>(weights.data(), R, n, values + s0 * D, part.data(), tiled);  // weights' rows n apart
    for (int64_t r = 0; r < R; ++r)
      if (limits[r] > s0)  // a row whose keys ended before this step saw none of it
        merge_span<D>(out + r * D, top[r], total[r], part.data() + r * D, span_top[r], span_total[r]);
  }
  for (int64_t r = 0; r < R; ++r) {
    float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[r * D + d] *= inverse;
  }
}

at::Tensor prefill(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t start,
                   double scale, bool tiled) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1,
              "q must be bfloat16 (tokens, heads, head_dim), head_dim contiguous");
  int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), H = keys.size(0);
  TORCH_CHECK(D == 64 || D == 128, "head_dim must be 64 or 128");
  check_cache(keys, H);
  check_cache(values, H);
  TORCH_CHECK(H > 0 && Hq % H == 0 && keys.size(2) == D && values.size(2) == D && keys.size(1) == values.size(1),
              "q, keys and values disagree");
  TORCH_CHECK(start >= 0 && start + T <= keys.size(1), "the keys must hold the start and the new tokens");
  if (tiled) check_tiles(keys), check_tiles(values);
  int64_t rep = Hq / H, block = std::max<int64_t>(1, PREFILL_ROWS / rep), blocks = (T + block - 1) / block;
  auto out = at::empty({T, Hq * D}, q.options());
  auto* o = reinterpret_cast<bf16*>(out.data_ptr());
  // the last blocks first: they see the most keys, and tasks are taken in order
  over_tasks(H * blocks, H * T * (start + T) * rep * D, [&](int64_t task) {
    int64_t h = task % H, t0 = (blocks - 1 - task / H) * block, tokens = std::min(block, T - t0), R = rep * tokens;
    thread_local std::vector<bf16> rows;
    thread_local std::vector<float> sums;
    thread_local std::vector<int64_t> limits;
    rows.resize(R * D), sums.resize(R * D), limits.resize(R);
    for (int64_t g = 0; g < rep; ++g)  // row (g, t): query head h * rep + g of token t0 + t
      for (int64_t t = 0; t < tokens; ++t) {
        std::memcpy(rows.data() + (g * tokens + t) * D, data(q) + (t0 + t) * q.stride(0) + (h * rep + g) * q.stride(1), D * 2);
        limits[g * tokens + t] = start + t0 + t + 1;
      }
    const bf16 *k = data(keys) + h * keys.stride(0), *v = data(values) + h * values.stride(0);
    if (D == 64) prefill_rows<64>(k, v, rows.data(), R, limits.data(), float(scale), tiled, sums.data());
    else prefill_rows<128>(k, v, rows.data(), R, limits.data(), float(scale), tiled, sums.data());
    for (int64_t g = 0; g < rep; ++g)
      for (int64_t t = 0; t < tokens; ++t)
        round_row(sums.data() + (g * tokens + t) * D, o + (t0 + t) * Hq * D + (h * rep + g) * D, D);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(triforce_decode, m) {
  m.def("use_pool(int address) -> ()", &use_pool);
  m.def("use_tiles(bool on) -> bool", &use_tiles);
  m.def("scores(Tensor rows, Tensor keys) -> Tensor");
  m.def("mix(Tensor probs, Tensor values) -> Tensor");
  m.def("attend(Tensor rows, Tensor keys, Tensor values, Tensor limits, float scale, bool tiled=False) -> Tensor");
  m.def("cache_attend(Tensor q, Tensor k, Tensor v, Tensor(a!) cache_k, Tensor(b!) cache_v, int layer, int start, "
        "float scale, bool tiled=False) -> Tensor");
  m.def("prefill(Tensor q, Tensor keys, Tensor values, int start, float scale, bool tiled=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(triforce_decode, CPU, m) {
  m.impl("scores", &scores);
  m.impl("mix", &mix);
  m.impl("attend", &attend);
  m.impl("cache_attend", &cache_attend);
  m.impl("prefill", &prefill);
}
