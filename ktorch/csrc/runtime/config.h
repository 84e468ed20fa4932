// The settings a user or a deployment chooses that the C++ side reads, and the one place it reads them. Each is
// an environment variable and can also be set from Python (kt::set_option; ktorch/config.py is the typed API and
// documents every setting, README.md "Settings" lists them):
//   KT_NUM_THREADS  the process-wide worker pool's size, caller included (default at::get_num_threads())
//   KT_SPIN_US      how long idle workers (and the host-task worker) spin before parking, us (default 2000)
//   KT_CPU_KERNEL   auto | portable | avx512 | amx: the kernel level (default auto: the best available)
//   KT_HUGE_PAGES   1 | 0: packed weights advised onto transparent huge pages (default 1)
//   KT_PROFILE      1 | 0: each fused_moe call's phase times on stderr (default 0)
// A value set from Python overrides the variable until it is cleared (set to nullopt). Each is read where it is
// used (KT_CPU_KERNEL, KT_HUGE_PAGES and KT_PROFILE on every call; KT_NUM_THREADS and KT_SPIN_US when a pool is
// built), so a process can change them between calls. Tuning values of the kernels and the driver are constants
// in the code, each with the measurement that chose it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace kt::runtime::config {

// The setting's value: set from Python, else the environment's; nullopt when neither (or empty). An unknown name
// is an error.
std::optional<std::string> value(const char* name);
// An integer setting (fallback when unset); anything else is an error naming it.
int64_t integer(const char* name, int64_t fallback);
// A 0/1 setting (fallback when unset); anything else is an error naming it.
bool flag(const char* name, bool fallback);
// Sets (or, with nullopt, clears) the Python-side value of a setting. The value is checked where it is read.
void set(const std::string& name, const std::optional<std::string>& v);

}  // namespace kt::runtime::config
