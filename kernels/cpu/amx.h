// AMX tile state shared by the amx level's kernels (linear.cpp, attention.cpp, qgemm.cpp): Linux's permission to use
// the tile registers and the one tile configuration every kernel here uses (8 tiles of 16 rows x 64 bytes).
#pragma once

#include "level.h"

#if GS_AMX
#include <c10/util/Exception.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace graphspec_amx {

// Linux hands out the tile registers' state only on request (arch_prctl, once per process, Linux 5.16+).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr int kGetPerm = 0x1022, kReqPerm = 0x1023, kXtileData = 18;
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return false;
    if (syscall(SYS_arch_prctl, kGetPerm, &bits) != 0) return false;
    return (bits & (1ul << kXtileData)) != 0;
  }();
  return ok;
}

// What a kernel says where Linux refused the tile state: `who` names the kernel.
inline void require_tiles(const char* who) {
  TORCH_CHECK(amx_permitted(), who, ": Linux did not grant this process the AMX tile state (arch_prctl "
              "ARCH_REQ_XCOMP_PERM; Linux 5.16 or newer); use GRAPHSPEC_CPU=avx512");
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {0};
  uint16_t colsb[16] = {0};
  uint8_t rows[16] = {0};
};

// Every tile 16 rows of 64 bytes. The configuration is thread state: set it at the start of each parallel task.
inline void configure_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

}  // namespace graphspec_amx

#endif  // GS_AMX
