"""Hot experts on the accelerator: ktorch.profile_experts, prepare(gpu_experts=..., expert_profile=...), and the
device experts kernels (ktorch/ops/gpu_experts.py).

On the CPU the "GPU" experts sit on the CPU device too: the same masking, kernels and sums run. Numerics are
compared with HF eager as every prepared model is (tests/models.py), and with the float64 reference.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ktorch
from ktorch.compile import REPORTS
from ktorch.ops.gpu_experts import gpu_experts_forward, grouped_mm_supported
from models import (
    FAMILIES,
    PROMPT,
    assert_greedy_matches,
    assert_logits_match,
    moe_experts_modules,
    teacher_forced_decode,
    tiny_model,
)
from reference import fused_moe_reference, relative_error

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kernel,dtype,T", [("gather", torch.float32, 5), ("gather", torch.bfloat16, 1),
                                            ("grouped_mm", torch.bfloat16, 7), ("grouped_mm", torch.bfloat16, 40)])
def test_device_experts_kernels_match_the_reference(kernel, dtype, T):
    """Random slots with absent (-1) ones among them, against fused_moe_reference on the same experts."""
    E, n, H, I, K = 8, 3, 64, 32, 4
    gate_up = torch.randn(E, 2 * I, H) / H**0.5
    down = torch.randn(E, H, I) / I**0.5
    on_device = torch.tensor([5, 1, 6])
    hidden = torch.randn(T, H).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
    weights = torch.rand(T, K)
    slot_of = torch.full((E,), -1, dtype=torch.long)
    slot_of[on_device] = torch.arange(n)
    slots = slot_of[ids]
    w13 = gate_up[on_device].transpose(1, 2).contiguous().to(dtype)
    w2 = down[on_device].transpose(1, 2).contiguous().to(dtype)
    got = gpu_experts_forward(hidden, slots, weights, w13, w2, "silu", kernel)
    want = fused_moe_reference(hidden, torch.where(slots >= 0, ids, -1), weights, gate_up.to(dtype), down.to(dtype))
    assert got.dtype == dtype and got.shape == (T, H)
    assert relative_error(got, want) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_grouped_mm_needs_bf16():
    assert not grouped_mm_supported(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="_grouped_mm"):
        gpu_experts_forward(torch.zeros(1, 64), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2),
                            torch.zeros(1, 64, 64), torch.zeros(1, 32, 64), "silu", "grouped_mm")


def test_profile_counts_every_routed_slot_and_picks_the_hottest():
    model = tiny_model("qwen3_moe")
    ids = torch.randint(0, 256, (2, 10))
    profile = ktorch.profile_experts(model, [ids, {"input_ids": ids[:1]}])
    names = [name for name, _ in ktorch.placement.experts_modules(model)]
    assert list(profile.counts) == names
    k = model.config.num_experts_per_tok
    assert all(int(c.sum()) == (20 + 10) * k for c in profile.counts.values())
    hot = profile.hottest(names[0], 3)
    counts = profile.counts[names[0]]
    assert counts[hot].tolist() == sorted(counts.tolist(), reverse=True)[:3]
    placement = {names[0]: hot.tolist(), names[1]: []}
    assert profile.fraction_on(placement) == pytest.approx(int(counts[hot].sum()) / int(sum(c.sum() for c in profile.counts.values())))
    assert ktorch.ExpertsProfile.from_dict(profile.to_dict()).counts[names[0]].equal(counts)


def test_gpu_experts_sizes_and_errors():
    base = tiny_model("qwen3_moe")  # 8 experts per layer, H=64, I=64, fp32: 3*64*64*4 bytes per expert
    profile = ktorch.profile_experts(base, torch.randint(0, 256, (1, 8)))
    for ask, n in ((3, 3), (0.25, 2), ("0.375MiB", 4)):  # 4 experts x 2 layers x 49152 B
        model = ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_experts=ask, expert_profile=profile)
        assert [len(v) for v in ktorch.gpu_placement(model).values()] == [n, n]
    with pytest.raises(ValueError, match="expert_profile"):
        ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_experts=2)
    with pytest.raises(ValueError, match="8"):
        ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_experts=9, expert_profile=profile)
    with pytest.raises(ValueError, match="memory"):
        ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_experts="lots", expert_profile=profile)
    with pytest.raises(ValueError, match="already packed"):
        ktorch.prepare(ktorch.prepare(copy.deepcopy(base), device="cpu"), device="cpu", gpu_experts=1,
                       expert_profile=profile)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_experts_match_hf_eager(family, dtype):
    """25% of each layer's experts (the hottest of a profile) on the "GPU" (here: the CPU device): logits of a
    prefill agree with HF eager as the all-CPU prepared model's do; compiled (no Inductor) equals eager exactly."""
    base = tiny_model(family, dtype=dtype)
    ids = torch.randint(0, 256, (1, 24))
    profile = ktorch.profile_experts(base, ids)
    model = ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_experts=0.25, expert_profile=profile)
    assert profile.fraction_on(ktorch.gpu_placement(model)) > 0.25  # the hottest quarter takes more than a quarter
    assert_logits_match(base, model, dtype, ids)
    torch._dynamo.reset()
    REPORTS.clear()
    compiled = torch.compile(model, backend="ktorch", options={"inductor": False}, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, model(ids).logits)
    (report,) = REPORTS
    assert report.async_calls == len(moe_experts_modules(model))
    assert all(n >= 10 for n in report.overlapped_nodes), "the device experts run between submit and wait"


