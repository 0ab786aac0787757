// Constrained rows' matchers (llguidance's, through its C API), advanced inside the decode programs:
// `jaxinfer_constrain_advance` feeds each constrained row the tokens a step made and gives every
// row's next bitmask; `jaxinfer_constrain_check` gives the masks after a verifying pass's drafts
// (jaxinfer/matchers.py says what each returns). As a custom call they run on XLA's thread with no
// Python in between: through a Python callback, the hand-over (the GIL, numpy arrays each way, XLA's
// threads waking after it) cost ~0.12 ms a step, a quarter of the bundled model's, while the
// matchers' own work is a few µs. On other backends a Python callback reaches the same functions
// (`jaxinfer_matchers_advance`, `jaxinfer_matchers_check`).
//
// llguidance's functions are bound at run time (`jaxinfer_matchers_bind`, with the addresses its
// Python package's library exports), so the build needs neither its header nor its library.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxinfer {
namespace {

struct LlgMatcher;  // llguidance's, opaque

// The llguidance functions used here (its llguidance.h; each int32_t result is 0, or -1 on error).
struct Llg {
  int32_t (*consume_token)(LlgMatcher*, uint32_t);
  int32_t (*compute_mask_into)(LlgMatcher*, uint32_t*, size_t);
  bool (*is_stopped)(const LlgMatcher*);
  bool (*is_error)(const LlgMatcher*);
  int32_t (*validate_tokens)(LlgMatcher*, const uint32_t*, size_t);
  int32_t (*rollback)(LlgMatcher*, size_t);
  bool (*is_accepting)(LlgMatcher*);
  void (*free_matcher)(LlgMatcher*);
} llg;

// One batch's matchers: a row's, or null where the row is free.
struct Set {
  int64_t batch, words;
  int32_t* masks;  // [batch, words]: the Python side's array (`Matchers.masks`), each row's next mask
  std::vector<LlgMatcher*> rows;
  std::vector<uint8_t> ended;  // the row's grammar is complete, or can go no further
  int64_t steps = 0;           // `advance` calls: one a decode step however many devices run it

  Set(int64_t batch, int64_t words, int32_t* masks)
      : batch(batch), words(words), masks(masks), rows(batch, nullptr), ended(batch, 0) {}
  ~Set() {
    for (LlgMatcher* m : rows) llg.free_matcher(m);
  }

  int32_t* mask(int64_t row) { return masks + row * words; }

  bool fill(LlgMatcher* m, int32_t* dst) {
    return llg.compute_mask_into(m, reinterpret_cast<uint32_t*>(dst), words * sizeof(int32_t)) == 0;
  }

  // tokens [batch, t] (-1 where none) → out [batch, words + 1]
  void advance(const int32_t* tokens, int64_t t, int32_t* out) {
    ++steps;
    for (int64_t row = 0; row < batch; ++row) {
      const int32_t* made = tokens + row * t;
      bool any = false;
      for (int64_t i = 0; i < t; ++i) any |= made[i] >= 0;
      out[row * (words + 1) + words] = 0;
      // a row that made nothing (not running: the host may be starting it anew) is not read
      LlgMatcher* m = any ? rows[row] : nullptr;
      if (m != nullptr && !ended[row]) {
        for (int64_t i = 0; i < t; ++i) {
          if (made[i] >= 0 && llg.consume_token(m, static_cast<uint32_t>(made[i])) != 0) break;
        }
        bool stop = llg.is_stopped(m) || llg.is_error(m) || !fill(m, mask(row));
        bool none = true;
        for (int64_t w = 0; w < words && none; ++w) none = mask(row)[w] == 0;
        if (stop || none) {  // ended: its steps are discarded from now on; all bits set keeps their sampling finite
          ended[row] = 1;
          out[row * (words + 1) + words] = 1;
          std::memset(mask(row), 0xff, words * sizeof(int32_t));
        }
      }
      std::memcpy(out + row * (words + 1), mask(row), words * sizeof(int32_t));
    }
  }

