"""Rotary position embedding of a layer's queries or keys in one Triton launch.

    out[..., :D/2] = x1 * cos1 - x2 * sin1        x = [x1 | x2] along the head dimension D
    out[..., D/2:] = x2 * cos2 + x1 * sin2        cos = [cos1 | cos2], sin = [sin1 | sin2] per position

what transformers' ``apply_rotary_pos_emb`` computes with ``rotate_half`` (``q * cos + rotate_half(q) * sin``: a
slice, a negation, a concatenation, two products and a sum, seven launches for each of q and k) for x [B, H, T, D]
at any strides with a unit stride along D, cos/sin [B or 1, T, D]. The products are taken in float32 and rounded
once to x's dtype, where the eager form rounds each product and the sum: the two differ in the last bit of some
elements. An experiment for the eager prefill, which is bound by its launching thread
(ktorch/integrations/fused_rope.py, ``bench_generate.py --prefill-variants default "rope kernel"``), until measured
on the device.

Limits: CUDA tensors (or CPU tensors under Triton's interpreter, TRITON_INTERPRET=1, for tests), D even and at most
``MAX_HEAD_DIM``, x, cos and sin of one floating dtype.
"""

import torch  # no "from __future__ import annotations": Triton reads the tl.constexpr annotations

from ktorch.ops.triton_experts import kernel_runs_on, triton, triton_available  # noqa: F401

MAX_HEAD_DIM = 512


if triton is not None:
    import triton.language as tl

    @triton.jit(do_not_specialize=["H", "T"])
    def _rope(x, out, cos, sin, H, T, sxb, sxh, sxt, sob, soh, sot, scb, sct, ssb, sst, HALF: tl.constexpr,
              BLOCK: tl.constexpr):
        r = tl.program_id(0)  # one (b, h, t) row of D elements
        t = r % T
        bh = r // T
        h = bh % H
        b = bh // H
        d = tl.arange(0, BLOCK)
        m = d < HALF
        xr = x + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + t.to(tl.int64) * sxt
        x1 = tl.load(xr + d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xr + HALF + d, mask=m, other=0.0).to(tl.float32)
        cr = cos + b.to(tl.int64) * scb + t.to(tl.int64) * sct
        sr = sin + b.to(tl.int64) * ssb + t.to(tl.int64) * sst
        c1 = tl.load(cr + d, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cr + HALF + d, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sr + d, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sr + HALF + d, mask=m, other=0.0).to(tl.float32)
        orow = out + b.to(tl.int64) * sob + h.to(tl.int64) * soh + t.to(tl.int64) * sot
        tl.store(orow + d, (x1 * c1 - x2 * s1).to(out.dtype.element_ty), mask=m)
        tl.store(orow + HALF + d, (x2 * c2 + x1 * s2).to(out.dtype.element_ty), mask=m)


def rope_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether ``rope`` takes these tensors (module docstring's limits), else the caller keeps the eager form."""
    if not triton_available() or not kernel_runs_on(x):
        return False
    if x.dim() != 4 or cos.dim() != 3 or sin.shape != cos.shape or not x.dtype.is_floating_point:
        return False
    B, H, T, D = x.shape
    if D % 2 or D > MAX_HEAD_DIM or cos.shape[1:] != (T, D) or cos.shape[0] not in (1, B):
        return False
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.device != x.device or sin.device != x.device:
        return False
    return x.stride(3) == 1 and cos.stride(2) == 1 and sin.stride(2) == 1


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated by cos/sin [B or 1, T, D] (module docstring); the result has x's layout."""
    if not rope_applies(x, cos, sin):
        raise ValueError(f"rope: x [B, H, T, D] (unit stride along D, D even, at most {MAX_HEAD_DIM}) and cos/sin "
                         f"[B or 1, T, D] of x's dtype on a device the kernel runs on, got x {x.dtype} "
                         f"{tuple(x.shape)} {x.stride()} on {x.device}, cos {cos.dtype} {tuple(cos.shape)}, sin "
                         f"{sin.dtype} {tuple(sin.shape)}")
    B, H, T, D = x.shape
    out = torch.empty_like(x)  # x's strides (a transposed projection stays transposed)
    if out.stride(3) != 1:
        out = torch.empty(B, H, T, D, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    _rope[(B * H * T,)](x, out, cos, sin, H, T, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
                        out.stride(2), cb, cos.stride(1), sb, sin.stride(1), HALF=D // 2,
                        BLOCK=triton.next_power_of_2(D // 2))
    return out
