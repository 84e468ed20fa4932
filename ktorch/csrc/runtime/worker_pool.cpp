#include "worker_pool.h"

#include "config.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>

namespace kt::runtime {

int64_t spin_us() { return config::integer("KT_SPIN_US", 2000); }

std::vector<int> process_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

namespace {
std::mutex g_pool_mutex;                   // guards creating and replacing g_pool
std::unique_ptr<WorkerPool> g_pool;        // the process-wide pool
std::atomic<WorkerPool*> g_current{nullptr};  // g_pool.get(), read without the lock on every parallel loop
thread_local WorkerPool* t_pool = nullptr;    // use_on_this_thread
}  // namespace

void WorkerPool::use_on_this_thread(WorkerPool* pool) { t_pool = pool; }

WorkerPool& WorkerPool::instance() {
  if (t_pool) return *t_pool;
  if (WorkerPool* pool = g_current.load(std::memory_order_acquire)) return *pool;
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (!g_pool) {
    g_pool = std::make_unique<WorkerPool>(static_cast<int>(config::integer("KT_NUM_THREADS", at::get_num_threads())),
                                          spin_us());
    g_current.store(g_pool.get(), std::memory_order_release);
  }
  return *g_pool;
}

void WorkerPool::resize(int workers) {
  TORCH_CHECK(workers >= 1, "set_num_threads: the pool needs at least 1 thread, got ", workers);
  const int64_t spin = spin_us();
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  if (g_pool && g_pool->size() == workers && g_pool->spin_us_ == spin) return;
  std::unique_ptr<WorkerPool> fresh = std::make_unique<WorkerPool>(workers, spin);
  if (g_pool) {
    std::lock_guard<std::mutex> idle(g_pool->run_mutex_);  // a call in flight finishes first
  }
  std::unique_ptr<WorkerPool> old = std::move(g_pool);
  g_pool = std::move(fresh);
  g_current.store(g_pool.get(), std::memory_order_release);
  old.reset();
}

WorkerPool::WorkerPool(int workers, int64_t spin_us, const std::vector<int>& bind_cpus) : spin_us_(spin_us) {
  TORCH_CHECK(workers >= 1, "KT_NUM_THREADS must be at least 1, got ", workers);
  for (int w = 1; w < workers; ++w) {
    threads_.emplace_back([this, w] { worker_loop(w); });
    pthread_setname_np(threads_.back().native_handle(), "kt-pool");  // what top -H and /proc/<pid>/task/*/comm show
    if (!bind_cpus.empty()) set_affinity(threads_.back(), bind_cpus);
  }
}

// Set by the constructor on the new thread's handle, not by the thread itself: the pool is bound when the
// constructor returns, whenever the thread first runs (a bound pool's first call could otherwise finish on the
// caller before a worker had bound itself).
void WorkerPool::set_affinity(std::thread& t, const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  pthread_setaffinity_np(t.native_handle(), sizeof(set), &set);
}

WorkerPool::~WorkerPool() {
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::work(int worker) {
  for (int64_t t = next_task_.fetch_add(1, std::memory_order_relaxed); t < n_tasks_;
       t = next_task_.fetch_add(1, std::memory_order_relaxed)) {
    if (!abort_.load(std::memory_order_relaxed)) {
      try {
        invoke_(fn_, t, worker);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
        abort_.store(true, std::memory_order_relaxed);  // the remaining tasks are skipped (still counted)
      }
    }
    done_tasks_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void WorkerPool::worker_loop(int worker) {
  uint64_t seen = 0;
  for (;;) {
    // spin for a while: the next MoE layer usually arrives within microseconds to a millisecond
    const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    int polls = 0;
    while (generation_.load(std::memory_order_acquire) == seen) {
      _mm_pause();
      if (++polls % 1024 == 0 && std::chrono::steady_clock::now() > spin_until) break;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      sleepers_.fetch_add(1);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      sleepers_.fetch_sub(1);
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    inside_.fetch_add(1);  // seq_cst, then read open_: see the handshake in worker_pool.h
    if (open_.load() && generation_.load() == seen) work(worker);
    inside_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void WorkerPool::run_erased(int64_t n, const void* fn, Invoke invoke) {
  if (n <= 0) return;
  if (threads_.empty() || n == 1) {
    for (int64_t t = 0; t < n; ++t) invoke(fn, t, 0);
    return;
  }
  std::lock_guard<std::mutex> job(run_mutex_);
  fn_ = fn;
  invoke_ = invoke;
  n_tasks_ = n;
  error_ = nullptr;
  abort_.store(false, std::memory_order_relaxed);
  next_task_.store(0, std::memory_order_relaxed);
  done_tasks_.store(0, std::memory_order_relaxed);
  open_.store(true);
  generation_.fetch_add(1);  // seq_cst: orders the job fields before it and the sleepers_ read after it
  if (sleepers_.load() > 0) {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    wake_.notify_all();
  }
  work(0);
  while (done_tasks_.load(std::memory_order_acquire) < n) _mm_pause();
  open_.store(false);  // seq_cst, then read inside_: a worker either is counted here or sees the job closed
  while (inside_.load() > 0) _mm_pause();
  if (error_) std::rethrow_exception(error_);
}

}  // namespace kt::runtime
