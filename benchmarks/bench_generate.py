"""End to end as a user runs it: ``ktorch generate`` (fresh processes, default options) beside llama.cpp's
``llama-bench`` at its best settings, on the same GGUF file, in one run.

ktorch     ``ktorch generate --model FILE --prompt <P bytes> --max-new-tokens N [ARGS]``, each run a new process
           exactly as typed at a shell; the file has no tokenizer, so the prompt's P bytes are P token ids. What is
           reported is what the command prints: load time (on a GPU ending with one warm-up prefill of 2048 random
           ids, ``ktorch.warm_up``, whose seconds it also prints apart: ``warmup_prefill_s``), time to first token
           (prefill), the decode step's capture, prefill tok/s, decode tok/s. Each --ktorch-args set runs --runs
           times (the first in a fresh process is the cold start; later ones show a warm page cache).
llama.cpp  ``llama-bench -m FILE -ngl 99 -ot exps=CPU`` swept over threads, -fa and -lm (see
           bench_vs_llamacpp.py, whose sweep and best-per-test pick this reuses), ppP and tgN.

    python benchmarks/bench_generate.py --gguf /tmp/q8.gguf --prompts 512 --gen 64 \\
        --ktorch-args "" "--deferred-experts 3" --llama-bench /tmp/lcpp/bin/llama-bench --json $OUT/gen.jsonl

Optionally writes the file first (--write-layers N: a random Qwen3-30B-A3B-shaped qwen3moe file, --write-type,
--write-seed; ktorch.integrations.gguf_writer.write_random_qwen3moe_gguf). Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_use import GpuUse  # noqa: E402

RATES = re.compile(r"prefill: (\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\) \| decode: (\d+) tokens(?: in ([\d.]+) s "
                   r"\(([\d.]+) tok/s\))?")
LOADED = re.compile(r"loaded in ([\d.]+) s")
CAPTURE = re.compile(r"decode-step capture ([\d.]+) s")
PREFILL_CAPTURE = re.compile(r"prefill capture ([\d.]+) s")
PREFILL_REPLAYED = re.compile(r"prefill replayed the captured (\d+)-token graph")
WARMUP_PREFILL = re.compile(r"loaded in [\d.]+ s \(prefill warm-up ([\d.]+) s\)")
SPLIT = re.compile(r"prefill split: (\d+) layer calls, experts hit (\d+) \(per layer ([\d,]*)\), copied (\d+) "
                   r"\(([\d.]+) GB\), copied but unused (\d+), resident hit (\d+); rows on the GPU ([\d.]+)%")
GPU_MEMORY = re.compile(r"GPU memory: budget ([\d.]+) GiB .* resident experts [\d.]+ \((\d+) of \d+ per layer.*used "
                        r"([\d.]+) GiB")
PEAK = re.compile(r"GPU memory measured: peak allocated ([\d.]+) GiB(?:, peak reserved ([\d.]+), outside the allocator "
                  r"now ([\d.]+))?")
RESIDENT = re.compile(r"(\d+) swapped after prefill in ([\d.]+) s; decode resident hit rate (\d+)/(\d+)")


def parse_generate_output(stderr: str) -> dict:
    """The figures ``ktorch generate`` printed on stderr (the rates line, the load time and its prefill warm-up, the
    capture time)."""
    out: dict = {}
    m = RATES.search(stderr)
    if m:
        out.update(prompt_tokens=int(m[1]), first_token_s=float(m[2]), prefill_tok_s=float(m[3]),
                   decode_tokens=int(m[4]))
        if m[5]:
            out.update(decode_s=float(m[5]), decode_tok_s=float(m[6]))
    m = LOADED.search(stderr)
    if m:
        out["load_s"] = float(m[1])
    m = CAPTURE.search(stderr)
    if m:
        out["capture_s"] = float(m[1])
    m = PREFILL_CAPTURE.search(stderr)  # the prompt's bucket's prefill captured after the output (GPU)
    if m:
        out["prefill_capture_s"] = float(m[1])
    m = PREFILL_REPLAYED.search(stderr)  # the prompt replayed a kept captured prefill, padded (else eager)
    out["prefill_replayed"] = int(m[1]) if m else 0
    m = WARMUP_PREFILL.search(stderr)  # the load-time warm-up (GPU only; counted in load_s)
    if m:
        out["warmup_prefill_s"] = float(m[1])
    m = SPLIT.search(stderr)  # the routing-aware prefill split's counters (--stream-experts auto)
    if m:
        out.update(split_layer_calls=int(m[1]), experts_hit=int(m[2]), hit_per_layer=[int(x) for x in m[3].split(",") if x],
                   experts_copied=int(m[4]), gb_copied=float(m[5]), copied_unused=int(m[6]), resident_hit=int(m[7]),
                   rows_on_gpu_pct=float(m[8]))
    m = GPU_MEMORY.search(stderr)
    if m:
        out.update(gpu_budget_gib=float(m[1]), resident_per_layer=int(m[2]), gpu_used_gib=float(m[3]))
    m = PEAK.search(stderr)
    if m:
        out["gpu_peak_gib"] = float(m[1])
        if m[2]:
            out.update(gpu_peak_reserved_gib=float(m[2]), gpu_outside_gib=float(m[3]))
    m = RESIDENT.search(stderr)
    if m:
        out.update(resident_swaps=int(m[1]), resident_swap_s=float(m[2]),
                   decode_resident_hit_rate=int(m[3]) / max(int(m[4]), 1))
    return out


def prompt_of(tokens: int, kind: str = "text", seed: Optional[int] = None) -> str:
    """A prompt of exactly ``tokens`` bytes (= token ids for a file without a tokenizer), not all the same.

    ``kind="text"``: a repeated English sentence (about 30 distinct ids); ``"random"``: seeded (``seed``, default
    ``tokens``) random printable ASCII (95 distinct ids), nearer llama-bench's random tokens."""
    if kind == "random":
        import random

        rng = random.Random(tokens if seed is None else seed)
        return "".join(chr(rng.randrange(32, 127)) for _ in range(tokens))
    text = "the quick brown fox jumps over the lazy dog while the cat sleeps in the sun "
    return (text * (tokens // len(text) + 1))[:tokens]


def prompt_ids(tokens: int, kind: str = "text", seed: Optional[int] = None):
    """``prompt_of``'s bytes as token ids [1, tokens] (a file without a tokenizer), what ``ktorch generate`` makes of
    the same prompt."""
    import torch

    return torch.tensor([list(prompt_of(tokens, kind, seed).encode())])


def run_generate(gguf: str, prompt_tokens: int, gen: int, extra: list[str], timeout_s: float,
                 prompt_kind: str = "text") -> dict:
    """One fresh ``ktorch generate`` process on ``gguf`` (a prompt of ``prompt_tokens`` ids, ``gen`` new tokens,
    ``extra`` options): what it printed (parse_generate_output), its wall time and the command as typed; ``error``
    when it failed or printed no decode rate. The process is ``python -m ktorch.cli``, the module behind the
    ``ktorch`` command, run by this interpreter (so the ktorch this benchmark imports is the one timed)."""
    args = ["generate", "--model", gguf, "--prompt", prompt_of(prompt_tokens, prompt_kind), "--max-new-tokens",
            str(gen), *extra]
    cmd = [sys.executable, "-m", "ktorch.cli", *args]
    shown = "ktorch " + " ".join(shlex.quote(c) for c in args[:3]) + f" --prompt <{prompt_tokens} bytes> " + \
        " ".join(shlex.quote(c) for c in args[5:])
    print("$ " + shown, flush=True)
    t0 = time.perf_counter()
    try:
        with GpuUse() as use:  # what the card shows in use (nvidia-smi): the allocator's peak leaves out the context
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"command": shown, "error": f"timeout after {timeout_s:.0f} s"}
    wall = time.perf_counter() - t0
    result = {"command": shown, "wall_s": wall, **parse_generate_output(proc.stderr)}
    if use.peak_gib is not None:
        result["gpu_smi_peak_gib"] = use.peak_gib
    if proc.returncode != 0 or "decode_tok_s" not in result:
        result["error"] = f"exit {proc.returncode}: " + proc.stderr[-1500:]
    print("  " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in result.items()
                             if k != "command"}), flush=True)
    return result


