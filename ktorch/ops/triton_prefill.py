"""Grouped GEMM kernels for prefill on int8 resident experts in the row layout (ktorch/ops/resident_rows.py), in
Triton: W8A16 (bf16/fp16 activations, int8 codes turned into weights in registers with their float32 scales, float32
accumulation).

    h[r]   = act(x_t @ gate_s^T) * (x_t @ up_s^T)   r = t*K + k, s = slots[t, k] >= 0, gate/up rows of w13 [n, 2I, H]
    y[r]   = w[t, k] * (h[r] @ down_s^T)            down rows of w2 [n, H, I]
    out[t] = sum_k y[t*K + k]                       over the slots k with s >= 0, in slot order (no atomics)

The (token, slot) rows are sorted by expert and each expert's run padded to ``BLOCK_M`` rows (``align_by_expert``,
the classic MoE layout: vLLM's and SGLang's ``moe_align_block_size``): then one program computes ``BLOCK_M`` rows of
one expert by ``BLOCK_N`` output channels, so each used expert's codes are read once per block of its rows (once in
all at prefill lengths where an expert gets at most ``BLOCK_M`` rows) and no bf16 weights are written. Three
kernels: ``gate_up`` (h in the activations' dtype, [T*K, I] by row), ``down`` (y float32 [T*K, H] by row, the
routing weight applied), ``sum_slots`` (out). The alignment is three Triton launches of fixed shapes (the padded
length is bounded by T*K + min(n, T*K) * (BLOCK_M - 1); blocks past the last expert's exit at once): no host sync,
so a call is CUDA-graph capturable. It replaced about thirty ATen launches (device, session 35, H200 host, 48-layer
Q8_0 file, every expert resident, `bench_generate.py --prefill-profile 3 --prefill-variants default "align kernel"`:
P=512 132.7 -> 106.3 ms warm, P=2048 137.7 -> 100.0, 5304 -> 3768 launches a profiled prefill: the eager prefill is
launch-bound).

Formats: int8 codes, symmetric (w = s q) or affine (w = s q - m: Q5_K's codes 0..31 with a minimum per group),
float32 scales [n, N, G] or [n, N, 2, G] as resident_rows holds them, for w13 and w2 each. 4-bit rows take
resident_rows' other prefill path (the used residents dequantized, then ``gpu_experts_forward``). How a tile applies
the scales (``MODE``, chosen from the group and ``BLOCK_K``):
  0  ``BLOCK_K`` divides the group (per channel, or a group of 32 with BLOCK_K 32/16): the codes (exact in bf16)
     are multiplied as they are and each tile's float32 product scaled per output channel: s * (x . q) - m * sum(x)
     (per channel symmetric: the scale applied once, at the end). The weights are never rounded.
  1  the group divides ``BLOCK_K`` (a longer tile): each code gets its scale (and minimum) in registers and the
     weight is rounded to the activations' dtype before the dot product (as the dequantize path rounds it).
Limits: CUDA tensors (or CPU tensors under Triton's interpreter, TRITON_INTERPRET=1, for tests), bf16 or fp16
activations; a group that neither divides nor is divided by a BLOCK_K of 16..128 (a power of two), is refused.
"""

import functools
from typing import NamedTuple, Optional

import torch  # no "from __future__ import annotations": Triton reads the tl.constexpr annotations

from ktorch.ops.triton_experts import (_ACT_CODES, next_power_of_2, on_kernel_device, row_format, triton,
                                      triton_available)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the average (token, slot) rows an expert gets. Measured
# (benchmarks/bench_resident_prefill.py --tiles, one Qwen3-30B-A3B layer, 128 int8 residents with a scale per 32,
# H200 host, session 33): T=512 (32 rows an expert) 32/128/32/4/3 651.6 us against 784.4 for 32/64/64/4/3 and 636.4
# for bf16 weights through grouped_mm; T=2048 (128 rows) 64/64/64/4/3 1162.1 us, 128/64/64/8/3 1157.0 (kept: the
# same), the others 1425-2198. The band up to 16 rows is not measured at its own sizes.
TILES = ((16, (16, 64, 64, 4, 3)), (32, (32, 128, 32, 4, 3)), (None, (64, 64, 64, 4, 3)))
BLOCK_SUM = 256  # output channels a program of sum_slots


