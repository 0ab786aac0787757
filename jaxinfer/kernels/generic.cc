// The portable paths: any CPU, plain C++. The reference the vectorised families are tested against,
// and what runs where none of them is built (a new architecture) or the cap says so.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "paths.h"

namespace jaxinfer {
namespace {

void quantize_rows(const float* x, int64_t m, int64_t k_blocks, int8_t* xq, float* xs, int32_t* xsum) {
  for (int64_t at = 0; at < m * k_blocks; ++at) {
    const float* v = x + at * kBlock;
    float amax = 0.f;
    for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float inverse = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < kBlock; ++i) {
      xq[at * kBlock + i] = static_cast<int8_t>(std::nearbyint(v[i] * inverse));  // ties to even, as jnp.round
      sum += xq[at * kBlock + i];
    }
    xs[at] = amax / 127.f;
    xsum[at] = sum;
  }
}

// Each block's weights are unpacked once, to their signed values by output, for all the rows; the
// 32-long integer dots are plain loops a compiler vectorises for the CPU's base instructions (SSE2,
// NEON). The sums are the VNNI path's: exact integer dots, then scaled in the same order.
template <int kBits, bool kE2M1 = false>
void qgroups(const QProblem& p, int64_t g0, int64_t g1) {
  constexpr int64_t weight_bytes = kBits == 8 ? 512 : 256;  // per group and block
  std::vector<float> acc(p.m * kGroup);
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < p.k_blocks; ++b) {
      const uint8_t* q = p.q + (g * p.k_blocks + b) * weight_bytes;
      int8_t w[kGroup][kBlock];  // output n's weight at k = 4 c + i
      for (int c = 0; c < 8; ++c) {
        for (int n = 0; n < kGroup; ++n) {
          for (int i = 0; i < 4; ++i) {
            if constexpr (kBits == 8) {
              w[n][4 * c + i] = static_cast<int8_t>(q[(c * kGroup + n) * 4 + i]);
            } else {
              const uint8_t byte = q[((c & 3) * kGroup + n) * 4 + i], code = c < 4 ? byte & 0x0F : byte >> 4;
              w[n][4 * c + i] = kE2M1 ? kE2M1Values[code] : static_cast<int8_t>(code - 8);
            }
          }
        }
      }
      const int64_t s = (g * p.k_blocks + b) * kGroup;
      for (int64_t row = 0; row < p.m; ++row) {
        const int8_t* xb = p.xq + (row * p.k_blocks + b) * kBlock;
        const float xs = p.xs[row * p.k_blocks + b];
        for (int n = 0; n < kGroup; ++n) {
          int32_t dot = 0;
          for (int k = 0; k < kBlock; ++k) dot += w[n][k] * xb[k];
          acc[row * kGroup + n] += static_cast<float>(dot) * (p.scale_at(s + n) * xs);
        }
      }
    }
    for (int64_t row = 0; row < p.m; ++row) std::memcpy(p.y + row * p.groups * kGroup + g * kGroup, &acc[row * kGroup], kGroup * sizeof(float));
  }
}

// The formats of KProblem, as qgroups: each block's codes unpacked once, integer dots per row, then
// scaled.
void kgroups(const KProblem& p, int64_t g0, int64_t g1) {
  const int bits = k_bits(p.kind);
  std::vector<float> acc(p.m * kGroup);
  for (int64_t g = g0; g < g1; ++g) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < p.k_blocks; ++b) {
      const uint8_t* q = p.block(g, b);
      int32_t w[kGroup][kBlock];  // output n's code at k = 4 c + i (Q6_K: code - 32)
      for (int c = 0; c < 8; ++c) {
        for (int n = 0; n < kGroup; ++n) {
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = q[((c & 3) * kGroup + n) * 4 + i];
            int32_t code = c < 4 ? byte & 0x0F : byte >> 4;
            if (bits == 5) code |= ((q[(4 * kGroup + n) * 4 + i] >> c) & 1) << 4;
            if (bits == 6) code = (code | (((q[((4 + c / 4) * kGroup + n) * 4 + i] >> (2 * (c & 3))) & 3) << 4)) - 32;
            w[n][4 * c + i] = code;
          }
        }
      }
      const uint16_t* super = p.supers(g, b);
      float scale[kGroup], min[kGroup];  // the unsigned formats': w = scale · code - min
      for (int n = 0; n < kGroup && p.kind != kQ6K; ++n) {
        const float d = f16_to_float(super[n]);
        if (p.kind == kQ4K || p.kind == kQ5K) {
          scale[n] = d * p.subs(g, b)[n];
          min[n] = f16_to_float(super[kGroup + n]) * p.subs(g, b)[kGroup + n];
        } else {
          scale[n] = d;
          min[n] = p.kind == kQ5_0 ? 16.f * d : f16_to_float(super[kGroup + n]);
        }
      }
      for (int64_t row = 0; row < p.m; ++row) {
        const int8_t* xb = p.xq + (row * p.k_blocks + b) * kBlock;
        const float xs = p.xs[row * p.k_blocks + b];
        const float xsum = static_cast<float>(p.xsum[row * p.k_blocks + b]);
        for (int n = 0; n < kGroup; ++n) {
          int32_t dots[2] = {0, 0};  // the block's halves of 16
          for (int k = 0; k < kBlock; ++k) dots[k / 16] += w[n][k] * xb[k];
          if (p.kind == kQ6K) {
            const uint8_t* sub = p.subs(g, b);
            const int32_t dot = static_cast<int8_t>(sub[n]) * dots[0] + static_cast<int8_t>(sub[kGroup + n]) * dots[1];
            acc[row * kGroup + n] += static_cast<float>(dot) * (f16_to_float(super[n]) * xs);
          } else {
            acc[row * kGroup + n] += xs * (static_cast<float>(dots[0] + dots[1]) * scale[n] - xsum * min[n]);
          }
        }
      }
    }
    for (int64_t row = 0; row < p.m; ++row) std::memcpy(p.y + row * p.groups * kGroup + g * kGroup, &acc[row * kGroup], kGroup * sizeof(float));
  }
}

void round_values(const float* x, float* out, int64_t n) {
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
void fgroups(const FProblem& p, int64_t g0, int64_t g1) {
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

bool visible(const Attention& p, int64_t s, int32_t at) { return s <= at && (p.window == 0 || s > at - p.window); }

float capped(const Attention& p, float score) { return p.softcap > 0.f ? std::tanh(score / p.softcap) * p.softcap : score; }

// One query row at a time, exact exp.
void attend(const Attention& p, const Item& it, const Part& part) {
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
      score = capped(p, score * p.scale_of(p.k_scale, kat) * p.scale);
      const float now = std::max(top, score);
      const float before = std::exp(top - now), weight = std::exp(score - now);
      total = total * before + weight;
      const float scaled = weight * p.scale_of(p.v_scale, kat);
      for (int64_t d = 0; d < p.hd; ++d) acc[d] = acc[d] * before + scaled * p.element(p.v, kat + d);
      top = now;
    }
    part.top[m] = top;
    part.total[m] = total;
  }
}

}  // namespace

void add_generic(Paths& t) {
  t.name = "generic";
  t.quantize_rows = quantize_rows;
  t.qgroups[0] = qgroups<8>;
  t.qgroups[1] = qgroups<4>;
  t.qgroups[2] = qgroups<4, true>;
  for (KGroups& k : t.kgroups) k = kgroups;
  t.fgroups[0] = fgroups<false>;
  t.fgroups[1] = fgroups<true>;
  t.round = round_values;
  t.attend_any = attend;
}

}  // namespace jaxinfer
