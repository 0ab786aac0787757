// The ARM family (aarch64: Apple Silicon, Graviton, Ampere, Raspberry Pi): float tiles and attention on
// 4-float NEON vectors (simd.h), NEON being every aarch64 CPU's; int8/int4 on SDOT where the CPU has
// the dot-product extension (ARMv8.2's: Apple M1, Graviton 2, Cortex-A76 on), otherwise on SMULL and
// SADALP. `JAXINFER_ISA=neon` takes the paths without SDOT on a CPU that has it.
#if defined(__aarch64__)
#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "paths.h"
#include "simd.h"

namespace jaxinfer {
namespace {

struct Neon {
  using F = float32x4_t;
  using Mask = uint32x4_t;  // all ones in a lane that is in
  static constexpr int L = 4, kRegisters = 32;

  static F load(const float* a) { return vld1q_f32(a); }
  static F load_aligned(const float* a) { return vld1q_f32(a); }
  static void store(float* a, F v) { vst1q_f32(a, v); }
  static void store_aligned(float* a, F v) { vst1q_f32(a, v); }
  static F zero() { return vdupq_n_f32(0.f); }
  static F set1(float v) { return vdupq_n_f32(v); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F max(F a, F b) { return vmaxq_f32(a, b); }
  static F abs(F a) { return vabsq_f32(a); }
  static F copysign(F magnitude, F sign) { return vbslq_f32(vdupq_n_u32(0x80000000u), sign, magnitude); }
  // as Avx512::exp; 2^n built in the exponent bits (n >= -126 for x >= -87.3: a normal float)
  static F exp(F x) {
    x = vmaxq_f32(x, vdupq_n_f32(-87.3f));
    const F n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    const int32x4_t two_n = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    return vmulq_f32(simd::exp_polynomial<Neon>(x, n), vreinterpretq_f32_s32(two_n));
  }
  static float reduce_max(F v) { return vmaxvq_f32(v); }
  static float reduce_add(F v) { return vaddvq_f32(v); }
  static F widen(const uint16_t* a) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(a), 16)); }
  static F widen_int8(const int8_t* a) {
    int32_t four;
    std::memcpy(&four, a, 4);
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(four))))));
  }
  static F widen_pairs(const uint16_t* a, bool second) {
    const uint32x4_t pair = vld1q_u32(reinterpret_cast<const uint32_t*>(a));
    return vreinterpretq_f32_u32(second ? vandq_u32(pair, vdupq_n_u32(0xFFFF0000u)) : vshlq_n_u32(pair, 16));
  }
  static Mask in_range(int32_t first, int32_t lo, int32_t up) {
    static const int32_t lanes[4] = {0, 1, 2, 3};
    const int32x4_t s = vaddq_s32(vdupq_n_s32(first), vld1q_s32(lanes));
    return vandq_u32(vcgtq_s32(s, vdupq_n_s32(lo)), vcgtq_s32(vdupq_n_s32(up), s));
  }
  static F max_where(F a, Mask m, F v) { return vbslq_f32(m, vmaxq_f32(a, v), a); }
  static F where(Mask m, F v) { return vreinterpretq_f32_u32(vandq_u32(m, vreinterpretq_u32_f32(v))); }

  // r[0..3] (4 keys' values at 4 dims) -> r[i] = dim i of the 4 keys.
  static void transpose(F r[4]) {
    const F t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]), t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    auto low = [](F a, F b) { return vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(a), vreinterpretq_f64_f32(b))); };
    auto high = [](F a, F b) { return vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(a), vreinterpretq_f64_f32(b))); };
    r[0] = low(t0, t2), r[1] = low(t1, t3), r[2] = high(t0, t2), r[3] = high(t1, t3);
  }
};

// ------------------------------------------------------------------------------------- quantized
// As the portable path's arithmetic: FCVTNS rounds to nearest even, as nearbyint.
void quantize_rows(const float* x, int64_t m, int64_t k_blocks, int8_t* xq, float* xs, int32_t* xsum) {
  for (int64_t at = 0; at < m * k_blocks; ++at) {
    float32x4_t v[8];
    float32x4_t top = vdupq_n_f32(0.f);
    for (int i = 0; i < 8; ++i) top = vmaxq_f32(top, vabsq_f32(v[i] = vld1q_f32(x + at * kBlock + 4 * i)));
    const float amax = vmaxvq_f32(top);
    const float32x4_t inverse = vdupq_n_f32(amax > 0.f ? 127.f / amax : 0.f);
    int32x4_t sum = vdupq_n_s32(0);
    for (int i = 0; i < 8; i += 2) {
      const int32x4_t q0 = vcvtnq_s32_f32(vmulq_f32(v[i], inverse)), q1 = vcvtnq_s32_f32(vmulq_f32(v[i + 1], inverse));
      sum = vaddq_s32(sum, vaddq_s32(q0, q1));
      vst1_s8(xq + at * kBlock + 4 * i, vqmovn_s16(vcombine_s16(vqmovn_s32(q0), vqmovn_s32(q1))));
    }
    xs[at] = amax / 127.f;
    xsum[at] = vaddvq_s32(sum);
  }
}

