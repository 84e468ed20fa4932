// AVX-512 kernels (AVX512F/BW/VL + AVX512_BF16 + AVX512_VNNI), for the packed layouts in kernels.h.
//
// Register-blocked micro-kernels: MR activation rows x NR 16-column blocks of fp32/int32 accumulators.
// Each 64-byte weight line is loaded once and used by MR rows; each activation pair/quad is a 32-bit
// broadcast used by NR blocks.
//   bf16: acc += dpbf16(x_pair, W_pair)                            (vdpbf16ps)
//   int8: acc += dpbusd(W ^ 0x80, x_quad), then (acc - 128 * sum(x)) * s_w * s_x   (vpdpbusd: u8 x s8)
//   int4: per group: acc_g += dpbusd(W_nibble, x_quad), acc += (acc_g - 8 * sum_g(x)) * s_w[g], then * s_x
//   grouped int8 (groups of 16/32, GGUF Q8_0/Q6_K): per group acc_g += dpbusd(W ^ 0x80, x_quad),
//         acc += (acc_g - 128 * sum_g(x)) * s_w[g], then * s_x
//   affine int8/int4 (b_min: GGUF Q5_K/Q4_K): the same without the int4 -8, and acc -= sum_g(x) * min[g] per group
//   coded int4 (b_codes: MXFP4): the nibble shuffled through the table to codes[u] + offset (unsigned), the offset
//         removed as the -8 is: acc += (acc_g - offset * sum_g(x)) * s_w[g]
// With M = 1 (decode) the kernels stream each block's weights once, front to back; the driver keeps
// enough blocks in flight across threads to saturate DRAM.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "../kernels.h"
#include "scales.h"

