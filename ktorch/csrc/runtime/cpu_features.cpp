// CPUID / XGETBV feature detection. AMX additionally needs the process to ask Linux for permission to
// use the XTILEDATA state (arch_prctl ARCH_REQ_XCOMP_PERM); without it the first tile instruction faults.
#include "cpu_features.h"

#include <cpuid.h>
#include <cstring>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kt::runtime {
namespace {

constexpr unsigned kArchReqXcompPerm = 0x1023;
constexpr unsigned kXfeatureXtiledata = 18;

unsigned long long xgetbv0() {
  unsigned eax, edx;
  asm volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<unsigned long long>(edx) << 32) | eax;
}

bool request_amx_permission() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a, b, c, d;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return f;
  const unsigned max_leaf = a;
  char vendor[13] = {0};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  f.vendor = vendor;
  if (max_leaf < 7) return f;
  __get_cpuid(1, &a, &b, &c, &d);
  const bool osxsave = (c >> 27) & 1;
  f.fma = (c >> 12) & 1;
  unsigned long long xcr0 = osxsave ? xgetbv0() : 0;
  f.os_avx = (xcr0 & 0x6) == 0x6;       // SSE, AVX (YMM)
  f.os_avx512 = (xcr0 & 0xe6) == 0xe6;  // SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = (b >> 5) & 1;
  f.avx512f = (b >> 16) & 1;
  f.avx512bw = (b >> 30) & 1;
  f.avx512vl = (b >> 31) & 1;
  f.avx512_vnni = (c >> 11) & 1;
  f.amx_bf16 = (d >> 22) & 1;
  f.amx_tile = (d >> 24) & 1;
  f.amx_int8 = (d >> 25) & 1;
  __cpuid_count(7, 1, a, b, c, d);
  f.avx512_bf16 = (a >> 5) & 1;
  const bool os_tiles = ((xcr0 >> 17) & 3) == 3;  // XTILECFG, XTILEDATA
  f.os_amx = f.amx_tile && os_tiles && request_amx_permission();
  return f;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

}  // namespace kt::runtime
