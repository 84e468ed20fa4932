"""GGUF expert types kept exact (docs/loading.md, "exact formats"): Q8_0, Q6_K, Q5_K as grouped int8 codes, Q4_0 and
Q4_K as int4 nibbles, MXFP4 as 4-bit E2M1 codes (tests/test_ops_mxfp4.py has more), each with the file's scales (and
minimums) per group.

Per type: blocks written by the gguf writer (ktorch/integrations/gguf_writer.py: the gguf package's quantizers, and
ktorch's for the K-quants, which the package only decodes), their codes read by gguf_loading.exact_codes, packed by
ktorch.ops.moe.pack_quantized; kt.unpack must give gguf.quants.dequantize of the same bytes bit for bit, and
kt.fused_moe must match the float64 reference on those weights as tightly as the int8 format does
(tests/test_ops_fused_moe.py's tolerance: the op's own error, its int8 activations).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.library import opcheck

import ktorch

gguf = pytest.importorskip("gguf")  # the blocks are written and decoded by the gguf package
from ktorch.integrations.gguf_loading import EXACT_TYPES, KSCALE_TYPES, exact_codes, exact_kscales
from ktorch.integrations.gguf_writer import encode
from ktorch.ops.moe import PackedExperts, pack_kscales, pack_quantized
from ktorch.ops.packed_weights import kscales_as_float
from reference import fused_moe_reference, relative_error

TYPES = sorted(EXACT_TYPES)
INT8_TOLERANCE = 3e-2  # tests/test_ops_fused_moe.py's int8 bound


def file_blocks(shape: tuple, type_name: str, scale: float) -> np.ndarray:
    """Random Gaussian weights of ``shape`` [E, N, K] (times ``scale``) written as GGUF blocks of ``type_name``."""
    x = (np.random.default_rng(int(torch.randint(0, 2**31, ())))
         .standard_normal(shape).astype(np.float32) * np.float32(scale))
    return encode(x, type_name)


def file_values(data: np.ndarray, type_name: str) -> torch.Tensor:
    return torch.from_numpy(np.asarray(gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name]),
                                       dtype=np.float32))


def pack_file(data: np.ndarray, type_name: str, gate_up: bool, two_level: bool = False):
    """(packed, scales) of GGUF blocks; two_level: the K-quant scales at the file's size (pack_kscales)."""
    codes, scales, mins = exact_codes(data, type_name)
    bits, _, _, table = EXACT_TYPES[type_name]
    packed, scales = pack_quantized(codes, scales, mins, bits=bits, gate_up=gate_up, mxfp4=table == "mxfp4")
    if two_level and type_name in KSCALE_TYPES:
        scales = pack_kscales(*exact_kscales(data, type_name), gate_up=gate_up)
    elif two_level and type_name == "Q8_0":  # the file's float16 d
        scales = scales.half()
    return packed, scales


def exact_experts(E: int, H: int, I: int, types: tuple[str, str, str], two_level: bool = False):
    """Experts whose gate, up, down are GGUF blocks of types[0..2]: (PackedExperts, gate_up [E, 2I, H], down
    [E, H, I] as the file's values). gate and up of one type (the loader's wider form for mixed ones is tested in
    tests/test_load_gguf.py)."""
    assert types[0] == types[1]
    gate_up_data = file_blocks((E, 2 * I, H), types[0], 1 / math.sqrt(H))
    down_data = file_blocks((E, H, I), types[2], 1 / math.sqrt(I))
    w13, s13 = pack_file(gate_up_data, types[0], gate_up=True, two_level=two_level)
    w2, s2 = pack_file(down_data, types[2], gate_up=False, two_level=two_level)
    packed = PackedExperts(w13, s13, w2, s2, "gguf:" + "/".join(dict.fromkeys(types)))
    return packed, file_values(gate_up_data, types[0]), file_values(down_data, types[2])


def make_routing(T: int, E: int, K: int):
    ids = torch.rand(T, E).argsort(dim=1)[:, :K]
    weights = torch.rand(T, K) + 0.1
    return ids, weights / weights.sum(dim=1, keepdim=True)


# ---------------------------------------------------------------- the weights are the file's


