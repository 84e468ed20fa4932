"""NUMA split of the fused-MoE op (ktorch/ops/numa_split.py, ktorch/csrc/moe/numa_split.cpp).

This machine may have one NUMA node: a split into n then cuts its CPUs into n groups (a forced split), which
runs the same code as a real one. What is checked:
  - slicing: the slices put back together dequantize to exactly the unsplit weights; each slice tensor is
    contiguous and its memory is its own;
  - against the unsplit op, every format: the split gives its result up to fp32 summation order (the down
    projection's sum over I is regrouped by slice), i.e. within a few fp32 roundings of the terms' magnitudes
    (reference.fused_moe_reference(magnitudes=True)), plus one rounding to a bf16/fp16 output. int8/int4 need
    the slices to quantize h = act(gate) * up with the scale of the whole row, as the unsplit op does, not
    each with its own slice's max: without that the difference would be ~1e-2, here it is ~1e-7;
  - bf16: the split output equals the per-slice ops summed in slice order in fp32, bit for bit (the
    concurrent run and the reduction); int8/int4 slices run alone would use their own h scales instead;
  - a slice that fails while the others wait for its h scales releases them (no hang), its error raised;
  - KT_NUMA_SPLIT in a fresh process, the errors, opcheck of both new ops.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from torch.library import opcheck

import ktorch
from ktorch.ops import NumaSplitExperts, numa_split_count
from conftest import DRIVER_ONLY_SKIPS
from reference import fused_moe_reference

SKIP_KERNEL_LEVELS = DRIVER_ONLY_SKIPS  # tests/conftest.py: avx2 runs this file's code as portable does

FORMATS = [("bf16", None), ("int8", None), ("int4", 32), ("int4", 64)]
FORMAT_IDS = ["bf16", "int8", "int4g32", "int4g64"]


def make_experts(E: int, H: int, I: int, fmt: str, group_size: int | None = None) -> ktorch.PackedExperts:
    gate_up = torch.randn(E, 2 * I, H) / math.sqrt(H)
    down = torch.randn(E, H, I) / math.sqrt(I)
    return ktorch.pack_experts(gate_up, down, fmt, group_size)


def make_routing(T: int, E: int, K: int, skip: float = 0.2, skewed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] distinct per row, about `skip` of the slots negative (skipped); weights [T, K] fp32.

    skewed: expert e drawn with probability ~ 1/(e+1)^2 (a few hot experts take most tokens), else uniformly.
    """
    if skewed:
        ids = torch.multinomial((torch.arange(E) + 1.0).pow(-2).expand(T, E), K, replacement=False)
    else:
        ids = torch.rand(T, E).argsort(dim=1)[:, :K]
    ids[torch.rand(T, K) < skip] = -1
    weights = torch.rand(T, K) + 0.1
    return ids, weights / weights.sum(dim=1, keepdim=True)


def unsplit(hidden, ids, weights, packed: ktorch.PackedExperts) -> torch.Tensor:
    """The unsplit op itself (ktorch.fused_moe would split a PackedExperts when KT_NUMA_SPLIT is set)."""
    return torch.ops.kt.fused_moe(hidden, ids, weights, *packed.tensors(), "silu")


def sum_of_slices(hidden, ids, weights, split: NumaSplitExperts) -> torch.Tensor:
    """What the split must compute: each slice through the unsplit op (fp32 out), added in slice order."""
    out = None
    for s in split.slices:
        part = torch.ops.kt.fused_moe(hidden.float(), ids, weights, *s.tensors(), "silu")
        out = part if out is None else out + part
    return out


def test_split_count_parsing(monkeypatch):
    monkeypatch.delenv("KT_NUMA_SPLIT", raising=False)
    assert numa_split_count() == 1
    monkeypatch.setenv("KT_NUMA_SPLIT", "3")
    assert numa_split_count() == 3
    monkeypatch.setenv("KT_NUMA_SPLIT", "auto")
    assert numa_split_count() == torch.ops.kt.numa_node_count() >= 1
    assert numa_split_count(2) == 2 and numa_split_count("2") == 2
    for bad in ("0", "two", -1, 0):
        with pytest.raises(ValueError, match="positive integer"):
            numa_split_count(bad)


