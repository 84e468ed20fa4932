// kt::fused_moe on the CPU: out[t] = sum_k w[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t,k],
// with negative ids skipped. One call, no Python in between:
//   1. route: group the (token, slot) pairs by expert (stable in token order); ids >= E are errors.
//   2. activations: each token's row once, as bf16, or as int8 with a per-row scale and group sums.
//   3. gate+up: tasks = (chunk of one expert's tokens, range of intermediate channels). A task copies its
//      tokens' rows one line apart into its worker's buffer (evenly strided rows: AMX tile loads read
//      them in place), then computes 32 gate + 32 up columns per kernel call and writes act(gate) * up into
//      h[pair] (int formats, a task covering all I channels: the GLU of a call runs as side work of the next call,
//      which the AMX walks interleave with their tile products, vector work beside the tile unit; int8 T=2048 1-8%
//      faster on the device, RESULTS.md session 20). When there are enough chunks to keep every worker busy, a task
//      covers all I channels of its rows, so it quantizes its h rows for the down projection itself (int formats)
//      while they are in its cache; otherwise the channels are split over tasks and a separate pass quantizes h (or
//      the caller's quantize_h, fused_moe.h: the NUMA split).
//   4. down: tasks = (range of output columns, group of experts: ids in the lower or upper half). A task
//      walks its experts in order, computes their tokens' rows of h . W_down^T for its columns and adds
//      w[t,k] times them into its group's accumulator rows (a token's first pair in the group writes its row:
//      the accumulators are never zeroed); the last task of a column range sums the groups' accumulators
//      that hold the token into the output. Ranges are wide (every range reads all of h), the groups
//      double the tasks for the same h traffic. No atomics on data, and each token's sum runs in the same
//      order whatever the batch, the worker count or the order tasks run in.
// Tasks are pulled dynamically by the workers (runtime/parallel.h), so skewed routing balances. Steps 2-4 are
// stages of one pool dispatch (run_stages): a task waits, spinning, for the stages before it to finish, instead of
// the pool closing and reopening a job between phases; while it waits it fetches its own weights into its core's L2
// (WaitPrefetch), so DRAM does not idle through a stage's tail.
// Where no pass quantizes all of h between gate/up and down, each expert group of step 4 has a gate/up stage and a
// down stage of its own, so the first groups' down tasks run during the last gate/up tasks.
// The task grids and prefetch distances are constants below, each with the device measurement that chose it; the
// variants they were chosen over were removed with the environment switches that selected them.
// Expert deferral runs two parts in one call (fused_moe_split, fused_moe.h): the stages of the deferred part come
// after the first part's, and the first part's result is published as soon as its down projection is done.
// Biases, clamped/softcapped activations and gateless experts (gpt-oss, DeepSeek-V4, MiniMax-M3, Inkling2, Nemotron-H)
// run in the driver's own epilogue (Epilogue below: plain C++, so every kernel level gets them): the gate/up bias,
// the clamps and the activation on each kernel call's fp32 output, and the down bias on each down call's output
// before the routing weight scales it. Calls without them keep the kernels' vectorized GLU.
// The training forward (fused_moe_with_delta, fused_moe.h; kt.fused_moe_delta for bf16/fp16 hidden) is this same
// call with deltas added to each gate/up kernel call's fp32 output in the GLU step (Part::Glu, before the kernels'
// GLU or the driver's epilogue: shared code, so every kernel level and the AMX side work get them), each routed
// pair's pre-activations (biases and deltas added) written out in that same step for the backward to read, and its
// h written out at the end of its gate/up task.
// KT_PROFILE=1 prints each call's phase times to stderr.
#include "fused_moe.h"

#include "bf16.h"
#include "profile.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <sched.h>
#include <string>
#include <type_traits>
#include <vector>

#include "../kernels/kernels.h"
#include "../runtime/dispatch.h"
#include "../runtime/parallel.h"

namespace kt::moe {
namespace {

using kernels::Activation;
using kernels::WeightFormat;

// The training forward's row work (Glu::add_delta, store_gate_up, store_h): plain loops over a row of a few dozen
// values, compiled for AVX-512, AVX2 and the baseline and picked at load time (GCC's function multiversioning; the
// driver's baseline is SSE2, where these conversions ran one value at a time: 111 of a T = 2048 int8 Qwen3 call's
// 428 ms on a 2-core AMD EPYC). The bf16 rounding is f32_to_bf16's (nearest even, NaN kept quiet).
#define ROW_CLONES __attribute__((target_clones("arch=skylake-avx512", "arch=haswell", "default")))
ROW_CLONES void add_row(float* c, const uint16_t* d, int n) {  // c += d, bf16 bits
  for (int i = 0; i < n; ++i) c[i] += bf16_to_f32(d[i]);
}
ROW_CLONES void add_row(float* c, const float* d, int n) {
  for (int i = 0; i < n; ++i) c[i] += d[i];
}
// dst = bf16(c + b) (b nullptr: c), n values
ROW_CLONES void store_bf16_row(uint16_t* dst, const float* c, const float* b, int64_t n) {
  if (b == nullptr) {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(c[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(c[i] + b[i]);
  }
}

constexpr int64_t kGateUpRows = 256;  // rows per gate/up task (bounded per-worker buffers)
// rows per down kernel call: all of an expert's rows in one call up to 256 (Qwen3 at T=2048 has 128 +- 11 an
// expert; with 128 half the experts made a second call of ~10 rows that read the weights again)
constexpr int64_t kDownRows = 256;
constexpr int64_t kDownCols = 16 * kernels::kMaxBlocks;  // columns per down kernel call
// a worker's kernel-output buffer: two gate/up outputs (the calls alternate between them: Part::gate_up), or one down
constexpr int64_t kGateUpC = kGateUpRows * 64;
constexpr int64_t kWorkerC = std::max(2 * kGateUpC, kDownRows * kDownCols);
// Down-projection expert groups (see step 4): 2. On the device no grid of ranges x groups (32 x 2, 16 x 4, 32 x 1,
// 8 x 4; session 12: 32 x 4, 64 x 2) beat 16 x 2 across shapes by more than the host's spread, and the winners
// disagreed (benchmarks/RESULTS.md, "Down-projection task grids" and "Session 12: finer down grids").
constexpr int64_t kDownGroups = 2;
// Gate/up tasks a pool worker: each expert's intermediate channels are cut into enough ranges for about 3 tasks a
// worker. 8 and 16 (and 26-39 down ranges) measured within 1-2% of the defaults on the device's decode layers
// (RESULTS.md, session 15: "finer task grids ... within 1-2%, so their defaults stay").
constexpr int64_t kGateUpTasksPerWorker = 3;
// The pipeline's last down stage runs on 2x narrower column ranges where the down calls are memory-bound, at most
// this many rows an expert on average, and 1x above (narrower tile calls run slower: on the device Qwen3 T=2048
// lost up to 9%, T=512 gained 0-18%; RESULTS.md, "Session 21").
constexpr int64_t kTailRows = 64;
// Decode-sized kernel calls prefetch each weight stream this many 64-byte lines ahead: a Qwen3 decode layer on the
// device (T = 1, 13 threads, interleaved A/B) ran 6% (int8) and 8% (int4 g32) faster with 8-32 than with the
// hardware prefetchers alone (0), 64 less so (RESULTS.md, session 15: "prefetching each weight stream 16 lines
// ahead on top: 6% (int8) and 8% (int4)").
constexpr int kPrefetchAhead = 16;

struct PackedMatrix {
  const at::Tensor* weights;
  const std::optional<at::Tensor>* scales;
  const char* name;
  int64_t E, N, K;
  WeightFormat fmt = WeightFormat::BF16;
  int64_t groups = 1;  // scale groups along K (per-channel int8: 1)
  bool affine = false;  // scales [E, 2, G, N]: scale, then minimum (GGUF K-quants kept exact)
  const int8_t* codes = nullptr;  // coded int4 (MXFP4: kernels::kMxfp4Codes), GemmArgs::b_codes
  // Scales at the file's size (describe): 0 none (fp32 per group); two-level (GGUF K-quants): 1 uint8 sub-scales
  // (Q4_K, Q5_K), 2 int8 (Q6_K), supers the fp32 super-scales along K (one per 256 input channels); 3 fp16 per group
  // (GGUF Q8_0's d), supers 0.
  int sub_kind = 0;
  int64_t supers = 0;
  int64_t group_size() const { return K / groups; }
  int64_t rows() const { return groups + 4 * supers; }  // two-level: byte rows of one scale part
  // floats from one expert's scales to the next one's, and from a scale to its minimum (affine)
  int64_t scale_expert_stride() const { return (affine ? 2 : 1) * groups * N; }
  int64_t min_offset() const { return groups * N; }
};

WeightFormat format_of(const at::Tensor& w, const char* name) {
  switch (w.scalar_type()) {
    case at::kBFloat16: return WeightFormat::BF16;
    case at::kChar: return WeightFormat::INT8;
    case at::kByte: return WeightFormat::INT4;
    case at::ScalarType::Float4_e2m1fn_x2: return WeightFormat::INT4;  // MXFP4 nibbles (codes_of)
    default:
      TORCH_CHECK(false, "fused_moe: ", name, " must be packed by kt.pack_bf16/pack_int8/pack_int4 (bfloat16, int8 or ",
                  "uint8 for int4) or pack_quantized (float4_e2m1fn_x2 for MXFP4 nibbles), got ", w.scalar_type());
  }
}

// The code table of packed int4 weights whose nibbles stand for table values (GemmArgs::b_codes): the dtype
// float4_e2m1fn_x2 marks MXFP4 nibbles (E2M1 codes, the table kMxfp4Codes: their values doubled); nullptr for the
// plain int4 (uint8) and every other format.
const int8_t* codes_of(const at::Tensor& w) {
  return w.scalar_type() == at::ScalarType::Float4_e2m1fn_x2 ? kernels::kMxfp4Codes : nullptr;
}

// Scales: [E, G, N] (W = q * s; int8: G = 1 per output channel, or groups of a multiple of 16 input channels;
// int4: groups of a multiple of 32), or [E, 2, G, N] (affine, W = q * s - m: [:, 0] the scales, [:, 1] the
// minimums; int4 codes then are the unsigned nibbles themselves).
PackedMatrix describe(const at::Tensor& w, const std::optional<at::Tensor>& s, WeightFormat f, const char* name,
                      const char* scales_name) {
  TORCH_CHECK(w.device().is_cpu(), "fused_moe: ", name, " must be a CPU tensor, got device ", w.device());
  const int64_t per = f == WeightFormat::BF16 ? 2 : 4;
  TORCH_CHECK(w.dim() == 5 && w.size(3) == 16 && w.size(4) == per && w.is_contiguous(), "fused_moe: ", name,
              " must be a contiguous packed tensor [E, N/16, K/", f == WeightFormat::INT4 ? 8 : per, ", 16, ", per,
              "], got shape ", w.sizes());
  PackedMatrix m{&w, &s, name, w.size(0), w.size(1) * 16, w.size(2) * (f == WeightFormat::INT4 ? 8 : per), f};
  m.codes = codes_of(w);
  if (f == WeightFormat::BF16) {
    TORCH_CHECK(!s.has_value(), "fused_moe: bf16 weights take no scales, but ", scales_name, " was given");
    return m;
  }
  TORCH_CHECK(s.has_value(), "fused_moe: ", f == WeightFormat::INT8 ? "int8" : "int4", " weights need ", scales_name);
  const at::Tensor& sc = *s;
  const bool two_level = sc.scalar_type() == at::kByte || sc.scalar_type() == at::kChar;
  const bool half = sc.scalar_type() == at::kHalf;
  TORCH_CHECK(sc.device().is_cpu() && (sc.scalar_type() == at::kFloat || two_level || half) &&
                  (sc.dim() == 3 || sc.dim() == 4) &&
                  sc.is_contiguous(),
              "fused_moe: ", scales_name, " must be a contiguous float32 CPU tensor [E, G, N] (or [E, 2, G, N]: ",
              "scales and minimums), float16 like them, or two-level uint8/int8 [E, (2,) G + K/64, N] ",
              "(ktorch.ops.moe.pack_kscales), got ",
              sc.scalar_type(), " ", sc.sizes(), " on ", sc.device());
  m.affine = sc.dim() == 4;
  TORCH_CHECK(!(m.affine && m.codes != nullptr), "fused_moe: ", name, " holds MXFP4 nibbles (float4_e2m1fn_x2), which ",
              "take scales [E, G, N], but ", scales_name, " has minimums too: ", sc.sizes());
  TORCH_CHECK(sc.size(0) == m.E && sc.size(-1) == m.N && (!m.affine || sc.size(1) == 2), "fused_moe: ", scales_name,
              " has shape ", sc.sizes(), " but ", name, " needs [", m.E, ", G, ", m.N, "] or [", m.E, ", 2, G, ", m.N, "]");
  m.groups = sc.size(-2);
  if (half) m.sub_kind = 3;
  if (two_level) {  // rows [0, G): the sub-scales; then the fp32 super-scales [K/256][N] as 4 K/256 byte rows
    TORCH_CHECK(m.K % 256 == 0 && m.groups > 4 * (m.K / 256), "fused_moe: two-level ", scales_name, " ", sc.sizes(),
                " needs K a multiple of 256 and more than K/64 rows, K=", m.K);
    m.supers = m.K / 256;
    m.groups -= 4 * m.supers;
    m.sub_kind = sc.scalar_type() == at::kByte ? 1 : 2;
    TORCH_CHECK(m.groups % m.supers == 0 && m.K % m.groups == 0, "fused_moe: two-level ", scales_name, " has ",
                m.groups, " sub-scale rows, not a whole number per 256 input channels of K=", m.K);
  }
  TORCH_CHECK(m.groups > 0 && m.K % m.groups == 0, "fused_moe: ", scales_name, " has ", m.groups,
              " groups, which do not divide K=", m.K);
  if (f == WeightFormat::INT8) {
    TORCH_CHECK((m.groups == 1 && !m.affine) || m.group_size() % 16 == 0, "fused_moe: int8 ", scales_name, " has ",
                m.groups, " groups of ", m.group_size(), " input channels; grouped or affine int8 needs groups of a ",
                "multiple of 16");
  } else {
    TORCH_CHECK(m.group_size() % 32 == 0, "fused_moe: ", scales_name, " has ",
                m.groups, " groups, which does not give a group size that is a multiple of 32 dividing K=", m.K);
  }
  return m;
}

// Scales at the file's size (m.sub_kind != 0) as the kernels take them: fp16 ones converted; two-level ones
// out[g * n + c] = super[g / (G / S)][c0 + c] * sub[g][c0 + c] for columns [c0, c0 + n) of expert e, in fp32 (the
// product of an fp32 holding a GGUF fp16 d and a small integer is exact: the same value as the fp32 per-group form);
// affine: the minimums follow at out + G * n. The driver runs it before each kernel call of more than
// kDirectScaleRows rows (reading the file's bytes, not 4 a group), into a thread's buffer. One row of n columns at a
// time, 16 (AVX-512) or 8 (AVX2 + F16C) columns a vector where the host has them: the scalar form (c10::Half's
// software conversion, a byte at a time) cost a T = 1 Qwen3 layer 0.1 ms of its 0.27 (Q4_K two-level 0.378 ms
// against 0.269 for the fp32 form, H200 host, session 29).
namespace {

// kind: 1 uint8 sub-scales, 2 int8, 3 fp16 (d == nullptr)
void expand_row_scalar(int kind, const void* src, const float* d, float* o, int64_t from, int64_t n) {
  for (int64_t c = from; c < n; ++c) {
    if (kind == 3) o[c] = static_cast<float>(static_cast<const c10::Half*>(src)[c]);
    else if (kind == 1) o[c] = d[c] * static_cast<float>(static_cast<const uint8_t*>(src)[c]);
    else o[c] = d[c] * static_cast<float>(static_cast<const int8_t*>(src)[c]);
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define EXPAND_WITH_VECTORS 1
__attribute__((target("avx512f"))) void expand_row_avx512(int kind, const void* src, const float* d, float* o,
                                                            int64_t n) {
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    __m512 v;
    if (kind == 3) {
      v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + c)));
    } else {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(src) + c));
      const __m512i w = kind == 1 ? _mm512_cvtepu8_epi32(b) : _mm512_cvtepi8_epi32(b);
      v = _mm512_mul_ps(_mm512_loadu_ps(d + c), _mm512_cvtepi32_ps(w));
    }
    _mm512_storeu_ps(o + c, v);
  }
  expand_row_scalar(kind, src, d, o, c, n);
}

__attribute__((target("avx2,f16c"))) void expand_row_avx2(int kind, const void* src, const float* d, float* o,
                                                            int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) {
    __m256 v;
    if (kind == 3) {
      v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + c)));
    } else {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(src) + c));
      const __m256i w = kind == 1 ? _mm256_cvtepu8_epi32(b) : _mm256_cvtepi8_epi32(b);
      v = _mm256_mul_ps(_mm256_loadu_ps(d + c), _mm256_cvtepi32_ps(w));
    }
    _mm256_storeu_ps(o + c, v);
  }
  expand_row_scalar(kind, src, d, o, c, n);
}
#endif

