// AMX kernels (AMX-TILE, AMX-BF16, AMX-INT8; AVX-512 for unpacking and epilogues), for the packed layouts
// in kernels.h. C[m][16b + c] = sum_k A[m][k] * W[16b + c][k] for m < M, b < nblocks, fp32 out:
//   bf16: C += TDPBF16PS(A: 16 rows x 32 k bf16, B: 16 k-pairs x 16 columns)            fp32 accumulate
//   int8: acc += TDPBSSD(A: 16 rows x 64 k int8, B: 16 k-quads x 16 columns int8);  C = acc * s_w[n] * s_x[m]
//   int4: per group g: acc_g = TDPBSSD(A, B_g), B_g = the nibbles unpacked to q - 8 (signed, [-8, 7]) in a
//         thread-local buffer;  C = s_x[m] * sum_g acc_g * s_w[g][n]
//   coded int4 (b_codes, MXFP4): B_g = codes[nibble] (a byte shuffle of the table), otherwise as symmetric int4
//   affine int4 with two-level scales (b_sub: GGUF Q4_K at the file's size): per super-block of 256, B = sub * u as
//         two unsigned byte planes h, l (sub * u = 256 h + l), acc_h += TDPBSUD(A, H), acc_l += TDPBSUD(A, L);
//         C = s_x[m] * sum_sb ((256 acc_h + acc_l) * super[sb][n] - sum_{g in sb} sum_g(x) * min[g][n])
//   int8 with two-level scales (GGUF Q6_K: codes in [-32, 31], signed sub-scales per 16; Q5_K: codes [0, 31],
//         unsigned per 32, minimums): the same two-plane walk, B = sub * q = 256 h + l with h signed (TDPBSSD) and l
//         unsigned (TDPBSUD)
//   symmetric int4 with two-level scales (ktorch's int4: sub-scales <= 15): B = sub * (u - 8), one signed plane;
//         acc = TDPBSSD over all of K (or a super-block);  C = s_x[m] * sum acc * super[n]
// Signed int8 x signed int8 needs no unsigned offset, so a_gsum is not read here (only for the affine minimums).
//   grouped int8 with float32 scales (GGUF Q8_0): the codes are the B tiles; per group g acc_g = TDPBSSD(A, B_g), then
//         as int4 (calls of at least kMinRowsGroupedInt8 rows)
// Other grouped/affine int8 (Q6_K/Q5_K with float32 scales) and affine int4 with float32 scales go to the AVX-512
// kernel (gemm_amx).
// The int8/int4 results equal the AVX-512 kernels' bit for bit (same integer sums, same fp32 operations in
// the same order), except the two-level walks (their integer sums span super-blocks: within fp32 rounding); bf16
// differs in fp32 rounding order only.
//
// Layout: the packed weights already are AMX B tiles. bf16 [K/2][16][2] and int8 [K/4][16][4]: one 32-deep
// (bf16) or 64-deep (int8) chunk of a 16-column block is one contiguous 1 KB tile, 16 rows of 64 B. int4
// [K/8][16][4]: a 64-byte line (8 k of 16 columns) unpacks to two tile rows, its low nibbles (k 8o..8o+3)
// then its high nibbles (k 8o+4..8o+7).
//
// Blocking: C tiles tmm0-3 form a 2 x 2 block (32 rows x 32 columns), A tiles tmm4-5, B tiles tmm6-7. Each
// block walks the whole K with its accumulators in the tiles (int4: one group at a time, then the group's
// sums are scaled into fp32 accumulators in L1). Column pairs are the outer loop, row pairs the inner one:
// a column pair's weights come from memory on its first row pair (prefetched a few tiles ahead) and from
// L2 on the others, and the next column pair (or the caller's next call's first one) is prefetched into L2 spread
// over the passes. Every format walks up to 256 rows at once; int4 unpacks a column pair's nibbles once a walk, on
// its first row pair (a few steps ahead of the tile loads), into a buffer its later row pairs read, and scales each
// group's sums right after the group; see "tile walk selection" and docs/amx.md.
// Activation rows: a 16-row group whose rows are evenly strided (e.g. the driver's down-projection input)
// is tile-loaded in place; otherwise its rows are copied into a thread-local buffer first.
//
// Limits: K % 32 == 0. int8 with K % 64 == 32 runs its last 32-deep step on a zero-padded copy of the B
// tiles. int4 group_size % 32 == 0; groups of 32 use 32-deep tiles (a second tile configuration: A 32
// bytes a row, B 8 rows). Any M (cut into walks of at most 256 rows) and nblocks.
// Small M: below a per-format row count the call goes to the AVX-512 kernel (decode is memory-bound and
// AVX-512 wastes no tile rows); the counts are kMinRows.
// Tile configuration: loaded (LDTILECFG) at the start of every call, since other code on the same thread
// (oneDNN, another config of ours) may have loaded its own; never released.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "../kernels.h"
#include "../avx512/scales.h"

#define KTAMX_COMPILER_BARRIER() asm volatile("" ::: "memory")

#if defined(KTAMX_EMULATE)
// Software tiles for checking the tile walk on machines without AMX (test/amx_kernels_test.cpp).
#include "test/emulated_tiles.h"
#define KTAMX_TILE_CONFIG(cfg) ::kt::kernels::amx_emulation::load_config(cfg)
#define KTAMX_TILE_LOAD(t, base, stride) ::kt::kernels::amx_emulation::load(t, base, stride)
#define KTAMX_TILE_STORE(t, base, stride) ::kt::kernels::amx_emulation::store(t, base, stride)
#define KTAMX_TILE_ZERO(t) ::kt::kernels::amx_emulation::zero(t)
#define KTAMX_TILE_DP_BF16(c, a, b) ::kt::kernels::amx_emulation::dp_bf16(c, a, b)
#define KTAMX_TILE_DP_S8(c, a, b) ::kt::kernels::amx_emulation::dp_s8(c, a, b)
#define KTAMX_TILE_DP_SU8(c, a, b) ::kt::kernels::amx_emulation::dp_su8(c, a, b)
#define KTAMX_RECORD_PREFETCH(p, to_l1) ::kt::kernels::amx_emulation::record_prefetch(p, to_l1)
#define KTAMX_RECORD_UNPACK(p, bytes) ::kt::kernels::amx_emulation::record_unpack(p, bytes)
#else
// gcc's tile intrinsics paste the register number into the instruction text, so tile arguments must be
// literals. Their TILELOADD asm does not declare that it reads memory: buffers filled with ordinary stores
// are fenced with KTAMX_COMPILER_BARRIER before their tiles are loaded (LDTILECFG likewise).
#define KTAMX_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define KTAMX_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define KTAMX_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define KTAMX_TILE_ZERO(t) _tile_zero(t)
#define KTAMX_TILE_DP_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define KTAMX_TILE_DP_S8(c, a, b) _tile_dpbssd(c, a, b)
#define KTAMX_TILE_DP_SU8(c, a, b) _tile_dpbsud(c, a, b)
#define KTAMX_RECORD_PREFETCH(p, to_l1) ((void)0)
#define KTAMX_RECORD_UNPACK(p, bytes) ((void)0)
#endif