namespace kt::kernels {
namespace {

inline __m512 bf16x16_to_f32(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

// acc += u8 x s8 quad dot products (vpdpbusd). gcc's builtin for it does not tie the accumulator to the
// destination register: it copies every accumulator before each dot product, and a 6 x 4 tile of them
// then spills inside the k loop (half the speed). The asm form keeps each accumulator in one register.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

inline int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Software prefetch of the weights the walk reads next (the next reduction chunk of the blocks, or the
// next call's first chunk, GemmArgs::next_b), spread over the row tiles of the current chunk: the tile
// for rows m0.. issues one prefetch per k step until its share is done. Without it every chunk's first
// row tile waits on DRAM (the hardware prefetchers do not run far enough ahead of these bursts), and
// compute and memory add up instead of overlapping: one thread, M = 32, weights cold, bf16 ran at 64% of
// its hot speed.
struct Prefetch {
  const uint8_t* base = nullptr;  // first block's first byte to fetch
  size_t stride = 0;              // bytes from block to block
  int64_t lines = 0;              // 64-byte lines per block
  int64_t l0 = 0, l1 = 0;         // this tile's share: lines [l0, l1) of all blocks' lines, block-major
  int64_t ahead = 0;              // few rows: lines ahead of the read one in each block (GemmArgs::prefetch_ahead)
  struct Cursor {
    const uint8_t* p = nullptr;
    int64_t left = 0, in_block = 0;
    const uint8_t* block = nullptr;
    size_t stride = 0;
    int64_t lines = 0;
    inline void step() {
      if (left <= 0) return;
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
      --left;
      p += 64;
      if (++in_block == lines) {
        block += stride;
        p = block;
        in_block = 0;
      }
    }
  };
  Cursor cursor() const {
    Cursor c;
    if (l1 <= l0 || lines == 0) return c;
    c.left = l1 - l0;
    c.stride = stride;
    c.lines = lines;
    c.block = base + (l0 / lines) * stride;
    c.in_block = l0 % lines;
    c.p = c.block + c.in_block * 64;
    return c;
  }
};

// Prefetch::ahead: line i + ahead of each of the tile's NR weight blocks (it may run past a block's end into the
// next block, which a prefetch may).
template <int NR>
inline void prefetch_ahead(const uint8_t* const* w, int64_t i, int64_t ahead) {
  if (ahead > 0)
    for (int b = 0; b < NR; ++b) _mm_prefetch(reinterpret_cast<const char*>(w[b] + (i + ahead) * 64), _MM_HINT_T0);
}

// ---------------------------------------------------------------- bf16
template <int MR, int NR, bool kPrefetch>
void bf16_tile(const GemmArgs& a, int m0, int b0, int64_t k0, int64_t k1, const Prefetch& pf) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NR; ++b)
      acc[r][b] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(a.c + (m0 + r) * a.ldc + 16 * (b0 + b));
  const uint16_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const uint16_t*>(a.a_rows[m0 + r]);
  const uint8_t* w[NR];
  for (int b = 0; b < NR; ++b) w[b] = a.b + (b0 + b) * a.b_block_stride;
  Prefetch::Cursor next = pf.cursor();
  for (int64_t p = k0 / 2; p < k1 / 2; ++p) {
    if constexpr (kPrefetch) next.step();
    prefetch_ahead<NR>(w, p, pf.ahead);
    __m512i wv[NR];
    for (int b = 0; b < NR; ++b) wv[b] = _mm512_loadu_si512(w[b] + p * 64);
    for (int r = 0; r < MR; ++r) {
      const __m512i xv = _mm512_set1_epi32(load_i32(x[r] + 2 * p));
      for (int b = 0; b < NR; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], (__m512bh)xv, (__m512bh)wv[b]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NR; ++b) _mm512_storeu_ps(a.c + (m0 + r) * a.ldc + 16 * (b0 + b), acc[r][b]);
}

// ---------------------------------------------------------------- int8
// The tile only accumulates int32 sums in `partial` (ldc int32 a row); gemm_int8 dequantizes once the
// whole K is summed. Keeping the dequantizing epilogue out of the tile keeps its 24 accumulators in
// registers (with it inlined, gcc spilled half of them inside the k loop).
template <int MR, int NR, bool kPrefetch>
void int8_tile(const GemmArgs& a, int m0, int b0, int64_t k0, int64_t k1, const Prefetch& pf, int32_t* partial) {
  __m512i acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NR; ++b)
      acc[r][b] = k0 == 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(partial + (m0 + r) * a.ldc + 16 * (b0 + b));
  const int8_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const int8_t*>(a.a_rows[m0 + r]);
  const uint8_t* w[NR];
  for (int b = 0; b < NR; ++b) w[b] = a.b + (b0 + b) * a.b_block_stride;
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  Prefetch::Cursor next = pf.cursor();
  for (int64_t q = k0 / 4; q < k1 / 4; ++q) {
    if constexpr (kPrefetch) next.step();
    prefetch_ahead<NR>(w, q, pf.ahead);
    __m512i wv[NR];
    for (int b = 0; b < NR; ++b) wv[b] = _mm512_xor_si512(_mm512_loadu_si512(w[b] + q * 64), sign);
    for (int r = 0; r < MR; ++r) {
      const __m512i xv = _mm512_set1_epi32(load_i32(x[r] + 4 * q));
      for (int b = 0; b < NR; ++b) acc[r][b] = dpbusd(acc[r][b], wv[b], xv);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NR; ++b) _mm512_storeu_si512(partial + (m0 + r) * a.ldc + 16 * (b0 + b), acc[r][b]);
}

// C = (partial - 128 * sum(x)) * s_w * s_x for the whole M x nblocks output.
void int8_dequantize(const GemmArgs& a, const int32_t* partial) {
  for (int m = 0; m < a.M; ++m) {
    const __m512i offset = _mm512_set1_epi32(128 * a.a_gsum[m * a.a_gsum_stride]);
    const __m512 xs = _mm512_set1_ps(a.a_scale[m]);
    for (int b = 0; b < a.nblocks; ++b) {
      const __m512 ws = _mm512_loadu_ps(a.b_scale + b * a.b_scale_block_stride);
      const __m512i v = _mm512_sub_epi32(_mm512_loadu_si512(partial + m * a.ldc + 16 * b), offset);
      _mm512_storeu_ps(a.c + m * a.ldc + 16 * b, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(v), ws), xs));
    }
  }
}

// ---------------------------------------------------------------- grouped formats
constexpr int64_t kScaleAhead = 4;  // groups ahead whose scales (and minimums) a tile prefetches

// The scales of a group are one line per block, a group's lines a row of scales apart (another page for most
// shapes), which the hardware prefetchers do not follow: fetch them (and the affine minimums) a few groups ahead
// (two-level: the sub-scale lines; a super-scale line serves a whole super-block).
template <int NR, bool kAffine>
inline void prefetch_scales(const GemmArgs& a, int b0, int64_t g, int64_t groups) {
  if (g + kScaleAhead >= groups) return;
  for (int b = 0; b < NR; ++b) prefetch_group_scales(a, kAffine, g + kScaleAhead, (b0 + b) * a.b_scale_block_stride);
}

// One group's int32 sums into the fp32 accumulators: acc += (gacc - offset * sum_g(x)) * s_w[g], and for the affine
// formats acc -= sum_g(x) * min[g] (the operations and their order of the portable kernels, fused; the scales in
// either form, group_scales16).
template <int MR, int NR, bool kAffine>
inline void group_epilogue(const GemmArgs& a, int m0, int b0, int64_t g, int32_t offset, __m512i (&gacc)[MR][NR],
                           __m512 (&acc)[MR][NR]) {
  __m512 ws[NR], wm[NR];
  const int64_t sb = super_of(a, g);
  for (int b = 0; b < NR; ++b) {
    ws[b] = group_scales16(a, false, g, sb, (b0 + b) * a.b_scale_block_stride);
    if constexpr (kAffine) wm[b] = group_scales16(a, true, g, sb, (b0 + b) * a.b_scale_block_stride);
  }
  for (int r = 0; r < MR; ++r) {
    const int32_t gsum = a.a_gsum[(m0 + r) * a.a_gsum_stride + g];
    const __m512i off = _mm512_set1_epi32(offset * gsum);
    const __m512 gs = _mm512_set1_ps(static_cast<float>(gsum));
    for (int b = 0; b < NR; ++b) {
      acc[r][b] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(gacc[r][b], off)), ws[b], acc[r][b]);
      if constexpr (kAffine) acc[r][b] = _mm512_fnmadd_ps(gs, wm[b], acc[r][b]);
    }
  }
}

