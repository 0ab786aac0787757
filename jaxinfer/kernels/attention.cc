// Attention of T queries per row over one layer of the KV cache, as an XLA FFI custom call
// (`jaxinfer_attention`): flash attention's running softmax over blocks of keys, the scores never
// leaving L1 (the vectorised items are simd.h's). XLA CPU runs a prompt chunk's attention as small batched dots with the
// softmax between them in separate passes, at 26-70 GFLOP/s (SmolLM-135M shape, 16-128 queries
// over 2500 keys), and a chunk's attention, not its weights, is what a running row waits for.
//
// Layouts (as jaxinfer.model and jaxinfer.kvcache hold them):
//   q, out [B, T, KV, G, hd] float32 (G query heads per kv head, grouped-query attention);
//   k, v   [L, R, KV, S, hd] float32, bfloat16 (or its bits as uint16) or int8: the whole stacked cache, row
//          `rows[b]`, layer `layer`;
//   k_scale, v_scale [L, R, KV, S] float32: an int8 cache's scale of each vector (none otherwise);
//   pos    [B, T] int32: each query's position; it sees keys at positions <= its own (and within
//          `window` when that is not 0), below `kv_len`;
//   sinks  [KV * G] float32: each query head's sink logit, which joins its softmax's denominator and
//          weighs no value (gpt-oss); -inf: none.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "paths.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxinfer {
namespace {

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

ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> pos, ffi::AnyBuffer k, ffi::AnyBuffer v,
                  ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::S32> rows, ffi::Buffer<ffi::F32> sinks,
                  int64_t layer, int64_t kv_len, int64_t window, float scale, float softcap, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const ffi::DataType type = k.element_type();
  const bool bf16 = type == ffi::DataType::BF16 || type == ffi::DataType::U16;  // U16: bfloat16's bits
  const int kv = bf16 ? kKvBf16 : type == ffi::DataType::S8 ? kKvInt8 : kKvF32;
  if (qd.size() != 5 || kd.size() != 5 || (kv == kKvF32 && type != ffi::DataType::F32) || v.element_type() != type ||
      kd[2] != qd[2] || kd[4] != qd[4] || layer >= kd[0] || kv_len > kd[3] || sinks.element_count() != qd[2] * qd[3]) {
    return ffi::Error::InvalidArgument(
        "jaxinfer_attention: q [B, T, KV, G, hd], a cache [L, R, KV, S, hd] of float32, bfloat16 (or uint16 bits) or int8 and sinks [KV * G] that agree");
  }
  const int64_t scales = kv == kKvInt8 ? static_cast<int64_t>(k.element_count()) / kd[4] : 0;
  if (static_cast<int64_t>(k_scale.element_count()) != scales || static_cast<int64_t>(v_scale.element_count()) != scales) {
    return ffi::Error::InvalidArgument("jaxinfer_attention: an int8 cache's scales are [L, R, KV, S], others none");
  }
  Attention p{q.typed_data(), k.untyped_data(), v.untyped_data(), pos.typed_data(), rows.typed_data(),
              qd[0], qd[1], qd[2], qd[3], qd[4], kd[1], kd[3], layer, kv_len, window, scale, softcap, kv,
              k_scale.typed_data(), v_scale.typed_data()};
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
  const Paths& table = paths();
  const int path = attend_slot(p.hd);
  const AttendItem run = path >= 0 && table.attend[kv][path] ? table.attend[kv][path] : table.attend_any;
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
  // each rescaled to the largest max (or the head's sink, its exp joining the sum).
  float* o = out->typed_data();
  const float* sink = sinks.typed_data();
  for (int64_t unit = 0; unit < units; ++unit) {
    const Item it = item_at(p, unit * p.splits);
    for (int64_t m = 0; m < it.rows; ++m) {
      float top = -std::numeric_limits<float>::infinity(), total = 0.f;
      for (int64_t s = 0; s < p.splits; ++s) top = std::max(top, part(unit * p.splits + s).top[m]);
      float* dst = o + p.query_at(it.b, it.t0 + m / p.G, it.h, m % p.G);
      std::fill(dst, dst + p.hd, 0.f);
      if (top == -std::numeric_limits<float>::infinity()) continue;  // no key visible (a finished row)
      const float head_sink = sink[it.h * p.G + m % p.G];
      top = std::max(top, head_sink);
      total = std::exp(head_sink - top);  // 0 without a sink
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("kv_len")
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale")
                                  .Attr<float>("softcap")
                                  .Ret<ffi::Buffer<ffi::F32>>());