namespace kt::kernels {
namespace {

constexpr int64_t kTileBytes = 1024;  // a full tile: 16 rows of 64 bytes
constexpr int kPrefetchSteps = 4;     // B tiles fetched this many k steps ahead on a column pair's first pass
constexpr int kUnpackAhead = 2;       // int4: a column pair's first pass unpacks the B tiles this many k steps ahead
constexpr int kMaxWalkRows = 256;     // rows per tile walk (16 row groups); larger calls are cut

// ---------------------------------------------------------------- small-M threshold
// Calls with fewer rows than this go to the AVX-512 kernel. Chosen from a device sweep of whole layers
// (benchmarks/bench_vs_kt_kernel.py swept them; see docs/amx.md).
constexpr int kMinRows[kNumFormats] = {2, 8, 16};  // bf16, int8, int4: measured, docs/amx.md
// Grouped int8 (GGUF Q8_0, grouped_int8_walk): its group-wise walk lost 9% to the AVX-512 kernel in a Qwen3-30B-A3B
// layer at T = 512 (about 32 rows an expert) and won 1.37x at T = 2048 (about 128): device, session 50, docs/amx.md.
constexpr int kMinRowsGroupedInt8 = 64;
// amx_min_rows_for_tests: a row count every format uses instead (0: every M through the tiles); -1: kMinRows.
std::atomic<int> g_test_min_rows{-1};

// ---------------------------------------------------------------- tile walk selection
// The order of the tile walk (docs/amx.md, "The tile walk": what the device measured fastest for bf16 and int8):
//   rows   (every format) column pairs outer, row pairs inner, over all rows of a call (walks of up to 256), and the
//                         weights of the next column pair, or of the caller's next call (next_b), prefetched into L2
//                         spread over every pass. int4 unpacks each column pair once a walk, kUnpackAhead k steps
//                         ahead of the tile loads of its first row pair, and runs each group's epilogue (its sums
//                         scaled into fp32) in place, right after the group's tile products.
// Variants measured and removed with their environment switches (benchmarks/RESULTS.md): k cut into chunks that
// stay in L1 ('kblock': +3-4% at T=512, slower at T=2048, within the spread, session 9; slower again in sessions 12
// and 20), A tiles prefetched into L1 ('+pfa', session 9: no row faster), thinner or no L2 prefetch of the next
// weights and no B tiles into L1 ahead (session 17: within 10% at 128 rows an expert, thinning only loses), no
// prefetch of the next A rows (session 20: the layer no faster, int8 T=2048 18.5 against 20.5 ms). int4 (session
// 32, docs/amx.md): 64-row walks unpacking right before each step's tile loads ('pairs', 1-12% slower), and each
// group's epilogue deferred into the next group's tile products (two C buffers, 9-25% slower).

// ---------------------------------------------------------------- tile configuration
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(TileConfig) == 64, "LDTILECFG reads 64 bytes");

// depth: bytes of k per A-tile row (64; 32 for int4 groups of 32). C tiles 0-3: 16 x 16 x 4 bytes;
// A tiles 4-5: 16 rows x depth; B tiles 6-7: depth / 4 rows x 64 bytes.
TileConfig make_tile_config(int depth) {
  TileConfig c;
  std::memset(&c, 0, sizeof(c));
  c.palette_id = 1;
  for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  for (int t = 4; t < 6; ++t) c.rows[t] = 16, c.colsb[t] = static_cast<uint16_t>(depth);
  for (int t = 6; t < 8; ++t) c.rows[t] = static_cast<uint8_t>(depth / 4), c.colsb[t] = 64;
  return c;
}

void load_tile_config(int depth) {
  static const TileConfig deep = make_tile_config(64), shallow = make_tile_config(32);
  KTAMX_COMPILER_BARRIER();
  KTAMX_TILE_CONFIG(depth == 32 ? &shallow : &deep);
}

// ---------------------------------------------------------------- per-thread buffers
// A growing, 64-byte aligned byte buffer; one per thread and purpose.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(data_); }
  uint8_t* get(size_t bytes) {
    if (bytes > size_) {
      std::free(data_);
      size_ = (bytes + 4095) / 4096 * 4096;
      data_ = static_cast<uint8_t*>(std::aligned_alloc(64, size_));
      if (data_ == nullptr) {
        size_ = 0;
        throw std::bad_alloc();
      }
      std::memset(data_, 0, size_);
    }
    return data_;
  }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

thread_local Scratch t_rows;   // activation rows that cannot be tile-loaded in place
thread_local Scratch t_btile;  // int4: a column pair's weights unpacked; int8: zero-padded last-step B tiles
thread_local Scratch t_ctile;  // the C tiles of one block [32][32] x 4 B (int4: two), the int4 fp32 accumulators
thread_local Scratch t_gsumf;  // two-level affine int4: the activation group sums as floats

// ---------------------------------------------------------------- activation rows
// Where the A tiles of row group g (rows 16g..16g+15) come from: row i at base[g] + i * stride[g].
struct ARows {
  const uint8_t* base[kMaxWalkRows / 16];
  int64_t stride[kMaxWalkRows / 16];
};

// in_place_ok: every tile load of a row stays inside the row's row_bytes (false for int8 with K % 64 != 0,
// whose last 64-byte step would read 32 bytes past the row).
ARows gather_rows(const GemmArgs& a, int64_t row_bytes, bool in_place_ok) {
  ARows ar;
  // Copied rows: 64 bytes of padding past the 64-rounded row keeps the 16 rows of a tile out of one L1 set.
  const int64_t ld = (row_bytes + 63) / 64 * 64 + 64;
  uint8_t* buf = nullptr;
  for (int g = 0; g * 16 < a.M; ++g) {
    const int m0 = 16 * g, n = std::min(16, a.M - m0);
    const auto r0 = reinterpret_cast<uintptr_t>(a.a_rows[m0]);
    if (in_place_ok && n == 16) {
      const auto stride = static_cast<int64_t>(reinterpret_cast<uintptr_t>(a.a_rows[m0 + 1]) - r0);
      bool even = true;
      for (int i = 2; i < 16 && even; ++i)
        even = reinterpret_cast<uintptr_t>(a.a_rows[m0 + i]) == r0 + static_cast<uintptr_t>(i * stride);
      if (even) {
        ar.base[g] = reinterpret_cast<const uint8_t*>(r0);
        ar.stride[g] = stride;
        continue;
      }
    }
    if (buf == nullptr) buf = t_rows.get(static_cast<size_t>((a.M + 15) / 16 * 16 * ld));
    uint8_t* dst = buf + m0 * ld;
    for (int i = 0; i < n; ++i) std::memcpy(dst + i * ld, a.a_rows[m0 + i], static_cast<size_t>(row_bytes));
    // Rows n..15 keep what an earlier call left: their C rows are computed and dropped (rows are independent).
    ar.base[g] = dst;
    ar.stride[g] = ld;
  }
  KTAMX_COMPILER_BARRIER();
  return ar;
}

// ---------------------------------------------------------------- tile steps
// Weights into L1 (to_l1) or L2; the emulated build records the lines for the test to check.
inline void prefetch(const uint8_t* p, int64_t bytes, bool to_l1) {
  for (int64_t o = 0; o < bytes; o += 64) {
    KTAMX_RECORD_PREFETCH(p + o, to_l1);
    if (to_l1) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
    else _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T1);
  }
}

template <int RA, int RB>
inline void zero_c() {
  KTAMX_TILE_ZERO(0);
  if constexpr (RB > 1) KTAMX_TILE_ZERO(1);
  if constexpr (RA > 1) KTAMX_TILE_ZERO(2);
  if constexpr (RA > 1 && RB > 1) KTAMX_TILE_ZERO(3);
}

// C tile (r, j) -> cbuf rows 16r.., columns 16j..: [32][32] values of 4 bytes, 128 bytes a row.
template <int RA, int RB>
inline void store_c(uint8_t* cbuf) {
  KTAMX_TILE_STORE(0, cbuf, 128);
  if constexpr (RB > 1) KTAMX_TILE_STORE(1, cbuf + 64, 128);
  if constexpr (RA > 1) KTAMX_TILE_STORE(2, cbuf + 16 * 128, 128);
  if constexpr (RA > 1 && RB > 1) KTAMX_TILE_STORE(3, cbuf + 16 * 128 + 64, 128);
}

// One k step of an RA x RB block: A tiles from a0/a1 (row strides sa0/sa1), B tiles from b0/b1 (64-byte rows).
// Each A tile serves RB products and each B tile RA products.
// kUnsigned0 / kUnsigned1: int8 A x uint8 B0 / B1 (TDPBSUD: the two-level walks' low byte planes, and Q4_K's high).
#define KTAMX_DP(c, a, b, u)                             \
  do {                                                   \
    if constexpr (kBf16) KTAMX_TILE_DP_BF16(c, a, b);    \
    else if constexpr (u) KTAMX_TILE_DP_SU8(c, a, b);    \
    else KTAMX_TILE_DP_S8(c, a, b);                      \
  } while (0)