def test_gpu_experts_with_deferral_and_inductor():
    """Both features at once: compiled without Inductor equals the eager model with the same settings exactly
    (bf16, grouped_mm); with Inductor (C++ on the CPU) within 1e-2 (fp32 activations, gather: no routing near-ties
    from bf16 rounding)."""
    for dtype, kernel in ((torch.bfloat16, "grouped_mm"), (torch.float32, "gather")):
        base = tiny_model("qwen3_moe", dtype=dtype)
        ids = torch.randint(0, 256, (1, 20))
        profile = ktorch.profile_experts(base, ids)
        model = ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_experts=2, expert_profile=profile,
                               gpu_experts_kernel=kernel, deferred_experts=1)
        options = {"inductor": dtype == torch.float32, "n_deferred_experts": 1}
        with torch.no_grad():
            want = model(ids).logits
            torch._dynamo.reset()
            got = torch.compile(model, backend="ktorch", options=options, fullgraph=True)(ids).logits
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=0, atol=1e-2)  # bf16 rounding of the op's inputs


def test_grouped_mm_kernel_compiles_with_inductor():
    """The grouped_mm kernel as Inductor compiles it (C++ on the CPU, bf16) against eager."""
    n, H, I, T, K = 3, 64, 32, 24, 4
    hidden = torch.randn(T, H).bfloat16()
    slots = torch.randint(-1, n, (T, K))
    weights = torch.rand(T, K)
    w13 = (torch.randn(n, H, 2 * I) / H**0.5).bfloat16()
    w2 = (torch.randn(n, I, H) / I**0.5).bfloat16()
    torch._dynamo.reset()
    compiled = torch.compile(gpu_experts_forward, fullgraph=True)
    got = compiled(hidden, slots, weights, w13, w2, "silu", "grouped_mm")
    eager = gpu_experts_forward(hidden, slots, weights, w13, w2, "silu", "grouped_mm")
    # Norm-wise errors: Inductor keeps some bf16 intermediates in fp32 where eager rounds them, and an output that
    # is a small difference of O(1) terms can then move by a bf16 ulp of the terms (seen: 0.025 on a 0.16).
    want = fused_moe_reference(hidden, slots, weights, w13.transpose(1, 2), w2.transpose(1, 2))
    assert relative_error(eager, want) < 2e-2
    assert relative_error(got, want) < 2e-2
    assert relative_error(got, eager) < 2e-2


@needs_cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernel", ["gather", "grouped_mm"])
def test_cuda_gpu_experts_match_hf_eager_and_compile_under_cuda_graphs(family, kernel):
    """On the GPU, the hottest 25% of experts on the GPU: the eager prefill against HF eager (bf16); then 12 decode
    steps compiled under CUDA graphs, teacher-forced. gather (fp32 activations) against the same steps run
    eagerly, within 1e-2. grouped_mm (bf16 only) against the same steps compiled without CUDA graphs (the same
    Inductor kernels): against eager, Inductor's bf16 rounding differs, and a router near-tie can flip one
    token's expert (seen on the device: one step of 12 off by 0.8, reproducible by seed, no CPU load needed)."""
    from models import decode_step_inputs

    if kernel == "grouped_mm" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm needs sm90+")
    torch._dynamo.reset()
    base = tiny_model(family, dtype=torch.bfloat16)
    profile = ktorch.profile_experts(base, torch.randint(0, 256, (4, 64)))
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", gpu_experts=0.25, expert_profile=profile,
                           gpu_experts_kernel=kernel)
    assert all(m.kt_gpu_w13.device.type == "cuda" for m in moe_experts_modules(model))
    assert_logits_match(base.to("cuda"), model, torch.bfloat16, torch.randint(0, 256, (1, PROMPT), device="cuda"))

    dtype = torch.float32 if kernel == "gather" else torch.bfloat16
    base = tiny_model(family, dtype=dtype)
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", gpu_experts=0.25, expert_profile=profile,
                           gpu_experts_kernel=kernel)
    eager_kwargs = decode_step_inputs(model)
    compiled_kwargs = dict(eager_kwargs, past_key_values=copy.deepcopy(eager_kwargs["past_key_values"]))
    tokens = torch.randint(0, 256, (12,), device="cuda")
    with torch.no_grad():
        if kernel == "gather":
            want = teacher_forced_decode(model, eager_kwargs, tokens, False)
        else:
            no_graphs = torch.compile(model, backend="ktorch", fullgraph=True)
            want = teacher_forced_decode(no_graphs, eager_kwargs, tokens, False)
            torch._dynamo.reset()
        step = torch.compile(model, backend="ktorch", mode="reduce-overhead", fullgraph=True)
        got = teacher_forced_decode(step, compiled_kwargs, tokens, True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)