// The vector width this host takes (0: scalar); KT's kernel level does not matter here: the row is plain conversion.
int expand_level() {
#ifdef EXPAND_WITH_VECTORS
  static const int level = __builtin_cpu_supports("avx512f") ? 2
                           : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) ? 1
                                                                                                : 0;
  return level;
#else
  return 0;
#endif
}

inline void expand_row(int level, int kind, const void* src, const float* d, float* o, int64_t n) {
#ifdef EXPAND_WITH_VECTORS
  if (level == 2) return expand_row_avx512(kind, src, d, o, n);
  if (level == 1) return expand_row_avx2(kind, src, d, o, n);
#endif
  expand_row_scalar(kind, src, d, o, 0, n);
}

}  // namespace

const float* expand_kscales(const PackedMatrix& m, const void* scales, int64_t e, int64_t c0, int64_t n) {
  thread_local std::vector<float> buf;
  const int parts = m.affine ? 2 : 1;
  if (buf.size() < static_cast<size_t>(parts * m.groups * n)) buf.resize(parts * m.groups * n);
  const int level = expand_level();
  if (m.sub_kind == 3) {  // fp16 per group: converted (exactly)
    for (int part = 0; part < parts; ++part) {
      const c10::Half* p = static_cast<const c10::Half*>(scales) + ((e * parts + part) * m.groups) * m.N + c0;
      float* o = buf.data() + part * m.groups * n;
      for (int64_t g = 0; g < m.groups; ++g) expand_row(level, 3, p + g * m.N, nullptr, o + g * n, n);
    }
    return buf.data();
  }
  const int64_t per = m.groups / m.supers;
  for (int part = 0; part < parts; ++part) {
    const uint8_t* p = static_cast<const uint8_t*>(scales) + (e * parts + part) * m.rows() * m.N;
    const float* sup = reinterpret_cast<const float*>(p + m.groups * m.N) + c0;
    float* o = buf.data() + part * m.groups * n;
    for (int64_t g = 0; g < m.groups; ++g)
      expand_row(level, m.sub_kind, p + g * m.N + c0, sup + (g / per) * m.N, o + g * n, n);
  }
  return buf.data();
}

// Calls of at most this many rows read two-level scales as the file's bytes (the kernels form each group's fp32
// scale as they go, once: one AVX-512 row tile); larger calls get them expanded (expand_kscales), which the
// AVX-512 kernel's row tiles then share instead of forming them again each. Device, one Qwen3-30B-A3B layer at
// T = 1, ms, the bytes against the expansion, three A/Bs of the two builds (session 42, H200 hosts; docs/loading.md):
// Q4_K two-level 0.271 / 0.304 / 0.281 against 0.351 / 0.434 / 0.378, Q4_K_M 0.335 / 0.408 / 0.405 against 0.368 /
// 0.458 / 0.485, Q6_K within noise. (Every call reading the bytes made prefill slower in the one A/B run: Q6_K
// 22.99 / 80.49 ms at T = 512 / 2048 against 17.76 / 69.63, Q4_K 13.95 / 42.87 against 12.86 / 38.11.)
constexpr int kDirectScaleRows = 6;

// A kernel call's weight scales (and minimums) for columns [c0, c0 + n) of expert e (a.M set): pointers into the
// float32 scales; fp16 ones expanded; two-level ones as the file's bytes and super-scales (kernels.h), alone for a
// call of at most kDirectScaleRows rows, else beside their float32 expansion (which only the AMX walks pass over).
void set_b_scales(kernels::GemmArgs& a, const PackedMatrix& m, const float* scales, int64_t e, int64_t c0,
                  int64_t n) {
  a.b_sub = a.b_min_sub = nullptr;
  a.b_super = a.b_min_super = nullptr;
  a.b_sub_signed = false;
  a.b_min = nullptr;
  if (m.sub_kind == 0) {
    a.b_scale = scales + e * m.scale_expert_stride() + c0;
    a.b_scale_group_stride = m.N;
    if (m.affine) a.b_min = a.b_scale + m.min_offset();
    return;
  }
  if (m.sub_kind != 3) {  // part p's sub-scale rows [G][N], then its super-scales [S][N] as 4 S byte rows
    const uint8_t* p = reinterpret_cast<const uint8_t*>(scales) + e * (m.affine ? 2 : 1) * m.rows() * m.N;
    a.b_sub = p + c0;
    a.b_super = reinterpret_cast<const float*>(p + m.groups * m.N) + c0;
    if (m.affine) {
      a.b_min_sub = a.b_sub + m.rows() * m.N;
      a.b_min_super = a.b_super + m.rows() * m.N / 4;
    }
    a.b_sub_group_stride = m.N;
    a.b_super_group_stride = m.N;
    a.b_sub_signed = m.sub_kind == 2;
    a.super_size = m.K / m.supers;
    if (a.M <= kDirectScaleRows) {
      a.b_scale = nullptr;
      return;
    }
  }
  a.b_scale = expand_kscales(m, scales, e, c0, n);
  a.b_scale_group_stride = n;
  if (m.affine) a.b_min = a.b_scale + m.groups * n;
}

// What the driver does between the gate/up kernel calls and h (and to the down calls' output). The kernels' GLU
// computes act(gate) * up for the first four activations; the rest, biases and gateless experts run in
// Part::Glu::run_epilogue, scalar C++ the compiler may vectorize (its cost beside the kernels' GLU is not measured
// yet: a gpt-oss-shaped prefill on the device would show it).
using Act = ActivationKind;

struct Epilogue {
  Act act = Act::SiLU;
  float alpha = 0, limit = 0, gate_cap = 0, up_cap = 0;  // the parameters of swiglu_oai, silu_clamped, softcap_swiglu
  bool gated = true;           // false: w13 holds only up ([E, I, H]) and h = act(up)
  const float* b13 = nullptr;  // [E, 2I] gate biases then up biases (gated), [E, I] (gateless); nullptr: none
  const float* b2 = nullptr;   // [E, H]
  bool kernel_glu() const { return gated && b13 == nullptr && act <= Act::Relu; }
  Activation kernel_act() const { return static_cast<Activation>(static_cast<int>(act)); }  // (Act's first four)

  static float act1(Act a, float x) {
    switch (a) {
      case Act::GeluTanh: {
        const float inner = 0.7978845608028654f * (x + 0.044715f * x * x * x);
        return 0.5f * x * (1.0f + std::tanh(inner));
      }
      case Act::Gelu: return 0.5f * x * (1.0f + std::erf(x * 0.7071067811865476f));
      case Act::Relu: return x > 0.0f ? x : 0.0f;
      case Act::Relu2: {
        const float r = x > 0.0f ? x : 0.0f;
        return r * r;
      }
      default: return x / (1.0f + std::exp(-x));  // SiLU
    }
  }
  // h for one channel from its gate and up values (biases added). The clamps keep NaN as torch.clamp does.
  float glu1(float g, float u) const {
    switch (act) {
      case Act::SwigluOai:  // gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), gate <= limit, |up| <= limit
        g = std::min(g, limit), u = std::max(std::min(u, limit), -limit);
        return (u + 1.0f) * (g / (1.0f + std::exp(-alpha * g)));
      case Act::SiluClamped:  // DeepSeek-V4: silu(gate) * up with the same clamps
        g = std::min(g, limit), u = std::max(std::min(u, limit), -limit);
        return g / (1.0f + std::exp(-g)) * u;
      case Act::SoftcapSwiglu:  // Inkling2: softcap(gate) * sigmoid(gate) * softcap(up), softcap(x) = c tanh(x / c)
        return gate_cap * std::tanh(g / gate_cap) / (1.0f + std::exp(-g)) * (up_cap * std::tanh(u / up_cap));
      default: return act1(act, g) * u;
    }
  }
};

