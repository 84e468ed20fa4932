"""One LoRA fine-tuning step of an MoE model whose routed experts stay in host memory: ktorch against transformers +
accelerate offloading the experts with ``device_map``.

Variants (each runs in its own process, one after the other, so that the host memory of one is free for the next):
  ktorch       experts packed in host memory (``--experts-dtype``, int8 by default) and frozen, computed by kt.fused_moe_delta
               and kt.fused_moe_backward on the CPU; attention, routers, embeddings on the GPU; LoRA on attention
               (peft) and on the experts (ktorch.lora, peft's per-expert layout) ; ``ktorch.prepare(...,
               trainable=True)``: decoder layers checkpointed (``--checkpointing off``: not)
  ktorch_pageable  ktorch with the host<->GPU crossings as they were before session 33 (plain ``.to()`` copies:
               pageable and blocking; the gate/up deltas and their gradient in fp32): the A/B of
               ktorch/ops/host_transfer.py (pinned, non-blocking, deltas in hidden's dtype) in one run; the session's
               other changes (the down adapter's per-token product, no zero gradient for the op's unused outputs)
               are in both
  hf_offload   transformers + accelerate as a user offloads today: device_map puts every ``...mlp.experts`` on "cpu"
               (bf16) and accelerate's hooks copy them to the GPU for each forward; LoRA with peft on attention;
               gradient checkpointing of the decoder layers. Not on the experts by default: peft 0.21's
               ``target_parameters`` folds the adapter into the parameter under ``torch.autocast(W.device.type)``, and
               accelerate keeps offloaded parameters on the "meta" device, so every step fails with "unsupported
               scalarType" (device, 2026-11-26); ``--hf-expert-lora on`` tries it. The peer then trains less than
               ktorch does (no expert adapters): its step time is a lower bound for the same work

  ops          no model: one MoE layer of the shape (random packed experts, ``--experts-dtype``; ``--op-shape
               E,H,I,K`` for another size) and the three CPU calls a trained layer makes per step with expert LoRA
               and checkpointing (kt.fused_moe_delta in the forward, its outputs kept through the recompute,
               kt.fused_moe_backward reading the forward's saved pre-activations), beside kt.fused_moe (the fused
               inference kernels) and the backward of a layer without expert LoRA (``_plain``: no deltas, x W13^T
               recomputed); ms per call at ``--seq`` tokens side by side with each one's ratio to kt.fused_moe, and
               the CPU experts' share of a step these make for the shape's layers (``cpu_step_s``);
               ``--recompute-row``: also the expert-LoRA backward recomputing the pre-activations (the path before
               they were saved); ``--layout-row``: also the backward's two transposed products on one thread with
               the weights decoded transposed (now) and row-major (before); ``--routing-skew S``: Zipf-like routing
               (expert r of a random order drawn with weight (r + 1)^-S, top-k without repeats; 0: uniform), as
               trained models and random ones route (S = 1.5: the busiest experts take 1200-2040 of 2048 tokens,
               as a random 4-layer model of the shape did past its first layer); ``--profile``: one more call of each with KT_PROFILE on, whose phase lines
               (kt.fused_moe_backward's: decode, products, element-wise work, copies per worker) print after the
               table

A step = forward over ``--seq`` random tokens (batch 1, labels = inputs), backward, AdamW step, zero_grad, synced.
``--steps`` timed steps after ``--warmup`` warm-up steps; the table shows the median, the peak GPU memory of the
timed steps (torch.cuda.max_memory_allocated, reset after the warm-up) and the process's peak host memory. Shapes: benchmarks/bench_e2e.py's (random weights). Benchmarks never
assert. benchmarks/device_train.sh is the device run of issue 35 built on this file.

    python benchmarks/bench_train.py                              # qwen3-30b-a3b, int8, seq 2048, both variants
    python benchmarks/bench_train.py --shape tiny --device cpu    # a smoke run without a GPU
    python benchmarks/bench_train.py --variants ops               # the per-layer CPU calls alone
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ("ktorch", "hf_offload")  # the default; "ops" on request
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_ms(fn, reps: int) -> float:
    fn()  # warm-up: oneDNN primitives, allocations
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _layout_ms(dtype, n: int, H: int, I: int, reps: int, gen) -> dict:
    """``--layout-row``: ms of the backward's two transposed products on one thread (as each expert task runs
    them), n rows (the layer's mean pairs an expert), in the compute dtype, with the weight matrix stored as
    kt.fused_moe_backward decodes it (``transposed``: W^T contiguous, read as the view (W^T)^T, the reduction
    dimension contiguous) and as it decoded it before (``rows``: W row-major as stored, [H, I] and [2I, H]). Where
    ``rows`` is as fast, the transposed decode buys nothing there and costs only its own decode time (the profile
    line's experts.decode)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dy, dgu = (torch.randn(n, k, generator=gen).to(dtype) for k in (H, 2 * I))
        w2, w13 = torch.randn(H, I, generator=gen).to(dtype), torch.randn(2 * I, H, generator=gen).to(dtype)
        w2t, w13t = w2.t().contiguous(), w13.t().contiguous()
        g, dx = torch.empty(n, I, dtype=dtype), torch.empty(n, H, dtype=dtype)
        return dict(n=n, dY_W2_rows=_median_ms(lambda: torch.mm(dy, w2, out=g), reps),
                    dY_W2_transposed=_median_ms(lambda: torch.mm(dy, w2t.t(), out=g), reps),
                    dgu_W13_rows=_median_ms(lambda: torch.mm(dgu, w13, out=dx), reps),
                    dgu_W13_transposed=_median_ms(lambda: torch.mm(dgu, w13t.t(), out=dx), reps))
    finally:
        torch.set_num_threads(threads)


def run_ops(args) -> dict:
    """The CPU experts' calls of one trained layer at ``args.seq`` tokens (see the module docstring, ``ops``)."""
    from bench_e2e import SHAPES, machine_info, random_packed_experts

    shape = SHAPES[args.shape]
    E = shape.get("num_experts", shape.get("n_routed_experts"))
    H, I, K = shape["hidden_size"], shape["moe_intermediate_size"], shape["num_experts_per_tok"]
    if args.op_shape:  # a smaller layer than the shape's (e.g. one a 2-core machine runs in seconds)
        E, H, I, K = (int(v) for v in args.op_shape.split(","))
    layers = args.layers or shape["num_hidden_layers"]
    gen = torch.Generator().manual_seed(0)
    packed = random_packed_experts(E, H, I, args.experts_dtype, gen)
    T = args.seq
    dtype = getattr(torch, args.op_dtype)
    x = torch.randn(T, H, generator=gen).to(dtype)
    if args.routing_skew > 0:  # Gumbel top-k over Zipf-like logits: K distinct experts a token, skewed over experts
        logits = -args.routing_skew * torch.log(torch.arange(1, E + 1, dtype=torch.float32))[torch.randperm(E, generator=gen)]
        gumbel = -torch.log(-torch.log(torch.rand(T, E, generator=gen).clamp(min=1e-12)))
        ids = (logits + gumbel).topk(K, dim=1).indices.to(torch.int32)
    else:
        ids = torch.rand(T, E, generator=gen).argsort(dim=1)[:, :K].to(torch.int32)
    counts = torch.bincount(ids.flatten().long(), minlength=E).sort(descending=True).values
    w = torch.softmax(torch.randn(T, K, generator=gen), -1)
    delta = torch.randn(T, K, 2 * I, generator=gen) * 0.01
    dy = torch.randn(T, H, generator=gen).to(dtype)
    dh = torch.randn(T, K, I, generator=gen).to(dtype)
    p = packed.tensors()
    gate_up = torch.ops.kt.fused_moe_delta(x, ids, w, *p, delta, "silu")[2]  # the pre-activations autograd saves
    ms = dict(
        fused_moe=_median_ms(lambda: torch.ops.kt.fused_moe(x, ids, w, *p, "silu"), args.op_reps),
        fused_moe_delta=_median_ms(lambda: torch.ops.kt.fused_moe_delta(x, ids, w, *p, delta, "silu"), args.op_reps),
        # what kt.fused_moe_delta's autograd runs: the forward's pre-activations read, not recomputed
        fused_moe_backward=_median_ms(
            lambda: torch.ops.kt.fused_moe_backward(dy, x, ids, w, *p, "silu", delta, dh, None, None, gate_up),
            args.op_reps),
        # the backward of a layer without expert adapters (kt.fused_moe's autograd: no deltas, no d h, recomputed)
        fused_moe_backward_plain=_median_ms(lambda: torch.ops.kt.fused_moe_backward(dy, x, ids, w, *p, "silu"),
                                            args.op_reps),
    )
    if args.recompute_row:  # the same backward recomputing x W13^T (what the expert-LoRA step ran before)
        ms["fused_moe_backward_recompute"] = _median_ms(
            lambda: torch.ops.kt.fused_moe_backward(dy, x, ids, w, *p, "silu", delta, dh), args.op_reps)
    layout_ms = None
    if args.layout_row:  # the backward's two transposed products on one dense expert, both weight layouts
        layout_ms = _layout_ms(dtype, max(1, T * K // E), H, I, args.op_reps, gen)
    if args.profile:  # one profiled call of each (KT_PROFILE's lines go to stderr; main() prints them)
        from ktorch import config

        config.set_profile(True)
        try:
            torch.ops.kt.fused_moe(x, ids, w, *p, "silu")
            torch.ops.kt.fused_moe_delta(x, ids, w, *p, delta, "silu")
            torch.ops.kt.fused_moe_backward(dy, x, ids, w, *p, "silu", delta, dh, None, None, gate_up)
            if args.recompute_row:
                torch.ops.kt.fused_moe_backward(dy, x, ids, w, *p, "silu", delta, dh)
        finally:
            config.set_profile(False)
    return dict(variant="ops", shape=args.shape, layers=layers, seq=T, experts_dtype=args.experts_dtype,
                dims=dict(E=E, H=H, I=I, K=K), op_dtype=args.op_dtype, routing_skew=args.routing_skew,
                distinct_experts=int((counts > 0).sum()), busiest_rows=counts[:4].tolist(),
                ms={k: round(v, 2) for k, v in ms.items()}, layout_ms=layout_ms,
                # per step with expert LoRA: forward and backward for every layer (the checkpoint's recompute keeps
                # the forward's outputs: ktorch.prepare's selective checkpointing)
                cpu_step_s=layers * (ms["fused_moe_delta"] + ms["fused_moe_backward"]) / 1e3,
                # the same without expert LoRA (the fused kernels forward, the plain backward)
                cpu_step_s_no_expert_lora=layers * (ms["fused_moe"] + ms["fused_moe_backward_plain"]) / 1e3,
                machine=machine_info("cpu"))


def run_variant(args) -> dict:
    if args.variant == "ops":
        return run_ops(args)
    from peft import LoraConfig, get_peft_model

    import ktorch
    from bench_e2e import build_model, machine_info, offload_device_map

    device = args.device
    t0 = time.perf_counter()
    if args.variant in ("ktorch", "ktorch_pageable"):
        if args.variant == "ktorch_pageable":
            _pageable_crossings()
        model, _ = build_model(args.shape, "eager", args.device, args.experts_dtype, layers=args.layers)
        ktorch.prepare(model, device=args.device, trainable=True, gradient_checkpointing=args.checkpointing == "on")
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=ATTENTION))
        ktorch.lora.add_expert_lora(model, r=args.rank, lora_alpha=2 * args.rank)
    else:  # built on the CPU, adapters added, then dispatched (peft wraps real parameters, not offloaded ones)
        model, _ = build_model(args.shape, "hf_offload", "cpu", "bf16", layers=args.layers)
        model.config.use_cache = False
        if args.checkpointing == "on":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if args.hf_expert_lora == "on" else None
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=ATTENTION,
                                                 target_parameters=experts))
        if device == "cuda":
            from accelerate import dispatch_model

            inner = model.base_model.model
            dispatch_model(inner, device_map=offload_device_map(inner), main_device=torch.device("cuda", 0))
    build_s = time.perf_counter() - t0
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        x = torch.randint(0, vocab, (1, args.seq), generator=gen).to(device)
        _sync(device)
        t = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - t

    for _ in range(args.warmup):  # allocations, oneDNN primitives, accelerate's first copies
        step()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [step() for _ in range(args.steps)]
    profile = _profile_step(model, opt, vocab, gen, args) if args.profile else None
    kt = args.variant.startswith("ktorch")
    result = dict(variant=args.variant, expert_lora=kt or args.hf_expert_lora == "on",
                  shape=args.shape, layers=model.config.num_hidden_layers, seq=args.seq, rank=args.rank,
                  experts_dtype=args.experts_dtype if kt else "bf16",
                  checkpointing=args.checkpointing,
                  step_s=statistics.median(times), steps=[round(t, 3) for t in times], warmup=args.warmup,
                  build_s=round(build_s, 1),
                  trainable_params=sum(p.numel() for p in params),
                  gpu_peak_gib=(torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None),
                  host_peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  machine=machine_info(device))
    if profile is not None:
        result["profile"] = profile
    return result


