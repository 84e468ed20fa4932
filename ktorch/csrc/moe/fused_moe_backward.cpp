// Training through the packed CPU experts: the backward of kt::fused_moe, and a forward that takes additive
// deltas on the gate/up pre-activations (LoRA on the experts) and returns h.
//
// Math, per routed pair p = (t, k) with e = ids[t, k] >= 0, w = weights[t, k], [g | u] = x_t W13_e^T (+ delta_p):
//   h_p = act(g) * u,   out[t] = sum_k w * h_p W2_e^T
// backward, given dY = d out [T, H] (and optionally d h [T, K, I], when h fed something else, e.g. a down adapter):
//   G  = dY[t] W2_e                     [I]     (the down projection read transposed)
//   dw = <G, h_p>                               (= <dY[t], h_p W2_e^T>: no extra product)
//   dh = w * G (+ dh_p)
//   dg = dh * u * act'(g),  du = dh * act(g)
//   dX[t] += [dg | du] W13_e              [H]     (gate/up read transposed); d delta_p = [dg | du]
// The expert weights are frozen: no gradient for them.
//
// What is saved and what is recomputed: fused_moe_delta (the expert-LoRA forward) returns the pre-activations
// [g | u] it computed ([T, K, N13] in hidden's dtype: biases and deltas included, as the GLU read them; Qwen3-30B-A3B
// at T = 2048: 48 MiB a layer in bf16, one layer's at a time with the decoder layers checkpointed, 2.4 GiB for 48
// layers without), its autograd saves them, and the backward reads them (its gate_up argument): 2 H*I-sized
// products a pair (dY W2, [dg | du] W13). Without them (kt.fused_moe's autograd, which saves only the op's inputs:
// hidden, ids, weights and references to the packed tensors) it recomputes [g | u] = x W13^T (+ biases + deltas)
// from hidden: 2 more, 5 in all. Measured here (2-core AMD EPYC, AVX2, loaded; int8, E=32, H=1024, I=384, K=8,
// T=256, fp32 hidden: fp32 products, as this CPU's bf16 matmul is an emulation): 252-315 ms a call with them against
// 365-384 recomputing (three runs; one profile: products 130 against 242, copies 6 against 33).
//
// The forward with deltas (fused_moe_delta) takes two paths by hidden's dtype:
// - bf16/fp16 (training): kt.fused_moe's own path (fused_moe.cpp, fused_moe_with_delta): the same packed kernels
//   (AMX/AVX-512/portable), tasks, stages and threads. The deltas are added to each gate/up kernel call's fp32 output
//   right before the GLU (in its shared driver step, Part::Glu: before the kernels' GLU or the driver's epilogue, and
//   inside the side work the AMX walks run), and each routed pair's h is written out from the GLU's output (bf16 for
//   bf16 weights; fp32 before the int8 quantization for int formats), rounded once to hidden's dtype. Its numerics
//   are kt.fused_moe's (activations rounded to bf16, or to int8 per row with int formats); with zero deltas it is
//   kt.fused_moe bit for bit. It runs every format kt.fused_moe runs, and so does the backward: the exact GGUF
//   layouts too (grouped and affine int8, affine int4, float16 and two-level scales, int4 gate/up beside int8 down:
//   describe_packed, expert_scales).
// - float32/float64: the reference below, on decoded experts: the exact function of the dequantized weights, which
//   gradcheck (float64) and the float32 comparisons with peft (tests/test_lora.py) check.
//
// How the backward (and the reference forward) run: the pairs are grouped by expert. With at least as many experts
// as ATen threads, each expert is one task, pulled by the ATen (OpenMP) workers from a shared counter, most tokens
// first, single threaded inside the task. The backward decodes its packed blocks (bf16, int8 per channel or group,
// int4 grouped, MXFP4 nibbles, the affine K-quants: kernels.h) a slice at a time into the worker's buffer and
// multiplies each slice at once (product_t, product_up). The transposed products dY W2 and [dg | du] W13 with bf16
// operands (bf16/fp16 hidden) at the avx512 and amx levels: kSliceBytes (256 KiB) of W^T's 16-column blocks
// decoded into the bf16 kernels' own packed layout (decode_expert_tb_bf16; int8 and int4 through decode_tb_avx512: a
// 16 x 16 tile a step, converted, scaled, rounded and transposed in registers) and multiplied by ktorch's packed bf16
// kernels (AVX-512 BF16, AMX tiles), fp32 out: no oneDNN call or reorder per slice (~44 a Qwen3 expert before, each
// with its fixed cost). Otherwise (fp32/fp64 hidden, the portable level, one expert over all threads) ATen's
// matmuls (oneDNN/MKL): W^T's rows decoded row-major (decode_expert_t_impl) and read as the view (W^T)^T, the
// reduction dimension contiguous in both operands. The recompute x W13^T (no saved pre-activations) multiplies W13's
// packed rows as stored, a slice of gate rows with the same up rows: with bf16 operands at the avx512 and amx levels
// through the packed bf16 kernels (bf16 weights read in place, int8/int4 decoded into that layout by
// decode_b_avx512), otherwise decoded row-major for ATen's matmul. The decoded weights stay in the core's L2 (2 MiB on the
// device's Xeon): decoding the whole expert first (9.4 MiB of W2^T and W13^T for Qwen3-30B-A3B in bf16) wrote each
// weight out to memory and read it back, with 16 workers sharing the bandwidth (docs/training.md has the device
// figures). The slicing runs along the products' output columns, so each output element is one whole reduction (no
// partial sums). ATen's bf16 fallback matmul (no AVX-512 BF16) is 5-9x faster with W^T read transposed
// (docs/training.md); its fp32 sgemm does not care. With fewer experts than threads (Mixtral's 8 on 16 cores, or few
// tokens) the experts run one at a time, each whole matrix decoded over the workers by blocks and the ATen ops
// multi-threaded, where the busiest expert's products are big enough for threads to pay (kMinThreadedMacs); smaller
// ones run one expert a worker as above. The float reference forward decodes W13 and W2 whole, as stored. Each
// pair's row of d hidden is its own row of a [pairs, H] buffer in the compute dtype, grouped by expert (the product
// of an expert writes its rows in place: no scatter), and the routed slots are summed by token in slot order
// afterwards in the element dtype (sum_slots; the skipped slots have no row): no atomics, the same result whatever
// the thread count. d delta is written in its own dtype, one rounding a row. KT_PROFILE=1 prints a line a call:
// setup, experts (per worker: decode, products, element-wise work, copies), sum (ExpertTimes below).
// Dtypes: the products run in float64 for float64 hidden (gradcheck), float32 for float32, bf16 otherwise (fp32
// accumulation; the packed kernels' transposed products give fp32 results: dY W2 kept in fp32, each pair's row of
// d hidden rounded once to bf16); the element-wise work in float32 (float64 for float64). Decoded int8/int4 weights
// are q * scale in fp32 (as kt.unpack), then cast. The int formats' forward (kt.fused_moe) also quantizes the
// activations to int8; this backward differentiates the function of the dequantized weights with float
// activations (a straight-through estimate for the activation rounding); given the forward's pre-activations it
// takes act' and h at the values the forward had (with that rounding, and rounded once to hidden's dtype, as the
// recompute's bf16 product rounds them too).
#include "fused_moe_backward.h"

#include "fused_moe.h"
#include "profile.h"
#include "../runtime/dispatch.h"
#include "../runtime/memory.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

