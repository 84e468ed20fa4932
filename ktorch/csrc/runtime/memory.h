// Memory for packed expert weights: transparent huge pages.
//
// Decode streams every routed expert's weights from DRAM once per token (1.8 GB a step on a 48-layer
// Qwen3-30B-A3B in int8), 4 KiB at a time on ordinary pages: every page is a TLB miss, and under a hypervisor
// (two-level page walks) a costly one. Packed weights are therefore allocated on transparent huge pages
// (2 MiB) where the kernel allows it: madvise(MADV_HUGEPAGE) on the buffer before its first touch, so that its
// faults take huge pages when THP is "madvise" or "always". Measured on the device's Xeon: a decode layer's
// experts 1-3% faster (benchmarks/RESULTS.md, bench_defer_split.py --huge-pages). KT_HUGE_PAGES=0 turns it off
// (the default is 1); with THP "never" the advice is a no-op. Nothing else changes: same bytes, same layout.
#pragma once

#include <ATen/ATen.h>

namespace kt::runtime {

// KT_HUGE_PAGES: 1 (default) or 0; anything else is an error naming the variable. Read on every call.
bool huge_pages_enabled();
// Advises the whole 2 MiB-aligned part of a CPU tensor's bytes onto huge pages (when enabled). Only pages not
// yet touched are affected: call it on a fresh allocation, before writing. Harmless on any tensor. Allocations
// above glibc's mmap threshold (at most 32 MiB; a layer's packed experts are hundreds of MiB) are always fresh;
// a smaller one may reuse heap memory an earlier tensor touched, which stays on small pages.
void advise_huge_pages(const at::Tensor& t);
// at::empty, advised onto huge pages: for packed weights that are written once and streamed on every call.
at::Tensor empty_weights(at::IntArrayRef sizes, const at::TensorOptions& options);

}  // namespace kt::runtime
