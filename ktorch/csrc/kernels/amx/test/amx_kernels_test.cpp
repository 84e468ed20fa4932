// Checks the AMX gemm kernels (amx/kernels.cpp) against a scalar double reference and against the AVX-512
// kernels, over the calls the fused-MoE driver makes and their edges: M 1..300 (tile walks of 1-16 row
// groups, partial groups, calls cut at 256 rows), nblocks 1-4, K with and without a 64-deep int8 tail,
// int4 groups of 32/64/128 (symmetric, nibbles that are MXFP4 codes, GemmArgs::b_codes, and affine with minimums as
// GGUF Q4_K, GemmArgs::b_min: with float32 scales, which gemm_amx sends to the AVX-512 kernel, and with two-level
// scales, GemmArgs::b_sub, which walk the tiles), activation rows evenly strided (tile-loaded in place) or gathered (copied),
// and the output rows/columns a call must leave alone, under the tile walk ('rows', M up to 300: walks of up to 256),
// and (emulated) that the weight prefetches stay inside the weights and cover what the walk fetches ahead, and that
// int4 unpacks each weight line once a walk.
// With --bench (real AMX only) it times one thread's AVX-512 gemm and AMX gemm per M on hot weights, for
// choosing the small-M threshold; --bench-cold the same streaming the weights from memory (GB/s of weights a
// core pulls under the walk's prefetching); --bench-peak one core's tile ceilings
// (dot products alone, then with tile loads from L1, L2 and L3) and its clock; --bench-stretch the bare tile
// loop, tiles + VNNI, and the walk on hot and cold weights taking turns within each ~200 ms (1 and 16 threads);
// --bench-siblings which vCPUs share a tile unit (every pair of CPUs at once); --bench-peak16 the bare loop on 16
// threads, int8 and bf16 (the instance's tile ceiling).
//
// Build and run with run.sh beside this file:
//   bash ktorch/csrc/kernels/amx/test/run.sh emulated     # any AVX-512 BF16/VNNI machine, under ASan
//   bash ktorch/csrc/kernels/amx/test/run.sh native       # on AMX hardware
//   bash ktorch/csrc/kernels/amx/test/run.sh native --bench
//   bash ktorch/csrc/kernels/amx/test/run.sh native --bench-cold
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <atomic>
#include <random>
#include <thread>
#include <stdexcept>
#include <string>
#include <vector>

#if !defined(KTAMX_EMULATE)
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "../../kernels.h"
#if defined(KTAMX_EMULATE)
#include "emulated_tiles.h"
#endif

using namespace kt::kernels;

namespace {

std::mt19937_64 rng(12345);

int rand_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }
float rand_float(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}
double from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

const char* name(WeightFormat f) { return f == WeightFormat::BF16 ? "bf16" : f == WeightFormat::INT8 ? "int8" : "int4"; }

// One random problem: weights for `total_blocks` 16-column blocks, of which the call uses the last
// `nblocks` (so that a tile load past the weights runs off the end of the allocation), M activation rows.
struct Problem {
  WeightFormat f;
  int M, nblocks, total_blocks;
  int64_t K, group;  // group: int4 group size; int8: K (per channel), or a scale per group (GGUF Q8_0)
  bool strided;
  bool coded = false;             // int4 with MXFP4's code table (GemmArgs::b_codes): w holds the codes' values
  bool affine = false;            // int4 u * s - m (GemmArgs::b_min, GGUF Q4_K): w holds u in [0, 15]
  std::vector<int> w;             // W[n][k] codes (bf16: the bf16 bits), n < 16 * total_blocks
  std::vector<uint8_t> packed;    // exactly the packed bytes
  std::vector<float> wscale;      // [G][N]
  std::vector<float> wmin;        // [G][N], affine only
  int sub_max = 0;                // two-level scales (GemmArgs::b_sub, GGUF Q4_K at the file's size): byte
  std::vector<uint8_t> sub;       //   sub-scales [G][N] in 0..sub_max (int8, GGUF Q6_K: signed, -sub_max-1..sub_max,
                                  //   codes in [-32, 31]) and float super-scales [K/256][N],
  std::vector<float> super;       //   wscale = super * sub; affine: min_sub and min_super likewise (wmin =
  std::vector<uint8_t> min_sub;   //   min_super * min_sub); the kernels get the two-level form alone (b_scale and
  std::vector<float> min_super;   //   b_min nullptr), as the driver passes it
  std::vector<uint8_t> arows;     // activation storage, exactly sized
  std::vector<const void*> rows;  // per call row
  std::vector<float> ascale;
  std::vector<int32_t> gsum;      // [M][G]
  int64_t G() const { return f == WeightFormat::BF16 ? 1 : K / group; }
  int64_t N() const { return 16 * total_blocks; }
};

Problem make_problem(WeightFormat f, int M, int64_t K, int nblocks, int64_t group, bool strided, bool coded = false,
                     bool affine = false, int sub_max = 0, bool same_super = false) {
  Problem p;
  p.f = f;
  p.coded = coded;
  p.affine = affine;
  p.M = M;
  p.K = K;
  p.nblocks = nblocks;
  p.total_blocks = nblocks + 1;
  p.sub_max = sub_max;
  p.group = f == WeightFormat::INT4 || sub_max > 0 || (f == WeightFormat::INT8 && group > 0) ? group : K;
  p.strided = strided;
  const int64_t N = p.N(), G = p.G();
  p.w.resize(N * K);
  std::vector<uint8_t> nibbles(coded ? N * K : 0);  // coded: the nibble of each weight, w its code's value
  for (size_t i = 0; i < p.w.size(); ++i) {
    int& v = p.w[i];
    if (f == WeightFormat::BF16) v = to_bf16(rand_float(-1, 1));
    else if (f == WeightFormat::INT8 && affine) v = rand_int(0, 31);  // GGUF Q5_K
    else if (f == WeightFormat::INT8) v = sub_max > 0 ? (i % K == 0 && sub_max == 127 ? -32 : rand_int(-32, 31)) : rand_int(-127, 127);
    else if (coded) v = kMxfp4Codes[nibbles[i] = static_cast<uint8_t>(rand_int(0, 15))];
    else if (affine) v = rand_int(0, 15);
    else v = rand_int(-8, 7);
  }
  const size_t bb = block_bytes(f, K);
  p.packed.resize(bb * p.total_blocks);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t nb = n / 16, c = n % 16;
      const int v = p.w[n * K + k];
      uint8_t* blk = p.packed.data() + nb * bb;
      if (f == WeightFormat::BF16) {
        const uint16_t h = static_cast<uint16_t>(v);
        std::memcpy(blk + ((k / 2) * 16 + c) * 4 + (k % 2) * 2, &h, 2);
      } else if (f == WeightFormat::INT8) {
        blk[((k / 4) * 16 + c) * 4 + k % 4] = static_cast<uint8_t>(static_cast<int8_t>(v));
      } else {
        uint8_t& byte = blk[((k / 8) * 16 + c) * 4 + k % 4];
        const uint8_t nib = coded ? nibbles[n * K + k] : static_cast<uint8_t>(affine ? v : v + 8);
        byte = (k % 8) < 4 ? static_cast<uint8_t>((byte & 0xf0) | nib) : static_cast<uint8_t>((byte & 0x0f) | (nib << 4));
      }
    }
  p.wscale.resize(G * N);
  for (auto& s : p.wscale) s = rand_float(0.5f, 2.0f) / 64;
  if (sub_max > 0) {  // (K a multiple of 256)
    p.sub.resize(G * N);
    p.super.resize(K / 256 * N);
    for (auto& s : p.super) s = rand_float(0.5f, 2.0f) / 64 / sub_max;
    if (same_super)  // one super-scale a column along K (ktorch's symmetric int4)
      for (size_t i = N; i < p.super.size(); ++i) p.super[i] = p.super[i % N];
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n) {
        // (int8: the first group's sub-scale -128 wherever sub_max is 127, with codes -32 at k = 0: p = 4096, the
        // largest product, h = 16)
        const bool signed_sub = f == WeightFormat::INT8 && !affine;
        int sub = rand_int(signed_sub ? -sub_max - 1 : 0, sub_max);
        if (signed_sub && sub_max == 127 && g == 0) sub = -128;
        p.sub[g * N + n] = static_cast<uint8_t>(static_cast<int8_t>(sub));
        p.wscale[g * N + n] = p.super[(g * group / 256) * N + n] * static_cast<float>(sub);
      }
  }
  if (affine) {
    p.wmin.resize(G * N);
    for (auto& m : p.wmin) m = rand_float(0.0f, 8.0f) / 64;  // about 8 s: Q4_K's minimums sit near the middle
  }
  if (affine && sub_max > 0) {  // Q4_K's minimums: 6-bit sub-minimums times a super-minimum (dmin)
    p.min_sub.resize(G * N);
    p.min_super.resize(K / 256 * N);
    for (auto& s : p.min_super) s = rand_float(0.0f, 8.0f) / 64 / 63;
    for (int64_t g = 0; g < G; ++g)
      for (int64_t n = 0; n < N; ++n) {
        p.min_sub[g * N + n] = static_cast<uint8_t>(rand_int(0, 63));
        p.wmin[g * N + n] = p.min_super[(g * group / 256) * N + n] * static_cast<float>(p.min_sub[g * N + n]);
      }
  }
  // activations: strided = M rows back to back; gathered = rows scattered in a larger buffer
  const int64_t row_bytes = f == WeightFormat::BF16 ? 2 * K : K;
  const int slots = strided ? M : 2 * M + 3;
  p.arows.resize(slots * row_bytes);
  for (int64_t i = 0; i < slots * K; ++i) {
    if (f == WeightFormat::BF16) {
      const uint16_t h = to_bf16(rand_float(-2, 2));
      std::memcpy(p.arows.data() + 2 * i, &h, 2);
    } else {
      p.arows[i] = static_cast<uint8_t>(static_cast<int8_t>(rand_int(-127, 127)));
    }
  }
  std::vector<int> order(slots);
  for (int i = 0; i < slots; ++i) order[i] = i;
  if (!strided) {
    std::shuffle(order.begin(), order.end(), rng);
    order.back() = slots - 1;  // the last row of the storage is used, so reads past it show up
    std::swap(order[M - 1], order.back());
  }
  p.rows.resize(M);
  for (int m = 0; m < M; ++m) p.rows[m] = p.arows.data() + order[m] * row_bytes;
  p.ascale.resize(M);
  for (auto& s : p.ascale) s = rand_float(0.5f, 2.0f) / 127;
  p.gsum.assign(M * G, 0);
  if (f != WeightFormat::BF16)
    for (int m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) p.gsum[m * G + k / p.group] += static_cast<const int8_t*>(p.rows[m])[k];
  return p;
}