// "name" or "name(key=value, ...)". Names: silu (swish), gelu_tanh (gelu_pytorch_tanh, gelu_new), gelu, relu, relu2,
// swiglu_oai(alpha=, limit=), silu_clamped(limit=), softcap_swiglu(gate=, up=); every parameter of a name is required.
Epilogue parse_epilogue(c10::string_view spec) {
  const std::string full(spec);
  const size_t open = full.find('(');
  const std::string name = full.substr(0, open);
  std::vector<std::pair<std::string, float>> params;
  if (open != std::string::npos) {
    TORCH_CHECK(full.back() == ')', "fused_moe: activation '", full, "' must be name or name(key=value, ...)");
    std::string body = full.substr(open + 1, full.size() - open - 2);
    size_t at = 0;
    while (at <= body.size() && !body.empty()) {
      const size_t comma = std::min(body.find(',', at), body.size());
      std::string item = body.substr(at, comma - at);
      item.erase(0, item.find_first_not_of(' '));
      item.erase(item.find_last_not_of(' ') + 1);
      const size_t eq = item.find('=');
      TORCH_CHECK(eq != std::string::npos && eq > 0, "fused_moe: activation '", full, "': '", item,
                  "' is not key=value");
      const std::string value = item.substr(eq + 1);
      char* end = nullptr;
      const float v = std::strtof(value.c_str(), &end);
      TORCH_CHECK(!value.empty() && *end == '\0' && std::isfinite(v), "fused_moe: activation '", full, "': '", value,
                  "' is not a finite number");
      params.push_back({item.substr(0, eq), v});
      at = comma + 1;
    }
  }
  Epilogue ep;
  // takes the parameters `keys` (all required, nothing else allowed) into `dst`
  auto take = [&](std::initializer_list<std::pair<const char*, float*>> keys) {
    for (const auto& [k, v] : params) {
      bool known = false;
      for (const auto& key : keys) known = known || k == key.first;
      TORCH_CHECK(known, "fused_moe: activation ", name, " takes no parameter '", k, "'");
    }
    for (const auto& key : keys) {
      int found = 0;
      for (const auto& [k, v] : params)
        if (k == key.first) *key.second = v, ++found;
      TORCH_CHECK(found == 1, "fused_moe: activation ", name, " needs ", key.first, "= exactly once, got '", full, "'");
    }
  };
  if (name == "silu" || name == "swish") ep.act = Act::SiLU, take({});
  else if (name == "gelu_tanh" || name == "gelu_pytorch_tanh" || name == "gelu_new") ep.act = Act::GeluTanh, take({});
  else if (name == "gelu") ep.act = Act::Gelu, take({});
  else if (name == "relu") ep.act = Act::Relu, take({});
  else if (name == "relu2") ep.act = Act::Relu2, take({});
  else if (name == "swiglu_oai") ep.act = Act::SwigluOai, take({{"alpha", &ep.alpha}, {"limit", &ep.limit}});
  else if (name == "silu_clamped") ep.act = Act::SiluClamped, take({{"limit", &ep.limit}});
  else if (name == "softcap_swiglu") {
    ep.act = Act::SoftcapSwiglu, take({{"gate", &ep.gate_cap}, {"up", &ep.up_cap}});
    TORCH_CHECK(ep.gate_cap > 0 && ep.up_cap > 0, "fused_moe: softcap_swiglu's caps must be positive, got '", full, "'");
  } else {
    TORCH_CHECK(false, "fused_moe: activation must be one of silu, gelu_tanh, gelu, relu, relu2, swiglu_oai(alpha=, ",
                "limit=), silu_clamped(limit=), softcap_swiglu(gate=, up=); got '", full, "'");
  }
  TORCH_CHECK((ep.act != Act::SwigluOai && ep.act != Act::SiluClamped) || ep.limit > 0,
              "fused_moe: the limit of ", name, " must be positive, got '", full, "'");
  return ep;
}

// KT_PROFILE=1: where each worker's time in gate/up or down goes (WorkerTimes, profile.h). Added to the phase
// line as <phase>.kernel (the gemm kernel calls), <phase>.epilogue (the driver's work on their output: GLU and
// h quantization, or down's weighted scatter), <phase>.other (the rest of the tasks: row copies, the group
// sums), each the mean over workers in ms, and <phase>.busiest (the largest sum of the three for one worker): one
// far longer than the kernel share spent it in the epilogue.
struct GemmTimes : WorkerTimes<3> {
  using WorkerTimes<3>::WorkerTimes;
  enum Kind { kKernel = 0, kEpilogue = 1, kOther = 2 };
};

// Scratch buffers kept from call to call. Large fresh allocations are mmap'd by malloc and returned to
// the OS on free, so every call would first-touch (page-fault) tens of MB from all workers at once,
// which serializes in the kernel; reused buffers are already mapped. One call at a time owns the
// shared workspace; a concurrent call gets a private one. A taken tensor does not own its bytes (one tensor
// object instead of three: this halved the fixed cost of a decode-sized call, 19 -> 9 us): each slot is taken
// at most once per call, and the workspace outlives the call's tensors.
class Workspace {
 public:
  enum Slot {
    kRows, kRowScale, kRowGsum,            // per token (step 2)
    kH, kHq, kHScale, kHGsum,              // per pair (steps 3, 4)
    kWorkerA, kWorkerScale, kWorkerGsum,   // per worker: a gate/up task's gathered rows
    kWorkerH, kWorkerC,                    // per worker: its h rows (fp32), kernel output
    kAcc,                                  // down accumulators [groups, T, H]
    kNumSlots
  };
  at::Tensor take(Slot slot, at::IntArrayRef shape, at::ScalarType dtype) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const int64_t bytes = std::max<int64_t>(1, n * static_cast<int64_t>(c10::elementSize(dtype)));
    at::Tensor& buf = slots_[slot];
    if (!buf.defined() || buf.numel() < bytes) buf = at::empty({bytes + bytes / 4}, at::TensorOptions().dtype(at::kByte));
    return at::from_blob(buf.data_ptr(), shape, at::TensorOptions().dtype(dtype));
  }

 private:
  at::Tensor slots_[kNumSlots];
};

Workspace& shared_workspace() {
  static Workspace ws;
  return ws;
}
std::mutex& shared_workspace_mutex() {
  static std::mutex m;
  return m;
}

// Row r of src ([R, C], any strides, bf16/fp16/fp32) as C floats. Plain C++: the driver holds no intrinsics.
void row_to_f32(const at::Tensor& src, int64_t r, float* dst) {
  const int64_t C = src.size(1), st = src.stride(1);
  switch (src.scalar_type()) {
    case at::kFloat: {
      const float* p = src.data_ptr<float>() + r * src.stride(0);
      for (int64_t c = 0; c < C; ++c) dst[c] = p[c * st];
      break;
    }
    case at::kBFloat16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>()) + r * src.stride(0);
      for (int64_t c = 0; c < C; ++c) {
        const uint32_t bits = static_cast<uint32_t>(p[c * st]) << 16;
        std::memcpy(dst + c, &bits, 4);
      }
      break;
    }
    default: {
      const at::Half* p = src.data_ptr<at::Half>() + r * src.stride(0);
      for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<float>(p[c * st]);
    }
  }
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// The bytes a claimed task will read (its weights), fetched into the waiting core's L2 while the task waits for
// the stages before it: with one token the tail of gate/up (a few tasks left, most cores idle) and the
// h quantization leave DRAM idle while every down task is already claimed; each waiter streams its own down
// weights meanwhile instead of spinning. A waiter issues a few lines between polls, so it starts its task as soon
// as it may, and at most `limit` bytes (kWaitPrefetchBytes).
class WaitPrefetch {
 public:
  explicit WaitPrefetch(size_t limit) : left_(limit) {}
  void add(const void* p, size_t bytes) {
    if (bytes > 0 && ranges_.size() < kMaxRanges) ranges_.push_back({static_cast<const char*>(p), bytes});
  }
  // Issues up to `lines` prefetches; false once there is nothing left to fetch.
  bool step(int lines) {
    for (; lines > 0; --lines) {
      while (next_ < ranges_.size() && offset_ >= ranges_[next_].bytes) {
        ++next_;
        offset_ = 0;
      }
      if (next_ == ranges_.size() || left_ < 64) return false;
      __builtin_prefetch(ranges_[next_].p + offset_, 0, 2);  // prefetcht1: to L2
      offset_ += 64;
      left_ -= 64;
    }
    return true;
  }

 private:
  static constexpr size_t kMaxRanges = 64;
  struct Range {
    const char* p;
    size_t bytes;
  };
  std::vector<Range> ranges_;
  size_t next_ = 0, offset_ = 0, left_;
};

// What a waiting task prefetches at most: 1 MiB, half the L2 of the device's cores; decode layers 3-5% faster on
// the device than with none (benchmarks/RESULTS.md, session 15: "Waiting tasks fetching their weights: 3-5%").
constexpr size_t kWaitPrefetchBytes = size_t{1024} << 10;

// A stage of a call: n independent tasks run(task, worker), which may start once every task of the stages in
// `after` has finished; `done` (optional) is called once, by the thread that finishes the stage's last task;
// `reads` (optional) lists the bytes a task will read, for WaitPrefetch.
struct Stage {
  const char* name = "";
  int64_t n = 0;
  std::function<void(int64_t, int)> run;
  std::vector<int> after;
  std::function<void()> done;
  std::function<void(int64_t, WaitPrefetch&)> reads = {};
};

// Runs a call's stages. one_dispatch: all of them in one dispatch of the pool, in list order, a task spinning
// first until the stages it comes after are finished. Tasks are pulled in index order and wait only on stages
// listed before their own, so every task a waiter waits for was pulled already by a running thread: no deadlock,
// and between stages no barrier of the pool (close the job, wait for the workers to leave it, wake them for the
// next), whose tail and wake-up a decode call paid once a phase. A task that throws ends the call: the tasks
// after it are counted without running (their waiters are released) and no `done` is called after it. Otherwise
// (a caller's quantize_h, which runs on the calling thread) one dispatch a stage, a one-task stage on the
// calling thread.
void run_stages(std::vector<Stage>& stages, bool one_dispatch, PhaseTimer& timer) {
  const int ns = static_cast<int>(stages.size());
  // Stages of one phase are named alike and listed together: the profile line has one entry a phase, at the end
  // of its last stage, unless none of its stages had tasks.
  auto phase_ends = [&](int i) { return i + 1 == ns || std::strcmp(stages[i + 1].name, stages[i].name) != 0; };
  if (!one_dispatch) {
    bool any = false;
    for (int i = 0; i < ns; ++i) {
      Stage& s = stages[i];
      runtime::parallel_tasks(s.n, s.run);
      if (s.done) s.done();
      any = any || s.n > 0;
      if (phase_ends(i)) {
        if (any) timer.mark(s.name);
        any = false;
      }
    }
    return;
  }
  std::vector<int64_t> first(ns + 1, 0);
  for (int i = 0; i < ns; ++i) first[i + 1] = first[i] + stages[i].n;
  std::unique_ptr<std::atomic<int64_t>[]> finished(new std::atomic<int64_t>[ns]);
  for (int i = 0; i < ns; ++i) finished[i].store(0, std::memory_order_relaxed);
  std::vector<PhaseTimer::Clock::time_point> end(ns);
  // a stage with no tasks and nothing to wait for is done before the dispatch (a part that routes no pair)
  for (Stage& s : stages) {
    bool ready = s.n == 0;
    for (int a : s.after) ready = ready && stages[a].n == 0;
    TORCH_INTERNAL_ASSERT(!s.done || s.n > 0 || ready, "fused_moe: an empty stage with a callback waits on work");
    if (ready && s.done) s.done();
  }
  std::atomic<bool> failed{false};
  const size_t prefetch_bytes = kWaitPrefetchBytes;
  runtime::parallel_tasks(first[ns], [&](int64_t task, int worker) {
    int s = 0;
    while (task >= first[s + 1]) ++s;
    const Stage& st = stages[s];
    std::optional<WaitPrefetch> prefetch;
    bool fetching = false;
    for (int a : st.after)
      for (int polls = 1; finished[a].load(std::memory_order_acquire) < stages[a].n; ++polls) {
        if (!prefetch && st.reads && prefetch_bytes > 0) {  // the first time this task waits
          prefetch.emplace(prefetch_bytes);
          st.reads(task - first[s], *prefetch);
          fetching = true;
        }
        if (fetching) fetching = prefetch->step(8);
        else cpu_relax();
        // a long wait means a thread holding an earlier task was preempted (more runnable threads than cores: the
        // GPU's launch and callback threads beside the pool); give this core up now and then so that it runs,
        // instead of a dozen waiters spinning until the scheduler's time slice ends (decode calls of 5-13 ms
        // seen on the H100 host, 48 layers with deferral)
        if (polls % runtime::kYieldPolls == 0) sched_yield();
      }
    auto finish = [&] {
      if (finished[s].fetch_add(1, std::memory_order_acq_rel) + 1 != st.n) return false;
      if (timer.on()) end[s] = PhaseTimer::Clock::now();
      return true;
    };
    if (!failed.load(std::memory_order_acquire)) {
      try {
        st.run(task - first[s], worker);
      } catch (...) {
        failed.store(true, std::memory_order_release);
        finish();
        throw;
      }
    }
    if (finish() && st.done && !failed.load(std::memory_order_acquire)) st.done();
  });
  if (!timer.on()) return;
  bool any = false;
  PhaseTimer::Clock::time_point at{};
  for (int i = 0; i < ns; ++i) {
    if (stages[i].n > 0) at = any ? std::max(at, end[i]) : end[i], any = true;
    if (phase_ends(i)) {
      if (any) timer.mark_at(stages[i].name, at);
      any = false;
    }
  }
}

