"""Int8 resident experts in a row-major layout, decoded by fused Triton kernels (ktorch/ops/triton_experts.py).

Which residents take it (``row_layout_applies``, decided when ``ktorch.gpu_memory`` places them): int8 codes with
float32 scales per group (our int8 per channel, the exact GGUF Q8_0, Q6_K and MXFP4 codes, MXFP4's 4-bit codes made int8
on the way to the device) on a CUDA device with
Triton importable. Every other resident (bf16, int4, the affine Q5_K codes; no Triton; not CUDA) stays in the
``kt.pack`` layout and ``packed_experts_forward`` (ktorch/ops/gpu_experts.py).

The layout (``RowExperts``), made once when residents are placed, and written in place when they are swapped
(``rows_from_packed``):

    w13 [n, 2I, H]  int8, gate rows then up rows, each row one output channel, H contiguous
    w13_scales [n, 2I, G] float32: group g of row r scales columns [g*H/G, (g+1)*H/G)
    w2  [n, H, I], w2_scales [n, H, G2]

the same values and bytes as the packed experts (the 32-row gate/up interleave and the 16x4 tiles undone).

Decode (calls of at most ``GATHER_MAX_TOKENS`` tokens, on CUDA): ``triton_rows_forward``, two kernels that read each
used expert's int8 rows and scales once and never write bf16 weights. Measured on an H200 (2026-11-26, one
Qwen3-30B-A3B layer, 128 int8 residents with a scale per 32, top-8, under a CUDA graph): 24.7 us a layer at T=1
where the packed path's gather + dequantize + bmm took 354.0 us (63.9 vs 1289.0 us at T=4); docs/resident_decode.md.
More tokens (prefill), or a CPU standing in for the device: all n residents dequantized at once
(``dequantize_rows``, bit for bit ``dequantize_packed``) and ``gpu_experts_forward``, as the packed layout does.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ktorch.ops.gpu_experts import ACTIVATIONS, GATHER_MAX_TOKENS, gpu_experts_forward
from ktorch.ops.packed_weights import MXFP4_DTYPE


class RowExperts(NamedTuple):
    """Int8 resident experts, row-major (see the module docstring): w13 [n, 2I, H], w13_scales [n, 2I, G],
    w2 [n, H, I], w2_scales [n, H, G2]."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def _symmetric_int8(packed: torch.Tensor, scales: Optional[torch.Tensor]) -> bool:
    # MXFP4 nibbles count: residents hold them as their int8 codes (gpu_memory._resident_tensors, mxfp4_as_int8)
    return packed.dtype in (torch.int8, MXFP4_DTYPE) and scales is not None and scales.dim() == 3


def row_layout_applies(w13: torch.Tensor, w13_scales: Optional[torch.Tensor], w2: torch.Tensor,
                       w2_scales: Optional[torch.Tensor], device: torch.device) -> bool:
    """Whether residents of these packed experts on ``device`` are held as ``RowExperts``: int8 codes with float32
    scales per group ([n, G, N]: not the affine formats' [n, 2, G, N]) for w13 and w2, a CUDA device, Triton
    importable. Otherwise they stay packed."""
    from ktorch.ops.triton_experts import triton_available

    return (torch.device(device).type == "cuda" and triton_available() and _symmetric_int8(w13, w13_scales)
            and _symmetric_int8(w2, w2_scales))


def _packed_rows(packed: torch.Tensor, gate_up: bool) -> tuple:
    """(a writer view of an [n, N, K] tensor in the packed blocks' row order, those blocks as [n, N/16, 16, K/4, 4]
    viewed in the same shape, the [n, N, K] tensor): the row map ``dequantize_packed`` undoes."""
    n, N, per = packed.shape[0], packed.shape[1] * 16, packed.shape[4]
    K = packed.shape[2] * per
    out = torch.empty(n, N, K, dtype=packed.dtype, device=packed.device)
    inner = (K // per, per)
    # gate/up packed rows 64b + 32h + 16c + r are original rows h*N/2 + 32b + 16c + r (the packing's interleave)
    rows = out.view(n, 2, N // 64, 2, 16, *inner).transpose(1, 2) if gate_up else out.view(n, N // 16, 16, *inner)
    return rows, packed.permute(0, 1, 3, 2, 4).view(rows.shape), out  # a view: no transient copy


def _unpack_one(packed: torch.Tensor, scales: Optional[torch.Tensor], gate_up: bool) -> tuple:
    if packed.dim() != 5 or packed.shape[3] != 16:
        raise ValueError(f"rows_from_packed: packed must be [n, N/16, K/4, 16, 4], got {tuple(packed.shape)}")
    n, N = packed.shape[0], packed.shape[1] * 16
    K = packed.shape[2] * packed.shape[4]
    if not _symmetric_int8(packed, scales) or scales.shape[0] != n or scales.shape[2] != N or K % scales.shape[1]:
        raise ValueError(f"rows_from_packed: the row layout takes int8 packed experts with float32 scales [n={n}, G, "
                         f"N={N}], G dividing K={K}; got {packed.dtype} with scales "
                         f"{None if scales is None else tuple(scales.shape)} (bf16, int4 and the affine formats "
                         "stay in the packed layout)")
    rows, blocks, q = _packed_rows(packed, gate_up)
    rows.copy_(blocks)
    G = scales.shape[1]
    s = torch.empty(n, N, G, dtype=scales.dtype, device=scales.device)
    lead = rows.shape[:-2]  # rows in packed order, then G
    target = s.view(n, 2, N // 64, 2, 16, G).transpose(1, 2) if gate_up else s.view(n, N // 16, 16, G)
    target.copy_(scales.transpose(1, 2).reshape(*lead, G))
    return q, s


def rows_from_packed(w13: torch.Tensor, w13_scales: Optional[torch.Tensor], w2: torch.Tensor,
                     w2_scales: Optional[torch.Tensor]) -> RowExperts:
    """Packed int8 experts (``kt.pack_*`` layout, [n, ...], any device) -> ``RowExperts`` on the same device: the
    same values, the same bytes, rows in the original order."""
    q13, s13 = _unpack_one(w13, w13_scales, True)
    q2, s2 = _unpack_one(w2, w2_scales, False)
    return RowExperts(q13, s13, q2, s2)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Row-major experts q [n, N, K] int8, scales [n, N, G] float32 -> [n, K, N] in ``dtype``, the transposed view
    of a contiguous [n, N, K], as ``dequantize_packed`` returns it: bit for bit its values (q * s computed in
    float32, rounded once)."""
    n, N, K = q.shape
    G = scales.shape[2]
    out = torch.empty(n, N, K, dtype=dtype, device=q.device)
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

    On CUDA with T <= ``GATHER_MAX_TOKENS`` (decode): the Triton kernels (``triton_rows_forward``). Otherwise every
    resident is dequantized and ``gpu_experts_forward`` runs with ``kernel`` ("auto", "gather", "grouped_mm"): bit for
    bit ``packed_experts_forward`` on the same experts with the same kernel."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"rows_experts_forward: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if hidden.is_cuda and hidden.shape[0] <= GATHER_MAX_TOKENS:
        from ktorch.ops.triton_experts import triton_rows_forward

        return triton_rows_forward(hidden, slots, topk_weights, rows, activation)
    w13 = dequantize_rows(rows.w13, rows.w13_scales, hidden.dtype)
    w2 = dequantize_rows(rows.w2, rows.w2_scales, hidden.dtype)
    return gpu_experts_forward(hidden, slots, topk_weights, w13, w2, activation, kernel)
