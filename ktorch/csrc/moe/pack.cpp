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
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../kernels/kernels.h"
#include "../runtime/memory.h"

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

// The rows of experts [e0, e1) in packed order as fp32. A contiguous fp32 weight is read in place (packed row p of a
// gate_up weight is its row (p % 64) / 32 * N/2 + p / 64 * 32 + p % 32); any other dtype or strides is first copied,
// one chunk at a time, into a reused fp32 buffer.
class PackedRows {
 public:
  PackedRows(const at::Tensor& weight, bool gate_up)
      : weight_(weight), gate_up_(gate_up), N_(weight.size(1)), K_(weight.size(2)),
        direct_(weight.scalar_type() == at::kFloat && weight.is_contiguous()) {}

  void load(int64_t e0, int64_t e1) {
    e0_ = e0;
    if (direct_) {
      base_ = weight_.data_ptr<float>() + e0 * N_ * K_;
      return;
    }
    const int64_t e = e1 - e0;
    if (!buffer_.defined() || buffer_.size(0) < e) buffer_ = at::empty({e, N_, K_}, weight_.options().dtype(at::kFloat));
    at::Tensor out = buffer_.narrow(0, 0, e);
    at::Tensor w = weight_.slice(0, e0, e1);
    if (gate_up_) {
      out.view({e, N_ / 64, 2, 32, K_}).copy_(w.reshape({e, 2, N_ / 64, 32, K_}).transpose(1, 2));
    } else {
      out.copy_(w);
    }
    base_ = buffer_.data_ptr<float>();
  }

  // Row n (packed order) of expert e (e0 <= e < e1 of the last load).
  const float* row(int64_t e, int64_t n) const {
    const int64_t src = direct_ && gate_up_ ? (n % 64) / 32 * (N_ / 2) + n / 64 * 32 + n % 32 : n;
    return base_ + ((e - e0_) * N_ + src) * K_;
  }

 private:
  const at::Tensor& weight_;
  const bool gate_up_;
  const int64_t N_, K_;
  const bool direct_;
  at::Tensor buffer_;
  const float* base_ = nullptr;
  int64_t e0_ = 0;
};

[[noreturn]] void non_finite(const char* op, int64_t expert, int64_t row, int64_t col) {
  TORCH_CHECK(false, op, ": weight has a non-finite value (inf or nan) in expert ", expert, ", output row ", row,
              " (packed order), columns from ", col, ": it cannot be quantized");
}

// max |x[k]| over n floats (n a multiple of 8), nan if any x[k] is nan; eight independent lanes so that the
// compiler vectorizes it.
inline float abs_max(const float* x, int64_t n) {
  float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  bool nan = false;
  for (int64_t k = 0; k < n; k += 8) {
    for (int j = 0; j < 8; ++j) {
      const float a = std::abs(x[k + j]);
      m[j] = a > m[j] ? a : m[j];
      nan |= a != a;
    }
  }
  float r = 0.0f;
  for (int j = 0; j < 8; ++j) r = std::max(r, m[j]);
  return nan ? std::numeric_limits<float>::quiet_NaN() : r;
}

// q = round_half_even(x / d) clamped to [lo, hi]; d > 0 and x finite. The clamp comes first (|x / d| can be far
// beyond hi only for d = 1e-30 on a zero row, where x = 0 anyway), then rounding by adding and subtracting 1.5 * 2^23:
// for |v| <= 2^22 the sum's last place is 1, so the float addition itself rounds v to the nearest integer, ties to
// even, exactly as torch.round (this vectorizes at the baseline ISA, where std::nearbyint is a library call).
inline int quantize(float x, float d, float lo, float hi) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  const float v = std::min(std::max(x / d, lo), hi);
  return static_cast<int>((v + kMagic) - kMagic);
}

}  // namespace

at::Tensor pack_bf16(const at::Tensor& weight, bool gate_up) {
  check_weight(weight, "pack_bf16", gate_up, 32);
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2);
  at::Tensor out = kt::runtime::empty_weights({E, N / 16, K / 2, 16, 2}, weight.options().dtype(at::kBFloat16));
  for_expert_chunks(E, [&](int64_t e0, int64_t e1) {  // the conversion is torch's own (nan bits included)
    out.slice(0, e0, e1).copy_(to_lanes(packed_row_order(weight.slice(0, e0, e1), gate_up), 2));
  });
  return out;
}

