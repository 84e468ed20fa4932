#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace kt::moe {

at::Tensor pack_bf16(const at::Tensor& weight, bool gate_up);
std::tuple<at::Tensor, at::Tensor> pack_int8(const at::Tensor& weight, bool gate_up);
std::tuple<at::Tensor, at::Tensor> pack_int4(const at::Tensor& weight, int64_t group_size, bool gate_up,
                                              bool two_level);
// Two-level K-quant scales (uint8 or int8 [E, (2,) G + K/64, N]: G sub-scale rows, then the fp32 super-scales
// [K/256][N] of each part as bytes; ktorch.ops.moe.pack_kscales) as float32 [E, (2,) G, N], super * sub exactly; float32
// scales are returned as they are, float16 ones (Q8_0's d) converted. K: the packed weights' input channels.
at::Tensor kscales_as_float(const at::Tensor& scales, int64_t K);
at::Tensor unpack(const at::Tensor& packed, const std::optional<at::Tensor>& scales, bool gate_up);

}  // namespace kt::moe