def _pageable_crossings() -> None:
    """ktorch_pageable: this process's crossings as before ktorch/ops/host_transfer.py: plain ``.to()`` copies both
    ways (pageable, blocking) and the gate/up deltas sent in fp32 (their gradient then comes back in fp32)."""
    import ktorch.lora
    import ktorch.ops.host_transfer as ht

    ht.host_copies = lambda tensors: [t.to("cpu") for t in tensors]
    ht.device_copy = lambda t, device: t.to(device)
    to_host = ktorch.lora.to_host

    def fp32_deltas(*tensors):  # expert_lora_forward's crossing: hidden, ids, weights[, deltas]
        return to_host(*tensors[:3], *(t.float() for t in tensors[3:]))

    ktorch.lora.to_host = fp32_deltas


def _union(spans: list) -> list:
    """Sorted, merged (start, end) intervals covering ``spans``."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(spans: list) -> float:
    return sum(b - a for a, b in spans)


def _profile_step(model, opt, vocab, gen, args) -> dict:
    """One more step under torch.profiler (CPU + CUDA activities), its phases marked with record_function: where the
    step's time goes. Returns the phases' wall ms (synced), the CPU experts' op time in each (kt.fused_moe_delta in
    the forward; in the backward, kt.fused_moe_delta is the checkpoint's recompute and kt.fused_moe_backward the
    experts' backward), the host<->device copies (bytes and GPU time, from the trace's memcpy events), the GPU
    kernels' total time, and the top ops by self CPU time (key_averages). Not timed with the other steps: the
    profiler adds its own overhead per op."""
    import os
    import tempfile

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    device = args.device
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    x = torch.randint(0, vocab, (1, args.seq), generator=gen).to(device)
    wall = {}
    _sync(device)
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        with record_function("phase:forward"):
            loss = model(input_ids=x, labels=x).loss
            _sync(device)
        wall["forward"], t = (time.perf_counter() - t) * 1e3, time.perf_counter()
        with record_function("phase:backward"):  # with checkpointing: the recompute happens in here
            loss.backward()
            _sync(device)
        wall["backward"], t = (time.perf_counter() - t) * 1e3, time.perf_counter()
        with record_function("phase:optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(device)
        wall["optimizer"] = (time.perf_counter() - t) * 1e3
    events = prof.events()
    phases = {e.name[len("phase:"):]: (e.time_range.start, e.time_range.end) for e in events
              if e.name.startswith("phase:") and e.device_type == DeviceType.CPU}

    def phase_of(e):
        return next((k for k, (a, b) in phases.items() if a <= e.time_range.start <= b), None)

    cpu_ops = {}  # (phase, op) -> [calls, ms]: the CPU experts' ops (their wall on the calling thread)
    for e in events:
        if e.name.startswith("kt::") and e.device_type == DeviceType.CPU:
            k = f"{phase_of(e)}:{e.name}"
            c = cpu_ops.setdefault(k, [0, 0.0])
            c[0] += 1
            c[1] += e.time_range.elapsed_us() / 1e3
    copies, gpu_kernel_ms, kernels, spans = {}, 0.0, {}, {"kernel": [], "copy": []}
    if device == "cuda":  # memcpy events carry their bytes in the trace's args
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        for ev in trace.get("traceEvents", []):
            cat = ev.get("cat", "")
            if cat == "gpu_memcpy":
                c = copies.setdefault(ev["name"], dict(calls=0, bytes=0, ms=0.0))
                c["calls"] += 1
                c["bytes"] += int(ev.get("args", {}).get("bytes", 0))
                c["ms"] += ev.get("dur", 0) / 1e3
                if "HtoD" in ev["name"]:
                    spans["copy"].append((ev["ts"], ev["ts"] + ev.get("dur", 0)))
            elif cat == "kernel":
                gpu_kernel_ms += ev.get("dur", 0) / 1e3
                k = kernels.setdefault(ev["name"][:70], [0, 0.0])
                k[0] += 1
                k[1] += ev.get("dur", 0) / 1e3
                spans["kernel"].append((ev["ts"], ev["ts"] + ev.get("dur", 0)))
    # host-side copy ops (a pageable .to(cpu)/.to(cuda) blocks the thread for its whole transfer)
    avg = prof.key_averages()
    host_copy = {a.key: dict(calls=a.count, ms=a.cpu_time_total / 1e3) for a in avg
                 if a.key in ("aten::_to_copy", "aten::copy_", "aten::to")}
    top = sorted(avg, key=lambda a: a.self_cpu_time_total, reverse=True)[:15]
    busy = {k: _union(v) for k, v in spans.items()}  # us of the timeline with a kernel / a host-to-device copy
    both = _union([(max(a, c), min(b, d)) for a, b in busy["kernel"] for c, d in busy["copy"] if min(b, d) > max(a, c)])
    return dict(wall_ms={k: round(v, 1) for k, v in wall.items()},
                gpu_busy_ms={"kernels": round(_length(busy["kernel"]) / 1e3, 1),
                             "h2d copies": round(_length(busy["copy"]) / 1e3, 1),
                             "both at once": round(_length(both) / 1e3, 1)},
                top_kernels=[(k, n, round(ms, 1)) for k, (n, ms) in
                             sorted(kernels.items(), key=lambda kv: -kv[1][1])[:12]],
                cpu_experts_ms={k: [v[0], round(v[1], 1)] for k, v in sorted(cpu_ops.items())},
                memcpy={k: dict(calls=v["calls"], mb=round(v["bytes"] / 1e6, 1), ms=round(v["ms"], 1))
                        for k, v in copies.items()},
                host_copy_ops={k: dict(calls=v["calls"], ms=round(v["ms"], 1)) for k, v in host_copy.items()},
                gpu_kernel_ms=round(gpu_kernel_ms, 1),
                top_self_cpu=[(a.key, a.count, round(a.self_cpu_time_total / 1e3, 1),
                               round(getattr(a, "self_device_time_total", 0.0) / 1e3, 1)) for a in top])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape has")
    p.add_argument("--experts-dtype", default="int8", choices=("bf16", "int8", "int4"))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (attention and experts)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (at least 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    p.add_argument("--checkpointing", default="on", choices=("on", "off"),
                   help="gradient checkpointing of the decoder layers (off: no recompute, every layer's activations "
                   "kept)")
    p.add_argument("--op-reps", type=int, default=3, help="ops: timed calls of each op (median)")
    p.add_argument("--op-shape", metavar="E,H,I,K",
                   help="ops: the layer's experts, hidden size, intermediate size and top-k instead of the shape's")
    p.add_argument("--op-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="ops: hidden's dtype (float32: the decoded-expert forward and fp32 products, e.g. where the "
                   "CPU has no bf16 matmul)")
    p.add_argument("--routing-skew", type=float, default=0.0, metavar="S",
                   help="ops: Zipf-like routing, expert weights (rank + 1)^-S (0: uniform); 1.5 is as skewed as a "
                   "random model of the shape routes")
    p.add_argument("--recompute-row", action="store_true",
                   help="ops: also time the expert-LoRA backward recomputing the pre-activations instead of reading "
                   "the forward's (fused_moe_backward_recompute)")
    p.add_argument("--layout-row", action="store_true",
                   help="ops: also time the backward's two transposed products (dY W2, [dg|du] W13) on one thread "
                   "with the weights decoded transposed (as kt.fused_moe_backward decodes them) and row-major (as "
                   "it decoded them before): what decides the decode's layout on a CPU")
    p.add_argument("--profile", action="store_true",
                   help="ops: one more call of each op with KT_PROFILE on; their phase lines print after the table. "
                   "ktorch / hf_offload: one more step under torch.profiler after the timed ones; its breakdown "
                   "(phases' wall, the CPU experts' ops per phase, host<->GPU copies in bytes and time, GPU kernel "
                   "time, top ops by self time) prints under the variant's row")
    p.add_argument("--jsonl", help="append one JSON line per variant to this file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--hf-expert-lora", default="off", choices=("on", "off"),
                   help="hf_offload: peft LoRA on the experts' parameters too (target_parameters), as ktorch has; "
                   "off by default: peft 0.21 cannot fold adapters into accelerate's offloaded (meta) parameters")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one variant in this process (the parent's children)
    p.add_argument("--json", action="store_true", help="also print one JSON line per variant")
    return p.parse_args(argv)


def _print_profile(variant: str, pr: dict) -> None:
    w = pr["wall_ms"]
    print(f"  {variant} profiled step (one, after the timed ones; profiler overhead included), ms: "
          + " | ".join(f"{k} {v}" for k, v in w.items()) + f" | total {sum(w.values()):.1f}")
    if pr["cpu_experts_ms"]:
        print("    CPU experts (phase:op calls ms): "
              + " | ".join(f"{k} {c} {ms}" for k, (c, ms) in pr["cpu_experts_ms"].items())
              + f" | sum {sum(ms for _, ms in pr['cpu_experts_ms'].values()):.1f}")
    if pr["memcpy"]:
        print("    host<->GPU copies (GPU side): "
              + " | ".join(f"{k} {v['calls']} calls {v['mb']} MB {v['ms']} ms" for k, v in pr["memcpy"].items()))
    print("    host copy ops (CPU wall, incl. children): "
          + " | ".join(f"{k} {v['calls']} calls {v['ms']} ms" for k, v in pr["host_copy_ops"].items())
          + f"; GPU kernels {pr['gpu_kernel_ms']} ms")
    if pr.get("gpu_busy_ms"):
        print("    GPU timeline busy, ms: " + " | ".join(f"{k} {v}" for k, v in pr["gpu_busy_ms"].items()))
        print("    top GPU kernels (name, calls, ms): " + " | ".join(f"{k} {n} {ms}" for k, n, ms in pr["top_kernels"]))
    print("    top ops by self CPU time (op, calls, self CPU ms, self GPU ms):")
    for key, n, cpu_ms, gpu_ms in pr["top_self_cpu"]:
        print(f"      {key[:60]:<60} {n:>7} {cpu_ms:>10} {gpu_ms:>10}")


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.steps < 1:
        raise SystemExit("bench_train: --steps must be at least 1")
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return
    rows, profiles = [], []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", variant] + [a for a in (argv or sys.argv[1:])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        profiles += [l for l in proc.stderr.splitlines() if l.startswith("kt.fused_moe")]
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            rows.append(dict(variant=variant, error=" | ".join(tail)))
        else:
            rows.append(json.loads(line[len("RESULT "):]))
    machine = next((r["machine"] for r in rows if "machine" in r), {})
    print(f"machine: {machine}")
    print(f"shape {args.shape} (layers {args.layers or 'all'}), seq {args.seq}, LoRA rank {args.rank}, batch 1")
    print(f"{'variant':<15} {'experts':>8} {'expert LoRA':>12} {'step s':>9} {'GPU peak GiB':>13} {'host peak GiB':>14} "
          f"{'trainable':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<15} failed: {r['error']}")
            continue
        if r["variant"] == "ops":  # the calls side by side, each also as a multiple of the inference op's time
            ms = r["ms"]
            print(f"{'ops':<12} one layer ({', '.join(f'{k}={v}' for k, v in r['dims'].items())}), "
                  f"{r['experts_dtype']}, {r['op_dtype']} hidden, {r['seq']} tokens, routing skew {r['routing_skew']} "
                  f"({r['distinct_experts']} experts hit, busiest {r['busiest_rows']} pairs), ms a call: "
                  + " | ".join(f"{k} {v}" + (f" ({v / ms['fused_moe']:.2f}x fused_moe)" if k != "fused_moe" else "")
                               for k, v in ms.items()))
            print(f"{'':<12} CPU experts a step ({r['layers']} layers, forward + backward): "
                  f"{r['cpu_step_s']:.2f} s with expert LoRA, {r['cpu_step_s_no_expert_lora']:.2f} s without")
            if r.get("layout_ms"):
                lm = r["layout_ms"]
                print(f"{'':<12} backward products, one thread, n={lm['n']}, {r['op_dtype']}, ms: dY W2 "
                      f"{lm['dY_W2_transposed']:.3f} transposed (now) | {lm['dY_W2_rows']:.3f} rows (before); "
                      f"[dg|du] W13 {lm['dgu_W13_transposed']:.3f} transposed (now) | {lm['dgu_W13_rows']:.3f} rows "
                      f"(before)")
            continue
        gpu = f"{r['gpu_peak_gib']:.2f}" if r["gpu_peak_gib"] is not None else "-"
        print(f"{r['variant']:<15} {r['experts_dtype']:>8} {str(r['expert_lora']):>12} {r['step_s']:>9.3f} {gpu:>13} "
              f"{r['host_peak_gib']:>14.1f} "
              f"{r['trainable_params']:>12,}")
        if r.get("profile"):
            _print_profile(r["variant"], r["profile"])
    for line in profiles:
        print(line)
    ok = {r["variant"]: r for r in rows if "error" not in r}
    if "ktorch" in ok and "hf_offload" in ok:
        print(f"hf_offload / ktorch step time: {ok['hf_offload']['step_s'] / ok['ktorch']['step_s']:.2f}x")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
