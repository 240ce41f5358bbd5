// What the kernels that run on AMX tiles share (stored_amx.cpp, decode_attention.cpp), after
// prelude.h: the tile registers asked of Linux, and the layout of a tile configuration
// (_tile_loadconfig). Each task loads its configuration and releases the tiles when done, so torch's
// own AMX GEMMs (oneDNN) and ours may run on the same threads.

#include <sys/syscall.h>
#include <unistd.h>

namespace {

// Linux lends the AMX tile registers only to processes that ask (arch_prctl, XFEATURE_XTILEDATA)
bool enable_amx() {
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace
