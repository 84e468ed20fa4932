// NUMA tensor parallelism for kt::fused_moe, as a layer above the op (the driver and kernels are untouched).
//
// Math: out[t] = sum_k w[t,k] * W2_e (act(W1_e x) * (W3_e x)) is a sum over the intermediate channels i,
// so with I cut into slices S_0..S_{n-1}, out = sum_g fused_moe(x, slice g), each slice holding the gate/up
// rows i in S_g and the down columns i in S_g. The sum runs in fp32, in slice order, then rounds once to
// the hidden dtype. bf16 weights: h = act(gate) * up is the same per channel, only the down projection's
// sum over i is regrouped (fp32 reduction order). int8/int4: the driver quantizes each row of h with one
// scale per row (its max over the channels it sees), so a slice quantizes its part of h with its own,
// smaller or equal scale: results differ from the unsplit op by h's quantization rounding, not only by
// summation order (the split is never less precise; tests bound the difference).
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

#include <cstring>
#include <numeric>

#include "../runtime/numa.h"
#include "../runtime/parallel.h"
#include "bf16.h"
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
    default:
      TORCH_CHECK(false, "numa_split_experts: w13 must be packed by kt.pack_bf16/pack_int8/pack_int4 (bfloat16, int8 ",
                  "or uint8), got ", w.scalar_type());
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
  if (quantized) {
    const at::Tensor &s13 = *s13_in, &s2 = *s2_in;
    TORCH_CHECK(s13.scalar_type() == at::kFloat && s13.dim() == 3 && s13.size(0) == E && s13.size(2) == 2 * I,
                "numa_split_experts: w13_scales must be float32 [E=", E, ", G, 2I=", 2 * I, "], got ", s13.scalar_type(),
                " ", s13.sizes());
    TORCH_CHECK(s2.scalar_type() == at::kFloat && s2.dim() == 3 && s2.size(0) == E && s2.size(2) == H && s2.size(1) > 0 &&
                    I % s2.size(1) == 0,
                "numa_split_experts: w2_scales must be float32 [E=", E, ", G, H=", H, "] with G dividing I=", I, ", got ",
                s2.scalar_type(), " ", s2.sizes());
    if (w13_in.scalar_type() == at::kByte) unit = std::lcm<int64_t>(32, I / s2.size(1));
  }
  const std::vector<int64_t> b = slice_bounds(I, unit, n, f.name);
  const at::Tensor w13 = w13_in.contiguous(), w2 = w2_in.contiguous();
  const at::Tensor s13 = quantized ? s13_in->contiguous() : at::Tensor();
  const at::Tensor s2 = quantized ? s2_in->contiguous() : at::Tensor();
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
  auto scales = [&](at::TensorList l, int g) { return quantized ? std::optional<at::Tensor>(l[g]) : std::nullopt; };
  // fp32 in, so each slice returns fp32 partial sums (bf16/fp16 -> fp32 is exact: the slices read the same
  // activations as the unsplit op)
  const at::Tensor x = hidden.to(at::kFloat);
  std::vector<at::Tensor> partial(n);
  runtime::NumaGroups& groups = runtime::NumaGroups::for_split(static_cast<int>(n));
  groups.run([&](int g) {
    partial[g] = fused_moe(x, topk_ids, topk_weights, w13[g], scales(w13_scales, g), w2[g], scales(w2_scales, g),
                           activation);
  });
  at::Tensor out = at::empty({T, H}, hidden.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0) return out;
  // out = partial[0] + partial[1] + ... in this order for every element; rows shared out over the groups
  groups.run([&](int g) {
    const int64_t t0 = T * g / n, t1 = T * (g + 1) / n;
    std::vector<float> row(H);
    for (int64_t t = t0; t < t1; ++t) {
      const float* p0 = partial[0].data_ptr<float>() + t * H;
      std::copy(p0, p0 + H, row.begin());
      for (int64_t s = 1; s < n; ++s) {
        const float* p = partial[s].data_ptr<float>() + t * H;
        for (int64_t j = 0; j < H; ++j) row[j] += p[j];
      }
      if (dtype == at::kFloat) {
        std::copy(row.begin(), row.end(), out.data_ptr<float>() + t * H);
      } else if (dtype == at::kBFloat16) {
        auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t * H;
        for (int64_t j = 0; j < H; ++j) o[j] = f32_to_bf16(row[j]);
      } else {
        at::Half* o = out.data_ptr<at::Half>() + t * H;
        for (int64_t j = 0; j < H; ++j) o[j] = static_cast<at::Half>(row[j]);
      }
    }
  });
  return out;
}

}  // namespace kt::moe
