// y[M, N] = x[M, K] @ W[N, K]^T on the CPU, as XLA FFI custom calls: `jaxinfer_qmatmul` for
// block-quantized W (`jaxinfer.quant`) and `jaxinfer_fmatmul` for float32/bfloat16 W
// (`jaxinfer.packed`); their `_routed` twins multiply rows each by its own matrix of a mixture's
// stack of experts (`forms.Experts`), read where it lies (`Expert`). Both keep 16 outputs side by
// side and share out the groups of 16 between this thread and XLA's pool; the paths that run a
// share are each instruction-set family's (paths.h).
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
//   (c, n, i) being k = 4 (c + 4 j) + i;  scale [N/16, K/32, 16] bfloat16. MXFP4 (`e2m1`): as int4,
//   each nibble an E2M1 code (paths.h's kE2M1Values, doubled) and the scale 2^(e - 128), which
//   bfloat16 holds exactly for every E8M0 exponent e.
// VNNI reads int8 weights as unsigned (q ^ 0x80 = q + 128) and int4 nibbles are q + 8, so every
// weight byte is an unsigned operand and the offset comes back as `offset * sum(xq)` per block;
// AVX2 multiplies |x| by w with x's sign instead (x86_avx2.cc). The scales are bfloat16 (ours) or
// float16 (llama.cpp's q8_0 / q4_0, `jaxinfer.quant`), widened to float32 where a block's sums are scaled.
#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "paths.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxinfer {
namespace {

// x's rows quantized per block of 32 (W8A8): int8 values, each block's scale and its values' sum.
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> xs;
  std::vector<int32_t> xsum;

  QuantizedRows(const Paths& run, const float* x, int64_t m, int64_t k_blocks)
      : xq(m * k_blocks * kBlock), xs(m * k_blocks), xsum(m * k_blocks) {
    run.quantize_rows(x, m, k_blocks, xq.data(), xs.data(), xsum.data());
  }
};

// A product checked and made ready, its groups of 16 outputs still to run: `share(g0, g1)` computes
// groups [g0, g1) (reading `state`, which it keeps alive); `group_bytes` sizes the threads' chunks.
struct Work {
  int64_t groups = 0;
  int64_t group_bytes = 1;
  std::function<void(int64_t, int64_t)> share;
};

void run_work(ffi::ThreadPool& pool, const Work& work) {
  if (work.groups > 0) parallel_items(pool, work.groups, work.group_bytes, work.share);
}

ffi::Error QPrepare(ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale, bool e2m1, ffi::ResultBuffer<ffi::F32> y,
                    Work* work) {
  const auto x_dims = x.dimensions();
  const auto q_dims = q.dimensions();
  const int bits = q.element_type() == ffi::DataType::S8 ? 8 : q.element_type() == ffi::DataType::U8 ? 4 : 0;
  if (bits == 0 || q_dims.size() != 5 || x_dims.size() == 0 || (e2m1 && bits != 4)) {
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: q must be int8 or uint8 [N/16, K/32, c, 16, 4] (MXFP4: uint8)");
  }
  const int64_t k = x_dims.back();
  const int64_t m = x.element_count() / std::max<int64_t>(k, 1);
  const int64_t groups = q_dims[0], k_blocks = q_dims[1];
  if (k != k_blocks * kBlock || q_dims[2] != (bits == 8 ? 8 : 4) || q_dims[3] != kGroup || q_dims[4] != 4) {
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: x and q disagree about K, or q is not packed");
  }
  const bool f16_scale = scale.element_type() == ffi::DataType::F16;
  if ((!f16_scale && scale.element_type() != ffi::DataType::BF16) || scale.element_count() != groups * k_blocks * kGroup) {
    return ffi::Error::InvalidArgument("jaxinfer_qmatmul: scale must be bfloat16 or float16 [N/16, K/32, 16]");
  }
  if (m == 0 || groups == 0) return ffi::Error::Success();

  const Paths& run = paths();
  struct State {
    QuantizedRows rows;
    QProblem problem;
  };
  auto state = std::make_shared<State>(State{QuantizedRows(run, x.typed_data(), m, k_blocks), {}});
  state->problem = QProblem{static_cast<const uint8_t*>(q.untyped_data()),
                            static_cast<const uint16_t*>(scale.untyped_data()),
                            y->typed_data(),
                            m, k_blocks, groups, bits, state->rows.xq.data(), state->rows.xs.data(), state->rows.xsum.data(), f16_scale,
                            e2m1};
  const QGroups share = run.qgroups[e2m1 ? 2 : bits == 8 ? 0 : 1];
  work->groups = groups;
  work->group_bytes = k_blocks * (bits == 8 ? 512 : 256) * std::max<int64_t>(1, m / 4);
  work->share = [state, share](int64_t g0, int64_t g1) { share(state->problem, g0, g1); };
  return ffi::Error::Success();
}

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q,
                   ffi::AnyBuffer scale, bool e2m1, ffi::ResultBuffer<ffi::F32> y) {
  Work work;
  const ffi::Error error = QPrepare(x, q, scale, e2m1, y, &work);
  if (error.success()) run_work(pool, work);
  return error;
}

