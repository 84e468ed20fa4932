"""Training with the routed experts computed where the hidden states are (the GPU), their packed weights copied there
per call: ``torch.ops.ktorch.train_experts``.

A training step multiplies every routed expert's weights by thousands of rows (Qwen3-30B-A3B at T = 2048: 154.6
GFLOP a layer forward and as much backward); the CPU op does that at a few TFLOPS (7.3 s a 48-layer step on the
device's 16-core Xeon with AMX, session 39) while a GPU does it in milliseconds, and what limits the GPU is bringing
the weights: 604 MB of int8 a layer over PCIe. So, for a model prepared with ``trainable=True`` on a GPU, each MoE
layer's packed experts (page-locked in place, as ``StreamedExperts`` pins them) are copied to the device, dequantized
there (``dequantize_packed``: bf16 [E, H, 2I] and [E, I, H]) and run through two ``torch._grouped_mm`` (per-expert
loops where it does not apply: float32/float64, or devices it does not take), twice a step: in the forward, and in
the backward (``train_experts_backward``), which copies them again, recomputes the pairs' pre-activations and writes
the gradients by hand instead of keeping a layer's dequantized weights (1.2 GB) or pre-activations alive. Each call
starts the copy of the layer that runs next (the next one forward, the previous one backward: ``link_train_layers``)
on a side stream while it computes. Under ``prepare``'s checkpointing the op's outputs are kept (selective
checkpointing, as for the CPU op), so the layer's recompute does not copy them a third time.

``train_experts(hidden [T, H], ids [T, K], weights [T, K], delta [T, K, 2I] or None, handle, activation, want_h)
-> (out [T, H], h [T, K, I] or [0])``: the routed experts of the layer registered under ``handle``
(``register_train_experts``) with ``delta`` added to each pair's gate/up pre-activations (expert LoRA's gate/up
adapter, gate columns then up columns), and ``h = act(gate) * up`` per pair when ``want_h`` (the down adapter's
input; zeros for skipped slots, ids < 0). Differentiable in hidden, weights and delta. The forms every device-side
expert path takes (unbiased, gated, an activation of ``ACTIVATIONS``: ``device_experts_problem``); other forms stay
on the CPU op.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional

import torch

from ktorch.ops.gpu_experts import ACTIVATIONS, grouped_mm_supported
from ktorch.ops.packed_weights import dequantize_packed, packed_in_features
from ktorch.ops.triton_train import sort_pairs

_REGISTRY: list = []  # handle -> a weak reference to the layer's StreamedExperts (its page-locked packed tensors)


def register_train_experts(streamed) -> int:
    """The handle the op takes for ``streamed`` (a ``StreamedExperts`` over the layer's packed tensors). The registry
    holds it weakly: its owner (the experts module, ``kt_train_streamed``) keeps it alive, and when the model goes
    its page-locked memory is unregistered and freed with it."""
    _REGISTRY.append(weakref.ref(streamed))
    return len(_REGISTRY) - 1


def _streamed(handle: int):
    layer = _REGISTRY[handle]() if 0 <= handle < len(_REGISTRY) else None
    if layer is None:
        raise ValueError(f"train_experts: no live experts registered under handle {handle} (the model they belonged "
                         "to was freed?)")
    return layer


def link_train_layers(handles: list) -> None:
    """The order a model's layers run in (handles of consecutive MoE layers), so that each call copies the layer
    it will need next while it computes: the next one in the forward, the previous one in the backward."""
    for i, h in enumerate(handles):
        layer = _streamed(h)
        layer.train_next = handles[i + 1] if i + 1 < len(handles) else h  # the last: itself, for the backward
        layer.train_prev = handles[i - 1] if i > 0 else None


_AHEAD: dict = {}  # device -> (handle, its packed tensors there, the event their copy recorded)
_SIDE: dict = {}  # device -> the stream copies ahead run on


def _packed_on(handle: int, device: torch.device, then: Optional[int]) -> tuple:
    """The layer's packed tensors on ``device``: the copy made ahead if it is this layer's (waited for on the current
    stream), else copied now; on a GPU the copy of layer ``then`` is then started on a side stream, so that it runs
    on the copy engine while this layer computes. The side stream waits for nothing: its copies read frozen
    page-locked weights into new memory, which the current stream holds (``record_stream``) once it uses it."""
    sources = _streamed(handle).sources
    if device.type != "cuda":
        return tuple(None if t is None else t.to(device) for t in sources)
    current = torch.cuda.current_stream(device)
    ahead = _AHEAD.pop(device, None)
    if ahead is not None and ahead[0] == handle:
        got = ahead[1]
        current.wait_event(ahead[2])
        for t in got:
            if t is not None:
                t.record_stream(current)
    else:  # (a copy ahead of another layer is dropped: its memory goes back to the side stream's pool)
        got = tuple(None if t is None else t.to(device, non_blocking=True) for t in sources)
    ahead_layer = _REGISTRY[then]() if then is not None and 0 <= then < len(_REGISTRY) else None
    if ahead_layer is not None:  # (a layer freed since, e.g. a module kept without its model: nothing to copy)
        side = _SIDE.get(device)
        if side is None:
            side = _SIDE[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            copies = tuple(None if t is None else t.to(device, non_blocking=True) for t in ahead_layer.sources)
            done = torch.cuda.Event()
            done.record(side)
        _AHEAD[device] = (then, copies, done)
    return got


def _device_weights(handle: int, device: torch.device, dtype: torch.dtype, then: Optional[int] = None) -> tuple:
    """The layer's experts on ``device`` in ``dtype``: w13 [E, H, 2I] (gate columns, then up), w2 [E, I, H]
    (``then``: the layer to copy ahead, see ``_packed_on``)."""
    w13, s13, w2, s2 = _packed_on(handle, device, then)
    return dequantize_packed(w13, s13, True, dtype), dequantize_packed(w2, s2, False, dtype)


def _grouped(rows: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, counts: list) -> torch.Tensor:
    """rows [P, in] sorted by expert (counts[e] rows of expert e, offs their cumulative ends) times each expert's
    w [E, in, out]: [P, out]. ``torch._grouped_mm`` where it takes the dtype and device, else one product a used
    expert (float32/float64: the exact paths the tests compare)."""
    if counts is None:
        return torch._grouped_mm(rows, w, offs=offs)
    parts, start = [], 0
    for e, n in enumerate(counts):
        if n:
            parts.append(rows[start:start + n] @ w[e])
        start += n
    return torch.cat(parts) if parts else rows.new_zeros(0, w.shape[-1])


class _Pairs(NamedTuple):
    """The (token, slot) pairs grouped by expert: ``order`` sorts them (stable), ``inverse`` puts them back, ``offs``
    the groups' cumulative ends (int32, for ``torch._grouped_mm``), ``counts`` their sizes as a list where
    grouped_mm does not apply (None where it does), ``tokens`` each sorted pair's token."""

    order: torch.Tensor
    inverse: torch.Tensor
    offs: torch.Tensor
    counts: Optional[list]
    tokens: torch.Tensor


def _pairs(hidden: torch.Tensor, ids: torch.Tensor, E: int) -> _Pairs:
    """Skipped slots (ids < 0) are grouped as expert 0 (computed and masked by the callers: no row of a product is
    left unwritten, so no gradient reads uninitialized memory)."""
    key = ids.clamp(min=0).reshape(-1).long()
    order, ends = sort_pairs(key, E)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    counts = None if grouped_mm_supported(hidden) else torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
    return _Pairs(order, inverse, ends.to(torch.int32), counts, order // ids.shape[1])


def _gate_up(hidden: torch.Tensor, delta: Optional[torch.Tensor], w13: torch.Tensor, p: _Pairs, T: int, K: int):
    """Each pair's pre-activations x W13_e (+ its delta): [T, K, 2I]."""
    gate_up = _grouped(hidden[p.tokens], w13, p.offs, p.counts)[p.inverse].view(T, K, w13.shape[-1])
    return gate_up if delta is None else gate_up + delta.to(gate_up.dtype)


def experts_compute(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, delta: Optional[torch.Tensor],
                    w13: torch.Tensor, w2: torch.Tensor, activation: str) -> tuple:
    """The routed experts in torch ops (differentiable in hidden, weights and delta): (out [T, H], h [T, K, I])."""
    T, K = ids.shape
    I = w2.shape[1]
    valid = ids >= 0
    p = _pairs(hidden, ids, w13.shape[0])
    gate_up = _gate_up(hidden, delta, w13, p, T, K)
    h = torch.where(valid.unsqueeze(-1), ACTIVATIONS[activation](gate_up[..., :I]) * gate_up[..., I:], 0)
    y = _grouped(h.reshape(T * K, I)[p.order], w2, p.offs, p.counts)[p.inverse].view(T, K, -1)
    coef = torch.where(valid, weights, 0).to(y.dtype)
    out = (y * coef.unsqueeze(-1)).sum(1, dtype=torch.float32 if y.dtype != torch.float64 else torch.float64)
    return out.to(hidden.dtype), h


@torch.library.custom_op("ktorch::train_experts", mutates_args=())
def train_experts(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, delta: Optional[torch.Tensor],
                  handle: int, activation: str, want_h: bool) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        w13, w2 = _device_weights(handle, hidden.device, hidden.dtype, getattr(_streamed(handle), "train_next", None))
        out, h = experts_compute(hidden, ids, weights, delta, w13, w2, activation)
    return out, (h.to(hidden.dtype) if want_h else hidden.new_empty(0))


@train_experts.register_fake
def _(hidden, ids, weights, delta, handle, activation, want_h):
    T, K = ids.shape
    I = packed_in_features(_streamed(handle).tensors[2])  # w2's in features
    return torch.empty_like(hidden), (hidden.new_empty(T, K, I) if want_h else hidden.new_empty(0))


def _setup(ctx, inputs, output):
    hidden, ids, weights, delta, handle, activation, want_h = inputs
    ctx.handle, ctx.activation, ctx.want_h = handle, activation, want_h
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, ids, weights, delta)


def _act_backward(activation: str, grad: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """grad * act'(g) for the activations of ``ACTIVATIONS``."""
    if activation == "silu":
        return torch.ops.aten.silu_backward(grad, g)
    if activation in ("gelu", "gelu_tanh"):
        return torch.ops.aten.gelu_backward(grad, g, approximate="tanh" if activation == "gelu_tanh" else "none")
    if activation == "relu":
        return torch.where(g > 0, grad, 0)
    raise ValueError(f"train_experts: no backward for activation {activation!r}")


@torch.library.custom_op("ktorch::train_experts_backward", mutates_args=())
def train_experts_backward(d_out: Optional[torch.Tensor], d_h: Optional[torch.Tensor], hidden: torch.Tensor,
                           ids: torch.Tensor, weights: torch.Tensor, delta: Optional[torch.Tensor], handle: int,
                           activation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weights, d delta or [0]) of ``train_experts`` for the gradients d_out [T, H] and d_h [T, K, I]
    (either may be None: no gradient there). The layer's weights are copied and dequantized again and the pairs'
    pre-activations recomputed (x W13 + delta); then, per pair (rows sorted by expert as in the forward),

        G = d_out[t] W2^T,  d weights = <G, h>,  dh = w G + d_h,  [dg | du] = [dh u act'(g) | dh act(g)],
        d delta = [dg | du],  d hidden[t] = sum_k [dg | du] W13^T

    (<d_out[t], h W2> = <d_out[t] W2^T, h>: the down product is not recomputed)."""
    T, K = ids.shape
    w13, w2 = _device_weights(handle, hidden.device, hidden.dtype, getattr(_streamed(handle), "train_prev", None))
    I = w2.shape[1]
    valid = (ids >= 0).unsqueeze(-1)
    p = _pairs(hidden, ids, w13.shape[0])
    gate_up = _gate_up(hidden, delta, w13, p, T, K)
    g, u = gate_up[..., :I], gate_up[..., I:]
    a = ACTIVATIONS[activation](g)
    h = torch.where(valid, a * u, 0)
    if d_out is not None:
        G = _grouped(d_out.to(hidden.dtype)[p.tokens], w2.transpose(1, 2), p.offs, p.counts)[p.inverse].view(T, K, I)
        acc = torch.promote_types(G.dtype, torch.float32)  # (float64 stays float64)
        d_weights = torch.where(valid.squeeze(-1), (G.to(acc) * h.to(acc)).sum(-1), 0).to(weights.dtype)
        dh = G * torch.where(valid.squeeze(-1), weights, 0).unsqueeze(-1).to(G.dtype)
    else:
        d_weights = torch.zeros_like(weights)
        dh = torch.zeros_like(h)
    if d_h is not None:
        dh = dh + d_h.to(dh.dtype)
    dh = torch.where(valid, dh, 0)
    d_gate_up = torch.cat([_act_backward(activation, dh * u, g), dh * a], dim=-1)  # [T, K, 2I]
    d_rows = _grouped(d_gate_up.reshape(T * K, 2 * I)[p.order], w13.transpose(1, 2), p.offs, p.counts)[p.inverse]
    sum_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    d_hidden = d_rows.view(T, K, -1).sum(1, dtype=sum_dtype).to(hidden.dtype)
    return d_hidden, d_weights, (d_gate_up.to(delta.dtype) if delta is not None else hidden.new_empty(0))


@train_experts_backward.register_fake
def _(d_out, d_h, hidden, ids, weights, delta, handle, activation):
    return (torch.empty_like(hidden), torch.empty_like(weights),
            torch.empty_like(delta) if delta is not None else hidden.new_empty(0))


def _backward(ctx, d_out, d_h):
    hidden, ids, weights, delta = ctx.saved_tensors
    need = ctx.needs_input_grad
    if d_out is None and (d_h is None or not ctx.want_h):
        return (None,) * 7
    dx, dw, dd = torch.ops.ktorch.train_experts_backward(d_out, d_h if ctx.want_h else None, hidden, ids, weights,
                                                         delta, ctx.handle, ctx.activation)
    return (dx if need[0] else None, None, dw if need[2] else None, dd if delta is not None and need[3] else None,
            None, None, None)


train_experts.register_autograd(_backward, setup_context=_setup)