template <bool kBf16, int RA, int RB, bool kUnsigned0 = false, bool kUnsigned1 = kUnsigned0>
inline void tile_step(const uint8_t* a0, int64_t sa0, const uint8_t* a1, int64_t sa1, const uint8_t* b0,
                      const uint8_t* b1) {
  KTAMX_TILE_LOAD(4, a0, sa0);
  KTAMX_TILE_LOAD(6, b0, 64);
  KTAMX_DP(0, 4, 6, kUnsigned0);
  if constexpr (RB > 1) {
    KTAMX_TILE_LOAD(7, b1, 64);
    KTAMX_DP(1, 4, 7, kUnsigned1);
  }
  if constexpr (RA > 1) {
    KTAMX_TILE_LOAD(5, a1, sa1);
    KTAMX_DP(2, 5, 6, kUnsigned0);
    if constexpr (RB > 1) KTAMX_DP(3, 5, 7, kUnsigned1);
  }
}
#undef KTAMX_DP

// The A tiles of a pass's row groups g0 (and g0 + 1 when RA > 1; else g0 again) and how many of their rows are
// the call's.
template <int RA>
struct RowPair {
  const uint8_t *a0, *a1;
  int64_t sa0, sa1;
  int rows;
  RowPair(const GemmArgs& a, const ARows& ar, int g0)
      : a0(ar.base[g0]), a1(RA > 1 ? ar.base[g0 + 1] : ar.base[g0]), sa0(ar.stride[g0]),
        sa1(RA > 1 ? ar.stride[g0 + 1] : ar.stride[g0]), rows(std::min(16 * RA, a.M - 16 * g0)) {}
};

// One pass of a block of C tiles over k steps [s0, s1): row groups g0 (.. g0 + RA - 1), column blocks b0
// (.. b0 + RB - 1). The walk (tile_walk) decides what each pass prefetches.
struct Block {
  int g0 = 0;
  int b0 = 0;
  int64_t s0 = 0, s1 = 0;            // k steps of this pass (full B tiles; the int8 32-deep tail is extra)
  bool unpack = false;               // int4: first pass of this column pair: unpack its weights, kUnpackAhead
                                     //   k steps ahead of the tile loads
  int64_t l1_from = 0, l1_to = 0;    // B tiles of steps in [l1_from, l1_to) prefetched into L1 kPrefetchSteps ahead
  const uint8_t* next = nullptr;     // weights of the next column pair (or call): bytes [next_begin, next_end)
  int next_blocks = 0;               //   of each of its next_blocks blocks prefetched into L2, next_step a k step
  int64_t next_begin = 0, next_end = 0, next_step = 0;
  const uint8_t* next_a = nullptr;   // the caller's next A rows: bytes [next_a_begin, next_a_end) into L2,
  int64_t next_a_begin = 0, next_a_end = 0, next_a_step = 0;  // next_a_step a k step
  SideWork* side = nullptr;          // the caller's side work: done up to side_to by the end of this pass, evenly
  int64_t side_from = 0, side_to = 0;  //   over its steps from side_from
};

// Bytes [begin, end) of `bytes` that pass `pass` of `passes` prefetches (64-byte aligned; the last pass to the end),
// `step` of them a k step over the pass's `steps` steps.
struct PassSlice {
  int64_t begin, end, step;
};
inline PassSlice pass_slice(int64_t bytes, int64_t pass, int64_t passes, int64_t steps) {
  PassSlice p;
  p.begin = bytes * pass / passes / 64 * 64;
  p.end = pass + 1 == passes ? bytes : bytes * (pass + 1) / passes / 64 * 64;
  p.step = (p.end - p.begin + steps * 64 - 1) / (steps * 64) * 64;
  return p;
}

// The caller's side work due by the end of step `step` of the pass's `steps` (after the step's tile products are
// issued, so the vector work runs beside them).
inline void run_side_through(const Block& blk, int64_t step, int64_t steps) {
  const int64_t due = blk.side_from + (blk.side_to - blk.side_from) * (step + 1) / steps;
  if (due > blk.side->done) {
    blk.side->run(blk.side->ctx, blk.side->done, due);
    blk.side->done = due;
  }
}
inline void run_side(const Block& blk, int64_t s) { run_side_through(blk, s - blk.s0, blk.s1 - blk.s0); }

// The part of the next column pair's weights that step s of this pass prefetches into L2.
inline void prefetch_next(const GemmArgs& a, const Block& blk, int64_t s) {
  const int64_t off = blk.next_begin + (s - blk.s0) * blk.next_step;
  if (off >= blk.next_end) return;
  const int64_t bytes = std::min(blk.next_step, blk.next_end - off);
  for (int j = 0; j < blk.next_blocks; ++j) prefetch(blk.next + j * a.b_block_stride + off, bytes, false);
}

// The part of the caller's next A rows that step s of this pass prefetches into L2.
inline void prefetch_next_a(const Block& blk, int64_t s) {
  const int64_t off = blk.next_a_begin + (s - blk.s0) * blk.next_a_step;
  if (off < blk.next_a_end) prefetch(blk.next_a + off, std::min(blk.next_a_step, blk.next_a_end - off), false);
}

// Prefetch for step s of a pass: B tiles kPrefetchSteps ahead into L1 (packed: bytes of a block per step), the
// next weights and the caller's next A rows into L2.
template <int RB>
inline void prefetch_step(const GemmArgs& a, const Block& blk, int64_t s, const uint8_t* b0, const uint8_t* b1,
                          int64_t packed) {
  const int64_t t = s + kPrefetchSteps;
  if (t >= blk.l1_from && t < blk.l1_to) {
    prefetch(b0 + t * packed, packed, true);
    if constexpr (RB > 1) prefetch(b1 + t * packed, packed, true);
  }
  if (blk.next != nullptr) prefetch_next(a, blk, s);
  if (blk.next_a != nullptr) prefetch_next_a(blk, s);
}

// ---------------------------------------------------------------- bf16 and int8
template <WeightFormat F, int RA, int RB>
void dense_block(const GemmArgs& a, const ARows& ar, const Block& blk, const uint8_t* tail_b, uint8_t* cbuf) {
  constexpr bool kBf16 = F == WeightFormat::BF16;
  const int64_t steps = kBf16 ? a.K / 32 : a.K / 64;  // full 1 KB B tiles; A advances 64 bytes a step
  const uint8_t* b0 = a.b + blk.b0 * a.b_block_stride;
  const uint8_t* b1 = b0 + a.b_block_stride;  // read only when RB > 1
  const RowPair<RA> rp(a, ar, blk.g0);
  const uint8_t *a0 = rp.a0, *a1 = rp.a1;
  const int64_t sa0 = rp.sa0, sa1 = rp.sa1;
  zero_c<RA, RB>();
  for (int64_t s = blk.s0; s < blk.s1; ++s) {
    prefetch_step<RB>(a, blk, s, b0, b1, kTileBytes);
    tile_step<kBf16, RA, RB>(a0 + s * 64, sa0, a1 + s * 64, sa1, b0 + s * kTileBytes, b1 + s * kTileBytes);
    if (blk.side != nullptr) run_side(blk, s);
  }
  if (!kBf16 && a.K % 64 != 0)  // int8: a last 32-deep step on zero-padded B tiles (A bytes past K meet zeros)
    tile_step<false, RA, RB>(a0 + steps * 64, sa0, a1 + steps * 64, sa1, tail_b, tail_b + kTileBytes);
  store_c<RA, RB>(cbuf);

  for (int r = 0; r < 16 * RA; ++r) {
    const int m = 16 * blk.g0 + r;
    if (m >= a.M) break;
    for (int j = 0; j < RB; ++j) {
      const uint8_t* src = cbuf + r * 128 + j * 64;
      float* dst = a.c + m * a.ldc + 16 * (blk.b0 + j);
      if constexpr (kBf16) {
        _mm512_storeu_ps(dst, _mm512_load_ps(reinterpret_cast<const float*>(src)));
      } else {
        const __m512 ws = _mm512_loadu_ps(a.b_scale + (blk.b0 + j) * a.b_scale_block_stride);
        const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(src));
        _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_mul_ps(v, ws), _mm512_set1_ps(a.a_scale[m])));
      }
    }
  }
}

