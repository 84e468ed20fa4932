"""``ktorch.prepare``: routed experts packed in CPU memory, everything else on the accelerator."""

from __future__ import annotations

import gc
from typing import Optional, Union

import torch
from torch import nn

from ktorch._library import leave_cores_for_the_gpu_side

from ktorch.integrations.deferral import set_deferred_experts as set_chain
from ktorch.ops.deferred_slots import is_deferred_count
from ktorch.experts_profile import ExpertsProfile
from ktorch.integrations.transformers_experts import (
    IMPLEMENTATION_NAME,
    UnsupportedExpertsError,
    attach_gpu_experts,
    attach_streamed_experts,
    gpu_expert_weights,
    check_supported,
    device_experts_problem,
    experts_modules,
    is_experts_module,
    pack_module_experts,
    packed_experts_of,
)


def prepare(
    model: nn.Module,
    device: Union[str, torch.device, None] = "cuda",
    experts_device: Union[str, torch.device] = "cpu",
    experts_dtype: str = "bf16",
    group_size: Optional[int] = None,
    deferred_experts: int = 0,
    gpu_experts: Union[int, float, str, None] = None,
    expert_profile: Optional[ExpertsProfile] = None,
    gpu_experts_kernel: str = "auto",
    stream_experts: Union[str, dict, None] = None,
    trainable: bool = False,
    gradient_checkpointing: bool = True,
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

    ``gpu_experts`` keeps each MoE layer's most routed-to experts (``expert_profile``, from
    ``ktorch.profile_experts``) on ``device`` as well: an int N (per layer), a float fraction of each layer's
    experts, or a memory budget for all layers together ("4GiB", "512MB"; in the model's dtype). Their slots are
    masked to -1 in what the CPU op receives, computed on the device (ktorch/ops/gpu_experts.py,
    ``gpu_experts_kernel``) while the CPU works, and the two parts summed.

    ``stream_experts`` (GPU only; default None: off) lets long inputs (prefill) use the GPU for part of every MoE
    layer's routed experts: from some token count on, a prefix of the layer's experts has its packed weights copied
    to the GPU per call (page-locked, asynchronous) and computed there while the CPU computes the rest
    (ktorch/ops/streamed_experts.py). ``"auto"`` measures the copy bandwidth and the CPU op on the first layer
    (about a second) and picks, per prompt length, the share that balances the two (``model.kt_stream_calibration``
    keeps what was measured); a table ``{min_tokens: experts or fraction}`` sets it by hand, e.g. ``{512: 0.4}``.
    Decode never streams. ``ktorch.stream_plan(model)`` shows the plan; ``set_stream_experts`` changes it later.

    ``trainable=True`` prepares for fine-tuning (docs/training.md): the experts stay frozen and packed, every other
    parameter requires grad (train all of them, or wrap the model with peft and ``ktorch.lora.add_expert_lora`` for
    adapters), ``loss.backward()`` reaches attention and routers through the experts (``kt.fused_moe``'s backward,
    ktorch/ops/moe_autograd.py), and with ``gradient_checkpointing`` (default) the decoder layers are recomputed in
    the backward (transformers' ``gradient_checkpointing_enable``, non-reentrant) and the KV cache is off. Deferral
    and streaming have no backward: they are refused with ``trainable``.
    Otherwise parameters stop requiring grad (inference). The result runs eagerly (hidden states hop to the CPU op and back) and under ``torch.compile``.
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
        if gpu_experts is not None or stream_experts is not None:
            problem = device_experts_problem(m)
            if problem is not None:
                raise UnsupportedExpertsError(f"prepare: {name}: gpu_experts/stream_experts: {problem}")
    if trainable and (deferred_experts or stream_experts is not None):
        raise ValueError("prepare: deferred_experts and stream_experts have no backward; leave them off with trainable")
    if stream_experts is not None and device.type != "cuda":
        raise ValueError(f"prepare: stream_experts copies experts to a CUDA device; device is {device}")
    if device.type != "cpu":
        leave_cores_for_the_gpu_side()  # see ktorch.set_num_threads
    if device.type == "cuda":
        _set_cuda_sync()
    n_gpu = _gpu_experts_per_layer(gpu_experts, modules)
    if n_gpu and expert_profile is None:
        raise ValueError("prepare: gpu_experts needs expert_profile (ktorch.profile_experts(model, inputs))")
    hot = {}
    for name, m in modules:
        if n_gpu:
            if packed_experts_of(m) is not None:
                raise ValueError(f"prepare: {name} is already packed; gpu_experts needs its unpacked weights "
                                 "(or attach them with ktorch.integrations.attach_gpu_experts)")
            if name not in expert_profile.counts:
                raise ValueError(f"prepare: expert_profile has no counts for {name}")
            ids = expert_profile.hottest(name, n_gpu)
            w13, w2 = gpu_expert_weights(m, ids)
            hot[name] = (ids, w13.to(device), w2.to(device))
            del w13, w2
    for _, m in modules:
        if packed_experts_of(m) is None:
            pack_module_experts(m, experts_dtype, group_size)
    for name, m in modules:
        if name in hot:
            attach_gpu_experts(m, *hot[name], kernel=gpu_experts_kernel)
    gc.collect()
    model.requires_grad_(trainable)  # the packed experts are buffers: frozen either way
    model.to(device)  # the packed experts modules ignore it (see attach_packed_experts)
    if trainable:
        _prepare_for_training(model, gradient_checkpointing)
    if stream_experts is not None:
        set_stream_experts(model, stream_experts, gpu_experts_kernel)
    _compile_generate_with_ktorch(model)
    set_deferred_experts(model, deferred_experts)
    set_impl = getattr(model, "set_experts_implementation", None)
    if set_impl is not None:
        set_impl(IMPLEMENTATION_NAME)
    else:
        for _, m in modules:
            m.config._experts_implementation = IMPLEMENTATION_NAME
    return model


def _prepare_for_training(model: nn.Module, gradient_checkpointing: bool) -> None:
    """Training mode, no KV cache, and (optionally) the decoder layers checkpointed: each layer's activations are
    recomputed in the backward, so a step holds one layer's activations beside the layers' inputs."""
    model.train()
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False
    if gradient_checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24's name
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
            return
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ValueError(f"prepare: {type(model).__name__} has no gradient_checkpointing_enable (a transformers "
                             "model has); pass gradient_checkpointing=False")
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _set_cuda_sync() -> None:
    """The launching thread sleeps while it waits for the GPU (``KT_CUDA_SYNC`` / ``ktorch.config.set_cuda_sync``,
    default "block"; "spin" keeps CUDA's busy wait): in hybrid inference the GPU mostly waits for the CPU experts,
    and a launching thread that spins through every decode step's sync takes a core from the experts' worker pool."""
    import warnings

    from ktorch import config
    from ktorch.compile.host_func import set_context_sync

    mode = config.value("KT_CUDA_SYNC") or "block"
    if mode == "keep":
        return
    if not set_context_sync(mode):
        warnings.warn(f"ktorch.prepare: could not set the CUDA context's sync mode to {mode!r} (cuCtxSetFlags needs a "
                      "CUDA 12.1+ driver); the launching thread may spin while it waits for the GPU", stacklevel=3)


def set_stream_experts(model: nn.Module, stream_experts: Union[str, dict, None], kernel: str = "auto",
                       copy_ahead: bool = True) -> nn.Module:
    """Sets which experts of every MoE layer long inputs stream to the GPU (``prepare(..., stream_experts=...)``).

    ``stream_experts``: ``"auto"`` (measure and balance, see ``prepare``), a table ``{min_tokens: experts or
    fraction}``, or None / ``"off"`` (no streaming). The model must be prepared for a CUDA device (its experts
    packed). Replaces any plan set before (its page-locked memory is released). ``copy_ahead`` (default) copies
    layer i+1's streamed experts while layer i computes, into two device buffers of one layer's streamed bytes
    (``ktorch.ops.streamed_experts.CopyAhead``); False copies each layer's when the device reaches it."""
    from ktorch.ops.streamed_experts import (StreamedExperts, StreamPlan, calibrate_stream_plan, link_streamed_layers,
                                             streamed_experts_of)

    modules = experts_modules(model)
    if not modules or any(packed_experts_of(m) is None for _, m in modules):
        raise ValueError("set_stream_experts: prepare the model first (its experts must be packed)")
    if stream_experts is None or stream_experts == "off":
        for _, m in modules:
            if getattr(m, "kt_stream_handle", None) is not None:
                streamed_experts_of(m.kt_stream_handle).unpin()
                m.kt_stream_handle = m.kt_stream_plan = None
        return model
    first = modules[0][1]
    num_experts = first.kt_w13.shape[0]
    device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    if stream_experts == "auto":
        if device is None:
            raise ValueError("set_stream_experts: 'auto' measures copies to the GPU; the model has no CUDA parameters")
        probe = StreamedExperts(first.kt_w13, first.kt_w13_scales, first.kt_w2, first.kt_w2_scales,
                                first.kt_activation, kernel)
        probe.pin_prefix(min(8, num_experts))
        try:
            top_k = getattr(model.config, "num_experts_per_tok", None) or 8
            plan, model.kt_stream_calibration = calibrate_stream_plan(probe, first.kt_w2.shape[1] * 16, top_k, device)
        finally:
            probe.unpin()
    elif isinstance(stream_experts, dict):
        plan = StreamPlan.from_table(stream_experts, num_experts)
    else:
        raise ValueError(f"stream_experts must be 'auto', 'off', None or a {{min_tokens: experts}} table, got "
                         f"{stream_experts!r}")
    for _, m in modules:
        attach_streamed_experts(m, plan, kernel=kernel)
    if copy_ahead and device is not None:
        link_streamed_layers([streamed_experts_of(m.kt_stream_handle) for _, m in modules], device)
    return model


def stream_plan(model: nn.Module) -> dict[int, int]:
    """{min_tokens: experts streamed per MoE layer} of ``prepare(..., stream_experts=...)`` (empty when off)."""
    for _, m in experts_modules(model):
        plan = getattr(m, "kt_stream_plan", None)
        if plan is not None:
            return dict(zip(plan.thresholds, plan.experts))
    return {}


def gpu_placement(model: nn.Module) -> dict[str, list]:
    """Expert ids each experts module keeps on the accelerator (``prepare(..., gpu_experts=...)``), by module name."""
    return {name: list(getattr(m, "kt_gpu_expert_ids", [])) for name, m in experts_modules(model)}


_UNITS = {"": 1, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3}


def _gpu_experts_per_layer(gpu_experts, modules) -> int:
    """N experts per layer from an int, a fraction of the layer's experts, or a memory budget ("4GiB")."""
    if gpu_experts is None:
        return 0
    m = modules[0][1]
    n_experts = getattr(m, "num_experts", None) or m.gate_up_proj.shape[0]
    if isinstance(gpu_experts, bool):
        raise ValueError(f"prepare: gpu_experts must be an int, a fraction or a memory size, got {gpu_experts!r}")
    if isinstance(gpu_experts, int):
        n = gpu_experts
    elif isinstance(gpu_experts, float):
        if not 0.0 <= gpu_experts <= 1.0:
            raise ValueError(f"prepare: a fractional gpu_experts must be in [0, 1], got {gpu_experts}")
        n = round(gpu_experts * n_experts)
    elif isinstance(gpu_experts, str):
        import re

        match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", gpu_experts)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"prepare: gpu_experts memory budget {gpu_experts!r} is not like '4GiB' or '512MB'")
        budget = float(match.group(1)) * _UNITS[match.group(2).lower()]
        per_expert = m.gate_up_proj[0].numel() * m.gate_up_proj.element_size() + m.down_proj[0].numel() * m.down_proj.element_size()
        n = int(budget // (per_expert * len(modules)))
    else:
        raise ValueError(f"prepare: gpu_experts must be an int, a fraction or a memory size, got {gpu_experts!r}")
    if not 0 <= n <= n_experts:
        raise ValueError(f"prepare: gpu_experts asks for {n} experts per layer; layers have {n_experts}")
    return n


def set_deferred_experts(model: nn.Module, n_deferred: int) -> nn.Module:
    """Sets how many lowest-weighted routed experts per token each MoE layer but the last defers (0: none).

    Applies to eager forwards of the prepared ``model`` and to ``generate``'s compiled decoding (its
    ``compile_config.options["n_deferred_experts"]``). A model compiled by hand takes the option itself:
    ``torch.compile(model, backend="ktorch", options={"n_deferred_experts": d})``."""
    if not is_deferred_count(n_deferred):
        raise ValueError(f"set_deferred_experts: n_deferred must be an int >= 0, got {n_deferred!r}")
    set_chain([m for _, m in experts_modules(model)], n_deferred)
    model.kt_deferred_experts = n_deferred  # read by ktorch.generate: decode defers, prefill does not
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
