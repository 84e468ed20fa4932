"""Common subexpressions of Inductor's post-grad graph: one node for each set of identical projections.

Inductor does not merge two ``aten.mm`` nodes of the same operands (its inference graphs get no CSE; AOTAutograd's
``fx_graph_cse`` runs in the training partitioner only). The decode step's fused q/k/v projection
(ktorch/integrations/fused_qkv.py) relies on it: each of the three projections computes ``x @ W_qkv^T`` of one
shared weight and slices its part, and this pass leaves one product of the three (one cuBLAS launch of 5,120
columns instead of three of 4,096, 512 and 512 on the Qwen3-30B-A3B shape).

``dedupe(graph)`` walks the graph in order and replaces every node whose target is one of ``OPS`` (pure,
deterministic: the same inputs give the same values) and whose arguments equal an earlier such node's (after the
earlier replacements) by that node. Nothing else moves. ``PASS`` is the ``CustomGraphPass`` that Inductor's config
takes (``post_grad_custom_pre_pass``); its ``uuid`` is this file's hash, so Inductor's on-disk cache stays valid
across runs and a change here recompiles.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

aten = torch.ops.aten
# pure views and products: equal arguments give equal values, and none mutates or reads a mutable state
OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.permute.default, aten.t.default,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.slice.Tensor, aten.squeeze.dim, aten.unsqueeze.default,
})


def _key(value: Any) -> Any:
    """A hashable form of a node's argument (nodes by identity, lists and dicts by content)."""
    if isinstance(value, torch.fx.Node):
        return ("node", id(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return ("torch", str(value))
    hash(value)  # ints, floats, bools, None, strings, SymInts' nodes are fx Nodes above
    return (type(value).__name__, value)


def dedupe(graph: torch.fx.Graph) -> int:
    """Merges identical nodes of ``OPS`` in place; returns how many were removed."""
    seen: dict = {}
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in OPS:
            continue
        try:
            key = (node.target, _key(node.args), _key(node.kwargs))
        except TypeError:  # an unhashable argument: leave the node alone
            continue
        first = seen.setdefault(key, node)
        if first is not node:
            node.replace_all_uses_with(first)
            graph.erase_node(node)
            removed += 1
    return removed


class _Dedupe(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        dedupe(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


PASS = _Dedupe()
