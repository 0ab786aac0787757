// The AVX2 + FMA family (Haswell, Zen 1 on: most desktops and laptops): float tiles and attention on
// 8-float vectors (simd.h), int8/int4 on VPMADDUBSW, or on AVX-VNNI's VPDPBUSD where the CPU has it.
// An AVX-512 CPU takes these for whatever its own family lacks, and `JAXINFER_ISA=avx2` (or
// `avx2-vnni`) makes it take them all.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <utility>

#include "paths.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "simd.h"

namespace jaxinfer {
namespace {

struct Avx2 {
  using F = __m256;
  using Mask = __m256;  // all ones in a lane that is in
  static constexpr int L = 8, kRegisters = 16;

  static F load(const float* a) { return _mm256_loadu_ps(a); }
  static F load_aligned(const float* a) { return _mm256_load_ps(a); }
  static void store(float* a, F v) { _mm256_storeu_ps(a, v); }
  static void store_aligned(float* a, F v) { _mm256_store_ps(a, v); }
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  static F copysign(F magnitude, F sign) { return _mm256_or_ps(magnitude, _mm256_and_ps(sign, _mm256_set1_ps(-0.f))); }
  // as Avx512::exp; 2^n built in the exponent bits (n >= -126 for x >= -87.3: a normal float)
  static F exp(F x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    const F n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(simd::exp_polynomial<Avx2>(x, n), _mm256_castsi256_ps(two_n));
  }
  static float reduce_max(F v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static float reduce_add(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static F widen(const uint16_t* a) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))), 16));
  }
  static F widen_int8(const int8_t* a) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)))); }
  static F widen_pairs(const uint16_t* a, bool second) {
    const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    return _mm256_castsi256_ps(second ? _mm256_and_si256(pair, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))) : _mm256_slli_epi32(pair, 16));
  }
  static Mask in_range(int32_t first, int32_t lo, int32_t up) {
    const __m256i s = _mm256_add_epi32(_mm256_set1_epi32(first), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(s, _mm256_set1_epi32(lo)), _mm256_cmpgt_epi32(_mm256_set1_epi32(up), s)));
  }
  static F max_where(F a, Mask m, F v) { return _mm256_blendv_ps(a, _mm256_max_ps(a, v), m); }
  static F where(Mask m, F v) { return _mm256_and_ps(m, v); }

  // r[0..7] (8 keys' values at 8 dims) -> r[i] = dim i of the 8 keys.
  static void transpose(F r[8]) {
    F t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  // per 128-bit half H: u[i + c] = dim 4H + c of keys i..i+3
      u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
      u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
      u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
      u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      r[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
      r[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
    }
  }
};

// ------------------------------------------------------------------------------------- quantized
// As the portable path's arithmetic: cvtps rounds to nearest even, as nearbyint.
void quantize_rows(const float* x, int64_t m, int64_t k_blocks, int8_t* xq, float* xs, int32_t* xsum) {
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // the packs' 4-byte pieces back in k order
  for (int64_t at = 0; at < m * k_blocks; ++at) {
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) top = _mm256_max_ps(top, Avx2::abs(v[i] = _mm256_loadu_ps(x + at * kBlock + 8 * i)));
    const float amax = Avx2::reduce_max(top);
    const __m256 inverse = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + at * kBlock), _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    xs[at] = amax / 127.f;
    xsum[at] = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
  }
}

// VPMADDUBSW multiplies unsigned by signed bytes and adds pairs into int16, saturating; VPMADDWD
// with ones then adds pairs of those into int32. int8: |x| times w with x's sign (llama.cpp's q8_0
// dot): |x|, |w| <= 127 keep a pair's sum within int16. int4: the nibbles (q + 8 <= 15) times x,
// where a pair is at most 2 · 15 · 127, so a block's 8 chunks add up in int16 (30480) before one
// widening, and the offset comes back as 8 · sum(xq).
// kRows rows by a group (two halves of 8 outputs), each weight vector loaded once for the rows.
inline __m256 widen_scale(const QProblem& p, const uint16_t* s) {  // 8 scales
  return p.f16_scale ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))) : Avx2::widen(s);
}

