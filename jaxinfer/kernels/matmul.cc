// y[M, N] = x[M, K] @ W[N, K]^T on the CPU, as XLA FFI custom calls: `jaxinfer_qmatmul` for
// block-quantized W (`jaxinfer.quant`) and `jaxinfer_fmatmul` for float32/bfloat16 W
// (`jaxinfer.packed`, further down). Both keep 16 outputs side by side and share out the groups of
// 16 between this thread and XLA's pool.
//
// Quantized: a custom call because XLA CPU never sends a dot with M == 1 to its int8
// kernels and rebuilds the float weight when dequantizing in the graph (../shared/JAX-ON-CPU.md).
// Like llama.cpp's q8_0 it is W8A8: each row of x is quantized per block of 32 to int8 with one
// float scale, and each block's dot is an integer dot.
//
// Layout (written by quant.quantize): 16 outputs ("a group") side by side, so one 64-byte vector holds
// 4 consecutive k of 16 outputs and `vpdpbusd` with 4 broadcast activation bytes advances all 16
// dots at once, with no horizontal sums:
//   int8: q [N/16, K/32, 8, 16, 4] int8;  int4: q [N/16, K/32, 4, 16, 4] uint8, nibble j of byte
//   (c, n, i) being k = 4 (c + 4 j) + i;  scale [N/16, K/32, 16] bfloat16.
// int8 weights are read as unsigned (q ^ 0x80 = q + 128) and int4 nibbles are q + 8, so every
// weight byte is an unsigned operand and the offset comes back as `offset * sum(xq)` per block.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxinfer {
namespace {

constexpr int kBlock = 32;  // k per scale
constexpr int kGroup = 16;  // outputs side by side

struct Problem {
  const float* x;
  const uint8_t* q;
  const uint16_t* scale;  // bfloat16 bits
  float* y;
  int64_t m, k_blocks, groups;
  int bits;
  // activations quantized per block: values, scales, and sums of the int8 values
  const int8_t* xq;
  const float* xs;
  const int32_t* xsum;
};


void quantize_rows(const float* x, int64_t m, int64_t k_blocks, int8_t* xq, float* xs, int32_t* xsum) {
  for (int64_t row = 0; row < m; ++row) {
    for (int64_t b = 0; b < k_blocks; ++b) {
      const float* v = x + (row * k_blocks + b) * kBlock;
      float amax = 0.f;
      for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float scale = amax / 127.f;
      const float inverse = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* out = xq + (row * k_blocks + b) * kBlock;
      int32_t sum = 0;
      for (int i = 0; i < kBlock; ++i) {
        out[i] = static_cast<int8_t>(std::nearbyint(v[i] * inverse));  // ties to even, as jnp.round
        sum += out[i];
      }
      xs[row * k_blocks + b] = scale;
      xsum[row * k_blocks + b] = sum;
    }
  }
}

// Portable path: any CPU.
void groups_generic(const Problem& p, int64_t g0, int64_t g1) {
  const int64_t weight_bytes = p.bits == 8 ? 512 : 256;  // per group and block
  const int offset = p.bits == 8 ? 128 : 8;
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t row = 0; row < p.m; ++row) {
      float acc[kGroup] = {};
      for (int64_t b = 0; b < p.k_blocks; ++b) {
        const uint8_t* w = p.q + (g * p.k_blocks + b) * weight_bytes;
        const int8_t* xb = p.xq + (row * p.k_blocks + b) * kBlock;
        int32_t dot[kGroup];
        for (int n = 0; n < kGroup; ++n) dot[n] = -offset * p.xsum[row * p.k_blocks + b];
        for (int c = 0; c < 8; ++c) {
          for (int n = 0; n < kGroup; ++n) {
            for (int i = 0; i < 4; ++i) {
              int u;
              if (p.bits == 8) {
                u = w[(c * kGroup + n) * 4 + i] ^ 0x80;
              } else {
                const uint8_t byte = w[((c & 3) * kGroup + n) * 4 + i];
                u = c < 4 ? (byte & 0x0F) : (byte >> 4);
              }
              dot[n] += u * xb[c * 4 + i];
            }
          }
        }
        const uint16_t* s = p.scale + (g * p.k_blocks + b) * kGroup;
        const float xs = p.xs[row * p.k_blocks + b];
        for (int n = 0; n < kGroup; ++n) acc[n] += static_cast<float>(dot[n]) * (bf16_to_float(s[n]) * xs);
      }
      std::memcpy(p.y + row * p.groups * kGroup + g * kGroup, acc, sizeof acc);
    }
  }
}

