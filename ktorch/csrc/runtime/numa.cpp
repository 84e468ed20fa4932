#include "numa.h"

#include "config.h"
#include "worker_pool.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

namespace kt::runtime {
namespace {

std::vector<int> parse_cpulist(const std::string& text) {  // "0-3,8-11,16"
  std::vector<int> cpus;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    part.erase(std::remove_if(part.begin(), part.end(), ::isspace), part.end());
    if (part.empty()) continue;
    const size_t dash = part.find('-');
    const int a = std::stoi(part.substr(0, dash));
    const int b = dash == std::string::npos ? a : std::stoi(part.substr(dash + 1));
    for (int c = a; c <= b; ++c) cpus.push_back(c);
  }
  return cpus;
}


std::vector<NumaNode> read_nodes() {
  const std::vector<int> allowed = process_cpus();
  std::vector<NumaNode> nodes;
  for (int id = 0; id < 1024; ++id) {
    std::ifstream f("/sys/devices/system/node/node" + std::to_string(id) + "/cpulist");
    if (!f) {
      if (id > 64 && nodes.empty()) break;
      continue;  // node ids may have holes
    }
    std::string line;
    std::getline(f, line);
    NumaNode node{id, {}};
    for (int c : parse_cpulist(line))
      if (std::find(allowed.begin(), allowed.end(), c) != allowed.end()) node.cpus.push_back(c);
    if (!node.cpus.empty()) nodes.push_back(std::move(node));
  }
  if (nodes.empty()) nodes.push_back({0, allowed.empty() ? std::vector<int>{0} : allowed});
  return nodes;
}


void bind_this_thread(const std::vector<int>& cpus) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int c : cpus) CPU_SET(c, &set);
  pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

}  // namespace

const std::vector<NumaNode>& numa_nodes() {
  static const std::vector<NumaNode> nodes = read_nodes();
  return nodes;
}

std::vector<CpuGroup> cpu_groups(int n) {
  TORCH_CHECK(n >= 1, "cpu_groups: a split needs at least 1 group, got ", n);
  const auto& nodes = numa_nodes();
  std::vector<CpuGroup> groups;
  if (static_cast<size_t>(n) == nodes.size()) {
    for (const auto& node : nodes) groups.push_back({node.cpus, node.id});
    return groups;
  }
  std::vector<int> cpus, node_of;
  for (const auto& node : nodes)
    for (int c : node.cpus) {
      cpus.push_back(c);
      node_of.push_back(node.id);
    }
  const int64_t C = static_cast<int64_t>(cpus.size());
  for (int g = 0; g < n; ++g) {
    CpuGroup group{{}, -1};
    std::vector<int> nodes_seen;
    if (C >= n) {
      for (int64_t i = C * g / n; i < C * (g + 1) / n; ++i) {
        group.cpus.push_back(cpus[i]);
        nodes_seen.push_back(node_of[i]);
      }
    } else {  // fewer CPUs than groups: groups share CPUs
      group.cpus.push_back(cpus[g % C]);
      nodes_seen.push_back(node_of[g % C]);
    }
    if (std::all_of(nodes_seen.begin(), nodes_seen.end(), [&](int id) { return id == nodes_seen[0]; }))
      group.node = nodes_seen[0];
    groups.push_back(std::move(group));
  }
  return groups;
}

bool bind_memory_to_node(void* ptr, size_t bytes, int node) {
#ifdef SYS_mbind
  if (node < 0 || node >= 1024 || bytes == 0) return false;
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + page - 1) / page * page;
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) / page * page;
  if (end <= begin) return false;
  unsigned long mask[1024 / (8 * sizeof(unsigned long))] = {};
  mask[node / (8 * sizeof(unsigned long))] = 1ul << (node % (8 * sizeof(unsigned long)));
  constexpr int kMpolBind = 2;      // <linux/mempolicy.h>
  constexpr unsigned kMpolMfMove = 1u << 1;
  return syscall(SYS_mbind, begin, end - begin, kMpolBind, mask, 1024ul + 1, kMpolMfMove) == 0;
#else
  (void)ptr, (void)bytes, (void)node;
  return false;
#endif
}

NumaGroups& NumaGroups::for_split(int n) {
  static std::mutex m;
  static auto* cache = new std::map<int, std::unique_ptr<NumaGroups>>();  // never freed: see worker_pool.cpp
  std::lock_guard<std::mutex> lock(m);
  auto& slot = (*cache)[n];
  if (!slot) slot = std::make_unique<NumaGroups>(n);
  return *slot;
}

NumaGroups::NumaGroups(int n) : groups_(cpu_groups(n)), errors_(n) {
  // Threads: the process-wide pool's count (KT_NUM_THREADS, default torch's intra-op threads), shared out
  // in proportion to the groups' CPUs, at least 1 (the leader) per group.
  const int64_t total = config::integer("KT_NUM_THREADS", at::get_num_threads());
  int64_t cpus = 0;
  for (const auto& g : groups_) cpus += static_cast<int64_t>(g.cpus.size());
  const int64_t spin = spin_us();
  for (const auto& g : groups_) {
    const int64_t share = std::max<int64_t>(1, total * static_cast<int64_t>(g.cpus.size()) / std::max<int64_t>(1, cpus));
    pools_.push_back(std::make_unique<WorkerPool>(static_cast<int>(share), spin, g.cpus));
  }
  for (int g = 0; g < n; ++g) {
    leaders_.emplace_back([this, g] { leader_loop(g); });
    pthread_setname_np(leaders_.back().native_handle(), "kt-numa");
  }
}

NumaGroups::~NumaGroups() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : leaders_) t.join();
}

void NumaGroups::leader_loop(int g) {
  bind_this_thread(groups_[g].cpus);
  WorkerPool::use_on_this_thread(pools_[g].get());
  unsigned long seen = 0;
  for (;;) {
    const std::function<void(int)>* job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
    }
    std::exception_ptr error;
    try {
      (*job)(g);
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    errors_[g] = error;
    if (--pending_ == 0) done_.notify_all();
  }
}

void NumaGroups::run(const std::function<void(int)>& fn) {
  std::lock_guard<std::mutex> job(run_mutex_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    pending_ = size();
    std::fill(errors_.begin(), errors_.end(), nullptr);
    ++generation_;
  }
  wake_.notify_all();
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return pending_ == 0; });
  for (auto& e : errors_)
    if (e) std::rethrow_exception(e);
}

}  // namespace kt::runtime
