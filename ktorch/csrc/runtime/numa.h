// NUMA topology and per-node thread groups, for the NUMA split of the fused-MoE op (moe/numa_split.h).
//
// Topology comes from /sys/devices/system/node/node*/cpulist, intersected with the process's affinity
// mask (no libnuma). A split into n groups uses one group per node when n equals the number of nodes
// that have allowed CPUs; otherwise (a forced split, e.g. KT_NUMA_SPLIT=2 on a one-node machine) the
// allowed CPUs, in node order, are cut into n contiguous groups (groups share CPUs when there are fewer
// CPUs than groups). Each group has a leader thread and a WorkerPool, all bound to the group's CPUs: the
// leader runs the group's share of a job with its pool as the thread's pool (WorkerPool::use_on_this_thread),
// so memory the group allocates and writes first is placed on its node by first touch.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "worker_pool.h"

namespace kt::runtime {

struct NumaNode {
  int id;                 // the node number in /sys/devices/system/node/node<id>
  std::vector<int> cpus;  // its CPUs that this process may run on
};

// Nodes with at least one allowed CPU, by id; one pseudo-node 0 with every allowed CPU when sysfs has none.
const std::vector<NumaNode>& numa_nodes();

struct CpuGroup {
  std::vector<int> cpus;
  int node;  // the NUMA node all its CPUs belong to, -1 when they span several
};

// The n groups a split into n uses (see the header comment). n >= 1.
std::vector<CpuGroup> cpu_groups(int n);

// Asks the kernel to keep the pages wholly inside [ptr, ptr + bytes) on `node` (mbind(2) through
// syscall(2), MPOL_BIND with MPOL_MF_MOVE, so pages already touched elsewhere move). Returns false when
// the kernel refuses (no NUMA support, a container without the permission); first touch still applies.
bool bind_memory_to_node(void* ptr, size_t bytes, int node);

// n thread groups, each a leader thread and a pool of workers bound to one CpuGroup.
class NumaGroups {
 public:
  // The groups for a split into n, created on first use and kept for the process's life.
  static NumaGroups& for_split(int n);

  explicit NumaGroups(int n);
  ~NumaGroups();
  NumaGroups(const NumaGroups&) = delete;
  NumaGroups& operator=(const NumaGroups&) = delete;

  int size() const { return static_cast<int>(groups_.size()); }
  const CpuGroup& group(int g) const { return groups_[g]; }
  int workers(int g) const { return pools_[g]->size(); }

  // Runs fn(g) on leader g for every group at once (fn may use runtime::parallel_tasks: it runs on the
  // group's pool) and returns when all are done; rethrows the error of the lowest group that threw.
  // Calls from several threads run one after another.
  void run(const std::function<void(int)>& fn);

 private:
  void leader_loop(int g);

  std::vector<CpuGroup> groups_;
  std::vector<std::unique_ptr<WorkerPool>> pools_;
  std::vector<std::thread> leaders_;

  std::mutex run_mutex_;  // one job at a time
  std::mutex mutex_;      // guards the fields below
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  unsigned long generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
  std::vector<std::exception_ptr> errors_;
};

}  // namespace kt::runtime
