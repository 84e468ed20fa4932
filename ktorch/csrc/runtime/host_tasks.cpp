// Host tasks: a routed-experts call that CUDA host functions start and join with no Python and no GIL.
//
// Under CUDA graphs the experts of one MoE layer are started by a host function once the hidden states are in
// pinned memory, and joined by a second host function that holds the stream until the result is in pinned
// memory (ktorch/compile/experts_runtime.py). Written in Python, each host function takes the GIL on CUDA's
// callback thread, so the CPU call starts late (after the GPU work placed between start and join) and the
// stream resumes late. Here the two host functions are plain C functions:
//   kt_host_task_start(task): queue the task to one C++ worker thread (which runs kt::moe::fused_moe on the
//                             task's pinned tensors and copies the result into the task's pinned output);
//   kt_host_task_join(task):  wait until the worker is done with it (spin kJoinSpinUs, then block);
//   kt_host_task_start_join(task): both, in one host function, where no device work sits between them.
// The worker spins kHostSpinUs after each call before it parks, so that the next layer's start reaches a thread
// that is awake.
// GPU handoff (tasks made with handoff: three int64 in pinned memory, ktorch/compile/gpu_handoff.py): no host
// function at all. CUDA runs a host function ~55 us after the work before it has landed and the stream waits for
// it to return, once or twice per layer and decode step. Instead the GPU writes a sequence number (one counter a
// device, so numbers grow in stream order across tasks) into the task's doorbell, words[0], with a small kernel
// after the input copies; the worker, while it spins (and, parked, every kBellPollUs), runs the task whose doorbell
// moved past the number it last took, lowest number first, and writes that number into words[1] once out is
// complete (words[2] once a split task's out_later is), with release semantics. The GPU's wait kernel spins on
// words[1] (or [2]) until it reaches the number, then the stream's H2D copy reads out. A handoff task is never
// started by a host function (refused with an error: it would run twice). Session 7-8's doorbell start alone
// (its join still a host function) measured no faster, 105.9 against 106.2 tok/s; this one removes the join's
// host function too. Unmeasured on the device so far (benchmarks/device_handoff.sh).
// Their addresses come from kt::host_task_functions(); a task is an opaque int64 handle made by
// kt::host_task_new and kept alive by the caller as long as any CUDA graph uses it.
// Split tasks (expert deferral, passes/deferral.py): a task made with out_later and a deferred count d runs its
// experts in two parts per start. It ranks each token's K slots by routing weight (descending; ties to the lower
// slot, as a stable sort) and runs the K - d highest into out and the d lowest into out_later (zeros when d = 0,
// without a second part) in one kt::moe::fused_moe_split call: the first part is marked joined for
// kt_host_task_join as soon as out is complete, while the deferred part's tasks run on behind it in the same pool
// dispatch (kt_host_task_join_later waits for them). One call rather than two: a second call per layer cost its
// fixed overhead and ran its few experts' weights at a lower bandwidth, ~100-220 us a layer on the H100 host
// (benchmarks/RESULTS.md). d is read from its int64 at each
// run, so one captured graph serves every d. The split happens here rather than on the GPU so that a deferring
// layer costs the stream what a plain one does: one set of input copies and one start host function, no sort or
// masking kernels.
// A failing call cannot raise on CUDA's callback thread: it prints the error, fills the output with NaN (never a
// silent wrong answer) and keeps the message for kt::host_task_error.
#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <immintrin.h>
#include <limits>
#include <pthread.h>
#include <sched.h>
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
  std::optional<at::Tensor> w13_bias, w2_bias;  // expert biases (kt::moe::fused_moe), or none
  std::string activation;
  std::atomic<int64_t> done{0};  // calls finished
  std::atomic<int64_t> started{0};
  std::mutex mutex;  // guards error, times
  std::condition_variable cv;
  std::string error;
  bool record_times = false;
  std::vector<int64_t> times;  // start_ns, end_ns pairs (CLOCK_MONOTONIC, as Python's perf_counter_ns)
  // split tasks (out_later defined): the deferred slots' result, the count d (one int64, read at each run), the two
  // id sets (the worker's), whether out_later holds zeros, and the second part's progress (as done)
  at::Tensor out_later, deferred, ids_now, ids_later;
  bool later_zero = false;
  std::atomic<int64_t> done_later{0};
  bool split() const { return out_later.defined(); }
  // GPU-handoff tasks (made with handoff, three int64 in pinned memory): words[0] is the doorbell the GPU writes a
  // sequence number into after the input copies, words[1] / words[2] the number of the last run whose first /
  // deferred part is complete in out / out_later (written by the worker with release semantics, read by the GPU's
  // wait kernel). taken_seq (the worker's, under its bells mutex) is the last number taken; seq the running one's.
  at::Tensor handoff;
  int64_t* words = nullptr;
  int64_t taken_seq = 0;
  int64_t seq = 0;
  bool gpu_handoff() const { return words != nullptr; }
};

