"""``ktorch.load``: a Hugging Face checkpoint folder or a GGUF file, straight into a hybrid-placed model."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ktorch.integrations.checkpoint_loading import CheckpointError, CheckpointSource, build_model


def builtin_or_path(path: Union[str, Path]) -> Path:
    """The name "builtin" -> the small model shipped in ktorch/builtin (a folder of that name is "./builtin");
    anything else -> that path, user-expanded. ``load`` and the command line's ``--model`` both read names so."""
    if str(path) == "builtin":
        from ktorch.builtin import BUILTIN_PATH

        return BUILTIN_PATH
    return Path(path).expanduser()


def open_checkpoint(path: Union[str, Path]) -> CheckpointSource:
    """The ``CheckpointSource`` for ``path``: a .gguf file (the first part of a split one), a folder with
    config.json and safetensors files, or "builtin" (``builtin_or_path``). Raises ``CheckpointError`` naming the
    path otherwise."""
    path = builtin_or_path(path)
    if not path.exists():
        raise CheckpointError(path, "no such file or folder")
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF":
            from ktorch.integrations.gguf_loading import GGUFSource

            return GGUFSource(path)
        raise CheckpointError(path, f"not a GGUF file (starts with {magic!r}, not b'GGUF') and not a checkpoint folder")
    from ktorch.integrations.safetensors_loading import SafetensorsSource

    return SafetensorsSource(path)


def load(
    path: Union[str, Path],
    device: Union[str, torch.device, None] = None,
    experts_dtype: str = "auto",
    group_size: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
    progress: bool = True,
    tokenizer: bool = True,
    stream_experts=None,
    gpu_memory: Union[int, str, None] = None,
    warm_up: bool = True,
) -> tuple[nn.Module, object]:
    """Loads an MoE checkpoint for hybrid inference: ``(model, tokenizer)``.

    Args:
        path: a Hugging Face checkpoint folder (config.json + *.safetensors), a llama.cpp GGUF file
            (qwen3moe, qwen2moe, deepseek2, llama/Mixtral architectures), or "builtin" for the small model
            shipped with ktorch.
        device: where attention, routers, shared experts, embeddings and the KV cache go (default: "cuda" if a
            GPU is visible, else "cpu"). Routed experts are always packed in CPU memory for ``kt.fused_moe``.
        experts_dtype: "auto", "bf16", "int8" or "int4". "auto" is bf16 for safetensors and, for GGUF, the
            file's own values exactly (Q4_0/Q4_K/Q5_K/Q6_K/Q8_0/MXFP4 codes with their per-group scales; float ->
            bf16; see docs/loading.md); an explicit format requantizes and prints the error it measured.
        group_size: int4 only (default: 32 for GGUF Q4 blocks, else 128 where it divides the sizes).
        dtype: dtype of the non-expert weights (default: the checkpoint config's for safetensors; for GGUF
            bfloat16 on a GPU, float32 on the CPU).
        progress: show a progress bar over layers.
        tokenizer: also build the tokenizer (None when the checkpoint has none, e.g. a GGUF benchmark file with
            ``tokenizer.ggml.model = "none"``).
        stream_experts, gpu_memory: GPU only, as ``ktorch.prepare`` takes them (the routing-aware prefill split,
            the GPU memory budget and its resident experts; docs/prefill_streaming.md). Default None: as the command
            line's defaults, on a CUDA device the split ``"auto"`` and the budget ``"auto"`` (resident experts fill
            the free memory minus a margin; "off": every expert in host memory, the split still copying the
            experts a long prompt uses); nothing on the CPU, or where the experts cannot run on the GPU (biases, no
            gate, another activation: ``placement.default_stream_experts``). ``stream_experts="off"``: no split.
        warm_up: on a GPU, end with ``ktorch.warm_up(model)``: one prefill of ``ktorch.generation.WARM_UP_TOKENS``
            random ids through a throwaway cache, so that the first prompt runs at warm speed (a fresh process's
            first prefill pays ~0.4 s of first kernel launches, stagings and page faults; docs/architecture.md),
            then a decoder kept on the model with that prefill captured, which a first prompt of up to as many
            tokens replays; on the CPU it does nothing. False: leave it to the caller (the command line calls it
            after its own placement options).

    On a GPU, Inductor's modules (the decode step's compile, after the first token) are imported on a background
    thread while the weights load (``generation.preload_compiler``), not during the first prompt.

    The model is built on the meta device and filled layer by layer; each layer's experts are packed as they are
    read, so loading needs about one chunk of unpacked expert weights beyond the final model. Errors in the files
    (missing or misshapen tensors, unsupported types or architectures, truncation) raise ``CheckpointError``
    before any long work, naming the file and the tensor.
    """
    from ktorch.placement import usable_device

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = usable_device(device, "load")
    if torch.device(device).type == "cuda":
        from ktorch.generation import preload_compiler

        # as the command line does. Without it generate starts the imports beside the first prompt: session 54 (12
        # layers, ktorch.load then generate) saw a first 512-token prompt take 118-166 ms against 13.5 ms for the
        # next, where the CLI's first prompt on 48 layers took 54 ms; the imports' GIL turns are the suspect, not
        # yet measured apart
        preload_compiler()
    source = open_checkpoint(path)
    if dtype is None and getattr(source, "default_dtype", None) is not None:
        dtype = source.default_dtype(device)
    model = build_model(source, device=device, dtype=dtype, experts_dtype=experts_dtype, group_size=group_size,
                        progress=progress)
    if stream_experts is None or gpu_memory is None:
        from ktorch.placement import default_gpu_memory, default_stream_experts, experts_modules

        if stream_experts is None:
            stream_experts = default_stream_experts(experts_modules(model), device)
        if gpu_memory is None:
            gpu_memory = default_gpu_memory(experts_modules(model), device, stream_experts)
    if stream_experts == "off" and gpu_memory in (None, "off"):
        stream_experts = gpu_memory = None  # nothing to place
    if stream_experts is not None or gpu_memory is not None:
        from ktorch.placement import set_stream_experts

        set_stream_experts(model, stream_experts, gpu_memory=gpu_memory)
    if warm_up:
        from ktorch.generation import warm_up as warm_up_prefill

        warm_up_prefill(model)
    return model, (source.tokenizer() if tokenizer else None)