#if defined(__x86_64__)
// The activations of a prefill chunk (128 rows) quantized with AVX-512: the scalar loop took about
// as long as the matmul itself there. Same arithmetic: cvtps rounds to nearest even, as nearbyint.
__attribute__((target("avx512f,avx512bw"))) void quantize_rows_avx512(const float* x, int64_t m, int64_t k_blocks,
                                                                      int8_t* xq, float* xs, int32_t* xsum) {
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

// AVX-512 VNNI: per group and block, 8 vpdpbusd per row cover 16 outputs x 32 k.
template <int kRows, int kBits>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_vnni(const Problem& p, int64_t g, int64_t row0) {
  constexpr int64_t weight_bytes = kBits == 8 ? 512 : 256;
  constexpr int offset = kBits == 8 ? 128 : 8;
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
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wb + 64 * c);
        w[c] = _mm512_and_si512(v, low);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    }
    const __m256i s16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.scale + (g * p.k_blocks + b) * kGroup));
    const __m512 sw = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s16), 16));
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

template <int kBits>
void groups_vnni(const Problem& p, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t row = 0;
    for (; row + 8 <= p.m; row += 8) tile_vnni<8, kBits>(p, g, row);
    switch (p.m - row) {
      case 7: tile_vnni<7, kBits>(p, g, row); break;
      case 6: tile_vnni<6, kBits>(p, g, row); break;
      case 5: tile_vnni<5, kBits>(p, g, row); break;
      case 4: tile_vnni<4, kBits>(p, g, row); break;
      case 3: tile_vnni<3, kBits>(p, g, row); break;
      case 2: tile_vnni<2, kBits>(p, g, row); break;
      case 1: tile_vnni<1, kBits>(p, g, row); break;
      default: break;
    }
  }
}

#endif

void run_groups(const Problem& p, int64_t g0, int64_t g1) {
#if defined(__x86_64__)
  if (has_vnni()) {
    if (p.bits == 8) groups_vnni<8>(p, g0, g1); else groups_vnni<4>(p, g0, g1);
    return;
  }
#endif
  groups_generic(p, g0, g1);
}

// ------------------------------------------------------------------------------- float weights
// y[M, N] = x[M, K] @ W[N, K]^T for W packed by `jaxinfer.packed`: float32 [N/16, K, 16], bfloat16
// [N/16, K/2, 16, 2] (each output's inputs k and k + 1 side by side, as AMX's tiles take them).
// The same 16 outputs side by side, so one vector of W and one broadcast of x advance 16 dots.
// XLA CPU runs a dot of 2–9 rows at about half its matrix-vector rate and converts bfloat16 weights
// to float32 on every call (../shared/JAX-ON-CPU.md); here every weight is read once for all the
// rows, in the width it is stored in, and the sums are float32. With `bf16_inputs` (x rounded to
// bfloat16), bfloat16 weights go to AMX (16 rows on) or VDPBF16PS (`dtile`) where the CPU has them:
// the pair layout is what both take.

struct FProblem {
  const float* x;
  const void* w;
  float* y;
  int64_t m, k, groups;
  const uint16_t* x_bf16 = nullptr;  // x rounded to bfloat16, for `dtile`
};

// x rounded to bfloat16 values for a model whose products take bfloat16 inputs
// (`ModelConfig.matmul_inputs`, the `bf16_inputs` attribute): the FMA paths then multiply what
// AMX's single pass does, so a row's result does not depend on which path its batch took.
inline float round_to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;  // to nearest even (finite values)
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

#if defined(__x86_64__)
// 16 floats → bfloat16 bits in the low half of each lane, rounded as round_to_bf16
__attribute__((target("avx512f"), always_inline)) inline __m512i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd)), 16);
}

