// kt::fused_moe on the CPU: out[t] = sum_k w[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t,k],
// with negative ids skipped. One call, no Python in between:
//   1. route: group the (token, slot) pairs by expert (stable in token order); ids >= E are errors.
//   2. activations: each token's row once, as bf16, or as int8 with a per-row scale and group sums.
//   3. gate+up: tasks = (chunk of one expert's tokens, range of intermediate channels). A task copies its
//      tokens' rows one line apart into its worker's buffer (evenly strided rows: AMX tile loads read
//      them in place), then computes 32 gate + 32 up columns per kernel call and writes act(gate) * up into
//      h[pair]. When there are enough chunks to keep every worker busy, a task covers all I channels of
//      its rows, so it quantizes its h rows for the down projection itself (int formats) while they are in
//      its cache; otherwise the channels are split over tasks and a separate pass quantizes h (or the
//      caller's quantize_h, fused_moe.h: the NUMA split).
//   4. down: tasks = (range of output columns, group of experts: ids in the lower or upper half). A task
//      walks its experts in order, computes their tokens' rows of h . W_down^T for its columns and adds
//      w[t,k] times them into its group's accumulator rows (a token's first pair in the group writes its row:
//      the accumulators are never zeroed); the last task of a column range sums the groups' accumulators
//      that hold the token into the output. Ranges are wide (every range reads all of h), the groups
//      double the tasks for the same h traffic. No atomics on data, and each token's sum runs in the same
//      order whatever the batch, the worker count or the order tasks run in.
// Tasks are pulled dynamically by the workers (runtime/parallel.h), so skewed routing balances.
// KT_PROFILE=1 prints each call's phase times to stderr.
#include "fused_moe.h"

#include "bf16.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "../kernels/kernels.h"
#include "../runtime/dispatch.h"
#include "../runtime/parallel.h"

