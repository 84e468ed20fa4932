"""passes/deferral.py on hand-built FX graphs: where the split submit, the extra wait and the join go, and results.

Structure is checked on graphs annotated with fake CUDA tensors; results on CPU-only graphs run for real through
the experts runtime, against the semantics written out by hand (with the op itself, so the comparison is exact;
the op is checked against tests/reference.py in test_ops_fused_moe.py).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import ktorch
from ktorch.compile.experts_runtime import RUNTIME
from ktorch.passes.async_boundary import (ASYNC_STAGE, insert_async_boundaries, overlap_independent_work,
                                          split_submit_op, submit_op, wait_op)
from ktorch.passes.deferral import DEFERRAL, defer_experts, split_topk_slots
from ktorch.passes.partition import find_cpu_experts
from test_passes_partition import E, H, I, K, T, annotate, to_cuda

_sites = itertools.count(20_000)


def two_layers_gpu(x, ids, w, w13, w2, shared):
    """Two MoE layers on a "GPU" with an attention stand-in between them; layer 1 routes on its own input."""
    r0 = to_cuda(torch.ops.kt.fused_moe(x.to("cpu"), ids.to("cpu"), w.to("cpu"), w13, None, w2, None, "silu"))
    h1 = x + r0
    a1 = h1 + F.linear(F.silu(F.linear(h1, shared)), shared.t())  # "attention" of layer 1
    logits = F.linear(a1, shared).float()  # router stand-in (ids beyond E do not matter to structure tests)
    w1, ids1 = torch.topk(logits.softmax(-1), K, dim=-1)
    r1 = to_cuda(torch.ops.kt.fused_moe(a1.to("cpu"), ids1.to("cpu"), w1.to("cpu"), w13, None, w2, None, "silu"))
    return a1 + r1 * 2


def rewrite(gm, n_deferred, layer_id=lambda call: 0):
    boundaries = insert_async_boundaries(gm, find_cpu_experts(gm), layer_id, lambda: next(_sites))
    for b in boundaries:
        overlap_independent_work(gm, b)
    return boundaries, defer_experts(gm, boundaries, n_deferred, lambda: next(_sites))


def position(gm) -> dict:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def test_deferring_layer_submits_once_and_joins_its_deferred_part_at_the_next_layer():
    gm = annotate(two_layers_gpu, {"x": "cuda"})
    before = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    (b0, b1), (deferral,) = rewrite(gm, 1)
    pos = position(gm)
    assert deferral.source is b0 and deferral.target is b1 and deferral.n_deferred == 1
    # layer 0: one split submit in the plain submit's place, on the router's own ids and weights (the CPU side
    # splits the slots: no sorting or masking nodes in the graph), with the deferred part's site and d
    assert b0.submit is deferral.submit and b0.submit.target is split_submit_op()
    assert b0.wait.args[0] is b0.submit and b0.submit.meta[ASYNC_STAGE] == "submit"
    hidden, ids, weights, layer, site, later_site, d = b0.submit.args
    assert [n.name for n in (hidden, ids, weights)] == ["x", "ids", "w"]
    assert (layer, site, later_site, d) == (0, b0.site, deferral.site, 1)
    assert deferral.site not in (b0.site, b1.site)
    assert not any(n.target in (torch.argsort, torch.where) for n in gm.graph.nodes)
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == before
    # its deferred part's wait: after layer 1's attention, router and immediate wait; then one add, read where r1 was
    attention = [n for n in gm.graph.nodes if n.target is F.linear][:2]
    topk = next(n for n in gm.graph.nodes if n.target is torch.topk)
    assert all(pos[b0.wait] < pos[n] < pos[deferral.wait] for n in attention + [topk, b1.submit])
    assert pos[b1.wait] < pos[deferral.wait] < pos[deferral.join]
    assert deferral.wait.target is wait_op() and deferral.wait.args[0] is deferral.submit
    assert deferral.wait.args[1:4] == (hidden, 0, deferral.site) and deferral.wait.meta[DEFERRAL] == "wait"
    assert deferral.join.args == (b1.wait, deferral.wait)
    assert list(b1.wait.users) == [deferral.join]
    assert deferral.join.meta["val"].device == torch.device("cuda", 0) and deferral.join.meta["val"].shape == (T, H)
    # the last layer defers nothing: a plain submit
    assert b1.submit.target is submit_op()
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(submit_op()) == 1 and targets.count(split_submit_op()) == 1 and targets.count(wait_op()) == 3


def test_runtime_count_is_minus_one_in_the_graph():
    gm = annotate(two_layers_gpu, {"x": "cuda"})
    (b0, _), (deferral,) = rewrite(gm, "runtime")
    assert deferral.n_deferred is None and b0.submit.args[-1] == -1


def test_deferred_count_is_capped_at_k():
    gm = annotate(two_layers_gpu, {"x": "cuda"})
    (b0, _), (deferral,) = rewrite(gm, K + 3)
    assert deferral.n_deferred == K and b0.submit.args[-1] == K


def test_zero_deferred_leaves_the_graph_untouched():
    gm = annotate(two_layers_gpu, {"x": "cuda"})
    boundaries = insert_async_boundaries(gm, find_cpu_experts(gm), lambda c: 0, lambda: next(_sites))
    before = gm.code
    assert defer_experts(gm, boundaries, 0, lambda: next(_sites)) == []
    assert gm.code == before
    with pytest.raises(ValueError, match=">= 0"):
        defer_experts(gm, boundaries, -1, lambda: next(_sites))


def test_split_topk_slots_keeps_the_highest_weights_ties_to_the_lower_slot():
    w = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]])
    ids = torch.tensor([[3, 1, 4, 0], [5, 6, 7, 2], [9, 8, 7, 6]])
    now, later = split_topk_slots(ids, w, 2)
    assert now.tolist() == [[-1, 1, 4, -1], [5, 6, -1, -1], [9, 8, -1, -1]]
    assert later.tolist() == [[3, -1, -1, 0], [-1, -1, 7, 2], [-1, -1, 7, 6]]
    assert split_topk_slots(ids, w, 4)[0].equal(ids) and (split_topk_slots(ids, w, 0)[0] == -1).all()
    # against a Python sort on random weights with many ties
    w = torch.randint(0, 3, (64, 6)).float()
    ids = torch.randint(0, 16, (64, 6))
    now, later = split_topk_slots(ids, w, 4)
    for t in range(64):
        keep = sorted(range(6), key=lambda k: (-w[t, k].item(), k))[:4]
        assert now[t].tolist() == [ids[t, k].item() if k in keep else -1 for k in range(6)]
        assert later[t].tolist() == [-1 if k in keep else ids[t, k].item() for k in range(6)]


def test_layers_with_different_token_counts_are_not_deferred():
    def layers(x, ids, w, w13, w2, shared):
        r0 = torch.ops.kt.fused_moe.default(x, ids, w, w13, None, w2, None, "silu")
        r1 = torch.ops.kt.fused_moe.default(r0[:2], ids[:2], w[:2], w13, None, w2, None, "silu")
        return r1.sum() + r0.sum()

    gm = annotate(layers, {})
    boundaries = insert_async_boundaries(gm, find_cpu_experts(gm), lambda c: 0, lambda: next(_sites))
    skipped: list = []
    assert defer_experts(gm, boundaries, 1, lambda: next(_sites), skipped) == []
    assert skipped and "token counts 3 and 2" in skipped[0]


# ---------------------------------------------------------------- running rewritten CPU graphs for real


def three_layers_cpu(x, ids, w, w13, w2, shared):
    """Three MoE layers, each routing on its own input (a slice of it as router logits)."""
    h = x
    for _ in range(3):
        a = h + F.linear(F.silu(F.linear(h, shared)), shared.t())
        weights, ids_l = torch.topk(a[:, :E].float().softmax(-1), K, dim=-1)
        h = a + torch.ops.kt.fused_moe.default(a, ids_l, weights, w13, None, w2, None, "silu")
    return h


def deferred_by_hand(args, n_deferred, experts):
    """three_layers_cpu with deferral written out: ``experts(hidden, ids, weights)`` runs one call."""
    h, pending = args["x"], None
    for layer in range(3):
        a = h + F.linear(F.silu(F.linear(h, args["shared"])), args["shared"].t())
        weights, ids = torch.topk(a[:, :E].float().softmax(-1), K, dim=-1)
        keep = [sorted(range(K), key=lambda k: (-weights[t, k].item(), k))[: K - n_deferred] for t in range(T)]
        now, later = ids.clone(), ids.clone()
        for t in range(T):
            for k in range(K):
                (later if k in keep[t] else now)[t, k] = -1
        if layer == 2:
            now = ids
        r = experts(a, now, weights)
        if pending is not None:
            r = r + pending
        pending = experts(a, later, weights) if layer < 2 else None
        h = a + r
    return h


def three_layer_args():
    """Inputs of three_layers_cpu (random packed bf16 experts) and the packed experts."""
    gate_up = torch.randn(E, 2 * I, H) / H**0.5
    down = torch.randn(E, H, I) / I**0.5
    packed = ktorch.pack_experts(gate_up, down, "bf16")
    args = dict(x=torch.randn(T, H, dtype=torch.bfloat16), ids=torch.zeros(T, K, dtype=torch.int64),
                w=torch.zeros(T, K), w13=packed.w13, w2=packed.w2,
                shared=torch.randn(I, H, dtype=torch.bfloat16) / H**0.5)
    return args, packed


@pytest.mark.parametrize("n_deferred", [0, 1, 2])
def test_rewritten_graph_computes_deferral_semantics(n_deferred):
    args, packed = three_layer_args()
    gm = fx.symbolic_trace(three_layers_cpu)
    no_deferral = gm(**args)
    FakeTensorProp(gm).propagate(*[args[n.target] for n in gm.graph.nodes if n.op == "placeholder"])
    layer = RUNTIME.register_layer(packed.w13, None, packed.w2, None, "silu")
    _, deferrals = rewrite(gm, n_deferred, lambda call: layer)
    assert len(deferrals) == (2 if n_deferred else 0)
    got = gm(**args)

    def op(hidden, ids, weights):
        return torch.ops.kt.fused_moe(hidden, ids, weights, packed.w13, None, packed.w2, None, "silu")

    want = deferred_by_hand(args, n_deferred, op)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if n_deferred == 0:
        torch.testing.assert_close(got, no_deferral, rtol=0, atol=0)
    else:
        assert not torch.equal(got, no_deferral)



def test_runtime_count_graph_computes_each_d():
    """n_deferred="runtime": the split calls read the count when they run, so one rewritten graph computes the
    semantics of whatever d set_runtime_deferred_experts last set (0 and more than K included), exactly."""
    from ktorch.compile import set_runtime_deferred_experts

    args, packed = three_layer_args()
    gm = fx.symbolic_trace(three_layers_cpu)
    FakeTensorProp(gm).propagate(*[args[n.target] for n in gm.graph.nodes if n.op == "placeholder"])
    layer = RUNTIME.register_layer(packed.w13, None, packed.w2, None, "silu")
    _, deferrals = rewrite(gm, "runtime", lambda call: layer)
    assert [d.n_deferred for d in deferrals] == [None, None]
    assert [n.args[-1] for n in gm.graph.nodes if n.target is split_submit_op()] == [-1, -1]

    def op(hidden, ids, weights):
        return torch.ops.kt.fused_moe(hidden, ids, weights, packed.w13, None, packed.w2, None, "silu")

    try:
        for d in (2, 0, 1, K, K + 5):
            set_runtime_deferred_experts(d)
            torch.testing.assert_close(gm(**args), deferred_by_hand(args, min(d, K), op), rtol=0, atol=0)
    finally:
        set_runtime_deferred_experts(0)


def test_bad_n_deferred_is_an_error():
    gm = annotate(two_layers_gpu, {"x": "cuda"})
    boundaries = insert_async_boundaries(gm, find_cpu_experts(gm), lambda call: 0, lambda: next(_sites))
    for bad in ("later", 1.5, True):
        with pytest.raises(ValueError, match="int >= 0 or 'runtime'"):
            defer_experts(gm, boundaries, bad, lambda: next(_sites))


def test_split_submit_rejects_bad_arguments():
    _, packed = three_layer_args()
    layer = RUNTIME.register_layer(packed.w13, None, packed.w2, None, "silu")
    x, ids, w = torch.randn(T, H), torch.zeros(T, K, dtype=torch.int64), torch.rand(T, K)
    with pytest.raises(ValueError, match=r"n_deferred must be >= 0 or -1 \(runtime\), got -2"):
        torch.ops.ktorch.submit_experts_split(x, ids, w, layer, next(_sites), next(_sites), -2)
    with pytest.raises(ValueError, match=rf"topk_ids must be \[T, K\], got \({T * K},\)"):
        torch.ops.ktorch.submit_experts_split(x, ids.flatten(), w, layer, next(_sites), next(_sites), 1)