__attribute__((target("avx512f"))) void round_all_avx512(const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i hi = round_bf16(_mm512_loadu_ps(x + i));
    _mm512_storeu_ps(out + i, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16)));
  }
  for (; i < n; ++i) out[i] = round_to_bf16(x[i]);
}
#endif

#if defined(JAXINFER_AVX512_BF16)
// x rounded as round_to_bf16, kept as the bfloat16 bits `dtile` reads two at a time
__attribute__((target("avx512f"))) void round_to_bf16_bits(const float* x, uint16_t* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(round_bf16(_mm512_loadu_ps(x + i))));
  for (; i < n; ++i) {
    const float v = round_to_bf16(x[i]);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
}
#endif

void round_all(const float* x, float* out, int64_t n) {
#if defined(__x86_64__)
  if (has_avx512()) return round_all_avx512(x, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = round_to_bf16(x[i]);
}

template <bool kBf16>
inline float weight_at(const FProblem& p, int64_t g, int64_t k, int n) {
  if constexpr (kBf16) {
    return bf16_to_float(static_cast<const uint16_t*>(p.w)[((g * p.k / 2 + k / 2) * kGroup + n) * 2 + (k & 1)]);
  } else {
    return static_cast<const float*>(p.w)[(g * p.k + k) * kGroup + n];
  }
}

template <bool kBf16>
void fgroups_generic(const FProblem& p, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t row = 0; row < p.m; ++row) {
      float acc[kGroup] = {};
      const float* x = p.x + row * p.k;
      for (int64_t k = 0; k < p.k; ++k) {
        for (int n = 0; n < kGroup; ++n) acc[n] += x[k] * weight_at<kBf16>(p, g, k, n);
      }
      std::memcpy(p.y + row * p.groups * kGroup + g * kGroup, acc, sizeof acc);
    }
  }
}

#if defined(__x86_64__)
// Where input k of a group's 16 outputs is. bfloat16: the 64 bytes of k's pair hold k in each
// lane's low half and k + 1 in its high half.
template <bool kBf16>
inline const void* group_at(const void* w, int64_t g, int64_t k, int64_t depth) {
  if constexpr (kBf16) return static_cast<const uint16_t*>(w) + (g * depth / 2 + k / 2) * 2 * kGroup;
  return static_cast<const float*>(w) + (g * depth + k) * kGroup;
}

// Input k of a group's 16 outputs as floats.
template <bool kBf16>
__attribute__((target("avx512f"), always_inline)) inline __m512 load_group(const void* w, int64_t g, int64_t k, int64_t depth) {
  if constexpr (kBf16) {
    const __m512i pair = _mm512_loadu_si512(group_at<kBf16>(w, g, k, depth));
    return _mm512_castsi512_ps(k & 1 ? _mm512_and_si512(pair, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))) : _mm512_slli_epi32(pair, 16));
  } else {
    return _mm512_loadu_ps(group_at<kBf16>(w, g, k, depth));
  }
}

// A tile's sums over rows [row0, row0 + kRows) and groups [g, g + kCols): from what the block
// before stored in y (k0 > 0), else zero; and stored back.
template <int kRows, int kCols>
__attribute__((target("avx512f"), always_inline)) inline void load_sums(const FProblem& p, int64_t g, int64_t row0, int64_t k0, __m512 (&acc)[kRows][kCols]) {
  const float* y = p.y + row0 * p.groups * kGroup + g * kGroup;
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = k0 ? _mm512_loadu_ps(y + r * p.groups * kGroup + c * kGroup) : _mm512_setzero_ps();
}

template <int kRows, int kCols>
__attribute__((target("avx512f"), always_inline)) inline void store_sums(const FProblem& p, int64_t g, int64_t row0, const __m512 (&acc)[kRows][kCols]) {
  float* y = p.y + row0 * p.groups * kGroup + g * kGroup;
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) _mm512_storeu_ps(y + r * p.groups * kGroup + c * kGroup, acc[r][c]);
}