// C of the call in double, for the columns of the used blocks (n0 = 16 * (total_blocks - nblocks)), and
// the sum of the magnitudes of the terms added for each element (what fp32 rounding errors scale with).
void reference(const Problem& p, std::vector<double>& out, std::vector<double>& magnitude) {
  const int64_t K = p.K, G = p.G(), N = p.N(), n0 = 16 * (p.total_blocks - p.nblocks), cols = 16 * p.nblocks;
  out.assign(p.M * cols, 0.0);
  magnitude.assign(p.M * cols, 0.0);
  for (int m = 0; m < p.M; ++m)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t n = n0 + c;
      double total = 0, mag = 0;
      if (p.f == WeightFormat::BF16) {
        const auto* x = static_cast<const uint16_t*>(p.rows[m]);
        for (int64_t k = 0; k < K; ++k) {
          const double t = from_bf16(x[k]) * from_bf16(static_cast<uint16_t>(p.w[n * K + k]));
          total += t;
          mag += std::fabs(t);
        }
      } else {
        const auto* x = static_cast<const int8_t*>(p.rows[m]);
        for (int64_t g = 0; g < G; ++g) {
          int64_t dot = 0;
          int64_t xsum = 0;
          for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) {
            dot += static_cast<int64_t>(x[k]) * p.w[n * K + k];
            xsum += x[k];
          }
          total += static_cast<double>(dot) * p.wscale[g * N + n];
          mag += std::fabs(static_cast<double>(dot) * p.wscale[g * N + n]);
          if (p.affine) {  // (u * s - m) . x = s (u . x) - m sum(x)
            total -= static_cast<double>(xsum) * p.wmin[g * N + n];
            mag += std::fabs(static_cast<double>(xsum) * p.wmin[g * N + n]);
          }
        }
        total *= p.ascale[m];
        mag *= p.ascale[m];
      }
      out[m * cols + c] = total;
      magnitude[m * cols + c] = mag;
    }
}

// The side work a call is handed (GemmArgs::side): the ranges run must follow each other from 0 (`broken`
// otherwise).
struct SideLog {
  int64_t next = 0;
  bool broken = false;
  static void run(void* self, int64_t u0, int64_t u1) {
    auto& l = *static_cast<SideLog*>(self);
    if (u0 != l.next || u1 <= u0) l.broken = true;
    l.next = u1;
  }
};

// Runs one gemm into a C buffer with a wider ldc and extra rows, all pre-filled with a sentinel. next_b: the
// hint of the caller's next call (default: these weights again); next_a (next_a_bytes): its A rows; side: work
// to interleave.
std::vector<float> run(const Problem& p, GemmFn fn, int64_t ldc, int extra_rows, const uint8_t* next_b = nullptr,
                       const std::vector<uint8_t>* next_a = nullptr, SideWork* side = nullptr) {
  std::vector<float> c((p.M + extra_rows) * ldc, -12345.0f);
  GemmArgs a;
  a.M = p.M;
  a.K = p.K;
  a.a_rows = p.rows.data();
  const int first = p.total_blocks - p.nblocks;
  if (p.f != WeightFormat::BF16) {
    a.a_scale = p.ascale.data();
    a.a_gsum = p.gsum.data();
    a.a_gsum_stride = p.G();
    a.group_size = p.group;
    a.b_scale = p.wscale.data() + 16 * first;
    a.b_scale_group_stride = p.N();
    a.b_scale_block_stride = 16;
  }
  if (p.coded) a.b_codes = kMxfp4Codes;
  if (p.affine) a.b_min = p.wmin.data() + 16 * first;
  if (p.sub_max > 0) {
    a.b_scale = a.b_min = nullptr;
    a.b_sub = p.sub.data() + 16 * first;
    a.b_sub_group_stride = p.N();
    a.b_super = p.super.data() + 16 * first;
    a.b_super_group_stride = p.N();
    a.b_sub_signed = p.f == WeightFormat::INT8 && !p.affine;
    if (p.affine) {
      a.b_min_sub = p.min_sub.data() + 16 * first;
      a.b_min_super = p.min_super.data() + 16 * first;
    }
    a.super_size = 256;
  }
  a.b = p.packed.data() + first * block_bytes(p.f, p.K);
  a.b_block_stride = block_bytes(p.f, p.K);
  a.nblocks = p.nblocks;
  a.c = c.data();
  a.ldc = ldc;
  a.next_b = next_b != nullptr ? next_b : p.packed.data();  // a prefetch hint only: any readable weights
  if (next_a != nullptr) {
    a.next_a = next_a->data();
    a.next_a_bytes = static_cast<int64_t>(next_a->size());
  }
  a.side = side;
  fn(a);
  return c;
}

int failures = 0;

// Set by check_walks: the walk prefetches the next column pair and the next call's first pair into L2 in full, and
// keeps its weight prefetches inside the weights.
bool g_check_prefetch = false;
bool g_full_next = false;

#if defined(KTAMX_EMULATE)
// The lines the last call prefetched: inside the call's weights or the next call's, or (into L2) the next call's
// A rows; with g_full_next and walked every line of the call's blocks 2.. and of the next call's first two blocks
// fetched into L2; with walked (the AMX walk ran, not the AVX-512 kernel) every line of the next A rows. Returns what is wrong, or an empty string.
std::string check_prefetches(const Problem& p, const std::vector<uint8_t>& next, const std::vector<uint8_t>& next_a,
                             bool walked) {
  auto lines = amx_emulation::prefetch_log().lines;
  const auto in = [](const void* q, const uint8_t* lo, size_t n) {
    return static_cast<const uint8_t*>(q) >= lo && static_cast<const uint8_t*>(q) < lo + n;
  };
  std::vector<char> seen_a((next_a.size() + 63) / 64, 0);
  for (const auto& l : lines) {
    if (in(l.line, next_a.data(), next_a.size())) {
      if (l.to_l1) return "prefetched the next A rows into L1";
      seen_a[(static_cast<const uint8_t*>(l.line) - next_a.data()) / 64] = 1;
    } else if (!in(l.line, p.packed.data(), p.packed.size()) && !in(l.line, next.data(), next.size())) {
      return "prefetched a line outside the weights and the next A rows";
    }
  }
  if (walked)
    for (char seen : seen_a)
      if (!seen) return "the next call's A rows were not prefetched into L2 in full";
  lines.erase(std::remove_if(lines.begin(), lines.end(), [&](const auto& l) { return in(l.line, next_a.data(), next_a.size()); }),
              lines.end());
  if (!g_full_next || !walked) return "";  // (the walk's L2 prefetches; the AVX-512 kernel makes its own)
  const size_t bb = block_bytes(p.f, p.K);
  const int64_t steps = p.f == WeightFormat::BF16 ? p.K / 32 : p.f == WeightFormat::INT8 ? p.K / 64 : p.K / (p.group == 32 ? 32 : 64);
  if (steps == 0) return "";
  std::vector<char> seen_call(p.packed.size() / 64, 0), seen_next(next.size() / 64, 0);
  for (const auto& l : lines) {
    if (l.to_l1) continue;
    const auto* q = static_cast<const uint8_t*>(l.line);
    if (in(q, p.packed.data(), p.packed.size())) seen_call[(q - p.packed.data()) / 64] = 1;
    else seen_next[(q - next.data()) / 64] = 1;
  }
  const size_t first = (p.total_blocks - p.nblocks) * bb;  // the call's block 0
  for (size_t o = first + 2 * bb; o < p.packed.size(); o += 64)
    if (!seen_call[o / 64]) return "a later column pair of the call was not prefetched into L2 in full";
  for (size_t o = 0; o < std::min<size_t>(2, p.nblocks) * bb; o += 64)
    if (!seen_next[o / 64])
      return "the next call's first column pair was not prefetched into L2 in full";
  return "";
}