namespace kt::moe {
namespace {

enum class Fmt { BF16, INT8, INT4 };

// The decodes compute q * s - m as kt.unpack does, two roundings: no fused multiply-add (GCC contracts by default in
// GNU mode where the target has FMA), so that the float64 backward differentiates exactly the weights kt.unpack and
// the float reference forward (decode_expert) give. Without minimums (m = 0), q * s - 0 is q * s either way.
#define NO_FP_CONTRACT __attribute__((optimize("fp-contract=off")))

struct Packed {
  Fmt fmt;
  const uint8_t* data;
  const float* scales;  // float32 [E, parts, G, N] (parts 2: scales, then minimums), or nullptr (bf16, or sub_kind)
  int64_t E, N, K, G;
  // INT4: the value of each nibble, u - 8, or MXFP4's code table (float4_e2m1fn_x2 weights: kernels::kMxfp4Codes),
  // or u itself (affine: w = u * s - m, GGUF Q4_K's codes as in the file)
  int8_t nibble[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
  bool affine = false;  // scales [E, 2, G, N]: w = q * s - m (the exact GGUF Q4_K and Q5_K)
  // Scales at the file's size, expanded to float32 an expert at a time (expert_scales): 0 none (float32 in
  // `scales`); 1 two-level uint8 sub-scales (Q4_K, Q5_K), 2 int8 (Q6_K), times float32 super-scales (one per 256
  // input channels, `supers` of them); 3 float16 per group (Q8_0's d). kt.fused_moe's forms (fused_moe.cpp describe).
  int sub_kind = 0;
  int64_t supers = 0;
  const void* raw_scales = nullptr;  // sub_kind != 0: the scales tensor's bytes
  uint64_t id = 0;                   // unique per describe_packed call: the key of expert_scales' per-thread cache
  int parts() const { return affine ? 2 : 1; }
  int64_t rows() const { return G + 4 * supers; }  // two-level: byte rows of one part
  size_t expert_bytes() const {
    const size_t per = fmt == Fmt::BF16 ? 2 * 16 : fmt == Fmt::INT8 ? 16 : 8;  // bytes per 16-column block per K
    return static_cast<size_t>(N / 16) * K * per;
  }
};

std::atomic<uint64_t> next_packed_id{1};

// The scales forms kt.fused_moe takes (fused_moe.cpp describe): float32 [E, G, N] (w = q * s; int8: G = 1 per output
// channel or groups of a multiple of 16 input channels; int4 groups of a multiple of 32) or [E, 2, G, N] (affine:
// w = q * s - m; int4 codes then the unsigned nibbles); float16 like them; two-level uint8/int8 [E, (2,) G + K/64, N]
// (ktorch.ops.moe.pack_kscales). w13 and w2 may differ in format (GGUF Q4_K_M: int4 gate/up beside int8 down).
Packed describe_packed(const char* op, const at::Tensor& w, const std::optional<at::Tensor>& s, const char* name,
                       const char* scales_name) {
  TORCH_CHECK(w.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ", w.device());
  Fmt f;
  int64_t per;
  switch (w.scalar_type()) {
    case at::kBFloat16: f = Fmt::BF16; per = 2; break;
    case at::kChar: f = Fmt::INT8; per = 4; break;
    case at::kByte: f = Fmt::INT4; per = 8; break;
    case at::ScalarType::Float4_e2m1fn_x2: f = Fmt::INT4; per = 8; break;  // MXFP4 nibbles, decoded through the table
    default:
      TORCH_CHECK(false, op, ": ", name, " must be packed by kt.pack_bf16/pack_int8/pack_int4 (bfloat16, int8 or uint8 ",
                  "for int4) or pack_quantized (float4_e2m1fn_x2 for MXFP4), got ", w.scalar_type());
  }
  TORCH_CHECK(w.dim() == 5 && w.size(3) == 16 && w.size(4) == (f == Fmt::BF16 ? 2 : 4) && w.is_contiguous(), op, ": ",
              name, " must be a contiguous packed tensor [E, N/16, K/", per, ", 16, ", f == Fmt::BF16 ? 2 : 4,
              "], got shape ", w.sizes());
  Packed p{f, static_cast<const uint8_t*>(w.data_ptr()), nullptr, w.size(0), w.size(1) * 16, w.size(2) * per, 1};
  p.id = next_packed_id++;
  const bool mxfp4 = w.scalar_type() == at::ScalarType::Float4_e2m1fn_x2;
  if (mxfp4) std::memcpy(p.nibble, kernels::kMxfp4Codes, 16);
  if (f == Fmt::BF16) {
    TORCH_CHECK(!s.has_value(), op, ": bf16 weights take no scales, but ", scales_name, " was given");
    return p;
  }
  TORCH_CHECK(s.has_value(), op, ": ", f == Fmt::INT8 ? "int8" : "int4", " weights need ", scales_name);
  const at::Tensor& sc = *s;
  const auto st = sc.scalar_type();
  const bool two_level = st == at::kByte || st == at::kChar;
  TORCH_CHECK(sc.device().is_cpu() && (st == at::kFloat || st == at::kHalf || two_level) &&
                  (sc.dim() == 3 || (sc.dim() == 4 && sc.size(1) == 2)) && sc.is_contiguous() && sc.size(0) == p.E &&
                  sc.size(-1) == p.N,
              op, ": ", scales_name, " must be a contiguous CPU tensor [E=", p.E, ", G, N=", p.N, "] (or [E, 2, G, N]: ",
              "scales and minimums) in float32 or float16, or two-level uint8/int8 [E, (2,) G + K/64, N] ",
              "(ktorch.ops.moe.pack_kscales), got ", st, " ", sc.sizes(), " on ", sc.device());
  p.affine = sc.dim() == 4;
  TORCH_CHECK(!(p.affine && mxfp4), op, ": ", name, " holds MXFP4 nibbles (float4_e2m1fn_x2), which take scales ",
              "[E, G, N], but ", scales_name, " has minimums too: ", sc.sizes());
  if (p.affine && f == Fmt::INT4)
    for (int u = 0; u < 16; ++u) p.nibble[u] = static_cast<int8_t>(u);
  p.G = sc.size(-2);
  if (two_level) {  // rows [0, G): the sub-scales; then the float32 super-scales [K/256][N] as 4 K/256 byte rows
    TORCH_CHECK(p.K % 256 == 0 && p.G > 4 * (p.K / 256), op, ": two-level ", scales_name, " ", sc.sizes(),
                " needs K a multiple of 256 and more than K/64 rows, K=", p.K);
    p.supers = p.K / 256;
    p.G -= 4 * p.supers;
    TORCH_CHECK(p.G % p.supers == 0, op, ": two-level ", scales_name, " has ", p.G,
                " sub-scale rows, not a whole number per 256 input channels of K=", p.K);
  }
  TORCH_CHECK(p.G > 0 && p.K % p.G == 0, op, ": ", scales_name, " has ", p.G, " groups, which do not divide K=", p.K);
  if (f == Fmt::INT8) {
    TORCH_CHECK((p.G == 1 && !p.affine) || (p.K / p.G) % 16 == 0, op, ": int8 ", scales_name, " has ", p.G,
                " groups of ", p.K / p.G, " input channels; grouped or affine int8 needs groups of a multiple of 16");
  } else {
    TORCH_CHECK((p.K / p.G) % 32 == 0, op, ": int4 ", scales_name, " has ", p.G, " groups of ", p.K / p.G,
                " input channels; int4 needs groups of a multiple of 32");
  }
  if (st == at::kFloat) {
    p.scales = sc.data_ptr<float>();
  } else {
    p.sub_kind = st == at::kHalf ? 3 : st == at::kByte ? 1 : 2;
    p.raw_scales = sc.data_ptr();
  }
  return p;
}

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The dense row of packed row p of an N-row matrix: gate_up, (p % 64) / 32 * N/2 + p / 64 * 32 + p % 32 (gate rows
// first, then up rows: pack.cpp's order undone); otherwise p. 16 packed rows from a multiple of 16 stay consecutive.
inline int64_t dense_row(int64_t p, int64_t N, bool gate_up) {
  return gate_up ? (p % 64) / 32 * (N / 2) + p / 64 * 32 + p % 32 : p;
}

// Expert e's float32 scales [parts][G][N] (the minimums [G][N] after the scales where affine), nullptr for bf16.
// Scales at the file's size (sub_kind) are expanded into a per-thread cache of the last two (matrix, expert) pairs
// (a worker decodes an expert's two matrices a slice at a time, alternately): super[g / (G / S)] * sub[g] in float32
// (exact: an fp16 d times a small integer), fp16 converted, as kt.fused_moe's expand_kscales forms them.
const float* expert_scales(const Packed& m, int64_t e) {
  if (m.fmt == Fmt::BF16) return nullptr;
  const int64_t GN = m.G * m.N;
  if (m.sub_kind == 0) return m.scales + e * m.parts() * GN;
  struct Entry {
    uint64_t id = 0;
    int64_t e = -1;
    std::vector<float> v;
  };
  thread_local Entry cache[2];
  thread_local int last = 0;
  for (int i = 0; i < 2; ++i)
    if (cache[i].id == m.id && cache[i].e == e) return cache[last = i].v.data();
  Entry& slot = cache[last ^= 1];
  slot.id = m.id;
  slot.e = e;
  slot.v.resize(m.parts() * GN);
  for (int part = 0; part < m.parts(); ++part) {
    float* o = slot.v.data() + part * GN;
    if (m.sub_kind == 3) {
      const c10::Half* h = static_cast<const c10::Half*>(m.raw_scales) + (e * m.parts() + part) * GN;
      for (int64_t i = 0; i < GN; ++i) o[i] = static_cast<float>(h[i]);
      continue;
    }
    const uint8_t* b = static_cast<const uint8_t*>(m.raw_scales) + (e * m.parts() + part) * m.rows() * m.N;
    const float* sup = reinterpret_cast<const float*>(b + GN);  // [S][N] float32 after the G byte rows (unaligned ok:
    const int64_t per = m.G / m.supers;                          // pack_kscales' rows are 4-byte multiples of N)
    for (int64_t g = 0; g < m.G; ++g) {
      const float* d = sup + (g / per) * m.N;
      for (int64_t n = 0; n < m.N; ++n)
        o[g * m.N + n] = d[n] * (m.sub_kind == 1 ? static_cast<float>(b[g * m.N + n])
                                                 : static_cast<float>(static_cast<int8_t>(b[g * m.N + n])));
    }
  }
  return slot.v.data();
}

// What the decodes read of expert e of m: its packed blocks, its float32 scales [G][N] (expert_scales; nullptr for
// bf16), its minimums [G][N] (affine; else nullptr) and the scale groups' size along K.
struct ExpertBlocks {
  const uint8_t* base;
  const float* sc;
  const float* mn;
  int64_t gsize;
};
inline ExpertBlocks expert_of(const Packed& m, int64_t e) {
  const float* sc = expert_scales(m, e);
  return {m.data + e * m.expert_bytes(), sc, m.affine ? sc + m.G * m.N : nullptr, m.K / m.G};
}

// Packed blocks [nb0, nb1) of expert e of m into out (of type T), a dense row-major [rows, K] matrix: packed row p
// lands on row dense_row(p - p_off, rows, gate_up). The whole expert: p_off = 0, rows = N (dense_row's order). A
// slice of gate/up rows [r0, r1) (multiples of 32): blocks [2 r0 / 16, 2 r1 / 16), p_off = 2 r0, rows = 2 (r1 - r0):
// the gate rows first, then the up rows (the packed 64-row groups keep their order relative to p_off).
template <typename T>
NO_FP_CONTRACT void decode_expert(const Packed& m, int64_t e, bool gate_up, T* out, int64_t nb0, int64_t nb1,
                                  int64_t p_off, int64_t rows) {
  const int64_t N = m.N, K = m.K;
  const auto [base, sc, mn, gsize] = expert_of(m, e);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    for (int64_t c = 0; c < 16; ++c) {
      const int64_t p = nb * 16 + c;
      const int64_t row = dense_row(p - p_off, rows, gate_up);
      T* dst = out + row * K;
      switch (m.fmt) {
        case Fmt::BF16: {  // [K/2][16][2]
          const uint16_t* blk = reinterpret_cast<const uint16_t*>(base) + nb * K * 16;
          for (int64_t q = 0; q < K / 2; ++q) {
            dst[2 * q] = static_cast<T>(bf16_bits_to_float(blk[(q * 16 + c) * 2]));
            dst[2 * q + 1] = static_cast<T>(bf16_bits_to_float(blk[(q * 16 + c) * 2 + 1]));
          }
          break;
        }
        case Fmt::INT8: {  // [K/4][16][4], one scale a row per group (per channel: G = 1)
          const int8_t* blk = reinterpret_cast<const int8_t*>(base) + nb * K * 16;
          for (int64_t q = 0; q < K / 4; ++q) {
            const int64_t g = 4 * q / gsize;
            const float s = sc[g * N + p], z = mn ? mn[g * N + p] : 0.f;
            for (int64_t j = 0; j < 4; ++j)
              dst[4 * q + j] = static_cast<T>(static_cast<float>(blk[(q * 16 + c) * 4 + j]) * s - z);
          }
          break;
        }
        case Fmt::INT4: {  // [K/8][16][4] bytes: low nibble value 8o + j, high nibble 8o + 4 + j, values m.nibble[u]
          const uint8_t* blk = base + nb * (K / 2) * 16;
          for (int64_t o = 0; o < K / 8; ++o) {
            const int64_t g = 8 * o / gsize;
            const float s = sc[g * N + p], z = mn ? mn[g * N + p] : 0.f;
            for (int64_t j = 0; j < 4; ++j) {
              const uint8_t b = blk[(o * 16 + c) * 4 + j];
              dst[8 * o + j] = static_cast<T>(static_cast<float>(m.nibble[b & 0xf]) * s - z);
              dst[8 * o + 4 + j] = static_cast<T>(static_cast<float>(m.nibble[b >> 4]) * s - z);
            }
          }
          break;
        }
      }
    }
  }
}

// float -> bf16 bits, rounded to nearest even (c10::BFloat16's rounding for finite values; decoded weights are finite)
inline uint16_t bf16_bits_rne(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

// decode_expert for bf16 output, the same values: the packed blocks are read in their own order (one q step of a
// block is 16 rows x `per` values, contiguous), the 16 x 64 values of a step computed in fixed-size loops the
// compiler vectorizes, then stored as 16 short row pieces. decode_expert's row-by-row walk converted one element at a
// time through c10::BFloat16 (the backward's decode was most of its time on the device estimate, docs/training.md).
// Compiled for AVX-512 (skylake-avx512), AVX2 (haswell) and the baseline, picked at load time (GCC's function
// multiversioning: the loops are plain C++, no intrinsics; the extension's baseline is SSE2).
__attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default"))) NO_FP_CONTRACT
void decode_expert_bf16(const Packed& m, int64_t e, bool gate_up, uint16_t* out, int64_t nb0, int64_t nb1,
                        int64_t p_off, int64_t rows) {
  const int64_t N = m.N, K = m.K;
  const auto [base, sc, mn, gsize] = expert_of(m, e);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const int64_t p0 = nb * 16;  // 16 packed rows land on 16 consecutive rows (gate/up blocks are 32 rows)
    const int64_t row0 = dense_row(p0 - p_off, rows, gate_up);
    uint16_t* dst = out + row0 * K;
    switch (m.fmt) {
      case Fmt::BF16: {  // [K/2][16][2]: a pure reshuffle of 4-byte pairs
        const uint32_t* blk = reinterpret_cast<const uint32_t*>(base) + nb * (K / 2) * 16;
        for (int64_t q = 0; q < K / 2; ++q)
          for (int c = 0; c < 16; ++c) std::memcpy(dst + c * K + 2 * q, blk + q * 16 + c, 4);
        break;
      }
      case Fmt::INT8: {  // [K/4][16][4], one scale a row per group (and a minimum: affine)
        const int8_t* blk = reinterpret_cast<const int8_t*>(base) + nb * K * 16;
        float s64[64] = {}, z64[64] = {};
        int64_t group = -1;
        for (int64_t q = 0; q < K / 4; ++q) {
          if (4 * q / gsize != group) {
            group = 4 * q / gsize;
            for (int i = 0; i < 64; ++i) s64[i] = sc[group * N + p0 + i / 4];
            if (mn) for (int i = 0; i < 64; ++i) z64[i] = mn[group * N + p0 + i / 4];
          }
          const int8_t* src = blk + q * 64;
          uint16_t v[64];
          for (int i = 0; i < 64; ++i) v[i] = bf16_bits_rne(static_cast<float>(src[i]) * s64[i] - z64[i]);
          for (int c = 0; c < 16; ++c) std::memcpy(dst + c * K + 4 * q, v + 4 * c, 8);
        }
        break;
      }
      case Fmt::INT4: {  // [K/8][16][4] bytes: low nibble value 8o + j, high nibble 8o + 4 + j, values m.nibble[u]
        const uint8_t* blk = base + nb * (K / 2) * 16;
        float s64[64] = {}, z64[64] = {};
        int64_t group = -1;
        for (int64_t o = 0; o < K / 8; ++o) {
          if (8 * o / gsize != group) {
            group = 8 * o / gsize;
            for (int i = 0; i < 64; ++i) s64[i] = sc[group * N + p0 + i / 4];
            if (mn) for (int i = 0; i < 64; ++i) z64[i] = mn[group * N + p0 + i / 4];
          }
          const uint8_t* src = blk + o * 64;
          uint16_t lo[64], hi[64];
          for (int i = 0; i < 64; ++i) {
            lo[i] = bf16_bits_rne(static_cast<float>(m.nibble[src[i] & 0xf]) * s64[i] - z64[i]);
            hi[i] = bf16_bits_rne(static_cast<float>(m.nibble[src[i] >> 4]) * s64[i] - z64[i]);
          }
          for (int c = 0; c < 16; ++c) {
            std::memcpy(dst + c * K + 8 * o, lo + 4 * c, 8);
            std::memcpy(dst + c * K + 8 * o + 4, hi + 4 * c, 8);
          }
        }
        break;
      }
    }
  }
}

// Expert e of m transposed: a dense row-major [K, N] matrix in out (W^T, the [N, K] matrix of decode_expert read
// by columns), column n of it dense_row's row n, the same values as decode_expert's. The backward's two transposed
// products (dY W2, [dg | du] W13) read it as a transposed view (W = (W^T)^T: the reduction dimension contiguous,
// the layout x W13^T has), which ATen's matmuls take fast where they care (docs/training.md). The write needs no
// tiling: one q step of a packed block is 16 rows x `per` values, and its transposed image is `per` pieces of 16
// consecutive columns (64 bytes in fp32, 32 in bf16) of `per` consecutive rows of W^T. The `per` x 16 values of a
// step are computed in block order (loops the compiler vectorizes) and stored as those pieces. Cvt converts a float
// to T (a plain cast; bf16 bits rounded to nearest even for bf16).
// Only W^T's rows [k0, k1) (multiples of the packed step: 2, 4 or 8) are decoded, into out [k1 - k0, N]: the
// backward decodes a slice at a time (slice_rows).
template <typename T, typename Cvt>
__attribute__((always_inline)) NO_FP_CONTRACT inline void decode_expert_t_impl(const Packed& m, int64_t e,
                                                                               bool gate_up, T* out, int64_t nb0,
                                                                               int64_t nb1, int64_t k0, int64_t k1,
                                                                               Cvt cvt) {
  const int64_t N = m.N, K = m.K;
  const auto [base, sc, mn, gsize] = expert_of(m, e);
  // a block's bytes per K index (16 rows of 2, 1 or 1/2 bytes): a slice reads (k1 - k0) * per_k of each block
  const int64_t per_k = m.fmt == Fmt::BF16 ? 32 : m.fmt == Fmt::INT8 ? 16 : 8;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    // the slice's piece of the block after next, fetched ahead: a slice reads short runs (1 KiB for 64 rows of
    // int8), too short for the hardware prefetcher to find before they end
    if (nb + 2 < nb1)
      for (int64_t b = (nb + 2) * K * per_k + k0 * per_k; b < (nb + 2) * K * per_k + k1 * per_k; b += 64)
        __builtin_prefetch(base + b);
    const int64_t p0 = nb * 16;  // 16 packed rows are 16 consecutive dense rows: 16 consecutive columns of W^T
    T* dst = out + dense_row(p0, N, gate_up) - k0 * N;  // (row k of W^T at dst + k * N, k in [k0, k1))
    // One step's values as 16 32-bit words, word c holding row c's `per` values: value j is word c's byte (or half)
    // j, taken out by shifts (what the vectorizer turns into a few whole-register ops, where indexing the bytes with
    // a stride of 4 does not vectorize well).
    uint32_t w[16];
    switch (m.fmt) {
      case Fmt::BF16: {  // [K/2][16][2]
        const uint16_t* blk = reinterpret_cast<const uint16_t*>(base) + nb * K * 16;
        for (int64_t q = k0 / 2; q < k1 / 2; ++q) {
          std::memcpy(w, blk + q * 32, sizeof(w));
          T v[2][16];
          for (int j = 0; j < 2; ++j)
            for (int c = 0; c < 16; ++c) v[j][c] = cvt(bf16_bits_to_float(static_cast<uint16_t>(w[c] >> (16 * j))));
          for (int j = 0; j < 2; ++j) std::memcpy(dst + (2 * q + j) * N, v[j], sizeof(v[j]));
        }
        break;
      }
      case Fmt::INT8: {  // [K/4][16][4], one scale a row per group (and a minimum: affine)
        const int8_t* blk = reinterpret_cast<const int8_t*>(base) + nb * K * 16;
        float s[16] = {}, z[16] = {};
        int64_t group = -1;
        for (int64_t q = k0 / 4; q < k1 / 4; ++q) {
          if (4 * q / gsize != group) {
            group = 4 * q / gsize;
            for (int c = 0; c < 16; ++c) s[c] = sc[group * N + p0 + c];
            if (mn) for (int c = 0; c < 16; ++c) z[c] = mn[group * N + p0 + c];
          }
          std::memcpy(w, blk + q * 64, sizeof(w));
          T v[4][16];
          for (int j = 0; j < 4; ++j)  // byte j sign-extended: shifted to the top, then arithmetically down
            for (int c = 0; c < 16; ++c)
              v[j][c] = cvt(static_cast<float>(static_cast<int32_t>(w[c] << (24 - 8 * j)) >> 24) * s[c] - z[c]);
          for (int j = 0; j < 4; ++j) std::memcpy(dst + (4 * q + j) * N, v[j], sizeof(v[j]));
        }
        break;
      }
      case Fmt::INT4: {  // [K/8][16][4] bytes: low nibble value 8o + j, high nibble 8o + 4 + j, values m.nibble[u]
        const uint8_t* blk = base + nb * (K / 2) * 16;
        float s[16] = {}, z[16] = {};
        int64_t group = -1;
        for (int64_t o = k0 / 8; o < k1 / 8; ++o) {
          if (8 * o / gsize != group) {
            group = 8 * o / gsize;
            for (int c = 0; c < 16; ++c) s[c] = sc[group * N + p0 + c];
            if (mn) for (int c = 0; c < 16; ++c) z[c] = mn[group * N + p0 + c];
          }
          const uint8_t* src = blk + o * 64;
          T v[8][16];
          for (int c = 0; c < 16; ++c)
            for (int j = 0; j < 4; ++j) {
              v[j][c] = cvt(static_cast<float>(m.nibble[src[4 * c + j] & 0xf]) * s[c] - z[c]);
              v[4 + j][c] = cvt(static_cast<float>(m.nibble[src[4 * c + j] >> 4]) * s[c] - z[c]);
            }
          for (int j = 0; j < 8; ++j) std::memcpy(dst + (8 * o + j) * N, v[j], sizeof(v[j]));
        }
        break;
      }
    }
  }
}

// decode_expert_t_impl for each compute dtype, compiled for AVX-512 (skylake-avx512), AVX2 (haswell) and the
// baseline, picked at load time (as decode_expert_bf16).
__attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default"))) NO_FP_CONTRACT
void decode_expert_t_bf16(const Packed& m, int64_t e, bool gate_up, uint16_t* out, int64_t nb0, int64_t nb1,
                          int64_t k0, int64_t k1) {
  decode_expert_t_impl(m, e, gate_up, out, nb0, nb1, k0, k1, [](float f) { return bf16_bits_rne(f); });
}
__attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default"))) NO_FP_CONTRACT
void decode_expert_t_float(const Packed& m, int64_t e, bool gate_up, float* out, int64_t nb0, int64_t nb1, int64_t k0,
                           int64_t k1) {
  decode_expert_t_impl(m, e, gate_up, out, nb0, nb1, k0, k1, [](float f) { return f; });
}
__attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default"))) NO_FP_CONTRACT
void decode_expert_t_double(const Packed& m, int64_t e, bool gate_up, double* out, int64_t nb0, int64_t nb1,
                            int64_t k0, int64_t k1) {
  decode_expert_t_impl(m, e, gate_up, out, nb0, nb1, k0, k1, [](float f) { return static_cast<double>(f); });
}

// W^T's rows [k0, k1) of packed blocks [nb0, nb1) of expert e into out [k1 - k0, N] (decode_expert_t_impl).
void decode_t(const Packed& m, int64_t e, bool gate_up, const at::Tensor& out, int64_t nb0, int64_t nb1, int64_t k0,
              int64_t k1) {
  switch (out.scalar_type()) {
    case at::kDouble: decode_expert_t_double(m, e, gate_up, out.data_ptr<double>(), nb0, nb1, k0, k1); break;
    case at::kFloat: decode_expert_t_float(m, e, gate_up, out.data_ptr<float>(), nb0, nb1, k0, k1); break;
    case at::kBFloat16:
      decode_expert_t_bf16(m, e, gate_up, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), nb0, nb1, k0,
                           k1);
      break;
    default: TORCH_CHECK(false, "fused_moe backward: unexpected compute dtype ", out.scalar_type());
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define TB_AVX512 1
#define TB_TARGET __attribute__((target("avx512f,avx512bw")))
#define TB_INLINE __attribute__((target("avx512f,avx512bw"), always_inline)) inline

// The two re-packing decodes below (decode_tb_avx512, decode_b_avx512) need AVX-512 F + BW.
bool has_avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512bw");
  return yes;
}

// 16 floats -> 16 bf16 bits, nearest even (bf16_bits_rne: the decoded weights are finite)
TB_INLINE __m256i bf16_rne_x16(__m512 f) {
  const __m512i x = _mm512_castps_si512(f);
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// A 16-row block's scales (and minimums: 0 without) for group g, each spread over the 16 lanes of a quarter of a
// step's 64 values [16 rows][4 k]: lane i of quarter h reads row 4 h + i / 4.
TB_INLINE void step_scales(const Packed& m, const float* sc, const float* mn, int64_t g, int64_t nb, __m512 S[4],
                           __m512 Z[4]) {
  alignas(64) static constexpr int32_t kRowOfLane[4][16] = {
      {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},     {4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7},
      {8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11}, {12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15}};
  const __m512 s16 = _mm512_loadu_ps(sc + g * m.N + nb * 16);
  const __m512 z16 = mn ? _mm512_loadu_ps(mn + g * m.N + nb * 16) : _mm512_setzero_ps();
  for (int h = 0; h < 4; ++h) {
    const __m512i idx = _mm512_load_si512(kRowOfLane[h]);
    S[h] = _mm512_permutexvar_ps(idx, s16);
    Z[h] = _mm512_permutexvar_ps(idx, z16);
  }
}

// A stored int4 step's 64 bytes [16 rows][4 j] as two steps of signed values [16 rows][4 k]: the low nibbles (k =
// 8 o + j) and the high ones (8 o + 4 + j), through the nibbles' value table (m.nibble broadcast to every lane)
TB_INLINE void nibble_steps(__m512i v, __m512i table, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  lo = _mm512_shuffle_epi8(table, _mm512_and_si512(v, low4));
  hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
}

TB_INLINE __m512i nibble_table(const Packed& m) {
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m.nibble)));
}

// decode_expert_tb_bf16 (below) for int8 and int4 weights with AVX-512 (F + BW). A 16 x 16 tile is 4 steps of 64 signed
// bytes [16 rows][4 k] (int8: as stored; int4: each stored step's low and then high nibbles, through the nibbles'
// value table: u - 8, u, or MXFP4's codes). Per half of the rows (8 rows: 4 row pairs) and step, 32 values become
// float, are scaled (minimums subtracted), rounded to bf16 (nearest even, as bf16_bits_rne: the weights are finite)
// and permuted into the 4 row pairs' pieces [4 k][2 rows]; a 4 x 4 transpose of 128-bit lanes over the 4 steps gives
// each pair's whole 64-byte row [16 k][2 rows] of block kb.
TB_TARGET NO_FP_CONTRACT
void decode_tb_avx512(const Packed& m, int64_t e, bool gate_up, uint16_t* out, int64_t kb0, int64_t kb1) {
  const int64_t N = m.N, K = m.K;
  const auto [base, sc, mn, gsize] = expert_of(m, e);
  const bool int4 = m.fmt == Fmt::INT4;
  const int64_t step_bytes = int4 ? 128 : 256;  // a block's bytes for 16 k
  // lane L = pp * 8 + j * 2 + r of a step's half (pair pp, k = 4 q + j, row 2 pp + r) reads lane (2 pp + r) * 4 + j
  alignas(64) int16_t perm[32];
  for (int L = 0; L < 32; ++L) perm[L] = static_cast<int16_t>((2 * (L / 8) + L % 2) * 4 + (L % 8) / 2);
  const __m512i pidx = _mm512_load_si512(perm);
  const __m512i table = nibble_table(m);
  for (int64_t nb = 0; nb < N / 16; ++nb) {
    const int64_t n0 = dense_row(nb * 16, N, gate_up);
    __m512 S[4], Z[4];
    int64_t group = -1;
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      if (16 * kb / gsize != group) step_scales(m, sc, mn, group = 16 * kb / gsize, nb, S, Z);
      const uint8_t* blk = base + nb * (int4 ? K * 8 : K * 16) + kb * step_bytes;
      __m512i q[4];  // step q: [16 rows][4 k = 4 q + j] signed values
      if (int4) {
        for (int o = 0; o < 2; ++o) nibble_steps(_mm512_loadu_si512(blk + 64 * o), table, q[2 * o], q[2 * o + 1]);
      } else {
        for (int i = 0; i < 4; ++i) q[i] = _mm512_loadu_si512(blk + 64 * i);
      }
      uint16_t* dst = out + (kb - kb0) * N * 16 + n0 * 16;
      for (int h = 0; h < 2; ++h) {  // rows 8 h .. 8 h + 7: pairs 4 h .. 4 h + 3
        __m512i step[4];
        for (int i = 0; i < 4; ++i) {
          const __m512i lo = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q[i], 2 * h));
          const __m512i hi = _mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(q[i], 2 * h + 1));
          const __m512 flo = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(lo), S[2 * h]), Z[2 * h]);
          const __m512 fhi = _mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(hi), S[2 * h + 1]), Z[2 * h + 1]);
          const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(bf16_rne_x16(flo)), bf16_rne_x16(fhi), 1);
          step[i] = _mm512_permutexvar_epi16(pidx, both);  // 128-bit lane pp: pair pp's piece [4 k][2 rows]
        }
        // 4 x 4 transpose of 128-bit lanes: row pp = (step 0 lane pp, step 1 lane pp, step 2 lane pp, step 3 lane pp)
        const __m512i t0 = _mm512_shuffle_i64x2(step[0], step[1], 0x44), t1 = _mm512_shuffle_i64x2(step[0], step[1], 0xee);
        const __m512i t2 = _mm512_shuffle_i64x2(step[2], step[3], 0x44), t3 = _mm512_shuffle_i64x2(step[2], step[3], 0xee);
        uint16_t* d = dst + 4 * h * 32;
        _mm512_storeu_si512(d, _mm512_shuffle_i64x2(t0, t2, 0x88));
        _mm512_storeu_si512(d + 32, _mm512_shuffle_i64x2(t0, t2, 0xdd));
        _mm512_storeu_si512(d + 64, _mm512_shuffle_i64x2(t1, t3, 0x88));
        _mm512_storeu_si512(d + 96, _mm512_shuffle_i64x2(t1, t3, 0xdd));
      }
    }
  }
}
#endif

