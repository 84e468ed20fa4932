"""The resident-swap policy (ktorch/gpu_memory.py ``resident_swap_pairs``, ``begin_resident_swaps``): a swap only
where the incoming expert's routing count beats the outgoing one's by more than the hysteresis, the counts' noise and
the copy's cost; no churn (repeated routing never swaps an expert back out, and settles); the resident count, the
device bytes and the buffers' addresses never change. On the CPU (the CPU stands in for the device); the side-stream
copies behind decode are checked on CUDA in tests/test_resident_rows.py."""

from __future__ import annotations

import copy

import pytest
import torch

import ktorch
from ktorch import gpu_memory
from ktorch.gpu_memory import (DECAY, SWAP_HYSTERESIS, SWAP_SIGMAS, begin_resident_swaps, device_bytes_held,
                               place_resident_experts, resident_swap_pairs, update_resident_experts)
from ktorch.ops.routed_experts import SplitCosts
from models import moe_experts_modules, tiny_model

COSTS = SplitCosts(h2d_bytes_per_s=1e9, cpu_fixed_s=1e-3, cpu_row_s=1e-5, cpu_expert_s=5e-4)


def _passes(fi: float, fo: float, min_rows: float = 0.0) -> bool:
    """The documented rule, written out."""
    return fi - fo > SWAP_HYSTERESIS * fo + SWAP_SIGMAS * (fi + fo) ** 0.5 and fi - fo >= min_rows


def test_pairs_follow_the_rule():
    f = torch.zeros(8, dtype=torch.float64)
    f[:] = torch.tensor([50.0, 40, 30, 20, 10, 5, 1, 0])
    assert resident_swap_pairs(f, [0, 1, 2]) == []  # the residents are the most routed-to: left alone
    assert resident_swap_pairs(f, [2, 1, 0]) == []
    # residents 5, 6, 7 (5, 1, 0 rows): 0 (50) replaces 7 (0), 1 (40) replaces 6 (1), 2 (30) replaces 5 (5)
    assert resident_swap_pairs(f, [5, 6, 7]) == [(0, 7), (1, 6), (2, 5)]
    # within the hysteresis: 55 against 50 never swaps, at any scale (the same routing repeated)
    g = torch.tensor([50.0, 55.0])
    for scale in (1.0, 10.0, 1e3, 1e6):
        assert resident_swap_pairs(g * scale, [0]) == []
    # noise: 6 rows against none is a single prompt's accident (3 sigma of sqrt(6) is 7.3); 60 against 10 is not
    assert resident_swap_pairs(torch.tensor([0.0, 6.0]), [0]) == []
    assert resident_swap_pairs(torch.tensor([10.0, 60.0]), [0]) == [(1, 0)]
    # the copy's cost in rows
    assert resident_swap_pairs(torch.tensor([10.0, 60.0]), [0], min_rows=51.0) == []
    assert resident_swap_pairs(torch.tensor([10.0, 60.0]), [0], min_rows=50.0) == [(1, 0)]


@pytest.mark.parametrize("seed", range(20))
def test_pairs_on_random_routing(seed):
    """Random skewed counts and resident sets: every pair passes the rule, brings in a non-resident from the top n
    for a resident outside it (distinct experts, most routed first against least routed first), the pairs not taken
    fail it; the same counts again give no pair (nothing swaps back)."""
    g = torch.Generator().manual_seed(seed)
    E, n = 32, int(torch.randint(1, 31, (1,), generator=g))
    weights = torch.rand(E, generator=g) ** 4  # skewed, like an MoE router's
    f = torch.bincount(torch.multinomial(weights, 512 * 4, replacement=True, generator=g), minlength=E).double()
    resident = torch.randperm(E, generator=g)[:n].tolist()
    pairs = resident_swap_pairs(f, resident)
    top = set(torch.argsort(-f, stable=True)[:n].tolist())
    incoming, outgoing = [i for i, _ in pairs], [o for _, o in pairs]
    assert len(set(incoming)) == len(incoming) and len(set(outgoing)) == len(outgoing)
    assert set(incoming) <= top - set(resident) and set(outgoing) <= set(resident) - top
    assert all(_passes(float(f[i]), float(f[o])) for i, o in pairs)
    swap_for = {o: i for i, o in pairs}
    after = [swap_for.get(e, e) for e in resident]
    assert len(set(after)) == n
    assert resident_swap_pairs(f, after) == []


def _model(residents: int, seed=0):
    torch.manual_seed(seed)
    model = ktorch.prepare(tiny_model("qwen3_moe", dtype=torch.float32), device="cpu", experts_dtype="int8")
    ktorch.set_stream_experts(model, COSTS)
    for m in moe_experts_modules(model):
        m.kt_routed.min_tokens = 8
        place_resident_experts(m, residents, torch.device("cpu"))
    return model


