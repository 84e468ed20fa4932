// Task-parallel loop used by the fused-MoE driver: n independent tasks, pulled dynamically by the
// workers of ktorch's pool (worker_pool.h), so skewed tasks balance.
#pragma once

#include <cstdint>

#include "worker_pool.h"

namespace kt::runtime {

inline int num_workers() { return WorkerPool::instance().size(); }

// fn(task, worker) for task in [0, n); worker in [0, num_workers()) indexes per-worker scratch.
template <typename Fn>
void parallel_tasks(int64_t n, const Fn& fn) {
  WorkerPool::instance().run(n, fn);
}

}  // namespace kt::runtime
