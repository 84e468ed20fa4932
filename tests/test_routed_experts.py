"""The routing-aware prefill split (ktorch/ops/routed_experts.py) and the GPU memory budget (ktorch/gpu_memory.py).

On the CPU the "device" is the CPU: the same choice, copies into the staging (contiguous runs), dequantization,
kernels, masking, sums, resident experts and swaps run, so the logic and numerics are tested here; page-locking and
the CUDA copies are tested on a GPU.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import ktorch
from ktorch.gpu_memory import (
    GpuMemoryPlan,
    device_bytes_held,
    parse_memory_size,
    place_resident_experts,
    reserve_bytes,
    reset_resident_hits,
    resident_hits,
    swap_resident_experts,
    update_resident_experts,
)
from ktorch.ops import triton_experts
from ktorch.ops.gpu_experts import gpu_experts_forward
from ktorch.ops.routed_experts import (
    DeviceStaging,
    RoutedExperts,
    SplitCosts,
    calibrate_split_costs,
    choose_device_experts,
    contiguous_runs,
    cpu_ids_for,
    expert_counts,
)
from ktorch.ops.streamed_experts import StreamedExperts, dequantize_packed
from ktorch.ops.triton_prefill import PackedBlocks, tile_for, triton_grouped_forward
from models import assert_logits_match, moe_experts_modules, tiny_model
from reference import fused_moe_reference, relative_error

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FORMATS = [("bf16", None), ("int8", None), ("int4", 32)]
TOLERANCE = {"bf16": 1e-2, "int8": 3e-2, "int4": 8e-2}

# the CPU op: 1 ms a call + 10 us a row + 0.5 ms an expert; copies 1 GB/s (1 MB experts: 1 ms each)
COSTS = SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=1e-3, cpu_row_s=1e-5, cpu_expert_s=5e-4)
ALL_TO_DEVICE = SplitCosts(h2d_bytes_per_s=1e15, cpu_fixed_s=1.0, cpu_row_s=1.0, cpu_expert_s=1.0)
ALL_ON_CPU = SplitCosts(h2d_bytes_per_s=1.0, cpu_fixed_s=0.0, cpu_row_s=1e-9, cpu_expert_s=0.0)


def test_expert_counts_skip_negative_slots():
    ids = torch.tensor([[0, 3], [3, -1], [-1, -1], [5, 3]])
    assert expert_counts(ids, 6).tolist() == [1, 0, 0, 3, 0, 1]


def test_choice_balances_the_two_sides_most_hit_first():
    """Most-hit experts go first; k minimises max(CPU, device); unused and resident experts are never copied."""
    counts = torch.tensor([0, 100, 5, 50, 0, 20, 1, 0])
    chosen = choose_device_experts(counts, COSTS, 10**6, capacity=8)
    # k = 0: CPU 1 + 1.76 + 3 = 5.76 ms; k = 1 (expert 1): CPU 1 + .76 + 2.5 = 4.26, device 1; k = 2 (+3): CPU
    # 1 + .26 + 2 = 3.26, device 2; k = 3 (+5): CPU 1 + .06 + 1.5 = 2.56, device 3 -> best k = 2
    assert chosen.tolist() == [1, 3]
    resident = torch.zeros(8, dtype=torch.bool)
    resident[1] = True  # computed on the device already: never copied, its rows not the CPU's
    # candidates 3, 5, 2, 6: k = 2 -> CPU 1 + .06 + 1 = 2.06, device 2; k = 3 -> device 3
    assert choose_device_experts(counts, COSTS, 10**6, capacity=8, resident=resident).tolist() == [3, 5]
    assert choose_device_experts(counts, COSTS, 10**6, capacity=1).tolist() == [1]  # capacity caps k
    assert choose_device_experts(counts, COSTS, 10**6, capacity=0).tolist() == []
    assert choose_device_experts(counts, ALL_TO_DEVICE, 10**6, capacity=8).tolist() == [1, 2, 3, 5, 6]
    assert choose_device_experts(counts, ALL_ON_CPU, 10**6, capacity=8).tolist() == []
    assert choose_device_experts(torch.zeros(8, dtype=torch.long), ALL_TO_DEVICE, 10, capacity=8).tolist() == []


def test_skewed_routing_copies_few_experts_uniform_many():
    """The same costs: a skewed batch (most rows on few experts) copies fewer experts than a near-uniform one."""
    E = 128
    uniform = torch.full((E,), 32)
    skewed = (4096 / torch.arange(1, E + 1).double() ** 1.2).long()
    costs = SplitCosts(h2d_bytes_per_s=25e9, cpu_fixed_s=2e-4, cpu_row_s=1e-6, cpu_expert_s=4.7e6 / 100e9)
    n_uniform = choose_device_experts(uniform, costs, 4_700_000, capacity=E).numel()
    chosen = choose_device_experts(skewed, costs, 4_700_000, capacity=E)
    assert 0 < chosen.numel() < n_uniform
    assert chosen.tolist() == list(range(chosen.numel()))  # the most hit: the lowest ids here


def test_contiguous_runs():
    assert contiguous_runs([]) == []
    assert contiguous_runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]


def test_costs_are_checked():
    with pytest.raises(ValueError, match="h2d_bytes_per_s must be > 0"):
        SplitCosts(0.0, 0, 0, 0)
    with pytest.raises(ValueError, match="cpu_row_s must be >= 0"):
        SplitCosts(1.0, 0, -1.0, 0)


def _layer(fmt, group_size, E=8, H=128, I=64, seed=0):
    torch.manual_seed(seed)
    packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) / H**0.5, torch.randn(E, H, I) / I**0.5, fmt, group_size)
    return packed, StreamedExperts(*packed.tensors(), "silu")


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=[f for f, _ in FORMATS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_any_split_gives_the_cpu_result(fmt, group_size, dtype):
    """For the empty split, every used expert, and random subsets: the device part is bit for bit
    gpu_experts_forward on the chosen experts' dequantized weights, or where they take them (int8 codes, bf16, the
    Triton kernels running) the grouped kernels on the chosen experts' packed blocks (the copies in runs land in
    the right slots),
    device + CPU parts agree with the CPU op alone and with the float64 reference within the format's tolerance,
    and the empty split is the CPU op bit for bit."""
    E, H, I, T, K = 8, 128, 64, 41, 3
    packed, layer = _layer(fmt, group_size, E, H, I)
    staging = DeviceStaging(layer, E, torch.device("cpu"), dtype)
    routed = RoutedExperts(layer, COSTS, staging)
    hidden = torch.randn(T, H).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    ids[0, 1] = -1
    ids[ids == 6] = 7  # expert 6 unused
    weights = torch.rand(T, K)
    cpu_only = ktorch.fused_moe(hidden, ids, weights, packed)
    gu, dn = packed.dequantize()
    want = fused_moe_reference(hidden, ids, weights, gu, dn)
    gen = torch.Generator().manual_seed(1)
    splits = [[], [0, 1, 2, 3, 4, 5, 7], [2], [0, 1, 4, 5], [3, 7]]
    splits += [sorted(torch.randperm(E, generator=gen)[:n].tolist()) for n in (2, 5)]
    for chosen in splits:
        chosen = torch.tensor(chosen, dtype=torch.int64)
        cpu_ids = cpu_ids_for(ids, chosen, E)
        assert not torch.isin(cpu_ids, chosen).any()
        cpu = ktorch.fused_moe(hidden, cpu_ids, weights, packed)
        if chosen.numel() == 0:
            assert torch.equal(cpu, cpu_only)
            continue
        device = routed.device_part(hidden, ids, weights, chosen)
        slot_of = torch.full((E,), -1, dtype=torch.long)
        slot_of[chosen] = torch.arange(chosen.numel())
        slots = torch.where(ids >= 0, slot_of[ids.clamp(min=0)], -1)
        blocks = PackedBlocks(*(None if t is None else t[chosen] for t in packed.tensors()[:4]))
        if routed.blocks_kernels_apply(hidden, blocks):  # int8, bf16 activations, the kernels running here
            # (Triton's interpreter): the grouped kernels on the copied blocks as they are
            expect = triton_grouped_forward(hidden, slots, weights, blocks, "silu", tile_for(ids.numel() / E))
        else:
            w13 = dequantize_packed(blocks.w13, blocks.w13_scales, True, dtype)
            w2 = dequantize_packed(blocks.w2, blocks.w2_scales, False, dtype)
            expect = gpu_experts_forward(hidden, slots, weights, w13, w2, "silu")
        assert torch.equal(device, expect), chosen
        total = device.double() + cpu.double()
        assert relative_error(total, want) < TOLERANCE[fmt], chosen
        assert relative_error(total, cpu_only.double()) < 2 * TOLERANCE[fmt], chosen


@pytest.mark.skipif(not (triton_experts.triton_available()
                         and (torch.cuda.is_available() or triton_experts.interpreting())),
                    reason="the captured split's kernels need Triton and a CUDA GPU, or Triton's interpreter "
                    "(TRITON_INTERPRET=1)")
@pytest.mark.parametrize("residents", [0, 3])
def test_captured_split_equals_the_host_split(residents):
    """RoutedExperts.captured_split (the choice, the gather into the staging's capacity rows and the grouped kernels
    over them, all device work) gives the host split's CPU ids, copied ids and device part bit for bit, for skewed
    and uniform routing, with resident experts' slots masked as the residents' split leaves them."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    E, H, I, T, K = 8, 128, 64, 41, 3
    packed, layer = _layer("int8", None, E, H, I)
    if device.type == "cuda":
        layer.pin_prefix(E)
    routed = RoutedExperts(layer, COSTS, DeviceStaging(layer, 3, device, torch.bfloat16))
    resident = torch.arange(E) < residents
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(T, H, generator=gen).to(device, torch.bfloat16)
    weights = torch.rand(T, K, generator=gen).to(device)
    copied = candidates = 0
    for skew in (0.0, 1.5, 3.0):
        p = 1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** skew
        ids = torch.stack([torch.multinomial(p, K, generator=gen) for _ in range(T)])
        ids[0, 1] = -1
        counts = expert_counts(ids, E)
        masked = torch.where((ids >= 0) & resident[ids.clamp(min=0)], -1, ids).to(device)
        chosen = routed.choose(counts, resident if residents else None)
        k = chosen.numel()
        copied += k
        candidates += int(((counts > 0) & ~resident).sum())
        cpu_ids, work, got = routed.captured_split(hidden, masked, weights, counts.to(device),
                                                   resident.to(device) if residents else None)
        assert got[:k].cpu().tolist() == chosen.tolist() and (got[k:] == -1).all()
        assert torch.equal(cpu_ids.cpu(), cpu_ids_for(masked, chosen, E).cpu())
        if k:
            assert torch.equal(work(), routed.device_part(hidden, masked, weights, chosen))
    assert 0 < copied < candidates  # some copies, not every used expert (the staging holds 3)