// W^T's 16-column blocks [kb0, kb1) of expert e of m in the bf16 kernels' packed layout (kernels.h: [blocks][N/2]
// [16][2], element (kb, p, c, j) = W^T[16 kb + c][2 p + j] = W[2 p + j][16 kb + c], W's rows n in dense_row's
// order), into out: the backward's transposed products run through the packed bf16 kernels (AVX-512 BF16 or AMX
// tiles) on it, as kt.fused_moe's bf16 experts do. One stored block of 16 rows nb and 16 consecutive k (one scale
// group: int8 groups are multiples of 16, int4 of 32) is a 16 x 16 tile t[c][k]; transposed, it is 8 row pairs of
// block kb, 512 contiguous bytes.
__attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default"))) NO_FP_CONTRACT
void decode_expert_tb_bf16(const Packed& m, int64_t e, bool gate_up, uint16_t* out, int64_t kb0, int64_t kb1) {
  const int64_t N = m.N, K = m.K;
  const auto [base, sc, mn, gsize] = expert_of(m, e);
  for (int64_t nb = 0; nb < N / 16; ++nb) {
    const int64_t n0 = dense_row(nb * 16, N, gate_up);  // the block's 16 rows: dense rows n0 .. n0 + 15
    float s[16] = {}, z[16] = {};
    int64_t group = -1;
    for (int64_t kb = kb0; kb < kb1; ++kb) {
      float t[16][16];  // t[c][k]: W[n0 + c][16 kb + k], before the scale
      switch (m.fmt) {
        case Fmt::BF16: {  // [K/2][16][2]: step q2 holds k = 2 q2 + j of the 16 rows
          const uint16_t* blk = reinterpret_cast<const uint16_t*>(base) + nb * K * 16 + kb * 16 * 16;
          for (int q = 0; q < 8; ++q)
            for (int c = 0; c < 16; ++c)
              for (int j = 0; j < 2; ++j) t[c][2 * q + j] = bf16_bits_to_float(blk[q * 32 + c * 2 + j]);
          break;
        }
        case Fmt::INT8: {  // [K/4][16][4]: step q holds k = 4 q + j
          const int8_t* blk = reinterpret_cast<const int8_t*>(base) + nb * K * 16 + kb * 16 * 16;
          for (int q = 0; q < 4; ++q)
            for (int c = 0; c < 16; ++c)
              for (int j = 0; j < 4; ++j) t[c][4 * q + j] = static_cast<float>(blk[q * 64 + c * 4 + j]);
          break;
        }
        case Fmt::INT4: {  // [K/8][16][4] bytes: step o's low nibbles k = 8 o + j, high ones 8 o + 4 + j
          const uint8_t* blk = base + nb * (K / 2) * 16 + kb * 16 * 8;
          for (int o = 0; o < 2; ++o)
            for (int c = 0; c < 16; ++c)
              for (int j = 0; j < 4; ++j) {
                const uint8_t b = blk[o * 64 + c * 4 + j];
                t[c][8 * o + j] = static_cast<float>(m.nibble[b & 0xf]);
                t[c][8 * o + 4 + j] = static_cast<float>(m.nibble[b >> 4]);
              }
          break;
        }
      }
      uint16_t* dst = out + (kb - kb0) * N * 16 + n0 * 16;  // block kb's pairs n0 / 2 .. n0 / 2 + 7
      if (m.fmt == Fmt::BF16) {
        for (int p = 0; p < 8; ++p)
          for (int c = 0; c < 16; ++c)
            for (int j = 0; j < 2; ++j) dst[p * 32 + c * 2 + j] = bf16_bits_rne(t[2 * p + j][c]);
        continue;
      }
      if (16 * kb / gsize != group) {
        group = 16 * kb / gsize;
        for (int c = 0; c < 16; ++c) s[c] = sc[group * N + nb * 16 + c];
        if (mn) for (int c = 0; c < 16; ++c) z[c] = mn[group * N + nb * 16 + c];
      }
      for (int p = 0; p < 8; ++p)
        for (int c = 0; c < 16; ++c)
          for (int j = 0; j < 2; ++j)
            dst[p * 32 + c * 2 + j] = bf16_bits_rne(t[2 * p + j][c] * s[2 * p + j] - z[2 * p + j]);
    }
  }
}

