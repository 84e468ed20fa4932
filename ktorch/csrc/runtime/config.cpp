#include "config.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>

namespace kt::runtime::config {
namespace {

constexpr const char* kNames[] = {"KT_NUM_THREADS", "KT_SPIN_US", "KT_CPU_KERNEL", "KT_HUGE_PAGES", "KT_PROFILE"};

bool known(const char* name) {
  for (const char* n : kNames)
    if (std::strcmp(n, name) == 0) return true;
  return false;
}

std::mutex g_mutex;
std::map<std::string, std::string> g_set;  // values set from Python
std::atomic<bool> g_any{false};            // g_set is not empty: the per-call reads skip the lock otherwise

}  // namespace

std::optional<std::string> value(const char* name) {
  TORCH_CHECK(known(name), "ktorch: '", name, "' is not one of ktorch's settings");
  if (g_any.load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_set.find(name);
    if (it != g_set.end()) return it->second;
  }
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return std::nullopt;
  return std::string(env);
}

int64_t integer(const char* name, int64_t fallback) {
  const std::optional<std::string> v = value(name);
  if (!v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v->c_str(), &end, 10);
  TORCH_CHECK(end != v->c_str() && *end == '\0', name, " must be an integer, got '", *v, "'");
  return x;
}

bool flag(const char* name, bool fallback) {
  const std::optional<std::string> v = value(name);
  if (!v) return fallback;
  TORCH_CHECK(*v == "0" || *v == "1", name, " must be 0 or 1, got '", *v, "'");
  return *v == "1";
}

void set(const std::string& name, const std::optional<std::string>& v) {
  TORCH_CHECK(known(name.c_str()), "ktorch: '", name, "' is not one of ktorch's settings (",
              "KT_NUM_THREADS, KT_SPIN_US, KT_CPU_KERNEL, KT_HUGE_PAGES, KT_PROFILE)");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (v && !v->empty()) g_set[name] = *v;
  else g_set.erase(name);
  g_any.store(!g_set.empty(), std::memory_order_release);
}

}  // namespace kt::runtime::config