// llama.cpp's formats of paths.h's KProblem (`kind`: its KKind): q [N/16, K/32, bits, 16, 4] uint8,
// sub [N/16, K/32, 2, 16] uint8 (the k-quants; empty for the others), super [N/16, K/32/per, supers,
// 16] float16.
ffi::Error KPrepare(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::U8> sub, ffi::Buffer<ffi::F16> super,
                    int64_t kind, ffi::ResultBuffer<ffi::F32> y, Work* work) {
  const auto x_dims = x.dimensions();
  const auto q_dims = q.dimensions();
  if (kind < 0 || kind >= kKinds) return ffi::Error::InvalidArgument("jaxinfer_kmatmul: unknown kind");
  if (q_dims.size() != 5 || x_dims.size() == 0 || q_dims[2] != k_bits(kind) || q_dims[3] != kGroup || q_dims[4] != 4) {
    return ffi::Error::InvalidArgument("jaxinfer_kmatmul: q must be uint8 [N/16, K/32, bits, 16, 4]");
  }
  const int64_t k = x_dims.back();
  const int64_t m = x.element_count() / std::max<int64_t>(k, 1);
  const int64_t groups = q_dims[0], k_blocks = q_dims[1];
  const int64_t subs = kind <= kQ6K ? groups * k_blocks * 2 * kGroup : 0;
  if (k != k_blocks * kBlock || k_blocks % k_per(kind) != 0 || sub.element_count() != subs ||
      super.element_count() != groups * (k_blocks / k_per(kind)) * k_supers(kind) * kGroup) {
    return ffi::Error::InvalidArgument("jaxinfer_kmatmul: x, q, sub and super disagree about N or K");
  }
  if (m == 0 || groups == 0) return ffi::Error::Success();
  const Paths& run = paths();
  struct State {
    QuantizedRows rows;
    std::vector<int32_t> xhalf;  // Q6_K's halves: the first 16 values' sum
    KProblem problem;
  };
  auto state = std::make_shared<State>(State{QuantizedRows(run, x.typed_data(), m, k_blocks), {}, {}});
  state->xhalf.assign(kind == kQ6K ? m * k_blocks : 0, 0);
  for (size_t at = 0; at < state->xhalf.size(); ++at) {
    for (int i = 0; i < kBlock / 2; ++i) state->xhalf[at] += state->rows.xq[at * kBlock + i];
  }
  state->problem = KProblem{q.typed_data(), sub.typed_data(), reinterpret_cast<const uint16_t*>(super.typed_data()), y->typed_data(),
                            m, k_blocks, groups, static_cast<int>(kind), state->rows.xq.data(), state->rows.xs.data(),
                            state->rows.xsum.data(), state->xhalf.data()};
  const KGroups share = run.kgroups[kind];
  work->groups = groups;
  work->group_bytes = k_blocks * state->problem.weight_bytes() * std::max<int64_t>(1, m / 4);
  work->share = [state, share](int64_t g0, int64_t g1) { share(state->problem, g0, g1); };
  return ffi::Error::Success();
}

ffi::Error KMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> q, ffi::Buffer<ffi::U8> sub,
                   ffi::Buffer<ffi::F16> super, int64_t kind, ffi::ResultBuffer<ffi::F32> y) {
  Work work;
  const ffi::Error error = KPrepare(x, q, sub, super, kind, y, &work);
  if (error.success()) run_work(pool, work);
  return error;
}

