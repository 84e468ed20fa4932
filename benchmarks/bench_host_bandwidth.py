"""The host's memory limits on prefill with CPU-resident experts: how fast the CPU reads DRAM, how fast the GPU's
copy engines read page-locked host memory, and how fast the two go **at once** (they read the same DRAM).

A prompt that hits every expert of a layer must move all of the layer's expert bytes out of host memory once: to
the CPU's cores (the CPU op) or over PCIe (streamed experts, docs/prefill_streaming.md; llama.cpp's ``-lm none``
copies every expert). So whatever the split, a layer costs at least

    layer bytes / (CPU read GB/s + copy GB/s, both measured while the other runs)

and this script prints that floor as prefill tokens/s for a model shape, beside the rates it measured:

    python benchmarks/bench_host_bandwidth.py --threads 13 16 --shape qwen3-30b-a3b

Rows: the CPU alone (a parallel fp32 sum over a buffer far larger than the L3, torch's threads set to each
``--threads``); then for two ways of moving ``--copy-mib`` of page-locked host memory (registered in place, as the
prefill split's packed experts are) to the GPU, side by side: ``copy`` (one DMA ``copy_``, the copy engines) and
``gather`` (the split's zero-copy Triton gather, ktorch/ops/triton_gather.py: the SMs read the host bytes through a
CUDA alias, rows of one expert's bytes in a random order), each alone and with the CPU reading at once (transfers
queued on a side stream, the CPU summing until the last one's event completes; each rate is its bytes over that
shared window). Best of ``--repeats``. Without a GPU only the CPU row is measured. Benchmarks
never assert; they print a table and the machine.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bench_fused_moe import machine
from ktorch.ops.streamed_experts import queue_timed

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


def measure(threads: int, x: torch.Tensor, transfers: dict, n_copies: int, repeats: int) -> dict:
    """The CPU's read rate alone, then per transfer (name -> (bytes, fn queuing one transfer on the current stream))
    its rate alone and, with the CPU reading at once, both rates."""
    torch.set_num_threads(threads)
    x.sum()  # warm: threads started, pages touched
    row = dict(threads=threads, cpu_alone=max(cpu_read(x, seconds=0.5) for _ in range(repeats)))
    if not transfers:
        return row
    side = torch.cuda.Stream()
    for name, (nbytes, fn) in transfers.items():
        alone, cpu_both, moved_both = 0.0, 0.0, 0.0
        for _ in range(repeats):
            begin, end = queue_timed(fn, n_copies, side)
            end.synchronize()
            alone = max(alone, n_copies * nbytes / (begin.elapsed_time(end) * 1e6))
            begin, end = queue_timed(fn, n_copies, side)
            cpu = cpu_read(x, until=end.query)
            end.synchronize()
            moved = n_copies * nbytes / (begin.elapsed_time(end) * 1e6)
            if cpu + moved > cpu_both + moved_both:
                cpu_both, moved_both = cpu, moved
        row.update({f"{name}_alone": alone, f"cpu_while_{name}": cpu_both, f"{name}_while_reading": moved_both})
    return row


def gpu_transfers(copy_mib: int, shape: str) -> tuple:
    """({name: (bytes, fn)}, cleanup) for ``measure``: the same bytes of page-locked host memory (registered in
    place with ``cudaHostRegister``, as the split's packed experts are) moved to the GPU two ways: ``copy``, one DMA
    ``copy_`` of them all; ``gather``, the split's zero-copy gather (ktorch/ops/triton_gather.py: the SMs read the
    host bytes through a CUDA alias) of all the rows, experts of ``shape``'s int8 size, in a random order."""
    from ktorch.ops.triton_gather import gather_rows, host_alias, word_dtype

    E, H, I, _ = SHAPES[shape]
    row_bytes = layer_bytes_int8(E, H, I) // E // 256 * 256  # an expert's bytes, 256 of them a word multiple
    rows = max(1, (copy_mib << 20) // row_bytes)
    host = torch.empty(rows, row_bytes, dtype=torch.uint8).random_(0, 256)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(host.data_ptr(), host.numel(), 0))
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of {host.numel()} bytes failed (cudaError {err})")
    dst = torch.empty(host.shape, dtype=host.dtype, device="cuda")
    alias = host_alias(host, word_dtype(row_bytes, host.data_ptr()), torch.device("cuda"))
    transfers = {"copy": (host.numel(), lambda: dst.copy_(host, non_blocking=True))}
    if alias is None:
        print("the registered memory has no CUDA alias here: no gather row")
    else:
        ids = torch.randperm(rows, device="cuda")
        words = torch.empty(alias.shape, dtype=alias.dtype, device="cuda")
        transfers["gather"] = (host.numel(), lambda: gather_rows([words], [alias], ids))
    for _, fn in transfers.values():  # warm: the kernel compiled, outside the timed runs
        fn()
    torch.cuda.synchronize()

    def cleanup():
        torch.cuda.synchronize()
        transfers.clear()  # the alias before the registration
        cudart.cudaHostUnregister(host.data_ptr())

    return transfers, cleanup


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
    transfers, cleanup = {}, (lambda: None)
    if torch.cuda.is_available() and not args.no_gpu:
        transfers, cleanup = gpu_transfers(args.copy_mib, args.shape)
    else:
        print("no GPU (or --no-gpu): the CPU's read rate only")
    before = torch.get_num_threads()
    try:
        rows = [measure(t, x, transfers, args.copies, args.repeats) for t in args.threads]
    finally:
        torch.set_num_threads(before)
        cleanup()

    E, H, I, layers = SHAPES[args.shape]
    mb = layer_bytes_int8(E, H, I) / 1e6
    print(f"\nGB/s, best of {args.repeats}; CPU: fp32 sum over {args.cpu_gib:g} GiB; copy: {args.copy_mib} MiB "
          "registered host-to-device, one DMA copy_; gather: the same bytes as rows of one expert's int8 bytes "
          "gathered by the split's zero-copy kernel, rows in a random order")
    names = ("copy", "gather")
    print("| threads | CPU alone | " + " | ".join(f"{n} alone | CPU while {n} | {n} while CPU reads | both at once "
                                                 f"({n})" for n in names) + " |")
    print("|---|---|" + "---|---|---|---|" * len(names))

    def both(r, n):
        return r[f"cpu_while_{n}"] + r[f"{n}_while_reading"] if f"{n}_alone" in r else None

    for r in rows:
        cells = [r["cpu_alone"]]
        for n in names:
            cells += [r.get(f"{n}_alone"), r.get(f"cpu_while_{n}"), r.get(f"{n}_while_reading"), both(r, n)]
        print(f"| {r['threads']} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
    best = max(max([b for b in (both(r, n) for n in names) if b is not None], default=r["cpu_alone"]) for r in rows)
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
