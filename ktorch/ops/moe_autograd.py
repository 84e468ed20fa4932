"""Gradients through the packed CPU experts: autograd for ``kt.fused_moe``, and the op that LoRA on the experts
runs, ``kt.fused_moe_delta``.

The expert weights stay frozen and packed (bf16, int8, int4); what flows is

    d hidden[t]     = sum_k w[t,k] * [dg | du] W13_e         (the gate/up projection read transposed)
    d weights[t,k]  = < dY[t], down_e(h_tk) >                (= <dY[t] W2_e, h_tk>)
    dg = (w dY[t] W2_e) * u * act'(g),  du = (w dY[t] W2_e) * act(g)

computed by ``torch.ops.kt.fused_moe_backward`` (ktorch/csrc/moe/fused_moe_backward.cpp) on the CPU from the packed
weights: each expert with routed pairs (or each piece of a busy expert's pairs) is decoded a slice at a time into
one worker's scratch (no unpacked copy of the layer) and multiplied by the packed bf16 kernels (ATen's matmuls at
the portable level and for float32/float64). Memory: for ``kt.fused_moe`` autograd keeps the op's inputs only (hidden
[T, H], ids and weights [T, K], references to the packed tensors) and the backward recomputes the gate/up
pre-activations from hidden (one more x W13^T product per pair: 3 per pair, the forward 2). ``kt.fused_moe_delta``
(expert LoRA) also returns those pre-activations, [T, K, 2I] in hidden's dtype (48 MiB a layer for Qwen3-30B-A3B at
T = 2048 in bf16, 2.4 GiB for 48 layers in host memory: ``ktorch.prepare``'s checkpointing keeps the op's outputs), and
its autograd saves them for the backward (and, in place of hidden and the deltas, whose values that backward
does not read, stride-0 stand-ins), which then skips that product (2 products per pair). With int8/int4
weights the forward also rounds the activations to int8; the backward is the gradient of the dequantized-weights
function with float activations (straight through that rounding), at the forward's own pre-activations when saved.

Every form the forward takes has this backward: the activations with parameters (swiglu_oai, silu_clamped,
softcap_swiglu: the clamps pass the gradient where torch.clamp does), relu2, the experts' biases (frozen: the gate/up
bias shifts the pre-activations, the down bias adds <dY[t], b2_e> to d weights) and gateless experts (h = act(up)).

``kt.fused_moe_delta(hidden, ids, weights, *packed, gate_up_delta [T, K, 2I], activation, w13_bias, w2_bias) ->
(out, h [T, K, I], gate_up [T, K, 2I])`` (gateless experts: gate_up_delta and gate_up [T, K, I]) is
the routed experts with ``gate_up_delta`` added to each (token, slot)'s gate/up pre-activations (gate columns then
up columns) that also returns h = act(gate) * up: what LoRA on the experts needs (ktorch/lora.py), since an adapter
on gate/up acts before the GLU and one on down acts on h; and gate_up, the pre-activations the GLU read (biases and
deltas included; zeros for skipped slots), which its backward reads (not differentiable: an output for autograd to
save, ``kt.fused_moe_backward(..., gate_up=)``). For bf16/fp16 hidden it runs kt.fused_moe's own packed
kernels (the deltas added to each gate/up kernel call's output before the GLU; kt.fused_moe's numerics, its exact
output when the deltas are zero); for float32/float64 hidden the decoded-expert path of the backward, exactly the
function of the dequantized weights (in float64 for float64 inputs, so ``torch.autograd.gradcheck`` applies to it).
"""

from __future__ import annotations

import torch

from ktorch.ops.packed_weights import packed_in_features

from ktorch.ops.moe import _check_same_device

_PACKED = ("w13", "w13_scales", "w2", "w2_scales", "w13_bias", "w2_bias")


# ---------------------------------------------------------------- fake impls


@torch.library.register_fake("kt::fused_moe_backward")
def _fused_moe_backward_fake(grad_out, hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales,
                             activation="silu", gate_up_delta=None, grad_h=None, w13_bias=None, w2_bias=None,
                             gate_up=None):
    _check_same_device("fused_moe_backward", "hidden",
                       dict(grad_out=grad_out, hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13,
                            w13_scales=w13_scales, w2=w2, w2_scales=w2_scales, gate_up_delta=gate_up_delta,
                            grad_h=grad_h, w13_bias=w13_bias, w2_bias=w2_bias, gate_up=gate_up))
    if gate_up is not None:
        torch._check(gate_up.dim() == 3 and gate_up.shape[:2] == topk_ids.shape
                     and gate_up.shape[2] == w13.shape[1] * 16, lambda: "fused_moe_backward: gate_up must be [T, K, N13]")
    torch._check(topk_ids.shape[0] == hidden.shape[0], lambda: "fused_moe_backward: topk_ids must have T rows")
    torch._check(hidden.shape[1] == w2.shape[1] * 16, lambda: "fused_moe_backward: hidden size does not match w2")
    d_delta = (torch.empty_like(gate_up_delta, memory_format=torch.contiguous_format) if gate_up_delta is not None
               else hidden.new_empty((0,)))
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format),
            torch.empty_like(topk_weights, memory_format=torch.contiguous_format), d_delta)