// Grouped int8 (Q8_0, Q6_K; affine: Q5_K): per group acc_g += dpbusd(W ^ 0x80, x_quad), then group_epilogue with the
// offset 128; the activation scale once K is summed. Mirrors int4_tile with int8 lines.
template <int MR, int NR, bool kPrefetch, bool kAffine>
void int8g_tile(const GemmArgs& a, int m0, int b0, int64_t k0, int64_t k1, const Prefetch& pf) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NR; ++b)
      acc[r][b] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(a.c + (m0 + r) * a.ldc + 16 * (b0 + b));
  const int8_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const int8_t*>(a.a_rows[m0 + r]);
  const uint8_t* w[NR];
  for (int b = 0; b < NR; ++b) w[b] = a.b + (b0 + b) * a.b_block_stride;
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t quads = a.group_size / 4;
  Prefetch::Cursor next = pf.cursor();
  const int64_t groups = a.K / a.group_size;
  for (int64_t g = k0 / a.group_size; g < k1 / a.group_size; ++g) {
    prefetch_scales<NR, kAffine>(a, b0, g, groups);
    __m512i gacc[MR][NR];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NR; ++b) gacc[r][b] = _mm512_setzero_si512();
    for (int64_t q = g * quads; q < (g + 1) * quads; ++q) {
      if constexpr (kPrefetch) next.step();
      prefetch_ahead<NR>(w, q, pf.ahead);
      __m512i wv[NR];
      for (int b = 0; b < NR; ++b) wv[b] = _mm512_xor_si512(_mm512_loadu_si512(w[b] + q * 64), sign);
      for (int r = 0; r < MR; ++r) {
        const __m512i xv = _mm512_set1_epi32(load_i32(x[r] + 4 * q));
        for (int b = 0; b < NR; ++b) gacc[r][b] = dpbusd(gacc[r][b], wv[b], xv);
      }
    }
    group_epilogue<MR, NR, kAffine>(a, m0, b0, g, 128, gacc, acc);
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 xs = _mm512_set1_ps(k1 < a.K ? 1.0f : a.a_scale[m0 + r]);
    for (int b = 0; b < NR; ++b) _mm512_storeu_ps(a.c + (m0 + r) * a.ldc + 16 * (b0 + b), _mm512_mul_ps(acc[r][b], xs));
  }
}

