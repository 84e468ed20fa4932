// kt::fused_moe on the CPU: out[t] = sum_k w[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t,k],
// with negative ids skipped. One call, no Python in between:
//   1. route: group the (token, slot) pairs by expert (stable in token order); ids >= E are errors.
//   2. prepare activations: bf16 rows, or int8 rows with per-row scales and group sums.
//   3. gate+up: tasks = (expert, chunk of its tokens, 32 intermediate channels); each computes 32 gate
//      and 32 up columns in one kernel call and writes act(gate) * up into h[pair].
//   4. down: tasks = (block of output columns); each walks every active expert, computes its tokens'
//      rows of h · W_down^T for those columns and adds w[t,k] times them into the token's output row.
//      Tasks own disjoint output columns, so no atomics and no per-pair output buffer are needed.
// Tasks are pulled dynamically by the workers (runtime/parallel.h), so skewed routing balances.
#include "fused_moe.h"

#include <ATen/ATen.h>

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

constexpr int64_t kTokensPerTask = 128;  // rows per kernel call (bounded scratch per worker)

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
  static constexpr int kMaxPhases = 16;
  bool on_ = false;
  Clock::time_point start_, last_;
  const char* phases_[kMaxPhases];
  double ms_[kMaxPhases];
  int n_ = 0;
};

// Activations in the form the kernels read, one row per (token, slot) pair of the routing.
struct Rows {
  at::Tensor storage;                 // bf16 or int8 rows
  std::vector<const void*> ptr;       // per pair
  std::vector<float> scale;           // per pair (int formats)
  std::vector<int32_t> gsum;          // per pair x groups (int formats)
  int64_t groups = 1;
};

// Scratch buffers kept from call to call. Large fresh allocations are mmap'd by malloc and returned to
// the OS on free, so every call would first-touch (page-fault) tens of MB from all workers at once,
// which serializes in the kernel; reused buffers are already mapped. One call at a time owns the
// shared workspace; a concurrent call gets a private one.
class Workspace {
 public:
  enum Slot { kRows, kRowsF32, kGathered, kH, kHq, kAcc, kScratch, kNumSlots };
  at::Tensor take(Slot slot, at::IntArrayRef shape, at::ScalarType dtype) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const int64_t bytes = std::max<int64_t>(1, n * static_cast<int64_t>(c10::elementSize(dtype)));
    at::Tensor& buf = slots_[slot];
    if (!buf.defined() || buf.numel() < bytes) buf = at::empty({bytes + bytes / 4}, at::TensorOptions().dtype(at::kByte));
    return buf.narrow(0, 0, bytes).view(dtype).view(shape);
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

// Quantizes rows of x [R, K] (fp32) in parallel.
void quantize(const kernels::KernelSet& ks, const at::Tensor& x, int64_t group_size, at::Tensor& q, at::Tensor& scale,
              at::Tensor& gsum) {
  const int64_t R = x.size(0), K = x.size(1), G = K / group_size;
  scale = at::empty({R}, x.options());
  gsum = at::empty({R, G}, x.options().dtype(at::kInt));
  const int64_t chunk = 16, tasks = (R + chunk - 1) / chunk;
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  int32_t* gp = gsum.data_ptr<int32_t>();
  runtime::parallel_tasks(tasks, [&](int64_t t, int) {
    const int64_t r0 = t * chunk, n = std::min(chunk, R - r0);
    ks.quantize_rows(xp + r0 * K, K, static_cast<int>(n), K, group_size, qp + r0 * K, K, sp + r0, gp + r0 * G);
  });
}

// src [R, C] (any dtype, any strides) as a contiguous tensor of `dtype`, converted by the pool's workers
// in slices small enough that ATen runs each copy serially: ATen's own intra-op threads would have to
// compete for the cores with the pool's spinning workers.
at::Tensor convert_rows(const at::Tensor& src, at::ScalarType dtype, at::Tensor dst) {
  if (src.scalar_type() == dtype && src.is_contiguous()) return src;
  const int64_t R = src.size(0), rows = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, src.size(1)));
  runtime::parallel_tasks((R + rows - 1) / rows, [&](int64_t t, int) {
    const int64_t r0 = t * rows, r1 = std::min(R, r0 + rows);
    dst.slice(0, r0, r1).copy_(src.slice(0, r0, r1));
  });
  return dst;
}

template <typename T>
void store_columns(const float* acc, int64_t rows, int64_t ld, int64_t c0, int64_t ncols, T* out) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t j = c0; j < c0 + ncols; ++j) out[t * ld + j] = static_cast<T>(acc[t * ld + j]);
}

}  // namespace

