"""The ``ktorch`` command: generate text, chat, and run the benchmarks (the CPU experts op, end to end, ...).

    ktorch generate --model builtin --prompt "The meaning of life is"
    ktorch generate --model /path/to/Qwen3-30B-A3B --prompt "..." --experts-dtype int8 --max-new-tokens 128
    ktorch generate --model /path/to/Qwen3-30B-A3B-Q4_K_M.gguf --prompt "..."
    ktorch chat --model builtin
    ktorch serve --model builtin --port 8000          # OpenAI-compatible server (/v1/chat/completions, ...)
    ktorch bench -- --shapes qwen3 --tokens 1 512
    ktorch bench e2e -- --shape qwen3-30b-a3b --prompts 512 --ktorch-args "" "--deferred-experts 3"

A model is a transformers checkpoint folder (config.json, safetensors, tokenizer files), a llama.cpp GGUF file,
or ``builtin``, the small MoE model shipped in ktorch/builtin. Unless ``--plain`` is given, ``ktorch.load`` builds
the model layer by layer, packing the routed experts into CPU memory (``--experts-dtype``) where
``torch.ops.kt.fused_moe`` runs them, and puts everything else on ``--device``: the GPU when there is one,
otherwise the CPU. A GGUF file without a tokenizer (``tokenizer.ggml.model = "none"``, benchmark files) runs on
token ids: the prompt's UTF-8 bytes are the input ids and the new ids are printed.
"""

from __future__ import annotations

import argparse
import errno
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

EXPERTS_DTYPES = ("auto", "bf16", "int8", "int4")
# ktorch bench NAME: the script under benchmarks/ and what it measures
BENCHMARKS = {
    "op": ("bench_fused_moe.py", "one MoE layer's routed experts on the CPU, per dtype, against the eager loop"),
    "generate": ("bench_generate.py", "fresh `ktorch generate` processes on a GGUF file, as typed, beside llama-bench"),
    "e2e": ("bench_e2e.py", "`ktorch generate` on a random-weight model of a shape against transformers + accelerate "
            "offload"),
    "deferral": ("bench_deferral.py", "expert deferral and hot experts: quality on the built-in model, decode speed "
                 "of `ktorch generate`'s loader and call"),
    "overhead": ("bench_overhead.py", "the fixed cost of one kt.fused_moe call"),
    "vs-kt-kernel": ("bench_vs_kt_kernel.py", "the op against KTransformers' kt-kernel on the same layers"),
    "vs-llamacpp": ("bench_vs_llamacpp.py", "`ktorch generate` against llama.cpp on the same GGUF weights, a file "
                    "per experts type"),
}
DTYPES = {"auto": None, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class CLIError(Exception):
    """A user-facing error: printed as ``ktorch <command>: <message>``, exit status 1."""


# ---------------------------------------------------------------- arguments


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and placement")
    m.add_argument(
        "--model",
        default="builtin",
        help="a transformers checkpoint folder (config.json + safetensors + tokenizer), a llama.cpp .gguf file "
        "(qwen3moe, qwen2moe, deepseek2, Mixtral), or 'builtin' for the small MoE model shipped with ktorch "
        "(default: builtin)",
    )
    m.add_argument(
        "--device",
        default="auto",
        help="where attention, routers, embeddings and the KV cache run: auto (cuda if a GPU is visible, else cpu), "
        "cpu, cuda, cuda:N (default: auto). The routed experts live in host memory, run by the CPU op; on a GPU "
        "--gpu-memory keeps the most used of them on it too.",
    )
    m.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="auto",
        help="dtype of the non-expert weights and activations: auto (the checkpoint's own, e.g. bf16), bf16, fp16, "
        "fp32 (default: auto)",
    )
    m.add_argument(
        "--experts-dtype",
        choices=EXPERTS_DTYPES,
        default="auto",
        help="format the routed experts are packed into for the CPU op: auto (bf16 for transformers checkpoints; "
        "for GGUF the file's values exactly: Q4_0/Q4_K/Q5_K/Q6_K/Q8_0/MXFP4 codes with their scales, floats -> "
        "bf16), bf16 (exact for bf16 checkpoints), int8 (per-channel), int4 (grouped, see --group-size): these "
        "requantize a GGUF file and print the error (default: auto)",
    )
    m.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="int4 only: input channels per quantization group, a multiple of 32 dividing the hidden and expert "
        "sizes (default: 128 where it divides them, else 32)",
    )
    m.add_argument(
        "--deferred-experts",
        type=int,
        default=0,
        metavar="D",
        help="expert deferral: at every MoE layer but the last, each token's D lowest-weighted routed experts "
        "join the next layer's output instead, so the CPU finishes them while the GPU runs on (docs/deferral.md; "
        "0 <= D <= the model's experts per token; changes results slightly by design) (default: 0)",
    )
    m.add_argument(
        "--stream-experts",
        default=None,
        metavar="PLAN",
        help="GPU only: long prompts compute part of each layer's experts on the GPU while the CPU does the rest "
        "(docs/prefill_streaming.md): auto (per layer, once routed, the experts the prompt uses most are copied to "
        "the GPU until both sides balance, by costs measured at load; unused experts move nowhere), off, or "
        "MIN_TOKENS:SHARE,... (a fixed prefix of every layer's experts, SHARE a fraction or an expert count, e.g. "
        "512:0.4,2048:0.45; for comparison) (default: auto on a GPU, off on the CPU)",
    )
    m.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="GPU only: the GPU memory the process may use, as nvidia-smi shows it (ktorch/gpu_memory.py): the CUDA "
        "context, the non-expert weights and a KV cache/activations reserve first (serve: its KV-cache pool), then the "
        "prefill split's staging, then resident experts (each layer's most routed-to, computed on the GPU at prefill "
        "and decode): auto (the free memory minus 512 MiB), off (every expert in host memory, run by the CPU op), or "
        "a size such as 24GiB, 24GB or a byte count "
        "(default: auto on a GPU, measured 7.2x the decode and 5.6x the first 512-token prompt's prefill of off with "
        "--deferred-experts 2 on a 48-layer Qwen3-30B-A3B-shaped Q8_0 file that fits the GPU, benchmarks/RESULTS.md; "
        "ignored on the CPU)",
    )
    m.add_argument(
        "--no-compile",
        action="store_true",
        help="GPU only: decode eagerly, one launch per kernel and a host sync per MoE layer, instead of replaying the "
        "decode step as one captured CUDA graph (the default: compiled and captured after the first token, 2-3 s on "
        "a 48-layer model, the compiled code cached on disk; the load's warm-up then also keeps a captured prefill "
        "for the first prompt: docs/architecture.md). For debugging and comparisons.",
    )
    m.add_argument(
        "--plain",
        action="store_true",
        help="run the model as transformers loads it, without ktorch.prepare: the experts run on --device with "
        "transformers' own implementation (a baseline for speed and quality comparisons)",
    )