// kRows rows by kCols groups over inputs [k0, k1): per k, kCols weight vectors and kRows broadcasts
// feed kRows * kCols independent sums (at most 24 of the 32 registers). From k0 > 0 on, the sums go
// on from what the block before stored in y (a float32 store and load: the same sums in the same
// order: `load_sums`). `ahead` > 0: also fetch into L1 the weights that many inputs on.
template <int kRows, int kCols, bool kBf16>
__attribute__((target("avx512f"))) void ftile(const FProblem& p, int64_t g, int64_t row0, int64_t k0, int64_t k1, int64_t ahead) {
  __m512 acc[kRows][kCols];
  load_sums(p, g, row0, k0, acc);
  const float* x = p.x + row0 * p.k;
  for (int64_t k = k0; k < k1; ++k) {
    if (ahead)
      for (int c = 0; c < kCols; ++c) _mm_prefetch(static_cast<const char*>(group_at<kBf16>(p.w, g + c, k + ahead, p.k)), _MM_HINT_T0);
    __m512 w[kCols];
    for (int c = 0; c < kCols; ++c) w[c] = load_group<kBf16>(p.w, g + c, k, p.k);
    for (int r = 0; r < kRows; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * p.k + k]);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(w[c], xv, acc[r][c]);
    }
  }
  store_sums(p, g, row0, acc);
}

#if defined(JAXINFER_AVX512_BF16)
// ftile for bfloat16 weights and x rounded to bfloat16 (`bf16_inputs`) on AVX512-BF16: VDPBF16PS
// multiplies each lane's pair of weights (k, k + 1) by x's pair exactly and adds both to the lane's
// float32 sum, so one instruction advances 16 dots by two inputs, with neither the pair's widening
// nor a second FMA.
template <int kRows, int kCols>
__attribute__((target("avx512f,avx512bf16"))) void dtile(const FProblem& p, int64_t g, int64_t row0, int64_t k0, int64_t k1, int64_t ahead) {
  __m512 acc[kRows][kCols];
  load_sums(p, g, row0, k0, acc);
  const uint16_t* x = p.x_bf16 + row0 * p.k;
  for (int64_t k = k0; k < k1; k += 2) {
    if (ahead)
      for (int c = 0; c < kCols; ++c) _mm_prefetch(static_cast<const char*>(group_at<true>(p.w, g + c, k + ahead, p.k)), _MM_HINT_T0);
    __m512bh w[kCols];
    for (int c = 0; c < kCols; ++c) w[c] = (__m512bh)_mm512_loadu_si512(group_at<true>(p.w, g + c, k, p.k));
    for (int r = 0; r < kRows; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * p.k + k, sizeof pair);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], xv);
    }
  }
  store_sums(p, g, row0, acc);
}
#endif

template <int kRows, int kCols, bool kBf16, bool kDot>
inline void tile(const FProblem& p, int64_t g, int64_t row0, int64_t k0, int64_t k1, int64_t ahead) {
#if defined(JAXINFER_AVX512_BF16)
  if constexpr (kDot) {
    dtile<kRows, kCols>(p, g, row0, k0, k1, ahead);
    return;
  }
#endif
  ftile<kRows, kCols, kBf16>(p, g, row0, k0, k1, ahead);
}

// 7–32 rows (batched decode, a checking pass): the tiles go over the inputs a block at a time, and
// the second tile fetches the next block's weights while the others reuse this one's from L1, so
// the stream from memory overlaps arithmetic instead of feeding the first tile alone. Measured with
// the weights cold, as decode reads them: SmolLM-135M's matrices at 16 rows 5–15% faster, decode
// at B=16 6–8%; from 48 rows (prefill chunks) no faster, and at 128 rows up to 20% slower (B=16
// prefill TTFT 739 → 912 ms), so whole K there. A block and the next one fetched beside it fit L1
// together (2 × 16 KiB of 48): blocks of 128 inputs (2 × 32 KiB) evicted the block in use, and a
// decode step's matrices at 16 rows took 7–11% longer (30 layers' SmolLM-135M matrices chained).
constexpr int64_t kFBlock = 64;  // 4 groups' weights: 16 KiB in float32
constexpr int64_t kFBlockMaxRows = 32;

