"""The one reference every op test compares against: plain torch, float64 for the MoE, fp32 for quantization.

Written to be read, not to be fast: if a test and a kernel disagree, this file says who is right.
  fused_moe_reference:      out[t] = sum_k w[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t,k] >= 0
                            (magnitudes=True: the same sums over the terms' absolute values); with biases
                            (gate/up before the activation, down before the weight), the clamped/softcapped
                            activations ("swiglu_oai(alpha=, limit=)", ...) and gateless experts (h = act(up))
  quantize_int8_reference:  per output channel, scale = max|W| / 127, q = round-half-even(W / scale)
  quantize_int4_reference:  per group of K, scale = max|W| / 7, q = round-half-even(W / scale) in [-8, 7]
  relative_error:           ||out - ref|| / ||ref|| over all elements
"""

from __future__ import annotations

import math

import torch

ACTIVATIONS = {
    "silu": lambda g: g * torch.sigmoid(g),
    "gelu_tanh": lambda g: 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g**3))),
    "gelu": lambda g: 0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0))),
    "relu": lambda g: g.clamp_min(0.0),
    "relu2": lambda g: g.clamp_min(0.0) ** 2,
}
# Activations of gate and up together, each with its parameters (all required): (gate, up, params) -> h
GLU_ACTIVATIONS = {
    # gpt-oss / MiniMax-M3: gate clamped above at limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha gate)
    "swiglu_oai": lambda g, u, p: (u.clamp(-p["limit"], p["limit"]) + 1.0)
    * g.clamp(max=p["limit"])
    * torch.sigmoid(p["alpha"] * g.clamp(max=p["limit"])),
    # DeepSeek-V4: the same clamps, then silu(gate) * up
    "silu_clamped": lambda g, u, p: ACTIVATIONS["silu"](g.clamp(max=p["limit"])) * u.clamp(-p["limit"], p["limit"]),
    # Inkling2: softcap(gate) * sigmoid(gate) * softcap(up), softcap(x) = c tanh(x / c)
    "softcap_swiglu": lambda g, u, p: p["gate"] * torch.tanh(g / p["gate"]) * torch.sigmoid(g)
    * (p["up"] * torch.tanh(u / p["up"])),
}


def parse_activation(spec: str) -> tuple[str, dict]:
    """"name" or "name(key=value, ...)" -> (name, {key: float})."""
    if "(" not in spec:
        return ACTIVATION_ALIASES.get(spec, spec), {}
    name, body = spec[:-1].split("(", 1)
    params = {k.strip(): float(v) for k, v in (item.split("=") for item in body.split(","))}
    return name, params


def glu_reference(gate: torch.Tensor | None, up: torch.Tensor, activation: str) -> torch.Tensor:
    """h from the gate and up outputs (biases already added); gate None: gateless experts, h = act(up)."""
    name, params = parse_activation(activation)
    if gate is None:
        return ACTIVATIONS[name](up)
    if name in GLU_ACTIVATIONS:
        return GLU_ACTIVATIONS[name](gate, up, params)
    return ACTIVATIONS[name](gate) * up