def _add_sampling_arguments(p: argparse.ArgumentParser, temperature: float) -> None:
    s = p.add_argument_group("generation")
    s.add_argument("--max-new-tokens", type=int, default=64 if temperature == 0 else 256, metavar="N",
                   help="stop after N new tokens (default: %(default)s)")
    s.add_argument("--temperature", type=float, default=temperature,
                   help="sampling temperature; 0 picks the most likely token (greedy) (default: %(default)s)")
    s.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass when sampling (default: %(default)s)")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide the logits of tokens already present by this (1.0: off) (default: %(default)s)")
    s.add_argument("--seed", type=int, default=0, help="random seed for sampling (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ktorch",
        description="CPU/GPU hybrid inference of MoE language models: routed experts on the CPU "
        "(torch.ops.kt.fused_moe), everything else on the GPU, or all of it on the CPU.",
        epilog="Run 'ktorch <command> --help' for a command's options. Example: "
        "ktorch generate --model builtin --prompt \"The meaning of life is\"",
    )
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)

    gen = sub.add_parser(
        "generate",
        help="complete a prompt, streaming the text, then print prefill and decode tokens/s",
        description="Complete a prompt with greedy decoding (or sampling with --temperature), printing the text "
        "as it is generated, then prefill tokens/s (prompt tokens / time to the first new token) and decode "
        "tokens/s (the remaining new tokens / their time) on stderr.",
    )
    gen.add_argument("--prompt", required=True, help="the text to complete; - reads it from standard input (a long "
                     "prompt, a file: --prompt - < FILE)")
    gen.add_argument("--chat-template", action="store_true",
                     help="wrap the prompt as a user message with the tokenizer's chat template")
    _add_model_arguments(gen)
    _add_sampling_arguments(gen, temperature=0.0)

    chat = sub.add_parser(
        "chat",
        help="interactive chat session using the tokenizer's chat template",
        description="Interactive chat: type a message and press Enter; the reply streams back. The conversation "
        "is formatted with the tokenizer's chat template. Commands: /reset clears the history, /exit (or "
        "Ctrl-D) quits.",
    )
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    _add_model_arguments(chat)
    _add_sampling_arguments(chat, temperature=0.7)

    serve = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with continuous batching and a prefix cache",
        description="Serves the model over HTTP in OpenAI's API: POST /v1/chat/completions and /v1/completions "
        "(streamed as server-sent events with \"stream\": true), GET /v1/models, GET /health, GET /v1/stats "
        "(ktorch's counters). Requests join and leave the running batch at every step; long prompts are prefilled "
        "in chunks of at most --max-batch-tokens tokens beside the other requests' decode tokens; KV pages of "
        "shared prompt prefixes are reused (README, Serving).",
    )
    _add_model_arguments(serve)
    srv = serve.add_argument_group("server")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model id clients name (default: 'builtin' or the checkpoint's file or folder name)")
    srv.add_argument("--page-size", type=int, default=None, metavar="TOKENS",
                     help="tokens per KV-cache page; prefixes are shared in whole pages (default: 16, EngineConfig.page_size)")
    srv.add_argument("--kv-pages", type=int, default=None, metavar="N",
                     help="KV-cache pages in the pool (default: --kv-cache-gib of them)")
    srv.add_argument("--kv-cache-gib", type=float, default=None, metavar="GIB",
                     help="memory for the KV-cache pool (default: 1 on the CPU; on a GPU with a --gpu-memory budget, "
                     "the default auto, 32768 tokens' worth plus whatever the resident experts leave, reserved before "
                     "them; with --gpu-memory off transformers sizes it from the free GPU memory)")
    srv.add_argument("--max-batch-tokens", type=int, default=None, metavar="N",
                     help="tokens per step: decode tokens plus a chunk of a new prompt (default: 512 on the CPU; on a "
                     "GPU sized by transformers)")
    srv.add_argument("--max-requests", type=int, default=256, metavar="N",
                     help="requests in flight (running or queued); more get HTTP 429 (default: %(default)s)")
    srv.add_argument("--max-queued-tokens", type=int, default=1 << 17, metavar="N",
                     help="prompt tokens of admitted requests not yet prefilled; a request past it gets HTTP 429 "
                     "(default: %(default)s)")
    srv.add_argument("--cuda-graphs", choices=("auto", "on", "off"), default="auto",
                     help="GPU: replay captured CUDA graphs for decode-sized steps, padded to token buckets (auto and "
                     "on: on a GPU; off: every step eager, measured 4.3x slower at one stream: RESULTS.md, serving) "
                     "(default: %(default)s)")
    srv.add_argument("--cpu-offload-gib", type=float, default=0.0, metavar="GIB",
                     help="GPU: pinned host memory for the KV pages of requests preempted when the GPU pool is full "
                     "(0: they re-prefill instead) (default: %(default)s)")
    srv.add_argument("--no-prefix-cache", action="store_true", help="do not share KV pages between requests")
    srv.add_argument("--host-prefix-cache-gib", type=float, default=None, metavar="GIB",
                     help="the prefix cache's second tier: KV pages evicted from the pool are kept in this much host "
                     "memory (least recently used dropped first) and copied back when a prompt starts with them "
                     "(default: 4 on a GPU, 0 on the CPU, where the pool is host memory already)")
    srv.add_argument("--step-stats", action="store_true",
                     help="record each step's tokens, time, distinct experts read and whether it replayed a CUDA "
                     "graph in /v1/stats (synchronizes the GPU around every step: for measurements, not for serving)")

    bench = sub.add_parser(
        "bench",
        help="run one of the benchmarks: the CPU experts op (default), end to end, deferral, the peers",
        description="Runs a benchmark script of the source checkout's benchmarks/ with the arguments after '--': "
        "'ktorch bench [NAME] -- ARGS', NAME one of "
        + ", ".join(f"{name} ({script}: {what})" for name, (script, what) in BENCHMARKS.items())
        + ". NAME defaults to op. 'ktorch bench NAME -- --help' lists a benchmark's own options. Examples: "
        "'ktorch bench -- --shapes qwen3 --tokens 1 512'; "
        "'ktorch bench e2e -- --shape qwen3-30b-a3b --prompts 512'.",
    )
    bench.add_argument("args", nargs=argparse.REMAINDER,
                       help="[NAME] then the benchmark's own arguments after -- (NAME: " + ", ".join(BENCHMARKS) + ")")
    return parser


# ---------------------------------------------------------------- loading and placement


def resolve_model_path(model: str) -> Path:
    """The checkpoint folder for ``--model``: ktorch/builtin for 'builtin', else the given folder (checked)."""
    from ktorch.loading import builtin_or_path

    path = builtin_or_path(model)
    if not path.exists():
        raise CLIError(f"--model {model}: no such file or folder; give a transformers checkpoint folder, a .gguf file "
                       "or 'builtin'")
    if path.is_file():
        return path  # ktorch.load checks it is GGUF
    if not (path / "config.json").exists() and any(path.glob("*.gguf")):
        raise CLIError(f"--model {model}: a folder of GGUF files; give the .gguf file itself")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise CLIError(f"--model {model}: not a transformers checkpoint folder (no config.json in it); give a folder "
                       "with config.json, safetensors weights and tokenizer files, or 'builtin'")
    return path


def resolve_device(device: str):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise CLIError(f"--device {device}: {e}") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {device}: this torch sees no CUDA GPU (torch {torch.__version__}); use --device cpu")
    return resolved


def load_model(args: argparse.Namespace, warm_up: bool = True, reserve_for=None):
    """(model, tokenizer, device), the model placed as the arguments ask. On a GPU, unless ``--plain`` (transformers'
    own path, as it runs) or ``warm_up=False``, it ends with ``ktorch.warm_up`` after the placement options (so the
    split's stagings and the residents are warmed too): the first prompt runs at warm speed. Its seconds (in the
    loading time) go to ``args.warm_up_s``, 0.0 when none ran. ``reserve_for(model)``: the bytes the GPU memory
    budget keeps for the KV cache and activations before the residents (``ktorch serve``: its pool's; default:
    generate's static cache, ktorch/gpu_memory.py ``reserve_bytes``)."""
    import torch

    args.warm_up_s = 0.0
    if args.deferred_experts < 0:
        raise CLIError(f"--deferred-experts must be >= 0, got {args.deferred_experts}")
    from ktorch.ops.streamed_experts import parse_stream_plan

    stream_by_default, gpu_memory_by_default = placement_defaults(args, resolve_device(args.device))
    try:
        stream = parse_stream_plan(args.stream_experts)
    except ValueError as e:
        raise CLIError(f"--stream-experts {args.stream_experts}: {e}") from None
    if args.no_compile and resolve_device(args.device).type != "cuda":
        raise CLIError("--no-compile turns off the CUDA graph of the decode step: it needs --device cuda (a GPU); "
                       "on the CPU decoding is eager anyway")
    if args.plain and (args.deferred_experts or stream != "off" or args.gpu_memory != "off"):
        raise CLIError("--plain runs transformers' own experts: --deferred-experts, --stream-experts and --gpu-memory "
                       "need ktorch")
    gpu_memory = _gpu_memory_argument(args.gpu_memory, stream)
    if args.group_size is not None and args.experts_dtype != "int4":
        raise CLIError(f"--group-size applies to --experts-dtype int4 only, got --experts-dtype {args.experts_dtype}")
    path = resolve_model_path(args.model)
    device = resolve_device(args.device)

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # no loading progress bars or advice between the command and its text
    hf_logging.disable_progress_bar()
    dtype = "auto" if DTYPES[args.dtype] is None else getattr(torch, DTYPES[args.dtype])
    if not args.plain:
        import ktorch
        from ktorch.integrations.checkpoint_loading import CheckpointError

        if device.type == "cuda" and not getattr(args, "no_compile", False):
            from ktorch.generation import preload_compiler

            preload_compiler()  # the decode step's compile imports Inductor: do it while the weights load

        try:
            model, tokenizer = ktorch.load(path, device=device, experts_dtype=args.experts_dtype,
                                           group_size=args.group_size, dtype=None if dtype == "auto" else dtype,
                                           progress=sys.stderr.isatty(), stream_experts="off",
                                           gpu_memory="off", warm_up=False)  # placement and warm-up: below
        except (CheckpointError, ValueError, OSError, ImportError) as e:  # ImportError: e.g. gguf not installed
            raise CLIError(f"--model {args.model}: {e}") from None
        top_k = getattr(model.config, "num_experts_per_tok", None)
        if top_k is not None and args.deferred_experts > top_k:
            raise CLIError(f"--deferred-experts {args.deferred_experts}: the model routes each token to {top_k} "
                           "experts; D must be at most that")
        ktorch.set_deferred_experts(model, args.deferred_experts)
        asked = (stream != "off" and not stream_by_default) or (gpu_memory != "off" and not gpu_memory_by_default)
        if not asked and (stream != "off" or gpu_memory != "off"):
            problem = _device_experts_problem(model)
            if problem is not None:  # the defaults ask for GPU experts it cannot run: the CPU runs them all, said once
                print(f"ktorch: every expert stays on the CPU ({problem})", file=sys.stderr)
                stream, gpu_memory = "off", "off"
        if stream != "off" or gpu_memory != "off":
            if device.type != "cuda":
                raise CLIError(f"--stream-experts and --gpu-memory place experts on a GPU; --device is {device}")
            try:
                ktorch.set_stream_experts(model, stream, gpu_memory=gpu_memory,
                                          reserve=reserve_for(model) if reserve_for is not None and gpu_memory != "off"
                                          else None)
            except ValueError as e:
                given = [] if stream_by_default else [f"--stream-experts {args.stream_experts}"]
                if not gpu_memory_by_default:
                    given.append(f"--gpu-memory {args.gpu_memory}")
                raise CLIError(f"{' '.join(given) or '--stream-experts auto --gpu-memory auto (the defaults on a GPU)'}"
                               f": {e}") from None
        if warm_up:  # the split's stagings and the residents exist now: warmed too; its kept capture only where
            # generate's CUDA graphs would replay it (serve's engine captures its own steps)
            args.warm_up_s = ktorch.warm_up(model, capture=args.command in ("generate", "chat")
                                            and not getattr(args, "no_compile", False))
        return model, (tokenizer if tokenizer is not None else TokenIdsTokenizer(model.config.vocab_size)), device
    if path.is_file():
        raise CLIError(f"--model {args.model}: --plain runs transformers checkpoint folders only")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise CLIError(f"--model {args.model}: transformers could not load {path}: {e}") from None
    model.eval()
    model.to(device)
    return model, tokenizer, device


def placement_defaults(args: argparse.Namespace, device) -> tuple[bool, bool]:
    """Fills the placement options left unset: ``--stream-experts`` and ``--gpu-memory`` are auto on a CUDA device
    (unless ``--plain``), off elsewhere, so that the CPU ignores them quietly. Returns which of the two were unset
    (an unset one is dropped quietly where the model's experts cannot run on the GPU; one given is an error there)."""
    on_gpu = device.type == "cuda" and not args.plain
    stream_by_default, gpu_memory_by_default = args.stream_experts is None, args.gpu_memory is None
    if stream_by_default:  # prefill streams the experts it uses most (docs/prefill_streaming.md)
        args.stream_experts = "auto" if on_gpu else "off"
    if gpu_memory_by_default:  # residents fill the free memory (ktorch/gpu_memory.py: measured faster than off)
        args.gpu_memory = "auto" if on_gpu else "off"
    return stream_by_default, gpu_memory_by_default


def _device_experts_problem(model) -> Optional[str]:
    """Why the model's routed experts cannot run on the GPU (biases, gateless, another activation), or None."""
    from ktorch.integrations.transformers_experts import device_experts_problem
    from ktorch.placement import experts_modules

    for _, m in experts_modules(model):
        problem = device_experts_problem(m)
        if problem is not None:
            return problem
    return None


def _gpu_memory_argument(text: str, stream):
    """--gpu-memory (resolved: load_model turns the unset default into auto on a GPU, off elsewhere) -> what
    set_stream_experts takes: "auto" (the free memory minus a margin), "off" (every expert in host memory), or
    bytes."""
    from ktorch.gpu_memory import parse_memory_size

    if text in ("auto", "off"):
        return text
    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise CLIError(f"--gpu-memory {text}: {e}") from None


class TokenIdsTokenizer:
    """Stands in for a tokenizer when the checkpoint has none (GGUF benchmark files): the prompt's UTF-8 bytes
    (modulo the vocabulary) are the input ids, and decoding prints ids as numbers."""

    pad_token_id = eos_token_id = chat_template = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, text: str, return_tensors: Optional[str] = None):
        import torch

        ids = [b % self.vocab_size for b in text.encode("utf-8")] or [0]
        return argparse.Namespace(input_ids=torch.tensor([ids]))

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        return "".join(f" {int(i)}" for i in (ids.tolist() if hasattr(ids, "tolist") else ids))