#ifdef TB_AVX512
// Packed blocks [nb0, nb1) of expert e of int8/int4 m as the bf16 kernels' packed blocks of the same rows (kernels.h:
// [blocks][K/2][16][2], the stored row order) into out: the recompute x W13^T through the packed bf16 kernels. A
// stored step of 16 rows x 4 k (int8; int4: a step's low or high nibbles, through the value table) becomes two bf16
// steps of 16 rows x 2 k: converted, scaled (minimums subtracted), rounded to bf16 and interleaved in registers.
TB_TARGET NO_FP_CONTRACT
void decode_b_avx512(const Packed& m, int64_t e, uint16_t* out, int64_t nb0, int64_t nb1) {
  const int64_t K = m.K;
  const ExpertBlocks ex = expert_of(m, e);  // (a struct, not a structured binding: the lambda below captures it)
  const bool int4 = m.fmt == Fmt::INT4;
  alignas(64) int16_t lo_idx[32], hi_idx[32];  // bf16 step 2q (k 4q, 4q+1) and 2q+1 (4q+2, 4q+3): lane 2c + j
  for (int L = 0; L < 32; ++L) {               // reads row c's value j (or 2 + j) of [rows 0-7 | rows 8-15]
    const int c = L / 2, j = L % 2;
    lo_idx[L] = static_cast<int16_t>((c < 8 ? 0 : 32) + (c % 8) * 4 + j);
    hi_idx[L] = static_cast<int16_t>(lo_idx[L] + 2);
  }
  const __m512i ilo = _mm512_load_si512(lo_idx), ihi = _mm512_load_si512(hi_idx);
  const __m512i table = nibble_table(m);
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint8_t* blk = ex.base + nb * (int4 ? K * 8 : K * 16);
    uint16_t* dst = out + (nb - nb0) * K * 16;
    __m512 S[4], Z[4];
    int64_t group = -1;
    // one 4-k step of 16 rows (64 signed values [row][4 k]) to bf16 steps 2 q4 and 2 q4 + 1
    auto emit = [&](__m512i v, int64_t q4) {
      if (4 * q4 / ex.gsize != group) step_scales(m, ex.sc, ex.mn, group = 4 * q4 / ex.gsize, nb, S, Z);
      __m256i b[4];
      for (int i = 0; i < 4; ++i) {
        const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(v, i)));
        b[i] = bf16_rne_x16(_mm512_sub_ps(_mm512_mul_ps(f, S[i]), Z[i]));
      }
      const __m512i r07 = _mm512_inserti64x4(_mm512_castsi256_si512(b[0]), b[1], 1);
      const __m512i r815 = _mm512_inserti64x4(_mm512_castsi256_si512(b[2]), b[3], 1);
      _mm512_storeu_si512(dst + (2 * q4) * 32, _mm512_permutex2var_epi16(r07, ilo, r815));
      _mm512_storeu_si512(dst + (2 * q4 + 1) * 32, _mm512_permutex2var_epi16(r07, ihi, r815));
    };
    if (int4) {
      for (int64_t o = 0; o < K / 8; ++o) {
        __m512i lo, hi;
        nibble_steps(_mm512_loadu_si512(blk + 64 * o), table, lo, hi);
        emit(lo, 2 * o);
        emit(hi, 2 * o + 1);
      }
    } else {
      for (int64_t q = 0; q < K / 4; ++q) emit(_mm512_loadu_si512(blk + 64 * q), q);
    }
  }
}
#endif

