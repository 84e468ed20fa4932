"""The ``"ktorch"`` torch.compile backend: the stages a Dynamo graph goes through.

    Dynamo FX graph (one kt.fused_moe node per MoE layer, packed weights as CPU graph inputs)
      1. partition       passes/partition.py       which nodes are CPU experts, which are GPU work
      2. async boundary  passes/async_boundary.py  submit/wait per experts call, independent work between
      2c. deferral       passes/deferral.py        (n_deferred_experts > 0) the lowest-weighted slots of layer i
                                                   run second in the same CPU call, waited for at layer i+1
      3. weights out     here                      the packed weights go to the experts runtime by layer id;
                                                   their graph inputs are dropped (the graph is device-only)
      4. GPU segments    Inductor (compile_fx)     everything else, with CUDA graphs when asked
    -> a callable taking Dynamo's arguments

Registered under the ``torch_dynamo_backends`` entry point (pyproject.toml), so ``backend="ktorch"`` works
without importing ktorch first.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import fx

from ktorch.compile.experts_runtime import RUNTIME
from ktorch.compile.options import BackendOptions
from ktorch.passes.async_boundary import Boundary, insert_async_boundaries, overlap_independent_work
from ktorch.passes.deferral import defer_experts
from ktorch.passes.partition import ExpertsCall, mark_partition, node_device

log = logging.getLogger(__name__)


@dataclass
class CompileReport:
    """What the backend did with one graph (the last few are kept in ``REPORTS``)."""

    options: BackendOptions
    experts_calls: int = 0
    async_calls: int = 0
    skipped: list = field(default_factory=list)  # reasons for calls left blocking
    overlapped_nodes: list = field(default_factory=list)  # per boundary, how many nodes moved between submit/wait
    deferrals: list = field(default_factory=list)  # passes/deferral.py Deferral per deferred layer
    deferral_skipped: list = field(default_factory=list)  # reasons for layer pairs left undeferred
    devices: set = field(default_factory=set)
    static_inputs_marked: list = field(default_factory=list)  # mutated inputs marked static for CUDA graphs
    cuda_graphs: bool = False
    graph: Optional[fx.GraphModule] = None  # the graph handed to Inductor (or run as is)


REPORTS: collections.deque = collections.deque(maxlen=16)


def _weights_of(call: ExpertsCall, inputs_by_node: dict, gm: fx.GraphModule) -> list:
    values = []
    for w in call.weights:
        if w is None:
            values.append(None)
        elif w.op == "placeholder":
            values.append(inputs_by_node[w])
        elif w.op == "get_attr":
            obj = gm
            for part in str(w.target).split("."):
                obj = getattr(obj, part)
            values.append(obj)
        else:
            raise RuntimeError(f"ktorch backend: packed weights of {call.node} come from {w.op} {w.target}, not an input")
    return values


def _drop_unused_inputs(gm: fx.GraphModule, candidates: set) -> list[int]:
    """Erases the placeholders in ``candidates`` that nothing uses; returns the indices of the others."""
    keep = []
    for i, node in enumerate([n for n in gm.graph.nodes if n.op == "placeholder"]):
        if node in candidates and not node.users:
            gm.graph.erase_node(node)
        else:
            keep.append(i)
    gm.graph.lint()
    gm.recompile()
    return keep


def _graph_devices(gm: fx.GraphModule) -> set:
    devices = set()
    for node in gm.graph.nodes:
        device = node_device(node, gm)
        if device is not None:
            devices.add(device.type)
    return devices


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy to rewrite: Dynamo reads the graph it handed over (its inputs) after the backend returns.

    Dynamo's metadata travels with it (the module's ``meta`` and ``_param_name_to_source``, each placeholder's
    ``_dynamo_source``): AOTAutograd reads them to tell Inductor which inputs are static (parameters, buffers,
    ``mark_static_address`` tensors), and CUDA graphs copy every input that is not static on every replay."""
    graph = fx.Graph()
    val_map: dict = {}
    output = graph.graph_copy(gm.graph, val_map)
    graph.output(output)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    for old, new in val_map.items():
        if old.op == "placeholder" and hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copy


# Ops through which a mutation of the result mutates the input (views).
_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "narrow", "select", "unsqueeze", "squeeze", "expand",
                 "__getitem__", "as_strided", "unflatten", "flatten", "view_as", "t", "diagonal", "unfold"}