  // drafted [batch, k + 1] (the drafts, then how many) → out [batch, k * words + 1]
  void check(const int32_t* drafted, int64_t k, int32_t* out) {
    for (int64_t row = 0; row < batch; ++row) {
      int32_t* masks_after = out + row * (k * words + 1);
      std::memset(masks_after, 0xff, k * words * sizeof(int32_t));
      int32_t& taken = masks_after[k * words];
      taken = static_cast<int32_t>(k);
      const int32_t* row_drafts = drafted + row * (k + 1);
      const int64_t n = std::min<int64_t>(std::max(row_drafts[k], 0), k);
      LlgMatcher* m = n > 0 ? rows[row] : nullptr;  // no drafts (or not running): as advance, not read
      if (m == nullptr || ended[row]) continue;
      std::vector<uint32_t> drafts(row_drafts, row_drafts + n);
      taken = 0;
      const int32_t valid = llg.validate_tokens(m, drafts.data(), drafts.size());
      for (int32_t i = 0; i < valid; ++i) {
        if (llg.consume_token(m, drafts[i]) != 0) break;
        if (llg.is_stopped(m)) {  // completes the match: left for the row's own token
          (void)llg.rollback(m, 1);
          break;
        }
        fill(m, masks_after + taken * words);
        ++taken;
      }
      (void)llg.rollback(m, taken);
    }
  }
};

std::mutex registry_lock;
std::vector<std::unique_ptr<Set>> registry;  // a set's id is its place + 1

Set* find(int64_t id) {
  std::lock_guard<std::mutex> hold(registry_lock);
  return id >= 1 && id <= static_cast<int64_t>(registry.size()) ? registry[id - 1].get() : nullptr;
}

ffi::Error Advance(ffi::Buffer<ffi::S32> tokens, ffi::ResultBuffer<ffi::S32> out, int64_t id) {
  Set* set = find(id);
  const auto dims = tokens.dimensions();
  if (set == nullptr || dims.size() != 2 || dims[0] != set->batch || static_cast<int64_t>(out->element_count()) != set->batch * (set->words + 1)) {
    return ffi::Error::InvalidArgument("jaxinfer_constrain_advance: no such matchers, or tokens of another batch");
  }
  set->advance(tokens.typed_data(), dims[1], out->typed_data());
  return ffi::Error::Success();
}

ffi::Error Check(ffi::Buffer<ffi::S32> drafted, ffi::ResultBuffer<ffi::S32> out, int64_t id) {
  Set* set = find(id);
  const auto dims = drafted.dimensions();
  if (set == nullptr || dims.size() != 2 || dims[0] != set->batch ||
      static_cast<int64_t>(out->element_count()) != set->batch * ((dims[1] - 1) * set->words + 1)) {
    return ffi::Error::InvalidArgument("jaxinfer_constrain_check: no such matchers, or drafts of another batch");
  }
  set->check(drafted.typed_data(), dims[1] - 1, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer

using jaxinfer::find;
using jaxinfer::llg;

// llguidance's functions, in `Llg`'s order.
extern "C" void jaxinfer_matchers_bind(void* const* functions) {
  static_assert(sizeof(jaxinfer::Llg) == 8 * sizeof(void*));
  std::memcpy(&llg, functions, sizeof(llg));
}

// A batch's matchers, all rows free; `masks` [batch, words] stays the caller's. Returns its id.
extern "C" int64_t jaxinfer_matchers_new(int64_t batch, int64_t words, int32_t* masks) {
  std::lock_guard<std::mutex> hold(jaxinfer::registry_lock);
  jaxinfer::registry.push_back(std::make_unique<jaxinfer::Set>(batch, words, masks));
  return static_cast<int64_t>(jaxinfer::registry.size());
}

extern "C" void jaxinfer_matchers_free(int64_t id) {
  std::unique_ptr<jaxinfer::Set> gone;
  std::lock_guard<std::mutex> hold(jaxinfer::registry_lock);
  if (id >= 1 && id <= static_cast<int64_t>(jaxinfer::registry.size())) gone = std::move(jaxinfer::registry[id - 1]);
}

// `row` constrained by `matcher` (taken over: freed with the set or the row's next one), its first
// mask already in the row of `masks`; a null matcher frees the row. A step in flight may run beside
// it: a row being started makes no tokens there, so the step reads no matcher of it (and the mask
// it copies out for it, the admission's prefill sets again).
extern "C" void jaxinfer_matchers_start(int64_t id, int64_t row, void* matcher) {
  jaxinfer::Set* set = find(id);
  llg.free_matcher(set->rows[row]);
  set->rows[row] = static_cast<jaxinfer::LlgMatcher*>(matcher);
  set->ended[row] = 0;
}

// Whether the row's text so far is a whole match (a free row's always is).
extern "C" bool jaxinfer_matchers_complete(int64_t id, int64_t row) {
  auto* m = find(id)->rows[row];
  return m == nullptr || (!llg.is_error(m) && llg.is_accepting(m));
}

extern "C" int64_t jaxinfer_matchers_steps(int64_t id) { return find(id)->steps; }

extern "C" void jaxinfer_matchers_advance(int64_t id, const int32_t* tokens, int64_t t, int32_t* out) {
  find(id)->advance(tokens, t, out);
}

extern "C" void jaxinfer_matchers_check(int64_t id, const int32_t* drafted, int64_t k, int32_t* out) {
  find(id)->check(drafted, k, out);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_constrain_advance, jaxinfer::Advance,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::S32>>().Attr<int64_t>("set"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxinfer_constrain_check, jaxinfer::Check,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::S32>>().Attr<int64_t>("set"));
