// NUMA tensor parallelism for kt::fused_moe, as a layer above the op (the kernels are untouched; the driver
// only lets a caller quantize h, fused_moe.h).
//
// Math: out[t] = sum_k w[t,k] * W2_e (act(W1_e x) * (W3_e x)) is a sum over the intermediate channels i,
// so with I cut into slices S_0..S_{n-1}, out = sum_g fused_moe(x, slice g), each slice holding the gate/up
// rows i in S_g and the down columns i in S_g. The sum runs in fp32, in slice order, then rounds once to
// the hidden dtype. h = act(gate) * up is the same per channel in a slice as in the unsplit op. bf16
// weights: only the down projection's sum over i is regrouped (fp32 reduction order). int8/int4: the down
// projection reads h quantized per row, one scale per row from its max |h|; a slice alone would see only
// its channels' max. So the slices of one call share it, in two phases: each slice runs gate/up and gives
// its rows' max |h|, waits for the other slices (SharedRowMax), then quantizes its channels with the max
// over all of them, the unsplit op's scale, with the kernels' arithmetic, and runs its down projection.
// Its q, row scale and group sums are then the unsplit op's bytes for its channels, so int8/int4 results
// also differ from the unsplit op only by the fp32 summation order (the split adds the scaled partial dot
// products of its slices where the unsplit op scales one). The price: a slice keeps h in fp32 until the
// exchange (the driver's in-cache quantization of full rows is off) and waits for the slowest slice's gate/up.
//
// Layouts (moe/pack.cpp): w13 [E, 2I/16, H/per, 16, per] with gate_up=True, every 4 blocks of 16 packed
// rows = 32 gate rows then their 32 up rows, so channels [i0, i1) (multiples of 32) are the blocks
// [i0/8, i1/8) along dim 1; w13_scales [E, G, 2I] in the same packed row order: columns [2*i0, 2*i1).
// w2 [E, H/16, I/per, 16, per] (int4: I/8 along dim 2): channels [i0, i1) are [i0/q, i1/q) along dim 2,
// q = per (bf16 2, int8 4) or 8 (int4); w2_scales int8 [E, 1, H] is the same for every slice, int4
// [E, I/gs, H] is cut along dim 1, so slice bounds are multiples of the int4 group size gs too.
// Slices: units of lcm(32, gs) channels shared out as evenly as possible (sizes differ by at most one unit).
//
// Placement: slice g's tensors are allocated and written (first touch) by group g's threads, which are bound
// to its node's CPUs, then mbind(2) to that node when the group is one node (runtime/numa.h).
#include "numa_split.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <numeric>

#include "../runtime/dispatch.h"
#include "pack.h"
#include "../runtime/numa.h"
#include "../runtime/parallel.h"
#include "fused_moe.h"

