"""The prefill split's choice made on the device (experiment, branch ``captured-prefill``).

``RoutedExperts.choose`` reads the layer's per-expert counts on the host (one sync a layer) and chooses the experts
to copy in numpy (``choose_device_experts``). A prefill captured in a CUDA graph can make neither: the choice has to
be device work of fixed shapes. ``choose_on_device`` is the same choice in tensor ops of [E]-sized shapes: the same
candidates (used, not resident), the same order (most rows first, lower id among equals), the same costs in the
same float64 operations, the same first minimum, so the same experts for any counts (tests/test_device_split.py);
its outputs are what the capturable parts downstream take: ``slot_of`` [E] (each chosen expert's slot among the
chosen, ascending ids, else -1), ``chosen`` [E] (the chosen ids ascending, then -1) and ``k`` [1] (how many), all on
the counts' device.

What a captured prefill still needs beyond this (see docs/prefill_streaming.md, "where a split prefill's wall
goes", and the session-45 stop note): the gather and the grouped kernels reading ``chosen`` and ``k`` from the
device (the staging's ``capacity`` rows, the tail skipped), the CPU part through the GPU handoff's host tasks as
the captured decode step runs it, and prompts padded to a captured length with their padding rows' ids -1.
"""

from __future__ import annotations

from typing import Optional

import torch

from ktorch.ops.routed_experts import SplitCosts


def choose_on_device(counts: torch.Tensor, costs: SplitCosts, bytes_per_expert: int, capacity: int,
                     resident: Optional[torch.Tensor] = None) -> tuple:
    """counts [E] int (rows per expert), ``resident`` [E] bool or None, on one device -> (slot_of [E] int64,
    chosen [E] int64, k [1] int64) on it, without a host sync: ``choose_device_experts``' choice (see the module)."""
    if counts.dim() != 1:
        raise ValueError(f"choose_on_device: counts must be [E], got {tuple(counts.shape)}")
    E = counts.numel()
    device = counts.device
    counts = counts.to(torch.int64)
    candidate = counts > 0
    if resident is not None:
        if resident.shape != counts.shape:
            raise ValueError(f"choose_on_device: resident must be [E={E}] bool, got {tuple(resident.shape)}")
        resident = resident.to(device=device, dtype=torch.bool)
        candidate = candidate & ~resident
    # most rows first, lower ids first among equals (a stable sort of -rows); the others (-rows = 1) last
    order = torch.sort(torch.where(candidate, -counts, 1), stable=True).indices
    n = candidate.sum()
    rows = torch.where(candidate, counts, 0)[order].to(torch.float64)
    taken = torch.cat([rows.new_zeros(1), torch.cumsum(rows, 0)])  # rows of the first k, k = 0..E (exact: integers)
    k = torch.arange(E + 1, device=device, dtype=torch.float64)
    cpu_experts = n.to(torch.float64) - k
    cpu_rows = rows.sum() - taken
    # SplitCosts.cpu_seconds and device_seconds, operation for operation (the same float64 roundings)
    cpu = torch.where(cpu_experts > 0,
                      costs.cpu_fixed_s + costs.cpu_row_s * cpu_rows + costs.cpu_expert_s * cpu_experts,
                      torch.zeros((), dtype=torch.float64, device=device))
    resident_rows = (torch.where(resident, counts, 0).sum() if resident is not None
                     else counts.new_zeros(())).to(torch.float64)
    per_copy = bytes_per_expert / costs.h2d_bytes_per_s + costs.device_expert_s
    device_s = k * per_copy + costs.device_row_s * (resident_rows + taken)
    total = torch.maximum(cpu, device_s)
    allowed = k <= torch.clamp(n, max=max(int(capacity), 0)).to(torch.float64)
    total = torch.where(allowed, total, torch.full((), float("inf"), dtype=torch.float64, device=device))
    best = torch.argmin(total)  # the first minimum: the smallest k
    take = torch.arange(E, device=device) < best
    chosen_mask = torch.zeros(E, dtype=torch.bool, device=device).scatter(0, order, take)
    slot_of = torch.where(chosen_mask, torch.cumsum(chosen_mask.to(torch.int64), 0) - 1, -1)
    ids = torch.arange(E, device=device)
    chosen = torch.sort(torch.where(chosen_mask, ids, E)).values
    chosen = torch.where(chosen < E, chosen, -1)
    return slot_of, chosen, best.reshape(1).to(torch.int64)