// Packed blocks [nb0, nb1) of expert e into out [rows, K] as stored, packed row p on row dense_row(p - p_off, rows)
// (decode_expert).
void decode_w(const Packed& m, int64_t e, bool gate_up, const at::Tensor& out, int64_t nb0, int64_t nb1, int64_t p_off,
              int64_t rows) {
  switch (out.scalar_type()) {
    case at::kDouble: decode_expert(m, e, gate_up, out.data_ptr<double>(), nb0, nb1, p_off, rows); break;
    case at::kFloat: decode_expert(m, e, gate_up, out.data_ptr<float>(), nb0, nb1, p_off, rows); break;
    case at::kBFloat16:
      decode_expert_bf16(m, e, gate_up, reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), nb0, nb1, p_off,
                         rows);
      break;
    default: TORCH_CHECK(false, "fused_moe backward: unexpected compute dtype ", out.scalar_type());
  }
}

// Decodes packed blocks [nb0, nb1) of expert e into out, the whole [N, K] (all blocks when nb1 < 0).
void decode_into(const Packed& m, int64_t e, bool gate_up, at::Tensor& out, int64_t nb0 = 0, int64_t nb1 = -1) {
  decode_w(m, e, gate_up, out, nb0, nb1 < 0 ? m.N / 16 : nb1, 0, m.N);
}

using Act = ActivationKind;

// a(x) of the single-input activations (the gated ones' act(gate), gateless experts' act(up))
at::Tensor act_forward(Act a, const at::Tensor& x) {
  switch (a) {
    case Act::SiLU: return at::silu(x);
    case Act::GeluTanh: return at::gelu(x, "tanh");
    case Act::Gelu: return at::gelu(x, "none");
    case Act::Relu: return at::relu(x);
    case Act::Relu2: return at::relu(x).square();
    default: TORCH_CHECK(false, "fused_moe backward: ", static_cast<int>(a), " is not a single-input activation");
  }
}

// grad * a'(x)
at::Tensor act_backward(Act a, const at::Tensor& grad, const at::Tensor& x) {
  switch (a) {
    case Act::SiLU: return at::silu_backward(grad, x);
    case Act::GeluTanh: return at::gelu_backward(grad, x, "tanh");
    case Act::Gelu: return at::gelu_backward(grad, x, "none");
    case Act::Relu: return at::threshold_backward(grad, x, 0);
    case Act::Relu2: return grad * at::relu(x) * 2;
    default: TORCH_CHECK(false, "fused_moe backward: ", static_cast<int>(a), " is not a single-input activation");
  }
}

// 1 where torch.clamp lets the gradient through (lo <= x <= hi, bounds included; NaN: 0), else 0, in x's dtype
at::Tensor clamp_pass(const at::Tensor& x, double lo, double hi) { return x.ge(lo).logical_and_(x.le(hi)).to(x.scalar_type()); }

// Everything a call needs, checked.
struct Call {
  const char* op;
  at::Tensor hidden, ids, weights;  // hidden [T, H]; ids int64 [T, K]; weights [T, K] in the element dtype
  Packed up, down;
  int64_t T, H, K, I, N13, E;  // N13: w13's rows, 2I (gated) or I (gateless: h = act(up))
  bool gated;
  ActivationSpec act;
  at::Tensor b13, b2;  // the experts' biases in the element dtype, [E, N13] and [E, H], or undefined
  at::ScalarType ct, et;  // compute (matmul) dtype, element-wise dtype
  std::vector<int64_t> order, start;  // pairs (t * K + k) grouped by expert: order[start[e] .. start[e + 1])
  std::vector<int64_t> experts;       // experts with pairs, most pairs first
};

Call make_call(const char* op, const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
               const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
               const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
               const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias) {
  TORCH_CHECK(hidden.device().is_cpu() && topk_ids.device().is_cpu() && topk_weights.device().is_cpu(), op,
              ": hidden, topk_ids and topk_weights must be CPU tensors, got ", hidden.device(), ", ", topk_ids.device(),
              ", ", topk_weights.device());
  const auto hd = hidden.scalar_type();
  TORCH_CHECK(hd == at::kBFloat16 || hd == at::kHalf || hd == at::kFloat || hd == at::kDouble, op,
              ": hidden must be bfloat16, float16, float32 or float64, got ", hd);
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be [T, H], got shape ", hidden.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong, op,
              ": topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == hidden.size(0), op, ": topk_ids must be [T=", hidden.size(0),
              ", K], got shape ", topk_ids.sizes());
  TORCH_CHECK(topk_weights.is_floating_point() && topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_weights must be a float tensor shaped like topk_ids ", topk_ids.sizes(), ", got ",
              topk_weights.scalar_type(), " ", topk_weights.sizes());
  Call c{op};
  c.up = describe_packed(op, w13, w13_scales, "w13", "w13_scales");
  c.down = describe_packed(op, w2, w2_scales, "w2", "w2_scales");
  c.T = hidden.size(0);
  c.H = hidden.size(1);
  c.K = topk_ids.size(1);
  c.E = c.up.E;
  // as kt::fused_moe: gated experts' w13 is [E, 2I, H] packed with gate_up=True; gateless ones' [E, I, H] (up only)
  c.gated = c.up.N != c.down.K;
  c.I = c.gated ? c.up.N / 2 : c.up.N;
  c.N13 = c.up.N;
  TORCH_CHECK(c.down.E == c.E, op, ": w13 has ", c.E, " experts but w2 has ", c.down.E);
  TORCH_CHECK(!c.gated || c.up.N % 64 == 0, op, ": w13 must be packed with gate_up=True (2I a multiple of 64), got N=",
              c.up.N);
  TORCH_CHECK(c.up.K == c.H && c.down.N == c.H, op, ": hidden size mismatch: hidden has H=", c.H, ", w13 expects K=",
              c.up.K, ", w2 produces N=", c.down.N);
  TORCH_CHECK(c.down.K == c.I, op, ": intermediate size mismatch: w13 gives I=", c.I,
              " (N/2; gateless experts: N), w2 expects K=", c.down.K);
  c.act = parse_activation(activation);
  TORCH_CHECK(c.gated || c.act.kind <= Act::Relu2, op, ": activation '", std::string(activation),
              "' needs a gate, but w13 holds only up projections (N=", c.up.N, " equals w2's K: gateless experts)");
  c.ct = hd == at::kDouble ? at::kDouble : hd == at::kFloat ? at::kFloat : at::kBFloat16;
  c.et = hd == at::kDouble ? at::kDouble : at::kFloat;
  auto bias_of = [&](const std::optional<at::Tensor>& b, const char* name, int64_t n) -> at::Tensor {
    if (!b.has_value()) return at::Tensor();
    TORCH_CHECK(b->device().is_cpu() && b->scalar_type() == at::kFloat && b->is_contiguous() && b->dim() == 2 &&
                    b->size(0) == c.E && b->size(1) == n,
                op, ": ", name, " must be a contiguous float32 CPU tensor [E=", c.E, ", ", n, "], got ",
                b->scalar_type(), " ", b->sizes(), " on ", b->device());
    return b->to(c.et);
  };
  c.b13 = bias_of(w13_bias, c.gated ? "w13_bias (gate biases, then up biases)" : "w13_bias (up biases)", c.N13);
  c.b2 = bias_of(w2_bias, "w2_bias", c.H);
  c.hidden = hidden;
  c.ids = topk_ids.to(at::kLong).contiguous();
  c.weights = topk_weights.to(c.et).contiguous();
  // group the pairs by expert, stable in (token, slot) order
  const int64_t* id = c.ids.data_ptr<int64_t>();
  const int64_t P = c.T * c.K;
  std::vector<int64_t> count(c.E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] < c.E, op, ": topk_ids[", p / std::max<int64_t>(c.K, 1), ", ", p % std::max<int64_t>(c.K, 1),
                "] = ", id[p], " is out of range for ", c.E, " experts");
    if (id[p] >= 0) ++count[id[p] + 1];
  }
  c.start.assign(c.E + 1, 0);
  for (int64_t e = 0; e < c.E; ++e) c.start[e + 1] = c.start[e] + count[e + 1];
  c.order.resize(c.start[c.E]);
  std::vector<int64_t> fill(c.start.begin(), c.start.end() - 1);
  for (int64_t p = 0; p < P; ++p)
    if (id[p] >= 0) c.order[fill[id[p]]++] = p;
  for (int64_t e = 0; e < c.E; ++e)
    if (c.start[e + 1] > c.start[e]) c.experts.push_back(e);
  std::stable_sort(c.experts.begin(), c.experts.end(), [&](int64_t a, int64_t b) {
    return c.start[a + 1] - c.start[a] > c.start[b + 1] - c.start[b];
  });
  return c;
}

// h [n, I] from a group's pre-activations gu [n, N13] (biases and deltas added), as kt::fused_moe's epilogue
// computes it (fused_moe.cpp, Epilogue::glu1; clamps as torch.clamp).
at::Tensor glu_forward(const Call& c, const at::Tensor& gu) {
  const ActivationSpec& a = c.act;
  if (!c.gated) return act_forward(a.kind, gu);
  const at::Tensor g = gu.narrow(1, 0, c.I), u = gu.narrow(1, c.I, c.I);
  switch (a.kind) {
    case Act::SwigluOai: {  // (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit
      const at::Tensor gc = at::clamp_max(g, a.limit);
      return (at::clamp(u, -a.limit, a.limit) + 1) * gc * at::sigmoid(gc * a.alpha);
    }
    case Act::SiluClamped: return at::silu(at::clamp_max(g, a.limit)) * at::clamp(u, -a.limit, a.limit);
    case Act::SoftcapSwiglu:  // gate_cap tanh(gate / gate_cap) * sigmoid(gate) * up_cap tanh(up / up_cap)
      return at::tanh(g / a.gate_cap) * at::sigmoid(g) * at::tanh(u / a.up_cap) * (a.gate_cap * a.up_cap);
    default: return act_forward(a.kind, g) * u;
  }
}