namespace kt::moe {
namespace {

struct Format {
  const char* name;
  int64_t k_per_index;  // reduction elements per index of a packed tensor's dim 2
};

Format format_of(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kBFloat16: return {"bf16", 2};
    case at::kChar: return {"int8", 4};
    case at::kByte: return {"int4", 8};
    case at::ScalarType::Float4_e2m1fn_x2: return {"mxfp4", 8};  // the int4 layout, nibbles that are MXFP4 codes
    default:
      TORCH_CHECK(false, "numa_split_experts: w13 must be packed by kt.pack_bf16/pack_int8/pack_int4 (bfloat16, int8 ",
                  "or uint8) or pack_quantized (float4_e2m1fn_x2 for MXFP4), got ", w.scalar_type());
  }
}

// Slice bounds over I: multiples of the unit, sizes as even as possible.
std::vector<int64_t> slice_bounds(int64_t I, int64_t unit, int64_t n, const char* fmt) {
  TORCH_CHECK(n >= 1, "numa_split_experts: n must be at least 1, got ", n);
  TORCH_CHECK(I % unit == 0, "numa_split_experts: intermediate size I=", I, " is not a multiple of ", unit);
  const int64_t units = I / unit;
  TORCH_CHECK(units >= n, "numa_split_experts: cannot split the intermediate size I=", I, " into ", n,
              " slices: every slice needs a multiple of ", unit, " channels (", unit == 32 ? "the kernels' tile of 32" :
              "lcm of the kernels' tile of 32 and the int4 group size", ", ", fmt, "), and I has only ", units);
  std::vector<int64_t> b(n + 1);
  for (int64_t g = 0; g <= n; ++g) b[g] = unit * (units * g / n);
  return b;
}

// dst[o] = src[o][a0 .. a1) for every index o of the dims before `dim` (the dims after it stay whole):
// one memcpy per outer index, shared out over the current thread's pool (its threads first-touch dst).
at::Tensor copy_range(const at::Tensor& src, int64_t dim, int64_t a0, int64_t a1, int node) {
  auto sizes = src.sizes().vec();
  sizes[dim] = a1 - a0;
  at::Tensor dst = at::empty(sizes, src.options());
  int64_t outer = 1, inner = src.element_size();
  for (int64_t d = 0; d < dim; ++d) outer *= src.size(d);
  for (int64_t d = dim + 1; d < src.dim(); ++d) inner *= src.size(d);
  const int64_t src_row = src.size(dim) * inner, dst_row = (a1 - a0) * inner;
  const auto* s = static_cast<const uint8_t*>(src.data_ptr());
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  constexpr int64_t kBytesPerTask = 1 << 20;
  const int64_t per_task = std::max<int64_t>(1, kBytesPerTask / std::max<int64_t>(1, dst_row));
  runtime::parallel_tasks((outer + per_task - 1) / per_task, [&](int64_t task, int) {
    for (int64_t o = task * per_task; o < std::min(outer, (task + 1) * per_task); ++o)
      std::memcpy(d + o * dst_row, s + o * src_row + a0 * inner, dst_row);
  });
  if (node >= 0) runtime::bind_memory_to_node(d, dst.nbytes(), node);
  return dst;
}

// Per-row max |h| shared by the slices of one fused_moe_numa call: each slice gives the maxima over its own
// channels and waits until every slice has given its own; all then read the max over all channels, which is
// the unsplit op's (a max has no rounding). A slice that ends without giving its maxima (an error, or
// nothing routed) releases the others, which then stop with SliceAbandoned.
struct SliceAbandoned {};

class SharedRowMax {
 public:
  explicit SharedRowMax(int n) : n_(n) {}

  void reduce(std::vector<float>& amax) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (abandoned_) throw SliceAbandoned{};
    if (given_ == 0) {
      max_ = amax;
    } else {
      TORCH_CHECK(max_.size() == amax.size(), "fused_moe_numa: slices routed ", max_.size(), " and ", amax.size(),
                  " pairs for the same topk_ids");
      for (size_t p = 0; p < amax.size(); ++p) max_[p] = std::max(max_[p], amax[p]);
    }
    if (++given_ == n_)
      all_given_.notify_all();
    else
      all_given_.wait(lock, [&] { return given_ == n_ || abandoned_; });
    if (given_ != n_) throw SliceAbandoned{};
    amax = max_;
  }

  // Called by every slice when its fused_moe returns or throws; releases the waiting slices if it never gave.
  void leave() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (given_ < n_) {
      abandoned_ = true;
      all_given_.notify_all();
    }
  }

 private:
  const int n_;
  std::mutex mutex_;
  std::condition_variable all_given_;
  std::vector<float> max_;
  int given_ = 0;
  bool abandoned_ = false;
};

// One slice's h quantization (fused_moe.h, QuantizeH): its rows' max |h|, shared, then kernels::QuantizeRowsFn's
// arithmetic with the shared max (kernels/kernels.h): scale = amax / 127, q = x * (127 / amax) rounded half to
// even, clamped to +-127, gsum per group of the down projection's scales. The same operations on the same
// values as the unsplit op's kernel, so the slice's q, scale and gsum are the unsplit op's bytes for its channels.
void quantize_h_with_shared_max(SharedRowMax& shared, const float* h, int64_t P, int64_t I, int64_t group_size,
                                int8_t* q, float* scale, int32_t* gsum) {
  constexpr int64_t kRowsPerTask = 16;
  const int64_t tasks = (P + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<float> amax(P);
  runtime::parallel_tasks(tasks, [&](int64_t task, int) {
    for (int64_t p = task * kRowsPerTask; p < std::min(P, (task + 1) * kRowsPerTask); ++p) {
      const float* x = h + p * I;
      float m[16] = {};  // independent maxima: the loop is not one chain of dependent max operations
      for (int64_t k = 0; k < I; k += 16)  // I is a multiple of 32
        for (int j = 0; j < 16; ++j) m[j] = std::max(m[j], std::fabs(x[k + j]));
      amax[p] = *std::max_element(m, m + 16);
    }
  });
  shared.reduce(amax);
  const int64_t groups = I / group_size;
  runtime::parallel_tasks(tasks, [&](int64_t task, int) {
    // adding then subtracting 1.5 * 2^23 rounds |y| < 2^22 to the nearest integer, ties to even (what
    // nearbyint and the AVX-512 conversion do in the default rounding mode); here |y| <= 127 up to rounding
    constexpr float kRound = 12582912.0f;
    for (int64_t p = task * kRowsPerTask; p < std::min(P, (task + 1) * kRowsPerTask); ++p) {
      const float* x = h + p * I;
      const float inv = amax[p] > 0.0f ? 127.0f / amax[p] : 0.0f;
      scale[p] = amax[p] / 127.0f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t sum = 0;
        for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
          const int32_t v = std::clamp(static_cast<int32_t>((x[k] * inv + kRound) - kRound), -127, 127);
          q[p * I + k] = static_cast<int8_t>(v);
          sum += v;
        }
        gsum[p * groups + g] = sum;
      }
    }
  });
}

}  // namespace

