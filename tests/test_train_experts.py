"""torch.ops.ktorch.train_experts: the routed experts of a training step computed on hidden's device from the packed
weights (ktorch/ops/train_experts.py), what ``prepare(trainable=True)`` runs on a GPU.

Against: the float64 reference (tests/reference.py) on the weights the packing stands for, finite differences
(gradcheck in float64), opcheck with autograd, and, on a model, the CPU op's path (kt.fused_moe_delta and its
backward): the same loss and gradients. On the CPU the op reads its weights unpinned (the GPU path pins them); the
GPU's own run is tests/test_train_experts_cuda (device only)."""

from __future__ import annotations

import pytest
import torch

import ktorch
from ktorch.ops.streamed_experts import StreamedExperts
from ktorch.ops.train_experts import register_train_experts
from reference import fused_moe_reference, relative_error

FORMATS = ("bf16", "int8", "int4")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu")


_OWNED: list = []


def _layer(E, H, I, fmt, activation="silu"):
    gate_up = torch.randn(E, 2 * I, H) * H**-0.5
    down = torch.randn(E, H, I) * I**-0.5
    packed = ktorch.pack_experts(gate_up, down, dtype=fmt, group_size=32 if fmt == "int4" else None)
    streamed = StreamedExperts(*packed.tensors()[:4], activation)
    _OWNED.append(streamed)  # the registry holds it weakly: what owns it here (a module's kt_train_streamed there)
    return packed, register_train_experts(streamed)


