// Portable kernels: plain C++ over the packed layouts described in kernels.h, compiled for the baseline
// x86-64 ISA (any CPU runs them). They define the arithmetic every faster kernel must reproduce:
// fp32 accumulation of bf16 products; int32 accumulation of int8 products with the weights offset to
// unsigned (+128 for int8, +8 for symmetric int4, code_offset for coded int4: MXFP4) and the offset removed through
// the activation group sums; the affine formats' minimums subtracted per group as min * (group sum of the quantized
// activations).
// Speed is not their purpose: they are the path of last resort and the executable specification.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../kernels.h"

namespace kt::kernels {
namespace {

inline float bf16_to_f32(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

void gemm_bf16(const GemmArgs& a) {
  const int64_t pairs = a.K / 2;
  for (int b = 0; b < a.nblocks; ++b) {
    const uint16_t* w = reinterpret_cast<const uint16_t*>(a.b + b * a.b_block_stride);
    for (int m = 0; m < a.M; ++m) {
      const uint16_t* x = static_cast<const uint16_t*>(a.a_rows[m]);
      float acc[16] = {0};
      for (int64_t p = 0; p < pairs; ++p) {
        const float x0 = bf16_to_f32(x[2 * p]), x1 = bf16_to_f32(x[2 * p + 1]);
        const uint16_t* wp = w + p * 32;
        for (int c = 0; c < 16; ++c) acc[c] += bf16_to_f32(wp[2 * c]) * x0 + bf16_to_f32(wp[2 * c + 1]) * x1;
      }
      std::memcpy(a.c + m * a.ldc + 16 * b, acc, sizeof(acc));
    }
  }
}

// Per-channel int8 (one group of K, no minimums): one int32 sum, dequantized once.
void gemm_int8_channel(const GemmArgs& a) {
  const int64_t quads = a.K / 4;
  for (int b = 0; b < a.nblocks; ++b) {
    const int8_t* w = reinterpret_cast<const int8_t*>(a.b + b * a.b_block_stride);
    const float* ws = a.b_scale + b * a.b_scale_block_stride;
    for (int m = 0; m < a.M; ++m) {
      const int8_t* x = static_cast<const int8_t*>(a.a_rows[m]);
      int32_t acc[16] = {0};
      for (int64_t q = 0; q < quads; ++q) {
        const int8_t* wq = w + q * 64;
        for (int c = 0; c < 16; ++c)
          for (int j = 0; j < 4; ++j) acc[c] += (static_cast<int32_t>(wq[4 * c + j]) + 128) * x[4 * q + j];
      }
      const int32_t offset = 128 * a.a_gsum[m * a.a_gsum_stride];
      for (int c = 0; c < 16; ++c)
        a.c[m * a.ldc + 16 * b + c] = static_cast<float>(acc[c] - offset) * ws[c] * a.a_scale[m];
    }
  }
}

// The grouped formats' walk: per block of 16 columns, row and group g, an int32 group sum gacc from
// group_dot(w, x, g, gacc); the code offset removed with the group's activation sum, scaled by the group's weight
// scale (group_scale: float32, or two-level) into an fp32 sum; affine formats then subtract min[g] * sum_g(x); the
// activation scale last.
template <typename GroupDot>
void gemm_grouped(const GemmArgs& a, int32_t code_offset, GroupDot group_dot) {
  const int64_t groups = a.K / a.group_size;
  for (int b = 0; b < a.nblocks; ++b) {
    const uint8_t* w = a.b + b * a.b_block_stride;
    const int64_t col = b * a.b_scale_block_stride;
    const bool has_min = affine(a);
    for (int m = 0; m < a.M; ++m) {
      const int8_t* x = static_cast<const int8_t*>(a.a_rows[m]);
      float acc[16] = {0};
      for (int64_t g = 0; g < groups; ++g) {
        int32_t gacc[16] = {0};
        group_dot(w, x, g, gacc);
        const int32_t gsum = a.a_gsum[m * a.a_gsum_stride + g];
        for (int c = 0; c < 16; ++c) {
          acc[c] += static_cast<float>(gacc[c] - code_offset * gsum) * group_scale(a, false, g, col + c);
          if (has_min) acc[c] -= static_cast<float>(gsum) * group_scale(a, true, g, col + c);
        }
      }
      for (int c = 0; c < 16; ++c) a.c[m * a.ldc + 16 * b + c] = acc[c] * a.a_scale[m];
    }
  }
}

// Grouped int8 (GGUF Q8_0, Q6_K; Q5_K and MXFP4 codes): a group sums (q + 128) * x over its quads (code offset 128).
void gemm_int8_grouped(const GemmArgs& a) {
  const int64_t quads_per_group = a.group_size / 4;
  gemm_grouped(a, 128, [&](const uint8_t* w, const int8_t* x, int64_t g, int32_t* gacc) {
    for (int64_t q = g * quads_per_group; q < (g + 1) * quads_per_group; ++q) {
      const int8_t* wq = reinterpret_cast<const int8_t*>(w) + q * 64;
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < 4; ++j) gacc[c] += (static_cast<int32_t>(wq[4 * c + j]) + 128) * x[4 * q + j];
    }
  });
}

void gemm_int8(const GemmArgs& a) {
  if (!affine(a) && (a.group_size == 0 || a.group_size == a.K)) gemm_int8_channel(a);
  else gemm_int8_grouped(a);
}

// int4: symmetric, (u - 8) * s per group; affine (b_min), u * s - min per group; coded (b_codes), codes[u] * s per
// group, summed as (codes[u] + offset) * x with offset = code_offset(codes) (the unsigned operand the AVX-512 kernel
// makes). A group sums the nibbles u (or their offset codes) times x over its octs (low nibbles the first 4 of 8
// inputs, high nibbles the last 4).
void gemm_int4(const GemmArgs& a) {
  const int64_t octs_per_group = a.group_size / 8;
  if (a.b_codes != nullptr) {
    const int32_t offset = code_offset(a.b_codes);
    int32_t value[16];
    for (int u = 0; u < 16; ++u) value[u] = a.b_codes[u] + offset;
    gemm_grouped(a, offset, [&](const uint8_t* w, const int8_t* x, int64_t g, int32_t* gacc) {
      for (int64_t o = g * octs_per_group; o < (g + 1) * octs_per_group; ++o) {
        const uint8_t* wo = w + o * 64;
        for (int c = 0; c < 16; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t v = wo[4 * c + j];
            gacc[c] += value[v & 0xf] * x[8 * o + j] + value[v >> 4] * x[8 * o + 4 + j];
          }
      }
    });
    return;
  }
  gemm_grouped(a, affine(a) ? 0 : 8, [&](const uint8_t* w, const int8_t* x, int64_t g, int32_t* gacc) {
    for (int64_t o = g * octs_per_group; o < (g + 1) * octs_per_group; ++o) {
      const uint8_t* wo = w + o * 64;
      for (int c = 0; c < 16; ++c)
        for (int j = 0; j < 4; ++j) {
          const uint8_t v = wo[4 * c + j];
          gacc[c] += (v & 0xf) * x[8 * o + j] + (v >> 4) * x[8 * o + 4 + j];
        }
    }
  });
}

inline float activate(float g, Activation act) {
  switch (act) {
    case Activation::SiLU: return g / (1.0f + std::exp(-g));
    case Activation::GeluTanh: {
      const float inner = 0.7978845608028654f * (g + 0.044715f * g * g * g);
      return 0.5f * g * (1.0f + std::tanh(inner));
    }
    case Activation::Gelu: return 0.5f * g * (1.0f + std::erf(g * 0.7071067811865476f));
    case Activation::Relu: return g > 0.0f ? g : 0.0f;
  }
  return g;
}

void glu_f32(const float* c, int64_t ldc, int M, int n, Activation act, float* out, int64_t ldo) {
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < n; ++i) out[m * ldo + i] = activate(c[m * ldc + i], act) * c[m * ldc + n + i];
}

void glu_bf16(const float* c, int64_t ldc, int M, int n, Activation act, uint16_t* out, int64_t ldo) {
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < n; ++i) out[m * ldo + i] = f32_to_bf16(activate(c[m * ldc + i], act) * c[m * ldc + n + i]);
}

