"""Resident experts at decode: the int8 row layout (ktorch/ops/resident_rows.py) and its Triton kernels
(ktorch/ops/triton_experts.py), which residents take it, and the CPU op skipped by a layer whose every expert is on
the device (ktorch/integrations/transformers_experts.py).

On the CPU the "device" is the CPU: the repacking, swaps in place, the dequantized path prefill takes and the
CPU-op skip run here (the row layout forced where a test says so: it is chosen only on CUDA with Triton) and are
compared bit for bit with the packed layout and against HF eager; the Triton kernels, their CUDA-graph capture and a
model decoding through them need CUDA and Triton and are skipped without them.
"""

from __future__ import annotations

import collections
import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ktorch
from ktorch.gpu_memory import (device_bytes_held, place_resident_experts, reset_resident_hits, resident_hits,
                               update_resident_experts)
from ktorch.integrations import transformers_experts
from ktorch.ops import resident_rows, triton_experts
from ktorch.ops.gpu_experts import GATHER_MAX_TOKENS, gpu_experts_forward, packed_experts_forward
from ktorch.ops.moe import pack_quantized
from ktorch.ops.packed_weights import dequantize_packed
from ktorch.ops.resident_rows import RowExperts, dequantize_rows, row_layout_applies, rows_experts_forward, \
    rows_from_packed
from ktorch.ops.routed_experts import SplitCosts
from models import assert_logits_match, moe_experts_modules, tiny_model
from reference import fused_moe_reference, relative_error

needs_cuda_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or not triton_experts.triton_available(),
    reason="the Triton decode kernels need a CUDA GPU and Triton")
# the kernels on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, Triton installed)
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS_RUN = triton_experts.triton_available() and (torch.cuda.is_available() or triton_experts.interpreting())
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN,
    reason="the Triton decode kernels need Triton and a CUDA GPU, or Triton's interpreter (TRITON_INTERPRET=1)")
COSTS = SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=1e-3, cpu_row_s=1e-5, cpu_expert_s=5e-4)
# int8 per channel (pack_experts), a scale per 32 (Q8_0, MXFP4), a scale per 16 (Q6_K), affine int8 codes 0..31 with
# a scale and minimum per 32 (Q5_K), int4 per 32 (pack_experts), int4 codes -8..7 per 32 (Q4_0), affine nibbles with a
# scale and minimum per 32 (Q4_K), and Q4_K_M's mix (Q4_K gate/up, Q6_K down)
FORMATS = [("int8", None), ("int8", 32), ("int8", 16), ("q5_k", 32), ("int4", 32), ("q4_0", 32), ("q4_k", 32),
           ("q4_k_m", 32)]
FORMAT_IDS = ["int8", "int8_g32", "int8_g16", "q5_k", "int4_g32", "q4_0", "q4_k", "q4_k_m"]
# GGUF-style codes: (bits, code range, affine)
CODES = {"int8": (8, (-128, 127), False), "q5_k": (8, (0, 31), True), "q4_0": (4, (-8, 7), False),
         "q4_k": (4, (0, 15), True)}