@pytest.mark.parametrize("fmt,group_size", [("int8", None), ("int4", 32), ("bf16", None)], ids=["int8", "int4", "bf16"])
@pytest.mark.parametrize("kernel,dtype,T", [("gather", torch.float32, 3), ("gather", torch.bfloat16, 1),
                                            ("gather", torch.bfloat16, 9), ("grouped_mm", torch.bfloat16, 40)])
def test_packed_device_experts_equal_the_dense_ones(fmt, group_size, kernel, dtype, T):
    """Experts held packed on the device (the GPU budget's residents) give bit for bit what gpu_experts_forward gives
    on their dequantized weights, with absent slots and more rows than one gather chunk (T=9, K=4: 36 > 32)."""
    from ktorch.ops.gpu_experts import packed_experts_forward
    from ktorch.ops.streamed_experts import dequantize_packed

    n, H, I, K = 5, 64, 32, 4
    packed = ktorch.pack_experts(torch.randn(n, 2 * I, H) / H**0.5, torch.randn(n, H, I) / I**0.5, fmt, group_size)
    hidden = torch.randn(T, H).to(dtype)
    slots = torch.randint(-1, n, (T, K))
    weights = torch.rand(T, K)
    w13 = dequantize_packed(packed.w13, packed.w13_scales, True, dtype)
    w2 = dequantize_packed(packed.w2, packed.w2_scales, False, dtype)
    want = gpu_experts_forward(hidden, slots, weights, w13, w2, "silu", kernel)
    got = packed_experts_forward(hidden, slots, weights, packed.tensors(), "silu", kernel)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt,group_size,affine", [("int8", None, False), ("int8", 32, True), ("int4", 32, False),
                                                   ("int4", 32, True), ("bf16", None, False)],
                         ids=["int8", "int8-affine", "int4", "int4-affine", "bf16"])
@pytest.mark.parametrize("gate_up", [True, False], ids=["gate_up", "down"])
def test_dequantize_packed_under_torch_compile_equals_eager(fmt, group_size, affine, gate_up):
    """dequantize_packed traced by torch.compile (its functional form: the eager one writes into views of its output,
    which AOT autograd could not trace) gives the eager weights bit for bit, for every packed format, affine ones
    (scales and minimums) included, with the gate/up rows' interleave undone."""
    from ktorch.ops.moe import pack_quantized
    from ktorch.ops.streamed_experts import dequantize_packed

    torch.manual_seed(0)
    n, N, K = 3, 128, 64
    if fmt == "bf16":
        experts = (ktorch.pack_experts(torch.randn(n, N, K), torch.randn(n, K, N // 2), "bf16") if gate_up
                   else ktorch.pack_experts(torch.randn(n, 2 * K, N), torch.randn(n, N, K), "bf16"))
        packed, scales = experts.tensors()[:2] if gate_up else experts.tensors()[2:]
    else:
        bits = 8 if fmt == "int8" else 4
        lo, hi = ((0, 15) if affine else (-8, 7)) if bits == 4 else ((0, 31) if affine else (-127, 127))
        codes = torch.randint(lo, hi + 1, (n, N, K), dtype=torch.int8)
        G = K // (group_size or K)
        s = torch.rand(n, N, G) + 0.1
        m = torch.rand(n, N, G) if affine else None
        packed, scales = pack_quantized(codes, s, m, bits=bits, gate_up=gate_up)
    want = dequantize_packed(packed, scales, gate_up, torch.bfloat16)
    torch._dynamo.reset()  # each case traces anew (ten cases would pass Dynamo's recompile limit of one function)
    got = torch.compile(dequantize_packed, backend="aot_eager", fullgraph=True)(packed, scales, gate_up,
                                                                               torch.bfloat16)
    assert got.shape == want.shape and torch.equal(got, want)


def test_torch_compile_ktorch_backend_on_a_model_with_resident_experts():
    """torch.compile(model, backend="ktorch") on a model whose experts are partly resident (what prepare places on a
    GPU by default; the CPU stands in for the device here): decode-sized calls give the eager model's logits."""
    from ktorch.gpu_memory import place_resident_experts

    torch.manual_seed(0)
    model = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.float32), device="cpu", experts_dtype="int8")
    for module in moe_experts_modules(model):
        place_resident_experts(module, 4, torch.device("cpu"))
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, backend="ktorch")(ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
