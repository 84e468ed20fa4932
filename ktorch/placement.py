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
    gpu_memory: Union[int, str, None] = None,
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
    layer's routed experts. ``"auto"``: the routing-aware split (ktorch/ops/routed_experts.py): per layer and call,
    once the router has run, each expert the batch uses is computed on the GPU (resident, or its packed weights
    copied there from page-locked memory, most-hit first) or by the CPU op, so that both finish together by costs
    measured at set-up (``model.kt_split_costs``; about a second); unused experts move nowhere.
    ``ktorch.prefill_split_stats(model)`` counts what moved. A table ``{min_tokens: experts or fraction}`` (e.g.
    ``{512: 0.4}``) streams a fixed prefix of every layer's experts instead (ktorch/ops/streamed_experts.py; kept for
    comparison). Decode never streams. ``set_stream_experts`` changes it later.

    ``gpu_memory`` is the budget ktorch.gpu_memory divides, the process's device memory as nvidia-smi shows it: the
    CUDA context (measured), the non-expert weights, a KV cache/activations reserve,
    the split's staging, and the rest as resident experts (packed; the same count per layer, the most routed-to at
    prefill, swapped between generate calls' prefill and decode when worth it); decode computes residents on the GPU.
    ``"auto"``: the free device memory minus a margin; bytes, or "24GiB", "24GB"; ``"off"``: no budget, every expert
    in host memory. Default (None): ``"auto"`` on a CUDA device, measured faster than ``"off"`` at prefill and decode
    (ktorch/gpu_memory.py); nothing where it does not apply: another device, ``trainable``, ``gpu_experts`` (which
    places residents by hand), a ``stream_experts`` table, or experts the device kernels cannot run (biases, ...).
    ``model.kt_gpu_memory.summary()`` shows the division. An explicit size on the CPU makes the CPU a stand-in device
    (tests); an explicit ``"auto"`` needs a CUDA device.

    ``trainable=True`` prepares for fine-tuning (docs/training.md): the experts stay frozen and packed, every other
    parameter requires grad (train all of them, or wrap the model with peft and ``ktorch.lora.add_expert_lora`` for
    adapters), ``loss.backward()`` reaches attention and routers through the experts (``kt.fused_moe``'s backward,
    ktorch/ops/moe_autograd.py), and with ``gradient_checkpointing`` (default) the decoder layers are recomputed in
    the backward (transformers' ``gradient_checkpointing_enable``, non-reentrant) except their CPU experts, whose
    outputs are kept in host memory (selective checkpointing), and the KV cache is off. Deferral
    and streaming have no backward: they are refused with ``trainable``, and a placement made before (a model
    ``ktorch.load`` placed: residents, the split) is undone.
    Otherwise parameters stop requiring grad (inference). The result runs eagerly (hidden states hop to the CPU op and back) and under ``torch.compile``.
    ``device="cpu"`` (or None) keeps the whole model on the CPU: no GPU is needed.

    Raises ``UnsupportedExpertsError`` before touching anything if a layer needs a feature the op lacks.
    """
    if torch.device(experts_device).type != "cpu":
        raise ValueError(f"prepare: kt.fused_moe runs on the CPU; experts_device must be 'cpu', got {experts_device!r}")
    device = usable_device("cpu" if device is None else device, "prepare")
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
    if gpu_memory not in (None, "off") and gpu_experts is not None:
        raise ValueError("prepare: gpu_memory fills the budget with resident experts itself; leave gpu_experts unset")
    if gpu_memory not in (None, "off") and trainable:
        raise ValueError("prepare: gpu_memory places experts for inference; leave it unset with trainable")
    if gpu_memory == "auto" and device.type != "cuda":
        raise ValueError(f"prepare: gpu_memory='auto' sizes the budget from a CUDA device's free memory; device is "
                         f"{device} (give a size, or leave gpu_memory unset)")
    if gpu_memory is None:
        gpu_memory = default_gpu_memory(modules, device, stream_experts, trainable, gpu_experts)
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
        if any(getattr(m, "kt_routed", None) is not None or getattr(m, "kt_stream_handle", None) is not None
               for _, m in modules):  # placed before (ktorch.load's default on a GPU): no backward
            set_stream_experts(model, "off")
        _prepare_for_training(model, gradient_checkpointing)
        if device.type == "cuda":
            _train_experts_on_device(modules)
    if stream_experts is not None or gpu_memory is not None:
        set_stream_experts(model, stream_experts, gpu_experts_kernel, gpu_memory=gpu_memory,
                           expert_profile=expert_profile if gpu_memory is not None else None)
    _compile_generate_with_ktorch(model)
    set_deferred_experts(model, deferred_experts)
    set_impl = getattr(model, "set_experts_implementation", None)
    if set_impl is not None:
        set_impl(IMPLEMENTATION_NAME)
    else:
        for _, m in modules:
            m.config._experts_implementation = IMPLEMENTATION_NAME
    return model


def usable_device(device: Union[str, torch.device], who: str) -> torch.device:
    """``device`` as a torch.device, or a ValueError naming ``who`` when this process cannot use it (a CUDA device
    without a CUDA build or GPU, or past the GPUs there are): before any loading or placement, not as torch's
    "Torch not compiled with CUDA enabled" halfway through."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{who}: device {str(device)!r}: this torch sees no CUDA GPU (torch {torch.__version__}); "
                             "use device='cpu'")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{who}: device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def default_stream_experts(modules: list, device: torch.device) -> Optional[str]:
    """What an unset ``stream_experts`` means for ``ktorch.load`` (as for the command line, whose
    ``--stream-experts`` is ``auto`` by default on a GPU): the routing-aware split, ``"auto"``, on a CUDA device
    where the experts can run there (``device_experts_problem``), else None. ``prepare``'s default stays None (off)."""
    if device.type != "cuda" or any(device_experts_problem(m) is not None for _, m in modules):
        return None
    return "auto"


