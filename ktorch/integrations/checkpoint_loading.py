"""Building a transformers MoE model from a checkpoint layer by layer, routed experts packed on the way in.

The model is created on the meta device (no memory), then filled one decoder layer at a time: non-expert tensors
go straight to their device in the model dtype, and each layer's routed experts are read a few experts at a time,
packed with ``ktorch.pack_experts`` (or placed as already quantized, for GGUF blocks that fit the op's int4
layout) into the layer's final packed tensors and attached with ``attach_packed_experts``. So at most a chunk of
unpacked expert weights (well under one layer's) exists beside the packed model; the source frees its read
buffers after each layer (``CheckpointSource.release``).

A source (``SafetensorsSource``, ``GGUFSource``) says what the checkpoint holds and reads it in transformers'
layout; ``build_model`` checks everything it can before reading any data (every tensor present, shapes right,
sizes the op supports), so a bad file fails in seconds with the file, the tensor and the problem named.
"""

from __future__ import annotations

import gc
import re
import types
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

from ktorch.integrations.transformers_experts import (
    _unpacked_biases,
    _unpacked_weights,
    attach_packed_experts,
    check_supported,
)
from ktorch.ops.moe import FORMATS, PackedExperts, empty_weights, pack_experts
from ktorch.ops.packed_weights import as_bytes