AB_VARIANTS = ("default", "eager layers", "host-function handoff", "two host functions", "sdpa attention", "aten route",
               "aten router", "aten kv write", "separate qkv", "linear router")
# --profile-steps profiles the default's step and these where they are among --ab-variants
PROFILED_VARIANTS = ("default", "host-function handoff", "aten router", "aten kv write", "separate qkv",
                     "linear router")


def ab_compile(args) -> None:
    """Experiments (benchmark flag): the captured decode step as ``generate`` makes it (decoder layers compiled
    regionally, each layer's CPU experts handed over by the GPU: a doorbell kernel and a wait kernel, no host
    function) against the eager layers, against host functions for the handoff (start and join in one where no GPU
    work sits between: "host-function handoff") and against separate start and join host functions, those of
    --ab-variants alternating on one loaded model (a fresh decoder, so a fresh capture, each time), per deferral in
    --deferred ("sdpa attention": transformers' SDPA over the whole cache instead of ktorch/decode_attention.py's
    flex attention; "aten route": the resident split's ATen ops instead of its Triton kernel; "aten router": the
    routers' softmax, ATen topk and renormalization instead of ktorch::router_topk; "aten kv write": transformers'
    StaticLayer.update (index_copy_) instead of the one-launch KV write; "separate qkv": the attention's three
    projections as three products instead of one over their fused weight; "linear router": the swapped routers'
    logits as the linear layer's product (cuBLAS, one row on two thread blocks) instead of the float32 reduction
    Inductor compiles into one kernel (integrations/transformers_routers.py)); then a
    profile of --profile-steps replays
    of the default's graph and of those of PROFILED_VARIANTS among --ab-variants: GPU kernel time and kernel count
    per step (torch.profiler), the CPU experts' time per step (the native host tasks' timeline) and the step's wall
    time."""
    import statistics

    import torch

    import ktorch
    import ktorch.generation as generation
    from ktorch.compile.experts_runtime import RUNTIME, ExpertsRuntime

    model, _ = ktorch.load(args.gguf, device="cuda", gpu_memory=args.ab_gpu_memory)
    ids = prompt_ids(args.prompts[0])

    from ktorch import decode_attention
    from ktorch.integrations import fused_qkv, transformers_cache, transformers_routers
    from ktorch.ops import triton_experts

    compiled = generation.compiled_layers
    submit = ExpertsRuntime._submit
    flex_applies, route_applies = decode_attention.applies, triton_experts.route_applies
    routers_swapped, cache_swapped = transformers_routers.swapped, transformers_cache.swapped
    qkv_swapped = fused_qkv.swapped
    router_kernel_forward = transformers_routers._kernel_forward

    def linear_router_forward(m, hidden, renormalize, cast, flatten, reduction=False):
        return router_kernel_forward(m, hidden, renormalize, cast, flatten)
    results: dict = {}

    def set_variant(variant: str) -> None:
        # the capture looks compiled_layers up in its module at each call: eager layers swap in a no-op context
        generation.compiled_layers = (lambda model, cache: contextlib.nullcontext()) if variant == "eager layers" \
            else compiled
        ExpertsRuntime._submit = (lambda self, *a, join_now=False, **k: submit(self, *a, join_now=False, **k)) \
            if variant == "two host functions" else submit
        # SDPA over the whole cache instead of the flex attention over its filled blocks (ktorch/decode_attention.py)
        decode_attention.applies = (lambda *a: "A/B") if variant == "sdpa attention" else flex_applies
        # the resident split's ATen ops instead of its one Triton kernel
        triton_experts.route_applies = (lambda ids: False) if variant == "aten route" else route_applies
        # the capture looks these up in their modules: transformers' router forwards / StaticLayer.update stay
        transformers_routers.swapped = (lambda model: contextlib.nullcontext([])) if variant == "aten router" \
            else routers_swapped
        transformers_cache.swapped = (lambda cache: contextlib.nullcontext([])) if variant == "aten kv write" \
            else cache_swapped
        # compiled_layers looks it up in its module: the q/k/v projections keep their own forwards
        fused_qkv.swapped = (lambda model: contextlib.nullcontext([])) if variant == "separate qkv" else qkv_swapped
        # _decode_forward looks it up in its module: the logits as a reduction Inductor compiles
        transformers_routers._kernel_forward = linear_router_forward if variant == "linear router" \
            else router_kernel_forward
        RUNTIME.gpu_handoff = variant not in ("host-function handoff", "two host functions")  # read at capture

    for d in args.deferred:
        ktorch.set_deferred_experts(model, d)
        for _ in range(args.ab_compile):
            for variant in args.ab_variants:
                set_variant(variant)
                model.kt_decoder = None
                t = ktorch.generate(model, ids, args.gen).timings
                results.setdefault((d, variant), []).append((t.decode_tok_s, t.warmup_s))
                print(f"d={d} {variant}: {t.line()} capture {t.warmup_s:.2f} s, on ktorch's kernels "
                      f"{model.kt_decoder.swapped}", flush=True)
        for variant in PROFILED_VARIANTS if args.profile_steps else ():
            if variant != "default" and variant not in args.ab_variants:
                continue
            set_variant(variant)
            model.kt_decoder = None
            ktorch.generate(model, ids, 4)
            profile_steps(model.kt_decoder, args.profile_steps, f"d={d} {variant}",
                          args.profile_trace if variant == "default" else None)
        set_variant("default")
    set_variant("default")
    for length in args.prompts[1:] if args.profile_steps else ():  # the step after longer prompts (its attention)
        model.kt_decoder = None
        ktorch.generate(model, prompt_ids(length), 4)
        profile_steps(model.kt_decoder, args.profile_steps, f"after a {length}-token prompt")
    for (d, variant), rows in results.items():
        print(f"d={d} {variant}: decode median {statistics.median(r[0] for r in rows):.1f} tok/s, capture median "
              f"{statistics.median(r[1] for r in rows):.2f} s ({len(rows)} runs)")


def profile_steps(decoder, steps: int, label: str, trace: str = None) -> None:
    """Replays the decoder's captured step ``steps`` times: wall ms per step, then again under torch.profiler for
    the GPU's kernel and copy time per step, and the CPU experts' time per step (native timeline)."""
    import time as _time

    import torch

    from ktorch.compile.experts_runtime import RUNTIME

    torch.cuda.synchronize()
    RUNTIME.take_native_timeline()
    t0 = _time.perf_counter()
    for _ in range(steps):
        decoder.step()
    torch.cuda.synchronize()
    wall = (_time.perf_counter() - t0) / steps * 1e3
    timeline = RUNTIME.take_native_timeline()
    experts_ms = sum(e - s for s, e, _ in timeline) / 1e6 / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder.step()
        torch.cuda.synchronize()
    kernels = copies = 0
    kernel_us = copy_us = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "memcpy" in name or "memset" in name:
            copies += 1
            copy_us += e.device_time
        else:
            kernels += 1
            kernel_us += e.device_time
    print(f"[profile {label}] step {wall:.2f} ms wall; CPU experts {experts_ms:.2f} ms/step "
          f"({len(timeline) / steps:.0f} calls); GPU kernels {kernel_us / steps / 1e3:.2f} ms/step "
          f"({kernels / steps:.0f} kernels); copies {copy_us / steps / 1e3:.2f} ms/step ({copies / steps:.0f})",
          flush=True)
    if trace:
        prof.export_chrome_trace(trace)
    top = sorted(prof.key_averages(), key=lambda k: -k.device_time_total)[:25]
    for k in top:
        print(f"    {k.device_time_total / steps:8.1f} us/step  x{k.count / steps:5.1f}  {k.key[:90]}")


