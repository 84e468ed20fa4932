#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <optional>

namespace kt::moe {

at::Tensor fused_moe(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                     const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                     const std::optional<at::Tensor>& w2_scales, c10::string_view activation);

}  // namespace kt::moe