// int4: how often the last call unpacked each packed weight line. Every line of the call's blocks once a walk (walks
// of up to 256 rows), none where the AVX-512 kernel ran (walked false), and nothing outside the call's blocks.
std::string check_unpacks(const Problem& p, bool walked) {
  const auto& spans = amx_emulation::unpack_log().spans;
  if (p.f != WeightFormat::INT4 && p.sub_max == 0)
    return spans.empty() ? "" : "unpacked weight lines in a call of a format that reads its tiles in place";
  const size_t bb = block_bytes(p.f, p.K), first = (p.total_blocks - p.nblocks) * bb;
  std::vector<int> count(p.packed.size() / 64, 0);
  for (const auto& u : spans) {
    const auto* q = static_cast<const uint8_t*>(u.src);
    if (q < p.packed.data() + first || q + u.bytes > p.packed.data() + p.packed.size() || (q - p.packed.data()) % 64 != 0)
      return "unpacked bytes outside the call's weights";
    for (long o = 0; o < u.bytes; o += 64) ++count[(q - p.packed.data() + o) / 64];
  }
  const int expected = walked ? (p.M + 255) / 256 : 0;
  for (size_t o = first; o < p.packed.size(); o += 64)
    if (count[o / 64] != expected)
      return "unpacked a weight line " + std::to_string(count[o / 64]) + " times, not " + std::to_string(expected);
  return "";
}
#endif

void check_case(WeightFormat f, int M, int64_t K, int nblocks, int64_t group, bool strided, bool coded = false,
                bool affine = false, int sub_max = 0, bool same_super = false) {
  const Problem p = make_problem(f, M, K, nblocks, group, strided, coded, affine, sub_max, same_super);
  const int64_t cols = 16 * nblocks, ldc = cols + 16;
  std::vector<uint8_t> next(block_bytes(f, K) * nblocks, 0);  // the caller's next call's weights
  std::vector<uint8_t> next_a(static_cast<size_t>(M) * 40 + 17, 0);  // its A rows (a length that ends mid-line)
  SideLog side_log;
  SideWork side;
  side.run = &SideLog::run;
  side.ctx = &side_log;
  side.units = M + 5;
  std::string prefetch_error;
#if defined(KTAMX_EMULATE)
  amx_emulation::prefetch_log().lines.clear();
  amx_emulation::prefetch_log().on = g_check_prefetch;
  amx_emulation::unpack_log().spans.clear();
  amx_emulation::unpack_log().on = g_check_prefetch;
#endif
  const std::vector<float> amx = run(p, amx_kernels().gemm[static_cast<int>(f)], ldc, 3, next.data(), &next_a, &side);
  // the side work: in order, and all of it where the tile walk ran (none where the call went to the AVX-512 kernel)
  const bool walked = side.done == side.units;
  std::string side_error;
  if (side_log.broken || side_log.next != side.done || (side.done != 0 && !walked))
    side_error = "ran its side work out of order or in part";
#if defined(KTAMX_EMULATE)
  amx_emulation::prefetch_log().on = false;
  amx_emulation::unpack_log().on = false;
  if (g_check_prefetch) prefetch_error = check_prefetches(p, next, next_a, walked);
  if (g_check_prefetch && prefetch_error.empty()) prefetch_error = check_unpacks(p, walked);
#endif
  if (prefetch_error.empty()) prefetch_error = side_error;
  const std::vector<float> avx = run(p, avx512_kernels().gemm[static_cast<int>(f)], ldc, 3);
  std::vector<double> ref, mag;
  reference(p, ref, mag);
  double worst = 0, worst_vs_avx = 0;
  bool untouched = true;
  for (int m = 0; m < M + 3; ++m)
    for (int64_t j = 0; j < ldc; ++j) {
      const float v = amx[m * ldc + j];
      if (m >= M || j >= cols) {
        untouched = untouched && v == -12345.0f;
        continue;
      }
      // fp32 accumulation: each of the (at most K) additions rounds by 2^-24 of a partial sum <= sum |terms|
      const double terms = f == WeightFormat::BF16 ? static_cast<double>(K) : static_cast<double>(p.G()) * (affine ? 2 : 1) + 2;
      const double bound = terms * std::ldexp(1.0, -24) * mag[m * cols + j] + 1e-30;
      worst = std::max(worst, std::fabs(v - ref[m * cols + j]) / bound);
      const float w = avx[m * ldc + j];
      worst_vs_avx = std::max(worst_vs_avx, static_cast<double>(std::fabs(v - w)));
    }
  // int formats: same integer sums and fp32 operations in the same order as AVX-512, so bit-identical (not the
  // two-level walk: its integer sums span super-blocks, the AVX-512 kernel's one group; the bound holds for both)
  const bool exact = f == WeightFormat::BF16 || sub_max > 0 || worst_vs_avx == 0.0;
  if (worst > 1.0 || !untouched || !exact || !prefetch_error.empty()) {
    ++failures;
    std::printf("FAIL %s%s M=%d K=%lld nblocks=%d group=%lld %s: error/bound %.3g, |amx-avx512| max %.3g%s%s%s\n", name(f),
                coded ? " (MXFP4 codes)" : sub_max > 0 ? (affine ? " (affine, two-level)" : " (two-level)")
                : affine ? " (affine)" : "",
                M, static_cast<long long>(K), nblocks, static_cast<long long>(group), strided ? "strided" : "gathered",
                worst, worst_vs_avx, untouched ? "" : ", wrote outside its rows/columns",
                prefetch_error.empty() ? "" : ", ", prefetch_error.c_str());
  }
}

// Every case under the walk each format takes (with every M through the tiles: amx_min_rows_for_tests(0)).
int check_walks(const char* label) {
  const int before = failures;
  g_check_prefetch = true;
  g_full_next = true;
  std::vector<int> Ms = {1, 2, 3, 5, 8, 15, 16, 17, 24, 31, 32, 33, 40, 47, 48, 49, 63, 64, 65, 100, 128, 129, 255, 256, 300};
  int cases = 0;
  for (bool strided : {true, false})
    for (int M : Ms)
      for (int nb = 1; nb <= 4; ++nb) {
        for (int64_t K : {64, 96, 256}) {
          check_case(WeightFormat::BF16, M, K, nb, 0, strided);
          check_case(WeightFormat::INT8, M, K, nb, 0, strided);
          cases += 2;
        }
        for (int64_t group : {32, 64, 128}) {
          check_case(WeightFormat::INT4, M, 256, nb, group, strided);
          ++cases;
        }
        check_case(WeightFormat::INT4, M, 96, nb, 32, strided);
        check_case(WeightFormat::INT4, M, 96, nb, 32, strided, true);  // MXFP4's codes through the table
        check_case(WeightFormat::INT4, M, 128, nb, 32, strided, false, true);  // affine (Q4_K's groups of 32)
        check_case(WeightFormat::INT4, M, 128, nb, 64, strided, false, true);
        check_case(WeightFormat::INT4, M, 256, nb, 32, strided, false, true, 63);  // Q4_K at the file's size
        check_case(WeightFormat::INT4, M, 512, nb, 64, strided, false, true, 255);  // every byte sub-scale
        check_case(WeightFormat::INT4, M, 512, nb, 128, strided, false, false, 15, true);  // ktorch's int4: all of K
        check_case(WeightFormat::INT4, M, 512, nb, 32, strided, false, false, 15);  // supers vary: per super-block
        check_case(WeightFormat::INT4, M, 256, nb, 64, strided, false, false, 63, true);  // subs > 15: group walk
        check_case(WeightFormat::INT8, M, 256, nb, 16, strided, false, false, 127);  // Q6_K at the file's size
        check_case(WeightFormat::INT8, M, 256, nb, 32, strided, false, true, 63);  // Q5_K at the file's size
        for (int64_t group : {32, 64, 128}) check_case(WeightFormat::INT8, M, 256, nb, group, strided);  // Q8_0's
        check_case(WeightFormat::INT8, M, 96, nb, 32, strided);  // (K % 64 == 32: 32-deep steps to the end)
        cases += 15;
      }
  // driver-sized reductions for each format (int8 with its 32-deep tail; int4 as the Qwen3 gate/up call at T=2048,
  // and Q4_K's down projection)
  for (int M : {7, 37, 64, 130}) {
    check_case(WeightFormat::BF16, M, 768, 4, 0, M % 2 == 1);
    check_case(WeightFormat::INT8, M, 800, 2, 0, M % 2 == 1);
    cases += 2;
    check_case(WeightFormat::INT4, M, 768, 3, 128, M % 2 == 1);
    ++cases;
  }
  check_case(WeightFormat::INT4, 128, 2048, 4, 128, true);
  check_case(WeightFormat::INT4, 256, 768, 4, 32, false, false, true);
  check_case(WeightFormat::INT4, 300, 768, 3, 32, false, false, true, 63);
  check_case(WeightFormat::INT4, 100, 2048, 2, 32, true, false, true, 63);
  check_case(WeightFormat::INT4, 300, 2048, 4, 128, false, false, false, 15, true);
  check_case(WeightFormat::INT4, 130, 768, 3, 32, true, false, false, 15, true);
  check_case(WeightFormat::INT8, 130, 768, 4, 16, true, false, false, 127);  // Q6_K: Qwen3's down projection
  check_case(WeightFormat::INT8, 300, 512, 3, 32, false, false, false, 100);
  check_case(WeightFormat::INT8, 130, 768, 4, 32, true, false, true, 63);  // Q5_K: Qwen3's down projection
  check_case(WeightFormat::INT8, 70, 512, 2, 64, false, false, true, 255);  // every unsigned byte sub-scale
  check_case(WeightFormat::INT8, 130, 2048, 4, 32, true);  // Q8_0: Qwen3's gate/up and down projections
  check_case(WeightFormat::INT8, 300, 768, 3, 32, false);
  cases += 12;
  g_check_prefetch = g_full_next = false;
  std::printf("walk %-22s %d cases, %d failed\n", label, cases, failures - before);
  return cases;
}

