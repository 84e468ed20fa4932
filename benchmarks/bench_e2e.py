"""End to end: prefill and decode tok/s of transformers MoE models whose routed experts run on the CPU.

Shapes (random weights, bf16; built on the meta device, then filled fast):
  qwen3-30b-a3b     48 layers, 128 experts top-8, H=2048, I=768, vocab 151936
  deepseek-v2-lite  27 layers (first dense), 64 routed experts top-6 + 2 shared, H=2048, I=1408, MLA attention
  tiny              the tests' 2-layer Qwen3-MoE (a smoke run; works on a CPU-only machine)

Variants:
  hf_offload   transformers + accelerate as a user offloads today: device_map puts every `...mlp.experts` on "cpu",
               accelerate's hooks move those weights to the GPU for each forward (bf16 experts in CPU memory)
  eager        ktorch: packed experts on the CPU (kt.fused_moe), the rest on the GPU, eager forward
  compiled     torch.compile(backend="ktorch"): Inductor + async submit/wait, no CUDA graphs
  cuda_graphs  torch.compile(backend="ktorch", mode="reduce-overhead"): the same under CUDA graphs

Timing is a forward loop at batch 1 with a static KV cache (gpt-fast style): prefill = one forward over the
prompt (logits of the last token only); decode = 1-token forwards, the next token picked by argmax on the
device, one sync at the end. Warm-up calls (compiles, CUDA-graph capture) are not timed.

--stream-experts "off;auto;512:0.3,2048:0.45": prefill with a prefix of each layer's experts streamed to the GPU
(ktorch.set_stream_experts): one row per setting and ktorch variant ("auto" also prints what it measured); decode
never streams, so rows after the first time prefill only. A setting ending in "@serial" copies each layer's experts
when the GPU reaches the layer instead of a layer ahead (set_stream_experts(copy_ahead=False)), for an A/B.

--profile: records a few decode steps with torch.profiler, writes the chrome trace (with the CPU experts calls
added as a thread "ktorch-experts", timed by the experts runtime since the profiler does not see its worker
thread), and prints for one step the GPU busy time, the CPU experts busy time, their overlap, and the host
syncs of the launching thread.

The table and the machine (CPU model, cores, kernel level, torch/transformers versions, GPU) go to stdout;
--json appends one line per variant. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from contextlib import nullcontext

import torch
from torch import nn

import ktorch
import ktorch.compile
from ktorch.integrations import attach_packed_experts
from ktorch.ops.moe import PackedExperts
from ktorch.ops.streamed_experts import parse_stream_plan
from ktorch.placement import experts_modules

SHAPES = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}
VARIANTS = ("hf_offload", "eager", "compiled", "cuda_graphs")
INIT_STD = 0.02


# ---------------------------------------------------------------- the machine


def machine_info(device: str) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers

    info = dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                kernel=ktorch.cpu_features()["kernel"], torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version())
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    info["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KT_")}  # ktorch's settings
    return info


# ---------------------------------------------------------------- building a random model fast


def _random_block(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n,), dtype=torch.int8, generator=gen)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return (torch.randn(n, generator=gen) * INIT_STD).to(dtype)


def fill_random_(t: torch.Tensor, gen: torch.Generator, block_elems: int = (1 << 24) + 4099) -> torch.Tensor:
    """Fills ``t`` by tiling one random block (a length that divides no expert, so experts differ): real memory,
    real values, at copy speed instead of RNG speed."""
    flat = t.view(-1)
    block = _random_block(t.dtype, min(block_elems, flat.numel()), gen)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])
    return t


def random_packed_experts(E: int, H: int, I: int, fmt: str, gen: torch.Generator, group_size=None) -> PackedExperts:
    """Packed experts of the right shapes (taken from the pack ops' fake impls) with random contents whose
    dequantized values have std ~INIT_STD."""
    pack = {"bf16": lambda w, gu: (torch.ops.kt.pack_bf16(w, gate_up=gu), None),
            "int8": lambda w, gu: torch.ops.kt.pack_int8(w, gate_up=gu),
            "int4": lambda w, gu: torch.ops.kt.pack_int4(w, group_size=group_size or 128, gate_up=gu)}[fmt]
    code_std = {"bf16": None, "int8": 73.3, "int4": 4.6}[fmt]
    tensors = []
    for shape, gate_up in (((E, 2 * I, H), True), ((E, H, I), False)):
        meta_w, meta_s = pack(torch.empty(shape, dtype=torch.bfloat16, device="meta"), gate_up)
        w = fill_random_(torch.empty(meta_w.shape, dtype=meta_w.dtype), gen)
        s = None
        if meta_s is not None:
            s = torch.full(meta_s.shape, INIT_STD / code_std, dtype=torch.float32)
            s.mul_(torch.rand(meta_s.shape, generator=gen) + 0.5)
        tensors += [w, s]
    return PackedExperts(tensors[0], tensors[1], tensors[2], tensors[3], fmt, group_size if fmt == "int4" else None)


def _materialize(model: nn.Module, device: str, gen_device: torch.Generator) -> None:
    """Gives every meta parameter/buffer real random storage on ``device`` (norms 1, rotary tables recomputed)."""
    for name, module in list(model.named_modules()):
        if hasattr(module, "inv_freq") and module.inv_freq.device.type == "meta":
            fresh = type(module)(module.config).to(device)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], fresh)
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        for pname, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            if is_norm and p.dim() == 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, INIT_STD, generator=gen_device)
            module._parameters[pname] = nn.Parameter(t, requires_grad=False)
        for bname, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype, device=device)


def offload_device_map(model: nn.Module) -> dict:
    """The device map a user writes (or infer_auto_device_map gives) to keep the routed experts on the CPU: the
    largest modules holding no experts on GPU 0, each experts module on "cpu"."""
    experts = {name for name, _ in experts_modules(model)}
    device_map = {}

    def visit(module: nn.Module, path: str):
        if path in experts:
            device_map[path] = "cpu"
        elif path and not any(e.startswith(path + ".") for e in experts):
            device_map[path] = 0
        else:
            if next(module.parameters(recurse=False), None) is not None or next(module.buffers(recurse=False), None) is not None:
                raise ValueError(f"offload_device_map: {path or 'the model'} holds tensors beside its experts")
            for child_name, child in module.named_children():
                visit(child, f"{path}.{child_name}" if path else child_name)

    visit(model, "")
    return device_map


def build_model(shape: str, variant: str, device: str, experts_dtype: str, seed: int = 0, layers: int | None = None):
    """A random model of ``shape`` placed for ``variant``: (model, seconds spent building)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    kwargs = dict(SHAPES[shape])
    if layers:
        kwargs["num_hidden_layers"] = layers
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    gen_device = torch.Generator(device=device).manual_seed(seed)
    experts = experts_modules(model)
    if variant == "hf_offload":
        for _, m in experts:
            for pname in ("gate_up_proj", "down_proj"):
                p = getattr(m, pname)
                setattr(m, pname, nn.Parameter(fill_random_(torch.empty(p.shape, dtype=p.dtype), gen), requires_grad=False))
        _materialize(model, device, gen_device)
        if device == "cuda":
            from accelerate import dispatch_model

            dispatch_model(model, device_map=offload_device_map(model), main_device=torch.device("cuda", 0))
    else:
        for _, m in experts:
            E, I, H = m.num_experts, m.intermediate_dim, m.hidden_dim
            attach_packed_experts(m, random_packed_experts(E, H, I, experts_dtype, gen))
        _materialize(model, device, gen_device)
        ktorch.prepare(model, device=device)  # experts already packed: placement and experts implementation only
    gc.collect()
    return model, time.perf_counter() - t0


# ---------------------------------------------------------------- timing


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Runner:
    """The forward of one variant with a static cache: prefill(ids) and decode steps."""

    def __init__(self, model, variant: str, device: str, max_len: int, options: dict | None = None):
        from transformers import StaticCache

        self.model, self.variant, self.device = model, variant, device
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        if variant in ("compiled", "cuda_graphs"):
            mode = "reduce-overhead" if variant == "cuda_graphs" else None
            if options:  # torch.compile takes a mode or options, not both: the mode goes into the options
                options = {**options, "cuda_graphs": variant == "cuda_graphs"}
                mode = None
            self.forward = torch.compile(model, backend="ktorch", mode=mode, options=options, fullgraph=True,
                                         dynamic=False)
        else:
            self.forward = model
        self.pos = 0

    def _call(self, ids: torch.Tensor):
        if self.variant == "cuda_graphs":
            torch.compiler.cudagraph_mark_step_begin()
        n = ids.shape[1]
        position = torch.arange(self.pos, self.pos + n, device=self.device)
        out = self.forward(input_ids=ids, past_key_values=self.cache, cache_position=position,
                           position_ids=position[None], use_cache=True, logits_to_keep=1)
        self.pos += n
        return out.logits[:, -1].argmax(-1, keepdim=True)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.cache.reset()
        self.pos = 0
        return self._call(ids)

    def decode(self, first: torch.Tensor, steps: int) -> torch.Tensor:
        nxt = first
        for _ in range(steps):
            nxt = self._call(nxt)
        return nxt


@torch.no_grad()
def profile_prefill(runner: Runner, tokens: int, out_dir: str, label: str) -> dict:
    """Profiles one prefill of ``tokens`` tokens (after one untimed) and says where its time went: the copy
    engines' busy time host-to-device (streamed experts) and its GB/s, the GPU kernels' busy time, the CPU experts'
    busy time (the runtime's timeline) and how much of it overlaps the copies. Writes the chrome trace."""
    ids = torch.randint(0, runner.model.config.vocab_size, (1, tokens), device=runner.device)
    runner.prefill(ids)
    sync(runner.device)
    path = os.path.join(out_dir, f"trace_prefill_{label}_{tokens}.json")
    events, timeline, marks = _profile_steps(runner, ["prefill"], lambda _: runner.prefill(ids), path)
    (before, after), = marks
    step = next(e for e in events if e["name"] == "prefill")
    offset_us = step["ts"] - (before + after) / 2e3
    h2d = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    h2d_spans = [(e["ts"], e["ts"] + e["dur"]) for e in h2d]
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel"]
    experts = [(s / 1e3 + offset_us, t / 1e3 + offset_us) for s, t, _ in timeline]
    h2d_bytes = sum(int((e.get("args") or {}).get("bytes", 0)) for e in h2d)
    h2d_ms = _union(h2d_spans) / 1e3
    return dict(trace=path, tokens=tokens, prefill_ms=step["dur"] / 1e3, h2d_busy_ms=h2d_ms,
                h2d_gb=h2d_bytes / 1e9, h2d_gbps=h2d_bytes / (h2d_ms * 1e6) if h2d_ms else 0.0,
                kernels_busy_ms=_union(kernels) / 1e3, cpu_experts_busy_ms=_union(experts) / 1e3,
                cpu_experts_calls=len(experts), cpu_under_copies_ms=_intersection(experts, h2d_spans) / 1e3,
                kernels_under_copies_ms=_intersection(kernels, h2d_spans) / 1e3)


def split_decode_deferral(options: dict | None) -> tuple[dict | None, int | None]:
    """The bench-only option ``decode_deferred_experts: d`` (deferral in decode only: prefill runs d = 0, where
    deferring splits each layer's CPU work into two calls for nothing to overlap) taken out of backend
    ``options``; the graphs are then compiled with ``n_deferred_experts="runtime"`` so that one compile serves
    both. Returns (backend options, d or None)."""
    if not options or "decode_deferred_experts" not in options:
        return options, None
    rest = {k: v for k, v in options.items() if k != "decode_deferred_experts"}
    d = options["decode_deferred_experts"]
    if isinstance(d, bool) or not isinstance(d, int) or d < 0:
        raise ValueError(f"decode_deferred_experts must be an int >= 0, got {d!r}")
    if rest.get("n_deferred_experts", "runtime") != "runtime":
        raise ValueError("decode_deferred_experts needs n_deferred_experts='runtime' (or unset), got "
                         f"{rest['n_deferred_experts']!r}")
    rest["n_deferred_experts"] = "runtime"
    return rest, d


@torch.no_grad()
def time_variant(model, variant: str, device: str, prompts: list[int], decode_tokens: int, decode_context: int,
                 repeats: int, vocab: int, options: dict | None = None, runner: Runner | None = None) -> dict:
    """Times prefill per prompt length and decode; ``runner`` reuses one made (and compiled) by an earlier call
    with the same lengths (result["runner"]). ``options`` may hold ``decode_deferred_experts`` (see
    split_decode_deferral): prefill then runs with no deferral and decode with that many deferred slots."""
    result: dict = {"variant": variant}
    options, decode_deferred = split_decode_deferral(options)
    if decode_deferred is not None:
        ktorch.compile.set_runtime_deferred_experts(0)
        result["decode_deferred_experts"] = decode_deferred
    if runner is None:
        runner = Runner(model, variant, device, max(prompts + [decode_context]) + decode_tokens + 16, options)
    gen = torch.Generator().manual_seed(1)
    warm = 1 if variant in ("hf_offload", "eager") else 3
    for p in prompts:
        ids = torch.randint(0, vocab, (1, p), generator=gen).to(device)
        t0 = time.perf_counter()
        for _ in range(warm):
            runner.prefill(ids)
        sync(device)
        result[f"warmup_prefill_{p}_s"] = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.prefill(ids)
            sync(device)
            times.append(time.perf_counter() - t0)
        result[f"prefill_{p}_tok_s"] = p / statistics.median(times)
    if decode_tokens:
        ids = torch.randint(0, vocab, (1, decode_context), generator=gen).to(device)
        first = runner.prefill(ids)
        if decode_deferred is not None:
            sync(device)
            ktorch.compile.set_runtime_deferred_experts(decode_deferred)
        t0 = time.perf_counter()
        first = runner.decode(first, warm + 1)
        sync(device)
        result["warmup_decode_s"] = time.perf_counter() - t0
        runtime = ktorch.compile.RUNTIME
        runtime.take_native_timeline()  # drop what the warm-up recorded
        stats0 = dict(runtime.stats)
        cpu0 = host_cpu_times()
        t0 = time.perf_counter()
        runner.decode(first, decode_tokens)
        sync(device)
        elapsed = time.perf_counter() - t0
        result.update(host_cpu_shares(cpu0, host_cpu_times()))
        result["decode_tok_s"] = decode_tokens / elapsed
        stats = runtime.stats
        native = runtime.take_native_timeline()
        experts_ns = stats["experts_ns"] - stats0.get("experts_ns", 0) + sum(end - start for start, end, _ in native)
        experts_calls = stats["experts_calls"] - stats0.get("experts_calls", 0) + len(native)
        # c without a profiler: the kt.fused_moe calls' own time per decode step (0 for the variants that do not
        # go through the experts runtime, e.g. compiled on a CPU-only machine runs the op in the graph)
        result["cpu_experts_ms_per_step"] = experts_ns / 1e6 / decode_tokens
        result["experts_calls_per_step"] = experts_calls / decode_tokens
        result["host_waits_per_step"] = (stats["host_waits"] - stats0.get("host_waits", 0)) / decode_tokens
        result["python_submits_per_step"] = (stats["submits"] - stats0.get("submits", 0)) / decode_tokens
        result.update(call_gap_stats(native))
    if decode_deferred is not None:
        sync(device)
        ktorch.compile.set_runtime_deferred_experts(0)
    result["runner"] = runner
    return result


def host_cpu_times() -> dict[str, int]:
    """The machine's CPU time by kind since boot (the "cpu" line of /proc/stat, in clock ticks); {} elsewhere."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return {}
    if not fields or fields[0] != "cpu":
        return {}
    return {name: int(v) for name, v in zip(names, fields[1:])}


def host_cpu_shares(before: dict, after: dict) -> dict:
    """Between two host_cpu_times: the share of all CPUs' time that was busy (user + system + irq), idle, and
    stolen by the hypervisor (steal: a virtual CPU that was ready to run while the host ran something else), in
    percent: a decode that stalls while steal is high lost its cores to other tenants, not to its own threads."""
    if not before or not after:
        return {}
    delta = {k: after[k] - before.get(k, 0) for k in after}
    total = sum(delta.values())
    if total <= 0:
        return {}
    busy = sum(delta.get(k, 0) for k in ("user", "nice", "system", "irq", "softirq"))
    idle = delta.get("idle", 0) + delta.get("iowait", 0)
    return {"host_busy_pct": 100.0 * busy / total, "host_idle_pct": 100.0 * idle / total,
            "host_steal_pct": 100.0 * delta.get("steal", 0) / total}


def call_gap_stats(timeline: list) -> dict:
    """Distribution of the CPU experts calls (native host tasks, under CUDA graphs) without a profiler: each
    call's duration and the gap from one call's end to the next one's start (the hop to the GPU and back, plus
    the GPU work between, in a healthy decode step ~0.1-0.3 ms; a thread the scheduler left waiting shows as a
    call or gap milliseconds long). Microseconds; empty without a timeline."""
    if len(timeline) < 2:
        return {}
    calls = sorted((end - start) / 1e3 for start, end, _ in timeline)
    gaps = sorted((b[0] - a[1]) / 1e3 for a, b in zip(timeline, timeline[1:]) if b[0] >= a[1])

    def q(xs, f):
        return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else 0.0

    return {"call_us_p50": q(calls, 0.5), "call_us_p99": q(calls, 0.99), "call_us_max": calls[-1],
            "gap_us_p50": q(gaps, 0.5), "gap_us_p90": q(gaps, 0.9), "gap_us_max": gaps[-1] if gaps else 0.0,
            "calls_over_1ms": sum(c > 1000 for c in calls), "gaps_over_1ms": sum(g > 1000 for g in gaps)}


def parse_pool_sweep(spec: str) -> list[tuple[int, int]]:
    """'15:2000,13:300,13' -> [(15, 2000), (13, 300), (13, spin)]: (pool threads, KT_SPIN_US) per decode re-timing;
    the spin defaults to the environment's (else 2000)."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        parts = item.split(":")
        try:
            if len(parts) > 2:
                raise ValueError
            threads = int(parts[0])
            spin = int(parts[1]) if len(parts) > 1 and parts[1] else int(os.environ.get("KT_SPIN_US") or 2000)
        except ValueError:
            raise SystemExit(f"--pool-sweep: want THREADS[:SPIN_US],..., got {item!r}") from None
        if threads < 1 or spin < 0:
            raise SystemExit(f"--pool-sweep: threads >= 1, spin >= 0, got {item!r}")
        out.append((threads, spin))
    return out


