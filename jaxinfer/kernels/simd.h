// The float matmul tiles and the attention kernel, written once over a vector type V and included
// inside each family's target region (x86_avx512.cc, x86_avx2.cc; arm_neon.cc, whose base NEON needs
// none), so every instantiation is compiled for that family's instructions. V, a struct of static
// functions, gives:
//   F (L floats), Mask (L lanes' flags), L, kRegisters (how many F the CPU holds);
//   load, load_aligned, store, store_aligned, zero, set1, fma(a, b, c) = a * b + c, add, sub, mul,
//   div, max, abs, copysign(magnitude, sign), exp (of x <= 0, within 2 ulp), reduce_max, reduce_add;
//   widen (L bfloat16 values), widen_pairs(at, second) (the first or second of L bfloat16 pairs),
//   widen_int8 (L int8 values);
//   in_range(first, lo, up) (the lanes i with lo < first + i < up), max_where(a, mask, v),
//   where(mask, v) (zero elsewhere), transpose(F r[L]) (L vectors of L as a matrix, in place).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "paths.h"

namespace jaxinfer {
namespace simd {

// ---------------------------------------------------------------------------------- float matmul
// Where input k of group g's 16 outputs is. bfloat16: the 64 bytes of k's pair hold k in each
// lane's low half and k + 1 in its high half.
template <bool kBf16>
inline const void* group_at(const void* w, int64_t g, int64_t k, int64_t depth) {
  if constexpr (kBf16) return static_cast<const uint16_t*>(w) + (g * depth / 2 + k / 2) * 2 * kGroup;
  return static_cast<const float*>(w) + (g * depth + k) * kGroup;
}

// Vector v (outputs v * L ...) of input k of a group's 16 outputs, as floats.
template <class V, bool kBf16>
inline typename V::F load_group(const void* w, int64_t g, int64_t k, int64_t depth, int v) {
  if constexpr (kBf16) return V::widen_pairs(static_cast<const uint16_t*>(group_at<kBf16>(w, g, k, depth)) + v * V::L * 2, k & 1);
  return V::load(static_cast<const float*>(group_at<kBf16>(w, g, k, depth)) + v * V::L);
}

// A tile's sums over rows [row0, row0 + kRows) and the vectors of groups from g on: from what the
// block before stored in y (k0 > 0), else zero; and stored back.
template <class V, int kRows, int kVecs>
inline void load_sums(const FProblem& p, int64_t g, int64_t row0, int64_t k0, typename V::F (&acc)[kRows][kVecs]) {
  const float* y = p.y + row0 * p.groups * kGroup + g * kGroup;
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = k0 ? V::load(y + r * p.groups * kGroup + c * V::L) : V::zero();
}

template <class V, int kRows, int kVecs>
inline void store_sums(const FProblem& p, int64_t g, int64_t row0, const typename V::F (&acc)[kRows][kVecs]) {
  float* y = p.y + row0 * p.groups * kGroup + g * kGroup;
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) V::store(y + r * p.groups * kGroup + c * V::L, acc[r][c]);
}

// What a tile fetches as it goes: inputs [k, k + n) of groups [g, g + kCols), spread evenly over its
// own inputs, up to kFetchPer each (n = 0: nothing); into L1 (`l1`) or L2. A tile fetching the next
// block into L1 ran no faster than the hardware's prefetch alone with the weights cold (AVX2's
// one-group tiles at 16 rows, one core: SmolLM-135M's matrices 60-65 GFLOP/s cold, ~100 hot); into
// L2, 65-85 (more misses in flight there, we take it). The prefetches lie
// inside the tile's loop, not in a function or loop of their own: GCC 12 takes one of nothing but
// prefetches for one without effects and deletes it, prefetches and all.
struct Fetch {
  int64_t g = 0, k = 0, n = 0;
  bool l1 = false;
};
constexpr int64_t kFetchPer = 4;

template <bool kBf16, int kCols>
struct Fetcher {
  const FProblem& p;
  Fetch f;
  int64_t per;  // inputs fetched per input of the tile
  Fetcher(const FProblem& p, const Fetch& f, int64_t count)
      : p(p), f(f), per(count > 0 ? std::min(kFetchPer, (f.n + count - 1) / count) : 0) {}
  template <int kLocality>  // __builtin_prefetch's: 3 for L1, 2 for L2
  __attribute__((always_inline)) void at(int64_t i) const {  // for the tile's input i
    const int64_t k = f.k + i * per, end = f.k + f.n;
    for (int c = 0; c < kCols; ++c) {
      if (k < end) __builtin_prefetch(group_at<kBf16>(p.w, f.g + c, k, p.k), 0, kLocality);
      if (per > 1 && k + 1 < end) __builtin_prefetch(group_at<kBf16>(p.w, f.g + c, k + 1, p.k), 0, kLocality);
      if (per > 2 && k + 2 < end) __builtin_prefetch(group_at<kBf16>(p.w, f.g + c, k + 2, p.k), 0, kLocality);
      if (per > 3 && k + 3 < end) __builtin_prefetch(group_at<kBf16>(p.w, f.g + c, k + 3, p.k), 0, kLocality);
    }
  }
  // f(std::integral_constant<int, locality>), 0 for none: the choice made once, outside a loop
  template <class F>
  void choose(F&& f_) const {
    if (!f.n) return f_(std::integral_constant<int, 0>{});
    if (f.l1) return f_(std::integral_constant<int, 3>{});
    f_(std::integral_constant<int, 2>{});
  }
};

// kRows rows by kCols groups over inputs [k0, k1): per k, the groups' weight vectors and kRows
// broadcasts feed kRows * kCols * 16 / L independent sums. From k0 > 0 on, the sums go on from what
// the block before stored in y (a float32 store and load: the same sums in the same order).
template <class V, int kRows, int kCols, bool kBf16>
void ftile(const FProblem& p, int64_t g, int64_t row0, int64_t k0, int64_t k1, const Fetch& fetch) {
  constexpr int kPer = kGroup / V::L, kVecs = kCols * kPer;
  typename V::F acc[kRows][kVecs];
  load_sums<V>(p, g, row0, k0, acc);
  const float* x = p.x + row0 * p.k;
  const Fetcher<kBf16, kCols> fetcher(p, fetch, k1 - k0);
  fetcher.choose([&](auto locality) {
    for (int64_t k = k0; k < k1; ++k) {
      if constexpr (decltype(locality)::value > 0) fetcher.template at<decltype(locality)::value>(k - k0);
      typename V::F w[kVecs];
      for (int c = 0; c < kVecs; ++c) w[c] = load_group<V, kBf16>(p.w, g + c / kPer, k, p.k, c % kPer);
      for (int r = 0; r < kRows; ++r) {
        const typename V::F xv = V::set1(x[r * p.k + k]);
        for (int c = 0; c < kVecs; ++c) acc[r][c] = V::fma(w[c], xv, acc[r][c]);
      }
    }
  });
  store_sums<V>(p, g, row0, acc);
}

// `tile(rows, row0, k0, k1, fetch)` over all rows in tiles of kRows, for the kCols groups from g.
// More rows than a tile, up to 32 (batched decode, a checking pass), go over the inputs a block at a
// time, and the second tile fetches the next block's weights while the others reuse this one's from
// L1, so the stream from memory overlaps arithmetic instead of feeding the first tile alone; at the
// last block, the next block is the first of the groups after these (`more`: this thread runs them;
// into L2, see Fetch). Measured on AVX-512 with the weights cold, as decode reads them (the fetch
// into L1 then): SmolLM-135M's matrices at 16 rows 5–15% faster, decode at
// B=16 6–8%; from 48 rows (prefill chunks) no faster, and at 128 rows up to 20% slower (B=16 prefill
// TTFT 739 → 912 ms), so whole K there. A block is 16 KiB of float32 weights, so that it and the next
// one fetched beside it fit L1 together: blocks of 32 KiB evicted the block in use on the Xeon
// (a decode step's matrices at 16 rows 7–11% slower, 30 layers' SmolLM-135M matrices chained), and
// AVX2's one-group tiles over 4 KiB blocks ran B=16 decode 3–5% slower than over 16 KiB.
constexpr int64_t kFBlockWeights = 4096;
constexpr int64_t kFBlockMaxRows = 32;

template <int kRows, int kCols, class Tile>
void frows(const FProblem& p, int64_t g, bool more, Tile&& tile) {
  const bool blocked = p.m > kRows && p.m <= kFBlockMaxRows;
  const int64_t block = blocked ? kFBlockWeights / (kCols * kGroup) : p.k;
  for (int64_t k0 = 0; k0 < p.k; k0 += block) {
    const int64_t k1 = std::min(p.k, k0 + block);
    const Fetch next = k1 < p.k ? Fetch{g, k1, std::min(block, p.k - k1)} : Fetch{g + kCols, 0, blocked && more ? std::min(block, p.k) : 0};
    int64_t row = 0;
    for (; row + kRows <= p.m; row += kRows) tile(std::integral_constant<int, kRows>{}, row, k0, k1, row == kRows ? next : Fetch{});
    if constexpr (kRows > 1) {
      if (row < p.m) with_rows<kRows - 1>(p.m - row, [&](auto rows) { tile(rows, row, k0, k1, row == kRows ? next : Fetch{}); });
    }
  }
}

// `tile(rows, cols, g, row0, k0, k1, fetch)` over groups [g0, g1): in tiles of kCols groups by kRows
// rows (`frows`), then the groups left over one at a time.
template <int kRows, int kCols, class Tile>
void fgroups_in_tiles(const FProblem& p, int64_t g0, int64_t g1, Tile&& tile) {
  int64_t g = g0;
  auto wide = [&](auto cols) {
    for (; g + decltype(cols)::value <= g1; g += decltype(cols)::value)
      frows<kRows, decltype(cols)::value>(p, g, g + decltype(cols)::value < g1,
                                          [&](auto rows, int64_t row0, int64_t k0, int64_t k1, const Fetch& fetch) { tile(rows, cols, g, row0, k0, k1, fetch); });
  };
  wide(std::integral_constant<int, kCols>{});
  if constexpr (kCols > 1) wide(std::integral_constant<int, 1>{});
}

// Decode's one row over bfloat16 weights fetches each group's weights this many inputs ahead (2 KiB
// of its stream): the hardware's prefetch alone left it under the bandwidth float32 reaches. AVX2 path
// on the Zen 4 EPYC, B = 1 decode tok/s at 0 / 16 / 32 / 64 / 128 / 256 / 512 inputs ahead, two
// rounds: SmolLM-135M 103–107 / 101–102 / 111–113 / 123–133 / 120–128 / 107–110 / 87–90 (29 → 35 GB/s),
// TinyLlama-1.1B 19.9, 22.1 at 0, 21.6, 26.0 at 64, 20.9, 26.1 at 128. Float32 weights gained nothing
// (SmolLM-135M 101–104 at 0, 83–104 at 32, 93 at 64): they already stream at the bandwidth.
constexpr int64_t kOneRowAhead = 64;

// The float tiles of the families whose registers hold 128 or 256 bits (AVX2: 16 of 8 floats; NEON:
// 32 of 4): one row by 4 groups (decode), two rows by 2, from four rows on 6 rows by one group (AVX2:
// 8, 8 and 12 sums, 2 weight vectors and 6 broadcasts per 12 FMAs; NEON: 16, 16 and 24), so that the
// FMAs' latency is covered without spilling.
template <class V, bool kBf16>
void fgroups_narrow(const FProblem& p, int64_t g0, int64_t g1) {
  auto tile = [&p](auto rows, auto cols, int64_t g, int64_t row0, int64_t k0, int64_t k1, const Fetch& fetch) {
    ftile<V, decltype(rows)::value, decltype(cols)::value, kBf16>(p, g, row0, k0, k1, fetch);
  };
  if (p.m == 1) {
    fgroups_in_tiles<1, 4>(p, g0, g1, [&tile](auto rows, auto cols, int64_t g, int64_t row0, int64_t k0, int64_t k1, const Fetch&) {
      tile(rows, cols, g, row0, k0, k1, kBf16 ? Fetch{g, k0 + kOneRowAhead, k1 - k0, true} : Fetch{});
    });
  } else if (p.m <= 3) {
    fgroups_in_tiles<2, 2>(p, g0, g1, tile);
  } else {
    fgroups_in_tiles<6, 1>(p, g0, g1, tile);
  }
}

// Cephes' expf polynomial: e^r for r = x - n ln 2 (ln 2 in two parts) where n = round(x / ln 2),
// within 2 ulp; the caller scales by 2^n.
template <class V>
inline typename V::F exp_polynomial(typename V::F x, typename V::F n) {
  typename V::F r = V::fma(n, V::set1(-0.693359375f), x);
  r = V::fma(n, V::set1(2.12194440e-4f), r);
  typename V::F y = V::set1(1.9875691500e-4f);
  y = V::fma(y, r, V::set1(1.3981999507e-3f));
  y = V::fma(y, r, V::set1(8.3334519073e-3f));
  y = V::fma(y, r, V::set1(4.1665795894e-2f));
  y = V::fma(y, r, V::set1(1.6666665459e-1f));
  y = V::fma(y, r, V::set1(5.0000001201e-1f));
  return V::fma(y, V::mul(r, r), V::add(r, V::set1(1.f)));
}

// --------------------------------------------------------------------------------------- attention
// Flash attention's running softmax over blocks of kKeys keys, the scores never leaving L1; the
// item and split logic is attention.cc's.

// Bytes an element of K or V takes.
constexpr int64_t kv_bytes(int kKv) { return kKv == kKvF32 ? 4 : kKv == kKvBf16 ? 2 : 1; }

// L values of K or V from element `at`, as floats (int8: unscaled; `attend` applies the scales).
template <class V, int kKv>
inline typename V::F load_kv(const void* a, int64_t at) {
  if constexpr (kKv == kKvBf16) return V::widen(static_cast<const uint16_t*>(a) + at);
  if constexpr (kKv == kKvInt8) return V::widen_int8(static_cast<const int8_t*>(a) + at);
  return V::load(static_cast<const float*>(a) + at);
}

// Scores of kRows query rows against a block of kKeys keys (transposed: [hd][kKeys]) into
// out[r][kKeys]: each key vector load feeds kRows FMAs.
template <class V, int kRows>
inline void scores(const float* const* q, const float* keys, int64_t hd, float* out) {
  constexpr int kVecs = kKeys / V::L;
  typename V::F acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = V::zero();
  for (int64_t d = 0; d < hd; ++d) {
    typename V::F k[kVecs];
    for (int c = 0; c < kVecs; ++c) k[c] = V::load_aligned(keys + d * kKeys + c * V::L);
    for (int r = 0; r < kRows; ++r) {
      const typename V::F qd = V::set1(q[r][d]);
      for (int c = 0; c < kVecs; ++c) acc[r][c] = V::fma(k[c], qd, acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) V::store(out + r * kKeys + c * V::L, acc[r][c]);
}

// Scores of kRows query rows against the n keys from s0 read where they lie in the cache, without
// the transposed copy, into out[r][kKeys] (zero past n): a decode step's few rows (the query heads of
// one kv head) cannot pay for the copy with their FMAs. kAt keys at once share each query load.
// The sums of L (row, key) pairs are one transpose and L - 1 adds, not L horizontal reductions.
// `next`: how many keys the block after this one has (fetched as these are scored).
// Per layer over 8192 float32 keys (a 2-core Zen 4, three sittings against the transposed copy):
// head dim 256 with 4 query heads a kv head 2.0-2.4 -> 1.7-1.9 ms, 128 with 2 1.7-2.1 -> 1.3-1.5,
// 64 with 3 0.40-0.44 -> 0.22-0.27.
template <class V, int kRows, int kVecs, int kKv>
inline void scores_direct(const float* const* q, const Attention& p, int64_t b, int64_t h, int64_t s0, int64_t n,
                          int64_t next, float* out) {
  constexpr int L = V::L, kAt = V::kRegisters >= 32 ? 4 : 2;
  constexpr int64_t kSize = kv_bytes(kKv), kRowBytes = kVecs * L * kSize;
  for (int64_t j = 0; j < n; j += kAt) {
    typename V::F acc[kRows][kAt];
    int64_t at[kAt];
    for (int i = 0; i < kAt; ++i) at[i] = p.key_at(b, s0 + std::min<int64_t>(j + i, n - 1), h);
    // into L2 as the scores go: these keys' values (read once the scores are weights) and the next
    // block's keys, one stream at a time being all the hardware's prefetch saw before: SmolLM-135M's
    // shape at B = 16 over 131 keys, the 30 layers cold (bench_attention.py --cold 16,131), AVX2
    // 13.7 -> 19.7 GB/s, native 17.7 -> 23.8; over 1000 keys AVX2 16.2 -> 26.4
    for (int i = 0; i < kAt; ++i)
      for (int64_t line = 0; line < kRowBytes; line += 64) {
        if (j + i < n) __builtin_prefetch(static_cast<const char*>(p.v) + at[i] * kSize + line, 0, 2);
        if (j + i < next) __builtin_prefetch(static_cast<const char*>(p.k) + (at[i] + kKeys * kVecs * L) * kSize + line, 0, 2);
      }
    for (int r = 0; r < kRows; ++r)
      for (int i = 0; i < kAt; ++i) acc[r][i] = V::zero();
    for (int c = 0; c < kVecs; ++c) {
      typename V::F k[kAt];
      for (int i = 0; i < kAt; ++i) k[i] = load_kv<V, kKv>(p.k, at[i] + c * L);
      for (int r = 0; r < kRows; ++r) {
        const typename V::F qc = V::load(q[r] + c * L);
        for (int i = 0; i < kAt; ++i) acc[r][i] = V::fma(k[i], qc, acc[r][i]);
      }
    }
    if constexpr (kRows * kAt >= L) {  // L sums at a time: the accumulators transposed and added
      alignas(64) float sums[kRows * kAt];
      for (int g = 0; g < kRows * kAt; g += L) {
        typename V::F lanes[L];
        for (int a = 0; a < L; ++a) lanes[a] = acc[(g + a) / kAt][(g + a) % kAt];
        V::transpose(lanes);
        for (int a = 1; a < L; ++a) lanes[0] = V::add(lanes[0], lanes[a]);
        V::store_aligned(sums + g, lanes[0]);
      }
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < kAt && j + i < n; ++i) out[r * kKeys + j + i] = sums[r * kAt + i];
    } else {
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < kAt && j + i < n; ++i) out[r * kKeys + j + i] = V::reduce_add(acc[r][i]);
    }
  }
  for (int r = 0; r < kRows; ++r) std::fill(out + r * kKeys + n, out + (r + 1) * kKeys, 0.f);
}

// acc[r] = acc[r] * rescale[r] + sum_j weights[r][j] * value_j over dims [d0, d0 + kVecs L) for kRows
// rows: each value vector load feeds kRows FMAs. value[j]: where value j's elements start, held as
// kKv says (widened as they are loaded).
template <class V, int kRows, int kVecs, int kKv>
inline void values(float* const* acc, const float* const* weights, const float* rescale, const void* const* value, int64_t n,
                   int64_t d0) {
  typename V::F out[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) out[r][c] = V::mul(V::load(acc[r] + d0 + c * V::L), V::set1(rescale[r]));
  for (int64_t j = 0; j < n; ++j) {
    typename V::F v[kVecs];
    for (int c = 0; c < kVecs; ++c) v[c] = load_kv<V, kKv>(value[j], d0 + c * V::L);
    for (int r = 0; r < kRows; ++r) {
      const typename V::F w = V::set1(weights[r][j]);
      for (int c = 0; c < kVecs; ++c) out[r][c] = V::fma(v[c], w, out[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) V::store(acc[r] + d0 + c * V::L, out[r][c]);
}

// The most vectors of a head's dims, at most `budget`, that divide them into whole chunks.
constexpr int chunk_of(int vecs, int budget) {
  for (int c = std::min(vecs, budget); c > 1; --c)
    if (vecs % c == 0) return c;
  return 1;
}

// One item over its keys, kKeys at a time: each block's keys are transposed once for all its rows.
// kVecs = hd / L. Accumulators take at most half the registers: kScoreRows rows' scores at once,
// kValueRows rows' value sums over kChunk vectors of dims at once. An int8 cache (kKvInt8): the
// scores of the int8 keys times each key's scale, and the values widened times theirs (as
// bfloat16 values are widened), so the sums are those over the dequantized cache.
template <class V, int kVecs, int kKv>
void attend(const Attention& p, const Item& it, const Part& part) {
  using F = typename V::F;
  constexpr int L = V::L, kBudget = V::kRegisters / 2;
  constexpr int64_t hd = kVecs * L;
  constexpr int kScoreRows = std::max<int>(1, kBudget / (kKeys / L));
  constexpr int kDirectRows = 4;
  // a quarter of the budget a row, so 4 rows share each value load (a decode step's query heads)
  constexpr int kChunk = chunk_of(kVecs, std::max(1, kBudget / 4));
  constexpr int kValueRows = kChunk * 4 <= kBudget ? 4 : kChunk * 2 <= kBudget ? 2 : 1;
  const int64_t b = it.b, h = it.h, rows = it.rows, lo = it.lo, hi = it.hi;
  constexpr bool kWiden = kKv != kKvF32;
  alignas(64) float keys[hd * kKeys];                   // the block's keys, transposed: [hd][kKeys]
  alignas(64) float widened[kWiden ? kKeys * hd : 1];  // bfloat16 or int8 values as float32
  alignas(64) float key_scale[kKv == kKvInt8 ? kKeys : 1];  // the block's keys' scales, 0 past its keys
  const void* value[kKeys];
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
  const F scale = V::set1(p.scale), minus_inf = V::set1(-std::numeric_limits<float>::infinity());

  const bool direct = rows <= kDirectRows;  // `scores_direct`
  // Where the values are read: as stored (float32; and a decode step's few rows, each bfloat16 or
  // int8 vector widened as it is loaded, int8's scale joining the weights), else widened once into
  // `widened` for a chunk's many rows.
  const bool stored = direct || !kWiden;
  alignas(64) float value_scale[kKv == kKvInt8 ? kKeys : 1];
  for (int64_t s0 = lo - lo % kKeys; s0 < hi; s0 += kKeys) {
    const int64_t n = std::min(kKeys, hi - s0);
    for (int64_t j0 = 0; j0 < (direct ? 0 : kKeys); j0 += L) {
      for (int c = 0; c < kVecs; ++c) {
        F r[L];
        for (int i = 0; i < L; ++i) r[i] = j0 + i < n ? load_kv<V, kKv>(p.k, p.key_at(b, s0 + j0 + i, h) + c * L) : V::zero();
        V::transpose(r);
        for (int i = 0; i < L; ++i) V::store_aligned(keys + (c * L + i) * kKeys + j0, r[i]);
      }
    }
    if constexpr (kKv == kKvInt8) {  // the keys' scales: a row's positions are consecutive
      const float* from = p.k_scale + p.key_at(b, s0, h) / hd;
      std::copy_n(from, n, key_scale);
      std::fill(key_scale + n, key_scale + kKeys, 0.f);
    }
    for (int64_t j = 0; j < n; ++j) {
      const int64_t from = p.key_at(b, s0 + j, h);
      if constexpr (kKv == kKvInt8) value_scale[j] = p.v_scale[from / hd];
      if (stored) {
        value[j] = static_cast<const char*>(p.v) + from * kv_bytes(kKv);
      } else if constexpr (kWiden) {
        const F by = V::set1(kKv == kKvInt8 ? value_scale[j] : 1.f);
        for (int c = 0; c < kVecs; ++c) {
          const F wide = load_kv<V, kKv>(p.v, from + c * L);
          V::store_aligned(widened + j * hd + c * L, kKv == kKvInt8 ? V::mul(wide, by) : wide);
        }
        value[j] = widened + j * hd;
      }
    }
    if (direct)  // every row's scores at once
      with_rows<kDirectRows>(rows, [&](auto count) { scores_direct<V, decltype(count)::value, kVecs, kKv>(&query[0], p, b, h, s0, n, std::min(kKeys, hi - s0 - kKeys), weights.data()); });
    for (int64_t m0 = 0; m0 < rows; m0 += kScoreRows) {
      float* w0 = weights.data() + m0 * kKeys;  // the scores, then in their place the weights
      if (!direct)
        with_rows<kScoreRows>(std::min<int64_t>(kScoreRows, rows - m0), [&](auto count) { scores<V, decltype(count)::value>(&query[m0], keys, hd, w0); });
      for (int64_t m = m0; m < std::min<int64_t>(rows, m0 + kScoreRows); ++m) {
        float* w = weights.data() + m * kKeys;
        constexpr int kBlockVecs = kKeys / L;
        F sc[kBlockVecs];
        typename V::Mask seen[kBlockVecs];
        F block_top = minus_inf;
        // visible: s <= at (causal), s < hi, and within the window where there is one
        const int32_t after = p.window > 0 ? at[m] - static_cast<int32_t>(p.window) : -1;
        const int32_t before = std::min<int32_t>(at[m] + 1, static_cast<int32_t>(hi));
        for (int c = 0; c < kBlockVecs; ++c) {
          seen[c] = V::in_range(static_cast<int32_t>(s0 + c * L), after, before);
          sc[c] = V::mul(V::load(w + c * L), kKv == kKvInt8 ? V::mul(scale, V::load_aligned(key_scale + c * L)) : scale);
          if (p.softcap > 0.f) {  // cap * tanh(x / cap), tanh|y| = (1 - e) / (1 + e) with e = e^{-2|y|}, then y's sign
            const F y = V::div(sc[c], V::set1(p.softcap));
            const F e = V::exp(V::mul(V::set1(-2.f), V::abs(y)));
            const F t = V::div(V::sub(V::set1(1.f), e), V::add(V::set1(1.f), e));
            sc[c] = V::mul(V::copysign(t, y), V::set1(p.softcap));
          }
          block_top = V::max_where(block_top, seen[c], sc[c]);
        }
        const float here = V::reduce_max(block_top);
        if (here == -std::numeric_limits<float>::infinity()) {  // no key of this block is visible
          for (int c = 0; c < kBlockVecs; ++c) V::store(w + c * L, V::zero());
          rescale[m] = 1.f;
          continue;
        }
        const float now = std::max(top[m], here);
        rescale[m] = std::exp(top[m] - now);
        F sum = V::zero();
        for (int c = 0; c < kBlockVecs; ++c) {
          const F e = V::where(seen[c], V::exp(V::sub(sc[c], V::set1(now))));
          V::store(w + c * L, e);
          sum = V::add(sum, e);
        }
        total[m] = total[m] * rescale[m] + V::reduce_add(sum);
        top[m] = now;
      }
    }
    if constexpr (kKv == kKvInt8) {  // read as stored: each weight times its value's scale
      if (stored)
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t j = 0; j < n; ++j) weights[m * kKeys + j] *= value_scale[j];
    }
    auto sums = [&](auto as) {  // as: how value[j] holds its elements
      constexpr int kAs = decltype(as)::value;
      for (int64_t d0 = 0; d0 < hd; d0 += kChunk * L) {
        int64_t m = 0;
        for (; m + kValueRows <= rows; m += kValueRows)
          values<V, kValueRows, kChunk, kAs>(&accumulator[m], &weight[m], &rescale[m], value, n, d0);
        if (m < rows)  // the rest at once: each value vector loaded once for them
          with_rows<kValueRows>(rows - m, [&](auto count) { values<V, decltype(count)::value, kChunk, kAs>(&accumulator[m], &weight[m], &rescale[m], value, n, d0); });
      }
    };
    if (stored)
      sums(std::integral_constant<int, kKv>{});
    else
      sums(std::integral_constant<int, kKvF32>{});
  }
}

// The attention paths of a family, by attend_slot.
template <class V, int kKv>
void add_attention_of(Paths& t) {
  t.attend[kKv][0] = attend<V, 32 / V::L, kKv>, t.attend[kKv][1] = attend<V, 64 / V::L, kKv>;
  t.attend[kKv][2] = attend<V, 80 / V::L, kKv>, t.attend[kKv][3] = attend<V, 96 / V::L, kKv>;
  t.attend[kKv][4] = attend<V, 128 / V::L, kKv>, t.attend[kKv][5] = attend<V, 256 / V::L, kKv>;
  t.attend[kKv][6] = attend<V, 512 / V::L, kKv>;
}

template <class V>
void add_attention(Paths& t) {
  add_attention_of<V, kKvF32>(t);
  add_attention_of<V, kKvBf16>(t);
  add_attention_of<V, kKvInt8>(t);
}

}  // namespace simd
}  // namespace jaxinfer
