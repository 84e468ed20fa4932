"""Fused decode kernels for resident experts in the row layout (ktorch/ops/resident_rows.py), in Triton.

    h[t, k]  = act(x_t @ gate_s^T) * (x_t @ up_s^T)          s = slots[t, k], gate/up rows of w13 [n, 2I, H]
    y[t, k]  = w[t, k] * (h[t, k] @ down_s^T)                down rows of w2 [n, H, I]; 0 where s = -1
    out[t]   = sum_k y[t, k]                                 in slot order (no atomics: the same bits every replay)

Two kernels and one sum: ``gate_up`` (one program per (token, slot) row and ``BLOCK_N`` output channels: reads those
channels' gate and up int8 rows and their scales once, dequantizes in registers, float32 dot products, writes h in
float32), ``down`` (one program per (token, slot) row and BLOCK_N channels of H: y), then ``y.sum(1)``. The int8
weights are read once and no bf16 weights are ever written: at Qwen3-30B-A3B's shape (H 2048, I 768, K 8) a decode
token reads 37.7 MB of int8 and 4.7 MB of float32 scales per layer, where the packed layout's path moves about
288 MB (gather copies, bf16 dequantized weights written and read again). Slots of -1 load nothing (masked loads).

Limits: int8 residents with float32 scales [n, N, G] (G dividing the row length); CUDA tensors; Triton imported
if present, so this module imports anywhere and fails on use with a clear error. Scales are applied per tile as the
group size allows (``scales_mode``): one per row when a group spans whole tiles (per channel), per group when whole
groups fit a tile (Q8_0's 32, Q6_K's 16), else one per element (any group size, slower).
Numerics: float32 sums throughout, one rounding at the end; ``packed_experts_forward`` (the packed layout's path)
rounds the dequantized weights, h and each slot's output to bf16, so the two agree within bf16 rounding, not bit for
bit (tests against a float64 reference).
"""

import torch  # no "from __future__ import annotations": Triton reads the tl.constexpr annotations

# The tile, measured on an H200 (2026-11-26, benchmarks/bench_resident_decode.py: one Qwen3-30B-A3B layer, 128 int8
# residents, scale per 32, top-8, in a CUDA graph; us a layer at T=1 / T=4): BLOCK_N/BLOCK_K/NUM_WARPS 8/256/4
# 24.7 / 63.9, 16/256/4 27.2 / 66.6, 4/512/4 27.0, 16/512/8 26.0 / 68.7, 32/128/4 46.8 / 75.6.
BLOCK_N = 8  # output channels per program: 8*768/8 = 768 gate/up programs and 8*2048/8 = 2048 down programs at T=1
BLOCK_K = 256  # int8 columns per load: each row 256 contiguous bytes
NUM_WARPS = 4
_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