@torch.no_grad()
def pool_sweep(model, runner, variant: str, device: str, decode_tokens: int, decode_context: int, vocab: int,
               settings: list[tuple[int, int]], options: dict | None = None) -> list[dict]:
    """Decode re-timed on the same compiled model (no new compile or capture) for each (pool threads, KT_SPIN_US):
    the pool is rebuilt between runs (set_num_threads rebuilds it when the size or the spin changed), while the
    host-task worker and CUDA's callback thread stay. ``options`` are time_variant's (a ``decode_deferred_experts`` in
    them holds for every re-timing). Restores the pool size, and the spin to the environment's."""
    size = ktorch.get_num_threads()
    rows = []
    try:
        for threads, spin_us in settings:
            sync(device)
            ktorch.config.set_spin_us(spin_us)
            torch.ops.kt.set_num_threads(threads)  # (the op: leaves ktorch's "size chosen" flag alone)
            r = time_variant(model, variant, device, [], decode_tokens, decode_context, 1, vocab, options,
                             runner=runner)
            r.pop("runner")
            r.update(pool_threads=threads, spin_us=spin_us)
            rows.append(r)
    finally:
        sync(device)
        ktorch.config.set_spin_us(None)
        torch.ops.kt.set_num_threads(size)
    return rows


# ---------------------------------------------------------------- the decode-step profile


