"""Partition: find the routed-expert calls that run on the CPU; everything else in the graph is GPU work.

Matches ``call_function`` nodes of ``torch.ops.kt.fused_moe`` (the packet, as Dynamo records it, or its
``.default`` overload, as AOT graphs do) whose packed weights ``w13`` are CPU tensors. Around each one it also
finds the device hops the transformers integration writes (ktorch/integrations/transformers_experts.py):
``.to("cpu")`` of the hidden states, ids and weights on the way in, ``.to(device)`` of the result on the way out.
A hop is any copy node (``to``, ``cpu``, ``cuda``, ``_to_copy``) that changes the device and nothing else.

Guarantees: the graph is not changed; each matched op node gets ``meta["ktorch_placement"] = "cpu_experts"``
and every other compute node ``"gpu"`` (which, on a CPU-only graph, means "the rest", run on the CPU). An op
whose inputs come from different devices, or whose CPU result is also used on the CPU, is reported with
``async_ok=False``: the async boundary leaves it as it is.

Devices are read from node metadata: ``meta["example_value"]`` (Dynamo) or ``meta["val"]`` (AOT,
FakeTensorProp); ``get_attr`` nodes from the module's attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import fx

PLACEMENT = "ktorch_placement"
CPU_EXPERTS = "cpu_experts"
GPU = "gpu"

_COPY_METHODS = {"to", "cpu", "cuda"}


def fused_moe_targets() -> tuple:
    return (torch.ops.kt.fused_moe, torch.ops.kt.fused_moe.default)


def node_value(node: fx.Node, gm: Optional[fx.GraphModule] = None):
    """The example (fake or real) value of ``node``, or None when the graph carries none."""
    for key in ("example_value", "val"):
        if key in node.meta:
            return node.meta[key]
    if node.op == "get_attr" and gm is not None:
        obj = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part, None)
        return obj
    return None


def set_fake_value(node: fx.Node, required: int = 0) -> fx.Node:
    """Sets ``node.meta["val"]`` (and ``example_value``) to the fake result of ``node.target`` on its inputs'
    example values, as Dynamo would have; leaves ``node`` as it is when no input carries a fake value or one of
    its first ``required`` positional inputs carries none. Returns ``node``."""
    from torch._subclasses.fake_tensor import FakeTensor

    def val(a):
        if isinstance(a, fx.Node):
            return node_value(a)
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a

    args, kwargs = val(node.args), {k: val(v) for k, v in node.kwargs.items()}
    fakes = [a for a in list(args) + list(kwargs.values()) if isinstance(a, FakeTensor)]
    if not fakes or any(a is None for a in args[:required]):
        return node
    with fakes[0].fake_mode:
        node.meta["val"] = node.meta["example_value"] = node.target(*args, **kwargs)
    return node


def node_device(node, gm: Optional[fx.GraphModule] = None) -> Optional[torch.device]:
    value = node_value(node, gm) if isinstance(node, fx.Node) else node
    return value.device if isinstance(value, torch.Tensor) else None


def is_device_hop(node: fx.Node, gm: Optional[fx.GraphModule] = None) -> bool:
    """A copy node whose output differs from its input in device only."""
    if node.op == "call_method":
        if node.target not in _COPY_METHODS:
            return False
    elif node.op == "call_function":
        if node.target not in (torch.Tensor.to, torch.ops.aten._to_copy.default, torch.ops.aten.to.device,
                               torch.ops.aten.to.dtype_layout):
            return False
    else:
        return False
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = node_value(node.args[0], gm), node_value(node, gm)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return src.device != out.device and src.dtype == out.dtype and src.shape == out.shape


@dataclass
class ExpertsCall:
    """One routed-experts call that runs on the CPU, and how the graph feeds and reads it."""

    node: fx.Node  # the kt.fused_moe node
    hidden: fx.Node  # [T, H] as the model produced it (before any hop to the CPU)
    topk_ids: fx.Node  # [T, K]
    topk_weights: fx.Node  # [T, K]
    weights: tuple  # (w13, w13_scales, w2, w2_scales, w13_bias, w2_bias): nodes, or None for absent scales/biases
    activation: str
    device: Optional[torch.device]  # where the model's hidden states live
    hops_in: list = field(default_factory=list)  # copy-to-CPU nodes feeding the op
    result: Optional[fx.Node] = None  # what the rest of the graph reads: the copy back, or the op itself
    async_ok: bool = True
    reason: str = ""


def _arg(node: fx.Node, index: int, name: str, default=None):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def _source(arg, gm) -> tuple:
    """(the value before a hop to the CPU, the hop node or None)."""
    if isinstance(arg, fx.Node) and is_device_hop(arg, gm) and node_device(arg, gm).type == "cpu":
        return arg.args[0], arg
    return arg, None


def find_cpu_experts(gm: fx.GraphModule) -> list[ExpertsCall]:
    """Every kt.fused_moe node of ``gm`` whose packed weights are on the CPU, in graph order."""
    calls = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in fused_moe_targets():
            continue
        w13 = _arg(node, 3, "w13")
        if node_device(w13, gm) is None or node_device(w13, gm).type != "cpu":
            continue
        weights = tuple(_arg(node, i, n) for i, n in enumerate(("w13", "w13_scales", "w2", "w2_scales"), start=3))
        weights += tuple(_arg(node, i, n) for i, n in enumerate(("w13_bias", "w2_bias"), start=8))
        sources = [_source(_arg(node, i, n), gm) for i, n in enumerate(("hidden", "topk_ids", "topk_weights"))]
        call = ExpertsCall(
            node=node,
            hidden=sources[0][0],
            topk_ids=sources[1][0],
            topk_weights=sources[2][0],
            weights=weights,
            activation=_arg(node, 7, "activation", "silu"),
            device=node_device(sources[0][0], gm),
            hops_in=[hop for _, hop in sources if hop is not None],
        )
        devices = {node_device(src, gm) for src, _ in sources}
        users = list(node.users)
        back = [u for u in users if is_device_hop(u, gm) and node_device(u, gm) == call.device]
        if len(devices) != 1 or call.device is None:
            call.async_ok, call.reason = False, f"inputs on several devices: {sorted(map(str, devices))}"
        elif call.device.type == "cpu":
            call.result = node
        elif len(back) == 1 and len(users) == 1:
            call.result = back[0]
        else:
            call.async_ok, call.reason = False, "the CPU result is used other than by one copy back to the device"
        calls.append(call)
    return calls


def mark_partition(gm: fx.GraphModule) -> list[ExpertsCall]:
    """``find_cpu_experts``, and tags every compute node with ``meta[PLACEMENT]``."""
    calls = find_cpu_experts(gm)
    experts = {c.node for c in calls}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            node.meta[PLACEMENT] = CPU_EXPERTS if node in experts else GPU
    return calls
