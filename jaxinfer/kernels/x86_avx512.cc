// The AVX-512 family (Skylake-X, Ice Lake, Sapphire Rapids, Zen 4 on): float tiles and attention on
// 16-float vectors (simd.h), int8/int4 on VNNI's VPDPBUSD, bfloat16 products on VDPBF16PS and AMX.
#if defined(__x86_64__)
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "paths.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#endif

#include "simd.h"

namespace jaxinfer {
namespace {

namespace ffi = xla::ffi;

struct Avx512 {
  using F = __m512;
  using Mask = __mmask16;
  static constexpr int L = 16, kRegisters = 32;

  static F load(const float* a) { return _mm512_loadu_ps(a); }
  static F load_aligned(const float* a) { return _mm512_load_ps(a); }
  static void store(float* a, F v) { _mm512_storeu_ps(a, v); }
  static void store_aligned(float* a, F v) { _mm512_store_ps(a, v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static F copysign(F magnitude, F sign) {
    const __m512i bit = _mm512_and_si512(_mm512_castps_si512(sign), _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), bit));
  }
  // Cephes' expf polynomial on x - n ln 2, scaled by 2^n
  static F exp(F x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    const F n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
    return _mm512_scalef_ps(simd::exp_polynomial<Avx512>(x, n), n);
  }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  static float reduce_add(F v) { return _mm512_reduce_add_ps(v); }
  static F widen(const uint16_t* a) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), 16));
  }
  static F widen_int8(const int8_t* a) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)))); }
  static F widen_pairs(const uint16_t* a, bool second) {
    const __m512i pair = _mm512_loadu_si512(a);
    return _mm512_castsi512_ps(second ? _mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))) : _mm512_slli_epi32(pair, 16));
  }
  static Mask in_range(int32_t first, int32_t lo, int32_t up) {
    const __m512i s = _mm512_add_epi32(_mm512_set1_epi32(first), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    return _mm512_cmpgt_epi32_mask(s, _mm512_set1_epi32(lo)) & _mm512_cmplt_epi32_mask(s, _mm512_set1_epi32(up));
  }
  static F max_where(F a, Mask m, F v) { return _mm512_mask_max_ps(a, m, a, v); }
  static F where(Mask m, F v) { return _mm512_maskz_mov_ps(m, v); }

  // r[0..15] (16 keys' values at 16 dims) -> r[i] = dim i of the 16 keys.
  static void transpose(F r[16]) {
    F t[16];
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
};

// ------------------------------------------------------------------------------------- quantized
// The activations of a prefill chunk (128 rows) quantized with AVX-512: the scalar loop took about
// as long as the matmul itself there. Same arithmetic: cvtps rounds to nearest even, as nearbyint.
void quantize_rows(const float* x, int64_t m, int64_t k_blocks, int8_t* xq, float* xs, int32_t* xsum) {
  for (int64_t at = 0; at < m * k_blocks; ++at) {
    const __m512 lo = _mm512_loadu_ps(x + at * kBlock), hi = _mm512_loadu_ps(x + at * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at * kBlock), _mm512_cvtsepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + at * kBlock + 16), _mm512_cvtsepi32_epi8(qhi));
    xs[at] = amax / 127.f;
    xsum[at] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

// VNNI: per group and block, 8 vpdpbusd per row cover 16 outputs x 32 k. The weights are read as
// unsigned (int8: q ^ 0x80 = q + 128; int4 nibbles: q + 8), the offset taken back per block as
// `offset * sum(xq)`.
template <int kRows, int kBits, bool kE2M1 = false>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const QProblem& p, int64_t g, int64_t row0) {
  constexpr int64_t weight_bytes = kBits == 8 ? 512 : 256;
  constexpr int offset = kBits == 8 ? 128 : kE2M1 ? kE2M1Offset : 8;  // MXFP4: its codes looked up as value + 12
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < p.k_blocks; ++b) {
    const uint8_t* wb = p.q + (g * p.k_blocks + b) * weight_bytes;
    __m512i w[8];
    if constexpr (kBits == 8) {
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int c = 0; c < 8; ++c) w[c] = _mm512_xor_si512(_mm512_loadu_si512(wb + 64 * c), flip);
    } else {
      const __m512i low = _mm512_set1_epi8(0x0F);
      const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kE2M1Unsigned)));
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * c);
        w[c] = _mm512_and_si512(v, low);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (kE2M1) w[c] = _mm512_shuffle_epi8(table, w[c]), w[c + 4] = _mm512_shuffle_epi8(table, w[c + 4]);
      }
    }
    const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scale + (g * p.k_blocks + b) * kGroup));
    const __m512 sw = p.f16_scale ? _mm512_cvtph_ps(s16) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s16), 16));
    for (int r = 0; r < kRows; ++r) {
      const int64_t at = (row0 + r) * p.k_blocks + b;
      const int32_t* xb = reinterpret_cast<const int32_t*>(p.xq + at * kBlock);
      __m512i dot = _mm512_set1_epi32(-offset * p.xsum[at]);
      for (int c = 0; c < 8; ++c) dot = _mm512_dpbusd_epi32(dot, w[c], _mm512_set1_epi32(xb[c]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, _mm512_set1_ps(p.xs[at])), acc[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(p.y + (row0 + r) * p.groups * kGroup + g * kGroup, acc[r]);
}

template <int kBits, bool kE2M1 = false>
void qgroups(const QProblem& p, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t row = 0;
    for (; row + 8 <= p.m; row += 8) tile_vnni<8, kBits, kE2M1>(p, g, row);
    if (row < p.m) with_rows<7>(p.m - row, [&](auto rows) { tile_vnni<decltype(rows)::value, kBits, kE2M1>(p, g, row); });
  }
}

// KProblem's formats on VNNI: per group and block, the 8 chunks' codes (4-bit, with a fifth bit, or
// Q6_K's fifth and sixth, shifted into bit 4 as the AVX2 path does) are the unsigned operand of 8
// vpdpbusd per row. Per row, a super-block's blocks add up in two float sums, Σ xs · sub-scale · dot
// and Σ xs · sum(xq) · sub-min (Q6_K: each half's dot - 32 · its sum(xq), times its scale, in int32),
// which the super-block's d and dmin scale once: the float work per block is the sub-scales'
// widening and two FMAs a row (it was a quarter of the time with d and dmin applied per block).
// The 4-bit formats' high nibbles are used in place (v & 0xF0, 16 · code), their chain's sum shifted
// back by 4 bits: one instruction fewer per chunk. (Tiles of two groups sharing x's broadcasts were
// slower in a model's decode: TinyLlama's Q4_K_M matrices a token, 21 ms against 17.6 for one group.)
template <int kRows, int kKind>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void ktile_vnni(const KProblem& p, int64_t g, int64_t row0) {
  constexpr int bits = k_bits(kKind), per = k_per(kKind);
  constexpr bool subs = kKind <= kQ6K;
  const __m512i low = _mm512_set1_epi8(0x0F), high_nibble = _mm512_set1_epi8(static_cast<char>(0xF0)),
                fifth = _mm512_set1_epi8(0x10), sixth = _mm512_set1_epi8(0x30);
  // one shift brings bits 2c, 2c + 1 of every byte to bits 4, 5 (the mask then drops what crossed in
  // from the other byte of the 16-bit lane)
  const auto to_bits_4_5 = [](__m512i v, int c) {
    return c == 2 ? v : c < 2 ? _mm512_slli_epi16(v, 4 - 2 * c) : _mm512_srli_epi16(v, 2 * c - 4);
  };
  const auto widen = [](const uint8_t* at) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))); };
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b0 = 0; b0 < p.k_blocks; b0 += per) {
    __m512 scaled[kRows], mins[kRows];  // the super-block's two sums
    for (int r = 0; r < kRows; ++r) scaled[r] = mins[r] = _mm512_setzero_ps();
    for (int64_t b = b0; b < b0 + per; ++b) {
      const uint8_t* wb = p.block(g, b);
      __m512i w[8];
      const __m512i high = bits >= 5 ? _mm512_loadu_si512(wb + 256) : _mm512_setzero_si512();
      const __m512i higher = bits == 6 ? _mm512_loadu_si512(wb + 320) : _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * c);
        w[c] = _mm512_and_si512(v, low);
        if constexpr (bits == 4) {
          w[c + 4] = _mm512_and_si512(v, high_nibble);
        } else {
          w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        if constexpr (bits == 5) {  // bit c (c + 4) of each byte to bit 4
          w[c] = _mm512_or_si512(w[c], _mm512_and_si512(_mm512_slli_epi16(high, 4 - c), fifth));
          w[c + 4] = _mm512_or_si512(w[c + 4], _mm512_and_si512(c == 0 ? high : _mm512_srli_epi16(high, c), fifth));
        }
        if constexpr (bits == 6) {  // bits 2c, 2c + 1 to bits 4, 5: w | (shifted & 0x30), one vpternlogd
          w[c] = _mm512_ternarylogic_epi32(w[c], to_bits_4_5(high, c), sixth, 0xF8);
          w[c + 4] = _mm512_ternarylogic_epi32(w[c + 4], to_bits_4_5(higher, c), sixth, 0xF8);
        }
      }
      const uint8_t* sub = subs ? p.subs(g, b) : nullptr;
      __m512 scale = _mm512_set1_ps(1.f), min = _mm512_set1_ps(1.f);  // the sub-scales, as floats
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();  // Q6_K's
      if constexpr (kKind == kQ6K) {
        s0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub)));
        s1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub + kGroup)));
      } else if constexpr (subs) {
        scale = widen(sub);
        min = widen(sub + kGroup);
      }
      for (int r = 0; r < kRows; ++r) {
        const int64_t at = (row0 + r) * p.k_blocks + b;
        const int32_t* xb = reinterpret_cast<const int32_t*>(p.xq + at * kBlock);
        __m512i dot = _mm512_setzero_si512(), other = _mm512_setzero_si512();  // two chains: half the latency
        if constexpr (kKind == kQ6K) {
          dot = _mm512_set1_epi32(-32 * p.xhalf[at]);
          other = _mm512_set1_epi32(-32 * (p.xsum[at] - p.xhalf[at]));
        }
        for (int c = 0; c < 4; ++c) {
          dot = _mm512_dpbusd_epi32(dot, w[c], _mm512_set1_epi32(xb[c]));
          other = _mm512_dpbusd_epi32(other, w[c + 4], _mm512_set1_epi32(xb[c + 4]));
        }
        const __m512 xs = _mm512_set1_ps(p.xs[at]);
        if constexpr (kKind == kQ6K) {  // the halves, each by its scale
          const __m512i both = _mm512_add_epi32(_mm512_mullo_epi32(dot, s0), _mm512_mullo_epi32(other, s1));
          scaled[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(both), xs, scaled[r]);
          continue;
        }
        if constexpr (bits == 4) other = _mm512_srai_epi32(other, 4);  // 16 · code, exactly
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(dot, other));
        scaled[r] = _mm512_fmadd_ps(sum, subs ? _mm512_mul_ps(scale, xs) : xs, scaled[r]);
        const __m512 xmin = _mm512_set1_ps(p.xs[at] * static_cast<float>(p.xsum[at]));
        mins[r] = subs ? _mm512_fmadd_ps(min, xmin, mins[r]) : _mm512_add_ps(mins[r], xmin);
      }
    }
    const uint16_t* super = p.supers(g, b0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super)));
    __m512 dmin = _mm512_setzero_ps();
    if constexpr (kKind == kQ5_0) dmin = _mm512_mul_ps(d, _mm512_set1_ps(16.f));
    if constexpr (kKind != kQ5_0 && kKind != kQ6K) dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(super + kGroup)));
    for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fnmadd_ps(dmin, mins[r], _mm512_fmadd_ps(d, scaled[r], acc[r]));
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(p.y + (row0 + r) * p.groups * kGroup + g * kGroup, acc[r]);
}