std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
numa_split_experts(const at::Tensor& w13_in, const std::optional<at::Tensor>& s13_in, const at::Tensor& w2_in,
                   const std::optional<at::Tensor>& s2_in, int64_t n) {
  const Format f = format_of(w13_in);
  const bool quantized = w13_in.scalar_type() != at::kBFloat16;
  for (const at::Tensor* t : {&w13_in, &w2_in})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 5 && t->size(3) == 16,
                "numa_split_experts: w13 and w2 must be packed CPU tensors [E, N/16, K/per, 16, per], got ", t->sizes(),
                " on ", t->device());
  TORCH_CHECK(w2_in.scalar_type() == w13_in.scalar_type(), "numa_split_experts: w13 and w2 must be packed in the same ",
              "format, got ", w13_in.scalar_type(), " and ", w2_in.scalar_type());
  TORCH_CHECK(s13_in.has_value() == quantized && s2_in.has_value() == quantized, "numa_split_experts: ",
              quantized ? "int8/int4 weights need w13_scales and w2_scales" : "bf16 weights take no scales");
  const int64_t E = w13_in.size(0), I = w13_in.size(1) * 8, H = w2_in.size(1) * 16;
  TORCH_CHECK(w13_in.size(1) % 4 == 0, "numa_split_experts: w13 must be packed with gate_up=True (2I a multiple of 64), ",
              "got N=", w13_in.size(1) * 16);
  TORCH_CHECK(w2_in.size(0) == E && w2_in.size(2) * f.k_per_index == I, "numa_split_experts: w2 ", w2_in.sizes(),
              " does not match w13 ", w13_in.sizes(), " (E=", E, ", I=", I, ")");
  int64_t unit = 32;
  // scales at the file's size (two-level K-quant, float16): the slices hold the float32 form (expanded once here,
  // exactly)
  const at::Tensor s13 = quantized ? kscales_as_float(*s13_in, H).contiguous() : at::Tensor();
  const at::Tensor s2 = quantized ? kscales_as_float(*s2_in, I).contiguous() : at::Tensor();
  if (quantized) {
    TORCH_CHECK(s13.scalar_type() == at::kFloat && s13.dim() == 3 && s13.size(0) == E && s13.size(2) == 2 * I,
                "numa_split_experts: w13_scales must be float32 [E=", E, ", G, 2I=", 2 * I, "], got ", s13.scalar_type(),
                " ", s13.sizes());
    TORCH_CHECK(s2.scalar_type() == at::kFloat && s2.dim() == 3 && s2.size(0) == E && s2.size(2) == H && s2.size(1) > 0 &&
                    I % s2.size(1) == 0,
                "numa_split_experts: w2_scales must be float32 [E=", E, ", G, H=", H, "] with G dividing I=", I, ", got ",
                s2.scalar_type(), " ", s2.sizes());
    // int4, and grouped int8 (GGUF Q8_0/Q6_K kept exact): slices hold whole groups of the down scales
    if (f.k_per_index == 8 || s2.size(1) > 1) unit = std::lcm<int64_t>(32, I / s2.size(1));
  }
  const std::vector<int64_t> b = slice_bounds(I, unit, n, f.name);
  const at::Tensor w13 = w13_in.contiguous(), w2 = w2_in.contiguous();
  std::vector<at::Tensor> w13s(n), s13s(quantized ? n : 0), w2s(n), s2s(quantized ? n : 0);
  runtime::NumaGroups& groups = runtime::NumaGroups::for_split(static_cast<int>(n));
  groups.run([&](int g) {
    const int64_t i0 = b[g], i1 = b[g + 1];
    const int node = groups.group(g).node;
    w13s[g] = copy_range(w13, 1, i0 / 8, i1 / 8, node);
    w2s[g] = copy_range(w2, 2, i0 / f.k_per_index, i1 / f.k_per_index, node);
    if (!quantized) return;
    s13s[g] = copy_range(s13, 2, 2 * i0, 2 * i1, node);
    const int64_t G2 = s2.size(1), gs = I / G2;
    s2s[g] = G2 == 1 ? copy_range(s2, 1, 0, 1, node) : copy_range(s2, 1, i0 / gs, i1 / gs, node);
  });
  return {w13s, s13s, w2s, s2s};
}

