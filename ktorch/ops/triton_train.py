"""Triton kernels of the GPU training path (ktorch/ops/train_experts.py, the expert adapters of ktorch/lora.py).

**Dequantizing packed experts** (``dequantize_rows``): int8 codes with float32 scales, or bf16, in the packed
layout [n, N/16, K/per, 16, per] -> [n, N, K] rows of ``dtype`` (w = q * s in float32, rounded once: the values of
``dequantize_packed``'s torch passes, bit for bit). One pass: a program reads one 16-row block's bytes for
``BLOCK_KW`` k steps (contiguous in the packed layout), transposes them in registers and writes the rows, the
gate/up interleave undone on the way (packed row 64b + 32h + 16c + r is row h N/2 + 32b + 16c + r). The torch
passes moved the bytes twice (a 4-byte word copy into row order, then the scale pass): on the device's H200 one
Qwen3-30B-A3B int8 layer took 3.2 ms (w13 2.1, w2 1.1) against ~0.5 ms of bytes at its bandwidth.

**Per-pair adapter products** (``pair_expand``, ``pair_contract``, ``segment_outer``): an expert adapter's factor
for pair p (token t, slot k, expert e = ids[p]) is an r x m block of a dense parameter, element (e, j, c) at
``e * se + j * sj + c * sc`` (peft's layout: lora_A [r E, in] row e r + j, lora_B [out, r E] column j E + e). The
dense products they replace multiplied every pair by every expert's block ([T K, r E] x [r E, m]: E times the work,
the zeros included): 5-9 ms a Qwen3-30B-A3B layer in float32 on the H200 (session 39's profile). Here each pair
reads only its expert's block (from L2: a layer's adapter is a few MB), in float32 with float32 sums (the
parameters' dtype, as peft computes):

    pair_expand(u [P, r], ids [P], W) -> [P, m]          out[p, c] = sum_j u[p, j] W(e_p, j, c)
    pair_contract(x [X, m], ids [P], W, rows) -> [P, r]  out[p, j] = sum_c W(e_p, j, c) x[p // rows, c]
    segment_outer(a [P, r], b [X, m], ids, order, offs, rows, W) -> dW    dW(e, j, c) = sum_{p: e_p = e} a[p, j]
                                                                                         b[p // rows, c]

(``rows``: pairs per row of x, K when x holds one row a token shared by its slots.) ``segment_outer`` is the weight
gradient of both: it walks each expert's pairs (``order`` sorts the pairs by expert, ``offs`` the groups' ends),
no atomics, so the same bits every run.

Limits: CUDA tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, for tests); Triton imported if
present, so this module imports anywhere (callers check ``kernel_runs_on``).
"""

from typing import Optional

import torch  # no "from __future__ import annotations": Triton reads the tl.constexpr annotations

from ktorch.ops.triton_experts import cdiv, interpreting, kernel_runs_on, next_power_of_2, triton  # noqa: F401

