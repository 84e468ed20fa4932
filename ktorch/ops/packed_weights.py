"""Packed experts (``kt.pack_*`` layouts, ktorch/csrc/moe/pack.cpp) back to weights on any device, with plain torch
ops: what the GPU side of streamed, routed and resident experts computes with. No ktorch imports, so every module
that places experts on a device can use it."""

from __future__ import annotations

from typing import Optional

import torch

# MXFP4 experts kept as 4-bit codes (GGUF MXFP4, OpenAI's gpt-oss blocks): the int4 layout [E, N/16, K/8, 16, 4] whose
# nibbles are E2M1 codes, marked by this dtype; each nibble u stands for MXFP4_CODES[u] (the E2M1 value doubled, the
# gguf package's MXFP4.kvalues; kernels.h kMxfp4Codes), times a float32 scale 2**(e - 128) per group of 32.
MXFP4_DTYPE = torch.float4_e2m1fn_x2
MXFP4_CODES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# The dtypes of packed int4-layout weights: plain int4 (u - 8, or u for the affine formats) and MXFP4 nibbles.
INT4_DTYPES = (torch.uint8, MXFP4_DTYPE)


# GGUF K-quant scales at the file's size ("two-level", ``ktorch.ops.moe.pack_kscales``): uint8 (Q4_K, Q5_K: 6-bit sc and m) or
# int8 (Q6_K: sc) [E, G + K/64, N], or [E, 2, G + K/64, N] with minimums: per part, G rows of sub-scales, then the
# float32 super-scales [K/256, N] (d, dmin per 256 input channels) stored as K/64 byte rows; the scale of group g is
# super[g // (G * 256 / K)] * sub[g], exact in float32 (the same value as the float32 per-group form).
# GGUF Q8_0's scales likewise stay the file's float16 d per group (a float16 scales tensor [E, G, N]).
def is_kscales(scales: Optional[torch.Tensor]) -> bool:
    """Whether ``scales`` are at the file's size (two-level K-quant scales, uint8/int8; float16 per group) rather
    than float32 per group."""
    return scales is not None and scales.dtype in (torch.uint8, torch.int8, torch.float16)