# ---------------------------------------------------------------- streaming and timing


def _make_streamer(tokenizer, out=None):
    """A transformers TextStreamer printing the new tokens' text to ``out`` (default: stdout) as they come."""
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            print(text, end="" if not stream_end else "\n", file=out or sys.stdout, flush=True)

    return Streamer(tokenizer, skip_prompt=False, skip_special_tokens=True)


def run_generation(model, tokenizer, input_ids, args: argparse.Namespace, out=None) -> tuple[list[int], object]:
    """Generates from ``input_ids`` ([1, P]) streaming the text to ``out``; returns (new token ids, Timings).

    ktorch models go through ``ktorch.generate`` (ktorch/generation.py: eager prefill, then the decode step as
    one CUDA graph on a GPU unless ``--no-compile``), the path the end-to-end benchmarks time; ``--plain``
    models through transformers' ``generate``."""
    import torch

    streamer = _make_streamer(tokenizer, out)
    if getattr(args, "plain", False):
        return _run_plain_generation(model, tokenizer, input_ids, args, streamer)
    from ktorch.generation import generate

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else None
    gc_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = {i for e in (eos, gc_eos) for i in ([e] if isinstance(e, int) else (e or []))}
    result = generate(
        model, input_ids, args.max_new_tokens, temperature=args.temperature,
        top_p=args.top_p if args.temperature > 0 else 1.0, repetition_penalty=args.repetition_penalty,
        seed=args.seed, eos_token_id=sorted(eos_ids), cuda_graphs=not getattr(args, "no_compile", False),
        on_tokens=lambda ids: streamer.put(torch.tensor(ids)),
        on_status=_status_printer())
    streamer.end()
    return result.ids, result.timings


