"""Routed experts kept on the accelerator (the "hot" experts of ``ktorch.prepare(..., gpu_experts=...)``).

Plain torch, so it runs eagerly and Inductor compiles it as ordinary GPU work between the CPU experts' submit and
wait. The math is kt.fused_moe's, for the experts this layer holds on the device:

    out[t] = sum_k  w[t, k] * down_s(act(x_t @ gate_s) * (x_t @ up_s)),   s = slots[t, k] >= 0

``slots`` [T, K] are indices into the device-resident experts (not global expert ids), -1 where the slot's expert
is not on the device (the CPU computes it). Two kernels:

  gather      gather each (token, slot) row's expert weights and batch-multiply all rows at once: reads K experts'
              weights per token; best for decode (T small), and shape-static (CUDA graphs).
  grouped_mm  sort the T*K (token, slot) rows by slot and run two ``torch._grouped_mm``: each weight is read once
              per call; best for prefill. Rows whose slot is -1 are sorted last, beyond the last group, and masked.

``kernel="auto"`` takes gather for T <= 16 and grouped_mm above (where ``torch._grouped_mm`` supports the device
and dtype, else gather).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "relu": F.relu,
}
GATHER_MAX_TOKENS = 16
GATHER_ROWS = 32  # (token, slot) rows per gather in the gather kernel: 32 experts' weights in flight at most


def gpu_experts_forward(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    activation: str = "silu",
    kernel: str = "auto",
) -> torch.Tensor:
    """hidden [T, H], slots [T, K] (index into the n device experts, -1: not here), topk_weights [T, K],
    w13 [n, H, 2I] (gate columns then up columns), w2 [n, I, H] -> [T, H] in hidden's dtype.

    ``kernel``: "auto", "gather" or "grouped_mm" (see the module docstring)."""
    if kernel == "auto":
        kernel = "gather" if hidden.shape[0] <= GATHER_MAX_TOKENS or not grouped_mm_supported(hidden) else "grouped_mm"
    if kernel == "gather":
        return _gather_forward(hidden, slots, topk_weights, w13, w2, ACTIVATIONS[activation])
    if kernel == "grouped_mm":
        if not grouped_mm_supported(hidden):
            raise ValueError(f"gpu_experts_forward: torch._grouped_mm does not take {hidden.dtype} on {hidden.device}")
        return _grouped_mm_forward(hidden, slots, topk_weights, w13, w2, ACTIVATIONS[activation])
    raise ValueError(f"gpu_experts_forward: kernel must be auto, gather or grouped_mm, got {kernel!r}")


def grouped_mm_supported(hidden: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for hidden's device and dtype: bf16, on the CPU or on CUDA sm90+."""
    if not hasattr(torch, "_grouped_mm") or hidden.dtype != torch.bfloat16:  # its meta impl takes bf16 only
        return False
    if hidden.device.type == "cpu":
        return True
    if hidden.device.type == "cuda":
        return torch.cuda.get_device_capability(hidden.device)[0] >= 9
    return False


def _gather_forward(hidden, slots, topk_weights, w13, w2, act) -> torch.Tensor:
    """All T*K (token, slot) rows at once, ``GATHER_ROWS`` at a time: gather each row's expert weights, two batched
    GEMMs, the weighted sum over K in float32. At decode (T = 1, K = 8) that is about a dozen kernels a layer where a
    loop over the K slots launched about fifty (each launch costs a captured decode step microseconds)."""
    T, K = slots.shape
    I = w2.shape[1]
    index = slots.clamp(min=0).reshape(-1)  # [T*K]
    x = hidden.unsqueeze(1).expand(T, K, hidden.shape[-1]).reshape(T * K, 1, -1)  # [T*K, 1, H]
    parts = []
    for start in range(0, T * K, GATHER_ROWS):  # bounds the gathered weights: GATHER_ROWS experts at a time
        rows = index[start:start + GATHER_ROWS]
        gate_up = torch.bmm(x[start:start + GATHER_ROWS], w13[rows])  # [r, 1, 2I]
        parts.append(torch.bmm(act(gate_up[..., :I]) * gate_up[..., I:], w2[rows]))  # [r, 1, H]
    y = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(T, K, -1)
    coef = torch.where(slots >= 0, topk_weights, 0).to(y.dtype)
    return (y * coef[..., None]).sum(1, dtype=torch.float32).to(hidden.dtype)