// The quantizing packers run one pass per chunk of experts, parallel over blocks of 16 output rows: the scales of
// a row (group), then its codes written straight into the lane layout.
std::tuple<at::Tensor, at::Tensor> pack_int8(const at::Tensor& weight, bool gate_up) {
  check_weight(weight, "pack_int8", gate_up, 32);
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2);
  at::Tensor out = kt::runtime::empty_weights({E, N / 16, K / 4, 16, 4}, weight.options().dtype(at::kChar));
  at::Tensor scales = at::empty({E, 1, N}, weight.options().dtype(at::kFloat));
  int8_t* o = out.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  PackedRows rows(weight, gate_up);
  for_expert_chunks(E, [&](int64_t e0, int64_t e1) {
    rows.load(e0, e1);
    at::parallel_for(0, (e1 - e0) * (N / 16), 1, [&](int64_t b0, int64_t b1) {
      std::vector<int8_t> q(K);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t e = e0 + b / (N / 16), nb = b % (N / 16);
        int8_t* blk = o + (e * (N / 16) + nb) * K * 16;
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t n = nb * 16 + r;
          const float* row = rows.row(e, n);
          const float amax = abs_max(row, K);
          if (!std::isfinite(amax)) non_finite("pack_int8", e, n, 0);
          const float scale = amax / 127.0f, d = std::max(scale, 1e-30f);
          sc[e * N + n] = scale;
          for (int64_t k = 0; k < K; ++k) q[k] = static_cast<int8_t>(quantize(row[k], d, -127.0f, 127.0f));
          for (int64_t k = 0; k < K; k += 4) std::memcpy(blk + k * 16 + r * 4, q.data() + k, 4);  // (k/4)*64 + r*4
        }
      }
    });
  });
  return {out, scales};
}

