// Which ISA's kernels run: the best this CPU allows, unless KT_CPU_KERNEL=portable|avx512|amx forces one
// (read at every call, so tests can reach each path in one process). Forcing a kernel the CPU cannot
// run is an error, never a silent fallback.
#pragma once

#include <string>

#include "../kernels/kernels.h"

namespace kt::runtime {

// "portable", "avx2", "avx512" or "amx": the level a call runs at after KT_CPU_KERNEL is applied.
std::string selected_kernel_level();
const kernels::KernelSet& select_kernels();
// The levels this machine can run, best last.
std::string available_kernel_levels();

}  // namespace kt::runtime