ACTIVATION_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def fused_moe_reference(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str = "silu",
    magnitudes: bool = False,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate_up_delta: torch.Tensor | None = None,
    return_h: bool = False,
):
    """hidden [T, H], topk_ids/topk_weights [T, K], gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I].

    gate_up may instead be [E, I, H] (= I rows): gateless experts, h = act(up). gate_up_bias [E, 2I] (or [E, I])
    is added to the gate/up outputs, down_bias [E, H] to the down output before the routing weight scales it.
    gate_up_delta [T, K, 2I] (or [T, K, I]) is added to each (token, slot)'s gate/up outputs after the bias
    (kt.fused_moe_delta: LoRA on the experts).
    Returns float64 [T, H], and with return_h also h [T, K, I] (float64, zeros for skipped slots). Negative ids skip
    their slot; a repeated id counts once per slot.
    magnitudes=True: instead, out[t, j] = sum_k |w[t,k]| sum_i |h_i| |down_e[j, i]|, the size of the terms the
    down projection and the weighted sum add up (h = act(gate) * up), to bound what their summation order changes.
    """
    x, gate_up, down = hidden.double(), gate_up.double(), down.double()
    weights = topk_weights.double()
    I = down.shape[2]
    gated = gate_up.shape[1] == 2 * I
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    h_all = torch.zeros(*topk_ids.shape, I, dtype=torch.float64)
    for e in range(gate_up.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gu = x[tokens] @ gate_up[e].T
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e].double()
        if gate_up_delta is not None:
            gu = gu + gate_up_delta[tokens, slots].double()
        h = glu_reference(gu[:, :I], gu[:, I:], activation) if gated else glu_reference(None, gu, activation)
        h_all[tokens, slots] = h
        w = weights[tokens, slots, None]
        if magnitudes:
            b = 0.0 if down_bias is None else down_bias[e].double().abs()
            out.index_add_(0, tokens, w.abs() * (h.abs() @ down[e].abs().T + b))
        else:
            y = h @ down[e].T
            if down_bias is not None:
                y = y + down_bias[e].double()
            out.index_add_(0, tokens, w * y)
    return (out, h_all) if return_h else out


def int8_codes_reference(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [E, N, K] -> (q int8 [E, N, K], scale fp32 [E, N, 1]); W ~ q * scale, per output channel n."""
    w = weight.float()
    scale = w.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(w / scale), torch.zeros_like(w))
    return q.clamp(-127, 127).to(torch.int8), scale


def quantize_int8_reference(weight: torch.Tensor) -> torch.Tensor:
    """The fp32 weights that int8 packing stands for: q * scale."""
    q, scale = int8_codes_reference(weight)
    return q.float() * scale


def int4_codes_reference(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [E, N, K] -> (q int8 in [-8, 7] [E, N, K], scale fp32 [E, N, K / group_size]), per group of K."""
    E, N, K = weight.shape
    w = weight.float().reshape(E, N, K // group_size, group_size)
    scale = w.abs().amax(-1, keepdim=True) / 7.0
    q = torch.where(scale > 0, torch.round(w / scale), torch.zeros_like(w)).clamp(-8, 7)
    return q.to(torch.int8).reshape(E, N, K), scale.squeeze(-1)


def quantize_int4_reference(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weights that int4 packing with this group size stands for: q * scale[group]."""
    q, scale = int4_codes_reference(weight, group_size)
    E, N, K = weight.shape
    return (q.float().reshape(E, N, K // group_size, group_size) * scale.unsqueeze(-1)).reshape(E, N, K)


def dequantize_reference(weight: torch.Tensor, fmt: str, group_size: int | None = None) -> torch.Tensor:
    """What packing `weight` in format `fmt` should give back through kt.unpack, fp32."""
    if fmt == "bf16":
        return weight.to(torch.bfloat16).float()
    if fmt == "int8":
        return quantize_int8_reference(weight)
    return quantize_int4_reference(weight, group_size)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over all elements, in float64 (0 when both are empty or zero)."""
    out, ref = out.double(), ref.double()
    num, den = (out - ref).norm().item(), ref.norm().item()
    if den == 0.0:
        return num
    return num / den


def router_topk_reference(logits: torch.Tensor, k: int, renormalize: bool) -> tuple:
    """A softmax router's top-k (ktorch/ops/triton_router.py): logits [T, E] -> (weights float64 [T, k], ids [T, k]):
    softmax in float64, the k largest by a stable descending sort (equal values: lowest expert first), renormalized
    to sum 1 when ``renormalize``."""
    p = torch.softmax(logits.double(), dim=-1)
    order = torch.sort(p, dim=-1, descending=True, stable=True).indices[:, :k]
    w = p.gather(1, order)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, order
