// Attention of T queries per row over one layer of the KV cache, as an XLA FFI custom call
// (`jaxinfer_attention`): flash attention's running softmax over blocks of keys, the scores never
// leaving the cache (L1). XLA CPU runs a prompt chunk's attention as small batched dots with the
// softmax between them in separate passes, at 26-70 GFLOP/s (SmolLM-135M shape, 16-128 queries
// over 2500 keys), and a chunk's attention, not its weights, is what a running row waits for.
//
// Layouts (as jaxinfer.model and jaxinfer.kvcache hold them):
//   q, out [B, T, KV, G, hd] float32 (G query heads per kv head, grouped-query attention);
//   k, v   [L, R, KV, S, hd] float32 or bfloat16: the whole stacked cache, row `rows[b]`, layer `layer`;
//   pos    [B, T] int32: each query's position; it sees keys at positions <= its own (and within
//          `window` when that is not 0), below `kv_len`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxinfer {
namespace {

constexpr int64_t kKeys = 64;  // keys per block: their scores for a query row fit 4 vectors

struct Attention {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* pos;
  const int32_t* rows;
  int64_t B, T, KV, G, hd, R, S, layer, kv_len, window;
  float scale, softcap;
  bool bf16;
  int64_t tile = 1;    // query positions per item
  int64_t tiles = 1;   // tiles per (row, kv head)
  int64_t splits = 1;  // items per tile, each over its share of the key blocks (flash decoding)

  int64_t key_at(int64_t b, int64_t s, int64_t h) const { return (((layer * R + rows[b]) * KV + h) * S + s) * hd; }
  int64_t query_at(int64_t b, int64_t t, int64_t h, int64_t g) const { return (((b * T + t) * KV + h) * G + g) * hd; }
  float element(const void* a, int64_t at) const {  // of k or v, as float32
    return bf16 ? bf16_to_float(static_cast<const uint16_t*>(a)[at]) : static_cast<const float*>(a)[at];
  }
};

// One work item: `tile` query positions x G heads (its rows, m = t * G + g) of one (row b, kv head h),
// over keys [lo, hi): its split's share of the blocks its queries can see.
struct Item {
  int64_t b, h, t0, rows, lo, hi;
};

// An item's result, unnormalised: per row the weighted values [hd], the scores' max and the
// weights' sum (softmax's running state, merged across splits).
struct Part {
  float* acc;
  float* top;
  float* total;
};

Item item_at(const Attention& p, int64_t i) {
  const int64_t split = i % p.splits, unit = i / p.splits;
  Item it{unit / (p.tiles * p.KV), unit / p.tiles % p.KV, unit % p.tiles * p.tile, 0, 0, 0};
  const int64_t t1 = std::min(p.T, it.t0 + p.tile);
  it.rows = (t1 - it.t0) * p.G;
  int64_t first = p.kv_len, last = -1;  // over queries below kv_len: those past it (finished rows) see nothing
  for (int64_t t = it.t0; t < t1; ++t) {
    const int64_t at = p.pos[it.b * p.T + t];
    if (at < p.kv_len) first = std::min(first, at), last = std::max(last, at);
  }
  const int64_t lo = last < 0 ? 0 : p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) : 0, hi = last + 1;
  const int64_t start = lo - lo % kKeys, blocks = (std::max(hi, start) - start + kKeys - 1) / kKeys;
  it.lo = std::max(lo, start + blocks * split / p.splits * kKeys);
  it.hi = std::min(hi, start + blocks * (split + 1) / p.splits * kKeys);
  return it;
}

bool visible(const Attention& p, int64_t s, int32_t at) {
  return s <= at && (p.window == 0 || s > at - p.window);
}

float capped(const Attention& p, float score) { return p.softcap > 0.f ? std::tanh(score / p.softcap) * p.softcap : score; }

// Portable path: any CPU. One query row at a time, exact exp.
void item_generic(const Attention& p, const Item& it, const Part& part) {
  for (int64_t m = 0; m < it.rows; ++m) {
    const int64_t t = it.t0 + m / p.G;
    const int32_t at = p.pos[it.b * p.T + t];
    const float* q = p.q + p.query_at(it.b, t, it.h, m % p.G);
    float* acc = part.acc + m * p.hd;
    float top = -std::numeric_limits<float>::infinity(), total = 0.f;
    std::fill(acc, acc + p.hd, 0.f);
    for (int64_t s = it.lo; s < it.hi; ++s) {
      if (!visible(p, s, at)) continue;
      const int64_t kat = p.key_at(it.b, s, it.h);
      float score = 0.f;
      for (int64_t d = 0; d < p.hd; ++d) score += q[d] * p.element(p.k, kat + d);
      score = capped(p, score * p.scale);
      const float now = std::max(top, score);
      const float before = std::exp(top - now), weight = std::exp(score - now);
      total = total * before + weight;
      for (int64_t d = 0; d < p.hd; ++d) acc[d] = acc[d] * before + weight * p.element(p.v, kat + d);
      top = now;
    }
    part.top[m] = top;
    part.total[m] = total;
  }
}

