"""One MoE layer's resident-expert decode on a GPU, replayed in a CUDA graph (docs/resident_decode.md).

The layer: n int8 experts of the Qwen3-30B-A3B shape (H 2048, I 768, a float32 scale per 32 inputs as Q8_0 loads),
all resident; T tokens (1 at decode), each routed to K distinct experts. Variants:

  packed        residents in the kt.pack layout: gather, dequantize_packed to bf16, bmm (what bf16/int4/affine
                residents and int8 ones without Triton decode with: packed_experts_forward)
  triton BN/BK/W  int8 residents row-major, the fused Triton kernels (what int8 residents decode with on CUDA):
                tile block_n/block_k/num_warps, the library's BLOCK_N/BLOCK_K/NUM_WARPS unless --tiles names others
  bf16-gather   residents held in bf16 (twice the bytes): gather + bmm, no dequantization (a reference)
  bf16-grouped  the same with torch._grouped_mm (each used expert read once, nothing gathered; a reference)

Each is captured REPEAT times in one CUDA graph (new routing every launch is not needed: the bytes read do not depend
on which experts) and replayed; prints microseconds per layer, the bytes a layer must read at least (the K experts'
int8 weights and scales), the bandwidth that implies, and each variant's relative error against a float64
reference. ``--profile`` adds the kernels of one eager call of packed and triton (torch.profiler).

    python benchmarks/bench_resident_decode.py [--experts 128] [--tokens 1 4] [--tiles 8/256/4 16/256/4] [--profile]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch


def _layer(n: int, H: int, I: int, group: int, seed: int = 0):
    from ktorch.ops.moe import pack_quantized

    g = torch.Generator().manual_seed(seed)
    c13 = torch.randint(-127, 128, (n, 2 * I, H), generator=g, dtype=torch.int8)
    c2 = torch.randint(-127, 128, (n, H, I), generator=g, dtype=torch.int8)
    s13 = torch.rand(n, 2 * I, H // group, generator=g) / (127 * 0.5 * H**0.5)
    s2 = torch.rand(n, H, I // group, generator=g) / (127 * 0.5 * I**0.5)
    w13, w13_scales = pack_quantized(c13, s13, bits=8, gate_up=True)
    w2, w2_scales = pack_quantized(c2, s2, bits=8)
    return (w13, w13_scales, w2, w2_scales), (c13, s13, c2, s2)


def _reference(hidden, slots, weights, rows) -> torch.Tensor:
    """float64 out [T, H] from the row layout's values (silu), one used expert at a time."""
    def dense(q, s, e):
        N, K = q.shape[1:]
        return (q[e].double().view(N, s.shape[2], -1) * s[e].double().unsqueeze(-1)).view(N, K)

    I = rows.w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(slots.shape[0]):
        x = hidden[t].double()
        for k in range(slots.shape[1]):
            e = int(slots[t, k])
            gu = dense(rows.w13, rows.w13_scales, e) @ x
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]
            out[t] += float(weights[t, k]) * (dense(rows.w2, rows.w2_scales, e) @ h)
    return out


def _time_graph(fn, repeat: int, replays: int) -> float:
    """Seconds per call of ``fn`` (no arguments, CUDA work only) captured ``repeat`` times in one graph."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / (replays * repeat))
    del graph
    return best


def _profile(label: str, fn) -> None:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    print(f"  {label}: {len(kernels)} kernels/copies, {total:.1f} us of GPU time (eager, one call)")
    for e in kernels:
        print(f"      {e.device_time:8.1f} us  {e.name[:110]}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeat", type=int, default=12, help="layer calls per captured graph (a 12-layer step)")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--tiles", nargs="+", default=None,
                   help="triton block_n/block_k/num_warps settings to compare (default: the library's tile)")
    args = p.parse_args(argv)

    from ktorch.ops.gpu_experts import gpu_experts_forward, packed_experts_forward
    from ktorch.ops.resident_rows import RowExperts, dequantize_rows, rows_from_packed
    from ktorch.ops.triton_experts import BLOCK_K, BLOCK_N, NUM_WARPS, triton_available, triton_rows_forward

    tiles = args.tiles or [f"{BLOCK_N}/{BLOCK_K}/{NUM_WARPS}"]

    n, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    print(f"GPU {torch.cuda.get_device_name()}, CPU {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, triton {'yes' if triton_available() else 'MISSING'}")
    t0 = time.perf_counter()
    packed_cpu, _ = _layer(n, H, I, args.group)
    packed = tuple(t.cuda() for t in packed_cpu)
    rows = rows_from_packed(*packed)
    w13_bf16 = dequantize_rows(rows.w13, rows.w13_scales, torch.bfloat16)  # [n, H, 2I] (column-major view)
    w2_bf16 = dequantize_rows(rows.w2, rows.w2_scales, torch.bfloat16)
    print(f"layer: {n} int8 experts, H {H}, I {I}, scale per {args.group}, top-{K}; built in "
          f"{time.perf_counter() - t0:.1f} s")
    per_expert = 3 * H * I + 3 * H * I // args.group * 4  # int8 codes + float32 scales
    for T in args.tokens:
        g = torch.Generator().manual_seed(T)
        hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
        slots = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(T)]).cuda()
        weights = torch.rand(T, K, generator=g).cuda()
        used = slots.unique().numel()
        least = used * per_expert
        variants = {"packed": lambda: packed_experts_forward(hidden, slots, weights, packed, "silu", "gather")}
        if triton_available():
            for tile in tiles:
                bn, bk, nw = (int(v) for v in tile.split("/"))
                variants[f"triton {tile}"] = (lambda bn=bn, bk=bk, nw=nw: triton_rows_forward(
                    hidden, slots, weights, rows, "silu", bn, bk, nw))
        variants["bf16-gather"] = lambda: gpu_experts_forward(hidden, slots, weights, w13_bf16, w2_bf16, "silu",
                                                              "gather")
        variants["bf16-grouped"] = lambda: gpu_experts_forward(hidden, slots, weights, w13_bf16, w2_bf16, "silu",
                                                               "grouped_mm")
        cpu_rows = RowExperts(*(t.cpu() for t in rows))
        ref = _reference(hidden.cpu(), slots.cpu(), weights.cpu(), cpu_rows)
        print(f"\nT={T}, K={K}: {used} experts used; they hold {least / 1e6:.1f} MB (int8 + fp32 scales)")
        print(f"  {'variant':<20} {'us/layer':>9} {'GB/s of int8+scales':>20} {'x packed':>9} {'rel. error':>11}")
        base = None
        for label, fn in variants.items():
            try:
                err = (fn().double().cpu() - ref).norm().item() / ref.norm().item()
                s = _time_graph(fn, args.repeat, args.replays)
            except Exception as e:  # a variant that fails is reported, the others still run
                print(f"  {label:<20} failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            base = base or s
            print(f"  {label:<20} {s * 1e6:9.1f} {least / s / 1e9:20.0f} {base / s:9.2f} {err:11.2e}", flush=True)
        if args.profile:
            print("  kernels per call (eager, torch.profiler):")
            for label in ("packed", f"triton {tiles[0]}"):
                if label in variants:
                    try:
                        _profile(label, variants[label])
                    except Exception as e:
                        print(f"  {label}: profile failed: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
