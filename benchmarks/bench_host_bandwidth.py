"""The host's memory limits on prefill with CPU-resident experts: how fast the CPU reads DRAM, how fast the GPU's
copy engines read page-locked host memory, and how fast the two go **at once** (they read the same DRAM).

A prompt that hits every expert of a layer must move all of the layer's expert bytes out of host memory once: to
the CPU's cores (the CPU op) or over PCIe (streamed experts, docs/prefill_streaming.md; llama.cpp's ``-lm none``
copies every expert). So whatever the split, a layer costs at least

    layer bytes / (CPU read GB/s + copy GB/s, both measured while the other runs)

and this script prints that floor as prefill tokens/s for a model shape, beside the rates it measured:

    python benchmarks/bench_host_bandwidth.py --threads 13 16 --shape qwen3-30b-a3b

Rows: the CPU alone (a parallel fp32 sum over a buffer far larger than the L3, torch's threads set to each
``--threads``), the copy alone (host-to-device ``copy_`` from page-locked memory, ``--copy-mib`` a copy), and
both at once (copies queued on a side stream, the CPU summing until the last copy's event completes; each rate is
its bytes over that shared window). Best of ``--repeats``. Without a GPU only the CPU row is measured. Benchmarks
never assert; they print a table and the machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_fused_moe import machine
from ktorch.ops.streamed_experts import queue_timed_copies

# bytes of one layer's routed experts in int8 with per-channel fp32 scales, and the layer count
SHAPES = {  # name: (E, H, I, layers)
    "qwen3-30b-a3b": (128, 2048, 768, 48),
    "deepseek-v3": (256, 7168, 2048, 58),
    "tiny": (8, 256, 128, 2),
}


def layer_bytes_int8(E: int, H: int, I: int) -> int:
    """One layer's int8 experts: w13 [E, 2I, H] + w2 [E, H, I] bytes and a fp32 scale per output channel."""
    return E * (3 * H * I + 4 * (2 * I + H))


def cpu_read(x: torch.Tensor, until=None, seconds: float = 0.0) -> float:
    """GB/s of repeated ``x.sum()`` until ``until()`` is true (or ``seconds`` have passed, at least one sum)."""
    nbytes = x.numel() * x.element_size()
    done, t0 = 0, time.perf_counter()
    while True:
        x.sum()
        done += nbytes
        elapsed = time.perf_counter() - t0
        if (until() if until is not None else elapsed >= seconds):
            return done / elapsed / 1e9


def measure(threads: int, x: torch.Tensor, src, dst, n_copies: int, repeats: int) -> dict:
    torch.set_num_threads(threads)
    x.sum()  # warm: threads started, pages touched
    row = dict(threads=threads, cpu_alone=max(cpu_read(x, seconds=0.5) for _ in range(repeats)))
    if src is None:
        return row
    nbytes = src.numel() * src.element_size()
    side = torch.cuda.Stream()
    alone, cpu_both, copy_both = 0.0, 0.0, 0.0
    for _ in range(repeats):
        begin, end = queue_timed_copies(src, dst, n_copies, side)
        end.synchronize()
        alone = max(alone, n_copies * nbytes / (begin.elapsed_time(end) * 1e6))
        begin, end = queue_timed_copies(src, dst, n_copies, side)
        cpu = cpu_read(x, until=end.query)
        end.synchronize()
        copy = n_copies * nbytes / (begin.elapsed_time(end) * 1e6)
        if cpu + copy > cpu_both + copy_both:
            cpu_both, copy_both = cpu, copy
    row.update(copy_alone=alone, cpu_while_copying=cpu_both, copy_while_reading=copy_both)
    return row


def floor_tokens_per_s(gbps: float, shape: str, tokens: int) -> float:
    """Prefill tok/s if every layer's expert bytes left host memory at ``gbps`` and nothing else took time."""
    E, H, I, layers = SHAPES[shape]
    return tokens / (layers * layer_bytes_int8(E, H, I) / (gbps * 1e9))


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    parser.add_argument("--cpu-gib", type=float, default=4.0, help="the CPU's buffer (far above the L3)")
    parser.add_argument("--copy-mib", type=int, default=256, help="bytes of one host-to-device copy")
    parser.add_argument("--copies", type=int, default=24, help="copies in one timed run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--no-gpu", action="store_true", help="the CPU row only")
    parser.add_argument("--json", default=None, help="append the rows as JSON lines to this file")
    args = parser.parse_args(argv)

    print(machine())
    x = torch.rand(int(args.cpu_gib * 2**30) // 4)
    src = dst = None
    if torch.cuda.is_available() and not args.no_gpu:
        src = torch.empty(args.copy_mib << 20, dtype=torch.uint8, pin_memory=True).random_(0, 256)
        dst = torch.empty(src.shape, dtype=src.dtype, device="cuda")
    else:
        print("no GPU (or --no-gpu): the CPU's read rate only")
    before = torch.get_num_threads()
    try:
        rows = [measure(t, x, src, dst, args.copies, args.repeats) for t in args.threads]
    finally:
        torch.set_num_threads(before)

    E, H, I, layers = SHAPES[args.shape]
    mb = layer_bytes_int8(E, H, I) / 1e6
    print(f"\nGB/s, best of {args.repeats}; CPU: fp32 sum over {args.cpu_gib:g} GiB; copy: {args.copy_mib} MiB "
          "page-locked host-to-device copies")
    print("| threads | CPU alone | copy alone | CPU while copying | copy while CPU reads | both at once |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["cpu_alone"]] + [r.get(k) for k in ("copy_alone", "cpu_while_copying", "copy_while_reading")]
        both = r["cpu_while_copying"] + r["copy_while_reading"] if "copy_alone" in r else None
        print(f"| {r['threads']} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells + [both]) + " |")
    best = max(r["cpu_while_copying"] + r["copy_while_reading"] if "copy_alone" in r else r["cpu_alone"]
               for r in rows)
    print(f"\nfloor for {args.shape} ({layers} layers, {mb:.0f} MB of int8 experts a layer, every expert hit): "
          + ", ".join(f"pp{t} <= {floor_tokens_per_s(best, args.shape, t):.0f} tok/s" for t in args.tokens)
          + f" at {best:.1f} GB/s (the best row's total)")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, bench="host_bandwidth", shape=args.shape)) + "\n")
    return rows


if __name__ == "__main__":
    main()
