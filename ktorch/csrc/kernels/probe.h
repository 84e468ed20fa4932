// Micro-benchmarks of the dot-product units, so benchmarks can state how close a kernel gets to peak.
#pragma once

#include <cstdint>

namespace kt::kernels {

// Runs `iters` rounds of independent 512-bit dot-product instructions on this thread and returns the
// operations performed (a multiply-add counts 2). kind: 0 = vdpbf16ps (bf16), 1 = vpdpbusd (int8).
double avx512_dot_ops(int kind, int64_t iters);

}  // namespace kt::kernels