void check_all() {
  amx_min_rows_for_tests(0);  // every M through the tiles
  int cases = check_walks("default");
  // the measured threshold sends small M to AVX-512: results must still be right
  amx_min_rows_for_tests(-1);
  for (int M : {1, 3, 4, 9}) {
    check_case(WeightFormat::INT8, M, 128, 2, 0, false);
    check_case(WeightFormat::INT8, M, 128, 2, 32, true);
    check_case(WeightFormat::INT4, M, 128, 2, 64, true);
    check_case(WeightFormat::INT4, M, 128, 2, 32, false, true);
    check_case(WeightFormat::INT4, M, 128, 2, 32, true, false, true);
    check_case(WeightFormat::INT4, M, 256, 2, 32, false, false, true, 63);
    check_case(WeightFormat::INT4, M, 256, 2, 128, true, false, false, 15, true);
    cases += 7;
  }
  std::printf("%d cases, %d failed\n", cases, failures);
}

#if !defined(KTAMX_EMULATE)
// The benches lay activation rows out as the driver does (fused_moe.cpp): evenly strided, one 64-byte line
// more apart than a row, so the kernels tile-load them in place (no copy) and a tile's 16 rows do not share
// L1 sets. Returns the storage; rows[m] point into it.
std::vector<uint8_t> driver_rows(const std::vector<const void*>& src, int64_t row_bytes, std::vector<const void*>& rows) {
  const int64_t ld = (row_bytes + 63) / 64 * 64 + 64;
  std::vector<uint8_t> store(src.size() * ld + 64);
  const size_t skew = (64 - reinterpret_cast<uintptr_t>(store.data()) % 64) % 64;
  rows.resize(src.size());
  for (size_t m = 0; m < src.size(); ++m) {
    uint8_t* dst = store.data() + skew + m * ld;
    std::memcpy(dst, src[m], row_bytes);
    rows[m] = dst;
  }
  return store;
}

// Row counts to time: KT_BENCH_M="16,128" (default: 1..256).
std::vector<int> bench_rows(std::vector<int> fallback) {
  const char* env = std::getenv("KT_BENCH_M");
  if (env == nullptr || *env == '\0') return fallback;
  std::vector<int> ms;
  for (const char* p = env; *p != '\0';) {
    char* end = nullptr;
    ms.push_back(static_cast<int>(std::strtol(p, &end, 10)));
    p = *end == ',' ? end + 1 : end;
    if (end == p && *p != '\0') break;
  }
  return ms;
}

// One thread: AMX vs AVX-512 per M on hot (L2-resident) weights, for the small-M threshold.
void bench() {
  amx_min_rows_for_tests(0);
  struct Shape { const char* what; int64_t K; int nblocks; };
  const Shape shapes[] = {{"qwen3 gate/up", 2048, 4}, {"qwen3 down", 768, 2}, {"deepseek gate/up", 7168, 4},
                          {"deepseek down", 2048, 4}};
  // AVX-512, then AMX under the format's walk
  // int4: groups of 128 with float32 scales; "int4-2l" ktorch's two-level int4 (sub-scales <= 15, one super a column);
  // "q4k-2l" GGUF Q4_K with two-level scales (groups of 32, minimums)
  struct Variant { WeightFormat f; const char* label; int64_t group; bool affine; int sub_max; bool same_super; };
  const Variant variants[] = {{WeightFormat::BF16, "bf16", 128, false, 0, false},
                              {WeightFormat::INT8, "int8", 128, false, 0, false},
                              {WeightFormat::INT4, "int4", 128, false, 0, false},
                              {WeightFormat::INT4, "int4-2l", 128, false, 15, true},
                              {WeightFormat::INT4, "q4k-2l", 32, true, 63, false}};
  std::printf("%-18s %-7s %4s %12s %11s %8s\n", "shape", "fmt", "M", "avx512 GOPS", "amx GOPS", "amx/avx");
  for (const Shape& s : shapes)
    for (const Variant& v : variants)
      for (int M : bench_rows({1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256})) {
        const WeightFormat f = v.f;
        Problem p = make_problem(f, M, s.K, s.nblocks, v.group, false, false, v.affine, v.sub_max, v.same_super);
        const std::vector<uint8_t> store = driver_rows(p.rows, f == WeightFormat::BF16 ? 2 * s.K : s.K, p.rows);
        double gops[2] = {0};
        for (int which = 0; which <= 1; ++which) {
          const GemmFn fn = which > 0 ? amx_kernels().gemm[static_cast<int>(f)] : avx512_kernels().gemm[static_cast<int>(f)];
          run(p, fn, 16 * s.nblocks, 0);
          int iters = 0;
          const auto t0 = std::chrono::steady_clock::now();
          double sec = 0;
          while (sec < 0.05) {
            for (int i = 0; i < 16; ++i) run(p, fn, 16 * s.nblocks, 0);
            iters += 16;
            sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          }
          gops[which] = 2.0 * M * s.K * 16 * s.nblocks * iters / sec / 1e9;
        }
        std::printf("%-18s %-7s %4d %12.1f %11.1f %8.2f\n", s.what, v.label, M, gops[0], gops[1],
                    gops[1] / gops[0]);
      }
}

