"""What expert deferral costs the CPU per layer: one decode layer's routed experts run as one call, or split into
the K - d highest-weighted slots and the d lowest (issue 5), through the native host tasks the compiled decode step
uses (runtime/host_tasks.cpp), with cold caches.

Rows, each timed over the same layer copies and routings, the modes taking turns call by call:
  op                 kt.fused_moe on the calling thread, all K slots (one pool dispatch for its stages)
  task d=0           a split host task with d = 0: one call of all K slots on the host-task worker
  task d=D 1 call    d = D: both parts in one fused_moe_split call, the first part published from inside it
(One dispatch a stage and two calls for a deferring layer, the ways before, were measured slower in session 13,
benchmarks/RESULTS.md, and removed from the library with the switches that kept them.)
With --env-variants the rows are instead the op, task d=0 and task d=D under each environment setting (settings
the op reads on every call, e.g. KT_CPU_KERNEL=avx512), all taking turns; the host-task worker's spin after each
task takes a core from the op rows there, the same in every variant.
Columns: first = ms until the first part is joinable (the task's own timeline), total = ms until both parts are
done (for d = 0 and the op the two are one). What deferral can hide per layer is bounded by the GPU work between
two layers; what it costs is total(d) - total(d=0).

    python benchmarks/bench_defer_split.py --shapes qwen3 deepseek-v2-lite --threads 13 16 --deferred 2

Cold caches: the layer is replicated until the copies exceed 8x the L3 cache (bench_fused_moe.py), every call
draws a fresh routing. Benchmarks never assert; they print a table and the machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch

import ktorch
from bench_fused_moe import huge_pages_note, l3_bytes, machine, random_packed, routings_for, variant_env
from ktorch.compile.experts_runtime import ExpertsLayer, _NativeHostFunctions

SHAPES = {  # name: (E, K, H, I)
    "qwen3": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "tiny": (8, 4, 256, 128),  # a smoke run (tests/test_bench_defer_split.py), not a measurement
}


def make_tasks(layers, T: int, K: int, H: int, d: int):
    """Per layer copy: a split task in each mode."""
    tasks = {}
    for mode in ("task d=0", f"task d={d} 1 call"):
        per_layer = []
        for packed in layers:
            staging = types.SimpleNamespace(
                hidden=torch.zeros(T, H, dtype=torch.bfloat16), topk_ids=torch.zeros(T, K, dtype=torch.int64),
                topk_weights=torch.zeros(T, K), out=torch.zeros(T, H, dtype=torch.bfloat16),
                out_later=torch.zeros(T, H, dtype=torch.bfloat16), deferred=torch.tensor(0 if mode == "task d=0" else d))
            per_layer.append((staging, _NativeHostFunctions(staging, ExpertsLayer(*packed.tensors(), "silu"))))
        tasks[mode] = per_layer
    return tasks


def run_task(staging, task, ids, w, x):
    staging.hidden.copy_(x)
    staging.topk_ids.copy_(ids)
    staging.topk_weights.copy_(w)
    torch.ops.kt.host_task_take_times(task.handle)
    t0 = time.perf_counter_ns()
    task.run()
    t1 = time.perf_counter_ns()
    times = torch.ops.kt.host_task_take_times(task.handle)
    first = (times[1] - times[0]) / 1e6 if times else (t1 - t0) / 1e6
    return first, (t1 - t0) / 1e6


def run_op(packed, ids, w, x):
    t0 = time.perf_counter_ns()
    torch.ops.kt.fused_moe(x, ids, w, *packed.tensors(), "silu")
    ms = (time.perf_counter_ns() - t0) / 1e6
    return ms, ms


def advised_copy(t: torch.Tensor, huge: bool) -> torch.Tensor:
    """A copy of ``t`` in fresh memory advised (madvise, before its first touch) onto transparent huge pages or
    kept off them, whatever THP_MEM_ALLOC_ENABLE says: the A/B of --huge-pages."""
    import ctypes
    import mmap

    out = torch.empty_like(t)  # a large allocation: fresh pages from mmap, not yet touched
    page = mmap.PAGESIZE
    start = -(-out.data_ptr() // page) * page
    end = (out.data_ptr() + out.numel() * out.element_size()) // page * page
    if end > start:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(start, end - start, 14 if huge else 15) != 0:  # MADV_HUGEPAGE / MADV_NOHUGEPAGE
            raise OSError(ctypes.get_errno(), "madvise failed")
    return out.copy_(t)


def advised_packed(packed: ktorch.PackedExperts, huge: bool) -> ktorch.PackedExperts:
    w13, s13, w2, s2 = packed.tensors()
    return ktorch.PackedExperts(advised_copy(w13, huge), s13, advised_copy(w2, huge), s2, packed.format,
                                packed.group_size)


def take_turns(modes: dict, routings: list, calls: int) -> dict:
    """(first, total) of `calls` calls of each mode, the modes taking turns. Every call takes the next routing and
    the next layer copy (each mode visits every copy): two calls a few apart never read the same experts of the same
    copy, so none finds the other's weights in the L3 (a round that gave every mode the same routing let the modes
    5 copies apart read from the L3 what the earlier one had fetched: the later modes looked faster)."""
    results = {mode: [] for mode in modes}
    for i in range(calls + 8):  # the first 8 rounds warm up
        for j, (mode, fn) in enumerate(modes.items()):
            k = i * len(modes) + j
            res = fn(k + i, routings[k % len(routings)])
            if i >= 8:
                results[mode].append(res)
    return results


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen3", "deepseek-v2-lite"], choices=sorted(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, nargs="+", default=[ktorch.get_num_threads()])
    ap.add_argument("--deferred", type=int, default=2)
    ap.add_argument("--format", default="int8", choices=["bf16", "int8", "int4"])
    ap.add_argument("--group-size", type=int, default=128, help="int4 scale group (32: what GGUF Q4_0 loads as)")
    ap.add_argument("--calls", type=int, default=400, help="calls per mode")
    ap.add_argument("--cold-factor", type=float, default=8.0, help="layer copies until their bytes exceed this x L3")
    ap.add_argument("--max-copies", type=int, default=64, help="at most this many layer copies")
    ap.add_argument("--env-variants", nargs="+", default=None, metavar="NAME=V[,NAME=V]",
                    help="A/B of environment settings the op reads on every call (e.g. KT_CPU_KERNEL=avx512; "
                         "'-': none): the op, task d=0 and task d=D in one call under each, all taking turns on the "
                         "same layer copies")
    ap.add_argument("--huge-pages", action="store_true",
                    help="A/B instead: the op and the tasks on layer copies in 4 KiB pages against copies on "
                         "transparent huge pages (madvise), taking turns")
    args = ap.parse_args(argv)
    if args.env_variants and args.huge_pages:
        ap.error("--env-variants and --huge-pages are separate A/Bs: give one")

    fmt = args.format + (f" g{args.group_size}" if args.format == "int4" else "")
    print(f"# {machine()}; torch {torch.__version__}; kernel {torch.ops.kt.selected_kernel()}; {fmt}; "
          f"L3 {l3_bytes() / 2**20:.0f} MiB")
    print("| shape | T | threads | mode | first ms (median) | total ms (median) | total p90 |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        E, K, H, I = SHAPES[shape]
        one = random_packed(E, H, I, args.format, args.group_size)
        nbytes = sum(t.numel() * t.element_size() for t in one.tensors() if t is not None)
        copies = min(args.max_copies, max(2, int(args.cold_factor * l3_bytes() / nbytes) + 1))
        layers = [one] + [random_packed(E, H, I, args.format, args.group_size) for _ in range(copies - 1)]
        sets = {"": layers}
        if args.huge_pages:
            sets = {f"/{name}": [advised_packed(packed, huge) for packed in layers]
                    for name, huge in (("4K", False), ("huge", True))}
            del layers
        print(f"# {shape}: {copies} layer copies a set; {huge_pages_note()}", flush=True)
        for T in args.tokens:
            routings = routings_for(T, E, K, H, 64)
            for threads in args.threads:
                ktorch.set_num_threads(threads)
                if args.env_variants:
                    results = take_turns(env_modes(layers, args.env_variants, T, K, H, args.deferred), routings,
                                         args.calls)
                    print_rows(shape, T, threads, results)
                    continue
                # the op rows first, alone: the host-task worker spins after each task run and would take a core
                # from them
                op_modes = {}
                for suffix, ls in sets.items():
                    op_modes[f"op{suffix}"] = lambda i, r, ls=ls: run_op(ls[i % len(ls)], *r)
                results = take_turns(op_modes, routings, args.calls)
                task_modes = {}
                for suffix, ls in sets.items():
                    for mode, per_layer in make_tasks(ls, T, K, H, args.deferred).items():
                        task_modes[mode + suffix] = (
                            lambda i, r, per_layer=per_layer: run_task(*per_layer[i % len(per_layer)], *r))
                results.update(take_turns(task_modes, routings, args.calls))
                print_rows(shape, T, threads, results)
                del task_modes


def env_modes(layers, variants: list[str], T: int, K: int, H: int, d: int) -> dict:
    """--env-variants: per variant the op, task d=0 and task d=D in one call, each run under the variant's environment
    (the op's knobs are read on every call, on whichever thread makes it)."""
    modes = {}
    tasks = make_tasks(layers, T, K, H, d)
    for variant in variants:
        def under(fn, variant=variant):
            def run(i, r):
                with variant_env(variant):
                    return fn(i, r)
            return run
        modes[f"op [{variant}]"] = under(lambda i, r: run_op(layers[i % len(layers)], *r))
        for mode, pl in tasks.items():
            modes[f"{mode} [{variant}]"] = under(lambda i, r, pl=pl: run_task(*pl[i % len(pl)], *r))
    return modes


def print_rows(shape: str, T: int, threads: int, results: dict) -> None:
    for mode, res in results.items():
        firsts, totals = [f for f, _ in res], sorted(t for _, t in res)
        print(f"| {shape} | {T} | {threads} | {mode} | {statistics.median(firsts):.3f} | "
              f"{statistics.median(totals):.3f} | {totals[int(0.9 * len(totals))]:.3f} |", flush=True)


if __name__ == "__main__":
    main()
