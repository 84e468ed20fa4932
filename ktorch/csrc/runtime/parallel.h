// Task-parallel loop used by the fused-MoE driver: n independent tasks, pulled dynamically from an
// atomic counter by at::get_num_threads() workers (ATen's intra-op pool), so skewed tasks balance.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kt::runtime {

inline int num_workers() { return at::in_parallel_region() ? 1 : at::get_num_threads(); }

// fn(task, worker) for task in [0, n); worker in [0, num_workers()) indexes per-worker scratch.
template <typename Fn>
void parallel_tasks(int64_t n, int workers, const Fn& fn) {
  if (n <= 0) return;
  workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(workers, n)));
  if (workers == 1) {
    for (int64_t t = 0; t < n; ++t) fn(t, 0);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w)
      for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < n; t = next.fetch_add(1, std::memory_order_relaxed))
        fn(t, static_cast<int>(w));
  });
}

}  // namespace kt::runtime
