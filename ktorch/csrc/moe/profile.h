// KT_PROFILE=1 (runtime/config.h): the per-call profile lines of kt.fused_moe (fused_moe.cpp) and
// kt.fused_moe_backward (fused_moe_backward.cpp): the wall time of each phase of a call, and where each worker's time
// in a parallel phase goes.
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "../runtime/config.h"

namespace kt::moe {

// One line per call on stderr, "kt.<op> <what>: phase ms ... total ms", with the wall time of each phase (KT_PROFILE
// read on every call, so a process can switch it; when off, each phase mark is one branch).
class PhaseTimer {
 public:
  using Clock = std::chrono::steady_clock;
  explicit PhaseTimer(const char* op = "fused_moe") : op_(op) {
    const std::optional<std::string> v = runtime::config::value("KT_PROFILE");
    on_ = v && *v != "0";
    if (on_) start_ = last_ = Clock::now();
  }
  bool on() const { return on_; }
  void mark(const char* phase) {
    if (!on_ || n_ == kMaxPhases) return;
    const Clock::time_point now = Clock::now();
    phases_[n_] = phase;
    ms_[n_++] = std::chrono::duration<double, std::milli>(now - last_).count();
    last_ = now;
  }
  // A phase that ended at `at` (not before the last one: phases of one dispatch can end out of order).
  void mark_at(const char* phase, Clock::time_point at) {
    if (!on_ || n_ == kMaxPhases) return;
    at = std::max(at, last_);
    phases_[n_] = phase;
    ms_[n_++] = std::chrono::duration<double, std::milli>(at - last_).count();
    last_ = at;
  }
  // An extra entry (not a phase: the wall clock does not move), e.g. a worker breakdown of the phase before it.
  void add(const char* name, double ms) {
    if (!on_ || n_ == kMaxPhases) return;
    phases_[n_] = name;
    ms_[n_++] = ms;
  }
  // Prints "kt.<op> <what>: phase ms, ..., total ms".
  void print(const std::string& what) const {
    if (!on_) return;
    std::string line = "kt." + std::string(op_) + " " + what + ":";
    char buf[64];
    for (int i = 0; i < n_; ++i) {
      std::snprintf(buf, sizeof(buf), " %s %.3f", phases_[i], ms_[i]);
      line += buf;
    }
    std::snprintf(buf, sizeof(buf), " total %.3f ms\n",
                  std::chrono::duration<double, std::milli>(last_ - start_).count());
    line += buf;
    std::fputs(line.c_str(), stderr);
  }

 private:
  static constexpr int kMaxPhases = 24;
  const char* op_;
  bool on_ = false;
  Clock::time_point start_, last_;
  const char* phases_[kMaxPhases];
  double ms_[kMaxPhases];
  int n_ = 0;
};

// Where each worker's time in a parallel phase goes, by N kinds of work, summed over its tasks: added to the phase
// line (report) as one entry a kind, the mean over workers in ms, and a last one, the busiest worker's sum of all
// kinds (a phase far longer than its busiest worker waited on wake-ups or scheduling). One cache line a worker.
template <int N>
class WorkerTimes {
 public:
  using Clock = std::chrono::steady_clock;
  WorkerTimes(bool on, int workers) : on_(on), t_(on ? workers : 0) {}
  // The mark a task's first lap starts from (read only when on).
  Clock::time_point start() const { return on_ ? Clock::now() : Clock::time_point(); }
  // Adds the time since `mark` to the worker's `kind` and moves `mark` to now; one branch when off.
  void lap(int worker, int kind, Clock::time_point& mark) {
    if (!on_) return;
    const Clock::time_point now = Clock::now();
    t_[worker].ns[kind] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - mark).count();
    mark = now;
  }
  // No entries when off or without workers (a call with nothing to run).
  void report(PhaseTimer& timer, const std::array<const char*, N>& names, const char* busiest) const {
    if (!on_ || t_.empty()) return;
    double sum[N] = {}, most = 0;
    for (const Slot& w : t_) {
      double all = 0;
      for (int k = 0; k < N; ++k) sum[k] += w.ns[k], all += w.ns[k];
      most = std::max(most, all);
    }
    const double n = static_cast<double>(t_.size()) * 1e6;
    for (int k = 0; k < N; ++k) timer.add(names[k], sum[k] / n);
    timer.add(busiest, most / 1e6);
  }

 private:
  struct alignas(64) Slot {
    int64_t ns[N] = {};
  };
  bool on_;
  std::vector<Slot> t_;
};

}  // namespace kt::moe
