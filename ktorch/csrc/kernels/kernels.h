// The contract between the fused-MoE driver (ktorch/csrc/moe/) and the ISA kernels
// (ktorch/csrc/kernels/{portable,avx2,avx512,amx}/). Pure C++: no ATen, no intrinsics, so that each ISA
// folder compiles on its own with its own -m flags and the driver picks a KernelSet at run time.
//
// Packed weight layouts (one expert; W is [N, K], N output channels, K reduction; N % 16 == 0):
//   bf16: [N/16][K/2][16][2]  element (nb, p, c, j) = W[16*nb + c][2*p + j]
//         (the AVX-512 BF16 dot-product pair layout, and also the AMX-BF16 B-tile layout)
//   int8: [N/16][K/4][16][4]  element (nb, q, c, j) = W[16*nb + c][4*q + j], signed, symmetric per
//         output channel: W ≈ q * scale[0][n]           (the VNNI quad layout = AMX-INT8 B-tile layout),
//         or per group of group_size input channels (group_size a multiple of 16): W = q * scale[k / group_size][n]
//   int4: [N/16][K/8][16][4] bytes; byte (nb, o, c, j) holds W[16*nb+c][8*o+j] + 8 in its low nibble and
//         W[16*nb+c][8*o+4+j] + 8 in its high nibble; values in [-8, 7], group-wise symmetric scales:
//         W ≈ q * scale[k / group_size][n] (ktorch.pack_experts' int4: scale = super[n] * sub[g][n] with byte
//         sub-scales 1..15, GemmArgs::b_sub, where K is a multiple of 256)
// Scales are fp32 [G][N] per expert (G = 1 for per-channel int8, K / group_size for grouped int8 and int4).
// Affine (GGUF K-quants kept exact: docs/loading.md): a minimum per scale, fp32 [G][N] (GemmArgs::b_min), and
//   int8: W = q * scale[g][n] - min[g][n]  (q the stored signed byte, e.g. Q5_K's 0..31)
//   int4: W = u * scale[g][n] - min[g][n]  (u the stored unsigned nibble 0..15, no -8: Q4_K's codes as in the file)
// The 16-column blocks of an expert follow each other; block nb starts at nb * block_bytes(K).
#pragma once

#include <cstddef>
#include <cstdint>