template <int kKind>
void kgroups(const KProblem& p, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t row = 0;
    for (; row + 8 <= p.m; row += 8) ktile_vnni<8, kKind>(p, g, row);
    if (row < p.m) with_rows<7>(p.m - row, [&](auto rows) { ktile_vnni<decltype(rows)::value, kKind>(p, g, row); });
  }
}

// ----------------------------------------------------------------------------------------- float
// 16 floats → bfloat16 bits in the low half of each lane, rounded as round_to_bf16
inline __m512i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
}

void round_values(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i hi = round_bf16(_mm512_loadu_ps(x + i));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
  }
  for (; i < n; ++i) out[i] = round_to_bf16(x[i]);
}

#if defined(JAXINFER_AVX512_BF16)
// x rounded as round_to_bf16, kept as the bfloat16 bits `dtile` reads two at a time
void round_bits(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(round_bf16(_mm512_loadu_ps(x + i))));
  for (; i < n; ++i) {
    const float v = round_to_bf16(x[i]);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
}

// ftile for bfloat16 weights and x rounded to bfloat16 (`bf16_inputs`) on AVX512-BF16: VDPBF16PS
// multiplies each lane's pair of weights (k, k + 1) by x's pair exactly and adds both to the lane's
// float32 sum, so one instruction advances 16 dots by two inputs, with neither the pair's widening
// nor a second FMA.
template <int kRows, int kCols>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void dtile(const FProblem& p, int64_t g, int64_t row0, int64_t k0, int64_t k1,
                                                                           const simd::Fetch& fetch) {
  __m512 acc[kRows][kCols];
  simd::load_sums<Avx512>(p, g, row0, k0, acc);
  const uint16_t* x = p.x_bf16 + row0 * p.k;
  const simd::Fetcher<true, kCols> fetcher(p, fetch, k1 - k0);
  for (int64_t k = k0; k < k1; k += 2) {
    if (fetch.n) fetcher.template at<2>(k - k0), fetcher.template at<2>(k - k0 + 1);  // the blocks' fetch (frows): into L2
    __m512bh w[kCols];
    for (int c = 0; c < kCols; ++c) w[c] = (__m512bh)_mm512_loadu_si512(simd::group_at<true>(p.w, g + c, k, p.k));
    for (int r = 0; r < kRows; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * p.k + k, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], xv);
    }
  }
  simd::store_sums<Avx512>(p, g, row0, acc);
}
#endif

