"""The one reference every op test compares against: plain torch, float64 for the MoE, fp32 for quantization.

Written to be read, not to be fast: if a test and a kernel disagree, this file says who is right.
  fused_moe_reference:      out[t] = sum_k w[t,k] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t,k] >= 0
                            (magnitudes=True: the same sums over the terms' absolute values)
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
}
ACTIVATION_ALIASES = {"swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


def fused_moe_reference(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    activation: str = "silu",
    magnitudes: bool = False,
) -> torch.Tensor:
    """hidden [T, H], topk_ids/topk_weights [T, K], gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I].

    Returns float64 [T, H]. Negative ids skip their slot; a repeated id counts once per slot.
    magnitudes=True: instead, out[t, j] = sum_k |w[t,k]| sum_i |h_i| |down_e[j, i]|, the size of the terms the
    down projection and the weighted sum add up (h = act(gate) * up), to bound what their summation order changes.
    """
    act = ACTIVATIONS[ACTIVATION_ALIASES.get(activation, activation)]
    x, gate_up, down = hidden.double(), gate_up.double(), down.double()
    weights = topk_weights.double()
    I = down.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for e in range(gate_up.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gu = x[tokens] @ gate_up[e].T
        h = act(gu[:, :I]) * gu[:, I:]
        w = weights[tokens, slots, None]
        if magnitudes:
            out.index_add_(0, tokens, w.abs() * (h.abs() @ down[e].abs().T))
        else:
            out.index_add_(0, tokens, w * (h @ down[e].T))
    return out


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