namespace kt::kernels {

enum class WeightFormat : int { BF16 = 0, INT8 = 1, INT4 = 2 };
constexpr int kNumFormats = 3;

enum class Activation : int { SiLU = 0, GeluTanh = 1, Gelu = 2, Relu = 3 };

// MXFP4's code table: nibble -> the E2M1 value doubled (gguf.quants.MXFP4.kvalues; nibble 8 is -0).
inline constexpr int8_t kMxfp4Codes[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The unsigned offset a kernel adds to coded nibbles so that codes[u] + offset >= 0 (vpdpbusd's unsigned operand):
// -min(codes), at least 0; the kernels require max(codes) + offset <= 255 and codes in int8 (kMxfp4Codes: offset 12,
// operands 0..24; the tables are constants of this header, chosen by the driver from the weights' dtype).
inline int32_t code_offset(const int8_t* codes) {
  int32_t lo = 0;
  for (int i = 0; i < 16; ++i) lo = codes[i] < lo ? codes[i] : lo;
  return -lo;
}

// Bytes of one 16-column block of a packed matrix with reduction length K.
inline size_t block_bytes(WeightFormat f, int64_t K) {
  switch (f) {
    case WeightFormat::BF16: return static_cast<size_t>(K) * 16 * 2;
    case WeightFormat::INT8: return static_cast<size_t>(K) * 16;
    case WeightFormat::INT4: return static_cast<size_t>(K) * 8;
  }
  return 0;
}

// Work a caller hands a kernel call to interleave with its own (the GLU of the previous call's output: vector work
// that runs beside the AMX tile products): units [0, units) in order, through run(ctx, u0, u1). A kernel runs
// any prefix of them and counts it in `done`; the caller runs the rest after the call (a kernel that ignores the
// work leaves done at 0).
struct SideWork {
  void (*run)(void* ctx, int64_t u0, int64_t u1) = nullptr;
  void* ctx = nullptr;
  int64_t units = 0;
  int64_t done = 0;
};

// C[m][16*b + c] = sum_k A[m][k] * W[16*b + c][k], for m < M and b < nblocks, in fp32.
// A rows are gathered through pointers (tokens routed to one expert are not adjacent in the batch).
//   bf16 weights: A rows are bf16 (uint16_t) of length K.
//   int8/int4:    A rows are int8 of length K in [-127, 127] (QuantizeRowsFn's range; the AVX2 kernels' pair
//                 products rely on it), row m dequantizes as a_scale[m] * A[m][k];
//                 a_gsum[m * a_gsum_stride + g] = sum of A[m][k] over k in group g (the group size of
//                 the weights, K for int8), used to undo the unsigned offset of the weights.
// The result is fully dequantized (a_scale and the weight scales applied).
struct GemmArgs {
  int M = 0;
  int64_t K = 0;
  const void* const* a_rows = nullptr;
  const float* a_scale = nullptr;
  const int32_t* a_gsum = nullptr;
  int64_t a_gsum_stride = 0;
  int64_t group_size = 0;  // int8 (K for per-channel scales) and int4
  const uint8_t* b = nullptr;        // first 16-column block
  size_t b_block_stride = 0;         // bytes from one 16-column block to the next one used
  const float* b_scale = nullptr;    // scale of the first column in group 0 (int8/int4; nullptr: two-level, b_sub)
  int64_t b_scale_group_stride = 0;  // floats from group g to g + 1 (= N)
  int64_t b_scale_block_stride = 16; // floats from one 16-column block to the next one used
  // Affine formats: the minimum of the first column in group 0, indexed like b_scale; nullptr: symmetric (or two-level
  // minimums, b_min_sub; affine() below). The kernels
  // subtract min[g][n] * a_scale[m] * a_gsum[m][g] per group (the group sums of the quantized activations).
  const float* b_min = nullptr;
  // int4 only: the 16 signed values the nibbles stand for (kMxfp4Codes), or nullptr (u - 8, or u with b_min). Never
  // set together with b_min.
  const int8_t* b_codes = nullptr;
  // Two-level scales (GGUF K-quants at the file's size, ktorch's int4): the scale of group g of column n is
  // b_super[(g * group_size / super_size) * b_super_group_stride + n] * b_sub[g * b_sub_group_stride + n] (a byte,
  // signed where b_sub_signed; the columns of a call indexed as b_scale's, b_scale_block_stride a block), the fp32
  // product, and an affine format's minimum likewise from b_min_sub and b_min_super (same strides). Given alone
  // (b_scale and b_min nullptr: the driver's calls, which read no float32 form) every kernel takes them; the AMX walks
  // multiply the nibbles by the byte sub-scales and sum whole super-blocks in their tiles (amx/kernels.cpp), the others
  // form each group's fp32 scale as they go. nullptr: none.
  const uint8_t* b_sub = nullptr;
  int64_t b_sub_group_stride = 0;
  const float* b_super = nullptr;
  int64_t b_super_group_stride = 0;
  const uint8_t* b_min_sub = nullptr;
  const float* b_min_super = nullptr;
  bool b_sub_signed = false;
  int64_t super_size = 0;            // input channels per super-scale (GGUF: 256)
  int nblocks = 0;                   // 16-column blocks to compute, 1..kMaxBlocks
  float* c = nullptr;
  int64_t ldc = 0;
  // A hint: the b of the caller's next call (same format, K, b_block_stride and nblocks), or nullptr.
  // The AVX-512 kernels prefetch its first weights during their last ones; other kernels may ignore it.
  const uint8_t* next_b = nullptr;
  // A hint: the activation rows of the caller's next call, next_a_bytes contiguous bytes (e.g. the down
  // projection's next expert: its h rows follow each other), or nullptr. The AMX walks prefetch them into L2
  // spread over this call's passes; other kernels ignore it.
  const uint8_t* next_a = nullptr;
  int64_t next_a_bytes = 0;
  // Optional work to interleave (see SideWork); the AMX walks spread it over their k steps, others leave it.
  SideWork* side = nullptr;
  // Calls of a few rows (decode): each weight stream is prefetched this many 64-byte lines ahead of the one read
  // (0: left to the hardware prefetchers). A hint the AVX-512 and avx2 kernels follow; the others ignore it.
  int prefetch_ahead = 0;
};
// An affine format (a minimum per group), in either scale form.
inline bool affine(const GemmArgs& a) { return a.b_min != nullptr || a.b_min_sub != nullptr; }

// The super-block of group g (two-level; any value for the float32 form).
inline int64_t super_of(const GemmArgs& a, int64_t g) {
  return a.b_scale != nullptr ? 0 : g * a.group_size / a.super_size;
}

// The weight scale (minimum: the affine minimum) of group g, column col (b_scale's column index): b_scale's float, or
// the two-level product.
inline float group_scale(const GemmArgs& a, bool minimum, int64_t g, int64_t col) {
  if (a.b_scale != nullptr) return (minimum ? a.b_min : a.b_scale)[g * a.b_scale_group_stride + col];
  const uint8_t byte = (minimum ? a.b_min_sub : a.b_sub)[g * a.b_sub_group_stride + col];
  const float sub = a.b_sub_signed ? static_cast<float>(static_cast<int8_t>(byte)) : static_cast<float>(byte);
  const float* super = minimum ? a.b_min_super : a.b_super;
  return super[super_of(a, g) * a.b_super_group_stride + col] * sub;
}

constexpr int kMaxBlocks = 8;  // the driver sizes its kernel-output buffers by it; the kernels take any count

using GemmFn = void (*)(const GemmArgs&);

// out[m][i] = act(C[m][i]) * C[m][n + i] for i < n (the gate columns come first, then the up columns).
using GluF32Fn = void (*)(const float* c, int64_t ldc, int M, int n, Activation act, float* out, int64_t ldo);
using GluBf16Fn = void (*)(const float* c, int64_t ldc, int M, int n, Activation act, uint16_t* out, int64_t ldo);

// Symmetric per-row int8 quantization: q = round(x / scale), scale = max|x| / 127 (0 for an all-zero row),
// and gsum[m][g] = sum of q over each group of group_size columns (group_size divides K).
using QuantizeRowsFn = void (*)(const float* x, int64_t ldx, int M, int64_t K, int64_t group_size, int8_t* q,
                                int64_t ldq, float* scale, int32_t* gsum);

// The down projection's weighted scatter: dst[rows[m] * ldd + j] += w[m] * src[m * lds + j] for m < M, j < n;
// rows with assign != nullptr and assign[m] != 0 are written instead (= w[m] * src[...]: the first expert of a
// token in an accumulator, which then needs no zeroing; the same value as adding to +0).
using ScatterAddFn = void (*)(const float* src, int64_t lds, int M, int64_t n, const float* w, const int64_t* rows,
                              const uint8_t* assign, float* dst, int64_t ldd);

// The down projection's last step: dst[j] = src[0][j] + src[1][j] + ... + src[n_src - 1][j] for j < n, added in
// that order in fp32 (n_src == 0: zeros), stored as fp32 (bf16_out false: dst is float*) or as bf16 rounded to
// nearest even, a NaN truncated with its quiet bit set (dst is uint16_t*), for every input (denormals too).
using SumRowsFn = void (*)(const float* const* src, int n_src, int64_t n, bool bf16_out, void* dst);

struct KernelSet {
  const char* name;
  GemmFn gemm[kNumFormats];
  GluF32Fn glu_f32;
  GluBf16Fn glu_bf16;
  QuantizeRowsFn quantize_rows;
  ScatterAddFn scatter_add;
  SumRowsFn sum_rows;
};

// Defined in the ISA folders; each returns nullptr-free tables. The amx table may fall back to avx512
// entries for formats it does not cover.
const KernelSet& portable_kernels();
const KernelSet& avx2_kernels();
const KernelSet& avx512_kernels();
const KernelSet& amx_kernels();
// Tests only (the kernel test binary, the op tests through kt::_amx_min_rows_for_tests): the AMX gemms send calls
// with fewer rows than `rows` to the AVX-512 ones, for every format (0: every call through the tiles); -1 restores
// the measured per-format counts. Not a setting: the counts are constants (amx/kernels.cpp, kMinRows).
void amx_min_rows_for_tests(int rows);

}  // namespace kt::kernels
