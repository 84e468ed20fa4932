// Checks the AMX gemm kernels (amx/kernels.cpp) against a scalar double reference and against the AVX-512
// kernels, over the calls the fused-MoE driver makes and their edges: M 1..100 (tile walks of 1-4 row
// groups, partial groups, calls cut at 64 rows), nblocks 1-4, K with and without a 64-deep int8 tail,
// int4 groups of 32/64/128, activation rows evenly strided (tile-loaded in place) or gathered (copied),
// and the output rows/columns a call must leave alone, under every tile walk (KT_AMX_WALK: auto, pairs, rows,
// kblock with chunks of 1, 3 and 8 k steps, with and without +pfa; M up to 300 for the walks of 256 rows),
// and (emulated) that the weight prefetches stay inside the weights and cover what each walk fetches ahead.
// Also checks KT_AMX_MIN_ROWS and KT_AMX_WALK parsing.
// With --bench (real AMX only) it times one thread's AVX-512 gemm and AMX gemm under each walk per M on hot
// weights, for choosing the small-M threshold and the walk; --bench-cold the same streaming the weights from
// memory (GB/s of weights a core pulls under each walk's prefetching).
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
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#if !defined(KT_AMX_EMULATE)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "../../kernels.h"
#if defined(KT_AMX_EMULATE)
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
  int64_t K, group;  // group: int4 group size; K for int8
  bool strided;
  std::vector<int> w;             // W[n][k] codes (bf16: the bf16 bits), n < 16 * total_blocks
  std::vector<uint8_t> packed;    // exactly the packed bytes
  std::vector<float> wscale;      // [G][N]
  std::vector<uint8_t> arows;     // activation storage, exactly sized
  std::vector<const void*> rows;  // per call row
  std::vector<float> ascale;
  std::vector<int32_t> gsum;      // [M][G]
  int64_t G() const { return f == WeightFormat::INT4 ? K / group : 1; }
  int64_t N() const { return 16 * total_blocks; }
};

Problem make_problem(WeightFormat f, int M, int64_t K, int nblocks, int64_t group, bool strided) {
  Problem p;
  p.f = f;
  p.M = M;
  p.K = K;
  p.nblocks = nblocks;
  p.total_blocks = nblocks + 1;
  p.group = f == WeightFormat::INT4 ? group : K;
  p.strided = strided;
  const int64_t N = p.N(), G = p.G();
  p.w.resize(N * K);
  for (auto& v : p.w) {
    if (f == WeightFormat::BF16) v = to_bf16(rand_float(-1, 1));
    else if (f == WeightFormat::INT8) v = rand_int(-127, 127);
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
        const uint8_t nib = static_cast<uint8_t>(v + 8);
        byte = (k % 8) < 4 ? static_cast<uint8_t>((byte & 0xf0) | nib) : static_cast<uint8_t>((byte & 0x0f) | (nib << 4));
      }
    }
  p.wscale.resize(G * N);
  for (auto& s : p.wscale) s = rand_float(0.5f, 2.0f) / 64;
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
          for (int64_t k = g * p.group; k < (g + 1) * p.group; ++k) dot += static_cast<int64_t>(x[k]) * p.w[n * K + k];
          total += static_cast<double>(dot) * p.wscale[g * N + n];
          mag += std::fabs(static_cast<double>(dot) * p.wscale[g * N + n]);
        }
        total *= p.ascale[m];
        mag *= p.ascale[m];
      }
      out[m * cols + c] = total;
      magnitude[m * cols + c] = mag;
    }
}

// Runs one gemm into a C buffer with a wider ldc and extra rows, all pre-filled with a sentinel. next_b: the
// hint of the caller's next call (default: these weights again).
std::vector<float> run(const Problem& p, GemmFn fn, int64_t ldc, int extra_rows, const uint8_t* next_b = nullptr) {
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
  a.b = p.packed.data() + first * block_bytes(p.f, p.K);
  a.b_block_stride = block_bytes(p.f, p.K);
  a.nblocks = p.nblocks;
  a.c = c.data();
  a.ldc = ldc;
  a.next_b = next_b != nullptr ? next_b : p.packed.data();  // a prefetch hint only: any readable weights
  fn(a);
  return c;
}

int failures = 0;

// Set by check_walk: the walk under test prefetches the next column pair and the next call's first pair into
// L2 in full ('rows', 'kblock'); every walk keeps its weight prefetches inside the weights.
bool g_check_prefetch = false;
bool g_full_next = false;
bool g_full_next_int4 = false;  // 'auto' walks int4 as 'pairs'

