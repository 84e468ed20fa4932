"""Resident experts in the row layout (ktorch/ops/resident_rows.py) and the fused Triton decode kernels
(ktorch/ops/triton_experts.py), the ``set_resident_decode`` experiment (ktorch/gpu_memory.py).

On the CPU the "device" is the CPU: the repacking, the gather kernel, swaps and the CPU-op skip run here and are
compared bit for bit with the packed layout and against a float64 reference; the Triton kernels and their CUDA-graph
capture need CUDA and Triton and are skipped without them.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ktorch
from ktorch.gpu_memory import device_bytes_held, place_resident_experts, set_resident_decode, update_resident_experts
from ktorch.integrations import transformers_experts
from ktorch.ops.moe import pack_quantized
from ktorch.ops.gpu_experts import gpu_experts_forward, packed_experts_forward
from ktorch.ops.packed_weights import dequantize_packed
from ktorch.ops.resident_rows import RowExperts, dequantize_rows, rows_experts_forward, rows_from_packed
from ktorch.ops.routed_experts import SplitCosts
from models import assert_logits_match, moe_experts_modules, tiny_model
from reference import fused_moe_reference, relative_error

needs_cuda_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or not __import__("importlib").util.find_spec("triton"),
    reason="the Triton decode kernels need a CUDA GPU and Triton")
COSTS = SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=1e-3, cpu_row_s=1e-5, cpu_expert_s=5e-4)
FORMATS = [("int8", None), ("int8", 32), ("bf16", None)]  # int8 per channel (pack_experts), per 32 (Q8_0)


def _experts(fmt, group_size, n=6, H=128, I=64, seed=0):
    """Packed experts: int8 with ``group_size`` are GGUF-style codes with a scale per group (``pack_quantized``, as
    Q8_0 loads), returned as (w13, w13_scales, w2, w2_scales) plus the codes and scales they were packed from."""
    torch.manual_seed(seed)
    if fmt == "int8" and group_size is not None:
        c13, c2 = torch.randint(-128, 128, (n, 2 * I, H)), torch.randint(-128, 128, (n, H, I))
        s13 = torch.rand(n, 2 * I, H // group_size) / (127 * H**0.5)
        s2 = torch.rand(n, H, I // group_size) / (127 * I**0.5)
        w13, w13_scales = pack_quantized(c13, s13, bits=8, gate_up=True)
        w2, w2_scales = pack_quantized(c2, s2, bits=8)
        return (w13, w13_scales, w2, w2_scales), (c13, s13, c2, s2)
    packed = ktorch.pack_experts(torch.randn(n, 2 * I, H) / H**0.5, torch.randn(n, H, I) / I**0.5, fmt, group_size)
    return packed.tensors()[:4], None


def _reference(hidden, slots, weights, rows: RowExperts) -> torch.Tensor:
    """float64 out [T, H] from the row layout's own values: w13 [n, 2I, H] and w2 [n, H, I] dequantized in float64."""
    def dense(q, s):
        if s is None:
            return q.double()
        n, N, K = q.shape
        return (q.double().view(n, N, s.shape[2], -1) * s.double().unsqueeze(-1)).view(n, N, K)

    return fused_moe_reference(hidden, slots, weights, dense(rows.w13, rows.w13_scales), dense(rows.w2, rows.w2_scales))


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=["int8", "int8_g32", "bf16"])
def test_rows_hold_the_packed_values(fmt, group_size):
    """The row layout dequantizes bit for bit to what dequantize_packed gives, in the same bytes; GGUF-style codes
    packed with pack_quantized come back as they were given."""
    packed, source = _experts(fmt, group_size)
    p13, s13, p2, s2 = packed
    rows = rows_from_packed(*packed)
    assert rows.w13.shape == (6, 128, 128) and rows.w2.shape == (6, 128, 64)
    assert sum(t.numel() * t.element_size() for t in rows if t is not None) == \
        sum(t.numel() * t.element_size() for t in packed if t is not None)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_rows(rows.w13, rows.w13_scales, dtype), dequantize_packed(p13, s13, True, dtype))
        assert torch.equal(dequantize_rows(rows.w2, rows.w2_scales, dtype), dequantize_packed(p2, s2, False, dtype))
    if source is not None:
        for got, want in zip(rows, source):
            assert torch.equal(got, want.to(got.dtype))


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=["int8", "int8_g32", "bf16"])
@pytest.mark.parametrize("kernel,dtype,T", [("gather", torch.float32, 3), ("gather", torch.bfloat16, 1),
                                            ("gather", torch.bfloat16, 9), ("grouped_mm", torch.bfloat16, 40)])
