"""Quantized resident experts in a row-major layout, decoded by fused Triton kernels (ktorch/ops/triton_experts.py).

Which residents take it (``row_layout_applies``, decided when ``ktorch.gpu_memory`` places them): integer codes
with float32 scales per group, and for the affine formats a float32 minimum per group, in either of w13 and w2
independently (a Q4_K_M layer: int4 affine gate/up, int8 down), on a CUDA device with Triton importable:

    int8 symmetric  w = s * q             our int8 per channel, the exact GGUF Q8_0, Q6_K and MXFP4 codes
                                          (MXFP4's 4-bit codes made int8 on the way to the device)
    int8 affine     w = s * q - m         the exact GGUF Q5_K codes (0..31, a byte each)
    int4 symmetric  w = s * (nibble - 8)  our int4 (group 32 or 128), the exact GGUF Q4_0 codes
    int4 affine     w = s * nibble - m    the exact GGUF Q4_K codes (0..15), a scale and a minimum per 32

bf16 residents (or no Triton, or not CUDA) stay in the ``kt.pack`` layout and ``packed_experts_forward``
(ktorch/ops/gpu_experts.py).

The layout (``RowExperts``), made once when residents are placed, and written in place when they are swapped
(``rows_from_packed``):

    w13 [n, 2I, H] int8, or [n, 2I, H/2] uint8 for 4-bit codes (two a byte); gate rows then up rows, each row one
        output channel, its codes contiguous. 4-bit rows keep the packed layout's byte order: byte 4o + b of a row
        holds column 8o + b in its low nibble and column 8o + 4 + b in its high one (codes stored as packed: + 8
        for symmetric int4, the nibbles themselves for affine)
    w13_scales [n, 2I, G] float32 (group g of row r covers columns [g*H/G, (g+1)*H/G)), or [n, 2I, 2, G] for the
        affine formats: the row's G scales, then its G minimums
    w2 [n, H, I] (or [n, H, I/2]), w2_scales [n, H, G2] (or [n, H, 2, G2])

the same values and bytes as the packed experts (the 32-row gate/up interleave and the 16x4 tiles undone).

Decode (calls of at most ``GATHER_MAX_TOKENS`` tokens, on CUDA): ``triton_rows_forward``, two kernels that read each
used expert's codes, scales (and minimums) once and never write bf16 weights. Measured for int8 on an H200
(2026-11-26, one Qwen3-30B-A3B layer, 128 int8 residents with a scale per 32, top-8, under a CUDA graph): 24.7 us a
layer at T=1 where the packed path's gather + dequantize + bmm took 354.0 us (63.9 vs 1289.0 us at T=4); the 4-bit
formats are not measured yet (docs/resident_decode.md). Prefill (more tokens) on int8 rows on CUDA: a Triton grouped
GEMM (``triton_grouped_forward``, ktorch/ops/triton_prefill.py: the (token, slot) rows sorted by expert, each used
expert's codes read once per block of its rows, no bf16 weights written). Prefill on 4-bit rows, or a CPU standing
in for the device: the residents the call's slots use (``used_experts``: one host sync) have their rows gathered
and dequantized (``dequantize_rows``, bit for bit ``dequantize_packed``) and ``gpu_experts_forward`` runs on them
with the slots renumbered: bit for bit the result of dequantizing all n (what the packed layout does, and what a call
under Dynamo's trace or a CUDA graph's capture still does: no host sync there).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ktorch.ops.gpu_experts import ACTIVATIONS, GATHER_MAX_TOKENS, gpu_experts_forward
from ktorch.ops.packed_weights import MXFP4_DTYPE, kscales_as_float, packed_in_features


class RowExperts(NamedTuple):
    """Quantized resident experts, row-major (see the module docstring): w13 [n, 2I, H] int8 or [n, 2I, H/2] uint8,
    w13_scales [n, 2I, G] or [n, 2I, 2, G] (affine), w2 [n, H, I] or [n, H, I/2], w2_scales [n, H, G2] or
    [n, H, 2, G2]."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def _packed_format(packed: torch.Tensor, scales: Optional[torch.Tensor]) -> Optional[tuple]:
    """(bits, affine) of packed experts the row layout takes (int8 [n, N/16, K/4, 16, 4] or int4 uint8
    [n, N/16, K/8, 16, 4], float32 scales [n, G, N] or [n, 2, G, N] with minimums), else None (bf16)."""
    if packed.dtype == MXFP4_DTYPE:  # residents hold MXFP4 nibbles as their int8 codes (gpu_memory, mxfp4_as_int8)
        return (8, False) if scales is not None and scales.dim() == 3 else None
    if packed.dtype in (torch.int8, torch.uint8) and scales is not None:  # scales at the file's size: residents
        scales = kscales_as_float(scales[:1], packed_in_features(packed))  # hold their float32 form (gpu_memory)
    if packed.dtype not in (torch.int8, torch.uint8) or scales is None or scales.dtype != torch.float32:
        return None
    if scales.dim() == 3:
        return (8 if packed.dtype == torch.int8 else 4), False
    if scales.dim() == 4 and scales.shape[1] == 2:
        return (8 if packed.dtype == torch.int8 else 4), True
    return None


