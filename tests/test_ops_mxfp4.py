"""MXFP4 experts as 4-bit codes (issue 32): the int4 layout whose nibbles are E2M1 codes (torch.float4_e2m1fn_x2,
``pack_quantized(mxfp4=True)``), decoded in the kernels through MXFP4's code table.

The strong check: the same MXFP4 blocks packed as nibbles and as int8 codes (the E2M1 values doubled, one a byte)
give kt.fused_moe's output bit for bit at every kernel level (the same integer products, the same fp32 scale
products), AMX tiles included. The weights themselves are gguf.quants.dequantize's (tests/test_ops_kquant.py runs
MXFP4 through its unpack and float64-reference tests too); the other readers of packed int4 (unpack, the NUMA split,
the backward and delta ops, the device paths' dequantization and resident form) handle the nibbles.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch.library import opcheck

import ktorch

gguf = pytest.importorskip("gguf")  # the blocks are decoded by the gguf package
from ktorch.integrations.gguf_loading import exact_codes
from ktorch.ops.moe import PackedExperts, pack_quantized
from ktorch.ops.packed_weights import MXFP4_DTYPE, dequantize_packed, mxfp4_as_int8
from reference import fused_moe_reference, relative_error

GPT_OSS = "swiglu_oai(alpha=1.702,limit=7.0)"


def mxfp4_blocks(shape: tuple, scale_bytes: tuple = (117, 123)) -> np.ndarray:
    """Random MXFP4 blocks for weights [E, N, K]: uint8 [E, N, K/32*17], E8M0 scale bytes drawn from scale_bytes
    (127 scales by 1: 117..123 give weights of about 0.001..0.1), the nibbles uniform."""
    E, N, K = shape
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    e = rng.integers(scale_bytes[0], scale_bytes[1] + 1, size=(E, N, K // 32, 1), dtype=np.uint8)
    qs = rng.integers(0, 256, size=(E, N, K // 32, 16), dtype=np.uint8)
    return np.concatenate([e, qs], axis=-1).reshape(E, N, K // 32 * 17)


def values(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4), np.float32))


def both_forms(E: int, H: int, I: int, biases: bool = False):
    """The same MXFP4 experts as (nibbles, int8 codes) PackedExperts, and (gate_up [E, 2I, H], down [E, H, I]) as the
    blocks' values."""
    d13, d2 = mxfp4_blocks((E, 2 * I, H)), mxfp4_blocks((E, H, I))
    c13, s13, _ = exact_codes(d13, "MXFP4")
    c2, s2, _ = exact_codes(d2, "MXFP4")
    b13 = torch.randn(E, 2 * I) * 0.1 if biases else None
    b2 = torch.randn(E, H) * 0.1 if biases else None
    forms = []
    for bits in (4, 8):
        w13, sc13 = pack_quantized(c13, s13, bits=bits, gate_up=True, mxfp4=bits == 4)
        w2, sc2 = pack_quantized(c2, s2, bits=bits, mxfp4=bits == 4)
        forms.append(PackedExperts(w13, sc13, w2, sc2, "gguf:MXFP4", None, b13, b2))
    return forms[0], forms[1], values(d13), values(d2)


def routing(T: int, E: int, K: int):
    ids = torch.rand(T, E).argsort(dim=1)[:, :K]
    weights = torch.rand(T, K) + 0.1
    return ids, weights / weights.sum(dim=1, keepdim=True)


