"""One MoE layer's resident-expert decode on a GPU, replayed in a CUDA graph (docs/resident_decode.md).

The layer: n experts of the Qwen3-30B-A3B shape (H 2048, I 768), all resident, in each of ``--formats``:

  int8    int8 codes, a float32 scale per 32 inputs (as Q8_0 loads)
  int4    symmetric int4 codes, a scale per 128 (ktorch's experts_dtype="int4" default group)
  q4_0    symmetric int4 codes, a scale per 32 (GGUF Q4_0 kept exact)
  q4_k    affine 4-bit codes 0..15 with a scale and a minimum per 32 (GGUF Q4_K kept exact)
  q5_k    affine int8 codes 0..31 with a scale and a minimum per 32 (GGUF Q5_K kept exact)
  q4_k_m  q4_k gate/up, int8 codes with a scale per 16 down (a Q4_K_M layer: Q4_K and Q6_K)

T tokens (1 at decode), each routed to K distinct experts. Variants, per format:

  packed        residents in the kt.pack layout: gather, dequantize_packed to bf16, bmm (what bf16 residents and
                quantized ones without Triton decode with: packed_experts_forward)
  triton BN/BK/W  residents row-major, the fused Triton kernels (what quantized residents decode with on CUDA):
                tile block_n/block_k(bytes of codes a row a load)/num_warps, each format's TILES entry unless --tiles
                names others
  bf16-gather   (int8 only) residents held in bf16 (twice int8's bytes): gather + bmm, no dequantization (a reference)
  bf16-grouped  (int8 only) the same with torch._grouped_mm (each used expert read once, nothing gathered)

Each is captured REPEAT times in one CUDA graph, each call routed to other experts (at T=1 disjoint sets while
REPEAT * K <= n: a decode step's layers each read their own experts, so L2 serves no call from an earlier one), and
replayed; prints microseconds per layer, the bytes a layer must read at least (the used
experts' codes, scales and minimums), the bandwidth that implies, and each variant's relative error against a float64
reference of the same codes. ``--profile`` adds the kernels of one eager call of packed and triton (torch.profiler).

    python benchmarks/bench_resident_decode.py [--formats int8 int4 q4_k] [--experts 128] [--tokens 1 4]
        [--tiles 8/256/4 8/1024/8/3 8/1024/8+4/256/4] [--profile]

A tile is block_n/block_k/num_warps[/num_stages] for both kernels, or GATE_UP+DOWN to give each its own.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

# format -> per projection (bits, code range, affine, group); None: the format's group for gate/up and down alike
_FORMATS = {
    "int8": ((8, (-127, 127), False, 32),) * 2,
    "int4": ((4, (-8, 7), False, 128),) * 2,
    "q4_0": ((4, (-8, 7), False, 32),) * 2,
    "q4_k": ((4, (0, 15), True, 32),) * 2,
    "q5_k": ((8, (0, 31), True, 32),) * 2,
    "q4_k_m": ((4, (0, 15), True, 32), (8, (-32, 31), False, 16)),
}


def _layer(fmt: str, n: int, H: int, I: int, seed: int = 0, distinct: int = 8) -> tuple:
    """Packed experts (w13, w13_scales, w2, w2_scales) of random codes in ``fmt`` (``pack_quantized``, as the exact
    GGUF types load), values of about unit-variance outputs; ``distinct`` random experts packed and repeated to n
    (each expert still has its own bytes on the device; building stays quick)."""
    from ktorch.ops.moe import pack_quantized

    g = torch.Generator().manual_seed(seed)
    d = min(n, distinct)
    packed = []
    for (bits, (lo, hi), affine, group), (N, K, gate_up) in zip(_FORMATS[fmt], ((2 * I, H, True), (H, I, False))):
        codes = torch.randint(lo, hi + 1, (d, N, K), generator=g, dtype=torch.int8)
        s = torch.rand(d, N, K // group, generator=g) / (max(-lo, hi) * 0.5 * K**0.5)
        m = torch.rand(d, N, K // group, generator=g) * (hi / 2) * s if affine else None
        packed += [t.repeat(-(-n // d), *(1,) * (t.dim() - 1))[:n].contiguous()
                   for t in pack_quantized(codes, s, m, bits=bits, gate_up=gate_up)]
    return tuple(packed)


def _reference(hidden, slots, weights, rows) -> torch.Tensor:
    """float64 out [T, H] from the row layout's values (silu), one used expert at a time, on hidden's device
    (benchmarks/bench_resident_prefill.py uses it too)."""
    from ktorch.ops.resident_rows import dequantize_rows

    I = rows.w13.shape[1] // 2
    x = hidden.double()
    out = torch.zeros(hidden.shape, dtype=torch.float64, device=hidden.device)
    for e in slots[slots >= 0].unique().tolist():
        t, k = (slots == e).nonzero(as_tuple=True)
        w13 = dequantize_rows(rows.w13[e:e + 1], rows.w13_scales[e:e + 1], torch.float64)[0]  # [H, 2I]
        w2 = dequantize_rows(rows.w2[e:e + 1], rows.w2_scales[e:e + 1], torch.float64)[0]  # [I, H]
        gu = x[t] @ w13
        y = (torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]) @ w2
        out.index_add_(0, t, y * weights[t, k].double()[:, None])
    return out


def random_call(T: int, H: int, K: int, n: int) -> tuple:
    """One call's CUDA inputs, seeded by T: hidden [T, H] bf16, slots [T, K] (K distinct residents of n a token),
    weights [T, K]; and how many residents the slots use (also for benchmarks/bench_resident_prefill.py)."""
    g = torch.Generator().manual_seed(T)
    hidden = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
    slots = torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(T)]).cuda()
    weights = torch.rand(T, K, generator=g).cuda()
    return hidden, slots, weights, slots.unique().numel()


def call_routings(T: int, K: int, n: int, repeat: int, device) -> list:
    """``repeat`` slot tensors [T, K] (K distinct experts of n a token) for the calls of one captured graph: at T=1
    disjoint sets while repeat * K <= n (each call reads its own experts' bytes, as a step's layers do), else each
    call its own random draw."""
    g = torch.Generator().manual_seed(1000 + T)
    if T == 1 and repeat * K <= n:
        order = torch.randperm(n, generator=g)
        return [order[i * K:(i + 1) * K][None].to(device) for i in range(repeat)]
    return [torch.stack([torch.randperm(n, generator=g)[:K] for _ in range(T)]).to(device) for _ in range(repeat)]


def parse_tile(text: str) -> tuple:
    """"bn/bk/nw[/ns]" (both kernels) or "GATE_UP+DOWN" -> ((bn, bk, nw, ns), (bn, bk, nw, ns)), ns None if absent."""
    parts = text.split("+")
    if len(parts) > 2:
        raise ValueError(f"--tiles: at most one '+' (gate_up+down), got {text!r}")
    tiles = []
    for part in parts:
        v = [int(x) for x in part.split("/")]
        if len(v) not in (3, 4):
            raise ValueError(f"--tiles: block_n/block_k/num_warps[/num_stages], got {part!r}")
        tiles.append((v[0], v[1], v[2], v[3] if len(v) == 4 else None))
    return tiles[0], tiles[-1]


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
    p.add_argument("--formats", nargs="+", default=["int8"], choices=sorted(_FORMATS))
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--tokens", type=int, nargs="+", default=[1])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--repeat", type=int, default=12, help="layer calls per captured graph (a 12-layer step)")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--tiles", nargs="+", default=None,
                   help="more triton block_n/block_k/num_warps settings to compare with each format's TILES entry")
    args = p.parse_args(argv)

    from ktorch.ops.gpu_experts import gpu_experts_forward, packed_experts_forward
    from ktorch.ops.resident_rows import RowExperts, dequantize_rows, rows_from_packed
    from ktorch.ops.triton_experts import TILES, triton_available, triton_rows_forward

    n, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    print(f"GPU {torch.cuda.get_device_name()}, CPU {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, triton {'yes' if triton_available() else 'MISSING'}")
    for fmt in args.formats:
        t0 = time.perf_counter()
        packed = tuple(t.cuda() for t in _layer(fmt, n, H, I))
        rows = rows_from_packed(*packed)
        cpu_rows = RowExperts(*(t.cpu() for t in rows))
        per_expert = sum(t[0].numel() * t.element_size() for t in rows)  # codes + scales (+ minimums)
        bits = 8 if rows.w13.dtype == torch.int8 else 4
        tiles = ["/".join(str(v) for v in TILES[bits])] + [t for t in args.tiles or [] if t != "/".join(
            str(v) for v in TILES[bits])]
        refs = {}
        if fmt == "int8":
            refs = {"w13": dequantize_rows(rows.w13, rows.w13_scales, torch.bfloat16),  # [n, H, 2I] (a view)
                    "w2": dequantize_rows(rows.w2, rows.w2_scales, torch.bfloat16)}
        print(f"\n== {fmt}: {n} experts, H {H}, I {I}, top-{K}, {per_expert / 1e6:.2f} MB an expert "
              f"(codes, scales, minimums); built in {time.perf_counter() - t0:.1f} s")
        for T in args.tokens:
            hidden, slots, weights, used = random_call(T, H, K, n)
            least = used * per_expert
            variants = {"packed": lambda: packed_experts_forward(hidden, slots, weights, packed, "silu", "gather")}
            checks = {}  # label -> the call on ``slots`` (the reference's routing) where the timed calls use others
            if triton_available():
                routings = call_routings(T, K, n, args.repeat, hidden.device)
                for tile in tiles:
                    pair, label = parse_tile(tile), f"triton {tile}"
                    variants[label] = (lambda pair=pair, it=iter(range(1 << 60)): triton_rows_forward(
                        hidden, routings[next(it) % len(routings)], weights, rows, "silu", pair))
                    checks[label] = (lambda pair=pair: triton_rows_forward(hidden, slots, weights, rows, "silu",
                                                                           pair))
            if refs:
                variants["bf16-gather"] = lambda: gpu_experts_forward(hidden, slots, weights, refs["w13"], refs["w2"],
                                                                      "silu", "gather")
                variants["bf16-grouped"] = lambda: gpu_experts_forward(hidden, slots, weights, refs["w13"],
                                                                       refs["w2"], "silu", "grouped_mm")
            ref = _reference(hidden.cpu(), slots.cpu(), weights.cpu(), cpu_rows)
            print(f"\n{fmt} T={T}, K={K}: {used} experts used; they hold {least / 1e6:.1f} MB")
            print(f"  {'variant':<20} {'us/layer':>9} {'GB/s of codes+scales':>21} {'x packed':>9} {'rel. error':>11}")
            base = None
            for label, fn in variants.items():
                try:
                    err = (checks.get(label, fn)().double().cpu() - ref).norm().item() / ref.norm().item()
                    s = _time_graph(fn, args.repeat, args.replays)
                except Exception as e:  # a variant that fails is reported, the others still run
                    print(f"  {label:<20} failed: {type(e).__name__}: {str(e)[:200]}")
                    continue
                base = base or s
                print(f"  {label:<20} {s * 1e6:9.1f} {least / s / 1e9:21.0f} {base / s:9.2f} {err:11.2e}", flush=True)
            if args.profile:
                print("  kernels per call (eager, torch.profiler):")
                for label in ("packed", f"triton {tiles[0]}"):
                    if label in variants:
                        try:
                            _profile(label, variants[label])
                        except Exception as e:
                            print(f"  {label}: profile failed: {type(e).__name__}: {str(e)[:200]}")
        del packed, rows, refs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
