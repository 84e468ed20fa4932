#include "memory.h"

#include <sys/mman.h>

#include <cstdint>

#include <c10/util/Exception.h>

#include "config.h"

namespace kt::runtime {

bool huge_pages_enabled() {
  return config::flag("KT_HUGE_PAGES", true);
}

void advise_huge_pages(const at::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.nbytes() == 0 || !huge_pages_enabled()) return;
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
  const uintptr_t begin = (first + kHuge - 1) & ~(kHuge - 1), end = (first + t.nbytes()) & ~(kHuge - 1);
  // A refusal (THP compiled out, a kernel without it) leaves ordinary pages: nothing to report.
  if (end > begin) (void)madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

at::Tensor empty_weights(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  advise_huge_pages(t);
  return t;
}

}  // namespace kt::runtime