// ---------------------------------------------------------------- int4

// kAffine (b_min set): the nibbles are the codes u themselves (no -8) and each group subtracts min * sum_g(x).
// kCoded (b_codes set): each nibble becomes codes[u] + offset (one in-lane byte shuffle of the table, offset =
// code_offset(codes), so the operand is unsigned) and the group removes offset * sum_g(x), as for the -8.
template <int MR, int NR, bool kPrefetch, bool kAffine, bool kCoded>
void int4_tile(const GemmArgs& a, int m0, int b0, int64_t k0, int64_t k1, const Prefetch& pf) {
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int b = 0; b < NR; ++b)
      acc[r][b] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(a.c + (m0 + r) * a.ldc + 16 * (b0 + b));
  const int8_t* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = static_cast<const int8_t*>(a.a_rows[m0 + r]);
  const uint8_t* w[NR];
  for (int b = 0; b < NR; ++b) w[b] = a.b + (b0 + b) * a.b_block_stride;
  const __m512i low = _mm512_set1_epi8(0x0f);
  int32_t offset = kAffine ? 0 : 8;
  __m512i table = _mm512_setzero_si512();
  if constexpr (kCoded) {
    offset = code_offset(a.b_codes);
    alignas(16) uint8_t t[16];
    for (int u = 0; u < 16; ++u) t[u] = static_cast<uint8_t>(a.b_codes[u] + offset);
    table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
  }
  const int64_t octs = a.group_size / 8;
  Prefetch::Cursor next = pf.cursor();
  // Few rows (decode): the low and high nibbles go to separate accumulators, so each accumulator takes one
  // vpdpbusd per weight line instead of a dependent pair (with one row and two blocks the pair's latency, not
  // DRAM, was the limit). With more rows there are enough independent chains, and not enough registers.
  constexpr bool kSplitNibbles = MR <= 2;
  constexpr int kHiRows = kSplitNibbles ? MR : 1, kHiBlocks = kSplitNibbles ? NR : 1;
  const int64_t groups = a.K / a.group_size;
  for (int64_t g = k0 / a.group_size; g < k1 / a.group_size; ++g) {
    prefetch_scales<NR, kAffine>(a, b0, g, groups);
    __m512i gacc[MR][NR], gacc_hi[kHiRows][kHiBlocks];
    for (int r = 0; r < MR; ++r)
      for (int b = 0; b < NR; ++b) gacc[r][b] = _mm512_setzero_si512();
    for (int r = 0; r < kHiRows; ++r)
      for (int b = 0; b < kHiBlocks; ++b) gacc_hi[r][b] = _mm512_setzero_si512();
    for (int64_t o = g * octs; o < (g + 1) * octs; ++o) {
      if constexpr (kPrefetch) next.step();
      prefetch_ahead<NR>(w, o, pf.ahead);
      for (int b = 0; b < NR; ++b) {
        const __m512i v = _mm512_loadu_si512(w[b] + o * 64);
        __m512i lo = _mm512_and_si512(v, low);
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (kCoded) {
          lo = _mm512_shuffle_epi8(table, lo);
          hi = _mm512_shuffle_epi8(table, hi);
        }
        for (int r = 0; r < MR; ++r) {
          gacc[r][b] = dpbusd(gacc[r][b], lo, _mm512_set1_epi32(load_i32(x[r] + 8 * o)));
          if constexpr (kSplitNibbles) {
            gacc_hi[r][b] = dpbusd(gacc_hi[r][b], hi, _mm512_set1_epi32(load_i32(x[r] + 8 * o + 4)));
          } else {
            gacc[r][b] = dpbusd(gacc[r][b], hi, _mm512_set1_epi32(load_i32(x[r] + 8 * o + 4)));
          }
        }
      }
    }
    if constexpr (kSplitNibbles) {
      for (int r = 0; r < MR; ++r)
        for (int b = 0; b < NR; ++b) gacc[r][b] = _mm512_add_epi32(gacc[r][b], gacc_hi[r][b]);
    }
    group_epilogue<MR, NR, kAffine>(a, m0, b0, g, offset, gacc, acc);
  }
  for (int r = 0; r < MR; ++r) {
    const __m512 xs = _mm512_set1_ps(k1 < a.K ? 1.0f : a.a_scale[m0 + r]);
    for (int b = 0; b < NR; ++b) _mm512_storeu_ps(a.c + (m0 + r) * a.ldc + 16 * (b0 + b), _mm512_mul_ps(acc[r][b], xs));
  }
}