// ---------------------------------------------------------------- int4
// The int4 walks' last step: C rows = the fp32 accumulators acc ([32][32], RB blocks of 16) times a_scale[m].
template <int RB>
inline void store_scaled(const GemmArgs& a, const Block& blk, int rows, const float* acc) {
  for (int r = 0; r < rows; ++r) {
    const int m = 16 * blk.g0 + r;
    const __m512 xs = _mm512_set1_ps(a.a_scale[m]);
    for (int j = 0; j < RB; ++j)
      _mm512_storeu_ps(a.c + m * a.ldc + 16 * (blk.b0 + j), _mm512_mul_ps(_mm512_load_ps(acc + r * 32 + 16 * j), xs));
  }
}

// The signed tile byte each nibble becomes, in each 128-bit lane (for _mm512_shuffle_epi8): the code table
// (b_codes: MXFP4), or u - 8 (symmetric).
inline __m512i int4_table(const GemmArgs& a) {
  alignas(16) int8_t t[16];
  for (int u = 0; u < 16; ++u) t[u] = a.b_codes != nullptr ? a.b_codes[u] : static_cast<int8_t>(u - 8);
  return _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
}

// Unpacks `lines` int4 lines (64 bytes: 8 k of 16 columns) into 2 * lines int8 tile rows: line o gives row
// 2o (its low nibbles, k = 8o..8o+3) and row 2o + 1 (its high nibbles, k = 8o+4..8o+7), each as table[u]
// (int4_table: q - 8, or the code).
inline void unpack_int4(const uint8_t* src, int lines, uint8_t* dst, __m512i table) {
  KTAMX_RECORD_UNPACK(src, 64 * lines);
  const __m512i low = _mm512_set1_epi8(0x0f);
  for (int o = 0; o < lines; ++o) {
    const __m512i v = _mm512_loadu_si512(src + o * 64);
    _mm512_store_si512(dst + 128 * o, _mm512_shuffle_epi8(table, _mm512_and_si512(v, low)));
    _mm512_store_si512(dst + 128 * o + 64, _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low)));
  }
}

// The group-wise walk: int4 (kInt8 false), and grouped int8 with a float32 scale per group (kInt8: GGUF Q8_0, whose
// packed codes already are B tiles, read in place: nothing unpacked). kDepth: k per step (64, or 32 for groups of
// 32). unpacked (int4): RB buffers of K/4 tile rows x 64 bytes, filled on the first pass of the column pair
// (blk.unpack: step t during step t - kUnpackAhead, so that the tile loads of a step do not wait for the stores that
// unpacked it) and read by its later row pairs. acc: [32][32] fp32. cbuf: a group's C sums [32][32] int32, scaled
// into acc (the group's epilogue) right after the group's tile products. Every pass covers all of K (the walks never
// cut these formats into k chunks).
template <int RA, int RB, int kDepth, bool kInt8 = false>
void grouped_block(const GemmArgs& a, const ARows& ar, const Block& blk, uint8_t* unpacked, uint8_t* cbuf,
                   float* acc) {
  constexpr int64_t kPackedStep = kDepth / (kInt8 ? 4 : 8) * 64;  // packed bytes of one block per step
  constexpr int64_t kUnpackedStep = kDepth / 4 * 64;              // one B tile (int8: kPackedStep)
  const int64_t steps = a.K / kDepth, group_steps = a.group_size / kDepth;
  const uint8_t* packed0 = a.b + blk.b0 * a.b_block_stride;
  const uint8_t* packed1 = packed0 + a.b_block_stride;  // read only when RB > 1
  uint8_t* u0 = unpacked;
  uint8_t* u1 = kInt8 ? nullptr : unpacked + steps * kUnpackedStep;  // (int8: no buffer, unpacked is nullptr)
  const uint8_t* t0 = kInt8 ? packed0 : u0;  // the B tiles of the two blocks
  const uint8_t* t1 = kInt8 ? packed1 : u1;
  const RowPair<RA> rp(a, ar, blk.g0);
  const uint8_t *a0 = rp.a0, *a1 = rp.a1;
  const int64_t sa0 = rp.sa0, sa1 = rp.sa1;
  const int rows = rp.rows;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < RB; ++j) _mm512_store_ps(acc + r * 32 + 16 * j, _mm512_setzero_ps());
  const __m512i table = kInt8 ? _mm512_setzero_si512() : int4_table(a);
  const auto unpack_step = [&](int64_t t) {
    unpack_int4(packed0 + t * kPackedStep, kDepth / 8, u0 + t * kUnpackedStep, table);
    if constexpr (RB > 1) unpack_int4(packed1 + t * kPackedStep, kDepth / 8, u1 + t * kUnpackedStep, table);
  };
  const bool unpack = !kInt8 && blk.unpack;
  const int64_t ahead = unpack ? kUnpackAhead : 0;
  if (unpack) {
    for (int64_t t = 0; t < std::min(ahead, steps); ++t) unpack_step(t);
    KTAMX_COMPILER_BARRIER();
  }
  // Group g's sums in cbuf into acc: acc += s_w * sum.
  const auto epilogue = [&](int64_t g) {
    const uint8_t* cb = cbuf;
    for (int j = 0; j < RB; ++j) {
      const __m512 ws = group_scales16(a, false, g, super_of(a, g), (blk.b0 + j) * a.b_scale_block_stride);
      for (int r = 0; r < rows; ++r) {
        float* p = acc + r * 32 + 16 * j;
        const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(cb + r * 128 + 64 * j));
        _mm512_store_ps(p, _mm512_fmadd_ps(v, ws, _mm512_load_ps(p)));
      }
    }
  };

  for (int64_t g = 0; g < a.K / a.group_size; ++g) {
    zero_c<RA, RB>();
    for (int64_t s = g * group_steps; s < (g + 1) * group_steps; ++s) {
      prefetch_step<RB>(a, blk, s, packed0, packed1, kPackedStep);
      if (unpack && s + ahead < steps) {
        unpack_step(s + ahead);
        KTAMX_COMPILER_BARRIER();
      }
      tile_step<false, RA, RB>(a0 + s * kDepth, sa0, a1 + s * kDepth, sa1, t0 + s * kUnpackedStep,
                               t1 + s * kUnpackedStep);
      if (blk.side != nullptr) run_side(blk, s);
    }
    store_c<RA, RB>(cbuf);
    KTAMX_COMPILER_BARRIER();  // (TILESTORED's asm does not declare the memory it writes)
    epilogue(g);
  }
  store_scaled<RB>(a, blk, rows, acc);
}

// ---------------------------------------------------------------- affine int4 with two-level scales (GGUF Q4_K)
// W = u * super[s][n] * sub[g][n] - min[g][n]: the byte sub-scales are integers, so a super-block's products need no
// float per group. The unpack writes p = sub * u (0..3825) of each weight as two unsigned byte planes, p = 256 h + l,
// the tiles sum x.h and x.l (TDPBSUD) over a whole super-block, and the super-block's epilogue adds
// (256 x.h + x.l) * super - sum_g sum_g(x) * min[g] to fp32 accumulators: one epilogue per super_size input
// channels (256) instead of one per group of 32, for twice the tile products, which have room to spare
// (the layer is bound by the unpack and the epilogues; docs/amx.md).

// The sub-scales of 16 columns (16 bytes), each repeated over its column's 4 bytes of a tile row.
inline __m512i sub_scale_bytes(const uint8_t* sub16) {
  const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sub16)));
  const __m512i rep = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  return _mm512_shuffle_epi8(d, rep);
}

