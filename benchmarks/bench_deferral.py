"""Expert deferral and hot experts on the GPU: quality on the built-in model, speed on large random models.

quality  (runs on a CPU in about a minute): the built-in trained Qwen3-MoE model (4 MoE layers, 16 experts,
         top-4; ktorch/builtin) on its held-out text (50 709 tokens, windows of 512), experts packed bf16 on the
         CPU. For each d in 0..K, two ways of treating each token's d lowest-weighted experts at every MoE layer
         but the last:
           defer  computed from layer i's input, added to layer i+1's routed output (docs/deferral.md)
           skip   not computed at all (the same slots dropped)
         Reported: perplexity, mean loss, and top-1 agreement (the share of positions whose argmax next token
         equals d = 0's).

speed    (the device): decode tok/s of ``ktorch generate``'s path on a random Qwen3-30B-A3B shaped GGUF file (--layers,
         --gguf-type; written to --gguf-dir unless there): the model loaded by the CLI's own loader
         (``ktorch.cli.load_model`` with the parsed options of ``ktorch generate`` plus --ktorch-args), decoded by
         the CLI's own call (``ktorch.cli.run_generation``: ``ktorch.generate`` with the command's defaults), for
         each n_deferred_experts in --deferred (``--deferred-experts d``, set between rows with
         ``ktorch.set_deferred_experts``, a fresh decode-step capture per row) and for each fraction in
         --gpu-experts of every layer's hottest experts kept on the GPU (d = 0). The routers get a Zipf bias
         (--zipf s: p_e ~ 1/rank^s, a random ranking per layer) so that random weights have hot experts;
         profile_experts finds them on one random prompt and f, the fraction of routed slots that land on GPU
         experts, is measured on another. The rates are the ones ``ktorch generate`` prints (its Timings). With
         --profile-steps N (GPU): N replays of each row's captured step profiled (bench_generate.profile_steps:
         wall ms, CPU experts ms and GPU kernel ms per step).

Benchmarks never assert; they print a table and the machine. --json appends one line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ktorch
from ktorch.passes.deferral import split_topk_slots
from ktorch.placement import experts_modules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- quality on the built-in model


class SkipLowestExperts:
    """Drops each token's ``n_skipped`` lowest-weighted slots at every MoE layer but the last (a context manager):
    the baseline that deferral is compared with. The slots get id -1, which kt.fused_moe skips."""

    def __init__(self, model, n_skipped: int):
        self.modules = [m for _, m in experts_modules(model)][:-1]
        self.n_skipped, self.handles = n_skipped, []

    def __enter__(self):
        def hook(module, args):
            hidden, ids, weights = args
            kept, _ = split_topk_slots(ids, weights, ids.shape[-1] - min(self.n_skipped, ids.shape[-1]))
            return hidden, kept, weights

        if self.n_skipped:
            self.handles = [m.register_forward_pre_hook(hook) for m in self.modules]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@torch.no_grad()
def score(model, tokens: torch.Tensor, seq_len: int, batch_size: int) -> tuple[float, torch.Tensor]:
    """(mean next-token NLL in nats, argmax predictions [N - 1]) of ``tokens`` [N] in consecutive windows of
    ``seq_len`` + 1 tokens (ktorch.builtin.evaluation.perplexity's windows)."""
    starts = list(range(0, tokens.numel() - 1, seq_len))
    nll, predictions = 0.0, []
    for i in range(0, len(starts), batch_size):
        group = starts[i:i + batch_size]
        for length in sorted({min(seq_len, tokens.numel() - 1 - s) for s in group}, reverse=True):
            same = [s for s in group if min(seq_len, tokens.numel() - 1 - s) == length]
            batch = torch.stack([tokens[s:s + length + 1] for s in same])
            logits = model(input_ids=batch[:, :-1], use_cache=False).logits.float()
            nll += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            predictions += [(s, logits[j].argmax(-1)) for j, s in enumerate(same)]
    predictions.sort(key=lambda p: p[0])
    return nll / (tokens.numel() - 1), torch.cat([p for _, p in predictions])


def run_quality(args) -> list[dict]:
    from ktorch.builtin import EVAL_TEXT_PATH, load_builtin, read_documents, token_stream

    model, tokenizer = load_builtin("cpu")
    ktorch.prepare(model, device="cpu", experts_dtype="bf16")
    tokens = token_stream(tokenizer, read_documents(EVAL_TEXT_PATH))
    if args.max_tokens:
        tokens = tokens[:args.max_tokens]
    k = model.config.num_experts_per_tok
    rows, baseline = [], None
    for d in range(k + 1):
        for mode in ("defer", "skip"):
            if d == 0 and mode == "skip":
                continue
            t0 = time.perf_counter()
            if mode == "defer":
                ktorch.set_deferred_experts(model, d)
                loss, pred = score(model, tokens, args.seq_len, args.batch_size)
                ktorch.set_deferred_experts(model, 0)
            else:
                with SkipLowestExperts(model, d):
                    loss, pred = score(model, tokens, args.seq_len, args.batch_size)
            if baseline is None:
                baseline = pred
            row = dict(mode=mode if d else "none", d=d, K=k, loss=loss, perplexity=float(torch.tensor(loss).exp()),
                       top1_agreement=(pred == baseline).float().mean().item(), tokens=int(tokens.numel() - 1),
                       seconds=time.perf_counter() - t0)
            rows.append(row)
            print(f"  {row['mode']:>5} d={d}: perplexity {row['perplexity']:8.2f}  top-1 agreement "
                  f"{100 * row['top1_agreement']:6.2f}%  ({row['seconds']:.0f} s)", file=sys.stderr)
    return rows


def print_quality(rows: list[dict]) -> None:
    k = rows[0]["K"]
    print(f"\nBuilt-in model (Qwen3-MoE, 4 MoE layers, 16 experts, top-{k}), held-out text, {rows[0]['tokens']} "
          "predicted tokens; the d lowest-weighted experts per token at every MoE layer but the last:\n")
    print("| d | deferred: perplexity | deferred: top-1 agreement | skipped: perplexity | skipped: top-1 agreement |")
    print("|---|---|---|---|---|")
    by = {(r["mode"], r["d"]): r for r in rows}
    for d in range(k + 1):
        defer = by.get(("defer", d), by.get(("none", d)))
        skip = by.get(("skip", d), by.get(("none", d)))
        print(f"| {d} | {defer['perplexity']:.2f} | {100 * defer['top1_agreement']:.2f}% | "
              f"{skip['perplexity']:.2f} | {100 * skip['top1_agreement']:.2f}% |")


# ---------------------------------------------------------------- speed on the device


class ZipfSkewedRouter(nn.Module):
    """Qwen3-MoE's top-k router with a fixed bias ``log p_e`` added to its logits, p_e ~ 1 / rank(e)^s over a
    random ranking of the experts: random weights then route like a trained model with hot experts."""

    def __init__(self, router: nn.Module, zipf_s: float, gen: torch.Generator):
        super().__init__()
        self.router = router
        E = router.num_experts
        rank = torch.randperm(E, generator=gen) + 1
        self.register_buffer("bias", (-zipf_s * rank.double().log()).float().to(router.weight.device))

    def forward(self, hidden_states):
        r = self.router
        hidden_states = hidden_states.reshape(-1, r.hidden_dim)
        logits = F.linear(hidden_states, r.weight) + self.bias.to(r.weight.dtype)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, r.top_k, dim=-1)
        if r.norm_topk_prob:
            top_value = top_value / top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_index