// Tiles of 6 rows by 4 groups: 24 sums in the 32 registers.
template <bool kBf16, bool kDot>
void fgroups(const FProblem& p, int64_t g0, int64_t g1) {
  simd::fgroups_in_tiles<6, 4>(p, g0, g1, [&p](auto rows, auto cols, int64_t g, int64_t row0, int64_t k0, int64_t k1, const simd::Fetch& fetch) {
    constexpr int kRows = decltype(rows)::value, kCols = decltype(cols)::value;
#if defined(JAXINFER_AVX512_BF16)
    if constexpr (kDot) return dtile<kRows, kCols>(p, g, row0, k0, k1, fetch);
#endif
    simd::ftile<Avx512, kRows, kCols, kBf16>(p, g, row0, k0, k1, fetch);
  });
}

#if defined(JAXINFER_AMX)
// bfloat16 weights, many rows (prefill chunks): AMX tiles. TDPBF16PS multiplies bfloat16 pairs
// exactly and sums in float32, so x is carried as two bfloat16 parts, x ≈ hi + lo with hi = bf16(x)
// and lo = bf16(x - hi): 16 significant bits (|x - hi - lo| ≤ 2^-16 |x|), where one part alone
// errs by 2^-8 (measured on TinyLlama's 2048×5632: largest error 2.7e-5 for float32 FMAs, 2.7e-5 for
// two parts, 2.1e-2 for one). A model whose products take bfloat16 inputs (`bf16_inputs`,
// `ModelConfig.matmul_inputs`, as PyTorch's bfloat16 runs) has hi alone, one pass instead of two:
// SmolLM-135M's matrices over a 512-token prompt in 80 ms instead of 128.
//
// A tile is 16 rows of 64 bytes. A (activations): 16 rows × 32 k, packed per call contiguous per
// tile as [part][rows/16][k/32][16][32] (loading them from x's rows with a long stride measured 1.7×
// slower at K = 2048). B (weights): 16 k-pairs × 16 outputs × 2, read in place from the packed
// weights; a K that is not a multiple of 32 leaves a last block of fewer pairs, copied with zeros
// after it. C: 2 × 2 tiles of 16 rows × 16 outputs, float32. Rows are padded to 32 with zeros.
constexpr int64_t kAmxChunkGroups = 16;
constexpr int64_t kAmxPassBlocks = 64;  // 2048 k: 16 groups' weights, 1 MiB, in a 2 MiB L2
constexpr int kParts = 2;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