def test_choose_counts_what_moved():
    packed, layer = _layer("int8", None)
    routed = RoutedExperts(layer, ALL_TO_DEVICE, DeviceStaging(layer, 3, torch.device("cpu"), torch.float32))
    counts = torch.tensor([4, 0, 9, 1, 0, 0, 2, 7])
    resident = torch.zeros(8, dtype=torch.bool)
    resident[2] = True
    chosen = routed.choose(counts, resident)
    assert chosen.tolist() == [0, 6, 7]  # capacity 3, most hit first among the non-resident ones
    s = routed.stats
    assert (s["passes"], s["experts_hit"], s["experts_copied"], s["copied_unused"], s["resident_hit"]) == (1, 5, 3, 0, 1)
    assert s["bytes_copied"] == 3 * layer.bytes_per_expert() and s["rows"] == 23 and s["rows_copied"] == 13
    assert routed.last_hit == 5 and routed.frequency.tolist() == counts.double().tolist()
    with pytest.raises(ValueError, match="4 experts chosen, the staging holds 3"):
        routed.device_part(torch.randn(2, 128), torch.zeros(2, 2, dtype=torch.long), torch.rand(2, 2),
                           torch.arange(4))


def _device_parts(routed: RoutedExperts, hidden, ids, weights, splits: list, runs: bool) -> list:
    """device_part for each chosen set, with the split's gather or (``runs``) its fallback, the per-run DMA copies,
    swapped in; the counters must not move."""
    from ktorch.ops import routed_experts

    before = dict(routed.stats)
    out = []
    original = routed_experts.gather_experts
    if runs:
        routed_experts.gather_experts = routed_experts._copy_expert_runs
    try:
        for chosen in splits:
            part = routed.device_part(hidden, ids, weights, torch.tensor(chosen, dtype=torch.int64))
            k = len(chosen)
            packed = [None if v is None else v.view(torch.uint8).clone()
                      for v in routed.layer.views_in(routed.staging.packed, k)]
            out.append((part, packed))
    finally:
        routed_experts.gather_experts = original
    assert dict(routed.stats) == before
    return out


CUDA_LAYERS = [("int8", None, 8, 128, 64), ("int4", 32, 8, 128, 64),
               ("int8", None, 16, 2048, 512)]  # the last: w13 32 MiB, registered in place (the others: pinned copies)