class PartTimer:
    """Forward hooks that add up wall time per part of a prefill (synchronizing the device at each hook, so that a
    part's kernels are charged to it): each decoder layer's attention, its MoE block less its routed experts (router,
    shared experts) and its routed experts (the ktorch experts forward: the split, the copies, the CPU op), layer 0
    apart from the others (first uses land there); the rest of the forward (embedding, norms, lm_head) and sampling
    are the prefill's time less these."""

    def __init__(self, model, device):
        import torch

        from ktorch.generation import decoder_layers

        self.totals: dict = {}
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.handles = []
        for i, layer in enumerate(decoder_layers(model)):
            where = "layer 0" if i == 0 else "layers 1+"
            attention = getattr(layer, "self_attn", None)
            mlp = getattr(layer, "mlp", None)
            experts = getattr(mlp, "experts", None) if mlp is not None else None
            if attention is not None:
                self._time(attention, f"attention, {where}")
            if experts is not None:
                self._time(mlp, f"MoE block less experts, {where}", minus=f"routed experts, {where}")
                self._time(experts, f"routed experts, {where}")

    def _time(self, module, name: str, minus: str = None) -> None:
        state = {}

        def pre(mod, args):
            self.sync()
            state["t"] = time.perf_counter()
            state["inner"] = self.totals.get(minus, 0.0) if minus else 0.0

        def post(mod, args, out):
            self.sync()
            inner = (self.totals.get(minus, 0.0) - state["inner"]) if minus else 0.0
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - state["t"] - inner

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def _log_triton_compiles():
    """Yields a list that gets one (seconds, line) per Triton kernel specialization compiled (or loaded from Triton's
    disk cache) inside the context: the seconds it took, and a line of the kernel's name, those seconds and its
    specialization key."""
    lines: list = []
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield lines
        return
    original = JITFunction._do_compile

    def logged(self, key, *rest, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, key, *rest, **kwargs)
        finally:
            seconds = time.perf_counter() - t0
            lines.append((seconds, f"{self.__name__} in {seconds:.3f} s, key {str(key)[:400]}"))

    JITFunction._do_compile = logged
    try:
        yield lines
    finally:
        JITFunction._do_compile = original


def _breakdown_run(args, model, ids, first_run: bool, extra: str, prompt: int) -> float:
    """One ``generate`` of one new token without CUDA graphs (the eager prefill, whose parts the timer's hooks time:
    they synchronize, which a prefill capture after a length's second prompt cannot take; session 53 saw it fail and
    the next model's load raise); the first run of a length under cProfile with --breakdown-cprofile N (its N
    largest functions by own and by cumulative time printed). Returns the time to the first token."""
    from ktorch.generation import generate

    if not (args.breakdown_cprofile and first_run):
        return generate(model, ids, 1, cuda_graphs=False).timings.first_token_s
    return _cprofiled(lambda: generate(model, ids, 1, cuda_graphs=False), args.breakdown_cprofile,
                      f"[breakdown {extra or 'defaults'}] P={prompt} run 0 under cProfile").timings.first_token_s


