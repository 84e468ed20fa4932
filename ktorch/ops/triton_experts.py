"""Fused decode kernels for resident experts in the row layout (ktorch/ops/resident_rows.py), in Triton.

    h[t, k]  = act(x_t @ gate_s^T) * (x_t @ up_s^T)          s = slots[t, k], gate/up rows of w13 [n, 2I, H]
    y[t, k]  = w[t, k] * (h[t, k] @ down_s^T)                down rows of w2 [n, H, I]; 0 where s = -1
    out[t]   = sum_k y[t, k]                                 in slot order (no atomics: the same bits every replay)

Three kernels: ``gate_up`` (one program per (token, slot) row and ``BLOCK_N`` output channels: reads those
channels' gate and up code rows and their scales once, dequantizes in registers, float32 dot products, writes h in
float32), ``down`` (one program per (token, slot) row and BLOCK_N channels of H: y), then ``sum_slots`` (out[t] = the
slots' y summed in slot order, rounded once to hidden's dtype). Before them, ``triton_route`` (one program) maps the
router's expert ids to resident slots and the CPU op's ids and counts hits. A decode step replays these four
kernels per resident layer where the ATen ops they replace launched ~19 (slot lookup, masks, the hit counter's
sums, dtype conversions, the slot sum and its cast). The codes
are read once and no bf16 weights are ever written: at Qwen3-30B-A3B's shape (H 2048, I 768, K 8) a decode token
reads 37.7 MB of int8 and 4.7 MB of float32 scales per layer (int8, a scale per 32), 18.9 MB of nibbles and 4.7 MB
of scales (int4, a scale per 32; 1.2 MB at 128) or 9.4 MB of scales and minimums (Q4_K), where the packed layout's
path moves about 288 MB (gather copies, bf16 dequantized weights written and read again). Slots of -1 load nothing.

Formats (constexprs, one per kernel: w13 and w2 may differ, as in a Q4_K_M layer): ``BITS`` 8 (int8 codes) or 4
(uint8 bytes of two codes: byte 4o + b of a row holds column 8o + b in its low nibble and 8o + 4 + b in its high
one; the activations are loaded at those columns, so the nibbles are never reordered); ``AFFINE`` 0 (w = s * q,
4-bit codes stored + 8) or 1 (w = s * q - m, the row's minimums after its scales). Per group the kernels sum q * x
(and for affine x) over the group and apply s (and m) once: s * sum(q x) - m * sum(x).

Limits: float32 scales [n, N, G] or [n, N, 2, G] (G dividing the row length; 4-bit groups whole bytes); CUDA
tensors (or CPU tensors under Triton's interpreter, TRITON_INTERPRET=1, for tests); Triton imported if present, so
this module imports anywhere and fails on use with a clear error. A tile loads ``BLOCK_K`` bytes of each row (int8:
columns; 4-bit: twice as many). Scales are applied per tile as the group size allows (``scales_mode``): one per row
when a group spans whole tiles (per channel), per group when whole groups fit a tile (Q8_0's 32, Q6_K's 16, the
4-bit 32 and 128), else one per element (any group size, slower).
Numerics: float32 sums throughout, one rounding at the end; ``packed_experts_forward`` (the packed layout's path)
rounds the dequantized weights, h and each slot's output to bf16, so the two agree within bf16 rounding, not bit for
bit (tests against a float64 reference).
"""

import os
from typing import Optional

import torch  # no "from __future__ import annotations": Triton reads the tl.constexpr annotations

# The tile per format (code bits -> BLOCK_N output channels a program, BLOCK_K bytes of a row a load, NUM_WARPS).
# int8, measured on an H200 (2026-11-26, benchmarks/bench_resident_decode.py: one Qwen3-30B-A3B layer, 128 int8
# residents, scale per 32, top-8, in a CUDA graph; us a layer at T=1 / T=4): 8/256/4 24.7 / 63.9, 16/256/4
# 27.2 / 66.6, 4/512/4 27.0, 16/512/8 26.0 / 68.7, 32/128/4 46.8 / 75.6.
# 4-bit (the same day and machine kind, `bench_resident_decode.py --formats int4 q4_k --tokens 1 4 --tiles 8/256/4`):
# 8/128/4, which loads the same 256 columns a tile as int8's tile, int4 23.1 / 66.2 us against 8/256/4's 24.6 / 76.6,
# Q4_K 26.4 against 29.3 at T=1 (the packed path: 422-434 us at T=1).
TILES = {8: (8, 256, 4), 4: (8, 128, 4)}
BLOCK_N, BLOCK_K, NUM_WARPS = TILES[8]  # 8*768/8 = 768 gate/up programs and 8*2048/8 = 2048 down programs at T=1
_ACT_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}