// ------------------------------------------------------------------------------- float weights
// Float W (`jaxinfer.packed`, paths.h's FProblem): 16 outputs side by side, so one vector of W and
// one broadcast of x advance 16 dots.
// XLA CPU runs a dot of 2–9 rows at about half its matrix-vector rate and converts bfloat16 weights
// to float32 on every call (../shared/JAX-ON-CPU.md); here every weight is read once for all the
// rows, in the width it is stored in, and the sums are float32. With `bf16_inputs` (x rounded to
// bfloat16), bfloat16 weights go to AMX (16 rows on) or VDPBF16PS (`Paths::bf16_dot`) where the CPU
// has them: the pair layout is what both take.

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
  const Paths& run = paths();
  if (bf16 && m >= kAmxMinRows && run.amx) {
    run.amx(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()), y->typed_data(), m, k, groups, bf16_inputs);
    return ffi::Error::Success();
  }
  FProblem problem{x.typed_data(), w.untyped_data(), y->typed_data(), m, k, groups};
  FGroups share = run.fgroups[bf16 ? 1 : 0];
  thread_local std::vector<float> rounded;
  thread_local std::vector<uint16_t> rounded_bits;
  if (bf16_inputs && bf16 && run.bf16_dot) {
    rounded_bits.resize(static_cast<size_t>(m * k));
    run.round_bits(problem.x, rounded_bits.data(), m * k);
    problem.x_bf16 = rounded_bits.data();
    share = run.bf16_dot;
  } else if (bf16_inputs) {
    rounded.resize(static_cast<size_t>(m * k));
    run.round(problem.x, rounded.data(), m * k);
    problem.x = rounded.data();
  }
  const int64_t tiles = (groups + kTileGroups - 1) / kTileGroups;
  const int64_t tile_bytes = kTileGroups * k * kGroup * (bf16 ? 2 : 4) * std::max<int64_t>(1, m / 6);
  parallel_items(pool, tiles, tile_bytes, [&problem, share](int64_t t0, int64_t t1) {
    share(problem, t0 * kTileGroups, std::min(problem.groups, t1 * kTileGroups));
  });
  return ffi::Error::Success();
}

// ------------------------------------------------------------------------------- experts
// A mixture's stack of E matrices [E, ...] (`forms.Experts`). Sliced in the graph, an expert's bytes
// were copied out of the stack before the kernel read them; here the stack's buffer is viewed as
// that one matrix.

class Expert {
 public:
  // Matrix `e` of `stack`: the same type, one leading axis fewer, its data where it lies. An empty
  // buffer (a format without sub-scales) stays as it is.
  Expert(const ffi::AnyBuffer& stack, int64_t e) {
    const auto dims = stack.dimensions();
    const bool empty = stack.element_count() == 0;
    const size_t bytes = empty ? 0 : stack.size_bytes() / dims[0];
    buf_ = {XLA_FFI_Buffer_STRUCT_SIZE,
            nullptr,
            static_cast<XLA_FFI_DataType>(stack.element_type()),
            static_cast<char*>(stack.untyped_data()) + e * bytes,
            static_cast<int64_t>(dims.size()) - (empty ? 0 : 1),
            const_cast<int64_t*>(dims.begin()) + (empty ? 0 : 1)};
  }
  const XLA_FFI_Buffer* get() const { return &buf_; }

 private:
  XLA_FFI_Buffer buf_;
};

// ------------------------------------------------------------------------------- routed rows
// A layer's (row, expert) pairs in one call (ggml's `mul_mat_id`): y[r] = x[r] @ W[expert[r]]^T for
// rows x [R, K], each routed to its own matrix of the stack. The rows are grouped by expert (a
// counting sort), each expert with rows runs the product above on all of them, read once where it
// lies in the stack, and an expert no row picked is never read. In the graph, each pair (or tile of
// one expert's rows) was a call of its own inside XLA's loop: 8 layers of 64 experts at 16 rows a
// step made 1,344 calls a step.

// run(expert, its rows [c, K], their products [c, N], &work) -> ffi::Error: computes them, or leaves
// its groups in `work`, which run here in one parallel region with every other expert's (each
// expert's own region made the threads meet once per expert: 1,344 times a step at batch 16).
template <typename Run>
ffi::Error routed(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32> x, int64_t experts, ffi::Buffer<ffi::S32> expert,
                  ffi::ResultBuffer<ffi::F32> y, Run run) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() == 0) return ffi::Error::InvalidArgument("routed product: x must be [R, K]");
  const int64_t k = x_dims.back();
  const int64_t rows = x.element_count() / std::max<int64_t>(k, 1);
  const int64_t n = y->dimensions().back();
  if (static_cast<int64_t>(expert.element_count()) != rows) {
    return ffi::Error::InvalidArgument("routed product: one expert a row");
  }
  const int32_t* ids = expert.typed_data();
  std::vector<int64_t> starts(experts + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    if (ids[r] < 0 || ids[r] >= experts) return ffi::Error::InvalidArgument("routed product: no such expert");
    ++starts[ids[r] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> order(rows), at(starts.begin(), starts.end() - 1);
  for (int64_t r = 0; r < rows; ++r) order[at[ids[r]]++] = r;
  std::vector<float> xs(rows * k), ys(rows * n);
  for (int64_t i = 0; i < rows; ++i) std::copy_n(x.typed_data() + order[i] * k, k, xs.data() + i * k);
  std::vector<Work> works;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = starts[e], count = starts[e + 1] - first;
    if (count == 0) continue;
    int64_t x_shape[2] = {count, k}, y_shape[2] = {count, n};
    XLA_FFI_Buffer xb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_F32, xs.data() + first * k, 2, x_shape};
    XLA_FFI_Buffer yb{XLA_FFI_Buffer_STRUCT_SIZE, nullptr, XLA_FFI_DataType_F32, ys.data() + first * n, 2, y_shape};
    Work work;
    const ffi::Error error = run(e, ffi::Buffer<ffi::F32>(&xb), ffi::ResultBuffer<ffi::F32>(ffi::Buffer<ffi::F32>(&yb)), &work);
    if (error.failure()) return error;
    if (work.groups > 0) works.push_back(std::move(work));
  }
  int64_t items = 0, item_bytes = 1;
  std::vector<int64_t> firsts;  // each work's first item
  for (const Work& work : works) {
    firsts.push_back(items);
    items += work.groups;
    item_bytes = std::max(item_bytes, work.group_bytes);
  }
  if (items > 0) {
    parallel_items(pool, items, item_bytes, [&works, &firsts](int64_t i0, int64_t i1) {
      size_t w = std::upper_bound(firsts.begin(), firsts.end(), i0) - firsts.begin() - 1;
      for (int64_t i = i0; i < i1; ++w) {  // [i, end) within work w
        const int64_t end = std::min(i1, firsts[w] + works[w].groups);
        works[w].share(i - firsts[w], end - firsts[w]);
        i = end;
      }
    });
  }
  for (int64_t i = 0; i < rows; ++i) std::copy_n(ys.data() + i * n, n, y->typed_data() + order[i] * n);
  return ffi::Error::Success();
}