@needs_cuda
@pytest.mark.parametrize("fmt,group_size,E,H,I", CUDA_LAYERS, ids=["int8", "int4", "int8-registered"])
def test_cuda_gather_equals_the_dma_runs(fmt, group_size, E, H, I):
    """On the GPU, the split's zero-copy gather through the aliases (page-locked copies, and memory registered in
    place) and the per-run DMA copies it replaced put the same bytes in the staging and give the same device part,
    bit for bit, for chosen sets of runs of one, many runs, one run and all; the counters do not move; the bytes
    are the chosen experts' host bytes."""
    packed, layer = _layer(fmt, group_size, E, H, I)
    layer.pin_prefix(E)
    assert bool(layer._registered) == (H == 2048)
    assert layer.gather_sources(torch.device("cuda")) is not None  # the gather runs, not the fallback
    T, K = 96, 4
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to("cuda")
    weights = torch.rand(T, K, generator=gen).to("cuda")
    splits = [[1], list(range(0, E, 2)), [0, 1, 2, 5, 6, E - 1], list(range(E)),
              sorted(torch.randperm(E, generator=gen)[:E // 2].tolist())]
    results = []
    for runs in (False, True):
        routed = RoutedExperts(layer, COSTS, DeviceStaging(layer, E, torch.device("cuda"), torch.bfloat16))
        routed.choose(torch.bincount(ids.flatten().cpu(), minlength=E))
        results.append((_device_parts(routed, hidden, ids, weights, splits, runs), dict(routed.stats)))
    (gathered, stats_g), (copied, stats_c) = results
    assert stats_g == stats_c
    for chosen, (part_g, bytes_g), (part_c, bytes_c) in zip(splits, gathered, copied):
        assert torch.equal(part_g, part_c), chosen
        for g, c, t in zip(bytes_g, bytes_c, layer.tensors):
            if t is not None:
                assert torch.equal(g, c) and torch.equal(g.cpu().view(len(chosen), -1),
                                                         t[chosen].reshape(len(chosen), -1).view(torch.uint8))


@needs_cuda
@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_cuda_gather_reads_nothing_of_experts_not_chosen(fmt):
    """Every byte of the experts not chosen set to 0xFF (NaN scales for int8, NaN weights for bf16) before they are
    page-locked: the device part of the chosen ones is finite and equals the clean layer's bit for bit."""
    E, H, I, T, K = 8, 128, 64, 64, 3
    _, clean = _layer(fmt, None, E, H, I)
    _, poisoned = _layer(fmt, None, E, H, I)
    chosen = [0, 2, 3, 6]
    others = torch.tensor([e for e in range(E) if e not in chosen])
    for t in poisoned.tensors:
        if t is not None:
            t.view(torch.uint8)[others] = 0xFF
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(T, H, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).to("cuda")
    weights = torch.rand(T, K, generator=gen).to("cuda")
    parts = []
    for layer in (clean, poisoned):
        layer.pin_prefix(E)
        routed = RoutedExperts(layer, COSTS, DeviceStaging(layer, E, torch.device("cuda"), torch.bfloat16))
        parts.append(routed.device_part(hidden, ids, weights, torch.tensor(chosen)))
    assert torch.isfinite(parts[1]).all() and torch.equal(parts[0], parts[1])


# ---------------------------------------------------------------- in a model


def _split_model(costs, gpu_memory=None, dtype=torch.float32, experts_dtype="bf16", min_tokens=8, seed=0):
    torch.manual_seed(seed)
    base = tiny_model("qwen3_moe", dtype=dtype)
    model = ktorch.prepare(copy.deepcopy(base), device="cpu", experts_dtype=experts_dtype)
    ktorch.set_stream_experts(model, costs, gpu_memory=gpu_memory)
    for m in moe_experts_modules(model):
        m.kt_routed.min_tokens = min_tokens
    return base, model


@pytest.mark.parametrize("costs", [COSTS, ALL_TO_DEVICE, ALL_ON_CPU], ids=["balanced", "all_device", "all_cpu"])
def test_split_model_matches_hf_eager_and_copies_only_used_experts(costs):
    base, model = _split_model(costs)
    ids = torch.randint(0, 256, (1, 24))
    assert_logits_match(base, model, torch.float32, ids)
    stats = ktorch.prefill_split_stats(model)
    layers = len(moe_experts_modules(model))
    assert stats["passes"] == layers and stats["copied_unused"] == 0
    assert stats["rows"] == 24 * model.config.num_experts_per_tok * layers
    assert len(stats["last_hit"]) == layers and sum(stats["last_hit"]) == stats["experts_hit"]
    if costs is ALL_TO_DEVICE:
        assert stats["experts_copied"] == stats["experts_hit"] and stats["rows_copied"] == stats["rows"]
    if costs is ALL_ON_CPU:
        assert stats["experts_copied"] == 0
        plain = ktorch.prepare(copy.deepcopy(base), device="cpu")
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain(ids).logits)
    per_expert = moe_experts_modules(model)[0].kt_routed.layer.bytes_per_expert()
    assert stats["bytes_copied"] == stats["experts_copied"] * per_expert
    passes = ktorch.prefill_split_stats(model)["passes"]
    short = torch.randint(0, 256, (1, 7))  # below min_tokens: no split, no count
    with torch.no_grad():
        model(short)
    assert ktorch.prefill_split_stats(model, reset=True)["passes"] == passes
    assert ktorch.prefill_split_stats(model)["passes"] == 0


def test_split_off_restores_the_plain_model():
    base, model = _split_model(ALL_TO_DEVICE)
    plain = ktorch.prepare(copy.deepcopy(base), device="cpu")
    ids = torch.randint(0, 256, (1, 20))
    ktorch.set_stream_experts(model, "off")
    assert all(getattr(m, "kt_routed", None) is None for m in moe_experts_modules(model))
    assert model.kt_gpu_memory is None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain(ids).logits)


# ---------------------------------------------------------------- the budget


def test_parse_memory_size():
    assert parse_memory_size("24GiB") == 24 << 30 and parse_memory_size("24GB") == 24 * 10**9
    assert parse_memory_size("1.5 MiB") == 3 << 19 and parse_memory_size("123456") == 123456
    assert parse_memory_size(4096) == 4096
    for bad in ("24 parsecs", "GiB", "-1GiB", True, -5):
        with pytest.raises(ValueError, match="gpu_memory"):
            parse_memory_size(bad)


def _floor(model, dtype=torch.float32) -> int:
    """Bytes the budget must cover before any expert: the weights held on the device and the reserve."""
    return device_bytes_held(model, torch.device("cpu")) + reserve_bytes(model, dtype)


def _per_resident(model) -> int:
    """A budget's bytes for one more resident expert a layer: the model's 2 layers of fp32 gate/up/down weights
    (2I x H and H x I, read from the packed shapes), more than the packed bytes and the dequantized scratch."""
    m0 = moe_experts_modules(model)[0]
    return (m0.kt_w13.shape[1] * 16 * m0.kt_w2.shape[1] * 16 * 3 // 2) * 4 * 2


def _split_with_residents(model, floor: int, residents: int, slack: int = 0) -> None:
    """The split (COSTS, from 8 tokens) under a budget of ``floor``, a staging of 8 fp32 experts and room for
    ``residents`` resident experts a layer (+ ``slack`` bytes)."""
    m0 = moe_experts_modules(model)[0]
    staging = DeviceStaging.bytes_for(m0.kt_routed.layer, 8, torch.float32)
    ktorch.set_stream_experts(model, COSTS, gpu_memory=floor + staging + residents * _per_resident(model) + slack)
    for m in moe_experts_modules(model):
        m.kt_routed.min_tokens = 8


def test_tiny_budget_is_never_exceeded():
    """A budget just above the weights and the reserve: the staging gets what fits, no expert is resident, and
    what was allocated (measured after placement) stays within it; below the weights and reserve it is refused."""
    base = tiny_model("qwen3_moe")
    model = ktorch.prepare(copy.deepcopy(base), device="cpu")
    floor = _floor(model)
    m0 = moe_experts_modules(model)[0]
    layer = StreamedExperts(m0.kt_w13, m0.kt_w13_scales, m0.kt_w2, m0.kt_w2_scales, "silu")
    per_staging = DeviceStaging.bytes_for(layer, 1, torch.float32)
    for extra in (0, per_staging - 1, 3 * per_staging + 100):
        ktorch.set_stream_experts(model, COSTS, gpu_memory=floor + extra)
        plan: GpuMemoryPlan = model.kt_gpu_memory
        assert plan.used <= plan.budget == floor + extra
        assert plan.resident_per_layer == 0 and plan.staging_experts == extra // per_staging
        staging = m0.kt_routed.staging
        held = device_bytes_held(model, torch.device("cpu")) + staging.nbytes
        assert held + plan.reserve <= plan.budget, (extra, held, plan)
        ids = torch.randint(0, 256, (1, 16))
        for m in moe_experts_modules(model):
            m.kt_routed.min_tokens = 8
        with torch.no_grad():
            model(ids)
        assert ktorch.prefill_split_stats(model, reset=True)["experts_copied"] <= plan.staging_experts * 2
    with pytest.raises(ValueError, match="less than the model's weights"):
        ktorch.set_stream_experts(model, COSTS, gpu_memory=floor - 1)


def test_budget_fills_residents_after_the_staging():
    base = tiny_model("qwen3_moe")
    model = ktorch.prepare(copy.deepcopy(base), device="cpu")
    m0 = moe_experts_modules(model)[0]
    layer = StreamedExperts(m0.kt_w13, m0.kt_w13_scales, m0.kt_w2, m0.kt_w2_scales, "silu")
    full_staging = DeviceStaging.bytes_for(layer, 8, torch.float32)
    two_i, h = m0.kt_w13.shape[1] * 16, m0.kt_w2.shape[1] * 16
    per_resident = (two_i * h + h * two_i // 2) * (2 * 2 + 4)  # bf16 packed in two layers, one fp32 scratch
    floor = _floor(model)
    budget = floor + full_staging + 3 * per_resident + 10
    ktorch.set_stream_experts(model, COSTS, gpu_memory=budget)
    plan = model.kt_gpu_memory
    assert plan.staging_experts == 8 and plan.resident_per_layer == 3 and plan.used <= budget
    assert "resident experts" in plan.summary()
    for m in moe_experts_modules(model):  # held packed, as the CPU op holds them
        assert len(m.kt_gpu_expert_ids) == 3 and m.kt_gpu_packed[0].shape == (3, *m0.kt_w13.shape[1:])
    # residents only: the split off, a budget given
    ktorch.set_stream_experts(model, "off", gpu_memory=floor + 2 * per_resident)  # residents measured again: gone
    assert model.kt_gpu_memory.resident_per_layer == 2 and model.kt_gpu_memory.staging_experts == 0


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_swapping_residents_mid_run_keeps_results():
    """Residents swapped in place between two forwards: the second gives what a model placed with the new residents
    from the start gives (bit for bit), agrees with HF eager, and the device buffers keep their addresses."""
    base, model = _split_model(COSTS)
    _split_with_residents(model, _floor(model), 2)
    m0 = moe_experts_modules(model)[0]
    assert [m.kt_gpu_expert_ids for m in moe_experts_modules(model)] == [[0, 1], [0, 1]]
    ids = torch.randint(0, 256, (1, 24))
    _logits(model, ids)
    addresses = [[t.data_ptr() for t in (*m.kt_gpu_packed, m.kt_gpu_slot_of) if t is not None]
                 for m in moe_experts_modules(model)]
    for m in moe_experts_modules(model):  # make experts 5 and 6 the most routed-to
        m.kt_routed.frequency.zero_()
        m.kt_routed.frequency[5], m.kt_routed.frequency[6] = 100.0, 50.0
    result = update_resident_experts(model)
    assert result["swapped"] == 4
    assert [sorted(m.kt_gpu_expert_ids) for m in moe_experts_modules(model)] == [[5, 6], [5, 6]]
    assert [[t.data_ptr() for t in (*m.kt_gpu_packed, m.kt_gpu_slot_of) if t is not None]
            for m in moe_experts_modules(model)] == addresses
    for m in moe_experts_modules(model):
        slot_of = m.kt_gpu_slot_of.tolist()
        assert [e for e in range(8) if slot_of[e] >= 0] == [5, 6]
        assert [m.kt_gpu_expert_ids[slot_of[e]] for e in (5, 6)] == [5, 6]
    after = _logits(model, ids)
    fresh = copy.deepcopy(model)  # the same residents placed from scratch, in the same slots
    from ktorch.gpu_memory import drop_resident_experts, place_resident_experts

    for m in moe_experts_modules(fresh):
        order = torch.tensor(m.kt_gpu_expert_ids)
        drop_resident_experts(m)
        place_resident_experts(m, 2, torch.device("cpu"), initial=order)
    assert torch.equal(_logits(fresh, ids), after)
    assert_logits_match(base, model, torch.float32, ids)
    assert update_resident_experts(model)["swapped"] == 0  # nothing better left
    with pytest.raises(ValueError, match="already resident"):
        swap_resident_experts(m0, [5], [6])
    with pytest.raises(ValueError, match="expert 4 is not resident"):
        swap_resident_experts(m0, [3], [4])
    with pytest.raises(ValueError, match=r"repeated experts in \[3, 3\]"):
        swap_resident_experts(m0, [3, 3], [5, 6])


def test_resident_hits_count_rows_on_residents():
    _, model = _split_model(ALL_ON_CPU)
    # every expert resident
    ktorch.set_stream_experts(model, "off", gpu_memory=_floor(model) + 8 * _per_resident(model))
    ids = torch.randint(0, 256, (1, 5))
    _logits(model, ids)
    hits, rows = resident_hits(model)
    assert hits == rows == 5 * model.config.num_experts_per_tok * 2
    reset_resident_hits(model)
    assert resident_hits(model) == (0, 0)


def test_generate_updates_residents_after_prefill():
    """ktorch.generate swaps residents after the prefill (outside decode) and decodes with them: an expert far more
    routed-to than the resident one (counts as if from earlier prompts, plus the prefill's) replaces it."""
    _, model = _split_model(COSTS)
    _split_with_residents(model, _floor(model), 1)
    assert all(m.kt_gpu_expert_ids == [0] for m in moe_experts_modules(model))
    for m in moe_experts_modules(model):
        m.kt_routed.frequency[5] = 1000.0
    prompt = torch.randint(0, 256, (1, 40))
    ktorch.generate(model, prompt, max_new_tokens=4)
    for m in moe_experts_modules(model):
        assert int(torch.argmax(m.kt_routed.frequency)) == 5  # counts decayed, same order
        assert m.kt_gpu_expert_ids == [5] and m.kt_gpu_slot_of.tolist() == [-1] * 5 + [0] + [-1] * 2
    hits, rows = resident_hits(model)  # decode's (3 steps: the counters were reset after the prefill's update)
    assert rows == 3 * model.config.num_experts_per_tok * 2 and 0 <= hits <= rows


def _split_state(model) -> tuple:
    ms = moe_experts_modules(model)
    return (ktorch.prefill_split_stats(model), [m.kt_routed.frequency.clone() for m in ms],
            [list(m.kt_gpu_expert_ids) for m in ms], [m.kt_gpu_hits.clone() for m in ms], resident_hits(model))


def _same_split_state(a: tuple, b: tuple) -> bool:
    return (a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1])) and a[2] == b[2]
            and all(torch.equal(x, y) for x, y in zip(a[3], b[3])) and a[4] == b[4])


