"""Side-by-side timing of one MoE layer's routed experts on the CPU.

Compares ktorch's kt.fused_moe (bf16 / int8 / int4 weights) with what a transformers user runs today on
the CPU: the experts module's "eager" loop over experts (oneDNN GEMMs per expert) and, where it runs, its
"grouped_mm" path, on the same random bf16 inputs, in one process.

Cold caches: the layer is replicated until the weights of all copies exceed 16x the L3 cache (as far as memory
allows), and calls cycle through the copies and through a set of random routings whose count shares no factor with
the copies' (so a copy meets another routing each time round: with 8 routings and 8 copies a T = 1 call met the same
experts of the same copy every 8th call, 8 x 8 experts of ~5 MB, and read them from a 300 MiB L3 at up to 176% of the
DRAM bandwidth); a call does not find the experts of the previous ones in cache. Random weights are generated
directly in each implementation's layout (any bytes are valid packed weights); numerical accuracy is the test suite's
job, not this script's.

Columns: ms per call (median), tokens/s, effective TFLOPS = 6*H*I*K*T / time, GB/s = bytes of the
distinct experts the routing touched / time (the decode roofline), and each as a % of what this machine
measures for itself at start: DRAM read bandwidth (a large fp32 sum) and the dot-product peak
(vdpbf16ps for bf16 and the eager baselines, vpdpbusd for int8/int4).

    python benchmarks/bench_fused_moe.py                      # Qwen3-30B-A3B and DeepSeek-V3 layer shapes
    python benchmarks/bench_fused_moe.py --shapes qwen3 --tokens 1 512 --impls ktorch-int8 eager
    python benchmarks/bench_fused_moe.py --shapes qwen3 --tokens 512 --impls ktorch-int8 --profile
    python benchmarks/bench_fused_moe.py --shapes qwen3 --tokens 1 512 2048 --impls ktorch-int8 ktorch-q4_k ktorch-q4_k_m

ktorch-q8_0, -q6_k, -q5_k, -q4_k, -q4_k_m (Q4_K gate/up, Q6_K down), -q4_0, -mxfp4: the GGUF types kept exact
(docs/loading.md), their codes and fp32 group scales (and minimums) counted in the GB/s column (-q4_k_2l, -q6_k_2l,
-q5_k_2l, -q4_k_m_2l: the same with two-level scales at the file's size; -q8_0_2l: float16 scales); -mxfp4_int8: MXFP4 as
int8 codes (a byte each), the form the 4-bit codes replaced. gpt-oss-120b's shape (--shapes gpt-oss-120b) runs them
with silu and no biases (the activation and biases cost the same in both forms).

--pages huge 4k: the ktorch rows on both kinds of pages, taking turns (ktorch's pack ops allocate packed weights on
transparent huge pages, so "huge", the default, is what users get; the rows on 4 KiB pages are named .../4k).

--profile: after timing each ktorch row, a few more calls run with KT_PROFILE=1 (the op prints its phase
times to stderr, see ktorch/csrc/moe/fused_moe.cpp); their per-phase medians are printed under the row.

--env-variants: each ktorch row is timed once per variant, a list of settings the op reads on every call (e.g.
KT_CPU_KERNEL=avx512; '-': none), on the same layer copies and routings, the variants taking turns at each T; the
rows are named e.g. ktorch-int8/KT_CPU_KERNEL=avx512:

    python benchmarks/bench_fused_moe.py --shapes qwen3 --tokens 1 512 --impls ktorch-int8 \
        --env-variants - KT_CPU_KERNEL=avx512 --profile
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import platform
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

import ktorch
from ktorch.ops.moe import int4_two_level

SHAPES = {  # name: (E, K, H, I)
    "qwen3": (128, 8, 2048, 768),
    "deepseek": (256, 8, 7168, 2048),
    "gpt-oss-120b": (128, 4, 2880, 2880),
}
KT_FORMATS = ("bf16", "int8", "int4")
# GGUF types kept exact (docs/loading.md): (bits, group, affine) of w13 and of w2. q4_k_m: Q4_K gate/up, Q6_K down.
# mxfp4: MXFP4's 4-bit E2M1 codes (float4_e2m1fn_x2 nibbles, the op's code table); mxfp4_int8: the int8-code form of
# the same blocks (codes -12..12 a byte each, the form before issue 32), for comparison.
EXACT = {"q8_0": ((8, 32, False), (8, 32, False)), "q6_k": ((8, 16, False), (8, 16, False)),
         "q5_k": ((8, 32, True), (8, 32, True)), "q4_k": ((4, 32, True), (4, 32, True)),
         "q4_k_m": ((4, 32, True), (8, 16, False)), "q4_0": ((4, 32, False), (4, 32, False)),
         "mxfp4": ((4, 32, False), (4, 32, False)), "mxfp4_int8": ((8, 32, False), (8, 32, False))}
# The K-quants with their scales at the file's size (two-level: a byte sub-scale per group, fp32 d/dmin per 256;
# ktorch.ops.moe.pack_kscales), beside the fp32-per-group forms above: -q4_k_2l, -q6_k_2l, -q4_k_m_2l.
KSCALES = {f"{t}_2l": t for t in ("q4_k", "q6_k", "q5_k", "q4_k_m", "q8_0")}  # (q8_0_2l: float16 d per 32)
EXACT.update({k: EXACT[t] for k, t in KSCALES.items()})
IMPLS = ("ktorch-bf16", "ktorch-int8", "ktorch-int4", *(f"ktorch-{f}" for f in EXACT), "eager", "grouped_mm")


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    feats = ktorch.cpu_features()
    return (
        f"{model}; {os.cpu_count()} logical CPUs, {torch.get_num_threads()} threads; "
        f"ktorch kernel {feats['kernel']} (available {','.join(feats['available'])}); torch {torch.__version__}"
    )


def huge_pages_note() -> str:
    """This process's memory on transparent huge pages (AnonHugePages of /proc/self/smaps_rollup) and the
    kernel's THP mode, e.g. "2048 MiB of 2400 MiB on huge pages (THP madvise)"; "" where Linux does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.split()[-1:] == ["kB"]}
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError, ValueError):
        return ""
    return (f"{kb.get('AnonHugePages', 0) >> 10} MiB of {kb.get('Anonymous', 0) >> 10} MiB anonymous memory on huge "
            f"pages (THP {mode}, THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')!r})")