// One thread streaming weights from memory: consecutive calls take consecutive weights of a 1 GiB pool (past
// any L3), each naming the next as next_b like the driver's calls of one expert, so the walks' prefetching
// is what is measured. Prints GB/s of weights read, AVX-512 and the AMX walk, per M; int4 in groups of 128.
void bench_cold() {
  amx_min_rows_for_tests(0);
  struct Shape { const char* what; int64_t K; int nblocks; };
  const Shape shapes[] = {{"qwen3 gate/up", 2048, 4}, {"qwen3 down", 768, 8}, {"deepseek gate/up", 7168, 4}};
  const size_t pool_bytes = size_t(1) << 30;
  auto* pool = static_cast<uint16_t*>(std::aligned_alloc(64, pool_bytes));
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < pool_bytes / 2; ++i) {  // as bf16: normal numbers near 2^-7; as int8/int4: any bytes
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    pool[i] = static_cast<uint16_t>((x & 0x807f) | 0x3c00);
  }
  const auto* base = reinterpret_cast<const uint8_t*>(pool);
  std::printf("one thread, weights from memory: GB/s of weights\n");
  std::printf("%-18s %-5s %4s %12s %11s\n", "shape", "fmt", "M", "avx512", "amx");
  for (const Shape& s : shapes)
    for (WeightFormat f : {WeightFormat::BF16, WeightFormat::INT8, WeightFormat::INT4})
      for (int M : bench_rows({16, 32, 128})) {
        const int64_t group = f != WeightFormat::INT4 ? s.K : 128;
        const int64_t N = 16 * s.nblocks, G = s.K / group;
        const size_t bb = block_bytes(f, s.K), call_bytes = bb * s.nblocks, calls = pool_bytes / call_bytes;
        const int64_t row_bytes = f == WeightFormat::BF16 ? 2 * s.K : s.K;
        std::vector<uint8_t> arows(M * row_bytes);
        for (size_t i = 0; i < arows.size(); ++i) arows[i] = static_cast<uint8_t>(f == WeightFormat::BF16 && i % 2 ? 0x3c : i * 7);
        std::vector<const void*> packed_rows(M), rows;
        for (int m = 0; m < M; ++m) packed_rows[m] = arows.data() + m * row_bytes;
        const std::vector<uint8_t> store = driver_rows(packed_rows, row_bytes, rows);
        std::vector<float> ascale(M, 1.0f / 127), wscale(G * N, 1.0f / 64), c(M * N);
        std::vector<int32_t> gsum(M * G, 0);
        GemmArgs a;
        a.M = M;
        a.K = s.K;
        a.a_rows = rows.data();
        a.a_scale = ascale.data();
        a.a_gsum = gsum.data();
        a.a_gsum_stride = G;
        a.group_size = group;
        a.b_block_stride = bb;
        a.b_scale = wscale.data();
        a.b_scale_group_stride = N;
        a.nblocks = s.nblocks;
        a.c = c.data();
        a.ldc = N;
        std::vector<double> gbs(2);
        size_t i = 0;
        for (int which = 0; which <= 1; ++which) {
          const GemmFn fn = which > 0 ? amx_kernels().gemm[static_cast<int>(f)] : avx512_kernels().gemm[static_cast<int>(f)];
          size_t n = 0;
          const auto t0 = std::chrono::steady_clock::now();
          double sec = 0;
          while (sec < 0.08) {
            for (int r = 0; r < 16; ++r, ++n, i = (i + 1) % calls) {
              a.b = base + i * call_bytes;
              a.next_b = base + (i + 1) % calls * call_bytes;
              fn(a);
            }
            sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          }
          gbs[which] = static_cast<double>(n * call_bytes) / sec / 1e9;
        }
        std::printf("%-18s %-5s %4d %12.2f %11.2f\n", s.what, name(f), M, gbs[0], gbs[1]);
      }
  amx_min_rows_for_tests(-1);
  std::free(pool);
}

// What one core's tiles can do on this machine, as ceilings for the walks above (int8 TDPBSSD and bf16
// TDPBF16PS, a 2 x 2 block of C tiles as in the kernels): the dot products alone (tiles loaded once), then
// each step also loading its 2 A + 2 B tiles. B tiles are 1 KB contiguous (the packed weights); A tiles are
// 16 rows `lda` bytes apart (64: contiguous; 2112: the driver's activation rows for K = 2048). The data is
// cycled through a buffer of a given size (16 KB: L1; 256 KB-1.5 MB: L2; 64 MB: L3 and memory), with the
// tiles of the step `ahead` steps on prefetched into L1 (none, A, B or both). Best of 3 runs each.
struct alignas(64) PeakConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

enum PeakPrefetch { kNone = 0, kA = 1, kB = 2, kAB = 3 };

// A region: `steps` k steps of an A panel (32 rows x 64 B a step, rows lda apart) and a B panel (2 blocks
// of 1 KB tiles), laid out in `bytes`.
template <bool kBf16>
double peak_run(const uint8_t* buf, size_t bytes, int64_t lda, int pf, int ahead, int64_t total_steps, bool loads) {
  // A panel: 32 rows x (steps * 64) bytes at stride lda (lda >= steps * 64 or lda = 64: tile-contiguous)
  const int64_t a_step = lda == 64 ? 2048 : 64;   // bytes from one step's A tile to the next's
  const int64_t a_row = lda;                      // bytes between rows of one A tile
  const int64_t a_half = lda == 64 ? 1024 : 16 * lda;  // the second A tile of a step
  int64_t steps = static_cast<int64_t>(bytes / 2 / 2048);  // half the bytes for A, half for B
  if (lda != 64) steps = std::min<int64_t>(steps, lda / 64);
  if (steps < 1) steps = 1;
  const uint8_t* A = buf;
  const uint8_t* B = buf + (lda == 64 ? steps * 2048 : 32 * lda);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, A, a_row); _tile_loadd(5, A + a_half, a_row); _tile_loadd(6, B, 64); _tile_loadd(7, B + 1024, 64);
  int64_t s = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < total_steps; ++i) {
    if (loads) {
      const uint8_t* a0 = A + s * a_step;
      const uint8_t* b0 = B + s * 2048;
      if (pf != kNone) {
        int64_t t = s + ahead;
        if (t >= steps) t -= steps;
        if (pf & kA) {
          const uint8_t* q = A + t * a_step;
          for (int r = 0; r < 16; ++r) {
            _mm_prefetch(reinterpret_cast<const char*>(q + r * a_row), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(q + a_half + r * a_row), _MM_HINT_T0);
          }
        }
        if (pf & kB) {
          const uint8_t* q = B + t * 2048;
          for (int o = 0; o < 2048; o += 64) _mm_prefetch(reinterpret_cast<const char*>(q + o), _MM_HINT_T0);
        }
      }
      s = s + 1 == steps ? 0 : s + 1;
      _tile_loadd(4, a0, a_row);
      _tile_loadd(6, b0, 64);
      if constexpr (kBf16) _tile_dpbf16ps(0, 4, 6); else _tile_dpbssd(0, 4, 6);
      _tile_loadd(7, b0 + 1024, 64);
      if constexpr (kBf16) _tile_dpbf16ps(1, 4, 7); else _tile_dpbssd(1, 4, 7);
      _tile_loadd(5, a0 + a_half, a_row);
      if constexpr (kBf16) { _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
      else { _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7); }
    } else {
      if constexpr (kBf16) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
      else { _tile_dpbssd(0, 4, 6); _tile_dpbssd(1, 4, 7); _tile_dpbssd(2, 5, 6); _tile_dpbssd(3, 5, 7); }
    }
  }
  alignas(64) static int32_t sink[16 * 16];
  _tile_stored(0, sink, 64);
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return 4.0 * 16 * 16 * 64 * 2 * static_cast<double>(total_steps) / sec / 1e9;  // int8 ops; bf16 flops are half
}