// The training forward's additions (fused_moe_with_delta, fused_moe.h), all indexed by the (token, slot) pair
// t * K + k: deltas added to each routed pair's gate/up outputs before the epilogue, h written out, and the
// pre-activations the GLU read (biases and deltas included) written out for the backward.
struct Training {
  const void* delta = nullptr;  // [T * K, N13] (gate columns, then up columns; gateless: up), bf16 or fp32
  bool delta_bf16 = false;
  int64_t n13 = 0;
  void* h = nullptr;  // [T * K, I] of h_dtype (bf16, fp16 or fp32)
  at::ScalarType h_dtype = at::kBFloat16;
  void* gate_up = nullptr;  // [T * K, N13] of gate_up_dtype (bf16, fp16 or fp32), or nullptr
  at::ScalarType gate_up_dtype = at::kBFloat16;
};

// What the parts of a call share: the shapes, the kernels, each token's activation row and per-worker scratch.
struct Shared {
  const at::Tensor& hidden;
  at::ScalarType hdtype;
  int64_t T, H, I, E;
  WeightFormat fmt;
  bool int_fmt;
  PackedMatrix up, down;
  Activation act;
  const kernels::KernelSet& ks;
  int workers;
  const uint8_t* up_base;
  const float* up_scales;
  const uint8_t* down_base;
  const float* down_scales;
  // step 2: the rows (read in place, or made by the activations stage), one a_ld-strided copy per task row
  int64_t x_groups, x_row_bytes, x_row_stride, a_ld;
  const uint8_t* rows = nullptr;
  float* row_scale = nullptr;
  int32_t* row_gsum = nullptr;
  uint8_t* rows_out = nullptr;  // where the activations stage writes them (nullptr: read in place)
  int prefetch_ahead = 0;       // GemmArgs::prefetch_ahead (kPrefetchAhead)
  at::Tensor wf32, wa, wsc, wgs, wc;
  Epilogue ep;  // biases, activation, gated or not
  const Training* train = nullptr;  // the training forward's deltas and h output, or nullptr (inference)

  // the tokens some pair routes here (1), of either part; the activations stage skips the others, which no task
  // reads: a split's CPU share or a padded prefill routes few of its rows here (a CPU op of 2048 rows routing 32:
  // the activations 7.25 ms of 15.3 on the dev machine, 1.87 of 8.85 at 512 rows, before it skipped them)
  const uint8_t* routed = nullptr;

  // the activations stage: 16 tokens a task, each run of routed ones converted (and quantized) at once
  int64_t activation_tasks() const { return rows_out == nullptr ? 0 : (T + 15) / 16; }
  void activations(int64_t task, int worker) const {
    const int64_t t0 = task * 16, n = std::min<int64_t>(16, T - t0);
    float* f = wf32.data_ptr<float>() + worker * wf32.size(1);
    for (int64_t a = 0; a < n;) {
      if (!routed[t0 + a]) {
        ++a;
        continue;
      }
      int64_t b = a + 1;
      while (b < n && routed[t0 + b]) ++b;
      const int64_t r0 = t0 + a, m = b - a;
      for (int64_t i = 0; i < m; ++i) row_to_f32(hidden, r0 + i, f + i * H);
      if (int_fmt) {
        ks.quantize_rows(f, H, static_cast<int>(m), H, up.group_size(), reinterpret_cast<int8_t*>(rows_out) + r0 * H,
                         H, row_scale + r0, row_gsum + r0 * x_groups);
      } else {
        auto* dst = reinterpret_cast<uint16_t*>(rows_out) + r0 * H;
        for (int64_t i = 0; i < m * H; ++i) dst[i] = f32_to_bf16(f[i]);
      }
      a = b;
    }
  }
};

// One part of a call: the pairs that one set of ids routes, steps 1, 3 and 4 for them, into `out` [T, H].
class Part {
 public:
  // wp: the routing weights as fp32 [T, K], contiguous. Checks the ids (>= E is an error).
  Part(const Shared& s, const at::Tensor& topk_ids, const float* wp, at::Tensor out, Workspace& ws,
       bool caller_quantizes_h)
      : s_(s), out_(std::move(out)) {
    // ---- 1. route
    const int64_t T = s.T, E = s.E, K = topk_ids.size(1);
    const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
    const int64_t* idp = ids.data_ptr<int64_t>();
    offset_.assign(E + 1, 0);
    for (int64_t i = 0; i < T * K; ++i) {
      const int64_t e = idp[i];
      TORCH_CHECK(e < E, "fused_moe: topk_ids[", i / K, ", ", i % K, "] = ", e, " is out of range for ", E,
                  " experts (negative ids mean 'skip')");
      if (e >= 0) ++offset_[e + 1];
    }
    for (int64_t e = 0; e < E; ++e) offset_[e + 1] += offset_[e];
    P_ = offset_[E];
    if (P_ == 0) {
      out_.zero_();
      return;
    }
    pair_token_.resize(P_);
    pair_weight_.resize(P_);
    if (s.train != nullptr) pair_slot_.resize(P_);
    {
      std::vector<int64_t> fill(offset_.begin(), offset_.end() - 1);
      for (int64_t t = 0, i = 0; t < T; ++t)  // (token by token: no division by K per pair)
        for (int64_t k = 0; k < K; ++k, ++i) {
          const int64_t e = idp[i];
          if (e < 0) continue;
          const int64_t p = fill[e]++;
          pair_token_[p] = t;
          pair_weight_[p] = wp[i];
          if (s.train != nullptr) pair_slot_[p] = i;
        }
    }
    for (int64_t e = 0; e < E; ++e)
      if (offset_[e + 1] > offset_[e]) active_.push_back(e);

    // ---- 3. plan: chunks of an expert's tokens (equal, at most kGateUpRows) and channel ranges per chunk (1 when
    // the chunks alone give every worker several tasks)
    for (int64_t e : active_) {
      const int64_t cnt = offset_[e + 1] - offset_[e], pieces = (cnt + kGateUpRows - 1) / kGateUpRows;
      for (int64_t i = 0; i < pieces; ++i) {
        const int64_t a0 = cnt * i / pieces, a1 = cnt * (i + 1) / pieces;
        chunks_.push_back({e, offset_[e] + a0, a1 - a0});
      }
    }
    const int64_t I = s.I, nchunks = static_cast<int64_t>(chunks_.size());
    // kernel calls of 32 gate + 32 up columns = 4 packed 16-column blocks; gateless: 64 up columns (fewer in the last)
    ugroups_ = s.ep.gated ? I / 32 : (I + 63) / 64;
    splits_ = s.workers == 1 ? 1 : std::min(ugroups_, (kGateUpTasksPerWorker * s.workers + nchunks - 1) / nchunks);
    full_rows_ = splits_ == 1 && !caller_quantizes_h;  // a caller's quantize_h takes all of h at once
    separate_quantize_ = s.int_fmt && !full_rows_ && !caller_quantizes_h;
    // Down-projection expert groups (step 4), and the stage groups of the pipeline: with no pass quantizing all of
    // h between gate/up and down, each group's gate/up tasks and down tasks are stages of their own, the down
    // stage of group g waiting only for group g's gate/up. Workers pull the gate/up tasks of group 0, then of
    // group 1, ..., then the down tasks of group 0, ...: those run at once (group 0's h is done), so they fill the
    // tail of the last gate/up tasks, where every down task used to wait for all of them (one gate/up and one down
    // stage, as before: int8 T=512 4% slower in every pair on the device, the other rows 0-9% within the spread;
    // RESULTS.md, session 18, "The pipeline, side by side"). Sums and results are the same either way.
    groups_ = std::min<int64_t>(kDownGroups, E);
    const bool pipelined = !separate_quantize_ && !caller_quantizes_h;
    stage_groups_ = pipelined ? groups_ : 1;
    auto stage_group = [&](int64_t e) { return stage_groups_ == 1 ? 0 : e * groups_ / E; };
    // each stage group's chunks together, largest first within it (the dynamic schedule then ends on small tasks)
    std::stable_sort(chunks_.begin(), chunks_.end(), [&](const Chunk& a, const Chunk& b) {
      const int64_t ga = stage_group(a.e), gb = stage_group(b.e);
      return ga != gb ? ga < gb : a.n > b.n;
    });
    chunk_start_.assign(stage_groups_ + 1, nchunks);
    for (int64_t g = 0, i = 0; g < stage_groups_; ++g) {
      while (i < nchunks && stage_group(chunks_[i].e) < g) ++i;
      chunk_start_[g] = i;
    }
    // h: bf16 [P, I] (bf16 weights); int formats: int8 [P, I] + scale + group sums, through fp32 [P, I] when split
    h_ = ws.take(Workspace::kH, {!s.int_fmt ? P_ * I / 2 : (full_rows_ ? 1 : P_ * I)}, at::kFloat);
    if (s.int_fmt) {
      hq_ = ws.take(Workspace::kHq, {P_, I}, at::kChar);
      hs_ = ws.take(Workspace::kHScale, {P_}, at::kFloat);
      hg_ = ws.take(Workspace::kHGsum, {P_, s.down.groups}, at::kInt);
    }

    // ---- 4. plan. ranges: a few per worker on small machines, one per worker on larger ones (every range reads
    // all of h). groups: the experts by id halves, each with its own [T, H] fp32 accumulator: twice the tasks for
    // the same h traffic. Both are fixed by the shapes, never by the routing or the worker count, so every
    // token's sum runs in the same order (expert order within a group, then group 0 + group 1) whatever the
    // batch, the routing of other tokens or the number of workers.
    h_rows_.resize(P_);
    {
      const auto* base = s.int_fmt ? static_cast<const uint8_t*>(hq_.data_ptr()) : static_cast<const uint8_t*>(h_.data_ptr());
      h_row_bytes_ = s.int_fmt ? I : 2 * I;
      for (int64_t p = 0; p < P_; ++p) h_rows_[p] = base + p * h_row_bytes_;
    }
    const int64_t hblocks = s.H / 16, nactive = static_cast<int64_t>(active_.size());
    ranges_ = std::min<int64_t>(hblocks, s.workers <= 4 ? 2 * s.workers : s.workers);
    // The last down stage of the pipeline cuts each range into tail_ narrower ones, so that the call ends on shorter
    // tasks (the last stage's tasks start together when its gate/up ends, and the phase waits for the slowest of
    // them). Ranges only split columns: the sums are the same for any tail. By default 2 where the down calls are
    // memory-bound (at most kTailRows rows an expert on average: a narrower call streams the same weights) and 1
    // where they are compute-bound (narrower tile calls run slower: on the device Qwen3 T=2048 lost up to 9%, T=512
    // gained 0-18%; RESULTS.md, "Session 21").
    const int64_t tail = P_ <= kTailRows * nactive ? 2 : 1;
    tail_ = stage_groups_ > 1 ? std::max<int64_t>(1, std::min(tail, hblocks / ranges_)) : 1;
    fine_ = ranges_ * tail_;
    group_start_.assign(groups_ + 1, nactive);  // group g: active[group_start[g] .. group_start[g + 1])
    for (int64_t g = 0, i = 0; g < groups_; ++g) {
      while (i < nactive && active_[i] * groups_ < E * g) ++i;
      group_start_[g] = i;
    }
    acc_is_out_ = groups_ == 1 && out_.scalar_type() == at::kFloat;
    acc_ = acc_is_out_ ? out_ : ws.take(Workspace::kAcc, {groups_, T, s.H}, at::kFloat);
    // The first pair of each token in each group writes its accumulator row instead of adding to it (the
    // accumulators are never zeroed: at T=2048 that was 32 MB of stores a call); seen[g][t]: group g has a pair
    // of token t (rows of the others are stale and left out of the final sum).
    pair_first_.assign(P_, 0);
    seen_.assign(groups_ * T, 0);
    for (int64_t g = 0; g < groups_; ++g)
      for (int64_t i = group_start_[g]; i < group_start_[g + 1]; ++i)
        for (int64_t p = offset_[active_[i]]; p < offset_[active_[i] + 1]; ++p) {
          uint8_t& seen = seen_[g * T + pair_token_[p]];
          pair_first_[p] = seen == 0;
          seen = 1;
        }
    // the tokens some pair routes, ascending: the final sums visit only them, and the other rows are zeroed whole
    // (a prefill split hands the CPU op a few of T rows: T=2048 with 147 pairs summed all 2048 rows per column
    // range, ~3 ms of a 27 ms call on the 2-core dev machine)
    tokens_.clear();
    if (!acc_is_out_)  // (the output as accumulator zeroes its unseen rows itself, in down())
      for (int64_t t = 0; t < T; ++t)
        for (int64_t g = 0; g < groups_; ++g)
          if (seen_[g * T + t] != 0) {
            tokens_.push_back(t);
            break;
          }
    range_done_.reset(new std::atomic<int>[fine_]);
    for (int64_t f = 0; f < fine_; ++f) range_done_[f].store(0, std::memory_order_relaxed);
  }