int64_t doorbell_of(const HostTask* t) { return __atomic_load_n(t->words, __ATOMIC_ACQUIRE); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// The host-task worker's spin before it parks: 2000 us, the pool's default, and what the device's best end-to-end
// decode settings kept for this worker while the pool's spin was cut to 300 us (KT_SPIN_US=300 with the former
// spin variable at 2000: benchmarks/RESULTS.md sessions 10-13 and the llama.cpp comparison). A constant since the
// separate variable was retired; KT_SPIN_US sets the pool's spin alone.
constexpr int64_t kHostSpinUs = 2000;
// A parked worker with doorbells to watch looks at them every 100 us, every 1000 us once no call ran for 100 ms
// (the first layer after a pause pays up to that; a decode step's layers reach a worker that still spins).
constexpr int64_t kBellPollUs = 100;
constexpr int64_t kBellIdlePollUs = 1000;
constexpr int64_t kBellIdleMs = 100;

class Worker {
 public:
  Worker()
      : spin_us_(kHostSpinUs),
        thread_([this] { loop(); }) {
    pthread_setname_np(thread_.native_handle(), "kt-host");
  }
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
  void add_bell(HostTask* t) {
    {
      std::lock_guard<std::mutex> lock(bells_mutex_);
      bells_.push_back(t);
      n_bells_.store(static_cast<int64_t>(bells_.size()), std::memory_order_release);
    }
    { std::lock_guard<std::mutex> lock(mutex_); }  // a worker parked without doorbells to watch wakes to poll them
    cv_.notify_one();
  }
  // Stops watching t's doorbell and returns once the worker is not running it (it never takes it again).
  void remove_bell(HostTask* t) {
    {
      std::lock_guard<std::mutex> lock(bells_mutex_);
      bells_.erase(std::remove(bells_.begin(), bells_.end(), t), bells_.end());
      n_bells_.store(static_cast<int64_t>(bells_.size()), std::memory_order_release);
    }
    while (running_.load(std::memory_order_acquire) == t) std::this_thread::yield();
  }

 private:
  void loop() {
    int64_t taken = 0;
    auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
    auto last_run = std::chrono::steady_clock::now();
    for (int polls = 1;; ++polls) {
      if (pushed_.load(std::memory_order_acquire) != taken) {
        HostTask* t = nullptr;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          t = queue_.front();
          queue_.pop_front();
        }
        ++taken;
        t->seq = 0;  // a pushed run publishes no sequence number
        run(t);
        last_run = std::chrono::steady_clock::now();
        spin_until = last_run + std::chrono::microseconds(spin_us_);
        continue;
      }
      if (n_bells_.load(std::memory_order_acquire) > 0) {
        if (HostTask* t = take_rung()) {
          run(t);
          running_.store(nullptr, std::memory_order_release);
          last_run = std::chrono::steady_clock::now();
          spin_until = last_run + std::chrono::microseconds(spin_us_);
          continue;
        }
      }
      if (polls % 256 != 0 || std::chrono::steady_clock::now() <= spin_until) {
        _mm_pause();
        continue;
      }
      // park until a push or the end; with doorbells to watch (nothing wakes the thread when the GPU writes one),
      // wake every kBellPollUs to look, every kBellIdlePollUs once idle for kBellIdleMs
      std::unique_lock<std::mutex> lock(mutex_);
      auto woken = [&] { return stop_ || pushed_.load(std::memory_order_acquire) != taken; };
      if (n_bells_.load(std::memory_order_acquire) > 0) {
        const bool idle = std::chrono::steady_clock::now() - last_run > std::chrono::milliseconds(kBellIdleMs);
        cv_.wait_for(lock, std::chrono::microseconds(idle ? kBellIdlePollUs : kBellPollUs), woken);
      } else {
        cv_.wait(lock, [&] { return woken() || n_bells_.load(std::memory_order_acquire) > 0; });
      }
      if (stop_ && pushed_.load(std::memory_order_acquire) == taken) return;
      if (pushed_.load(std::memory_order_acquire) != taken)
        spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
      else
        polls = -1;  // a timed wake to look at the doorbells: one look, then park again (no spin)
    }
  }
  // The GPU-handoff task whose doorbell holds the lowest number above the one it last ran (the order the GPU rang
  // them: the numbers come from one counter a device), marked taken and running; nullptr if none rang.
  HostTask* take_rung() {
    std::lock_guard<std::mutex> lock(bells_mutex_);
    HostTask* best = nullptr;
    int64_t best_seq = 0;
    for (HostTask* t : bells_) {
      const int64_t seq = doorbell_of(t);
      if (seq > t->taken_seq && (best == nullptr || seq < best_seq)) {
        best = t;
        best_seq = seq;
      }
    }
    if (best != nullptr) {
      best->taken_seq = best->seq = best_seq;
      running_.store(best, std::memory_order_release);  // under the lock: remove_bell waits for it
    }
    return best;
  }
  static void run(HostTask* t) {
    const int64_t t0 = now_ns();
    if (!t->split()) {
      call(t, t->topk_ids, t->out);
      finish(t, false, t0);
      return;
    }
    int64_t d = 0;
    try {
      d = split_slots(t);
    } catch (const std::exception& e) {
      fail(t, e, t->out);
      fail(t, e, t->out_later);
      finish(t, false, t0);
      finish(t, true, -1);
      return;
    }
    if (d == 0) {
      call(t, t->topk_ids, t->out);
      finish(t, false, t0);
      if (!t->later_zero) {
        t->out_later.zero_();
        t->later_zero = true;
      }
      finish(t, true, -1);
      return;
    }
    t->later_zero = false;
    // one call: the first part is published from inside it (on a pool thread) while the deferred part runs on
    std::atomic<int64_t> published{-1};  // when the first part was marked joined
    try {
      c10::InferenceMode inference;
      kt::moe::fused_moe_split(t->hidden, t->ids_now, t->ids_later, t->topk_weights, t->w13, t->w13_scales, t->w2,
                               t->w2_scales, t->activation, t->out, t->out_later, [&] {
                                 finish(t, false, t0);
                                 published.store(now_ns(), std::memory_order_release);
                               }, t->w13_bias, t->w2_bias);
    } catch (const std::exception& e) {
      if (published.load(std::memory_order_acquire) < 0) {
        fail(t, e, t->out);
        finish(t, false, t0);
      }
      fail(t, e, t->out_later);
    }
    finish(t, true, published.load(std::memory_order_acquire));  // -1 (nothing recorded) if never published
  }
  // One experts call on the task's tensors with these ids, written into out (NaN and the message kept on failure).
  // Into out, not a new result copied there: at T = 2048 a fresh 8 MB result (its pages faulted in) and its copy on
  // this thread made a captured prefill's CPU calls 1.1-4.2 ms where the op alone takes ~1 ms (session 57, H200
  // host, 250 rows over 5 experts a call).
  static void call(HostTask* t, const at::Tensor& ids, const at::Tensor& out) {
    try {
      c10::InferenceMode inference;  // per thread; the experts ops have no autograd
      kt::moe::fused_moe_out(t->hidden, ids, t->topk_weights, t->w13, t->w13_scales, t->w2, t->w2_scales,
                             t->activation, t->w13_bias, t->w2_bias, out);
    } catch (const std::exception& e) {
      fail(t, e, out);
    }
  }
  static void fail(HostTask* t, const std::exception& e, const at::Tensor& out) {
    std::lock_guard<std::mutex> lock(t->mutex);
    t->error = e.what();
    std::fprintf(stderr, "ktorch: CPU experts call failed on the host-task worker (output set to NaN): %s\n",
                 e.what());
    out.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  // Marks the first part (later = false) or the deferred part of this run done; t0 >= 0: records (t0, now).
  static void finish(HostTask* t, bool later, int64_t t0) {
    std::lock_guard<std::mutex> lock(t->mutex);
    if (t0 >= 0 && t->record_times && t->times.size() < 8192) {  // bounded: drained by host_task_take_times
      t->times.push_back(t0);
      t->times.push_back(now_ns());
    }
    (later ? t->done_later : t->done).fetch_add(1, std::memory_order_release);
    // a doorbell's run: its number in the pinned word the GPU's wait kernel polls, after the output is complete
    if (t->seq > 0) __atomic_store_n(t->words + (later ? 2 : 1), t->seq, __ATOMIC_RELEASE);
    // under the lock: host_task_free takes it after its joins, so the task outlives this last touch
    t->cv.notify_all();
  }
  // Fills ids_now / ids_later from topk_ids by each slot's rank in its token's weights (stable, descending):
  // rank < K - d stays now, the rest goes later (-1 where a slot is in the other set). Returns d, clamped to [0, K].
  static int64_t split_slots(HostTask* t) {
    const int64_t T = t->topk_ids.size(0), K = t->topk_ids.size(1);
    const int64_t d = std::clamp<int64_t>(__atomic_load_n(t->deferred.data_ptr<int64_t>(), __ATOMIC_ACQUIRE), 0, K);
    if (d == 0) return 0;
    const int64_t keep = K - d;
    const at::Tensor w = t->topk_weights.scalar_type() == at::kFloat ? t->topk_weights
                                                                     : t->topk_weights.to(at::kFloat);
    const float* wp = w.data_ptr<float>();
    AT_DISPATCH_INDEX_TYPES(t->topk_ids.scalar_type(), "host_task_split", [&] {
      const index_t* ids = t->topk_ids.data_ptr<index_t>();
      index_t* now = t->ids_now.data_ptr<index_t>();
      index_t* later = t->ids_later.data_ptr<index_t>();
      for (int64_t i = 0; i < T * K; i += K) {
        for (int64_t j = 0; j < K; ++j) {
          int64_t rank = 0;
          for (int64_t k = 0; k < K; ++k) rank += wp[i + k] > wp[i + j] || (wp[i + k] == wp[i + j] && k < j);
          now[i + j] = rank < keep ? ids[i + j] : index_t(-1);
          later[i + j] = rank < keep ? index_t(-1) : ids[i + j];
        }
      }
    });
    return d;
  }

  int64_t spin_us_;
  std::mutex bells_mutex_;
  std::vector<HostTask*> bells_;  // the GPU-handoff tasks (guarded by bells_mutex_)
  std::atomic<int64_t> n_bells_{0};
  std::atomic<HostTask*> running_{nullptr};  // the GPU-handoff task the worker is running, if any
  std::atomic<int64_t> pushed_{0};  // tasks pushed so far; the worker spins while it has taken them all
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<HostTask*> queue_;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the fields above are built
};

// First called by host_task_new (a Python thread), never first
// on CUDA's callback thread.
Worker& worker() {
  static Worker* w = new Worker();  // never destroyed: CUDA may call a host function during interpreter exit
  return *w;
}

// How long a join spins before it blocks: a decode call ends within a few hundred microseconds, so the stream
// resumes at once (1000 us, the value the device's decode runs used; longer calls block on the task's cv).
constexpr int64_t kJoinSpinUs = 1000;

// Waits until the task's calls started so far have finished their first part (later = false) or their deferred
// part.
void join_part(HostTask* t, bool later) {
  const int64_t want = t->started.load(std::memory_order_relaxed);
  const std::atomic<int64_t>& counter = later ? t->done_later : t->done;
  auto finished = [&] { return counter.load(std::memory_order_acquire) >= want; };
  const auto spin_until = std::chrono::steady_clock::now() + std::chrono::microseconds(kJoinSpinUs);
  for (int polls = 1;; ++polls) {
    if (finished()) return;
    _mm_pause();
    if (polls % 256 == 0 && std::chrono::steady_clock::now() > spin_until) break;
  }
  std::unique_lock<std::mutex> lock(t->mutex);
  t->cv.wait(lock, finished);
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
  if (t->gpu_handoff()) {  // a GPU-handoff task runs from its doorbell only (a host function could run it twice)
    std::lock_guard<std::mutex> lock(t->mutex);
    t->error = "host task: a GPU-handoff task (made with handoff) is started by its doorbell, not by a host function";
    std::fprintf(stderr, "ktorch: %s\n", t->error.c_str());
    return;
  }
  t->started.fetch_add(1, std::memory_order_relaxed);
  kt::runtime::worker().push(t);
}

__attribute__((visibility("default"))) void kt_host_task_join(void* p) {
  kt::runtime::join_part(static_cast<kt::runtime::HostTask*>(p), false);
}

// A split task's deferred part (cudaHostFn_t-compatible, like the two above).
__attribute__((visibility("default"))) void kt_host_task_join_later(void* p) {
  kt::runtime::join_part(static_cast<kt::runtime::HostTask*>(p), true);
}

// Start, then join the first part, in one host function: for a call with no device work between its start and
// its join (a plain layer, a deferring one whose deferred part is joined later), this saves the stream the
// second host function's round trip through CUDA's callback thread, once per layer and decode step.
__attribute__((visibility("default"))) void kt_host_task_start_join(void* p) {
  kt_host_task_start(p);
  kt_host_task_join(p);
}

}  // extern "C"