// The kernel's 'rows' walk against bare replicas of it on the same data (int8, M rows laid out as the driver
// does, hot weights), in one process: which part of the walk costs what. Replicas: the same tile steps with no
// prefetches and no epilogue; + B prefetched into L1 on every pass; with the two blocks of a column pair
// interleaved a step apart (1 KB) instead of a block apart (K * 16 bytes); A packed in tile order; huge pages.
// A tiles: group g, step s at arow0[g] + s * a_step, rows lda apart (rows: a_step 64; tiled: a_step 1024, lda 64).
// B: block 1 of a pair blk_stride after block 0; interleaved (blk_stride 1024) steps are 2 KB apart, else 1 KB.
template <bool kPrefetchB>
void replica(const uint8_t* const* arow0, int64_t lda, int64_t a_step, int row_pairs, const uint8_t* b,
             int64_t blk_stride, int64_t pair_stride, int pairs, int64_t steps, uint8_t* cbuf) {
  const int64_t bs = blk_stride == 1024 ? 2048 : 1024;
  for (int cp = 0; cp < pairs; ++cp)
    for (int rp = 0; rp < row_pairs; ++rp) {
      const uint8_t* a0 = arow0[2 * rp];
      const uint8_t* a1 = arow0[2 * rp + 1];
      const uint8_t* b0 = b + cp * pair_stride;
      const uint8_t* b1 = b0 + blk_stride;
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        if (kPrefetchB && s + 4 < steps)
          for (int l = 0; l < 16; ++l) {
            _mm_prefetch(reinterpret_cast<const char*>(b0 + (s + 4) * bs + 64 * l), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(b1 + (s + 4) * bs + 64 * l), _MM_HINT_T0);
          }
        _tile_loadd(4, a0 + s * a_step, lda);
        _tile_loadd(6, b0 + s * bs, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_loadd(7, b1 + s * bs, 64);
        _tile_dpbssd(1, 4, 7);
        _tile_loadd(5, a1 + s * a_step, lda);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
      _tile_stored(0, cbuf, 128); _tile_stored(1, cbuf + 64, 128);
      _tile_stored(2, cbuf + 2048, 128); _tile_stored(3, cbuf + 2112, 128);
    }
}

void bench_replica() {
  amx_min_rows_for_tests(0);  // (int8: the 'rows' walk)
  static const PeakConfig cfg;
  alignas(64) static uint8_t cbuf[32 * 128];
  struct Shape { const char* what; int64_t K; int nblocks; };
  const Shape shapes[] = {{"qwen3 gate/up", 2048, 4}, {"qwen3 down", 768, 8}};
  std::printf("int8, one thread, hot weights, GOPS (best of 5). A: rows (the driver's) or tiled ([group][step] 1 KB tiles);\n"
              "B: blk (blocks K*16 B apart) or il (a pair's blocks interleaved per step); hp: copies in MADV_HUGEPAGE memory\n"
              "%-14s %4s %8s %8s %8s %8s %8s %8s %8s %8s %8s %8s %8s\n", "shape", "M", "kernel", "rows/blk", "+pfB", "rows/il",
              "tile/blk", "tile/il", "t/il+pfB", "hp r/blk", "hp r/il", "hp t/blk", "hp t/il");
  for (const Shape& sh : shapes)
    for (int M : bench_rows({64, 128, 256})) {
      Problem p = make_problem(WeightFormat::INT8, M, sh.K, sh.nblocks, 128, false);
      const std::vector<uint8_t> store = driver_rows(p.rows, sh.K, p.rows);
      const int64_t lda = static_cast<const uint8_t*>(p.rows[1]) - static_cast<const uint8_t*>(p.rows[0]);
      const int groups = (M + 15) / 16, row_pairs = groups / 2;
      std::vector<const uint8_t*> arow0(groups);
      for (int g = 0; g < groups; ++g) arow0[g] = static_cast<const uint8_t*>(p.rows[16 * g]);
      const int64_t bb = static_cast<int64_t>(block_bytes(WeightFormat::INT8, sh.K)), steps = sh.K / 64;
      const uint8_t* b = p.packed.data() + bb;  // the call's blocks (make_problem puts one unused block first)
      // interleaved: per column pair [steps][2][1 KB]
      std::vector<uint8_t> il(bb * sh.nblocks + 64);
      uint8_t* ilb = il.data() + (64 - reinterpret_cast<uintptr_t>(il.data()) % 64) % 64;
      for (int cp = 0; cp < sh.nblocks / 2; ++cp)
        for (int64_t st = 0; st < steps; ++st)
          for (int j = 0; j < 2; ++j)
            std::memcpy(ilb + cp * 2 * bb + (st * 2 + j) * 1024, b + (2 * cp + j) * bb + st * 1024, 1024);
      const double ops = 2.0 * 16 * row_pairs * 2 * sh.K * 16 * sh.nblocks;
      auto time = [&](auto&& fn) {
        double best = 0;
        for (int r = 0; r < 5; ++r) {
          int iters = 0;
          const auto t0 = std::chrono::steady_clock::now();
          double sec = 0;
          while (sec < 0.02) {
            for (int i = 0; i < 8; ++i) fn();
            iters += 8;
            sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          }
          best = std::max(best, ops * iters / sec / 1e9);
        }
        return best;
      };
      const GemmFn kernel = amx_kernels().gemm[static_cast<int>(WeightFormat::INT8)];
      std::vector<float> c(M * 16 * sh.nblocks);
      GemmArgs ga;
      ga.M = 32 * row_pairs;
      ga.K = sh.K;
      ga.a_rows = p.rows.data();
      ga.a_scale = p.ascale.data();
      ga.a_gsum = p.gsum.data();
      ga.a_gsum_stride = 1;
      ga.group_size = sh.K;
      ga.b = b;
      ga.b_block_stride = bb;
      ga.b_scale = p.wscale.data() + 16;
      ga.b_scale_group_stride = p.N();
      ga.nblocks = sh.nblocks;
      ga.c = c.data();
      ga.ldc = 16 * sh.nblocks;
      const double g_kernel = time([&] { kernel(ga); });
      _tile_loadconfig(&cfg);
      // huge pages: a 2 MB-aligned region with MADV_HUGEPAGE holding copies of A (rows, tiled) and B (both layouts)
      const int64_t a_rows_bytes = groups * 16 * lda, a_tiled_bytes = groups * steps * 1024, b_bytes = bb * sh.nblocks;
      const size_t huge_bytes = ((a_rows_bytes + a_tiled_bytes + 2 * b_bytes) / (2 << 20) + 1) * (2 << 20);
      auto* huge = static_cast<uint8_t*>(std::aligned_alloc(2 << 20, huge_bytes));
      const int madv = madvise(huge, huge_bytes, MADV_HUGEPAGE);
      std::memset(huge, 0, huge_bytes);
      uint8_t* h_rows = huge;
      uint8_t* h_tiled = h_rows + a_rows_bytes;
      uint8_t* h_b = h_tiled + a_tiled_bytes;
      uint8_t* h_il = h_b + b_bytes;
      std::memcpy(h_rows, p.rows[0], a_rows_bytes - lda + sh.K);
      std::memcpy(h_b, b, b_bytes);
      std::memcpy(h_il, ilb, b_bytes);
      std::vector<uint8_t> tiled_store(a_tiled_bytes + 64);
      uint8_t* tiled = tiled_store.data() + (64 - reinterpret_cast<uintptr_t>(tiled_store.data()) % 64) % 64;
      for (int g = 0; g < groups; ++g)
        for (int64_t st = 0; st < steps; ++st)
          for (int r = 0; r < 16; ++r)
            std::memcpy(tiled + (g * steps + st) * 1024 + r * 64, static_cast<const uint8_t*>(p.rows[16 * g + r]) + st * 64, 64);
      std::memcpy(h_tiled, tiled, a_tiled_bytes);
      std::vector<const uint8_t*> tiled0(groups), h_rows0(groups), h_tiled0(groups);
      for (int g = 0; g < groups; ++g) {
        tiled0[g] = tiled + g * steps * 1024;
        h_rows0[g] = h_rows + 16 * g * lda;
        h_tiled0[g] = h_tiled + g * steps * 1024;
      }
      const int pairs = sh.nblocks / 2;
      double g[10];
      g[0] = time([&] { replica<false>(arow0.data(), lda, 64, row_pairs, b, bb, 2 * bb, pairs, steps, cbuf); });
      g[1] = time([&] { replica<true>(arow0.data(), lda, 64, row_pairs, b, bb, 2 * bb, pairs, steps, cbuf); });
      g[2] = time([&] { replica<false>(arow0.data(), lda, 64, row_pairs, ilb, 1024, 2 * bb, pairs, steps, cbuf); });
      g[3] = time([&] { replica<false>(tiled0.data(), 64, 1024, row_pairs, b, bb, 2 * bb, pairs, steps, cbuf); });
      g[4] = time([&] { replica<false>(tiled0.data(), 64, 1024, row_pairs, ilb, 1024, 2 * bb, pairs, steps, cbuf); });
      g[5] = time([&] { replica<true>(tiled0.data(), 64, 1024, row_pairs, ilb, 1024, 2 * bb, pairs, steps, cbuf); });
      g[6] = time([&] { replica<false>(h_rows0.data(), lda, 64, row_pairs, h_b, bb, 2 * bb, pairs, steps, cbuf); });
      g[7] = time([&] { replica<false>(h_rows0.data(), lda, 64, row_pairs, h_il, 1024, 2 * bb, pairs, steps, cbuf); });
      g[8] = time([&] { replica<false>(h_tiled0.data(), 64, 1024, row_pairs, h_b, bb, 2 * bb, pairs, steps, cbuf); });
      g[9] = time([&] { replica<false>(h_tiled0.data(), 64, 1024, row_pairs, h_il, 1024, 2 * bb, pairs, steps, cbuf); });
      std::printf("%-14s %4d %8.0f", sh.what, 32 * row_pairs, g_kernel);
      for (double v : g) std::printf(" %8.0f", v);
      std::printf("  (madvise %d)\n", madv);
      std::free(huge);
    }
  amx_min_rows_for_tests(-1);
}

// All-core tile ceiling: n threads, thread i pinned to CPU i, each running the L1-resident 2 x 2 loop of
// bench_peak (dot products + 4 tile loads a step from 16 KB) for ~1 s at the same time; then one thread's rate
// in 50 ms samples with the machine's steal time (/proc/stat) beside it, to see whether the tile rate is steady.
long long steal_ticks() {
  FILE* f = std::fopen("/proc/stat", "r");
  if (f == nullptr) return -1;
  char cpu[16];
  long long v[8] = {0};
  const int n = std::fscanf(f, "%15s %lld %lld %lld %lld %lld %lld %lld %lld", cpu, &v[0], &v[1], &v[2], &v[3], &v[4],
                            &v[5], &v[6], &v[7]);
  std::fclose(f);
  return n == 9 ? v[7] : -1;
}

// The calling thread onto CPU `cpu`, with the tile configuration loaded.
void pin_with_tiles(int cpu, const PeakConfig& cfg) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  _tile_loadconfig(&cfg);
}