def test_rows_forward_equals_the_packed_one(fmt, group_size, kernel, dtype, T):
    """Bit for bit packed_experts_forward (= gpu_experts_forward on dequantize_packed weights), with absent slots and
    more rows than one gather chunk (T=9, K=4: 36 > 32), and within bf16 rounding of a float64 reference."""
    packed, _ = _experts(fmt, group_size)
    p13, s13, p2, s2 = packed
    rows = rows_from_packed(*packed)
    K = 4
    hidden = torch.randn(T, 128).to(dtype)
    slots = torch.randint(-1, 6, (T, K))
    weights = torch.rand(T, K)
    want = packed_experts_forward(hidden, slots, weights, packed, "silu", kernel)
    w13, w2 = dequantize_packed(p13, s13, True, dtype), dequantize_packed(p2, s2, False, dtype)
    assert torch.equal(want, gpu_experts_forward(hidden, slots, weights, w13, w2, "silu", kernel))
    got = rows_experts_forward(hidden, slots, weights, rows, "silu", kernel)
    assert got.dtype == dtype and torch.equal(got, want)
    ref = _reference(hidden, slots, weights, rows)
    assert relative_error(got, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_rows_refuse_what_they_cannot_hold():
    int4, _ = _experts("int4", 32)
    with pytest.raises(ValueError, match="int8 or bf16 packed experts, got torch.uint8"):
        rows_from_packed(*int4)
    int8, _ = _experts("int8", None)
    with pytest.raises(ValueError, match="need scales"):
        rows_from_packed(int8[0], None, int8[2], int8[3])
    rows = rows_from_packed(*int8)
    hidden, slots, weights = torch.randn(1, 128), torch.zeros(1, 2, dtype=torch.int64), torch.rand(1, 2)
    with pytest.raises(ValueError, match="kernel must be one of"):
        rows_experts_forward(hidden, slots, weights, rows, "silu", "fast")
    with pytest.raises(ValueError, match="activation must be one of"):
        rows_experts_forward(hidden, slots, weights, rows, "swiglu")
    from ktorch.ops.triton_experts import triton_rows_forward

    with pytest.raises(ValueError, match="run on CUDA tensors"):
        triton_rows_forward(hidden, slots, weights, rows)


# ---------------------------------------------------------------- in a model: set_resident_decode


def _model_with_residents(residents: int, experts_dtype="int8", seed=0):
    """A tiny Qwen3-MoE (8 experts a layer) prepared on the CPU with the prefill split and ``residents`` resident
    experts a layer (the CPU stands in for the device)."""
    torch.manual_seed(seed)
    base = tiny_model("qwen3_moe", dtype=torch.float32)
    model = ktorch.prepare(copy.deepcopy(base), device="cpu", experts_dtype=experts_dtype)
    ktorch.set_stream_experts(model, COSTS)
    for m in moe_experts_modules(model):
        m.kt_routed.min_tokens = 8
        place_resident_experts(m, residents, torch.device("cpu"))
    return base, model


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_gather_decode_equals_packed_in_a_model_and_after_swaps():
    """set_resident_decode(model, "gather") repacks the residents in place of the packed ones (the same bytes); decode
    (few tokens) and prefill give bit for bit the packed layout's logits; swaps write rows; "packed" restores."""
    base, model = _model_with_residents(3)
    short, long = torch.randint(0, 256, (1, 5)), torch.randint(0, 256, (1, 24))
    want_short, want_long = _logits(model, short), _logits(model, long)
    held = device_bytes_held(model, torch.device("cpu"))
    assert set_resident_decode(model, "gather") == len(moe_experts_modules(model))
    assert all(isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(model))
    assert device_bytes_held(model, torch.device("cpu")) == held
    assert torch.equal(_logits(model, short), want_short) and torch.equal(_logits(model, long), want_long)
    assert_logits_match(base, model, torch.float32, short)
    # swaps write the incoming experts in the row layout: equal to the packed layout swapped the same way
    packed_model = copy.deepcopy(model)
    set_resident_decode(packed_model, "packed")
    assert all(not isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(packed_model))
    for mm in (model, packed_model):
        for m in moe_experts_modules(mm):
            m.kt_routed.frequency.zero_()
            m.kt_routed.frequency[5], m.kt_routed.frequency[6], m.kt_routed.frequency[7] = 100.0, 50.0, 25.0
        assert update_resident_experts(mm)["swapped"] > 0
    assert all(isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(model))
    assert torch.equal(_logits(model, short), _logits(packed_model, short))


def test_skip_idle_cpu_only_when_every_expert_is_resident(monkeypatch):
    """skip_idle_cpu: a layer with all its experts resident makes no CPU op call and gives the same logits; with one
    expert in host memory the CPU op is still called."""
    calls = []
    run = transformers_experts._run_experts

    def counting(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(transformers_experts, "_run_experts", counting)
    ids = torch.randint(0, 256, (1, 5))
    _, model = _model_with_residents(8)  # all 8 experts of each layer
    want = _logits(model, ids)
    assert len(calls) == 2
    set_resident_decode(model, "gather", skip_idle_cpu=True)
    calls.clear()
    assert torch.equal(_logits(model, ids), want) and calls == []
    _, partial = _model_with_residents(7)
    want = _logits(partial, ids)
    set_resident_decode(partial, "packed", skip_idle_cpu=True)
    calls.clear()
    assert torch.equal(_logits(partial, ids), want) and len(calls) == 2


def test_set_resident_decode_errors():
    _, model = _model_with_residents(2)
    with pytest.raises(ValueError, match="kernel must be one of"):
        set_resident_decode(model, "fused")
    with pytest.raises(ValueError, match="'triton' needs residents on a CUDA device"):
        set_resident_decode(model, "triton")
    _, int4 = _model_with_residents(2, experts_dtype="int4")
    with pytest.raises(ValueError, match="row layout takes int8 or bf16 residents"):
        set_resident_decode(int4, "gather")


# ---------------------------------------------------------------- CUDA: the Triton kernels


@needs_cuda_triton
@pytest.mark.parametrize("activation,T,K,H,I,group_size", [
    ("silu", 1, 8, 256, 128, None), ("silu", 3, 4, 512, 192, 32), ("silu", 16, 8, 2048, 768, 32),
    ("gelu", 3, 4, 512, 192, 32), ("gelu_tanh", 3, 4, 512, 192, 32), ("relu", 2, 8, 256, 128, None)])
def test_cuda_triton_kernels_match_the_gather_kernel(activation, T, K, H, I, group_size):
    """The fused kernels: within bf16 rounding of the float64 reference, no worse than the gather kernel's error
    (plus a little: they round once, the gather kernel per slot), absent slots skipped, odd sizes masked; each way
    of applying the scales (a group spanning tiles: per-channel H=256; whole groups per tile; per element)."""
    from ktorch.ops.triton_experts import triton_rows_forward

    torch.manual_seed(0)
    n = 12
    packed, _ = _experts("int8", group_size, n=n, H=H, I=I)
    rows = RowExperts(*(t.cuda() for t in rows_from_packed(*packed)))
    hidden = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    slots = torch.randint(-1, n, (T, K), device="cuda")
    weights = torch.rand(T, K, device="cuda")
    got = triton_rows_forward(hidden, slots, weights, rows, activation)
    per_element = triton_rows_forward(hidden, slots, weights, rows, activation, mode=2)  # a scale load per element
    gather = rows_experts_forward(hidden, slots, weights, rows, activation, "gather")
    cpu_rows = RowExperts(*(t.cpu() for t in rows))
    ref = fused_moe_reference(hidden.cpu(), slots.cpu(), weights.cpu(),
                              dequantize_rows(cpu_rows.w13, cpu_rows.w13_scales, torch.float64).transpose(1, 2),
                              dequantize_rows(cpu_rows.w2, cpu_rows.w2_scales, torch.float64).transpose(1, 2),
                              activation)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    bound = max(1.2 * relative_error(gather.cpu(), ref), 4e-3)
    assert relative_error(got.cpu(), ref) <= bound and relative_error(per_element.cpu(), ref) <= bound
    assert torch.equal(triton_rows_forward(hidden, slots, weights, rows, activation), got)  # no atomics


@needs_cuda_triton
def test_cuda_triton_decode_replays_in_a_cuda_graph_and_generates():
    """The kernels under a captured CUDA graph give the eager result for new inputs; a tiny model with every expert
    resident (int8) and the triton kernel with skip_idle_cpu matches HF eager's logits, and its captured decode steps
    give the eager steps' greedy tokens."""
    from ktorch.ops.triton_experts import triton_rows_forward

    torch.manual_seed(0)
    packed, _ = _experts("int8", 32, n=16, H=2048, I=768)
    rows = RowExperts(*(t.cuda() for t in rows_from_packed(*packed)))
    hidden = torch.randn(1, 2048, device="cuda").to(torch.bfloat16)
    slots = torch.randint(-1, 16, (1, 8), device="cuda")
    weights = torch.rand(1, 8, device="cuda")
    triton_rows_forward(hidden, slots, weights, rows)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_rows_forward(hidden, slots, weights, rows)
    hidden.copy_(torch.randn(1, 2048, device="cuda"))
    slots.copy_(torch.randint(-1, 16, (1, 8), device="cuda"))
    graph.replay()
    assert torch.equal(out, triton_rows_forward(hidden, slots, weights, rows))

    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 6))
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype="int8", stream_experts="off",
                           gpu_memory="4GiB")
    assert all(len(m.kt_gpu_expert_ids) == m.kt_w13.shape[0] for m in moe_experts_modules(model))  # all resident
    set_resident_decode(model, "triton", skip_idle_cpu=True)
    assert all(isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(model))
    assert_logits_match(base.to("cuda"), model, torch.bfloat16, ids.cuda())
    captured = ktorch.generate(model, ids, max_new_tokens=8)
    assert captured.timings.cuda_graphs
    assert ktorch.generate(model, ids, max_new_tokens=8, cuda_graphs=False).ids == captured.ids
