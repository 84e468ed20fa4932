"""One projection for an attention's queries, keys and values in the compiled decode step.

transformers' attention modules (Qwen2/3-MoE, Mixtral, OLMoE, Llama, ...) project the same hidden states three
times, ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)``: three matrix-vector products a layer in a decode step, of
which the two small ones (512 columns on the Qwen3-30B-A3B shape) cost as much as the large one (device, H200 host,
48 layers, every expert resident: 5.5 + 5.4 + 6.6 us a layer of a 4.27 ms step, cuBLAS's tiles for one row).

``fuse_weights(model)`` lays each such module's three weights (and biases) end to end in one tensor and makes the
three ``nn.Linear`` weights views of it: the same memory, the same values, the same modules (prefill, state dicts
and everything else see nothing new). ``swapped(model)``, opened by ``compiled_layers`` around the decode step's
capture, gives each of the three a forward ``linear(x, W_qkv)[..., a:b]``; the three products of one weight then
are one node in Inductor's graph (ktorch/passes/cse.py) and one launch in the step.

Which modules: an attention module (class name ending in ``Attention``) whose ``q_proj``, ``k_proj`` and ``v_proj``
are exactly ``nn.Linear`` (a peft or quantized wrapper is left alone) of the same input size, dtype and device,
all with biases or none, no weight requiring grad (a trainable model keeps its own). The swapped forward is the
layer's own product on whatever tensor it is given, sliced to its own rows, so it is right for any attention
forward (one that projects other tensors, e.g. cross attention, simply keeps three products); only the rounding of
a product may differ (cuBLAS picks its tile by the width). A ``model.to(...)`` that copies the views apart is seen
(the three no longer lie end to end in one storage) and the weights are fused again; no reference to the fused
tensor is kept outside the three views.
"""

from __future__ import annotations

import contextlib
import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

NAMES = ("q_proj", "k_proj", "v_proj")


def _projections(m: nn.Module) -> Optional[list]:
    """The module's q/k/v ``nn.Linear`` layers where they can share one weight, else None."""
    if not type(m).__name__.endswith("Attention"):
        return None
    projs = [getattr(m, n, None) for n in NAMES]
    if any(type(p) is not nn.Linear for p in projs):
        return None
    w = [p.weight for p in projs]
    if any(t.requires_grad for t in w) or len({(t.shape[1], t.dtype, t.device) for t in w}) != 1:
        return None
    biases = [p.bias for p in projs]
    if any(b is not None for b in biases) and (any(b is None or b.requires_grad for b in biases)
                                                or len({b.dtype for b in biases}) != 1):
        return None
    return projs


def _end_to_end(tensors: list) -> Optional[torch.Tensor]:
    """The one tensor [sum of rows, ...] that ``tensors`` (contiguous, in order) are consecutive row blocks of,
    as a view of their storage, else None. Nothing is kept on the module: a ``model.to(...)`` that copies the
    blocks apart leaves no fused tensor alive, and the next ``fuse_weights`` lays them out again."""
    first = tensors[0]
    if any(not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
           for t in tensors):
        return None
    offset = first.storage_offset()
    for t in tensors:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride())


def fused(m: nn.Module) -> Optional[tuple]:
    """(weight [Nq + Nk + Nv, H], bias or None, the three row ranges) of a module whose q/k/v layers share one
    weight (``fuse_weights``), else None."""
    projs = _projections(m)
    if projs is None:
        return None
    weight = _end_to_end([p.weight for p in projs])
    bias = _end_to_end([p.bias for p in projs]) if projs[0].bias is not None else None
    if weight is None or (projs[0].bias is not None and bias is None):
        return None
    ranges, start = [], 0
    for p in projs:
        ranges.append((start, start + p.weight.shape[0]))
        start = ranges[-1][1]
    return weight, bias, tuple(ranges)


