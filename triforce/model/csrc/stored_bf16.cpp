// Products with a model's stored blocks in bfloat16 on avx512_bf16 (stored_bf16.py), after
// prelude.h and records.h.

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512bf16")

namespace {

// acc[r] += block sums q . x of 16 column pairs w[j] for NR rows of x, pair j being columns
// 2 * PAIR(j) of the block (pair_of). Four chains per row (dpbf16's latency), at any number of rows:
// a row's sums then run in one order whatever rows share the call, so a verification pass gives each
// token its decode step's bits (two chains at 2-4 rows changed about one lm_head output in 10^5).
template <int NR, typename PairOf>
AVX512 inline void dots(const __m512bh* w, const uint32_t* const* x, PairOf pair_of, __m512* t) {
  constexpr int CH = 4;
  for (int r = 0; r < NR; ++r) {
    __m512 chain[CH];
    for (int c = 0; c < CH; ++c) chain[c] = _mm512_setzero_ps();
    for (int j = 0; j < 16; ++j)
      chain[j % CH] = _mm512_dpbf16_ps(chain[j % CH], w[j], (__m512bh)_mm512_set1_epi32(x[r][pair_of(j)]));
    for (int c = 0; c < CH; ++c) t[r] = _mm512_add_ps(t[r], chain[c]);
  }
}

// One group of 16 output rows against NR rows of x (x pairs per row, sx: block sums of x per row)
template <int NR, typename Scale>
AVX512 void q4_group(const uint8_t* rec, int64_t blocks, const uint32_t* const* x, const float* const* sx, __m512* acc) {
  constexpr int RECORD = q4_record<Scale>();
  const __m512i table = _mm512_load_si512(tables().unsigned_nibble);
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, rec += RECORD) {
    for (int line = 0; line < RECORD; line += 64) read_ahead(rec + line);
    __m512bh w[16];
    for (int c = 0; c < 4; ++c) decode4(_mm512_loadu_si512(rec + 64 * c), table, table, w + 4 * c);
    const uint32_t* xb[NR];
    __m512 t[NR];
    for (int r = 0; r < NR; ++r) xb[r] = x[r] + 16 * b, t[r] = _mm512_setzero_ps();
    dots<NR>(w, xb, [](int j) { return j; }, t);  // vector c, pair k: columns 8c + 2k, +1
    __m512 d = load_scales(reinterpret_cast<const Scale*>(rec + 256));
    __m512 m = load_scales(reinterpret_cast<const Scale*>(rec + 256 + 16 * sizeof(Scale)));
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r][b]), _mm512_fmadd_ps(t[r], d, acc[r]));
  }
}

template <int NR, typename Scale>
AVX512 void q8_group(const uint8_t* rec, int64_t blocks, const uint32_t* const* x, const float* const*, __m512* acc) {
  constexpr int RECORD = q8_record<Scale>();
  const __m512i low = _mm512_load_si512(tables().unsigned_nibble);
  const __m512i high = _mm512_load_si512(tables().signed_high);
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, rec += RECORD) {
    for (int line = 0; line < RECORD; line += 64) read_ahead(rec + line);
    __m512 t[NR];
    for (int r = 0; r < NR; ++r) t[r] = _mm512_setzero_ps();
    for (int half = 0; half < 2; ++half) {  // 16 code vectors of pairs at a time: the registers hold 32
      __m512bh w[16];
      for (int c = 0; c < 4; ++c) decode4(_mm512_loadu_si512(rec + 64 * (4 * half + c)), low, high, w + 4 * c);
      const uint32_t* xb[NR];
      for (int r = 0; r < NR; ++r) xb[r] = x[r] + 16 * b + 8 * half;
      // vector c, pairs 0, 1: columns 4c, 4c + 1 (low, high nibbles); pairs 2, 3: 4c + 2, 4c + 3
      dots<NR>(w, xb, [](int j) { return 2 * (j / 4) + (j % 4) / 2; }, t);
    }
    __m512 d = load_scales(reinterpret_cast<const Scale*>(rec + 512));
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_fmadd_ps(t[r], d, acc[r]);
  }
}

using GroupFn = void (*)(const uint8_t*, int64_t, const uint32_t* const*, const float* const*, __m512*);

template <template <int, typename> class Pick, typename Scale>
GroupFn group_fn(int rows) {
  switch (rows) {
    case 1: return Pick<1, Scale>::fn;
    case 2: return Pick<2, Scale>::fn;
    case 3: return Pick<3, Scale>::fn;
    default: return Pick<4, Scale>::fn;
  }
}
template <int NR, typename Scale> struct Q4 { static constexpr GroupFn fn = q4_group<NR, Scale>; };
template <int NR, typename Scale> struct Q8 { static constexpr GroupFn fn = q8_group<NR, Scale>; };

AVX512 at::Tensor product(const at::Tensor& x_in, const at::Tensor& records, int64_t out_features, bool q4) {
  Product call(x_in, records, out_features, q4);
  const int64_t R = call.R, K = call.K, groups = call.groups, blocks = call.blocks, bytes = call.bytes;
  const bool f32 = call.f32;
  const uint8_t* rec = call.rec;
  bf16* o = call.o;
  const auto& x = call.x;
  const auto& sums = call.sums;
  // groups of output rows split over torch's threads, each thread's share at least GRAIN_WEIGHTS
  // weight-rows of work (smaller matrices stay on one); a group's outputs do not depend on the split
  const int64_t grain = std::max<int64_t>(1, GRAIN_WEIGHTS / (16 * K * std::max<int64_t>(R, 1)));
  over_ranges(groups, grain, [&](int64_t first, int64_t last) {
  for (int64_t g = first; g < last; ++g) {
    const uint8_t* group = rec + g * blocks * bytes;
    for (int64_t r0 = 0; r0 < R; r0 += 4) {
      int nr = int(std::min<int64_t>(4, R - r0));
      const uint32_t* xs[4];
      const float* sx[4];
      for (int r = 0; r < nr; ++r) {
        xs[r] = reinterpret_cast<const uint32_t*>(data(x) + (r0 + r) * K);
        sx[r] = q4 ? sums.data() + (r0 + r) * blocks : nullptr;
      }
      GroupFn fn = q4 ? (f32 ? group_fn<Q4, float>(nr) : group_fn<Q4, uint16_t>(nr))
                      : (f32 ? group_fn<Q8, float>(nr) : group_fn<Q8, uint16_t>(nr));
      __m512 acc[4];
      fn(group, blocks, xs, sx, acc);
      for (int r = 0; r < nr; ++r) store_group(acc[r], o + (r0 + r) * out_features + 16 * g, out_features - 16 * g);
    }
  }
  });
  return call.out;
}

at::Tensor q4_product(const at::Tensor& x, const at::Tensor& records, int64_t n) { return product(x, records, n, true); }
at::Tensor q8_product(const at::Tensor& x, const at::Tensor& records, int64_t n) { return product(x, records, n, false); }

}  // namespace

#pragma GCC pop_options

TORCH_LIBRARY(triforce_stored, m) {
  m.def("use_pool(int address) -> ()", &use_pool);
  m.def("q4_product(Tensor x, Tensor records, int out_features) -> Tensor");
  m.def("q8_product(Tensor x, Tensor records, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(triforce_stored, CPU, m) {
  m.impl("q4_product", &q4_product);
  m.impl("q8_product", &q8_product);
}
