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
#include <string>
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

// JSON's lexical state, enough to know where a key begins and ends; `levels`, the open containers:
// is_object() (the innermost), open(is_object), close(), add(key) (false: its object holds it).
struct Lexer {
  std::string key;  // the key being written
  bool in_string = false, escape = false, in_key = false, expect_key = false;

  // Reads byte c; false where it closes a key its object holds already.
  template <class Levels>
  bool read(uint8_t c, Levels& levels) {
    if (in_string) {
      if (escape) {
        escape = false;
      } else if (c == '\\') {
        escape = true;
      } else if (c == '"') {
        in_string = false;
        const bool closed = in_key;
        in_key = false;
        return !closed || levels.add(key);
      }
      if (in_key) key.push_back(static_cast<char>(c));
    } else if (c == '"') {
      in_string = true;
      in_key = expect_key && levels.is_object();
      expect_key = false;
      key.clear();
    } else if (c == '{' || c == '[') {
      levels.open(c == '{');
      expect_key = c == '{';
    } else if (c == '}' || c == ']') {
      levels.close();
      expect_key = false;
    } else if (c == ',') {
      expect_key = levels.is_object();
    }
    return true;
  }
};

// The keys of a JSON row's open objects, read from its bytes as they are made: a grammar cannot say
// "no key twice" (a context-free language cannot hold the keys written), and llguidance let
// `patternProperties` with `minProperties: 2` write {"b":0,"b":0}, which parses to one key and breaks
// the schema it was made under. Each mask then loses the tokens that would close a key its object
// already holds. Keys compare as written (escapes and all); the writer is compact JSON, which writes
// a key one way.
struct Keys {
  Lexer lexer;
  std::vector<std::vector<std::string>> objects;  // per open container (an array's: none), its keys
  std::vector<uint8_t> is_object;

  void feed(const uint8_t* bytes, size_t n) {  // bytes `refuses` did not refuse
    struct Own {
      Keys& k;
      bool is_object() const { return !k.is_object.empty() && k.is_object.back(); }
      void open(bool object) {
        k.objects.emplace_back();
        k.is_object.push_back(object);
      }
      void close() {
        if (!k.objects.empty()) {
          k.objects.pop_back();
          k.is_object.pop_back();
        }
      }
      bool add(const std::string& key) {
        k.objects.back().push_back(key);
        return true;
      }
    } own{*this};
    for (size_t i = 0; i < n; ++i) lexer.read(bytes[i], own);
  }

  // Whether `bytes` would close a key its object holds already: the containers below read where
  // they are, those the bytes open and the keys they add kept aside (a token is a few bytes).
  bool refuses(const uint8_t* bytes, size_t n) const {
    struct View {
      const Keys& k;
      size_t top;                                                     // the open containers below
      std::vector<std::pair<bool, std::vector<std::string>>> opened;  // containers the bytes open
      std::vector<std::pair<size_t, std::string>> added;              // keys they add to those below
      bool is_object() const { return opened.empty() ? top > 0 && k.is_object[top - 1] : opened.back().first; }
      void open(bool object) { opened.emplace_back(object, std::vector<std::string>{}); }
      void close() {
        if (!opened.empty()) {
          opened.pop_back();
        } else if (top > 0) {
          --top;
        }
      }
      bool add(const std::string& key) {
        if (!opened.empty()) {
          auto& held = opened.back().second;
          if (std::find(held.begin(), held.end(), key) != held.end()) return false;
          held.push_back(key);
          return true;
        }
        const auto& held = k.objects[top - 1];
        if (std::find(held.begin(), held.end(), key) != held.end()) return false;
        for (const auto& [level, name] : added)
          if (level == top - 1 && name == key) return false;
        added.emplace_back(top - 1, key);
        return true;
      }
    } view{*this, objects.size(), {}, {}};
    Lexer lexer = this->lexer;
    for (size_t i = 0; i < n; ++i)
      if (!lexer.read(bytes[i], view)) return true;
    return false;
  }
};

// Each token's bytes, and the tokens that hold a quote (only those can close a key).
struct Vocabulary {
  std::vector<uint32_t> start;  // token t's bytes are data[start[t], start[t + 1])
  std::vector<uint8_t> data;
  std::vector<int32_t> quoted;

  const uint8_t* bytes(int32_t t) const { return data.data() + start[t]; }
  size_t size(int32_t t) const { return start[t + 1] - start[t]; }
};

// One batch's matchers: a row's, or null where the row is free.
struct Set {
  int64_t batch, words;
  int32_t* masks;  // [batch, words]: the Python side's array (`Matchers.masks`), each row's next mask
  std::vector<LlgMatcher*> rows;
  std::vector<uint8_t> ended;  // the row's grammar is complete, or can go no further
  std::vector<uint8_t> json;   // the row's output is JSON: its keys are guarded (`Keys`)
  std::vector<Keys> keys;
  Vocabulary vocabulary;
  int64_t steps = 0;  // `advance` calls: one a decode step however many devices run it

  Set(int64_t batch, int64_t words, int32_t* masks, Vocabulary vocabulary)
      : batch(batch), words(words), masks(masks), rows(batch, nullptr), ended(batch, 0), json(batch, 0), keys(batch),
        vocabulary(std::move(vocabulary)) {}
  ~Set() {
    for (LlgMatcher* m : rows) llg.free_matcher(m);
  }

  int32_t* mask(int64_t row) { return masks + row * words; }

  bool fill(LlgMatcher* m, int32_t* dst) {
    return llg.compute_mask_into(m, reinterpret_cast<uint32_t*>(dst), words * sizeof(int32_t)) == 0;
  }