# ---------------------------------------------------------------- slicing


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("n", [2, 3])
def test_slices_reassemble_exactly(fmt, group_size, n):
    E, H, I = 5, 64, 192  # 192 = 6 x 32 = 3 x 64: n=2 and 3 for every group size here
    packed = make_experts(E, H, I, fmt, group_size)
    split = packed.split_numa(n)
    assert split.num_slices == n and split.intermediate_size == I and split.format == fmt
    sizes = [s.intermediate_size for s in split.slices]
    assert sum(sizes) == I and max(sizes) - min(sizes) <= (math.lcm(32, group_size) if group_size else 32)
    gate_up, down = packed.dequantize()
    gate_up_s, down_s = split.dequantize()
    assert torch.equal(gate_up, gate_up_s) and torch.equal(down, down_s)


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
def test_slice_tensors_contiguous_and_distinct(fmt, group_size):
    packed = make_experts(4, 64, 192, fmt, group_size)
    split = packed.split_numa(3)
    spans = [(t.data_ptr(), t.data_ptr() + t.nbytes) for t in packed.tensors() if t is not None]
    for s in split.slices:
        for t in s.tensors():
            if t is None:
                assert fmt == "bf16"
                continue
            assert t.is_contiguous() and t.device.type == "cpu"
            spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
    spans.sort()
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0, "two tensors share memory"
    assert split.nbytes >= packed.nbytes  # int8 down scales are copied to every slice


def test_unsplittable_intermediate_size_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"cannot split the intermediate size I=32 into 2 slices"):
        make_experts(3, 64, 32, "int8").split_numa(2)
    with pytest.raises(RuntimeError, match=r"I=96 into 4 slices: every slice needs a multiple of 32"):
        make_experts(3, 64, 96, "bf16").split_numa(4)
    # int4 with group 64: slices must hold whole groups of the down projection's scales
    with pytest.raises(RuntimeError, match=r"I=128 into 3 slices: every slice needs a multiple of 64"):
        make_experts(3, 64, 128, "int4", 64).split_numa(3)
    with pytest.raises(ValueError, match="positive integer"):
        make_experts(3, 64, 64, "bf16").split_numa(0)


def test_pack_experts_numa_split_argument():
    gate_up, down = torch.randn(4, 128, 64), torch.randn(4, 64, 64)
    assert isinstance(ktorch.pack_experts(gate_up, down, "int8"), ktorch.PackedExperts)
    split = ktorch.pack_experts(gate_up, down, "int8", numa_split=2)
    assert isinstance(split, NumaSplitExperts) and split.num_slices == 2
    assert torch.equal(split.dequantize()[1], ktorch.pack_experts(gate_up, down, "int8").dequantize()[1])


# ---------------------------------------------------------------- results


# Differences the split may show against the unsplit op, in units of the fp32 rounding (2^-24) of the sum of
# the terms' magnitudes: measured up to ~3 over these shapes (bf16 and int formats alike); without the shared
# h scale int8/int4 differ by ~1e5 of these units.
REGROUPING_ROUNDINGS = 32


def assert_split_matches_unsplit(parts, whole, hidden, ids, weights, packed, what):
    """|parts - whole| <= REGROUPING_ROUNDINGS * 2^-24 * sum of |terms|, plus one rounding to a bf16/fp16 output."""
    assert parts.dtype == whole.dtype and parts.shape == whole.shape, what
    gate_up, down = packed.dequantize()
    size = fused_moe_reference(hidden, ids, weights, gate_up, down, magnitudes=True)
    bound = REGROUPING_ROUNDINGS * 2.0**-24 * size
    if parts.dtype != torch.float32:
        ulp = 2.0**-7 if parts.dtype == torch.bfloat16 else 2.0**-10
        bound = bound + ulp * torch.maximum(whole.double().abs(), parts.double().abs())
    diff = (parts.double() - whole.double()).abs()
    worst = (diff / bound.clamp_min(1e-300)).max().item() if diff.numel() else 0.0
    assert (diff <= bound).all(), f"{what}: split differs from unsplit by up to {worst:.3g}x the bound"


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("T", [1, 3, 17, 130, 520])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_split_matches_unsplit(kernel, fmt, group_size, n, T, routing, seed):
    E, K, H, I = 16, 4, 128, 384
    packed = make_experts(E, H, I, fmt, group_size)
    split = packed.split_numa(n)
    hidden = torch.randn(T, H)
    ids, weights = make_routing(T, E, K, skewed=routing == "skewed")
    whole = unsplit(hidden, ids, weights, packed)
    parts = ktorch.fused_moe(hidden, ids, weights, split)
    what = f"seed={seed} {kernel} {fmt} n={n} T={T} {routing}"
    assert_split_matches_unsplit(parts, whole, hidden, ids, weights, packed, what)
    assert (parts[(ids < 0).all(dim=1)] == 0).all(), what
    assert torch.equal(ktorch.fused_moe(hidden, ids, weights, split), parts), f"{what}: not deterministic"


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_split_matches_unsplit_low_precision_hidden(kernel, fmt, group_size, dtype, seed):
    E, K, H, I, T = 16, 4, 128, 384, 41
    packed = make_experts(E, H, I, fmt, group_size)
    hidden = torch.randn(T, H).to(dtype)
    ids, weights = make_routing(T, E, K)
    whole = unsplit(hidden, ids, weights, packed)
    for n in (2, 3):
        parts = ktorch.fused_moe(hidden, ids, weights, packed.split_numa(n))
        assert_split_matches_unsplit(parts, whole, hidden, ids, weights, packed, f"seed={seed} {kernel} {fmt} n={n} {dtype}")


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
def test_one_slice_is_the_unsplit_op(fmt, group_size, seed):
    packed = make_experts(8, 128, 192, fmt, group_size)
    hidden = torch.randn(33, 128)
    ids, weights = make_routing(33, 8, 3)
    out = ktorch.fused_moe(hidden, ids, weights, packed.split_numa(1))
    assert torch.equal(out, unsplit(hidden, ids, weights, packed)), f"seed={seed} {fmt}"


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("T", [1, 7, 33, 130])
def test_bf16_split_equals_sum_of_slices_bit_for_bit(kernel, n, T, seed):
    E, K, H, I = 8, 3, 128, 192
    split = make_experts(E, H, I, "bf16").split_numa(n)
    hidden = torch.randn(T, H)
    ids, weights = make_routing(T, E, K)
    out = ktorch.fused_moe(hidden, ids, weights, split)
    assert out.dtype == torch.float32 and out.shape == (T, H)
    assert torch.equal(out, sum_of_slices(hidden, ids, weights, split)), f"seed={seed} {kernel} n={n} T={T}"
    out_bf16 = ktorch.fused_moe(hidden.bfloat16(), ids, weights, split)
    assert out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16, sum_of_slices(hidden.bfloat16(), ids, weights, split).bfloat16())


