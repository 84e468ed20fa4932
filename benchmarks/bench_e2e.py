"""End to end against what users run today: ``ktorch generate`` beside transformers + accelerate offload.

Shapes (random weights):
  qwen3-30b-a3b     48 layers, 128 experts top-8, H=2048, I=768, vocab 151936
  deepseek-v2-lite  27 layers (first dense), 64 routed experts top-6 + 2 shared, H=2048, I=1408, MLA attention
                    (hf_offload only: the GGUF writer writes qwen3moe files)
  tiny              the tests' 2-layer Qwen3-MoE (a smoke run; works on a CPU-only machine)

Variants:
  ktorch       ``ktorch generate --model FILE --prompt <P bytes> --max-new-tokens N [OPTIONS]`` in a fresh process,
               exactly as a user types it (benchmarks/bench_generate.py's ``run_generate``), on a random GGUF file of
               the shape (--gguf-type experts, written to --gguf-dir unless there, deleted after unless --keep), once
               per string of options in --ktorch-args ('' = the defaults): the figures are the ones it prints
               (load, prefill rate, decode-step capture, decode rate)
  hf_offload   transformers + accelerate as a user offloads today: device_map puts every `...mlp.experts` on "cpu",
               accelerate's hooks move those weights to the GPU for each forward (bf16 experts in CPU memory), and
               transformers' ``generate`` runs it, timed as ``ktorch generate --plain`` times it (the same function:
               first token = prefill, the rest = decode)

The table and the machine (CPU model, cores, kernel level, torch/transformers versions, GPU) go to stdout;
--json appends one line per process or run. Benchmarks never assert. (The decode step's own profile, on the
model as generate runs it: bench_generate.py --ab-compile 1 --profile-steps N.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import ktorch
from ktorch.integrations import attach_packed_experts
from ktorch.ops.moe import PackedExperts
from ktorch.placement import experts_modules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the benchmarks import each other by name

SHAPES = {
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        max_position_embeddings=8192, tie_word_embeddings=False,
    ),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
        q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, topk_method="greedy",
        n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=8192,
        tie_word_embeddings=False,
    ),
    "tiny": dict(
        model_type="qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=4096, tie_word_embeddings=False,
    ),
}
VARIANTS = ("ktorch", "hf_offload")
INIT_STD = 0.02


# ---------------------------------------------------------------- the machine


def machine_info(device: str) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers

    info = dict(cpu=cpu, cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                kernel=ktorch.cpu_features()["kernel"], torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version())
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    info["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KT_")}  # ktorch's settings
    return info


# ---------------------------------------------------------------- building a random model fast


def _random_block(dtype: torch.dtype, n: int, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.int8:
        return torch.randint(-127, 128, (n,), dtype=torch.int8, generator=gen)
    if dtype == torch.uint8:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    return (torch.randn(n, generator=gen) * INIT_STD).to(dtype)


def fill_random_(t: torch.Tensor, gen: torch.Generator, block_elems: int = (1 << 24) + 4099) -> torch.Tensor:
    """Fills ``t`` by tiling one random block (a length that divides no expert, so experts differ): real memory,
    real values, at copy speed instead of RNG speed."""
    flat = t.view(-1)
    block = _random_block(t.dtype, min(block_elems, flat.numel()), gen)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])
    return t


def random_packed_experts(E: int, H: int, I: int, fmt: str, gen: torch.Generator, group_size=None) -> PackedExperts:
    """Packed experts of the right shapes (taken from the pack ops' fake impls) with random contents whose
    dequantized values have std ~INIT_STD."""
    pack = {"bf16": lambda w, gu: (torch.ops.kt.pack_bf16(w, gate_up=gu), None),
            "int8": lambda w, gu: torch.ops.kt.pack_int8(w, gate_up=gu),
            "int4": lambda w, gu: torch.ops.kt.pack_int4(w, group_size=group_size or 128, gate_up=gu)}[fmt]
    code_std = {"bf16": None, "int8": 73.3, "int4": 4.6}[fmt]
    tensors = []
    for shape, gate_up in (((E, 2 * I, H), True), ((E, H, I), False)):
        meta_w, meta_s = pack(torch.empty(shape, dtype=torch.bfloat16, device="meta"), gate_up)
        w = fill_random_(torch.empty(meta_w.shape, dtype=meta_w.dtype), gen)
        s = None
        if meta_s is not None:
            s = torch.full(meta_s.shape, INIT_STD / code_std, dtype=torch.float32)
            s.mul_(torch.rand(meta_s.shape, generator=gen) + 0.5)
        tensors += [w, s]
    return PackedExperts(tensors[0], tensors[1], tensors[2], tensors[3], fmt, group_size if fmt == "int4" else None)


def _materialize(model: nn.Module, device: str, gen_device: torch.Generator) -> None:
    """Gives every meta parameter/buffer real random storage on ``device`` (norms 1, rotary tables recomputed)."""
    for name, module in list(model.named_modules()):
        if hasattr(module, "inv_freq") and module.inv_freq.device.type == "meta":
            fresh = type(module)(module.config).to(device)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], fresh)
    for module in model.modules():
        is_norm = "norm" in type(module).__name__.lower()
        for pname, p in list(module._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            t = torch.empty(p.shape, dtype=p.dtype, device=device)
            if is_norm and p.dim() == 1:
                t.fill_(1.0)
            else:
                t.normal_(0.0, INIT_STD, generator=gen_device)
            module._parameters[pname] = nn.Parameter(t, requires_grad=False)
        for bname, b in list(module._buffers.items()):
            if b is not None and b.device.type == "meta":
                module._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype, device=device)


def offload_device_map(model: nn.Module) -> dict:
    """The device map a user writes (or infer_auto_device_map gives) to keep the routed experts on the CPU: the
    largest modules holding no experts on GPU 0, each experts module on "cpu"."""
    experts = {name for name, _ in experts_modules(model)}
    device_map = {}

    def visit(module: nn.Module, path: str):
        if path in experts:
            device_map[path] = "cpu"
        elif path and not any(e.startswith(path + ".") for e in experts):
            device_map[path] = 0
        else:
            if next(module.parameters(recurse=False), None) is not None or next(module.buffers(recurse=False), None) is not None:
                raise ValueError(f"offload_device_map: {path or 'the model'} holds tensors beside its experts")
            for child_name, child in module.named_children():
                visit(child, f"{path}.{child_name}" if path else child_name)

    visit(model, "")
    return device_map


def build_model(shape: str, variant: str, device: str, experts_dtype: str, seed: int = 0, layers: int | None = None):
    """A random model of ``shape`` placed for ``variant``: (model, seconds spent building)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.perf_counter()
    kwargs = dict(SHAPES[shape])
    if layers:
        kwargs["num_hidden_layers"] = layers
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    gen_device = torch.Generator(device=device).manual_seed(seed)
    experts = experts_modules(model)
    if variant == "hf_offload":
        for _, m in experts:
            for pname in ("gate_up_proj", "down_proj"):
                p = getattr(m, pname)
                setattr(m, pname, nn.Parameter(fill_random_(torch.empty(p.shape, dtype=p.dtype), gen), requires_grad=False))
        _materialize(model, device, gen_device)
        if device == "cuda":
            from accelerate import dispatch_model

            dispatch_model(model, device_map=offload_device_map(model), main_device=torch.device("cuda", 0))
    else:
        for _, m in experts:
            E, I, H = m.num_experts, m.intermediate_dim, m.hidden_dim
            attach_packed_experts(m, random_packed_experts(E, H, I, experts_dtype, gen))
        _materialize(model, device, gen_device)
        ktorch.prepare(model, device=device)  # experts already packed: placement and experts implementation only
    gc.collect()
    return model, time.perf_counter() - t0


# ---------------------------------------------------------------- ktorch generate on a GGUF file of the shape

# write_random_qwen3moe_gguf's arguments for the shapes a qwen3moe file can hold (layers: SHAPES' or --layers)
GGUF_SHAPES = {
    "qwen3-30b-a3b": {},
    "tiny": dict(num_experts=8, experts_per_token=2, hidden_size=64, expert_intermediate_size=64, num_heads=4,
                 num_kv_heads=2, head_dim=16, vocab_size=256, distinct_experts=2),
}


def gguf_for(shape: str, experts_type: str, layers: int, directory: str) -> tuple[str, bool]:
    """The random GGUF file of ``shape`` (written unless it exists): (path, written now)."""
    from ktorch.integrations.gguf_writer import write_random_qwen3moe_gguf

    if shape not in GGUF_SHAPES:
        raise SystemExit(f"--shape {shape}: the ktorch variant runs `ktorch generate` on a GGUF file, and the "
                         f"writer makes qwen3moe files only ({', '.join(GGUF_SHAPES)}); run --variants hf_offload")
    path = os.path.join(directory, f"{shape}-random-{experts_type}-{layers}l.gguf")
    if os.path.exists(path):
        return path, False
    t0 = time.perf_counter()
    write_random_qwen3moe_gguf(Path(path + ".partial"), experts_type=experts_type, num_layers=layers,
                               progress=False, **GGUF_SHAPES[shape])
    os.replace(path + ".partial", path)
    print(f"wrote {path} ({os.path.getsize(path) / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return path, True


def run_ktorch(path: str, prompts: list[int], decode_tokens: int, ktorch_args: list[str], runs: int,
               timeout_s: float) -> list[dict]:
    """One row per ``ktorch generate`` process: per options string, run and prompt length."""
    from bench_generate import run_generate

    rows = []
    for extra in ktorch_args:
        for run in range(runs):
            for p in prompts:
                r = run_generate(path, p, decode_tokens, shlex.split(extra), timeout_s)
                rows.append(dict(r, variant="ktorch", options=extra.strip() or "defaults", run=run, prompt=p))
    return rows


# ---------------------------------------------------------------- the peer: transformers + accelerate offload


class _NoText:
    def put(self, value):
        pass

    def end(self):
        pass


@torch.no_grad()
def run_hf_offload(shape: str, device: str, prompts: list[int], decode_tokens: int, layers: int | None) -> list[dict]:
    """transformers' ``generate`` on the offloaded model, timed by the function ``ktorch generate --plain`` uses:
    one row per prompt length."""
    from ktorch.cli import TokenIdsTokenizer, _run_plain_generation

    model, build_s = build_model(shape, "hf_offload", device, "bf16", layers=layers)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    settings = argparse.Namespace(temperature=0.0, top_p=1.0, repetition_penalty=1.0, seed=0,
                                  max_new_tokens=decode_tokens)
    rows = []
    for p in prompts:
        ids = torch.randint(0, vocab, (1, p), generator=gen)
        new_ids, t = _run_plain_generation(model, TokenIdsTokenizer(vocab), ids, settings, _NoText())
        rows.append(dict(variant="hf_offload", options="accelerate device_map: experts on cpu", prompt=p,
                         build_s=build_s, prompt_tokens=p, first_token_s=t.first_token_s,
                         prefill_tok_s=t.prefill_tok_s, decode_tokens=t.decode_tokens, decode_s=t.decode_s,
                         decode_tok_s=t.decode_tok_s))
        print(f"hf_offload P={p}: {t.line()}", flush=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--variants", default="ktorch,hf_offload", help="ktorch, hf_offload (default: both)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--prompts", default="512", help="prompt lengths, a process (ktorch) or a run each")
    parser.add_argument("--decode-tokens", type=int, default=64, help="ktorch generate --max-new-tokens")
    parser.add_argument("--baseline-decode-tokens", type=int, default=4, help="new tokens for hf_offload")
    parser.add_argument("--ktorch-args", nargs="*", default=[""], metavar="OPTIONS",
                        help="one string of `ktorch generate` options per setting, e.g. '' '--deferred-experts 3' "
                             "(default: '' = the defaults)")
    parser.add_argument("--runs", type=int, default=1, help="ktorch generate processes per setting and prompt")
    parser.add_argument("--timeout", type=float, default=400, help="seconds per ktorch process")
    parser.add_argument("--gguf-type", default="Q8_0", help="GGML type of the file's experts (Q8_0 loads as int8)")
    parser.add_argument("--gguf-dir", default="/tmp", help="where the GGUF file goes (default: /tmp)")
    parser.add_argument("--keep", action="store_true", help="keep a GGUF file this run wrote")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="hf_offload's main device (ktorch generate: its default, the GPU when there is one)")
    parser.add_argument("--json", default=None, help="append results as JSON lines to this file")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)

    variants = [v for v in args.variants.split(",") if v]
    for variant in variants:
        if variant not in VARIANTS:
            raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")
    info = machine_info(args.device)
    print("machine:", json.dumps(info))
    layers = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    print(f"shape: {args.shape}, {layers} layers {json.dumps(SHAPES[args.shape])}", flush=True)
    prompts = [int(p) for p in args.prompts.split(",") if p]
    rows: list[dict] = []
    if "ktorch" in variants:
        path, written = gguf_for(args.shape, args.gguf_type, layers, args.gguf_dir)
        try:
            rows += run_ktorch(path, prompts, args.decode_tokens, args.ktorch_args, args.runs, args.timeout)
        finally:
            if written and not args.keep:
                os.unlink(path)
    if "hf_offload" in variants:
        rows += run_hf_offload(args.shape, args.device, prompts, args.baseline_decode_tokens, args.layers)
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps(dict(r, shape=args.shape, layers=layers, machine=info), default=str) + "\n")

    print("\n| variant | options | prompt | prefill tok/s | decode tok/s | load s | decode-step capture s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | {r['options']} | {r['prompt']} | error: {r['error'][:200]!r} | | | |")
            continue
        cells = [f"{r[k]:.2f}" if k in r else "-" for k in ("prefill_tok_s", "decode_tok_s", "load_s", "capture_s")]
        print(f"| {r['variant']} | {r['options']} | {r['prompt']} | " + " | ".join(cells) + " |")
    decode = {}
    for r in rows:
        if r.get("decode_tok_s"):
            decode.setdefault((r["variant"], r["options"]), []).append(r["decode_tok_s"])
    base = [statistics.median(v) for (variant, _), v in decode.items() if variant == "hf_offload"]
    for (variant, options), v in decode.items():
        if variant == "ktorch" and base:
            print(f"decode, ktorch generate [{options}] / hf_offload: {statistics.median(v) / base[0]:.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
