// Training through the packed CPU experts: the backward of kt::fused_moe, and a forward that takes additive
// deltas on the gate/up pre-activations (LoRA on the experts) and returns h.
//
// Math, per routed pair p = (t, k) with e = ids[t, k] >= 0, w = weights[t, k], [g | u] = x_t W13_e^T (+ delta_p):
//   h_p = act(g) * u,   out[t] = sum_k w * h_p W2_e^T
// backward, given dY = d out [T, H] (and optionally d h [T, K, I], when h fed something else, e.g. a down adapter):
//   G  = dY[t] W2_e                     [I]     (the down projection read transposed)
//   dw = <G, h_p>                               (= <dY[t], h_p W2_e^T>: no extra product)
//   dh = w * G (+ dh_p)
//   dg = dh * u * act'(g),  du = dh * act(g)
//   dX[t] += [dg | du] W13_e              [H]     (gate/up read transposed); d delta_p = [dg | du]
// The expert weights are frozen: no gradient for them.
//
// What is saved and what is recomputed: autograd saves only the op's inputs (hidden, ids, weights and references to
// the packed tensors, no copies); the backward recomputes [g | u] = x W13^T from hidden instead of saving the
// [T, K, 2I] pre-activations (Qwen3-30B-A3B at T = 2048: 48 MiB a layer in bf16, 2.4 GiB for 48 layers), at the
// price of one more x W13^T product per pair (2 of the 5 H*I-sized products a pair's backward makes here).
//
// How: the pairs are grouped by expert; each expert is one task, pulled by the ATen (OpenMP) workers from a shared
// counter, most tokens first. A task decodes its expert's packed blocks (bf16, int8 per channel, int4 grouped:
// kernels.h) into its worker's scratch as dense [2I, H] and [H, I] matrices in the compute dtype (no unpacked copy
// of the layer: one expert per worker at a time), then runs the products with ATen's matmuls (oneDNN/MKL), single
// threaded inside the task. Each pair's row goes to its own slot of a [T, K, H] buffer and the K slots are summed in
// slot order afterwards: no atomics, the same result whatever the thread count.
// Dtypes: the products run in float64 for float64 hidden (gradcheck), float32 for float32, bf16 otherwise (fp32
// accumulation inside the matmul); the element-wise work in float32 (float64 for float64). Decoded int8/int4 weights
// are q * scale in fp32 (as kt.unpack), then cast. The int formats' forward (kt.fused_moe) also quantizes the
// activations to int8; this backward differentiates the function of the dequantized weights with float
// activations (a straight-through estimate for the activation rounding).
#include "fused_moe_backward.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