@pytest.mark.parametrize("fmt,group_size", [("int8", None), ("int4", 32)], ids=["int8", "int4"])
def test_int_split_slices_share_the_h_scale(fmt, group_size, seed):
    """Each slice alone scales h by its own channels' max; inside the split they use the whole row's."""
    E, K, H, I, T = 8, 3, 128, 192, 33
    packed = make_experts(E, H, I, fmt, group_size)
    split = packed.split_numa(2)
    hidden = torch.randn(T, H)
    ids, weights = make_routing(T, E, K, skip=0.0)
    whole = unsplit(hidden, ids, weights, packed)
    alone = sum_of_slices(hidden, ids, weights, split)
    parts = ktorch.fused_moe(hidden, ids, weights, split)
    assert (parts - whole).abs().max() < 1e-3 * (alone - whole).abs().max(), f"seed={seed} {fmt}"


@pytest.mark.parametrize("fmt,group_size", [("bf16", None), ("int8", None), ("int4", 32)], ids=["bf16", "int8", "int4"])
def test_empty_batch_no_slots_and_all_skipped(fmt, group_size):
    split = make_experts(4, 64, 64, fmt, group_size).split_numa(2)
    out = ktorch.fused_moe(torch.empty(0, 64, dtype=torch.bfloat16), torch.empty(0, 2, dtype=torch.long),
                           torch.empty(0, 2), split)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    out = ktorch.fused_moe(torch.randn(3, 64), torch.empty(3, 0, dtype=torch.long), torch.empty(3, 0), split)
    assert out.shape == (3, 64) and (out == 0).all()
    out = ktorch.fused_moe(torch.randn(3, 64), torch.full((3, 2), -1), torch.rand(3, 2), split)
    assert (out == 0).all()


def test_bad_ids_raise_through_the_split():
    split = make_experts(4, 64, 64, "int8").split_numa(2)
    with pytest.raises(RuntimeError, match=r"topk_ids\[1, 0\] = 4 is out of range for 4 experts"):
        ktorch.fused_moe(torch.randn(2, 64), torch.tensor([[0, 1], [4, 1]]), torch.rand(2, 2), split)
    # the groups still work after an error
    assert ktorch.fused_moe(torch.randn(2, 64), torch.tensor([[0, 1], [3, 1]]), torch.rand(2, 2), split).shape == (2, 64)


def test_slices_of_different_formats_are_an_error():
    int8 = make_experts(4, 64, 64, "int8").split_numa(2)
    int4 = make_experts(4, 64, 64, "int4", 32).split_numa(2)
    w13, s13, w2, s2 = (list(a) for a in int8.op_args())
    w13[1], s13[1], w2[1], s2[1] = int4.slices[1].tensors()
    with pytest.raises(RuntimeError, match="every slice must be packed in the same format"):
        torch.ops.kt.fused_moe_numa(torch.randn(2, 64), torch.tensor([[0, 1], [2, 3]]), torch.rand(2, 2), w13, s13, w2,
                                    s2, "silu")