struct AmxProblem {
  const uint16_t* a;  // [parts][mp/16][kp/32][16][32]
  const uint16_t* w;  // [groups, k/2, 16, 2]
  float* y;
  int64_t m, k, kp, mp, groups;
  int parts;  // kParts, or 1 for bfloat16 inputs
};

// Rows [r0, r1) of 16 into their tiles: each float → hi, lo bfloat16 (hi alone in one part).
void pack_a_amx(const float* x, const AmxProblem& p, uint16_t* a, int64_t r0, int64_t r1) {
  const int64_t kb = p.kp / 32, part = p.mp * p.kp;
  for (int64_t row = r0 * 16; row < r1 * 16; ++row) {
    uint16_t* hi_row = a + ((row / 16) * kb * 16 + row % 16) * 32;
    for (int64_t k0 = 0; k0 < p.kp; k0 += 16) {
      __m512 v = _mm512_setzero_ps();
      if (row < p.m && k0 < p.k) {
        const __mmask16 valid = p.k - k0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (p.k - k0)) - 1);
        v = _mm512_maskz_loadu_ps(valid, x + row * p.k + k0);
      }
      const __m512i hi = round_bf16(v);
      uint16_t* at = hi_row + (k0 / 32) * 512 + k0 % 32;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), _mm512_cvtepi32_epi16(hi));
      if (p.parts == 1) continue;
      const __m512i lo = round_bf16(_mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(at + part), _mm512_cvtepi32_epi16(lo));
    }
  }
}

