"""The differentiable experts calls' copies between the accelerator and the CPU ops (ktorch/ops/host_transfer.py).

On the CPU the crossings pass tensors as they are (what every CPU test of training runs through); the CUDA tests
(skipped without a GPU) check that the pinned, non-blocking copies give what plain ``.to()`` copies give, values and
gradients, bit for bit, and that the copies to the host are complete when the CPU reads them.
"""

from __future__ import annotations

import pytest
import torch

import ktorch
from ktorch.ops.host_transfer import device_copy, host_copies, to_device, to_host

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned host<->GPU copies need a CUDA device")


def test_crossings_on_the_cpu_pass_values_and_gradients_unchanged():
    """CPU tensors: the same values and gradients as no crossing; integer tensors carried without gradient; an
    output nothing differentiates gets no gradient (None, no zeros made and copied)."""
    x = torch.randn(4, 3, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    ids = torch.arange(4)
    xc, idc, wc = to_host(x, ids, w)
    assert torch.equal(xc, x) and torch.equal(idc, ids) and torch.equal(wc, w) and not idc.requires_grad
    yc, zc = to_device("cpu", xc * 3, wc * 2)
    g = torch.randn(4, 3, dtype=torch.bfloat16)
    yc.backward(g)  # zc unused
    assert torch.equal(x.grad, g * 3) and w.grad is None


@cuda
def test_host_copies_and_device_copy_round_trip_exactly():
    dev = torch.device("cuda")
    for t in (torch.randn(33, 17, device=dev).to(torch.bfloat16), torch.randn(5, 7, 3, device=dev),
              torch.randint(-1, 9, (6, 4), device=dev), torch.randn(40, 9, device=dev).t()):
        (c,) = host_copies([t])
        assert c.device.type == "cpu" and c.is_pinned() and c.dtype == t.dtype and c.shape == t.shape
        assert torch.equal(c, t.cpu())
        back = device_copy(c.clone(), dev)  # pageable source: pinned staging
        assert back.device == t.device and torch.equal(back, t)
        assert torch.equal(device_copy(c, dev), t)  # pinned source: sent as is


@cuda
def test_host_copies_wait_for_the_stream():
    """A copy queued behind long GPU work is complete when host_copies returns (the CPU reads it next)."""
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        b = a @ a  # work queued ahead of the copy
        want = b.sum(0)
        (c,) = host_copies([want])
        assert torch.equal(c, want.cpu())


@cuda
def test_gradients_through_the_crossings_equal_plain_copies():
    """A small graph GPU -> CPU op -> GPU through to_host/to_device against .to(): equal outputs and gradients."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 32, device="cuda", generator=g, requires_grad=True)
    m = torch.randn(32, 16)

    def run(cross: bool):
        x.grad = None
        if cross:
            (xc,) = to_host(x * 2)
            (y,) = to_device("cuda", torch.tanh(xc @ m))
        else:
            y = torch.tanh((x * 2).to("cpu") @ m).to("cuda")
        (y.square().sum()).backward()
        return y.detach(), x.grad.clone()

    for a, b in zip(run(True), run(False)):
        assert a.device.type == "cuda" and torch.equal(a, b)
    side = torch.cuda.Stream()  # a step on a side stream: the gradients' copies queue on it, ordered before their use
    with torch.cuda.stream(side):
        got = run(True)
    torch.cuda.synchronize()
    for a, b in zip(got, run(False)):
        assert torch.equal(a, b)


@cuda
def test_differentiable_fused_moe_on_cuda_equals_plain_copies(monkeypatch):
    """kt.fused_moe's differentiable call from the experts integration (no expert adapters, as under attention-only
    LoRA): a packed experts module's output and the gradients of hidden and the routing weights on the GPU equal,
    bit for bit, those with plain .to() copies."""
    import ktorch.ops.host_transfer as ht

    model, _ = ktorch.load("builtin", device="cuda", dtype=torch.bfloat16, experts_dtype="int8", progress=False)
    ktorch.prepare(model, device="cuda", trainable=True, gradient_checkpointing=False)
    experts = model.model.layers[0].mlp.experts
    T, H, E, K = 48, model.config.hidden_size, model.config.num_experts, model.config.num_experts_per_tok
    g = torch.Generator().manual_seed(2)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
    w0 = torch.rand(T, K, generator=g).to("cuda", torch.bfloat16)
    x0 = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
    go = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)

    def run():
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        out = experts(x, ids, w)
        return [out.detach()] + list(torch.autograd.grad(out, (x, w), go))

    ours = run()
    monkeypatch.setattr(ht, "host_copies", lambda ts: [t.to("cpu") for t in ts])
    monkeypatch.setattr(ht, "device_copy", lambda t, device: t.to(device))
    plain = run()
    for a, b in zip(ours, plain):
        assert a.device.type == "cuda" and torch.equal(a, b)
