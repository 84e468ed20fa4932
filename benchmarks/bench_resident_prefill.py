"""One MoE layer's prefill with every expert resident on a GPU as int8 rows (docs/resident_decode.md, issue 36).

The layer: n experts of the Qwen3-30B-A3B shape (H 2048, I 768), all resident as int8 codes with a float32 scale per
32 inputs (as Q8_0 loads; ``--group 0``: per channel), T tokens each routed to K distinct random experts. Variants:

  dequant-all     every resident dequantized to bf16 (dequantize_rows), then gpu_experts_forward's grouped_mm: the
                  prefill path before (a fixed ~5 ms a layer on the 48-layer file)
  dequant-used    rows_experts_forward with kernel="grouped_mm": only the residents the call uses dequantized (one
                  host sync), then grouped_mm
  triton BM/BN/BK/W/S  the Triton grouped GEMM (ktorch/ops/triton_prefill.py) with that tile (block_m, block_n,
                  block_k, num_warps, num_stages); the first is ``tile_for``'s choice (what rows_experts_forward runs)
  bf16-grouped    the same experts held in bf16 (twice the bytes), grouped_mm alone: no dequantization (a reference)

Eager calls timed with CUDA events (the best of 3 rounds of ``--iters``; dequant-used syncs with the host once a
call); prints us a layer, the GB/s of codes+scales the used experts hold, and each variant's relative error against
a float64 reference of the same codes (computed on the GPU).

    python benchmarks/bench_resident_prefill.py [--tokens 512 2048] [--experts 128] [--group 32]
        [--tiles 64/64/64/4/3 32/64/32/4/3]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from bench_resident_decode import _reference, random_call  # (benchmarks/ is on sys.path when run as a script)


def _layer(n: int, H: int, I: int, group: int, distinct: int = 8, seed: int = 0) -> tuple:
    """Packed int8 experts (w13, w13_scales, w2, w2_scales): ``distinct`` random ones repeated to n (each expert
    still has its own bytes on the device), a scale per ``group`` inputs (0: per channel)."""
    from ktorch.ops.moe import pack_quantized

    g = torch.Generator().manual_seed(seed)
    d = min(n, distinct)
    packed = []
    for N, K, gate_up in ((2 * I, H, True), (H, I, False)):
        codes = torch.randint(-127, 128, (d, N, K), generator=g, dtype=torch.int8)
        s = torch.rand(d, N, K // (group or K), generator=g) / (127 * 0.5 * K**0.5)
        packed += [t.repeat(-(-n // d), *(1,) * (t.dim() - 1))[:n].contiguous()
                   for t in pack_quantized(codes, s, None, bits=8, gate_up=gate_up)]
    return tuple(packed)


def _time(fn, iters: int) -> float:
    """Seconds per eager call of ``fn``: CUDA events around ``iters`` calls, the best of 3 rounds."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / iters)
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--group", type=int, default=32, help="inputs a scale covers (0: per channel)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiles", nargs="+", default=[],
                   help="more triton block_m/block_n/block_k/num_warps/num_stages tiles to compare")
    args = p.parse_args(argv)

    from ktorch.ops.gpu_experts import gpu_experts_forward
    from ktorch.ops.resident_rows import dequantize_rows, rows_experts_forward, rows_from_packed
    from ktorch.ops.triton_experts import triton_available
    from ktorch.ops.triton_prefill import tile_for, triton_grouped_forward

    n, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    print(f"GPU {torch.cuda.get_device_name()}, CPU {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, triton {'yes' if triton_available() else 'MISSING'}")
    t0 = time.perf_counter()
    rows = rows_from_packed(*(t.cuda() for t in _layer(n, H, I, args.group)))
    per_expert = sum(t[0].numel() * t.element_size() for t in rows)
    bf16 = {"w13": dequantize_rows(rows.w13, rows.w13_scales, torch.bfloat16).contiguous(),
            "w2": dequantize_rows(rows.w2, rows.w2_scales, torch.bfloat16).contiguous()}
    print(f"== {n} int8 experts resident, H {H}, I {I}, top-{K}, a scale per {args.group or 'channel'}, "
          f"{per_expert / 1e6:.2f} MB an expert; built in {time.perf_counter() - t0:.1f} s")
    for T in args.tokens:
        hidden, slots, weights, used = random_call(T, H, K, n)
        least = used * per_expert
        tiles = [tile_for(T * K / n)] + [tuple(int(v) for v in t.split("/")) for t in args.tiles]

        def dequant_all():
            w13 = dequantize_rows(rows.w13, rows.w13_scales, torch.bfloat16)
            w2 = dequantize_rows(rows.w2, rows.w2_scales, torch.bfloat16)
            return gpu_experts_forward(hidden, slots, weights, w13, w2, "silu", "grouped_mm")

        variants = {"dequant-all": dequant_all,
                    "dequant-used": lambda: rows_experts_forward(hidden, slots, weights, rows, "silu", "grouped_mm")}
        if triton_available():
            for tile in dict.fromkeys(tiles):
                variants["triton " + "/".join(map(str, tile))] = (
                    lambda tile=tile: triton_grouped_forward(hidden, slots, weights, rows, "silu", tile))
        variants["bf16-grouped"] = lambda: gpu_experts_forward(hidden, slots, weights, bf16["w13"], bf16["w2"],
                                                               "silu", "grouped_mm")
        ref = _reference(hidden, slots, weights, rows)
        print(f"\nT={T}, K={K}: {used} experts used; they hold {least / 1e6:.1f} MB")
        print(f"  {'variant':<22} {'us/layer':>9} {'GB/s of codes+scales':>21} {'x dequant-all':>14} "
              f"{'rel. error':>11}")
        base = None
        for label, fn in variants.items():
            try:
                out = fn()
                err = ((out.double() - ref).norm() / ref.norm()).item()
                s = _time(fn, args.iters)
            except Exception as e:  # a variant that fails is reported, the others still run
                print(f"  {label:<22} failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            base = base or s
            print(f"  {label:<22} {s * 1e6:9.1f} {least / s / 1e9:21.0f} {base / s:14.2f} {err:11.2e}", flush=True)
        del ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
