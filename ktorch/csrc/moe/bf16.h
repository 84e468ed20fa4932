// fp32 <-> bf16 of the op driver (its activation rows; the training forward's deltas and h); the kernels' sum_rows
// rounds the same way.
#pragma once

#include <cstdint>
#include <cstring>

namespace kt::moe {

// Round to nearest even (NaN kept quiet), as the kernels' own bf16 conversions.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float bf16_to_f32(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace kt::moe
