// What this CPU and OS let ktorch run, detected once from CPUID and XCR0.
#pragma once

#include <string>

namespace kt::runtime {

struct CpuFeatures {
  std::string vendor;
  bool avx2 = false, fma = false;
  bool os_avx = false;                        // XCR0 enables SSE and YMM state
  bool avx512f = false, avx512bw = false, avx512vl = false;
  bool avx512_bf16 = false, avx512_vnni = false;
  bool os_avx512 = false;                     // XCR0 enables opmask and ZMM state
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;
  bool os_amx = false;                        // XCR0 enables XTILECFG/XTILEDATA and the kernel granted XTILEDATA
  bool has_avx2_kernels() const { return os_avx && avx2 && fma; }
  bool has_avx512_kernels() const { return os_avx512 && avx512f && avx512bw && avx512vl && avx512_bf16 && avx512_vnni; }
  bool has_amx_kernels() const { return has_avx512_kernels() && os_amx && amx_tile && amx_bf16 && amx_int8; }
};

const CpuFeatures& cpu_features();

}  // namespace kt::runtime