def _cprofiled(fn, n: int, title: str):
    """Runs ``fn()`` under cProfile and prints its ``n`` largest Python functions by own and by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    result = prof.runcall(fn)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(n)
    stats.sort_stats("cumulative").print_stats(n)
    print(f"{title}:\n" + "\n".join(line for line in text.getvalue().splitlines() if line.strip()), flush=True)
    return result


def breakdown(args) -> None:
    """Experiment (benchmark flag): where a process's first prefills spend their time. Per --ktorch-args set, one
    process loads the model as ``ktorch generate --no-compile`` does on a GPU (ktorch.cli.load_model: the same
    defaults and options, the load-time warm-up included unless --breakdown-cold, no captured prefill kept: these
    runs prefill eagerly), then runs --breakdown prefills of each --prompts length
    (``ktorch.generate``, 1 new token): per part (PartTimer), the CPU op's own time (the experts runtime's timeline:
    kt.fused_moe on its worker, GPU models), the minor page faults and new CUDA memory segments, run by run. Run 0 is
    the first prompt of that length (after the warm-up: what a user's first prompt pays; with --breakdown-cold the
    process's cold first prefill, a shorter length earlier warming part of it); the later runs are warm. Each Triton
    kernel specialization a run compiles (or loads from Triton's disk cache) is printed with its key."""
    import resource

    import torch

    from ktorch.cli import build_parser, load_model, resolve_device
    from ktorch.compile.experts_runtime import RUNTIME

    for extra in args.ktorch_args:
        cli = build_parser().parse_args(["generate", "--model", args.gguf, "--prompt", "x", *shlex.split(extra)])
        # its runs prefill eagerly: on a GPU the warm-up keeps no captured prefill they would drop (--no-compile's)
        cli.no_compile = resolve_device(cli.device).type == "cuda"
        t0 = time.perf_counter()
        model, _, device = load_model(cli, warm_up=not args.breakdown_cold)
        print(f"[breakdown {extra or 'defaults'}] loaded in {time.perf_counter() - t0:.1f} s on {device} (prefill "
              f"warm-up {cli.warm_up_s:.2f} s{', skipped: --breakdown-cold' if args.breakdown_cold else ''})", flush=True)
        timer = PartTimer(model, device)
        for prompt in args.prompts:
            ids = prompt_ids(prompt, args.prompt_kind)
            runs = []
            for _ in range(args.breakdown):
                timer.totals.clear()
                RUNTIME.timeline = []
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                segments = torch.cuda.memory_stats(device)["segment.all.allocated"] if device.type == "cuda" else 0
                with _log_triton_compiles() as compiled:
                    first = _breakdown_run(args, model, ids, not runs, extra, prompt)
                for _, line in compiled:
                    print(f"[breakdown {extra or 'defaults'}] P={prompt} run {len(runs)} compiled {line}", flush=True)
                parts = dict(timer.totals)
                parts["CPU op (kt.fused_moe on the worker)"] = sum(e - s for s, e, _ in RUNTIME.timeline) / 1e9
                parts["rest (embedding, norms, lm_head, sampling)"] = first - sum(
                    v for k, v in timer.totals.items())
                parts["minor page faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                if device.type == "cuda":
                    parts["new CUDA segments"] = torch.cuda.memory_stats(device)["segment.all.allocated"] - segments
                runs.append((first, parts))
            RUNTIME.timeline = None
            print(f"[breakdown {extra or 'defaults'}] P={prompt}: first token ms by run: "
                  + ", ".join(f"{1e3 * r[0]:.2f}" for r in runs), flush=True)
            for name in runs[0][1]:
                counts = name.startswith(("minor", "new"))
                cells = ", ".join(f"{r[1][name]:.0f}" if counts else f"{1e3 * r[1][name]:.1f}" for r in runs)
                print(f"    {name:48s} {'' if counts else 'ms '}{cells}", flush=True)
        timer.remove()
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


PREFILL_VARIANTS = ("default", "sync-per-layer", "eager", "refitted-law")
_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


_HOST_WAITS = (*_SYNC_CALLS, "cudaMemcpyAsync")  # a pageable read's async copy waits too


def layer_anatomy(events: list) -> Optional[dict]:
    """What bounds an eager split prefill, from its profiled Chrome trace's ``traceEvents``: per MoE layer (from one
    split's counts read to the host to the next: their device-to-pageable copies), in ms: ``period``; ``gpu_busy``
    (its kernels and copies, as a union); ``to_copy`` (the GPU idle from the counts' read to the split's copy,
    ``_gather_rows``, while the launching thread chooses, routes and submits); ``copy``; ``cpu_wait`` (the GPU's
    wait kernel holding the stream for the CPU op); ``host_blocked`` (the launching thread's wait in the call that
    reads the counts). Medians over the layers, ``layers`` their number, and ``bound``: the largest of the GPU's
    own work (busy less the CPU op's wait), the CPU op (``cpu_wait``) and the launching thread (the GPU idle: period
    less busy). None without two such reads (no host split: every expert resident, a captured prefill, the CPU)."""
    import statistics

    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                    key=lambda e: e["ts"])
    marks = [e for e in device if e.get("name") == "Memcpy DtoH (Device -> Pageable)"]
    waits = [e for e in events if e.get("cat") == "cuda_runtime" and e.get("name") in _HOST_WAITS and "dur" in e]
    if len(marks) < 2:
        return None
    rows = []
    for a, b in zip(marks, marks[1:]):
        read = a["ts"] + a["dur"]
        inside = [e for e in device if read <= e["ts"] < b["ts"]]
        copies = [e for e in inside if e["name"] == "_gather_rows"]
        rows.append({
            "period": (b["ts"] - a["ts"]) / 1e3,
            "gpu_busy": _busy_ms([(e["ts"], e["ts"] + e["dur"]) for e in [a, *inside]]),
            "to_copy": (copies[0]["ts"] - read) / 1e3 if copies else 0.0,
            "copy": sum(e["dur"] for e in copies) / 1e3,
            "cpu_wait": sum(e["dur"] for e in inside if e["name"] == "_wait_kernel") / 1e3,
            # the host call that returned once the counts were read: it spans the copy's end
            "host_blocked": max((w["dur"] for w in waits if w["ts"] <= read <= w["ts"] + w["dur"]), default=0) / 1e3,
        })
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["layers"] = len(rows)
    shares = {"the GPU's work": out["gpu_busy"] - out["cpu_wait"], "the CPU op": out["cpu_wait"],
              "the launching thread": out["period"] - out["gpu_busy"]}
    out["bound"] = max(shares, key=shares.get)
    return out


def _busy_ms(intervals: list) -> float:
    """The union of [start, end) intervals (us), in ms."""
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1e3


def split_model_line(calls: list, timeline: list, costs) -> str:
    """The split's cost model against one prefill: ``calls`` the SplitCalls its layer calls appended
    (``RoutedExperts.calls``, in call order), ``timeline`` the CPU op's (start_ns, end_ns, tokens) per call (the
    experts runtime's ``timeline``: one per layer call, in the same order; empty where the CPU op ran inline, on the
    CPU), ``costs`` the SplitCosts. Sums over the calls of predicted and measured time per side, the per-call ratio
    measured / predicted (median, min, max), the predicted CPU time's three terms and the calls' mean CPU rows,
    CPU experts and copied experts. Call it after the device has synchronized (the device parts' events)."""
    import statistics

    def ratios(pairs: list) -> str:
        r = [m / p for p, m in pairs if p > 0]
        return f"per call {statistics.median(r):.2f}/{min(r):.2f}/{max(r):.2f}" if r else "no ratio"

    n = len(calls)
    cpu_predicted = sum(c.cpu_s for c in calls)
    if len(timeline) == n:
        cpu_pairs = [(c.cpu_s, (e - s) / 1e9) for c, (s, e, _) in zip(calls, timeline)]
        cpu = f"measured {1e3 * sum(m for _, m in cpu_pairs):.1f} ms ({ratios(cpu_pairs)})"
    else:
        cpu = f"measured n/a ({len(timeline)} CPU op calls timed for {n} split calls)"
    device_pairs = [(c.device_s, c.device_measured_s) for c in calls if c.device_measured_s is not None]
    fixed = sum(costs.cpu_fixed_s for c in calls if c.cpu_experts > 0)
    rows = sum(costs.cpu_row_s * c.cpu_rows for c in calls)
    experts = sum(costs.cpu_expert_s * c.cpu_experts for c in calls)
    return (f"split model: CPU predicted {1e3 * cpu_predicted:.1f} ms / {cpu}; device predicted "
            f"{1e3 * sum(p for p, _ in device_pairs):.1f} ms / measured {1e3 * sum(m for _, m in device_pairs):.1f} ms "
            f"({ratios(device_pairs)}, {len(device_pairs)} calls with device work); sums over {n} layer calls, ratios "
            f"measured/predicted median/min/max. CPU predicted = fixed {1e3 * fixed:.1f} + rows {1e3 * rows:.1f} + "
            f"experts {1e3 * experts:.1f} ms; per call {sum(c.cpu_rows for c in calls) / n:.0f} CPU rows, "
            f"{sum(c.cpu_experts for c in calls) / n:.1f} CPU experts, {sum(c.copied for c in calls) / n:.1f} copied")


def split_model_prefill(model, P: int, prefill, sync, costs):
    """One prefill of ``P`` tokens (``prefill(P)``) with the split's calls recorded (``RoutedExperts.calls``) and the
    CPU op's calls timed (the experts runtime's timeline): ``split_model_line`` of it, or None where no layer split
    (no routing-aware split, or every expert on the device). Unprofiled: the profiler's overhead on the launching
    thread would stretch the device parts' events."""
    from ktorch.compile.experts_runtime import RUNTIME
    from ktorch.integrations.transformers_experts import experts_modules

    routed = [m.kt_routed for _, m in experts_modules(model) if getattr(m, "kt_routed", None) is not None]
    calls: list = []
    for r in routed:
        r.calls = calls
    RUNTIME.timeline = []
    try:
        prefill(P)
        sync()
    finally:
        timeline, RUNTIME.timeline = RUNTIME.timeline, None
        for r in routed:
            r.calls = None
    shortest = min((r.min_tokens for r in routed), default=0)  # CPU op calls too short to split are not paired
    timeline = [t for t in timeline if t[2] >= shortest]
    return split_model_line(calls, timeline, costs) if calls and costs is not None else None


def prefill_profile(args) -> None:
    """Experiment (benchmark flag): is a warm prefill bound by the host (launches, Python, syncs) or by the GPU? Per
    --ktorch-args set, one process loads the model as ``ktorch generate`` does, then alternates --prefill-variants
    for --prefill-profile rounds over the --prompts lengths, timing ``Decoder.prefill`` + reading the first token (no
    hooks, no syncs but the prefill's own; each length's prefill captured first, as generate captures it for a
    length's third prompt on). Variants:
    ``default`` (what generate runs); ``sync-per-layer`` (the split's
    counts copied to the host at every MoE layer, as before commit 66e74df, whatever the placement); ``eager`` (the
    captured prefills set aside: what a length's first two prompts run, a one-shot generate's); ``refitted-law``
    (prefills captured after the default's, their split choosing with the CPU law as refitted to the eager calls
    observed until then, ``SplitCosts`` as they stand, instead of the calibration's, ``SplitCosts.calibrated``).
    (Lost to one stream, session 58 call 3, H200 host, 12 layers, 9 GiB, warm ms at P=512/2048: a split layer's
    resident experts' part on a high-priority side stream beside the copied experts' gather and kernels, skew 1.5
    16.7/31.6 against 16.8/32.0, skew 0 27.9/47.2 against 28.6/47.4: within noise, deleted.)
    (Lost to ``eager``
    as it is, session 49, H200 host, 12 layers, warm ms at P=512/2048, skew 0, host memory / 6 GiB; deleted after: the
    CPU op's inputs staged with each layer's counts read and the split's copy launched first after it, the chosen
    and resident experts masked out of the staged ids on the worker: 97.8/133.0 and 66.0/92.8 against 89.3/105.8 and
    62.7/82.6 (the GPU idle before the copy 0.91-1.20 ms a layer against 1.45-1.75, but the copy slower beside the
    CPU op's reads, 4.18 against 3.62 ms, and the GPU then waiting for the CPU op, 1.02 against 0.00 ms); every
    Triton kernel launched through its compiled kernel's launcher after the first call of a kind (a key of our own
    in place of JITFunction.run's binding and cache key): 2-5 us less a launch (bench, Triton 3.6: 16.5 against
    19.5 us a launch of the grouped sum, 30.9 against 36.0 of the route), ~16 launches a layer, within the noise on
    the clock (skew 1.5, 4 rounds: 40.8/52.0 against 42.4/52.2 at 6 GiB, 41.4/56.8 against 40.9/56.0 in host
    memory); the split copying nothing (residents on the GPU, every other expert on the CPU op, no counts read a
    layer), skew 1.5, 6 GiB: 155.2/524.7 against 52.5/54.4 (the residents held 99 of the 295 experts the prompt hit);
    the residents and the split's copies in one grouped pass (the kernels reading two sources, the residents' row
    layout and the copies' packed blocks, bit for bit the one-source result; 8 fewer launches a layer), skew 1.5,
    6 GiB, call 6: 50.1/59.3 against 50.6/60.7 with a pass each (the instance's copy 1.5 ms a layer, bound by the
    GPU's work): within noise, so the simpler two passes stay. Lost to the launch order kept, session 48, H200 host, 12
    layers, warm ms at P=512/2048: the eager split's copy launched right after the choice on a side stream (before the
    route and the CPU op's submit): on every SM it held the CPU op's input copies back until it ended (call 2, skew 0
    host memory 97.0/151.2 against 66.4/99.7); on half the SMs (call 3) it started 0.35 ms earlier but its launch
    delayed the CPU op's inputs, slower in all 8 cells (skew 1.5 host 40.9/64.5 against 40.4/59.5, 6GiB 43.4/57.5
    against 41.3/53.6; skew 0 72.8/104.9 against 69.2/99.1, 63.4/92.5 against 57.3/87.6). Deleted after its
    run here, session 48 call 1, H200 host, 12 layers, warm ms eager / device split: the eager split made on the
    device as a captured one, no host sync a layer, with twice the launches (1361 against 653): skew 1.5 host memory
    P=512/2048 55.1/64.1 against 58.2/57.5, 6GiB 68.9/64.7 against 79.3/83.8; skew 0 host 73.0/97.7 against
    57.3/86.6, 6GiB 64.3/82.0 against 66.9/73.1; profiled walls 77.5/100.1/64.6/87.4 against 85.6/93.8/86.7/95.2
    (skew 0): no consistent gain. Merged after their runs here: session 44, each attention's q, k and v from one
    product over the fused weight
    (``fused_qkv.eager_swapped``); session 46: the captured prefill (``Decoder.capture_prefill``, 10 of 12 cells
    faster, the other two tied: benchmarks/RESULTS.md section 2); session 35: the rows sorted by expert in three Triton
    launches, each RMSNorm one ``F.rms_norm``; the split's copies as one zero-copy gather a layer, which tied the
    per-run DMA copies on the clock (call 3, H200 host: off P=512/2048 355.5/481.5 ms against 340.0/510.8, 24GiB
    213.0/316.2 against 219.5/306.0) with ~8000 fewer ATen ops a prefill; the runs stay as its fallback.)
    (A prefill through the compiled layers with dynamic shapes lost to ``default``, session 33 on an H200 host:
    104.9 / 107.3 ms warm at P=512 / 2048 against 86.6 / 94.4, after an 11.5 s compile; deleted. Again in session 36,
    H200 host, one compile for every length (no duck shaping): every expert resident 87.8 / 87.0 ms against eager's
    63.2 / 78.5, 24GiB 267.9 / 359.3 against 211.8 / 327.5, with 1649 launches against 2417: the compiled graphs'
    own host time per call outweighs the launches saved; not merged.) Then one
    profiled prefill per variant and length: wall, GPU busy time (the union of kernels and copies), kernels
    launched, synchronizing CUDA calls the host made; before each, where the routing-aware split runs, an unprofiled
    prefill checks its cost model (``split_model_prefill``: the CPU op's and the device part's time per layer call,
    predicted by the calibrated SplitCosts against measured)."""
    import statistics
    from unittest import mock

    import torch
    from torch.profiler import ProfilerActivity, profile

    import ktorch
    from ktorch.cli import build_parser, load_model
    from ktorch.compile.experts_runtime import RUNTIME
    from ktorch.generation import Sampling, _decoder_for, captured_prefill_problem
    from ktorch.ops.routed_experts import RoutedExperts, SplitCosts

    def context(variant, decoder):
        stack = contextlib.ExitStack()
        if variant == "sync-per-layer":
            original = RoutedExperts.copies_possible
            RoutedExperts.copies_possible = lambda self, ids: True
            stack.callback(setattr, RoutedExperts, "copies_possible", original)
        if variant == "eager" or variant in own_graphs:  # no graphs (a length's first prompts), or the variant's
            graphs, decoder.prefill_graphs = decoder.prefill_graphs, variant_graphs.get(variant, {})
            stack.callback(setattr, decoder, "prefill_graphs", graphs)
        return stack

    own_graphs = {  # variants replaying prefills captured with their own code
        "refitted-law": lambda: mock.patch.object(SplitCosts, "calibrated", lambda self: self),
    }

    def capture(decoder, label):
        for P in args.prompts:  # as generate does after a length's second prompt (where the prefill is capturable)
            with torch.inference_mode():
                seconds = decoder.capture_prefill(P)
            why = captured_prefill_problem(decoder.model, decoder.cache, decoder.device) or (
                "its bucket's graph is kept" if decoder.prefill_bucket(P) in decoder.prefill_graphs else
                "refused: the captured prefills' pinned buffers are at their limit")
            print(f"[prefill {label}] P={P}: " + (f"prefill captured in {seconds:.2f} s" if seconds else
                  f"no new captured prefill ({why})"), flush=True)

    for extra in args.ktorch_args:
        cli = build_parser().parse_args(["generate", "--model", args.gguf, "--prompt", "x", *shlex.split(extra)])
        model, _, device = load_model(cli)
        label = extra or "defaults"
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        decoder = _decoder_for(model, max(args.prompts) + 1, Sampling(), cuda_graphs=True)
        prompts = {P: prompt_ids(P, args.prompt_kind).to(device) for P in args.prompts}
        variant_graphs: dict = {}
        capture(decoder, label)
        for variant, patch in own_graphs.items():  # their own graphs, captured with the variant's code
            if variant in args.prefill_variants:
                default_graphs, decoder.prefill_graphs = decoder.prefill_graphs, collections.OrderedDict()
                with patch():
                    capture(decoder, f"{label} {variant}")
                variant_graphs[variant], decoder.prefill_graphs = decoder.prefill_graphs, default_graphs
        times: dict = {}
        tokens: dict = {}  # (variant, P) -> the first tokens of its runs
        native: dict = {}  # (variant, P) -> the native host tasks' CPU op calls of its latest run: [(start, end)] ns

        def prefill(P: int, variant: str = None) -> float:
            sync()
            RUNTIME.take_native_timeline()
            t0 = time.perf_counter()
            token = int(decoder.prefill(prompts[P]).item())
            seconds = time.perf_counter() - t0
            if variant is not None:
                tokens.setdefault((variant, P), set()).add(token)
                native[(variant, P)] = [(s, e) for s, e, _ in RUNTIME.take_native_timeline()]
            return seconds

        costs = getattr(model, "kt_split_costs", None)

        def print_costs(when: str) -> None:  # what the routing-aware split decides from (calibrate_split_costs at
            if costs is not None:  # load, then refitted to the split's CPU calls: SplitCosts.refit_cpu)
                print(f"[prefill {label}] split costs {when}: h2d {costs.h2d_bytes_per_s / 1e9:.1f} GB/s, CPU op "
                      f"{1e3 * costs.cpu_fixed_s:.2f} ms + {1e9 * costs.cpu_row_s:.0f} ns a row + "
                      f"{1e6 * costs.cpu_expert_s:.0f} us an expert ({costs.refits} refits), device "
                      f"{1e9 * costs.device_row_s:.1f} ns a row + {1e6 * costs.device_expert_s:.0f} us an expert",
                      flush=True)
                law = costs.calibrated()  # what captured prefills choose with
                print(f"[prefill {label}] the calibration's CPU law (captured prefills'): {1e3 * law.cpu_fixed_s:.2f} "
                      f"ms + {1e9 * law.cpu_row_s:.0f} ns a row + {1e6 * law.cpu_expert_s:.0f} us an expert; its "
                      "points (rows, experts, ms): " + " ".join(f"({r:.0f}, {e:.0f}, {1e3 * t:.3f})"
                                                                for r, e, t in costs.calibration), flush=True)

        print_costs("before")
        with torch.inference_mode():
            for _ in range(args.prefill_profile):
                for variant in args.prefill_variants:
                    with context(variant, decoder):
                        for P in args.prompts:
                            times.setdefault((variant, P), []).append(prefill(P, variant))
            print_costs("after")
            for variant in args.prefill_variants:
                for P in args.prompts:
                    t = times[(variant, P)]
                    warm = statistics.median(t[1:]) if len(t) > 1 else t[0]
                    print(f"[prefill {label}] {variant:16s} P={P}: first token {1e3 * warm:.1f} ms warm (median of "
                          f"{max(len(t) - 1, 1)}; {P / warm:.0f} tok/s), run 0 {1e3 * t[0]:.1f} ms; first tokens "
                          f"{sorted(tokens[(variant, P)])}", flush=True)
                    calls = native.get((variant, P))
                    if calls:  # a replayed prefill's CPU op calls (the GPU handoff's native tasks), the latest run
                        ms = [(e - s) / 1e6 for s, e in calls]
                        print(f"[prefill {label}] {variant:16s} P={P}: {len(ms)} CPU op calls (native tasks) "
                              f"{sum(ms):.1f} ms, each " + " ".join(f"{m:.2f}" for m in ms), flush=True)
            for variant in args.prefill_variants:
                with context(variant, decoder):
                    for P in args.prompts:
                        line = split_model_prefill(model, P, prefill, sync, costs)
                        if line is not None:
                            print(f"[prefill {label}] {variant:16s} P={P} {line}", flush=True)
                        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                        if costs is not None:
                            ktorch.prefill_split_stats(model, reset=True)
                        with profile(activities=activities) as prof:
                            wall = prefill(P)
                        if costs is not None:
                            split = ktorch.prefill_split_stats(model, reset=True)
                            cpu_rows = split["rows"] - split["rows_copied"] - split["rows_resident"]
                            cpu_experts = split["experts_hit"] - split["experts_copied"] - split["resident_hit"]
                            print(f"[prefill {label}] {variant:16s} P={P} split: {split['experts_copied']} experts "
                                  f"copied ({split['bytes_copied'] / 1e9:.2f} GB), {split['experts_hit']} hit, "
                                  f"{split['resident_hit']} of them resident, {split['copied_unused']} copied unused; "
                                  f"the CPU op {cpu_rows} rows of {split['rows']} over {cpu_experts} experts",
                                  flush=True)
                        gpu = [(e.time_range.start, e.time_range.end) for e in prof.events()
                               if e.device_type == torch.autograd.DeviceType.CUDA]
                        syncs = sum(k.count for k in prof.key_averages() if k.key in _SYNC_CALLS)
                        launches = sum(k.count for k in prof.key_averages()
                                       if k.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                    "cudaLaunchKernelExC"))
                        anatomy = None
                        keep = args.profile_trace and variant == args.prefill_variants[0]
                        with tempfile.TemporaryDirectory() as tmp:
                            path = os.path.join(tmp, "trace.json")
                            if device.type == "cuda" or keep:
                                prof.export_chrome_trace(path)
                            if device.type == "cuda":
                                with open(path) as f:
                                    anatomy = layer_anatomy(json.load(f)["traceEvents"])
                            if keep:
                                import gzip

                                dest = f"{args.profile_trace}.{re.sub(r'[^A-Za-z0-9]+', '_', label)}.P{P}.json.gz"
                                with open(path, "rb") as f, gzip.open(dest, "wb") as g:
                                    g.write(f.read())
                                print(f"[prefill {label}] trace: {dest}", flush=True)
                        print(f"[prefill {label}] {variant:16s} P={P} profiled: wall {1e3 * wall:.1f} ms, GPU busy "
                              f"{_busy_ms(gpu):.1f} ms, {len(gpu)} GPU kernels/copies, {launches} launches, "
                              f"{syncs} synchronizing calls", flush=True)
                        if anatomy is not None:
                            print(f"[prefill {label}] {variant:16s} P={P} a layer (median of {anatomy['layers']}): "
                                  f"{anatomy['period']:.2f} ms, GPU busy {anatomy['gpu_busy']:.2f}, GPU idle before "
                                  f"the copy {anatomy['to_copy']:.2f}, copy {anatomy['copy']:.2f}, GPU waiting for "
                                  f"the CPU op {anatomy['cpu_wait']:.2f}, launching thread waiting "
                                  f"{anatomy['host_blocked']:.2f}: bound by {anatomy['bound']}", flush=True)
                        top = sorted(prof.key_averages(), key=lambda k: -k.device_time_total)[:8]
                        for k in top:
                            if k.device_time_total > 0:
                                print(f"        {k.device_time_total / 1e3:8.2f} ms  x{k.count:5d}  {k.key[:80]}")
                        calls = sorted((k for k in prof.key_averages() if k.key.startswith("aten::")),
                                       key=lambda k: -k.count)[:12]  # where the launches come from
                        print("        most called ATen ops: " + ", ".join(f"{k.key[6:]} {k.count}" for k in calls))
                        if args.prefill_cprofile:
                            _cprofiled(lambda: prefill(P), args.prefill_cprofile,
                                       f"[prefill {label}] {variant:16s} P={P} a warm prefill under cProfile")
        del model, decoder
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def cold_start(args) -> None:
    """Experiment (benchmark flag): the start-up issue 31 bounds (warm-up at most 15 s in a fresh process, 5 s on the
    second run). ``--cold-start N`` fresh ``ktorch generate`` processes as typed (``run_generate``: the first of
    --prompts, --gen new tokens, per --ktorch-args set), Triton's and Inductor's disk caches in a new empty folder for
    the first (what a fresh machine has, whatever this one has cached) and kept for the next ones (second runs): each
    one's load, warm-up prefill, decode capture and first token as it printed them. Then the first process once more
    from empty caches with its compiles listed (``--cold-start-child``: the same command in this interpreter, every
    Triton specialization ktorch's kernels compile with its seconds, and Dynamo/Inductor's ``compile_times``)."""
    import tempfile
    from unittest import mock

    def caches_in(folder: str) -> dict:
        return {"TRITON_CACHE_DIR": os.path.join(folder, "triton"),
                "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor")}

    prompt = args.prompts[0]
    for extra in args.ktorch_args:
        with tempfile.TemporaryDirectory(prefix="kt-cold-") as caches:
            with mock.patch.dict(os.environ, caches_in(caches)):  # run_generate's processes inherit them
                for run in range(args.cold_start):
                    r = run_generate(args.gguf, prompt, args.gen, shlex.split(extra), args.timeout, args.prompt_kind)
                    caches_then = "empty caches" if run == 0 else "caches of the ones before"
                    print(f"[cold start {extra or 'defaults'}] process {run} ({caches_then}): "
                          f"load {r.get('load_s', float('nan')):.1f} s (warm-up prefill and its captures "
                          f"{r.get('warmup_prefill_s', float('nan')):.2f} s), decode capture "
                          f"{r.get('capture_s', float('nan')):.2f} s, first token "
                          f"{r.get('first_token_s', float('nan')):.3f} s"
                          + (f"; error {r['error'][:300]}" if "error" in r else ""), flush=True)
        with tempfile.TemporaryDirectory(prefix="kt-cold-") as caches:
            env = dict(os.environ, **caches_in(caches))
            cmd = [sys.executable, os.path.abspath(__file__), "--gguf", args.gguf, "--cold-start-child",
                   "--prompts", str(prompt), "--gen", str(args.gen), "--prompt-kind", args.prompt_kind,
                   "--ktorch-args", extra]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
            lines = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if ln.startswith("[compiles")
                     or ln.startswith("    ")]
            print("\n".join(lines) if lines else f"[cold start] the compile listing failed (exit {proc.returncode}): "
                  + proc.stderr[-1500:], flush=True)