if triton is not None:
    import triton.language as tl

    from ktorch.ops.triton_experts import _act

    @triton.jit
    def _tile_product(x, q_rows, s_rows, koffs, mask_k, mask_n, k0, G, GS, GROUP: tl.constexpr, MODE: tl.constexpr,
                      AFFINE: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # [BLOCK_M, BLOCK_N] float32: x [BLOCK_M, BLOCK_K] (the activations' dtype) times the rows' weights over the
        # tile's columns (k0 on), whose codes lie koffs from each row's start; q_rows/s_rows [BLOCK_N] pointers to
        # the rows' codes and scales, a scale group GS further, the minimums G * GS further (the row layout: GS 1;
        # the packed one: GS N, see _code_offsets). DOT_F32 (Triton's interpreter only, whose bf16 dot products are
        # wrong and casts to bf16 truncate): the same values multiplied in float32, MODE 1's weights unrounded (and h
        # kept in float32 by the caller)
        q = tl.load(q_rows[None, :] + koffs[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        if MODE == 0:  # the tile in one group: codes as they are, then the group's scale (and minimum)
            if DOT_F32:
                p = tl.dot(x.to(tl.float32), q.to(tl.float32), input_precision="ieee")
            else:
                p = tl.dot(x, q.to(x.dtype))
            if GROUP > 0:  # GROUP 0: per channel symmetric, the scale applied by the caller at the end
                s = tl.load(s_rows + (k0 // GROUP) * GS, mask=mask_n, other=0.0).to(tl.float32)
                p = p * s[None, :]
                if AFFINE == 1:
                    mn = tl.load(s_rows + (G + k0 // GROUP) * GS, mask=mask_n, other=0.0).to(tl.float32)
                    p = p - tl.sum(x.to(tl.float32), axis=1)[:, None] * mn[None, :]
        else:  # groups within the tile: each code's scale (and minimum), the weight rounded to x's dtype. The
            # tile's BLOCK_K / GROUP scales a row loaded once and broadcast over their groups' codes
            gi = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            gm = (gi < G)[:, None] & mask_n[None, :]
            s = tl.load(s_rows[None, :] + gi[:, None] * GS, mask=gm, other=0.0).to(tl.float32)  # [BLOCK_K / GROUP, BLOCK_N]
            s = tl.reshape(tl.broadcast_to(s[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))
            w = q.to(tl.float32) * s
            if AFFINE == 1:
                mn = tl.load(s_rows[None, :] + (G + gi[:, None]) * GS, mask=gm, other=0.0).to(tl.float32)
                w = w - tl.reshape(tl.broadcast_to(mn[:, None, :], (BLOCK_K // GROUP, GROUP, BLOCK_N)),
                                   (BLOCK_K, BLOCK_N))
            if DOT_F32:
                p = tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                p = tl.dot(x, w.to(x.dtype))
        return p

    # The row counts (T * K) and the residents' count are plain arguments, not specialized: Triton would otherwise
    # compile a kernel again for a count that is or is not a multiple of 16 (a prompt of odd length after an even
    # one) or equal to 1, on a user's first prompt of that kind (warm_tiles warms each tile once).
    @triton.jit
    def _code_offsets(offs_k, PACKED: tl.constexpr):
        # where the codes of columns offs_k lie from their row's start: the row layout's k, or the packed layout's
        # (kt.pack_int8: [N/16, K/4, 16, 4] blocks, so column k of row p is at (p // 16) * 16 K + (p % 16) * 4 +
        # (k // 4) * 64 + k % 4: a row part and a column part)
        if PACKED:
            return (offs_k // 4) * 64 + offs_k % 4
        else:
            return offs_k

    @triton.jit
    def _packed_row(p, K):
        # the row part of the packed layout's offsets (_code_offsets) for packed rows p of K columns
        return (p // 16).to(tl.int64) * 16 * K + (p % 16) * 4

    @triton.jit(do_not_specialize=["n_rows", "n_slots", "n_experts"])
    def _gate_up_grouped(x_ptr, sorted_ptr, block_expert_ptr, q_ptr, s_ptr, h_ptr, n_rows, n_slots, n_experts, H, I,
                         G, GROUP: tl.constexpr, MODE: tl.constexpr, AFFINE: tl.constexpr, ACT: tl.constexpr,
                         DOT_F32: tl.constexpr, PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        num_n = tl.cdiv(I, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        e = tl.load(block_expert_ptr + pid_m)
        if e >= n_experts:  # a block past the last expert's rows
            return
        r = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # row t*K + k, or n_rows (padding)
        mask_m = r < n_rows
        tok = (r // n_slots).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        if AFFINE == 1:
            SG = 2 * G
        else:
            SG = G
        e64 = e.to(tl.int64)
        if PACKED:  # gate row j is packed row (j // 32) * 64 + j % 32, up row j 32 rows after it (pack's interleave);
            # scales [n, (2,) G, 2I] by packed row
            pg = (offs_n // 32) * 64 + offs_n % 32
            gate_q = q_ptr + e64 * 2 * I * H + _packed_row(pg, H)
            up_q = q_ptr + e64 * 2 * I * H + _packed_row(pg + 32, H)
            gate_s = s_ptr + e64 * 2 * I * SG + pg
            up_s = gate_s + 32
            GS = 2 * I
        else:  # rows [n, 2I, H], gate rows then up rows; scales [n, 2I, (2,) G]
            gate_q = q_ptr + e64 * 2 * I * H + offs_n.to(tl.int64) * H
            up_q = gate_q + I * H
            gate_s = s_ptr + e64 * 2 * I * SG + offs_n.to(tl.int64) * SG
            up_s = gate_s + I * SG
            GS = 1
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < H
            koffs = _code_offsets(offs_k, PACKED)
            x = tl.load(x_ptr + tok[:, None] * H + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc_g += _tile_product(x, gate_q, gate_s, koffs, mask_k, mask_n, k0, G, GS, GROUP, MODE, AFFINE,
                                   DOT_F32, BLOCK_N, BLOCK_K)
            acc_u += _tile_product(x, up_q, up_s, koffs, mask_k, mask_n, k0, G, GS, GROUP, MODE,
                                   AFFINE, DOT_F32, BLOCK_N, BLOCK_K)
        if MODE == 0 and GROUP == 0:
            acc_g = acc_g * tl.load(gate_s, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            acc_u = acc_u * tl.load(up_s, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        h = _act(acc_g, ACT) * acc_u
        tl.store(h_ptr + r.to(tl.int64)[:, None] * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit(do_not_specialize=["n_rows", "n_experts"])
    def _down_grouped(h_ptr, sorted_ptr, block_expert_ptr, w_ptr, q_ptr, s_ptr, y_ptr, n_rows, n_experts, H, I, G,
                      GROUP: tl.constexpr, MODE: tl.constexpr, AFFINE: tl.constexpr, DOT_F32: tl.constexpr,
                      PACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        num_n = tl.cdiv(H, BLOCK_N)
        pid_m = pid // num_n
        pid_n = pid % num_n
        e = tl.load(block_expert_ptr + pid_m)
        if e >= n_experts:
            return
        r = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        mask_m = r < n_rows
        r64 = r.to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        if AFFINE == 1:
            SG = 2 * G
        else:
            SG = G
        e64 = e.to(tl.int64)
        if PACKED:  # [n, H/16, I/4, 16, 4] blocks, scales [n, (2,) G, H]
            q_rows = q_ptr + e64 * H * I + _packed_row(offs_n, I)
            s_rows = s_ptr + e64 * H * SG + offs_n
            GS = H
        else:
            q_rows = q_ptr + e64 * H * I + offs_n.to(tl.int64) * I
            s_rows = s_ptr + e64 * H * SG + offs_n.to(tl.int64) * SG
            GS = 1
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < I
            koffs = _code_offsets(offs_k, PACKED)
            x = tl.load(h_ptr + r64[:, None] * I + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc += _tile_product(x, q_rows, s_rows, koffs, mask_k, mask_n, k0, G, GS, GROUP, MODE, AFFINE, DOT_F32,
                                 BLOCK_N, BLOCK_K)
        if MODE == 0 and GROUP == 0:
            acc = acc * tl.load(s_rows, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        coef = tl.load(w_ptr + r64, mask=mask_m, other=0.0)
        tl.store(y_ptr + r64[:, None] * H + offs_n[None, :], acc * coef[:, None],
                 mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit(do_not_specialize=["n_slots"])
    def _sum_slots(y_ptr, slots_ptr, out_ptr, H, n_slots, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, n_slots):
            here = (tl.zeros([BLOCK], dtype=tl.int32) + tl.load(slots_ptr + t * n_slots + k)) >= 0
            acc += tl.load(y_ptr + (t * n_slots + k) * H + offs, mask=mask & here, other=0.0)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


ALIGN_ROWS = 64  # (token, slot) rows a program of the alignment kernels' count and scatter
ALIGN_SCAN = 16  # row blocks a step of the scan's loops
# the experts' axis of the alignment kernels is padded to at least this (a constexpr): the split's copied experts
# (n = the call's count, 20-40 a layer) would otherwise compile the three kernels again for each power of two, in a
# user's first prompt (device, session 35: a first 512-token prompt with every expert in host memory 2.15 s against
# 0.36 s warm, with the copied experts' tiles below)
ALIGN_MIN_PAD = 256


if triton is not None:
    @triton.jit(do_not_specialize=["R"])
    def _align_count(slots_ptr, hist_ptr, R, N_PAD: tl.constexpr, BLOCK: tl.constexpr):
        # hist[b, e]: the rows of block b routed to expert e (an absent slot, -1, counts nowhere)
        b = tl.program_id(0)
        offs = b * BLOCK + tl.arange(0, BLOCK)
        key = tl.load(slots_ptr + offs, mask=offs < R, other=-1)
        e = tl.arange(0, N_PAD)
        hits = (key[:, None] == e[None, :]).to(tl.int32)
        tl.store(hist_ptr + b * N_PAD + e, tl.sum(hits, axis=0))

    @triton.jit(do_not_specialize=["R", "n", "n_blocks", "n_out", "capacity"])  # n: the experts of a call
    def _align_scan(hist_ptr, base_ptr, sorted_ptr, block_expert_ptr, R, n, n_blocks, n_out, capacity,
                    BLOCK_M: tl.constexpr, N_PAD: tl.constexpr, SCAN: tl.constexpr, FILL: tl.constexpr):
        # one program: each expert's padded run start, each row block's first position per expert (base[b, e]),
        # each output block's expert, and every position first set to R (the padding rows)
        e = tl.arange(0, N_PAD)
        total = tl.zeros([N_PAD], dtype=tl.int32)
        for b0 in range(0, n_blocks, SCAN):
            rows = b0 + tl.arange(0, SCAN)
            total += tl.sum(tl.load(hist_ptr + rows[:, None] * N_PAD + e[None, :], mask=(rows < n_blocks)[:, None],
                                    other=0), axis=0)
        padded = tl.where(e < n, (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
        end = tl.cumsum(padded, 0)
        carry = end - padded
        for b0 in range(0, n_blocks, SCAN):
            rows = b0 + tl.arange(0, SCAN)
            m = (rows < n_blocks)[:, None]
            tile = tl.load(hist_ptr + rows[:, None] * N_PAD + e[None, :], mask=m, other=0)
            tl.store(base_ptr + rows[:, None] * N_PAD + e[None, :], carry[None, :] + tl.cumsum(tile, 0) - tile, mask=m)
            carry += tl.sum(tile, axis=0)
        for c0 in range(0, n_out, SCAN):
            blk = c0 + tl.arange(0, SCAN)
            before = ((end[None, :] <= (blk * BLOCK_M)[:, None]) & (e < n)[None, :]).to(tl.int32)
            tl.store(block_expert_ptr + blk, tl.sum(before, axis=1), mask=blk < n_out)
        for c0 in range(0, capacity, FILL):
            idx = c0 + tl.arange(0, FILL)
            tl.store(sorted_ptr + idx, tl.zeros([FILL], dtype=tl.int32) + R, mask=idx < capacity)

    @triton.jit(do_not_specialize=["R"])
    def _align_scatter(slots_ptr, base_ptr, sorted_ptr, R, N_PAD: tl.constexpr, BLOCK: tl.constexpr):
        # each routed row to its expert's run: the block's base for the expert plus the row's rank among the
        # block's earlier rows of that expert (row order kept: a stable sort)
        b = tl.program_id(0)
        i = tl.arange(0, BLOCK)
        offs = b * BLOCK + i
        key = tl.load(slots_ptr + offs, mask=offs < R, other=-1)
        here = key >= 0
        earlier = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        base = tl.load(base_ptr + b * N_PAD + tl.maximum(key, 0), mask=here, other=0)
        tl.store(sorted_ptr + base + rank, offs.to(tl.int32), mask=here)


def align_by_expert(slots: torch.Tensor, n: int, block_m: int) -> tuple:
    """slots int32 [T, K] on the kernels' device (index into n experts, -1: none) -> (sorted_ids [P] int32: the rows
    t*K + k sorted by expert (stable), each expert's run padded with T*K to a multiple of ``block_m``, then T*K to
    the end; block_expert [P / block_m] int32: each block's expert, n past the last one). P = the bound for any
    routing of this shape, T*K + min(n, T*K) * (block_m - 1) rounded up to block_m: fixed shapes, no host sync.
    Three Triton launches: count per row block, one program's scan, scatter (tests/test_triton_prefill.py holds the
    ATen form it replaced, ~30 launches, as its reference)."""
    if slots.dtype != torch.int32 or slots.dim() != 2:
        raise ValueError(f"align_by_expert: slots must be int32 [T, K], got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if not triton_available():
        raise RuntimeError("align_by_expert: Triton is not installed")
    if not on_kernel_device(slots):
        raise ValueError(f"align_by_expert: the kernels run on CUDA tensors, slots are on {slots.device}")
    T, K = slots.shape
    R = T * K
    capacity = -(-(R + min(n, R) * (block_m - 1)) // block_m) * block_m
    n_pad = max(next_power_of_2(n + 1), ALIGN_MIN_PAD)  # one compiled variant for any n below it
    n_blocks = max(1, -(-R // ALIGN_ROWS))
    flat = slots.contiguous().view(-1)
    scratch = torch.empty(2, n_blocks, n_pad, dtype=torch.int32, device=slots.device)
    sorted_ids = torch.empty(capacity, dtype=torch.int32, device=slots.device)
    block_expert = torch.empty(capacity // block_m, dtype=torch.int32, device=slots.device)
    _align_count[(n_blocks,)](flat, scratch[0], R, N_PAD=n_pad, BLOCK=ALIGN_ROWS)
    _align_scan[(1,)](scratch[0], scratch[1], sorted_ids, block_expert, R, n, n_blocks, capacity // block_m,
                      capacity, BLOCK_M=block_m, N_PAD=n_pad, SCAN=ALIGN_SCAN, FILL=1024)
    _align_scatter[(n_blocks,)](flat, scratch[1], sorted_ids, R, N_PAD=n_pad, BLOCK=ALIGN_ROWS)
    return sorted_ids, block_expert


class PackedBlocks(NamedTuple):
    """Int8 experts in ``kt.pack_int8``'s blocks, which the grouped kernels read as they are (no row layout made):
    w13 [n, 2I/16, H/4, 16, 4], w13_scales [n, (2,) G, 2I], w2 [n, H/16, I/4, 16, 4], w2_scales [n, (2,) G, H],
    scales float32 or float16 by packed row (two-level K-quant scales are made float32 first). The routing-aware
    split's copied experts (ktorch/ops/routed_experts.py) come to the device in this form."""

    w13: torch.Tensor
    w13_scales: torch.Tensor
    w2: torch.Tensor
    w2_scales: torch.Tensor


def _tile_mode(affine: bool, G: int, K: int, block_k: int) -> Optional[tuple]:
    """(affine, G, GROUP constexpr, MODE) of int8 codes with K columns in G scale groups for tiles of ``block_k``
    columns, or None where a group neither divides nor is divided by block_k."""
    if K % G:
        return None
    group = K // G
    if G == 1 and not affine:
        return affine, G, 0, 0
    if G == 1 or group % block_k == 0:
        return affine, G, group, 0
    if block_k % group == 0:
        return affine, G, group, 1
    return None


def _grouped_format(codes: torch.Tensor, scales: torch.Tensor, K: int, block_k: int) -> Optional[tuple]:
    """``_tile_mode`` of int8 rows with K columns, or None where the kernels do not take them (4-bit codes)."""
    bits, affine = row_format(codes, scales)
    if bits != 8 or scales.dtype != torch.float32:
        return None
    return _tile_mode(affine, scales.shape[-1], K, block_k)


def _blocks_format(codes: torch.Tensor, scales: Optional[torch.Tensor], K: int, block_k: int) -> Optional[tuple]:
    """``_tile_mode`` of int8 packed blocks with K columns, or None (other codes, scales the kernels do not read)."""
    if codes.dtype != torch.int8 or codes.dim() != 5 or codes.shape[3:] != (16, 4) or scales is None:
        return None
    if scales.dtype not in (torch.float32, torch.float16) or scales.dim() not in (3, 4):
        return None
    affine = scales.dim() == 4
    if affine and scales.shape[1] != 2:
        return None
    return _tile_mode(affine, scales.shape[-2], K, block_k)


def _float_scales(blocks: PackedBlocks) -> PackedBlocks:
    """Two-level K-quant scales as their float32 form; float32 and float16 ones as they are (the kernels read both)."""
    from ktorch.ops.packed_weights import kscales_as_float

    def one(scales, K):
        return scales if scales is None or scales.dtype in (torch.float32, torch.float16) else kscales_as_float(scales, K)

    return blocks._replace(w13_scales=one(blocks.w13_scales, blocks.w13.shape[2] * 4),
                           w2_scales=one(blocks.w2_scales, blocks.w2.shape[2] * 4))


def _shapes(rows) -> tuple:
    """(n, 2I, H) of residents in the row layout or packed blocks."""
    if isinstance(rows, PackedBlocks):
        return rows.w13.shape[0], rows.w13.shape[1] * 16, rows.w13.shape[2] * 4
    return tuple(rows.w13.shape)


def _formats(rows, block_k: int, floated: bool = False) -> tuple:
    """(w13's, w2's) ``_tile_mode`` (None where the kernels do not take it) for either layout; ``floated``: packed
    blocks' scales made float already (``_float_scales``)."""
    if isinstance(rows, PackedBlocks):
        rows = rows if floated else _float_scales(rows)
        return (_blocks_format(rows.w13, rows.w13_scales, rows.w13.shape[2] * 4, block_k),
                _blocks_format(rows.w2, rows.w2_scales, rows.w2.shape[2] * 4, block_k))
    if rows.w13.dtype != torch.int8 or rows.w2.dtype != torch.int8:
        return None, None
    return (_grouped_format(rows.w13, rows.w13_scales, rows.w13.shape[2], block_k),
            _grouped_format(rows.w2, rows.w2_scales, rows.w2.shape[2], block_k))


def tile_for(rows_per_expert: float) -> tuple:
    """The ``TILES`` entry for an average of ``rows_per_expert`` (token, slot) rows an expert."""
    for most, tile in TILES:
        if most is None or rows_per_expert <= most:
            return tile
    raise AssertionError("TILES ends with a catch-all")


def warm_tiles(rows, activation: str, dtype: torch.dtype) -> int:
    """Compiles the grouped kernels for every ``TILES`` entry on these residents' formats (one launch each, one
    token's row): a prompt's tile follows its rows an expert (``tile_for``), so the load-time warm-up prefill
    compiles one tile and a user's first prompt of another size compiled the next one (0.86 s at 512 tokens after a
    2048-token warm-up, H200 host, session 33). Returns the tiles launched (0 where the grouped kernels do not take
    these residents, or without Triton or a GPU)."""
    launches = tile_launches(rows, activation, dtype)
    for launch in launches:
        launch()
    return len(launches)


def tile_launches(rows, activation: str, dtype: torch.dtype) -> list:
    """``warm_tiles``' launches, not run: a callable per ``TILES`` entry the grouped kernels take on these rows, each
    launching them once on one token's row of zeros (inputs the launches only read, shared). The load-time warm-up
    runs those of every format side by side (generation._warm_resident_tiles: Triton's compile releases the GIL)."""
    if not triton_available() or dtype not in (torch.bfloat16, torch.float16):
        return []
    n, two_i, H = _shapes(rows)
    hidden = torch.zeros(1, H, dtype=dtype, device=rows.w13.device)
    slots = torch.zeros(1, 1, dtype=torch.int32, device=hidden.device)
    weights = torch.zeros(1, 1, dtype=torch.float32, device=hidden.device)
    return [functools.partial(triton_grouped_forward, hidden, slots, weights, rows, activation, tile=tile)
            for _, tile in TILES if grouped_applies(hidden, rows, tile)]


def every_tile_takes(rows) -> bool:
    """Whether the grouped kernels read ``rows``' codes (``RowExperts`` or ``PackedBlocks``) as they lie at every tile
    (``TILES``): int8 codes whose scale groups each tile's block_k takes. The format half of ``grouped_applies``,
    asked of weights before any activation exists (the GPU budget's residents, the split's staging)."""
    return all(None not in _formats(rows, tile[2]) for _, tile in TILES)


def grouped_applies(hidden: torch.Tensor, rows, tile: Optional[tuple] = None) -> bool:
    """Whether ``triton_grouped_forward`` takes this call: CUDA (or Triton's interpreter on CPU tensors), bf16 or
    fp16 activations, int8 codes for w13 and w2 in a group the tile takes."""
    if not triton_available() or hidden.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not on_kernel_device(hidden):
        return False
    f13, f2 = _formats(rows, (tile or tile_for(1.0))[2])
    return f13 is not None and f2 is not None


def triton_grouped_forward(hidden: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor, rows,
                           activation: str = "silu", tile: Optional[tuple] = None) -> torch.Tensor:
    """hidden [T, H] bf16/fp16 (CUDA), slots [T, K] (index into the n experts, -1: not here), topk_weights [T, K],
    rows: ``RowExperts`` with int8 codes, or ``PackedBlocks`` (int8 in kt.pack_int8's blocks, read as they are)
    -> [T, H] in hidden's dtype. ``tile``: (block_m, block_n, block_k, num_warps, num_stages), ``tile_for`` the
    average rows an expert unless a benchmark compares others."""
    if not triton_available():
        raise RuntimeError("triton_grouped_forward: Triton is not installed")
    if not on_kernel_device(hidden):
        raise ValueError(f"triton_grouped_forward: the Triton kernels run on CUDA tensors, hidden is on "
                         f"{hidden.device}")
    if activation not in _ACT_CODES:
        raise ValueError(f"triton_grouped_forward: activation must be one of {tuple(_ACT_CODES)}, got {activation!r}")
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"triton_grouped_forward: hidden must be bf16 or fp16, got {hidden.dtype}")
    packed = isinstance(rows, PackedBlocks)
    if rows.w13.dtype != torch.int8 or rows.w2.dtype != torch.int8:
        raise ValueError(f"triton_grouped_forward: int8 codes, got {rows.w13.dtype} and {rows.w2.dtype} (4-bit rows: "
                         "resident_rows' dequantizing path)")
    if packed:
        rows = _float_scales(rows)
        n, two_i, H = _shapes(rows)
        I = two_i // 2
        if (rows.w13.dim() != 5 or rows.w2.shape != (n, H // 16, I // 4, 16, 4) or rows.w13_scales is None
                or rows.w2_scales is None or rows.w13_scales.shape[0] != n or rows.w13_scales.shape[-1] != two_i
                or rows.w2_scales.shape[0] != n or rows.w2_scales.shape[-1] != H or two_i % 64):
            raise ValueError(f"triton_grouped_forward: packed blocks w13 [n, 2I/16, H/4, 16, 4] (2I a multiple of 64) "
                             f"and w2 [n, H/16, I/4, 16, 4] with scales [n, (2,) G, N], got {tuple(rows.w13.shape)}, "
                             f"{tuple(rows.w2.shape)}, scales {None if rows.w13_scales is None else tuple(rows.w13_scales.shape)}"
                             f" and {None if rows.w2_scales is None else tuple(rows.w2_scales.shape)}")
    else:
        if rows.w13.dim() != 3 or rows.w2.dim() != 3:
            raise ValueError(f"triton_grouped_forward: int8 rows w13 [n, 2I, H] and w2 [n, H, I], got "
                             f"{rows.w13.dtype} {tuple(rows.w13.shape)} and {rows.w2.dtype} {tuple(rows.w2.shape)}")
        n, two_i, H = rows.w13.shape
        I = two_i // 2
        if rows.w2.shape != (n, H, I) or rows.w13_scales.shape[:2] != (n, two_i) or rows.w2_scales.shape[:2] != (n, H):
            raise ValueError(f"triton_grouped_forward: w2 [n={n}, H={H}, I={I}] and scales [n, N, ...] for w13 "
                             f"[{n}, {two_i}] and w2 [{n}, {H}], got {tuple(rows.w2.shape)}, "
                             f"{tuple(rows.w13_scales.shape)} and {tuple(rows.w2_scales.shape)}")
    T, K = slots.shape
    if hidden.shape != (T, H) or topk_weights.shape != (T, K):
        raise ValueError(f"triton_grouped_forward: hidden [T, H={H}], slots/topk_weights [T, K]; got "
                         f"{tuple(hidden.shape)}, {tuple(slots.shape)}, {tuple(topk_weights.shape)}")
    bm, bn, bk, nw, ns = tile or tile_for(T * K / n)
    f13, f2 = _formats(rows, bk, floated=packed)
    if f13 is None or f2 is None:
        raise ValueError(f"triton_grouped_forward: the scale groups of w13 and w2 must divide or be divided by "
                         f"block_k={bk} (int8 codes, float32{' or float16' if packed else ''} scales)")
    x = hidden.contiguous()
    s = slots.to(torch.int32).contiguous()
    w = topk_weights.to(torch.float32).contiguous()
    sorted_ids, block_expert = align_by_expert(s, n, bm)
    R = T * K
    dot_f32 = int(not hidden.is_cuda)  # Triton's interpreter (see _tile_product), whose casts to bf16 truncate: h
    h = torch.empty(R, I, dtype=torch.float32 if dot_f32 else hidden.dtype, device=hidden.device)  # kept float32
    y = torch.empty(R, H, dtype=torch.float32, device=hidden.device)
    out = torch.empty(T, H, dtype=hidden.dtype, device=hidden.device)
    blocks = block_expert.numel()
    a13, G13, g13, m13 = f13
    _gate_up_grouped[(blocks * -(-I // bn),)](x, sorted_ids, block_expert, rows.w13, rows.w13_scales, h, R, K, n, H,
                                              I, G13, GROUP=g13, MODE=m13, AFFINE=int(a13),
                                              ACT=_ACT_CODES[activation], DOT_F32=dot_f32, PACKED=int(packed),
                                              BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
    a2, G2, g2, m2 = f2
    _down_grouped[(blocks * -(-H // bn),)](h, sorted_ids, block_expert, w, rows.w2, rows.w2_scales, y, R, n, H, I, G2,
                                           GROUP=g2, MODE=m2, AFFINE=int(a2), DOT_F32=dot_f32, PACKED=int(packed),
                                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
    _sum_slots[(T, -(-H // BLOCK_SUM))](y, s, out, H, K, BLOCK=BLOCK_SUM)
    return out