// d gu [n, N13] (gate columns, then up columns; gateless: up's) from dh = d h [n, I], gu as glu_forward took it.
at::Tensor glu_backward(const Call& c, const at::Tensor& gu, const at::Tensor& dh) {
  const ActivationSpec& a = c.act;
  if (!c.gated) return act_backward(a.kind, dh, gu);
  const at::Tensor g = gu.narrow(1, 0, c.I), u = gu.narrow(1, c.I, c.I);
  at::Tensor dg, du;
  switch (a.kind) {
    case Act::SwigluOai: {  // h = (uc + 1) gc s, s = sigmoid(alpha gc): dh/dgc = (uc + 1)(s + alpha gc s (1 - s))
      const at::Tensor gc = at::clamp_max(g, a.limit), uc = at::clamp(u, -a.limit, a.limit);
      const at::Tensor s = at::sigmoid(gc * a.alpha);
      dg = dh * (uc + 1) * (s + gc * s * (1 - s) * a.alpha) * clamp_pass(g, -INFINITY, a.limit);
      du = dh * gc * s * clamp_pass(u, -a.limit, a.limit);
      break;
    }
    case Act::SiluClamped: {
      const at::Tensor gc = at::clamp_max(g, a.limit), uc = at::clamp(u, -a.limit, a.limit);
      dg = at::silu_backward(dh * uc, gc) * clamp_pass(g, -INFINITY, a.limit);
      du = dh * at::silu(gc) * clamp_pass(u, -a.limit, a.limit);
      break;
    }
    case Act::SoftcapSwiglu: {  // h = A(g) S(g) B(u): A = cg tanh(g / cg), A' = 1 - tanh^2, S' = S (1 - S)
      const at::Tensor tg = at::tanh(g / a.gate_cap), tu = at::tanh(u / a.up_cap), s = at::sigmoid(g);
      const at::Tensor B = tu * a.up_cap, A = tg * a.gate_cap;
      dg = dh * B * ((1 - tg * tg) * s + A * s * (1 - s));
      du = dh * A * s * (1 - tu * tu);
      break;
    }
    default:
      dg = act_backward(a.kind, dh * u, g);
      du = dh * act_forward(a.kind, g);
  }
  return at::cat({dg, du}, 1);
}

// KT_PROFILE=1 (profile.h, as kt.fused_moe's line): one line a call on stderr with its phases (setup, experts, sum)
// and the experts phase broken down per worker, summed over its experts: decode (packed blocks to dense matrices),
// products (the matmuls), elementwise (GLU, its backward, d weights), copies (gathering rows, casts, scattering the
// pairs' rows), each the mean over workers in ms, and the busiest worker's total.
struct ExpertTimes : WorkerTimes<4> {
  using WorkerTimes<4>::WorkerTimes;
  enum Kind { kDecode = 0, kProducts = 1, kElementwise = 2, kCopies = 3 };
  void report(PhaseTimer& timer) const {
    WorkerTimes<4>::report(timer, {"experts.decode", "experts.products", "experts.elementwise", "experts.copies"},
                           "experts.busiest");
  }
};

// The busiest expert's rows x H x N13 (one product's multiply-adds) below which fewer experts than threads still run
// one a worker (single-threaded products inside the parallel region) rather than one at a time with multi-threaded
// ATen ops: MKL forks all its threads for a product of any size outside a parallel region. A [5, 32] x [32, 64]
// float64 product took 509 us on 16 threads against 7.5 us on one (2-core host, oversubscribed 8x), and the float64
// gradcheck tests (E = 4, H = I = 32, a few hundred calls of 5 tokens) ran past a minute on the device's 16 cores
// under 12 test processes. 2^20: about 0.1-0.5 ms on one core, where the fork pays.
constexpr int64_t kMinThreadedMacs = int64_t(1) << 20;

// One task of for_each_expert: the pairs [r0, r1) of expert e's run in c.order (offsets into pair_rows(c, e)).
struct Task {
  int64_t e, r0, r1;
};

// The fewest rows the multi-worker backward cuts an expert's pairs into (a piece re-decodes the expert's weights:
// at T = 2048 on the device the decode of an expert cost about as much as the products of ~90 of its rows).
constexpr int64_t kMinTaskRows = 128;

// c's experts as tasks, most rows first. With `split` (the backward's products, which decode a slice at a time), an
// expert with more pairs than half a worker's fair share (all pairs / threads, at least kMinTaskRows) is cut into
// near-equal pieces under that size, so that one busy expert does not keep the other workers waiting. Routing is
// rarely uniform: past its first layer a random 4-layer Qwen3-30B-A3B at T = 2048 sent 1300-1965 of the 2048 tokens
// to each of its five busiest experts, up to twice a worker's share of the 16,384 pairs on 16 cores (1024).
std::vector<Task> expert_tasks(const Call& c, bool split) {
  std::vector<Task> tasks;
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t total = static_cast<int64_t>(c.order.size());
  const int64_t most = split ? std::max(kMinTaskRows, (total + 2 * threads - 1) / (2 * threads))
                             : std::numeric_limits<int64_t>::max();
  for (int64_t e : c.experts) {
    const int64_t rows = c.start[e + 1] - c.start[e];
    const int64_t pieces = (rows - 1) / most + 1;  // (rows >= 1; no overflow at most = max)
    const int64_t piece = ((rows + pieces - 1) / pieces + 15) / 16 * 16;
    for (int64_t r0 = 0; r0 < rows; r0 += piece) tasks.push_back({e, r0, std::min(rows, r0 + piece)});
  }
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.r1 - a.r0 > b.r1 - b.r0; });
  return tasks;
}

// How many workers for_each_expert runs c's tasks on: none without experts; one (the calling thread, its ATen ops
// multi-threaded) when the tasks are fewer than the ATen threads and the busiest expert's products are big enough
// (kMinThreadedMacs) or there is one expert; else one a thread, at most one a task.
int expert_workers(const Call& c, int64_t tasks) {
  const int64_t n = static_cast<int64_t>(c.experts.size());
  const int threads = at::get_num_threads();
  if (n == 0) return 0;
  if (tasks >= threads) return threads;
  const int64_t rows = c.start[c.experts[0] + 1] - c.start[c.experts[0]];  // most pairs first
  if (n == 1 || rows * c.H * c.N13 >= kMinThreadedMacs) return 1;
  return static_cast<int>(tasks);
}

// The bytes of one decoded slice (the backward's products, slice_rows): with the products' activations (a
// [rows, N] matrix of an expert's tokens, 0.5 MiB for 128 tokens at H = 2048 in bf16) and oneDNN's blocked copy of the
// slice, well inside a core's L2 (2 MiB on the device's Xeon), so that decoded weights are written and read there and
// never go through memory: the whole expert decoded first (W2^T and W13^T: 9.4 MiB for Qwen3-30B-A3B in bf16) made
// each decoded weight go out to memory and back, ~3 GB a layer on 16 cores (docs/training.md).
constexpr int64_t kSliceBytes = int64_t(256) << 10;

// Rows of a slice of a matrix of `count` rows of `width` elements of `bytes` each: kSliceBytes' worth, a multiple of
// 32 (the packed steps, int4 groups of 32 and 64-row gate/up groups divide it; at least 32), at most `count`.
int64_t slice_rows(int64_t count, int64_t width, int64_t bytes) {
  return std::min(count, std::max<int64_t>(32, kSliceBytes / (width * bytes) / 32 * 32));
}

// The dense matrices of one expert a worker holds (Layouts: w13 [N13, H] and w2 [H, I] as stored, what the float
// reference's x W13^T and h W2^T read through .t()), and the backward's decode buffer `slice`: a slice of one matrix
// at a time (kSliceBytes, each worker its own), or where one expert at a time runs over several threads (`whole`)
// room for a whole matrix, decoded over the threads at once and multiplied by one multi-threaded product.
struct Dense {
  at::Tensor w13, w2, slice;
  bool whole = false;
  // bf16 products through ktorch's packed bf16 kernels (product_t), at the avx512 and amx levels; nullptr: ATen's
  const kernels::KernelSet* kernels = nullptr;
};
struct Layouts {
  bool w13, w2, slices;
};

// Runs fn(task, dense, worker) for every task (expert_tasks: each expert with pairs, or pieces of its pairs), each
// task's expert decoded into its worker's scratch (the layouts `need` asks for; the slices are the backward's to
// decode). As many tasks as threads or more: the tasks are pulled by the ATen workers (most rows first), each single
// threaded inside. Fewer (e.g. Mixtral's 8 experts on 16 cores, or a few tokens): one whole expert at a time on the
// calling thread, its decode split over the workers by blocks and its ATen ops multi-threaded, so that no core idles
// for want of an expert (worker 0 in the profile).
template <typename Fn>
void for_each_expert(const Call& c, const std::vector<Task>& tasks, ExpertTimes& times, Layouts need, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int threads = expert_workers(c, n);
  if (threads == 0) return;
  const auto opts = at::TensorOptions().dtype(c.ct);
  auto scratch = [&]() {
    Dense d;
    if (need.w13) d.w13 = at::empty({c.N13, c.H}, opts);
    if (need.w2) d.w2 = at::empty({c.H, c.I}, opts);
    if (need.slices) {
      d.whole = threads == 1 && at::get_num_threads() > 1;  // (on one thread, slices as each worker's)
      const kernels::KernelSet& ks = runtime::select_kernels();
      // (levels with bf16 dot products: avx512 and amx; at portable and avx2 ATen's matmuls)
      if (c.ct == at::kBFloat16 && std::strcmp(ks.name, "portable") != 0 && std::strcmp(ks.name, "avx2") != 0)
        d.kernels = &ks;
      const int64_t es = static_cast<int64_t>(c10::elementSize(c.ct));
      const int64_t halves = c.gated ? 2 : 1;  // x W13^T's slices: gate rows and their up rows
      d.slice = at::empty({d.whole ? std::max(c.N13, c.I) * c.H
                                   : std::max({slice_rows(c.I, c.H, es) * c.H, slice_rows(c.H, c.N13, es) * c.N13,
                                               halves * slice_rows(c.N13 / halves, halves * c.H, es) * c.H})},
                          opts);
    }
    return d;
  };
  // decodes blocks [b0, b1) (of w13's, of w2's) of expert e into d (b1 < 0: all)
  auto decode = [&](int64_t e, Dense& d, bool of_w13, int64_t b0, int64_t b1) {
    if (of_w13) {
      if (need.w13) decode_into(c.up, e, c.gated, d.w13, b0, b1);
    } else {
      if (need.w2) decode_into(c.down, e, false, d.w2, b0, b1);
    }
  };
  if (threads == 1) {  // one at a time, the decode split by blocks and the ATen ops over the threads
    Dense d = scratch();
    for (int64_t e : c.experts) {
      auto mark = times.start();
      if (need.w13)
        at::parallel_for(0, c.up.N / 16, 4, [&](int64_t b0, int64_t b1) { decode(e, d, true, b0, b1); });
      if (need.w2)
        at::parallel_for(0, c.down.N / 16, 4, [&](int64_t b0, int64_t b1) { decode(e, d, false, b0, b1); });
      times.lap(0, ExpertTimes::kDecode, mark);
      fn(Task{e, 0, c.start[e + 1] - c.start[e]}, static_cast<const Dense&>(d), 0);
    }
    return;
  }
  std::atomic<int64_t> next{0};
  std::vector<std::string> errors(threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t end) {
    const c10::AutoGradMode no_grad(false);
    for (int64_t slot = b; slot < end; ++slot) {
      try {
        Dense d = scratch();
        for (int64_t i = next++; i < n; i = next++) {
          const Task& t = tasks[i];
          auto mark = times.start();
          decode(t.e, d, true, 0, -1);
          decode(t.e, d, false, 0, -1);
          times.lap(static_cast<int>(slot), ExpertTimes::kDecode, mark);
          fn(t, static_cast<const Dense&>(d), static_cast<int>(slot));
        }
      } catch (const std::exception& ex) {
        errors[slot] = ex.what();
        next = n;
      }
    }
  });
  for (const auto& err : errors) TORCH_CHECK(err.empty(), c.op, ": ", err);
}