template <int kCols, bool kBf16, bool kDot>
void frows_avx512(const FProblem& p, int64_t g) {
  const int64_t block = p.m > 6 && p.m <= kFBlockMaxRows ? kFBlock : p.k;
  for (int64_t k0 = 0; k0 < p.k; k0 += block) {
    const int64_t k1 = std::min(p.k, k0 + block);
    const int64_t next = k1 < p.k ? std::min(block, p.k - k1) : 0;
    int64_t row = 0;
    for (; row + 6 <= p.m; row += 6) tile<6, kCols, kBf16, kDot>(p, g, row, k0, k1, row == 6 ? next : 0);
    const int64_t ahead = row == 6 ? next : 0;
    switch (p.m - row) {
      case 5: tile<5, kCols, kBf16, kDot>(p, g, row, k0, k1, ahead); break;
      case 4: tile<4, kCols, kBf16, kDot>(p, g, row, k0, k1, ahead); break;
      case 3: tile<3, kCols, kBf16, kDot>(p, g, row, k0, k1, ahead); break;
      case 2: tile<2, kCols, kBf16, kDot>(p, g, row, k0, k1, ahead); break;
      case 1: tile<1, kCols, kBf16, kDot>(p, g, row, k0, k1, ahead); break;
      default: break;
    }
  }
}

template <bool kBf16, bool kDot>
void fgroups_avx512(const FProblem& p, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + 4 <= g1; g += 4) frows_avx512<4, kBf16, kDot>(p, g);
  for (; g < g1; ++g) frows_avx512<1, kBf16, kDot>(p, g);
}
#endif

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
constexpr int64_t kAmxMinRows = 16;  // from 12–16 rows on, the tiles are ahead of FMAs (SmolLM and TinyLlama matrices)
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
__attribute__((target("avx512f,avx512bw"))) void pack_a_amx(const float* x, const AmxProblem& p, uint16_t* a, int64_t r0, int64_t r1) {
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

template <bool kBf16>
void run_fgroups(const FProblem& p, int64_t g0, int64_t g1) {
#if defined(JAXINFER_AVX512_BF16)
  if constexpr (kBf16)
    if (p.x_bf16) return fgroups_avx512<true, true>(p, g0, g1);
#endif
#if defined(__x86_64__)
  if (has_avx512()) return fgroups_avx512<kBf16, false>(p, g0, g1);
#endif
  fgroups_generic<kBf16>(p, g0, g1);
}

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                   ffi::Buffer<ffi::BF16> scale, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto q_dims = q.dimensions();
  const int bits = q.element_type() == ffi::DataType::S8 ? 8 : q.element_type() == ffi::DataType::U8 ? 4 : 0;
  if (bits == 0 || q_dims.size() != 5 || x_dims.size() == 0) {
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: q must be int8 or uint8 [N/16, K/32, c, 16, 4]");
  }
  const int64_t k = x_dims.back();
  const int64_t m = x.element_count() / std::max<int64_t>(k, 1);
  const int64_t groups = q_dims[0], k_blocks = q_dims[1];
  if (k != k_blocks * kBlock || q_dims[2] != (bits == 8 ? 8 : 4) || q_dims[3] != kGroup || q_dims[4] != 4) {
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: x and q disagree about K, or q is not packed");
  }
  if (m == 0 || groups == 0) return ffi::Error::Success();

  std::vector<int8_t> xq(m * k);
  std::vector<float> xs(m * k_blocks);
  std::vector<int32_t> xsum(m * k_blocks);
#if defined(__x86_64__)
  if (has_vnni()) {
    quantize_rows_avx512(x.typed_data(), m, k_blocks, xq.data(), xs.data(), xsum.data());
  } else {
    quantize_rows(x.typed_data(), m, k_blocks, xq.data(), xs.data(), xsum.data());
  }
#else
  quantize_rows(x.typed_data(), m, k_blocks, xq.data(), xs.data(), xsum.data());
#endif
  const Problem problem{x.typed_data(),
                        static_cast<const uint8_t*>(q.untyped_data()),
                        reinterpret_cast<const uint16_t*>(scale.typed_data()),
                        y->typed_data(),
                        m, k_blocks, groups, bits, xq.data(), xs.data(), xsum.data()};
  const int64_t group_bytes = k_blocks * (bits == 8 ? 512 : 256) * std::max<int64_t>(1, m / 4);
  parallel_items(pool, groups, group_bytes, [&problem](int64_t g0, int64_t g1) { run_groups(problem, g0, g1); });
  return ffi::Error::Success();
}

