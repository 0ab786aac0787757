// The kernels' problems, and the table of paths that solve them: one source file per instruction-set
// family fills its entries (generic.cc the portable reference, x86_avx2.cc, x86_avx512.cc,
// arm_neon.cc), and
// `paths()` picks the table once for this CPU and each cap, as llama.cpp's ggml-cpu/arch/ does.
// The FFI handlers (matmul.cc, attention.cc) check shapes, share the work out and call the table.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "common.h"

namespace jaxinfer {

constexpr int kBlock = 32;  // quantized weights: k per scale
constexpr int kGroup = 16;  // outputs side by side, in every packed layout

// y[M, N] = x[M, K] @ W[N, K]^T for block-quantized W (the layout: matmul.cc), W8A8: x quantized per
// block of 32 to int8 with one float scale (`xs`) and its values' sum (`xsum`) beside them. 4-bit codes
// are q + 8 (int4, Q4_0), or MXFP4's E2M1 codes (`e2m1`), whose values are kE2M1Values' (doubled, so
// integers: the scale holds the half), taken as kE2M1Values[code] + 12 where a path wants them unsigned.
constexpr int8_t kE2M1Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int kE2M1Offset = 12;
alignas(16) constexpr uint8_t kE2M1Unsigned[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
struct QProblem {
  const uint8_t* q;
  const uint16_t* scale;  // bfloat16 bits, or float16 where `f16_scale` (llama.cpp's q8_0 / q4_0)
  float* y;
  int64_t m, k_blocks, groups;
  int bits;
  const int8_t* xq;
  const float* xs;
  const int32_t* xsum;
  bool f16_scale = false;
  bool e2m1 = false;

  float scale_at(int64_t at) const { return f16_scale ? f16_to_float(scale[at]) : bf16_to_float(scale[at]); }
};

// y[M, N] = x[M, K] @ W[N, K]^T for W in one of llama.cpp's formats with blocks of 32 that a scale
// and min turn into values (Q4_K, Q5_K, Q6_K; Q4_1, Q5_1, Q5_0), repacked by `jaxinfer.quant` with
// their values unchanged; W8A8 as QProblem. Per group of 16 outputs and block of 32 inputs, `bits`
// chunks of 4 inputs by 16 outputs: 0-3 the low 4 bits of the codes, packed as int4's; a 5-bit
// format's chunk 4, bit c of byte i, the fifth bit of input 4c + i; Q6_K's chunks 4 and 5, bits 2c and
// 2c + 1, the fifth and sixth (c < 4, then c >= 4). The k-quants add two 8-bit sub-scales per output
// and block (`sub` [2][16]), and every format float16 super-scales per output (`super` [supers][16])
// once per `per` blocks:
//   Q4_K, Q5_K: w = d·scale·code - dmin·min (sub: scale, min; super: d, dmin; per 8)
//   Q6_K:       w = d·scale_h·(code - 32), h the block's half of 16 (sub: int8 scales; super: d; per 8)
//   Q4_1, Q5_1: w = d·code - m (super: d, m, the file's min negated; per 1)
//   Q5_0:       w = d·code - 16·d (super: d; per 1)
enum KKind { kQ4K = 0, kQ5K, kQ6K, kQ4_1, kQ5_1, kQ5_0, kKinds };
constexpr int k_bits(int kind) { return kind == kQ6K ? 6 : (kind == kQ5K || kind == kQ5_1 || kind == kQ5_0) ? 5 : 4; }
constexpr int k_per(int kind) { return kind <= kQ6K ? 8 : 1; }
constexpr int k_supers(int kind) { return kind == kQ6K || kind == kQ5_0 ? 1 : 2; }

struct KProblem {
  const uint8_t* q;
  const uint8_t* sub;  // the k-quants'
  const uint16_t* super;
  float* y;
  int64_t m, k_blocks, groups;
  int kind;
  const int8_t* xq;
  const float* xs;
  const int32_t* xsum;
  const int32_t* xhalf;  // Q6_K: the sum of each block's first 16 xq

  int64_t weight_bytes() const { return k_bits(kind) * 64; }  // per group and block
  const uint8_t* block(int64_t g, int64_t b) const { return q + (g * k_blocks + b) * weight_bytes(); }
  const uint8_t* subs(int64_t g, int64_t b) const { return sub + (g * k_blocks + b) * 2 * kGroup; }
  const uint16_t* supers(int64_t g, int64_t b) const {
    const int per = k_per(kind);
    return super + (g * (k_blocks / per) + b / per) * k_supers(kind) * kGroup;
  }
};

// y[M, N] = x[M, K] @ W[N, K]^T for float W packed by `jaxinfer.packed`: float32 [N/16, K, 16],
// bfloat16 [N/16, K/2, 16, 2] (each output's inputs k and k + 1 side by side, as AMX's tiles take them).
struct FProblem {
  const float* x;
  const void* w;
  float* y;
  int64_t m, k, groups;
  const uint16_t* x_bf16 = nullptr;  // x rounded to bfloat16, for `Paths::bf16_dot`
};

// How the KV cache holds K and V: float32, bfloat16, or int8 with one float32 scale a (position,
// kv head) (`--kv-dtype int8`: each value times its vector's scale).
enum KvKind : int { kKvF32 = 0, kKvBf16 = 1, kKvInt8 = 2 };

// Attention of T queries per row over one layer of the whole stacked KV cache (attention.cc).
struct Attention {
  const float* q;
  const void* k;
  const void* v;
  const int32_t* pos;
  const int32_t* rows;
  int64_t B, T, KV, G, hd, R, S, layer, kv_len, window;
  float scale, softcap;
  int kv;                          // KvKind
  const float* k_scale = nullptr;  // int8: [L, R, KV, S], a key's at key_at / hd
  const float* v_scale = nullptr;
  int64_t tile = 1;    // query positions per item
  int64_t tiles = 1;   // tiles per (row, kv head)
  int64_t splits = 1;  // items per tile, each over its share of the key blocks (flash decoding)

  int64_t key_at(int64_t b, int64_t s, int64_t h) const { return (((layer * R + rows[b]) * KV + h) * S + s) * hd; }
  int64_t query_at(int64_t b, int64_t t, int64_t h, int64_t g) const { return (((b * T + t) * KV + h) * G + g) * hd; }
  float element(const void* a, int64_t at) const {  // of k or v as stored, as float32 (int8: unscaled)
    if (kv == kKvInt8) return static_cast<const int8_t*>(a)[at];
    return kv == kKvBf16 ? bf16_to_float(static_cast<const uint16_t*>(a)[at]) : static_cast<const float*>(a)[at];
  }
  float scale_of(const float* scales, int64_t at) const { return kv == kKvInt8 ? scales[at / hd] : 1.f; }  // its vector's
};

constexpr int64_t kKeys = 64;  // attention: keys per block

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

using QuantizeRows = void (*)(const float* x, int64_t m, int64_t k_blocks, int8_t* xq, float* xs, int32_t* xsum);
using QGroups = void (*)(const QProblem&, int64_t g0, int64_t g1);
using KGroups = void (*)(const KProblem&, int64_t g0, int64_t g1);
using FGroups = void (*)(const FProblem&, int64_t g0, int64_t g1);
using RoundValues = void (*)(const float* x, float* out, int64_t n);
using RoundBits = void (*)(const float* x, uint16_t* out, int64_t n);
using AttendItem = void (*)(const Attention&, const Item&, const Part&);
using AmxMatmul = void (*)(xla::ffi::ThreadPool&, const float* x, const uint16_t* w, float* y, int64_t m, int64_t k, int64_t groups,
                           bool bf16_inputs);

struct Paths {
  std::string name;  // `jaxinfer.kernel.isa()`
  QuantizeRows quantize_rows = nullptr;
  QGroups qgroups[3] = {};  // int8, int4, MXFP4
  KGroups kgroups[kKinds] = {};  // by KKind
  FGroups fgroups[2] = {};  // float32, bfloat16 weights
  RoundValues round = nullptr;  // x rounded to bfloat16 values (`bf16_inputs` on the FMA paths)
  // bfloat16 weights times x rounded to bfloat16 (VDPBF16PS), x given as bits by `round_bits`
  FGroups bf16_dot = nullptr;
  RoundBits round_bits = nullptr;
  AmxMatmul amx = nullptr;  // bfloat16 weights from kAmxMinRows rows on
  AttendItem attend[3][7] = {};  // [KvKind][attend_slot(head size)]
  AttendItem attend_any = nullptr;  // any head size: the portable path
};

constexpr int64_t kAmxMinRows = 16;  // from 12–16 rows on, the tiles are ahead of FMAs (SmolLM and TinyLlama matrices)

// The head sizes the vectorised attention has paths for (`jaxinfer.kernel.ATTENTION_HEAD_DIMS`).
constexpr int64_t kAttendHeadDims[7] = {32, 64, 80, 96, 128, 256, 512};  // 512: Gemma 4's full layers

inline int attend_slot(int64_t hd) {  // where hd's path is in Paths::attend, or -1
  for (int i = 0; i < 7; ++i)
    if (kAttendHeadDims[i] == hd) return i;
  return -1;
}

// Each family adds what this CPU has of it over what is already there.
void add_generic(Paths&);
void add_avx2(Paths&, bool vnni);
void add_avx512(Paths&, bool amx);
void add_neon(Paths&, bool dotprod);

// The table for this CPU under the current cap.
const Paths& paths();

// x rounded to bfloat16 (to nearest even, finite values), kept a float: for a model whose products
// take bfloat16 inputs (`ModelConfig.matmul_inputs`, the `bf16_inputs` attribute), so that every
// path multiplies what AMX's single pass does and a row's result does not depend on its batch's path.
inline float round_to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// tile(g, row, std::integral_constant<int, rows>) over groups [g0, g1), each group's m rows in tiles
// of 2 and the one left: the narrow families' quantized drivers (16 vector registers, or SDOT's pairs).
template <class Tile>
inline void groups_in_row_pairs(int64_t g0, int64_t g1, int64_t m, Tile&& tile) {
  for (int64_t g = g0; g < g1; ++g) {
    int64_t row = 0;
    for (; row + 2 <= m; row += 2) tile(g, row, std::integral_constant<int, 2>{});
    if (row < m) tile(g, row, std::integral_constant<int, 1>{});
  }
}

// f(std::integral_constant<int, rows>) for 1 <= rows <= kMax: a tile's row count made a template
// argument, for the remainders of a loop over whole tiles.
template <int kMax, int kRows = 1, class F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (kRows < kMax) {
    if (rows != kRows) return with_rows<kMax, kRows + 1>(rows, f);
  }
  f(std::integral_constant<int, kRows>{});
}

}  // namespace jaxinfer