def fuse_weights(model: nn.Module) -> list:
    """Fuses the q/k/v weights of every attention module that takes it (see the module's docstring); returns those
    modules. Idempotent; memory-neutral after each module (its three weights are freed as the fused one takes
    their place)."""
    modules = []
    for m in model.modules():
        projs = _projections(m)
        if projs is None:
            continue
        if fused(m) is None:
            # normal tensors even when called under inference mode (generate's): an inference tensor as a weight
            # would break a later forward with autograd on (fine-tuning the same model)
            with torch.inference_mode(False), torch.no_grad():
                weight = torch.cat([p.weight for p in projs])
                bias = torch.cat([p.bias for p in projs]) if projs[0].bias is not None else None
                start = 0
                for p in projs:
                    a, start = start, start + p.weight.shape[0]
                    p.weight = nn.Parameter(weight[a:start], requires_grad=False)
                    if bias is not None:
                        p.bias = nn.Parameter(bias[a:start], requires_grad=False)
        modules.append(m)
    return modules


def _fused_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # the three projections' products of one weight: Inductor's graph keeps one (ktorch/passes/cse.py)
    return F.linear(x, self.kt_qkv_weight, self.kt_qkv_bias)[..., self.kt_qkv_start:self.kt_qkv_end]


@contextlib.contextmanager
def swapped(model: nn.Module):
    """Fuses the model's q/k/v weights (``fuse_weights``) and, while open, runs each fused module's q/k/v layers
    on ``_fused_forward`` (the fused weight and bias as buffers, so that Dynamo takes them as the compiled layer's
    inputs: one compile for every layer); gives the fused attention modules."""
    touched = []
    modules = fuse_weights(model)
    try:
        for m in modules:
            weight, bias, ranges = fused(m)
            for name, (a, b) in zip(NAMES, ranges):
                p = getattr(m, name)
                touched.append(p)
                p.register_buffer("kt_qkv_weight", weight, persistent=False)
                p.register_buffer("kt_qkv_bias", bias, persistent=False)
                p.kt_qkv_start, p.kt_qkv_end = a, b
                p.forward = types.MethodType(_fused_forward, p)
        yield modules
    finally:
        for p in touched:
            p.__dict__.pop("forward", None)
            p._buffers.pop("kt_qkv_weight", None)
            p._buffers.pop("kt_qkv_bias", None)
            for attr in ("kt_qkv_start", "kt_qkv_end"):
                p.__dict__.pop(attr, None)


@contextlib.contextmanager
def eager_swapped(model: nn.Module):
    """The eager prefill's q/k/v (``Decoder.prefill`` on a GPU opens it; it won its device A/B there, session 44,
    generation.py): while open, a
    fused module's q layer computes the one product ``linear(x, W_qkv)`` and keeps it, and its k and v layers, given
    the same tensor ``x`` next, slice it instead of making their own (transformers' attention forwards call q, k, v
    in that order on one tensor); any other call (another tensor, another order) makes its own product and drops what
    was kept. Two products and their launches fewer a layer, where an eager prefill is bound by its launching
    thread. Gives the modules."""
    touched = []
    modules = fuse_weights(model)
    try:
        for m in modules:
            weight, bias, ranges = fused(m)
            kept: dict = {}  # the q layer's input and the whole product, until the v layer takes its slice
            for i, (name, (a, b)) in enumerate(zip(NAMES, ranges)):
                p = getattr(m, name)
                touched.append(p)
                p.forward = types.MethodType(_eager_forward(i, a, b, weight, bias, kept), p)
        yield modules
    finally:
        for p in touched:
            p.__dict__.pop("forward", None)


def _eager_forward(i: int, a: int, b: int, weight: torch.Tensor, bias: Optional[torch.Tensor], kept: dict):
    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if i == 0:
            kept["x"], kept["out"] = x, F.linear(x, weight, bias)
            return kept["out"][..., a:b]
        if kept.get("x") is x:
            out = kept["out"]
            if i == len(NAMES) - 1:
                kept.clear()  # nothing held past the layer
            return out[..., a:b]
        kept.clear()  # another input: the q layer's product is not this call's, nor a later one's
        return F.linear(x, self.weight, self.bias)
    return forward