// A block's int32 dots (outputs 8h..8h+7 of each row) into acc[r][h], scaled by w's and x's scales.
template <int kRows>
inline void qscale(const QProblem& p, int64_t g, int64_t b, int64_t row0, const __m256i dot[kRows][2], __m256 acc[kRows][2]) {
  const uint16_t* scale = p.scale + (g * p.k_blocks + b) * kGroup;
  const __m256 sw[2] = {widen_scale(p, scale), widen_scale(p, scale + 8)};
  for (int r = 0; r < kRows; ++r) {
    const __m256 xs = _mm256_set1_ps(p.xs[(row0 + r) * p.k_blocks + b]);
    for (int h = 0; h < 2; ++h) acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), _mm256_mul_ps(sw[h], xs), acc[r][h]);
  }
}

// A tile's 16 outputs of each row (QProblem's or KProblem's).
template <int kRows, class Problem>
inline void store_tile(const Problem& p, int64_t g, int64_t row0, const __m256 acc[kRows][2]) {
  for (int r = 0; r < kRows; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(p.y + (row0 + r) * p.groups * kGroup + g * kGroup + 8 * h, acc[r][h]);
}

// MXFP4 (kE2M1): the codes looked up (VPSHUFB) as their values + 12, at most 24, so a pair is at most
// 2 · 24 · 127 and a chunk's two are widened at once; the offset comes back as 12 · sum(xq).
template <int kRows, int kBits, bool kE2M1 = false>
void qtile(const QProblem& p, int64_t g, int64_t row0) {
  constexpr int64_t weight_bytes = kBits == 8 ? 512 : 256;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Unsigned)));
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.k_blocks; ++b) {
    const uint8_t* wb = p.q + (g * p.k_blocks + b) * weight_bytes;
    const int32_t* xb[kRows];
    for (int r = 0; r < kRows; ++r) xb[r] = reinterpret_cast<const int32_t*>(p.xq + ((row0 + r) * p.k_blocks + b) * kBlock);
    __m256i dot[kRows][2];
    if constexpr (kBits == 8) {
      for (int r = 0; r < kRows; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int c = 0; c < 8; ++c) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32));
        for (int r = 0; r < kRows; ++r) {
          const __m256i x = _mm256_set1_epi32(xb[r][c]), ax = _mm256_abs_epi8(x);
          dot[r][0] = _mm256_add_epi32(dot[r][0], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, x)), ones));
          dot[r][1] = _mm256_add_epi32(dot[r][1], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, x)), ones));
        }
      }
    } else {
      __m256i sums[kRows][2];
      for (int r = 0; r < kRows; ++r) sums[r][0] = sums[r][1] = dot[r][0] = dot[r][1] = _mm256_setzero_si256();
      for (int c = 0; c < 4; ++c) {
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32 * h));
          __m256i first = _mm256_and_si256(v, low), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          if constexpr (kE2M1) first = _mm256_shuffle_epi8(table, first), second = _mm256_shuffle_epi8(table, second);
          for (int r = 0; r < kRows; ++r) {
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(first, _mm256_set1_epi32(xb[r][c])),
                                                  _mm256_maddubs_epi16(second, _mm256_set1_epi32(xb[r][c + 4])));
            if constexpr (kE2M1) {
              dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_madd_epi16(pair, ones));
            } else {
              sums[r][h] = _mm256_add_epi16(sums[r][h], pair);
            }
          }
        }
      }
      for (int r = 0; r < kRows; ++r) {
        const __m256i offset = _mm256_set1_epi32((kE2M1 ? kE2M1Offset : 8) * p.xsum[(row0 + r) * p.k_blocks + b]);
        for (int h = 0; h < 2; ++h) {
          const __m256i sum = kE2M1 ? dot[r][h] : _mm256_madd_epi16(sums[r][h], ones);
          dot[r][h] = _mm256_sub_epi32(sum, offset);
        }
      }
    }
    qscale<kRows>(p, g, b, row0, dot, acc);
  }
  store_tile<kRows>(p, g, row0, acc);
}

