"""Streaming a prefix of each layer's experts to the accelerator on long inputs (ktorch/ops/streamed_experts.py,
``prepare(..., stream_experts=...)``, ``attach_streamed_experts``).

On the CPU the "device" is the CPU: the same dequantization, masking, kernels and sums run, so the numerics are
tested here; page-locking, the copies and CUDA-graph capture are tested on a GPU.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ktorch
from ktorch.compile import REPORTS
from ktorch.integrations import attach_streamed_experts
from ktorch.ops.streamed_experts import (
    StreamedExperts,
    StreamPlan,
    cpu_ids_without,
    dequantize_packed,
    link_streamed_layers,
    register_streamed_experts,
)
from models import FAMILIES, assert_logits_match, moe_experts_modules, tiny_model
from reference import fused_moe_reference, relative_error

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FORMATS = [("bf16", None), ("int8", None), ("int4", 32), ("int4", 64)]
FORMAT_IDS = ["bf16", "int8", "int4g32", "int4g64"]


SHAPES = [(3, 64, 32), (5, 192, 96), (1, 128, 160), (2, 256, 128)]  # E, H, I


@pytest.mark.parametrize("fmt,group_size,E,H,I", [(f, g, *shape) for f, g in FORMATS for shape in SHAPES
                                                  if not g or (shape[1] % g == 0 and shape[2] % g == 0)])
def test_dequantize_packed_is_kt_unpack_transposed(fmt, group_size, E, H, I):
    """Exactly kt.unpack (transposed to [n, K, N]) in fp32; within bf16 rounding in bf16."""
    gate_up, down = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    packed = ktorch.pack_experts(gate_up, down, fmt, group_size)
    want_gu, want_down = packed.dequantize()
    for dtype in (torch.float32, torch.bfloat16):
        w13 = dequantize_packed(packed.w13, packed.w13_scales, True, dtype)
        w2 = dequantize_packed(packed.w2, packed.w2_scales, False, dtype)
        assert w13.shape == (E, H, 2 * I) and w2.shape == (E, I, H) and w13.dtype == w2.dtype == dtype
        assert w13.transpose(1, 2).is_contiguous() and w2.transpose(1, 2).is_contiguous()  # column-major, K inner
        if dtype == torch.float32:
            assert torch.equal(w13, want_gu.transpose(1, 2)) and torch.equal(w2, want_down.transpose(1, 2))
        else:
            assert torch.equal(w13, want_gu.transpose(1, 2).bfloat16())
            assert torch.equal(w2, want_down.transpose(1, 2).bfloat16())


def test_dequantize_packed_errors():
    packed = ktorch.pack_experts(torch.randn(2, 64, 64), torch.randn(2, 64, 32), "int8")
    with pytest.raises(ValueError, match="scales"):
        dequantize_packed(packed.w13, None, True, torch.float32)
    with pytest.raises(ValueError, match=r"\[n, N/16"):
        dequantize_packed(packed.w13.flatten(3), packed.w13_scales, True, torch.float32)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_packed(packed.w13, packed.w13_scales[:1], True, torch.float32)


def test_stream_plan():
    plan = StreamPlan.from_table({2048: 0.5, 256: 16, 512: 0.25}, num_experts=128)
    assert plan.thresholds == [256, 512, 2048] and plan.experts == [16, 32, 64] and plan.max_experts == 64
    assert [plan.experts_for(t) for t in (1, 255, 256, 511, 512, 2047, 2048, 10**6)] == [0, 0, 16, 16, 32, 32, 64, 64]
    assert StreamPlan().experts_for(4096) == 0
    for bad in ({0: 4}, {512: 129}, {512: 1.5}, {512: -1}, {"512": 4}, {512: True}):
        with pytest.raises(ValueError, match="stream_experts"):
            StreamPlan.from_table(bad, num_experts=128)


@pytest.mark.parametrize("fmt,group_size", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streamed_part_plus_cpu_part_is_the_layer(fmt, group_size, dtype):
    """The op on experts [0, n) plus kt.fused_moe on the rest (their slots masked) against the float64 reference
    of the whole layer on the dequantized weights; negative ids and repeated ids among the slots."""
    E, H, I, T, K, n = 8, 128, 64, 37, 3, 3
    gate_up, down = torch.randn(E, 2 * I, H) / H**0.5, torch.randn(E, H, I) / I**0.5
    packed = ktorch.pack_experts(gate_up, down, fmt, group_size)
    handle = register_streamed_experts(StreamedExperts(*packed.tensors(), "silu", kernel="auto"))
    hidden = torch.randn(T, H).to(dtype)
    ids = torch.randint(-1, E, (T, K))
    ids[0] = 1  # one expert in every slot of a token
    weights = torch.rand(T, K)
    streamed = torch.ops.ktorch.streamed_experts(hidden, ids, weights, handle, n)
    cpu = ktorch.fused_moe(hidden, cpu_ids_without(ids, n), weights, packed)
    assert streamed.dtype == dtype and streamed.shape == (T, H)
    assert (cpu_ids_without(ids, n) < n).sum() == (cpu_ids_without(ids, n) == -1).sum()
    gu, dn = packed.dequantize()
    want = fused_moe_reference(hidden, ids, weights, gu, dn)
    want_streamed = fused_moe_reference(hidden, torch.where(ids < n, ids, -1), weights, gu, dn)
    tolerance = {"bf16": 1e-2, "int8": 3e-2, "int4": 8e-2}[fmt]
    assert relative_error(streamed, want_streamed) < (tolerance if dtype == torch.bfloat16 else 1e-5)
    assert relative_error(streamed.double() + cpu.double(), want) < tolerance


def test_streamed_experts_opcheck():
    packed = ktorch.pack_experts(torch.randn(4, 64, 64) / 8, torch.randn(4, 64, 32) / 6, "int8")
    handle = register_streamed_experts(StreamedExperts(*packed.tensors(), "silu"))
    args = (torch.randn(5, 64), torch.randint(-1, 4, (5, 2)), torch.rand(5, 2), handle, 2)
    torch.library.opcheck(torch.ops.ktorch.streamed_experts.default, args)
    with pytest.raises(ValueError, match="no streamed experts under handle"):
        torch.ops.ktorch.streamed_experts(*args[:3], 10**6, 2)


def _stream(model, table, **kwargs):
    for m in moe_experts_modules(model):
        attach_streamed_experts(m, table, pin=False, **kwargs)
    return model


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_streamed_model_matches_hf_eager(family, dtype):
    """Half of each layer's experts streamed from 16 tokens on: a 24-token prefill agrees with HF eager as the
    unstreamed prepared model does; a 15-token one does not stream and equals the unstreamed model exactly."""
    base = tiny_model(family, dtype=dtype)
    plain = ktorch.prepare(copy.deepcopy(base), device="cpu", experts_dtype="bf16")
    model = _stream(copy.deepcopy(plain), {16: 0.5})
    assert ktorch.stream_plan(model) == {16: 4}
    ids = torch.randint(0, 256, (1, 24))
    assert_logits_match(base, model, dtype, ids)
    short = ids[:, :15]
    with torch.no_grad():
        assert torch.equal(model(short).logits, plain(short).logits)


def test_streamed_model_compiled_overlaps_and_equals_eager():
    """Compiled (no Inductor): the streamed experts run between each layer's submit and wait, and the logits equal
    the eager model's exactly (bf16, int8 experts, grouped_mm)."""
    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    model = _stream(ktorch.prepare(copy.deepcopy(base), device="cpu", experts_dtype="int8"), {8: 3})
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        REPORTS.clear()
        got = torch.compile(model, backend="ktorch", options={"inductor": False}, fullgraph=True)(ids).logits
    assert torch.equal(got, want)
    (report,) = REPORTS
    assert report.async_calls == len(moe_experts_modules(model))
    streamed = [n.meta.get("ktorch_async") for n in report.graph.graph.nodes if "streamed_experts" in str(n.target)]
    assert streamed == ["overlapped"] * len(moe_experts_modules(model))