def _union(intervals):
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _intersection(a, b):
    """Total length of (union a) ∩ (union b)."""
    def merged(iv):
        out = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out

    a, b = merged(a), merged(b)
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize")


def _profile_steps(runner: Runner, names: list, run, path: str) -> tuple:
    """Runs ``run(i)`` for each of ``names`` under torch.profiler, each inside an annotation ``names[i]`` and
    synced at its end, with the experts runtime's timeline on, and writes the chrome trace to ``path``. Returns
    (the trace's complete events, the runtime's timeline [(start_ns, end_ns, tokens)], per step perf_counter_ns just
    before and just after its annotation opened: the annotation's trace time lies between the two, so their
    midpoint aligns the runtime's timeline with the trace to within half their gap)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if runner.device == "cuda" else [])
    runtime = ktorch.compile.RUNTIME
    marks = []
    runtime.timeline = []
    runtime.take_native_timeline()  # (native host tasks) calls made before the profile are not ours
    try:
        with profile(activities=activities) as prof:
            for i, name in enumerate(names):
                before = time.perf_counter_ns()
                with record_function(name):
                    marks.append((before, time.perf_counter_ns()))
                    run(i)
                    sync(runner.device)
    finally:
        timeline, runtime.timeline = runtime.timeline, None
        timeline = sorted(timeline + runtime.take_native_timeline())
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    return events, timeline, marks


@torch.no_grad()
def profile_decode(runner: Runner, steps: int, out_dir: str, label: str) -> dict:
    """Profiles ``steps`` decode steps (each synced at its end) and summarizes the middle one."""
    state = [runner.decode(runner.prefill(torch.zeros(1, 64, dtype=torch.long, device=runner.device)), 4)]
    sync(runner.device)

    def one_step(_):
        state[0] = runner.decode(state[0], 1)

    path = os.path.join(out_dir, f"trace_{label}.json")
    events, timeline, marks = _profile_steps(runner, [f"decode_step_{i}" for i in range(steps)], one_step, path)
    k = steps // 2
    step = next(e for e in events if e["name"] == f"decode_step_{k}")
    lo, hi = step["ts"], step["ts"] + step["dur"]
    before, after = marks[k]
    offset_us = step["ts"] - (before + after) / 2e3  # trace time = perf_counter time + offset
    align_us = (after - before) / 2e3  # ... to within this
    main_tid = step["tid"]

    def inside(e):
        return e["ts"] >= lo and e["ts"] + e.get("dur", 0) <= hi

    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and inside(e)]
    experts = [(s / 1e3 + offset_us, t / 1e3 + offset_us) for s, t, _ in timeline]
    experts = [(s, t) for s, t in experts if s >= lo and t <= hi]
    syncs = [e["name"] for e in events if e.get("cat") == "cuda_runtime" and e["name"] in SYNC_CALLS
             and e["tid"] == main_tid and inside(e)]
    # Add the CPU experts to the trace as their own thread, so a trace viewer shows them under the GPU work.
    with open(path) as f:
        trace = json.load(f)
    pid = step.get("pid", 0)
    trace["traceEvents"] += [dict(ph="X", name="kt.fused_moe (experts worker)", cat="ktorch", pid=pid,
                                  tid="ktorch-experts", ts=s / 1e3 + offset_us, dur=(t - s) / 1e3,
                                  args={"tokens": n}) for s, t, n in timeline]
    with open(path, "w") as f:
        json.dump(trace, f)
    under_us, windows = gpu_work_under_experts(events, lo, hi)
    return dict(trace=path, step_ms=step["dur"] / 1e3, gpu_busy_ms=_union(gpu) / 1e3,
                gpu_under_experts_ms=under_us / 1e3, experts_windows=windows,
                cpu_experts_busy_ms=_union(experts) / 1e3, overlap_ms=_intersection(gpu, experts) / 1e3,
                # the overlap that holds however the alignment errs: each CPU call shrunk by align_us both sides
                overlap_min_ms=_intersection(gpu, [(a + align_us, b - align_us) for a, b in experts
                                                   if b - a > 2 * align_us]) / 1e3,
                experts_calls=len(experts), align_us=align_us,
                main_thread_syncs=max(len(syncs) - 1, 0),  # minus the profiling sync
                sync_calls=sorted(set(syncs)))


def gpu_work_under_experts(events: list, lo: float, hi: float) -> tuple[float, int]:
    """(us, windows): GPU kernel time that ran while a CPU experts call was in flight, read off the GPU timeline
    alone, in [lo, hi]. A call's inputs are copied device -> pinned, its start host function then hands it to the
    worker, and its result is copied pinned -> device once the worker is done; the stream runs in order, so a
    kernel after a call's last input copy and before its result copy ran after the call started and before it
    ended. Exact for d = 0 (one call in flight at a time); with deferral it counts only the layer's own window."""
    copies = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "gpu_memcpy" and lo <= e["ts"] <= hi)
    kernels = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and lo <= e["ts"] <= hi]
    windows, last_in = [], None
    for start, end, name in copies:
        if "DtoH" in name:
            last_in = end
        elif "HtoD" in name and last_in is not None:
            windows.append((last_in, start))
            last_in = None
    inside = [(max(a, w0), min(b, w1)) for a, b in kernels for w0, w1 in windows if a < w1 and b > w0]
    return _union(inside), len(windows)