template <int kBits, bool kE2M1 = false>
void qgroups(const QProblem& p, int64_t g0, int64_t g1) {
  groups_in_row_pairs(g0, g1, p.m, [&](int64_t g, int64_t row, auto rows) { qtile<decltype(rows)::value, kBits, kE2M1>(p, g, row); });
}

#if defined(JAXINFER_AVX_VNNI)
// AVX-VNNI (Alder Lake, Zen 4 on): as the AVX-512 path's VNNI tiles on 8 outputs a vector. The weights
// are read as unsigned (int8: q ^ 0x80 = q + 128; int4 nibbles: q + 8), x's 4 bytes broadcast as the
// signed operand, and the offset comes back per block as `offset * sum(xq)`: one VPDPBUSD per 4 k of 8
// outputs where the plain path takes VPMADDUBSW, VPMADDWD and an add (and x's sign folded into w).
// Compiled for AVX-VNNI here only: the rest of this file must run on CPUs without it.
template <int kRows, int kBits, bool kE2M1 = false>
__attribute__((target("avx2,fma,f16c,avxvnni"))) void qtile_vnni(const QProblem& p, int64_t g, int64_t row0) {
  constexpr int64_t weight_bytes = kBits == 8 ? 512 : 256;
  constexpr int offset = kBits == 8 ? 128 : kE2M1 ? kE2M1Offset : 8;
  const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Unsigned)));
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.k_blocks; ++b) {
    const uint8_t* wb = p.q + (g * p.k_blocks + b) * weight_bytes;
    const int32_t* xb[kRows];
    __m256i dot[kRows][2], odd[kRows][2];  // two chains per half (chunks c even and odd): half the latency
    for (int r = 0; r < kRows; ++r) {
      const int64_t at = (row0 + r) * p.k_blocks + b;
      xb[r] = reinterpret_cast<const int32_t*>(p.xq + at * kBlock);
      dot[r][0] = dot[r][1] = _mm256_set1_epi32(-offset * p.xsum[at]);
      odd[r][0] = odd[r][1] = _mm256_setzero_si256();
    }
    if constexpr (kBits == 8) {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int c = 0; c < 8; ++c) {
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c)), flip);
        const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32)), flip);
        for (int r = 0; r < kRows; ++r) {
          const __m256i x = _mm256_set1_epi32(xb[r][c]);
          __m256i(&into)[2] = c % 2 ? odd[r] : dot[r];
          into[0] = _mm256_dpbusd_avx_epi32(into[0], w0, x);
          into[1] = _mm256_dpbusd_avx_epi32(into[1], w1, x);
        }
      }
    } else {
      const __m256i low = _mm256_set1_epi8(0x0F);
      for (int c = 0; c < 4; ++c) {
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32 * h));
          __m256i first = _mm256_and_si256(v, low), second = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          if constexpr (kE2M1) first = _mm256_shuffle_epi8(table, first), second = _mm256_shuffle_epi8(table, second);
          for (int r = 0; r < kRows; ++r) {
            dot[r][h] = _mm256_dpbusd_avx_epi32(dot[r][h], first, _mm256_set1_epi32(xb[r][c]));
            odd[r][h] = _mm256_dpbusd_avx_epi32(odd[r][h], second, _mm256_set1_epi32(xb[r][c + 4]));
          }
        }
      }
    }
    for (int r = 0; r < kRows; ++r)
      for (int h = 0; h < 2; ++h) dot[r][h] = _mm256_add_epi32(dot[r][h], odd[r][h]);
    qscale<kRows>(p, g, b, row0, dot, acc);
  }
  store_tile<kRows>(p, g, row0, acc);
}