// One int4 line (64 bytes: 8 k of 16 columns, codes u) times the sub-scale bytes sc into the planes h and l: row
// 2o of each (the low nibbles, k = 8o..8o+3) and row 2o + 1 (the high nibbles). p = sc * u per byte, formed as 16-bit
// products of the even and odd bytes (vpmaddubsw with the other byte masked off); l = p & 255, h = p >> 8.
inline void unpack_kq4_line(const uint8_t* src, __m512i sc, uint8_t* h, uint8_t* l) {
  const __m512i v = _mm512_loadu_si512(src);
  const __m512i even = _mm512_set1_epi16(0x000f), odd = _mm512_set1_epi16(0x0f00);
  constexpr __mmask64 kOdd = 0xAAAAAAAAAAAAAAAAull;
  const __m512i nib[2] = {v, _mm512_srli_epi16(v, 4)};
  for (int half = 0; half < 2; ++half) {
    const __m512i pe = _mm512_maddubs_epi16(sc, _mm512_and_si512(nib[half], even));
    const __m512i po = _mm512_maddubs_epi16(sc, _mm512_and_si512(nib[half], odd));
    _mm512_store_si512(l + 64 * half, _mm512_mask_blend_epi8(kOdd, pe, _mm512_slli_epi16(po, 8)));
    _mm512_store_si512(h + 64 * half, _mm512_mask_blend_epi8(kOdd, _mm512_srli_epi16(pe, 8), po));
  }
}

// One int8 tile row (4 k of 16 columns, signed codes q: GGUF Q6_K's [-32, 31], Q5_K's [0, 31]) times the sub-scale
// bytes sc (sub_scale_bytes of the row's group, which a tile row never crosses; signed for Q6_K, unsigned for Q5_K)
// into the planes h (signed) and l (unsigned): p = sc * q (|p| <= 255 * 128, any codes and sub-scales) as 16-bit
// products of the even and odd bytes, extended as their kinds are, l = p & 255, h = p >> 8 (arithmetic).
template <bool kSignedSub>
inline void unpack_k8_row(const uint8_t* src, __m512i sc, uint8_t* h, uint8_t* l) {
  const __m512i v = _mm512_loadu_si512(src);
  constexpr __mmask64 kOdd = 0xAAAAAAAAAAAAAAAAull;
  const __m512i sc_even = kSignedSub ? _mm512_srai_epi16(_mm512_slli_epi16(sc, 8), 8)
                                     : _mm512_and_si512(sc, _mm512_set1_epi16(0x00ff));
  const __m512i sc_odd = kSignedSub ? _mm512_srai_epi16(sc, 8) : _mm512_srli_epi16(sc, 8);
  const __m512i pe = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8), sc_even);
  const __m512i po = _mm512_mullo_epi16(_mm512_srai_epi16(v, 8), sc_odd);
  _mm512_store_si512(l, _mm512_mask_blend_epi8(kOdd, pe, _mm512_slli_epi16(po, 8)));
  _mm512_store_si512(h, _mm512_mask_blend_epi8(kOdd, _mm512_srai_epi16(pe, 8), po));
}

// The two-plane walks: the row pair g0 (RA row groups) against the RB column blocks of a pair, one block after the
// other (each takes four C tiles: h and l sums of two row groups), the products p = sub * code of a super-block
// summed as 256 x.h + x.l in the tiles. kInt8 false: GGUF Q4_K (int4 codes u, unsigned sub-scales, planes both
// unsigned, a minimum per group); true: int8 codes, h signed (GGUF Q6_K: signed sub-scales per 16, no minimums;
// Q5_K: unsigned sub-scales per 32, minimums). unpacked: per block, per 64-deep step, the h tile then the l tile
// (2 KB), filled on the column pair's first pass (blk.unpack, kUnpackAhead steps ahead) and read by its later row
// pairs. gsumf (the affine formats, else nullptr): the walk's activation group sums as floats, [M][G]. acc: [32][16]
// fp32. The walk's prefetches of the next weights and A rows and its side work are spread over the block's steps
// (the RB blocks' steps in turn).
template <bool kInt8, int RA, int RB>
void two_plane_block(const GemmArgs& a, const ARows& ar, const Block& blk, uint8_t* unpacked, uint8_t* cbuf,
                     float* acc, const float* gsumf) {
  constexpr int64_t kPackedStep = kInt8 ? 1024 : 512;  // packed bytes of one block per 64-deep step
  constexpr int64_t kUnpackedStep = 2048;              // its h and l tiles
  const int64_t steps = a.K / 64, super_steps = a.super_size / 64, groups = a.K / a.group_size;
  const int64_t per_super = a.super_size / a.group_size;
  const RowPair<RA> rp(a, ar, blk.g0);
  const uint8_t *a0 = rp.a0, *a1 = rp.a1;
  const int64_t sa0 = rp.sa0, sa1 = rp.sa1;
  const int rows = rp.rows;
  const int64_t vsteps = RB * steps;  // the pass's steps, block after block
  // sub-scale lines a step reads: one a tile row's group (Q6_K: 4), or one per 32 k (Q4_K: 2)
  constexpr int kSubsPerStep = kInt8 ? 4 : 2;
  for (int j = 0; j < RB; ++j) {
    const int64_t col = (blk.b0 + j) * a.b_scale_block_stride;
    const uint8_t* packed = a.b + (blk.b0 + j) * a.b_block_stride;
    uint8_t* u = unpacked + j * steps * kUnpackedStep;
    const auto unpack_step = [&](int64_t t) {
      KTAMX_RECORD_UNPACK(packed + t * kPackedStep, kPackedStep);
      for (int part = 0; part < kSubsPerStep; ++part) {  // 64 / kSubsPerStep k at a time (groups: multiples of it)
        const int64_t g = (64 * t + 64 / kSubsPerStep * part) / a.group_size;
        const __m512i sc = sub_scale_bytes(a.b_sub + g * a.b_sub_group_stride + col);
        if constexpr (kInt8) {  // 4 tile rows of 4 k
          for (int r = 4 * part; r < 4 * part + 4; ++r) {
            uint8_t* hr = u + t * kUnpackedStep + 64 * r;
            if (a.b_sub_signed) unpack_k8_row<true>(packed + t * kPackedStep + 64 * r, sc, hr, hr + 1024);
            else unpack_k8_row<false>(packed + t * kPackedStep + 64 * r, sc, hr, hr + 1024);
          }
        } else {  // 4 int4 lines of 8 k
          for (int o = 4 * part; o < 4 * part + 4; ++o)
            unpack_kq4_line(packed + t * kPackedStep + 64 * o, sc, u + t * kUnpackedStep + 128 * o,
                            u + t * kUnpackedStep + 1024 + 128 * o);
        }
      }
    };
    const int64_t ahead = blk.unpack ? kUnpackAhead : 0;
    if (blk.unpack) {
      for (int64_t t = 0; t < std::min(ahead, steps); ++t) unpack_step(t);
      KTAMX_COMPILER_BARRIER();
    }
    for (int r = 0; r < rows; ++r) _mm512_store_ps(acc + r * 16, _mm512_setzero_ps());
    for (int64_t sb = 0; sb < steps / super_steps; ++sb) {
      zero_c<RA, 2>();
      for (int64_t s = sb * super_steps; s < (sb + 1) * super_steps; ++s) {
        const int64_t v = j * steps + s;  // this step among the pass's
        if (blk.unpack) {
          const int64_t t = s + kPrefetchSteps;
          if (t < steps) prefetch(packed + t * kPackedStep, kPackedStep, true);
          for (int part = 0; part < kSubsPerStep; ++part) {  // the sub-scales a few steps ahead (a line per group)
            const int64_t gt = std::min(groups - 1, (64 * t + 64 / kSubsPerStep * part) / a.group_size);
            _mm_prefetch(reinterpret_cast<const char*>(a.b_sub + gt * a.b_sub_group_stride + col), _MM_HINT_T0);
          }
        }
        if (j == 0 && blk.next != nullptr) prefetch_next(a, blk, s);
        if (j == 0 && blk.next_a != nullptr) prefetch_next_a(blk, s);
        if (blk.unpack && s + ahead < steps) {
          unpack_step(s + ahead);
          KTAMX_COMPILER_BARRIER();
        }
        tile_step<false, RA, 2, !kInt8, true>(a0 + s * 64, sa0, a1 + s * 64, sa1, u + s * kUnpackedStep,
                                              u + s * kUnpackedStep + 1024);
        if (blk.side != nullptr) run_side_through(blk, v, vsteps);
      }
      store_c<RA, 2>(cbuf);
      KTAMX_COMPILER_BARRIER();
      // acc += (256 x.h + x.l) * super (Q4_K: - sum over the super-block's groups of sum_g(x) * min[g])
      const __m512 sup = _mm512_loadu_ps(a.b_super + sb * a.b_super_group_stride + col);
      __m512 mins[8];  // Q4_K: per_super <= 8 (group_size >= 32, super_size <= 256)
      if (gsumf != nullptr)
        for (int64_t i = 0; i < per_super; ++i) mins[i] = group_scales16(a, true, sb * per_super + i, sb, col);
      for (int r = 0; r < rows; ++r) {
        const __m512i h = _mm512_load_si512(cbuf + r * 128), l = _mm512_load_si512(cbuf + r * 128 + 64);
        __m512 x = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 8), l)), sup,
                                   _mm512_load_ps(acc + r * 16));
        if (gsumf != nullptr) {
          const float* gs = gsumf + (16 * blk.g0 + r) * groups + sb * per_super;
          for (int64_t i = 0; i < per_super; ++i) x = _mm512_fnmadd_ps(_mm512_set1_ps(gs[i]), mins[i], x);
        }
        _mm512_store_ps(acc + r * 16, x);
      }
    }
    for (int r = 0; r < rows; ++r) {
      const int m = 16 * blk.g0 + r;
      _mm512_storeu_ps(a.c + m * a.ldc + 16 * (blk.b0 + j),
                       _mm512_mul_ps(_mm512_load_ps(acc + r * 16), _mm512_set1_ps(a.a_scale[m])));
    }
  }
}

