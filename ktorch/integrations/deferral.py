"""Expert deferral for eager (not compiled) models: ``ktorch.prepare(model, deferred_experts=d)``.

The same semantics as the compile pass (ktorch/passes/deferral.py, docs/deferral.md): at every MoE layer but the
last, each token's ``d`` lowest-weighted routed experts are computed from that layer's input, and their weighted
sum is added to the *next* MoE layer's routed-experts output instead of this layer's.

The experts modules of one model share a ``DeferralChain``; each knows its index in it. The chain carries the
pending deferred call from one layer to the next:

- hidden states on the CPU: the deferred slots run right away (``kt.fused_moe``) and their result waits in the
  chain (no overlap, the same numbers);
- hidden states on a GPU: one split submit to the experts runtime (``submit_experts_split``: the CPU ranks the
  slots, runs the K - d highest, then the d others), the first part waited for at once and the deferred one at
  the next layer, so that layer's attention and router run on the GPU while the CPU finishes it (the overlap the
  compiled graph gets).

Calls of ``PREFILL_TOKENS`` tokens or more (prefill) defer nothing (``defers``): their CPU experts read the weights
of nearly every expert the batch routes to, and a deferred part routes to the same experts, so the weights would
be read twice; the whole prompt's result is exact, and only the decode steps after it defer. (Measured: session 44
on the device, benchmarks/RESULTS.md.)

Under ``torch.compile`` the chain is not used: the backend option ``n_deferred_experts`` decides (``prepare``
sets it for ``generate``'s compiled decoding).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ktorch.ops.deferred_slots import split_topk_slots
from ktorch.ops.routed_experts import MIN_TOKENS


# the prefill boundary, the routing-aware split's too (calls this long may copy experts to the GPU)
PREFILL_TOKENS = MIN_TOKENS


def defers(tokens: int) -> bool:
    """Whether an eager call of ``tokens`` tokens defers (decode-sized calls do; prefill-sized ones do not)."""
    return tokens < PREFILL_TOKENS


class DeferralChain:
    """The experts modules of one model, in layer order, and the deferred call pending between two of them."""

    def __init__(self, n_deferred: int, n_layers: int):
        if n_deferred < 0:
            raise ValueError(f"deferred_experts must be >= 0, got {n_deferred}")
        self.n_deferred = n_deferred
        self.n_layers = n_layers
        self._pending: Optional[tuple] = None  # (layer index, result [T, H] or (ticket, hidden, layer, site))

    def take(self, index: int):
        """The pending deferred result of layer ``index - 1`` ([T, H]), or None; drops a stale one (a forward
        that stopped halfway), after joining it so the runtime's sites stay in order."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        source, value = pending
        result = _resolve(value)
        return result if source == index - 1 else None

    def put(self, index: int, value) -> None:
        self._pending = (index, value)


def _resolve(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    from ktorch.compile.experts_runtime import RUNTIME

    ticket, hidden, layer, site = value
    return RUNTIME.wait(ticket, hidden, layer, site)


def set_deferred_experts(modules: list[nn.Module], n_deferred: int) -> None:
    """Makes the experts ``modules`` (one model's, in layer order) defer ``n_deferred`` slots per token eagerly.

    ``n_deferred = 0`` removes deferral: the modules compute exactly what they did before."""
    if n_deferred == 0:
        for m in modules:
            m.__dict__.pop("kt_deferral", None)
        return
    chain = DeferralChain(n_deferred, len(modules))
    for i, m in enumerate(modules):
        m.kt_deferral = (chain, i)


def deferred_experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor, run_experts, gpu_work=None) -> torch.Tensor:
    """One eager MoE layer with deferral: hidden_states [T, H], top_k_index/top_k_weights [T, K] -> [T, H].

    ``run_experts(module, hidden, ids, weights)`` runs the routed experts at once (kt.fused_moe); ``gpu_work()``,
    when given, the device-resident experts' part (never deferred). Returns this layer's immediate CPU result plus
    the previous layer's deferred result, plus the device part: the order the compiled graph adds them in."""

    chain, index = module.kt_deferral
    last = index == chain.n_layers - 1
    k = top_k_index.shape[-1]
    d = 0 if last else min(chain.n_deferred, k)
    later = None
    if hidden_states.device.type == "cuda":
        # one submit: the CPU ranks each token's slots and runs the K - d highest now, the d others after them
        # (waited for at the next layer); the GPU does no sorting or masking and copies the inputs once
        from ktorch.compile.experts_runtime import RUNTIME

        layer, site_now, site_later = _runtime_ids(module)
        join_now = gpu_work is None  # no device work before the wait: start and join as one host function
        if d == 0:
            ticket = RUNTIME.submit(hidden_states, top_k_index, top_k_weights, layer, site_now, join_now=join_now)
        else:
            ticket = RUNTIME.submit_split(hidden_states, top_k_index, top_k_weights, layer, site_now, site_later, d,
                                          join_now=join_now)
            later = (ticket, hidden_states, layer, site_later)
        gpu_out = gpu_work() if gpu_work is not None else None  # on the GPU while the CPU runs both parts
        out = RUNTIME.wait(ticket, hidden_states, layer, site_now)
    else:
        ids_now, ids_later = (top_k_index, None) if d == 0 else split_topk_slots(top_k_index, top_k_weights, k - d)
        out = run_experts(module, hidden_states, ids_now, top_k_weights)
        later = None if ids_later is None else run_experts(module, hidden_states, ids_later, top_k_weights)
        gpu_out = gpu_work() if gpu_work is not None else None
    previous = chain.take(index)
    if previous is not None:
        out = out + previous
    if gpu_out is not None:
        out = out + gpu_out
    if later is not None:
        chain.put(index, later)
    return out


def _runtime_ids(module: nn.Module) -> tuple[int, int, int]:
    """(layer id, site of the immediate call, site of the deferred call) of ``module`` in the experts runtime."""
    from ktorch.compile.experts_runtime import RUNTIME

    ids = getattr(module, "_kt_deferral_runtime_ids", None)
    if ids is None or ids[0] is not module.kt_w13:
        layer = RUNTIME.register_layer(module.kt_w13, module.kt_w13_scales, module.kt_w2, module.kt_w2_scales,
                                       module.kt_activation, getattr(module, "kt_w13_bias", None),
                                       getattr(module, "kt_w2_bias", None))
        ids = module._kt_deferral_runtime_ids = (module.kt_w13, layer, RUNTIME.new_site(), RUNTIME.new_site())
    return ids[1:]
