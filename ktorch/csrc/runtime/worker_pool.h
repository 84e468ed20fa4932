// ktorch's own CPU worker pool for the fused-MoE op.
//
// Why not ATen's OpenMP pool: the op runs once per MoE layer per decode step (48 times per token on
// Qwen3-30B-A3B), each call a few hundred microseconds of work; it needs workers that are already awake
// when a call arrives. Workers here spin for KT_SPIN_US microseconds (default 2000) after each job, then
// park on a condition variable; the calling thread takes part as worker 0, tasks are pulled from an
// atomic counter (dynamic balancing for skewed routing). A call waits for its tasks, not for every worker:
// with more runnable threads than cores (the GPU launch thread, CUDA's host-function thread, other
// processes), a worker the scheduler has not run yet simply misses the call instead of stalling it for a
// scheduler time slice.
//
// Thread counts: KT_NUM_THREADS workers in all (the caller included); default at::get_num_threads() at
// the pool's creation (PyTorch's intra-op thread count, one per physical core by default). Workers are not
// pinned: the calling thread is not, and a caller that lands on a pinned spinning worker's CPU shares it with
// that worker for whole scheduler time slices (milliseconds); pinning measured no better on the device
// (benchmarks/RESULTS.md, pool sweep), and the switch for it was removed.
// While workers spin, PyTorch's own intra-op threads compete with them for cores, so the op does its
// own conversions on the pool instead of through ATen's parallel kernels; on a CPU-only run the ATen
// work between MoE layers is short, and KT_SPIN_US=0 parks workers at once.
// Spinning workers do not yield their core (sched_yield every ~10 us was tried for the GPU launcher's sake and
// did not help decode on the device: benchmarks/RESULTS.md, pool sweep); hybrid placement leaves cores free
// instead (ktorch.prepare, HYBRID_SPARE_CORES). KT_NUM_THREADS and KT_SPIN_US are read through config.h.
//
// Other pools (NUMA split, runtime/numa.h): a pool can also be built bound to a set of CPUs (all its
// workers may run on any CPU of the set, e.g. one NUMA node), and a thread can be given its own pool with
// use_on_this_thread(): instance() on that thread then returns that pool, so code written against the
// process-wide pool (parallel.h, the fused-MoE driver) runs on the thread's pool unchanged. Threads that
// never call it see the process-wide pool as before.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace kt::runtime {

// The CPUs this process may run on (its affinity mask), in order.
std::vector<int> process_cpus();
// KT_SPIN_US (config.h): how long an idle worker spins before it parks, us (default 2000).
int64_t spin_us();
// Polls between two sched_yield calls of a thread that waits long for another's task (fused_moe's stage waits;
// ~10 us of PAUSEs).
constexpr int kYieldPolls = 64;

class WorkerPool {
 public:
  // The process-wide pool, created on first use.
  static WorkerPool& instance();
  // Replaces the process-wide pool by one of `workers` threads (the caller included), unless it has that size
  // and KT_SPIN_US still reads as it was built with. Waits for a call in flight on
  // the old pool; call it between ops (a call that has already looked up the pool must not be running on another
  // thread).
  static void resize(int workers);
  // instance() on the calling thread returns `pool` from now on (nullptr: the process-wide pool again).
  // The pool must outlive its use on this thread.
  static void use_on_this_thread(WorkerPool* pool);

  // A pool whose worker threads (not the caller) may run on the CPUs in bind_cpus only (empty: anywhere).
  WorkerPool(int workers, int64_t spin_us, const std::vector<int>& bind_cpus = {});
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Workers including the calling thread.
  int size() const { return static_cast<int>(threads_.size()) + 1; }

  // Runs fn(task, worker) for task in [0, n) on all workers; worker in [0, size()) is unique among the
  // calls running at one time (index per-worker scratch with it). Returns when every task is done;
  // rethrows the first exception a task threw. Calls from several threads run one after another.
  template <typename Fn>
  void run(int64_t n, const Fn& fn) {
    run_erased(n, &fn, [](const void* f, int64_t task, int worker) { (*static_cast<const Fn*>(f))(task, worker); });
  }

 private:
  using Invoke = void (*)(const void*, int64_t, int);
  void run_erased(int64_t n, const void* fn, Invoke invoke);
  void work(int worker);
  void worker_loop(int worker);
  static void set_affinity(std::thread& t, const std::vector<int>& cpus);

  std::vector<std::thread> threads_;
  int64_t spin_us_;
  std::mutex run_mutex_;

  // The current job. A call returns when all its tasks are done and no worker is inside it: a worker that
  // has not joined by then (descheduled, or still waking from its park) never enters it, so one late
  // thread costs the call nothing unless it holds a task. Joining is a Dekker handshake on seq_cst
  // atomics: the worker counts itself in (inside_), then checks that the job is still open; the caller
  // closes the job, then waits for inside_ to drain.
  const void* fn_ = nullptr;
  Invoke invoke_ = nullptr;
  int64_t n_tasks_ = 0;
  std::atomic<int64_t> next_task_{0};
  std::atomic<int64_t> done_tasks_{0};
  std::atomic<int> inside_{0};
  std::atomic<bool> open_{false};
  std::atomic<bool> abort_{false};  // a task threw: the rest are counted done without running
  std::exception_ptr error_;
  std::mutex error_mutex_;

  std::atomic<uint64_t> generation_{0};
  std::atomic<bool> stop_{false};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
};

}  // namespace kt::runtime