// Walks the M x nblocks output in MR x NR tiles, instantiating the remainder shapes. The reduction is
// cut into chunks of kc so that the NR weight blocks of a chunk stay in L1 while every row group of
// the call passes over them (the weights are then read from L2/DRAM once per call, not once per row
// group); tiles carry their partial sums across chunks in C (int8: in an int32 buffer).
constexpr int kNoPrefetchRows = 6;  // calls of at most this many rows (one row tile) do not prefetch

template <int MR, int NR, template <int, int> class Tile>
struct TileWalker {
  template <int R, int B>
  static void at(const GemmArgs& a, int m0, int b0, int mr, int nr, int64_t k0, int64_t k1, const Prefetch& pf) {
    if constexpr (R > 1) {
      if (mr < R) return at<R - 1, B>(a, m0, b0, mr, nr, k0, k1, pf);
    }
    if constexpr (B > 1) {
      if (nr < B) return at<R, B - 1>(a, m0, b0, mr, nr, k0, k1, pf);
    }
    Tile<R, B>::run(a, m0, b0, k0, k1, pf);
  }
  // k_bytes: bytes of one k of a 16-column block (bf16 32, int8 16, int4 8).
  static void run(const GemmArgs& a, int64_t kc, int64_t k_bytes) {
    const int tiles = (a.M + MR - 1) / MR;
    for (int b0 = 0; b0 < a.nblocks; b0 += NR)
      for (int64_t k0 = 0; k0 < a.K; k0 += kc) {
        Prefetch pf;  // the chunk after this one
        int blocks = 0;
        if (a.M <= kNoPrefetchRows) {
          // one row tile streams the weights steadily: the hardware prefetchers keep up on their own, unless the
          // caller asks for software prefetches a fixed distance ahead in each block
          pf.ahead = a.prefetch_ahead;
        } else if (k0 + kc < a.K) {
          pf.base = a.b + b0 * a.b_block_stride + (k0 + kc) * k_bytes;
          blocks = std::min(NR, a.nblocks - b0);
          pf.lines = std::min(kc, a.K - k0 - kc) * k_bytes / 64;
        } else if (b0 + NR < a.nblocks) {
          pf.base = a.b + (b0 + NR) * a.b_block_stride;
          blocks = std::min(NR, a.nblocks - b0 - NR);
          pf.lines = std::min(kc, a.K) * k_bytes / 64;
        } else if (a.next_b != nullptr) {
          pf.base = a.next_b;
          blocks = std::min(NR, a.nblocks);
          pf.lines = std::min(kc, a.K) * k_bytes / 64;
        }
        pf.stride = a.b_block_stride;
        const int64_t total = blocks * pf.lines;
        for (int m0 = 0, t = 0; m0 < a.M; m0 += MR, ++t) {
          pf.l0 = total * t / tiles;
          pf.l1 = total * (t + 1) / tiles;
          at<MR, NR>(a, m0, b0, std::min(MR, a.M - m0), std::min(NR, a.nblocks - b0), k0, std::min(a.K, k0 + kc), pf);
        }
      }
  }
};

