"""Expert deferral's one rule: which of a token's top-k slots run now and which run one layer later.

The eager path (ktorch/integrations/deferral.py), the compiled runtime (ktorch/compile/experts_runtime.py), the
FX pass (ktorch/passes/deferral.py), the backend's options and ``ktorch.set_deferred_experts`` all read it from
here; the native host tasks compute the same ranks in C++ (ktorch/csrc/runtime/host_tasks.cpp). It imports
nothing of ktorch, so every one of them can.
"""

from __future__ import annotations

import torch


def is_deferred_count(value, runtime_ok: bool = False) -> bool:
    """Whether ``value`` is a number of deferred slots: an int >= 0 (not a bool), or "runtime" if ``runtime_ok``."""
    if runtime_ok and value == "runtime":
        return True
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def split_topk_slots(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n_immediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_now, ids_later), both [T, K] like ``topk_ids``: what a split call runs in its two parts.

    ids_now keeps each token's ``n_immediate`` highest-weighted slots (ties to the lower slot) and sets the others
    to -1; ids_later holds exactly the others."""
    order = torch.argsort(topk_weights, dim=-1, descending=True, stable=True)
    rank = torch.argsort(order, dim=-1, stable=True)
    keep = torch.lt(rank, n_immediate)
    return torch.where(keep, topk_ids, -1), torch.where(keep, -1, topk_ids)
