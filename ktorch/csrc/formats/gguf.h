// Decoding llama.cpp's GGUF block-quantized tensors (ktorch/integrations/gguf_loading.py uses it when loading).
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace kt::formats {

// blocks: uint8 [n, type_size] (n blocks of one GGML type, as stored in the file) -> float32 [n, block_size], the
// values the format stands for, computed in float32 in the same order of operations as the gguf package's
// dequantize_blocks (bit-identical results). qtype: "Q8_0", "Q4_0", "Q4_K", "Q5_K" or "Q6_K".
at::Tensor gguf_dequantize(const at::Tensor& blocks, const std::string& qtype);

// The same into out (contiguous float32 with n * block_size elements, any shape): a loader reuses one buffer and
// so does not pay for fresh pages on every tensor.
void gguf_dequantize_into(const at::Tensor& blocks, const std::string& qtype, const at::Tensor& out);

}  // namespace kt::formats