#if defined(__x86_64__)
// e^x for x <= 0 (and -inf): Cephes' expf polynomial on x - n ln 2, scaled by 2^n; within 2 ulp.
__attribute__((target("avx512f"), always_inline)) inline __m512 exp_avx512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);
}

template <bool kBf16>
__attribute__((target("avx512f"), always_inline)) inline __m512 load16(const void* a, int64_t at) {
  if constexpr (kBf16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(a) + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(a) + at);
  }
}

// r[0..15] (16 keys' values at 16 dims) -> r[i] = dim i of the 16 keys.
__attribute__((target("avx512f"), always_inline)) inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // per 128-bit lane L: r[i + c] = dim 4L + c of keys i..i+3
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int h = 0; h < 16; h += 8) {
    for (int c = 0; c < 4; ++c) {
      t[h + c] = _mm512_shuffle_f32x4(r[h + c], r[h + c + 4], 0x88);
      t[h + c + 4] = _mm512_shuffle_f32x4(r[h + c], r[h + c + 4], 0xdd);
    }
  }
  for (int c = 0; c < 8; ++c) {
    r[c] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0x88);
    r[c + 8] = _mm512_shuffle_f32x4(t[c], t[c + 8], 0xdd);
  }
}

// Scores of kRows query rows against a block of kKeys keys (transposed: [hd][kKeys]) into
// out[r][kKeys]: each key vector load feeds kRows FMAs.
template <int kRows>
__attribute__((target("avx512f"), always_inline)) inline void scores_avx512(const float* const* q, const float* keys, int64_t hd, float* out) {
  __m512 acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; ++d) {
    __m512 k[4];
    for (int c = 0; c < 4; ++c) k[c] = _mm512_load_ps(keys + d * kKeys + c * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 qd = _mm512_set1_ps(q[r][d]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(k[c], qd, acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + r * kKeys + c * 16, acc[r][c]);
}

// acc[r] = acc[r] * rescale[r] + sum_j weights[r][j] * value_j for kRows rows: each value vector
// load feeds kRows FMAs.
template <int kRows, int kVecs>
__attribute__((target("avx512f"), always_inline)) inline void values_avx512(float* const* acc, const float* const* weights, const float* rescale,
                                                                            const float* const* value, int64_t n) {
  __m512 out[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) out[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + c * 16), _mm512_set1_ps(rescale[r]));
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[kVecs];
    for (int c = 0; c < kVecs; ++c) v[c] = _mm512_loadu_ps(value[j] + c * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 w = _mm512_set1_ps(weights[r][j]);
      for (int c = 0; c < kVecs; ++c) out[r][c] = _mm512_fmadd_ps(v[c], w, out[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(acc[r] + c * 16, out[r][c]);
}

// One item over its keys, kKeys at a time: each block's keys are transposed once for all its rows.
// kVecs = hd / 16.
template <int kVecs, bool kBf16>
__attribute__((target("avx512f"))) void item_avx512(const Attention& p, const Item& it, const Part& part) {
  constexpr int64_t hd = kVecs * 16;
  constexpr int kValueRows = kVecs <= 4 ? 4 : kVecs <= 8 ? 2 : 1;  // accumulators in at most 16 registers
  const int64_t b = it.b, h = it.h, rows = it.rows, lo = it.lo, hi = it.hi;
  alignas(64) float keys[hd * kKeys];  // the block's keys, transposed: [hd][kKeys]
  alignas(64) float widened[kBf16 ? kKeys * hd : 1];  // bfloat16 values as float32
  const float* value[kKeys];
  std::vector<float> weights(rows * kKeys), rescale(rows, 1.f);
  float* top = part.top;
  float* total = part.total;
  std::fill(part.acc, part.acc + rows * hd, 0.f);
  std::fill(top, top + rows, -std::numeric_limits<float>::infinity());
  std::fill(total, total + rows, 0.f);
  std::vector<const float*> query(rows), weight(rows);
  std::vector<float*> accumulator(rows);
  std::vector<int32_t> at(rows);
  for (int64_t m = 0; m < rows; ++m) {
    at[m] = p.pos[b * p.T + it.t0 + m / p.G];
    query[m] = p.q + p.query_at(b, it.t0 + m / p.G, h, m % p.G);
    weight[m] = weights.data() + m * kKeys;
    accumulator[m] = part.acc + m * hd;
  }
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(p.scale), minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());

  for (int64_t s0 = lo - lo % kKeys; s0 < hi; s0 += kKeys) {
    const int64_t n = std::min(kKeys, hi - s0);
    for (int64_t j0 = 0; j0 < kKeys; j0 += 16) {
      for (int c = 0; c < kVecs; ++c) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = j0 + i < n ? load16<kBf16>(p.k, p.key_at(b, s0 + j0 + i, h) + c * 16) : _mm512_setzero_ps();
        transpose16(r);
        for (int i = 0; i < 16; ++i) _mm512_store_ps(keys + (c * 16 + i) * kKeys + j0, r[i]);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (kBf16) {
        for (int c = 0; c < kVecs; ++c) _mm512_store_ps(widened + j * hd + c * 16, load16<kBf16>(p.v, p.key_at(b, s0 + j, h) + c * 16));
        value[j] = widened + j * hd;
      } else {
        value[j] = static_cast<const float*>(p.v) + p.key_at(b, s0 + j, h);
      }
    }
    for (int64_t m0 = 0; m0 < rows; m0 += 4) {
      float* w0 = weights.data() + m0 * kKeys;  // the scores, then in their place the weights
      switch (std::min<int64_t>(4, rows - m0)) {
        case 4: scores_avx512<4>(&query[m0], keys, hd, w0); break;
        case 3: scores_avx512<3>(&query[m0], keys, hd, w0); break;
        case 2: scores_avx512<2>(&query[m0], keys, hd, w0); break;
        default: scores_avx512<1>(&query[m0], keys, hd, w0); break;
      }
      for (int64_t m = m0; m < std::min<int64_t>(rows, m0 + 4); ++m) {
        float* w = weights.data() + m * kKeys;
        __m512 sc[4];
        for (int c = 0; c < 4; ++c) sc[c] = _mm512_loadu_ps(w + c * 16);
        __mmask16 seen[4];
        __m512 block_top = minus_inf;
        const __m512i position = _mm512_set1_epi32(at[m]);
        for (int c = 0; c < 4; ++c) {
          const __m512i s = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(s0 + c * 16)), lane);
          seen[c] = _mm512_cmple_epi32_mask(s, position) & _mm512_cmplt_epi32_mask(s, _mm512_set1_epi32(static_cast<int32_t>(hi)));
          if (p.window > 0) seen[c] &= _mm512_cmpgt_epi32_mask(s, _mm512_set1_epi32(at[m] - static_cast<int32_t>(p.window)));
          sc[c] = _mm512_mul_ps(sc[c], scale);
          if (p.softcap > 0.f) {  // cap * tanh(x / cap), tanh|y| = (1 - e) / (1 + e) with e = e^{-2|y|}, then y's sign
            const __m512 y = _mm512_div_ps(sc[c], _mm512_set1_ps(p.softcap));
            const __m512 e = exp_avx512(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(y)));
            const __m512 t = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), e), _mm512_add_ps(_mm512_set1_ps(1.f), e));
            const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
            sc[c] = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), _mm512_set1_ps(p.softcap));
          }
          block_top = _mm512_mask_max_ps(block_top, seen[c], block_top, sc[c]);
        }
        const float here = _mm512_reduce_max_ps(block_top);
        if (here == -std::numeric_limits<float>::infinity()) {  // no key of this block is visible
          for (int c = 0; c < 4; ++c) _mm512_storeu_ps(w + c * 16, _mm512_setzero_ps());
          rescale[m] = 1.f;
          continue;
        }
        const float now = std::max(top[m], here);
        rescale[m] = std::exp(top[m] - now);
        __m512 sum = _mm512_setzero_ps();
        for (int c = 0; c < 4; ++c) {
          const __m512 e = _mm512_maskz_mov_ps(seen[c], exp_avx512(_mm512_sub_ps(sc[c], _mm512_set1_ps(now))));
          _mm512_storeu_ps(w + c * 16, e);
          sum = _mm512_add_ps(sum, e);
        }
        total[m] = total[m] * rescale[m] + _mm512_reduce_add_ps(sum);
        top[m] = now;
      }
    }
    int64_t m = 0;
    for (; m + kValueRows <= rows; m += kValueRows) values_avx512<kValueRows, kVecs>(&accumulator[m], &weight[m], &rescale[m], value, n);
    switch (rows - m) {  // the rest at once: each value vector loaded once for them
      case 3: if constexpr (kValueRows > 3) values_avx512<3, kVecs>(&accumulator[m], &weight[m], &rescale[m], value, n); break;
      case 2: if constexpr (kValueRows > 2) values_avx512<2, kVecs>(&accumulator[m], &weight[m], &rescale[m], value, n); break;
      case 1: values_avx512<1, kVecs>(&accumulator[m], &weight[m], &rescale[m], value, n); break;
      default: break;
    }
  }
}

