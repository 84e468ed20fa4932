"""Per-call overhead of kt.fused_moe: a tiny op (T=1, E=8, K=2, H=128, I=64) that does almost no work, so its
time is the call's fixed cost: Python -> dispatcher -> the op's checks and routing -> waking ktorch's workers
and waiting for them.

    python benchmarks/bench_overhead.py [--threads 1,2,16] [--calls 20000]

For each pool size (ktorch.set_num_threads) it reports the median and 99th percentile of back-to-back calls
(workers still spinning from the previous call) and of calls spaced by a gap longer than the spin time
(KT_SPIN_US, default 2 ms: workers parked, so the call pays the wake-up). For scale, a dispatcher round trip
of a trivial ATen op (torch.add of two 1-element tensors) is measured the same way. Benchmarks never assert.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import ktorch


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def timed_calls(fn, calls: int, gap_s: float = 0.0) -> list[float]:
    for _ in range(min(100, calls)):
        fn()
    out = []
    for _ in range(calls):
        if gap_s:
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:  # busy wait: a sleep would let the scheduler move this thread
                pass
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default=f"1,{torch.get_num_threads()}", help="pool sizes to measure")
    p.add_argument("--calls", type=int, default=20000, help="back-to-back calls per pool size")
    p.add_argument("--gap-calls", type=int, default=300, help="calls after a gap longer than the spin time")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    E, H, I = 8, 128, 64
    packed = ktorch.pack_experts(torch.randn(E, 2 * I, H) * 0.05, torch.randn(E, H, I) * 0.05, "int8")
    x, ids, w = torch.randn(1, H), torch.tensor([[1, 5]]), torch.rand(1, 2)
    tensors = packed.tensors()
    op = torch.ops.kt.fused_moe
    spin_s = int(os.environ.get("KT_SPIN_US", "2000")) / 1e6
    from bench_e2e import machine_info  # this folder is on sys.path when the script runs

    info = machine_info("cpu")
    cpu = info["cpu"]
    print("machine:", json.dumps(info))
    a, b = torch.ones(1), torch.ones(1)
    rows = [("torch.add (1 element), dispatcher round trip", 1, timed_calls(lambda: torch.add(a, b), args.calls))]
    before = ktorch.get_num_threads()
    try:
        for n in (int(t) for t in args.threads.split(",")):
            ktorch.set_num_threads(n)
            call = lambda: op(x, ids, w, *tensors, "silu")  # noqa: E731
            rows.append(("kt.fused_moe tiny, back to back", n, timed_calls(call, args.calls)))
            rows.append((f"kt.fused_moe tiny, after a {1e3 * 2 * spin_s:.0f} ms gap (workers parked)", n,
                         timed_calls(call, args.gap_calls, gap_s=2 * spin_s)))
    finally:
        ktorch.set_num_threads(before)
    print("\n| call | pool threads | median us | p99 us |")
    print("|---|---|---|---|")
    for name, n, ts in rows:
        print(f"| {name} | {n} | {statistics.median(ts):.1f} | {percentile(ts, 0.99):.1f} |")
    if args.json:
        with open(args.json, "a") as f:
            for name, n, ts in rows:
                f.write(json.dumps(dict(bench="overhead", call=name, threads=n, median_us=statistics.median(ts),
                                        p99_us=percentile(ts, 0.99), cpu=cpu)) + "\n")


if __name__ == "__main__":
    main()