// ---------------------------------------------------------------- symmetric int4 with two-level scales
// ktorch's own int4 (W = (u - 8) * super[s][n] * sub[g][n], byte sub-scales 0..15 per group, the float super-scale
// one per column, repeated along K): b = sub * (u - 8) fits a signed byte (|b| <= 120), so the unpack writes b and
// the tiles sum the whole of K (a super-block at a time where the supers differ along K), with int8's single
// epilogue instead of one per group.

// One int4 line (8 k of 16 columns) into tile rows 2o (low nibbles) and 2o + 1 (high nibbles) of b = sub * (u - 8):
// one 16-bit multiply forms sub * u for both bytes of a word (both are the same column's, and sub * u <= 225 leaves
// no carry), then sub8 = 8 * sub is taken off each byte (wrapping to the signed value).
inline void unpack_int4s_line(const uint8_t* src, __m512i sub16, __m512i sub8, uint8_t* dst) {
  const __m512i v = _mm512_loadu_si512(src);
  const __m512i low = _mm512_set1_epi8(0x0f);
  const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  _mm512_store_si512(dst, _mm512_sub_epi8(_mm512_mullo_epi16(lo, sub16), sub8));
  _mm512_store_si512(dst + 64, _mm512_sub_epi8(_mm512_mullo_epi16(hi, sub16), sub8));
}

// two_plane_block's counterpart for symmetric int4: a RA x RB block of C tiles (grouped_block's shape and unpack
// schedule), epi_steps 64-deep steps between epilogues (all of K, or a super-block).
template <int RA, int RB>
void int4s_block(const GemmArgs& a, const ARows& ar, const Block& blk, uint8_t* unpacked, uint8_t* cbuf, float* acc,
                 int64_t epi_steps) {
  constexpr int64_t kPackedStep = 512, kUnpackedStep = 1024;
  const int64_t steps = a.K / 64, groups = a.K / a.group_size;
  const uint8_t* packed0 = a.b + blk.b0 * a.b_block_stride;
  const uint8_t* packed1 = packed0 + a.b_block_stride;  // read only when RB > 1
  uint8_t* u0 = unpacked;
  uint8_t* u1 = unpacked + steps * kUnpackedStep;
  const RowPair<RA> rp(a, ar, blk.g0);
  const uint8_t *a0 = rp.a0, *a1 = rp.a1;
  const int64_t sa0 = rp.sa0, sa1 = rp.sa1;
  const int rows = rp.rows;
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < RB; ++j) _mm512_store_ps(acc + r * 32 + 16 * j, _mm512_setzero_ps());
  const auto unpack_step = [&](int64_t t) {
    for (int j = 0; j < RB; ++j) {
      const uint8_t* packed = (j == 0 ? packed0 : packed1) + t * kPackedStep;
      uint8_t* dst = (j == 0 ? u0 : u1) + t * kUnpackedStep;
      KTAMX_RECORD_UNPACK(packed, kPackedStep);
      for (int half = 0; half < 2; ++half) {  // 32 k (4 lines) at a time: groups are multiples of 32
        const int64_t g = (64 * t + 32 * half) / a.group_size;
        const __m512i sc = sub_scale_bytes(a.b_sub + g * a.b_sub_group_stride + (blk.b0 + j) * a.b_scale_block_stride);
        const __m512i sub16 = _mm512_and_si512(sc, _mm512_set1_epi16(0x00ff));  // each word: its column's sub
        const __m512i sub8 = _mm512_slli_epi16(sc, 3);  // 8 sub a byte (sub <= 15: no bit crosses a byte)
        for (int o = 4 * half; o < 4 * half + 4; ++o) unpack_int4s_line(packed + 64 * o, sub16, sub8, dst + 128 * o);
      }
    }
  };
  const int64_t ahead = blk.unpack ? kUnpackAhead : 0;
  if (blk.unpack) {
    for (int64_t t = 0; t < std::min(ahead, steps); ++t) unpack_step(t);
    KTAMX_COMPILER_BARRIER();
  }
  for (int64_t e = 0; e < steps / epi_steps; ++e) {
    zero_c<RA, RB>();
    for (int64_t s = e * epi_steps; s < (e + 1) * epi_steps; ++s) {
      prefetch_step<RB>(a, blk, s, packed0, packed1, kPackedStep);
      if (blk.unpack) {  // the sub-scales a few steps ahead (a line per group and block)
        const int64_t gt = std::min(groups - 1, (s + kPrefetchSteps) * 64 / a.group_size);
        for (int j = 0; j < RB; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(a.b_sub + gt * a.b_sub_group_stride +
                                                     (blk.b0 + j) * a.b_scale_block_stride), _MM_HINT_T0);
      }
      if (blk.unpack && s + ahead < steps) {
        unpack_step(s + ahead);
        KTAMX_COMPILER_BARRIER();
      }
      tile_step<false, RA, RB>(a0 + s * 64, sa0, a1 + s * 64, sa1, u0 + s * kUnpackedStep, u1 + s * kUnpackedStep);
      if (blk.side != nullptr) run_side(blk, s);
    }
    store_c<RA, RB>(cbuf);
    KTAMX_COMPILER_BARRIER();
    const int64_t sb = e * epi_steps * 64 / a.super_size;
    for (int j = 0; j < RB; ++j) {
      const __m512 sup = _mm512_loadu_ps(a.b_super + sb * a.b_super_group_stride + (blk.b0 + j) * a.b_scale_block_stride);
      for (int r = 0; r < rows; ++r) {
        float* p = acc + r * 32 + 16 * j;
        const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(cbuf + r * 128 + 64 * j));
        _mm512_store_ps(p, _mm512_fmadd_ps(v, sup, _mm512_load_ps(p)));
      }
    }
  }
  store_scaled<RB>(a, blk, rows, acc);
}

// ---------------------------------------------------------------- tile walk
struct Buffers {
  uint8_t* cbuf;
  float* acc;
  uint8_t* btile;
  const float* gsumf;  // two-level affine int4: the activation group sums as floats, [M][G]
  int64_t epi_steps;   // two-level symmetric int4: 64-deep steps between epilogues (0: not that walk)
  bool k8;             // two-level int8 (GGUF Q6_K, Q5_K): two_plane_block
  bool g8;             // grouped int8 with float32 scales (GGUF Q8_0): grouped_block, B tiles in place
};