using Run = void (*)(const Attention&, const Item&, const Part&);

template <bool kBf16>
Run avx512_for(int64_t hd) {
  switch (hd) {
    case 32: return item_avx512<2, kBf16>;
    case 64: return item_avx512<4, kBf16>;
    case 80: return item_avx512<5, kBf16>;
    case 96: return item_avx512<6, kBf16>;
    case 128: return item_avx512<8, kBf16>;
    case 256: return item_avx512<16, kBf16>;
    default: return nullptr;
  }
}
#endif

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> pos, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::S32> rows, int64_t layer, int64_t kv_len, int64_t window, float scale, float softcap,
                  ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const bool bf16 = k.element_type() == ffi::DataType::BF16;
  if (qd.size() != 5 || kd.size() != 5 || (!bf16 && k.element_type() != ffi::DataType::F32) || v.element_type() != k.element_type() ||
      kd[2] != qd[2] || kd[4] != qd[4] || layer >= kd[0] || kv_len > kd[3]) {
    return ffi::Error::InvalidArgument("jaxinfer_attention: q [B, T, KV, G, hd] and a cache [L, R, KV, S, hd] of float32 or bfloat16 that agree");
  }
  Attention p{q.typed_data(), k.untyped_data(), v.untyped_data(), pos.typed_data(), rows.typed_data(),
              qd[0], qd[1], qd[2], qd[3], qd[4], kd[1], kd[3], layer, kv_len, window, scale, softcap, bf16};
  // Items of up to 64 query rows (each block of keys is transposed once per item); where that
  // leaves a thread idle (decode: one item per kv head) each tile's key blocks are split between
  // items and their softmaxes merged.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads()), units_wanted = 4 * threads;
  p.tile = std::max<int64_t>(1, std::min(p.T, 64 / p.G));
  p.tiles = (p.T + p.tile - 1) / p.tile;
  int64_t keys = 0;
  for (int64_t i = 0; i < p.B * p.T; ++i) keys = std::max<int64_t>(keys, p.pos[i] < kv_len ? p.pos[i] + 1 : 0);
  const int64_t units = p.B * p.KV * p.tiles;
  p.splits = std::max<int64_t>(1, std::min((units_wanted + units - 1) / units, keys / (2 * kKeys)));
  Run run = item_generic;