int32_t* int8_partials(size_t n) {
  thread_local std::vector<int32_t> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

template <int R, int B> struct Bf16Tile {
  static void run(const GemmArgs& a, int m0, int b0, int64_t k0, int64_t k1, const Prefetch& pf) {
    if (pf.l1 > pf.l0) bf16_tile<R, B, true>(a, m0, b0, k0, k1, pf);
    else bf16_tile<R, B, false>(a, m0, b0, k0, k1, pf);
  }
};
template <int R, int B> struct Int8Tile {
  static void run(const GemmArgs& a, int m0, int b0, int64_t k0, int64_t k1, const Prefetch& pf) {
    int32_t* partial = int8_partials(static_cast<size_t>(a.M) * a.ldc);
    if (pf.l1 > pf.l0) int8_tile<R, B, true>(a, m0, b0, k0, k1, pf, partial);
    else int8_tile<R, B, false>(a, m0, b0, k0, k1, pf, partial);
  }
};
template <int R, int B> struct Int4Tile {
  static void run(const GemmArgs& a, int m0, int b0, int64_t k0, int64_t k1, const Prefetch& pf) {
    const bool pre = pf.l1 > pf.l0;
    if (affine(a)) {
      if (pre) int4_tile<R, B, true, true, false>(a, m0, b0, k0, k1, pf);
      else int4_tile<R, B, false, true, false>(a, m0, b0, k0, k1, pf);
    } else if (a.b_codes != nullptr) {
      if (pre) int4_tile<R, B, true, false, true>(a, m0, b0, k0, k1, pf);
      else int4_tile<R, B, false, false, true>(a, m0, b0, k0, k1, pf);
    } else {
      if (pre) int4_tile<R, B, true, false, false>(a, m0, b0, k0, k1, pf);
      else int4_tile<R, B, false, false, false>(a, m0, b0, k0, k1, pf);
    }
  }
};
template <int R, int B> struct Int8GroupedTile {
  static void run(const GemmArgs& a, int m0, int b0, int64_t k0, int64_t k1, const Prefetch& pf) {
    const bool pre = pf.l1 > pf.l0;
    if (affine(a)) {
      if (pre) int8g_tile<R, B, true, true>(a, m0, b0, k0, k1, pf);
      else int8g_tile<R, B, false, true>(a, m0, b0, k0, k1, pf);
    } else {
      if (pre) int8g_tile<R, B, true, false>(a, m0, b0, k0, k1, pf);
      else int8g_tile<R, B, false, false>(a, m0, b0, k0, k1, pf);
    }
  }
};

// Reduction chunks: 16 KiB of weights per chunk for NR blocks (a multiple of the int4 group size).
void gemm_bf16(const GemmArgs& a) { TileWalker<6, 4, Bf16Tile>::run(a, 128, 32); }
void gemm_int8(const GemmArgs& a) {
  if (affine(a) || (a.group_size > 0 && a.group_size < a.K)) {  // grouped / affine (GGUF-exact formats)
    const int64_t kc = std::max<int64_t>(a.group_size, 256 / a.group_size * a.group_size);
    if (a.M <= 2) TileWalker<2, 4, Int8GroupedTile>::run(a, kc, 16);
    else TileWalker<6, 2, Int8GroupedTile>::run(a, kc, 16);
    return;
  }
  TileWalker<6, 4, Int8Tile>::run(a, 256, 16);
  int8_dequantize(a, int8_partials(static_cast<size_t>(a.M) * a.ldc));
}
void gemm_int4(const GemmArgs& a) {
  const int64_t kc = std::max<int64_t>(a.group_size, 1024 / a.group_size * a.group_size);
  // one or two rows: four blocks per tile (eight independent accumulator chains with the nibbles split)
  if (a.M <= 2) TileWalker<2, 4, Int4Tile>::run(a, kc, 8);
  else TileWalker<6, 2, Int4Tile>::run(a, kc, 8);
}

// ---------------------------------------------------------------- epilogues
// exp(x) = 2^n * p(r), n = round(x * log2 e), r = x - n ln2 in [-ln2/2, ln2/2]; relative error ~2e-7.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// g / d for d >= 1 (the sigmoids' 1 + exp(-x)): a 14-bit reciprocal and one Newton step (relative error ~1e-7,
// a few times cheaper than VDIVPS, the epilogue's costliest instruction). d past ~1e38 gives 0 (a denormal 1/d).
inline __m512 div_by(__m512 g, __m512 d) {
  const __m512 r = _mm512_rcp14_ps(d);
  return _mm512_mul_ps(g, _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f))));
}