namespace kt::moe {
namespace {

using kernels::Activation;
using kernels::WeightFormat;

constexpr int64_t kGateUpRows = 256;  // rows per gate/up task (bounded per-worker buffers)
// rows per down kernel call: all of an expert's rows in one call up to 256 (Qwen3 at T=2048 has 128 +- 11 an
// expert; with 128 half the experts made a second call of ~10 rows that read the weights again)
constexpr int64_t kDownRows = 256;
constexpr int64_t kDownCols = 16 * kernels::kMaxBlocks;  // columns per down kernel call
constexpr int64_t kDownGroups = 2;    // down-projection expert groups (see step 4)

struct PackedMatrix {
  const at::Tensor* weights;
  const std::optional<at::Tensor>* scales;
  const char* name;
  int64_t E, N, K;
  int64_t groups = 1;  // scale groups along K (int8: 1)
  int64_t group_size() const { return K / groups; }
};

WeightFormat format_of(const at::Tensor& w, const char* name) {
  switch (w.scalar_type()) {
    case at::kBFloat16: return WeightFormat::BF16;
    case at::kChar: return WeightFormat::INT8;
    case at::kByte: return WeightFormat::INT4;
    default:
      TORCH_CHECK(false, "fused_moe: ", name, " must be packed by kt.pack_bf16/pack_int8/pack_int4 (bfloat16, int8 or ",
                  "uint8 for int4), got ", w.scalar_type());
  }
}

PackedMatrix describe(const at::Tensor& w, const std::optional<at::Tensor>& s, WeightFormat f, const char* name,
                      const char* scales_name) {
  TORCH_CHECK(w.device().is_cpu(), "fused_moe: ", name, " must be a CPU tensor, got device ", w.device());
  const int64_t per = f == WeightFormat::BF16 ? 2 : 4;
  TORCH_CHECK(w.dim() == 5 && w.size(3) == 16 && w.size(4) == per && w.is_contiguous(), "fused_moe: ", name,
              " must be a contiguous packed tensor [E, N/16, K/", f == WeightFormat::INT4 ? 8 : per, ", 16, ", per,
              "], got shape ", w.sizes());
  PackedMatrix m{&w, &s, name, w.size(0), w.size(1) * 16, w.size(2) * (f == WeightFormat::INT4 ? 8 : per)};
  if (f == WeightFormat::BF16) {
    TORCH_CHECK(!s.has_value(), "fused_moe: bf16 weights take no scales, but ", scales_name, " was given");
    return m;
  }
  TORCH_CHECK(s.has_value(), "fused_moe: ", f == WeightFormat::INT8 ? "int8" : "int4", " weights need ", scales_name);
  const at::Tensor& sc = *s;
  TORCH_CHECK(sc.device().is_cpu() && sc.scalar_type() == at::kFloat && sc.dim() == 3 && sc.is_contiguous(),
              "fused_moe: ", scales_name, " must be a contiguous float32 CPU tensor [E, G, N], got ", sc.scalar_type(), " ",
              sc.sizes(), " on ", sc.device());
  TORCH_CHECK(sc.size(0) == m.E && sc.size(2) == m.N, "fused_moe: ", scales_name, " has shape ", sc.sizes(),
              " but ", name, " needs [", m.E, ", G, ", m.N, "]");
  m.groups = sc.size(1);
  if (f == WeightFormat::INT8) {
    TORCH_CHECK(m.groups == 1, "fused_moe: int8 ", scales_name, " must be per output channel [E, 1, N], got ", sc.sizes());
  } else {
    TORCH_CHECK(m.groups > 0 && m.K % m.groups == 0 && m.group_size() % 32 == 0, "fused_moe: ", scales_name, " has ",
                m.groups, " groups, which does not give a group size that is a multiple of 32 dividing K=", m.K);
  }
  return m;
}

Activation parse_activation(c10::string_view a) {
  if (a == "silu" || a == "swish") return Activation::SiLU;
  if (a == "gelu_tanh" || a == "gelu_pytorch_tanh" || a == "gelu_new") return Activation::GeluTanh;
  if (a == "gelu") return Activation::Gelu;
  if (a == "relu") return Activation::Relu;
  TORCH_CHECK(false, "fused_moe: activation must be one of silu, gelu_tanh, gelu, relu; got '", std::string(a), "'");
}

// KT_PROFILE=1: one line per call on stderr with the wall time of each phase (read on every call, so a
// process can switch it; when off, each phase mark is one branch).
class PhaseTimer {
 public:
  using Clock = std::chrono::steady_clock;
  PhaseTimer() {
    const char* env = std::getenv("KT_PROFILE");
    on_ = env != nullptr && *env != '\0' && std::strcmp(env, "0") != 0;
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
  // An extra entry (not a phase: the wall clock does not move), e.g. a worker breakdown of the phase before it.
  void add(const char* name, double ms) {
    if (!on_ || n_ == kMaxPhases) return;
    phases_[n_] = name;
    ms_[n_++] = ms;
  }
  // Prints "kt.fused_moe <what>: phase ms, ..., total ms".
  void print(const std::string& what) const {
    if (!on_) return;
    std::string line = "kt.fused_moe " + what + ":";
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
  bool on_ = false;
  Clock::time_point start_, last_;
  const char* phases_[kMaxPhases];
  double ms_[kMaxPhases];
  int n_ = 0;
};

// KT_PROFILE=1: where each worker's time in a parallel phase goes, summed over its tasks. Added to the phase
// line as <phase>.kernel (the gemm kernel calls), <phase>.epilogue (the driver's work on their output: GLU and
// h quantization, or down's weighted scatter), <phase>.other (the rest of the tasks: row copies, the group
// sums), each the mean over workers in ms, and <phase>.busiest (the largest sum of the
// three for one worker): a phase far longer than its busiest worker waited on wake-ups or scheduling, one
// far longer than the kernel share spent it in the epilogue.
class WorkerTimes {
 public:
  using Clock = std::chrono::steady_clock;
  WorkerTimes(bool on, int workers) : on_(on), t_(on ? workers : 0) {}
  enum Kind { kKernel = 0, kEpilogue = 1, kOther = 2 };
  // The mark a task's first lap starts from (read only when on).
  Clock::time_point start() const { return on_ ? Clock::now() : Clock::time_point(); }
  // Adds the time since `mark` to the worker's `kind` and moves `mark` to now; one branch when off.
  void lap(int worker, Kind kind, Clock::time_point& mark) {
    if (!on_) return;
    const Clock::time_point now = Clock::now();
    t_[worker].ns[kind] += std::chrono::duration_cast<std::chrono::nanoseconds>(now - mark).count();
    mark = now;
  }
  void report(PhaseTimer& timer, const char* kernel, const char* epilogue, const char* other,
              const char* busiest) const {
    if (!on_) return;
    double sum[3] = {0, 0, 0}, most = 0;
    for (const Slot& w : t_) {
      for (int k = 0; k < 3; ++k) sum[k] += w.ns[k];
      most = std::max(most, static_cast<double>(w.ns[0] + w.ns[1] + w.ns[2]));
    }
    const double n = static_cast<double>(t_.size()) * 1e6;
    timer.add(kernel, sum[0] / n);
    timer.add(epilogue, sum[1] / n);
    timer.add(other, sum[2] / n);
    timer.add(busiest, most / 1e6);
  }

 private:
  struct alignas(64) Slot {
    int64_t ns[3] = {0, 0, 0};
  };
  bool on_;
  std::vector<Slot> t_;
};

// Scratch buffers kept from call to call. Large fresh allocations are mmap'd by malloc and returned to
// the OS on free, so every call would first-touch (page-fault) tens of MB from all workers at once,
// which serializes in the kernel; reused buffers are already mapped. One call at a time owns the
// shared workspace; a concurrent call gets a private one. A taken tensor does not own its bytes (one tensor
// object instead of three: this halved the fixed cost of a decode-sized call, 19 -> 9 us): each slot is taken
// at most once per call, and the workspace outlives the call's tensors.
class Workspace {
 public:
  enum Slot {
    kRows, kRowScale, kRowGsum,            // per token (step 2)
    kH, kHq, kHScale, kHGsum,              // per pair (steps 3, 4)
    kWorkerA, kWorkerScale, kWorkerGsum,   // per worker: a gate/up task's gathered rows
    kWorkerH, kWorkerC,                    // per worker: its h rows (fp32), kernel output
    kAcc,                                  // down accumulators [groups, T, H]
    kNumSlots
  };
  at::Tensor take(Slot slot, at::IntArrayRef shape, at::ScalarType dtype) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const int64_t bytes = std::max<int64_t>(1, n * static_cast<int64_t>(c10::elementSize(dtype)));
    at::Tensor& buf = slots_[slot];
    if (!buf.defined() || buf.numel() < bytes) buf = at::empty({bytes + bytes / 4}, at::TensorOptions().dtype(at::kByte));
    return at::from_blob(buf.data_ptr(), shape, at::TensorOptions().dtype(dtype));
  }

 private:
  at::Tensor slots_[kNumSlots];
};

Workspace& shared_workspace() {
  static Workspace ws;
  return ws;
}
std::mutex& shared_workspace_mutex() {
  static std::mutex m;
  return m;
}

// A tuning knob of the down projection's task grid (KT_DOWN_RANGES, KT_DOWN_GROUPS: read on every call, so one
// process can time several; benchmarks/bench_fused_moe.py --env-variants): a count in [1, most], else `fallback`.
int64_t env_count(const char* name, int64_t fallback, int64_t most) {
  const char* env = std::getenv(name);
  if (env == nullptr || *env == '\0') return fallback;
  char* end = nullptr;
  const long long v = std::strtoll(env, &end, 10);
  TORCH_CHECK(*end == '\0' && v >= 1 && v <= most, name, " must be a count from 1 to ", most, ", got '", env, "'");
  return v;
}

// Row r of src ([R, C], any strides, bf16/fp16/fp32) as C floats. Plain C++: the driver holds no intrinsics.
void row_to_f32(const at::Tensor& src, int64_t r, float* dst) {
  const int64_t C = src.size(1), st = src.stride(1);
  switch (src.scalar_type()) {
    case at::kFloat: {
      const float* p = src.data_ptr<float>() + r * src.stride(0);
      for (int64_t c = 0; c < C; ++c) dst[c] = p[c * st];
      break;
    }
    case at::kBFloat16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(src.data_ptr<at::BFloat16>()) + r * src.stride(0);
      for (int64_t c = 0; c < C; ++c) {
        const uint32_t bits = static_cast<uint32_t>(p[c * st]) << 16;
        std::memcpy(dst + c, &bits, 4);
      }
      break;
    }
    default: {
      const at::Half* p = src.data_ptr<at::Half>() + r * src.stride(0);
      for (int64_t c = 0; c < C; ++c) dst[c] = static_cast<float>(p[c * st]);
    }
  }
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& hidden_in, const at::Tensor& topk_ids_in, const at::Tensor& topk_weights_in,
                     const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                     const std::optional<at::Tensor>& w2_scales, c10::string_view activation) {
  return fused_moe_with_h_quantizer(hidden_in, topk_ids_in, topk_weights_in, w13, w13_scales, w2, w2_scales, activation,
                                    QuantizeH());
}

at::Tensor fused_moe_with_h_quantizer(const at::Tensor& hidden_in, const at::Tensor& topk_ids_in,
                                      const at::Tensor& topk_weights_in, const at::Tensor& w13,
                                      const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                                      const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
                                      const QuantizeH& quantize_h) {
  // ---- checks
  TORCH_CHECK(hidden_in.device().is_cpu(), "fused_moe: hidden must be a CPU tensor, got device ", hidden_in.device());
  TORCH_CHECK(hidden_in.dim() == 2, "fused_moe: hidden must be [T, H] (2-D), got shape ", hidden_in.sizes());
  const auto hdtype = hidden_in.scalar_type();
  TORCH_CHECK(hdtype == at::kBFloat16 || hdtype == at::kFloat || hdtype == at::kHalf,
              "fused_moe: hidden must be bfloat16, float16 or float32, got ", hdtype);
  TORCH_CHECK(topk_ids_in.device().is_cpu() && topk_weights_in.device().is_cpu(),
              "fused_moe: topk_ids and topk_weights must be CPU tensors, got ", topk_ids_in.device(), " and ",
              topk_weights_in.device());
  TORCH_CHECK(topk_ids_in.scalar_type() == at::kInt || topk_ids_in.scalar_type() == at::kLong,
              "fused_moe: topk_ids must be int32 or int64, got ", topk_ids_in.scalar_type());
  TORCH_CHECK(topk_weights_in.is_floating_point(), "fused_moe: topk_weights must be floating point, got ",
              topk_weights_in.scalar_type());
  const int64_t T = hidden_in.size(0), H = hidden_in.size(1);
  TORCH_CHECK(topk_ids_in.dim() == 2 && topk_ids_in.size(0) == T, "fused_moe: topk_ids must be [T=", T,
              ", K], got shape ", topk_ids_in.sizes());
  TORCH_CHECK(topk_weights_in.sizes() == topk_ids_in.sizes(), "fused_moe: topk_weights must have the shape of topk_ids ",
              topk_ids_in.sizes(), ", got ", topk_weights_in.sizes());
  const WeightFormat fmt = format_of(w13, "w13");
  TORCH_CHECK(w2.scalar_type() == w13.scalar_type(), "fused_moe: w13 and w2 must be packed in the same format, got ",
              w13.scalar_type(), " and ", w2.scalar_type());
  const PackedMatrix up = describe(w13, w13_scales, fmt, "w13", "w13_scales");
  const PackedMatrix down = describe(w2, w2_scales, fmt, "w2", "w2_scales");
  const int64_t E = up.E, I = up.N / 2;
  TORCH_CHECK(down.E == E, "fused_moe: w13 has ", E, " experts but w2 has ", down.E);
  TORCH_CHECK(up.N % 64 == 0, "fused_moe: w13 must be packed with gate_up=True (2I a multiple of 64), got N=", up.N);
  TORCH_CHECK(up.K == H && down.N == H, "fused_moe: hidden size mismatch: hidden has H=", H, ", w13 expects K=", up.K,
              ", w2 produces N=", down.N);
  TORCH_CHECK(down.K == I, "fused_moe: intermediate size mismatch: w13 gives I=", I, " (N/2), w2 expects K=", down.K);
  const Activation act = parse_activation(activation);
  PhaseTimer timer;

  at::Tensor out = at::empty({T, H}, hidden_in.options());
  std::unique_lock<std::mutex> ws_lock(shared_workspace_mutex(), std::try_to_lock);
  Workspace private_ws;
  Workspace& ws = ws_lock.owns_lock() ? shared_workspace() : private_ws;
  const kernels::KernelSet& ks = runtime::select_kernels();
  if (T == 0 || topk_ids_in.size(1) == 0) return out.zero_();
  const int workers = runtime::num_workers();

  timer.mark("setup");
  // ---- 1. route
  const int64_t Ksel = topk_ids_in.size(1);
  const at::Tensor ids = topk_ids_in.to(at::kLong).contiguous();
  const at::Tensor wts = topk_weights_in.to(at::kFloat).contiguous();
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* wp = wts.data_ptr<float>();
  std::vector<int64_t> count(E + 1, 0);
  for (int64_t i = 0; i < T * Ksel; ++i) {
    const int64_t e = idp[i];
    TORCH_CHECK(e < E, "fused_moe: topk_ids[", i / Ksel, ", ", i % Ksel, "] = ", e, " is out of range for ", E,
                " experts (negative ids mean 'skip')");
    if (e >= 0) ++count[e + 1];
  }
  std::vector<int64_t> offset(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) offset[e + 1] = offset[e] + count[e + 1];
  const int64_t P = offset[E];
  if (P == 0) return out.zero_();
  std::vector<int64_t> pair_token(P);
  std::vector<float> pair_weight(P);
  {
    std::vector<int64_t> fill(offset.begin(), offset.end() - 1);
    for (int64_t i = 0; i < T * Ksel; ++i) {
      const int64_t e = idp[i];
      if (e < 0) continue;
      const int64_t p = fill[e]++;
      pair_token[p] = i / Ksel;
      pair_weight[p] = wp[i];
    }
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (offset[e + 1] > offset[e]) active.push_back(e);

  timer.mark("route");
  // ---- 2. each token's activation row once: bf16, or int8 with a scale and group sums (int formats)
  const bool int_fmt = fmt != WeightFormat::BF16;
  const int64_t x_groups = int_fmt ? up.groups : 1;
  const int64_t x_row_bytes = int_fmt ? H : 2 * H;
  const uint8_t* rows = nullptr;
  const float* row_scale = nullptr;
  const int32_t* row_gsum = nullptr;
  at::Tensor wf32 = ws.take(Workspace::kWorkerH, {workers, std::max(kGateUpRows * I, 16 * H)}, at::kFloat);
  if (!int_fmt && hdtype == at::kBFloat16 && hidden_in.stride(1) == 1) {
    rows = static_cast<const uint8_t*>(hidden_in.data_ptr());  // rows read in place (any row stride)
  } else {
    at::Tensor r = ws.take(Workspace::kRows, {T, x_row_bytes}, at::kByte);
    at::Tensor sc = ws.take(Workspace::kRowScale, {T}, at::kFloat);
    at::Tensor gs = ws.take(Workspace::kRowGsum, {T, x_groups}, at::kInt);
    uint8_t* rp = r.data_ptr<uint8_t>();
    runtime::parallel_tasks((T + 15) / 16, [&](int64_t task, int worker) {
      const int64_t t0 = task * 16, n = std::min<int64_t>(16, T - t0);
      float* f = wf32.data_ptr<float>() + worker * wf32.size(1);
      for (int64_t i = 0; i < n; ++i) row_to_f32(hidden_in, t0 + i, f + i * H);
      if (int_fmt) {
        ks.quantize_rows(f, H, static_cast<int>(n), H, up.group_size(), reinterpret_cast<int8_t*>(rp) + t0 * H, H,
                         sc.data_ptr<float>() + t0, gs.data_ptr<int32_t>() + t0 * x_groups);
      } else {
        auto* dst = reinterpret_cast<uint16_t*>(rp) + t0 * H;
        for (int64_t i = 0; i < n * H; ++i) dst[i] = f32_to_bf16(f[i]);
      }
    });
    rows = rp;
    row_scale = sc.data_ptr<float>();
    row_gsum = gs.data_ptr<int32_t>();
  }
  const int64_t x_row_stride = rows == hidden_in.data_ptr() ? hidden_in.stride(0) * 2 : x_row_bytes;
  timer.mark("activations");

  // ---- 3. gate + up + activation: h[p] = act(x_p W_gate^T) * (x_p W_up^T)
  // Chunks: an expert's tokens cut into equal chunks of at most kGateUpRows, largest first (the dynamic
  // schedule then ends on small tasks). splits: channel ranges per chunk, 1 when the chunks alone give
  // every worker several tasks.
  struct Chunk { int64_t e, p0, n; };
  std::vector<Chunk> chunks;
  for (int64_t e : active) {
    const int64_t cnt = offset[e + 1] - offset[e], pieces = (cnt + kGateUpRows - 1) / kGateUpRows;
    for (int64_t i = 0; i < pieces; ++i) {
      const int64_t a0 = cnt * i / pieces, a1 = cnt * (i + 1) / pieces;
      chunks.push_back({e, offset[e] + a0, a1 - a0});
    }
  }
  std::stable_sort(chunks.begin(), chunks.end(), [](const Chunk& a, const Chunk& b) { return a.n > b.n; });
  const int64_t ugroups = I / 32;  // kernel calls of 32 gate + 32 up columns = 4 packed 16-column blocks
  const int64_t nchunks = static_cast<int64_t>(chunks.size());
  const int64_t splits = workers == 1 ? 1 : std::min(ugroups, (3 * workers + nchunks - 1) / nchunks);
  const bool full_rows = splits == 1 && !quantize_h;  // a caller's quantize_h takes all of h at once
  const bool h_bf16 = !int_fmt;
  // h: bf16 [P, I] (bf16 weights); int formats: int8 [P, I] + scale + group sums, through fp32 [P, I] when split
  at::Tensor h = ws.take(Workspace::kH, {h_bf16 ? P * I / 2 : (full_rows ? 1 : P * I)}, at::kFloat);
  at::Tensor hq, hs, hg;
  if (int_fmt) {
    hq = ws.take(Workspace::kHq, {P, I}, at::kChar);
    hs = ws.take(Workspace::kHScale, {P}, at::kFloat);
    hg = ws.take(Workspace::kHGsum, {P, down.groups}, at::kInt);
  }
  const size_t up_block = kernels::block_bytes(fmt, up.K);
  const auto* up_base = static_cast<const uint8_t*>(w13.data_ptr());
  const float* up_scales = w13_scales ? w13_scales->data_ptr<float>() : nullptr;
  const int64_t max_rows = std::max<int64_t>(kGateUpRows, kDownRows);
  // A task's rows are a_ld apart: one 64-byte line more than the row, so that the 16 rows an AMX tile load
  // reads in place do not share one or two L1 sets (H = 2048: rows 2048 (int8) or 4096 (bf16) bytes apart
  // fall into 2 or 1 of the 64 sets of a 12-way L1, and evict each other and the weights).
  const int64_t a_ld = (x_row_bytes + 63) / 64 * 64 + 64;
  at::Tensor wa = ws.take(Workspace::kWorkerA, {workers, kGateUpRows * a_ld}, at::kByte);
  at::Tensor wsc = ws.take(Workspace::kWorkerScale, {workers, kGateUpRows}, at::kFloat);
  at::Tensor wgs = ws.take(Workspace::kWorkerGsum, {workers, kGateUpRows * x_groups}, at::kInt);
  at::Tensor wc = ws.take(Workspace::kWorkerC, {workers, max_rows * kDownCols}, at::kFloat);
  WorkerTimes gu_times(timer.on(), workers);
  runtime::parallel_tasks(nchunks * splits, [&](int64_t task, int worker) {
    auto t_mark = gu_times.start();
    const Chunk& ch = chunks[task / splits];
    const int64_t split = task % splits;
    const int64_t g0 = ugroups * split / splits, g1 = ugroups * (split + 1) / splits;
    // the chunk's rows, a_ld apart
    uint8_t* a_buf = wa.data_ptr<uint8_t>() + worker * wa.size(1);
    float* a_scale = wsc.data_ptr<float>() + worker * kGateUpRows;
    int32_t* a_gsum = wgs.data_ptr<int32_t>() + worker * wgs.size(1);
    const void* a_rows[kGateUpRows];
    for (int64_t m = 0; m < ch.n; ++m) {
      const int64_t t = pair_token[ch.p0 + m];
      std::memcpy(a_buf + m * a_ld, rows + t * x_row_stride, x_row_bytes);
      a_rows[m] = a_buf + m * a_ld;
      if (int_fmt) {
        a_scale[m] = row_scale[t];
        std::copy(row_gsum + t * x_groups, row_gsum + (t + 1) * x_groups, a_gsum + m * x_groups);
      }
    }
    float* c = wc.data_ptr<float>() + worker * wc.size(1);
    float* hrows = wf32.data_ptr<float>() + worker * wf32.size(1);  // full rows: this task's h, fp32 [n, I]
    gu_times.lap(worker, WorkerTimes::kOther, t_mark);
    for (int64_t g = g0; g < g1; ++g) {
      kernels::GemmArgs a;
      a.M = static_cast<int>(ch.n);
      a.K = up.K;
      a.a_rows = a_rows;
      if (int_fmt) {
        a.a_scale = a_scale;
        a.a_gsum = a_gsum;
        a.a_gsum_stride = x_groups;
        a.group_size = up.group_size();
        a.b_scale = up_scales + ch.e * up.groups * up.N + 64 * g;
        a.b_scale_group_stride = up.N;
      }
      a.b = up_base + (ch.e * (up.N / 16) + 4 * g) * up_block;
      a.b_block_stride = up_block;
      if (g + 1 < g1) a.next_b = a.b + 4 * up_block;
      a.nblocks = 4;
      a.c = c;
      a.ldc = 64;
      ks.gemm[static_cast<int>(fmt)](a);
      gu_times.lap(worker, WorkerTimes::kKernel, t_mark);
      if (h_bf16)
        ks.glu_bf16(c, 64, a.M, 32, act, static_cast<uint16_t*>(h.data_ptr()) + ch.p0 * I + 32 * g, I);
      else if (full_rows)
        ks.glu_f32(c, 64, a.M, 32, act, hrows + 32 * g, I);
      else
        ks.glu_f32(c, 64, a.M, 32, act, h.data_ptr<float>() + ch.p0 * I + 32 * g, I);
      gu_times.lap(worker, WorkerTimes::kEpilogue, t_mark);
    }
    if (int_fmt && full_rows)
      ks.quantize_rows(hrows, I, static_cast<int>(ch.n), I, down.group_size(), hq.data_ptr<int8_t>() + ch.p0 * I, I,
                       hs.data_ptr<float>() + ch.p0, hg.data_ptr<int32_t>() + ch.p0 * down.groups);
    gu_times.lap(worker, WorkerTimes::kEpilogue, t_mark);
  });
  timer.mark("gate_up");
  gu_times.report(timer, "gate_up.kernel", "gate_up.epilogue", "gate_up.other", "gate_up.busiest");
  if (int_fmt && quantize_h) {
    quantize_h(h.data_ptr<float>(), P, I, down.group_size(), hq.data_ptr<int8_t>(), hs.data_ptr<float>(),
               hg.data_ptr<int32_t>());
    timer.mark("h_quantize");
  } else if (int_fmt && !full_rows) {
    const int64_t per = 16;
    runtime::parallel_tasks((P + per - 1) / per, [&](int64_t task, int) {
      const int64_t p0 = task * per, n = std::min(per, P - p0);
      ks.quantize_rows(h.data_ptr<float>() + p0 * I, I, static_cast<int>(n), I, down.group_size(),
                       hq.data_ptr<int8_t>() + p0 * I, I, hs.data_ptr<float>() + p0,
                       hg.data_ptr<int32_t>() + p0 * down.groups);
    });
    timer.mark("h_quantize");
  }

  // ---- 4. down projection + weighted sum into each token's row
  std::vector<const void*> h_rows(P);
  {
    const auto* base = int_fmt ? static_cast<const uint8_t*>(hq.data_ptr()) : static_cast<const uint8_t*>(h.data_ptr());
    const int64_t row_bytes = int_fmt ? I : 2 * I;
    for (int64_t p = 0; p < P; ++p) h_rows[p] = base + p * row_bytes;
  }
  // ranges: a few per worker on small machines, one per worker on larger ones (every range reads all of h).
  // groups: the experts by id halves, each with its own [T, H] fp32 accumulator: twice the tasks for the
  // same h traffic. Both are fixed by the shapes, never by the routing or the worker count, so every
  // token's sum runs in the same order (expert order within a group, then group 0 + group 1) whatever
  // the batch, the routing of other tokens or the number of workers.
  const int64_t hblocks = H / 16;
  const int64_t nactive = static_cast<int64_t>(active.size());
  const int64_t ranges = std::min(hblocks, env_count("KT_DOWN_RANGES", workers <= 4 ? 2 * workers : workers, 4096));
  const int64_t groups = std::min<int64_t>(env_count("KT_DOWN_GROUPS", kDownGroups, 16), E);
  std::vector<int64_t> group_start(groups + 1, nactive);  // group g: active[group_start[g] .. group_start[g + 1])
  for (int64_t g = 0, i = 0; g < groups; ++g) {
    while (i < nactive && active[i] * groups < E * g) ++i;
    group_start[g] = i;
  }
  const bool acc_is_out = groups == 1 && hdtype == at::kFloat;
  at::Tensor acc = acc_is_out ? out : ws.take(Workspace::kAcc, {groups, T, H}, at::kFloat);
  float* accp = acc.data_ptr<float>();
  // The first pair of each token in each group writes its accumulator row instead of adding to it (the
  // accumulators are never zeroed: at T=2048 that was 32 MB of stores a call); seen[g][t]: group g has a pair
  // of token t (rows of the others are stale and left out of the final sum).
  std::vector<uint8_t> pair_first(P, 0), seen(groups * T, 0);
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t i = group_start[g]; i < group_start[g + 1]; ++i)
      for (int64_t p = offset[active[i]]; p < offset[active[i] + 1]; ++p) {
        uint8_t& s = seen[g * T + pair_token[p]];
        pair_first[p] = s == 0;
        s = 1;
      }
  std::vector<std::atomic<int>> range_done(ranges);
  for (auto& d : range_done) d.store(0, std::memory_order_relaxed);
  const size_t down_block = kernels::block_bytes(fmt, down.K);
  const auto* down_base = static_cast<const uint8_t*>(w2.data_ptr());
  const float* down_scales = w2_scales ? w2_scales->data_ptr<float>() : nullptr;
  WorkerTimes down_times(timer.on(), workers);
  runtime::parallel_tasks(ranges * groups, [&](int64_t task, int worker) {
    auto t_mark = down_times.start();
    const int64_t r = task / groups, g = task % groups;
    const int64_t b0 = hblocks * r / ranges, b1 = hblocks * (r + 1) / ranges;
    const int64_t c0 = 16 * b0, c1 = 16 * b1;
    float* accg = accp + g * T * H;
    if (acc_is_out)  // the output itself: rows no pair writes are zeros
      for (int64_t t = 0; t < T; ++t)
        if (seen[t] == 0) std::fill(accg + t * H + c0, accg + t * H + c1, 0.0f);
    float* c = wc.data_ptr<float>() + worker * wc.size(1);
    down_times.lap(worker, WorkerTimes::kOther, t_mark);
    for (int64_t i = group_start[g]; i < group_start[g + 1]; ++i) {
      const int64_t e = active[i];
      for (int64_t p0 = offset[e]; p0 < offset[e + 1]; p0 += kDownRows) {
        const int M = static_cast<int>(std::min(kDownRows, offset[e + 1] - p0));
        for (int64_t cb = b0; cb < b1; cb += kernels::kMaxBlocks) {
          kernels::GemmArgs a;
          a.M = M;
          a.K = down.K;
          a.a_rows = h_rows.data() + p0;
          if (int_fmt) {
            a.a_scale = hs.data_ptr<float>() + p0;
            a.a_gsum = hg.data_ptr<int32_t>() + p0 * down.groups;
            a.a_gsum_stride = down.groups;
            a.group_size = down.group_size();
            a.b_scale = down_scales + e * down.groups * down.N + 16 * cb;
            a.b_scale_group_stride = down.N;
          }
          a.b = down_base + (e * hblocks + cb) * down_block;
          a.b_block_stride = down_block;
          a.nblocks = static_cast<int>(std::min<int64_t>(kernels::kMaxBlocks, b1 - cb));
          if (cb + kernels::kMaxBlocks < b1)
            a.next_b = a.b + kernels::kMaxBlocks * down_block;
          else if (p0 + kDownRows >= offset[e + 1] && i + 1 < group_start[g + 1])
            a.next_b = down_base + (active[i + 1] * hblocks + b0) * down_block;
          a.c = c;
          a.ldc = kDownCols;
          ks.gemm[static_cast<int>(fmt)](a);
          down_times.lap(worker, WorkerTimes::kKernel, t_mark);
          ks.scatter_add(c, kDownCols, M, 16 * a.nblocks, pair_weight.data() + p0, pair_token.data() + p0,
                         pair_first.data() + p0, accg + 16 * cb, H);
          down_times.lap(worker, WorkerTimes::kEpilogue, t_mark);
        }
      }
    }
    // the last group task of this range sums the groups that have the token, in group order, into the output
    if (range_done[r].fetch_add(1, std::memory_order_acq_rel) != groups - 1 || acc_is_out) return;
    for (int64_t t = 0; t < T; ++t) {
      int64_t first = 0;
      while (first < groups && seen[first * T + t] == 0) ++first;
      float* row = accp + (first < groups ? first : 0) * T * H + t * H;
      if (first == groups) std::fill(row + c0, row + c1, 0.0f);  // no pair: a zero row
      for (int64_t gg = first + 1; gg < groups; ++gg) {
        if (seen[gg * T + t] == 0) continue;
        const float* add = accp + gg * T * H + t * H;
        for (int64_t j = c0; j < c1; ++j) row[j] += add[j];
      }
      if (hdtype == at::kFloat) {
        std::copy(row + c0, row + c1, out.data_ptr<float>() + t * H + c0);
      } else if (hdtype == at::kBFloat16) {
        auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) + t * H;
        for (int64_t j = c0; j < c1; ++j) o[j] = f32_to_bf16(row[j]);
      } else {
        at::Half* o = out.data_ptr<at::Half>() + t * H;
        for (int64_t j = c0; j < c1; ++j) o[j] = static_cast<at::Half>(row[j]);
      }
    }
    down_times.lap(worker, WorkerTimes::kOther, t_mark);
  });
  timer.mark("down");
  down_times.report(timer, "down.kernel", "down.scatter", "down.other", "down.busiest");
  if (timer.on())
    timer.print("T=" + std::to_string(T) + " pairs=" + std::to_string(P) + " experts=" + std::to_string(active.size()) +
                " " + (fmt == WeightFormat::BF16 ? "bf16" : fmt == WeightFormat::INT8 ? "int8" : "int4") + " " + ks.name);
  return out;
}

}  // namespace kt::moe
