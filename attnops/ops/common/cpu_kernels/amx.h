// The AMX tile unit, shared by the bf16 GEMM (gemm_bf16.cpp) and the decode kernel (decode.cpp): whether this
// process may use it, and the tile configuration of a thread while it does.
//
// ATTNOPS_AMX is 1 where the build targets AVX512-BF16 and AMX-BF16 on Linux. amx_granted() then says whether the
// CPU has the unit and Linux lets the process use its state (asked once per process, for every thread; an inline
// function, so every source file of the library shares one answer). ATTNOPS_CPU_AMX=0 keeps the unit unused.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define ATTNOPS_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace attnops {

inline bool amx_granted() {
  static const bool granted = [] {
    const char* setting = std::getenv("ATTNOPS_CPU_AMX");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return (edx & kAmxBf16) && (edx & kAmxTile) && syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return granted;
}

// The tile configuration on the calling thread while in scope: all eight tiles 16 rows x 64 bytes (16 x 16 fp32
// sums, or 16 rows of 32 bf16 / 16 pairs x 16 columns of operands). Released on exit: no tile state is kept between
// calls.
class Tiles {
 public:
  Tiles() {
    Config config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
      config.rows[t] = 16;
      config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;

 private:
  struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
  };
};

}  // namespace attnops
#else
#define ATTNOPS_AMX 0
#endif