def kscales_as_float(scales: Optional[torch.Tensor], K: int) -> Optional[torch.Tensor]:
    """Scales at the file's size (any device: two-level K-quant scales, float16 ones) -> the float32 per-group form
    [E, (2,) G, N], exactly; anything else (float32 scales, None) as it is. K: the input channels of the packed
    weights the scales belong to."""
    if not is_kscales(scales):
        return scales
    if scales.dtype == torch.float16:
        return scales.float()
    S = K // 256
    R = scales.shape[-2]
    if K % 256 or scales.dim() not in (3, 4) or R <= 4 * S or (R - 4 * S) % S:
        raise ValueError(f"kscales_as_float: two-level scales must be [E, (2,) G + K/64, N] with K a multiple of 256 "
                         f"and G of K/256, got {tuple(scales.shape)} for K={K}")
    s = scales if scales.dim() == 4 else scales.unsqueeze(1)
    E, P, _, N = s.shape
    G = R - 4 * S
    sup = s[:, :, G:].contiguous().view(torch.uint8).reshape(E, P, 4 * S * N).view(torch.float32).reshape(E, P, S, N)
    out = sup.repeat_interleave(G // S, dim=2) * s[:, :, :G].float()
    return (out if scales.dim() == 4 else out.squeeze(1)).contiguous()


def packed_in_features(packed: torch.Tensor) -> int:
    """K of packed weights [E, N/16, K/per, 16, per]: per 2 (bf16), 4 (int8), 8 (int4, MXFP4 nibbles)."""
    return packed.shape[2] * (8 if packed.dtype in INT4_DTYPES else 2 if packed.dtype == torch.bfloat16 else 4)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for MXFP4 nibbles its uint8 view (the same shape): copies, selections and transfers of packed
    weights go through it, since torch implements few ops for float4_e2m1fn_x2 (before 2.11, not even every copy)."""
    return t.view(torch.uint8) if t.dtype == MXFP4_DTYPE else t


_MXFP4_TABLES: dict = {}  # device -> MXFP4_CODES as an int8 tensor there


def mxfp4_as_int8(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 nibbles (``MXFP4_DTYPE`` [n, N/16, K/8, 16, 4], any device) -> the same weights as int8 codes in the int8
    layout [n, N/16, K/4, 16, 4] (each nibble's ``MXFP4_CODES`` value; the scales stay as they are): the form the
    device paths (resident rows, ``dequantize_packed``) compute with, and ``kt.fused_moe``'s int8-code form of MXFP4.
    Line o of a block holds k 8o..8o+3 in its low nibbles and 8o+4..8o+7 in its high ones: int8 quads 2o and 2o+1."""
    if packed.dtype != MXFP4_DTYPE or packed.dim() != 5 or packed.shape[3:] != (16, 4):
        raise ValueError(f"mxfp4_as_int8: expected {MXFP4_DTYPE} [n, N/16, K/8, 16, 4], got {packed.dtype} "
                         f"{tuple(packed.shape)}")
    u = packed.view(torch.uint8)
    n, nb, ko = u.shape[:3]
    table = _MXFP4_TABLES.get(u.device)
    if table is None:  # made once per device: a copy to the device here would wait for the stream (resident swaps)
        table = _MXFP4_TABLES[u.device] = torch.tensor(MXFP4_CODES, dtype=torch.int8, device=u.device)
    out = torch.empty(n, nb, ko, 2, 16, 4, dtype=torch.int8, device=u.device)
    out[:, :, :, 0] = table[u.bitwise_and(0xF).long()]
    out[:, :, :, 1] = table[u.bitwise_right_shift(4).long()]
    return out.view(n, nb, 2 * ko, 16, 4)


def _dequantize_functional(q, scales, mins, offset, gate_up, n, N, K, dtype, out):
    """``dequantize_packed``'s values by functional ops (for torch.compile): q [n, N/16, 16, ...] codes in packed row
    order -> [n, K, N], the same op per element as the eager path (so the same rounding)."""
    inner = q.shape[3:]
    if scales is None:
        w = q.to(dtype)
    else:
        G = scales.shape[1]
        s = scales.transpose(1, 2).reshape(n, N // 16, 16, G, *(1,) * len(inner))
        q_groups = q.unflatten(3, (G, -1))
        if offset:
            w = torch.addcmul(s * offset, q_groups, s)
        elif mins is not None:
            w = torch.addcmul(-mins.transpose(1, 2).reshape(s.shape), q_groups, s)
        else:
            w = torch.mul(q_groups, s)
        w = w.to(dtype).reshape(n, N // 16, 16, *inner)
    if gate_up:  # packed row 64b + 32h + 16c + r is row h*N/2 + 32b + 16c + r
        w = w.reshape(n, N // 64, 2, 2, 16, *inner).transpose(1, 2)
    w = w.reshape(n, N, K)
    if out is not None:
        out.copy_(w)
        w = out
    return w.transpose(1, 2)


def _dequantize_words(packed, scales, gate_up, n, N, K, out):
    """``dequantize_packed`` for int8 and bf16 blocks (a k step of a row is one 4-byte word): the words moved into
    dense row order by one 4-byte copy ([n, N/16, K/per, 16] -> [n, N, K/per], the gate/up interleave undone on the
    way), then one contiguous pass applying the scales (or converting) into ``out``. The same operations per element
    as the 7-D pass over bytes it replaces (q * s in float32, rounded once to out's dtype), so the same values; on
    the device's H200 that pass ran at about 0.4 TB/s over a Qwen3-30B-A3B layer."""
    per = packed.shape[4]
    words = packed.view(torch.int32).squeeze(-1).transpose(2, 3)  # [n, N/16, 16, K/per]: rows in packed order
    codes = torch.empty(n, N, K // per, dtype=torch.int32, device=packed.device)
    if gate_up:  # packed row 64b + 32h + 16c + r is row h*N/2 + 32b + 16c + r
        codes.view(n, 2, N // 64, 2, 16, K // per).transpose(1, 2).copy_(words.unflatten(1, (N // 64, 2, 2)))
    else:
        codes.view(n, N // 16, 16, K // per).copy_(words)
    q = codes.view(packed.dtype).view(n, N, K)
    if scales is None:
        out.copy_(q)
    else:
        G = scales.shape[1]
        if gate_up:  # the scales' columns are in packed row order too
            scales = scales.view(n, G, N // 64, 2, 32).transpose(2, 3).reshape(n, G, N)
        torch.mul(q.view(n, N, G, K // G), scales.transpose(1, 2).unsqueeze(-1), out=out.view(n, N, G, K // G))
    return out.transpose(1, 2)


def dequantize_packed(packed: torch.Tensor, scales: Optional[torch.Tensor], gate_up: bool,
                      dtype: torch.dtype, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Packed experts (``kt.pack_*`` layout, any device) -> their weights transposed, [n, K, N] in ``dtype``.

    packed [n, N/16, K/per, 16, per] (bf16 per=2, int8 per=4; int4 uint8 [n, N/16, K/8, 16, 4]; MXFP4 nibbles
    ``MXFP4_DTYPE`` in the int4 layout, decoded through ``mxfp4_as_int8``), scales float32
    [n, G, N] (None for bf16; two-level K-quant scales are made float32 first: ``kscales_as_float``), or [n, 2, G, N]
    for the affine formats (scales then minimums: q * s - m, int4 codes
    the nibbles themselves). With ``gate_up`` the N = 2I columns come back in the original order (gate then up),
    undoing the packing's 32-row interleave. [n, K, N] is what ``torch._grouped_mm`` and ``gpu_experts_forward``
    take (w13 [n, H, 2I], w2 [n, I, H]). Equals ``kt.unpack(packed, scales, gate_up).transpose(1, 2)`` up to the
    rounding to ``dtype``; plain torch ops, so it runs where the tensors are.

    The result is the transposed view of an [n, N, K] buffer (column-major [n, K, N], as transformers hands
    its expert weights to ``torch._grouped_mm``): every pass reads and writes along K, which is contiguous in
    the packed blocks too, so on a GPU the writes coalesce (a row-major [n, K, N] result made the last pass write
    one element per N-strided address). One elementwise pass over the weights reads the packed blocks in place,
    applies the scales and writes ``dtype`` (int4: two more split the nibbles first). int8 with scales and bf16 on a
    GPU take one Triton kernel instead (ktorch/ops/triton_train.py ``dequantize_rows``: the same values, 3.5 TB/s on
    the device's H200 against the torch passes' 0.6).

    ``out``: a contiguous [n, N, K] tensor of ``dtype`` on packed's device to write into (a preallocated buffer);
    the result is then ``out.transpose(1, 2)``."""
    if packed.dim() != 5 or packed.shape[3] != 16:
        raise ValueError(f"dequantize_packed: packed must be [n, N/16, K/per, 16, per], got {tuple(packed.shape)}")
    scales = kscales_as_float(scales, packed_in_features(packed))  # two-level K-quant scales: float32, exactly
    if packed.dtype == MXFP4_DTYPE:  # MXFP4 nibbles: their int8 codes (the same values and scales)
        if scales is None or scales.dim() != 3:
            raise ValueError("dequantize_packed: MXFP4 nibbles need their scales [n, G, N]")
        packed = mxfp4_as_int8(packed)
    n, N = packed.shape[0], packed.shape[1] * 16
    mins = None
    if scales is not None and scales.dim() == 4:  # affine (GGUF Q4_K/Q5_K kept exact): [n, 2, G, N] scales, minimums
        scales, mins = scales[:, 0], scales[:, 1]
    blocks = packed.permute(0, 1, 3, 2, 4)  # [n, N/16, 16, K/per, per]: rows in packed order, K along each row
    # Under torch.compile the same values come from functional ops (out= writes into views of out did not trace:
    # AOT autograd's functionalization failed to view the permuted blocks), then one reshape into [n, N, K].
    compiling = torch.compiler.is_compiling()
    if packed.dtype == torch.uint8:  # int4: low nibbles are k 8o..8o+3, high nibbles 8o+4..8o+7, stored + 8
        K = packed.shape[2] * 8
        if compiling:
            q = torch.stack([torch.bitwise_and(blocks, 0xF), torch.bitwise_right_shift(blocks, 4)], dim=-2)
        else:
            q = torch.empty(*blocks.shape[:4], 2, 4, dtype=torch.uint8, device=packed.device)  # [.., K/8, 2, 4]
            torch.bitwise_and(blocks, 0xF, out=q[..., 0, :])
            torch.bitwise_right_shift(blocks, 4, out=q[..., 1, :])
        offset = -8.0 if mins is None else 0.0  # affine codes are the nibbles themselves
    else:  # bf16, int8: read in place, as [n, N/16, 16, K/per, per] blocks (rows in packed order)
        per = packed.shape[4]
        K = packed.shape[2] * per
        q, offset = blocks, 0.0
    if out is not None and (out.shape != (n, N, K) or out.dtype != dtype or out.device != packed.device
                            or not out.is_contiguous()):
        raise ValueError(f"dequantize_packed: out must be a contiguous [{n}, {N}, {K}] {dtype} tensor on "
                         f"{packed.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
    if compiling:
        return _dequantize_functional(q, scales, mins, offset, gate_up, n, N, K, dtype, out)
    if mins is None:  # int8 + scales and bf16 on a GPU: one Triton pass (the same values)
        from ktorch.ops.triton_train import dequantize_rows, dequantize_rows_applies

        if dequantize_rows_applies(packed, scales, dtype):
            return dequantize_rows(packed, scales, gate_up, dtype, out).transpose(1, 2)
    if out is None:
        out = torch.empty(n, N, K, dtype=dtype, device=packed.device)
    if scales is None:
        if packed.dtype != torch.bfloat16:
            raise ValueError(f"dequantize_packed: {packed.dtype} packed weights need their scales")
        return _dequantize_words(packed, None, gate_up, n, N, K, out)
    G = scales.shape[1]
    if scales.shape != (n, G, N) or K % G or (K // G) % (8 if packed.dtype == torch.uint8 else per):
        raise ValueError(f"dequantize_packed: scales must be [n={n}, G, N={N}] with G dividing K={K} into "
                         f"whole blocks, got {tuple(scales.shape)}")
    if packed.dtype == torch.int8 and mins is None:
        return _dequantize_words(packed, scales, gate_up, n, N, K, out)
    # int4 and affine int8: out's rows seen in q's shape with the rows in packed order, so that one elementwise pass
    # writes them where they belong: [n, N/16, 16, K/8, 2, 4] (int4) or [n, N/16, 16, K/per, per]; gate/up rows
    # 64b + 32h + 16c + r go to row h*N/2 + 32b + 16c + r
    inner = q.shape[3:]
    rows = out.view(n, 2, N // 64, 2, 16, *inner).transpose(1, 2) if gate_up else out.view(n, N // 16, 16, *inner)
    q = q.view(rows.shape)  # [n, N/64, 2, 2, 16, ...] or [n, N/16, 16, ...]
    lead = rows.shape[:-len(inner)]
    s = scales.transpose(1, 2).reshape(*lead, G, *(1,) * len(inner))  # rows in packed order
    q_groups = q.unflatten(len(lead), (G, -1))  # K/per (K/8 for int4) split into G groups: a view
    target = rows.unflatten(len(lead), (G, -1))
    if offset:
        torch.addcmul(s * offset, q_groups, s, out=target)  # (q - 8) * s in one pass (an FMA: exact on the CPU)
    elif mins is not None:
        m = mins.transpose(1, 2).reshape(s.shape)
        torch.addcmul(-m, q_groups, s, out=target)  # q * s - m
    else:
        torch.mul(q_groups, s, out=target)
    return out.transpose(1, 2)