def test_packed_form_and_bytes(seed):
    """Nibbles: float4_e2m1fn_x2 in the int4 layout, 0.5 bytes a weight plus a float32 scale per 32 (0.625 in all,
    against the int8 codes' 1.125); their weights are the blocks' values, bit for bit."""
    E, H, I = 2, 64, 64
    nib, codes, gate_up, down = both_forms(E, H, I)
    assert nib.w13.dtype == MXFP4_DTYPE and nib.w13.shape == (E, 2 * I // 16, H // 8, 16, 4)
    assert codes.w13.dtype == torch.int8
    weights = E * 3 * H * I
    assert nib.nbytes == weights * 0.625 and codes.nbytes == weights * 1.125
    g13, g2 = nib.dequantize()
    assert torch.equal(g13, gate_up) and torch.equal(g2, down)
    assert nib.intermediate_size == I and nib.has_gate


@pytest.mark.parametrize("T", [1, 6, 70])
def test_op_equals_int8_codes_bit_for_bit(kernel, T, seed):
    """kt.fused_moe on the nibbles = on the int8 codes of the same blocks, bit for bit (silu; gpt-oss's activation
    with biases), and within the int8 tolerance of the float64 reference on the blocks' values."""
    E, K, H, I = 6, 2, 128, 96
    for activation, biases in (("silu", False), (GPT_OSS, True)):
        nib, codes, gate_up, down = both_forms(E, H, I, biases)
        hidden = torch.randn(T, H).to(torch.bfloat16)
        ids, weights = routing(T, E, K)
        out = ktorch.fused_moe(hidden, ids, weights, nib, activation=activation)
        want = ktorch.fused_moe(hidden, ids, weights, codes, activation=activation)
        assert torch.equal(out, want), f"seed={seed} {kernel} T={T} {activation}: nibbles differ from int8 codes"
        ref = fused_moe_reference(hidden, ids, weights, gate_up, down, activation, gate_up_bias=nib.w13_bias,
                                  down_bias=nib.w2_bias)
        assert relative_error(out, ref) <= 4e-2, f"seed={seed} {kernel} T={T} {activation}"


def test_every_call_on_amx_tiles(kernel, seed):
    """AMX: every call through the tiles (the nibbles shuffled to their codes as signed tile bytes), small T too, bit
    for bit the int8 codes' output (which the AVX-512 grouped kernel computes)."""
    if kernel != "amx":
        pytest.skip("the tile walk's small-call threshold exists at the amx level only")
    E, K, H, I = 5, 3, 256, 128
    nib, codes, _, _ = both_forms(E, H, I)
    try:
        torch.ops.kt._amx_min_rows_for_tests(0)
        for T in (1, 17, 70, 700):  # (700: ~400 rows an expert, walks of 256)
            hidden = torch.randn(T, H).to(torch.bfloat16)
            ids, weights = routing(T, E, K)
            out = ktorch.fused_moe(hidden, ids, weights, nib)
            assert torch.equal(out, ktorch.fused_moe(hidden, ids, weights, codes)), f"seed={seed} T={T} on tiles"
    finally:
        torch.ops.kt._amx_min_rows_for_tests(-1)


def test_mixed_with_int8_down(seed):
    """MXFP4 nibbles for gate/up with int8 codes for down (formats mix per projection): the int8-only output."""
    E, K, H, I, T = 4, 2, 128, 64, 9
    nib, codes, _, _ = both_forms(E, H, I)
    mixed = PackedExperts(nib.w13, nib.w13_scales, codes.w2, codes.w2_scales, "gguf:MXFP4/Q8_0")
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = routing(T, E, K)
    assert torch.equal(ktorch.fused_moe(hidden, ids, weights, mixed), ktorch.fused_moe(hidden, ids, weights, codes))


@contextlib.contextmanager
def float4_comparable():
    """opcheck's test_schema compares each input before and after the call with torch.allclose, which torch does
    not implement for float4_e2m1fn_x2 ("copy_" not implemented): for the duration, float4 tensors are compared as
    their bytes (bit for bit, a stricter check than allclose); every other dtype as before."""
    allclose = torch.allclose

    def compare(a, b, *args, **kwargs):
        if a.dtype == MXFP4_DTYPE or b.dtype == MXFP4_DTYPE:
            return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return allclose(a, b, *args, **kwargs)

    torch.allclose = compare
    try:
        yield
    finally:
        torch.allclose = allclose


def test_opcheck(seed):
    E, K, H, I, T = 3, 2, 64, 64, 5
    nib, _, _, _ = both_forms(E, H, I, biases=True)
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = routing(T, E, K)
    delta = torch.randn(T, K, 2 * I)
    with float4_comparable():
        opcheck(torch.ops.kt.fused_moe, (hidden, ids, weights, *nib.tensors(), GPT_OSS, *nib.biases()))
        opcheck(torch.ops.kt.unpack, (nib.w13, nib.w13_scales, True))
        opcheck(torch.ops.kt.fused_moe_delta, (hidden, ids, weights, *nib.tensors(), delta, "silu"))
        opcheck(torch.ops.kt.fused_moe_backward, (torch.randn(T, H).to(torch.bfloat16), hidden, ids, weights,
                                                   *nib.tensors(), "silu"))
        split = PackedExperts(*nib.tensors(), nib.format).split_numa(2)  # (the split takes no biases)
        opcheck(torch.ops.kt.fused_moe_numa, (hidden, ids, weights, *(list(t) for t in zip(
            *[(s.w13, s.w13_scales, s.w2, s.w2_scales) for s in split.slices])), "silu"))
        opcheck(torch.ops.kt.numa_split_experts, (*nib.tensors(), 2))


def test_backward_and_delta_read_the_codes(seed):
    """The training ops decode the nibbles through the table: float32 gradients equal the float64 reference's
    (autograd on the blocks' values) within float32 rounding, and the delta forward on the packed kernels (bf16
    hidden) equals the int8 codes' with zero deltas... as kt.fused_moe does."""
    E, K, H, I, T = 4, 2, 64, 64, 7
    nib, codes, gate_up, down = both_forms(E, H, I)
    ids, weights = routing(T, E, K)
    x = (torch.randn(T, H)).requires_grad_()
    w = weights.clone().requires_grad_()
    out = ktorch.fused_moe(x, ids, w, nib)
    grad = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), grad)
    xr, wr = x.detach().double().requires_grad_(), weights.double().requires_grad_()
    ref = fused_moe_reference(xr, ids, wr, gate_up, down, "silu")
    rx, rw = torch.autograd.grad(ref, (xr, wr), grad.double())
    assert relative_error(gx, rx) <= 2e-6 and relative_error(gw, rw) <= 2e-6, f"seed={seed}"
    hidden = torch.randn(T, H).to(torch.bfloat16)
    zeros = torch.zeros(T, K, 2 * I)
    o4, h4, _ = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *nib.tensors(), zeros, "silu")
    o8, h8, _ = torch.ops.kt.fused_moe_delta(hidden, ids, weights, *codes.tensors(), zeros, "silu")
    assert torch.equal(o4, o8) and torch.equal(h4, h8)
    assert torch.equal(o4, ktorch.fused_moe(hidden, ids, weights, nib))