def _status_printer():
    """Prints the capture's progress message on a terminal (its time is in the closing timing lines anyway)."""
    def status(text: str) -> None:
        if sys.stderr.isatty() and text.startswith("capturing"):
            print(f"\n[ktorch] {text}", file=sys.stderr, flush=True)
    return status


def _run_plain_generation(model, tokenizer, input_ids, args, streamer):
    """transformers' own ``generate`` (``--plain``): the baseline, timed the same way."""
    import torch

    from ktorch.generation import Timings

    device = model.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    times: list = []

    class Clock:
        def put(self, value):
            times.append(time.perf_counter())
            streamer.put(value.cpu()) if len(times) > 1 else None

        def end(self):
            streamer.end()

    sampling = args.temperature > 0
    kwargs = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p) if sampling else dict(do_sample=False)
    if args.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = args.repetition_penalty
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=args.max_new_tokens, streamer=Clock(),
                                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None
                                else tokenizer.eos_token_id, **kwargs)
    t_end = time.perf_counter()
    new_ids = output[0, input_ids.shape[1]:].tolist()
    t_first = times[1] if len(times) > 1 else t_end  # times[0]: the prompt
    return new_ids, Timings(prompt_tokens=input_ids.shape[1], new_tokens=len(new_ids), first_token_s=t_first - t0,
                            decode_s=t_end - t_first)