inline __m512 activate(__m512 g, Activation act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  switch (act) {
    case Activation::SiLU: return div_by(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    case Activation::GeluTanh: {
      // 0.5 g (1 + tanh(u)) = g * sigmoid(2u) = g / (1 + exp(-2u))
      const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
      const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
      return div_by(g, _mm512_add_ps(one, exp_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), u))));
    }
    case Activation::Gelu: {
      alignas(64) float v[16];
      _mm512_store_ps(v, g);
      for (float& e : v) e = 0.5f * e * (1.0f + std::erf(e * 0.7071067811865476f));
      return _mm512_load_ps(v);
    }
    case Activation::Relu: return _mm512_max_ps(g, _mm512_setzero_ps());
  }
  return g;
}

inline __m256i f32_to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

template <typename Store>
void glu_rows(const float* c, int64_t ldc, int M, int n, Activation act, Store store) {
  for (int m = 0; m < M; ++m) {
    const float* g = c + m * ldc;
    int i = 0;
    for (; i + 16 <= n; i += 16) store(m, i, _mm512_mul_ps(activate(_mm512_loadu_ps(g + i), act), _mm512_loadu_ps(g + n + i)), 0xffff);
    if (i < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
      store(m, i, _mm512_mul_ps(activate(_mm512_maskz_loadu_ps(k, g + i), act), _mm512_maskz_loadu_ps(k, g + n + i)), k);
    }
  }
}

void glu_f32(const float* c, int64_t ldc, int M, int n, Activation act, float* out, int64_t ldo) {
  glu_rows(c, ldc, M, n, act, [&](int m, int i, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(out + m * ldo + i, k, v); });
}

void glu_bf16(const float* c, int64_t ldc, int M, int n, Activation act, uint16_t* out, int64_t ldo) {
  glu_rows(c, ldc, M, n, act,
           [&](int m, int i, __m512 v, __mmask16 k) { _mm256_mask_storeu_epi16(out + m * ldo + i, k, f32_to_bf16x16(v)); });
}

void quantize_rows(const float* x, int64_t ldx, int M, int64_t K, int64_t group_size, int8_t* q, int64_t ldq,
                   float* scale, int32_t* gsum) {
  const int64_t groups = K / group_size;
  for (int m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    int64_t k = 0;
    __m512 vmax = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(xr + k)));
    float amax = _mm512_reduce_max_ps(vmax);
    for (; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    scale[m] = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    const __m512i lim = _mm512_set1_epi32(127);
    for (int64_t g = 0; g < groups; ++g) {
      __m512i sum = _mm512_setzero_si512();
      for (k = g * group_size; k < (g + 1) * group_size; k += 16) {  // group_size % 16 == 0 (checked by the driver)
        __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xr + k), inv));
        v = _mm512_max_epi32(_mm512_min_epi32(v, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + m * ldq + k), _mm512_cvtepi32_epi8(v));
      }
      gsum[m * groups + g] = _mm512_reduce_add_epi32(sum);
    }
  }
}

