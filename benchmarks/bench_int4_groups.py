"""int4 decode calls by quantization group size, side by side: group 32 (what Q4_K GGUF experts become) against
group 128 (the control, its scales 4x sparser), Qwen3-30B-A3B layer shape (E=128, K=8, H=2048, I=768).

Two packed copies of the layer per group size are cycled (so a call does not find the last one's experts in
cache), a fresh random routing per call; median ms of ``--calls`` calls of ``ktorch.fused_moe`` per (T, group).
The g32 / g128 ratio is the figure to compare between builds (the bytes ratio is 1.17); the absolute times move
with the machine's load.

    python benchmarks/bench_int4_groups.py                # T = 1 and 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import ktorch

E, H, I, K = 128, 2048, 768, 8


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--calls", type=int, default=400)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    packs = {}
    for group in (32, 128):
        gate_up = torch.randn(E, 2 * I, H, dtype=torch.bfloat16) * 0.02
        down = torch.randn(E, H, I, dtype=torch.bfloat16) * 0.02
        packs[group] = [ktorch.pack_experts(gate_up, down, "int4", group_size=group),
                        ktorch.pack_experts(gate_up.roll(1, 0), down.roll(1, 0), "int4", group_size=group)]
    for T in args.tokens:
        x = torch.randn(T, H, dtype=torch.bfloat16)
        ms = {}
        for group in (32, 128):
            times = []
            for i in range(args.calls):
                ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
                weights = torch.rand(T, K)
                t0 = time.perf_counter()
                ktorch.fused_moe(x, ids, weights, packs[group][i % 2])
                times.append(time.perf_counter() - t0)
            ms[group] = statistics.median(times) * 1e3
        print(f"T={T} g32 {ms[32]:.3f} ms  g128 {ms[128]:.3f} ms  g32/g128 {ms[32] / ms[128]:.3f}", flush=True)


if __name__ == "__main__":
    main()
