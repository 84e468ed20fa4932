"""passes/async_boundary.py on hand-built FX graphs: submit/wait placement, overlap, purity, and results.

Structure is checked on graphs annotated with fake CUDA tensors; results on CPU-only graphs run for real
through the experts runtime (the "GPU" side on the CPU), against the graph before the rewrite.
"""

from __future__ import annotations

import itertools
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import ktorch
from ktorch.compile.experts_runtime import RUNTIME
from ktorch.passes.async_boundary import (
    ASYNC_STAGE,
    insert_async_boundaries,
    is_pure,
    overlap_independent_work,
    submit_op,
    wait_op,
)
from ktorch.passes.partition import find_cpu_experts
from test_passes_partition import E, H, I, K, T, annotate, cpu_layer, gpu_layer

_sites = itertools.count(10_000)


def rewrite(gm, layer_id=lambda call: 0, overlap=True):
    boundaries = insert_async_boundaries(gm, find_cpu_experts(gm), layer_id, lambda: next(_sites))
    moved = [overlap_independent_work(gm, b) for b in boundaries] if overlap else []
    return boundaries, moved


def position(gm) -> dict:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def test_gpu_call_becomes_submit_and_wait():
    gm = annotate(gpu_layer, {"x": "cuda"})
    (b,), _ = rewrite(gm, overlap=False)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.kt.fused_moe not in targets and "to" not in targets
    assert torch.ops.aten._to_copy.default not in targets
    assert b.submit.target is submit_op() and b.wait.target is wait_op()
    assert [a.name for a in b.submit.args[:3]] == ["x", "ids", "w"] and b.submit.args[3:] == (0, b.site)
    assert b.wait.args[0] is b.submit and b.wait.args[1].name == "x"
    # submit right after its last input; meta carries fake values on the device
    assert b.submit.prev.name == "w"
    assert b.wait.meta["val"].device == torch.device("cuda", 0) and b.wait.meta["val"].shape == (T, H)
    assert b.submit.meta[ASYNC_STAGE] == "submit" and b.wait.meta[ASYNC_STAGE] == "wait"


def test_shared_experts_move_between_submit_and_wait():
    gm = annotate(gpu_layer, {"x": "cuda"})
    (b,), (moved,) = rewrite(gm)
    pos = position(gm)
    linears = [n for n in gm.graph.nodes if n.target is F.linear]
    assert len(linears) == 2 and all(pos[b.submit] < pos[n] < pos[b.wait] for n in linears)
    assert set(linears) <= set(moved)
    (add,) = [n for n in gm.graph.nodes if n.target is operator.add]
    assert pos[b.wait] < pos[add]
    # the shared result is read after the wait, so the wait is ordered after it
    assert b.wait.args[4] == [linears[-1]]


def test_work_that_needs_the_result_stays_after_the_wait():
    def layer(x, ids, w, w13, w2, shared):
        out = torch.ops.kt.fused_moe.default(x, ids, w, w13, None, w2, None, "silu")
        y = out * 2  # needs the result
        z = F.linear(x, shared)  # does not
        return y + z.sum()

    gm = annotate(layer, {})
    (b,), (moved,) = rewrite(gm)
    pos = position(gm)
    (mul,) = [n for n in gm.graph.nodes if n.target is operator.mul]
    (lin,) = [n for n in gm.graph.nodes if n.target is F.linear]
    (total,) = [n for n in gm.graph.nodes if n.target == "sum"]
    assert pos[b.submit] < pos[lin] < pos[b.wait] < pos[mul]
    assert moved == [lin, total]


def test_impure_node_stops_the_overlap():
    def layer(x, ids, w, w13, w2, shared):
        out = torch.ops.kt.fused_moe.default(x, ids, w, w13, None, w2, None, "silu")
        shared.index_copy_(0, torch.zeros(1, dtype=torch.long), shared[:1])  # a cache update: must not move
        z = F.linear(x, shared)
        return out + z.sum()

    gm = annotate(layer, {})
    (b,), (moved,) = rewrite(gm)
    pos = position(gm)
    (copy,) = [n for n in gm.graph.nodes if n.target == "index_copy_"]
    (lin,) = [n for n in gm.graph.nodes if n.target is F.linear]
    assert pos[b.wait] < pos[copy] < pos[lin]
    assert all(pos[n] < pos[copy] for n in moved)