namespace kt::runtime {

int64_t host_task_new(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& out, const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales,
                      const at::Tensor& w2, const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                      bool record_times, const std::optional<at::Tensor>& out_later,
                      const std::optional<at::Tensor>& deferred, const std::optional<at::Tensor>& w13_bias,
                      const std::optional<at::Tensor>& w2_bias, const std::optional<at::Tensor>& handoff) {
  TORCH_CHECK(out.sizes() == hidden.sizes() && out.scalar_type() == hidden.scalar_type() && out.is_contiguous(),
              "host_task_new: out must be a contiguous tensor like hidden ", hidden.sizes(), " ", hidden.scalar_type(),
              ", got ", out.sizes(), " ", out.scalar_type());
  for (const at::Tensor* t : {&hidden, &topk_ids, &topk_weights, &out})
    TORCH_CHECK(t->device().is_cpu(), "host_task_new: staging tensors must be on the CPU (pinned), got ", t->device());
  TORCH_CHECK(out_later.has_value() == deferred.has_value(),
              "host_task_new: a split task needs both out_later and deferred (got only one)");
  if (out_later.has_value()) {
    const at::Tensor &o = *out_later, &d = *deferred;
    TORCH_CHECK(o.sizes() == out.sizes() && o.scalar_type() == out.scalar_type() && o.is_contiguous() &&
                    o.device().is_cpu(),
                "host_task_new: out_later must be a contiguous CPU tensor like out ", out.sizes(), " ",
                out.scalar_type(), ", got ", o.sizes(), " ", o.scalar_type(), " on ", o.device());
    TORCH_CHECK(d.device().is_cpu() && d.scalar_type() == at::kLong && d.numel() == 1 && d.is_contiguous(),
                "host_task_new: deferred must be one int64 in CPU memory, got ", d.sizes(), " ", d.scalar_type(),
                " on ", d.device());
    TORCH_CHECK(topk_ids.dim() == 2 && topk_weights.sizes() == topk_ids.sizes() && topk_ids.is_contiguous() &&
                    (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong) &&
                    at::isFloatingType(topk_weights.scalar_type()),
                "host_task_new: a split task needs contiguous int32/int64 topk_ids [T, K] and floating topk_weights "
                "of the same shape, got ", topk_ids.sizes(), " ", topk_ids.scalar_type(), " and ",
                topk_weights.sizes(), " ", topk_weights.scalar_type());
  }
  if (handoff.has_value()) {
    const at::Tensor& h = *handoff;
    TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kLong && h.dim() == 1 && h.numel() == 3 &&
                    h.is_contiguous(),
                "host_task_new: handoff must be three int64 (doorbell, done, done_later) contiguous in CPU (pinned) "
                "memory, got ", h.sizes(), " ", h.scalar_type(), " on ", h.device());
    const int64_t* w = h.data_ptr<int64_t>();
    TORCH_CHECK(w[0] == 0 && w[1] == 0 && w[2] == 0, "host_task_new: a new handoff must read 0 0 0, got ", w[0], " ",
                w[1], " ", w[2]);
    const auto* lo = reinterpret_cast<const char*>(w);
    const auto* hi = lo + 3 * sizeof(int64_t);
    for (const at::Tensor* o : {&hidden, &topk_ids, &topk_weights, &out}) {
      const auto* olo = static_cast<const char*>(o->data_ptr());
      const auto* ohi = olo + o->numel() * o->element_size();
      TORCH_CHECK(hi <= olo || ohi <= lo, "host_task_new: handoff overlaps the task's staging tensors");
    }
    if (out_later.has_value()) {
      const auto* olo = static_cast<const char*>(out_later->data_ptr());
      TORCH_CHECK(hi <= olo || olo + out_later->numel() * out_later->element_size() <= lo,
                  "host_task_new: handoff overlaps the task's staging tensors");
    }
  }
  worker();  // started here, on a Python thread, never first on CUDA's callback thread
  auto* t = new HostTask();
  t->hidden = hidden;
  t->topk_ids = topk_ids;
  t->topk_weights = topk_weights;
  t->out = out;
  t->w13 = w13;
  t->w13_scales = w13_scales;
  t->w2 = w2;
  t->w2_scales = w2_scales;
  t->w13_bias = w13_bias;
  t->w2_bias = w2_bias;
  t->activation = std::string(activation);
  t->record_times = record_times;
  if (out_later.has_value()) {
    t->out_later = *out_later;
    t->deferred = *deferred;
    t->ids_now = at::empty_like(topk_ids);
    t->ids_later = at::empty_like(topk_ids);
  }
  if (handoff.has_value()) {
    t->handoff = *handoff;
    t->words = t->handoff.data_ptr<int64_t>();
    worker().add_bell(t);
  }
  return reinterpret_cast<int64_t>(t);
}

void host_task_free(int64_t handle) {
  auto* t = task_of(handle);
  if (t->gpu_handoff()) worker().remove_bell(t);  // not watched from here on, and not running
  kt_host_task_join(t);  // never free a task the worker still holds
  if (t->split()) kt_host_task_join_later(t);
  { std::lock_guard<std::mutex> lock(t->mutex); }  // ... nor one it is still notifying (a spinning join returns first)
  delete t;
}

// Start and join on the calling thread's behalf: what the two host functions do, without CUDA.
void host_task_run(int64_t handle) {
  auto* t = task_of(handle);
  kt_host_task_start(t);
  kt_host_task_join(t);
  if (t->split()) kt_host_task_join_later(t);
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
  return {reinterpret_cast<int64_t>(&kt_host_task_start), reinterpret_cast<int64_t>(&kt_host_task_join),
          reinterpret_cast<int64_t>(&kt_host_task_join_later), reinterpret_cast<int64_t>(&kt_host_task_start_join)};
}

}  // namespace kt::runtime