at::Tensor fused_moe(const at::Tensor& hidden_in, const at::Tensor& topk_ids_in, const at::Tensor& topk_weights_in,
                     const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                     const std::optional<at::Tensor>& w2_scales, c10::string_view activation) {
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
  // ---- 2. activations for gate+up, one contiguous row per pair (in expert order), so that every
  // expert's rows form one strided matrix the kernels can load in place (AMX tiles, prefetchers)
  Rows x;
  at::Tensor rows;  // per token: bf16, or int8 quantized
  if (fmt == WeightFormat::BF16) {
    rows = convert_rows(hidden_in, at::kBFloat16, ws.take(Workspace::kRows, {T, H}, at::kBFloat16));
  } else {
    at::Tensor s, g;
    rows = ws.take(Workspace::kRows, {T, H}, at::kChar);
    quantize(ks, convert_rows(hidden_in, at::kFloat, ws.take(Workspace::kRowsF32, {T, H}, at::kFloat)), up.group_size(),
             rows, s, g);
    x.groups = up.groups;
    x.scale.resize(P);
    x.gsum.resize(P * x.groups);
    const float* sp = s.data_ptr<float>();
    const int32_t* gp = g.data_ptr<int32_t>();
    for (int64_t p = 0; p < P; ++p) {
      const int64_t t = pair_token[p];
      x.scale[p] = sp[t];
      std::copy(gp + t * x.groups, gp + (t + 1) * x.groups, x.gsum.begin() + p * x.groups);
    }
  }
  timer.mark("activations");
  const int64_t row_bytes = H * rows.element_size();
  x.storage = ws.take(Workspace::kGathered, {P, H}, rows.scalar_type());
  {
    const auto* src = static_cast<const uint8_t*>(rows.data_ptr());
    auto* dst = static_cast<uint8_t*>(x.storage.data_ptr());
    const int64_t per_task = std::max<int64_t>(1, 65536 / row_bytes);
    runtime::parallel_tasks((P + per_task - 1) / per_task, [&](int64_t t, int) {
      for (int64_t p = t * per_task; p < std::min(P, (t + 1) * per_task); ++p)
        std::memcpy(dst + p * row_bytes, src + pair_token[p] * row_bytes, row_bytes);
    });
    x.ptr.resize(P);
    for (int64_t p = 0; p < P; ++p) x.ptr[p] = dst + p * row_bytes;
  }

  timer.mark("gather");
  // ---- 3. gate + up + activation: h[p] = act(x_p W_gate^T) * (x_p W_up^T)
  const bool h_bf16 = fmt == WeightFormat::BF16;
  at::Tensor h = ws.take(Workspace::kH, {P, I}, h_bf16 ? at::kBFloat16 : at::kFloat);
  const size_t up_block = kernels::block_bytes(fmt, up.K);
  const auto* up_base = static_cast<const uint8_t*>(w13.data_ptr());
  const float* up_scales = w13_scales ? w13_scales->data_ptr<float>() : nullptr;
  const int64_t ublocks = I / 32;  // each task: 32 gate + 32 up columns = 4 packed 16-column blocks
  struct Chunk { int64_t e, p0, n; };
  std::vector<Chunk> chunks;
  for (int64_t e : active)
    for (int64_t p0 = offset[e]; p0 < offset[e + 1]; p0 += kTokensPerTask)
      chunks.push_back({e, p0, std::min(kTokensPerTask, offset[e + 1] - p0)});
  at::Tensor scratch = ws.take(Workspace::kScratch, {workers, kTokensPerTask, 64}, at::kFloat);
  float* scratch_p = scratch.data_ptr<float>();
  runtime::parallel_tasks(static_cast<int64_t>(chunks.size()) * ublocks, [&](int64_t task, int worker) {
    const Chunk& ch = chunks[task / ublocks];
    const int64_t jb = task % ublocks;
    kernels::GemmArgs a;
    a.M = static_cast<int>(ch.n);
    a.K = up.K;
    a.a_rows = x.ptr.data() + ch.p0;
    if (fmt != WeightFormat::BF16) {
      a.a_scale = x.scale.data() + ch.p0;
      a.a_gsum = x.gsum.data() + ch.p0 * x.groups;
      a.a_gsum_stride = x.groups;
      a.group_size = up.group_size();
      a.b_scale = up_scales + ch.e * up.groups * up.N + 64 * jb;
      a.b_scale_group_stride = up.N;
    }
    a.b = up_base + (ch.e * (up.N / 16) + 4 * jb) * up_block;
    a.b_block_stride = up_block;
    a.nblocks = 4;
    a.c = scratch_p + static_cast<int64_t>(worker) * kTokensPerTask * 64;
    a.ldc = 64;
    ks.gemm[static_cast<int>(fmt)](a);
    if (h_bf16)
      ks.glu_bf16(a.c, 64, a.M, 32, act, static_cast<uint16_t*>(h.data_ptr()) + ch.p0 * I + 32 * jb, I);
    else
      ks.glu_f32(a.c, 64, a.M, 32, act, h.data_ptr<float>() + ch.p0 * I + 32 * jb, I);
  });

  timer.mark("gate_up");
  // ---- 4. down projection + weighted sum into each token's row
  Rows hr;
  hr.ptr.resize(P);
  at::Tensor hs, hg;
  if (h_bf16) {
    const auto* base = static_cast<const uint8_t*>(h.data_ptr());
    for (int64_t p = 0; p < P; ++p) hr.ptr[p] = base + p * I * 2;
  } else {
    hr.storage = ws.take(Workspace::kHq, {P, I}, at::kChar);
    quantize(ks, h, down.group_size(), hr.storage, hs, hg);
    hr.groups = down.groups;
    const int8_t* base = hr.storage.data_ptr<int8_t>();
    for (int64_t p = 0; p < P; ++p) hr.ptr[p] = base + p * I;
  }
  timer.mark("h_quantize");
  at::Tensor acc = hdtype == at::kFloat ? out : ws.take(Workspace::kAcc, {T, H}, at::kFloat);
  float* accp = acc.data_ptr<float>();
  const size_t down_block = kernels::block_bytes(fmt, down.K);
  const auto* down_base = static_cast<const uint8_t*>(w2.data_ptr());
  const float* down_scales = w2_scales ? w2_scales->data_ptr<float>() : nullptr;
  const int64_t hblocks = H / 16;
  // Column blocks per task: wide for reuse of each activation row, narrow enough to keep every worker busy.
  int nb = kernels::kMaxBlocks;
  while (nb > 1 && hblocks / nb < 4 * workers) nb /= 2;
  const int64_t dtasks = (hblocks + nb - 1) / nb;
  runtime::parallel_tasks(dtasks, [&](int64_t task, int worker) {
    const int64_t b0 = task * nb;
    const int nblk = static_cast<int>(std::min<int64_t>(nb, hblocks - b0));
    const int64_t c0 = 16 * b0, ncols = 16 * nblk;
    for (int64_t t = 0; t < T; ++t) std::fill_n(accp + t * H + c0, ncols, 0.0f);
    float* c = scratch_p + static_cast<int64_t>(worker) * kTokensPerTask * 64;
    for (int64_t e : active) {
      for (int64_t p0 = offset[e]; p0 < offset[e + 1]; p0 += kTokensPerTask) {
        kernels::GemmArgs a;
        a.M = static_cast<int>(std::min(kTokensPerTask, offset[e + 1] - p0));
        a.K = down.K;
        a.a_rows = hr.ptr.data() + p0;
        if (!h_bf16) {
          a.a_scale = hs.data_ptr<float>() + p0;
          a.a_gsum = hg.data_ptr<int32_t>() + p0 * hr.groups;
          a.a_gsum_stride = hr.groups;
          a.group_size = down.group_size();
          a.b_scale = down_scales + e * down.groups * down.N + c0;
          a.b_scale_group_stride = down.N;
        }
        a.b = down_base + (e * hblocks + b0) * down_block;
        a.b_block_stride = down_block;
        a.nblocks = nblk;
        a.c = c;
        a.ldc = 64;
        ks.gemm[static_cast<int>(fmt)](a);
        for (int m = 0; m < a.M; ++m) {
          const float w = pair_weight[p0 + m];
          float* dst = accp + pair_token[p0 + m] * H + c0;
          const float* src = c + m * 64;
          for (int64_t j = 0; j < ncols; ++j) dst[j] += w * src[j];
        }
      }
    }
    if (hdtype == at::kBFloat16)
      store_columns(accp, T, H, c0, ncols, out.data_ptr<at::BFloat16>());
    else if (hdtype == at::kHalf)
      store_columns(accp, T, H, c0, ncols, out.data_ptr<at::Half>());
  });
  timer.mark("down");
  if (timer.on())
    timer.print("T=" + std::to_string(T) + " pairs=" + std::to_string(P) + " experts=" + std::to_string(active.size()) +
                " " + (fmt == WeightFormat::BF16 ? "bf16" : fmt == WeightFormat::INT8 ? "int8" : "int4") + " " + ks.name);
  return out;
}

}  // namespace kt::moe
