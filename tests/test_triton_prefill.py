"""Prefill on int8 resident experts: the Triton grouped GEMM (ktorch/ops/triton_prefill.py) and its routing from
rows_experts_forward (ktorch/ops/resident_rows.py).

The kernels run on CUDA, or on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1 with Triton installed:
there the products are taken in float32, the interpreter's bf16 ones being wrong); skipped otherwise. The alignment
(plain torch) and the refusals run everywhere. Under the interpreter the weights and h are not rounded to bf16 (its
casts to bf16 truncate): the CUDA runs test that rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ktorch
from ktorch.ops import resident_rows, triton_experts, triton_prefill
from ktorch.ops.gpu_experts import GATHER_MAX_TOKENS, gpu_experts_forward, packed_experts_forward
from ktorch.ops.resident_rows import RowExperts, dequantize_rows, rows_experts_forward, rows_from_packed
from ktorch.ops.triton_prefill import PackedBlocks, align_by_expert, grouped_applies, tile_for, triton_grouped_forward
from models import assert_logits_match, moe_experts_modules, tiny_model
from reference import relative_error
from test_resident_rows import KERNEL_DEVICE, _experts, _reference

KERNELS_RUN = triton_experts.triton_available() and (torch.cuda.is_available() or triton_experts.interpreting())
needs_kernels = pytest.mark.skipif(
    not KERNELS_RUN,
    reason="the Triton kernels need Triton and a CUDA GPU, or Triton's interpreter (TRITON_INTERPRET=1)")
needs_cuda_triton = pytest.mark.skipif(not torch.cuda.is_available() or not triton_experts.triton_available(),
                                       reason="needs a CUDA GPU and Triton")


def _routing(T, K, n, device, seed=0):
    """slots [T, K] over a few of the n experts (0, 1 and n - 1 never used), about a fifth -1, weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    used = torch.tensor([2, 3, 5, 7, n - 2])
    slots = used[torch.randint(0, len(used), (T, K), generator=g)]
    slots[torch.rand(T, K, generator=g) < 0.2] = -1
    slots[0, 0], slots[-1, -1] = 4, -1  # expert 4: a single row
    return slots.to(device), torch.rand(T, K, generator=g).to(device)


