// AVX2 kernels (AVX2 + FMA), for the packed layouts in kernels.h: the x86-64 machines without AVX-512 (AMD Zen 2 and
// 3, Intel's client cores), which otherwise run the portable kernels.
//
// The int8 and int4 gemms form the same int32 sums as the portable kernels (exact), as 8-column halves of each
// 16-column block: u8 x s8 pair products (vpmaddubsw) widened to int32 (vpmaddwd by ones). The unsigned operand is
// the nibble u (or an MXFP4 code shuffled to codes[u] + offset), or for int8 |w| with the sign moved onto the
// activation (vpsignb): pair sums stay below 2^15 because the activation codes are in [-127, 127] (kernels.h).
// Then per group, in fp32: acc += (sum - offset * sum_g(x)) * s_w[g] (fused multiply-add), affine acc -= sum_g(x) *
// min[g], and the activation scale last; so results equal the portable kernels' within fp32 rounding (the fused
// multiply-add rounds once). bf16: fp32 products of the bf16 pairs, fused into fp32 accumulators.
// Rows go in pairs (row_pairs), each pair walking a block's whole K, each weight line prefetched
// GemmArgs::prefetch_ahead lines ahead (session 51, the AVX2 CI kind: int4 5-18% faster at T = 1 and 8 in every run,
// Q4_K in 8 of 9, int8 4% in one, Q8_0 within noise; prefetching the strided scale lines too was slower; commit
// 8829a31); the other KernelSet entries are the portable ones.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "../kernels.h"

namespace kt::kernels {
namespace {

inline __m256i bcast32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// The 16 scales (minimum: the affine minimums) of group g for the 16 columns at col (b_scale's column index), in two
// halves: the float32 form, or the two-level product super * sub (kernels.h group_scale, the same fp32 product).
inline void group_scales(const GemmArgs& a, bool minimum, int64_t g, int64_t col, __m256 (&s)[2]) {
  if (a.b_scale != nullptr) {
    const float* p = (minimum ? a.b_min : a.b_scale) + g * a.b_scale_group_stride + col;
    s[0] = _mm256_loadu_ps(p);
    s[1] = _mm256_loadu_ps(p + 8);
    return;
  }
  const __m128i bytes = _mm_loadu_si128(
      reinterpret_cast<const __m128i*>((minimum ? a.b_min_sub : a.b_sub) + g * a.b_sub_group_stride + col));
  const __m128i upper = _mm_srli_si128(bytes, 8);
  const __m256i sub0 = a.b_sub_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  const __m256i sub1 = a.b_sub_signed ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
  const float* super = (minimum ? a.b_min_super : a.b_super) + super_of(a, g) * a.b_super_group_stride + col;
  s[0] = _mm256_mul_ps(_mm256_loadu_ps(super), _mm256_cvtepi32_ps(sub0));
  s[1] = _mm256_mul_ps(_mm256_loadu_ps(super + 8), _mm256_cvtepi32_ps(sub1));
}

// Each block's rows in pairs, a last odd row alone: rows(m0, b, std::integral_constant<int, R>{}) for R = 2, 1.
template <typename Rows>
void row_pairs(const GemmArgs& a, Rows rows) {
  for (int b = 0; b < a.nblocks; ++b) {
    int m = 0;
    for (; m + 2 <= a.M; m += 2) rows(m, b, std::integral_constant<int, 2>{});
    if (m < a.M) rows(m, b, std::integral_constant<int, 1>{});
  }
}

enum class Codes { Int8, Int4, Int4Coded };

// One group's int32 sums for the R rows at x (group g: lines [l0, l1) of the block at w, 64 bytes each: 4 k of int8
// or 8 k of int4 for the 16 columns) into gacc[r][half].
template <Codes kCodes, int R>
inline void group_sums(const uint8_t* w, const int8_t* const* x, int64_t l0, int64_t l1, __m256i table,
                       int64_t ahead, __m256i (&gacc)[R][2]) {
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
  for (int r = 0; r < R; ++r) gacc[r][0] = gacc[r][1] = _mm256_setzero_si256();
  for (int64_t l = l0; l < l1; ++l) {
    const uint8_t* line = w + l * 64;
    if (ahead > 0) _mm_prefetch(reinterpret_cast<const char*>(line + ahead * 64), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32 * h));
      if constexpr (kCodes == Codes::Int8) {
        const __m256i mag = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_maddubs_epi16(mag, _mm256_sign_epi8(bcast32(x[r] + 4 * l), v));
          gacc[r][h] = _mm256_add_epi32(gacc[r][h], _mm256_madd_epi16(p, ones));
        }
      } else {
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (kCodes == Codes::Int4Coded) {
          lo = _mm256_shuffle_epi8(table, lo);
          hi = _mm256_shuffle_epi8(table, hi);
        }
        for (int r = 0; r < R; ++r) {
          const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, bcast32(x[r] + 8 * l)),
                                             _mm256_maddubs_epi16(hi, bcast32(x[r] + 8 * l + 4)));
          gacc[r][h] = _mm256_add_epi32(gacc[r][h], _mm256_madd_epi16(p, ones));
        }
      }
    }
  }
}

