// Products with a model's stored blocks through AMX tiles (stored_amx.py), after prelude.h,
// records.h and amx_frame.h.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16,amx-tile,amx-bf16")

namespace {

// tile 0: R rows of x, one block's 32 columns (16 pairs); then each group's tiles (chain below): its
// decoded codes, 16 pairs of columns x 16 output rows, and its R x 16 float32 sums
void configure(int rows, bool q4) {
  TileConfig c;
  for (int t = 0; t < 7; ++t) c.colsb[t] = 64, c.rows[t] = 16;
  c.rows[0] = c.rows[2] = c.rows[6] = uint8_t(rows);
  if (q4) c.rows[4] = uint8_t(rows);
  _tile_loadconfig(&c);
}


// NG groups of 16 output rows (consecutive records) against R <= 16 rows of x (row stride K), acc
// their float32 sums (group j's row r at acc[16 * j + r]). Two groups share each block's tile of x
// and run two chains of tile work the core overlaps: one group's chain (decode, store, load, sum,
// store, load) waits on itself, and alone ran at half the avx512 kernels' speed on one row.
// A group's chain of tile work on one block, each group on tiles of its own (tile numbers are part
// of the instructions): its decoded codes loaded, summed against x's tile 0, the sums stored. Q4
// (one tile of codes): groups on tiles 1, 3, 5 with sums in 2, 4, 6; Q8 (low and high nibbles'
// tiles): codes 1 and 3, 4 and 5, sums 2 and 6.
#define TILE_CHAIN(Q4, J, LO, HI, SUMS)                                          \
  template <> struct chain<Q4, J> {                                              \
    static void sum(const void* lo, const void* hi, float* sums) {               \
      _tile_loadd(LO, lo, 64);                                                   \
      _tile_zero(SUMS);                                                          \
      _tile_dpbf16ps(SUMS, 0, LO);                                               \
      if (!Q4) {                                                                 \
        _tile_loadd(HI, hi, 64);                                                 \
        _tile_dpbf16ps(SUMS, 0, HI);                                             \
      }                                                                          \
      _tile_stored(SUMS, sums, 64);                                              \
    }                                                                            \
  };
template <bool Q4, int J> struct chain;
TILE_CHAIN(true, 0, 1, 1, 2)
TILE_CHAIN(true, 1, 3, 3, 4)
TILE_CHAIN(true, 2, 5, 5, 6)
TILE_CHAIN(false, 0, 1, 3, 2)
TILE_CHAIN(false, 1, 4, 5, 6)
template <> struct chain<false, 2> { static void sum(const void*, const void*, float*) {} };
#undef TILE_CHAIN

// A block's codes of NG groups decoded into bfloat16 pair rows (a tile's layout)
template <bool Q4, int NG>
inline void decode_block(const uint8_t* rec, int64_t stride, __m512i low, __m512i high, __m512bh (*lo)[16],
                         __m512bh (*hi)[16]) {
  constexpr int RECORD = Q4 ? 320 : 544;  // the codes' lines to read ahead (scales beside them)
  for (int j = 0; j < NG; ++j) {
    const uint8_t* codes = rec + j * stride;
    for (int line = 0; line < RECORD; line += 64) read_ahead(codes + line);
    if (Q4) {  // vector c, pair k: columns 8c + 2k, +1 -> pair row 4c + k
      for (int c = 0; c < 4; ++c) decode4(_mm512_loadu_si512(codes + 64 * c), low, low, lo[j] + 4 * c);
    } else {  // vector v: pairs 2v (low, high nibbles: w0, w1) and 2v + 1 (w2, w3)
      for (int v = 0; v < 8; ++v) {
        __m512bh w[4];
        decode4(_mm512_loadu_si512(codes + 64 * v), low, high, w);
        lo[j][2 * v] = w[0], hi[j][2 * v] = w[1], lo[j][2 * v + 1] = w[2], hi[j][2 * v + 1] = w[3];
      }
    }
  }
}

// NG groups of 16 output rows (consecutive records) against R <= 16 rows of x (row stride K), acc
// their float32 sums (group j's row r at acc[16 * j + r]). The groups share each block's tile of x,
// and each runs a chain of tile work of its own, which the core overlaps. The work is pipelined over
// blocks: block b + 1 is decoded and block b - 1's sums scaled while block b's tiles run, through
// two sets of buffers, since a tile is loaded from (and stored to) memory only after the stores
// before it reach the cache: one chain in step ran at half the avx512 kernels' speed on one row.
template <bool Q4, typename Scale, int NG>
void tile_groups(const uint8_t* rec, int64_t blocks, const bf16* x, int64_t K, int R, const float* sx,
                 int64_t sx_stride, __m512* acc) {
  constexpr int RECORD = Q4 ? q4_record<Scale>() : q8_record<Scale>();
  const __m512i low = _mm512_load_si512(tables().unsigned_nibble);
  const __m512i high = _mm512_load_si512(tables().signed_high);
  alignas(64) __m512bh lo[2][NG][16], hi[2][NG][16];
  alignas(64) float sums[2][NG][16 * 16];
  const int64_t stride = blocks * RECORD;  // from one group's records to the next's
  for (int r = 0; r < 16 * NG; ++r) acc[r] = _mm512_setzero_ps();
  auto scale = [&](int64_t b) {  // block b's sums, scaled into acc
    for (int j = 0; j < NG; ++j) {
      const uint8_t* scales = rec + j * stride + b * RECORD + (Q4 ? 256 : 512);
      const float* t = sums[b & 1][j];
      __m512 d = load_scales(reinterpret_cast<const Scale*>(scales));
      __m512* a = acc + 16 * j;
      if (Q4) {
        __m512 m = load_scales(reinterpret_cast<const Scale*>(scales + 16 * sizeof(Scale)));
        for (int r = 0; r < R; ++r)
          a[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * sx_stride + b]), _mm512_fmadd_ps(_mm512_load_ps(t + 16 * r), d, a[r]));
      } else {
        for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(_mm512_load_ps(t + 16 * r), d, a[r]);
      }
    }
  };
  decode_block<Q4, NG>(rec, stride, low, high, lo[0], hi[0]);
  for (int64_t b = 0; b < blocks; ++b) {
    const int now = b & 1;
    if (b + 1 < blocks) decode_block<Q4, NG>(rec + (b + 1) * RECORD, stride, low, high, lo[1 - now], hi[1 - now]);
    _tile_loadd(0, x + 32 * b, 2 * K);
    chain<Q4, 0>::sum(lo[now][0], hi[now][0], sums[now][0]);
    if constexpr (NG > 1) chain<Q4, 1>::sum(lo[now][1], hi[now][1], sums[now][1]);
    if constexpr (NG > 2) chain<Q4, 2>::sum(lo[now][2], hi[now][2], sums[now][2]);
    if (b > 0) scale(b - 1);
  }
  scale(blocks - 1);
}