def describe_overlap() -> str:
    """The nodes between the first submit and its wait in the last graph the backend compiled."""
    if not ktorch.compile.REPORTS:
        return ""
    graph = ktorch.compile.REPORTS[-1].graph
    nodes = list(graph.graph.nodes)
    names = [str(n.target) for n in nodes]
    try:
        i = next(k for k, n in enumerate(nodes) if n.meta.get("ktorch_async") == "submit")
        j = next(k for k, n in enumerate(nodes) if n.meta.get("ktorch_async") == "wait" and k > i)
    except StopIteration:
        return ""
    between = [f"{n.op}:{getattr(n.target, '__name__', n.target)}" for n in nodes[i + 1: j]]
    return f"between the first submit and its wait ({len(between)} nodes): " + ", ".join(between)


# ---------------------------------------------------------------- main


@torch.no_grad()
def standalone_experts_ms(model, rounds: int = 5, tokens: int = 1, seed: int = 2) -> float:
    """ms per decode step of the model's kt.fused_moe calls run back to back on this thread, outside the model:
    every MoE layer once per round with ``tokens`` random tokens routed uniformly (the first round not timed).
    Against the decode's cpu_experts_ms_per_step it tells what running inside the step costs the op."""
    gen = torch.Generator().manual_seed(seed)
    modules = [m for _, m in experts_modules(model)]
    k = getattr(model.config, "num_experts_per_tok", 8)
    calls = []
    for m in modules:
        E, H = m.kt_w13.shape[0], m.kt_w2.shape[1] * 16
        x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
        calls.append((m, x, E))
    elapsed = 0.0
    for r in range(rounds + 1):
        for m, x, E in calls:
            ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
            w = torch.full((tokens, k), 1.0 / k)
            t0 = time.perf_counter()
            torch.ops.kt.fused_moe(x, ids, w, m.kt_w13, m.kt_w13_scales, m.kt_w2, m.kt_w2_scales, m.kt_activation)
            if r:
                elapsed += time.perf_counter() - t0
    return elapsed * 1e3 / rounds