  int64_t pairs() const { return P_; }
  int64_t experts() const { return static_cast<int64_t>(active_.size()); }
  // marks the tokens this part's pairs route (Shared::routed)
  void mark_routed(std::vector<uint8_t>& routed) const {
    for (int64_t p = 0; p < P_; ++p) routed[pair_token_[p]] = 1;
  }
  // Stage groups (see the plan): 1, or one per down group. Gate/up tasks of stage group g: first_gate_up_task(g)
  // + [0, gate_up_tasks(g)); down tasks: down_task(g, [0, down_tasks(g))).
  int64_t stage_groups() const { return stage_groups_; }
  int64_t gate_up_tasks(int64_t g) const { return (chunk_start_[g + 1] - chunk_start_[g]) * splits_; }
  int64_t first_gate_up_task(int64_t g) const { return chunk_start_[g] * splits_; }
  int64_t quantize_tasks() const { return separate_quantize_ ? (P_ + 15) / 16 : 0; }
  // A down task: group g's column ranges [f0, f1) of the fine grid (fine_ = ranges_ * tail_ ranges; a range of the
  // coarse grid is tail_ fine ones, so both grids cut H at the same places).
  struct DownTask {
    int64_t g, f0, f1;
  };
  int64_t down_tasks(int64_t g) const {
    return P_ == 0 ? 0 : stage_groups_ == 1 ? ranges_ * groups_ : g == stage_groups_ - 1 ? fine_ : ranges_;
  }
  DownTask down_task(int64_t g, int64_t task) const {
    if (stage_groups_ == 1) return {task % groups_, task / groups_ * tail_, (task / groups_ + 1) * tail_};
    if (g == stage_groups_ - 1) return {g, task, task + 1};
    return {g, task * tail_, (task + 1) * tail_};
  }

  // The task grids, shared by the tasks and by what they read (gate_up_reads, down_reads). Gate/up task `task`:
  // chunk chunks_[task / splits_], channel groups [g0, g1) of 32 gate + 32 up columns (4 packed blocks each).
  std::pair<int64_t, int64_t> gate_up_groups(int64_t task) const {
    const int64_t split = task % splits_;
    return {ugroups_ * split / splits_, ugroups_ * (split + 1) / splits_};
  }
  // The 4 packed w13 blocks of expert e's channel group g (the groups of an expert follow each other).
  const uint8_t* up_group(int64_t e, int64_t g) const {
    return s_.up_base + (e * (s_.up.N / 16) + 4 * g) * kernels::block_bytes(s_.up.fmt, s_.up.K);
  }
  // Fine ranges [f0, f1): the 16-column blocks [b0, b1) of H.
  std::pair<int64_t, int64_t> down_blocks(int64_t f0, int64_t f1) const {
    const int64_t hblocks = s_.H / 16;
    return {hblocks * f0 / fine_, hblocks * f1 / fine_};
  }
  // Packed w2 block b of expert e (the blocks of an expert follow each other).
  const uint8_t* down_block_at(int64_t e, int64_t b) const {
    return s_.down_base + (e * (s_.H / 16) + b) * kernels::block_bytes(s_.down.fmt, s_.down.K);
  }

  // ---- 3. gate + up + activation: h[p] = act(x_p W_gate^T) * (x_p W_up^T)
  void gate_up(int64_t task, int worker, GemmTimes& times) const {
    const Shared& s = s_;
    auto t_mark = times.start();
    const Chunk& ch = chunks_[task / splits_];
    const int64_t I = s.I;
    const auto [g0, g1] = gate_up_groups(task);
    // the chunk's rows, a_ld apart
    uint8_t* a_buf = s.wa.data_ptr<uint8_t>() + worker * s.wa.size(1);
    float* a_scale = s.wsc.data_ptr<float>() + worker * kGateUpRows;
    int32_t* a_gsum = s.wgs.data_ptr<int32_t>() + worker * s.wgs.size(1);
    const void* a_rows[kGateUpRows];
    for (int64_t m = 0; m < ch.n; ++m) {
      const int64_t t = pair_token_[ch.p0 + m];
      std::memcpy(a_buf + m * s.a_ld, s.rows + t * s.x_row_stride, s.x_row_bytes);
      a_rows[m] = a_buf + m * s.a_ld;
      if (s.int_fmt) {
        a_scale[m] = s.row_scale[t];
        std::copy(s.row_gsum + t * s.x_groups, s.row_gsum + (t + 1) * s.x_groups, a_gsum + m * s.x_groups);
      }
    }
    float* c = s.wc.data_ptr<float>() + worker * s.wc.size(1);
    float* hrows = s.wf32.data_ptr<float>() + worker * s.wf32.size(1);  // full rows: this task's h, fp32 [n, I]
    times.lap(worker, GemmTimes::kOther, t_mark);
    const size_t up_block = kernels::block_bytes(s.up.fmt, s.up.K);
    // The GLU of call g: h columns 32g.. (gateless: 64g..) of the chunk's rows from that call's c.
    const Epilogue& ep = s.ep;
    auto glu_of = [&](int64_t g, float* cg) {
      const int64_t h0 = ep.gated ? 32 * g : 64 * g;
      Glu u{&s.ks, cg, s.act, nullptr, nullptr, I};
      if (s.train != nullptr) {  // this call's delta columns, added before the epilogue; its pre-activations' columns
        u.train = s.train;
        u.slots = pair_slot_.data() + ch.p0;
        u.d_gate = ep.gated ? h0 : -1;
        u.d_up = ep.gated ? I + h0 : h0;
        u.nd = static_cast<int>(ep.gated ? 32 : std::min<int64_t>(64, I - h0));
      }
      if (!s.int_fmt) u.bf16 = static_cast<uint16_t*>(h_.data_ptr()) + ch.p0 * I + h0;
      else u.f32 = (full_rows_ ? hrows : h_.data_ptr<float>() + ch.p0 * I) + h0;
      if (!ep.kernel_glu()) {
        u.ep = &ep;
        u.n = static_cast<int>(ep.gated ? 32 : std::min<int64_t>(64, I - h0));
        if (ep.b13 != nullptr) {
          const float* b = ep.b13 + ch.e * (ep.gated ? 2 * I : I);
          u.bias_gate = ep.gated ? b + h0 : nullptr;
          u.bias_up = ep.gated ? b + I + h0 : b + h0;
        }
      }
      return u;
    };
    // blocks of call g: 4, but the last call of gateless experts covers what is left of I
    auto blocks_of = [&](int64_t g) { return ep.gated ? 4 : static_cast<int>(std::min<int64_t>(4, (I - 64 * g) / 16)); };
    // With overlap the GLU of call g is side work of call g + 1 (the AMX walks run it beside their tile products);
    // c alternates between two halves of the worker's buffer. Same GLU, same values either way. Only where the GLU
    // writes the worker's own rows (int formats, full rows): its stores into the shared h (bf16, or split
    // channels) miss the caches and held the tiles up (bf16 T=2048 1-6% slower on the device; RESULTS.md).
    const bool overlap = s.int_fmt && full_rows_;
    Glu pending;
    bool has_pending = false;
    for (int64_t g = g0; g < g1; ++g) {
      float* cg = c + ((g - g0) & 1) * kGateUpC;
      kernels::GemmArgs a;
      a.M = static_cast<int>(ch.n);
      a.K = s.up.K;
      a.a_rows = a_rows;
      if (s.int_fmt) {
        a.a_scale = a_scale;
        a.a_gsum = a_gsum;
        a.a_gsum_stride = s.x_groups;
        a.group_size = s.up.group_size();
        set_b_scales(a, s.up, s.up_scales, ch.e, 64 * g, 16 * blocks_of(g));
        a.b_codes = s.up.codes;
      }
      a.b = up_group(ch.e, g);
      a.prefetch_ahead = s.prefetch_ahead;
      a.b_block_stride = up_block;
      a.nblocks = blocks_of(g);
      if (g + 1 < g1 && blocks_of(g + 1) == a.nblocks) a.next_b = a.b + 4 * up_block;
      a.c = cg;
      a.ldc = 64;
      kernels::SideWork side;
      if (has_pending) {
        side.run = &Glu::run;
        side.ctx = &pending;
        side.units = a.M;
        a.side = &side;
      }
      s.ks.gemm[static_cast<int>(s.up.fmt)](a);
      times.lap(worker, GemmTimes::kKernel, t_mark);
      if (has_pending && side.done < side.units) Glu::run(&pending, side.done, side.units);
      pending = glu_of(g, cg);
      has_pending = overlap && g + 1 < g1;
      if (!has_pending) Glu::run(&pending, 0, a.M);
      times.lap(worker, GemmTimes::kEpilogue, t_mark);
    }
    if (s.train != nullptr && s.train->h != nullptr) {  // the training forward: this task's h, before quantization
      const int64_t c0 = ep.gated ? 32 * g0 : 64 * g0, c1 = std::min<int64_t>(I, ep.gated ? 32 * g1 : 64 * g1);
      for (int64_t m = 0; m < ch.n; ++m) {
        const int64_t p = ch.p0 + m;
        if (!s.int_fmt) store_h(static_cast<const uint16_t*>(h_.data_ptr()) + p * I + c0, nullptr, c1 - c0, p, c0);
        else store_h(nullptr, (full_rows_ ? hrows + m * I : h_.data_ptr<float>() + p * I) + c0, c1 - c0, p, c0);
      }
    }
    if (s.int_fmt && full_rows_)
      s.ks.quantize_rows(hrows, I, static_cast<int>(ch.n), I, s.down.group_size(), hq_.data_ptr<int8_t>() + ch.p0 * I,
                         I, hs_.data_ptr<float>() + ch.p0, hg_.data_ptr<int32_t>() + ch.p0 * s.down.groups);
    times.lap(worker, GemmTimes::kEpilogue, t_mark);
  }

  // The training forward's h output: n channels of pair p's h (bf16 or fp32 source) into its row of train->h from
  // channel c0, in train->h's dtype (fp32 rounded once to nearest even for bf16).
  void store_h(const uint16_t* bf16, const float* f32, int64_t n, int64_t p, int64_t c0) const {
    const Training& tr = *s_.train;
    const int64_t off = pair_slot_[p] * s_.I + c0;
    switch (tr.h_dtype) {
      case at::kBFloat16: {
        uint16_t* dst = static_cast<uint16_t*>(tr.h) + off;
        if (bf16 != nullptr) std::memcpy(dst, bf16, n * 2);
        else store_bf16_row(dst, f32, nullptr, n);
        break;
      }
      case at::kHalf: {
        at::Half* dst = static_cast<at::Half*>(tr.h) + off;
        for (int64_t j = 0; j < n; ++j) dst[j] = static_cast<at::Half>(bf16 != nullptr ? bf16_to_f32(bf16[j]) : f32[j]);
        break;
      }
      default: {
        float* dst = static_cast<float*>(tr.h) + off;
        if (f32 != nullptr) std::memcpy(dst, f32, n * 4);
        else for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_f32(bf16[j]);
      }
    }
  }

  // What gate_up(task) reads from the weights: its chunk's expert, its channel groups (4 blocks each, contiguous).
  void gate_up_reads(int64_t task, WaitPrefetch& pf) const {
    const int64_t e = chunks_[task / splits_].e;
    const auto [g0, g1] = gate_up_groups(task);
    pf.add(up_group(e, g0), up_group(e, g1) - up_group(e, g0));
  }

  // What down(task) reads from the weights: its column range of each expert of its group.
  void down_reads(const DownTask& task, WaitPrefetch& pf) const {
    const int64_t g = task.g;
    const auto [b0, b1] = down_blocks(task.f0, task.f1);
    for (int64_t i = group_start_[g]; i < group_start_[g + 1]; ++i)
      pf.add(down_block_at(active_[i], b0), down_block_at(active_[i], b1) - down_block_at(active_[i], b0));
  }