_FAILING_SLICE_SCRIPT = """
import torch, ktorch
torch.manual_seed(0)
def split(E):
    gate_up, down = torch.randn(E, 128, 64), torch.randn(E, 64, 64)
    return ktorch.pack_experts(gate_up, down, "int8").split_numa(2)
four, five = split(4).op_args(), split(5).op_args()
hidden, weights = torch.randn(3, 64), torch.rand(3, 2)
for first, second in ((four, five), (five, four)):
    # the slice with 4 experts rejects id 4; the one with 5 reaches the exchange of h scales and waits for it
    args = [[a[0], b[1]] for a, b in zip(first, second)]
    try:
        torch.ops.kt.fused_moe_numa(hidden, torch.tensor([[0, 1], [4, 1], [2, 3]]), weights, *args, "silu")
    except RuntimeError as e:
        assert "= 4 is out of range for 4 experts" in str(e), e
    else:
        raise AssertionError("no error")
out = ktorch.fused_moe(hidden, torch.tensor([[0, 1], [3, 1], [2, 3]]), weights, ktorch.pack_experts(
    torch.randn(4, 128, 64), torch.randn(4, 64, 64), "int8", numa_split=2))
assert out.shape == (3, 64)
print("ok")
"""


def test_a_failing_slice_releases_the_others():
    """One slice throws before the h-scale exchange while the other waits there: the error comes out, no hang."""
    result = subprocess.run([sys.executable, "-c", _FAILING_SLICE_SCRIPT], env=dict(os.environ, KT_SPIN_US="0"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


# ---------------------------------------------------------------- KT_NUMA_SPLIT


_ENV_SCRIPT = """
import sys, torch, ktorch
from ktorch.ops import NumaSplitExperts

hidden, ids, weights, packed = torch.load(sys.argv[1], weights_only=False)
out = ktorch.fused_moe(hidden, ids, weights, packed)
cache = packed._numa_split_cache
slices = cache.num_slices if isinstance(cache, NumaSplitExperts) else 1
torch.save((out, slices), sys.argv[2])
"""


@pytest.mark.parametrize("fmt,group_size", [("bf16", None), ("int8", None), ("int4", 32)], ids=["bf16", "int8", "int4"])
def test_kt_numa_split_env_in_a_fresh_process(fmt, group_size, seed, tmp_path, monkeypatch):
    """KT_NUMA_SPLIT=n makes ktorch.fused_moe split a plain PackedExperts (once) and run the split."""
    monkeypatch.delenv("KT_NUMA_SPLIT", raising=False)  # the in-process reference runs unsplit unless told
    E, K, H, I, T = 8, 3, 96, 96, 19
    packed = make_experts(E, H, I, fmt, group_size)
    hidden = torch.randn(T, H).to(torch.bfloat16)
    ids, weights = make_routing(T, E, K)
    inputs = tmp_path / "inputs.pt"
    torch.save((hidden, ids, weights, packed), inputs)
    for n in ("1", "2", "3"):
        env = dict(os.environ, KT_NUMA_SPLIT=n, KT_SPIN_US="0")
        path = tmp_path / f"out{n}.pt"
        subprocess.run([sys.executable, "-c", _ENV_SCRIPT, str(inputs), str(path)], env=env, check=True, timeout=120)
        out, slices = torch.load(path)
        assert slices == int(n)
        want = ktorch.fused_moe(hidden, ids, weights, packed.split_numa(int(n)) if n != "1" else packed)
        assert torch.equal(out, want), f"seed={seed} KT_NUMA_SPLIT={n} {fmt}"


def test_kt_numa_split_env_leaves_unsplittable_layers_whole(monkeypatch):
    monkeypatch.setenv("KT_NUMA_SPLIT", "2")
    packed = make_experts(4, 64, 32, "bf16")
    hidden, (ids, weights) = torch.randn(3, 64), make_routing(3, 4, 2)
    with pytest.warns(UserWarning, match="runs these experts unsplit"):
        out = ktorch.fused_moe(hidden, ids, weights, packed)
    assert torch.equal(out, torch.ops.kt.fused_moe(hidden, ids, weights, *packed.tensors(), "silu"))


# ---------------------------------------------------------------- opcheck


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
def test_opcheck_numa_split_ops(fmt, group_size):
    E, K, H, I = 6, 2, 64, 192
    packed = make_experts(E, H, I, fmt, group_size)
    opcheck(torch.ops.kt.numa_split_experts.default, (*packed.tensors(), 3))
    split = packed.split_numa(3)
    ids, weights = make_routing(7, E, K)
    cases = [
        (torch.randn(7, H, dtype=torch.bfloat16), ids, weights, "silu"),
        (torch.randn(7, H), ids.to(torch.int32), weights.to(torch.bfloat16), "gelu_tanh"),
        (torch.randn(H, 7).t(), ids, weights, "relu"),
        (torch.empty(0, H, dtype=torch.bfloat16), ids[:0], weights[:0], "silu"),
    ]
    for hidden, i, w, act in cases:
        opcheck(torch.ops.kt.fused_moe_numa.default, (hidden, i, w, *split.op_args(), act))
