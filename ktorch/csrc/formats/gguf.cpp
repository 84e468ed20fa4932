// GGUF block formats, decoded in one parallel pass over the blocks. Each block is self-contained (its own scales),
// so blocks are independent work items. Layouts (GGML's, little-endian; "f16" is IEEE half):
//   Q8_0  34 B / 32 values:  f16 d, int8 q[32];                                v = q * d
//   Q4_0  18 B / 32 values:  f16 d, u8 qs[16]; value i<16 is the low nibble of qs[i], i>=16 the high nibble
//                            of qs[i-16];                                      v = d * (q - 8)
//   Q4_K 144 B / 256 values: f16 d, f16 dmin, u8 scales[12] (eight 6-bit scales and mins, below), u8 qs[128];
//                            sub-block j (32 values) = nibble j%2 of qs[32*(j/2) ...];  v = (d*sc[j]) * q - dmin*m[j]
//   Q5_K 176 B / 256 values: as Q4_K plus u8 qh[32] (before qs): bit j of qh[l] is bit 4 of value l of sub-block j
//   Q6_K 210 B / 256 values: u8 ql[128], u8 qh[64], int8 scales[16], f16 d; value i = 128*H + r (H = i/128):
//                            low 4 bits = nibble (r/64) of ql[64*H + r%64], high 2 bits = bits 2*(r/32) of
//                            qh[32*H + r%32]; q = that - 32;               v = (d*scales[i/16]) * q
// K-quant 6-bit scales/mins (bytes s[0..11]): for j<4, sc = s[j] & 63, m = s[j+4] & 63; for j>=4,
//   sc = (s[j+4] & 15) | ((s[j-4] >> 6) << 4), m = (s[j+4] >> 4) | ((s[j] >> 6) << 4).
#include "gguf.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace kt::formats {
namespace {

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

void k_scale_min(const uint8_t* s, int j, int& sc, int& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

void q8_0(const uint8_t* b, float* v) {
  const float d = f16(b);
  for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(static_cast<int8_t>(b[2 + i])) * d;
}

void q4_0(const uint8_t* b, float* v) {
  const float d = f16(b);
  const uint8_t* qs = b + 2;
  for (int i = 0; i < 16; ++i) {
    v[i] = d * static_cast<float>((qs[i] & 15) - 8);
    v[i + 16] = d * static_cast<float>((qs[i] >> 4) - 8);
  }
}

// Q4_K and Q5_K share everything but the fifth bit (qh, Q5_K only).
template <bool kFifthBit>
void qk_4_5(const uint8_t* b, float* v) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 16 + (kFifthBit ? 32 : 0);
  for (int j = 0; j < 8; ++j) {
    int sc, m;
    k_scale_min(scales, j, sc, m);
    const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(m);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) {
      int x = (q[l] >> shift) & 15;
      if constexpr (kFifthBit) x |= ((qh[l] >> j) & 1) << 4;
      const float p = ds * static_cast<float>(x);
      v[32 * j + l] = p - dm;
    }
  }
}

void q6_k(const uint8_t* b, float* v) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int i = 0; i < 256; ++i) {
    const int H = i / 128, r = i % 128;
    const int lo = (ql[64 * H + r % 64] >> (4 * (r / 64))) & 15;
    const int hi = (qh[32 * H + r % 32] >> (2 * (r / 32))) & 3;
    const int q = static_cast<int8_t>(lo | (hi << 4)) - 32;
    v[i] = (d * static_cast<float>(scales[i / 16])) * static_cast<float>(q);
  }
}

struct Format {
  const char* name;
  int64_t type_size, block_size;
  void (*decode)(const uint8_t*, float*);
};

constexpr Format kFormats[] = {
    {"Q8_0", 34, 32, q8_0}, {"Q4_0", 18, 32, q4_0}, {"Q4_K", 144, 256, qk_4_5<false>},
    {"Q5_K", 176, 256, qk_4_5<true>}, {"Q6_K", 210, 256, q6_k},
};

const Format& checked_format(const at::Tensor& blocks, const std::string& qtype, const char* op) {
  const Format* fmt = nullptr;
  for (const Format& f : kFormats) {
    if (qtype == f.name) fmt = &f;
  }
  TORCH_CHECK(fmt != nullptr, op, ": qtype must be one of Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, got '", qtype, "'");
  TORCH_CHECK(blocks.device().is_cpu(), op, ": blocks must be a CPU tensor, got device ", blocks.device());
  TORCH_CHECK(blocks.scalar_type() == at::kByte, op, ": blocks must be uint8, got ", blocks.scalar_type());
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(1) == fmt->type_size, op, ": ", qtype, " blocks must be [n, ",
              fmt->type_size, "] bytes, got shape ", blocks.sizes());
  return *fmt;
}

void decode_all(const Format& fmt, const at::Tensor& blocks, float* o) {
  const at::Tensor src = blocks.contiguous();
  const uint8_t* in = src.data_ptr<uint8_t>();
  at::parallel_for(0, src.size(0), 2048, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0; i < b1; ++i) fmt.decode(in + i * fmt.type_size, o + i * fmt.block_size);
  });
}

}  // namespace

at::Tensor gguf_dequantize(const at::Tensor& blocks, const std::string& qtype) {
  const Format& fmt = checked_format(blocks, qtype, "gguf_dequantize");
  at::Tensor out = at::empty({blocks.size(0), fmt.block_size}, blocks.options().dtype(at::kFloat));
  decode_all(fmt, blocks, out.data_ptr<float>());
  return out;
}

void gguf_dequantize_into(const at::Tensor& blocks, const std::string& qtype, const at::Tensor& out) {
  const Format& fmt = checked_format(blocks, qtype, "gguf_dequantize_into");
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "gguf_dequantize_into: out must be a contiguous float32 CPU tensor, got ", out.scalar_type(), " on ",
              out.device(), out.is_contiguous() ? "" : " (not contiguous)");
  TORCH_CHECK(out.numel() == blocks.size(0) * fmt.block_size, "gguf_dequantize_into: out must hold ",
              blocks.size(0) * fmt.block_size, " values (", blocks.size(0), " blocks of ", fmt.block_size, "), got ",
              out.numel());
  decode_all(fmt, blocks, out.data_ptr<float>());
}

}  // namespace kt::formats