def timing_lines(timings, load_s: Optional[float] = None) -> str:
    """The rates line ("prefill: ... | decode: ...") and, below it, where the time went before decoding."""
    parts = []
    if load_s is not None:
        parts.append(f"load {load_s:.1f} s")
    parts.append(f"first token {timings.first_token_s:.2f} s after loading")
    if timings.prefill_replayed:
        parts.append(f"prefill replayed the captured {timings.prefill_replayed}-token graph")
    if timings.prefill_capture_s:
        parts.append(f"prefill capture {timings.prefill_capture_s:.2f} s (after the output)")
    if timings.cuda_graphs:
        parts.append(f"decode-step capture {timings.warmup_s:.1f} s" if timings.warmup_s else "decode step reused")
    return timings.line() + "\n[ktorch] " + ", ".join(parts)


def placement_lines(model, timings) -> list:
    """What the GPU memory budget holds, what the prefill split moved, and the residents' decode hit rate."""
    plan = getattr(model, "kt_gpu_memory", None)
    if plan is None:
        return []
    import ktorch
    from ktorch.gpu_memory import resident_hits

    lines = ["[ktorch] " + plan.summary()]
    import torch

    device = model.get_input_embeddings().weight.device
    if device.type == "cuda":
        from ktorch.gpu_memory import outside_allocator

        g = 1 << 30
        peak, reserved = torch.cuda.max_memory_allocated(device) / g, torch.cuda.max_memory_reserved(device) / g
        lines.append(f"[ktorch] GPU memory measured: peak allocated {peak:.2f} GiB, peak reserved {reserved:.2f}, "
                     f"outside the allocator now {outside_allocator(device) / g:.2f} (budget {plan.budget / g:.2f})")
    s = ktorch.prefill_split_stats(model)
    if s["passes"]:
        rows = max(s["rows"], 1)
        lines.append(f"[ktorch] prefill split: {s['passes']} layer calls, experts hit {s['experts_hit']} (per layer "
                     f"{','.join(map(str, s['last_hit']))}), copied {s['experts_copied']} ({s['bytes_copied'] / 1e9:.2f}"
                     f" GB), copied but unused {s['copied_unused']}, resident hit {s['resident_hit']}; rows on the GPU "
                     f"{100 * (s['rows_copied'] + s['rows_resident']) / rows:.1f}% (copied "
                     f"{100 * s['rows_copied'] / rows:.1f}%, resident {100 * s['rows_resident'] / rows:.1f}%)")
    if plan.resident_per_layer:
        hits, rows = resident_hits(model)
        lines.append(f"[ktorch] resident experts: {timings.resident_swaps} swapped after prefill in "
                     f"{timings.resident_swap_s:.2f} s; decode resident hit rate {hits}/{rows} = "
                     f"{100 * hits / max(rows, 1):.1f}%")
    return lines