template <int kBits, bool kE2M1 = false>
void qgroups_vnni(const QProblem& p, int64_t g0, int64_t g1) {
  groups_in_row_pairs(g0, g1, p.m, [&](int64_t g, int64_t row, auto rows) { qtile_vnni<decltype(rows)::value, kBits, kE2M1>(p, g, row); });
}
#endif

// KProblem's formats on the same instructions. Per chunk c of a block, the 4-bit codes as int4's,
// with a fifth bit, or Q6_K's fifth and sixth, shifted into bit 4 (srli on 16-bit lanes, then masked
// per byte, so no bit crosses into its neighbour). Unsigned codes (all but Q6_K) go to VPMADDUBSW as
// they are (a pair is at most 2 · 31 · 127, so four add up in int16) and come back as
// scale · dot - min · sum(xq); Q6_K's code - 32 is signed and takes |x| times it with x's sign as int8
// does, each half of 16 summed apart (4 · 2 · 32 · 127 < 2^15) and scaled by its own sub-scale in int32.
// On AVX-VNNI every code is unsigned (Q6_K's too, its 32 · sum(xq) of each half taken back), and
// VPDPBUSD sums into int32 at once.

// Chunks c and c + 4 of outputs 8h..8h+7 of a block: the codes, unsigned (Q6_K's minus 32 where `kCentred`).
template <int kBits, bool kCentred>
inline void kcodes(const uint8_t* wb, const __m256i high[2], int c, int h, __m256i& first, __m256i& second) {
  const __m256i low = _mm256_set1_epi8(0x0F), bit = _mm256_set1_epi8(1), bits2 = _mm256_set1_epi8(3);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * c + 32 * h));
  first = _mm256_and_si256(v, low);
  second = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
  if constexpr (kBits == 5) {
    first = _mm256_or_si256(first, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high[0], c), bit), 4));
    second = _mm256_or_si256(second, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high[0], c + 4), bit), 4));
  }
  if constexpr (kBits == 6) {
    first = _mm256_or_si256(first, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high[0], 2 * c), bits2), 4));
    second = _mm256_or_si256(second, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(high[1], 2 * c), bits2), 4));
    if constexpr (kCentred) {
      first = _mm256_sub_epi8(first, _mm256_set1_epi8(32));
      second = _mm256_sub_epi8(second, _mm256_set1_epi8(32));
    }
  }
}

// The bits above the low nibbles of a block's outputs 8h..8h+7 (none for the 4-bit formats).
template <int kBits>
inline void khigh(const uint8_t* wb, int h, __m256i high[2]) {
  high[0] = high[1] = _mm256_setzero_si256();
  if constexpr (kBits >= 5) high[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 256 + 32 * h));
  if constexpr (kBits == 6) high[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 320 + 32 * h));
}

// A block's outputs 8h..8h+7 into acc[r][h] from each row's int32 dots of its two halves (chunks
// 0-3 and 4-7 of the block's k; Q6_K scales each by its sub-scale, the others add them).
template <int kRows, int kKind>
inline void kscale(const KProblem& p, int64_t g, int64_t b, int h, int64_t row0, const __m256i dot[kRows][2], __m256 acc[kRows][2]) {
  const uint16_t* super = p.supers(g, b);
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super + 8 * h)));
  if constexpr (kKind == kQ6K) {
    const uint8_t* sub = p.subs(g, b);
    const __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 8 * h)));
    const __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + kGroup + 8 * h)));
    for (int r = 0; r < kRows; ++r) {
      const __m256i both = _mm256_add_epi32(_mm256_mullo_epi32(dot[r][0], s0), _mm256_mullo_epi32(dot[r][1], s1));
      acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(both), _mm256_mul_ps(d, _mm256_set1_ps(p.xs[(row0 + r) * p.k_blocks + b])), acc[r][h]);
    }
    return;
  }
  __m256 scale = d, min;
  if constexpr (kKind == kQ4K || kKind == kQ5K) {
    const uint8_t* sub = p.subs(g, b);
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super + kGroup + 8 * h)));
    scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 8 * h)))));
    min = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + kGroup + 8 * h)))));
  } else if constexpr (kKind == kQ5_0) {
    min = _mm256_mul_ps(d, _mm256_set1_ps(16.f));
  } else {
    min = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(super + kGroup + 8 * h)));
  }
  for (int r = 0; r < kRows; ++r) {
    const int64_t at = (row0 + r) * p.k_blocks + b;
    const __m256 sum = _mm256_fmsub_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dot[r][0], dot[r][1])), scale,
                                       _mm256_mul_ps(_mm256_set1_ps(static_cast<float>(p.xsum[at])), min));
    acc[r][h] = _mm256_fmadd_ps(sum, _mm256_set1_ps(p.xs[at]), acc[r][h]);
  }
}