@pytest.mark.parametrize("gate_up", [False, True], ids=["plain", "gate_up"])
@pytest.mark.parametrize("type_name", TYPES)
def test_unpack_equals_gguf_dequantize(type_name, gate_up, seed):
    E, N, K = 3, 128, 512
    data = file_blocks((E, N, K), type_name, 0.05)
    packed, scales = pack_file(data, type_name, gate_up)
    bits, group, affine, table = EXACT_TYPES[type_name]
    assert packed.dtype == (torch.int8 if bits == 8 else torch.float4_e2m1fn_x2 if table == "mxfp4" else torch.uint8)
    assert scales.shape == ((E, 2, K // group, N) if affine else (E, K // group, N))
    got = torch.ops.kt.unpack(packed, scales, gate_up=gate_up)
    want = file_values(data, type_name)
    assert want.abs().max() > 0
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err <= 1e-6, f"seed={seed} {type_name}: unpack differs from gguf.quants.dequantize by {err:.3g}"
    assert torch.equal(got, want), f"seed={seed} {type_name}: not bit for bit"


def test_mxfp4_extreme_scales(seed):
    """MXFP4's scale 2**(e - 128) for the smallest and largest bytes the loader accepts (0, 1: subnormal floats;
    252): every code under each is exact."""
    E, N, K = 1, 16, 32
    rows = []
    for e in (0, 1, 2, 127, 128, 252):
        for code_row in range(N // 6 + 1):
            codes = (np.arange(32) + code_row) % 16
            qs = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)
            rows.append(np.concatenate([[e], qs]).astype(np.uint8))
    data = np.stack(rows[:N]).reshape(E, N, 17)
    packed, scales = pack_file(data, "MXFP4", False)
    assert torch.equal(torch.ops.kt.unpack(packed, scales), file_values(data, "MXFP4"))


# ---------------------------------------------------------------- the op on them


@pytest.mark.parametrize("T", [1, 7, 64, 300])
@pytest.mark.parametrize("types", [(t, t, t) for t in TYPES] + [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q8_0")],
                         ids=lambda ts: "-".join(dict.fromkeys(ts)))
def test_fused_moe_matches_reference(kernel, types, T, seed):
    E, K, H, I = 6, 2, 256, 512
    packed, gate_up, down = exact_experts(E, H, I, types)
    g13, g2 = packed.dequantize()
    assert torch.equal(g13, gate_up) and torch.equal(g2, down)
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = make_routing(T, E, K)
    out = ktorch.fused_moe(hidden, ids, weights, packed)
    ref = fused_moe_reference(hidden, ids, weights, gate_up, down, "silu")
    err = relative_error(out, ref)
    tol = INT8_TOLERANCE * (4 / 3 if T < 4 else 1)  # as tests/test_ops_fused_moe.py: few rows average nothing
    assert err <= tol, f"seed={seed} {kernel} {types} T={T}: relative error {err:.4g} > {tol}"


@pytest.mark.parametrize("two_level", [False, True], ids=["float32", "two_level"])
@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q4_K"), ("Q4_K", "Q4_K", "Q6_K"), ("Q6_K", "Q6_K", "Q6_K"),
                                   ("Q5_K", "Q5_K", "Q5_K"), ("Q8_0", "Q8_0", "Q8_0")], ids=lambda ts: "-".join(dict.fromkeys(ts)))
def test_fused_moe_every_call_on_tiles(kernel, types, two_level, seed):
    """AMX: every call through the tiles, small T too: affine int4 on the tiles with float32 scales (sent to AVX-512)
    or two-level ones (the two-plane walk), grouped int8 sent to AVX-512 except Q6_K and Q5_K with their two-level
    scales (the two-plane walk)."""
    if kernel != "amx":
        pytest.skip("the tile walk's small-call threshold exists at the amx level only")
    E, K, H, I = 7, 3, 768, 256  # (K-quant rows: multiples of 256)
    packed, gate_up, down = exact_experts(E, H, I, types, two_level=two_level)
    try:
        torch.ops.kt._amx_min_rows_for_tests(0)
        for T in (1, 2, 5, 17, 70):
            hidden = torch.randn(T, H).to(torch.bfloat16)
            ids, weights = make_routing(T, E, K)
            out = ktorch.fused_moe(hidden, ids, weights, packed)
            ref = fused_moe_reference(hidden, ids, weights, gate_up, down, "silu")
            err = relative_error(out, ref)
            assert err <= INT8_TOLERANCE * 4 / 3, f"seed={seed} {types} T={T} on tiles: {err:.4g}"
    finally:
        torch.ops.kt._amx_min_rows_for_tests(-1)


def test_amx_int4_walk_on_q4_k(kernel, seed):
    """AMX: Q4_K (affine int4, groups of 32) under the int4 tile walk, every call on the tiles, up to ~300 rows an
    expert (two walks a call): within int8's tolerance of the reference."""
    if kernel != "amx":
        pytest.skip("the int4 tile walk exists at the amx level only")
    E, K, H, I = 7, 3, 512, 256
    packed, gate_up, down = exact_experts(E, H, I, ("Q4_K", "Q4_K", "Q4_K"))
    try:
        torch.ops.kt._amx_min_rows_for_tests(0)
        for T in (17, 300, 700):
            hidden = torch.randn(T, H).to(torch.bfloat16)
            ids, weights = make_routing(T, E, K)
            out = ktorch.fused_moe(hidden, ids, weights, packed)
            err = relative_error(out, fused_moe_reference(hidden, ids, weights, gate_up, down, "silu"))
            assert err <= INT8_TOLERANCE, f"seed={seed} T={T}: relative error {err:.4g}"
    finally:
        torch.ops.kt._amx_min_rows_for_tests(-1)


def test_affine_minimums_are_applied(seed):
    """Q4_K's weights are s*q - m: the same packed codes read as symmetric int4 (the minimums dropped, -8 applied)
    move the output far past the tolerance, so the reference comparison sees the minimums."""
    E, K, H, I, T = 2, 1, 256, 256, 5
    packed, gate_up, down = exact_experts(E, H, I, ("Q4_K", "Q4_K", "Q4_K"))
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = make_routing(T, E, K)
    ref = fused_moe_reference(hidden, ids, weights, gate_up, down, "silu")
    out = ktorch.fused_moe(hidden, ids, weights, packed)
    assert relative_error(out, ref) <= INT8_TOLERANCE
    no_mins = PackedExperts(packed.w13, packed.w13_scales[:, 0].contiguous(), packed.w2,
                            packed.w2_scales[:, 0].contiguous(), "int4")
    wrong = ktorch.fused_moe(hidden, ids, weights, no_mins)
    assert relative_error(wrong, ref) > 10 * INT8_TOLERANCE


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q5_K"), ("Q8_0", "Q8_0", "Q8_0")],
                         ids=lambda ts: "-".join(dict.fromkeys(ts)))
