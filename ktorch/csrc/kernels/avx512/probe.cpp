// Peak probe: 12 independent accumulator chains per round hide the instruction latency, so the loop is
// bound by the dot-product issue rate alone. 32 pairs x 2 ops (bf16) or 64 quads-lanes x 2 ops (int8).
#include <immintrin.h>

#include "../probe.h"

namespace kt::kernels {

double avx512_dot_ops(int kind, int64_t iters) {
  constexpr int kChains = 12;
  const __m512i a = _mm512_set1_epi32(0x3f803f80), b = _mm512_set1_epi32(0x01010101);
  if (kind == 0) {
    __m512 acc[kChains];
    for (auto& v : acc) v = _mm512_setzero_ps();
    for (int64_t i = 0; i < iters; ++i) {
      for (auto& v : acc) v = _mm512_dpbf16_ps(v, (__m512bh)a, (__m512bh)a);
      asm volatile("" ::"v"(acc[0]));
    }
    __m512 s = acc[0];
    for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    return static_cast<double>(iters) * kChains * 32 * 2;
  }
  __m512i acc[kChains];
  for (auto& v : acc) v = _mm512_setzero_si512();
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& v : acc) v = _mm512_dpbusd_epi32(v, b, b);
    asm volatile("" ::"v"(acc[0]));
  }
  __m512i s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_epi32(s, acc[i]);
  volatile int sink = _mm512_reduce_add_epi32(s);
  (void)sink;
  return static_cast<double>(iters) * kChains * 64 * 2;
}

}  // namespace kt::kernels
