"""Async boundary: split each CPU experts call into submit and wait, with independent work in between.

Matches the ``ExpertsCall``s that partition.py reports with ``async_ok``. Rewrites

    h_cpu = hidden.to("cpu"); ids_cpu = ...; w_cpu = ...
    out_cpu = kt.fused_moe(h_cpu, ids_cpu, w_cpu, w13, s13, w2, s2, act)
    out = out_cpu.to(device)

into

    ticket = ktorch.submit_experts(hidden, ids, w, layer, site)      # right after its last input
    <pure nodes that do not depend on the result>                     # overlap_independent_work
    out = ktorch.wait_experts(ticket, hidden, layer, site, after=[...])

(a CPU-only graph has no hops; the same rewrite applies). ``layer`` is the id the caller gives the packed
weights (ktorch/compile/experts_runtime.py keeps them), ``site`` a fresh id per call site.

``overlap_independent_work`` then moves the nodes that follow the wait and do not depend on it (DeepSeek's
shared experts, for one) in front of it, keeping their order, until the first node that is not pure (an
in-place op, a cache update, another submit/wait) or the output. The moved nodes whose values are read after
the wait are listed in its ``after`` argument, so a later scheduler (Inductor) cannot sink them past it.

Guarantees: the graph computes what it computed before, for any placement of the independent work; the
submit precedes its wait and nothing impure crosses either. The boundary is two ordinary nodes joined by the
ticket, so a later pass (the deferral pass) may move a wait further down, past the next layer's attention,
as long as it stays before the first use of its result; calls at one site complete in order.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import fx

from ktorch.passes.partition import ExpertsCall, node_value, set_fake_value

ASYNC_STAGE = "ktorch_async"  # node.meta key: "submit" / "wait" / "overlapped"


# The runtime's ops (ktorch/compile/experts_runtime.py), defined by ``import ktorch``, which every import of this
# module runs first: the passes name them and never import the runtime (the compile package imports the passes).
def submit_op():
    return torch.ops.ktorch.submit_experts.default


def split_submit_op():
    return torch.ops.ktorch.submit_experts_split.default


def wait_op():
    return torch.ops.ktorch.wait_experts.default


@dataclass
class Boundary:
    call: ExpertsCall
    submit: fx.Node
    wait: fx.Node
    layer: int
    site: int


def _index(graph: fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def insert_async_boundaries(
    gm: fx.GraphModule,
    calls: list[ExpertsCall],
    layer_id: Callable[[ExpertsCall], int],
    new_site: Callable[[], int],
) -> list[Boundary]:
    """Rewrites every ``async_ok`` call into a submit/wait pair; returns the pairs in graph order."""
    graph = gm.graph
    boundaries = []
    for call in calls:
        if not call.async_ok:
            continue
        layer, site = layer_id(call), new_site()
        order = _index(graph)
        inputs = [call.hidden, call.topk_ids, call.topk_weights]
        last_input = max((n for n in inputs if isinstance(n, fx.Node)), key=order.__getitem__)
        submit_args = (call.hidden, call.topk_ids, call.topk_weights, layer, site)
        with graph.inserting_after(last_input):
            submit = graph.call_function(submit_op(), submit_args)
        wait_args = (submit, call.hidden, layer, site, [])
        with graph.inserting_before(call.result):
            wait = graph.call_function(wait_op(), wait_args)
        for node in (submit, wait):
            set_fake_value(node, required=3)
        submit.meta[ASYNC_STAGE], wait.meta[ASYNC_STAGE] = "submit", "wait"
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in call.node.meta:
                submit.meta[key] = wait.meta[key] = call.node.meta[key]
        call.result.replace_all_uses_with(wait)
        dead = [call.result, call.node] if call.result is not call.node else [call.node]
        for node in dead:
            graph.erase_node(node)
        for hop in call.hops_in:
            if not hop.users:
                graph.erase_node(hop)
        boundaries.append(Boundary(call, submit, wait, layer, site))
    graph.lint()
    gm.recompile()
    return boundaries


# ---------------------------------------------------------------- purity: what may cross a wait

_IMPURE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                     operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                     operator.ior, operator.ixor, operator.ilshift, operator.irshift, operator.imatmul}


def is_pure(node: fx.Node) -> bool:
    """True when running ``node`` earlier cannot change any result: no mutation, no side effect."""
    if node.op == "get_attr":
        return True
    if node.op == "call_method":
        name = str(node.target)
        if name.startswith("__") and name.endswith("__"):
            return name not in ("__setitem__", "__delitem__") and not name.startswith("__i")
        return not name.endswith("_")
    if node.op != "call_function":
        return False
    target = node.target
    if "out" in node.kwargs or node.kwargs.get("inplace", False):
        return False
    if target in _IMPURE_OPERATORS or target in (submit_op(), split_submit_op(), wait_op()):
        return False
    if isinstance(target, torch._ops.OpOverload):
        return not target._schema.is_mutable and not node.is_impure()
    if isinstance(target, torch._ops.OpOverloadPacket):
        return not any(getattr(target, o)._schema.is_mutable for o in target.overloads()) and not node.is_impure()
    if getattr(target, "__module__", None) == "_operator":
        return True
    name = getattr(target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return False
    return not node.is_impure()


def overlap_independent_work(gm: fx.GraphModule, boundary: Boundary) -> list[fx.Node]:
    """Moves the pure nodes after ``boundary.wait`` that do not depend on it in front of it; returns them."""
    wait = boundary.wait
    dependent = {wait}
    moved: list[fx.Node] = []
    node: Optional[fx.Node] = wait.next
    while node is not None and node.op != "root":
        if node.op in ("output", "placeholder") or not is_pure(node):
            break
        if any(d in dependent for d in node.all_input_nodes):
            dependent.add(node)
        else:
            moved.append(node)
        node = node.next
    for n in moved:
        wait.prepend(n)
        n.meta[ASYNC_STAGE] = "overlapped"
    moved_set = set(moved)
    after = [n for n in moved if isinstance(node_value(n), torch.Tensor) and any(u not in moved_set for u in n.users)]
    args = list(wait.args)
    args[4] = list(args[4]) + after
    wait.args = tuple(args)
    gm.graph.lint()
    gm.recompile()
    return moved
