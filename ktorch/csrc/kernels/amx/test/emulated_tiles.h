// A software model of the eight AMX tile registers, so that the AMX kernels' tile walk (configurations,
// addresses, strides, which tile meets which) can be checked on a machine without AMX: kernels.cpp built
// with -DKTAMX_EMULATE calls these instead of the tile instructions. Semantics follow the Intel SDM for
// palette 1 (LDTILECFG, TILELOADD, TILESTORED, TILEZERO, TDPBSSD, TDPBF16PS), and every condition under
// which the hardware faults (#GP on a bad configuration, #UD on unconfigured tiles or mismatched shapes)
// aborts with a message instead. Loads and stores touch exactly rows x colsb bytes, as the hardware does,
// so AddressSanitizer reports a tile load that strays past a buffer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace kt::kernels::amx_emulation {

struct Tile {
  int rows = 0;
  int colsb = 0;
  uint8_t data[16][64];
};

struct TileState {
  bool configured = false;
  Tile tile[8];
};

inline TileState& state() {
  thread_local TileState s;
  return s;
}

[[noreturn]] inline void fault(const char* what, int t) {
  std::fprintf(stderr, "emulated AMX fault: %s (tmm%d)\n", what, t);
  std::abort();
}

inline void load_config(const void* cfg) {
  const auto* p = static_cast<const uint8_t*>(cfg);
  if (p[0] != 1) fault("LDTILECFG: palette must be 1", -1);
  if (p[1] != 0) fault("LDTILECFG: start_row must be 0", -1);
  for (int i = 2; i < 16; ++i)
    if (p[i] != 0) fault("LDTILECFG: reserved bytes must be 0", -1);
  TileState& s = state();
  for (int t = 0; t < 16; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, p + 16 + 2 * t, 2);
    const int rows = p[48 + t];
    if (t >= 8) {
      if (colsb != 0 || rows != 0) fault("LDTILECFG: palette 1 has 8 tiles", t);
      continue;
    }
    if (rows > 16 || colsb > 64 || (rows == 0) != (colsb == 0)) fault("LDTILECFG: bad tile shape", t);
    s.tile[t].rows = rows;
    s.tile[t].colsb = colsb;
    std::memset(s.tile[t].data, 0, sizeof(s.tile[t].data));
  }
  s.configured = true;
}

inline Tile& configured_tile(int t) {
  TileState& s = state();
  if (!s.configured) fault("tile instruction before LDTILECFG", t);
  if (t < 0 || t > 7) fault("no such tile", t);
  Tile& x = s.tile[t];
  if (x.rows == 0) fault("tile not configured", t);
  return x;
}

inline void load(int t, const void* base, long stride) {
  Tile& x = configured_tile(t);
  std::memset(x.data, 0, sizeof(x.data));
  for (int r = 0; r < x.rows; ++r) std::memcpy(x.data[r], static_cast<const uint8_t*>(base) + r * stride, x.colsb);
}

inline void store(int t, void* base, long stride) {
  Tile& x = configured_tile(t);
  for (int r = 0; r < x.rows; ++r) std::memcpy(static_cast<uint8_t*>(base) + r * stride, x.data[r], x.colsb);
}

inline void zero(int t) { std::memset(configured_tile(t).data, 0, sizeof(Tile::data)); }

// The shape rules shared by the dot-product instructions (SDM: #UD unless they hold).
inline void check_dp(const char* name, int c, int a, int b, int per) {
  Tile& C = configured_tile(c);
  Tile& A = configured_tile(a);
  Tile& B = configured_tile(b);
  if (c == a || c == b || a == b) fault(name, c);
  if (A.colsb % per != 0 || B.rows != A.colsb / per || C.colsb != B.colsb || C.rows != A.rows || C.colsb % 4 != 0)
    fault(name, c);
}

// C[m][n] += sum_k sum_j A[m][4k + j] * B[k][4n + j], int8 x int8 (TDPBSSD) or int8 x uint8 (TDPBSUD) -> int32.
template <typename BByte>
inline void dp_int8(const char* name, int c, int a, int b) {
  check_dp(name, c, a, b, 4);
  Tile& C = state().tile[c];
  const Tile& A = state().tile[a];
  const Tile& B = state().tile[b];
  for (int m = 0; m < C.rows; ++m)
    for (int n = 0; n < C.colsb / 4; ++n) {
      int32_t acc;
      std::memcpy(&acc, &C.data[m][4 * n], 4);
      for (int k = 0; k < A.colsb / 4; ++k)
        for (int j = 0; j < 4; ++j)
          acc += static_cast<int32_t>(static_cast<int8_t>(A.data[m][4 * k + j])) *
                 static_cast<int32_t>(static_cast<BByte>(B.data[k][4 * n + j]));
      std::memcpy(&C.data[m][4 * n], &acc, 4);
    }
}
inline void dp_s8(int c, int a, int b) { dp_int8<int8_t>("TDPBSSD: tile shapes do not match", c, a, b); }
inline void dp_su8(int c, int a, int b) { dp_int8<uint8_t>("TDPBSUD: tile shapes do not match", c, a, b); }

inline float bf16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// C[m][n] += sum_k A[m][2k] * B[k][2n] + A[m][2k + 1] * B[k][2n + 1], bf16 x bf16 -> fp32.
inline void dp_bf16(int c, int a, int b) {
  check_dp("TDPBF16PS: tile shapes do not match", c, a, b, 4);
  Tile& C = state().tile[c];
  const Tile& A = state().tile[a];
  const Tile& B = state().tile[b];
  for (int m = 0; m < C.rows; ++m)
    for (int n = 0; n < C.colsb / 4; ++n) {
      float acc;
      std::memcpy(&acc, &C.data[m][4 * n], 4);
      for (int k = 0; k < A.colsb / 4; ++k)
        for (int j = 0; j < 2; ++j) acc += bf16_to_float(&A.data[m][4 * k + 2 * j]) * bf16_to_float(&B.data[k][4 * n + 2 * j]);
      std::memcpy(&C.data[m][4 * n], &acc, 4);
    }
}

// The weight lines the kernels prefetch (not an instruction of AMX: a record, so that the test can check
// that prefetches stay inside the weights and cover what each walk promises to fetch ahead).
struct Prefetch {
  const void* line;
  bool to_l1;
};
struct PrefetchLog {
  bool on = false;
  std::vector<Prefetch> lines;
};

inline PrefetchLog& prefetch_log() {
  thread_local PrefetchLog log;
  return log;
}

inline void record_prefetch(const void* p, bool to_l1) {
  PrefetchLog& log = prefetch_log();
  if (log.on) log.lines.push_back({p, to_l1});
}

// The packed int4 bytes the kernels unpack into tile layout (a record, so that the test can count how often each
// weight line is unpacked: once a walk of up to 256 rows under the default walk).
struct Unpack {
  const void* src;
  long bytes;
};
struct UnpackLog {
  bool on = false;
  std::vector<Unpack> spans;
};

inline UnpackLog& unpack_log() {
  thread_local UnpackLog log;
  return log;
}

inline void record_unpack(const void* src, long bytes) {
  UnpackLog& log = unpack_log();
  if (log.on) log.spans.push_back({src, bytes});
}

}  // namespace kt::kernels::amx_emulation
