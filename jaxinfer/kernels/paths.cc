// The table of paths for this CPU under each cap, built once per cap on first use.
#include <mutex>

#include "paths.h"

namespace jaxinfer {

const Paths& paths() {
  static Paths tables[kPortable + 1];
  static std::once_flag built[kPortable + 1];
  const int cap = std::clamp(isa_cap.load(std::memory_order_relaxed), static_cast<int>(kNative), static_cast<int>(kPortable));
  std::call_once(built[cap], [cap] {
    Paths& t = tables[cap];
    add_generic(t);
    if (cap < kPortable) {
      add_avx2(t, cap < kBaseVectors);
      add_neon(t, cap < kBaseVectors);
    }
    if (cap < kBaseDot) add_avx512(t, cap < kNoAmx);
  });
  return tables[cap];
}

}  // namespace jaxinfer

// JAXINFER_ISA and the tests: 0 the CPU's best paths, 1 no AMX, 2 the base vector family with its dot
// product (AVX2 with AVX-VNNI, NEON with SDOT), 3 without it (AVX2, NEON), 4 the portable ones.
extern "C" void jaxinfer_cap_isa(int cap) { jaxinfer::isa_cap.store(cap); }

// The paths taken under the current cap (`jaxinfer.kernel.isa()`): the family, then what it adds.
extern "C" const char* jaxinfer_kernel_isa() { return jaxinfer::paths().name.c_str(); }