try:  # a dependency on GPU machines only (it comes with CUDA builds of torch)
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def triton_available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        if ACT == 0:
            out = g * tl.sigmoid(g)
        elif ACT == 1:
            out = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
        elif ACT == 2:  # 0.5 g (1 + tanh(u)) = g sigmoid(2u)
            out = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        else:
            out = tl.maximum(g, 0.0)
        return out

    @triton.jit
    def _tile_dot(q_rows, s_rows, row_mask, v, k0, K, G, GROUP: tl.constexpr, MODE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # [BLOCK_N] float32: sum over k in [k0, k0 + BLOCK_K) of q[n, k] * s[n, k // GROUP] * v[k]; q_rows/s_rows
        # [BLOCK_N] pointers to the rows' codes and scales, row_mask [BLOCK_N], v [BLOCK_K] float32 (0 past K)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        m = row_mask[:, None] & (offs_k < K)[None, :]
        qv = tl.load(q_rows[:, None] + offs_k[None, :], mask=m, other=0).to(tl.float32) * v[None, :]
        if MODE == 0:  # a scale group spans whole tiles: one scale per row
            s = tl.load(s_rows + k0 // GROUP, mask=row_mask, other=0.0)
            out = tl.sum(qv, axis=1) * s
        elif MODE == 1:  # whole groups in a tile: sum each group, then scale
            gi = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            s = tl.load(s_rows[:, None] + gi[None, :], mask=row_mask[:, None] & (gi < G)[None, :], other=0.0)
            out = tl.sum(tl.sum(tl.reshape(qv, (BLOCK_N, BLOCK_K // GROUP, GROUP)), axis=2) * s, axis=1)
        else:  # any group size: a scale per element (cached loads)
            s = tl.load(s_rows[:, None] + (offs_k // GROUP)[None, :], mask=m, other=0.0)
            out = tl.sum(qv * s, axis=1)
        return out

    @triton.jit
    def _gate_up(x_ptr, slots_ptr, q_ptr, s_ptr, h_ptr, n_slots, H, I, G, GROUP: tl.constexpr, MODE: tl.constexpr,
                 ACT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)  # t * n_slots + k
        t = row // n_slots
        slot = tl.load(slots_ptr + row)
        e = tl.maximum(slot, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        row_mask = mask_n & (slot >= 0)  # an absent slot loads nothing
        gate_q = q_ptr + e * 2 * I * H + offs_n.to(tl.int64) * H
        gate_s = s_ptr + e * 2 * I * G + offs_n.to(tl.int64) * G
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + t * H + offs_k, mask=offs_k < H, other=0.0).to(tl.float32)
            acc_g += _tile_dot(gate_q, gate_s, row_mask, x, k0, H, G, GROUP, MODE, BLOCK_N, BLOCK_K)
            acc_u += _tile_dot(gate_q + I * H, gate_s + I * G, row_mask, x, k0, H, G, GROUP, MODE, BLOCK_N, BLOCK_K)
        tl.store(h_ptr + row * I + offs_n, _act(acc_g, ACT) * acc_u, mask=mask_n)

    @triton.jit
    def _down(h_ptr, slots_ptr, w_ptr, q_ptr, s_ptr, y_ptr, H, I, G, GROUP: tl.constexpr, MODE: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        e = tl.maximum(slot, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        row_mask = mask_n & (slot >= 0)
        q_rows = q_ptr + e * H * I + offs_n.to(tl.int64) * I
        s_rows = s_ptr + e * H * G + offs_n.to(tl.int64) * G
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            hk = tl.load(h_ptr + row * I + offs_k, mask=offs_k < I, other=0.0)
            acc += _tile_dot(q_rows, s_rows, row_mask, hk, k0, I, G, GROUP, MODE, BLOCK_N, BLOCK_K)
        coef = tl.where(slot >= 0, tl.load(w_ptr + row).to(tl.float32), 0.0)
        tl.store(y_ptr + row * H + offs_n, acc * coef, mask=mask_n)


def scales_mode(group: int, block_k: int) -> int:
    """How a tile applies the scales (``_tile_dot``): 0 a group spans whole tiles, 1 whole groups in a tile (powers
    of two), 2 a scale per element (any group size)."""
    if group % block_k == 0:
        return 0
    if block_k % group == 0 and group & (group - 1) == 0:
        return 1
    return 2


def triton_rows_forward(hidden: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor, rows,
                        activation: str = "silu", block_n: int = BLOCK_N, block_k: int = BLOCK_K,
                        num_warps: int = NUM_WARPS) -> torch.Tensor:
    """hidden [T, H] (CUDA), slots [T, K] (-1: not resident), topk_weights [T, K], rows: ``RowExperts`` of int8
    with float32 scales -> [T, H] in hidden's dtype. Shape-static and free of host syncs (CUDA-graph capturable).
    ``block_n``/``block_k``/``num_warps``: the tile (powers of two), the measured ``BLOCK_N``/``BLOCK_K``/``NUM_WARPS``
    unless a benchmark compares others (benchmarks/bench_resident_decode.py --tiles)."""
    if not hidden.is_cuda:
        raise ValueError(f"triton_rows_forward: the Triton kernels run on CUDA tensors, hidden is on {hidden.device}")
    if not triton_available():
        raise RuntimeError("triton_rows_forward: Triton is not installed (residents without it stay in the packed "
                           "layout: ktorch/ops/resident_rows.py row_layout_applies)")
    if rows.w13.dtype != torch.int8 or rows.w13_scales is None or rows.w2_scales is None:
        raise ValueError(f"triton_rows_forward: int8 residents with scales only, got {rows.w13.dtype}")
    if activation not in _ACT_CODES:
        raise ValueError(f"triton_rows_forward: activation must be one of {tuple(_ACT_CODES)}, got {activation!r}")
    n, two_i, H = rows.w13.shape
    I = two_i // 2
    T, K = slots.shape
    if hidden.shape != (T, H) or rows.w2.shape != (n, H, I) or topk_weights.shape != (T, K):
        raise ValueError(f"triton_rows_forward: hidden [T, H={H}], slots/topk_weights [T, K], w2 [n, H, I={I}]; got "
                         f"{tuple(hidden.shape)}, {tuple(slots.shape)}, {tuple(topk_weights.shape)}, "
                         f"{tuple(rows.w2.shape)}")
    G13, G2 = rows.w13_scales.shape[2], rows.w2_scales.shape[2]
    x = hidden.contiguous()
    s = slots.to(torch.int32).contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    h = torch.empty(T * K, I, dtype=torch.float32, device=hidden.device)
    y = torch.empty(T, K, H, dtype=torch.float32, device=hidden.device)
    g13, g2 = H // G13, I // G2
    _gate_up[(T * K, -(-I // block_n))](x, s, rows.w13, rows.w13_scales, h, K, H, I, G13, GROUP=g13,
                                        MODE=scales_mode(g13, block_k),
                                        ACT=_ACT_CODES[activation], BLOCK_N=block_n, BLOCK_K=block_k,
                                        num_warps=num_warps)
    _down[(T * K, -(-H // block_n))](h, s, w, rows.w2, rows.w2_scales, y, H, I, G2, GROUP=g2,
                                     MODE=scales_mode(g2, block_k), BLOCK_N=block_n,
                                     BLOCK_K=block_k, num_warps=num_warps)
    return y.sum(1).to(hidden.dtype)
