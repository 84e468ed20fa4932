"""ktorch's kt.fused_moe against KTransformers' own CPU MoE kernels (kt-kernel), on the same layers and inputs.

One MoE layer's routed experts on the CPU, both sides given the same bf16 master weights, bf16 hidden states,
routing and top-k weights:
  ktorch     ktorch.pack_experts(..., dtype=fmt) + ktorch.fused_moe, at a kernel level/threshold "variant"
             (auto, avx512, amx, amx:N = KT_CPU_KERNEL=amx with the AMX gemms' small-M threshold at N rows for
             every format, through the private test hook kt::_amx_min_rows_for_tests: the sweep that chose the
             per-format constants of amx/kernels.cpp).
             Format q4k: GGUF Q4_K kept exact (int4 nibbles 0..15 with a scale and a minimum per group of 32, the
             scales at the file's two-level size), the master weights fit to Q4_K's values (q4k_codes) and placed
             as the GGUF loader places a file's Q4_K blocks (pack_quantized + pack_kscales); H, I multiples of 256.
             kt-kernel has no Q4_K: its row is AMXInt4_MOE (per channel), taken from the int4 run when int4 is
             measured too.
  kt-kernel  kt_kernel_ext.moe.AMXBF16_MOE / AMXInt8_MOE / AMXInt4_MOE built from the same bf16 tensors through
             a MOEConfig and load_weights_task (its online quantization), run with forward_task on a CPUInfer
             pool. Note its int4 is per output channel; ktorch's int4 is per group of --group-size.

Cold caches: each side cycles through enough distinct layers that their weights exceed --cold-factor x the L3
cache (read from lscpu/sysfs), with a fresh random routing every call, so a call does not find the experts of
the previous ones in cache. To keep set-up quick and memory bounded, layer i's master weights are
--distinct-experts random experts (seed i) tiled to all E experts: the same bytes and access pattern as fully
random weights, fine for timing, not for accuracy. Errors are measured apart, on a small instance with fully
random weights (--error-experts experts, --error-tokens tokens), against the float64 reference of
tests/reference.py, with the relative error ||out - ref|| / ||ref||.

Each (side, thread count) runs in a child process of its own: ktorch's worker pool is sized at its first
call (KT_NUM_THREADS), kt-kernel's at CPUInfer construction, and idle pools of the other side would compete
for cores. kt-kernel's CPUInfer pins its workers and spins; when they take every core the calling thread
waits for a time slice (calls then take multiples of ~8 ms), so the default sweep gives it cores-1 and cores
workers, and with --kt-pin-caller (default) pins the calling thread to the CPUs its workers do not get.

Columns: ms per call (median); effective TFLOPS (bf16) or TOPS (int8/int4) = 6*H*I*K*T / time; GB/s = bytes of
the distinct experts the routing touched / time (the decode roofline); rel. err vs the float64 reference.
The side-by-side table shows each side at its fastest thread count and variant for that row.

kt-kernel is not part of ktorch and nothing of it is committed: put a copy of kt-kernel 0.7.2 from the package
registry (its kt_kernel/ folder with the _kt_kernel_ext_*.so builds, and kt_kernel.libs/) in .peers/kt_kernel/
(git-ignored), e.g. from `pip download --no-deps --only-binary=:all: --python-version 3.12 kt-kernel==0.7.2`.
Its extension is loaded through kt-kernel's own loader (kt_kernel/_cpu_detect.py, which picks the build for
this CPU) without importing the rest of its package. It needs the Python it was built for (CPython 3.12);
where it cannot load, the script prints "kt-kernel not found (...)" and times ktorch alone.

    python benchmarks/bench_vs_kt_kernel.py                                   # Qwen3-30B-A3B and DeepSeek-V3 shapes
    python benchmarks/bench_vs_kt_kernel.py --shapes qwen3 --tokens 512 2048 --formats int8 \\
        --ktorch-variants avx512 amx:1 amx:4 amx:16 --kt-threads 15
    python benchmarks/bench_vs_kt_kernel.py --shapes qwen3 --formats int8 int4 q4k --tokens 512 2048 \\
        --kt-threads 15 --cold-factor 16 --min-seconds 0.3
    python benchmarks/bench_vs_kt_kernel.py --shapes tiny --no-kt              # quick check on any machine
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {  # name: (E, K, H, I)
    "qwen3": (128, 8, 2048, 768),
    "deepseek": (256, 8, 7168, 2048),
    "tiny": (32, 4, 256, 128),
}
DEFAULT_TOKENS = {"qwen3": [1, 32, 512, 2048], "deepseek": [1, 512], "tiny": [1, 16, 128]}
FORMATS = ("bf16", "int8", "int4", "q4k")
KT_CLASSES = {"bf16": "AMXBF16_MOE", "int8": "AMXInt8_MOE", "int4": "AMXInt4_MOE", "q4k": "AMXInt4_MOE"}
RESULT = "RESULT "


# ---------------------------------------------------------------- the machine
def lscpu() -> dict:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in out.splitlines() if ":" in line)}


def parse_size(text: str) -> int:
    """'300 MiB (2 instances)' or '32768K' -> bytes."""
    word = text.split("(")[0].strip().replace(" ", "")
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "B": 1}
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if word.endswith(unit):
            return int(float(word[: -len(unit)]) * mult)
    return int(word)


def l3_bytes() -> int:
    """All L3 of the machine (lscpu sums its instances), else cpu0's from sysfs, else 32 MiB."""
    info = lscpu()
    if "L3 cache" in info:
        with contextlib.suppress(ValueError):
            return parse_size(info["L3 cache"])
    base = "/sys/devices/system/cpu/cpu0/cache"
    with contextlib.suppress(OSError, ValueError):
        for idx in os.listdir(base):
            with open(os.path.join(base, idx, "level")) as f:
                if int(f.read()) == 3:
                    with open(os.path.join(base, idx, "size")) as f:
                        return parse_size(f.read().strip())
    return 32 << 20