def test_warm_up_prefill_leaves_the_split_counters_and_the_residents():
    """The load-time warm-up's prefill (ktorch.generation._warm_up_prefill, run here on the CPU, where the split's
    "device" is the CPU) on a split model with residents, before and after a generate call: it splits as a prompt
    does (one split call per layer) and leaves the split counters, routing frequency, resident experts and resident
    hit counts as they were, so generate's tokens, counters, frequency, residents (swapped after its prefill from
    that frequency) and decode hit counts are those of a model without the warm-up. ktorch.warm_up itself does
    nothing on the CPU. (Residents from a profile: the warm-up's routing picks unprofiled ones,
    test_resident_swaps.py::test_the_warm_ups_routing_picks_the_first_residents.)"""
    import ktorch.generation as generation

    prompt = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))

    def model_():
        _, model = _split_model(COSTS)
        _split_with_residents(model, _floor(model), 1)
        for m in moe_experts_modules(model):
            m.kt_residents_profiled = True  # as placement marks residents chosen from an expert profile
        return model

    cold = model_()
    cold_ids = ktorch.generate(cold, prompt, max_new_tokens=4).ids
    model = model_()
    passes = []
    for m in moe_experts_modules(model):  # the warm-up's own split calls: seen before the state is put back
        choose = m.kt_routed.choose
        m.kt_routed.choose = lambda *a, choose=choose, **k: (passes.append(1), choose(*a, **k))[1]
    assert ktorch.warm_up(model) == 0.0 and passes == []
    before = _split_state(model)
    assert generation._warm_up_prefill(model, 64) > 0
    assert len(passes) == len(moe_experts_modules(model))  # it split
    assert _same_split_state(_split_state(model), before) and getattr(model, "kt_decoder", None) is None
    assert ktorch.generate(model, prompt, max_new_tokens=4).ids == cold_ids
    assert _same_split_state(_split_state(model), _split_state(cold))
    after = _split_state(model)  # between two calls: the first call's counters, frequency, residents, hits kept
    assert generation._warm_up_prefill(model, 64) > 0 and _same_split_state(_split_state(model), after)


@needs_cuda
def test_cuda_split_prefill_matches_hf_eager_and_pins_every_expert():
    torch.manual_seed(0)
    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype="int8", stream_experts=ALL_TO_DEVICE,
                           gpu_memory="off")  # no residents: every used expert is copied
    for m in moe_experts_modules(model):
        assert m.kt_routed.layer.pinned_experts == 8 and m.kt_routed.staging.packed.is_cuda
        assert all(t is None or t.is_pinned() for t in m.kt_routed.layer.sources)
        m.kt_routed.min_tokens = 8
    ids = torch.randint(0, 256, (1, 48), device="cuda")
    assert_logits_match(base.to("cuda"), model, torch.bfloat16, ids)
    stats = ktorch.prefill_split_stats(model)
    assert stats["copied_unused"] == 0 and stats["passes"] == 2 and stats["experts_copied"] == stats["experts_hit"]
    ktorch.set_stream_experts(model, COSTS, gpu_memory="2GiB")  # a budget: within it, measured
    assert model.kt_gpu_memory.used <= 2 << 30 and torch.cuda.memory_allocated() <= 2 << 30


@needs_cuda
@pytest.mark.parametrize("costs", [COSTS, ALL_ON_CPU], ids=["split", "cpu_op"])
def test_cuda_warm_up_leaves_the_first_prompt_nothing_to_allocate(costs, monkeypatch):
    """ktorch.warm_up on the GPU (what ktorch.load and the command line's loading end with): it runs (seconds > 0),
    keeps a decoder of the reserved KV positions (within the model's 1024) with the warm-up's prefill captured, and
    the first prompt replays it padded, making no new CUDA memory segment and no new page-locked staging (the experts
    runtime's pools), with the token of a model without the warm-up. The control: without the warm-up, the same first
    prefill does allocate (both start with no eager staging pool and no cached free CUDA memory, as a fresh
    process)."""
    import ktorch.generation as generation
    from ktorch.compile.experts_runtime import RUNTIME

    def model_():
        torch.manual_seed(0)
        # 1024 positions: the warm-up (WARM_UP_TOKENS capped by them) is longer than the prompt's cache
        m = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.bfloat16, max_position_embeddings=1024), device="cuda",
                           experts_dtype="int8", stream_experts=costs, gpu_memory="off")
        for e in moe_experts_modules(m):
            e.kt_routed.min_tokens = 8
        return m

    def pool_allocations() -> int:
        pools = list(RUNTIME._shared_pools.values()) + [p for site in RUNTIME._sites.values() for p in site.pools.values()]
        return sum(p.allocations for p in pools)

    def fresh_model():  # as in a fresh process: no eager staging pool yet, no cached free CUDA memory
        import gc

        RUNTIME._shared_pools.clear()
        m = model_()
        gc.collect()  # an earlier model (its kept decoder refers back to it) freed before the cache is emptied
        torch.cuda.empty_cache()
        return m

    seen = []
    prefill = generation.Decoder.prefill

    def recorded(self, x):
        torch.cuda.synchronize()
        before = (torch.cuda.memory_stats()["segment.all.allocated"], pool_allocations())
        out = prefill(self, x)
        torch.cuda.synchronize()
        seen.append((before, (torch.cuda.memory_stats()["segment.all.allocated"], pool_allocations())))
        return out

    monkeypatch.setattr(generation.Decoder, "prefill", recorded)
    ids = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(3))
    cold = ktorch.generate(fresh_model(), ids, 4, cuda_graphs=False).ids  # eager decode: the prefill is the point
    assert len(seen) == 1 and seen[0][0] != seen[0][1], seen  # the control: a cold first prefill allocates
    model = fresh_model()
    lengths = []
    init = generation.Decoder.__init__
    monkeypatch.setattr(generation.Decoder, "__init__",
                        lambda self, model, max_len, *a, **k: (lengths.append(max_len), init(self, model, max_len, *a, **k))[1])
    assert ktorch.warm_up(model) > 0 and lengths == [1024, 1024]  # the throwaway eager one, the kept one
    kept = model.kt_decoder
    # WARM_UP_BUCKETS' 512 too, the longest kept last (evicted last)
    assert kept.max_len == 1024 and list(kept.prefill_graphs) == [512, 1024]
    assert all(g.graph is not None for g in kept.prefill_graphs.values())
    replays = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or original(self))
    seen.clear()
    warm = ktorch.generate(model, ids, 1)
    assert warm.ids == cold[:1] and len(seen) == 1 and replays == [1] and model.kt_decoder is kept
    assert warm.timings.prefill_replayed == 512  # the 200-token prompt: the smallest captured bucket holding it
    assert seen[0][0] == seen[0][1], seen  # the first prompt's prefill: no new segment, no new pinned staging


@needs_cuda
def test_cuda_auto_calibrates_and_generates():
    torch.manual_seed(0)
    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype="int8", stream_experts="auto")
    costs = model.kt_split_costs
    assert costs.h2d_bytes_per_s > 1e8 and costs.cpu_row_s >= 0
    result = ktorch.generate(model, torch.randint(0, 256, (1, 80)), max_new_tokens=8)
    assert len(result.ids) == 8