template <bool kBf16>
void bench_peak_threads(int n) {
  static const PeakConfig cfg;
  std::vector<double> gops(n, 0);
  std::vector<std::thread> threads;
  std::atomic<int> ready{0};
  for (int t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      pin_with_tiles(t, cfg);
      auto* buf = static_cast<uint8_t*>(std::aligned_alloc(64, 16 << 10));
      for (int i = 0; i < (16 << 10); ++i) buf[i] = static_cast<uint8_t>(i * 37 + 11);
      for (int i = 1; i < (16 << 10); i += 2) buf[i] = kBf16 ? 0x3c : buf[i];  // as bf16: normal numbers
      peak_run<kBf16>(buf, 16 << 10, 64, kNone, 0, 2000000, true);  // warm up
      ready.fetch_add(1);
      while (ready.load() < n) {}
      gops[t] = peak_run<kBf16>(buf, 16 << 10, 64, kNone, 0, 8000000, true) / (kBf16 ? 2 : 1);
      _tile_release();
      std::free(buf);
    });
  for (auto& th : threads) th.join();
  double sum = 0, lo = 1e30, hi = 0;
  for (double g : gops) sum += g, lo = std::min(lo, g), hi = std::max(hi, g);
  std::printf("%2d threads at once, %s 2x2 from L1: %8.0f G%s in all (per thread %6.0f..%6.0f)\n", n,
              kBf16 ? "bf16" : "int8", sum, kBf16 ? "FLOPS" : "OPS", lo, hi);
}

void bench_peak_series() {
  static const PeakConfig cfg;
  _tile_loadconfig(&cfg);
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(64, 16 << 10));
  for (int i = 0; i < (16 << 10); ++i) buf[i] = static_cast<uint8_t>(i * 37 + 11);
  std::printf("one thread, int8 2x2 from L1, 50 ms samples: GOPS (steal ticks)\n");
  for (int i = 0; i < 60; ++i) {
    const long long s0 = steal_ticks();
    const double g = peak_run<false>(buf, 16 << 10, 64, kNone, 0, 400000, true);
    std::printf("%6.0f(%lld)%s", g, steal_ticks() - s0, i % 10 == 9 ? "\n" : " ");
  }
  _tile_release();
  std::free(buf);
}

// --bench-peak-threads: the one-thread series, 1..16 threads int8 and bf16, then the series again.
void bench_peak_all() {
  bench_peak_series();
  for (int n : {1, 2, 4, 8, 12, 15, 16}) bench_peak_threads<false>(n);
  for (int n : {1, 8, 15, 16}) bench_peak_threads<true>(n);
  bench_peak_series();
}

// --bench-peak16: the bare L1 tile loop on 16 threads at once, int8 then bf16, twice (the instance's tile ceiling
// for the whole-layer figures measured beside it: device step `bound`).
void bench_peak16() {
  for (int round = 0; round < 2; ++round) {
    bench_peak_threads<false>(16);
    bench_peak_threads<true>(16);
  }
}

// --bench-stretch: the tile unit's rate moves between stretches (fast, then a quarter of that for seconds), so
// rates measured at different moments do not compare. Here n threads (pinned, all at once) take turns, in rounds of
// ~40 ms a mode, between: the bare L1 tile loop ("bare"); the same loop with V AVX-512 VNNI dot products
// (register operands) between its steps ("bare+vnni", tile and VNNI ops counted apart: whether a core's vector
// units add to what its tile unit does); the kernel's default walk at M = 128 on the Qwen3 gate/up shape (int8,
// K = 2048, 4 blocks) with hot weights (one call's 128 KB, from L2) and with cold ones (each thread cycling through
// its own 128 MiB of a pool, past the L3). A round prints each mode's total TOPS, so the walk's hot/cold ratio is
// read within one stretch. KT_BENCH_THREADS (default 1,16), KT_BENCH_ROUNDS (default 12), KT_BENCH_VNNI (default 32).
int env_int(const char* name, int fallback) {
  const char* env = std::getenv(name);
  return env == nullptr || *env == '\0' ? fallback : std::atoi(env);
}