using GroupsFn = void (*)(const uint8_t*, int64_t, const bf16*, int64_t, int, const float*, int64_t, __m512*);

template <bool Q4, int NG>
GroupsFn groups_fn(bool f32) { return f32 ? tile_groups<Q4, float, NG> : tile_groups<Q4, uint16_t, NG>; }

at::Tensor product(const at::Tensor& x_in, const at::Tensor& records, int64_t out_features, bool q4) {
  Product call(x_in, records, out_features, q4);
  const int64_t R = call.R, K = call.K, groups = call.groups, blocks = call.blocks, bytes = call.bytes;
  const uint8_t* rec = call.rec;
  bf16* o = call.o;
  const bf16* x = data(call.x);
  const float* sums = call.sums.data();
  const bool f32 = call.f32;
  // Q4 groups three at a time, Q8 two (the tiles they need); a last partial set takes fewer
  const int per = q4 ? 3 : 2;
  GroupsFn fns[3] = {q4 ? groups_fn<true, 1>(f32) : groups_fn<false, 1>(f32),
                     q4 ? groups_fn<true, 2>(f32) : groups_fn<false, 2>(f32), groups_fn<true, 3>(f32)};
  // the tiles' arithmetic is shared by up to 16 rows, so a share's least work counts groups, not
  // rows; shares of whole sets of groups, so that a group's outputs do not depend on the split
  const int64_t sets = (groups + per - 1) / per, grain = std::max<int64_t>(1, GRAIN_WEIGHTS / (16 * per * K));
  over_ranges(sets, grain, [&](int64_t first, int64_t last) {
    int configured = 0;
    for (int64_t set = first; set < last; ++set) {
      int64_t g = per * set;
      int ng = int(std::min<int64_t>(per, groups - g));
      for (int64_t r0 = 0; r0 < R; r0 += 16) {
        int nr = int(std::min<int64_t>(16, R - r0));
        if (nr != configured) configure(configured = nr, q4);
        __m512 acc[48];
        fns[ng - 1](rec + g * blocks * bytes, blocks, x + r0 * K, K, nr, sums + r0 * blocks, blocks, acc);
        for (int j = 0; j < ng; ++j)
          for (int r = 0; r < nr; ++r)
            store_group(acc[16 * j + r], o + (r0 + r) * out_features + 16 * (g + j), out_features - 16 * (g + j));
      }
    }
    if (configured) _tile_release();
  });
  return call.out;
}

at::Tensor q4_product(const at::Tensor& x, const at::Tensor& records, int64_t n) { return product(x, records, n, true); }
at::Tensor q8_product(const at::Tensor& x, const at::Tensor& records, int64_t n) { return product(x, records, n, false); }
bool enable() { return enable_amx(); }

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY(triforce_stored_amx, m) {
  m.def("use_pool(int address) -> ()", &use_pool);
  m.def("enable() -> bool", &enable);
  m.def("q4_product(Tensor x, Tensor records, int out_features) -> Tensor");
  m.def("q8_product(Tensor x, Tensor records, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(triforce_stored_amx, CPU, m) {
  m.impl("q4_product", &q4_product);
  m.impl("q8_product", &q8_product);
}