// out [T, H] in `dtype`: out[t] = the sum of pair t * K + k's row of d hidden over the routed slots k (ids >= 0),
// added in slot order (zeros for a token with none) in the element dtype A, then rounded once. The rows are
// `grouped` [pairs, H] of the compute dtype S, in c.order's order (each expert's product writes its rows in place):
// pair p's row is the one at its position in c.order. Tokens split over the ATen workers: the same result for any
// count.
template <typename S, typename A>
void sum_slots_as(const Call& c, const S* src, A* dst) {
  const int64_t* id = c.ids.data_ptr<int64_t>();
  std::vector<int64_t> pos(c.T * c.K, -1);
  for (int64_t i = 0; i < static_cast<int64_t>(c.order.size()); ++i) pos[c.order[i]] = i;
  const int64_t H = c.H, K = c.K;
  at::parallel_for(0, c.T, std::max<int64_t>(1, 32768 / std::max<int64_t>(H, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      A* o = dst + t * H;
      bool first = true;
      for (int64_t k = 0; k < K; ++k) {
        if (id[t * K + k] < 0) continue;
        const S* r = src + pos[t * K + k] * H;
        if (first) for (int64_t j = 0; j < H; ++j) o[j] = static_cast<A>(r[j]);
        else for (int64_t j = 0; j < H; ++j) o[j] += static_cast<A>(r[j]);
        first = false;
      }
      if (first) std::fill(o, o + H, A(0));
    }
  });
}

at::Tensor sum_slots(const Call& c, const at::Tensor& grouped, at::ScalarType dtype) {
  at::Tensor acc = at::empty({c.T, c.H}, at::TensorOptions().dtype(c.et));
  if (c.et == at::kDouble) {
    sum_slots_as(c, grouped.data_ptr<double>(), acc.data_ptr<double>());
  } else if (grouped.scalar_type() == at::kFloat) {
    sum_slots_as(c, grouped.data_ptr<float>(), acc.data_ptr<float>());
  } else {
    TORCH_CHECK(grouped.scalar_type() == at::kBFloat16 && c.et == at::kFloat, c.op, ": unexpected dtypes ",
                grouped.scalar_type(), ", ", c.et);
    sum_slots_as(c, grouped.data_ptr<at::BFloat16>(), acc.data_ptr<float>());
  }
  return acc.to(dtype);
}

// Zeros the rows of skipped slots (ids < 0) of a [T * K, n] pair buffer (the routed rows are all written).
void zero_skipped_rows(const Call& c, at::Tensor& pairs) {
  const int64_t* id = c.ids.data_ptr<int64_t>();
  const int64_t row = pairs.size(1) * static_cast<int64_t>(pairs.element_size());
  char* base = static_cast<char*>(pairs.data_ptr());
  for (int64_t p = 0; p < c.T * c.K; ++p)
    if (id[p] < 0) std::memset(base + p * row, 0, row);
}

at::Tensor pair_rows(const Call& c, int64_t e) {
  return at::from_blob(const_cast<int64_t*>(c.order.data()) + c.start[e], {c.start[e + 1] - c.start[e]}, at::kLong);
}

// d [T, K, N13] (deltas or pre-activations) as [T * K, N13], checked
at::Tensor checked_delta(const Call& c, const at::Tensor& d, const char* name) {
  TORCH_CHECK(d.device().is_cpu() && d.is_floating_point() && d.dim() == 3 && d.size(0) == c.T && d.size(1) == c.K &&
                  d.size(2) == c.N13,
              c.op, ": ", name, " must be a float CPU tensor [T=", c.T, ", K=", c.K, ", ", c.gated ? "2I=" : "I=", c.N13,
              "], got ", d.scalar_type(), " ", d.sizes(), " on ", d.device());
  return d.reshape({c.T * c.K, c.N13});
}

// A group's pre-activations [n, N13] in the element dtype: x W13^T + the expert's gate/up bias + the pairs' deltas.
at::Tensor pre_activations(const Call& c, int64_t e, const at::Tensor& x, const at::Tensor& W13,
                           const at::Tensor& delta, const at::Tensor& rows) {
  at::Tensor gu = at::mm(x, W13.t()).to(c.et);
  if (c.b13.defined()) gu.add_(c.b13.select(0, e));
  if (delta.defined()) gu.add_(delta.index_select(0, rows).to(c.et));
  return gu;
}

using Mark = std::chrono::steady_clock::time_point;

// c [M, 16 nblocks] (fp32, ldc floats a row) = a W^T through d.kernels' packed bf16 gemm: a's M bf16 rows of K (rows
// contiguous), W the nblocks packed bf16 blocks of K at b (kernels.h's bf16 layout). product_t and product_up.
void packed_bf16_product(const Dense& d, const at::Tensor& a, const uint8_t* b, int nblocks, float* c, int64_t ldc) {
  thread_local std::vector<const void*> rows;
  const int M = static_cast<int>(a.size(0));
  rows.resize(M);
  const auto* a0 = reinterpret_cast<const uint16_t*>(a.data_ptr<at::BFloat16>());
  for (int i = 0; i < M; ++i) rows[i] = a0 + i * a.stride(0);
  kernels::GemmArgs g;
  g.M = M;
  g.K = a.size(1);
  g.a_rows = rows.data();
  g.b = b;
  g.b_block_stride = kernels::block_bytes(kernels::WeightFormat::BF16, g.K);
  g.nblocks = nblocks;
  g.c = c;
  g.ldc = ldc;
  d.kernels->gemm[static_cast<int>(kernels::WeightFormat::BF16)](g);
}

// This thread's fp32 buffer of at least n floats (the packed products' results before they are placed)
float* thread_floats(int64_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(n)) buf.resize(n);
  return buf.data();
}

// out [n, K] = a [n, N] W (W = expert e of m as the dense [N, K] matrix, rows in dense_row's order): the backward's
// transposed products dY W2 and [dg | du] W13. W^T's rows are decoded slice_rows at a time into d.slice and each
// slice multiplied at once, read as the view (W^T)^T (the reduction dimension contiguous in both operands), its
// columns of out written; with d.whole, W^T at once, decoded over the threads, and one multi-threaded product. out:
// rows contiguous, any float dtype (the product's rows rounded to a's dtype first, as a whole product's are).
void product_t(const Packed& m, int64_t e, bool gate_up, const at::Tensor& a, const at::Tensor& out, const Dense& d,
               ExpertTimes& times, int worker, Mark& mark) {
  const int64_t N = m.N, K = m.K;
  if (d.kernels != nullptr && a.scalar_type() == at::kBFloat16 && N % 32 == 0 && !d.whole) {
    // bf16 operands: the packed bf16 kernels on W^T's blocks decoded into their layout, fp32 results written into
    // out (fp32: in place; otherwise through this thread's buffer, rounded once)
    const int64_t rows = slice_rows(K, N, 2);  // a multiple of 32: whole 16-column blocks
    const int64_t M = a.size(0);
    const bool in_place = out.scalar_type() == at::kFloat && out.stride(1) == 1;
    uint16_t* slice = reinterpret_cast<uint16_t*>(d.slice.data_ptr<at::BFloat16>());
    for (int64_t k0 = 0; k0 < K; k0 += rows) {
      const int64_t k1 = std::min(K, k0 + rows), w = k1 - k0;
#ifdef TB_AVX512
      if (m.fmt != Fmt::BF16 && has_avx512bw()) decode_tb_avx512(m, e, gate_up, slice, k0 / 16, k1 / 16);
      else
#endif
        decode_expert_tb_bf16(m, e, gate_up, slice, k0 / 16, k1 / 16);
      times.lap(worker, ExpertTimes::kDecode, mark);
      const uint8_t* b = reinterpret_cast<const uint8_t*>(slice);
      if (in_place) {
        packed_bf16_product(d, a, b, static_cast<int>(w / 16), out.data_ptr<float>() + k0, out.stride(0));
      } else {
        float* cbuf = thread_floats(M * w);
        packed_bf16_product(d, a, b, static_cast<int>(w / 16), cbuf, w);
        out.narrow(1, k0, w).copy_(at::from_blob(cbuf, {M, w}, at::kFloat));
      }
      times.lap(worker, ExpertTimes::kProducts, mark);
    }
    return;
  }
  const int64_t rows = d.whole ? K : slice_rows(K, N, static_cast<int64_t>(d.slice.element_size()));
  for (int64_t k0 = 0; k0 < K; k0 += rows) {
    const int64_t k1 = std::min(K, k0 + rows);
    const at::Tensor wt = d.slice.narrow(0, 0, (k1 - k0) * N).view({k1 - k0, N});
    auto dec = [&](int64_t b0, int64_t b1) { decode_t(m, e, gate_up, wt, b0, b1, k0, k1); };
    if (d.whole) at::parallel_for(0, N / 16, 4, dec);
    else dec(0, N / 16);
    times.lap(worker, ExpertTimes::kDecode, mark);
    at::Tensor o = out.narrow(1, k0, k1 - k0);
    if (k1 - k0 == K && out.scalar_type() == a.scalar_type()) at::mm_out(o, a, wt.t());
    else o.copy_(at::mm(a, wt.t()));
    times.lap(worker, ExpertTimes::kProducts, mark);
  }
}

