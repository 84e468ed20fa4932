// The weight scales of one group for 16 columns, as the AVX-512 kernels and the AMX walks' epilogues (compiled with
// AVX-512) read them: the float32 form (b_scale / b_min), or the two-level form given alone (kernels.h: byte
// sub-scales times their fp32 super-scale, the product expand_kscales formed, bit for bit).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "../kernels.h"

namespace kt::kernels {

// group g (in super-block sb = super_of(a, g), kernels.h), columns col..col+15 (b_scale's column index); minimum:
// the affine minimums
__attribute__((always_inline)) inline __m512 group_scales16(const GemmArgs& a, bool minimum, int64_t g, int64_t sb,
                                                            int64_t col) {
  if (a.b_scale != nullptr) return _mm512_loadu_ps((minimum ? a.b_min : a.b_scale) + g * a.b_scale_group_stride + col);
  const __m128i bytes = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>((minimum ? a.b_min_sub : a.b_sub) + g * a.b_sub_group_stride + col));
  // (the zero-masked forms with every lane on: the same instructions, without the unmasked intrinsics' undefined
  // source operand, which gcc 12 reports as maybe uninitialized at every inlined use)
  const __m512i sub =
      a.b_sub_signed ? _mm512_maskz_cvtepi8_epi32(0xffff, bytes) : _mm512_maskz_cvtepu8_epi32(0xffff, bytes);
  const float* super = (minimum ? a.b_min_super : a.b_super) + sb * a.b_super_group_stride;
  return _mm512_mul_ps(_mm512_loadu_ps(super + col), _mm512_maskz_cvtepi32_ps(0xffff, sub));
}

// Prefetches group g's scale line (and its minimum's) of the 16 columns at col into L1, in either form.
inline void prefetch_group_scales(const GemmArgs& a, bool affine_min, int64_t g, int64_t col) {
  if (a.b_scale != nullptr) {
    const int64_t at = g * a.b_scale_group_stride + col;
    _mm_prefetch(reinterpret_cast<const char*>(a.b_scale + at), _MM_HINT_T0);
    if (affine_min) _mm_prefetch(reinterpret_cast<const char*>(a.b_min + at), _MM_HINT_T0);
    return;
  }
  const int64_t at = g * a.b_sub_group_stride + col;
  _mm_prefetch(reinterpret_cast<const char*>(a.b_sub + at), _MM_HINT_T0);
  if (affine_min) _mm_prefetch(reinterpret_cast<const char*>(a.b_min_sub + at), _MM_HINT_T0);
}

}  // namespace kt::kernels