  // h quantized when the channels were split over tasks: 16 rows a task
  void quantize(int64_t task) const {
    const int64_t p0 = task * 16, n = std::min<int64_t>(16, P_ - p0), I = s_.I;
    s_.ks.quantize_rows(h_.data_ptr<float>() + p0 * I, I, static_cast<int>(n), I, s_.down.group_size(),
                        hq_.data_ptr<int8_t>() + p0 * I, I, hs_.data_ptr<float>() + p0,
                        hg_.data_ptr<int32_t>() + p0 * s_.down.groups);
  }
  void quantize_with(const QuantizeH& quantize_h) const {
    quantize_h(h_.data_ptr<float>(), P_, s_.I, s_.down.group_size(), hq_.data_ptr<int8_t>(), hs_.data_ptr<float>(),
               hg_.data_ptr<int32_t>());
  }

  // ---- 4. down projection + weighted sum into each token's row: task = (group, range of output columns)
  void down(const DownTask& task, int worker, GemmTimes& times) const {
    const Shared& s = s_;
    auto t_mark = times.start();
    const int64_t T = s.T, H = s.H;
    const int64_t g = task.g;
    const auto [b0, b1] = down_blocks(task.f0, task.f1);
    const int64_t c0 = 16 * b0, c1 = 16 * b1;
    float* accp = acc_.data_ptr<float>();
    float* accg = accp + g * T * H;
    if (acc_is_out_)  // the output itself: rows no pair writes are zeros
      for (int64_t t = 0; t < T; ++t)
        if (seen_[t] == 0) std::fill(accg + t * H + c0, accg + t * H + c1, 0.0f);
    float* c = s.wc.data_ptr<float>() + worker * s.wc.size(1);
    const size_t down_block = kernels::block_bytes(s.down.fmt, s.down.K);
    times.lap(worker, GemmTimes::kOther, t_mark);
    // (the weighted scatter right after each call: run as side work of the next call, between its tile steps, it
    // made the layer slower, int8 T=2048 16.7 ms against 14.5: stores that miss hold up the tile loads; RESULTS.md)
    for (int64_t i = group_start_[g]; i < group_start_[g + 1]; ++i) {
      const int64_t e = active_[i];
      for (int64_t p0 = offset_[e]; p0 < offset_[e + 1]; p0 += kDownRows) {
        const int M = static_cast<int>(std::min(kDownRows, offset_[e + 1] - p0));
        for (int64_t cb = b0; cb < b1; cb += kernels::kMaxBlocks) {
          kernels::GemmArgs a;
          a.M = M;
          a.K = s.down.K;
          a.a_rows = h_rows_.data() + p0;
          if (s.int_fmt) {
            a.a_scale = hs_.data_ptr<float>() + p0;
            a.a_gsum = hg_.data_ptr<int32_t>() + p0 * s.down.groups;
            a.a_gsum_stride = s.down.groups;
            a.group_size = s.down.group_size();
            set_b_scales(a, s.down, s.down_scales, e, 16 * cb, 16 * std::min<int64_t>(kernels::kMaxBlocks, b1 - cb));
            a.b_codes = s.down.codes;
          }
          a.b = down_block_at(e, cb);
          a.prefetch_ahead = s.prefetch_ahead;
          a.b_block_stride = down_block;
          a.nblocks = static_cast<int>(std::min<int64_t>(kernels::kMaxBlocks, b1 - cb));
          if (cb + kernels::kMaxBlocks < b1) {
            a.next_b = a.b + kernels::kMaxBlocks * down_block;
          } else {  // the next call reads other h rows: this expert's next rows, or the next expert's
            int64_t next_p = -1, next_end = 0;
            if (p0 + kDownRows < offset_[e + 1]) {
              next_p = p0 + kDownRows, next_end = offset_[e + 1];
            } else if (i + 1 < group_start_[g + 1]) {
              a.next_b = down_block_at(active_[i + 1], b0);
              next_p = offset_[active_[i + 1]], next_end = offset_[active_[i + 1] + 1];
            }
            if (next_p >= 0) {  // (h rows follow each other: pairs are grouped by expert)
              a.next_a = static_cast<const uint8_t*>(h_rows_[next_p]);
              a.next_a_bytes = std::min(kDownRows, next_end - next_p) * h_row_bytes_;
            }
          }
          a.c = c;
          a.ldc = kDownCols;
          s.ks.gemm[static_cast<int>(s.down.fmt)](a);
          times.lap(worker, GemmTimes::kKernel, t_mark);
          if (s.ep.b2 != nullptr) {  // the expert's down bias, before the routing weight scales the row
            const float* b = s.ep.b2 + e * H + 16 * cb;
            const int64_t n = 16 * a.nblocks;
            for (int m = 0; m < M; ++m)
              for (int64_t j = 0; j < n; ++j) c[m * kDownCols + j] += b[j];
          }
          s.ks.scatter_add(c, kDownCols, M, 16 * a.nblocks, pair_weight_.data() + p0, pair_token_.data() + p0,
                           pair_first_.data() + p0, accg + 16 * cb, H);
          times.lap(worker, GemmTimes::kEpilogue, t_mark);
        }
      }
    }
    // the last group task of each fine range sums the groups that have the token, in group order, into the output
    if (acc_is_out_) return;
    for (int64_t f = task.f0; f < task.f1; ++f) {
      if (range_done_[f].fetch_add(1, std::memory_order_acq_rel) != groups_ - 1) continue;
      const auto [fb0, fb1] = down_blocks(f, f + 1);
      const int64_t fc0 = 16 * fb0, fc1 = 16 * fb1;
      const int64_t es = out_.element_size();
      auto* out = static_cast<char*>(out_.data_ptr()) + fc0 * es;
      const float* src[kDownGroups];
      for (const int64_t t : tokens_) {
        int n = 0;  // the groups that have the token, in group order (at least one)
        for (int64_t gg = 0; gg < groups_; ++gg)
          if (seen_[gg * T + t] != 0) src[n++] = accp + (gg * T + t) * H + fc0;
        store_row_sum(s.ks, src, n, fc1 - fc0, out_.scalar_type(), out + t * H * es);
      }
      // rows no pair routes are zeros: range f zeroes those among its share of the tokens, whole rows at a time
      // (no other task writes them)
      const int64_t t0 = T * f / fine_, t1 = T * (f + 1) / fine_;
      auto* base = static_cast<char*>(out_.data_ptr());
      auto next = std::lower_bound(tokens_.begin(), tokens_.end(), t0);  // the next routed token
      for (int64_t a = t0; a < t1;) {
        const int64_t b = next == tokens_.end() ? t1 : std::min(*next++, t1);
        if (b > a) std::memset(base + a * H * es, 0, static_cast<size_t>((b - a) * H * es));
        a = b + 1;
      }
    }
    times.lap(worker, GemmTimes::kOther, t_mark);
  }

 private:
  struct Chunk {
    int64_t e, p0, n;
  };
  // The GLU of one gate/up kernel call (32 gate + 32 up columns, c with 64 columns a row) into h, fp32 or bf16
  // (ldo elements a row); as kernels::SideWork, rows [r0, r1).
  // With ep set (anything but the kernels' plain GLU) the driver's Epilogue makes n columns of h: gated, from the
  // 32 gate and 32 up columns of c; gateless, from its first n (up) columns; bias_gate/bias_up: those columns'
  // biases, or nullptr.
  struct Glu {
    const kernels::KernelSet* ks = nullptr;
    float* c = nullptr;  // (the worker's own buffer: the training forward adds its deltas in place)
    Activation act = Activation::SiLU;
    float* f32 = nullptr;
    uint16_t* bf16 = nullptr;
    int64_t ldo = 0;
    const Epilogue* ep = nullptr;
    int n = 32;
    const float* bias_gate = nullptr;
    const float* bias_up = nullptr;
    // The training forward (train set): row r's deltas, row slots[r] of train->delta, its columns d_gate.. into
    // c's 32 gate columns (gated) and d_up.. into its nd up columns (gateless: c's first nd columns), added to c
    // before the epilogue reads it, so the kernels' GLU and the driver's epilogue both see them.
    const Training* train = nullptr;
    const int64_t* slots = nullptr;
    int64_t d_gate = -1, d_up = 0;
    int nd = 0;
    static void run(void* self, int64_t r0, int64_t r1) {
      const Glu& u = *static_cast<const Glu*>(self);
      const int rows = static_cast<int>(r1 - r0);
      if (u.train != nullptr && u.train->delta != nullptr) u.add_delta(r0, r1);
      if (u.train != nullptr && u.train->gate_up != nullptr) u.store_gate_up(r0, r1);
      if (u.ep != nullptr) return u.run_epilogue(r0, r1);
      if (u.bf16 != nullptr) u.ks->glu_bf16(u.c + r0 * 64, 64, rows, 32, u.act, u.bf16 + r0 * u.ldo, u.ldo);
      else u.ks->glu_f32(u.c + r0 * 64, 64, rows, 32, u.act, u.f32 + r0 * u.ldo, u.ldo);
    }
    void add_delta(int64_t r0, int64_t r1) const {
      if (train->delta_bf16) add_delta_as(static_cast<const uint16_t*>(train->delta), r0, r1);
      else add_delta_as(static_cast<const float*>(train->delta), r0, r1);
    }
    template <typename D>  // the deltas' element: bf16 bits or fp32
    void add_delta_as(const D* delta, int64_t r0, int64_t r1) const {
      const int up_at = d_gate >= 0 ? 32 : 0;
      for (int64_t r = r0; r < r1; ++r) {
        float* cr = c + r * 64;
        const D* d = delta + slots[r] * train->n13;
        if (d_gate >= 0) add_row(cr, d + d_gate, 32);
        add_row(cr + up_at, d + d_up, nd);
      }
    }
    // The training forward's pre-activations: c's gate and up columns of rows [r0, r1) with their biases (what the
    // epilogue or the kernels' GLU reads) into the same columns of train->gate_up as the deltas came from, rounded
    // once to its dtype.
    void store_gate_up(int64_t r0, int64_t r1) const {
      const int up_at = d_gate >= 0 ? 32 : 0;
      if (train->gate_up_dtype == at::kBFloat16) {  // (the training dtype) straight from c, biases (or +0) added
        static constexpr float kZeros[64] = {};
        const float* bg = bias_gate != nullptr ? bias_gate : kZeros;
        const float* bu = bias_up != nullptr ? bias_up : kZeros;
        uint16_t* out = static_cast<uint16_t*>(train->gate_up);
        for (int64_t r = r0; r < r1; ++r) {
          const float* cr = c + r * 64;
          const int64_t row = slots[r] * train->n13;
          if (d_gate >= 0) store_bf16_row(out + row + d_gate, cr, bg, 32);
          store_bf16_row(out + row + d_up, cr + up_at, bu, nd);
        }
        return;
      }
      float v[64];
      for (int64_t r = r0; r < r1; ++r) {
        const float* cr = c + r * 64;
        int n = 0;
        if (d_gate >= 0)
          for (int i = 0; i < 32; ++i) v[n++] = cr[i] + (bias_gate != nullptr ? bias_gate[i] : 0.0f);
        for (int i = 0; i < nd; ++i) v[n++] = cr[up_at + i] + (bias_up != nullptr ? bias_up[i] : 0.0f);
        const int64_t row = slots[r] * train->n13;
        if (d_gate >= 0) store_row(v, 32, row + d_gate);
        store_row(v + up_at, nd, row + d_up);
      }
    }
    void store_row(const float* v, int n, int64_t at) const {
      switch (train->gate_up_dtype) {
        case at::kBFloat16: {
          uint16_t* dst = static_cast<uint16_t*>(train->gate_up) + at;
          for (int i = 0; i < n; ++i) dst[i] = f32_to_bf16(v[i]);
          break;
        }
        case at::kHalf: {
          at::Half* dst = static_cast<at::Half*>(train->gate_up) + at;
          for (int i = 0; i < n; ++i) dst[i] = static_cast<at::Half>(v[i]);
          break;
        }
        default: std::memcpy(static_cast<float*>(train->gate_up) + at, v, n * sizeof(float));
      }
    }
    void run_epilogue(int64_t r0, int64_t r1) const {
      const Epilogue& e = *ep;
      float h[64];
      for (int64_t r = r0; r < r1; ++r) {
        const float* cr = c + r * 64;
        if (e.gated) {
          for (int i = 0; i < n; ++i) {
            const float g = cr[i] + (bias_gate != nullptr ? bias_gate[i] : 0.0f);
            const float v = cr[32 + i] + (bias_up != nullptr ? bias_up[i] : 0.0f);
            h[i] = e.glu1(g, v);
          }
        } else {
          for (int i = 0; i < n; ++i) h[i] = Epilogue::act1(e.act, cr[i] + (bias_up != nullptr ? bias_up[i] : 0.0f));
        }
        if (bf16 != nullptr) {
          for (int i = 0; i < n; ++i) bf16[r * ldo + i] = f32_to_bf16(h[i]);
        } else {
          std::memcpy(f32 + r * ldo, h, n * sizeof(float));
        }
      }
    }
  };
  const Shared& s_;
  at::Tensor out_;
  int64_t P_ = 0;
  std::vector<int64_t> offset_, pair_token_, active_;
  std::vector<int64_t> pair_slot_;  // training forward only: each pair's t * K + k (the delta and h rows)
  std::vector<float> pair_weight_;
  std::vector<Chunk> chunks_;
  std::vector<int64_t> chunk_start_ = {0, 0};  // stage group g: chunks_[chunk_start_[g] .. chunk_start_[g + 1])
  int64_t stage_groups_ = 1;
  int64_t ugroups_ = 0, splits_ = 1;
  bool full_rows_ = false, separate_quantize_ = false;
  at::Tensor h_, hq_, hs_, hg_, acc_;
  std::vector<const void*> h_rows_;  // the down projection's input rows, h_row_bytes_ apart (pairs in expert order)
  int64_t h_row_bytes_ = 0;
  int64_t ranges_ = 1, groups_ = 1, tail_ = 1, fine_ = 1;  // fine_ = ranges_ * tail_ (kTailRows)
  std::vector<int64_t> group_start_;
  bool acc_is_out_ = false;
  std::vector<uint8_t> pair_first_, seen_;
  std::vector<int64_t> tokens_;  // the tokens some pair routes, ascending
  std::unique_ptr<std::atomic<int>[]> range_done_;
};

}  // namespace

