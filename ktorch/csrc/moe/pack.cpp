// Packing expert weights into the kernels' layouts (ktorch/csrc/kernels/kernels.h), and back.
//
// Input: W [E, N, K] (N output channels, K reduction) in any float dtype and any strides, e.g.
// transformers' gate_up_proj [E, 2I, H] or down_proj [E, H, I]. With gate_up=True the N = 2I rows are
// first reordered so that every 64 packed rows hold 32 gate rows then the 32 matching up rows: one
// kernel task then computes act(gate) * up for 32 intermediate channels from 64 adjacent packed rows.
// Quantization (deterministic, round half to even, in fp32):
//   int8: scale[n] = max_k |W[n,k]| / 127,  q = round(W / scale) in [-127, 127]
//   int4: scale[g][n] = max_{k in group g} |W[n,k]| / 7,  q = round(W / scale) in [-7, 7] (stored + 8)
// Experts are processed a few at a time so that packing a layer needs little memory beyond its output.
#include "pack.h"

#include <ATen/ATen.h>

namespace kt::moe {
namespace {

constexpr int64_t kExpertsPerChunk = 8;

void check_weight(const at::Tensor& w, const char* op, bool gate_up, int64_t k_multiple) {
  TORCH_CHECK(w.device().is_cpu(), op, ": weight must be a CPU tensor, got device ", w.device());
  TORCH_CHECK(w.dim() == 3, op, ": weight must be [E, N, K] (3-D), got shape ", w.sizes());
  TORCH_CHECK(w.is_floating_point(), op, ": weight must be a floating-point tensor, got ", w.scalar_type());
  const int64_t N = w.size(1), K = w.size(2);
  TORCH_CHECK(N > 0 && N % (gate_up ? 64 : 16) == 0, op, ": the output dimension N=", N, " must be a positive multiple of ",
              gate_up ? "64 for gate_up (the intermediate size must be a multiple of 32)" : "16");
  TORCH_CHECK(K > 0 && K % k_multiple == 0, op, ": the reduction dimension K=", K, " must be a positive multiple of ",
              k_multiple);
}

// Rows of W in packed order: for gate_up, [g0..g31, u0..u31, g32..g63, u32..u63, ...].
at::Tensor packed_row_order(const at::Tensor& w, bool gate_up) {
  if (!gate_up) return w;
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  return w.reshape({E, 2, N / 64, 32, K}).transpose(1, 2).reshape({E, N, K});
}

// Inverse of packed_row_order.
at::Tensor original_row_order(const at::Tensor& w, bool gate_up) {
  if (!gate_up) return w;
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  return w.reshape({E, N / 64, 2, 32, K}).transpose(1, 2).reshape({E, N, K});
}

// [E, N, K] -> [E, N/16, K/per, 16, per]
at::Tensor to_lanes(const at::Tensor& w, int64_t per) {
  const int64_t E = w.size(0), N = w.size(1), K = w.size(2);
  return w.reshape({E, N / 16, 16, K / per, per}).permute({0, 1, 3, 2, 4});
}

at::Tensor from_lanes(const at::Tensor& p) {  // inverse of to_lanes
  const int64_t E = p.size(0), nb = p.size(1), kq = p.size(2), per = p.size(4);
  return p.permute({0, 1, 3, 2, 4}).reshape({E, nb * 16, kq * per});
}

template <typename Fn>
void for_expert_chunks(int64_t E, const Fn& fn) {
  for (int64_t e0 = 0; e0 < E; e0 += kExpertsPerChunk) fn(e0, std::min(E, e0 + kExpertsPerChunk));
}

}  // namespace

at::Tensor pack_bf16(const at::Tensor& weight, bool gate_up) {
  check_weight(weight, "pack_bf16", gate_up, 32);
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2);
  at::Tensor out = at::empty({E, N / 16, K / 2, 16, 2}, weight.options().dtype(at::kBFloat16));
  for_expert_chunks(E, [&](int64_t e0, int64_t e1) {
    out.slice(0, e0, e1).copy_(to_lanes(packed_row_order(weight.slice(0, e0, e1), gate_up), 2));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> pack_int8(const at::Tensor& weight, bool gate_up) {
  check_weight(weight, "pack_int8", gate_up, 32);
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2);
  at::Tensor out = at::empty({E, N / 16, K / 4, 16, 4}, weight.options().dtype(at::kChar));
  at::Tensor scales = at::empty({E, 1, N}, weight.options().dtype(at::kFloat));
  for_expert_chunks(E, [&](int64_t e0, int64_t e1) {
    at::Tensor w = packed_row_order(weight.slice(0, e0, e1), gate_up).to(at::kFloat);
    at::Tensor scale = w.abs().amax(-1, /*keepdim=*/true).div_(127.0f);
    at::Tensor q = w.div(scale.clamp_min(1e-30f)).round_().clamp_(-127, 127).to(at::kChar);
    out.slice(0, e0, e1).copy_(to_lanes(q, 4));
    scales.slice(0, e0, e1).copy_(scale.transpose(1, 2));
  });
  return {out, scales};
}

std::tuple<at::Tensor, at::Tensor> pack_int4(const at::Tensor& weight, int64_t group_size, bool gate_up) {
  check_weight(weight, "pack_int4", gate_up, 32);
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
              "pack_int4: group_size must be a positive multiple of 32 that divides K=", K, ", got ", group_size);
  const int64_t G = K / group_size;
  at::Tensor out = at::empty({E, N / 16, K / 8, 16, 4}, weight.options().dtype(at::kByte));
  at::Tensor scales = at::empty({E, G, N}, weight.options().dtype(at::kFloat));
  for_expert_chunks(E, [&](int64_t e0, int64_t e1) {
    const int64_t e = e1 - e0;
    at::Tensor w = packed_row_order(weight.slice(0, e0, e1), gate_up).to(at::kFloat).reshape({e, N, G, group_size});
    at::Tensor scale = w.abs().amax(-1, /*keepdim=*/true).div_(7.0f);  // [e, N, G, 1]
    at::Tensor u = w.div(scale.clamp_min(1e-30f)).round_().clamp_(-8, 7).add_(8).to(at::kByte).reshape({e, N, K});
    // [e, N/16, 16, K/8, 2, 4] -> [e, N/16, K/8, 16, 2, 4]; halves 0/1 become the low/high nibbles
    at::Tensor t = u.reshape({e, N / 16, 16, K / 8, 2, 4}).permute({0, 1, 3, 2, 4, 5});
    out.slice(0, e0, e1).copy_(t.select(4, 0).bitwise_or(t.select(4, 1).bitwise_left_shift(4)));
    scales.slice(0, e0, e1).copy_(scale.squeeze(-1).transpose(1, 2));
  });
  return {out, scales};
}

at::Tensor unpack(const at::Tensor& packed, const std::optional<at::Tensor>& scales, bool gate_up) {
  TORCH_CHECK(packed.device().is_cpu(), "unpack: packed must be a CPU tensor, got device ", packed.device());
  TORCH_CHECK(packed.dim() == 5 && packed.size(3) == 16, "unpack: packed must be [E, N/16, K/per, 16, per], got shape ",
              packed.sizes());
  const auto dtype = packed.scalar_type();
  const int64_t E = packed.size(0), N = packed.size(1) * 16;
  at::Tensor w;
  if (dtype == at::kBFloat16) {
    TORCH_CHECK(!scales.has_value(), "unpack: bf16 packed weights take no scales");
    TORCH_CHECK(packed.size(4) == 2, "unpack: bf16 packed weights must end in [16, 2], got ", packed.sizes());
    w = from_lanes(packed).to(at::kFloat);
  } else {
    TORCH_CHECK(dtype == at::kChar || dtype == at::kByte,
                "unpack: packed weights must be bfloat16, int8 or uint8 (int4), got ", dtype);
    TORCH_CHECK(packed.size(4) == 4, "unpack: quantized packed weights must end in [16, 4], got ", packed.sizes());
    TORCH_CHECK(scales.has_value(), "unpack: quantized packed weights need their scales");
    const at::Tensor& s = *scales;
    const int64_t K = dtype == at::kChar ? packed.size(2) * 4 : packed.size(2) * 8;
    TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.size(0) == E && s.size(2) == N && s.size(1) > 0 &&
                    K % s.size(1) == 0,
                "unpack: scales must be float32 [E=", E, ", G, N=", N, "] with G dividing K=", K, ", got ",
                s.scalar_type(), " ", s.sizes());
    if (dtype == at::kChar) {
      TORCH_CHECK(s.size(1) == 1, "unpack: int8 scales must be [E, 1, N], got ", s.sizes());
      w = from_lanes(packed).to(at::kFloat);
    } else {
      at::Tensor lo = packed.bitwise_and(0xf), hi = packed.bitwise_right_shift(4);
      at::Tensor q = at::stack({lo, hi}, 3).to(at::kFloat).sub_(8);  // [E, N/16, K/8, 2, 16, 4]
      w = q.permute({0, 1, 4, 2, 3, 5}).reshape({E, N, K});
    }
    const int64_t G = s.size(1);
    w = (w.reshape({E, N, G, K / G}) * s.transpose(1, 2).unsqueeze(-1)).reshape({E, N, K});
  }
  return original_row_order(w, gate_up).contiguous();
}

}  // namespace kt::moe