#if defined(KT_AMX_EMULATE)
// The weight lines the last call prefetched: inside the call's weights or the next call's, and with
// g_full_next every line of the call's blocks 2.. and of the next call's first two blocks fetched into L2.
// Returns what is wrong, or an empty string.
std::string check_prefetches(const Problem& p, const std::vector<uint8_t>& next) {
  const auto& lines = amx_emulation::prefetch_log().lines;
  const auto in = [](const void* q, const uint8_t* lo, size_t n) {
    return static_cast<const uint8_t*>(q) >= lo && static_cast<const uint8_t*>(q) < lo + n;
  };
  for (const auto& l : lines)
    if (!in(l.line, p.packed.data(), p.packed.size()) && !in(l.line, next.data(), next.size()))
      return "prefetched a line outside the weights";
  if (!g_full_next || (p.f == WeightFormat::INT4 && !g_full_next_int4)) return "";
  const size_t bb = block_bytes(p.f, p.K);
  const int64_t steps = p.f == WeightFormat::BF16 ? p.K / 32 : p.f == WeightFormat::INT8 ? p.K / 64 : p.K / 64;
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
    if (!seen_next[o / 64]) return "the next call's first column pair was not prefetched into L2 in full";
  return "";
}
#endif

void check_case(WeightFormat f, int M, int64_t K, int nblocks, int64_t group, bool strided) {
  const Problem p = make_problem(f, M, K, nblocks, group, strided);
  const int64_t cols = 16 * nblocks, ldc = cols + 16;
  std::vector<uint8_t> next(block_bytes(f, K) * nblocks, 0);  // the caller's next call's weights
  std::string prefetch_error;
#if defined(KT_AMX_EMULATE)
  amx_emulation::prefetch_log().lines.clear();
  amx_emulation::prefetch_log().on = g_check_prefetch;
#endif
  const std::vector<float> amx = run(p, amx_kernels().gemm[static_cast<int>(f)], ldc, 3, next.data());
#if defined(KT_AMX_EMULATE)
  amx_emulation::prefetch_log().on = false;
  if (g_check_prefetch) prefetch_error = check_prefetches(p, next);
#endif
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
      const double terms = f == WeightFormat::BF16 ? static_cast<double>(K) : static_cast<double>(p.G()) + 2;
      const double bound = terms * std::ldexp(1.0, -24) * mag[m * cols + j] + 1e-30;
      worst = std::max(worst, std::fabs(v - ref[m * cols + j]) / bound);
      const float w = avx[m * ldc + j];
      worst_vs_avx = std::max(worst_vs_avx, static_cast<double>(std::fabs(v - w)));
    }
  // int formats: same integer sums and fp32 operations in the same order as AVX-512, so bit-identical
  const bool exact = f == WeightFormat::BF16 || worst_vs_avx == 0.0;
  if (worst > 1.0 || !untouched || !exact || !prefetch_error.empty()) {
    ++failures;
    std::printf("FAIL %s M=%d K=%lld nblocks=%d group=%lld %s: error/bound %.3g, |amx-avx512| max %.3g%s%s%s\n", name(f),
                M, static_cast<long long>(K), nblocks, static_cast<long long>(group), strided ? "strided" : "gathered",
                worst, worst_vs_avx, untouched ? "" : ", wrote outside its rows/columns",
                prefetch_error.empty() ? "" : ", ", prefetch_error.c_str());
  }
}