ActivationSpec parse_activation(c10::string_view spec) {
  const Epilogue ep = parse_epilogue(spec);
  return {ep.act, ep.alpha, ep.limit, ep.gate_cap, ep.up_cap};
}

void store_row_sum(const kernels::KernelSet& ks, const float* const* src, int n_src, int64_t n, at::ScalarType dtype,
                   void* dst) {
  if (dtype != at::kHalf) return ks.sum_rows(src, n_src, n, dtype == at::kBFloat16, dst);
  thread_local std::vector<float> row;
  row.resize(n);
  ks.sum_rows(src, n_src, n, false, row.data());
  at::Half* o = static_cast<at::Half*>(dst);
  for (int64_t j = 0; j < n; ++j) o[j] = static_cast<at::Half>(row[j]);
}

namespace {

// The checks every entry point makes; returns the weight format.
WeightFormat check_call(const at::Tensor& hidden_in, const at::Tensor& topk_ids_in, const at::Tensor& topk_weights_in,
                        const at::Tensor& w13, const at::Tensor& w2) {
  TORCH_CHECK(hidden_in.device().is_cpu(), "fused_moe: hidden must be a CPU tensor, got device ", hidden_in.device());
  TORCH_CHECK(hidden_in.dim() == 2, "fused_moe: hidden must be [T, H] (2-D), got shape ", hidden_in.sizes());
  const auto hdtype = hidden_in.scalar_type();
  TORCH_CHECK(hdtype == at::kBFloat16 || hdtype == at::kFloat || hdtype == at::kHalf,
              "fused_moe: hidden must be bfloat16, float16 or float32, got ", hdtype);
  TORCH_CHECK(topk_ids_in.device().is_cpu() && topk_weights_in.device().is_cpu(),
              "fused_moe: topk_ids and topk_weights must be CPU tensors, got ", topk_ids_in.device(), " and ",
              topk_weights_in.device());
  TORCH_CHECK(topk_ids_in.scalar_type() == at::kInt || topk_ids_in.scalar_type() == at::kLong,
              "fused_moe: topk_ids must be int32 or int64, got ", topk_ids_in.scalar_type());
  TORCH_CHECK(topk_weights_in.is_floating_point(), "fused_moe: topk_weights must be floating point, got ",
              topk_weights_in.scalar_type());
  const int64_t T = hidden_in.size(0);
  TORCH_CHECK(topk_ids_in.dim() == 2 && topk_ids_in.size(0) == T, "fused_moe: topk_ids must be [T=", T,
              ", K], got shape ", topk_ids_in.sizes());
  TORCH_CHECK(topk_weights_in.sizes() == topk_ids_in.sizes(), "fused_moe: topk_weights must have the shape of topk_ids ",
              topk_ids_in.sizes(), ", got ", topk_weights_in.sizes());
  const WeightFormat fmt = format_of(w13, "w13");
  const WeightFormat fmt2 = format_of(w2, "w2");
  // int8 with int4 is allowed (both take int8 activations: a GGUF Q4_K_M layer, Q4_K gate/up with Q6_K down)
  TORCH_CHECK(fmt2 == fmt || (fmt != WeightFormat::BF16 && fmt2 != WeightFormat::BF16),
              "fused_moe: w13 and w2 must both be bf16 or both quantized (int8/int4), got ", w13.scalar_type(), " and ",
              w2.scalar_type());
  return fmt;
}

Workspace& second_shared_workspace() {
  static Workspace ws;
  return ws;
}

// A call in one or two parts (out_later defined: the pairs of ids_later into out_later, after out_now is
// published with on_now). Both outputs are contiguous [T, H] tensors of hidden's dtype or fp32 (fp32_out of
// fused_moe_with_h_quantizer).
// fmt: what check_call, which the entry point ran, returned.
void run_call(WeightFormat fmt, const at::Tensor& hidden_in, const at::Tensor& ids_now, const at::Tensor* ids_later,
              const at::Tensor& topk_weights_in, const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales,
              const at::Tensor& w2, const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
              const QuantizeH& quantize_h, const at::Tensor& out_now, const at::Tensor* out_later,
              const std::function<void()>& on_now, const std::optional<at::Tensor>& w13_bias,
              const std::optional<at::Tensor>& w2_bias, const Training* train = nullptr) {
  const PackedMatrix up = describe(w13, w13_scales, fmt, "w13", "w13_scales");
  const PackedMatrix down = describe(w2, w2_scales, format_of(w2, "w2"), "w2", "w2_scales");
  // gated: w13 is [E, 2I, H] packed with gate_up=True; gateless: [E, I, H] (up only), packed with gate_up=False
  const bool gated = up.N != down.K;
  const int64_t T = hidden_in.size(0), H = hidden_in.size(1), E = up.E, I = gated ? up.N / 2 : up.N;
  TORCH_CHECK(down.E == E, "fused_moe: w13 has ", E, " experts but w2 has ", down.E);
  TORCH_CHECK(!gated || up.N % 64 == 0, "fused_moe: w13 must be packed with gate_up=True (2I a multiple of 64), got N=",
              up.N);
  TORCH_CHECK(up.K == H && down.N == H, "fused_moe: hidden size mismatch: hidden has H=", H, ", w13 expects K=", up.K,
              ", w2 produces N=", down.N);
  TORCH_CHECK(down.K == I, "fused_moe: intermediate size mismatch: w13 gives I=", I, " (N/2; gateless experts: N), w2 ",
              "expects K=", down.K);
  TORCH_CHECK(I % 32 == 0, "fused_moe: the intermediate size I=", I, " must be a multiple of 32");
  Epilogue ep = parse_epilogue(activation);
  ep.gated = gated;
  TORCH_CHECK(gated || (ep.act != Act::SwigluOai && ep.act != Act::SiluClamped && ep.act != Act::SoftcapSwiglu),
              "fused_moe: activation '", std::string(activation), "' needs a gate, but w13 holds only up projections ",
              "(N=", up.N, " equals w2's K: gateless experts)");
  auto bias_of = [&](const std::optional<at::Tensor>& b, const char* name, int64_t n) -> const float* {
    if (!b.has_value()) return nullptr;
    TORCH_CHECK(b->device().is_cpu() && b->scalar_type() == at::kFloat && b->is_contiguous() && b->dim() == 2 &&
                    b->size(0) == E && b->size(1) == n,
                "fused_moe: ", name, " must be a contiguous float32 CPU tensor [E=", E, ", ", n, "], got ",
                b->scalar_type(), " ", b->sizes(), " on ", b->device());
    return b->data_ptr<float>();
  };
  ep.b13 = bias_of(w13_bias, gated ? "w13_bias (gate biases, then up biases)" : "w13_bias (up biases)", gated ? 2 * I : I);
  ep.b2 = bias_of(w2_bias, "w2_bias", H);
  const Activation act = ep.kernel_glu() ? ep.kernel_act() : Activation::SiLU;
  PhaseTimer timer;

  std::unique_lock<std::mutex> ws_lock(shared_workspace_mutex(), std::try_to_lock);
  Workspace private_ws, private_ws2;
  Workspace& ws = ws_lock.owns_lock() ? shared_workspace() : private_ws;
  Workspace& ws2 = ws_lock.owns_lock() ? second_shared_workspace() : private_ws2;
  const kernels::KernelSet& ks = runtime::select_kernels();
  // Nothing routed here (T = 0, or every slot negative: a decode step whose experts are all resident on the GPU,
  // ktorch.gpu_memory): zeros, without waking the pool.
  auto any_routed = [](const at::Tensor& ids_any) {
    const at::Tensor ids = ids_any.contiguous();
    const int64_t n = ids.numel();
    if (ids.scalar_type() == at::kInt) {
      const int32_t* p = ids.data_ptr<int32_t>();
      for (int64_t i = 0; i < n; ++i)
        if (p[i] >= 0) return true;
    } else {
      const int64_t* p = ids.data_ptr<int64_t>();
      for (int64_t i = 0; i < n; ++i)
        if (p[i] >= 0) return true;
    }
    return false;
  };
  if (T == 0 || ids_now.size(1) == 0 ||
      (!train && !any_routed(ids_now) && (ids_later == nullptr || !any_routed(*ids_later)))) {
    out_now.zero_();
    if (on_now) on_now();
    if (out_later != nullptr) out_later->zero_();
    return;
  }
  const int workers = runtime::num_workers();
  timer.mark("setup");

  const bool int_fmt = fmt != WeightFormat::BF16;
  const bool caller_quantizes_h = int_fmt && quantize_h;  // bf16 weights have no h to quantize (fused_moe.h)
  Shared s{hidden_in, hidden_in.scalar_type(), T, H, I, E, fmt, int_fmt, up, down, act, ks, workers,
           static_cast<const uint8_t*>(w13.data_ptr()),
           w13_scales ? static_cast<const float*>(w13_scales->data_ptr()) : nullptr,  // (two-level: bytes, describe)
           static_cast<const uint8_t*>(w2.data_ptr()),
           w2_scales ? static_cast<const float*>(w2_scales->data_ptr()) : nullptr,
           int_fmt ? up.groups : 1, int_fmt ? H : 2 * H, 0, 0};
  s.ep = ep;
  s.train = train;
  TORCH_INTERNAL_ASSERT(train == nullptr || (ids_later == nullptr && !caller_quantizes_h &&
                                             train->n13 == (gated ? 2 * I : I)));
  s.prefetch_ahead = kPrefetchAhead;
  // ---- 1. route (each part)
  const at::Tensor wts = topk_weights_in.to(at::kFloat).contiguous();
  Part now(s, ids_now, wts.data_ptr<float>(), out_now, ws, caller_quantizes_h);
  std::optional<Part> later;
  if (ids_later != nullptr) later.emplace(s, *ids_later, wts.data_ptr<float>(), *out_later, ws2, false);
  if (now.pairs() == 0 && (!later || later->pairs() == 0)) {  // outputs zeroed by the parts
    if (on_now) on_now();
    return;
  }
  timer.mark("route");

  // ---- 2. each routed token's activation row once: bf16, or int8 with a scale and group sums (int formats)
  std::vector<uint8_t> routed;
  s.wf32 = ws.take(Workspace::kWorkerH, {workers, std::max(kGateUpRows * I, 16 * H)}, at::kFloat);
  if (!int_fmt && s.hdtype == at::kBFloat16 && hidden_in.stride(1) == 1) {
    s.rows = static_cast<const uint8_t*>(hidden_in.data_ptr());  // rows read in place (any row stride)
    s.x_row_stride = hidden_in.stride(0) * 2;
  } else {
    s.rows_out = ws.take(Workspace::kRows, {T, s.x_row_bytes}, at::kByte).data_ptr<uint8_t>();
    s.rows = s.rows_out;
    s.row_scale = ws.take(Workspace::kRowScale, {T}, at::kFloat).data_ptr<float>();
    s.row_gsum = ws.take(Workspace::kRowGsum, {T, s.x_groups}, at::kInt).data_ptr<int32_t>();
    s.x_row_stride = s.x_row_bytes;
    routed.assign(T, 0);  // from the parts' routing (step 1), not the ids again
    now.mark_routed(routed);
    if (later) later->mark_routed(routed);
    s.routed = routed.data();
  }
  // A task's rows are a_ld apart: one 64-byte line more than the row, so that the 16 rows an AMX tile load
  // reads in place do not share one or two L1 sets (H = 2048: rows 2048 (int8) or 4096 (bf16) bytes apart
  // fall into 2 or 1 of the 64 sets of a 12-way L1, and evict each other and the weights).
  s.a_ld = (s.x_row_bytes + 63) / 64 * 64 + 64;
  s.wa = ws.take(Workspace::kWorkerA, {workers, kGateUpRows * s.a_ld}, at::kByte);
  s.wsc = ws.take(Workspace::kWorkerScale, {workers, kGateUpRows}, at::kFloat);
  s.wgs = ws.take(Workspace::kWorkerGsum, {workers, kGateUpRows * s.x_groups}, at::kInt);
  s.wc = ws.take(Workspace::kWorkerC, {workers, kWorkerC}, at::kFloat);

  // ---- 3, 4 for each part, as stages: activations; then per part gate/up, h quantization, down
  GemmTimes gu_times(timer.on(), workers), down_times(timer.on(), workers);
  std::vector<Stage> stages;
  stages.push_back({"activations", s.activation_tasks(), [&s](int64_t t, int w) { s.activations(t, w); }, {}, {}});
  // (the stages of one phase share its name: the profile line has one wall time a phase)
  auto add_part = [&](const Part& part, bool first, const std::function<void()>& done) {
    const int64_t groups = part.stage_groups();
    const int gu = static_cast<int>(stages.size());
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t off = part.first_gate_up_task(g);
      stages.push_back({first ? "gate_up" : "gate_up.later", part.gate_up_tasks(g),
                        [&part, &gu_times, off](int64_t t, int w) { part.gate_up(off + t, w, gu_times); }, {0}, {},
                        [&part, off](int64_t t, WaitPrefetch& pf) { part.gate_up_reads(off + t, pf); }});
    }
    // down stage g waits for stage before_down + g: its group's gate/up, or the pass quantizing all of h (one stage
    // group then)
    int before_down = gu;
    if (first && caller_quantizes_h) {
      stages.push_back({"h_quantize", 1, [&part, &quantize_h](int64_t, int) { part.quantize_with(quantize_h); }, {gu}, {}});
      before_down = gu + 1;
    } else if (part.quantize_tasks() > 0) {
      stages.push_back({first ? "h_quantize" : "h_quantize.later", part.quantize_tasks(),
                        [&part](int64_t t, int) { part.quantize(t); }, {gu}, {}});
      before_down = gu + 1;
    }
    // `done` once, by whichever down stage finishes last
    auto left = std::make_shared<std::atomic<int64_t>>(groups);
    std::function<void()> down_done;
    if (done) down_done = [left, done] {
      if (left->fetch_sub(1, std::memory_order_acq_rel) == 1) done();
    };
    for (int64_t g = 0; g < groups; ++g)
      stages.push_back({first ? "down" : "down.later", part.down_tasks(g),
                        [&part, &down_times, g](int64_t t, int w) { part.down(part.down_task(g, t), w, down_times); },
                        {before_down + static_cast<int>(g)}, down_done,
                        [&part, g](int64_t t, WaitPrefetch& pf) { part.down_reads(part.down_task(g, t), pf); }});
  };
  add_part(now, true, on_now);
  if (later) add_part(*later, false, {});
  // One dispatch for all stages unless a caller's quantize_h runs between them. (One dispatch a stage for every call,
  // as before the stages were chained, tied on the device, 0.531 against 0.529 ms a Qwen3 decode layer, RESULTS.md
  // session 13; the split calls need the one dispatch to run the deferred part on behind the first.)
  run_stages(stages, !caller_quantizes_h, timer);
  gu_times.report(timer, {"gate_up.kernel", "gate_up.epilogue", "gate_up.other"}, "gate_up.busiest");
  down_times.report(timer, {"down.kernel", "down.scatter", "down.other"}, "down.busiest");
  if (timer.on()) {
    std::string what = "T=" + std::to_string(T) + " pairs=" + std::to_string(now.pairs()) +
                       " experts=" + std::to_string(now.experts());
    if (later) what += " later_pairs=" + std::to_string(later->pairs()) + " later_experts=" + std::to_string(later->experts());
    if (train != nullptr) what += " delta";  // fused_moe_with_delta
    const char* format = fmt == WeightFormat::BF16 ? "bf16" : fmt == WeightFormat::INT8 ? "int8" : up.codes ? "mxfp4" : "int4";
    timer.print(what + " " + format + " " + ks.name);
  }
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& hidden_in, const at::Tensor& topk_ids_in, const at::Tensor& topk_weights_in,
                     const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                     const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                     const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias) {
  return fused_moe_with_h_quantizer(hidden_in, topk_ids_in, topk_weights_in, w13, w13_scales, w2, w2_scales, activation,
                                    QuantizeH(), false, w13_bias, w2_bias);
}