def cold_start_child(args) -> None:
    """``--cold-start``'s listing: ``ktorch generate`` (the command line's own function) in this process, its Triton
    compiles and Dynamo/Inductor's compile times printed after it."""
    from ktorch import cli

    extra = args.ktorch_args[0] if args.ktorch_args else ""
    cli_args = cli.build_parser().parse_args(["generate", "--model", args.gguf, "--prompt",
                                              prompt_of(args.prompts[0], args.prompt_kind), "--max-new-tokens",
                                              str(args.gen), *shlex.split(extra)])
    t0 = time.perf_counter()
    with _log_triton_compiles() as compiled:
        cli.cmd_generate(cli_args)
    wall = time.perf_counter() - t0
    seconds = sorted(compiled, key=lambda x: -x[0])
    print(f"[compiles {extra or 'defaults'}] generate {wall:.1f} s; ktorch's Triton kernels: {len(seconds)} "
          f"specializations compiled or loaded, {sum(s for s, _ in seconds):.2f} s, the largest:", flush=True)
    for _, line in seconds[:20]:
        print(f"    {line[:200]}", flush=True)
    from torch._dynamo.utils import compile_times

    print(f"[compiles {extra or 'defaults'}] Dynamo/Inductor compile_times (s):", flush=True)
    for line in str(compile_times(repr="str", aggregate=True)).splitlines():
        print(f"    {line[:200]}", flush=True)