def test_streamed_model_with_inductor():
    """With Inductor (C++ on the CPU): within 1e-2 of the eager model. fp32 activations (gather kernel), as in the
    hot-experts test: in bf16, Inductor's own rounding flips near-tie routing decisions now and then."""
    base = tiny_model("qwen3_moe")
    model = _stream(ktorch.prepare(copy.deepcopy(base), device="cpu"), {8: 3})
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="ktorch", fullgraph=True)(ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)  # bf16 rounding of the CPU op's inputs


def test_streamed_and_hot_experts_together():
    """Hot experts resident on the device are masked before streaming, so no slot is computed twice: logits agree
    with HF eager."""
    base = tiny_model("qwen3_moe")
    ids = torch.randint(0, 256, (1, 24))
    profile = ktorch.profile_experts(base, ids)
    model = ktorch.prepare(copy.deepcopy(base), device="cpu", gpu_experts=2, expert_profile=profile)
    _stream(model, {4: 5})
    assert_logits_match(base, model, torch.float32, ids)


def test_prepare_stream_experts_errors():
    base = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match="CUDA device"):
        ktorch.prepare(copy.deepcopy(base), device="cpu", stream_experts={512: 0.5})
    model = ktorch.prepare(copy.deepcopy(base), device="cpu")
    with pytest.raises(ValueError, match="streams 9 experts"):
        attach_streamed_experts(moe_experts_modules(model)[0], StreamPlan([4], [9]), pin=False)
    with pytest.raises(ValueError, match="not packed"):
        attach_streamed_experts(moe_experts_modules(tiny_model("qwen3_moe"))[0], {4: 1}, pin=False)
    assert ktorch.stream_plan(model) == {}
    with pytest.raises(ValueError, match="prepare the model first"):
        ktorch.set_stream_experts(tiny_model("qwen3_moe"), {4: 1})
    with pytest.raises(ValueError, match="'auto', 'off'"):
        ktorch.set_stream_experts(model, 0.5)
    with pytest.raises(ValueError, match="no CUDA parameters"):
        ktorch.set_stream_experts(model, "auto")