def _inputs(T, K, E, H, I, dtype=torch.float64):
    ids = torch.randint(0, E, (T, K))
    ids[1, 0] = -1  # a skipped slot
    ids[2, 1] = ids[2, 0] = 3  # a repeated expert
    return (torch.randn(T, H, dtype=dtype), ids, torch.rand(T, K, dtype=dtype),
            torch.randn(T, K, 2 * I, dtype=dtype) * 0.3)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_and_gradients_equal_float64_reference(fmt, activation):
    """float64: out and h equal the reference to rounding; d hidden, d weights and d delta equal autograd through
    the reference (with a loss on out and on h, as expert LoRA's down adapter adds)."""
    E, H, I, T, K = 6, 64, 32, 23, 3
    packed, handle = _layer(E, H, I, fmt, activation)
    x, ids, w, d = _inputs(T, K, E, H, I)
    gate_up, down = packed.dequantize()
    rx, rw, rd = (t.clone().requires_grad_() for t in (x, w, d))
    ref, ref_h = fused_moe_reference(rx, ids, rw, gate_up, down, activation, gate_up_delta=rd, return_h=True)
    gx, gw, gd = (t.clone().requires_grad_() for t in (x, w, d))
    out, h = torch.ops.ktorch.train_experts(gx, ids, gw, gd, handle, activation, True)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h, ref_h, rtol=1e-10, atol=1e-12)
    dy, dh = torch.randn_like(out), torch.randn_like(h)
    torch.autograd.backward((ref, ref_h), (dy, dh))
    torch.autograd.backward((out, h), (dy, dh))
    for name, a, b in (("hidden", gx.grad, rx.grad), ("weights", gw.grad, rw.grad), ("delta", gd.grad, rd.grad)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"{fmt} {activation} d {name}: {m}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gradcheck_and_opcheck(fmt):
    E, H, I, T, K = 4, 32, 32, 5, 2
    _, handle = _layer(E, H, I, fmt)
    x, ids, w, d = _inputs(T, K, E, H, I)
    args = tuple(t.requires_grad_() for t in (x, w, d))
    assert torch.autograd.gradcheck(
        lambda a, b, c: torch.ops.ktorch.train_experts(a, ids, b, c, handle, "silu", True), args)
    assert torch.autograd.gradcheck(  # no delta, no h (a layer without expert adapters)
        lambda a, b: torch.ops.ktorch.train_experts(a, ids, b, None, handle, "silu", False)[0], args[:2])
    torch.library.opcheck(torch.ops.ktorch.train_experts.default, (x, ids, w, d, handle, "silu", True))
    torch.library.opcheck(torch.ops.ktorch.train_experts.default, (x, ids, w, None, handle, "silu", False))


@pytest.mark.skipif(not (hasattr(torch, "_grouped_mm")), reason="torch._grouped_mm is not in this torch")
@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_through_grouped_mm_within_bf16_tolerance(fmt):
    """bf16 hidden states take torch._grouped_mm (the GPU's kernel; on the CPU too where torch has it): within bf16
    tolerance of the float64 reference, forward and gradients."""
    E, H, I, T, K = 8, 128, 64, 40, 4
    packed, handle = _layer(E, H, I, fmt)
    x, ids, w, d = _inputs(T, K, E, H, I)
    gate_up, down = packed.dequantize()
    rx, rw, rd = (t.clone().requires_grad_() for t in (x, w, d))
    ref, ref_h = fused_moe_reference(rx, ids, rw, gate_up, down, "silu", gate_up_delta=rd, return_h=True)
    bx, bw, bd = (t.to(torch.bfloat16).requires_grad_() for t in (x, w, d))
    out, h = torch.ops.ktorch.train_experts(bx, ids, bw, bd, handle, "silu", True)
    assert relative_error(out, ref) < 2e-2 and relative_error(h, ref_h) < 2e-2
    dy, dh = torch.randn_like(ref), torch.randn_like(ref_h)
    torch.autograd.backward((ref, ref_h), (dy, dh))
    torch.autograd.backward((out, h), (dy.to(torch.bfloat16), dh.to(torch.bfloat16)))
    for name, a, b in (("hidden", bx.grad, rx.grad), ("weights", bw.grad, rw.grad), ("delta", bd.grad, rd.grad)):
        assert relative_error(a, b) < 3e-2, f"{fmt} d {name}: {relative_error(a, b):.3g}"


def test_a_handle_lives_as_long_as_its_owner():
    """The registry holds each layer weakly: once its owner lets go (a freed model), the handle names nothing (a
    clear error), and the page-locked memory is released with it."""
    import gc

    packed = _layer(4, 32, 32, "int8")[0]
    streamed = StreamedExperts(*packed.tensors()[:4], "silu")
    handle = register_train_experts(streamed)
    x, ids, w, d = _inputs(3, 2, 4, 32, 32)
    torch.ops.ktorch.train_experts(x, ids, w, d, handle, "silu", False)
    del streamed
    gc.collect()
    with pytest.raises(ValueError, match="no live experts registered under handle"):
        torch.ops.ktorch.train_experts(x, ids, w, d, handle, "silu", False)


def _adapted(model):
    """peft LoRA on q/v and ktorch's expert LoRA (r=4), B random (so the adapters act), in train mode."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    ktorch.lora.add_expert_lora(model, r=4, lora_alpha=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model.train()


class _CountCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Executions of the ktorch train_experts ops (outside selective checkpointing's mode, which answers cached calls
    without reaching this one)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.ktorch.train_experts.default, torch.ops.ktorch.train_experts_backward.default):
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_model_step_equals_the_cpu_op_path():
    """The built-in model prepared for training (float32, int8 experts, LoRA on attention and experts, checkpointed):
    its experts on train_experts (what a GPU gets) give the loss and gradients of the CPU op's path to float32
    rounding, and with checkpointing the op runs once a MoE layer in the forward and once in the backward."""
    from ktorch.placement import _train_experts_on_device, experts_modules

    x = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(5))
    results = []
    for on_op in (False, True):
        torch.manual_seed(0)
        model, _ = ktorch.load("builtin", device="cpu", dtype=torch.float32, experts_dtype="int8", progress=False)
        ktorch.prepare(model, device="cpu", trainable=True)
        if on_op:
            _train_experts_on_device(experts_modules(model), pin=False)
        model = _adapted(model)
        with _CountCalls() as count:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
        layers = model.config.num_hidden_layers
        want = {"train_experts": layers, "train_experts_backward": layers} if on_op else {}
        assert count.calls == want, count.calls
        results.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (l0, g0), (l1, g1) = results
    assert abs(l0 - l1) < 1e-5 * abs(l0)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        assert relative_error(g1[name], g0[name]) < 1e-4, f"{name}: {relative_error(g1[name], g0[name]):.3g}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path (page-locked weights, copies ahead) needs CUDA")
@pytest.mark.parametrize("experts_dtype", ["bf16", "int8"])
def test_cuda_step_equals_the_cpu_op_path(experts_dtype):
    """On a GPU, prepare(trainable=True) attaches the path (page-locked weights, each call copying the next layer's
    ahead on a side stream): two LoRA steps (bf16, checkpointed) give the losses and gradients of the CPU op's path
    (the handles removed) within bf16 tolerance, the second step reusing what the first left (no copy ahead is
    lost or read early)."""
    from ktorch.placement import experts_modules

    x = torch.randint(0, 4096, (2, 64), generator=torch.Generator().manual_seed(7)).cuda()
    results = []
    for on_gpu in (True, False):
        torch.manual_seed(0)
        model, _ = ktorch.load("builtin", device="cuda", dtype=torch.bfloat16, experts_dtype=experts_dtype,
                               progress=False)
        ktorch.prepare(model, device="cuda", trainable=True)
        modules = experts_modules(model)
        assert all(getattr(m, "kt_train_handle", None) is not None for _, m in modules)
        if not on_gpu:
            for _, m in modules:
                del m.kt_train_handle
        model = _adapted(model)
        losses, grads = [], None
        for _ in range(2):
            model.zero_grad()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            losses.append(loss.item())
            grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((losses, grads))
    (l0, g0), (l1, g1) = results
    assert all(abs(a - b) < 2e-2 * abs(b) for a, b in zip(l0, l1)), (l0, l1)
    for name in g1:
        assert relative_error(g0[name], g1[name]) < 5e-2, f"{name}: {relative_error(g0[name], g1[name]):.3g}"


def test_prepare_keeps_the_cpu_op_when_page_locking_fails(monkeypatch):
    """Page-locking the experts can fail (a low `ulimit -l`, no memory to lock): prepare warns, naming the error, and
    the layers it could not pin keep the CPU op (no handle), rather than failing the whole preparation."""
    from ktorch.placement import _train_experts_on_device, experts_modules

    def refuse(self, n):
        raise RuntimeError("stream_experts: cudaHostRegister of 1 bytes failed (cudaError 2)")

    monkeypatch.setattr(StreamedExperts, "pin_prefix", refuse)
    model, _ = ktorch.load("builtin", device="cpu", dtype=torch.float32, experts_dtype="int8", progress=False)
    ktorch.prepare(model, device="cpu", trainable=True)
    modules = experts_modules(model)
    with pytest.warns(UserWarning, match=r"the experts stay on the CPU op for training \(stream_experts: "
                                         r"cudaHostRegister of 1 bytes failed"):
        _train_experts_on_device(modules)
    assert all(getattr(m, "kt_train_handle", None) is None for _, m in modules)
