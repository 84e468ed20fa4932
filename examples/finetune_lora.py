"""Fine-tune an MoE model with LoRA while its routed experts stay packed and frozen in host memory.

    python examples/finetune_lora.py                                   # the built-in model on its eval text, CPU or GPU
    python examples/finetune_lora.py --model /models/Qwen3-30B-A3B --experts-dtype int8 --text my.txt --seq 2048

Attention gets peft's LoRA (on the GPU when there is one); every experts module gets per-expert LoRA on gate_up and
down (ktorch.lora, peft's layout), whose frozen part runs on the CPU (kt.fused_moe_delta and its backward). The
adapter is written in peft's format: ``peft.PeftModel.from_pretrained(transformers_model, out)`` loads it into the
unpacked model. See docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from peft import LoraConfig, get_peft_model

import ktorch
from ktorch.builtin import EVAL_TEXT_PATH


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin", help="checkpoint folder, GGUF file or 'builtin'")
    p.add_argument("--experts-dtype", default="auto", choices=("auto", "bf16", "int8", "int4"))
    p.add_argument("--text", default=str(EVAL_TEXT_PATH), help="a UTF-8 text file to fine-tune on")
    p.add_argument("--held-out", type=float, default=0.1, help="fraction of the text kept for evaluation")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default="lora-adapter", help="folder for the adapter (peft format)")
    args = p.parse_args()
    for name, value, ok, rule in (("--steps", args.steps, args.steps >= 1, ">= 1"),
                                  ("--batch", args.batch, args.batch >= 1, ">= 1"),
                                  ("--seq", args.seq, args.seq >= 2, ">= 2 (the loss predicts each next token)"),
                                  ("--rank", args.rank, args.rank >= 1, ">= 1"),
                                  ("--lr", args.lr, args.lr > 0, "> 0"),
                                  ("--held-out", args.held_out, 0 < args.held_out < 1, "in (0, 1)")):
        if not ok:
            p.error(f"{name} must be {rule}, got {value}")
    if not os.path.isfile(args.text):
        p.error(f"--text {args.text}: no such file")

    model, tokenizer = ktorch.load(args.model, experts_dtype=args.experts_dtype,
                                   gpu_memory="off")  # training: every expert on the CPU op (no resident experts)
    ktorch.prepare(model, device=model.device, trainable=True)  # experts frozen, layers checkpointed
    model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    ktorch.lora.add_expert_lora(model, r=args.rank, lora_alpha=2 * args.rank)  # after peft: peft freezes the rest

    ids = torch.tensor(tokenizer(open(args.text, encoding="utf-8").read()).input_ids)
    cut = int(ids.numel() * (1 - args.held_out))
    train, held_out = ids[:cut], ids[cut:]
    if train.numel() <= args.seq or held_out.numel() < args.seq:
        p.error(f"--text {args.text}: {ids.numel()} tokens leave {train.numel()} to train on and {held_out.numel()} "
                f"held out (--held-out {args.held_out}); both need more than --seq {args.seq}")
    device = next(p.device for p in model.parameters())

    def held_out_loss() -> float:
        n = max(1, held_out.numel() // args.seq)
        x = held_out[: n * args.seq].view(n, args.seq)[:16].to(device)
        model.eval()
        with torch.no_grad():
            loss = model(input_ids=x, labels=x).loss.item()
        model.train()
        return loss

    params = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable parameters: {sum(p.numel() for p in params):,}; held-out loss before: {held_out_loss():.4f}")
    opt = torch.optim.AdamW(params, lr=args.lr)
    model.train()
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, train.numel() - args.seq, (args.batch,))
        x = torch.stack([train[s:s + args.seq] for s in starts.tolist()]).to(device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == args.steps:
            print(f"step {step}: loss {loss.item():.4f} ({(time.perf_counter() - t0) / step:.2f} s/step)")
    print(f"held-out loss after: {held_out_loss():.4f}")
    ktorch.lora.save_adapter(model, args.out)
    print(f"adapter written to {args.out}/ (peft format)")


if __name__ == "__main__":
    main()