// 4 of a block's scales as float32: bfloat16 widened, or float16 converted (FCVTL, base ARMv8)
inline float32x4_t widen_scale(const QProblem& p, const uint16_t* s) {
  return p.f16_scale ? vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(s))) : Neon::widen(s);
}

// A block's weights for a group (the layout: matmul.cc): int8, per chunk c of 4 inputs, 16 outputs'
// 4 bytes, so vector j of chunk c is outputs 4j..4j+3 at inputs 4c..4c+3; int4, the same for chunks
// 0..3 with chunk c + 4 in the high nibbles, each nibble q + 8. The int4 dots take the nibbles as
// they are and subtract 8 · sum(xq) once per block, as the AVX2 path does.
//
// SDOT's intrinsics only in functions compiled for it; the rest of the file is base ARMv8. (GCC 12
// refused "+dotprod" alone for these templates' intrinsics; every CPU with SDOT is ARMv8.2 or later.)
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif

// SDOT: each instruction adds 4 outputs' 4-input dots into int32; kRows rows by a group, each weight
// vector loaded once for the rows, x's chunk broadcast (LD1R) to meet it.
// MXFP4 (kE2M1): the codes looked up (TBL) as their values + 12, the offset 12 · sum(xq).
template <int kRows, int kBits, bool kE2M1 = false>
void qtile_dot(const QProblem& p, int64_t g, int64_t row0) {
  constexpr int64_t weight_bytes = kBits == 8 ? 512 : 256;
  const uint8x16_t table = vld1q_u8(kE2M1Unsigned);
  float32x4_t acc[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < p.k_blocks; ++b) {
    const uint8_t* wb = p.q + (g * p.k_blocks + b) * weight_bytes;
    const int32_t* xb[kRows];
    int32x4_t dot[kRows][4];
    for (int r = 0; r < kRows; ++r) {
      xb[r] = reinterpret_cast<const int32_t*>(p.xq + ((row0 + r) * p.k_blocks + b) * kBlock);
      for (int j = 0; j < 4; ++j) dot[r][j] = vdupq_n_s32(0);
    }
    for (int c = 0; c < (kBits == 8 ? 8 : 4); ++c) {
      int8x16_t x[kRows], xh[kRows];  // chunk c's 4 inputs in every lane (int4: and chunk c + 4's)
      for (int r = 0; r < kRows; ++r) {
        x[r] = vreinterpretq_s8_s32(vld1q_dup_s32(xb[r] + c));
        if constexpr (kBits == 4) xh[r] = vreinterpretq_s8_s32(vld1q_dup_s32(xb[r] + c + 4));
      }
      for (int j = 0; j < 4; ++j) {
        const uint8x16_t v = vld1q_u8(wb + 64 * c + 16 * j);
        if constexpr (kBits == 8) {
          for (int r = 0; r < kRows; ++r) dot[r][j] = vdotq_s32(dot[r][j], vreinterpretq_s8_u8(v), x[r]);
        } else {
          uint8x16_t low = vandq_u8(v, vdupq_n_u8(0x0F)), high = vshrq_n_u8(v, 4);
          if constexpr (kE2M1) low = vqtbl1q_u8(table, low), high = vqtbl1q_u8(table, high);
          const int8x16_t first = vreinterpretq_s8_u8(low), second = vreinterpretq_s8_u8(high);
          for (int r = 0; r < kRows; ++r) dot[r][j] = vdotq_s32(vdotq_s32(dot[r][j], first, x[r]), second, xh[r]);
        }
      }
    }
    const uint16_t* scale = p.scale + (g * p.k_blocks + b) * kGroup;
    for (int r = 0; r < kRows; ++r) {
      const float xs = p.xs[(row0 + r) * p.k_blocks + b];
      const int32x4_t offset = vdupq_n_s32(kBits == 8 ? 0 : (kE2M1 ? kE2M1Offset : 8) * p.xsum[(row0 + r) * p.k_blocks + b]);
      for (int j = 0; j < 4; ++j)
        acc[r][j] = vfmaq_f32(acc[r][j], vcvtq_f32_s32(vsubq_s32(dot[r][j], offset)), vmulq_n_f32(widen_scale(p, scale + 4 * j), xs));
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < 4; ++j) vst1q_f32(p.y + (row0 + r) * p.groups * kGroup + g * kGroup + 4 * j, acc[r][j]);
}

template <int kBits, bool kE2M1 = false>
void qgroups_dot(const QProblem& p, int64_t g0, int64_t g1) {
  groups_in_row_pairs(g0, g1, p.m, [&](int64_t g, int64_t row, auto rows) { qtile_dot<decltype(rows)::value, kBits, kE2M1>(p, g, row); });
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// Without SDOT (ARMv8.0: Cortex-A72, Graviton 1): SMULL makes 8 int16 products of two outputs' 4
// inputs (|w x| <= 127 · 127 for int8, 15 · 127 for int4 nibbles) and SADALP adds their pairs into
// int32, so each output's two partial sums sit side by side until ADDP adds them after the block.
// One row at a time: 8 pair sums and 4 float sums.
template <int kBits, bool kE2M1 = false>
void qtile_mull(const QProblem& p, int64_t g, int64_t row) {
  constexpr int64_t weight_bytes = kBits == 8 ? 512 : 256;
  const uint8x16_t table = vld1q_u8(kE2M1Unsigned);  // MXFP4: its codes as value + 12 (|w x| <= 24 · 127)
  float32x4_t acc[4];
  for (int j = 0; j < 4; ++j) acc[j] = vdupq_n_f32(0.f);
  for (int64_t b = 0; b < p.k_blocks; ++b) {
    const int8_t* wb = reinterpret_cast<const int8_t*>(p.q + (g * p.k_blocks + b) * weight_bytes);
    const int32_t* xb = reinterpret_cast<const int32_t*>(p.xq + (row * p.k_blocks + b) * kBlock);
    int32x4_t pairs[8];  // [2j]: outputs 4j and 4j + 1, two partial sums each; [2j + 1]: 4j + 2, 4j + 3
    for (int i = 0; i < 8; ++i) pairs[i] = vdupq_n_s32(0);
    auto add = [&](int j, int8x16_t w, int8x8_t x) {
      pairs[2 * j] = vpadalq_s16(pairs[2 * j], vmull_s8(vget_low_s8(w), x));
      pairs[2 * j + 1] = vpadalq_s16(pairs[2 * j + 1], vmull_s8(vget_high_s8(w), x));
    };
    for (int c = 0; c < (kBits == 8 ? 8 : 4); ++c) {
      const int8x8_t x = vreinterpret_s8_s32(vdup_n_s32(xb[c]));  // the chunk's 4 inputs, twice
      for (int j = 0; j < 4; ++j) {
        if constexpr (kBits == 8) {
          add(j, vld1q_s8(wb + 64 * c + 16 * j), x);
        } else {
          const uint8x16_t v = vld1q_u8(reinterpret_cast<const uint8_t*>(wb) + 64 * c + 16 * j);
          uint8x16_t low = vandq_u8(v, vdupq_n_u8(0x0F)), high = vshrq_n_u8(v, 4);
          if constexpr (kE2M1) low = vqtbl1q_u8(table, low), high = vqtbl1q_u8(table, high);
          add(j, vreinterpretq_s8_u8(low), x);
          add(j, vreinterpretq_s8_u8(high), vreinterpret_s8_s32(vdup_n_s32(xb[c + 4])));
        }
      }
    }
    const uint16_t* scale = p.scale + (g * p.k_blocks + b) * kGroup;
    const float xs = p.xs[row * p.k_blocks + b];
    const int32x4_t offset = vdupq_n_s32(kBits == 8 ? 0 : (kE2M1 ? kE2M1Offset : 8) * p.xsum[row * p.k_blocks + b]);
    for (int j = 0; j < 4; ++j) {
      const int32x4_t dot = vsubq_s32(vpaddq_s32(pairs[2 * j], pairs[2 * j + 1]), offset);
      acc[j] = vfmaq_f32(acc[j], vcvtq_f32_s32(dot), vmulq_n_f32(widen_scale(p, scale + 4 * j), xs));
    }
  }
  for (int j = 0; j < 4; ++j) vst1q_f32(p.y + row * p.groups * kGroup + g * kGroup + 4 * j, acc[j]);
}

template <int kBits, bool kE2M1 = false>
void qgroups_mull(const QProblem& p, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t row = 0; row < p.m; ++row) qtile_mull<kBits, kE2M1>(p, g, row);
}

// ----------------------------------------------------------------------------------------- float
void round_values(const float* x, float* out, int64_t n) {  // as round_to_bf16
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const uint32x4_t bits = vreinterpretq_u32_f32(vld1q_f32(x + i));
    const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    const uint32x4_t rounded = vaddq_u32(bits, vaddq_u32(vdupq_n_u32(0x7FFF), odd));
    vst1q_f32(out + i, vreinterpretq_f32_u32(vandq_u32(rounded, vdupq_n_u32(0xFFFF0000u))));
  }
  for (; i < n; ++i) out[i] = round_to_bf16(x[i]);
}

}  // namespace

void add_neon(Paths& t, bool dotprod) {
  t.name = "neon";
  t.quantize_rows = quantize_rows;
  if (dotprod && cpu().dotprod) {
    t.name += "-dotprod";
    t.qgroups[0] = qgroups_dot<8>;
    t.qgroups[1] = qgroups_dot<4>;
    t.qgroups[2] = qgroups_dot<4, true>;
  } else {
    t.qgroups[0] = qgroups_mull<8>;
    t.qgroups[1] = qgroups_mull<4>;
    t.qgroups[2] = qgroups_mull<4, true>;
  }
  t.fgroups[0] = simd::fgroups_narrow<Neon, false>;
  t.fgroups[1] = simd::fgroups_narrow<Neon, true>;
  t.round = round_values;
  simd::add_attention<Neon>(t);
}

}  // namespace jaxinfer
#else
#include "paths.h"

void jaxinfer::add_neon(Paths&, bool) {}  // not an ARM CPU
#endif