def test_numa_split(seed):
    """Two NUMA slices of the nibbles (run where this machine has one node too): the split int8 codes' output bit for
    bit (the split quantizes h as the unsplit op does), and the reference's within the int8 tolerance."""
    E, K, H, I, T = 4, 2, 128, 128, 9
    nib, codes, gate_up, down = both_forms(E, H, I)
    split = nib.split_numa(2)
    assert all(s.w13.dtype == MXFP4_DTYPE for s in split.slices)
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = routing(T, E, K)
    out = ktorch.fused_moe(hidden, ids, weights, split)
    assert torch.equal(out, ktorch.fused_moe(hidden, ids, weights, codes.split_numa(2)))
    assert relative_error(out, fused_moe_reference(hidden, ids, weights, gate_up, down, "silu")) <= 3e-2


def test_device_forms(seed):
    """What the device paths compute with: mxfp4_as_int8 of the nibbles is the int8-code packing of the same blocks
    byte for byte (residents hold it, the Triton rows read it), and dequantize_packed (streamed/routed experts) gives
    kt.unpack's weights."""
    E, H, I = 3, 64, 96
    nib, codes, gate_up, down = both_forms(E, H, I)
    assert torch.equal(mxfp4_as_int8(nib.w13), codes.w13) and torch.equal(mxfp4_as_int8(nib.w2), codes.w2)
    assert torch.equal(dequantize_packed(nib.w13, nib.w13_scales, True, torch.float32), gate_up.transpose(1, 2))
    assert torch.equal(dequantize_packed(nib.w2, nib.w2_scales, False, torch.float32), down.transpose(1, 2))
    with pytest.raises(ValueError, match="mxfp4_as_int8"):
        mxfp4_as_int8(codes.w13)
    # streamed experts: the packed bytes staged in a uint8 buffer (views_in, copy_prefix), then dequantized
    from ktorch.ops.streamed_experts import StreamedExperts

    layer = StreamedExperts(*nib.tensors(), "silu")
    views = layer.views_in(torch.zeros(layer.prefix_bytes(2), dtype=torch.uint8), 2)
    layer.copy_prefix(views, 2)
    assert views[0].dtype == MXFP4_DTYPE
    w13, w2 = layer.device_weights(2, torch.device("cpu"), torch.float32)
    assert torch.equal(dequantize_packed(views[0], views[1], True, torch.float32), w13)
    assert torch.equal(w13, gate_up[:2].transpose(1, 2)) and torch.equal(w2, down[:2].transpose(1, 2))


def test_bad_input_is_refused():
    codes = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, -1, -2, -3, -4, -6, -8, -12, 5] * 2, dtype=torch.int8)
    scales = torch.ones(1, 16, 1)
    with pytest.raises(ValueError, match="doubled E2M1"):
        pack_quantized(codes.repeat(16, 1).unsqueeze(0), scales, bits=4, mxfp4=True)
    with pytest.raises(ValueError, match="bits=4 and no mins"):
        pack_quantized(codes[:15].repeat(16, 3)[:, :32].unsqueeze(0), scales, bits=8, mxfp4=True)
    nib, _, _, _ = both_forms(2, 64, 64)
    affine = torch.stack([nib.w13_scales, nib.w13_scales], dim=1)
    hidden = torch.randn(2, 64).to(torch.bfloat16)
    ids, weights = routing(2, 2, 1)
    with pytest.raises(RuntimeError, match="MXFP4 nibbles"):
        torch.ops.kt.fused_moe(hidden, ids, weights, nib.w13, affine, nib.w2, nib.w2_scales)
    with pytest.raises(RuntimeError, match="MXFP4 nibbles"):
        torch.ops.kt.unpack(nib.w13, affine, True)