// Rows m0 .. m0 + R - 1 of block b: every group's sums scaled into fp32 accumulators, then the activation scale.
// offset: what each unsigned code carries beyond its value (int4 symmetric 8, MXFP4 code_offset; int8 0: the sums
// are of the signed codes themselves).
template <Codes kCodes, int R>
void grouped_rows(const GemmArgs& a, int m0, int b, int32_t offset, __m256i table) {
  const uint8_t* w = a.b + b * a.b_block_stride;
  const int64_t col = b * a.b_scale_block_stride;
  const int64_t k_per_line = kCodes == Codes::Int8 ? 4 : 8, lines = a.group_size / k_per_line;
  const bool has_min = affine(a);
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = static_cast<const int8_t*>(a.a_rows[m0 + r]);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < a.K / a.group_size; ++g) {
    __m256i gacc[R][2];
    group_sums<kCodes, R>(w, x, g * lines, (g + 1) * lines, table, a.prefetch_ahead, gacc);
    __m256 ws[2], wm[2];
    group_scales(a, false, g, col, ws);
    if (has_min) group_scales(a, true, g, col, wm);
    for (int r = 0; r < R; ++r) {
      const int32_t gsum = a.a_gsum[(m0 + r) * a.a_gsum_stride + g];
      const __m256i off = _mm256_set1_epi32(offset * gsum);
      for (int h = 0; h < 2; ++h) {
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(gacc[r][h], off)), ws[h], acc[r][h]);
        if (has_min) acc[r][h] = _mm256_fnmadd_ps(_mm256_set1_ps(static_cast<float>(gsum)), wm[h], acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 xs = _mm256_set1_ps(a.a_scale[m0 + r]);
    float* out = a.c + (m0 + r) * a.ldc + 16 * b;
    _mm256_storeu_ps(out, _mm256_mul_ps(acc[r][0], xs));
    _mm256_storeu_ps(out + 8, _mm256_mul_ps(acc[r][1], xs));
  }
}

template <Codes kCodes>
void grouped_gemm(const GemmArgs& a, int32_t offset, __m256i table) {
  row_pairs(a, [&](int m, int b, auto r) { grouped_rows<kCodes, decltype(r)::value>(a, m, b, offset, table); });
}

// Per-channel int8: one sum over all of K, then (sum * s_w) * s_x, as the portable kernel orders it.
template <int R>
void channel_rows(const GemmArgs& a, int m0, int b) {
  const uint8_t* w = a.b + b * a.b_block_stride;
  const int8_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = static_cast<const int8_t*>(a.a_rows[m0 + r]);
  __m256i sums[R][2];
  group_sums<Codes::Int8, R>(w, x, 0, a.K / 4, _mm256_setzero_si256(), a.prefetch_ahead, sums);
  const float* ws = a.b_scale + b * a.b_scale_block_stride;
  for (int r = 0; r < R; ++r) {
    const __m256 xs = _mm256_set1_ps(a.a_scale[m0 + r]);
    float* out = a.c + (m0 + r) * a.ldc + 16 * b;
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(out + 8 * h,
                       _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sums[r][h]), _mm256_loadu_ps(ws + 8 * h)), xs));
  }
}

void gemm_int8(const GemmArgs& a) {
  if (!affine(a) && (a.group_size == 0 || a.group_size == a.K)) {
    row_pairs(a, [&](int m, int b, auto r) { channel_rows<decltype(r)::value>(a, m, b); });
    return;
  }
  grouped_gemm<Codes::Int8>(a, 0, _mm256_setzero_si256());
}

void gemm_int4(const GemmArgs& a) {
  if (a.b_codes != nullptr) {
    const int32_t offset = code_offset(a.b_codes);
    alignas(16) uint8_t t[16];
    for (int u = 0; u < 16; ++u) t[u] = static_cast<uint8_t>(a.b_codes[u] + offset);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t)));
    grouped_gemm<Codes::Int4Coded>(a, offset, table);
    return;
  }
  grouped_gemm<Codes::Int4>(a, affine(a) ? 0 : 8, _mm256_setzero_si256());
}

// bf16: a line is one k pair of the 16 columns (their bf16 pairs); the even k is a pair's low half.
template <int R>
void bf16_rows(const GemmArgs& a, int m0, int b) {
  const uint8_t* w = a.b + b * a.b_block_stride;
  const uint16_t* x[R];
  for (int r = 0; r < R; ++r) x[r] = static_cast<const uint16_t*>(a.a_rows[m0 + r]);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < a.K / 2; ++p) {
    __m256 x0[R], x1[R];
    for (int r = 0; r < R; ++r) {
      uint32_t e = static_cast<uint32_t>(x[r][2 * p]) << 16, o = static_cast<uint32_t>(x[r][2 * p + 1]) << 16;
      float fe, fo;
      std::memcpy(&fe, &e, 4);
      std::memcpy(&fo, &o, 4);
      x0[r] = _mm256_set1_ps(fe);
      x1[r] = _mm256_set1_ps(fo);
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 64 + 32 * h));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      for (int r = 0; r < R; ++r) acc[r][h] = _mm256_fmadd_ps(odd, x1[r], _mm256_fmadd_ps(even, x0[r], acc[r][h]));
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = a.c + (m0 + r) * a.ldc + 16 * b;
    _mm256_storeu_ps(out, acc[r][0]);
    _mm256_storeu_ps(out + 8, acc[r][1]);
  }
}

void gemm_bf16(const GemmArgs& a) {
  row_pairs(a, [&](int m, int b, auto r) { bf16_rows<decltype(r)::value>(a, m, b); });
}

}  // namespace

const KernelSet& avx2_kernels() {
  static const KernelSet set = [] {
    const KernelSet& portable = portable_kernels();
    return KernelSet{"avx2",
                     {gemm_bf16, gemm_int8, gemm_int4},
                     portable.glu_f32,
                     portable.glu_bf16,
                     portable.quantize_rows,
                     portable.scatter_add,
                     portable.sum_rows};
  }();
  return set;
}

}  // namespace kt::kernels