#if defined(__x86_64__)
  if (has_avx512()) {
    if (Run fast = bf16 ? avx512_for<true>(p.hd) : avx512_for<false>(p.hd)) run = fast;
  }
#endif
  const int64_t rows_per = p.tile * p.G, slot = rows_per * (p.hd + 2);
  std::vector<float> scratch(units * p.splits * slot);
  const Attention& problem = p;
  float* parts = scratch.data();
  auto part = [&problem, parts, slot, rows_per](int64_t i) {
    float* at = parts + i * slot;
    return Part{at, at + rows_per * problem.hd, at + rows_per * (problem.hd + 1)};
  };
  parallel_items(pool, units * p.splits, keys * p.hd * 8 / p.splits, [&problem, run, &part](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) run(problem, item_at(problem, i), part(i));
  });
  // Merge each tile's splits: softmax over all its keys = the splits' weighted values and sums,
  // each rescaled to the largest max.
  float* o = out->typed_data();
  for (int64_t unit = 0; unit < units; ++unit) {
    const Item it = item_at(p, unit * p.splits);
    for (int64_t m = 0; m < it.rows; ++m) {
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t s = 0; s < p.splits; ++s) top = std::max(top, part(unit * p.splits + s).top[m]);
      float* dst = o + p.query_at(it.b, it.t0 + m / p.G, it.h, m % p.G);
      std::fill(dst, dst + p.hd, 0.f);
      if (top == -std::numeric_limits<float>::infinity()) continue;  // no key visible (a finished row)
      for (int64_t s = 0; s < p.splits; ++s) {
        const Part from = part(unit * p.splits + s);
        const float weight = std::exp(from.top[m] - top);
        total += from.total[m] * weight;
        for (int64_t d = 0; d < p.hd; ++d) dst[d] += from.acc[m * p.hd + d] * weight;
      }
      for (int64_t d = 0; d < p.hd; ++d) dst[d] /= total;
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_attention, jaxinfer::Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("kv_len")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