template <int kRows, int kKind>
void ktile(const KProblem& p, int64_t g, int64_t row0) {
  constexpr int bits = k_bits(kKind);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.k_blocks; ++b) {
    const uint8_t* wb = p.block(g, b);
    const int32_t* xb[kRows];
    for (int r = 0; r < kRows; ++r) xb[r] = reinterpret_cast<const int32_t*>(p.xq + ((row0 + r) * p.k_blocks + b) * kBlock);
    for (int h = 0; h < 2; ++h) {  // outputs 8h..8h+7
      __m256i sums[kRows][2];  // int16: unsigned codes, chunks c < 2 and c >= 2 (of 0..3, each with c + 4); Q6_K the halves
      for (int r = 0; r < kRows; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
      __m256i high[2];
      khigh<bits>(wb, h, high);
      for (int c = 0; c < 4; ++c) {
        __m256i first, second;
        kcodes<bits, true>(wb, high, c, h, first, second);
        for (int r = 0; r < kRows; ++r) {
          const __m256i x0 = _mm256_set1_epi32(xb[r][c]), x1 = _mm256_set1_epi32(xb[r][c + 4]);
          if constexpr (kKind == kQ6K) {
            sums[r][0] = _mm256_add_epi16(sums[r][0], _mm256_maddubs_epi16(_mm256_abs_epi8(x0), _mm256_sign_epi8(first, x0)));
            sums[r][1] = _mm256_add_epi16(sums[r][1], _mm256_maddubs_epi16(_mm256_abs_epi8(x1), _mm256_sign_epi8(second, x1)));
          } else {
            const __m256i pair = _mm256_add_epi16(_mm256_maddubs_epi16(first, x0), _mm256_maddubs_epi16(second, x1));
            sums[r][c / 2] = _mm256_add_epi16(sums[r][c / 2], pair);
          }
        }
      }
      __m256i dot[kRows][2];
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < 2; ++i) dot[r][i] = _mm256_madd_epi16(sums[r][i], ones);
      kscale<kRows, kKind>(p, g, b, h, row0, dot, acc);
    }
  }
  store_tile<kRows>(p, g, row0, acc);
}

template <int kKind>
void kgroups(const KProblem& p, int64_t g0, int64_t g1) {
  groups_in_row_pairs(g0, g1, p.m, [&](int64_t g, int64_t row, auto rows) { ktile<decltype(rows)::value, kKind>(p, g, row); });
}

