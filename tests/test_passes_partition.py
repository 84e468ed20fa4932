"""passes/partition.py on hand-built FX graphs: which kt.fused_moe nodes are CPU experts, and their hops.

Graphs are traced from small functions and annotated by FakeTensorProp, with fake CUDA tensors standing for the
GPU side (no GPU is needed to build them).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import ktorch  # noqa: F401  (loads torch.ops.kt)
from ktorch.passes.partition import CPU_EXPERTS, GPU, PLACEMENT, find_cpu_experts, is_device_hop, mark_partition

T, H, I, E, K = 3, 64, 32, 4, 2


def annotate(fn, devices: dict, weights_device="cpu") -> fx.GraphModule:
    """symbolic_trace(fn), with meta["val"] from fake inputs: x/ids/w on ``devices``' devices, packed weights
    [E, 2I/16, H/2, 16, 2] / [E, H/16, I/2, 16, 2] bf16 on ``weights_device``, a shared weight [I, H] with x."""
    gm = fx.symbolic_trace(fn)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        inputs = dict(
            x=torch.empty(T, H, dtype=torch.bfloat16, device=devices.get("x", "cpu")),
            ids=torch.empty(T, K, dtype=torch.int64, device=devices.get("ids", devices.get("x", "cpu"))),
            w=torch.empty(T, K, dtype=torch.float32, device=devices.get("w", devices.get("x", "cpu"))),
            w13=torch.empty(E, 2 * I // 16, H // 2, 16, 2, dtype=torch.bfloat16, device=weights_device),
            w2=torch.empty(E, H // 16, I // 2, 16, 2, dtype=torch.bfloat16, device=weights_device),
            shared=torch.empty(I, H, dtype=torch.bfloat16, device=devices.get("x", "cpu")),
        )
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    FakeTensorProp(gm, mode).propagate(*[inputs[n] for n in names])
    return gm


CUDA = torch.device("cuda", 0)


def to_cuda(t):
    # What Dynamo records for .to(device) in AOT form; Tensor.to("cuda") refuses fake tensors without a CUDA build.
    return torch.ops.aten._to_copy.default(t, device=CUDA)


def gpu_layer(x, ids, w, w13, w2, shared):
    out = torch.ops.kt.fused_moe(x.to("cpu"), ids.to("cpu"), w.to("cpu"), w13, None, w2, None, "silu")
    return to_cuda(out) + F.linear(F.silu(F.linear(x, shared)), shared.t())


def cpu_layer(x, ids, w, w13, w2, shared):
    out = torch.ops.kt.fused_moe.default(x, ids, w, w13, None, w2, None, "gelu")
    return out + F.linear(x, shared).sum()


def nodes(gm, op=None, target=None):
    return [n for n in gm.graph.nodes if (op is None or n.op == op) and (target is None or n.target == target)]


def test_gpu_graph_finds_call_hops_and_copy_back():
    gm = annotate(gpu_layer, {"x": "cuda"})
    (call,) = find_cpu_experts(gm)
    assert call.node.target is torch.ops.kt.fused_moe
    assert [call.hidden.name, call.topk_ids.name, call.topk_weights.name] == ["x", "ids", "w"]
    assert call.device == torch.device("cuda", 0)
    assert len(call.hops_in) == 3 and all(h.target == "to" for h in call.hops_in)
    assert call.result.target is torch.ops.aten._to_copy.default and call.result.args[0] is call.node
    assert call.async_ok and call.activation == "silu"
    assert [w.name if w is not None else None for w in call.weights] == ["w13", None, "w2", None, None, None]


def test_cpu_only_graph_has_no_hops():
    gm = annotate(cpu_layer, {})
    (call,) = find_cpu_experts(gm)
    assert call.node.target is torch.ops.kt.fused_moe.default
    assert call.hops_in == [] and call.result is call.node and call.async_ok
    assert call.device == torch.device("cpu") and call.activation == "gelu"


def test_experts_with_weights_off_the_cpu_are_not_cpu_experts():
    gm = annotate(cpu_layer, {"x": "cuda"}, weights_device="cuda")
    assert find_cpu_experts(gm) == []


def test_inputs_from_several_devices_are_left_blocking():
    gm = annotate(gpu_layer, {"x": "cuda", "ids": "cpu"})
    (call,) = find_cpu_experts(gm)
    assert not call.async_ok and "several devices" in call.reason


def test_result_used_on_the_cpu_is_left_blocking():
    def layer(x, ids, w, w13, w2, shared):
        out = torch.ops.kt.fused_moe(x.to("cpu"), ids.to("cpu"), w.to("cpu"), w13, None, w2, None, "silu")
        return to_cuda(out), out.sum()

    (call,) = find_cpu_experts(annotate(layer, {"x": "cuda"}))
    assert not call.async_ok and "used other than" in call.reason


def test_mark_partition_tags_every_compute_node():
    gm = annotate(gpu_layer, {"x": "cuda"})
    mark_partition(gm)
    compute = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert {n.meta[PLACEMENT] for n in compute} == {CPU_EXPERTS, GPU}
    assert [n for n in compute if n.meta[PLACEMENT] == CPU_EXPERTS] == nodes(gm, target=torch.ops.kt.fused_moe)


@pytest.mark.parametrize("method,arg,hop", [("to", "cpu", True), ("cpu", None, True), ("to", torch.float32, False)])
def test_is_device_hop(method, arg, hop):
    def f(x):
        return getattr(x, method)(*([] if arg is None else [arg]))

    gm = fx.symbolic_trace(f)
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(2, 2, dtype=torch.bfloat16, device="cuda")
    FakeTensorProp(gm, mode).propagate(x)
    (node,) = nodes(gm, op="call_method")
    assert is_device_hop(node, gm) is hop