namespace kt::moe {
namespace {

enum class Fmt { BF16, INT8, INT4 };

struct Packed {
  Fmt fmt;
  const uint8_t* data;
  const float* scales;  // [E, G, N] or nullptr
  int64_t E, N, K, G;
  size_t expert_bytes() const {
    const size_t per = fmt == Fmt::BF16 ? 2 * 16 : fmt == Fmt::INT8 ? 16 : 8;  // bytes per 16-column block per K
    return static_cast<size_t>(N / 16) * K * per;
  }
};

Packed describe_packed(const char* op, const at::Tensor& w, const std::optional<at::Tensor>& s, const char* name,
                       const char* scales_name) {
  TORCH_CHECK(w.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ", w.device());
  Fmt f;
  int64_t per;
  switch (w.scalar_type()) {
    case at::kBFloat16: f = Fmt::BF16; per = 2; break;
    case at::kChar: f = Fmt::INT8; per = 4; break;
    case at::kByte: f = Fmt::INT4; per = 8; break;
    default:
      TORCH_CHECK(false, op, ": ", name, " must be packed by kt.pack_bf16/pack_int8/pack_int4 (bfloat16, int8 or uint8 ",
                  "for int4), got ", w.scalar_type());
  }
  TORCH_CHECK(w.dim() == 5 && w.size(3) == 16 && w.size(4) == (f == Fmt::BF16 ? 2 : 4) && w.is_contiguous(), op, ": ",
              name, " must be a contiguous packed tensor [E, N/16, K/", per, ", 16, ", f == Fmt::BF16 ? 2 : 4,
              "], got shape ", w.sizes());
  Packed p{f, static_cast<const uint8_t*>(w.data_ptr()), nullptr, w.size(0), w.size(1) * 16, w.size(2) * per, 1};
  if (f == Fmt::BF16) {
    TORCH_CHECK(!s.has_value(), op, ": bf16 weights take no scales, but ", scales_name, " was given");
    return p;
  }
  TORCH_CHECK(s.has_value(), op, ": ", f == Fmt::INT8 ? "int8" : "int4", " weights need ", scales_name);
  const at::Tensor& sc = *s;
  TORCH_CHECK(sc.device().is_cpu() && sc.scalar_type() == at::kFloat && sc.dim() == 3 && sc.is_contiguous() &&
                  sc.size(0) == p.E && sc.size(2) == p.N && sc.size(1) > 0 && p.K % sc.size(1) == 0,
              op, ": ", scales_name, " must be a contiguous float32 CPU tensor [E=", p.E, ", G, N=", p.N,
              "] with G dividing K=", p.K, ", got ", sc.scalar_type(), " ", sc.sizes(), " on ", sc.device());
  p.G = sc.size(1);
  TORCH_CHECK(f == Fmt::INT4 || p.G == 1, op, ": int8 ", scales_name, " must be per output channel [E, 1, N], got ",
              sc.sizes());
  p.scales = sc.data_ptr<float>();
  return p;
}

inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Expert e of m as a dense row-major [N, K] matrix in out (of type T). gate_up: packed row p is row
// (p % 64) / 32 * N/2 + p / 64 * 32 + p % 32 of the result (gate rows first, then up rows: pack.cpp's order undone).
template <typename T>
void decode_expert(const Packed& m, int64_t e, bool gate_up, T* out) {
  const int64_t N = m.N, K = m.K;
  const uint8_t* base = m.data + e * m.expert_bytes();
  const float* sc = m.scales != nullptr ? m.scales + e * m.G * N : nullptr;
  const int64_t gsize = K / m.G;
  for (int64_t nb = 0; nb < N / 16; ++nb) {
    for (int64_t c = 0; c < 16; ++c) {
      const int64_t p = nb * 16 + c;
      const int64_t row = gate_up ? (p % 64) / 32 * (N / 2) + p / 64 * 32 + p % 32 : p;
      T* dst = out + row * K;
      switch (m.fmt) {
        case Fmt::BF16: {  // [K/2][16][2]
          const uint16_t* blk = reinterpret_cast<const uint16_t*>(base) + nb * K * 16;
          for (int64_t q = 0; q < K / 2; ++q) {
            dst[2 * q] = static_cast<T>(bf16_bits_to_float(blk[(q * 16 + c) * 2]));
            dst[2 * q + 1] = static_cast<T>(bf16_bits_to_float(blk[(q * 16 + c) * 2 + 1]));
          }
          break;
        }
        case Fmt::INT8: {  // [K/4][16][4]
          const int8_t* blk = reinterpret_cast<const int8_t*>(base) + nb * K * 16;
          const float s = sc[p];
          for (int64_t q = 0; q < K / 4; ++q)
            for (int64_t j = 0; j < 4; ++j) dst[4 * q + j] = static_cast<T>(static_cast<float>(blk[(q * 16 + c) * 4 + j]) * s);
          break;
        }
        case Fmt::INT4: {  // [K/8][16][4] bytes: low nibble value 8o + j, high nibble 8o + 4 + j, both stored + 8
          const uint8_t* blk = base + nb * (K / 2) * 16;
          for (int64_t o = 0; o < K / 8; ++o) {
            const float s = sc[(8 * o / gsize) * N + p];
            for (int64_t j = 0; j < 4; ++j) {
              const uint8_t b = blk[(o * 16 + c) * 4 + j];
              dst[8 * o + j] = static_cast<T>(static_cast<float>(static_cast<int>(b & 0xf) - 8) * s);
              dst[8 * o + 4 + j] = static_cast<T>(static_cast<float>(static_cast<int>(b >> 4) - 8) * s);
            }
          }
          break;
        }
      }
    }
  }
}

void decode_into(const Packed& m, int64_t e, bool gate_up, at::Tensor& out) {
  switch (out.scalar_type()) {
    case at::kDouble: decode_expert(m, e, gate_up, out.data_ptr<double>()); break;
    case at::kFloat: decode_expert(m, e, gate_up, out.data_ptr<float>()); break;
    case at::kBFloat16: decode_expert(m, e, gate_up, out.data_ptr<at::BFloat16>()); break;
    default: TORCH_CHECK(false, "fused_moe backward: unexpected compute dtype ", out.scalar_type());
  }
}

enum class Act { SiLU, GeluTanh, Gelu, Relu };

Act parse_act(const char* op, c10::string_view a) {
  if (a == "silu" || a == "swish") return Act::SiLU;
  if (a == "gelu_tanh" || a == "gelu_pytorch_tanh" || a == "gelu_new") return Act::GeluTanh;
  if (a == "gelu") return Act::Gelu;
  if (a == "relu") return Act::Relu;
  TORCH_CHECK(false, op, ": activation must be one of silu, gelu_tanh, gelu, relu; got '", std::string(a), "'");
}

at::Tensor act_forward(Act a, const at::Tensor& g) {
  switch (a) {
    case Act::SiLU: return at::silu(g);
    case Act::GeluTanh: return at::gelu(g, "tanh");
    case Act::Gelu: return at::gelu(g, "none");
    case Act::Relu: return at::relu(g);
  }
  return g;
}

at::Tensor act_backward(Act a, const at::Tensor& grad, const at::Tensor& g) {
  switch (a) {
    case Act::SiLU: return at::silu_backward(grad, g);
    case Act::GeluTanh: return at::gelu_backward(grad, g, "tanh");
    case Act::Gelu: return at::gelu_backward(grad, g, "none");
    case Act::Relu: return at::threshold_backward(grad, g, 0);
  }
  return grad;
}

// Everything a call needs, checked.
struct Call {
  const char* op;
  at::Tensor hidden, ids, weights;  // hidden [T, H]; ids int64 [T, K]; weights [T, K] in the element dtype
  Packed up, down;
  int64_t T, H, K, I, E;
  Act act;
  at::ScalarType ct, et;  // compute (matmul) dtype, element-wise dtype
  std::vector<int64_t> order, start;  // pairs (t * K + k) grouped by expert: order[start[e] .. start[e + 1])
  std::vector<int64_t> experts;       // experts with pairs, most pairs first
};

Call make_call(const char* op, const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
               const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
               const std::optional<at::Tensor>& w2_scales, c10::string_view activation) {
  TORCH_CHECK(hidden.device().is_cpu() && topk_ids.device().is_cpu() && topk_weights.device().is_cpu(), op,
              ": hidden, topk_ids and topk_weights must be CPU tensors, got ", hidden.device(), ", ", topk_ids.device(),
              ", ", topk_weights.device());
  const auto hd = hidden.scalar_type();
  TORCH_CHECK(hd == at::kBFloat16 || hd == at::kHalf || hd == at::kFloat || hd == at::kDouble, op,
              ": hidden must be bfloat16, float16, float32 or float64, got ", hd);
  TORCH_CHECK(hidden.dim() == 2, op, ": hidden must be [T, H], got shape ", hidden.sizes());
  TORCH_CHECK(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong, op,
              ": topk_ids must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == hidden.size(0), op, ": topk_ids must be [T=", hidden.size(0),
              ", K], got shape ", topk_ids.sizes());
  TORCH_CHECK(topk_weights.is_floating_point() && topk_weights.sizes() == topk_ids.sizes(), op,
              ": topk_weights must be a float tensor shaped like topk_ids ", topk_ids.sizes(), ", got ",
              topk_weights.scalar_type(), " ", topk_weights.sizes());
  Call c{op};
  c.up = describe_packed(op, w13, w13_scales, "w13", "w13_scales");
  c.down = describe_packed(op, w2, w2_scales, "w2", "w2_scales");
  TORCH_CHECK(c.up.fmt == c.down.fmt, op, ": w13 and w2 must be packed in one format, got ", w13.scalar_type(), " and ",
              w2.scalar_type());
  c.T = hidden.size(0);
  c.H = hidden.size(1);
  c.K = topk_ids.size(1);
  c.E = c.up.E;
  c.I = c.up.N / 2;
  TORCH_CHECK(c.down.E == c.E, op, ": w13 has ", c.E, " experts but w2 has ", c.down.E);
  TORCH_CHECK(c.up.N % 64 == 0, op, ": w13 must be packed with gate_up=True (2I a multiple of 64), got N=", c.up.N);
  TORCH_CHECK(c.up.K == c.H && c.down.N == c.H, op, ": hidden size mismatch: hidden has H=", c.H, ", w13 expects K=",
              c.up.K, ", w2 produces N=", c.down.N);
  TORCH_CHECK(c.down.K == c.I, op, ": intermediate size mismatch: w13 gives I=", c.I, " (N/2), w2 expects K=", c.down.K);
  c.act = parse_act(op, activation);
  c.ct = hd == at::kDouble ? at::kDouble : hd == at::kFloat ? at::kFloat : at::kBFloat16;
  c.et = hd == at::kDouble ? at::kDouble : at::kFloat;
  c.hidden = hidden;
  c.ids = topk_ids.to(at::kLong).contiguous();
  c.weights = topk_weights.to(c.et).contiguous();
  // group the pairs by expert, stable in (token, slot) order
  const int64_t* id = c.ids.data_ptr<int64_t>();
  const int64_t P = c.T * c.K;
  std::vector<int64_t> count(c.E + 1, 0);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] < c.E, op, ": topk_ids[", p / std::max<int64_t>(c.K, 1), ", ", p % std::max<int64_t>(c.K, 1),
                "] = ", id[p], " is out of range for ", c.E, " experts");
    if (id[p] >= 0) ++count[id[p] + 1];
  }
  c.start.assign(c.E + 1, 0);
  for (int64_t e = 0; e < c.E; ++e) c.start[e + 1] = c.start[e] + count[e + 1];
  c.order.resize(c.start[c.E]);
  std::vector<int64_t> fill(c.start.begin(), c.start.end() - 1);
  for (int64_t p = 0; p < P; ++p)
    if (id[p] >= 0) c.order[fill[id[p]]++] = p;
  for (int64_t e = 0; e < c.E; ++e)
    if (c.start[e + 1] > c.start[e]) c.experts.push_back(e);
  std::stable_sort(c.experts.begin(), c.experts.end(), [&](int64_t a, int64_t b) {
    return c.start[a + 1] - c.start[a] > c.start[b + 1] - c.start[b];
  });
  return c;
}

// Runs fn(e, w13 [2I, H], w2 [H, I]) for every expert with pairs, on the ATen workers (each task single threaded
// inside), each worker decoding into its own scratch.
template <typename Fn>
void for_each_expert(const Call& c, bool need_w13, bool need_w2, const Fn& fn) {
  const int64_t n = static_cast<int64_t>(c.experts.size());
  if (n == 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), n));
  std::atomic<int64_t> next{0};
  std::vector<std::string> errors(threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t end) {
    for (int64_t slot = b; slot < end; ++slot) {
      try {
        const auto opts = at::TensorOptions().dtype(c.ct);
        at::Tensor w13 = need_w13 ? at::empty({2 * c.I, c.H}, opts) : at::Tensor();
        at::Tensor w2 = need_w2 ? at::empty({c.H, c.I}, opts) : at::Tensor();
        for (int64_t i = next++; i < n; i = next++) {
          const int64_t e = c.experts[i];
          if (need_w13) decode_into(c.up, e, true, w13);
          if (need_w2) decode_into(c.down, e, false, w2);
          fn(e, w13, w2);
        }
      } catch (const std::exception& ex) {
        errors[slot] = ex.what();
        next = n;
      }
    }
  });
  for (const auto& err : errors) TORCH_CHECK(err.empty(), c.op, ": ", err);
}