// out [n, N13] (the element dtype) = x [n, H] W13_e^T, the recompute of the pre-activations (before biases and
// deltas): W13's rows decoded as stored a slice at a time, gated experts' as gate rows [r0, r1) with the same up rows
// (the packed blocks [2 r0 / 16, 2 r1 / 16)), each slice's product written to both halves of out; d.whole: at once.
void product_up(const Call& c, int64_t e, const at::Tensor& x, const at::Tensor& out, const Dense& d,
                ExpertTimes& times, int worker, Mark& mark) {
  const int64_t halves = c.gated ? 2 : 1, half = c.N13 / halves;
#ifdef TB_AVX512
  if (d.kernels != nullptr && x.scalar_type() == at::kBFloat16 && c.H % 32 == 0 && !d.whole &&
      (c.up.fmt == Fmt::BF16 || has_avx512bw())) {
    // the packed bf16 kernels on W13's blocks (bf16 weights: as stored; int8/int4: decoded into that layout a slice
    // of packed rows at a time), fp32 out in the packed rows' order: 32 gate rows, then their 32 up rows
    const int64_t rows = slice_rows(half, halves * c.H, 2);
    const int64_t M = x.size(0);
    uint16_t* slice = reinterpret_cast<uint16_t*>(d.slice.data_ptr<at::BFloat16>());
    const size_t block = kernels::block_bytes(kernels::WeightFormat::BF16, c.H);
    float* o = out.data_ptr<float>();  // [n, N13] contiguous fp32 (the element dtype)
    const int64_t ldo = out.stride(0);
    for (int64_t r0 = 0; r0 < half; r0 += rows) {
      const int64_t r1 = std::min(half, r0 + rows), w = halves * (r1 - r0);
      const int64_t nb0 = halves * r0 / 16, nb1 = halves * r1 / 16;
      const uint8_t* b = c.up.data + e * c.up.expert_bytes() + nb0 * block;  // bf16 weights: as stored
      if (c.up.fmt != Fmt::BF16) {
        decode_b_avx512(c.up, e, slice, nb0, nb1);
        b = reinterpret_cast<const uint8_t*>(slice);
      }
      times.lap(worker, ExpertTimes::kDecode, mark);
      float* cbuf = thread_floats(M * w);
      packed_bf16_product(d, x, b, static_cast<int>(nb1 - nb0), cbuf, w);
      for (int64_t i = 0; i < M; ++i) {  // packed column p -> dense column dense_row(halves * r0 + p)
        const float* src = cbuf + i * w;
        float* dst = o + i * ldo;
        if (!c.gated) {
          std::memcpy(dst + r0, src, w * sizeof(float));
          continue;
        }
        for (int64_t p = 0; p < w; p += 32)
          std::memcpy(dst + dense_row(2 * r0 + p, c.N13, true), src + p, 32 * sizeof(float));
      }
      times.lap(worker, ExpertTimes::kProducts, mark);
    }
    return;
  }
#endif
  const int64_t rows = d.whole ? half : slice_rows(half, halves * c.H, static_cast<int64_t>(d.slice.element_size()));
  for (int64_t r0 = 0; r0 < half; r0 += rows) {
    const int64_t r1 = std::min(half, r0 + rows), n = r1 - r0;
    const at::Tensor w = d.slice.narrow(0, 0, halves * n * c.H).view({halves * n, c.H});
    const int64_t nb0 = halves * r0 / 16, nb1 = halves * r1 / 16;
    auto dec = [&](int64_t b0, int64_t b1) { decode_w(c.up, e, c.gated, w, b0, b1, halves * r0, halves * n); };
    if (d.whole) at::parallel_for(nb0, nb1, 4, dec);
    else dec(nb0, nb1);
    times.lap(worker, ExpertTimes::kDecode, mark);
    const at::Tensor y = at::mm(x, w.t());
    for (int64_t h = 0; h < halves; ++h) out.narrow(1, h * half + r0, n).copy_(y.narrow(1, h * n, n));
    times.lap(worker, ExpertTimes::kProducts, mark);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_moe_delta(
    const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13,
    const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2, const std::optional<at::Tensor>& w2_scales,
    const at::Tensor& gate_up_delta, c10::string_view activation,
    const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias) {
  const char* op = "fused_moe_delta";
  const auto hd = hidden.scalar_type();
  if (hd == at::kBFloat16 || hd == at::kHalf) {  // the packed kernels: kt::fused_moe's path with the deltas added
    TORCH_CHECK(topk_ids.dim() == 2, op, ": topk_ids must be [T, K], got shape ", topk_ids.sizes());
    TORCH_CHECK(w2.dim() == 5, op, ": w2 must be a packed tensor [E, H/16, I/per, 16, per], got shape ", w2.sizes());
    const bool nibbles = w2.scalar_type() == at::kByte || w2.scalar_type() == at::ScalarType::Float4_e2m1fn_x2;
    const int64_t I = w2.size(2) * (nibbles ? 8 : w2.size(4));
    const auto opts = hidden.options().memory_format(at::MemoryFormat::Contiguous);
    // h and the pre-activations (75 MB a Qwen3 layer at T = 2048 in bf16) are new every call, above glibc's mmap
    // threshold: with transparent huge pages advised, their first writes fault 2 MiB pages in, not 4 KiB ones (12.3 K
    // minor faults a call -> 537 here); likewise the backward's large buffers
    at::Tensor h = runtime::empty_weights({topk_ids.size(0), topk_ids.size(1), I}, opts);
    at::Tensor gu = runtime::empty_weights({topk_ids.size(0), topk_ids.size(1), w13.size(1) * 16}, opts);
    at::Tensor out = fused_moe_with_delta(hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation,
                                          gate_up_delta, h, gu, w13_bias, w2_bias);
    return {out, h, gu};
  }
  // float32/float64: the function of the dequantized weights, exactly (the reference gradcheck and the tests run)
  Call c = make_call(op, hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation, w13_bias, w2_bias);
  const at::Tensor delta = checked_delta(c, gate_up_delta, "gate_up_delta");
  const at::Tensor out_pairs = at::zeros({c.T * c.K, c.H}, at::TensorOptions().dtype(c.et));
  const at::Tensor h_pairs = at::zeros({c.T * c.K, c.I}, at::TensorOptions().dtype(c.et));
  const at::Tensor gu_pairs = at::zeros({c.T * c.K, c.N13}, at::TensorOptions().dtype(c.et));
  const at::Tensor wflat = c.weights.reshape({c.T * c.K});
  ExpertTimes times(false, 0);  // (no profile line: the reference)
  for_each_expert(c, expert_tasks(c, false), times, {true, true, false}, [&](const Task& t, const Dense& d, int) {
    const int64_t e = t.e;
    const at::Tensor rows = pair_rows(c, e);
    const at::Tensor x = c.hidden.index_select(0, at::floor_divide(rows, c.K)).to(c.ct);
    const at::Tensor gu = pre_activations(c, e, x, d.w13, delta, rows);
    const at::Tensor h = glu_forward(c, gu);
    at::Tensor y = at::mm(h.to(c.ct), d.w2.t()).to(c.et);
    if (c.b2.defined()) y.add_(c.b2.select(0, e));  // the down bias, before the routing weight
    out_pairs.index_copy_(0, rows, y.mul_(wflat.index_select(0, rows).unsqueeze(1)));
    h_pairs.index_copy_(0, rows, h);
    gu_pairs.index_copy_(0, rows, gu);
  });
  at::Tensor out = out_pairs.view({c.T, c.K, c.H}).sum(1).to(hidden.scalar_type());
  return {out, h_pairs.view({c.T, c.K, c.I}).to(hidden.scalar_type()),
          gu_pairs.view({c.T, c.K, c.N13}).to(hidden.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_moe_backward(
    const at::Tensor& grad_out, const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
    const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
    const std::optional<at::Tensor>& gate_up_delta, const std::optional<at::Tensor>& grad_h,
    const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias,
    const std::optional<at::Tensor>& gate_up) {
  const char* op = "fused_moe_backward";
  // the matmuls write d hidden's rows in place (mm_out), which autograd refuses on inputs that require grad
  // (gradcheck's); nothing here is differentiated (grad mode is per thread: for_each_expert's workers set it too)
  c10::AutoGradMode no_grad(false);
  PhaseTimer timer(op);
  Call c = make_call(op, hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation, w13_bias, w2_bias);
  TORCH_CHECK(grad_out.device().is_cpu() && grad_out.is_floating_point() && grad_out.sizes() == hidden.sizes(), op,
              ": grad_out must be a float CPU tensor shaped like hidden ", hidden.sizes(), ", got ",
              grad_out.scalar_type(), " ", grad_out.sizes(), " on ", grad_out.device());
  const at::Tensor delta = gate_up_delta.has_value() ? checked_delta(c, *gate_up_delta, "gate_up_delta") : at::Tensor();
  // the forward's pre-activations (biases and deltas included), or undefined: recomputed from hidden
  const at::Tensor saved = gate_up.has_value() ? checked_delta(c, *gate_up, "gate_up") : at::Tensor();
  at::Tensor dh_ext;
  if (grad_h.has_value()) {
    const at::Tensor& d = *grad_h;
    TORCH_CHECK(d.device().is_cpu() && d.is_floating_point() && d.dim() == 3 && d.size(0) == c.T && d.size(1) == c.K &&
                    d.size(2) == c.I,
                op, ": grad_h must be a float CPU tensor [T=", c.T, ", K=", c.K, ", I=", c.I, "], got ", d.scalar_type(),
                " ", d.sizes(), " on ", d.device());
    dh_ext = d.reshape({c.T * c.K, c.I});
  }
  const auto eopts = at::TensorOptions().dtype(c.et);
  // the pairs' rows of d hidden and d delta: every routed row is written by its expert's task. d hidden's rows in
  // c.order's order, in the compute dtype (each expert's product writes its rows in place, as the matmul rounds
  // them; sum_slots adds them up by token). The skipped slots' rows of d delta are zeroed. d delta is kept in its
  // output dtype: each row rounded once, no second pass.
  const at::Tensor dx_grouped =
      runtime::empty_weights({static_cast<int64_t>(c.order.size()), c.H}, at::TensorOptions().dtype(c.ct));
  const at::Tensor dw = at::zeros({c.T * c.K}, eopts);
  at::Tensor ddelta;
  if (delta.defined()) {
    ddelta = runtime::empty_weights({c.T * c.K, c.N13}, at::TensorOptions().dtype(gate_up_delta->scalar_type()));
    zero_skipped_rows(c, ddelta);
  }
  const at::Tensor wflat = c.weights.reshape({c.T * c.K});
  const at::Tensor dy_all = grad_out.contiguous();
  timer.mark("setup");
  // the products decode their weights a slice at a time into each worker's d.slice (product_t, product_up): a busy
  // expert's pairs are cut into pieces, each decoding the expert again (expert_tasks)
  const std::vector<Task> tasks = expert_tasks(c, true);
  ExpertTimes times(timer.on(), expert_workers(c, static_cast<int64_t>(tasks.size())));
  for_each_expert(c, tasks, times, {false, false, true}, [&](const Task& t, const Dense& d, int worker) {
    auto mark = times.start();
    const int64_t e = t.e, n = t.r1 - t.r0;
    const at::Tensor rows = pair_rows(c, e).narrow(0, t.r0, n);
    const at::Tensor tokens = at::floor_divide(rows, c.K);
    const at::Tensor x = saved.defined() ? at::Tensor() : c.hidden.index_select(0, tokens).to(c.ct);
    const at::Tensor dy = dy_all.index_select(0, tokens);
    const at::Tensor dyc = dy.to(c.ct);
    const at::Tensor we = wflat.index_select(0, rows).unsqueeze(1);
    const at::Tensor dhe = dh_ext.defined() ? dh_ext.index_select(0, rows).to(c.et) : at::Tensor();
    const at::Tensor de = delta.defined() && !saved.defined() ? delta.index_select(0, rows).to(c.et) : at::Tensor();
    at::Tensor gu = saved.defined() ? saved.index_select(0, rows).to(c.et) : at::empty({n, c.N13}, eopts);
    const at::Tensor G = at::empty({n, c.I}, eopts);
    times.lap(worker, ExpertTimes::kCopies, mark);
    if (!saved.defined()) product_up(c, e, x, gu, d, times, worker, mark);
    product_t(c.down, e, false, dyc, G, d, times, worker, mark);  // [n, I]
    if (!saved.defined()) {
      if (c.b13.defined()) gu.add_(c.b13.select(0, e));
      if (de.defined()) gu.add_(de);
    }
    const at::Tensor h = glu_forward(c, gu);
    at::Tensor dwe = (G * h).sum(1);
    if (c.b2.defined()) dwe.add_(at::mv(dy.to(c.et), c.b2.select(0, e)));  // d w also sees the down bias
    at::Tensor dh = G.mul_(we);
    if (dhe.defined()) dh.add_(dhe);
    const at::Tensor dgu = glu_backward(c, gu, dh);  // [n, N13]
    const at::Tensor dguc = dgu.to(c.ct);
    times.lap(worker, ExpertTimes::kElementwise, mark);
    product_t(c.up, e, c.gated, dguc, dx_grouped.narrow(0, c.start[e] + t.r0, n), d, times, worker, mark);
    dw.index_copy_(0, rows, dwe);
    if (ddelta.defined()) ddelta.index_copy_(0, rows, dgu.to(ddelta.scalar_type()));
    times.lap(worker, ExpertTimes::kCopies, mark);
  });
  timer.mark("experts");
  times.report(timer);
  at::Tensor dx = sum_slots(c, dx_grouped, hidden.scalar_type());
  at::Tensor dweights = dw.view({c.T, c.K}).to(topk_weights.scalar_type());
  at::Tensor dd = ddelta.defined() ? ddelta.view({c.T, c.K, c.N13}) : at::empty({0}, hidden.options());
  timer.mark("sum");
  timer.print("T=" + std::to_string(c.T) + " pairs=" + std::to_string(c.order.size()) +
             " experts=" + std::to_string(c.experts.size()) + " tasks=" + std::to_string(tasks.size()) +
             (delta.defined() ? " delta" : "") +
             (dh_ext.defined() ? " grad_h" : "") + (saved.defined() ? " saved" : "") + " " +
             std::string(c10::toString(c.ct)));
  return {dx, dweights, dd};
}

}  // namespace kt::moe