at::Tensor fused_moe_with_h_quantizer(const at::Tensor& hidden_in, const at::Tensor& topk_ids_in,
                                      const at::Tensor& topk_weights_in, const at::Tensor& w13,
                                      const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                                      const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                                      const QuantizeH& quantize_h, bool fp32_out,
                                      const std::optional<at::Tensor>& w13_bias,
                                      const std::optional<at::Tensor>& w2_bias) {
  const WeightFormat fmt = check_call(hidden_in, topk_ids_in, topk_weights_in, w13, w2);
  at::Tensor out = at::empty({hidden_in.size(0), hidden_in.size(1)},
                             fp32_out ? hidden_in.options().dtype(at::kFloat) : hidden_in.options());
  run_call(fmt, hidden_in, topk_ids_in, nullptr, topk_weights_in, w13, w13_scales, w2, w2_scales, activation, quantize_h,
           out, nullptr, {}, w13_bias, w2_bias);
  return out;
}

void fused_moe_out(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                   const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                   const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias,
                   const at::Tensor& out) {
  const WeightFormat fmt = check_call(hidden, topk_ids, topk_weights, w13, w2);
  TORCH_CHECK(out.device().is_cpu() && out.sizes() == hidden.sizes() && out.scalar_type() == hidden.scalar_type() &&
                  out.is_contiguous(),
              "fused_moe_out: out must be a contiguous CPU tensor like hidden ", hidden.sizes(), " ",
              hidden.scalar_type(), ", got ", out.sizes(), " ", out.scalar_type(), " on ", out.device());
  const auto overlap = at::get_overlap_status(out, hidden);
  TORCH_CHECK(overlap == at::MemOverlapStatus::No || hidden.numel() == 0,
              "fused_moe_out: out must not share memory with hidden");
  run_call(fmt, hidden, topk_ids, nullptr, topk_weights, w13, w13_scales, w2, w2_scales, activation, QuantizeH(), out,
           nullptr, {}, w13_bias, w2_bias);
}

void fused_moe_split(const at::Tensor& hidden, const at::Tensor& ids_now, const at::Tensor& ids_later,
                     const at::Tensor& topk_weights, const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales,
                     const at::Tensor& w2, const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                     const at::Tensor& out_now, const at::Tensor& out_later, const std::function<void()>& on_now,
                     const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias) {
  const WeightFormat fmt = check_call(hidden, ids_now, topk_weights, w13, w2);
  TORCH_CHECK(ids_later.sizes() == ids_now.sizes() && ids_later.device().is_cpu() &&
                  (ids_later.scalar_type() == at::kInt || ids_later.scalar_type() == at::kLong),
              "fused_moe_split: ids_later must be an int32/int64 CPU tensor shaped like ids_now ", ids_now.sizes(),
              ", got ", ids_later.sizes(), " ", ids_later.scalar_type(), " on ", ids_later.device());
  for (const at::Tensor* o : {&out_now, &out_later})
    TORCH_CHECK(o->device().is_cpu() && o->sizes() == hidden.sizes() && o->scalar_type() == hidden.scalar_type() &&
                    o->is_contiguous(),
                "fused_moe_split: the outputs must be contiguous CPU tensors like hidden ", hidden.sizes(), " ",
                hidden.scalar_type(), ", got ", o->sizes(), " ", o->scalar_type(), " on ", o->device());
  run_call(fmt, hidden, ids_now, &ids_later, topk_weights, w13, w13_scales, w2, w2_scales, activation, QuantizeH(), out_now,
           &out_later, on_now, w13_bias, w2_bias);
}

at::Tensor fused_moe_with_delta(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                                const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                                const at::Tensor& gate_up_delta, const at::Tensor& h_out, const at::Tensor& gate_up_out,
                                const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias) {
  const WeightFormat fmt = check_call(hidden, topk_ids, topk_weights, w13, w2);
  const int64_t T = hidden.size(0), K = topk_ids.size(1), n13 = w13.size(1) * 16;
  const int64_t I = w2.size(2) * (format_of(w2, "w2") == WeightFormat::INT4 ? 8 : w2.size(4));
  TORCH_CHECK(gate_up_delta.device().is_cpu() && gate_up_delta.is_floating_point() && gate_up_delta.dim() == 3 &&
                  gate_up_delta.size(0) == T && gate_up_delta.size(1) == K && gate_up_delta.size(2) == n13,
              "fused_moe_delta: gate_up_delta must be a float CPU tensor [T=", T, ", K=", K, ", ",
              n13 == I ? "I=" : "2I=", n13, "], got ", gate_up_delta.scalar_type(), " ", gate_up_delta.sizes(), " on ",
              gate_up_delta.device());
  TORCH_CHECK(h_out.device().is_cpu() && h_out.is_contiguous() && h_out.dim() == 3 && h_out.size(0) == T &&
                  h_out.size(1) == K && h_out.size(2) == I &&
                  (h_out.scalar_type() == at::kBFloat16 || h_out.scalar_type() == at::kHalf ||
                   h_out.scalar_type() == at::kFloat),
              "fused_moe_delta: h_out must be a contiguous bf16/fp16/fp32 CPU tensor [T=", T, ", K=", K, ", I=", I,
              "], got ", h_out.scalar_type(), " ", h_out.sizes());
  TORCH_CHECK(!gate_up_out.defined() ||
                  (gate_up_out.device().is_cpu() && gate_up_out.is_contiguous() && gate_up_out.dim() == 3 &&
                   gate_up_out.size(0) == T && gate_up_out.size(1) == K && gate_up_out.size(2) == n13 &&
                   (gate_up_out.scalar_type() == at::kBFloat16 || gate_up_out.scalar_type() == at::kHalf ||
                    gate_up_out.scalar_type() == at::kFloat)),
              "fused_moe_delta: gate_up_out must be a contiguous bf16/fp16/fp32 CPU tensor [T=", T, ", K=", K, ", ",
              n13, "], got ", gate_up_out.scalar_type(), " ", gate_up_out.sizes());
  // the deltas read in place when bf16 or fp32 and contiguous (the usual case: an adapter's output)
  const at::Tensor delta = gate_up_delta.scalar_type() == at::kBFloat16
                               ? gate_up_delta.contiguous()
                               : gate_up_delta.to(at::kFloat).contiguous();
  Training train;
  train.delta = delta.data_ptr();
  train.delta_bf16 = delta.scalar_type() == at::kBFloat16;
  train.n13 = n13;
  train.h = h_out.data_ptr();
  train.h_dtype = h_out.scalar_type();
  if (gate_up_out.defined()) {
    train.gate_up = gate_up_out.data_ptr();
    train.gate_up_dtype = gate_up_out.scalar_type();
  }
  // skipped slots' h (and pre-activation) rows are zeros (the routed ones are all written by the gate/up tasks)
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * K; ++i) {
    if (idp[i] >= 0) continue;
    std::memset(static_cast<char*>(h_out.data_ptr()) + i * I * h_out.element_size(), 0, I * h_out.element_size());
    if (gate_up_out.defined())
      std::memset(static_cast<char*>(gate_up_out.data_ptr()) + i * n13 * gate_up_out.element_size(), 0,
                  n13 * gate_up_out.element_size());
  }
  at::Tensor out = at::empty({T, hidden.size(1)}, hidden.options());
  run_call(fmt, hidden, topk_ids, nullptr, topk_weights, w13, w13_scales, w2, w2_scales, activation, QuantizeH(), out,
           nullptr, {}, w13_bias, w2_bias, &train);
  return out;
}

}  // namespace kt::moe
