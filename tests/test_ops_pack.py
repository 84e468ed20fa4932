"""kt.pack_bf16 / pack_int8 / pack_int4 / unpack and ktorch.pack_experts against tests/reference.py.

Packing is deterministic, so unpack(pack(W)) must equal the reference dequantization exactly (both sides do
the same fp32 operations: one division, one round-half-even, one multiplication), and the packed bytes must
follow the layouts written in ktorch/csrc/kernels/kernels.h element by element.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import ktorch
from ktorch.ops.packed_weights import kscales_as_float
from reference import (
    dequantize_reference,
    int4_codes_reference,
    int8_codes_reference,
    relative_error,
)

kt = torch.ops.kt

# (E, N, K): N output channels (a multiple of 64 so that gate_up packing applies), K reduction.
SHAPES = [(1, 64, 32), (3, 192, 128), (6, 320, 192), (5, 128, 320)]
INT4_GROUPS = [32, 64, 128]


def pack(weight: torch.Tensor, fmt: str, group_size: int | None = None, gate_up: bool = False):
    """(packed, scales or None) through the op of the format."""
    if fmt == "bf16":
        return kt.pack_bf16(weight, gate_up=gate_up), None
    if fmt == "int8":
        return kt.pack_int8(weight, gate_up=gate_up)
    return kt.pack_int4(weight, group_size=group_size, gate_up=gate_up)


def format_cases():
    """(fmt, group_size) for every format, int4 at each group size."""
    return [("bf16", None), ("int8", None)] + [("int4", g) for g in INT4_GROUPS]


def shape_format_cases():
    """(shape, fmt, group_size) for every shape and format whose group size divides K."""
    return [(s, f, g) for s in SHAPES for f, g in format_cases() if g is None or s[2] % g == 0]


def original_row(n: int, N: int, gate_up: bool) -> int:
    """The row of W [E, N, K] held by packed row n: gate_up packs 32 gate rows then the 32 matching up rows."""
    if not gate_up:
        return n
    chunk, within = divmod(n, 64)
    return 32 * chunk + within if within < 32 else N // 2 + 32 * chunk + within - 32


# ---------------------------------------------------------------- unpack(pack(W)) == reference dequantization


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("shape,fmt,group_size", shape_format_cases())
def test_unpack_of_pack_equals_reference_dequantization(shape, fmt, group_size, gate_up, seed):
    w = torch.randn(shape) * 0.05
    packed, scales = pack(w, fmt, group_size, gate_up)
    got = kt.unpack(packed, scales, gate_up=gate_up)
    want = dequantize_reference(w, fmt, group_size)
    assert got.dtype == torch.float32 and got.shape == shape
    mismatched = (got != want).sum().item()
    assert mismatched == 0, (
        f"seed={seed}: {fmt} g={group_size} gate_up={gate_up} {shape}: {mismatched} of {got.numel()} elements differ "
        f"from the reference dequantization, max |diff| {(got - want).abs().max().item():.3g}"
    )


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("fmt,group_size", [("bf16", None), ("int8", None), ("int4", 32)])
def test_pack_accepts_any_float_dtype(src_dtype, fmt, group_size, seed):
    w = (torch.randn(2, 64, 64) * 0.05).to(src_dtype)
    packed, scales = pack(w, fmt, group_size)
    want = w.to(torch.bfloat16).float() if fmt == "bf16" else dequantize_reference(w.float(), fmt, group_size)
    assert torch.equal(kt.unpack(packed, scales), want), f"seed={seed}: {fmt} from {src_dtype}"


def test_bf16_round_trip_keeps_special_values():
    w = torch.zeros(1, 16, 32)
    w[0, 0, :4] = torch.tensor([float("inf"), float("-inf"), -0.0, 1e-40])  # 1e-40: an fp32 subnormal
    w[0, 1, 0] = float("nan")
    got = kt.unpack(kt.pack_bf16(w), None)
    want = w.to(torch.bfloat16).float()
    assert torch.equal(got[0, 0], want[0, 0]) and torch.equal(got.signbit(), want.signbit())
    assert got[0, 1, 0].isnan()


def test_quantization_rounds_half_to_even():
    # scale = 127 / 127 = 1 (int8) and 7 / 7 = 1 (int4): the codes are W itself, rounded.
    row = [2.5, 3.5, -2.5, -3.5, 0.5, -0.5, 1.5, 6.4]
    w = torch.zeros(1, 16, 32)
    w[0, :, : len(row)] = torch.tensor(row)
    w8 = w.clone()
    w8[0, :, 31] = 127.0
    w4 = w.clone()
    w4[0, :, 31] = 7.0
    want = torch.tensor([2.0, 4.0, -2.0, -4.0, 0.0, -0.0, 2.0, 6.0])
    got8 = kt.unpack(*kt.pack_int8(w8))[0, 0, : len(row)]
    got4 = kt.unpack(*kt.pack_int4(w4, group_size=32))[0, 0, : len(row)]
    assert torch.equal(got8, want), f"int8 codes of {row}: {got8.tolist()}, want {want.tolist()}"
    assert torch.equal(got4, want), f"int4 codes of {row}: {got4.tolist()}, want {want.tolist()}"


@pytest.mark.parametrize("fmt,group_size", [("int8", None), ("int4", 32)])
def test_all_zero_rows_quantize_to_zero(fmt, group_size):
    w = torch.randn(2, 32, 64)
    w[0, 5] = 0.0
    w[1, :, :32] = 0.0  # int4: whole zero groups
    packed, scales = pack(w, fmt, group_size)
    got = kt.unpack(packed, scales)
    assert torch.isfinite(got).all() and torch.isfinite(scales).all()
    assert torch.equal(got, dequantize_reference(w, fmt, group_size))
    assert (got[0, 5] == 0).all() and (got[1, :, :32] == 0).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("fmt,group_size", [("int8", None), ("int4", 32)])
def test_non_finite_weights_refuse_quantization(fmt, group_size, bad):
    w = torch.randn(3, 32, 64)
    w[2, 17, 40] = bad  # expert 2, row 17, column 40 (int4 group 32: columns from 32)
    w[2, 17, 0] = 100.0  # a larger finite value first must not hide it
    col = "32" if fmt == "int4" else "0"
    with pytest.raises(RuntimeError, match=rf"non-finite value .* in expert 2, output row 17 .*columns from {col}"):
        pack(w, fmt, group_size)


# ---------------------------------------------------------------- packed layouts of kernels.h, element by element


def sample_positions(shape, count=64):
    """`count` random index tuples into a tensor of `shape`, plus its first and last element."""
    picks = [tuple(int(torch.randint(0, s, ())) for s in shape) for _ in range(count)]
    return picks + [tuple(0 for _ in shape), tuple(s - 1 for s in shape)]


@pytest.mark.parametrize("gate_up", [False, True])
def test_bf16_layout(gate_up, seed):
    E, N, K = 3, 128, 96
    w = torch.randn(E, N, K)
    packed = kt.pack_bf16(w, gate_up=gate_up)
    assert packed.shape == (E, N // 16, K // 2, 16, 2) and packed.dtype == torch.bfloat16
    wb = w.to(torch.bfloat16)
    for e, nb, p, c, j in sample_positions(packed.shape):
        # bf16: element (nb, p, c, j) = W[16*nb + c][2*p + j]
        n = original_row(16 * nb + c, N, gate_up)
        assert packed[e, nb, p, c, j] == wb[e, n, 2 * p + j], f"seed={seed}: bf16 packed[{e},{nb},{p},{c},{j}]"


@pytest.mark.parametrize("gate_up", [False, True])
def test_int8_layout(gate_up, seed):
    E, N, K = 2, 128, 64
    w = torch.randn(E, N, K)
    packed, scales = kt.pack_int8(w, gate_up=gate_up)
    assert packed.shape == (E, N // 16, K // 4, 16, 4) and packed.dtype == torch.int8
    assert scales.shape == (E, 1, N) and scales.dtype == torch.float32
    q, scale = int8_codes_reference(w)
    for e, nb, qd, c, j in sample_positions(packed.shape):
        # int8: element (nb, q, c, j) = Q[16*nb + c][4*q + j]; scale[0][n] belongs to packed row n
        n = original_row(16 * nb + c, N, gate_up)
        where = f"seed={seed}: int8 packed[{e},{nb},{qd},{c},{j}] (row {n})"
        assert packed[e, nb, qd, c, j] == q[e, n, 4 * qd + j], where
        assert scales[e, 0, 16 * nb + c] == scale[e, n, 0], where


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_layout(group_size, gate_up, seed):
    E, N, K = 2, 128, 128
    w = torch.randn(E, N, K)
    packed, scales = kt.pack_int4(w, group_size=group_size, gate_up=gate_up)
    assert packed.shape == (E, N // 16, K // 8, 16, 4) and packed.dtype == torch.uint8
    assert scales.shape == (E, K // group_size, N) and scales.dtype == torch.float32
    q, scale = int4_codes_reference(w, group_size)
    for e, nb, o, c, j in sample_positions(packed.shape):
        # int4: byte (nb, o, c, j) = (Q[16nb+c][8o+j] + 8) | (Q[16nb+c][8o+4+j] + 8) << 4
        n = original_row(16 * nb + c, N, gate_up)
        byte = int(packed[e, nb, o, c, j])
        where = f"seed={seed}: int4 packed[{e},{nb},{o},{c},{j}] = {byte:#04x} (row {n})"
        assert byte & 0xF == int(q[e, n, 8 * o + j]) + 8, where
        assert byte >> 4 == int(q[e, n, 8 * o + 4 + j]) + 8, where
        g = (8 * o + j) // group_size
        assert scales[e, g, 16 * nb + c] == scale[e, n, g], where


@pytest.mark.parametrize("gate_up", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, 256])
def test_int4_two_level_layout(group_size, gate_up, seed):
    """kt.pack_int4(two_level=True): per row a float32 super-scale s = max |group absmax| / 105 (stored once per 256
    input channels), per group a byte c in 1..15, of r = round(absmax / 7s) and the three below it the one with the
    least squared error, and codes q = round(w / (s c)) in [-8, 7], so c * q fits a signed byte (the AMX walk's
    single tile plane); kt.unpack and the float32 form (kscales_as_float) give s * c * q; the weight error is below
    the float32 form's (absmax / 7 per group) by 5% or more on Gaussian weights."""
    E, N, K = 2, 128, 512
    w = torch.randn(E, N, K)
    w[0, 5] *= 0  # an all-zero row: scale 0, codes 0
    w[1, 7, :group_size] *= 1e-3  # a group far below its row's largest: its sub-scale 1
    packed, scales = kt.pack_int4(w, group_size=group_size, gate_up=gate_up, two_level=True)
    G, S = K // group_size, K // 256
    assert packed.shape == (E, N // 16, K // 8, 16, 4) and scales.dtype == torch.uint8
    assert scales.shape == (E, G + K // 64, N)
    sub = scales[:, :G].long()
    sup = scales[:, G:].contiguous().view(torch.float32).reshape(E, S, N)
    assert torch.equal(sup, sup[:, :1].expand(E, S, N)), "one super-scale a row along K"
    w_rows = w if not gate_up else w[:, [original_row(n, N, True) for n in range(N)]]  # packed row order
    amax = w_rows.abs().reshape(E, N, G, group_size).amax(-1)
    want_sup = amax.amax(-1) / 105
    assert torch.equal(sup[:, 0], want_sup)
    ratio = torch.where(want_sup[..., None] > 0, amax / (7 * want_sup[..., None]), torch.ones_like(amax))
    r = ratio.round().clamp(1, 15).long()
    c = sub.transpose(1, 2)
    assert torch.all((c <= r) & (c >= (r - 3).clamp(min=1))), "the sub-scale is r or one of the three below it"
    assert int(sub.min()) >= 1 and int(sub.max()) <= 15
    groups = w_rows.reshape(E, N, G, group_size).double()

    def group_error(cs):  # each group's squared error with sub-scales cs, codes rounded and clamped to [-8, 7]
        d = (want_sup[..., None] * cs.float()).double()[..., None]
        return ((torch.round(groups / d.clamp(min=1e-30)).clamp(-8, 7) * d - groups) ** 2).sum(-1)

    chosen = group_error(c)
    for i in range(4):
        assert torch.all(chosen <= group_error((r - i).clamp(min=1)) * (1 + 1e-5) + 1e-12), f"candidate r - {i}"
    deq = kt.unpack(packed, scales, gate_up=gate_up)
    assert torch.equal(deq, kt.unpack(packed, kscales_as_float(scales, K), gate_up=gate_up))
    per_group = torch.empty(E, G, N)
    per_group[:, :, [original_row(n, N, gate_up) for n in range(N)]] = kscales_as_float(scales, K)  # original rows
    q = (deq.double() / per_group.repeat_interleave(group_size, 1).transpose(1, 2)).nan_to_num(0)
    assert (q - q.round()).abs().max() < 1e-4 and q.abs().max() <= 8.0001
    assert torch.all(deq[0, 5] == 0)
    err = (deq - w).norm() / w.norm()
    f32 = kt.unpack(*kt.pack_int4(w, group_size=group_size, gate_up=gate_up), gate_up=gate_up)
    assert err <= 0.95 * (f32 - w).norm() / w.norm(), f"seed={seed}: two-level error {err:.4f}"
    with pytest.raises(RuntimeError, match="two-level"):
        kt.pack_int4(torch.randn(1, 16, 96), group_size=32, two_level=True)  # K not a multiple of 256


# ---------------------------------------------------------------- input layouts and the Python API


@pytest.mark.parametrize("fmt,group_size", [("bf16", None), ("int8", None), ("int4", 32)])
def test_pack_from_transposed_view_equals_pack_from_contiguous(fmt, group_size, seed):
    E, N, K = 3, 192, 96
    w_t = torch.randn(E, K, N).transpose(1, 2)  # [E, N, K], K-major like a [in, out] checkpoint
    assert not w_t.is_contiguous()
    strided = torch.randn(E, N, 2 * K)[:, :, ::2]
    for view in (w_t, strided):
        for gate_up in (False, True):
            got, got_s = pack(view, fmt, group_size, gate_up)
            want, want_s = pack(view.contiguous(), fmt, group_size, gate_up)
            assert torch.equal(got, want), f"seed={seed}: {fmt} gate_up={gate_up} strides {view.stride()}"
            assert got_s is None or torch.equal(got_s, want_s)


@pytest.mark.parametrize("fmt,group_size", [("bf16", None), ("int8", None), ("int4", 32), ("int4", None)])
def test_pack_experts_gate_and_up_separately_equals_gate_up(fmt, group_size, seed):
    E, H, I = 4, 96, 160
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I)
    a = ktorch.pack_experts(torch.cat([gate, up], dim=1), down, fmt, group_size)
    b = ktorch.pack_experts(None, down, fmt, group_size, gate_proj=gate, up_proj=up)
    assert a.format == b.format == fmt and a.group_size == b.group_size
    for x, y in zip(a.tensors(), b.tensors()):
        assert (x is None and y is None) or torch.equal(x, y), f"seed={seed}: {fmt}"


@pytest.mark.parametrize("fmt,group_size", [("bf16", None), ("int8", None), ("int4", 32), ("int4", 64)])
def test_packed_experts_dequantize_and_sizes(fmt, group_size, seed):
    E, H, I = 6, 192, 320
    gate_up, down = torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05
    p = ktorch.pack_experts(gate_up, down, fmt, group_size)
    assert (p.num_experts, p.hidden_size, p.intermediate_size) == (E, H, I)
    assert p.nbytes == sum(t.numel() * t.element_size() for t in p.tensors() if t is not None)
    got_gate_up, got_down = p.dequantize()
    assert torch.equal(got_gate_up, dequantize_reference(gate_up, fmt, group_size)), f"seed={seed}"
    assert torch.equal(got_down, dequantize_reference(down, fmt, group_size)), f"seed={seed}"


def test_pack_experts_default_int4_group_size():
    assert ktorch.pack_experts(torch.randn(2, 256, 128), torch.randn(2, 128, 128), "int4").group_size == 128
    assert ktorch.pack_experts(torch.randn(2, 192, 128), torch.randn(2, 128, 96), "int4").group_size == 32


def test_packing_is_deterministic():
    w = torch.randn(3, 128, 64)
    for fmt, g in format_cases()[:3]:
        a, b = pack(w, fmt, g, True), pack(w.clone(), fmt, g, True)
        assert torch.equal(a[0], b[0]) and (a[1] is None or torch.equal(a[1], b[1]))


# ---------------------------------------------------------------- quantization error itself, reported


@pytest.mark.parametrize(
    "fmt,group_size,bound",
    [("bf16", None, 4e-3), ("int8", None, 1.2e-2), ("int4", 32, 0.11), ("int4", 64, 0.12), ("int4", 128, 0.13)],
)
def test_quantization_error_of_gaussian_weights(fmt, group_size, bound, seed, record_property):
    """How far the dequantized weights are from the originals (separately from the kernels' own error)."""
    w = torch.randn(8, 256, 512) * 0.02
    packed, scales = pack(w, fmt, group_size)
    err = relative_error(kt.unpack(packed, scales), w)
    record_property("weight_error", err)
    print(f"weight quantization error {fmt} group={group_size}: {err:.4f} (bound {bound})")
    assert err < bound, f"seed={seed}: {fmt} group={group_size} weight error {err:.4f} >= {bound}"


# ---------------------------------------------------------------- opcheck (schema, fake impl, autograd registration)


@pytest.mark.parametrize("gate_up", [False, True])
def test_opcheck_pack_and_unpack(gate_up):
    w = torch.randn(3, 128, 96)
    cases = [
        (kt.pack_bf16.default, (w, gate_up)),
        (kt.pack_int8.default, (w, gate_up)),
        (kt.pack_int4.default, (w, 32, gate_up)),
        (kt.pack_bf16.default, (w.transpose(1, 2).contiguous().transpose(1, 2).to(torch.bfloat16), gate_up)),
    ]
    for op, args in cases:
        opcheck(op, args)
    opcheck(kt.pack_int4.default, (torch.randn(2, 64, 128),), {"group_size": 64, "gate_up": gate_up})
    opcheck(kt.pack_int4.default, (torch.randn(2, 64, 256),), {"group_size": 64, "gate_up": gate_up, "two_level": True})
    opcheck(kt.unpack.default, (*kt.pack_int4(torch.randn(2, 64, 256), group_size=32, gate_up=gate_up,
                                              two_level=True), gate_up))
    opcheck(kt.unpack.default, (kt.pack_bf16(w, gate_up=gate_up), None, gate_up))
    opcheck(kt.unpack.default, (*kt.pack_int8(w, gate_up=gate_up), gate_up))
    opcheck(kt.unpack.default, (*kt.pack_int4(w, group_size=32, gate_up=gate_up), gate_up))


def test_pack_and_unpack_on_meta_give_the_real_shapes():
    w = torch.randn(3, 128, 96)
    for fn in (
        lambda t: kt.pack_bf16(t, gate_up=True),
        lambda t: kt.pack_int8(t, gate_up=True),
        lambda t: kt.pack_int4(t, group_size=32, gate_up=True),
    ):
        real, meta = fn(w), fn(w.to("meta"))
        real, meta = (real, meta) if isinstance(real, tuple) else ((real,), (meta,))
        for r, m in zip(real, meta):
            assert m.device.type == "meta" and m.shape == r.shape and m.dtype == r.dtype


@pytest.mark.parametrize("bits,mins,mxfp4", [(8, False, False), (4, False, False), (4, True, False), (4, False, True)],
                         ids=["int8", "int4", "int4_affine", "mxfp4"])
@pytest.mark.parametrize("gate_up", [False, True])
def test_pack_quantized_into_out_equals_a_new_tensor(bits, mins, mxfp4, gate_up):
    """pack_quantized(out=): the packed codes written into the given tensor (rows of a layer's, as the GGUF loader
    packs chunks in place), equal to a fresh pack; an out of another shape or dtype is not written (a new tensor)."""
    from ktorch.ops.moe import pack_quantized
    from ktorch.ops.packed_weights import MXFP4_CODES

    gen = torch.Generator().manual_seed(7)
    E, N, K, G = 3, 64, 96, 3
    if mxfp4:
        codes = torch.tensor(MXFP4_CODES)[torch.randint(0, 16, (E, N, K), generator=gen)]
    else:
        lo, hi = (-128, 128) if bits == 8 else ((0, 16) if mins else (-8, 8))
        codes = torch.randint(lo, hi, (E, N, K), generator=gen)
    scales = torch.rand(E, N, G, generator=gen) + 0.1
    m = torch.rand(E, N, G, generator=gen) if mins else None
    fresh, s = pack_quantized(codes, scales, m, bits=bits, gate_up=gate_up, mxfp4=mxfp4)
    layer = torch.zeros((E + 2, *fresh.shape[1:]), dtype=fresh.dtype)  # the chunk's rows 1..E of a layer
    got, s2 = pack_quantized(codes, scales, m, bits=bits, gate_up=gate_up, mxfp4=mxfp4, out=layer[1:E + 1])
    assert got.data_ptr() == layer[1].data_ptr() and torch.equal(s2, s)
    assert torch.equal(layer[1:E + 1].view(torch.uint8), fresh.view(torch.uint8))
    assert not layer[0].view(torch.uint8).any() and not layer[E + 1].view(torch.uint8).any()
    wrong = torch.zeros((E + 1, *fresh.shape[1:]), dtype=fresh.dtype)
    other, _ = pack_quantized(codes, scales, m, bits=bits, gate_up=gate_up, mxfp4=mxfp4, out=wrong)
    assert other.data_ptr() != wrong.data_ptr() and not wrong.view(torch.uint8).any()
    assert torch.equal(other.view(torch.uint8), fresh.view(torch.uint8))