try:  # a dependency on GPU machines only (it comes with CUDA builds of torch)
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def row_format(codes: torch.Tensor, scales: torch.Tensor) -> tuple:
    """(bits, affine) of one projection in the row layout: int8 codes 8 bits, uint8 4 (two a byte); affine when the
    scales hold minimums too ([n, N, 2, G])."""
    if codes.dtype not in (torch.int8, torch.uint8) or scales is None or scales.dim() not in (3, 4):
        got = None if scales is None else tuple(scales.shape)
        raise ValueError(f"row_format: row-layout codes are int8 or uint8 with float32 scales [n, N, G] or "
                         f"[n, N, 2, G], got {codes.dtype} with scales {got}")
    return (8 if codes.dtype == torch.int8 else 4), scales.dim() == 4


def triton_available() -> bool:
    return triton is not None


# Host-side grid and block sizes in plain integers: recent Triton makes ``triton.cdiv`` and
# ``triton.next_power_of_2`` constexpr functions whose host call costs ~11 us each (Triton 3.9 here), several a layer
# on an eager prefill's launching thread, which bounds it (docs/prefill_streaming.md).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (Triton's own TRITON_INTERPRET=1): then they take CPU tensors."""
    if triton is None:
        return False
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_kernel_device(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is one the Triton kernels run on: CUDA, or the CPU under Triton's interpreter (tests)."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def kernel_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``'s device: Triton present and ``on_kernel_device``."""
    return triton is not None and on_kernel_device(t)


# Programmatic dependent launch (sm_90 and later): the decode step's Triton kernels (route, gate_up, down, sum_slots
# here; the router's top-k, triton_router.py; the KV write, triton_kv_write.py) are launched so that the GPU may
# schedule a kernel while the one before it drains; each waits for that one's completion (gdc_wait) before it touches
# memory, then lets the next one be scheduled (once every program of this one has started). Read at launch: a capture
# records it. Device, session 53 (H200 host, 12-layer near-uniform Q8_0 file, every expert resident, captured decode,
# bench_generate --ab-variants default pdl, 2 runs each): 974.0 / 976.4 against 954.8 / 954.3 tok/s (+2.2%).
# False (the tests' comparison): plain launches.
PDL = True
_PDL_DEVICES: dict = {}


def pdl_options(t: torch.Tensor) -> dict:
    """The launch options of a decode kernel on ``t``'s device: {"PDL": 1, "launch_pdl": True} where ``PDL`` is on
    and the device is a CUDA one of compute capability 9 or more (not under the interpreter), else {}."""
    if not PDL or not t.is_cuda or interpreting():
        return {}
    if t.device not in _PDL_DEVICES:
        _PDL_DEVICES[t.device] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return {"PDL": 1, "launch_pdl": True} if _PDL_DEVICES[t.device] else {}


if triton is not None:

    @triton.jit
    def pdl_prologue(PDL: tl.constexpr):
        """A PDL-launched kernel's first instructions (``pdl_options``): wait until its predecessor has completed and
        its writes are visible, then let the next kernel be scheduled; nothing where ``PDL`` is 0."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

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
    def _load_x(x_row, kb0, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
        # (v_lo, v_hi) [BLOCK_K] float32: the activations the tile's bytes [kb0, kb0 + BLOCK_K) multiply, 0 past K
        # columns. int8: byte j is column j (v_hi = v_lo, unused); 4-bit: byte 4o + b holds columns 8o + b (low
        # nibble) and 8o + 4 + b (high)
        offs_b = kb0 + tl.arange(0, BLOCK_K)
        if BITS == 8:
            v_lo = tl.load(x_row + offs_b, mask=offs_b < K, other=0.0).to(tl.float32)
            v_hi = v_lo
        else:
            col = 2 * offs_b - offs_b % 4
            v_lo = tl.load(x_row + col, mask=col < K, other=0.0).to(tl.float32)
            v_hi = tl.load(x_row + col + 4, mask=col < K, other=0.0).to(tl.float32)
        return v_lo, v_hi

    @triton.jit
    def _tile_products(q_rows, row_mask, v_lo, v_hi, offs, KB, BITS: tl.constexpr, AFFINE: tl.constexpr):
        # (p [BLOCK_N, BLOCK_K] the codes times the activations, xv [BLOCK_K] the activations each byte multiplies
        # (summed over its two nibbles), m the tile's mask) over bytes ``offs``, before the scales
        m = row_mask[:, None] & (offs < KB)[None, :]
        if BITS == 8:
            p = tl.load(q_rows[:, None] + offs[None, :], mask=m, other=0).to(tl.float32) * v_lo[None, :]
            xv = v_lo
        else:  # masked bytes: scales 0 (rows) or activations 0 (columns), whatever the nibbles
            b = tl.load(q_rows[:, None] + offs[None, :], mask=m, other=0)
            lo = (b & 15).to(tl.float32)
            hi = (b >> 4).to(tl.float32)
            if AFFINE == 0:  # symmetric int4 codes are stored + 8
                lo = lo - 8.0
                hi = hi - 8.0
            p = lo * v_lo[None, :] + hi * v_hi[None, :]
            xv = v_lo + v_hi
        return p, xv, m

    @triton.jit
    def _scaled_terms(p, xv, m, s_rows, offs, G, GROUP: tl.constexpr, AFFINE: tl.constexpr):
        # [BLOCK_N, BLOCK_K] the products scaled element by element (any group size; cached loads), minus the
        # minimums' terms (affine)
        gk = (offs // GROUP)[None, :]
        w = p * tl.load(s_rows[:, None] + gk, mask=m, other=0.0)
        if AFFINE == 1:
            w = w - tl.load(s_rows[:, None] + G + gk, mask=m, other=0.0) * xv[None, :]
        return w

    @triton.jit
    def _tile_dot(q_rows, s_rows, row_mask, v_lo, v_hi, kb0, KB, G, GROUP: tl.constexpr, MODE: tl.constexpr,
                  BITS: tl.constexpr, AFFINE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # [BLOCK_N] float32: the rows' weights over bytes [kb0, kb0 + BLOCK_K) times the activations (v_lo, v_hi
        # from _load_x); q_rows/s_rows [BLOCK_N] pointers to the rows' codes and scales (minimums G further),
        # row_mask [BLOCK_N], KB bytes a row, GROUP bytes a scale covers
        offs = kb0 + tl.arange(0, BLOCK_K)
        p, xv, m = _tile_products(q_rows, row_mask, v_lo, v_hi, offs, KB, BITS, AFFINE)
        if MODE == 0:  # a scale group spans whole tiles: one scale (and minimum) per row
            s = tl.load(s_rows + kb0 // GROUP, mask=row_mask, other=0.0)
            out = tl.sum(p, axis=1) * s
            if AFFINE == 1:
                mn = tl.load(s_rows + G + kb0 // GROUP, mask=row_mask, other=0.0)
                out = out - mn * tl.sum(xv, axis=0)
        elif MODE == 1:  # whole groups in a tile: sum each group, then scale
            gi = kb0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            gm = row_mask[:, None] & (gi < G)[None, :]
            s = tl.load(s_rows[:, None] + gi[None, :], mask=gm, other=0.0)
            out = tl.sum(tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // GROUP, GROUP)), axis=2) * s, axis=1)
            if AFFINE == 1:
                mn = tl.load(s_rows[:, None] + G + gi[None, :], mask=gm, other=0.0)
                xg = tl.sum(tl.reshape(xv, (BLOCK_K // GROUP, GROUP)), axis=1)
                out = out - tl.sum(mn * xg[None, :], axis=1)
        else:  # any group size: a scale per element
            out = tl.sum(_scaled_terms(p, xv, m, s_rows, offs, G, GROUP, AFFINE), axis=1)
        return out

    @triton.jit
    def _gate_up(x_ptr, slots_ptr, q_ptr, s_ptr, h_ptr, n_slots, H, I, G, GROUP: tl.constexpr, MODE: tl.constexpr,
                 BITS: tl.constexpr, AFFINE: tl.constexpr, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0):
        pdl_prologue(PDL)
        row = tl.program_id(0)  # t * n_slots + k
        t = row // n_slots
        slot = tl.load(slots_ptr + row)
        e = tl.maximum(slot, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < I
        # an absent slot loads nothing (the slot splat to [BLOCK_N] first: Triton's interpreter mishandles a scalar
        # mask broadcast into a load mask)
        row_mask = mask_n & (tl.zeros([BLOCK_N], dtype=tl.int32) + slot >= 0)
        if BITS == 8:
            KB = H
        else:
            KB = H // 2
        if AFFINE == 1:
            SG = 2 * G
        else:
            SG = G
        gate_q = q_ptr + e * 2 * I * KB + offs_n.to(tl.int64) * KB
        gate_s = s_ptr + e * 2 * I * SG + offs_n.to(tl.int64) * SG
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for kb0 in range(0, KB, BLOCK_K):
            v_lo, v_hi = _load_x(x_ptr + t * H, kb0, H, BITS, BLOCK_K)
            acc_g += _tile_dot(gate_q, gate_s, row_mask, v_lo, v_hi, kb0, KB, G, GROUP, MODE, BITS, AFFINE,
                               BLOCK_N, BLOCK_K)
            acc_u += _tile_dot(gate_q + I * KB, gate_s + I * SG, row_mask, v_lo, v_hi, kb0, KB, G, GROUP, MODE,
                               BITS, AFFINE, BLOCK_N, BLOCK_K)
        tl.store(h_ptr + row * I + offs_n, _act(acc_g, ACT) * acc_u, mask=mask_n)

    @triton.jit
    def _down(h_ptr, slots_ptr, w_ptr, q_ptr, s_ptr, y_ptr, H, I, G, GROUP: tl.constexpr, MODE: tl.constexpr,
              BITS: tl.constexpr, AFFINE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PDL: tl.constexpr = 0):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        slot = tl.load(slots_ptr + row)
        e = tl.maximum(slot, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < H
        row_mask = mask_n & (tl.zeros([BLOCK_N], dtype=tl.int32) + slot >= 0)
        if BITS == 8:
            KB = I
        else:
            KB = I // 2
        if AFFINE == 1:
            SG = 2 * G
        else:
            SG = G
        q_rows = q_ptr + e * H * KB + offs_n.to(tl.int64) * KB
        s_rows = s_ptr + e * H * SG + offs_n.to(tl.int64) * SG
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for kb0 in range(0, KB, BLOCK_K):
            v_lo, v_hi = _load_x(h_ptr + row * I, kb0, I, BITS, BLOCK_K)
            acc += _tile_dot(q_rows, s_rows, row_mask, v_lo, v_hi, kb0, KB, G, GROUP, MODE, BITS, AFFINE,
                             BLOCK_N, BLOCK_K)
        coef = tl.where(slot >= 0, tl.load(w_ptr + row).to(tl.float32), 0.0)
        tl.store(y_ptr + row * H + offs_n, acc * coef, mask=mask_n)

    @triton.jit(do_not_specialize=["n"])  # n = T * K: one compile for every prompt length
    def _route(ids_ptr, slot_of_ptr, slots_ptr, cpu_ids_ptr, hits_ptr, n, COUNT: tl.constexpr, BLOCK: tl.constexpr,
               PDL: tl.constexpr = 0):
        pdl_prologue(PDL)
        # one program over the n (token, slot) pairs: slots = slot_of[id] (-1 for id < 0 or an expert not held),
        # cpu_ids = id where the slot is not held, else -1; hits += routed pairs << 32 | held pairs
        total = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            e = tl.load(ids_ptr + offs, mask=m, other=-1)
            routed = m & (e >= 0)
            s = tl.load(slot_of_ptr + tl.maximum(e, 0), mask=routed, other=-1)
            tl.store(slots_ptr + offs, s, mask=m)
            tl.store(cpu_ids_ptr + offs, tl.where(s >= 0, -1, e), mask=m)
            if COUNT:
                total += tl.where(routed, 4294967296, 0).to(tl.int64) + tl.where(s >= 0, 1, 0).to(tl.int64)
        if COUNT:
            tl.store(hits_ptr, tl.load(hits_ptr) + tl.sum(total, axis=0))

    @triton.jit
    def _sum_slots(y_ptr, out_ptr, K, H, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
        # out[t] = sum_k y[t, k] in slot order, float32, rounded once to out's dtype
        pdl_prologue(PDL)
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < H
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in range(0, K):
            acc += tl.load(y_ptr + (t * K + k) * H + offs, mask=m, other=0.0)
        tl.store(out_ptr + t * H + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


ROUTE_BLOCK = 256  # pairs a loop of _route (a decode call has T * K <= 16 * K)


def route_applies(ids: torch.Tensor) -> bool:
    """Whether ``triton_route`` runs for these ids: Triton present, CUDA tensors (or CPU ones under the interpreter:
    tests), not under Dynamo's trace (there the same ops in ATen are traced and fused by Inductor)."""
    if triton is None or torch.compiler.is_compiling():
        return False
    return on_kernel_device(ids)


def triton_route(ids: torch.Tensor, slot_of: torch.Tensor, hits: Optional[torch.Tensor] = None) -> tuple:
    """One kernel for what the resident split does with ~11 small ATen kernels a layer (a decode step's launches add
    up: 48 layers): ids [T, K] integer (-1: no expert), slot_of [E] integer (an expert's index among the residents,
    -1: not held) -> (slots [T, K] in slot_of's dtype, -1 where not held; cpu_ids [T, K] in ids' dtype, the ids of
    the pairs not held, -1 elsewhere). ``hits`` (int64 0-d): += routed pairs << 32 | held pairs (``kt_gpu_hits``).
    Shape-static, no host sync (CUDA-graph capturable)."""
    if ids.dim() != 2 or slot_of.dim() != 1 or ids.dtype.is_floating_point or slot_of.dtype.is_floating_point:
        raise ValueError(f"triton_route: ids [T, K] and slot_of [E] integer tensors, got {ids.dtype} "
                         f"{tuple(ids.shape)} and {slot_of.dtype} {tuple(slot_of.shape)}")
    if slot_of.device != ids.device or (hits is not None and (hits.device != ids.device or hits.dtype != torch.int64
                                                              or hits.dim() != 0)):
        raise ValueError(f"triton_route: ids, slot_of and hits (int64, 0-d) on one device, got {ids.device}, "
                         f"{slot_of.device}, {None if hits is None else (hits.device, hits.dtype, hits.dim())}")
    ids = ids.contiguous()
    slot_of = slot_of.contiguous()
    slots = torch.empty(ids.shape, dtype=slot_of.dtype, device=ids.device)
    cpu_ids = torch.empty_like(ids)
    _route[(1,)](ids, slot_of, slots, cpu_ids, slots if hits is None else hits, ids.numel(), COUNT=hits is not None,
                 BLOCK=ROUTE_BLOCK, **pdl_options(ids))
    return slots, cpu_ids


def scales_mode(group: int, block_k: int) -> int:
    """How a tile applies the scales (``_tile_dot``), ``group`` and ``block_k`` in bytes of codes: 0 a group spans
    whole tiles, 1 whole groups in a tile (powers of two), 2 a scale per element (any group size)."""
    if group % block_k == 0:
        return 0
    if block_k % group == 0 and group & (group - 1) == 0:
        return 1
    return 2


def _kernel_format(codes: torch.Tensor, scales: torch.Tensor, K: int, name: str) -> tuple:
    """(bits, affine, G, bytes a scale group covers) of one projection's rows (K columns a row)."""
    bits, affine = row_format(codes, scales)
    G = scales.shape[-1]
    if scales.dtype != torch.float32 or K % G or (bits == 4 and (K // G) % 8) or (affine and scales.shape[-2] != 2):
        raise ValueError(f"triton_rows_forward: {name} scales must be float32 [n, N, G] (or [n, N, 2, G]) with G "
                         f"dividing K={K} (4-bit: groups of multiples of 8); got {scales.dtype} {tuple(scales.shape)}")
    return bits, affine, G, K // G * bits // 8


def triton_rows_forward(hidden: torch.Tensor, slots: torch.Tensor, topk_weights: torch.Tensor, rows,
                        activation: str = "silu", tiles: Optional[tuple] = None) -> torch.Tensor:
    """hidden [T, H] (CUDA), slots [T, K] (-1: not resident), topk_weights [T, K], rows: ``RowExperts`` (int8 or
    4-bit codes with float32 scales, symmetric or affine, w13 and w2 each its own format) -> [T, H] in hidden's
    dtype. Shape-static and free of host syncs (CUDA-graph capturable). ``tiles``: ((block_n, block_k, num_warps,
    num_stages) of _gate_up, the same of _down) (powers of two; block_k in bytes of codes; num_stages None: Triton's
    default), each kernel's format's ``TILES`` entry unless a benchmark compares others
    (benchmarks/bench_resident_decode.py --tiles)."""
    if not on_kernel_device(hidden):
        raise ValueError(f"triton_rows_forward: the Triton kernels run on CUDA tensors, hidden is on {hidden.device}")
    if not triton_available():
        raise RuntimeError("triton_rows_forward: Triton is not installed (residents without it stay in the packed "
                           "layout: ktorch/ops/resident_rows.py row_layout_applies)")
    if activation not in _ACT_CODES:
        raise ValueError(f"triton_rows_forward: activation must be one of {tuple(_ACT_CODES)}, got {activation!r}")
    if rows.w13.dim() != 3 or rows.w2.dim() != 3:
        raise ValueError(f"triton_rows_forward: w13 [n, 2I, H(/2)] and w2 [n, H, I(/2)], got "
                         f"{tuple(rows.w13.shape)} and {tuple(rows.w2.shape)}")
    n, two_i, kb13 = rows.w13.shape
    I = two_i // 2
    H = kb13 * (1 if rows.w13.dtype == torch.int8 else 2)
    T, K = slots.shape
    kb2 = I if rows.w2.dtype == torch.int8 else I // 2
    if hidden.shape != (T, H) or rows.w2.shape != (n, H, kb2) or topk_weights.shape != (T, K):
        raise ValueError(f"triton_rows_forward: hidden [T, H={H}], slots/topk_weights [T, K], w2 [n, H, I={I}] (I/2 "
                         f"bytes for 4-bit codes); got {tuple(hidden.shape)}, {tuple(slots.shape)}, "
                         f"{tuple(topk_weights.shape)}, {tuple(rows.w2.shape)} {rows.w2.dtype}")
    b13, a13, G13, g13 = _kernel_format(rows.w13, rows.w13_scales, H, "w13")
    b2, a2, G2, g2 = _kernel_format(rows.w2, rows.w2_scales, I, "w2")
    if rows.w13_scales.shape[:2] != (n, two_i) or rows.w2_scales.shape[:2] != (n, H):
        raise ValueError(f"triton_rows_forward: scales [n, N, ...] for w13 [{n}, {two_i}] and w2 [{n}, {H}], got "
                         f"{tuple(rows.w13_scales.shape)} and {tuple(rows.w2_scales.shape)}")
    # no conversion kernels (a decode step launches each of these per layer): the kernels load int32/int64 slots and
    # any float weights as they are
    x = hidden.contiguous()
    s = slots.contiguous() if slots.dtype in (torch.int32, torch.int64) else slots.to(torch.int32).contiguous()
    w = topk_weights.contiguous() if topk_weights.is_floating_point() else topk_weights.float().contiguous()
    h = torch.empty(T * K, I, dtype=torch.float32, device=hidden.device)
    y = torch.empty(T, K, H, dtype=torch.float32, device=hidden.device)
    (bn, bk, nw, ns), (bn2, bk2, nw2, ns2) = tiles or ((*TILES[b13], None), (*TILES[b2], None))
    stages = {} if ns is None else {"num_stages": ns}
    _gate_up[(T * K, -(-I // bn))](x, s, rows.w13, rows.w13_scales, h, K, H, I, G13, GROUP=g13,
                                   MODE=scales_mode(g13, bk), BITS=b13, AFFINE=int(a13),
                                   ACT=_ACT_CODES[activation], BLOCK_N=bn, BLOCK_K=bk,
                                   num_warps=nw, **stages, **pdl_options(x))
    stages = {} if ns2 is None else {"num_stages": ns2}
    _down[(T * K, -(-H // bn2))](h, s, w, rows.w2, rows.w2_scales, y, H, I, G2, GROUP=g2, MODE=scales_mode(g2, bk2),
                                 BITS=b2, AFFINE=int(a2), BLOCK_N=bn2, BLOCK_K=bk2,
                                 num_warps=nw2, **stages, **pdl_options(x))
    out = torch.empty(T, H, dtype=hidden.dtype, device=hidden.device)
    _sum_slots[(T, -(-H // 1024))](y, out, K, H, BLOCK=1024, **pdl_options(y))
    return out