def _state(model):
    return [(list(m.kt_gpu_expert_ids), [t.data_ptr() for t in m.kt_gpu_packed if t is not None],
             m.kt_gpu_slot_of.clone()) for m in moe_experts_modules(model)]


def _check_consistent(model, n: int) -> None:
    for m in moe_experts_modules(model):
        ids = m.kt_gpu_expert_ids
        assert len(ids) == len(set(ids)) == n
        want = [-1] * m.kt_w13.shape[0]
        for j, e in enumerate(ids):
            want[e] = j
        assert m.kt_gpu_slot_of.tolist() == want


def test_update_keeps_the_budget_and_the_best_set():
    """Residents already holding the most routed-to experts are left alone (no swap, no write); a clearly better set
    swaps in, the count of residents, the bytes held and the buffers' addresses unchanged, the slot map matching the
    ids; the same counts again swap nothing."""
    model = _model(3)
    held = device_bytes_held(model, torch.device("cpu"))
    before = _state(model)
    for m in moe_experts_modules(model):
        m.kt_routed.frequency[:] = torch.tensor([90.0, 80, 70, 10, 5, 3, 1, 0])  # residents 0, 1, 2 are the top 3
    assert update_resident_experts(model)["swapped"] == 0
    assert [s[0] for s in _state(model)] == [s[0] for s in before]
    for m in moe_experts_modules(model):
        m.kt_routed.frequency[:] = torch.tensor([5.0, 3, 1, 0, 0, 90, 80, 70])
    assert update_resident_experts(model)["swapped"] == 6
    _check_consistent(model, 3)
    assert all(sorted(m.kt_gpu_expert_ids) == [5, 6, 7] for m in moe_experts_modules(model))
    assert [s[1] for s in _state(model)] == [s[1] for s in before]  # written in place
    assert device_bytes_held(model, torch.device("cpu")) == held
    for m in moe_experts_modules(model):  # decayed
        assert m.kt_routed.frequency.tolist() == [DECAY * x for x in [5.0, 3, 1, 0, 0, 90, 80, 70]]
        m.kt_routed.frequency /= DECAY
    assert update_resident_experts(model)["swapped"] == 0


def test_repeated_prompts_settle_without_churn():
    """The same prompt's routing counted again and again (prefill after prefill, as a chat repeats a system
    prompt): swaps only bring experts in toward the most routed-to, never take one back out, stop after a few
    updates, and never change the resident count."""
    model = _model(3)
    prompt = torch.randint(0, 256, (1, 64))
    swapped_in, counts = {id(m): set() for m in moe_experts_modules(model)}, []
    for _ in range(8):
        with torch.no_grad():
            model(prompt)  # a prefill-sized call: the split counts its routing
        before = {id(m): set(m.kt_gpu_expert_ids) for m in moe_experts_modules(model)}
        counts.append(update_resident_experts(model)["swapped"])
        _check_consistent(model, 3)
        for m in moe_experts_modules(model):
            now = set(m.kt_gpu_expert_ids)
            assert not (swapped_in[id(m)] - now)  # nothing swapped in goes back out
            swapped_in[id(m)] |= now - before[id(m)]
    assert counts[0] > 0 and counts[-3:] == [0, 0, 0], counts


def test_one_prompt_of_near_uniform_routing_does_not_churn():
    """One prefill whose counts are about uniform (a prompt's noise) swaps none of a resident set: differences
    within sqrt-noise are not evidence."""
    model = _model(4)
    g = torch.Generator().manual_seed(0)
    for m in moe_experts_modules(model):
        m.kt_routed.frequency[:] = torch.bincount(torch.randint(0, 8, (512 * 2,), generator=g), minlength=8).double()
    assert update_resident_experts(model)["swapped"] == 0


def test_the_copy_cost_in_rows(monkeypatch):
    """With measured costs a pair must also gain the rows that pay for its copy: slow copies (h2d 1 kB/s) and cheap
    CPU misses swap nothing that the rule alone would; no costs (the split off): the rule alone."""
    model = _model(1)
    m = moe_experts_modules(model)[0]
    m.kt_routed.frequency[:] = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 200])
    assert gpu_memory._copy_rows(model, m) < 1.0  # 1 GB/s against 0.5 ms a miss: a fraction of a row
    model.kt_split_costs = SplitCosts(h2d_bytes_per_s=1e3, cpu_fixed_s=0.0, cpu_row_s=0.0, cpu_expert_s=1e-6)
    assert gpu_memory._copy_rows(model, m) > 200
    for mm in moe_experts_modules(model):
        mm.kt_routed.frequency[:] = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 200])
    assert update_resident_experts(model)["swapped"] == 0
    model.kt_split_costs = None
    for mm in moe_experts_modules(model):
        mm.kt_routed.frequency[:] = torch.tensor([0.0, 0, 0, 0, 0, 0, 0, 200])
    assert update_resident_experts(model)["swapped"] == 2