// The 2 × 2 C tiles (0–3) from / to 32 rows × 32 floats at `at`, `stride` floats apart.
__attribute__((target("amx-tile"), always_inline)) inline void load_c(const float* at, int64_t stride) {
  _tile_loadd(0, at, stride * 4);
  _tile_loadd(1, at + 16, stride * 4);
  _tile_loadd(2, at + 16 * stride, stride * 4);
  _tile_loadd(3, at + 16 * stride + 16, stride * 4);
}

__attribute__((target("amx-tile"), always_inline)) inline void store_c(float* at, int64_t stride) {
  _tile_stored(0, at, stride * 4);
  _tile_stored(1, at + 16, stride * 4);
  _tile_stored(2, at + 16 * stride, stride * 4);
  _tile_stored(3, at + 16 * stride + 16, stride * 4);
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw"))) void amx_groups(const AmxProblem& p, int64_t g0, int64_t g1) {
  const int64_t kb = p.kp / 32, full = p.k / 32, part = p.mp * p.kp, n = p.groups * kGroup, depth = p.k / 2 * 32;
  thread_local std::vector<uint16_t> tail;  // the last, short block of pairs of each group, zero-padded
  if (full < kb) {
    tail.assign(static_cast<size_t>((g1 - g0) * 512), 0);
    for (int64_t g = g0; g < g1; ++g)
      std::memcpy(tail.data() + (g - g0) * 512, p.w + g * depth + full * 512, (p.k - full * 32) * 16 * sizeof(uint16_t));
  }
  auto block = [&](int64_t g, int64_t i) { return i < full ? p.w + g * depth + i * 512 : tail.data() + (g - g0) * 512; };
  // Deep matrices go in passes of kAmxPassBlocks k-blocks, so that a pass's weights of the chunk stay
  // in L2 while every row block runs over them; between passes the sums wait in `acc`.
  const int64_t passes = (kb + kAmxPassBlocks - 1) / kAmxPassBlocks, width = (g1 - g0 + 1) / 2 * 2 * kGroup;
  thread_local std::vector<float> acc;
  if (passes > 1) acc.resize(static_cast<size_t>(p.mp * width));
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
  alignas(64) float spill[32][32];
  for (int64_t pass = 0; pass < passes; ++pass) {
    const int64_t i0 = pass * kAmxPassBlocks, i1 = std::min(kb, i0 + kAmxPassBlocks);
    for (int64_t row = 0; row < p.mp; row += 32) {
      const uint16_t* a0 = p.a + (row / 16) * kb * 512;
      const uint16_t* a1 = a0 + kb * 512;
      for (int64_t g = g0; g < g1; g += 2) {
        const int64_t second = std::min(g + 1, g1 - 1);  // an odd last group is multiplied twice, stored once
        float* sums = passes > 1 ? acc.data() + row * width + (g - g0) * kGroup : nullptr;  // acc is empty in one pass
        if (pass == 0) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
        } else {
          load_c(sums, width);
        }
        for (int64_t i = i0; i < i1; ++i) {
          _tile_loadd(6, block(g, i), 64);
          _tile_loadd(7, block(second, i), 64);
          for (int s = 0; s < p.parts; ++s) {
            _tile_loadd(4, a0 + s * part + i * 512, 64);
            _tile_loadd(5, a1 + s * part + i * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        float* out = p.y + row * n + g * kGroup;
        const int64_t cols = (second > g ? 2 : 1) * kGroup;
        if (pass + 1 < passes) {
          store_c(sums, width);
        } else if (row + 32 <= p.m && second > g) {
          store_c(out, n);
        } else {  // the last rows, or an odd group: through a spill
          store_c(&spill[0][0], 32);
          for (int64_t r = 0; r < 32 && row + r < p.m; ++r) std::memcpy(out + r * n, spill[r], cols * sizeof(float));
        }
      }
    }
  }
  _tile_release();
}

// The AMX path of FMatmul: x packed into tiles, then chunks of whole pairs of groups (at most 16
// groups, at least two chunks a thread) shared out.
void amx_matmul(ffi::ThreadPool& pool, const float* x, const uint16_t* w, float* y, int64_t m, int64_t k, int64_t groups, bool bf16_inputs) {
  const int64_t kp = (k + 31) / 32 * 32, mp = (m + 31) / 32 * 32;
  thread_local std::vector<uint16_t> kept;  // a fresh one faulted in up to 11 MiB of pages a call
  const int parts = bf16_inputs ? 1 : kParts;
  kept.resize(static_cast<size_t>(parts * mp * kp));
  uint16_t* a = kept.data();  // by name, a thread_local is each thread's own: the pool gets the pointer
  const AmxProblem problem{a, w, y, m, k, kp, mp, groups, parts};
  parallel_items(pool, mp / 16, 16 * kp * 4, [&problem, x, a](int64_t r0, int64_t r1) { pack_a_amx(x, problem, a, r0, r1); });
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = std::clamp<int64_t>((groups + 2 * threads - 1) / (2 * threads), 2, kAmxChunkGroups) / 2 * 2;
  const int64_t chunks = (groups + per - 1) / per;
  parallel_items(pool, chunks, int64_t{1} << 20, [&problem, per](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) amx_groups(problem, c * per, std::min(problem.groups, (c + 1) * per));
  });
}
#endif


}  // namespace