# Unpacked fp32 elements read per chunk of experts (about 256 MB): bounds loading memory beyond the packed model.
CHUNK_ELEMENTS = 64 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint ktorch cannot load. The message names the file, the tensor (if one) and the problem."""

    def __init__(self, path: Union[str, Path], problem: str, tensor: Optional[str] = None):
        where = f"{path}" if tensor is None else f"{path}: tensor {tensor!r}"
        super().__init__(f"{where}: {problem}")
        self.path, self.tensor, self.problem = str(path), tensor, problem


class CheckpointSource(ABC):
    """One checkpoint (a file or a folder) seen in transformers' names and layouts."""

    path: Path

    @abstractmethod
    def config(self):
        """The transformers config of the model the checkpoint holds."""

    @abstractmethod
    def check_tensor(self, name: str, shape: tuple[int, ...]) -> None:
        """Raises ``CheckpointError`` unless the non-expert tensor ``name`` (a model state-dict key) is present
        with this shape (transformers' layout)."""

    @abstractmethod
    def read_tensor(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The non-expert tensor ``name`` in transformers' layout, as ``dtype`` on ``device``."""

    @abstractmethod
    def check_experts(self, module_name: str, num_experts: int, intermediate: int, hidden: int) -> None:
        """Raises ``CheckpointError`` unless the routed experts of ``module_name`` are present with these sizes."""

    @abstractmethod
    def experts_format(self, module_name: str, requested: str) -> tuple[str, Optional[int]]:
        """(format, group_size) the experts of ``module_name`` will be packed in for ``requested`` ("auto" or a
        format of ``ktorch.ops.moe.FORMATS``)."""

    @abstractmethod
    def read_experts(self, module_name: str, first: int, end: int, fmt: str, group_size: Optional[int],
                     into: Optional[tuple] = None) -> PackedExperts:
        """Experts ``first:end`` of ``module_name``, packed in ``fmt``. ``into``: the layer's packed tensors' rows
        ``first:end`` (``PackedExperts.tensors()`` order, None where a layer has none), which a source may pack the
        weights into directly (returning views of them: ``pack_experts_in_chunks`` then copies nothing); a source may
        ignore it."""

    def read_expert_rows(self, name: str, first: int, end: int) -> torch.Tensor:
        """Experts ``first:end`` (rows of the first dimension) of the experts module's own parameter ``name`` as
        stored, for modules whose experts are not in the plain layout ``check_experts`` reads (transposed,
        interleaved, biased or gateless: ``experts_as_stored``). Sources that cannot raise ``CheckpointError``."""
        raise CheckpointError(self.path, f"{name}: this checkpoint format does not hold experts in the module's own "
                                         "layout (transposed, interleaved, biased or gateless experts)")

    def check_stored_experts(self, module_name: str, module: nn.Module) -> None:
        """Raises ``CheckpointError`` unless the parameters of the ``experts_as_stored`` module ``module_name``
        are present as the module holds them (a source may hold them otherwise, e.g. as MXFP4 blocks)."""
        for p, t in module.named_parameters(recurse=False):
            self.check_tensor(f"{module_name}.{p}", tuple(t.shape))

    def release(self) -> None:
        """Drops read buffers (mapped file pages, open handles) after a layer is done."""

    def tokenizer(self):
        """The checkpoint's tokenizer, or None if it has none."""
        return None


def empty_model(config, dtype: torch.dtype) -> nn.Module:
    """The causal LM for ``config`` on the meta device (parameters and buffers allocate nothing), in eval mode."""
    from transformers import AutoModelForCausalLM

    config._experts_implementation = "eager"  # switched to "ktorch" once the experts are packed
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _layer_index(name: str) -> Optional[int]:
    match = re.search(r"\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if leaf in module._parameters:
        module._parameters[leaf] = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _tied_names(model: nn.Module) -> dict[str, str]:
    """{tied parameter: the parameter it shares}, e.g. {"lm_head.weight": "model.embed_tokens.weight"}."""
    keys = getattr(model, "all_tied_weights_keys", None)
    if keys is None:  # older transformers
        keys = {}
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(text, "tie_word_embeddings", False) and model.get_output_embeddings() is not None:
            keys = {"lm_head.weight": "model.embed_tokens.weight"}
    return dict(keys)


def _rebuilt(module: nn.Module) -> Optional[nn.Module]:
    """A fresh CPU instance of a buffer-only module built from its config (rotary embeddings), or None."""
    config = getattr(module, "config", None)
    if config is None or any(True for _ in module.parameters(recurse=False)):
        return None
    try:
        with torch.device("cpu"):
            return type(module)(config=config)
    except Exception:  # noqa: BLE001 - not constructible from its config alone
        return None


def _chunk_size(num_experts: int, intermediate: int, hidden: int) -> int:
    return max(1, min(num_experts, CHUNK_ELEMENTS // max(1, 3 * intermediate * hidden)))


def pack_experts_in_chunks(source: CheckpointSource, module_name: str, num_experts: int, intermediate: int,
                           hidden: int, fmt: str, group_size: Optional[int]) -> PackedExperts:
    """One layer's experts packed ``chunk`` experts at a time into preallocated packed tensors."""
    chunk = _chunk_size(num_experts, intermediate, hidden)
    out: Optional[list] = None
    packed_format, packed_group = fmt, group_size
    for first in range(0, num_experts, chunk):
        end = min(num_experts, first + chunk)
        into = None if out is None else tuple(None if t is None else t[first:end] for t in out[:4])
        part = source.read_experts(module_name, first, end, fmt, group_size, into=into)
        tensors = (*part.tensors(), *part.biases())
        if out is None:
            out = [None if t is None else empty_weights((num_experts, *t.shape[1:]), t.dtype) for t in tensors]
            packed_format, packed_group = part.format, part.group_size
        for dst, src in zip(out, tensors):
            if dst is not None and src.data_ptr() != dst[first:end].data_ptr():  # (packed in place: nothing to copy)
                as_bytes(dst)[first:end].copy_(as_bytes(src))  # (MXFP4 nibbles copied as bytes)
        del part
    return PackedExperts(*out[:4], packed_format, packed_group, out[4], out[5])


def experts_as_stored(module: nn.Module) -> bool:
    """True for experts modules the loader reads parameter by parameter, in the module's own layout (transposed,
    interleaved gate/up, biases: gpt-oss), rather than through ``check_experts`` / ``read_experts``'s plain
    [E, 2I, H] / [E, H, I]."""
    return (module.is_transposed or not module.is_concatenated or getattr(module, "has_bias", False)
            or not getattr(module, "has_gate", True))


def pack_stored_experts_in_chunks(source: CheckpointSource, module_name: str, module: nn.Module, fmt: str,
                                  group_size: Optional[int]) -> PackedExperts:
    """``pack_experts_in_chunks`` for an ``experts_as_stored`` module: each chunk of experts is read as the module
    holds its parameters, then de-transposed, de-interleaved and packed as ``pack_module_experts`` does."""
    params = dict(module.named_parameters(recurse=False))
    E = next(iter(params.values())).shape[0]
    gated = getattr(module, "has_gate", True)
    gate_up, _ = _unpacked_weights(module)
    chunk = _chunk_size(E, gate_up.shape[1], gate_up.shape[2])
    out: Optional[list] = None
    fmt_out, group_out = fmt, group_size
    for first in range(0, E, chunk):
        end = min(E, first + chunk)
        held = types.SimpleNamespace(**{p: source.read_expert_rows(f"{module_name}.{p}", first, end) for p in params},
                                     is_transposed=module.is_transposed, is_concatenated=module.is_concatenated,
                                     has_gate=gated, has_bias=getattr(module, "has_bias", False))
        w13, down = _unpacked_weights(held)
        b13, b2 = _unpacked_biases(held)
        if gated:
            part = pack_experts(w13, down, dtype=fmt, group_size=group_size, gate_up_bias=b13, down_bias=b2)
        else:
            part = pack_experts(up_proj=w13, down_proj=down, dtype=fmt, group_size=group_size, gate_up_bias=b13,
                                down_bias=b2)
        tensors = (*part.tensors(), *part.biases())
        if out is None:
            out = [None if t is None else empty_weights((E, *t.shape[1:]), t.dtype) for t in tensors]
            fmt_out, group_out = part.format, part.group_size
        for dst, src in zip(out, tensors):
            if dst is not None:
                dst[first:end].copy_(src)
        del part, held
    return PackedExperts(*out[:4], fmt_out, group_out, out[4], out[5])


def build_model(
    source: CheckpointSource,
    device: Union[str, torch.device] = "cuda",
    dtype: Optional[torch.dtype] = None,
    experts_dtype: str = "auto",
    group_size: Optional[int] = None,
    progress: bool = True,
) -> nn.Module:
    """The model of ``source``, loaded layer by layer and prepared as ``ktorch.prepare`` leaves a model.

    Args:
        source: the checkpoint.
        device: where the non-expert weights go ("cuda", "cpu", ...); experts stay on the CPU.
        dtype: dtype of the non-expert weights (default: the config's, else bfloat16).
        experts_dtype: "auto" (the source's choice: bf16 for safetensors, the closest format for GGUF) or one of
            "bf16", "int8", "int4".
        group_size: int4 only.
        progress: a tqdm bar over layers (on stderr).
    """
    from ktorch.placement import experts_modules, prepare

    if experts_dtype != "auto" and experts_dtype not in FORMATS:
        raise ValueError(f"load: experts_dtype must be 'auto' or one of {FORMATS}, got {experts_dtype!r}")
    if group_size is not None and experts_dtype != "int4":
        raise ValueError(f"load: group_size applies to experts_dtype='int4' only, got experts_dtype={experts_dtype!r}")
    device = torch.device(device)
    config = source.config()
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = empty_model(config, dtype)
    experts = experts_modules(model)
    if not experts:
        raise CheckpointError(source.path, f"{type(model).__name__} has no routed-experts modules; ktorch.load loads "
                                           "MoE models (transformers >= 5 experts classes)")
    expert_params = {f"{name}.{p}" for name, m in experts for p, _ in m.named_parameters(recurse=False)}
    tied = _tied_names(model)
    persistent = {n: t for n, t in model.state_dict(keep_vars=True).items() if n not in expert_params and n not in tied}

    # -- every check before any data is read
    for name, t in persistent.items():
        source.check_tensor(name, tuple(t.shape))
    sizes = {}
    for name, module in experts:
        try:
            check_supported(module)
        except ValueError as e:
            raise CheckpointError(source.path, str(e)) from None
        if not getattr(module, "has_gate", True):
            raise CheckpointError(source.path, f"{name}: ktorch.load does not read gateless experts yet "
                                               f"({type(module).__name__}); load the model with transformers and call "
                                               "ktorch.prepare")
        gate_up, down = _unpacked_weights(module)
        num_experts, intermediate, hidden = down.shape[0], down.shape[2], down.shape[1]
        sizes[name] = (num_experts, intermediate, hidden)
        if experts_as_stored(module):  # (gpt-oss, Nemotron-H) read parameter by parameter, as the module holds them
            source.check_stored_experts(name, module)
        else:
            source.check_experts(name, *sizes[name])
        for what, size in (("hidden size", hidden), ("expert intermediate size", intermediate)):
            if size % 32:
                raise CheckpointError(source.path, f"{name}: {what} {size} is not a multiple of 32, which "
                                                   "kt.fused_moe needs")
    formats = {name: source.experts_format(name, experts_dtype) for name, _ in experts}
    if experts_dtype == "int4" and group_size is not None:
        formats = {name: ("int4", group_size) for name in formats}

    # -- layer by layer
    by_layer: dict[Optional[int], list[str]] = {}
    for name in persistent:
        by_layer.setdefault(_layer_index(name), []).append(name)
    experts_by_layer = {_layer_index(name + "."): (name, module) for name, module in experts}
    layers = sorted(set(by_layer) - {None} | set(experts_by_layer) - {None})
    steps: list[Optional[int]] = [None, *layers]  # embeddings, final norm and lm_head first
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(layers), desc=f"loading {source.path.name}", unit="layer", leave=False)
    with torch.no_grad():
        for step in steps:
            for name in by_layer.get(step, []):
                _set_tensor(model, name, source.read_tensor(name, dtype, device))
            if step in experts_by_layer:
                name, module = experts_by_layer[step]
                fmt, group = formats[name]
                # (a format outside FORMATS is a source's exact one, e.g. GGUF's: read_experts reads it, whatever the
                # module's layout)
                if experts_as_stored(module) and fmt in FORMATS:
                    packed = pack_stored_experts_in_chunks(source, name, module, fmt, group)
                else:
                    packed = pack_experts_in_chunks(source, name, *sizes[name], fmt, group)
                attach_packed_experts(module, packed)
            source.release()
            gc.collect(1)  # the young generations: a layer's cyclic garbage, without walking the whole model each time
            if bar is not None and step is not None:
                bar.update(1)
    if bar is not None:
        bar.close()

    # -- tied weights, non-persistent buffers (rotary frequencies), nothing left on meta
    for name, target in tied.items():
        _set_tensor(model, name, model.get_parameter(target))
    for module_name, module in model.named_modules():
        meta_buffers = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if meta_buffers:
            fresh = _rebuilt(module)
            if fresh is not None:  # e.g. a rotary embedding: its constructor computes the frequencies
                for n in meta_buffers:
                    module._buffers[n] = fresh._buffers[n].to(device)
            else:
                for n in meta_buffers:
                    module._buffers[n] = torch.empty_like(module._buffers[n], device=device)
                model._init_weights(module)
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise CheckpointError(source.path, "no value for it in the checkpoint", tensor=name)
    return prepare(model, device=device, gpu_memory="off")  # ktorch.load places the experts after (its options)