@torch.library.register_fake("kt::fused_moe_delta")
def _fused_moe_delta_fake(hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, gate_up_delta,
                          activation="silu", w13_bias=None, w2_bias=None):
    _check_same_device("fused_moe_delta", "hidden",
                       dict(hidden=hidden, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w13_scales=w13_scales,
                            w2=w2, w2_scales=w2_scales, gate_up_delta=gate_up_delta, w13_bias=w13_bias,
                            w2_bias=w2_bias))
    torch._check(topk_ids.shape[0] == hidden.shape[0], lambda: "fused_moe_delta: topk_ids must have T rows")
    torch._check(hidden.shape[1] == w2.shape[1] * 16, lambda: "fused_moe_delta: hidden size does not match w2")
    T, K = topk_ids.shape
    return (torch.empty_like(hidden, memory_format=torch.contiguous_format),
            hidden.new_empty((T, K, packed_in_features(w2))), hidden.new_empty((T, K, w13.shape[1] * 16)))


# ---------------------------------------------------------------- autograd


def _frozen_check(ctx, packed) -> None:
    for name, t in zip(_PACKED, packed):
        if t is not None and t.requires_grad:
            raise RuntimeError(f"kt.fused_moe: {name} requires grad; the packed expert weights are frozen (train "
                               "adapters beside them: ktorch.lora)")


def _setup_fused_moe(ctx, inputs, output):
    hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, activation, w13_bias, w2_bias = inputs
    _frozen_check(ctx, (w13, w13_scales, w2, w2_scales, w13_bias, w2_bias))
    ctx.activation = activation
    ctx.save_for_backward(hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, w13_bias, w2_bias)


def _fused_moe_backward(ctx, grad_out):
    hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, w13_bias, w2_bias = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if not (need_x or need_w):
        return (None,) * 10
    dx, dw, _ = torch.ops.kt.fused_moe_backward(grad_out, hidden, topk_ids, topk_weights, w13, w13_scales, w2,
                                                w2_scales, ctx.activation, None, None, w13_bias, w2_bias)
    return (dx if need_x else None, None, dw if need_w else None) + (None,) * 7


torch.library.register_autograd("kt::fused_moe", _fused_moe_backward, setup_context=_setup_fused_moe)


def _shape_of(t: torch.Tensor) -> torch.Tensor:
    """A stand-in for ``t`` with its shape and dtype and no memory: one zero expanded (strides 0)."""
    return t.new_zeros(()).expand(t.shape)


def _setup_fused_moe_delta(ctx, inputs, output):
    hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, gate_up_delta, activation, w13_bias, w2_bias = inputs
    _frozen_check(ctx, (w13, w13_scales, w2, w2_scales, w13_bias, w2_bias))
    ctx.activation = activation
    gate_up = output[2]  # the pre-activations: read by the backward, not differentiated
    ctx.mark_non_differentiable(gate_up)
    # no zero gradients made for the outputs nothing differentiated: gate_up's would be [T, K, 2I] zeros a call (50 MB
    # at Qwen3-30B-A3B's T = 2048 in bf16), written and never read; a missing d h is no d h for the op
    ctx.set_materialize_grads(False)
    # the backward reads the saved pre-activations, not hidden's or the deltas' values (only their shapes and dtypes:
    # d hidden's and d delta's): stride-0 stand-ins keep no memory alive (under expert LoRA they are the pinned copies
    # from the GPU, 58 MB a layer at Qwen3-30B-A3B's T = 2048 in bf16, every layer's without checkpointing)
    ctx.save_for_backward(_shape_of(hidden), topk_ids, topk_weights, w13, w13_scales, w2, w2_scales,
                          _shape_of(gate_up_delta), w13_bias, w2_bias, gate_up)


def _fused_moe_delta_backward(ctx, grad_out, grad_h, _grad_gate_up):
    (hidden, topk_ids, topk_weights, w13, w13_scales, w2, w2_scales, gate_up_delta, w13_bias, w2_bias,
     gate_up) = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(hidden)
    dx, dw, dd = torch.ops.kt.fused_moe_backward(grad_out, hidden, topk_ids, topk_weights, w13, w13_scales, w2,
                                                 w2_scales, ctx.activation, gate_up_delta, grad_h, w13_bias, w2_bias,
                                                 gate_up)
    need = ctx.needs_input_grad
    return (dx if need[0] else None, None, dw if need[2] else None, None, None, None, None,
            dd if need[7] else None, None, None, None)


torch.library.register_autograd("kt::fused_moe_delta", _fused_moe_delta_backward, setup_context=_setup_fused_moe_delta)


def _fused_moe_numa_backward(ctx, grad_out):
    raise RuntimeError("kt.fused_moe_numa has no backward (torch.library's autograd of ops with Tensor[] inputs does "
                       "not take it here); ktorch.fused_moe with NUMA-split experts runs each slice through kt.fused_moe "
                       "when gradients are needed")


torch.library.register_autograd("kt::fused_moe_numa", _fused_moe_numa_backward)