void check_min_rows_parsing() {
  const char* good[] = {"8", "0", "bf16=8", "bf16=8,int8=2,int4=16", "int4=3"};
  for (const char* v : good) {
    setenv("KT_AMX_MIN_ROWS", v, 1);
    try {
      amx_kernels();
    } catch (const std::exception& e) {
      ++failures;
      std::printf("FAIL KT_AMX_MIN_ROWS='%s' rejected: %s\n", v, e.what());
    }
  }
  const char* bad[] = {"x", "-1", "8,9", "fp8=3", "bf16=", "bf16=3;int8=4"};
  for (const char* v : bad) {
    setenv("KT_AMX_MIN_ROWS", v, 1);
    bool threw = false;
    try {
      amx_kernels();
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    if (!threw) {
      ++failures;
      std::printf("FAIL KT_AMX_MIN_ROWS='%s' accepted\n", v);
    }
  }
  unsetenv("KT_AMX_MIN_ROWS");
}

void check_walk_parsing() {
  const char* good[] = {"", "auto", "auto+pfa", "pairs", "rows", "kblock", "kblock:1", "kblock:16", "rows+pfa", "kblock:4+pfa", "pairs+pfa"};
  for (const char* v : good) {
    setenv("KT_AMX_WALK", v, 1);
    try {
      amx_kernels();
    } catch (const std::exception& e) {
      ++failures;
      std::printf("FAIL KT_AMX_WALK='%s' rejected: %s\n", v, e.what());
    }
  }
  const char* bad[] = {"autos", "row", "kblock:", "kblock:0", "kblock:x", "rows+", "rows+pfb", "kblock8", "pairs:2x"};
  for (const char* v : bad) {
    setenv("KT_AMX_WALK", v, 1);
    bool threw = false;
    try {
      amx_kernels();
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    if (!threw) {
      ++failures;
      std::printf("FAIL KT_AMX_WALK='%s' accepted\n", v);
    }
  }
  unsetenv("KT_AMX_WALK");
}

// Every case under the walk that KT_AMX_WALK names (set by the caller).
int check_walk(const char* walk) {
  setenv("KT_AMX_WALK", walk, 1);
  amx_kernels();
  const int before = failures;
  const bool long_walk = std::strcmp(walk, "pairs") != 0;  // walks of 256 rows: cut at 256, not 64
  g_check_prefetch = true;
  g_full_next = long_walk;
  g_full_next_int4 = long_walk && std::strncmp(walk, "auto", 4) != 0;
  std::vector<int> Ms = {1, 2, 3, 5, 8, 15, 16, 17, 24, 31, 32, 33, 40, 47, 48, 49, 63, 64, 65, 100};
  if (long_walk) Ms.insert(Ms.end(), {129, 256, 300});
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
        ++cases;
      }
  // a driver-sized reduction for each format (kblock: 3 chunks of bf16, 2 of int8 plus its 32-deep tail)
  for (int M : {7, 37, 64, 130}) {
    check_case(WeightFormat::BF16, M, 768, 4, 0, M % 2 == 1);
    check_case(WeightFormat::INT8, M, 800, 2, 0, M % 2 == 1);
    check_case(WeightFormat::INT4, M, 768, 3, 128, M % 2 == 1);
    cases += 3;
  }
  g_check_prefetch = g_full_next = g_full_next_int4 = false;
  std::printf("walk %-14s %d cases, %d failed\n", walk, cases, failures - before);
  return cases;
}

void check_all() {
  check_min_rows_parsing();
  check_walk_parsing();
  setenv("KT_AMX_MIN_ROWS", "0", 1);  // every M through the tiles
  amx_kernels();
  int cases = 0;
  for (const char* walk : {"auto", "pairs", "rows", "rows+pfa", "kblock", "kblock:1", "kblock:3+pfa"}) cases += check_walk(walk);
  unsetenv("KT_AMX_WALK");
  amx_kernels();
  // the default threshold sends small M to AVX-512: results must still be right
  unsetenv("KT_AMX_MIN_ROWS");
  amx_kernels();
  for (int M : {1, 3, 4, 9}) {
    check_case(WeightFormat::INT8, M, 128, 2, 0, false);
    check_case(WeightFormat::INT4, M, 128, 2, 64, true);
    cases += 2;
  }
  std::printf("%d cases, %d failed\n", cases, failures);
}

#if !defined(KT_AMX_EMULATE)
// One thread: AMX vs AVX-512 per M on hot (L2-resident) weights, for the small-M threshold.
void bench() {
  setenv("KT_AMX_MIN_ROWS", "0", 1);
  amx_kernels();
  struct Shape { const char* what; int64_t K; int nblocks; };
  const Shape shapes[] = {{"qwen3 gate/up", 2048, 4}, {"qwen3 down", 768, 2}, {"deepseek gate/up", 7168, 4},
                          {"deepseek down", 2048, 4}};
  // AVX-512, then AMX under each walk (the column "amx/avx" compares the default walk, pairs)
  const char* walks[] = {"pairs", "rows", "rows+pfa", "kblock", "kblock+pfa"};
  constexpr int kWalks = sizeof(walks) / sizeof(walks[0]);
  std::printf("%-18s %-5s %4s %12s", "shape", "fmt", "M", "avx512 GOPS");
  for (const char* w : walks) std::printf(" %11s", w);
  std::printf(" %8s\n", "amx/avx");
  for (const Shape& s : shapes)
    for (WeightFormat f : {WeightFormat::BF16, WeightFormat::INT8, WeightFormat::INT4})
      for (int M : {1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256}) {
        const Problem p = make_problem(f, M, s.K, s.nblocks, 128, false);
        double gops[1 + kWalks];
        for (int which = 0; which <= kWalks; ++which) {
          if (which > 0) {
            setenv("KT_AMX_WALK", walks[which - 1], 1);
            amx_kernels();
          }
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
        std::printf("%-18s %-5s %4d %12.1f", s.what, name(f), M, gops[0]);
        for (int i = 1; i <= kWalks; ++i) std::printf(" %11.1f", gops[i]);
        std::printf(" %8.2f\n", gops[1] / gops[0]);
      }
}

// One thread streaming weights from memory: consecutive calls take consecutive weights of a 1 GiB pool (past
// any L3), each naming the next as next_b like the driver's calls of one expert, so the walks' prefetching
// is what is measured. Prints GB/s of weights read, AVX-512 and each AMX walk, per M.
void bench_cold() {
  setenv("KT_AMX_MIN_ROWS", "0", 1);
  struct Shape { const char* what; int64_t K; int nblocks; };
  const Shape shapes[] = {{"qwen3 gate/up", 2048, 4}, {"qwen3 down", 768, 8}, {"deepseek gate/up", 7168, 4}};
  const char* walks[] = {"pairs", "rows", "rows+pfa", "kblock", "kblock+pfa"};
  constexpr int kWalks = sizeof(walks) / sizeof(walks[0]);
  const size_t pool_bytes = size_t(1) << 30;
  auto* pool = static_cast<uint16_t*>(std::aligned_alloc(64, pool_bytes));
  uint64_t x = 88172645463325252ull;
  for (size_t i = 0; i < pool_bytes / 2; ++i) {  // as bf16: normal numbers near 2^-7; as int8/int4: any bytes
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    pool[i] = static_cast<uint16_t>((x & 0x807f) | 0x3c00);
  }
  const auto* base = reinterpret_cast<const uint8_t*>(pool);
  std::printf("one thread, weights from memory: GB/s of weights\n%-18s %-5s %4s %12s", "shape", "fmt", "M", "avx512");
  for (const char* w : walks) std::printf(" %11s", w);
  std::printf("\n");
  for (const Shape& s : shapes)
    for (WeightFormat f : {WeightFormat::BF16, WeightFormat::INT8, WeightFormat::INT4})
      for (int M : {16, 32, 128}) {
        const int64_t N = 16 * s.nblocks, G = f == WeightFormat::INT4 ? s.K / 128 : 1;
        const size_t bb = block_bytes(f, s.K), call_bytes = bb * s.nblocks, calls = pool_bytes / call_bytes;
        const int64_t row_bytes = f == WeightFormat::BF16 ? 2 * s.K : s.K;
        std::vector<uint8_t> arows(M * row_bytes);
        for (size_t i = 0; i < arows.size(); ++i) arows[i] = static_cast<uint8_t>(f == WeightFormat::BF16 && i % 2 ? 0x3c : i * 7);
        std::vector<const void*> rows(M);
        for (int m = 0; m < M; ++m) rows[m] = arows.data() + m * row_bytes;
        std::vector<float> ascale(M, 1.0f / 127), wscale(G * N, 1.0f / 64), c(M * N);
        std::vector<int32_t> gsum(M * G, 0);
        GemmArgs a;
        a.M = M;
        a.K = s.K;
        a.a_rows = rows.data();
        a.a_scale = ascale.data();
        a.a_gsum = gsum.data();
        a.a_gsum_stride = G;
        a.group_size = f == WeightFormat::INT4 ? 128 : s.K;
        a.b_block_stride = bb;
        a.b_scale = wscale.data();
        a.b_scale_group_stride = N;
        a.nblocks = s.nblocks;
        a.c = c.data();
        a.ldc = N;
        double gbs[1 + kWalks];
        size_t i = 0;
        for (int which = 0; which <= kWalks; ++which) {
          if (which > 0) {
            setenv("KT_AMX_WALK", walks[which - 1], 1);
            amx_kernels();
          }
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
        std::printf("%-18s %-5s %4d %12.2f", s.what, name(f), M, gbs[0]);
        for (int w = 1; w <= kWalks; ++w) std::printf(" %11.2f", gbs[w]);
        std::printf("\n");
      }
  std::free(pool);
}
#endif

}  // namespace

int main(int argc, char** argv) {
#if !defined(KT_AMX_EMULATE)
  // Linux gives a process the AMX tile state only on request (ktorch does this in runtime/cpu_features.cpp).
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::printf("this machine/OS does not grant AMX (arch_prctl ARCH_REQ_XCOMP_PERM failed)\n");
    return 2;
  }
  if (argc > 1 && std::string(argv[1]) == "--bench") {
    bench();
    return 0;
  }
  if (argc > 1 && std::string(argv[1]) == "--bench-cold") {
    bench_cold();
    return 0;
  }
#else
  (void)argc;
  (void)argv;
#endif
  check_all();
  return failures == 0 ? 0 : 1;
}