def default_gpu_memory(modules: list, device: torch.device, stream_experts=None, trainable: bool = False,
                       gpu_experts=None) -> Optional[str]:
    """What an unset ``gpu_memory`` means for ``prepare`` / ``ktorch.load`` / the command line: ``"auto"`` on a CUDA
    device for inference, else None (nothing placed): another device, ``trainable``, ``gpu_experts``, a fixed
    ``stream_experts`` table (kept for comparison, without residents), or experts the device kernels cannot run
    (``device_experts_problem``: biases, no gate, another activation), which then all stay on the CPU op."""
    if trainable or gpu_experts is not None or isinstance(stream_experts, dict):
        return None
    return default_stream_experts(modules, device)  # the same device and experts conditions


def _prepare_for_training(model: nn.Module, gradient_checkpointing: bool) -> None:
    """Training mode, no KV cache, and (optionally) the decoder layers checkpointed: each layer's activations are
    recomputed in the backward, so a step holds one layer's activations beside the layers' inputs."""
    model.train()
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False, "context_fn": _keep_cpu_experts_outputs}
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24's name
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
            return
        enable = getattr(model, "gradient_checkpointing_enable", None)
        if enable is None:
            raise ValueError(f"prepare: {type(model).__name__} has no gradient_checkpointing_enable (a transformers "
                             "model has); pass gradient_checkpointing=False")
        enable(gradient_checkpointing_kwargs=kwargs)


def _train_experts_on_device(modules, pin: bool = True) -> None:
    """Training on a GPU: each MoE layer's routed experts computed there, their packed weights page-locked in host
    memory and copied per call (ktorch/ops/train_experts.py), where the layer's form allows (gated, no biases, an
    activation of ``ACTIVATIONS``: ``device_experts_problem``); the others keep the CPU op. The 48-layer
    Qwen3-30B-A3B step with LoRA at T = 2048 on the device: docs/training.md."""
    from ktorch.ops.streamed_experts import StreamedExperts
    from ktorch.ops.train_experts import link_train_layers, register_train_experts

    handles = []
    for _, m in modules:
        if getattr(m, "kt_train_handle", None) is not None:
            continue
        if device_experts_problem(m) is not None:
            continue
        packed = packed_experts_of(m)
        streamed = StreamedExperts(*packed.tensors()[:4], m.kt_activation)
        if pin:  # (tests on the CPU attach unpinned ones)
            try:
                streamed.pin_prefix(packed.num_experts)
            except RuntimeError as e:  # e.g. `ulimit -l` too low: this layer and the rest keep the CPU op
                import warnings

                warnings.warn(f"ktorch.prepare: the experts stay on the CPU op for training ({e})", stacklevel=3)
                break
        m.kt_train_streamed = streamed  # (the registry holds it weakly)
        m.kt_train_handle = register_train_experts(streamed)
        handles.append(m.kt_train_handle)
    link_train_layers(handles)  # each call copies the next layer's weights while it computes


