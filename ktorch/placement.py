"""``ktorch.prepare``: routed experts packed in CPU memory, everything else on the accelerator."""

from __future__ import annotations

import gc
from typing import Optional, Union

import torch
from torch import nn

from ktorch.integrations.deferral import set_deferred_experts as set_chain
from ktorch.integrations.transformers_experts import (
    IMPLEMENTATION_NAME,
    check_supported,
    is_experts_module,
    pack_module_experts,
    packed_experts_of,
)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every transformers experts module in ``model``, in module order."""
    return [(name, m) for name, m in model.named_modules() if is_experts_module(m)]


def prepare(
    model: nn.Module,
    device: Union[str, torch.device, None] = "cuda",
    experts_device: Union[str, torch.device] = "cpu",
    experts_dtype: str = "bf16",
    group_size: Optional[int] = None,
    deferred_experts: int = 0,
) -> nn.Module:
    """Places an MoE model for hybrid inference, in place, and returns it.

    - every routed-experts module (transformers' ``@use_experts_implementation`` classes) is packed once on the
      CPU in ``experts_dtype`` ("bf16", "int8" or "int4" with ``group_size``), and its unpacked
      ``gate_up_proj``/``down_proj`` are freed;
    - every other parameter and buffer (embeddings, attention, routers, shared experts, norms, lm_head) moves
      to ``device``; the KV cache that ``generate`` creates follows them;
    - the model's experts implementation becomes ``"ktorch"``, so each MoE layer calls ``torch.ops.kt.fused_moe``.

    ``deferred_experts=d`` (default 0: off): at every MoE layer but the last, each token's d lowest-weighted
    routed experts join the next layer's output instead (docs/deferral.md); eager forwards do it through the
    experts modules, and ``generate``'s compiled decoding through the backend option ``n_deferred_experts``.
    ``set_deferred_experts(model, d)`` changes it later.

    Parameters stop requiring grad (the kt ops are inference-only). The result runs eagerly (hidden states hop to the CPU op and back) and under ``torch.compile``.
    ``device="cpu"`` (or None) keeps the whole model on the CPU: no GPU is needed.

    Raises ``UnsupportedExpertsError`` before touching anything if a layer needs a feature the op lacks.
    """
    if torch.device(experts_device).type != "cpu":
        raise ValueError(f"prepare: kt.fused_moe runs on the CPU; experts_device must be 'cpu', got {experts_device!r}")
    device = torch.device("cpu" if device is None else device)
    modules = experts_modules(model)
    if not modules:
        raise ValueError(
            f"prepare: {type(model).__name__} has no transformers experts modules (classes decorated with "
            "@use_experts_implementation); ktorch needs transformers >= 5 MoE models"
        )
    for name, m in modules:  # fail before any change
        if packed_experts_of(m) is None:
            try:
                check_supported(m)
            except ValueError as e:
                raise type(e)(f"{name}: {e}") from None
    for _, m in modules:
        if packed_experts_of(m) is None:
            pack_module_experts(m, experts_dtype, group_size)
    gc.collect()
    model.requires_grad_(False)  # inference only: the kt ops have no backward
    model.to(device)  # the packed experts modules ignore it (see attach_packed_experts)
    _compile_generate_with_ktorch(model)
    set_deferred_experts(model, deferred_experts)
    set_impl = getattr(model, "set_experts_implementation", None)
    if set_impl is not None:
        set_impl(IMPLEMENTATION_NAME)
    else:
        for _, m in modules:
            m.config._experts_implementation = IMPLEMENTATION_NAME
    return model


def set_deferred_experts(model: nn.Module, n_deferred: int) -> nn.Module:
    """Sets how many lowest-weighted routed experts per token each MoE layer but the last defers (0: none).

    Applies to eager forwards of the prepared ``model`` and to ``generate``'s compiled decoding (its
    ``compile_config.options["n_deferred_experts"]``). A model compiled by hand takes the option itself:
    ``torch.compile(model, backend="ktorch", options={"n_deferred_experts": d})``."""
    if isinstance(n_deferred, bool) or not isinstance(n_deferred, int) or n_deferred < 0:
        raise ValueError(f"set_deferred_experts: n_deferred must be an int >= 0, got {n_deferred!r}")
    set_chain([m for _, m in experts_modules(model)], n_deferred)
    config = getattr(getattr(model, "generation_config", None), "compile_config", None)
    if config is not None and config.backend == "ktorch":
        options = dict(config.options or {})
        if n_deferred:
            options["n_deferred_experts"] = n_deferred
            if config.mode is not None:  # torch.compile takes a mode or options, not both: the mode becomes options
                options.update(_mode_as_options(config.mode))
                config.mode = None
        else:
            options.pop("n_deferred_experts", None)
        config.options = options or None
    return model


def _mode_as_options(mode: str) -> dict:
    """The ktorch backend options that ``mode`` stands for (see BackendOptions.parse)."""
    from ktorch.compile.options import BackendOptions

    opts = BackendOptions.parse(mode)
    options = {"cuda_graphs": opts.cuda_graphs}
    if opts.inductor_config:
        options["inductor_config"] = dict(opts.inductor_config)
    return options


def _compile_generate_with_ktorch(model: nn.Module) -> None:
    """Points transformers' automatic compile of static-cache decoding at the ktorch backend."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return
    try:
        from transformers import CompileConfig
    except ImportError:
        return
    current = getattr(config, "compile_config", None)
    if current is None or current.backend == "inductor":
        config.compile_config = CompileConfig(backend="ktorch", fullgraph=True)  # mode="reduce-overhead"
