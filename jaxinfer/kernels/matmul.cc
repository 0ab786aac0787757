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
// y[M, N] = x[M, K] @ W[N, K]^T for float32 or bfloat16 W packed [N/16, K, 16] (`jaxinfer.packed`):
// the same 16 outputs side by side, so one vector of W and one broadcast of x advance 16 dots.
// XLA CPU runs a dot of 2–9 rows at about half its matrix-vector rate and converts bfloat16 weights
// to float32 on every call (../shared/JAX-ON-CPU.md); here every weight is read once for all the
// rows, in the width it is stored in, and the sums are float32.

struct FProblem {
  const float* x;
  const void* w;
  float* y;
  int64_t m, k, groups;
};

template <bool kBf16>
inline float weight_at(const void* w, int64_t at) {
  if constexpr (kBf16) {
    return bf16_to_float(static_cast<const uint16_t*>(w)[at]);
  } else {
    return static_cast<const float*>(w)[at];
  }
}

template <bool kBf16>
void fgroups_generic(const FProblem& p, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t row = 0; row < p.m; ++row) {
      float acc[kGroup] = {};
      const float* x = p.x + row * p.k;
      for (int64_t k = 0; k < p.k; ++k) {
        for (int n = 0; n < kGroup; ++n) acc[n] += x[k] * weight_at<kBf16>(p.w, (g * p.k + k) * kGroup + n);
      }
      std::memcpy(p.y + row * p.groups * kGroup + g * kGroup, acc, sizeof acc);
    }
  }
}

#if defined(__x86_64__)
template <bool kBf16>
__attribute__((target("avx512f"), always_inline)) inline __m512 load_group(const void* w, int64_t at) {
  if constexpr (kBf16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(w) + at);
  }
}

// kRows rows by kCols groups: per k, kCols weight vectors and kRows broadcasts feed kRows * kCols
// independent sums (at most 24 of the 32 registers).
template <int kRows, int kCols, bool kBf16>
__attribute__((target("avx512f"))) void ftile(const FProblem& p, int64_t g, int64_t row0) {
  __m512 acc[kRows][kCols];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* x = p.x + row0 * p.k;
  for (int64_t k = 0; k < p.k; ++k) {
    __m512 w[kCols];
    for (int c = 0; c < kCols; ++c) w[c] = load_group<kBf16>(p.w, ((g + c) * p.k + k) * kGroup);
    for (int r = 0; r < kRows; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * p.k + k]);
      for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(w[c], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kCols; ++c) _mm512_storeu_ps(p.y + (row0 + r) * p.groups * kGroup + (g + c) * kGroup, acc[r][c]);
}

template <int kCols, bool kBf16>
void frows_avx512(const FProblem& p, int64_t g) {
  int64_t row = 0;
  for (; row + 6 <= p.m; row += 6) ftile<6, kCols, kBf16>(p, g, row);
  switch (p.m - row) {
    case 5: ftile<5, kCols, kBf16>(p, g, row); break;
    case 4: ftile<4, kCols, kBf16>(p, g, row); break;
    case 3: ftile<3, kCols, kBf16>(p, g, row); break;
    case 2: ftile<2, kCols, kBf16>(p, g, row); break;
    case 1: ftile<1, kCols, kBf16>(p, g, row); break;
    default: break;
  }
}

template <bool kBf16>
void fgroups_avx512(const FProblem& p, int64_t g0, int64_t g1) {
  int64_t g = g0;
  for (; g + 4 <= g1; g += 4) frows_avx512<4, kBf16>(p, g);
  for (; g < g1; ++g) frows_avx512<1, kBf16>(p, g);
}
#endif

template <bool kBf16>
void run_fgroups(const FProblem& p, int64_t g0, int64_t g1) {
#if defined(__x86_64__)
  if (has_avx512()) return fgroups_avx512<kBf16>(p, g0, g1);
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

ffi::Error FMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  const auto w_dims = w.dimensions();
  const bool bf16 = w.element_type() == ffi::DataType::BF16;
  if ((!bf16 && w.element_type() != ffi::DataType::F32) || w_dims.size() != 3 || w_dims[2] != kGroup || x_dims.size() == 0) {
    return ffi::Error::InvalidArgument("jaxinfer_fmatmul: w must be float32 or bfloat16 [N/16, K, 16]");
  }
  const int64_t k = x_dims.back();
  const int64_t m = x.element_count() / std::max<int64_t>(k, 1);
  const int64_t groups = w_dims[0];
  if (k != w_dims[1]) return ffi::Error::InvalidArgument("jaxinfer_fmatmul: x and w disagree about K");
  if (m == 0 || groups == 0) return ffi::Error::Success();
  const FProblem problem{x.typed_data(), w.untyped_data(), y->typed_data(), m, k, groups};
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
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" void jaxinfer_force_generic(int yes) {
#if defined(__x86_64__)
  jaxinfer::force_generic.store(yes != 0);
#endif
}

extern "C" const char* jaxinfer_kernel_isa() {  // the best path this CPU takes
#if defined(__x86_64__)
  if (jaxinfer::has_vnni()) return "avx512-vnni";
  if (jaxinfer::has_avx512()) return "avx512";
#endif
  return "generic";
}