def l3_bytes() -> int:
    """The largest L3 size that sysfs or lscpu reports (VMs often show a per-core slice in sysfs only)."""
    sizes = [32 << 20]
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for idx in os.listdir(base):
            with open(os.path.join(base, idx, "level")) as f:
                level = int(f.read())
            with open(os.path.join(base, idx, "size")) as f:
                size = f.read().strip()
            if level == 3:
                sizes.append(int(size.rstrip("KMG")) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1))
    except (OSError, ValueError):
        pass
    try:
        out = subprocess.run(["lscpu", "-B"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("L3 cache:"):
                sizes.append(int(line.split(":", 1)[1].split()[0]))
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return max(sizes)


class ReadBandwidth:
    """Bytes/s of a parallel fp32 sum over a buffer far larger than the caches (best of ``tries``), measured again
    whenever called: the device's read bandwidth moves by 10-20% from one second to the next (a bare read of the same
    weights 82-120 GB/s between adjacent runs, session 50), so a decode row is put beside the bandwidth measured
    next to it (``paired_rows``), not only the one measured at start."""

    def __init__(self, nbytes: int = 2 << 30):
        self.x = torch.rand(nbytes // 4)
        self.x.sum()

    def __call__(self, tries: int = 5) -> float:
        best = math.inf
        for _ in range(tries):
            t0 = time.perf_counter()
            self.x.sum()
            best = min(best, time.perf_counter() - t0)
        return self.x.numel() * 4 / best


def weights_buffer(shape, dtype: torch.dtype, pages: str = "huge") -> torch.Tensor:
    """An uninitialized tensor for packed weights: on transparent huge pages as ktorch's pack ops allocate them
    (pages "huge": madvise before the first touch, where THP allows it) or on whatever pages the allocator gives
    ("4k": with THP "madvise", as on the device, 4 KiB pages)."""
    if pages == "huge":
        return ktorch.ops.moe.empty_weights(shape, dtype)
    if pages == "4k":
        return torch.empty(shape, dtype=dtype)
    raise ValueError(f"pages must be 'huge' or '4k', got {pages!r}")


def fill_parallel(t: torch.Tensor, fill) -> torch.Tensor:
    """``fill(piece, generator)`` on contiguous pieces of t at once, one a thread (ATen's random fills are serial: a
    DeepSeek-V3 int8 layer copy, 10.5 GiB, took ~50 s to fill in one thread, bf16's 21 GiB over 100 s, and every
    process of an A/B fills its own). Each piece has its own generator, seeded from the default one: the same
    weights for the same ``torch.manual_seed`` and thread count."""
    flat = t.view(-1)
    n = max(1, min(torch.get_num_threads(), flat.numel() >> 20))  # pieces of at least 1 Mi elements
    seeds = torch.randint(0, 2**62, (n,)).tolist()
    edges = [flat.numel() * i // n for i in range(n + 1)]

    def one(i: int) -> None:
        fill(flat[edges[i]:edges[i + 1]], torch.Generator().manual_seed(seeds[i]))

    if n == 1:
        one(0)
    else:
        with ThreadPoolExecutor(n) as pool:  # ATen releases the GIL inside each fill
            list(pool.map(one, range(n)))
    return t


def random_packed(E: int, H: int, I: int, fmt: str, group_size: int = 128, pages: str = "huge") -> ktorch.PackedExperts:
    """Random weights directly in the packed layout (valid packed weights; no unpacked master copy), on the pages
    of weights_buffer."""

    def codes(N, K, bits, low=0, high=256):
        """An [N, K] matrix's random packed codes per expert: int8 bytes in [low, high), or int4 nibble pairs."""
        shape, dtype = ((E, N // 16, K // 4, 16, 4), torch.int8) if bits == 8 else ((E, N // 16, K // 8, 16, 4), torch.uint8)
        return fill_parallel(weights_buffer(shape, dtype, pages), lambda p, g: p.random_(low, high, generator=g))

    def mat(N, K):
        if fmt == "bf16":
            w = weights_buffer((E, N // 16, K // 2, 16, 2), torch.bfloat16, pages)
            return fill_parallel(w, lambda p, g: p.normal_(generator=g).mul_(K**-0.5)), None
        if fmt == "int4" and int4_two_level(K, group_size):  # as pack_experts packs int4 there: byte sub-scales
            # 1..15 per group, one fp32 super-scale a column (stored per 256 input channels)
            sub = torch.randint(1, 16, (E, K // group_size, N), dtype=torch.uint8)
            sup = torch.rand(E, 1, N).add_(0.5).mul_(K**-0.5 / 60).expand(E, K // 256, N).contiguous()
            return codes(N, K, 4), torch.cat([sub, sup.view(torch.uint8).reshape(E, -1, N)], dim=1).contiguous()
        scale_groups = 1 if fmt == "int8" else K // group_size
        scales = torch.rand(E, scale_groups, N).add_(0.5).mul_(K**-0.5 / (64 if fmt == "int8" else 4))
        return (codes(N, K, 8, -127, 128) if fmt == "int8" else codes(N, K, 4)), scales

    def exact_mat(N, K, form):
        bits, group, affine = form
        scales = torch.rand(E, *((2,) if affine else ()), K // group, N).add_(0.5).mul_(K**-0.5 / 8)
        if fmt == "q8_0_2l":
            scales = scales.half()
        elif fmt in KSCALES:  # two-level: sub-scales 1..63 (Q6_K: int8), then fp32 super-scales [K/256, N] as bytes
            P = 2 if affine else 1
            sub = torch.randint(1, 64, (E, P, K // group, N), dtype=torch.uint8)
            sup = torch.rand(E, P, K // 256, N).add_(0.5).mul_(K**-0.5 / 256).view(torch.uint8).reshape(E, P, -1, N)
            scales = torch.cat([sub, sup], dim=2)
            scales = (scales if affine else scales[:, 0]).contiguous()
            if not affine:
                scales = scales.view(torch.int8)
        if fmt == "mxfp4":  # any nibble is an E2M1 code
            return codes(N, K, 4).view(torch.float4_e2m1fn_x2), scales
        return (codes(N, K, 8, *((-12, 13) if fmt == "mxfp4_int8" else (-32, 32))) if bits == 8 else codes(N, K, 4)), scales

    if fmt in EXACT:
        w13, s13 = exact_mat(2 * I, H, EXACT[fmt][0])
        w2, s2 = exact_mat(H, I, EXACT[fmt][1])
        return ktorch.PackedExperts(w13, s13, w2, s2, f"gguf:{fmt}")
    w13, s13 = mat(2 * I, H)
    w2, s2 = mat(H, I)
    return ktorch.PackedExperts(w13, s13, w2, s2, fmt, group_size if fmt == "int4" else None)


def hf_experts(E: int, H: int, I: int, impl: str) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, hidden_act="silu")
    config._experts_implementation = impl
    with torch.device("meta"):
        mod = Qwen3MoeExperts(config)
    mod.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H, dtype=torch.bfloat16).mul_(H**-0.5), requires_grad=False)
    mod.down_proj = torch.nn.Parameter(torch.randn(E, H, I, dtype=torch.bfloat16).mul_(I**-0.5), requires_grad=False)
    return mod


def expert_bytes(impl: str, H: int, I: int, group_size: int = 128) -> float:
    n = 3 * H * I
    if impl == "ktorch-int8":
        return n + 4 * (2 * I + H)
    if impl == "ktorch-int4":  # a byte per group and an fp32 per 256 (two-level), or an fp32 per group
        return sum(k * nk / 2 + (k * nk / group_size + 4 * k * nk / 256 if int4_two_level(k, group_size)
                                 else 4 * k * nk / group_size) for k, nk in ((H, 2 * I), (I, H)))
    fmt = impl.split("-", 1)[1] if impl.startswith("ktorch-") else None
    if fmt in EXACT:  # codes (a byte, or a nibble) and fp32 scales (and minimums) per group
        def part(elements, form):
            bits, group, affine = form
            if fmt == "q8_0_2l":  # float16 per group
                return elements * bits / 8 + elements / group * 2
            if fmt in KSCALES:  # a byte per group, an fp32 per 256 (each, scale and minimum)
                return elements * bits / 8 + (elements / group + elements / 256 * 4) * (2 if affine else 1)
            return elements * bits / 8 + elements / group * 4 * (2 if affine else 1)
        return part(2 * I * H, EXACT[fmt][0]) + part(H * I, EXACT[fmt][1])
    return 2 * n


def time_calls(fn, layers, routings, min_calls: int, min_seconds: float, first: int = 0) -> tuple[float, int]:
    """The median seconds of calls ``first``, ``first`` + 1, ... of the cycle through the copies and routings (a
    warm-up call first where ``first`` is 0), and the next call's index."""
    if first == 0:
        fn(layers[0], *routings[0])  # warm-up: first-touch, allocator, thread pool
        first = 1  # (the warm-up's copy and routing are in cache)
    times = []
    start = time.perf_counter()
    i = first
    while i - first < min_calls or time.perf_counter() - start < min_seconds:
        layer = layers[i % len(layers)]
        ids, w, x = routings[i % len(routings)]
        t0 = time.perf_counter()
        fn(layer, ids, w, x)
        times.append(time.perf_counter() - t0)
        i += 1
        if i - first >= 10 * min_calls and time.perf_counter() - start > min_seconds:
            break
    return statistics.median(times), i


PAIRED_MAX_T = 8  # rows of at most this many tokens (memory-bound: decode) are timed in rounds paired with the bandwidth
PAIRED_ROUNDS = 5


def paired_rows(fn, layers, routings, min_calls: int, min_seconds: float, read_bandwidth, nbytes: float):
    """A decode row timed in ``PAIRED_ROUNDS`` rounds, each right after a read-bandwidth measurement (best of 3):
    the median of the rounds' times, and the median of their ratios (bytes read / time) / (the bandwidth just
    measured)."""
    secs, ratios, at = [], [], 0
    for _ in range(PAIRED_ROUNDS):
        bw = read_bandwidth(3)
        sec, at = time_calls(fn, layers, routings, min_calls, min_seconds / PAIRED_ROUNDS, at)
        secs.append(sec)
        ratios.append(nbytes / sec / bw)
    return statistics.median(secs), statistics.median(ratios)


def profile_phases(fn, layers, routings, calls: int = 5) -> dict[str, float]:
    """Median ms per phase of `calls` ktorch calls run with KT_PROFILE=1 (stderr captured at the fd level)."""
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 2)
        os.environ["KT_PROFILE"] = "1"
        try:
            for i in range(calls):
                ids, w, x = routings[i % len(routings)]
                fn(layers[i % len(layers)], ids, w, x)
        finally:
            os.environ.pop("KT_PROFILE")
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        lines = [line for line in tmp.read().splitlines() if line.startswith("kt.fused_moe ")]
    phases: dict[str, list[float]] = {}
    for line in lines:  # "kt.fused_moe <what>: phase ms ... total ms ms"
        words = line.split(":", 1)[1].split()
        for name, value in zip(words[0::2], words[1::2]):
            phases.setdefault(name, []).append(float(value))
    return {name: statistics.median(v) for name, v in phases.items()}


@contextlib.contextmanager
def variant_env(variant: str | None):
    """The environment of one timed variant: --env-variants' 'NAME=V,NAME=V' ('-' or None: no change)."""
    with contextlib.ExitStack() as stack:
        for item in (variant or "-").split(","):
            if item and item != "-":
                name, _, value = item.partition("=")
                stack.enter_context(env_set(name, value))
        yield


@contextlib.contextmanager
def env_set(name: str, value: str | None):
    """os.environ[name] = value inside the block, restored after; None leaves the environment alone."""
    saved = os.environ.get(name)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        if value is not None and saved is None:
            os.environ.pop(name, None)
        elif value is not None:
            os.environ[name] = saved


def coprime_count(n: int, copies: int) -> int:
    """The least count >= n that shares no factor with `copies` (routings cycled beside `copies` layer copies then
    pair each copy with every routing before any pair repeats)."""
    while math.gcd(n, copies) != 1:
        n += 1
    return n


def routings_for(T: int, E: int, K: int, H: int, n: int, cpu_experts: Optional[int] = None) -> list:
    """``n`` random routings of T tokens (ids [T, K], weights, hidden [T, H] bf16). ``cpu_experts``: only the pairs of
    that many experts (a random set per routing) keep their id, the others are -1, as a prefill split hands the CPU
    op the few experts it leaves there (session 56, skewed routing at 24 GiB: ~1% of the rows)."""
    out = []
    for _ in range(n):
        logits = torch.randn(T, E)
        w, ids = torch.softmax(logits, -1).topk(K, dim=-1)
        if cpu_experts is not None:
            kept = torch.zeros(E, dtype=torch.bool)
            kept[torch.randperm(E)[:cpu_experts]] = True
            ids = torch.where(kept[ids], ids, -1)
        out.append((ids, (w / w.sum(-1, keepdim=True)).float(), torch.randn(T, H, dtype=torch.bfloat16)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 32, 512, 2048])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: all cores)")
    ap.add_argument("--min-calls", type=int, default=5)
    ap.add_argument("--min-seconds", type=float, default=1.0)
    ap.add_argument("--profile", action="store_true", help="print the op's per-phase medians (KT_PROFILE=1)")
    ap.add_argument("--env-variants", nargs="+", default=None, metavar="NAME=V[,NAME=V]",
                    help="time each ktorch row under each of these environment settings (settings the op reads "
                         "on every call, e.g. KT_CPU_KERNEL=avx512; '-' for none)")
    ap.add_argument("--pages", nargs="+", default=["huge"], choices=["huge", "4k"],
                    help="pages of the ktorch rows' packed weights: huge (what ktorch's pack ops give, the default) "
                         "and/or 4k; with both, each ktorch row is timed on both sets of layer copies, taking turns "
                         "(rows named e.g. ktorch-int8/4k)")
    ap.add_argument("--cpu-experts", type=int, default=None, metavar="N",
                    help="only N experts' pairs routed (a random N per routing, the other slots -1): the CPU op's "
                    "share of a prefill split, few rows among T (default: every pair routed)")
    ap.add_argument("--memory-budget-gb", type=float, default=None,
                    help="skip an implementation whose layer copies would exceed this (default: 70%% of RAM)")
    args = ap.parse_args()
    if args.cpu_experts is not None and args.cpu_experts < 1:
        ap.error(f"--cpu-experts must be at least 1 (the experts whose pairs stay routed), got {args.cpu_experts}")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    budget = (args.memory_budget_gb or 0.7 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30) * 2**30
    l3 = l3_bytes()
    read_bandwidth = ReadBandwidth()
    bw = read_bandwidth()
    try:
        peak = {k: torch.ops.kt.dot_peak(k, 2_000_000) for k in ("bf16", "int8")}
    except RuntimeError as err:  # no AVX-512 (the portable kernels): no dot-product peak to compare with
        print(f"no dot-product peak: {err}")
        peak = {"bf16": math.nan, "int8": math.nan}
    print(f"machine: {machine()}")
    print(f"L3 {l3 / 2**20:.0f} MiB; measured read bandwidth {bw / 1e9:.1f} GB/s; dot-product peak "
          f"bf16 {peak['bf16'] / 1e12:.2f} TFLOPS, int8 {peak['int8'] / 1e12:.2f} TOPS (all threads)")

    rows = []
    for shape in args.shapes:
        E, K, H, I = SHAPES[shape]
        for impl in args.impls:
            pages = args.pages if impl.startswith("ktorch") else [None]
            per_layer = E * expert_bytes(impl, H, I)
            n_layers = max(1, min(math.ceil(16 * l3 / per_layer), int(budget // (per_layer * len(pages)))))
            if per_layer * n_layers * len(pages) > budget:
                print(f"skip {impl} on {shape}: {len(pages)} x {n_layers} x {per_layer / 2**30:.1f} GiB exceeds the "
                      "memory budget")
                continue
            print(f"{impl} on {shape}: {n_layers} layer copies of {per_layer / 2**30:.2f} GiB"
                  + (f" on each of {'/'.join(pages)} pages" if pages != [None] else ""), flush=True)
            if impl.startswith("ktorch"):
                fmt = impl.split("-")[1]
                layer_sets = {page: [random_packed(E, H, I, fmt, pages=page) for _ in range(n_layers)] for page in pages}
                print(f"    {huge_pages_note()}", flush=True)

                def fn(layer, ids, w, x):
                    return ktorch.fused_moe(x, ids, w, layer)

                peak_kind = "bf16" if fmt == "bf16" else "int8"
            else:
                layer_sets = {None: [hf_experts(E, H, I, impl) for _ in range(n_layers)]}

                def fn(layer, ids, w, x):
                    with torch.no_grad():
                        return layer(x, ids, w.to(x.dtype))

                peak_kind = "bf16"
            walks = args.env_variants if args.env_variants and impl.startswith("ktorch") else [None]
            for T in args.tokens:
                routings = routings_for(T, E, K, H, coprime_count(8, n_layers), args.cpu_experts)
                for walk in walks:
                    for page, layers in layer_sets.items():
                        label = impl if walk is None else f"{impl}/{walk}"
                        label += "/4k" if page == "4k" else ""
                        distinct = statistics.mean(len(torch.unique(r[0][r[0] >= 0])) for r in routings)
                        routed = statistics.mean(int((r[0] >= 0).sum()) for r in routings)  # pairs
                        nbytes = distinct * expert_bytes(impl, H, I)
                        paired = T <= PAIRED_MAX_T
                        try:
                            with variant_env(walk):
                                if paired:
                                    sec, paired_bw = paired_rows(fn, layers, routings, args.min_calls,
                                                                 args.min_seconds, read_bandwidth, nbytes)
                                else:
                                    sec = time_calls(fn, layers, routings, args.min_calls, args.min_seconds)[0]
                        except (RuntimeError, NotImplementedError) as err:
                            print(f"{label} T={T}: failed: {str(err).splitlines()[0]}")
                            continue
                        flops = 6 * H * I * routed
                        gbs = nbytes / sec / 1e9
                        rows.append((shape, label, T, sec * 1e3, T / sec, flops / sec / 1e12, gbs,
                                     100 * gbs * 1e9 / bw, 100 * flops / sec / peak[peak_kind],
                                     100 * paired_bw if paired else None))
                        print("{:<9} {:<12} T={:<5} {:9.3f} ms {:10.0f} tok/s {:7.3f} TFLOPS {:7.1f} GB/s "
                              "({:5.1f}% BW, {:5.1f}% peak)".format(*rows[-1][:9])
                              + (f" paired: {rows[-1][9]:.1f}% of the bandwidth read beside it" if paired else ""),
                              flush=True)
                        if args.profile and impl.startswith("ktorch"):
                            with variant_env(walk):
                                phases = profile_phases(fn, layers, routings)
                            print("    phases (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()),
                                  flush=True)
            del layer_sets, layers
            gc.collect()

    print()
    print("| shape | impl | T | ms | tok/s | eff. TFLOPS | GB/s | % read BW | % paired BW | % dot peak | vs eager |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    eager = {(r[0], r[2]): r[3] for r in rows if r[1] == "eager"}
    for r in rows:
        ratio = eager.get((r[0], r[2]))
        vs = f"{ratio / r[3]:.2f}x" if ratio else "-"
        paired = f"{r[9]:.0f}%" if r[9] is not None else "-"
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.0f} | {r[5]:.3f} | {r[6]:.1f} | {r[7]:.0f}% | "
              f"{paired} | {r[8]:.0f}% | {vs} |")


if __name__ == "__main__":
    main()