// int4 whose two-level scales the AMX walk takes: affine (two_plane_block; other affine int4 goes to AVX-512,
// gemm_amx), or symmetric with every sub-scale of the call <= 15 (int4s_block; otherwise the group-wise walk, whose
// epilogue reads the scales in either form).
inline bool two_level_shape(const GemmArgs& a) {
  return a.b_sub != nullptr && a.b_super != nullptr && !a.b_sub_signed && a.b_codes == nullptr &&
         a.group_size % 32 == 0 && a.super_size % 64 == 0 && a.super_size % a.group_size == 0 &&
         a.K % a.super_size == 0;
}
inline bool two_level_walk(const GemmArgs& a) {
  return affine(a) && two_level_shape(a) && a.super_size / a.group_size <= 8;
}
// int8 whose two-level scales the AMX walk takes (two_plane_block): GGUF Q6_K (signed sub-scales, no minimums) and
// Q5_K (unsigned, minimums: at most 8 groups a super-block), groups a multiple of 16 (a tile row's 4 k never cross
// one), super-blocks of at most 256 (int32 sums: 256 * 127 * 128 * 256 < 2^31); other grouped int8 goes to AVX-512.
inline bool two_level_int8_walk(const GemmArgs& a) {
  return a.b_sub != nullptr && a.b_super != nullptr && a.b_codes == nullptr && a.group_size % 16 == 0 &&
         a.super_size % 64 == 0 && a.super_size <= 256 && a.super_size % a.group_size == 0 &&
         a.K % a.super_size == 0 && (!affine(a) || a.super_size / a.group_size <= 8);
}
// Grouped int8 (GGUF Q8_0: signed codes, a float32 scale per 32; the driver expands a float16 one) walks the tiles
// group by group as int4 does (grouped_block), its B tiles read in place (the packed codes are the tiles), each
// group's int32 sums scaled into fp32 accumulators: the same integer sums and fp32 operations in the same order as
// the AVX-512 kernel (bit for bit). Groups a multiple of 32 (32: 32-deep tiles); not affine (Q5_K's float32 form),
// not groups of 16 (Q6_K's): those stay on the AVX-512 kernel.
inline bool grouped_int8_walk(const GemmArgs& a) {
  return !affine(a) && a.b_codes == nullptr && a.group_size > 0 && a.group_size < a.K && a.group_size % 32 == 0 &&
         !two_level_int8_walk(a);
}
// Symmetric two-level: 64-deep steps between epilogues, all of K where each column's super-scale is the same along
// K (and K small enough for int32 sums: 120 * 127 * K < 2^31) or a super-block; 0 where a sub-scale exceeds 15.
// The check runs on every call: it ORs the call's sub-scale bytes 64 at a time and compares the super-scale rows 16
// columns at a time (as first written, a byte compare a block and group and a scalar compare a column and super-block:
// ~0.25 ms of a 5.5 ms Qwen3 layer at T = 512 over 16 threads, estimated from the counts, not measured).
int64_t int4s_epilogue_steps(const GemmArgs& a) {
  if (affine(a) || !two_level_shape(a)) return 0;
  const int64_t groups = a.K / a.group_size, supers = a.K / a.super_size, cols = 16 * a.nblocks;
  const bool dense = a.b_scale_block_stride == 16;  // the call's columns of a group are one run of bytes
  __m512i any = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* row = a.b_sub + g * a.b_sub_group_stride;
    if (dense) {
      int64_t c = 0;
      for (; c + 64 <= cols; c += 64) any = _mm512_or_si512(any, _mm512_loadu_si512(row + c));
      if (c < cols) any = _mm512_or_si512(any, _mm512_maskz_loadu_epi8(~0ull >> (64 - (cols - c)), row + c));
    } else {
      for (int b = 0; b < a.nblocks; ++b)
        any = _mm512_or_si512(any, _mm512_maskz_loadu_epi8(0xffff, row + b * a.b_scale_block_stride));
    }
  }
  if (_mm512_test_epi8_mask(any, _mm512_set1_epi8(static_cast<char>(0xf0))) != 0) return 0;  // a sub-scale > 15
  bool same = a.K <= 131072;
  for (int64_t s = 1; s < supers && same; ++s)
    for (int b = 0; b < a.nblocks && same; ++b) {
      const float* col = a.b_super + b * a.b_scale_block_stride;
      same = _mm512_cmp_ps_mask(_mm512_loadu_ps(col + s * a.b_super_group_stride), _mm512_loadu_ps(col),
                                _CMP_NEQ_UQ) == 0;
    }
  return same ? a.K / 64 : a.super_size / 64;
}

template <WeightFormat F, int RA, int RB>
void run_block(const GemmArgs& a, const ARows& ar, const Block& blk, const Buffers& buf) {
  if constexpr (F == WeightFormat::INT4) {
    if (buf.gsumf != nullptr) two_plane_block<false, RA, RB>(a, ar, blk, buf.btile, buf.cbuf, buf.acc, buf.gsumf);
    else if (buf.epi_steps > 0) int4s_block<RA, RB>(a, ar, blk, buf.btile, buf.cbuf, buf.acc, buf.epi_steps);
    else if (a.group_size == 32) grouped_block<RA, RB, 32>(a, ar, blk, buf.btile, buf.cbuf, buf.acc);
    else grouped_block<RA, RB, 64>(a, ar, blk, buf.btile, buf.cbuf, buf.acc);
  } else if (F == WeightFormat::INT8 && buf.k8) {
    two_plane_block<true, RA, RB>(a, ar, blk, buf.btile, buf.cbuf, buf.acc, buf.gsumf);
  } else if (F == WeightFormat::INT8 && buf.g8) {
    if (a.group_size % 64 == 0) grouped_block<RA, RB, 64, true>(a, ar, blk, nullptr, buf.cbuf, buf.acc);
    else grouped_block<RA, RB, 32, true>(a, ar, blk, nullptr, buf.cbuf, buf.acc);
  } else {
    dense_block<F, RA, RB>(a, ar, blk, buf.btile, buf.cbuf);
  }
}