def test_calibration_on_a_cpu_stand_in():
    """The CPU stand-in measures copies with CPU memcpy; the CPU op's fit is non-negative and explains some time."""
    layers = [_layer("int8", None, E=16, H=256, I=128, seed=s)[1] for s in range(2)]
    costs = calibrate_split_costs(layers, 256, 4, torch.device("cpu"), tokens=(64, 256), repeats=1)
    assert costs.h2d_bytes_per_s > 0 and costs.device_expert_s >= 0 and costs.device_row_s >= 0
    assert min(costs.cpu_fixed_s, costs.cpu_row_s, costs.cpu_expert_s) >= 0
    assert costs.cpu_fixed_s + 256 * 4 * costs.cpu_row_s + 16 * costs.cpu_expert_s > 0


def test_generate_prints_placement_lines_that_the_benchmark_reads():
    """ktorch generate's placement lines (ktorch/cli.py placement_lines) parse back in benchmarks/bench_generate.py:
    the split counters, the budget and the decode resident hit rate, as the model counted them."""
    import sys
    from pathlib import Path

    from ktorch.cli import placement_lines

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from bench_generate import parse_generate_output

    _, model = _split_model(COSTS)
    _split_with_residents(model, _floor(model), 2)
    result = ktorch.generate(model, torch.randint(0, 256, (1, 40)), max_new_tokens=5)
    stats = ktorch.prefill_split_stats(model)
    parsed = parse_generate_output(result.timings.line() + "\n" + "\n".join(placement_lines(model, result.timings)))
    assert parsed["experts_hit"] == stats["experts_hit"] and parsed["experts_copied"] == stats["experts_copied"]
    assert parsed["hit_per_layer"] == stats["last_hit"] and parsed["copied_unused"] == 0
    assert parsed["resident_per_layer"] == 2 and parsed["gpu_used_gib"] <= parsed["gpu_budget_gib"]
    hits, rows = resident_hits(model)
    assert parsed["decode_resident_hit_rate"] == pytest.approx(hits / rows)


@needs_cuda
def test_cuda_captured_decode_after_a_swap_matches_eager():
    """Residents swapped in place between two generate calls: the kept CUDA graph (it reads the same buffers) decodes
    the tokens an eager decode with the same residents gives; the hit counters count captured steps. The int8
    residents are row-major (Triton decode kernels) where Triton is installed, packed otherwise."""
    from ktorch.ops.resident_rows import RowExperts
    from ktorch.ops.triton_experts import triton_available

    torch.manual_seed(0)
    base = tiny_model("qwen3_moe")  # fp32: the captured step runs Inductor-fused layers; bf16 rounding flips tokens
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype="int8", stream_experts=COSTS)
    floor = torch.cuda.memory_allocated() + reserve_bytes(model, torch.float32)
    _split_with_residents(model, floor, 3, slack=64 << 20)
    assert model.kt_gpu_memory.resident_per_layer >= 2
    for m in moe_experts_modules(model):
        # three residents of the 8 experts (the budget's slack may hold all 8 of so small a model: none to swap in)
        place_resident_experts(m, 3, torch.device("cuda"), initial=torch.tensor([0, 1, 2]))
    assert all(isinstance(m.kt_gpu_packed, RowExperts) == triton_available() for m in moe_experts_modules(model))
    prompt = torch.randint(0, 256, (1, 40), device="cuda")
    ktorch.generate(model, prompt, max_new_tokens=8)
    graph = model.kt_decoder.graph
    assert graph is not None
    wanted = {}
    for m in moe_experts_modules(model):  # two experts not resident now become the most routed-to
        outside = [e for e in range(m.kt_routed.frequency.numel()) if e not in set(m.kt_gpu_expert_ids)]
        wanted[id(m)] = set(outside[:2])
        m.kt_routed.frequency[outside[:2]] = 1e9
    assert update_resident_experts(model)["swapped"] >= 2 * len(wanted)
    captured = ktorch.generate(model, prompt, max_new_tokens=8)
    assert model.kt_decoder.graph is graph  # reused after the swap
    hits, rows = resident_hits(model)
    slots_per_step = model.config.num_experts_per_tok * 2  # top-k slots x 2 layers, each replayed step
    assert rows > 0 and rows % slots_per_step == 0 and 0 <= hits <= rows
    eager = ktorch.generate(model, prompt, max_new_tokens=8, cuda_graphs=False)
    assert captured.ids == eager.ids
    assert all(wanted[id(m)] <= set(m.kt_gpu_expert_ids) for m in moe_experts_modules(model))


def test_load_takes_the_split_and_the_budget():
    """ktorch.load(..., stream_experts=, gpu_memory=) places as set_stream_experts does (the builtin model, CPU)."""
    model, _ = ktorch.load("builtin", device="cpu", stream_experts=COSTS, gpu_memory="off", tokenizer=False)
    plan = model.kt_gpu_memory
    assert plan.resident_per_layer == 0 and plan.staging_experts == model.config.num_experts
    assert all(m.kt_routed.costs is COSTS for m in moe_experts_modules(model))


def test_prepare_budget_starts_residents_from_a_profile():
    torch.manual_seed(5)
    base = tiny_model("qwen3_moe")
    ids = torch.randint(0, 256, (1, 24))
    profile = ktorch.profile_experts(base, ids)
    floor = _floor(ktorch.prepare(copy.deepcopy(base), device="cpu"))
    m0 = moe_experts_modules(base)[0]
    per_resident = (m0.gate_up_proj[0].numel() + m0.down_proj[0].numel()) * 4 * 2
    model = ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_memory=floor + 3 * per_resident,
                           expert_profile=profile)
    assert model.kt_gpu_memory.resident_per_layer == 3 and model.kt_gpu_memory.staging_experts == 0
    for (name, _), m in zip(ktorch.placement.experts_modules(model), moe_experts_modules(model)):
        assert sorted(m.kt_gpu_expert_ids) == sorted(profile.hottest(name, 3).tolist())
    assert_logits_match(base, model, torch.float32, ids)
    with pytest.raises(ValueError, match="leave gpu_experts unset"):
        ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_memory="1GiB", gpu_experts=2, expert_profile=profile)


# ---------------------------------------------------------------- the defaults and the serve's reserve


def test_default_gpu_memory_is_auto_on_cuda_for_inference_only():
    """What an unset gpu_memory means for prepare, ktorch.load and the command line (placement.default_gpu_memory):
    "auto" on a CUDA device for inference; nothing on the CPU, for training, beside gpu_experts or a fixed stream
    table, or for experts the device kernels cannot run (gpt-oss's biased experts: every expert stays on the CPU)."""
    from ktorch.placement import default_gpu_memory, experts_modules
    from test_integrations_families import tiny_family_model

    modules = experts_modules(tiny_model("qwen3_moe"))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_gpu_memory(modules, cuda) == "auto" == default_gpu_memory(modules, cuda, "auto")
    assert default_gpu_memory(modules, cuda, COSTS) == "auto"
    assert default_gpu_memory(modules, cpu) is None
    assert default_gpu_memory(modules, cuda, trainable=True) is None
    assert default_gpu_memory(modules, cuda, gpu_experts=2) is None
    assert default_gpu_memory(modules, cuda, {512: 0.4}) is None
    biased = experts_modules(tiny_family_model("gpt_oss"))
    assert default_gpu_memory(biased, cuda) is None


def test_ktorch_loads_default_split_is_the_command_lines():
    """What an unset stream_experts means for ktorch.load (placement.default_stream_experts): the routing-aware
    split, "auto", on a CUDA device, as `ktorch generate`'s --stream-experts default; nothing on the CPU or for
    experts the device kernels cannot run."""
    from ktorch.placement import default_stream_experts, experts_modules
    from test_integrations_families import tiny_family_model

    modules = experts_modules(tiny_model("qwen3_moe"))
    assert default_stream_experts(modules, torch.device("cuda")) == "auto"
    assert default_stream_experts(modules, torch.device("cpu")) is None
    assert default_stream_experts(experts_modules(tiny_family_model("gpt_oss")), torch.device("cuda")) is None


@needs_cuda
def test_cuda_ktorch_load_places_as_the_command_line_does():
    """ktorch.load on a GPU with its defaults: the split (its costs measured) and the budget, as the command line's
    defaults place them; stream_experts="off": the budget's residents only, no split."""
    from ktorch.ops.routed_experts import SplitCosts

    model, _ = ktorch.load("builtin", device="cuda", progress=False, tokenizer=False, warm_up=False)
    assert model.kt_gpu_memory is not None and isinstance(model.kt_split_costs, SplitCosts)  # measured at load
    assert all(getattr(m, "kt_routed", None) is not None for m in moe_experts_modules(model))
    off, _ = ktorch.load("builtin", device="cuda", progress=False, tokenizer=False, warm_up=False,
                         stream_experts="off")
    assert off.kt_gpu_memory is not None and off.kt_split_costs is None  # residents, the layers only counting