def _mark_mutated_inputs_static(gm: fx.GraphModule) -> list:
    """Marks the graph inputs that the graph mutates in place (a static KV cache: keys, values, its length
    counter) as static addresses for CUDA graphs, as ``torch._dynamo.mark_static_address`` would have.

    transformers marks its StaticCache tensors itself, but only when the cache is filled outside a compiled
    region (and some versions leave the length counter out); Inductor's CUDA graphs skip a graph that mutates
    an input which is not static. The cache's tensors keep their addresses for the cache's life; a new cache
    makes the CUDA graphs re-record. Returns the placeholders marked."""
    import operator

    def root(node):
        while isinstance(node, fx.Node):
            if node.op == "placeholder":
                return node
            view = (node.op == "call_method" and node.target in _VIEW_METHODS) or (
                node.op == "call_function" and node.target is operator.getitem)
            if not view or not node.args:
                return None
            node = node.args[0]
        return None

    marked = []
    for node in gm.graph.nodes:
        name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
        inplace = node.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__")
        if not (inplace or (node.op == "call_function" and node.target is operator.setitem)) or not node.args:
            continue
        ph = root(node.args[0])
        if ph is None or ph in marked:
            continue
        tensor_dict = dict(ph.meta.get("tensor_dict", {}))
        if not tensor_dict.get("_dynamo_static_input_type"):
            tensor_dict["_dynamo_static_input_type"] = "unguarded"
            ph.meta["tensor_dict"] = tensor_dict
            marked.append(ph)
    return marked


def compile_graph(gm: fx.GraphModule, example_inputs: list, opts: BackendOptions) -> tuple[Callable, CompileReport]:
    """Runs the stages on a copy of ``gm``; returns (callable taking ``gm``'s arguments, report)."""
    report = CompileReport(options=opts)
    gm = _copy_graph_module(gm)
    calls = mark_partition(gm)
    report.experts_calls = len(calls)
    report.skipped = [c.reason for c in calls if not c.async_ok]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs_by_node = dict(zip(placeholders, example_inputs))
    weight_inputs: set = set()
    if opts.async_experts:
        def layer_id(call: ExpertsCall) -> int:
            weight_inputs.update(w for w in call.weights if w is not None and w.op == "placeholder")
            w13, s13, w2, s2, b13, b2 = _weights_of(call, inputs_by_node, gm)
            return RUNTIME.register_layer(w13, s13, w2, s2, call.activation, b13, b2)

        boundaries: list[Boundary] = insert_async_boundaries(gm, calls, layer_id, RUNTIME.new_site)
        report.async_calls = len(boundaries)
        if opts.overlap:
            report.overlapped_nodes = [len(overlap_independent_work(gm, b)) for b in boundaries]
        if opts.n_deferred_experts:
            report.deferrals = defer_experts(gm, boundaries, opts.n_deferred_experts, RUNTIME.new_site,
                                             report.deferral_skipped)
    keep = _drop_unused_inputs(gm, weight_inputs)
    inputs = [example_inputs[i] for i in keep]
    report.devices = _graph_devices(gm)
    report.cuda_graphs = opts.cuda_graphs and report.devices <= {"cuda"} and "cuda" in report.devices
    if opts.cuda_graphs and not report.cuda_graphs:
        log.info("ktorch backend: CUDA graphs off for a graph on %s", sorted(report.devices))
    if report.cuda_graphs:
        report.static_inputs_marked = [str(n.target) for n in _mark_mutated_inputs_static(gm)]
    report.graph = gm
    if opts.inductor:
        from torch._inductor.compile_fx import compile_fx

        patches = {"triton.cudagraphs": report.cuda_graphs}
        if report.async_calls:
            # Both reorderings sink a node towards its only user: they would move each submit down to its wait,
            # after the independent work the async-boundary pass put between them. Keep the graph's order.
            import torch._inductor.config as inductor_config

            for key in ("reorder_for_locality", "reorder_for_peak_memory"):
                if hasattr(inductor_config, key):
                    patches[key] = False
        patches.update(opts.inductor_config)
        compiled = compile_fx(gm, inputs, config_patches=patches)
    else:
        compiled = gm
    if len(keep) == len(example_inputs):
        return compiled, report

    def run(*args):
        return compiled(*[args[i] for i in keep])

    return run, report


def ktorch_backend(gm: fx.GraphModule, example_inputs: list, mode: Optional[str] = None,
                   options: Optional[dict] = None) -> Callable:
    """``torch.compile(model, backend="ktorch", mode=None, options={...})``; options: see BackendOptions."""
    opts = BackendOptions.parse(mode, options)
    compiled, report = compile_graph(gm, example_inputs, opts)
    REPORTS.append(report)
    return compiled