void add_avx512(Paths& t, bool amx) {
  const Cpu& has = cpu();
  if (!has.avx512) return;
  t.name = "avx512";
  t.fgroups[0] = fgroups<false, false>;
  t.fgroups[1] = fgroups<true, false>;
  t.round = round_values;
  simd::add_attention<Avx512>(t);
  if (has.avx512_vnni) {
    t.name += "-vnni";
    t.quantize_rows = quantize_rows;
    t.qgroups[0] = qgroups<8>;
    t.qgroups[1] = qgroups<4>;
    t.qgroups[2] = qgroups<4, true>;
    t.kgroups[kQ4K] = kgroups<kQ4K>;
    t.kgroups[kQ5K] = kgroups<kQ5K>;
    t.kgroups[kQ6K] = kgroups<kQ6K>;
    t.kgroups[kQ4_1] = kgroups<kQ4_1>;
    t.kgroups[kQ5_1] = kgroups<kQ5_1>;
    t.kgroups[kQ5_0] = kgroups<kQ5_0>;
  }
#if defined(JAXINFER_AVX512_BF16)
  if (has.avx512_bf16) {
    t.name += "-bf16";
    t.bf16_dot = fgroups<true, true>;
    t.round_bits = round_bits;
  }
#endif
#if defined(JAXINFER_AMX)
  if (amx && has.amx) {
    t.name += "-amx";
    t.amx = amx_matmul;
  }
#endif
}

}  // namespace jaxinfer

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
#include "paths.h"

void jaxinfer::add_avx512(Paths&, bool) {}  // not an x86 CPU
#endif