def physical_cores() -> int:
    """Cores (not hyperthreads) among the CPUs this process may run on."""
    allowed = os.sched_getaffinity(0)
    try:
        out = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True).stdout
        cores = {tuple(line.split(",")[1:]) for line in out.splitlines()
                 if line and not line.startswith("#") and int(line.split(",")[0]) in allowed}
        return max(1, len(cores))
    except (OSError, subprocess.CalledProcessError, ValueError):
        return len(allowed)


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_lines() -> list[str]:
    import torch

    import ktorch

    info = lscpu()
    model = info.get("Model name", platform.processor() or "unknown CPU")
    flags = set(info.get("Flags", "").split())
    isa = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8") if f in flags]
    feats = ktorch.cpu_features()
    return [
        f"machine: {model}; {info.get('Socket(s)', '?')} socket(s), {physical_cores()} cores, "
        f"{len(os.sched_getaffinity(0))} CPUs usable; L3 {l3_bytes() / 2**20:.0f} MiB; "
        f"RAM {memory_bytes() / 2**30:.0f} GiB",
        f"ISA: {' '.join(isa) or 'no AVX-512/AMX flags'}; ktorch kernel levels: {','.join(feats['available'])} "
        f"(default {feats['kernel']}); torch {torch.__version__}; python {platform.python_version()}",
    ]


# ---------------------------------------------------------------- weights, routing, timing (children)
def expert_bytes(side: str, fmt: str, H: int, I: int, group_size: int) -> float:
    """Bytes of one expert's packed weights and scales (kt-kernel's int8/int4 scales are per output channel)."""
    n = 3 * H * I
    if fmt == "bf16":
        return 2 * n
    if fmt == "q4k" and side == "ktorch":  # nibbles; per 256 weights 8 sub-scales + 8 sub-minimums + 2 float32 supers
        return n / 2 + n * 24 / 256
    if fmt == "q4k":
        fmt = "int4"
    if fmt == "int8" or side == "kt":
        return n * (1 if fmt == "int8" else 0.5) + 4 * (2 * I + H)
    return n / 2 + 4 * (2 * I * H + H * I) / group_size