def _describe(model, args: argparse.Namespace, device, load_s: float) -> str:
    formats = sorted({m.kt_format for m in model.modules() if getattr(m, "kt_format", None)})
    experts = "experts on --device (transformers)" if args.plain else f"experts {'/'.join(formats)} on cpu (kt.fused_moe)"
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    warm_up = getattr(args, "warm_up_s", 0.0)
    return (f"[ktorch] {args.model}: {size / 1e6:.1f} MB of weights, {model.dtype} on {device}, {experts}; loaded in "
            f"{load_s:.1f} s" + (f" (prefill warm-up {warm_up:.2f} s)" if warm_up else ""))


# ---------------------------------------------------------------- commands


def _load_and_describe(args: argparse.Namespace, warm_up: bool = True, reserve_for=None):
    """load_model, then the one-line description of what was loaded and how long it took, its warm-up included
    (stderr)."""
    t0 = time.perf_counter()
    model, tokenizer, device = load_model(args, warm_up=warm_up, reserve_for=reserve_for)
    args.load_s = time.perf_counter() - t0
    print(_describe(model, args, device, args.load_s), file=sys.stderr, flush=True)
    return model, tokenizer


def cmd_generate(args: argparse.Namespace) -> int:
    if args.prompt == "-":  # read before loading: a prompt that is not there fails in a second, not after the load
        args.prompt = sys.stdin.read()
    if not args.prompt:
        raise CLIError("--prompt is empty: give the text to complete (or - to read it from standard input)")
    model, tokenizer = _load_and_describe(args)
    if args.chat_template:
        input_ids = _chat_input_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    else:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
        print(args.prompt if not isinstance(tokenizer, TokenIdsTokenizer) else f"[token ids] {tokenizer.decode(input_ids[0]).strip()} ->",
              end="", flush=True)  # the completion continues the prompt on the same line
    _, timings = run_generation(model, tokenizer, input_ids, args)
    print(timing_lines(timings, args.load_s), file=sys.stderr, flush=True)
    for line in placement_lines(model, timings):
        print(line, file=sys.stderr, flush=True)
    return 0