def aten_alignment(slots: torch.Tensor, n: int, block_m: int) -> tuple:
    """The reference for ``triton_prefill.align_by_expert``: the same two tensors in plain torch (the form the
    kernels replaced, ~30 launches), any device."""
    T, K = slots.shape
    R = T * K
    dev = slots.device
    key = torch.where(slots >= 0, slots, n).reshape(-1).long()
    counts = torch.zeros(n + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    padded = (counts[:n] + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    start = counts.cumsum(0) - counts
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    capacity = -(-(R + min(n, R) * (block_m - 1)) // block_m) * block_m
    pos = torch.arange(R, device=dev) - start[sorted_key] + padded_start[sorted_key.clamp(max=n - 1)]
    pos = torch.where(sorted_key < n, pos, capacity)  # absent slots: a dropped last entry
    sorted_ids = torch.full((capacity + 1,), R, dtype=torch.int32, device=dev)
    sorted_ids[pos] = order.to(torch.int32)
    blocks = torch.arange(0, capacity, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, blocks, right=True).to(torch.int32)
    return sorted_ids[:capacity], block_expert


def test_align_by_expert_sorts_rows_into_padded_blocks():
    """Each used expert's rows, in row order, start a block and fill its blocks, padded with T*K; the blocks say
    their expert; absent slots appear nowhere; blocks past the last expert's say n; fixed shapes."""
    n, T, K, bm = 10, 7, 3, 4
    slots, _ = _routing(T, K, n, "cpu")
    sorted_ids, block_expert = aten_alignment(slots.to(torch.int32), n, bm)
    R = T * K
    capacity = -(-(R + min(n, R) * (bm - 1)) // bm) * bm
    assert sorted_ids.shape == (capacity,) and block_expert.shape == (capacity // bm,)
    flat = slots.reshape(-1)
    blocks = sorted_ids.view(-1, bm)
    b = 0
    for e in range(n):
        rows = [r for r in range(R) if flat[r] == e]
        nb = -(-len(rows) // bm)
        got = blocks[b:b + nb].reshape(-1).tolist()
        assert got == rows + [R] * (nb * bm - len(rows))
        assert block_expert[b:b + nb].tolist() == [e] * nb
        b += nb
    assert (blocks[b:] == R).all() and (block_expert[b:] == n).all()


@needs_kernels
@pytest.mark.parametrize("n, T, K, bm, skew", [(10, 7, 3, 4, 0.0), (128, 64, 8, 32, 0.0), (128, 300, 8, 64, 1.5),
                                               (128, 1, 8, 16, 0.0), (16, 130, 4, 32, 3.0), (256, 65, 8, 64, 0.0)])
def test_align_kernel_gives_the_aten_alignment_bit_for_bit(n, T, K, bm, skew):
    """The three-launch alignment returns the reference's sorted rows and block experts (checked above against
    their definition) for near-uniform and skewed routing, absent slots included, any row count (partial row
    blocks)."""
    g = torch.Generator().manual_seed(n * 1000 + T)
    p = torch.arange(1, n + 1, dtype=torch.float64) ** -skew
    slots = torch.multinomial(p.expand(T, n), K, generator=g)  # K distinct experts a token
    slots[torch.rand(T, K, generator=g) < 0.1] = -1  # slots routed elsewhere (not resident)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    slots = slots.to(torch.int32).to(dev)
    want = aten_alignment(slots, n, bm)
    got = align_by_expert(slots, n, bm)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())


def test_align_kernel_refuses_bad_slots():
    with pytest.raises(ValueError, match="int32"):
        align_by_expert(torch.zeros(2, 3, dtype=torch.int64), 4, 16)


GROUPED_CASES = [  # format, group, activation, T, K, H, I, tile (None: tile_for); small: the interpreter is slow
    ("int8", 32, "silu", 17, 2, 128, 64, None),  # Q8_0's groups, BLOCK_K 64: scales in registers (MODE 1)
    ("int8", 32, "gelu", 64, 8, 128, 64, (32, 32, 32, 4, 2)),  # BLOCK_K 32: a scale per tile (MODE 0)
    ("int8", None, "silu", 300, 8, 64, 32, None),  # per channel: the scale at the end; 64-row blocks
    ("int8", None, "relu", 17, 2, 160, 96, (16, 32, 64, 4, 1)),  # per channel, odd sizes (partial tiles)
    ("int8", 16, "gelu_tanh", 64, 2, 160, 96, (16, 32, 64, 4, 1)),  # Q6_K's 16, odd sizes
    ("q5_k", 32, "relu", 17, 8, 128, 64, (16, 64, 32, 4, 1)),  # affine, a scale and minimum per tile
    ("q5_k", 32, "silu", 64, 2, 192, 96, (16, 32, 64, 4, 1)),  # affine, in registers
]


def _grouped_case(fmt, group_size, T, K, H, I, n=12):
    """(packed experts on the kernels' device, their row layout, bf16 hidden [T, H], slots and weights [T, K]) of
    one GROUPED_CASES entry: n experts, _routing's slots (absent ones, unused experts, one used once)."""
    packed, _ = _experts(fmt, group_size, n=n, H=H, I=I)
    packed = tuple(t.to(KERNEL_DEVICE) for t in packed)
    torch.manual_seed(1)
    hidden = torch.randn(T, H, device=KERNEL_DEVICE).to(torch.bfloat16)
    slots, weights = _routing(T, K, n, KERNEL_DEVICE)
    return packed, rows_from_packed(*packed), hidden, slots, weights


@needs_kernels
@pytest.mark.parametrize("fmt,group_size,activation,T,K,H,I,tile", GROUPED_CASES,
                         ids=[f"{c[0]}_{c[1]}_{c[2]}_T{c[3]}_K{c[4]}_H{c[5]}_I{c[6]}_{c[7] and c[7][:3]}"
                              for c in GROUPED_CASES])
def test_grouped_kernels_match_a_float64_reference(fmt, group_size, activation, T, K, H, I, tile):
    """The grouped GEMM within bf16 rounding of the float64 reference of the same codes, no worse than the packed
    path (plus a little: on CUDA both round h, the down GEMM's input, to bf16; the interpreter keeps it in float32),
    with absent slots, experts never used and one used once; the same bits twice."""
    packed, rows, hidden, slots, weights = _grouped_case(fmt, group_size, T, K, H, I)
    got = triton_grouped_forward(hidden, slots, weights, rows, activation, tile)
    ref = _reference(hidden, slots, weights, rows, activation)
    packed_error = relative_error(packed_experts_forward(hidden, slots, weights, packed, activation).cpu(), ref)
    assert got.dtype == torch.bfloat16 and got.shape == (T, H)
    assert relative_error(got.cpu(), ref) <= max(1.2 * packed_error, 4e-3)
    assert torch.equal(triton_grouped_forward(hidden, slots, weights, rows, activation, tile), got)


@needs_kernels
@pytest.mark.parametrize("fmt,group_size,activation,T,K,H,I,tile", GROUPED_CASES,
                         ids=[f"{c[0]}_{c[1]}_{c[2]}_T{c[3]}_K{c[4]}_H{c[5]}_I{c[6]}_{c[7] and c[7][:3]}"
                              for c in GROUPED_CASES])
def test_packed_blocks_give_the_rows_result_bit_for_bit(fmt, group_size, activation, T, K, H, I, tile):
    """The kernels reading kt.pack_int8's blocks as they are (the split's copied experts: PackedBlocks) compute
    what they compute on the same experts in the row layout, bit for bit: the same codes, scales and tiles, only
    their addresses differ (the gate/up interleave undone in the kernel). Float16 scales (Q8_0's at the file's
    size) are read as they are: the same bits as their float32 form."""
    packed, rows, hidden, slots, weights = _grouped_case(fmt, group_size, T, K, H, I)
    want = triton_grouped_forward(hidden, slots, weights, rows, activation, tile)
    blocks = PackedBlocks(*packed)
    assert grouped_applies(hidden, blocks, tile)
    assert torch.equal(triton_grouped_forward(hidden, slots, weights, blocks, activation, tile), want)
    if packed[1].dim() == 3 and packed[1].dtype == torch.float32:  # scales as float16 where they are exactly that
        half = blocks._replace(w13_scales=packed[1].half(), w2_scales=packed[3].half())
        exact = RowExperts(rows.w13, rows.w13_scales.half().float(), rows.w2, rows.w2_scales.half().float())
        assert torch.equal(triton_grouped_forward(hidden, slots, weights, half, activation, tile),
                           triton_grouped_forward(hidden, slots, weights, exact, activation, tile))


@needs_kernels
def test_grouped_kernels_take_fp16_and_int32_slots():
    n, T, K, H, I = 8, 20, 4, 128, 64
    packed, _ = _experts("int8", 32, n=n, H=H, I=I)
    rows = rows_from_packed(*(t.to(KERNEL_DEVICE) for t in packed))
    torch.manual_seed(2)
    hidden = torch.randn(T, H, device=KERNEL_DEVICE).to(torch.float16)
    slots, weights = _routing(T, K, n, KERNEL_DEVICE)
    got = triton_grouped_forward(hidden, slots.to(torch.int32), weights.to(torch.bfloat16), rows, "silu")
    assert got.dtype == torch.float16
    assert relative_error(got.cpu(), _reference(hidden, slots, weights.to(torch.bfloat16).float(), rows)) < 4e-3


@needs_kernels
@pytest.mark.parametrize("fmt,group_size", [("int8", 32), ("q5_k", 32), ("int4", 32), ("q4_k_m", 32)])
def test_prefill_routes_int8_rows_to_the_grouped_kernels(monkeypatch, fmt, group_size):
    """rows_experts_forward takes the grouped GEMM for more than GATHER_MAX_TOKENS tokens on int8 rows (symmetric
    or affine) with kernel="auto", and the dequantizing path for 4-bit rows, a named kernel or a decode call."""
    n, T, K = 8, GATHER_MAX_TOKENS + 1, 4
    packed, _ = _experts(fmt, group_size, n=n)
    rows = rows_from_packed(*(t.to(KERNEL_DEVICE) for t in packed))
    torch.manual_seed(3)
    hidden = torch.randn(T, 128, device=KERNEL_DEVICE).to(torch.bfloat16)
    slots, weights = _routing(T, K, n, KERNEL_DEVICE)
    monkeypatch.setattr(resident_rows, "_grouped_kernels_apply",
                        lambda hidden, rows: hidden.shape[0] > GATHER_MAX_TOKENS and grouped_applies(hidden, rows))
    calls = []
    forward = triton_prefill.triton_grouped_forward
    monkeypatch.setattr(triton_prefill, "triton_grouped_forward", lambda *a: calls.append(1) or forward(*a))
    got = rows_experts_forward(hidden, slots, weights, rows)
    assert len(calls) == (fmt in ("int8", "q5_k"))
    assert relative_error(got.cpu(), _reference(hidden, slots, weights, rows)) < 1e-2
    rows_experts_forward(hidden, slots, weights, rows, "silu", "grouped_mm")
    rows_experts_forward(hidden[:GATHER_MAX_TOKENS], slots[:GATHER_MAX_TOKENS], weights[:GATHER_MAX_TOKENS], rows,
                         "silu", "gather")
    assert len(calls) == (fmt in ("int8", "q5_k"))


def test_grouped_refuses_what_it_cannot_take():
    packed, _ = _experts("int8", 32, n=4)
    rows = rows_from_packed(*packed)
    hidden = torch.randn(20, 128).to(torch.bfloat16)
    slots, weights = torch.zeros(20, 2, dtype=torch.long), torch.rand(20, 2)
    assert not grouped_applies(hidden.float(), rows)
    four, _ = _experts("int4", 32, n=4)
    assert not grouped_applies(hidden, rows_from_packed(*four))
    if not KERNELS_RUN:
        with pytest.raises((ValueError, RuntimeError)):
            triton_grouped_forward(hidden, slots, weights, rows)
        return
    hidden = hidden.to(KERNEL_DEVICE)
    rows = RowExperts(*(t.to(KERNEL_DEVICE) for t in rows))
    slots, weights = slots.to(KERNEL_DEVICE), weights.to(KERNEL_DEVICE)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        triton_grouped_forward(hidden.float(), slots, weights, rows)
    with pytest.raises(ValueError, match="int8 codes"):
        triton_grouped_forward(hidden, slots, weights, rows_from_packed(*(t.to(KERNEL_DEVICE) for t in four)))
    with pytest.raises(ValueError, match="int8 codes"):
        triton_grouped_forward(hidden, slots, weights, PackedBlocks(*(t.to(KERNEL_DEVICE) for t in four)))
    assert not grouped_applies(hidden, PackedBlocks(*(t.to(KERNEL_DEVICE) for t in four)))
    with pytest.raises(ValueError, match="packed blocks"):
        blocks = PackedBlocks(*(t.to(KERNEL_DEVICE) for t in packed))
        triton_grouped_forward(hidden, slots, weights, blocks._replace(w2=blocks.w2[:, :4]))
    with pytest.raises(ValueError, match="activation"):
        triton_grouped_forward(hidden, slots, weights, rows, "tanh")
    with pytest.raises(ValueError, match="block_k"):  # groups of 32 with a 48-column tile: neither divides
        triton_grouped_forward(hidden, slots, weights, rows, "silu", (16, 32, 48, 4, 1))
    with pytest.raises(ValueError, match="hidden"):
        triton_grouped_forward(hidden[:, :64], slots, weights, rows)


def test_tile_for_grows_with_the_rows_an_expert_gets():
    assert [tile_for(r)[0] for r in (1, 16, 17, 32, 33, 1e6)] == [16, 16, 32, 32, 64, 64]


@needs_cuda_triton
@pytest.mark.parametrize("group_size", [32, None])
def test_cuda_grouped_kernels_at_the_qwen3_shape(group_size):
    """Qwen3-30B-A3B's expert shape (H 2048, I 768), 16 residents, T = 512 (top-8): within bf16 rounding (no worse
    than the packed path, plus a little), the same bits twice, and rows_experts_forward routes there; a CUDA graph
    replays it (no host sync)."""
    torch.manual_seed(0)
    n, T, K, H, I = 16, 512, 8, 2048, 768
    packed, _ = _experts("int8", group_size, n=n, H=H, I=I)
    rows = rows_from_packed(*(t.cuda() for t in packed))
    hidden = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    slots = torch.stack([torch.randperm(n)[:K] for _ in range(T)]).cuda()
    slots[::7, 0] = -1
    weights = torch.rand(T, K, device="cuda")
    got = rows_experts_forward(hidden, slots, weights, rows)
    assert torch.equal(got, triton_grouped_forward(hidden, slots, weights, rows))
    ref = _reference(hidden, slots, weights, rows)
    packed_error = relative_error(packed_experts_forward(hidden, slots, weights, tuple(t.cuda() for t in packed),
                                                         "silu").cpu(), ref)
    assert relative_error(got.cpu(), ref) <= max(1.2 * packed_error, 4e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_grouped_forward(hidden, slots, weights, rows)
    slots.copy_(torch.stack([torch.randperm(n)[:K] for _ in range(T)]))
    graph.replay()
    assert torch.equal(out, triton_grouped_forward(hidden, slots, weights, rows))


def _compiled_kernels() -> int:
    """Kernels Triton has compiled for the grouped prefill (every device's cache)."""
    kernels = (triton_prefill._gate_up_grouped, triton_prefill._down_grouped, triton_prefill._sum_slots,
               triton_prefill._align_count, triton_prefill._align_scan, triton_prefill._align_scatter)
    return sum(len(caches[0]) for k in kernels for caches in k.device_caches.values())


@needs_cuda_triton
@pytest.mark.parametrize("group_size", [32, None])
def test_cuda_warm_tiles_leave_nothing_to_compile_for_any_prompt_length(group_size):
    """After ``warm_tiles`` (the load-time warm-up's), prompts of any length, odd or even, taking any tile, compile
    nothing more (a user's first prompt of another size compiled two kernels, 0.86 s, before), and give what an
    unwarmed call gives."""
    torch.manual_seed(1)
    n, K, H, I = 16, 8, 256, 128
    packed, _ = _experts("int8", group_size, n=n, H=H, I=I)
    rows = rows_from_packed(*(t.cuda() for t in packed))
    assert triton_prefill.warm_tiles(rows, "silu", torch.bfloat16) == len(triton_prefill.TILES)
    compiled = _compiled_kernels()
    for T in (33, 31, 64, 63, 65, 200, 511, 1):  # rows an expert 16.5 .. 255.5: every tile, odd and even row counts
        hidden = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        slots = torch.stack([torch.randperm(n)[:K] for _ in range(T)]).cuda()
        weights = torch.rand(T, K, device="cuda")
        got = triton_grouped_forward(hidden, slots, weights, rows)
        ref = _reference(hidden, slots, weights, rows)
        assert relative_error(got.cpu(), ref) <= 4e-3, T
    assert _compiled_kernels() == compiled


@needs_cuda_triton
def test_cuda_the_warm_ups_threads_warm_every_tile_of_every_format():
    """``generation._warm_resident_tiles`` (the load-time warm-up's, before its prefill) runs the tile launches of
    each distinct format in threads: one per tile and format, and after them prompts of any length on either format
    compile nothing more and give what the unthreaded kernels give."""
    from torch import nn

    from ktorch import generation

    torch.manual_seed(3)
    n, K, H, I = 16, 8, 256, 128
    packed, _ = _experts("int8", 32, n=n, H=H, I=I)
    packed = tuple(t.cuda() for t in packed)
    model = nn.Module()
    model.emb = nn.Embedding(4, 8, dtype=torch.bfloat16)
    model.get_input_embeddings = lambda: model.emb
    for name, rows in (("rows", rows_from_packed(*packed)), ("blocks", PackedBlocks(*packed))):
        holder = nn.Module()
        holder.kt_gpu_packed, holder.kt_activation = rows, "silu"
        model.add_module(name, holder)
    assert generation._warm_resident_tiles(model) == 2 * len(triton_prefill.TILES)
    compiled = _compiled_kernels()
    for T in (33, 200, 511, 1):
        hidden = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        slots = torch.stack([torch.randperm(n)[:K] for _ in range(T)]).cuda()
        weights = torch.rand(T, K, device="cuda")
        got = triton_grouped_forward(hidden, slots, weights, model.rows.kt_gpu_packed)
        assert relative_error(got.cpu(), _reference(hidden, slots, weights, model.rows.kt_gpu_packed)) <= 4e-3, T
        assert torch.equal(triton_grouped_forward(hidden, slots, weights, model.blocks.kt_gpu_packed), got)
    assert _compiled_kernels() == compiled


@needs_cuda_triton
def test_cuda_warm_tiles_on_one_packed_expert_cover_any_count_of_copied_experts():
    """The split's copied experts (packed blocks, 1..E a layer and call): ``warm_tiles`` on one expert's blocks (the
    load-time warm-up's, generation._warm_resident_tiles) leaves nothing to compile for any expert count and prompt
    length (the alignment's expert axis is padded to ALIGN_MIN_PAD: a first prompt compiled it per power of two)."""
    torch.manual_seed(2)
    E, K, H, I = 100, 8, 256, 128
    packed, _ = _experts("int8", 32, n=E, H=H, I=I)
    packed = tuple(t.cuda() for t in packed)
    one = PackedBlocks(*(t[:1] for t in packed))
    assert triton_prefill.warm_tiles(one, "silu", torch.bfloat16) == len(triton_prefill.TILES)
    compiled = _compiled_kernels()
    calls = []
    for n, T in ((5, 33), (17, 200), (33, 64), (100, 511), (2, 1)):
        blocks = PackedBlocks(*(t[:n] for t in packed))
        hidden = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        slots = torch.randint(0, n, (T, K), device="cuda")
        weights = torch.rand(T, K, device="cuda")
        calls.append((blocks, hidden, slots, weights, triton_grouped_forward(hidden, slots, weights, blocks)))
    assert _compiled_kernels() == compiled
    for blocks, hidden, slots, weights, got in calls:  # (the row layout's kernels compile here: not warmed)
        assert torch.equal(got, triton_grouped_forward(hidden, slots, weights, rows_from_packed(*blocks)))


@needs_kernels
def test_warm_tiles_launch_each_tile_and_refuse_what_the_kernels_do_not_take():
    """``warm_tiles`` launches one call per tile on formats the grouped kernels take (Triton's interpreter on the
    CPU here, CUDA on a GPU) and none for float32 activations or 4-bit codes (they never reach these kernels)."""
    packed, _ = _experts("int8", 32, n=4, H=128, I=64)
    rows = rows_from_packed(*(t.to(KERNEL_DEVICE) for t in packed))
    assert triton_prefill.warm_tiles(rows, "silu", torch.bfloat16) == len(triton_prefill.TILES)
    assert triton_prefill.warm_tiles(rows, "silu", torch.float32) == 0
    packed4, _ = _experts("int4", 128, n=4, H=128, I=128)
    assert triton_prefill.warm_tiles(rows_from_packed(*(t.to(KERNEL_DEVICE) for t in packed4)), "silu",
                                     torch.bfloat16) == 0


@needs_cuda_triton
@pytest.mark.parametrize("fmt,group_size", [("int4", 128), ("q4_k_m", 32), ("int8", 32)])
def test_cuda_prefill_dequantizing_the_used_residents_is_bit_for_bit(fmt, group_size):
    """On CUDA, the path 4-bit rows take at prefill (and int8 rows with a kernel named): the used residents
    dequantized give the bits of all n dequantized, with torch's grouped_mm (sm90+) or the gather kernel."""
    torch.manual_seed(0)
    n, T, K, H, I = 32, 300, 8, 512, 256
    packed, _ = _experts(fmt, group_size, n=n, H=H, I=I)
    rows = rows_from_packed(*(t.cuda() for t in packed))
    hidden = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    slots, weights = _routing(T, K, n, "cuda")
    kernel = "auto" if fmt != "int8" else "gather"
    want = gpu_experts_forward(hidden, slots, weights, dequantize_rows(rows.w13, rows.w13_scales, torch.bfloat16),
                               dequantize_rows(rows.w2, rows.w2_scales, torch.bfloat16), "silu", kernel)
    assert torch.equal(rows_experts_forward(hidden, slots, weights, rows, "silu", kernel), want)


@needs_cuda_triton
def test_cuda_prefill_of_a_model_with_int8_residents_takes_the_grouped_kernels(monkeypatch):
    """A tiny model with every expert resident as int8 rows: a 40-token prompt's layers run the grouped GEMM and give
    HF eager's logits (within the int8 quantization's tolerance of assert_logits_match)."""
    calls = []
    forward = triton_prefill.triton_grouped_forward
    monkeypatch.setattr(triton_prefill, "triton_grouped_forward", lambda *a: calls.append(1) or forward(*a))
    torch.manual_seed(0)
    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 40))
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype="int8", stream_experts="off",
                           gpu_memory="4GiB")
    assert all(isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(model))
    assert_logits_match(base.to("cuda"), model, torch.bfloat16, ids.cuda())
    assert len(calls) >= len(moe_experts_modules(model))


@needs_kernels
def test_prefill_of_a_model_through_the_grouped_kernels(monkeypatch):
    """A tiny bf16 model with every expert resident as int8 rows (the row layout forced; on the CPU under Triton's
    interpreter, or on CUDA): a 24-token forward runs each layer's grouped GEMM, makes no CPU op call, and gives the
    packed layout's logits within bf16 rounding."""
    from ktorch.gpu_memory import place_resident_experts

    device = torch.device(KERNEL_DEVICE)
    torch.manual_seed(0)
    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)

    def prepared(rows: bool):
        monkeypatch.setattr(resident_rows, "row_layout_applies", lambda *args: rows)
        model = ktorch.prepare(copy.deepcopy(base), device=str(device), experts_dtype="int8")
        for m in moe_experts_modules(model):
            place_resident_experts(m, m.kt_w13.shape[0], device)
        return model

    model, packed_model = prepared(True), prepared(False)
    assert all(isinstance(m.kt_gpu_packed, RowExperts) for m in moe_experts_modules(model))
    monkeypatch.setattr(resident_rows, "_grouped_kernels_apply",
                        lambda hidden, rows: hidden.shape[0] > GATHER_MAX_TOKENS and grouped_applies(hidden, rows))
    calls, cpu_op = [], []
    forward = triton_prefill.triton_grouped_forward
    monkeypatch.setattr(triton_prefill, "triton_grouped_forward", lambda *a: calls.append(1) or forward(*a))
    from ktorch.integrations import transformers_experts

    run = transformers_experts._run_experts
    monkeypatch.setattr(transformers_experts, "_run_experts", lambda *a, **k: cpu_op.append(1) or run(*a, **k))
    ids = torch.randint(0, 256, (1, 24), device=device)
    with torch.no_grad():
        got = model(ids).logits.float()
        assert len(calls) == len(moe_experts_modules(model)) and not cpu_op
        want = packed_model(ids).logits.float()
    assert relative_error(got.cpu(), want.cpu()) < 2e-2