// scatter_add asks for the destination row kScatterAhead rows ahead in exclusive state (PREFETCHW, every AVX-512
// CPU has it) before it writes row m. The down projection's accumulator rows are scattered over ~1 MB a task and
// come from the L3, and a store to a missing line holds the store buffer until its line arrives. 4 rows: on the
// device about -20% of down.scatter at T=2048 against none, and 12 no better (benchmarks/RESULTS.md, session 19,
// "PREFETCHW of the scatter's destination rows").
constexpr int kScatterAhead = 4;

inline void prefetch_w(const void* p) { asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(p))); }

// 16 lanes a step, a masked tail; one fused multiply-add per element (the portable set rounds twice).
void scatter_add(const float* src, int64_t lds, int M, int64_t n, const float* w, const int64_t* rows,
                 const uint8_t* assign, float* dst, int64_t ldd) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (n % 16)) - 1);
  const int64_t full = n / 16 * 16;
  constexpr int ahead = kScatterAhead;
  for (int m = 0; m < std::min(ahead, M); ++m)
    for (int64_t j = 0; j < n; j += 16) prefetch_w(dst + rows[m] * ldd + j);
  for (int m = 0; m < M; ++m) {
    if (m + ahead < M)
      for (int64_t j = 0; j < n; j += 16) prefetch_w(dst + rows[m + ahead] * ldd + j);
    float* d = dst + rows[m] * ldd;
    const float* s = src + m * lds;
    const __m512 wm = _mm512_set1_ps(w[m]);
    if (assign != nullptr && assign[m] != 0) {
      for (int64_t j = 0; j < full; j += 16) _mm512_storeu_ps(d + j, _mm512_mul_ps(wm, _mm512_loadu_ps(s + j)));
      if (tail) _mm512_mask_storeu_ps(d + full, tail, _mm512_mul_ps(wm, _mm512_maskz_loadu_ps(tail, s + full)));
      continue;
    }
    for (int64_t j = 0; j < full; j += 16)
      _mm512_storeu_ps(d + j, _mm512_fmadd_ps(wm, _mm512_loadu_ps(s + j), _mm512_loadu_ps(d + j)));
    if (tail)
      _mm512_mask_storeu_ps(d + full, tail,
                            _mm512_fmadd_ps(wm, _mm512_maskz_loadu_ps(tail, s + full), _mm512_maskz_loadu_ps(tail, d + full)));
  }
}

// bf16 by integer rounding (VCVTNEPS2BF16 would flush fp32 denormals to zero): + 0x7fff + the kept lsb, NaN
// truncated with the quiet bit set.
inline __m256i f32_to_bf16_exact(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
  return _mm512_cvtepi32_epi16(r);
}

void sum_rows(const float* const* src, int n_src, int64_t n, bool bf16_out, void* dst) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - j)) - 1);
    __m512 v = n_src > 0 ? _mm512_maskz_loadu_ps(k, src[0] + j) : _mm512_setzero_ps();
    for (int s = 1; s < n_src; ++s) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, src[s] + j));
    if (bf16_out) _mm256_mask_storeu_epi16(static_cast<uint16_t*>(dst) + j, k, f32_to_bf16_exact(v));
    else _mm512_mask_storeu_ps(static_cast<float*>(dst) + j, k, v);
  }
}

}  // namespace

const KernelSet& avx512_kernels() {
  static const KernelSet set{"avx512", {gemm_bf16, gemm_int8, gemm_int4}, glu_f32, glu_bf16, quantize_rows,
                             scatter_add, sum_rows};
  return set;
}

}  // namespace kt::kernels