def test_gpu_memory_auto_needs_cuda_and_off_places_no_resident():
    """Unset on the CPU: nothing placed, as before. "auto" given where there is no CUDA device is a clear error
    (prepare, ktorch.load, set_stream_experts), never a silent no-op. "off" keeps every expert in host memory, with
    the split on or off."""
    base = tiny_model("qwen3_moe")
    model = ktorch.prepare(copy.deepcopy(base), device="cpu")
    assert getattr(model, "kt_gpu_memory", None) is None
    assert all(getattr(m, "kt_routed", None) is None for m in moe_experts_modules(model))
    with pytest.raises(ValueError, match="gpu_memory='auto' sizes the budget from a CUDA device's free memory"):
        ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_memory="auto")
    with pytest.raises(ValueError, match="gpu_memory='auto' sizes the budget from a CUDA device's free memory"):
        ktorch.set_stream_experts(model, "off", gpu_memory="auto")
    with pytest.raises(ValueError, match="gpu_memory='auto' sizes the budget from a CUDA device's free memory"):
        ktorch.load("builtin", device="cpu", gpu_memory="auto", tokenizer=False, progress=False)
    off = ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_memory="off")
    assert getattr(off, "kt_gpu_memory", None) is None
    assert all(getattr(m, "kt_gpu_expert_ids", None) is None for m in moe_experts_modules(off))
    ktorch.set_stream_experts(model, COSTS, gpu_memory="off")  # the split with no budget: a full staging, no resident
    assert model.kt_gpu_memory.resident_per_layer == 0 and model.kt_gpu_memory.staging_experts == 8
    assert all(getattr(m, "kt_gpu_expert_ids", None) is None and getattr(m, "kt_gpu_slot_of", None) is None
               for m in moe_experts_modules(model))
    ids = torch.randint(0, 256, (1, 12))
    assert_logits_match(base, model, torch.float32, ids)


def test_prepare_for_training_undoes_a_placement():
    """A model placed with residents (what ktorch.load does by default on a GPU; a CPU stand-in budget here) and
    then prepared with trainable=True loses its residents and split, so that the backward runs (neither has one)."""
    base = tiny_model("qwen3_moe")
    model = ktorch.prepare(copy.deepcopy(base), device="cpu")
    ktorch.set_stream_experts(model, "off", gpu_memory=_floor(model) + 3 * _per_resident(model))
    assert model.kt_gpu_memory.resident_per_layer == 3
    ktorch.prepare(model, device="cpu", trainable=True, gradient_checkpointing=False)
    assert model.kt_gpu_memory is None
    assert all(getattr(m, "kt_routed", None) is None and getattr(m, "kt_gpu_expert_ids", None) is None
               for m in moe_experts_modules(model))
    ids = torch.randint(0, 256, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_a_larger_reserve_gives_fewer_residents():
    """The reserve comes before the residents (ktorch serve gives its KV pool's bytes): a budget whose residents
    would eat the pool's bytes holds fewer, exactly (budget - weights - reserve) // bytes per resident; the pool's
    reserve is what the plan says it kept; a budget below the weights and the pool is refused."""
    from ktorch.gpu_memory import dequantized_bytes_per_expert, resident_bytes_per_expert
    from ktorch.serve.engine import EngineConfig, kv_pool_for

    model = ktorch.prepare(copy.deepcopy(tiny_model("qwen3_moe")), device="cpu")
    modules = moe_experts_modules(model)
    per = resident_bytes_per_expert(modules[0]) * len(modules) + dequantized_bytes_per_expert(modules[0], torch.float32)
    weights = device_bytes_held(model, torch.device("cpu"))
    pool = kv_pool_for(model.config, torch.float32, EngineConfig(page_size=16, num_blocks=400, max_batch_tokens=2048))
    assert pool.nbytes > reserve_bytes(model, torch.float32) + 8 * per  # generate's reserve leaves room for all 8
    budget = weights + pool.nbytes + 3 * per + 10
    ktorch.set_stream_experts(model, "off", gpu_memory=budget)
    assert model.kt_gpu_memory.resident_per_layer == 8  # residents would take the pool's bytes
    ktorch.set_stream_experts(model, "off", gpu_memory=budget, reserve=pool.nbytes)
    plan = model.kt_gpu_memory
    assert plan.reserve == pool.nbytes and plan.used <= budget
    assert plan.resident_per_layer == (budget - weights - pool.nbytes) // per == 3
    assert all(len(m.kt_gpu_expert_ids) == 3 for m in modules)
    with pytest.raises(ValueError, match="less than the model's weights"):
        ktorch.set_stream_experts(model, "off", gpu_memory=weights + pool.nbytes - 1, reserve=pool.nbytes)
    with pytest.raises(ValueError, match="reserve must be a byte count"):
        ktorch.set_stream_experts(model, "off", gpu_memory=budget, reserve=-1)


def test_residents_read_in_place_need_no_scratch(monkeypatch):
    """Int8 residents in the row layout, which decode's Triton kernels and a prefill's grouped GEMM read where they lie
    (bf16 activations, kernel auto), need no dequantized scratch: the plan divides the budget by their packed bytes
    alone, so the same budget holds more of them. 4-bit rows (dequantized at prefill), fp32 activations, a kernel
    named, and the CPU (no row layout) keep the scratch. The CUDA check (row_layout_applies) stands in as true."""
    from ktorch.gpu_memory import (dequantized_bytes_per_expert, plan_gpu_memory, resident_bytes_per_expert,
                                   residents_read_in_place)
    from ktorch.ops import resident_rows

    torch.manual_seed(0)
    int8 = ktorch.prepare(copy.deepcopy(tiny_model("qwen3_moe")), device="cpu", experts_dtype="int8")
    int4 = ktorch.prepare(copy.deepcopy(tiny_model("qwen3_moe")), device="cpu", experts_dtype="int4", group_size=32)
    m8, m4 = moe_experts_modules(int8)[0], moe_experts_modules(int4)[0]
    cpu = torch.device("cpu")
    assert not residents_read_in_place(m8, cpu, torch.bfloat16)  # no row layout off CUDA
    monkeypatch.setattr(resident_rows, "row_layout_applies", lambda *a: True)
    assert residents_read_in_place(m8, cpu, torch.bfloat16) and residents_read_in_place(m8, cpu, torch.float16)
    assert not residents_read_in_place(m8, cpu, torch.float32)
    assert not residents_read_in_place(m8, cpu, torch.bfloat16, kernel="grouped_mm")
    assert not residents_read_in_place(m4, cpu, torch.bfloat16)
    modules = moe_experts_modules(int8)
    packed = resident_bytes_per_expert(modules[0]) * len(modules)
    scratch = dequantized_bytes_per_expert(modules[0], torch.bfloat16)
    floor = device_bytes_held(int8, cpu) + reserve_bytes(int8, torch.bfloat16)
    budget = floor + 3 * (packed + scratch) + 3 * packed // 2
    in_place = plan_gpu_memory(int8, modules, budget, cpu, torch.bfloat16, None)
    assert in_place.resident_per_layer == min(8, 3 + (3 * packed // 2 + 3 * scratch) // packed) > 3
    assert in_place.resident == in_place.resident_per_layer * packed and in_place.used <= budget
    named = plan_gpu_memory(int8, modules, budget, cpu, torch.bfloat16, None, kernel="grouped_mm")
    assert named.resident_per_layer == 3 and named.resident == 3 * (packed + scratch)


def test_the_budget_counts_what_lies_outside_the_allocator(monkeypatch):
    """The budget is the process's device memory as the card shows it: the bytes outside the allocator when the plan
    is made (the CUDA context, measured on a GPU: a CPU stand-in has none, so a stand-in figure here) come first and
    take residents' room; a budget below them, the weights and the reserve is refused naming the context."""
    from ktorch import gpu_memory

    model = ktorch.prepare(copy.deepcopy(tiny_model("qwen3_moe")), device="cpu")
    per = _per_resident(model)
    budget = _floor(model) + 5 * per
    ktorch.set_stream_experts(model, "off", gpu_memory=budget)
    assert model.kt_gpu_memory.outside == 0 and model.kt_gpu_memory.resident_per_layer == 5
    monkeypatch.setattr(gpu_memory, "outside_allocator", lambda device: 3 * per)
    ktorch.set_stream_experts(model, "off", gpu_memory=budget)
    plan = model.kt_gpu_memory
    assert plan.outside == 3 * per and plan.used <= budget and "CUDA context" in plan.summary()
    assert plan.resident_per_layer == 2
    with pytest.raises(ValueError, match="reserve .* and the CUDA context"):
        ktorch.set_stream_experts(model, "off", gpu_memory=_floor(model) + per)


@needs_cuda
def test_cuda_prepare_and_load_default_to_resident_experts():
    """On a GPU, prepare and ktorch.load with no placement option hold resident experts within the free memory
    (the tiny models' experts all fit: every layer's), give HF eager's logits and decode on residents only;
    gpu_memory="off" holds none; trainable=True takes them back to the CPU op."""
    torch.manual_seed(0)
    base = tiny_model("qwen3_moe")
    model = ktorch.prepare(copy.deepcopy(base), device="cuda")
    plan = model.kt_gpu_memory
    assert plan is not None and plan.resident_per_layer == 8 and plan.staging_experts == 0
    assert plan.used <= plan.budget and torch.cuda.memory_allocated() <= plan.budget
    ids = torch.randint(0, 256, (1, 12))
    assert_logits_match(copy.deepcopy(base).to("cuda"), model, torch.float32, ids.cuda())
    reset_resident_hits(model)
    result = ktorch.generate(model, ids, max_new_tokens=8, cuda_graphs=False)  # captured: tests/test_resident_rows.py
    hits, rows = resident_hits(model)
    assert len(result.ids) == 8 and hits == rows > 0
    off = ktorch.prepare(copy.deepcopy(base), device="cuda", gpu_memory="off")
    assert getattr(off, "kt_gpu_memory", None) is None
    assert all(getattr(m, "kt_gpu_expert_ids", None) is None for m in moe_experts_modules(off))
    loaded, _ = ktorch.load("builtin", device="cuda", progress=False, tokenizer=False, warm_up=False)
    assert loaded.kt_gpu_memory.resident_per_layer == loaded.config.num_experts
    ktorch.prepare(loaded, device="cuda", trainable=True, gradient_checkpointing=False)
    assert loaded.kt_gpu_memory is None
    assert all(getattr(m, "kt_gpu_expert_ids", None) is None for m in moe_experts_modules(loaded))


def test_split_call_prices_a_call_as_the_choice_does():
    """SplitCall.of: the CPU side (rows and experts neither copied nor resident) and the device side (copied experts,
    rows of copied and resident experts) priced by hand, and the same prices choose_device_experts minimised."""
    from ktorch.ops.routed_experts import SplitCall

    counts = np.array([0, 100, 5, 50, 0, 20, 1, 0])
    resident = np.zeros(8, dtype=bool)
    resident[5] = True
    call = SplitCall.of(counts, np.array([1, 3]), resident, COSTS, 10**6)
    assert (call.cpu_rows, call.cpu_experts, call.copied, call.device_rows) == (6, 2, 2, 170)
    assert call.cpu_s == pytest.approx(1e-3 + 6e-5 + 1e-3)  # 1 ms + 6 rows x 10 us + 2 experts x 0.5 ms
    assert call.device_s == pytest.approx(2e-3)  # 2 x 1 MB at 1 GB/s, no device row cost
    costs = SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=0, cpu_row_s=1e-5, cpu_expert_s=0, device_row_s=1e-6,
                       device_expert_s=1e-4)
    call = SplitCall.of(counts, np.array([1, 2, 3, 6]), None, costs, 10**6)
    assert (call.cpu_rows, call.cpu_experts) == (20, 1) and call.cpu_s == pytest.approx(2e-4)
    assert call.device_s == pytest.approx(4 * (1e-3 + 1e-4) + 156e-6)
    everything = SplitCall.of(counts, np.array([1, 2, 3, 5, 6]), None, COSTS, 10**6)
    assert everything.cpu_experts == 0 and everything.cpu_s == 0.0  # no CPU expert: no CPU time, fixed included
    assert call.device_measured_s is None


def test_recorded_calls_price_each_layer_call_and_time_its_device_part():
    """RoutedExperts.calls (off by default): a split model's layer calls each append their SplitCall, priced from the
    call's counts as the choice priced them, and their device part timed when it ran (on the CPU: wall time)."""
    _, model = _split_model(COSTS)
    modules = moe_experts_modules(model)
    assert all(m.kt_routed.calls is None for m in modules)
    calls: list = []
    for m in modules:
        m.kt_routed.calls = calls
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 24)))
    stats = ktorch.prefill_split_stats(model)
    assert len(calls) == len(modules) == stats["passes"]
    assert sum(c.copied for c in calls) == stats["experts_copied"]
    assert sum(c.device_rows for c in calls) == stats["rows_copied"]
    assert sum(c.cpu_rows for c in calls) == stats["rows"] - stats["rows_copied"]
    for c in calls:
        assert c.cpu_s == pytest.approx(float(COSTS.cpu_seconds(c.cpu_rows, c.cpu_experts)))
        assert c.device_s == pytest.approx(c.copied * 1e-3 * modules[0].kt_routed.bytes_per_expert / 10**6)
        assert (c.device_measured_s is not None and c.device_measured_s > 0) == (c.copied > 0)


