// Every kt op is declared here, and only here: schemas first, then the CPU kernels that implement them.
// Fake (meta) implementations for tracing live in ktorch/ops/.
#include <torch/library.h>

#include <chrono>
#include <vector>

#include "kernels/kernels.h"
#include "kernels/probe.h"
#include "formats/gguf.h"
#include "moe/fused_moe.h"
#include "moe/fused_moe_backward.h"
#include "moe/numa_split.h"
#include "moe/pack.h"
#include "runtime/config.h"
#include "runtime/cpu_features.h"
#include "runtime/dispatch.h"
#include "runtime/host_tasks.h"
#include "runtime/memory.h"
#include "runtime/numa.h"
#include "runtime/parallel.h"

namespace {

// "key=value" lines describing the CPU and the kernel each call will use; parsed by ktorch.cpu_features().
std::vector<std::string> cpu_info() {
  const auto& f = kt::runtime::cpu_features();
  auto b = [](bool v) { return std::string(v ? "1" : "0"); };
  std::vector<std::string> out = {
      "vendor=" + f.vendor,
      "avx2=" + b(f.avx2), "fma=" + b(f.fma), "os_avx=" + b(f.os_avx),
      "avx512f=" + b(f.avx512f), "avx512bw=" + b(f.avx512bw), "avx512vl=" + b(f.avx512vl),
      "avx512_bf16=" + b(f.avx512_bf16), "avx512_vnni=" + b(f.avx512_vnni), "os_avx512=" + b(f.os_avx512),
      "amx_tile=" + b(f.amx_tile), "amx_bf16=" + b(f.amx_bf16), "amx_int8=" + b(f.amx_int8), "os_amx=" + b(f.os_amx),
      "available=" + kt::runtime::available_kernel_levels(),
  };
  return out;
}

std::string selected_kernel() { return kt::runtime::selected_kernel_level(); }

int64_t get_num_threads() { return kt::runtime::num_workers(); }
void set_num_threads(int64_t n) { kt::runtime::WorkerPool::resize(static_cast<int>(n)); }

// The settings the C++ side reads (runtime/config.h): set_option(name, value) overrides the environment variable,
// set_option(name, None) clears that; get_option reads the value in effect. ktorch/config.py is their typed API.
void set_option(c10::string_view name, const std::optional<std::string>& value) {
  kt::runtime::config::set(std::string(name), value);
}
std::optional<std::string> get_option(c10::string_view name) { return kt::runtime::config::value(std::string(name).c_str()); }

// Tests only (kernels.h): the AMX gemms' small-M threshold for every format (0: every call through the tiles; -1:
// the measured counts). Not a setting; tests/test_ops_fused_moe.py reaches the tiles with small calls through it.
void amx_min_rows_for_tests(int64_t rows) { kt::kernels::amx_min_rows_for_tests(static_cast<int>(rows)); }

// NUMA nodes that have CPUs this process may use ("auto" for KT_NUMA_SPLIT).
int64_t numa_node_count() { return static_cast<int64_t>(kt::runtime::numa_nodes().size()); }

// Peak dot-product rate of all ktorch workers together, in operations per second (benchmarks report
// kernels as a fraction of it). kind: "bf16" (vdpbf16ps) or "int8" (vpdpbusd).
double dot_peak(c10::string_view kind, int64_t iters) {
  TORCH_CHECK(kind == "bf16" || kind == "int8", "dot_peak: kind must be bf16 or int8, got '", std::string(kind), "'");
  TORCH_CHECK(kt::runtime::cpu_features().has_avx512_kernels(), "dot_peak: needs AVX-512 BF16/VNNI");
  const int k = kind == "bf16" ? 0 : 1;
  // 8 slices per worker: a worker that wakes late leaves its slices to the others instead of idling them
  const int64_t n = 8 * kt::runtime::num_workers();
  std::vector<double> ops(n, 0.0);
  const auto t0 = std::chrono::steady_clock::now();
  kt::runtime::parallel_tasks(n, [&](int64_t task, int) { ops[task] = kt::kernels::avx512_dot_ops(k, iters / 8); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  double total = 0;
  for (double o : ops) total += o;
  return total / s;
}

}  // namespace

TORCH_LIBRARY(kt, m) {
  m.def("pack_bf16(Tensor weight, bool gate_up=False) -> Tensor");
  m.def("pack_int8(Tensor weight, bool gate_up=False) -> (Tensor, Tensor)");
  m.def("pack_int4(Tensor weight, int group_size=128, bool gate_up=False, bool two_level=False) -> (Tensor, Tensor)");
  m.def("unpack(Tensor packed, Tensor? scales, bool gate_up=False) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, str qtype) -> Tensor");
  m.def("gguf_dequantize_into(Tensor blocks, str qtype, Tensor(a!) out) -> ()");
  m.def(
      "fused_moe(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor? w13_scales, Tensor w2, "
      "Tensor? w2_scales, str activation=\"silu\", Tensor? w13_bias=None, Tensor? w2_bias=None) -> Tensor");
  // fused_moe into a given output (the experts runtime's eager calls: their pinned staging)
  m.def(
      "fused_moe_out(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor? w13_scales, Tensor w2, "
      "Tensor? w2_scales, str activation, Tensor? w13_bias, Tensor? w2_bias, Tensor(a!) out) -> ()");
  // training (moe/fused_moe_backward.cpp): fused_moe's backward, and the forward with gate/up deltas (expert LoRA)
  m.def(
      "fused_moe_backward(Tensor grad_out, Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, "
      "Tensor? w13_scales, Tensor w2, Tensor? w2_scales, str activation=\"silu\", Tensor? gate_up_delta=None, "
      "Tensor? grad_h=None, Tensor? w13_bias=None, Tensor? w2_bias=None, Tensor? gate_up=None) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "fused_moe_delta(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w13, Tensor? w13_scales, Tensor w2, "
      "Tensor? w2_scales, Tensor gate_up_delta, str activation=\"silu\", "
      "Tensor? w13_bias=None, Tensor? w2_bias=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "numa_split_experts(Tensor w13, Tensor? w13_scales, Tensor w2, Tensor? w2_scales, int n) -> "
      "(Tensor[], Tensor[], Tensor[], Tensor[])");
  m.def(
      "fused_moe_numa(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor[] w13, Tensor[] w13_scales, "
      "Tensor[] w2, Tensor[] w2_scales, str activation=\"silu\") -> Tensor");
  m.def("numa_node_count() -> int", &numa_node_count);
  m.def("cpu_info() -> str[]", &cpu_info);
  m.def("selected_kernel() -> str", &selected_kernel);
  m.def("dot_peak(str kind, int iters=10000000) -> float", &dot_peak);
  m.def("get_num_threads() -> int", &get_num_threads);
  m.def("set_num_threads(int n) -> ()", &set_num_threads);
  m.def("set_option(str name, str? value) -> ()", &set_option);
  m.def("get_option(str name) -> str?", &get_option);
  m.def("_amx_min_rows_for_tests(int rows) -> ()", &amx_min_rows_for_tests);
  m.def("advise_huge_pages(Tensor t) -> ()");
  // host tasks (runtime/host_tasks.h): experts calls that CUDA host functions start and join without Python
  m.def(
      "host_task_new(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor out, Tensor w13, Tensor? w13_scales, "
      "Tensor w2, Tensor? w2_scales, str activation, bool record_times=False, "
      "Tensor? out_later=None, Tensor? deferred=None, Tensor? w13_bias=None, Tensor? w2_bias=None, "
      "Tensor? handoff=None) -> int",
      &kt::runtime::host_task_new);
  m.def("host_task_free(int handle) -> ()", &kt::runtime::host_task_free);
  m.def("host_task_run(int handle) -> ()", &kt::runtime::host_task_run);
  m.def("host_task_error(int handle) -> str", &kt::runtime::host_task_error);
  m.def("host_task_take_times(int handle) -> int[]", &kt::runtime::host_task_take_times);
  m.def("host_task_functions() -> int[]", &kt::runtime::host_task_functions);
}

TORCH_LIBRARY_IMPL(kt, CPU, m) {
  m.impl("pack_bf16", &kt::moe::pack_bf16);
  m.impl("pack_int8", &kt::moe::pack_int8);
  m.impl("pack_int4", &kt::moe::pack_int4);
  m.impl("advise_huge_pages", &kt::runtime::advise_huge_pages);
  m.impl("unpack", &kt::moe::unpack);
  m.impl("gguf_dequantize", &kt::formats::gguf_dequantize);
  m.impl("gguf_dequantize_into", &kt::formats::gguf_dequantize_into);
  m.impl("fused_moe", &kt::moe::fused_moe);
  m.impl("fused_moe_out", &kt::moe::fused_moe_out);
  m.impl("fused_moe_backward", &kt::moe::fused_moe_backward);
  m.impl("fused_moe_delta", &kt::moe::fused_moe_delta);
  m.impl("numa_split_experts", &kt::moe::numa_split_experts);
  m.impl("fused_moe_numa", &kt::moe::fused_moe_numa);
}