#if defined(JAXINFER_AVX_VNNI)
template <int kRows, int kKind>
__attribute__((target("avx2,fma,f16c,avxvnni"))) void ktile_vnni(const KProblem& p, int64_t g, int64_t row0) {
  constexpr int bits = k_bits(kKind);
  __m256 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < p.k_blocks; ++b) {
    const uint8_t* wb = p.block(g, b);
    const int32_t* xb[kRows];
    __m256i start[kRows][2];  // Q6_K: -32 · each half's sum(xq), its codes' offset
    for (int r = 0; r < kRows; ++r) {
      const int64_t at = (row0 + r) * p.k_blocks + b;
      xb[r] = reinterpret_cast<const int32_t*>(p.xq + at * kBlock);
      start[r][0] = start[r][1] = _mm256_setzero_si256();
      if constexpr (kKind == kQ6K) {
        start[r][0] = _mm256_set1_epi32(-32 * p.xhalf[at]);
        start[r][1] = _mm256_set1_epi32(-32 * (p.xsum[at] - p.xhalf[at]));
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256i high[2];
      khigh<bits>(wb, h, high);
      __m256i dot[kRows][2], odd[kRows][2];  // chunks c even and odd apart: two chains, half the latency
      for (int r = 0; r < kRows; ++r) {
        dot[r][0] = start[r][0], dot[r][1] = start[r][1];
        odd[r][0] = odd[r][1] = _mm256_setzero_si256();
      }
      for (int c = 0; c < 4; ++c) {
        __m256i first, second;
        kcodes<bits, false>(wb, high, c, h, first, second);
        for (int r = 0; r < kRows; ++r) {
          __m256i(&into)[2] = c % 2 ? odd[r] : dot[r];
          into[0] = _mm256_dpbusd_avx_epi32(into[0], first, _mm256_set1_epi32(xb[r][c]));
          into[1] = _mm256_dpbusd_avx_epi32(into[1], second, _mm256_set1_epi32(xb[r][c + 4]));
        }
      }
      for (int r = 0; r < kRows; ++r)
        for (int i = 0; i < 2; ++i) dot[r][i] = _mm256_add_epi32(dot[r][i], odd[r][i]);
      kscale<kRows, kKind>(p, g, b, h, row0, dot, acc);
    }
  }
  store_tile<kRows>(p, g, row0, acc);
}

template <int kKind>
void kgroups_vnni(const KProblem& p, int64_t g0, int64_t g1) {
  groups_in_row_pairs(g0, g1, p.m, [&](int64_t g, int64_t row, auto rows) { ktile_vnni<decltype(rows)::value, kKind>(p, g, row); });
}

template <int... kKind>
void add_kgroups_vnni(Paths& t, std::integer_sequence<int, kKind...>) {
  ((t.kgroups[kKind] = kgroups_vnni<kKind>), ...);
}
#endif

template <int... kKind>
void add_kgroups(Paths& t, std::integer_sequence<int, kKind...>) {
  ((t.kgroups[kKind] = kgroups<kKind>), ...);
}

// ----------------------------------------------------------------------------------------- float
void round_values(const float* x, float* out, int64_t n) {  // as round_to_bf16
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i bits = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)))));
  }
  for (; i < n; ++i) out[i] = round_to_bf16(x[i]);
}

}  // namespace

void add_avx2(Paths& t, bool vnni) {
  if (!cpu().avx2) return;
  t.name = "avx2";
  t.quantize_rows = quantize_rows;
  t.qgroups[0] = qgroups<8>;
  t.qgroups[1] = qgroups<4>;
  t.qgroups[2] = qgroups<4, true>;
  add_kgroups(t, std::make_integer_sequence<int, kKinds>{});
#if defined(JAXINFER_AVX_VNNI)
  if (vnni && cpu().avx_vnni) {
    t.name += "-vnni";
    t.qgroups[0] = qgroups_vnni<8>;
    t.qgroups[1] = qgroups_vnni<4>;
    t.qgroups[2] = qgroups_vnni<4, true>;
    add_kgroups_vnni(t, std::make_integer_sequence<int, kKinds>{});
  }
#endif
  t.fgroups[0] = simd::fgroups_narrow<Avx2, false>;
  t.fgroups[1] = simd::fgroups_narrow<Avx2, true>;
  t.round = round_values;
  simd::add_attention<Avx2>(t);
}

}  // namespace jaxinfer

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
#include "paths.h"

void jaxinfer::add_avx2(Paths&, bool) {}  // not an x86 CPU
#endif