ffi::Error QMatmulRouted(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer scale,
                         ffi::Buffer<ffi::S32> expert, bool e2m1, ffi::ResultBuffer<ffi::F32> y) {
  if (q.dimensions().size() == 0) return ffi::Error::InvalidArgument("jaxinfer_qmatmul_routed: q must be a stack");
  return routed(pool, x, q.dimensions()[0], expert, y,
                [&](int64_t e, ffi::Buffer<ffi::F32> rows, ffi::ResultBuffer<ffi::F32> out, Work* work) {
                  const Expert q_e(q, e), scale_e(scale, e);
                  return QPrepare(rows, ffi::AnyBuffer(q_e.get()), ffi::AnyBuffer(scale_e.get()), e2m1, out, work);
                });
}

ffi::Error KMatmulRouted(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer q, ffi::AnyBuffer sub,
                         ffi::AnyBuffer super, ffi::Buffer<ffi::S32> expert, int64_t kind, ffi::ResultBuffer<ffi::F32> y) {
  if (q.dimensions().size() == 0 || q.element_type() != ffi::DataType::U8 || sub.element_type() != ffi::DataType::U8 ||
      super.element_type() != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument("jaxinfer_kmatmul_routed: q and sub must be uint8 stacks, super float16");
  }
  return routed(pool, x, q.dimensions()[0], expert, y,
                [&](int64_t e, ffi::Buffer<ffi::F32> rows, ffi::ResultBuffer<ffi::F32> out, Work* work) {
                  const Expert q_e(q, e), sub_e(sub, e), super_e(super, e);
                  return KPrepare(rows, ffi::Buffer<ffi::U8>(q_e.get()), ffi::Buffer<ffi::U8>(sub_e.get()),
                                  ffi::Buffer<ffi::F16>(super_e.get()), kind, out, work);
                });
}

ffi::Error FMatmulRouted(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::Buffer<ffi::S32> expert,
                         bool bf16_inputs, ffi::ResultBuffer<ffi::F32> y) {
  if (w.dimensions().size() == 0) return ffi::Error::InvalidArgument("jaxinfer_fmatmul_routed: w must be a stack");
  return routed(pool, x, w.dimensions()[0], expert, y,  // each expert in a region of its own (AMX takes its own)
                [&](int64_t e, ffi::Buffer<ffi::F32> rows, ffi::ResultBuffer<ffi::F32> out, Work*) {
                  const Expert w_e(w, e);
                  return FMatmul(pool, rows, ffi::AnyBuffer(w_e.get()), bf16_inputs, out);
                });
}

}  // namespace
}  // namespace jaxinfer

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_qmatmul_routed, jaxinfer::QMatmulRouted,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<bool>("e2m1")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_kmatmul_routed, jaxinfer::KMatmulRouted,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("kind")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_fmatmul_routed, jaxinfer::FMatmulRouted,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<bool>("bf16_inputs")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_qmatmul, jaxinfer::QMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("e2m1")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_kmatmul, jaxinfer::KMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Attr<int64_t>("kind")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_fmatmul, jaxinfer::FMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<bool>("bf16_inputs")
                                  .Ret<ffi::Buffer<ffi::F32>>());