def _assert_logits_as_if_placed_there(model, n: int) -> None:
    """``model``'s logits equal those of a copy whose ``n`` residents a layer were placed where ``model``'s are now
    from the start (swaps leave the model as a placement would)."""
    fresh = copy.deepcopy(model)
    for m in moe_experts_modules(fresh):
        order = torch.tensor(m.kt_gpu_expert_ids)
        gpu_memory.drop_resident_experts(m)
        place_resident_experts(m, n, torch.device("cpu"), initial=order)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)


def test_begin_on_the_cpu_finishes_at_once_and_generate_decodes_with_the_swapped_set():
    """On the CPU stand-in the swaps are done when begin_resident_swaps returns; generate's decode uses the new
    residents, with the logits of a model whose residents were placed there from the start."""
    model = _model(2)
    for m in moe_experts_modules(model):
        m.kt_routed.frequency[:] = torch.tensor([0.0, 0, 0, 0, 0, 0, 300, 200])
    swaps = begin_resident_swaps(model)
    assert swaps.swapped == 4 and not swaps.pending and swaps.poll()
    _check_consistent(model, 2)
    _assert_logits_as_if_placed_there(model, 2)


def test_copy_runs_selects_the_experts_in_order():
    """The swap's copies from page-locked experts (CUDA) go one per run of consecutive ids: any order and runs give
    ``index_select``'s result."""
    source = torch.randn(12, 3, 5)
    for ids in ([0], [3, 4, 5], [7, 2, 3, 4, 11, 0, 1], list(range(12)), [5, 4, 3]):
        out = gpu_memory._copy_runs(source, ids, torch.empty(len(ids), 3, 5))
        assert torch.equal(out, source.index_select(0, torch.tensor(ids)))


def test_the_warm_ups_routing_picks_the_first_residents():
    """The load-time warm-up's prefill (run here on the CPU) swaps residents placed without a profile toward its own
    routing, by the swap rule, before any prompt: here the two least-routed experts of that routing start resident
    and the residents after are what ``resident_swap_pairs`` makes of the warm-up's counts (measured on a copy of the
    model), while the routing frequency stays empty (it counts prompts). Residents from a profile
    (``kt_residents_profiled``) and a model whose prompts counted routing are left as they are. The logits after
    equal those of a model whose residents were placed there from the start."""
    import ktorch.generation as generation

    model = _model(2)
    probe = copy.deepcopy(model)
    tokens = min(generation.WARM_UP_TOKENS, model.config.max_position_embeddings)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens),
                        generator=torch.Generator().manual_seed(generation.WARM_UP_SEED))
    with torch.no_grad():
        probe(ids)  # the warm-up's ids counted by the split
    routing = [m.kt_routed.frequency.clone() for m in moe_experts_modules(probe)]
    want = []
    for m, counts in zip(moe_experts_modules(model), routing):
        coldest = torch.argsort(counts, stable=True)[:2].tolist()
        gpu_memory.drop_resident_experts(m)
        place_resident_experts(m, 2, torch.device("cpu"), initial=torch.tensor(coldest))
        pairs = dict((o, i) for i, o in resident_swap_pairs(counts, coldest, gpu_memory._copy_rows(model, m, counts)))
        want.append(sorted(pairs.get(e, e) for e in coldest))
    profiled, counted = copy.deepcopy(model), copy.deepcopy(model)
    for m in moe_experts_modules(profiled):
        m.kt_residents_profiled = True
    for m in moe_experts_modules(counted):
        m.kt_routed.frequency[0] = 1.0
    before = [sorted(m.kt_gpu_expert_ids) for m in moe_experts_modules(model)]
    assert sum(len(set(a) ^ set(b)) for a, b in zip(before, want)) > 0  # the rule swaps something here

    assert generation._warm_up_prefill(model, generation.WARM_UP_TOKENS) > 0
    assert [sorted(m.kt_gpu_expert_ids) for m in moe_experts_modules(model)] == want
    _check_consistent(model, 2)
    assert all(float(m.kt_routed.frequency.sum()) == 0 for m in moe_experts_modules(model))
    for other in (profiled, counted):
        generation._warm_up_prefill(other, generation.WARM_UP_TOKENS)
        assert [sorted(m.kt_gpu_expert_ids) for m in moe_experts_modules(other)] == before
    _assert_logits_as_if_placed_there(model, 2)