def test_set_stream_experts_off_restores_the_plain_model():
    base = tiny_model("qwen3_moe")
    plain = ktorch.prepare(copy.deepcopy(base), device="cpu", experts_dtype="int8")
    model = _stream(copy.deepcopy(plain), {4: 0.5})
    ids = torch.randint(0, 256, (1, 10))
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, plain(ids).logits)  # the streamed part skips the op's int8 activations
        ktorch.set_stream_experts(model, "off")
        assert ktorch.stream_plan(model) == {}
        assert torch.equal(model(ids).logits, plain(ids).logits)


@needs_cuda
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_cuda_streamed_prefill_matches_hf_eager_and_captures(family):
    """On the GPU: the streamed experts' packed bytes are page-locked; a 48-token bf16 prefill (eager) agrees with
    HF eager; compiled with CUDA graphs (the copies captured as memcpy nodes) the logits equal those of the same
    graph compiled without CUDA graphs, on replays with different prompts. (Not against eager: Inductor's bf16
    rounding can flip a router near-tie, seen on the device as one position of 48 off by 0.6.)"""
    torch._dynamo.reset()
    base = tiny_model(family, dtype=torch.bfloat16)
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype="int8", stream_experts={32: 0.5})
    for m in moe_experts_modules(model):
        streamed = ktorch.ops.streamed_experts.streamed_experts_of(m.kt_stream_handle)
        assert streamed.pinned_experts == 4 and all(t is None or t.is_pinned() for t in streamed.sources)
    ids = torch.randint(0, 256, (1, 48), device="cuda")
    assert_logits_match(base.to("cuda"), model, torch.bfloat16, ids)
    prompts = [torch.randint(0, 256, (1, 48), device="cuda") for _ in range(3)]
    with torch.no_grad():
        no_graphs = torch.compile(model, backend="ktorch", fullgraph=True)
        want = [no_graphs(ids).logits.float() for ids in prompts]
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ktorch", mode="reduce-overhead", fullgraph=True)
        for ids, w in zip(prompts, want):
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(ids).logits.float()
            torch.testing.assert_close(got, w, rtol=0, atol=1e-2)


@needs_cuda
@pytest.mark.parametrize("fmt,group_size", [("int8", None), ("int4", 32), ("bf16", None)],
                         ids=["int8", "int4g32", "bf16"])
def test_cuda_copy_ahead_equals_copies_in_place(fmt, group_size):
    """CopyAhead (the next layer's experts copied on a side stream while this layer computes, two buffers taking
    turns) gives bit for bit what each layer's own copies give: layers in order, out of order (a queued copy never
    taken), with an expert count other than the one queued, with layers that do not stream, and captured in a CUDA
    graph replayed on new inputs. Every layer has other weights, so a wrong buffer shows."""
    E, H, I, K, L = 8, 128, 64, 3, 4
    plan = StreamPlan([1, 40], [3, 5])  # T < 40: 3 experts; T >= 40: 5
    linked, plain = [], []
    for _ in range(L):
        packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) / H**0.5, torch.randn(E, H, I) / I**0.5, fmt, group_size)
        for chain in (linked, plain):
            s = StreamedExperts(*packed.tensors(), "silu")
            s.plan = plan
            s.pin_prefix(plan.max_experts)
            chain.append(s)
    ahead = link_streamed_layers(linked, torch.device("cuda"))
    assert ahead is not None and all(s.copy_ahead is ahead for s in linked)
    assert ahead.device == torch.empty(0, device="cuda").device  # "cuda" resolved to the index tensors report
    assert [s.next_layer for s in linked] == linked[1:] + [None]

    def inputs(T):
        return (torch.randn(T, H, device="cuda", dtype=torch.bfloat16), torch.randint(-1, E, (T, K), device="cuda"),
                torch.rand(T, K, device="cuda"))

    def run(chain, order, x, ids, w):
        return [chain[i].forward(x, ids, w, plan.experts_for(x.shape[0])) for i in order]

    for order, T in [([0, 1, 2, 3], 45), ([0, 2, 3], 45), ([1, 3, 0], 12), ([0, 1, 2, 3], 12), ([2, 3, 0, 1], 64)]:
        args = inputs(T)
        got = run(linked, order, *args)
        assert ahead.pending is None if order[-1] == L - 1 else ahead.pending.layer is linked[order[-1] + 1]
        for g, w in zip(got, run(plain, order, *args)):
            assert torch.equal(g, w), (order, T)
    args = inputs(45)  # n differs from the queued one: layer 1 queued with 5 experts, taken with 3
    linked[0].forward(*args, 5)
    assert ahead.pending is not None and ahead.pending.layer is linked[1] and ahead.pending.n == 5
    assert torch.equal(linked[1].forward(*args, 3), plain[1].forward(*args, 3))
    linked[2].plan = None  # a layer that does not stream: layer 1 queues nothing for it
    linked[1].forward(*args, 5)
    assert ahead.pending is None
    linked[2].plan = plan
    torch.cuda.synchronize()

    static = inputs(45)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(linked, range(L), *static)  # warm-up, as graph capture wants
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(linked, range(L), *static)
    assert ahead.pending is None  # the last layer queues nothing: no side-stream work left open
    for _ in range(2):
        new = inputs(45)
        for dst, src in zip(static, new):
            dst.copy_(src)
        graph.replay()
        want = run(plain, range(L), *new)
        for g, w in zip(captured, want):
            assert torch.equal(g, w)
    for s in linked + plain:
        s.unpin()
    assert all(s.copy_ahead is None and s.next_layer is None for s in linked)


