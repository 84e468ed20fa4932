#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace kt::moe {

at::Tensor pack_bf16(const at::Tensor& weight, bool gate_up);
std::tuple<at::Tensor, at::Tensor> pack_int8(const at::Tensor& weight, bool gate_up);
std::tuple<at::Tensor, at::Tensor> pack_int4(const at::Tensor& weight, int64_t group_size, bool gate_up);
at::Tensor unpack(const at::Tensor& packed, const std::optional<at::Tensor>& scales, bool gate_up);

}  // namespace kt::moe
