#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <functional>
#include <optional>

#include "../kernels/kernels.h"

namespace kt::moe {
// The activations kt::fused_moe takes (the first four are the kernels' kernels::Activation, in its order).
enum class ActivationKind { SiLU, GeluTanh, Gelu, Relu, Relu2, SwigluOai, SiluClamped, SoftcapSwiglu };
// An activation spec parsed: "name" or "name(key=value, ...)" (fused_moe.cpp lists the names and their parameters;
// raises naming the problem). The backward (fused_moe_backward.cpp) reads specs with it too.
struct ActivationSpec {
  ActivationKind kind = ActivationKind::SiLU;
  float alpha = 0, limit = 0, gate_cap = 0, up_cap = 0;  // swiglu_oai(alpha, limit), silu_clamped(limit), softcap_swiglu(gate, up)
};
ActivationSpec parse_activation(c10::string_view spec);

// Expert biases (optional, fp32 contiguous CPU): w13_bias [E, 2I] (gate biases, then up biases; [E, I] for gateless
// experts) is added to the gate/up outputs before the activation, w2_bias [E, H] to the down output before the routing
// weight scales it. Gateless experts (w13 packed with gate_up=False, [E, I, H]: w13's N equals w2's K) compute
// h = act(up). activation: a name, with parameters for the clamped/softcapped ones, e.g. "swiglu_oai(alpha=1.702,
// limit=7)" (fused_moe.cpp, parse_epilogue, lists them).
at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                     const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                     const std::optional<at::Tensor>& w13_bias = std::nullopt,
                     const std::optional<at::Tensor>& w2_bias = std::nullopt);

// fused_moe written into out (contiguous, hidden's shape and dtype, CPU, not hidden's memory): the same numbers bit
// for bit, without a new tensor. The experts runtime's eager calls (ktorch/compile/experts_runtime.py) write their
// pinned staging this way instead of copying a new result into it on the worker thread.
void fused_moe_out(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                   const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                   const std::optional<at::Tensor>& w13_bias, const std::optional<at::Tensor>& w2_bias,
                   const at::Tensor& out);

// How a caller can quantize h = act(gate) * up, the down projection's input, in the driver's place (int8/int4
// weights): the NUMA split (numa_split.cpp) has each slice quantize its channels of a row with the scale of the
// whole row, as the unsplit op does. Called once per call, on the calling thread, after gate/up: h is fp32
// [P, I], one row per routed (token, slot) pair in the driver's order (grouped by expert, set by topk_ids
// alone); it fills q int8 [P, I], scale [P] and gsum [P, I / group_size] as kernels::QuantizeRowsFn defines
// them. Not called when nothing is routed (T, K or the routed pairs 0).
using QuantizeH = std::function<void(const float* h, int64_t P, int64_t I, int64_t group_size, int8_t* q,
                                     float* scale, int32_t* gsum)>;

// fused_moe with h quantized by quantize_h when it is set and the weights are int8/int4, its output in hidden's dtype
// or, with fp32_out, in float32 (the NUMA split's partial sums, rounded once after the slices' sum).
at::Tensor fused_moe_with_h_quantizer(const at::Tensor& hidden, const at::Tensor& topk_ids,
                                      const at::Tensor& topk_weights, const at::Tensor& w13,
                                      const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                                      const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                                      const QuantizeH& quantize_h, bool fp32_out = false,
                                      const std::optional<at::Tensor>& w13_bias = std::nullopt,
                                      const std::optional<at::Tensor>& w2_bias = std::nullopt);

// One call in two parts (expert deferral): the slots that ids_now routes into out_now, then those that ids_later
// routes into out_later (negative ids skipped in each; the same hidden and topk_weights), in one dispatch of the
// worker pool: the later part's tasks run behind the first part's and fill its tail. on_now (optional) is called as
// soon as out_now is complete, on whichever thread finished it, while the later part may still run; it is not
// called when the call fails. Each output is what kt::fused_moe returns for its ids, bit for bit. Both outputs:
// contiguous CPU tensors shaped and typed like hidden.
void fused_moe_split(const at::Tensor& hidden, const at::Tensor& ids_now, const at::Tensor& ids_later,
                     const at::Tensor& topk_weights, const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales,
                     const at::Tensor& w2, const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                     const at::Tensor& out_now, const at::Tensor& out_later, const std::function<void()>& on_now,
                     const std::optional<at::Tensor>& w13_bias = std::nullopt,
                     const std::optional<at::Tensor>& w2_bias = std::nullopt);

// The training forward (fused_moe_delta, fused_moe_backward.cpp): kt::fused_moe with gate_up_delta [T, K, N13]
// (N13 = w13's rows: 2I, gate columns then up columns, or I for gateless experts; any float dtype and layout, bf16 and
// fp32 contiguous read in place) added to each routed (token, slot)'s gate/up outputs (after the bias, before the
// activation), and each routed pair's h = act(gate) * up written into h_out (contiguous [T, K, I], bf16, fp16 or
// fp32; the rows of skipped slots zeroed). The same kernels, tasks, stages and numerics as fused_moe (whose result
// it is bit for bit when the deltas are zeros); h_out holds h as the GLU made it (fp32 for int formats, before their
// int8 quantization for the down projection; bf16 for bf16 weights), rounded once to h_out's dtype. gate_up_out
// (optional, contiguous [T, K, N13], bf16, fp16 or fp32): each routed pair's pre-activations as the GLU read them (the
// kernels' fp32 output with the biases and deltas added), rounded once to its dtype, skipped slots' rows zeroed:
// what the backward would otherwise recompute.
at::Tensor fused_moe_with_delta(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                                const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                                const at::Tensor& gate_up_delta, const at::Tensor& h_out,
                                const at::Tensor& gate_up_out = at::Tensor(),
                                const std::optional<at::Tensor>& w13_bias = std::nullopt,
                                const std::optional<at::Tensor>& w2_bias = std::nullopt);

// dst, a row of `dtype` (fp32, bf16 or fp16) = src[0] + src[1] + ... + src[n_src - 1] over n columns, added in fp32
// in that order by ks.sum_rows (zeros when n_src is 0), then rounded once: the last step of the op (its expert
// groups) and of the NUMA split (its slices).
void store_row_sum(const kernels::KernelSet& ks, const float* const* src, int n_src, int64_t n, at::ScalarType dtype,
                   void* dst);

}  // namespace kt::moe