def _keep_cpu_experts_outputs():
    """The checkpointed layers' context (selective activation checkpointing): the CPU experts' outputs are kept from
    the forward, not recomputed in the backward; everything else is recomputed. Their outputs live in host memory
    (kt.fused_moe_delta's out, h and pre-activations: 80 MB a Qwen3-30B-A3B layer at T = 2048 in bf16, 3.8 GB for 48
    layers; kt.fused_moe's out, 8 MB), and their recompute was one of the three CPU calls a layer makes per step."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts([torch.ops.kt.fused_moe.default, torch.ops.kt.fused_moe_delta.default,
                                                 torch.ops.ktorch.train_experts.default])


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


def set_stream_experts(model: nn.Module, stream_experts, kernel: str = "auto", copy_ahead: bool = True,
                       gpu_memory: Union[int, str, None] = None,
                       expert_profile: Optional[ExpertsProfile] = None, reserve: Optional[int] = None) -> nn.Module:
    """Sets how long inputs use the GPU for every MoE layer's routed experts (``prepare(..., stream_experts=...,
    gpu_memory=...)``), and the GPU memory budget.

    ``stream_experts``: ``"auto"`` (the routing-aware split, its costs measured now), a ``SplitCosts`` (the split
    with these costs: tests, experiments), a table ``{min_tokens: experts or fraction}`` (a fixed prefix streamed,
    ``copy_ahead`` copying layer i+1's while layer i computes), or None / ``"off"``. ``gpu_memory``: the budget
    (see ``prepare``): ``"auto"`` (the free memory minus a margin), a size, or ``"off"``; None (this setter's
    default, unlike ``prepare``'s) is ``"auto"`` with the split on and ``"off"`` with it off, so that
    ``set_stream_experts(model, None)`` takes every expert back to the CPU op. With the split off and a budget,
    resident experts still fill it; ``expert_profile`` (``ktorch.profile_experts``) picks the first
    residents (default: each layer's first experts, until prefills have counted routing). ``reserve``: the bytes kept
    for the KV cache and activations before the residents (default: generate's static cache, ``reserve_bytes``;
    ``ktorch serve`` gives its paged pool's). The model must be prepared (its experts packed). Replaces what was
    set before (page-locked memory released, residents and staging freed, a captured decode step dropped)."""
    from ktorch.ops.routed_experts import SplitCosts
    from ktorch.ops.streamed_experts import StreamPlan, link_streamed_layers, streamed_experts_of

    modules = experts_modules(model)
    if not modules or any(packed_experts_of(m) is None for _, m in modules):
        raise ValueError("set_stream_experts: prepare the model first (its experts must be packed)")
    if not (stream_experts is None or stream_experts in ("off", "auto") or isinstance(stream_experts, (dict, SplitCosts))):
        raise ValueError(f"stream_experts must be 'auto', 'off', None, a SplitCosts or a {{min_tokens: experts}} "
                         f"table, got {stream_experts!r}")
    if gpu_memory == "auto" and not any(p.device.type == "cuda" for p in model.parameters()):
        raise ValueError("set_stream_experts: gpu_memory='auto' sizes the budget from a CUDA device's free memory; the "
                         "model has no CUDA parameters (give a size, or 'off')")
    if gpu_memory not in (None, "off") and any(
            getattr(m, "kt_gpu_expert_ids", None) and getattr(m, "kt_routed", None) is None for _, m in modules):
        raise ValueError("set_stream_experts: gpu_memory fills the budget with resident experts; this model keeps "
                         "experts placed by gpu_experts=")
    _clear_gpu_placement(model, modules)
    for _, m in modules:
        if getattr(m, "kt_stream_handle", None) is not None:
            streamed_experts_of(m.kt_stream_handle).unpin()
            m.kt_stream_handle = m.kt_stream_plan = None
    device = next((p.device for p in model.parameters() if p.device.type == "cuda"), None)
    if isinstance(stream_experts, dict):
        plan = StreamPlan.from_table(stream_experts, modules[0][1].kt_w13.shape[0])
        for _, m in modules:
            attach_streamed_experts(m, plan, kernel=kernel)
        if copy_ahead and device is not None:
            link_streamed_layers([streamed_experts_of(m.kt_stream_handle) for _, m in modules], device)
    if stream_experts == "auto" or isinstance(stream_experts, SplitCosts) or gpu_memory not in (None, "off"):
        if stream_experts == "auto" and device is None:
            raise ValueError("set_stream_experts: 'auto' measures copies to the GPU; the model has no CUDA parameters")
        routed = stream_experts if isinstance(stream_experts, SplitCosts) or stream_experts == "auto" else None
        _place_routed(model, modules, routed, gpu_memory, kernel, expert_profile, reserve)
    return model


def _clear_gpu_placement(model: nn.Module, modules) -> None:
    """Undoes ``_place_routed``: residents, staging and page-locking go; a captured decode step (which read the
    residents) is dropped."""
    from ktorch.gpu_memory import drop_resident_experts

    swaps = getattr(model, "kt_resident_swaps", None)
    if swaps is not None:  # copies still under way write the buffers about to be freed: ordered before it
        swaps.finish()
        model.kt_resident_swaps = None
    placed = False
    for _, m in modules:
        routed = getattr(m, "kt_routed", None)
        if routed is not None:
            routed.layer.unpin()
            if getattr(m, "kt_gpu_expert_ids", None) is not None:
                drop_resident_experts(m)
            m.kt_routed = None
            placed = True
    if placed:
        model.kt_gpu_memory = None
        if getattr(model, "kt_decoder", None) is not None:
            model.kt_decoder = None


def _place_routed(model: nn.Module, named_modules: list, costs, gpu_memory, kernel: str,
                  expert_profile: Optional[ExpertsProfile] = None, reserve: Optional[int] = None) -> None:
    """The routing-aware split (``costs``: a SplitCosts, "auto" to measure, None: off) and the GPU memory budget."""
    from ktorch.gpu_memory import budget_bytes, place_resident_experts, plan_gpu_memory
    from ktorch.ops.routed_experts import DeviceStaging, RoutedExperts, SplitCosts, calibrate_split_costs
    from ktorch.ops.streamed_experts import StreamedExperts

    modules = [m for _, m in named_modules]
    embeddings = model.get_input_embeddings().weight
    device, dtype = embeddings.device, embeddings.dtype
    for m in modules:
        _check_device(m)
    layers = [StreamedExperts(m.kt_w13, m.kt_w13_scales, m.kt_w2, m.kt_w2_scales, m.kt_activation, kernel)
              for m in modules]
    E = layers[0].num_experts
    if costs is not None and device.type == "cuda":
        for layer in layers:  # any expert may be copied: page-lock all (in place for the large tensors)
            layer.pin_prefix(E)
    if costs == "auto":
        top_k = getattr(model.config, "num_experts_per_tok", None) or 8
        costs = calibrate_split_costs(layers, modules[0].kt_w2.shape[1] * 16, top_k, device)
    model.kt_split_costs = costs
    budget = budget_bytes(gpu_memory, model, device)  # None ("off"): a full staging, no residents
    staging_bytes = (lambda n: DeviceStaging.bytes_for(layers[0], n, dtype, device, kernel)) if costs is not None else None
    plan = plan_gpu_memory(model, modules, budget, device, dtype, staging_bytes, reserve,
                           getattr(modules[0], "kt_gpu_kernel", "auto"))
    staging = DeviceStaging(layers[0], plan.staging_experts, device, dtype, kernel) if costs is not None else None
    counting = SplitCosts(1.0, 0.0, 0.0, 0.0)  # split off: the layers only count routing (capacity 0)
    for (name, m), layer in zip(named_modules, layers):
        m.kt_routed = RoutedExperts(layer, costs if costs is not None else counting, staging, kernel=kernel)
        if plan.resident_per_layer:
            initial = None
            if expert_profile is not None and name in expert_profile.counts:
                initial = expert_profile.hottest(name, plan.resident_per_layer)
            place_resident_experts(m, plan.resident_per_layer, device, initial=initial)
            m.kt_residents_profiled = initial is not None  # else the warm-up's routing picks them (generation.py)
    model.kt_gpu_memory = plan


def _check_device(module: nn.Module) -> None:
    from ktorch.integrations.transformers_experts import device_experts_problem

    problem = device_experts_problem(module)
    if problem is not None:
        raise UnsupportedExpertsError(f"stream_experts/gpu_memory: {problem}")


def prefill_split_stats(model: nn.Module, reset: bool = False) -> dict:
    """What the routing-aware prefill split did since the last reset, summed over MoE layers: passes (layer calls
    that split), experts_hit, experts_copied, bytes_copied, copied_unused (experts copied that the batch did not use:
    0), rows, rows_copied, rows_resident, resident_hit; and ``last_hit``: distinct experts each layer's latest
    split call used. ``reset`` zeroes the counters after reading them."""
    import collections

    total: collections.Counter = collections.Counter()
    last = []
    for _, m in experts_modules(model):
        routed = getattr(m, "kt_routed", None)
        if routed is None:
            continue
        total.update(routed.stats)
        last.append(routed.last_hit)
        if reset:
            routed.stats.clear()
    out = {k: total.get(k, 0) for k in ("passes", "experts_hit", "experts_copied", "bytes_copied", "copied_unused",
                                         "rows", "rows_copied", "rows_resident", "resident_hit")}
    out["last_hit"] = last
    return out


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
        from ktorch.gpu_memory import parse_memory_size

        try:
            budget = parse_memory_size(gpu_experts)
        except ValueError:
            raise ValueError(f"prepare: gpu_experts memory budget {gpu_experts!r} is not like '4GiB' or '512MB'") from None
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