def _codes(fmt, group_size, n, N, K, gate_up):
    """(pack_quantized of random codes of ``fmt`` (CODES), (codes, scales, mins or None)): the values w = s q - m."""
    bits, (lo, hi), affine = CODES[fmt]
    codes = torch.randint(lo, hi + 1, (n, N, K))
    s = torch.rand(n, N, K // group_size) / (max(-lo, hi) * K**0.5)
    m = torch.rand_like(s) * (hi / 2) * s if affine else None  # minimums about half the codes' range: w centred
    return pack_quantized(codes, s, m, bits=bits, gate_up=gate_up), (codes, s, m)


def _experts(fmt, group_size, n=6, H=128, I=64, seed=0):
    """Packed experts (w13, w13_scales, w2, w2_scales) and, for the GGUF-style formats, the codes, scales and mins
    they were packed from (``pack_quantized``, as the exact GGUF types load): [(c13, s13, m13), (c2, s2, m2)]."""
    torch.manual_seed(seed)
    if fmt == "q4_k_m":
        (w13, source13), (w2, source2) = (_codes("q4_k", group_size, n, 2 * I, H, True),
                                          _codes("int8", 16, n, H, I, False))
        return (*w13, *w2), [source13, source2]
    if fmt in CODES and not (fmt == "int8" and group_size is None):
        (w13, source13), (w2, source2) = (_codes(fmt, group_size, n, 2 * I, H, True),
                                          _codes(fmt, group_size, n, H, I, False))
        return (*w13, *w2), [source13, source2]
    packed = ktorch.pack_experts(torch.randn(n, 2 * I, H) / H**0.5, torch.randn(n, H, I) / I**0.5, fmt, group_size)
    return packed.tensors()[:4], None


def _row_bytes(codes: torch.Tensor, affine: bool) -> torch.Tensor:
    """The row layout's bytes of 4-bit codes [n, N, K] (module docstring of resident_rows): byte 4o + b holds column
    8o + b in its low nibble and 8o + 4 + b in its high one, stored + 8 when symmetric."""
    u = (codes + (0 if affine else 8)).to(torch.uint8)
    n, N, K = u.shape
    blocks = u.view(n, N, K // 8, 2, 4)
    return (blocks[:, :, :, 0] | (blocks[:, :, :, 1] << 4)).reshape(n, N, K // 2)


def _reference(hidden, slots, weights, rows: RowExperts, activation="silu") -> torch.Tensor:
    """float64 out [T, H] from the row layout's own values."""
    rows = RowExperts(*(t.cpu() for t in rows))
    return fused_moe_reference(hidden.cpu(), slots.cpu(), weights.cpu(),
                               dequantize_rows(rows.w13, rows.w13_scales, torch.float64).transpose(1, 2),
                               dequantize_rows(rows.w2, rows.w2_scales, torch.float64).transpose(1, 2), activation)


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
def test_rows_hold_the_packed_values(fmt, group_size):
    """The row layout dequantizes bit for bit to what dequantize_packed gives, in the same bytes; GGUF-style codes
    packed with pack_quantized come back as they were given (4-bit: two a byte in the documented order; affine:
    each row's scales, then its minimums), and their values are s q - m in float64."""
    packed, source = _experts(fmt, group_size)
    p13, s13, p2, s2 = packed
    rows = rows_from_packed(*packed)
    for q, s, p, N, K in ((rows.w13, rows.w13_scales, p13, 128, 128), (rows.w2, rows.w2_scales, p2, 128, 64)):
        assert q.dtype == p.dtype and q.shape == (6, N, K if p.dtype == torch.int8 else K // 2)
        assert s.dtype == torch.float32 and s.shape[:2] == (6, N)
    assert sum(t.numel() * t.element_size() for t in rows) == sum(t.numel() * t.element_size() for t in packed)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_rows(rows.w13, rows.w13_scales, dtype), dequantize_packed(p13, s13, True, dtype))
        assert torch.equal(dequantize_rows(rows.w2, rows.w2_scales, dtype), dequantize_packed(p2, s2, False, dtype))
    if source is None:
        return
    for q, scales, (codes, s, m) in ((rows.w13, rows.w13_scales, source[0]), (rows.w2, rows.w2_scales, source[1])):
        affine = m is not None
        assert torch.equal(q, codes.to(torch.int8) if q.dtype == torch.int8 else _row_bytes(codes, affine))
        assert torch.equal(scales, torch.stack([s, m], 2) if affine else s)
        group = codes.shape[2] // s.shape[2]
        want = codes.double() * s.double().repeat_interleave(group, 2)
        if affine:
            want -= m.double().repeat_interleave(group, 2)
        got = dequantize_rows(q, scales, torch.float64).transpose(1, 2)  # computed in float32, rounded once
        assert torch.allclose(got, want, rtol=2**-23, atol=2**-23 * want.abs().max().item())


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("kernel,dtype,T", [("gather", torch.float32, 3), ("auto", torch.bfloat16, 1),
                                            ("gather", torch.bfloat16, 9), ("grouped_mm", torch.bfloat16, 40)])
def test_rows_forward_off_cuda_equals_the_packed_one(fmt, group_size, kernel, dtype, T):
    """Off CUDA (and on CUDA for prefill) rows_experts_forward dequantizes every resident and runs
    gpu_experts_forward: bit for bit packed_experts_forward with the same kernel, absent slots included, and within
    rounding of a float64 reference."""
    packed, _ = _experts(fmt, group_size)
    rows = rows_from_packed(*packed)
    K = 4
    hidden = torch.randn(T, 128).to(dtype)
    slots = torch.randint(-1, 6, (T, K))
    weights = torch.rand(T, K)
    want = packed_experts_forward(hidden, slots, weights, packed, "silu", kernel)
    got = rows_experts_forward(hidden, slots, weights, rows, "silu", kernel)
    assert got.dtype == dtype and torch.equal(got, want)
    assert relative_error(got, _reference(hidden, slots, weights, rows)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("kernel,dtype,T", [("auto", torch.bfloat16, 17), ("grouped_mm", torch.bfloat16, 64),
                                            ("gather", torch.bfloat16, 24), ("gather", torch.float32, 17)])
def test_prefill_dequantizes_only_the_experts_it_uses(monkeypatch, fmt, group_size, kernel, dtype, T):
    """A call of more than GATHER_MAX_TOKENS tokens dequantizes the residents its slots use (their rows gathered),
    not all n: bit for bit the result of dequantizing all n and running gpu_experts_forward with the same kernel,
    with absent slots (-1), experts never used (including the first and the last) and one used by a single slot."""
    torch.manual_seed(1)
    n, K = 12, 4
    packed, _ = _experts(fmt, group_size, n=n)
    rows = rows_from_packed(*packed)
    hidden = torch.randn(T, 128).to(dtype)
    slots = torch.tensor([2, 3, 5, 7, 10])[torch.randint(0, 5, (T, K))]
    slots[torch.rand(T, K) < 0.2] = -1
    slots[0, 0], slots[1, 1] = 8, -1  # expert 8: one slot; 0, 1, 4, 6, 9, 11: none
    weights = torch.rand(T, K)
    full = gpu_experts_forward(hidden, slots, weights, dequantize_rows(rows.w13, rows.w13_scales, dtype),
                               dequantize_rows(rows.w2, rows.w2_scales, dtype), "silu", kernel)
    seen = []
    dequantize = resident_rows.dequantize_rows
    monkeypatch.setattr(resident_rows, "dequantize_rows", lambda q, *a: seen.append(q.shape[0]) or dequantize(q, *a))
    got = rows_experts_forward(hidden, slots, weights, rows, "silu", kernel)
    assert seen == [6, 6]  # experts 2, 3, 5, 7, 8, 10
    assert got.dtype == dtype and torch.equal(got, full)
    assert relative_error(got, _reference(hidden, slots, weights, rows)) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    assert torch.equal(rows_experts_forward(hidden, torch.full_like(slots, -1), weights, rows, "silu", kernel),
                       torch.zeros_like(hidden))


def test_used_experts_renumbers_in_order():
    slots = torch.tensor([[7, -1, 3], [3, 12, -1]], dtype=torch.int32)
    used, compact = resident_rows.used_experts(slots)
    assert used.tolist() == [3, 7, 12] and compact.dtype == torch.int32
    assert compact.tolist() == [[1, -1, 0], [0, 2, -1]]


def test_which_residents_take_the_row_layout(monkeypatch):
    """Int8 and int4 codes with per-group float32 scales (symmetric or affine, w13 and w2 each its own format), on
    CUDA, with Triton: rows. bf16, and a w13/w2 mix with bf16, stay packed; so does everything on the CPU or without
    Triton."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(triton_experts, "triton_available", lambda: True)
    for fmt, group_size in FORMATS:
        assert row_layout_applies(*_experts(fmt, group_size)[0], cuda)
        assert not row_layout_applies(*_experts(fmt, group_size)[0], torch.device("cpu"))
    bf16 = _experts("bf16", None)[0]
    assert not row_layout_applies(*bf16, cuda)
    for fmt, group_size in FORMATS:
        other = _experts(fmt, group_size)[0]
        assert not row_layout_applies(*other[:2], *bf16[2:], cuda)
        assert not row_layout_applies(*bf16[:2], *other[2:], cuda)
    int4, q4_k = _experts("int4", 32)[0], _experts("q4_k", 32)[0]
    assert row_layout_applies(*int4[:2], *q4_k[2:], cuda) and row_layout_applies(*q4_k[:2], *int4[2:], cuda)
    monkeypatch.setattr(triton_experts, "triton_available", lambda: False)
    assert not row_layout_applies(*int4, cuda)


def test_rows_refuse_what_they_cannot_hold():
    with pytest.raises(ValueError, match="the row layout takes int8 or int4 packed experts with float32 scales"):
        rows_from_packed(*_experts("bf16", None)[0])
    int8, _ = _experts("int8", None)
    with pytest.raises(ValueError, match="got torch.int8 with scales None"):
        rows_from_packed(int8[0], None, int8[2], int8[3])
    q4_k, _ = _experts("q4_k", 32)
    with pytest.raises(ValueError, match="the row layout takes int8 or int4"):  # minimums without a [n, 2, G, N] shape
        rows_from_packed(q4_k[0], q4_k[1].reshape(6, 1, 2 * q4_k[1].shape[2], -1), q4_k[2], q4_k[3])
    rows = rows_from_packed(*int8)
    hidden, slots, weights = torch.randn(1, 128), torch.zeros(1, 2, dtype=torch.int64), torch.rand(1, 2)
    with pytest.raises(ValueError, match="activation must be one of"):
        rows_experts_forward(hidden, slots, weights, rows, "swiglu")
    if not triton_experts.interpreting():
        with pytest.raises(ValueError, match="run on CUDA tensors"):
            triton_experts.triton_rows_forward(hidden, slots, weights, rows)
    with pytest.raises(ValueError, match="row-layout codes are int8 or uint8"):
        dequantize_rows(rows.w13.float(), rows.w13_scales, torch.float32)


@pytest.mark.parametrize("types", [{"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"},
                                   {"gate": "Q5_K", "up": "Q5_K", "down": "Q8_0"},
                                   {"gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"}],
                         ids=["Q4_K_M", "Q5_K-Q8_0", "Q4_0"])
def test_gguf_experts_take_the_row_layout(types, tmp_path, monkeypatch):
    """Experts loaded exact from a GGUF file (Q4_K_M: int4 affine gate/up, int8 per 16 down; Q5_K: affine int8;
    Q4_0: symmetric int4 per 32) are held as rows on CUDA with Triton, hold the packed values bit for bit, and (with
    the kernels: CUDA, or Triton's interpreter) decode within bf16 rounding of a float64 reference."""
    pytest.importorskip("gguf")
    from ktorch.integrations.gguf_writer import write_gguf_from_model

    torch.manual_seed(0)
    model = tiny_model("qwen3_moe", hidden_size=256, moe_intermediate_size=256, initializer_range=0.04,
                       num_hidden_layers=1)
    path = write_gguf_from_model(model, tmp_path / "k.gguf", experts_type=types["gate"], experts_types=types,
                                 other_type="F16")
    loaded, _ = ktorch.load(path, device="cpu", progress=False)
    m = moe_experts_modules(loaded)[0]
    packed = (m.kt_w13, m.kt_w13_scales, m.kt_w2, m.kt_w2_scales)
    monkeypatch.setattr(triton_experts, "triton_available", lambda: True)
    assert row_layout_applies(*packed, torch.device("cuda"))
    monkeypatch.undo()
    rows = rows_from_packed(*packed)
    want = {"Q4_K": (torch.uint8, 4), "Q5_K": (torch.int8, 4), "Q4_0": (torch.uint8, 3), "Q6_K": (torch.int8, 3),
            "Q8_0": (torch.int8, 3)}
    assert (rows.w13.dtype, rows.w13_scales.dim()) == want[types["gate"]]
    assert (rows.w2.dtype, rows.w2_scales.dim()) == want[types["down"]]
    assert torch.equal(dequantize_rows(rows.w13, rows.w13_scales, torch.float32),
                       dequantize_packed(packed[0], packed[1], True, torch.float32))
    assert torch.equal(dequantize_rows(rows.w2, rows.w2_scales, torch.float32),
                       dequantize_packed(packed[2], packed[3], False, torch.float32))
    if not KERNELS_RUN:
        return
    rows = RowExperts(*(t.to(KERNEL_DEVICE) for t in rows))
    hidden = torch.randn(2, 256).to(torch.bfloat16)
    slots, weights = torch.tensor([[0, 5], [-1, 7]]), torch.rand(2, 2)
    got = triton_experts.triton_rows_forward(*(t.to(KERNEL_DEVICE) for t in (hidden, slots, weights)), rows)
    assert relative_error(got.cpu(), _reference(hidden, slots, weights, rows)) <= 4e-3


# ---------------------------------------------------------------- in a model


class CountOps(TorchDispatchMode):
    """Counts the ops dispatched while active (kt.fused_moe: the CPU op)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _model_with_residents(residents: int, experts_dtype="int8", seed=0, deferred=0, device="cpu"):
    """A tiny Qwen3-MoE (8 experts a layer, 2 layers) prepared on ``device`` with the prefill split (from 8 tokens)
    and ``residents`` resident experts a layer (on the CPU, the CPU stands in for the device)."""
    torch.manual_seed(seed)
    base = tiny_model("qwen3_moe", dtype=torch.float32)
    model = ktorch.prepare(copy.deepcopy(base), device=device, experts_dtype=experts_dtype)
    ktorch.set_stream_experts(model, COSTS)
    for m in moe_experts_modules(model):
        m.kt_routed.min_tokens = 8
        if residents:
            place_resident_experts(m, residents, torch.device(device))
    if deferred:
        ktorch.set_deferred_experts(model, deferred)
    return base, model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _cpu_op_calls(model, ids) -> tuple:
    with CountOps() as ops:
        logits = _logits(model, ids)
    return logits, ops.counts["kt.fused_moe"]


@pytest.mark.parametrize("experts_dtype", ["int8", "int4"])
def test_row_layout_in_a_model_equals_packed_and_swaps_in_place(monkeypatch, experts_dtype):
    """Residents placed as RowExperts (forced here: the CPU stands in for CUDA) hold the packed ones' bytes; decode-
    and prefill-sized calls give the packed layout's logits bit for bit; swaps write rows into the same buffers
    (addresses kept) and still equal the packed layout swapped the same way."""
    base, packed_model = _model_with_residents(3, experts_dtype)
    monkeypatch.setattr(resident_rows, "row_layout_applies", lambda *args: True)
    _, model = _model_with_residents(3, experts_dtype)
    monkeypatch.undo()
    assert all(isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(model))
    assert all(not isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(packed_model))
    cpu = torch.device("cpu")
    assert device_bytes_held(model, cpu) == device_bytes_held(packed_model, cpu)
    short, long = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 24))
    for ids in (short, long):
        assert torch.equal(_logits(model, ids), _logits(packed_model, ids))
    if experts_dtype == "int8":  # int4 is far from HF eager (the residents' own quantization)
        assert_logits_match(base, model, torch.float32, short)
    addresses = [[t.data_ptr() for t in m.kt_gpu_packed] for m in moe_experts_modules(model)]
    for mm in (model, packed_model):
        for m in moe_experts_modules(mm):
            m.kt_routed.frequency.zero_()
            m.kt_routed.frequency[5], m.kt_routed.frequency[6], m.kt_routed.frequency[7] = 100.0, 50.0, 25.0
        assert update_resident_experts(mm)["swapped"] == 6
    assert [[t.data_ptr() for t in m.kt_gpu_packed] for m in moe_experts_modules(model)] == addresses
    for m in moe_experts_modules(model):
        assert sorted(m.kt_gpu_expert_ids) == [5, 6, 7] and isinstance(m.kt_gpu_packed, RowExperts)
        fresh = rows_from_packed(*(t.index_select(0, torch.tensor(m.kt_gpu_expert_ids))
                                   for t in (m.kt_w13, m.kt_w13_scales, m.kt_w2, m.kt_w2_scales)))
        assert all(torch.equal(a, b) for a, b in zip(m.kt_gpu_packed, fresh))  # the rows a fresh placement makes
    for ids in (short, long):
        assert torch.equal(_logits(model, ids), _logits(packed_model, ids))


def _as_mxfp4(model, nibbles: bool):
    """Each experts module of a prepared ``model`` given MXFP4 experts (its weights encoded as MXFP4 blocks by the gguf
    package), as 4-bit codes (``nibbles``) or as the int8 codes of the same blocks."""
    gguf = pytest.importorskip("gguf")  # noqa: F841 (the blocks are written by the gguf package)
    from ktorch.integrations import attach_packed_experts, packed_experts_of
    from ktorch.integrations.gguf_loading import exact_codes
    from ktorch.integrations.gguf_writer import encode
    from ktorch.ops.moe import PackedExperts

    for m in moe_experts_modules(model):
        gate_up, down = packed_experts_of(m).dequantize()
        (c13, s13, _), (c2, s2, _) = (exact_codes(encode(w.numpy(), "MXFP4"), "MXFP4") for w in (gate_up, down))
        bits = 4 if nibbles else 8
        w13, sc13 = pack_quantized(c13, s13, bits=bits, gate_up=True, mxfp4=nibbles)
        w2, sc2 = pack_quantized(c2, s2, bits=bits, mxfp4=nibbles)
        attach_packed_experts(m, PackedExperts(w13, sc13, w2, sc2, "gguf:MXFP4"), m.kt_activation)
    return model


def test_mxfp4_residents_hold_their_int8_codes(monkeypatch):
    """MXFP4 experts as 4-bit codes: residents hold their int8 codes (twice the packed bytes, counted so by the
    planner), so the row layout applies (forced here: the CPU stands in for CUDA); the logits equal those of the
    same blocks given as int8 codes with the same residents, bit for bit, and swaps write the same rows."""
    from ktorch.gpu_memory import resident_bytes_per_expert

    models = []
    for nibbles in (True, False):
        torch.manual_seed(0)
        model = _as_mxfp4(ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.float32), device="cpu",
                                         experts_dtype="int8"), nibbles)
        ktorch.set_stream_experts(model, COSTS)
        monkeypatch.setattr(resident_rows, "row_layout_applies", lambda *args: True)
        for m in moe_experts_modules(model):
            m.kt_routed.min_tokens = 8
            place_resident_experts(m, 3, torch.device("cpu"))
        monkeypatch.undo()
        models.append(model)
    nib, codes = models
    for a, b in zip(moe_experts_modules(nib), moe_experts_modules(codes)):
        assert a.kt_w13.dtype == torch.float4_e2m1fn_x2 and b.kt_w13.dtype == torch.int8
        assert resident_bytes_per_expert(a) == resident_bytes_per_expert(b)
        assert isinstance(a.kt_gpu_packed, RowExperts) and all(torch.equal(x, y) for x, y in zip(a.kt_gpu_packed,
                                                                                                  b.kt_gpu_packed))
    short, long = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 24))
    for ids in (short, long):
        assert torch.equal(_logits(nib, ids), _logits(codes, ids))
    for mm in models:
        for m in moe_experts_modules(mm):
            m.kt_routed.frequency.zero_()
            m.kt_routed.frequency[5], m.kt_routed.frequency[6] = 100.0, 50.0
        assert update_resident_experts(mm)["swapped"] == 4
    for ids in (short, long):
        assert torch.equal(_logits(nib, ids), _logits(codes, ids))


@pytest.mark.parametrize("experts_dtype", ["int8", "bf16", "int4"])
def test_every_expert_resident_makes_no_cpu_op_call(experts_dtype):
    """A layer whose 8 experts are all resident computes them on the device alone, for any format: no kt.fused_moe
    call at decode-sized or prefill-sized (routed split) calls, the logits of the same experts on the CPU op (the
    residents' own quantization: int4 is far from HF eager), every routed slot counted as a resident hit. With 7 of
    8 resident, the CPU op is called once a layer."""
    base, model = _model_with_residents(8, experts_dtype)
    _, on_cpu = _model_with_residents(0, experts_dtype)  # the same packed experts, no residents
    for T in (1, 5, 24):
        ids = torch.randint(0, 256, (1, T))
        reset_resident_hits(model)
        logits, calls = _cpu_op_calls(model, ids)
        assert calls == 0
        hits, rows = resident_hits(model)
        assert hits == rows == T * model.config.num_experts_per_tok * 2
        torch.testing.assert_close(logits, _logits(on_cpu, ids), atol=0.05, rtol=0)
        if experts_dtype != "int4":
            assert_logits_match(base, model, torch.float32, ids)
    stats = ktorch.prefill_split_stats(model)  # the 24-token call split: nothing copied, every used expert resident
    assert stats["experts_copied"] == 0 and stats["resident_hit"] == stats["experts_hit"] > 0
    _, partial = _model_with_residents(7, experts_dtype)
    ids = torch.randint(0, 256, (1, 5))
    logits, calls = _cpu_op_calls(partial, ids)
    assert calls == 2
    torch.testing.assert_close(logits, _logits(on_cpu, ids), atol=0.05, rtol=0)


def test_deferral_still_calls_the_cpu_op_with_every_expert_resident():
    """With deferred experts (d = 1) a layer passes its deferred slots on through the CPU op's chain, so it is not
    skipped; with every expert resident nothing is deferred and the logits are HF eager's."""
    base, model = _model_with_residents(8, deferred=1)
    ids = torch.randint(0, 256, (1, 5))
    _, calls = _cpu_op_calls(model, ids)
    assert calls > 0
    assert_logits_match(base, model, torch.float32, ids)


def test_generate_with_every_expert_resident_counts_hits_without_the_cpu_op():
    """ktorch.generate (prefill, the swap update, decode) with every expert resident: no CPU op call at all, and the
    printed decode resident hit rate is 100% of the decode steps' routed slots."""
    from ktorch.cli import placement_lines

    torch.manual_seed(0)
    model = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.float32), device="cpu", experts_dtype="int8")
    ktorch.set_stream_experts(model, COSTS, gpu_memory=1 << 40)  # the CPU stands in: every expert fits
    assert model.kt_gpu_memory.resident_per_layer == 8
    prompt = torch.randint(0, 256, (1, 20))
    with CountOps() as ops:
        result = ktorch.generate(model, prompt, max_new_tokens=5)
    assert ops.counts["kt.fused_moe"] == 0 and len(result.ids) == 5
    hits, rows = resident_hits(model)
    assert hits == rows == 4 * model.config.num_experts_per_tok * 2  # the 4 decode steps after the first token
    line = [s for s in placement_lines(model, result.timings) if "resident hit rate" in s]
    assert line and f"{hits}/{rows} = 100.0%" in line[0]


def _count_cpu_op_calls(monkeypatch) -> list:
    """A list that gets an item per call of the CPU op's wrapper (``_run_experts``): counts in eager, compiled and
    captured steps alike, where a dispatch mode (CountOps) would change what Dynamo compiles."""
    calls = []
    run = transformers_experts._run_experts

    def counting(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(transformers_experts, "_run_experts", counting)
    return calls


@needs_kernels
@pytest.mark.parametrize("experts_dtype", ["int8", "int4"])
def test_kernels_decode_a_model_like_the_packed_path(monkeypatch, experts_dtype):
    """The whole resident decode path through the Triton kernels, the model where the kernels run (on CUDA, as
    placement makes rows there; or on the CPU under Triton's interpreter, the row layout forced): a tiny model with
    every expert resident gives the packed layout's logits within float32 rounding at decode-sized calls, and
    ktorch.generate decodes the same greedy tokens, with no CPU op call."""
    torch.manual_seed(0)
    if KERNEL_DEVICE == "cpu":
        monkeypatch.setattr(resident_rows, "row_layout_applies", lambda *args: True)
        monkeypatch.setattr(resident_rows, "_kernels_apply", lambda hidden: hidden.shape[0] <= GATHER_MAX_TOKENS)
    _, model = _model_with_residents(8, experts_dtype, device=KERNEL_DEVICE)
    monkeypatch.setattr(resident_rows, "row_layout_applies", lambda *args: False)
    _, packed_model = _model_with_residents(8, experts_dtype, device=KERNEL_DEVICE)
    assert all(isinstance(m.kt_gpu_packed, RowExperts) and m.kt_gpu_packed.w13.device.type == KERNEL_DEVICE
               for m in moe_experts_modules(model))
    assert all(not isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(packed_model))
    calls = []
    forward = triton_experts.triton_rows_forward
    monkeypatch.setattr(triton_experts, "triton_rows_forward", lambda *args: calls.append(1) or forward(*args))
    cpu_calls = _count_cpu_op_calls(monkeypatch)
    ids = torch.randint(0, 256, (1, 5), device=KERNEL_DEVICE)
    logits, fused_calls = _cpu_op_calls(model, ids)
    assert len(calls) == 2 and fused_calls == 0 and cpu_calls == []  # both layers through the kernels
    want = _logits(packed_model, ids)
    assert relative_error(logits, want) < 1e-5
    prompt = torch.randint(0, 256, (1, 6), device=KERNEL_DEVICE)
    got = ktorch.generate(model, prompt, max_new_tokens=4)
    assert cpu_calls == [] and len(calls) > 2
    assert got.ids == ktorch.generate(packed_model, prompt, max_new_tokens=4).ids


def test_residents_on_another_device_than_the_input_are_refused_clearly():
    """A model run on one device with residents placed on another (here the meta device stands in: placed there,
    run on the CPU) gets a ValueError naming both devices from the experts' forward, before any kernel."""
    _, model = _model_with_residents(0)
    for m in moe_experts_modules(model):
        place_resident_experts(m, 8, torch.device("meta"))
    with pytest.raises(ValueError, match="device experts are on meta .* and its input on cpu"):
        _logits(model, torch.randint(0, 256, (1, 3)))
    rows = RowExperts(*(t.to("meta") for t in rows_from_packed(*_experts("int8", 32)[0])))
    with pytest.raises(ValueError, match="the residents are on meta and hidden on cpu"):
        rows_experts_forward(torch.randn(1, 128), torch.zeros(1, 2, dtype=torch.int64), torch.rand(1, 2), rows)


@needs_cuda_triton
def test_cuda_residents_with_the_model_on_the_cpu_are_refused_clearly():
    """Residents forced onto CUDA (Triton rows) while the model runs on the CPU: the clear error, not the Triton
    wrapper's (nor a device mismatch deep in a kernel)."""
    _, model = _model_with_residents(0)
    for m in moe_experts_modules(model):
        place_resident_experts(m, 8, torch.device("cuda"))
        assert isinstance(m.kt_gpu_packed, RowExperts)
    with pytest.raises(ValueError, match="device experts are on cuda:0 .* and its input on cpu"):
        _logits(model, torch.randint(0, 256, (1, 3)))


# ---------------------------------------------------------------- CUDA: the Triton kernels


KERNEL_CASES = [  # format, group, activation, T, K, H, I (small: Triton's interpreter runs them on CPU tensors too)
    ("int8", None, "silu", 1, 8, 256, 128),  # per channel (a group spanning tiles)
    ("int8", 32, "silu", 3, 2, 256, 96),  # whole groups per tile
    ("int8", None, "silu", 2, 4, 256, 96),  # per channel: gate/up spanning tiles, down a scale per element
    ("int8", 16, "silu", 4, 2, 256, 128),
    ("int8", 32, "gelu", 3, 2, 160, 96),
    ("int8", 32, "gelu_tanh", 3, 2, 160, 96),
    ("int8", None, "relu", 2, 4, 256, 128),
    ("int4", 32, "silu", 1, 8, 256, 128),  # int4 (pack_experts) per 32: whole groups per tile
    ("int4", 128, "silu", 4, 2, 384, 128),  # per 128, odd H (not a whole tile)
    ("q4_0", 32, "gelu", 4, 2, 160, 96),  # odd sizes
    ("q4_k", 32, "silu", 1, 8, 160, 96),
    ("q4_k", 32, "gelu_tanh", 4, 2, 256, 128),
    ("q4_k", 96, "silu", 4, 2, 192, 96),  # affine, a scale per element (48-byte groups)
    ("q4_0", 256, "relu", 1, 4, 512, 256),  # 4-bit, a group spanning whole tiles (128 bytes)
    ("q5_k", 32, "silu", 4, 2, 192, 96),
    ("q4_k_m", 32, "relu", 4, 2, 192, 64),  # Q4_K gate/up, Q6_K-style int8 per 16 down
]


@needs_kernels
@pytest.mark.parametrize("fmt,group_size,activation,T,K,H,I", KERNEL_CASES,
                         ids=[f"{c[0]}_{c[1]}_{c[2]}_T{c[3]}_H{c[5]}_I{c[6]}" for c in KERNEL_CASES])
def test_kernels_match_a_float64_reference(fmt, group_size, activation, T, K, H, I):
    """The fused kernels (on CUDA, or on CPU tensors under Triton's interpreter) for each format: within bf16
    rounding of the float64 reference, no worse than the packed path's error (plus a little: they round once, it
    rounds the weights and each slot), absent slots (-1) skipped, odd sizes masked; each way of applying the scales;
    the same bits twice (no atomics)."""
    torch.manual_seed(0)
    n = 12
    packed, _ = _experts(fmt, group_size, n=n, H=H, I=I)
    packed = tuple(t.to(KERNEL_DEVICE) for t in packed)
    rows = rows_from_packed(*packed)
    hidden = torch.randn(T, H, device=KERNEL_DEVICE).to(torch.bfloat16)
    slots = torch.randint(-1, n, (T, K), device=KERNEL_DEVICE)
    slots[0, 0] = -1  # at least one absent slot
    weights = torch.rand(T, K, device=KERNEL_DEVICE)
    got = triton_experts.triton_rows_forward(hidden, slots, weights, rows, activation)
    if KERNEL_DEVICE == "cuda":
        assert torch.equal(rows_experts_forward(hidden, slots, weights, rows, activation), got)
    ref = _reference(hidden, slots, weights, rows, activation)
    packed_error = relative_error(packed_experts_forward(hidden, slots, weights, packed, activation).cpu(), ref)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    assert relative_error(got.cpu(), ref) <= max(1.2 * packed_error, 4e-3)
    if KERNEL_DEVICE == "cuda":  # the same bits twice (no atomics); the interpreter runs programs in order anyway
        assert torch.equal(triton_experts.triton_rows_forward(hidden, slots, weights, rows, activation), got)
    # another tile for each kernel (what bench_resident_decode --tiles compares): the same sums in another order
    other = triton_experts.triton_rows_forward(hidden, slots, weights, rows, activation, ((4, 64, 2, 1), (16, 32, 4, 2)))
    assert relative_error(other.cpu(), ref) <= max(1.2 * packed_error, 4e-3)
    assert relative_error(other.float().cpu(), got.float().cpu()) <= 1e-2
    # the router's bf16 weights and int32 slots are read as they are: the values of their float32 / int64 forms
    low = weights.to(torch.bfloat16)
    assert torch.equal(triton_experts.triton_rows_forward(hidden, slots.int(), low, rows, activation),
                       triton_experts.triton_rows_forward(hidden, slots, low.float(), rows, activation))


def test_programmatic_dependent_launch_applies_to_capable_cuda_devices_only(monkeypatch):
    """triton_experts.PDL (on by default): off, no launch option; on, none for CPU tensors (the interpreter's) either;
    on a CUDA device, the kernel's constexpr and the launch attribute where its compute capability is 9 or more."""
    monkeypatch.setattr(triton_experts, "PDL", False)
    assert triton_experts.pdl_options(torch.zeros(1)) == {}
    monkeypatch.setattr(triton_experts, "PDL", True)
    assert triton_experts.pdl_options(torch.zeros(1)) == {}
    if torch.cuda.is_available():
        major = torch.cuda.get_device_capability()[0]
        want = {"PDL": 1, "launch_pdl": True} if major >= 9 else {}
        assert triton_experts.pdl_options(torch.zeros(1, device="cuda")) == want


@pytest.mark.skipif(triton_experts.triton is None or triton_experts.interpreting(),
                    reason="compiling for a GPU needs Triton, not its interpreter")
def test_decode_kernels_compile_for_hopper_with_and_without_programmatic_dependent_launch():
    """The residents' decode kernels (route, gate/up at int8 and Q4_K, down, slot sum) compile to sm_90 code through
    Triton's real compiler (no GPU needed): with PDL = 1 the PTX holds both griddepcontrol instructions, with 0
    neither (what the interpreter, which runs the kernels here, does not check)."""
    from sm90 import pdl_instructions, sm90_ptx

    def ptx(fn, signature: dict, constexprs: dict) -> str:
        code = sm90_ptx(fn, signature, constexprs)
        assert pdl_instructions(code) == (bool(constexprs["PDL"]),) * 2, pdl_instructions(code)
        return code

    dims = {"H": "i32", "I": "i32", "G": "i32"}
    for pdl in (0, 1):
        ptx(triton_experts._route, {"ids_ptr": "*i64", "slot_of_ptr": "*i64", "slots_ptr": "*i64", "cpu_ids_ptr": "*i64",
                                    "hits_ptr": "*i64", "n": "i32"},
            {"COUNT": True, "BLOCK": triton_experts.ROUTE_BLOCK, "PDL": pdl})
        for bits, affine, group in ((8, 0, 32), (4, 1, 32)):
            bn, bk, _ = triton_experts.TILES[bits]
            fmt = {"GROUP": group, "MODE": triton_experts.scales_mode(group, bk), "BITS": bits, "AFFINE": affine}
            ptx(triton_experts._gate_up, {"x_ptr": "*bf16", "slots_ptr": "*i64", "q_ptr": "*i8" if bits == 8 else "*u8",
                                          "s_ptr": "*fp32", "h_ptr": "*fp32", "n_slots": "i32", **dims},
                {**fmt, "ACT": 0, "BLOCK_N": bn, "BLOCK_K": bk, "PDL": pdl})
            ptx(triton_experts._down, {"h_ptr": "*fp32", "slots_ptr": "*i64", "w_ptr": "*fp32",
                                       "q_ptr": "*i8" if bits == 8 else "*u8", "s_ptr": "*fp32", "y_ptr": "*fp32", **dims},
                {**fmt, "BLOCK_N": bn, "BLOCK_K": bk, "PDL": pdl})
        ptx(triton_experts._sum_slots, {"y_ptr": "*fp32", "out_ptr": "*bf16", "K": "i32", "H": "i32"},
            {"BLOCK": 1024, "PDL": pdl})


@needs_kernels
@pytest.mark.parametrize("T,K,E,n,ids_dtype", [(1, 8, 128, 73, torch.int64), (5, 4, 16, 16, torch.int64),
                                               (16, 8, 128, 0, torch.int32), (70, 6, 64, 20, torch.int64)])
def test_route_kernel_matches_the_aten_split(T, K, E, n, ids_dtype):
    """triton_route (the resident split in one kernel) against the ATen ops it replaces, at decode sizes and past one
    loop of the kernel (70 x 6 pairs): slots in slot_of's dtype, the CPU op's ids in ids' dtype, padding -1 ids
    neither routed nor held, the hit counter added to (not overwritten), and again at the same bits."""
    torch.manual_seed(T * 131 + n)
    ids = torch.randint(0, E, (T, K), dtype=ids_dtype, device=KERNEL_DEVICE)
    ids[0, : K // 2] = -1  # padding and skipped slots
    slot_of = torch.full((E,), -1, dtype=torch.int64)
    slot_of[torch.randperm(E)[:n]] = torch.randperm(n)
    slot_of = slot_of.to(KERNEL_DEVICE)
    hits = torch.tensor(7 << 32 | 5, dtype=torch.int64, device=KERNEL_DEVICE)
    slots, cpu_ids = triton_experts.triton_route(ids, slot_of, hits)
    want_slots = torch.where(ids >= 0, slot_of[ids.clamp(min=0).long()], -1)
    assert slots.dtype == slot_of.dtype and cpu_ids.dtype == ids.dtype
    assert torch.equal(slots, want_slots)
    assert torch.equal(cpu_ids, torch.where(want_slots >= 0, -1, ids))
    routed, held = int((ids >= 0).sum()), int((want_slots >= 0).sum())
    assert int(hits) == (7 + routed) << 32 | (5 + held)
    again, cpu_again = triton_experts.triton_route(ids, slot_of)
    assert torch.equal(again, slots) and torch.equal(cpu_again, cpu_ids)


@needs_kernels
def test_route_kernel_refuses_bad_inputs():
    ids = torch.zeros(2, 3, dtype=torch.int64, device=KERNEL_DEVICE)
    slot_of = torch.zeros(4, dtype=torch.int64, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="integer tensors"):
        triton_experts.triton_route(ids.float(), slot_of)
    with pytest.raises(ValueError, match=r"ids \[T, K\]"):
        triton_experts.triton_route(ids[0], slot_of)
    with pytest.raises(ValueError, match="int64, 0-d"):
        triton_experts.triton_route(ids, slot_of, torch.zeros(1, dtype=torch.int64, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="int64, 0-d"):
        triton_experts.triton_route(ids, slot_of, torch.zeros((), dtype=torch.int32, device=KERNEL_DEVICE))


@needs_cuda_triton
@pytest.mark.parametrize("fmt,group_size", [("int8", 32), ("int4", 128), ("q4_k", 32)])
def test_cuda_kernels_at_the_qwen3_shape(fmt, group_size):
    """Qwen3-30B-A3B's expert shape (H 2048, I 768) at T = 16 (the most a decode call takes): within bf16 rounding."""
    torch.manual_seed(0)
    n, T, K, H, I = 16, 16, 8, 2048, 768
    packed, _ = _experts(fmt, group_size, n=n, H=H, I=I)
    rows = rows_from_packed(*(t.cuda() for t in packed))
    hidden = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    slots = torch.randint(-1, n, (T, K), device="cuda")
    weights = torch.rand(T, K, device="cuda")
    got = rows_experts_forward(hidden, slots, weights, rows)
    assert relative_error(got.cpu(), _reference(hidden, slots, weights, rows)) <= 4e-3


@needs_cuda_triton
def test_cuda_kernels_with_programmatic_dependent_launch_give_the_same_bits(monkeypatch):
    """triton_experts.PDL on an sm_90+ GPU: the route and the residents' kernels, eagerly and replayed from a CUDA
    graph (where the launches become programmatic edges), the same bits as without it."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9 or more")
    torch.manual_seed(0)
    n = 16
    packed, _ = _experts("int8", 32, n=n, H=256, I=128)
    rows = rows_from_packed(*(t.cuda() for t in packed))
    hidden = torch.randn(4, 256, device="cuda").to(torch.bfloat16)
    ids = torch.randint(0, 2 * n, (4, 8), device="cuda")
    slot_of = torch.where(torch.arange(2 * n, device="cuda") < n, torch.arange(2 * n, device="cuda"), -1)
    weights = torch.rand(4, 8, device="cuda")

    def step():
        slots, _ = triton_experts.triton_route(ids, slot_of)
        return triton_experts.triton_rows_forward(hidden, slots, weights, rows)

    monkeypatch.setattr(triton_experts, "PDL", False)
    assert not triton_experts.pdl_options(hidden)
    want = step()
    monkeypatch.setattr(triton_experts, "PDL", True)
    assert triton_experts.pdl_options(hidden)
    assert torch.equal(step(), want)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@needs_cuda_triton
@pytest.mark.parametrize("fmt", ["int8", "q4_k"])
def test_cuda_triton_kernels_replay_in_a_cuda_graph(fmt):
    torch.manual_seed(0)
    packed, _ = _experts(fmt, 32, n=16, H=2048, I=768)
    rows = rows_from_packed(*(t.cuda() for t in packed))
    hidden = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    slots = torch.randint(-1, 16, (1, 8), device="cuda")
    weights = torch.rand(1, 8, device="cuda")
    rows_experts_forward(hidden, slots, weights, rows)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rows_experts_forward(hidden, slots, weights, rows)
    hidden.copy_(torch.randn(1, 2048, device="cuda"))
    slots.copy_(torch.randint(-1, 16, (1, 8), device="cuda"))
    graph.replay()
    assert torch.equal(out, rows_experts_forward(hidden, slots, weights, rows))


def _teacher_forced_steps(monkeypatch, model, prompt, tokens, compiled: bool) -> tuple:
    """Decode steps run eagerly from a fresh static cache (the kept decoder's length), fed ``tokens[:-1]`` after the
    prompt (teacher-forced): with the decoder layers compiled as the captured step compiles them
    (``generation.compiled_layers``: the same kernels a replay runs) or plain eager. Returns (the prefill's token,
    float32 logits [steps, V], per step the (router input [T, H] float32, sorted experts [T, K]) of each MoE layer,
    recorded where the experts forward splits its slots: eager in compiled steps too)."""
    from ktorch.generation import Decoder, Sampling, compiled_layers

    routing = []
    split = transformers_experts._split_gpu_experts

    def recording(module, hidden, ids, weights):
        routing[-1].append((hidden.detach().float().cpu(), ids.detach().cpu().sort(-1).values))
        return split(module, hidden, ids, weights)

    monkeypatch.setattr(transformers_experts, "_split_gpu_experts", recording)
    decoder = Decoder(model, model.kt_decoder.max_len, prompt.device, Sampling(), cuda_graphs=False)
    logits = []
    try:
        with torch.inference_mode():  # as generate runs (the compiled layers' guards)
            routing.append([])
            first = int(decoder.prefill(prompt))
            with compiled_layers(model, decoder.cache) if compiled else contextlib.nullcontext():
                for token in tokens[:-1]:
                    routing.append([])
                    decoder.token.fill_(token)
                    logits.append(decoder._forward(decoder.token, decoder.position).float())
                    decoder.position.add_(1)
    finally:
        monkeypatch.setattr(transformers_experts, "_split_gpu_experts", split)
    return first, torch.cat(logits), routing[1:]


@needs_cuda_triton
@pytest.mark.parametrize("experts_dtype", ["int8", "int4", "bf16"])
def test_cuda_every_expert_resident_decodes_without_the_cpu_op(monkeypatch, experts_dtype):
    """A tiny model with every expert resident on CUDA: int8 and int4 residents are RowExperts (Triton decode), bf16
    ones stay packed; no CPU op call (prefill, eager or captured decode); HF eager's logits (int8, bf16; int4: those
    of its experts on the CPU op); every routed slot of the captured decode a resident hit.

    The captured steps (CUDA-graph replays) give exactly the tokens of the same compiled step run eagerly on the
    same tokens (teacher-forced: the same kernels in the same order, so a replay reading a stale buffer differs);
    plain eager decode (``cuda_graphs=False``) runs the decoder layers uncompiled (Inductor fuses the bf16 norms,
    rotary and router math in float32, eager rounds each op to bf16), so its logits on the same tokens agree
    within bf16 tolerance up to the first routing flip, which must be a near-tie, and its greedy tokens may differ
    at a near-tie of the tiny random model."""
    from models import LOGIT_ATOL, ROUTER_RTOL

    calls = _count_cpu_op_calls(monkeypatch)
    torch.manual_seed(0)
    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 6))
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype=experts_dtype, stream_experts="off",
                           gpu_memory="4GiB")
    assert all(len(m.kt_gpu_expert_ids) == m.kt_w13.shape[0] for m in moe_experts_modules(model))  # all resident
    assert all(isinstance(m.kt_gpu_packed, RowExperts) == (experts_dtype != "bf16")
               for m in moe_experts_modules(model))
    if experts_dtype == "int4":  # the same int4 experts on the CPU op (int4 is far from HF eager)
        on_cpu = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype="int4", stream_experts="off",
                                gpu_memory="off")
        want = _logits(on_cpu, ids.cuda()).float()
        calls.clear()  # those were the CPU op's
        torch.testing.assert_close(_logits(model, ids.cuda()).float(), want, atol=0.05, rtol=0)
    else:
        assert_logits_match(base.to("cuda"), model, torch.bfloat16, ids.cuda())
    captured = ktorch.generate(model, ids, max_new_tokens=8)
    assert captured.timings.cuda_graphs
    hits, rows = resident_hits(model)
    assert hits == rows > 0
    prompt = ids.cuda()
    first, compiled, routing_c = _teacher_forced_steps(monkeypatch, model, prompt, captured.ids, compiled=True)
    assert [first] + compiled.argmax(-1).tolist() == captured.ids  # the replays: exactly the compiled step's tokens
    _, eager, routing_e = _teacher_forced_steps(monkeypatch, model, prompt, captured.ids, compiled=False)
    assert len(routing_e) == len(routing_c) == len(captured.ids) - 1
    for step, (layers_e, layers_c) in enumerate(zip(routing_e, routing_c)):
        flips = [(x_e, x_c) for (x_e, ids_e), (x_c, ids_c) in zip(layers_e, layers_c) if not torch.equal(ids_e, ids_c)]
        if flips:  # a near-tie: the two routers' inputs within rounding; nothing after it is compared
            x_e, x_c = flips[0]
            assert ((x_e - x_c).norm() / x_c.norm()).item() <= ROUTER_RTOL[torch.bfloat16], f"step {step}"
            break
        diff = (eager[step] - compiled[step]).abs().max().item()
        assert diff <= LOGIT_ATOL[torch.bfloat16], f"step {step}: eager and compiled logits differ by {diff:.3g}"
    plain = ktorch.generate(model, ids, max_new_tokens=8, cuda_graphs=False)
    assert not plain.timings.cuda_graphs and plain.ids[0] == captured.ids[0]  # the same prefill
    assert calls == []


@needs_cuda_triton
@pytest.mark.parametrize("split", ["pinned", "pageable"])
def test_cuda_swaps_behind_decode_write_what_placement_writes(split):
    """begin_resident_swaps on CUDA: the outgoing experts leave the slot map at once (stream order: their slots go to
    the CPU op), the host's resident ids change only when the slot maps flip (poll / finish); the side stream's
    copies (from the split's page-locked experts, or gathered into page-locked memory with the split off) write the
    rows a fresh placement makes, bit for bit, and the logits are a fresh placement's. generate with swaps under way
    behind its decode ends with them finished and the decode counted."""
    from ktorch.gpu_memory import _resident_tensors, begin_resident_swaps, drop_resident_experts

    torch.manual_seed(0)
    model = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.float32), device="cuda", experts_dtype="int8",
                           stream_experts=COSTS if split == "pinned" else "off", gpu_memory="4GiB")
    for m in moe_experts_modules(model):
        drop_resident_experts(m)
        place_resident_experts(m, 3, torch.device("cuda"), initial=torch.tensor([0, 1, 2]))
        assert isinstance(m.kt_gpu_packed, RowExperts)
        assert (m.kt_routed.layer.pinned_experts == 8) == (split == "pinned")
        m.kt_routed.frequency.zero_()
        m.kt_routed.frequency[5:8] = torch.tensor([300.0, 200.0, 100.0], dtype=torch.float64)
    swaps = begin_resident_swaps(model)
    assert swaps.swapped == 6 and swaps.pending
    for m in moe_experts_modules(model):
        assert m.kt_gpu_slot_of.tolist() == [-1] * 8 and m.kt_gpu_expert_ids == [0, 1, 2]
    swaps.finish()
    assert not swaps.pending
    torch.cuda.synchronize()
    fresh = copy.deepcopy(model)
    for m, f in zip(moe_experts_modules(model), moe_experts_modules(fresh)):
        assert sorted(m.kt_gpu_expert_ids) == [5, 6, 7]
        assert [m.kt_gpu_slot_of.tolist()[e] for e in m.kt_gpu_expert_ids] == [0, 1, 2]
        placed = _resident_tensors(m, torch.tensor(m.kt_gpu_expert_ids), torch.device("cuda"), True)
        assert all(torch.equal(a, b) for a, b in zip(m.kt_gpu_packed, placed))
        order = torch.tensor(f.kt_gpu_expert_ids)
        drop_resident_experts(f)
        place_resident_experts(f, 3, torch.device("cuda"), initial=order)
    ids = torch.randint(0, 256, (1, 5), device="cuda")
    assert torch.equal(_logits(model, ids), _logits(fresh, ids))
    for m in moe_experts_modules(model):  # 0, 1, 2 far the most routed-to again: swapped back behind decode
        m.kt_routed.frequency[0:3] = 1e4
    result = ktorch.generate(model, torch.randint(0, 256, (1, 40)), max_new_tokens=8, eos_token_id=[])
    assert result.timings.resident_swaps == 6 and len(result.ids) == 8
    assert all(sorted(m.kt_gpu_expert_ids) == [0, 1, 2] for m in moe_experts_modules(model))
    assert not model.kt_resident_swaps.pending
    hits, rows = resident_hits(model)
    assert rows == 7 * model.config.num_experts_per_tok * 2 and 0 <= hits <= rows