# ---------------------------------------------------------------- the calibration's fit


def _install_law(monkeypatch, fixed, row, expert, calls=None):
    """The calibration's CPU op replaced by a stand-in taking fixed + row * rows + expert * experts seconds on a
    virtual clock, which routed_experts' timings read: every reading advances it by a microsecond (so each measured
    interval is positive) and the stand-in by its law's time. The fit then sees the law itself, whatever the load
    on the machine running the tests (a stand-in spinning on the real clock failed CI under load)."""
    import types

    from ktorch.ops import routed_experts

    clock = [0.0]

    def perf_counter():
        clock[0] += 1e-6
        return clock[0]

    def op(layer, x, ids, weights):
        rows = int((ids >= 0).sum())
        experts = int(ids[ids >= 0].unique().numel())
        if calls is not None:
            calls.append((rows, experts))
        clock[0] += fixed + row * rows + expert * experts

    monkeypatch.setattr(routed_experts, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(routed_experts, "_cpu_op", op)


@pytest.mark.parametrize("law", [(1e-3, 4e-6, 5e-5), (5e-4, 1e-6, 3e-4)], ids=["rows_dominate", "experts_dominate"])
def test_calibration_recovers_a_known_cpu_law(law, monkeypatch):
    """With the CPU op replaced by one whose time follows fixed + row_s * rows + expert_s * experts, the
    calibration's fit gives the law's coefficients back within 10%, whichever term dominates; its runs are at
    ``tokens``, with every expert used and with a quarter of them, and in the split's sparse calls (SPARSE_CALLS:
    a few experts with a few rows each, the rest of the rows unrouted)."""
    from ktorch.ops.routed_experts import SPARSE_CALLS

    calls: list = []
    _install_law(monkeypatch, *law, calls=calls)
    layers = [_layer("int8", None, E=16, H=256, I=128, seed=s)[1] for s in range(2)]
    costs = calibrate_split_costs(layers, 256, 4, torch.device("cpu"), tokens=(64, 256), repeats=2)
    dense = {(64 * 4, 16), (256 * 4, 16), (64 * 4, 4), (256 * 4, 4)}
    sparse = set(calls) - dense
    assert dense <= set(calls) and {e for _, e in sparse} == {min(used, 16) for used, _ in SPARSE_CALLS}
    assert all(0 < r <= e * max(per for _, per in SPARSE_CALLS) for r, e in sparse)
    assert costs.cpu_fixed_s == pytest.approx(law[0], rel=0.1)
    assert costs.cpu_row_s == pytest.approx(law[1], rel=0.1)
    assert costs.cpu_expert_s == pytest.approx(law[2], rel=0.1)


def _calibrated(fixed, row, expert, **kwargs):
    """SplitCosts as the set-up measures them: a law's four calibration points (1024 and 4096 rows, 16 and 4
    experts) and the law fitted to them."""
    points = tuple((r, e, fixed + row * r + expert * e) for r in (1024, 4096) for e in (16, 4))
    return SplitCosts(h2d_bytes_per_s=kwargs.pop("h2d_bytes_per_s", 1e9), cpu_fixed_s=fixed, cpu_row_s=row,
                      cpu_expert_s=expert, calibration=points, **kwargs)


def test_costs_learn_the_cpu_law_from_the_calls_observed():
    """The set-up's fit said 3 ms a call; the split's CPU calls as they ran (5-400 rows, 1-15 experts, 2% noise)
    follow 0.4 ms + 3 us a row + 15 us an expert. Nothing changes before ``REFIT_EVERY`` calls are observed; from
    48 calls the refitted law predicts them within 5% each, where the set-up's was more than 1.5x off."""
    from ktorch.ops.routed_experts import REFIT_EVERY

    def law(r, e):
        return 4e-4 + 3e-6 * r + 1.5e-5 * e

    costs = _calibrated(3e-3, 2.5e-6, 1.3e-5)
    rng = np.random.default_rng(0)
    calls = [(int(rng.integers(5, 400)), int(rng.integers(1, 16))) for _ in range(48)]
    seconds = [law(r, e) * (1 + 0.02 * rng.standard_normal()) for r, e in calls]
    assert all(costs.cpu_seconds(r, e) > 1.5 * law(r, e) for r, e in calls)
    for (r, e), s in zip(calls[:REFIT_EVERY - 1], seconds):
        costs.observe_cpu(r, e, s)
    assert not costs.refit_cpu() and costs.cpu_fixed_s == 3e-3 and costs.refits == 0
    for (r, e), s in zip(calls[REFIT_EVERY - 1:], seconds[REFIT_EVERY - 1:]):
        costs.observe_cpu(r, e, s)
        costs.refit_cpu()
    assert costs.refits == (len(calls) - REFIT_EVERY) // REFIT_EVERY + 1
    for r, e in calls:
        assert float(costs.cpu_seconds(r, e)) == pytest.approx(law(r, e), rel=0.05)
    assert costs.cpu_fixed_s == pytest.approx(4e-4, rel=0.25)
    copied = copy.deepcopy(costs)  # a deep-copied model's costs: their own lock, the same observations
    copied.observe_cpu(10, 2, law(10, 2))
    assert copied._observed[-1] == (10.0, 2.0, law(10, 2)) and len(costs._observed) == len(calls)


def test_costs_given_by_hand_do_not_learn_and_no_coefficient_goes_negative():
    """Costs without calibration points (given by hand) ignore observed calls; a refit whose least squares give a
    negative coefficient drops it (0) and fits the others: here calls whose time falls with their experts."""
    from ktorch.ops.routed_experts import REFIT_EVERY

    given = SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=1e-3, cpu_row_s=1e-5, cpu_expert_s=5e-4)
    for _ in range(3 * REFIT_EVERY):
        given.observe_cpu(100, 4, 1.0)
    assert not given.refit_cpu() and given == COSTS
    costs = _calibrated(1e-3, 1e-6, 1e-5)
    for r in range(2 * REFIT_EVERY):
        e = 1 + r % 8
        costs.observe_cpu(50 + 10 * r, e, 1e-3 + 2e-6 * (50 + 10 * r) - 5e-5 * e)
    assert costs.refit_cpu()
    assert costs.cpu_expert_s == 0 and costs.cpu_fixed_s > 0 and costs.cpu_row_s > 0