// The L1 loop of peak_run with `vnni` VPDPBUSDs after each step's 4 tile products (tiles false: the VPDPBUSDs
// alone); returns {tile ops, vnni ops}.
std::pair<double, double> mixed_run(const uint8_t* buf, int vnni, double seconds, bool tiles = true) {
  const uint8_t* A = buf;
  const uint8_t* B = buf + 8 * 2048;
  __m512i acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i va = _mm512_set1_epi32(0x01020304), vb = _mm512_set1_epi32(0x05060708);
  int64_t steps = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double sec = 0;
  while (sec < seconds) {
    for (int it = 0; it < 256; ++it) {
      const int64_t s = (steps + it) % 8;
      if (tiles) {
        _tile_loadd(4, A + s * 2048, 64);
        _tile_loadd(6, B + s * 2048, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_loadd(7, B + s * 2048 + 1024, 64);
        _tile_dpbssd(1, 4, 7);
        _tile_loadd(5, A + s * 2048 + 1024, 64);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
      for (int v = 0; v < vnni; v += 8) {
        acc[0] = _mm512_dpbusd_epi32(acc[0], va, vb);
        acc[1] = _mm512_dpbusd_epi32(acc[1], va, vb);
        acc[2] = _mm512_dpbusd_epi32(acc[2], va, vb);
        acc[3] = _mm512_dpbusd_epi32(acc[3], va, vb);
        acc[4] = _mm512_dpbusd_epi32(acc[4], va, vb);
        acc[5] = _mm512_dpbusd_epi32(acc[5], va, vb);
        acc[6] = _mm512_dpbusd_epi32(acc[6], va, vb);
        acc[7] = _mm512_dpbusd_epi32(acc[7], va, vb);
      }
    }
    steps += 256;
    sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  alignas(64) static thread_local int32_t sink[16 * 16];
  _tile_stored(0, sink, 64);
  __m512i all = acc[0];
  for (int i = 1; i < 8; ++i) all = _mm512_add_epi32(all, acc[i]);
  _mm512_store_si512(sink, all);
  const double v = vnni / 8 * 8;  // VPDPBUSDs a step, each 16 lanes x 4 products
  return {tiles ? 4.0 * 16 * 16 * 64 * 2 * steps / sec : 0.0, v * 16 * 4 * 2 * steps / sec};
}

void bench_stretch() {
  static const PeakConfig cfg;
  amx_min_rows_for_tests(0);
  amx_kernels();
  const int rounds = env_int("KT_BENCH_ROUNDS", 12), vnni = env_int("KT_BENCH_VNNI", 32);
  std::vector<int> counts;
  {
    const char* env = std::getenv("KT_BENCH_THREADS");
    std::string list = env != nullptr && *env != '\0' ? env : "1,16";
    for (size_t start = 0; start <= list.size();) {
      size_t comma = list.find(',', start);
      if (comma == std::string::npos) comma = list.size();
      counts.push_back(std::atoi(list.substr(start, comma - start).c_str()));
      start = comma + 1;
    }
  }
  constexpr int kM = 128, kBlocks = 4;
  constexpr int64_t kK = 2048;
  const size_t call_bytes = block_bytes(WeightFormat::INT8, kK) * kBlocks, slice = size_t(128) << 20;
  const int most = *std::max_element(counts.begin(), counts.end());
  auto* pool = static_cast<uint8_t*>(std::aligned_alloc(4096, slice * most));
  std::printf("stretch: %d rounds of 5 modes, ~40 ms each; TOPS of all threads (int8 ops)\n", rounds);
  for (int n : counts) {
    std::printf("%2d threads: %8s %10s %10s %10s %10s\n", n, "bare", "bare+vnni", "(vnni)", "walk hot", "walk cold");
    std::vector<double> tops(5 * n);
    std::atomic<int> arrived{0};
    auto barrier = [&](int target) {
      arrived.fetch_add(1);
      while (arrived.load() < target) {}
    };
    std::vector<std::vector<double>> table(rounds, std::vector<double>(5, 0));
    std::vector<std::thread> threads;
    for (int t = 0; t < n; ++t)
      threads.emplace_back([&, t] {
        pin_with_tiles(t, cfg);
        auto* l1 = static_cast<uint8_t*>(std::aligned_alloc(64, 32 << 10));
        for (int i = 0; i < (32 << 10); ++i) l1[i] = static_cast<uint8_t>(i * 37 + 11);
        uint8_t* mine = pool + t * slice;
        for (size_t i = 0; i < slice; i += 64) std::memset(mine + i, static_cast<int>(i >> 6) * 7, 64);
        std::vector<uint8_t> arows(kM * kK);
        for (size_t i = 0; i < arows.size(); ++i) arows[i] = static_cast<uint8_t>(i * 7);
        std::vector<const void*> packed(kM), rows;
        for (int m = 0; m < kM; ++m) packed[m] = arows.data() + m * kK;
        const std::vector<uint8_t> store = driver_rows(packed, kK, rows);
        std::vector<float> ascale(kM, 1.0f / 127), wscale(16 * kBlocks, 1.0f / 64), c(kM * 16 * kBlocks);
        std::vector<int32_t> gsum(kM, 0);
        GemmArgs a;
        a.M = kM;
        a.K = kK;
        a.a_rows = rows.data();
        a.a_scale = ascale.data();
        a.a_gsum = gsum.data();
        a.a_gsum_stride = 1;
        a.group_size = kK;
        a.b_block_stride = block_bytes(WeightFormat::INT8, kK);
        a.b_scale = wscale.data();
        a.b_scale_group_stride = 16 * kBlocks;
        a.nblocks = kBlocks;
        a.c = c.data();
        a.ldc = 16 * kBlocks;
        const GemmFn fn = amx_kernels().gemm[static_cast<int>(WeightFormat::INT8)];
        const size_t calls = slice / call_bytes;
        size_t i = 0;
        auto walk = [&](bool cold) {
          int64_t n_calls = 0;
          const auto t0 = std::chrono::steady_clock::now();
          double sec = 0;
          while (sec < 0.04) {
            for (int r = 0; r < 4; ++r, ++n_calls) {
              a.b = mine + (cold ? i : 0) * call_bytes;
              a.next_b = cold ? mine + (i + 1) % calls * call_bytes : a.b;
              if (cold) i = (i + 1) % calls;
              fn(a);
            }
            sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          }
          return 2.0 * kM * kK * 16 * kBlocks * n_calls / sec;
        };
        walk(true);
        int sync = 0;
        for (int r = 0; r < rounds; ++r) {
          double v[5];
          barrier(n * ++sync);
          v[0] = mixed_run(l1, 0, 0.04).first;
          barrier(n * ++sync);
          const auto m = mixed_run(l1, vnni, 0.04);
          v[1] = m.first;
          v[2] = m.second;
          barrier(n * ++sync);
          v[3] = walk(false);
          barrier(n * ++sync);
          v[4] = walk(true);
          for (int k = 0; k < 5; ++k) tops[5 * t + k] = v[k];
          barrier(n * ++sync);
          if (t == 0)
            for (int k = 0; k < 5; ++k) {
              double sum = 0;
              for (int u = 0; u < n; ++u) sum += tops[5 * u + k];
              table[r][k] = sum / 1e12;
            }
          barrier(n * ++sync);
        }
        _tile_release();
        std::free(l1);
      });
    for (auto& th : threads) th.join();
    for (int r = 0; r < rounds; ++r)
      std::printf("   round %2d: %8.2f %10.2f %10.2f %10.2f %10.2f\n", r, table[r][0], table[r][1], table[r][2],
                  table[r][3], table[r][4]);
  }
  std::free(pool);
}

// --bench-siblings: which vCPUs share a tile unit. The guest shows 16 cores and no siblings, but with 8 or 16
// threads at once each got ~1.5 TOPS against ~4.1 for one thread alone (session 18). For every pair (i, j) of
// CPUs, two pinned threads run the bare L1 tile loop at the same moment for ~30 ms, R times (KT_BENCH_ROUNDS,
// default 4); the pair's best total is printed as a multiple of the best one-thread rate measured alongside (on
// CPU i alone, in the same rounds). Two CPUs of one core share one unit: ~1.0; of two cores: ~2.0 (the host's
// slow stretches only lower a round, hence the best of R). Then the same for one tile thread beside one AVX-512
// thread (VNNI products only): does a sibling's vector work slow the tiles?
void bench_siblings() {
  static const PeakConfig cfg;
  const int n = static_cast<int>(std::thread::hardware_concurrency());
  const int rounds = std::max(1, env_int("KT_BENCH_ROUNDS", 4));
  // Threads on `cpus` (at most 2) at the same moment, the second running VNNI products alone when vnni_second:
  // each one's rate (tile TOPS, or VNNI TOPS for that second thread).
  auto run = [&](std::vector<int> cpus, bool vnni_second) {
    std::vector<double> r(cpus.size(), 0);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (size_t k = 0; k < cpus.size(); ++k)
      threads.emplace_back([&, k] {
        pin_with_tiles(cpus[k], cfg);
        alignas(64) static thread_local uint8_t l1[32 << 10];
        for (int i = 0; i < (32 << 10); ++i) l1[i] = static_cast<uint8_t>(i * 37 + 11);
        mixed_run(l1, 0, 0.005);  // warm up
        ready.fetch_add(1);
        while (ready.load() < static_cast<int>(cpus.size())) {}
        const bool vnni_only = vnni_second && k == 1;
        const auto m = vnni_only ? mixed_run(l1, 32, 0.03, false) : mixed_run(l1, 0, 0.03);
        r[k] = (vnni_only ? m.second : m.first) / 1e12;
        _tile_release();
      });
    for (auto& th : threads) th.join();
    return r;
  };
  for (int mode = 0; mode < 2; ++mode) {
    std::printf(mode == 0 ? "siblings: pair's best total tile rate / best one-thread rate (%d CPUs, %d rounds)\n"
                          : "tiles on CPU i beside VNNI on CPU j: i's best rate / its best alone (%d CPUs, %d rounds)\n",
                n, rounds);
    std::printf("  i\\j");
    for (int j = 0; j < n; ++j) std::printf(" %4d", j);
    std::printf("   alone (TOPS)\n");
    for (int i = 0; i < n; ++i) {
      std::vector<double> best(n, 0);
      double alone = 0;
      for (int r = 0; r < rounds; ++r) {
        alone = std::max(alone, run({i}, false)[0]);
        for (int j = 0; j < n; ++j) {
          if (j == i) continue;
          const std::vector<double> p = run({i, j}, mode == 1);
          best[j] = std::max(best[j], mode == 0 ? p[0] + p[1] : p[0]);
        }
      }
      std::printf("  %3d ", i);
      for (int j = 0; j < n; ++j)
        if (j == i) std::printf("    -");
        else std::printf(" %4.2f", alone > 0 ? best[j] / alone : 0.0);
      std::printf("   %5.2f\n", alone);
      std::fflush(stdout);
    }
  }
}

void bench_peak() {
  static const PeakConfig cfg;
  _tile_loadconfig(&cfg);
  const size_t big = size_t(64) << 20;
  auto* buf = static_cast<uint8_t*>(std::aligned_alloc(64, big));
  for (size_t i = 0; i < big; ++i) buf[i] = static_cast<uint8_t>(i * 37 + 11);
  for (size_t i = 1; i < big; i += 2) buf[i] = 0x3c;  // as bf16: normal numbers
  peak_run<false>(buf, 4096, 64, kNone, 0, 4000000, false);  // warm up the tile unit's clock
  std::printf("%-5s %-6s %6s %-5s %5s %9s\n", "fmt", "KB", "lda", "pf", "ahead", "GOPS");
  static const char* const pf_name[] = {"none", "A", "B", "A+B"};
  for (int bf = 0; bf < 2; ++bf) {
    auto best = [&](size_t kb, int64_t lda, int pf, int ahead, bool loads) {
      double g = 0;
      for (int r = 0; r < 3; ++r)
        g = std::max(g, bf ? peak_run<true>(buf, kb << 10, lda, pf, ahead, 1000000, loads) / 2
                           : peak_run<false>(buf, kb << 10, lda, pf, ahead, 1000000, loads));
      return g;
    };
    const char* f = bf ? "bf16" : "int8";
    std::printf("%-5s %-6s %6s %-5s %5s %9.1f\n", f, "-", "-", "dots", "-", best(4, 64, kNone, 0, false));
    for (size_t kb : {16, 256, 1536, 65536})
      for (int64_t lda : {64, 2112})
        for (int pf : {kNone, kA, kB, kAB})
          for (int ahead : {1, 2, 4}) {
            if (pf == kNone && ahead > 1) continue;
            if (lda != 64 && kb > 256) continue;  // a strided panel is 64 KB + its B: an L2 case only
            std::printf("%-5s %-6zu %6ld %-5s %5d %9.1f\n", f, kb, static_cast<long>(lda), pf_name[pf],
                        pf == kNone ? 0 : ahead, best(kb, lda, pf, ahead, true));
          }
  }
  _tile_release();
  std::free(buf);
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if !defined(KTAMX_EMULATE)
  // Linux gives a process the AMX tile state only on request (ktorch does this in runtime/cpu_features.cpp).
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::printf("this machine/OS does not grant AMX (arch_prctl ARCH_REQ_XCOMP_PERM failed)\n");
    return 2;
  }
  struct Bench { const char* flag; void (*run)(); };
  static const Bench benches[] = {{"--bench", bench}, {"--bench-cold", bench_cold}, {"--bench-peak", bench_peak},
                                  {"--bench-replica", bench_replica}, {"--bench-peak-threads", bench_peak_all}, {"--bench-stretch", bench_stretch},
                                  {"--bench-peak16", bench_peak16},
                                  {"--bench-siblings", bench_siblings}};
  for (const Bench& b : benches)
    if (argc > 1 && std::string(argv[1]) == b.flag) {
      b.run();
      return 0;
    }
#else
  (void)argc;
  (void)argv;
#endif
  check_all();
  return failures == 0 ? 0 : 1;
}
