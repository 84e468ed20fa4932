"""Resident experts in a row-major layout for decode (an experiment: ``ktorch.set_resident_decode``; the default
keeps residents in the ``kt.pack`` layout, ktorch/ops/gpu_experts.py ``packed_experts_forward``).

The layout (``RowExperts``), made once when residents are placed or swapped (``rows_from_packed``):

    w13 [n, 2I, H]  int8 (or bf16), gate rows then up rows, each row one output channel, H contiguous
    w13_scales [n, 2I, G] float32 (None for bf16): group g of row r scales columns [g*H/G, (g+1)*H/G)
    w2  [n, H, I], w2_scales [n, H, G2]

the same values and bytes as the packed experts (the 32-row gate/up interleave and the 16x4 tiles undone). Decode
(T <= 16) then reads each (token, slot) row's expert with no permute:

  gather   plain torch: gather the K experts' int8 rows and scales, dequantize them in one elementwise op over a
           contiguous [r, N, G, K/G] view (no 8-d strides), ``bmm`` against the row-major weights. Bit for bit
           ``gpu_experts_forward`` on ``dequantize_packed`` weights (the same products, the same rounding).
  triton   ktorch/ops/triton_experts.py: two kernels read each slot's int8 weights once and never write bf16
           weights; float32 sums, so within bf16 rounding of ``gather`` (CUDA with Triton only).

More tokens (prefill): all n experts are dequantized at once and ``gpu_experts_forward`` runs, as for the packed
layout. Formats: bf16 and int8 packed experts (symmetric scales); int4 and the affine GGUF formats are refused.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ktorch.ops.gpu_experts import ACTIVATIONS, GATHER_MAX_TOKENS, GATHER_ROWS, gpu_experts_forward, \
    grouped_mm_supported

KERNELS = ("auto", "gather", "triton", "grouped_mm")


class RowExperts(NamedTuple):
    """Resident experts, row-major (see the module docstring): w13 [n, 2I, H], w13_scales [n, 2I, G] | None,
    w2 [n, H, I], w2_scales [n, H, G2] | None."""

    w13: torch.Tensor
    w13_scales: Optional[torch.Tensor]
    w2: torch.Tensor
    w2_scales: Optional[torch.Tensor]


def _packed_rows(packed: torch.Tensor, gate_up: bool) -> tuple:
    """(a writer view of an [n, N, K] tensor in the packed blocks' row order, those blocks as [n, N/16, 16, K/per,
    per] viewed in the same shape, the [n, N, K] tensor): the row map ``dequantize_packed`` undoes."""
    n, N, per = packed.shape[0], packed.shape[1] * 16, packed.shape[4]
    K = packed.shape[2] * per
    out = torch.empty(n, N, K, dtype=packed.dtype, device=packed.device)
    inner = (K // per, per)
    # gate/up packed rows 64b + 32h + 16c + r are original rows h*N/2 + 32b + 16c + r (the packing's interleave)
    rows = out.view(n, 2, N // 64, 2, 16, *inner).transpose(1, 2) if gate_up else out.view(n, N // 16, 16, *inner)
    return rows, packed.permute(0, 1, 3, 2, 4).view(rows.shape), out  # a view: no transient copy


def _unpack_one(packed: torch.Tensor, scales: Optional[torch.Tensor], gate_up: bool) -> tuple:
    if packed.dim() != 5 or packed.shape[3] != 16:
        raise ValueError(f"rows_from_packed: packed must be [n, N/16, K/per, 16, per], got {tuple(packed.shape)}")
    if packed.dtype not in (torch.int8, torch.bfloat16):
        raise ValueError(f"rows_from_packed: the row layout takes int8 or bf16 packed experts, got {packed.dtype} "
                         "(int4 stays in the packed layout)")
    if (scales is None) != (packed.dtype == torch.bfloat16):
        raise ValueError(f"rows_from_packed: {packed.dtype} packed experts "
                         f"{'need' if scales is None else 'take no'} scales")
    n, N = packed.shape[0], packed.shape[1] * 16
    K = packed.shape[2] * packed.shape[4]
    if scales is not None and (scales.dim() != 3 or scales.shape[0] != n or scales.shape[2] != N
                               or K % scales.shape[1]):
        raise ValueError(f"rows_from_packed: scales must be [n={n}, G, N={N}] with G dividing K={K} (affine "
                         f"formats stay in the packed layout), got {tuple(scales.shape)}")
    rows, blocks, q = _packed_rows(packed, gate_up)
    rows.copy_(blocks)
    if scales is None:
        return q, None
    G = scales.shape[1]
    s = torch.empty(n, N, G, dtype=scales.dtype, device=scales.device)
    lead = rows.shape[:-2]  # rows in packed order, then G
    target = s.view(n, 2, N // 64, 2, 16, G).transpose(1, 2) if gate_up else s.view(n, N // 16, 16, G)
    target.copy_(scales.transpose(1, 2).reshape(*lead, G))
    return q, s


def rows_from_packed(w13: torch.Tensor, w13_scales: Optional[torch.Tensor], w2: torch.Tensor,
                     w2_scales: Optional[torch.Tensor]) -> RowExperts:
    """Packed experts (``kt.pack_*`` int8 or bf16, [n, ...], any device) -> ``RowExperts`` on the same device: the
    same values, the same bytes, rows in the original order."""
    q13, s13 = _unpack_one(w13, w13_scales, True)
    q2, s2 = _unpack_one(w2, w2_scales, False)
    return RowExperts(q13, s13, q2, s2)


def dequantize_rows(q: torch.Tensor, scales: Optional[torch.Tensor], dtype: torch.dtype,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Row-major experts q [n, N, K] (scales [n, N, G] float32, None for bf16) -> [n, K, N] in ``dtype``, the
    transposed view of a contiguous [n, N, K] (``out`` if given), as ``dequantize_packed`` returns it: bit for bit
    its values (q * s computed in float32, rounded once)."""
    n, N, K = q.shape
    if out is None:
        out = torch.empty(n, N, K, dtype=dtype, device=q.device)
    elif out.shape != (n, N, K) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"dequantize_rows: out must be a contiguous [{n}, {N}, {K}] {dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if scales is None:
        out.copy_(q)
    else:
        G = scales.shape[2]
        torch.mul(q.view(n, N, G, K // G), scales.unsqueeze(-1), out=out.view(n, N, G, K // G))
    return out.transpose(1, 2)


def rows_experts_forward(
    hidden: torch.Tensor,
    slots: torch.Tensor,
    topk_weights: torch.Tensor,
    rows: RowExperts,
    activation: str = "silu",
    kernel: str = "auto",
) -> torch.Tensor:
    """``packed_experts_forward`` for residents in the row layout: hidden [T, H], slots [T, K] (index into the n
    residents, -1: not here), topk_weights [T, K] -> [T, H] in hidden's dtype.

    ``kernel``: "auto" (gather for T <= 16, else grouped_mm where supported), "gather", "triton" (the fused
    decode kernels, CUDA only), "grouped_mm" (all n experts dequantized, then ``gpu_experts_forward``)."""
    if kernel not in KERNELS:
        raise ValueError(f"rows_experts_forward: kernel must be one of {KERNELS}, got {kernel!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"rows_experts_forward: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    T = hidden.shape[0]
    if kernel == "auto":
        kernel = "gather" if T <= GATHER_MAX_TOKENS or not grouped_mm_supported(hidden) else "grouped_mm"
    if kernel == "triton":
        from ktorch.ops.triton_experts import triton_rows_forward

        return triton_rows_forward(hidden, slots, topk_weights, rows, activation)
    if kernel == "grouped_mm":
        w13 = dequantize_rows(rows.w13, rows.w13_scales, hidden.dtype)
        w2 = dequantize_rows(rows.w2, rows.w2_scales, hidden.dtype)
        return gpu_experts_forward(hidden, slots, topk_weights, w13, w2, activation, kernel)
    return _gather_rows(hidden, slots, topk_weights, rows, ACTIVATIONS[activation])


def _gather_rows(hidden, slots, topk_weights, rows: RowExperts, act) -> torch.Tensor:
    """``GATHER_ROWS`` (token, slot) rows at a time: gather their experts' rows and scales (2 kernels each for w13
    and w2), dequantize (1 each), two ``bmm`` against the row-major weights (transposed operands, no copies)."""
    T, K = slots.shape
    I = rows.w2.shape[2]
    index = slots.clamp(min=0).reshape(-1)
    x = hidden.unsqueeze(1).expand(T, K, hidden.shape[-1]).reshape(T * K, 1, -1)
    parts = []
    for start in range(0, T * K, GATHER_ROWS):
        r = index[start:start + GATHER_ROWS]
        w13 = _dequantize_gathered(rows.w13, rows.w13_scales, r, hidden.dtype)
        w2 = _dequantize_gathered(rows.w2, rows.w2_scales, r, hidden.dtype)
        gate_up = torch.bmm(x[start:start + GATHER_ROWS], w13)  # [r, 1, 2I]
        parts.append(torch.bmm(act(gate_up[..., :I]) * gate_up[..., I:], w2))  # [r, 1, H]
    y = (parts[0] if len(parts) == 1 else torch.cat(parts)).view(T, K, -1)
    coef = torch.where(slots >= 0, topk_weights, 0).to(y.dtype)
    return (y * coef[..., None]).sum(1, dtype=torch.float32).to(hidden.dtype)


def _dequantize_gathered(q: torch.Tensor, scales: Optional[torch.Tensor], r: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """Experts ``r`` of q [n, N, K] as [len(r), K, N] in ``dtype``; bf16 rows in bf16 need no second pass."""
    if scales is None and q.dtype == dtype:
        return q[r].transpose(1, 2)
    return dequantize_rows(q[r], None if scales is None else scales[r], dtype)