@needs_cuda
def test_cuda_more_experts_than_page_locked_is_refused():
    """A call for more experts than were page-locked names the fix, with or without CopyAhead."""
    packed = ktorch.pack_experts(torch.randn(4, 64, 64) / 8, torch.randn(4, 64, 32) / 6, "int8")
    chain = [StreamedExperts(*packed.tensors(), "silu") for _ in range(2)]
    for s in chain:
        s.plan = StreamPlan([1], [2])
        s.pin_prefix(2)
    link_streamed_layers(chain[:1], torch.device("cuda"))
    args = (torch.randn(5, 64, device="cuda"), torch.randint(-1, 4, (5, 2), device="cuda"),
            torch.rand(5, 2, device="cuda"))
    for s in chain:
        with pytest.raises(RuntimeError, match="3 experts asked, 2 page-locked; call pin_prefix"):
            s.forward(*args, 3)
        s.unpin()


@needs_cuda
def test_cuda_page_locked_memory_is_unregistered_when_the_experts_go():
    """Memory ``pin_prefix`` registered in place is unregistered when the StreamedExperts object is collected (its
    tensors are freed after): a range left registered after its memory is freed broke the next model's copies to
    the GPU in the same process (bench_generate --breakdown's third load: "CUDA error: invalid argument"). The
    tensor, kept alive here, registers again once the object is gone (it would be refused as already registered)."""
    import gc

    H, I, E = 2048, 1024, 16  # w13 of 16 int8 experts: 64 MiB, registered in place
    packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 6, "int8")
    w13 = packed.tensors()[0]
    s = StreamedExperts(*packed.tensors(), "silu")
    s.pin_prefix(E)
    assert s._registered and s._registered[0] == w13.data_ptr()
    del s
    gc.collect()
    cudart = torch.cuda.cudart()
    nbytes = w13.numel() * w13.element_size()
    assert int(cudart.cudaHostRegister(w13.data_ptr(), nbytes, 0)) == 0
    assert int(cudart.cudaHostUnregister(w13.data_ptr())) == 0


@needs_cuda
def test_cuda_prepare_stream_experts_copy_ahead_is_exact():
    """A prefill with copies queued a layer ahead (the default) equals the one with each layer's own copies."""
    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    model = ktorch.prepare(copy.deepcopy(base), device="cuda", experts_dtype="int8", stream_experts={32: 0.5})
    first = ktorch.ops.streamed_experts.streamed_experts_of(moe_experts_modules(model)[0].kt_stream_handle)
    assert first.copy_ahead is not None
    ids = torch.randint(0, 256, (1, 48), device="cuda")
    with torch.no_grad():
        ahead = model(ids).logits
        ktorch.set_stream_experts(model, {32: 0.5}, copy_ahead=False)
        plain = model(ids).logits
    torch.testing.assert_close(ahead, plain, rtol=0, atol=0)


def test_streamed_experts_with_deferral_compiled_equals_eager():
    """Streaming at prefill with deferral on: the deferral pass splits the CPU op's slots only (streamed experts join
    in their own layer, as in eager), so the compiled graph (no Inductor) equals the eager model exactly."""
    base = tiny_model("qwen3_moe", dtype=torch.bfloat16)
    model = _stream(ktorch.prepare(copy.deepcopy(base), device="cpu", deferred_experts=1), {8: 3})
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        got = torch.compile(model, backend="ktorch", options={"inductor": False, "n_deferred_experts": 1},
                            fullgraph=True)(ids).logits
    assert torch.equal(got, want)