def test_opcheck(types):
    E, K, H, I, T = 4, 2, 256, 256, 5
    packed, _, _ = exact_experts(E, H, I, types)
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = make_routing(T, E, K)
    opcheck(torch.ops.kt.fused_moe, (hidden, ids, weights, *packed.tensors(), "silu"))
    opcheck(torch.ops.kt.unpack, (packed.w13, packed.w13_scales, True))


# ---------------------------------------------------------------- K-quant scales at the file's size (two-level)

KSCALE_MIXES = [("Q4_K",) * 3, ("Q4_K", "Q4_K", "Q6_K"), ("Q5_K",) * 3, ("Q6_K",) * 3, ("Q5_K", "Q5_K", "Q8_0")]


@pytest.mark.parametrize("types", KSCALE_MIXES, ids=lambda ts: "-".join(dict.fromkeys(ts)))
def test_kscales_same_output_as_float_scales(kernel, types, seed):
    """The same blocks with two-level scales (a sub-scale a group, d and dmin a 256) and with float32 scales a group:
    the op's output bit for bit at this kernel level (T = 1, 5 and 300: decode, small and tiled calls), the float64
    reference met, the weights (kt.unpack, the device paths' dequantize_packed) the file's, the scales' bytes the
    file's (Q4_K 0.59375 a weight with its codes)."""
    E, K, H, I = 6, 2, 512, 256
    state = torch.random.get_rng_state()
    ref_packed, gate_up, down = exact_experts(E, H, I, types)
    torch.random.set_rng_state(state)  # the same blocks again, two-level
    packed, gate_up2, down2 = exact_experts(E, H, I, types, two_level=True)
    assert torch.equal(gate_up, gate_up2) and torch.equal(down, down2)
    for s, ref_s, K_in, t in ((packed.w13_scales, ref_packed.w13_scales, H, types[0]),
                              (packed.w2_scales, ref_packed.w2_scales, I, types[2])):
        assert torch.equal(kscales_as_float(s, K_in), ref_s)
        group = EXACT_TYPES[t][1]
        if t == "Q8_0":  # float16 per group
            assert s.dtype == torch.float16 and s.shape == ref_s.shape
            continue
        assert s.dtype == (torch.int8 if t == "Q6_K" else torch.uint8)
        assert s[0].numel() == (2 if t != "Q6_K" else 1) * (K_in // group + 4 * K_in // 256) * s.shape[-1]
    if types[0] == "Q4_K":
        w = packed.w13[0].numel() + packed.w13_scales[0].numel()
        assert w / (2 * I * H) == 0.59375
    g13, g2 = packed.dequantize()
    assert torch.equal(g13, gate_up) and torch.equal(g2, down)
    from ktorch.ops.packed_weights import dequantize_packed

    assert torch.equal(dequantize_packed(packed.w2, packed.w2_scales, False, torch.float32), down.transpose(1, 2))
    for T in (1, 5, 300):
        hidden = torch.randn(T, H).to(torch.bfloat16)
        ids, weights = make_routing(T, E, K)
        out = ktorch.fused_moe(hidden, ids, weights, packed)
        want = ktorch.fused_moe(hidden, ids, weights, ref_packed)
        if kernel == "amx" and set(types) & {"Q4_K", "Q5_K", "Q6_K"} and T >= 16:
            # the AMX walk of Q4_K, Q5_K and Q6_K takes the integer sub-scales and sums 256-wide super-blocks in its tiles (the
            # float32 form goes to AVX-512, one group at a time): the same values within fp32 rounding, then bf16's. An output
            # near zero (cancelling terms) carries the fp32 rounding of its terms' size, not its own: the absolute
            # slack is 2^-9 of the largest output (half a bf16 step there; the device failed 1e-6 of it with either
            # scale path, seeds 2169552713 and 2207428720, session 42)
            assert torch.allclose(out.float(), want.float(), rtol=2 ** -7, atol=2 ** -9 * want.abs().max().item()), \
                f"seed={seed} {kernel} {types} T={T}: two-level differs from float32 scales by more than rounding"
        else:
            assert torch.equal(out, want), f"seed={seed} {kernel} {types} T={T}: two-level differs from float32 scales"
        ref = fused_moe_reference(hidden, ids, weights, gate_up, down, "silu")
        assert relative_error(out, ref) <= INT8_TOLERANCE * (4 / 3 if T < 4 else 1)


def test_kscales_opcheck_numa_and_errors(seed):
    """opcheck of fused_moe and unpack on two-level scales; the NUMA split (slices hold the float32 form) matches
    the unsplit op; scales with a row count that is no sub-scales + K/64 are errors, not wrong answers."""
    E, K, H, I, T = 4, 2, 256, 512, 5
    state = torch.random.get_rng_state()
    ref_packed, _, _ = exact_experts(E, H, I, ("Q6_K",) * 3)
    torch.random.set_rng_state(state)
    packed, _, _ = exact_experts(E, H, I, ("Q6_K",) * 3, two_level=True)
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = make_routing(T, E, K)
    opcheck(torch.ops.kt.fused_moe, (hidden, ids, weights, *packed.tensors(), "silu"))
    opcheck(torch.ops.kt.unpack, (packed.w13, packed.w13_scales, True))
    split, ref_split = packed.split_numa(2), ref_packed.split_numa(2)
    for a, b in zip(split.op_args(), ref_split.op_args()):
        assert all(torch.equal(x, y) for x, y in zip(a, b)) if isinstance(a, (list, tuple)) else a == b
    assert torch.equal(ktorch.fused_moe(hidden, ids, weights, split), ktorch.fused_moe(hidden, ids, weights, ref_split))
    state = torch.random.get_rng_state()
    q8_ref, _, _ = exact_experts(E, H, I, ("Q8_0",) * 3)
    torch.random.set_rng_state(state)
    q8, _, _ = exact_experts(E, H, I, ("Q8_0",) * 3, two_level=True)  # float16 scales
    assert q8.w2_scales.dtype == torch.float16
    opcheck(torch.ops.kt.fused_moe, (hidden, ids, weights, *q8.tensors(), "silu"))
    q8_split = q8.split_numa(2)
    assert q8_split.op_args()[3][0].dtype == torch.float32
    assert torch.equal(ktorch.fused_moe(hidden, ids, weights, q8_split),
                       ktorch.fused_moe(hidden, ids, weights, q8_ref.split_numa(2)))
    q4, _, _ = exact_experts(E, H, I, ("Q4_K",) * 3, two_level=True)
    opcheck(torch.ops.kt.fused_moe, (hidden, ids, weights, *q4.tensors(), "silu"))
    bad = q4.w2_scales[:, :, 1:].contiguous()  # one sub-scale row short: groups no longer whole per 256
    with pytest.raises(RuntimeError, match="two-level"):
        torch.ops.kt.fused_moe(hidden, ids, weights, q4.w13, q4.w13_scales, q4.w2, bad)
    with pytest.raises(RuntimeError, match="two-level"):
        torch.ops.kt.unpack(q4.w2, bad)


def test_kscales_device_forms(seed):
    """GPU residents (the CPU standing in) hold two-level scales as their float32 form: the same tensors as the
    float32 form's residents, counted as such (resident_bytes_per_expert); the streamed experts' dequantization
    (dequantize_packed) of both forms is equal."""
    from ktorch.gpu_memory import _resident_tensors, resident_bytes_per_expert
    from ktorch.ops.packed_weights import dequantize_packed

    state = torch.random.get_rng_state()
    ref, _, _ = exact_experts(5, 256, 256, ("Q4_K", "Q4_K", "Q6_K"))
    torch.random.set_rng_state(state)
    two, _, _ = exact_experts(5, 256, 256, ("Q4_K", "Q4_K", "Q6_K"), two_level=True)
    modules = []
    for p in (ref, two):
        m = torch.nn.Module()
        m.kt_w13, m.kt_w13_scales, m.kt_w2, m.kt_w2_scales = p.tensors()
        modules.append(m)
    ids = torch.tensor([4, 1])
    got, want = (_resident_tensors(m, ids, torch.device("cpu"), False) for m in (modules[1], modules[0]))
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
    assert resident_bytes_per_expert(modules[1]) == resident_bytes_per_expert(modules[0])
    for w, s, r, gu in ((two.w13, two.w13_scales, ref.w13_scales, True), (two.w2, two.w2_scales, ref.w2_scales, False)):
        assert torch.equal(dequantize_packed(w, s, gu, torch.float32), dequantize_packed(w, r, gu, torch.float32))


# ---------------------------------------------------------------- bad input


def test_bad_scales_are_errors():
    E, H, I = 2, 256, 256
    packed, _, _ = exact_experts(E, H, I, ("Q4_K", "Q4_K", "Q6_K"))
    hidden = torch.randn(3, H).to(torch.bfloat16)
    ids, weights = make_routing(3, E, 1)
    bad = packed.w13_scales.reshape(E, 2, -1)  # 3-D view of the wrong size
    with pytest.raises(RuntimeError, match="w13_scales"):
        torch.ops.kt.fused_moe(hidden, ids, weights, packed.w13, bad.contiguous(), packed.w2, packed.w2_scales)
    three = torch.ones(E, 3, H // 32, 2 * I)  # [E, 3, G, N]: neither [E, G, N] nor [E, 2, G, N]
    with pytest.raises(RuntimeError, match=r"\[E, 2, G, N\]|needs"):
        torch.ops.kt.fused_moe(hidden, ids, weights, packed.w13, three, packed.w2, packed.w2_scales)
    eight = torch.ones(E, I // 8, H)  # int8 groups of 8
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.kt.fused_moe(hidden, ids, weights, packed.w13, packed.w13_scales, packed.w2, eight)
    with pytest.raises(RuntimeError, match="both be bf16 or both quantized"):
        torch.ops.kt.fused_moe(hidden, ids, weights, packed.w13, packed.w13_scales,
                               torch.zeros(E, H // 16, I // 2, 16, 2, dtype=torch.bfloat16), None)


def test_pack_quantized_rejects_codes_out_of_range():
    codes = torch.full((1, 16, 32), 16, dtype=torch.int8)
    scales = torch.ones(1, 16, 1)
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_quantized(codes, scales, torch.zeros_like(scales), bits=4)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_quantized(codes, scales, bits=4)
    with pytest.raises(ValueError, match="multiple of 16"):
        pack_quantized(codes.to(torch.int8), torch.ones(1, 16, 4), bits=8)  # groups of 8


@pytest.mark.parametrize("gate_up", [False, True])
def test_pack_quantized_int8_takes_unaligned_and_strided_codes(gate_up):
    """The int8 layout is copied as 4-byte words: codes at an odd offset of their storage, transposed codes or a
    wider integer dtype pack to the same bytes as their contiguous int8 copy."""
    g = torch.Generator().manual_seed(3)
    E, N, K = 2, 128, 64
    flat = torch.randint(-128, 128, (E * N * K + 1,), dtype=torch.int8, generator=g)
    odd = flat[1:].view(E, N, K)  # storage offset 1
    scales = torch.rand(E, N, 2, generator=g)
    want = pack_quantized(odd.clone(), scales, bits=8, gate_up=gate_up)
    rows = odd.reshape(E, 2, N // 64, 32, K).transpose(1, 2).reshape(E, N, K) if gate_up else odd
    assert torch.equal(want[0], rows.reshape(E, N // 16, 16, K // 4, 4).permute(0, 1, 3, 2, 4))  # [E, N/16, K/4, 16, 4]
    for codes in (odd, odd.transpose(1, 2).contiguous().transpose(1, 2), odd.to(torch.int16)):
        got = pack_quantized(codes, scales, bits=8, gate_up=gate_up)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---------------------------------------------------------------- other paths that read the packed experts


def test_numa_split_of_grouped_int8(seed):
    """The NUMA split cuts Q8_0/Q6_K experts at whole groups of the down scales (two slices, run where this machine
    has one node too) and matches the reference; affine scales are refused with the shape named."""
    E, K, H, I, T = 4, 2, 256, 512, 9
    for types in (("Q8_0",) * 3, ("Q6_K",) * 3):
        packed, gate_up, down = exact_experts(E, H, I, types)
        split = packed.split_numa(2)
        hidden = torch.randn(T, H).to(torch.bfloat16)
        ids, weights = make_routing(T, E, K)
        out = ktorch.fused_moe(hidden, ids, weights, split)
        ref = fused_moe_reference(hidden, ids, weights, gate_up, down, "silu")
        assert relative_error(out, ref) <= INT8_TOLERANCE, f"seed={seed} {types}"
    packed, _, _ = exact_experts(E, H, I, ("Q4_K",) * 3)
    with pytest.raises(RuntimeError, match="w13_scales must be float32"):
        packed.split_numa(2)


@pytest.mark.parametrize("types", [("Q4_K", "Q4_K", "Q6_K"), ("Q5_K", "Q5_K", "Q8_0")], ids=["Q4_K_M", "Q5_K-Q8_0"])
def test_streamed_dequantize_matches_unpack(types):
    """The device paths' dequantization (streamed experts) of the exact formats: kt.unpack's weights, transposed."""
    from ktorch.ops.streamed_experts import dequantize_packed

    packed, gate_up, down = exact_experts(3, 256, 256, types)
    assert torch.equal(dequantize_packed(packed.w13, packed.w13_scales, True, torch.float32), gate_up.transpose(1, 2))
    assert torch.equal(dequantize_packed(packed.w2, packed.w2_scales, False, torch.float32), down.transpose(1, 2))


def test_pack_kscales_and_kscales_as_float_refuse_bad_shapes():
    """pack_kscales and kscales_as_float name what is wrong with two-level scales they cannot read."""
    sub, sup = torch.randint(0, 64, (2, 64, 8), dtype=torch.uint8), torch.rand(2, 64, 1)
    with pytest.raises(ValueError, match="pack_kscales: expected sub uint8/int8"):
        pack_kscales(sub.float(), sup)
    with pytest.raises(ValueError, match="pack_kscales: expected sub uint8/int8"):
        pack_kscales(sub[:, :, :7], torch.rand(2, 64, 2))  # S does not divide G
    with pytest.raises(ValueError, match="sub_mins and super_mins must both be None"):
        pack_kscales(sub, sup, sub_mins=sub)
    with pytest.raises(ValueError, match="N=48 must be a multiple of 64"):
        pack_kscales(sub[:, :48], sup[:, :48], gate_up=True)
    packed = pack_kscales(sub, sup)  # [2, 8 + 4, 64] for K = 256
    assert torch.equal(kscales_as_float(packed, 256), sup.repeat_interleave(8, dim=2).transpose(1, 2) *
                       sub.transpose(1, 2).float())
    with pytest.raises(ValueError, match="kscales_as_float: two-level scales must be"):
        kscales_as_float(packed, 1024)  # K/64 = 16 super-scale rows: more than the tensor's 12 rows
    with pytest.raises(ValueError, match="kscales_as_float: two-level scales must be"):
        kscales_as_float(packed, 200)  # K not a multiple of 256