def _chat_input_ids(tokenizer, messages: list[dict[str, str]]):
    if not getattr(tokenizer, "chat_template", None):
        raise CLIError("this tokenizer has no chat template (tokenizer_config.json 'chat_template' or "
                       "chat_template.jinja); use 'ktorch generate' for plain completion")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return encoded["input_ids"]


def cmd_chat(args: argparse.Namespace) -> int:
    model, tokenizer = _load_and_describe(args)
    _chat_input_ids(tokenizer, [{"role": "user", "content": "probe"}])  # fail now, not after the first message
    print("Type a message and press Enter; /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    while True:
        try:
            text = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not text.strip():
            continue
        if text.strip() == "/exit":
            return 0
        if text.strip() == "/reset":
            messages = list(start)
            print("(history cleared)", file=sys.stderr)
            continue
        messages.append({"role": "user", "content": text})
        new_ids, timings = run_generation(model, tokenizer, _chat_input_ids(tokenizer, messages), args)
        reply = tokenizer.decode(new_ids, skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": reply})
        print(f"[{timings.line()}]", file=sys.stderr, flush=True)


def cmd_bench(args: argparse.Namespace) -> int:
    rest = list(args.args)
    name = rest.pop(0) if rest[:1] and rest[0] in BENCHMARKS else "op"
    if rest[:1] == ["--"]:
        rest = rest[1:]
    elif rest and not rest[0].startswith("-"):
        raise CLIError(f"unknown benchmark {rest[0]!r}: choose one of {', '.join(BENCHMARKS)} "
                       "(then -- and its arguments)")
    script = Path(__file__).resolve().parent.parent / "benchmarks" / BENCHMARKS[name][0]
    if not script.is_file():
        raise CLIError(f"benchmarks/{script.name} is not next to this installation (ktorch bench needs the source "
                       "checkout, installed with pip install -e .); from a checkout run: "
                       f"python benchmarks/{script.name} --help")
    return subprocess.call([sys.executable, str(script), *rest], env=os.environ.copy())


def check_listen_address(host: str, port: int) -> None:
    """Binds (host, port) once and lets go, before the model loads: an address in use (another server) or one this
    machine does not have is a CLIError now, not a traceback from aiohttp after the load. SO_REUSEADDR as aiohttp's
    own socket sets it, so a port left in TIME_WAIT by the last server passes, as it would there."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise CLIError(f"--host {host}: {e.strerror}") from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                raise CLIError(f"--host {host} --port {port}: cannot listen there: {e.strerror}"
                               + (" (another server?)" if e.errno == errno.EADDRINUSE else "")) from None


def cmd_serve(args: argparse.Namespace) -> int:
    if args.plain:
        raise CLIError("serve runs ktorch-prepared models; --plain is for generate and chat")
    if args.no_compile:
        raise CLIError("serve captures its own CUDA graphs per batch size (--cuda-graphs off turns them off); "
                       "--no-compile is for generate and chat")
    for name in ("port", "page_size", "kv_pages", "max_batch_tokens", "max_requests", "max_queued_tokens"):
        value = getattr(args, name)
        if value is not None and (value < 1 or (name == "page_size" and value < 4) or (name == "port" and value > 65535)):
            raise CLIError(f"--{name.replace('_', '-')} {value}: out of range")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise CLIError(f"--kv-cache-gib {args.kv_cache_gib}: must be > 0")
    if args.host_prefix_cache_gib is not None and args.host_prefix_cache_gib < 0:
        raise CLIError(f"--host-prefix-cache-gib {args.host_prefix_cache_gib}: must be >= 0")
    if args.cpu_offload_gib < 0:
        raise CLIError(f"--cpu-offload-gib {args.cpu_offload_gib}: must be >= 0")
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise CLIError("serve needs aiohttp: pip install 'ktorch[serve]'") from None
    check_listen_address(args.host, args.port)
    from ktorch.serve import EngineConfig, run_server
    from ktorch.serve.engine import check_transformers

    try:
        check_transformers()
    except RuntimeError as e:
        raise CLIError(str(e)) from None
    # the engine warms up itself before it serves (/health answers): on a GPU with --cuda-graphs auto or on it
    # captures each token bucket's step (1-256 tokens; its layers compiled by Inductor, once per bucket, cached on
    # disk for the next process) through its own paged cache and batch runner, which pays the
    # process's first kernel launches, stagings and page faults; ktorch.warm_up (a static cache) would pay them twice.
    # With --cuda-graphs off no engine warm-up runs, so the load's does (a no-op on the CPU).
    config = EngineConfig(
        page_size=args.page_size or EngineConfig.page_size, num_blocks=args.kv_pages, kv_cache_gib=args.kv_cache_gib,
        max_batch_tokens=args.max_batch_tokens, max_requests=args.max_requests,
        max_queued_tokens=args.max_queued_tokens,
        cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
        cpu_offload_gib=args.cpu_offload_gib, prefix_cache=not args.no_prefix_cache, step_stats=args.step_stats)
    pools = []  # the KV pool the GPU memory plan reserved (load_model calls serve_reserve when it plans residents)

    def serve_reserve(model) -> int:
        from ktorch.serve.engine import kv_pool_for

        pools.append(kv_pool_for(model.config, model.dtype, config))
        return pools[-1].nbytes

    model, tokenizer = _load_and_describe(args, warm_up=args.cuda_graphs == "off", reserve_for=serve_reserve)
    if isinstance(tokenizer, TokenIdsTokenizer):
        print(f"[ktorch] {args.model} has no tokenizer: completions take token-id prompts (a string's UTF-8 bytes "
              "become ids) and return the new ids as text; chat is refused", file=sys.stderr, flush=True)
    on_gpu = model.get_input_embeddings().weight.device.type == "cuda"
    host_gib = args.host_prefix_cache_gib
    config.host_cache_gib = host_gib if host_gib is not None else (4.0 if on_gpu else 0.0)
    plan = getattr(model, "kt_gpu_memory", None)
    if pools and plan is not None:
        pool = pools[-1]
        if args.kv_pages is None and args.kv_cache_gib is None:  # the default pool takes what the residents left
            pool = pool.grown_by(plan.budget - plan.used)
        config.num_blocks, config.max_batch_tokens = pool.num_blocks, pool.max_batch_tokens
        config.max_memory_percent = 1.0  # the plan reserved the pool's bytes; transformers' 0.8 would count them twice
        print(f"[ktorch] {plan.summary()}\n[ktorch] {pool.line()}", file=sys.stderr, flush=True)
    name = args.served_model_name or ("builtin" if args.model == "builtin" else Path(args.model).name)
    run_server(model, tokenizer, name, host=args.host, port=args.port, config=config,
               print_fn=lambda msg: print(f"[ktorch] serving {name} ({msg.strip()})", file=sys.stderr, flush=True))
    return 0


COMMANDS = {"generate": cmd_generate, "chat": cmd_chat, "serve": cmd_serve, "bench": cmd_bench}


def check_generation_arguments(args: argparse.Namespace) -> None:
    """--max-new-tokens and the sampling options of generate and chat, checked before the model loads (seconds to
    minutes) with the library's own rules (ktorch.generation.Sampling), each error naming its option."""
    if not hasattr(args, "max_new_tokens"):
        return
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from ktorch.generation import Sampling

    try:
        Sampling(args.temperature, args.top_p, args.repetition_penalty)
    except ValueError as e:
        name, _, rest = str(e).partition(" ")
        raise CLIError(f"--{name.replace('_', '-')} {rest}") from None


def _one_line_warnings(command: str, show):
    """warnings.showwarning for a command: ktorch's own warnings (issued from a line of this package, e.g. a prompt
    past the model's context) as one line of the command's; the others (transformers', torch's) as Python shows
    them, their source named."""
    package = str(Path(__file__).resolve().parent)

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if str(filename).startswith(package):
            print(f"ktorch {command}: warning: {message}", file=sys.stderr, flush=True)
        else:
            show(message, category, filename, lineno, file, line)

    return showwarning


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_generation_arguments(args)
        with warnings.catch_warnings():
            warnings.showwarning = _one_line_warnings(args.command, warnings.showwarning)
            return COMMANDS[args.command](args)
    except CLIError as e:
        print(f"ktorch {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
