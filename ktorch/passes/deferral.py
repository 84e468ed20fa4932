"""Expert deferral: the lowest-weighted experts of MoE layer i join the residual stream one layer later.

Semantics (KTransformers' "Expert Deferral", as kt-kernel implements it; docs/deferral.md). For each token, the
``d`` slots of its K routed experts with the lowest routing weights at layer i are *deferred*: they are computed
from layer i's input like the others, but their weighted sum ``D_i`` is not part of layer i's output. It is added
to layer i+1's routed-experts output instead, so it joins the residual stream at the end of layer i+1's MoE block:

    x_{i+1}   = h_i + Attn_{i+1}(h_i)                                  # does not see D_i
    h_{i+1}   = x_{i+1} + Shared_{i+1}(x_{i+1}) + R_{i+1}(x_{i+1}) + D_i   # R: the K - d immediate slots
                                                                       # router and experts of i+1 do not see D_i

The last MoE layer of the graph defers nothing (nothing would join its output). ``d = 0`` leaves the graph as it
is. Ties in the weights go to the lower slot index (a stable sort).

Matches: the ``Boundary`` pairs of passes/async_boundary.py (graph order), after ``overlap_independent_work``.
Rewrites, for every boundary but the last,

    ticket = submit_experts(h_i, ids, w, layer, site)
    ...
    r_i = wait_experts(ticket, h_i, layer, site, after)
    ...                                       # layer i+1's attention and router
    r_j = wait_experts(ticket_j, h_j, layer_j, site_j, after_j)
    <users of r_j>

into

    ticket = submit_experts_split(h_i, ids, w, layer, site, new_site, d)  # d = -1: the runtime count
    ...
    r_i = wait_experts(ticket, h_i, layer, site, after)                   # the K - d highest-weighted slots
    ...                                       # layer i+1's attention and router run while the CPU finishes
    r_j = wait_experts(ticket_j, h_j, layer_j, site_j, after_j)
    d_i = wait_experts(ticket, h_i, layer, new_site, [])                  # the d lowest-weighted slots
    r_j' = r_j + d_i
    <users of r_j, now reading r_j'>

The slots are split on the CPU, by the runtime (ktorch/compile/experts_runtime.py): rank each token's slots by
weight (stable, descending) and run ranks < K - d first, the rest second, as ``split_topk_slots`` (ktorch/ops/deferred_slots.py) does. The graph
gets no sorting or masking kernels and no second set of input copies: a deferring layer costs the device what a
plain one does, plus the join's copy and add.

Guarantees: ``d = 0`` changes nothing (the graph is returned untouched); every new wait follows its submit and
precedes the first use of its result; the runtime runs a split call's two parts back to back and the calls in
submission order, so when layer i+1's immediate wait returns, layer i's deferred part is already done.
Consecutive boundaries must have the same number of tokens (a decoder's layers do); a pair that does not is left
undeferred and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import fx

from ktorch.ops.deferred_slots import is_deferred_count, split_topk_slots  # noqa: F401  (split_topk_slots: re-exported)
from ktorch.passes.async_boundary import ASYNC_STAGE, Boundary, split_submit_op, wait_op
from ktorch.passes.partition import node_value, set_fake_value

DEFERRAL = "ktorch_deferral"  # node.meta key: "submit" / "wait" / "join"


@dataclass
class Deferral:
    """One deferred call: layer ``source``'s lowest-weighted slots, joined at boundary ``target``'s result."""

    source: Boundary
    target: Boundary
    submit: fx.Node  # the split submit of the source layer (also source.submit now)
    wait: fx.Node  # the wait of its deferred part, right after the target's wait
    join: fx.Node  # target result + deferred result
    site: int
    n_deferred: Optional[int]  # None: read at run time (n_deferred_experts="runtime")


def _call(graph: fx.Graph, target, args: tuple, kwargs: Optional[dict] = None, stage: str = "") -> fx.Node:
    node = graph.call_function(target, args, kwargs or {})
    node.meta[DEFERRAL] = stage
    return set_fake_value(node)


def _tokens(boundary: Boundary) -> Optional[int]:
    value = node_value(boundary.call.hidden)
    return value.shape[0] if isinstance(value, torch.Tensor) else None


def defer_experts(
    gm: fx.GraphModule,
    boundaries: list[Boundary],
    n_deferred,
    new_site: Callable[[], int],
    skipped: Optional[list] = None,
) -> list[Deferral]:
    """Defers the ``n_deferred`` lowest-weighted slots of every boundary but the last to the next boundary.

    ``boundaries``: the async boundaries of ``gm`` in graph order (one per MoE layer). ``n_deferred`` is capped at
    each layer's K; ``"runtime"`` builds every deferred call and reads the count at run time
    (``ktorch.compile.set_runtime_deferred_experts``), so one graph serves every d (its Deferral records carry
    ``n_deferred=None``). Pairs that cannot be deferred (token counts differ or are unknown) are left as they are
    and their reasons appended to ``skipped``. Returns the deferrals made, in graph order."""
    runtime = n_deferred == "runtime"
    if not is_deferred_count(n_deferred, runtime_ok=True):
        raise ValueError(f"defer_experts: n_deferred must be an int >= 0 or 'runtime', got {n_deferred!r}")
    if n_deferred == 0 or len(boundaries) < 2:
        return []
    graph = gm.graph
    done: list[Deferral] = []
    for source, target in zip(boundaries, boundaries[1:]):
        t_source, t_target = _tokens(source), _tokens(target)
        if t_source is None or t_source != t_target:
            if skipped is not None:
                skipped.append(f"layer {source.layer} -> {target.layer}: token counts {t_source} and {t_target}")
            continue
        hidden, topk_ids, topk_weights, layer, site = source.submit.args
        k = node_value(topk_ids).shape[-1]
        d = None if runtime else min(n_deferred, k)
        deferred_site = new_site()
        with graph.inserting_before(source.submit):
            submit = _call(graph, split_submit_op(),
                           (hidden, topk_ids, topk_weights, layer, site, deferred_site, -1 if d is None else d), None,
                           "submit")
        source.submit.replace_all_uses_with(submit)
        for key in (ASYNC_STAGE, "stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in source.submit.meta:
                submit.meta[key] = source.submit.meta[key]
        graph.erase_node(source.submit)
        source.submit = submit
        with graph.inserting_after(target.wait):
            wait = _call(graph, wait_op(), (submit, hidden, layer, deferred_site, []), None, "wait")
        with graph.inserting_after(wait):
            join = _call(graph, torch.add, (target.wait, wait), None, "join")
        target.wait.replace_all_uses_with(join, delete_user_cb=lambda user: user is not join)
        wait.meta[ASYNC_STAGE] = "wait"
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
            if key in submit.meta:
                wait.meta[key] = submit.meta[key]
        done.append(Deferral(source, target, submit, wait, join, deferred_site, d))
    graph.lint()
    gm.recompile()
    return done
