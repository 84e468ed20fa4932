// Host tasks: routed-experts calls started and joined without Python (host_tasks.cpp): by CUDA host functions, or
// by the GPU through pinned words (a doorbell it writes, done sequences it waits for).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/string_view.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kt::runtime {

int64_t host_task_new(const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                      const at::Tensor& out, const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales,
                      const at::Tensor& w2, const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                      bool record_times, const std::optional<at::Tensor>& out_later,
                      const std::optional<at::Tensor>& deferred, const std::optional<at::Tensor>& w13_bias,
                      const std::optional<at::Tensor>& w2_bias, const std::optional<at::Tensor>& handoff);
void host_task_free(int64_t handle);
void host_task_run(int64_t handle);
std::string host_task_error(int64_t handle);
std::vector<int64_t> host_task_take_times(int64_t handle);
std::vector<int64_t> host_task_functions();  // addresses of kt_host_task_start, _join, _join_later, _start_join

}  // namespace kt::runtime