def test_the_cpu_law_fits_relative_errors_so_small_calls_count():
    """``fit_cpu_law`` fits each point's error relative to its seconds: points of the law fixed + row + expert
    (0.1 ms, 1.5 us, 40 us) with 3% noise, tenths of a millisecond (a split's sparse calls) beside tens of
    milliseconds (dense calls), give every point back within 10%, the sparse ones included (an absolute fit let
    them be off by their own size), and the coefficients within 15%; a coefficient that comes out negative is
    dropped."""
    from ktorch.ops.routed_experts import fit_cpu_law

    def law(r, e):
        return 1e-4 + 1.5e-6 * r + 4e-5 * e

    rng = np.random.default_rng(1)
    shapes = [(4, 1), (16, 4), (48, 8), (64, 4), (384, 8)] + [(r, e) for r in (2048, 8192) for e in (32, 128)]
    points = [(r, e, law(r, e) * (1 + 0.03 * rng.standard_normal())) for r, e in shapes]
    fixed, row, expert = fit_cpu_law(points)
    for r, e, _ in points:
        assert fixed + row * r + expert * e == pytest.approx(law(r, e), rel=0.1)
    assert (fixed, row, expert) == pytest.approx((1e-4, 1.5e-6, 4e-5), rel=0.15)
    falling = [(r, e, 1e-3 + 2e-6 * r - 5e-5 * e) for r, e in [(50 + 10 * i, 1 + i % 8) for i in range(24)]]
    fixed, row, expert = fit_cpu_law(falling)
    assert expert == 0 and fixed > 0 and row > 0


def test_captured_prefills_choose_with_the_calibrations_cpu_law(monkeypatch):
    """``SplitCosts.calibrated`` is the law of the set-up's points alone, whatever the refits to observed (eager)
    calls made of the costs; a captured split chooses with it (its CPU calls run on native tasks, as the
    calibration times the op). Costs given by hand are their own calibrated costs."""
    from ktorch.ops import routed_experts
    from ktorch.ops.routed_experts import REFIT_EVERY, RoutedExperts, fit_cpu_law

    costs = _calibrated(1e-3, 1e-6, 1e-5)
    for r in range(2 * REFIT_EVERY):
        costs.observe_cpu(50 + 10 * r, 1 + r % 8, 5e-3 + 1e-6 * r)
    assert costs.refit_cpu()
    law = costs.calibrated()
    assert (law.cpu_fixed_s, law.cpu_row_s, law.cpu_expert_s) == pytest.approx(fit_cpu_law(costs.calibration))
    assert law.cpu_fixed_s == pytest.approx(1e-3, rel=1e-6) and costs.cpu_fixed_s > 4e-3
    assert (law.h2d_bytes_per_s, law.device_row_s, law.calibration) == (costs.h2d_bytes_per_s, costs.device_row_s,
                                                                        costs.calibration)
    assert COSTS.calibrated() is COSTS

    seen = []

    class Chosen(Exception):
        pass

    def choose(counts, costs_given, *args, **kwargs):
        seen.append(costs_given)
        raise Chosen

    monkeypatch.setattr(routed_experts, "choose_on_device", choose)
    routed = RoutedExperts(_layer("int8", None)[1], costs, None)
    ids = torch.zeros(8, 2, dtype=torch.int64)
    with pytest.raises(Chosen):
        routed.captured_split(torch.zeros(8, 128), ids, torch.ones(8, 2), torch.ones(8, dtype=torch.int64), None)
    assert seen[0].cpu_fixed_s == law.cpu_fixed_s and seen[0].cpu_row_s == law.cpu_row_s


def test_split_model_reports_each_cpu_call_to_its_costs():
    """A prefill of the split model (CPU stand-in): each layer call that leaves the CPU op experts reports that
    call's rows and experts, as the choice counted them, and a positive time; shorter calls (no split) report
    nothing; after ``REFIT_EVERY`` calls the costs are refitted."""
    from ktorch.ops.routed_experts import REFIT_EVERY

    costs = _calibrated(1e-3, 1e-5, 5e-4, h2d_bytes_per_s=3e7)  # about half the experts hit copied
    base, model = _split_model(costs)
    routed = [m.kt_routed for m in moe_experts_modules(model)]
    assert all(r.costs is costs for r in routed)
    calls = 0
    for _ in range(3 * REFIT_EVERY):
        if costs.refits:
            break
        before = ktorch.prefill_split_stats(model)
        with torch.no_grad():
            model(torch.randint(0, 256, (1, 24)))
        stats = ktorch.prefill_split_stats(model)
        cpu_rows = (stats["rows"] - stats["rows_copied"]) - (before["rows"] - before["rows_copied"])
        new = list(costs._observed)[calls:] if len(costs._observed) > calls else []
        if costs.refits == 0:
            assert sum(r for r, _, _ in new) == cpu_rows and all(s > 0 and e >= 1 for _, e, s in new)
        calls += len(new)
    assert costs.refits >= 1 and calls >= REFIT_EVERY
    observed = len(costs._observed)
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 5)))  # below min_tokens: no split, nothing observed
    assert len(costs._observed) == observed


def test_runtime_reports_an_eager_calls_seconds():
    """RUNTIME.submit(..., observe=f): the worker calls f once with the op's seconds, before the wait returns."""
    from ktorch.compile.experts_runtime import RUNTIME
    from ktorch.ops.moe import pack_experts

    torch.manual_seed(0)
    E, H, I, T, K = 4, 64, 32, 8, 2
    packed = pack_experts(torch.randn(E, 2 * I, H, dtype=torch.bfloat16) / 8, torch.randn(E, H, I, dtype=torch.bfloat16) / 8)
    layer = RUNTIME.register_layer(packed.w13, None, packed.w2, None, "silu")
    site = RUNTIME.new_site()
    hidden = torch.randn(T, H, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, K), dtype=torch.int32)
    weights = torch.full((T, K), 0.5)
    seen: list = []
    ticket = RUNTIME.submit(hidden, ids, weights, layer, site, observe=seen.append)
    out = RUNTIME.wait(ticket, hidden, layer, site)
    assert len(seen) == 1 and seen[0] > 0
    want = torch.ops.kt.fused_moe(hidden, ids, weights, packed.w13, None, packed.w2, None, "silu")
    assert torch.equal(out, want)


def test_warm_up_prefill_teaches_the_split_costs():
    """What the load-time warm-up keeps: its CPU calls are observed by the split's (calibrated) costs, one per layer
    that left the CPU experts, so a first prompt's choice already uses them (the counters are put back, above)."""
    import ktorch.generation as generation

    costs = _calibrated(1e-3, 1e-5, 5e-4, h2d_bytes_per_s=3e7)
    _, model = _split_model(costs)
    assert generation._warm_up_prefill(model, 64) > 0
    observed = list(costs._observed)
    assert 1 <= len(observed) <= len(moe_experts_modules(model))
    assert all(rows >= experts >= 1 and seconds > 0 for rows, experts, seconds in observed)
    assert ktorch.prefill_split_stats(model)["passes"] == 0  # the counters: put back