  // Clears from `dst` the tokens that would close a key `k`'s object holds already.
  void refuse_keys(const Keys& k, int32_t* dst) const {
    if (k.objects.empty()) return;  // no object open: no key to repeat
    for (int32_t t : vocabulary.quoted) {
      const int64_t w = t / 32;
      if (w < words && (dst[w] >> (t % 32) & 1) && k.refuses(vocabulary.bytes(t), vocabulary.size(t))) {
        dst[w] &= ~(int32_t{1} << (t % 32));
      }
    }
  }

  // refuse_keys, and where a key is being begun or written with few tokens to go on (the grammar's
  // keys are a small set: `patternProperties` of one letter), also each token after which nothing
  // would be left: {"g":0,"g could only close as "g" again, and the row would end there unfinished.
  // Looked ahead one token (m consumes it and is rolled back); free-form keys have thousands of
  // tokens to go on, and no dead end one token away to look for.
  static constexpr int kLookahead = 64;
  void guard(LlgMatcher* m, const Keys& k, int32_t* dst) {
    refuse_keys(k, dst);
    if (k.objects.empty() || !(k.lexer.in_key || (k.lexer.expect_key && k.is_object.back())) || k.objects.back().empty()) return;
    std::vector<int32_t> next;
    for (int64_t w = 0; w < words && static_cast<int>(next.size()) <= kLookahead; ++w)
      for (uint32_t bits = static_cast<uint32_t>(dst[w]); bits; bits &= bits - 1) next.push_back(static_cast<int32_t>(w * 32 + __builtin_ctz(bits)));
    if (static_cast<int>(next.size()) > kLookahead) return;
    std::vector<int32_t> after(words);
    for (int32_t t : next) {
      if (t + 1 >= static_cast<int32_t>(vocabulary.start.size()) || llg.consume_token(m, static_cast<uint32_t>(t)) != 0) continue;
      bool open = !llg.is_stopped(m) && !llg.is_error(m) && fill(m, after.data());
      if (open) {
        Keys ahead = k;
        ahead.feed(vocabulary.bytes(t), vocabulary.size(t));
        refuse_keys(ahead, after.data());
        open = std::any_of(after.begin(), after.end(), [](int32_t word) { return word != 0; });
      }
      (void)llg.rollback(m, 1);
      if (!open) dst[t / 32] &= ~(int32_t{1} << (t % 32));
    }
  }

  // Feeds the row's token to its matcher (and keys); false where the grammar (or a key twice) refuses it.
  bool consume(int64_t row, int32_t token, Keys& k) {
    const bool known = token >= 0 && token + 1 < static_cast<int32_t>(vocabulary.start.size());
    if (json[row] && known && k.refuses(vocabulary.bytes(token), vocabulary.size(token))) return false;
    if (llg.consume_token(rows[row], static_cast<uint32_t>(token)) != 0) return false;
    if (json[row] && known) k.feed(vocabulary.bytes(token), vocabulary.size(token));
    return true;
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
          if (made[i] >= 0 && !consume(row, made[i], keys[row])) break;
        }
        bool stop = llg.is_stopped(m) || llg.is_error(m) || !fill(m, mask(row));
        if (!stop && json[row]) guard(m, keys[row], mask(row));
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
      Keys k = json[row] ? keys[row] : Keys{};  // the drafts' keys, dropped with them
      for (int32_t i = 0; i < valid; ++i) {
        if (!consume(row, static_cast<int32_t>(drafts[i]), k)) break;
        if (llg.is_stopped(m)) {  // completes the match: left for the row's own token
          (void)llg.rollback(m, 1);
          break;
        }
        fill(m, masks_after + taken * words);
        if (json[row]) guard(m, k, masks_after + taken * words);
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

// A batch's matchers, all rows free; `masks` [batch, words] stays the caller's; the vocabulary's
// `vocab` tokens as llguidance's tokenizer takes them (`lens`, their bytes one after another in
// `data`), copied. Returns its id.
extern "C" int64_t jaxinfer_matchers_new(int64_t batch, int64_t words, int32_t* masks, int64_t vocab, const uint32_t* lens,
                                         const uint8_t* data) {
  jaxinfer::Vocabulary v;
  v.start.resize(vocab + 1, 0);
  for (int64_t t = 0; t < vocab; ++t) v.start[t + 1] = v.start[t] + lens[t];
  v.data.assign(data, data + v.start[vocab]);
  for (int64_t t = 0; t < vocab; ++t) {
    const uint8_t* b = v.bytes(static_cast<int32_t>(t));
    if (v.size(static_cast<int32_t>(t)) > 0 && b[0] != 0xFF && std::find(b, b + v.size(static_cast<int32_t>(t)), '"') != b + v.size(static_cast<int32_t>(t))) {
      v.quoted.push_back(static_cast<int32_t>(t));
    }
  }
  std::lock_guard<std::mutex> hold(jaxinfer::registry_lock);
  jaxinfer::registry.push_back(std::make_unique<jaxinfer::Set>(batch, words, masks, std::move(v)));
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
// `json`: the output is JSON, whose keys are guarded (`Keys`).
extern "C" void jaxinfer_matchers_start(int64_t id, int64_t row, void* matcher, bool json) {
  jaxinfer::Set* set = find(id);
  llg.free_matcher(set->rows[row]);
  set->rows[row] = static_cast<jaxinfer::LlgMatcher*>(matcher);
  set->ended[row] = 0;
  set->json[row] = json && matcher != nullptr;
  set->keys[row] = jaxinfer::Keys{};
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
