// Host tasks: a routed-experts call that CUDA host functions start and join with no Python and no GIL.
//
// Under CUDA graphs the experts of one MoE layer are started by a host function once the hidden states are in
// pinned memory, and joined by a second host function that holds the stream until the result is in pinned
// memory (ktorch/compile/experts_runtime.py). Written in Python, each host function takes the GIL on CUDA's
// callback thread, so the CPU call starts late (after the GPU work placed between start and join) and the
// stream resumes late. Here the two host functions are plain C functions:
//   kt_host_task_start(task): queue the task to one C++ worker thread (which runs kt::moe::fused_moe on the
//                             task's pinned tensors and copies the result into the task's pinned output);
//   kt_host_task_join(task):  wait until the worker is done with it (spin KT_JOIN_SPIN_US, default 1000, then
//                             block).
// The worker spins KT_SPIN_US (as the pool's workers do, default 2000) after each call before it parks, so that the
// next layer's start reaches a thread that is awake.
// Their addresses come from kt::host_task_functions(); a task is an opaque int64 handle made by
// kt::host_task_new and kept alive by the caller as long as any CUDA graph uses it.
// A failing call cannot raise on CUDA's callback thread: it prints the error, fills the output with NaN (never a
// silent wrong answer) and keeps the message for kt::host_task_error.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <immintrin.h>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "host_tasks.h"
#include "worker_pool.h"

#include "../moe/fused_moe.h"

namespace kt::runtime {
namespace {

struct HostTask {
  at::Tensor hidden, topk_ids, topk_weights, out, w13, w2;
  std::optional<at::Tensor> w13_scales, w2_scales;
  std::string activation;
  std::atomic<int64_t> done{0};  // calls finished
  std::atomic<int64_t> started{0};
  std::mutex mutex;  // guards error, times
  std::condition_variable cv;
  std::string error;
  bool record_times = false;
  std::vector<int64_t> times;  // start_ns, end_ns pairs (CLOCK_MONOTONIC, as Python's perf_counter_ns)
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

class Worker {
 public:
  Worker() : spin_us_(env_int("KT_SPIN_US", 2000)), thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }
  void push(HostTask* t) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(t);
      pushed_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_one();  // no system call when the worker is spinning (nobody waits on the condition variable)
  }

 private:
  void loop() {
    int64_t taken = 0;
    for (;;) {
      const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      int polls = 0;
      while (pushed_.load(std::memory_order_acquire) == taken) {
        _mm_pause();
        if (++polls % 256 == 0 && std::chrono::steady_clock::now() > spin_until) break;
      }
      HostTask* t = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        t = queue_.front();
        queue_.pop_front();
      }
      ++taken;
      run(t);
    }
  }
  static void run(HostTask* t) {
    const int64_t t0 = now_ns();
    try {
      c10::InferenceMode inference;  // per thread; the experts ops have no autograd
      const at::Tensor r = kt::moe::fused_moe(t->hidden, t->topk_ids, t->topk_weights, t->w13, t->w13_scales, t->w2,
                                              t->w2_scales, t->activation);
      t->out.copy_(r);
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(t->mutex);
      t->error = e.what();
      std::fprintf(stderr, "ktorch: CPU experts call failed on the host-task worker (output set to NaN): %s\n",
                   e.what());
      t->out.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    {
      std::lock_guard<std::mutex> lock(t->mutex);
      if (t->record_times && t->times.size() < 8192) {  // bounded: drained by host_task_take_times
        t->times.push_back(t0);
        t->times.push_back(now_ns());
      }
      t->done.fetch_add(1, std::memory_order_release);
    }
    t->cv.notify_all();
  }

  int64_t spin_us_;
  std::atomic<int64_t> pushed_{0};  // tasks pushed so far; the worker spins while it has taken them all
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<HostTask*> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the fields above are built
};

// Both are first called by host_task_new (a Python thread, where a bad environment variable raises), never first
// on CUDA's callback thread.
Worker& worker() {
  static Worker* w = new Worker();  // never destroyed: CUDA may call a host function during interpreter exit
  return *w;
}

int64_t join_spin_us() {
  static const int64_t us = env_int("KT_JOIN_SPIN_US", 1000);
  return us;
}

HostTask* task_of(int64_t handle) {
  TORCH_CHECK(handle != 0, "host task: null handle");
  return reinterpret_cast<HostTask*>(handle);
}

}  // namespace
}  // namespace kt::runtime