def parse_stream_setting(spec: str) -> tuple:
    """'SETTING' or 'SETTING@serial' (SETTING as ``parse_stream_plan`` reads it) -> (what ``set_stream_experts``
    takes, copy_ahead)."""
    spec = spec.strip()
    serial = spec.endswith("@serial")
    return parse_stream_plan(spec.removesuffix("@serial")), not serial


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--experts-dtype", choices=("bf16", "int8", "int4"), default="int8")
    parser.add_argument("--prompts", default="512,2048", help="prefill prompt lengths")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--baseline-decode-tokens", type=int, default=4, help="decode steps timed for hf_offload")
    parser.add_argument("--decode-context", type=int, default=512, help="prompt length before decoding")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count (smoke runs)")
    parser.add_argument("--options", default=None,
                        help='ktorch backend options as JSON for the compiled variants, e.g. \'{"overlap": false}\'')
    parser.add_argument("--profile", action="store_true", help="profile decode steps of the ktorch variants")
    parser.add_argument("--profile-prefill", action="store_true",
                        help="profile one prefill per prompt length of each ktorch row (CUDA): copy engines, "
                             "kernels and CPU experts busy time, their overlap; chrome traces in --out")
    parser.add_argument("--op-check", action="store_true",
                        help="also time the model's experts ops back to back outside the model (standalone ms per "
                             "decode step), to compare with the decode's cpu_experts_ms_per_step")
    parser.add_argument("--stream-experts", default="off",
                        help="';'-separated prefill streaming settings for the ktorch variants: off, auto, or "
                             "'min_tokens:experts_or_fraction,...' (e.g. 512:0.3,2048:0.45); '@serial' at the end: "
                             "no copies a layer ahead")
    parser.add_argument("--pool-sweep", default="",
                        help="after each ktorch variant's decode, re-time it (same compile) per pool setting "
                             "THREADS[:KT_SPIN_US],... e.g. '15:2000,13:2000,13:300' (whether the pool's "
                             "spinning workers and CUDA's host-function thread fight for the cores)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for traces")
    parser.add_argument("--json", default=None, help="append results as JSON lines to this file")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    info = machine_info(args.device)
    print("machine:", json.dumps(info))
    print(f"shape: {args.shape} {json.dumps(SHAPES[args.shape])}")
    print(f"experts: {args.experts_dtype} on the CPU; device: {args.device}")
    prompts = [int(p) for p in args.prompts.split(",") if p]
    options = json.loads(args.options) if args.options else None
    variants = args.variants.split(",")
    for variant in variants:
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")
    streams = [parse_stream_setting(spec) for spec in args.stream_experts.split(";") if spec.strip()]
    sweep = parse_pool_sweep(args.pool_sweep)
    runs = [(v, stream) for v in variants for stream in (streams if v != "hf_offload" else [("off", True)])]
    rows = []
    model = None  # the ktorch variants share one placed model
    for i, (variant, (stream, ahead)) in enumerate(runs):
        torch._dynamo.reset()
        build_s = 0.0
        if variant == "hf_offload" or model is None:
            model, build_s = build_model(args.shape, variant, args.device, args.experts_dtype, layers=args.layers)
        calibration = None
        if variant != "hf_offload":
            ktorch.set_stream_experts(model, stream, copy_ahead=ahead)
            calibration = getattr(model, "kt_stream_calibration", None) if stream == "auto" else None
        first_of_variant = i == 0 or runs[i - 1][0] != variant
        decode = args.baseline_decode_tokens if variant == "hf_offload" else args.decode_tokens
        decode = decode if first_of_variant else 0
        repeats = 1 if variant == "hf_offload" else args.repeats
        r = time_variant(model, variant, args.device, prompts, decode, args.decode_context, repeats,
                         model.config.vocab_size, options)
        runner = r.pop("runner")
        r.update(shape=args.shape, experts_dtype=args.experts_dtype, build_s=build_s, machine=info,
                 layers=model.config.num_hidden_layers, options=options)
        if variant != "hf_offload":
            r.update(stream_experts=stream, copy_ahead=ahead, stream_plan=ktorch.stream_plan(model))
            if args.op_check and decode:
                r["standalone_experts_ms_per_step"] = standalone_experts_ms(model)
            if calibration is not None:
                r["stream_calibration"] = dict(h2d_gbps=calibration.h2d_gbps, cpu_ms=calibration.cpu_ms)
        if args.profile and variant != "hf_offload":
            r["profile"] = profile_decode(runner, 5, args.out, f"{args.shape}_{variant}")
            r["overlap_nodes"] = describe_overlap()
        if args.profile_prefill and variant != "hf_offload" and args.device == "cuda":
            tag = f"{args.shape}_{variant}_{len(rows)}"
            r["prefill_profile"] = [profile_prefill(runner, p, args.out, tag) for p in prompts]
        if sweep and decode and variant != "hf_offload":
            r["pool_sweep"] = pool_sweep(model, runner, variant, args.device, decode, args.decode_context,
                                         model.config.vocab_size, sweep)
        rows.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "machine"}, default=str), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(r, default=str) + "\n")
        del runner
        if variant == "hf_offload":
            model = None
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()

    cols = [f"prefill_{p}_tok_s" for p in prompts] + ["decode_tok_s", "host_waits_per_step", "cpu_experts_ms_per_step"]
    if args.op_check:
        cols.append("standalone_experts_ms_per_step")
    print()
    print("| variant | streamed experts per layer | " +
          " | ".join(c.replace("_tok_s", " tok/s").replace("_", " ") for c in cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        plan = r.get("stream_plan") or {}
        streamed = ", ".join(f"{n} from {t} tokens" for t, n in plan.items()) or "none"
        if plan and not r.get("copy_ahead", True):
            streamed += " (serial copies)"
        print(f"| {r['variant']} | {streamed} | " + " | ".join(f"{r[c]:.2f}" if c in r else "-" for c in cols) + " |")
    gap_cols = ("call_us_p50", "call_us_p99", "gap_us_p50", "gap_us_p90", "gap_us_max", "calls_over_1ms", "gaps_over_1ms")
    for r in rows:
        if "pool_sweep" not in r:
            continue
        print(f"\npool sweep, {r['variant']} (decode re-timed on the same compiled model; CPU calls and the gaps "
              "between them from the native host tasks' timeline, us):")
        print("| pool threads | KT_SPIN_US | decode tok/s | cpu experts ms per step | " + " | ".join(gap_cols) + " |")
        print("|---|---|---|---|" + "---|" * len(gap_cols))
        for p in r["pool_sweep"]:
            print(f"| {p['pool_threads']} | {p['spin_us']} | {p['decode_tok_s']:.2f} | {p['cpu_experts_ms_per_step']:.2f} | "
                  + " | ".join(f"{p.get(c, 0):.0f}" for c in gap_cols) + " |")
    for r in rows:
        for pp in r.get("prefill_profile", []):
            serial = "" if r.get("copy_ahead", True) else ", serial copies"
            print(f"  prefill {pp['tokens']} ({r['variant']}, plan {r.get('stream_plan')}{serial}): "
                  f"{pp['prefill_ms']:.1f} ms; copies to the GPU busy {pp['h2d_busy_ms']:.1f} ms "
                  f"({pp['h2d_gb']:.2f} GB, {pp['h2d_gbps']:.1f} GB/s); kernels busy {pp['kernels_busy_ms']:.1f} "
                  f"ms, {pp['kernels_under_copies_ms']:.1f} under copies; CPU experts busy "
                  f"{pp['cpu_experts_busy_ms']:.1f} ms in {pp['cpu_experts_calls']} calls, "
                  f"{pp['cpu_under_copies_ms']:.1f} under copies")
        if "stream_calibration" in r:
            c = r["stream_calibration"]
            print(f"\nstream_experts=auto measured: host-to-device {c['h2d_gbps']:.1f} GB/s, CPU op per layer "
                  + ", ".join(f"{t} tokens {ms:.2f} ms" for t, ms in sorted(c["cpu_ms"].items())))
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            print(f"\nprofile {r['variant']} (one decode step, synced): step {p['step_ms']:.2f} ms, GPU busy "
                  f"{p['gpu_busy_ms']:.2f} ms, CPU experts busy {p['cpu_experts_busy_ms']:.2f} ms "
                  f"({p['experts_calls']} kt::fused_moe calls), overlap {p['overlap_ms']:.2f} ms (at least "
                  f"{p['overlap_min_ms']:.2f} ms: the CPU timeline aligns to +-{p['align_us']:.0f} us); GPU "
                  f"kernels between a call's input copies and its result copy {p['gpu_under_experts_ms']:.3f} ms "
                  f"({p['experts_windows']} calls), "
                  f"host syncs on the launching thread {p['main_thread_syncs']} {p['sync_calls']}; trace {p['trace']}")
            if r.get("overlap_nodes"):
                print("  " + r["overlap_nodes"])


if __name__ == "__main__":
    main(sys.argv[1:])