std::tuple<at::Tensor, at::Tensor> pack_int4(const at::Tensor& weight, int64_t group_size, bool gate_up,
                                              bool two_level) {
  check_weight(weight, "pack_int4", gate_up, 32);
  const int64_t E = weight.size(0), N = weight.size(1), K = weight.size(2);
  TORCH_CHECK(group_size > 0 && group_size % 32 == 0 && K % group_size == 0,
              "pack_int4: group_size must be a positive multiple of 32 that divides K=", K, ", got ", group_size);
  TORCH_CHECK(!two_level || (K % 256 == 0 && 256 % group_size == 0),
              "pack_int4: two-level scales need K a multiple of 256 and groups that divide 256, got K=", K,
              " and group_size ", group_size);
  const int64_t G = K / group_size, S = K / 256;
  at::Tensor out = kt::runtime::empty_weights({E, N / 16, K / 8, 16, 4}, weight.options().dtype(at::kByte));
  // float32 [E, G, N]; two-level: uint8 [E, G + K/64, N], the sub-scale rows, then the super-scales' float32 [S][N]
  at::Tensor scales = two_level ? at::empty({E, G + 4 * S, N}, weight.options().dtype(at::kByte))
                                : at::empty({E, G, N}, weight.options().dtype(at::kFloat));
  uint8_t* o = out.data_ptr<uint8_t>();
  float* sc = two_level ? nullptr : scales.data_ptr<float>();
  uint8_t* sub = two_level ? scales.data_ptr<uint8_t>() : nullptr;
  PackedRows rows(weight, gate_up);
  for_expert_chunks(E, [&](int64_t e0, int64_t e1) {
    rows.load(e0, e1);
    at::parallel_for(0, (e1 - e0) * (N / 16), 1, [&](int64_t b0, int64_t b1) {
      std::vector<uint8_t> u(K);
      std::vector<float> amax(G);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t e = e0 + b / (N / 16), nb = b % (N / 16);
        uint8_t* blk = o + (e * (N / 16) + nb) * (K / 2) * 16;
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t n = nb * 16 + r;
          const float* row = rows.row(e, n);
          float row_max = 0.0f;
          for (int64_t g = 0; g < G; ++g) {
            amax[g] = abs_max(row + g * group_size, group_size);
            if (!std::isfinite(amax[g])) non_finite("pack_int4", e, n, g * group_size);
            row_max = std::max(row_max, amax[g]);
          }
          // two-level: the row's super-scale s = max / (7 * 15), each group's sub-scale c in 1..15 (so c * q fits a
          // signed byte: the AMX walk's single tile plane), of round(amax / 7s) and the three below it the one whose
          // codes give the group the least squared error (a smaller scale clips the group's largest weights but
          // rounds the rest finer: Gaussian rows, groups of 128, error 0.1024 against 0.1176 for round(amax / 7s)
          // alone and 0.1174 for the float32 form's amax / 7; groups of 32 0.0890 against 0.0979)
          const float super = row_max / 105.0f;
          if (two_level) {
            uint8_t* sp = sub + (e * (G + 4 * S)) * N + G * N;  // [S][N] float32 as bytes
            for (int64_t s = 0; s < S; ++s) std::memcpy(sp + (s * N + n) * 4, &super, 4);
          }
          for (int64_t g = 0; g < G; ++g) {
            const float* x = row + g * group_size;
            float scale = amax[g] / 7.0f;
            if (two_level) {
              const float r = super > 0.0f ? std::min(15.0f, std::max(1.0f, std::nearbyint(amax[g] / (7.0f * super))))
                                           : 1.0f;
              float cand[4], d[4], err[4] = {0.0f, 0.0f, 0.0f, 0.0f};
              for (int i = 0; i < 4; ++i) {
                cand[i] = std::max(1.0f, r - static_cast<float>(i));
                d[i] = std::max(super * cand[i], 1e-30f);  // as the codes below are quantized
              }
              for (int64_t k = 0; k < group_size; ++k)  // (one pass for the four: the compiler vectorizes over k)
                for (int i = 0; i < 4; ++i) {
                  const float diff = static_cast<float>(quantize(x[k], d[i], -8.0f, 7.0f)) * d[i] - x[k];
                  err[i] += diff * diff;
                }
              float c = cand[0], best = err[0];
              for (int i = 1; i < 4; ++i)
                if (err[i] < best) c = cand[i], best = err[i];
              sub[(e * (G + 4 * S) + g) * N + n] = static_cast<uint8_t>(c);
              scale = super * c;
            } else {
              sc[(e * G + g) * N + n] = scale;
            }
            const float d = std::max(scale, 1e-30f);
            for (int64_t k = 0; k < group_size; ++k) u[g * group_size + k] = static_cast<uint8_t>(quantize(x[k], d, -8.0f, 7.0f) + 8);
          }
          // 8 values per 4 bytes: byte j holds value j (low nibble) and value 4 + j (high nibble)
          for (int64_t kb = 0; kb < K / 8; ++kb) {
            for (int64_t j = 0; j < 4; ++j) {
              blk[kb * 64 + r * 4 + j] = static_cast<uint8_t>(u[kb * 8 + j] | (u[kb * 8 + 4 + j] << 4));
            }
          }
        }
      }
    });
  });
  return {out, scales};
}

at::Tensor kscales_as_float(const at::Tensor& scales, int64_t K) {
  if (scales.scalar_type() == at::kHalf) return scales.to(at::kFloat);  // Q8_0's fp16 scales (exact)
  if (scales.scalar_type() != at::kByte && scales.scalar_type() != at::kChar) return scales;
  TORCH_CHECK((scales.dim() == 3 || (scales.dim() == 4 && scales.size(1) == 2)) && K % 256 == 0 &&
                  scales.size(-2) > K / 64 && (scales.size(-2) - K / 64) % (K / 256) == 0,
              "two-level scales must be uint8/int8 [E, G + K/64, N] or [E, 2, G + K/64, N] with K a multiple of 256 and ",
              "G a multiple of K/256, got ", scales.sizes(), " for K=", K);
  const at::Tensor s = scales.dim() == 3 ? scales.unsqueeze(1) : scales;
  const int64_t E = s.size(0), P = s.size(1), R = s.size(2), N = s.size(3), S = K / 256, G = R - 4 * S;
  const at::Tensor sub = s.narrow(2, 0, G).to(at::kFloat);
  const at::Tensor sup = s.narrow(2, G, 4 * S).contiguous().view(at::kByte).reshape({E, P, 4 * S * N})
                             .view(at::kFloat).reshape({E, P, S, N});
  at::Tensor out = sup.repeat_interleave(G / S, 2) * sub;
  return scales.dim() == 3 ? out.squeeze(1).contiguous() : out.contiguous();
}

