#!/usr/bin/env python3
"""Trains ktorch's built-in model: a small Qwen3-MoE language model on the corpus of scripts/build_corpus.py.

    python scripts/build_corpus.py                      # once: .corpus/{train,valid}.txt, tokenizer, eval text
    python scripts/train_builtin.py --out ktorch/builtin # the committed model (one GPU: under 4 minutes)
    python scripts/train_builtin.py --steps 20 --batch-size 4 --seq-len 128 --out /tmp/tiny   # smoke test

Plain PyTorch loop: AdamW, linear warm-up then cosine decay to 10%, bf16 autocast on CUDA, gradient
clipping, the router load-balancing loss (``router_aux_loss_coef``). The token stream of .corpus/train.txt
is cut into windows of ``seq_len`` + 1 tokens, shuffled per epoch by a seeded generator. Every
``--eval-every`` steps the validation loss is measured and the best weights so far are kept; those are
saved (bf16 safetensors, ``save_pretrained``) with the tokenizer files, and scored on the held-out text
ktorch/builtin/eval.txt. ``train_metrics.json`` beside the weights records the perplexity, the loss
curve, the configuration and the machine.

Seeded (``--seed``): a CPU run repeats bit for bit; a GPU run up to the summation order of atomic adds.

``--time-budget-s`` bounds the training loop: from step 30 on, the measured step time decides whether
``--steps`` still fit; if not, the run ends earlier (and says so), the cosine schedule shortened to match.

The script imports torch, transformers and tokenizers only, not the ktorch package: the training machine
need not have the ktorch extension built.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import math
import os
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
BUILTIN_DIR = REPO / "ktorch" / "builtin"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# tests/test_builtin.py recomputes this slice's perplexity from the committed weights and compares.
EVAL_SLICE_TOKENS, EVAL_SLICE_SEQ_LEN = 2049, 256


def _load_evaluation():
    """ktorch/builtin/evaluation.py, loaded by path (importing the ktorch package would load its extension)."""
    spec = importlib.util.spec_from_file_location("builtin_evaluation", BUILTIN_DIR / "evaluation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


evaluation = _load_evaluation()


def builtin_config(vocab_size: int, eot_id: int, im_end_id: int):
    """The built-in model's architecture: 4 Qwen3-MoE layers, 16 experts (top-4) of width 128, hidden 256.

    About 8.1 M parameters (16.3 MB in bf16), of which 6.3 M are routed experts; per token about 3.4 M run.
    Hidden and expert widths are multiples of 32 (kt.fused_moe's packing) and of 128 (int4 groups of 128).
    """
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,  # dense MLP width; unused, every layer is MoE
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        router_aux_loss_coef=0.01,
        output_router_logits=False,  # the loop asks for router logits itself; inference does not need them
        initializer_range=0.02,
        bos_token_id=eot_id,
        eos_token_id=[eot_id, im_end_id],
        pad_token_id=eot_id,
        use_cache=True,
    )


# ---------------------------------------------------------------- routed experts for training


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    return fn(x, w, offs=offs)


def bf16_grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Routed experts as two grouped matmuls on bf16 copies of the fp32 master weights.

    hidden_states: [T, H]; top_k_index, top_k_weights: [T, K] -> [T, H] in hidden_states' dtype.
    transformers' own "grouped_mm" runs at the weights' dtype (grouped_mm is not autocast-aware), which for
    fp32 master weights leaves the bf16 grouped GEMM unused.
    """
    T, H = hidden_states.shape
    K = top_k_index.shape[1]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(expert_ids, minlength=self.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = hidden_states[order // K].to(torch.bfloat16)
    gate_up = _grouped_mm(x, self.gate_up_proj.to(torch.bfloat16).transpose(1, 2), offs)  # [T*K, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    out = _grouped_mm(self.act_fn(gate) * up, self.down_proj.to(torch.bfloat16).transpose(1, 2), offs)  # [T*K, H]
    out = out.float() * top_k_weights.reshape(-1)[order].float().unsqueeze(-1)
    unsorted = torch.empty_like(out).index_copy(0, order, out)
    return unsorted.view(T, K, H).sum(1).to(hidden_states.dtype)


TRAIN_EXPERTS_IMPLEMENTATION = "bf16_grouped_mm"


def set_experts_implementation(model, name: str) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(name)
    else:  # transformers versions without the setter read the name from the shared config on every call
        model.config._experts_implementation = name


def register_train_experts() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(TRAIN_EXPERTS_IMPLEMENTATION, bf16_grouped_mm_experts_forward)


# ---------------------------------------------------------------- data


class WindowSampler:
    """Batches of [B, seq_len + 1] windows of a token stream; every window once per epoch, in seeded order."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int):
        n = (tokens.numel() - 1) // seq_len
        if n < batch_size:
            raise ValueError(f"train: {tokens.numel()} tokens make {n} windows of {seq_len}, fewer than --batch-size {batch_size}")
        self.windows = tokens[: n * seq_len + 1].unfold(0, seq_len + 1, seq_len)  # [n, seq_len + 1] view
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.order, self.pos, self.epoch = torch.randperm(n, generator=self.generator), 0, 0

    def next_batch(self) -> torch.Tensor:
        if self.pos + self.batch_size > self.order.numel():
            self.order, self.pos = torch.randperm(self.order.numel(), generator=self.generator), 0
            self.epoch += 1
        idx = self.order[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.windows[idx]

    @property
    def epochs_done(self) -> float:
        return self.epoch + self.pos / self.order.numel()


# ---------------------------------------------------------------- training


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def lr_at(step: int, total: int, warmup: int, peak: float, floor_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def training_loss(model, batch: torch.Tensor, aux_coef: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross entropy + aux_coef * load-balancing loss, cross entropy, aux loss) of a [B, L+1] batch, as tensors
    (reading them would wait for the GPU every step)."""
    out = model(input_ids=batch[:, :-1], output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=ce.device)
    return ce + aux_coef * aux, ce.detach(), aux.detach()


def pick_experts_implementation(model, batch: torch.Tensor, autocast) -> str:
    """The first implementation that runs a forward and backward and matches eager's loss.

    Tries ``bf16_grouped_mm`` (fast on CUDA), then transformers' ``grouped_mm``, and falls back to ``eager``.
    """
    with autocast():
        set_experts_implementation(model, "eager")
        reference = training_loss(model, batch, 0.0)[1].item()
    for name in (TRAIN_EXPERTS_IMPLEMENTATION, "grouped_mm"):
        try:
            set_experts_implementation(model, name)
            with autocast():
                loss, ce, _ = training_loss(model, batch, 0.0)
            loss.backward()
            ce = ce.item()
            model.zero_grad(set_to_none=True)
            if abs(ce - reference) > 0.02 * abs(reference):
                raise RuntimeError(f"loss {ce:.4f} differs from eager's {reference:.4f}")
            print(f"experts implementation: {name} (probe loss {ce:.4f}, eager {reference:.4f})", flush=True)
            return name
        except Exception as e:  # noqa: BLE001 -- any failure means: use the next one
            model.zero_grad(set_to_none=True)
            print(f"experts implementation {name} unusable here: {type(e).__name__}: {str(e)[:200]}", flush=True)
    set_experts_implementation(model, "eager")
    print("experts implementation: eager", flush=True)
    return "eager"


def score(model, tokens: torch.Tensor, seq_len: int, batch_size: int, n_bytes) -> dict[str, float]:
    """evaluation.perplexity with the experts implementation a fresh from_pretrained picks (grouped_mm where
    torch has it), or eager where that fails."""
    for impl in ("grouped_mm", "eager"):
        try:
            set_experts_implementation(model, impl)
            return evaluation.perplexity(model, tokens, seq_len=seq_len, batch_size=batch_size, n_bytes=n_bytes)
        except Exception as e:  # noqa: BLE001
            if impl == "eager":
                raise
            print(f"scoring with {impl} failed ({type(e).__name__}: {str(e)[:200]}); using eager", flush=True)
    raise AssertionError("unreachable")


def valid_loss(model, tokens: torch.Tensor, seq_len: int, batch_size: int, autocast) -> float:
    with autocast():
        return evaluation.perplexity(model, tokens, seq_len=seq_len, batch_size=batch_size)["loss"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4000, help="optimizer steps (default 4000, about 15 epochs)")
    parser.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    parser.add_argument("--warmup", type=int, default=200, help="linear warm-up steps (default 200)")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=50, help="print the training loss every N steps")
    parser.add_argument("--eval-every", type=int, default=200, help="validation every N steps; the best weights are kept")
    parser.add_argument("--valid-tokens", type=int, default=0, help="validate on the first N tokens of valid.txt (0: all)")
    parser.add_argument("--time-budget-s", type=float, default=170.0, help="upper bound on the training loop's seconds")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--corpus", type=Path, default=REPO / ".corpus", help="folder with train.txt and valid.txt")
    parser.add_argument("--tokenizer", type=Path, default=BUILTIN_DIR, help="folder with tokenizer.json (default ktorch/builtin)")
    parser.add_argument("--eval-text", type=Path, default=BUILTIN_DIR / "eval.txt", help="held-out text to report perplexity on")
    parser.add_argument("--out", type=Path, required=True, help="output folder (config, model.safetensors, tokenizer, train_metrics.json)")
    parser.add_argument("--no-tokenizer-files", action="store_true",
                        help="leave the tokenizer files out of --out (when they are there already, e.g. ktorch/builtin)")
    args = parser.parse_args(argv)
    t_start = time.perf_counter()

    from tokenizers import Tokenizer
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    torch.set_float32_matmul_precision("high")  # TF32 for the few fp32 matmuls left outside autocast on CUDA

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    tokenizer = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    train_docs = evaluation.read_documents(args.corpus / "train.txt")
    valid_docs = evaluation.read_documents(args.corpus / "valid.txt")
    eval_docs = evaluation.read_documents(args.eval_text)
    train_tokens = evaluation.token_stream(tokenizer, train_docs)
    valid_tokens = evaluation.token_stream(tokenizer, valid_docs)
    if args.valid_tokens:
        valid_tokens = valid_tokens[: args.valid_tokens]
    eval_tokens = evaluation.token_stream(tokenizer, eval_docs)
    print(
        f"tokens: train {train_tokens.numel():,}  valid {valid_tokens.numel():,}  eval {eval_tokens.numel():,}"
        f"  ({time.perf_counter() - t_start:.1f} s)",
        flush=True,
    )

    config = builtin_config(tokenizer.get_vocab_size(), tokenizer.token_to_id("<|endoftext|>"), tokenizer.token_to_id("<|im_end|>"))
    register_train_experts()
    model = Qwen3MoeForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    print(f"model: {n_params / 1e6:.2f} M parameters ({n_experts / 1e6:.2f} M in routed experts) on {device}", flush=True)

    sampler = WindowSampler(train_tokens, args.seq_len, args.batch_size, args.seed)
    probe = sampler.windows[: min(4, args.batch_size)].to(device)
    experts_impl = pick_experts_implementation(model, probe, autocast)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    total_steps, history, best = args.steps, [], None
    model.train()
    t_loop = time.perf_counter()
    step = 0
    while step < total_steps:
        lr = lr_at(step, total_steps, args.warmup, args.lr)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sampler.next_batch().to(device, non_blocking=True)
        with autocast():
            loss, ce, aux = training_loss(model, batch, config.router_aux_loss_coef)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1

        if args.time_budget_s > 0 and (step == 10 or step == 30 or (step > 30 and step % args.log_every == 0)):
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step time is the GPU's, not the launch queue's
            elapsed = time.perf_counter() - t_loop
            if step == 10:
                t_warm = elapsed  # the first steps warm up; the step time is measured from here
            else:
                per_step = (elapsed - t_warm) / (step - 10)  # includes the validation passes so far
                fit = step + int((args.time_budget_s - elapsed) / (per_step * 1.05))
                if fit < total_steps:
                    print(f"time budget: {per_step * 1e3:.1f} ms/step, {elapsed:.0f} s spent; {total_steps} steps "
                          f"would end past {args.time_budget_s:.0f} s; using {max(fit, step)} steps", flush=True)
                    total_steps = max(fit, step)

        if step % args.log_every == 0 or step == total_steps or step <= 3:
            ce, aux, grad_norm = ce.item(), aux.item(), grad_norm.item()
            elapsed = time.perf_counter() - t_loop
            print(f"step {step:5d}/{total_steps}  loss {ce:.4f}  aux {aux:.3f}  lr {lr:.2e}  |g| {grad_norm:.2f}"
                  f"  epoch {sampler.epochs_done:.2f}  {elapsed:.0f} s", flush=True)
        if step % args.eval_every == 0 or step == total_steps:
            v = valid_loss(model, valid_tokens, args.seq_len, args.batch_size, autocast)
            model.train()
            history.append({"step": step, "train_loss": round(float(ce), 4), "valid_loss": round(v, 4), "epoch": round(sampler.epochs_done, 3)})
            mark = ""
            if best is None or v < best[1]:
                best = (step, v, copy.deepcopy(model.state_dict()))
                mark = "  (best)"
            print(f"valid step {step}: loss {v:.4f}  perplexity {math.exp(v):.2f}{mark}", flush=True)
    train_seconds = time.perf_counter() - t_loop

    best_step, best_valid, state = best
    model.load_state_dict(state)
    del state
    model.to(torch.bfloat16)  # the stored precision
    model.eval()
    model.config.output_router_logits = False
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
        do_sample=False, max_new_tokens=64,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out))
    for name in () if args.no_tokenizer_files else TOKENIZER_FILES:
        src = args.tokenizer / name
        if src.exists() and src.resolve() != (args.out / name).resolve():
            shutil.copyfile(src, args.out / name)
    size = (args.out / "model.safetensors").stat().st_size
    print(f"saved {args.out} (model.safetensors {size / 1e6:.2f} MB)", flush=True)

    # The saved bf16 weights scored as the tests and the CLI load them on a CPU: fp32 compute.
    model.float()
    scores = score(model, eval_tokens, args.seq_len, args.batch_size, evaluation.documents_bytes(eval_docs))
    slice_scores = score(model, eval_tokens[:EVAL_SLICE_TOKENS], EVAL_SLICE_SEQ_LEN, args.batch_size, None)
    print(f"held-out ({args.eval_text.name}, {scores['tokens']:,} tokens): perplexity {scores['perplexity']:.2f},"
          f" {scores['bits_per_byte']:.3f} bits/byte; first {EVAL_SLICE_TOKENS} tokens: {slice_scores['perplexity']:.2f};"
          f" best valid step {best_step}", flush=True)

    metrics = {
        "eval": {"text": str(args.eval_text.relative_to(REPO) if args.eval_text.is_relative_to(REPO) else args.eval_text),
                 "tokens": scores["tokens"], "seq_len": args.seq_len, "perplexity": round(scores["perplexity"], 3),
                 "loss": round(scores["loss"], 4), "bits_per_byte": round(scores["bits_per_byte"], 4),
                 "compute": "fp32 on bf16 weights"},
        "eval_slice": {"tokens": EVAL_SLICE_TOKENS, "seq_len": EVAL_SLICE_SEQ_LEN,
                       "perplexity": round(slice_scores["perplexity"], 3)},
        "best_step": best_step, "best_valid_loss": round(best_valid, 4),
        "steps": total_steps, "steps_requested": args.steps, "epochs": round(sampler.epochs_done, 3),
        "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr, "warmup": args.warmup,
        "weight_decay": args.weight_decay, "seed": args.seed, "train_tokens": train_tokens.numel(),
        "parameters": n_params, "routed_expert_parameters": n_experts,
        "experts_implementation": experts_impl, "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1), "history": history,
        "machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
                    "torch": torch.__version__, "transformers": __import__("transformers").__version__,
                    "python": platform.python_version(), "cpu_count": os.cpu_count()},
        "command": "python " + " ".join([os.path.relpath(__file__, REPO)] + (sys.argv[1:] if argv is None else argv)),
    }
    (args.out / "train_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"wrote {args.out / 'train_metrics.json'}; {time.perf_counter() - t_start:.0f} s total", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
