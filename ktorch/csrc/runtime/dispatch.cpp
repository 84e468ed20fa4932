#include "dispatch.h"

#include <c10/util/Exception.h>

#include <cstdlib>

#include "config.h"
#include "cpu_features.h"

namespace kt::runtime {
namespace {

// Flipped when ktorch/csrc/kernels/amx/ holds real AMX kernels.
constexpr bool kAmxKernelsWritten = true;

bool level_available(const std::string& level) {
  const CpuFeatures& f = cpu_features();
  if (level == "portable") return true;
  if (level == "avx2") return f.has_avx2_kernels();
  if (level == "avx512") return f.has_avx512_kernels();
  if (level == "amx") return kAmxKernelsWritten && f.has_amx_kernels();
  return false;
}

std::string best_level() {
  if (level_available("amx")) return "amx";
  if (level_available("avx512")) return "avx512";
  if (level_available("avx2")) return "avx2";
  return "portable";
}

}  // namespace

std::string available_kernel_levels() {
  std::string out = "portable";
  for (const char* l : {"avx2", "avx512", "amx"})
    if (level_available(l)) out += std::string(",") + l;
  return out;
}

std::string selected_kernel_level() {
  const std::string want = config::value("KT_CPU_KERNEL").value_or("");
  if (want.empty() || want == "auto") return best_level();
  TORCH_CHECK(want == "portable" || want == "avx2" || want == "avx512" || want == "amx",
              "KT_CPU_KERNEL must be one of auto, portable, avx2, avx512, amx; got '", want, "'");
  TORCH_CHECK(level_available(want), "KT_CPU_KERNEL=", want, " but this CPU/OS cannot run it (available: ",
              available_kernel_levels(), ")");
  return want;
}

const kernels::KernelSet& select_kernels() {
  const std::string level = selected_kernel_level();
  if (level == "amx") return kernels::amx_kernels();
  if (level == "avx512") return kernels::avx512_kernels();
  if (level == "avx2") return kernels::avx2_kernels();
  return kernels::portable_kernels();
}

}  // namespace kt::runtime
