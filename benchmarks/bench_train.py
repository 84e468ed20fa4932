"""One LoRA fine-tuning step of an MoE model whose routed experts stay in host memory: ktorch against transformers +
accelerate offloading the experts with ``device_map``.

Variants (each runs in its own process, one after the other, so that the host memory of one is free for the next):
  ktorch       experts packed in host memory (``--experts-dtype``, int8 by default) and frozen, computed by kt.fused_moe_delta
               and kt.fused_moe_backward on the CPU; attention, routers, embeddings on the GPU; LoRA on attention
               (peft) and on the experts (ktorch.lora, peft's per-expert layout) ; ``ktorch.prepare(...,
               trainable=True)``: decoder layers checkpointed
  hf_offload   transformers + accelerate as a user offloads today: device_map puts every ``...mlp.experts`` on "cpu"
               (bf16) and accelerate's hooks copy them to the GPU for each forward; LoRA with peft on attention and on
               the experts' parameters (``target_parameters``); gradient checkpointing of the decoder layers

A step = forward over ``--seq`` random tokens (batch 1, labels = inputs), backward, AdamW step, zero_grad, synced.
``--steps`` timed steps after one warm-up step; the table shows the median, the peak GPU memory of the timed steps
(torch.cuda.max_memory_allocated) and the process's peak host memory. Shapes: benchmarks/bench_e2e.py's (random
weights). Benchmarks never assert.

    python benchmarks/bench_train.py                              # qwen3-30b-a3b, int8, seq 2048, both variants
    python benchmarks/bench_train.py --shape tiny --device cpu    # a smoke run without a GPU
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

VARIANTS = ("ktorch", "hf_offload")
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_variant(args) -> dict:
    from peft import LoraConfig, get_peft_model

    import ktorch
    from bench_e2e import build_model, machine_info, offload_device_map

    device = args.device
    t0 = time.perf_counter()
    if args.variant == "ktorch":
        model, _ = build_model(args.shape, "eager", args.device, args.experts_dtype, layers=args.layers)
        ktorch.prepare(model, device=args.device, trainable=True)
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=ATTENTION))
        ktorch.lora.add_expert_lora(model, r=args.rank, lora_alpha=2 * args.rank)
    else:  # built on the CPU, adapters added, then dispatched (peft wraps real parameters, not offloaded ones)
        model, _ = build_model(args.shape, "hf_offload", "cpu", "bf16", layers=args.layers)
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if args.hf_expert_lora == "on" else None
        model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=ATTENTION,
                                                 target_parameters=experts))
        if device == "cuda":
            from accelerate import dispatch_model

            inner = model.base_model.model
            dispatch_model(inner, device_map=offload_device_map(inner), main_device=torch.device("cuda", 0))
    build_s = time.perf_counter() - t0
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def step() -> float:
        x = torch.randint(0, vocab, (1, args.seq), generator=gen).to(device)
        _sync(device)
        t = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        return time.perf_counter() - t

    step()  # warm-up: allocations, oneDNN primitives, accelerate's first copies
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [step() for _ in range(args.steps)]
    result = dict(variant=args.variant, expert_lora=args.variant == "ktorch" or args.hf_expert_lora == "on",
                  shape=args.shape, layers=args.layers, seq=args.seq, rank=args.rank,
                  experts_dtype=args.experts_dtype if args.variant == "ktorch" else "bf16",
                  step_s=statistics.median(times), steps=[round(t, 3) for t in times], build_s=round(build_s, 1),
                  trainable_params=sum(p.numel() for p in params),
                  gpu_peak_gib=(torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None),
                  host_peak_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  machine=machine_info(device))
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape has")
    p.add_argument("--experts-dtype", default="int8", choices=("bf16", "int8", "int4"))
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (attention and experts)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--hf-expert-lora", default="on", choices=("on", "off"),
                   help="hf_offload: peft LoRA on the experts' parameters too (target_parameters), as ktorch has")
    p.add_argument("--variant", help=argparse.SUPPRESS)  # one variant in this process (the parent's children)
    p.add_argument("--json", action="store_true", help="also print one JSON line per variant")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.variant:
        print("RESULT " + json.dumps(run_variant(args)), flush=True)
        return
    rows = []
    for variant in args.variants.split(","):
        cmd = [sys.executable, __file__, "--variant", variant] + [a for a in (argv or sys.argv[1:])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            rows.append(dict(variant=variant, error=" | ".join(tail)))
        else:
            rows.append(json.loads(line[len("RESULT "):]))
    machine = next((r["machine"] for r in rows if "machine" in r), {})
    print(f"machine: {machine}")
    print(f"shape {args.shape} (layers {args.layers or 'all'}), seq {args.seq}, LoRA rank {args.rank}, batch 1")
    print(f"{'variant':<12} {'experts':>8} {'expert LoRA':>12} {'step s':>9} {'GPU peak GiB':>13} {'host peak GiB':>14} "
          f"{'trainable':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} failed: {r['error']}")
            continue
        gpu = f"{r['gpu_peak_gib']:.2f}" if r["gpu_peak_gib"] is not None else "-"
        print(f"{r['variant']:<12} {r['experts_dtype']:>8} {str(r['expert_lora']):>12} {r['step_s']:>9.3f} {gpu:>13} "
              f"{r['host_peak_gib']:>14.1f} "
              f"{r['trainable_params']:>12,}")
    ok = {r["variant"]: r for r in rows if "error" not in r}
    if "ktorch" in ok and "hf_offload" in ok:
        print(f"hf_offload / ktorch step time: {ok['hf_offload']['step_s'] / ok['ktorch']['step_s']:.2f}x")
    if args.json:
        for r in rows:
            print(json.dumps(r))


if __name__ == "__main__":
    main()
