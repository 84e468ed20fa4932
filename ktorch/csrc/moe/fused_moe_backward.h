// Training through the packed experts (fused_moe_backward.cpp): kt::fused_moe's backward, and the forward with
// additive gate/up deltas (LoRA on the experts) that also returns h = act(gate) * up.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>
#include <tuple>

namespace kt::moe {

// (out [T, H] in hidden's dtype, h [T, K, I] and gate_up [T, K, N13] in hidden's dtype, zeros for skipped slots):
// the routed experts with gate_up_delta [T, K, 2I] (gate columns then up columns; gateless experts: [T, K, I]) added
// to each pair's pre-activations; gate_up holds those pre-activations as the GLU read them (biases and deltas included), what
// fused_moe_backward takes instead of recomputing x W13^T. Activations, biases and gateless experts as kt::fused_moe
// takes them (fused_moe.h). bf16/fp16 hidden: kt::fused_moe's packed kernels (fused_moe_with_delta, its numerics);
// float32/float64: the decoded-expert reference, the exact function of the dequantized weights.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_moe_delta(
    const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights, const at::Tensor& w13,
    const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2, const std::optional<at::Tensor>& w2_scales,
    const at::Tensor& gate_up_delta, c10::string_view activation,
    const std::optional<at::Tensor>& w13_bias = std::nullopt, const std::optional<at::Tensor>& w2_bias = std::nullopt);

// (d hidden in hidden's dtype, d topk_weights in its dtype, d gate_up_delta [T, K, N13] in its dtype or an empty
// tensor when gate_up_delta is not given) for grad_out = d out [T, H] and, optionally, grad_h = d h [T, K, I].
// gate_up (optional): fused_moe_delta's third output, the pre-activations [T, K, N13] of the forward being
// differentiated; when given, the backward reads them instead of recomputing x W13^T (+ biases + deltas).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_moe_backward(
    const at::Tensor& grad_out, const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
    const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
    const std::optional<at::Tensor>& gate_up_delta, const std::optional<at::Tensor>& grad_h,
    const std::optional<at::Tensor>& w13_bias = std::nullopt, const std::optional<at::Tensor>& w2_bias = std::nullopt,
    const std::optional<at::Tensor>& gate_up = std::nullopt);

}  // namespace kt::moe