def row_layout_applies(w13: torch.Tensor, w13_scales: Optional[torch.Tensor], w2: torch.Tensor,
                       w2_scales: Optional[torch.Tensor], device: torch.device) -> bool:
    """Whether residents of these packed experts on ``device`` are held as ``RowExperts``: int8 or int4 codes with
    float32 scales per group (and minimums: the affine formats) for w13 and w2 (each its own format), a CUDA
    device, Triton importable. Otherwise (bf16) they stay packed."""
    from ktorch.ops.triton_experts import triton_available

    return (torch.device(device).type == "cuda" and triton_available()
            and _packed_format(w13, w13_scales) is not None and _packed_format(w2, w2_scales) is not None)


def _packed_rows(packed: torch.Tensor, gate_up: bool) -> tuple:
    """(a writer view of an [n, N, KB] tensor in the packed blocks' row order, those blocks as [n, N/16, 16, KB/4, 4]
    viewed in the same shape, the [n, N, KB] tensor): the row map ``dequantize_packed`` undoes. KB: bytes a row
    (K for int8, K/2 for int4)."""
    n, N, per = packed.shape[0], packed.shape[1] * 16, packed.shape[4]
    KB = packed.shape[2] * per
    out = torch.empty(n, N, KB, dtype=packed.dtype, device=packed.device)
    inner = (KB // per, per)
    # gate/up packed rows 64b + 32h + 16c + r are original rows h*N/2 + 32b + 16c + r (the packing's interleave)
    rows = out.view(n, 2, N // 64, 2, 16, *inner).transpose(1, 2) if gate_up else out.view(n, N // 16, 16, *inner)
    return rows, packed.permute(0, 1, 3, 2, 4).view(rows.shape), out  # a view: no transient copy


def _unpack_one(packed: torch.Tensor, scales: Optional[torch.Tensor], gate_up: bool) -> tuple:
    if packed.dim() != 5 or packed.shape[3] != 16:
        raise ValueError(f"rows_from_packed: packed must be [n, N/16, K/4, 16, 4] (int8) or [n, N/16, K/8, 16, 4] "
                         f"(int4), got {tuple(packed.shape)}")
    n, N = packed.shape[0], packed.shape[1] * 16
    fmt = _packed_format(packed, scales)
    K = packed.shape[2] * (4 if packed.dtype == torch.int8 else 8)
    tail = None if fmt is None else (scales.shape[1:3] if fmt[1] else scales.shape[1:2])
    if fmt is None or packed.shape[4] != 4 or scales.shape[0] != n or scales.shape[-1] != N or K % scales.shape[-2] or (
            fmt[0] == 4 and (K // scales.shape[-2]) % 8):
        raise ValueError(f"rows_from_packed: the row layout takes int8 or int4 packed experts with float32 scales "
                         f"[n={n}, G, N={N}] (or [n, 2, G, N] with minimums), G dividing K={K} (int4: into groups of "
                         f"multiples of 8); got {packed.dtype} with scales "
                         f"{None if scales is None else (scales.dtype, tuple(scales.shape))} (bf16 stays in the "
                         "packed layout)")
    rows, blocks, q = _packed_rows(packed, gate_up)
    rows.copy_(blocks)
    s = torch.empty(n, N, *tail, dtype=scales.dtype, device=scales.device)
    lead = rows.shape[:-2]  # rows in packed order, then (2,) G
    source = scales.permute(0, 3, 1, 2) if fmt[1] else scales.transpose(1, 2)  # [n, N, (2,) G] in packed order
    target = s.view(n, 2, N // 64, 2, 16, *tail).transpose(1, 2) if gate_up else s.view(n, N // 16, 16, *tail)
    target.copy_(source.reshape(*lead, *tail))
    return q, s


def rows_from_packed(w13: torch.Tensor, w13_scales: Optional[torch.Tensor], w2: torch.Tensor,
                     w2_scales: Optional[torch.Tensor]) -> RowExperts:
    """Packed int8/int4 experts (``kt.pack_*`` layout, [n, ...], any device; w13 and w2 each in its own format) ->
    ``RowExperts`` on the same device: the same values, the same bytes, rows in the original order."""
    q13, s13 = _unpack_one(w13, kscales_as_float(w13_scales, packed_in_features(w13)), True)  # file-size scales:
    q2, s2 = _unpack_one(w2, kscales_as_float(w2_scales, packed_in_features(w2)), False)  # their float32 form
    return RowExperts(q13, s13, q2, s2)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Row-major experts q [n, N, K] int8 or [n, N, K/2] uint8, scales [n, N, G] (or [n, N, 2, G]: scales, then
    minimums) float32 -> [n, K, N] in ``dtype``, the transposed view of a contiguous [n, N, K], as
    ``dequantize_packed`` returns it: bit for bit its values (q * s, (q - 8) * s as q * s + (-8 s), or q * s - m,
    computed in float32 by the same ops, rounded once)."""
    from ktorch.ops.triton_experts import row_format

    bits, affine = row_format(q, scales)
    n, N, KB = q.shape
    G = scales.shape[-1]
    if bits == 4:  # byte 4o + b: column 8o + b in the low nibble, 8o + 4 + b in the high one
        K = 2 * KB
        codes = torch.empty(n, N, KB // 4, 2, 4, dtype=torch.uint8, device=q.device)
        blocks = q.view(n, N, KB // 4, 4)
        torch.bitwise_and(blocks, 0xF, out=codes[..., 0, :])
        torch.bitwise_right_shift(blocks, 4, out=codes[..., 1, :])
    else:
        K, codes = KB, q
    out = torch.empty(n, N, K, dtype=dtype, device=q.device)
    s = (scales[:, :, 0] if affine else scales).unsqueeze(-1)  # [n, N, G, 1]
    q_groups, target = codes.reshape(n, N, G, K // G), out.view(n, N, G, K // G)
    if affine:
        torch.addcmul(-scales[:, :, 1].unsqueeze(-1), q_groups, s, out=target)  # q * s - m
    elif bits == 4:
        torch.addcmul(s * -8.0, q_groups, s, out=target)  # (q - 8) * s, as dequantize_packed computes it
    else:
        torch.mul(q_groups, s, out=target)
    return out.transpose(1, 2)


def _kernels_apply(hidden: torch.Tensor) -> bool:
    """Whether ``rows_experts_forward`` runs the Triton kernels: CUDA, at most ``GATHER_MAX_TOKENS`` tokens (decode).
    (Tests running Triton's interpreter on CPU tensors replace it.)"""
    return hidden.is_cuda and hidden.shape[0] <= GATHER_MAX_TOKENS


def _grouped_kernels_apply(hidden: torch.Tensor, rows: RowExperts) -> bool:
    """Whether ``rows_experts_forward`` runs the Triton grouped GEMM (ktorch/ops/triton_prefill.py): CUDA, more than
    ``GATHER_MAX_TOKENS`` tokens (prefill), bf16/fp16 activations, int8 codes in w13 and w2. (Tests running Triton's
    interpreter on CPU tensors replace it.)"""
    from ktorch.ops.triton_prefill import grouped_applies

    return hidden.is_cuda and hidden.shape[0] > GATHER_MAX_TOKENS and grouped_applies(hidden, rows)


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

    On CUDA with T <= ``GATHER_MAX_TOKENS`` (decode): the Triton kernels (``triton_rows_forward``). On CUDA with more
    tokens, int8 codes in w13 and w2, bf16/fp16 activations and ``kernel="auto"``: the Triton grouped GEMM
    (``triton_grouped_forward``, ktorch/ops/triton_prefill.py). Otherwise (4-bit codes, a kernel named, a CPU) the
    residents the slots use are dequantized (every resident under Dynamo or a CUDA graph's capture) and
    ``gpu_experts_forward`` runs with ``kernel`` ("auto", "gather", "grouped_mm"): bit for bit
    ``packed_experts_forward`` on the same experts with the same kernel."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"rows_experts_forward: activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    if rows.w13.device != hidden.device:
        raise ValueError(f"rows_experts_forward: the residents are on {rows.w13.device} and hidden on {hidden.device}; "
                         "run the model on the device the residents were placed on")
    if _kernels_apply(hidden):
        from ktorch.ops.triton_experts import triton_rows_forward

        return triton_rows_forward(hidden, slots, topk_weights, rows, activation)
    if kernel == "auto" and _grouped_kernels_apply(hidden, rows):
        from ktorch.ops.triton_prefill import triton_grouped_forward

        return triton_grouped_forward(hidden, slots, topk_weights, rows, activation)
    if not _compact_applies(hidden):
        w13 = dequantize_rows(rows.w13, rows.w13_scales, hidden.dtype)
        w2 = dequantize_rows(rows.w2, rows.w2_scales, hidden.dtype)
        return gpu_experts_forward(hidden, slots, topk_weights, w13, w2, activation, kernel)
    used, compact = used_experts(slots)
    if used.numel() == 0:  # every slot elsewhere (the CPU op's): nothing here
        return hidden.new_zeros(hidden.shape)
    part = RowExperts(*(t.index_select(0, used) for t in rows))
    w13 = dequantize_rows(part.w13, part.w13_scales, hidden.dtype)
    w2 = dequantize_rows(part.w2, part.w2_scales, hidden.dtype)
    return gpu_experts_forward(hidden, compact, topk_weights, w13, w2, activation, kernel)


def _compact_applies(hidden: torch.Tensor) -> bool:
    """Whether a longer call may dequantize only the residents it uses: their number is known on the host only (one
    sync), which neither Dynamo's trace nor a CUDA graph's capture takes; those dequantize every resident."""
    if torch.compiler.is_compiling():
        return False
    return not (hidden.is_cuda and torch.cuda.is_current_stream_capturing())


def used_experts(slots: torch.Tensor) -> tuple:
    """(the residents slots [T, K] use, ascending [m] (a host sync: m is data-dependent), slots renumbered into them
    [T, K], -1 kept). The renumbering keeps the order of experts, so ``gpu_experts_forward`` sorts the (token, slot)
    rows as it would on all n and computes bit for bit the same rows."""
    here = slots >= 0
    used = torch.unique(slots[here])  # sorted
    compact = torch.where(here, torch.searchsorted(used, slots.clamp(min=0).contiguous()), -1)
    return used, compact.to(slots.dtype)