constexpr int64_t kTileGroups = 4;  // a thread's share is whole tiles of 4 groups

ffi::Error FMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, bool bf16_inputs, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  const bool f32 = w.element_type() == ffi::DataType::F32;
  const bool packed = (f32 && w_dims.size() == 3 && w_dims[2] == kGroup) || (bf16 && w_dims.size() == 4 && w_dims[2] == kGroup && w_dims[3] == 2);
  if (!packed || x_dims.size() == 0) {
    return ffi::Error::InvalidArgument("jaxinfer_fmatmul: w must be float32 [N/16, K, 16] or bfloat16 [N/16, K/2, 16, 2]");
  }
  const int64_t k = x_dims.back();
  const int64_t m = x.element_count() / std::max<int64_t>(k, 1);
  const int64_t groups = w_dims[0];
  if (k != w_dims[1] * (bf16 ? 2 : 1)) return ffi::Error::InvalidArgument("jaxinfer_fmatmul: x and w disagree about K");
  if (m == 0 || groups == 0) return ffi::Error::Success();
#if defined(JAXINFER_AMX)
  if (bf16 && m >= kAmxMinRows && has_amx()) {
    amx_matmul(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()), y->typed_data(), m, k, groups, bf16_inputs);
    return ffi::Error::Success();
  }
#endif
  FProblem problem{x.typed_data(), w.untyped_data(), y->typed_data(), m, k, groups};
  thread_local std::vector<float> rounded;
  thread_local std::vector<uint16_t> rounded_bits;
#if defined(JAXINFER_AVX512_BF16)
  if (bf16_inputs && bf16 && has_avx512_bf16()) {
    rounded_bits.resize(static_cast<size_t>(m * k));
    round_to_bf16_bits(problem.x, rounded_bits.data(), m * k);
    problem.x_bf16 = rounded_bits.data();
  }
#endif
  if (bf16_inputs && !problem.x_bf16) {
    rounded.resize(static_cast<size_t>(m * k));
    round_all(problem.x, rounded.data(), m * k);
    problem.x = rounded.data();
  }
  const int64_t tiles = (groups + kTileGroups - 1) / kTileGroups;
  const int64_t tile_bytes = kTileGroups * k * kGroup * (bf16 ? 2 : 4) * std::max<int64_t>(1, m / 6);
  parallel_items(pool, tiles, tile_bytes, [&problem, bf16](int64_t t0, int64_t t1) {
    const int64_t g0 = t0 * kTileGroups, g1 = std::min(problem.groups, t1 * kTileGroups);
    if (bf16) run_fgroups<true>(problem, g0, g1); else run_fgroups<false>(problem, g0, g1);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_qmatmul, jaxinfer::QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_fmatmul, jaxinfer::FMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("bf16_inputs")
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" void jaxinfer_cap_isa(int cap) {  // tests: 0 the CPU's best paths, 1 no AMX, 2 the portable ones
  jaxinfer::isa_cap.store(cap);
}

extern "C" const char* jaxinfer_kernel_isa() {  // the best path this CPU takes
#if defined(__x86_64__)
  if (jaxinfer::has_vnni() && jaxinfer::has_avx512_bf16() && jaxinfer::has_amx()) return "avx512-vnni-bf16-amx";
  if (jaxinfer::has_vnni() && jaxinfer::has_amx()) return "avx512-vnni-amx";
  if (jaxinfer::has_vnni() && jaxinfer::has_avx512_bf16()) return "avx512-vnni-bf16";
  if (jaxinfer::has_vnni()) return "avx512-vnni";
  if (jaxinfer::has_avx512()) return "avx512";
#endif
  return "generic";
}