def test_is_pure():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    nodes = {
        True: [g.call_function(operator.add, (x, y)), g.call_function(torch.relu, (x,)), g.call_method("sum", (x,)),
               g.call_method("__getitem__", (x, 0)), g.call_function(torch.ops.aten.mul.Tensor, (x, y)),
               g.call_function(F.linear, (x, y))],
        False: [g.call_method("add_", (x, 1)), g.call_function(F.relu, (x,), {"inplace": True}),
                g.call_function(torch.add, (x, y), {"out": x}), g.call_function(operator.setitem, (y, 0, 1)),
                g.call_function(operator.iadd, (x, y)), g.call_method("__setitem__", (y, 0, 1)),
                g.call_function(torch.ops.aten.add_.Tensor, (x, y)), g.call_function(torch.ops.aten.index_copy_, (x, 0, y, y)),
                g.call_function(submit_op(), (x, y, y, 0, 0)), g.call_module("m", (x,))],
    }
    for pure, ns in nodes.items():
        for n in ns:
            assert is_pure(n) is pure, n.format_node()


# ---------------------------------------------------------------- running rewritten CPU graphs for real


def packed_inputs(activation="silu"):
    gate_up = torch.randn(E, 2 * I, H) / H**0.5
    down = torch.randn(E, H, I) / I**0.5
    packed = ktorch.pack_experts(gate_up, down, "bf16")
    x = torch.randn(T, H, dtype=torch.bfloat16)
    ids = torch.randint(0, E, (T, K))
    w = torch.rand(T, K)
    shared = torch.randn(I, H, dtype=torch.bfloat16) / H**0.5
    return dict(x=x, ids=ids, w=w, w13=packed.w13, w2=packed.w2, shared=shared), packed


def run_rewritten(fn, rewrite_fn):
    """(the graph's result after ``rewrite_fn(gm, args, layer_id)``, its result before), on real CPU tensors."""
    args, packed = packed_inputs()
    gm = fx.symbolic_trace(fn)
    want = gm(**args)
    def layer_id(call):
        return RUNTIME.register_layer(packed.w13, None, packed.w2, None, call.activation)

    rewrite_fn(gm, args, layer_id)
    assert all(n.target is not torch.ops.kt.fused_moe.default for n in gm.graph.nodes)
    got = gm(**args)
    return got, want


def find_cpu_experts_real(gm, args):
    """find_cpu_experts on a traced graph, annotated from the real CPU arguments it will run with."""
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm).propagate(*[args[n] for n in names])
    return find_cpu_experts(gm)


@pytest.mark.parametrize("overlap", [False, True])
def test_rewritten_cpu_graph_computes_the_same(overlap):
    def rw(gm, args, layer_id):
        boundaries = insert_async_boundaries(gm, find_cpu_experts_real(gm, args), layer_id, lambda: next(_sites))
        assert len(boundaries) == 1
        if overlap:
            assert len(overlap_independent_work(gm, boundaries[0])) >= 1

    got, want = run_rewritten(cpu_layer, rw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_waits_can_move_later_and_submits_can_interleave():
    """Two expert calls: both submitted before either wait, and the first wait moved to the end (what a deferral
    pass does). The results do not change."""

    def two_calls(x, ids, w, w13, w2, shared):
        a = torch.ops.kt.fused_moe.default(x, ids, w, w13, None, w2, None, "silu")
        x2 = F.linear(F.linear(x, shared), shared.t())
        b = torch.ops.kt.fused_moe.default(x2, ids, w, w13, None, w2, None, "silu")
        return a + b

    def rw(gm, args, layer_id):
        boundaries = insert_async_boundaries(gm, find_cpu_experts_real(gm, args), layer_id, lambda: next(_sites))
        first, second = boundaries
        second.wait.append(first.wait)  # defer the first wait past the second call
        pos = position(gm)
        assert pos[first.submit] < pos[second.submit] < pos[second.wait] < pos[first.wait]
        gm.graph.lint()
        gm.recompile()

    got, want = run_rewritten(two_calls, rw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
