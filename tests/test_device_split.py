"""The prefill split's choice on the device (``routed_experts.choose_on_device``): the same experts
as the host's numpy choice for any counts, and no host sync on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ktorch.ops.routed_experts import SplitCosts, choose_device_experts, choose_on_device

COSTS = [
    SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=1e-3, cpu_row_s=1e-5, cpu_expert_s=5e-4),
    SplitCosts(h2d_bytes_per_s=48e9, cpu_fixed_s=7e-4, cpu_row_s=3.2e-6, cpu_expert_s=1.8e-5, device_row_s=1.2e-7),
    SplitCosts(h2d_bytes_per_s=1e15, cpu_fixed_s=1.0, cpu_row_s=1.0, cpu_expert_s=1.0),  # everything copied
    SplitCosts(h2d_bytes_per_s=1.0, cpu_fixed_s=0.0, cpu_row_s=1e-9, cpu_expert_s=0.0),  # nothing copied
    SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=0.0, cpu_row_s=1e-6, cpu_expert_s=0.0, device_row_s=1e-6),
    SplitCosts(h2d_bytes_per_s=float("inf"), cpu_fixed_s=0.0, cpu_row_s=0.0, cpu_expert_s=0.0),  # every k ties
    SplitCosts(h2d_bytes_per_s=float("inf"), cpu_fixed_s=1.0, cpu_row_s=0.0, cpu_expert_s=0.0,
               device_row_s=0.0),  # ties from the first k that leaves the CPU nothing
]


def _cases(rng, E):
    for trial in range(60):
        skew = rng.uniform(0.0, 2.0)
        p = 1.0 / np.arange(1, E + 1) ** skew
        p = rng.permutation(p / p.sum())
        T = int(rng.choice([1, 7, 64, 512, 2048]))
        counts = np.bincount(rng.choice(E, size=T * 8, p=p), minlength=E).astype(np.int64)
        if trial % 5 == 0:
            counts = rng.integers(0, 3, size=E)  # many equal counts: ties in the order and in the costs
        resident = None if trial % 3 == 0 else rng.random(E) < rng.uniform(0.0, 0.9)
        capacity = int(rng.choice([0, 1, 4, E // 4, E]))
        yield counts, resident, capacity


def _check(device):
    rng = np.random.default_rng(0)
    for E in (8, 128):
        for counts, resident, capacity in _cases(rng, E):
            for costs in COSTS:
                want = choose_device_experts(counts, costs, 4_718_592, capacity, resident).numpy()
                slot_of, chosen, k = choose_on_device(
                    torch.from_numpy(counts).to(device), costs, 4_718_592, capacity,
                    None if resident is None else torch.from_numpy(resident).to(device))
                slot_of, chosen, k = slot_of.cpu(), chosen.cpu(), int(k.item())
                assert k == want.size
                assert chosen[:k].tolist() == want.tolist() and (chosen[k:] == -1).all()
                expect = np.full(E, -1)
                expect[want] = np.arange(want.size)
                assert slot_of.tolist() == expect.tolist()


def test_device_choice_equals_the_host_choice():
    _check("cpu")


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="counts must be"):
        choose_on_device(torch.zeros(2, 4, dtype=torch.int64), COSTS[0], 1, 1)
    with pytest.raises(ValueError, match="resident must be"):
        choose_on_device(torch.zeros(4, dtype=torch.int64), COSTS[0], 1, 1, torch.zeros(3, dtype=torch.bool))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_device_choice_equals_the_host_choice_without_a_sync():
    _check("cuda")
    counts = torch.randint(0, 50, (128,), device="cuda")
    resident = torch.rand(128, device="cuda") < 0.3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        choose_on_device(counts, COSTS[1], 4_718_592, 32, resident)
    finally:
        torch.cuda.set_sync_debug_mode("default")