def _grouped_mm_forward(hidden, slots, topk_weights, w13, w2, act) -> torch.Tensor:
    T, K = slots.shape
    n, I = w13.shape[0], w2.shape[1]
    key = torch.where(slots >= 0, slots, n).reshape(-1)  # [T*K]; rows of absent slots sort last
    order = torch.argsort(key, stable=True)
    counts = (key[:, None] == torch.arange(n, device=key.device)).sum(0)  # [n], shape-static (no bincount)
    offs = counts.cumsum(0).to(torch.int32)
    rows = hidden[order // K]  # [T*K, H]
    gate_up = torch._grouped_mm(rows, w13, offs=offs)  # [T*K, 2I]
    y = torch._grouped_mm(act(gate_up[:, :I]) * gate_up[:, I:], w2, offs=offs)  # [T*K, H]
    # Back to (token, slot) order and summed over the K slots in a fixed order: no atomic adds (index_add is
    # one per row on a GPU, and its order, hence the bf16 rounding, varied between runs of the same graph).
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    y = y[inverse].view(T, K, -1)
    here = (slots >= 0)[..., None]
    y = torch.where(here, y * topk_weights[..., None].to(y.dtype), 0)  # rows past the last group hold garbage
    return y.sum(1, dtype=torch.float32).to(hidden.dtype)


def packed_experts_forward(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    packed: tuple,
    activation: str = "silu",
    kernel: str = "auto",
) -> torch.Tensor:
    """``gpu_experts_forward`` for device experts held packed (``kt.pack_*`` layout: (w13, w13_scales, w2,
    w2_scales) [n, ...] on hidden's device, the budget's resident experts): half a bf16 copy's bytes for int8.

    Few tokens (the gather kernel): each (token, slot) row's packed expert is gathered and dequantized, then
    multiplied, ``GATHER_ROWS`` rows at a time, so a decode step dequantizes only the K experts a token uses. More
    tokens: all n experts are dequantized once (a transient [n, ...] in hidden's dtype) and ``gpu_experts_forward``
    runs on them. Bit for bit ``gpu_experts_forward`` on ``dequantize_packed`` of the same experts."""
    from ktorch.ops.packed_weights import dequantize_packed

    p13, s13, p2, s2 = packed
    if kernel == "auto":
        kernel = "gather" if hidden.shape[0] <= GATHER_MAX_TOKENS or not grouped_mm_supported(hidden) else "grouped_mm"
    if kernel != "gather":
        w13 = dequantize_packed(p13, s13, True, hidden.dtype)
        w2 = dequantize_packed(p2, s2, False, hidden.dtype)
        return gpu_experts_forward(hidden, slots, topk_weights, w13, w2, activation, kernel)
    act = ACTIVATIONS[activation]
    T, K = slots.shape
    index = slots.clamp(min=0).reshape(-1)
    x = hidden.unsqueeze(1).expand(T, K, hidden.shape[-1]).reshape(T * K, 1, -1)
    parts = []
    for start in range(0, T * K, GATHER_ROWS):
        rows = index[start:start + GATHER_ROWS]
        w13 = dequantize_packed(p13[rows], None if s13 is None else s13[rows], True, hidden.dtype)  # [r, H, 2I]
        w2 = dequantize_packed(p2[rows], None if s2 is None else s2[rows], False, hidden.dtype)  # [r, I, H]
        I = w2.shape[1]
        gate_up = torch.bmm(x[start:start + GATHER_ROWS], w13)
        parts.append(torch.bmm(act(gate_up[..., :I]) * gate_up[..., I:], w2))
    y = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(T, K, -1)
    coef = torch.where(slots >= 0, topk_weights, 0).to(y.dtype)
    return (y * coef[..., None]).sum(1, dtype=torch.float32).to(hidden.dtype)