def same_process(args) -> None:
    """--same-process N: per --ktorch-args set, one process loads the file as ``ktorch generate`` does (the command
    line's own loader and options) and generates from N different random prompts of each --prompts length through
    the command line's own generation call (``ktorch.cli.run_generation``, as `ktorch chat` or a Python user's
    repeated ``generate``), printing each prompt's prefill and decode rates: a length's first prompts are eager, and
    from its third on its prefill replays the graph captured after its second (``CAPTURE_AFTER``). Prompt i of a
    length is ``prompt_ids``' random bytes seeded by (length, i)."""
    import torch

    from ktorch.cli import TokenIdsTokenizer, build_parser as cli_parser, load_model, run_generation

    for extra in args.ktorch_args:
        cli = cli_parser().parse_args(["generate", "--model", args.gguf, "--prompt", "x", "--max-new-tokens",
                                       str(args.gen), *shlex.split(extra)])
        t0 = time.perf_counter()
        model, tokenizer, _ = load_model(cli)
        label = extra or "defaults"
        print(f"[same process {label}] loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        if not isinstance(tokenizer, TokenIdsTokenizer):
            raise SystemExit("--same-process: a file without a tokenizer (the prompt's bytes are its ids)")
        for P in args.prompts:
            for i in range(args.same_process):
                ids = prompt_ids(P, "random", seed=P * 1000 + i)
                with open(os.devnull, "w") as sink:
                    _, t = run_generation(model, tokenizer, ids, cli, out=sink)
                rate = f"{t.decode_tok_s:.1f}" if t.decode_tokens else "n/a"
                print(f"[same process {label}] P={P} prompt {i + 1}: prefill {1e3 * t.first_token_s:.1f} ms "
                      f"({t.prefill_tok_s:.0f} tok/s), decode {rate} tok/s, prefill capture after it "
                      f"{t.prefill_capture_s:.2f} s", flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True)
    p.add_argument("--write-layers", type=int, default=0, help="write a random qwen3moe file of N layers first")
    p.add_argument("--write-type", default="Q8_0")
    p.add_argument("--write-seed", type=int, default=11)
    p.add_argument("--write-router-skew", type=float, default=0.0,
                   help="Zipf-like routing of exponent ~S in the written file (write_random_qwen3moe_gguf router_skew; "
                   "0: near-uniform)")
    p.add_argument("--prompt-kind", choices=["text", "random"], default="text",
                   help="ktorch prompts: a repeated sentence (default) or random printable bytes")
    p.add_argument("--llama-n-cpu-moe", type=int, default=None, metavar="N",
                   help="llama.cpp with the experts of the first N layers on the CPU and the rest on the GPU "
                   "(llama-bench --n-cpu-moe N instead of -ot exps=CPU): the GPU-budget scenario")
    p.add_argument("--prompts", type=int, nargs="+", default=[512])
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--ktorch-args", nargs="*", default=[""], help="one string of generate options per setting")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=400)
    p.add_argument("--llama-bench", default=None)
    p.add_argument("--threads", default="15,16")
    p.add_argument("--flash-attn", default="0,1")
    p.add_argument("--load-mode", default="none")
    p.add_argument("--llama-reps", type=int, default=2)
    p.add_argument("--llama-timeout", type=float, default=300)
    p.add_argument("--skip-ktorch", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--ab-compile", type=int, default=0, metavar="ROUNDS",
                   help="experiment: in one process (model loaded once), ROUNDS alternations of ktorch.generate with "
                   "the captured step's decoder layers compiled (the default) and eager, per deferral in --deferred; "
                   "prints decode tok/s and capture s of each, then --profile-steps replays profiled")
    p.add_argument("--profile-steps", type=int, default=0)
    p.add_argument("--profile-trace", default=None, help="--ab-compile: the profiled replays as a Chrome trace; "
                   "--prefill-profile: the first variant's profiled prefill of each prompt length, per --ktorch-args "
                   "set, as PATH.<set>.P<n>.json.gz")
    p.add_argument("--ab-gpu-memory", default="auto", help="--ab-compile: the model's GPU memory option (off: every "
                   "expert on the CPU, the handoffs timed; auto, the default: every expert resident where it fits)")
    p.add_argument("--deferred", type=int, nargs="+", default=[0, 3])
    p.add_argument("--ab-variants", nargs="+", default=list(AB_VARIANTS), choices=AB_VARIANTS,
                   help="--ab-compile: the variants alternated (default: all; 'default' is the captured step as "
                   "generate makes it)")
    p.add_argument("--breakdown", type=int, default=0, metavar="RUNS",
                   help="experiment: per --ktorch-args set, one process (loaded as ktorch generate loads, its warm-up "
                   "included) times RUNS prefills of each --prompts length by part (attention, router/shared, routed "
                   "experts, the CPU op, the rest), with page faults and new CUDA segments: the first run is the "
                   "first prompt of that length")
    p.add_argument("--breakdown-cprofile", type=int, default=0, metavar="N",
                   help="--breakdown: run 0 of each length under cProfile, its N largest functions by own and by "
                   "cumulative time printed (the first prompt's extra time, by Python function)")
    p.add_argument("--breakdown-cold", action="store_true",
                   help="--breakdown without the load-time warm-up (ktorch.warm_up): run 0 is the process's cold first "
                   "prefill, what the warm-up takes out of the first prompt")
    p.add_argument("--same-process", type=int, default=0, metavar="N",
                   help="N prompts of each length in one process through the command line's generation call "
                   "(the first eager, the third on replaying the captured prefill): prefill and decode per prompt")
    p.add_argument("--cold-start", type=int, default=0, metavar="N",
                   help="experiment: N fresh ktorch generate processes per --ktorch-args set (the first of --prompts), "
                   "Triton's and Inductor's caches empty for the first and kept for the next; then the first again "
                   "with its compiles listed (issue 31's start-up)")
    p.add_argument("--cold-start-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prefill-profile", type=int, default=0, metavar="ROUNDS",
                   help="experiment: per --ktorch-args set, one process alternates --prefill-variants ROUNDS times over "
                   "the --prompts lengths (warm prefill times), then profiles one prefill of each: GPU busy time against "
                   "wall, kernels, launches and synchronizing calls (host-bound or GPU-bound)")
    p.add_argument("--prefill-cprofile", type=int, default=0, metavar="N",
                   help="--prefill-profile: then one warm prefill per variant and length under cProfile, its N "
                   "largest Python functions by own and by cumulative time printed (the launching thread's time)")
    p.add_argument("--prefill-variants", nargs="+", default=["default", "sync-per-layer"], choices=PREFILL_VARIANTS,
                   help="--prefill-profile: the variants alternated")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.prefill_profile:
        return prefill_profile(args)
    if args.same_process:
        return same_process(args)
    if args.cold_start_child:
        return cold_start_child(args)
    if args.cold_start:
        return cold_start(args)
    if args.ab_compile:
        return ab_compile(args)

    def emit(line: dict) -> None:
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")

    if args.write_layers and not os.path.exists(args.gguf):
        from ktorch.integrations.gguf_writer import write_random_qwen3moe_gguf

        t0 = time.perf_counter()
        write_random_qwen3moe_gguf(Path(args.gguf), args.write_type, num_layers=args.write_layers,
                                   seed=args.write_seed, progress=False, router_skew=args.write_router_skew)
        print(f"wrote {args.gguf} ({os.path.getsize(args.gguf) / 1e9:.1f} GB) in {time.perf_counter() - t0:.0f} s")
    if args.breakdown:
        return breakdown(args)
    rows = []
    if not args.skip_ktorch:
        for extra in args.ktorch_args:
            for prompt in args.prompts:
                for run in range(args.runs):
                    r = run_generate(args.gguf, prompt, args.gen, shlex.split(extra), args.timeout, args.prompt_kind)
                    r.update(kind="ktorch", args=extra, run=run, prompt=prompt)
                    rows.append(r)
                    emit(r)
    if args.llama_bench:
        from bench_vs_llamacpp import best_per_test, llama_bench_commands, run_llama_bench, setting_label

        cmds = llama_bench_commands(args.llama_bench, args.gguf, args.prompts, args.gen, args.threads,
                                    args.flash_attn, args.load_mode, "512,2048", args.llama_reps, [])
        if args.llama_n_cpu_moe is not None:  # experts of the last layers on the GPU, the first N's on the CPU
            for cmd in cmds:
                i = cmd.index("-ot")
                cmd[i:i + 2] = ["--n-cpu-moe", str(args.llama_n_cpu_moe)]
        records = run_llama_bench(cmds, Path(args.json or "/tmp/gen.jsonl").with_suffix(".llama.log"),
                                  args.llama_timeout)
        for name, r in sorted(best_per_test(records).items()):
            line = dict(kind="llama.cpp", test=name, tok_s=r["avg_ts"], setting=setting_label(r),
                        n_cpu_moe=args.llama_n_cpu_moe, gpu_smi_peak_gib=r.get("gpu_smi_peak_gib"))
            used = (f", GPU in use (nvidia-smi) peak {line['gpu_smi_peak_gib']:.2f} GiB"
                    if line["gpu_smi_peak_gib"] is not None else "")
            print(f"llama.cpp best {name}: {r['avg_ts']:.1f} tok/s ({line['setting']}){used}", flush=True)
            emit(line)
    print("\nktorch generate (as printed):")
    for r in rows:
        if "error" in r:
            print(f"  [{r['args'] or 'defaults'}] P={r['prompt']} run {r['run']}: {r['error'][:300]}")
            continue
        warm = f" (prefill warm-up {r['warmup_prefill_s']:.2f} s)" if "warmup_prefill_s" in r else ""
        print(f"  [{r['args'] or 'defaults'}] P={r['prompt']} run {r['run']}: load {r.get('load_s', 0):.1f} s{warm}, "
              f"prefill capture {r.get('prefill_capture_s', 0):.2f} s, first token {r['first_token_s']:.2f} s "
              f"({r['prefill_tok_s']:.0f} tok/s prefill, "
              f"{'replayed ' + str(r['prefill_replayed']) if r.get('prefill_replayed') else 'eager'}), capture "
              f"{r.get('capture_s', 0):.1f} s, decode {r['decode_tok_s']:.1f} tok/s, wall {r['wall_s']:.0f} s")
        if "experts_hit" in r:
            print(f"      split: experts hit per layer {r['hit_per_layer']}, copied {r['experts_copied']} experts "
                  f"({r['gb_copied']:.2f} GB) of {r['experts_hit']} hit, copied unused {r['copied_unused']}, rows on "
                  f"the GPU {r['rows_on_gpu_pct']:.1f}%")
        if "gpu_budget_gib" in r:
            rate = r.get("decode_resident_hit_rate")
            print(f"      GPU memory {r['gpu_used_gib']:.2f} of {r['gpu_budget_gib']:.2f} GiB planned, peak allocated "
                  f"{r.get('gpu_peak_gib', float('nan')):.2f} GiB, in use (nvidia-smi) peak "
                  f"{r.get('gpu_smi_peak_gib', float('nan')):.2f} GiB, "
                  f"{r['resident_per_layer']} resident experts per layer"
                  + (f", decode resident hit rate {100 * rate:.1f}%" if rate is not None else ""))


if __name__ == "__main__":
    main()