at::Tensor unpack(const at::Tensor& packed, const std::optional<at::Tensor>& scales_in, bool gate_up) {
  TORCH_CHECK(packed.device().is_cpu(), "unpack: packed must be a CPU tensor, got device ", packed.device());
  TORCH_CHECK(packed.dim() == 5 && packed.size(3) == 16, "unpack: packed must be [E, N/16, K/per, 16, per], got shape ",
              packed.sizes());
  const auto dtype = packed.scalar_type();
  const int64_t E = packed.size(0), N = packed.size(1) * 16;
  at::Tensor w;
  if (dtype == at::kBFloat16) {
    TORCH_CHECK(!scales_in.has_value(), "unpack: bf16 packed weights take no scales");
    TORCH_CHECK(packed.size(4) == 2, "unpack: bf16 packed weights must end in [16, 2], got ", packed.sizes());
    w = from_lanes(packed).to(at::kFloat);
  } else {
    const bool mxfp4 = dtype == at::ScalarType::Float4_e2m1fn_x2;  // int4 layout, nibbles through kMxfp4Codes
    TORCH_CHECK(dtype == at::kChar || dtype == at::kByte || mxfp4,
                "unpack: packed weights must be bfloat16, int8, uint8 (int4) or float4_e2m1fn_x2 (MXFP4 nibbles), got ",
                dtype);
    TORCH_CHECK(packed.size(4) == 4, "unpack: quantized packed weights must end in [16, 4], got ", packed.sizes());
    TORCH_CHECK(scales_in.has_value(), "unpack: quantized packed weights need their scales");
    const int64_t K = dtype == at::kChar ? packed.size(2) * 4 : packed.size(2) * 8;
    const at::Tensor s = kscales_as_float(*scales_in, K);
    // [E, G, N]: W = q * s; [E, 2, G, N] (affine): W = q * s - m, int4 codes the unsigned nibbles themselves
    const bool affine = s.dim() == 4;
    TORCH_CHECK(s.scalar_type() == at::kFloat && (s.dim() == 3 || (affine && s.size(1) == 2)) && s.size(0) == E &&
                    s.size(-1) == N && s.size(-2) > 0 && K % s.size(-2) == 0,
                "unpack: scales must be float32 [E=", E, ", G, N=", N, "] or [E, 2, G, N] (scales, minimums) with G ",
                "dividing K=", K, " (or float16 like them, or two-level uint8/int8: ktorch.ops.moe.pack_kscales), got ",
                s.scalar_type(), " ", s.sizes());
    const int64_t G = s.size(-2);
    if (dtype == at::kChar) {
      TORCH_CHECK((G == 1 && !affine) || (K / G) % 16 == 0, "unpack: grouped or affine int8 scales need groups of a ",
                  "multiple of 16 input channels, got ", s.sizes(), " for K=", K);
      w = from_lanes(packed).to(at::kFloat);
    } else {
      TORCH_CHECK(!(mxfp4 && affine), "unpack: MXFP4 nibbles take scales [E, G, N], got ", s.sizes());
      const at::Tensor bytes = mxfp4 ? packed.view(at::kByte) : packed;
      at::Tensor lo = bytes.bitwise_and(0xf), hi = bytes.bitwise_right_shift(4);
      at::Tensor q = at::stack({lo, hi}, 3);  // [E, N/16, K/8, 2, 16, 4]
      if (mxfp4) {
        const at::Tensor table = at::from_blob(const_cast<int8_t*>(kernels::kMxfp4Codes), {16}, at::kChar);
        q = table.to(at::kFloat).index_select(0, q.reshape({-1}).to(at::kLong)).reshape(q.sizes());
      } else {
        q = q.to(at::kFloat);
        if (!affine) q.sub_(8);
      }
      w = q.permute({0, 1, 4, 2, 3, 5}).reshape({E, N, K});
    }
    const at::Tensor scale = affine ? s.select(1, 0) : s;
    w = w.reshape({E, N, G, K / G}) * scale.transpose(1, 2).unsqueeze(-1);
    if (affine) w = w - s.select(1, 1).transpose(1, 2).unsqueeze(-1);
    w = w.reshape({E, N, K});
  }
  return original_row_order(w, gate_up).contiguous();
}

}  // namespace kt::moe
