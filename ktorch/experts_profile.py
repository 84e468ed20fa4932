"""Which routed experts a model uses: ``ktorch.profile_experts(model, inputs)``.

The counts decide which experts ``ktorch.prepare(..., gpu_experts=N, expert_profile=profile)`` keeps on the GPU:
the N most routed-to of each layer. Counting happens in forward pre-hooks of the experts modules, so the model
runs eagerly (prepared or not, on any device); a slot with a negative id is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Union

import torch
from torch import nn

from ktorch.integrations.transformers_experts import experts_modules


@dataclass
class ExpertsProfile:
    """Routed slots per expert of each MoE layer: ``counts[name]`` is [E] int64, ``name`` the experts module's
    qualified name in the model (``model.layers.3.mlp.experts``)."""

    counts: dict[str, torch.Tensor] = field(default_factory=dict)

    def hottest(self, name: str, n: int) -> torch.Tensor:
        """The ``n`` most routed-to expert ids [n] of layer ``name``, most first (ties to the lower id)."""
        counts = self.counts[name]
        order = torch.argsort(-counts, stable=True)
        return order[:n].clone()

    def fraction_on(self, placement: dict[str, list]) -> float:
        """The share of all routed slots whose expert is in ``placement[name]`` (expert ids per layer)."""
        total = sum(int(c.sum()) for c in self.counts.values())
        hit = sum(int(self.counts[name][torch.as_tensor(ids, dtype=torch.long)].sum())
                  for name, ids in placement.items() if name in self.counts and len(ids))
        return hit / total if total else 0.0

    def to_dict(self) -> dict:
        return {name: c.tolist() for name, c in self.counts.items()}

    @classmethod
    def from_dict(cls, data: dict) -> "ExpertsProfile":
        return cls({name: torch.tensor(c, dtype=torch.int64) for name, c in data.items()})


def profile_experts(model: nn.Module, inputs: Union[torch.Tensor, dict, Iterable]) -> ExpertsProfile:
    """Runs ``model`` on ``inputs`` (token ids [B, S], a dict of forward kwargs, or an iterable of either) without
    grad and counts, per MoE layer, how many routed slots pick each expert."""
    modules = experts_modules(model)
    if not modules:
        raise ValueError(f"profile_experts: {type(model).__name__} has no transformers experts modules")
    profile = ExpertsProfile()
    handles = []
    for name, module in modules:
        n_experts = getattr(module, "num_experts", None)
        if n_experts is None:
            n_experts = module.kt_w13.shape[0] if getattr(module, "kt_w13", None) is not None else module.gate_up_proj.shape[0]
        profile.counts[name] = torch.zeros(n_experts, dtype=torch.int64)

        def hook(mod, args, name=name):
            ids = args[1].detach().reshape(-1)
            ids = ids[ids >= 0].cpu()
            profile.counts[name] += torch.bincount(ids, minlength=profile.counts[name].numel())

        handles.append(module.register_forward_pre_hook(hook))
    batches = [inputs] if isinstance(inputs, (torch.Tensor, dict)) else list(inputs)
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch) if isinstance(batch, dict) else model(batch)
    finally:
        for h in handles:
            h.remove()
    return profile