at::Tensor pair_rows(const Call& c, int64_t e) {
  return at::from_blob(const_cast<int64_t*>(c.order.data()) + c.start[e], {c.start[e + 1] - c.start[e]}, at::kLong);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_moe_delta(const at::Tensor& hidden, const at::Tensor& topk_ids,
                                                   const at::Tensor& topk_weights, const at::Tensor& w13,
                                                   const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
                                                   const std::optional<at::Tensor>& w2_scales,
                                                   const at::Tensor& gate_up_delta, c10::string_view activation) {
  const char* op = "fused_moe_delta";
  Call c = make_call(op, hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation);
  TORCH_CHECK(gate_up_delta.device().is_cpu() && gate_up_delta.is_floating_point() && gate_up_delta.dim() == 3 &&
                  gate_up_delta.size(0) == c.T && gate_up_delta.size(1) == c.K && gate_up_delta.size(2) == 2 * c.I,
              op, ": gate_up_delta must be a float CPU tensor [T=", c.T, ", K=", c.K, ", 2I=", 2 * c.I, "], got ",
              gate_up_delta.scalar_type(), " ", gate_up_delta.sizes(), " on ", gate_up_delta.device());
  const at::Tensor delta = gate_up_delta.reshape({c.T * c.K, 2 * c.I});
  const at::Tensor out_pairs = at::zeros({c.T * c.K, c.H}, at::TensorOptions().dtype(c.et));
  const at::Tensor h_pairs = at::zeros({c.T * c.K, c.I}, at::TensorOptions().dtype(c.et));
  const at::Tensor wflat = c.weights.reshape({c.T * c.K});
  for_each_expert(c, true, true, [&](int64_t e, const at::Tensor& W13, const at::Tensor& W2) {
    const at::Tensor rows = pair_rows(c, e);
    const at::Tensor x = c.hidden.index_select(0, at::floor_divide(rows, c.K)).to(c.ct);
    const at::Tensor gu = at::mm(x, W13.t()).to(c.et).add_(delta.index_select(0, rows).to(c.et));
    const at::Tensor g = gu.narrow(1, 0, c.I), u = gu.narrow(1, c.I, c.I);
    const at::Tensor h = act_forward(c.act, g).mul_(u);
    const at::Tensor y = at::mm(h.to(c.ct), W2.t()).to(c.et).mul_(wflat.index_select(0, rows).unsqueeze(1));
    out_pairs.index_copy_(0, rows, y);
    h_pairs.index_copy_(0, rows, h);
  });
  at::Tensor out = out_pairs.view({c.T, c.K, c.H}).sum(1).to(hidden.scalar_type());
  return {out, h_pairs.view({c.T, c.K, c.I}).to(hidden.scalar_type())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_moe_backward(
    const at::Tensor& grad_out, const at::Tensor& hidden, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
    const at::Tensor& w13, const std::optional<at::Tensor>& w13_scales, const at::Tensor& w2,
    const std::optional<at::Tensor>& w2_scales, c10::string_view activation,
    const std::optional<at::Tensor>& gate_up_delta, const std::optional<at::Tensor>& grad_h) {
  const char* op = "fused_moe_backward";
  Call c = make_call(op, hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation);
  TORCH_CHECK(grad_out.device().is_cpu() && grad_out.is_floating_point() && grad_out.sizes() == hidden.sizes(), op,
              ": grad_out must be a float CPU tensor shaped like hidden ", hidden.sizes(), ", got ",
              grad_out.scalar_type(), " ", grad_out.sizes(), " on ", grad_out.device());
  at::Tensor delta, dh_ext;
  if (gate_up_delta.has_value()) {
    const at::Tensor& d = *gate_up_delta;
    TORCH_CHECK(d.device().is_cpu() && d.is_floating_point() && d.dim() == 3 && d.size(0) == c.T && d.size(1) == c.K &&
                    d.size(2) == 2 * c.I,
                op, ": gate_up_delta must be a float CPU tensor [T=", c.T, ", K=", c.K, ", 2I=", 2 * c.I, "], got ",
                d.scalar_type(), " ", d.sizes(), " on ", d.device());
    delta = d.reshape({c.T * c.K, 2 * c.I});
  }
  if (grad_h.has_value()) {
    const at::Tensor& d = *grad_h;
    TORCH_CHECK(d.device().is_cpu() && d.is_floating_point() && d.dim() == 3 && d.size(0) == c.T && d.size(1) == c.K &&
                    d.size(2) == c.I,
                op, ": grad_h must be a float CPU tensor [T=", c.T, ", K=", c.K, ", I=", c.I, "], got ", d.scalar_type(),
                " ", d.sizes(), " on ", d.device());
    dh_ext = d.reshape({c.T * c.K, c.I});
  }
  const auto eopts = at::TensorOptions().dtype(c.et);
  const at::Tensor dx_pairs = at::zeros({c.T * c.K, c.H}, eopts);
  const at::Tensor dw = at::zeros({c.T * c.K}, eopts);
  const at::Tensor ddelta = delta.defined() ? at::zeros({c.T * c.K, 2 * c.I}, eopts) : at::Tensor();
  const at::Tensor wflat = c.weights.reshape({c.T * c.K});
  const at::Tensor dy_all = grad_out.contiguous();
  for_each_expert(c, true, true, [&](int64_t e, const at::Tensor& W13, const at::Tensor& W2) {
    const at::Tensor rows = pair_rows(c, e);
    const at::Tensor tokens = at::floor_divide(rows, c.K);
    const at::Tensor x = c.hidden.index_select(0, tokens).to(c.ct);
    at::Tensor gu = at::mm(x, W13.t()).to(c.et);
    if (delta.defined()) gu.add_(delta.index_select(0, rows).to(c.et));
    const at::Tensor g = gu.narrow(1, 0, c.I), u = gu.narrow(1, c.I, c.I);
    const at::Tensor a = act_forward(c.act, g);
    const at::Tensor h = a * u;
    const at::Tensor G = at::mm(dy_all.index_select(0, tokens).to(c.ct), W2).to(c.et);  // [n, I]
    dw.index_copy_(0, rows, (G * h).sum(1));
    at::Tensor dh = G.mul_(wflat.index_select(0, rows).unsqueeze(1));
    if (dh_ext.defined()) dh.add_(dh_ext.index_select(0, rows).to(c.et));
    const at::Tensor dgu = at::cat({act_backward(c.act, dh * u, g), dh * a}, 1);  // [n, 2I]
    if (ddelta.defined()) ddelta.index_copy_(0, rows, dgu);
    dx_pairs.index_copy_(0, rows, at::mm(dgu.to(c.ct), W13).to(c.et));
  });
  at::Tensor dx = dx_pairs.view({c.T, c.K, c.H}).sum(1).to(hidden.scalar_type());
  at::Tensor dweights = dw.view({c.T, c.K}).to(topk_weights.scalar_type());
  at::Tensor dd = ddelta.defined() ? ddelta.view({c.T, c.K, 2 * c.I}).to(gate_up_delta->scalar_type())
                                   : at::empty({0}, hidden.options());
  return {dx, dweights, dd};
}

}  // namespace kt::moe