extern "C" {

// cudaHostFn_t-compatible: void (*)(void*).
__attribute__((visibility("default"))) void kt_host_task_start(void* p) {
  auto* t = static_cast<kt::runtime::HostTask*>(p);
  t->started.fetch_add(1, std::memory_order_relaxed);
  kt::runtime::worker().push(t);
}

__attribute__((visibility("default"))) void kt_host_task_join(void* p) {
  auto* t = static_cast<kt::runtime::HostTask*>(p);
  const int64_t want = t->started.load(std::memory_order_relaxed);
  const int64_t spin_us = kt::runtime::join_spin_us();
  // a decode call ends within a few hundred microseconds: spin, so that the stream resumes at once
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us);
  for (int polls = 1;; ++polls) {
    if (t->done.load(std::memory_order_acquire) >= want) return;
    _mm_pause();
    if (polls % 256 == 0 && std::chrono::steady_clock::now() > spin_until) break;
  }
  std::unique_lock<std::mutex> lock(t->mutex);
  t->cv.wait(lock, [&] { return t->done.load(std::memory_order_acquire) >= want; });
}

}  // extern "C"

namespace kt::runtime {

int64_t host_task_new(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& out, const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales,
                      const at::Tensor& w2, const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                      bool record_times) {
  TORCH_CHECK(out.sizes() == hidden.sizes() && out.scalar_type() == hidden.scalar_type() && out.is_contiguous(),
              "host_task_new: out must be a contiguous tensor like hidden ", hidden.sizes(), " ", hidden.scalar_type(),
              ", got ", out.sizes(), " ", out.scalar_type());
  for (const at::Tensor* t : {&hidden, &topk_ids, &topk_weights, &out})
    TORCH_CHECK(t->device().is_cpu(), "host_task_new: staging tensors must be on the CPU (pinned), got ", t->device());
  worker();        // started here, where errors (KT_SPIN_US) can raise
  join_spin_us();  // KT_JOIN_SPIN_US, likewise
  auto* t = new HostTask();
  t->hidden = hidden;
  t->topk_ids = topk_ids;
  t->topk_weights = topk_weights;
  t->out = out;
  t->w13 = w13;
  t->w13_scales = w13_scales;
  t->w2 = w2;
  t->w2_scales = w2_scales;
  t->activation = std::string(activation);
  t->record_times = record_times;
  return reinterpret_cast<int64_t>(t);
}

void host_task_free(int64_t handle) {
  auto* t = task_of(handle);
  kt_host_task_join(t);  // never free a task the worker still holds
  delete t;
}

// Start and join on the calling thread's behalf: what the two host functions do, without CUDA.
void host_task_run(int64_t handle) {
  auto* t = task_of(handle);
  kt_host_task_start(t);
  kt_host_task_join(t);
}

std::string host_task_error(int64_t handle) {
  auto* t = task_of(handle);
  std::lock_guard<std::mutex> lock(t->mutex);
  return t->error;
}

// The (start_ns, end_ns) pairs recorded since the last call, flattened; empties the record.
std::vector<int64_t> host_task_take_times(int64_t handle) {
  auto* t = task_of(handle);
  std::lock_guard<std::mutex> lock(t->mutex);
  std::vector<int64_t> times;
  times.swap(t->times);
  return times;
}

std::vector<int64_t> host_task_functions() {
  return {reinterpret_cast<int64_t>(&kt_host_task_start), reinterpret_cast<int64_t>(&kt_host_task_join)};
}

}  // namespace kt::runtime
