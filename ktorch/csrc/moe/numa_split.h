#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <tuple>
#include <vector>

namespace kt::moe {

// Cuts packed experts into n slices of the intermediate dimension, slice g placed on group g's node.
// Returns (w13 slices, w13_scales slices, w2 slices, w2_scales slices); the scale lists are empty for bf16.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>>
numa_split_experts(const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                   const std::optional<at::Tensor>& w2_scales, int64_t n);

// fused_moe over slices from numa_split_experts: slice g runs on group g's threads, the fp32 partial
// outputs are summed in slice order. int8/int4: the slices quantize h with shared per-row scales (the
// unsplit op's), exchanged between gate/up and the down projection.
at::Tensor fused_moe_numa(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                          at::TensorList w13, at::TensorList w13_scales, at::TensorList w2, at::TensorList w2_scales,
                          c10::string_view activation);

}  // namespace kt::moe
