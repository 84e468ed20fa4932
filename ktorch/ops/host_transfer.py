"""The differentiable experts calls' copies between the accelerator and the CPU ops (``kt.fused_moe``,
``kt.fused_moe_delta`` and their backward), in both directions and for the gradients.

A training step moves, per layer and pass, the hidden states and routing to the CPU and the experts' output back,
and under expert LoRA the gate/up deltas [T, K, 2I] and h [T, K, I] too (ktorch/lora.py). Plain ``.to()`` copies
of pageable memory stage through the driver's buffer one tensor at a time: on the device (H200 host, Qwen3-30B-A3B
shape cut to 8 layers, seq 2048, session 33's profile) 2.0 GB device-to-pageable took 1230 ms of GPU time, about
1.6 GB/s. Here a CUDA tensor goes to the CPU through pinned memory (torch's caching host allocator: blocks reused
across calls, not pinned per call) with non-blocking copies, and the host waits once for the source stream before
the CPU op reads them; the way back stages through pinned memory and copies without blocking (the stream orders it
before the kernels that read the result; the allocator holds the staging block until the copy has ended). CPU
tensors pass as they are (the CPU-only model, and every CPU test, runs the same autograd wiring).

Autograd's inverse of a crossing is the other direction: ``to_host``'s gradients go back to each tensor's device
with ``device_copy``, ``to_device``'s come to the CPU with ``host_copies``. Integer tensors (the routing ids) cross
without gradient.
"""

from __future__ import annotations

import contextlib

import torch


def host_copies(tensors) -> list[torch.Tensor]:
    """CPU copies of ``tensors`` for a CPU op to read. A CUDA tensor is copied into pinned memory (torch's caching
    host allocator: blocks are reused across calls, not allocated per call) without blocking, and the host waits
    once for each source stream before returning, so the copies are complete when the caller reads them (a pageable
    copy instead stages through the driver's buffer one tensor at a time, at a fraction of the bus' speed). CPU
    tensors are returned as they are; other devices get a plain copy."""
    out, streams = [], {}
    for t in tensors:
        if t.is_cuda:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            streams[t.device] = torch.cuda.current_stream(t.device)
            out.append(buf)
        else:
            out.append(t.cpu())
    for stream in streams.values():
        stream.synchronize()
    return out


def device_copy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (CPU) on ``device``. To a CUDA device through a pinned staging block and a non-blocking copy: the
    current stream orders the copy before the kernels that read the result, and the caching host allocator keeps
    the block (its use recorded by the copy) until the copy has ended, so freeing it here is safe."""
    device = torch.device(device)
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    if not t.is_pinned():
        t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
    return t.to(device, non_blocking=True)


class _ToHost(torch.autograd.Function):
    """Tensors to the CPU (``host_copies``); their gradients back to each one's device (``device_copy``). Integer
    tensors cross too, without gradient."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.devices = [t.device for t in tensors]
        # the streams the tensors came from: the gradients' copies are queued there, where autograd runs the nodes
        # that made the tensors (this node is a CPU one to the engine, which orders no stream after it)
        ctx.streams = {t.device: torch.cuda.current_stream(t.device) for t in tensors if t.is_cuda}
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: nothing to copy
        outs = host_copies(tensors)
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for g, d in zip(grads, ctx.devices):
            if g is None or not g.is_floating_point():
                out.append(None)
                continue
            with torch.cuda.stream(ctx.streams[d]) if d in ctx.streams else contextlib.nullcontext():
                out.append(device_copy(g, d))
        return tuple(out)


class _ToDevice(torch.autograd.Function):
    """CPU tensors to ``device`` (``device_copy``); their gradients back to the CPU (``host_copies``: one wait)."""

    @staticmethod
    def forward(ctx, device, *tensors):
        ctx.set_materialize_grads(False)
        return tuple(device_copy(t, device) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        present = [g for g in grads if g is not None]
        copies = iter(host_copies(present))
        return (None,) + tuple(None if g is None else next(copies) for g in grads)


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the CPU (``host_copies``), differentiable: their gradients return to each one's device."""
    return _ToHost.apply(*tensors)


def to_device(device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CPU ``tensors`` on ``device`` (``device_copy``), differentiable: their gradients come back to the CPU."""
    return _ToDevice.apply(torch.device(device), *tensors)