def skew_routers(model, zipf_s: float, seed: int = 0) -> int:
    """Replaces every Qwen3-MoE router of ``model`` by a ZipfSkewedRouter; returns how many."""
    gen = torch.Generator().manual_seed(seed)
    n = 0
    for module in list(model.modules()):
        gate = getattr(module, "gate", None)
        if gate is not None and type(gate).__name__ == "Qwen3MoeTopKRouter":
            module.gate = ZipfSkewedRouter(gate, zipf_s, gen)
            n += 1
    return n


def attach_random_gpu_experts(model, profile, fraction: float, device: str, seed: int = 0) -> dict:
    """Keeps the hottest ``fraction`` of each layer's experts (by ``profile``) on ``device``, with random weights
    (the CPU ones are random too); returns the placement."""
    from ktorch.integrations import attach_gpu_experts

    gen = torch.Generator(device=device).manual_seed(seed)
    for name, m in experts_modules(model):
        E = m.kt_w13.shape[0]
        n = round(fraction * E)
        if n == 0:
            continue
        H, I = m.hidden_dim, m.intermediate_dim
        w13 = torch.empty(n, H, 2 * I, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
        w2 = torch.empty(n, I, H, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
        attach_gpu_experts(m, profile.hottest(name, n), w13, w2)
    return ktorch.gpu_placement(model)


def detach_gpu_experts(model) -> None:
    for _, m in experts_modules(model):
        for name in ("kt_gpu_slot_of", "kt_gpu_w13", "kt_gpu_w2"):
            if hasattr(m, name):
                delattr(m, name)


def load_as_cli(gguf: str, options: str):
    """(model, tokenizer, parsed options) as ``ktorch generate --model gguf OPTIONS`` loads them."""
    from ktorch import cli

    parsed = cli.build_parser().parse_args(["generate", "--model", gguf, "--prompt", "x", *shlex.split(options)])
    model, tokenizer, _ = cli.load_model(parsed)
    return model, tokenizer, parsed


def run_speed(args) -> list[dict]:
    import bench_e2e

    from ktorch.cli import run_generation

    rows = []
    grid = [(d, 0.0) for d in (int(x) for x in args.deferred.split(",") if x)]
    grid += [(0, float(g)) for g in args.gpu_experts.split(",") if g and float(g) > 0]
    path, written = bench_e2e.gguf_for(args.shape, args.gguf_type, args.layers, args.gguf_dir)
    try:
        t0 = time.perf_counter()
        model, tokenizer, options = load_as_cli(path, args.ktorch_args)
        build_s = time.perf_counter() - t0
    finally:
        if written and not args.keep:
            os.unlink(path)
    device = next(model.parameters()).device
    skewed = skew_routers(model, args.zipf) if args.zipf else 0
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    profile = ktorch.profile_experts(model, torch.randint(0, vocab, (1, 512), generator=gen).to(device))
    check_ids = torch.randint(0, vocab, (1, 512), generator=gen).to(device)
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=gen)
    options.max_new_tokens = args.decode_tokens
    print(f"  loaded in {build_s:.0f} s; {skewed} routers Zipf-skewed (s={args.zipf})", file=sys.stderr)
    with open(os.devnull, "w") as text_sink:
        for d, gpu_fraction in grid:
            detach_gpu_experts(model)
            f = 0.0
            if gpu_fraction:
                placement = attach_random_gpu_experts(model, profile, gpu_fraction, str(device))
                f = ktorch.profile_experts(model, check_ids).fraction_on(placement)  # on tokens not profiled
            ktorch.set_deferred_experts(model, d)
            model.kt_decoder = None  # a fresh capture for this placement
            _, t = run_generation(model, tokenizer, prompt, options, out=text_sink)
            row = dict(shape=args.shape, layers=args.layers, n_deferred_experts=d, gpu_experts=gpu_fraction, f=f,
                       zipf_s=args.zipf if skewed else 0.0, ktorch_args=args.ktorch_args,
                       prompt_tokens=t.prompt_tokens, prefill_tok_s=t.prefill_tok_s, decode_tokens=t.decode_tokens,
                       decode_tok_s=t.decode_tok_s, capture_s=t.warmup_s, cuda_graphs=t.cuda_graphs)
            rows.append(row)
            if args.json:  # row by row: a run cut short keeps what it measured
                with open(args.json, "a") as fh:
                    fh.write(json.dumps({"bench": "deferral_speed", **row}) + "\n")
            print(f"  d={d} gpu_experts={gpu_fraction} (f={f:.2f}): {t.line()}, capture {t.warmup_s:.1f} s",
                  file=sys.stderr)
            if args.profile_steps and getattr(model.kt_decoder, "graph", None) is not None:
                from bench_generate import profile_steps

                profile_steps(model.kt_decoder, args.profile_steps, f"d={d} gpu_experts={gpu_fraction}")
    ktorch.set_deferred_experts(model, 0)
    return rows


def print_speed(rows: list[dict]) -> None:
    print("\n| shape | layers | d | GPU experts | f | decode tok/s | prefill tok/s | decode-step capture s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['layers']} | {r['n_deferred_experts']} | {100 * r['gpu_experts']:.0f}% | "
              f"{r['f']:.2f} | {r['decode_tok_s']:.2f} | {r['prefill_tok_s']:.1f} | {r['capture_s']:.1f} |")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("quality", "speed"))
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=None, help="quality: score only the first tokens")
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=("qwen3-30b-a3b", "tiny"),
                        help="speed: the random GGUF file's shape (bench_e2e.py's; tiny: a smoke run)")
    parser.add_argument("--layers", type=int, default=12, help="speed: decoder layers of the file (default: 12)")
    parser.add_argument("--gguf-type", default="Q8_0", help="speed: GGML type of the experts (Q8_0 loads as int8)")
    parser.add_argument("--gguf-dir", default="/tmp", help="speed: where the GGUF file goes (default: /tmp)")
    parser.add_argument("--keep", action="store_true", help="speed: keep a GGUF file this run wrote")
    parser.add_argument("--ktorch-args", default="",
                        help="speed: more `ktorch generate` options for the load, e.g. '--stream-experts off'")
    parser.add_argument("--deferred", default="0,1,2,4,6", help="speed: --deferred-experts values (no GPU experts)")
    parser.add_argument("--gpu-experts", default="0.1,0.25", help="speed: fractions of hot experts on the GPU (d=0)")
    parser.add_argument("--zipf", type=float, default=1.0, help="speed: Zipf exponent of the router skew (0: none)")
    parser.add_argument("--prompt", type=int, default=512, help="speed: prompt tokens before decoding")
    parser.add_argument("--decode-tokens", type=int, default=64, help="speed: --max-new-tokens")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="speed: profile this many replays of each row's captured decode step (GPU)")
    parser.add_argument("--json", default=None, help="append rows as JSON lines to this file")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    import bench_e2e

    print(json.dumps(bench_e2e.machine_info("cuda" if torch.cuda.is_available() else "cpu")))
    if args.what == "quality":
        rows = run_quality(args)
        print_quality(rows)
    else:
        rows = run_speed(args)
        print_speed(rows)
        return  # rows were written as they came
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": f"deferral_{args.what}", **r}) + "\n")


if __name__ == "__main__":
    main()