def q4k_codes(w):
    """w [n, N, K] float (K a multiple of 256) as GGUF Q4_K's values: (codes uint8 0..15 [n, N, K], sub-scales and
    sub-minimums uint8 0..63 [n, N, K/32], super-scales d and dmin float32 [n, N, K/256]), w ~ d*sc*u - dmin*m per
    group of 32 (a plain min/max fit, not llama.cpp's search: the layout and the kernel's work are what is timed)."""
    import torch

    n, N, K = w.shape
    g = w.float().reshape(n, N, K // 256, 8, 32)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale, mn = (hi - lo) / 15, -lo
    d, dmin = scale.amax(-1, keepdim=True) / 63, mn.amax(-1, keepdim=True) / 63
    sc = torch.where(d > 0, scale / d.clamp(min=1e-30), 0).round().clamp(0, 63)
    m = torch.where(dmin > 0, mn / dmin.clamp(min=1e-30), 0).round().clamp(0, 63)
    s_eff, m_eff = (d * sc).unsqueeze(-1), (dmin * m).unsqueeze(-1)
    u = torch.where(s_eff > 0, (g + m_eff) / s_eff.clamp(min=1e-30), 0).round().clamp(0, 15)
    return (u.reshape(n, N, K).to(torch.uint8), sc.reshape(n, N, K // 32).to(torch.uint8),
            m.reshape(n, N, K // 32).to(torch.uint8), d.reshape(n, N, K // 256), dmin.reshape(n, N, K // 256))


def q4k_experts(gate_up, down):
    """ktorch.PackedExperts in GGUF Q4_K kept exact (format "gguf:Q4_K") from bf16 master experts (gate_up
    [n, 2I, H], down [n, H, I]): q4k_codes placed as the GGUF loader places a file's Q4_K blocks (pack_quantized for
    the codes, pack_kscales for the scales at the file's two-level size)."""
    import ktorch
    from ktorch.ops.moe import pack_kscales, pack_quantized

    def part(w, gate_up_rows: bool):
        codes, sc, m, d, dmin = q4k_codes(w)
        scales = (d.repeat_interleave(8, dim=-1) * sc.float()).contiguous()
        mins = (dmin.repeat_interleave(8, dim=-1) * m.float()).contiguous()
        packed, _ = pack_quantized(codes, scales, mins, bits=4, gate_up=gate_up_rows)
        return packed, pack_kscales(sc, d.contiguous(), m, dmin.contiguous(), gate_up=gate_up_rows)

    w13, s13 = part(gate_up, True)
    w2, s2 = part(down, False)
    return ktorch.PackedExperts(w13, s13, w2, s2, "gguf:Q4_K")


def pack_for(fmt: str, gate_up, down, group_size):
    """The ktorch side's packed experts of one format (q4k: q4k_experts; int4 with group_size)."""
    import ktorch

    if fmt == "q4k":
        return q4k_experts(gate_up, down)
    return ktorch.pack_experts(gate_up, down, dtype=fmt, group_size=group_size if fmt == "int4" else None)


def master_experts(n: int, H: int, I: int, seed: int):
    """n random experts in bf16: gate_up [n, 2I, H] (gate rows, then up rows) and down [n, H, I]."""
    import torch

    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(n, 2 * I, H, generator=g).mul_(H**-0.5).to(torch.bfloat16)
    down = torch.randn(n, H, I, generator=g).mul_(I**-0.5).to(torch.bfloat16)
    return gate_up, down


def tiled(t, E: int, huge_pages: bool = False):
    """t [D, ...] repeated along dim 0 to E entries (expert e = t[e % D]), contiguous; huge_pages: in memory advised
    onto transparent huge pages before its first touch, as ktorch's pack ops allocate packed weights."""
    import torch

    index = torch.arange(E) % t.shape[0]
    if not huge_pages:
        return t[index].contiguous()
    from ktorch.ops.moe import empty_weights

    return torch.index_select(t, 0, index, out=empty_weights((E, *t.shape[1:]), t.dtype))


def random_routing(T: int, E: int, K: int, rng):
    """(topk_ids [T, K] int64, topk_weights [T, K] fp32 summing to 1 per token) from random router logits.

    Drawn with numpy on the calling thread alone: torch ops here would leave ATen's OpenMP threads spinning
    into the timed call, competing with the pinned workers of either side."""
    import numpy as np
    import torch

    logits = rng.standard_normal((T, E), dtype=np.float32)
    ids = np.argpartition(-logits, K - 1, axis=1)[:, :K]
    top = np.take_along_axis(logits, ids, axis=1)
    w = np.exp(top - top.max(axis=1, keepdims=True))
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy((w / w.sum(axis=1, keepdims=True)).astype(np.float32))


def random_hidden(T: int, H: int, gen=None):
    import torch

    return torch.randn(T, H, generator=gen).to(torch.bfloat16)


def n_layers_for(layer_bytes: float, l3: int, cold_factor: float) -> int:
    return max(2, math.ceil(cold_factor * l3 / layer_bytes))


def time_calls(call, layers, T, E, K, H, min_calls, min_seconds):
    """Median seconds of call(layer, x, ids, w), cycling through layers, a fresh routing every call; and the
    mean number of distinct experts a routing touched."""
    import numpy as np

    rng = np.random.default_rng(T)
    inputs = [random_hidden(T, H) for _ in range(2)]
    for layer in layers[:2]:  # warm-up: first touch, allocators, thread pools
        call(layer, inputs[0], *random_routing(T, E, K, rng))
    times, distinct = [], []
    start = time.perf_counter()
    i = 0
    while i < min_calls or time.perf_counter() - start < min_seconds:
        ids, w = random_routing(T, E, K, rng)
        distinct.append(len(np.unique(ids.numpy())))
        t0 = time.perf_counter()
        call(layers[i % len(layers)], inputs[i % 2], ids, w)
        times.append(time.perf_counter() - t0)
        i += 1
        if i >= 10 * min_calls and time.perf_counter() - start > min_seconds:
            break
    return statistics.median(times), statistics.mean(distinct)


def emit(**kw) -> None:
    print(RESULT + json.dumps(kw), flush=True)


@contextlib.contextmanager
def variant_env(env: dict):
    """Sets KT_CPU_KERNEL as a ktorch variant names it (cleared otherwise) and, for amx:N, the AMX gemms' small-M
    threshold (env["amx_min_rows"]), for the duration."""
    import torch

    saved = os.environ.get("KT_CPU_KERNEL")
    if "KT_CPU_KERNEL" in env:
        os.environ["KT_CPU_KERNEL"] = env["KT_CPU_KERNEL"]
    else:
        os.environ.pop("KT_CPU_KERNEL", None)
    if "amx_min_rows" in env:
        torch.ops.kt._amx_min_rows_for_tests(env["amx_min_rows"])
    try:
        yield
    finally:
        if "amx_min_rows" in env:
            torch.ops.kt._amx_min_rows_for_tests(-1)
        if saved is None:
            os.environ.pop("KT_CPU_KERNEL", None)
        else:
            os.environ["KT_CPU_KERNEL"] = saved


def ktorch_variants(names: list[str], available: list[str]):
    """[(label, env)] for the variants this machine runs, and [(label, reason)] for the others."""
    runs, skipped = [], []
    for name in names:
        level, _, rest = name.partition(":")
        if level == "auto":
            runs.append((name, {}))
            continue
        if level not in available:
            skipped.append((name, f"kernel level {level} is not available here ({','.join(available)})"))
            continue
        env = {"KT_CPU_KERNEL": level}
        if rest:
            env["amx_min_rows"] = int(rest)
        runs.append((name, env))
    return runs, skipped


def reference_tools():
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from reference import fused_moe_reference, relative_error

    return fused_moe_reference, relative_error


def error_instance(spec: dict):
    """The small, fully random instance errors are measured on, with its float64 reference output."""
    import torch

    E, K, H, I = spec["shape_dims"]
    Ee, T = spec["error_experts"], spec["error_tokens"]
    gate_up, down = master_experts(Ee, H, I, seed=10_000)
    import numpy as np

    x = random_hidden(T, H, torch.Generator().manual_seed(10_001))
    ids, w = random_routing(T, Ee, min(K, Ee), np.random.default_rng(10_002))
    fused_moe_reference, _ = reference_tools()
    return gate_up, down, x, ids, w, fused_moe_reference(x, ids, w, gate_up, down)


def child_ktorch(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    import ktorch

    E, K, H, I = spec["shape_dims"]
    fmt, gs = spec["format"], spec["group_size"]
    runs, skipped = ktorch_variants(spec["variants"], ktorch.cpu_features()["available"])
    for label, reason in skipped:
        emit(kind="skip", side="ktorch", variant=label, reason=reason)
    if not runs:
        return
    _, relative_error = reference_tools()

    if spec["error_tokens"] > 0:
        gate_up, down, x, ids, w, ref = error_instance(spec)
        packed = pack_for(fmt, gate_up, down, gs)
        for label, env in runs:
            with variant_env(env):
                err = relative_error(ktorch.fused_moe(x, ids, w, packed), ref)
            emit(kind="error", side="ktorch", variant=label, error=err)
        del gate_up, down, packed, ref
        gc.collect()

    per_layer = E * expert_bytes("ktorch", fmt, H, I, spec["group_size"])
    n = n_layers_for(per_layer, spec["l3"], spec["cold_factor"])
    t0 = time.perf_counter()
    layers = []
    for i in range(n):
        gate_up, down = master_experts(spec["distinct_experts"], H, I, seed=i)
        p = pack_for(fmt, gate_up, down, gs)
        layers.append(ktorch.PackedExperts(tiled(p.w13, E, True), None if p.w13_scales is None else tiled(p.w13_scales, E),
                                           tiled(p.w2, E, True), None if p.w2_scales is None else tiled(p.w2_scales, E),
                                           p.format, p.group_size))
        del gate_up, down, p
    from bench_fused_moe import huge_pages_note

    print(f"    ktorch {fmt}: {n} layers x {per_layer / 2**30:.2f} GiB packed in {time.perf_counter() - t0:.0f} s; "
          f"{huge_pages_note()}",
          flush=True)

    def call(layer, x, ids, w):
        return ktorch.fused_moe(x, ids, w, layer)

    for T in spec["tokens"]:
        for label, env in runs:
            with variant_env(env):
                kernel = torch.ops.kt.selected_kernel()
                sec, distinct = time_calls(call, layers, T, E, K, H, spec["min_calls"], spec["min_seconds"])
            emit(kind="time", side="ktorch", variant=f"{label}" if label != "auto" else f"auto({kernel})", T=T,
                 sec=sec, distinct=distinct, bytes=distinct * expert_bytes("ktorch", fmt, H, I, spec["group_size"]))


def kt_kernel_dir(path: str):
    """The kt_kernel/ package folder: under `path`, else the installed package's; None when neither exists."""
    if path and os.path.isdir(os.path.join(path, "kt_kernel")):
        return os.path.join(path, "kt_kernel")
    import importlib.util

    found = importlib.util.find_spec("kt_kernel")
    return list(found.submodule_search_locations)[0] if found and found.submodule_search_locations else None


def load_kt_kernel(path: str):
    """(extension module, its CPU variant), loaded by kt-kernel's own loader (kt_kernel/_cpu_detect.py), which picks
    the best build for this CPU. Importing the kt_kernel package itself would also pull in its model-loading
    wrappers and their dependencies (gguf, safetensors, ...), which the kernels do not need."""
    import importlib.util

    folder = kt_kernel_dir(path)
    if folder is None:
        raise ImportError(f"no kt_kernel package in {path} and none installed")
    spec = importlib.util.spec_from_file_location("kt_kernel_cpu_detect", os.path.join(folder, "_cpu_detect.py"))
    loader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loader)
    ext, variant = loader.initialize()
    return ext, variant


def child_kt(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    try:
        ext, variant = load_kt_kernel(spec["kt_path"])
    except Exception as err:  # an ImportError, or its loader refusing this CPU
        emit(kind="peer_missing", reason=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return
    fmt = spec["format"]
    cls = getattr(ext.moe, KT_CLASSES[fmt], None)
    if cls is None:
        emit(kind="skip", side="kt", variant=KT_CLASSES[fmt], reason="not in this kt-kernel build")
        return
    emit(kind="peer_info", variant=variant, int8_kernel=getattr(ext, "__int8_kernel__", "?"))
    E, K, H, I = spec["shape_dims"]
    threads = spec["threads"]
    cpu_infer = ext.CPUInfer(threads)
    if spec["kt_pin_caller"]:
        cpus = sorted(os.sched_getaffinity(0))
        rest = cpus[threads:]
        if rest:  # its workers take the first CPUs; give the calling thread the others
            os.sched_setaffinity(0, rest)
            print(f"    kt-kernel: {threads} workers, calling thread pinned to CPUs {rest[0]}-{rest[-1]}", flush=True)
    max_len = -(-max(spec["tokens"] + [spec["error_tokens"]]) // 32) * 32  # kt-kernel wants a multiple of 32
    keep = []  # what the layers' pointers refer to

    def build(gate, up, down, experts: int, layer_idx: int):
        """One kt-kernel layer from contiguous bf16 gate, up [E, I, H] and down [E, H, I]; it copies/quantizes them."""
        mask = torch.zeros(experts, dtype=torch.bool)  # no expert on a GPU
        p2l = torch.arange(experts, dtype=torch.int64)
        cfg = ext.moe.MOEConfig(experts, min(K, experts), H, I, mask.data_ptr())
        cfg.layer_idx = layer_idx
        cfg.max_len = max_len
        cfg.pool = cpu_infer.backend_
        cfg.gate_proj, cfg.up_proj, cfg.down_proj = gate.data_ptr(), up.data_ptr(), down.data_ptr()
        moe = cls(cfg)
        cpu_infer.submit(moe.load_weights_task(p2l.data_ptr()))
        cpu_infer.sync()
        if hasattr(moe, "warm_up_task"):
            cpu_infer.submit(moe.warm_up_task())
            cpu_infer.sync()
        keep.append(mask)
        return moe

    outs = {}

    def call(moe, x, ids, w):
        T = x.shape[0]
        if T not in outs:
            outs[T] = (torch.empty(T, H, dtype=torch.bfloat16), torch.tensor([T], dtype=torch.int32))
        out, bsz = outs[T]
        cpu_infer.submit(moe.forward_task(bsz.data_ptr(), ids.shape[1], ids.data_ptr(), w.data_ptr(), x.data_ptr(),
                                          out.data_ptr(), False))
        cpu_infer.sync()
        return out

    _, relative_error = reference_tools()
    if spec["error_tokens"] > 0:
        gate_up, down, x, ids, w, ref = error_instance(spec)
        moe = build(gate_up[:, :I].contiguous(), gate_up[:, I:].contiguous(), down, gate_up.shape[0], layer_idx=1000)
        emit(kind="error", side="kt", variant="kt", error=relative_error(call(moe, x, ids, w), ref))
        del gate_up, down, moe, ref
        gc.collect()

    per_layer = E * expert_bytes("kt", fmt, H, I, spec["group_size"])
    n = n_layers_for(per_layer, spec["l3"], spec["cold_factor"])
    t0 = time.perf_counter()
    layers = []
    for i in range(n):
        base_gate_up, base_down = master_experts(spec["distinct_experts"], H, I, seed=i)
        layers.append(build(tiled(base_gate_up[:, :I], E), tiled(base_gate_up[:, I:], E), tiled(base_down, E), E,
                            layer_idx=i))  # the bf16 master (3 tensors) is freed on return
        del base_gate_up, base_down
        gc.collect()
    print(f"    kt-kernel {fmt}: {n} layers x {per_layer / 2**30:.2f} GiB built in {time.perf_counter() - t0:.0f} s",
          flush=True)
    for T in spec["tokens"]:
        sec, distinct = time_calls(call, layers, T, E, K, H, spec["min_calls"], spec["min_seconds"])
        emit(kind="time", side="kt", variant=KT_CLASSES[fmt], T=T, sec=sec, distinct=distinct,
             bytes=distinct * expert_bytes("kt", fmt, H, I, spec["group_size"]))


# ---------------------------------------------------------------- the parent: sweep, tables
def run_child(spec: dict, env_extra: dict) -> list[dict]:
    env = dict(os.environ, **env_extra)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    results, tail = [], []
    for line in proc.stdout:
        line = line.rstrip("\n")
        if line.startswith(RESULT):
            results.append(json.loads(line[len(RESULT):]))
            r = results[-1]
            if r["kind"] == "time":
                print(f"    {r['side']:<6} {r['variant']:<14} T={r['T']:<5} {r['sec'] * 1e3:10.3f} ms", flush=True)
        else:
            tail = (tail + [line])[-30:]
            if line.startswith("    "):
                print(line, flush=True)
    if proc.wait() != 0:
        print(f"  child failed (exit {proc.returncode}); its last output:\n    " + "\n    ".join(tail), flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen3", "deepseek"], choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=None,
                    help="token counts T for every shape (default: qwen3 1 32 512 2048, deepseek 1 512)")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    ap.add_argument("--ktorch-threads", nargs="+", type=int, default=None, help="default: the physical cores")
    ap.add_argument("--kt-threads", nargs="+", type=int, default=None, help="default: cores-1 and cores")
    ap.add_argument("--ktorch-variants", nargs="+", default=["auto"],
                    help="auto | portable | avx512 | amx | amx:N (AVX-512 below N rows for every format)")
    ap.add_argument("--kt-path", default=os.environ.get("KT_KERNEL_PATH", os.path.join(ROOT, ".peers", "kt_kernel")),
                    help="folder holding kt_kernel/ (default: $KT_KERNEL_PATH or .peers/kt_kernel)")
    ap.add_argument("--no-kt", action="store_true", help="time ktorch only")
    ap.add_argument("--no-ktorch", action="store_true", help="time kt-kernel only")
    ap.add_argument("--kt-pin-caller", action=argparse.BooleanOptionalAction, default=True,
                    help="pin the thread calling kt-kernel to the CPUs its workers do not take (default on)")
    ap.add_argument("--group-size", type=int, default=128, help="ktorch int4 group size (q4k: Q4_K's 32)")
    ap.add_argument("--cold-factor", type=float, default=3.0, help="layers cycled: weights >= this x L3")
    ap.add_argument("--distinct-experts", type=int, default=4, help="random experts per timing layer, tiled to E")
    ap.add_argument("--error-tokens", type=int, default=64, help="0: no error measurement")
    ap.add_argument("--error-experts", type=int, default=16)
    ap.add_argument("--min-calls", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument("--memory-budget-gb", type=float, default=None, help="skip runs above this (default: 80%% of RAM)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.child:
        spec = json.loads(args.child)
        (child_ktorch if spec["side"] == "ktorch" else child_kt)(spec)
        return

    for name in args.ktorch_variants:
        level, _, rest = name.partition(":")
        if level not in ("auto", "portable", "avx2", "avx512", "amx") or (
                rest and (level != "amx" or not rest.isdigit())):
            ap.error(f"--ktorch-variants: unknown variant {name!r} (auto, portable, avx2, avx512, amx, amx:N)")
    for line in machine_lines():
        print(line)
    cores = physical_cores()
    l3 = l3_bytes()
    budget = (args.memory_budget_gb or 0.8 * memory_bytes() / 2**30) * 2**30
    ktorch_threads = args.ktorch_threads or [cores]
    kt_threads = args.kt_threads or sorted({max(1, cores - 1), cores})
    sides = [] if args.no_ktorch else ["ktorch"]
    kt_note = None
    if not args.no_kt:
        if kt_kernel_dir(args.kt_path):
            sides.append("kt")
        else:
            kt_note = f"kt-kernel not found (no {args.kt_path}/kt_kernel, and no kt_kernel package installed)"
            print(kt_note)
    print(f"cold caches: layers cycled until their weights exceed {args.cold_factor:g} x L3 = "
          f"{args.cold_factor * l3 / 2**20:.0f} MiB; fresh routing every call; memory budget {budget / 2**30:.0f} GiB")
    print(f"threads: ktorch {ktorch_threads}, kt-kernel {kt_threads}; ktorch variants {args.ktorch_variants}")

    rows = []  # one per timed (shape, fmt, T, side, variant, threads)
    errors = {}  # (side, shape, fmt, variant) -> relative error; kt-kernel's variant is "kt"
    kt_info = None
    for shape in args.shapes:
        E, K, H, I = SHAPES[shape]
        tokens = args.tokens or DEFAULT_TOKENS[shape]
        for fmt in args.formats:
            if fmt == "q4k" and (H % 256 or I % 256):
                print(f"skip q4k on {shape}: Q4_K's blocks of 256 need H={H} and I={I} multiples of 256")
                continue
            for side in list(sides):
                if side == "kt" and fmt == "q4k" and "int4" in args.formats:
                    print(f"{shape} q4k, kt: kt-kernel has no Q4_K; its int4 (AMXInt4_MOE) row stands beside it")
                    continue
                per_layer = E * expert_bytes(side, fmt, H, I, args.group_size)
                n = n_layers_for(per_layer, l3, args.cold_factor)
                need = n * per_layer + E * 3 * H * I * 2 * (side == "kt")  # kt-kernel also holds a bf16 master
                if need > budget:
                    print(f"skip {side} {fmt} on {shape}: {n} layers need ~{need / 2**30:.0f} GiB, over the budget")
                    continue
                for i, threads in enumerate(ktorch_threads if side == "ktorch" else kt_threads):
                    print(f"{shape} {fmt}, {side}, {threads} threads:", flush=True)
                    spec = dict(side=side, shape=shape, shape_dims=[E, K, H, I], format=fmt, tokens=tokens,
                                threads=threads, variants=args.ktorch_variants, group_size=args.group_size,
                                l3=l3, cold_factor=args.cold_factor, distinct_experts=args.distinct_experts,
                                error_tokens=args.error_tokens if i == 0 else 0, error_experts=args.error_experts,
                                min_calls=args.min_calls, min_seconds=args.min_seconds, kt_path=args.kt_path,
                                kt_pin_caller=args.kt_pin_caller)
                    env = {"KT_NUM_THREADS": str(threads)} if side == "ktorch" else {}
                    for r in run_child(spec, env):
                        if r["kind"] == "peer_missing":
                            kt_note = f"kt-kernel not found ({r['reason']})"
                            print(kt_note)
                            sides.remove("kt")
                        elif r["kind"] == "peer_info":
                            kt_info = r
                        elif r["kind"] == "skip":
                            print(f"  skip {r['side']} {r['variant']}: {r['reason']}")
                        elif r["kind"] == "error":
                            errors[(side, shape, fmt, r["variant"])] = r["error"]
                            if side == "kt" and fmt == "int4" and "q4k" in args.formats:
                                errors[(side, shape, "q4k", r["variant"])] = r["error"]
                            print(f"    {side:<6} {r['variant']:<14} rel. error {r['error']:.2e}")
                        elif r["kind"] == "time":
                            rows.append(dict(shape=shape, fmt=fmt, T=r["T"], side=side, variant=r["variant"],
                                             threads=threads, sec=r["sec"], distinct=r["distinct"], bytes=r["bytes"]))
                            if side == "kt" and fmt == "int4" and "q4k" in args.formats:  # (kt-kernel has no Q4_K)
                                rows.append(dict(rows[-1], fmt="q4k"))
                    if side not in sides:
                        break
            gc.collect()
    print_tables(rows, errors, kt_info, kt_note)


def print_tables(rows: list[dict], errors: dict, kt_info, kt_note) -> None:
    print()
    if kt_info:
        print(f"kt-kernel: extension variant {kt_info['variant']}, int8 kernel {kt_info['int8_kernel']}")
    elif kt_note:
        print(kt_note)
    if not rows:
        print("no results")
        return

    def eff(r):
        E, K, H, I = SHAPES[r["shape"]]
        return 6 * H * I * K * r["T"] / r["sec"] / 1e12

    def gbs(r):
        return r["bytes"] / r["sec"] / 1e9

    def err(r):
        variant = "kt" if r["side"] == "kt" else r["variant"].split("(")[0]
        e = errors.get((r["side"], r["shape"], r["fmt"], variant))
        return "-" if e is None else f"{e:.2e}"

    print("\nAll runs (eff. = 6*H*I*K*T / time: TFLOPS for bf16, TOPS for int8/int4):\n")
    print("| shape | fmt | T | side | variant | threads | ms | eff. | GB/s | rel. err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['fmt']} | {r['T']} | {r['side']} | {r['variant']} | {r['threads']} | "
              f"{r['sec'] * 1e3:.3f} | {eff(r):.2f} | {gbs(r):.1f} | {err(r)} |")

    best = {}
    for r in rows:
        key = (r["shape"], r["fmt"], r["T"], r["side"])
        if key not in best or r["sec"] < best[key]["sec"]:
            best[key] = r
    print("\nSide by side, each at its best variant and thread count (speed-up = kt ms / ktorch ms):\n")
    print("| shape | fmt | T | ktorch ms | ktorch config | kt ms | kt threads | speed-up | ktorch eff. | kt eff. | "
          "ktorch GB/s | kt GB/s | ktorch err | kt err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    order = list(SHAPES)
    for shape, fmt, T in sorted({k[:3] for k in best}, key=lambda k: (order.index(k[0]), FORMATS.index(k[1]), k[2])):
        a, b = best.get((shape, fmt, T, "ktorch")), best.get((shape, fmt, T, "kt"))
        cells = [shape, fmt, str(T)]
        cells += [f"{a['sec'] * 1e3:.3f}", f"{a['variant']}, {a['threads']}t"] if a else ["-", "-"]
        cells += [f"{b['sec'] * 1e3:.3f}", str(b["threads"])] if b else ["-", "-"]
        cells.append(f"{b['sec'] / a['sec']:.2f}x" if a and b else "-")
        cells += [f"{eff(a):.2f}" if a else "-", f"{eff(b):.2f}" if b else "-"]
        cells += [f"{gbs(a):.1f}" if a else "-", f"{gbs(b):.1f}" if b else "-"]
        cells += [err(a) if a else "-", err(b) if b else "-"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