at::Tensor fused_moe_numa(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                          at::TensorList w13, at::TensorList w13_scales, at::TensorList w2, at::TensorList w2_scales,
                          c10::string_view activation) {
  const int64_t n = static_cast<int64_t>(w13.size());
  TORCH_CHECK(n >= 1, "fused_moe_numa: needs at least one slice, got none");
  TORCH_CHECK(static_cast<int64_t>(w2.size()) == n, "fused_moe_numa: w13 has ", n, " slices but w2 has ", w2.size());
  TORCH_CHECK(w13_scales.empty() || static_cast<int64_t>(w13_scales.size()) == n, "fused_moe_numa: w13_scales must ",
              "be empty (bf16) or have one tensor per slice (", n, "), got ", w13_scales.size());
  TORCH_CHECK(w2_scales.size() == w13_scales.size(), "fused_moe_numa: w13_scales has ", w13_scales.size(),
              " tensors but w2_scales has ", w2_scales.size());
  TORCH_CHECK(hidden.device().is_cpu() && hidden.dim() == 2, "fused_moe_numa: hidden must be a [T, H] CPU tensor, got ",
              hidden.sizes(), " on ", hidden.device());
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kHalf,
              "fused_moe_numa: hidden must be bfloat16, float16 or float32, got ", dtype);
  const int64_t T = hidden.size(0), H = hidden.size(1);
  const bool quantized = !w13_scales.empty();
  for (int64_t g = 1; g < n; ++g)
    TORCH_CHECK(w13[g].scalar_type() == w13[0].scalar_type() && w2[g].scalar_type() == w2[0].scalar_type(),
                "fused_moe_numa: every slice must be packed in the same format, slice 0 has ", w13[0].scalar_type(),
                " and slice ", g, " has ", w13[g].scalar_type());
  auto scales = [&](at::TensorList l, int g) { return quantized ? std::optional<at::Tensor>(l[g]) : std::nullopt; };
  // each slice reads hidden as the unsplit op does (bf16 rows in place with bf16 weights) and returns fp32
  // partial sums
  std::vector<at::Tensor> partial(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<char> abandoned(n, 0);
  SharedRowMax shared(static_cast<int>(n));
  runtime::NumaGroups& groups = runtime::NumaGroups::for_split(static_cast<int>(n));
  groups.run([&](int g) {
    // int8/int4: every slice quantizes h with the whole row's scale (the header comment); one slice has it
    QuantizeH quantize_h;
    if (quantized && n > 1)
      quantize_h = [&shared](const float* h, int64_t P, int64_t I, int64_t gs, int8_t* q, float* s, int32_t* gsum) {
        quantize_h_with_shared_max(shared, h, P, I, gs, q, s, gsum);
      };
    try {
      partial[g] = fused_moe_with_h_quantizer(hidden, topk_ids, topk_weights, w13[g], scales(w13_scales, g), w2[g],
                                              scales(w2_scales, g), activation, quantize_h, /*fp32_out=*/true);
    } catch (const SliceAbandoned&) {
      abandoned[g] = 1;
    } catch (...) {
      errors[g] = std::current_exception();
    }
    shared.leave();
  });
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);  // the lowest slice's error; the others stopped because of it
  for (int64_t g = 0; g < n; ++g)
    TORCH_CHECK(!abandoned[g], "fused_moe_numa: slice ", g, " stopped because another slice ended without quantizing h");
  at::Tensor out = at::empty({T, H}, hidden.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  // out = partial[0] + partial[1] + ... in this order for every element; rows shared out over the groups
  const kernels::KernelSet& ks = runtime::select_kernels();
  groups.run([&](int g) {
    const int64_t t0 = T * g / n, t1 = T * (g + 1) / n;
    std::vector<const float*> src(n);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t s = 0; s < n; ++s) src[s] = partial[s].data_ptr<float>() + t * H;
      store_row_sum(ks, src.data(), static_cast<int>(n), H, dtype,
                    static_cast<char*>(out.data_ptr()) + t * H * out.element_size());
    }
  });
  return out;
}

}  // namespace kt::moe