_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _dequant_rows(packed_ptr, scales_ptr, out_ptr, N, K, KW, G, GS, PER: tl.constexpr, BLOCK_KW: tl.constexpr,
                      GATE_UP: tl.constexpr, SCALED: tl.constexpr):
        pid = tl.program_id(0)  # n * (N / 16) + row block
        kb = tl.program_id(1)
        NB = N // 16
        e = pid // NB
        nb = pid % NB
        BK: tl.constexpr = BLOCK_KW * PER
        # the block's bytes for k steps [kb BLOCK_KW, (kb + 1) BLOCK_KW): [BLOCK_KW, 16, PER], contiguous
        src = packed_ptr + (pid.to(tl.int64) * KW + kb * BLOCK_KW) * 16 * PER
        q = tl.load(src + tl.arange(0, BLOCK_KW * 16 * PER))
        q = tl.reshape(tl.permute(tl.reshape(q, (BLOCK_KW, 16, PER)), (1, 0, 2)), (16, BK))  # [row, k]
        r = tl.arange(0, 16)
        k = kb * BK + tl.arange(0, BK)
        prow = nb * 16 + r  # the row in packed order
        if SCALED:
            s = tl.load(scales_ptr + e.to(tl.int64) * G * N + (k // GS)[None, :] * N + prow[:, None])
            w = q.to(tl.float32) * s
        else:
            w = q
        if GATE_UP:  # packed row 64b + 32h + 16c + r -> h N/2 + 32b + 16c + r
            row = ((nb // 2) % 2) * (N // 2) + (nb // 4) * 32 + (nb % 2) * 16 + r
        else:
            row = prow
        dst = out_ptr + e.to(tl.int64) * N * K + row[:, None].to(tl.int64) * K + k[None, :]
        tl.store(dst, w.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _pair_expand(u_ptr, ids_ptr, w_ptr, out_ptr, P, M, se, sj, sc, R: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_M: tl.constexpr):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        c = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        pm = p < P
        mask = pm[:, None] & (c < M)[None, :]
        e = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int64)
        acc = tl.zeros((BLOCK_P, BLOCK_M), dtype=tl.float32)
        for j in tl.static_range(R):
            uj = tl.load(u_ptr + p.to(tl.int64) * R + j, mask=pm, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + e[:, None] * se + j * sj + c[None, :].to(tl.int64) * sc, mask=mask, other=0.0)
            acc += uj[:, None] * w.to(tl.float32)
        tl.store(out_ptr + p[:, None].to(tl.int64) * M + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _pair_contract(x_ptr, ids_ptr, w_ptr, out_ptr, P, M, ROWS, se, sj, sc, R: tl.constexpr, RP: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        pm = p < P
        j = tl.arange(0, RP)
        e = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int64)
        xrow = (p // ROWS).to(tl.int64)
        acc = tl.zeros((BLOCK_P, RP), dtype=tl.float32)
        for m0 in range(0, M, BLOCK_M):
            c = m0 + tl.arange(0, BLOCK_M)
            cm = c < M
            x = tl.load(x_ptr + xrow[:, None] * M + c[None, :], mask=pm[:, None] & cm[None, :], other=0.0)
            wmask = pm[:, None, None] & (j < R)[None, :, None] & cm[None, None, :]
            w = tl.load(w_ptr + e[:, None, None] * se + j[None, :, None] * sj + c[None, None, :].to(tl.int64) * sc,
                        mask=wmask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[:, None, :], axis=2)
        tl.store(out_ptr + p[:, None].to(tl.int64) * R + j[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=pm[:, None] & (j < R)[None, :])

    @triton.jit
    def _segment_outer(a_ptr, b_ptr, order_ptr, offs_ptr, out_ptr, M, ROWS, se, sj, sc, R: tl.constexpr,
                       RP: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
        e = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cm = c < M
        j = tl.arange(0, RP)
        jm = j < R
        start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
        end = tl.load(offs_ptr + e)
        acc = tl.zeros((RP, BLOCK_M), dtype=tl.float32)
        for q0 in range(start, end, BLOCK_P):
            q = q0 + tl.arange(0, BLOCK_P)
            qm = q < end
            p = tl.load(order_ptr + q, mask=qm, other=0).to(tl.int64)
            a = tl.load(a_ptr + p[:, None] * R + j[None, :], mask=qm[:, None] & jm[None, :], other=0.0)
            b = tl.load(b_ptr + (p // ROWS)[:, None] * M + c[None, :], mask=qm[:, None] & cm[None, :], other=0.0)
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[:, None, :], axis=0)
        dst = out_ptr + e.to(tl.int64) * se + j[:, None] * sj + c[None, :].to(tl.int64) * sc
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=jm[:, None] & cm[None, :])


def _need_triton(name: str) -> None:
    if triton is None:
        raise RuntimeError(f"{name}: Triton is not installed (it comes with CUDA builds of torch)")


def dequantize_rows_applies(packed: torch.Tensor, scales: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """Whether ``dequantize_rows`` takes these packed weights: int8 codes with float32 scales [n, G, N] or bf16
    without, contiguous, on a device the kernel runs on, to a bf16/fp16/fp32 result, K a multiple of 16 k steps
    and the scale groups whole k steps."""
    if not kernel_runs_on(packed) or dtype not in _OUT_DTYPES or packed.dim() != 5 or packed.shape[3] != 16:
        return False
    if not packed.is_contiguous() or packed.shape[2] % 16:
        return False
    if packed.dtype == torch.bfloat16:
        return scales is None
    if packed.dtype != torch.int8 or scales is None or scales.dtype != torch.float32 or scales.dim() != 3:
        return False
    n, N, K = packed.shape[0], packed.shape[1] * 16, packed.shape[2] * 4
    G = scales.shape[1]
    return scales.shape == (n, G, N) and scales.is_contiguous() and K % G == 0 and (K // G) % 4 == 0


def dequantize_rows(packed: torch.Tensor, scales: Optional[torch.Tensor], gate_up: bool, dtype: torch.dtype,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``dequantize_packed`` for what ``dequantize_rows_applies`` takes, in one kernel: [n, N, K] rows of ``dtype``
    (``out`` if given: contiguous [n, N, K] of dtype on packed's device), returned as that buffer (not transposed)."""
    _need_triton("dequantize_rows")
    if not dequantize_rows_applies(packed, scales, dtype):
        raise ValueError("dequantize_rows: these packed weights are not int8 + scales / bf16 on a kernel device")
    n, NB, KW, _, per = packed.shape
    N, K = NB * 16, KW * per
    if out is None:
        out = torch.empty(n, N, K, dtype=dtype, device=packed.device)
    if n == 0 or N == 0 or K == 0:
        return out
    G = scales.shape[1] if scales is not None else 1
    block_kw = next(b for b in (64, 32, 16) if KW % b == 0)
    # Triton's interpreter (tests on CPU tensors) truncates casts to 16-bit floats: it writes float32 there, rounded
    # by torch, so that the values are what the kernel writes on a GPU (float32 products, rounded once)
    target = out if out.dtype == torch.float32 or not interpreting() else torch.empty(
        out.shape, dtype=torch.float32, device=out.device)
    _dequant_rows[(n * NB, KW // block_kw)](packed, scales if scales is not None else packed, target, N, K, KW, G,
                                            K // G, PER=per, BLOCK_KW=block_kw, GATE_UP=gate_up,
                                            SCALED=scales is not None, num_warps=4)
    if target is not out:
        out.copy_(target)
    return out


def pair_expand(u: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, strides: tuple, m: int) -> torch.Tensor:
    """out [P, m] (u's dtype): out[p, c] = sum_j u[p, j] W(ids[p], j, c), W's element (e, j, c) at ``w``'s flat
    offset e se + j sj + c sc (``strides`` = (se, sj, sc)), float32 sums. u [P, r] contiguous, ids [P] in [0, E)."""
    _need_triton("pair_expand")
    P, R = u.shape
    out = torch.empty(P, m, dtype=u.dtype, device=u.device)
    if P == 0 or m == 0:
        return out
    block_m = min(128, next_power_of_2(m))
    _pair_expand[(cdiv(P, 32), cdiv(m, block_m))](u, ids, w, out, P, m, *strides, R=R, BLOCK_P=32,
                                                  BLOCK_M=block_m, num_warps=4)
    return out


def pair_contract(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, strides: tuple, r: int,
                  rows: int = 1) -> torch.Tensor:
    """out [P, r] (x's dtype): out[p, j] = sum_c W(ids[p], j, c) x[p // rows, c] (``strides`` as in
    ``pair_expand``), float32 sums. x [X, m] contiguous with X = P / rows."""
    _need_triton("pair_contract")
    P, m = ids.shape[0], x.shape[1]
    out = torch.empty(P, r, dtype=x.dtype, device=x.device)
    if P == 0:
        return out
    rp = next_power_of_2(r)
    block_m = max(16, min(64, 512 // rp))
    _pair_contract[(cdiv(P, 16),)](x, ids, w, out, P, m, rows, *strides, R=r, RP=rp, BLOCK_P=16,
                                   BLOCK_M=block_m, num_warps=4)
    return out


def segment_outer(a: torch.Tensor, b: torch.Tensor, order: torch.Tensor, offs: torch.Tensor, strides: tuple,
                  like: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """dW, a contiguous tensor shaped as ``like`` (every element written: an expert without pairs gets zeros):
    dW(e, j, c) = sum over pairs p of expert e of a[p, j] b[p // rows, c], float32
    sums in ``order`` (the pairs sorted by expert, stable) with ``offs`` [E] the groups' cumulative ends.
    a [P, r] and b [X, m] contiguous; ``strides`` (se, sj, sc) into ``like``'s flat storage."""
    _need_triton("segment_outer")
    E = offs.shape[0]
    R, m = a.shape[1], b.shape[1]
    out = torch.empty_like(like, memory_format=torch.contiguous_format)
    if out.numel() == 0:
        return out
    rp = next_power_of_2(R)
    block_m = max(16, min(128, 1024 // rp))
    _segment_outer[(E, cdiv(m, block_m))](a, b, order, offs, out, m, rows, *strides, R=R, RP=rp,
                                          BLOCK_P=16, BLOCK_M=block_m, num_warps=4)
    return out


def sort_pairs(ids: torch.Tensor, E: int) -> tuple:
    """(order, ends): the pairs (ids [P] in [0, E)) sorted by expert, stable, and the groups' cumulative ends [E]
    int64. No host sync (``bincount``'s CUDA kernel reads the ids' maximum on the host)."""
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids.long(), torch.ones_like(ids, dtype=torch.int64))
    return torch.argsort(ids, stable=True), counts.cumsum(0)


class _Expand(torch.autograd.Function):
    """out = pair_expand(u, ids, w): differentiable in u and w."""

    @staticmethod
    def forward(ctx, u, ids, w, strides, E, m):
        ctx.save_for_backward(u, ids, w)
        ctx.strides, ctx.E = strides, E
        return pair_expand(u, ids, w, strides, m)

    @staticmethod
    def backward(ctx, g):
        u, ids, w = ctx.saved_tensors
        g = g.contiguous()
        du = pair_contract(g, ids, w, ctx.strides, u.shape[1]) if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[2]:
            order, offs = sort_pairs(ids, ctx.E)
            dw = segment_outer(u, g, order, offs, ctx.strides, w)
        return du, None, dw, None, None, None


class _Contract(torch.autograd.Function):
    """out = pair_contract(x, ids, w, rows): differentiable in x and w."""

    @staticmethod
    def forward(ctx, x, ids, w, strides, E, r, rows):
        ctx.save_for_backward(x, ids, w)
        ctx.strides, ctx.E, ctx.rows = strides, E, rows
        return pair_contract(x, ids, w, strides, r, rows)

    @staticmethod
    def backward(ctx, g):
        x, ids, w = ctx.saved_tensors
        g = g.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = pair_expand(g, ids, w, ctx.strides, x.shape[1])  # each pair's part of its row's gradient
            if ctx.rows > 1:
                dx = dx.view(x.shape[0], ctx.rows, x.shape[1]).sum(1, dtype=torch.float32).to(x.dtype)
        dw = None
        if ctx.needs_input_grad[2]:
            order, offs = sort_pairs(ids, ctx.E)
            dw = segment_outer(g, x, order, offs, ctx.strides, w, ctx.rows)
        return dx, None, dw, None, None, None, None


def expand_pairs(u: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, strides: tuple, E: int, m: int) -> torch.Tensor:
    """``pair_expand``, differentiable in u and w (the backward: ``pair_contract`` and ``segment_outer``)."""
    return _Expand.apply(u.contiguous(), ids.contiguous(), w, strides, E, m)


def contract_pairs(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, strides: tuple, E: int, r: int,
                   rows: int = 1) -> torch.Tensor:
    """``pair_contract``, differentiable in x and w (the backward: ``pair_expand`` and ``segment_outer``)."""
    return _Contract.apply(x.contiguous(), ids.contiguous(), w, strides, E, r, rows)
