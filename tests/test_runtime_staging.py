"""The experts runtime's host staging (ktorch/compile/experts_runtime.py): eager calls of any token count share a
site's grow-only pool; captured calls keep buffers of their own."""

from __future__ import annotations

import pytest
import torch

import ktorch
from ktorch.compile.experts_runtime import ExpertsRuntime, _Site, _StagingPool


def _inputs(T, H=64, K=4, E=6):
    return torch.randn(T, H, dtype=torch.bfloat16), torch.randint(-1, E, (T, K), dtype=torch.int32), torch.rand(T, K)


def test_two_prompt_lengths_reuse_one_buffer():
    site = _Site()
    a = site.staging_for(*_inputs(300))
    b = site.staging_for(*_inputs(37))
    c = site.staging_for(*_inputs(512))  # still within the first allocation (512 rows)
    pool = next(iter(site.pools.values()))
    assert pool.allocations == 1 and pool.rows == 512
    assert a.hidden.data_ptr() == b.hidden.data_ptr() == c.hidden.data_ptr()
    assert a.out.data_ptr() == b.out.data_ptr() and a.topk_ids.data_ptr() == b.topk_ids.data_ptr()
    assert b.hidden.shape == (37, 64) and b.topk_ids.shape == (37, 4) and b.out.shape == (37, 64)
    assert c.hidden.shape == (512, 64)
    site.staging_for(*_inputs(513))  # grows once, to the next power of two
    assert pool.allocations == 2 and pool.rows == 1024
    split = site.staging_for(*_inputs(1), deferred=torch.tensor(1))  # a split call: its own pool, with out_later
    assert pool.allocations == 2 and len(site.pools) == 2 and split.out_later.shape == (1, 64)
    if torch.cuda.is_available():
        assert a.hidden.is_pinned() and b.out.is_pinned()


def test_small_first_call_gets_the_minimum_rows_and_other_dtypes_their_own_pool():
    site = _Site()
    site.staging_for(*_inputs(1))
    assert next(iter(site.pools.values())).rows == _StagingPool.MIN_ROWS
    h, ids, w = _inputs(5)
    site.staging_for(h.float(), ids, w)
    assert len(site.pools) == 2


def test_captured_stagings_are_per_shape_and_never_the_pool():
    site = _Site()
    eager = site.staging_for(*_inputs(1))
    cap1 = site.staging_for(*_inputs(1), captured=True)
    cap2 = site.staging_for(*_inputs(1), captured=True)
    assert cap1 is cap2 and cap1.hidden.data_ptr() != eager.hidden.data_ptr()
    site.staging_for(*_inputs(4096))  # the pool grows; the captured buffers stay where they were
    assert site.staging_for(*_inputs(1), captured=True).hidden.data_ptr() == cap1.hidden.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eager_cuda_calls_of_two_lengths_match_the_op_and_share_the_pool():
    torch.manual_seed(3)
    E, H, I = 6, 64, 32
    packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 6, "int8")
    rt = ExpertsRuntime()
    layer, site = rt.register_layer(*packed.tensors(), "silu"), rt.new_site()
    for T in (300, 37):
        h, ids, w = _inputs(T, H, 4, E)
        out = rt.wait(rt.submit(h.cuda(), ids.cuda(), w.cuda(), layer, site), h.cuda(), layer, site)
        assert torch.equal(out.cpu(), ktorch.fused_moe(h, ids, w, packed))
    (pool,) = rt._shared_pools.values()  # the sites share one pool; none of their own was made
    assert pool.allocations == 1 and not rt._sites[site].pools and not pool.busy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eager_cuda_calls_in_flight_together_do_not_share_buffers():
    """Two layers submitted before either is waited for: the second finds the shared pool held and takes its site's
    own, so both results are right; afterwards the shared pool is free again."""
    torch.manual_seed(4)
    E, H, I = 6, 64, 32
    packs = [ktorch.pack_experts(torch.randn(E, 2 * I, H) / 8, torch.randn(E, H, I) / 6, "int8") for _ in range(2)]
    rt = ExpertsRuntime()
    layers = [rt.register_layer(*p.tensors(), "silu") for p in packs]
    sites = [rt.new_site(), rt.new_site()]
    inputs = [_inputs(50, H, 4, E), _inputs(70, H, 4, E)]
    tickets = [rt.submit(h.cuda(), i.cuda(), w.cuda(), l, s) for (h, i, w), l, s in zip(inputs, layers, sites)]
    outs = [rt.wait(t, h.cuda(), l, s) for t, (h, _, _), l, s in zip(tickets, inputs, layers, sites)]
    for out, (h, i, w), p in zip(outs, inputs, packs):
        assert torch.equal(out.cpu(), ktorch.fused_moe(h, i, w, p))
    assert len(rt._sites[sites[1]].pools) == 1 and not rt._sites[sites[0]].pools
    assert not any(p.busy for p in rt._shared_pools.values())


def test_abandoned_capture_leaves_no_submit_for_the_next_captures_waits():
    """A capture that fails between a submit and its wait (generate's captured prefill falls back to eager then)
    leaves the site's captured submit behind; ``abandon_capture`` forgets it, at every site."""
    rt = ExpertsRuntime()
    for site in (3, 5):
        rt._sites[site].captured_pending.append(("staging", 1, 1, None))
    rt.abandon_capture()
    assert all(not state.captured_pending for state in rt._sites.values()) and len(rt._sites) == 2
