// What the CPU kernels share: what the CPU has, bfloat16 bits, and sharing work out with XLA's pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
// AMX code needs a compiler that knows its intrinsics (GCC 11, clang 12); an older one builds the
// rest of the kernels without it rather than failing the whole build.
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define JAXINFER_AMX 1
#endif
// VDPBF16PS's intrinsics likewise (GCC 10, clang 9), and AVX-VNNI's (GCC 11, clang 12).
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10)
#define JAXINFER_AVX512_BF16 1
#endif
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define JAXINFER_AVX_VNNI 1
#endif
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif
#if defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxinfer {

// JAXINFER_ISA and the tests cap the paths a CPU takes, to compare each with the one below it: its
// best; its best family without matrix units (AMX); the base vector family with its dot product
// (x86: AVX2 with AVX-VNNI, no AVX-512: Alder Lake; ARM: NEON with SDOT); the base vector family
// alone (x86: AVX2 + FMA, Zen 1-3; ARM: NEON without SDOT); the portable C++.
enum Cap : int { kNative = 0, kNoAmx = 1, kBaseDot = 2, kBaseVectors = 3, kPortable = 4 };
inline std::atomic<int> isa_cap{kNative};

// What this CPU has, asked once. The kernels never ask: `paths()` (paths.h) picks their table by
// these and the cap.
struct Cpu {
  bool avx2 = false;         // AVX2 + FMA (Haswell, Zen 1 on)
  bool avx_vnni = false;     // VPDPBUSD on 256 bits, VEX-coded (Alder Lake, Zen 4 on): CPUID 7.1 EAX bit 4
  bool avx512 = false;       // AVX-512 F, BW and VL (Skylake-X, Zen 4 on)
  bool avx512_vnni = false;  // VPDPBUSD on 512 bits
  bool avx512_bf16 = false;  // VDPBF16PS (Cooper Lake, Sapphire Rapids, Zen 4 on): CPUID 7.1 EAX bit 5
  bool amx = false;          // AMX's bfloat16 tiles, and Linux lets this process use them
  bool dotprod = false;      // ARM's SDOT (ARMv8.2's dot-product extension: Apple M1, Graviton 2 on)
};

inline const Cpu& cpu() {
  static const Cpu facts = [] {
    Cpu c;
#if defined(__x86_64__)
    unsigned a, b, cx, d;
    c.avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    // (not __builtin_cpu_supports("avxvnni"): GCC 12's libgcc said no on a Zen 4 that has it)
    c.avx_vnni = c.avx2 && __get_cpuid_count(7, 1, &a, &b, &cx, &d) && (a & (1u << 4));
    c.avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    c.avx512_vnni = c.avx512 && __builtin_cpu_supports("avx512vnni");
    c.avx512_bf16 = c.avx512 && __get_cpuid_count(7, 1, &a, &b, &cx, &d) && (a & (1u << 5));
#if defined(JAXINFER_AMX)
    // AMX-BF16 is CPUID 7.0 EDX bit 22, AMX-TILE bit 24; the tile data must be asked of Linux
    // (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: other kernels ask too, and asking twice
    // is harmless)
    if (c.avx512 && __get_cpuid_count(7, 0, &a, &b, &cx, &d) && (d & (1u << 22)) && (d & (1u << 24))) {
      constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
      c.amx = syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
    }
#endif
#endif
#if defined(__aarch64__) && defined(__linux__)
    c.dotprod = getauxval(AT_HWCAP) & (1ul << 20);  // HWCAP_ASIMDDP
#elif defined(__aarch64__) && defined(__APPLE__)
    int has = 0;
    size_t size = sizeof has;
    c.dotprod = sysctlbyname("hw.optional.arm.FEAT_DotProd", &has, &size, nullptr, 0) == 0 && has;
#endif
    return c;
  }();
  return facts;
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// IEEE half (float16) bits → float, exactly (subnormals included; the portable path's, where no
// conversion instruction is compiled in).
inline float f16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF;
  uint32_t word;
  if (exponent == 0x1F) {
    word = sign | 0x7F800000u | (mantissa << 13);  // inf, nan
  } else if (exponent != 0) {
    word = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else {  // zero or subnormal: mantissa · 2^-24
    const float value = std::ldexp(static_cast<float>(mantissa), -24);
    std::memcpy(&word, &value, sizeof word);
    word |= sign;
  }
  float value;
  std::memcpy(&value, &word, sizeof value);
  return value;
}

// Work is shared out in chunks between this thread and XLA's intra-op pool. Whoever is free
// takes the next chunk, and the caller waits only for chunks already taken, so a pool that is busy
// (or absent) costs speed, never a deadlock. The state is shared, not on this stack: a pool task may
// start after the call has returned and must find nothing left to do.
struct Shared {
  std::function<void(int64_t, int64_t)> run;  // items [i0, i1)
  int64_t items, chunk_items, chunks;
  std::atomic<int64_t> next{0}, finished{0};

  void work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      run(c * chunk_items, std::min(items, (c + 1) * chunk_items));
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs `run` over [0, items) on this thread and the pool, in chunks of a quarter of a thread's share
// (a few per thread even out the finish), at most ~1 MiB of work (`item_bytes` per item) each: a
// chunk's weights stream from memory as one run the prefetchers follow. Decode's matmuls one after
// another (each waiting for the last, as in a model), 2 Zen 4 cores: q4_0 31 → 42 GB/s, Q4_K 32 → 38,
// Q6_K 26 → 33 when chunks of at most 32 KiB became 1 MiB. `run` may read the caller's stack: it is
// only called before the caller returns.
inline void parallel_items(xla::ffi::ThreadPool& pool, int64_t items, int64_t item_bytes, std::function<void(int64_t, int64_t)> run) {
  auto shared = std::make_shared<Shared>();
  shared->run = std::move(run);
  shared->items = items;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t by_size = std::max<int64_t>(1, (int64_t{1024} << 10) / std::max<int64_t>(1, item_bytes));
  shared->chunk_items = std::min(by_size, std::max<int64_t>(1, items / (4 * threads)));
  shared->chunks = (items + shared->chunk_items - 1) / shared->chunk_items;
  const int64_t helpers = std::min(threads - 1, shared->chunks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([shared] { shared->work(); });
  shared->work();
  while (shared->finished.load(std::memory_order_acquire) < shared->chunks) std::this_thread::yield();
}

}  // namespace jaxinfer