void quantize_rows(const float* x, int64_t ldx, int M, int64_t K, int64_t group_size, int8_t* q, int64_t ldq,
                   float* scale, int32_t* gsum) {
  const int64_t groups = K / group_size;
  for (int m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float s = amax / 127.0f;
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    scale[m] = s;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * group_size; k < (g + 1) * group_size; ++k) {
        const int32_t v = static_cast<int32_t>(std::nearbyint(xr[k] * inv));
        q[m * ldq + k] = static_cast<int8_t>(std::clamp(v, -127, 127));
        sum += q[m * ldq + k];
      }
      gsum[m * groups + g] = sum;
    }
  }
}

void scatter_add(const float* src, int64_t lds, int M, int64_t n, const float* w, const int64_t* rows,
                 const uint8_t* assign, float* dst, int64_t ldd) {
  for (int m = 0; m < M; ++m) {
    float* __restrict__ d = dst + rows[m] * ldd;
    const float* __restrict__ s = src + m * lds;
    if (assign != nullptr && assign[m] != 0) {
      for (int64_t j = 0; j < n; ++j) d[j] = w[m] * s[j];
    } else {
      for (int64_t j = 0; j < n; ++j) d[j] += w[m] * s[j];
    }
  }
}

void sum_rows(const float* const* src, int n_src, int64_t n, bool bf16_out, void* dst) {
  for (int64_t j = 0; j < n; ++j) {
    float v = n_src > 0 ? src[0][j] : 0.0f;
    for (int s = 1; s < n_src; ++s) v += src[s][j];
    if (bf16_out) static_cast<uint16_t*>(dst)[j] = f32_to_bf16(v);
    else static_cast<float*>(dst)[j] = v;
  }
}

}  // namespace

const KernelSet& portable_kernels() {
  static const KernelSet set{"portable", {gemm_bf16, gemm_int8, gemm_int4}, glu_f32, glu_bf16, quantize_rows,
                             scatter_add, sum_rows};
  return set;
}

}  // namespace kt::kernels