// One call of at most kMaxWalkRows rows. Column pairs outer, then row pairs, each pass over all of K (int4: the
// first row pair unpacks the column pair's weights, kUnpackAhead k steps ahead of its tile loads; the others read
// them unpacked). What each pass prefetches: the first row pair its B tiles into L1; every pass 1/passes of the next
// column pair, or of the first column pair of the caller's next call (next_b), into L2, and 1/passes of the
// caller's next A rows (next_a) into L2.
// side_until: how much of the caller's side work (a.side) is due by the end of this walk.
template <WeightFormat F>
void tile_walk(const GemmArgs& a, int64_t side_until) {
  const bool two_level = F == WeightFormat::INT4 && two_level_walk(a);
  const int64_t epi_steps = F == WeightFormat::INT4 ? int4s_epilogue_steps(a) : 0;
  const bool k8 = F == WeightFormat::INT8 && two_level_int8_walk(a);
  const bool g8 = F == WeightFormat::INT8 && grouped_int8_walk(a);
  const int depth = (F == WeightFormat::INT4 && a.group_size == 32 && !two_level && epi_steps == 0) ||
                            (g8 && a.group_size % 64 != 0)
                        ? 32
                        : 64;
  load_tile_config(depth);
  const int64_t row_bytes = F == WeightFormat::BF16 ? 2 * a.K : a.K;
  // (a 32-deep walk's A tile loads end at K: in place for any K)
  const ARows ar = gather_rows(a, row_bytes, F != WeightFormat::INT8 || a.K % 64 == 0 || depth == 32);
  Buffers buf;
  // [C sums 4 KB][int4's fp32 accumulators 4 KB]
  buf.cbuf = t_ctile.get(32 * 128 + 32 * 32 * sizeof(float));
  buf.acc = reinterpret_cast<float*>(buf.cbuf + 32 * 128);
  buf.btile = nullptr;
  buf.gsumf = nullptr;
  buf.epi_steps = epi_steps;
  buf.k8 = k8;
  buf.g8 = g8;
  const bool int8_tail = F == WeightFormat::INT8 && !g8 && a.K % 64 != 0;
  if ((F == WeightFormat::INT4 && two_level) || buf.k8) {
    buf.btile = t_btile.get(static_cast<size_t>(2 * 32 * a.K));  // 2 blocks x 2 planes x K/4 rows x 64 B
    if (affine(a)) {
      const int64_t G = a.K / a.group_size;
      auto* gf = reinterpret_cast<float*>(t_gsumf.get(static_cast<size_t>(a.M * G) * sizeof(float)));
      for (int m = 0; m < a.M; ++m)
        for (int64_t g = 0; g < G; ++g) gf[m * G + g] = static_cast<float>(a.a_gsum[m * a.a_gsum_stride + g]);
      buf.gsumf = gf;
    }
  } else if (F == WeightFormat::INT4) {
    buf.btile = t_btile.get(static_cast<size_t>(2 * 16 * a.K));  // 2 blocks x K/4 rows x 64 B
  }
  if (int8_tail) buf.btile = t_btile.get(2 * kTileBytes);
  const int groups = (a.M + 15) / 16, row_pairs = (groups + 1) / 2;
  // k steps of full B tiles
  const int64_t steps = F == WeightFormat::BF16 ? a.K / 32 : F == WeightFormat::INT8 && !g8 ? a.K / 64 : a.K / depth;
  const int64_t bb = static_cast<int64_t>(block_bytes(F, a.K));
  const bool next_a = a.next_a != nullptr && a.next_a_bytes > 0;
  const int64_t a_passes = static_cast<int64_t>((a.nblocks + 1) / 2) * row_pairs;
  const int64_t side_from = a.side != nullptr ? a.side->done : 0;
  for (int b0 = 0; b0 < a.nblocks; b0 += 2) {
    const int nb = std::min(2, a.nblocks - b0);
    if (int8_tail) {  // rows 0-7: the blocks' last 8 k-quads; rows 8-15: zeros
      for (int j = 0; j < nb; ++j) {
        std::memcpy(buf.btile + j * kTileBytes, a.b + (b0 + j) * a.b_block_stride + a.K / 64 * kTileBytes, 512);
        std::memset(buf.btile + j * kTileBytes + 512, 0, 512);
      }
      KTAMX_COMPILER_BARRIER();
    }
    const uint8_t* next = nullptr;
    int next_blocks = 0;
    if (b0 + 2 < a.nblocks) {
      next = a.b + (b0 + 2) * a.b_block_stride;
      next_blocks = std::min(2, a.nblocks - b0 - 2);
    } else if (a.next_b != nullptr) {
      next = a.next_b;
      next_blocks = std::min(2, a.nblocks);
    }
    for (int r = 0; r < row_pairs; ++r) {
      const int g0 = 2 * r, na = std::min(2, groups - g0);
      Block blk;
      blk.g0 = g0;
      blk.b0 = b0;
      blk.s0 = 0;
      blk.s1 = steps;
      blk.unpack = r == 0;
      if (r == 0) {  // (int4 reads its packed B only while unpacking, on the first row pair)
        blk.l1_from = 0;
        blk.l1_to = steps;
      }
      if (next != nullptr && steps > 0) {  // 1/passes of the next pair during each pass
        blk.next = next;
        blk.next_blocks = next_blocks;
        const PassSlice ps = pass_slice(bb, r, row_pairs, steps);
        blk.next_begin = ps.begin;
        blk.next_end = ps.end;
        blk.next_step = ps.step;
      }
      const int64_t walk_pass = static_cast<int64_t>(b0 / 2) * row_pairs + r;  // this pass among the walk's a_passes
      if (next_a && steps > 0) {
        const PassSlice ps = pass_slice(a.next_a_bytes, walk_pass, a_passes, steps);
        blk.next_a = a.next_a;
        blk.next_a_begin = ps.begin;
        blk.next_a_end = ps.end;
        blk.next_a_step = ps.step;
      }
      if (a.side != nullptr && steps > 0) {  // (walk_pass / a_passes of the work due)
        blk.side = a.side;
        blk.side_from = side_from + (side_until - side_from) * walk_pass / a_passes;
        blk.side_to = side_from + (side_until - side_from) * (walk_pass + 1) / a_passes;
      }
      if (na == 2 && nb == 2) run_block<F, 2, 2>(a, ar, blk, buf);
      else if (na == 2) run_block<F, 2, 1>(a, ar, blk, buf);
      else if (nb == 2) run_block<F, 1, 2>(a, ar, blk, buf);
      else run_block<F, 1, 1>(a, ar, blk, buf);
    }
  }
}

template <WeightFormat F>
void gemm_amx(const GemmArgs& a) {
  const int test_rows = g_test_min_rows.load(std::memory_order_relaxed);
  // the two-level int8 walk unpacks as int4's do: int4's row count (not measured on its own)
  const bool k8 = F == WeightFormat::INT8 && two_level_int8_walk(a);
  const bool g8 = F == WeightFormat::INT8 && grouped_int8_walk(a);
  const int min_rows = g8 ? kMinRowsGroupedInt8 : kMinRows[static_cast<int>(k8 ? WeightFormat::INT4 : F)];
  if (a.M < (test_rows >= 0 ? test_rows : min_rows)) return avx512_kernels().gemm[static_cast<int>(F)](a);
  // Grouped int8 with float32 scales in groups of 32 or more (GGUF Q8_0) walks the tiles as int4 does, a group at a
  // time (grouped_int8_walk). Affine int8 and groups of 16 (Q5_K/Q6_K with float32 scales) have no tile walk; they
  // run on the AVX-512 kernel at every M. So does affine int4 with
  // float32 scales per group: its walk stored, converted and scaled 4 C tiles after every 32-deep group, and the
  // AVX-512 kernel beat it at every size measured (device, one Qwen3-30B-A3B layer, ms at T = 512 / 2048: Q4_K 15.9 /
  // 66.9 against the walk's 30.9 / 72.6; session 39). With two-level scales (b_sub) Q4_K walks two_plane_block: 14.57
  // / 40.62 against the AVX-512 kernel's 14.92 / 59.08 on the float32 form (session 41, bench_fused_moe.py
  // ktorch-q4_k_2l / ktorch-q4_k), and so do Q6_K (sub * q as two byte planes: 16.49 / 39.90 against 23.62 / 86.92,
  // session 42) and Q5_K (17.98 / 43.28 against 19.36 / 69.88, session 43). Symmetric int4 keeps the walk (7.9 / 22.3
  // against 11.6 / 44.5), and so does MXFP4 (50.2 / 128.5 against 43.6 / 171.4: the walk wins the larger call).
  if ((F == WeightFormat::INT8 && !k8 && !g8 && (affine(a) || (a.group_size > 0 && a.group_size < a.K))) ||
      (F == WeightFormat::INT4 && affine(a) && !two_level_walk(a)))
    return avx512_kernels().gemm[static_cast<int>(F)](a);
  constexpr int max_rows = kMaxWalkRows;
  GemmArgs part = a;
  for (int m0 = 0; m0 < a.M; m0 += max_rows) {
    part.M = std::min(max_rows, a.M - m0);
    part.a_rows = a.a_rows + m0;
    if (a.a_scale != nullptr) part.a_scale = a.a_scale + m0;
    if (a.a_gsum != nullptr) part.a_gsum = a.a_gsum + m0 * a.a_gsum_stride;
    part.c = a.c + m0 * a.ldc;
    part.next_b = m0 + max_rows < a.M ? nullptr : a.next_b;  // a later walk of this call reuses this b from L2
    part.next_a = m0 + max_rows < a.M ? nullptr : a.next_a;
    tile_walk<F>(part, a.side != nullptr ? a.side->units * (m0 + part.M) / a.M : 0);
  }
}

}  // namespace

const KernelSet& amx_kernels() {
  static const KernelSet set = [] {
    const KernelSet& avx = avx512_kernels();
    return KernelSet{"amx",
                     {gemm_amx<WeightFormat::BF16>, gemm_amx<WeightFormat::INT8>, gemm_amx<WeightFormat::INT4>},
                     avx.glu_f32,
                     avx.glu_bf16,
                     avx.quantize_rows,
                     avx.scatter_add,
                     avx.sum_rows};
  }();
  return set;
}

void amx_min_rows_for_tests(int rows) { g_test_min_rows.store(rows < 0 ? -1 : rows, std::memory_order_relaxed); }

}  // namespace kt::kernels
